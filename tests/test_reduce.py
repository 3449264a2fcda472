"""The reduce tier: attention with atom masses, merge-reduce caches, reducers, baselines (tiny models)."""

from __future__ import annotations

import math

import pytest
import torch

import kvcodec
from kvcodec.reduction import (
    METHODS,
    Plan,
    ReducedCache,
    ReducedLayer,
    entries_for,
    plan_for,
    prefill,
    reducers,
)
from kvcodec.reduction import attention as att

from .common import model_cache, tiny_model

KINDS = ["llama", "qwen2", "gpt2"]


def _ids(n, seed=0, vocab=128):
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def _model(kind, impl="eager"):
    m = tiny_model(kind)
    m.set_attn_implementation(impl)
    return m


def _layers_from(cache, model, build):
    """A ReducedCache whose full layers are built by ``build(i, keys, values) -> ReducedLayer``."""
    scale = att.scalings(model)
    layers = [build(i, layer.keys, layer.values, scale[i]) for i, layer in enumerate(cache.layers)]
    return ReducedCache(model, Plan(k=1, block=1, method=None), layers=layers)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", KINDS)
def test_enable_changes_nothing_for_ordinary_caches(kind, impl):
    m = _model(kind, impl)
    ids = _ids(40)
    before = m(ids).logits
    name = att.enable(m)
    assert name == "kvcodec_reduce:" + impl and att.enable(m) == name
    after = m(ids).logits
    assert torch.equal(before, after)


@pytest.mark.parametrize("kind", KINDS)
def test_unit_masses_reproduce_exact_attention_bit_for_bit_on_eager(kind):
    """Every token kept as an atom with an explicit zero log-weight: the bias path runs and adds 0."""
    m = _model(kind)
    ids, nxt = _ids(50), _ids(7, seed=1)
    full = model_cache(m, ids)
    ref = m(nxt, past_key_values=full).logits

    def build(i, k, v, s):
        red = ReducedLayer(Plan(k=1, block=1, method=None), i, s)
        red.set_fixed(k, v, k.shape[2], beta=torch.zeros(k.shape[:3]))
        return red

    red = _layers_from(model_cache(m, ids), m, build)
    assert red.layers[0].beta is not None  # the bias path is exercised
    got = m(nxt, past_key_values=red).logits
    assert torch.equal(ref, got)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_log_weight_equals_duplicated_token(impl):
    """An atom with beta = log 2 attends exactly like two copies of it with beta = 0, and unlike one copy."""
    m = _model("llama", impl)
    ids, nxt = _ids(30), _ids(3, seed=2)
    cache = model_cache(m, ids)
    j = 11

    def dup(i, k, v, s):
        red = ReducedLayer(Plan(k=1, block=1, method=None), i, s)
        kk = torch.cat([k, k[:, :, j:j + 1]], 2)
        vv = torch.cat([v, v[:, :, j:j + 1]], 2)
        red.set_fixed(kk, vv, k.shape[2], beta=torch.zeros(kk.shape[:3]))
        return red

    def weighted(w):
        def build(i, k, v, s):
            red = ReducedLayer(Plan(k=1, block=1, method=None), i, s)
            b = torch.zeros(k.shape[:3])
            b[:, :, j] = w
            red.set_fixed(k, v, k.shape[2], beta=b)
            return red
        return build

    a = m(nxt, past_key_values=_layers_from(cache, m, dup)).logits
    b = m(nxt, past_key_values=_layers_from(cache, m, weighted(math.log(2)))).logits
    c = m(nxt, past_key_values=_layers_from(cache, m, weighted(0.0))).logits
    assert torch.allclose(a, b, atol=1e-5)
    assert (a - c).abs().max() > 1e-4


def test_gaussian_kernel_form_equals_softmax_attention():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 5, 16, generator=g, dtype=torch.float64) * 2
    k = torch.randn(2, 40, 16, generator=g, dtype=torch.float64) * 3
    v = torch.randn(2, 40, 8, generator=g, dtype=torch.float64)
    beta = torch.randn(2, 40, generator=g, dtype=torch.float64)
    s = 16 ** -0.5
    soft = att.softmax_attention(q, k, v, beta, s)
    kern = att.kernel_attention(q, k, v, att.kernel_logmass(k, beta, s), s)
    assert torch.allclose(soft, kern, atol=1e-10)
    # forgetting the exp(|k|^2 s / 2) reweighting changes the attention (papers.md B.5 item 5)
    wrong = att.kernel_attention(q, k, v, beta, s)
    assert (wrong - soft).abs().max() > 1e-2


def _summary(n=64, h=3, d=8, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, h, n, d, generator=g, dtype=dtype) * 2, torch.randn(1, h, n, d, generator=g, dtype=dtype),
            torch.randn(1, h, n, generator=g).float() * 0.5)


def _moments(summary, s):
    k, v, beta = summary
    lm = att.kernel_logmass(k, beta, s)
    w = torch.softmax(lm, -1)[..., None]
    return torch.logsumexp(lm, -1), (w * k.double()).sum(2), (w * v.double()).sum(2)


def test_cluster_preserves_mass_and_weighted_means():
    s = 8 ** -0.5
    summ = _summary()
    out = reducers.cluster(summ, 16, s, torch.Generator().manual_seed(0))
    assert out[0].shape == (1, 3, 16, 8) and out[2].shape == (1, 3, 16)
    for a, b in zip(_moments(summ, s), _moments(out, s)):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-6)  # exact up to beta stored in float32


def test_sample_is_reproducible_and_unbiased():
    s = 8 ** -0.5
    summ = _summary(n=32, h=2)
    a = reducers.sample(summ, 8, s, torch.Generator().manual_seed(5))
    b = reducers.sample(summ, 8, s, torch.Generator().manual_seed(5))
    c = reducers.sample(summ, 8, s, torch.Generator().manual_seed(6))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c[0])
    # total mass is kept on every draw; the value mean is unbiased (mean over 400 draws within 4 standard errors)
    mass, _, vmean = _moments(summ, s)
    draws = [reducers.sample(summ, 8, s, torch.Generator().manual_seed(i)) for i in range(400)]
    for d in draws[:5]:
        assert torch.allclose(_moments(d, s)[0], mass, atol=1e-6)
    est = torch.stack([_moments(d, s)[2] for d in draws])
    se = est.std(0) / math.sqrt(len(draws))
    assert ((est.mean(0) - vmean).abs() <= 4 * se + 1e-9).all()


def test_plan_for_and_entries():
    assert entries_for(100, 10, sinks=4) == 4 + 10 * bin(9).count("1") + 6
    for n in (100, 1000, 4321):
        for keep in (0.1, 0.25, 0.5):
            k, e = plan_for(n, keep)
            assert e == entries_for(n, k) <= round(keep * n)
            assert all(entries_for(n, j) <= e or entries_for(n, j) > round(keep * n) for j in range(1, n))
    assert plan_for(100, 0.05) == (1, entries_for(100, 1))  # 4 sinks + 2 atoms: the smallest there is
    assert plan_for(50, 1.0) == (50, 50)
    with pytest.raises(ValueError):
        plan_for(10, 0)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", KINDS)
def test_reduce_then_forward_and_generate(kind, method):
    m = _model(kind, "sdpa")
    ids = _ids(200)
    cache = model_cache(m, ids)
    red = kvcodec.reduce(cache, m, keep=0.2, method=method, tokens=ids)
    k, e = plan_for(200, 0.2)
    assert red.entries() == e and red.describe()["tokens"] == 200
    assert red.get_seq_length() == 200
    out = m.generate(torch.cat([ids, _ids(5, 1)], 1), past_key_values=red, max_new_tokens=30, do_sample=False,
                     pad_token_id=0)
    assert out.shape == (1, 235)
    assert red.get_seq_length() == 234  # the last generated token is never fed back
    if method in ("cluster", "sample"):  # decoding keeps reducing: memory bound of the binary counter
        d = red.describe()
        assert d["entries"] <= 4 + k * max(1, math.ceil(math.log2(d["blocks"] + 1))) + k


def test_reduce_keep_all_equals_full_cache_and_same_seed_same_cache():
    m = _model("llama")
    ids = _ids(120)
    cache = model_cache(m, ids)
    nxt = _ids(4, 3)
    ref = m(nxt, past_key_values=model_cache(m, ids)).logits
    assert torch.equal(m(nxt, past_key_values=kvcodec.reduce(cache, m, keep=1.0)).logits, ref)
    a = kvcodec.reduce(cache, m, keep=0.25, method="sample", seed=7)
    b = kvcodec.reduce(cache, m, keep=0.25, method="sample", seed=7)
    c = kvcodec.reduce(cache, m, keep=0.25, method="sample", seed=8)
    assert torch.equal(a.layers[1].keys, b.layers[1].keys) and torch.equal(a.layers[1].beta, b.layers[1].beta)
    assert not torch.equal(a.layers[1].beta, c.layers[1].beta)
    assert not torch.equal(m(nxt, past_key_values=a).logits, ref)  # a reduction changes the output


def test_baselines_keep_the_documented_tokens():
    m = _model("llama")
    ids = _ids(100)
    cache = model_cache(m, ids)
    red = kvcodec.reduce(cache, m, budget=20, method="streaming")
    e = red.entries()
    k = cache.layers[0].keys
    want = torch.cat([k[:, :, :4], k[:, :, 100 - (e - 4):]], 2)
    assert torch.equal(red.layers[0].keys, want)
    snap = kvcodec.reduce(cache, m, budget=80, method="snapkv", tokens=ids)  # window 64 kept whole
    assert torch.equal(snap.layers[0].keys[:, :, -64:], k[:, :, -64:])
    h2o = kvcodec.reduce(cache, m, budget=20, method="h2o", tokens=ids)
    e = h2o.entries()
    assert torch.equal(h2o.layers[0].keys[:, :, -(e - e // 2):], k[:, :, 100 - (e - e // 2):])


def test_snapkv_recovers_tokens_from_the_cache():
    m = _model("llama")
    ids = _ids(90)
    cache = model_cache(m, ids)
    a = kvcodec.reduce(cache, m, keep=0.3, method="snapkv")
    b = kvcodec.reduce(cache, m, keep=0.3, method="snapkv", tokens=ids[0])
    assert torch.equal(a.layers[1].keys, b.layers[1].keys)


def test_sliding_layers_are_kept_and_mixed_models_run():
    m = _model("qwen2_mixed")
    ids = _ids(60)
    cache = model_cache(m, ids)
    red = kvcodec.reduce(cache, m, keep=0.3)
    assert isinstance(red.layers[0], ReducedLayer) and not isinstance(red.layers[1], ReducedLayer)
    out = m.generate(torch.cat([ids, _ids(3, 1)], 1), past_key_values=red, max_new_tokens=10, do_sample=False,
                     pad_token_id=0)
    assert out.shape == (1, 73)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_merge_reduce_prefill(impl):
    m = _model("llama", impl)
    ids = _ids(300)
    full = m(ids).logits
    cache, out = prefill(m, ids, keep=1.0)
    assert torch.equal(out.logits, full)  # nothing to reduce: the ordinary prefill
    cache, out = prefill(m, ids, keep=0.2, method="cluster")
    k, e = plan_for(300, 0.2)
    assert cache.entries() == e
    d = (out.logits - full).abs()
    assert d[:, : 4 + k].max() < 1e-6  # the sinks and the first block see raw tokens only (other float order)
    assert d[:, 4 + k:].max() > 1e-5  # later blocks see a summary
    out2 = m.generate(torch.cat([ids, _ids(2, 1)], 1), past_key_values=cache, max_new_tokens=5, do_sample=False,
                      pad_token_id=0)
    assert out2.shape == (1, 307)


def _leaves(m, k=4, h=2, d=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, 1, h, k, d, generator=g) * 2, torch.randn(m, 1, h, k, d, generator=g),
            torch.randn(m, 1, h, k, generator=g) * 0.3)


def _mass(summary, s):
    """Total kernel log-mass per (node, batch, head)."""
    return torch.logsumexp(att.kernel_logmass(summary[0], summary[2], s), -1)


@pytest.mark.parametrize("method", ["cluster", "sample"])
def test_scan_prefixes_summarise_exactly_the_earlier_blocks(method):
    """Every exclusive prefix of the down-sweep carries the total mass of the blocks before its leaf (both
    reducers keep mass), leaf 0's is empty, and the up-sweep's root carries everything."""
    from kvcodec.reduction import tree

    s, m = 6 ** -0.5, 8
    leaves = _leaves(m)
    fn = reducers.REDUCERS[method]
    levels = tree.upsweep(fn, 4, s, leaves, lambda *w: sum(map(ord, str(w))))
    assert [lv[0].shape[0] for lv in levels] == [8, 4, 2, 1]
    assert torch.allclose(_mass(levels[-1], s)[0], torch.logsumexp(_mass(leaves, s), 0), atol=1e-4)
    pre = tree.exclusive_prefixes(fn, 4, s, levels, lambda *w: sum(map(ord, str(w))))
    leaf_mass = _mass(leaves, s)
    assert (_mass(pre, s)[0] < -1e3).all()  # nothing before block 0: zero-mass padding only
    for b in range(1, m):
        assert torch.allclose(_mass(pre, s)[b], torch.logsumexp(leaf_mass[:b], 0), atol=1e-4), b


@pytest.mark.parametrize("method", ["cluster", "sample"])
def test_batched_ingest_matches_the_streaming_binary_counter(method):
    """kvcodec.reduce builds the buckets in one batched tree; feeding the same tokens block by block through
    the cache's update reaches the same buckets (same sizes, same spans: same total mass per bucket)."""
    m = _model("llama")
    ids = _ids(150)
    cache = model_cache(m, ids)
    red = kvcodec.reduce(cache, m, keep=0.2, method=method)
    plan = red.plan
    for i, layer in enumerate(cache.layers):
        lay = ReducedLayer(plan, i, red.layers[i].scaling)
        for a in range(0, 150, 7):  # streaming, 7 tokens at a time
            lay.update(layer.keys[:, :, a:a + 7], layer.values[:, :, a:a + 7])
        got = red.layers[i]
        assert lay.describe() == got.describe()
        for x, y in zip(lay.levels, got.levels):
            assert (x is None) == (y is None)
            if x is not None:
                assert torch.allclose(_mass(x, lay.scaling), _mass(y, lay.scaling), atol=1e-4)
    att.clear_bias(0), att.clear_bias(1)


def test_unknown_method_and_bad_keep():
    m = _model("llama")
    cache = model_cache(m, _ids(20))
    with pytest.raises(ValueError, match="unknown reduce method"):
        kvcodec.reduce(cache, m, method="nope")
    with pytest.raises(ValueError, match="keep"):
        kvcodec.reduce(cache, m, keep=1.5)
