"""Arithmetic coding of token ids with the model's own next-token distribution.

The decoder can only compute token i's distribution after decoding token i-1,
so it runs the model one token at a time.  A batched prefill gives slightly
different logits (measured on SmolLM2: ~1e-4), and the range coder needs
*bit-identical* probabilities on both sides, so the encoder computes them by
the very same procedure: an incremental pass, one token per forward call, with
a transformers ``DynamicCache``.  The procedure is described by
:meth:`LMTokenCoder.procedure` (to be recorded in the file); the decoder checks
a checksum per chunk of tokens, so a decoder whose numerics differ (another
CPU, another torch, another thread count) stops at the first bad chunk with a
clear error instead of emitting wrong tokens.

Probabilities: ``softmax`` of the float32 logits computed in float64, passed to
constriction's ``Categorical(perfect=False)`` (24-bit fixed point; every
symbol keeps a probability >= 2**-24, so no token is ever uncodable).  The
first token has no context and is coded uniformly over the vocabulary.
"""

from __future__ import annotations

import importlib.metadata as md
import numpy as np
import torch

from ..runtime import cache_kwarg
from ._coder import RangeTokenCoder, TokenStream  # noqa: F401  (TokenStream re-exported)

CHUNK_TOKENS = 256


def lm_procedure(model, procedure_id: str) -> dict:
    """The recorded procedure of an LM token coder: the id names the procedure of spec/kvz.md; dtype, device,
    threads and library versions are what a decoder must match to get the same probabilities."""
    p = next(model.parameters())
    return {"id": procedure_id, "dtype": str(p.dtype).replace("torch.", ""), "device": p.device.type,
            "threads": torch.get_num_threads(),
            "versions": {"torch": torch.__version__, "transformers": md.version("transformers"),
                         "constriction": md.version("constriction")}}


class LMTokenCoder(RangeTokenCoder):
    """Code token ids with ``model``'s next-token distribution (see the module docstring).

    Examples
    --------
    >>> # stream = LMTokenCoder(model).encode(ids); ids2 = LMTokenCoder(model).decode(stream)
    """

    MISMATCH_HINT = ("this decoder computes different probabilities than the encoder did (another model, dtype, "
                     "device, library version or thread count; see the recorded procedure), or the stream is corrupt")

    def __init__(self, model, chunk_tokens: int = CHUNK_TOKENS):
        super().__init__(int(model.get_output_embeddings().weight.shape[0]), chunk_tokens)
        self.model = model.eval()
        self._cache_kw = cache_kwarg(model)

    def procedure(self) -> dict:
        """What a decoder must reproduce to get the same probabilities (informative versions included)."""
        # spec/kvz.md: incremental, one token per call, softmax in float64, first token uniform,
        # constriction RangeEncoder + Categorical(perfect=False)
        return lm_procedure(self.model, "lm-incremental-v1")

    def _distributions(self):
        """Generator: send token i-1, receive the float64 distribution of token i."""
        from transformers.cache_utils import DynamicCache

        cache = DynamicCache()
        probs = np.full(self.vocab, 1.0 / self.vocab)
        while True:
            tok = yield probs
            with torch.no_grad():
                ids = torch.tensor([[int(tok)]], device=next(self.model.parameters()).device)
                out = self.model(ids, use_cache=True, **{self._cache_kw: cache})
                logits = out.logits[0, -1].float().double()
                probs = torch.softmax(logits, dim=0).cpu().numpy()
