"""Attention matching: refit a selection's log-weights and values so that its attention reproduces the whole
cache's on reference queries (Zweiger, Fu, Guo and Kim, "Fast KV compaction via attention matching", 2026).

For one KV head with cached keys ``k_1..k_n`` and values ``v_j``, a query ``q`` sees the block's mass
``M(q) = sum_j exp(s <q, k_j>)`` and its local output ``O(q) = sum_j exp(s <q, k_j>) v_j / M(q)``.  Whatever
comes after the block (a question, generated tokens) mixes with it in proportion to ``M(q)``, so a reduced
block must reproduce both.  With the kept keys ``c_i`` fixed (a selection's, or atoms'):

1. masses: ``w >= 0`` minimising ``sum_q (sum_i w_i exp(s <q, c_i>) / M(q) - 1)^2`` (non-negative least squares
   on the relative mass error of each reference query; accelerated projected gradient), ``beta_i = log w_i``;
2. values: with ``p_qi`` the reduced block's attention weights under those masses, ``x`` minimising
   ``sum_q |sum_i p_qi x_i - O(q)|^2 + lam sum_i |x_i - v_i|^2``: least squares pulled toward the kept entries'
   own values (``lam`` = a factor of :data:`RIDGES` times the mean diagonal of ``P^T P``), so an entry the
   queries never separate keeps its value.  The factor is chosen per head by validation: fitted on every
   other reference query, the one whose values predict the remaining queries' outputs best - or no value fit
   at all, when the kept values predict them better than every fit (a head keeping many entries for few
   queries).

A head that keeps every token is left as it is.  The reference queries are the replay's (KVzip's
"repeat the previous context"; :func:`kvcodec.reduction.replay_observation`), all computed over the whole
cache, or, with ``reduce(fit="policy")`` (the paper's "on-policy" variant), those of a second replay over the
reduced cache, each layer's computed through the layers below it once they are fitted.
"""

from __future__ import annotations

import torch

__all__ = ["fit_head", "RIDGES", "ITERATIONS", "FLOOR"]

#: the value fit's pulls toward the kept entries' own values tried (relative to the mean diagonal of P^T P);
#: the one that predicts held-out reference queries best is used, or none of them if the kept values do better
RIDGES = (1e-3, 1e-2, 1e-1, 1.0)
#: at most this many projected-gradient steps of the mass fit; it stops early once a step moves the masses by
#: less than TOLERANCE of their norm
ITERATIONS = 300
TOLERANCE = 1e-5
#: keys per step of the whole block's attention (its memory: reference queries x KEY_CHUNK floats)
KEY_CHUNK = 8192
#: smallest mass an entry keeps (an entry the fit would zero stays attendable: log-weight >= log FLOOR)
FLOOR = 1e-6


def _nnls(a: torch.Tensor, iterations: int) -> torch.Tensor:
    """``w >= 0`` minimising ``|a w - 1|^2`` (``a`` ``[m, t]``, float64) by FISTA on the normal equations,
    started from the best common scale of all entries."""
    g = a.T @ a
    c = a.sum(0)
    total = g.sum()
    if not bool(total > 0):
        return torch.ones(a.shape[1], dtype=a.dtype, device=a.device)
    v = torch.ones(a.shape[1], dtype=a.dtype, device=a.device)
    for _ in range(30):  # power iteration: g is entrywise non-negative, its Perron vector is near ones
        v = g @ v
        v = v / v.norm()
    lip = float(v @ (g @ v)) * 1.05 + 1e-30
    w = torch.full((a.shape[1],), float(c.sum() / total), dtype=a.dtype, device=a.device)
    y, step = w, 1.0
    for _ in range(iterations):
        nxt = (y - (g @ y - c) / lip).clamp_min(0)
        step_next = (1 + (1 + 4 * step * step) ** 0.5) / 2
        y = nxt + ((step - 1) / step_next) * (nxt - w)
        moved = float((nxt - w).norm())
        w, step = nxt, step_next
        if moved <= TOLERANCE * float(w.norm()):
            break
    return w


def _solve(g, b, kept_values, ridge):
    """``x`` minimising ``|P x - O|^2 + lam |x - kept_values|^2`` from ``g = P^T P`` and ``b = P^T O``."""
    lam = ridge * float(g.diagonal().mean()) + 1e-12
    return torch.linalg.solve(g + lam * torch.eye(g.shape[0], dtype=g.dtype, device=g.device), b + lam * kept_values)


@torch.no_grad()
def fit_head(keys, values, kept_keys, kept_values, queries, scaling: float, ridges=RIDGES,
             iterations: int = ITERATIONS):
    """(values ``[t, dv]``, log-weights ``[t]``) for one KV head's kept entries ``kept_keys`` ``[t, d]``,
    ``kept_values`` ``[t, dv]``, matching the attention of its whole block ``keys`` ``[n, d]``, ``values``
    ``[n, dv]`` on ``queries`` ``[m, d]`` (post-RoPE, all after the block); float64, see the module's text."""
    q = queries.float()
    m = q.shape[0]
    dev = q.device
    top = torch.full((m, 1), float("-inf"), device=dev)
    mass = torch.zeros(m, dtype=torch.float64, device=dev)  # M(q) / exp(top), over the keys so far
    acc = torch.zeros(m, values.shape[-1], dtype=torch.float64, device=dev)
    for a in range(0, int(keys.shape[0]), KEY_CHUNK):  # online softmax: memory m x KEY_CHUNK, whatever n is
        logits = scaling * (q @ keys[a:a + KEY_CHUNK].float().T)
        new_top = torch.maximum(top, logits.amax(1, keepdim=True))
        e = torch.exp(logits - new_top)
        shrink = torch.exp(top - new_top).double()
        mass = mass * shrink[:, 0] + e.sum(1, dtype=torch.float64)
        acc = acc * shrink + (e @ values[a:a + KEY_CHUNK].float()).double()
        top = new_top
    out = acc / mass[:, None]  # O(q)
    a = torch.exp(scaling * (q @ kept_keys.float().T) - top).double() / mass[:, None]  # [m, t]
    w = _nnls(a, iterations).clamp_min(FLOOR)
    p = a * w
    p = p / p.sum(1, keepdim=True).clamp_min(1e-300)
    v0 = kept_values.double()
    # the value fit's ridge: whichever of ``ridges`` (or none: the kept values as they are) predicts the
    # outputs of every other reference query best when fitted on the rest
    fit_rows, check_rows = slice(0, None, 2), slice(1, None, 2)
    pf, pc = p[fit_rows], p[check_rows]
    g, b = pf.T @ pf, pf.T @ out[fit_rows]
    best, best_err = None, float((pc @ v0 - out[check_rows]).square().sum())
    for ridge in ridges:
        err = float((pc @ _solve(g, b, v0, ridge) - out[check_rows]).square().sum())
        if err < best_err:
            best, best_err = ridge, err
    x = v0 if best is None else _solve(g + pc.T @ pc, b + pc.T @ out[check_rows], v0, best)
    return x, torch.log(w)
