"""The ``exact`` and ``tokens`` tiers: a cache stored as its tokens (+ a residual), restored by recompute.

Encoder: tokens (given, or recovered from layer-0 values and verified) ->
plan (schedule recorded by :class:`~kvcodec.tokens.RecordingCache`, given, or
inferred; padding and position-id convention of a padded batch) -> token
streams (``lm``: coded while replaying the plan, which also yields the
regenerated cache; ``static`` / ``draft``: coded per row, then the plan is
replayed) -> residual of original against regenerated, per section.

Whenever the cache cannot be stored this way (unsupported architecture, a
cache that does not start at position 0 or has dropped tokens, tokens that
cannot be recovered or do not regenerate the cache) the caller falls back to
the lossless tier with a :class:`~kvcodec.errors.FallbackWarning`; a file that
decodes wrong is never produced.
"""

from __future__ import annotations

import struct
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from .cache import KVCache, to_canonical
from .errors import ConfigError, FormatError, ModelMismatch
from .tokens._coder import TokenStream
from .tokens.lm import CHUNK_TOKENS
from .tokens.regen import Plan, ScheduleLMCoder, replay

TOKEN_CHUNK = CHUNK_TOKENS  # tokens per Chunk_Checksums entry
_STREAM_HEAD = struct.Struct("<II")  # Num_Tokens, Num_Chunks


class Fallback(Exception):
    """Internal: the token tiers cannot store this cache (the message says why)."""


# --- token stream payloads ---------------------------------------------------------
def pack_stream(s: TokenStream) -> bytes:
    return (_STREAM_HEAD.pack(s.num_tokens, len(s.chunk_checksums))
            + np.asarray(s.chunk_checksums, dtype="<u8").tobytes() + s.words.astype("<u4").tobytes())


def unpack_stream(payload: bytes, *, expect_tokens: int, chunk: int, offset: int) -> TokenStream:
    if len(payload) < _STREAM_HEAD.size:
        raise FormatError("token_stream payload shorter than its fixed fields", field="Token_Stream.Num_Tokens",
                          offset=offset)
    n, nc = _STREAM_HEAD.unpack_from(payload, 0)
    if n != expect_tokens:
        raise FormatError(f"Num_Tokens {n}, the header implies {expect_tokens}", field="Token_Stream.Num_Tokens",
                          offset=offset)
    if nc != -(-n // chunk):
        raise FormatError(f"Num_Chunks {nc} for {n} tokens in chunks of {chunk}", field="Token_Stream.Num_Chunks",
                          offset=offset + 4)
    rest = len(payload) - _STREAM_HEAD.size - 8 * nc
    if rest < 0 or rest % 4:
        raise FormatError(f"token_stream payload of {len(payload)} bytes does not hold {nc} checksums and whole "
                          "u32 words", field="Token_Stream.Words", offset=offset + 8)
    sums = np.frombuffer(payload, dtype="<u8", count=nc, offset=8).tolist()
    words = np.frombuffer(payload, dtype="<u4", offset=8 + 8 * nc).astype(np.uint32)
    return TokenStream(words, n, chunk, sums)


# --- model helpers ----------------------------------------------------------------
def split_model(model):
    if isinstance(model, tuple):
        return model[0], model[1]
    return model, None


def vocab_size(model) -> int:
    return int(model.get_output_embeddings().weight.shape[0])


_TABLES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def recover(kv: KVCache, model):
    """:func:`~kvcodec.tokens.recover.recover_tokens` on ``kv``'s layer-0 values, with the model's vocab table
    built once per model."""
    from .tokens.recover import recover_tokens

    return recover_tokens(kv.values[0], model, table=_value_table(model))


def _value_table(model):
    from .tokens.recover import layer0_value_table

    stamp = sum(p._version for p in model.parameters())
    hit = _TABLES.get(model)
    if hit is None or hit[0] != stamp:
        hit = (stamp, layer0_value_table(model))
        _TABLES[model] = hit
    return hit[1]


def _close(a: torch.Tensor, b: torch.Tensor, rel: float = 2e-2) -> bool:
    a, b = a.double(), b.double()
    scale = a.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    return bool(((a - b).abs() / scale).max() <= rel) if a.numel() else True


# --- plans: padding, position ids, schedule ----------------------------------------
def _schedule_arg(schedule, cache, n: int) -> list[int] | None:
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
        sched = [int(size) for size, count in schedule for _ in range(int(count))]
    elif isinstance(schedule, (list, tuple)):
        sched = [int(x) for x in schedule]
    else:
        raise ConfigError("schedule must be None, 'infer', 'prefill', a list of call sizes or of [size, count] runs")
    if not sched or min(sched) < 1 or sum(sched) != n:
        raise ConfigError(f"schedule's calls add up to {sum(sched)} tokens, the cache holds {n}")
    return sched


def _padding_candidates(tokens: torch.Tensor, attention_mask, model, tok) -> list[tuple[list[int], int]]:
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
        ids = {getattr(model.config, "pad_token_id", None), getattr(tok, "pad_token_id", None) if tok else None}
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
    from .tokens.regen import _call_kwargs, _forward

    dev = next(model.parameters()).device
    prefix = KVCache([k[:, :, :j].clone() for k in kv.keys], [v[:, :, :j].clone() for v in kv.values],
                     sliding_window=kv.sliding_window, cumulative_length=[j] * kv.num_layers).to_dynamic_cache()
    _forward(model, tokens[:, j:j + 1].to(dev), prefix, _call_kwargs(plan, j, j + 1, dev))
    got = to_canonical(prefix)
    return all(torch.equal(a[:, :, j:j + 1], ga[:, :, -1:])
               for a, ga in zip(kv.keys + kv.values, got.keys + got.values))


def infer_plan(model, kv: KVCache, tokens, candidates, given_schedule) -> tuple[Plan, str, KVCache | None]:
    """Find the plan that regenerates ``kv`` bit for bit; returns (plan, how it was found, its regeneration
    when it was verified by one)."""
    n = tokens.shape[1]
    pos_modes = ["mask", "arange"]
    plans = [Plan(given_schedule or [n], pads, mode, pid, list(kv.sliding_window)) for pads, pid in candidates
             for mode in (pos_modes if any(pads) else ["mask"])]
    if given_schedule is not None and len(plans) == 1:
        return plans[0], "given", None
    first = None
    for plan in plans:  # one prefill (or the given schedule): cheap, and the commonest
        regen = to_canonical(replay(model, tokens, plan))
        first = regen if first is None else first
        if regen.equal(kv):
            return plan, "given" if given_schedule else "verified: one prefill", regen
    if given_schedule is not None:
        return plans[0], "given (not verified)", first
    if n < 3 or any(lay.shape[2] != n for lay in kv.keys):
        return plans[0], "unknown: one prefill assumed", first
    # "one prefill of P tokens, then single steps" (generate()): positions >= P pass the single-step probe
    for plan in plans:
        if not _probe_single_step(model, kv, tokens, plan, n - 1):
            continue
        lo, hi = 1, n - 1  # smallest j whose probe passes
        while lo < hi:
            mid = (lo + hi) // 2
            if _probe_single_step(model, kv, tokens, plan, mid):
                hi = mid
            else:
                lo = mid + 1
        return Plan([lo] + [1] * (n - lo), plan.padding, plan.positions, plan.pad_token, plan.windows), \
            f"inferred: prefill {lo}, then {n - lo} single steps", None
    return plans[0], "unknown: one prefill assumed", first


# --- encoding ---------------------------------------------------------------------
@dataclass
class TokenEncoding:
    header_tokens: dict
    streams: list[TokenStream]
    regen: KVCache
    tokens: torch.Tensor
    how: str
    token_bits: float


def prepare(cache, kv: KVCache, model, *, tier: str, tokens, token_model: str, draft, schedule, attention_mask,
            tolerance) -> TokenEncoding:
    """Everything of a token-tier file but the residual sections; raises :class:`Fallback`."""
    from .api import _model_record

    mdl, tok = split_model(model)
    p = next(mdl.parameters())
    if p.dtype != kv.dtype:
        raise ConfigError(f"the cache is {kv.dtype_name}, the model computes in {str(p.dtype)[6:]}: pass the model "
                          "the cache was made with (same dtype)")
    if kv.start_position != 0:
        raise Fallback(f"the cache starts at position {kv.start_position}; regeneration needs every token from 0")
    n = max(kv.cumulative_length)
    if any(c != n for c in kv.cumulative_length) or any(
            sw is None and k.shape[2] != n for k, sw in zip(kv.keys, kv.sliding_window)):
        raise Fallback("layers have seen different numbers of tokens")
    if tokens is None and kv.tokens is not None and kv.tokens.shape[1] == n:
        tokens = kv.tokens
    if tokens is None:
        if kv.keys[0].shape[2] != n:
            raise Fallback("layer 0 no longer holds every token (sliding window); pass tokens=")
        try:
            rec = recover(kv, mdl)
        except ConfigError as e:
            raise Fallback(f"token recovery: {e}") from None
        if not rec.ok:
            raise Fallback(f"token recovery failed: {rec.reason}")
        tokens = rec.tokens
    tokens = torch.as_tensor(tokens).to("cpu", torch.int64)
    if tokens.dim() == 1:
        tokens = tokens[None]
    if tokens.shape != (kv.batch, n):
        raise ConfigError(f"tokens must be [batch={kv.batch}, {n}], not {tuple(tokens.shape)}")
    vocab = vocab_size(mdl)
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        raise ConfigError(f"token ids must be in [0, {vocab})")
    given = _schedule_arg(schedule, cache, n)
    plan, how, verified = infer_plan(mdl, kv, tokens, _padding_candidates(tokens, attention_mask, mdl, tok), given)
    if token_model == "lm":
        coder = ScheduleLMCoder(mdl, TOKEN_CHUNK)
        streams, regen = coder.encode(tokens, plan)
        procedure, draft_rec = coder.procedure(), None
        regen = to_canonical(regen)
    elif token_model in ("static", "draft"):
        if token_model == "static":
            from .tokens.static import StaticTokenCoder

            coder = StaticTokenCoder(vocab, TOKEN_CHUNK)
            procedure, draft_rec = dict(StaticTokenCoder.PROCEDURE), None
        else:
            from .tokens.lm import LMTokenCoder

            if draft is None:
                raise ConfigError("token_model='draft' needs draft=<a smaller model with the same tokenizer>")
            dm, dtok = split_model(draft)
            if tok is not None and dtok is not None and tok.get_vocab() != dtok.get_vocab():
                raise ConfigError("the draft model's tokenizer differs from the model's")
            if vocab_size(dm) < vocab and int(tokens.max()) >= vocab_size(dm):
                raise ConfigError("the draft model's vocabulary is smaller than the tokens need")
            coder = LMTokenCoder(dm, TOKEN_CHUNK)
            vocab = coder.vocab
            procedure, draft_rec = coder.procedure(), _model_record(draft)
        streams = []
        for r in range(kv.batch):
            streams.append(coder.encode(tokens[r, plan.padding[r] if plan.padding else 0:]))
        regen = verified if verified is not None else to_canonical(replay(mdl, tokens, plan))
    else:
        raise ConfigError(f"token_model must be 'lm', 'static' or 'draft', not {token_model!r}")
    if regen.num_layers != kv.num_layers or any(a.shape != b.shape for a, b in zip(regen.keys + regen.values,
                                                                                   kv.keys + kv.values)):
        raise Fallback("the regenerated cache has another shape (another model layout?)")
    # verify the tokens: layer-0 values depend on the token only, whatever the schedule or the engine
    if not _close(regen.values[0], kv.values[0]):
        raise Fallback("the tokens do not regenerate the cache's layer-0 values: the cache was modified "
                       "(quantized, pruned) or was made with another model")
    dev = 0.0
    for a, b in zip(kv.keys + kv.values, regen.keys + regen.values):
        if a.numel():
            d = float((a.double() - b.double()).abs().max())
            dev = max(dev, d) if d == d else float("inf")
    header_tokens = {
        "token_model": token_model, "draft": draft_rec, "vocab": vocab, "chunk_tokens": TOKEN_CHUNK,
        "procedure": procedure, "schedule": _runs(plan.schedule), "padding": list(plan.padding or [0] * kv.batch),
        "positions": plan.positions, "pad_token": int(plan.pad_token),
        "tolerance": None if tolerance is None else float(tolerance) if tolerance else 0,
        "max_abs_deviation": dev if dev != float("inf") else None,
    }
    return TokenEncoding(header_tokens, streams, regen, tokens, how, float(sum(s.cross_entropy_bits for s in streams)))


def _runs(schedule):
    from .tokens.schedule import runs

    return runs(schedule)


# --- decoding ---------------------------------------------------------------------
def procedure_differences(recorded: dict, current: dict) -> str:
    """What differs between the recorded procedure and this decoder's (for error messages)."""
    diffs = []
    for key in ("dtype", "device", "threads"):
        if key in recorded and recorded.get(key) != current.get(key):
            diffs.append(f"{key} {recorded.get(key)} (file) vs {current.get(key)} (here)")
    rv, cv = recorded.get("versions", {}), current.get("versions", {})
    diffs += [f"{k} {rv[k]} (file) vs {cv.get(k)} (here)" for k in rv if rv[k] != cv.get(k)]
    if not diffs:
        return "the recorded procedure matches this decoder's, so the stream is most likely corrupt"
    hint = "; e.g. torch.set_num_threads(...)" if any(d.startswith("threads") for d in diffs) else ""
    return "decode where these match: " + ", ".join(diffs) + hint


def regenerate(header, streams: list[TokenStream], model, draft=None) -> tuple[torch.Tensor, KVCache]:
    """Decode the token streams and regenerate the cache (before residuals)."""
    from .errors import ChecksumMismatch

    try:
        return _regenerate(header, streams, model, draft)
    except ChecksumMismatch as e:
        t = header.tokens
        if t.token_model == "static":
            raise
        coder_model = split_model(draft if t.token_model == "draft" else model)[0]
        current = ScheduleLMCoder(coder_model).procedure()
        raise ChecksumMismatch(f"{e.message}. {procedure_differences(t.raw['procedure'], current)}",
                               field=e.field, offset=e.offset) from None


def _regenerate(header, streams: list[TokenStream], model, draft=None) -> tuple[torch.Tensor, KVCache]:
    t = header.tokens
    mdl, _ = split_model(model)
    n_layers = getattr(getattr(mdl, "config", None), "num_hidden_layers", None)
    if n_layers is not None and n_layers != len(header.layers):
        raise ModelMismatch(f"the header describes {len(header.layers)} layers, the model has {n_layers}",
                            field="Header.cache.layers")
    plan = Plan(list(t.schedule), list(t.padding), t.positions, t.pad_token,
                [lay.sliding_window for lay in header.layers])
    if t.token_model == "lm":
        if vocab_size(mdl) != t.vocab:
            raise FormatError(f"tokens.vocab {t.vocab} differs from the model's {vocab_size(mdl)}",
                              field="Header.tokens.vocab")
        tokens, regen = ScheduleLMCoder(mdl, t.chunk_tokens).decode(streams, plan)
        return tokens, to_canonical(regen)
    if t.token_model == "static":
        from .tokens.static import StaticTokenCoder

        if t.vocab != vocab_size(mdl):
            raise FormatError(f"tokens.vocab {t.vocab} differs from the model's {vocab_size(mdl)}",
                              field="Header.tokens.vocab")
        coder = StaticTokenCoder(t.vocab, t.chunk_tokens)
    else:
        from .tokens.lm import LMTokenCoder

        if draft is None:
            raise ConfigError("this file's tokens were coded with a draft model: decode(data, model, draft=...)")
        dm, _ = split_model(draft)
        coder = LMTokenCoder(dm, t.chunk_tokens)
        if coder.vocab != t.vocab:
            raise FormatError(f"tokens.vocab {t.vocab} differs from the draft model's {coder.vocab}",
                              field="Header.tokens.vocab")
    n = header.num_tokens
    tokens = torch.full((header.batch, n), t.pad_token, dtype=torch.int64)
    for r, s in enumerate(streams):
        ids = coder.decode(s)
        if ids.numel() and int(ids.max()) >= vocab_size(mdl):
            raise FormatError(f"batch row {r}: a decoded token id is outside the model's vocabulary",
                              field="Token_Stream.Words")
        tokens[r, t.padding[r]:] = ids
    return tokens, to_canonical(replay(mdl, tokens, plan))
