"""Coexistence with other libraries in one process."""

from __future__ import annotations


def llvmlite_shim() -> None:
    """vLLM 0.32's Triton-override registration (run as its workers start) scans every loaded module's objects
    with ``vars(x).get``; llvmlite's library wrapper (loaded by numba, which kvcodec's rANS uses) answers
    ``__dict__`` through its ``__getattr__`` with a wrapped C function, and the scan raises ``AttributeError``:
    a vLLM worker that imported kvcodec would not start.  Give that wrapper an empty ``__dict__`` answer
    (nothing in llvmlite asks for it).  Called by the modules that import numba."""
    try:
        from llvmlite.binding import ffi
    except ImportError:
        return
    tab = getattr(getattr(ffi, "lib", None), "_fntab", None)
    if isinstance(tab, dict):
        tab.setdefault("__dict__", {})
