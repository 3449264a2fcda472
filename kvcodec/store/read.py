"""The read path: sessions walked from their last chunk, chunks checked against their keys, and the exact
longest stored prefix of any token sequence (spec/store.md §4-§6).

Readers take no lock and write nothing but quarantine moves (of objects whose own bytes are bad).  A walk is
bounded by the session's declared count and by the objects that exist (each step reads a distinct object; a
key seen twice is a :class:`FormatError` at once).  A walk that meets a missing object while a collection
folds the session's chunks is retried once the fold has published its object.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from ..cache import KVCache, to_canonical
from ..errors import (
    ChecksumMismatch,
    ConfigError,
    FormatError,
    KvzError,
    NumericsMismatch,
    ObjectMissing,
    PredictorsRequired,
)
from ..identity import split_model
from ..tokens.continuation import CONTEXT_TOKENS
from .keys import (
    ROOT_PARENT,
    chain_key,
    chunk_key,
    chunk_path,
    common_length,
    entry_dir,
    entry_levels,
    is_hex64,
    numerics_path,
    is_reduced_rel,
    parse_entry_name,
    reduced_path,
    session_path,
    split_reduced_key,
    token_ids,
)
from .objects import MAX_BASE_DEPTH, SMALL_LIMIT, Objects, chunk_links

#: how match() restores a stored prefix: decode its chunks, recompute it with the model, or whichever this
#: machine does faster (both rates measured: decoding as chunks are read, the model's prefill once)
ROUTES = ("auto", "decode", "recompute")


@dataclass(frozen=True)
class Link:
    """A chunk object as a walk meets it: its parent, how many token ids it covers (a folded cold object:
    several chunks'), its base and how many ids come from it, and its first covered position."""
    parent: bytes
    count: int
    base: bytes | None
    m: int
    first: int


@dataclass(frozen=True)
class Hit:
    """A stored hot chunk under the query's parent that shares ``common`` ids with the query's window."""
    key: bytes
    common: int
    ids: np.ndarray  # every id of the chunk (a delta chunk's base's first)
    level: int  # the prefix length of the directory it was found in
    names: frozenset  # the token ids (as their names spell them) of that directory's entries


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Positions of one layer from several chunks, joined; chunks that disagree on anything but their length
    (a foreign or damaged object under a valid name) are a :class:`FormatError`, not a torch error."""
    t0 = tensors[0]
    for t in tensors[1:]:
        if t.dim() != 4 or t.shape[:2] != t0.shape[:2] or t.shape[3:] != t0.shape[3:] or t.dtype != t0.dtype:
            raise FormatError(f"the chunks of one session disagree on a layer's shape or dtype ({tuple(t0.shape)} "
                              f"{t0.dtype} vs {tuple(t.shape)} {t.dtype})", field="Chunk")
    return torch.cat(tensors, 2)


class ReadPath(Objects):
    # -- links and token ids -------------------------------------------------------------------------------
    def _link(self, ns: str, key: bytes, start: int, depth: int = 0, expect: int | None = None) -> Link:
        """The chunk at position ``start``, hot (its header) or cold, without decoding anything.  A model-coded
        cold object may cover the chunks before it too (folded, spec §4.2): given ``expect``, the chunk's own
        token count, its first covered position is ``start + expect - ids`` and the parent is that chunk's.
        :class:`ObjectMissing` when it has neither object; a placement its header contradicts is a
        :class:`FormatError` (not the chunk's fault alone: nothing is quarantined for it)."""
        if depth > MAX_BASE_DEPTH:
            raise FormatError(f"chunk {key.hex()[:16]}…: more than {MAX_BASE_DEPTH} bases", field="Header.info")
        try:
            hot = self._hot(ns, key)
        except KvzError:  # malformed: quarantined; its cold object may still serve
            hot = None
        size = self.record(ns)["chunk_tokens"]
        if hot is not None:
            if hot.start != start + hot.m:
                raise FormatError(f"chunk {key.hex()[:16]}… holds positions from {hot.start} ({hot.m} from a base), "
                                  f"its place here is {start}", field="Header.cache.start_position")
            return Link(hot.parent, hot.m + hot.ids.size, hot.base, hot.m, start)
        cold = self._cold(ns, key, max_tokens=start + (expect or size))
        if cold is None:
            raise self._missing(ns, key, ": the session's tokens are lost")
        if cold.kind == "ids":
            return Link(cold.parent, cold.n, None, 0, start)
        first = start if expect is None else start + expect - cold.n
        if first < 0 or first % size or first > start or (expect is None and cold.n > size):
            raise FormatError(f"cold chunk {key.hex()[:16]}… at position {start} covers {cold.n} tokens: they do "
                              f"not end with its {expect} (chunks of {size})", field="Cold.L")
        if not cold.m:
            return Link(cold.link, cold.n, None, 0, first)
        if cold.link == key:
            raise FormatError(f"cold chunk {key.hex()[:16]}… names itself as its base", field="Cold.Link")
        base = self._link(ns, cold.link, first, depth + 1)
        if base.count < cold.m:
            raise FormatError(f"cold chunk {key.hex()[:16]}…: its base holds {base.count} < {cold.m} tokens",
                              field="Cold.m")
        return Link(base.parent, cold.n, cold.link, cold.m, first)

    def _ids(self, ns: str, key: bytes, start: int, before: np.ndarray | None, model, depth: int = 0,
             count: int | None = None) -> np.ndarray:
        """Every token id of the chunk at ``start``: a hot chunk's from its header (a delta chunk's first ones
        from its base), a cold one's from its object - decoding a model-coded one with ``model`` after
        ``before`` (the ids before ``start``, at least the last 1,024; read from the parents when None)."""
        memo = self._ids_memo.get((ns, key, start))
        if memo is not None:
            return memo
        if depth > MAX_BASE_DEPTH:
            raise FormatError(f"chunk {key.hex()[:16]}…: more than {MAX_BASE_DEPTH} bases", field="Header.info")
        try:
            hot = self._hot(ns, key)
        except KvzError:
            hot = None
        cold = None
        if hot is not None:
            base, m, held = hot.base, hot.m, hot.ids
        else:
            size = self.record(ns)["chunk_tokens"]
            cold = self._cold(ns, key, max_tokens=start + (count or size))
            if cold is None:
                raise self._missing(ns, key)
            if cold.kind == "ids":
                return cold.ids  # checked against its key when parsed
            limit = size if count is None else count
            if cold.n > limit:  # a folded object is decoded only where a walk placed it (its count known)
                raise FormatError(f"cold chunk {key.hex()[:16]}… holds {cold.n} tokens, at most {limit} expected",
                                  field="Cold.L")
            base, m = (cold.link, cold.m) if cold.m else (None, 0)
        head = np.zeros(0, dtype=np.int64)
        if base is not None:
            if base == key:
                raise FormatError(f"chunk {key.hex()[:16]}… names itself as its base", field="Header.info.base")
            head = self._ids(ns, base, start, before, model, depth + 1)
            if head.size < m:
                raise FormatError(f"chunk {key.hex()[:16]}…: its base holds {head.size} < {m} tokens",
                                  field="Header.info")
            head = head[:m]
        if cold is None:
            return np.concatenate([head, held])
        # a model-coded cold chunk (spec §4.2)
        if model is None:
            raise ConfigError(f"chunk {key.hex()[:16]}… is cold and its token ids are coded with the model: pass "
                              "model= (or open the store with it)")
        mdl = split_model(model)[0]
        parent = cold.link if base is None else self._link(ns, base, start, depth + 1).parent
        if before is None:
            before = self._prefix_ids(ns, parent, start, model)
        self._check_numerics(ns, cold.profile, mdl)
        from ..tokens.continuation import decode_continuation

        context = np.concatenate([np.asarray(before, dtype=np.int64), head])[-CONTEXT_TOKENS:]
        ids = np.concatenate([head, decode_continuation(mdl, context, cold.words, cold.n - m)])
        if chain_key(bytes.fromhex(ns), parent, ids, self.record(ns)["chunk_tokens"]) != key:
            raise ChecksumMismatch(f"cold chunk {key.hex()[:16]}… decodes to token ids that are not its key's: the "
                                   "object is corrupt, or this machine computes the model's probabilities "
                                   "differently in a way its numerics profile does not name", field="Cold.Words")
        self._remember(ns, key, start, ids)
        return ids

    def _remember(self, ns: str, key: bytes, start: int, ids: np.ndarray) -> None:
        """Decoded ids are remembered (a key fixes them) up to 64 MiB, then forgotten all at once."""
        if sum(a.nbytes for a in self._ids_memo.values()) + ids.nbytes > 64 << 20:
            self._ids_memo.clear()
        self._ids_memo[ns, key, start] = ids

    def _prefix_ids(self, ns: str, parent: bytes, start: int, model, full: bool = False) -> np.ndarray:
        """The last 1,024 (or all) token ids before position ``start`` of the chunk whose parent is ``parent``:
        the parents (whole chunks, or folded cold objects covering several) walked back to position 0, then
        read (and decoded, where model-coded) forwards."""
        size = self.record(ns)["chunk_tokens"]
        chain, k, a, seen = [], parent, start - size, set()
        while k != ROOT_PARENT:
            if a < 0 or k in seen:
                raise FormatError(f"chunk {parent.hex()[:16]}…: more parents than positions", field="Chunk")
            seen.add(k)
            link = self._link(ns, k, a, expect=size)
            chain.append((k, link.first, link.count))
            k, a = link.parent, link.first - size
        if a != -size:
            raise FormatError(f"chunk {parent.hex()[:16]}…: fewer parents than positions", field="Chunk")
        tail, every = np.zeros(0, dtype=np.int64), []
        for k, first, n in reversed(chain):
            ids = self._ids(ns, k, first, tail, model, count=n)
            every.append(ids)
            tail = np.concatenate([tail, ids])[-CONTEXT_TOKENS:]
        return np.concatenate(every) if full and every else tail

    @staticmethod
    def _engine(mdl) -> tuple:
        """What a remembered numerics profile depends on besides the model object."""
        return id(mdl), torch.get_num_threads(), str(next(mdl.parameters()).device), \
            str(next(mdl.parameters()).dtype)

    def _check_numerics(self, ns: str, pid: bytes, mdl) -> None:
        """Refuse, before decoding, a model-coded cold chunk whose encoder's profile is not this engine's."""
        import json

        if self._profiles.get((ns, self._engine(mdl))) == pid or self._profiles.get((ns, pid, self._engine(mdl))):
            return
        from .. import numerics
        from ..tokens.continuation import PROCEDURE
        from ..tokens.plan import STEP_THREADS

        path = numerics_path(ns, pid)
        raw = self._read(path, SMALL_LIMIT)
        if raw is None:
            raise ObjectMissing(f"numerics profile {pid.hex()} of a cold chunk is not stored ({path})",
                                field="Numerics")
        try:
            import hashlib

            if hashlib.sha256(raw).digest()[:8] != pid:
                raise FormatError("a numerics profile object does not hash to its name", field="Numerics")
            rec = json.loads(raw)
            if not isinstance(rec, dict) or not isinstance(rec.get("numerics"), dict):
                raise FormatError("not a numerics profile object", field="Numerics")
        except (ValueError, RecursionError) as e:
            raise FormatError(f"corrupt numerics profile: {e}", field="Numerics") from None
        if rec.get("procedure") != PROCEDURE or rec.get("context_tokens") != CONTEXT_TOKENS:
            raise FormatError(f"cold chunks coded by procedure {rec.get('procedure')!r} with context "
                              f"{rec.get('context_tokens')!r}: this reader knows {PROCEDURE} with {CONTEXT_TOKENS}",
                              field="Numerics.procedure")
        recorded = rec["numerics"]
        if recorded.get("step_threads") != STEP_THREADS:
            raise FormatError(f"cold chunks coded with one-token calls on {recorded.get('step_threads')!r} threads: "
                              f"this reader runs them on {STEP_THREADS}", field="Numerics.step_threads")
        diffs = numerics.differences_here(recorded, mdl, step_threads=recorded.get("step_threads"))
        if diffs:
            raise NumericsMismatch(f"cold chunks of this store were coded by an engine with other numerics ("
                                   f"{'; '.join(diffs)}): {numerics.advice(diffs, tried=True)}")
        self._profiles[ns, pid, self._engine(mdl)] = True

    # -- sessions --------------------------------------------------------------------------------------------
    @staticmethod
    def _split_key(key: str) -> tuple[str, str]:
        ns, _, session = str(key).partition(":")
        if not (is_hex64(ns) and is_hex64(session)):
            raise ConfigError(f"not a session key: {key!r} (expected '<namespace>:<session>', 64 hex digits each)")
        return ns, session

    def _walk(self, ns: str, session: str, n: int) -> list[tuple[bytes, int, int]]:
        """(key, first covered position, ids covered) of each chunk object of a session, from the last chunk
        back to chunk 0 through their parent links (spec §6), then reversed.  Bounded: a key met twice or a
        chain longer than the declared count allows is a :class:`FormatError` at once."""
        size = self.record(ns)["chunk_tokens"]
        k, links, a, seen = bytes.fromhex(session), [], (n - 1) // size * size, set()
        while a >= 0:  # from the last chunk back: (key, first position, token ids) per object
            if k == ROOT_PARENT:
                raise FormatError(f"session {session[:16]}… declares {n} tokens; its chunks hold {n - a - size}",
                                  field="Session")
            if k in seen:
                raise FormatError(f"session {session[:16]}…: chunk {k.hex()[:16]}… is its own ancestor (a loop)",
                                  field="Chunk.parent")
            seen.add(k)
            expect = min(n, a + size) - a
            link = self._link(ns, k, a, expect=expect)
            if link.count != a + expect - link.first:
                raise FormatError(f"chunk {k.hex()[:16]}… of session {session[:16]}… holds {link.count} tokens, "
                                  f"the session's count ({n}) places {a + expect - link.first} there",
                                  field="Session")
            links.append((k, link.first, link.count))
            k, a = link.parent, link.first - size
        if k != ROOT_PARENT:
            raise FormatError(f"session {session[:16]}…: its first chunk has a parent", field="Chunk")
        links.reverse()
        return links

    def _manifest(self, key: str, model=None, ids: bool = True) -> tuple[str, dict]:
        """(namespace, {"num_tokens", "chain", "ids"}) of a session: its 12-byte object, then its chunks walked
        from the last to the first through their parent keys; then (``ids``) their token ids from the first to
        the last (a model-coded cold chunk is decoded after the tokens before it), each chunk's key
        recomputed from its parent and ids, so a misplaced or altered chunk is caught.  ``chain``: (key, ids)
        per chunk, or (key, first position, number of ids) per object without ``ids``."""
        ns, session = self._split_key(key)
        n = self._session_count(ns, session)
        for attempt in range(3):
            try:
                links = self._walk(ns, session, n)
                break
            except ObjectMissing:  # a collection folding these chunks publishes the folded object first:
                if attempt == 2:   # a walk that raced it finds that object when it looks again
                    raise
                time.sleep(0.05 * (attempt + 1))
        if not ids:
            return ns, {"num_tokens": n, "chain": links}
        recorded = self.record(ns).get("model") or {}
        if model is not None and "fingerprint" in recorded:
            from ..identity import check_model

            check_model(recorded, model)  # another model must not decode or recompute this session's positions
        size, nsb = self.record(ns)["chunk_tokens"], bytes.fromhex(ns)
        chain, tail, parent = [], np.zeros(0, dtype=np.int64), ROOT_PARENT
        for k, first, count in links:
            held = self._ids(ns, k, first, tail, model, count=count)
            keys = []
            for b in range(0, held.size, size):  # a folded cold object covers several chunks
                keys.append(chunk_key(nsb, keys[-1] if keys else parent, held[b:b + size]))
            if held.size != count or keys[-1] != k:
                self._ids_memo.pop((ns, k, first), None)
                err = FormatError(f"chunk {k.hex()[:16]}… of session {session[:16]}… holds other tokens than its "
                                  "key says", field="Chunk")
                self._blame(ns, k, err, tail, model)
                raise err
            chain += [(kk, held[b:b + size]) for kk, b in zip(keys, range(0, held.size, size))]
            tail = np.concatenate([tail, held])[-CONTEXT_TOKENS:]
            parent = k
        return ns, {"num_tokens": n, "ids": np.concatenate([h for _, h in chain]), "chain": chain}

    def _blame(self, ns: str, key: bytes, err: Exception, before=None, model=None) -> None:
        """A hot chunk whose own parent and ids do not hash to its name is quarantined (putting its session
        again rewrites it); one that cannot be proven bad here (its base unreadable, a model-coded cold object
        another engine may read) stays."""
        try:
            hot = self._hot(ns, key)
        except KvzError:
            return  # malformed: already quarantined
        if hot is not None and self._self_consistent(ns, key, hot, before, model) is False:
            self._quarantine(chunk_path(ns, key), err)

    def tokens(self, key: str, model=None) -> torch.Tensor:
        """A stored session's token ids ``[1, n]`` (``model``: this store's by default; needed only where
        cold chunks are coded with it)."""
        return torch.from_numpy(self._manifest(key, self.model if model is None else model)[1]["ids"])[None]

    def get(self, key: str, model=None, *, output: str = "dynamic"):
        """A whole stored session's cache (``output="kvcache"``: a :class:`KVCache` with its tokens, and
        ``stored_positions``: how many leading positions it read from the store - the rest were recomputed).

        A session whose chunks were evicted (``gc(max_bytes=)``) is **cold**: with a model (this store's or
        ``model=``) the missing positions are recomputed on top of the stored prefix - a valid cache of the
        session's tokens, equal to the original where the engine computes the same way; without one, the
        missing chunk raises :class:`~kvcodec.errors.ObjectMissing` (a ``FileNotFoundError``)."""
        model = self.model if model is None else model
        if output not in ("dynamic", "kvcache"):
            raise ConfigError(f"output must be 'dynamic' or 'kvcache', not {output!r}")
        if split_reduced_key(key) is not None:  # a reduced object (spec §6.1): its own file
            return self._get_reduced(key, model, output)
        ns, m = self._manifest(key, model)
        ids, parts, a = m["ids"], [], 0
        for k, held in m["chain"]:
            try:
                parts.append(self._load_chunk(ns, k, a, held.size, expect=held))
                a += held.size
            except (FileNotFoundError, KvzError) as e:
                if isinstance(e, PredictorsRequired):
                    raise
                if model is None:
                    if isinstance(e, FileNotFoundError):
                        raise ObjectMissing(f"{e} (evicted): pass model= to recompute it", field="Chunk") from None
                    raise
                parts.append(self._recompute(model, parts, ids, a))
                break
        kv = self._output(parts, "kvcache")
        if output == "dynamic":
            return kv.to_dynamic_cache()
        kv.tokens = torch.from_numpy(ids)[None]
        kv.stored_positions = a  # what came from the store (the rest: recomputed by the model)
        return kv

    def hot_tokens(self, key: str, model=None) -> int:
        """How many leading positions of a stored session are held hot (its chunks and their bases): what
        :meth:`get` returns without the model; the positions after them were evicted (cold) and are
        recomputed."""
        ns, m = self._manifest(key, self.model if model is None else model)
        n = 0
        for k, held in m["chain"]:
            got = self._hot_chain(ns, k, n)
            if got is None or got[0].size < held.size:
                break
            n += held.size
        return n

    def layers(self, key: str):
        """Yield ``(i, keys, values)`` of a stored session layer by layer: each chunk's file is opened once and
        only layer i's sections are read for layer i (range reads on object storage), so layer i is usable
        while later layers are still being read.  Every chunk must be hot (:meth:`get` recomputes cold ones)."""
        ns, m = self._manifest(key, self.model)
        plan, a = [], 0
        for k, held in m["chain"]:
            plan.append((k, a, held.size))
            a += held.size
        yield from self._stream(ns, plan, {})

    def sessions(self) -> list[str]:
        """Every stored session's key (names that are not a session object's are ignored)."""
        out = []
        for ns in self.namespaces():
            for rel, item in self.backend.walk(f"ns/{ns}/sessions"):
                name = item.name
                if item.kind == "file" and name.endswith(".kvs") and is_hex64(name[:-4]):
                    out.append(f"{ns}:{name[:-4]}")
        return sorted(out)

    def __iter__(self):
        return iter(self.sessions())

    def __contains__(self, key: str) -> bool:
        if (red := split_reduced_key(key)) is not None:
            return self._exists(reduced_path(*red))
        try:
            ns, session = self._split_key(key)
        except ConfigError:
            return False
        return self._exists(session_path(ns, session))

    def exists(self) -> bool:
        """Is there a store at this URL (its root, with a namespace directory)?"""
        return self.backend.root_exists() and self.backend.listdir("ns", limit=1) is not None

    # -- chunks ------------------------------------------------------------------------------------------------
    def _load_chunk(self, ns: str, key: bytes, start: int, m: int, *, expect: np.ndarray | None = None,
                    depth: int = 0, parent: bytes | None = None) -> KVCache:
        """The first ``m`` positions of a chunk, checked: its start and length, its token ids against
        ``expect`` where given (a chunk under another's name is caught even by a lookup that found it by its
        key), a delta chunk's first positions from its base.  :class:`ObjectMissing` when it is not hot; a
        chunk proven bad by its own bytes is quarantined and raises."""
        from ..file import KvzFile

        path = chunk_path(ns, key)

        def decode(fh):
            with KvzFile(fh) as f:
                self._attach_predictors(ns, f)
                return f.to_kvcache(), f.header.raw.get("info")

        try:
            got = self._read_file(path, decode)
            if got is None:
                raise ObjectMissing(f"chunk {key.hex()} is not stored hot", field="Chunk")
            kv, info = got
            base, bm, own_parent = chunk_links(info, key)
        except (PredictorsRequired, ObjectMissing):
            raise  # the chunk is intact (its namespace's predictors are not), or not there
        except KvzError as e:
            self._quarantine(path, e)
            raise
        if kv.start_position != start + bm or kv.seq_len + bm < m or depth > MAX_BASE_DEPTH or (
                parent is not None and own_parent != parent) or kv.tokens is None:
            raise FormatError(f"chunk {key.hex()[:16]}… holds positions {kv.start_position}.."
                              f"{kv.start_position + kv.seq_len} after {bm} of a base, expected {start}.."
                              f"{start + m}", field="Header.cache.start_position")
        own_ids = token_ids(kv.tokens)
        if expect is not None and not np.array_equal(own_ids[:max(0, m - bm)], expect[bm:m]):
            err = FormatError(f"chunk {key.hex()[:16]}… holds other token ids than the ones it was looked up by",
                              field="Chunk")
            self._blame(ns, key, err)
            raise err
        self.backend.touch(path)
        own = KVCache([k[:, :, :max(0, m - bm)] for k in kv.keys], [v[:, :, :max(0, m - bm)] for v in kv.values],
                      start_position=start + bm)
        if not bm:
            return own
        head = self._load_chunk(ns, base, start, min(m, bm), expect=None if expect is None else expect[:bm],
                                depth=depth + 1, parent=own_parent)
        if m <= bm:
            return head
        return self._output([head, own], "kvcache")

    @torch.no_grad()
    def _recompute(self, model, parts: list[KVCache], ids: np.ndarray, a: int) -> KVCache:
        """Positions ``a ..`` of a session, computed by the model on top of the stored ``parts`` (one call)."""
        from ..tokens.plan import cache_kwarg, output_cache

        mdl, _ = split_model(model)
        prefix = self._output(parts, "dynamic") if parts else None
        kw = {} if prefix is None else {cache_kwarg(mdl): prefix}
        out = mdl(torch.from_numpy(ids[a:])[None].to(next(mdl.parameters()).device), use_cache=True, **kw)
        full = to_canonical(output_cache(out))
        return KVCache([k[:, :, a:].cpu() for k in full.keys], [v[:, :, a:].cpu() for v in full.values],
                       start_position=a)

    @staticmethod
    def _output(parts: list[KVCache], output: str):
        if any(p.num_layers != parts[0].num_layers for p in parts):
            raise FormatError("the chunks of one session hold different numbers of layers", field="Chunk")
        kv = KVCache([_cat([p.keys[i] for p in parts]) for i in range(parts[0].num_layers)],
                     [_cat([p.values[i] for p in parts]) for i in range(parts[0].num_layers)])
        if output == "kvcache":
            return kv
        if output != "dynamic":
            raise ConfigError(f"output must be 'dynamic' or 'kvcache', not {output!r}")
        return kv.to_dynamic_cache()

    def _stream(self, ns: str, plan: list, files: dict):
        """Layer by layer over ``plan`` [(chunk key, first position, positions)]; closes ``files`` at the end."""
        try:
            first = self._chunk_file(ns, plan[0][0], files)[0]
            for i in range(len(first.header.layers)):
                parts = [self._chunk_layer(ns, k, start, n, i, files) for k, start, n in plan]
                yield i, _cat([p[0] for p in parts]), _cat([p[1] for p in parts])
        finally:
            self._close(files)

    @staticmethod
    def _close(files: dict) -> None:
        for f, fh, *_ in files.values():
            f.close()
            fh.close()
        files.clear()

    def _open_chain(self, ns: str, key: bytes, files: dict) -> None:
        """Open a hot chunk and its bases (headers only): ObjectMissing / KvzError if one is not hot."""
        k = key
        for _ in range(MAX_BASE_DEPTH + 1):
            k = self._chunk_file(ns, k, files)[2]
            if k is None:
                return
        raise FormatError(f"chunk {key.hex()[:16]}…: more than {MAX_BASE_DEPTH} bases", field="Header.info")

    def _chunk_file(self, ns: str, key: bytes, files: dict):
        """(KvzFile, file object, base key or None, base tokens) of a hot chunk, opened once per ``files``."""
        from ..file import KvzFile

        if key not in files:
            fh = self._open(chunk_path(ns, key))
            if fh is None:
                raise ObjectMissing(f"chunk {key.hex()} is not stored hot: get(key, model) recomputes it",
                                    field="Chunk")
            f = None
            try:
                f = KvzFile(fh)
                self._attach_predictors(ns, f)
                base, bm, _parent = chunk_links(f.header.raw.get("info"), key)
            except BaseException:
                if f is not None:
                    f.close()
                fh.close()
                raise
            files[key] = (f, fh, base, bm)
        return files[key]

    def _chunk_layer(self, ns: str, key: bytes, start: int, m: int, i: int, files: dict, depth: int = 0):
        """Layer ``i``'s keys and values for the first ``m`` positions of a chunk (a delta chunk's from its
        base first), from that layer's sections only."""
        f, _fh, base, bm = self._chunk_file(ns, key, files)
        if f.header.start_position != start + bm or depth > MAX_BASE_DEPTH:
            raise FormatError(f"chunk {key.hex()[:16]}… does not start at {start + bm}",
                              field="Header.cache.start_position")
        k, v = f.layer(i)
        own = max(0, m - bm)
        k, v = k[:, :, :own], v[:, :, :own]
        if not bm:
            return k, v
        hk, hv = self._chunk_layer(ns, base, start, min(m, bm), i, files, depth + 1)
        return (_cat([hk, k]), _cat([hv, v])) if own else (hk, hv)

    # -- the longest stored prefix ---------------------------------------------------------------------------
    def _has_entries(self, ns: str, directory: str, step: int) -> bool:
        """Does a prefix directory hold an entry?  (One short listing; junk names are not entries.)"""
        items = self.backend.listdir(directory, limit=4)
        if not items:
            return False
        if any(i.kind == "file" and parse_entry_name(i.name, step) for i in items):
            return True
        return any(i.kind == "file" and parse_entry_name(i.name, step)
                   for i in self.backend.listdir(directory) or [])

    def _candidates(self, ns: str, directory: str, step: int, window: np.ndarray) -> tuple[list, frozenset]:
        """The entries of a prefix directory, best first: (how many of the window's next ids its name carries
        the same, chunk key); and the token parts of their names."""
        out, names = [], set()
        for item in self.backend.listdir(directory) or []:
            parsed = parse_entry_name(item.name, step) if item.kind == "file" else None
            if parsed is not None:
                out.append((common_length(parsed[0], window), parsed[1]))
                names.add(item.name.partition(".")[0])
        out.sort(key=lambda c: -c[0])
        return out, frozenset(names)

    def _lookup(self, ns: str, parent: bytes, w: np.ndarray, start: int) -> Hit | None:
        """The stored hot chunk under ``parent`` (at position ``start``) that shares the most leading ids with
        ``w`` (at most a chunk's worth), exactly: a binary search for the deepest prefix directory that holds
        an entry (a live chunk's entries exist at every level below its length), then that directory's entries
        (their names carry the next ids), then the best candidate's own ids read and compared.  None when no
        stored chunk shares an id."""
        size, step = self._geometry(ns)
        if not step or not w.size:
            return None
        nsb = bytes.fromhex(ns)
        levels = list(entry_levels(w.size, size, step))
        lo, hi, best = 0, len(levels) - 1, -1
        while lo <= hi:
            mid = (lo + hi) // 2
            if self._has_entries(ns, entry_dir(ns, chunk_key(nsb, parent, w[:levels[mid]])), step):
                best, lo = mid, mid + 1
            else:
                hi = mid - 1
        while best >= 0:  # the deepest level first; one whose entries all name chunks gone meanwhile: shallower
            m = levels[best]
            directory = entry_dir(ns, chunk_key(nsb, parent, w[:m]))
            found, names = self._candidates(ns, directory, step, w[m:m + step])
            best_hit = None
            for same, key in found:  # the ones whose names share the most; of those, the longest common
                if best_hit is not None and same < best_hit[0]:  # prefix, then the shortest chain of bases
                    break
                got = self._hot_chain(ns, key, start)
                if got is None or got[2] != parent or not got[0].size:  # gone, or an entry naming a chunk
                    continue                                            # elsewhere: the entry's fault
                c = common_length(got[0], w)
                if c > m and (best_hit is None or (c, -len(got[1])) > (best_hit[1], -best_hit[2])):
                    best_hit = (same, c, len(got[1]), key, got[0])
            if best_hit is not None:
                return Hit(best_hit[3], best_hit[1], best_hit[4], m, names)
            best -= 1
        return None

    def match(self, tokens, model=None, *, dtype: torch.dtype | None = None, output: str = "dynamic"):
        """``(n, cache)``: the longest prefix ``tokens[:n]`` whose cache is stored hot, and that cache (None
        when n is 0), so the caller runs the model on ``tokens[n:]`` only.  Whole chunks are found by key, then
        the stored chunk that shares the most of the next chunk's ids, to the exact token (its prefix
        entries).  Every chunk used is checked against the ids it is used for.  A store without a model needs
        ``dtype=`` unless this object put a cache or the store holds one namespace of its configuration.  With
        a model, ``route`` decides how the prefix is restored (decoding its chunks, or recomputing it;
        ``"auto"``: whichever this machine measured faster - on a CPU, decoding).  ``output="layers"``: the
        cache as an iterator of ``(i, keys, values)``, layer i read (range reads of its sections only) while
        later layers are not yet fetched, as :meth:`layers`."""
        if output not in ("dynamic", "kvcache", "layers"):
            raise ConfigError(f"output must be 'dynamic', 'kvcache' or 'layers', not {output!r}")
        ids = token_ids(tokens)
        ns = self.namespace(model, dtype)
        plan = self._plan(ns, ids)
        total = sum(m for _, _, m in plan)
        if total and self._recompute_is_faster(model, plan):
            mdl = split_model(self.model if model is None else model)[0]
            kv = self._recompute(mdl, [], ids[:total], 0)
            if output == "layers":
                return total, ((i, k, v) for i, (k, v) in enumerate(zip(kv.keys, kv.values)))
            return total, self._output([kv], output)
        if output == "layers":  # every chunk of the prefix opened (headers: range reads), then layer by layer
            files, hot, n = {}, [], 0
            for key, a, m in plan:
                try:
                    self._open_chain(ns, key, files)
                    self._check_ids(ns, key, a, ids[a:a + m])
                except PredictorsRequired:
                    self._close(files)
                    raise  # the chunk is there: its namespace's predictors are not (spec §2)
                except (FileNotFoundError, KvzError):
                    break
                hot.append((key, n, m))
                n += m
            if not hot:
                self._close(files)
                return 0, None
            return n, self._stream(ns, hot, files)
        parts, n = [], 0
        t0, read = time.perf_counter(), 0
        for key, a, m in plan:
            try:
                got = self._load_chunk(ns, key, a, m, expect=ids[a:a + m])
            except PredictorsRequired:
                raise
            except (FileNotFoundError, KvzError):
                break
            parts.append(got)
            n += m
            read += got.nbytes()
        if read:
            self._rates["decode_bytes_per_s"] = read / max(time.perf_counter() - t0, 1e-9)
        if not n:
            return 0, None
        return n, self._output(parts, output)

    def _plan(self, ns: str, ids: np.ndarray) -> list[tuple[bytes, int, int]]:
        """The chunks that hold the longest stored prefix of ``ids``: (chunk key, first position, tokens used
        from it) - whole chunks found by key, then the stored chunk sharing the most of the next one's ids."""
        nsb, size = bytes.fromhex(ns), self.record(ns)["chunk_tokens"]
        plan = []
        parent, a = ROOT_PARENT, 0
        while a < ids.size:
            b = min(ids.size, a + size)
            key = chunk_key(nsb, parent, ids[a:b])
            if self._exists(chunk_path(ns, key)):
                plan.append((key, a, b - a))
                parent, a = key, b
                continue
            hit = self._lookup(ns, parent, ids[a:b], a)
            if hit is not None:
                plan.append((hit.key, a, hit.common))
            break
        return plan

    def lookup(self, tokens, model=None, *, dtype: torch.dtype | None = None) -> int:
        """How many leading tokens of ``tokens`` :meth:`match` would find stored, without reading a cache
        (a scheduler's question: chunks are found by key and by their prefix entries, nothing is decoded).
        A chunk can vanish or prove corrupt between this answer and a match: the match then returns less."""
        ids = token_ids(tokens)
        ns = self.namespace(model, dtype)
        return sum(m for _, _, m in self._plan(ns, ids))

    def _check_ids(self, ns: str, key: bytes, start: int, want: np.ndarray) -> None:
        """A chunk (with its bases) holds ``want`` as its first ids: else :class:`FormatError` (and the chunk is
        quarantined if its own bytes disagree with its name)."""
        held = self._ids(ns, key, start, None, None)
        if held.size < want.size or not np.array_equal(held[:want.size], want):
            err = FormatError(f"chunk {key.hex()[:16]}… holds other token ids than the ones it was looked up by",
                              field="Chunk")
            self._blame(ns, key, err)
            raise err

    def _recompute_is_faster(self, model, plan) -> bool:
        """The cost model of ``route="auto"``: recompute when the model's measured prefill (tokens/s, on a
        64-token probe, once) beats this store's measured decoding (bytes of cache/s) for this prefix."""
        model = self.model if model is None else model
        if self.route == "decode" or model is None:
            return False
        if self.route == "recompute":
            return True
        if "decode_bytes_per_s" not in self._rates:
            return False  # measured on the first decode
        mdl = split_model(model)[0]
        if "prefill_tokens_per_s" not in self._rates:
            ids = np.arange(64, dtype=np.int64) % max(2, int(mdl.config.vocab_size))
            t0 = time.perf_counter()
            probe = self._recompute(mdl, [], ids, 0)
            self._rates["prefill_tokens_per_s"] = 64 / max(time.perf_counter() - t0, 1e-9)
            self._rates["cache_bytes_per_token"] = probe.nbytes() / 64
        tokens = sum(m for _, _, m in plan)
        decode_s = tokens * self._rates["cache_bytes_per_token"] / self._rates["decode_bytes_per_s"]
        return tokens / self._rates["prefill_tokens_per_s"] < decode_s

    @property
    def rates(self) -> dict:
        """What ``route="auto"`` has measured on this machine: decoding (bytes of cache per second) and the
        model's prefill (tokens per second)."""
        return dict(self._rates)

    # -- counts ----------------------------------------------------------------------------------------------
    def usage(self) -> dict:
        """The store's metrics, per namespace (every session walked, nothing decoded): ``positions`` (sessions'
        positions, counted per session), ``stored_positions`` (positions held by hot chunks, each once),
        ``dedup_ratio`` (the first over the second), ``shared_share`` (of stored positions, the share held by
        chunks several sessions use), ``compression_ratio`` (raw bytes of the stored positions in the
        namespace's dtype against their chunks' bytes) and ``tail_bits`` (bits per component of the chunks only
        one session uses: what each session stores beyond shared prefixes).  Sessions that cannot be walked
        (damaged, collected meanwhile) are counted in ``unreadable``."""
        by_ns: dict[str, list[str]] = {}
        for key in self.sessions():  # listed once, grouped by namespace
            ns, session = key.split(":")
            by_ns.setdefault(ns, []).append(session)
        out = {}
        for ns in self.namespaces():
            refs: dict[bytes, int] = {}
            info: dict[bytes, tuple[int, int, bytes | None]] = {}  # hot key -> (own positions, bytes, its base)
            d = {"sessions": 0, "unreadable": 0, "positions": 0}
            comps = dsize = None
            for session in by_ns.get(ns, []):
                d["sessions"] += 1
                try:
                    n = self._session_count(ns, session)
                    chain = self._walk(ns, session, n)
                except (KeyError, KvzError, OSError):
                    d["unreadable"] += 1
                    continue
                d["positions"] += n
                used = set()
                for k, _first, _count in chain:
                    used.add(k)
                    if k not in info:
                        hot = self._hot(ns, k)
                        if hot is None:  # cold: its ids only, no positions stored
                            continue
                        item = self.backend.stat(chunk_path(ns, k))
                        info[k] = (int(hot.ids.size), item.size if item is not None else 0, hot.base)
                        if comps is None:
                            comps, dsize = self._components(ns, k)
                    if info[k][2] is not None:  # a delta chunk's first positions are its base's
                        used.add(info[k][2])
                for k in used:
                    refs[k] = refs.get(k, 0) + 1
            stored = sum(p for p, _, _ in info.values())
            nbytes = sum(b for _, b, _ in info.values())
            tail = [info[k] for k, r in refs.items() if r == 1 and k in info]
            tail_pos, tail_bytes = sum(p for p, _, _ in tail), sum(b for _, b, _ in tail)
            d.update(stored_positions=stored, chunk_bytes=nbytes,
                     dedup_ratio=round(d["positions"] / stored, 3) if stored else 0.0,
                     shared_share=round(sum(info[k][0] for k, r in refs.items() if r > 1 and k in info) / stored, 4)
                     if stored else 0.0,
                     compression_ratio=round(stored * comps * dsize / nbytes, 3) if nbytes and comps else 0.0,
                     tail_bits=round(8 * tail_bytes / (tail_pos * comps), 3) if tail_pos and comps else 0.0)
            out[ns] = d
        return out

    def _components(self, ns: str, key: bytes) -> tuple[int, int]:
        """(key and value components per position, bytes per component) of a namespace, from one chunk."""
        from ..file import KvzFile

        def header(fh):
            with KvzFile(fh) as f:
                return f.header
        h = self._read_file(chunk_path(ns, key), header)
        comps = sum(layer.kv_heads * (layer.k_dim + layer.v_dim) for layer in h.layers)
        return comps, torch.empty(0, dtype=getattr(torch, h.dtype)).element_size()

    def stats(self) -> dict:
        """Counts and bytes: sessions, hot chunks (keys and values), cold chunks (token ids only: evicted),
        prefix entries, reduced objects, quarantined objects, per namespace and in total."""
        out = {"url": self.backend.describe(), "namespaces": {}, "sessions": 0, "chunks": 0, "cold_chunks": 0,
               "entries": 0, "reduced": 0, "bytes": 0}
        for ns in self.namespaces():
            d = {"sessions": 0, "chunks": 0, "cold_chunks": 0, "entries": 0, "chunk_bytes": 0, "session_bytes": 0,
                 "reduced": 0, "reduced_bytes": 0}
            for sub, kind in (("chunks", "chunks"), ("entries", "entries"), ("sessions", "sessions"),
                              ("reduced", "reduced")):
                for rel, item in self.backend.walk(f"ns/{ns}/{sub}"):
                    if item.kind != "file" or item.name.startswith("."):
                        continue
                    if kind == "chunks":
                        d["cold_chunks" if item.name.endswith(".ids") else "chunks"] += 1
                        d["chunk_bytes"] += item.size
                    elif kind == "entries":
                        d["entries"] += 1
                    elif kind == "reduced":
                        if not is_reduced_rel(rel.split("/")[2:], item.name):
                            continue  # not a reduced object's name (spec §1): not counted
                        d["reduced"] += 1
                        d["reduced_bytes"] += item.size
                    else:
                        d["sessions"] += 1
                        d["session_bytes"] += item.size
            try:
                d["record"] = self.record(ns)
            except (KeyError, KvzError):
                d["record"] = None
            out["namespaces"][ns] = d
            for k in ("sessions", "chunks", "cold_chunks", "entries", "reduced"):
                out[k] += d[k]
            out["bytes"] += d["chunk_bytes"] + d["session_bytes"] + d["reduced_bytes"]
        out["quarantined"] = sum(1 for _ in self.backend.walk("quarantine"))
        return out
