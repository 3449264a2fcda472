"""A store's objects, read with bounds and checked for what they are (spec/store.md §2, §4, §6).

Every object kind has a reader here that (1) reads at most what such an object can legitimately hold (a
session object 12 bytes, a namespace record 64 KiB, a cold object what its token count allows, a chunk
through range reads bounded by its own header), (2) checks its form, and (3) says what is wrong with a
:class:`~kvcodec.errors.KvzError` naming the object.  An object is moved to ``quarantine/`` only when its
**own** bytes prove it bad (a malformed form, ids and parent that do not hash to its name); a disagreement
between two objects (a session's count and a chunk, an entry and the chunk it names) is reported without
moving a chunk other sessions may share.
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
from dataclasses import dataclass

import numpy as np
import zstandard

from ..errors import ConfigError, FormatError, KvzError, ObjectMissing, UnsafeObject, warn
from ..identity import model_record, split_model
from .keys import (
    FORMAT,
    VERSION,
    canonical,
    chunk_key,
    chunk_path,
    cold_path,
    is_hex64,
    namespace_path,
    predictors_path,
    session_path,
)

SESSION_MAGIC = b"KVZSES1\x00"  # a session object: this, then num_tokens (u32): 12 bytes
IDS_MAGIC = b"KVZIDS1\x00"  # a cold chunk: this, parent key (32), n (u32), one zstd frame of n u32 ids
LM_MAGIC = b"KVZL"  # a cold chunk whose ids are coded with the model (spec/store.md 4.2)
LM_HEAD = struct.Struct("<4s8sII32s")  # magic, numerics profile id, L, m (base tokens), parent or base key
MAX_BASE_DEPTH = 64  # delta chunks on delta chunks: a bound a hostile store cannot exceed
#: what a small object may hold at most (bytes)
SMALL_LIMIT = 1 << 16
#: a predictors file (kvz.md §13.1: 6.5 MB for SmolLM2; bounded so that a hostile one cannot exhaust memory)
PREDICTORS_LIMIT = 1 << 32


def cold_limit(tokens: int) -> int:
    """The most bytes a cold object of ``tokens`` ids can hold: a zstd frame never exceeds its input by more
    than its block headers, and a model-coded id costs at most 24 bits (spec §4.2), both within 4 bytes an
    id plus the heads."""
    return 128 + 5 * max(0, tokens)


@dataclass(frozen=True)
class Hot:
    """A hot chunk's header: its first position's tokens come from ``base`` (``m`` of them) when it is a
    delta chunk; ``ids`` are its own token ids, from position ``start``."""
    start: int
    base: bytes | None
    m: int
    ids: np.ndarray
    parent: bytes


@dataclass(frozen=True)
class Cold:
    """A cold object parsed: ``kind`` ``"ids"`` (zstd: ``parent``, ``ids``) or ``"lm"`` (``profile``, ``n``
    ids covered, ``m`` of them from the base ``link``, else ``link`` is the parent; ``words``)."""
    kind: str
    n: int
    parent: bytes | None = None
    ids: np.ndarray | None = None
    profile: bytes | None = None
    m: int = 0
    link: bytes | None = None
    words: np.ndarray | None = None


def chunk_links(info, key: bytes) -> tuple[bytes | None, int, bytes | None]:
    """(base key or None, base tokens, parent key or None) from a chunk's header ``info`` (spec §4);
    :class:`FormatError` when they are malformed."""
    info = info if isinstance(info, dict) else {}
    base, m, parent = info.get("base"), info.get("base_tokens"), info.get("parent")
    if base is None:
        m = 0
    elif not (is_hex64(base) and isinstance(m, int) and not isinstance(m, bool) and m > 0):
        raise FormatError(f"chunk {key.hex()[:16]}…: malformed base {base!r} / base_tokens {m!r}",
                          field="Header.info.base")
    if parent is not None and not is_hex64(parent):
        raise FormatError(f"chunk {key.hex()[:16]}…: malformed parent {parent!r}", field="Header.info.parent")
    return (None if base is None else bytes.fromhex(base)), m, (None if parent is None else bytes.fromhex(parent))


class Objects:
    """The object layer of a :class:`~kvcodec.store.Store` (a base class: the store's read, write and
    collection paths use these readers).  Set by the store: ``backend``, ``model``, ``model_id``, ``tier``,
    ``tier_options``, ``chunk_tokens``, ``granularity``, ``_encoder``."""

    # -- raw reads ---------------------------------------------------------------------------------------------
    def _read(self, rel: str, limit: int) -> bytes | None:
        """A plain object's bytes (None when absent); an object at this name that is not a plain file is moved
        to quarantine (never followed) and reads as absent."""
        try:
            return self.backend.read(rel, limit)
        except UnsafeObject as e:
            self._quarantine(rel, e)
            return None

    def _open(self, rel: str):
        try:
            return self.backend.open(rel)
        except UnsafeObject as e:
            self._quarantine(rel, e)
            return None

    def _read_file(self, rel: str, fn):
        """``fn(file object)`` on a plain object, or None when it is absent - also when it vanished while it
        was read (a collector removed it); read again when it was replaced while read (an object store's read
        is pinned to one version of the object: s3fs's FileExpired)."""
        for attempt in range(3):
            fh = self._open(rel)
            if fh is None:
                return None
            try:
                return fn(fh)
            except FileNotFoundError:
                return None
            except OSError as e:
                if type(e).__name__ != "FileExpired" or attempt == 2:
                    raise
            finally:
                fh.close()
        return None

    def _exists(self, rel: str) -> bool:
        st = self.backend.stat(rel)
        return st is not None and st.kind == "file"

    def _quarantine(self, rel: str, err: Exception) -> None:
        """Move an object whose own bytes are bad out of the way (it is never returned), with a warning."""
        dest = "quarantine/" + rel.replace("/", "_") + f".{int(time.time())}"
        try:
            self.backend.move(rel, dest)
        except (OSError, KvzError):  # gone meanwhile, or moved by another reader
            pass
        warn(f"kvcodec.Store: {rel} is corrupt ({err}); moved to quarantine/")

    # -- namespaces ----------------------------------------------------------------------------------------------
    def namespace(self, model=None, dtype=None) -> str:
        """The namespace id (64 hex digits) of this store's configuration for ``model`` (default: the
        store's) and ``dtype``; its record is published on first use.  Without a model or ``dtype``: the dtype
        this object last put, else the only namespace of this store's model id and configuration."""
        model = self.model if model is None else model
        if model is None and self.model_id is None:
            raise ConfigError("a store without a model needs model_id= (a name for the model its caches come from): "
                              "caches of two models must never share a namespace")
        if dtype is None:
            if model is not None:
                dtype = next(split_model(model)[0].parameters()).dtype
            else:
                dtype = self._default_dtype()
        record = self._record_for(model, dtype)
        data = canonical(record)
        ns = hashlib.sha256(data).hexdigest()
        if ns not in self._namespaces:
            path = namespace_path(ns)
            if self._read(path, SMALL_LIMIT) != data:
                self.backend.write(path, data)
            self._namespaces[ns] = record
        return ns

    def _record_for(self, model, dtype) -> dict:
        rec = model_record(model)
        ident = {"id": self.model_id} if rec is None else {k: rec[k] for k in ("fingerprint", "tokenizer") if k in rec}
        return {"format": FORMAT + "-namespace", "version": VERSION, "model": ident,
                "dtype": str(dtype).replace("torch.", ""), "tier": self.tier, "options": self._encoder_options(),
                "chunk_tokens": self.chunk_tokens, "granularity": self.granularity}

    def _default_dtype(self):
        """A model-less store's dtype when none is given: the last put's, else the only namespace on the store
        whose record is this configuration's for some dtype."""
        import torch

        if self._last_dtype is not None:
            return self._last_dtype
        found = []
        for ns in self.namespaces():
            try:
                rec = self.record(ns)
            except (KeyError, KvzError):
                continue
            dt = getattr(torch, str(rec.get("dtype")), None)
            if isinstance(dt, torch.dtype) and rec == self._record_for(None, dt):
                found.append(dt)
        if len(found) == 1:
            return found[0]
        which = f"it holds {', '.join(sorted(str(d) for d in found))}" if found else "it holds none"
        raise ConfigError("a store without a model needs the cache (put) or dtype= to name its namespace "
                          f"({which} for model_id={self.model_id!r} and this configuration)")

    def record(self, ns: str) -> dict:
        """A namespace's record (``namespace.json``, checked against its id): what its sessions were written
        with - ``chunk_tokens`` and ``granularity`` included - whatever this Store object was opened with."""
        if ns not in self._namespaces:
            path = namespace_path(ns)
            raw = self._read(path, SMALL_LIMIT)
            if raw is None:
                raise KeyError(f"namespace {ns}")
            try:
                if hashlib.sha256(raw).hexdigest() != ns:
                    raise FormatError("namespace.json does not hash to its namespace id", field="Namespace")
                rec = json.loads(raw)
                if not isinstance(rec, dict) or rec.get("format") != FORMAT + "-namespace" \
                        or rec.get("version") != VERSION or not (
                        isinstance(rec.get("chunk_tokens"), int) and 1 <= rec["chunk_tokens"] <= 1 << 20
                        and isinstance(rec.get("granularity"), int)
                        and 0 <= rec["granularity"] < rec["chunk_tokens"]):
                    raise FormatError("not a kvz-store namespace record of this version", field="Namespace.format")
            except (ValueError, RecursionError, FormatError) as e:
                err = e if isinstance(e, FormatError) else FormatError(f"corrupt namespace record: {e}",
                                                                       field="Namespace")
                self._quarantine(path, err)
                raise err from None
            self._namespaces[ns] = rec
        return self._namespaces[ns]

    def _geometry(self, ns: str) -> tuple[int, int]:
        """(chunk tokens, the step of its prefix entries: 0 for none, or for a granularity whose entry names
        would exceed the names' bound) of a namespace."""
        from .keys import MAX_GRANULARITY

        rec = self.record(ns)
        g = rec["granularity"]
        return rec["chunk_tokens"], (g if g <= MAX_GRANULARITY else 0)

    def _encoder_options(self) -> dict:
        """The options as the namespace record names them: a calibration profile by the SHA-256 of its JSON,
        predictors by their identity (the SHA-256 of their file, which the namespace keeps)."""
        out = {}
        for k in sorted(self.tier_options):
            v = self.tier_options[k]
            if k == "profile" and v is not None:
                v = hashlib.sha256(v.to_json().encode()).hexdigest()
            elif k == "predictors" and v is not None:
                v = v.identity
            out[k] = v
        return out

    def namespaces(self) -> list[str]:
        """The namespace ids present (listed fresh: other processes write too)."""
        items = self.backend.listdir("ns") or []
        return sorted(i.name for i in items if i.kind == "dir" and is_hex64(i.name))

    # -- predictors ------------------------------------------------------------------------------------------
    def _publish_predictors(self, ns: str) -> None:
        """The namespace's predictors, written once beside its record: its chunks decode with them."""
        pred = self.tier_options.get("predictors")
        if pred is None:
            return
        path = predictors_path(ns, pred.identity)
        if not self._exists(path):
            self.backend.write(path, pred.to_bytes(), create=True)

    def predictors(self, ns: str, ident: str):
        """The predictors ``ident`` (SHA-256) of namespace ``ns``, read once from ``ns/<N>/predictors/``
        (:class:`~kvcodec.errors.PredictorsRequired` when they are missing or damaged: the chunk that names
        them is intact, and stays)."""
        from ..errors import PredictorsRequired
        from ..predict import from_bytes

        own = self.tier_options.get("predictors")
        if own is not None and own.identity == ident:
            return own  # this store's own: no need to read them back
        if ident not in self._predictors:
            if not is_hex64(ident):
                raise FormatError(f"predictors {ident!r} is not a SHA-256", field="Header.predict.predictors")
            path = predictors_path(ns, ident)
            raw = self._read(path, PREDICTORS_LIMIT)
            if raw is None:
                raise PredictorsRequired(f"namespace {ns[:16]}…: its chunks need the predictors {ident}, and "
                                         f"{path} is missing")
            try:
                pred = from_bytes(raw)  # its identity is the SHA-256 of raw
                if pred.identity != ident:
                    raise FormatError("the predictors do not hash to their name", field="Predictors")
            except KvzError as e:
                self._quarantine(path, e)
                raise PredictorsRequired(f"namespace {ns[:16]}…: its predictors {ident} were damaged ({e}); "
                                         "moved to quarantine/") from None
            self._predictors[ident] = pred
        return self._predictors[ident]

    def _attach_predictors(self, ns: str, f) -> None:
        """A predicted lossy chunk (format 1.6) decodes with its namespace's predictors."""
        if f.header.predict is not None:
            f.predictors = self.predictors(ns, f.header.predict["predictors"])

    # -- sessions --------------------------------------------------------------------------------------------
    def _session_count(self, ns: str, session: str) -> int:
        """A session object's token count; KeyError when absent; a malformed one is quarantined
        (:class:`FormatError`)."""
        path = session_path(ns, session)
        try:
            raw = self._read(path, 12)
        except KvzError as e:  # longer than a session object: malformed
            raw = b"!"
            err = e
        else:
            err = None
        if raw is None:
            raise KeyError(f"{ns}:{session}")
        if len(raw) != 12 or raw[:8] != SESSION_MAGIC or not int.from_bytes(raw[8:], "little"):
            err = FormatError(f"session {session[:16]}…: not a kvz-store session object of this version"
                              + (f" ({err})" if err else ""), field="Session")
            self._quarantine(path, err)
            raise err
        return int.from_bytes(raw[8:], "little")

    # -- chunks --------------------------------------------------------------------------------------------
    def _hot(self, ns: str, key: bytes) -> Hot | None:
        """A hot chunk's header, read from its header and tokens section only (range reads); None when it has
        no hot object.  One whose own header is malformed (not a .kvz, no token ids, batch > 1, bad links) is
        quarantined and raises."""
        from ..file import KvzFile

        memo = self._headers
        if memo is not None and (ns, key) in memo:
            return memo[ns, key]
        path = chunk_path(ns, key)

        def header(fh):
            with KvzFile(fh) as f:
                return f.header, f.tokens()

        try:
            got = self._read_file(path, header)
            if got is None:
                return None
            h, ids = got
            base, m, parent = chunk_links(h.raw.get("info"), key)
            held = ids[0].numpy().astype(np.int64) if ids is not None else None
            if held is None or h.batch != 1 or parent is None or h.start_position < m or held.size == 0:
                raise FormatError(f"chunk {key.hex()[:16]}… is not a store chunk (token ids "
                                  f"{'stored' if held is not None else 'missing'}, batch {h.batch}, start "
                                  f"{h.start_position}, {m} from a base, parent {parent is not None})",
                                  field="Header.info")
        except KvzError as e:
            self._quarantine(path, e)
            raise
        out = Hot(h.start_position, base, m, held, parent)
        if memo is not None:
            memo[ns, key] = out
        return out

    def _cold(self, ns: str, key: bytes, max_tokens: int | None = None) -> Cold | None:
        """A chunk's cold object parsed (spec §4.1, §4.2), or None when absent; a malformed one is quarantined
        and raises :class:`FormatError`.  ``max_tokens``: the most ids a walk allows it to cover (a folded
        object covers several chunks); its size is bounded by what that many ids take."""
        size = self.record(ns)["chunk_tokens"]
        limit_tokens = max(size, max_tokens or 0)
        path = cold_path(ns, key)
        try:
            raw = self._read(path, cold_limit(limit_tokens))
        except KvzError as e:
            self._quarantine(path, e)
            raise
        if raw is None:
            return None
        try:
            if raw[:4] == LM_MAGIC:
                if len(raw) < LM_HEAD.size or (len(raw) - LM_HEAD.size) % 4:
                    raise FormatError(f"model-coded cold chunk of {len(raw)} bytes (a 52-byte head, then whole "
                                      "words)", field="Cold")
                _magic, pid, n, m, link = LM_HEAD.unpack_from(raw)
                if not 1 <= n or m >= n or m >= size or len(raw) == LM_HEAD.size:  # n > C: folded (4.2)
                    raise FormatError(f"model-coded cold chunk: {n} tokens, {m} from a base, "
                                      f"{len(raw) - LM_HEAD.size} bytes of code (chunks of {size})", field="Cold.L")
                return Cold("lm", n, profile=pid, m=m, link=link,
                            words=np.frombuffer(raw, dtype="<u4", offset=LM_HEAD.size))
            if len(raw) < 44 or raw[:8] != IDS_MAGIC:
                raise FormatError("not a cold chunk object", field="Ids")
            n = int.from_bytes(raw[40:44], "little")
            frame = raw[44:]
            if not 1 <= n <= size or zstandard.get_frame_parameters(frame).content_size != 4 * n:
                raise FormatError("cold chunk: token count and frame disagree", field="Ids")
            ids = np.frombuffer(zstandard.ZstdDecompressor().decompress(frame, max_output_size=4 * n,
                                                                        allow_extra_data=False), dtype="<u4")
            ids = ids.astype(np.int64)
            parent = raw[8:40]
            if chunk_key(bytes.fromhex(ns), parent, ids) != key:  # its own bytes disagree with its name
                raise FormatError(f"cold chunk {key.hex()[:16]}…: its parent and token ids are not its key's",
                                  field="Ids")
        except (FormatError, zstandard.ZstdError) as e:
            err = e if isinstance(e, FormatError) else FormatError(f"cold chunk: {e}", field="Ids")
            self._quarantine(path, err)
            raise err from None
        return Cold("ids", n, parent=parent, ids=ids)

    def _self_consistent(self, ns: str, key: bytes, hot: Hot, before=None, model=None) -> bool | None:
        """Do a hot chunk's own parent and token ids (a delta chunk's base's first) hash to its name?  None
        when that cannot be told (its base is unreadable here)."""
        ids = hot.ids
        if hot.base is not None:
            try:
                head = self._ids(ns, hot.base, hot.start - hot.m, before, model)
            except (KvzError, ConfigError, FileNotFoundError):
                return None
            if head.size < hot.m:
                return None
            ids = np.concatenate([head[:hot.m], ids])
        return chunk_key(bytes.fromhex(ns), hot.parent, ids) == key

    def _missing(self, ns: str, key: bytes, what: str = "") -> ObjectMissing:
        return ObjectMissing(f"chunk {key.hex()} is not stored (hot or cold){what}", field="Chunk")

    def _hot_chain(self, ns: str, key: bytes, start: int) -> tuple[np.ndarray, list[bytes], bytes] | None:
        """(every id, the chain's keys - the chunk's first, then its bases -, its parent) of a hot chunk at
        position ``start`` whose bases are all hot, of its parent and in place, from their headers alone; None
        when one is not hot or the chain is not a chain (a loop, another parent, more than 64 bases)."""
        chain, k, seen = [], key, set()
        parent = None
        while k is not None:
            if k in seen or len(chain) > MAX_BASE_DEPTH:
                return None
            seen.add(k)
            try:
                hot = self._hot(ns, k)
            except KvzError:
                return None
            if hot is None or hot.start != start + hot.m or (parent is not None and hot.parent != parent):
                return None
            parent = hot.parent
            chain.append((k, hot))
            k = hot.base
        ids = chain[-1][1].ids
        for _k, hot in reversed(chain[:-1]):
            if ids.size < hot.m:
                return None
            ids = np.concatenate([ids[:hot.m], hot.ids])
        return ids, [k for k, _ in chain], parent
