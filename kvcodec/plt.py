"""Probabilistic-language-trie (PLT) quantities and the tail-delta quantizer of the layer-1 study.

READ ME FIRST
-------------
The seed paper (Magarshak, arXiv:2604.15356, section 2.3 and Definition 3; see
``shared/design/papers.md`` A.1-A.2) clusters sessions by
``d_T(s, t) = -log2 P(s ^ t)``, the self-information of their longest common
prefix, and stores cluster members as an exact shared prefix plus quantized
"tail deltas" against a centroid session.  Three facts shape this module:

1. ``d_T`` is a **value**, not a distance: ``d_T(s, s) = I(s) > 0``, a longer
   shared prefix gives a *larger* ``d_T``, and with two first tokens of
   probability 1/2 both the ultrametric and the triangle inequality fail
   (``d_T(a, a) = 1``, ``d_T(a, b) = 0``).  It is therefore returned by
   :func:`plt_value_bits`, named as what it is: the bits of computation two
   sequences share.
2. The tree path distance ``d_tree(s, t) = I(s) + I(t) - 2 I(s ^ t)`` (edge
   weights = surprisal) is a genuine pseudometric: :func:`plt_tree_distance`.
   :func:`normalized_tree_distance` divides it by ``I(s) + I(t)``, giving the
   fraction of the two sequences' information that is *not* shared, in [0, 1].
3. The paper's clustering rule ``d_T <= delta`` is kept only as the option
   ``paper_literal_threshold`` of :func:`choose_centroid`; because ``d_T``
   grows with the shared prefix, the rule selects sessions with *short* shared
   prefixes (an unrelated session, LCP 0, always has ``d_T = 0``).

Surprisal convention: ``surprisal[j] = -log2 P(t_j | t_<j)`` in bits, one
float per token; ``I(x)`` is the sum over ``x``'s tokens.  The first token of a
sequence has no context unless the caller prepends one (a BOS token); then its
bits are whatever :func:`token_surprisal` is told (``first_token_bits``, 0 by
default).  Two sequences that share their first token share that term, so it
cancels in ``d_tree``.

The quantizer (:func:`quantize_groups` / :func:`dequantize_groups`) codes rows
of a ``[..., N, D]`` tensor (N vectors of D components) with ``bits`` in 0..8
per component: a fixed orthogonal rotation (randomized Hadamard, seeded), then
one float16 scale per group of ``group`` consecutive rows (the RMS of the
group), then a uniform mid-rise quantizer whose step is the optimum for a unit
Gaussian (Max 1960).  Its bit count includes the scales; :meth:`GroupQuantized.to_bytes`
packs exactly that many bits (rounded up to whole bytes).  No pickle anywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["lcp_len", "plt_value_bits", "plt_tree_distance", "normalized_tree_distance", "window_tree_distances",
           "surprisal_from_logits", "token_surprisal", "choose_centroid", "CentroidChoice", "GroupQuantized",
           "quantize_groups", "dequantize_groups", "rotation", "GAUSSIAN_STEP", "SCALE_BITS"]

#: step / sigma of the MSE-optimal uniform quantizer of a unit Gaussian with 2**bits levels (Max 1960,
#: table I; also Jayant & Noll table 4.3).  Mid-rise: the levels are (k + 1/2) * step, k = -L/2 .. L/2 - 1.
GAUSSIAN_STEP = {1: 1.5958, 2: 0.9957, 3: 0.5860, 4: 0.3352, 5: 0.1881, 6: 0.1041, 7: 0.0569, 8: 0.0308}

#: bits of one group scale (stored as IEEE float16)
SCALE_BITS = 16

_FP16_MAX = 65504.0


# --------------------------------------------------------------------------------------------------------------
# token sequences and the trie quantities


def _ids(s, name: str) -> np.ndarray:
    a = s.detach().cpu().numpy() if isinstance(s, torch.Tensor) else np.asarray(s)
    if a.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence of token ids, got shape {a.shape}")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name}: token ids must be integers, got dtype {a.dtype}")
    return a


def _bits(x, n: int, name: str) -> np.ndarray:
    a = x.detach().cpu().double().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, dtype=np.float64)
    if a.shape != (n,):
        raise ValueError(f"{name}: expected {n} per-token bits, got shape {a.shape}")
    return a


def lcp_len(s, t) -> int:
    """Length of the longest common prefix of two token sequences (exact id comparison).

    >>> lcp_len([5, 6, 7], [5, 6, 9, 9])
    2
    >>> lcp_len([], [1]), lcp_len([1, 2], [1, 2])
    (0, 2)
    """
    a, b = _ids(s, "s"), _ids(t, "t")
    m = min(a.size, b.size)
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else int(m)


def plt_value_bits(s, t, surprisal_s, surprisal_t=None) -> float:
    """The paper's ``d_T(s, t) = -log2 P(s ^ t)``: the bits of the shared prefix (a value, not a distance).

    ``surprisal_s`` holds ``-log2 P(s_j | s_<j)`` per token of ``s``; the shared prefix's bits are summed from
    it (and averaged with ``surprisal_t``'s when given: in exact arithmetic they are equal, in floating point
    two forward passes of different lengths can differ in the last bits).  ``plt_value_bits(s, s, .) = I(s)``,
    not 0, and it *grows* as the shared prefix grows: see the module docstring.
    """
    a = _ids(s, "s")
    m = lcp_len(a, t)
    v = float(_bits(surprisal_s, a.size, "surprisal_s")[:m].sum())
    if surprisal_t is not None:
        v = 0.5 * (v + float(_bits(surprisal_t, _ids(t, "t").size, "surprisal_t")[:m].sum()))
    return v


def plt_tree_distance(s, t, surprisal_s, surprisal_t) -> float:
    """``d_tree(s, t) = I(s) + I(t) - 2 I(s ^ t)``: the bits of the two divergent suffixes (a pseudometric).

    Computed as ``sum(surprisal_s[m:]) + sum(surprisal_t[m:])`` with ``m = lcp_len(s, t)``, which equals the
    formula whenever the shared prefix has the same bits in both (always, for one model and exact arithmetic),
    and is 0 for ``s == t``.  Edge weights are surprisals, so this is the weighted path length in the trie:
    symmetric, zero on the diagonal, and it satisfies the triangle inequality.
    """
    a, b = _ids(s, "s"), _ids(t, "t")
    m = lcp_len(a, b)
    ps, pt = _bits(surprisal_s, a.size, "surprisal_s"), _bits(surprisal_t, b.size, "surprisal_t")
    return float(ps[m:].sum() + pt[m:].sum())


def normalized_tree_distance(s, t, surprisal_s, surprisal_t) -> float:
    """``d_tree(s, t) / (I(s) + I(t))`` in [0, 1]: the fraction of the pair's information that is not shared.

    0 for identical sequences, 1 for sequences with no common prefix (or no information); the corrected
    clustering rule thresholds this (0.1-0.3 is the range the study tries).
    """
    a, b = _ids(s, "s"), _ids(t, "t")
    total = float(_bits(surprisal_s, a.size, "surprisal_s").sum() + _bits(surprisal_t, b.size, "surprisal_t").sum())
    if total <= 0.0:
        return 0.0 if lcp_len(a, b) == a.size == b.size else 1.0
    return min(1.0, max(0.0, plt_tree_distance(a, b, surprisal_s, surprisal_t) / total))


def window_tree_distances(s, t, surprisal_s, surprisal_t, window: int, start: int = 0) -> np.ndarray:
    """Normalised ``d_tree`` of index-aligned windows ``[a, a + window)``, ``a = start, start + window, ...``.

    Each window of ``s`` is compared with the window of ``t`` at the *same absolute positions* (the index
    alignment the tail deltas use), as its own little trie: the windows' own LCP, their divergent suffixes'
    bits (each side's surprisal is conditioned on that side's own history).  Windows past the end of ``t``
    get 1.0.  Returns one value per window of ``s[start:]`` (the last may be shorter).
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    a, b = _ids(s, "s"), _ids(t, "t")
    ps, pt = _bits(surprisal_s, a.size, "surprisal_s"), _bits(surprisal_t, b.size, "surprisal_t")
    out = []
    for lo in range(start, a.size, window):
        hi = min(lo + window, a.size)
        if hi > b.size:
            out.append(1.0)
            continue
        out.append(normalized_tree_distance(a[lo:hi], b[lo:hi], ps[lo:hi], pt[lo:hi]))
    return np.asarray(out, dtype=np.float64)


def surprisal_from_logits(logits, ids, first_token_bits: float = 0.0) -> np.ndarray:
    """Per-token bits ``-log2 P(t_j | t_<j)`` from next-token logits ``[n, vocab]`` (row j predicts token j+1).

    Token 0 has no prediction in ``logits``; it gets ``first_token_bits``.  Computed in float64.
    """
    ids_a = _ids(ids, "ids")
    lg = torch.as_tensor(logits).double()
    if lg.dim() != 2 or lg.shape[0] != ids_a.size:
        raise ValueError(f"logits: expected [{ids_a.size}, vocab], got {tuple(lg.shape)}")
    out = np.empty(ids_a.size, dtype=np.float64)
    if ids_a.size:
        out[0] = float(first_token_bits)
    if ids_a.size > 1:
        lp = torch.log_softmax(lg[:-1], dim=-1)
        nxt = torch.as_tensor(ids_a[1:], dtype=torch.long)
        out[1:] = (-lp[torch.arange(nxt.numel()), nxt] / math.log(2.0)).numpy()
    return out


@torch.no_grad()
def token_surprisal(model, ids, *, first_token_bits: float = 0.0):
    """Per-token surprisal (bits) of ``ids`` under ``model``, from one forward pass with the cache on.

    ``ids``: ``[1, n]`` or ``[n]`` token ids.  Returns ``(bits, output)``: ``bits`` a float64 numpy array of
    length n (token 0 gets ``first_token_bits``: prepend a BOS to ``ids`` to score it, at the price of a cache
    that holds the BOS too), and ``output`` the model's forward output (``logits`` and the KV cache), so the
    surprisals come free with the prefill as the paper's trie assumes.
    """
    x = torch.as_tensor(ids, dtype=torch.long)
    if x.dim() == 1:
        x = x[None]
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"ids: expected [1, n] or [n], got {tuple(x.shape)}")
    out = model(x, use_cache=True)
    return surprisal_from_logits(out.logits[0], x[0], first_token_bits), out


# --------------------------------------------------------------------------------------------------------------
# centroid choice


@dataclass(frozen=True)
class CentroidChoice:
    """What :func:`choose_centroid` found: ``index`` into the library or None, and the pair's numbers."""

    index: int | None
    rule: str
    lcp: int = 0
    value_bits: float = 0.0  # d_T = I(s ^ c)
    tree_distance: float = 0.0  # d_tree(s, c)
    normalized_distance: float = 1.0  # d_tree / (I(s) + I(c))


def choose_centroid(s, surprisal_s, library, *, max_normalized_distance: float = 0.2,
                    paper_literal_threshold: float | None = None) -> CentroidChoice:
    """Pick the centroid of session ``s`` among ``library`` = a sequence of ``(tokens, surprisal)`` pairs.

    Corrected rule (default): the candidate with the longest LCP (ties: the smallest normalised ``d_tree``),
    accepted when its :func:`normalized_tree_distance` is ``<= max_normalized_distance``.

    ``paper_literal_threshold=delta`` (bits) applies the paper's literal rule instead: candidates with
    ``d_T(s, c) <= delta``, the one with the smallest ``d_T`` (the "nearest" under the paper's metric).
    **This selects short shared prefixes**: ``d_T`` is the bits of the shared prefix, so a session sharing
    nothing (``d_T = 0``) always qualifies and wins, and a long shared system prompt is rejected once its
    bits exceed ``delta``.  (The paper's lookup section maximises ``d_T`` instead, contradicting the rule.)
    """
    a = _ids(s, "s")
    ps = _bits(surprisal_s, a.size, "surprisal_s")
    rows = []
    for i, (t, pt) in enumerate(library):
        m = lcp_len(a, t)
        rows.append((i, m, plt_value_bits(a, t, ps, pt), plt_tree_distance(a, t, ps, pt),
                     normalized_tree_distance(a, t, ps, pt)))
    if not rows:
        return CentroidChoice(None, "literal" if paper_literal_threshold is not None else "corrected")
    if paper_literal_threshold is not None:
        ok = [r for r in rows if r[2] <= paper_literal_threshold]
        if not ok:
            best = min(rows, key=lambda r: (r[2], r[0]))
            return CentroidChoice(None, "literal", *best[1:])
        best = min(ok, key=lambda r: (r[2], r[0]))
        return CentroidChoice(best[0], "literal", *best[1:])
    best = min(rows, key=lambda r: (-r[1], r[4], r[0]))
    idx = best[0] if best[4] <= max_normalized_distance else None
    return CentroidChoice(idx, "corrected", *best[1:])


# --------------------------------------------------------------------------------------------------------------
# the tail-delta quantizer


_ROTATIONS: dict[tuple[int, int], torch.Tensor] = {}


def rotation(dim: int, seed: int = 0) -> torch.Tensor:
    """A fixed ``[dim, dim]`` float32 orthogonal matrix: ``diag(random signs) @ H / sqrt(dim)`` (Hadamard H)
    when ``dim`` is a power of two, else the Q of a seeded Gaussian's QR.  Deterministic in ``(dim, seed)``,
    so a decoder rebuilds it from the two numbers (nothing is stored).  It spreads outlier channels (keys have
    a few) over all components so one scale per group fits them."""
    key = (dim, seed)
    if key not in _ROTATIONS:
        g = torch.Generator().manual_seed(seed)
        if dim & (dim - 1) == 0:
            h = torch.ones(1, 1, dtype=torch.float64)
            while h.shape[0] < dim:
                h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
            signs = torch.randint(0, 2, (dim,), generator=g).double() * 2 - 1
            r = signs[:, None] * h / math.sqrt(dim)
        else:
            q, rr = torch.linalg.qr(torch.randn(dim, dim, generator=g, dtype=torch.float64))
            r = q * torch.sign(torch.diagonal(rr))[None, :]
        _ROTATIONS[key] = r.float()
    return _ROTATIONS[key]


@dataclass
class GroupQuantized:
    """Codes and scales of :func:`quantize_groups`; ``shape`` is the input's ``[..., N, D]``."""

    codes: torch.Tensor  # uint8 [..., N, D], values < 2**bits (empty when bits == 0)
    scales: torch.Tensor  # float16 [..., G], G = ceil(N / group) (empty when bits == 0)
    shape: tuple[int, ...]
    bits: int
    group: int
    rotate: bool
    seed: int

    @property
    def num_components(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 0

    @property
    def num_scales(self) -> int:
        return int(self.scales.numel())

    @property
    def bits_total(self) -> int:
        """Every bit this representation needs: codes (``bits`` each) and scales (16 each)."""
        return self.bits * self.num_components + SCALE_BITS * self.num_scales

    @property
    def bits_per_component(self) -> float:
        return self.bits_total / self.num_components if self.num_components else 0.0

    def to_bytes(self) -> bytes:
        """Codes packed LSB-first, ``bits`` per component, then the scales as little-endian float16.

        ``len(to_bytes()) == ceil(bits_total / 8)`` except that codes and scales each round up to whole bytes.
        """
        if self.bits == 0:
            return b""
        c = self.codes.reshape(-1).numpy().astype(np.uint8)
        planes = (c[:, None] >> np.arange(self.bits, dtype=np.uint8)) & 1
        packed = np.packbits(planes.reshape(-1), bitorder="little").tobytes()
        return packed + self.scales.reshape(-1).numpy().astype("<f2").tobytes()

    @classmethod
    def from_bytes(cls, data: bytes, shape, bits: int, group: int = 8, rotate: bool = True,
                   seed: int = 0) -> GroupQuantized:
        """Inverse of :meth:`to_bytes`; the layout parameters travel outside the bytes (as in a header)."""
        shape = tuple(int(x) for x in shape)
        if len(shape) < 2:
            raise ValueError(f"shape must be [..., N, D], got {shape}")
        n_comp = int(np.prod(shape))
        lead, n = shape[:-2], shape[-2]
        n_groups = int(np.prod(lead)) * (-(-n // group)) if bits else 0
        code_bytes = -(-(bits * n_comp) // 8)
        if len(data) != code_bytes + 2 * n_groups:
            raise ValueError(f"expected {code_bytes + 2 * n_groups} bytes for shape {shape} at {bits} bits, "
                             f"got {len(data)}")
        if bits == 0:
            return cls(torch.zeros(0, dtype=torch.uint8), torch.zeros(0, dtype=torch.float16), shape, 0, group,
                       rotate, seed)
        planes = np.unpackbits(np.frombuffer(data[:code_bytes], dtype=np.uint8), count=bits * n_comp,
                               bitorder="little").reshape(n_comp, bits)
        codes = (planes.astype(np.uint16) << np.arange(bits, dtype=np.uint16)).sum(1).astype(np.uint8)
        scales = np.frombuffer(data[code_bytes:], dtype="<f2").astype(np.float16)
        return cls(torch.from_numpy(codes.reshape(shape).copy()),
                   torch.from_numpy(scales.reshape(*lead, -1).copy()), shape, bits, group, rotate, seed)


def _group_rms(y: torch.Tensor, group: int) -> torch.Tensor:
    """RMS of each group of ``group`` consecutive rows of ``y`` [..., N, D] -> [..., ceil(N / group)]."""
    n, d = y.shape[-2], y.shape[-1]
    g = -(-n // group)
    pad = g * group - n
    sq = y.pow(2).sum(-1)  # [..., N]
    if pad:
        sq = torch.cat([sq, sq.new_zeros(*sq.shape[:-1], pad)], -1)
    counts = torch.full((g,), float(group * d))
    if pad:
        counts[-1] = float((group - pad) * d)
    return (sq.reshape(*sq.shape[:-1], g, group).sum(-1) / counts).sqrt()


def quantize_groups(x, bits: int = 2, *, group: int = 8, rotate: bool = True, seed: int = 0) -> GroupQuantized:
    """Quantize the rows of ``x`` ``[..., N, D]`` at ``bits`` per component, one float16 scale per ``group`` rows.

    Steps: ``y = x @ R`` (:func:`rotation`, when ``rotate``); per group of ``group`` consecutive rows (along N,
    independently for every leading index; the last group may be shorter) ``sigma`` = RMS of the group's
    components, stored as float16 (clamped to 65504); code ``q = clamp(floor(y / step) + L/2, 0, L-1)`` with
    ``L = 2**bits``, ``step = GAUSSIAN_STEP[bits] * sigma``.  ``bits = 0`` stores nothing (decodes to zeros:
    for a delta, "use the reference as is").  Error bound: a component inside the range
    ``|y| < (L/2) * step`` is off by at most ``step / 2`` (:func:`dequantize_groups`); outside it, by
    ``|y| - (L/2 - 1/2) * step``.  The rotation is orthogonal, so ``||x - x_hat|| = ||y - y_hat||``.
    """
    if not (isinstance(bits, int) and 0 <= bits <= 8):
        raise ValueError(f"bits must be an integer in 0..8, got {bits!r}")
    if group < 1:
        raise ValueError(f"group must be >= 1, got {group}")
    x = torch.as_tensor(x)
    if x.dim() < 2:
        raise ValueError(f"x must be [..., N, D], got shape {tuple(x.shape)}")
    shape = tuple(x.shape)
    if bits == 0 or x.numel() == 0:
        return GroupQuantized(torch.zeros(0, dtype=torch.uint8), torch.zeros(0, dtype=torch.float16), shape,
                              bits, group, rotate, seed)
    y = x.float()
    if rotate:
        y = y @ rotation(shape[-1], seed)
    sigma = _group_rms(y, group).clamp(max=_FP16_MAX).half()
    step = GAUSSIAN_STEP[bits] * sigma.float()  # the decoder's step: from the stored float16
    step_rows = step.repeat_interleave(group, dim=-1)[..., : shape[-2], None]
    levels = 1 << bits
    safe = torch.where(step_rows > 0, step_rows, torch.ones_like(step_rows))
    q = torch.floor(y / safe) + levels // 2
    q = torch.where(step_rows > 0, q, torch.full_like(q, levels // 2))
    return GroupQuantized(q.clamp(0, levels - 1).to(torch.uint8), sigma, shape, bits, group, rotate, seed)


def dequantize_groups(q: GroupQuantized) -> torch.Tensor:
    """Float32 reconstruction ``[..., N, D]`` of :func:`quantize_groups`' output."""
    if q.bits == 0 or q.num_components == 0:
        return torch.zeros(q.shape, dtype=torch.float32)
    levels = 1 << q.bits
    step = GAUSSIAN_STEP[q.bits] * q.scales.float()
    step_rows = step.repeat_interleave(q.group, dim=-1)[..., : q.shape[-2], None]
    y = (q.codes.float() - levels // 2 + 0.5) * step_rows
    if q.rotate:
        y = y @ rotation(q.shape[-1], q.seed).T
    return y
