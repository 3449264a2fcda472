"""kernels/ ships as kvcodec._kernels and never needs Triton to import."""

import importlib.util

import pytest

import kvcodec
from kvcodec import _kernels


def test_kernels_package_is_inside_kvcodec():
    assert _kernels.__name__ == "kvcodec._kernels"
    assert importlib.util.find_spec("kernels") is None or "kvcodec" not in (importlib.util.find_spec("kernels").origin or "")


def test_require_triton_raises_backend_unavailable_without_triton():
    if _kernels.triton_available():
        pytest.skip("Triton is installed here")
    with pytest.raises(kvcodec.BackendUnavailable):
        _kernels.require_triton()
