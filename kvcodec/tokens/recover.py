"""Recover the token ids of a cache from its first attention layer's values.

The values a model's first decoder layer writes to the cache depend only on the tokens up to that layer's
attention: the embedding (scaled or not), the input normalisation and the value projection (separate,
fused with q and k, compressed as in MLA, normalised as in some families).  kvcodec does not re-implement
any of that: it runs the model's own code and stops it at the first cache write (:class:`_Stop`), so every
layout transformers implements is handled by the model's code.  Two cases:

* **position-free** (rotary, ALiBi, NoPE - Llama, Qwen, Gemma, Phi-3, GPT-NeoX, Falcon, DeepSeek-V3 ...):
  the value of a token is the same at every position, so one table of the value of every vocabulary entry
  (each run alone, at position 0) identifies each cached token by its nearest row.  Measured on SmolLM2:
  512 of 512 tokens exact; 11 of 49,152 rows duplicate another (such tokens have identical KV everywhere,
  so either choice regenerates the same cache).
* **absolute positions added to the embedding** (GPT-2, OPT): the value is ``W_v N(e_t + w_p) + b_v``
  with ``N`` a LayerNorm (pre-LN) or nothing (post-LN OPT-350m).  The position's contribution is known, so
  each candidate is scored in value space without any inverse: with a LayerNorm, ``v − b_v − W_v β`` is
  ``A (x − μ1)/σ`` (``A = W_v diag(γ)``, ``x = e_t + w_p``), so the right token is the one whose ``A x`` and
  ``A 1`` span it; without a norm, ``v − b_v − W_v w_p`` is ``W_v e_t``.  Two matrix products per position
  chunk against a precomputed ``[vocab, H·D]`` table; no per-candidate forward.  This needs the family's
  module names (:func:`_absolute_layout`).

Verification is part of recovery: the recovered sequence is run through the same first layer (the model's
code again, every position in context) and must reproduce the cache's values within ``tolerance``, and
every position's match must be clearly better than the runner-up; otherwise recovery reports failure (a
quantized, pruned or foreign cache, or a first layer that mixes context) instead of guessing.  The token
tiers then regenerate the whole cache from the ids and compare it bit for bit, so a wrong id can never
produce a wrong file.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from ..identity import vocab_size
from .plan import cache_kwarg


@dataclass
class RecoveredTokens:
    tokens: torch.Tensor | None  # [batch, seq] int64, None when recovery failed
    ok: bool
    reason: str
    max_relative_distance: float  # worst distance of the re-run first layer from the cache, / value norm
    min_relative_margin: float  # worst (runner-up - best) match score, over distinct candidates
    method: str = "table"  # "table" (position-free first layer) or "absolute" (positions removed by inversion)


class _Stop(Exception):
    """Raised by :class:`_capture_cache`'s ``update`` at the first write of the watched layer."""


def _capture_cache(model, layer: int):
    from transformers.cache_utils import DynamicCache

    class Capture(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            if layer_idx == layer:
                raise _Stop(key_states, value_states)
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    try:
        return Capture(config=model.config)
    except Exception:  # a config DynamicCache cannot read: plain layers are enough to reach the first write
        return Capture()


PARTS = ("values", "keys")


@torch.no_grad()
def first_layer_values(model, ids: torch.Tensor, layer: int = 0, part: str = "values") -> torch.Tensor:
    """The values (or keys) ``[batch, kv_heads, seq, dim]`` the model writes to cache layer ``layer`` when it
    runs on ``ids [batch, seq]`` from position 0, computed by the model's own code and stopped there."""
    dev = next(model.parameters()).device
    try:
        model(ids.to(dev), use_cache=True, **{cache_kwarg(model): _capture_cache(model, layer)})
    except _Stop as stop:
        return stop.args[PARTS.index(part) ^ 1]  # args are (keys, values)
    raise ConfigError(f"token recovery: {type(model).__name__} ran without writing layer {layer} of its cache")


@torch.no_grad()
def layer0_value_table(model, layer: int = 0, part: str = "values", batch: int = 2048) -> torch.Tensor:
    """``[vocab, kv_heads * dim]``: the value (or key) the model writes to cache layer ``layer`` for every
    vocabulary entry run alone at position 0, in the model's dtype."""
    vocab = vocab_size(model)
    rows = []
    for a in range(0, vocab, batch):
        v = first_layer_values(model, torch.arange(a, min(vocab, a + batch))[:, None], layer, part)
        rows.append(v[:, :, 0, :].reshape(v.shape[0], -1).cpu())
    return torch.cat(rows)


@torch.no_grad()
def position_free_part(model, layer: int = 0, probe: int = 8) -> str | None:
    """``"values"`` when the first layer's values of a token do not depend on its position or context (most
    models), ``"keys"`` when its keys do not (MLA as transformers caches it: the keys slot holds the latent,
    the values slot the rotary part), None when neither: probed on ``probe`` tokens run in one sequence and
    each alone at position 0, by the model's own code."""
    vocab = vocab_size(model)
    ids = (torch.arange(probe) * 7919 + 11) % vocab
    for part in PARTS:
        seq = first_layer_values(model, ids[None], layer, part)[0].transpose(0, 1).reshape(probe, -1).double()
        alone = first_layer_values(model, ids[:, None], layer, part)[:, :, 0].reshape(probe, -1).double()
        if float(((seq - alone).norm(dim=1) / alone.norm(dim=1).clamp_min(1e-30)).max()) <= 2e-2:
            return part
    return None


def _unique_rows(table: torch.Tensor):
    """Distinct rows, and for each the smallest token id having it."""
    uniq, inverse = torch.unique(table, dim=0, return_inverse=True)
    rep = torch.full((uniq.shape[0],), table.shape[0], dtype=torch.long)
    rep = rep.scatter_reduce(0, inverse, torch.arange(table.shape[0]), reduce="amin")
    return uniq, rep


def _flat(values: torch.Tensor) -> torch.Tensor:
    """``[B, H, S, D]`` -> ``[B*S, H*D]`` float64 (heads side by side, as the projection writes them)."""
    b, h, s, d = values.shape
    return values.permute(0, 2, 1, 3).reshape(b * s, h * d).double()


def _nearest(vals: torch.Tensor, tab: torch.Tensor, chunk: int = 512):
    """Index of the nearest row of ``tab`` for every row of ``vals`` (float64), with the relative distance
    of the best and the relative gap to the runner-up."""
    tab_sq = (tab * tab).sum(1)
    idx = torch.empty(vals.shape[0], dtype=torch.long)
    best = torch.empty(vals.shape[0], dtype=torch.float64)
    gap = torch.empty(vals.shape[0], dtype=torch.float64)
    for a in range(0, vals.shape[0], chunk):
        v = vals[a:a + chunk]
        dist = (tab_sq[None, :] - 2 * v @ tab.T + (v * v).sum(1, keepdim=True)).clamp_min(0)  # squared L2
        two = dist.topk(min(2, tab.shape[0]), dim=1, largest=False)
        bd = two.values[:, 0].sqrt()
        second = two.values[:, 1].sqrt() if tab.shape[0] > 1 else torch.full_like(bd, float("inf"))
        norm = v.norm(dim=1).clamp_min(1e-30)
        idx[a:a + chunk], best[a:a + chunk], gap[a:a + chunk] = two.indices[:, 0], bd / norm, (second - bd) / norm
    return idx, best, gap


# -- absolute positions ------------------------------------------------------------------------------------

@dataclass
class _Absolute:
    table: torch.Tensor  # [V, H*D] float32: A e_t for every token (A = W_v diag(gamma), or W_v without a norm)
    positions: torch.Tensor  # [P, H*D] float64: A w_p for every position
    offset: torch.Tensor  # [H*D] float64: what the value has whatever the token (b_v, plus W_v beta with a norm)
    ones: torch.Tensor | None  # [H*D] float64: A 1 (the LayerNorm's mean direction); None without a norm
    rep: torch.Tensor  # [V] the smallest token id having each row of ``table``


#: model_type of the families whose first-layer values :func:`_absolute_layout` knows how to invert
ABSOLUTE_POSITION_TYPES = ("gpt2", "opt")


@torch.no_grad()
def _absolute_layout(model) -> _Absolute | None:
    """The pieces of a first layer whose values are ``W_v N(e_t + w_p) + b_v`` (GPT-2, OPT; ``N`` a LayerNorm
    or nothing), or None when the model does not add learned absolute positions to its embeddings."""
    kind = getattr(model.config, "model_type", "")
    if kind not in ABSOLUTE_POSITION_TYPES:
        return None
    if kind == "gpt2":
        base = model.transformer
        d = base.wte.weight.shape[1]
        e, pos = base.wte.weight, base.wpe.weight
        ln, w, b = base.h[0].ln_1, base.h[0].attn.c_attn.weight[:, 2 * d:].T, base.h[0].attn.c_attn.bias[2 * d:]
        norm = (ln.weight, ln.bias)
    else:  # opt
        dec = model.model.decoder
        e = dec.embed_tokens.weight
        if dec.project_in is not None:
            e = e @ dec.project_in.weight.T
        pos = dec.embed_positions.weight[dec.embed_positions.offset:]
        layer = dec.layers[0]
        v = layer.self_attn.v_proj
        w, b = v.weight, v.bias if v.bias is not None else torch.zeros(v.weight.shape[0])
        norm = (layer.self_attn_layer_norm.weight, layer.self_attn_layer_norm.bias) \
            if model.config.do_layer_norm_before else None
    w, b = w.detach().double().cpu(), b.detach().double().cpu()
    offset, ones = b, None
    if norm is not None:
        gamma, beta = norm[0].detach().double().cpu(), norm[1].detach().double().cpu()
        offset = b + w @ beta
        w = w * gamma[None, :]
        ones = w.sum(1)
    uniq, rep = _unique_rows(e.detach().float().cpu())
    return _Absolute((uniq.double() @ w.T).float(), pos.detach().double().cpu() @ w.T, offset, ones, rep)


def _absolute_scores(values: torch.Tensor, lay: _Absolute, chunk: int = 256):
    """Per position, the token whose ``e_t + w_p`` explains the value best, with its relative residual and
    the relative gap to the runner-up, all in value space (no inverse, so no rounding is amplified).  With a
    LayerNorm, ``u = v − offset`` is ``A (x − μ1)/σ`` for ``x = e_t + w_p``: the right token's ``A x`` and
    ``A 1`` span ``u`` (the residual of ``u`` outside that span is zero); without one, ``u − A w_p = A e_t``."""
    b, h, s, d = values.shape
    if s > lay.positions.shape[0]:
        raise ConfigError(f"token recovery: {s} positions, the model has {lay.positions.shape[0]}")
    u = _flat(values) - lay.offset  # [B*S, H*D]
    aw = lay.positions[:s].repeat(b, 1)  # A w_p of every row
    tab = lay.table
    t_sq = (tab.double() * tab.double()).sum(1).float()
    if lay.ones is not None:
        g = lay.ones / lay.ones.norm().clamp_min(1e-30)
        t_g = (tab.double() @ g).float()
    idx = torch.empty(b * s, dtype=torch.long)
    best = torch.empty(b * s, dtype=torch.float64)
    gap = torch.empty(b * s, dtype=torch.float64)
    for a in range(0, b * s, chunk):
        uu, ww = u[a:a + chunk], aw[a:a + chunk]
        if lay.ones is None:
            target = (uu - ww).float()
            dist = (t_sq[None, :] - 2 * target @ tab.T + (target * target).sum(1, keepdim=True)).clamp_min(0)
            ref = (target * target).sum(1, keepdim=True).clamp_min(1e-30)
        else:
            u1 = uu - (uu @ g)[:, None] * g  # u without its A1 part
            ua = (u1.float() @ tab.T) + (u1 * ww).sum(1, keepdim=True).float()  # u1 . A x_t
            aa = t_sq[None, :] + 2 * (ww.float() @ tab.T) + (ww * ww).sum(1, keepdim=True).float()  # |A x_t|^2
            ag = t_g[None, :] + (ww @ g).float()[:, None]  # A x_t . g
            ref = (u1 * u1).sum(1, keepdim=True).float().clamp_min(1e-30)
            dist = (ref - ua * ua / (aa - ag * ag).clamp_min(1e-30)).clamp_min(0)
        rel = dist / ref
        two = rel.topk(min(2, tab.shape[0]), dim=1, largest=False)
        bd = two.values[:, 0].double().sqrt()
        second = two.values[:, 1].double().sqrt() if tab.shape[0] > 1 else torch.full_like(bd, float("inf"))
        idx[a:a + chunk], best[a:a + chunk], gap[a:a + chunk] = lay.rep[two.indices[:, 0]], bd, second - bd
    return idx, best, gap


# -- recovery --------------------------------------------------------------------------------------------------

@torch.no_grad()
def recover_tokens(values_layer0: torch.Tensor, model, *, layer: int = 0, part: str = "values",
                   table: torch.Tensor | None = None, tolerance: float = 2e-2) -> RecoveredTokens:
    """Find the token of every position from the values (``part="keys"``: the keys) ``[batch, kv_heads, seq,
    dim]`` of cache layer ``layer`` (the model's first attention layer), then check them by running that layer
    on the result.

    ``tolerance`` bounds the distance between the cache's values and the re-run layer's, relative to the
    value's norm (bf16 caches round values to 8 significant bits: ~1e-2 relative).  Of several tokens with
    identical first-layer values, the smallest id is returned.
    """
    b, h, s, d = values_layer0.shape
    if s == 0:
        return RecoveredTokens(torch.zeros(b, 0, dtype=torch.long), True, "ok", 0.0, float("inf"))
    absolute = _memo(model, ("absolute",), lambda: _absolute_layout(model))
    if absolute is not None:
        method = "absolute"
        if absolute.table.shape[1] != h * d:
            return RecoveredTokens(None, False, f"layer-{layer} values have {h}x{d} components, the model's "
                                   f"{absolute.table.shape[1]}", float("inf"), 0.0, method)
        idx, best, gap = _absolute_scores(values_layer0, absolute)
        tokens = idx
    else:
        method = "table"
        if table is None:
            table = layer0_value_table(model, layer, part)
        if table.shape[1] != h * d:
            return RecoveredTokens(None, False, f"layer-{layer} values have {h}x{d} components, the model's "
                                   f"{table.shape[1]}", float("inf"), 0.0, method)
        uniq, rep = _unique_rows(table.float())
        idx, best, gap = _nearest(_flat(values_layer0), uniq.double())
        tokens = rep[idx]
    worst_margin = float(gap.min())
    if float(best.max()) > tolerance:
        return RecoveredTokens(None, False, f"a position is {float(best.max()):.3g} (relative) from every "
                               "vocabulary entry: the cache was modified (quantized, pruned) or comes from "
                               "another model", float(best.max()), worst_margin, method)
    if worst_margin <= float(best.max()):
        return RecoveredTokens(None, False, "two different vocabulary entries are about equally close: ambiguous",
                               float(best.max()), worst_margin, method)
    tokens = tokens.reshape(b, s)
    again = _flat(first_layer_values(model, tokens, layer, part).cpu())
    ref = _flat(values_layer0)
    worst = float(((again - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-30)).max())
    if worst > tolerance:
        return RecoveredTokens(None, False, f"the model's layer {layer} run on the recovered tokens is {worst:.3g} "
                               "(relative) from the cache: its values depend on position or context in a way "
                               "recovery does not invert (padding, or attention before that layer)",
                               worst, worst_margin, method)
    return RecoveredTokens(tokens, True, "ok", worst, worst_margin, method)


@torch.no_grad()
def min_pairwise_distance(table: torch.Tensor, chunk: int = 1024) -> tuple[float, int]:
    """Smallest L2 distance between two different rows, and how many rows duplicate another."""
    uniq, _ = _unique_rows(table.float())
    tab = uniq.double()
    sq = (tab * tab).sum(1)
    best = float("inf")
    for a in range(0, tab.shape[0], chunk):
        v = tab[a:a + chunk]
        dd = (sq[None, :] - 2 * v @ tab.T + sq[a:a + chunk, None]).clamp_min(0)
        dd[torch.arange(v.shape[0]), torch.arange(a, a + v.shape[0])] = float("inf")
        best = min(best, float(dd.min().sqrt()))
    return best, table.shape[0] - uniq.shape[0]


_MEMO: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _memo(model, key, compute):
    """``compute()`` once per model object, ``key`` and weights version."""
    stamp = sum(p._version for p in model.parameters())
    per = _MEMO.setdefault(model, {})
    hit = per.get(key)
    if hit is None or hit[0] != stamp:
        hit = per[key] = (stamp, compute())
    return hit[1]


def cached_value_table(model, layer: int = 0, part: str = "values") -> torch.Tensor:
    """:func:`layer0_value_table`, built once per model object, layer, part and weights version."""
    return _memo(model, ("table", layer, part), lambda: layer0_value_table(model, layer, part))


def recover(kv, model, layer: int = 0) -> RecoveredTokens:
    """The token ids of ``kv`` (a :class:`~kvcodec.KVCache`) from its layer ``layer``: by inversion for
    absolute-position models, else from the first layer's position-free part (:func:`position_free_part`)
    and the model's table of it, built once (:func:`cached_value_table`)."""
    if getattr(model.config, "model_type", "") in ABSOLUTE_POSITION_TYPES:
        return recover_tokens(kv.values[layer], model, layer=layer)
    part = _memo(model, ("part", layer), lambda: position_free_part(model, layer))
    if part is None:
        return RecoveredTokens(None, False, f"the model's layer-{layer} keys and values both depend on position "
                               "or context (probed), so no table identifies a token", float("inf"), 0.0)
    tensor = kv.values[layer] if part == "values" else kv.keys[layer]
    return recover_tokens(tensor, model, layer=layer, part=part, table=cached_value_table(model, layer, part))
