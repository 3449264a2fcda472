"""A decode in a new process, and in a process whose allocator maps new memory for every large request (issue 16,
BENCHMARKS "Decode, eighth pass").

    KVCODEC_CORPUS=../shared/corpus python scripts/studies/fresh_process.py [--rounds 5] [--out F.json]

SmolLM2's bf16 cache of the first 2,048 tokens of Austen, encoded lossless and lossy (2 bits), each file read
from disk (the page cache) and decoded to a ``DynamicCache`` on 1 thread:

* **New processes**: each round starts, per file, one process whose kernel cache directory is empty (the vector
  kernels compiled by LLVM, as before their machine code was kept on disk) and one whose directory holds them
  (loaded); each reports its import time, its first decode and the median of its next 7.
* **The allocator's state** (in this process, then in one started with ``MALLOC_MMAP_THRESHOLD_=131072``, which
  makes glibc map new memory for every request of 128 KiB or more, as a fresh process does until it has freed
  a mapping that large): decodes with the scratch buffers on (``kvcodec.scratch.ENABLED``) and off (new memory
  for every table, index-symbol array and payload, as before), alternated round by round; medians, and the
  page faults of one decode.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("KVCODEC_THREADS", "1")

CHILD = r"""
import os, sys, time, statistics, json
t0 = time.perf_counter()
import torch, kvcodec
from kvcodec.entropy import _lanes_simd
torch.set_num_threads(1)
imported = time.perf_counter() - t0
ts = []
for i in range(8):
    t = time.perf_counter(); x = kvcodec.decode(sys.argv[1], output="kvcache"); ts.append(time.perf_counter() - t)
    del x
print(json.dumps({"import_s": imported, "first_s": ts[0], "then_s": statistics.median(ts[1:]),
                  "kernels": _lanes_simd.OBJECTS}))
"""

STATE = r"""
import os, sys, time, statistics, json, resource
import torch, kvcodec
from kvcodec import scratch
torch.set_num_threads(1)
rounds = int(sys.argv[2])
ts, faults = {True: [], False: []}, {}
for on in (True, False):
    scratch.ENABLED = on
    kvcodec.decode(sys.argv[1], output="kvcache")
for r in range(rounds):
    for on in (True, False):
        scratch.ENABLED = on
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t = time.perf_counter()
        x = kvcodec.decode(sys.argv[1], output="kvcache")
        ts[on].append(time.perf_counter() - t)
        faults[on] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
        del x
print(json.dumps({"scratch_s": statistics.median(ts[True]), "new_memory_s": statistics.median(ts[False]),
                  "scratch_faults": faults[True], "new_memory_faults": faults[False]}))
"""


def _run(code: str, args: list, env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=1800)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", default="prose_en_austen_pride_and_prejudice.txt")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    import kvcodec
    from kvcodec.lab.common import machine_info, text_cache

    torch.set_num_threads(1)
    _, _, kv = text_cache(args.text, 2048, "bfloat16")
    results = {"text": args.text, "tokens": 2048, "rounds": args.rounds, "machine": machine_info(), "files": {}}
    with tempfile.TemporaryDirectory(prefix="kvz-fresh-") as d:
        d = Path(d)
        files = {"lossless": d / "lossless.kvz", "lossy 2 bits": d / "lossy2.kvz"}
        kvcodec.save(files["lossless"], kv, tier="lossless")
        kvcodec.save(files["lossy 2 bits"], kv, tier="lossy", bits=2.0)
        warm = d / "warm"
        for path in files.values():  # the warm directory's kernels
            _run(CHILD, [path], {"KVCODEC_CACHE_DIR": str(warm)})
        for name, path in files.items():
            rows = {"compiled": [], "loaded": []}
            for r in range(args.rounds):
                cold = d / f"cold{r}-{name.replace(' ', '')}"
                rows["compiled"].append(_run(CHILD, [path], {"KVCODEC_CACHE_DIR": str(cold)}))
                rows["loaded"].append(_run(CHILD, [path], {"KVCODEC_CACHE_DIR": str(warm)}))
            fresh = {k: {m: statistics.median(x[m] for x in v) for m in ("import_s", "first_s", "then_s")}
                     for k, v in rows.items()}
            state = {"this process": _run(STATE, [path, 3 * args.rounds], {"KVCODEC_CACHE_DIR": str(warm)}),
                     "MALLOC_MMAP_THRESHOLD_=131072": _run(STATE, [path, 3 * args.rounds],
                                                           {"KVCODEC_CACHE_DIR": str(warm),
                                                            "MALLOC_MMAP_THRESHOLD_": "131072"})}
            results["files"][name] = {"bytes": path.stat().st_size, "new_processes": fresh, "runs": rows,
                                      "allocator": state}
            print(name, json.dumps({"new_processes": fresh, "allocator": state}, indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
