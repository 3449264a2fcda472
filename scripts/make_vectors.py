#!/usr/bin/env python
"""Regenerate the golden vectors in spec/vectors/ - on purpose, never from a test.

Each case writes ``<case>.kvz`` and ``<case>.json``; the JSON holds the encode
options and the SHA-256 of every *input* tensor (computed here from the
inputs, before encoding), so the tests check decoding against the inputs,
not against the decoder's own output.  Inputs come from NumPy's PCG64 with
fixed seeds, so they are the same on every platform.

Beside them, as tensors (safetensors):

* ``<case>.input.safetensors`` (lossy cases): the input cache, so a test
  re-encodes it and compares bytes;
* ``<case>.regen.safetensors`` (token tiers): the cache the shipped tiny
  model regenerated from the tokens on the machine that wrote the vectors.
  Regeneration is float arithmetic and differs between CPUs (another
  instruction set, another BLAS kernel), so the tests decode the portable
  parts everywhere - container, static-coded token streams, residuals applied
  to these tensors - and the parts that need the model's exact numbers only
  where this machine regenerates these tensors bit for bit.

    python scripts/make_vectors.py          # rewrite all vectors
    python scripts/make_vectors.py --check  # exit 1 if any vector would change
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import torch

import kvcodec
from kvcodec.dtypes import from_bit_patterns

OUT = Path(__file__).resolve().parent.parent / "spec" / "vectors"
INFO = {"kvcodec_version": "golden-vector"}


def structured(rng, shape, dtype):
    """Channel-structured floats (per-channel scale and offset), as in real caches."""
    b, h, s, d = shape
    x = rng.standard_normal(shape) * np.exp(rng.standard_normal((1, h, 1, d))) + rng.standard_normal((1, h, 1, d))
    return torch.from_numpy(x.astype(np.float32)).to(dtype)


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def cases():
    rng = np.random.default_rng(20261129)
    # 1: bf16, GQA-like 2 layers x 2 heads, 24 tokens, default options
    kv = [(structured(rng, (1, 2, 24, 8), torch.bfloat16), structured(rng, (1, 2, 24, 8), torch.bfloat16))
          for _ in range(2)]
    yield "bf16_basic", kvcodec.KVCache([k for k, _ in kv], [v for _, v in kv]), {}
    # 2: fp32, batch 2, token ids, start position, chunked into 4-token sections, no context model
    kv = [(structured(rng, (2, 1, 10, 4), torch.float32), structured(rng, (2, 1, 10, 6), torch.float32))
          for _ in range(2)]
    toks = torch.from_numpy(rng.integers(0, 50000, size=(2, 10)))
    yield "fp32_chunked_tokens", kvcodec.KVCache([k for k, _ in kv], [v for _, v in kv], toks, 7), \
        {"chunk_tokens": 4, "context": "none", "ways": 3}
    # 3: fp16 with special values (inf, nan payloads, -0, subnormals) and one incompressible layer (raw mode)
    k = structured(rng, (1, 2, 16, 8), torch.float16)
    k.view(torch.int16).view(-1)[:6] = torch.tensor([0x7C00, -1024, 0x7E01, -32768, 1, 0x7C01], dtype=torch.int16)
    noise = from_bit_patterns(rng.integers(0, 2**16, size=(1, 2, 16, 8), dtype=np.uint16), torch.float16)
    yield "fp16_special_raw", kvcodec.KVCache([k, noise], [noise.clone(), k.clone()]), {"coded_bits": 6}
    # 4: sliding-window layer beside a full layer (different lengths), bf16
    full = (structured(rng, (1, 1, 12, 4), torch.bfloat16), structured(rng, (1, 1, 12, 4), torch.bfloat16))
    win = (structured(rng, (1, 1, 5, 4), torch.bfloat16), structured(rng, (1, 1, 5, 4), torch.bfloat16))
    yield "bf16_sliding_window", kvcodec.KVCache([full[0], win[0]], [full[1], win[1]],
                                                 sliding_window=[None, 6], cumulative_length=[12, 12]), \
        {"chunk_tokens": 5}
    # 5: enough symbols per slice for two tables (the class rule and Ctx_Map matter), k = 6, 5 ways over 32
    #    rows (a partial lane group), float16 in Mode 1
    kv = [(structured(rng, (1, 2, 256, 16), torch.float16), structured(rng, (1, 2, 256, 16), torch.float16))]
    yield "fp16_tables_k6", kvcodec.KVCache([k for k, _ in kv], [v for _, v in kv]), {"coded_bits": 6, "ways": 5}
    # 6: float32 in Mode 1, one class (Q = 1) and two tables, 4 ways (full groups), Scale_Bits 14
    kv = [(structured(rng, (1, 2, 256, 16), torch.float32), structured(rng, (1, 2, 256, 16), torch.float32))]
    yield "fp32_tables_q1", kvcodec.KVCache([k for k, _ in kv], [v for _, v in kv]), \
        {"context": "none", "ways": 4, "scale_bits": 14}
    # 7 (1.3): layer states - a linear (Mamba-like) layer, an attention layer, a hybrid layer with two slots
    #    (slot 0: conv only, slot 1: recurrent only), an indexed layer (DeepSeek-V3.2's indexer keys); bf16 conv
    #    states, fp32 recurrent states; raw and zstd payloads
    from kvcodec.state import LayerState

    noise = from_bit_patterns(rng.integers(0, 2**16, size=(1, 6, 4), dtype=np.uint16), torch.bfloat16)
    rec = torch.from_numpy(np.round(rng.standard_normal((1, 2, 4, 3)), 1).astype(np.float32))
    conv2 = torch.from_numpy(np.repeat(rng.standard_normal((1, 5, 1)), 3, axis=2).astype(np.float32)).bfloat16()
    rec2 = torch.zeros(1, 3, 2, dtype=torch.float32)
    empty = torch.empty(1, 1, 0, 1, dtype=torch.bfloat16)
    kv = [(empty, empty)] + [(structured(rng, (1, 1, 6, 4), torch.bfloat16), structured(rng, (1, 1, 6, 4),
                                                                                     torch.bfloat16))
                             for _ in range(3)]
    index = structured(rng, (1, 1, 6, 4), torch.bfloat16)[:, 0]
    states = [LayerState("linear", 1, [noise], [rec]), None,
              LayerState("hybrid", 2, [conv2, None], [None, rec2]), LayerState("indexed", 1, [None], [None], index)]
    yield "lossless_state", kvcodec.KVCache([k for k, _ in kv], [v for _, v in kv], cumulative_length=[0, 6, 6, 6],
                                            states=states), {}
    # 8 (1.4): a reduced cache (merge-reduce summaries with log-weights and anchors, a raw sliding layer)
    yield "lossless_reduced", reduced_cache(rng, torch.bfloat16), {}
    # 9 (1.7): a one-shot selection (method tova): kept tokens in `fixed`, then tokens appended raw (sinks, buffer)
    yield "lossless_selected", selected_cache(rng, torch.float16), {}
    # 10 (1.7, spec revision 1.7.1): a one-shot selection (method kvzip) whose reduced layers hold different
    # numbers of entries (kvzip's budget spread over the layers)
    yield "lossless_spread", spread_cache(rng, torch.bfloat16), {}
    # 11 (1.8): kvzip with heads holding different numbers of entries (parts.heads): absent entries not stored,
    # two batch rows, tokens appended after the selection, chunks of 4 crossing the absent places
    yield "lossless_heads", heads_cache(np.random.default_rng(11), torch.bfloat16), {"chunk_tokens": 4}
    # 12 (1.11): a bounded kvzip cache (reduce.bound, the scores tensor): heads holding different numbers, tokens
    # appended past a compaction (some of them now in fixed), +inf and ordinary scores
    yield "lossless_bounded", bounded_cache(np.random.default_rng(12), torch.float16), {}


def reduced_cache(rng, dtype, n=46, form="query"):
    """(1.4) a reduced cache: two full-attention layers summarised by merge-reduce (k = 4 atoms per summary,
    blocks of 4, 2 raw sinks, a raw window of 3) with the clustering reducer, and a sliding-window layer kept
    raw beside them; the ``query`` form stores each layer's anchor."""
    from kvcodec.reduction.cache import Plan, ReducedCache, ReducedLayer, ingest

    plan = Plan(k=4, block=4, sinks=2, method="cluster", seed=3, window=3, form=form)
    keys = [structured(rng, (1, 2, n, 8), dtype) for _ in range(2)]
    values = [structured(rng, (1, 2, n, 8), dtype) for _ in range(2)]
    anchors = [torch.from_numpy(rng.standard_normal((1, 2, 8)).astype(np.float32)) for _ in range(2)]
    layers = [ReducedLayer(plan, i, 8 ** -0.5) for i in range(2)]
    ingest(layers, keys, values, anchors)
    from transformers.cache_utils import DynamicSlidingWindowLayer

    win = DynamicSlidingWindowLayer(sliding_window=6)
    win.lazy_initialization(keys[0][:, :, :6], values[0][:, :, :6])
    win.keys, win.values, win.cumulative_length = keys[0][:, :, -6:].clone(), values[0][:, :, -6:].clone(), n
    return kvcodec.to_canonical(ReducedCache(None, plan, layers=layers + [win], method="cluster"))


def selected_cache(rng, dtype, n=30, kept=9, appended=5):
    """(1.7) a cache reduced by a one-shot selection, method ``tova``: two full-attention layers of ``n``
    tokens of which ``kept`` (each layer its own, the last token among them) are held in ``fixed``; then
    ``appended`` tokens decoded after the reduction, kept raw: the first 2 in ``sinks``, the rest in
    ``buffer``."""
    from kvcodec.reduction.cache import Plan, ReducedCache, ReducedLayer

    plan = Plan(k=4, block=4, sinks=2, method=None, seed=0, window=0, form="dot")
    layers = []
    for i in range(2):
        keys, values = structured(rng, (1, 2, n, 8), dtype), structured(rng, (1, 2, n, 8), dtype)
        idx = torch.from_numpy(np.sort(np.append(rng.choice(n - 1, kept - 1, replace=False), n - 1)))
        layer = ReducedLayer(plan, i, 8 ** -0.5)
        layer.set_fixed(keys[:, :, idx], values[:, :, idx], n)
        layer.update(structured(rng, (1, 2, appended, 8), dtype), structured(rng, (1, 2, appended, 8), dtype))
        layers.append(layer)
    return kvcodec.to_canonical(ReducedCache(None, plan, layers=layers, method="tova"))


def spread_cache(rng, dtype, n=24, kept=(5, 11, 8)):
    """(1.7.1) a cache reduced by method ``kvzip`` with its budget spread over the layers: three full-attention
    layers of ``n`` tokens holding ``kept`` of them in ``fixed`` (the first 2 among them: the sinks a kvzip
    selection always keeps), nothing appended."""
    from kvcodec.reduction.cache import Plan, ReducedCache, ReducedLayer

    plan = Plan(k=8, block=8, sinks=2, method=None, seed=0, window=0, form="dot")
    layers = []
    for i, e in enumerate(kept):
        keys, values = structured(rng, (1, 2, n, 8), dtype), structured(rng, (1, 2, n, 8), dtype)
        idx = torch.from_numpy(np.sort(np.append(rng.choice(np.arange(2, n), e - 2, replace=False), [0, 1])))
        layer = ReducedLayer(plan, i, 8 ** -0.5)
        layer.set_fixed(keys[:, :, idx], values[:, :, idx], n)
        layers.append(layer)
    return kvcodec.to_canonical(ReducedCache(None, plan, layers=layers, method="kvzip"))


def heads_cache(rng, dtype, n=20, appended=4, counts=(((7, 3, 0), (5, 7, 2)), ((1, 4, 4), (4, 0, 3)))):
    """(1.8) a cache reduced by method ``kvzip`` whose heads keep different numbers of entries: two batch rows
    and two full-attention layers of 3 heads x 8 over ``n`` tokens, head (b, h) of layer l holding
    ``counts[l][b][h]`` of them in ``fixed`` (in token order; the layer's fixed part as long as its longest head,
    the others' absent places zero with log-weight -inf), then ``appended`` tokens raw (2 sinks, 2 buffer)."""
    from kvcodec.reduction.cache import Plan, ReducedCache, ReducedLayer

    plan = Plan(k=8, block=8, sinks=2, method=None, seed=0, window=0, form="dot")
    layers = []
    for i, rows in enumerate(counts):
        c = torch.tensor(rows)
        width = int(c.max())
        keys, values = structured(rng, (2, 3, n, 8), dtype), structured(rng, (2, 3, n, 8), dtype)
        idx = torch.zeros(2, 3, width, dtype=torch.long)
        for b in range(2):
            for h in range(3):
                kept = np.sort(rng.choice(n, int(c[b, h]), replace=False))
                idx[b, h, :len(kept)] = torch.from_numpy(kept)
        present = torch.arange(width)[None, None, :] < c[..., None]
        gk = keys.gather(2, idx[..., None].expand(-1, -1, -1, 8)).masked_fill(~present[..., None], 0)
        gv = values.gather(2, idx[..., None].expand(-1, -1, -1, 8)).masked_fill(~present[..., None], 0)
        layer = ReducedLayer(plan, i, 8 ** -0.5)
        layer.set_fixed(gk, gv, n, torch.zeros(2, 3, width).masked_fill(~present, float("-inf")))
        layer.update(structured(rng, (2, 3, appended, 8), dtype), structured(rng, (2, 3, appended, 8), dtype))
        layers.append(layer)
    return kvcodec.to_canonical(ReducedCache(None, plan, layers=layers, method="kvzip"))


def bounded_cache(rng, dtype, n=16, counts=((5, 3), (4, 4)), recent=2, step=3):
    """(1.11) a cache reduced by method ``kvzip`` with a bound (``recent`` 2, ``step`` 3): two full-attention
    layers of 2 heads x 8 over ``n`` tokens, head h of layer l holding ``counts[l][h]`` of them in ``fixed`` (layer
    0's heads different numbers: ``heads``), fitted-like log-weights, scores drawn at random (the first 2 tokens
    +inf); then 3 tokens appended (2 to ``sinks``), 5 more, every score redrawn, and 1 more, which first compacts
    the layer: the buffer's 4 oldest tokens compete with the fixed entries, the 2 newest stay."""
    from kvcodec.reduction.cache import Plan, ReducedCache, ReducedLayer

    plan = Plan(k=8, block=8, sinks=2, method=None, seed=0, window=0, form="dot", recent=recent, step=step)
    layers = []
    for i, rows in enumerate(counts):
        c = torch.tensor([rows])
        width = int(c.max())
        keys, values = structured(rng, (1, 2, n, 8), dtype), structured(rng, (1, 2, n, 8), dtype)
        idx = torch.zeros(1, 2, width, dtype=torch.long)
        for h in range(2):
            kept = np.sort(np.concatenate([[0, 1], rng.choice(np.arange(2, n), int(c[0, h]) - 2, replace=False)]))
            idx[0, h, :len(kept)] = torch.from_numpy(kept)
        present = torch.arange(width)[None, None, :] < c[..., None]
        gk = keys.gather(2, idx[..., None].expand(-1, -1, -1, 8)).masked_fill(~present[..., None], 0)
        gv = values.gather(2, idx[..., None].expand(-1, -1, -1, 8)).masked_fill(~present[..., None], 0)
        beta = torch.from_numpy(rng.normal(0, 0.5, (1, 2, width)).astype(np.float32)).masked_fill(~present,
                                                                                                     float("-inf"))
        scores = torch.from_numpy(rng.random((1, 2, width)).astype(np.float32))
        scores[..., :2] = float("inf")
        layer = ReducedLayer(plan, i, 8 ** -0.5)
        layer.set_fixed(gk, gv, n, beta, scores.masked_fill(~present, 0.0))
        for m in (3, 5, 1):
            layer.update(structured(rng, (1, 2, m, 8), dtype), structured(rng, (1, 2, m, 8), dtype))
            fresh = torch.from_numpy(rng.random(tuple(layer.scores.shape)).astype(np.float32))
            layer.scores = torch.where(torch.isinf(layer.scores), layer.scores, fresh)
        layers.append(layer)
    return kvcodec.to_canonical(ReducedCache(None, plan, layers=layers, method="kvzip"))


def lossy_cases():
    """Lossy tier: the decoded tensors are defined by spec section 13; their hashes are recorded from the
    decoder and checked against an independent reimplementation in tests/test_lossy.py."""
    rng = np.random.default_rng(5)
    kv = [(structured(rng, (1, 2, 36, 16), torch.bfloat16), structured(rng, (1, 2, 36, 16), torch.bfloat16))]
    # chunks of 16: chunk 0 in Mode 2 (the sink token exact), chunk 1 in Mode 1, chunk 2 (4 tokens) all exact
    yield "lossy_uniform_window", kvcodec.KVCache([k for k, _ in kv], [v for _, v in kv]), \
        {"tier": "lossy", "bits": 5.0, "window": 4, "chunk_tokens": 16}
    kv = [(structured(rng, (1, 1, 10, 6), torch.float16), structured(rng, (1, 1, 10, 6), torch.float16))]
    yield "lossy_kivi", kvcodec.KVCache([k for k, _ in kv], [v for _, v in kv]), \
        {"tier": "lossy", "quantizer": "kivi", "kivi_bits": 3, "group": 4, "sink": 0}
    kv = [(structured(rng, (1, 2, 12, 8), torch.float32), structured(rng, (1, 2, 12, 8), torch.float32))]
    yield "lossy_lloyd", kvcodec.KVCache([k for k, _ in kv], [v for _, v in kv]), \
        {"tier": "lossy", "quantizer": "lloyd", "lloyd_bits": 2, "sink": 0}
    kv = [(structured(rng, (1, 2, 9, 6), torch.bfloat16), structured(rng, (1, 2, 9, 6), torch.bfloat16))]
    yield "lossy_cachegen", kvcodec.KVCache([k for k, _ in kv], [v for _, v in kv]), \
        {"tier": "lossy", "quantizer": "cachegen", "sink": 0, "window": 2}
    # (1.4) a reduced cache's atoms quantized; its log-weights and anchors stay exact
    yield "lossy_reduced", reduced_cache(rng, torch.float16), {"tier": "lossy", "quantizer": "kivi", "kivi_bits": 3,
                                                                "group": 4, "sink": 0}
    # (1.8) heads holding different numbers of entries, quantized head by head (a fresh generator: the cases
    # after it keep theirs)
    yield "lossy_heads", heads_cache(np.random.default_rng(12), torch.float16), \
        {"tier": "lossy", "quantizer": "kivi", "kivi_bits": 3, "group": 4, "sink": 0, "chunk_tokens": 4}
    # (1.5) quantizer "weighted": keys in Method 5 with per-channel steps from a profile, values in Method 1
    kv = [(structured(rng, (1, 2, 20, 8), torch.float32), structured(rng, (1, 2, 20, 8), torch.float32))]
    profile = kvcodec.Profile([rng.uniform(0.2, 3.0, (2, 8)).astype(np.float32)], model=None, tokens=0)
    yield "lossy_weighted", kvcodec.KVCache([k for k, _ in kv], [v for _, v in kv]), \
        {"tier": "lossy", "quantizer": "weighted", "step": 0.3, "profile": profile}
    # (1.6) predicted slices (spec section 13.1): layer 1 a linear image of layer 0 (so the prediction pays), random
    # float16 predictors recorded beside the file, sink token and a 2-token window exact, 2 chunks
    from kvcodec import predict as P

    h, t, d = 2, 14, 8
    theta = 1.0 / (100.0 ** (np.arange(0, d, 2) / d))
    start, scale = 300, 0.875  # positions 300 .. 313 and a rotary scale other than 1: both in the recurrence
    cos, sin = P.rope_tables(np.cos(theta), np.sin(theta), scale, start, t)
    pre0 = rng.normal(size=(h, t, d)).astype(np.float32)
    mix = rng.normal(size=(h * d, h * d)).astype(np.float32) * 0.3
    pre1 = P.unflat(P.flat(pre0) @ mix + rng.normal(size=(t, h * d)).astype(np.float32) * 0.05, h)
    v0 = rng.normal(size=(h, t, d)).astype(np.float32)
    v1 = (v0 * 0.5 + rng.normal(size=(h, t, d)) * 0.1).astype(np.float32)
    kv = [(torch.from_numpy(P.rotate(pre, cos, sin))[None], torch.from_numpy(v)[None])
          for pre, v in ((pre0, v0), (pre1, v1))]
    f16 = np.float16
    pred = P.Predictors(
        [(np.zeros((0, h * d), f16), (rng.normal(size=h * d) * 0.1).astype(f16)),
         (mix.astype(f16), np.zeros(h * d, f16))],
        [((rng.normal(size=(h * d, h * d)) * 0.05).astype(f16), np.zeros(h * d, f16)),
         ((rng.normal(size=(2 * h * d, h * d)) * 0.05).astype(f16), (rng.normal(size=h * d) * 0.01).astype(f16))],
        np.cos(theta), np.sin(theta), scale, {"note": "random predictors of the golden vector lossy_predicted"})
    profile = kvcodec.Profile([rng.uniform(0.2, 3.0, (h, d)).astype(np.float32) for _ in range(2)], model=None,
                              tokens=0)
    yield "lossy_predicted", kvcodec.KVCache([k for k, _ in kv], [v for _, v in kv], start_position=start), \
        {"tier": "lossy", "quantizer": "weighted", "step": 0.3, "key_ratio": 0.15, "profile": profile,
         "predictors": pred, "window": 2, "chunk_tokens": 8}


def tiny():
    """The smallest useful file, dumped in hex in spec/kvz.md Appendix A."""
    k = torch.tensor([[[[1.0], [-2.0]]]], dtype=torch.float16)
    v = torch.tensor([[[[0.5], [0.25]]]], dtype=torch.float16)
    return kvcodec.KVCache([k], [v])


MODEL_DIR = OUT / "models" / "tiny-llama"
MAMBA_DIR = OUT / "models" / "tiny-mamba"


def tiny_model():
    """The tiny Llama the token-tier vectors need at decode (written once; an input, like the tensors)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if not (MODEL_DIR / "model.safetensors").is_file():
        torch.manual_seed(20261129)
        cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
        LlamaForCausalLM(cfg).save_pretrained(MODEL_DIR)
    return LlamaForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()


def tiny_mamba():
    """The tiny Mamba of ``exact_state`` (state-space layers only: its cache is conv and recurrent state)."""
    from transformers import MambaConfig, MambaForCausalLM

    if not (MAMBA_DIR / "model.safetensors").is_file():
        torch.manual_seed(20261130)
        cfg = MambaConfig(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2,
                          conv_kernel=4, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        MambaForCausalLM(cfg).save_pretrained(MAMBA_DIR)
    return MambaForCausalLM.from_pretrained(MAMBA_DIR, dtype=torch.float32).eval()


@torch.no_grad()
def run_schedule(model, ids, schedule, padding=None):
    """The cache of feeding ``ids`` by the calls of ``schedule`` (left padding with generate()'s positions)."""
    from kvcodec.tokens.plan import Plan, replay

    plan = Plan(schedule, padding or [0] * ids.shape[0], "mask", 0)
    return replay(model, ids, plan)


def token_cases():
    """Token-tier cases: (name, cache, encode options).  Inputs from PCG64 and the shipped tiny model."""
    rng = np.random.default_rng(11292026)
    model = tiny_model()
    ids = torch.from_numpy(rng.integers(0, 64, size=(1, 20)))
    yield "exact_static_prefill", model, run_schedule(model, ids, [20]), {"token_model": "static"}
    ids = torch.from_numpy(rng.integers(0, 64, size=(1, 17)))
    sched = [12] + [1] * 5
    cache = run_schedule(model, ids, sched)
    yield "exact_lm_steps", model, cache, {"token_model": "lm", "schedule": [[12, 1], [1, 5]]}
    yield "exact_lm_residual", model, cache, {"token_model": "lm", "schedule": [[17, 1]]}  # wrong on purpose
    # residual Mode 2: layer 1's keys are noise the model does not reproduce (stored as floats, not as residuals)
    noisy = kvcodec.to_canonical(cache)
    g = torch.Generator().manual_seed(7)
    noisy.keys[1] = torch.randn(noisy.keys[1].shape, generator=g) * 1e3
    yield "exact_lm_noise", model, noisy, {"token_model": "lm", "schedule": [[12, 1], [1, 5]]}
    ids = torch.from_numpy(rng.integers(1, 64, size=(2, 15)))
    ids[1, :3] = 0
    cache = run_schedule(model, ids, [11] + [1] * 4, padding=[0, 3])
    mask = torch.ones(2, 15, dtype=torch.long)
    mask[1, :3] = 0
    yield "tokens_tolerance_padded", model, cache, {"token_model": "static", "tier": "tokens", "tolerance": 1e-8,
                                                    "schedule": [[15, 1]], "attention_mask": mask.tolist()}
    # (1.9) token model blocks: two rows (the second left-padded by 3), blocks of 4 tokens (rows of 15 and 12
    # coded tokens: blocks of 4, 4, 4, 3 and 4, 4, 4), the cache filled by a prefill and single steps
    yield "exact_blocks_padded", model, cache, {"token_model": "blocks", "block_tokens": 4,
                                                "schedule": [[11, 1], [1, 4]], "attention_mask": mask.tolist()}
    # (1.3) state only: layer 0's states are regenerated, layer 1's recurrent state is perturbed, so the file
    # stores it whole in a state section
    mamba = tiny_mamba()
    ids = torch.from_numpy(rng.integers(0, 64, size=(1, 10)))
    kv = kvcodec.to_canonical(run_schedule(mamba, ids, [10]))
    kv.states[1].recurrent[0] = kv.states[1].recurrent[0] + 1.0
    yield "exact_state", mamba, kv, {"token_model": "static", "tokens": ids.tolist()}


def states_meta(kv) -> dict:
    """``states_sha256`` (files with layer states only): per layer null, or the SHA-256 of each state tensor's
    bytes in state order."""
    if not kv.has_state:
        return {}
    return {"states_sha256": [None if st is None else [sha(t) for _, _, t in st.tensors()] for st in kv.states]}


def tensors(kv) -> dict:
    """A cache as named tensors for safetensors: ``keys.<layer>``, ``values.<layer>`` and, for layers with
    state, ``state.<layer>.<index>`` in state order."""
    out = {f"keys.{i}": k.contiguous() for i, k in enumerate(kv.keys)}
    out.update({f"values.{i}": v.contiguous() for i, v in enumerate(kv.values)})
    for i, st in enumerate(kv.states):
        if st is not None:
            out.update({f"state.{i}.{j}": t.contiguous() for j, (_, _, t) in enumerate(st.tensors())})
    return out


def _safetensors(kv) -> bytes:
    from safetensors.torch import save

    return save(tensors(kv))


def engine_state() -> tuple[bytes, dict]:
    """(1.10) A llama.cpp sequence state file written here by hand (spec section 15.1): 5 tokens, 2 layers of 2
    KV heads x 4 float16 (structured values), keys as rows, values transposed (``v_trans`` 1); and the GGUF
    record it is packed with (the SHA-256 of a stand-in model file)."""
    import struct

    rng = np.random.default_rng(1010)
    cells, layers, heads, dim = 5, 2, 2, 4
    out = [struct.pack("<III", 0x67677371, 3, cells), np.arange(100, 100 + cells, dtype="<i4").tobytes(),
           struct.pack("<II", 1, cells)]
    out += [struct.pack("<iIi", i, 1, 0) for i in range(cells)]
    out.append(struct.pack("<II", 1, layers))
    keys, values = [], []
    for _ in range(layers):
        k = (rng.standard_normal((cells, heads * dim)) * 2).astype("<f2")
        out.append(struct.pack("<iQ", 1, heads * dim * 2) + k.tobytes())
        keys.append(torch.from_numpy(k.reshape(cells, heads, dim).transpose(1, 0, 2).copy())[None])
    for _ in range(layers):
        v = rng.standard_normal((cells, heads * dim)).astype("<f2")
        out.append(struct.pack("<iII", 1, 2, heads * dim) + v.T.copy().tobytes())
        values.append(torch.from_numpy(v.reshape(cells, heads, dim).transpose(1, 0, 2).copy())[None])
    record = {"file_sha256": hashlib.sha256(b"a stand-in for a GGUF file").hexdigest(), "name": "tiny",
              "architecture": "llama",
              "geometry": {"layers": layers, "kv_heads": [heads] * layers, "k_dim": dim, "v_dim": dim}}
    return b"".join(out), record, keys, values


def build():
    """Yield (name, file bytes, meta, {suffix: extra file bytes})."""
    from kvcodec import llama_cpp

    state, record, keys, values = engine_state()
    data = llama_cpp.pack_bytes(state, record, info=INFO, threads=1, scale_bits=12)
    yield "engine_llama_seq", data, {
        "options": {"tier": "lossless", "scale_bits": 12, "threads": 1, "model": record}, "dtype": "float16",
        "file_sha256": hashlib.sha256(data).hexdigest(),
        # the layers as spec section 15 reads them out of the state file (computed here from its values)
        "keys_sha256": [sha(t) for t in keys], "values_sha256": [sha(t) for t in values],
        "engine_file_sha256": hashlib.sha256(state).hexdigest(), "tokens": None, "start_position": 0,
    }, {"engine.bin": state}
    for name, model, cache, opts in token_cases():
        kv = kvcodec.to_canonical(cache)
        enc = dict(opts)
        for key in ("attention_mask", "tokens"):
            if key in enc:
                enc[key] = torch.tensor(enc[key])
        data = kvcodec.encode(cache, model, info=INFO, **enc)
        with kvcodec.open_kvz(data, model) as f:
            regen = f.regenerated()
        back = kvcodec.decode(data, model, output="kvcache")
        meta = {
            "options": opts,
            "model": "models/tiny-mamba" if model.config.model_type == "mamba" else "models/tiny-llama",
            "dtype": kv.dtype_name,
            "file_sha256": hashlib.sha256(data).hexdigest(),
            "keys_sha256": [sha(t) for t in kv.keys],
            "values_sha256": [sha(t) for t in kv.values],
            "tokens": back.tokens.tolist(),
            "start_position": 0,
            **states_meta(kv),
        }
        yield name, data, meta, {"regen.safetensors": _safetensors(regen)}
    for name, kv, opts in list(cases()) + [("fp16_tiny", tiny(), {})] + list(lossy_cases()):
        if opts.get("tier", "lossless") == "lossless":
            # the lossless vectors were made when the tier's default Scale_Bits was 12 (now 10): pinned, so the
            # files stay byte for byte what they were (Scale_Bits is in each payload; any value 8..15 decodes)
            opts = {"scale_bits": 12, **opts}
        data = kvcodec.encode(kv, info=INFO, threads=1, **opts)
        if opts.get("tier") == "lossy":
            pred = opts.get("predictors")
            out = kvcodec.decode(data, output="kvcache", predictors=pred)
            shown = {**opts, "profile": json.loads(opts["profile"].to_json())} if "profile" in opts else opts
            extra = {"input.safetensors": _safetensors(kv)}
            if pred is not None:  # the predictors beside the file, named in the options by their SHA-256
                from kvcodec import predict as P

                extra["predictors.safetensors"] = P.to_bytes(pred)
                shown = {**shown, "predictors": P.identity(extra["predictors.safetensors"])}
            meta = {"options": shown, "dtype": kv.dtype_name, "file_sha256": hashlib.sha256(data).hexdigest(),
                    "keys_sha256": [sha(t) for t in out.keys], "values_sha256": [sha(t) for t in out.values],
                    "input_keys_sha256": [sha(t) for t in kv.keys], "input_values_sha256": [sha(t) for t in kv.values],
                    "tokens": None, "start_position": kv.start_position, **states_meta(kv)}
            yield name, data, meta, extra
            continue
        meta = {
            "options": opts,
            "dtype": kv.dtype_name,
            "file_sha256": hashlib.sha256(data).hexdigest(),
            "keys_sha256": [sha(t) for t in kv.keys],
            "values_sha256": [sha(t) for t in kv.values],
            "tokens": None if kv.tokens is None else kv.tokens.tolist(),
            "start_position": kv.start_position,
            **states_meta(kv),
        }
        yield name, data, meta, {}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--only", nargs="+", metavar="CASE",
                    help="write only these cases (new vectors, added on purpose without touching the others; the "
                         "numerics-bound ones depend on the machine that writes them)")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    changed = 0
    for name, data, meta, extra in build():
        if args.only and name not in args.only:
            continue
        files = {OUT / f"{name}.kvz": data, OUT / f"{name}.json": (json.dumps(meta, indent=2, sort_keys=True)
                                                                    + "\n").encode()}
        files.update({OUT / f"{name}.{suffix}": b for suffix, b in extra.items()})
        same = all(p.is_file() and p.read_bytes() == b for p, b in files.items())
        changed += not same
        if args.check:
            print(f"{name}: {'unchanged' if same else 'WOULD CHANGE'}")
            continue
        for p, b in files.items():
            p.write_bytes(b)
        print(f"{name}: {len(data)} bytes{'' if same else ' (rewritten)'}")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
