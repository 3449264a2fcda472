"""Our reducers and kvpress's presses on the same long-context items, side by side (BENCHMARKS "kvpress side by
side").

    python scripts/peers/kvpress_compare.py --ours docs/bench_reduce.json --kvpress docs/kvpress_reduce.json

``--ours``: what ``kvz bench --reduce`` wrote (its ``rows``); ``--kvpress``: what ``scripts/peers/kvpress_reduce.py``
wrote on the items ``kvz bench --reduce --export-items`` exported from the same run's settings.  Items are matched
by (file, kind, depth, question order within the file).  Per keep and method: the number of items, the mean
change of the answer's log2-likelihood against each side's own full cache with a 95 % bootstrap interval (2,000
resamples, seed 0 in every cell), needle exact matches, and the entries kept per KV head.  Also the agreement of
the two full caches' answer log-likelihoods (two transformers versions).  Prints a Markdown table.
"""

import argparse
import json
from collections import defaultdict

import numpy as np


def keyed(rows):
    """{(file, kind, depth, n-th of that kind/depth in the file): {(method, keep): row}}"""
    seen = defaultdict(int)
    out = defaultdict(dict)
    order = {}
    for r in rows:
        base = (r["file"], r["kind"], r["depth"])
        if (base, r["method"], r["keep"]) not in order:
            order[(base, r["method"], r["keep"])] = 0
        n = order[(base, r["method"], r["keep"])]
        order[(base, r["method"], r["keep"])] += 1
        seen[base] = max(seen[base], n + 1)
        out[base + (n,)][(r["method"], r["keep"])] = r
    return out


def ci(x, rng):
    x = np.asarray(x, dtype=np.float64)
    boots = rng.choice(x, size=(2000, x.size), replace=True).mean(axis=1)
    return x.mean(), np.percentile(boots, 2.5), np.percentile(boots, 97.5)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ours", required=True)
    ap.add_argument("--kvpress", required=True)
    ap.add_argument("--methods", nargs="+", default=["cluster", "snapkv", "streaming"])
    ap.add_argument("--pivot", action="store_true", help="one row per method, one column per keep")
    args = ap.parse_args()
    ours = keyed(json.load(open(args.ours))["rows"])
    kvp = keyed(json.load(open(args.kvpress)))
    common = sorted(set(ours) & set(kvp))
    keeps = sorted({k for item in kvp.values() for (m, k) in item if m != "full"})
    presses = sorted({m for item in kvp.values() for (m, k) in item if m != "full"})
    full_diff = [kvp[i][("full", 1.0)]["answer_bits"] - ours[i][("full", 1.0)]["answer_bits"] for i in common]
    print(f"{len(common)} items in both runs; full-cache answer log2-likelihood, kvpress's run minus ours: mean "
          f"{np.mean(full_diff):+.3f} bits, largest |difference| {np.max(np.abs(full_diff)):.3f}\n")
    arms = [("ours", m) for m in args.methods] + [("kvpress", p) for p in presses]
    cells = {}
    if not args.pivot:
        print("| keep | method | items | entries per head | mean Δ bits vs its full cache [95 % CI] | needle EM |")
        print("|---:|---|---:|---:|---|---:|")
    for keep in keeps:
        for side, m in arms:
            src = ours if side == "ours" else kvp
            d, ent, em, nn = [], [], 0, 0
            for i in common:
                row = src[i].get((m, keep))
                if row is None:
                    continue
                d.append(row["answer_bits"] - src[i][("full", 1.0)]["answer_bits"])
                ent.append(row["entries"])
                if row["kind"] == "needle":
                    nn += 1
                    em += bool(row["exact"])
            if not d:
                continue
            mean, lo, hi = ci(d, np.random.default_rng(0))  # each cell's resamples seeded alike
            cells[(m, keep)] = f"{mean:+.2f} [{lo:+.2f}, {hi:+.2f}], {em}/{nn}"
            if not args.pivot:  # kvpress rows are named kvpress-<press>
                print(f"| {keep} | {m} | {len(d)} | {int(np.median(ent))} | {mean:+.2f} [{lo:+.2f}, {hi:+.2f}] | "
                      f"{em}/{nn} |")
    if args.pivot:
        print("| method | " + " | ".join(f"keep {k}: Δ bits [95 % CI], needles" for k in keeps) + " |")
        print("|---|" + "---|" * len(keeps))
        for _, m in arms:
            print(f"| {m} | " + " | ".join(cells.get((m, k), "-") for k in keeps) + " |")


if __name__ == "__main__":
    main()
