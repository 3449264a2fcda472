"""The first touch of new memory after the process has been idle, and what it does to a restore (issue 16,
BENCHMARKS "Decode, ninth pass").

    KVCODEC_CORPUS=../shared/corpus python scripts/studies/first_touch.py [--rounds 3] [--idle 6] [--out F.json]

On a virtual machine whose host takes back the memory its guest leaves free (Linux's free page reporting,
``page_reporting.page_reporting_order`` on the guest's kernel command line; Firecracker and others), memory the
process frees goes back to the host a few seconds later, and touching new memory after that costs the host's
page faults as well as the guest's.  This study measures, 1 thread, in rounds, each after the process slept
``--idle`` seconds or 0.2 s, in a process that only restores (a new one, which imports kvcodec and reads the
files; in a process that has run the model, large requests are often served from memory the allocator already
holds, and then nothing is touched for the first time):

* **touch**: ``np.empty`` of the raw size of SmolLM2's bf16 cache of 2,048 tokens (45 MiB) and one write per
  4 KiB page (no kvcodec);
* **lossless / lossy 2 bits**: ``kvcodec.load`` of that cache's ``.kvz`` file (in the page cache) to a
  ``KVCache``, whose tensors are new memory;
* each also after the long sleep **then** :func:`kvcodec.lab.common.touch_fresh_memory` (3x the raw size,
  untimed): what ``kvz bench --restore`` does before each timed call.

Medians over the rounds; the conditions alternate within each round.
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
import json, sys, time
import numpy as np, torch, kvcodec
from kvcodec.lab.common import touch_fresh_memory
torch.set_num_threads(1)
raw, rounds, idle, files = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), json.loads(sys.argv[4])


def touch():
    a = np.empty(raw, dtype=np.uint8)
    a[::4096] = 1
    return a


calls = {"touch": touch, **{name: (lambda p=p: kvcodec.load(p, output="kvcache")) for name, p in files.items()}}
for fn in calls.values():  # warm-up: kernels, scratch buffers
    fn()
conditions = {"after 0.2 s": (0.2, False), f"after {idle:g} s idle": (idle, False),
              f"after {idle:g} s idle, fresh memory touched first": (idle, True)}
times = {f"{c} | {k}": [] for c in conditions for k in calls}
for r in range(rounds):
    for k, fn in calls.items():
        for c, (sleep, prime) in conditions.items():
            time.sleep(sleep)
            if prime:
                touch_fresh_memory(3 * raw)
            t = time.perf_counter()
            out = fn()
            times[f"{c} | {k}"].append(time.perf_counter() - t)
            del out
            print(f"round {r}: {k}, {c}: {1e3 * times[f'{c} | {k}'][-1]:.1f} ms", file=sys.stderr, flush=True)
print(json.dumps({"conditions": list(conditions), "calls": list(calls), "times": times}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", default="prose_en_austen_pride_and_prejudice.txt")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--idle", type=float, default=6.0, help="seconds of sleep before the 'idle' calls")
    ap.add_argument("--out", help="write the results here (JSON)")
    args = ap.parse_args()
    import kvcodec
    from kvcodec.lab.common import machine_info, text_cache

    _, _, kv = text_cache(args.text, 2048, "bfloat16")
    raw = kv.nbytes()
    with tempfile.TemporaryDirectory(prefix="kvz-touch-") as d:
        files = {"lossless": str(Path(d) / "lossless.kvz"), "lossy 2 bits": str(Path(d) / "lossy2.kvz")}
        kvcodec.save(files["lossless"], kv, tier="lossless")
        kvcodec.save(files["lossy 2 bits"], kv, tier="lossy", bits=2)
        child = subprocess.run([sys.executable, "-c", CHILD, str(raw), str(args.rounds), str(args.idle),
                                json.dumps(files)], stdout=subprocess.PIPE, check=True, text=True)
    got = json.loads(child.stdout)
    cmdline = ""
    try:
        with open("/proc/cmdline") as f:
            cmdline = " ".join(w for w in f.read().split() if w.startswith("page_reporting"))
    except OSError:
        pass
    results = {"text": args.text, "tokens": 2048, "raw_bytes": raw, "rounds": args.rounds, "idle_s": args.idle,
               "machine": machine_info(), "kernel_page_reporting": cmdline or None,
               "median_ms": {c: {k: 1e3 * statistics.median(got["times"][f"{c} | {k}"]) for k in got["calls"]}
                             for c in got["conditions"]},
               "all_ms": {key: [1e3 * t for t in v] for key, v in got["times"].items()}}
    print(json.dumps(results["median_ms"], indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
