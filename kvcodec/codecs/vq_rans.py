"""Lossy per-vector quantization of KV slices: codec ``vq_rans`` (tier ``lossy``).

TurboQuant-style: every key / value vector ``x`` (one token, one head, D
components) is split into its norm and its direction ``u = x / |x|``; the
direction is rotated by a randomized Hadamard transform (random signs from a
stored seed, then the Walsh-Hadamard butterfly), which makes every coordinate
``z = H(s * u)`` close to N(0, 1) whatever the vector; the coordinates are
quantized with one scalar quantizer per slice and the indices entropy-coded
with our rANS lane coder (per-coordinate context tables, like
``float_ctx_rans``).  Two quantizers:

* ``uniform`` (default): ``q = round(z / step)``.  Entropy-coded uniform
  quantization is within ~0.25 bit of the rate-distortion bound at these rates
  and its rate is continuous: the encoder finds the step that meets ``bits=``
  (average bits per component, side information included);
* ``lloyd``: the Lloyd-Max codebook of N(0, 1) with ``2**b`` levels (the
  TurboQuant paper's quantizer), stored in the payload, indices entropy-coded.

Keys get a step ``sqrt(key_weight)`` finer than values (equal *weighted*
distortion; measured on SmolLM2, 512 tokens: quantizing only the keys costs 9x
the KL of quantizing only the values; ``key_weight=8`` halves the KL at 2
bits/component against equal steps, and 4..16 are within 20 % of each other).
``weighted`` (format 1.5) puts the key bits where the queries look: a key error δk moves a query's logit by
s·⟨q, δk⟩, so each key channel d gets its own step ``step * key_ratio / w_d`` with w_d the RMS of s·q_d
from a calibration profile (:func:`kvcodec.calibrate`; Method 5: no rotation, no norms, the float16 steps
in the payload, so decoding needs no profile); values keep the rotated uniform quantizer.  On SmolLM2 it
roughly halves the KL at 2 bits per component (BENCHMARKS.md).
Without rotation, for comparison: ``kivi`` (min-max groups, keys per channel
over token groups, values per token) and ``cachegen`` (per-token max-abs
scaling over all heads, finer bins in shallow layers, as LMCache ships it).

The last ``window`` tokens of a cache may be kept exact (KIVI's
full-precision window).  Decoding uses only IEEE float32 additions,
subtractions and multiplications in a fixed order (the butterfly is written
out, no BLAS), so the same bytes give the same tensors on every machine.
See ``spec/kvz.md`` section 13.
"""

from __future__ import annotations

import math
import struct
from typing import NamedTuple

import numpy as np

from .. import scratch
from ..dtypes import DTYPES, bit_patterns
from ..entropy import rans
from ..errors import ConfigError, FormatError
from ..registry import register_codec
from . import _rotate_simd, _vq_numba
from . import float_ctx_rans as floatctx
from .base import Codec, Slice
from .hadamard import SIGN_RULE, fwht, signs  # noqa: F401  (part of this codec's reference arithmetic)

CODEC_ID = "vq_rans"
METHOD_UNIFORM = 1
METHOD_LLOYD = 2
METHOD_KIVI = 3
METHOD_CACHEGEN = 4
METHOD_CHANNEL = 5
CHANNEL_MINOR = 5  # the format minor version that introduced Method 5
PREDICT_MINOR = 6  # the format minor version of predicted slices (params["predict"]: the predictors' SHA-256)
METHODS = {"uniform": METHOD_UNIFORM, "lloyd": METHOD_LLOYD, "kivi": METHOD_KIVI, "cachegen": METHOD_CACHEGEN,
           "channel": METHOD_CHANNEL}
#: quantizers a user picks (``quantizer=``); ``weighted`` writes keys with Method 5 (per-channel steps from a
#: calibration profile) and values with Method 1 (the rotated uniform quantizer)
QUANTIZERS = ("uniform", "lloyd", "kivi", "cachegen", "weighted")
_KIVI = struct.Struct("<BBH")  # Axis (0: per channel over token groups, 1: per token over channel groups), Bits, Group
MAX_SYMBOL_BITS = 12
_FIXED = struct.Struct("<BBBBIQfI")  # Mode, Method, Symbol_Bits, Sign_Rule, Exact_Tokens, Seed, Step, Norms_Length
_HEAD = struct.Struct("<II")  # Mode 2: Head_Tokens, Head_Length
DEFAULTS = {"quantizer": "uniform", "bits": 3.0, "step": None, "lloyd_bits": 3, "window": 0, "sink": 1,
            "seed": 0x6B767A,
            "kivi_bits": 2, "group": 32, "key_weight": 8.0,
            # CacheGen as LMCache ships it (7B/8B preset): per-token max-abs bins, finer in shallow layers
            "cachegen_bins": [32, 16], "cachegen_key_fine": 0.3125, "cachegen_value_fine": 0.0625}
#: options of quantizer ``weighted`` only (recorded in the header only for it, so other files keep their bytes):
#: the key step in logit units per value step (measured on SmolLM2, BENCHMARKS.md: 0.15-0.2 at 2 bits)
WEIGHTED_DEFAULTS = {"key_ratio": 0.15}
#: quantizer ``weighted`` with predictors (spec 13.1): the default key step per value step.  Predicted values
#: cost fewer bits, so keys can have a finer step at the same rate; measured (BENCHMARKS.md, SmolLM2 fp32 at
#: ~1.97 bits) lower KL than 0.15 on 5 of 6 texts and equal on the sixth.
PREDICTED_KEY_RATIO = 0.07
# the indices are coded like float_ctx_rans symbols, with Scale_Bits 10 (as the lossless tier): the tables of
# a stream (up to 32 x 2**Scale_Bits entries) then take 128 KiB instead of 512, and a SmolLM2 cache decodes
# 1.4x faster than at 12 for the same bytes (+0.00 %; BENCHMARKS.md); files made at 12 decode as before
_CTX = {**floatctx.DEFAULTS, "scale_bits": 10}
#: Scale_Bits of the index streams of Symbol_Bits <= 8 (spec revision 1.8.3; every stream states its own, so
#: this is an encoder choice): 2**8 slots hold any such alphabet, and the decoder's 32 direct tables of a
#: stream (4 bytes a slot) then take 32 KiB, the size of a level-1 data cache, where at 10 they took 128 KiB.
#: Measured on SmolLM2 caches (BENCHMARKS.md, "The lossy tier's decode"): the same bytes to +-0.06 %, the
#: index streams' kernel 1.17-1.22x faster, a whole decode 1.09-1.15x (two runs).  CacheGen's streams (Method
#: 4, a peer's replica) stay at 10: +0.3 % at 8.
SMALL_SCALE_BITS = 8


def _ctx(k: int) -> dict:
    """The coding parameters of an index stream of ``k``-bit symbols."""
    return {**_CTX, "scale_bits": SMALL_SCALE_BITS} if k <= 8 else _CTX


#: Methods 1 and 2: max |z| * max(D, 65536) must stay below this, so the butterfly (|y| <= D max |z|) and the
#: product with a float16 norm (< 65536) stay finite and no NaN (whose bits would be the CPU's) can arise
RECON_BOUND = 2.0 ** 127


def check_config(cfg: dict) -> dict:
    cfg = {k: v for k, v in cfg.items() if k not in ("max_kl", "calibrated_kl")}  # recorded, informative
    unknown = set(cfg) - set(DEFAULTS) - set(WEIGHTED_DEFAULTS) - {"predict"}
    if unknown:
        raise ConfigError(f"{CODEC_ID}: unknown options {sorted(unknown)} (known: "
                          f"{sorted(set(DEFAULTS) | set(WEIGHTED_DEFAULTS))})")
    out = {**DEFAULTS, **(WEIGHTED_DEFAULTS if cfg.get("quantizer") == "weighted" else {}), **cfg}
    if out["quantizer"] not in QUANTIZERS:
        raise ConfigError(f"{CODEC_ID}: quantizer must be one of {sorted(QUANTIZERS)}")
    pr = out.get("predict")
    if "predict" in out and not (out["quantizer"] == "weighted" and isinstance(pr, str) and len(pr) == 64
                                 and all(c in "0123456789abcdef" for c in pr)):
        raise ConfigError(f"{CODEC_ID}: predict is the SHA-256 (64 hex digits) of the predictors of quantizer "
                          "'weighted'")
    if "key_ratio" in out and not (isinstance(out["key_ratio"], (int, float)) and 1e-4 <= out["key_ratio"] <= 1e4):
        raise ConfigError(f"{CODEC_ID}: key_ratio must be a number in [1e-4, 10000]")
    if out["step"] is not None and not (isinstance(out["step"], (int, float)) and out["step"] > 0):
        raise ConfigError(f"{CODEC_ID}: step must be a positive number")
    if not (isinstance(out["bits"], (int, float)) and 0.05 <= out["bits"] <= 12):
        raise ConfigError(f"{CODEC_ID}: bits (average bits per component) must be in [0.05, 12]")
    if not (isinstance(out["lloyd_bits"], int) and 2 <= out["lloyd_bits"] <= 8):
        raise ConfigError(f"{CODEC_ID}: lloyd_bits must be an int in [2, 8]")
    if not (isinstance(out["kivi_bits"], int) and 1 <= out["kivi_bits"] <= 8):
        raise ConfigError(f"{CODEC_ID}: kivi_bits must be an int in [1, 8]")
    if not (isinstance(out["group"], int) and 1 <= out["group"] <= 65535):
        raise ConfigError(f"{CODEC_ID}: group must be an int in [1, 65535]")
    if not (isinstance(out["key_weight"], (int, float)) and 0.01 <= out["key_weight"] <= 1e4):
        raise ConfigError(f"{CODEC_ID}: key_weight must be a number in [0.01, 10000]")
    cb = out["cachegen_bins"]
    if not (isinstance(cb, (list, tuple)) and len(cb) == 2 and all(isinstance(x, int) and 3 <= x <= 4096 for x in cb)):
        raise ConfigError(f"{CODEC_ID}: cachegen_bins must be [fine, coarse] bin counts in [3, 4096]")
    out["cachegen_bins"] = list(cb)
    for key in ("cachegen_key_fine", "cachegen_value_fine"):
        if not (isinstance(out[key], (int, float)) and 0 <= out[key] <= 1):
            raise ConfigError(f"{CODEC_ID}: {key} (fraction of layers with fine bins) must be in [0, 1]")
    if not (isinstance(out["window"], int) and out["window"] >= 0):
        raise ConfigError(f"{CODEC_ID}: window must be an int >= 0")
    if not (isinstance(out["sink"], int) and 0 <= out["sink"] < 2 ** 32):
        raise ConfigError(f"{CODEC_ID}: sink (first tokens kept exact) must be an int >= 0")
    if not (isinstance(out["seed"], int) and 0 <= out["seed"] < 2 ** 64):
        raise ConfigError(f"{CODEC_ID}: seed must be an int in [0, 2**64)")
    return out


def lloyd_max_gaussian(levels: int, iters: int = 200) -> np.ndarray:
    """Lloyd-Max reconstruction points of N(0, 1) (ascending float32): encoder side only, stored in the file."""
    from math import erf, exp, pi, sqrt

    def pdf(t):
        return exp(-t * t / 2) / sqrt(2 * pi)

    def cdf(t):
        return 0.5 * (1 + erf(t / sqrt(2)))

    c = np.array([(i + 0.5) / levels * 6 - 3 for i in range(levels)], dtype=np.float64)
    for _ in range(iters):
        edges = np.concatenate([[-np.inf], (c[1:] + c[:-1]) / 2, [np.inf]])
        new = []
        for a, b in zip(edges[:-1], edges[1:]):
            mass = cdf(b) - cdf(a)
            new.append((pdf(a) - pdf(b)) / mass if mass > 0 else (a + b) / 2)
        c = np.array(new)
    return c.astype(np.float32)


# --- encoder ------------------------------------------------------------------------
def directions(x: np.ndarray, seed: int):
    """(fp16 norms, rotated coordinates z) of float32 vectors ``x [N, D]``."""
    norms16, z, _ = _rotated(x, seed, None)
    return norms16, z


def directions_q(x: np.ndarray, seed: int, step) -> tuple[np.ndarray, np.ndarray]:
    """(fp16 norms, ``rint(z / step)`` as int64) of float32 vectors ``x [N, D]``: Method 1's indices before the
    offset (``z`` from :func:`directions`, ``step`` a float32)."""
    norms16, z, q = _rotated(x, seed, np.float32(step))
    return norms16, q.astype(np.int64)


def _rotated(x: np.ndarray, seed: int, step):
    """(fp16 norms, z, ``rint(z / step)`` in float32 or None): the vector kernel
    (:func:`._rotate_simd.forward`, one pass, the same binary32 operations) where it runs, else NumPy."""
    sg = signs(seed, x.shape[1])
    if x.shape[0] and _rotate_simd.forward_usable(x.shape[1]):
        norms16 = _rotate_simd.norms(x).astype(np.float16)
        z, q = _rotate_simd.forward(x, norms16.astype(np.float32), sg, step)
        return norms16, z, q
    norms16 = np.linalg.norm(x.astype(np.float64), axis=1).astype(np.float16)
    n32 = norms16.astype(np.float32)
    safe = np.where(n32 > 0, n32, np.float32(1.0))
    u = (x / safe[:, None]).astype(np.float32)
    u[n32 == 0] = 0
    z = fwht(u * sg[None, :])
    return norms16, z, None if step is None else np.rint(z / step)


def entropy_bits(q: np.ndarray) -> float:
    """Empirical order-0 entropy of integer indices, bits per index (rate estimate)."""
    lo, hi = (float(q.min()), float(q.max())) if q.size else (0.0, 0.0)
    if hi - lo < 1 << 24:  # the counts of the distinct values in ascending order, as np.unique gives them
        cnt = np.bincount((q - lo).astype(np.int64).ravel())
        cnt = cnt[cnt > 0]
    else:
        _, cnt = np.unique(q, return_counts=True)
    return _entropy_of(cnt)


def _entropy_of(cnt: np.ndarray) -> float:
    """Bits per index of the positive counts ``cnt`` of the distinct indices, in ascending order of index."""
    p = cnt / cnt.sum()
    return float(-(p * np.log2(p)).sum())


def step_for_rate(z: np.ndarray, rate: float) -> float:
    """Uniform step whose index entropy is ``rate`` bits (bisection on log step)."""
    sample = z.ravel()
    if sample.size > 1 << 20:
        sample = sample[:: sample.size // (1 << 20) + 1]
    fast = sample.dtype == np.float32 and sample.size > 0 and rans.backend() == "numba"
    if fast:
        sample = np.ascontiguousarray(sample)
        smin, smax = sample.min(), sample.max()
    lo, hi = -12.0, 6.0  # log2 step
    for _ in range(40):
        mid = (lo + hi) / 2
        if fast:
            bits = _index_entropy(sample, np.float32(2.0 ** mid), smin, smax)
        else:
            bits = entropy_bits(np.rint(sample / 2.0 ** mid))
        if bits > rate:
            lo = mid
        else:
            hi = mid
    return float(np.float32(2.0 ** hi))


def _index_entropy(sample: np.ndarray, st: np.float32, smin: np.float32, smax: np.float32) -> float:
    """``entropy_bits(np.rint(sample / st))`` for float32 ``sample`` in one Numba pass: ``rint(v / st)`` is
    monotone in ``v``, so its least and largest values are those of ``smin`` and ``smax``, and the counts come out
    in ascending order of the index, as ``entropy_bits`` takes them."""
    lo, hi = np.rint(smin / st), np.rint(smax / st)
    if not hi - lo < 1 << 24:
        return entropy_bits(np.rint(sample / st))
    cnt = np.empty(int(hi - lo) + 1, dtype=np.int64)
    _vq_numba.index_counts(sample, st, int(lo), cnt)
    return _entropy_of(cnt[cnt > 0])


def _kivi_groups(x: np.ndarray, axis: int, group: int) -> np.ndarray:
    """``[B, H, T, D]`` -> ``[groups, group_len]``: per channel over token groups (axis 0) or per token over
    channel groups (axis 1); the last group may be shorter (padded by repeating its last element)."""
    b, h, t, d = x.shape
    if axis == 0:
        y = x.transpose(0, 1, 3, 2)  # [B, H, D, T]
    else:
        y = x
    n = y.shape[-1]
    ng = -(-n // group)
    pad = ng * group - n
    if pad:
        y = np.concatenate([y, np.repeat(y[..., -1:], pad, axis=-1)], axis=-1)
    return np.ascontiguousarray(y).reshape(-1, group), n


def _kivi_ungroup(g: np.ndarray, shape, axis: int, group: int) -> np.ndarray:
    b, h, t, d = shape
    n = t if axis == 0 else d
    lead = (b, h, d) if axis == 0 else (b, h, t)
    y = g.reshape(*lead, -1)[..., :n]
    return y.transpose(0, 1, 3, 2) if axis == 0 else y


def _encode_kivi(x: np.ndarray, cfg: dict, axis: int) -> list[bytes]:
    b, h, t, d = x.shape
    bits, group = cfg["kivi_bits"], cfg["group"]
    g, _ = _kivi_groups(x.astype(np.float32), axis, group)
    mn = g.min(axis=1).astype(np.float16)
    top = (1 << bits) - 1
    scale = ((g.max(axis=1) - mn.astype(np.float32)) / top).astype(np.float16)
    m32, s32 = mn.astype(np.float32), scale.astype(np.float32)
    safe = np.where(s32 > 0, s32, np.float32(1))
    q = np.clip(np.rint((g - m32[:, None]) / safe[:, None]), 0, top).astype(np.uint16)
    q[s32 == 0] = 0
    qx = _kivi_ungroup(q, x.shape, axis, group)
    k = max(2, bits)
    rows = qx.reshape(b * h, t, d)
    side = np.stack([mn, scale], axis=1).view(np.uint16).reshape(-1, 2, 1, 1)
    side_p = floatctx.encode(np.ascontiguousarray(side.transpose(1, 0, 2, 3)).reshape(1, 2, -1, 1), "float16", {})
    return [_KIVI.pack(axis, bits, group), struct.pack("<I", len(side_p)), side_p,
            floatctx.encode_symbols(rows, k, _ctx(k))], k


def _encode_cachegen(x: np.ndarray, bins: int) -> tuple[list[bytes], int]:
    b, h, t, d = x.shape
    half = bins // 2 - 1 if bins % 2 == 0 else bins // 2  # q in [-half, half]
    mx = np.abs(x).transpose(0, 2, 1, 3).reshape(b, t, h * d).max(axis=2)  # per token, all heads and channels
    scale16 = (mx / half).astype(np.float16)
    s32 = scale16.astype(np.float32)
    safe = np.where(s32 > 0, s32, np.float32(1))
    q = np.clip(np.rint(x / safe[:, None, :, None]), -half, half).astype(np.int64)
    q[np.broadcast_to((s32 == 0)[:, None, :, None], q.shape)] = 0
    k = max(2, math.ceil(math.log2(2 * half + 1)))
    rows = (q + half).astype(np.uint16).reshape(b * h, t, d)
    side = floatctx.encode(scale16.view(np.uint16).reshape(b, 1, t, 1), "float16", {})
    return [struct.pack("<HH", bins, 0), struct.pack("<I", len(side)), side, floatctx.encode_symbols(rows, k, _CTX)], k


def _decode_cachegen(mv, p: int, shape, k: int, offset: int):
    b, h, t, d = shape
    if len(mv) < p + 8:
        raise FormatError("payload ends inside the CacheGen fields", field="VQ.CacheGen", offset=offset + p)
    bins, reserved = struct.unpack_from("<HH", mv, p)
    half = bins // 2 - 1 if bins % 2 == 0 else bins // 2
    if bins < 3 or reserved or k != max(2, math.ceil(math.log2(2 * half + 1))):
        raise FormatError(f"CacheGen fields bins {bins}, Symbol_Bits {k} are invalid", field="VQ.CacheGen",
                          offset=offset + p)
    (side_len,) = struct.unpack_from("<I", mv, p + 4)
    p += 8
    if side_len > len(mv) - p:
        raise FormatError(f"Side_Length {side_len} runs past the payload", field="VQ.CacheGen.Side_Length",
                          offset=offset + p - 4)
    scales = floatctx.decode(mv[p:p + side_len], (b, 1, t, 1), "float16", offset=offset + p)
    p += side_len
    s32 = scales.view(np.float16).astype(np.float32).reshape(b, t)
    if not np.isfinite(s32).all():
        raise FormatError("a CacheGen scale is not finite", field="VQ.CacheGen.Side", offset=offset + p)
    syms = np.empty((b * h, t, d), dtype=np.uint16)
    p += floatctx.decode_symbols(mv[p:], syms, k, offset=offset + p, exact_payload=False, coded_bits=k)
    q = syms.reshape(b, h, t, d).astype(np.int64)
    if int(q.max()) > 2 * half:
        raise FormatError("a CacheGen index exceeds the bins", field="VQ.Indices", offset=offset + p)
    return (q - half).astype(np.float32) * s32[:, None, :, None], p


def cachegen_bins(cfg: dict, part: int, layer: int, num_layers: int) -> int:
    fine = cfg["cachegen_key_fine"] if part == 0 else cfg["cachegen_value_fine"]
    return cfg["cachegen_bins"][0] if layer < math.ceil(fine * num_layers) else cfg["cachegen_bins"][1]


def channel_steps(step: float, key_ratio: float, weights: np.ndarray) -> np.ndarray:
    """Method 5's float16 steps ``[H, D]``: ``step * key_ratio / weights`` (weights: each key channel's
    importance, the RMS logit change per unit of the channel, from a calibration profile), clamped to the
    positive finite float16 range."""
    with np.errstate(divide="ignore", over="ignore"):
        st = np.float64(step) * np.float64(key_ratio) / np.asarray(weights, dtype=np.float64)
    st = np.nan_to_num(st, nan=65504.0, posinf=65504.0)
    return np.clip(st, 2.0 ** -14, 65504.0).astype(np.float16)


def index_payload(q: np.ndarray, levels: int | None = None) -> tuple[bytes, int, int]:
    """(``Indices``, ``Symbol_Bits``, ``Index_Offset``) of integer indices ``q [B, H, T', D]``: one coded row
    per (batch, head, channel) over the tokens; the symbols offset to start at 0, or (a codebook of
    ``levels`` entries) the indices themselves."""
    b, h, t, d = q.shape
    lo = int(q.min()) if levels is None else 0
    span = int(q.max()) - lo + 1 if levels is None else levels
    k = max(2, math.ceil(math.log2(span)) if span > 1 else 1)
    if k > MAX_SYMBOL_BITS:
        raise ConfigError(f"{CODEC_ID}: {span} quantization levels need more than {MAX_SYMBOL_BITS} bits; "
                          "raise the step / lower the rate")
    syms = (q - lo).astype(np.uint16).reshape(b * h, t, d)
    return floatctx.encode_symbols(syms, k, _ctx(k)), k, lo


def _encode_channel(x: np.ndarray, steps16: np.ndarray, recon: dict | None = None) -> tuple[list[bytes], int, int]:
    """(Method 5 fields after Index_Offset, Symbol_Bits, Index_Offset) of ``x [B, H, T', D]``; ``recon["values"]``,
    if asked, the decoder's binary32 reconstruction."""
    q = np.rint(x.astype(np.float32) / steps16.astype(np.float32)[None, :, None, :]).astype(np.int64)
    idx, k, lo = index_payload(q)
    if recon is not None:
        b, h, t, d = x.shape
        out = np.empty((b * h, t, d), dtype=np.float32)
        _vq_numba.channel_dequant((q - lo).astype(np.uint16).reshape(b * h, t, d), lo, steps16.astype(np.float32),
                                  out)
        recon["values"] = out.reshape(b, h, t, d)
    return [steps16.astype("<f2").tobytes(), idx], k, lo


def encode(x: np.ndarray, cfg: dict, *, exact_tokens: int = 0, dtype: str = "float32",
           exact_bits: np.ndarray | None = None, head_tokens: int = 0, head_bits: np.ndarray | None = None,
           step: float | None = None, part: int = 0, layer: int = 0, num_layers: int = 1, rotq=None,
           weights: np.ndarray | None = None, recon: dict | None = None) -> bytes:
    """Quantize a ``[B, H, T, D]`` float32 slice; the last ``exact_tokens`` tokens are stored losslessly
    (``exact_bits``: their bit patterns in ``dtype``), and so are the first ``head_tokens`` (``head_bits``;
    Mode 2: attention-sink tokens).  ``step`` overrides the rate search.  ``part`` (0 keys, 1 values) picks
    KIVI's axis: keys per channel, values per token.  ``rotq(step, seed, a, b)``, if given, returns the
    (float16 norms, indices) of the slice's tokens ``a .. b`` for Method 1 (the Triton kernel: bit-exact
    with the NumPy path it replaces).  ``weights`` ``[H, D]``: quantizer ``weighted``, the key channels'
    importances of this layer (:class:`kvcodec.calibrate`'s profile).  ``recon`` (Methods 1 and 5), if given, receives
    ``"values"``: the decoder's binary32 reconstruction of the quantized tokens (those between the exact head and
    tail), computed from the indices without entropy-decoding them."""
    cfg = check_config(cfg)
    if head_tokens:
        if head_tokens + exact_tokens > x.shape[2]:
            raise ValueError("head_tokens + exact_tokens exceed the slice")
        body = encode(np.ascontiguousarray(x[:, :, head_tokens:]), cfg, exact_tokens=exact_tokens, dtype=dtype,
                      exact_bits=exact_bits, step=step, part=part, layer=layer, num_layers=num_layers,
                      rotq=None if rotq is None else (lambda st, sd, a, b: rotq(st, sd, a + head_tokens,
                                                                                b + head_tokens)),
                      weights=weights, recon=recon)
        head = floatctx.encode(np.ascontiguousarray(head_bits), dtype, {})
        n = _FIXED.size + 4
        return b"".join([bytes([2]), body[1:n], _HEAD.pack(head_tokens, len(head)), head, body[n:]])
    b, h, t, d = x.shape
    if cfg["quantizer"] == "weighted" and part == 0:  # keys: Method 5, per-channel steps
        if weights is None or np.shape(weights) != (h, d):
            raise ConfigError(f"{CODEC_ID}: quantizer 'weighted' needs the key weights [{h}, {d}] of layer {layer} "
                              "(profile=kvcodec.calibrate(model))")
        tq = t - exact_tokens
        st = step if step is not None else cfg["step"]
        if st is None:
            raise ConfigError(f"{CODEC_ID}: quantizer 'weighted' needs a step (the tier sets it from bits=)")
        body, k, lo = [], 2, 0
        if tq > 0:
            body, k, lo = _encode_channel(np.ascontiguousarray(x[:, :, :tq]),
                                          channel_steps(st, cfg["key_ratio"], weights), recon)
        elif recon is not None:
            recon["values"] = np.zeros((b, h, 0, d), dtype=np.float32)
        tail = floatctx.encode(np.ascontiguousarray(exact_bits), dtype, {}) if exact_tokens else b""
        return b"".join([_FIXED.pack(1, METHOD_CHANNEL, k, SIGN_RULE, exact_tokens, 0, 0.0, 0),
                         struct.pack("<i", lo), *body, struct.pack("<I", len(tail)), tail])
    if cfg["quantizer"] in ("kivi", "cachegen"):
        tq = t - exact_tokens
        body = []
        k = 2
        xq = np.ascontiguousarray(x[:, :, :tq])
        if tq > 0 and cfg["quantizer"] == "kivi":
            body, k = _encode_kivi(xq, cfg, 0 if part == 0 else 1)
        elif tq > 0:
            body, k = _encode_cachegen(xq, cachegen_bins(cfg, part, layer, num_layers))
        tail = floatctx.encode(np.ascontiguousarray(exact_bits), dtype, {}) if exact_tokens else b""
        return b"".join([_FIXED.pack(1, METHODS[cfg["quantizer"]], k, SIGN_RULE, exact_tokens, 0, 0.0, 0),
                         struct.pack("<i", 0), *body, struct.pack("<I", len(tail)), tail])
    if d & (d - 1):
        raise ConfigError(f"{CODEC_ID}: head dimension {d} is not a power of two (the Hadamard rotation needs one)")
    tq = t - exact_tokens
    method = METHODS.get(cfg["quantizer"], METHOD_UNIFORM)  # "weighted": values by the uniform quantizer
    seed = int(cfg["seed"])
    parts = []
    if tq > 0:
        vecs = np.ascontiguousarray(x[:, :, :tq]).reshape(-1, d).astype(np.float32)
        st = step if step is not None else cfg["step"]
        z = None
        if method != METHOD_UNIFORM or st is None:
            norms16, z = directions(vecs, seed)
        if method == METHOD_UNIFORM:
            st = np.float32(st if st is not None else step_for_rate(z, cfg["bits"]))
            if part == 0 and cfg["quantizer"] == "uniform":  # keys: a finer step (D_k = D_v / key_weight)
                st = np.float32(st / np.float32(math.sqrt(cfg["key_weight"])))
            if rotq is not None:
                norms16, q = rotq(st, seed, 0, tq)
            elif z is not None:
                q = np.rint(z / st).astype(np.int64)
            else:  # the same, in one pass with the rotation where the vector kernel runs
                norms16, q = directions_q(vecs, seed, st)
            codebook = b""
        else:
            cb = lloyd_max_gaussian(1 << cfg["lloyd_bits"])
            st = np.float32(0)
            q = np.searchsorted((cb[1:] + cb[:-1]) / 2, z).astype(np.int64)
            codebook = cb.astype("<f4").tobytes()
        levels = None if method == METHOD_UNIFORM else 1 << cfg["lloyd_bits"]
        idx, k, lo = index_payload(q.reshape(b, h, tq, d), levels)
        if recon is not None:
            if method != METHOD_UNIFORM:
                raise ValueError("recon= is computed for Methods 1 and 5")
            out = np.empty((b, h, tq, d), dtype=np.float32)
            syms = (q.reshape(b * h, tq, d) - lo).astype(np.uint16)
            n32 = norms16.astype(np.float32).reshape(b * h, tq)
            if _rotate_simd.usable(syms, lo, out):  # the decoder's own vector reconstruction
                _rotate_simd.rotate(syms, lo, st, signs(seed, d, SIGN_RULE), 1.0 / d, n32, out)
            else:
                _vq_numba.rotate_back(syms.reshape(-1, d), lo, np.float32(st), np.zeros(1, np.float32), False,
                                      signs(seed, d, SIGN_RULE), np.float32(1.0 / d), n32.reshape(-1),
                                      out.reshape(-1, d))
            recon["values"] = out
        nbytes = floatctx.encode(norms16.view(np.uint16).reshape(b, h, tq, 1), "float16", {})
        parts = [_FIXED.pack(1, method, k, SIGN_RULE, exact_tokens, seed, float(st), len(nbytes)),
                 struct.pack("<i", lo), codebook, nbytes, idx]
    else:
        parts = [_FIXED.pack(1, method, 2, SIGN_RULE, exact_tokens, seed, 0.0, 0), struct.pack("<i", 0)]
        if recon is not None:
            recon["values"] = np.zeros((b, h, 0, d), dtype=np.float32)
    tail = b""
    if exact_tokens:
        tail = floatctx.encode(np.ascontiguousarray(exact_bits), dtype, {})
    return b"".join(parts) + struct.pack("<I", len(tail)) + tail


def describe(prefix: bytes, shape: tuple[int, int, int, int], dtype_bits: int) -> dict | None:
    """What the first bytes of a payload say (``kvz inspect``): quantizer, index bits, step, exact head and
    tail tokens, and the size the same indices would take packed at a fixed ``Symbol_Bits`` each (Methods 1
    and 2: indices + 16-bit norms + exact tokens at ``dtype_bits``), in bits per component.  None if the
    prefix is not a valid start of a payload (inspect does not validate)."""
    if len(prefix) < _FIXED.size + 4:
        return None
    mode, method, k, _, exact, _seed, st, _ = _FIXED.unpack_from(prefix, 0)
    names = {v: n for n, v in METHODS.items()}
    if mode not in (1, 2) or method not in names:
        return None
    b, h, t, d = shape
    head = 0
    if mode == 2:
        if len(prefix) < _FIXED.size + 4 + _HEAD.size:
            return None
        head = _HEAD.unpack_from(prefix, _FIXED.size + 4)[0]
    out = {"quantizer": names[method], "symbol_bits": k, "step": st if method == METHOD_UNIFORM else None,
           "head_tokens": head, "exact_tokens": exact}
    tq = t - head - exact
    if method in (METHOD_UNIFORM, METHOD_LLOYD) and tq >= 0 and b * h * t * d:
        fixed = b * h * (tq * (k * d + 16) + (head + exact) * d * dtype_bits)
        out["fixed_width_bits_per_component"] = round(fixed / (b * h * t * d), 4)
    return out


# --- decoder ------------------------------------------------------------------------
class Decoded(NamedTuple):
    values: np.ndarray | None  # float32 [B, H, T - H0 - E, D]: the dequantized tokens H0 .. T - E (None:
    # written into the caller's ``dest`` already)
    tail: np.ndarray | None  # bit patterns of the E exact last tokens, or None
    exact: int  # E
    head: np.ndarray | None  # bit patterns of the H0 exact first tokens (Mode 2), or None
    head_tokens: int  # H0


def decode(payload, shape: tuple[int, int, int, int], dtype: str, *, offset: int = 0, minor: int = 99) -> Decoded:
    """Decode a payload of a ``[B, H, T, D]`` slice of a file stamped 1.``minor``.  Every field is validated
    before use."""
    return decode_many([(payload, shape, dtype, offset, minor)])[0]


def decode_many(items: list) -> list:
    """:func:`decode` of each ``(payload, shape, dtype, offset, minor[, dest])``: the payloads are parsed side by
    side and their index streams decoded together (:func:`~kvcodec.entropy.rans.lanes_decode_many`: the vector
    kernels run several streams in one loop).  ``dest`` (optional): the slice's output bit patterns ``[B, H, T,
    D]`` (uint16 for bfloat16, uint32 for float32), into which Method 1's tokens are written directly when the
    vector reconstruction takes them (:mod:`._rotate_simd`; the result's ``values`` is then ``None``)."""
    steps = [_decode_steps(*item) for item in items]
    results: list = [None] * len(steps)
    wanted = {}
    for i, g in enumerate(steps):
        try:
            wanted[i] = next(g)
        except StopIteration as e:
            results[i] = e.value
    while wanted:
        rans.lanes_decode_many(list(wanted.values()))
        decoded, wanted = wanted, {}
        for i in decoded:
            try:
                wanted[i] = steps[i].send(None)
            except StopIteration as e:
                results[i] = e.value
    return results


def _symbols(mv, p: int, syms: np.ndarray, k: int, offset: int):
    """Parse the index stream at ``p`` (``floatctx.decode_symbols``' checks) and ask the driver of
    :func:`_decode_steps` to decode it into ``syms``; the bytes it used."""
    st, used = floatctx.parse_symbols(mv[p:], syms.shape, k, offset=offset + p, exact_payload=False, coded_bits=k,
                                      dense=False)
    yield st, syms
    return used


def _decode_steps(payload, shape: tuple[int, int, int, int], dtype: str, offset: int = 0, minor: int = 99,
                  dest=None):
    """:func:`decode` as a generator: it yields each index stream ``(rans.Stream, out)`` it needs decoded and
    returns the :class:`Decoded` (:func:`decode_many` drives it)."""
    mv = memoryview(payload)
    b, h, t, d = shape
    if dest is not None and (dest.shape != tuple(shape) or dest.dtype != DTYPES[dtype].uint
                             or not dest.flags.writeable):
        raise ValueError(f"dest must be a writeable {DTYPES[dtype].uint.__name__} array of shape {tuple(shape)}, "
                         f"got {dest.dtype} {dest.shape}")
    if len(mv) < _FIXED.size + 4:
        raise FormatError("vq_rans payload shorter than its fixed fields", field="VQ.Mode", offset=offset)
    mode, method, k, rule, exact, seed, st, norms_len = _FIXED.unpack_from(mv, 0)
    (lo,) = struct.unpack_from("<i", mv, _FIXED.size)
    if mode not in (1, 2):
        raise FormatError(f"unknown vq_rans mode {mode}", field="VQ.Mode", offset=offset)
    p = _FIXED.size + 4
    head, head_tokens = None, 0
    if mode == 2:
        if len(mv) < p + _HEAD.size:
            raise FormatError("payload ends inside the Mode 2 fields", field="VQ.Head_Tokens", offset=offset + p)
        head_tokens, head_len = _HEAD.unpack_from(mv, p)
        if not 1 <= head_tokens <= t:
            raise FormatError(f"Head_Tokens {head_tokens} outside [1, {t}]", field="VQ.Head_Tokens", offset=offset + p)
        if head_len > len(mv) - p - _HEAD.size:
            raise FormatError(f"Head_Length {head_len} runs past the payload", field="VQ.Head_Length",
                              offset=offset + p + 4)
        p += _HEAD.size
        head = floatctx.decode(mv[p:p + head_len], (b, h, head_tokens, d), dtype, offset=offset + p)
        p += head_len
        t -= head_tokens
    if method not in (METHOD_UNIFORM, METHOD_LLOYD, METHOD_KIVI, METHOD_CACHEGEN, METHOD_CHANNEL):
        raise FormatError(f"unknown quantizer method {method}", field="VQ.Method", offset=offset + 1)
    if method == METHOD_CHANNEL and minor < CHANNEL_MINOR:
        raise FormatError(f"Method 5 in a file stamped 1.{minor} (it needs 1.{CHANNEL_MINOR})", field="VQ.Method",
                          offset=offset + 1)
    if not 2 <= k <= MAX_SYMBOL_BITS:
        raise FormatError(f"Symbol_Bits {k} outside [2, {MAX_SYMBOL_BITS}]", field="VQ.Symbol_Bits", offset=offset + 2)
    if rule > 1:
        raise FormatError(f"unknown Sign_Rule {rule} (0: format 1.1, 1: format 1.2)", field="VQ.Sign_Rule",
                          offset=offset + 3)
    if rule != (0 if minor < 2 else 1):  # spec section 3, 13 field 4 (revision 1.11.1): the rule of the version
        raise FormatError(f"Sign_Rule {rule} in a file stamped 1.{minor} (files stamped 1.1 use 0, 1.2 or later 1)",
                          field="VQ.Sign_Rule", offset=offset + 3)
    if exact > t:
        raise FormatError(f"Exact_Tokens {exact} > {t} tokens in the slice", field="VQ.Exact_Tokens", offset=offset + 4)
    if d & (d - 1) and method in (METHOD_UNIFORM, METHOD_LLOYD):
        raise FormatError(f"head dimension {d} is not a power of two", field="Header.cache.layers", offset=offset)
    tq = t - exact
    step_bits = struct.unpack_from("<I", mv, 16)[0]
    for name, value, at, must_be_zero in (
            ("Seed", seed, 8, method in (METHOD_KIVI, METHOD_CACHEGEN, METHOD_CHANNEL)),
            ("Step", step_bits, 16, method != METHOD_UNIFORM or tq == 0),
            ("Norms_Length", norms_len, 20, method in (METHOD_KIVI, METHOD_CACHEGEN, METHOD_CHANNEL) or tq == 0),
            ("Index_Offset", lo, 24, method not in (METHOD_UNIFORM, METHOD_CHANNEL) or tq == 0)):
        if must_be_zero and value:
            raise FormatError(f"{name} must be 0 for Method {method} with {tq} quantized tokens (spec section 13)",
                              field=f"VQ.{name}", offset=offset + at)
    out = np.zeros((b, h, 0, d), dtype=np.float32)  # tq == 0; every method with tokens replaces it
    # where Methods 1 and 5 may write their tokens directly: the output's bfloat16 / float32 bit patterns
    view = dest[:, :, head_tokens:head_tokens + tq] if dest is not None and dtype in ("bfloat16", "float32") else None
    if tq and method == METHOD_KIVI:
        out, p = _decode_kivi(mv, p, (b, h, tq, d), k, offset)
    elif tq and method == METHOD_CACHEGEN:
        out, p = _decode_cachegen(mv, p, (b, h, tq, d), k, offset)
    elif tq and method == METHOD_CHANNEL:
        out, p = yield from _decode_channel(mv, p, (b, h, tq, d), k, lo, offset, view)
    elif tq:
        if method == METHOD_UNIFORM and not (math.isfinite(st) and st > 0):
            raise FormatError(f"Step {st} is not a positive finite number", field="VQ.Step", offset=offset + 16)
        levels = 1 << k
        if method == METHOD_UNIFORM and max(abs(lo), abs(lo + levels - 1)) * st >= RECON_BOUND / max(d, 65536):
            raise FormatError(f"Step {st} with Index_Offset {lo} could overflow binary32 in the reconstruction "
                              "(spec section 13)", field="VQ.Step", offset=offset + 16)
        if method == METHOD_LLOYD:
            if len(mv) < p + 4 * levels:
                raise FormatError("payload shorter than its codebook", field="VQ.Codebook", offset=offset + p)
            cb = np.frombuffer(mv[p:p + 4 * levels], dtype="<f4").astype(np.float32)
            if not np.isfinite(cb).all():
                raise FormatError("codebook has a non-finite value", field="VQ.Codebook", offset=offset + p)
            if float(np.abs(cb).max()) >= RECON_BOUND / max(d, 65536):
                raise FormatError("a codebook value could overflow binary32 in the reconstruction (spec section 13)",
                                  field="VQ.Codebook", offset=offset + p)
            p += 4 * levels
        if norms_len > len(mv) - p:
            raise FormatError(f"Norms_Length {norms_len} runs past the payload", field="VQ.Norms_Length",
                              offset=offset + 20)
        norms = floatctx.decode(mv[p:p + norms_len], (b, h, tq, 1), "float16", offset=offset + p)
        p += norms_len
        syms = _scratch_symbols((b * h, tq, d))
        try:
            p += yield from _symbols(mv, p, syms, k, offset)
            n32 = norms.view(np.float16).astype(np.float32).reshape(-1)
            if not np.isfinite(n32).all():
                raise FormatError("a vector norm is not finite", field="VQ.Norms", offset=offset)
            s = syms.reshape(-1, d)
            if method == METHOD_LLOYD and (int(s.max()) >= levels or lo != 0):
                raise FormatError("index outside the codebook", field="VQ.Indices", offset=offset + p)
            if method == METHOD_UNIFORM and view is not None and _rotate_simd.usable(syms, lo, view):
                _rotate_simd.rotate(syms, lo, st, signs(seed, d, rule), 1.0 / d, n32.reshape(b * h, tq), view)
                out = None
            else:
                out = np.empty((b * h * tq, d), dtype=np.float32)
                _vq_numba.rotate_back(s, lo, np.float32(st), cb if method == METHOD_LLOYD else np.zeros(1, np.float32),
                                      method == METHOD_LLOYD, signs(seed, d, rule), np.float32(1.0 / d), n32, out)
                out = out.reshape(b, h, tq, d)
        finally:
            scratch.give(syms)
    if len(mv) < p + 4:
        raise FormatError("payload ends before Tail_Length", field="VQ.Tail_Length", offset=offset + p)
    (tail_len,) = struct.unpack_from("<I", mv, p)
    p += 4
    if tail_len != len(mv) - p:
        raise FormatError(f"Tail_Length {tail_len}, {len(mv) - p} bytes left", field="VQ.Tail_Length",
                          offset=offset + p - 4)
    tail = None
    if exact:
        tail = floatctx.decode(mv[p:], (b, h, exact, d), dtype, offset=offset + p)
    elif tail_len:
        raise FormatError("a tail without exact tokens", field="VQ.Tail_Length", offset=offset + p - 4)
    return Decoded(out, tail, exact, head, head_tokens)


def _decode_channel(mv, p: int, shape, k: int, lo: int, offset: int, view=None):
    """Method 5: ``float32(symbol + Index_Offset) * Channel_Steps[h, d]`` (one binary32 product); a generator
    (its index stream is decoded by :func:`decode_many`'s driver).  With ``view`` (the output slice's uint32
    float32 or uint16 bfloat16 bit patterns) the values are written there, rounded (bfloat16), and the
    result is ``None``."""
    b, h, t, d = shape
    n = 2 * h * d
    if len(mv) < p + n:
        raise FormatError("payload shorter than its Channel_Steps", field="VQ.Channel_Steps", offset=offset + p)
    st = np.frombuffer(mv[p:p + n], dtype="<f2").astype(np.float32).reshape(h, d)
    if not (np.isfinite(st).all() and (st > 0).all()):
        raise FormatError("a channel step is not a positive finite number", field="VQ.Channel_Steps",
                          offset=offset + p)
    p += n
    syms = _scratch_symbols((b * h, t, d))
    try:
        p += yield from _symbols(mv, p, syms, k, offset)
        if view is not None:
            if _rotate_simd.dequant_usable(syms, lo, st, view):  # the vector kernel: the same bits
                _rotate_simd.dequant(syms, lo, st, view)
            else:
                _vq_numba.channel_dequant_into(syms, lo, st, view)
            return None, p
        out = np.empty((b * h, t, d), dtype=np.float32)
        _vq_numba.channel_dequant(syms, lo, st, out)
        return out.reshape(b, h, t, d), p
    finally:
        scratch.give(syms)


def _scratch_symbols(shape) -> np.ndarray:
    """A uint16 array of ``shape`` for a slice's index symbols, in scratch memory (:mod:`kvcodec.scratch`; the
    caller gives it back once the reconstruction has read it)."""
    return scratch.take(2 * math.prod(shape), np.uint16).reshape(shape)


def _decode_kivi(mv, p: int, shape, k: int, offset: int):
    b, h, t, d = shape
    if len(mv) < p + _KIVI.size + 4:
        raise FormatError("payload ends inside the KIVI fields", field="VQ.KIVI", offset=offset + p)
    axis, bits, group = _KIVI.unpack_from(mv, p)
    if axis not in (0, 1) or not 1 <= bits <= 8 or group < 1 or k != max(2, bits):
        raise FormatError(f"KIVI fields axis {axis}, bits {bits}, group {group}, Symbol_Bits {k} are invalid",
                          field="VQ.KIVI", offset=offset + p)
    p += _KIVI.size
    (side_len,) = struct.unpack_from("<I", mv, p)
    p += 4
    n = t if axis == 0 else d
    ngroups = (b * h * (d if axis == 0 else t)) * -(-n // group)
    if side_len > len(mv) - p:
        raise FormatError(f"Side_Length {side_len} runs past the payload", field="VQ.KIVI.Side_Length",
                          offset=offset + p - 4)
    side = floatctx.decode(mv[p:p + side_len], (1, 2, ngroups, 1), "float16", offset=offset + p)
    p += side_len
    side = side.reshape(2, ngroups).view(np.float16).astype(np.float32)
    if not np.isfinite(side).all():
        raise FormatError("a KIVI minimum or scale is not finite", field="VQ.KIVI.Side", offset=offset + p)
    syms = np.empty((b * h, t, d), dtype=np.uint16)
    p += floatctx.decode_symbols(mv[p:], syms, k, offset=offset + p, exact_payload=False, coded_bits=k)
    q = syms.reshape(b, h, t, d)
    if int(q.max()) > (1 << bits) - 1:
        raise FormatError("a KIVI index exceeds 2**bits - 1", field="VQ.Indices", offset=offset + p)
    g, _ = _kivi_groups(q.astype(np.float32), axis, group)
    vals = side[0][:, None] + g * side[1][:, None]
    return _kivi_ungroup(vals.astype(np.float32), shape, axis, group), p



def global_step(tensors, params: dict) -> float:
    """One uniform step for a whole cache (equal distortion everywhere: MSE-optimal allocation), chosen so that
    indices plus norms average ``params['bits']`` bits per component (order-0 estimate; the context coder then
    lands at or below it).  ``tensors``: every key and value tensor of the cache."""
    zs, comps, vecs = [], 0, 0
    for t in tensors:
        if not t.numel():
            continue
        x = t.float().reshape(-1, t.shape[-1]).cpu().numpy()
        sub = x[:: max(1, x.shape[0] // 4096)]
        zs.append(directions(sub, params["seed"])[1].ravel())
        comps += t.numel()
        vecs += x.shape[0]
    if not zs:  # no token anywhere (state-space layers only, or an empty cache): no step is used
        return 1.0
    side = 12.0 * vecs / max(comps, 1)  # fp16 norms coded by float_ctx_rans: ~12 bits each (measured)
    return step_for_rate(np.concatenate(zs), max(0.05, params["bits"] - side))


def uses_kernel(t) -> bool:
    """Does the encoder quantize tensor ``t`` with the Triton kernel?  When ``t`` is on a GPU and Triton is
    installed, or when ``KVCODEC_TRITON=1`` (CPU tensors under ``TRITON_INTERPRET=1``: how the tests check
    that both paths write the same bytes)."""
    import os

    from .. import _kernels

    return bool((t.is_cuda or os.environ.get("KVCODEC_TRITON") == "1") and _kernels.triton_available())


def _kernel_rotq(t):
    """The Triton rotation + quantization of slice ``t`` for the uniform quantizer where :func:`uses_kernel`,
    else None (NumPy)."""
    if not uses_kernel(t):
        return None

    def rotq(step, seed, a, b):
        from .._kernels import vq

        norms, q = vq.rotate_quantize(t[:, :, a:b], float(step), int(seed))
        return norms.cpu().numpy(), q.cpu().numpy().astype(np.int64)

    return rotq


@register_codec
class VqRans(Codec):
    """Lossy per-vector quantization (tier ``lossy``).  ``params`` are :func:`check_config`'s (the tier fills
    ``step``); the cache's first ``sink`` and last ``window`` tokens of each layer are stored exactly, which is
    why :meth:`encode` needs to know where the slice sits.  ``step=`` overrides ``params['step']`` (the tier's
    rate and KL searches try steps without rebuilding the codec)."""

    codec_id = CODEC_ID

    @classmethod
    def configure(cls, options: dict, dtype: str) -> "VqRans":
        return cls(check_config(dict(options)))

    def exact_split(self, where: Slice) -> tuple[int, int]:
        """(head, tail): how many of the slice's first and last tokens are stored exactly (sink, window)."""
        p = self.params
        n, start = where.shape[2], where.start
        exact = max(0, start + n - max(start, where.layer_tokens - p["window"])) if p["window"] else 0
        return min(max(0, p["sink"] - start), n - exact), exact

    def exact_bytes(self, t, where: Slice) -> int:
        """Bytes of the slice's exactly stored tokens (their lossless payloads): independent of the step."""
        head, exact = self.exact_split(where)
        n = t.shape[2]
        return sum(len(floatctx.encode(np.ascontiguousarray(bit_patterns(x)), where.dtype, {}))
                   for x, m in ((t[:, :, :head], head), (t[:, :, n - exact:], exact)) if m)

    #: quantizer ``weighted``: per layer, the key channels' weights ``[H, D]`` (a calibration profile's; the
    #: tier sets them, they are not part of the header's params)
    key_weights = None

    def encode(self, t, where: Slice, prediction=None, step: float | None = None, recon: dict | None = None) -> bytes:
        p = self.params
        n = t.shape[2]
        head, exact = self.exact_split(where)
        weights = None if self.key_weights is None else self.key_weights[where.layer]
        if weights is not None and where.row is not None:  # (1.8) one head's slice: that head's channel weights
            weights = weights[where.row[1]:where.row[1] + 1]
        return encode(t.float().cpu().numpy(), p, exact_tokens=exact, dtype=where.dtype,
                      exact_bits=bit_patterns(t[:, :, n - exact:]) if exact else None, head_tokens=head,
                      head_bits=bit_patterns(t[:, :, :head]) if head else None, step=step, part=where.part,
                      layer=where.layer, num_layers=where.num_layers, rotq=_kernel_rotq(t), weights=weights,
                      recon=recon)

    def decode(self, payload, where: Slice, prediction=None, out=None) -> np.ndarray:
        """The reconstruction's bit patterns in the cache's dtype (float32 values rounded to nearest even: here
        for bfloat16, by torch for float16), exact head and tail tokens as stored."""
        return self.decode_many([(payload, where, out)])[0]

    decode_batch = 6  # index streams decoded together (entropy/_lanes_simd.py): keys and values have their own
    # parameters, so 6 slices make two groups of 3

    def decode_many(self, items: list) -> list:
        outs = [np.empty(where.shape, dtype=DTYPES[where.dtype].uint) if out is None else out
                for _, where, out in items]
        decs = decode_many([(payload, where.shape, where.dtype, where.offset, where.minor, out)
                            for (payload, where, _), out in zip(items, outs)])
        return [self._finish(dec, where, out) for dec, (_, where, _), out in zip(decs, items, outs)]

    @staticmethod
    def _finish(dec: Decoded, where: Slice, out) -> np.ndarray:
        import torch

        dt = DTYPES[where.dtype]
        h0, t = dec.head_tokens, where.shape[2]
        if dec.values is None:  # written into out by the vector reconstruction
            pass
        elif dt.name == "bfloat16":  # rounded here: torch's conversion is ~10x slower
            from ._vq_numba import f32_to_bf16

            f32_to_bf16(dec.values.view(np.uint32), out[:, :, h0:t - dec.exact])
        elif dt.name == "float32":
            out[:, :, h0:t - dec.exact] = dec.values.view(np.uint32)
        else:
            out[:, :, h0:t - dec.exact] = bit_patterns(torch.from_numpy(dec.values).to(dt.torch))
        if h0:
            out[:, :, :h0] = dec.head
        if dec.exact:
            out[:, :, t - dec.exact:] = dec.tail
        return out
