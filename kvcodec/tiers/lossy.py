"""Tier ``lossy``: per-vector quantization, ``vq_rans``; no model needed to decode, deterministic.

Options are the codec's (:mod:`kvcodec.codecs.vq_rans`: ``bits``, ``quantizer``,
``window``, ``sink`` ...) plus ``max_kl``.  The rate is met here, not in the
codec: ``bits=`` (average bits per component, side information included) by a
closed loop on the uniform quantizer's step, or ``max_kl=`` by calibrating the
step with the model on the cache's own last tokens.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..cache import KVCache
from ..codecs.vq_rans import CHANNEL_MINOR, DEFAULTS, WEIGHTED_DEFAULTS, VqRans, describe, global_step, uses_kernel
from ..container import layout as L
from ..dtypes import from_bit_patterns
from ..errors import ConfigError, warn
from ..identity import split_model
from ..parallel import run_ordered
from ..registry import register_tier
from ..tokens.plan import cache_kwarg
from ..tokens.recover import recover
from .base import DirectTier, EncodeJob, tensor_slice


@register_tier
class LossyTier(DirectTier):
    tier_id = "lossy"
    min_minor = 2  # Sign_Rule 1 (SplitMix64 signs); files stamped 1.1 hold Sign_Rule 0 payloads
    read_minor = 1
    summary = "quantized tensors (--bits or --max-kl); no model needed to decode"
    codec_ids = (VqRans.codec_id,)
    option_names = frozenset(DEFAULTS) | frozenset(WEIGHTED_DEFAULTS) | {"max_kl", "profile"}

    @classmethod
    def file_minor(cls, params: dict) -> int:
        """1.5 for quantizer ``weighted`` (its keys are ``vq_rans`` Method 5 payloads), else the tier's."""
        return CHANNEL_MINOR if params.get("quantizer") == "weighted" else cls.min_minor

    def codec(self, job: EncodeJob) -> VqRans:
        options = dict(job.options.codec)
        max_kl = options.pop("max_kl", None)
        profile = options.pop("profile", None)
        codec = VqRans.configure(options, job.kv.dtype_name)
        params, kv = codec.params, job.kv
        if params["quantizer"] == "weighted":
            from ..calibrate import Profile

            if not isinstance(profile, Profile):
                raise ConfigError("quantizer 'weighted' needs profile=kvcodec.calibrate(model) (the key channels' "
                                  "weights; decoding does not need it)")
            profile.check(kv.keys)
            codec.key_weights = profile.key_weights
        elif profile is not None:
            raise ConfigError("profile= is for quantizer 'weighted'")
        for i, t in enumerate(kv.keys + kv.values):
            if t.shape[-1] & (t.shape[-1] - 1) and params["quantizer"] in ("uniform", "lloyd", "weighted"):
                raise ConfigError(f"{VqRans.codec_id}: head dimension {t.shape[-1]} is not a power of two (the "
                                  "Hadamard rotation needs one)")
            if t.numel() and not bool(torch.isfinite(t).all()):
                part, layer = ("keys", i) if i < len(kv.keys) else ("values", i - len(kv.keys))
                raise ConfigError(f"layer {layer} {part}: a value is not finite; the lossy tier quantizes finite "
                                  "values (tier 'lossless' stores any bit pattern)")
        if max_kl is not None:
            if params["quantizer"] != "uniform" or options.get("step") is not None:
                raise ConfigError("max_kl= picks the step of the uniform quantizer; do not give step=")
            params["step"], params["calibrated_kl"] = step_for_kl(kv, job.model, float(max_kl), codec)
            params["max_kl"] = float(max_kl)
        elif params["quantizer"] in ("uniform", "weighted") and params["step"] is None:
            params["step"] = global_step(kv.keys + kv.values, params)
        return codec

    def encode_threads(self, job: EncodeJob) -> int | None:
        """One thread where the Triton kernel quantizes (the rotated uniform quantizer of quantizers ``uniform``
        and ``weighted``, on any tensor on a GPU or under ``KVCODEC_TRITON=1``: a GPU serialises the launches
        anyway, and Triton's CPU interpreter is not thread-safe); else the job's."""
        quantizer = job.options.codec.get("quantizer", DEFAULTS["quantizer"])
        if quantizer in ("uniform", "weighted") and any(uses_kernel(t) for t in job.kv.keys + job.kv.values):
            return 1
        return job.options.threads

    def payloads(self, job: EncodeJob, codec: VqRans, jobs) -> list[bytes] | None:
        """Closed loop on the rate: code every slice, measure, rescale the step and repeat until indices + norms
        + tables fit in ``bits=`` per component (rate ~ -log2 step); the payloads of the chosen step.
        Two-sided: the order-0 estimate the first step came from overshoots what the context coder achieves by
        ~0.5 bit."""
        given = job.options.codec
        params, kv = codec.params, job.kv
        if (params["quantizer"] not in ("uniform", "weighted") or given.get("step") is not None
                or given.get("max_kl") is not None):
            return None  # a fixed step
        threads = self.encode_threads(job)
        work = self.encode_slice(job, codec)
        # The rate is that of the quantized tokens: the exactly stored ones (sink, window) are stored at their
        # own, step-independent cost.  (Counting them made the budget of small caches unreachable, and the loop
        # then raised the step until every index was 0.)
        comps, exact_bytes = 0, 0
        for li, part, _c, where in jobs:
            head, tail = codec.exact_split(where)
            b, h, n, d = where.shape
            comps += b * h * (n - head - tail) * d
            exact_bytes += codec.exact_bytes(tensor_slice(kv, li, part, where), where)
        if comps == 0:
            return None  # every token is stored exactly: no step to choose
        best, first = None, None
        for _ in range(8):
            payloads = []
            run_ordered(jobs, work, threads, lambda j, pl: payloads.append(pl))
            rate = 8 * (sum(len(pl) for pl in payloads) - exact_bytes) / comps
            first = first or (rate, params["step"], payloads)
            if rate <= params["bits"] and (best is None or rate > best[0]):
                best = (rate, params["step"], payloads)
            if rate <= params["bits"] and params["bits"] - rate < 0.02:
                break
            with np.errstate(over="ignore"):
                nxt = float(np.float32(params["step"] * 2.0 ** min(rate - params["bits"] + 0.005, 64.0)))
            if not (math.isfinite(nxt) and nxt > 0):
                break  # the budget is out of reach (tiny caches): no finite step meets it
            params["step"] = nxt
        if best is None:
            # Side information alone exceeds the budget (tiny caches): keep the first step (the order-0 estimate
            # for the requested rate), not the lowest rate reached - that is a step so large that every index
            # is 0 and the quantized tokens decode to zero vectors.
            warn(f"{VqRans.codec_id}: bits={params['bits']} not reachable for this cache (norms, tables and fixed "
                 f"fields alone cost more); its quantized tokens take {first[0]:.2f} bits per component")
            best = first
        _, params["step"], payloads = best
        return payloads

    def describe_section(self, reader, entry) -> dict:
        """The quantizer, index bits, step and exact tokens a kv section's payload starts with."""
        h = reader.header
        if entry.section_type != L.SECTION_KV:
            return {}
        lay = h.layers[entry.layer]
        a, b = lay.chunk_range(entry.chunk, h.chunk_tokens)
        return {"coding": describe(reader.read_payload_prefix(entry, 64),
                                   (h.batch, lay.kv_heads, b - a, lay.dim(entry.part)), 8 * h.itemsize)}


def step_for_kl(kv: KVCache, model, max_kl: float, codec: VqRans, calib_tokens: int = 32) -> tuple[float, float]:
    """The coarsest uniform step whose cache keeps the model's next-token distributions within ``max_kl``
    (mean KL, bits) on the cache's own last ``calib_tokens`` tokens: those are fed teacher-forced on top of the
    rest of the cache, exact and quantized.  Needs the model and the tokens (given or recovered)."""
    from .base import slice_jobs, tensor_slice

    if model is None:
        raise ConfigError("max_kl= needs the model: encode(cache, model, tier='lossy', max_kl=...)")
    if kv.reduce is not None:
        raise ConfigError("max_kl= calibrates on the cache's own last tokens, which a reduced cache's entries are "
                          "not: use bits= for a reduced cache")
    mdl, _ = split_model(model)
    s = kv.seq_len
    n = min(calib_tokens, s // 4)
    if n < 1 or kv.start_position or any(k.shape[2] != s for k in kv.keys):
        raise ConfigError("max_kl= needs a cache of at least 4 tokens from position 0 with every layer complete")
    tokens = kv.tokens
    if tokens is None:
        rec = recover(kv, mdl)
        if not rec.ok:
            raise ConfigError(f"max_kl= needs the cache's tokens: pass tokens= ({rec.reason})")
        tokens = rec.tokens

    def logp(cache_kv: KVCache):
        prefix = KVCache([k[:, :, :s - n] for k in cache_kv.keys], [v[:, :, :s - n] for v in cache_kv.values])
        with torch.no_grad():
            out = mdl(tokens[:, s - n:].to(next(mdl.parameters()).device), use_cache=True,
                      **{cache_kwarg(mdl): prefix.to_dynamic_cache()})
        return torch.log_softmax(out.logits.double(), dim=-1)

    ref = logp(kv)
    whole = slice_jobs(kv, max(s, 1))  # one slice per layer and part

    def kl_at(step: float) -> float:
        parts = {L.PART_KEYS: [], L.PART_VALUES: []}
        for li, part, _c, where in whole:
            bits = codec.decode(codec.encode(tensor_slice(kv, li, part, where), where, step=step), where)
            parts[part].append(from_bit_patterns(bits, kv.dtype))
        lq = logp(KVCache(parts[L.PART_KEYS], parts[L.PART_VALUES]))
        return float(((ref.exp() * (ref - lq)).sum(-1) / np.log(2)).mean())

    lo, hi = -5.0, 2.0  # log2 step: lo (about 7 bits per component) meets the target (checked), hi is coarse
    best = (2.0 ** lo, kl_at(2.0 ** lo))
    if best[1] > max_kl:
        raise ConfigError(f"max_kl={max_kl} is not reachable by the lossy tier on this cache (the finest step "
                          f"gives {best[1]:.3g} bits); use tier='exact' or 'lossless'")
    for _ in range(7):
        mid = (lo + hi) / 2
        d = kl_at(2.0 ** mid)
        if d <= max_kl:
            lo, best = mid, (2.0 ** mid, d)
        else:
            hi = mid
    return float(np.float32(best[0])), best[1]

