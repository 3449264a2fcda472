"""The write path: ``put`` (spec/store.md §4-§7, steps P1-P5).

P1  read the collection lease (its epoch);
P2  for each chunk: reuse it when its hot object (and every base's) is there and holds its ids; else write
    it - a delta chunk on the stored chunk that shares the most of its ids, or whole - then its prefix
    entries (in ascending order, only where no entry with its next ids exists);
P3  publish the session object;
P4  **settle**: for every collection that overlapped P1-P3, read its record; objects this session needs that
    it condemned are checked once that collection has ended, and what it removed is written again (from the
    cache being put); repeated until a round writes nothing;
P5  return the key: the put is acknowledged.

Why that is enough (spec §7.4): a collection deletes only what it condemned and its second listing of the
sessions did not reach.  A collection whose second listing came after P3 saw this session; one whose second
listing came before P3 published its condemned set before that listing, so P4 - after P3 - reads it.
"""

from __future__ import annotations

import numpy as np
import torch

from ..cache import KVCache, to_canonical
from ..errors import ConfigError, UnsupportedCache
from ..identity import split_model
from .keys import (
    ROOT_PARENT,
    VERSION,
    chunk_key,
    chunk_path,
    common_length,
    entry_dir,
    entry_levels,
    entry_name,
    session_path,
    token_ids,
)
from .lease import KEEP_RECORDS, read_record, read_state, wait_finished
from .objects import MAX_BASE_DEPTH, SESSION_MAGIC
from .reduced import ReducedObjects


class Needs:
    """What an acknowledged session needs, by object path: its chunks' hot objects, their bases', and the
    prefix entries its chunks' lookups rely on (named by directory and token ids: any chunk's entry serves)."""

    def __init__(self):
        self.chunks: dict[int, tuple[bytes, int, bytes]] = {}  # start -> (key, end, parent)
        self.paths: dict[str, tuple] = {}  # object path (entries: directory/tokens) -> ("chunk"|"base"|"entry", start)

    def chunk(self, ns: str, start: int, end: int, key: bytes, parent: bytes, bases: list[bytes]) -> None:
        self.chunks[start] = (key, end, parent)
        self.paths[chunk_path(ns, key)] = ("chunk", start)
        for b in bases:
            self.paths.setdefault(chunk_path(ns, b), ("base", start))

    def entry(self, directory: str, tokens: str, start: int) -> None:
        self.paths[f"{directory}/{tokens}"] = ("entry", start)

    def hits(self, condemned: dict) -> set[tuple]:
        out = set()
        for path in condemned:
            what = self.paths.get(path)
            if what is None and "/entries/" in path:
                what = self.paths.get(path.rpartition(".")[0])
            if what is not None:
                out.add(what)
        return out


class WritePath(ReducedObjects):
    #: how long a put waits for a collection that condemned an object it needs to end (seconds)
    settle_timeout = 600.0

    @property
    def settle_stats(self) -> dict:
        """What this object's puts did to settle (write.py, P4): collection records read, waits for a
        collection that condemned what a put needed, chunks and entries written again."""
        if "_settle_stats" not in self.__dict__:
            self._settle_stats = {"records_read": 0, "waits": 0, "chunks_rewritten": 0, "entries_rewritten": 0}
        return self._settle_stats

    @property
    def put_stats(self) -> dict:
        """What this object's puts wrote: chunks reused (already stored) and written, and the bytes written."""
        if "_put_stats" not in self.__dict__:
            self._put_stats = {"chunks_reused": 0, "chunks_written": 0, "bytes_written": 0}
        return self._put_stats

    def put(self, cache, model=None, tokens=None, progress=None) -> str:
        """Store one session's cache (batch 1) and return its key.  ``tokens`` (1-D or ``[1, n]``): the ids of
        the positions the cache holds; else recovered from the cache with the model, as :func:`encode` does.
        Chunks already stored (by this or any other session) are not written again.  When this returns, the
        session is stored whatever collections ran meanwhile (module docstring).

        A reduced cache (:func:`kvcodec.reduce`) is stored as its own object (spec §6.1), keyed by the full
        token sequence it stands for - ``tokens`` is then required - and returns ``<N>:<s>:<r>``:
        :meth:`get` reads it back, :meth:`reductions` lists them, :meth:`delete` removes it."""
        model = self.model if model is None else model
        kv = to_canonical(cache)
        if kv.reduce is not None:
            return self._put_reduced(kv, model, tokens)
        n = self._check_storable(kv)
        ids = self._session_tokens(kv, model, tokens, n)
        ns = self.namespace(model, kv.dtype)
        self._last_dtype = kv.dtype
        self._publish_predictors(ns)  # before any chunk that names them (and again if a reader quarantined them)
        state = read_state(self.backend)  # P1
        need = Needs()
        nsb, size = bytes.fromhex(ns), self.record(ns)["chunk_tokens"]
        parent = ROOT_PARENT
        for a in range(0, n, size):  # P2
            b = min(n, a + size)
            key = self._put_chunk(ns, nsb, kv, ids, a, b, parent, need)
            parent = key
            if progress:
                progress(b - a)
        session = parent.hex()
        self.backend.write(session_path(ns, session), SESSION_MAGIC + int(n).to_bytes(4, "little"))  # P3
        self._settle(ns, need, state, kv, ids)  # P4
        return f"{ns}:{session}"

    def _put_chunk(self, ns: str, nsb: bytes, kv: KVCache, ids: np.ndarray, a: int, b: int, parent: bytes,
                   need: Needs, *, whole: bool = False) -> bytes:
        """Chunk [a, b) of a session: reused when stored hot and whole of its ids (with every base), else
        written (a delta chunk where a stored chunk shares its first ids, unless ``whole``); its entries."""
        w = ids[a:b]
        key = chunk_key(nsb, parent, w)
        got = None if whole else self._hot_chain(ns, key, a)
        if got is not None and got[2] == parent and np.array_equal(got[0], w):
            need.chunk(ns, a, b, key, parent, got[1][1:])
            self.backend.touch(chunk_path(ns, key))  # used now: what eviction orders by
            self._entries(ns, nsb, parent, w, key, a, need, reused=True)
            self.put_stats["chunks_reused"] += 1
            return key
        hit = None if whole else self._lookup(ns, parent, w, a)
        m, bases = 0, []
        if hit is not None and hit.key != key:
            m = min(hit.common, b - a - 1)
            chain = self._hot_chain(ns, hit.key, a)
            if m <= 0 or chain is None or key in chain[1] or len(chain[1]) >= MAX_BASE_DEPTH:
                m = 0
            else:
                bases = chain[1]
        info = {"kvcodec_store": VERSION, "parent": parent.hex()}
        if m > 0:
            info.update(base=hit.key.hex(), base_tokens=int(m))
        part = KVCache([k[:, :, a + m:b] for k in kv.keys], [v[:, :, a + m:b] for v in kv.values],
                       torch.from_numpy(ids[a + m:b])[None], start_position=a + m)
        data = self._encoder.encode(part, info=info)
        # an object already at the name that is not a usable copy (malformed: quarantined; on an evicted
        # base; cold only) is replaced; else a writer that published it meanwhile is kept
        present = self._exists(chunk_path(ns, key))
        wrote = self.backend.write(chunk_path(ns, key), data, create=not present and not whole)
        if not wrote and self._hot_chain(ns, key, a) is None:
            self.backend.write(chunk_path(ns, key), data)
            wrote = True
        if wrote:
            self.put_stats["chunks_written"] += 1
            self.put_stats["bytes_written"] += len(data)
        need.chunk(ns, a, b, key, parent, bases)
        self._entries(ns, nsb, parent, w, key, a, need, hit=hit)
        return key

    def _entries(self, ns: str, nsb: bytes, parent: bytes, w: np.ndarray, key: bytes, start: int, need: Needs, *,
                 hit=None, reused: bool = False, force: bool = False) -> int:
        """A chunk's prefix entries (spec §5), in ascending order of their prefix length, so that whoever
        sees a chunk's entry at one level finds an entry with the same ids at every level below.  Levels a
        lookup's hit proves covered (it shares those ids and the next step's) are relied on, not written;
        a reused chunk's are checked at its last level only."""
        size, step = self._geometry(ns)
        levels = list(entry_levels(w.size, size, step))
        if not levels:
            return 0
        covered = 0 if hit is None or force else hit.common  # levels m with m + step <= covered are covered
        if reused and not force:
            last = levels[-1]
            name = entry_name(w[last:last + step], key).partition(".")[0]
            d = entry_dir(ns, chunk_key(nsb, parent, w[:last]))
            present = {i.name.partition(".")[0] for i in self.backend.listdir(d) or [] if i.kind == "file"}
            if name in present:
                covered = w.size + step  # established by whoever wrote it; the collector keeps them so
        created = 0
        for m in levels:
            d = entry_dir(ns, chunk_key(nsb, parent, w[:m]))
            following = w[m:m + step]
            tokens = "".join(f"{int(t):08x}" for t in following)
            need.entry(d, tokens, start)
            if m + step <= covered:
                continue
            if hit is not None and not force and m == hit.level and tokens in hit.names:
                continue
            created += self.backend.write(f"{d}/{entry_name(following, key)}", b"", create=True)
        return created

    # -- P4 ----------------------------------------------------------------------------------------------------
    def _settle(self, ns: str, need: Needs, state, kv: KVCache, ids: np.ndarray) -> None:
        """Make sure no collection that overlapped this put removed what the session needs (module
        docstring): read each overlapping collection's record; wait for one that condemned a needed object
        to end; write again what is gone.  Repeated until a round writes nothing."""
        first = state.epoch if state.active else state.epoch + 1
        while True:
            now = read_state(self.backend)
            if now.epoch < first:
                return
            hits, undecided = set(), []
            for e in range(first, now.epoch + 1):
                self.settle_stats["records_read"] += 1
                rec = read_record(self.backend, e)
                if rec is None:
                    if e <= now.epoch - KEEP_RECORDS:  # pruned: a put longer than that many collections
                        hits |= set(need.paths.values())
                    else:  # not written yet (or its collector died before deciding anything)
                        undecided.append(e)
                    continue
                if rec.status == "mark":
                    undecided.append(e)
                    continue
                mine = need.hits(rec.condemned)
                if mine and rec.status == "sweep":
                    self.settle_stats["waits"] += 1
                    wait_finished(self.backend, e, self.lease_seconds, self.settle_timeout)
                hits |= mine
            if not self._repair(ns, need, hits, kv, ids):
                return
            # what this round wrote was written after the collections it read ended; ones still deciding
            # then (and later ones) may have seen the session while it lacked what was just written back
            first = min(undecided) if undecided else now.epoch + 1

    def _repair(self, ns: str, need: Needs, hits: set, kv: KVCache, ids: np.ndarray) -> bool:
        """Write again what a collection removed: a chunk whose hot object, or a base's, is gone is written
        whole from the cache; entries are written again.  Whether anything was written."""
        if not hits:
            return False
        nsb = bytes.fromhex(ns)
        wrote = False
        for start in sorted({s for kind, s in hits if kind in ("chunk", "base")}):
            key, end, parent = need.chunks[start]
            got = self._hot_chain(ns, key, start)
            if got is None or not np.array_equal(got[0], ids[start:end]):
                self._put_chunk(ns, nsb, kv, ids, start, end, parent, Needs(), whole=True)
                self.settle_stats["chunks_rewritten"] += 1
                wrote = True
        for start in sorted({s for kind, s in hits if kind == "entry"}):
            key, end, parent = need.chunks[start]
            created = self._entries(ns, nsb, parent, ids[start:end], key, start, Needs(), force=True)
            self.settle_stats["entries_rewritten"] += created
            wrote = wrote or created > 0
        return wrote

    # -- what a store keeps ------------------------------------------------------------------------------------
    def _check_storable(self, kv: KVCache) -> int:
        if kv.batch != 1:
            raise UnsupportedCache(f"a store keeps one session per put: batch {kv.batch} (put each row)")
        if kv.has_state:
            raise UnsupportedCache("layers with recurrent / conv state or indexer keys have no per-token slices "
                                   "to share between sessions: save() such a cache as one .kvz file")
        n = kv.seq_len
        if n == 0:
            raise ConfigError("an empty cache is not a session")
        if kv.start_position != 0 or any(k.shape[2] != n or c != n for k, c in zip(kv.keys, kv.cumulative_length)):
            raise UnsupportedCache("a store chunks caches by position from 0: this cache does not start at 0 or a "
                                   "sliding-window layer dropped tokens (save() it as one .kvz file)")
        return n

    def _session_tokens(self, kv: KVCache, model, tokens, n: int) -> np.ndarray:
        if tokens is not None and kv.tokens is not None and not np.array_equal(token_ids(tokens),
                                                                               token_ids(kv.tokens)):
            raise ConfigError("tokens= differs from the token ids the cache carries")
        if tokens is None and kv.tokens is not None:
            tokens = kv.tokens
        if tokens is None:
            if model is None:
                raise ConfigError("put() needs tokens= or a model to recover them from the cache")
            from ..tokens.recover import recover

            rec = recover(kv, split_model(model)[0])
            if not rec.ok:
                raise ConfigError(f"put(): the cache's tokens could not be recovered ({rec.reason}); pass tokens=")
            tokens = rec.tokens
        ids = token_ids(tokens)
        if ids.size != n:
            raise ConfigError(f"{ids.size} token ids for a cache of {n} positions")
        return ids

    # -- the reuse loop ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, tokens, model=None, **generate_kwargs):
        """Persisted agent memory in one call: the longest stored prefix of ``tokens`` is restored, the model
        runs on the rest and generates (``generate_kwargs`` go to ``model.generate``), and the whole session
        - prompt and answer - is stored.  Returns ``(output ids [1, n + new], session key, tokens reused)``."""
        from ..tokens.plan import cache_kwarg, output_cache

        model = self.model if model is None else model
        if model is None:
            raise ConfigError("Store.generate needs a model")
        mdl, _ = split_model(model)
        ids = torch.from_numpy(token_ids(tokens))[None].to(next(mdl.parameters()).device)
        n, cache = self.match(ids[:, :-1], model)  # generate() must feed at least the last prompt token
        from transformers.cache_utils import DynamicCache

        cache = DynamicCache(config=mdl.config) if cache is None else cache
        out = mdl.generate(ids, **{cache_kwarg(mdl): cache}, return_dict_in_generate=True, **generate_kwargs)
        seq = out.sequences
        cache = output_cache(out)
        held = to_canonical(cache).seq_len
        key = self.put(cache, model, tokens=seq[:, :held])
        return seq, key, n


__all__ = ["Needs", "WritePath", "common_length"]
