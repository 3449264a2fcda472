"""GPU benchmark of the lossy tier's Triton kernels (kvcodec/_kernels/vq.py): achieved bandwidth vs the device's peak.

    python scripts/gpu_bench.py [--out bench_out] [--peak-gbs 4800]

Needs a CUDA device and Triton.  For each dtype and shape (a SmolLM2-sized layer slice and a large
Llama-sized one), times ``rotate_quantize`` (reads x, writes int32 indices + fp16 norms) and
``dequantize_add`` (reads indices + norms (+ base), writes the output) with CUDA events, median of 50 runs
after 5 warm-ups, and reports the bytes moved / time as GB/s and as a fraction of the peak.  The peak is
taken from ``--peak-gbs`` or a table of known devices (H100 SXM 3350, H200 4800, A100 80GB 2039 GB/s).
It also checks, on one case, that the GPU results equal the NumPy reference bit for bit.
The entropy decoder (kvcodec/_kernels/rans.py: the lossless tier's rANS streams, one program per stream, its lanes one
vector) is timed on 60 streams of a SmolLM2-sized bf16 slice ([3, 2048, 64], structured like a cache: channel
scales), checked against the CPU decoder, and reported as GB/s of decoded bf16 output.
Results: OUT/gpu_bench.json and OUT/gpu_bench.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

PEAKS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "L40S": 864.0, "A10": 600.0, "RTX 4090": 1008.0}
SHAPES = [(1, 3, 4096, 64), (1, 8, 32768, 128), (8, 8, 4096, 128)]


def timed(fn, reps=50, warm=5):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--peak-gbs", type=float, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from kvcodec._kernels import vq
    from kvcodec.codecs import vq_rans as quant

    name = torch.cuda.get_device_name()
    peak = args.peak_gbs or next((v for k, v in PEAKS.items() if k in name), None)
    dev = "cuda"
    rows = []
    # bit-exactness on the device (the interpreter tests cover CPU)
    x = torch.randn(2, 3, 257, 64) * 3
    n, q = vq.rotate_quantize(x.to(dev), 0.05, 11)
    rn, rz = quant.directions(x.reshape(-1, 64).numpy(), 11)
    exact_q = bool((n.cpu().numpy().view(np.uint16) == rn.view(np.uint16)).all()
                   and (q.cpu().numpy() == np.rint(rz / np.float32(0.05))).all())
    back = vq.dequantize_add(q, n, 0.05, 11, tuple(x.shape), torch.float32).cpu().numpy()
    u = quant.fwht(q.cpu().numpy().astype(np.float32) * np.float32(0.05)) * quant.signs(11, 64) * np.float32(1 / 64)
    exact_dq = bool((back.reshape(-1, 64) == u * n.cpu().numpy().astype(np.float32)[:, None]).all())
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for shape in SHAPES:
            x = torch.randn(shape, device=dev).to(dtype)
            pred = torch.randn(shape, device=dev).to(dtype)
            el = x.numel()
            nv = el // shape[-1]
            es = x.element_size()
            t_q = timed(lambda: vq.rotate_quantize(x, 0.05, 1))
            t_qp = timed(lambda: vq.rotate_quantize(x, 0.05, 1, pred))
            n, q = vq.rotate_quantize(x, 0.05, 1)
            t_d = timed(lambda: vq.dequantize_add(q, n, 0.05, 1, shape, dtype))
            t_db = timed(lambda: vq.dequantize_add(q, n, 0.05, 1, shape, dtype, base=pred))
            for op, t, nbytes in (("rotate_quantize", t_q, el * es + el * 4 + nv * 2),
                                  ("rotate_quantize (residual)", t_qp, 2 * el * es + el * 4 + nv * 2),
                                  ("dequantize_add", t_d, el * 4 + nv * 2 + el * es),
                                  ("dequantize_add (+ base)", t_db, el * 4 + nv * 2 + 2 * el * es)):
                gbs = nbytes / t / 1e9
                rows.append({"op": op, "dtype": str(dtype).removeprefix("torch."), "shape": list(shape),
                             "seconds": t, "bytes": nbytes, "gb_per_s": gbs,
                             "fraction_of_peak": gbs / peak if peak else None})
                print(f"{op:28s} {rows[-1]['dtype']:9s} {shape}: {t * 1e6:9.1f} us {gbs:8.1f} GB/s"
                      + (f" ({gbs / peak:.0%} of {peak:.0f})" if peak else ""), flush=True)
    exact_rans = _entropy_rows(rows, dev, peak)
    res = {"command": "python scripts/gpu_bench.py", "device": name, "peak_gb_per_s": peak,
           "bit_exact_quantize": exact_q, "bit_exact_dequantize": exact_dq, "bit_exact_entropy": exact_rans,
           "torch": torch.__version__, "triton": __import__("triton").__version__, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_bench.json").write_text(json.dumps(res, indent=1))
    lines = [f"`{res['command']}` on {name} (peak {peak} GB/s); bit-exact vs NumPy: quantize {exact_q}, "
             f"dequantize {exact_dq}, entropy decoder {exact_rans}", "", "| op | dtype | shape | us | GB/s | of peak |",
             "|---|---|---|---:|---:|---:|"]
    for r in rows:
        frac = f"{r['fraction_of_peak']:.0%}" if r["fraction_of_peak"] else "-"
        lines.append(f"| {r['op']} | {r['dtype']} | {r['shape']} | {r['seconds'] * 1e6:.1f} | {r['gb_per_s']:.1f} | "
                     f"{frac} |")
    (out / "gpu_bench.md").write_text("\n".join(lines) + "\n")
    return 0 if exact_q and exact_dq and exact_rans else 1


def _entropy_rows(rows, dev, peak, streams=60, shape=(1, 3, 2048, 64)) -> bool:
    """Time the Triton entropy decoder on ``streams`` lossless payloads of ``shape`` (bf16); True if its words
    equal the CPU decoder's."""
    from kvcodec._kernels import rans as kr
    from kvcodec.codecs import float_ctx_rans as fc

    b, h, s, d = shape
    g = torch.Generator().manual_seed(0)
    parsed, want = [], []
    for _ in range(streams):
        x = (torch.randn(shape, generator=g) * torch.exp(torch.randn(1, h, 1, d, generator=g) * 2)).bfloat16()
        words = x.contiguous().view(torch.int16).numpy().view(np.uint16)
        payload = fc.encode(words, "bfloat16", {})
        if payload[0] != 1:
            raise RuntimeError("the synthetic slice was stored raw (Mode 0): nothing for the entropy decoder")
        parsed.append(fc.parse_symbols(memoryview(payload), (b * h, s, d), 16)[0])
        want.append(fc.decode(payload, shape, "bfloat16"))
    got = kr.decode(parsed, (b * h, s, d), device=dev).cpu().numpy()
    exact = all((got[i].astype(np.uint16).reshape(shape) == want[i]).all() for i in range(streams))
    t = timed(lambda: kr.decode(parsed, (b * h, s, d), device=dev), reps=5, warm=1)
    nbytes = streams * x.numel() * 2
    gbs = nbytes / t / 1e9
    # not a bandwidth-bound kernel (a serial chain per lane), and the time includes the host's table setup and
    # the status copy: no fraction of peak
    rows.append({"op": f"rANS decode ({streams} streams, host table setup included)", "dtype": "bfloat16",
                 "shape": list(shape), "seconds": t, "bytes": nbytes, "gb_per_s": gbs, "fraction_of_peak": None})
    print(f"rANS decode: {t * 1e3:.1f} ms, {gbs:.2f} GB/s of bf16 output, bit-exact {exact}", flush=True)
    return exact


if __name__ == "__main__":
    sys.exit(main())
