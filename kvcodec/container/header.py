"""The JSON header of a .kvz file: building, canonical serialisation, validation.

The header is UTF-8 JSON written canonically (sorted keys, no whitespace,
``ensure_ascii=False``), so re-encoding a decoded cache gives identical bytes.
Validation is strict: every field is type- and range-checked against the
limits before anything is allocated from it, and unknown keys are errors
except under ``info`` (free-form, informative) and keys starting with ``x-``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from ..errors import FormatError, LimitExceeded, UnknownId
from . import layout as L

TIERS = {"lossless": {"float_ctx_rans"}, "exact": {"int_residual_rans"}, "tokens": {"int_residual_rans"},
         "lossy": {"vq_rans"}}
TOKEN_TIERS = ("exact", "tokens")
TOKEN_MODELS = ("lm", "static", "draft")
PROCEDURES = {"lm": "lm-schedule-v1", "draft": "lm-incremental-v1", "static": "static-wb-o2-v1"}
POSITIONS = ("mask", "arange")
MAX_SCHEDULE_RUNS = 1 << 20
DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def dumps(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


@dataclass(frozen=True)
class LayerInfo:
    kv_heads: int
    k_dim: int
    v_dim: int
    seq_len: int
    sliding_window: int | None
    cumulative_length: int

    def chunks(self, chunk_tokens: int) -> int:
        return -(-self.seq_len // chunk_tokens)

    def chunk_range(self, chunk: int, chunk_tokens: int) -> tuple[int, int]:
        a = chunk * chunk_tokens
        return a, min(self.seq_len, a + chunk_tokens)


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
    tokens: "TokenInfo | None" = None

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype]

    def slices(self):
        """``(layer, part, chunk)`` of every kv / residual slice, in canonical order."""
        return [(li, part, c) for li, lay in enumerate(self.layers) for c in range(lay.chunks(self.chunk_tokens))
                for part in (L.PART_KEYS, L.PART_VALUES)]

    def expected_sections(self):
        """Canonical section order: ``[((type, layer, part, chunk), optional), ...]``."""
        if self.tokens is not None:
            out = [((L.SECTION_TOKEN_STREAM, 0, 0, r), False) for r in range(self.batch)]
            if self.tokens.has_residual:  # checksums of every slice; residuals only where non-zero
                out.append(((L.SECTION_TENSOR_CHECKSUMS, 0, 0, 0), False))
                out += [((L.SECTION_RESIDUAL, *s), True) for s in self.slices()]
            return out
        out = [((L.SECTION_TOKENS, 0, 0, 0), False)] if self.num_tokens else []
        return out + [((L.SECTION_KV, *s), False) for s in self.slices()]

    def tensor_bytes(self) -> int:
        return sum(self.batch * lay.kv_heads * lay.seq_len * (lay.k_dim + lay.v_dim) * self.itemsize
                   for lay in self.layers)


@dataclass(frozen=True)
class TokenInfo:
    """The header's ``tokens`` object (token tiers)."""

    token_model: str
    draft: dict | None
    vocab: int
    chunk_tokens: int
    schedule: tuple[int, ...]  # expanded call sizes
    padding: tuple[int, ...]
    positions: str
    pad_token: int
    tolerance: float | None
    has_residual: bool
    raw: dict


class _V:
    """Small typed accessor that names the JSON path in every error."""

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


def parse(data: bytes, *, offset: int, limits: dict | None = None) -> Header:
    """Parse and validate header bytes located at ``offset`` in the file."""
    lim = {"max_layers": L.MAX_LAYERS, "max_batch": L.MAX_BATCH, "max_heads": L.MAX_HEADS,
           "max_head_dim": L.MAX_HEAD_DIM, "max_seq_len": L.MAX_SEQ_LEN,
           "max_output_bytes": L.default_max_output_bytes(), **(limits or {})}
    v = _V(offset)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FormatError(f"header is not UTF-8: {e.reason} at byte {e.start}", field="Header",
                          offset=offset + e.start) from None

    def no_dupes(pairs):
        keys = [k for k, _ in pairs]
        if len(keys) != len(set(keys)):
            raise FormatError("header has a duplicate key", field="Header", offset=offset)
        return dict(pairs)

    def bad_const(c):
        raise FormatError(f"header contains {c}", field="Header", offset=offset)

    try:
        obj = json.loads(text, object_pairs_hook=no_dupes, parse_constant=bad_const)
    except json.JSONDecodeError as e:
        raise FormatError(f"header is not JSON: {e.msg}", field="Header", offset=offset + e.pos) from None
    except RecursionError:
        raise FormatError("header nests too deeply", field="Header", offset=offset) from None
    v.obj(obj, "", {"format", "tier", "codec", "cache", "model"}, {"info", "tokens"})
    if obj["format"] != "kvz":
        v.fail("format", f"must be 'kvz', not {obj['format']!r}")
    tier = v.str(obj, "tier", "")
    if tier not in TIERS:
        v.fail("tier", f"unknown tier {tier!r}", UnknownId)
    codec = v.obj(obj["codec"], "codec", {"id", "params"})
    cid = v.str(codec, "id", "codec")
    if cid not in TIERS[tier]:
        v.fail("codec.id", f"unknown codec {cid!r} for tier {tier!r}", UnknownId)
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
    layers_raw = cache["layers"]
    if not isinstance(layers_raw, list):
        v.fail("cache.layers", "must be a list")
    if not 1 <= len(layers_raw) <= lim["max_layers"]:
        v.fail("cache.layers", f"{len(layers_raw)} layers outside [1, {lim['max_layers']}]",
               LimitExceeded if len(layers_raw) else FormatError)
    layers = []
    for i, lr in enumerate(layers_raw):
        p = f"cache.layers[{i}]"
        v.obj(lr, p, {"kv_heads", "k_dim", "v_dim", "seq_len", "sliding_window", "cumulative_length"}, {"repeat"})
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
        if sw is None and cum != seq:
            v.fail(f"{p}.cumulative_length", "must equal seq_len for a full-attention layer")
        layers += [LayerInfo(heads, kd, vd, seq, sw, cum)] * repeat
    if ntok and tier not in TOKEN_TIERS:
        longest = max(lay.seq_len for lay in layers)
        if ntok != longest:
            v.fail("cache.num_tokens", f"{ntok} token ids for a cache of {longest} tokens")
    model = obj["model"]
    if model is not None:
        v.obj(model, "model", {"fingerprint"}, {"name", "architecture", "tokenizer"})
        for key in ("fingerprint", "tokenizer"):
            if key in model and not _HEX64.match(v.str(model, key, "model")):
                v.fail(f"model.{key}", "must be 64 lowercase hex digits")
    tinfo = None
    if tier in TOKEN_TIERS:
        if "tokens" not in obj:
            v.fail("tokens", f"missing: tier {tier!r} needs the tokens object")
        if model is None:
            v.fail("model", f"tier {tier!r} needs the model's fingerprint")
        tinfo = _token_info(v, obj["tokens"], tier, batch, ntok, start, layers, lim)
    elif "tokens" in obj:
        v.fail("tokens", f"not allowed in tier {tier!r}")
    hdr = Header(obj, tier, cid, codec["params"], dtype, batch, chunk, start, ntok, tuple(layers), model, tinfo)
    if 2 * sum(lay.chunks(chunk) for lay in layers) + 2 + batch > L.MAX_SECTIONS:
        v.fail("cache.chunk_tokens", f"the cache would need more than {L.MAX_SECTIONS} sections", LimitExceeded)
    if hdr.tensor_bytes() > lim["max_output_bytes"]:
        v.fail("cache.layers", f"decoded tensors would take {hdr.tensor_bytes()} bytes, over the limit of "
               f"{lim['max_output_bytes']} (pass limits={{'max_output_bytes': ...}} to allow)", LimitExceeded)
    return hdr


def _token_info(v: _V, t, tier, batch, ntok, start, layers, lim) -> TokenInfo:
    p = "tokens"
    v.obj(t, p, {"token_model", "draft", "vocab", "chunk_tokens", "procedure", "schedule", "padding", "positions",
                 "pad_token", "tolerance", "max_abs_deviation"})
    tm = v.str(t, "token_model", p)
    if tm not in TOKEN_MODELS:
        v.fail(f"{p}.token_model", f"unknown token model {tm!r}", UnknownId)
    draft = t["draft"]
    if (draft is None) != (tm != "draft"):
        v.fail(f"{p}.draft", "must be an object exactly when token_model is 'draft'")
    if draft is not None:
        v.obj(draft, f"{p}.draft", {"fingerprint"}, {"name", "architecture", "tokenizer"})
        if not _HEX64.match(v.str(draft, "fingerprint", f"{p}.draft")):
            v.fail(f"{p}.draft.fingerprint", "must be 64 lowercase hex digits")
    vocab = v.int(t, "vocab", p, 1, 1 << 31, LimitExceeded)
    chunk = v.int(t, "chunk_tokens", p, 1, L.MAX_CHUNK_TOKENS, LimitExceeded)
    if not isinstance(t["procedure"], dict) or "id" not in t["procedure"]:
        v.fail(f"{p}.procedure", "must be an object with an id")
    if t["procedure"]["id"] != PROCEDURES[tm]:
        v.fail(f"{p}.procedure.id", f"{t['procedure']['id']!r} is not a procedure of token model {tm!r}", UnknownId)
    if ntok < 1:
        v.fail("cache.num_tokens", f"tier {tier!r} needs num_tokens >= 1")
    if start != 0:
        v.fail("cache.start_position", f"tier {tier!r} regenerates from position 0; start_position must be 0")
    for i, lay in enumerate(layers):
        if lay.cumulative_length != ntok or (lay.sliding_window is None and lay.seq_len != ntok):
            v.fail(f"cache.layers[{i}]", f"tier {tier!r}: every layer must have seen all {ntok} tokens")
    runs = t["schedule"]
    if not isinstance(runs, list) or not 1 <= len(runs) <= MAX_SCHEDULE_RUNS:
        v.fail(f"{p}.schedule", f"must be a list of 1 to {MAX_SCHEDULE_RUNS} [size, count] pairs")
    total = 0
    for i, r in enumerate(runs):
        if not (isinstance(r, list) and len(r) == 2 and all(isinstance(x, int) and not isinstance(x, bool)
                                                            and x >= 1 for x in r)):
            v.fail(f"{p}.schedule[{i}]", "must be a [size, count] pair of positive integers")
        total += r[0] * r[1]
        if total > ntok:
            break
    if total != ntok:
        v.fail(f"{p}.schedule", f"calls add up to {total} tokens, num_tokens is {ntok}")
    pad = t["padding"]
    if not (isinstance(pad, list) and len(pad) == batch and all(
            isinstance(x, int) and not isinstance(x, bool) and 0 <= x < ntok for x in pad)):
        v.fail(f"{p}.padding", f"must be {batch} integers in [0, {ntok})")
    positions = v.str(t, "positions", p)
    if positions not in POSITIONS:
        v.fail(f"{p}.positions", f"must be one of {list(POSITIONS)}", UnknownId)
    pad_token = v.int(t, "pad_token", p, 0, vocab - 1)
    tol = v.num(t, "tolerance", p)
    if tier == "exact" and tol != 0:
        v.fail(f"{p}.tolerance", "must be 0 in tier 'exact'")
    v.num(t, "max_abs_deviation", p)
    schedule = tuple(size for size, count in runs for _ in range(count))
    return TokenInfo(tm, draft, vocab, chunk, schedule, tuple(pad), positions, pad_token, tol, tol is not None, t)
