"""Prediction across layers for the lossy tier (AQUA-KV): the arithmetic and the per-model predictors.

A lossy file coded with ``predictors=`` (quantizer ``weighted``, format 1.6, spec/kvz.md §13.1) stores, for
every quantized token, the residual after a linear prediction from the decoder's reconstruction of the layer
before (keys pre-RoPE; values also from the layer's own keys).  The predictors are a per-model profile fitted
once (:func:`calibrate_predictors`), stored apart (a safetensors file, :meth:`Predictors.save`) and named in
the file by their SHA-256: decoding needs them, never the model.  Every decoder-side operation is specified in
IEEE arithmetic so that every platform reconstructs the same bits:

* the RoPE rotation of position t and rotary pair i uses ``(c_t, s_t)`` from the binary64 recurrence
  ``c_0 = 1, s_0 = 0, (c_{t+1}, s_{t+1}) = (c_t C - s_t S, s_t C + c_t S)`` with the profile's binary64
  ``C = cos theta_i, S = sin theta_i`` (no libm on the decoder), rounded to binary32 and multiplied by the
  profile's ``scale`` in binary32; ``x' = x c + rotate_half(x) s`` in binary32 (rotate-half layout: pairs
  (i, i + D/2)), the inverse with ``-s``;
* a prediction is, per output j, ``acc = bias[j]``, then ``acc = acc + x[i] * W[i, j]`` for i = 0, 1, ... in
  binary32, weights and biases widened exactly from float16.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numba as nb
import numpy as np

from ._compat import llvmlite_shim
from .codecs.vq_rans import PREDICTED_KEY_RATIO
from .parallel import threads as worker_threads

llvmlite_shim()  # numba is loaded: let vLLM's workers start beside it (kvcodec/_compat.py)

__all__ = ["Predictors", "calibrate_predictors", "rope_tables", "rotate", "predict"]


@nb.njit(cache=True, nogil=True)
def _recurrence(cos_t, sin_t, start, n, out_c, out_s):
    p = cos_t.shape[0]
    c = np.ones(p, dtype=np.float64)
    s = np.zeros(p, dtype=np.float64)
    for t in range(start + n):
        if t >= start:
            for i in range(p):
                out_c[t - start, i] = np.float32(c[i])
                out_s[t - start, i] = np.float32(s[i])
        for i in range(p):
            c2 = c[i] * cos_t[i] - s[i] * sin_t[i]
            s[i] = s[i] * cos_t[i] + c[i] * sin_t[i]
            c[i] = c2


def rope_tables(cos_theta: np.ndarray, sin_theta: np.ndarray, scale: float, start: int, n: int):
    """(cos, sin) ``[n, P]`` float32 of positions ``start .. start + n - 1`` for the rotary pairs whose
    per-position angle has the binary64 cosine and sine given (module docstring)."""
    cos_theta = np.ascontiguousarray(cos_theta, dtype=np.float64)
    sin_theta = np.ascontiguousarray(sin_theta, dtype=np.float64)
    out_c = np.empty((n, cos_theta.size), dtype=np.float32)
    out_s = np.empty((n, cos_theta.size), dtype=np.float32)
    _recurrence(cos_theta, sin_theta, int(start), int(n), out_c, out_s)
    sc = np.float32(scale)
    return out_c * sc, out_s * sc


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, inverse: bool = False) -> np.ndarray:
    """``x [..., T, D]`` float32 rotated by each position's angle (rotate-half layout), or back."""
    x = np.asarray(x, dtype=np.float32)
    h = x.shape[-1] // 2
    s = -sin if inverse else sin
    x1, x2 = x[..., :h], x[..., h:]
    return np.concatenate([x1 * cos + (-x2) * s, x2 * cos + x1 * s], axis=-1).astype(np.float32)


def _predict_blocks(x, w, b, out, blk):
    # blocks of 8 tokens share each weight row (read once per block).  Every output is bias + x[0] w[0] +
    # x[1] w[1] + ... in that order, whichever block or thread computes it.
    t_n, i_n = x.shape
    o_n = w.shape[1]
    t0 = blk * 8
    nt = min(8, t_n - t0)
    acc = np.empty((8, o_n), dtype=np.float32)
    for tt in range(nt):
        for j in range(o_n):
            acc[tt, j] = b[j]
    for i in range(i_n):
        for tt in range(nt):
            xi = x[t0 + tt, i]
            for j in range(o_n):
                acc[tt, j] = acc[tt, j] + xi * w[i, j]
    for tt in range(nt):
        for j in range(o_n):
            out[t0 + tt, j] = acc[tt, j]


_block = nb.njit(cache=True, nogil=True, inline="always")(_predict_blocks)


@nb.njit(cache=True, nogil=True)
def _predict_range(x, w, b, out, blk0, blk1):
    for blk in range(blk0, blk1):
        _block(x, w, b, out, blk)


def predict(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, parallel: bool = True,
            threads: int | None = None) -> np.ndarray:
    """``[T, O]`` float32: ``bias + x @ weight`` in the specified binary32 order (module docstring); ``x [T, I]``
    float32, ``weight [I, O]`` and ``bias [O]`` float16 (widened exactly).  ``parallel``: blocks of tokens on
    ``threads`` cores (default ``$KVCODEC_THREADS`` or every core; the result does not depend on it)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    w = np.ascontiguousarray(np.asarray(weight, dtype=np.float16).astype(np.float32))
    b = np.ascontiguousarray(np.asarray(bias, dtype=np.float16).astype(np.float32))
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0] or b.shape != (w.shape[1],):
        raise ValueError(f"predict: x {x.shape}, weight {w.shape}, bias {b.shape} do not fit")
    out = np.empty((x.shape[0], w.shape[1]), dtype=np.float32)
    nblk = (x.shape[0] + 7) // 8
    n = min(worker_threads(threads), nblk) if parallel else 1
    if n <= 1:
        _predict_range(x, w, b, out, 0, nblk)
        return out
    # Python threads over ranges of blocks (the kernel releases the GIL), not Numba's parallel=True: its OpenMP
    # layer shares libgomp with torch and resets torch's thread count, which the token tiers' numerics record
    cuts = [nblk * i // n for i in range(n + 1)]
    with ThreadPoolExecutor(n) as ex:
        list(ex.map(lambda i: _predict_range(x, w, b, out, cuts[i], cuts[i + 1]), range(n)))
    return out


# --- the predictors (a per-model profile) and their closed-loop fit ------------------------------------------

class Predictors:
    """Per layer, the key predictor (from the previous layer's reconstructed pre-RoPE keys; layer 0: the bias
    alone) and the value predictor (from this layer's reconstructed pre-RoPE keys, then the previous layer's
    reconstructed values; layer 0: from its keys), float16 ``(weight [in, out], bias [out])`` each, over the
    KV heads concatenated (``H * D`` features); the RoPE recurrence's binary64 ``cos_theta``, ``sin_theta``
    ``[D / 2]`` and ``scale``."""

    def __init__(self, keys, values, cos_theta, sin_theta, scale: float = 1.0, meta: dict | None = None):
        self.keys, self.values = keys, values
        self.cos_theta = np.asarray(cos_theta, dtype=np.float64)
        self.sin_theta = np.asarray(sin_theta, dtype=np.float64)
        self.scale = float(scale)
        self.meta = dict(meta or {})

    def nbytes(self) -> int:
        return sum(w.nbytes + b.nbytes for w, b in self.keys + self.values)

    def tables(self, start: int, n: int):
        """The decoder's (cos, sin) ``[n, D/2]`` of positions ``start ..``: the recurrence's values times
        ``scale`` (spec 13.1)."""
        return rope_tables(self.cos_theta, self.sin_theta, self.scale, start, n)

    def inverse_tables(self, start: int, n: int):
        """The encoder's tables for taking keys back before RoPE: ``rotate(k, *inverse_tables, inverse=True)``
        undoes ``rotate(., *tables)`` up to rounding, ``scale`` included (the model multiplies cos and sin by
        it; dividing by it here keeps the decoder's keys at the model's scale)."""
        return rope_tables(self.cos_theta, self.sin_theta, 1.0 / self.scale, start, n)

    def to_bytes(self) -> bytes:
        """The canonical safetensors bytes (:func:`to_bytes`)."""
        return to_bytes(self)

    @property
    def identity(self) -> str:
        """The SHA-256 of :meth:`to_bytes` (64 hex digits): what a file names.  Computed once: treat the
        arrays as immutable."""
        if getattr(self, "_identity", None) is None:
            self._identity = identity(self.to_bytes())
        return self._identity

    def save(self, path) -> int:
        """Write the predictors (a safetensors file) atomically; returns the bytes written."""
        from .atomic import atomic_output

        data = self.to_bytes()
        with atomic_output(path) as f:
            f.write(data)
        return len(data)

    @classmethod
    def load(cls, path) -> "Predictors":
        """Read predictors written by :meth:`save` (a local path or fsspec URL), checked field by field."""
        from .file import open_path

        with open_path(path, "rb") as f:
            return from_bytes(f.read(MAX_PREDICTORS_BYTES + 1))

    @classmethod
    def from_bytes(cls, data: bytes) -> "Predictors":
        return from_bytes(data)


def as_predictors(x) -> "Predictors":
    """``x`` as :class:`Predictors`: the object itself, its file bytes, or a path / URL of its file."""
    import os

    from .errors import ConfigError

    if isinstance(x, Predictors):
        if not getattr(x, "_checked", False):  # built in memory: checked as its file would be, once
            try:
                data = x.to_bytes()
            except (ValueError, TypeError, OverflowError) as e:
                raise ConfigError(f"these predictors cannot be written as a predictors file: {e}") from None
            back = from_bytes(data)
            x._identity, x._checked = back.identity, True
        return x
    if isinstance(x, (bytes, bytearray, memoryview)):
        return from_bytes(bytes(x))
    if isinstance(x, (str, os.PathLike)):
        return Predictors.load(x)
    raise ConfigError(f"predictors= takes kvcodec.Predictors, their file's bytes or its path, not "
                      f"{type(x).__name__} (kvcodec.calibrate_predictors makes them)")


def flat(x):
    """[H, T, D] -> [T, H * D] (T may be 0)."""
    h, t, d = x.shape
    return np.ascontiguousarray(x.transpose(1, 0, 2).reshape(t, h * d))


def unflat(x, h):
    """[T, H * D] -> [H, T, D] (T may be 0)."""
    t, w = x.shape
    return np.ascontiguousarray(x.reshape(t, h, w // h).transpose(1, 0, 2))


def _ridge(g: np.ndarray, xy: np.ndarray, damp: float):
    """float16 (weight, bias) from the accumulated ``[X 1]^T [X 1]`` and ``[X 1]^T Y`` (binary64)."""
    g = g + damp * max(float(np.diag(g).mean()), 1e-30) * np.eye(len(g))
    wb = np.linalg.solve(g, xy)
    return wb[:-1].astype(np.float16), wb[-1].astype(np.float16)


def _moments(x: np.ndarray, y: np.ndarray):
    x1 = np.concatenate([x.astype(np.float64), np.ones((len(x), 1))], axis=1)
    return x1.T @ x1, x1.T @ y.astype(np.float64)


def reconstruct(x: np.ndarray, part: int, step: float, key_weights, cfg: dict) -> np.ndarray:
    """What the lossy tier's decoder rebuilds from slice ``x [H, T, D]`` (float32) coded at ``step``: keys by
    Method 5 with ``key_weights [H, D]``, values by Method 1 (quantizer ``weighted``)."""
    from .codecs import vq_rans

    payload = vq_rans.encode(x[None], {**cfg, "quantizer": "weighted"}, step=step, part=part, weights=key_weights)
    return vq_rans.decode(payload, (1, *x.shape), "float32").values[0]


def fit(caches, cos_theta, sin_theta, scale: float, key_weights, step: float, *, damp: float = 1e-3,
        cfg: dict | None = None) -> Predictors:
    """Fit the predictors on calibration caches (each a list of per-layer ``(keys, values)`` float32 arrays
    ``[H, T, D]``, post-RoPE keys, positions from 0; token 0 is left out, the tier stores it exactly) layer
    after layer on the reconstructions the decoder will have at ``step`` (closed loop, as AQUA-KV does)."""
    cfg = {"key_ratio": PREDICTED_KEY_RATIO, **(cfg or {})}
    nl = len(caches[0])
    rot = [rope_tables(cos_theta, sin_theta, 1.0 / scale, 1, c[0][0].shape[1] - 1) for c in caches]  # inverse
    prev_k = prev_v = None
    keys, values = [], []
    for li in range(nl):
        kp = [flat(rotate(c[li][0][:, 1:], *rot[j], inverse=True)) for j, c in enumerate(caches)]
        h = caches[0][li][0].shape[0]
        gk = xyk = None
        for j, y in enumerate(kp):
            x = prev_k[j] if li else np.zeros((len(y), 0), np.float32)
            g, xy = _moments(x, y)
            gk, xyk = (g, xy) if gk is None else (gk + g, xyk + xy)
        wk = _ridge(gk, xyk, damp)
        khat = []
        for j, y in enumerate(kp):
            x = prev_k[j] if li else np.zeros((len(y), 0), np.float32)
            pk = predict(x, *wk)
            r = reconstruct(unflat(y - pk, h), 0, step, key_weights[li], cfg)
            khat.append(flat(r) + pk)
        vf = [flat(c[li][1][:, 1:]) for c in caches]
        xs = [khat[j] if li == 0 else np.concatenate([khat[j], prev_v[j]], axis=1) for j in range(len(caches))]
        gv = xyv = None
        for x, y in zip(xs, vf):
            g, xy = _moments(x, y)
            gv, xyv = (g, xy) if gv is None else (gv + g, xyv + xy)
        wv = _ridge(gv, xyv, damp)
        vhat = []
        for x, y in zip(xs, vf):
            pv = predict(x, *wv)
            vhat.append(flat(reconstruct(unflat(y - pv, h), 1, step, key_weights[li], cfg)) + pv)
        keys.append(wk)
        values.append(wv)
        prev_k, prev_v = khat, vhat
    return Predictors(keys, values, cos_theta, sin_theta, scale,
                      {"step": float(step), "tokens": int(sum(len(k) for k in kp)), "damp": damp})


def code_layers(layers, pred: Predictors, step: float, key_weights, cfg: dict | None = None):
    """(payloads, reconstruction) of a cache's layers (per layer ``(keys, values)`` float32 ``[H, T, D]``,
    post-RoPE keys from position 0) coded as the predictive tier would: token 0 exact, the other tokens'
    residuals after prediction by Method 5 (keys, pre-RoPE) and Method 1 (values); the reconstruction is the
    decoder's, float32, in the same layout."""
    import torch

    from .codecs import vq_rans
    from .dtypes import bit_patterns

    cfg = {"key_ratio": PREDICTED_KEY_RATIO, **(cfg or {}), "quantizer": "weighted"}
    t = layers[0][0].shape[1]
    cos, sin = pred.tables(1, t - 1)
    icos, isin = pred.inverse_tables(1, t - 1)
    payloads, out = [], []
    prev_k = prev_v = None
    for li, (k, v) in enumerate(layers):
        h = k.shape[0]
        kp = flat(rotate(k[:, 1:], icos, isin, inverse=True))
        x = prev_k if li else np.zeros((len(kp), 0), np.float32)
        pk = predict(x, *pred.keys[li])
        pl = vq_rans.encode(unflat(kp - pk, h)[None], cfg, step=step, part=0, weights=key_weights[li])
        khat = flat(vq_rans.decode(pl, (1, h, t - 1, k.shape[2]), "float32").values[0]) + pk
        xv = khat if li == 0 else np.concatenate([khat, prev_v], axis=1)
        pv = predict(xv, *pred.values[li])
        plv = vq_rans.encode(unflat(flat(v[:, 1:]) - pv, h)[None], cfg, step=step, part=1)
        vhat = flat(vq_rans.decode(plv, (1, h, t - 1, v.shape[2]), "float32").values[0]) + pv
        head = [len(vq_rans.floatctx.encode(bit_patterns(torch.from_numpy(a[None, :, :1])), "float32", {}))
                for a in (k, v)]
        payloads.append((len(pl) + head[0], len(plv) + head[1]))
        rk = np.concatenate([k[:, :1], rotate(unflat(khat, h), cos, sin)], axis=1)
        rv = np.concatenate([v[:, :1], unflat(vhat, h)], axis=1)
        out.append((rk, rv))
        prev_k, prev_v = khat, vhat
    return payloads, out


# --- the predictors on disk (safetensors; no pickle) ---------------------------------------------------------

PREDICTORS_FORMAT = "kvz-predictors"
PREDICTORS_VERSION = "1"
MAX_PREDICTORS_BYTES = 1 << 31


def to_bytes(pred: Predictors) -> bytes:
    """The predictors as a safetensors file: ``keys.{l}.weight/bias``, ``values.{l}.weight/bias`` (float16),
    ``rope.cos_theta``, ``rope.sin_theta`` (float64); metadata: format, version, scale, meta (JSON)."""
    import json

    from safetensors.numpy import save

    t = {}
    for part, layers in (("keys", pred.keys), ("values", pred.values)):
        for li, (w, b) in enumerate(layers):
            t[f"{part}.{li}.weight"] = np.ascontiguousarray(w, dtype=np.float16)
            t[f"{part}.{li}.bias"] = np.ascontiguousarray(b, dtype=np.float16)
    t["rope.cos_theta"] = pred.cos_theta
    t["rope.sin_theta"] = pred.sin_theta
    # the metadata as a tensor of canonical JSON bytes: safetensors' own metadata map is written in no fixed
    # order, and the file's hash is its identity
    meta = {"format": PREDICTORS_FORMAT, "version": PREDICTORS_VERSION, "scale": pred.scale, "meta": pred.meta}
    t["meta.json"] = np.frombuffer(json.dumps(meta, sort_keys=True).encode(), dtype=np.uint8).copy()
    return save(t)


def identity(data: bytes) -> str:
    """The predictors' identity: the SHA-256 of their file bytes (what a file would name)."""
    import hashlib

    return hashlib.sha256(data).hexdigest()


def from_bytes(data: bytes) -> Predictors:
    """Parse and check a predictors file (spec 13.1; :class:`~kvcodec.errors.FormatError` naming the field for
    anything else: another format, missing or extra tensors, shapes that do not chain, non-finite values, a
    ``scale`` that is not a non-zero finite binary32).  The result's identity is the SHA-256 of ``data``."""
    import json
    import struct

    from safetensors import SafetensorError
    from safetensors.numpy import load

    from .errors import FormatError, LimitExceeded

    data = bytes(data)
    if len(data) > MAX_PREDICTORS_BYTES:
        raise LimitExceeded(f"predictors of {len(data)} bytes (limit {MAX_PREDICTORS_BYTES})", field="Predictors")
    if len(data) < 8:
        raise FormatError("shorter than a safetensors header", field="Predictors")
    (hlen,) = struct.unpack_from("<Q", data, 0)
    if hlen > len(data) - 8:
        raise FormatError(f"header length {hlen} runs past the {len(data)} bytes", field="Predictors.header")

    def no_duplicates(pairs):
        out = {}
        for k, v in pairs:
            if k in out:
                raise FormatError(f"key {k!r} given twice", field="Predictors.meta.json")
            out[k] = v
        return out

    try:
        t = load(data)
    except (SafetensorError, ValueError, UnicodeDecodeError) as e:
        raise FormatError(f"not a safetensors file of predictors: {e}", field="Predictors") from None
    raw_meta = t.pop("meta.json", None)
    if raw_meta is None or raw_meta.dtype != np.uint8 or raw_meta.ndim != 1:
        raise FormatError("meta.json must be a U8 vector", field="Predictors.meta.json")
    try:
        meta = json.loads(raw_meta.tobytes().decode("utf-8"), object_pairs_hook=no_duplicates)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise FormatError(f"meta.json is not a JSON object: {type(e).__name__}", field="Predictors.meta.json") \
            from None
    if not isinstance(meta, dict) or meta.get("format") != PREDICTORS_FORMAT \
            or meta.get("version") != PREDICTORS_VERSION:
        raise FormatError(f"not {PREDICTORS_FORMAT} version {PREDICTORS_VERSION}", field="Predictors.format")
    scale, extra = meta.get("scale"), meta.get("meta")
    ok = isinstance(scale, (int, float)) and not isinstance(scale, bool)
    if ok:
        with np.errstate(over="ignore"):
            s32 = np.float32(float(scale)) if abs(scale) < 1e308 else np.float32(np.inf)
        ok = bool(np.isfinite(s32)) and s32 != 0
    if not ok or not isinstance(extra, dict):
        raise FormatError("scale must be a number whose binary32 rounding is finite and not 0, and meta an object",
                          field="Predictors.metadata")
    cos_t, sin_t = t.get("rope.cos_theta"), t.get("rope.sin_theta")
    if cos_t is None or sin_t is None or cos_t.dtype != np.float64 or cos_t.shape != sin_t.shape or cos_t.ndim != 1 \
            or cos_t.size == 0 or sin_t.dtype != np.float64 \
            or not (np.isfinite(cos_t).all() and np.isfinite(sin_t).all()):
        raise FormatError("rope.cos_theta / rope.sin_theta must be finite float64 vectors of one non-zero length",
                          field="Predictors.rope")
    nl = 0
    while f"keys.{nl}.weight" in t:
        nl += 1
    if nl == 0 or "keys.0.bias" not in t:
        raise FormatError("no layer 0 predictors", field="Predictors.keys.0")
    width = t["keys.0.bias"].shape[0] if t["keys.0.bias"].ndim == 1 else -1
    if width <= 0 or width % (2 * cos_t.size):
        raise FormatError(f"feature width {width} is not heads x {2 * cos_t.size}", field="Predictors.keys.0.bias")
    keys, values = [], []
    for li in range(nl):
        for part, dst, n_in in (("keys", keys, 0 if li == 0 else width),
                                ("values", values, width if li == 0 else 2 * width)):
            w, b = t.get(f"{part}.{li}.weight"), t.get(f"{part}.{li}.bias")
            if w is None or b is None or w.dtype != np.float16 or b.dtype != np.float16 \
                    or w.shape != (n_in, width) or b.shape != (width,):
                raise FormatError(f"must be float16 [{n_in}, {width}] and [{width}]", field=f"Predictors.{part}.{li}")
            if not (np.isfinite(w).all() and np.isfinite(b).all()):
                raise FormatError("a value is not finite", field=f"Predictors.{part}.{li}")
            dst.append((w, b))
    if len(t) != 4 * nl + 2:
        raise FormatError(f"{len(t)} tensors, {4 * nl + 2} expected for {nl} layers", field="Predictors")
    pred = Predictors(keys, values, cos_t, sin_t, float(scale), extra)
    pred._identity = identity(data)  # the file's own bytes, whatever serialiser wrote them
    pred._checked = True
    return pred


def model_rope(model) -> tuple[np.ndarray, np.ndarray, float]:
    """(cos theta, sin theta, scale) of a model's rotary embedding (rotate-half layout over the whole head), for
    the RoPE recurrence; :class:`~kvcodec.errors.ConfigError` for a model without one."""
    from .calibrate import rotate_half_pairs
    from .errors import ConfigError

    rope = getattr(getattr(model, "model", None), "rotary_emb", None)
    inv = getattr(rope, "inv_freq", None)
    if inv is None or not rotate_half_pairs(model.config):
        raise ConfigError("prediction needs a model whose keys are rotated by RoPE over the whole head in the "
                          "rotate-half layout (Llama, Qwen2, Mistral ...)")
    theta = inv.detach().double().cpu().numpy()
    return np.cos(theta), np.sin(theta), float(getattr(rope, "attention_scaling", 1.0))


def calibrate_predictors(model, texts=None, *, tokenizer=None, profile=None, tokens: int = 2048,
                         bits: float = 2.0, step: float | None = None) -> Predictors:
    """Fit :class:`Predictors` for ``model`` (one prefill per text, then a closed-loop ridge fit layer after
    layer; about a minute for SmolLM2 on 2,048 tokens on 2 cores).

    ``texts``: strings (tokenized with ``tokenizer``, the first ``tokens`` tokens of each) or token ids
    (``[1, n]`` or 1-D); default: the first ``tokens`` tokens of the embedded text (needs ``tokenizer``).
    ``profile``: the key channels' weights of quantizer ``weighted`` (:func:`kvcodec.calibrate`; default:
    calibrated on the first 128 tokens of the first text).  The fit is done on the reconstructions at the step
    that codes the calibration caches at ``bits`` per component (or at ``step``); one fit serves every rate
    (BENCHMARKS.md: fitted once, median KL 0.0072 at 2 bits against 0.0076 refitted per step).  A
    calibration-text count of one genre serves others (BENCHMARKS.md gives the measured transfer)."""
    import torch

    from .cache import to_canonical
    from .calibrate import Profile, calibrate, default_ids
    from .codecs.vq_rans import DEFAULTS, global_step
    from .errors import ConfigError
    from .identity import fingerprint
    from .models import prefill, tokenize

    cos_t, sin_t, scale = model_rope(model)
    if texts is None:
        if tokenizer is None:
            raise ConfigError("calibrate_predictors() needs texts= (token ids) or tokenizer= (to tokenize the "
                              "embedded text)")
        texts = [default_ids(tokenizer, tokens)]
    if isinstance(texts, (str, torch.Tensor, np.ndarray)):
        texts = [texts]
    ids_list = []
    for t in texts:
        if isinstance(t, str):
            if tokenizer is None:
                raise ConfigError("calibrate_predictors(): text given as strings needs tokenizer=")
            t = tokenize(tokenizer, t, tokens)
        ids = torch.as_tensor(t).long().reshape(1, -1)
        if ids.shape[1] < 2:
            raise ConfigError(f"calibrate_predictors(): a text of {ids.shape[1]} tokens (at least 2)")
        ids_list.append(ids)
    if profile is None:
        profile = calibrate(model, ids_list[0][:, :128])
    elif not isinstance(profile, Profile):
        raise ConfigError("profile= takes a kvcodec.Profile (kvcodec.calibrate)")
    caches, tensors = [], []
    for ids in ids_list:
        kv = to_canonical(prefill(model, ids))
        caches.append([(k[0].float().numpy(), v[0].float().numpy()) for k, v in zip(kv.keys, kv.values)])
        tensors += kv.keys + kv.values
    n = sum(int(ids.shape[1]) - 1 for ids in ids_list)  # token 0 is stored exactly, not fitted
    h, _, d = caches[0][0][0].shape
    features = 2 * h * d  # the value predictor's inputs: this layer's keys and the layer below's values
    if n < 4 * features:
        from .errors import warn

        warn(f"calibrate_predictors: {n} calibration tokens for predictors with {features} inputs: fewer than "
             f"{4 * features}, they may predict worse than none (SmolLM2: 300 tokens of one text doubled the KL "
             "on another; 2,048 tokens of one genre met the target)")
    if step is None:
        step = global_step(tensors, {**DEFAULTS, "bits": float(bits)})
    pred = fit(caches, cos_t, sin_t, scale, profile.key_weights, step)
    pred.meta["model"] = fingerprint(model)  # informative: the file names the predictors by their hash
    return pred
