"""A/B of whole encodes: python ab.py REPO OUTJSON -- encodes the Austen 2,048-token SmolLM2 cache (bf16, fp32) with
the lossless tier and bf16 with the lossy tier at 2 and 3 bits, 1 thread, median of 5; writes times and sizes."""
import sys, json, time
sys.path.insert(0, sys.argv[1])
import numpy as np, torch
import kvcodec
from kvcodec.lab.common import corpus_files
from kvcodec.models import load_model, prefill, tokenize
torch.set_num_threads(1)
model, tok = load_model("smollm2")
path = {f.name: f for f in corpus_files()}["prose_en_austen_pride_and_prejudice.txt"]
ids = tokenize(tok, path.read_text(encoding="utf-8"), 2048)
res = {}
for dname, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
    kv = prefill(model, ids, dt)
    arms = [("lossless", {})]
    if dname == "bf16":
        arms += [("lossy2", {"tier": "lossy", "bits": 2.0}), ("lossy3", {"tier": "lossy", "bits": 3.0})]
    for name, opts in arms:
        data = kvcodec.encode(kv, threads=1, **opts)
        ts = []
        for _ in range(5):
            t0 = time.perf_counter(); data = kvcodec.encode(kv, threads=1, **opts); ts.append(time.perf_counter() - t0)
        raw = sum(l.keys.numel() + l.values.numel() for l in kv.layers) * (2 if dname == "bf16" else 4)
        res[f"{dname} {name}"] = {"s": float(np.median(ts)), "bytes": len(data), "mb_s": raw / np.median(ts) / 1e6}
json.dump(res, open(sys.argv[2], "w"), indent=1)
print(sys.argv[1], {k: round(v["mb_s"], 1) for k, v in res.items()})
