"""Tier ``lossy``: per-vector quantization, ``vq_rans``; no model needed to decode, deterministic.

Options are the codec's (:mod:`kvcodec.codecs.vq_rans`: ``bits``, ``quantizer``,
``window``, ``sink`` ...) plus ``max_kl``.  The rate is met here, not in the
codec: ``bits=`` (average bits per component, side information included) by a
closed loop on the uniform quantizer's step, or ``max_kl=`` by calibrating the
step with the model on the cache's own last tokens.
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from ..cache import KVCache
from ..codecs.vq_rans import (
    CHANNEL_MINOR,
    DEFAULTS,
    PREDICT_MINOR,
    PREDICTED_KEY_RATIO,
    WEIGHTED_DEFAULTS,
    VqRans,
    describe,
    global_step,
    uses_kernel,
)
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
    option_names = frozenset(DEFAULTS) | frozenset(WEIGHTED_DEFAULTS) | {"max_kl", "profile", "predictors"}

    @classmethod
    def file_minor(cls, params: dict) -> int:
        """1.6 for predicted slices, 1.5 for quantizer ``weighted`` (its keys are ``vq_rans`` Method 5 payloads),
        else the tier's."""
        if params.get("predict"):
            return PREDICT_MINOR
        return CHANNEL_MINOR if params.get("quantizer") == "weighted" else cls.min_minor

    def codec(self, job: EncodeJob) -> VqRans:
        options = dict(job.options.codec)
        max_kl = options.pop("max_kl", None)
        profile = options.pop("profile", None)
        predictors = options.pop("predictors", None)
        if predictors is not None and options.get("quantizer") == "weighted":
            options.setdefault("key_ratio", PREDICTED_KEY_RATIO)
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
        if predictors is not None:
            from ..predict import as_predictors

            predictors = as_predictors(predictors)
            params["predict"] = _check_predictors(predictors, kv, params)
            codec.predictors = predictors
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

    def decoder(self, f):
        if f.header.predict is not None:
            return _PredictedDecoder(f, super().decoder(f))
        return super().decoder(f)

    def header_objects(self, codec) -> dict:
        """(1.6) the ``predict`` object when the slices are residuals of a prediction."""
        if getattr(codec, "predictors", None) is None:
            return {}
        return {"predict": {"predictors": codec.params["predict"], "layout": "rotate_half",
                            "exact_head": codec.exact_range[0], "exact_tail": codec.exact_range[1]}}

    def payloads(self, job: EncodeJob, codec: VqRans, jobs) -> list[bytes] | None:
        """Closed loop on the rate: code every slice, measure, rescale the step and repeat until indices + norms
        + tables fit in ``bits=`` per component (rate ~ -log2 step); the payloads of the chosen step.
        Two-sided: the order-0 estimate the first step came from overshoots what the context coder achieves by
        ~0.5 bit."""
        given = job.options.codec
        params, kv = codec.params, job.kv
        predicted = getattr(codec, "predictors", None) is not None  # each layer depends on the one before it
        if (params["quantizer"] not in ("uniform", "weighted") or given.get("step") is not None
                or given.get("max_kl") is not None):  # a fixed step
            return _predicted_payloads(kv, codec, jobs, params["step"]) if predicted else None
        threads = self.encode_threads(job)
        work = self.encode_slice(job, codec)

        def code_all() -> list[bytes]:
            if predicted:
                return _predicted_payloads(kv, codec, jobs, params["step"])
            payloads = []
            run_ordered(jobs, work, threads, lambda j, pl: payloads.append(pl))
            return payloads

        # The rate is that of the quantized tokens: the exactly stored ones (sink, window) are stored at their
        # own, step-independent cost.  (Counting them made the budget of small caches unreachable, and the loop
        # then raised the step until every index was 0.)
        comps, exact_bytes = 0, 0
        for li, part, _c, where in jobs:
            head, tail = codec.exact_split(where)
            b, h, n, d = where.shape
            comps += b * h * (n - head - tail) * d
            exact_bytes += codec.exact_bytes(tensor_slice(kv, li, part, where), where)
        if comps == 0:  # every token is stored exactly: no step to choose
            return _predicted_payloads(kv, codec, jobs, params["step"]) if predicted else None
        best, first = None, None
        for _ in range(8):
            payloads = code_all()
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
        return {"coding": describe(reader.read_payload_prefix(entry, 64),
                                   lay.slice_shape(entry.chunk, h.chunk_tokens, h.batch, entry.part), 8 * h.itemsize)}


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



# --- predicted slices (format 1.6, spec/kvz.md §13.1; design notes: docs/design_predictive_lossy.md) ----------

def _check_predictors(pred, kv: KVCache, params: dict) -> str:
    """The predictors' identity (SHA-256 of their file bytes) after checking they fit the cache."""
    if params["quantizer"] != "weighted":
        raise ConfigError("predictors= is for quantizer 'weighted'")
    if kv.reduce is not None:
        raise ConfigError("a reduced cache's entries are not positions: predictors= does not apply")
    if len(pred.keys) != kv.num_layers:
        raise ConfigError(f"the predictors have {len(pred.keys)} layers, the cache {kv.num_layers}")
    if any(s is not None for s in kv.states) or any(w is not None for w in kv.sliding_window):
        raise ConfigError("predictors= needs full-attention layers without layer state or sliding window (spec "
                          "13.1): store this cache unpredicted")
    t = kv.keys[0].shape[2]
    if (kv.start_position + t) * pred.cos_theta.size > L.MAX_ROPE_STEPS:
        raise ConfigError(f"positions up to {kv.start_position + t} with {pred.cos_theta.size} rotary pairs exceed "
                          f"the RoPE recurrence's limit of {L.MAX_ROPE_STEPS} steps (spec 13.1): store it unpredicted")
    for i, (k, v) in enumerate(zip(kv.keys, kv.values)):
        width = k.shape[1] * k.shape[3]
        if k.shape != v.shape or k.shape[2] != t or pred.keys[i][1].shape[0] != width \
                or 2 * pred.cos_theta.size != k.shape[3]:
            raise ConfigError(f"layer {i}: keys {tuple(k.shape)}, values {tuple(v.shape)} do not fit the predictors "
                              f"({pred.keys[i][1].shape[0]} features, {pred.cos_theta.size} rotary pairs) or the "
                              "other layers")
    return pred.identity


def _exact_range(params: dict, t: int) -> tuple[int, int]:
    """The quantized tokens ``[a, b)`` of a layer of ``t`` tokens: the first ``sink`` and the last ``window``
    are stored exactly and never predicted."""
    tail = min(params["window"], t) if params["window"] else 0
    return min(params["sink"], t - tail), t - tail


def _predicted_payloads(kv: KVCache, codec: VqRans, jobs, step: float) -> list[bytes]:
    """Every slice's payload in ``jobs`` order: layer after layer, the residual of each quantized token after
    the prediction from the decoder's reconstruction of the layer before (keys pre-RoPE), the exact tokens as
    they are; each layer's reconstruction is the decoder's (its payloads decoded)."""
    from .. import predict as P

    pred, params = codec.predictors, codec.params
    t = kv.keys[0].shape[2]
    a, b = _exact_range(params, t)
    codec.exact_range = (a, t - b)  # the header's predict.exact_head / exact_tail
    icos, isin = pred.inverse_tables(kv.start_position + a, b - a)
    by_layer = {}
    for j in jobs:
        by_layer.setdefault(j[0], []).append(j)
    out = {}
    nl = kv.num_layers
    khat = [None] * nl  # per layer, per batch row: the decoder's pre-RoPE keys [T', H * D] (binary32)
    ready = [threading.Event() for _ in range(nl)]

    def keys_chain():  # the keys of layer l depend on the keys of layer l - 1 only
        for li in range(nl):
            k = kv.keys[li].float().cpu().numpy()
            h = k.shape[1]
            res, pk = k.copy(), []
            for bi in range(k.shape[0]):
                x = khat[li - 1][bi] if li else np.zeros((b - a, 0), np.float32)
                pk.append(P.predict(x, *pred.keys[li], parallel=False))
                res[bi][:, a:b] = P.unflat(P.flat(P.rotate(k[bi][:, a:b], icos, isin, inverse=True)) - pk[bi], h)
            rec = _code_layer(kv, codec, by_layer[li], 0, res, step, out)
            khat[li] = [P.flat(rec[bi][:, a:b]) + pk[bi] for bi in range(k.shape[0])]
            ready[li].set()

    def values_chain():  # the values of layer l need its keys and the values of layer l - 1
        vhat = None
        for li in range(nl):
            v = kv.values[li].float().cpu().numpy()
            h = v.shape[1]
            ready[li].wait()
            if khat[li] is None:
                return  # the keys chain failed: its exception is raised below
            res, pv = v.copy(), []
            for bi in range(v.shape[0]):
                x = khat[li][bi] if li == 0 else np.concatenate([khat[li][bi], vhat[bi]], axis=1)
                pv.append(P.predict(x, *pred.values[li], parallel=False))
                res[bi][:, a:b] = P.unflat(P.flat(v[bi][:, a:b]) - pv[bi], h)
            rec = _code_layer(kv, codec, by_layer[li], 1, res, step, out)
            vhat = [P.flat(rec[bi][:, a:b]) + pv[bi] for bi in range(v.shape[0])]

    # two chains on two threads (the kernels release the GIL): keys run ahead, values follow layer by layer
    with ThreadPoolExecutor(2) as ex:
        fk = ex.submit(keys_chain)
        fv = ex.submit(values_chain)
        try:
            fk.result()
        finally:
            for e in ready:
                e.set()  # never leave the values chain waiting
        fv.result()
    return [out[id(j)] for j in jobs]


def _code_layer(kv: KVCache, codec: VqRans, jobs, part: int, x: np.ndarray, step: float, out: dict) -> np.ndarray:
    """Code the slices of one layer's ``part`` from ``x`` (float32 ``[B, H, T, D]``, in the cache's dtype's
    values), store their payloads in ``out`` by job, and return the decoder's float32 reconstruction."""
    dt = kv.keys[0].dtype
    full = torch.from_numpy(x).to(dt)
    rec = np.empty_like(x)
    for j in jobs:
        if j[1] != part:
            continue
        where = j[3]
        sl = full[:, :, where.start:where.start + where.shape[2]]
        got = {}
        out[id(j)] = codec.encode(sl, where, step=step, recon=got)
        # the decoder's values without entropy-decoding the payload: the quantized tokens' binary32 reconstruction
        # rounded to the cache's dtype (as VqRans.decode rounds it), the exact tokens as they are
        head, tail = codec.exact_split(where)
        n = where.shape[2]
        part_rec = sl.float().numpy().copy()
        part_rec[:, :, head:n - tail] = torch.from_numpy(got["values"]).to(dt).float().numpy()
        rec[:, :, where.start:where.start + n] = part_rec
    return rec


class _PredictedDecoder:
    """Decoder of predicted slices: every section decoded as the direct tiers do (residuals), then layer after
    layer the prediction added back and the keys rotated (``kvcodec.predict``'s arithmetic)."""

    def __init__(self, f, direct):
        self.f = f
        self.direct = direct  # the direct tiers' decoder: every section's residual
        self.pred = None
        self.done, self.prev, self.checked = -1, None, -1  # the last layer reconstructed, its (keys, values)
        self.rope = None  # the rotation's tables, computed once
        self.lock = threading.Lock()  # layer() from several threads: one reconstruction at a time

    def _predictors(self):
        """The file's predictors, checked before any tensor is decoded in the spec's order: their SHA-256 first
        (:class:`PredictorsRequired` names the one the file needs), then their file (:class:`FormatError`);
        the header and the index stay readable without them (inspect)."""
        import os

        from ..errors import FormatError, PredictorsRequired
        from ..predict import MAX_PREDICTORS_BYTES, as_predictors, from_bytes, identity

        if self.pred is None:
            want = self.f.header.predict["predictors"]
            given = getattr(self.f, "predictors", None)
            if given is None:
                raise PredictorsRequired(f"this file's tensors are residuals of a prediction: decode it with its "
                                         f"predictors (predictors=, or kvz --predictors FILE), the file whose SHA-256 "
                                         f"is {want}")
            if isinstance(given, (str, os.PathLike)):
                from ..file import open_path

                with open_path(given, "rb") as fh:
                    given = fh.read(MAX_PREDICTORS_BYTES + 1)
            if isinstance(given, (bytes, bytearray, memoryview)):
                got = identity(bytes(given))
                if got != want:
                    raise PredictorsRequired(f"the file needs the predictors {want}, these are {got}")
                pred = from_bytes(given)
            else:
                pred = as_predictors(given)
                if pred.identity != want:
                    raise PredictorsRequired(f"the file needs the predictors {want}, these are {pred.identity}")
            h = self.f.header
            width, pairs = h.layers[0].kv_heads * h.layers[0].k_dim, h.layers[0].k_dim // 2
            if len(pred.keys) != len(h.layers) or pred.keys[0][1].shape[0] != width or pred.cos_theta.size != pairs:
                raise FormatError(f"the predictors have {len(pred.keys)} layers of {pred.keys[0][1].shape[0]} "
                                  f"features and {pred.cos_theta.size} pairs; the file {len(h.layers)} of {width} "
                                  f"and {pairs}", field="predict.predictors")
            self.pred = pred
        return self.pred

    def tokens(self):
        return self.direct.tokens()

    def states(self, layers) -> dict:
        return self.direct.states(layers)

    def _check_exact(self, a: int, b: int, last: int) -> None:
        """Every payload of layers 0 .. ``last`` stores exactly the tokens outside ``[a, b)`` (the header's
        ``predict.exact_head`` / ``exact_tail``), no more, no fewer: its Mode 2 head and its Exact_Tokens."""
        from ..errors import FormatError

        h, r = self.f.header, self.f.reader
        for e in r.sections:
            if e.section_type != L.SECTION_KV or e.layer > last:
                continue
            lay = h.layers[e.layer]
            lo, hi = lay.chunk_range(e.chunk, h.chunk_tokens)
            got = describe(r.read_payload_prefix(e, 64), (h.batch, lay.kv_heads, hi - lo, lay.dim(e.part)),
                           8 * h.itemsize)
            want = (max(0, min(a, hi) - lo), max(0, hi - max(b, lo)))
            have = None if got is None else (got["head_tokens"], got["exact_tokens"])
            if have != want:
                raise FormatError(f"layer {e.layer} chunk {e.chunk}: exact tokens (head, tail) {have}, the predict "
                                  f"object says {want}", field="predict.exact_head", offset=e.payload_offset)

    def layers(self, layers, progress=None) -> dict:
        """The requested layers; a layer needs the reconstruction of every layer below it, so the last one
        reconstructed is kept: layer-by-layer readers (``KvzFile.layer(0)``, ``layer(1)`` ...) decode each
        layer once."""
        pred = self._predictors()
        layers = sorted(set(layers))
        if not layers:
            return {}
        with self.lock:
            return self._layers(pred, layers, progress)

    def _check_finite(self, li: int, row: int, khat, vhat, rot) -> None:
        """spec section 13.1: every binary32 value of steps 2 and 3 (the keys and values with their prediction,
        the rotated keys) is finite, else the file is invalid.  Infinities and NaN stay non-finite under + and x,
        so checking the final values finds every overflow, and no NaN (whose bits are the CPU's) is returned."""
        from ..errors import FormatError

        for what, x, part in (("key", khat, L.PART_KEYS), ("value", vhat, L.PART_VALUES),
                              ("rotated key", rot, L.PART_KEYS)):
            if not np.isfinite(x).all():
                e = self.f.reader.entry(L.SECTION_KV, li, part, 0)
                raise FormatError(f"layer {li}, batch row {row}: a predicted {what} is not finite in binary32 (the "
                                  "prediction or the rotation overflows: spec section 13.1)", field="predict",
                                  offset=e.payload_offset)

    def _layers(self, pred, layers, progress) -> dict:
        from .. import predict as P

        f = self.f
        h = f.header
        t = h.layers[0].seq_len
        a, b = h.predict["exact_head"], t - h.predict["exact_tail"]
        if layers[-1] > self.checked:
            self._check_exact(a, b, layers[-1])
            self.checked = layers[-1]
        first = self.done + 1 if self.done < layers[0] else 0  # continue from the kept layer, else restart
        prev = self.prev if first else None
        d = self.direct.layers(range(first, layers[-1] + 1), progress)
        dt = d[first, L.PART_KEYS].dtype
        if self.rope is None:
            with np.errstate(over="ignore", invalid="ignore"):  # tables that overflow: refused with the keys below
                self.rope = pred.tables(h.start_position + a, b - a)
        cos, sin = self.rope
        threads = getattr(f, "threads", None)
        out = {}
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused below, not warned about
            for li in range(first, layers[-1] + 1):
                k, v = d[li, L.PART_KEYS].float().numpy(), d[li, L.PART_VALUES].float().numpy()
                bsz, hh = k.shape[0], k.shape[1]
                ko, vo, cur = k.copy(), v.copy(), []
                for bi in range(bsz):
                    x = prev[bi][0] if li else np.zeros((b - a, 0), np.float32)
                    khat = P.flat(k[bi][:, a:b]) + P.predict(x, *pred.keys[li], threads=threads)
                    xv = khat if li == 0 else np.concatenate([khat, prev[bi][1]], axis=1)
                    vhat = P.flat(v[bi][:, a:b]) + P.predict(xv, *pred.values[li], threads=threads)
                    rot = P.rotate(P.unflat(khat, hh), cos, sin)
                    self._check_finite(li, bi, khat, vhat, rot)
                    ko[bi][:, a:b] = rot
                    vo[bi][:, a:b] = P.unflat(vhat, hh)
                    cur.append((khat, vhat))
                prev = cur
                if li in layers:
                    out[li, L.PART_KEYS] = torch.from_numpy(ko).to(dt)
                    out[li, L.PART_VALUES] = torch.from_numpy(vo).to(dt)
        self.done, self.prev = layers[-1], prev
        return out
