"""Where the lossy tier's bits go, on one SmolLM2 cache (BENCHMARKS.md, "tried and not shipped").

    python scripts/studies/coding_gain.py [--text legal_en_gpl-3.0.txt]

1. Transform coding gain (high-rate theory, bits/component) of the vq_rans directions: after the
   random Hadamard rotation, in the raw basis, and in a per-head KLT (PCA) basis.
2. Temporal redundancy of the quantized indices at the 2-bit step: order-0 entropy, entropy given
   the previous token's index (what the coder's "prev" context exploits), and closed-loop DPCM from
   the previous reconstructed token (with and without the same context).
"""

import argparse

import numpy as np
import torch

from kvcodec.cache import to_canonical
from kvcodec.codecs import vq_rans as quant
from kvcodec.lab.common import corpus_files
from kvcodec.lab.evaluate import prefix_case
from kvcodec.models import load_model


def entropy(q):
    _, c = np.unique(q, return_counts=True)
    p = c / c.sum()
    return float(-(p * np.log2(p)).sum())


def cond_entropy(q, ctx):
    n = len(q)
    _, cj = np.unique(ctx.astype(np.int64) * 100000 + q, return_counts=True)
    _, cc = np.unique(ctx, return_counts=True)
    return float((-(cj * np.log2(cj / n)).sum() + (cc * np.log2(cc / n)).sum()) / n)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", default="legal_en_gpl-3.0.txt")
    ap.add_argument("--step", type=float, default=1.47, help="the values' step at ~2 bits/component")
    args = ap.parse_args()
    model, tok = load_model("smollm2", dtype=torch.float32)
    files = {f.name: f for f in corpus_files()}
    _, _, exact, _ = prefix_case(model, tok, files[args.text], 1024, 256)
    kv = to_canonical(exact)
    seed = quant.DEFAULTS["seed"]
    for part, tensors, st in (("keys", kv.keys, args.step / 8 ** 0.5), ("values", kv.values, args.step)):
        gain, red = [], []
        for li in range(0, kv.num_layers, 3):
            x = tensors[li][0].float().numpy()
            for h in range(x.shape[0]):
                v = x[h, 1:]
                d = v.shape[1]
                u = v / np.linalg.norm(v, axis=1, keepdims=True)
                _, z = quant.directions(v, seed)

                def g(c):
                    var = np.var(c, axis=0) + 1e-12
                    return 0.5 * np.log2(var.mean() / np.exp(np.log(var).mean()))

                ev = np.linalg.eigvalsh(u.T @ u / len(u)) + 1e-12
                gain.append((g(z), g(u), 0.5 * np.log2(ev.mean() / np.exp(np.log(ev).mean()))))
                q = np.rint(z / np.float32(st)).astype(np.int64)
                rec, r = np.zeros(d, np.float32), []
                for t in range(len(z)):
                    dq = np.rint((z[t] - rec) / np.float32(st))
                    r.append(dq)
                    rec = rec + dq * np.float32(st)
                r = np.array(r).astype(np.int64)
                red.append((np.mean([entropy(q[:, i]) for i in range(d)]),
                            np.mean([cond_entropy(q[1:, i], q[:-1, i]) for i in range(d)]),
                            np.mean([entropy(r[:, i]) for i in range(d)]),
                            np.mean([cond_entropy(r[1:, i], r[:-1, i]) for i in range(d)])))
        print(f"{part}: coding gain (bits/comp) rotated {np.mean([a[0] for a in gain]):.2f}, raw "
              f"{np.mean([a[1] for a in gain]):.2f}, per-head KLT {np.mean([a[2] for a in gain]):.2f}")
        m = np.mean(red, 0)
        print(f"{part}: index entropy H(q) {m[0]:.3f}, H(q | previous q) {m[1]:.3f}, DPCM H(d) {m[2]:.3f}, "
              f"H(d | previous d) {m[3]:.3f} bits")


if __name__ == "__main__":
    main()
