"""Tier ``lossless``: the tensors themselves, bit-exact, coded with ``float_ctx_rans``; no model needed to decode.

Options are the codec's (``scale_bits``, ``ways``, ``max_tables``,
``context``, ``coded_bits``: :mod:`kvcodec.codecs.float_ctx_rans`).  Format 1.0.

The tier's default ``scale_bits`` is 10, not the codec's 12 (which the lossy and token tiers' side
streams keep): on SmolLM2 caches it codes as small (bf16 1.5766x at both, fp32 1.2236x vs 1.2237x: the
coarser frequencies cost what their smaller tables save) and its decode tables are a quarter the size,
which is what keeps the decoder's hot loop in L1 (BENCHMARKS.md, "Decode speed").
"""

from __future__ import annotations

from ..codecs.float_ctx_rans import DEFAULTS, FloatCtxRans
from ..registry import register_tier
from .base import DirectTier, EncodeJob


@register_tier
class LosslessTier(DirectTier):
    tier_id = "lossless"
    summary = "the tensors, bit-exact; no model needed to decode"
    codec_ids = (FloatCtxRans.codec_id,)
    min_minor = 0
    option_names = frozenset(DEFAULTS)
    #: the tier's defaults over the codec's
    defaults = {"scale_bits": 10}

    def codec(self, job: EncodeJob) -> FloatCtxRans:
        opts = dict(job.options.codec)
        if (opts.get("coded_bits") or 0) <= 10:  # 2**10 slots hold any table of <= 10-bit symbols
            opts = {**self.defaults, **opts}
        return FloatCtxRans.configure(opts, job.kv.dtype_name)
