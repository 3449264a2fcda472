"""Reference implementation of the token range coder of spec/kvz.md §11.2, written from the spec text.

This is the pseudo-code of the spec made runnable, not a fast coder.  It reproduces, bit for bit, what
kvcodec gets from constriction (>= 0.4, < 0.6) with

    enc = constriction.stream.queue.RangeEncoder()
    enc.encode(np.array([t], dtype=np.int32), constriction.stream.model.Categorical(perfect=False), p[None, :])
    words = enc.get_compressed()

and ``constriction.stream.queue.RangeDecoder(words).decode(family, p[None, :])``.
(In constriction: ``LazyContiguousCategoricalEntropyModel::from_floating_point_probabilities_fast`` with
``PRECISION = 24``, and ``RangeEncoder<u32, u64>`` / ``RangeDecoder<u32, u64>``.)

Only the standard library is used for the arithmetic (Python ints are exact, Python floats are IEEE
binary64 with round-to-nearest-even, the same as Rust's ``f64``); numpy is accepted as input only.

    quantize(p)                 -> list of V integer frequencies, each >= 1, summing to 2**24
    encode(symbols, dists)      -> numpy uint32 array of words
    decode(words, dists, n)     -> list of n symbols
"""

from __future__ import annotations

import bisect
import itertools
import math
from typing import Sequence

import numpy as np

PRECISION = 24                 # bits of the quantized probabilities
TOTAL = 1 << PRECISION         # 2**24: the frequencies of one distribution sum to this
WORD_BITS = 32                 # the coder emits u32 words
STATE_BITS = 64                # Low and Range are u64
MASK64 = (1 << STATE_BITS) - 1
WORD_MASK = (1 << WORD_BITS) - 1
RANGE_MIN = 1 << (STATE_BITS - WORD_BITS)   # 2**32: Range is renormalised when it drops below this
MAX_VOCAB = TOTAL - 2          # 16_777_214: largest V constriction accepts (it requires V < 2**24 - 1)


class InvalidStream(ValueError):
    """The words are not a valid range-coder stream for the given distributions; ``decoded`` holds the
    symbols decoded before the one that failed."""

    def __init__(self, message: str, decoded: list[int]):
        super().__init__(message)
        self.decoded = decoded


# ---------------------------------------------------------------------------------------------
# 1. Probabilities -> cumulative frequencies
# ---------------------------------------------------------------------------------------------

def cumulative(p) -> list[int]:
    """Cumulative frequencies C[0..V] of the float64 vector ``p`` (unnormalised, entries >= 0).

    C[0] = 0, C[V] = 2**24, and symbol s has the frequency C[s+1] - C[s] >= 1.
    """
    if isinstance(p, np.ndarray) and p.dtype != np.float64:
        # constriction would quantize a float32 array in binary32 arithmetic: not what the spec describes
        raise TypeError(f"distributions are float64 vectors, not {p.dtype}")
    p = np.asarray(p, dtype=np.float64).reshape(-1)
    V = p.size
    if not 2 <= V <= MAX_VOCAB:
        raise ValueError(f"vocabulary size {V} outside [2, {MAX_VOCAB}]")
    p = p.tolist()                             # exact: each float64 becomes the same Python float
    if any(not math.isfinite(x) or x < 0.0 for x in p):
        raise ValueError("probabilities must be finite and non-negative")

    # Running sums S[s] = (((p[0] + p[1]) + p[2]) + ... + p[s-1]), strictly left to right, each addition
    # rounded to binary64 (NOT numpy's pairwise p.sum(), NOT math.fsum).  S[0] = 0.0.
    S = [0.0] + list(itertools.accumulate(p))
    N = S[V]                                   # the normalisation: the same left-to-right sum
    if not (math.isfinite(N) and N >= 2.0 ** -1022):  # constriction: N must be a positive, *normal* float
        raise ValueError("probabilities sum to zero, a subnormal number or overflow")
    free = TOTAL - V                           # weight left after giving every symbol 1
    scale = float(free) / N                    # one binary64 division
    if not math.isfinite(scale):               # N so small that free / N overflows
        raise ValueError("probabilities sum too small (2**24 / sum overflows binary64)")

    C = []
    for s in range(V):
        # binary64 product, then truncation toward zero (Rust's `f64 as u32`), then + s
        C.append(int(S[s] * scale) + s)
    C.append(TOTAL)                            # the last symbol takes everything up to 2**24
    return C


def quantize(p) -> list[int]:
    """Integer frequencies (each >= 1, summing to 2**24) of the float64 vector ``p``."""
    C = cumulative(p)
    return [C[s + 1] - C[s] for s in range(len(C) - 1)]


def _symbol_of(C: list[int], q: int) -> int:
    """The symbol s with C[s] <= q < C[s+1] (0 <= q < 2**24)."""
    return bisect.bisect_right(C, q) - 1


# ---------------------------------------------------------------------------------------------
# 2. Encoder
# ---------------------------------------------------------------------------------------------

def _dist(dists, i: int, history: list[int]):
    return dists(i, history) if callable(dists) else dists[i]


def _add_carry(out: list[int]) -> int:
    """Add 1 to the number formed by the words already emitted (last word = least significant).
    Returns how many words changed."""
    i = len(out) - 1
    while True:
        # The coder's invariants guarantee that the carry is absorbed before it runs off the front.
        assert i >= 0, "carry out of the first word (cannot happen)"
        out[i] = (out[i] + 1) & WORD_MASK
        if out[i] != 0:
            return len(out) - i
        i -= 1


def encode(symbols: Sequence[int], dists, trace: dict | None = None) -> np.ndarray:
    """Code ``symbols[i]`` under the distribution ``dists[i]`` (or ``dists(i, symbols[:i])``).

    Returns the u32 words (the value of ``RangeEncoder.get_compressed()``).  If ``trace`` is a
    dict, it receives counts of renormalisations and carries, the most words one carry changed,
    whether the flush carried, whether a trailing zero word was appended and the final Low and
    Range (for tests).
    """
    symbols = [int(t) for t in symbols]
    out: list[int] = []
    low, rng = 0, MASK64                        # Low = 0, Range = 2**64 - 1
    carries = renorms = flush_carry = longest_carry = 0

    for i, t in enumerate(symbols):
        C = cumulative(_dist(dists, i, symbols[:i]))
        if not 0 <= t < len(C) - 1:
            raise ValueError(f"symbol {t} outside the distribution's support")
        c, f = C[t], C[t + 1] - C[t]

        scale = rng >> PRECISION                # floor(Range / 2**24)
        rng = scale * f                         # new Range (>= scale >= 2**8, fits in 64 bits)
        low = low + scale * c                   # new Low, may exceed 64 bits ...
        if low > MASK64:                        # ... then the overflow is a carry into the emitted words
            low &= MASK64
            longest_carry = max(longest_carry, _add_carry(out))
            carries += 1
        if rng < RANGE_MIN:                     # renormalise: emit Low's top word, shift by one word
            out.append(low >> (STATE_BITS - WORD_BITS))
            low = (low << WORD_BITS) & MASK64
            rng = rng << WORD_BITS
            renorms += 1

    trailing_zero = False
    if symbols:                                 # flush; an empty message is zero words
        point = low + (RANGE_MIN - 1)           # Low + 2**32 - 1, may carry
        if point > MASK64:
            point &= MASK64
            longest_carry = max(longest_carry, _add_carry(out))
            carries += 1
            flush_carry = 1
        point_word = point >> (STATE_BITS - WORD_BITS)
        out.append(point_word)
        upper_word = ((low + rng) & MASK64) >> (STATE_BITS - WORD_BITS)
        if upper_word == point_word:            # pin the value against words appended after the stream
            out.append(0)
            trailing_zero = True

    if trace is not None:
        trace.update(carries=carries, renorms=renorms, flush_carry=flush_carry, longest_carry=longest_carry,
                     trailing_zero=trailing_zero, low=low, range=rng)
    return np.array(out, dtype=np.uint32)


# ---------------------------------------------------------------------------------------------
# 3. Decoder
# ---------------------------------------------------------------------------------------------

def decode(words, dists, n: int) -> list[int]:
    """Decode ``n`` symbols from ``words``; ``dists`` as for :func:`encode` (a callable gets the symbols
    decoded so far).  Raises :class:`InvalidStream` where no symbol fits (constriction: AssertionError
    "invalid compressed data")."""
    words = [int(w) for w in np.asarray(words, dtype=np.uint32).reshape(-1)]
    pos = 0

    def next_word() -> int:                     # words past the end read as 0
        nonlocal pos
        w = words[pos] if pos < len(words) else 0
        pos += 1
        return w

    low, rng = 0, MASK64
    point = (next_word() << WORD_BITS) | next_word()   # first word is the most significant
    out: list[int] = []
    for i in range(n):
        C = cumulative(_dist(dists, i, out))
        scale = rng >> PRECISION
        q = ((point - low) & MASK64) // scale   # (Point - Low) mod 2**64, floor-divided
        if q >= TOTAL:
            raise InvalidStream(f"symbol {i}: quantile {q} >= 2**24", out)
        s = _symbol_of(C, q)
        c, f = C[s], C[s + 1] - C[s]
        low = (low + scale * c) & MASK64
        rng = scale * f
        if rng < RANGE_MIN:
            low = (low << WORD_BITS) & MASK64
            rng = rng << WORD_BITS
            point = ((point << WORD_BITS) & MASK64) | next_word()
        out.append(s)
    return out
