"""Preparing a coded stream for the vector decoders, before and after (issue 16, BENCHMARKS "Decode, sixth pass").

    KVCODEC_CORPUS=../shared/corpus python scripts/studies/stream_prep.py [--text FILE] [--rounds 15] [--out F.json]

SmolLM2's cache of the first 2,048 tokens of the text, encoded lossless (bf16 and fp32) and lossy (bf16, 2 and
3 bits); each file decoded whole (1 thread, to a ``DynamicCache``) with the two switches of
``kvcodec/entropy/rans.py`` on (now) and off (before), in alternation round by round (medians):

* ``PACKED_TABLES``: a stream's packed frequency tables parsed straight into the vector kernels' tables in one
  Numba pass, against unpacking them into dense frequencies (``Num_Tables x 2**Coded_Bits``) and building the
  kernels' tables from those;
* ``IN_PLACE``: the kernels read the payload's words and raw bits where they are, against copying both into
  zero-padded arrays per stream.

Both off is the preparation as before (the kernels are the same in all four: the raw bits' per-step switch to
their tail copy and the norms' unrolled decoder run in every column); each alone is also timed.  The decodes
are checked bit-identical first.
"""

import argparse
import json
import os

import torch

os.environ.setdefault("KVCODEC_THREADS", "1")

import kvcodec  # noqa: E402
from kvcodec.entropy import rans  # noqa: E402
from kvcodec.lab.common import interleaved_medians, machine_info, text_cache  # noqa: E402

VARIANTS = {"now": (True, True), "tables packed only": (True, False), "in place only": (False, True),
            "before": (False, False)}


def _decode(data: bytes, packed: bool, in_place: bool):
    rans.PACKED_TABLES, rans.IN_PLACE = packed, in_place
    try:
        return kvcodec.decode(data, output="kvcache")
    finally:
        rans.PACKED_TABLES = rans.IN_PLACE = True


def _same(a, b) -> bool:
    word = {2: torch.int16, 4: torch.int32}
    return all(torch.equal(x.view(word[x.element_size()]), y.view(word[y.element_size()]))
               for x, y in zip(list(a.keys) + list(a.values), list(b.keys) + list(b.values)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", default="prose_en_austen_pride_and_prejudice.txt")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    files = {}
    for dtype in ("bfloat16", "float32"):
        _, _, kv = text_cache(args.text, 2048, dtype)
        files[f"lossless {dtype}"] = kvcodec.encode(kv, tier="lossless")
        if dtype == "bfloat16":
            for bits in (2, 3):
                files[f"lossy {bits} bits {dtype}"] = kvcodec.encode(kv, tier="lossy", bits=bits)
    results = {"text": args.text, "tokens": 2048, "rounds": args.rounds, "machine": machine_info(), "files": {}}
    for name, data in files.items():
        ref = _decode(data, False, False)
        for v, (p, i) in VARIANTS.items():
            if not _same(_decode(data, p, i), ref):
                raise SystemExit(f"{name}: {v} decodes differently")
        raw = sum(t.numel() * t.element_size() for t in list(ref.keys) + list(ref.values))
        del ref
        med = interleaved_medians({v: (lambda p=p, i=i, data=data: _decode(data, p, i))
                                   for v, (p, i) in VARIANTS.items()}, args.rounds)
        row = {"bytes": len(data), "raw_bytes": raw, "ms": {v: 1e3 * s for v, s in med.items()},
               "mb_s": {v: raw / s / 1e6 for v, s in med.items()},
               "speedup_now_vs_before": med["before"] / med["now"]}
        results["files"][name] = row
        print(f"{name}: " + ", ".join(f"{v} {1e3 * s:.1f} ms" for v, s in med.items())
              + f"; before / now {row['speedup_now_vs_before']:.3f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        print("wrote", args.out)


if __name__ == "__main__":
    main()
