"""Every golden vector decodes with the independent implementation in tests/independent (written from spec/
alone): container, lossless, lossy, static token streams, residuals applied to the recorded regenerations,
(1.3) layer state tensors from state sections or the recorded regenerations, (1.6) predicted slices with the
predictors file beside the vector, (1.10) engine files rebuilt byte for byte (§15)."""

import hashlib
import json
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from .independent import decoder as K

VECTORS = Path(__file__).resolve().parent.parent / "spec" / "vectors"
CASES = sorted(p.stem for p in VECTORS.glob("*.kvz"))


@pytest.mark.parametrize("case", CASES)
def test_independent_decoder_reads_the_vector(case):
    meta = json.loads((VECTORS / f"{case}.json").read_text())
    buf = (VECTORS / f"{case}.kvz").read_bytes()
    regen = None
    rp = VECTORS / f"{case}.regen.safetensors"
    if rp.exists():
        info0, _ = K.parse_container(buf)
        st, w = load_file(str(rp)), info0["W"]
        n = len(info0["layers"])
        regen = ([np.ascontiguousarray(st[f"keys.{i}"]).view(f"<u{w}") for i in range(n)],
                 [np.ascontiguousarray(st[f"values.{i}"]).view(f"<u{w}") for i in range(n)],
                 # (1.3) state tensors, state.<layer>.<index> in state order (Appendix A)
                 [None if x["state"] is None else
                  [np.ascontiguousarray(st[f"state.{i}.{j}"]).view(f"<u{t['W']}")
                   for j, t in enumerate(x["state"]["tensors"])]
                  for i, x in enumerate(info0["layers"])])
    # (1.6) predicted slices: the predictors file named by the header lies beside the vector (Appendix A)
    pp = VECTORS / f"{case}.predictors.safetensors"
    predictors = pp.read_bytes() if pp.exists() else None
    if meta.get("sign_rule") == 0:  # spec 13: a decoder MAY refuse Sign_Rule 0 (this one does); one that decodes
        with pytest.raises(K.UnsupportedVersion):  # it MUST produce the hashes (the reference's test_vectors)
            K.decode_file(buf, regen, predictors=predictors)
        return
    info, tokens, ks, vs, _notes = K.decode_file(buf, regen, predictors=predictors)
    if meta.get("tokens") is not None and tokens is not None and all(t is not None for t in tokens):
        assert tokens == meta["tokens"]
    w = info["W"]
    assert [hashlib.sha256(x.astype(f"<u{w}").tobytes()).hexdigest() for x in ks] == meta["keys_sha256"]
    assert [hashlib.sha256(x.astype(f"<u{w}").tobytes()).hexdigest() for x in vs] == meta["values_sha256"]
    if "states_sha256" in meta:
        states = info["states"]
        assert states is not None
        got = [None if x is None else
               [hashlib.sha256(np.ascontiguousarray(a).astype(f"<u{a.dtype.itemsize}").tobytes()).hexdigest()
                for a in x]
               for x in states]
        assert got == meta["states_sha256"]
    else:
        assert info["states"] is None or all(x is None for x in info["states"])
    # (1.10) engine files: the state file the .kvz rebuilds (§15), beside the vector as <case>.engine.bin
    if "engine_file_sha256" in meta:
        assert info["engine"] is not None
        rebuilt = K.rebuild_engine_file(buf)
        assert hashlib.sha256(rebuilt).hexdigest() == meta["engine_file_sha256"]
        assert rebuilt == (VECTORS / f"{case}.engine.bin").read_bytes()
    else:
        assert info["engine"] is None


# ------------------------------------------------ engine_file validation (1.10, §15), on the engine vector
ENGINE_CASE = "engine_llama_seq"


def _rewrite(buf, edit=None, minor=None):
    """The file with its header JSON changed by edit(header) (and its Version_Minor by minor), the header
    written canonically, every offset and checksum recomputed (sections unchanged)."""
    hl = struct.unpack_from("<I", buf, 12)[0]
    hdr = json.loads(buf[16:16 + hl])
    if edit is not None:
        edit(hdr)
    raw = json.dumps(hdr, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    pre = buf[:8] + struct.pack("<HHI", 1, struct.unpack_from("<H", buf, 10)[0] if minor is None else minor,
                                len(raw))
    hck = K.xxh(pre + raw)
    io = struct.unpack_from("<Q", buf, len(buf) - 32)[0]
    body = buf[16 + hl + 8:io]
    delta = len(raw) - hl
    ipay = bytearray(buf[io + 40:len(buf) - 32])
    for i in range(struct.unpack_from("<I", ipay, 0)[0]):
        off = struct.unpack_from("<Q", ipay, 8 + 32 * i)[0]
        struct.pack_into("<Q", ipay, 8 + 32 * i, off + delta)
    new_io = io + delta
    ih = bytearray(buf[io:io + 32])
    struct.pack_into("<Q", ih, 24, K.xxh(ipay))
    ih = bytes(ih) + struct.pack("<Q", K.xxh(ih))
    n = new_io + 40 + len(ipay) + 32
    foot = struct.pack("<QQ", new_io, n)
    foot += struct.pack("<Q", K.xxh(foot + struct.pack("<Q", hck))) + K.END_MAGIC
    return pre + raw + struct.pack("<Q", hck) + body + ih + bytes(ipay) + foot


def _ef(f):
    def edit(h):
        f(h["engine_file"])
    return edit


def _set(**kv):
    return _ef(lambda e: e.update(kv))


def _del(k):
    return _ef(lambda e: e.pop(k))


BAD_HEADERS = {
    "missing_kind": (_del("kind"), "FormatError"),
    "missing_model": (_del("model"), "FormatError"),
    "unknown_key": (_set(extra=1), "FormatError"),
    "engine_not_str": (_set(engine=3), "FormatError"),
    "length_negative": (_set(length=-1), "FormatError"),
    "length_above_limit": (_set(length=K.OUTPUT_LIMIT + 1), "LimitExceeded"),
    "length_bool": (_set(length=True), "FormatError"),
    "verbatim_above_length": (_set(verbatim=477), "FormatError"),
    "sha256_upper": (_set(sha256="FB6AF82FD0D0BBBB4190866D64697CEAF3C1FC177CC9954A046A8D5165FFAE03"), "FormatError"),
    "sha256_null_lossless": (_set(sha256=None), "FormatError"),
    "model_no_file_sha256": (_set(model={"name": "tiny"}), "FormatError"),
    "model_unknown_key": (_set(model={"file_sha256": "0" * 64, "y": 1}), "FormatError"),
    "engine_file_null": (lambda h: h.update(engine_file=None), "FormatError"),
    "pieces_not_list": (_set(pieces={}), "FormatError"),
    "pieces_too_many": (_set(pieces=[["bytes", 0, 0]] * ((1 << 20) + 1)), "LimitExceeded"),
    "piece_two_items": (_ef(lambda e: e["pieces"].__setitem__(0, ["bytes", 0])), "FormatError"),
    "piece_unknown_tag": (_ef(lambda e: e["pieces"].__setitem__(0, ["byte", 0, 120])), "FormatError"),
    "bytes_beyond_verbatim": (_ef(lambda e: e["pieces"].__setitem__(0, ["bytes", 37, 120])), "FormatError"),
    "bytes_negative": (_ef(lambda e: e["pieces"].__setitem__(0, ["bytes", -1, 120])), "FormatError"),
    "recomputed_without_recompute": (_ef(lambda e: e["pieces"].__setitem__(0, ["recomputed", 0, 120])),
                                     "FormatError"),
    "layer_out_of_range": (_ef(lambda e: e["pieces"].__setitem__(1, ["keys", 2, "rows"])), "FormatError"),
    "order_unknown": (_ef(lambda e: e["pieces"].__setitem__(1, ["keys", 0, "cols"])), "UnknownId"),
    "order_not_str": (_ef(lambda e: e["pieces"].__setitem__(1, ["keys", 0, 1])), "FormatError"),
    "pair_twice": (_ef(lambda e: e["pieces"].__setitem__(3, ["keys", 0, "columns"])), "FormatError"),
    "lengths_short": (_ef(lambda e: e["pieces"].pop(0)), "FormatError"),
    "sliding_window_layer": (lambda h: h["cache"]["layers"][0].update(sliding_window=8), "FormatError"),
    "batch_2": (lambda h: h["cache"].update(batch=2), "FormatError"),
    "tier_lossy_with_sha256": (lambda h: h.update(tier="lossy", codec={"id": "vq_rans", "params": {}}),
                               "FormatError"),
    "recompute_in_lossy": (lambda h: (h.update(tier="lossy", codec={"id": "vq_rans", "params": {}}),
                                      h["engine_file"].update(sha256=None, recompute=dict(RECOMPUTE))),
                           "FormatError"),
    "recompute_missing_params": (_ef(lambda e: e.update(recompute={k: v for k, v in RECOMPUTE.items()
                                                                   if k != "params"})), "FormatError"),
    "recompute_tokens_beyond": (_ef(lambda e: e.update(recompute=dict(RECOMPUTE, tokens=[140, 5]))),
                                "FormatError"),
    "recompute_length_above_limit": (_ef(lambda e: e.update(recompute=dict(RECOMPUTE,
                                                                           length=K.OUTPUT_LIMIT + 1))),
                                     "LimitExceeded"),
    "recompute_ubatch_above_batch": (_ef(lambda e: e.update(recompute=dict(
        RECOMPUTE, params=dict(RECOMPUTE["params"], n_ubatch=1024)))), "FormatError"),
    "recompute_type_unknown": (_ef(lambda e: e.update(recompute=dict(
        RECOMPUTE, params=dict(RECOMPUTE["params"], type_k="q8_1")))), "FormatError"),
}
# a recompute object (§15.2) regenerating the first 120 bytes of the vector's sequence file from its 5 token
# ids, which lie at byte 12 of the engine_bytes data (u32 magic, version, count, then the ids, §15.1)
RECOMPUTE = {"engine": "llama.cpp", "procedure": "llama.cpp-seq-prefill-v1", "length": 120, "tokens": [12, 5],
             "params": {"n_batch": 512, "n_ubatch": 512, "flash_attn": False, "type_k": "f16", "type_v": "f16",
                        "build": "b0"}}


@pytest.mark.parametrize("name", sorted(BAD_HEADERS))
def test_independent_engine_file_rules(name):
    buf = (VECTORS / f"{ENGINE_CASE}.kvz").read_bytes()
    edit, err = BAD_HEADERS[name]
    with pytest.raises(getattr(K, err)):
        K.parse_container(_rewrite(buf, edit))


def test_independent_engine_file_container():
    buf = (VECTORS / f"{ENGINE_CASE}.kvz").read_bytes()
    assert _rewrite(buf) == buf  # the rewriter is exact
    with pytest.raises(K.FormatError):  # §3: stamped below 1.10
        K.parse_container(_rewrite(buf, minor=9))
    with pytest.raises(K.UnsupportedVersion):
        K.parse_container(_rewrite(buf, minor=K.IMPL_MINOR + 1))
    with pytest.raises(K.OffsetError):  # an engine_bytes section without an engine_file
        K.parse_container(_rewrite(buf, lambda h: h.pop("engine_file")))
    with pytest.raises(K.ChecksumMismatch):  # tier lossless: the SHA-256 of the file rebuilt
        K.rebuild_engine_file(_rewrite(buf, _set(sha256="0" * 64)))
    with pytest.raises(K.ModelMismatch):
        K.rebuild_engine_file(buf, model_file_sha256="1" * 64)
    with pytest.raises(K.ConfigError):  # a null model: only on explicit instruction
        K.rebuild_engine_file(_rewrite(buf, _set(model=None)))
    assert K.rebuild_engine_file(_rewrite(buf, _set(model=None)), allow_null_model=True) == \
        (VECTORS / f"{ENGINE_CASE}.engine.bin").read_bytes()


def test_independent_engine_file_recompute():
    buf = (VECTORS / f"{ENGINE_CASE}.kvz").read_bytes()
    want = (VECTORS / f"{ENGINE_CASE}.engine.bin").read_bytes()

    def edit(e):
        e["recompute"] = dict(RECOMPUTE)
        e["pieces"][0] = ["recomputed", 0, 120]
    f = _rewrite(buf, _ef(edit))
    seen = []

    def regenerate(rc, model, ids):
        seen.append((rc["procedure"], model["file_sha256"], ids))
        return want[:120]
    assert K.rebuild_engine_file(f, regenerate) == want
    assert seen == [("llama.cpp-seq-prefill-v1", "3ec4175ae3e065e72292da87eb0df1a77ef3704061cf49dafa65d7eaf8f4e8a7",
                     list(struct.unpack_from("<5i", want, 12)))]
    with pytest.raises(K.ConfigError):  # the engine is needed
        K.rebuild_engine_file(f)
    with pytest.raises(K.ChecksumMismatch):  # an engine that computes otherwise
        K.rebuild_engine_file(f, lambda rc, m, ids: bytes(120))
    with pytest.raises(K.ChecksumMismatch):
        K.rebuild_engine_file(f, lambda rc, m, ids: want[:119])
    # an unknown (engine, procedure) pair: the cache still decodes, the engine file cannot be rebuilt (§15.2)
    g = _rewrite(buf, _ef(lambda e: (edit(e), e["recompute"].update(procedure="other", params={"z": 1}))))
    K.decode_file(g)
    with pytest.raises(K.UnknownId):
        K.rebuild_engine_file(g, regenerate)


def test_independent_decoder_checks_model_weights_of_a_1_12_file():
    """(1.12, spec 4.1) A token-tier file made now carries model.weights and is stamped 1.12; the independent
    decoder reads its header and computes the same weights from the shipped model's files (config.json and
    safetensors) - no transformers - so it can refuse another model; a 1.11 stamp with weights is refused."""
    import torch
    from transformers import AutoModelForCausalLM

    import kvcodec

    d = VECTORS / "models" / "tiny-llama"
    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(3))
    data = kvcodec.encode(kvcodec.models.prefill(m, ids), m, tokens=ids, token_model="static")
    K.parse_container(data)  # the container and header as the spec reads them
    assert struct.unpack_from("<H", data, 10)[0] == 12
    head = json.loads(data[16:16 + struct.unpack_from("<I", data, 12)[0]])
    assert head["model"]["weights"] == K.weights_fingerprint(d)
    with pytest.raises(K.FormatError):
        K.validate_header(head, 11)
