"""``kvz eval``: how much a lossy cache changes what the model does next.

Protocol (rerun with the command line in the output):

1. For each text, the first ``prefix`` tokens are prefilled (SmolLM2, the
   chosen dtype) into the *exact* cache; the *compressed* cache is
   ``decode(encode(exact, tier="lossy", **options))``.
2. The next ``continuation`` tokens of the text are fed teacher-forced, in one
   forward call, on top of each cache (the continuation's own keys and values
   are computed exactly in both runs: only the stored prefix differs).
3. Per continuation position: the next-token distributions P (exact) and Q
   (compressed).  Reported: **mean KL(P || Q) in bits** (the primary measure),
   top-1 agreement, the cross-entropy of the true next tokens under each
   (difference), and per layer the relative error ``|a_q - a_p| / |a_p|`` of the
   attention output (``self_attn`` module output) over the continuation.
4. Greedy continuation: 32 tokens generated greedily from each cache; the
   length of the common prefix.

Rates are the file's bits per stored component (all side information and the
container included) over the prefix cache.
"""

from __future__ import annotations

import copy
import json
import platform
import statistics
from pathlib import Path

import torch

from ..errors import ConfigError
from .common import missing_corpus, write_report

DEFAULT_TEXTS = ["legal_en_gpl-3.0.txt", "prose_en_austen_pride_and_prejudice.txt", "code_python_textwrap.py"]


@torch.no_grad()
def _teacher_forced(model, cache, cont, capture: bool):
    from ..tokens.plan import cache_kwarg

    outs = {}
    hooks = []
    if capture:
        for i, layer in enumerate(model.model.layers):
            hooks.append(layer.self_attn.register_forward_hook(
                lambda m, a, o, i=i: outs.__setitem__(i, (o[0] if isinstance(o, tuple) else o).float().clone())))
    try:
        logits = model(cont, use_cache=True, **{cache_kwarg(model): cache}).logits[0].double()
    finally:
        for hk in hooks:
            hk.remove()
    return torch.log_softmax(logits, dim=-1), outs


@torch.no_grad()
def _greedy(model, ids, cache, n, eos):
    from ..tokens.plan import cache_kwarg

    out = model.generate(ids, **{cache_kwarg(model): cache}, max_new_tokens=n, do_sample=False, pad_token_id=eos)
    return out[0, ids.shape[1]:]


def prefix_case(model, tok, path, prefix: int, continuation: int):
    """(prefix ids, continuation ids, exact prefix cache, stored components) for one corpus text."""
    from ..cache import to_canonical
    from ..models import prefill, tokenize

    ids = tokenize(tok, path.read_text(encoding="utf-8"), prefix + continuation + 1)
    prefix_ids, cont = ids[:, :prefix], ids[:, prefix:]
    exact = prefill(model, prefix_ids)
    kv = to_canonical(exact)
    return prefix_ids, cont, exact, sum(t.numel() for t in kv.keys + kv.values)


def evaluate_cache(model, tok, exact_cache, compressed_cache, prefix_ids, cont_ids) -> dict:
    """All measures for one (exact, compressed) pair; caches are not modified."""
    lp, ap = _teacher_forced(model, copy.deepcopy(exact_cache), cont_ids[:, :-1], True)
    lq, aq = _teacher_forced(model, copy.deepcopy(compressed_cache), cont_ids[:, :-1], True)
    kl = (lp.exp() * (lp - lq)).sum(-1) / torch.log(torch.tensor(2.0, dtype=torch.float64))
    target = cont_ids[0, 1:]
    ce_p = float(-lp[torch.arange(target.numel()), target].mean() / torch.log(torch.tensor(2.0)))
    ce_q = float(-lq[torch.arange(target.numel()), target].mean() / torch.log(torch.tensor(2.0)))
    full = torch.cat([prefix_ids, cont_ids[:, :1]], dim=1)
    g_p = _greedy(model, full, copy.deepcopy(exact_cache), 32, tok.eos_token_id)
    g_q = _greedy(model, full, copy.deepcopy(compressed_cache), 32, tok.eos_token_id)
    agree = 0
    for a, b in zip(g_p.tolist(), g_q.tolist()):
        if a != b:
            break
        agree += 1
    attn = [float((aq[i] - ap[i]).norm() / ap[i].norm().clamp_min(1e-30)) for i in sorted(ap)]
    return {"mean_kl_bits": float(kl.mean()), "max_kl_bits": float(kl.max()),
            "top1_agreement": float((lp.argmax(-1) == lq.argmax(-1)).double().mean()),
            "ce_exact_bits": ce_p, "ce_compressed_bits": ce_q, "ce_diff_bits": ce_q - ce_p,
            "greedy_agreement": agree, "attention_rel_error": attn}


def run_eval(args) -> int:
    from .. import api, dtypes
    from ..models import load_model
    from .common import corpus_files

    dtype = dtypes.parse(args.dtype).torch
    model, tok = load_model("smollm2", dtype=dtype)
    files = {f.name: f for f in corpus_files(args.corpus)}
    if not files and not args.texts:
        return missing_corpus("kvz eval")
    texts = args.texts or DEFAULT_TEXTS
    configs = [json.loads(c) for c in args.config] if args.config else [{"bits": args.bits}]
    extra = _weighted_options(args, model, tok, configs)
    rows = []
    for name in texts:
        path = files.get(name) or Path(name)  # a corpus file's name, or any text file
        if not path.is_file():
            raise ConfigError(f"kvz eval: {name} is neither a corpus file nor a file")
        prefix, cont, exact, comps = prefix_case(model, tok, path, args.prefix, args.continuation)
        for cfg in configs:
            opts = {k: v for k, v in cfg.items() if k != "predictors"}
            if cfg.get("quantizer") == "weighted":
                opts["profile"] = extra["profile"]
                if cfg.get("predictors"):
                    opts["predictors"] = extra["predictors"]
            data = api.encode(exact, tier="lossy", **opts)
            comp = api.decode(data, predictors=opts.get("predictors"))
            r = evaluate_cache(model, tok, exact, comp, prefix, cont)
            r.update(text=name, config=cfg, bits_per_component=8 * len(data) / comps,
                     payload_bits_per_component=8 * sum(s["bytes"] for s in api.inspect(data)["sections"]) / comps)
            rows.append(r)
            print(f"{name} {json.dumps(cfg)}: {r['bits_per_component']:.3f} bits/comp, KL {r['mean_kl_bits']:.4f} bits, "
                  f"top-1 {r['top1_agreement']:.3f}, dCE {r['ce_diff_bits']:+.4f}, greedy {r['greedy_agreement']}/32",
                  flush=True)
    res = {"command": "kvz eval " + " ".join(getattr(args, "argv", []) or []), "model": f"SmolLM2-135M-Instruct ({args.dtype})",
           "prefix": args.prefix, "continuation": args.continuation, "machine": platform.machine(), "rows": rows}
    write_report(args.out, "eval", res, to_markdown(res))
    return 0


def _weighted_options(args, model, tok, configs) -> dict:
    """The profile (``--profile``, else calibrated on the embedded text) and predictors (``--predictors``) of
    the configurations with quantizer ``weighted`` (``"predictors": true`` in a configuration uses them)."""
    out = {}
    if any(c.get("quantizer") == "weighted" for c in configs):
        from ..calibrate import Profile, calibrate

        out["profile"] = Profile.load(args.profile) if getattr(args, "profile", None) else calibrate(model,
                                                                                                    tokenizer=tok)
    if any(c.get("predictors") for c in configs):
        if not getattr(args, "predictors", None):
            raise ConfigError('a configuration with "predictors": true needs --predictors FILE (kvz calibrate)')
        from ..predict import Predictors

        out["predictors"] = Predictors.load(args.predictors)
    return out


def summarize(rows: list[dict]) -> list[dict]:
    """Per configuration: medians over texts."""
    by = {}
    for r in rows:
        by.setdefault(json.dumps(r["config"], sort_keys=True), []).append(r)
    out = []
    for key, rs in by.items():
        out.append({"config": json.loads(key), "texts": len(rs),
                    "bits_per_component": statistics.median(r["bits_per_component"] for r in rs),
                    "mean_kl_bits": statistics.median(r["mean_kl_bits"] for r in rs),
                    "top1_agreement": statistics.median(r["top1_agreement"] for r in rs),
                    "ce_diff_bits": statistics.median(r["ce_diff_bits"] for r in rs),
                    "greedy_agreement": statistics.median(r["greedy_agreement"] for r in rs)})
    return sorted(out, key=lambda r: r["bits_per_component"])


def to_markdown(res: dict) -> str:
    lines = [f"{res['model']}, prefix {res['prefix']} tokens, {res['continuation']} continuation tokens "
             "teacher-forced; medians over texts.", "",
             "| config | bits/comp (all included) | mean KL (bits) | top-1 agree | ΔCE (bits) | greedy agree /32 |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in summarize(res["rows"]):
        lines.append(f"| `{json.dumps(r['config'], sort_keys=True)}` | {r['bits_per_component']:.3f} | "
                     f"{r['mean_kl_bits']:.4f} | {r['top1_agreement']:.3f} | {r['ce_diff_bits']:+.4f} | "
                     f"{r['greedy_agreement']:.0f} |")
    return "\n".join(lines) + "\n"
