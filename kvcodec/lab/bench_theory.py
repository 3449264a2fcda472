"""`kvz bench --theory`: the reduce tier's theory (papers.md B.2), measured per head on SmolLM2.

For each document the first ``--context`` tokens are prefilled (the cache ``P``); the queries of the next 64
positions, which attend to that cache, are the query sample ``nu`` (the "future" queries, grouped per KV
head over its query heads).  Per head and mass form f (``kernel``: P_i proportional to exp(s |k_i|^2 / 2),
the papers'; ``dot``: uniform; ``query``: exp(s <a, k_i>) with a the mean of the last 64 prefill queries;
``optimal``: the variance-minimising P_i proportional to sqrt(c_i), which needs nu):

- the response profile ``Gamma_i(q) = a_i(q) (v_i - Att(q|P)) / P_i`` (a_i: softmax attention weight) and
  ``tr Sigma_f = sum_i c_i / P_i`` with ``c_i = E_q |a_i(q) (v_i - Att(q))|^2``: the risk of K i.i.d. draws
  from P_f is exactly ``tr Sigma_f / K`` (the query-agnostic rate);
- the spectrum of ``Sigma_f`` (the SVD of ``G``, row i = sqrt(P_i) Gamma_i over the query sample) and
  ``tail_{K/3}(Sigma_f) / K`` (the query-aware rate);
- the measured risk ``E_q |Att(q|Q) - Att(q|P)|^2`` of each reducer (one-shot, the whole cache to K atoms),
  against those predictions;
- the fraction of ``tr Sigma_f`` captured by span(Phi) (weighted least squares of Gamma on [1, Phi]) for
  Phi = v and Phi = [k; v], which protected clustering balances exactly (Assumption 5.1's diagnostic), with
  the fraction a random Phi of the same dimension captures (the fitting floor);
- risk accumulation over merge-reduce levels: the summary of 2^L blocks built by the tree against a one-shot
  reduction of the same tokens to K atoms, for L = 1 .. 4.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from .common import missing_corpus, selected_files, write_report

FORMS = ("kernel", "dot", "query", "optimal")


def _profile(keys, values, queries, s):
    """Per head: attention weights ``a`` [h, q, n], ``Att`` [h, q, dv] and ``c`` [h, n] (float64)."""
    a = torch.softmax(s * queries @ keys.transpose(-1, -2), -1)
    att = a @ values
    # c_i = mean_q |a_i(q)|^2 |v_i - att(q)|^2, expanded to avoid the [h, q, n, dv] tensor
    v2 = (values * values).sum(-1)  # [h, n]
    cross = att @ values.transpose(-1, -2)  # [h, q, n]
    att2 = (att * att).sum(-1)  # [h, q]
    d2 = v2[:, None, :] - 2 * cross + att2[..., None]
    c = (a * a * d2).mean(1)
    return a, att, c


def _logp(form, keys, s, anchor, c):
    """log P_i of the form, normalised per head [h, n]."""
    if form == "kernel":
        lp = 0.5 * s * (keys * keys).sum(-1)
    elif form == "dot":
        lp = torch.zeros(keys.shape[:2], dtype=keys.dtype)
    elif form == "query":
        lp = s * (keys @ anchor[..., None])[..., 0]
    else:  # optimal: P proportional to sqrt(c)
        lp = 0.5 * torch.log(c.clamp_min(1e-300))
    return lp - torch.logsumexp(lp, -1, keepdim=True)


def _spectrum(a, att, values, lp):
    """Eigenvalues (descending) of Sigma per head, from G G^T (n x n); G_i = a_i (v_i - att) / sqrt(P_i s).
    (``trace_check`` in the rows compares their sum with tr Sigma computed directly.)"""
    h, sq, n = a.shape
    out = []
    for j in range(h):
        g = a[j].transpose(0, 1)[..., None] * (values[j][:, None, :] - att[j][None])  # [n, q, dv]
        g = (g.reshape(n, -1) * torch.exp(-0.5 * lp[j])[:, None] / math.sqrt(sq))
        scale = g.abs().max().clamp_min(1e-300)
        gf = (g / scale).float()  # the n x n Gram in float32 (the costly product), its spectrum in float64
        gram = (gf @ gf.transpose(0, 1)).double()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # multi-threaded eigvalsh spins for seconds on a busy machine; one thread: 40 ms
        try:
            ev = torch.linalg.eigvalsh(gram).flip(0).clamp_min(0) * scale ** 2
        finally:
            torch.set_num_threads(threads)
        out.append(ev)
    return torch.stack(out)  # [h, n]


def _capture(a, att, values, lp, feats, seed=0):
    """Fraction of tr Sigma captured by span([1, feats]) (weighted least squares of Gamma_i on the features,
    weights P_i), and by the same number of random features (the floor); per head."""
    h, sq, n = a.shape
    gen = torch.Generator().manual_seed(seed)
    out, floor = [], []
    for j in range(h):
        g = a[j].transpose(0, 1)[..., None] * (values[j][:, None, :] - att[j][None])
        g = g.reshape(n, -1) * torch.exp(-0.5 * lp[j])[:, None]  # sqrt(P_i) Gamma_i
        w = torch.exp(0.5 * lp[j])[:, None]
        tot = (g * g).sum()
        res = []
        for x in (feats[j], torch.randn(feats[j].shape, generator=gen, dtype=feats.dtype)):
            xx = torch.cat([torch.ones(n, 1, dtype=x.dtype), x], 1) * w
            sol = torch.linalg.lstsq(xx, g).solution
            r = g - xx @ sol
            res.append(float(1 - (r * r).sum() / tot))
        out.append(res[0])
        floor.append(res[1])
    return out, floor


def _risk(queries, keys, values, q_atoms, s, ref):
    """E_q |Att(q|Q) - Att(q|P)|^2 per head for a summary ``q_atoms`` = (k, v, beta) [1, h, K, d]."""
    k, v, beta = (t[0].double() for t in q_atoms)
    att = torch.softmax(s * queries @ k.transpose(-1, -2) + beta[:, None, :], -1) @ v
    return ((att - ref) ** 2).sum(-1).mean(-1)  # [h]


@torch.no_grad()
def measure_doc(model, ids, n, layers, keeps, seeds=3, progress=print):
    from ..reduction import reducers, tree
    from ..reduction.attention import enable, observe
    from ..tokens.plan import cache_kwarg

    enable(model)
    ka = cache_kwarg(model)
    with observe(model, window=64, received=False) as pre:
        out = model(ids[:, :n], **{ka: None}, use_cache=True)
    cache = out["cache"] if "cache" in out else out["past_key_values"]
    with observe(model, window=64, received=False) as fut:
        model(ids[:, n:n + 64], **{ka: cache})
    rows = []
    for li in layers:
        s = pre.scaling[li]
        keys = cache.layers[li].keys[0, :, :n].double()  # [h, n, d]
        values = cache.layers[li].values[0, :, :n].double()
        h, _, d = keys.shape
        fq = fut.queries[li][0].double()  # [hq, 64, d]
        g = fq.shape[0] // h
        queries = fq.reshape(h, g * fq.shape[1], d)  # the group's query heads pooled
        anchor = pre.queries[li][0].double().reshape(h, -1, d).mean(1)  # [h, d]
        a, att, c = _profile(keys, values, queries, s)
        ref = att
        att_norm = (att * att).sum(-1).mean(-1)  # [h]
        lps = {f: _logp(f, keys, s, anchor, c) for f in FORMS}
        tr = {f: (c * torch.exp(-lps[f])).sum(-1) for f in FORMS}
        spec = {f: _spectrum(a, att, values, lps[f]) for f in ("kernel", "query")}
        cap = {}
        for name, feats in (("v", values), ("k,v", torch.cat([keys, values], -1))):
            got, floor = _capture(a, att, values, lps["query"], feats)
            cap[name] = {"captured": got, "random_floor": floor}
        summ = (keys[None].float(), values[None].float(), torch.zeros(1, h, n))
        anchors = {"kernel": None, "dot": torch.zeros(1, h, d), "query": anchor[None].float()}
        for keep in keeps:
            kk = max(1, int(round(keep * n)))
            m = kk // 3
            meas = {}
            for form in ("kernel", "dot", "query"):
                rs = [_risk(queries, keys, values, reducers.sample(summ, kk, s, torch.Generator().manual_seed(sd),
                                                                   anchor=anchors[form]), s, ref)
                      for sd in range(seeds)]
                meas[f"sample-{form}"] = torch.stack(rs).mean(0)
                meas[f"cluster-{form}"] = _risk(queries, keys, values, reducers.cluster(
                    summ, kk, s, torch.Generator().manual_seed(0), anchor=anchors[form]), s, ref)
            for j in range(h):
                row = {"layer": li, "head": j, "n": n, "keep": keep, "K": kk, "att_norm": float(att_norm[j])}
                for f in FORMS:
                    row[f"pred_iid_{f}"] = float(tr[f][j]) / kk
                for f in ("kernel", "query"):
                    row[f"pred_tail_{f}"] = float(spec[f][j, m:].sum()) / kk
                    row[f"trace_check_{f}"] = float(spec[f][j].sum() / tr[f][j])  # = 1 (the SVD's trace)
                for key, val in meas.items():
                    row[key] = float(val[j])
                if keep == keeps[0]:
                    for name, cv in cap.items():
                        row[f"capture_{name}"] = cv["captured"][j]
                        row[f"capture_{name}_floor"] = cv["random_floor"][j]
                rows.append(row)
        # risk over merge-reduce levels: the tree's summary of 2^L blocks vs one-shot, same tokens, same K
        kk = max(4, int(round(0.05 * n)))
        for lvl in range(1, 5):
            span = kk * (1 << lvl)
            if span > n:
                break
            sk, sv = keys[:, n - span:], values[:, n - span:]
            _, sref, _ = _profile(sk, sv, queries, s)
            for form in ("query", "dot"):
                for red in ("cluster", "sample"):
                    fn = reducers.REDUCERS[red]
                    leaves = tree.leaves_of(sk[None].float(), sv[None].float(), kk)
                    levels = tree.upsweep(fn, kk, s, leaves, lambda *w: sum(map(ord, str(w))),
                                          anchors[form])
                    top = tuple(t[0] for t in levels[-1])
                    one = fn((sk[None].float(), sv[None].float(), torch.zeros(1, h, span)), kk, s,
                             torch.Generator().manual_seed(1), anchor=anchors[form])
                    r_tree = _risk(queries, sk, sv, top, s, sref)
                    r_one = _risk(queries, sk, sv, one, s, sref)
                    for j in range(h):
                        rows.append({"layer": li, "head": j, "levels": lvl, "K": kk, "span": span, "form": form,
                                     "reducer": red, "risk_tree": float(r_tree[j]), "risk_one_shot": float(r_one[j])})
        progress(f"layer {li} done")
    return rows


def _gmean(x):
    x = np.asarray([v for v in x if v > 0], float)
    return float(np.exp(np.log(x).mean())) if len(x) else float("nan")


def summarise(rows, keeps):
    heads = [r for r in rows if "keep" in r]
    out = {"per_keep": [], "capture": {}, "levels": []}
    for keep in keeps:
        sel = [r for r in heads if r["keep"] == keep]
        d = {"keep": keep, "heads": len(sel)}
        for key in [k for k in sel[0] if k.startswith(("pred_", "sample-", "cluster-"))]:
            d[key] = _gmean([r[key] / r["att_norm"] for r in sel])  # relative risk, geometric mean over heads
        d["sample_over_pred"] = {f: _gmean([r[f"sample-{f}"] / r[f"pred_iid_{f}"] for r in sel])
                                 for f in ("kernel", "dot", "query")}
        d["cluster_query_below_tail_query"] = float(np.mean([r["cluster-query"] <= r["pred_tail_query"] for r in sel]))
        d["cluster_query_below_iid_query"] = float(np.mean([r["cluster-query"] <= r["pred_iid_query"] for r in sel]))
        d["trace_check"] = _gmean([r["trace_check_kernel"] for r in sel])
        out["per_keep"].append(d)
    first = [r for r in heads if "capture_v" in r]
    for name in ("v", "k,v"):
        out["capture"][name] = {"median": float(np.median([r[f"capture_{name}"] for r in first])),
                                "random_floor_median": float(np.median([r[f"capture_{name}_floor"] for r in first]))}
    lv = [r for r in rows if "levels" in r]
    for lvl in sorted({r["levels"] for r in lv}):
        for form in ("query", "dot"):
            for red in ("cluster", "sample"):
                sel = [r for r in lv if r["levels"] == lvl and r["form"] == form and r["reducer"] == red]
                if sel:
                    out["levels"].append({"levels": lvl, "form": form, "reducer": red, "heads": len(sel),
                                          "tree_over_one_shot": _gmean([r["risk_tree"] / r["risk_one_shot"]
                                                                        for r in sel])})
    return out


def to_markdown(res) -> str:
    s = res["summary"]
    lines = ["# Reduce tier: the theory, measured (`kvz bench --theory`)", "",
             f"SmolLM2 fp32; {res['documents']} documents ({', '.join(res['files'])}), cache of {res['context']} "
             f"tokens each; query sample = the 64 following positions' queries (pooled over the 3 query heads of "
             f"each KV head: 192 queries); layers {res['layers']}; {res['heads']} heads in all. Risks are relative "
             "(E_q |Att(q|Q) - Att(q|P)|^2 / E_q |Att(q|P)|^2), geometric means over heads. "
             "pred_iid_f = tr Sigma_f / K (K i.i.d. draws from P_f), pred_tail_f = tail_{K/3}(Sigma_f) / K.", "",
             "| keep | pred iid kernel | pred iid dot | pred iid query | pred iid optimal | pred tail kernel | "
             "pred tail query | sample-kernel | sample-dot | sample-query | cluster-kernel | cluster-dot | "
             "cluster-query | cluster-query <= tail (share of heads) |",
             "|---:|" + "---:|" * 13]
    for d in s["per_keep"]:
        lines.append(f"| {d['keep']:g} | " + " | ".join(
            f"{d[k]:.3g}" for k in ("pred_iid_kernel", "pred_iid_dot", "pred_iid_query", "pred_iid_optimal",
                                    "pred_tail_kernel", "pred_tail_query", "sample-kernel", "sample-dot",
                                    "sample-query", "cluster-kernel", "cluster-dot", "cluster-query"))
            + f" | {d['cluster_query_below_tail_query']:.2f} |")
    lines += ["", "Measured i.i.d. sampling risk / its prediction tr Sigma_f / K (1 = the theory's rate holds):", "",
              "| keep | kernel | dot | query |", "|---:|---:|---:|---:|"]
    for d in s["per_keep"]:
        r = d["sample_over_pred"]
        lines.append(f"| {d['keep']:g} | {r['kernel']:.3f} | {r['dot']:.3f} | {r['query']:.3f} |")
    lines += ["", "Fraction of tr Sigma (query form) captured by span([1, Phi]) (median over heads; a random Phi of "
              "the same dimension in brackets, the fitting floor):", ""]
    for name, c in s["capture"].items():
        lines.append(f"- Phi = {name}: {c['median']:.3f} ({c['random_floor_median']:.3f})")
    lines += ["", "Risk over merge-reduce levels: the tree's summary of 2^L blocks of K tokens (K = 5 % of the "
              "cache) / a one-shot reduction of the same tokens to K atoms (geometric mean over heads):", "",
              "| levels | form | reducer | tree / one-shot |", "|---:|---|---|---:|"]
    for d in s["levels"]:
        lines.append(f"| {d['levels']} | {d['form']} | {d['reducer']} | {d['tree_over_one_shot']:.3f} |")
    return "\n".join(lines) + "\n"


def run_theory_bench(args) -> int:
    from ..models import load_model

    files = selected_files(args)
    if not files:
        return missing_corpus("kvz bench --theory")
    model, tok = load_model("smollm2", dtype=torch.float32)
    n = args.context
    keeps = sorted(args.keeps)
    nl = model.config.num_hidden_layers
    layers = sorted({0, nl // 4, nl // 2, 3 * nl // 4, nl - 1})
    t0 = time.perf_counter()
    rows, used = [], []
    for f in files:
        ids = tok(f.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)["input_ids"]
        if len(ids) < n + 64:
            continue
        used.append(f.name)
        for r in measure_doc(model, torch.tensor([ids[:n + 64]]), n, layers, keeps,
                             progress=lambda m, name=f.name: print(f"{name}: {m}", flush=True)):
            r["file"] = f.name
            rows.append(r)
        if len(used) == args.documents:
            break
    if not used:
        print(f"kvz bench --theory: no document of the corpus has {n} + 64 tokens")
        return 1
    res = {"model": "smollm2 fp32", "context": n, "documents": len(used), "files": used, "layers": layers,
           "keeps": keeps, "heads": len({(r["file"], r["layer"], r["head"]) for r in rows}),
           "seconds": round(time.perf_counter() - t0, 1), "summary": summarise(rows, keeps), "rows": rows}
    write_report(args.out, "bench_theory", res, to_markdown(res))
    return 0
