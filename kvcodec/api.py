"""Public API: encode / decode / save / load / inspect / open."""

from __future__ import annotations

import io
import os
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from . import __version__
from .cache import DTYPE_BY_NAME, KVCache, to_canonical
from .container import layout as L
from .container.header import TIERS
from .container.reader import KvzReader
from .container.writer import KvzWriter
from .errors import ConfigError, FormatError, ModelMismatch
from .stages import floatctx

__all__ = ["encode", "decode", "save", "load", "inspect", "open_kvz", "KvzFile"]

DEFAULT_CHUNK_TOKENS = 4096
_NP_UINT = {2: np.uint16, 4: np.uint32}
_TORCH_INT = {2: torch.int16, 4: torch.int32}


def _threads(threads: int | None) -> int:
    if threads is None:
        threads = int(os.environ.get("KVCODEC_THREADS", "0")) or (os.cpu_count() or 1)
    return max(1, threads)


# --- model fingerprints, cached per model object ---------------------------
_FP_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def fingerprint_of(model, tokenizer=None) -> str:
    """:func:`kvcodec.models.model_fingerprint`, memoised per (model, weights version)."""
    from .models import model_fingerprint

    stamp = (sum(p._version for p in model.parameters()), id(tokenizer))
    hit = _FP_CACHE.get(model)
    if hit and hit[0] == stamp:
        return hit[1]
    fp = model_fingerprint(model, tokenizer)
    _FP_CACHE[model] = (stamp, fp)
    return fp


def _model_record(model) -> dict | None:
    if model is None:
        return None
    if isinstance(model, tuple):  # (model, tokenizer) as returned by load_model
        model, tok = model
    else:
        tok = None
    rec = {"fingerprint": fingerprint_of(model, tok)}
    arch = getattr(getattr(model, "config", None), "model_type", None)
    if isinstance(arch, str):
        rec["architecture"] = arch
    return rec


# --- tensors <-> bit patterns ------------------------------------------------
def _bits(t: torch.Tensor) -> np.ndarray:
    """Raw bit patterns of a CPU copy of ``t`` as uint16/uint32 numpy."""
    t = t.detach().to("cpu").contiguous()
    return t.view(_TORCH_INT[t.element_size()]).numpy().view(_NP_UINT[t.element_size()])


def _tensor(bits: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    size = torch.empty((), dtype=dtype).element_size()
    arr = np.ascontiguousarray(bits).view({2: np.int16, 4: np.int32}[size])
    return torch.from_numpy(arr).view(dtype)


# --- encoding ------------------------------------------------------------------
def _header(kv: KVCache, tier: str, codec_params: dict, chunk_tokens: int, model, info) -> dict:
    return {
        "format": "kvz",
        "tier": tier,
        "codec": {"id": floatctx.CODEC_ID, "params": codec_params},
        "cache": {
            "dtype": kv.dtype_name,
            "batch": kv.batch,
            "chunk_tokens": chunk_tokens,
            "start_position": int(kv.start_position),
            "num_tokens": 0 if kv.tokens is None else int(kv.tokens.shape[1]),
            "layers": [
                {"kv_heads": int(k.shape[1]), "k_dim": int(k.shape[3]), "v_dim": int(v.shape[3]),
                 "seq_len": int(k.shape[2]), "sliding_window": kv.sliding_window[i],
                 "cumulative_length": int(kv.cumulative_length[i])}
                for i, (k, v) in enumerate(zip(kv.keys, kv.values))
            ],
        },
        "model": _model_record(model),
        "info": {"kvcodec_version": __version__} if info is None else info,
    }


def _write(sink, cache, model, tier: str, chunk_tokens: int, tokens, info, threads, options, progress=None):
    if tier not in TIERS:
        raise ConfigError(f"unknown tier {tier!r}; this version implements {sorted(TIERS)}")
    if not isinstance(chunk_tokens, int) or not 1 <= chunk_tokens <= L.MAX_CHUNK_TOKENS:
        raise ConfigError(f"chunk_tokens must be an int in [1, {L.MAX_CHUNK_TOKENS}]")
    kv = to_canonical(cache)
    if tokens is not None:
        tokens = torch.as_tensor(tokens)
        if tokens.dim() == 1:
            tokens = tokens.unsqueeze(0)
        kv = KVCache(kv.keys, kv.values, tokens, kv.start_position, kv.sliding_window, kv.cumulative_length)
    params = floatctx.check_config(dict(options), kv.dtype_name)
    ids = None if kv.tokens is None else kv.tokens.to("cpu", torch.int64).numpy()
    if ids is not None and ids.size and (ids.min() < 0 or ids.max() >= 1 << 32):
        raise ValueError("token ids must be in [0, 2**32)")
    writer = KvzWriter(sink, _header(kv, tier, params, chunk_tokens, model, info))
    if ids is not None:
        writer.write_section(L.SECTION_TOKENS, ids.astype("<u4").tobytes())
    jobs = []
    for li, (k, v) in enumerate(zip(kv.keys, kv.values)):
        for c in range(-(-k.shape[2] // chunk_tokens)):
            a, b = c * chunk_tokens, min(k.shape[2], (c + 1) * chunk_tokens)
            jobs.append((li, L.PART_KEYS, c, k[:, :, a:b]))
            jobs.append((li, L.PART_VALUES, c, v[:, :, a:b]))

    def work(job, _):
        return floatctx.encode(_bits(job[3]), kv.dtype_name, params)

    # Encoding defaults to one thread: with two, NumPy/BLAS inside each job already use the cores and
    # the jobs contend (kvz bench, bf16: 41 MB/s with 1 thread, 29-35 MB/s with 2).
    _run_ordered(jobs, work, 1 if threads is None else threads, lambda job, payload: writer.write_section(
        L.SECTION_KV, payload, layer=job[0], part=job[1], chunk=job[2]), progress)
    return writer.close()


def _run_ordered(jobs, work, threads, consume, progress=None, prepare=None):
    """Run ``work(job, prepared)`` in a bounded window of threads, in order.

    ``prepare(job)`` runs in the calling thread (file reads: file objects are
    not thread-safe); ``consume(job, result)`` also runs there, in job order.
    At most ``2 * threads`` jobs are in flight, which bounds memory.
    """
    prepare = prepare or (lambda job: None)
    n = _threads(threads)

    def done(job, result):
        consume(job, result)
        if progress:
            progress(1)

    if n == 1 or len(jobs) < 2:
        for job in jobs:
            done(job, work(job, prepare(job)))
        return
    with ThreadPoolExecutor(n) as ex:
        window = []
        for job in jobs:
            window.append((job, ex.submit(work, job, prepare(job))))
            if len(window) >= 2 * n:
                j, f = window.pop(0)
                done(j, f.result())
        for j, f in window:
            done(j, f.result())


def encode(cache, model=None, *, tier: str = "lossless", chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
           tokens=None, info: dict | None = None, threads: int | None = None, **options) -> bytes:
    """Encode a KV cache to .kvz bytes.

    Parameters
    ----------
    cache : DynamicCache, tuple of (key, value) pairs, or KVCache
    model : transformers model or (model, tokenizer), optional
        Recorded by fingerprint; tiers that recompute the cache need it.
    tier : str
        ``"lossless"`` (bit-exact, no model needed to decode).
    chunk_tokens : int
        Tokens per section: the granularity of random access.
    tokens : int tensor [batch, seq], optional
        Token ids to store alongside the cache.
    threads : int, optional
        Sections coded in parallel; default 1 (faster here, see BENCHMARKS.md).
    **options
        Codec options (``scale_bits``, ``ways``, ``max_tables``, ``context``, ``coded_bits``).

    Examples
    --------
    >>> import torch, kvcodec
    >>> cache = [(torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4))]
    >>> data = kvcodec.encode(cache)
    >>> out = kvcodec.decode(data, output="kvcache")
    >>> out.equal(kvcodec.KVCache([cache[0][0]], [cache[0][1]]))
    True
    """
    buf = io.BytesIO()
    _write(buf, cache, model, tier, chunk_tokens, tokens, info, threads, options)
    return buf.getvalue()


def _open_path(path, mode):
    import fsspec

    return fsspec.open(os.fspath(path) if isinstance(path, os.PathLike) else path, mode).open()


def save(path, cache, model=None, **kwargs) -> int:
    """Encode ``cache`` to ``path`` (local path or fsspec URL), streaming; returns bytes written.

    Written to ``path + '.tmp'`` first and renamed on success for local paths, so
    a crash never leaves a half-written file under the final name.
    """
    progress = kwargs.pop("progress", None)
    enc = {k: kwargs.pop(k) for k in ("tier", "chunk_tokens", "tokens", "info", "threads") if k in kwargs}
    is_local = isinstance(path, os.PathLike) or "://" not in str(path)
    target = os.fspath(path) if is_local else path
    tmp = f"{target}.tmp" if is_local else target
    f = _open_path(tmp, "wb")
    try:
        n = _write(f, cache, model, enc.get("tier", "lossless"), enc.get("chunk_tokens", DEFAULT_CHUNK_TOKENS),
                   enc.get("tokens"), enc.get("info"), enc.get("threads"), kwargs, progress)
    except BaseException:
        f.close()
        if is_local and os.path.exists(tmp):
            os.remove(tmp)
        raise
    f.close()
    if is_local:
        os.replace(tmp, target)
    return n


# --- decoding ------------------------------------------------------------------
class KvzFile:
    """An open .kvz file: header-level facts, and per-layer lazy decoding.

    >>> # with kvcodec.open_kvz("cache.kvz") as f: k, v = f.layer(3)
    """

    def __init__(self, source, model=None, *, limits: dict | None = None, threads: int | None = None):
        self._owned = None
        if isinstance(source, (str, os.PathLike)) and "://" in str(source):
            self._owned = _open_path(source, "rb")
            source = self._owned
        self.reader = KvzReader(source, limits=limits)
        self.header = self.reader.header
        self.threads = threads
        if model is not None:
            check_model(self.header, model)

    @property
    def dtype(self) -> torch.dtype:
        return DTYPE_BY_NAME[self.header.dtype]

    def tokens(self) -> torch.Tensor | None:
        h = self.header
        if not h.num_tokens:
            return None
        e = self.reader.entry(L.SECTION_TOKENS)
        if e.length != 4 * h.batch * h.num_tokens:
            raise FormatError(f"tokens section has {e.length} bytes, expected {4 * h.batch * h.num_tokens}",
                              field="Payload_Length", offset=e.offset + 16)
        ids = np.frombuffer(self.reader.read_payload(e), dtype="<u4").astype(np.int64)
        return torch.from_numpy(ids.reshape(h.batch, h.num_tokens))

    def _decode(self, layers, progress=None) -> dict:
        """Decode the keys and values of ``layers``: {(layer, part): tensor}."""
        h = self.header
        outs = {}
        jobs = []
        for li in layers:
            lay = h.layers[li]
            for p in (L.PART_KEYS, L.PART_VALUES):
                dim = lay.k_dim if p == L.PART_KEYS else lay.v_dim
                outs[li, p] = np.empty((h.batch, lay.kv_heads, lay.seq_len, dim), dtype=_NP_UINT[h.itemsize])
            for c in range(lay.chunks(h.chunk_tokens)):
                jobs += [(li, L.PART_KEYS, c), (li, L.PART_VALUES, c)]

        def prepare(job):
            e = self.reader.entry(L.SECTION_KV, *job)
            return self.reader.read_payload(e), e.payload_offset

        def work(job, prepared):
            li, p, c = job
            lay = h.layers[li]
            a, b = lay.chunk_range(c, h.chunk_tokens)
            shape = (h.batch, lay.kv_heads, b - a, lay.k_dim if p == L.PART_KEYS else lay.v_dim)
            whole = lay.chunks(h.chunk_tokens) == 1  # decode straight into the output, no copy
            return floatctx.decode(prepared[0], shape, h.dtype, offset=prepared[1],
                                   out=outs[li, p] if whole else None)

        def put(job, arr):
            li, p, c = job
            if arr is not outs[li, p]:
                a, b = h.layers[li].chunk_range(c, h.chunk_tokens)
                outs[li, p][:, :, a:b] = arr

        _run_ordered(jobs, work, self.threads, put, progress, prepare)
        return {key: _tensor(arr, self.dtype) for key, arr in outs.items()}

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode one layer's keys and values, reading only its sections."""
        if not 0 <= i < len(self.header.layers):
            raise IndexError(f"layer {i} of {len(self.header.layers)}")
        d = self._decode([i])
        return d[i, L.PART_KEYS], d[i, L.PART_VALUES]

    def num_sections(self) -> int:
        return len(self.reader.sections)

    def to_kvcache(self, progress=None) -> KVCache:
        """Decode the whole file."""
        h = self.header
        n = len(h.layers)
        d = self._decode(range(n), progress)
        return KVCache([d[i, L.PART_KEYS] for i in range(n)], [d[i, L.PART_VALUES] for i in range(n)],
                       self.tokens(), h.start_position,
                       [lay.sliding_window for lay in h.layers], [lay.cumulative_length for lay in h.layers])

    def close(self):
        self.reader.close()
        if self._owned is not None:
            self._owned.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def check_model(header, model) -> None:
    """Raise :class:`ModelMismatch` if ``model`` is not the one recorded in the file."""
    if header.model is None:
        return
    rec = _model_record(model)
    if rec["fingerprint"] != header.model["fingerprint"]:
        raise ModelMismatch(f"file was made with model {header.model['fingerprint'][:16]}…, "
                            f"the model given is {rec['fingerprint'][:16]}…", field="Header.model.fingerprint",
                            offset=L.PREAMBLE.size)


def open_kvz(source, model=None, **kwargs) -> KvzFile:
    """Open a .kvz file (bytes, path, fsspec URL or file object) for lazy reading."""
    return KvzFile(source, model, **kwargs)


def _convert(kv: KVCache, output: str):
    if output == "dynamic":
        return kv.to_dynamic_cache()
    if output == "kvcache":
        return kv
    if output == "legacy":
        return kv.to_legacy()
    raise ConfigError(f"output must be 'dynamic', 'kvcache' or 'legacy', not {output!r}")


def decode(data, model=None, *, output: str = "dynamic", limits: dict | None = None, threads: int | None = None,
           progress=None):
    """Decode .kvz bytes into a cache (a ``DynamicCache`` by default).

    ``output="kvcache"`` returns a :class:`KVCache`, ``"legacy"`` a tuple of pairs.
    ``limits`` caps what the file may ask for (``max_output_bytes`` ...).
    """
    with KvzFile(data, model, limits=limits, threads=threads) as f:
        return _convert(f.to_kvcache(progress), output)


def load(path, model=None, **kwargs):
    """Load a .kvz file from a local path or fsspec URL; see :func:`decode`."""
    output = kwargs.pop("output", "dynamic")
    progress = kwargs.pop("progress", None)
    f = _open_path(path, "rb")
    try:
        with KvzFile(f, model, **kwargs) as kf:
            return _convert(kf.to_kvcache(progress), output)
    finally:
        f.close()


def inspect(source, *, verify_checksums: bool = False) -> dict:
    """Describe a .kvz file from its header and index, without decoding payloads.

    With ``verify_checksums=True`` every payload is also read and its checksum
    checked (still no decoding).  The result is JSON-serialisable.
    """
    owned = None
    if isinstance(source, (str, os.PathLike)) and "://" in str(source):
        owned = source = _open_path(source, "rb")
    try:
        with KvzReader(source) as r:
            h = r.header
            sections = []
            for e in r.sections:
                d = {"type": e.name, "offset": e.offset, "bytes": e.length}
                if e.section_type == L.SECTION_KV:
                    lay = h.layers[e.layer]
                    a, b = lay.chunk_range(e.chunk, h.chunk_tokens)
                    dim = lay.k_dim if e.part == L.PART_KEYS else lay.v_dim
                    comps = h.batch * lay.kv_heads * (b - a) * dim
                    d.update(layer=e.layer, part="keys" if e.part == L.PART_KEYS else "values", chunk=e.chunk,
                             tokens=[a, b], components=comps,
                             bits_per_component=round(8 * e.length / comps, 4) if comps else None)
                sections.append(d)
            status = "header, index and footer checksums ok; payloads not read"
            if verify_checksums:
                r.verify_checksums()
                status = "all checksums ok"
            raw = h.tensor_bytes()
            return {
                "format_version": f"{r.version[0]}.{r.version[1]}",
                "file_bytes": r.size,
                "tier": h.tier,
                "codec": {"id": h.codec_id, "params": h.codec_params},
                "model": h.model,
                "dtype": h.dtype,
                "batch": h.batch,
                "num_layers": len(h.layers),
                "kv_heads": sorted({lay.kv_heads for lay in h.layers}),
                "head_dims": sorted({lay.k_dim for lay in h.layers} | {lay.v_dim for lay in h.layers}),
                "tokens": max(lay.seq_len for lay in h.layers),
                "start_position": h.start_position,
                "has_token_ids": bool(h.num_tokens),
                "chunk_tokens": h.chunk_tokens,
                "raw_tensor_bytes": raw,
                "ratio": round(raw / r.size, 4) if r.size else None,
                "bits_per_component": round(8 * r.size / (raw / h.itemsize), 4) if raw else None,
                "info": h.raw.get("info"),
                "checksums": status,
                "sections": sections,
            }
    finally:
        if owned is not None:
            owned.close()

