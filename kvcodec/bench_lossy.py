"""``kvz bench --lossy``: rate-distortion of the lossy tier on SmolLM2 (protocol of ``kvz eval``).

Per text: the exact cache of the first ``--prefix`` tokens (fp32 model, like
``../shared/design/peers.md``), then for every configuration the cache decoded
from a ``tier="lossy"`` file; the next ``--continuation`` tokens teacher-forced
on each.  Rate = every byte of the kv sections (indices, norms / scales,
tables, exact window) per stored component; the container's fixed header
(~1 KB) is reported apart.  Distortion = mean KL(P_exact || P_compressed) in
bits per token.  Two in-process reference points without entropy coding use
the same protocol: fp8 e4m3 per tensor (8 bits) and per-token min-max 4-bit
(4 bits + two fp16 per 64 components = 4.5 bits).

Results: ``OUT/bench_lossy.json``, ``OUT/bench_lossy.md`` and, with
matplotlib installed (``pip install kvz[bench]``), ``OUT/bench_lossy.png``.
"""

from __future__ import annotations

import json
import platform
import statistics
from pathlib import Path

import torch

from .runtime import write_report

CONFIGS = ([{"quantizer": "uniform", "bits": b} for b in (1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0)]
           + [{"quantizer": "lloyd", "lloyd_bits": b} for b in (2, 3, 4)]
           + [{"quantizer": "kivi", "kivi_bits": b, "group": 32} for b in (2, 3, 4)]
           + [{"quantizer": "cachegen", "cachegen_bins": bins} for bins in ([16, 8], [32, 16], [64, 32])])
TEXTS = ["legal_en_gpl-3.0.txt", "prose_en_austen_pride_and_prejudice.txt", "code_python_textwrap.py"]


def _fp8(kv):
    from .cache import KVCache

    def q(t):
        s = t.abs().amax().clamp_min(1e-30) / 448.0
        return ((t / s).to(torch.float8_e4m3fn).to(t.dtype) * s).to(t.dtype)

    return KVCache([q(t) for t in kv.keys], [q(t) for t in kv.values])


def _minmax_token(kv, bits=4):
    from .cache import KVCache

    def q(t):
        mn, mx = t.amin(-1, keepdim=True), t.amax(-1, keepdim=True)
        sc = ((mx - mn) / (2 ** bits - 1)).clamp_min(1e-30)
        return (torch.round((t - mn) / sc) * sc + mn).to(t.dtype)

    return KVCache([q(t) for t in kv.keys], [q(t) for t in kv.values])


def run_lossy_bench(args) -> int:
    from . import api
    from .cache import to_canonical
    from .evaluate import evaluate_cache, prefix_case
    from .models import load_model
    from .runtime import corpus_files

    model, tok = load_model("smollm2", dtype=torch.float32)
    files = {f.name: f for f in corpus_files()}
    texts = args.genres or TEXTS
    rows = []
    for name in texts:
        prefix, cont, exact, comps = prefix_case(model, tok, files[name], args.prefix, args.continuation)
        kv = to_canonical(exact)
        for label, build, rate in (("fp8 e4m3 per tensor (reference, not entropy-coded)", _fp8, 8.0),
                                   ("per-token min-max 4-bit (reference, not entropy-coded)", _minmax_token, 4.5)):
            r = evaluate_cache(model, tok, exact, build(kv).to_dynamic_cache(), prefix, cont)
            r.update(text=name, method=label, config={}, bits_per_component=rate, header_bytes=0)
            rows.append(r)
        for cfg in CONFIGS:
            data = api.encode(exact, tier="lossy", **cfg)
            info = api.inspect(data)
            payload = sum(s["bytes"] for s in info["sections"] if s["type"] == "kv")
            r = evaluate_cache(model, tok, exact, api.decode(data), prefix, cont)
            r.update(text=name, method=f"kvz {cfg['quantizer']}", config=cfg,
                     bits_per_component=8 * payload / comps, header_bytes=len(data) - payload)
            rows.append(r)
            print(f"{name} {json.dumps(cfg)}: {r['bits_per_component']:.3f} bits/comp, KL {r['mean_kl_bits']:.4f}, "
                  f"top-1 {r['top1_agreement']:.3f}", flush=True)
    res = {"command": f"kvz bench --lossy --prefix {args.prefix} --continuation {args.continuation}",
           "model": "SmolLM2-135M-Instruct (float32)", "machine": platform.machine(), "rows": rows,
           "peers": "not run by this command yet: see ../shared/design/peers.md for their measured rates "
                    "(cross-entropy protocol); their own venvs are the next step"}
    out = write_report(args.out, "bench_lossy", res, to_markdown(res))
    _plot(res, out / "bench_lossy.png")
    return 0


def _summary(rows):
    by = {}
    for r in rows:
        by.setdefault((r["method"], json.dumps(r["config"], sort_keys=True)), []).append(r)
    out = []
    for (method, cfg), rs in by.items():
        out.append({"method": method, "config": json.loads(cfg), "texts": len(rs),
                    "bits": statistics.median(r["bits_per_component"] for r in rs),
                    "kl": statistics.median(r["mean_kl_bits"] for r in rs),
                    "kl_mean": statistics.fmean(r["mean_kl_bits"] for r in rs),
                    "top1": statistics.median(r["top1_agreement"] for r in rs),
                    "dce": statistics.median(r["ce_diff_bits"] for r in rs),
                    "greedy": statistics.median(r["greedy_agreement"] for r in rs)})
    return sorted(out, key=lambda r: (r["method"], r["bits"]))


def to_markdown(res) -> str:
    lines = [f"`{res['command']}`; {res['model']}; medians over {len({r['text'] for r in res['rows']})} texts.", "",
             "| method | config | bits/comp (all side info) | mean KL (bits/token) | top-1 agree | ΔCE (bits) | "
             "greedy agree /32 |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in _summary(res["rows"]):
        lines.append(f"| {r['method']} | `{json.dumps(r['config'], sort_keys=True)}` | {r['bits']:.3f} | "
                     f"{r['kl']:.4f} | {r['top1']:.3f} | {r['dce']:+.4f} | {r['greedy']:.0f} |")
    lines += ["", f"Peers: {res['peers']}."]
    return "\n".join(lines) + "\n"


def _plot(res, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    summ = _summary(res["rows"])
    for method in sorted({r["method"] for r in summ}):
        pts = sorted((r["bits"], r["kl"]) for r in summ if r["method"] == method)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=method)
    ax.axhline(0.01, color="grey", lw=0.8, ls="--")
    ax.axvline(2.0, color="grey", lw=0.8, ls="--")
    ax.set_yscale("log")
    ax.set_xlabel("bits per component (all side information)")
    ax.set_ylabel("mean KL(P_exact || P_compressed), bits/token")
    ax.set_title("SmolLM2-135M, kvz lossy tier: rate vs distortion")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
