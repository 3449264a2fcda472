"""The randomized Hadamard rotation of ``vq_rans`` (spec section 13): random signs from a seed, and the
unnormalised Walsh-Hadamard butterfly in float32, written out so every machine computes the same bits.

A leaf module: the codec and the Triton kernels (``kvcodec._kernels.vq``) both take their signs from here.
"""

from __future__ import annotations

import functools

import numpy as np

#: ``Sign_Rule`` of a vq_rans payload: 1 = SplitMix64 (format 1.2), 0 = NumPy's PCG64 (format 1.1 files only)
SIGN_RULE = 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def signs(seed: int, d: int, rule: int = SIGN_RULE) -> np.ndarray:
    """The random signs (float32 +-1, read-only) of the randomized Hadamard transform (spec section 13); the
    last few (seed, d, rule) are cached: a decoder asks for the same ones for every slice.

    Rule 1: sign i is -1 when the top bit of SplitMix64's output for counter ``i + 1`` is set, i.e. of
    ``mix(seed + (i + 1) * 0x9E3779B97F4A7C15 mod 2**64)``.  Rule 0 (files of format 1.1): the i-th of d
    integers drawn by NumPy's ``Generator(PCG64(seed)).integers(0, 2, size=d, dtype=uint8)`` is 1."""
    return _signs(int(seed), int(d), int(rule))


@functools.lru_cache(maxsize=256)
def _signs(seed: int, d: int, rule: int) -> np.ndarray:
    out = _compute_signs(seed, d, rule)
    out.flags.writeable = False
    return out


def _compute_signs(seed: int, d: int, rule: int) -> np.ndarray:
    if rule == 0:
        bits = np.random.Generator(np.random.PCG64(seed)).integers(0, 2, size=d, dtype=np.uint8)
        return np.where(bits == 1, np.float32(-1.0), np.float32(1.0))
    if rule != 1:
        raise ValueError(f"unknown sign rule {rule}")
    with np.errstate(over="ignore"):
        z = np.uint64(seed) + np.arange(1, d + 1, dtype=np.uint64) * _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return np.where(z >> np.uint64(63), np.float32(-1.0), np.float32(1.0))


def fwht(x: np.ndarray) -> np.ndarray:
    """Unnormalised Walsh-Hadamard transform along the last axis (length a power of two), float32 (the Numba
    butterfly; :func:`fwht_numpy` is the same arithmetic in NumPy, tested equal)."""
    from ._vq_numba import fwht_rows

    out = np.array(x, dtype=np.float32, order="C", copy=True)
    if out.size:
        fwht_rows(out)
    return out


def fwht_numpy(x: np.ndarray) -> np.ndarray:
    """:func:`fwht` as NumPy array operations (the reference the Numba butterfly is checked against)."""
    n, d = x.shape
    h = 1
    x = np.ascontiguousarray(x, dtype=np.float32)
    while h < d:
        y = x.reshape(n, d // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        x = np.concatenate([a + b, a - b], axis=2).reshape(n, d)
        h *= 2
    return x
