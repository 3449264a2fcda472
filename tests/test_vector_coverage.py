"""The golden vectors cover every branch of the spec: a decoder that gets any one of them wrong fails a vector.

Each vector's sections are walked here with the spec's field layouts (not the decoder), and the branches they
take are collected; ``REQUIRED`` lists the branches of spec sections 8, 11, 12 and 13.  A branch without a
vector fails the test, naming it: add a case to ``scripts/make_vectors.py``.
"""

import json
import struct
from pathlib import Path

import numpy as np
import zstandard

from kvcodec.container import layout as L
from kvcodec.container.reader import KvzReader

VECTORS = Path(__file__).resolve().parent.parent / "spec" / "vectors"
FLOAT_FIXED = struct.Struct("<BBBBBBHIII")  # spec 8.1
VQ_FIXED = struct.Struct("<BBBBIQfI")  # spec 13

REQUIRED = {
    # section 8: every dtype in both modes, both class counts, one and several tables, a class rule that
    # matters (a row whose tables differ between the lower / equal / higher classes), full and partial lane
    # groups, the unrolled lane counts and others, Coded_Bits = 6 and the dtype defaults
    *[("float", dt, mode) for dt in ("float32", "float16", "bfloat16") for mode in (0, 1)],
    ("classes", 1), ("classes", 6), ("tables", "one"), ("tables", "several"), ("class_rule", "matters"),
    ("groups", "partial"), ("groups", "full"), ("ways", 4), ("ways", 8), ("ways", "other"),
    ("coded_bits", 6), ("coded_bits", "default"),
    # sections 3, 11, 12: every tier, token model, residual mode, padding
    *[("tier", t) for t in ("lossless", "exact", "tokens", "lossy")],
    ("token_model", "lm"), ("token_model", "static"),
    ("residual", 1), ("residual", 2), ("tolerance", "number"), ("padding", "mask"), ("token_ids", "stored"),
    ("sliding_window", "yes"), ("repeat", "yes"),
    # section 13: every method, both modes, a slice with no quantized token, both KIVI axes, Sign_Rule 1
    *[("vq_method", m) for m in (1, 2, 3, 4, 5)], ("vq_mode", 1), ("vq_mode", 2), ("vq_all_exact", "yes"),
    ("vq_exact_tail", "yes"), ("kivi_axis", 0), ("kivi_axis", 1), ("sign_rule", 1), ("predict", "yes"),
    # sections 4.2, 5.6 (1.3): both state kinds, both codings, several slots with a tensor missing, a state
    # dtype other than the cache's, a token-tier file with a stored and a regenerated state tensor
    ("state_kind", "linear"), ("state_kind", "hybrid"), ("state_kind", "indexed"), ("state_coding", 0),
    ("state_coding", 1),
    ("state_slots", "several, one partial"), ("state_dtype", "differs"), ("state_token_tier", "stored"),
    ("state_token_tier", "regenerated"),
}


def float_payload(p: bytes, dtype: str, shape, out: set, coded_bits_default: int | None):
    """Branches of one float_ctx_rans payload (spec 8)."""
    out.add(("float", dtype, p[0]))
    if p[0] != 1:
        return
    coded_part(p, shape, out, coded_bits_default)


def coded_part(p: bytes, shape, out: set, coded_bits_default: int | None):
    _, k, _sb, ways, q, _, g, side_len, side_raw, _ = FLOAT_FIXED.unpack_from(p, 0)
    b, h, _t, d = shape
    rows = b * h * d
    out.add(("classes", q))
    out.add(("tables", "one" if g == 1 else "several"))
    out.add(("groups", "partial" if rows % ways else "full"))
    out.add(("ways", ways if ways in (4, 8) else "other"))
    if coded_bits_default is not None:
        out.add(("coded_bits", "default" if k == coded_bits_default else k))
    side = zstandard.ZstdDecompressor().decompress(p[20:20 + side_len], max_output_size=side_raw)
    cmap = np.frombuffer(side, dtype=np.uint8, count=rows * q, offset=2 * rows).reshape(rows, q)
    if q == 6 and g > 1 and ((cmap[:, 0] != cmap[:, 2]) | (cmap[:, 3] != cmap[:, 5])).any():
        out.add(("class_rule", "matters"))


DEFAULT_K = {"float32": 10, "float16": 7, "bfloat16": 10}


def branches(case: str) -> set:
    out = set()
    data = (VECTORS / f"{case}.kvz").read_bytes()
    with KvzReader(data) as r:
        h = r.header
        raw = h.raw
        out.add(("tier", h.tier))
        if h.predict is not None:  # (1.6) predicted slices, section 13.1
            out.add(("predict", "yes"))
        if h.tier == "lossless" and h.num_tokens:
            out.add(("token_ids", "stored"))
        if any(lay.sliding_window for lay in h.layers):
            out.add(("sliding_window", "yes"))
        if any("repeat" in lay for lay in raw["cache"]["layers"]):
            out.add(("repeat", "yes"))
        if "tokens" in raw:
            t = raw["tokens"]
            out.add(("token_model", t["token_model"]))
            if t["tolerance"]:
                out.add(("tolerance", "number"))
            if any(t["padding"]):
                out.add(("padding", t["positions"]))
        for li, lay in enumerate(h.layers):
            st = lay.state
            if st is None:
                continue
            out.add(("state_kind", st.kind))
            have = {(t.slot, t.name) for t in st.tensors}
            if st.slots > 1 and any(len({n for s, n in have if s == slot}) == 1 for slot in range(st.slots)):
                out.add(("state_slots", "several, one partial"))
            if any(t.dtype != h.dtype for t in st.tensors):
                out.add(("state_dtype", "differs"))
            if h.tier in ("exact", "tokens"):
                for j in range(len(st.tensors)):
                    out.add(("state_token_tier", "stored" if r.has(L.SECTION_STATE, li, j) else "regenerated"))
        for e in r.sections:
            p = r.read_payload(e)
            if e.section_type == L.SECTION_STATE:
                out.add(("state_coding", p[0]))
            if e.section_type not in (L.SECTION_KV, L.SECTION_RESIDUAL):
                continue
            lay = h.layers[e.layer]
            a, b = lay.chunk_range(e.chunk, h.chunk_tokens)
            shape = (h.batch, lay.kv_heads, b - a, lay.dim(e.part))
            if e.section_type == L.SECTION_RESIDUAL:
                out.add(("residual", p[0]))
                if p[0] == 1:
                    coded_part(p[1:], shape, out, None)
                elif p[0] == 2:
                    float_payload(p[1:], h.dtype, shape, out, DEFAULT_K[h.dtype])
            elif h.tier == "lossless":
                float_payload(p, h.dtype, shape, out, DEFAULT_K[h.dtype])
            else:
                mode, method, _k, rule, exact, _seed, _st, _nl = VQ_FIXED.unpack_from(p, 0)
                out |= {("vq_method", method), ("vq_mode", mode), ("sign_rule", rule)}
                t = shape[2]
                if mode == 2:
                    t -= struct.unpack_from("<I", p, VQ_FIXED.size + 4)[0]
                if exact == t:
                    out.add(("vq_all_exact", "yes"))
                elif exact:
                    out.add(("vq_exact_tail", "yes"))
                if method == 3 and exact < t and mode == 1:
                    out.add(("kivi_axis", p[VQ_FIXED.size + 4]))
    return out


def test_vectors_cover_every_spec_branch():
    cases = sorted(p.stem for p in VECTORS.glob("*.kvz"))
    covered = set().union(*(branches(c) for c in cases))
    missing = sorted(REQUIRED - covered, key=str)
    assert not missing, f"spec branches without a golden vector: {missing}"


def test_appendix_a_lists_every_vector():
    spec = (VECTORS.parent / "kvz.md").read_text()
    appendix = spec[spec.index("## Appendix A"):spec.index("## Appendix B")]
    for p in VECTORS.glob("*.kvz"):
        assert f"`{p.stem}`" in appendix, f"spec Appendix A does not list {p.stem}"
    for p in VECTORS.glob("*.json"):
        json.loads(p.read_text())
