"""Study (issue 15, direction 1): quantize keys and values where attention feels the error.

A key error δk changes the logit of every query q by s·⟨q, δk⟩, so its cost is δkᵀ C δk with
C = s² E[q qᵀ] over the queries of the KV head's group; a value error δv reaches the residual stream as
W_o,g δv for each query head g of the group, so its cost is δvᵀ M δv with M = Σ_g W_o,gᵀ W_o,g (a model
weight: no calibration).  Quantizing ``u = A x`` (A = C^{1/2} or M^{1/2} per layer and KV head, in the
eigenbasis) with one uniform step makes the *weighted* error white, and entropy coding each coordinate
(channel) separately spends bits where the weight is: reverse water-filling for free.

Arms, each at several steps, each coded with the lossy tier's own index coder (``float_ctx_rans`` symbols,
one row per channel: real bytes, not an entropy estimate), the first token stored exactly as the tier does:

- ``tier``: the shipped lossy tier (``api.encode(tier="lossy", bits=b)``), all bytes of its kv sections;
- ``rotated``: this script's own path with A = I after the tier's Hadamard rotation and per-vector norms
  (checks that this script's coding matches the tier's);
- ``weighted``: A from C (keys; queries of a *calibration* text of another genre, post-RoPE, last 512
  prefill positions) and M (values), eigenvalues floored at 1e-4 of their mean;
- ``weighted-oracle``: C from the evaluated text's own queries (upper bound of calibration).

Rates: bits per stored component of the indices, the first token and (rotated) the norms; the profile
(A⁻¹ per layer, part and KV head, f16) is a per-model side table reported apart.  Quality: mean KL (bits)
of the next-token distributions over the continuation, teacher-forced (``kvz eval``'s measure).

    python -m kvcodec.lab.study_weighted --corpus ../shared/corpus --out bench_out
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time

import numpy as np
import torch

TEXTS = ["legal_en_gpl-3.0.txt", "prose_en_austen_pride_and_prejudice.txt", "code_python_textwrap.py"]
CALIBRATION = "data_iso_3166-1.json"


@torch.no_grad()
def logp(model, cache, cont):
    from ..tokens.plan import cache_kwarg

    out = model(cont, **{cache_kwarg(model): copy.deepcopy(cache)}).logits[0].double()
    return torch.log_softmax(out, -1)


def kl(lp, lq):
    return float(((lp.exp() * (lp - lq)).sum(-1) / math.log(2)).mean())


@torch.no_grad()
def query_moments(model, ids, window: int = 512):
    """Per layer: ``[kv_heads, D, D]`` s² E[q qᵀ] over the last ``window`` prefill queries of each group."""
    from ..reduction.attention import observe

    with observe(model, window=window, received=False) as obs:
        model(ids, use_cache=False)
    out = {}
    for li, q in obs.queries.items():
        b, hq, w, d = q.shape
        kv = model.config.num_key_value_heads
        qg = q.double().reshape(b, kv, hq // kv, w, d).reshape(kv, -1, d)
        out[li] = (obs.scaling[li] ** 2) * torch.einsum("hnd,hne->hde", qg, qg) / qg.shape[1]
    return out


def value_weights(model):
    """Per layer: ``[kv_heads, D, D]`` Σ_g W_o,gᵀ W_o,g over the query heads of each group."""
    cfg = model.config
    hq, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // hq
    out = {}
    for li, layer in enumerate(model.model.layers):
        w = layer.self_attn.o_proj.weight.detach().double()  # [hidden, hq * d]
        blocks = w.reshape(w.shape[0], hq, d).permute(1, 2, 0)  # [hq, d, hidden]
        m = blocks @ blocks.transpose(1, 2)  # [hq, d, d]
        out[li] = m.reshape(kv, hq // kv, d, d).sum(1)
    return out


def sqrt_and_inverse(c, floor: float = 1e-4):
    """(A, A⁻¹) with A = C^{1/2} (symmetric), eigenvalues floored at ``floor`` × their mean."""
    lam, u = torch.linalg.eigh(c)
    lam = lam.clamp(min=floor * lam.mean(-1, keepdim=True).clamp_min(1e-30))
    a = u @ torch.diag_embed(lam.sqrt()) @ u.transpose(-1, -2)
    ai = u @ torch.diag_embed(lam.rsqrt()) @ u.transpose(-1, -2)
    return a, ai


def _code(u: np.ndarray, step: float) -> tuple[int, np.ndarray]:
    """(bytes, reconstruction) of ``u [B, H, T, D]`` by a uniform step, indices coded like the tier's."""
    from ..codecs.vq_rans import index_payload

    q = np.rint(u / step).astype(np.int64)
    return len(index_payload(q)[0]) + 4, (q * step).astype(np.float32)


def exact_bytes(x: torch.Tensor) -> int:
    from ..codecs import float_ctx_rans as floatctx

    return len(floatctx.encode(np.ascontiguousarray(x.float().numpy().view(np.uint32)), "float32", {}))


def transformed(kv, weights, step_k: float, step_v: float):
    """(bytes, decoded KVCache): every layer's keys / values after token 0 coded with one step per part;
    token 0 exact.  ``weights = (keys, values)``, each None (the tier's Hadamard rotation with per-vector
    norms) or per layer ``(A, A⁻¹)`` (``A x`` quantized, no norms)."""
    from ..cache import KVCache
    from ..codecs import float_ctx_rans as floatctx
    from ..codecs.vq_rans import directions, fwht, signs

    keys, values, nbytes = [], [], 0
    for li in range(kv.num_layers):
        for part, src, dst, step in ((0, kv.keys[li], keys, step_k), (1, kv.values[li], values, step_v)):
            x = src.float()
            nbytes += exact_bytes(x[:, :, :1])
            body = x[:, :, 1:]
            b, h, t, d = body.shape
            if weights[part] is None:
                norms16, z = directions(body.reshape(-1, d).numpy(), 0x6B767A)
                nb, zq = _code(z.reshape(b, h, t, d), step)
                nbytes += nb + len(floatctx.encode(norms16.view(np.uint16).reshape(b, h, t, 1), "float16", {}))
                y = fwht(zq.reshape(-1, d)) * signs(0x6B767A, d)[None, :] / np.float32(d)
                rec = torch.from_numpy(y * norms16.astype(np.float32)[:, None]).reshape(b, h, t, d)
            else:
                a, ai = weights[part][li]
                u = torch.einsum("hde,bhte->bhtd", a, body.double()).float().numpy()
                nb, uq = _code(u, step)
                nbytes += nb
                rec = torch.einsum("hde,bhte->bhtd", ai, torch.from_numpy(uq).double()).float()
            dst.append(torch.cat([x[:, :, :1], rec], 2).to(src.dtype))
    return nbytes, KVCache(keys, values)


def rope_pair_average(c):
    """C averaged over RoPE phases: per pair (i, i + D/2) (the rotate-half layout), the mean of its two
    diagonal entries on both; every off-diagonal entry 0 (a rotation by position decorrelates pairs of
    different frequencies).  Diagonal: a per-channel weight."""
    d = c.shape[-1]
    diag = torch.diagonal(c, dim1=-2, dim2=-1)
    pair = (diag[..., : d // 2] + diag[..., d // 2:]) / 2
    return torch.diag_embed(torch.cat([pair, pair], -1))


def study_parser(doc: str) -> argparse.ArgumentParser:
    """The options the lossy studies share: corpus, output directory, cache and continuation lengths, texts."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--corpus", default="../shared/corpus")
    p.add_argument("--out", default="bench_out")
    p.add_argument("--prefix", type=int, default=1024)
    p.add_argument("--continuation", type=int, default=128)
    p.add_argument("--texts", nargs="*", default=TEXTS)
    return p


def main(argv=None) -> int:
    from .. import api
    from ..cache import to_canonical
    from ..models import load_model, prefill, tokenize
    from .common import corpus_files, write_report

    p = study_parser(__doc__)
    p.add_argument("--calibration", default=CALIBRATION)
    p.add_argument("--tier-bits", type=float, nargs="*", default=[1.5, 2.0, 2.5, 3.0, 3.5])
    p.add_argument("--focus", type=int, nargs="*", metavar="TOKENS",
                   help="only the tier and 'keys pair-weighted, values rotated' on a finer step grid, with key "
                        "weights calibrated on this many tokens of --calibration (each count an arm) and on the "
                        "evaluated text itself (oracle)")
    args = p.parse_args(argv)
    t0 = time.time()
    model, tok = load_model("smollm2", dtype=torch.float32)
    files = {f.name: f for f in corpus_files(args.corpus)}
    cal_ids = tokenize(tok, files[args.calibration].read_text(encoding="utf-8"), args.prefix)
    cal = query_moments(model, cal_ids)
    vw = {li: sqrt_and_inverse(m) for li, m in value_weights(model).items()}
    kw = {li: sqrt_and_inverse(c) for li, c in cal.items()}
    kwp = {li: sqrt_and_inverse(rope_pair_average(c)) for li, c in cal.items()}
    kwn = {n: {li: sqrt_and_inverse(rope_pair_average(c)) for li, c in query_moments(model, cal_ids[:, :n],
                                                                                      window=n).items()}
           for n in args.focus or ()}
    profile_bytes = 2 * sum(a.numel() for a, _ in list(vw.values()) + list(kw.values()))
    rows = []
    for name in args.texts:
        ids = tokenize(tok, files[name].read_text(encoding="utf-8"), args.prefix + args.continuation)
        prefix, cont = ids[:, :args.prefix], ids[:, args.prefix:]
        exact = prefill(model, prefix)
        kv = to_canonical(exact)
        comps = sum(t.numel() for t in kv.keys + kv.values)
        lp = logp(model, exact, cont)
        oracle = None if args.focus else {li: sqrt_and_inverse(c) for li, c in query_moments(model, prefix).items()}

        def row(arm, cfg, nbytes, cache):
            r = {"text": name, "arm": arm, "config": cfg, "bits_per_component": 8 * nbytes / comps,
                 "mean_kl_bits": kl(lp, logp(model, cache, cont))}
            rows.append(r)
            print(f"{name} {arm} {json.dumps(cfg)}: {r['bits_per_component']:.3f} bits, KL {r['mean_kl_bits']:.4f}",
                  flush=True)

        for b in args.tier_bits:
            data = api.encode(exact, tier="lossy", bits=b)
            payload = sum(s["bytes"] for s in api.inspect(data)["sections"] if s["type"] == "kv")
            row("tier", {"bits": b}, payload, api.decode(data))
        if args.focus:
            arms = {f"keys pair-weighted ({n} calibration tokens), values rotated": kwn[n] for n in args.focus}
            arms["keys pair-weighted (oracle: the text's own queries), values rotated"] = {
                li: sqrt_and_inverse(rope_pair_average(c)) for li, c in query_moments(model, prefix).items()}
            for arm, w in arms.items():
                for sk in (0.15, 0.2, 0.3):
                    for sv in (0.75, 1.0, 1.4):
                        nb, rec = transformed(kv, (w, None), sk, sv)
                        row(arm, {"key_step": sk, "value_step": sv}, nb, rec.to_dynamic_cache())
            continue
        for st in (0.4, 0.55, 0.75, 1.0, 1.4):
            nb, rec = transformed(kv, (None, None), st, st)
            row("rotated", {"step": st}, nb, rec.to_dynamic_cache())
        ident = {li: (torch.eye(a.shape[-1], dtype=a.dtype).expand_as(a),) * 2 for li, (a, _) in vw.items()}
        rot = (0.55, 0.75, 1.0, 1.4)
        grids = {"plain per-channel (no rotation, no norms)": ((ident, ident), (0.3, 0.6, 1.0), None),
                 "keys weighted (full C), values rotated": ((kw, None), (0.05, 0.1, 0.2), rot[:3]),
                 "keys pair-weighted, values rotated": ((kwp, None), (0.1, 0.2, 0.4), rot[:3]),
                 "keys oracle-weighted, values rotated": ((oracle, None), (0.05, 0.1, 0.2), rot[:3]),
                 "keys rotated, values weighted": ((None, vw), rot[:3], (2.0, 4.0, 8.0)),
                 "keys pair-weighted, values weighted": ((kwp, vw), (0.1, 0.2, 0.4), (2.0, 4.0, 8.0))}
        for arm, (w, ks, vs) in grids.items():
            for sk in ks:
                for sv in vs or (sk,):
                    nb, rec = transformed(kv, w, sk, sv)
                    row(arm, {"key_step": sk, "value_step": sv}, nb, rec.to_dynamic_cache())
    res = {"command": "python -m kvcodec.lab.study_weighted " + " ".join(argv or []),
           "model": "SmolLM2-135M-Instruct (float32)", "prefix": args.prefix, "continuation": args.continuation,
           "calibration": args.calibration, "profile_bytes_f16": profile_bytes, "rows": rows,
           "at_bits": at_bits(rows), "seconds": round(time.time() - t0, 1)}
    write_report(args.out, "study_weighted", res, to_markdown(res))
    return 0


def interp(points, bits):
    """KL at ``bits`` by log-linear interpolation of (bits, KL) points (None outside their range)."""
    pts = sorted(points)
    for (b0, k0), (b1, k1) in zip(pts, pts[1:]):
        if b0 <= bits <= b1 and k0 > 0 and k1 > 0:
            w = (bits - b0) / (b1 - b0) if b1 > b0 else 0.0
            return math.exp(math.log(k0) + w * (math.log(k1) - math.log(k0)))
    return None


def front(points):
    """The (bits, KL) points no other point beats on both: the arm's best rate-distortion curve."""
    out = []
    for b, k in sorted(points):
        if not out or k < out[-1][1]:
            out.append((b, k))
    return out


def at_bits(rows, targets=(2.0, 3.0)):
    """Per text and arm: KL interpolated at each target rate on the arm's front (over its steps)."""
    groups = {}
    for r in rows:
        groups.setdefault((r["text"], r["arm"]), []).append((r["bits_per_component"], r["mean_kl_bits"]))
    return [{"text": t, "arm": a, **{f"kl_at_{b:g}": interp(front(p), b) for b in targets}}
            for (t, a), p in groups.items()]


def to_markdown(res) -> str:
    lines = [f"{res['model']}, prefix {res['prefix']}, continuation {res['continuation']} teacher-forced; "
             f"key weights calibrated on {res['calibration']}; profile {res['profile_bytes_f16'] / 1e6:.2f} MB "
             "(f16, per model, not counted in the rates). KL interpolated at the rate on each arm's front over its "
             "step grid (log-linear between the two nearest points; '—' outside the measured range).", "",
             *kl_table(res["at_bits"], (2.0, 3.0))]
    return "\n".join(lines + row_table(res["rows"])) + "\n"


def kl_table(at_rows, targets) -> list[str]:
    """Markdown lines of :func:`at_bits`' rows: text, arm, the KL at each target rate ('—' where unmeasured)."""
    out = ["| text | arm | " + " | ".join(f"KL at {b:g} bits" for b in targets) + " |",
           "|---|---|" + "---:|" * len(targets)]
    for r in at_rows:
        kls = [r[f"kl_at_{b:g}"] for b in targets]
        out.append(f"| {r['text']} | {r['arm']} | " + " | ".join("—" if x is None else f"{x:.4f}" for x in kls) + " |")
    return out


def row_table(rows) -> list[str]:
    """Markdown lines of every measured point: text, arm, config, bits per component, KL."""
    out = ["", "| text | arm | config | bits/comp | KL bits |", "|---|---|---|---:|---:|"]
    for r in rows:
        out.append(f"| {r['text']} | {r['arm']} | `{json.dumps(r['config'])}` | {r['bits_per_component']:.3f} | "
                   f"{r['mean_kl_bits']:.4f} |")
    return out


if __name__ == "__main__":
    raise SystemExit(main())
