"""The golden vectors cover every branch of the spec: a decoder that gets any one of them wrong fails a vector.

Each vector's sections are walked here with the spec's field layouts (not the decoder), and the branches they
take are collected; ``REQUIRED`` lists the branches of spec sections 8, 11, 12 and 13.  A branch without a
vector fails the test, naming it: add a case to ``scripts/make_vectors.py``.

Issue 51 item 2 added rules a vector only pins when its numbers make them matter (``PINNED``: each with the
vector written for it); for those the walk computes whether they matter here, e.g. whether a vocabulary's
uniform distribution quantizes differently under another summation order.  ``scripts/studies/vector_rules.py``
decodes each of those vectors with its rule broken and shows the recorded result is then not reproduced.
"""

import json
import math
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
    # (issue 51 item 2): the branches of PINNED, below, are required too
    # sections 4.2, 5.6 (1.3): both state kinds, both codings, several slots with a tensor missing, a state
    # dtype other than the cache's, a token-tier file with a stored and a regenerated state tensor
    ("state_kind", "linear"), ("state_kind", "hybrid"), ("state_kind", "indexed"), ("state_coding", 0),
    ("state_coding", 1),
    ("state_slots", "several, one partial"), ("state_dtype", "differs"), ("state_token_tier", "stored"),
    ("state_token_tier", "regenerated"),
}

#: (issue 51 item 2) rules that an implementation could break while every earlier vector still decoded: each
#: branch with the vector written to pin it (scripts/make_vectors.py; spec Appendix A).  Each is also REQUIRED,
#: and test_pinned_branches_are_covered_by_their_vector checks that the named vector takes it.
PINNED = {
    # 11.2 static-wb-o2-v1: a coded token whose order-2 context (the previous two tokens) has counts, applied
    # after the order-1 context's; and a token whose 24-bit frequencies depend on the order-0 term's rounding
    ("static_context", "order 2"): "exact_static_order2",
    ("static_order0", "rounding matters"): "exact_static_order2",
    # 11.2 / 11.2.1 at a real vocabulary: 1.0/V inexact, and its uniform distribution's frequencies differ
    # between the left-to-right running sum and an exact (or pairwise) total
    ("vocab", "1/V inexact"): "exact_blocks_v49152",
    ("sum_order", "matters"): "exact_blocks_v49152",
    ("token_model", "blocks"): "exact_blocks_padded",
    # 11.2 lm-incremental-v1
    ("token_model", "draft"): "exact_draft_padded",
    # 13.1 step 3: positions whose binary32 cos / sin by the recurrence differ from a direct binary64 cos(p theta)
    ("rope_recurrence", "differs from direct"): "lossy_predicted_far",
    # 13 Method 3 in float16 / bfloat16: a value whose binary32 result rounded to dtype differs from the exact
    # min + q * scale rounded to dtype once (a fused multiply-add cannot differ: q * scale is exact in binary32)
    ("kivi_rounding", "binary32 then dtype"): "lossy_kivi_rounding",
    # 5.4 / 12: tier tokens whose tolerance zeroed residuals (the reconstruction is not the input); a Mode 0 residual
    ("tolerance", "zeroes residuals"): "tokens_tolerance_zeroed",
    ("residual", 0): "tokens_tolerance_zeroed",
    # 13 field 4: Sign_Rule 0 (a file stamped 1.1)
    ("sign_rule", 0): "lossy_sign_rule0",
    # 13 Mode 2 with every method
    ("vq_mode2_method", 1): "lossy_uniform_window",
    ("vq_mode2_method", 2): "lossy_lloyd_head",
    ("vq_mode2_method", 3): "lossy_kivi_rounding",
    ("vq_mode2_method", 4): "lossy_cachegen_odd",
    ("vq_mode2_method", 5): "lossy_weighted",
    # 13 Method 4 with odd Bins (half = (Bins - 1) / 2)
    ("cachegen_bins", "odd"): "lossy_cachegen_odd",
    # 5 Slices (1.8): a per-head slice ([1, 1, T, D]) in float_ctx_rans Mode 1, and in Mode 0
    ("heads_float", 1): "lossless_heads_coded",
    ("heads_float", 0): "lossless_heads",
}
REQUIRED |= set(PINNED)


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


# --- (issue 51 item 2) whether a rule's numbers matter in a vector -------------------------------------------
def cumulative(p: np.ndarray, total: float | None = None) -> np.ndarray:
    """Spec 11.2.1's C[0..V-1] of the float64 vector ``p``: the left-to-right running sum (NumPy's cumsum adds in
    order), Scale = (2^24 - V) / Total; ``total``: another Total, to see whether the sum order matters."""
    run = np.concatenate([[0.0], np.cumsum(p)])
    scale = float((1 << 24) - p.size) / (run[-1] if total is None else total)
    return np.trunc(run[:-1] * scale).astype(np.int64) + np.arange(p.size)


def static_q(seq, V: int, order0: str = "spec"):
    """Spec 11.2 static-wb-o2-v1: the q vector of each token of ``seq`` (order 0, then the order-1 and order-2
    contexts); ``order0`` "split": the order-0 term as (1/V) * (d0 / (n0 + d0)) + c0 / (n0 + d0) instead."""
    c0 = np.zeros(V)
    d0 = 0
    c1, c2, out = {}, {}, []
    for i, tok in enumerate(seq):
        n0 = i  # tokens counted so far
        if n0 == 0:
            p = np.full(V, 1.0 / V)
        elif order0 == "spec":
            p = (c0 + d0 / V) / (n0 + d0)
        else:
            p = np.full(V, (1.0 / V) * (d0 / (n0 + d0)))
            p[c0 > 0] = p[c0 > 0] + c0[c0 > 0] / (n0 + d0)
        for ctx in (c1.get(seq[i - 1]) if i else None, c2.get((seq[i - 2], seq[i - 1])) if i > 1 else None):
            if ctx:
                n, d = sum(ctx.values()), len(ctx)
                p = p * (d / (n + d))
                for t, c in ctx.items():
                    p[t] = p[t] + c / (n + d)
        out.append(np.floor(p * 2.0 ** 40) + 1.0)
        d0 += c0[tok] == 0
        c0[tok] += 1
        if i:
            c1.setdefault(seq[i - 1], {})[tok] = c1.get(seq[i - 1], {}).get(tok, 0) + 1
        if i > 1:
            c2.setdefault((seq[i - 2], seq[i - 1]), {})[tok] = c2.get((seq[i - 2], seq[i - 1]), {}).get(tok, 0) + 1
    return out


def static_branches(seq, V: int, out: set):
    if any(seq[j:j + 2] == seq[i - 2:i] for i in range(2, len(seq)) for j in range(i - 2)):
        out.add(("static_context", "order 2"))
    for tok, a, b in zip(seq, static_q(seq, V), static_q(seq, V, "split")):
        if (a != b).any():
            ca, cb = (np.append(cumulative(x), 1 << 24) for x in (a, b))
            if ca[tok] != cb[tok] or ca[tok + 1] != cb[tok + 1]:  # the coded token's interval moves
                out.add(("static_order0", "rounding matters"))


def uniform_branches(V: int, out: set):
    """1.0/V exact only for a power of two V; the uniform distribution's frequencies with the running sum's Total
    against the exact sum's (math.fsum) and numpy's pairwise sum."""
    if V & (V - 1):
        out.add(("vocab", "1/V inexact"))
    p = np.full(V, 1.0 / V)
    c = cumulative(p)
    if any((cumulative(p, t) != c).any() for t in (math.fsum(p.tolist()), float(p.sum()))):
        out.add(("sum_order", "matters"))


def rope_branches(case: str, h, out: set):
    """13.1 step 3 for a predicted file's quantized positions: the recurrence's binary32 cos / sin (times the
    scale) against a direct binary64 cos(p * theta), theta = atan2(sin_theta, cos_theta)."""
    from safetensors.numpy import load_file

    pred = load_file(str(VECTORS / f"{case}.predictors.safetensors"))
    ct, st = pred["rope.cos_theta"].astype(np.float64), pred["rope.sin_theta"].astype(np.float64)
    sc = np.float32(json.loads(bytes(pred["meta.json"]).decode())["scale"])
    pr, S = h.predict, h.layers[0].seq_len
    pos = range(h.start_position + pr["exact_head"], h.start_position + S - pr["exact_tail"])
    c, s = np.ones_like(ct), np.zeros_like(st)
    th = np.arctan2(st, ct)
    for p in range(pos.stop):
        if p in pos:
            rec = (c.astype(np.float32) * sc, s.astype(np.float32) * sc)
            direct = (np.cos(p * th).astype(np.float32) * sc, np.sin(p * th).astype(np.float32) * sc)
            if (rec[0] != direct[0]).any() or (rec[1] != direct[1]).any():
                out.add(("rope_recurrence", "differs from direct"))
                return
        c, s = c * ct - s * st, s * ct + c * st


def _to_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """Values rounded once to float16 / bfloat16 (round to nearest, ties to even; normal bfloat16 values)."""
    if dtype == "float16":
        return np.asarray(x, np.float64).astype(np.float16).astype(np.float64)
    return np.array([0.0 if v == 0 else math.ldexp(round(math.frexp(v)[0] * 256), math.frexp(v)[1] - 8)
                     for v in np.asarray(x, np.float64).ravel()]).reshape(np.shape(x))


def kivi_branches(p: bytes, at: int, shape, tq: int, dtype: str, out: set):
    """13 Method 3 (fields at ``at``, ``tq`` quantized tokens): does a value's binary32 min + q*scale, rounded to
    dtype, differ from the exact value rounded to dtype once?"""
    from kvcodec.codecs import float_ctx_rans as F

    b, hh, _t, d = shape
    axis, bits, group, side_len = struct.unpack_from("<BBHI", p, at)
    k = max(2, bits)
    n = tq if axis == 0 else d
    ng = b * hh * (d if axis == 0 else tq) * -(-n // group)
    side = F.decode(memoryview(p)[at + 8:at + 8 + side_len], (1, 2, ng, 1), "float16").view(np.float16)
    side = side.reshape(2, ng).astype(np.float32)
    q = np.empty((b * hh, tq, d), np.uint16)
    F.decode_symbols(memoryview(p)[at + 8 + side_len:], q, k, exact_payload=False, coded_bits=k)
    q = q.reshape(b, hh, tq, d)
    g = (q.transpose(0, 1, 3, 2) if axis == 0 else q).astype(np.float32)  # groups run along the last axis
    pad = -g.shape[-1] % group
    g = np.concatenate([g, np.repeat(g[..., -1:], pad, axis=-1)], axis=-1).reshape(ng, group)
    mn, sc = side[0][:, None], side[1][:, None]
    b32 = (mn + g * sc).astype(np.float32)  # binary32: the product (exact), then the sum
    exact = mn.astype(np.float64) + g.astype(np.float64) * sc.astype(np.float64)  # exact in binary64
    if (_to_dtype(b32, dtype) != _to_dtype(exact, dtype)).any():
        out.add(("kivi_rounding", "binary32 then dtype"))


DEFAULT_K = {"float32": 10, "float16": 7, "bfloat16": 10}


def branches(case: str) -> set:
    out = set()
    data = (VECTORS / f"{case}.kvz").read_bytes()
    meta = json.loads((VECTORS / f"{case}.json").read_text())
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
                # (issue 51) zeroed residuals: the reconstruction (keys_sha256, what a decoder produces) not the input
                if meta.get("input_keys_sha256", meta["keys_sha256"]) != meta["keys_sha256"] or \
                        meta.get("input_values_sha256", meta["values_sha256"]) != meta["values_sha256"]:
                    out.add(("tolerance", "zeroes residuals"))
            if any(t["padding"]):
                out.add(("padding", t["positions"]))
            if t["token_model"] == "static":  # the token ids, checked against the streams by test_vectors.py
                for row, ids in enumerate(meta["tokens"]):
                    static_branches(ids[t["padding"][row]:], t["vocab"], out)
            else:  # the neural procedures code a row's (lm-blocks-v1: each block's) first token uniformly
                uniform_branches(t["vocab"], out)
        if h.predict is not None:
            rope_branches(case, h, out)
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
            shape = lay.slice_shape(e.chunk, h.chunk_tokens, h.batch, e.part)  # (1.8) [1, 1, T, D] for one head
            if e.section_type == L.SECTION_RESIDUAL:
                out.add(("residual", p[0]))
                if p[0] == 1:
                    coded_part(p[1:], shape, out, None)
                elif p[0] == 2:
                    float_payload(p[1:], h.dtype, shape, out, DEFAULT_K[h.dtype])
            elif h.tier == "lossless":
                float_payload(p, h.dtype, shape, out, DEFAULT_K[h.dtype])
                if lay.heads is not None:
                    out.add(("heads_float", p[0]))
            else:
                mode, method, _k, rule, exact, _seed, _st, _nl = VQ_FIXED.unpack_from(p, 0)
                out |= {("vq_method", method), ("vq_mode", mode), ("sign_rule", rule)}
                t = shape[2]
                at = VQ_FIXED.size + 4  # the method fields (after Index_Offset; Mode 2: after the head)
                if mode == 2:
                    t -= struct.unpack_from("<I", p, at)[0]
                    out.add(("vq_mode2_method", method))
                    at += 8 + struct.unpack_from("<I", p, at + 4)[0]
                if exact == t:
                    out.add(("vq_all_exact", "yes"))
                elif exact:
                    out.add(("vq_exact_tail", "yes"))
                if method == 3 and exact < t:
                    out.add(("kivi_axis", p[at]))
                    if h.dtype != "float32":
                        kivi_branches(p, at, shape, t - exact, h.dtype, out)
                if method == 4 and exact < t:
                    out.add(("cachegen_bins", "odd" if struct.unpack_from("<H", p, at)[0] % 2 else "even"))
    return out


def test_vectors_cover_every_spec_branch():
    cases = sorted(p.stem for p in VECTORS.glob("*.kvz"))
    covered = set().union(*(branches(c) for c in cases))
    missing = sorted(REQUIRED - covered, key=str)
    assert not missing, f"spec branches without a golden vector: {missing}"


def test_pinned_branches_are_covered_by_their_vector():
    """(issue 51 item 2) each rule of PINNED is taken by the vector written for it (not only by chance)."""
    missing = sorted(((b, case) for b, case in PINNED.items() if b not in branches(case)), key=str)
    assert not missing, f"vectors that no longer take the branch they were written for: {missing}"


def test_appendix_a_lists_every_vector():
    spec = (VECTORS.parent / "kvz.md").read_text()
    appendix = spec[spec.index("## Appendix A"):spec.index("## Appendix B")]
    for p in VECTORS.glob("*.kvz"):
        assert f"`{p.stem}`" in appendix, f"spec Appendix A does not list {p.stem}"
    for p in VECTORS.glob("*.json"):
        json.loads(p.read_text())
