"""The one table of the floating-point types a cache may hold, and bit-pattern views of tensors.

Codecs work on the raw bit patterns of a tensor (``uint16`` for bf16/fp16,
``uint32`` for fp32): :func:`bit_patterns` and :func:`from_bit_patterns`
convert without changing a bit (NaN payloads and ``-0`` included).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["DType", "DTYPES", "by_name", "of", "parse", "bit_patterns", "from_bit_patterns", "same_bits"]


@dataclass(frozen=True)
class DType:
    name: str  #: the header's ``cache.dtype``
    torch: torch.dtype
    itemsize: int  #: bytes per element
    exponent_bits: int
    uint: type  #: NumPy type of a bit pattern
    int_view: torch.dtype  #: same-size torch integer type, for bitwise comparison
    aliases: tuple[str, ...] = ()


DTYPES: dict[str, DType] = {d.name: d for d in (
    DType("float32", torch.float32, 4, 8, np.uint32, torch.int32, ("fp32",)),
    DType("float16", torch.float16, 2, 5, np.uint16, torch.int16, ("fp16",)),
    DType("bfloat16", torch.bfloat16, 2, 8, np.uint16, torch.int16, ("bf16",)),
)}
_BY_TORCH = {d.torch: d for d in DTYPES.values()}


def by_name(name: str) -> DType:
    return DTYPES[name]


def of(dtype: torch.dtype) -> DType:
    """The entry of a torch dtype; ``KeyError`` if caches of that type are not supported."""
    return _BY_TORCH[dtype]


def parse(text: str) -> DType:
    """A dtype from its name or alias (``bf16``, ``float16`` ...), for command-line options."""
    for d in DTYPES.values():
        if text == d.name or text in d.aliases:
            return d
    names = sorted(n for d in DTYPES.values() for n in (d.name, *d.aliases))
    raise ValueError(f"unknown dtype {text!r}: one of {names}")


def bit_patterns(t: torch.Tensor) -> np.ndarray:
    """Raw bit patterns of a CPU copy of ``t`` as a uint16/uint32 NumPy array."""
    d = of(t.dtype)
    t = t.detach().to("cpu").contiguous()
    return t.view(d.int_view).numpy().view(d.uint)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bit patterns (NaN payloads and -0 included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    iv = of(a.dtype).int_view
    return torch.equal(a.contiguous().view(iv), b.contiguous().view(iv))


def nonzero_entries(t: torch.Tensor) -> torch.Tensor:
    """Per entry (the last axis reduced), whether any component's bit pattern is not +0.0's (-0.0 counts)."""
    return (t.contiguous().view(of(t.dtype).int_view) != 0).any(-1)


def from_bit_patterns(bits: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The tensor of ``dtype`` whose bit patterns are the uint16/uint32 array ``bits`` (no copy if contiguous)."""
    signed = {2: np.int16, 4: np.int32}[of(dtype).itemsize]  # torch has no uint16/uint32 views to go through
    if bits.size == 0:  # NumPy gives empty arrays zero strides, which torch then refuses to view as bytes
        return torch.empty(bits.shape, dtype=dtype)
    return torch.from_numpy(np.ascontiguousarray(bits).view(signed)).view(dtype)
