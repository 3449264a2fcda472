"""kvcodec.plt: LCP, the paper's d_T (a value) against d_tree (a distance), surprisal, centroid rules, quantizer."""

import itertools
import math

import numpy as np
import pytest
import torch

from kvcodec import plt

from .common import VOCAB, tiny_model

# --------------------------------------------------------------------------------------------------------------
# lcp_len


@pytest.mark.parametrize("s, t, n", [
    ([], [], 0), ([], [1, 2], 0), ([1, 2], [], 0), ([3], [3], 1), ([3], [4], 0),
    ([1, 2, 3], [1, 2, 3], 3), ([1, 2], [1, 2, 3], 2), ([1, 2, 3], [1, 2], 2), ([1, 2, 3], [1, 9, 3], 1),
    ([7, 1, 2], [8, 1, 2], 0),
])
def test_lcp_len_edge_cases(s, t, n):
    assert plt.lcp_len(s, t) == n == plt.lcp_len(t, s)


def test_lcp_len_takes_numpy_and_torch_and_large_ids():
    a = np.array([5, 60000, 2, 9], dtype=np.int64)
    assert plt.lcp_len(a, torch.tensor([5, 60000, 2, 8])) == 3
    assert plt.lcp_len(torch.arange(1000), torch.cat([torch.arange(999), torch.tensor([0])])) == 999


def test_lcp_len_rejects_batches_and_floats():
    with pytest.raises(ValueError, match="1-D"):
        plt.lcp_len(torch.zeros(1, 3, dtype=torch.long), [0, 0, 0])
    with pytest.raises(TypeError, match="integers"):
        plt.lcp_len([0.5, 1.0], [0, 1])


# --------------------------------------------------------------------------------------------------------------
# d_T is a value, d_tree a distance


def test_papers_counterexample_two_first_tokens_of_probability_one_half():
    a, b = [0], [1]
    one_bit = [1.0]  # -log2 0.5
    d = plt.plt_value_bits
    assert d(a, a, one_bit) == 1.0  # d_T(a, a) = 1 > 0: not even zero on the diagonal
    assert d(a, b, one_bit) == 0.0 == d(b, a, one_bit)
    # ultrametric inequality d(a,a) <= max(d(a,b), d(b,a)) would need 1 <= 0
    assert not d(a, a, one_bit) <= max(d(a, b, one_bit), d(b, a, one_bit))
    # triangle inequality d(a,a) <= d(a,b) + d(b,a) fails the same way
    assert not d(a, a, one_bit) <= d(a, b, one_bit) + d(b, a, one_bit)
    # the tree distance is the sensible one on the same pair
    assert plt.plt_tree_distance(a, a, one_bit, one_bit) == 0.0
    assert plt.plt_tree_distance(a, b, one_bit, one_bit) == 2.0
    assert plt.normalized_tree_distance(a, b, one_bit, one_bit) == 1.0


def _random_trie_model(seed, vocab=3):
    """A random PLT: P(t | prefix) from a Dirichlet drawn once per prefix (memoised), as a surprisal function."""
    rng = np.random.default_rng(seed)
    table = {}

    def bits(seq):
        out = []
        for j in range(len(seq)):
            key = tuple(seq[:j])
            if key not in table:
                table[key] = rng.dirichlet(np.full(vocab, 0.7))
            out.append(-math.log2(max(table[key][seq[j]], 1e-300)))
        return np.asarray(out)

    return bits


def test_tree_distance_is_a_pseudometric_on_random_tries_and_d_T_is_not():
    violations_dT = 0
    for seed in range(5):
        bits = _random_trie_model(seed)
        rng = np.random.default_rng(100 + seed)
        seqs = [list(rng.integers(0, 3, size=rng.integers(0, 6))) for _ in range(14)]
        seqs += [seqs[0][:2], seqs[1] + [0, 1]]  # prefixes of one another too
        sp = [bits(s) for s in seqs]
        I = [float(p.sum()) for p in sp]  # noqa: E741
        D = np.array([[plt.plt_tree_distance(s, t, ps, pt) for t, pt in zip(seqs, sp)] for s, ps in zip(seqs, sp)])
        V = np.array([[plt.plt_value_bits(s, t, ps, pt) for t, pt in zip(seqs, sp)] for s, ps in zip(seqs, sp)])
        assert np.allclose(np.diag(D), 0) and np.allclose(D, D.T) and (D >= -1e-12).all()
        for i, j in itertools.product(range(len(seqs)), repeat=2):  # d_tree = I(s) + I(t) - 2 I(s ^ t)
            assert D[i, j] == pytest.approx(I[i] + I[j] - 2 * V[i, j], abs=1e-9)
        for i, j, k in itertools.product(range(len(seqs)), repeat=3):
            assert D[i, k] <= D[i, j] + D[j, k] + 1e-9
            # what does hold for d_T is the *reverse* (LCP) inequality
            assert V[i, k] >= min(V[i, j], V[j, k]) - 1e-9
            violations_dT += V[i, k] > V[i, j] + V[j, k] + 1e-9
        assert np.allclose(np.diag(V), I)  # d_T(s, s) = I(s), not 0
    assert violations_dT > 0  # d_T breaks the triangle inequality on these tries, not just on the toy pair


def test_value_bits_averages_the_two_sides_and_checks_lengths():
    assert plt.plt_value_bits([1, 2, 3], [1, 2, 4], [1.0, 2.0, 5.0], [1.0, 2.2, 9.0]) == pytest.approx(3.1)
    with pytest.raises(ValueError, match="per-token bits"):
        plt.plt_value_bits([1, 2], [1, 2], [1.0])


def test_window_tree_distances_resynchronise_after_a_substitution():
    base = list(range(40))
    edit = list(base)
    edit[5] = 99  # one token substituted in the first window, the rest index-aligned and identical
    sb, se = np.full(40, 2.0), np.full(40, 2.0)
    w = plt.window_tree_distances(edit, base, se, sb, window=10)
    assert w.shape == (4,)
    assert 0 < w[0] < 1 and np.all(w[1:] == 0)
    shifted = [7] + base[:-1]  # an insertion: nothing lines up by index any more
    assert np.all(plt.window_tree_distances(shifted, base, sb, sb, window=10) > 0.5)
    assert plt.window_tree_distances(base, base[:25], sb, sb[:25], window=10)[-1] == 1.0  # past the reference


# --------------------------------------------------------------------------------------------------------------
# centroid rules


def test_literal_rule_selects_short_prefixes_and_corrected_rule_the_long_one():
    sib = list(range(100)) + [500 + i for i in range(20)]  # shares a 100-token prefix with s
    other = [900 + i for i in range(120)]  # shares nothing
    s = list(range(100)) + [700 + i for i in range(20)]
    bits = np.full(120, 3.0)
    lib = [(sib, bits), (other, bits)]
    lit = plt.choose_centroid(s, bits, lib, paper_literal_threshold=16.0)
    assert lit.index == 1 and lit.lcp == 0 and lit.value_bits == 0.0  # the unrelated session wins
    cor = plt.choose_centroid(s, bits, lib, max_normalized_distance=0.2)
    assert cor.index == 0 and cor.lcp == 100 and cor.normalized_distance == pytest.approx(40 * 3 / 720)
    assert plt.choose_centroid(s, bits, lib, max_normalized_distance=0.1).index is None  # 0.167 > 0.1
    assert plt.choose_centroid(s, bits, [(sib, bits)], paper_literal_threshold=16.0).index is None
    assert plt.choose_centroid(s, bits, []).index is None


# --------------------------------------------------------------------------------------------------------------
# surprisal


def test_surprisal_from_logits_matches_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(6, 11)
    ids = torch.tensor([3, 1, 4, 1, 5, 9])
    got = plt.surprisal_from_logits(logits, ids, first_token_bits=7.5)
    lp = torch.log_softmax(logits.double(), -1)
    want = [7.5] + [float(-lp[j - 1, ids[j]] / math.log(2)) for j in range(1, 6)]
    assert np.allclose(got, want)
    with pytest.raises(ValueError):
        plt.surprisal_from_logits(logits[:5], ids)


def test_token_surprisal_one_pass_on_a_tiny_model_gives_the_cache_and_the_chain_rule():
    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (1, 12))
    bits, out = plt.token_surprisal(model, ids)
    assert bits.shape == (12,) and bits[0] == 0.0 and (bits[1:] > 0).all()
    cache = out["cache"] if "cache" in out else out["past_key_values"]
    assert cache.get_seq_length() == 12
    # the chain rule: P(t_1..t_11 | t_0) from step-by-step decoding equals the one-pass product
    step = 0.0
    with torch.no_grad():
        for j in range(1, 12):
            lp = torch.log_softmax(model(ids[:, :j]).logits[0, -1].double(), -1)
            step += float(-lp[ids[0, j]] / math.log(2))
    assert bits.sum() == pytest.approx(step, rel=1e-5)


# --------------------------------------------------------------------------------------------------------------
# the quantizer


def test_rotation_is_orthogonal_and_deterministic():
    for d in (64, 6):
        r = plt.rotation(d, seed=3)
        assert torch.allclose(r @ r.T, torch.eye(d), atol=1e-5)
        assert torch.equal(r, plt.rotation(d, seed=3))
    assert not torch.equal(plt.rotation(64, 0), plt.rotation(64, 1))


@pytest.mark.parametrize("bits", [1, 2, 3, 8])
@pytest.mark.parametrize("rotate", [True, False])
def test_quantizer_error_bound_per_component(bits, rotate):
    torch.manual_seed(bits)
    x = torch.randn(3, 21, 16) * torch.linspace(0.1, 10, 21)[None, :, None]  # 21 rows: 2 full groups + 5
    q = plt.quantize_groups(x, bits, group=8, rotate=rotate, seed=1)
    xh = plt.dequantize_groups(q)
    y = x @ plt.rotation(16, 1) if rotate else x
    yh = xh @ plt.rotation(16, 1) if rotate else xh
    step = (plt.GAUSSIAN_STEP[bits] * q.scales.float()).repeat_interleave(8, -1)[..., :21, None].expand_as(y)
    half = (1 << bits) // 2
    inside = y.abs() < half * step
    err = (y - yh).abs()
    assert (err[inside] <= step[inside] / 2 * (1 + 1e-4) + 1e-6).all()
    bound_out = y.abs() - (half - 0.5) * step
    assert (err[~inside] <= bound_out[~inside] + 1e-4).all()
    assert torch.allclose((x - xh).norm(), (y - yh).norm(), rtol=1e-4)  # the rotation keeps the error's norm


@pytest.mark.parametrize("bits, lo, hi", [(1, 0.33, 0.40), (2, 0.105, 0.135), (3, 0.030, 0.042)])
def test_quantizer_mse_on_gaussian_data_is_the_uniform_optimum(bits, lo, hi):
    # Max's table: MSE of the optimal uniform quantizer of a unit Gaussian: 0.3634 (1 bit), 0.1188 (2), 0.03744 (3)
    torch.manual_seed(0)
    x = torch.randn(4, 512, 64) * 3.0
    xh = plt.dequantize_groups(plt.quantize_groups(x, bits))
    rel = float((x - xh).pow(2).sum() / x.pow(2).sum())
    assert lo < rel < hi


def test_quantizer_groups_have_their_own_scale():
    torch.manual_seed(0)
    small, big = torch.randn(8, 64) * 1e-3, torch.randn(8, 64) * 1e3
    xh = plt.dequantize_groups(plt.quantize_groups(torch.cat([small, big]), 2, group=8))
    assert float((xh[:8] - small).norm() / small.norm()) < 0.4  # a shared scale would zero the small group
    xh_one = plt.dequantize_groups(plt.quantize_groups(torch.cat([small, big]), 2, group=16))
    assert float((xh_one[:8] - small).norm() / small.norm()) > 0.9


@pytest.mark.parametrize("bits", [0, 1, 2, 5])
def test_quantizer_bit_accounting_and_bytes_roundtrip(bits):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 19, 64)
    q = plt.quantize_groups(x, bits, group=8)
    n_comp, n_groups = 2 * 3 * 19 * 64, 2 * 3 * 3
    assert q.num_components == n_comp
    if bits == 0:
        assert q.bits_total == 0 and q.to_bytes() == b"" and not plt.dequantize_groups(q).any()
        return
    assert q.num_scales == n_groups
    assert q.bits_total == bits * n_comp + 16 * n_groups
    assert q.bits_per_component == pytest.approx(bits + 16 * n_groups / n_comp)
    data = q.to_bytes()
    assert len(data) == -(-bits * n_comp // 8) + 2 * n_groups
    back = plt.GroupQuantized.from_bytes(data, x.shape, bits, group=8)
    assert torch.equal(back.codes, q.codes) and torch.equal(back.scales, q.scales)
    assert torch.equal(plt.dequantize_groups(back), plt.dequantize_groups(q))
    with pytest.raises(ValueError, match="bytes"):
        plt.GroupQuantized.from_bytes(data[:-1], x.shape, bits)


def test_two_bits_with_scales_stay_near_two_bits_for_head_vectors():
    q = plt.quantize_groups(torch.randn(30, 384, 64), 2, group=8)  # 8 vectors of 64 share one 16-bit scale
    assert q.bits_per_component == pytest.approx(2 + 16 / 512)


def test_quantizer_zero_group_and_bad_arguments():
    x = torch.zeros(10, 8)
    x[8:] = 1.0
    q = plt.quantize_groups(x, 2, group=8)
    assert torch.equal(plt.dequantize_groups(q)[:8], torch.zeros(8, 8))
    with pytest.raises(ValueError):
        plt.quantize_groups(x, 9)
    with pytest.raises(ValueError):
        plt.quantize_groups(torch.zeros(4), 2)


def test_a_small_delta_costs_the_same_bits_but_a_smaller_error():
    torch.manual_seed(0)
    ref = torch.randn(64, 64) * 5
    member = ref + 0.1 * torch.randn(64, 64)
    direct = plt.quantize_groups(member, 2)
    delta = plt.quantize_groups(member - ref, 2)
    assert direct.bits_total == delta.bits_total
    err_direct = (plt.dequantize_groups(direct) - member).norm()
    err_delta = (ref + plt.dequantize_groups(delta) - member).norm()
    assert err_delta < 0.05 * err_direct
