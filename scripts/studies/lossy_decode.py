"""The lossy tier's decode, part by part (issue 16; BENCHMARKS "The lossy tier's decode").

    python scripts/studies/lossy_decode.py [--text prose_en_austen_pride_and_prejudice.txt] [--out FILE.json]

1 thread, medians of 7 interleaved rounds, on SmolLM2's bf16 cache of the first 2,048 tokens of the text:

* **reconstruction** (Method 1: dequantize, inverse Walsh-Hadamard, signs, norm, bfloat16 rounding) on the
  cache's own index symbols at 2 bits: the Numba kernels (float32, then a rounding pass) against the vector
  kernel (``kvcodec/codecs/_rotate_simd.py``: one token per vector register, the rounding fused), the latter
  with the butterfly as adds, subtracts and blends and the bfloat16 rounding's NaN case (``plain``, until
  spec revision 1.8.3's code) and as fused multiply-adds without the NaN case (``fused``, now), checked
  bit-identical first; Mcomp/s, bfloat16 and float32 output;
* **output allocation**: whole decodes of the 2-bit file (1 thread) with the layer tensors as views of one
  allocation (now) against one fresh array per layer and part (before), with the previous result of the same
  kind held during the decode (a caller that keeps its cache) or freed before it (outside the timing), the
  four kinds in an order that rotates every round, in this process (which holds the model and the cache) and
  in a fresh process that only decodes (what the page faults of new memory cost depends on the memory a
  process has freed before);
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
from kvcodec.lab.common import interleaved_medians, machine_info, text_cache  # noqa: E402


def reconstruction(kv) -> dict:
    """The reconstruction kernels on eight layers' keys quantized at 2 bits (the tier's own quantizer)."""
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
    outs = {"numba": np.empty((b, h, t, d), np.uint16)}

    def numba_path():
        _vq_numba.rotate_back(syms.reshape(-1, d), lo, step, np.zeros(1, np.float32), False, sign, inv,
                              n32.reshape(-1), f32)
        _vq_numba.f32_to_bf16(f32.view(np.uint32).reshape(b, h, t, d), outs["numba"])

    fns = {"numba": numba_path}
    for form, fused in (("plain", False), ("fused", True)):  # the kernel variants, called directly
        for bf16 in (True, False):
            key = f"{form}_{'bf16' if bf16 else 'fp32'}"
            out = outs[key] = np.empty((b, h, t, d), np.uint16 if bf16 else np.uint32)
            _rotate_simd.FUSED = fused
            try:
                fn = _rotate_simd._kernel(d, bf16, fused and bf16 and _rotate_simd._finite(lo, step, n32))
            finally:
                _rotate_simd.FUSED = True
            fns[key] = (lambda fn=fn, out=out: fn(syms.ctypes.data, n32.ctypes.data, sign.ctypes.data,
                                                  out.ctypes.data, b * h, t, h, *out.strides[:3], lo, float(step),
                                                  float(inv)))
    for f in fns.values():
        f()
    want32 = f32.reshape(b, h, t, d).view(np.uint32)
    for key, out in outs.items():
        want = want32 if key.endswith("fp32") else outs["numba"]
        assert np.array_equal(out, want), f"the vector reconstruction ({key}) differs from the Numba kernels"
    m = interleaved_medians(fns, 7)
    comps = syms.size
    return {"components": comps, **{f"{k}_mcomps": comps / v / 1e6 for k, v in m.items()},
            "fused_vs_plain_bf16": m["plain_bf16"] / m["fused_bf16"],
            "fused_vs_plain_fp32": m["plain_fp32"] / m["fused_fp32"], "fused_vs_numba": m["numba"] / m["fused_bf16"]}


def allocation(kv, rounds: int = 11) -> list:
    """Whole decodes of the 2-bit file, one output block against a fresh array per layer and part: here, and in
    a fresh process that only decodes."""
    import subprocess
    import sys
    import tempfile

    data = kvcodec.encode(kv, tier="lossy", bits=2.0)
    raw = sum(x.numel() * x.element_size() for x in kv.keys + kv.values)
    rows = [{**r, "process": "model and cache held"} for r in _allocation_rows(data, raw, rounds)]
    with tempfile.NamedTemporaryFile(suffix=".kvz") as f:
        f.write(data)
        f.flush()
        code = ("import json, sys; sys.path.insert(0, sys.argv[3]); import lossy_decode as L; "
                "print(json.dumps(L._allocation_rows(open(sys.argv[1], 'rb').read(), int(sys.argv[2]), "
                f"{rounds})))")
        out = subprocess.run([sys.executable, "-c", code, f.name, str(raw), os.path.dirname(__file__)],
                             check=True, capture_output=True, text=True).stdout
    return rows + [{**r, "process": "decode only"} for r in json.loads(out.splitlines()[-1])]


def _allocation_rows(data: bytes, raw: int, rounds: int) -> list:
    from kvcodec.tiers import base

    real = base.output_block

    def per_array(shapes, dtype):
        return {key: np.empty(shape, dtype=dtype) for key, shape in shapes.items()}

    kinds = [(name, prev) for name in ("per layer", "one block") for prev in ("held", "freed")]
    times = {kind: [] for kind in kinds}
    held = dict.fromkeys(kinds)  # each kind's previous result: kept during its next decode, or freed before it
    try:
        for r in range(rounds + 1):
            for i in range(len(kinds)):
                kind = kinds[(i + r) % len(kinds)]  # the order rotates: no kind always follows the same one
                base.output_block = per_array if kind[0] == "per layer" else real
                if kind[1] == "freed":
                    held[kind] = None
                t = time.perf_counter()
                out = kvcodec.decode(data, output="kvcache", threads=1)
                dt = time.perf_counter() - t
                held[kind] = out if kind[1] == "held" else None
                del out
                if r:  # round 0 warms up
                    times[kind].append(dt)
    finally:
        base.output_block = real
    rows = []
    for (name, prev), v in times.items():
        m = statistics.median(v)
        rows.append({"output": name, "previous": prev, "threads": 1, "decode_ms": 1e3 * m, "mb_s": raw / m / 1e6,
                     "speedup": statistics.median(times["per layer", prev]) / m})
    return rows


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

            m = interleaved_medians({sb: (lambda sb=sb, d=d: decode(sb, d)) for sb, d in datas.items()}, rounds)
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
    res = {"text": args.text, "tokens": args.tokens, "machine": machine_info(), "reconstruction": reconstruction(kv),
           "allocation": allocation(kv), "index_streams": index_streams(kv)}
    r = res["reconstruction"]
    print(f"reconstruction, {r['components']:,} components, Mcomp/s: Numba {r['numba_mcomps']:.0f}, vector plain "
          f"{r['plain_bf16_mcomps']:.0f} (fp32 {r['plain_fp32_mcomps']:.0f}), fused {r['fused_bf16_mcomps']:.0f} "
          f"(fp32 {r['fused_fp32_mcomps']:.0f}): fused / plain {r['fused_vs_plain_bf16']:.2f}x bf16, "
          f"{r['fused_vs_plain_fp32']:.2f}x fp32")
    for row in res["allocation"]:
        print(f"{row['process']}: output {row['output']}, previous result {row['previous']}: "
              f"{row['decode_ms']:.1f} ms, {row['mb_s']:.0f} MB/s ({row['speedup']:.2f}x)")
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
