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

    python scripts/make_vectors.py               # rewrite all vectors
    python scripts/make_vectors.py --check       # exit 1 if any vector would change
    python scripts/make_vectors.py --only A B    # write only the vectors A and B (a new vector, on purpose)
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
    """(1.8) a cache reduced by method ``kvzip`` whose heads keep different numbers of entries: batch rows
    and full-attention layers of heads x 8 over ``n`` tokens (as many as ``counts`` has: by default two rows, two
    layers, 3 heads), head (b, h) of layer l holding
    ``counts[l][b][h]`` of them in ``fixed`` (in token order; the layer's fixed part as long as its longest head,
    the others' absent places zero with log-weight -inf), then ``appended`` tokens raw (2 sinks, 2 buffer)."""
    from kvcodec.reduction.cache import Plan, ReducedCache, ReducedLayer

    plan = Plan(k=8, block=8, sinks=2, method=None, seed=0, window=0, form="dot")
    layers = []
    nb, nh = len(counts[0]), len(counts[0][0])  # batch rows and heads (2 and 3 unless counts says otherwise)
    for i, rows in enumerate(counts):
        c = torch.tensor(rows)
        width = int(c.max())
        keys, values = structured(rng, (nb, nh, n, 8), dtype), structured(rng, (nb, nh, n, 8), dtype)
        idx = torch.zeros(nb, nh, width, dtype=torch.long)
        for b in range(nb):
            for h in range(nh):
                kept = np.sort(rng.choice(n, int(c[b, h]), replace=False))
                idx[b, h, :len(kept)] = torch.from_numpy(kept)
        present = torch.arange(width)[None, None, :] < c[..., None]
        gk = keys.gather(2, idx[..., None].expand(-1, -1, -1, 8)).masked_fill(~present[..., None], 0)
        gv = values.gather(2, idx[..., None].expand(-1, -1, -1, 8)).masked_fill(~present[..., None], 0)
        layer = ReducedLayer(plan, i, 8 ** -0.5)
        layer.set_fixed(gk, gv, n, torch.zeros(nb, nh, width).masked_fill(~present, float("-inf")))
        layer.update(structured(rng, (nb, nh, appended, 8), dtype), structured(rng, (nb, nh, appended, 8), dtype))
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


def _llama(path, seed: int, **config):
    """A tiny Llama written once to ``path`` from ``seed`` and ``config`` (an input, like the tensors), loaded in
    float32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if not (path / "model.safetensors").is_file():
        torch.manual_seed(seed)
        LlamaForCausalLM(LlamaConfig(max_position_embeddings=128, **config)).save_pretrained(path)
    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def tiny_model():
    """The tiny Llama the token-tier vectors need at decode."""
    return _llama(MODEL_DIR, 20261129, vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1)


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


# --- issue 51, item 2: vectors that pin rules no earlier vector pinned (spec/kvz.md, Appendix A) -----------
# Each of these is written on purpose (``--only NAME``) and never changes the earlier vectors' inputs: every case
# has its own generator.  scripts/studies/vector_rules.py decodes each with its rule broken and shows that the
# recorded hashes (or token ids) then differ.

VOCAB_DIR = OUT / "models" / "tiny-llama-v49152"
DRAFT_DIR = OUT / "models" / "tiny-llama-draft"
#: the start position of ``lossy_predicted_far``: its 16 positions 84442 .. 84457 hold two (84444 and 84457) whose
#: binary32 cos / sin by the recurrence of spec 13.1 differ from a direct binary64 cos(p * theta), theta =
#: atan2(sin_theta, cos_theta) (and three, 84446 too, for the theta the predictors were made from); scanning up
#: from position 0, the first 16-position window with two (scripts/studies/vector_rules.py)
PREDICTED_FAR_START = 84442


def vocab_model():
    """A Llama with a real vocabulary (49152, SmolLM2's) and almost nothing else (hidden size 2, one layer, one
    key-value head of dimension 2, tied embeddings): 394 KB of float32 weights.  At V = 64 the uniform
    distribution 1/V and every sum of it are exact; at 49152 they are not (spec 11.2, 11.2.1)."""
    return _llama(VOCAB_DIR, 49152, vocab_size=49152, hidden_size=2, intermediate_size=4, num_hidden_layers=1,
                  num_attention_heads=1, num_key_value_heads=1, head_dim=2, tie_word_embeddings=True)


def draft_model():
    """A draft model for ``exact_draft_padded``: another tiny Llama with the tiny Llama's vocabulary (64), one
    layer, other weights; its distributions differ from the model's, so a decoder that codes with the model
    instead of the draft fails."""
    return _llama(DRAFT_DIR, 20261201, vocab_size=64, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1)


def order2_tokens(rng, n: int, symbols=(3, 17, 42, 9, 58)) -> list[int]:
    """``n`` token ids of a random order-2 Markov chain over a few ``symbols``: pairs of tokens recur with
    different followers, so the static model's order-2 contexts (spec 11.2, ``static-wb-o2-v1``) have counts
    and apply after the order-1 ones at most positions."""
    nxt = {(a, b): rng.permutation(symbols)[:2] for a in symbols for b in symbols}
    out = [int(x) for x in rng.choice(symbols, 2)]
    while len(out) < n:
        cand = nxt[(out[-2], out[-1])]
        out.append(int(cand[0] if rng.random() < 0.7 else rng.choice(symbols)))
    return out


def pinning_token_cases():
    """Token-tier cases of issue 51 item 2: (name, model, cache, encode options, extra); ``extra`` may hold
    ``draft`` (the draft model) and ``mode0`` (the (layer, part) slices whose residual is written in Mode 0)."""
    model = tiny_model()
    rng = np.random.default_rng(512)
    # tier tokens with a tolerance that zeroes residuals; static model with order-2 contexts; a Mode 0 residual.
    # Layer 0's keys are moved by 1e-6 (within the tolerance: zeroed, the reconstruction keeps the regeneration)
    # and at a few places by 0.05 (kept); layer 1's values by 1e-6 only, so their residual is all zero: the
    # reference encoder omits such a section, this case writes it in Mode 0 on purpose (spec 12)
    ids = torch.tensor([order2_tokens(rng, 24)])
    kv = kvcodec.to_canonical(run_schedule(model, ids, [24]))
    small = torch.from_numpy(rng.choice([-1e-6, 1e-6], size=tuple(kv.keys[0].shape)).astype(np.float32))
    big = torch.from_numpy((rng.random(tuple(kv.keys[0].shape)) < 0.1) * rng.normal(0, 0.05, tuple(kv.keys[0].shape)))
    kv.keys[0] = kv.keys[0] + small + big.float()
    kv.values[1] = kv.values[1] + torch.from_numpy(rng.choice([-1e-6, 1e-6], size=tuple(kv.values[1].shape))).float()
    yield "tokens_tolerance_zeroed", model, kv, {"token_model": "static", "tier": "tokens", "tolerance": 1e-4,
                                                  "schedule": [[24, 1]]}, {"mode0": [(1, 1)]}
    # static model, tier exact: order-2 contexts, and a token whose frequency depends on the order-0 term's
    # rounding: the order-0 term (c0 + d0/V) / (n0 + d0), as spec 11.2 writes it, and (1/V) * (d0 / (n0 + d0)) +
    # c0 / (n0 + d0), equal in exact arithmetic, round differently at this sequence's position 19, and of the 24-bit
    # cumulative frequencies there C[48] moves (3 of the first 3000 generators give such a position, none of the
    # first 30000 codes a token there whose interval moves: so token 19 is set to 48, an unseen token); the 20
    # tokens after it let the one-unit shift of the coder's interval reach a later token's boundary
    ids = order2_tokens(np.random.default_rng(463), 40)
    ids[19] = 48
    ids = torch.tensor([ids])
    yield "exact_static_order2", model, run_schedule(model, ids, [40]), {"token_model": "static"}, {}
    # token model blocks at a real vocabulary (49152), blocks of 2: the first token of every block is coded with
    # the uniform distribution 1.0/V (portable: no model call), the second with the model's softmax
    vm = vocab_model()
    ids = torch.from_numpy(rng.integers(0, 49152, size=(1, 40)))
    yield "exact_blocks_v49152", vm, run_schedule(vm, ids, [40]), {"token_model": "blocks", "block_tokens": 2,
                                                                    "schedule": [[40, 1]]}, {}
    # token model draft: two rows, the second left-padded by 3, each coded alone by the draft model one token
    # per call (lm-incremental-v1), the cache filled by a prefill and single steps
    ids = torch.from_numpy(rng.integers(1, 64, size=(2, 14)))
    ids[1, :3] = 0
    mask = torch.ones(2, 14, dtype=torch.long)
    mask[1, :3] = 0
    cache = run_schedule(model, ids, [10] + [1] * 4, padding=[0, 3])
    yield "exact_draft_padded", model, cache, {"token_model": "draft", "schedule": [[10, 1], [1, 4]],
                                               "attention_mask": mask.tolist()}, {"draft": draft_model()}


def kivi_rounding_cache(rng):
    """float16 keys and values [1, 1, 9, 8] in which one KIVI group of each axis is {2^-24, 1, 2, 3.0078125}: its
    minimum 2^-24, its scale float16(3.0078125 / 3) = 1027/1024 and its top index 3, so min + 3 * scale is
    3.0087890625 + 2^-24, which binary32 rounds to 3.0087890625, a float16 tie that rounds to even, 3.0078125;
    one rounding of the exact value to float16 gives 3.009765625 (spec 13, Method 3: binary32, then dtype)."""
    k = structured(rng, (1, 1, 9, 8), torch.float16)
    v = structured(rng, (1, 1, 9, 8), torch.float16)
    crafted = torch.tensor([2.0 ** -24, 1.0, 2.0, 3.0078125], dtype=torch.float16)
    k[0, 0, 1:5, 0] = crafted  # keys: axis 0, channel 0 over the first 4 quantized tokens (token 0 is the head)
    v[0, 0, 1, 0:4] = crafted  # values: axis 1, token 1 over channels 0 .. 3
    return kvcodec.KVCache([k], [v])


def predicted_far_case(rng, start=PREDICTED_FAR_START):
    """(1.6) a predicted file at positions ``start`` .. ``start`` + 15: one float32 layer of 2 heads x 8 (angles
    100^(-2i/8), predictors' scale 0.875), the first token exact.  Head 1's keys lie in the first half of each
    rotary pair (the second half 0 before RoPE, and decoded as exactly 0), so its rotated keys are u * cos and
    u * sin alone: a cos or sin that differs by one unit in binary32 changes them (where both halves hold
    values, as in head 0, a pair's cos or sin differs only near its zero, where that term vanishes in the sum).
    (KVCache, options)."""
    from kvcodec import predict as P

    h, t, d = 2, 16, 8
    theta = 1.0 / (100.0 ** (np.arange(0, d, 2) / d))
    cos, sin = P.rope_tables(np.cos(theta), np.sin(theta), 0.875, start, t)
    pre = rng.normal(size=(h, t, d)).astype(np.float32)
    v = (pre * 0.5 + rng.normal(size=(h, t, d)) * 0.1).astype(np.float32)
    pre[1, :, d // 2:] = 0  # head 1's second halves zero: its rotated keys are u cos and u sin, one product each
    kv = kvcodec.KVCache([torch.from_numpy(P.rotate(pre, cos, sin))[None]], [torch.from_numpy(v)[None]],
                         start_position=start)
    f16 = np.float16
    kbias = (rng.normal(size=h * d) * 0.1).astype(f16)
    kbias[d + d // 2:] = 0  # (with a zero prediction there, k~ is exactly 0)
    pred = P.Predictors(
        [(np.zeros((0, h * d), f16), kbias)],
        [((rng.normal(size=(h * d, h * d)) * 0.05).astype(f16), (rng.normal(size=h * d) * 0.01).astype(f16))],
        np.cos(theta), np.sin(theta), 0.875, {"note": "random predictors of the golden vector lossy_predicted_far"})
    profile = kvcodec.Profile([rng.uniform(0.2, 3.0, (h, d)).astype(np.float32)], model=None, tokens=0)
    return kv, {"tier": "lossy", "quantizer": "weighted", "step": 0.3, "key_ratio": 0.15, "profile": profile,
                "predictors": pred, "window": 0}


def pinning_cases():
    """Lossless and lossy cases of issue 51 item 2: (name, cache, options)."""
    rng = np.random.default_rng(5151)
    # (1.8) a per-head layer whose payloads are coded (Mode 1): one batch row, 2 heads x 8 over 100 tokens,
    # holding 90 and 20 of them, then 4 appended: head 0's 94 entries in Mode 1, head 1's 24 raw (Mode 0)
    yield "lossless_heads_coded", heads_cache(np.random.default_rng(13), torch.bfloat16, n=100,
                                              counts=(((90, 20),),)), {}
    # Mode 2 (the first token exact) with Method 2 (Lloyd-Max), float32
    kv = [(structured(rng, (1, 2, 6, 8), torch.float32), structured(rng, (1, 2, 6, 8), torch.float32))]
    yield "lossy_lloyd_head", kvcodec.KVCache([k for k, _ in kv], [v for _, v in kv]), \
        {"tier": "lossy", "quantizer": "lloyd", "lloyd_bits": 2}
    # Mode 2 with Method 3 (KIVI, 2 bits, groups of 4), float16 with a group whose value needs binary32 first
    yield "lossy_kivi_rounding", kivi_rounding_cache(rng), {"tier": "lossy", "quantizer": "kivi", "kivi_bits": 2,
                                                            "group": 4}
    # Mode 2 with Method 4 (CacheGen) and odd Bins: keys 7 bins (half 3), values 5 (half 2)
    kv = [(structured(rng, (1, 2, 7, 6), torch.bfloat16), structured(rng, (1, 2, 7, 6), torch.bfloat16))]
    yield "lossy_cachegen_odd", kvcodec.KVCache([k for k, _ in kv], [v for _, v in kv]), \
        {"tier": "lossy", "quantizer": "cachegen", "cachegen_bins": [7, 5], "cachegen_key_fine": 1.0,
         "cachegen_value_fine": 0.0}
    # Sign_Rule 0, a file stamped 1.1 (Method 1, no exact token): written by sign_rule_0 below
    kv = [(structured(rng, (1, 1, 6, 8), torch.float32), structured(rng, (1, 1, 6, 8), torch.float32))]
    yield "lossy_sign_rule0", kvcodec.KVCache([k for k, _ in kv], [v for _, v in kv]), \
        {"tier": "lossy", "step": 0.25, "sink": 0}
    # (1.6) predicted slices far from position 0, where the recurrence of spec 13.1 and a direct cos(p theta) differ
    yield ("lossy_predicted_far", *predicted_far_case(rng))


#: cases written with Sign_Rule 0 and stamped 1.1 (``sign_rule_0``); their JSON says so (``sign_rule``: 0)
SIGN_RULE_0 = ("lossy_sign_rule0",)


def sign_rule_0(encode):
    """``encode()`` (a call of ``kvcodec.encode`` for tier lossy) as a format 1.1 writer made it: the rotation's
    signs by Sign_Rule 0 (NumPy's PCG64, spec 13) in every payload, the file stamped 1.1 (Version_Minor 1, the
    header checksum and the footer's checksum resealed).  Tests call it to re-encode ``lossy_sign_rule0``."""
    import struct

    from kvcodec.codecs import hadamard, vq_rans
    from kvcodec.container import layout as L

    saved = vq_rans.SIGN_RULE, vq_rans.signs
    vq_rans.SIGN_RULE = 0
    vq_rans.signs = lambda seed, d, rule=0: hadamard.signs(seed, d, rule)
    try:
        data = bytearray(encode())
    finally:
        vq_rans.SIGN_RULE, vq_rans.signs = saved
    struct.pack_into("<H", data, 10, 1)
    hend = 16 + struct.unpack_from("<I", data, 12)[0]
    hsum = L.xxh3(bytes(data[:hend]))
    struct.pack_into("<Q", data, hend, hsum)
    index_offset, file_length = struct.unpack_from("<QQ", data, len(data) - 32)
    struct.pack_into("<Q", data, len(data) - 16, L.footer_checksum(index_offset, file_length, hsum))
    return bytes(data)


def mode0_residuals(slices):
    """A context in which the reference encoder writes the residual of each (layer, part) of ``slices`` whose
    residual is all zero as a Mode 0 section (spec 12: "a writer omits the section instead"), on purpose."""
    import contextlib

    from kvcodec.codecs.int_residual_rans import IntResidualRans

    @contextlib.contextmanager
    def ctx():
        real = IntResidualRans.encode

        def encode(self, t, where, prediction=None):
            out = real(self, t, where, prediction)
            return bytes([0]) if out is None and (where.layer, where.part) in slices else out

        IntResidualRans.encode = encode
        try:
            yield
        finally:
            IntResidualRans.encode = real

    return ctx()


def model_dir(model) -> str:
    """The shipped model's directory relative to spec/vectors (``model`` in a token-tier JSON)."""
    return Path(model.config._name_or_path).resolve().relative_to(OUT.resolve()).as_posix()


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
    for name, model, cache, opts, extra in [(*c, {}) for c in token_cases()] + list(pinning_token_cases()):
        kv = kvcodec.to_canonical(cache)
        enc = dict(opts)
        for key in ("attention_mask", "tokens"):
            if key in enc:
                enc[key] = torch.tensor(enc[key])
        draft = extra.get("draft")
        if draft is not None:
            enc["draft"] = draft
        with mode0_residuals(set(extra.get("mode0", ()))):
            data = kvcodec.encode(cache, model, info=INFO, **enc)
        with kvcodec.open_kvz(data, model, draft=draft) as f:
            regen = f.regenerated()
            # what a decoder produces from the recorded regeneration: the input (tier exact), or with a tolerance
            # the reconstruction the encoder computed (spec 5.4), which may differ from the input
            out = f.to_kvcache(regenerated=regen)
        back = kvcodec.decode(data, model, draft=draft, output="kvcache")
        meta = {
            "options": opts,
            "model": model_dir(model),
            "dtype": kv.dtype_name,
            "file_sha256": hashlib.sha256(data).hexdigest(),
            "keys_sha256": [sha(t) for t in out.keys],
            "values_sha256": [sha(t) for t in out.values],
            "tokens": back.tokens.tolist(),
            "start_position": 0,
            **states_meta(kv),
        }
        if not out.equal(kv):  # a tolerance zeroed residuals: the input's hashes beside the reconstruction's
            meta.update(input_keys_sha256=[sha(t) for t in kv.keys], input_values_sha256=[sha(t) for t in kv.values])
        if draft is not None:
            meta["draft_model"] = model_dir(draft)
        if extra.get("mode0"):  # written on purpose (spec 12: the reference encoder omits such a section)
            meta["mode0_residuals"] = [list(x) for x in extra["mode0"]]
        yield name, data, meta, {"regen.safetensors": _safetensors(regen)}
    for name, kv, opts in list(cases()) + [("fp16_tiny", tiny(), {})] + list(lossy_cases()) + list(pinning_cases()):
        if opts.get("tier", "lossless") == "lossless":
            # the lossless vectors were made when the tier's default Scale_Bits was 12 (now 10): pinned, so the
            # files stay byte for byte what they were (Scale_Bits is in each payload; any value 8..15 decodes)
            opts = {"scale_bits": 12, **opts}
        if name in SIGN_RULE_0:
            data = sign_rule_0(lambda kv=kv, opts=opts: kvcodec.encode(kv, info=INFO, threads=1, **opts))
        else:
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
            if name in SIGN_RULE_0:
                meta["sign_rule"] = 0
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
