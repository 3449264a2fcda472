"""The reduce tier: fewer cache entries instead of fewer bits (papers.md part B).

The package is ``kvcodec.reduction``; its entry point is ``kvcodec.reduce``.

``kvcodec.reduce(cache, model, keep=0.1)`` returns a :class:`ReducedCache` that the same model takes as its cache
directly - ``model(ids, cache=reduced)`` (``past_key_values=`` before transformers 5.2x) and ``model.generate(...)`` -
and that keeps its budget as decoding appends to it.  The default method is ``"kvzip"`` with its
attention-matching fit and its bound (the method that measures best on held-out documents, BENCHMARKS.md "Reduce
tier"; docs/reduce.md says which to use when).  Methods:

- ``"cluster"``, ``"sample"``: the paper's merge-reduce summaries (binary-counter buckets of ``K``-atom
  summaries, blocks of ``B = K`` tokens, 4 raw attention sinks, optionally a raw recent ``window``) with the
  protected-clustering or the mass-proportional sampling reducer; atoms carry masses
  (:mod:`kvcodec.reduction.attention`).  ``form`` chooses the mass the reducers preserve
  (:data:`kvcodec.reduction.cache.FORMS`): ``"query"`` (default) the mass seen from the mean of the last
  64 queries of the prefill (the prefill is re-run on the cache's tokens when no ``observation`` is given),
  ``"dot"`` the token counts (no forward pass), ``"kernel"`` the papers' Gaussian-kernel mass (measured
  much worse on SmolLM2: BENCHMARKS.md).
- ``"streaming"`` (StreamingLLM: sinks + recent window), ``"snapkv"`` (window 64, pool 5, GQA mean),
  ``"h2o"`` (half heavy hitters by normalised received attention, half recent), ``"tova"`` (TOVA: the
  tokens the last token attends to most, averaged over all query heads of the layer, and the last token),
  ``"kvzip"`` (KVzip: the sinks and, per KV head, the tokens that receive the most attention when the model
  replays the cache's own tokens after it, optionally after a repeat instruction ``prompt``): one-shot
  selections of original tokens, the baselines; later tokens are appended raw.  ``snapkv``, ``h2o`` and
  ``tova`` re-run the prefill on the cache's tokens (given, or recovered from the cache) to see the queries;
  ``kvzip`` runs the replay after a copy of the cache and, unless ``fit=False``, refits its selection's
  values and log-weights to the whole cache's attention on the replay's queries (:mod:`kvcodec.reduction.fit`).
  With ``bound`` (``kvzip``'s default) appended tokens compete with the kept ones for the same places.

Every method keeps the same number of entries per KV head for the same ``keep`` (or ``budget``):
:func:`plan_for` picks ``K`` so the merge-reduce summary holds at most ``round(keep * n)`` entries, and the
baselines keep exactly as many as the summary holds.
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import DynamicLayer

from .attention import enable, observe, scalings
from .cache import FORMS, Plan, ReducedCache, ReducedLayer, ingest
from .reducers import REDUCERS
from .scan import prefill

__all__ = ["reduce", "prefill", "plan_for", "entries_for", "layer_budgets", "rank_budgets", "head_budgets",
           "ALLOCATIONS",
           "ReducedCache", "ReducedLayer", "Plan", "METHODS", "enable", "replay_observation", "REPEAT_PROMPT"]

MERGE_REDUCE = tuple(REDUCERS)
#: the methods ``fit=True`` applies to: kvzip on its replay's queries, the prefill-scored selections on the
#: prefill's own (every ``ceil(n / 1024)``-th query)
FIT_METHODS = ("kvzip", "snapkv", "tova", "h2o")
BASELINES = ("streaming", "snapkv", "h2o", "tova", "kvzip")
METHODS = MERGE_REDUCE + BASELINES



def entries_for(n: int, k: int, sinks: int = 4, block: int | None = None, window: int = 0) -> int:
    """Entries a merge-reduce summary of ``n`` tokens holds per KV head (``block`` defaults to ``k``; ``window``
    recent tokens always raw)."""
    block = block or k
    if n <= sinks + window:
        return n
    rest = n - sinks - window
    blocks = rest // block
    return sinks + window + min(k, block) * bin(blocks).count("1") + rest % block


def plan_for(n: int, keep: float | None = None, *, budget: int | None = None, sinks: int = 4,
             window: float = 0.0) -> tuple[int, int, int]:
    """``(K, W, entries)``: a raw recent window of ``W = round(window * budget)`` tokens and the ``K`` (blocks of
    ``K`` tokens) whose merge-reduce summary of ``n`` tokens holds the most entries per KV head without
    exceeding ``budget`` (default ``round(keep * n)``); the larger ``K`` on a tie.  (The entry count is not
    monotone in ``K``: it depends on the bits of ``(n - sinks - W) // K``.)"""
    if budget is None:
        if keep is None or not 0 < keep <= 1:
            raise ValueError(f"keep must be in (0, 1], got {keep!r}")
        budget = round(keep * n)
    if not 0 <= window < 1:
        raise ValueError(f"window must be a fraction of the budget in [0, 1), got {window!r}")
    budget = max(int(budget), sinks + 1)
    if budget >= n:
        return max(n, 1), 0, n
    w = int(round(window * budget))
    w = min(w, budget - sinks - 1)
    best = None
    for k in range(1, budget - sinks - w + 1):
        e = entries_for(n, k, sinks, window=w)
        if e <= budget and (best is None or e >= best[2]):
            best = (k, w, e)
    return best or (1, w, entries_for(n, 1, sinks, window=w))  # nothing fits: the smallest summary there is


def _anchor(form, keys, obs, layer_idx):
    """The query a reducer tilts masses at (``[b, kv_heads, d]``): for the ``"query"`` form the mean of the
    observed queries of the KV head's group, else ``None`` (the plan's form decides)."""
    if form != "query":
        return None
    b, h, _, d = keys.shape
    q = obs.queries[layer_idx].float()  # [b, hq, window, d]
    return q.mean(2).view(b, h, q.shape[1] // h, d).mean(2)


def _full_layers(cache):
    return [i for i, layer in enumerate(cache.layers) if type(layer) is DynamicLayer]


def _tokens(cache, model, tokens):
    if tokens is not None:
        t = torch.as_tensor(tokens)
        return (t[None] if t.dim() == 1 else t).long()
    from ..cache import to_canonical
    from ..tokens.recover import recover_tokens

    kv = to_canonical(cache)
    rec = recover_tokens(kv.values[0], model)
    if not rec.ok:
        from ..errors import ConfigError

        raise ConfigError(f"this method needs the cache's tokens and they could not be recovered from it "
                          f"({rec.reason}); pass tokens=")
    return rec.tokens.long()


def _copy_layer(layer):
    """A deep copy of a cache layer without the autograd history its tensors may carry (``copy.deepcopy``
    refuses tensors that are not graph leaves)."""
    c = copy.copy(layer)
    for name, value in vars(layer).items():
        if isinstance(value, torch.Tensor):
            setattr(c, name, value.detach())
    return copy.deepcopy(c)


def _copy(cache):
    """A deep copy of ``cache`` to run the model after (its layers copied by :func:`_copy_layer`)."""
    shallow = copy.copy(cache)
    shallow.layers = []
    out = copy.deepcopy(shallow)
    out.layers = [_copy_layer(layer) for layer in cache.layers]
    return out


def _cache_tokens(cache, model, tokens, batch: int, n: int):
    """The cache's token ids ``[batch, n]`` (given, or recovered from the cache), checked against its shape."""
    ids = _tokens(cache, model, tokens)
    if tuple(ids.shape) != (batch, n):
        raise ValueError(f"tokens of shape {tuple(ids.shape)} for a cache of batch {batch} and {n} tokens")
    return ids


def _per_row(ids, batch: int, what: str, empty: bool = True):
    """Token ids ``what`` (``question``, ``prompt``) read after a cache of ``batch`` rows, as ``[batch, L]``: one
    sequence for every row, or one per row (``empty``: whether L may be 0)."""
    t = torch.as_tensor(ids)
    t = (t[None] if t.dim() == 1 else t).long()
    if t.dim() != 2 or (t.shape[-1] == 0 and not empty):
        raise ValueError(f"{what} must be a {'' if empty else 'non-empty '}sequence of token ids, got shape "
                         f"{tuple(t.shape)}")
    if t.shape[0] != batch:
        if t.shape[0] != 1:
            raise ValueError(f"{t.shape[0]} {what}s for a cache of batch {batch} (give one, or one per row)")
        t = t.expand(batch, -1)
    return t


def _observe_question(cache, model, question, batch: int):
    """The queries of ``question`` (token ids) run after ``cache`` (of ``batch`` rows, left untouched), recorded
    per layer."""
    from ..tokens.plan import cache_kwarg

    q = _per_row(question, batch, "question", empty=False)
    with observe(model, window=q.shape[-1], received=False) as obs:
        model(q, **{cache_kwarg(model): _copy(cache)})
    return obs


#: context tokens per replay pass of ``kvzip``.  A pass sits after the whole cache, so it sees the tokens it
#: replays from as far back as a question right after the cache sees them, plus at most one chunk: a question
#: finds a token ``n - j`` positions back, the pass that replays it ``n - chunk start`` (+ prompt) back.  In one
#: pass (KVzip's chunk of 2K or more on shorter caches) every token is seen from ~n back, and ``fit``, made on
#: the replay's queries, matched the heads that read mostly nearby tokens to an attention no question produces:
#: measured on SmolLM2, needles near the cache's end were lost (BENCHMARKS.md, "The replay in passes of 512
#: tokens").  Passes also bound the positions (below
#: n + prompt + chunk) and the scores' memory ((chunk + prompt) x (n + chunk + prompt) floats).
REPLAY_CHUNK = 512
#: tokens of the previous chunk read again after the prompt, before the next chunk (KVzip's lead-in)
REPLAY_LEAD = 8
#: KVzip's repeat instruction, for ``prompt=`` once tokenized with the model's tokenizer (kvpress's text for
#: models without a chat template; ``kvz encode --reduce-method kvzip`` and ``kvz bench --reduce`` use it)
REPEAT_PROMPT = "\n\nRepeat the previous context exactly.\n"
#: tokens of the cache that ``fit="policy"``'s second replay reads (all of a shorter cache; fewer where the
#: model's positions end first)
POLICY_READ = 4096
#: at most this many of the replay's queries per query head and layer are kept as ``fit``'s reference queries
#: (every ``ceil(replayed / REFERENCE_QUERIES)``-th of them)
REFERENCE_QUERIES = 1024


def _reference_stride(queries: int) -> int:
    """Every how many of ``queries`` queries one is kept as a reference query (at most REFERENCE_QUERIES)."""
    return max(1, -(-queries // REFERENCE_QUERIES))


def replay_observation(cache, model, ids, prompt=None, chunk: int = REPLAY_CHUNK):
    """What ``kvzip`` scores with: an :class:`~kvcodec.reduction.attention.Observation` whose ``peak[l]``
    ``[b, kv_heads, n]`` holds the largest attention weight each cached key receives while the model, after a
    copy of ``cache``, reads ``prompt`` (token ids, or None) and then the cache's own tokens ``ids`` ``[b, n]``
    again, ``chunk`` tokens per pass (a pass after the first reads the previous chunk's last 8 tokens after the
    prompt; each key is scored by the pass that replays it, over everything that pass's queries see).  Its
    ``reference[l]`` ``[b, q_heads, m, d]`` holds every ``stride``-th query of the replay (post-RoPE; at most
    :data:`REFERENCE_QUERIES` per head), the queries ``fit=True`` matches attention on."""
    from ..tokens.plan import cache_kwarg

    b, n = ids.shape
    p = _per_row([] if prompt is None else prompt, b, "prompt")
    if chunk < 1:
        raise ValueError(f"replay_chunk must be >= 1, got {chunk}")
    limit = getattr(model.config, "max_position_embeddings", None)
    longest = n + p.shape[1] + min(chunk, n) + (REPLAY_LEAD if n > chunk else 0)
    if isinstance(limit, int) and longest > limit:
        room = limit - n - p.shape[1] - REPLAY_LEAD
        raise ValueError(f"kvzip's replay would reach position {longest - 1} of a model made for {limit} "
                         + (f"positions; pass replay_chunk <= {room}" if room >= 1 else
                            "positions, with any replay_chunk: the cache is too long to replay after itself"))
    starts = range(0, n, chunk)
    read = sum(p.shape[1] + min(REPLAY_LEAD, s) + min(chunk, n - s) for s in starts)  # queries of every pass
    stride = _reference_stride(read)
    out, refs = None, {}
    for start in starts:
        end = min(n, start + chunk)
        lead = torch.cat([p, ids[:, max(0, start - REPLAY_LEAD):start]], -1)
        with observe(model, window=1, received=False, peak=True, stride=stride) as obs:
            obs.peak_keys = (start, end)
            model(torch.cat([lead, ids[:, start:end]], -1), **{cache_kwarg(model): _copy(cache)})
        got = obs.peak
        for li, v in obs.reference.items():
            refs.setdefault(li, []).append(v)
        if out is None:
            out = obs
            out.peak = {li: torch.zeros(*v.shape[:2], n, device=v.device) for li, v in got.items()}
        for li, v in got.items():
            out.peak[li][..., start:end] = v
    out.reference = {li: torch.cat(v, 2) for li, v in refs.items()}
    out.prompt, out.replay_chunk = p, chunk
    return out


class _PolicyFitter:
    """``reduce(fit="policy")``: called by the attention of each reduced layer while the model replays the cache
    after the reduced cache; fits the layer's first ``widths[l]`` entries (its kept ones) to the whole layer's
    attention on the queries it is given - computed through the layers below, already fitted - and has
    attention use the fitted ones."""

    def __init__(self, full_layers, widths: dict, scale: dict):
        self.full, self.widths, self.scale, self.fitted = full_layers, widths, scale, {}

    def __call__(self, module, query, key, value, beta):
        li = getattr(module, "layer_idx", None)
        width = self.widths.get(li)
        if width is None or li in self.fitted:
            return value, beta
        b, h, total, _ = key.shape
        if beta is None:
            beta = torch.zeros(b, h, total, device=key.device)
        ref = query[:, :, ::_reference_stride(int(query.shape[2]))].detach().float()
        full = self.full[li]
        v, bt = fit_layer(full.keys, full.values, key[:, :, :width], value[:, :, :width], beta[:, :, :width], ref,
                           self.scale[li])
        self.fitted[li] = (v, bt)
        return torch.cat([v, value[:, :, width:]], 2), torch.cat([bt.to(beta.dtype), beta[:, :, width:]], 2)


ALLOCATIONS = ("uniform", "layers", "ranks", "heads", "layer-heads")


def _budget_frame(scores: dict, entries: int, sinks: int):
    """(the layers in order, tokens n, sinks kept s, and the budgets when there is nothing to rank or None)."""
    order = sorted(scores)
    if not order:
        return order, 0, 0, {}
    n = int(scores[order[0]].shape[-1])
    other = [li for li in order if int(scores[li].shape[-1]) != n]
    if other:
        raise ValueError(f"scores of layer {other[0]} cover {scores[other[0]].shape[-1]} tokens, of layer "
                         f"{order[0]} {n}: the layers compete for the same tokens' places")
    if entries >= n:
        return order, n, min(sinks, n), {li: n for li in order}
    return order, n, min(sinks, entries, n), None


def rank_budgets(scores: dict, entries: int, sinks: int) -> dict:
    """KVzip's uneven budget by ranks, per layer: ``layer -> entries per KV head`` for the layers of ``scores``
    (``layer -> [b, h, n]`` scores comparable across layers, such as the replay's peak attention), ``entries`` per
    layer on average (every layer gets ``n`` when ``entries >= n``). The first ``min(sinks, entries)`` tokens are
    always kept. Every head's other scores are sorted, largest first; a layer's r-th place is worth the mean, over
    its heads and batch rows, of their r-th largest score; the ``layers x (entries - sinks)`` places of largest
    worth over all layers are kept (a layer's worths descend with r, so it keeps its first places: ties are broken
    by layer order) and each layer gets its sinks plus its places. Heads of one layer keep the same number of
    entries (a layer's keys are one tensor), each its own best ones, so nothing is held and masked; the layer is
    priced by what its heads lose together at each depth, not by how many of their single entries rank high
    (:func:`layer_budgets`, which a layer with one sharp head and several flat ones lets down)."""
    order, n, s, done = _budget_frame(scores, entries, sinks)
    if done is not None:
        return done
    worth = torch.cat([scores[li][..., s:].double().flatten(0, 1).sort(-1, descending=True).values.mean(0)
                       for li in order])  # [L * (n - s)]: layer by layer, each descending
    top = worth.sort(descending=True, stable=True).indices[: len(order) * (entries - s)]
    keep = torch.zeros(len(order), dtype=torch.long, device=top.device)
    keep.index_add_(0, top // (n - s), torch.ones_like(top))
    return {li: s + int(keep[i]) for i, li in enumerate(order)}


def layer_budgets(scores: dict, entries: int, sinks: int) -> dict:
    """KVzip's uneven budget, per layer: ``layer -> entries per KV head`` for the layers of ``scores`` (``layer ->
    [b, h, n]`` scores comparable across layers, such as the replay's peak attention), summing to ``entries``
    per layer on average.  Every score but the first ``sinks`` tokens' (always kept) competes in one ranking over
    all layers, heads and batch rows; a layer gets its sinks plus the mean, over its heads and rows, of the
    ranking's top places that fell to it (the global top ``layers x heads x (entries - sinks)`` per row, ties
    broken by layer order), rounded by largest remainder so that the total is exact.  Heads of one layer keep
    the same number of entries (a layer's keys are one tensor), so no entry is held and masked."""
    order, n, s, done = _budget_frame(scores, entries, sinks)
    if done is not None:
        return done
    flat = torch.cat([scores[li][..., s:].float().flatten(1) for li in order], 1)  # [b, L * h * (n - s)]
    b = flat.shape[0]
    per_row = [int(scores[li].shape[1]) * (n - s) for li in order]
    top = sum(int(scores[li].shape[1]) for li in order) * (entries - s)
    won = torch.zeros_like(flat, dtype=torch.bool)
    won.scatter_(1, flat.topk(top, dim=1, sorted=False).indices, True)
    share = []
    for w in won.split(per_row, 1):  # mean over rows and heads of each layer's places
        share.append(float(w.sum()) / (b * w.shape[1] / (n - s)))
    total = len(order) * (entries - s)
    base = [min(int(x), n - s) for x in share]
    rest = total - sum(base)
    for i in sorted(range(len(order)), key=lambda i: base[i] - share[i])[: max(rest, 0)]:
        base[i] += 1
    return {li: s + base[i] for i, li in enumerate(order)}


def head_budgets(scores: dict, entries: int, sinks: int, within: dict | None = None) -> dict:
    """KVzip's own uneven budget, per KV head: ``layer -> [b, h]`` entries of each head (LongTensor) for the layers
    of ``scores`` (``layer -> [b, h, n]`` replay scores).  The first ``min(sinks, entries)`` tokens of every head
    are kept; with ``within`` None every other score of every layer and head competes in one ranking per batch
    row, whose top ``layers x heads x (entries - sinks)`` places are kept (ties by layer order, then head, then
    token); with ``within`` (``layer -> entries per head``, such as :func:`rank_budgets` gives) each layer's
    ``heads x (within[layer] - sinks)`` places are ranked among its own heads only (a layer keeps its total, its
    heads share it unevenly).  A head's count includes its sinks."""
    order, n, s, done = _budget_frame(scores, entries, sinks)
    if done is not None:
        return {li: torch.full(scores[li].shape[:2], n, dtype=torch.long) for li in order}
    out = {}
    if within is None:
        groups = [(order, entries - s)]
    else:
        groups = [([li], within[li] - s) for li in order]
    for lis, per_head in groups:
        flat = torch.cat([scores[li][..., s:].double().flatten(1) for li in lis], 1)  # [b, sum(h) * (n - s)]
        b = flat.shape[0]
        heads = sum(int(scores[li].shape[1]) for li in lis)
        take = min(heads * per_head, flat.shape[1])
        top = flat.sort(dim=1, descending=True, stable=True).indices[:, :take]
        won = torch.zeros(b, heads, dtype=torch.long, device=top.device)
        won.scatter_add_(1, top // (n - s), torch.ones_like(top))
        at = 0
        for li in lis:
            h = int(scores[li].shape[1])
            out[li] = s + won[:, at:at + h]
            at += h
    return out


def _select_heads(scores, count, sinks: int):
    """Indices ``[b, h, S]`` (``S = count.max()``) and a mask ``[b, h, S]`` of the entries present: each head's
    first ``count`` entries are its first ``sinks`` tokens and its best scored others, in token order; the rest
    of its ``S`` places are absent (index 0, to be zeroed and given log-weight -inf: spec/kvz.md section 14.2,
    ``heads``)."""
    b, h, n = scores.shape
    width = int(count.max())
    score = scores.clone()
    score[..., : min(sinks, width)] = float("inf")
    rank = score.sort(dim=-1, descending=True, stable=True).indices[..., :width]  # best first
    present = torch.arange(width, device=scores.device)[None, None, :] < count.to(scores.device)[..., None]
    idx = torch.where(present, rank, n).sort(-1).values  # the kept tokens in order, then n for the absent places
    return idx.masked_fill(~present, 0), present


def _gather(keys, values, idx, present):
    """(keys, values, log-weights or None) of the entries ``idx`` ``[b, h, S]``; ``present`` (None: all) marks the
    places that hold an entry, the others zero with log-weight -inf."""
    gk = keys.gather(2, idx[..., None].expand(-1, -1, -1, keys.shape[-1]))
    gv = values.gather(2, idx[..., None].expand(-1, -1, -1, values.shape[-1]))
    if present is None or present.all():
        return gk, gv, None
    gk, gv = gk.masked_fill(~present[..., None], 0), gv.masked_fill(~present[..., None], 0)
    return gk, gv, torch.zeros(present.shape, device=present.device).masked_fill(~present, float("-inf"))


def _with_rest(keys, values, idx, present, atom):
    """:func:`_gather` of the kept entries ``idx`` plus, right after each head's kept ones where ``atom`` ``[b, h]``
    is set, one atom standing for the tokens the head evicted: their mean key and mean value, log-weight
    log(count) (``rest=True``: attention gives it count x exp(s <q, mean key>), the evicted tokens' total
    exp(s <q, k_j>) to first order, a lower bound by Jensen's inequality; a head that evicted nothing has no
    atom).  The places after a head's entries are absent (zero, -inf), the longest head filling the tensors."""
    b, h, n, _ = keys.shape
    if present is None:
        present = torch.ones(idx.shape, dtype=torch.bool, device=idx.device)
    kept = torch.zeros(b, h, n + 1, dtype=torch.bool, device=idx.device)
    kept.scatter_(2, idx.masked_fill(~present, n), True)  # absent places land in the extra column n
    evicted = ~kept[..., :n]
    cnt = evicted.sum(-1)  # [b, h]
    w = evicted.double() / cnt.clamp_min(1)[..., None]
    atom_k = (w[..., None] * keys.double()).sum(2).to(keys.dtype)  # [b, h, dk]
    atom_v = (w[..., None] * values.double()).sum(2).to(values.dtype)
    nkept = present.sum(-1)  # [b, h]
    has = (cnt > 0) & atom.to(cnt.device)
    width = int((nkept + has.long()).max())
    gk, gv, _ = _gather(keys, values, idx, present)
    pad = width - int(idx.shape[-1])  # 0 or 1: the longest head's atom, if it has one
    if pad:
        gk = torch.cat([gk, gk.new_zeros(b, h, pad, gk.shape[-1])], 2)
        gv = torch.cat([gv, gv.new_zeros(b, h, pad, gv.shape[-1])], 2)
    place = torch.arange(width, device=idx.device)[None, None, :]
    at = (place == nkept[..., None]) & has[..., None]  # the atom's place in each head that has one
    gk = torch.where(at[..., None], atom_k[:, :, None, :], gk)
    gv = torch.where(at[..., None], atom_v[:, :, None, :], gv)
    beta = torch.zeros(b, h, width, device=idx.device)
    beta = torch.where(at, torch.log(cnt.clamp_min(1).float())[..., None], beta)
    beta = beta.masked_fill(place >= (nkept + has.long())[..., None], float("-inf"))
    return gk, gv, beta


def fit_layer(keys, values, gk, gv, beta, reference, scaling: float):
    """(values, log-weights ``[b, h, S]``) of a layer's kept entries ``gk``/``gv`` (log-weights ``beta``, None:
    all 0; -inf: absent places, left as they are) refitted head by head to the whole layer's attention on the
    ``reference`` queries ``[b, q_heads, m, d]`` (``fit=True``, :func:`kvcodec.reduction.fit.fit_head`)."""
    from .fit import fit_head

    b, h, width, _ = gk.shape
    n = int(keys.shape[2])
    group = reference.shape[1] // h
    present = torch.ones(b, h, width, dtype=torch.bool, device=gk.device) if beta is None else torch.isfinite(beta)
    out_v = gv.clone()
    out_b = torch.zeros(b, h, width, device=gk.device) if beta is None else beta.clone().float()
    for r in range(b):
        for j in range(h):
            sel = present[r, j].nonzero().squeeze(1)
            if int(sel.numel()) >= n:  # a head that keeps every token is exact as it is
                continue
            queries = reference[r, j * group:(j + 1) * group].reshape(-1, reference.shape[-1])
            x, lw = fit_head(keys[r, j], values[r, j], gk[r, j, sel], gv[r, j, sel], queries, scaling)
            x = x.to(gv.dtype)
            if bool(torch.isfinite(x).all()):  # (a fit beyond the cache dtype's range keeps the tokens' values)
                out_v[r, j, sel] = x
            out_b[r, j, sel] = lw.float()
    return out_v, out_b


def _select(method: str, keys, obs_layer, budget: int, sinks: int, window: int = 64):
    """Indices ``[b, h, budget]`` (ascending) of the tokens a baseline keeps."""
    b, h, n, _ = keys.shape
    if budget >= n:
        return torch.arange(n).expand(b, h, n)
    if method == "streaming":
        s = min(sinks, budget)
        idx = torch.cat([torch.arange(s), torch.arange(n - (budget - s), n)])
        return idx.expand(b, h, budget)
    if method == "snapkv":
        queries, scaling = obs_layer["queries"], obs_layer["scaling"]
        w = min(window, queries.shape[2], budget)
        hq = queries.shape[1]
        g = hq // h
        kq = keys.float().repeat_interleave(g, dim=1)
        logits = scaling * queries.float() @ kq.transpose(-1, -2)  # [b, hq, W, n]
        if obs_layer.get("after"):  # a question's queries, past the cache: every key visible, no raw window
            w = 0
        else:
            qpos = torch.arange(n - queries.shape[2], n)[:, None]
            logits = logits.masked_fill(torch.arange(n)[None, :] > qpos, float("-inf"))
        att = torch.softmax(logits, -1)[..., : n - w].mean(2)  # attention to keys before the window
        att = torch.nn.functional.avg_pool1d(att.reshape(b * hq, 1, -1), 5, stride=1, padding=2,
                                             count_include_pad=False).reshape(b, hq, -1)
        score = att.view(b, h, g, -1).mean(2)
        top = score.topk(budget - w, dim=-1).indices
        win = torch.arange(n - w, n).expand(b, h, w)
        return torch.cat([top, win], -1).sort(-1).values
    if method == "tova":  # Oren et al., "Transformers are multi-state RNNs": the last query's attention
        att = obs_layer["last"][..., :n]  # [b, hq, n]: its weights on the cache (a question's own keys after)
        score = att.mean(1, keepdim=True).expand(b, h, n)  # one score per token: every KV head keeps the same
        if obs_layer.get("after"):  # the question's last query: every token of the cache is a candidate
            return score.topk(budget, dim=-1).indices.sort(-1).values
        top = score[..., : n - 1].topk(budget - 1, dim=-1).indices  # the last token is always kept
        return torch.cat([top, torch.full((b, h, 1), n - 1)], -1).sort(-1).values
    if method == "kvzip":  # Kim et al., "KVzip: query-agnostic KV cache compression with context reconstruction"
        score = obs_layer["peak"].clone()
        score[..., : min(sinks, budget)] = float("inf")  # the sinks are never evicted
        return score.topk(budget, dim=-1).indices.sort(-1).values
    if method == "h2o":
        score = obs_layer["received"] / obs_layer["seen"]
        recent = budget - budget // 2
        heavy = budget - recent
        top = score[..., : n - recent].topk(heavy, dim=-1).indices if heavy else score.new_zeros(b, h, 0).long()
        rec = torch.arange(n - recent, n).expand(b, h, recent)
        return torch.cat([top, rec], -1).sort(-1).values
    raise ValueError(f"unknown baseline {method!r}")


#: a bounded one-shot cache (``reduce(bound=True)``, the default of ``kvzip``): the newest appended tokens that
#: stay raw, and how many more arrive before the rest compete with the kept entries (ReducedLayer.compact)
BOUND_RECENT = 16
BOUND_STEP = 16


def _entry_scores(obs, layer: int, idx, present, atom, count, sinks: int, width: int):
    """``[b, h, width]``: the score each kept entry of a bounded cache starts with - the selection's own score of
    the token (kvzip: the replay's peak attention; a method without one: 0), +inf for the first ``sinks`` tokens
    and for a ``rest`` atom (never evicted), 0 for absent places."""
    b, h, _ = idx.shape
    peak = None if obs is None else getattr(obs, "peak", {}).get(layer)
    if peak is None:
        tok = torch.zeros(b, h, int(idx.max()) + 1 if idx.numel() else 1)
    else:
        tok = peak.float().clone()
    tok[..., :sinks] = float("inf")
    got = tok.gather(2, idx.clamp(max=tok.shape[-1] - 1))
    if present is not None:
        got = got.masked_fill(~present, 0.0)
    out = torch.zeros(b, h, width)
    out[..., :got.shape[-1]] = got[..., :width]
    if bool(atom.any()):  # rest: each such head's atom follows its kept tokens (place count - 1)
        place = (count.to(torch.long) - 1).clamp(min=0)
        out.scatter_(2, place[..., None], torch.where(atom[..., None], float("inf"), out.gather(2, place[..., None])))
    return out


@torch.no_grad()
def reduce(cache, model, keep: float | None = 0.1, method: str = "kvzip", *, budget: int | None = None,
           tokens=None, sinks: int = 4, seed: int = 0, observation=None, window: float = 0.0,
           form: str = "query", question=None, prompt=None, replay_chunk: int = REPLAY_CHUNK,
           allocation: str | None = None, rest: bool = False, fit: bool | str | None = None,
           bound: bool | None = None) -> ReducedCache:
    """Reduce ``cache`` (a transformers cache or anything :func:`kvcodec.to_canonical` takes) made by ``model``
    to about ``keep`` of its entries per KV head (or exactly ``budget`` for the baselines).  The model is
    switched to the mass-aware attention wrapper (:func:`kvcodec.reduction.attention.enable`); with ordinary
    caches it computes exactly what it computed before.  ``observation``: what
    :func:`kvcodec.reduction.attention.observe` recorded during the prefill that made the cache (``snapkv``,
    ``h2o`` and ``tova`` then skip their own re-run).  ``window``: the fraction of the budget kept as raw
    recent tokens (merge-reduce methods; default 0); ``form``: the mass the reducers preserve (``"query"``,
    ``"dot"``, ``"kernel"``).  ``question``: token ids of what the reduced cache will be asked, when that is
    known at reduction time (query-aware compression, SnapKV's setting): the question is run once after the
    full cache, and its queries replace the prefill's last 64: ``snapkv`` scores keys with them (no raw
    window: the question is not part of the cache), ``tova`` with the question's last one (the cache's last
    token then has to earn its place), and the ``query`` form anchors its masses at their mean; the methods
    that look at no query (``streaming``, ``h2o``, the ``dot`` and ``kernel`` forms) and ``kvzip`` (whose
    point is not to need one) refuse it.  ``prompt``: ``kvzip`` only, token ids read between the cache and its
    replay (KVzip's repeat instruction, e.g. the model's tokens of "\\n\\nRepeat the previous context
    exactly.\\n"); without it the replay follows the cache directly; ``replay_chunk``: context tokens per
    replay pass (:func:`replay_observation`; default :data:`REPLAY_CHUNK`, 512: a pass scores its tokens from
    about as far back as a question after the cache would see them, which one pass over the whole cache does
    not - measured on SmolLM2, BENCHMARKS.md).  ``observation`` for ``kvzip`` is what
    :func:`replay_observation` returned for this cache.  ``allocation``: ``"uniform"`` - every KV head of every
    layer keeps the same number of entries (the default of every method but ``kvzip``); ``"heads"`` (``kvzip``
    only, its default; KVzip's own rule) - the same total, spread over the layers and over the heads of each
    layer: one ranking of every head's replay scores over all layers (:func:`head_budgets`).  The cache holds
    each head's kept entries only; while attention runs, a layer's tensors are padded to its longest head's
    count, the other heads' extra places absent (zero, log-weight -inf: never attended to), and a ``.kvz`` file
    (format 1.8) stores only the kept entries.  Spread over the layers only, every head of a layer keeping as
    many (format 1.7): ``"ranks"`` - a layer's r-th place is worth the mean of its heads' r-th largest replay
    score, and the best places of all layers win (:func:`rank_budgets`); ``"layers"`` - each layer's mean share
    of the top single scores of every layer and head (:func:`layer_budgets`, which favours a layer with one
    sharp head); ``"layer-heads"`` gives each layer its ``ranks`` total and ranks its heads among themselves.
    Measured on SmolLM2 (BENCHMARKS.md, "Reduce tier"): every spread far ahead of uniform; heads ahead of ranks
    and ranks ahead of layers on average at every budget measured, the intervals excluding 0 at some of them.
    ``rest`` (the one-shot methods): each KV head that evicts tokens gives one of its entries to an atom standing
    for all of them - their mean key and value with log-weight log(count), so attention still sees the evicted
    tokens' mass to first order (the paper's masses on a selection); off by default (BENCHMARKS.md, "Reduce
    tier", has what it measured).  ``fit`` (``kvzip`` only; None: on for ``kvzip``): after the selection, each
    head's log-weights and values are refitted so that its attention reproduces the whole cache's - its mass
    and its output - on the replay's queries (attention matching, :mod:`kvcodec.reduction.fit`); the keys stay
    the selected ones.  Measured on SmolLM2 (BENCHMARKS.md): far better at 5-10 % kept, level at 25-50 %;
    ``fit=False`` keeps the selected tokens' own values with log-weight 0.  ``fit="policy"``: the paper's
    on-policy variant - the layers are fitted during a second replay over the reduced cache, each on queries
    computed through the layers below it once those are fitted (the cache's first :data:`POLICY_READ`
    tokens in one pass after the prompt, so its queries see the cache's end from ~n away, as a one-pass replay's
    did; one more forward pass; measured on SmolLM2, with one-pass replays, no better than ``fit=True``, so not
    the default).  The fit's reference queries come from the replay's passes: with passes of 512 tokens the
    last ones see the cache's end from as near as a question does (one pass over the whole cache lost needles
    near its end, BENCHMARKS.md).  ``bound`` (one-shot methods; None: on for ``kvzip``, the default method): the
    cache keeps its budget while tokens are appended (format 1.11) - once :data:`BOUND_RECENT` +
    :data:`BOUND_STEP` appended tokens are raw, all but the newest :data:`BOUND_RECENT` compete with the kept
    entries for their places by the largest attention weight each has received (the selection's score to begin
    with: kvzip's replay peak; then every query run on the cache), each head keeping as many entries as it
    kept (:meth:`ReducedLayer.compact`); ``bound=False`` appends every token raw (the cache then grows by one
    entry per token)."""
    if method not in METHODS:
        raise ValueError(f"unknown reduce method {method!r}; known: {', '.join(METHODS)}")
    if bound is None:
        bound = method == "kvzip"
    if bound and method in MERGE_REDUCE:
        raise ValueError(f"bound= makes appended tokens compete with a one-shot selection; {method!r} keeps reducing "
                         "what is appended by itself")
    if not hasattr(cache, "layers"):
        from ..cache import to_canonical

        cache = to_canonical(cache).to_dynamic_cache(model.config)
    full = _full_layers(cache)
    if not full:
        raise ValueError("the cache has no full-attention layer to reduce")
    n = int(cache.layers[full[0]].keys.shape[2])
    if form not in FORMS:
        raise ValueError(f"unknown mass form {form!r}; known: {', '.join(FORMS)}")
    k, w, entries = plan_for(n, keep, budget=budget, sinks=sinks, window=window)
    enable(model)
    scale = scalings(model)
    obs = observation
    need_q = method in ("snapkv", "h2o", "tova") or (method in MERGE_REDUCE and form == "query")
    batch = int(cache.layers[full[0]].keys.shape[0])
    if allocation is None:
        allocation = "heads" if method == "kvzip" else "uniform"
    if allocation not in ALLOCATIONS:
        raise ValueError(f"unknown allocation {allocation!r}; known: {', '.join(ALLOCATIONS)}")
    if allocation != "uniform" and method != "kvzip":
        raise ValueError(f"allocation {allocation!r} ranks kvzip's replay scores across layers; method {method!r} "
                         "keeps the same number of entries in every layer and head")
    if rest and method in MERGE_REDUCE:
        raise ValueError(f"rest= gives a selection's evicted tokens one atom; {method!r} summarises every token "
                         "already")
    if prompt is not None and method != "kvzip":
        raise ValueError(f"prompt= is kvzip's repeat instruction; method {method!r} reads no prompt")
    if fit is None:
        fit = method == "kvzip"
    if fit not in (True, False, "policy"):
        raise ValueError(f"fit must be True, False or 'policy', got {fit!r}")
    if fit and method not in FIT_METHODS:
        raise ValueError(f"fit= matches attention on queries the method saw (kvzip's replay, the prefill of snapkv, "
                         f"tova, h2o); method {method!r} sees none")
    if fit == "policy" and method != "kvzip":
        raise ValueError("fit='policy' fits during a second replay: kvzip only")
    if fit and question is not None and method != "kvzip":  # (kvzip refuses any question, below)
        raise ValueError("fit= matches attention on the prefill's queries; with question= pass fit=False")
    if method == "kvzip":
        if question is not None:
            raise ValueError("kvzip scores the cache by replaying it, so that no question is needed; a known "
                             "question is snapkv's or tova's setting")
        if obs is None:
            obs = replay_observation(cache, model, _cache_tokens(cache, model, tokens, batch, n), prompt,
                                     replay_chunk)
        elif prompt is not None:
            raise ValueError("pass prompt= or observation=, not both (the observation's replay had its prompt)")
        elif any(obs.peak.get(i) is None or tuple(obs.peak[i].shape) != (batch, cache.layers[i].keys.shape[1], n)
                 for i in full):
            raise ValueError("kvzip's observation= must be what replay_observation() returned for this cache")
        if fit and any(getattr(obs, "reference", {}).get(i) is None for i in full):
            raise ValueError("fit= needs the replay's reference queries: pass the observation replay_observation() "
                             "returned (its .reference), or none")
    elif question is not None:
        if not need_q or method == "h2o":
            what = f"form {form!r}" if method in MERGE_REDUCE else f"method {method!r}"
            raise ValueError(f"{what} looks at no query, so a question would change nothing; "
                             "question= needs snapkv, tova or a merge-reduce method in the query form")
        if observation is not None:
            raise ValueError("pass question= or observation=, not both")
        obs = _observe_question(cache, model, question, batch)
    elif need_q and (obs is None or (method == "h2o" and not obs.received)):
        ids = _cache_tokens(cache, model, tokens, batch, n)
        with observe(model, window=64, received=method == "h2o", stride=_reference_stride(n) if fit else 0) as obs:
            model(ids, use_cache=False)
    if fit and method != "kvzip" and any(getattr(obs, "reference", {}).get(i) is None for i in full):
        raise ValueError("fit= needs reference queries: pass an observation recorded with "
                         "observe(model, stride=...) during the prefill, or none")
    # the one-shot baselines keep tokens with no masses to weigh: their plan says "dot" (counts)
    plan = Plan(k=k, block=k, sinks=sinks, method=method if method in MERGE_REDUCE else None, seed=seed, window=w,
                form=form if method in MERGE_REDUCE else "dot", recent=BOUND_RECENT if bound else 0,
                step=BOUND_STEP if bound else 0)
    per_layer, per_head = {}, {}
    if allocation in ("layers", "ranks"):
        per_layer = (layer_budgets if allocation == "layers" else rank_budgets)(
            {i: obs.peak[i] for i in full}, entries, sinks)
    elif allocation in ("heads", "layer-heads"):
        peaks = {i: obs.peak[i] for i in full}
        per_head = head_budgets(peaks, entries, sinks,
                                rank_budgets(peaks, entries, sinks) if allocation == "layer-heads" else None)
    layers, pending, kept = [], {}, {}
    for i, layer in enumerate(cache.layers):
        if i not in full:
            layers.append(_copy_layer(layer))
            continue
        if int(layer.keys.shape[2]) != n:
            raise ValueError(f"layer {i} holds {layer.keys.shape[2]} tokens, layer {full[0]} {n}")
        red = ReducedLayer(plan, i, scale[i])
        if method in MERGE_REDUCE:
            pending.setdefault(scale[i], []).append((red, layer.keys, layer.values, _anchor(form, layer.keys, obs, i)))
        else:
            keys, values = layer.keys, layer.values
            o = None if obs is None else {"queries": obs.queries.get(i), "scaling": obs.scaling.get(i),
                                          "received": obs.received.get(i), "seen": obs.seen.get(i),
                                          "peak": obs.peak.get(i), "last": obs.last.get(i),
                                          "after": question is not None}
            present = None
            count = per_head[i] if i in per_head else torch.full((batch, keys.shape[1]), per_layer.get(i, entries))
            # rest: a head that evicts tokens and keeps more than its sinks gives its last-ranked place to the
            # evicted tokens' atom (the sinks are never given up)
            atom = (count < n) & (count > sinks) if rest else torch.zeros(count.shape, dtype=torch.bool)
            if i in per_head:
                idx, present = _select_heads(obs.peak[i], count - atom.long(), sinks)
            else:
                idx = _select(method, keys, o, int(count.max()) - int(atom.any()), sinks)
            gk, gv, beta = _with_rest(keys, values, idx, present, atom) if rest else _gather(keys, values, idx, present)
            scores = _entry_scores(obs, i, idx, present, atom, count, sinks, int(gk.shape[2])) if bound else None
            if fit is True:
                gv, beta = fit_layer(keys, values, gk, gv, beta, obs.reference[i], scale[i])
            elif fit == "policy":
                kept[i] = (gk, gv, beta)
            red.set_fixed(gk, gv, n, beta, scores)
        layers.append(red)
    for group in pending.values():  # every layer of one scaling in one batched tree
        anchors = [g[3] for g in group] if form == "query" else None
        ingest([g[0] for g in group], [g[1] for g in group], [g[2] for g in group], anchors)
    out = ReducedCache(model, plan, layers=layers, method=method)
    if kept:  # fit="policy": a second replay over the reduced cache fits each layer on its way up
        from ..tokens.plan import cache_kwarg
        from .attention import fitting

        ids = _cache_tokens(cache, model, tokens, batch, n)
        lead = getattr(obs, "prompt", None)
        lead = _per_row([] if lead is None else lead, batch, "prompt")
        fitter = _PolicyFitter(cache.layers, {i: int(v[0].shape[2]) for i, v in kept.items()}, scale)
        read = min(n, max(replay_chunk, POLICY_READ))
        limit = getattr(model.config, "max_position_embeddings", None)
        if isinstance(limit, int):  # within the model's positions (the first replay was: at least 1 token fits)
            read = max(1, min(read, limit - n - int(lead.shape[1])))
        with fitting(fitter):
            model(torch.cat([lead, ids[:, :read]], -1), **{cache_kwarg(model): copy.deepcopy(out)})
        for i, (gk, gv, beta) in kept.items():
            gv, beta = fitter.fitted.get(i, (gv, beta))
            layers[i].set_fixed(gk, gv, n, beta, layers[i].scores)
    return out
