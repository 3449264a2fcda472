"""Bytes and held entries of a KVzip-reduced cache: heads of a layer keeping different numbers (allocation
``heads``, format 1.8) against every head of a layer keeping as many (``ranks``, format 1.7).

    KVCODEC_CORPUS=../shared/corpus python scripts/studies/heads_bytes.py [FILE ...] [--out docs/study_heads_bytes.json]

For each corpus file (default: the GPL and the Python tutorial): the first 2,048 tokens prefilled by SmolLM2 in
bfloat16 (as stored in practice), KVzip's replay once (after the repeat instruction), then for each keep (10 and
25 %) and allocation: the entries kept and held per KV head, and the bytes of the reduced cache in the lossless
tier and the lossy tier at 3 and 2 bits.  Nothing is timed.
"""

import argparse
import json
import os
import warnings
from pathlib import Path

import torch

import kvcodec
from kvcodec.models import load_model
from kvcodec.reduction import REPEAT_PROMPT, replay_observation


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="*", default=["legal_en_gpl-3.0.txt", "techdoc_en_python_tutorial_controlflow.rst"])
    ap.add_argument("--corpus", default=os.environ.get("KVCODEC_CORPUS", "../shared/corpus"))
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model, tok = load_model("smollm2", dtype=torch.bfloat16)
    prompt = tok(REPEAT_PROMPT, add_special_tokens=False)["input_ids"]
    rows = []
    for name in args.files:
        text = Path(args.corpus, name).read_text(encoding="utf-8", errors="replace")
        ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids[:, : args.tokens]
        with torch.no_grad():
            cache = model(ids, use_cache=True).past_key_values
        raw = sum(la.keys.numel() * 2 * 2 for la in cache.layers)
        obs = replay_observation(cache, model, ids, prompt)
        for keep in (0.1, 0.25):
            for alloc in ("ranks", "heads"):
                red = kvcodec.reduce(cache, model, keep, "kvzip", observation=obs, allocation=alloc)
                row = {"file": name, "tokens": int(ids.shape[1]), "keep": keep, "allocation": alloc,
                       "kept_per_head": round(red.counted(), 1), "held_per_head": red.entries(),
                       "raw_bf16_bytes": raw, "lossless_bytes": len(kvcodec.encode(red))}
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    for bits in (3, 2):
                        row[f"lossy{bits}_bytes"] = len(kvcodec.encode(red, tier="lossy", bits=float(bits)))
                rows.append(row)
                print(json.dumps(row))
    if args.out:
        Path(args.out).write_text(json.dumps({"model": "smollm2 bf16", "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
