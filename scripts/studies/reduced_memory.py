"""The memory a reduced SmolLM2 cache holds, against the entries it keeps (issue 14).

    KVCODEC_CORPUS=../shared/corpus python scripts/studies/reduced_memory.py [--checkout DIR] [--out FILE.json]

The first 2,048 tokens of the GPL prefilled by SmolLM2 in bfloat16; the cache reduced to 10 % and 25 % by KVzip
(allocations heads and ranks), SnapKV and the merge-reduce summaries (cluster), then 16 tokens generated on it.
For each: the entries kept per KV head, the bytes those entries take (keys and values, bfloat16), and the bytes
the reduced cache's layers hold: every tensor they reference, each storage counted once (a view costs its whole
storage), measured from outside the cache so that checkouts without ``ReducedCache.nbytes`` compare too
(``--checkout``: import kvcodec from there); and the time per generated token (greedy, 16 tokens after a fresh
reduction, median of 3, 2 threads): run two checkouts in alternation to compare them.
"""

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path


def held_bytes(cache) -> int:
    """``ReducedCache.nbytes()``, copied here on purpose: the checkout measured *before* the change (``--checkout``)
    has no such method, and both sides must be counted by the same code."""
    import torch

    seen = {}

    def visit(x):
        if isinstance(x, torch.Tensor):
            st = x.untyped_storage()
            seen[(st.device, st.data_ptr())] = st.nbytes()
        elif isinstance(x, (list, tuple)):
            for y in x:
                visit(y)

    for layer in cache.layers:
        for v in vars(layer).values():
            visit(v)
    return sum(seen.values())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkout", default=None)
    ap.add_argument("--file", default="legal_en_gpl-3.0.txt")
    ap.add_argument("--corpus", default=os.environ.get("KVCODEC_CORPUS", "../shared/corpus"))
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.checkout:
        sys.path.insert(0, os.path.abspath(args.checkout))
    import torch

    import kvcodec
    from kvcodec.models import load_model
    from kvcodec.reduction import REPEAT_PROMPT, replay_observation

    warnings.filterwarnings("ignore")
    torch.set_num_threads(2)
    model, tok = load_model("smollm2", dtype=torch.bfloat16)
    prompt = tok(REPEAT_PROMPT, add_special_tokens=False)["input_ids"]
    text = Path(args.corpus, args.file).read_text(encoding="utf-8", errors="replace")
    ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids[:, : args.tokens]
    with torch.no_grad():
        full = model(ids, use_cache=True).past_key_values
    full_bytes = sum(la.keys.nbytes + la.values.nbytes for la in full.layers)
    per_entry = full_bytes / ids.shape[1]  # bytes of one token's keys and values over every layer and head
    obs = replay_observation(full, model, ids, prompt)
    rows = []
    for keep in (0.1, 0.25):
        for method, kw in (("kvzip", {"allocation": "heads", "observation": obs}),
                           ("kvzip", {"allocation": "ranks", "observation": obs}),
                           ("snapkv", {}), ("cluster", {})):
            times = []
            for _ in range(3):
                red = kvcodec.reduce(full, model, keep=keep, method=method, tokens=ids, **kw)
                kept = red.counted()
                row = {"keep": keep, "method": method + (f",allocation={kw['allocation']}" if "allocation" in kw
                                                         else ""),
                       "kept_per_head": kept, "kept_bytes": kept * per_entry, "held_bytes": held_bytes(red)}
                t = time.perf_counter()
                with torch.no_grad():
                    model.generate(torch.cat([ids, ids[:, -1:]], 1), past_key_values=red, max_new_tokens=16,
                                   min_new_tokens=16, do_sample=False)
                times.append((time.perf_counter() - t) / 16)
            row["ms_per_token"] = 1e3 * statistics.median(times)
            row["held_bytes_after_16"] = held_bytes(red)
            row["held_vs_kept"] = row["held_bytes"] / row["kept_bytes"]
            rows.append(row)
            print(f"{keep:g} {row['method']:24s} kept {kept:7.1f}/head = {row['kept_bytes'] / 1e6:6.2f} MB, "
                  f"held {row['held_bytes'] / 1e6:6.2f} MB ({row['held_vs_kept']:.2f}x), after 16 tokens "
                  f"{row['held_bytes_after_16'] / 1e6:6.2f} MB; {row['ms_per_token']:.1f} ms/token; full cache "
                  f"{full_bytes / 1e6:.2f} MB")
    if args.out:
        Path(args.out).write_text(json.dumps({"file": args.file, "tokens": int(ids.shape[1]),
                                              "full_bytes": full_bytes, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
