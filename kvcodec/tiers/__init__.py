"""The tiers: ways of storing a cache, one module each, registered by id (``kvcodec.registry``).

* :mod:`.lossless` - the tensors, bit-exact (no model to decode);
* :mod:`.lossy` - per-vector quantization (no model to decode);
* :mod:`.exact` - the tokens plus a residual, restored bit-identically by recompute;
* :mod:`.tokens` - the tokens, restored by recompute within a tolerance.

The contract every tier implements is :class:`.base.Tier`.
"""

from . import exact, lossless, lossy, tokens  # noqa: F401  (registers the tiers)
from .base import DirectTier, EncodeJob, Fallback, Options, Tier

__all__ = ["Tier", "DirectTier", "Options", "EncodeJob", "Fallback"]
