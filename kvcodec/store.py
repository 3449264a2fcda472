"""``kvcodec.Store``: many caches on a local directory or object storage, each shared prefix stored once.

A store keeps **sessions** (a token sequence and its cache) as content-addressed **chunks** of
``chunk_tokens`` positions (default 256), so sessions that share a prefix - a system prompt, tool schemas,
a conversation that branches - share its chunks.  Layout and bytes: ``spec/store.md``.

* A chunk's key is a chained SHA-256 over (namespace, parent chunk's key, its token ids as u32 LE): equal
  keys mean equal token prefixes, in every process and on every machine.  The **namespace** binds the model
  fingerprint, tokenizer, dtype, tier and codec options and the chunk size: two models, dtypes or
  configurations never share a chunk.  It is stored once (``namespace.json``), not in every chunk.
* A chunk object is a ``.kvz`` file (tier ``lossless`` by default, or ``lossy``) of the chunk's keys,
  values and token ids, ``start_position`` = its first position, linked to its parent chunk.  Inside every
  chunk, **prefix pointers** every ``granularity`` tokens (default 16) let :meth:`Store.match` and
  :meth:`Store.put` find a chunk that starts the same way; a new chunk that does is stored as a **delta
  chunk** (only the positions after the exact common prefix, naming its base), so a shared prefix is stored
  once to the token.
* A session is a 12-byte object named by its last chunk's key, written after its chunks: a reader never
  sees a session whose chunks are not all published; its tokens and chunks are found through the parents.
* A byte budget (``gc(max_bytes=)``) evicts least recently used chunks to **cold** objects (token ids and
  parent only): their sessions keep their tokens, and :meth:`Store.get` recomputes their tensors with the
  model.

Safety: every object is published atomically (temporary file, fsync, rename on a local file system; one
PUT on object storage), and content addressing makes concurrent writers of the same chunk write the same
thing for the same tokens, so any interleaving leaves a valid store.  No index file: everything is found
by key or by listing.  A corrupt object raises a named :class:`~kvcodec.errors.KvzError` from
:meth:`get`, is moved to ``quarantine/`` and is never returned; :meth:`match` treats it as a miss.
:meth:`gc` removes chunks no session references and the debris of interrupted writers, once they are
older than ``grace_seconds`` (so it never races a writer that is still publishing).

Limits (refused with :class:`~kvcodec.errors.UnsupportedCache`): batch 1 per session; caches that start at
position 0 and whose every layer holds every token (sliding windows that dropped tokens and recurrent state
have no per-token slices to share).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time

import numpy as np
import torch
import zstandard

from .cache import KVCache, to_canonical
from .errors import (
    ChecksumMismatch,
    ConfigError,
    FormatError,
    KvzError,
    NumericsMismatch,
    PredictorsRequired,
    UnsupportedCache,
    warn,
)
from .identity import model_record, split_model
from .tokens.continuation import CONTEXT_TOKENS

__all__ = ["Store", "chunk_key", "token_ids"]

FORMAT = "kvz-store"
VERSION = 1
CHUNK_MAGIC = b"kvcodec-store-chunk-v1\x00"
ROOT_PARENT = bytes(32)
POINTER_BYTES = 36  # chunk key (32) + u32 LE token count
SESSION_MAGIC = b"KVZSES1\x00"  # a session object: this, then num_tokens (u32): 12 bytes
IDS_MAGIC = b"KVZIDS1\x00"  # a cold chunk: this, parent key (32), n (u32), one zstd frame of n u32 ids
LM_MAGIC = b"KVZL"  # a cold chunk whose ids are coded with the model (spec/store.md 4.2)
_LM_HEAD = struct.Struct("<4s8sII32s")  # magic, numerics profile id, L, m (base tokens), parent or base key
MAX_BASE_DEPTH = 64  # delta chunks on delta chunks: a bound a hostile store cannot exceed
#: tiers a store keeps chunks in (the direct tiers: restoring a chunk needs no model)
CHUNK_TIERS = ("lossless", "lossy")
#: how match() restores a stored prefix: decode its chunks, recompute it with the model, or whichever this
#: machine does faster (both rates measured: decoding as chunks are read, the model's prefill once)
ROUTES = ("auto", "decode", "recompute")


def token_ids(tokens) -> np.ndarray:
    """Token ids as a 1-D int64 array, from a sequence, a 1-D tensor or a ``[1, n]`` tensor (as tokenizers
    return them)."""
    t = tokens.detach().cpu().numpy() if isinstance(tokens, torch.Tensor) else np.asarray(tokens)
    if t.ndim == 2 and t.shape[0] == 1:
        t = t[0]
    if t.ndim != 1:
        raise ConfigError(f"tokens must be a 1-D sequence or a [1, n] tensor, not shape {tuple(t.shape)}")
    if t.size and (not np.issubdtype(t.dtype, np.integer) or t.min() < 0 or t.max() >= 1 << 32):
        raise ConfigError("token ids must be integers in [0, 2**32)")
    return t.astype(np.int64)


def chunk_key(namespace: bytes, parent: bytes, ids: np.ndarray) -> bytes:
    """SHA-256 of ``CHUNK_MAGIC ‖ namespace id (32 bytes) ‖ parent key (32 bytes) ‖ ids as u32 LE``."""
    return hashlib.sha256(CHUNK_MAGIC + namespace + parent + ids.astype("<u4").tobytes()).digest()


def _hex64(x) -> bool:
    return isinstance(x, str) and len(x) == 64 and all(c in "0123456789abcdef" for c in x)


def _chunk_links(info, key: bytes) -> tuple[bytes | None, int, bytes | None]:
    """(base key or None, base tokens, parent key or None) from a chunk's header ``info`` (spec/store.md 4);
    :class:`FormatError` when they are malformed."""
    info = info if isinstance(info, dict) else {}
    base, m, parent = info.get("base"), info.get("base_tokens"), info.get("parent")
    if base is None:
        m = 0
    elif not (_hex64(base) and isinstance(m, int) and not isinstance(m, bool) and m > 0):
        raise FormatError(f"chunk {key.hex()[:16]}…: malformed base {base!r} / base_tokens {m!r}",
                          field="Header.info.base")
    if parent is not None and not _hex64(parent):
        raise FormatError(f"chunk {key.hex()[:16]}…: malformed parent {parent!r}", field="Header.info.parent")
    return (None if base is None else bytes.fromhex(base)), m, (None if parent is None else bytes.fromhex(parent))


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Positions of one layer from several chunks, joined; chunks that disagree on anything but their length
    (a foreign or damaged object under a valid name) are a :class:`FormatError`, not a torch error."""
    t0 = tensors[0]
    for t in tensors[1:]:
        if t.dim() != 4 or t.shape[:2] != t0.shape[:2] or t.shape[3:] != t0.shape[3:] or t.dtype != t0.dtype:
            raise FormatError(f"the chunks of one session disagree on a layer's shape or dtype ({tuple(t0.shape)} "
                              f"{t0.dtype} vs {tuple(t.shape)} {t.dtype})", field="Chunk")
    return torch.cat(tensors, 2)


def _pointer_lengths(n: int, chunk_tokens: int, granularity: int) -> range:
    """The prefix lengths of a chunk of ``n`` tokens that get a pointer: every multiple of ``granularity`` up
    to n (a whole chunk of ``chunk_tokens`` is found by its own key instead); none for granularity 0."""
    if not granularity:
        return range(0)
    return range(granularity, min(n, chunk_tokens - 1) + 1, granularity)


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


class Store:
    """Sessions of one model (or of none) under ``url``: a local path, ``file://``, ``s3://bucket/prefix`` or
    any fsspec URL (``storage_options`` go to fsspec; the AWS environment variables work as for any fsspec
    user).

    >>> # store = kvcodec.Store("s3://bucket/memory", model)
    >>> # n, cache = store.match(ids)        # the longest stored prefix of ids, and its cache
    >>> # key = store.put(cache, tokens=ids) # after running the model on ids[n:]

    ``tier`` (``"lossless"`` or ``"lossy"``) and ``**tier_options`` are how chunks are coded (as
    :func:`kvcodec.encode`); they are part of the namespace.
    """

    def __init__(self, url, model=None, storage_options: dict | None = None, *, chunk_tokens: int = 256,
                 granularity: int | None = None, tier: str = "lossless", grace_seconds: float = 3600.0,
                 route: str = "auto", model_id: str | None = None, **tier_options):
        import fsspec

        if route not in ROUTES:
            raise ConfigError(f"route must be one of {ROUTES}, not {route!r}")
        self.route, self._rates, self.model_id = route, {}, model_id
        if tier not in CHUNK_TIERS:
            raise ConfigError(f"a store keeps chunks in tier {CHUNK_TIERS}, not {tier!r} (the token tiers are "
                              "a session's own business: save() them)")
        if granularity is None:  # 16 tokens, or half a chunk for small chunks
            granularity = 16 if chunk_tokens > 16 else chunk_tokens // 2
        if not 1 <= chunk_tokens <= 1 << 20 or not 0 <= granularity < chunk_tokens:
            raise ConfigError("chunk_tokens must be in [1, 2**20] and granularity in [0, chunk_tokens)")
        url = os.fspath(url)
        self.fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        self.root = root.rstrip("/")
        self.model = model
        self.chunk_tokens, self.granularity, self.grace_seconds = chunk_tokens, granularity, grace_seconds
        self.tier, self.tier_options = tier, dict(tier_options)
        if tier_options.get("predictors") is not None:  # kept once per namespace (ns/<N>/predictors/)
            from .predict import as_predictors

            self.tier_options["predictors"] = as_predictors(tier_options["predictors"])
        if tier_options.get("profile") is not None:
            from .calibrate import Profile

            if not isinstance(tier_options["profile"], Profile):
                raise ConfigError("profile= takes a kvcodec.Profile (kvcodec.calibrate)")
        self._predictors: dict[str, object] = {}  # SHA-256 -> Predictors read from a namespace
        self._local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))
        from .api import Encoder

        self._encoder = Encoder(tier=tier, chunk_tokens=chunk_tokens, **tier_options)
        self._namespaces: dict[str, dict] = {}
        # content addressing makes this safe to remember: a chunk key fixes its token ids
        self._ids_memo: dict[tuple[str, bytes], np.ndarray] = {}
        self._profiles: dict = {}
        self._headers: dict | None = None  # chunk headers, remembered during one gc (which reads each 3 times)

    # -- paths and objects --------------------------------------------------------------------------------
    def _path(self, *parts: str) -> str:
        return "/".join((self.root, *parts))

    def _ns_dir(self, ns: str) -> str:
        return self._path("ns", ns)

    def _chunk_path(self, ns: str, key: bytes) -> str:
        h = key.hex()
        return self._path("ns", ns, "chunks", h[:2], h + ".kvz")

    def _pointer_path(self, ns: str, key: bytes) -> str:
        h = key.hex()
        return self._path("ns", ns, "prefix", h[:2], h)

    def _session_path(self, ns: str, key: str) -> str:
        return self._path("ns", ns, "sessions", key[:2], key + ".kvs")

    def _ids_path(self, ns: str, key: bytes) -> str:
        h = key.hex()
        return self._path("ns", ns, "chunks", h[:2], h + ".ids")

    def _numerics_path(self, ns: str, pid: bytes) -> str:
        return self._path("ns", ns, "numerics", pid.hex() + ".json")

    def _predictors_path(self, ns: str, ident: str) -> str:
        return self._path("ns", ns, "predictors", ident + ".safetensors")

    def _write(self, path: str, data: bytes, overwrite: bool = True) -> None:
        """Publish ``data`` at ``path`` atomically (local: unique temp file, fsync, rename; else one PUT).
        ``overwrite=False``: a chunk another writer published meanwhile is kept (locally: a hard link that
        fails if the name exists; object stores have no such test through fsspec: the last PUT stays)."""
        if self._local:
            from .atomic import atomic_output

            os.makedirs(os.path.dirname(path), exist_ok=True)
            try:
                with atomic_output(path, overwrite=overwrite) as f:
                    f.write(data)
            except (FileExistsError, ConfigError):
                if overwrite:
                    raise
        else:
            self.fs.pipe_file(path, data)

    def _bases(self, ns: str, key: bytes, start: int, expect: int | None = None):
        """The keys of a chunk's bases, nearest first (hot delta chunks and model-coded cold ones name a base;
        at most MAX_BASE_DEPTH).  ``expect``: the chunk's own token count where it may be a folded cold
        object (spec/store.md 4.2), whose base sits at its first covered position."""
        try:
            _parent, _n, k, _m, first = self._link(ns, key, start, expect=expect)
        except (FileNotFoundError, KvzError, ConfigError):
            return
        for _ in range(MAX_BASE_DEPTH):
            if k is None:
                return
            yield k
            try:
                k = self._link(ns, k, first)[2]
            except (FileNotFoundError, KvzError, ConfigError):
                return

    def _refresh(self, ns: str, key: bytes, start: int) -> None:
        """A chunk (and its bases) reused by a put: make it young, so that a gc whose snapshot predates the
        put does not collect it (local file systems; object stores cannot touch an object cheaply)."""
        for k in (key, *self._bases(ns, key, start)):
            self._touch(self._chunk_path(ns, k))

    def _usable_base(self, ns: str, base: bytes, key: bytes, parent: bytes, start: int) -> bool:
        """Can a new chunk ``key`` be a delta on ``base``: another chunk of the same parent, whose bases are all
        hot, none of them ``key`` (no cycle), fewer than MAX_BASE_DEPTH - 1 of them (readers refuse longer
        chains)?  Its chain is touched (see :meth:`_refresh`)."""
        k = base
        for _ in range(MAX_BASE_DEPTH - 1):
            if k == key:
                return False
            try:
                _first, nxt, _m, _held, par = self._chunk_header(ns, k, start)
            except (FileNotFoundError, KvzError):
                return False
            if par != parent:
                return False
            self._touch(self._chunk_path(ns, k))
            if nxt is None:
                return True
            k = nxt
        return False

    def _read(self, path: str) -> bytes | None:
        try:
            return self.fs.cat_file(path)
        except FileNotFoundError:
            return None

    def _touch(self, path: str) -> None:
        """Mark a chunk as used now (its modification time: what ``gc(max_bytes=)`` evicts by).  Local file
        systems only: object stores have no cheap way to update a time, so there eviction is by age."""
        if self._local:
            try:
                os.utime(path)
            except OSError:
                pass

    def _exists(self, path: str) -> bool:
        """Is ``path`` there now?  (Object-store clients cache listings; another process may have written or
        collected the object since: the cached answer is dropped first.)"""
        if not self._local:
            self.fs.invalidate_cache(path)
        try:
            return bool(self.fs.exists(path))
        except FileNotFoundError:
            return False

    def _quarantine(self, path: str, err: Exception) -> None:
        """Move a corrupt object out of the way (it is never returned), with a warning naming it."""
        rel = path[len(self.root) + 1:] if path.startswith(self.root + "/") else os.path.basename(path)
        dest = self._path("quarantine", rel.replace("/", "_") + f".{int(time.time())}")
        try:
            if self._local:
                os.makedirs(os.path.dirname(dest), exist_ok=True)
            self.fs.mv(path, dest)
        except OSError:  # gone meanwhile, or moved by another reader
            pass
        warn(f"kvcodec.Store: {rel} is corrupt ({err}); moved to quarantine/")

    # -- namespaces ---------------------------------------------------------------------------------------
    def namespace(self, model=None, dtype: torch.dtype | None = None) -> str:
        """The namespace id (64 hex digits) of this store's configuration for ``model`` (default: the
        store's) and ``dtype`` (default: the model's); its record is published on first use."""
        model = self.model if model is None else model
        if model is None and self.model_id is None:
            raise ConfigError("a store without a model needs model_id= (a name for the model its caches come from): "
                              "caches of two models must never share a namespace")
        if dtype is None:
            if model is None:
                raise ConfigError("a store without a model needs the cache (put) or dtype= to name its namespace")
            dtype = next(split_model(model)[0].parameters()).dtype
        rec = model_record(model)
        ident = {"id": self.model_id} if rec is None else {k: rec[k] for k in ("fingerprint", "tokenizer") if k in rec}
        record = {"format": FORMAT + "-namespace", "version": VERSION, "model": ident,
                  "dtype": str(dtype).replace("torch.", ""), "tier": self.tier,
                  "options": self._encoder_options(), "chunk_tokens": self.chunk_tokens,
                  "granularity": self.granularity}
        data = _canonical(record)
        ns = hashlib.sha256(data).hexdigest()
        if ns not in self._namespaces:
            path = self._path("ns", ns, "namespace.json")
            if self._read(path) != data:
                self._write(path, data)
            self._namespaces[ns] = record
        return ns

    def record(self, ns: str) -> dict:
        """A namespace's record (``namespace.json``, checked against its id): what its sessions were written
        with - ``chunk_tokens`` and ``granularity`` included - whatever this Store object was opened with."""
        if ns not in self._namespaces:
            path = self._path("ns", ns, "namespace.json")
            raw = self._read(path)
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

    def _publish_predictors(self, ns: str) -> None:
        """The namespace's predictors, written once beside its record: its chunks decode with them."""
        pred = self.tier_options.get("predictors")
        if pred is None:
            return
        path = self._predictors_path(ns, pred.identity)
        if not self._exists(path):
            self._write(path, pred.to_bytes(), overwrite=False)

    def predictors(self, ns: str, ident: str):
        """The predictors ``ident`` (SHA-256) of namespace ``ns``, read once from ``ns/<N>/predictors/``
        (:class:`~kvcodec.errors.PredictorsRequired` when they are missing or damaged: the chunk that names
        them is intact, and stays)."""
        from .errors import PredictorsRequired
        from .predict import from_bytes

        own = self.tier_options.get("predictors")
        if own is not None and own.identity == ident:
            return own  # this store's own: no need to read them back
        if ident not in self._predictors:
            if not _hex64(ident):
                raise FormatError(f"predictors {ident!r} is not a SHA-256", field="Header.predict.predictors")
            path = self._predictors_path(ns, ident)
            raw = self._read(path)
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

    def namespaces(self) -> list[str]:
        """The namespace ids present (listed fresh: other processes write too)."""
        self.fs.invalidate_cache()
        try:
            names = (os.path.basename(p.rstrip("/")) for p in self.fs.ls(self._path("ns"), detail=False))
        except FileNotFoundError:
            return []
        return sorted(n for n in names if _hex64(n))

    # -- put ----------------------------------------------------------------------------------------------
    def put(self, cache, model=None, tokens=None, progress=None) -> str:
        """Store one session's cache (batch 1) and return its key.  ``tokens`` (1-D or ``[1, n]``): the ids of
        the positions the cache holds; else recovered from the cache with the model, as :func:`encode` does.
        Chunks already stored (by this or any other session) are not written again."""
        model = self.model if model is None else model
        kv = to_canonical(cache)
        n = self._check_storable(kv)
        ids = self._session_tokens(kv, model, tokens, n)
        ns = self.namespace(model, kv.dtype)
        self._publish_predictors(ns)  # before any chunk that names them (and again if a reader quarantined them)
        nsb = bytes.fromhex(ns)
        parent = ROOT_PARENT
        for a in range(0, n, self.chunk_tokens):
            b = min(n, a + self.chunk_tokens)
            key = chunk_key(nsb, parent, ids[a:b])
            path = self._chunk_path(ns, key)
            if self._exists(path):
                self._refresh(ns, key, a)  # reused: younger than any gc's grace from now on
            else:
                # a stored chunk under the same parent that starts with the same tokens (a prefix pointer, then
                # its token ids for the exact common length): store only what follows, as a delta chunk - on a
                # base that is another chunk, whose chain of bases is hot, acyclic and short
                base, m = self._common_prefix(ns, nsb, parent, ids[a:b], a)
                m = min(m, b - a - 1)
                if m > 0 and not self._usable_base(ns, base, key, parent, a):
                    m = 0
                info = {"kvcodec_store": VERSION, "parent": parent.hex()}
                if m > 0:
                    info.update(base=base.hex(), base_tokens=int(m))
                part = KVCache([k[:, :, a + m:b] for k in kv.keys], [v[:, :, a + m:b] for v in kv.values],
                               torch.from_numpy(ids[a + m:b])[None], start_position=a + m)
                self._write(path, self._encoder.encode(part, info=info), overwrite=False)
            for m in _pointer_lengths(b - a, self.chunk_tokens, self.granularity):
                pointer = self._pointer_path(ns, chunk_key(nsb, parent, ids[a:a + m]))
                old = self._read(pointer)
                # another chunk with the same first m tokens may own it; re-point it if that one was collected
                if old is None or len(old) != POINTER_BYTES or not self._exists(self._chunk_path(ns, old[:32])):
                    self._write(pointer, key + int(m).to_bytes(4, "little"))
            parent = key
            if progress:
                progress(b - a)
        session = parent.hex()
        marker = SESSION_MAGIC + int(n).to_bytes(4, "little")  # the chunks hold the tokens and link to parents
        path = self._session_path(ns, session)
        if self._read(path) != marker:
            self._write(path, marker)
        return f"{ns}:{session}"

    def _check_storable(self, kv: KVCache) -> int:
        if kv.batch != 1:
            raise UnsupportedCache(f"a store keeps one session per put: batch {kv.batch} (put each row)")
        if kv.reduce is not None:
            raise UnsupportedCache("a reduced cache holds atoms, not token positions: the store cannot chunk or "
                                   "share it. save() it as one .kvz (tier lossless or lossy), or put() the full "
                                   "cache and kvcodec.reduce() what get() / match() return")
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
            from .tokens.recover import recover

            rec = recover(kv, split_model(model)[0])
            if not rec.ok:
                raise ConfigError(f"put(): the cache's tokens could not be recovered ({rec.reason}); pass tokens=")
            tokens = rec.tokens
        ids = token_ids(tokens)
        if ids.size != n:
            raise ConfigError(f"{ids.size} token ids for a cache of {n} positions")
        return ids

    # -- match / get --------------------------------------------------------------------------------------
    def match(self, tokens, model=None, *, dtype: torch.dtype | None = None, output: str = "dynamic"):
        """``(n, cache)``: the longest prefix ``tokens[:n]`` whose cache is stored, and that cache (None when
        n is 0), so the caller runs the model on ``tokens[n:]`` only.  Whole chunks are found by key, the
        rest to ``granularity`` tokens inside the next chunk, then to the exact token.  A store without a model
        needs ``dtype=``.  With a model, ``route`` decides how the prefix is restored (decoding its chunks, or
        recomputing it; ``"auto"``: whichever this machine measured faster - on a CPU, decoding).
        ``output="layers"``: the cache as an iterator of ``(i, keys, values)``, layer i read (range reads of
        its sections only) while later layers are not yet fetched, as :meth:`layers` (every chunk's header is
        read before ``n`` is returned; a section found corrupt later raises its :class:`KvzError` from the
        iterator)."""
        ids = token_ids(tokens)
        ns = self.namespace(model, dtype)
        nsb = bytes.fromhex(ns)
        plan = []  # (chunk key, tokens used from it)
        parent, a = ROOT_PARENT, 0
        while a < ids.size:
            b = min(ids.size, a + self.chunk_tokens)
            key = chunk_key(nsb, parent, ids[a:b])
            if self._exists(self._chunk_path(ns, key)):
                plan.append((key, b - a))
                parent, a = key, b
                continue
            base, m = self._common_prefix(ns, nsb, parent, ids[a:b], a)
            if m:
                plan.append((base, m))
            break
        total = sum(m for _, m in plan)
        if output not in ("dynamic", "kvcache", "layers"):
            raise ConfigError(f"output must be 'dynamic', 'kvcache' or 'layers', not {output!r}")
        if total and self._recompute_is_faster(model, ns, plan):
            mdl = split_model(self.model if model is None else model)[0]
            kv = self._recompute(mdl, [], ids[:total], 0)
            if output == "layers":
                return total, ((i, k, v) for i, (k, v) in enumerate(zip(kv.keys, kv.values)))
            return total, self._output([kv], output)
        if output == "layers":  # every chunk of the prefix opened (headers: range reads), then layer by layer
            files, hot, n = {}, [], 0
            for key, m in plan:
                try:
                    self._open_chain(ns, key, files)
                except PredictorsRequired:
                    self._close(files)
                    raise  # the chunk is there: its namespace's predictors are not (spec/store.md 2)
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
        for key, m in plan:
            got = self._load_chunk(ns, key, n, m, strict=False)
            if got is None:
                break
            parts.append(got)
            n += m
            read += got.nbytes()
        if read:
            self._rates["decode_bytes_per_s"] = read / max(time.perf_counter() - t0, 1e-9)
        if not n:
            return 0, None
        return n, self._output(parts, output)

    def _recompute_is_faster(self, model, ns: str, plan) -> bool:
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
        tokens = sum(m for _, m in plan)
        decode_s = tokens * self._rates["cache_bytes_per_token"] / self._rates["decode_bytes_per_s"]
        return tokens / self._rates["prefill_tokens_per_s"] < decode_s

    @property
    def rates(self) -> dict:
        """What ``route="auto"`` has measured on this machine: decoding (bytes of cache per second) and the
        model's prefill (tokens per second)."""
        return dict(self._rates)

    def _longest_pointer(self, ns: str, nsb: bytes, parent: bytes, ids: np.ndarray):
        """(chunk key, m) for the largest multiple m of ``granularity`` with a pointer, or None.  Pointers of a
        stored chunk exist for every multiple below its length, so the hits are a prefix: binary search."""
        if not self.granularity:
            return None
        lo, hi, best = 1, min(ids.size, self.chunk_tokens - 1) // self.granularity, None  # m = k * granularity
        while lo <= hi:
            k = (lo + hi) // 2
            m = k * self.granularity
            raw = self._read(self._pointer_path(ns, chunk_key(nsb, parent, ids[:m])))
            if raw is not None and len(raw) == POINTER_BYTES and int.from_bytes(raw[32:], "little") == m:
                best, lo = (raw[:32], m), k + 1
            else:
                hi = k - 1
        return best

    def _common_prefix(self, ns: str, nsb: bytes, parent: bytes, ids: np.ndarray, start: int) -> tuple[bytes, int]:
        """(a stored chunk under ``parent``, how many of ``ids`` it starts with): the longest prefix pointer,
        extended to the exact common length with that chunk's token ids; (b"", 0) when none."""
        hit = self._longest_pointer(ns, nsb, parent, ids)
        if hit is None:
            return b"", 0
        base, m = hit
        try:
            # a pointer names a chunk; that chunk answers for itself only where it is: a pointer to a chunk of
            # another position or parent is the pointer's fault (a miss), never the chunk's (no quarantine)
            if self._chunk_header(ns, base, start, quarantine_position=False)[4] != parent:
                return b"", 0
            held = self._chunk_ids(ns, base, start)
        except (FileNotFoundError, KvzError, ConfigError):
            return b"", 0
        n = min(held.size, ids.size)
        diff = np.flatnonzero(held[:n] != ids[:n])
        common = int(diff[0]) if diff.size else n
        return (base, common) if common >= m else (b"", 0)

    def _chunk_header(self, ns: str, key: bytes, start: int | None, *, quarantine_position: bool = True
                      ) -> tuple[int, bytes | None, int, np.ndarray, bytes]:
        """(its first position, base chunk key or None, base tokens, the token ids it holds, its parent's key) of
        a hot chunk object, read from its header and tokens section only (range reads on object storage)."""
        from .file import KvzFile

        memo = self._headers
        if memo is not None and (ns, key, start, quarantine_position) in memo:
            return memo[ns, key, start, quarantine_position]
        path = self._chunk_path(ns, key)
        try:
            with self.fs.open(path, "rb") as fh, KvzFile(fh) as f:
                h, ids = f.header, f.tokens()
        except FileNotFoundError:
            raise FileNotFoundError(f"chunk {key.hex()} is not stored") from None
        except KvzError as e:
            self._quarantine(path, e)
            raise
        try:
            base, m, parent = _chunk_links(h.raw.get("info"), key)
            held = ids[0].numpy() if ids is not None else None
            expected = h.start_position if start is None else start + m
            elsewhere = not quarantine_position and held is not None and h.start_position != expected
            if held is None or h.batch != 1 or (h.start_position != expected and not elsewhere) or parent is None:
                raise FormatError(f"chunk {key.hex()[:16]}… does not describe positions from {start} (start "
                                  f"{h.start_position}, {m} from a base, token ids "
                                  f"{'stored' if held is not None else 'missing'}, parent {parent is not None})",
                                  field="Header.info")
        except KvzError as e:
            self._quarantine(path, e)
            raise
        if elsewhere:  # valid where it is; the caller expected it elsewhere
            raise FormatError(f"chunk {key.hex()[:16]}… starts at {h.start_position}, not {expected}",
                              field="Header.cache.start_position")
        if memo is not None:
            memo[ns, key, start, quarantine_position] = (h.start_position, base, m, held, parent)
        return h.start_position, base, m, held, parent

    def _chunk_ids(self, ns: str, key: bytes, start: int, model=None) -> np.ndarray:
        """Every token id of a hot chunk (a delta chunk's base's first, hot or cold; a model-coded base is
        decoded with ``model``, :class:`ConfigError` without one)."""
        if not self._exists(self._chunk_path(ns, key)):
            raise FileNotFoundError(f"chunk {key.hex()} is not stored hot")
        return self._ids(ns, key, start, None, model)

    def _load_chunk(self, ns: str, key: bytes, start: int, m: int, strict: bool, depth: int = 0,
                    parent: bytes | None = None) -> KVCache | None:
        """The first ``m`` positions of a chunk, checked (its start and length; a delta chunk's first positions
        from its base); a corrupt chunk is quarantined and raises (``strict``) or reads as a miss."""
        from .file import KvzFile

        path = self._chunk_path(ns, key)
        data = self._read(path)
        if data is None:
            if strict:
                raise FileNotFoundError(f"chunk {key.hex()} of this session is not stored")
            return None
        try:
            with KvzFile(data) as f:
                self._attach_predictors(ns, f)
                kv, info = f.to_kvcache(), f.header.raw.get("info")
            base, bm, own_parent = _chunk_links(info, key)
            if kv.start_position != start + bm or kv.seq_len + bm < m or depth > MAX_BASE_DEPTH or (
                    parent is not None and own_parent != parent):
                raise FormatError(f"chunk {key.hex()[:16]}… holds positions {kv.start_position}.."
                                  f"{kv.start_position + kv.seq_len} after {bm} of a base, expected {start}.."
                                  f"{start + m}", field="Header.cache.start_position")
        except PredictorsRequired:
            raise  # the chunk is intact: its namespace's predictors are not
        except KvzError as e:
            self._quarantine(path, e)
            if strict:
                raise
            return None
        self._touch(path)
        own = KVCache([k[:, :, :max(0, m - bm)] for k in kv.keys], [v[:, :, :max(0, m - bm)] for v in kv.values],
                      start_position=start + bm)
        if not bm:
            return own
        head = self._load_chunk(ns, base, start, min(m, bm), strict, depth + 1, own_parent)
        if head is None or m <= bm:
            return head
        return self._output([head, own], "kvcache")

    @torch.no_grad()
    def _recompute(self, model, parts: list[KVCache], ids: np.ndarray, a: int) -> KVCache:
        """Positions ``a ..`` of a session, computed by the model on top of the stored ``parts`` (one call)."""
        from .tokens.plan import cache_kwarg

        mdl, _ = split_model(model)
        prefix = self._output(parts, "dynamic") if parts else None
        kw = {} if prefix is None else {cache_kwarg(mdl): prefix}
        out = mdl(torch.from_numpy(ids[a:])[None].to(next(mdl.parameters()).device), use_cache=True, **kw)
        full = to_canonical(out.past_key_values)
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

    def _manifest(self, key: str, model=None, ids: bool = True) -> tuple[str, dict]:
        """(namespace, {"num_tokens", "chain", "ids"}) of a session: its 12-byte object, then its chunks walked
        from the last to the first through their parent keys; then (``ids``) their token ids from the first to
        the last (a model-coded cold chunk is decoded after the tokens before it), each chunk's key
        recomputed from its parent and ids, so a misplaced or altered chunk is caught.  ``chain``: (key, ids)
        per chunk, or (key, number of ids) without ``ids``."""
        ns, session = self._split_key(key)
        path = self._session_path(ns, session)
        raw = self._read(path)
        if raw is None:
            raise KeyError(key)
        if len(raw) != 12 or raw[:8] != SESSION_MAGIC or not int.from_bytes(raw[8:], "little"):
            err = FormatError("not a kvz-store session object of this version", field="Session")
            self._quarantine(path, err)
            raise err
        n = int.from_bytes(raw[8:], "little")
        size = self.record(ns)["chunk_tokens"]
        k, links, a = bytes.fromhex(session), [], (n - 1) // size * size
        while a >= 0:  # from the last chunk back: (key, first position, token ids) per object
            if k == ROOT_PARENT:
                raise FormatError(f"session {session[:16]}… declares {n} tokens; its chunks hold {n - a - size}",
                                  field="Session")
            expect = min(n, a + size) - a
            parent, count, _base, _m, first = self._link(ns, k, a, expect=expect)
            if count != a + expect - first:
                err = FormatError(f"chunk {k.hex()[:16]}… of session {session[:16]}… holds {count} tokens, its "
                                  f"position implies {a + expect - first}", field="Chunk")
                self._quarantine_chunk(ns, k, err)
                raise err
            links.append((k, first, count))
            k, a = parent, first - size
        if k != ROOT_PARENT:
            raise FormatError(f"session {session[:16]}…: its first chunk has a parent", field="Chunk")
        links.reverse()
        if not ids:
            return ns, {"num_tokens": n, "chain": links}
        recorded = self.record(ns).get("model") or {}
        if model is not None and "fingerprint" in recorded:
            from .identity import check_model

            check_model(recorded, model)  # another model must not decode or recompute this session's positions
        chain, tail, parent, nsb = [], np.zeros(0, dtype=np.int64), ROOT_PARENT, bytes.fromhex(ns)
        for k, first, count in links:
            held = self._ids(ns, k, first, tail, model, count=count)
            keys = []
            for b in range(0, held.size, size):  # a folded cold object covers several chunks
                keys.append(chunk_key(nsb, keys[-1] if keys else parent, held[b:b + size]))
            if held.size != count or keys[-1] != k:
                err = FormatError(f"chunk {k.hex()[:16]}… of session {session[:16]}… holds other tokens than its "
                                  "key says", field="Chunk")
                self._ids_memo.pop((ns, k, first), None)
                self._quarantine_chunk(ns, k, err)
                raise err
            chain += [(kk, held[b:b + size]) for kk, b in zip(keys, range(0, held.size, size))]
            tail = np.concatenate([tail, held])[-CONTEXT_TOKENS:]
            parent = k
        return ns, {"num_tokens": n, "ids": np.concatenate([h for _, h in chain]), "chain": chain}

    def _quarantine_chunk(self, ns: str, key: bytes, err: Exception) -> None:
        """A chunk that disagrees with its key: quarantine it, hot and cold (so that putting its session again
        repairs it) - except a model-coded cold object, which a machine with other numerics may misread."""
        for bad in (self._chunk_path(ns, key), self._ids_path(ns, key)):
            raw = self._read(bad) if bad.endswith(".ids") else b""
            if self._exists(bad) and not (raw or b"").startswith(LM_MAGIC):
                self._quarantine(bad, err)

    def _cold(self, ns: str, key: bytes) -> dict | None:
        """A chunk's cold object parsed (spec/store.md 4.1, 4.2), or None when absent; a malformed one is
        quarantined and raises :class:`FormatError`."""
        path = self._ids_path(ns, key)
        raw = self._read(path)
        if raw is None:
            return None
        size = self.record(ns)["chunk_tokens"]
        try:
            if raw[:4] == LM_MAGIC:
                if len(raw) < _LM_HEAD.size or (len(raw) - _LM_HEAD.size) % 4:
                    raise FormatError(f"model-coded cold chunk of {len(raw)} bytes (a 52-byte head, then whole "
                                      "words)", field="Cold")
                _magic, pid, n, m, link = _LM_HEAD.unpack_from(raw)
                if not 1 <= n or m >= n or m >= size or len(raw) == _LM_HEAD.size:  # n > C: folded (4.2)
                    raise FormatError(f"model-coded cold chunk: {n} tokens, {m} from a base, "
                                      f"{len(raw) - _LM_HEAD.size} bytes of code (chunks of {size})", field="Cold.L")
                return {"kind": "lm", "profile": pid, "n": n, "m": m, "link": link,
                        "words": np.frombuffer(raw, dtype="<u4", offset=_LM_HEAD.size)}
            if len(raw) < 44 or raw[:8] != IDS_MAGIC:
                raise FormatError("not a cold chunk object", field="Ids")
            n = int.from_bytes(raw[40:44], "little")
            frame = raw[44:]
            if n > size or zstandard.get_frame_parameters(frame).content_size != 4 * n:
                raise FormatError("cold chunk: token count and frame disagree", field="Ids")
            ids = np.frombuffer(zstandard.ZstdDecompressor().decompress(frame, max_output_size=4 * n,
                                                                        allow_extra_data=False), dtype="<u4")
        except (FormatError, zstandard.ZstdError) as e:
            err = e if isinstance(e, FormatError) else FormatError(f"cold chunk: {e}", field="Ids")
            self._quarantine(path, err)
            raise err from None
        return {"kind": "ids", "parent": raw[8:40], "n": n, "ids": ids.astype(np.int64)}

    def _hot_or_cold(self, ns: str, key: bytes, start: int, quarantine_position: bool = True
                     ) -> tuple[tuple | None, dict | None]:
        """(the hot chunk's header as :meth:`_chunk_header` gives it, None) or (None, its cold object parsed);
        FileNotFoundError when it has neither (a corrupt hot object is quarantined and the cold one read)."""
        try:
            return self._chunk_header(ns, key, start, quarantine_position=quarantine_position), None
        except (FileNotFoundError, KvzError):
            cold = self._cold(ns, key)
        if cold is None:
            raise FileNotFoundError(f"chunk {key.hex()} is not stored (hot or cold): the session's tokens are lost")
        return None, cold

    def _link(self, ns: str, key: bytes, start: int, depth: int = 0, expect: int | None = None
              ) -> tuple[bytes, int, bytes | None, int, int]:
        """(parent key, token ids, base key or None, tokens from the base, first position) of the chunk at
        position ``start``, hot (its header) or cold, without decoding anything.  A model-coded cold object
        may cover the chunks before it too (folded, spec/store.md 4.2): given ``expect``, the chunk's own token
        count, its first covered position is ``start + expect - ids`` and the parent is that chunk's."""
        if depth > MAX_BASE_DEPTH:
            raise FormatError(f"chunk {key.hex()[:16]}…: more than {MAX_BASE_DEPTH} bases", field="Header.info")
        hot, cold = self._hot_or_cold(ns, key, start)
        if hot is not None:
            _first, base, m, held, parent = hot
            out = (parent, m + held.size, base, m, start)
        else:
            if cold["kind"] == "ids":
                out = (cold["parent"], cold["n"], None, 0, start)
            else:
                size = self.record(ns)["chunk_tokens"]
                first = start if expect is None else start + expect - cold["n"]
                if first < 0 or first % size or first > start or (expect is None and cold["n"] > size):
                    raise FormatError(f"cold chunk {key.hex()[:16]}… at position {start} covers {cold['n']} "
                                      f"tokens: they do not end with its {expect} (chunks of {size})",
                                      field="Cold.L")
                if not cold["m"]:
                    out = (cold["link"], cold["n"], None, 0, first)
                else:
                    parent, bn = self._link(ns, cold["link"], first, depth + 1)[:2]
                    if bn < cold["m"]:
                        raise FormatError(f"cold chunk {key.hex()[:16]}…: its base holds {bn} < {cold['m']} "
                                          "tokens", field="Cold.m")
                    out = (parent, cold["n"], cold["link"], cold["m"], first)
        return out

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
        # a walk placed it here; a put may have rewritten it since (hot where it was cold): never quarantined
        # for its position by this second look
        hot, cold = self._hot_or_cold(ns, key, start, quarantine_position=False)
        if hot is not None:
            _first, base, m, held, parent = hot
        else:
            if cold["kind"] == "ids":
                return cold["ids"]  # checked against the key by the caller
            limit = self.record(ns)["chunk_tokens"] if count is None else count
            if cold["n"] > limit:  # a folded object is decoded only where a walk placed it (its count known)
                raise FormatError(f"cold chunk {key.hex()[:16]}… holds {cold['n']} tokens, at most {limit} expected",
                                  field="Cold.L")
            base, m = (cold["link"], cold["m"]) if cold["m"] else (None, 0)
        head = np.zeros(0, dtype=np.int64)
        if base is not None:
            head = self._ids(ns, base, start, before, model, depth + 1)
            if head.size < m:
                raise FormatError(f"chunk {key.hex()[:16]}…: its base holds {head.size} < {m} tokens",
                                  field="Header.info")
            head = head[:m]
        if cold is None:
            return np.concatenate([head, held])
        # a model-coded cold chunk (spec/store.md 4.2)
        if model is None:
            raise ConfigError(f"chunk {key.hex()[:16]}… is cold and its token ids are coded with the model: pass "
                              "model= (or open the store with it)")
        mdl = split_model(model)[0]
        parent = cold["link"] if base is None else self._link(ns, base, start, depth + 1)[0]
        if before is None:
            before = self._prefix_ids(ns, parent, start, model)
        self._check_numerics(ns, cold["profile"], mdl)
        from .tokens.continuation import decode_continuation

        context = np.concatenate([np.asarray(before, dtype=np.int64), head])[-CONTEXT_TOKENS:]
        ids = np.concatenate([head, decode_continuation(mdl, context, cold["words"], cold["n"] - m)])
        if self._chain_key(ns, parent, ids) != key:
            raise ChecksumMismatch(f"cold chunk {key.hex()[:16]}… decodes to token ids that are not its key's: the "
                                   "object is corrupt, or this machine computes the model's probabilities "
                                   "differently in a way its numerics profile does not name", field="Cold.Words")
        self._remember(ns, key, start, ids)
        return ids

    def _chain_key(self, ns: str, parent: bytes, ids: np.ndarray) -> bytes:
        """The key of the last chunk of ``ids`` split into chunks from a chunk start after ``parent``."""
        size, nsb, k = self.record(ns)["chunk_tokens"], bytes.fromhex(ns), parent
        for a in range(0, ids.size, size):
            k = chunk_key(nsb, k, ids[a:a + size])
        return k

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
        chain, k, a = [], parent, start - size
        while k != ROOT_PARENT:
            if a < 0:
                raise FormatError(f"chunk {parent.hex()[:16]}…: more parents than positions", field="Chunk")
            par, n, _b, _m, first = self._link(ns, k, a, expect=size)
            chain.append((k, first, n))
            k, a = par, first - size
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

    def _numerics_id(self, ns: str, mdl) -> bytes:
        """The 8-byte id of this engine's profile for model-coded cold chunks (its object published once)."""
        if (ns, self._engine(mdl)) not in self._profiles:
            from . import numerics
            from .tokens.continuation import PROCEDURE
            from .tokens.plan import STEP_THREADS

            data = _canonical({"context_tokens": CONTEXT_TOKENS, "procedure": PROCEDURE,
                               "numerics": {**numerics.profile(mdl), "step_threads": STEP_THREADS}})
            pid = hashlib.sha256(data).digest()[:8]
            path = self._numerics_path(ns, pid)
            if self._read(path) != data:
                self._write(path, data)
            self._profiles[ns, self._engine(mdl)] = pid
        return self._profiles[ns, self._engine(mdl)]

    def _check_numerics(self, ns: str, pid: bytes, mdl) -> None:
        """Refuse, before decoding, a model-coded cold chunk whose encoder's profile is not this engine's."""
        if self._profiles.get((ns, self._engine(mdl))) == pid or self._profiles.get((ns, pid, self._engine(mdl))):
            return
        from . import numerics
        from .tokens.continuation import PROCEDURE

        path = self._numerics_path(ns, pid)
        raw = self._read(path)
        if raw is None:
            raise FileNotFoundError(f"numerics profile {pid.hex()} of a cold chunk is not stored ({path})")
        try:
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
        from .tokens.plan import STEP_THREADS

        if recorded.get("step_threads") != STEP_THREADS:
            raise FormatError(f"cold chunks coded with one-token calls on {recorded.get('step_threads')!r} threads: "
                              f"this reader runs them on {STEP_THREADS}", field="Numerics.step_threads")
        diffs = numerics.differences_here(recorded, mdl, step_threads=recorded.get("step_threads"))
        if diffs:
            raise NumericsMismatch(f"cold chunks of this store were coded by an engine with other numerics ("
                                   f"{'; '.join(diffs)}): {numerics.advice(diffs, tried=True)}")
        self._profiles[ns, pid, self._engine(mdl)] = True

    def tokens(self, key: str, model=None) -> torch.Tensor:
        """A stored session's token ids ``[1, n]`` (``model``: this store's by default; needed only where
        cold chunks are coded with it)."""
        return torch.from_numpy(self._manifest(key, self.model if model is None else model)[1]["ids"])[None]

    def get(self, key: str, model=None, *, output: str = "dynamic"):
        """A whole stored session's cache (``output="kvcache"``: a :class:`KVCache` with its tokens).

        A session whose chunks were evicted (``gc(max_bytes=)``) or quarantined is **cold**: with a model (this
        store's or ``model=``) the missing positions are recomputed on top of the stored prefix - a valid cache
        of the session's tokens, equal to the original where the engine computes the same way; without one,
        the missing chunk raises (``FileNotFoundError``; a corrupt one its :class:`KvzError`)."""
        model = self.model if model is None else model
        ns, m = self._manifest(key, model)
        ids, parts, a = m["ids"], [], 0
        for k, held in m["chain"]:
            try:
                parts.append(self._load_chunk(ns, k, a, held.size, strict=True))
                a += held.size
            except (FileNotFoundError, KvzError) as e:
                if model is None:
                    if isinstance(e, FileNotFoundError):
                        raise FileNotFoundError(f"{e} (evicted or quarantined): pass model= to recompute it") from None
                    raise
                parts.append(self._recompute(model, parts, ids, a))
                break
        if not parts:
            raise ConfigError(f"session {key} holds no tokens")
        kv = self._output(parts, "kvcache")
        if output == "dynamic":
            return kv.to_dynamic_cache()
        if output != "kvcache":
            raise ConfigError(f"output must be 'dynamic' or 'kvcache', not {output!r}")
        kv.tokens = torch.from_numpy(ids)[None]
        return kv

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
        """Open a hot chunk and its bases (headers only): FileNotFoundError / KvzError if one is not hot."""
        k = key
        for _ in range(MAX_BASE_DEPTH + 1):
            k = self._chunk_file(ns, k, files)[2]
            if k is None:
                return
        raise FormatError(f"chunk {key.hex()[:16]}…: more than {MAX_BASE_DEPTH} bases", field="Header.info")

    def _chunk_file(self, ns: str, key: bytes, files: dict):
        """(KvzFile, file object, base key or None, base tokens) of a hot chunk, opened once per ``files``."""
        from .file import KvzFile

        if key not in files:
            path = self._chunk_path(ns, key)
            try:
                fh = self.fs.open(path, "rb")
            except FileNotFoundError:
                raise FileNotFoundError(f"chunk {key.hex()} is not stored hot: get(key, model) recomputes it") \
                    from None
            f = None
            try:
                f = KvzFile(fh)
                self._attach_predictors(ns, f)
                base, bm, _parent = _chunk_links(f.header.raw.get("info"), key)
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

    # -- listing, deletion, gc ----------------------------------------------------------------------------
    def _find(self, *parts: str) -> list[str]:
        try:
            return sorted(self.fs.find(self._path(*parts)))
        except FileNotFoundError:
            return []

    def sessions(self) -> list[str]:
        """Every stored session's key."""
        out = []
        for ns in self.namespaces():
            for p in self._find("ns", ns, "sessions"):
                name = os.path.basename(p)
                if name.endswith(".kvs") and len(name) == 68:
                    out.append(f"{ns}:{name[:-4]}")
        return out

    def __iter__(self):
        return iter(self.sessions())

    @staticmethod
    def _split_key(key: str) -> tuple[str, str]:
        ns, _, session = str(key).partition(":")
        if not (_hex64(ns) and _hex64(session)):
            raise ConfigError(f"not a session key: {key!r} (expected '<namespace>:<session>', 64 hex digits each)")
        return ns, session

    def __contains__(self, key: str) -> bool:
        try:
            ns, session = self._split_key(key)
        except ConfigError:
            return False
        return self._exists(self._session_path(ns, session))

    def delete(self, key: str) -> None:
        """Remove a session (its chunks stay until :meth:`gc` finds them unreferenced)."""
        ns, session = self._split_key(key)
        path = self._session_path(ns, session)
        if not self._exists(path):
            raise KeyError(key)
        self.fs.rm(path)

    def _referenced(self) -> tuple[set[str], set[str], set[str], tuple[dict, set, set]]:
        """Paths of every chunk (hot and cold, with the bases of delta chunks) and pointer some session needs;
        the namespaces with a record or session that cannot be read (nothing in them may be collected or
        folded: which chunks their sessions need is unknown); the namespaces whose pointers cannot all be named
        (kept); and what folding needs (:meth:`_foldable`): how many sessions reach each chunk object, the
        chunks that are some chunk's base, and those unknown namespaces."""
        keep, unknown, unknown_pointers, sessions_of, based = set(), set(), set(), {}, set()
        for key in self.sessions():
            ns = key.partition(":")[0]
            try:
                rec = self.record(ns)
            except (KeyError, KvzError):
                unknown.add(ns)
                continue
            try:
                _, m = self._manifest(key, ids=False)  # links only: no model needed, nothing decoded
            except KeyError:  # deleted meanwhile
                continue
            except (KvzError, FileNotFoundError):  # unreadable: which objects it needs is unknown, so nothing
                unknown.add(ns)                   # in its namespace is collected
                continue
            nsb, parent, n = bytes.fromhex(ns), ROOT_PARENT, m["num_tokens"]
            size, step = rec["chunk_tokens"], rec["granularity"]
            for key_, first, count in m["chain"]:
                a = first + count - 1 - (first + count - 1) % size  # the object's own chunk (folded: the last)
                # a delta chunk needs its base (and the base's base ...), hot or cold
                bases = list(self._bases(ns, key_, a, min(n, a + size) - a))
                sessions_of[ns, key_] = sessions_of.get((ns, key_), 0) + 1
                based.update((ns, b) for b in bases)
                for k in (key_, *bases):
                    keep.update((self._chunk_path(ns, k), self._ids_path(ns, k)))
                try:  # pointers serve lookups into hot chunks only: a cold chunk's are collected
                    ids = self._chunk_ids(ns, key_, a, self.model) if first == a else None
                except (FileNotFoundError, KvzError):
                    ids = None
                except ConfigError:  # a hot chunk on a model-coded base, no model here: its pointers'
                    ids = None         # names are unknown, so no pointer of this namespace is collected
                    unknown_pointers.add(ns)
                if ids is not None:
                    keep.update(self._pointer_path(ns, chunk_key(nsb, parent, ids[:g]))
                                for g in _pointer_lengths(ids.size, size, step))
                parent = key_
        return keep, unknown, unknown_pointers, (sessions_of, based, unknown)

    def _age(self, path: str) -> float:
        """Seconds since the object was last written (or touched); 0 when unknown or gone (never collected
        on a guess)."""
        try:
            info = self.fs.info(path)
        except FileNotFoundError:
            return 0.0
        t = info.get("mtime") or info.get("LastModified") or info.get("last_modified") or info.get("created")
        if hasattr(t, "timestamp"):
            t = t.timestamp()
        try:
            return max(0.0, time.time() - float(t)) if t is not None else 0.0
        except (TypeError, ValueError):
            return 0.0

    def _remove(self, path: str) -> int:
        """Delete one object; its size, or -1 when another process removed it first."""
        try:
            size = int(self.fs.info(path).get("size", 0))
            self.fs.rm(path)
        except FileNotFoundError:
            return -1
        return size

    def gc(self, grace_seconds: float | None = None, max_bytes: int | None = None, *, model=None,
           cold: str = "auto", progress=None) -> dict:
        """Remove chunks and pointers no session references, and interrupted writers' temporary files, once
        they are older than ``grace_seconds`` (default: the store's): a writer still publishing is never
        collected.  With ``max_bytes``, then evict the least recently used chunks (local file systems: last
        read or written; object stores: written) until the chunks take at most that many bytes: their
        sessions become cold - :meth:`get` recomputes what is missing with the model, :meth:`match` stops
        before it.  An evicted chunk keeps its token ids: ``cold="lm"`` codes them with the model (this
        store's, or ``model=``) conditioned on the tokens before them - a few bits per token, decoded with the
        same model on an engine with the same numerics; ``cold="ids"`` keeps them zstd-coded (any machine, no
        model; ~17 bits per token); ``"auto"``: ``lm`` when there is a model of the namespace.  Pointers into
        cold chunks are collected (they serve lookups of hot ones).  ``progress(1)`` after each eviction.
        Run one collection at a time per store (spec/store.md 7); writers and readers may run meanwhile.
        Returns what it removed."""
        if cold not in ("auto", "lm", "ids"):
            raise ConfigError(f"cold must be 'auto', 'lm' or 'ids', not {cold!r}")
        model = self.model if model is None else model
        if cold == "lm" and model is None:
            raise ConfigError("cold='lm' needs the model (model= or the store's)")
        grace = self.grace_seconds if grace_seconds is None else grace_seconds
        self._headers = {}
        try:
            keep, unknown, unknown_pointers, refs = self._referenced()
        finally:
            self._headers = None
        keep = {p.lstrip("/") for p in keep}
        removed = {"chunks": 0, "pointers": 0, "temporary": 0, "bytes": 0}
        for ns in self.namespaces():
            if ns in unknown:
                continue
            for kind, sub in (("chunks", "chunks"), ("pointers", "prefix")):
                if kind == "pointers" and ns in unknown_pointers:
                    continue
                for p in self._find("ns", ns, sub):
                    name = os.path.basename(p)
                    temp = name.startswith(".") and name.endswith(".kvz-tmp")
                    if (temp or p.lstrip("/") not in keep) and self._age(p) >= grace:
                        size = self._remove(p)
                        if size >= 0:
                            removed["temporary" if temp else kind] += 1
                            removed["bytes"] += size
            for p in self._find("ns", ns, "sessions"):
                name = os.path.basename(p)
                if name.startswith(".") and name.endswith(".kvz-tmp") and self._age(p) >= grace:
                    removed["temporary"] += self._remove(p) >= 0
        if max_bytes is not None:
            removed["evicted"], removed["evicted_bytes"], removed["cold_lm"] = self._evict(
                int(max_bytes), None if cold == "ids" else model, progress, grace, refs)
        return removed

    def _evict(self, max_bytes: int, model, progress=None, grace: float = 0.0, refs=None) -> tuple[int, int, int]:
        """Delete the least recently used chunks until the chunks of every namespace take ``max_bytes``, each
        after publishing its cold object (model-coded where ``model`` is the namespace's and the tokens before
        the chunk can be read; else zstd).  (evicted, bytes freed, how many model-coded)."""
        chunks = []
        for ns in self.namespaces():
            try:
                found = self.fs.find(self._path("ns", ns, "chunks"), detail=True)
            except FileNotFoundError:
                continue
            for p, info in found.items():
                if not os.path.basename(p).startswith(".") and p.endswith(".kvz"):
                    t = info.get("mtime") or info.get("LastModified") or info.get("last_modified") or 0
                    t = t.timestamp() if hasattr(t, "timestamp") else float(t)
                    chunks.append((t, p, int(info.get("size", 0))))
        total, count, freed, coded = sum(c[2] for c in chunks), 0, 0, 0
        sizes = {p: size for _t, p, size in chunks}
        for _t, p, size in sorted(chunks):
            if total <= max_bytes:
                break
            ns, key = p.split("/ns/")[-1].split("/")[0], bytes.fromhex(os.path.basename(p)[:64])
            folded = []
            try:  # keep its tokens and its link to its parent: the session stays whole, cold
                first, base, m, held, parent = self._chunk_header(ns, key, None)
                obj = None
                if model is not None:
                    try:
                        obj, folded = self._cold_lm(ns, key, first - m, base, m, held, parent, model, refs, grace)
                    except (FileNotFoundError, KvzError, ConfigError) as e:  # (another engine's profile, ids the
                        warn(f"kvcodec.Store: chunk {key.hex()[:16]}… evicted with zstd-coded ids: {e}")  # model
                        obj, folded = None, []                                           # cannot code, ...)
                if obj is None:
                    ids = self._chunk_ids(ns, key, first - m)
                    frame = zstandard.ZstdCompressor(level=19, write_content_size=True).compress(
                        ids.astype("<u4").tobytes())
                    obj = IDS_MAGIC + parent + int(ids.size).to_bytes(4, "little") + frame
            except (FileNotFoundError, KvzError, ConfigError):
                continue
            self._write(self._ids_path(ns, key), obj)
            if self._remove(p) >= 0:
                total, count, freed = total - size, count + 1, freed + size
                coded += obj[:4] == LM_MAGIC
            for k in folded:  # now covered by this chunk's object (published first: a crash leaves both)
                self._remove(self._ids_path(ns, k))
                hot = self._chunk_path(ns, k)
                # a put may have written it hot again meanwhile (it found it cold) or reused it (touched):
                # looked at again now, and kept unless older than the grace period
                if self._exists(hot) and self._age(hot) >= grace and self._remove(hot) >= 0:
                    gone = sizes.get(hot, sizes.get(hot.lstrip("/"), 0))
                    total, count, freed = total - gone, count + 1, freed + gone
            if progress:
                progress(1)
        return count, freed, coded

    def _foldable(self, ns: str, key: bytes, refs, grace: float) -> bool:
        """May chunk ``key`` be folded into its child's cold object: one session reaches it, it is nobody's
        base, and it is cold or its hot object is older than the grace period (a put that reuses a hot chunk
        touches it; one that finds it cold writes it again)."""
        count, based, unknown = refs
        if ns in unknown or count.get((ns, key)) != 1 or (ns, key) in based:
            return False
        hot = self._chunk_path(ns, key)
        return not self._exists(hot) or self._age(hot) >= grace

    def _cold_lm(self, ns: str, key: bytes, start: int, base: bytes | None, m: int, held: np.ndarray,
                 parent: bytes, model, refs=None, grace: float = 0.0) -> tuple[bytes | None, list[bytes]]:
        """(a hot chunk's model-coded cold object, the chunks before it that it covers) (spec/store.md 4.2):
        its ids coded with the model conditioned on the tokens before them; (None, []) where the model is not
        the namespace's.  A whole chunk that one session alone reaches also covers (folds) its parents as far
        as they are that session's alone (:meth:`_foldable`) - up to and including a delta chunk, whose base
        it then names - so a session's private tail costs one 52-byte head, not one per chunk."""
        recorded = self.record(ns).get("model") or {}
        rec = model_record(model)
        if rec is None or recorded.get("fingerprint") != rec.get("fingerprint"):
            return None, []
        from .tokens.continuation import encode_continuation

        mdl, size = split_model(model)[0], self.record(ns)["chunk_tokens"]
        first, link, lm, folded = start, (base if m else parent), m, []
        if refs is not None and not m and self._foldable(ns, key, refs, grace):  # (it is hot: old enough)
            p = parent
            while p != ROOT_PARENT and self._foldable(ns, p, refs, grace):
                par, _n, b, bm, pfirst = self._link(ns, p, first - size, expect=size)
                folded.append(p)
                first, link, lm = pfirst, (b if bm else par), bm
                if bm:
                    break
                p = par
        first_parent = link if not lm else self._link(ns, link, first)[0]
        every = self._prefix_ids(ns, parent, start, model, full=True)  # positions 0 .. start
        head = self._ids(ns, base, start, every[-CONTEXT_TOKENS:], model)[:m] if base is not None \
            else np.zeros(0, dtype=np.int64)
        if head.size != m:
            return None, []
        ids = np.concatenate([every[first:], head, held])  # positions first .. the end of this chunk
        if self._chain_key(ns, first_parent, ids) != key:  # what a reader will check, checked before anything
            return None, []                                # is deleted (a misnamed chunk: zstd, unfolded)
        context = np.concatenate([every[:first], ids[:lm]])[-CONTEXT_TOKENS:]
        words, _bits = encode_continuation(mdl, context, ids[lm:])
        self._remember(ns, key, first, ids)
        return (_LM_HEAD.pack(LM_MAGIC, self._numerics_id(ns, mdl), ids.size, lm, link)
                + words.astype("<u4").tobytes()), folded

    def stats(self) -> dict:
        """Counts and bytes: sessions, hot chunks (keys and values), cold chunks (token ids only: evicted),
        pointers, quarantined objects, per namespace and in total."""
        out = {"url": self.root, "namespaces": {}, "sessions": 0, "chunks": 0, "cold_chunks": 0, "pointers": 0,
               "bytes": 0}
        for ns in self.namespaces():
            d = {"sessions": 0, "chunks": 0, "cold_chunks": 0, "pointers": 0, "chunk_bytes": 0, "session_bytes": 0}
            for kind, sub, size_key in (("chunks", "chunks", "chunk_bytes"), ("pointers", "prefix", None),
                                        ("sessions", "sessions", "session_bytes")):
                try:
                    found = self.fs.find(self._path("ns", ns, sub), detail=True)
                except FileNotFoundError:
                    found = {}
                for p, info in found.items():
                    if os.path.basename(p).startswith("."):
                        continue
                    d["cold_chunks" if p.endswith(".ids") else kind] += 1
                    if size_key:
                        d[size_key] += int(info.get("size", 0))
            try:
                d["record"] = self.record(ns)
            except (KeyError, KvzError):
                d["record"] = None
            out["namespaces"][ns] = d
            for k in ("sessions", "chunks", "cold_chunks", "pointers"):
                out[k] += d[k]
            out["bytes"] += d["chunk_bytes"] + d["session_bytes"]
        out["quarantined"] = len(self._find("quarantine"))
        return out

    # -- the reuse loop -----------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, tokens, model=None, **generate_kwargs):
        """Persisted agent memory in one call: the longest stored prefix of ``tokens`` is restored, the model
        runs on the rest and generates (``generate_kwargs`` go to ``model.generate``), and the whole session
        - prompt and answer - is stored.  Returns ``(output ids [1, n + new], session key, tokens reused)``."""
        from .tokens.plan import cache_kwarg

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
        held = to_canonical(out.past_key_values).seq_len
        key = self.put(out.past_key_values, model, tokens=seq[:, :held])
        return seq, key, n
