"""Golden vectors (spec/vectors): decode byte-exactly, re-encode to identical bytes.

The vectors are written by ``scripts/make_vectors.py`` and committed; a missing
vector is a failure, and nothing here ever writes one.
"""

import hashlib
import json
from pathlib import Path

import pytest
import torch

import kvcodec
from kvcodec.container.reader import KvzReader

VECTORS = Path(__file__).resolve().parent.parent / "spec" / "vectors"
CASES = ["bf16_basic", "fp32_chunked_tokens", "fp16_special_raw", "bf16_sliding_window", "fp16_tiny"]


def sha(t):
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def test_vector_set_is_complete():
    found = sorted(p.stem for p in VECTORS.glob("*.kvz"))
    assert found == sorted(CASES)
    assert all((VECTORS / f"{c}.json").is_file() for c in CASES)


@pytest.mark.parametrize("case", CASES)
def test_decode_vector(case):
    meta = json.loads((VECTORS / f"{case}.json").read_text())
    data = (VECTORS / f"{case}.kvz").read_bytes()
    assert hashlib.sha256(data).hexdigest() == meta["file_sha256"]
    kv = kvcodec.decode(data, output="kvcache")
    assert kv.dtype_name == meta["dtype"]
    assert [sha(t) for t in kv.keys] == meta["keys_sha256"]
    assert [sha(t) for t in kv.values] == meta["values_sha256"]
    assert (kv.tokens.tolist() if kv.tokens is not None else None) == meta["tokens"]
    assert kv.start_position == meta["start_position"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", ["numba", "python"])
def test_reencode_vector_identically(case, backend, monkeypatch):
    monkeypatch.setenv("KVCODEC_BACKEND", backend)
    meta = json.loads((VECTORS / f"{case}.json").read_text())
    data = (VECTORS / f"{case}.kvz").read_bytes()
    kv = kvcodec.decode(data, output="kvcache")
    info = KvzReader(data).header.raw["info"]
    assert kvcodec.encode(kv, info=info, threads=1, **meta["options"]) == data


def test_raw_mode_vector_has_a_raw_section():
    info = kvcodec.inspect(VECTORS / "fp16_special_raw.kvz")
    assert max(s["bits_per_component"] or 0 for s in info["sections"]) > 16
