"""Per-layer step allocation for the lossy tier, measured (BENCHMARKS.md, "tried and not shipped").

    python scripts/studies/allocation.py sensitivities [--text legal_en_gpl-3.0.txt] [--out sens.json]
    python scripts/studies/allocation.py apply --sens sens.json [--texts ...]     # held-out texts
    python scripts/studies/allocation.py fisher [--texts ...]

SmolLM2 fp32, 1,024-token prefix, 256 teacher-forced tokens, mean KL in bits (kvz eval's protocol,
without the greedy runs).  ``sensitivities``: every (layer, part) quantized at the 2-bit step, one of
them 2x coarser at a time (60 probes).  ``apply``: steps s_lp = s0 * g_lp with g ∝ sensitivity^-power
(geometric mean 1, clipped to [1/4, 4]) against equal steps (power 0), at two base steps.
``fisher``: g from a squared-gradient (Fisher) estimate of each slice's sensitivity instead.
The first token is kept exact in every run (the tier's default sink=1).
"""

import argparse
import json
import sys

import numpy as np
import torch

from kvcodec import api
from kvcodec.cache import KVCache, to_canonical
from kvcodec.codecs import vq_rans as quant
from kvcodec.lab.common import corpus_files
from kvcodec.lab.evaluate import prefix_case
from kvcodec.models import load_model
from kvcodec.tokens.plan import cache_kwarg


def setup(name, model, tok):
    files = {f.name: f for f in corpus_files()}
    prefix, cont, exact, comps = prefix_case(model, tok, files[name], 1024, 256)
    kv = to_canonical(exact)

    @torch.no_grad()
    def logp(k, v):
        c = KVCache(k, v).to_dynamic_cache()
        return torch.log_softmax(model(cont[:, :-1], use_cache=True, **{cache_kwarg(model): c}).logits[0].double(), -1)

    ref = logp(kv.keys, kv.values)

    def kl(k, v):
        lq = logp(k, v)
        return float(((ref.exp() * (ref - lq)).sum(-1) / np.log(2)).mean())

    return prefix, kv, comps, kl


def quantized(kv, params, steps):
    """Decoded keys, values and coded bytes with step steps[l, part] per slice (sink token exact)."""
    ks, vs, n = [], [], 0
    for li in range(kv.num_layers):
        for p, t, dst in ((0, kv.keys[li], ks), (1, kv.values[li], vs)):
            pl = quant.encode(t.float().numpy(), params, step=float(steps[li, p]), part=p, layer=li,
                              num_layers=kv.num_layers)
            out = torch.from_numpy(quant.decode(pl, tuple(t.shape), "float32").values)
            out[:, :, :1] = t[:, :, :1]
            dst.append(out)
            n += len(pl)
    return ks, vs, n


def gains(a, power):
    g = np.maximum(a, 5e-4) ** (-power)
    g = g / np.exp(np.log(g).mean())
    return np.clip(g, 0.25, 4)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["sensitivities", "apply", "fisher"])
    ap.add_argument("--text", default="legal_en_gpl-3.0.txt")
    ap.add_argument("--texts", nargs="*", default=["prose_en_austen_pride_and_prejudice.txt", "code_python_textwrap.py"])
    ap.add_argument("--sens", default="sens.json")
    ap.add_argument("--out", default="sens.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    model, tok = load_model("smollm2", dtype=torch.float32)
    params = quant.check_config({"bits": 2.0, "sink": 0})
    if args.what == "sensitivities":
        prefix, kv, comps, kl = setup(args.text, model, tok)
        s0 = api.inspect(api.encode(KVCache(kv.keys, kv.values), tier="lossy", bits=2.0))["codec"]["params"]["step"]
        L = kv.num_layers
        base = np.full((L, 2), s0)
        ks, vs, _ = quantized(kv, params, base)
        k0 = kl(ks, vs)
        sens = np.zeros((L, 2))
        for li in range(L):
            for p in (0, 1):
                steps = base.copy()
                steps[li, p] *= 2
                t = kv.keys[li] if p == 0 else kv.values[li]
                pl = quant.encode(t.float().numpy(), params, step=float(steps[li, p]), part=p, layer=li, num_layers=L)
                out = torch.from_numpy(quant.decode(pl, tuple(t.shape), "float32").values)
                out[:, :, :1] = t[:, :, :1]
                k2, v2 = list(ks), list(vs)
                (k2 if p == 0 else v2)[li] = out
                sens[li, p] = kl(k2, v2) - k0
                print(li, p, round(sens[li, p], 5), flush=True)
        json.dump({"text": args.text, "s0": s0, "base_kl": k0, "delta_kl": sens.tolist()}, open(args.out, "w"))
        return 0
    for name in args.texts:
        prefix, kv, comps, kl = setup(name, model, tok)
        if args.what == "apply":
            a = np.array(json.load(open(args.sens))["delta_kl"])
        else:  # Fisher: sum over vectors of |x|^2 |d log p / dx|^2, labels sampled from the model (4 draws)
            s, n = kv.seq_len, 64
            kk = [k[:, :, :s - n].clone().requires_grad_(True) for k in kv.keys]
            vv = [v[:, :, :s - n].clone().requires_grad_(True) for v in kv.values]
            out = model(prefix[:, s - n:], use_cache=True, **{cache_kwarg(model): KVCache(kk, vv).to_dynamic_cache()})
            lp = torch.log_softmax(out.logits[0].float(), -1)
            g = torch.Generator().manual_seed(0)
            w = np.zeros(2 * kv.num_layers)
            for rep in range(4):
                y = torch.multinomial(lp.exp().detach(), 1, generator=g).flatten()
                grads = torch.autograd.grad(-lp[torch.arange(n), y].sum(), kk + vv, retain_graph=rep < 3)
                w += [float(((t.detach() ** 2).sum(-1) * (gr ** 2).sum(-1)).sum()) for t, gr in zip(kk + vv, grads)]
            a = np.stack([w[:kv.num_layers], w[kv.num_layers:]], 1)
        for s0 in (1.0, 1.47):
            for power in (0.0, 0.25, 0.5):
                ks, vs, nb = quantized(kv, params, s0 * (gains(a, power) if power else np.ones((kv.num_layers, 2))))
                print(f"{name} {args.what} power {power} base step {s0}: {8 * nb / comps:.3f} bits/comp, "
                      f"KL {kl(ks, vs):.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
