"""kvcodec/_kernels (the Triton kernels) never needs Triton to import, and shadows no other package."""

import importlib.util

import pytest

import kvcodec
from kvcodec import _kernels


def test_kernels_package_is_inside_kvcodec():
    """The kernels are ``kvcodec._kernels``; nothing in this checkout is importable as a top-level ``kernels``
    (PyPI's `kernels`, which transformers imports when it is installed: a top-level ``kernels`` directory
    shadowed it wherever the checkout's root was on sys.path, as under pytest, and broke every model load)."""
    from pathlib import Path

    assert _kernels.__name__ == "kvcodec._kernels"
    root = Path(__file__).resolve().parents[1]
    assert not (root / "kernels").exists()
    spec = importlib.util.find_spec("kernels")  # PyPI's, when installed (a venv may live inside the checkout)
    assert spec is None or Path(spec.origin or "/").resolve().parent != root / "kernels"


def test_require_triton_raises_backend_unavailable_without_triton():
    if _kernels.triton_available():
        pytest.skip("Triton is installed here")
    with pytest.raises(kvcodec.BackendUnavailable):
        _kernels.require_triton()
