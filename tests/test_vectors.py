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
LOSSLESS = ["bf16_basic", "fp32_chunked_tokens", "fp16_special_raw", "bf16_sliding_window", "fp16_tiny"]
TOKEN_TIERS = ["exact_static_prefill", "exact_lm_steps", "exact_lm_residual", "tokens_tolerance_padded"]
LOSSY = ["lossy_uniform_window", "lossy_kivi"]
CASES = LOSSLESS + TOKEN_TIERS + LOSSY


def sha(t):
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def test_vector_set_is_complete():
    found = sorted(p.stem for p in VECTORS.glob("*.kvz"))
    assert found == sorted(CASES)
    assert all((VECTORS / f"{c}.json").is_file() for c in CASES)


@pytest.mark.parametrize("case", LOSSLESS)
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


@pytest.mark.parametrize("case", LOSSLESS)
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


def test_spec_byte_walkthrough_matches_the_vector():
    """Every fully written hex line of spec/kvz.md Appendix A.1 is the vector's bytes at that offset."""
    import re

    spec = (VECTORS.parent / "kvz.md").read_text()
    block = spec.split("### A.1")[1].split("```")[1]
    data = (VECTORS / "fp16_tiny.kvz").read_bytes()
    checked = 0
    for line in block.splitlines():
        m = re.match(r"^(\d+)\s+((?:[0-9a-f]{2}(?: \| | |$))+)", line)
        if not m or "..." in line:
            continue
        hexes = bytes(int(h, 16) for h in re.findall(r"[0-9a-f]{2}", m.group(2)))
        off = int(m.group(1))
        assert data[off:off + len(hexes)] == hexes, line
        checked += 1
    assert checked >= 8


def _vector_model():
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(VECTORS / "models" / "tiny-llama", dtype=torch.float32).eval()


def _encode_options(meta):
    opts = dict(meta["options"])
    if "attention_mask" in opts:
        opts["attention_mask"] = torch.tensor(opts["attention_mask"])
    return opts


@pytest.mark.parametrize("case", TOKEN_TIERS)
def test_decode_token_tier_vector(case):
    """Decoding needs the shipped tiny model; the result is checked against the input tensors' hashes (exact
    tier) or within the tolerance (every slice is also checked by its tensor checksum inside the decoder)."""
    meta = json.loads((VECTORS / f"{case}.json").read_text())
    data = (VECTORS / f"{case}.kvz").read_bytes()
    assert hashlib.sha256(data).hexdigest() == meta["file_sha256"]
    assert data[8:12] == b"\x01\x00\x01\x00"  # format 1.1
    model = _vector_model()
    kv = kvcodec.decode(data, model, output="kvcache")
    assert kv.tokens.tolist() == meta["tokens"]
    if meta["options"].get("tier", "exact") == "exact":
        assert [sha(t) for t in kv.keys] == meta["keys_sha256"]
        assert [sha(t) for t in kv.values] == meta["values_sha256"]
    with pytest.raises(kvcodec.ConfigError):
        kvcodec.decode(data)  # the model is required


@pytest.mark.parametrize("case", TOKEN_TIERS)
def test_reencode_token_tier_vector(case):
    """Re-encoding the decoded cache gives the same sections (the header's procedure records this machine's
    library versions and thread count, which are informative)."""
    meta = json.loads((VECTORS / f"{case}.json").read_text())
    data = (VECTORS / f"{case}.kvz").read_bytes()
    model = _vector_model()
    kv = kvcodec.decode(data, model, output="kvcache")
    if meta["options"].get("tier", "exact") != "exact":
        return  # a lossy file re-encodes its reconstruction, not its input
    info = KvzReader(data).header.raw["info"]
    again = kvcodec.encode(kv, model, info=info, tokens=kv.tokens, **_encode_options(meta))
    with KvzReader(data) as a, KvzReader(again) as b:
        pa = [(e.section_type, e.layer, e.part, e.chunk, a.read_payload(e)) for e in a.sections]
        pb = [(e.section_type, e.layer, e.part, e.chunk, b.read_payload(e)) for e in b.sections]
        ha, hb = dict(a.header.raw), dict(b.header.raw)
    assert pa == pb
    for h in (ha, hb):
        h["tokens"] = {k: v for k, v in h["tokens"].items() if k != "procedure"}
    assert ha == hb


@pytest.mark.parametrize("case", LOSSY)
def test_decode_lossy_vector(case):
    """Lossy vectors pin spec section 13's reconstruction (checked independently in test_lossy.py): any change
    to the decoder's arithmetic changes these hashes.  Decoding needs no model and is deterministic."""
    meta = json.loads((VECTORS / f"{case}.json").read_text())
    data = (VECTORS / f"{case}.kvz").read_bytes()
    assert hashlib.sha256(data).hexdigest() == meta["file_sha256"]
    kv = kvcodec.decode(data, output="kvcache")
    assert [sha(t) for t in kv.keys] == meta["keys_sha256"]
    assert [sha(t) for t in kv.values] == meta["values_sha256"]
    assert kvcodec.inspect(data)["tier"] == "lossy"


@pytest.mark.parametrize("case", LOSSY)
def test_reencode_lossy_vector_from_its_inputs(case):
    """The lossy vectors' inputs come from fixed seeds (scripts/make_vectors.py): encoding them again with the
    recorded options must give the committed file byte for byte (catches an encoder change that was not
    followed by a deliberate regeneration)."""
    import sys
    import warnings

    sys.path.insert(0, str(VECTORS.parent.parent / "scripts"))
    import make_vectors

    meta = json.loads((VECTORS / f"{case}.json").read_text())
    name, kv, opts = next(c for c in make_vectors.lossy_cases() if c[0] == case)
    assert opts == meta["options"]
    assert [sha(t) for t in kv.keys] == meta["input_keys_sha256"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        data = kvcodec.encode(kv, info=make_vectors.INFO, threads=1, **opts)
    assert data == (VECTORS / f"{case}.kvz").read_bytes()
