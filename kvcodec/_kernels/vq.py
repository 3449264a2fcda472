"""Triton kernels of the lossy tier (codec ``vq_rans``, Methods 1 uniform; spec/kvz.md section 13).

* :func:`rotate_quantize` — residual ``x - pred`` (``pred`` optional), fp16 norm, randomized Hadamard
  rotation of the direction and uniform quantization, fused: one read of ``x`` (and ``pred``), one write
  of the int32 indices and fp16 norms;
* :func:`dequantize_add` — the inverse: indices -> rotated coordinates -> inverse rotation -> scale by the
  norm, plus ``base`` (optional), rounded to the output dtype.

Both take ``[batch, heads, seq, head_dim]`` tensors in float16, bfloat16 or float32 (head_dim a power of
two) on any device Triton runs on; on CPU tensors they run under ``TRITON_INTERPRET=1`` (how the tests
check them).  They are **bit-exact** with the NumPy reference in :mod:`kvcodec.codecs.vq_rans`, because their
output feeds the bitstream (encoder) or must equal every other decoder's (decoder):

* every operation is one IEEE binary32 operation in the reference's order: the butterfly is written out
  with ``split``/``join`` (no ``tl.dot``, whose fp32 path may use TF32), divisions are ``div_rn``
  (Triton's ``/`` is an approximate division on NVIDIA GPUs), rounding to the nearest integer with ties to
  even uses the exact ``(v + 1.5 * 2**23) - 1.5 * 2**23`` identity (|v| < 2**22, clamped first), and the
  launches pass ``enable_fp_fusion=False`` so no multiply-add is contracted into an FMA;
* the norm is the float64 square root of a float64 sum of exact float64 squares, rounded once to float16.
  The sum's order differs from NumPy's pairwise sum; the two can round to different float16 values only if
  the float64 sums straddle a float16 rounding boundary (they differ by a few float64 ulps, ~2**-50
  relative: about one vector in 2**39).

The ``_<op>_kernel`` (jitted) / ``<op>`` (host launcher) split follows ``kvcodec/_kernels/__init__.py``.
"""

from __future__ import annotations

import numpy as np
import torch

from . import require_triton

_BLOCK_ROWS = 16
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

def _build():
    """The jitted kernels, imported on first use (Triton is imported lazily)."""
    require_triton()
    from . import _vq_triton as k

    return k._rotate_quantize_kernel, k._dequantize_add_kernel


def _check_layout(shape, dtype, name: str) -> int:
    """head_dim of a ``[batch, heads, seq, head_dim]`` shape in one of the three dtypes, else ValueError."""
    if len(shape) != 4:
        raise ValueError(f"{name}: expected a [batch, heads, seq, head_dim] tensor, got {tuple(shape)}")
    d = shape[-1]
    if d < 2 or d & (d - 1):
        raise ValueError(f"{name}: head_dim {d} is not a power of two >= 2 (the Hadamard rotation needs one)")
    if dtype not in _DTYPES:
        raise ValueError(f"{name}: dtype {dtype} (float16, bfloat16 or float32)")
    return d


def _check(x: torch.Tensor, name: str) -> int:
    return _check_layout(tuple(x.shape), x.dtype, name)


def _signs(seed: int, d: int, device) -> torch.Tensor:
    from kvcodec.codecs.hadamard import signs

    return torch.from_numpy(signs(seed, d)).to(device)


def rotate_quantize(x: torch.Tensor, step: float, seed: int, pred: torch.Tensor | None = None):
    """(float16 norms ``[B*H*S]``, int32 indices ``[B*H*S, D]``) of ``x - pred`` (``pred``: same shape,
    any of the three dtypes), quantized with the uniform ``step`` after the rotation of ``seed``."""
    rq, _ = _build()
    d = _check(x, "x")
    if pred is not None and (pred.shape != x.shape or pred.device != x.device):
        raise ValueError(f"pred {tuple(pred.shape)} on {pred.device} does not match x {tuple(x.shape)} on {x.device}")
    if pred is not None:
        _check(pred, "pred")
    n = x.numel() // d
    xc = x.contiguous()
    pc = pred.contiguous() if pred is not None else xc
    norms = torch.empty(n, dtype=torch.float16, device=x.device)
    q = torch.empty((n, d), dtype=torch.int32, device=x.device)
    if n:
        rq[(-(-n // _BLOCK_ROWS),)](xc, pc, _signs(seed, d, x.device), norms, q, n, float(np.float32(step)),
                                    HAS_PRED=pred is not None, BN=_BLOCK_ROWS, D=d, LOG_D=d.bit_length() - 1,
                                    **_no_fma())
    return norms, q


def dequantize_add(q: torch.Tensor, norms: torch.Tensor, step: float, seed: int, shape, dtype: torch.dtype,
                   offset: int = 0, base: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, H, S, D]`` tensor of ``dtype``: vectors ``(q + offset) * step`` rotated back, scaled by the
    float16 ``norms``, plus ``base`` (optional, same shape); every value as :func:`kvcodec.codecs.vq_rans.decode`
    computes it (binary32, one rounding to ``dtype`` at the end)."""
    _, dq = _build()
    d = _check_layout(tuple(shape), dtype, "shape")
    b, h, s, _ = shape
    n = b * h * s
    if tuple(q.shape) != (n, d) or q.dtype != torch.int32 or tuple(norms.shape) != (n,) \
            or norms.dtype != torch.float16:
        raise ValueError(f"q must be int32 [{n}, {d}] and norms float16 [{n}] for shape {tuple(shape)}")
    if base is not None:
        if tuple(base.shape) != tuple(shape) or base.device != q.device:
            raise ValueError(f"base {tuple(base.shape)} does not match {tuple(shape)}")
        _check(base, "base")
    out = torch.empty(tuple(shape), dtype=dtype, device=q.device)
    if n:
        bc = base.contiguous() if base is not None else out
        dq[(-(-n // _BLOCK_ROWS),)](q.contiguous(), norms.contiguous(), _signs(seed, d, q.device), bc, out, n,
                                    int(offset), float(np.float32(step)), float(np.float32(1.0 / d)),
                                    HAS_BASE=base is not None, OUT_BF16=dtype == torch.bfloat16, BN=_BLOCK_ROWS, D=d, LOG_D=d.bit_length() - 1,
                                    **_no_fma())
    return out


def _no_fma() -> dict:
    """Launch option that keeps multiplies and adds separate (no FMA contraction) where the backend has it."""
    import os

    return {} if os.environ.get("TRITON_INTERPRET") == "1" else {"enable_fp_fusion": False}
