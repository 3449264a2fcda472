"""Shared helpers: tiny random HF models, caches, and file corruption."""

from __future__ import annotations

import torch

VOCAB = 128


def tiny_model(kind: str, dtype=torch.float32):
    """A tiny randomly initialised causal LM of the given layout (seconds to build and run)."""
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(1234)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=512)
    if kind == "llama":  # GQA: 4 query heads share 2 kv heads
        m = LlamaForCausalLM(LlamaConfig(num_key_value_heads=2, **common))
    elif kind == "qwen2":  # MQA, with biases on q/k/v
        m = Qwen2ForCausalLM(Qwen2Config(num_key_value_heads=1, **common))
    elif kind == "qwen2_mixed":  # one full-attention layer, one sliding-window layer
        m = Qwen2ForCausalLM(Qwen2Config(num_key_value_heads=2, sliding_window=8, use_sliding_window=True,
                                         layer_types=["full_attention", "sliding_attention"], **common))
    elif kind == "mistral_sw":  # every layer sliding-window
        m = MistralForCausalLM(MistralConfig(num_key_value_heads=2, sliding_window=8, **common))
    elif kind == "gpt2":  # absolute positions, no GQA
        m = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=512,
                                       bos_token_id=0, eos_token_id=0))
    else:
        raise ValueError(kind)
    return m.to(dtype).eval()


@torch.no_grad()
def model_cache(model, ids):
    out = model(ids, use_cache=True)
    return out["cache"] if "cache" in out else out["past_key_values"]


def recorded_generate(model, ids, new, pad_token_id=0, **kw):
    """Greedy generation into a :class:`kvcodec.tokens.RecordingCache`: (the cache, the output ids)."""
    from kvcodec.tokens import RecordingCache
    from kvcodec.tokens.plan import cache_kwarg

    rec = RecordingCache(config=model.config)
    out = model.generate(ids, **{cache_kwarg(model): rec}, max_new_tokens=new, do_sample=False,
                         pad_token_id=pad_token_id, **kw)
    return rec, out


def greedy_from(model, ids, original, restored, new, pad_token_id=0):
    """Greedy continuations of ``ids`` from a copy of ``original`` and from ``restored``."""
    import copy

    from kvcodec.tokens.plan import cache_kwarg

    kw = dict(max_new_tokens=new, do_sample=False, pad_token_id=pad_token_id)
    return (model.generate(ids, **{cache_kwarg(model): copy.deepcopy(original)}, **kw),
            model.generate(ids, **{cache_kwarg(model): restored}, **kw))


def random_cache(layers=2, batch=1, heads=2, seq=16, dim=8, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, heads, seq, dim, generator=g).to(dtype) * 3,
             torch.randn(batch, heads, seq, dim, generator=g).to(dtype)) for _ in range(layers)]


def flip_bit(data: bytes, bit: int) -> bytes:
    b = bytearray(data)
    b[bit // 8] ^= 1 << (bit % 8)
    return bytes(b)


def patch(data: bytes, offset: int, new: bytes) -> bytes:
    b = bytearray(data)
    b[offset:offset + len(new)] = new
    return bytes(b)


# --- checkers (numcodecs-style): the tests are mostly calls to these ------------------------------------------
def check_roundtrip(cache, model=None, *, draft=None, **encode_kwargs) -> bytes:
    """Encode ``cache`` (with ``model`` / options), decode it back and require bit-identical tensors, the same
    layer layout and, where the file stores token ids, the same ids; also through a file object.  Returns the
    file's bytes."""
    import io

    import kvcodec

    data = kvcodec.encode(cache, model, **({"draft": draft} if draft is not None else {}), **encode_kwargs)
    want = kvcodec.to_canonical(cache)
    for source in (data, io.BytesIO(data)):
        got = kvcodec.decode(source, model, draft=draft, output="kvcache")
        assert got.equal(want), "decoded tensors differ from the input"
        assert got.sliding_window == want.sliding_window and got.cumulative_length == want.cumulative_length
        assert got.start_position == want.start_position
        tokens = encode_kwargs.get("tokens")
        if tokens is not None and got.tokens is not None:
            assert got.tokens.tolist() == torch.as_tensor(tokens).reshape(got.tokens.shape).tolist()
    return data


def check_rejects(error, source, *args, match=None, fn=None, **kwargs):
    """``source`` bytes: decoding them (or ``fn(source, ...)``: ``inspect``, ``open_kvz``) must raise ``error``
    (a KvzError names its field); anything else is a cache, and encoding it with ``args`` / ``kwargs`` must
    raise ``error``.  Returns the exception."""
    import pytest

    import kvcodec

    with pytest.raises(error, match=match) as ei:
        if fn is not None:
            fn(source, *args, **kwargs)
        elif isinstance(source, (bytes, bytearray)):
            kvcodec.decode(bytes(source), *args, **kwargs)
        else:
            kvcodec.encode(source, *args, **kwargs)
    if isinstance(ei.value, kvcodec.FormatError):
        assert ei.value.field, "a format error names the field at fault"
    return ei.value


def check_vector(case: str, model=None):
    """Decode golden vector ``case`` (spec/vectors) and compare with the SHA-256 of its recorded tensors, token ids
    and start position; returns the decoded KVCache."""
    import hashlib
    import json
    from pathlib import Path

    import kvcodec

    vectors = Path(__file__).resolve().parent.parent / "spec" / "vectors"
    meta = json.loads((vectors / f"{case}.json").read_text())
    data = (vectors / f"{case}.kvz").read_bytes()
    assert hashlib.sha256(data).hexdigest() == meta["file_sha256"], "the vector's bytes changed"
    kv = kvcodec.decode(data, model, output="kvcache")

    def sha(t):
        return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()

    assert kv.dtype_name == meta["dtype"]
    assert [sha(t) for t in kv.keys] == meta["keys_sha256"]
    assert [sha(t) for t in kv.values] == meta["values_sha256"]
    assert (kv.tokens.tolist() if kv.tokens is not None else None) == meta["tokens"]
    assert kv.start_position == meta["start_position"]
    return kv


def fuzz_tools():
    """The fuzzer's file surgery (``fuzz/fuzz.py``): ``header_of``, ``with_header`` (a new header, offsets
    shifted, checksums resealed) and ``reseal``."""
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parent.parent / "fuzz")
    if root not in sys.path:
        sys.path.insert(0, root)
    import fuzz

    return fuzz
