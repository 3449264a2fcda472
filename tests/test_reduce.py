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
from kvcodec.tokens.plan import output_cache

from .common import cache_arg, check_rejects, fuzz_tools, model_cache, tiny_model

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
    ref = m(nxt, **cache_arg(m, full)).logits

    def build(i, k, v, s):
        red = ReducedLayer(Plan(k=1, block=1, method=None), i, s)
        red.set_fixed(k, v, k.shape[2], beta=torch.zeros(k.shape[:3]))
        return red

    red = _layers_from(model_cache(m, ids), m, build)
    assert red.layers[0].beta is not None  # the bias path is exercised
    got = m(nxt, **cache_arg(m, red)).logits
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

    a = m(nxt, **cache_arg(m, _layers_from(cache, m, dup))).logits
    b = m(nxt, **cache_arg(m, _layers_from(cache, m, weighted(math.log(2))))).logits
    c = m(nxt, **cache_arg(m, _layers_from(cache, m, weighted(0.0)))).logits
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


def test_tilted_cluster_is_exact_at_its_anchor_and_never_overweights():
    """Masses seen from an anchor query a (form "query"/"dot"): each cluster keeps its exact mass and value mean
    at q = a, so attention at the anchor is unchanged; at any other query a cluster's atom carries at most its
    members' mass (Jensen), so merged atoms never outweigh raw tokens.  The kernel form has no such bound."""
    s = 8 ** -0.5
    k, v, beta = _summary(n=48, h=2)
    g = torch.Generator().manual_seed(1)
    a = torch.randn(1, 2, 8, generator=g, dtype=torch.float64)
    out = reducers.cluster((k, v, beta), 12, s, torch.Generator().manual_seed(0), anchor=a.float())
    ref = att.softmax_attention(a[:, :, None], k, v, beta, s)
    got = att.softmax_attention(a[:, :, None], out[0], out[1], out[2], s)
    assert torch.allclose(ref, got, atol=1e-5)
    qs = torch.randn(1, 2, 200, 8, generator=g, dtype=torch.float64) * 2
    z_full = torch.logsumexp(s * qs @ k.transpose(-1, -2) + beta.double()[:, :, None], -1)
    z_red = torch.logsumexp(s * qs @ out[0].transpose(-1, -2) + out[2].double()[:, :, None], -1)
    assert (z_red <= z_full + 1e-5).all()
    kern = reducers.cluster((k, v, beta), 12, s, torch.Generator().manual_seed(0))
    z_kern = torch.logsumexp(s * qs @ kern[0].transpose(-1, -2) + kern[2].double()[:, :, None], -1)
    assert (z_kern > z_full + 1e-3).any()  # the Gaussian-kernel centroid overweights far queries
    smp = reducers.sample((k, v, beta), 12, s, torch.Generator().manual_seed(0), anchor=a.float())
    z_smp = torch.logsumexp(s * a[:, :, None] @ smp[0].transpose(-1, -2) + smp[2].double()[:, :, None], -1)
    assert torch.allclose(z_smp, z_full[..., :1] * 0 + torch.logsumexp(
        s * a[:, :, None] @ k.transpose(-1, -2) + beta.double()[:, :, None], -1), atol=1e-5)


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
            k, w, e = plan_for(n, keep)
            assert w == 0 and e == entries_for(n, k) <= round(keep * n)
            assert all(entries_for(n, j) <= e or entries_for(n, j) > round(keep * n) for j in range(1, n))
            if n >= 1000:  # room for a window of half the budget and a summary
                k, w, e = plan_for(n, keep, window=0.5)
                assert w == round(0.5 * round(keep * n)) and e == entries_for(n, k, window=w) <= round(keep * n)
    assert entries_for(100, 10, sinks=4, window=20) == 4 + 20 + 10 * bin(7).count("1") + 6
    assert plan_for(100, 0.05) == (1, 0, entries_for(100, 1))  # 4 sinks + 2 atoms: the smallest there is
    assert plan_for(50, 1.0) == (50, 0, 50)
    with pytest.raises(ValueError):
        plan_for(10, 0)
    with pytest.raises(ValueError):
        plan_for(10, 0.5, window=1.0)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", KINDS)
def test_reduce_then_forward_and_generate(kind, method):
    m = _model(kind, "sdpa")
    ids = _ids(200)
    cache = model_cache(m, ids)
    red = kvcodec.reduce(cache, m, keep=0.2, method=method, tokens=ids)
    k, _, e = plan_for(200, 0.2)
    assert red.counted() == pytest.approx(e) and red.describe()["entries"] == e and red.describe()["tokens"] == 200
    assert red.entries() >= e  # held: more where the heads of a layer keep different numbers (kvzip)
    assert red.get_seq_length() == 200
    out = m.generate(torch.cat([ids, _ids(5, 1)], 1), **cache_arg(m, red), max_new_tokens=30, do_sample=False,
                     pad_token_id=0)
    assert out.shape == (1, 235)
    assert red.get_seq_length() == 234  # the last generated token is never fed back
    if method in ("cluster", "sample"):  # decoding keeps reducing: memory bound of the binary counter
        d = red.describe()
        assert d["entries"] <= 4 + k * max(1, math.ceil(math.log2(d["blocks"] + 1))) + k


@pytest.mark.parametrize("method", METHODS)
def test_a_reduced_cache_holds_one_copy_of_its_entries(method):
    """The memory a reduced cache holds is its kept entries' (keys, values, log-weights, anchors), once: no part
    keeps the storage of the whole cache it was cut from alive, the assembled tensors are not a second copy of the
    parts, and where the heads of a layer keep different numbers (kvzip) none holds the longest head's count -
    after the reduction, after decoding steps (merge-reduce carries blocks up the levels) and after a .kvz
    round trip."""
    m = _model("llama", "sdpa")
    ids = _ids(200)
    full = model_cache(m, ids)
    full_bytes = sum(la.keys.nbytes + la.values.nbytes for la in full.layers)

    def own(red, weights=True):  # the entries attention sees (a head's absent places not held), their
        n = 0                       # log-weights (a part without any holds none) and the anchors
        for la in red.layers:
            k, v, beta = la.keys, la.values, getattr(la, "beta", None)
            kept = round(la.counted() * k.shape[0] * k.shape[1]) if isinstance(la, ReducedLayer) else k.shape[2]
            n += kept * (k.shape[3] * k.element_size() + v.shape[3] * v.element_size()
                         + (0 if beta is None or not weights else beta.element_size()))
            n += 0 if getattr(la, "anchor", None) is None else la.anchor.nbytes
            # a bounded layer's scores (float32, one per held place: 1/(2 D) of its keys and values in float32)
            n += 0 if getattr(la, "scores", None) is None or not weights else la.scores.nbytes
        return n

    def holds_own(red):
        return own(red, weights=False) <= red.nbytes() <= own(red)

    red = kvcodec.reduce(full, m, keep=0.2, method=method, tokens=ids)
    assert holds_own(red) and red.nbytes() < 0.4 * full_bytes
    m.generate(torch.cat([ids, _ids(5, 1)], 1), **cache_arg(m, red), max_new_tokens=20, do_sample=False,
               pad_token_id=0)
    assert holds_own(red)
    back = kvcodec.decode(kvcodec.encode(red), m)  # log-weights decode as a tensor, zeros where the cache had none
    assert holds_own(back) and back.nbytes() < 0.4 * full_bytes
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(red.reduced_layers(), back.reduced_layers()))


def test_reduce_keep_all_equals_full_cache_and_same_seed_same_cache():
    m = _model("llama")
    ids = _ids(120)
    cache = model_cache(m, ids)
    nxt = _ids(4, 3)
    ref = m(nxt, **cache_arg(m, model_cache(m, ids))).logits
    assert torch.equal(m(nxt, **cache_arg(m, kvcodec.reduce(cache, m, keep=1.0))).logits, ref)
    a = kvcodec.reduce(cache, m, keep=0.25, method="sample", seed=7)
    b = kvcodec.reduce(cache, m, keep=0.25, method="sample", seed=7)
    c = kvcodec.reduce(cache, m, keep=0.25, method="sample", seed=8)
    assert torch.equal(a.layers[1].keys, b.layers[1].keys) and torch.equal(a.layers[1].beta, b.layers[1].beta)
    assert not torch.equal(a.layers[1].beta, c.layers[1].beta)
    assert not torch.equal(m(nxt, **cache_arg(m, a)).logits, ref)  # a reduction changes the output


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


def _kept_positions(reduced_keys, keys):
    """The positions ``[b, h, entries]`` of the original ``keys`` each kept entry is (every entry must be one)."""
    hit = (reduced_keys[:, :, :, None, :] == keys[:, :, None, :, :]).all(-1)
    assert hit.any(-1).all()
    return hit.float().argmax(-1)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tova_keeps_what_the_last_token_attends_to_most(kind):
    """TOVA: per layer, the last token and the tokens the last token's attention weights (the eager model's
    own, output_attentions, averaged over every query head of the layer) rank highest; the same tokens in every
    KV head.  Checked against float64 scores: each kept token within float32 error of the last one kept."""
    m = _model(kind)
    ids = _ids(90)
    out = m(ids, use_cache=True, output_attentions=True)
    cache = output_cache(out)
    red = kvcodec.reduce(cache, m, budget=17, method="tova", tokens=ids)
    e = plan_for(90, budget=17)[2]  # as many entries as a merge-reduce summary of that budget holds
    assert red.entries() == e and red.method == "tova"
    for li, layer in enumerate(cache.layers):
        score = out.attentions[li][0, :, -1].double().mean(0)  # [90], the last query, all query heads
        kept = _kept_positions(red.layers[li].keys, layer.keys)
        assert (kept == kept[:, :1]).all()  # every KV head keeps the same tokens
        kept = kept[0, 0]
        assert kept[-1] == 89 and (kept.diff() > 0).all()
        last = score[:89].topk(e - 1).values[-1]
        assert (score[kept[:-1]] >= last - 1e-7).all()
        assert torch.equal(red.layers[li].values, layer.values[:, :, kept])
    a = kvcodec.reduce(cache, m, budget=17, method="tova")  # tokens recovered from the cache
    assert torch.equal(a.layers[1].keys, red.layers[1].keys)
    out2 = m.generate(torch.cat([ids, _ids(3, 1)], 1), **cache_arg(m, red), max_new_tokens=4, do_sample=False,
                      pad_token_id=0)
    assert out2.shape == (1, 97)


def test_tova_knowing_the_question_ranks_every_token_by_the_questions_last_query():
    """With question=: the question's last query, its weights as the eager model computes them (output_attentions,
    the question's own keys in the softmax), averaged over the query heads; the cache's last token is not
    forced."""
    import copy

    m = _model("llama")
    ids, q = _ids(100), _ids(7, 5)
    cache = model_cache(m, ids)
    ref = m(q, **cache_arg(m, copy.deepcopy(cache)), output_attentions=True).attentions
    red = kvcodec.reduce(cache, m, budget=20, method="tova", question=q)
    e = plan_for(100, budget=20)[2]
    assert cache.get_seq_length() == 100 and red.entries() == e
    for li, layer in enumerate(cache.layers):
        score = ref[li][0, :, -1, :100].double().mean(0)  # [100]: the cache's keys, weights over all 107
        kept = _kept_positions(red.layers[li].keys, layer.keys)[0, 0]
        assert (score[kept] >= score.topk(e).values[-1] - 1e-7).all()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_kvzip_keeps_the_sinks_and_what_the_replay_attends_to_most(kind):
    """KVzip: per KV head, the sinks and the tokens with the highest peak attention (the eager model's own
    weights, output_attentions, over every replayed query and every query head of the group) while the model
    reads the prompt and the cache's tokens again after the cache."""
    import copy

    m = _model(kind)
    ids, prompt = _ids(80), _ids(3, 9)
    cache = model_cache(m, ids)
    red = kvcodec.reduce(cache, m, budget=24, method="kvzip", tokens=ids, prompt=prompt, allocation="uniform")
    e = plan_for(80, budget=24)[2]
    assert red.entries() == e and cache.get_seq_length() == 80
    att_out = m(torch.cat([prompt, ids], 1), **cache_arg(m, copy.deepcopy(cache)), output_attentions=True).attentions
    differ = False
    for li, layer in enumerate(cache.layers):
        h = layer.keys.shape[1]
        w = att_out[li][0, :, :, :80].double()  # [hq, 83, 80]: the replay's weights on the cached keys
        score = w.amax(1).view(h, -1, 80).amax(1)  # [h, 80]
        kept = _kept_positions(red.layers[li].keys, layer.keys)[0]  # [h, e]
        assert (kept[:, :4] == torch.arange(4)).all()  # the sinks
        last = score[:, 4:].topk(e - 4, -1).values[:, -1:]
        assert (score.gather(1, kept[:, 4:]) >= last - 1e-7).all()
        differ |= not (kept == kept[:1]).all()
    if kind == "llama":  # 2 KV heads: each keeps its own tokens
        assert differ
    # no prompt: the replay follows at once
    plain = kvcodec.reduce(cache, m, budget=24, method="kvzip", tokens=ids, allocation="uniform")
    assert not all(torch.equal(a.keys, b.keys) for a, b in zip(plain.layers, red.layers))
    with pytest.raises(ValueError, match="reads no prompt"):
        kvcodec.reduce(cache, m, budget=24, method="tova", tokens=ids, prompt=prompt)
    with pytest.raises(ValueError, match="no question is needed"):
        kvcodec.reduce(cache, m, budget=24, method="kvzip", question=prompt)


def test_layer_budgets_rank_every_layer_and_head_together():
    """layer_budgets: one ranking of every non-sink score of every layer, head and row; a layer gets its sinks
    plus its heads' mean share of the top places; the total is exact; a layer never gets more than it holds."""
    from kvcodec.reduction import layer_budgets

    g = torch.Generator().manual_seed(3)
    n, s, e = 40, 4, 12
    hi = torch.rand(2, 3, n, generator=g) + 10  # every score above layer 1's: layer 0 takes all it can
    lo = torch.rand(2, 3, n, generator=g)
    mid = torch.rand(2, 3, n, generator=g) + 5
    # 3 layers x 3 heads x 8 places per row: all to layer 0's 3 x 36 candidates, 8 per head
    assert layer_budgets({0: hi, 1: lo, 2: mid}, e, s) == {0: s + 3 * (e - s), 1: s, 2: s}
    # 3 x 3 x 16 places: layer 0 takes every token (36 per head), the middle layer the 36 left
    assert layer_budgets({0: hi, 1: lo, 2: mid}, 20, s) == {0: n, 1: s, 2: s + 12}
    # one head's scores high: it takes its 36 tokens, the layer's other heads the 12 places left (the other
    # layer scores lower), so the layer gets the mean, 16 places
    one = lo.clone()
    one[:, 0] += 10
    assert layer_budgets({0: one, 1: lo - 1}, e, s) == {0: s + 16, 1: s}
    # brute force on random scores: the counts of the global top places, averaged, rounded by largest remainder
    sc = {li: torch.rand(1, 2, n, generator=g) * (li + 1) for li in range(4)}
    got = layer_budgets(sc, e, s)
    allv = torch.cat([sc[li][..., s:].flatten() for li in range(4)])
    cut = allv.sort(descending=True).values[4 * 2 * (e - s) - 1]
    share = [float((sc[li][..., s:] >= cut).sum()) / 2 for li in range(4)]
    assert sum(got.values()) == 4 * e
    assert all(abs(got[li] - s - share[li]) < 1 for li in range(4))
    assert layer_budgets(sc, n + 5, s) == {li: n for li in range(4)}  # the budget holds every token
    assert layer_budgets({}, e, s) == {}


def test_rank_budgets_price_a_layer_by_what_its_heads_lose_together():
    """rank_budgets: a layer's r-th place is worth the mean over its heads and rows of their r-th largest score;
    the largest worths over all layers win; the total is exact; a layer never gets more than it holds; where
    one sharp head outranks a layer of evenly useful heads, layer_budgets favours the sharp head's layer and
    rank_budgets the even one."""
    from kvcodec.reduction import layer_budgets, rank_budgets

    g = torch.Generator().manual_seed(4)
    n, s, e = 40, 4, 12
    hi = torch.rand(2, 3, n, generator=g) + 10
    lo = torch.rand(2, 3, n, generator=g)
    mid = torch.rand(2, 3, n, generator=g) + 5
    assert rank_budgets({0: hi, 1: lo, 2: mid}, e, s) == {0: s + 3 * (e - s), 1: s, 2: s}
    assert rank_budgets({0: hi, 1: lo, 2: mid}, 20, s) == {0: n, 1: s, 2: s + 12}  # 48 places: 36 + 12
    # layer 0: head 0 scores ~10 everywhere, heads 1 and 2 ~0 (worth ~10/3 per place); layer 1: every head ~4
    sharp = torch.rand(1, 3, n, generator=g) * 0.01
    sharp[:, 0] += 10
    even = torch.rand(1, 3, n, generator=g) * 0.01 + 4
    assert rank_budgets({0: sharp, 1: even}, e, s) == {0: s, 1: s + 2 * (e - s)}
    # layer_budgets: 2 x 3 x 8 = 48 places, 36 of them layer 0's head 0, 12 layer 1's: means 12 and 4
    assert layer_budgets({0: sharp, 1: even}, e, s) == {0: s + 12, 1: s + 4}
    # brute force on random scores of several scales
    sc = {li: torch.rand(2, 2, n, generator=g) ** (li + 1) * (li + 1) for li in range(4)}
    got = rank_budgets(sc, e, s)
    worth = []
    for li in range(4):
        rows = [sorted(sc[li][b, h, s:].tolist(), reverse=True) for b in range(2) for h in range(2)]
        worth += [(sum(r[i] for r in rows) / 4, li) for i in range(n - s)]
    won = sorted(worth, key=lambda t: -t[0])[: 4 * (e - s)]
    assert got == {li: s + sum(1 for _, w in won if w == li) for li in range(4)}
    assert sum(got.values()) == 4 * e
    assert rank_budgets(sc, n + 5, s) == {li: n for li in range(4)}
    assert rank_budgets({}, e, s) == {}
    assert rank_budgets(sc, 3, s) == {li: 3 for li in range(4)}  # fewer entries than sinks: the first ones
    assert rank_budgets({3: even, 7: sharp}, e, s) == {3: s + 2 * (e - s), 7: s}  # any layer indices
    with pytest.raises(ValueError, match="cover 30 tokens"):
        rank_budgets({0: hi, 1: lo[..., :30]}, e, s)


def _beta(layer):
    """A reduced layer's log-weights (None: every entry at 0)."""
    return layer.beta if layer.beta is not None else torch.zeros(layer.keys.shape[:3])


def _padded(red, model):
    """The same entries as ``red`` with every reduced layer padded to the longest with entries whose log-weight
    is -1e30 (attention 0): equal sizes, so the mask transformers builds fits every layer."""
    top = max(la.entries() for la in red.reduced_layers())
    scale = att.scalings(model)
    layers = []
    for i, la in enumerate(red.layers):
        b, h, e, d = la.keys.shape
        pad = top - e
        own = la.beta if la.beta is not None else torch.zeros(b, h, e)  # (heads: the absent entries' -inf)
        beta = torch.cat([own, torch.full((b, h, pad), -1e30)], 2)
        out = ReducedLayer(Plan(k=1, block=1, method=None), i, scale[i])
        out.set_fixed(torch.cat([la.keys, torch.zeros(b, h, pad, d)], 2),
                      torch.cat([la.values, torch.zeros(b, h, pad, la.values.shape[3])], 2),
                      la.cumulative_length, beta=beta)
        layers.append(out)
    return ReducedCache(model, Plan(k=1, block=1, method=None), layers=layers, method="kvzip")


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", KINDS)
def test_kvzip_spread_over_layers_runs_with_layers_of_different_sizes(kind, impl):
    """allocation="layers": per layer the replay's top tokens by the shared ranking; layers of different sizes
    attend like the same entries padded to one size with masked entries (several new tokens: the causal part of
    the mask follows each layer), generate() runs, and the file round-trips."""
    import copy

    from kvcodec.reduction import layer_budgets, rank_budgets, replay_observation

    m = _model(kind, impl)
    ids = _ids(120)
    cache = model_cache(m, ids)
    obs = replay_observation(cache, m, ids)
    red = kvcodec.reduce(cache, m, budget=30, method="kvzip", observation=obs, allocation="layers")
    e = plan_for(120, budget=30)[2]
    want = layer_budgets({i: obs.peak[i] for i in range(len(cache.layers))}, e, 4)
    sizes = [la.entries() for la in red.layers]
    assert sizes == [want[i] for i in range(len(sizes))] and sum(sizes) == e * len(sizes)
    assert red.entries() == e
    for li, layer in enumerate(cache.layers):  # each head: the sinks and its own top tokens
        kept = _kept_positions(red.layers[li].keys, layer.keys)[0]
        assert (kept[:, :4] == torch.arange(4)).all()
        sc = obs.peak[li][0]
        last = sc[:, 4:].topk(sizes[li] - 4, -1).values[:, -1:]
        assert (sc.gather(1, kept[:, 4:]) >= last).all()
    nxt = _ids(6, 7)
    got = m(nxt, **cache_arg(m, copy.deepcopy(red))).logits
    ref = m(nxt, **cache_arg(m, _padded(red, m))).logits
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    uni = kvcodec.reduce(cache, m, budget=30, method="kvzip", observation=obs, allocation="uniform")
    if len(set(sizes)) > 1:
        assert not torch.allclose(got, m(nxt, **cache_arg(m, copy.deepcopy(uni))).logits)
    out = m.generate(torch.cat([ids, nxt], 1), **cache_arg(m, copy.deepcopy(red)), max_new_tokens=8,
                     do_sample=False, pad_token_id=0)
    assert out.shape == (1, 134)
    data = kvcodec.encode(red)
    info = kvcodec.inspect(data)["reduce"]
    assert info["entries"] == e and info["entries_range"] == [min(sizes), max(sizes)]
    assert info["keep"] == round(e / 120, 4)
    back = kvcodec.decode(data, m)
    assert [la.entries() for la in back.layers] == sizes and back.describe() == red.describe()
    assert torch.equal(m(nxt, **cache_arg(m, back)).logits, got)
    lossy = kvcodec.decode(kvcodec.encode(red, tier="lossy", bits=3), m)
    assert [la.entries() for la in lossy.layers] == sizes
    ranks = kvcodec.reduce(cache, m, budget=30, method="kvzip", observation=obs, allocation="ranks")
    default = kvcodec.reduce(cache, m, budget=30, method="kvzip", observation=obs)  # allocation "heads"
    heads = kvcodec.reduce(cache, m, budget=30, method="kvzip", observation=obs, allocation="heads")
    assert all(torch.equal(a.keys, b.keys) and torch.equal(_beta(a), _beta(b))
               for a, b in zip(default.layers, heads.layers))
    want = rank_budgets({i: obs.peak[i] for i in range(len(cache.layers))}, e, 4)
    sizes = [la.entries() for la in ranks.layers]
    assert sizes == [want[i] for i in range(len(sizes))] and sum(sizes) == e * len(sizes)
    got = m(nxt, **cache_arg(m, copy.deepcopy(ranks))).logits
    torch.testing.assert_close(got, m(nxt, **cache_arg(m, _padded(ranks, m))).logits, rtol=1e-5, atol=1e-5)
    back = kvcodec.decode(kvcodec.encode(ranks), m)
    assert [la.entries() for la in back.layers] == sizes
    for alloc in ("layers", "ranks", "heads", "layer-heads"):
        with pytest.raises(ValueError, match=f"allocation '{alloc}' ranks kvzip"):
            kvcodec.reduce(cache, m, budget=30, method="snapkv", tokens=ids, allocation=alloc)
    with pytest.raises(ValueError, match="unknown allocation"):
        kvcodec.reduce(cache, m, budget=30, method="kvzip", observation=obs, allocation="rows")


def test_head_budgets_rank_every_head_and_keep_each_row_s_total():
    """head_budgets: one ranking of every score (sinks excluded) per batch row over all layers and heads (or,
    with ``within``, each layer's heads among themselves); each head gets its sinks plus its places."""
    from kvcodec.reduction import head_budgets

    n, s = 12, 2
    sharp = torch.zeros(1, 2, n)
    sharp[0, 0, s:] = torch.arange(n - s, 0, -1).float()  # head 0 wants everything, head 1 nothing
    flat = torch.zeros(1, 2, n)
    flat[0, 0, s:] = torch.linspace(0.9, 0.0, 2 * (n - s))[0::2]  # 0.9, 0.8, 0.7, ... between the two heads
    flat[0, 1, s:] = torch.linspace(0.9, 0.0, 2 * (n - s))[1::2]
    got = head_budgets({0: sharp, 1: flat}, 5, s)  # 2 layers x 2 heads x 3 places = 12 places
    assert got[0].tolist() == [[s + 10, s]] and got[1].tolist() == [[s + 1, s + 1]]
    assert sum(int(v.sum()) for v in got.values()) == 4 * 5
    within = head_budgets({0: sharp, 1: flat}, 5, s, within={0: 5, 1: 5})  # each layer keeps 2 x 5
    assert within[0].tolist() == [[s + 6, s]] and within[1].tolist() == [[5, 5]]
    rows = torch.stack([sharp[0], sharp[0].flip(0)])  # two batch rows, each ranked on its own
    got = head_budgets({0: rows}, 5, s)
    assert got[0].tolist() == [[s + 6, s], [s, s + 6]]
    assert head_budgets({0: sharp}, n + 1, s)[0].tolist() == [[n, n]]  # everything fits
    assert head_budgets({}, 5, s) == {}


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_kvzip_heads_of_a_layer_keep_different_numbers_and_store_only_what_they_keep(kind, impl):
    """allocation="heads" (format 1.8): each head keeps its sinks and its own best tokens up to its budget,
    first and in token order; the layer holds its longest head's count, the other heads' absent places zero
    with log-weight -inf.  Attention equals that of the same entries padded and masked by hand; the file
    stores only the kept entries (kv components = the kept ones), is stamped 1.8, round-trips bit for bit in
    the lossless tier, decodes in the lossy tier, and the spec-only decoder reads it."""
    import copy

    from kvcodec.reduction import head_budgets, rank_budgets, replay_observation

    from .independent import decoder as K

    m = _model(kind, impl)
    ids = _ids(120)
    cache = model_cache(m, ids)
    obs = replay_observation(cache, m, ids)
    e = plan_for(120, budget=30)[2]
    peaks = {i: obs.peak[i] for i in range(len(cache.layers))}
    for alloc, want in (("heads", head_budgets(peaks, e, 4)),
                        ("layer-heads", head_budgets(peaks, e, 4, rank_budgets(peaks, e, 4)))):
        # (fit=False: the selected tokens' own values at log-weight 0; the fit is tested below)
        red = kvcodec.reduce(cache, m, budget=30, method="kvzip", observation=obs, allocation=alloc, fit=False,
                             bound=False)
        assert red.counted() == pytest.approx(e) and red.describe()["entries"] == e
        for li, (layer, la) in enumerate(zip(cache.layers, red.layers)):
            count = want[li][0]
            assert la.entries() == int(count.max())
            for h in range(layer.keys.shape[1]):
                c = int(count[h])
                kept = _kept_positions(la.keys[:, h:h + 1, :c], layer.keys[:, h:h + 1])[0][0]
                assert (kept[:4] == torch.arange(4)).all() and (kept.diff() > 0).all()
                sc = obs.peak[li][0, h]
                assert (sc[kept[4:]] >= sc[4:].topk(c - 4).values[-1]).all()
                beta = la.beta if la.beta is not None else torch.zeros(la.keys.shape[:3])  # None: every head full
                assert (beta[0, h, :c] == 0).all() and torch.isneginf(beta[0, h, c:]).all()
                assert not la.keys[0, h, c:].any() and not la.values[0, h, c:].any()
        nxt = _ids(6, 7)
        got = m(nxt, **cache_arg(m, copy.deepcopy(red))).logits
        torch.testing.assert_close(got, m(nxt, **cache_arg(m, _padded(red, m))).logits, rtol=1e-5, atol=1e-5)
        data = kvcodec.encode(red)
        ragged = any(la.beta is not None and torch.isneginf(la.beta).any() for la in red.layers)
        assert ragged or cache.layers[0].keys.shape[1] == 1  # one KV head: a layer's heads cannot differ
        assert data[10] == (8 if ragged else 7)
        info = kvcodec.inspect(data)
        assert info["reduce"]["entries"] == e and info["reduce"].get("held", e) == red.entries()
        kv_comps = sum(s["components"] for s in info["sections"] if s["type"] == "kv")
        kept = sum(int(c.sum()) for c in want.values())
        assert kv_comps == kept * 2 * cache.layers[0].keys.shape[3]  # keys and values of the kept entries only
        back = kvcodec.decode(data, m)
        def beta(la):  # None: every entry at log-weight 0
            return la.beta if la.beta is not None else torch.zeros(la.keys.shape[:3])

        for a, b in zip(red.layers, back.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values) and torch.equal(beta(a), beta(b))
        assert back.describe() == red.describe()
        assert torch.equal(m(nxt, **cache_arg(m, back)).logits, got)
        lossy = kvcodec.decode(kvcodec.encode(red, tier="lossy", bits=3), m)
        for a, b in zip(red.layers, lossy.layers):
            assert torch.equal(beta(a), beta(b)) and not b.keys[torch.isneginf(beta(b))].any()
        _, _, spec_k, spec_v, _ = K.decode_file(data, None)
        for li, la in enumerate(red.layers):
            assert spec_k[li].tobytes() == la.keys.numpy().tobytes()
            assert spec_v[li].tobytes() == la.values.numpy().tobytes()
        out = m.generate(torch.cat([ids, nxt], 1), **cache_arg(m, copy.deepcopy(red)), max_new_tokens=4,
                         do_sample=False, pad_token_id=0)
        assert out.shape == (1, 130)


@pytest.mark.parametrize("alloc", ["uniform", "heads"])
def test_rest_gives_each_head_s_evicted_tokens_one_atom(alloc):
    """rest=True: a head that evicts tokens and keeps more than its sinks keeps one entry fewer of its own (its
    sinks and best replay scores, in token order) and, right after them, one atom: the mean key and mean value
    of every token it evicted, log-weight log(count); the same number of entries as without rest, and a head
    that keeps only its sinks keeps them all, with no atom.  The file keeps the atom bit for bit, and a
    merge-reduce method, whose atoms summarise every token already, refuses the option."""
    import copy

    from kvcodec.reduction import head_budgets, replay_observation

    m = _model("qwen2")
    ids = _ids(120)
    cache = model_cache(m, ids)
    obs = replay_observation(cache, m, ids)
    # a second observation in which layer 0's scores lose every place to layer 1's: its head keeps its sinks only
    flat = copy.copy(obs)
    flat.peak = {**obs.peak, 0: torch.full_like(obs.peak[0], -1.0)}
    atoms = sinks_only = 0
    for budget, obs in ((30, obs), (30, flat), (12, obs)):
        peaks = {i: obs.peak[i] for i in range(len(cache.layers))}
        e = plan_for(120, budget=budget)[2]
        want = head_budgets(peaks, e, 4) if alloc == "heads" else None
        red = kvcodec.reduce(cache, m, budget=budget, method="kvzip", observation=obs, allocation=alloc, rest=True,
                             fit=False)
        assert red.counted() == pytest.approx(e)
        for li, (layer, la) in enumerate(zip(cache.layers, red.layers)):
            for h in range(layer.keys.shape[1]):
                c = int(want[li][0, h]) if want is not None else e
                if c <= 4:  # only sinks: all kept, no atom
                    sinks_only += 1
                    kept = _kept_positions(la.keys[:, h:h + 1, :c], layer.keys[:, h:h + 1])[0][0]
                    assert (kept == torch.arange(c)).all() and (_beta(la)[0, h, :c] == 0).all()
                    continue
                atoms += 1
                kept = _kept_positions(la.keys[:, h:h + 1, :c - 1], layer.keys[:, h:h + 1])[0][0]
                assert (kept[:4] == torch.arange(4)).all() and (kept.diff() > 0).all()
                sc = obs.peak[li][0, h]
                if c > 5:
                    assert (sc[kept[4:]] >= sc[4:].topk(c - 5).values[-1]).all()
                out = torch.ones(120, dtype=torch.bool)
                out[kept] = False
                k64, v64 = layer.keys[0, h].double(), layer.values[0, h].double()
                # (float64 means in another summation order: equal to float32 rounding)
                torch.testing.assert_close(la.keys[0, h, c - 1], k64[out].mean(0).to(la.keys.dtype), rtol=1e-6,
                                           atol=1e-7)
                torch.testing.assert_close(la.values[0, h, c - 1], v64[out].mean(0).to(la.values.dtype), rtol=1e-6,
                                           atol=1e-7)
                beta = _beta(la)[0, h]
                assert (beta[:c - 1] == 0).all() and beta[c - 1] == torch.log(torch.tensor(float(out.sum())))
                assert torch.isneginf(beta[c:]).all() and not la.keys[0, h, c:].any()
        back = kvcodec.decode(kvcodec.encode(red), m)
        for a, b in zip(red.layers, back.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values) and torch.equal(_beta(a), _beta(b))
        nxt = _ids(6, 7)
        assert torch.equal(m(nxt, **cache_arg(m, back)).logits, m(nxt, **cache_arg(m, copy.deepcopy(red))).logits)
    assert atoms and (sinks_only or alloc == "uniform")
    with pytest.raises(ValueError, match="rest="):
        kvcodec.reduce(cache, m, budget=30, method="cluster", rest=True)


def _block_attention(q, keys, values, beta, scaling):
    """(mass, output) of a block of entries seen from queries ``q`` ``[m, d]``: sum_j exp(s<q, k_j> + beta_j) and
    the attention output over the block alone (float64)."""
    logits = scaling * q.double() @ keys.double().T + beta.double()
    return torch.logsumexp(logits, -1), torch.softmax(logits, -1) @ values.double()


def test_fit_recovers_a_block_of_repeated_tokens_exactly(monkeypatch):
    """Attention matching (kvcodec.reduction.fit): a head whose 40 tokens are 8 distinct (key, value) pairs,
    each repeated 5 times, kept as one copy of each: the fitted masses are 5 (log-weight log 5) and the values
    unchanged, so the block's mass and output are the whole block's for queries the fit never saw too; the plain
    selection (masses 1) gets the output right but the mass 5 times too small; the block's attention computed
    in steps of 7 keys gives the same fit.  A head that keeps every token gets masses 1 and its own values
    back."""
    from kvcodec.reduction.fit import fit_head

    g = torch.Generator().manual_seed(3)
    d, s = 16, 0.25
    base_k, base_v = torch.randn(8, d, generator=g), torch.randn(8, d, generator=g)
    keys, values = base_k.repeat_interleave(5, 0), base_v.repeat_interleave(5, 0)
    ref, unseen = torch.randn(300, d, generator=g), torch.randn(50, d, generator=g)
    x, lw = fit_head(keys, values, base_k, base_v, ref, s)
    torch.testing.assert_close(lw, torch.full((8,), math.log(5.0), dtype=torch.float64), rtol=0, atol=1e-6)
    torch.testing.assert_close(x, base_v.double(), rtol=0, atol=1e-6)  # (the products are float32's)
    want_m, want_o = _block_attention(unseen, keys, values, torch.zeros(40), s)
    got_m, got_o = _block_attention(unseen, base_k, x, lw, s)
    torch.testing.assert_close(got_m, want_m, rtol=0, atol=1e-6)
    torch.testing.assert_close(got_o, want_o, rtol=0, atol=1e-6)
    plain_m, _ = _block_attention(unseen, base_k, base_v, torch.zeros(8), s)
    assert (want_m - plain_m - math.log(5.0)).abs().max() < 1e-6  # what the fit corrects
    from kvcodec.reduction import fit as fit_module

    monkeypatch.setattr(fit_module, "KEY_CHUNK", 7)  # the block's attention in 6 steps: the same fit
    x7, lw7 = fit_head(keys, values, base_k, base_v, ref, s)
    torch.testing.assert_close(x7, x, rtol=0, atol=1e-6)
    torch.testing.assert_close(lw7, lw, rtol=0, atol=1e-6)
    keys, values = torch.randn(30, d, generator=g), torch.randn(30, d, generator=g)
    x, lw = fit_head(keys, values, keys, values, ref, s)
    assert lw.abs().max() < 1e-4
    torch.testing.assert_close(x, values.double(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("alloc", ["uniform", "heads"])
def test_fit_matches_the_whole_cache_s_attention_better_than_the_selection(alloc):
    """reduce(fit=True) (kvzip's default): the same keys as the plain selection, each head's log-weights and values
    refitted; on the replay's queries each head's block mass is closer to the whole cache's (summed over the
    heads) and its output too; a head that keeps every token is untouched.  Bit for bit through a file, logits
    equal after decode, generate() runs; other methods and an observation without reference queries are
    refused."""
    import copy

    from kvcodec.reduction import replay_observation

    m = _model("llama")
    ids = _ids(120)
    cache = model_cache(m, ids)
    obs = replay_observation(cache, m, ids)
    assert all(obs.reference[i].shape[:2] == (1, m.config.num_attention_heads) for i in range(len(cache.layers)))
    scale = att.scalings(m)
    plain = kvcodec.reduce(cache, m, budget=20, method="kvzip", observation=obs, allocation=alloc, fit=False)
    fitted = kvcodec.reduce(cache, m, budget=20, method="kvzip", observation=obs, allocation=alloc)  # the default
    err = {"plain": [0.0, 0.0], "fit": [0.0, 0.0]}
    for li, (layer, a, b) in enumerate(zip(cache.layers, plain.layers, fitted.layers)):
        assert torch.equal(a.keys, b.keys) and torch.equal(torch.isneginf(_beta(a)), torch.isneginf(_beta(b)))
        heads = layer.keys.shape[1]
        group = obs.reference[li].shape[1] // heads
        for h in range(heads):
            q = obs.reference[li][0, h * group:(h + 1) * group].reshape(-1, layer.keys.shape[-1])
            want_m, want_o = _block_attention(q, layer.keys[0, h], layer.values[0, h], torch.zeros(120), scale[li])
            live = torch.isfinite(_beta(b)[0, h])
            if int(live.sum()) == 120:
                assert torch.equal(a.values[0, h], b.values[0, h]) and not _beta(b)[0, h].any()
                continue
            for name, la in (("plain", a), ("fit", b)):
                got_m, got_o = _block_attention(q, la.keys[0, h, live], la.values[0, h, live], _beta(la)[0, h, live],
                                                scale[li])
                err[name][0] += float((got_m - want_m).square().mean())
                err[name][1] += float((got_o - want_o).square().sum(-1).mean())
    assert err["fit"][0] < 0.5 * err["plain"][0] and err["fit"][1] < err["plain"][1]
    back = kvcodec.decode(kvcodec.encode(fitted), m)
    for a, b in zip(fitted.layers, back.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values) and torch.equal(_beta(a), _beta(b))
    nxt = _ids(6, 7)
    assert torch.equal(m(nxt, **cache_arg(m, back)).logits, m(nxt, **cache_arg(m, copy.deepcopy(fitted))).logits)
    out = m.generate(torch.cat([ids, nxt], 1), **cache_arg(m, copy.deepcopy(fitted)), max_new_tokens=3,
                     do_sample=False, pad_token_id=0)
    assert out.shape == (1, 129)
    with pytest.raises(ValueError, match="fit="):
        kvcodec.reduce(cache, m, budget=20, method="streaming", tokens=ids, fit=True)
    bare = copy.copy(obs)
    bare.reference = {}
    with pytest.raises(ValueError, match="reference queries"):
        kvcodec.reduce(cache, m, budget=20, method="kvzip", observation=bare)


@pytest.mark.parametrize("method", ["snapkv", "tova"])
def test_fit_of_a_prefill_scored_selection_matches_attention_on_the_prefill_s_queries(method):
    """reduce(method="snapkv" | "tova", fit=True): no replay - the selection's values and log-weights are refitted
    on every ceil(n / 1024)-th query of the prefill reduce() observes itself; on those queries each head's block
    mass and output are closer to the whole cache's than the plain selection's; the keys are the selection's;
    an observation recorded without reference queries is refused."""
    from kvcodec.reduction import observe

    m = _model("llama")
    ids = _ids(120)
    cache = model_cache(m, ids)
    with observe(m, window=64, stride=1) as obs:
        m(ids, use_cache=False)
    scale = att.scalings(m)
    plain = kvcodec.reduce(cache, m, budget=20, method=method, tokens=ids, bound=False)
    fitted = kvcodec.reduce(cache, m, budget=20, method=method, tokens=ids, fit=True, bound=False)
    err = {"plain": [0.0, 0.0], "fit": [0.0, 0.0]}
    for li, (layer, a, b) in enumerate(zip(cache.layers, plain.layers, fitted.layers)):
        assert torch.equal(a.keys, b.keys)
        heads = layer.keys.shape[1]
        group = obs.reference[li].shape[1] // heads
        for h in range(heads):
            q = obs.reference[li][0, h * group:(h + 1) * group].reshape(-1, layer.keys.shape[-1])
            want_m, want_o = _block_attention(q, layer.keys[0, h], layer.values[0, h], torch.zeros(120), scale[li])
            for name, la in (("plain", a), ("fit", b)):
                got_m, got_o = _block_attention(q, la.keys[0, h], la.values[0, h], _beta(la)[0, h], scale[li])
                err[name][0] += float((got_m - want_m).square().mean())
                err[name][1] += float((got_o - want_o).square().sum(-1).mean())
    assert err["fit"][0] < 0.5 * err["plain"][0] and err["fit"][1] < err["plain"][1]
    with observe(m, window=64) as bare:
        m(ids, use_cache=False)
    with pytest.raises(ValueError, match="reference queries"):
        kvcodec.reduce(cache, m, budget=20, method=method, observation=bare, fit=True)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_fit_on_policy_refits_each_layer_on_queries_through_the_fitted_layers_below(kind):
    """fit="policy": layer 0 sees the same queries as the replay (nothing below it changed), so its fit equals
    fit=True's bit for bit; the layers above see queries computed through fitted layers, so theirs differ; the
    keys are the selection's in every layer.  Bit for bit through a file; an unknown fit value is refused."""
    import copy

    from kvcodec.reduction import replay_observation

    m = _model(kind)
    ids = _ids(120)
    cache = model_cache(m, ids)
    obs = replay_observation(cache, m, ids, prompt=[5, 6, 7])
    off = kvcodec.reduce(cache, m, budget=20, method="kvzip", observation=obs)
    pol = kvcodec.reduce(cache, m, budget=20, method="kvzip", observation=obs, fit="policy")
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(off.layers, pol.layers))
    assert torch.equal(off.layers[0].values, pol.layers[0].values) and torch.equal(_beta(off.layers[0]),
                                                                                     _beta(pol.layers[0]))
    assert not all(torch.equal(a.values, b.values) for a, b in zip(off.layers[1:], pol.layers[1:]))
    back = kvcodec.decode(kvcodec.encode(pol), m)
    for a, b in zip(pol.layers, back.layers):
        assert torch.equal(a.values, b.values) and torch.equal(_beta(a), _beta(b))
    nxt = _ids(6, 7)
    assert torch.equal(m(nxt, **cache_arg(m, back)).logits, m(nxt, **cache_arg(m, copy.deepcopy(pol))).logits)
    with pytest.raises(ValueError, match="fit must be"):
        kvcodec.reduce(cache, m, budget=20, method="kvzip", observation=obs, fit="yes")


def test_heads_headers_and_weights_are_checked():
    """spec section 14.2 (1.8): parts.heads lists each row's heads, each at most fixed, the longest fixed and some
    shorter; absent entries (and only they) have log-weight -inf; a file with heads stamped below 1.8 is
    refused by field."""
    from kvcodec.container import header as hd

    m = _model("llama")
    ids = _ids(100)
    red = kvcodec.reduce(model_cache(m, ids), m, budget=25, method="kvzip", tokens=ids, allocation="heads",
                         fit=False, bound=False)  # log-weights 0 and -inf only: the tampering below relies on their bytes
    kv = kvcodec.to_canonical(red)
    li = next(i for i, st in enumerate(kv.states) if "heads" in st.parts)
    from kvcodec.tiers.base import build_header

    fixed = kv.states[li].parts["fixed"]
    for mutate, match in [
        (lambda p: p.update(heads=p["heads"] + p["heads"]), "one per batch row"),
        (lambda p: p["heads"][0].append(1), "KV heads"),
        (lambda p: p["heads"][0].__setitem__(0, fixed + 1), "heads\\[0\\]\\[0\\]"),
        (lambda p: p["heads"][0].__setitem__(0, True), "heads\\[0\\]\\[0\\]"),
        (lambda p: p.update(heads=[[fixed] * len(p["heads"][0])]), "some head"),
        (lambda p: p.update(heads=[[x - 1 if x else 0 for x in p["heads"][0]]]), "longest head"),
        (lambda p: p.update(heads=[]), "one per batch row"),
    ]:
        h = build_header(kv, "lossless", {"id": "float_ctx_rans", "params": {}}, 64, None, None)
        mutate(h["cache"]["layers"][li]["state"]["parts"])
        with pytest.raises(kvcodec.FormatError, match=match) as err:
            hd.parse(hd.dumps(h), offset=16)
        assert "parts.heads" in err.value.field
    data = kvcodec.encode(kv)
    old = bytearray(data)
    old[10] = 7
    err = check_rejects(kvcodec.FormatError, fuzz_tools().reseal(bytes(old)), match="1\\.8")
    assert err.field == "Version_Minor"
    bad = kvcodec.to_canonical(red)
    lw = bad.states[li].log_weights.clone()
    n = kv.states[li].parts["heads"][0]
    h = n.index(min(n))
    lw[0, h, min(n)] = 0.0  # an absent entry made visible: the structure no longer says it is absent
    bad.states[li].log_weights = lw
    with pytest.raises(ValueError, match="absent"):
        bad.states[li].check(li, 1)
    data = kvcodec.encode(kv)  # tamper the decoded weights inside a valid file: refused at decode by field
    from kvcodec.state import encode_payload

    good = encode_payload(kv.states[li].log_weights)
    at = data.find(good)
    assert at > 0 and len(encode_payload(lw)) == len(good)
    tampered = fuzz_tools().reseal(data[:at] + encode_payload(lw) + data[at + len(good):])
    err = check_rejects(kvcodec.FormatError, tampered, match="-inf")
    assert err.field == "State.Data"


def test_masked_entries_that_hold_data_are_stored_whole():
    """A hand-built reduced layer whose heads end in log-weight -inf over keys that are not zero is stored whole
    (no parts.heads, format 1.7: the lossless tier gives back what it was given); a KVCache that declares heads
    over absent entries holding data is refused before any byte is written."""
    plan = Plan(k=8, block=8, sinks=2, method=None, seed=0, window=0, form="dot")
    g = torch.Generator().manual_seed(1)
    keys, values = torch.randn(1, 2, 6, 4, generator=g), torch.randn(1, 2, 6, 4, generator=g)
    beta = torch.zeros(1, 2, 6)
    beta[0, 1, 3:] = float("-inf")
    layer = ReducedLayer(plan, 0, 0.5)
    layer.set_fixed(keys, values, 20, beta)
    data = kvcodec.encode(ReducedCache(None, plan, layers=[layer], method="kvzip"))
    assert data[10] == 7 and "heads" not in kvcodec.inspect(data)["reduce"]["parts"]
    back = kvcodec.decode(data).layers[0]
    assert torch.equal(back.keys, keys) and torch.equal(back.values, values) and torch.equal(back.beta, beta)
    zeroed = keys.clone()
    zeroed[0, 1, 3:] = 0
    vz = values.clone()
    vz[0, 1, 3:] = 0
    layer = ReducedLayer(plan, 0, 0.5)
    layer.set_fixed(zeroed, vz, 20, beta)
    kv = kvcodec.to_canonical(ReducedCache(None, plan, layers=[layer], method="kvzip"))
    assert kv.states[0].parts["heads"] == [[6, 3]] and kvcodec.encode(kv)[10] == 8
    with pytest.raises(ValueError, match="absent entries"):
        kvcodec.KVCache([keys], [vz], cumulative_length=[20], states=kv.states, reduce=kv.reduce)


def test_repeated_heads_layers_are_counted_once():
    """A header repeating a layer with parts.heads: the layers are one object, whose chunk count (a sum over
    its batch x heads entries) is made once, so parsing costs the header's size, not repeat x heads; the
    count is right (what the writer cut)."""
    from kvcodec.container import header as hd
    from kvcodec.tiers.base import build_header, slice_jobs

    m = _model("llama")
    ids = _ids(100)
    red = kvcodec.reduce(model_cache(m, ids), m, budget=25, method="kvzip", tokens=ids, allocation="heads")
    kv = kvcodec.to_canonical(red)
    li = next(i for i, st in enumerate(kv.states) if "heads" in st.parts)
    h = build_header(kv, "lossless", {"id": "float_ctx_rans", "params": {}}, 3, None, None)
    lay = dict(h["cache"]["layers"][li], repeat=500)
    h["cache"]["layers"] = [lay]
    got = hd.parse(hd.dumps(h), offset=16)
    assert len(got.layers) == 500 and all(x is got.layers[0] for x in got.layers)
    assert got.layers[0].__dict__["_memo_values"] == {("chunks", 3): got.layers[0].chunks(3)}
    assert got.layers[0].chunks(3) == sum(1 for j in slice_jobs(kv, 3) if j[0] == li) // 2


def test_kvzip_replays_long_caches_in_chunks_within_the_models_positions():
    """replay_chunk: each pass reads the prompt, the previous chunk's last 8 tokens and its chunk after the cache;
    each key is scored by the pass that replays it (the eager model's own weights); a replay past the model's
    positions is refused with the chunk that would fit; bad observations and tokens are refused by name."""
    import copy

    from kvcodec.reduction import replay_observation

    m = _model("llama")  # max_position_embeddings 512
    ids, prompt = _ids(300), _ids(3, 9)
    cache = model_cache(m, ids)
    with pytest.raises(ValueError, match="replay_chunk <= 201"):
        kvcodec.reduce(cache, m, budget=40, method="kvzip", tokens=ids, prompt=prompt)
    obs = replay_observation(cache, m, ids, prompt, chunk=120)  # passes over 0-119, 120-239, 240-299
    for start, end in ((0, 120), (120, 240), (240, 300)):
        lead = torch.cat([prompt, ids[:, max(0, start - 8):start]], 1)
        att = m(torch.cat([lead, ids[:, start:end]], 1), **cache_arg(m, copy.deepcopy(cache)),
                output_attentions=True).attentions
        for li in range(2):
            w = att[li][0, :, :, start:end].double().amax(1)  # [hq, chunk]
            want = w.view(2, 2, -1).amax(1)
            assert torch.allclose(obs.peak[li][0, :, start:end].double(), want, atol=1e-6)
    red = kvcodec.reduce(cache, m, budget=40, method="kvzip", tokens=ids, prompt=prompt, replay_chunk=120)
    again = kvcodec.reduce(cache, m, budget=40, method="kvzip", observation=obs)
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(red.layers, again.layers))
    with pytest.raises(ValueError, match="not both"):
        kvcodec.reduce(cache, m, budget=40, method="kvzip", observation=obs, prompt=prompt)
    short = replay_observation(cache, m, ids[:, :100])
    with pytest.raises(ValueError, match="replay_observation"):
        kvcodec.reduce(cache, m, budget=40, method="kvzip", observation=short)
    with pytest.raises(ValueError, match="batch 1 and 300"):
        kvcodec.reduce(cache, m, budget=40, method="tova", tokens=torch.cat([ids, ids]))


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
    out = m.generate(torch.cat([ids, _ids(3, 1)], 1), **cache_arg(m, red), max_new_tokens=10, do_sample=False,
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
    k, _, e = plan_for(300, 0.2)
    assert cache.entries() == e
    d = (out.logits - full).abs()
    assert d[:, : 4 + k].max() < 1e-6  # the sinks and the first block see raw tokens only (other float order)
    assert d[:, 4 + k:].max() > 1e-5  # later blocks see a summary
    out2 = m.generate(torch.cat([ids, _ids(2, 1)], 1), **cache_arg(m, cache), max_new_tokens=5, do_sample=False,
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


@pytest.mark.parametrize("method,form,window", [("cluster", "query", 0.0), ("sample", "query", 0.0),
                                                ("cluster", "kernel", 0.0), ("cluster", "dot", 0.5)])
def test_batched_ingest_matches_the_streaming_binary_counter(method, form, window):
    """kvcodec.reduce builds the buckets in one batched tree; feeding the same tokens block by block through
    the cache's update reaches the same buckets (same sizes, same spans: same total mass per bucket)."""
    m = _model("llama")
    ids = _ids(150)
    cache = model_cache(m, ids)
    red = kvcodec.reduce(cache, m, keep=0.2, method=method, window=window, form=form, tokens=ids)
    plan = red.plan
    assert plan.window == plan_for(150, 0.2, window=window)[1]
    for i, layer in enumerate(cache.layers):
        got = red.layers[i]
        lay = ReducedLayer(plan, i, got.scaling)
        lay.anchor = got.anchor
        for a in range(0, 150, 7):  # streaming, 7 tokens at a time
            lay.update(layer.keys[:, :, a:a + 7], layer.values[:, :, a:a + 7])
        att.clear_bias(i)  # no attention ran: drop the bias nobody took
        assert lay.describe() == got.describe()
        anchor = got.anchor_for(layer.keys)
        assert (anchor is None) == (form == "kernel") and (form != "dot" or not anchor.any())
        for x, y in zip(lay.levels, got.levels):
            assert (x is None) == (y is None)
            if x is not None:  # the mass the form preserves, summed per bucket
                mx = torch.logsumexp(reducers.logmass(x[0], x[2], lay.scaling, anchor), -1)
                my = torch.logsumexp(reducers.logmass(y[0], y[2], lay.scaling, anchor), -1)
                assert torch.allclose(mx, my, atol=1e-4)
    att.clear_bias(0), att.clear_bias(1)


def test_unknown_method_and_bad_keep():
    m = _model("llama")
    cache = model_cache(m, _ids(20))
    with pytest.raises(ValueError, match="unknown reduce method"):
        kvcodec.reduce(cache, m, method="nope")
    with pytest.raises(ValueError, match="keep"):
        kvcodec.reduce(cache, m, keep=1.5)


# --- the .kvz form of a reduced cache (spec/kvz.md section 14) ----------------------------------------------

@pytest.mark.parametrize("method", ["cluster", "sample", "snapkv", "streaming", "tova", "kvzip"])
def test_reduced_cache_roundtrips_through_kvz_and_keeps_decoding(method):
    """Lossless: the decoded ReducedCache holds the same entries, log-weights, anchor and parts, gives the same
    logits and keeps reducing identically as tokens are appended."""
    m = _model("llama")
    ids = _ids(150)
    red = kvcodec.reduce(model_cache(m, ids), m, keep=0.2, method=method, tokens=ids)
    data = kvcodec.encode(red)
    info = kvcodec.inspect(data)
    # the lowest version with everything the file uses: reduced caches came with 1.4, methods tova, kvzip with 1.7,
    # heads of a layer keeping different numbers (kvzip's default) with 1.8
    # and kvzip's default bound with 1.11
    heads = any(la.beta is not None and torch.isneginf(la.beta).any() for la in red.reduced_layers())
    want = "1.11" if method == "kvzip" else "1.8" if heads else "1.7" if method in ("tova", "kvzip") else "1.4"
    assert info["format_version"] == want and info["reduce"]["method"] == method and heads == (method == "kvzip")
    assert info["reduce"]["entries"] == round(red.counted()) and info["reduce"]["tokens"] == 150
    back = kvcodec.decode(data, m)
    assert isinstance(back, ReducedCache) and back.describe() == red.describe()
    for a, b in zip(red.reduced_layers(), back.reduced_layers()):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert torch.equal(a.beta if a.beta is not None else torch.zeros(a.keys.shape[:3]), b.beta)
        assert (a.anchor is None) == (b.anchor is None) and (a.anchor is None or torch.equal(a.anchor, b.anchor))
    nxt = _ids(40, 5)  # crosses block boundaries: both caches reduce again, the same way
    assert torch.equal(m(nxt, **cache_arg(m, red)).logits, m(nxt, **cache_arg(m, back)).logits)
    assert back.describe() == red.describe()
    # re-encoding the decoded cache gives the same bytes
    assert kvcodec.encode(kvcodec.decode(data, m)) == data


def test_a_tova_file_needs_1_7():
    """Method tova came with format 1.7: a file saying it is older is refused before any work, by field, and
    every method has the version that introduced it."""
    from kvcodec.container.header import REDUCE_METHOD_MINOR
    from kvcodec.state import REDUCE_METHODS

    from .independent import decoder as K

    assert set(REDUCE_METHOD_MINOR) == set(REDUCE_METHODS)
    m = _model("llama")
    ids = _ids(60)
    for method in ("tova", "kvzip"):
        kw = {"allocation": "ranks", "bound": False} if method == "kvzip" else {}  # (its defaults need 1.8, 1.11)
        data = bytearray(kvcodec.encode(kvcodec.reduce(model_cache(m, ids), m, keep=0.3, method=method, tokens=ids,
                                                       **kw)))
        assert data[10] == 7
        K.decode_file(bytes(data), None)  # the spec-only decoder reads it
        data[10] = 6
        old = fuzz_tools().reseal(bytes(data))
        err = check_rejects(kvcodec.FormatError, old, match="1\\.7")
        assert err.field == "Version_Minor"
        with pytest.raises(K.FormatError, match="needs 1.7"):
            K.decode_file(old, None)


def test_reduced_cache_composes_with_the_lossy_tier():
    m = _model("llama")
    ids = _ids(200)
    full = model_cache(m, ids)
    red = kvcodec.reduce(full, m, keep=0.25, method="cluster", tokens=ids)
    lossless = kvcodec.encode(red)
    lossy = kvcodec.encode(red, tier="lossy", bits=3.0)
    assert len(lossy) < len(lossless) < len(kvcodec.encode(model_cache(m, ids)))
    back = kvcodec.decode(lossy, m)
    assert kvcodec.inspect(lossy)["tier"] == "lossy" and back.entries() == red.entries()
    for a, b in zip(red.reduced_layers(), back.reduced_layers()):
        assert torch.equal(a.beta, b.beta)  # log-weights are exact in every tier
        assert (a.keys - b.keys).abs().max() > 0  # the entries themselves are quantized
    nxt = _ids(3, 6)
    ref = torch.log_softmax(m(nxt, **cache_arg(m, kvcodec.decode(lossless, m))).logits.double(), -1)
    got = torch.log_softmax(m(nxt, **cache_arg(m, back)).logits.double(), -1)
    assert (ref.exp() * (ref - got)).sum(-1).max() < 0.05  # 3-bit atoms stay close to the exact atoms


def test_reduced_cache_refuses_token_tiers_and_legacy_output():
    m = _model("llama")
    ids = _ids(60)
    red = kvcodec.reduce(model_cache(m, ids), m, keep=0.3, tokens=ids)
    with pytest.raises(kvcodec.ConfigError, match="lossless"):
        kvcodec.encode(red, m, tier="exact")
    assert kvcodec.inspect(kvcodec.encode(red, m))["tier"] == "lossless"  # the default with a model
    with pytest.raises(kvcodec.ConfigError, match="legacy"):
        kvcodec.decode(kvcodec.encode(red), output="legacy")
    with pytest.raises(kvcodec.ConfigError, match="bits="):
        kvcodec.encode(red, m, tier="lossy", max_kl=0.01)


@pytest.mark.parametrize("kind", ["llama", "qwen2_mixed"])  # qwen2_mixed: a single reduced layer
def test_decoded_reduced_cache_without_the_model_is_refused_before_any_change(kind):
    """Without the mass-aware attention the log-weights would be ignored: a cache decoded without its model
    refuses the first reduced layer's update (before anything changes) until it is bound to the model."""
    m = _model(kind)
    ids = _ids(80)
    data = kvcodec.encode(kvcodec.reduce(model_cache(m, ids), m, keep=0.3, tokens=ids))
    fresh = _model(kind)  # same weights, attention not switched
    back = kvcodec.decode(data)
    before = back.describe()
    with pytest.raises(kvcodec.ConfigError, match="bound"):
        fresh(_ids(2, 1), **cache_arg(fresh, back))
    assert back.describe() == before and back.get_seq_length() == 80
    ref = m(_ids(2, 1), **cache_arg(m, kvcodec.decode(data, m))).logits
    assert torch.equal(fresh(_ids(2, 1), **cache_arg(fresh, back.bind(fresh))).logits, ref)
    fresh.set_attn_implementation("eager")  # switched away again: refused again
    with pytest.raises(kvcodec.ConfigError, match="bind"):
        fresh(_ids(2, 1), **cache_arg(fresh, back))


def test_hand_built_reduced_cache_that_breaks_the_spec_is_refused_at_encode():
    m = _model("llama")
    ids = _ids(100)
    kv = kvcodec.to_canonical(kvcodec.reduce(model_cache(m, ids), m, keep=0.3, method="cluster", tokens=ids))
    kv.states[0].anchor = None  # form query without its anchor
    with pytest.raises(kvcodec.ConfigError, match="anchor"):
        kvcodec.encode(kv)


def test_raw_tokens_with_log_weights_are_refused_at_decode():
    m = _model("llama")
    ids = _ids(100)
    kv = kvcodec.to_canonical(kvcodec.reduce(model_cache(m, ids), m, keep=0.3, method="cluster", tokens=ids))
    kv.states[0].log_weights = kv.states[0].log_weights.clone()
    kv.states[0].log_weights[..., -1] = 3.0  # a buffer token
    with pytest.raises(kvcodec.FormatError, match="raw tokens"):
        kvcodec.decode(kvcodec.encode(kv))


def _move(parts, a, b):
    """Move part ``a``'s entries to part ``b`` (the total stays right, the structure does not)."""
    parts[b], parts[a] = parts[b] + parts[a], 0


def _reduced_header(mutate):
    m = _model("llama")
    ids = _ids(100)
    red = kvcodec.reduce(model_cache(m, ids), m, keep=0.3, method="cluster", tokens=ids)
    kv = kvcodec.to_canonical(red)
    from kvcodec.tiers.base import build_header

    h = build_header(kv, "lossless", {"id": "float_ctx_rans", "params": {}}, 64, None, None)
    mutate(h)
    return h


@pytest.mark.parametrize("mutate,match,cls", [
    (lambda h: h["reduce"].update(method="magic"), "reduce.method", "UnknownId"),
    (lambda h: h["reduce"].update(form="cosine"), "reduce.form", "UnknownId"),
    (lambda h: h["reduce"].update(reducer=None), "reduce.reducer", "FormatError"),
    (lambda h: h["reduce"].update(extra=1), "unknown keys", "FormatError"),
    (lambda h: h.pop("reduce"), "reduce object", "FormatError"),
    (lambda h: h["cache"]["layers"][0]["state"]["parts"].update(buffer=999), "parts", "FormatError"),
    (lambda h: _move(h["cache"]["layers"][0]["state"]["parts"], "buffer", "fixed"), "parts.fixed", "FormatError"),
    (lambda h: h["cache"]["layers"][0]["state"].update(scaling=-1.0), "scaling", "FormatError"),
    (lambda h: h["cache"]["layers"][0]["state"]["tensors"][0].update(dtype="float16"), "log_weights", "FormatError"),
    (lambda h: h["cache"]["layers"][0].update(cumulative_length=1), "cumulative_length", "FormatError"),
    (lambda h: h["cache"]["layers"][0].update(sliding_window=8), "sliding_window", "FormatError"),
    (lambda h: h.update(tier="exact"), "", "FormatError"),
])
def test_hostile_reduce_headers_are_refused_by_name(mutate, match, cls):
    from kvcodec.container import header as hd

    body = hd.dumps(_reduced_header(mutate))
    with pytest.raises(getattr(kvcodec.errors, cls), match=match):
        hd.parse(body, offset=16)


@pytest.mark.parametrize("mutate,match", [
    (lambda h: h["cache"]["layers"][0].update(cumulative_length=h["cache"]["layers"][0]["cumulative_length"] + 1),
     "parts stand for"),
    (lambda h: h["cache"]["layers"][0]["state"]["tensors"].pop(), "anchor"),
    (lambda h: h["cache"]["layers"][0]["state"]["parts"]["levels"].append(None), "last level"),
    (lambda h: h["cache"].update(num_tokens=1), "num_tokens"),
    (lambda h: h.update(reduce=None), "reduce"),
    (lambda h: h["reduce"].update(reducer="streaming"), "reducer"),
])
def test_reduced_layer_consistency_rules(mutate, match):
    """spec section 14.2: the parts must stand for cumulative_length tokens, the anchor is there if and only if
    the form is query, no trailing null level, no token ids."""
    from kvcodec.container import header as hd

    with pytest.raises(kvcodec.errors.KvzError, match=match):
        hd.parse(hd.dumps(_reduced_header(mutate)), offset=16)


def test_reduced_cache_with_tokens_is_refused():
    m = _model("llama")
    ids = _ids(60)
    red = kvcodec.reduce(model_cache(m, ids), m, keep=0.3, tokens=ids)
    with pytest.raises(kvcodec.ConfigError, match="token ids"):
        kvcodec.encode(red, tokens=ids[:, :red.entries()])


def test_bench_method_options_and_variant_pairs():
    """`kvz bench --reduce` methods with reduce()'s options (the sinks ablation), paired against their method."""
    from kvcodec.lab import bench_reduce as br

    m = _model("llama")
    ids = _ids(96)
    cache = model_cache(m, ids)
    red, nbytes = br._reduced(m, "cluster,sinks=0", cache, ids, 0.25, None, 0)
    assert nbytes is None and red.plan.sinks == 0 and red.plan.method == "cluster"
    win, _ = br._reduced(m, "streaming,sinks=0", cache, ids, 0.25, None, 0)
    k = cache.layers[0].keys
    assert torch.equal(win.layers[0].keys, k[:, :, 96 - win.entries():])  # a pure recent window
    with pytest.raises(ValueError, match="unknown method option"):
        br._reduced(m, "cluster,sink=0", cache, ids, 0.25, None, 0)
    with pytest.raises(ValueError, match="no question was given"):
        br._reduced(m, "snapkv,question", cache, ids, 0.25, None, 0)
    q = _ids(5, 4)
    asked, _ = br._reduced(m, "snapkv,question", cache, ids, 0.25, None, 0, question=q)
    assert torch.equal(asked.layers[0].keys, kvcodec.reduce(cache, m, 0.25, "snapkv", question=q).layers[0].keys)
    assert br._asks("cluster,question,sinks=0") and not br._asks("cluster,sinks=0")
    for option, fit in (("nofit", False), ("fit=policy", "policy")):  # kvzip's fit options reach reduce()
        got, _ = br._reduced(m, f"kvzip,{option}", cache, ids, 0.25, None, 0)
        want = kvcodec.reduce(cache, m, 0.25, "kvzip", tokens=ids, fit=fit)
        assert all(torch.equal(a.values, b.values) for a, b in zip(got.layers, want.layers))
    # kvzip's replay in passes of N tokens: run by reduce(), or read from an observation replayed so
    from kvcodec.reduction import replay_observation

    want = kvcodec.reduce(cache, m, 0.25, "kvzip", tokens=ids, replay_chunk=32)
    default = kvcodec.reduce(cache, m, 0.25, "kvzip", tokens=ids)
    assert not all(torch.equal(a.keys, b.keys) for a, b in zip(want.layers, default.layers))  # the option matters
    obs = replay_observation(cache, m, ids, chunk=32)
    assert obs.replay_chunk == 32 and br._replay_chunk("kvzip,nofit,chunk=32") == 32
    for given in (None, obs):
        got, _ = br._reduced(m, "kvzip,chunk=32", cache, ids, 0.25, given, 0)
        assert all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
                   for a, b in zip(got.layers, want.layers))
    with pytest.raises(ValueError, match="passes of 64 tokens; the observation given was replayed in passes of 32"):
        br._reduced(m, "kvzip,chunk=64", cache, ids, 0.25, obs, 0)
    with pytest.raises(ValueError, match="method 'snapkv' has no replay"):
        br._reduced(m, "snapkv,chunk=64", cache, ids, 0.25, None, 0)
    rows = []
    for i, (method, bits) in enumerate([("full", -1.0), ("cluster", -3.0), ("cluster,sinks=0", -5.0),
                                        ("streaming", -2.0)] * 2):
        rows.append({"file": "f", "kind": "needle", "depth": i // 4, "method": method, "keep": 1.0 if method == "full"
                     else 0.1, "answer_bits": bits - i // 4, "exact": False, "entries": 9, "reduce_s": 0.0})
    summary, versus = br.summarise(rows, [0.1], ["full", "cluster", "cluster,sinks=0", "streaming"])
    pair = {(v["a"], v["b"]): v for v in versus}
    assert pair[("cluster,sinks=0", "cluster")]["delta_bits_mean"] == -2.0
    assert pair[("cluster,sinks=0", "cluster")]["b_better"] == 2
    assert pair[("cluster", "streaming")]["delta_bits_mean"] == -1.0
    assert {s["method"] for s in summary} == {"cluster", "cluster,sinks=0", "streaming"}


def test_bench_merges_an_earlier_run_only_when_it_is_the_same_experiment(tmp_path):
    import json
    from pathlib import Path

    from kvcodec.lab import bench_reduce as br

    def row(method, keep, bits, depth=0.1):
        return {"file": "f", "kind": "needle", "depth": depth, "method": method, "keep": keep, "answer_bits": bits,
                "exact": False, "entries": 9, "reduce_s": 0.0}

    settings = {"context": 64, "documents": 1, "files": ["f"], "depths": [0.1], "seed": 0}
    old = {**settings, "methods": ["full", "cluster", "tova"],
           "rows": [row("full", 1.0, -1.0), row("cluster", 0.1, -4.0), row("cluster", 0.5, -2.0),
                    row("tova", 0.1, -3.0)]}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    rows = [row("full", 1.0, -1.0), row("tova", 0.1, -2.5)]
    got, methods, source = br.merge_earlier(rows, ["full", "tova"], [0.1], settings, path)
    assert methods == ["full", "tova", "cluster"]  # this run's tova rows, not the earlier run's
    assert got == rows + [row("cluster", 0.1, -4.0)]  # at this run's budgets only
    assert source["path"] == str(path) and len(source["sha256"]) == 64
    with pytest.raises(ValueError, match="cluster at keep 0.25 does not have every item"):
        br.merge_earlier(rows, ["full", "tova"], [0.1, 0.25], settings, path)
    with pytest.raises(ValueError, match="seed"):
        br.merge_earlier(rows, ["full", "tova"], [0.1], {**settings, "seed": 1}, path)
    with pytest.raises(ValueError, match="other answers"):
        br.merge_earlier([row("full", 1.0, -1.1)], ["full"], [0.1], settings, path)
    # another machine's rounding (1e-4 bits) merges; another greedy answer does not
    assert br.merge_earlier([row("full", 1.0, -1.0001)], ["full"], [0.1], settings, path)[1] == ["full", "cluster",
                                                                                                "tova"]
    with pytest.raises(ValueError, match="other answers"):
        br.merge_earlier([{**row("full", 1.0, -1.0), "exact": True}], ["full"], [0.1], settings, path)
    # a method whose defaults changed since: the earlier rows under the name they have now, beside this run's
    got, methods, source = br.merge_earlier(rows, ["full", "tova"], [0.1], settings, path,
                                            {"tova": "tova,old", "cluster": "cluster,old"})
    assert methods == ["full", "tova", "cluster,old", "tova,old"]
    assert got == rows + [{**row("cluster", 0.1, -4.0), "method": "cluster,old"},
                          {**row("tova", 0.1, -3.0), "method": "tova,old"}]
    assert source["renamed"] == {"tova": "tova,old", "cluster": "cluster,old"}
    # a rename this file cannot apply is another file's; onto a name this run or the file has, it is refused
    assert br.merge_earlier(rows, ["full", "tova"], [0.1], settings, path, {"h2o": "h2o,old"})[1] == \
        ["full", "tova", "cluster"]
    for bad in ({"tova": "cluster"}, {"cluster": "tova"}):
        with pytest.raises(ValueError, match="--merge-rename's new name"):
            br.merge_earlier(rows, ["full", "tova"], [0.1], settings, path, bad)
    # the report says which rows were renamed (the shipped table was merged so)
    shipped = json.loads((Path(__file__).parent.parent / "docs" / "bench_reduce.json").read_text())
    assert {"kvzip": "kvzip,allocation=ranks"} in [x.get("renamed") for x in shipped["merged"]["from"]]
    assert "paired item by item; its kvzip as kvzip,allocation=ranks." in br.to_markdown(shipped)
    # before the run: the pairs against this run's methods and every --merge run's
    other = {**old, "methods": ["full", "h2o"]}
    assert br.merge_renames(["tova=tova,old", "h2o=h2o,old"], ["full", "kvzip"], [old, other]) == \
        {"tova": "tova,old", "h2o": "h2o,old"}
    assert br.merge_renames(None, ["full"], []) == {}
    for pairs, runs, msg in ((["tova"], [old], "OLD=NEW"), (["tova=a", "tova=b"], [old], "twice"),
                             (["tova=a"], [], "there are none"), (["snapkv=a"], [old, other], "no --merge run has"),
                             (["full=a"], [old], "no --merge run has"), (["tova=x", "cluster=x"], [old], "new name x"),
                             (["tova=kvzip"], [old], "new name kvzip"), (["tova=cluster"], [old], "new name"),
                             (["tova=full"], [old], "new name full")):
        with pytest.raises(ValueError, match=msg):
            br.merge_renames(pairs, ["full", "kvzip"], runs)


def test_store_keeps_a_reduced_cache_beside_its_session(tmp_path, capsys):
    """Reduced objects (store spec §6.1): put(reduced, tokens=) stores it whole, keyed by the full token sequence
    and how it was reduced; get() returns the same reduced cache (same logits, same compactions later); it
    survives a collection (its session deleted, an eviction budget of 0); a generated-into cache is stored
    under its longer sequence; bad tokens and a copy under another name are refused by field."""
    import copy
    import json

    m = _model("llama")
    ids = _ids(80)
    store = kvcodec.Store(tmp_path / "s", m, chunk_tokens=32, grace_seconds=0)
    full = model_cache(m, ids)
    key = store.put(full, tokens=ids)
    red = kvcodec.reduce(store.get(key), m, keep=0.25, tokens=ids)
    with pytest.raises(kvcodec.ConfigError, match="tokens="):
        store.put(red)
    with pytest.raises(kvcodec.ConfigError, match="79 token ids for a reduced cache that has seen 80"):
        store.put(red, tokens=ids[:, :-1])
    rkey = store.put(red, tokens=ids)
    ns, s, r = rkey.split(":")
    assert key == f"{ns}:{s}" and len(r) == 16  # keyed by the same token sequence as the full session
    other = store.put(kvcodec.reduce(store.get(key), m, keep=0.5, tokens=ids), tokens=ids)
    assert store.reductions(ids) == sorted([rkey, other]) == store.reductions() and rkey in store
    assert store.sessions() == [key]  # sessions are sessions; reduced objects are listed apart
    assert store.stats()["reduced"] == 2
    from kvcodec.cli import main  # the command line lists them and writes one out as a .kvz file

    url = str(tmp_path / "s")
    assert main(["store", "ls", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == [key] + sorted([rkey, other])
    assert main(["store", "get", url, rkey, "-o", str(tmp_path / "r.safetensors")]) == 1
    assert "-o OUT.kvz" in capsys.readouterr().err
    assert main(["store", "get", url, rkey, "-o", str(tmp_path / "r.kvz")]) == 0
    capsys.readouterr()
    assert kvcodec.to_canonical(kvcodec.load(tmp_path / "r.kvz")).equal(kvcodec.to_canonical(red))
    nxt, nxt2 = _ids(40, 5), _ids(3, 6)

    def run(cache):  # the second call compacts the first call's tokens (a bounded layer)
        return torch.cat([m(nxt, **cache_arg(m, cache)).logits, m(nxt2, **cache_arg(m, cache)).logits], 1)

    want = run(copy.deepcopy(red))
    store.delete(key)
    store.gc(max_bytes=0)  # its session gone and every chunk evicted: the reduced objects are roots
    assert key not in store and store.reductions() == sorted([rkey, other])
    back = store.get(rkey, m)
    assert isinstance(back, ReducedCache)
    other_model = _model("llama")
    with torch.no_grad():
        other_model.model.norm.weight.mul_(1.5)
    with pytest.raises(kvcodec.ModelMismatch):  # as a session's get: another model is refused
        store.get(rkey, other_model)
    (tmp_path / "s" / "ns" / ns / "reduced" / s[:2] / s / "junk.txt").write_bytes(b"x")  # not an object: not counted
    assert store.stats()["reduced"] == 2
    assert torch.equal(run(back), want)  # and the 40 tokens compacted alike
    longer = torch.cat([ids, nxt, nxt2], 1)
    with pytest.raises(kvcodec.ConfigError, match="has seen 123"):
        store.put(back, tokens=ids)
    k2 = store.put(back, tokens=longer)
    assert k2.split(":")[2] == r and k2.split(":")[1] != s  # the same reduction of the longer sequence
    store.delete(other)
    with pytest.raises(KeyError):
        store.delete(other)
    with pytest.raises(KeyError):
        store.get(other)
    # a reduced object copied under another sequence's name is refused by its own header, and quarantined
    src = tmp_path / "s" / "ns" / ns / "reduced" / s[:2] / s / f"{r}.kvz"
    fake = "f" * 64
    dest = tmp_path / "s" / "ns" / ns / "reduced" / fake[:2] / fake
    dest.mkdir(parents=True)
    (dest / f"{r}.kvz").write_bytes(src.read_bytes())
    with pytest.raises(kvcodec.FormatError) as err:
        store.get(f"{ns}:{fake}:{r}")
    assert err.value.field == "Header.info"
    assert not (dest / f"{r}.kvz").exists() and any((tmp_path / "s" / "quarantine").iterdir())


def _question_queries(m, cache, q):
    """The question's post-RoPE queries per layer, recorded by the public observer on a copy of the cache."""
    import copy

    with att.observe(m, window=q.shape[1], received=False) as obs:
        m(q, **cache_arg(m, copy.deepcopy(cache)))
    return obs


def test_snapkv_knowing_the_question_keeps_the_keys_the_question_attends_to():
    """question=: the kept tokens are the top keys by the question's pooled attention (recomputed here in
    float64), with no raw window (the question is not in the cache); the cache given is left untouched."""
    m = _model("llama")
    ids, q = _ids(100), _ids(7, 5)
    cache = model_cache(m, ids)
    red = kvcodec.reduce(cache, m, budget=20, method="snapkv", question=q)
    assert cache.get_seq_length() == 100 and red.entries() == 20
    blind = kvcodec.reduce(cache, m, budget=20, method="snapkv", tokens=ids)
    k = cache.layers[0].keys
    assert torch.equal(blind.layers[0].keys, k[:, :, 80:])  # budget < 64: the agnostic window is all it keeps
    obs = _question_queries(m, cache, q)
    for li, layer in enumerate(cache.layers):
        keys = layer.keys.double()
        qs = obs.queries[li].double()  # [1, hq, 7, d]
        g = qs.shape[1] // keys.shape[1]
        probs = torch.softmax(obs.scaling[li] * qs @ keys.repeat_interleave(g, 1).transpose(-1, -2), -1).mean(2)
        pooled = torch.stack([probs[..., max(0, j - 2):j + 3].mean(-1) for j in range(100)], -1)
        score = pooled.view(1, keys.shape[1], g, 100).mean(2)
        # the kept keys are original keys, in order, each scoring within float32 error of the 20th best
        # (a near-tie at the boundary may go either way between float32 and this float64 reference)
        got = red.layers[li].keys
        kept = _kept_positions(got, layer.keys)  # [1, h, 20]
        assert (kept.diff(dim=-1) > 0).all()
        twentieth = score.topk(20, -1).values[..., -1:]
        assert (score.gather(-1, kept) >= twentieth - 1e-8).all()  # scores ~0.01: float32 error ~1e-9
    out = m.generate(torch.cat([ids, q], 1), **cache_arg(m, red), max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 112)


def test_merge_reduce_knowing_the_question_anchors_at_its_queries():
    m = _model("qwen2")
    ids, q = _ids(120), _ids(6, 9)
    cache = model_cache(m, ids)
    red = kvcodec.reduce(cache, m, keep=0.25, method="cluster", question=q)
    blind = kvcodec.reduce(cache, m, keep=0.25, method="cluster", tokens=ids)
    obs = _question_queries(m, cache, q)
    for li, layer in enumerate(red.layers):
        qs = obs.queries[li]
        h = cache.layers[li].keys.shape[1]
        want = qs.mean(2).view(1, h, qs.shape[1] // h, -1).mean(2)
        assert torch.allclose(layer.anchor, want, atol=1e-6)
        assert not torch.allclose(layer.anchor, blind.layers[li].anchor)
    assert red.entries() == blind.entries()
    nxt = _ids(3, 2)
    assert torch.isfinite(m(nxt, **cache_arg(m, red)).logits).all()


def test_a_question_is_refused_where_it_would_change_nothing():
    m = _model("llama")
    ids, q = _ids(60), _ids(4, 1)
    cache = model_cache(m, ids)
    for method, form in [("streaming", "query"), ("h2o", "query"), ("cluster", "dot"), ("sample", "kernel")]:
        with pytest.raises(ValueError, match="looks at no query"):
            kvcodec.reduce(cache, m, keep=0.3, method=method, form=form, question=q, tokens=ids)
    with pytest.raises(ValueError, match="not both"):
        kvcodec.reduce(cache, m, keep=0.3, method="snapkv", question=q, observation=_question_queries(m, cache, q))
    with pytest.raises(ValueError, match="non-empty"):
        kvcodec.reduce(cache, m, keep=0.3, method="snapkv", question=[])
    with pytest.raises(ValueError, match="2 questions for a cache of batch 1"):
        kvcodec.reduce(cache, m, keep=0.3, method="snapkv", question=torch.cat([q, q]))


@pytest.mark.parametrize("method", ["kvzip", "tova", "cluster"])
def test_reduce_takes_a_cache_made_with_autograd_on(method):
    """A cache from a forward pass outside torch.no_grad() carries autograd history, which copy.deepcopy refuses;
    reduce() copies it without that history (the same entries as from a no_grad cache)."""
    m = _model("qwen2_mixed")  # a sliding layer too, copied as it is
    ids = _ids(60)
    with_grad = output_cache(m(ids, use_cache=True))
    assert with_grad.layers[0].keys.requires_grad
    kw = {"question": _ids(4, 1)} if method == "tova" else {"tokens": ids}
    red = kvcodec.reduce(with_grad, m, keep=0.3, method=method, **kw)
    ref = kvcodec.reduce(model_cache(m, ids), m, keep=0.3, method=method, **kw)
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(red.layers, ref.layers))


# -- bounded one-shot caches (format 1.11: reduce.bound, scores) ------------------------------------------------

def _present(la):
    """Per KV head, the entries of a reduced layer attention sees ([b, h])."""
    beta = la.beta if la.beta is not None else torch.zeros(la.keys.shape[:3])
    return torch.isfinite(beta).sum(-1)


def test_kvzip_by_default_keeps_its_budget_while_generating():
    """The default reduce (kvzip, fit, bound) after N generated tokens holds, per head, at most what it kept +
    the raw sinks + recent + step - 1 + the call's token; the same reduction with bound=False grows by one entry
    per token.  The selection's sinks are never evicted, and the first 4 tokens of every head stay."""
    from kvcodec.reduction import BOUND_RECENT, BOUND_STEP

    m = _model("llama")
    ids = _ids(200)
    full = model_cache(m, ids)
    red = kvcodec.reduce(full, m, keep=0.2, tokens=ids)
    assert red.method == "kvzip" and red.plan.step == BOUND_STEP and red.plan.recent == BOUND_RECENT
    grow = kvcodec.reduce(full, m, keep=0.2, tokens=ids, bound=False)
    kept = {i: _present(la).clone() for i, la in enumerate(red.layers) if isinstance(la, ReducedLayer)}
    new = 120
    for cache in (red, grow):
        m.generate(torch.cat([ids, _ids(5, 1)], 1), **cache_arg(m, cache), max_new_tokens=new, do_sample=False,
                   pad_token_id=0, min_new_tokens=new)
    for i, la in enumerate(red.layers):
        if not isinstance(la, ReducedLayer):
            continue
        limit = kept[i] + red.plan.sinks + BOUND_RECENT + BOUND_STEP - 1 + 1
        assert (_present(la) <= limit).all() and (_present(la) >= kept[i]).all()
        assert (_present(grow.layers[i]) == kept[i] + 5 + new - 1).all()
        fixed = la.fixed
        assert torch.equal(fixed[0][:, :, :4], full.layers[i].keys[:, :, :4])  # the sinks of every head
        assert la.get_seq_length() == 200 + 5 + new - 1
    assert red.counted() < grow.counted() - 50


def test_compaction_keeps_each_heads_highest_scored_entries_in_order():
    """ReducedLayer.compact against a brute-force oracle of spec/kvz.md section 14.4: per head, of the present fixed
    entries and the buffer's oldest (buffer - recent) tokens, the c highest-scored (c = the head's present fixed
    entries; ties to the earlier), in candidate order, with their keys, values, log-weights and scores; the
    buffer keeps its newest `recent`; the sinks are untouched."""
    g = torch.Generator().manual_seed(5)
    plan = Plan(k=1, block=1, sinks=2, method=None, form="dot", recent=2, step=3)
    la = ReducedLayer(plan, 0, 0.5)
    counts = torch.tensor([[6, 4, 1]])
    width = 6
    present = torch.arange(width)[None, None, :] < counts[..., None]
    keys = torch.randn(1, 3, width, 4, generator=g).masked_fill(~present[..., None], 0)
    values = torch.randn(1, 3, width, 4, generator=g).masked_fill(~present[..., None], 0)
    beta = torch.randn(1, 3, width, generator=g).masked_fill(~present, float("-inf"))
    scores = torch.rand(1, 3, width, generator=g).masked_fill(~present, 0)
    scores[0, 1, 2] = scores[0, 1, 3] = 0.5  # a tie: the earlier wins
    la.set_fixed(keys, values, 40, beta, scores)
    for n in (3, 4):  # 2 tokens to the sinks, then a buffer of 5 = recent + step: the next update compacts
        la.update(torch.randn(1, 3, n, 4, generator=g), torch.randn(1, 3, n, 4, generator=g))
        la.scores = torch.where(torch.rand(la.scores.shape, generator=g) < 0.3, torch.tensor(0.5),
                                torch.rand(la.scores.shape, generator=g))
    before = [t.clone() for t in la.assemble()[:2]], la.scores.clone(), la.assemble()[2].clone()
    (k0, v0), s0, b0 = before
    sinks = (la.sinks[0].clone(), la.sinks[1].clone())
    buf = la.buffer[0].shape[2]
    assert buf == 5
    assert la.compact() and not la.compact()
    fk, fv, fb = la.fixed
    for h in range(3):
        c = int(counts[0, h])
        cand = list(range(c)) + [width + 2 + j for j in range(buf - 2)]  # assembled places: fixed | sinks | buffer
        best = sorted(cand, key=lambda j: (-float(s0[0, h, j]), cand.index(j)))[:c]
        keep = [j for j in cand if j in best]
        assert torch.equal(fk[0, h, :c], k0[0, h, keep]) and torch.equal(fv[0, h, :c], v0[0, h, keep])
        assert torch.equal(fb[0, h, :c], b0[0, h, keep]) and torch.equal(la.scores[0, h, :c], s0[0, h, keep])
        assert torch.isneginf(fb[0, h, c:]).all() and not fk[0, h, c:].any()
    assert torch.equal(la.sinks[0], sinks[0]) and torch.equal(la.sinks[1], sinks[1])
    assert torch.equal(la.buffer[0], k0[:, :, -2:]) and la.scores.shape[2] == width + 2 + 2
    assert la.get_seq_length() == 40 + 7


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_scores_are_the_largest_attention_weight_each_entry_receives(kind):
    """A bounded layer's scores after a forward call: the larger of their value before and the largest weight
    any query of the call (any query head of the group) gave the entry - checked against the eager model's own
    attention weights (output_attentions), log-weights and mask included."""
    m = _model(kind)
    ids = _ids(120)
    red = kvcodec.reduce(model_cache(m, ids), m, keep=0.25, tokens=ids)
    before = {i: la.scores.clone() for i, la in enumerate(red.layers) if isinstance(la, ReducedLayer)}
    nxt = _ids(6, 3)
    out = m(nxt, **cache_arg(m, red), output_attentions=True)
    for i, s in before.items():
        la = red.layers[i]
        w = out.attentions[i].float()  # [b, hq, q, entries + new]
        b, hq, q, n = w.shape
        h = la.keys.shape[1]
        want = torch.maximum(torch.cat([s, torch.zeros(b, h, q)], 2), w.view(b, h, hq // h, q, n).amax(dim=(2, 3)))
        torch.testing.assert_close(la.scores, want, rtol=1e-5, atol=1e-6)
        assert bool((la.scores[..., :4] == float("inf")).all())  # every head's sinks: never evicted


def test_a_bounded_cache_round_trips_and_keeps_compacting_identically():
    """A bounded cache, generated into past a compaction, written to .kvz (format 1.11, scores exact) and read
    back: the same entries, scores and logits, and both keep compacting the same way."""
    m = _model("llama")
    ids = _ids(150)
    red = kvcodec.reduce(model_cache(m, ids), m, keep=0.2, tokens=ids)
    m(_ids(40, 2), **cache_arg(m, red))
    m(_ids(1, 4), **cache_arg(m, red))  # compacts first (40 raw tokens >= recent + step)
    data = kvcodec.encode(red)
    assert data[10] == 11 and kvcodec.inspect(data)["reduce"]["bound"] == {"recent": 16, "step": 16}
    back = kvcodec.decode(data, m)
    for a, b in zip(red.reduced_layers(), back.reduced_layers()):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.scores, b.scores)
    for step in range(3):
        nxt = _ids(20, 10 + step)
        assert torch.equal(m(nxt, **cache_arg(m, red)).logits, m(nxt, **cache_arg(m, back)).logits)
        assert back.describe() == red.describe()
    assert kvcodec.encode(kvcodec.decode(kvcodec.encode(red), m)) == kvcodec.encode(red)


def test_bound_headers_and_scores_are_checked():
    """reduce.bound and the scores tensor: a bound beside a merge-reduce reducer, a null bound, scores without a
    bound (or a bound without scores), NaN scores, a bounded file stamped 1.10 - each refused by field."""
    import kvcodec.container.header as hd
    from kvcodec.tiers.base import build_header

    m = _model("llama")
    ids = _ids(100)
    red = kvcodec.reduce(model_cache(m, ids), m, keep=0.3, tokens=ids)
    kv = kvcodec.to_canonical(red)
    li = next(i for i, st in enumerate(kv.states) if st is not None and st.kind == "reduced")
    good = build_header(kv, "lossless", {"id": "float_ctx_rans", "params": {}}, 64, None, None)
    hd.parse(hd.dumps(good), offset=16)
    import copy as _copy

    for mutate, field in [
        (lambda h: h["reduce"].update(reducer="cluster", method="cluster"), "reduce.bound"),
        (lambda h: h["reduce"].update(bound=None), "reduce.bound"),
        (lambda h: h["reduce"]["bound"].update(step=0), "reduce.bound"),
        (lambda h: h["reduce"]["bound"].update(extra=1), "reduce.bound"),
        (lambda h: h["reduce"].pop("bound"), f"layers[{li}].state.tensors"),
        (lambda h: h["cache"]["layers"][li]["state"]["tensors"].pop(), f"layers[{li}].state.tensors"),
    ]:
        h = _copy.deepcopy(good)
        mutate(h)
        with pytest.raises(kvcodec.FormatError) as err:
            hd.parse(hd.dumps(h), offset=16)
        assert field in err.value.field
    data = kvcodec.encode(kv)
    old = bytearray(data)
    old[10] = 10
    err = check_rejects(kvcodec.FormatError, fuzz_tools().reseal(bytes(old)), match="1\\.11")
    assert err.field == "Version_Minor"
    bad = kvcodec.to_canonical(red)
    bad.states[li].scores = bad.states[li].scores.clone()
    bad.states[li].scores[0, 0, 5] = float("nan")
    with pytest.raises(kvcodec.ConfigError, match="NaN"):
        kvcodec.encode(bad)
    # the same bytes written past the writer's check: the decoder finds them in the section
    from kvcodec.state import encode_payload

    good_payload = encode_payload(kv.states[li].scores)
    nan = kv.states[li].scores.clone()
    nan[0, 0, 5] = float("nan")
    raw = data.replace(good_payload, encode_payload(nan))
    assert raw != data and len(raw) == len(data)  # (scores of attention weights do not compress: stored raw)
    with pytest.raises(kvcodec.FormatError, match="NaN") as e:
        kvcodec.decode(fuzz_tools().reseal(raw), m)
    assert e.value.field == "State.Data"


def test_a_bounded_layer_without_kept_entries_keeps_none_of_the_moved_tokens():
    """spec/kvz.md section 14.4: each head keeps as many of the candidates as its fixed part held - none, for a
    bounded layer that was never given a selection: it holds its sinks and its recent raw tokens only."""
    g = torch.Generator().manual_seed(3)
    la = ReducedLayer(Plan(k=1, block=1, sinks=2, method=None, form="dot", recent=2, step=3), 0, 0.5)
    la.update(torch.randn(1, 1, 8, 4, generator=g), torch.randn(1, 1, 8, 4, generator=g))  # 2 sinks, 6 raw
    last = torch.randn(1, 1, 1, 4, generator=g)
    la.update(last, torch.randn(1, 1, 1, 4, generator=g))  # compacts first: 4 move, 0 kept; 2 recent + this one
    assert la.entries() == 2 + 2 + 1 and la.fixed[0].shape[2] == 0 and torch.equal(la.keys[:, :, -1:], last)
    assert la.get_seq_length() == 9 and la.scores.shape[2] == 5
