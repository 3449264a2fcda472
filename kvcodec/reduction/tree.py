"""Merge-reduce trees over blocks, one batched reducer call per tree level.

Summaries here are stacked: ``(keys, values, beta)`` with keys ``[nodes, batch, heads, K, d]``.  Every node of
a tree level is reduced in one reducer call (nodes and batch folded into the reducer's batch dimension), so a
tree over ``m`` blocks costs ``O(log m)`` calls - the parallel form of the scan (Blelloch's up-sweep and
down-sweep).  Summaries shorter than ``K`` are padded with zero-mass atoms (key and value 0, ``beta`` =
:data:`PAD_BETA`): they carry no attention (``exp(PAD_BETA)`` underflows to 0 next to any real atom), are never
drawn by the sampling reducer while a real atom exists, and add no mass to a cluster.
"""

from __future__ import annotations

import torch

__all__ = ["PAD_BETA", "pad", "reduce_nodes", "upsweep", "exclusive_prefixes", "binary_counter", "leaves_of"]

#: log-weight of a padding atom (zero mass)
PAD_BETA = -1.0e4


def pad(summary, k: int):
    """Pad stacked summaries to ``k`` atoms with zero-mass atoms."""
    keys, values, beta = summary
    n = keys.shape[-2]
    if n >= k:
        return summary
    shape = list(keys.shape)
    shape[-2] = k - n
    zk = keys.new_zeros(shape)
    shape[-1] = values.shape[-1]
    zv = values.new_zeros(shape)
    zb = torch.full(beta.shape[:-1] + (k - n,), PAD_BETA, dtype=beta.dtype)
    return torch.cat([keys, zk], -2), torch.cat([values, zv], -2), torch.cat([beta, zb], -1)


def reduce_nodes(fn, k: int, scaling: float, summary, gen: torch.Generator, anchor=None):
    """Apply reducer ``fn`` to every node of stacked summaries ``[nodes, batch, heads, n, d]`` (``anchor``
    ``[batch, heads, d]`` or ``None``, the same for every node)."""
    keys, values, beta = summary
    nodes, b, h, n, dk = keys.shape
    flat = (keys.reshape(nodes * b, h, n, dk), values.reshape(nodes * b, h, n, values.shape[-1]),
            beta.reshape(nodes * b, h, n))
    if anchor is not None:
        anchor = anchor.expand(nodes, *anchor.shape).reshape(nodes * b, h, -1)
    ok, ov, ob = fn(flat, k, scaling, gen, anchor=anchor)
    m = ok.shape[2]
    return ok.reshape(nodes, b, h, m, dk), ov.reshape(nodes, b, h, m, values.shape[-1]), ob.reshape(nodes, b, h, m)


def _pairs(summary, count: int):
    """MERGE of nodes (2i, 2i+1) for i < count."""
    return tuple(torch.cat([t[0:2 * count:2], t[1:2 * count:2]], dim=-2 if t.dim() == 5 else -1)
                 for t in summary)


def upsweep(fn, k: int, scaling: float, leaves, seed_of, anchor=None):
    """Levels of the tree over ``leaves`` (each padded to ``k`` atoms): ``levels[0] = leaves``, level ``l + 1``
    node ``i`` = REDUCE(MERGE(level l nodes 2i, 2i+1), k); a level with an odd count leaves its last node
    unpaired.  ``seed_of(level)`` seeds each level's call."""
    if leaves[0].shape[-2] > k:
        leaves = reduce_nodes(fn, k, scaling, leaves, torch.Generator().manual_seed(seed_of("leaf", 0)), anchor)
    levels = [pad(leaves, k)]
    while levels[-1][0].shape[0] >= 2:
        count = levels[-1][0].shape[0] // 2
        merged = _pairs(levels[-1], count)
        gen = torch.Generator().manual_seed(seed_of("up", len(levels)))
        levels.append(reduce_nodes(fn, k, scaling, merged, gen, anchor))
    return levels


def exclusive_prefixes(fn, k: int, scaling: float, levels, seed_of, anchor=None):
    """Down-sweep: the summary of all blocks before each leaf, ``[leaves, ...]`` (leaf 0's is all padding), for
    a tree whose leaf count is a power of two.  The left child inherits its parent's prefix; the right child
    gets REDUCE(MERGE(parent prefix, left sibling), k), or the left sibling itself when the parent has no
    prefix (the tree's left spine)."""
    top = len(levels) - 1
    if levels[top][0].shape[0] != 1:
        raise ValueError("exclusive_prefixes needs a power-of-two number of leaves")
    pre = pad(tuple(t[:1, ..., :0, :] if t.dim() == 5 else t[:1, ..., :0] for t in levels[0]), k)
    for lvl in range(top, 0, -1):
        nodes = pre[0].shape[0]
        left = tuple(t[0::2] for t in levels[lvl - 1])
        right_pre = [t.clone() for t in left]  # node 0: its left child's summary itself
        if nodes > 1:
            merged = tuple(torch.cat([p[1:], lt[1:]], dim=-2 if p.dim() == 5 else -1) for p, lt in zip(pre, left))
            gen = torch.Generator().manual_seed(seed_of("down", lvl))
            red = reduce_nodes(fn, k, scaling, merged, gen, anchor)
            for t, r in zip(right_pre, red):
                t[1:] = r
        # interleave: child 2i <- pre[i], child 2i+1 <- right_pre[i]
        pre = tuple(torch.stack([p, r], 1).reshape(2 * nodes, *p.shape[1:]) for p, r in zip(pre, right_pre))
    return pre


def binary_counter(fn, k: int, scaling: float, leaves, seed_of, anchor=None):
    """The buckets a binary counter holds after taking ``m`` leaves in order: ``{level: summary}`` for each set
    bit of ``m``; the bucket at level ``l`` summarises ``2**l`` consecutive leaves (the last complete node of
    level ``l`` of the tree).  Summaries are ``[1, batch, heads, k, d]``."""
    m = leaves[0].shape[0]
    levels = upsweep(fn, k, scaling, leaves, seed_of, anchor)
    out = {}
    for lvl, summ in enumerate(levels):
        count = m >> lvl
        if count & 1:
            out[lvl] = tuple(t[count - 1:count] for t in summ)
    return out


def leaves_of(keys, values, block: int):
    """Blocks of ``block`` tokens of ``[batch, heads, n, d]`` tensors (``n`` a multiple of ``block``) as stacked
    leaves ``[n / block, batch, heads, block, d]`` with zero log-weights."""
    b, h, n, d = keys.shape
    m = n // block
    lk = keys[:, :, : m * block].reshape(b, h, m, block, d).permute(2, 0, 1, 3, 4)
    lv = values[:, :, : m * block].reshape(b, h, m, block, values.shape[-1]).permute(2, 0, 1, 3, 4)
    return lk, lv, torch.zeros(m, b, h, block)

