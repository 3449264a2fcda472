"""Time one peer package's *decoding* alone (dequantization, or CacheGen's entropy decode), inside that peer's
own virtual environment: the comparison issue 16 asks of the lossy tier's decoder.

    <peer venv>/bin/python scripts/peers/dequant.py PEER IN.safetensors THREADS REPEATS

IN holds ``keys.<layer>`` / ``values.<layer>`` float32 tensors ``[1, heads, tokens, head_dim]`` (what
``kvz bench --restore --peers`` writes).  Every configuration below is encoded once, untimed; then its whole-cache
decode (every layer's keys and values back to tensors) is timed ``REPEATS`` times with torch on ``THREADS``
threads, and one JSON line per configuration gives the median seconds and the output's components and dtype.
Needs only torch, safetensors and the peer: no kvcodec import.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import statistics
import sys
import time

import torch
from safetensors.torch import load_file


def _v(pkg):
    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return "?"


def _hf(backend, nbits):
    """transformers' QuantizedCache layers: ``layer._dequantize`` of the stored keys and values."""
    from transformers import cache_utils as cu

    cls = cu.QuantoQuantizedLayer if backend == "quanto" else cu.HQQQuantizedLayer
    axis = 0 if backend == "quanto" else 1

    def encode(k, v):
        layer = cls(nbits=nbits, axis_key=axis, axis_value=axis, q_group_size=64, residual_length=0)
        layer.update(k, v)
        return layer

    def decode(layer):
        return layer._dequantize(layer._quantized_keys), layer._dequantize(layer._quantized_values)

    return f"{backend} nbits={nbits} group=64 (QuantizedLayer._dequantize)", encode, decode


def _tq(label, make, encode_name, decode_name):
    """A TurboQuant implementation: one quantizer per head dimension, its encode / decode methods by name."""
    tq = {}

    def encode(k, v):
        q = tq.setdefault(k.shape[-1], make(k.shape[-1]))
        return q, getattr(q, encode_name)(k), getattr(q, encode_name)(v)

    def decode(state):
        q, a, b = state
        dec = getattr(q, decode_name)
        return (dec(*a), dec(*b)) if isinstance(a, tuple) else (dec(a), dec(b))

    return label, encode, decode


def _turboquant(bits):
    from turboquant import TurboQuantMSE

    return _tq(f"turboquant TurboQuantMSE bits={bits} (dequantize)",
               lambda d: TurboQuantMSE(d, bits=bits, device="cpu"), "quantize", "dequantize")


def _fused(bits):
    from fused_turboquant.core.quantizer import TurboQuantMSE

    return _tq(f"fused-turboquant TurboQuantMSE(RHT) bits={bits}, PyTorch CPU path (decode)",
               lambda d: TurboQuantMSE(d, bits=bits, device="cpu"), "encode", "decode")


PEERS = {
    "quanto": ([lambda: _hf("quanto", 2), lambda: _hf("quanto", 4)], ["optimum-quanto", "transformers"]),
    "hqq": ([lambda: _hf("hqq", 2), lambda: _hf("hqq", 4)], ["hqq", "transformers"]),  # its 3-bit layer fails
    "turboquant": ([lambda: _turboquant(2), lambda: _turboquant(3)], ["turboquant"]),
    "fused-turboquant": ([lambda: _fused(2), lambda: _fused(3)], ["fused-turboquant"]),
}


def main(argv):
    peer, src, threads, repeats = argv[0], argv[1], int(argv[2]), int(argv[3])
    torch.set_num_threads(threads)
    tensors = load_file(src)
    layers = sorted(int(k.split(".")[1]) for k in tensors if k.startswith("keys."))
    makers, pkgs = PEERS[peer]
    version = " / ".join(f"{p} {_v(p)}" for p in pkgs)
    for make in makers:
        label, encode, decode = make()
        row = {"peer": peer, "config": label, "version": version, "threads": threads}
        try:
            states = [encode(tensors[f"keys.{li}"], tensors[f"values.{li}"]) for li in layers]
            out = [decode(s) for s in states]  # warm-up, and the output's size
            row["components"] = sum(x.numel() for pair in out for x in pair)
            row["dtype"] = str(out[0][0].dtype).replace("torch.", "")
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                for s in states:
                    decode(s)
                times.append(time.perf_counter() - t0)
            row["seconds"] = statistics.median(times)
        except Exception as e:  # record why, keep going
            row["error"] = f"{type(e).__name__}: {e}"
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
