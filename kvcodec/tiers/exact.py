"""Tier ``exact``: a cache stored as its tokens plus a residual, restored bit-identically by recomputing it.

Encoder: tokens (given, or recovered from layer-0 values and verified) ->
plan (schedule recorded by :class:`~kvcodec.tokens.RecordingCache`, given, or
inferred; padding and position-id convention of a padded batch) -> token
streams (``lm``: coded while replaying the plan, which also yields the
regenerated cache; ``static`` / ``draft``: coded per row, then the plan is
replayed) -> per slice, the checksum of what the decoder must produce and the
residual of original against regenerated (``int_residual_rans``; a section
only where they differ).

Decoder: the token streams are decoded with the model (``lm``: one pass that
also regenerates the cache), the plan is replayed, the residuals applied and
every slice checked against its checksum - a decoder that computes differently
fails with :class:`~kvcodec.errors.ChecksumMismatch`, never silently.

When the cache cannot be stored this way (a cache that does not start at
position 0 or has dropped tokens, tokens that cannot be recovered or do not
regenerate the cache) the writer raises :class:`~kvcodec.tiers.base.Fallback`
and the API stores it losslessly.  Tier ``tokens`` (:mod:`.tokens`) is this
tier with a tolerance.  See ``spec/kvz.md`` sections 5.3-5.5, 9, 11, 12.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from .. import numerics
from ..cache import KVCache, to_canonical
from ..codecs.base import Slice
from ..codecs.int_residual_rans import IntResidualRans, checksum
from ..container import layout as L
from ..container.header import is_hex64
from ..container.writer import KvzWriter
from ..dtypes import DTYPES, bit_patterns, from_bit_patterns, same_bits
from ..errors import (
    ChecksumMismatch,
    ConfigError,
    FallbackWarning,
    FormatError,
    LimitExceeded,
    ModelMismatch,
    NumericsMismatch,
    ResidualWarning,
    UnknownId,
    warn,
)
from ..identity import check_model, model_record, split_model, vocab_size
from ..registry import register_tier
from ..state import LayerState, decode_payload
from ..tokens import blocks, lm
from ..tokens.lm import LMTokenCoder
from ..tokens.plan import (
    Plan,
    infer_plan,
    padding_candidates,
    replay,
    schedule_arg,
    single_steps,
    step_thread_candidates,
    step_threads,
)
from ..tokens.rangecoder import TokenStream, pack_stream, unpack_stream
from ..tokens.recover import recover
from ..tokens.schedule import expand, runs
from ..tokens.static import StaticTokenCoder
from .base import UNSET, EncodeJob, Fallback, Options, Tier, tensor_slice, write_states

TOKEN_MODELS = ("lm", "static", "draft", "blocks")
#: what an encoder may be asked for: a token model, or "auto" (the default: chosen per cache, below)
TOKEN_MODEL_OPTIONS = (*TOKEN_MODELS, "auto")
PROCEDURES = {"lm": lm.SCHEDULE, "draft": lm.INCREMENTAL, "static": StaticTokenCoder.PROCEDURE["id"],
              "blocks": blocks.PROCEDURE}
#: token model "auto": the longest block of ``blocks`` whose decoding is estimated to take at most this share of
#: the regeneration the encoder just timed (so that a restore - decoding, then the same replay - takes about two
#: of them), kept if its streams are smaller than "static"'s; "static" if no block of ``AUTO_MIN_BLOCK`` tokens
#: or more fits (spec/kvz.md §11.5)
AUTO_BUDGET = 0.9
#: ... and whose coding (the same calls as its decoding) took at most this share of it, else the next shorter
AUTO_LIMIT = 1.0
AUTO_BLOCKS = (128, 64, 32, 16)
#: not shorter: SmolLM2's L = 8 decoded in 2.9x a 512-token prefill at 8.7-9.3 bits/token, about what "static"
#: codes on longer text (7.7-9.6 at 8,192 tokens; BENCHMARKS.md "Token models")
AUTO_MIN_BLOCK = 16
POSITIONS = ("mask", "arange")
MAX_SCHEDULE_RUNS = 1 << 20
MAX_VOCAB = (1 << 24) - 2  # the largest alphabet the 24-bit frequencies of spec 11.2.1 can code


@dataclass(frozen=True)
class TokenChannel:
    """The header's ``tokens`` object, validated."""

    token_model: str
    draft: dict | None
    vocab: int
    checksum_tokens: int  #: tokens per Chunk_Checksums entry (the JSON's ``chunk_tokens``)
    schedule_runs: tuple[tuple[int, int], ...]  #: [size, count] runs (expanded only to replay them)
    padding: tuple[int, ...]
    positions: str
    pad_token: int
    tolerance: float | None
    raw: dict

    @property
    def has_residual(self) -> bool:
        return self.tolerance is not None

    def plan(self, windows=None) -> Plan:
        return Plan(expand(self.schedule_runs), list(self.padding), self.positions, self.pad_token, windows)


@register_tier
class ExactTier(Tier):
    tier_id = "exact"
    summary = "tokens + residual, bit-identical; the model recomputes the cache"
    codec_ids = (IntResidualRans.codec_id,)
    min_minor = 1
    needs_model = True
    header_key = "tokens"
    option_names = frozenset({"token_model", "draft", "tolerance", "block_tokens"})

    # -- encoder ------------------------------------------------------------------------------------
    def tolerance(self, opts: Options):
        """0: a lossless residual.  Tier ``tokens`` overrides."""
        if opts.tolerance is not UNSET and opts.tolerance != 0:
            raise ConfigError("tier 'exact' is bit-identical (tolerance 0); use tier='tokens' with tolerance=eps")
        return 0

    def check(self, opts: Options, model) -> None:
        super().check(opts, model)
        if model is None:
            raise ConfigError(f"tier {self.tier_id!r} stores the cache as its tokens and needs the model: "
                              "encode(cache, model)")
        if opts.token_model is not None and opts.token_model not in TOKEN_MODEL_OPTIONS:
            raise ConfigError(f"token_model must be one of {list(TOKEN_MODEL_OPTIONS)}, not {opts.token_model!r}")
        self.tolerance(opts)

    def write(self, job: EncodeJob) -> int:
        tolerance = self.tolerance(job.options)
        enc = prepare(job, tolerance)
        kv = job.kv
        job.info = job.base_info()
        job.info.setdefault("schedule_source", enc.how)
        job.report.update(cross_entropy_bits=enc.token_bits, schedule_source=enc.how)
        payloads, sums = [], []
        if tolerance is not None:
            codec = IntResidualRans(tolerance=tolerance)
            for li, part, c, where in job.slice_jobs():
                orig, reg = tensor_slice(kv, li, part, where), tensor_slice(enc.regen, li, part, where)
                payload = codec.encode(orig, where, prediction=reg)
                # what the decoder must produce: the original, or with a tolerance the reconstruction
                if tolerance:
                    target = codec.decode(payload, where, prediction=bit_patterns(reg))
                else:
                    target = bit_patterns(orig)
                sums.append(checksum(target))
                payloads.append(((li, part, c), payload))
            self._judge_residual(job, enc, tolerance, sum(len(p) for _, p in payloads if p is not None))
        writer = KvzWriter(job.sink, job.header(self.tier_id, IntResidualRans().get_config(),
                                                extra=(self.header_key, enc.header_tokens),
                                                num_tokens=int(enc.tokens.shape[1])))
        for r, stream in enumerate(enc.streams):
            writer.write_section(L.SECTION_TOKEN_STREAM, pack_stream(stream), chunk=r)
        if tolerance is not None:
            # layer states (1.3): checked like slices; stored whole where regeneration does not reproduce them
            differs = set()
            for li, (st, rs) in enumerate(zip(kv.states, enc.regen.states)):
                if st is not None:
                    for j, ((_n, _s, t), (_m, _r, u)) in enumerate(zip(st.tensors(), rs.tensors())):
                        sums.append(checksum(bit_patterns(t)))
                        if not same_bits(t, u):
                            differs.add((li, j))
            writer.write_section(L.SECTION_TENSOR_CHECKSUMS, np.asarray(sums, dtype="<u8").tobytes())
            for (li, part, c), payload in payloads:
                if payload is not None:
                    writer.write_section(L.SECTION_RESIDUAL, payload, layer=li, part=part, chunk=c)
            write_states(writer, kv, lambda li, j: (li, j) in differs)
        return writer.close()

    #: a residual is large (a warning) when it is more than this many bytes and ...
    WARN_BYTES = 16384
    #: ... more than this many times the rest of the file (token streams, and ~2 KiB for the header)
    WARN_FACTOR = 4

    def _judge_residual(self, job: EncodeJob, enc: TokenEncoding, tolerance, residual_bytes: int) -> None:
        """Say so when regeneration does not reproduce the cache and the residual is large: a
        :class:`ResidualWarning` naming the positions that differ and the likely cause.  (The file is never much
        larger than the lossless tier's: a slice the regeneration predicts worse than nothing is coded directly,
        as the lossless tier codes it - spec §12, mode 2.)"""
        kv, regen = job.kv, enc.regen
        raw = sum(t.numel() * t.element_size() for t in kv.keys + kv.values)
        streams = sum(s.nbytes for s in enc.streams)
        if residual_bytes <= max(self.WARN_BYTES, self.WARN_FACTOR * (streams + 2048)):
            return
        n = int(enc.tokens.shape[1])
        differs = torch.zeros(n, dtype=torch.bool)
        for a, b in zip(kv.keys + kv.values, regen.keys + regen.values):
            if a.shape[2] == n and a.numel():
                differs |= (bit_patterns(a) != bit_patterns(b)).reshape(a.shape[0], a.shape[1], n, -1).any(-1).any(
                    1).any(0)
        if not bool(differs.any()):
            return
        single = torch.zeros(n, dtype=torch.bool)
        single[single_steps(expand(enc.header_tokens["schedule"]))] = True
        k, where = int(differs.sum()), torch.nonzero(differs).flatten()
        threads = enc.header_tokens["procedure"]["numerics"].get("step_threads")
        tried = f"it tried one-token calls on {step_thread_candidates()} threads"
        first = int(where[0])
        if enc.how.startswith("unknown") and first > 0 and k == n - first:
            cause = (f"positions 0..{first - 1} are reproduced by one prefill and every later one differs: the cache "
                     f"looks like a prefill of {first} tokens followed by calls of one token (generate(), a decode "
                     f"loop) made under settings the encoder did not find ({tried}): another thread count, "
                     "attention implementation or torch build than this process's")
        elif bool((differs & ~single).any()):
            cause = (f"positions inside multi-token calls differ (the first at {first}): the cache was "
                     f"filled by other calls than the plan found ({enc.how}; pass schedule= or fill a "
                     "kvcodec.tokens.RecordingCache), or its calls of several tokens ran on another thread count "
                     f"than this process's {torch.get_num_threads()}, another attention implementation, dtype or "
                     "torch build")
        else:
            cause = (f"only one-token calls differ: they ran under settings the encoder did not find ({tried} "
                     f"and kept {threads}): another thread count, attention implementation or torch build than "
                     "this process's")
        size = residual_bytes + streams
        msg = (f"recomputing this cache from its tokens reproduces {n - k} of its {n} positions bit for bit; the "
               f"other {k} ({100 * k / n:.1f} %) are stored as a residual of {residual_bytes:,} bytes "
               f"({raw / size:,.0f}x smaller than the raw cache instead of thousands of times). Likely cause: "
               f"{cause}. Encoding in the process that made the cache, with the same model object and settings, "
               "avoids it (slices predicted worse than nothing are stored as the lossless tier stores them)")
        job.report["residual_positions"] = k
        warn(msg, ResidualWarning)

    # -- container ----------------------------------------------------------------------------------
    def parse_header(self, v, header, limits: dict) -> TokenChannel:
        tier, p = self.tier_id, "tokens"
        t, ntok = header.raw["tokens"], header.num_tokens
        if header.model is None:
            v.fail("model", f"tier {tier!r} needs the model's fingerprint")
        v.obj(t, p, {"token_model", "draft", "vocab", "chunk_tokens", "procedure", "schedule", "padding",
                     "positions", "pad_token", "tolerance", "max_abs_deviation"})
        tm = v.str(t, "token_model", p)
        if tm not in TOKEN_MODELS:
            v.fail(f"{p}.token_model", f"unknown token model {tm!r}", UnknownId)
        draft = t["draft"]
        if (draft is None) != (tm != "draft"):
            v.fail(f"{p}.draft", "must be an object exactly when token_model is 'draft'")
        if draft is not None:
            v.obj(draft, f"{p}.draft", {"fingerprint"}, {"name", "architecture", "tokenizer", "weights"})
            for key in ("fingerprint", "tokenizer", "weights"):  # (1.12) weights
                if key in draft and not is_hex64(v.str(draft, key, f"{p}.draft")):
                    v.fail(f"{p}.draft.{key}", "must be 64 lowercase hex digits")
        vocab = v.int(t, "vocab", p, 2, MAX_VOCAB)  # spec 11.2.1: every symbol keeps a frequency >= 1 of 2**24
        chunk = v.int(t, "chunk_tokens", p, 1, L.MAX_CHUNK_TOKENS, LimitExceeded)
        if not isinstance(t["procedure"], dict) or "id" not in t["procedure"]:
            v.fail(f"{p}.procedure", "must be an object with an id")
        if t["procedure"]["id"] != PROCEDURES[tm]:
            v.fail(f"{p}.procedure.id", f"{t['procedure']['id']!r} is not a procedure of token model {tm!r}",
                   UnknownId)
        if tm == "blocks":  # (1.9) the block length is part of the procedure
            if "block_tokens" not in t["procedure"]:
                v.fail(f"{p}.procedure.block_tokens", "missing: token model 'blocks' needs the block length")
            v.int(t["procedure"], "block_tokens", f"{p}.procedure", 1, blocks.MAX_BLOCK_TOKENS, LimitExceeded)
        for key in ("numerics", "draft_numerics"):  # (1.2; their value types: revision 1.11.1) spec 11.1, 11.4
            if key in t["procedure"]:
                _check_profile(v, t["procedure"][key], f"{p}.procedure.{key}")
        if ntok < 1:
            v.fail("cache.num_tokens", f"tier {tier!r} needs num_tokens >= 1")
        if header.start_position != 0:
            v.fail("cache.start_position", f"tier {tier!r} regenerates from position 0; start_position must be 0")
        for i, lay in enumerate(header.layers):
            if lay.state is not None and lay.state.kind == "linear":
                continue  # state only: no attention tokens
            if lay.cumulative_length != ntok or (lay.sliding_window is None and lay.seq_len != ntok):
                v.fail(f"cache.layers[{i}]", f"tier {tier!r}: every layer must have seen all {ntok} tokens")
        schedule_runs = t["schedule"]
        if not isinstance(schedule_runs, list) or not 1 <= len(schedule_runs) <= MAX_SCHEDULE_RUNS:
            v.fail(f"{p}.schedule", f"must be a list of 1 to {MAX_SCHEDULE_RUNS} [size, count] pairs")
        total = 0
        for i, r in enumerate(schedule_runs):
            if not (isinstance(r, list) and len(r) == 2 and all(isinstance(x, int) and not isinstance(x, bool)
                                                                and x >= 1 for x in r)):
                v.fail(f"{p}.schedule[{i}]", "must be a [size, count] pair of positive integers")
            total += r[0] * r[1]
            if total > ntok:
                break
        if total != ntok:
            v.fail(f"{p}.schedule", f"calls add up to {total} tokens, num_tokens is {ntok}")
        pad = t["padding"]
        if not (isinstance(pad, list) and len(pad) == header.batch and all(
                isinstance(x, int) and not isinstance(x, bool) and 0 <= x < ntok for x in pad)):
            v.fail(f"{p}.padding", f"must be {header.batch} integers in [0, {ntok})")
        positions = v.str(t, "positions", p)
        if positions not in POSITIONS:
            v.fail(f"{p}.positions", f"must be one of {list(POSITIONS)}", UnknownId)
        pad_token = v.int(t, "pad_token", p, 0, vocab - 1)
        tol = v.num(t, "tolerance", p)
        if tier == "exact" and tol != 0:
            v.fail(f"{p}.tolerance", "must be 0 in tier 'exact'")
        v.num(t, "max_abs_deviation", p)
        return TokenChannel(tm, draft, vocab, chunk, tuple(map(tuple, schedule_runs)), tuple(pad), positions,
                            pad_token, tol, t)

    def sections(self, header) -> list:
        out = [((L.SECTION_TOKEN_STREAM, 0, 0, r), False) for r in range(header.batch)]
        if header.tier_info.has_residual:  # checksums of every slice; residuals only where non-zero
            out.append(((L.SECTION_TENSOR_CHECKSUMS, 0, 0, 0), False))
            out += [((L.SECTION_RESIDUAL, *s), True) for s in header.slices()]
            # (1.3) a state tensor is stored only where regeneration does not reproduce it
            out += [((L.SECTION_STATE, li, j, 0), True) for li, j in header.state_sections()]
        return out

    # -- decoder ------------------------------------------------------------------------------------
    def decoder(self, f):
        return _TokenDecoder(f)

    def describe(self, reader) -> dict:
        h = reader.header
        t = h.tier_info
        coded = sum(h.num_tokens - p for p in t.padding)
        stream_bytes = sum(e.length for e in reader.sections if e.section_type == L.SECTION_TOKEN_STREAM)
        return {"token_channel": {
            "token_model": t.token_model, "draft": t.draft, "schedule": t.raw["schedule"],
            "padding": list(t.padding), "positions": t.positions, "tolerance": t.tolerance,
            "max_abs_deviation": t.raw["max_abs_deviation"],
            "coded_tokens": coded, "token_stream_bytes": stream_bytes,
            "bits_per_token": round(8 * stream_bytes / coded, 4) if coded else None,
            "residual_bytes": sum(e.length for e in reader.sections if e.section_type == L.SECTION_RESIDUAL),
            "procedure": t.raw["procedure"],
        }}

    def describe_section(self, reader, entry) -> dict:
        return {"batch_row": entry.chunk} if entry.section_type == L.SECTION_TOKEN_STREAM else {}


# --- encoding ---------------------------------------------------------------------------------------
def _close(a: torch.Tensor, b: torch.Tensor, rel: float = 2e-2) -> bool:
    a, b = a.double(), b.double()
    scale = a.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    return bool(((a - b).abs() / scale).max() <= rel) if a.numel() else True


@dataclass
class TokenEncoding:
    header_tokens: dict
    streams: list[TokenStream]
    regen: KVCache
    tokens: torch.Tensor
    how: str
    token_bits: float


def prepare(job: EncodeJob, tolerance) -> TokenEncoding:
    """Everything of a token-tier file but the residual sections; raises :class:`Fallback`.  One-token calls
    run on the thread count that reproduces the cache's own (found by :func:`infer_plan`; ``STEP_THREADS``
    where none does), which the numerics profile records (``step_threads``)."""
    return _prepare(job, tolerance)


def _prepare(job: EncodeJob, tolerance) -> TokenEncoding:
    kv, opts = job.kv, job.options
    mdl, tok = split_model(job.model)
    token_model = opts.token_model or ("draft" if opts.draft is not None else "auto")
    p = next(mdl.parameters())
    if p.dtype != kv.dtype:
        raise ConfigError(f"the cache is {kv.dtype_name}, the model computes in {str(p.dtype)[6:]}: pass the model "
                          "the cache was made with (same dtype)")
    if kv.start_position != 0:
        raise Fallback(f"the cache starts at position {kv.start_position}; regeneration needs every token from 0")
    attn = [i for i, st in enumerate(kv.states) if st is None or st.kind != "linear"]  # layers with attention
    n = max(kv.cumulative_length[i] for i in attn) if attn else None
    if n is None:
        if job.tokens is None:
            raise Fallback("the cache has no attention layer (state-space layers only) to recover the tokens "
                           "from; pass tokens=")
        n = int(torch.as_tensor(job.tokens).reshape(kv.batch, -1).shape[1])
    if any(kv.cumulative_length[i] != n for i in attn) or any(
            kv.sliding_window[i] is None and kv.keys[i].shape[2] != n for i in attn):
        raise Fallback("layers have seen different numbers of tokens")
    tokens = job.tokens
    if tokens is None and kv.tokens is not None and kv.tokens.shape[1] == n:
        tokens = kv.tokens
    if tokens is None:
        if kv.keys[attn[0]].shape[2] != n:
            raise Fallback(f"layer {attn[0]} no longer holds every token (sliding window); pass tokens=")
        try:
            rec = recover(kv, mdl, attn[0])
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
    given = schedule_arg(job.schedule, job.cache, n)
    t0 = time.perf_counter()
    plan, how, verified = infer_plan(mdl, kv, tokens, padding_candidates(tokens, job.attention_mask, mdl, tok), given)
    job.report["plan_seconds"] = time.perf_counter() - t0  # with a verified plan: about one bare prefill
    with step_threads(plan.step_threads):
        return _code(job, tolerance, kv, opts, mdl, tok, token_model, tokens, vocab, n, attn, plan, how, verified)


def _code(job, tolerance, kv, opts, mdl, tok, token_model, tokens, vocab, n, attn, plan, how,
          verified) -> TokenEncoding:
    """The token streams and the regenerated cache of ``plan`` (one-token calls on ``plan.step_threads``)."""
    draft_rec = None
    rows = [tokens[r, plan.padding[r] if plan.padding else 0:] for r in range(kv.batch)]
    if token_model == "lm":  # coded while the plan is replayed: one pass gives the streams and the regeneration
        coder = LMTokenCoder(mdl, lm.CHUNK_TOKENS)
        streams, regen = coder.encode_replay(tokens, plan, job.progress)
        procedure, regen = coder.procedure(lm.SCHEDULE), to_canonical(regen)
    else:
        prefill_s = job.report["plan_seconds"]
        if verified is None:  # the regeneration first ("auto" weighs the token decoding against this prefill)
            t0 = time.perf_counter()
            verified = to_canonical(replay(mdl, tokens, plan, job.progress))
            prefill_s = time.perf_counter() - t0
        elif job.progress:
            job.progress(n)
        regen = verified
        if token_model in ("auto", "blocks"):
            block = opts.codec.get("block_tokens")
            lengths = [int(x.numel()) for x in rows]
            settled = True
            if token_model == "auto":
                block, settled = _auto_block(mdl, lengths, prefill_s, job.report)
            elif block is None:
                block = blocks.default_block_tokens(max(lengths))
            streams = procedure = None
            while block is not None:
                coder = blocks.BlockTokenCoder(mdl, int(block), lm.CHUNK_TOKENS, plan.pad_token)
                t0 = time.perf_counter()
                streams, procedure = coder.encode(rows), coder.procedure()
                took = time.perf_counter() - t0  # the decoder makes the same calls: about its decoding time
                if settled or took <= AUTO_LIMIT * prefill_s:
                    break
                # the estimate was optimistic (later steps attend to more): the next shorter block, if any
                job.report["auto"].setdefault("measured_decode_seconds", {})[block] = round(took, 4)
                shorter = [b for b in AUTO_BLOCKS if b < block and b >= AUTO_MIN_BLOCK]
                block = shorter[0] if shorter else None
                streams = procedure = None
            if token_model == "auto" and not settled:
                _remember_block(mdl, lengths, block, job.report)
            if token_model == "auto":  # the static coder is cheap and wins on repetitive text (logs)
                static = [StaticTokenCoder(vocab, lm.CHUNK_TOKENS).encode(x) for x in rows]
                if streams is None or sum(x.nbytes for x in static) < sum(x.nbytes for x in streams):
                    streams, procedure = static, dict(StaticTokenCoder.PROCEDURE)
            token_model = "blocks" if procedure["id"] == blocks.PROCEDURE else "static"
            job.report["token_model"] = token_model
        elif token_model == "static":
            streams = [StaticTokenCoder(vocab, lm.CHUNK_TOKENS).encode(x) for x in rows]
            procedure = dict(StaticTokenCoder.PROCEDURE)
        else:
            if opts.draft is None:
                raise ConfigError("token_model='draft' needs draft=<a smaller model with the same tokenizer>")
            dm, dtok = split_model(opts.draft)
            if tok is not None and dtok is not None and tok.get_vocab() != dtok.get_vocab():
                raise ConfigError("the draft model's tokenizer differs from the model's")
            if vocab_size(dm) < vocab and int(tokens.max()) >= vocab_size(dm):
                raise ConfigError("the draft model's vocabulary is smaller than the tokens need")
            coder = LMTokenCoder(dm, lm.CHUNK_TOKENS)
            vocab = coder.vocab
            procedure, draft_rec = coder.procedure(lm.INCREMENTAL), model_record(opts.draft, with_weights=True)
            streams = [coder.encode(x) for x in rows]
    procedure = {**procedure, "numerics": {**numerics.profile(mdl), "step_threads": plan.step_threads}}
    if token_model == "draft":
        procedure["draft_numerics"] = {**numerics.profile(split_model(opts.draft)[0]),
                                       "step_threads": plan.step_threads}
    if regen.num_layers != kv.num_layers or any(a.shape != b.shape for a, b in zip(regen.keys + regen.values,
                                                                                   kv.keys + kv.values)) or any(
            (a is None) != (b is None) or (a is not None and a.descriptor() != b.descriptor())
            for a, b in zip(regen.states, kv.states)):
        raise Fallback("the regenerated cache has another shape (another model layout?)")
    # verify the tokens: the first attention layer's values depend on the token only (most models), whatever
    # the schedule or the engine
    if attn and attn[0] == 0 and not _close(regen.values[0], kv.values[0]):
        raise Fallback("the tokens do not regenerate the cache's layer-0 values: the cache was modified "
                       "(quantized, pruned) or was made with another model")
    dev = 0.0
    for a, b in zip(kv.keys + kv.values, regen.keys + regen.values):
        if a.numel():
            d = float((a.double() - b.double()).abs().max())
            dev = max(dev, d) if d == d else float("inf")
    header_tokens = {
        "token_model": token_model, "draft": draft_rec, "vocab": vocab, "chunk_tokens": lm.CHUNK_TOKENS,
        "procedure": procedure, "schedule": runs(plan.schedule), "padding": list(plan.padding or [0] * kv.batch),
        "positions": plan.positions, "pad_token": int(plan.pad_token),
        "tolerance": None if tolerance is None else float(tolerance) if tolerance else 0,
        "max_abs_deviation": dev if dev != float("inf") else None,
    }
    return TokenEncoding(header_tokens, streams, regen, tokens, how, float(sum(s.cross_entropy_bits for s in streams)))


def _auto_block(model, lengths: list[int], prefill_s: float, report: dict) -> tuple[int | None, bool]:
    """Token model "auto": the longest block (``AUTO_BLOCKS``) whose ``L - 1`` batched decoding steps are
    estimated, from one timed step of that batch, to take at most ``AUTO_BUDGET`` x the bare prefill just
    timed; None (token model "static") if none of at least ``AUTO_MIN_BLOCK`` tokens fits; and whether that is
    settled (remembered for these lengths in this process) or still to be confirmed by timing the coding
    itself (``AUTO_LIMIT``).  Measured on this machine, so a file says which it chose
    (``procedure.block_tokens``)."""
    memo = _memo(model)
    key = _memo_key(model, lengths)
    if key in memo:  # one process encodes one cache (and its copies) the same way
        report["auto"] = memo[key][1]
        return memo[key][0], True
    block, report["auto"] = _measure_block(model, lengths, prefill_s)
    return block, False


def _memo(model) -> dict:
    try:
        return _AUTO_MEMO.setdefault(model, {})
    except TypeError:  # not weak-referenceable: no memo
        return {}


def _memo_key(model, lengths) -> tuple:
    return tuple(lengths), torch.get_num_threads(), str(next(model.parameters()).dtype)


def _remember_block(model, lengths, block, report) -> None:
    """The block length "auto" settled on for rows of these lengths (after measuring its coding)."""
    _memo(model)[_memo_key(model, lengths)] = (block, report["auto"])


_AUTO_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _measure_block(model, lengths, prefill_s) -> tuple[int | None, dict]:
    from transformers.cache_utils import DynamicCache

    from ..tokens.plan import cache_kwarg

    longest = max(lengths)
    dev = next(model.parameters()).device
    tried = {}
    for block in AUTO_BLOCKS:
        steps = min(block, longest) - 1
        if steps < AUTO_MIN_BLOCK - 1:
            break
        if block > longest and block // 2 >= longest:  # the next shorter block is as long as the rows
            continue
        rows = sum(-(-m // block) for m in lengths)
        ids = torch.zeros((rows, 1), dtype=torch.int64, device=dev)
        step_s = float("inf")
        with torch.no_grad():
            for _ in range(2):  # the faster of two: the first call of a new shape also sets up kernels
                cache = DynamicCache(config=model.config)
                t0 = time.perf_counter()
                model(ids, use_cache=True, **{cache_kwarg(model): cache})
                step_s = min(step_s, time.perf_counter() - t0)
        tried[block] = round(steps * step_s, 4)
        if steps * step_s <= AUTO_BUDGET * prefill_s:
            return block, {"prefill_seconds": round(prefill_s, 4), "estimated_decode_seconds": tried}
    return None, {"prefill_seconds": round(prefill_s, 4), "estimated_decode_seconds": tried}


# --- decoding ---------------------------------------------------------------------------------------
#: ``step_threads`` of a numerics profile: an intra-op thread count the decoder runs its one-token calls on
MAX_STEP_THREADS = 1024


def _check_profile(v, prof, path: str) -> None:
    """A numerics profile (spec 11.4): an object whose values are strings or integers (not booleans), except
    ``env``, an object of strings, and ``step_threads``, an integer 1 .. 1024 [FormatError]."""
    if not isinstance(prof, dict):
        v.fail(path, "must be an object (the numerics profile, spec 11.4)")
    for key, val in prof.items():
        if key == "env":
            if not (isinstance(val, dict) and all(isinstance(x, str) for x in val.values())):
                v.fail(f"{path}.env", "must be an object of strings")
        elif key == "step_threads":
            if not (isinstance(val, int) and not isinstance(val, bool) and 1 <= val <= MAX_STEP_THREADS):
                v.fail(f"{path}.step_threads", f"must be an integer 1 .. {MAX_STEP_THREADS}")
        elif not (isinstance(val, str) or (isinstance(val, int) and not isinstance(val, bool))):
            v.fail(f"{path}.{key}", "must be a string or an integer")


def procedure_differences(recorded: dict, coder_model, procedure_id: str, key: str = "numerics") -> str:
    """What differs between the recorded procedure and this decoder's (for error messages): the numerics
    profile where the file records one (``key``: ``numerics`` or ``draft_numerics``), else (files of format
    1.1) the informative dtype / device / threads / versions."""
    if isinstance(recorded.get(key), dict):
        diffs = numerics.differences_here(recorded[key], coder_model, step_threads=recorded[key].get("step_threads"))
    else:
        current = LMTokenCoder(coder_model).procedure(procedure_id)
        diffs = [f"{k} {recorded.get(k)} (file) vs {current.get(k)} (here)" for k in ("dtype", "device", "threads")
                 if k in recorded and recorded.get(k) != current.get(k)]
        rv, cv = recorded.get("versions", {}), current.get("versions", {})
        diffs += [f"{k} {rv[k]} (file) vs {cv.get(k)} (here)" for k in rv if rv[k] != cv.get(k)]
    if not diffs:
        return "the recorded procedure matches this decoder's, so the stream is most likely corrupt"
    return "decode where these match: " + ", ".join(diffs) + ": " + numerics.advice(diffs, tried=True)


class _TokenDecoder:
    """Decoding of one open token-tier file: tokens and regeneration once, residuals per layer."""

    def __init__(self, f):
        self.f = f
        self._regen = None
        self._recompute = False
        t = f.header.tier_info
        if f.draft is not None and t.draft is not None:
            check_model(t.draft, f.draft, "draft")

    def _streams(self) -> list[TokenStream]:
        h, r = self.f.header, self.f.reader
        out = []
        for row in range(h.batch):
            e = r.entry(L.SECTION_TOKEN_STREAM, 0, 0, row)
            out.append(unpack_stream(r.read_payload(e), expect_tokens=h.num_tokens - h.tier_info.padding[row],
                                     chunk=h.tier_info.checksum_tokens, offset=e.payload_offset))
        return out

    def work(self) -> tuple[int, str]:
        """What ``progress`` counts while decoding: positions regenerated (the residuals take no time)."""
        return self.f.header.num_tokens, "token"

    def regenerated(self, progress=None) -> tuple[torch.Tensor, KVCache]:
        """(tokens, the regenerated cache before residuals), decoded once; ``progress(n)`` per n positions."""
        if self._regen is None:
            f, h = self.f, self.f.header
            if f.model is None:
                raise ConfigError(f"this file's tier {h.tier!r} is restored by recomputing the cache with the model "
                                  "it was made with: decode(data, model)")
            if h.tier_info.draft is not None and f.draft is None:
                raise ConfigError("this file's tokens were coded with a draft model: decode(data, model, draft=...)")
            with step_threads(self._step_threads()):  # as the encoder ran its one-token calls
                self._check_numerics()
                tokens, regen = regenerate(h, self._streams(), f.model, f.draft, progress)
            for i, lay in enumerate(h.layers):
                if (regen.keys[i].shape != (h.batch, lay.kv_heads, lay.seq_len, lay.k_dim)
                        or regen.values[i].shape != (h.batch, lay.kv_heads, lay.seq_len, lay.v_dim)
                        or regen.dtype != DTYPES[h.dtype].torch):
                    raise ModelMismatch(f"layer {i}: the model regenerates {tuple(regen.keys[i].shape)} "
                                        f"{regen.dtype}, the header says {(h.batch, lay.kv_heads, lay.seq_len)} "
                                        f"{h.dtype}", field=f"Header.cache.layers[{i}]", offset=L.PREAMBLE.size)
            self._regen = (tokens, regen)
        return self._regen

    def tokens(self) -> torch.Tensor:
        return self.regenerated()[0]

    def _step_threads(self) -> int | None:
        """The encoder's thread count for one-token calls (files of format 1.1: torch's, None)."""
        n = self.f.header.tier_info.raw["procedure"].get("numerics", {})
        n = n.get("step_threads") if isinstance(n, dict) else None
        return n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_STEP_THREADS else None

    def _check_numerics(self) -> None:
        """Before any work: can this machine reproduce the float results the file needs (spec 11.4)?"""
        f, t = self.f, self.f.header.tier_info
        proc = t.raw["procedure"]
        if f.numerics == "try" or not isinstance(proc.get("numerics"), dict):
            return  # asked to try, or a file without a recorded profile: the checksums decide
        multi = any(size > 1 for size, _ in t.schedule_runs)
        diffs = numerics.differences_here(proc["numerics"], split_model(f.model)[0],
                                          step_threads=self._step_threads(), multi_token_calls=multi)
        token_diffs = []
        if t.token_model == "lm":
            token_diffs = diffs
        elif t.token_model == "blocks":  # batched calls: the thread count matters (multi-token shaped)
            token_diffs = numerics.differences_here(proc["numerics"], split_model(f.model)[0],
                                                    step_threads=self._step_threads(), multi_token_calls=True)
        elif t.token_model == "draft" and isinstance(proc.get("draft_numerics"), dict) and f.draft is not None:
            token_diffs = numerics.differences_here(proc["draft_numerics"], split_model(f.draft)[0],
                                                    step_threads=proc["draft_numerics"].get("step_threads"),
                                                    multi_token_calls=False)
        if token_diffs:
            raise NumericsMismatch(
                f"the tokens of this file were coded with probabilities of the {t.token_model!r} model that this "
                f"machine computes differently ({'; '.join(token_diffs)}): they cannot be decoded here. What works: "
                f"{numerics.advice(token_diffs)}; files of tiers 'lossless' and 'lossy', and token model 'static', "
                "decode anywhere", field="Header.tokens.procedure.numerics", offset=L.PREAMBLE.size)
        if not diffs or not t.has_residual:
            return  # tier tokens without residual: restore = this machine's recompute, by definition
        if f.numerics == "recompute":
            warn(f"numerics differ ({'; '.join(diffs)}): returning this machine's regeneration without the file's "
                 f"residuals; on the encoder's machine a bare regeneration was within "
                 f"{t.raw.get('max_abs_deviation')} of the original", FallbackWarning)
            self._recompute = True
            return
        raise NumericsMismatch(
            f"this file's tier {self.f.header.tier!r} restores the cache bit for bit by recomputing it, and this "
            f"machine computes differently from the encoder's ({'; '.join(diffs)}). What works: "
            f"{numerics.advice(diffs)}; or numerics='recompute' for this machine's regeneration without the "
            "residuals", field="Header.tokens.procedure.numerics", offset=L.PREAMBLE.size)

    def _checksums(self) -> dict:
        h, r = self.f.header, self.f.reader
        e = r.entry(L.SECTION_TENSOR_CHECKSUMS)
        slices = h.slices() + [("state", li, j) for li, j in h.state_sections()]
        if e.length != 8 * len(slices):
            raise FormatError(f"tensor_checksums has {e.length} bytes, the header implies {8 * len(slices)}",
                              field="Payload_Length", offset=e.offset + 16)
        sums = np.frombuffer(r.read_payload(e), dtype="<u8").tolist()
        return {s: (x, e.payload_offset + 8 * i) for i, (s, x) in enumerate(zip(slices, sums))}

    def states(self, layers, regen: KVCache | None = None) -> dict:
        """Layer states (1.3) of ``layers``: the regenerated ones, replaced by the file's ``state`` sections
        where it has them, each checked against its Tensor_Checksum."""
        h, r = self.f.header, self.f.reader
        if not h.has_state:
            return {}
        regen = self.regenerated()[1] if regen is None else regen
        sums = self._checksums() if h.tier_info.has_residual and not self._recompute else None
        out = {}
        for li in layers:
            info, got = h.layers[li].state, regen.states[li]
            if info is None:
                continue
            if got is None or got.descriptor() != info.descriptor():
                raise ModelMismatch(f"layer {li}: the model regenerates another state than the header describes")
            st = LayerState(got.kind, got.slots, list(got.conv), list(got.recurrent), got.indexer)
            for j, (t, (_n, _s, regenerated)) in enumerate(zip(info.tensors, got.tensors())):
                tensor, at = regenerated, None
                if r.has(L.SECTION_STATE, li, j, 0):
                    e = r.entry(L.SECTION_STATE, li, j, 0)
                    tensor, at = decode_payload(r.read_payload(e), t.dtype, t.shape, e.payload_offset), e.payload_offset
                if sums is not None:
                    digest, where = sums["state", li, j]
                    if checksum(bit_patterns(tensor)) != digest:
                        raise ChecksumMismatch(
                            f"layer {li} {t.name} state {t.slot}: the restored tensor's checksum differs from the "
                            "original's - this decoder regenerates the cache differently from the encoder"
                            + ("" if at is None else ", or the state section is corrupt"),
                            field="Tensor_Checksums", offset=where)
                st.set(t.name, t.slot, tensor)
            out[li] = st
        return out

    def layers(self, layers, progress=None, regen: KVCache | None = None) -> dict:
        """Keys and values of ``layers``: the regenerated tensors (``regen``, else the model's) with the residuals
        applied, each slice checked against its Tensor_Checksum."""
        h, r = self.f.header, self.f.reader
        regen = self.regenerated(progress)[1] if regen is None else regen
        sums = self._checksums() if h.tier_info.has_residual and not self._recompute else None
        codec = IntResidualRans()
        outs = {}
        for li in layers:
            lay = h.layers[li]
            for p, t in ((L.PART_KEYS, regen.keys[li]), (L.PART_VALUES, regen.values[li])):
                if sums is None:
                    outs[li, p] = t
                    continue
                bits = bit_patterns(t).copy()
                for c in range(lay.chunks(h.chunk_tokens)):
                    a, b = lay.chunk_range(c, h.chunk_tokens)
                    digest, at = sums[li, p, c]
                    payload = None
                    if r.has(L.SECTION_RESIDUAL, li, p, c):
                        e = r.entry(L.SECTION_RESIDUAL, li, p, c)
                        payload, at = r.read_payload(e), e.payload_offset
                    where = Slice((h.batch, lay.kv_heads, b - a, bits.shape[3]), h.dtype, li, p, a, lay.seq_len,
                                  len(h.layers), at)
                    out = codec.decode(payload, where, prediction=np.ascontiguousarray(bits[:, :, a:b]))
                    if checksum(out) != digest:
                        raise ChecksumMismatch(
                            f"layer {li} {('keys', 'values')[p]} chunk {c}: the restored tensor's checksum differs "
                            "from the original's - this decoder regenerates the cache differently from the encoder "
                            "(another engine, dtype, library version or thread count: see the file's "
                            "tokens.procedure)" + ("" if payload is None else ", or the residual is corrupt"),
                            field="Tensor_Checksums", offset=at)
                    bits[:, :, a:b] = out
                outs[li, p] = from_bit_patterns(bits, DTYPES[h.dtype].torch)
        return outs


def regenerate(header, streams: list[TokenStream], model, draft=None, progress=None) -> tuple[torch.Tensor, KVCache]:
    """Decode the token streams and regenerate the cache (before residuals); ``progress(n)`` per n positions."""
    try:
        return _regenerate(header, streams, model, draft, progress)
    except ChecksumMismatch as e:
        t = header.tier_info
        if t.token_model == "static":
            raise
        coder_model = split_model(draft if t.token_model == "draft" else model)[0]
        hint = procedure_differences(t.raw["procedure"], coder_model, PROCEDURES[t.token_model],
                                     "draft_numerics" if t.token_model == "draft" else "numerics")
        raise ChecksumMismatch(f"{e.message}. {hint}", field=e.field, offset=e.offset) from None


def _regenerate(header, streams: list[TokenStream], model, draft=None, progress=None) -> tuple[torch.Tensor, KVCache]:
    t = header.tier_info
    mdl, _ = split_model(model)
    n_layers = getattr(getattr(mdl, "config", None), "num_hidden_layers", None)
    if n_layers is not None and n_layers != len(header.layers):
        raise ModelMismatch(f"the header describes {len(header.layers)} layers, the model has {n_layers}",
                            field="Header.cache.layers")
    plan = t.plan([lay.sliding_window for lay in header.layers])
    if t.token_model in ("lm", "static", "blocks") and vocab_size(mdl) != t.vocab:
        raise FormatError(f"tokens.vocab {t.vocab} differs from the model's {vocab_size(mdl)}",
                          field="Header.tokens.vocab")
    if t.token_model == "lm":
        tokens, regen = LMTokenCoder(mdl, t.checksum_tokens).decode_replay(streams, plan, progress)
        return tokens, to_canonical(regen)
    if t.token_model == "blocks":  # every row at once: their blocks are one batch
        rows = blocks.BlockTokenCoder(mdl, int(t.raw["procedure"]["block_tokens"]), t.checksum_tokens,
                                      t.pad_token).decode(streams)
    else:
        if t.token_model == "static":
            coder = StaticTokenCoder(t.vocab, t.checksum_tokens)
        else:
            if draft is None:
                raise ConfigError("this file's tokens were coded with a draft model: decode(data, model, draft=...)")
            coder = LMTokenCoder(split_model(draft)[0], t.checksum_tokens)
            if coder.vocab != t.vocab:
                raise FormatError(f"tokens.vocab {t.vocab} differs from the draft model's {coder.vocab}",
                                  field="Header.tokens.vocab")
        rows = (coder.decode(s) for s in streams)
    tokens = torch.full((header.batch, header.num_tokens), t.pad_token, dtype=torch.int64)
    for r, ids in enumerate(rows):
        if ids.numel() and int(ids.max()) >= vocab_size(mdl):
            raise FormatError(f"batch row {r}: a decoded token id is outside the model's vocabulary",
                              field="Token_Stream.Words")
        tokens[r, t.padding[r]:] = ids
    return tokens, to_canonical(replay(mdl, tokens, plan, progress))
