"""The byte-level codecs of section payloads, one module per codec id (``spec/registry.md``).

Each registers a :class:`~kvcodec.codecs.base.Codec` subclass:

* :mod:`.float_ctx_rans` - bit-exact float coding (tier ``lossless``);
* :mod:`.vq_rans` - rotation + quantization, rANS-coded (tier ``lossy``);
* :mod:`.int_residual_rans` - the residual of a regenerated cache (tiers ``exact`` / ``tokens``).
"""

from . import float_ctx_rans, int_residual_rans, vq_rans  # noqa: F401  (registers the codecs)
from .base import Codec, Slice

__all__ = ["Codec", "Slice"]
