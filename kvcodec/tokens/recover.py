"""Recover the token ids of a cache from its layer-0 values.

In models without absolute position embeddings (Llama, Qwen2, Mistral ...),
the layer-0 value vector of a token is ``v_proj(input_layernorm(embed(t)))``:
no RoPE, no context.  So a per-model table of that vector for every vocabulary
entry identifies each cached token by nearest row.  Measured on SmolLM2: 512 of
512 tokens recovered exactly; 11 of 49,152 vocabulary rows are duplicates
(such tokens have identical KV everywhere, so either choice regenerates the
same cache).

Verification is part of recovery: every position's distance to its nearest
row must be tiny compared with the gap to the next different row, otherwise
recovery reports failure (a quantized, pruned or foreign cache) instead of
guessing.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ..errors import ConfigError


@dataclass
class RecoveredTokens:
    tokens: torch.Tensor | None  # [batch, seq] int64, None when recovery failed
    ok: bool
    reason: str
    max_relative_distance: float  # worst nearest-row distance / value norm
    min_relative_margin: float  # worst (second-best - best) / value norm, over distinct rows


def _layer0_modules(model):
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    try:
        embed = base.embed_tokens
        layer = base.layers[0]
        norm, v_proj = layer.input_layernorm, layer.self_attn.v_proj
    except AttributeError:
        raise ConfigError(
            f"token recovery needs layer-0 values that depend only on the token (Llama / Qwen2 / Mistral "
            f"layouts); {type(model).__name__} is not supported yet (absolute position embeddings, or "
            "another module layout)") from None
    if getattr(model.config, "model_type", "") in ("gemma", "gemma2", "gemma3"):
        raise ConfigError("token recovery: Gemma scales embeddings; not supported yet")
    return embed, norm, v_proj


@torch.no_grad()
def layer0_value_table(model, batch: int = 4096) -> torch.Tensor:
    """``[vocab, kv_heads * head_dim]`` layer-0 value vectors, in the model's dtype."""
    embed, norm, v_proj = _layer0_modules(model)
    vocab = embed.weight.shape[0]
    rows = []
    for a in range(0, vocab, batch):
        ids = torch.arange(a, min(vocab, a + batch), device=embed.weight.device)
        rows.append(v_proj(norm(embed(ids)[None]))[0])
    return torch.cat(rows)


def _unique_rows(table: torch.Tensor):
    """Distinct rows, and for each the smallest token id having it."""
    uniq, inverse = torch.unique(table, dim=0, return_inverse=True)
    rep = torch.full((uniq.shape[0],), table.shape[0], dtype=torch.long)
    rep = rep.scatter_reduce(0, inverse, torch.arange(table.shape[0]), reduce="amin")
    return uniq, rep


@torch.no_grad()
def recover_tokens(values_layer0: torch.Tensor, model, *, table: torch.Tensor | None = None,
                   tolerance: float = 2e-2, chunk: int = 512) -> RecoveredTokens:
    """Find the token of every position from layer-0 values ``[batch, kv_heads, seq, head_dim]``.

    ``tolerance`` bounds the nearest-row distance relative to the vector's norm
    (bf16 caches round values to 8 significant bits: ~1e-2 relative).  Of
    several tokens with identical rows, the smallest id is returned.
    """
    if table is None:
        table = layer0_value_table(model)
    b, h, s, d = values_layer0.shape
    if table.shape[1] != h * d:
        return RecoveredTokens(None, False, f"layer-0 values have {h}x{d} components, the model's {table.shape[1]}",
                               float("inf"), 0.0)
    uniq, rep = _unique_rows(table.float())
    vals = values_layer0.permute(0, 2, 1, 3).reshape(b * s, h * d).double()
    tab = uniq.double()
    tab_sq = (tab * tab).sum(1)
    tokens = torch.empty(b * s, dtype=torch.long)
    worst_dist, worst_margin = 0.0, float("inf")
    for a in range(0, b * s, chunk):
        v = vals[a:a + chunk]
        dist = (tab_sq[None, :] - 2 * v @ tab.T + (v * v).sum(1, keepdim=True)).clamp_min(0)  # squared L2
        two = dist.topk(min(2, tab.shape[0]), dim=1, largest=False)
        bd = two.values[:, 0].sqrt()
        second = two.values[:, 1].sqrt() if tab.shape[0] > 1 else torch.full_like(bd, float("inf"))
        norm = v.norm(dim=1).clamp_min(1e-30)
        worst_dist = max(worst_dist, float((bd / norm).max()))
        worst_margin = min(worst_margin, float(((second - bd) / norm).min()))
        tokens[a:a + chunk] = rep[two.indices[:, 0]]
    tokens = tokens.reshape(b, s)
    if worst_dist > tolerance:
        return RecoveredTokens(None, False, f"a position is {worst_dist:.3g} (relative) from every vocabulary row: "
                               "the cache was modified (quantized, pruned) or comes from another model",
                               worst_dist, worst_margin)
    if worst_margin <= worst_dist:
        return RecoveredTokens(None, False, "two different vocabulary rows are about equally close: ambiguous",
                               worst_dist, worst_margin)
    return RecoveredTokens(tokens, True, "ok", worst_dist, worst_margin)


@torch.no_grad()
def min_pairwise_distance(table: torch.Tensor, chunk: int = 1024) -> tuple[float, int]:
    """Smallest L2 distance between two different rows, and how many rows duplicate another."""
    uniq, _ = _unique_rows(table.float())
    tab = uniq.double()
    sq = (tab * tab).sum(1)
    best = float("inf")
    for a in range(0, tab.shape[0], chunk):
        v = tab[a:a + chunk]
        d = (sq[None, :] - 2 * v @ tab.T + sq[a:a + chunk, None]).clamp_min(0)
        d[torch.arange(v.shape[0]), torch.arange(a, a + v.shape[0])] = float("inf")
        best = min(best, float(d.min().sqrt()))
    return best, table.shape[0] - uniq.shape[0]


_TABLES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def cached_value_table(model) -> torch.Tensor:
    """:func:`layer0_value_table`, built once per model object and weights version."""
    stamp = sum(p._version for p in model.parameters())
    hit = _TABLES.get(model)
    if hit is None or hit[0] != stamp:
        hit = (stamp, layer0_value_table(model))
        _TABLES[model] = hit
    return hit[1]


def recover(values_layer0: torch.Tensor, model) -> RecoveredTokens:
    """:func:`recover_tokens` with the model's vocab table built once (:func:`cached_value_table`)."""
    return recover_tokens(values_layer0, model, table=cached_value_table(model))
