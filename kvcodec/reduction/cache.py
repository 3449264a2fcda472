"""A transformers cache whose full-attention layers hold merge-reduce summaries (papers.md B.3).

Per layer and KV head the cache holds, in this order:

- ``fixed``: atoms chosen once (the one-shot baselines: StreamingLLM, SnapKV, H2O keep selected tokens here);
- ``sinks``: the first ``sinks`` tokens, raw;
- ``levels``: binary-counter buckets, level ``l`` empty or one ``K``-atom summary of ``2**l`` blocks;
- ``buffer``: the most recent tokens, raw.

Every token after the sinks enters the buffer; when the buffer holds ``window + B`` tokens (``window`` recent
tokens always stay raw, 0 in the paper's form), the oldest block leaves it as
a leaf summary (reduced to ``K`` atoms if ``B > K``) and is carried up the levels: while level ``l`` is
occupied, ``s = REDUCE(MERGE(level_l, s), K)`` and ``l`` increases.  Attention runs over all the entries, each
atom's log-weight ``beta`` added to its logit (:mod:`kvcodec.reduction.attention`), so memory stays at most
``sinks + K * popcount(blocks) + window + B + (new tokens of one call)`` entries.

Sliding-window and linear-attention layers are kept as they are (their memory is already bounded).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from ..dtypes import nonzero_entries
from ..state import REDUCE_FORMS, LayerState
from . import reducers
from .attention import set_bias

__all__ = ["ReducedCache", "ReducedLayer", "Plan", "ingest", "seed_of", "FORMS"]


@dataclass(frozen=True)
class Plan:
    """How a layer reduces: ``k`` atoms per summary, blocks of ``block`` tokens, ``sinks`` raw first tokens,
    ``window`` most recent tokens always raw, ``method`` a key of :data:`kvcodec.reduction.reducers.REDUCERS`
    or ``None`` (never reduce: append raw), ``form`` how the reducers weigh atoms (:data:`FORMS`).  ``step`` > 0
    (``method`` None only, format 1.11): the layer is **bounded** - once ``recent + step`` appended tokens are
    raw in its buffer, the next update first lets all but the ``recent`` newest compete with the kept entries
    for the kept entries' places, by the largest attention weight each has received (:meth:`ReducedLayer.compact`),
    so a head never holds more than its kept entries + ``sinks`` + ``recent + step - 1`` + one call's tokens."""

    k: int
    block: int
    sinks: int = 4
    method: str | None = "cluster"
    seed: int = 0
    window: int = 0
    form: str = "query"
    recent: int = 0
    step: int = 0

    def __post_init__(self):
        if self.form not in FORMS:
            raise ValueError(f"unknown mass form {self.form!r}; known: {', '.join(FORMS)}")
        if self.step < 0 or self.recent < 0 or (self.step and self.method is not None):
            raise ValueError(f"a bound (step > 0, recent >= 0) belongs to a one-shot plan (method None): {self}")
        if self.k < 1 or self.block < 1 or self.sinks < 0 or self.window < 0 or (
                self.method is not None and self.block < self.k):
            raise ValueError(f"reduce plan needs k >= 1, block >= 1 (>= k with a reducer: a summary never holds "
                             f"more atoms than tokens), sinks >= 0, window >= 0 (got {self})")
        if self.method is not None and self.method not in reducers.REDUCERS:
            raise ValueError(f"unknown reducer {self.method!r}; known: {sorted(reducers.REDUCERS)}")


#: How a reducer weighs atoms (:func:`kvcodec.reduction.reducers.logmass`): ``"kernel"`` the Gaussian-kernel
#: masses ``exp(beta + scaling |k|^2 / 2)`` (papers.md B.1); ``"dot"`` the token counts ``exp(beta)`` (the
#: masses seen from the zero query); ``"query"`` the masses seen from an anchor query, the mean of the queries
#: observed at the end of the prefill (per KV head; the zero query where none was observed).
FORMS = REDUCE_FORMS


def seed_of(*parts) -> int:
    """A 63-bit generator seed from the parts' text (the same on every machine)."""
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "little") >> 1


def _empty(like: torch.Tensor, dim: int | None = None):
    shape = list(like.shape)
    shape[2] = 0
    if dim is not None:
        shape[3] = dim
    return like.new_empty(shape)


class ReducedLayer(DynamicLayer):
    """One full-attention layer of a :class:`ReducedCache`."""

    is_croppable = False

    def __init__(self, plan: Plan, layer_idx: int, scaling: float):
        # storage (properties below): the fixed part as given, or packed (its heads keeping different numbers);
        # keys / values / beta held, or assembled on demand (packed layers: the padded tensors live only while
        # attention uses them)
        self._fixed = None
        self._packed = None  # (keys [N, D], values [N, Dv], beta [N], counts [B][H], longest) or None
        self._keys = self._values = self._beta = None
        self._lazy = False
        super().__init__()
        self.plan, self.layer_idx, self.scaling = plan, layer_idx, scaling
        self.fixed = None  # (k, v, beta) or None
        self.sinks = None  # (k, v)
        self.levels: list = []
        self.buffer = None  # (k, v)
        self.beta = None
        self.cumulative_length = 0
        self.blocks = 0
        self.anchor = None  # [b, kv_heads, d] query the reducers tilt the masses at, or None: kernel masses
        #: a bounded layer (``plan.step``): ``[b, kv_heads, entries]`` float32, aligned with the assembled entries,
        #: the largest attention weight each entry has received (its selection's score to begin with; +inf: never
        #: evicted); None otherwise
        self.scores = None

    # --- storage -----------------------------------------------------------------------------------------------
    @property
    def fixed(self):
        """``(keys, values, beta-or-None)`` of the fixed part, ``[b, h, n, d]`` (a packed part is padded: each
        head's absent places zero, log-weight -inf), or None."""
        return self._unpack() if self._packed is not None else self._fixed

    @fixed.setter
    def fixed(self, part):
        self._fixed, self._packed = part, None

    def _held(self, i):
        if self._lazy:
            return self.assemble()[i]
        return (self._keys, self._values, self._beta)[i]

    def _set(self, i, t):
        if self._lazy:  # something set one tensor from outside (transformers' offloading): hold them all
            self._keys, self._values, self._beta = self.assemble()
            self._lazy = False
        if i == 0:
            self._keys = t
        elif i == 1:
            self._values = t
        else:
            self._beta = t

    keys = property(lambda self: self._held(0), lambda self, t: self._set(0, t))
    values = property(lambda self: self._held(1), lambda self, t: self._set(1, t))
    beta = property(lambda self: self._held(2), lambda self, t: self._set(2, t))

    def _unpack(self, extra: int = 0):
        """The packed fixed part padded (each head's kept entries, then zeros at log-weight -inf), with ``extra``
        more places (zero, log-weight 0) after it for the other parts."""
        k, v, w, counts, n = self._packed
        b, h = len(counts), len(counts[0])
        keys, values = k.new_zeros(b, h, n + extra, k.shape[1]), v.new_zeros(b, h, n + extra, v.shape[1])
        beta = w.new_zeros(b, h, n + extra)
        beta[:, :, :n] = float("-inf")
        at = 0
        for i in range(b):
            for j in range(h):
                c = counts[i][j]
                keys[i, j, :c], values[i, j, :c], beta[i, j, :c] = k[at:at + c], v[at:at + c], w[at:at + c]
                at += c
        return keys, values, beta

    @staticmethod
    def _pack(part, counts):
        """``part`` (padded keys, values, beta) as one tensor each of every head's kept entries, in (row, head)
        order: new storage, only what the heads keep."""
        rows = [(i, j, c) for i, r in enumerate(counts) for j, c in enumerate(r)]
        return (torch.cat([part[0][i, j, :c] for i, j, c in rows]), torch.cat([part[1][i, j, :c] for i, j, c in rows]),
                torch.cat([part[2][i, j, :c] for i, j, c in rows]), counts, int(part[0].shape[2]))

    # --- state -------------------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states, value_states):
        super().lazy_initialization(key_states, value_states)
        self.sinks = (_empty(key_states), _empty(value_states))
        self.buffer = (_empty(key_states), _empty(value_states))

    def _parts(self, fixed: bool = True):
        """(keys, values, beta-or-None) of every part, oldest first (``fixed=False``: but the fixed part)."""
        out = []
        if fixed and self.fixed is not None:
            out.append(self.fixed)
        out.append((*self.sinks, None))
        for s in reversed(self.levels):
            if s is not None:
                out.append(s)
        out.append((*self.buffer, None))
        return out

    def assemble(self):
        if self._packed is not None:
            return self._assemble_packed()
        parts = self._parts()
        keys = torch.cat([p[0] for p in parts], dim=2)
        values = torch.cat([p[1] for p in parts], dim=2)
        if all(p[2] is None for p in parts):
            return keys, values, None
        b, h = keys.shape[:2]
        beta = torch.cat([p[2] if p[2] is not None else torch.zeros(b, h, p[0].shape[2]) for p in parts], dim=2)
        return keys, values, beta

    def _assemble_packed(self):
        """:meth:`assemble` of a packed layer: the padded tensors written once (each head's kept entries, then the
        other parts), not unpacked and then concatenated."""
        n = self._packed[4]
        parts = self._parts(fixed=False)
        keys, values, beta = self._unpack(sum(p[0].shape[2] for p in parts))
        at = n
        for p in parts:
            m = p[0].shape[2]
            keys[:, :, at:at + m], values[:, :, at:at + m] = p[0], p[1]
            if p[2] is not None:
                beta[:, :, at:at + m] = p[2]
            at += m
        return keys, values, beta

    def _hold(self, assembled) -> None:
        """Hold ``assembled`` (what :meth:`assemble` returned) as the layer's ``keys`` / ``values`` / ``beta``, every
        part then a view of it: the layer keeps one copy of its entries, and no part keeps alive the storage it
        was cut from (the whole cache a sink or a selection was sliced out of, the previous step's tensors)."""
        keys, values, beta = assembled
        at = 0
        fixed = None if self._packed is None else self._packed
        if fixed is None and self._fixed is not None:
            n = self._fixed[0].shape[2]
            part = (keys[:, :, :n], values[:, :, :n], None if self._fixed[2] is None else beta[:, :, :n])
            counts = self._heads(part)
            if counts is not None:  # its heads keep different numbers: kept entries only, padded when used
                fixed = self._pack(part, counts)
        if fixed is not None:
            n = fixed[4]
            keys, values = keys[:, :, n:].clone(), values[:, :, n:].clone()
            beta = None if beta is None else beta[:, :, n:].clone()
            self._keys = self._values = self._beta = None
            self._lazy = True
            self._packed, self._fixed = fixed, None
        else:
            self._keys, self._values, self._beta = keys, values, beta
            self._lazy = False

        def view(part):  # (k, v) -> (k, v); (k, v, beta-or-None) -> the same
            nonlocal at
            n = part[0].shape[2]
            out = (keys[:, :, at:at + n], values[:, :, at:at + n])
            if len(part) == 3:
                out += (None if part[2] is None else beta[:, :, at:at + n],)
            at += n
            return out

        if self._fixed is not None:
            self._fixed = view(self._fixed)
        self.sinks = view(self.sinks)
        for lvl in range(len(self.levels) - 1, -1, -1):  # assembled highest level first
            if self.levels[lvl] is not None:
                self.levels[lvl] = view(self.levels[lvl])
        self.buffer = view(self.buffer)
        assert at == keys.shape[2]

    def set_fixed(self, keys, values, tokens: int, beta=None, scores=None) -> None:
        """Hold ``keys``/``values`` (with log-weights ``beta``, default 0) as the entries of ``tokens`` tokens;
        ``scores`` ``[b, h, entries]`` (a bounded plan: each entry's score to begin with, default 0)."""
        self.lazy_initialization(keys, values)
        self.fixed = (keys, values, beta)
        self.cumulative_length = tokens
        if self.plan.step:
            self.scores = (torch.zeros(keys.shape[:3]) if scores is None else scores).float().clone()
        self._hold(self.assemble())

    def entries(self) -> int:
        """Entries per KV head of the layer's key tensor (a packed layer's: its longest head's)."""
        if self._lazy:
            rest = [self.sinks, self.buffer] + [x for x in self.levels if x is not None]
            return self._packed[4] + sum(int(p[0].shape[2]) for p in rest)
        return 0 if self.keys is None or self.keys.dim() < 3 else int(self.keys.shape[2])

    def counted(self) -> float:
        """Entries per KV head that attention can see, on average over the heads and batch rows: the held ones
        less those of log-weight -inf (padding of a head that keeps fewer than its layer holds)."""
        if self.beta is None or self.beta.numel() == 0:
            return float(self.entries())
        return float(torch.isfinite(self.beta).sum()) / (self.beta.shape[0] * self.beta.shape[1])

    # --- transformers' layer interface ------------------------------------------------------------------------
    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.plan.step:
            self.compact()
            if self.scores is None:
                self.scores = torch.zeros(key_states.shape[0], key_states.shape[1], self.entries())
            self.scores = torch.cat([self.scores, self.scores.new_zeros(*key_states.shape[:2], key_states.shape[2])], 2)
        self.cumulative_length += key_states.shape[2]
        room = self.plan.sinks - self.sinks[0].shape[2]
        if room > 0:
            self.sinks = (torch.cat([self.sinks[0], key_states[:, :, :room]], 2),
                          torch.cat([self.sinks[1], value_states[:, :, :room]], 2))
            key_states, value_states = key_states[:, :, room:], value_states[:, :, room:]
        self.buffer = (torch.cat([self.buffer[0], key_states], 2), torch.cat([self.buffer[1], value_states], 2))
        keys, values, beta = self.assemble()
        set_bias(self.layer_idx, keys, beta, self._scored if self.scores is not None else None)
        if self._flush():
            self._hold(self.assemble())
        else:
            self._hold((keys, values, beta))
        return keys, values

    def _scored(self, weights: torch.Tensor) -> None:
        """What the attention wrapper saw this call's queries give each entry (``[b, h, entries]``)."""
        if weights.shape == self.scores.shape:
            self.scores = torch.maximum(self.scores, weights.to(self.scores.device))

    def compact(self) -> bool:
        """A bounded one-shot layer (``plan.step``): when its buffer holds ``recent + step`` raw tokens or more, all
        but the ``recent`` newest compete with the ``fixed`` entries for the ``fixed`` entries' places: each head
        keeps as many entries as it held in ``fixed``, those of the highest scores (the largest attention weight
        each has received: from the selection, then from every query run on the cache; ties to the older), in
        their order (the old fixed entries, then the tokens from the buffer), log-weights and values as they
        were; the others are dropped.  The raw ``sinks`` part is never touched.  Returns whether it compacted."""
        p = self.plan
        m = 0 if self.buffer is None else int(self.buffer[0].shape[2])
        if not p.step or m < p.recent + p.step or self.scores is None:
            return False
        fixed = self.fixed
        bk, bv = self.buffer
        b, h = bk.shape[:2]
        if fixed is None:  # nothing selected (an empty cache made bounded): the buffer's tokens start the fixed part
            fixed = (bk[:, :, :0], bv[:, :, :0], None)
        fk, fv, fb = fixed
        f, move = int(fk.shape[2]), m - p.recent
        s = int(self.sinks[0].shape[2])
        fb = torch.zeros(b, h, f) if fb is None else fb.float()
        present = torch.isfinite(fb)
        count = present.sum(-1)  # each head keeps as many as its fixed part holds (spec/kvz.md section 14.4)
        ck = torch.cat([fk, bk[:, :, :move]], 2)
        cv = torch.cat([fv, bv[:, :, :move]], 2)
        cb = torch.cat([fb, fb.new_zeros(b, h, move)], 2)
        sc = self.scores
        cs = torch.cat([sc[..., :f].masked_fill(~present, float("-inf")), sc[..., f + s:f + s + move]], 2)
        cand = torch.cat([present, present.new_ones(b, h, move)], 2)
        order = cs.masked_fill(~cand, float("-inf")).sort(dim=-1, descending=True, stable=True).indices
        width = int(count.max())
        total = f + move
        keep = torch.zeros(b, h, total, dtype=torch.bool)
        keep.scatter_(2, order, torch.arange(total)[None, None, :].expand(b, h, total) < count[..., None])
        idx = torch.where(keep, torch.arange(total)[None, None, :], total).sort(-1).values[..., :width]
        have = torch.arange(width)[None, None, :] < count[..., None]
        idx = idx.masked_fill(~have, 0)
        nk = ck.gather(2, idx[..., None].expand(-1, -1, -1, ck.shape[-1])).masked_fill(~have[..., None], 0)
        nv = cv.gather(2, idx[..., None].expand(-1, -1, -1, cv.shape[-1])).masked_fill(~have[..., None], 0)
        nb = cb.gather(2, idx).masked_fill(~have, float("-inf"))
        ns = cs.gather(2, idx).masked_fill(~have, 0.0)
        plain = bool(have.all()) and not bool(torch.isneginf(nb).any())
        self.fixed = (nk, nv, None if plain and fixed[2] is None else nb)
        self.buffer = (bk[:, :, move:], bv[:, :, move:])
        self.scores = torch.cat([ns, sc[..., f:f + s], sc[..., f + s + move:]], 2)
        self._hold(self.assemble())
        return True

    def set_state(self, sinks, levels, buffer, tokens: int, blocks: int) -> None:
        """Hold a state built elsewhere (:func:`ingest`): raw ``sinks`` and ``buffer`` ``(k, v)``, ``levels`` a
        list of ``(k, v, beta)`` or ``None``, after ``tokens`` tokens of which ``blocks`` blocks were carried."""
        self.lazy_initialization(sinks[0], sinks[1])
        self.sinks, self.levels, self.buffer = sinks, levels, buffer
        self.cumulative_length, self.blocks = tokens, blocks
        self._hold(self.assemble())

    def _reduce(self, summary, *where):
        fn = reducers.REDUCERS[self.plan.method]
        gen = torch.Generator().manual_seed(seed_of(self.plan.seed, self.layer_idx, *where))
        return fn(summary, self.plan.k, self.scaling, gen, anchor=self.anchor_for(summary[0]))

    def anchor_for(self, keys):
        """The anchor query of the plan's form for atoms ``keys`` ``[b, h, n, d]`` (``None``: kernel masses)."""
        if self.plan.form == "kernel":
            return None
        if self.anchor is not None and self.plan.form == "query":
            return self.anchor
        return keys.new_zeros(keys.shape[0], keys.shape[1], keys.shape[3], dtype=torch.float32)

    def _flush(self) -> bool:
        if self.plan.method is None:
            return False
        bs, done = self.plan.block, False
        while self.buffer[0].shape[2] >= bs + self.plan.window:
            bk, bv = self.buffer[0][:, :, :bs], self.buffer[1][:, :, :bs]
            self.buffer = (self.buffer[0][:, :, bs:], self.buffer[1][:, :, bs:])
            s = (bk, bv, torch.zeros(bk.shape[:3]))
            if bs > self.plan.k:
                s = self._reduce(s, self.blocks, "leaf")
            lvl = 0
            while lvl < len(self.levels) and self.levels[lvl] is not None:
                s = self._reduce(reducers.merge(self.levels[lvl], s), self.blocks, lvl)
                self.levels[lvl] = None
                lvl += 1
            if lvl == len(self.levels):
                self.levels.append(None)
            self.levels[lvl] = s
            self.blocks += 1
            done = True
        return done

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        n = self.entries()
        return n + query_length, self.cumulative_length - n

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a reduced cache cannot be cropped: its summaries mix the tokens")

    def _map(self, fn):
        if self.fixed is not None:
            self.fixed = tuple(fn(t) for t in self.fixed)
        self.sinks = tuple(fn(t) for t in self.sinks)
        self.levels = [None if s is None else tuple(fn(t) for t in s) for s in self.levels]
        self.buffer = tuple(fn(t) for t in self.buffer)
        if self.anchor is not None:
            self.anchor = fn(self.anchor)
        if self.scores is not None:
            self.scores = fn(self.scores)
        self._hold(self.assemble())

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._map(lambda t: t[indices, ...])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def reset(self) -> None:
        self.__init__(self.plan, self.layer_idx, self.scaling)

    def to_state(self) -> LayerState:
        """The layer as a :class:`kvcodec.state.LayerState` of kind ``reduced`` (its entries are ``keys`` /
        ``values``): log-weights of every entry, the anchor (form ``query``), the parts and the scaling."""
        levels = [None if x is None else int(x[0].shape[2]) for x in self.levels]
        parts = {"fixed": 0 if self.fixed is None else int(self.fixed[0].shape[2]),
                 "sinks": int(self.sinks[0].shape[2]), "levels": levels, "buffer": int(self.buffer[0].shape[2])}
        b, h, n = self.keys.shape[:3]
        beta = self.beta if self.beta is not None else torch.zeros(b, h, n)
        heads = self._heads()
        if heads is not None:
            parts["heads"] = heads
        anchor = None
        if self.plan.form == "query":  # the zero query where none was observed (what anchor_for uses)
            anchor = self.anchor if self.anchor is not None else torch.zeros(b, h, self.keys.shape[3])
        scores = None
        if self.plan.step:  # (1.11) a bounded layer's scores, aligned with its entries
            scores = self.scores if self.scores is not None else torch.zeros(b, h, n)
            scores = scores.float().contiguous()
        return LayerState("reduced", 1, [None], [None], log_weights=beta.float().contiguous(),
                          anchor=None if anchor is None else anchor.float().contiguous(), parts=parts,
                          scaling=float(self.scaling), scores=scores)

    def _heads(self, fixed=None):
        """(format 1.8) per batch row and KV head, the entries each head holds of the fixed part (``fixed``,
        default the layer's), when the heads hold different numbers: each head's absent places (log-weight -inf)
        are the last of the fixed part, and the longest head fills it; else None (every entry is stored,
        whatever its log-weight)."""
        if fixed is None:
            if self._packed is not None:
                return [list(r) for r in self._packed[3]]
            fixed = self._fixed
        if fixed is None or fixed[2] is None or fixed[2].shape[2] == 0:
            return None
        beta = fixed[2]
        gone = torch.isneginf(beta)
        if not gone.any():
            return None
        n = (~gone).sum(-1)
        if not torch.equal(gone, torch.arange(beta.shape[2], device=beta.device)[None, None, :] >= n[..., None]) \
                or int(n.max()) != beta.shape[2]:
            return None
        if any(nonzero_entries(t)[gone].any() for t in fixed[:2]):  # masked entries holding data: stored
            return None
        return n.tolist()

    @classmethod
    def from_state(cls, plan: Plan, layer_idx: int, keys, values, tokens: int, state: LayerState) -> "ReducedLayer":
        """The inverse of :meth:`to_state`: a layer holding ``keys`` / ``values`` (the entries, in storage order)
        after ``tokens`` tokens."""
        layer = cls(plan, layer_idx, float(state.scaling))
        layer.lazy_initialization(keys, values)
        beta, p, at = state.log_weights, state.parts, 0

        def take(n, with_beta):
            nonlocal at
            out = (keys[:, :, at:at + n], values[:, :, at:at + n]) + ((beta[:, :, at:at + n],) if with_beta else ())
            at += n
            return out

        if p["fixed"]:
            layer.fixed = take(p["fixed"], True)
        layer.sinks = take(p["sinks"], False)
        levels = [None] * len(p["levels"])
        for lvl in range(len(levels) - 1, -1, -1):  # stored highest level first
            if p["levels"][lvl] is not None:
                levels[lvl] = take(p["levels"][lvl], True)
        layer.levels = levels
        layer.buffer = take(p["buffer"], False)
        layer.cumulative_length = int(tokens)
        layer.blocks = sum(1 << lvl for lvl, x in enumerate(levels) if x is not None)
        layer.anchor = state.anchor
        if plan.step:
            layer.scores = torch.zeros(keys.shape[:3]) if state.scores is None else state.scores.float().clone()
        layer._hold(layer.assemble())
        return layer

    def describe(self) -> dict:
        return {"entries": self.entries(), "tokens": self.cumulative_length, "blocks": self.blocks,
                "levels": [None if s is None else int(s[0].shape[2]) for s in self.levels],
                "buffer": int(self.buffer[0].shape[2]) if self.buffer else 0,
                "sinks": int(self.sinks[0].shape[2]) if self.sinks else 0,
                "fixed": int(self.fixed[0].shape[2]) if self.fixed is not None else 0}


def ingest(layers: list, keys: list, values: list, anchors: list | None = None) -> None:
    """Fill empty :class:`ReducedLayer` s (same plan and scaling) with whole caches ``[b, h, n, d]`` at once: the
    state the binary counter reaches after taking the ``n`` tokens in order, computed as one merge-reduce tree
    per level batched over every layer (:func:`kvcodec.reduction.tree.binary_counter`)."""
    from . import tree

    plan, scaling = layers[0].plan, layers[0].scaling
    if any(la.plan != plan or la.scaling != scaling for la in layers):
        raise ValueError("ingest: layers of different plans or scalings")
    _nl, b = len(layers), keys[0].shape[0]
    k = torch.cat(keys, 0)  # layers stacked in the batch dimension
    v = torch.cat(values, 0)
    n = k.shape[2]
    if plan.form == "kernel":
        anchors = None
    elif anchors is None or plan.form == "dot":
        anchors = [torch.zeros(x.shape[0], x.shape[1], x.shape[3]) for x in keys]
    anchor = None if anchors is None else torch.cat(anchors, 0).float()
    s = min(plan.sinks, n)
    m = max(0, n - s - plan.window) // plan.block if plan.method is not None else 0
    body = s + m * plan.block
    buckets = {}
    if m:
        leaves = tree.leaves_of(k[:, :, s:body], v[:, :, s:body], plan.block)
        fn = reducers.REDUCERS[plan.method]
        buckets = tree.binary_counter(fn, plan.k, scaling, leaves,
                                      lambda *where: seed_of(plan.seed, "ingest", *where), anchor)
    top = max(buckets) + 1 if buckets else 0
    for i, layer in enumerate(layers):
        sl = slice(i * b, (i + 1) * b)
        levels = [None if lvl not in buckets else tuple(t[0, sl] for t in buckets[lvl]) for lvl in range(top)]
        levels = [None if x is None else (x[0].to(k.dtype), x[1].to(v.dtype), x[2]) for x in levels]
        layer.set_state((k[sl, :, :s], v[sl, :, :s]), levels, (k[sl, :, body:], v[sl, :, body:]), n, m)
        layer.anchor = None if anchor is None or plan.form != "query" else anchor[sl]


class ReducedCache(DynamicCache):
    """A :class:`transformers.DynamicCache` whose full-attention layers are :class:`ReducedLayer`.

    Build one with :func:`kvcodec.reduce` (from an existing cache) or :func:`kvcodec.reduction.prefill`, or empty
    with ``ReducedCache(model, plan)`` and let the model fill it (it reduces as tokens arrive).  The model must
    have been switched to the mass-aware attention wrapper (:func:`kvcodec.reduction.attention.enable`), which
    the constructors here do."""

    def __init__(self, model, plan: Plan, *, layers=None, method: str | None = None):
        from .attention import scalings

        if model is None and layers is None:
            raise ValueError("ReducedCache: an empty cache needs the model")
        self.plan = plan
        self.config = None  # the config of the model it is bound to (bind)
        if model is not None:
            self.bind(model)
        #: what made the cache: a merge-reduce reducer or a one-shot baseline (kvcodec.reduction.METHODS)
        self.method = method or plan.method
        if layers is None:
            scale = scalings(model)
            template = DynamicCache(config=model.config)
            layers = []
            for i, layer in enumerate(template.layers):
                if type(layer) is DynamicLayer:
                    if i not in scale:
                        raise ValueError(f"layer {i}: no attention module with a scaling found in the model")
                    layers.append(ReducedLayer(plan, i, scale[i]))
                else:
                    layers.append(layer)
        Cache.__init__(self, layers=layers)

    def bind(self, model) -> "ReducedCache":
        """Switch ``model`` to the mass-aware attention (:func:`kvcodec.reduction.attention.enable`) and remember
        it: the cache refuses to run on a model whose attention would ignore its atoms' masses."""
        from .attention import enable

        enable(model)
        self.config = model.config
        return self

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        from ..errors import ConfigError
        from .attention import enabled_name

        if isinstance(self.layers[layer_idx], ReducedLayer) and (
                self.config is None or enabled_name(self.config) is None):
            raise ConfigError("this reduced cache is not bound to a model whose attention applies its atoms' masses "
                              "(they would be ignored): decode it with kvcodec.decode(..., model) / load(..., model), "
                              "or call cache.bind(model) first" if self.config is None else
                              "the model this reduced cache is bound to was switched away from the mass-aware "
                              "attention: call cache.bind(model) again")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def reduced_layers(self) -> list[ReducedLayer]:
        return [layer for layer in self.layers if isinstance(layer, ReducedLayer)]

    def entries(self) -> int:
        """Entries (atoms + raw tokens) per KV head held by a reduced layer: their mean over the reduced layers,
        rounded (every layer holds as many unless the budget was spread over the layers; where the heads of a
        layer keep different numbers, the layer holds its longest head's, :meth:`counted` the entries kept)."""
        red = self.reduced_layers()
        return round(sum(la.entries() for la in red) / len(red)) if red else 0

    def counted(self) -> float:
        """Entries per KV head that attention sees (:meth:`ReducedLayer.counted`), on average over the reduced
        layers; less than :meth:`entries` where a layer's heads keep different numbers (``allocation="heads"``)."""
        red = self.reduced_layers()
        return sum(la.counted() for la in red) / len(red) if red else 0.0

    def nbytes(self) -> int:
        """Bytes of memory the cache's layers hold: every tensor they reference, each storage counted once
        (a view costs what its whole storage costs)."""
        seen: dict = {}

        def visit(x):
            if isinstance(x, torch.Tensor):
                st = x.untyped_storage()
                seen[(st.device, st.data_ptr())] = st.nbytes()
            elif isinstance(x, (list, tuple)):
                for y in x:
                    visit(y)

        for layer in self.layers:
            for v in vars(layer).values():
                visit(v)
        return sum(seen.values())

    def kvcodec_reduce(self) -> dict:
        """The header's ``reduce`` object (spec/kvz.md section 14): how the cache was reduced and how it keeps
        reducing as tokens are appended."""
        p = self.plan
        out = {"method": self.method, "reducer": p.method, "form": p.form, "k": p.k, "block": p.block,
               "sinks": p.sinks, "window": p.window, "seed": p.seed}
        if p.step:  # (1.11) appended tokens compete for the kept entries' places
            out["bound"] = {"recent": p.recent, "step": p.step}
        return out

    @classmethod
    def from_canonical(cls, kv, model=None) -> "ReducedCache":
        """A :class:`kvcodec.KVCache` whose ``reduce`` is set (what a reduced ``.kvz`` decodes to) as a
        ReducedCache; ``model`` (optional) is switched to the mass-aware attention."""
        r = kv.reduce
        bound = r.get("bound") or {}
        plan = Plan(k=r["k"], block=r["block"], sinks=r["sinks"], method=r["reducer"], seed=r["seed"],
                    window=r["window"], form=r["form"], recent=bound.get("recent", 0), step=bound.get("step", 0))
        plain = kv.to_dynamic_cache(plain=True)
        layers = []
        for i, st in enumerate(kv.states):
            if st is not None and st.kind == "reduced":
                layers.append(ReducedLayer.from_state(plan, i, kv.keys[i], kv.values[i], kv.cumulative_length[i], st))
            else:
                layers.append(plain.layers[i])
        return cls(model, plan, layers=layers, method=r["method"])

    def describe(self) -> dict:
        red = self.reduced_layers()
        d = red[0].describe() if red else {}
        if red:  # entries per KV head: the mean over the layers (they differ where the budget was spread)
            kept = self.counted()
            d["entries"] = round(kept)
            if kept != sum(la.entries() for la in red) / len(red):  # heads of a layer differ: held
                d["held"] = self.entries()
        return {"k": self.plan.k, "block": self.plan.block, "sinks": self.plan.sinks, "method": self.plan.method,
                "seed": self.plan.seed, **d,
                "keep": (sum(la.counted() for la in red) / (len(red) * d["tokens"])) if d.get("tokens") else None}
