"""How a cache was filled, and replaying it: the plan a bit-exact regeneration follows.

A cache is regenerated bit for bit only by the same sequence of forward calls
(same chunk boundaries, same batch, same attention mask and position ids) on
the same engine.  A :class:`Plan` holds everything that decides those calls:

* ``schedule``: the number of new tokens of each forward call (sums to N);
* ``padding``: left-padding length of each batch row (0 for an unpadded batch);
* ``positions``: how position ids of a padded batch were made - ``"mask"`` as
  ``generate()`` does (``cumsum(mask) - 1``, padding at 0) or ``"arange"`` as a
  plain forward call does (0..N-1 whatever the mask);
* ``pad_token``: the id at padded positions;
* ``windows``: the kind of each cache layer to fill.

:func:`replay` runs a plan; :func:`infer_plan` finds the plan that regenerates
a given cache (one prefill, the given schedule, or ``generate()``'s "prefill P,
then single steps" located by a binary search on single-step probes).
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field, replace

import torch

from ..cache import KVCache, to_canonical
from ..errors import ConfigError
from .schedule import expand

__all__ = ["Plan", "cache_kwarg", "output_cache", "call_kwargs", "new_cache", "forward", "replay", "schedule_arg",
           "step_threads", "STEP_THREADS",
           "padding_candidates", "infer_plan", "step_thread_candidates", "single_steps"]


@dataclass
class Plan:
    schedule: list[int]
    padding: list[int] = field(default_factory=list)
    positions: str = "mask"
    pad_token: int = 0
    #: per layer: the sliding window of the cache layer to fill (None = full attention), as in the original
    #: cache (a cache built without the model's config holds full layers even for sliding-window attention);
    #: None: the layers the model's config asks for; []: plain layers created as the model fills them
    windows: list | None = None
    #: intra-op threads of the one-token calls (the numerics profile's ``step_threads``): the count the cache's
    #: own one-token calls ran on, where the encoder found it (:func:`infer_plan`)
    step_threads: int = 1

    @property
    def num_tokens(self) -> int:
        return sum(self.schedule)

    def padded(self) -> bool:
        return any(self.padding)


def cache_kwarg(model) -> str:
    """Name of the forward / ``generate`` cache argument: ``cache`` (transformers >= 5.2x) or
    ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def output_cache(out):
    """The cache a forward or ``generate`` output holds, by its name in the installed transformers (``cache``, or
    ``past_key_values`` before 5.2x): reading the old name on a newer output logs a deprecation warning."""
    return out["cache"] if "cache" in out else out["past_key_values"]


def call_kwargs(plan: Plan, a: int, b: int, device) -> dict:
    """attention_mask / position_ids of the forward call over positions [a, b)."""
    if not plan.padded():
        return {}
    pad = torch.tensor(plan.padding, device=device)[:, None]
    mask = (torch.arange(b, device=device)[None, :] >= pad).long()
    if plan.positions == "mask":
        pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)[:, a:b]
    else:
        pos = torch.arange(a, b, device=device)[None, :].expand(len(plan.padding), -1)
    return {"attention_mask": mask, "position_ids": pos}


def new_cache(model, plan: Plan):
    """An empty DynamicCache whose layers are of the kinds ``plan.windows`` names."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    if plan.windows is None:
        return DynamicCache(config=model.config)
    try:  # the model's own layer kinds (state-space layers included) when they have the planned windows
        own = DynamicCache(config=model.config)
        if len(own.layers) == len(plan.windows) and all(
                getattr(la, "sliding_window", None) == w for la, w in zip(own.layers, plan.windows)):
            return own
    except Exception:  # a config DynamicCache cannot read: the planned kinds below
        pass
    cache = DynamicCache()
    if plan.windows:
        cache.layers = [DynamicSlidingWindowLayer(sliding_window=w) if w else DynamicLayer() for w in plan.windows]
    return cache


#: Intra-op threads of one-token forward calls during token-tier work: 1 (recorded in the file's numerics
#: profile as ``step_threads``), or None: torch's current count (files written before it was recorded).
#: One thread because the bits of a bf16 one-token call depend on the thread count (tested) and a fixed
#: count keeps them reproducible, and because it is the fast choice on a busy machine: measured on 2 cores,
#: SmolLM2 bf16 one-token steps took 62-84 ms on 2 threads and 83-110 ms on 1 when the machine was quiet,
#: 203-306 ms on 2 and 70-95 ms on 1 while another job held a core.
STEP_THREADS = 1
_step = {"threads": None}


@contextlib.contextmanager
def step_threads(n: int | None):
    """Within the block, one-token forward calls (:func:`forward`) run on ``n`` intra-op threads (None:
    torch's current count)."""
    old = _step["threads"]
    _step["threads"] = n
    try:
        yield
    finally:
        _step["threads"] = old


def _takes_logits_to_keep(model) -> bool:
    cls = type(model)
    if cls not in _LOGITS_TO_KEEP:
        try:
            _LOGITS_TO_KEEP[cls] = "logits_to_keep" in inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            _LOGITS_TO_KEEP[cls] = False
    return _LOGITS_TO_KEEP[cls]


_LOGITS_TO_KEEP: dict = {}


def forward(model, ids, cache, kw, all_logits: bool = True):
    """One forward call that appends ``ids`` to ``cache``; returns the logits (``all_logits=False``: the
    caller needs the cache only, so the model computes the last position's logits alone where it can — the
    head over every position was ~1/5 of a SmolLM2 prefill; the cache's bits do not depend on it).  A call of
    one token runs on the thread count :func:`step_threads` set, if any; longer calls on torch's."""
    if not all_logits and ids.shape[-1] > 1 and _takes_logits_to_keep(model):
        kw = {**kw, "logits_to_keep": 1}
    n, base = _step["threads"], torch.get_num_threads()
    if ids.shape[-1] != 1 or n is None or n == base:
        return model(ids, use_cache=True, **{cache_kwarg(model): cache}, **kw).logits
    torch.set_num_threads(n)
    try:
        return model(ids, use_cache=True, **{cache_kwarg(model): cache}, **kw).logits
    finally:
        torch.set_num_threads(base)


@torch.no_grad()
def replay(model, tokens: torch.Tensor, plan: Plan, progress=None):
    """Run ``plan``'s forward calls over ``tokens [B, N]``; returns the DynamicCache.  ``progress(n)`` after
    each call of n positions.  One-token calls run on the thread count :func:`step_threads` set (the caller
    sets ``plan.step_threads``: a decoder takes it from the file)."""
    dev = next(model.parameters()).device
    tokens = tokens.to(dev)
    cache = new_cache(model, plan)
    pos = 0
    for n in plan.schedule:
        forward(model, tokens[:, pos:pos + n], cache, call_kwargs(plan, pos, pos + n, dev), all_logits=False)
        pos += n
        if progress:
            progress(n)
    return cache


# --- finding the plan of a cache ------------------------------------------------------------
def schedule_arg(schedule, cache, n: int) -> list[int] | None:
    """The call sizes ``schedule=`` names (or a :class:`~kvcodec.tokens.RecordingCache` recorded); None: infer."""
    if schedule is None:
        rec = getattr(cache, "schedule", None)  # a RecordingCache
        if isinstance(rec, list) and rec and sum(rec) == n:
            return list(rec)
        return None
    if schedule == "prefill":
        return [n]
    if schedule == "infer":
        return None
    if isinstance(schedule, (list, tuple)) and schedule and all(isinstance(x, (list, tuple)) for x in schedule):
        sched = expand([[int(size), int(count)] for size, count in schedule])
    elif isinstance(schedule, (list, tuple)):
        sched = [int(x) for x in schedule]
    else:
        raise ConfigError("schedule must be None, 'infer', 'prefill', a list of call sizes or of [size, count] runs")
    if not sched or min(sched) < 1 or sum(sched) != n:
        raise ConfigError(f"schedule's calls add up to {sum(sched)} tokens, the cache holds {n}")
    return sched


def padding_candidates(tokens: torch.Tensor, attention_mask, model, tokenizer) -> list[tuple[list[int], int]]:
    """(padding per row, pad token) candidates, most likely first."""
    b, n = tokens.shape
    if attention_mask is not None:
        m = torch.as_tensor(attention_mask).to("cpu").long()
        if m.shape != (b, n):
            raise ConfigError(f"attention_mask must be [batch={b}, tokens={n}], not {tuple(m.shape)}")
        pads = []
        for r in range(b):
            row = m[r]
            p = int((row.cumsum(0) == 0).sum())
            if not bool((row[p:] == 1).all()) or bool((row[:p] != 0).any()) or p >= n:
                raise ConfigError(f"attention_mask row {r}: only left padding (zeros, then ones) is supported")
            pads.append(p)
        pad_tok = int(tokens[[r for r in range(b) if pads[r]][0], 0]) if any(pads) else 0
        return [(pads, pad_tok)]
    cands = [([0] * b, 0)]
    if b > 1:
        ids = {getattr(model.config, "pad_token_id", None),
               getattr(tokenizer, "pad_token_id", None) if tokenizer else None}
        ids |= {int(tokens[r, 0]) for r in range(b)}
        for pid in sorted(i for i in ids if isinstance(i, int)):
            pads = []
            for r in range(b):
                row = tokens[r] == pid
                pads.append(min(int((row.long().cumprod(0)).sum()), n - 1))
            if any(pads) and min(pads) == 0 and (pads, pid) not in cands:
                cands.append((pads, pid))
    return cands


@torch.no_grad()
def _probe_single_step(model, kv: KVCache, tokens, plan: Plan, j: int) -> bool:
    """Was position j computed as one single-token call on top of the original cache [0, j)?  (Every layer of
    ``kv`` holds all positions: the caller checks.)"""
    dev = next(model.parameters()).device
    prefix = KVCache([k[:, :, :j].clone() for k in kv.keys], [v[:, :, :j].clone() for v in kv.values],
                     sliding_window=kv.sliding_window, cumulative_length=[j] * kv.num_layers).to_dynamic_cache()
    forward(model, tokens[:, j:j + 1].to(dev), prefix, call_kwargs(plan, j, j + 1, dev))
    got = to_canonical(prefix)
    return all(torch.equal(a[:, :, j:j + 1], ga[:, :, -1:])
               for a, ga in zip(kv.keys + kv.values, got.keys + got.values))


_SCHEDULE_TRIES = 3  # prefill lengths checked from the probe's answer on


def step_thread_candidates() -> list[int]:
    """The thread counts a cache's one-token calls most likely ran on, most likely first: ``STEP_THREADS``
    (what kvcodec itself uses), torch's current count (what ``generate()`` and a hand-written loop use by
    default) and the machine's CPU count.  Each is tried with one probe call (:func:`infer_plan`)."""
    import os

    out = [STEP_THREADS]
    for t in (torch.get_num_threads(), os.cpu_count() or 1):
        if 1 <= t <= 1024 and t not in out:
            out.append(t)
    return out


def _step_probe(model, kv, tokens, plan: Plan, j: int, threads) -> int | None:
    """The first of ``threads`` on which position j, computed as one single-token call on top of the original
    prefix, reproduces the cache bit for bit; None if none does."""
    for t in threads:
        with step_threads(t):
            if _probe_single_step(model, kv, tokens, plan, j):
                return t
    return None


def infer_plan(model, kv: KVCache, tokens, candidates, given_schedule,
               threads=None) -> tuple[Plan, str, KVCache | None]:
    """Find the plan that regenerates ``kv`` bit for bit; returns (plan, how it was found, its regeneration
    when it was verified by one).  ``threads``: the thread counts to try for one-token calls (default
    :func:`step_thread_candidates`); the plan's ``step_threads`` is the one found (a one-token call's last
    bits can depend on it: a cache made by ``generate()`` under torch's default count is regenerated
    exactly only on that count)."""
    threads = list(threads or step_thread_candidates())
    n = tokens.shape[1]
    pos_modes = ["mask", "arange"]
    plans = [Plan(given_schedule or [n], pads, mode, pid, list(kv.sliding_window), threads[0])
             for pads, pid in candidates for mode in (pos_modes if any(pads) else ["mask"])]
    probe_ok = not (n < 3 or any(lay.shape[2] != n for lay in kv.keys) or kv.has_state)  # states: no prefix
    note = ""
    if given_schedule is not None:
        # the given schedule's one-token calls: which thread count reproduces the last of them?
        singles = single_steps(given_schedule)
        if singles and probe_ok and len(threads) > 1:
            found = None
            for i, plan in enumerate(plans):
                found = _step_probe(model, kv, tokens, plan, singles[-1], threads)
                if found is not None:
                    plans = [replace(p, step_threads=found) for p in [plans[i]] + plans[:i] + plans[i + 1:]]
                    break
            if found is None:
                note = f" (its one-token calls are reproduced on none of {threads} threads: residual)"
    if given_schedule is not None and len(plans) == 1:
        return plans[0], "given" + note, None
    first = None
    for plan in plans:  # one prefill (or the given schedule): cheap, and the commonest
        with step_threads(plan.step_threads):
            regen = to_canonical(replay(model, tokens, plan))
        first = regen if first is None else first
        if regen.equal(kv):
            return plan, "given" if given_schedule else "verified: one prefill", regen
    if given_schedule is not None:
        return plans[0], "given (not verified)" + note, first
    if not probe_ok:
        return plans[0], "unknown: one prefill assumed", first
    # "one prefill of P tokens, then single steps" (generate()): positions >= P pass the single-step probe
    for plan in plans:
        t = _step_probe(model, kv, tokens, plan, n - 1, threads)
        if t is None:
            continue
        plan = replace(plan, step_threads=t)
        lo, hi = 1, n - 1  # smallest j whose probe passes
        with step_threads(t):
            while lo < hi:
                mid = (lo + hi) // 2
                if _probe_single_step(model, kv, tokens, plan, mid):
                    hi = mid
                else:
                    lo = mid + 1
        on = f" on {t} thread{'s' if t > 1 else ''}"
        # The probe checks one position on top of the original prefix; a prefill of another length can give
        # the prefix other bits (other matmul blocking), and a CPU may give a position the same bits as a
        # single step and inside the prefill (bf16 here: prefill 31 passed the probe of a 32-token prefill).
        # So the prefill itself is checked, one forward call of p tokens: the first of lo, lo + 1, ... whose
        # prefill reproduces positions [0, p) bit for bit wins (the caller's replay confirms the rest).
        for p in range(lo, min(n, lo + _SCHEDULE_TRIES)):
            head = replace(plan, schedule=[p])
            got = to_canonical(replay(model, tokens[:, :p], head))
            if all(torch.equal(a[:, :, :p], b) for a, b in zip(kv.keys + kv.values, got.keys + got.values)):
                return replace(plan, schedule=[p] + [1] * (n - p)), \
                    f"inferred: prefill {p}, then {n - p} single steps{on}", None
        return replace(plan, schedule=[lo] + [1] * (n - lo)), \
            f"inferred: prefill {lo}, then {n - lo} single steps{on} (its prefill differs: residual)", None
    return plans[0], f"unknown: one prefill assumed (no single step reproduced on {threads} threads)", first


def single_steps(schedule) -> list[int]:
    """The positions a schedule's one-token calls fill, past position 0 (a first call of one token is the
    prefill of a one-token prompt)."""
    out, pos = [], 0
    for size in schedule:
        if size == 1 and pos >= 1:
            out.append(pos)
        pos += size
    return out
