"""scripts/spec_rangecoder.py (the range coder of spec/kvz.md §11.2, written from the spec) is bit-exact with
constriction, the coder kvcodec uses (kvcodec/tokens/rangecoder.py): the same quantized frequencies, the same
words for every message, the same symbols (and the same rejections) for every word sequence.

Deterministic (seeded numpy RNGs) and fast; the carry, flush and trailing-zero paths of the coder are driven
on purpose (``_steer``) rather than left to chance.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest

constriction = pytest.importorskip("constriction")

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("spec_rangecoder", ROOT / "scripts" / "spec_rangecoder.py")
ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref)

TOTAL = 1 << 24
FAMILY = constriction.stream.model.Categorical(perfect=False)  # as kvcodec.tokens.rangecoder.categorical()


# --- constriction, called exactly as kvcodec.tokens.rangecoder calls it -----------------------------------

def c_encode(symbols, dists) -> np.ndarray:
    enc = constriction.stream.queue.RangeEncoder()
    for t, p in zip(symbols, dists):
        enc.encode(np.array([t], dtype=np.int32), FAMILY, p[None, :])
    return np.asarray(enc.get_compressed(), dtype=np.uint32)


def c_decode(words, dists) -> tuple[list[int], int | None]:
    """Symbols decoded before the first rejection, and the index of that rejection (None: none)."""
    dec = constriction.stream.queue.RangeDecoder(np.ascontiguousarray(words, dtype=np.uint32))
    out = []
    for i, p in enumerate(dists):
        try:
            out.append(int(dec.decode(FAMILY, p[None, :])[0]))
        except AssertionError:  # constriction: "invalid compressed data"
            return out, i
    return out, None


def r_decode(words, dists) -> tuple[list[int], int | None]:
    try:
        return ref.decode(words, dists, len(dists)), None
    except ref.InvalidStream as e:
        return e.decoded, len(e.decoded)


def c_cumulative_at(p: np.ndarray, t: int) -> int:
    """constriction's cumulative frequency C[t], read off the one word of a one-symbol message.

    From the fresh state (Range = 2**64 - 1, scale = 2**40 - 1) the flushed word is
    ((2**40 - 1) * C[t] + 2**32 - 1) >> 32 = 256 * C[t] exactly (for C[t] < 2**24)."""
    w = c_encode([t], [p])
    assert w.size in (1, 2) and int(w[0]) % 256 == 0
    return int(w[0]) // 256


# --- distributions ---------------------------------------------------------------------------------------

def random_dist(rnd: np.random.Generator, V: int) -> np.ndarray:
    kind = int(rnd.integers(9))
    if kind == 0:                                   # flat-ish
        p = rnd.random(V)
    elif kind == 1:                                 # log-normal, wide dynamic range
        p = np.exp(rnd.normal(0.0, 8.0, V))
    elif kind == 2:                                 # many exact zeros
        p = rnd.random(V) * (rnd.random(V) < 0.3)
    elif kind == 3:                                 # one dominant symbol, the rest tiny
        p = np.full(V, 1e-12)
        p[rnd.integers(V)] = 1.0
    elif kind == 4:                                 # peaked softmax, normalised
        z = rnd.normal(0.0, 1.0, V) * 12.0
        p = np.exp(z - z.max())
        p /= p.sum()
        p = p.astype(np.float64)
    elif kind == 5:                                 # the lm procedures' uniform vector
        p = np.full(V, 1.0 / V)
    elif kind == 6:                                 # static-wb-o2-v1's integer-valued weights
        p = np.floor(rnd.dirichlet(np.full(V, 0.1)) * 2.0 ** 40) + 1.0
    elif kind == 7:                                 # huge unnormalised sum, subnormal entries
        p = rnd.random(V) * 1e300 / V
        tiny = rnd.random(V) < 0.2
        tiny[rnd.integers(V)] = False
        p[tiny] = 5e-324
    else:                                           # tiny (but normal) sum
        p = rnd.random(V) * 1e-290
    if not p.sum() > 0:
        p[0] = 1.0
    return np.ascontiguousarray(p, dtype=np.float64)


def random_message(rnd, V, n, dists=None):
    dists = dists or [random_dist(rnd, V) for _ in range(n)]
    syms = []
    for p in dists:
        if rnd.random() < 0.8:                      # mostly likely symbols, sometimes any symbol
            syms.append(int(rnd.choice(V, p=p / math.fsum(p))))
        else:
            syms.append(int(rnd.integers(V)))
    return syms, dists


def exact_dist(c: int, f: int) -> np.ndarray:
    """A 3-symbol vector whose symbol 1 quantizes to exactly cumulative c and frequency f
    (the sum is 2**24 - 3 = the free weight, so scale = 1.0 exactly)."""
    assert c >= 1 and f >= 1 and c + f <= TOTAL - 1
    return np.array([c - 1, f - 1, TOTAL - 1 - c - f], dtype=np.float64)


# --- 1. quantization -------------------------------------------------------------------------------------

def test_quantize_properties_and_exact_dist():
    rnd = np.random.default_rng(1)
    for V in (2, 3, 7, 1000, 50_000):
        for _ in range(3):
            q = ref.quantize(random_dist(rnd, V))
            assert len(q) == V and sum(q) == TOTAL and min(q) >= 1
    assert ref.cumulative(exact_dist(5, 7)) == [0, 5, 12, TOTAL]
    assert ref.cumulative(exact_dist(1, TOTAL - 2)) == [0, 1, TOTAL - 1, TOTAL]


@pytest.mark.parametrize("V", [2, 3, 5, 17, 256, 1000, 32_000, 50_000])
def test_quantized_frequencies_match_constriction(V):
    rnd = np.random.default_rng(V)
    for _ in range(4):
        p = random_dist(rnd, V)
        C = ref.cumulative(p)
        if V <= 256:
            ts = range(V)
        else:                                       # ends, zero-probability symbols and a random sample
            ts = {0, 1, V - 2, V - 1, *rnd.integers(V, size=24).tolist(), *np.flatnonzero(p == 0)[:8].tolist()}
        for t in sorted(ts):
            assert c_cumulative_at(p, t) == C[t], (V, t)


@pytest.mark.parametrize("V", [3000, 32_000, 49_152, 128_256])
def test_uniform_needs_the_left_to_right_sum(V):
    """np.full(V, 1/V): normalising by numpy's pairwise p.sum() (or exactly) instead of the left-to-right
    binary64 sum changes the frequencies; constriction uses the left-to-right sum, as the reference does.
    And ones(V) (the 'same' uniform distribution) quantizes differently for some V."""
    p = np.full(V, 1.0 / V)
    C = ref.cumulative(p)
    S = np.cumsum(p)                                # numpy's cumsum is a left-to-right running sum
    assert float(S[-1]) != float(p.sum())           # pairwise and left-to-right sums differ here
    scale = float(TOTAL - V) / float(p.sum())
    C_pairwise = [int(s * scale) + i for i, s in enumerate([0.0, *S[:-1].tolist()])] + [TOTAL]
    differ = [t for t in range(V) if C[t] != C_pairwise[t]]
    assert differ
    for t in differ[:12] + [0, V - 1]:
        assert c_cumulative_at(p, t) == C[t]
    if V == 49_152:
        assert ref.cumulative(np.ones(V)) != C


def test_vocabulary_limits():
    big = np.ones(TOTAL - 2)                        # 2**24 - 2 symbols: the largest constriction accepts
    assert ref.MAX_VOCAB == TOTAL - 2
    scale = 2.0 / (TOTAL - 2)                       # free weight 2: frequencies 1 except two symbols with 2
    for t in (0, 1, (TOTAL - 2) // 2, (TOTAL - 2) // 2 + 1, TOTAL - 4, TOTAL - 3):
        assert c_cumulative_at(big, t) == int(t * scale) + t
    for V in (1, TOTAL - 1, TOTAL):
        p = np.ones(V)
        with pytest.raises(ValueError):
            c_encode([0], [p])
        with pytest.raises(ValueError):
            ref.quantize(p)
    # a large vocabulary the (slow) reference can still afford
    rnd = np.random.default_rng(7)
    p = random_dist(rnd, 1 << 18)
    C = ref.cumulative(p)
    for t in rnd.integers(1 << 18, size=16).tolist() + [(1 << 18) - 1]:
        assert c_cumulative_at(p, t) == C[t]


@pytest.mark.parametrize("p", [[0.0, 0.0], [1e-310, 1e-310], [1.0, np.nan], [1.0, np.inf], [1e308, 1e308]],
                         ids=["zero", "subnormal-sum", "nan", "inf", "sum-overflows"])
def test_unnormalisable_rejected_by_both(p):
    p = np.array(p)
    with pytest.raises(ValueError):
        c_encode([0], [p])
    with pytest.raises(ValueError):
        ref.quantize(p)


def test_out_of_support_symbol_rejected_by_both():
    p = np.ones(4)
    for t in (-1, 4):
        with pytest.raises(KeyError):               # constriction: "zero probability under the model"
            c_encode([t], [p])
        with pytest.raises(ValueError):
            ref.encode([t], [p])


def test_concrete_model_equals_family():
    """Categorical(p, perfect=False) (eager model) and the family (lazy model) give the same bytes."""
    rnd = np.random.default_rng(3)
    for V in (2, 9, 3000):
        syms, dists = random_message(rnd, V, 12)
        enc = constriction.stream.queue.RangeEncoder()
        for t, p in zip(syms, dists):
            enc.encode(np.array([t], dtype=np.int32), constriction.stream.model.Categorical(p, perfect=False))
        assert np.array_equal(enc.get_compressed(), c_encode(syms, dists))


# --- 2. encoder and decoder ------------------------------------------------------------------------------

def _check(syms, dists, trace=None):
    trace = {} if trace is None else trace
    words = ref.encode(syms, dists, trace)
    expect = c_encode(syms, dists)
    assert words.dtype == np.uint32
    assert np.array_equal(words, expect), (words[:8], expect[:8])
    # one word per renormalisation, one flush word, and the optional trailing zero (none for no symbols)
    assert words.size == (trace["renorms"] + 1 + trace["trailing_zero"] if syms else 0)
    assert ref.decode(expect, dists, len(syms)) == syms
    assert c_decode(words, dists) == (syms, None)
    return words


def test_empty_and_single():
    p = np.array([0.25, 0.75])
    assert ref.encode([], []).size == 0 == c_encode([], []).size
    assert ref.decode(np.zeros(0, np.uint32), [], 0) == []
    rnd = np.random.default_rng(4)
    for V in (2, 3, 100, 50_000):
        for _ in range(4):
            syms, dists = random_message(rnd, V, 1)
            _check(syms, dists)
    _check([0], [p])
    _check([1], [p])


def test_random_messages_bit_exact():
    rnd = np.random.default_rng(2024)
    totals = {"carries": 0, "renorms": 0, "trailing_zero": 0}
    for _ in range(150):
        V = int(rnd.choice([2, 3, 5, 17, 256, 1000]))
        syms, dists = random_message(rnd, V, int(rnd.integers(0, 40)))
        tr: dict = {}
        _check(syms, dists, tr)
        for k in totals:
            totals[k] += int(tr.get(k, 0))
    for _ in range(12):                             # large vocabularies, short messages
        V = int(rnd.choice([4096, 32_000, 50_000]))
        _check(*random_message(rnd, V, int(rnd.integers(1, 5))))
    assert totals["carries"] > 0 and totals["renorms"] > 100 and totals["trailing_zero"] > 0, totals


def test_adaptive_distributions_callable():
    """Distributions that depend on the symbols so far (as the token models do), passed as a callable."""
    V = 50
    base = np.random.default_rng(5).random((V, V)) ** 6

    def dist(i, hist):
        return base[hist[-1]] if hist else np.full(V, 1.0 / V)

    syms = np.random.default_rng(6).integers(V, size=200).tolist()
    dists = [dist(i, syms[:i]) for i in range(len(syms))]
    words = ref.encode(syms, dist)
    assert np.array_equal(words, c_encode(syms, dists))
    assert ref.decode(words, dist, len(syms)) == syms


# --- 3. the rare paths of the coder, driven on purpose -----------------------------------------------------

def _pick(goal: str, low: int, rng_: int, rnd) -> tuple[int, int]:
    """(c, f) for the next symbol so that the coder state does ``goal``.  Low and Range are the reference's
    64-bit state; the interval 'straddles' when Low + Range > 2**64 (the pending words may still carry)."""
    scale = rng_ >> 24
    B = (1 << 64) - low                             # distance from Low up to the carry boundary
    straddles = rng_ > B
    top = TOTAL - 1                                 # c + f may not exceed this (exact_dist)
    if goal == "shrink":                            # any symbol of frequency 1
        return int(rnd.integers(1, top - 1)), 1
    if goal == "enter":                             # renormalise into a straddling interval
        assert not straddles and scale < 1 << 31
        f = ((1 << 32) - 1) // scale
        for _ in range(10_000):
            c = int(rnd.integers(1, top - f + 1))
            if ((low + scale * c) % (1 << 32)) + scale * f > 1 << 32:
                return c, f
        raise AssertionError("no c found")
    assert straddles, goal
    if goal == "stay":                              # renormalise and still straddle (one more pending word)
        assert scale < 1 << 31
        f = ((1 << 32) - 1) // scale
        c = (B - 1) // scale - int(rnd.integers(0, f - 1))
    elif goal == "narrow":                          # still straddle, no renormalisation, Range ~ 2**40
        f = max(1, (1 << 40) // scale)
        c = (B - 1) // scale - f // 2
    elif goal == "carry":                           # resolve: the interval moves wholly above 2**64
        c = -(-B // scale)
        f = int(rnd.integers(1, max(2, min(1 << 20, top - c))))
    elif goal == "nocarry":                         # resolve: the interval moves wholly below 2**64
        room = B // scale
        f = int(rnd.integers(1, max(2, room // 2)))
        c = int(rnd.integers(1, max(2, room - f)))
    elif goal == "flush_carry":                     # last symbol: Low + 2**32 - 1 carries at the flush
        assert scale < (1 << 32) - 1
        c, f = (B - 1) // scale, -(-(1 << 32) // scale)
    else:
        raise ValueError(goal)
    assert c >= 1 and f >= 1 and c + f <= top, (goal, c, f)
    if goal in ("stay", "narrow", "flush_carry"):
        assert scale * c < B < scale * (c + f)
    return c, f


def _steer(goals, rnd):
    syms, dists = [], []
    for goal in goals:
        tr: dict = {}
        ref.encode(syms, dists, tr)
        c, f = _pick(goal, tr.get("low", 0), tr.get("range", (1 << 64) - 1), rnd)
        syms.append(1)
        dists.append(exact_dist(c, f))
    return syms, dists


@pytest.mark.parametrize("seed", range(6))
def test_carry_paths_bit_exact(seed):
    rnd = np.random.default_rng(100 + seed)
    k = 1 + seed                                    # pending words before the carry resolves
    scenarios = {
        "carry": (["shrink", "enter"] + ["narrow", "stay"] * (k - 1) + ["carry", "shrink", "shrink"], k),
        "nocarry": (["shrink", "enter"] + ["narrow", "stay"] * (k - 1) + ["nocarry", "shrink"], 0),
        "flush_carry": (["shrink", "enter"] + ["narrow", "stay"] * (k - 1) + ["narrow", "flush_carry"], k),
    }
    for name, (goals, longest) in scenarios.items():
        syms, dists = _steer(goals, rnd)
        tr: dict = {}
        _check(syms, dists, tr)
        assert tr["longest_carry"] == longest, (name, tr)
        assert tr["flush_carry"] == (name == "flush_carry"), (name, tr)


def test_trailing_zero_word():
    """The flush appends a 0 word when Low + Range and Low + 2**32 - 1 share their top word."""
    rnd = np.random.default_rng(9)
    seen = 0
    for _ in range(40):
        syms, dists = _steer(["shrink"] * int(rnd.integers(1, 4)), rnd)
        tr: dict = {}
        ref.encode(syms, dists, tr)
        low, rng_ = tr["low"], tr["range"]
        scale = rng_ >> 24
        f = -(-(1 << 32) // scale)                  # Range just above 2**32
        for c in rnd.integers(1, TOTAL - 1 - f, size=64).tolist():
            lo = (low + scale * c) % (1 << 32)
            if lo >= 1 and lo + scale * f < 1 << 33:
                break
        syms.append(1)
        dists.append(exact_dist(c, f))
        tr = {}
        words = _check(syms, dists, tr)
        seen += tr["trailing_zero"]
        assert not tr["trailing_zero"] or words[-1] == 0
    assert seen >= 20


# --- 4. decoding arbitrary words: same symbols, same rejections ------------------------------------------

def test_decoder_on_arbitrary_words():
    rnd = np.random.default_rng(11)
    rejected = 0
    for trial in range(300):
        V = int(rnd.choice([2, 3, 10, 300]))
        n = int(rnd.integers(1, 12))
        dists = [random_dist(rnd, V) for _ in range(n)]
        kind = trial % 4
        if kind == 0:                               # random garbage of random length (incl. empty)
            words = rnd.integers(0, 1 << 32, size=int(rnd.integers(0, 6)), dtype=np.uint64).astype(np.uint32)
        elif kind == 1:                             # first quantile >= 2**24: invalid at once
            words = np.array([0xFFFFFFFF, 0xFF000000 | int(rnd.integers(1 << 24))] + [0] * 3, dtype=np.uint32)
        else:                                       # a valid stream, truncated or with a word set to all ones
            syms, _ = random_message(rnd, V, n, dists)
            words = ref.encode(syms, dists)
            if kind == 2:
                words = words[:int(rnd.integers(0, words.size + 1))]
            elif words.size:
                words = words.copy()
                words[int(rnd.integers(words.size))] = 0xFFFFFFFF
        got = r_decode(words, dists)
        assert got == c_decode(words, dists), (trial, words)
        rejected += got[1] is not None
    assert rejected >= 75                           # every kind-1 trial, at least
