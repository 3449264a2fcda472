"""Layer state (format 1.3, spec sections 4.2 and 5.6): hostile headers and payloads raise named errors before
any large allocation, tampered state is caught by its checksum, and caches that cannot be stored faithfully
are refused by name."""

import json
from pathlib import Path

import pytest
import torch

import kvcodec
from kvcodec.state import CODING_RAW, CODING_ZSTD, LayerState, decode_payload, encode_payload
from kvcodec.tokens.plan import output_cache

from .common import VOCAB, cache_arg, check_rejects, fuzz_tools, tiny_model

VECTORS = Path(__file__).resolve().parent.parent / "spec" / "vectors"
header_of, with_header, reseal = fuzz_tools().header_of, fuzz_tools().with_header, fuzz_tools().reseal


def _vector(case):
    return (VECTORS / f"{case}.kvz").read_bytes()


def _state_header(mutate):
    data = _vector("lossless_state")
    h = header_of(data)
    mutate(h["cache"]["layers"])
    return with_header(data, h)


@pytest.mark.parametrize("mutate,error,match", [
    (lambda ls: ls[0]["state"].update(kind="ssm"), kvcodec.UnknownId, "kind"),
    (lambda ls: ls[0]["state"]["tensors"][0].update(name="hidden"), kvcodec.UnknownId, "name"),
    (lambda ls: ls[0]["state"]["tensors"][0].update(dtype="int8"), kvcodec.UnknownId, "dtype"),
    (lambda ls: ls[0]["state"]["tensors"][0].update(shape=[1, 24]), kvcodec.FormatError, "3-dimensional"),
    (lambda ls: ls[0]["state"]["tensors"][0].update(shape=[2, 6, 4]), kvcodec.FormatError, "batch"),
    (lambda ls: ls[0]["state"]["tensors"][1].update(shape=[1, 2 ** 31, 2 ** 31, 8]), kvcodec.LimitExceeded,
     "bytes"),
    (lambda ls: ls[0]["state"]["tensors"][1].update(shape=[1, 2 ** 32]), kvcodec.LimitExceeded, "shape"),
    (lambda ls: ls[0]["state"]["tensors"][1].update(shape=[1] * 9), kvcodec.FormatError, "1 to 8"),
    (lambda ls: ls[0]["state"]["tensors"].reverse(), kvcodec.FormatError, "order"),
    (lambda ls: ls[0]["state"]["tensors"][1].update(slot=1), kvcodec.FormatError, "slot"),
    (lambda ls: ls[0]["state"].update(slots=0), kvcodec.FormatError, "slots"),
    (lambda ls: ls[0].update(seq_len=3, cumulative_length=3), kvcodec.FormatError, "linear"),
    (lambda ls: ls[0]["state"].update(extra=1), kvcodec.FormatError, "unknown keys"),
    # its state sections are no longer expected: the first one found is refused by its type and layer
    (lambda ls: ls[2].pop("state"), kvcodec.OffsetError, "Section_Type"),
    (lambda ls: ls[3]["state"]["tensors"][0].update(shape=[1, 5, 4]), kvcodec.FormatError, "one row per"),
    (lambda ls: ls[3].update(sliding_window=4, cumulative_length=9), kvcodec.FormatError, "full-attention"),
    (lambda ls: ls[2]["state"]["tensors"][0].update(name="indexer_keys"), kvcodec.FormatError, "indexer_keys"),
    (lambda ls: ls[3]["state"]["tensors"][0].update(name="conv"), kvcodec.FormatError, "indexed"),
])
def test_hostile_state_headers_are_refused_by_field(mutate, error, match):
    check_rejects(error, _state_header(mutate), match=match)


def test_a_state_file_stamped_below_1_3_is_refused():
    data = bytearray(_vector("lossless_state"))
    data[10] = 2
    check_rejects(kvcodec.FormatError, fuzz_tools().reseal(bytes(data)), match="1.3|1\\.3|Version")


def _with_payload(monkeypatch, payload: bytes) -> bytes:
    """A lossless file of a Mamba cache whose first state section holds ``payload`` (checksums valid)."""
    import kvcodec.tiers.base as base

    model = tiny_model("mamba")
    with torch.no_grad():
        cache = output_cache(model(torch.randint(0, VOCAB, (1, 6)), use_cache=True))
    first = {"done": False}

    def crafted(t):
        if first["done"]:
            return encode_payload(t)
        first["done"] = True
        return payload

    monkeypatch.setattr(base, "encode_payload", crafted)
    return kvcodec.encode(cache)


@pytest.mark.parametrize("payload,match", [
    (bytes([2]) + bytes(7) + bytes(16), "Coding"),
    (bytes([CODING_RAW, 1]) + bytes(6) + bytes(16), "reserved"),
    (bytes([CODING_RAW]) + bytes(7) + bytes(5), "raw state data of 5 bytes"),
    (bytes([CODING_RAW]) + bytes(3), "shorter"),
    (bytes([CODING_ZSTD]) + bytes(7) + b"not zstd", "not a zstd frame"),
    (bytes([CODING_ZSTD]) + bytes(7) + bytes.fromhex("2ab54d18") + bytes(8), "not a zstd frame"),  # skippable
])
def test_hostile_state_payloads_raise_format_errors(monkeypatch, payload, match):
    data = _with_payload(monkeypatch, payload)
    check_rejects(kvcodec.FormatError, data, match=match)


def test_zstd_state_frames_must_declare_exactly_their_size(monkeypatch):
    import zstandard

    raw = bytes(1024 * 2 * 4 * 4)  # far more than the tensor: never allocated, refused from the frame header
    for frame, match in ((zstandard.ZstdCompressor(write_content_size=True).compress(raw), "declares"),
                         (zstandard.ZstdCompressor(write_content_size=False).compress(raw), "declares no"),
                         (zstandard.ZstdCompressor(write_content_size=True).compress(b"x" * 64)[:-3], "zstd")):
        check_rejects(kvcodec.FormatError, bytes([CODING_ZSTD]) + bytes(7) + frame, match=match,
                      fn=lambda p: decode_payload(p, "float32", (1, 4, 4), 0))
        data = _with_payload(monkeypatch, bytes([CODING_ZSTD]) + bytes(7) + frame)
        check_rejects(kvcodec.FormatError, data, match="zstd")


def test_payloads_round_trip_every_dtype_and_special_value():
    for t in (torch.tensor([[float("nan"), -0.0, float("inf"), 1e-40]]), torch.randn(2, 3, 4).bfloat16(),
              torch.zeros(1, 0, 3, dtype=torch.float16), torch.randn(1, 8).half()):
        back = decode_payload(encode_payload(t), str(t.dtype)[6:], tuple(t.shape), 0)
        assert back.dtype == t.dtype and back.shape == t.shape
        assert torch.equal(back.view(torch.int16 if t.element_size() == 2 else torch.int32),
                           t.view(torch.int16 if t.element_size() == 2 else torch.int32))


def test_tampered_state_section_of_a_token_tier_file_fails_its_checksum():
    """exact_state keeps layer 1's recurrent state in a state section: change one of its floats (resealing the
    payload checksum, as an attacker or a buggy tool would) and the tensor checksum catches it."""
    import zstandard
    from safetensors.torch import load_file

    from kvcodec.container import layout as L
    from kvcodec.container.reader import KvzReader

    data = _vector("exact_state")
    with KvzReader(data) as r:
        e = r.entry(L.SECTION_STATE, 1, 1, 0)
        payload = r.read_payload(e)
    raw = bytearray(zstandard.ZstdDecompressor().decompress(payload[8:]))
    raw[0] ^= 1
    new = bytes([CODING_RAW]) + bytes(7) + bytes(raw)
    assert len(new) != len(payload)
    # rebuild the file with the same header and the tampered section, through the writer
    import io

    from kvcodec.container.writer import KvzWriter

    out = io.BytesIO()
    with KvzReader(data) as r:
        w = KvzWriter(out, r.header.raw)
        for s in r.sections:
            p = r.read_payload(s)
            w.write_section(s.section_type, new if s.section_type == L.SECTION_STATE else p, layer=s.layer,
                            part=s.part, chunk=s.chunk)
        w.close()
    t = load_file(str(VECTORS / "exact_state.regen.safetensors"))
    regen = kvcodec.KVCache([t["keys.0"], t["keys.1"]], [t["values.0"], t["values.1"]], cumulative_length=[0, 0],
                            states=[LayerState("linear", 1, [t[f"state.{i}.0"]], [t[f"state.{i}.1"]])
                                    for i in range(2)])
    with kvcodec.open_kvz(data) as f:
        assert f.to_kvcache(regenerated=regen).states[1].recurrent[0] is not None
    with kvcodec.open_kvz(out.getvalue()) as f, pytest.raises(kvcodec.ChecksumMismatch, match="recurrent state"):
        f.to_kvcache(regenerated=regen)


def test_layer_recording_its_past_is_refused_by_name():
    model = tiny_model("mamba")
    with torch.no_grad():
        cache = output_cache(model(torch.randint(0, VOCAB, (1, 6)), use_cache=True))
    cache.layers[1].activate_past_recording()
    check_rejects(kvcodec.UnsupportedCache, cache, match="layer 1: .*records its past.*crop")


def test_kvcache_checks_the_states_it_is_given():
    k = torch.zeros(1, 1, 0, 1)
    with pytest.raises(ValueError, match="conv"):
        kvcodec.KVCache([k], [k], cumulative_length=[0], states=[LayerState("linear", 1, [torch.zeros(1, 4)],
                                                                              [None])])
    with pytest.raises(ValueError, match="batch"):
        kvcodec.KVCache([k], [k], cumulative_length=[0], states=[LayerState("linear", 1, [None],
                                                                              [torch.zeros(2, 4)])])
    with pytest.raises(ValueError, match="linear"):
        kvcodec.KVCache([torch.zeros(1, 1, 3, 1)], [torch.zeros(1, 1, 3, 1)],
                        states=[LayerState("linear", 1, [None], [torch.zeros(1, 4)])])
    with pytest.raises(TypeError, match="LayerState"):
        kvcodec.KVCache([k], [k], cumulative_length=[0], states=[{"conv": None}])


def test_decoded_state_is_not_changed_by_generating_from_it():
    """transformers updates conv / recurrent states in place: a restored DynamicCache holds copies, so the
    KVCache it came from (and a second restore) stays as decoded."""
    model = tiny_model("falcon_h1")
    ids = torch.randint(0, VOCAB, (1, 8))
    with torch.no_grad():
        cache = output_cache(model(ids, use_cache=True))
    kv = kvcodec.decode(kvcodec.encode(cache), output="kvcache")
    before = [t.clone() for st in kv.states if st is not None for _, _, t in st.tensors()]
    model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0, **cache_arg(model, kv.to_dynamic_cache()))
    after = [t for st in kv.states if st is not None for _, _, t in st.tensors()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_inspect_names_every_state_tensor():
    info = kvcodec.inspect(VECTORS / "lossless_state.kvz")
    assert info["state"]["tensors"] == 5 and info["state"]["layers"] == {0: "linear", 2: "hybrid", 3: "indexed"}
    states = [s for s in info["sections"] if s["type"] == "state"]
    assert [(s["layer"], s["state"], s["slot"], s["coding"]) for s in states] == [
        (0, "conv", 0, "raw"), (0, "recurrent", 0, "zstd"), (2, "conv", 0, "raw"), (2, "recurrent", 1, "zstd"),
        (3, "indexer_keys", 0, "raw")]
    json.dumps(info)
