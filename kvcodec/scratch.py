"""Scratch memory the decoders reuse from one call to the next, instead of asking the allocator each time.

A decode's large temporaries (each stream's direct decoding table, 128 KiB for a lossless stream; the lossy
tier's index symbols, 768 KiB a slice of SmolLM2) are freed a few milliseconds after they are made.  Whether
the C allocator then hands the next decode the same memory or maps new pages, which the system fills with
zeros on first touch (~11,000 page faults a lossy decode of a 2,048-token SmolLM2 cache), depends on what the
process did before: glibc serves requests from 128 KiB up with new mappings until it has freed a mapping that
large (its "dynamic mmap threshold"), and returns the top of its heap to the system when enough of it is free.
So the same decode ran 1.6x slower in a fresh process than in one that had compiled kernels first
(BENCHMARKS.md, "Decode, eighth pass").  The buffers here are kept between calls (at most :data:`CAP` bytes in
all, process-wide), so a decode's temporaries touch memory that is already mapped whatever the process's
history.

:func:`take` hands out a buffer no one else holds; :func:`give` takes it back once its user is done with it
(and nothing still reads it).  Thread-safe.  :func:`clear` lets the memory go.
"""

from __future__ import annotations

import threading

import numpy as np

__all__ = ["take", "give", "clear", "held_bytes", "outstanding", "aligned", "CAP"]

#: bytes of free buffers kept between calls, at most (the rest are freed when given back)
CAP = 32 << 20
#: False: every buffer is new memory and none is kept (as before this module; a switch for A/B timings)
ENABLED = True
#: sizes are rounded up to a multiple of this (buffers of one size class are interchangeable)
_GRAIN = 64 << 10

_LOCK = threading.Lock()
_FREE: dict[int, list[np.ndarray]] = {}
_OUT: dict[int, np.ndarray] = {}  # the buffers handed out, by address
_HELD = 0


def aligned(nbytes: int, zero: bool = False) -> np.ndarray:
    """New memory (not from the free buffers): a uint8 array of ``nbytes`` bytes starting on a 64-byte boundary
    (a cache line: a vector load of an aligned row never straddles two), zero-filled if ``zero``."""
    raw = (np.zeros if zero else np.empty)(nbytes + 64, dtype=np.uint8)
    at = -raw.ctypes.data % 64
    return raw[at:at + nbytes]


def _size_class(nbytes: int) -> int:
    return max(_GRAIN, -(-nbytes // _GRAIN) * _GRAIN)


def take(nbytes: int, dtype=np.uint8) -> np.ndarray:
    """A 1-D array of ``nbytes`` bytes as ``dtype`` (uninitialised, 64-byte aligned), from the free buffers when
    one of its size is there, else new; hand it back with :func:`give` when nothing reads it any more."""
    dtype = np.dtype(dtype)
    if nbytes < 0 or nbytes % dtype.itemsize:
        raise ValueError(f"take: {nbytes} bytes is not a whole number of {dtype} items")
    size = _size_class(nbytes)
    global _HELD
    with _LOCK:
        free = _FREE.get(size) if ENABLED else None
        block = free.pop() if free else None
        if block is not None:
            _HELD -= size
    if block is None:
        block = aligned(size)
    with _LOCK:
        _OUT[block.ctypes.data] = block
    return block[:nbytes].view(dtype)


def give(arr: np.ndarray) -> None:
    """Take back an array :func:`take` handed out (whole, as it was handed out); it is kept for the next call
    while the free buffers stay within :data:`CAP`, else freed."""
    global _HELD
    with _LOCK:
        block = _OUT.pop(arr.ctypes.data, None) if isinstance(arr, np.ndarray) else None
        if block is None:
            raise ValueError("give: not an array take() handed out, or given back already")
        size = block.nbytes
        if ENABLED and _HELD + size <= CAP:
            _FREE.setdefault(size, []).append(block)
            _HELD += size


def clear() -> None:
    """Free every buffer kept between calls."""
    global _HELD
    with _LOCK:
        _FREE.clear()
        _HELD = 0


def held_bytes() -> int:
    """Bytes of free buffers kept now."""
    with _LOCK:
        return _HELD


def outstanding() -> int:
    """Buffers handed out and not given back yet."""
    with _LOCK:
        return len(_OUT)
