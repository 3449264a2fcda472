"""Numba kernels of the ``vq_rans`` decoder's reconstruction (spec section 13), fused per token vector.

They compute exactly the binary32 operations the spec writes out, in its order (no fused multiply-add, no
reassociation: Numba compiles without fast-math), so they give the bits of the NumPy expressions they replace
(``tests/test_lossy.py`` compares both on every method).  One pass over the symbols instead of five NumPy
temporaries: the lossy tier's decode went from ~40 MB/s of bf16 output (the butterfly in NumPy was 60 % of it)
to what BENCHMARKS.md reports.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from .._compat import llvmlite_shim

llvmlite_shim()  # numba is loaded: let vLLM's workers start beside it (kvcodec/_compat.py)


@nb.njit(cache=True, nogil=True, inline="always")
def _rotate(syms, offset, step, codebook, use_codebook, sign, inv_d, norms, out, d):
    n = syms.shape[0]
    buf = np.empty(d, dtype=np.float32)
    for r in range(n):
        if use_codebook:
            for i in range(d):
                buf[i] = codebook[syms[r, i]]
        else:
            for i in range(d):
                buf[i] = np.float32(np.int64(syms[r, i]) + offset) * step
        h = 1
        while h < d:
            for b0 in range(0, d, 2 * h):
                for j in range(b0, b0 + h):
                    a = buf[j]
                    c = buf[j + h]
                    buf[j] = a + c
                    buf[j + h] = a - c
            h *= 2
        nr = norms[r]
        for i in range(d):
            out[r, i] = ((buf[i] * sign[i]) * inv_d) * nr


# The head dimensions of most models, compiled with D a constant (inlined: the loops unroll; measured 1.9x the
# generic kernel's speed at D = 64)
@nb.njit(cache=True, nogil=True)
def _rotate_64(syms, offset, step, codebook, use_codebook, sign, inv_d, norms, out):
    _rotate(syms, offset, step, codebook, use_codebook, sign, inv_d, norms, out, 64)


@nb.njit(cache=True, nogil=True)
def _rotate_128(syms, offset, step, codebook, use_codebook, sign, inv_d, norms, out):
    _rotate(syms, offset, step, codebook, use_codebook, sign, inv_d, norms, out, 128)


@nb.njit(cache=True, nogil=True)
def _rotate_any(syms, offset, step, codebook, use_codebook, sign, inv_d, norms, out):
    _rotate(syms, offset, step, codebook, use_codebook, sign, inv_d, norms, out, syms.shape[1])


def rotate_back(syms, offset, step, codebook, use_codebook, sign, inv_d, norms, out):
    """Methods 1 and 2: ``out[r] = ((WHT(z) * sign) * inv_d) * norms[r]`` with ``z[i] = float32(syms[r, i] +
    offset) * step`` (Method 1) or ``codebook[syms[r, i]]`` (Method 2); ``syms [n, D]``, D a power of two."""
    kernel = {64: _rotate_64, 128: _rotate_128}.get(syms.shape[1], _rotate_any)
    kernel(syms, offset, step, codebook, use_codebook, sign, inv_d, norms, out)


@nb.njit(cache=True, nogil=True)
def channel_dequant(syms, offset, steps, out):
    """Method 5: ``out[bh, t, d] = float32(syms[bh, t, d] + offset) * steps[bh % H, d]`` (``steps [H, D]``)."""
    bh, t, d = syms.shape
    heads = steps.shape[0]
    for a in range(bh):
        st = steps[a % heads]
        for j in range(t):
            for i in range(d):
                out[a, j, i] = np.float32(np.int64(syms[a, j, i]) + offset) * st[i]


@nb.njit(cache=True, nogil=True, inline="always")
def bf16_bits(w):
    """The bfloat16 bit pattern of the float32 whose bit pattern is ``w`` (uint32), rounded to nearest even
    (spec section 13); a NaN stays a quiet NaN with its sign and leading payload bits.  A select, no branch:
    the loops that call it vectorise."""
    nan = (w & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    r = (w + np.uint32(0x7FFF) + ((w >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    q = (w >> np.uint32(16)) | np.uint32(0x40)
    return np.uint16(q if nan else r)


@nb.njit(cache=True, nogil=True)
def channel_dequant_into(syms, offset, steps, out):
    """:func:`channel_dequant` written into ``out [B, H, T, D]`` (any strides, e.g. a slice of the cache's
    output): the float32 bit patterns (uint32) or the bfloat16 ones rounded to nearest even (uint16,
    :func:`f32_to_bf16`'s rule), in one pass."""
    b_n, heads, t, d = out.shape
    tmp = np.empty(d, dtype=np.float32)
    bits = tmp.view(np.uint32)
    for a in range(b_n):
        for hh in range(heads):
            r = a * heads + hh
            st = steps[r % steps.shape[0]]
            for j in range(t):
                for i in range(d):
                    tmp[i] = np.float32(np.int64(syms[r, j, i]) + offset) * st[i]
                if out.itemsize == 4:
                    for i in range(d):
                        out[a, hh, j, i] = bits[i]
                else:
                    for i in range(d):
                        out[a, hh, j, i] = bf16_bits(bits[i])


@nb.njit(cache=True, nogil=True)
def index_counts(sample, step, lo, counts):
    """``counts[rint(v / step) - lo] += 1`` for every ``v`` of ``sample`` (float32; ``v / step`` a binary32
    division, ``rint`` ties to even: NumPy's ``np.rint(sample / step)``), from zeros."""
    counts[:] = 0
    for i in range(sample.size):
        counts[np.int64(np.rint(sample[i] / step)) - lo] += 1


@nb.njit(cache=True, nogil=True)
def fwht_rows(x):
    """In place: the unnormalised Walsh-Hadamard butterfly of every row of ``x [N, D]`` (float32, D a power of
    two), ``(a, b) <- (a + b, a - b)`` for h = 1, 2, 4 ... in the order of :func:`kvcodec.codecs.hadamard.fwht`'s
    NumPy formulation (the same binary32 operations, so the same bits)."""
    n, d = x.shape
    for r in range(n):
        h = 1
        while h < d:
            for b0 in range(0, d, 2 * h):
                for j in range(b0, b0 + h):
                    a = x[r, j]
                    c = x[r, j + h]
                    x[r, j] = a + c
                    x[r, j + h] = a - c
            h *= 2


@nb.njit(cache=True, nogil=True)
def f32_to_bf16(u, out):
    """``out[...]`` = the bfloat16 bit patterns of the float32 values whose bit patterns are ``u`` (uint32, both
    ``[A, B, T, D]``; ``out`` may be a slice along T), rounded to nearest even (spec section 13); a NaN (which
    finite inputs cannot produce) stays a quiet NaN with its sign and leading payload bits."""
    a_n, b_n, t_n, d_n = u.shape
    for a in range(a_n):
        for b in range(b_n):
            for t in range(t_n):
                for i in range(d_n):
                    out[a, b, t, i] = bf16_bits(u[a, b, t, i])
