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

Results: ``OUT/bench_lossy.json``, ``OUT/bench_lossy.md``, ``OUT/bench_lossy.svg`` (:mod:`kvcodec.lab.plots`) and,
with matplotlib installed (``pip install kvz[bench]``), ``OUT/bench_lossy.png``.
"""

from __future__ import annotations

import json
import platform
import statistics
from pathlib import Path

import torch

from .common import missing_corpus, write_report
from .plots import lossy_plot

CONFIGS = ([{"quantizer": "uniform", "bits": b} for b in (1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0)]
           + [{"quantizer": "lloyd", "lloyd_bits": b} for b in (2, 3, 4)]
           + [{"quantizer": "kivi", "kivi_bits": b, "group": 32} for b in (2, 3, 4)]
           + [{"quantizer": "cachegen", "cachegen_bins": bins} for bins in ([16, 8], [32, 16], [64, 32])]
           + [{"quantizer": "weighted", "bits": b} for b in (1.5, 2.0, 2.5, 3.0, 3.5)]
           + [{"quantizer": "weighted", "bits": b, "predictors": True} for b in (1.5, 1.95, 2.0, 2.5, 3.0)])
#: the predictors (cross-layer prediction, kvcodec.calibrate_predictors) are fitted on up to this many tokens of
#: each corpus file that is not evaluated
PREDICTOR_TOKENS = 2048
TEXTS = ["legal_en_gpl-3.0.txt", "prose_en_austen_pride_and_prejudice.txt", "code_python_textwrap.py"]
#: quantizer "weighted" is calibrated (kvcodec.calibrate) on the first 128 tokens of this corpus file, a genre
#: none of the evaluated texts has (the embedded default text is the prose text's own first chapters)
CALIBRATION = "data_iso_3166-1.json"


def _fp8(kv):
    from ..cache import KVCache

    def q(t):
        x = t.float()  # float32 arithmetic: a float16 cache cannot hold the clamp
        s = x.abs().amax().clamp_min(1e-30) / 448.0
        return ((x / s).to(torch.float8_e4m3fn).float() * s).to(t.dtype)

    return KVCache([q(t) for t in kv.keys], [q(t) for t in kv.values])


def _minmax_token(kv, bits=4):
    from ..cache import KVCache

    def q(t):
        x = t.float()  # float32 arithmetic: a float16 cache cannot hold the clamp
        mn, mx = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        sc = ((mx - mn) / (2 ** bits - 1)).clamp_min(1e-30)
        return (torch.round((x - mn) / sc) * sc + mn).to(t.dtype)

    return KVCache([q(t) for t in kv.keys], [q(t) for t in kv.values])


def run_lossy_bench(args) -> int:
    from .. import api
    from ..cache import to_canonical
    from ..dtypes import parse
    from ..models import load_model
    from .common import corpus_files
    from .evaluate import evaluate_cache, prefix_case

    cache_dtype = getattr(args, "cache_dtype", "fp32")
    dt = parse(cache_dtype)
    model, tok = load_model("smollm2", dtype=dt.torch)
    files = {f.name: f for f in corpus_files(args.corpus)}
    if not files:
        return missing_corpus("kvz bench --lossy")
    texts = args.genres or TEXTS
    from ..calibrate import calibrate
    from ..models import tokenize

    cal = CALIBRATION if CALIBRATION not in texts else next(f for f in sorted(files) if f not in texts)
    profile = calibrate(model, tokenize(tok, files[cal].read_text(encoding="utf-8"), 128))
    pred_files = [f for f in sorted(files) if f not in texts]
    pred = None
    if any(c.get("predictors") for c in CONFIGS):
        import time

        from ..predict import calibrate_predictors

        t0 = time.perf_counter()
        pred = calibrate_predictors(model, [files[f].read_text(encoding="utf-8") for f in pred_files],
                                    tokenizer=tok, profile=profile, tokens=PREDICTOR_TOKENS)
        pred_seconds = time.perf_counter() - t0
        print(f"predictors: {len(pred.to_bytes())} bytes, fitted on {pred.meta['tokens']} tokens of "
              f"{len(pred_files)} texts in {pred_seconds:.0f} s", flush=True)
    rows = []
    for name in texts:
        prefix, cont, exact, comps = prefix_case(model, tok, files[name], args.prefix, args.continuation)
        kv = to_canonical(exact)
        for label, build, rate in (("fp8 e4m3 per tensor (reference, not entropy-coded)", _fp8, 8.0),
                                   ("per-token min-max 4-bit (reference, not entropy-coded)", _minmax_token, 4.5)):
            r = evaluate_cache(model, tok, exact, build(kv).to_dynamic_cache(), prefix, cont)
            r.update(text=name, method=label, config={}, bits_per_component=rate, header_bytes=0)
            rows.append(r)
        for b0 in (2, 3):
            rows.append(_surprisal_adaptive(model, tok, exact, kv, prefix, cont, comps, name, b0))
        if args.peers is not None:
            rows += _peer_rows(args.peers, model, tok, exact, kv, prefix, cont, name)
        for cfg in CONFIGS:
            extra = {"profile": profile} if cfg["quantizer"] == "weighted" else {}
            if cfg.get("predictors"):
                extra["predictors"] = pred
            data = api.encode(exact, tier="lossy", **{k: v for k, v in cfg.items() if k != "predictors"}, **extra)
            info = api.inspect(data)
            kvs = [s for s in info["sections"] if s["type"] == "kv"]
            payload = sum(s["bytes"] for s in kvs)
            fixed = None
            if all(s.get("coding") and "fixed_width_bits_per_component" in s["coding"] for s in kvs):
                fixed = sum(s["coding"]["fixed_width_bits_per_component"] * s["components"] for s in kvs) / comps
            r = evaluate_cache(model, tok, exact, api.decode(data, predictors=pred), prefix, cont)
            method = f"kvz {cfg['quantizer']}" + (" + predictors" if cfg.get("predictors") else "")
            r.update(text=name, method=method, config=cfg,
                     bits_per_component=8 * payload / comps, header_bytes=len(data) - payload,
                     fixed_width_bits_per_component=fixed)
            rows.append(r)
            print(f"{name} {json.dumps(cfg)}: {r['bits_per_component']:.3f} bits/comp, KL {r['mean_kl_bits']:.4f}, "
                  f"top-1 {r['top1_agreement']:.3f}", flush=True)
    res = {"command": f"kvz bench --lossy --prefix {args.prefix} --continuation {args.continuation}"
                      + (f" --cache-dtype {cache_dtype}" if cache_dtype != "fp32" else ""),
           "model": f"SmolLM2-135M-Instruct ({dt.name})", "machine": platform.machine(), "rows": rows,
           "calibration": f"quantizer weighted: kvcodec.calibrate on the first 128 tokens of {cal}",
           "predictors": None if pred is None else {
               "bytes": len(pred.to_bytes()), "sha256": pred.identity, "tokens": pred.meta["tokens"],
               "texts": pred_files, "seconds": round(pred_seconds, 1),
               "bits_per_component_if_in_one_file": round(8 * len(pred.to_bytes()) / comps, 3)},
           "peers": _peer_note(args.peers)}
    stem = "bench_lossy" + (f"_{cache_dtype}" if cache_dtype != "fp32" else "")  # one dtype does not overwrite another
    out = write_report(args.out, stem, res, to_markdown(res))
    _plot(res, out / f"{stem}.png")
    lossy_plot(res, out / f"{stem}.svg")  # without matplotlib too
    return 0


def _surprisal_adaptive(model, tok, exact, kv, prefix, cont, comps, text, b0: int) -> dict:
    """The seed paper's surprisal-adaptive allocation b_i = max(1, floor(b0 * h_i / mean h)) (h_i: the
    model's surprisal of token i), applied to the rotated uniform quantizer: token i gets the step
    ``step * 2**(b0 - b_i)`` (one bit = half the step).  Tokens with the same b_i are coded together as one
    vq_rans slice per (layer, part), so the rate is the real coded size.  A study (the format has one step
    per slice): compare it with the uniform rows at the same rate."""
    import math

    from ..cache import KVCache
    from ..codecs import vq_rans as quant
    from .evaluate import evaluate_cache

    with torch.no_grad():
        lp = torch.log_softmax(model(prefix).logits[0, :-1].double(), -1)
    h = -lp[torch.arange(prefix.shape[1] - 1), prefix[0, 1:]] / math.log(2)
    h = torch.cat([h.mean().reshape(1), h])  # token 0 has no prediction: the mean
    b = torch.clamp(torch.floor(b0 * h / h.mean()), min=1, max=b0 + 4).long()  # cap: 12-bit index symbols
    params = quant.check_config({"bits": float(b0), "sink": 0})
    step = quant.global_step(kv.keys + kv.values, params)
    keys, values, nbytes = [], [], 0
    for li in range(kv.num_layers):
        for part, t, dst in ((0, kv.keys[li], keys), (1, kv.values[li], values)):
            out = torch.empty_like(t, dtype=torch.float32)
            for bi in sorted(set(b.tolist())):
                idx = (b == bi).nonzero().flatten()
                x = t[:, :, idx].float().numpy()
                payload = quant.encode(x, params, step=step * 2.0 ** (b0 - bi), part=part, layer=li,
                                       num_layers=kv.num_layers)
                nbytes += len(payload)
                out[:, :, idx] = torch.from_numpy(quant.decode(payload, x.shape, "float32").values)
            dst.append(out.to(t.dtype))
    r = evaluate_cache(model, tok, exact, KVCache(keys, values).to_dynamic_cache(), prefix, cont)
    r.update(text=text, method="study: surprisal-adaptive bits (uniform, rotated)",
             config={"b0": b0, "rule": "b_i = min(b0 + 4, max(1, floor(b0 h_i / mean h)))"},
             mean_b_i=float(b.double().mean()), bits_per_component=8 * nbytes / comps, header_bytes=0)
    print(f"{text} surprisal-adaptive b0={b0}: {r['bits_per_component']:.3f} bits/comp, KL {r['mean_kl_bits']:.4f}",
          flush=True)
    return r


PEERS = ["quanto", "hqq", "fp8", "turboquant", "fused-turboquant", "tiny-turboquant", "lmcache"]
PEER_VENV = {"fp8": "quanto"}  # transformers' fp8 layer runs in the quanto venv (same transformers)
#: the peer runners (scripts/peers in the checkout)
PEER_SCRIPTS = Path(__file__).resolve().parents[2] / "scripts" / "peers"


def peers_root() -> Path:
    import os

    return Path(os.environ.get("KVCODEC_PEERS", Path.home() / ".cache" / "kvcodec" / "peers"))


def _peer_note(peers) -> str:
    if peers is None:
        return ("not run (add --peers after scripts/peers/setup.sh; ../shared/design/peers.md has their rates "
                "under a cross-entropy protocol)")
    return (f"run in their own venvs under {peers_root()} (scripts/peers/setup.sh, scripts/peers/runner.py); "
            "bits/comp as each peer stores its indices and side information (formula per row)")


def _peer_rows(peers, model, tok, exact, kv, prefix, cont, text) -> list[dict]:
    """Each peer compresses the same exact cache in its own venv (scripts/peers/runner.py); the quality of
    its reconstruction is measured here with the same protocol.  A peer that is not set up or fails gets a
    row saying why."""
    import subprocess
    import tempfile

    from safetensors.torch import load_file, save_file

    from ..cache import KVCache
    from .evaluate import evaluate_cache

    runner = PEER_SCRIPTS / "runner.py"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "in.safetensors"
        save_file({**{f"keys.{i}": k.float().contiguous() for i, k in enumerate(kv.keys)},
                   **{f"values.{i}": v.float().contiguous() for i, v in enumerate(kv.values)}}, str(src))
        for peer in peers or PEERS:
            py = peers_root() / PEER_VENV.get(peer, peer) / "bin" / "python"
            base = {"text": text, "method": f"peer {peer}", "header_bytes": 0}
            if not runner.exists():
                rows.append({**base, "config": {"error": f"{runner} is missing (run from a checkout)"}})
                continue
            if not py.exists():
                rows.append({**base, "config": {"error": f"not set up: scripts/peers/setup.sh {peer}"}})
                continue
            out = Path(tmp) / peer
            proc = subprocess.run([str(py), str(runner), peer, str(src), str(out)], capture_output=True, text=True,
                                  timeout=3600)
            listing = out / f"{peer}.json"
            if proc.returncode or not listing.exists():
                rows.append({**base, "config": {"error": (proc.stderr or proc.stdout).strip()[-300:]}})
                continue
            for r in json.loads(listing.read_text()):
                cfg = {"config": r["config"], "version": r["version"], "storage": r["storage"]}
                if "error" in r:
                    rows.append({**base, "config": {**cfg, "error": r["error"]}})
                    continue
                rec = load_file(str(out / r["file"]))
                n = len(kv.keys)
                comp = KVCache([rec[f"keys.{i}"].to(kv.dtype) for i in range(n)],
                               [rec[f"values.{i}"].to(kv.dtype) for i in range(n)])
                ev = evaluate_cache(model, tok, exact, comp.to_dynamic_cache(), prefix, cont)
                ev.update(base, config=cfg, bits_per_component=r["bits_per_component"], seconds=r["seconds"])
                rows.append(ev)
                print(f"{text} peer {peer} {r['config']}: {r['bits_per_component']:.3f} bits/comp, "
                      f"KL {ev['mean_kl_bits']:.4f}", flush=True)
    return rows


def _summary(rows):
    by = {}
    for r in rows:
        if "mean_kl_bits" not in r:  # a peer that could not run: listed apart
            continue
        by.setdefault((r["method"], json.dumps(r["config"], sort_keys=True)), []).append(r)
    out = []
    for (method, cfg), rs in by.items():
        out.append({"method": method, "config": json.loads(cfg), "texts": len(rs),
                    "bits": statistics.median(r["bits_per_component"] for r in rs),
                    "kl": statistics.median(r["mean_kl_bits"] for r in rs),
                    "kl_mean": statistics.fmean(r["mean_kl_bits"] for r in rs),
                    "top1": statistics.median(r["top1_agreement"] for r in rs),
                    "dce": statistics.median(r["ce_diff_bits"] for r in rs),
                    "greedy": statistics.median(r["greedy_agreement"] for r in rs),
                    "fixed": (statistics.median(r["fixed_width_bits_per_component"] for r in rs)
                              if all(r.get("fixed_width_bits_per_component") for r in rs) else None)})
    return sorted(out, key=lambda r: (r["method"], r["bits"]))


def to_markdown(res) -> str:
    lines = [f"`{res['command']}`; {res['model']}; medians over {len({r['text'] for r in res['rows']})} texts.", "",
             "| method | config | bits/comp (all side info) | same indices fixed-width | mean KL (bits/token) | "
             "top-1 agree | ΔCE (bits) | greedy agree /32 |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    peers = {}
    for r in _summary(res["rows"]):
        fixed = f"{r['fixed']:.3f}" if r.get("fixed") else ""
        cfg = r["config"]
        if r["method"].startswith("peer "):  # the peer's own configuration; version and storage below
            peers[r["method"]] = (cfg["version"], cfg.get("storage", ""))
            label = cfg["config"]
        else:
            label = f"`{json.dumps(cfg, sort_keys=True)}`"
        lines.append(f"| {r['method']} | {label} | {r['bits']:.3f} | {fixed} | "
                     f"{r['kl']:.4f} | {r['top1']:.3f} | {r['dce']:+.4f} | {r['greedy']:.0f} |")
    if res.get("calibration"):
        lines += ["", f"Calibration: {res['calibration']} (the profile is not stored: the file carries the "
                  "per-channel steps, counted in bits/comp)."]
    pr = res.get("predictors")
    if pr:
        lines += ["", f"Predictors (`kvz weighted + predictors`): `kvcodec.calibrate_predictors` on "
                  f"{pr['tokens']:,} tokens of {len(pr['texts'])} corpus files none of the evaluated texts is "
                  f"({', '.join(pr['texts'])}), in {pr['seconds']} s. They are a per-model profile, stored "
                  f"once per store namespace and not counted in bits/comp: {pr['bytes']:,} bytes "
                  f"(SHA-256 {pr['sha256'][:16]}…), which inside one file of this cache would add "
                  f"{pr['bits_per_component_if_in_one_file']} bits per component."]
    if peers:
        lines += ["", "Peer versions and how their bits/comp are counted:", ""]
        lines += [f"- {m} ({v}): {st}" for m, (v, st) in sorted(peers.items())]
    failed = {(r["method"], r["config"].get("config", ""), r["config"]["error"]) for r in res["rows"]
              if "mean_kl_bits" not in r}
    if failed:
        lines += ["", "Peers that could not run:", ""]
        lines += [f"- {m} {c}: {e}" for m, c, e in sorted(failed)]
    lines += ["", f"Peers: {res['peers']}."]
    return "\n".join(lines) + "\n"


def _plot(res, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(10, 5))
    summ = _summary(res["rows"])

    def series(r):  # one curve per quantizer family (turboquant's IP variant apart from its MSE one)
        cfg = r["config"].get("config", "") if isinstance(r["config"], dict) else ""
        return r["method"] + (" (IP + QJL)" if "TurboQuantIP" in cfg else "")

    colors = plt.get_cmap("tab20").colors
    for i, name in enumerate(sorted({series(r) for r in summ})):
        pts = sorted((r["bits"], r["kl"]) for r in summ if series(r) == name)
        kvz = name.startswith("kvz")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-" if kvz else "s--", color=colors[i % len(colors)],
                lw=2 if "predictors" in name else 1.2, ms=5 if kvz else 4, label=name)
    ax.axhline(0.01, color="grey", lw=0.8, ls="--")
    ax.axvline(2.0, color="grey", lw=0.8, ls="--")
    ax.set_yscale("log")
    ax.set_xlabel("bits per component (all side information)")
    ax.set_ylabel("mean KL(P_exact || P_compressed), bits/token")
    ax.set_title("SmolLM2-135M, kvz lossy tier: rate vs distortion")
    ax.legend(fontsize=6.5, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
