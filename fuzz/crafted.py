#!/usr/bin/env python
"""Write the hand-made hostile files into ``tests/data/malformed/`` (rerun after a format change).

Each file is a golden vector with one field made hostile and every checksum resealed, so it reaches the
check it is about; ``tests/test_malformed.py`` decodes each one and expects a ``KvzError`` (and, for the files of
``EXPECTED``, exactly that class and field, from the reference decoder and the independent one alike).

Issue 10: the JSON header, huge schedules, trailing data.  Issue 51 (spec revision 1.11.1): non-finite
``vq_rans`` side values, predicted slices that overflow (their predictors beside them, ``<name>.predictors``),
the index section's header, unknown section types, ``repeat``, ``tokens.positions``, numerics profiles, a
sink's log-weight, ``Sign_Rule`` and the version, zstd frames in ``Side``, Method 1's bound in binary64.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "fuzz"))
sys.path.insert(0, str(ROOT))

from fuzz import header_of, reseal, with_header

OUT = ROOT / "tests" / "data" / "malformed"
SEC = struct.Struct("<HHIHHIQQQ")  # a section header (spec section 5)
INDEX_ENTRY = struct.Struct("<QHHIIIQ")  # an index entry (spec section 6)


def vector(case: str) -> bytes:
    return (ROOT / "spec" / "vectors" / f"{case}.kvz").read_bytes()


def raw_info(case: str, raw: str) -> bytes:
    """``case`` with ``info`` replaced by the JSON text ``raw``."""
    data = vector(case)
    h = header_of(data)
    h["info"] = "@@"
    text = json.dumps(h, sort_keys=True, separators=(",", ":"), ensure_ascii=False).replace('"@@"', raw)
    return with_header(data, None, raw=text.encode())


def huge_schedule() -> bytes:
    data = vector("exact_lm_steps")
    h = header_of(data)
    n = 10**8
    h["cache"]["num_tokens"] = n
    for lay in h["cache"]["layers"]:
        lay.update(seq_len=4, sliding_window=4, cumulative_length=n)
    h["tokens"]["schedule"] = [[1, n]]
    return with_header(data, h)


# --- file surgery: sections -------------------------------------------------------------------------------
def sections(data: bytes) -> list[dict]:
    """Every section before the index, in file order: its offset and header fields (from the index)."""
    io_ = struct.unpack_from("<Q", data, len(data) - 32)[0]
    count = struct.unpack_from("<I", data, io_ + 40)[0]
    out = []
    for i in range(count):
        off, typ, part, layer, chunk, _, n = INDEX_ENTRY.unpack_from(data, io_ + 48 + 32 * i)
        out.append({"offset": off, "type": typ, "part": part, "layer": layer, "chunk": chunk, "length": n,
                    "flags": struct.unpack_from("<H", data, off + 2)[0]})
    return out


def find(data: bytes, typ: int, layer: int = 0, part: int = 0, chunk: int = 0) -> int:
    """The position (in file order) of the section ``(typ, layer, part, chunk)``."""
    for i, s in enumerate(sections(data)):
        if (s["type"], s["layer"], s["part"], s["chunk"]) == (typ, layer, part, chunk):
            return i
    raise KeyError((typ, layer, part, chunk))


def payload(data: bytes, i: int) -> bytes:
    s = sections(data)[i]
    return data[s["offset"] + 40:s["offset"] + 40 + s["length"]]


def rebuild(data: bytes, secs: list[tuple[int, int, int, int, int, bytes]]) -> bytes:
    """``data``'s preamble and header with the sections ``(type, flags, layer, part, chunk, payload)`` in this
    order, then a new index and footer: every offset, length and checksum computed."""
    from kvcodec.container import layout as L

    hlen = struct.unpack_from("<I", data, 12)[0]
    head = data[:16 + hlen + 8]
    hsum = struct.unpack_from("<Q", data, 16 + hlen)[0]
    body, entries, pos = [], [], len(head)
    for typ, flags, layer, part, chunk, pl in secs:
        h32 = struct.pack("<HHIHHIQQ", typ, flags, layer, part, 0, chunk, len(pl), L.xxh3(pl))
        body.append(h32 + struct.pack("<Q", L.xxh3(h32)) + pl)
        entries.append(INDEX_ENTRY.pack(pos, typ, part, layer, chunk, 0, len(pl)))
        pos += 40 + len(pl)
    ipl = struct.pack("<II", len(entries), 0) + b"".join(entries)
    h32 = struct.pack("<HHIHHIQQ", 0xFFFF, 1, 0, 0, 0, 0, len(ipl), L.xxh3(ipl))
    index = h32 + struct.pack("<Q", L.xxh3(h32)) + ipl
    end = pos + len(index) + 32
    foot = struct.pack("<QQ", pos, end)
    foot += struct.pack("<Q", L.footer_checksum(pos, end, hsum)) + L.END_MAGIC
    return head + b"".join(body) + index + foot


def _as_list(data: bytes) -> list[list]:
    return [[s["type"], s["flags"], s["layer"], s["part"], s["chunk"], payload(data, i)]
            for i, s in enumerate(sections(data))]


def with_payload(data: bytes, i: int, new: bytes) -> bytes:
    """``data`` with the payload of its ``i``-th section replaced (the file rebuilt around it)."""
    secs = _as_list(data)
    secs[i][5] = new
    return rebuild(data, [tuple(s) for s in secs])


def with_section(data: bytes, i: int, typ: int, flags: int, pl: bytes) -> bytes:
    """``data`` with a section of type ``typ`` (``Layer``, ``Part``, ``Chunk`` 0) inserted before its ``i``-th."""
    secs = _as_list(data)
    secs.insert(i, [typ, flags, 0, 0, 0, pl])
    return rebuild(data, [tuple(s) for s in secs])


def patched(data: bytes, at: int, fmt: str, *values) -> bytes:
    """``data`` with ``values`` packed at byte ``at``, every checksum resealed."""
    b = bytearray(data)
    struct.pack_into(fmt, b, at, *values)
    return reseal(bytes(b))


def with_minor(data: bytes, minor: int) -> bytes:
    return patched(data, 10, "<H", minor)


def edited(case: str, edit) -> bytes:
    data = vector(case)
    h = header_of(data)
    edit(h)
    return with_header(data, h)


# --- issue 51 (spec revision 1.11.1) -----------------------------------------------------------------------
KV, STATE, TOKEN_STREAM, INDEX = 1, 6, 3, 0xFFFF
VQ_FIXED = struct.Struct("<BBBBIQfIi")  # Mode, Method, Symbol_Bits, Sign_Rule, Exact_Tokens, Seed, Step, Norms_Length, Index_Offset


def _float16_payload(values: np.ndarray, shape) -> bytes:
    """A float_ctx_rans payload of ``values`` (float16) in ``shape``."""
    from kvcodec.codecs import float_ctx_rans as floatctx

    return floatctx.encode(np.asarray(values, np.float16).view(np.uint16).reshape(shape), "float16", {})


def _float16_of(pl, shape) -> np.ndarray:
    from kvcodec.codecs import float_ctx_rans as floatctx

    return floatctx.decode(pl, shape, "float16").view(np.float16).reshape(-1).copy()


def _vq_fields(data: bytes, i: int):
    """(payload, fixed fields, position after the fixed fields and a Mode 2 head, and the slice's shape)."""
    h = header_of(data)
    s = sections(data)[i]
    lay = h["cache"]["layers"][s["layer"]]  # the vectors used here have no repeat
    c = h["cache"]["chunk_tokens"]
    t = min(lay["seq_len"], (s["chunk"] + 1) * c) - s["chunk"] * c
    shape = (h["cache"]["batch"], lay["kv_heads"], t, lay["k_dim"] if s["part"] == 0 else lay["v_dim"])
    pl = payload(data, i)
    f = VQ_FIXED.unpack_from(pl, 0)
    p = VQ_FIXED.size
    if f[0] == 2:
        h0, hlen = struct.unpack_from("<II", pl, p)
        p += 8 + hlen
        shape = (shape[0], shape[1], shape[2] - h0, shape[3])
    return pl, f, p, shape


def kivi_side_inf() -> bytes:
    """lossy_kivi: a group's minimum +inf and its scale -inf (the issue's file): decoded, NaN whose bits are the
    CPU's.  Spec section 13, Method 3: every side value finite [FormatError, VQ.KIVI.Side]."""
    data = vector("lossy_kivi")
    i = find(data, KV, 0, 0, 0)
    pl, f, p, (b, h, t, d) = _vq_fields(data, i)
    assert f[1] == 3 and f[4] == 0, f  # Method 3, no exact tail
    axis, _, group, side_len = struct.unpack_from("<BBHI", pl, p)
    n = t if axis == 0 else d
    ng = b * h * (d if axis == 0 else t) * -(-n // group)
    side = _float16_of(pl[p + 8:p + 8 + side_len], (1, 2, ng, 1))
    side[0], side[ng] = np.inf, -np.inf
    new = _float16_payload(side, (1, 2, ng, 1))
    return with_payload(data, i, pl[:p + 4] + struct.pack("<I", len(new)) + new + pl[p + 8 + side_len:])


def cachegen_side_inf() -> bytes:
    """lossy_cachegen: a token's scale +inf.  Spec section 13, Method 4 [FormatError, VQ.CacheGen.Side]."""
    data = vector("lossy_cachegen")
    i = find(data, KV, 0, 0, 0)
    pl, f, p, (b, _, t, _) = _vq_fields(data, i)
    assert f[1] == 4, f
    t -= f[4]  # the quantized tokens: the exact tail is stored apart
    side_len = struct.unpack_from("<I", pl, p + 4)[0]
    side = _float16_of(pl[p + 8:p + 8 + side_len], (b, 1, t, 1))
    side[0] = np.inf
    new = _float16_payload(side, (b, 1, t, 1))
    return with_payload(data, i, pl[:p + 4] + struct.pack("<I", len(new)) + new + pl[p + 8 + side_len:])


def _predictors():
    from kvcodec import predict as P

    return P.from_bytes((ROOT / "spec" / "vectors" / "lossy_predicted.predictors.safetensors").read_bytes())


def _with_predictors(data: bytes, pred) -> tuple[bytes, bytes]:
    """``data`` naming the predictors ``pred`` (their SHA-256 in the header) and those predictors' bytes."""
    from kvcodec import predict as P

    pb = P.to_bytes(pred)
    h = header_of(data)
    h["predict"]["predictors"] = P.identity(pb)
    return with_header(data, h), pb


def predict_scale_overflow() -> tuple[bytes, bytes]:
    """lossy_predicted with predictors whose scale is 3e38 (finite in binary32): the rotated keys overflow
    (spec section 13.1, finiteness [FormatError, predict])."""
    from kvcodec import predict as P

    p = _predictors()
    return _with_predictors(vector("lossy_predicted"), P.Predictors(p.keys, p.values, p.cos_theta, p.sin_theta,
                                                                     3e38, p.meta))


def predict_recurrence_overflow() -> tuple[bytes, bytes]:
    """lossy_predicted with finite rope tables of 1e200: the binary64 recurrence overflows to inf - inf = NaN."""
    from kvcodec import predict as P

    p = _predictors()
    big = np.full_like(p.cos_theta, 1e200)
    return _with_predictors(vector("lossy_predicted"), P.Predictors(p.keys, p.values, big, big, p.scale, p.meta))


def predict_values_overflow() -> tuple[bytes, bytes]:
    """The issue's file: layer 0's values (chunk 0, Method 1) with a Step inside section 13's bound, every
    Index_Offset-shifted index of one sign and norms of 65504, so each head's channel 0 is about 1.7e38 (finite);
    layer 1's value predictor weighs head 0's channel 0 by +65504 and head 1's by -65504: +inf + -inf = NaN."""
    from kvcodec import predict as P

    data = vector("lossy_predicted")
    i = find(data, KV, 0, 1, 0)
    pl, f, p, (b, h, t, d) = _vq_fields(data, i)
    mode, method, k, rule, exact, seed, _, norms_len, _ = f
    assert method == 1 and exact == 0 and d <= 65536, f
    o = 1 << 20
    step = np.float32(2.0 ** 111 / (o + (1 << k) - 1))
    while float(o + (1 << k) - 1) * float(step) >= 2.0 ** 111:
        step = np.nextafter(step, np.float32(0))
    norms = _float16_payload(np.full(b * h * t, 65504.0), (b, h, t, 1))
    fixed = VQ_FIXED.pack(mode, method, k, rule, exact, seed, float(step), len(norms), o)
    new = fixed + pl[VQ_FIXED.size:p] + norms + pl[p + norms_len:]
    pred = _predictors()
    hd = h * d
    w, bias = pred.values[1]
    w = np.array(w, dtype=np.float16)
    w[hd + 0, :] = 65504.0  # the rows of the previous layer's values, head 0 channel 0 ...
    w[hd + d, :] = -65504.0  # ... and head 1 channel 0
    values = list(pred.values)
    values[1] = (w, bias)
    return _with_predictors(with_payload(data, i, new), P.Predictors(pred.keys, values, pred.cos_theta,
                                                                      pred.sin_theta, pred.scale, pred.meta))


def _index_at(data: bytes) -> int:
    return struct.unpack_from("<Q", data, len(data) - 32)[0]


def index_flags(flags: int) -> bytes:
    data = vector("fp16_tiny")
    return patched(data, _index_at(data) + 2, "<H", flags)


def index_field(at: int, fmt: str, value: int) -> bytes:
    data = vector("fp16_tiny")
    return patched(data, _index_at(data) + at, fmt, value)


def index_entry_reserved() -> bytes:
    data = vector("fp16_tiny")
    return patched(data, _index_at(data) + 40 + 8 + 20, "<I", 1)


def section_type0(flags: int) -> bytes:
    """fp16_tiny with a section of the reserved type 0 before the index (spec section 5: a type the decoder
    does not know; skipped when not critical)."""
    data = vector("fp16_tiny")
    return with_section(data, len(sections(data)), 0, flags, b"not a known section")


def repeat_in(minor: int) -> bytes:
    """bf16_basic's two identical layers written once with ``repeat`` 2, stamped 1.``minor``."""
    data = vector("bf16_basic")
    h = header_of(data)
    a, b = h["cache"]["layers"]
    assert a == b
    h["cache"]["layers"] = [dict(a, repeat=2)]
    return with_minor(with_header(data, h), minor)


def repeat_value(n) -> bytes:
    def edit(h):
        h["cache"]["layers"][0]["repeat"] = n
    return edited("exact_static_prefill", edit)


def tokens_key(key: str, value) -> bytes:
    def edit(h):
        h["tokens"][key] = value
    return edited("exact_static_prefill", edit)


def numerics(profile) -> bytes:
    def edit(h):
        h["tokens"]["procedure"]["numerics"] = profile
    return edited("exact_static_prefill", edit)


def numerics_with(**kv) -> bytes:
    def edit(h):
        h["tokens"]["procedure"]["numerics"].update(kv)
    return edited("exact_static_prefill", edit)


def sink_beta(bits: int) -> tuple[bytes, tuple[int, int, int]]:
    """lossless_selected with the log-weight of layer 0's first sink (batch row 0, head 0) set to the binary32
    ``bits`` (the state section rewritten raw), and that entry's (row, head, index)."""
    data = vector("lossless_selected")
    h = header_of(data)
    st = h["cache"]["layers"][0]["state"]
    assert st["tensors"][0]["name"] == "log_weights"
    i = find(data, STATE, 0, 0, 0)
    pl = payload(data, i)
    shape = st["tensors"][0]["shape"]
    n = int(np.prod(shape)) * 4
    if pl[0] == 0:
        raw = bytearray(pl[8:])
    else:
        import zstandard

        raw = bytearray(zstandard.ZstdDecompressor().decompress(pl[8:]))
    assert len(raw) == n
    j = st["parts"]["fixed"]  # the first sink
    struct.pack_into("<I", raw, 4 * j, bits)  # [0, 0, j] in C order
    return with_payload(data, i, bytes(8) + bytes(raw)), (0, 0, j)


def sign_rule(rule: int, minor: int | None = None) -> bytes:
    data = vector("lossy_uniform_window")
    if minor is not None:
        data = with_minor(data, minor)
    i = find(data, KV, 0, 0, 1)
    return patched(data, sections(data)[i]["offset"] + 40 + 3, "<B", rule)


def _side_frame(data: bytes, i: int):
    """bf16_basic's payload ``i`` (float_ctx_rans Mode 1): (payload, Side_Length)."""
    pl = payload(data, i)
    assert pl[0] == 1
    return pl, struct.unpack_from("<I", pl, 8)[0]


def side_with(kind: str) -> bytes:
    """bf16_basic's first payload with its ``Side`` frame made hostile: ``dict`` (a Dictionary_ID of 7 added to
    its frame header), ``skip-before`` / ``skip-after`` (a skippable frame beside it).  Spec section 8.2."""
    data = vector("bf16_basic")
    i = find(data, KV, 0, 0, 0)
    pl, n = _side_frame(data, i)
    frame = pl[20:20 + n]
    skippable = struct.pack("<II", 0x184D2A50, 3) + b"kvz"
    if kind == "dict":
        fhd = frame[4]
        assert fhd & 3 == 0  # no Dictionary_ID field yet
        at = 5 if fhd & 0x20 else 6  # after the descriptor (and the window descriptor, if any)
        frame = frame[:4] + bytes([fhd | 1]) + frame[5:at] + bytes([7]) + frame[at:]
    elif kind == "skip-before":
        frame = skippable + frame
    elif kind == "skip-after":
        frame = frame + skippable
    else:
        raise ValueError(kind)
    new = pl[:8] + struct.pack("<I", len(frame)) + pl[12:20] + frame + pl[20 + n:]
    return with_payload(data, i, new)


#: spec section 13 (revision 1.11.1): Method 1's bound test in binary64.  max(|o|, |o + 2^k - 1|) = M and
#: Step = m * 2^57 with M * m = 2^54 - 1: the exact product lies below 2^111, its binary64 rounding is 2^111
BOUND_M, BOUND_m = 1203250167, 14971449


def step_bound(m: int = BOUND_m) -> bytes:
    data = vector("lossy_uniform_window")
    i = find(data, KV, 0, 0, 1)
    _, f, _, shape = _vq_fields(data, i)
    assert f[0] == 1 and f[1] == 1 and shape[3] <= 65536 and (1 << f[2]) - 1 < BOUND_M, f
    at = sections(data)[i]["offset"] + 40
    step = np.float32(m * 2.0 ** 57)
    assert float(step) == m * 2.0 ** 57
    return patched(patched(data, at + 16, "<f", float(step)), at + 24, "<i", -BOUND_M)


#: name -> (builder, error class, field the reference decoder names): every file here is rejected so by both
#: decoders (tests/test_malformed.py).  Predicted files come with their predictors (``<name>.predictors``).
EXPECTED = {
    "vq-kivi-side-inf.bin": (kivi_side_inf, "FormatError", "VQ.KIVI.Side"),
    "vq-cachegen-side-inf.bin": (cachegen_side_inf, "FormatError", "VQ.CacheGen.Side"),
    "predict-scale-overflow.bin": (predict_scale_overflow, "FormatError", "predict"),
    "predict-recurrence-overflow.bin": (predict_recurrence_overflow, "FormatError", "predict"),
    "predict-values-nan.bin": (predict_values_overflow, "FormatError", "predict"),
    "index-flags-0.bin": (lambda: index_flags(0), "FormatError", "Section_Flags"),
    "index-flags-3.bin": (lambda: index_flags(3), "ReservedBitSet", "Section_Flags"),
    "index-layer-1.bin": (lambda: index_field(4, "<I", 1), "FormatError", "Layer"),
    "index-part-1.bin": (lambda: index_field(8, "<H", 1), "FormatError", "Part"),
    "index-chunk-1.bin": (lambda: index_field(12, "<I", 1), "FormatError", "Chunk"),
    "index-reserved.bin": (lambda: index_field(10, "<H", 1), "ReservedBitSet", "Section.Reserved"),
    "index-entry-reserved.bin": (index_entry_reserved, "ReservedBitSet", "Index.Reserved"),
    "section-type0-critical.bin": (lambda: section_type0(1), "UnknownId", "Section_Type"),
    "repeat-in-1.0.bin": (lambda: repeat_in(0), "FormatError", "Version_Minor"),
    "repeat-70000.bin": (lambda: repeat_value(70000), "LimitExceeded", "Header.cache.layers[0].repeat"),
    "repeat-1.bin": (lambda: repeat_value(1), "FormatError", "Header.cache.layers[0].repeat"),
    "positions-unknown.bin": (lambda: tokens_key("positions", "rope"), "UnknownId", "Header.tokens.positions"),
    "positions-not-string.bin": (lambda: tokens_key("positions", 1), "FormatError", "Header.tokens.positions"),
    "numerics-not-object.bin": (lambda: numerics("cpu"), "FormatError", "Header.tokens.procedure.numerics"),
    "numerics-threads-bool.bin": (lambda: numerics_with(threads=True), "FormatError",
                                  "Header.tokens.procedure.numerics.threads"),
    "numerics-env-int.bin": (lambda: numerics_with(env={"MKL_CBWR": 1}), "FormatError",
                             "Header.tokens.procedure.numerics.env"),
    "numerics-step-threads-0.bin": (lambda: numerics_with(step_threads=0), "FormatError",
                                    "Header.tokens.procedure.numerics.step_threads"),
    "numerics-null.bin": (lambda: numerics_with(cuda=None), "FormatError", "Header.tokens.procedure.numerics.cuda"),
    "sink-beta-subnormal.bin": (lambda: sink_beta(1)[0], "FormatError", "State.Data"),
    "sign-rule-0-in-1.2.bin": (lambda: sign_rule(0), "FormatError", "VQ.Sign_Rule"),
    "sign-rule-1-in-1.1.bin": (lambda: sign_rule(1, minor=1), "FormatError", "VQ.Sign_Rule"),
    "side-dictionary.bin": (lambda: side_with("dict"), "FormatError", "Side"),
    "side-skippable-before.bin": (lambda: side_with("skip-before"), "FormatError", "Side"),
    "side-skippable-after.bin": (lambda: side_with("skip-after"), "FormatError", "Side"),
    "step-bound-binary64.bin": (step_bound, "FormatError", "VQ.Step"),
}


def files() -> dict[str, bytes]:
    out = {
        "header-bigint.bin": raw_info("bf16_basic", '{"n":%s}' % ("7" * 4400)),
        "header-deep.bin": raw_info("bf16_basic", "[" * 985 + "]" * 985),
        "header-inf.bin": raw_info("bf16_basic", "1e400"),
        "header-surrogate.bin": raw_info("bf16_basic", '"\\udc00"'),
        "schedule-huge.bin": huge_schedule(),
        "trailing-data.bin": vector("fp16_tiny") + b"\x00" * 17,
    }
    for name, (build, _, _) in EXPECTED.items():
        got = build()
        if isinstance(got, tuple):  # a predicted file and its predictors
            out[name], out[name[:-4] + ".predictors"] = got
        else:
            out[name] = got
    return out


if __name__ == "__main__":
    # the files of EXPECTED are rewritten (tests/test_malformed.py checks that they are what their builders make);
    # the issue-10 files were made from the vectors of their day and are kept as they are unless missing
    OUT.mkdir(parents=True, exist_ok=True)
    keep = {n for n in files() if n.replace(".predictors", ".bin") not in EXPECTED}
    for name, data in files().items():
        if name in keep and (OUT / name).exists():
            continue
        (OUT / name).write_bytes(data)
        print(f"{name}: {len(data)} bytes")
