"""Every mainstream architecture transformers runs on CPU x {prefill, generate} x {lossless, exact without
``tokens=``} x {float32, bfloat16}: the decoded cache is bit-identical to the original and ``generate()``
continues from it exactly as from the original - or the encoder says why it could not use the tier asked for
(a :class:`FallbackWarning` naming the reason; the fallback is lossless, so still bit-identical).  Never a
silent difference.

Tiny random models (tests/common.py ``_LAYOUTS``), a prompt longer than the sliding windows (8 tokens), so
all-sliding first layers exercise their fallback.  The architectures whose token recovery must succeed are
listed in ``RECOVERS``; the others must fall back with a reason and round-trip exactly once given ``tokens=``.
"""

import copy
import warnings

import pytest
import torch

import kvcodec
from kvcodec.errors import FallbackWarning
from kvcodec.tokens.plan import output_cache

from .common import VOCAB, greedy_from, model_cache, tiny_model

ARCHS = ["llama", "mistral_sw", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "gpt2", "gpt_neox", "falcon", "opt",
         "cohere", "stablelm", "deepseek_v3", "deepseek_v32", "gemma3n", "falcon_h1", "jamba", "zamba2", "mamba",
         "qwen3_next"]
#: token recovery must work here: a first attention layer whose values (or, MLA, keys) identify the token
#: (fused qkv, scaled embeddings, MLA, absolute positions, FalconH1's attention beside its Mamba mixer)
RECOVERS = {"llama", "qwen2", "qwen3", "phi3", "gpt2", "gpt_neox", "falcon", "opt", "cohere", "stablelm",
            "deepseek_v3", "deepseek_v32", "falcon_h1"}
#: why the others cannot recover (the fallback message must say so)
REASONS = {"mistral_sw": "sliding window", "gemma2": "sliding window", "gemma3": "sliding window",
           "gemma3n": "sliding window", "mamba": "no attention layer", "zamba2": "depend on position",
           "qwen3_next": "depend on position", "jamba": "depend on position"}
PROMPT, NEW = 12, 4


def _cache(model, mode):
    """(cache, the ids it holds, the ids to continue from)."""
    torch.manual_seed(99)
    ids = torch.randint(1, VOCAB, (1, PROMPT))
    if mode == "prefill":
        return model_cache(model, ids), ids, torch.cat([ids, torch.randint(1, VOCAB, (1, 1))], 1)
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    cache = output_cache(out)
    return cache, out.sequences[:, :-1], out.sequences


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["prefill", "generate"])
@pytest.mark.parametrize("arch", ARCHS)
def test_architecture_round_trips_or_says_why(arch, mode, dtype):
    model = tiny_model(arch, dtype)
    cache, held, prompt = _cache(model, mode)
    original = kvcodec.to_canonical(cache)
    for tier in ("lossless", "exact"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            data = kvcodec.encode(cache, model if tier == "exact" else None, tier=tier)
        fallbacks = [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]
        got = kvcodec.inspect(data)["tier"]
        if tier == "exact":
            if arch in RECOVERS:
                assert got == "exact" and not fallbacks, fallbacks
            elif got != "exact":  # said why, in the warning and in the file
                assert got == "lossless" and len(fallbacks) == 1
                assert REASONS[arch] in fallbacks[0], fallbacks[0]
                assert kvcodec.inspect(data)["info"]["fallback"]
        else:
            assert got == "lossless" and not fallbacks
        back = kvcodec.decode(data, model, output="kvcache")
        assert back.equal(original), f"{tier}: decoded cache differs"
        a, b = greedy_from(model, prompt, cache, back.to_dynamic_cache(), 3)
        assert torch.equal(a, b), f"{tier}: generate() continues differently"
    if arch not in RECOVERS:  # given the tokens, the token tier works on every architecture
        data = kvcodec.encode(cache, model, tokens=held)
        assert kvcodec.inspect(data)["tier"] == "exact"
        assert kvcodec.decode(data, model, output="kvcache").equal(original)


@pytest.mark.parametrize("arch", ["falcon_h1", "jamba", "zamba2", "mamba", "qwen3_next", "deepseek_v32"])
def test_state_space_layers_are_stored_whole(arch):
    """Recurrent and conv states, and indexer keys, are part of the file (format 1.3): ``inspect`` lists them,
    the decoded layers are the original classes, and a file without them could not continue the same way."""
    model = tiny_model(arch)
    cache, _, prompt = _cache(model, "prefill")
    data = kvcodec.encode(cache)
    info = kvcodec.inspect(data)
    assert info["format_version"] == "1.3" and any(s["type"] == "state" for s in info["sections"])
    restored = kvcodec.decode(data)
    assert [type(la) for la in restored.layers] == [type(la) for la in cache.layers]
    zeroed = kvcodec.to_canonical(restored)
    for st in zeroed.states:
        if st is not None:
            for _, _, t in st.tensors():
                t.zero_()  # what dropping the state would give

    def next_logits(c):
        from kvcodec.tokens.plan import cache_kwarg

        with torch.no_grad():
            return model(prompt[:, -1:], use_cache=True, **{cache_kwarg(model): c}).logits

    assert torch.equal(next_logits(kvcodec.decode(data)), next_logits(copy.deepcopy(cache)))
    assert not torch.equal(next_logits(zeroed.to_dynamic_cache()), next_logits(copy.deepcopy(cache)))


def test_cropped_cache_round_trips():
    """``DynamicCache.crop`` (speculative decoding, edits): a cropped cache stores and restores like any."""
    model = tiny_model("llama", torch.bfloat16)
    cache, _, _ = _cache(model, "generate")
    cache.crop(-5)  # drop the last 5 positions
    for tier in ("lossless", "exact"):
        data = kvcodec.encode(cache, model, tier=tier)
        assert kvcodec.inspect(data)["tier"] == tier
        assert kvcodec.decode(data, model, output="kvcache").equal(kvcodec.to_canonical(cache))


def test_a_made_up_layer_class_is_refused_by_name():
    """An unknown layer class - here a made-up subclass of DynamicLayer - is refused by name with the list of
    what is stored, as a ConfigError (the CLI's one-line class of errors), never read as its parent."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    layer = type("MyCompressedLayer", (DynamicLayer,), {})()
    k = torch.randn(1, 2, 5, 4)
    layer.lazy_initialization(k, k)
    layer.keys, layer.values = k, k
    cache = DynamicCache()
    cache.layers = [layer]
    with pytest.raises(kvcodec.ConfigError, match="MyCompressedLayer.*stores DynamicLayer, DynamicSlidingWindowLayer"):
        kvcodec.encode(cache)


def test_offloaded_cache_is_read_after_its_copies_complete():
    """``DynamicCache(offloading=True)`` keeps most layers on the CPU, copied there asynchronously; running a
    model with it needs CUDA (transformers waits on CUDA streams), so here the cache is filled by hand: its
    layers are ordinary DynamicLayers, stored like any (on a GPU, after a device synchronisation), restored as
    a plain DynamicCache."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    model = tiny_model("llama")
    plain, _, _ = _cache(model, "prefill")
    off = DynamicCache(offloading=True)
    off.layers = []
    for layer in plain.layers:
        copy_ = DynamicLayer()
        copy_.lazy_initialization(layer.keys, layer.values)
        copy_.keys, copy_.values = layer.keys.clone(), layer.values.clone()
        off.layers.append(copy_)
    data = kvcodec.encode(off, model)
    assert kvcodec.inspect(data)["tier"] == "exact"
    assert kvcodec.decode(data, model, output="kvcache").equal(kvcodec.to_canonical(plain))


@pytest.mark.parametrize("arch", ["qwen3_next", "jamba"])
def test_linear_attention_token_count_is_restored(arch):
    """transformers >= 5.25 counts the tokens a linear-attention layer has seen (its get_seq_length, which sets
    the next positions): not stored in the file, it comes back as the count the attention layers imply, and a
    cache whose count disagrees with them is refused by name rather than restored different."""
    model = tiny_model(arch)
    cache, _, _ = _cache(model, "prefill")
    linear = [la for la in cache.layers if hasattr(la, "cumulative_length_linear")]
    if not linear:
        pytest.skip("this transformers does not count a linear-attention layer's tokens (before 5.25)")
    restored = kvcodec.decode(kvcodec.encode(cache))
    assert restored.get_seq_length() == cache.get_seq_length() > 0
    assert [int(la.cumulative_length_linear) for la in restored.layers if hasattr(la, "cumulative_length_linear")] \
        == [int(la.cumulative_length_linear) for la in linear]
    linear[0].cumulative_length_linear += 1
    with pytest.raises(kvcodec.errors.UnsupportedCache, match="tokens seen"):
        kvcodec.encode(cache)
