"""Run one peer package on a KV cache, inside that peer's own virtual environment.

    <peer venv>/bin/python scripts/peers/runner.py PEER IN.safetensors OUT_DIR

IN holds ``keys.<layer>`` / ``values.<layer>`` float32 tensors ``[1, heads, tokens, head_dim]``.  For every
configuration of PEER (CONFIGS below) the runner compresses and decompresses each layer with the peer's
own code and writes ``OUT_DIR/<peer>-<i>.safetensors`` (the reconstructed tensors) and one
``OUT_DIR/<peer>.json`` with, per configuration: label, version, **bits per component as the peer stores
them** (its packed indices plus its side information; the formula is given in ``storage``), encode and
decode seconds, or the error that stopped it.  kvcodec computes the quality (mean KL) in its own venv.
Needs only torch, numpy, safetensors and the peer: no kvcodec import.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import sys
import time
import traceback
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def _v(pkg):
    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return "?"


# --- transformers' QuantizedCache layers (quanto, HQQ) and its fp8 layer ----------------------------------
def _hf_layer(backend, nbits, axis, group):
    from transformers import cache_utils as cu

    def run(k, v):
        if backend == "fp8":
            layer = cu.Fp8QuantizedLayer()
        else:
            cls = cu.QuantoQuantizedLayer if backend == "quanto" else cu.HQQQuantizedLayer
            layer = cls(nbits=nbits, axis_key=axis, axis_value=axis, q_group_size=group, residual_length=0)
        layer.update(k, v)
        return layer._dequantize(layer._quantized_keys), layer._dequantize(layer._quantized_values)

    return run


def _hf_configs(backend):
    if backend == "fp8":
        return [("fp8_e4m3 per tensor (transformers Fp8QuantizedLayer)", _hf_layer("fp8", 8, 0, 0),
                 lambda d: 8.0, "8 bits + one fp32 scale per tensor")]
    axis = 0 if backend == "quanto" else 1
    out = []
    for nbits in ((4, 2) if backend == "quanto" else (4, 3, 2)):
        out.append((f"nbits={nbits} axis_k={axis} axis_v={axis} group=64 residual_length=0",
                    _hf_layer(backend, nbits, axis, 64), lambda d, n=nbits: n + 64 / 64,
                    "nbits + (scale + zero point, 2 x 32 bits) per group of 64"))
    return out


# --- TurboQuant implementations ----------------------------------------------------------------------------
def _turboquant_configs():
    from turboquant import TurboQuantIP, TurboQuantMSE

    def mse(bits):
        def run(k, v):
            tq = TurboQuantMSE(k.shape[-1], bits=bits, device="cpu")
            out = []
            for x in (k, v):
                idx, norms = tq.quantize(x)
                out.append(tq.dequantize(idx, norms))
            return out
        return run

    def ip(bits):
        def run(k, v):
            tq = TurboQuantIP(k.shape[-1], bits=bits, device="cpu")
            return [tq.dequantize(*tq.quantize(x)) for x in (k, v)]
        return run

    cfgs = [(f"TurboQuantMSE bits={b}", mse(b), lambda d, b=b: b + 32 / d,
             "bits per index (packed) + one fp32 norm per vector") for b in (2, 3, 4)]
    cfgs += [(f"TurboQuantIP bits={b} ((b-1)-bit MSE + 1-bit QJL residual)", ip(b), lambda d, b=b: b + 64 / d,
              "b bits per component + fp32 norm + fp32 residual norm per vector") for b in (2, 3, 4)]
    return cfgs


def _fused_configs():
    from fused_turboquant.core.quantizer import TurboQuantMSE

    def run_b(bits):
        def run(k, v):
            tq = TurboQuantMSE(k.shape[-1], bits=bits, device="cpu")  # PyTorch path (its Triton path is CUDA-only)
            return [tq.decode(tq.encode(x)).to(x.dtype) for x in (k, v)]
        return run

    return [(f"TurboQuantMSE(RHT) bits={b}, PyTorch CPU path", run_b(b), lambda d, b=b: b + 32 / d,
             "bits per index (packed) + one fp32 norm per vector") for b in (2, 3, 4)]


def _tiny_configs():
    from tiny_turboquant import TinyKVCache

    def run_p(preset):
        def run(k, v, layer=[0]):  # noqa: B006 - one cache per call
            cache = TinyKVCache(compression=preset, residual_len=0, block_size=128)
            kk, vv = cache.update(k, v, 0)
            rep = cache.layers[0].memory_report()
            run.bits = 8 * rep["compressed_storage_bytes"] / (k.numel() + v.numel())
            return kk.to(k.dtype), vv.to(v.dtype)
        return run

    out = []
    for p in ("safe", "balanced", "compact", "aggressive"):
        fn = run_p(p)
        out.append((f"TinyKVCache compression={p} residual_len=0 block=128", fn, fn,
                    "memory_report()['compressed_storage_bytes'] (its packed indices and scales)"))
    return out


def _lmcache_configs():
    from lmcache.storage_backend.serde.cachegen_basics import CacheGenConfig, QuantizationSpec
    from lmcache.storage_backend.serde.cachegen_decoder import CacheGenDeserializer
    from lmcache.storage_backend.serde.cachegen_encoder import CacheGenSerializer

    chunk = 256

    def make(nlayers):
        # what CacheGenConfig.from_model_name gives a model of >= 10 layers (it needs a hub download to
        # read the layer count; offline we build the same config): keys 32 bins in layers 0-9, 16 after;
        # values 32 bins in layers 0-1, 16 after
        cfg = CacheGenConfig(nlayers=nlayers,
                             kspecs=[QuantizationSpec(0, min(10, nlayers), 32), QuantizationSpec(10, nlayers, 16)],
                             vspecs=[QuantizationSpec(0, min(2, nlayers), 32), QuantizationSpec(2, nlayers, 16)])
        ser, de = object.__new__(CacheGenSerializer), object.__new__(CacheGenDeserializer)
        for o in (ser, de):
            o.cachegen_config, o.chunk_size = cfg, chunk
            o.key_bins, o.value_bins = o.make_key_bins(cfg), o.make_value_bins(cfg)
        de.dtype, de.output_buffer = torch.float32, None
        return ser, de

    def run_all(tensors, layers):
        # LMCache's layout: [layers, 2, tokens, heads, head_dim], coded in chunks of 256 tokens
        blob = torch.stack([torch.stack([tensors[f"keys.{i}"][0], tensors[f"values.{i}"][0]]) for i in layers])
        blob = blob.permute(0, 1, 3, 2, 4).contiguous()
        ser, de = make(len(layers))
        parts, nbytes = [], 0
        for a in range(0, blob.shape[2], chunk):
            bs = ser.to_bytes(blob[:, :, a:a + chunk].contiguous())
            nbytes += len(bs)
            parts.append(de.from_bytes(bs).float().cpu())  # [layers, 2, tokens, heads, head_dim]
        rec = torch.cat(parts, dim=2).permute(0, 1, 3, 2, 4)  # [layers, 2, heads, tokens, head_dim]
        run_all.bits = 8 * nbytes / blob.numel()
        return {li: (rec[j, 0][None], rec[j, 1][None]) for j, li in enumerate(layers)}

    return [("CacheGen (storage_backend.serde), default bins for the layer count (keys 32/16 bins, values 32/16), "
             "chunk=256 tokens", run_all, run_all, "len(CacheGenSerializer.to_bytes(chunk)) summed over 256-token chunks")]


PEERS = {
    "quanto": (lambda: _hf_configs("quanto"), ["optimum-quanto", "transformers"]),
    "hqq": (lambda: _hf_configs("hqq"), ["hqq", "transformers"]),
    "fp8": (lambda: _hf_configs("fp8"), ["transformers"]),
    "turboquant": (_turboquant_configs, ["turboquant"]),
    "fused-turboquant": (_fused_configs, ["fused-turboquant"]),
    "tiny-turboquant": (_tiny_configs, ["tiny-turboquant"]),
    "lmcache": (_lmcache_configs, ["lmcache"]),
}


def main(argv):
    peer, src, out = argv[0], Path(argv[1]), Path(argv[2])
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(2)
    tensors = load_file(str(src))
    layers = sorted(int(k.split(".")[1]) for k in tensors if k.startswith("keys."))
    make, pkgs = PEERS[peer]
    version = " / ".join(f"{p} {_v(p)}" for p in pkgs)
    rows = []
    for i, (label, fn, bits_fn, storage) in enumerate(make()):
        row = {"peer": peer, "config": label, "version": version, "storage": storage}
        try:
            rec, comps, bits_sum, t0 = {}, 0, 0.0, time.perf_counter()
            whole = fn(tensors, layers) if peer == "lmcache" else None  # codes all layers at once
            for li in layers:
                k, v = tensors[f"keys.{li}"], tensors[f"values.{li}"]
                kk, vv = whole[li] if whole is not None else fn(k, v)
                if tuple(kk.shape) != tuple(k.shape) or tuple(vv.shape) != tuple(v.shape):
                    raise RuntimeError(f"layer {li}: shapes {tuple(kk.shape)}/{tuple(vv.shape)} != {tuple(k.shape)}")
                rec[f"keys.{li}"] = kk.float().contiguous()
                rec[f"values.{li}"] = vv.float().contiguous()
                n = k.numel() + v.numel()
                bits_sum += (fn.bits if bits_fn is fn else bits_fn(k.shape[-1])) * n
                comps += n
            row["seconds"] = time.perf_counter() - t0
            row["bits_per_component"] = bits_sum / comps
            row["file"] = f"{peer}-{i}.safetensors"
            save_file(rec, str(out / row["file"]))
        except Exception as e:  # record why, keep going
            row["error"] = f"{type(e).__name__}: {e}"
            row["traceback"] = traceback.format_exc(limit=3)
        print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
        rows.append(row)
    (out / f"{peer}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
