"""Tier ``lossless``: the tensors themselves, bit-exact, coded with ``float_ctx_rans``; no model needed to decode.

Options are the codec's (``scale_bits``, ``ways``, ``max_tables``,
``context``, ``coded_bits``: :mod:`kvcodec.codecs.float_ctx_rans`).  Format 1.0.
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

    def codec(self, job: EncodeJob) -> FloatCtxRans:
        return FloatCtxRans.configure(job.options.codec, job.kv.dtype_name)
