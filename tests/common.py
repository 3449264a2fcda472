"""Shared helpers: tiny random HF models, caches, and file corruption."""

from __future__ import annotations

import torch

VOCAB = 128


#: tiny_model kinds: config class, model class, options beyond the common ones (see ARCHITECTURES)
_MOE = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=1,
            n_group=1, topk_group=1)
_MLA = dict(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)
_LAYOUTS = {
    "llama": ("Llama", "LlamaForCausalLM", dict(num_key_value_heads=2)),  # GQA: 4 query heads share 2 kv heads
    "qwen2": ("Qwen2", "Qwen2ForCausalLM", dict(num_key_value_heads=1)),  # MQA, with biases on q/k/v
    "qwen2_mixed": ("Qwen2", "Qwen2ForCausalLM", dict(  # one full-attention layer, one sliding-window layer
        num_key_value_heads=2, sliding_window=8, use_sliding_window=True,
        layer_types=["full_attention", "sliding_attention"])),
    "mistral_sw": ("Mistral", "MistralForCausalLM", dict(num_key_value_heads=2, sliding_window=8)),  # all sliding
    "qwen3": ("Qwen3", "Qwen3ForCausalLM", dict(num_key_value_heads=2, head_dim=8)),  # q/k norms
    "gemma2": ("Gemma2", "Gemma2ForCausalLM", dict(num_key_value_heads=2, head_dim=8, sliding_window=8)),
    "gemma3": ("Gemma3Text", "Gemma3ForCausalLM", dict(num_key_value_heads=2, head_dim=8, sliding_window=8)),
    "phi3": ("Phi3", "Phi3ForCausalLM", dict(num_key_value_heads=2, pad_token_id=0)),  # fused qkv
    "gpt_neox": ("GPTNeoX", "GPTNeoXForCausalLM", dict()),  # fused qkv, partial rotary
    "falcon": ("Falcon", "FalconForCausalLM", dict(new_decoder_architecture=True, num_kv_heads=2)),
    "cohere": ("Cohere", "CohereForCausalLM", dict(num_key_value_heads=2)),
    "stablelm": ("StableLm", "StableLmForCausalLM", dict(num_key_value_heads=2)),
    "deepseek_v3": ("DeepseekV3", "DeepseekV3ForCausalLM", dict(**_MLA, **_MOE)),  # MLA: the latent is cached
    "gemma3n": ("Gemma3nText", "Gemma3nForCausalLM", dict(
        num_key_value_heads=2, head_dim=8, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        num_kv_shared_layers=0, altup_num_inputs=2, laurel_rank=4, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB, activation_sparsity_pattern=[0.0, 0.0])),
    "deepseek_v32": ("DeepseekV32", "DeepseekV32ForCausalLM", dict(  # MLA + lightning indexer keys
        num_key_value_heads=4, **_MLA, **_MOE, index_head_dim=8, index_n_heads=2, index_topk=4)),
    "falcon_h1": ("FalconH1", "FalconH1ForCausalLM", dict(  # every layer: attention + Mamba2 side by side
        num_key_value_heads=2, head_dim=8, mamba_d_state=8, mamba_n_heads=4, mamba_d_head=8, mamba_d_ssm=32,
        mamba_n_groups=1, mamba_chunk_size=8)),
    "jamba": ("Jamba", "JambaForCausalLM", dict(  # Mamba layer, then attention layer
        num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
        expert_layer_offset=1, num_experts=2, mamba_d_state=8, mamba_dt_rank=4, use_mamba_kernels=False)),
    "zamba2": ("Zamba2", "Zamba2ForCausalLM", dict(
        num_key_value_heads=2, mamba_d_state=8, mamba_headdim=8, n_mamba_heads=8, num_mem_blocks=1,
        mamba_ngroups=1, layers_block_type=["mamba", "hybrid"], use_mem_rope=True)),
    "qwen3_next": ("Qwen3Next", "Qwen3NextForCausalLM", dict(  # gated-delta linear attention + full attention
        num_key_value_heads=2, head_dim=8, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8, num_experts=2, num_experts_per_tok=1,
        moe_intermediate_size=16, shared_expert_intermediate_size=16,
        layer_types=["linear_attention", "full_attention"])),
}


def tiny_model(kind: str, dtype=torch.float32):
    """A tiny randomly initialised causal LM of the given layout (seconds to build and run): a key of
    ``_LAYOUTS``, or ``gpt2`` / ``opt`` / ``opt_post_ln`` (absolute positions) or ``mamba``."""
    import transformers

    torch.manual_seed(1234)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=512)
    if kind in _LAYOUTS:
        cfg, cls, extra = _LAYOUTS[kind]
        m = getattr(transformers, cls)(getattr(transformers, cfg + "Config")(**{**common, **extra}))
    elif kind == "gpt2":  # absolute positions, no GQA
        m = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=512, bos_token_id=0, eos_token_id=0))
    elif kind in ("opt", "opt_post_ln"):  # learned positions (offset 2); post-LN like OPT-350m
        m = transformers.OPTForCausalLM(transformers.OPTConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
            max_position_embeddings=512, word_embed_proj_dim=32, do_layer_norm_before=kind == "opt",
            bos_token_id=0, eos_token_id=0, pad_token_id=1))
    elif kind == "mamba":
        m = transformers.MambaForCausalLM(transformers.MambaConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=8, bos_token_id=0, eos_token_id=0))
    else:
        raise ValueError(kind)
    for key in ("bos_token_id", "eos_token_id"):  # defaults outside the tiny vocabulary
        if isinstance(getattr(m.config, key, None), int) and getattr(m.config, key) >= VOCAB:
            setattr(m.config, key, 0)
    return m.to(dtype).eval()


@torch.no_grad()
def model_cache(model, ids):
    from kvcodec.tokens.plan import output_cache

    return output_cache(model(ids, use_cache=True))


def cache_arg(model, cache) -> dict:
    """``cache`` as the keyword argument of ``model``'s forward / ``generate``, by the name the installed
    transformers takes (``cache``; ``past_key_values`` before 5.2x, which newer versions warn about)."""
    from kvcodec.tokens.plan import cache_kwarg

    return {cache_kwarg(model): cache}


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


def vector_predictors(case: str):
    """The predictors a golden vector names (``<case>.predictors.safetensors`` beside it, spec section 13.1), or
    None."""
    from pathlib import Path

    from kvcodec import predict

    path = Path(__file__).resolve().parent.parent / "spec" / "vectors" / f"{case}.predictors.safetensors"
    return predict.from_bytes(path.read_bytes()) if path.is_file() else None


def check_vector(case: str, model=None, numerics: str = "strict"):
    """Decode golden vector ``case`` (spec/vectors) and compare with the SHA-256 of its recorded tensors, token ids
    and start position; returns the decoded KVCache.  ``numerics``: as :func:`kvcodec.decode`'s."""
    import hashlib
    import json
    from pathlib import Path

    import kvcodec

    vectors = Path(__file__).resolve().parent.parent / "spec" / "vectors"
    meta = json.loads((vectors / f"{case}.json").read_text())
    data = (vectors / f"{case}.kvz").read_bytes()
    assert hashlib.sha256(data).hexdigest() == meta["file_sha256"], "the vector's bytes changed"
    kv = kvcodec.decode(data, model, output="kvcache", predictors=vector_predictors(case), numerics=numerics)

    def sha(t):
        return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()

    assert kv.dtype_name == meta["dtype"]
    assert [sha(t) for t in kv.keys] == meta["keys_sha256"]
    assert [sha(t) for t in kv.values] == meta["values_sha256"]
    assert (kv.tokens.tolist() if kv.tokens is not None else None) == meta["tokens"]
    assert kv.start_position == meta["start_position"]
    states = [None if st is None else [sha(t) for _, _, t in st.tensors()] for st in kv.states]
    assert states == meta.get("states_sha256", [None] * kv.num_layers)
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


def numerics_like_the_vectors() -> bool:
    """Whether this machine's forward passes give the float results of the machine that wrote the golden vectors
    (the tiny model regenerates ``exact_lm_steps``' cache from its tokens bit for bit).  Where they do not (another
    instruction set or BLAS kernels), what rests on a recomputation reproducing another shape's bits - empty
    residuals, a schedule or a padding inferred by recomputing - is not expected: the round trips stay exact
    through the residual, and the tests that check those properties say they were skipped."""
    from .test_vectors import _numerics_match

    return _numerics_match("exact_lm_steps")


NUMERICS_SKIP = ("numerics-bound: this machine's float results differ from the vectors' machine's, so recomputation "
                 "is not bit-identical across shapes here (the round trips above were checked and are exact)")
