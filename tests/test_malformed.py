"""Regression files: every input the fuzzer ever found a problem with, plus hand-made ones.

Each must be rejected with a KvzError - no other exception, no hang.  The hand-made files of issue 51 (spec
revision 1.11.1, ``fuzz/crafted.py``'s ``EXPECTED``) are rejected with exactly the class and field the spec names,
by the reference decoder and by the independent one (tests/independent, written from the spec); beside them, the
files those rules keep valid decode, in both.
"""

import hashlib
import json
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

import kvcodec

from .common import check_rejects
from .independent import decoder as K

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "malformed"
VECTORS = ROOT / "spec" / "vectors"
MALFORMED = sorted(DATA.glob("*.bin"))
LIMITS = {"max_output_bytes": 1 << 24}

if str(ROOT / "fuzz") not in sys.path:
    sys.path.insert(0, str(ROOT / "fuzz"))
import crafted as C


def test_there_are_regression_files():
    assert MALFORMED


def _predictors(path: Path):
    p = path.with_suffix(".predictors")
    return p.read_bytes() if p.exists() else None


@pytest.mark.parametrize("path", MALFORMED, ids=[p.name for p in MALFORMED])
def test_malformed_file_raises_kvz_error(path):
    check_rejects(kvcodec.KvzError, path.read_bytes(), limits=LIMITS)
    pred = _predictors(path)
    if pred is not None:  # a predicted file: with its predictors it reaches the payloads
        check_rejects(kvcodec.KvzError, path.read_bytes(), limits=LIMITS, predictors=pred)


def test_fuzz_smoke():
    """A few seconds of each fuzz target, so the harness itself stays working."""
    import subprocess

    r = subprocess.run([sys.executable, str(ROOT / "fuzz" / "fuzz.py"), "--seconds", "8", "--seed", "11"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 findings" in r.stdout


# --- issue 51: each rule's hostile file, its class and field, in both decoders ----------------------------------
def _independent(data: bytes, case: str | None = None, predictors: bytes | None = None):
    """The independent decoder's decode_file, with the vector's recorded regeneration (token tiers)."""
    regen = None
    rp = VECTORS / f"{case}.regen.safetensors"
    if case is not None and rp.exists():
        info0, _ = K.parse_container(data)
        st, w, n = load_file(str(rp)), info0["W"], len(info0["layers"])
        regen = ([np.ascontiguousarray(st[f"keys.{i}"]).view(f"<u{w}") for i in range(n)],
                 [np.ascontiguousarray(st[f"values.{i}"]).view(f"<u{w}") for i in range(n)],
                 [None] * n)
    return K.decode_file(data, regen, predictors=predictors)


def _hashes(ks, vs, w):
    return ([hashlib.sha256(x.astype(f"<u{w}").tobytes()).hexdigest() for x in ks],
            [hashlib.sha256(x.astype(f"<u{w}").tobytes()).hexdigest() for x in vs])


def _sha(t):
    from .test_vectors import sha

    return sha(t)


@pytest.mark.parametrize("name", sorted(C.EXPECTED))
def test_crafted_file_is_refused_with_the_spec_class_and_field(name):
    build, cls, field = C.EXPECTED[name]
    built = build()
    data, pred = built if isinstance(built, tuple) else (built, None)
    assert (DATA / name).read_bytes() == data, "stale: rerun python fuzz/crafted.py"
    assert _predictors(DATA / name) == pred
    kw = {} if pred is None else {"predictors": pred}
    e = check_rejects(getattr(kvcodec, cls), data, limits=LIMITS, **kw)
    assert (type(e).__name__, e.field) == (cls, field), e
    with pytest.raises(getattr(K, cls)):
        _independent(data, predictors=pred)


# --- the same rules keep these files valid ---------------------------------------------------------------------
def test_surgery_is_exact():
    """The helpers rebuild a vector byte for byte (so the hostile files differ in their one field only)."""
    for case in ("fp16_tiny", "lossy_predicted", "exact_static_prefill", "lossless_selected"):
        data = C.vector(case)
        assert C.rebuild(data, [tuple(s) for s in C._as_list(data)]) == data


@pytest.mark.parametrize("appended, cls", [(65504, "TrailingData"), (65505, "TruncatedFile")])
def test_earlier_footer_is_searched_in_the_last_64_kib(appended, cls):
    """Spec section 7 (a MUST since revision 1.11.1): candidates lie wholly in the last 65536 bytes, after the
    header; 65504 appended bytes leave the complete file's footer there, 65505 do not."""
    data = C.vector("fp16_tiny") + b"\x00" * appended
    e = check_rejects(getattr(kvcodec, cls), data)
    assert e.field == ("File_Length" if cls == "TrailingData" else "End_Magic")
    with pytest.raises(getattr(K, cls)):
        K.parse_container(data)


def test_footer_checksum_is_checked_before_file_length():
    """Spec section 7's order: a footer whose File_Length is short and whose checksum is wrong is a checksum
    mismatch in both decoders."""
    data = bytearray(C.vector("fp16_tiny") + b"\x00" * 40)
    data[-32:] = C.vector("fp16_tiny")[-32:]
    struct.pack_into("<Q", data, len(data) - 16, 1)  # Footer_Checksum
    check_rejects(kvcodec.ChecksumMismatch, bytes(data))
    with pytest.raises(K.ChecksumMismatch):
        K.parse_container(bytes(data))


def test_stream_words_left_unread_are_valid():
    """Spec section 11.2.2 (revision 1.11.1: MUST NOT reject): words after a token stream's last read word change
    nothing; the tokens, the residuals and the tensors are the vector's."""
    from kvcodec.container.reader import KvzReader
    from kvcodec.tokens.rangecoder import unpack_stream
    from kvcodec.tokens.static import StaticTokenCoder

    case = "exact_static_prefill"
    meta = json.loads((VECTORS / f"{case}.json").read_text())
    data = C.vector(case)
    i = C.find(data, C.TOKEN_STREAM, 0, 0, 0)
    longer = C.with_payload(data, i, C.payload(data, i) + struct.pack("<3I", 0xDEADBEEF, 7, 0xFFFFFFFF))
    assert len(longer) == len(data) + 12
    streams = []
    for f in (data, longer):
        with KvzReader(f) as r:
            t = r.header.tier_info
            e = r.entry(C.TOKEN_STREAM, 0, 0, 0)
            streams.append(unpack_stream(r.read_payload(e), expect_tokens=r.header.num_tokens - t.padding[0],
                                         chunk=t.checksum_tokens, offset=e.payload_offset))
    assert len(streams[1].words) == len(streams[0].words) + 3
    assert StaticTokenCoder(t.vocab, t.checksum_tokens).decode(streams[1]).tolist() == meta["tokens"][0]
    info, tokens, ks, vs, _ = _independent(longer, case)
    assert tokens[0] == meta["tokens"][0]
    assert _hashes(ks, vs, info["W"]) == (meta["keys_sha256"], meta["values_sha256"])


def test_repeat_is_valid_from_1_1():
    """Spec section 3: the file of repeat-in-1.0.bin stamped 1.1 is valid and decodes to bf16_basic's tensors."""
    meta = json.loads((VECTORS / "bf16_basic.json").read_text())
    data = C.repeat_in(1)
    kv = kvcodec.decode(data, output="kvcache")
    assert ([_sha(t) for t in kv.keys], [_sha(t) for t in kv.values]) == (meta["keys_sha256"], meta["values_sha256"])
    info, _, ks, vs, _ = _independent(data)
    assert _hashes(ks, vs, info["W"]) == (meta["keys_sha256"], meta["values_sha256"])


def test_a_non_critical_section_of_type_0_is_skipped():
    """Spec section 5 (revision 1.11.1): the reserved type 0 is a type the decoder does not know; not critical,
    it is skipped (section-type0-critical.bin: critical, refused)."""
    meta = json.loads((VECTORS / "fp16_tiny.json").read_text())
    data = C.section_type0(0)
    assert [s["type"] for s in C.sections(data)] == [1, 1, 0]
    kv = kvcodec.decode(data, output="kvcache")
    assert [_sha(t) for t in kv.keys] == meta["keys_sha256"]
    info, _, ks, vs, _ = _independent(data)
    assert _hashes(ks, vs, info["W"]) == (meta["keys_sha256"], meta["values_sha256"])


def test_a_sliding_window_layer_may_hold_more_tokens_than_its_window():
    """Spec section 4 (revision 1.11.1): seq_len > sliding_window is valid and decodes as stored."""
    meta = json.loads((VECTORS / "bf16_sliding_window.json").read_text())

    def edit(h):
        lay = h["cache"]["layers"][1]
        assert lay["sliding_window"] is not None and lay["seq_len"] == 5
        lay["sliding_window"] = 2
    data = C.edited("bf16_sliding_window", edit)
    kv = kvcodec.decode(data, output="kvcache")
    assert [_sha(t) for t in kv.values] == meta["values_sha256"] and kv.sliding_window[1] == 2
    info, _, ks, vs, _ = _independent(data)
    assert _hashes(ks, vs, info["W"]) == (meta["keys_sha256"], meta["values_sha256"])


def test_numerics_profile_types_that_are_valid():
    """Spec section 11.4 (revision 1.11.1): any key whose value is a string or an integer, env an object of
    strings, step_threads 1 .. 1024 (numerics-*.bin: the other types, refused)."""
    for kw in ({"x-engine-build": "b1234"}, {"foo": 3}, {"env": {"MKL_CBWR": "AUTO"}}, {"step_threads": 1024}):
        data = C.numerics_with(**kw)
        assert kvcodec.inspect(data)["tier"] == "exact"
        K.parse_container(data)
    e = check_rejects(kvcodec.FormatError, C.numerics_with(step_threads=1025), fn=kvcodec.inspect)
    assert e.field == "Header.tokens.procedure.numerics.step_threads"
    with pytest.raises(K.FormatError):
        K.parse_container(C.numerics_with(step_threads=1025))


def test_a_sink_log_weight_of_negative_zero_is_zero():
    """Spec section 14.2 (revision 1.11.1): the raw tokens' beta is tested as a value, so -0.0 is 0: valid, and
    returned as stored (sink-beta-subnormal.bin: the smallest subnormal, refused)."""
    data, (b, h, j) = C.sink_beta(0x80000000)
    kv = kvcodec.decode(data, output="kvcache")
    beta = kv.states[0].tensors()[0][2]
    assert int(beta.numpy().view(np.uint32)[b, h, j]) == 0x80000000
    info, _, _, _, _ = _independent(data)
    assert int(np.asarray(info["states"][0][0]).view(np.uint32)[b, h, j]) == 0x80000000


def test_method_1_bound_is_binary64_and_a_step_below_it_decodes():
    """Spec section 13 (revision 1.11.1): Method 1's bound test is one binary64 product.  step-bound-binary64.bin
    lies below the bound in exact arithmetic and at it in binary64 (refused); the next smaller step decodes, to
    the same bits in both decoders."""
    m, M = C.BOUND_m, C.BOUND_M
    assert M * m == 2 ** 54 - 1 and M * m * 2 ** 57 < 2 ** 111 <= float(M) * (m * 2.0 ** 57)
    data = C.step_bound(m - 1)
    kv = kvcodec.decode(data, output="kvcache")
    info, _, ks, vs, _ = _independent(data)
    assert ([_sha(t) for t in kv.keys], [_sha(t) for t in kv.values]) == _hashes(ks, vs, info["W"])
    assert all(bool(t.float().isfinite().all()) for t in kv.keys)


def test_predicted_overflow_is_found_in_the_layer_where_it_happens():
    """Spec section 13.1 (revision 1.11.1): the issue's file overflows in layer 1's values only; layer 0 decodes
    (a reader of layer 0 computes nothing beyond it), the whole file does not."""
    data, pred = C.predict_values_overflow()
    with kvcodec.open_kvz(data, predictors=pred) as f:
        _, v0 = f.layer(0)
        assert bool(v0.isfinite().all()) and float(v0.abs().max()) > 1e38  # finite, near binary32's largest
        with pytest.raises(kvcodec.FormatError, match="layer 1"):
            f.layer(1)


def test_chunk_tokens_above_its_range_and_another_procedure_id():
    """Spec revision 1.12.0 (what revision 1.11.1 left open): cache.chunk_tokens and tokens.chunk_tokens above 2^24
    are LimitExceeded, a tokens.procedure.id that is not its token model's is UnknownId - the reference decoder
    and the independent one alike."""
    from fuzz import header_of, with_header

    cases = []
    base = (ROOT / "spec" / "vectors" / "exact_static_prefill.kvz").read_bytes()
    h = header_of(base)
    h["cache"]["chunk_tokens"] = (1 << 24) + 1
    cases.append((with_header(base, h), kvcodec.LimitExceeded, "LimitExceeded"))
    h = header_of(base)
    h["tokens"]["chunk_tokens"] = (1 << 24) + 1
    cases.append((with_header(base, h), kvcodec.LimitExceeded, "LimitExceeded"))
    h = header_of(base)
    h["tokens"]["procedure"]["id"] = "lm-schedule-v1"  # the lm model's, in a static file
    cases.append((with_header(base, h), kvcodec.UnknownId, "UnknownId"))
    for data, cls, name in cases:
        with pytest.raises(cls):
            kvcodec.inspect(data)
        with pytest.raises(Exception) as err:
            K.decode_file(data)
        assert type(err.value).__name__ == name
