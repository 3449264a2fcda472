"""The JSON header of a .kvz file: building, canonical serialisation, validation.

The header is UTF-8 JSON written canonically (sorted keys, no whitespace,
``ensure_ascii=False``), so re-encoding a decoded cache gives identical bytes.
Validation is strict: every field is type- and range-checked against the
limits before anything is allocated from it, and unknown keys are errors
except under ``info`` (free-form, informative) and keys starting with ``x-``.

This module knows the parts every tier shares (``format``, ``tier``,
``codec``, ``cache``, ``model``); what a tier adds - its own header object
(``tokens``), its rules, its sections - comes from the tier's hooks
(:class:`kvcodec.tiers.base.Tier`), found through :mod:`kvcodec.registry`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace

from .. import registry
from ..dtypes import DTYPES
from ..errors import FormatError, LimitExceeded, UnknownId
from . import layout as L

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
#: the format minor version of ``layers[].repeat`` (1.1): a file stamped 1.0 with it is invalid (spec section 3)
REPEAT_MINOR = 1
#: the format minor version that introduced layer states (``layers[i].state``, ``state`` sections)
STATE_MINOR = 3
#: the format minor version that introduced reduced caches (the ``reduce`` object, state kind ``reduced``)
REDUCE_MINOR = 4
#: the format minor version that introduced predicted lossy slices (the ``predict`` object, spec section 13.1)
PREDICT_MINOR = 6
#: the format minor version that introduced each ``reduce.method`` (spec section 14.1; ``tova`` and ``kvzip``
#: came with 1.7)
REDUCE_METHOD_MINOR = {"cluster": REDUCE_MINOR, "sample": REDUCE_MINOR, "streaming": REDUCE_MINOR,
                       "snapkv": REDUCE_MINOR, "h2o": REDUCE_MINOR, "tova": 7, "kvzip": 7}


def reduce_minor(reduce: dict) -> int:
    """The lowest minor version that has a ``reduce`` object with this ``method`` (an unknown method is the
    parser's to refuse: it counts as the latest)."""
    return REDUCE_METHOD_MINOR.get(reduce.get("method"), L.FORMAT_VERSION_MINOR)


def is_hex64(text: str) -> bool:
    """64 lowercase hex digits: the form of every fingerprint in a header."""
    return bool(_HEX64.match(text))


def dumps(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


@dataclass(frozen=True)
class StateTensor:
    name: str  # "conv" or "recurrent"
    slot: int
    dtype: str
    shape: tuple[int, ...]

    def nbytes(self) -> int:
        n = DTYPES[self.dtype].itemsize
        for x in self.shape:
            n *= x
        return n


@dataclass(frozen=True)
class StateInfo:
    kind: str  # "linear", "hybrid", "indexed" or "reduced" (kvcodec.state.KINDS)
    slots: int
    tensors: tuple[StateTensor, ...]
    parts: dict | None = None  # kind "reduced": entries per part (kvcodec.state.REDUCED_PARTS)
    scaling: float | None = None  # kind "reduced": the attention's factor on <q, k>

    def descriptor(self) -> dict:
        """The header's ``layers[i].state`` object (as :meth:`kvcodec.state.LayerState.descriptor` writes it)."""
        d = {"kind": self.kind, "slots": self.slots,
             "tensors": [{"name": t.name, "slot": t.slot, "dtype": t.dtype, "shape": list(t.shape)}
                         for t in self.tensors]}
        if self.kind == "reduced":
            d.update(parts=self.parts, scaling=self.scaling)
        return d


#: the format minor version that let the heads of a reduced layer hold different numbers of entries
#: (``parts.heads``, spec section 14.2)
HEADS_MINOR = 8
#: the format minor version that introduced token model ``blocks`` (procedure ``lm-blocks-v1``)
BLOCKS_MINOR = 9
#: the format minor version that introduced engine files (the ``engine_file`` object, ``engine_bytes`` section:
#: spec section 15)
ENGINE_MINOR = 10
#: the format minor version that introduced bounded reduced caches (``reduce.bound``, the ``scores`` state tensor:
#: spec section 14)
BOUND_MINOR = 11
#: the format minor version that introduced ``model.weights``, the fingerprint any implementation computes from a
#: model's tensors (spec section 4.1)
WEIGHTS_MINOR = 12
#: most pieces an ``engine_file`` may list (spec section 15)
MAX_ENGINE_PIECES = 1 << 20


@dataclass(frozen=True)
class Run:
    """The entries one ``kv`` slice covers (spec section 5, "Slices").  A layer whose heads all hold its
    ``seq_len`` entries is cut into chunks of every batch row and head at once: ``row`` None, entries
    ``[start, stop)`` of the layer.  (1.8) A reduced layer with ``parts.heads`` is cut head by head: ``row`` =
    (batch row, KV head), entries ``[start, stop)`` of that head's stored sequence (its first ``n`` entries, then
    the layer's entries from ``fixed`` on: the absent places between are not stored)."""

    row: tuple[int, int] | None
    start: int
    stop: int
    total: int  #: entries of the layer (``row`` None) or of the head's stored sequence
    n: int = 0  #: the head's fixed entries (``row`` set)
    fixed: int = 0  #: the layer's fixed part (``row`` set)

    def spans(self) -> tuple[tuple[int, int, int], ...]:
        """``(lo, hi, position)``: the slice's entries ``[lo, hi)`` are the layer's from ``position`` on."""
        if self.row is None:
            return ((0, self.stop - self.start, self.start),)
        out = []
        if self.start < self.n:
            out.append((0, min(self.stop, self.n) - self.start, self.start))
        if self.stop > self.n:
            lo = max(self.start, self.n)
            out.append((lo - self.start, self.stop - self.start, lo + self.fixed - self.n))
        return tuple(out)


def layer_runs(seq: int, chunk_tokens: int, heads=None, fixed: int = 0) -> tuple[Run, ...]:
    """Every slice of a layer of ``seq`` entries, in canonical order (spec section 5): chunks of ``chunk_tokens``
    entries; with ``heads`` (1.8: per batch row, per KV head, the fixed entries the head holds, of the layer's
    ``fixed``) each head's stored sequence chunked in turn, rows and heads in order, heads storing nothing
    skipped."""
    if heads is None:
        return tuple(Run(None, a, min(seq, a + chunk_tokens), seq) for a in range(0, seq, chunk_tokens))
    out = []
    for b, row in enumerate(heads):
        for h, n in enumerate(row):
            total = n + seq - fixed
            out += [Run((b, h), a, min(total, a + chunk_tokens), total, n, fixed)
                    for a in range(0, total, chunk_tokens)]
    return tuple(out)


@dataclass(frozen=True)
class LayerInfo:
    kv_heads: int
    k_dim: int
    v_dim: int
    seq_len: int
    sliding_window: int | None
    cumulative_length: int
    state: StateInfo | None = None  # (1.3) recurrent / conv state

    def dim(self, part: int) -> int:
        """Head dimension of the keys (``part`` 0) or the values (1)."""
        return self.k_dim if part == L.PART_KEYS else self.v_dim

    @property
    def heads(self):
        """(1.8) per batch row, per KV head, the fixed entries each head of a reduced layer holds (a list of
        lists), or None: every head holds ``seq_len``."""
        parts = None if self.state is None else self.state.parts
        return None if parts is None else parts.get("heads")

    def _memo(self, key, make):
        """A value computed once per layer object (the dataclass is frozen: kept beside its fields)."""
        memo = self.__dict__.setdefault("_memo_values", {})
        if key not in memo:
            memo[key] = make()
        return memo[key]

    def runs(self, chunk_tokens: int) -> tuple[Run, ...]:
        """The layer's slices (:func:`layer_runs`), chunk index by chunk index (made once per layer)."""
        if self.heads is None:
            return self._memo(("runs", chunk_tokens), lambda: layer_runs(self.seq_len, chunk_tokens))
        return self._memo(("runs", chunk_tokens), lambda: layer_runs(self.seq_len, chunk_tokens, self.heads,
                                                                      self.state.parts["fixed"]))

    def chunks(self, chunk_tokens: int) -> int:
        if self.heads is None:
            return -(-self.seq_len // chunk_tokens)
        tail = self.seq_len - self.state.parts["fixed"]  # counted without making the runs (a hostile header)
        return self._memo(("chunks", chunk_tokens),
                          lambda: sum(-(-(n + tail) // chunk_tokens) for row in self.heads for n in row))

    def chunk_range(self, chunk: int, chunk_tokens: int) -> tuple[int, int]:
        """Entries ``[a, b)`` of chunk ``chunk``: of the layer, or (1.8, ``heads``) of its head's stored
        sequence (:meth:`runs` says which head)."""
        if self.heads is not None:
            r = self.runs(chunk_tokens)[chunk]
            return r.start, r.stop
        a = chunk * chunk_tokens
        return a, min(self.seq_len, a + chunk_tokens)

    def slice_shape(self, chunk: int, chunk_tokens: int, batch: int, part: int) -> tuple[int, int, int, int]:
        """The tensor shape of a slice: ``[B, H, T, D]``, or ``[1, 1, T, D]`` for one head (``heads``)."""
        a, b = self.chunk_range(chunk, chunk_tokens)
        if self.heads is not None:
            return (1, 1, b - a, self.dim(part))
        return (batch, self.kv_heads, b - a, self.dim(part))


@dataclass(frozen=True)
class Header:
    raw: dict
    tier: str
    codec_id: str
    codec_params: dict
    dtype: str
    batch: int
    chunk_tokens: int
    start_position: int
    num_tokens: int
    layers: tuple[LayerInfo, ...]
    model: dict | None
    #: what the tier's ``parse_header`` hook made of its own header object (token tiers: the ``tokens`` object)
    tier_info: object = None
    #: (1.4) the ``reduce`` object of a reduced cache, validated, or None
    reduce: dict | None = None
    #: (1.6) the ``predict`` object of a lossy file whose slices are residuals of a prediction, or None
    predict: dict | None = None
    #: (1.10) the ``engine_file`` object of a file that rebuilds an engine's own state file, validated, or None
    engine: dict | None = None

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype].itemsize

    def slices(self):
        """``(layer, part, chunk)`` of every kv / residual slice, in canonical order."""
        return [(li, part, c) for li, lay in enumerate(self.layers) for c in range(lay.chunks(self.chunk_tokens))
                for part in (L.PART_KEYS, L.PART_VALUES)]

    def expected_sections(self):
        """Canonical section order: ``[((type, layer, part, chunk), optional), ...]`` (the tier's)."""
        return registry.tier(self.tier).sections(self)

    def state_sections(self):
        """``(layer, index)`` of every ``state`` section (1.3), in canonical order."""
        return [(li, j) for li, lay in enumerate(self.layers) if lay.state is not None
                for j in range(len(lay.state.tensors))]

    @property
    def has_state(self) -> bool:
        return any(lay.state is not None for lay in self.layers)

    @property
    def min_minor(self) -> int:
        """The lowest format minor version that can express this file (the tier's; 3 with layer states, 4 for a
        reduced cache, 7 for one reduced by ``tova`` or ``kvzip``)."""
        return max(registry.tier(self.tier).min_minor, self._feature_minor())

    @property
    def read_minor(self) -> int:
        """The lowest minor version a file of this tier may state (older revisions this decoder still reads)."""
        t = registry.tier(self.tier)
        return max(t.min_minor if t.read_minor is None else t.read_minor, self._feature_minor())

    def _feature_minor(self) -> int:
        draft = (self.raw.get("tokens") or {}).get("draft")
        weights = WEIGHTS_MINOR if any(isinstance(m, dict) and "weights" in m for m in (self.model, draft)) else 0
        return max(weights, self._structure_minor())

    def _structure_minor(self) -> int:
        blocks = BLOCKS_MINOR if getattr(getattr(self, "tier_info", None), "token_model", None) == "blocks" else 0
        if self.engine is not None:
            return ENGINE_MINOR
        if self.predict is not None:
            return PREDICT_MINOR
        if self.reduce is not None:
            bound = BOUND_MINOR if "bound" in self.reduce else 0
            if any(lay.heads is not None for lay in self.layers):
                return max(bound, HEADS_MINOR, reduce_minor(self.reduce))
            return max(bound, reduce_minor(self.reduce))
        repeat = REPEAT_MINOR if any("repeat" in lay for lay in self.raw["cache"]["layers"]) else 0
        return max(blocks, repeat, STATE_MINOR if self.has_state else 0)

    def output_bytes(self) -> int:
        """What the limit ``max_output_bytes`` bounds (spec section 4): the tensors, the layer states and 4
        bytes per token id."""
        return self.tensor_bytes() + self.state_bytes() + 4 * self.batch * self.num_tokens

    def state_bytes(self) -> int:
        return sum(t.nbytes() for lay in self.layers if lay.state is not None for t in lay.state.tensors)

    def tensor_bytes(self) -> int:
        return sum(self.batch * lay.kv_heads * lay.seq_len * (lay.k_dim + lay.v_dim) * self.itemsize
                   for lay in self.layers)


class Validator:
    """Typed accessors that name the JSON path in every error (tiers validate their own objects with it)."""

    def __init__(self, offset: int):
        self.offset = offset

    def fail(self, path: str, msg: str, cls=FormatError):
        raise cls(f"header {path}: {msg}", field=f"Header.{path}", offset=self.offset)

    def obj(self, d, path, required: set, optional: set = frozenset()):
        if not isinstance(d, dict):
            self.fail(path, "must be an object")
        missing = required - d.keys()
        if missing:
            self.fail(path, f"missing keys {sorted(missing)}")
        extra = {k for k in d.keys() - required - optional if not k.startswith("x-")}
        if extra:
            self.fail(path, f"unknown keys {sorted(extra)}")
        return d

    def int(self, d, key, path, lo, hi, cls=FormatError):
        v = d[key]
        if not isinstance(v, int) or isinstance(v, bool):
            self.fail(f"{path}.{key}", f"must be an integer, not {type(v).__name__}")
        if not lo <= v <= hi:
            self.fail(f"{path}.{key}", f"{v} outside [{lo}, {hi}]", cls if v > hi else FormatError)
        return v

    def num(self, d, key, path, optional_null=True):
        v = d[key]
        if v is None and optional_null:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
            self.fail(f"{path}.{key}", "must be a non-negative number" + (" or null" if optional_null else ""))
        return float(v)

    def str(self, d, key, path):
        v = d[key]
        if not isinstance(v, str):
            self.fail(f"{path}.{key}", "must be a string")
        return v


#: JSON limits of spec section 4, checked everywhere in the header (``info`` included)
MAX_JSON_DEPTH = 32
MAX_NUMBER_CHARS = 40
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")


def _depth(text: str) -> int:
    """The deepest nesting of objects and arrays, strings skipped (a bounded scan, no recursion)."""
    import numpy as np

    bare = _STRING.sub("", text).encode("utf-8", "surrogatepass")
    b = np.frombuffer(bare, dtype=np.uint8)
    step = np.isin(b, (0x5B, 0x7B)).astype(np.int32) - np.isin(b, (0x5D, 0x7D)).astype(np.int32)
    return int(np.cumsum(step).max(initial=0))


def _loads(text: str, offset: int):
    """Strict JSON: no duplicate keys, no NaN/Infinity, nesting <= MAX_JSON_DEPTH, numbers of at most
    MAX_NUMBER_CHARS characters that are finite binary64 values, no lone surrogate in any string."""
    def fail(msg, pos=0):
        raise FormatError(f"header {msg}", field="Header", offset=offset + pos)

    if _depth(text) > MAX_JSON_DEPTH:
        fail(f"nests deeper than {MAX_JSON_DEPTH} levels")

    def no_dupes(pairs):
        keys = [k for k, _ in pairs]
        if len(keys) != len(set(keys)):
            fail(f"has a duplicate key {sorted(k for k in keys if keys.count(k) > 1)[0]!r}")
        for k in keys:
            _no_surrogate(k, fail)
        return dict(pairs)

    def bad_const(c):
        fail(f"contains {c}")

    def number(s):
        if len(s) > MAX_NUMBER_CHARS:
            fail(f"has a number of {len(s)} characters (at most {MAX_NUMBER_CHARS})")
        if "." in s or "e" in s or "E" in s:
            x = float(s)
            if not math.isfinite(x):
                fail(f"has the number {s[:20]}, which is not a finite binary64 value")
            return x
        return int(s)

    try:
        obj = json.loads(text, object_pairs_hook=no_dupes, parse_constant=bad_const, parse_int=number,
                         parse_float=number)
    except json.JSONDecodeError as e:
        fail(f"is not JSON: {e.msg}", e.pos)
    except RecursionError:  # unreachable after the depth scan; kept so no RecursionError can escape
        fail("nests too deeply")
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            _no_surrogate(x, fail)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return obj


def _no_surrogate(s: str, fail) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        fail(f"has a string with a lone surrogate escape ({s[:20]!r})")


def parse(data: bytes, *, offset: int, limits: dict | None = None) -> Header:
    """Parse and validate header bytes located at ``offset`` in the file."""
    lim = {"max_layers": L.MAX_LAYERS, "max_batch": L.MAX_BATCH, "max_heads": L.MAX_HEADS,
           "max_head_dim": L.MAX_HEAD_DIM, "max_seq_len": L.MAX_SEQ_LEN,
           "max_rope_steps": L.MAX_ROPE_STEPS,
           "max_output_bytes": L.default_max_output_bytes(), **(limits or {})}
    v = Validator(offset)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FormatError(f"header is not UTF-8: {e.reason} at byte {e.start}", field="Header",
                          offset=offset + e.start) from None

    obj = _loads(text, offset)
    tier_keys = registry.tier_header_keys()
    v.obj(obj, "", {"format", "tier", "codec", "cache", "model"},
          {"info", "reduce", "predict", "engine_file"} | tier_keys)
    if obj["format"] != "kvz":
        v.fail("format", f"must be 'kvz', not {obj['format']!r}")
    tier_id = v.str(obj, "tier", "")
    if not registry.has_tier(tier_id):
        v.fail("tier", f"unknown tier {tier_id!r} (this decoder reads {registry.tier_ids()})", UnknownId)
    tier = registry.tier(tier_id)
    for key in sorted(tier_keys & obj.keys()):
        if key != tier.header_key:
            v.fail(key, f"not allowed in tier {tier_id!r}")
    codec = v.obj(obj["codec"], "codec", {"id", "params"})
    cid = v.str(codec, "id", "codec")
    if cid not in tier.codec_ids:
        v.fail("codec.id", f"unknown codec {cid!r} for tier {tier_id!r}", UnknownId)
    if not isinstance(codec["params"], dict):
        v.fail("codec.params", "must be an object")
    cache = v.obj(obj["cache"], "cache", {"dtype", "batch", "chunk_tokens", "start_position", "num_tokens", "layers"})
    dtype = v.str(cache, "dtype", "cache")
    if dtype not in DTYPES:
        v.fail("cache.dtype", f"unknown dtype {dtype!r}", UnknownId)
    batch = v.int(cache, "batch", "cache", 1, lim["max_batch"], LimitExceeded)
    chunk = v.int(cache, "chunk_tokens", "cache", 1, L.MAX_CHUNK_TOKENS, LimitExceeded)
    start = v.int(cache, "start_position", "cache", 0, lim["max_seq_len"], LimitExceeded)
    ntok = v.int(cache, "num_tokens", "cache", 0, lim["max_seq_len"], LimitExceeded)
    predict = None
    if "predict" in obj:
        if tier_id != "lossy":
            v.fail("predict", f"not allowed in tier {tier_id!r} (predicted slices are tier 'lossy''s)")
        if "reduce" in obj:
            v.fail("predict", "a reduced cache's entries are not positions: it cannot be predicted")
        predict = v.obj(obj["predict"], "predict", {"predictors", "layout", "exact_head", "exact_tail"})
        for key in ("exact_head", "exact_tail"):
            v.int(predict, key, "predict", 0, lim["max_seq_len"], LimitExceeded)
        pid = predict["predictors"]
        if not (isinstance(pid, str) and len(pid) == 64 and all(c in "0123456789abcdef" for c in pid)):
            v.fail("predict.predictors", "must be the predictors' SHA-256, 64 lowercase hex digits")
        if predict["layout"] != "rotate_half":
            v.fail("predict.layout", f"unknown rotary layout {predict['layout']!r} (this decoder reads 'rotate_half')",
                   UnknownId)
    reduce = None
    if "reduce" in obj:
        if tier.header_key is not None:
            v.fail("reduce", f"not allowed in tier {tier_id!r}: a reduced cache is stored by the tiers that store "
                             "its tensors (lossless, lossy)")
        reduce = _parse_reduce(v, obj["reduce"], lim)
    layers_raw = cache["layers"]
    if not isinstance(layers_raw, list):
        v.fail("cache.layers", "must be a list")
    if not 1 <= len(layers_raw) <= lim["max_layers"]:
        v.fail("cache.layers", f"{len(layers_raw)} layers outside [1, {lim['max_layers']}]",
               LimitExceeded if len(layers_raw) else FormatError)
    layers = []
    for i, lr in enumerate(layers_raw):
        p = f"cache.layers[{i}]"
        v.obj(lr, p, {"kv_heads", "k_dim", "v_dim", "seq_len", "sliding_window", "cumulative_length"},
              {"repeat", "state"})
        repeat = v.int(lr, "repeat", p, 2, lim["max_layers"], LimitExceeded) if "repeat" in lr else 1
        if len(layers) + repeat > lim["max_layers"]:
            v.fail(p, f"more than {lim['max_layers']} layers", LimitExceeded)
        heads = v.int(lr, "kv_heads", p, 1, lim["max_heads"], LimitExceeded)
        kd = v.int(lr, "k_dim", p, 1, lim["max_head_dim"], LimitExceeded)
        vd = v.int(lr, "v_dim", p, 1, lim["max_head_dim"], LimitExceeded)
        seq = v.int(lr, "seq_len", p, 0, lim["max_seq_len"], LimitExceeded)
        sw = lr["sliding_window"]
        if sw is not None:
            sw = v.int(lr, "sliding_window", p, 1, lim["max_seq_len"], LimitExceeded)
        cum = v.int(lr, "cumulative_length", p, seq, lim["max_seq_len"] + (1 << 32), LimitExceeded)
        state = _parse_state(v, lr["state"], f"{p}.state", batch, lim) if "state" in lr else None
        reduced = state is not None and state.kind == "reduced"
        if sw is None and cum != seq and not reduced:
            v.fail(f"{p}.cumulative_length", "must equal seq_len for a full-attention layer")
        if reduced:
            _check_reduced(v, p, state, reduce, heads, kd, seq, sw, cum)
        if state is not None and state.kind == "indexed" and (
                sw is not None or state.tensors[0].shape[1] != seq):
            v.fail(f"{p}.state", "indexer_keys hold one row per cached token ([batch, seq_len, index_dim]) of a "
                                 "full-attention layer")
        if state is not None and state.kind == "linear" and (heads, kd, vd, seq, sw, cum) != (1, 1, 1, 0, None, 0):
            v.fail(p, "a linear (state-only) layer has kv_heads, k_dim, v_dim 1, seq_len and cumulative_length 0 "
                      "and no sliding_window")
        layers += [LayerInfo(heads, kd, vd, seq, sw, cum, state)] * repeat
    model = obj["model"]
    if model is not None:
        v.obj(model, "model", {"fingerprint"}, {"name", "architecture", "tokenizer", "weights"})
        for key in ("fingerprint", "tokenizer", "weights"):
            if key in model and not is_hex64(v.str(model, key, "model")):
                v.fail(f"model.{key}", "must be 64 lowercase hex digits")
    if reduce is not None and not any(lay.state is not None and lay.state.kind == "reduced" for lay in layers):
        v.fail("reduce", "a reduced cache has at least one layer of state kind 'reduced'")
    if reduce is not None and ntok:
        v.fail("cache.num_tokens", "a reduced cache stores no token ids (0)")
    engine = None
    if "engine_file" in obj:
        if tier_id not in ("lossless", "lossy") or reduce is not None or predict is not None:
            v.fail("engine_file", "allowed in tiers 'lossless' and 'lossy' only, without 'reduce' or 'predict'")
        engine = _parse_engine_file(v, obj["engine_file"], tier_id, batch, dtype, layers, lim)
    hdr = Header(obj, tier_id, cid, codec["params"], dtype, batch, chunk, start, ntok, tuple(layers), model,
                 reduce=reduce, predict=predict, engine=engine)
    if predict is not None and (layers[0].k_dim % 2 or any(
            (lay.seq_len, lay.kv_heads, lay.k_dim, lay.v_dim, lay.state, lay.sliding_window)
            != (layers[0].seq_len, layers[0].kv_heads, layers[0].k_dim, layers[0].k_dim, None, None)
            for lay in layers)):
        v.fail("predict", "predicted layers must all hold the same tokens, heads and an even dimension (keys = "
                          "values), without layer state or sliding window")
    if predict is not None and (start + layers[0].seq_len) * (layers[0].k_dim // 2) > lim["max_rope_steps"]:
        v.fail("predict", f"positions up to {start + layers[0].seq_len} with {layers[0].k_dim // 2} rotary pairs need "
                          f"more than {lim['max_rope_steps']} steps of the RoPE recurrence", LimitExceeded)
    if predict is not None and predict["exact_head"] + predict["exact_tail"] > layers[0].seq_len:
        v.fail("predict.exact_tail", f"{predict['exact_head']} + {predict['exact_tail']} exact tokens exceed the "
                                     f"layers' {layers[0].seq_len}")
    if tier.header_key is not None and tier.header_key not in obj:
        v.fail(tier.header_key, f"missing: tier {tier_id!r} needs the {tier.header_key} object")
    hdr = replace(hdr, tier_info=tier.parse_header(v, hdr, lim))
    # a repeated layer is one object (its chunks, O(batch x heads) with parts.heads, are counted once)
    if 2 * sum(lay.chunks(chunk) for lay in layers) + 2 + batch + len(hdr.state_sections()) > L.MAX_SECTIONS:
        v.fail("cache.chunk_tokens", f"the cache would need more than {L.MAX_SECTIONS} sections", LimitExceeded)
    if hdr.output_bytes() > lim["max_output_bytes"]:
        v.fail("cache.layers", f"decoded tensors, states and token ids would take {hdr.output_bytes()} bytes, over the "
               f"limit of "
               f"{lim['max_output_bytes']} (pass limits={{'max_output_bytes': ...}} to allow)", LimitExceeded)
    return hdr


def _parse_engine_file(v: Validator, ef, tier_id: str, batch: int, dtype: str, layers: list, lim: dict) -> dict:
    """(1.10) The ``engine_file`` object (spec section 15): what the file's bytes rebuild, piece by piece.  Returns
    it with ``pieces`` as tuples: ``("bytes", offset, length)``, ``("keys" | "values", layer, order)``."""
    p = "engine_file"
    v.obj(ef, p, {"engine", "kind", "length", "verbatim", "sha256", "pieces", "model"}, {"recompute"})
    v.str(ef, "engine", p)
    v.str(ef, "kind", p)
    length = v.int(ef, "length", p, 0, lim["max_output_bytes"], LimitExceeded)
    verbatim = v.int(ef, "verbatim", p, 0, length, FormatError)
    digest = ef["sha256"]
    if tier_id == "lossless":
        if not (isinstance(digest, str) and is_hex64(digest)):
            v.fail(f"{p}.sha256", "tier 'lossless': must be the SHA-256 of the file rebuilt, 64 lowercase hex digits")
    elif digest is not None:
        v.fail(f"{p}.sha256", f"tier {tier_id!r} rebuilds another file than the one packed: must be null")
    model = ef["model"]
    if model is not None:
        v.obj(model, f"{p}.model", {"file_sha256"}, {"name", "architecture"})
        if not is_hex64(v.str(model, "file_sha256", f"{p}.model")):
            v.fail(f"{p}.model.file_sha256", "must be 64 lowercase hex digits")
        for key in ("name", "architecture"):
            if key in model:
                v.str(model, key, f"{p}.model")
    if batch != 1:
        v.fail("cache.batch", "a file with an engine_file holds one sequence (batch 1)")
    regen = None
    if "recompute" in ef:  # the engine regenerates (part of) its file from token ids (spec section 15.2)
        rc = v.obj(ef["recompute"], f"{p}.recompute", {"engine", "procedure", "length", "tokens", "params"})
        v.str(rc, "engine", f"{p}.recompute")
        v.str(rc, "procedure", f"{p}.recompute")
        regen = v.int(rc, "length", f"{p}.recompute", 0, lim["max_output_bytes"], LimitExceeded)
        tok = rc["tokens"]
        if not (isinstance(tok, list) and len(tok) == 2 and all(isinstance(x, int) and not isinstance(x, bool)
                                                                and x >= 0 for x in tok)):
            v.fail(f"{p}.recompute.tokens", "must be [offset, count], two non-negative integers")
        if tok[0] + 4 * tok[1] > verbatim:
            v.fail(f"{p}.recompute.tokens", f"{tok[1]} token ids at {tok[0]} outside the {verbatim} verbatim bytes")
        if not isinstance(rc["params"], dict):
            v.fail(f"{p}.recompute.params", "must be an object")
        if tier_id != "lossless" or not isinstance(digest, str):
            v.fail(f"{p}.recompute", "a regenerated file is checked by its SHA-256: tier 'lossless' only")
        if rc["engine"] != ef["engine"]:
            v.fail(f"{p}.recompute.engine", f"{rc['engine']!r} is not engine_file.engine {ef['engine']!r}")
    pieces = ef["pieces"]
    if not isinstance(pieces, list):
        v.fail(f"{p}.pieces", "must be a list")
    if len(pieces) > MAX_ENGINE_PIECES:
        v.fail(f"{p}.pieces", f"{len(pieces)} pieces, over {MAX_ENGINE_PIECES}", LimitExceeded)
    seen, total = set(), 0
    itemsize = DTYPES[dtype].itemsize
    for i, piece in enumerate(pieces):
        q = f"{p}.pieces[{i}]"
        if not isinstance(piece, list) or len(piece) != 3 or piece[0] not in ("bytes", "keys", "values",
                                                                              "recomputed"):
            v.fail(q, 'must be ["bytes", offset, length], ["recomputed", offset, length], ["keys", layer, order] '
                      'or ["values", layer, order]')
        kind, a, b = piece
        if kind in ("bytes", "recomputed"):
            for k, x in ((1, a), (2, b)):
                if not isinstance(x, int) or isinstance(x, bool) or x < 0:
                    v.fail(f"{q}[{k}]", "must be a non-negative integer")
            if kind == "recomputed" and regen is None:
                v.fail(q, "a recomputed piece needs engine_file.recompute")
            room = verbatim if kind == "bytes" else regen
            if a + b > room:
                v.fail(q, f"{kind} [{a}, {a + b}) outside the {room} {'verbatim' if kind == 'bytes' else 'regenerated'}"
                          " bytes")
            total += b
        else:
            if not isinstance(a, int) or isinstance(a, bool) or not 0 <= a < len(layers):
                v.fail(f"{q}[1]", f"must be a layer index in [0, {len(layers)})")
            if b not in ("rows", "columns"):
                v.fail(f"{q}[2]", f"order {b!r} is not 'rows' or 'columns'", UnknownId)
            if (kind, a) in seen:
                v.fail(q, f"{kind} of layer {a} appear twice")
            seen.add((kind, a))
            lay = layers[a]
            if lay.state is not None or lay.sliding_window is not None:
                v.fail(q, "an engine_file's layers hold keys and values only (no state, no sliding window)")
            total += lay.kv_heads * lay.seq_len * (lay.k_dim if kind == "keys" else lay.v_dim) * itemsize
        if total > length:
            v.fail(f"{p}.pieces", f"the pieces make more than the {length} bytes of engine_file.length")
    if total != length:
        v.fail(f"{p}.pieces", f"the pieces make {total} bytes, engine_file.length says {length}")
    if regen is not None and not any(isinstance(x, list) and x[:1] == ["recomputed"] for x in pieces):
        v.fail(f"{p}.recompute", "no piece is recomputed")
    return {**ef, "pieces": [tuple(x) for x in pieces]}


def _parse_state(v: Validator, st, p: str, batch: int, lim: dict) -> StateInfo:
    """A layer's ``state`` object (1.3): kind, slots, and its tensors in canonical order."""
    from ..state import KINDS, MAX_LEVELS, MAX_RANK, MAX_SLOTS, NAMES

    if not isinstance(st, dict):
        v.fail(p, "must be an object")
    kind = v.str(st, "kind", p) if "kind" in st else None
    v.obj(st, p, {"kind", "slots", "tensors"} | ({"parts", "scaling"} if kind == "reduced" else set()))
    if kind not in KINDS:
        v.fail(f"{p}.kind", f"{kind!r} is not one of {list(KINDS)}", UnknownId)
    slots = v.int(st, "slots", p, 1, MAX_SLOTS)
    raw = st["tensors"]
    if not isinstance(raw, list):
        v.fail(f"{p}.tensors", "must be a list")
    out, last = [], (-1, -1)
    for j, t in enumerate(raw):
        q = f"{p}.tensors[{j}]"
        v.obj(t, q, {"name", "slot", "dtype", "shape"})
        name = v.str(t, "name", q)
        if name not in NAMES:
            v.fail(f"{q}.name", f"{name!r} is not one of {list(NAMES)}", UnknownId)
        slot = v.int(t, "slot", q, 0, slots - 1)
        if (slot, NAMES.index(name)) <= last:
            v.fail(q, "state tensors must be in order of slot, conv before recurrent, each at most once")
        last = (slot, NAMES.index(name))
        dtype = v.str(t, "dtype", q)
        if dtype not in DTYPES:
            v.fail(f"{q}.dtype", f"unknown dtype {dtype!r}", UnknownId)
        shape = t["shape"]
        if not isinstance(shape, list) or not 1 <= len(shape) <= MAX_RANK:
            v.fail(f"{q}.shape", f"must be a list of 1 to {MAX_RANK} integers")
        dims = []
        for k, x in enumerate(shape):
            if not isinstance(x, int) or isinstance(x, bool):
                v.fail(f"{q}.shape[{k}]", f"must be an integer, not {type(x).__name__}")
            if not 0 <= x <= lim["max_seq_len"]:
                v.fail(f"{q}.shape[{k}]", f"{x} outside [0, {lim['max_seq_len']}]",
                       LimitExceeded if x > 0 else FormatError)
            dims.append(x)
        dims = tuple(dims)
        if dims[0] != batch:
            v.fail(f"{q}.shape[0]", f"{dims[0]} is not the batch size {batch}")
        if name != "recurrent" and len(dims) != 3:
            v.fail(f"{q}.shape", f"a {name} tensor is 3-dimensional, not {len(dims)}-dimensional")
        if (name == "indexer_keys") != (kind == "indexed"):
            v.fail(f"{q}.name", f"{name!r} in a layer of kind {kind!r} (indexer_keys belong to kind 'indexed' "
                                "and only to it)")
        if (name in ("log_weights", "anchor", "scores")) != (kind == "reduced"):
            v.fail(f"{q}.name", f"{name!r} in a layer of kind {kind!r} (log_weights, anchor and scores are the "
                                "tensors of kind 'reduced', and its only ones)")
        out.append(StateTensor(name, slot, dtype, dims))
    if kind == "indexed" and (slots != 1 or len(out) != 1):
        v.fail(p, "a layer of kind 'indexed' has one slot holding exactly its indexer_keys")
    if kind != "reduced":
        return StateInfo(kind, slots, tuple(out))
    if slots != 1 or not out or out[0].name != "log_weights":
        v.fail(p, "a layer of kind 'reduced' has one slot holding its log_weights (and optionally its anchor and "
                  "its scores)")
    parts = v.obj(st["parts"], f"{p}.parts", {"fixed", "sinks", "levels", "buffer"}, {"heads"})
    got = {key: v.int(parts, key, f"{p}.parts", 0, lim["max_seq_len"], LimitExceeded)
           for key in ("fixed", "sinks", "buffer")}
    if "heads" in parts:  # (1.8) the fixed entries each head holds; their count per row checked in _check_reduced
        rows = parts["heads"]
        if not isinstance(rows, list) or len(rows) != batch:
            v.fail(f"{p}.parts.heads", f"must be a list of {batch} lists (one per batch row)")
        for b, row in enumerate(rows):
            if not isinstance(row, list) or not row or len(row) > lim["max_heads"]:
                v.fail(f"{p}.parts.heads[{b}]", "must be a list of one integer per KV head")
            for h, x in enumerate(row):
                if not isinstance(x, int) or isinstance(x, bool) or not 0 <= x <= got["fixed"]:
                    v.fail(f"{p}.parts.heads[{b}][{h}]", f"must be an integer in [0, fixed = {got['fixed']}]")
        got["heads"] = [list(row) for row in rows]
    levels = parts["levels"]
    if not isinstance(levels, list) or len(levels) > MAX_LEVELS:
        v.fail(f"{p}.parts.levels", f"must be a list of at most {MAX_LEVELS} entries")
    for j, x in enumerate(levels):
        if x is not None and (not isinstance(x, int) or isinstance(x, bool) or x < 1):
            v.fail(f"{p}.parts.levels[{j}]", "must be null or an integer >= 1")
        if x is not None and x > lim["max_seq_len"]:
            v.fail(f"{p}.parts.levels[{j}]", f"{x} above {lim['max_seq_len']}", LimitExceeded)
    got["levels"] = list(levels)
    scaling = st["scaling"]
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not scaling > 0:
        v.fail(f"{p}.scaling", "must be a positive number")
    return StateInfo(kind, slots, tuple(out), got, float(scaling))


def _parse_reduce(v: Validator, r, lim: dict) -> dict:
    """The ``reduce`` object (1.4): how the cache was reduced and how it keeps reducing."""
    v.obj(r, "reduce", {"method", "reducer", "form", "k", "block", "sinks", "window", "seed"}, {"bound"})
    method = v.str(r, "method", "reduce")
    if method not in L.REDUCE_METHODS:
        v.fail("reduce.method", f"{method!r} is not one of {list(L.REDUCE_METHODS)}", UnknownId)
    reducer = r["reducer"]
    if reducer is not None:
        reducer = v.str(r, "reducer", "reduce")
        if reducer not in L.REDUCERS:
            v.fail("reduce.reducer", f"{reducer!r} is not null or one of {list(L.REDUCERS)}", UnknownId)
    if (method in L.REDUCERS) != (reducer == method) or (method not in L.REDUCERS and reducer is not None):
        v.fail("reduce.reducer", f"must be the method for a merge-reduce method and null for {method!r}")
    form = v.str(r, "form", "reduce")
    if form not in L.REDUCE_FORMS:
        v.fail("reduce.form", f"{form!r} is not one of {list(L.REDUCE_FORMS)}", UnknownId)
    out = {"method": method, "reducer": reducer, "form": form}
    for key, lo in (("k", 1), ("block", 1), ("sinks", 0), ("window", 0)):
        out[key] = v.int(r, key, "reduce", lo, lim["max_seq_len"], LimitExceeded)
    out["seed"] = v.int(r, "seed", "reduce", 0, (1 << 63) - 1)
    if "bound" in r:  # (1.11) appended tokens compete for the kept entries' places
        if reducer is not None:
            v.fail("reduce.bound", f"belongs to a one-shot method (reducer null); {method!r} keeps reducing by itself")
        b = v.obj(r["bound"], "reduce.bound", {"recent", "step"})
        out["bound"] = {"recent": v.int(b, "recent", "reduce.bound", 0, lim["max_seq_len"], LimitExceeded),
                        "step": v.int(b, "step", "reduce.bound", 1, lim["max_seq_len"], LimitExceeded)}
    return out


def _check_reduced(v: Validator, p: str, state: StateInfo, reduce: dict | None, heads: int, kd: int, seq: int,
                   sw, cum: int) -> None:
    """A reduced layer against its layer and the ``reduce`` object (spec section 14.2)."""
    if reduce is None:
        v.fail(f"{p}.state", "a layer of kind 'reduced' needs the header's reduce object")
    if sw is not None:
        v.fail(f"{p}.sliding_window", "a reduced layer is a full-attention layer (null)")
    lw = state.tensors[0]
    if lw.dtype != "float32" or lw.shape[1:] != (heads, seq):
        v.fail(f"{p}.state.tensors[0]", f"log_weights are float32 [batch, {heads}, {seq}]")
    names = [t.name for t in state.tensors]
    if ("anchor" in names) != (reduce["form"] == "query"):
        v.fail(f"{p}.state.tensors", "a reduced layer holds an anchor if and only if the form is 'query'")
    if ("scores" in names) != ("bound" in reduce):
        v.fail(f"{p}.state.tensors", "a reduced layer holds scores if and only if the reduce object has a bound")
    for j, t in enumerate(state.tensors):
        if t.name == "anchor" and (t.dtype != "float32" or t.shape[1:] != (heads, kd)):
            v.fail(f"{p}.state.tensors[{j}]", f"the anchor is float32 [batch, {heads}, {kd}]")
        if t.name == "scores" and (t.dtype != "float32" or t.shape[1:] != (heads, seq)):
            v.fail(f"{p}.state.tensors[{j}]", f"the scores are float32 [batch, {heads}, {seq}]")
    pr = state.parts
    if "heads" in pr:
        if any(len(row) != heads for row in pr["heads"]):
            v.fail(f"{p}.state.parts.heads", f"each batch row lists its {heads} KV heads")
        top = max(max(row) for row in pr["heads"])
        if top != pr["fixed"] or all(x == top for row in pr["heads"] for x in row):
            v.fail(f"{p}.state.parts.heads", f"the longest head holds fixed = {pr['fixed']} entries and some head "
                                             f"fewer (longest: {top})")
    if pr["levels"] and pr["levels"][-1] is None:
        v.fail(f"{p}.state.parts.levels", "the last level is not null")
    held = pr["fixed"] + pr["sinks"] + pr["buffer"] + sum(x or 0 for x in pr["levels"])
    if held != seq:
        v.fail(f"{p}.state.parts", f"the parts hold {held} entries, the layer {seq}")
    if pr["sinks"] > reduce["sinks"]:
        v.fail(f"{p}.state.parts.sinks", f"{pr['sinks']} sinks, the reduce object allows {reduce['sinks']}")
    if reduce["reducer"] is None:
        if any(x is not None for x in pr["levels"]):
            v.fail(f"{p}.state.parts.levels", f"method {reduce['method']!r} has no merge-reduce levels")
    else:
        if pr["fixed"]:
            v.fail(f"{p}.state.parts.fixed", f"method {reduce['method']!r} holds no fixed entries")
        if any(x is not None and x > min(reduce["k"], reduce["block"] << lvl) for lvl, x in enumerate(pr["levels"])):
            v.fail(f"{p}.state.parts.levels", f"level l holds at most min(k = {reduce['k']}, block * 2^l) atoms")
        if pr["buffer"] >= reduce["window"] + reduce["block"]:
            v.fail(f"{p}.state.parts.buffer", f"{pr['buffer']} raw tokens; a buffer holds fewer than window + "
                                               f"block = {reduce['window'] + reduce['block']}")
        if pr["sinks"] < reduce["sinks"] and (pr["buffer"] or any(x is not None for x in pr["levels"])):
            v.fail(f"{p}.state.parts", "tokens after the sinks while the sinks are not full")
        tokens = pr["sinks"] + reduce["block"] * sum(1 << lvl for lvl, x in enumerate(pr["levels"]) if x is not None) \
            + pr["buffer"]
        if tokens != cum:
            v.fail(f"{p}.cumulative_length", f"{cum}, but the parts stand for {tokens} tokens (sinks + block * "
                                             "blocks of the levels + buffer)")
