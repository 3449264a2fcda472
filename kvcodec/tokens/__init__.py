"""The token channel: a KV cache is a deterministic function of its tokens, so the tokens - a few bits each
under the model - are the cache's real information content.

* :mod:`.recover` - read the tokens back out of a cache (layer-0 values depend
  only on the token in models without absolute position embeddings), with
  verification;
* :mod:`.schedule` - :class:`RecordingCache`, which records how a cache was
  filled (the chunk boundaries a bit-exact regeneration must replay);
* :mod:`.plan` - the plan of forward calls (schedule, padding, position ids)
  and its replay, and inference of the plan of a given cache;
* :mod:`.rangecoder` - the range-coding base (constriction), chunk checksums,
  the ``token_stream`` payload;
* :mod:`.lm` - the token coder that uses the model's own next-token
  distribution, while replaying a plan or incrementally (a draft model);
* :mod:`.static` - the same without a neural network (adaptive Witten-Bell
  order-2 model), so a restore costs one parallel prefill.

The tiers built from these pieces are :mod:`kvcodec.tiers.exact` and
:mod:`kvcodec.tiers.tokens`.
"""

from .lm import LMTokenCoder
from .plan import Plan, replay
from .rangecoder import TokenStream
from .recover import RecoveredTokens, layer0_value_table, recover_tokens
from .schedule import RecordingCache
from .static import StaticTokenCoder

__all__ = ["LMTokenCoder", "StaticTokenCoder", "TokenStream", "Plan", "replay", "RecoveredTokens",
           "layer0_value_table", "recover_tokens", "RecordingCache"]
