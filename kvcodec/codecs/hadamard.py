"""The randomized Hadamard rotation of ``vq_rans`` (spec section 13): random signs from a seed, and the
unnormalised Walsh-Hadamard butterfly in float32, written out so every machine computes the same bits.

A leaf module: the codec and the Triton kernels (``kvcodec._kernels.vq``) both take their signs from here.
"""

from __future__ import annotations

import numpy as np


def signs(seed: int, d: int) -> np.ndarray:
    """The random signs (float32 +-1) of the randomized Hadamard transform: PCG64(seed), d fair bits."""
    bits = np.random.Generator(np.random.PCG64(seed)).integers(0, 2, size=d, dtype=np.uint8)
    return np.where(bits == 1, np.float32(-1.0), np.float32(1.0))


def fwht(x: np.ndarray) -> np.ndarray:
    """Unnormalised Walsh-Hadamard transform along the last axis (length a power of two), float32."""
    n, d = x.shape
    h = 1
    x = np.ascontiguousarray(x, dtype=np.float32)
    while h < d:
        y = x.reshape(n, d // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        x = np.concatenate([a + b, a - b], axis=2).reshape(n, d)
        h *= 2
    return x
