"""Local reducers: bring a summary of ``N`` atoms down to ``K`` (papers.md B.3).

A summary is ``(keys, values, beta)`` with keys ``[b, h, N, dk]``, values ``[b, h, N, dv]`` and log-weights
``beta`` ``[b, h, N]`` (float32): ``beta`` adds to the atom's attention logit.  Its *kernel* log-mass
(B.1) is ``l = beta + scaling * |k|^2 / 2``: with it, softmax attention over the atoms equals attention under
the Gaussian kernel ``exp(-scaling |q - k|^2 / 2)`` with masses ``exp(l)``, and masses of disjoint spans add.

Reducers (every head reduced independently; randomness from one ``torch.Generator`` per call, seeded by the
caller from (seed, layer, block, level), so a reduction is reproducible):

- :func:`sample` - ``K`` i.i.d. draws with probability proportional to kernel mass, each carrying ``M / K``
  (unbiased: E[Q] = S).  Duplicate draws stay separate atoms (same attention as one atom with their summed
  mass, same shapes for every head).
- :func:`cluster` - protected clustering: weighted k-means (5 Lloyd iterations) of the atoms on
  standardised ``[k; v]``; a cluster becomes one atom with the summed kernel mass and the mass-weighted mean
  key and value.  The mass-weighted means of ``k`` and ``v`` (any feature linear in them, such as ``Phi = v``)
  and the total mass are preserved exactly, whatever the clustering.
"""

from __future__ import annotations

import math

import torch

from .attention import kernel_logmass

__all__ = ["REDUCERS", "sample", "cluster", "merge", "logmass", "beta_of"]


def merge(*summaries):
    """MERGE: concatenate atom lists."""
    parts = [s for s in summaries if s is not None]
    return tuple(torch.cat([p[i] for p in parts], dim=2) for i in range(3))


def logmass(keys, beta, scaling: float, anchor=None):
    """log of each atom's mass (float64): with ``anchor`` ``None`` the Gaussian-kernel mass
    ``beta + scaling |k|^2 / 2``; with an anchor query ``a`` ``[b, h, d]`` the mass seen from ``a``,
    ``beta + scaling <a, k>`` (the exponential tilt at ``a``; ``a = 0`` gives the token counts)."""
    if anchor is None:
        return kernel_logmass(keys, beta, scaling)
    return beta.double() + scaling * (keys.double() @ anchor.double()[..., :, None])[..., 0]


def beta_of(keys, lm, scaling: float, anchor=None):
    """The log-weight that gives an atom at ``keys`` the log-mass ``lm`` (inverse of :func:`logmass`)."""
    return (lm - logmass(keys, torch.zeros(keys.shape[:-1], dtype=torch.float64), scaling, anchor)).float()


def sample(summary, k: int, scaling: float, gen: torch.Generator, anchor=None):
    keys, values, beta = summary
    b, h, n, _ = keys.shape
    if n <= k:
        return summary
    lm = logmass(keys, beta, scaling, anchor)  # [b, h, n] float64
    total = torch.logsumexp(lm, -1)  # log M
    p = torch.softmax(lm, -1).reshape(b * h, n).float()
    idx = torch.multinomial(p, k, replacement=True, generator=gen).reshape(b, h, k)
    idx_sorted, _ = idx.sort(-1)
    kk = keys.gather(2, idx_sorted[..., None].expand(-1, -1, -1, keys.shape[-1]))
    vv = values.gather(2, idx_sorted[..., None].expand(-1, -1, -1, values.shape[-1]))
    # new mass M / K per draw
    new_lm = (total - math.log(k))[..., None].expand(-1, -1, k)
    return kk, vv, beta_of(kk, new_lm, scaling, anchor)


def cluster(summary, k: int, scaling: float, gen: torch.Generator, anchor=None, iters: int = 5):
    keys, values, beta = summary
    b, h, n, dk = keys.shape
    if n <= k:
        return summary
    lm = logmass(keys, beta, scaling, anchor)  # float64 [b, h, n]
    w = torch.softmax(lm, -1)  # normalised masses within the summary
    kf, vf = keys.double(), values.double()
    feats = torch.cat([kf, vf], -1)
    mu = (w[..., None] * feats).sum(2, keepdim=True)
    var = (w[..., None] * (feats - mu) ** 2).sum(2, keepdim=True)
    scale = torch.cat([var[..., :dk].sum(-1, keepdim=True).expand(-1, -1, -1, dk),
                       var[..., dk:].sum(-1, keepdim=True).expand(-1, -1, -1, feats.shape[-1] - dk)], -1)
    z = feats / scale.clamp_min(1e-30).sqrt()
    # initial centres: k distinct atoms drawn by mass (without replacement), then weighted Lloyd iterations
    p = (w.reshape(b * h, n).float() + 1e-12)
    init = torch.multinomial(p, k, replacement=False, generator=gen).reshape(b, h, k)
    cen = z.gather(2, init[..., None].expand(-1, -1, -1, z.shape[-1]))
    for _ in range(iters):
        d2 = torch.cdist(z, cen)  # [b, h, n, k]
        assign = d2.argmin(-1)
        onehot = torch.zeros(b, h, n, k, dtype=torch.float64).scatter_(-1, assign[..., None], 1.0)
        wsum = (w[..., None] * onehot).sum(2)  # [b, h, k]
        new = (onehot * w[..., None]).transpose(-1, -2) @ z / wsum.clamp_min(1e-300)[..., None]
        cen = torch.where(wsum[..., None] > 0, new, cen)  # an empty cluster keeps its centre
    assign = torch.cdist(z, cen).argmin(-1)
    onehot = torch.zeros(b, h, n, k, dtype=torch.float64).scatter_(-1, assign[..., None], 1.0)
    # cluster masses in log space: log sum over members of exp(lm)
    top = lm.max(-1, keepdim=True).values
    mass = (onehot * torch.exp(lm - top)[..., None]).sum(2)  # [b, h, k], relative to exp(top)
    used = mass > 0
    wk = onehot * torch.exp(lm - top)[..., None] / mass.clamp_min(1e-300)[:, :, None, :]  # member weights
    kk = wk.transpose(-1, -2) @ kf
    vv = wk.transpose(-1, -2) @ vf
    clm = torch.log(mass.clamp_min(1e-300)) + top
    kk, vv = kk.to(keys.dtype), vv.to(values.dtype)
    nb = beta_of(kk, clm, scaling, anchor)
    # an empty cluster becomes a zero-mass atom (beta = -inf would poison max-subtraction; use a large negative)
    nb = torch.where(used, nb, torch.full_like(nb, -1e4))
    return kk, vv, nb


REDUCERS = {"sample": sample, "cluster": cluster}
