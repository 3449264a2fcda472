"""Building blocks of the token channel (issue 3): token recovery and token coding.

A KV cache is a deterministic function of its tokens, so the tokens - a few
bits each under the model - are the cache's real information content.  This
package holds the two pieces the token tiers are built from:

* :mod:`.recover` - read the tokens back out of a cache (layer-0 values depend
  only on the token in models without absolute position embeddings), with
  verification;
* :mod:`.lm` - arithmetic-code token ids with the model's own next-token
  distribution (constriction's range coder), computed by one recorded,
  deterministic procedure, with a checksum per token chunk;
* :mod:`.static` - the same without a neural network (adaptive Witten-Bell
  order-2 model), so a restore costs one parallel prefill;
* :mod:`.schedule` - :class:`RecordingCache`, which records how a cache was
  filled (the chunk boundaries a bit-exact regeneration must replay).

* :mod:`.regen` - regeneration by replaying a schedule (padding, position-id
  conventions) and the schedule-following LM coder of the ``exact`` / ``tokens``
  tiers (:mod:`kvcodec.tokentier`).
"""

from .lm import LMTokenCoder, TokenStream
from .recover import RecoveredTokens, layer0_value_table, recover_tokens
from .schedule import RecordingCache

__all__ = ["LMTokenCoder", "TokenStream", "RecoveredTokens", "layer0_value_table", "recover_tokens",
           "RecordingCache"]
