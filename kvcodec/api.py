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
from .cache import bit_patterns as _bits
from .cache import from_bit_patterns as _tensor
from .container import layout as L
from .container.header import TIERS
from .container.reader import KvzReader
from .container.writer import KvzWriter
from .errors import ConfigError, FormatError, ModelMismatch
from .stages import floatctx

__all__ = ["encode", "decode", "save", "load", "inspect", "open_kvz", "KvzFile"]

DEFAULT_CHUNK_TOKENS = 4096
_NP_UINT = {2: np.uint16, 4: np.uint32}


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


_TOK_FP: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _tokenizer_fp(tok) -> str:
    """:func:`kvcodec.models.tokenizer_fingerprint`, memoised per tokenizer object and vocabulary size."""
    from .models import tokenizer_fingerprint

    stamp = len(tok)
    try:
        hit = _TOK_FP.get(tok)
    except TypeError:  # not weak-referenceable
        return tokenizer_fingerprint(tok)
    if hit and hit[0] == stamp:
        return hit[1]
    fp = tokenizer_fingerprint(tok)
    _TOK_FP[tok] = (stamp, fp)
    return fp


def _model_record(model) -> dict | None:
    if model is None:
        return None
    if isinstance(model, tuple):  # (model, tokenizer) as returned by load_model
        model, tok = model
    else:
        tok = None
    rec = {"fingerprint": fingerprint_of(model)}
    if tok is not None:
        rec["tokenizer"] = _tokenizer_fp(tok)
    arch = getattr(getattr(model, "config", None), "model_type", None)
    if isinstance(arch, str):
        rec["architecture"] = arch
    return rec


# --- tensors <-> bit patterns ------------------------------------------------
# --- encoding ------------------------------------------------------------------
def _header(kv: KVCache, tier: str, codec: dict, chunk_tokens: int, model, info, tokens: dict | None = None,
            num_tokens: int | None = None) -> dict:
    h = {
        "format": "kvz",
        "tier": tier,
        "codec": codec,
        "cache": {
            "dtype": kv.dtype_name,
            "batch": kv.batch,
            "chunk_tokens": chunk_tokens,
            "start_position": int(kv.start_position),
            "num_tokens": (0 if kv.tokens is None else int(kv.tokens.shape[1])) if num_tokens is None else num_tokens,
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
    if tokens is not None:  # format 1.1: runs of identical layers are written once, with "repeat"
        h["tokens"] = tokens
        runs = []
        for lay in h["cache"]["layers"]:
            if runs and {k: x for k, x in runs[-1].items() if k != "repeat"} == lay:
                runs[-1]["repeat"] = runs[-1].get("repeat", 1) + 1
            else:
                runs.append(dict(lay))
        h["cache"]["layers"] = runs
    return h


_UNSET = object()


def _resolve_tier(tier, model, tolerance):
    if tier is None:
        tier = "lossless" if model is None else ("tokens" if tolerance is not _UNSET and tolerance != 0 else "exact")
    if tier not in TIERS:
        raise ConfigError(f"unknown tier {tier!r}; this version implements {sorted(TIERS)}")
    if tier in ("lossless", "lossy"):
        if tolerance is not _UNSET and tolerance not in (0, None):
            raise ConfigError("tolerance applies to the token tiers (tier='tokens')")
        return tier, None
    if model is None:
        raise ConfigError(f"tier {tier!r} stores the cache as its tokens and needs the model: encode(cache, model)")
    if tolerance is _UNSET:
        tolerance = 0 if tier == "exact" else None
    if tier == "exact" and tolerance != 0:
        raise ConfigError("tier 'exact' is bit-identical (tolerance 0); use tier='tokens' with tolerance=eps")
    if tolerance is not None and not (isinstance(tolerance, (int, float)) and tolerance >= 0):
        raise ConfigError("tolerance must be None or a number >= 0")
    return tier, tolerance


def _write(sink, cache, model, tier, chunk_tokens: int, tokens, info, threads, options, progress=None, tok=None):
    tok = tok or {}
    tier, tolerance = _resolve_tier(tier, model, tok.get("tolerance", _UNSET))
    if not isinstance(chunk_tokens, int) or not 1 <= chunk_tokens <= L.MAX_CHUNK_TOKENS:
        raise ConfigError(f"chunk_tokens must be an int in [1, {L.MAX_CHUNK_TOKENS}]")
    kv = to_canonical(cache)
    if tokens is not None:
        tokens = torch.as_tensor(tokens)
        if tokens.dim() == 1:
            tokens = tokens.unsqueeze(0)
    if tier in ("exact", "tokens"):
        from . import tokentier

        if options:
            raise ConfigError(f"options {sorted(options)} apply to the lossless tier only")
        try:
            enc = tokentier.prepare(cache, kv, model, tier=tier, tokens=tokens,
                                    token_model=tok.get("token_model") or ("draft" if tok.get("draft") else "lm"),
                                    draft=tok.get("draft"), schedule=tok.get("schedule"),
                                    attention_mask=tok.get("attention_mask"), tolerance=tolerance)
        except tokentier.Fallback as e:
            import warnings

            from .errors import FallbackWarning

            warnings.warn(f"tier {tier!r} cannot store this cache ({e}); stored losslessly instead",
                          FallbackWarning, stacklevel=3)
            info = {**({"kvcodec_version": __version__} if info is None else info), "fallback": str(e)}
            tier = "lossless"
        else:
            return _write_token_tier(sink, kv, enc, model, tier, chunk_tokens, tolerance, info, progress)
    if tokens is not None:
        kv = KVCache(kv.keys, kv.values, tokens, kv.start_position, kv.sliding_window, kv.cumulative_length)
    if tier == "lossy":
        from .stages import quant

        options = dict(options)
        max_kl = options.pop("max_kl", None)
        params = quant.check_config(options)
        codec_id = quant.CODEC_ID
        for t in kv.keys + kv.values:
            if t.shape[-1] & (t.shape[-1] - 1) and params["quantizer"] in ("uniform", "lloyd"):
                raise ConfigError(f"{codec_id}: head dimension {t.shape[-1]} is not a power of two (the Hadamard "
                                  "rotation needs one)")
        if max_kl is not None:
            if params["quantizer"] != "uniform" or options.get("step") is not None:
                raise ConfigError("max_kl= picks the step of the uniform quantizer; do not give step=")
            params["step"], params["calibrated_kl"] = _step_for_kl(kv, model, float(max_kl), params)
            params["max_kl"] = float(max_kl)
            options["step"] = params["step"]  # fixed: no rate loop
        elif params["quantizer"] == "uniform" and params["step"] is None:
            params["step"] = _global_step(kv, params)
    else:
        params = floatctx.check_config(dict(options), kv.dtype_name)
        codec_id = floatctx.CODEC_ID
    ids = None if kv.tokens is None else kv.tokens.to("cpu", torch.int64).numpy()
    if ids is not None and ids.size and (ids.min() < 0 or ids.max() >= 1 << 32):
        raise ValueError("token ids must be in [0, 2**32)")
    closed_loop = tier == "lossy" and params.get("max_kl") is None and options.get("step") is None \
        and params["quantizer"] == "uniform"
    jobs = []
    for li, (k, v) in enumerate(zip(kv.keys, kv.values)):
        for c in range(-(-k.shape[2] // chunk_tokens)):
            a, b = c * chunk_tokens, min(k.shape[2], (c + 1) * chunk_tokens)
            jobs.append((li, L.PART_KEYS, c, k[:, :, a:b]))
            jobs.append((li, L.PART_VALUES, c, v[:, :, a:b]))

    def work(job, _):
        if tier == "lossy":
            li, part, c, t = job
            return _quantize_slice(t, params, kv, li, part, c * chunk_tokens)
        return floatctx.encode(_bits(job[3]), kv.dtype_name, params)

    # Encoding defaults to one thread: with two, NumPy/BLAS inside each job already use the cores and
    # the jobs contend (kvz bench, bf16: 41 MB/s with 1 thread, 29-35 MB/s with 2).
    threads = 1 if threads is None else threads
    payloads = _fit_rate(kv, jobs, work, threads, params, codec_id) if closed_loop else None
    writer = KvzWriter(sink, _header(kv, tier, {"id": codec_id, "params": params}, chunk_tokens, model, info))
    if ids is not None:
        writer.write_section(L.SECTION_TOKENS, ids.astype("<u4").tobytes())

    def put(job, payload):
        writer.write_section(L.SECTION_KV, payload, layer=job[0], part=job[1], chunk=job[2])

    if payloads is None:
        _run_ordered(jobs, work, threads, put, progress)
    else:
        for job, payload in zip(jobs, payloads):
            put(job, payload)
            if progress:
                progress(1)
    return writer.close()


def _quantize_slice(t: torch.Tensor, params: dict, kv: KVCache, li: int, part: int, start: int,
                    step: float | None = None) -> bytes:
    """The vq_rans payload of the slice ``t`` (tokens ``start ..`` of layer ``li``): the cache's first
    ``sink`` tokens and last ``window`` tokens are stored exactly."""
    from .stages import quant

    seq, n = kv.keys[li].shape[2], t.shape[2]
    end = start + n
    exact = max(0, end - max(start, seq - params["window"])) if params["window"] else 0
    head = min(max(0, params["sink"] - start), n - exact)
    return quant.encode(t.float().cpu().numpy(), params, exact_tokens=exact, dtype=kv.dtype_name,
                        exact_bits=_bits(t[:, :, n - exact:]) if exact else None, head_tokens=head,
                        head_bits=_bits(t[:, :, :head]) if head else None, step=step, part=part, layer=li,
                        num_layers=kv.num_layers, rotq=_kernel_rotq(t))


def _kernel_rotq(t: torch.Tensor):
    """The Triton rotation + quantization of slice ``t`` for the uniform quantizer, used when ``t`` is on a
    GPU and Triton is installed, or when ``KVCODEC_TRITON=1`` (CPU tensors under ``TRITON_INTERPRET=1``:
    how the tests check that both paths write the same bytes); else None (NumPy)."""
    from . import _kernels

    if not ((t.is_cuda or os.environ.get("KVCODEC_TRITON") == "1") and _kernels.triton_available()):
        return None

    def rotq(step, seed, a, b):
        from ._kernels import vq

        norms, q = vq.rotate_quantize(t[:, :, a:b], float(step), int(seed))
        return norms.cpu().numpy(), q.cpu().numpy().astype(np.int64)

    return rotq


def _fit_rate(kv: KVCache, jobs, work, threads, params: dict, codec_id: str) -> list[bytes]:
    """Closed loop on the rate of the lossy tier: code every slice, measure, rescale ``params['step']`` and
    repeat until indices + norms + tables fit in ``bits=`` per component (rate ~ -log2 step); returns the
    payloads of the chosen step.  Two-sided: the order-0 estimate the first step came from overshoots what
    the context coder achieves by ~0.5 bit."""
    comps = sum(t.numel() for t in kv.keys + kv.values)
    best, lowest = None, None
    for _ in range(8):
        payloads = []
        _run_ordered(jobs, work, threads, lambda job, pl: payloads.append(pl))
        rate = 8 * sum(len(pl) for pl in payloads) / max(comps, 1)
        if rate <= params["bits"] and (best is None or rate > best[0]):
            best = (rate, params["step"], payloads)
        if lowest is None or rate < lowest[0]:
            lowest = (rate, params["step"], payloads)
        if rate <= params["bits"] and params["bits"] - rate < 0.02:
            break
        params["step"] = float(np.float32(params["step"] * 2.0 ** (rate - params["bits"] + 0.005)))
    if best is None:  # side information alone exceeds the budget (tiny caches): the lowest rate reached
        import warnings

        warnings.warn(f"{codec_id}: bits={params['bits']} not reachable for this cache (norms and tables "
                      f"alone cost more); stored at {lowest[0]:.2f} bits per component", stacklevel=4)
        best = lowest
    _, params["step"], payloads = best
    return payloads


def _step_for_kl(kv: KVCache, model, max_kl: float, params: dict, calib_tokens: int = 32) -> tuple[float, float]:
    """The coarsest uniform step whose cache keeps the model's next-token distributions within ``max_kl``
    (mean KL, bits) on the cache's own last ``calib_tokens`` tokens: those are fed teacher-forced on top of the
    rest of the cache, exact and quantized.  Needs the model and the tokens (given or recovered)."""
    from .tokentier import recover, split_model

    if model is None:
        raise ConfigError("max_kl= needs the model: encode(cache, model, tier='lossy', max_kl=...)")
    mdl, _ = split_model(model)
    s = kv.seq_len
    n = min(calib_tokens, s // 4)
    if n < 1 or kv.start_position or any(k.shape[2] != s for k in kv.keys):
        raise ConfigError("max_kl= needs a cache of at least 4 tokens from position 0 with every layer complete")
    tokens = kv.tokens
    if tokens is None:
        rec = recover(kv, mdl)
        if not rec.ok:
            raise ConfigError(f"max_kl= needs the cache's tokens: pass tokens= ({rec.reason})")
        tokens = rec.tokens
    from .runtime import cache_kwarg

    def logp(cache_kv: KVCache):
        prefix = KVCache([k[:, :, :s - n] for k in cache_kv.keys], [v[:, :, :s - n] for v in cache_kv.values])
        with torch.no_grad():
            out = mdl(tokens[:, s - n:].to(next(mdl.parameters()).device), use_cache=True,
                      **{cache_kwarg(mdl): prefix.to_dynamic_cache()})
        return torch.log_softmax(out.logits.double(), dim=-1)

    ref = logp(kv)
    dtype = kv.dtype

    def kl_at(step: float) -> float:
        keys, values = [], []
        for li in range(kv.num_layers):
            for part, t, dst in ((0, kv.keys[li], keys), (1, kv.values[li], values)):
                payload = _quantize_slice(t, params, kv, li, part, 0, step=step)
                dst.append(_tensor(_dequantize(payload, tuple(t.shape), kv.dtype_name, 0, dtype), dtype))
        lq = logp(KVCache(keys, values))
        return float(((ref.exp() * (ref - lq)).sum(-1) / np.log(2)).mean())

    lo, hi = -5.0, 2.0  # log2 step: lo (about 7 bits per component) meets the target (checked), hi is coarse
    best = (2.0 ** lo, kl_at(2.0 ** lo))
    if best[1] > max_kl:
        raise ConfigError(f"max_kl={max_kl} is not reachable by the lossy tier on this cache (the finest step "
                          f"gives {best[1]:.3g} bits); use tier='exact' or 'lossless'")
    for _ in range(7):
        mid = (lo + hi) / 2
        d = kl_at(2.0 ** mid)
        if d <= max_kl:
            lo, best = mid, (2.0 ** mid, d)
        else:
            hi = mid
    return float(np.float32(best[0])), best[1]


def _global_step(kv: KVCache, params: dict) -> float:
    """One uniform step for the whole cache (equal distortion everywhere: MSE-optimal allocation), chosen so
    that indices plus norms average ``params['bits']`` bits per component (order-0 estimate; the context
    coder then lands at or below it)."""
    from .stages import quant

    zs, comps, vecs = [], 0, 0
    for t in kv.keys + kv.values:
        if not t.numel():
            continue
        x = t.float().reshape(-1, t.shape[-1]).numpy()
        sub = x[:: max(1, x.shape[0] // 4096)]
        zs.append(quant._directions(sub, params["seed"])[1].ravel())
        comps += t.numel()
        vecs += x.shape[0]
    side = 12.0 * vecs / max(comps, 1)  # fp16 norms coded by float_ctx_rans: ~12 bits each (measured)
    return quant.step_for_rate(np.concatenate(zs), max(0.05, params["bits"] - side))


def _write_token_tier(sink, kv: KVCache, enc, model, tier, chunk_tokens, tolerance, info, progress):
    from . import tokentier
    from .stages import residual

    base = {"kvcodec_version": __version__} if info is None else dict(info)
    base.setdefault("schedule_source", enc.how)
    header = _header(kv, tier, {"id": residual.CODEC_ID, "params": {}}, chunk_tokens, model, base, enc.header_tokens,
                     num_tokens=int(enc.tokens.shape[1]))
    writer = KvzWriter(sink, header)
    for r, stream in enumerate(enc.streams):
        writer.write_section(L.SECTION_TOKEN_STREAM, tokentier.pack_stream(stream), chunk=r)
    if tolerance is not None:
        payloads, sums = [], []
        for li, (k, v) in enumerate(zip(kv.keys, kv.values)):
            for c in range(-(-k.shape[2] // chunk_tokens)):
                for part, orig, reg in ((L.PART_KEYS, k, enc.regen.keys[li]),
                                        (L.PART_VALUES, v, enc.regen.values[li])):
                    a, b = c * chunk_tokens, min(orig.shape[2], (c + 1) * chunk_tokens)
                    payload, digest = residual.encode(_bits(orig[:, :, a:b]), _bits(reg[:, :, a:b]), kv.dtype_name,
                                                      tolerance or 0.0)
                    sums.append(digest)
                    payloads.append(((li, part, c), payload))
                    if progress:
                        progress(1)
        writer.write_section(L.SECTION_TENSOR_CHECKSUMS, np.asarray(sums, dtype="<u8").tobytes())
        for (li, part, c), payload in payloads:
            if payload is not None:
                writer.write_section(L.SECTION_RESIDUAL, payload, layer=li, part=part, chunk=c)
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


def encode(cache, model=None, *, tier: str | None = None, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
           tokens=None, token_model: str | None = None, draft=None, schedule=None, attention_mask=None,
           tolerance=_UNSET, info: dict | None = None, threads: int | None = None, **options) -> bytes:
    """Encode a KV cache to .kvz bytes.

    Parameters
    ----------
    cache : DynamicCache (or :class:`~kvcodec.tokens.RecordingCache`), tuple of (key, value) pairs, or KVCache
    model : transformers model or (model, tokenizer), optional
        The model the cache was made with.  Given a model, the default tier is
        ``"exact"``: the cache is stored as its tokens plus a residual and
        decoding recomputes it with the model.
    tier : str
        ``"exact"`` (default with a model: tokens + residual, bit-identical),
        ``"tokens"`` (tokens only - restore is recompute - or, with
        ``tolerance=eps``, a residual bounding the error by eps), or
        ``"lossless"`` (default without a model: the tensors themselves,
        bit-exact, no model needed to decode).  When the token tiers cannot
        store the cache (unsupported architecture, tokens not recoverable, a
        cache not starting at position 0) the encoder stores it losslessly and
        warns (:class:`~kvcodec.errors.FallbackWarning`).
    chunk_tokens : int
        Tokens per kv / residual section: the granularity of random access.
    tokens : int tensor [batch, seq], optional
        The cache's token ids.  Token tiers recover them from the cache when
        omitted; the lossless tier stores them alongside when given.
    token_model : ``"lm"`` (default), ``"static"`` or ``"draft"``
        Probability model of the token channel: the model itself (decoding
        runs it token by token), an adaptive context model (decoding = one
        prefill), or ``draft`` (a smaller model with the same tokenizer).
    schedule : None, ``"infer"``, ``"prefill"``, list of call sizes or of ``[size, count]`` runs
        How the cache was filled (forward calls and their sizes).  Default:
        the schedule a :class:`~kvcodec.tokens.RecordingCache` recorded, else
        inferred (one prefill; or one prefill then single steps, as
        ``generate()`` does).
    attention_mask : [batch, seq] 0/1, optional
        Left padding of a padded batch (inferred from pad tokens when omitted).
    tolerance : float or None
        Token tiers: 0 = lossless residual, eps = max abs error eps, None = no residual.
    threads : int, optional
        Sections coded in parallel; default 1 (faster here, see BENCHMARKS.md).
    **options
        Lossless codec options (``scale_bits``, ``ways``, ``max_tables``, ``context``, ``coded_bits``).

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
    _write(buf, cache, model, tier, chunk_tokens, tokens, info, threads, options,
           tok=dict(token_model=token_model, draft=draft, schedule=schedule, attention_mask=attention_mask,
                    tolerance=tolerance))
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
    tok = {k: kwargs.pop(k) for k in ("token_model", "draft", "schedule", "attention_mask", "tolerance")
           if k in kwargs}
    is_local = isinstance(path, os.PathLike) or "://" not in str(path)
    target = os.fspath(path) if is_local else path
    tmp = f"{target}.tmp" if is_local else target
    f = _open_path(tmp, "wb")
    try:
        n = _write(f, cache, model, enc.get("tier"), enc.get("chunk_tokens", DEFAULT_CHUNK_TOKENS),
                   enc.get("tokens"), enc.get("info"), enc.get("threads"), kwargs, progress, tok)
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
def _dequantize(payload, shape, dtype_name: str, offset: int, dtype: torch.dtype) -> np.ndarray:
    """A vq_rans slice as bit patterns of ``dtype`` (float32 values rounded by torch: deterministic)."""
    from .stages import quant

    dec = quant.decode(payload, shape, dtype_name, offset=offset)
    out = np.empty(shape, dtype=_NP_UINT[torch.empty((), dtype=dtype).element_size()])
    h0, t = dec.head_tokens, shape[2]
    out[:, :, h0:t - dec.exact] = _bits(torch.from_numpy(dec.values).to(dtype))
    if h0:
        out[:, :, :h0] = dec.head
    if dec.exact:
        out[:, :, t - dec.exact:] = dec.tail
    return out


class KvzFile:
    """An open .kvz file: header-level facts, and per-layer lazy decoding.

    >>> # with kvcodec.open_kvz("cache.kvz") as f: k, v = f.layer(3)
    """

    def __init__(self, source, model=None, *, draft=None, limits: dict | None = None, threads: int | None = None):
        self._owned = None
        self.model, self.draft, self._regen = model, draft, None
        if isinstance(source, (str, os.PathLike)) and "://" in str(source):
            self._owned = _open_path(source, "rb")
            source = self._owned
        self.reader = KvzReader(source, limits=limits)
        self.header = self.reader.header
        self.threads = threads
        if model is not None:
            check_model(self.header, model)
        t = self.header.tokens
        if t is not None and draft is not None and t.draft is not None:
            check_model(self.header, draft, t.draft, "draft")

    @property
    def is_token_tier(self) -> bool:
        return self.header.tokens is not None

    def _regenerated(self):
        """Token tiers: (tokens, regenerated KVCache), decoded once."""
        if self._regen is None:
            from . import tokentier

            h = self.header
            if self.model is None:
                raise ConfigError(f"this file's tier {h.tier!r} is restored by recomputing the cache with the model "
                                  "it was made with: decode(data, model)")
            if h.tokens.draft is not None and self.draft is None:
                raise ConfigError("this file's tokens were coded with a draft model: decode(data, model, draft=...)")
            streams = []
            for r in range(h.batch):
                e = self.reader.entry(L.SECTION_TOKEN_STREAM, 0, 0, r)
                streams.append(tokentier.unpack_stream(self.reader.read_payload(e),
                                                       expect_tokens=h.num_tokens - h.tokens.padding[r],
                                                       chunk=h.tokens.chunk_tokens, offset=e.payload_offset))
            tokens, regen = tokentier.regenerate(h, streams, self.model, self.draft)
            for i, lay in enumerate(h.layers):
                if (regen.keys[i].shape != (h.batch, lay.kv_heads, lay.seq_len, lay.k_dim)
                        or regen.values[i].shape != (h.batch, lay.kv_heads, lay.seq_len, lay.v_dim)
                        or regen.dtype != self.dtype):
                    raise ModelMismatch(f"layer {i}: the model regenerates {tuple(regen.keys[i].shape)} "
                                        f"{regen.dtype}, the header says {(h.batch, lay.kv_heads, lay.seq_len)} "
                                        f"{h.dtype}", field=f"Header.cache.layers[{i}]", offset=L.PREAMBLE.size)
            self._regen = (tokens, regen)
        return self._regen

    def regenerated(self) -> KVCache:
        """Token tiers: the cache the model regenerates from the decoded tokens, before the residuals."""
        return self._regenerated()[1]

    @property
    def dtype(self) -> torch.dtype:
        return DTYPE_BY_NAME[self.header.dtype]

    def tokens(self) -> torch.Tensor | None:
        h = self.header
        if self.is_token_tier:
            return self._regenerated()[0]
        if not h.num_tokens:
            return None
        e = self.reader.entry(L.SECTION_TOKENS)
        if e.length != 4 * h.batch * h.num_tokens:
            raise FormatError(f"tokens section has {e.length} bytes, expected {4 * h.batch * h.num_tokens}",
                              field="Payload_Length", offset=e.offset + 16)
        ids = np.frombuffer(self.reader.read_payload(e), dtype="<u4").astype(np.int64)
        return torch.from_numpy(ids.reshape(h.batch, h.num_tokens))

    def _tensor_checksums(self) -> dict:
        h = self.header
        e = self.reader.entry(L.SECTION_TENSOR_CHECKSUMS)
        slices = h.slices()
        if e.length != 8 * len(slices):
            raise FormatError(f"tensor_checksums has {e.length} bytes, the header implies {8 * len(slices)}",
                              field="Payload_Length", offset=e.offset + 16)
        sums = np.frombuffer(self.reader.read_payload(e), dtype="<u8").tolist()
        return {s: (x, e.payload_offset + 8 * i) for i, (s, x) in enumerate(zip(slices, sums))}

    def _decode_token_tier(self, layers, progress=None, regen: KVCache | None = None) -> dict:
        from .stages import residual

        h = self.header
        regen = self._regenerated()[1] if regen is None else regen
        sums = self._tensor_checksums() if h.tokens.has_residual else None
        outs = {}
        for li in layers:
            lay = h.layers[li]
            for p, t in ((L.PART_KEYS, regen.keys[li]), (L.PART_VALUES, regen.values[li])):
                if sums is None:
                    outs[li, p] = t
                    continue
                bits = _bits(t).copy()
                for c in range(lay.chunks(h.chunk_tokens)):
                    a, b = lay.chunk_range(c, h.chunk_tokens)
                    digest, at = sums[li, p, c]
                    payload = None
                    if self.reader.has(L.SECTION_RESIDUAL, li, p, c):
                        e = self.reader.entry(L.SECTION_RESIDUAL, li, p, c)
                        payload, at = self.reader.read_payload(e), e.payload_offset
                    bits[:, :, a:b] = residual.decode(payload, np.ascontiguousarray(bits[:, :, a:b]), h.dtype, digest,
                                                      offset=at, what=f"layer {li} {('keys', 'values')[p]} chunk {c}")
                    if progress:
                        progress(1)
                outs[li, p] = _tensor(bits, self.dtype)
        return outs

    def _decode(self, layers, progress=None, regen=None) -> dict:
        """Decode the keys and values of ``layers``: {(layer, part): tensor}."""
        h = self.header
        if self.is_token_tier:
            return self._decode_token_tier(layers, progress, regen)
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
            if h.codec_id == "vq_rans":
                return _dequantize(prepared[0], shape, h.dtype, prepared[1], self.dtype)
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
        """Decode one layer's keys and values, reading only its sections (token tiers regenerate the whole
        cache once, then apply this layer's residual)."""
        if not 0 <= i < len(self.header.layers):
            raise IndexError(f"layer {i} of {len(self.header.layers)}")
        d = self._decode([i])
        return d[i, L.PART_KEYS], d[i, L.PART_VALUES]

    def num_sections(self) -> int:
        return len(self.reader.sections)

    def to_kvcache(self, progress=None, *, regenerated: KVCache | None = None) -> KVCache:
        """Decode the whole file.  Token tiers: ``regenerated=`` applies the file's residuals to those tensors
        instead of regenerating the cache with the model (no model needed; no token ids in the result)."""
        h = self.header
        n = len(h.layers)
        d = self._decode(range(n), progress, regenerated)
        return KVCache([d[i, L.PART_KEYS] for i in range(n)], [d[i, L.PART_VALUES] for i in range(n)],
                       None if regenerated is not None else self.tokens(), h.start_position,
                       [lay.sliding_window for lay in h.layers], [lay.cumulative_length for lay in h.layers])

    def close(self):
        self.reader.close()
        if self._owned is not None:
            self._owned.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def check_model(header, model, recorded: dict | None = None, what: str = "model") -> None:
    """Raise :class:`ModelMismatch` if ``model`` is not the one recorded in the file."""
    recorded = header.model if recorded is None else recorded
    if recorded is None:
        return
    rec = _model_record(model)
    if rec["fingerprint"] != recorded["fingerprint"]:
        raise ModelMismatch(f"file was made with {what} {recorded['fingerprint'][:16]}…, "
                            f"the {what} given is {rec['fingerprint'][:16]}… (another model, another dtype or "
                            "modified weights)", field=f"Header.{what}.fingerprint", offset=L.PREAMBLE.size)
    if "tokenizer" in rec and "tokenizer" in recorded and rec["tokenizer"] != recorded["tokenizer"]:
        raise ModelMismatch(f"file was made with a {what} whose tokenizer differs from the one given",
                            field=f"Header.{what}.tokenizer", offset=L.PREAMBLE.size)


def open_kvz(source, model=None, **kwargs) -> KvzFile:
    # kwargs: draft=, limits=, threads=
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


def decode(data, model=None, *, draft=None, output: str = "dynamic", limits: dict | None = None,
           threads: int | None = None, progress=None):
    """Decode .kvz bytes into a cache (a ``DynamicCache`` by default).

    ``model`` is required for the token tiers (``exact``, ``tokens``): the cache
    is recomputed with it; it must be the model the file was made with
    (:class:`~kvcodec.errors.ModelMismatch` otherwise).  ``draft`` likewise for
    files whose tokens were coded with a draft model.  ``output="kvcache"``
    returns a :class:`KVCache`, ``"legacy"`` a tuple of pairs.  ``limits`` caps
    what the file may ask for (``max_output_bytes`` ...).
    """
    with KvzFile(data, model, draft=draft, limits=limits, threads=threads) as f:
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
    from .stages import quant

    owned = None
    if isinstance(source, (str, os.PathLike)) and "://" in str(source):
        owned = source = _open_path(source, "rb")
    try:
        with KvzReader(source) as r:
            h = r.header
            sections = []
            for e in r.sections:
                d = {"type": e.name, "offset": e.offset, "bytes": e.length}
                if e.section_type == L.SECTION_TOKEN_STREAM:
                    d.update(batch_row=e.chunk)
                if e.section_type in (L.SECTION_KV, L.SECTION_RESIDUAL):
                    lay = h.layers[e.layer]
                    a, b = lay.chunk_range(e.chunk, h.chunk_tokens)
                    dim = lay.k_dim if e.part == L.PART_KEYS else lay.v_dim
                    comps = h.batch * lay.kv_heads * (b - a) * dim
                    d.update(layer=e.layer, part="keys" if e.part == L.PART_KEYS else "values", chunk=e.chunk,
                             tokens=[a, b], components=comps,
                             bits_per_component=round(8 * e.length / comps, 4) if comps else None)
                    if h.tier == "lossy" and e.section_type == L.SECTION_KV:
                        d["coding"] = quant.describe(r.read_payload_prefix(e, 64),
                                                     (h.batch, lay.kv_heads, b - a, dim),
                                                     8 * h.itemsize)
                sections.append(d)
            status = "header, index and footer checksums ok; payloads not read"
            if verify_checksums:
                r.verify_checksums()
                status = "all checksums ok"
            raw = h.tensor_bytes()
            token_channel = None
            if h.tokens is not None:
                t = h.tokens
                coded = sum(h.num_tokens - p for p in t.padding)
                stream_bytes = sum(e.length for e in r.sections if e.section_type == L.SECTION_TOKEN_STREAM)
                token_channel = {
                    "token_model": t.token_model, "draft": t.draft, "schedule": t.raw["schedule"],
                    "padding": list(t.padding), "positions": t.positions, "tolerance": t.tolerance,
                    "max_abs_deviation": t.raw["max_abs_deviation"],
                    "coded_tokens": coded, "token_stream_bytes": stream_bytes,
                    "bits_per_token": round(8 * stream_bytes / coded, 4) if coded else None,
                    "residual_bytes": sum(e.length for e in r.sections if e.section_type == L.SECTION_RESIDUAL),
                    "procedure": t.raw["procedure"],
                }
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
                "token_channel": token_channel,
                "checksums": status,
                "sections": sections,
            }
    finally:
        if owned is not None:
            owned.close()

