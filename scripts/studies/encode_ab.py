"""Whole encodes of one checkout, for same-session A/Bs of the encoder (issue 16; BENCHMARKS "Encode speed").

    python scripts/studies/encode_ab.py CHECKOUT OUT.json [--text prose_en_austen_pride_and_prejudice.txt]
        [--repeats 5] [--best] [--lossless-only]

Imports ``kvcodec`` from ``CHECKOUT`` (a git worktree of the commit to measure), builds SmolLM2's cache of the
text's first 2,048 tokens and times ``kvcodec.encode`` on one thread (median of ``--repeats`` after a warm-up, or
with ``--best`` the fastest): the lossless tier on the bf16 and fp32 caches, the lossy tier at 2 and 3 bits on
the bf16 cache (not with ``--lossless-only``).  Writes seconds, MB/s of
raw cache and the encoded size per arm.  For an A/B, run it for the two checkouts in alternation, several times,
and compare the same arms (the sizes must be equal when the change keeps the bytes):

    git worktree add /tmp/old <commit>; git worktree add /tmp/new HEAD
    for i in 1 2; do python scripts/studies/encode_ab.py /tmp/old old$i.json; python scripts/studies/encode_ab.py /tmp/new new$i.json; done
"""

import argparse
import json
import os
import sys
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkout")
    ap.add_argument("out")
    ap.add_argument("--text", default="prose_en_austen_pride_and_prejudice.txt")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--best", action="store_true", help="report the fastest encode instead of the median")
    ap.add_argument("--lossless-only", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("KVCODEC_THREADS", "1")
    sys.path.insert(0, os.path.abspath(args.checkout))
    import numpy as np
    import torch

    import kvcodec
    from kvcodec.lab.common import corpus_files
    from kvcodec.models import load_model, prefill, tokenize

    torch.set_num_threads(1)
    model, tok = load_model("smollm2")
    path = {f.name: f for f in corpus_files()}[args.text]
    ids = tokenize(tok, path.read_text(encoding="utf-8"), 2048)
    res = {"checkout": args.checkout, "kvcodec": kvcodec.__file__, "text": args.text}
    for dname, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        kv = prefill(model, ids, dt)
        raw = sum(layer.keys.numel() + layer.values.numel() for layer in kv.layers) * (2 if dname == "bf16" else 4)
        arms = [("lossless", {})]
        if dname == "bf16" and not args.lossless_only:
            arms += [("lossy 2 bits", {"tier": "lossy", "bits": 2.0}), ("lossy 3 bits", {"tier": "lossy", "bits": 3.0})]
        for name, opts in arms:
            data = kvcodec.encode(kv, threads=1, **opts)
            ts = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                data = kvcodec.encode(kv, threads=1, **opts)
                ts.append(time.perf_counter() - t0)
            s = float(np.min(ts) if args.best else np.median(ts))
            res[f"{dname} {name}"] = {"s": s, "bytes": len(data), "mb_s": raw / s / 1e6}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(args.checkout, {k: round(v["mb_s"], 1) for k, v in res.items() if isinstance(v, dict)})


if __name__ == "__main__":
    main()
