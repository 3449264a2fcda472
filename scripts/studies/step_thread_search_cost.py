"""What the thread-count search of the exact tier's encoder costs (issue 46).

Encodes SmolLM2 bf16 caches made by ``generate()`` (200 prompt tokens, 40 one-token steps; into a
RecordingCache, whose schedule is given, and a plain DynamicCache, whose plan is inferred) with the search
(candidates: 1, torch's count, the CPU count) and without it (candidates: 1), medians of 5, alternated, one
process.  Run from the repository root: ``python scripts/studies/step_thread_search_cost.py``.
"""

import os
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

import kvcodec
from kvcodec.tokens import RecordingCache
from kvcodec.tokens import plan as P
from kvcodec.tokens.plan import cache_kwarg


def main() -> None:
    model, tok = kvcodec.load_model("smollm2", dtype=torch.bfloat16)
    text = (Path(os.environ.get("KVCODEC_CORPUS", "../shared/corpus")) / "legal_en_gpl-3.0.txt").read_text()
    ids = tok(text[len(text) // 2:], return_tensors="pt").input_ids[:, :200]

    def make(rec):
        c = (RecordingCache if rec else DynamicCache)(config=model.config)
        with torch.no_grad():
            model.generate(ids, **{cache_kwarg(model): c}, max_new_tokens=41, do_sample=False,
                           pad_token_id=tok.eos_token_id)
        return c

    search = P.step_thread_candidates
    for rec in (True, False):
        cache = make(rec)
        times = {"on": [], "off": []}
        for _ in range(5):
            for mode in ("on", "off"):
                P.step_thread_candidates = search if mode == "on" else (lambda: [1])
                t = time.perf_counter()
                kvcodec.encode(cache, (model, tok), token_model="static")
                times[mode].append(time.perf_counter() - t)
        P.step_thread_candidates = search
        on, off = statistics.median(times["on"]), statistics.median(times["off"])
        print(f"{'RecordingCache' if rec else 'DynamicCache (inferred plan)'}: candidates {search()}, search on "
              f"{on:.3f} s, off {off:.3f} s, ratio {on / off:.3f}")


if __name__ == "__main__":
    main()
