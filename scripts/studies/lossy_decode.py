"""The lossy tier's decode, part by part (issue 16; BENCHMARKS "The lossy tier's decode").

    python scripts/studies/lossy_decode.py [--text prose_en_austen_pride_and_prejudice.txt] [--out FILE.json]

1 thread, medians of 7 interleaved rounds, on SmolLM2's bf16 cache of the first 2,048 tokens of the text:

* **reconstruction** (Method 1: dequantize, inverse Walsh-Hadamard, signs, norm, bfloat16 rounding) on the
  cache's own index symbols at 2 bits: the Numba kernels (float32, then a rounding pass) against the vector
  kernel (``kvcodec/codecs/_rotate_simd.py``: one token per vector register, the rounding fused), checked
  bit-identical first; Mcomp/s;
* **index streams**: the whole decode of the cache at 2 and 3 bits with the index streams coded at
  ``Scale_Bits`` 12 (the reference encoder until spec revision 1.6.2), 10 (until 1.8.3) and 8 (now, for
  symbols of up to 8 bits: all of these), bytes, ms and the ms of the index streams' vector kernel within it
  (its mean over the rounds, after one untimed decode of each).
  The step comes from a rate loop over the coded sizes, so the variants' steps (and values) may differ by a
  hair.
"""

import argparse
import collections
import json
import os
import statistics
import time

import numpy as np
import torch

os.environ.setdefault("KVCODEC_THREADS", "1")

import kvcodec  # noqa: E402
from kvcodec.codecs import _rotate_simd, _vq_numba, vq_rans  # noqa: E402
from kvcodec.codecs.hadamard import signs  # noqa: E402
from kvcodec.entropy import _lanes_simd  # noqa: E402
from kvcodec.lab.common import text_cache  # noqa: E402


def medians(fns: dict, rounds: int = 7) -> dict:
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def reconstruction(kv) -> dict:
    """Both reconstruction kernels on one layer's keys quantized at 2 bits (the tier's own quantizer)."""
    x = torch.cat([k.float() for k in kv.keys[:8]], 1).numpy()  # [1, 8 * H, T, D]
    b, h, t, d = x.shape
    norms, z = vq_rans.directions(x.reshape(-1, d), 7)
    step = np.float32(vq_rans.step_for_rate(z, 2.0))
    q = np.rint(z / step).astype(np.int64)
    lo = int(q.min())
    syms = (q - lo).astype(np.uint16).reshape(b * h, t, d)
    n32 = norms.astype(np.float16).astype(np.float32).reshape(b * h, t)
    sign, inv = signs(7, d), np.float32(1.0 / d)
    f32 = np.empty((b * h * t, d), np.float32)
    old = np.empty((b, h, t, d), np.uint16)
    new = np.empty((b, h, t, d), np.uint16)

    def numba_path():
        _vq_numba.rotate_back(syms.reshape(-1, d), lo, step, np.zeros(1, np.float32), False, sign, inv,
                              n32.reshape(-1), f32)
        _vq_numba.f32_to_bf16(f32.view(np.uint32).reshape(b, h, t, d), old)

    def vector_path():
        _rotate_simd.rotate(syms, lo, step, sign, inv, n32, new)

    numba_path()
    vector_path()
    assert np.array_equal(old, new), "the vector reconstruction differs from the Numba kernels"
    m = medians({"numba": numba_path, "vector": vector_path})
    comps = syms.size
    return {"components": comps, **{f"{k}_mcomps": comps / v / 1e6 for k, v in m.items()},
            "speedup": m["numba"] / m["vector"]}


def index_streams(kv) -> list:
    rows = []
    base, small = dict(vq_rans._CTX), vq_rans.SMALL_SCALE_BITS  # the index coder's parameters (study knobs)
    kernel_s = collections.defaultdict(float)
    current = [None]
    run = _lanes_simd._run

    def timed_run(*args):  # the index streams' vector kernel, timed per variant
        t = time.perf_counter()
        try:
            return run(*args)
        finally:
            kernel_s[current[0]] += time.perf_counter() - t

    rounds = 7
    try:
        _lanes_simd._run = timed_run
        for bits in (2.0, 3.0):
            datas = {}
            for sb in (12, 10, 8):
                vq_rans._CTX, vq_rans.SMALL_SCALE_BITS = {**base, "scale_bits": sb}, sb
                datas[sb] = kvcodec.encode(kv, tier="lossy", bits=bits)
            vq_rans._CTX, vq_rans.SMALL_SCALE_BITS = base, small
            for d in datas.values():  # warm-up: every kernel variant compiled before the timed rounds
                kvcodec.decode(d)
            kernel_s.clear()

            def decode(sb, d):
                current[0] = sb
                kvcodec.decode(d)

            m = medians({sb: (lambda sb=sb, d=d: decode(sb, d)) for sb, d in datas.items()}, rounds)
            for sb, d in datas.items():
                rows.append({"bits": bits, "scale_bits": sb, "bytes": len(d), "bytes_vs_12": len(d) / len(datas[12]),
                             "bytes_vs_10": len(d) / len(datas[10]), "decode_ms": 1e3 * m[sb],
                             "speed_vs_12": m[12] / m[sb], "speed_vs_10": m[10] / m[sb],
                             "kernel_ms": 1e3 * kernel_s[sb] / rounds,
                             "kernel_speed_vs_10": kernel_s[10] / kernel_s[sb]})
    finally:
        vq_rans._CTX, vq_rans.SMALL_SCALE_BITS = base, small
        _lanes_simd._run = run
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--text", default="prose_en_austen_pride_and_prejudice.txt")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    _, _, kv = text_cache(args.text, args.tokens)
    res = {"text": args.text, "tokens": args.tokens, "reconstruction": reconstruction(kv),
           "index_streams": index_streams(kv)}
    r = res["reconstruction"]
    print(f"reconstruction, {r['components']:,} components: Numba {r['numba_mcomps']:.0f} Mcomp/s, "
          f"vector {r['vector_mcomps']:.0f} Mcomp/s ({r['speedup']:.1f}x)")
    for row in res["index_streams"]:
        print(f"{row['bits']:g} bits, Scale_Bits {row['scale_bits']}: {row['bytes']:,} B "
              f"({row['bytes_vs_10']:.5f}x of 10), decode {row['decode_ms']:.0f} ms ({row['speed_vs_10']:.2f}x of 10; "
              f"{row['speed_vs_12']:.2f}x of 12), index kernel {row['kernel_ms']:.1f} ms "
              f"({row['kernel_speed_vs_10']:.2f}x of 10)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
