"""Triton kernels of kvcodec (installed as ``kvcodec._kernels``).

Triton is imported lazily: CPU-only installs never import it.  Kernels follow
the ``_<op>_kernel`` (jitted, private) / ``<op>_launch`` (host launcher) split,
and each is tested against a torch reference, under ``TRITON_INTERPRET=1`` on
machines without a GPU.  ``vq``: the lossy tier's fused residual + rotation +
quantization and dequantization + add (bit-exact with the NumPy reference);
``rans``: the entropy decoder of the rANS lane streams, fused with ``vq_rans``
Method 5's dequantization (bit-exact with the CPU decoders);
``scripts/gpu_bench.py`` measures their bandwidth on a GPU.
"""

from __future__ import annotations

import importlib


def triton_available() -> bool:
    """True when Triton imports (it may still lack a device)."""
    try:
        importlib.import_module("triton")
    except Exception:  # ImportError, or a broken install raising at import
        return False
    return True


def require_triton():
    """Import and return the ``triton`` module, or raise :class:`~kvcodec.errors.BackendUnavailable`."""
    from kvcodec.errors import BackendUnavailable

    try:
        return importlib.import_module("triton")
    except Exception as e:
        raise BackendUnavailable(f"Triton is not available ({e}); install kvz[gpu] on a machine with a GPU") from None
