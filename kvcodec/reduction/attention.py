"""Attention with per-atom masses, through transformers' attention-function interface.

A reduced cache holds *atoms* ``(k, v, beta)`` per KV head: ``beta`` is an additive log-weight on the atom's
logit, ``logit_j = scaling * <q, k_j> + beta_j`` (papers.md B.3, dot-product form).  A raw token has
``beta = 0``; an atom standing for ``rho`` tokens' worth of softmax mass has ``beta = log rho``.

transformers computes attention in a function chosen by ``config._attn_implementation``; a cache only returns
keys and values.  :func:`enable` registers a wrapper around the model's own implementation (eager, sdpa, ...)
under a new name and switches the model to it.  The wrapper delegates unchanged - same function, same
arguments, so the same bits - unless the keys it receives are exactly the tensor a :class:`ReducedLayer`
returned for this layer and call, in which case it adds that layer's ``beta`` (per KV head, repeated over the
query heads of its group) to the attention mask first.  The pairing is by tensor identity, so a stale bias can
never reach another call.

:func:`observe` records, while a model runs a prefill, what the query-aware reducers need: the last ``window``
post-RoPE queries of every layer and the attention each key received (summed over queries, H2O-style).
"""

from __future__ import annotations

import math
import sys
import threading
from contextlib import contextmanager

import torch

__all__ = ["enable", "enabled_name", "set_bias", "clear_bias", "float_mask", "observe", "Observation",
           "kernel_logmass",
           "scalings", "softmax_attention", "kernel_attention", "prefill_mode"]

_PREFIX = "kvcodec_reduce:"
_state = threading.local()


def _pending() -> dict:
    d = getattr(_state, "pending", None)
    if d is None:
        d = _state.pending = {}
    return d


def set_bias(layer_idx: int, keys: torch.Tensor, beta: torch.Tensor | None, scorer=None) -> None:
    """Attach ``beta`` ``[batch, kv_heads, entries]`` (None: all 0) to the key tensor layer ``layer_idx`` is about
    to return, marking it as a reduced layer's entries (one pending bias per layer: a bias nobody took is
    replaced, never accumulated).  ``scorer``: called as ``scorer(weights)`` with the largest attention weight
    ``[batch, kv_heads, entries]`` any query of the call gives each entry (over the query heads of the KV head's
    group, the log-weights and the mask applied): how a bounded layer learns what its queries read."""
    _pending()[layer_idx] = (keys, beta, scorer)


def clear_bias(layer_idx: int) -> None:
    _pending().pop(layer_idx, None)


def _take_bias(layer_idx, keys: torch.Tensor):
    """``(reduced, beta, scorer)``: whether ``keys`` are the entries a reduced layer returned for this call, their
    log-weights (None: all 0) and the layer's scorer (None: it keeps no scores)."""
    hit = _pending().get(layer_idx)
    if hit is None or hit[0] is not keys:
        return False, None, None
    del _pending()[layer_idx]
    return True, hit[1], hit[2]


def peak_weights(query, key, mask, scaling: float, chunk: int = 256) -> torch.Tensor:
    """``[b, kv_heads, kv]``: the largest attention weight any query of ``query`` ``[b, hq, q, d]`` (any of the
    query heads of a KV head's group) gives each key of ``key`` ``[b, kv_heads, kv, d]`` under the additive float
    ``mask`` (broadcastable to ``[b, hq, q, kv]``: the causal mask and the log-weights), float32, ``chunk``
    queries at a time."""
    b, hq, q, d = query.shape
    hk, n = key.shape[1], key.shape[2]
    g = hq // hk
    kf = key.detach().float()[:, :, None]  # [b, hk, 1, n, d]
    m = mask.float().expand(b, hq, q, n)
    out = torch.zeros(b, hk, n, device=query.device)
    for a in range(0, q, chunk):
        qa = query[:, :, a:a + chunk].detach().float()
        c = qa.shape[2]
        logits = scaling * qa.view(b, hk, g, c, d) @ kf.transpose(-1, -2) + m[:, :, a:a + c].reshape(b, hk, g, c, n)
        out = torch.maximum(out, torch.softmax(logits, -1).amax(dim=(2, 3)))
    return out


def float_mask(mask, q_len: int, kv_len: int, dtype, device) -> torch.Tensor:
    """The additive float form of a transformers attention mask (``None`` = causal with the queries last)."""
    if mask is None:
        if q_len == 1:
            return torch.zeros(1, 1, 1, kv_len, dtype=dtype, device=device)
        qi = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
        allowed = torch.arange(kv_len, device=device)[None, :] <= qi
        mask = allowed[None, None]
    if mask.dtype == torch.bool:
        return torch.where(mask, torch.zeros((), dtype=dtype, device=device),
                           torch.full((), torch.finfo(dtype).min, dtype=dtype, device=device))
    return mask.to(dtype)


def _visible(mask: torch.Tensor, q_len: int, kv_len: int) -> torch.Tensor:
    """``mask`` as wide as the layer's ``kv_len`` entries: one built for another layer's entries (budgets spread
    over the layers) keeps only its last ``q_len`` columns (the new tokens'), every stored entry before them
    visible to every new query (spec section 14)."""
    if mask.shape[-1] == kv_len:
        return mask
    past = torch.zeros(*mask.shape[:-1], kv_len - q_len, dtype=mask.dtype, device=mask.device)
    return torch.cat([past, mask[..., -q_len:]], -1)


def _module_eager(module):
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise RuntimeError(f"{type(module).__module__} has no eager_attention_forward to delegate to")
    return fn


def _wrapper(original: str):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        fn = _module_eager(module) if original == "eager" else ALL_ATTENTION_FUNCTIONS[original]
        obs = getattr(_state, "observer", None)
        if obs is not None:
            obs.record(module, query, key, kwargs.get("scaling"))
        reduced, beta, scorer = _take_bias(getattr(module, "layer_idx", None), key)
        fitter = getattr(_state, "fitter", None)
        if fitter is not None and reduced:  # fit="policy": the layer's entries refitted to these queries first
            value, beta = fitter(module, query, key, value, beta)
        mode = getattr(_state, "prefill", None)
        if mode is not None and beta is None and query.shape[2] == key.shape[2] > mode[0].sinks + mode[0].block:
            plan, handler = mode
            return handler(fn, plan, module, query, key, value, attention_mask, args, kwargs)
        b, hq, q_len, _ = query.shape
        kv_len = key.shape[-2]
        if beta is not None or (reduced and attention_mask is not None and attention_mask.shape[-1] != kv_len):
            mask = _visible(float_mask(attention_mask, q_len, kv_len, query.dtype, query.device), q_len, kv_len)
            if beta is not None:
                groups = hq // beta.shape[1]
                mask = mask + beta.to(query.dtype).repeat_interleave(groups, dim=1)[:, :, None, :]  # [b, hq, 1, kv]
            attention_mask = mask
        if scorer is not None:  # a bounded layer: what this call's queries read of its entries
            scaling = kwargs.get("scaling")
            scaling = getattr(module, "scaling", 1.0 / math.sqrt(query.shape[-1])) if scaling is None else scaling
            mask = _visible(float_mask(attention_mask, q_len, kv_len, torch.float32, query.device), q_len, kv_len)
            scorer(peak_weights(query, key, mask, float(scaling)))
        return fn(module, query, key, value, attention_mask, *args, **kwargs)

    attention.kvcodec_original = original
    return attention


def enabled_name(model) -> str | None:
    """The mass-aware attention implementation ``model`` (or a model config) runs, or None."""
    impl = getattr(getattr(model, "config", model), "_attn_implementation", None)
    return impl if isinstance(impl, str) and impl.startswith(_PREFIX) else None


def enable(model) -> str:
    """Switch ``model`` to the mass-aware wrapper of its current attention implementation (idempotent).

    Models whose attention does not go through transformers' attention interface are refused with a
    :class:`~kvcodec.errors.UnsupportedCache` naming the model class."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    from ..errors import UnsupportedCache

    name = enabled_name(model)
    if name is not None:
        return name
    original = getattr(model.config, "_attn_implementation", None) or "eager"
    if original != "eager" and original not in ALL_ATTENTION_FUNCTIONS._global_mapping:
        raise UnsupportedCache(f"attention implementation {original!r} of {type(model).__name__} cannot carry "
                               "atom masses; load the model with attn_implementation='eager' or 'sdpa'")
    if not getattr(model, "_can_set_attn_implementation", lambda: True)():
        raise UnsupportedCache(f"{type(model).__name__} does not use transformers' attention interface, so a "
                               "reduced cache cannot add its atom masses")
    name = _PREFIX + original
    if name not in ALL_ATTENTION_FUNCTIONS._global_mapping:
        AttentionInterface.register(name, _wrapper(original))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[original])
    model.set_attn_implementation(name)
    if enabled_name(model) != name:
        raise UnsupportedCache(f"{type(model).__name__} refused attention implementation {name!r}")
    return name


def scalings(model) -> dict[int, float]:
    """``layer_idx -> scaling`` of the model's attention modules (the factor on ``<q, k>``)."""
    out = {}
    for m in model.modules():
        li, s = getattr(m, "layer_idx", None), getattr(m, "scaling", None)
        if isinstance(li, int) and isinstance(s, (int, float)):
            out.setdefault(li, float(s))
    return out


def kernel_logmass(keys: torch.Tensor, beta: torch.Tensor, scaling: float) -> torch.Tensor:
    """log of the Gaussian-kernel mass of each atom: ``beta + scaling * |k|^2 / 2`` (float64)."""
    k = keys.double()
    return beta.double() + 0.5 * scaling * (k * k).sum(-1)


def softmax_attention(q, keys, values, beta, scaling):
    """Reference dot-product attention with log-weights (float64): q ``[..., s, d]``, keys ``[..., n, d]``."""
    logits = scaling * q.double() @ keys.double().transpose(-1, -2) + beta.double()[..., None, :]
    return torch.softmax(logits, -1) @ values.double()


def kernel_attention(q, keys, values, logmass, scaling):
    """Att(q | P) of papers.md B.1 with the Gaussian kernel exp(-scaling |q - k|^2 / 2) and masses exp(logmass)."""
    d2 = ((q.double()[..., :, None, :] - keys.double()[..., None, :, :]) ** 2).sum(-1)
    w = torch.softmax(-0.5 * scaling * d2 + logmass.double()[..., None, :], -1)
    return w @ values.double()


class Observation:
    """What :func:`observe` recorded per layer: ``queries[l]`` ``[b, q_heads, window, d]`` (post-RoPE, the
    last ``window`` positions), ``last[l]`` ``[b, q_heads, keys]`` (the attention weights of the call's last
    query over every key it saw, the call's own included), ``received[l]`` ``[b, kv_heads, n]`` (attention
    each key received, summed over the queries that could see it and averaged over a KV head's query heads),
    ``seen[l]`` ``[n]`` (how many queries could see each key), ``scaling[l]`` and, with ``peak``,
    ``peak[l]`` ``[b, kv_heads, end - start]``: the largest attention weight any query of the call gave each
    key ``start .. end - 1`` of those already in the cache (``peak_keys``; default all of them), over the query
    heads of the KV head's group (KVzip's score when the call replays the cache's own tokens); layers that do
    not hold those keys (sliding windows) are skipped.  With ``stride`` (> 0), ``reference[l]``
    ``[b, q_heads, ceil(s / stride), d]``: every ``stride``-th query of the call (post-RoPE), the reference
    queries ``kvzip``'s ``fit`` matches attention on."""

    def __init__(self, window: int, received: bool = True, chunk: int = 256, peak: bool = False, stride: int = 0):
        self.window, self.chunk, self.want_received, self.want_peak = window, chunk, received, peak
        self.queries, self.received, self.seen, self.scaling, self.peak, self.last = {}, {}, {}, {}, {}, {}
        self.reference, self.stride = {}, stride
        self.peak_keys: tuple[int, int] | None = None

    @torch.no_grad()
    def record(self, module, query, key, scaling):
        li = getattr(module, "layer_idx", None)
        if li is None:
            return
        if scaling is None:
            scaling = getattr(module, "scaling", 1.0 / math.sqrt(query.shape[-1]))
        b, hq, s, d = query.shape
        hk, n = key.shape[1], key.shape[-2]
        g = hq // hk
        self.scaling[li] = float(scaling)
        self.queries[li] = query[:, :, -self.window:].detach().float().clone()
        if self.stride:
            self.reference[li] = query[:, :, ::self.stride].detach().float().clone()
        q_last = query[:, :, -1:].detach().float().view(b, hk, g, 1, d)
        logits = float(scaling) * q_last @ key.detach().float()[:, :, None].transpose(-1, -2)
        self.last[li] = torch.softmax(logits, -1).reshape(b, hq, n)  # the last query sees every key
        if self.want_peak:
            self._record_peak(li, query, key, float(scaling))
        if not self.want_received:
            return
        acc = torch.zeros(b, hk, g, n, device=query.device)
        for w in self._weights(query, key, float(scaling)):
            acc += w.sum(3)
        self.received[li] = acc.mean(2)
        self.seen[li] = (s - torch.clamp(torch.arange(n) - (n - s), min=0)).clamp(min=1).float()

    def _weights(self, query, key, scaling):
        """The causal attention weights of ``query``'s positions (the last of ``key``'s) over ``key``,
        ``self.chunk`` queries at a time: yields ``[b, kv_heads, group, chunk, n]``, each query head of a group
        against its KV head's keys (float32)."""
        b, hq, s, d = query.shape
        hk, n = key.shape[1], key.shape[-2]
        dev = query.device
        kf = key.detach().float()[:, :, None]  # [b, hk, 1, n, d]
        for a in range(0, s, self.chunk):
            qa = query[:, :, a:a + self.chunk].detach().float()
            qa = qa.view(b, hk, hq // hk, qa.shape[2], d)
            logits = scaling * qa @ kf.transpose(-1, -2)  # [b, hk, g, c, n]
            qi = torch.arange(a, a + qa.shape[3], device=dev)[:, None] + n - s
            yield torch.softmax(logits.masked_fill(torch.arange(n, device=dev)[None, :] > qi, float("-inf")), -1)

    @torch.no_grad()
    def _record_peak(self, li, query, key, scaling):
        b, hq, s, _ = query.shape
        hk, n = key.shape[1], key.shape[-2]
        past = n - s
        start, end = self.peak_keys or (0, past)
        if end > past:  # a layer that does not hold the keys scored (a sliding window)
            return
        peak = torch.zeros(b, hk, hq // hk, end - start, device=query.device)
        for w in self._weights(query, key, scaling):  # the past keys, then the call's own
            peak = torch.maximum(peak, w[..., start:end].amax(3))
        self.peak[li] = peak.amax(2)


@contextmanager
def prefill_mode(plan, handler):
    """Inside the block, a fresh prefill (queries and keys of the same positions) is computed by
    ``handler(fn, plan, module, query, key, value, mask, args, kwargs)`` (:mod:`kvcodec.reduction.scan`)."""
    prev = getattr(_state, "prefill", None)
    _state.prefill = (plan, handler)
    try:
        yield
    finally:
        _state.prefill = prev


@contextmanager
def fitting(fitter):
    """Inside the block, a reduced layer's attention first calls ``fitter(module, query, key, value, beta)``,
    which returns the ``(value, beta)`` attention then uses (``reduce(fit="policy")``)."""
    prev = getattr(_state, "fitter", None)
    _state.fitter = fitter
    try:
        yield
    finally:
        _state.fitter = prev


@contextmanager
def observe(model, window: int = 64, received: bool = True, peak: bool = False, stride: int = 0):
    """Record queries (and, with ``received``, the attention each key received; with ``peak``, the largest
    attention each key already in the cache receives; with ``stride``, every ``stride``-th query) of every
    layer while ``model`` runs inside the block."""
    enable(model)
    obs = Observation(window, received, peak=peak, stride=stride)
    prev = getattr(_state, "observer", None)
    _state.observer = obs
    try:
        yield obs
    finally:
        _state.observer = prev
