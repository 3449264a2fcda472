"""Caches made the way users make them: the encoder finds the replay settings that reproduce the cache's own
one-token calls (issue 46), and says so when none does.

A CPU's one-token forward calls can depend on the intra-op thread count (measured on other machines for
SmolLM2 fp32; on the CPU these tests were written on they do not).  So that these tests mean the same on
every machine, the model here is a tiny Llama whose first key projection adds ``(threads - 1) * 1e-3`` in
calls of one token: a real torch model whose one-token numerics depend on the thread count, as such a
CPU's do."""

from __future__ import annotations

import warnings

import pytest
import torch

import kvcodec
from kvcodec.tokens.plan import cache_kwarg
from tests.common import VOCAB, tiny_model


def _thread_sensitive_model():
    model = tiny_model("llama")

    def hook(_module, inputs, output):
        if inputs[0].shape[-2] == 1:  # a call of one token
            return output + (torch.get_num_threads() - 1) * 1e-3
        return output

    model.model.layers[0].self_attn.k_proj.register_forward_hook(hook)
    return model


@pytest.fixture
def two_threads():
    old = torch.get_num_threads()
    torch.set_num_threads(2)  # "torch's default" of a 2-core machine, whatever this one has
    yield
    torch.set_num_threads(old)


@torch.no_grad()
def _hand_loop(model, ids, steps, step_threads=None):
    """A prefill, then greedy one-token calls as users write them (on ``step_threads`` if given)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    kw = {cache_kwarg(model): cache}
    nxt = model(ids, use_cache=True, **kw).logits[:, -1:].argmax(-1)
    old = torch.get_num_threads()
    if step_threads:
        torch.set_num_threads(step_threads)
    try:
        for _ in range(steps):
            nxt = model(nxt, use_cache=True, **kw).logits[:, -1:].argmax(-1)
    finally:
        torch.set_num_threads(old)
    return cache


def _encode_quiet(cache, model, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        data = kvcodec.encode(cache, model, **kw)
    return data, [w for w in caught if issubclass(w.category, (kvcodec.ResidualWarning, kvcodec.FallbackWarning))]


def test_the_model_here_really_depends_on_the_thread_count(two_threads):
    model = _thread_sensitive_model()
    ids = torch.randint(0, VOCAB, (1, 12))
    a = kvcodec.to_canonical(_hand_loop(model, ids, 3, step_threads=1))
    b = kvcodec.to_canonical(_hand_loop(model, ids, 3))
    assert a.keys[0][:, :, :12].equal(b.keys[0][:, :, :12]) and not a.keys[0][:, :, 12:].equal(b.keys[0][:, :, 12:])


@pytest.mark.parametrize("recording", [False, True])
def test_steps_on_torchs_default_threads_are_found_and_replayed(two_threads, recording):
    model = _thread_sensitive_model()
    torch.manual_seed(3)
    ids = torch.randint(1, VOCAB, (1, 40))  # no pad id 0: generate() would mask it
    if recording:
        from kvcodec.tokens import RecordingCache

        cache = RecordingCache(config=model.config)
        model.generate(ids, **{cache_kwarg(model): cache}, max_new_tokens=30, do_sample=False, pad_token_id=0)
    else:
        cache = _hand_loop(model, ids, 30)
    data, caught = _encode_quiet(cache, model)
    assert not caught, [str(w.message) for w in caught]
    info = kvcodec.inspect(data)
    assert info["token_channel"]["procedure"]["numerics"]["step_threads"] == 2
    assert info["token_channel"]["residual_bytes"] == 0
    # the decoder runs its one-token calls on the file's count (2), not on kvcodec's own (1): bit for bit
    assert kvcodec.decode(data, model, output="kvcache").equal(kvcodec.to_canonical(cache))


def test_steps_on_a_count_the_encoder_does_not_try_get_the_warning(two_threads):
    model = _thread_sensitive_model()
    torch.manual_seed(4)
    ids = torch.randint(0, VOCAB, (1, 64))
    cache = _hand_loop(model, ids, 400, step_threads=37)  # no candidate: 1, torch's 2, the CPU count
    data, caught = _encode_quiet(cache, model)
    assert len(caught) == 1 and issubclass(caught[0].category, kvcodec.ResidualWarning)
    msg = str(caught[0].message)
    assert "400 (86.2 %)" in msg and "looks like a prefill of 64 tokens followed by calls of one token" in msg, msg
    assert kvcodec.decode(data, model, output="kvcache").equal(kvcodec.to_canonical(cache))  # still exact


def test_an_unrelated_cache_costs_about_the_lossless_tiers_size_and_says_why(two_threads):
    model = tiny_model("llama")
    torch.manual_seed(5)
    ids = torch.randint(0, VOCAB, (1, 300))
    kv = kvcodec.to_canonical(_hand_loop(model, ids, 0))
    # layer-0 values are what the tokens make (so the tokens are accepted); everything else is unrelated to
    # what they regenerate (a fine-tuned model's cache, say)
    g = torch.Generator().manual_seed(0)
    other = kvcodec.KVCache([torch.randn(k.shape, generator=g) for k in kv.keys],
                            [kv.values[0]] + [torch.randn(v.shape, generator=g) for v in kv.values[1:]])
    data, caught = _encode_quiet(other, model, tokens=ids)
    assert [w.category for w in caught] == [kvcodec.ResidualWarning], [str(w.message) for w in caught]
    assert "0 of its 300 positions" in str(caught[0].message)
    lossless = kvcodec.encode(other, tokens=ids)
    assert len(data) <= len(lossless) * 1.02 + 1024, (len(data), len(lossless))
    assert kvcodec.decode(data, model, output="kvcache").equal(other)
