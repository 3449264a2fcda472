"""Prefill under causal merge-reduce (papers.md B.3, "Prefill: causal merge-reduce with a Blelloch scan").

The prompt after the ``sinks`` first tokens is cut into blocks of ``B`` tokens.  Each block's queries attend to
the raw sinks, the *exclusive prefix summary* ``E_b`` (at most ``K`` atoms summarising every earlier block) and
their own block's raw tokens under the causal mask, so a query costs ``O(sinks + K + B)`` instead of ``O(n)``.
The summaries come from the scan's tree over the blocks: a node's summary is ``REDUCE(MERGE(left, right), K)``;
the left child inherits its parent's prefix, the right child gets ``REDUCE(MERGE(parent prefix, left), K)``.
The blocks (padded to a power of two with zero-mass atoms) are the leaves of :mod:`kvcodec.reduction.tree`'s
up-sweep and down-sweep, one batched reducer call per tree level.  Attention itself is the model's own function,
called once for all blocks (blocks stacked in the batch dimension) with the atoms' log-weights in the mask, so
model-specific details (soft-capping, scaling) are kept.
"""

from __future__ import annotations

import torch

from . import attention, reducers, tree
from .cache import Plan, ReducedCache, seed_of

__all__ = ["prefill", "merge_reduce_attention"]


def merge_reduce_attention(fn, plan: Plan, module, query, key, value, attention_mask, args, kwargs):
    """The attention output of a fresh prefill (``query`` and ``key`` cover the same positions) computed over
    ``[sinks ; E_b atoms ; block b]`` for every block at once; same return form as ``fn``."""
    b, hq, n, dq = query.shape
    hk = key.shape[1]
    s, bs = min(plan.sinks, n), plan.block
    layer = getattr(module, "layer_idx", 0)
    scaling = kwargs.get("scaling", getattr(module, "scaling", dq ** -0.5))
    fn_reduce = reducers.REDUCERS[plan.method]
    rest = n - s
    nb = -(-rest // bs)
    size = 1 << max(0, (nb - 1).bit_length())  # leaves padded to a power of two for the scan
    kr, vr = key[:, :, s:], value[:, :, s:]
    padn = size * bs - rest
    if padn:
        kr = torch.cat([kr, kr.new_zeros(b, hk, padn, kr.shape[-1])], 2)
        vr = torch.cat([vr, vr.new_zeros(b, hk, padn, vr.shape[-1])], 2)
    leaves = tree.leaves_of(kr, vr, bs)
    valid = torch.arange(size * bs) < rest  # real tokens among the padded blocks
    leaves = (leaves[0], leaves[1], torch.where(valid.reshape(size, 1, 1, bs), 0.0, tree.PAD_BETA)
              .expand(size, b, hk, bs).contiguous())

    def seed(*where):
        return seed_of(plan.seed, "prefill", layer, *where)

    # causal: no query of the prompt may weigh the summaries, so the "query" form tilts at the zero query
    anchor = None if plan.form == "kernel" else torch.zeros(b, hk, key.shape[-1])
    levels = tree.upsweep(fn_reduce, plan.k, scaling, leaves, seed, anchor)
    pre = tree.exclusive_prefixes(fn_reduce, plan.k, scaling, levels, seed, anchor)  # [size, b, hk, K, d]
    # per block: keys [sinks ; E_b ; own block], block-major in the batch dimension
    kk = torch.cat([key[:, :, :s].expand(size, -1, -1, -1, -1) if s else pre[0][..., :0, :],
                    pre[0].to(key.dtype), leaves[0]], -2)
    vv = torch.cat([value[:, :, :s].expand(size, -1, -1, -1, -1) if s else pre[1][..., :0, :],
                    pre[1].to(value.dtype), leaves[1]], -2)
    kv_len = kk.shape[-2]
    beta = torch.cat([torch.zeros(size, b, hk, s), pre[2], leaves[2]], -1)  # [size, b, hk, kv]
    causal = torch.arange(bs)[None, :] <= torch.arange(bs)[:, None]  # [q, own keys]
    allowed = torch.cat([torch.ones(bs, s + plan.k, dtype=torch.bool), causal], 1)  # [bs, kv]
    dt = query.dtype
    mask = torch.where(allowed, torch.zeros((), dtype=dt), torch.full((), torch.finfo(dt).min, dtype=dt))
    groups = hq // hk
    mask = mask[None, None, None] + beta.to(dt).repeat_interleave(groups, dim=2)[:, :, :, None, :]
    qr = query[:, :, s:]
    if padn:
        qr = torch.cat([qr, qr.new_zeros(b, hq, padn, dq)], 2)
    qb = qr.reshape(b, hq, size, bs, dq).permute(2, 0, 1, 3, 4).reshape(size * b, hq, bs, dq)
    out = fn(module, qb.contiguous(), kk.reshape(size * b, hk, kv_len, -1).contiguous(),
             vv.reshape(size * b, hk, kv_len, -1).contiguous(), mask.reshape(size * b, hq, bs, kv_len).to(query.device),
             *args, **kwargs)[0]  # [size * b, bs, hq, dv]
    out = out.reshape(size, b, bs, hq, -1).permute(1, 0, 2, 3, 4).reshape(b, size * bs, hq, -1)[:, :rest]
    if s:
        head = _causal(fn, module, query[:, :, :s], key[:, :, :s], value[:, :, :s], args, kwargs)
        out = torch.cat([head, out], 1)
    return out, None


def _causal(fn, module, q, k, v, args, kwargs):
    """``fn`` on queries that are the last ``q_len`` positions of ``k``, under the causal mask."""
    mask = attention.float_mask(None, q.shape[2], k.shape[2], q.dtype, q.device)
    return fn(module, q.contiguous(), k.contiguous(), v.contiguous(), mask, *args, **kwargs)[0]


@torch.no_grad()
def prefill(model, ids, keep: float | None = 0.1, method: str = "cluster", *, budget: int | None = None,
            sinks: int = 4, seed: int = 0, form: str = "dot", **model_kwargs):
    """Run ``model`` on ``ids`` ``[batch, n]`` with merge-reduce attention and return ``(cache, output)``: the
    :class:`ReducedCache` (the summary of all ``n`` tokens, ready for more tokens or ``generate``) and the model's
    output (its logits computed under the reduced attention)."""
    from . import plan_for

    ids = torch.as_tensor(ids)
    if ids.dim() == 1:
        ids = ids[None]
    if method not in reducers.REDUCERS:
        raise ValueError(f"merge-reduce prefill needs a reducer ({', '.join(reducers.REDUCERS)}), got {method!r}")
    k, _, _ = plan_for(int(ids.shape[1]), keep, budget=budget, sinks=sinks)
    plan = Plan(k=k, block=k, sinks=sinks, method=method, seed=seed, form=form)
    cache = ReducedCache(model, plan)
    from ..tokens.plan import cache_kwarg

    with attention.prefill_mode(plan, merge_reduce_attention):
        out = model(ids, **{cache_kwarg(model): cache}, **model_kwargs)
    return cache, out
