"""Arithmetic coding of token ids with a model's own next-token distribution.

The decoder can only compute token i's distribution after decoding token i-1,
and the range coder needs *bit-identical* probabilities on both sides, so the
encoder computes them by the very procedure the decoder will run.  One coder,
:class:`LMTokenCoder`, implements the two procedures of ``spec/kvz.md``:

* ``lm-schedule-v1`` (:meth:`~LMTokenCoder.encode_replay`, the model of the
  ``exact`` / ``tokens`` tiers): the tokens of a batch are coded *while*
  replaying the cache's :class:`~kvcodec.tokens.plan.Plan`, so the decoder's
  one pass both decodes the tokens and regenerates the cache.  A call of one
  token gives the next token's distribution as a by-product; inside a call of
  several tokens (a prefill) the decoder does not know the tokens yet, so
  their distributions come from an incremental "scratch" pass over a copy of
  the cache, which is then dropped and the real call is made.
* ``lm-incremental-v1`` (:meth:`~LMTokenCoder.encode`, a draft model): one
  sequence, one token per forward call - the same walk over the plan "N single
  steps" of plain cache layers.

Probabilities: ``softmax`` of the float32 logits computed in float64; the
first token of a row has no context and is coded uniformly.  The recorded
procedure (:meth:`~LMTokenCoder.procedure`) names what a decoder must match
(dtype, device, threads; library versions are informative); the decoder checks
a checksum per chunk of tokens, so one whose numerics differ stops at the first
bad chunk with a clear error instead of emitting wrong tokens.
"""

from __future__ import annotations

import copy
import importlib.metadata as md

import numpy as np
import torch

from ..errors import FormatError
from .plan import Plan, call_kwargs, forward, new_cache
from .rangecoder import TokenStream, categorical, check_chunk, chunk_checksums, decode_symbol, encode_symbol

__all__ = ["CHUNK_TOKENS", "SCHEDULE", "INCREMENTAL", "LMTokenCoder", "TokenStream", "next_token_probs"]

CHUNK_TOKENS = 256  #: tokens per Chunk_Checksums entry
SCHEDULE = "lm-schedule-v1"
INCREMENTAL = "lm-incremental-v1"


def next_token_probs(logits: torch.Tensor) -> np.ndarray:
    """float64 softmax of the float32 logits of each row: the coded distributions."""
    return torch.softmax(logits.float().double(), dim=-1).cpu().numpy()


class LMTokenCoder:
    """Code token ids with ``model``'s next-token distribution (module docstring).

    Examples
    --------
    >>> # stream = LMTokenCoder(model).encode(ids); ids2 = LMTokenCoder(model).decode(stream)
    >>> # streams, cache = LMTokenCoder(model).encode_replay(tokens, plan)
    """

    MISMATCH_HINT = ("this decoder computes different probabilities than the encoder did (another model, dtype, "
                     "device, library version or thread count; see the file's tokens.procedure), or the stream is "
                     "corrupt")

    def __init__(self, model, chunk_tokens: int = CHUNK_TOKENS):
        self.model = model.eval()
        self.vocab = int(model.get_output_embeddings().weight.shape[0])
        self.chunk_tokens = int(chunk_tokens)
        self._cs, self._family = categorical()

    def procedure(self, procedure_id: str = SCHEDULE) -> dict:
        """The recorded procedure: the id names the procedure of spec/kvz.md; dtype, device, threads and library
        versions are what a decoder must match to get the same probabilities."""
        p = next(self.model.parameters())
        return {"id": procedure_id, "dtype": str(p.dtype).replace("torch.", ""), "device": p.device.type,
                "threads": torch.get_num_threads(),
                "versions": {"torch": torch.__version__, "transformers": md.version("transformers"),
                             "constriction": md.version("constriction")}}

    # -- lm-incremental-v1: one row, one token per call --------------------------------------------------
    def encode(self, ids) -> TokenStream:
        """Code a 1-D sequence of ids by the incremental procedure."""
        ids = torch.as_tensor(ids).reshape(1, -1).to("cpu", torch.int64)
        streams, _ = self.encode_replay(ids, Plan([1] * ids.shape[1], windows=[]))
        return streams[0]

    def decode(self, stream: TokenStream) -> torch.Tensor:
        """Decode ``stream.num_tokens`` ids coded by :meth:`encode`; ChecksumMismatch at the first bad chunk."""
        tokens, _ = self.decode_replay([stream], Plan([1] * stream.num_tokens, windows=[]))
        return tokens[0]

    # -- lm-schedule-v1: a batch, coded while its plan is replayed ---------------------------------------
    @torch.no_grad()
    def _run(self, plan: Plan, step, tokens: torch.Tensor, progress=None):
        """Walk the plan.  ``step(i, probs)`` returns the tokens ``[B]`` of position i given the ``[B, V]``
        distributions (None where there is no context yet); ``tokens`` is filled in place."""
        dev = next(self.model.parameters()).device
        cache = new_cache(self.model, plan)
        probs = None
        pos = 0
        for n in plan.schedule:
            a, b = pos, pos + n
            scratch = None
            for i in range(a, b):
                tokens[:, i] = step(i, probs)
                if progress:
                    progress(1)  # one position coded / decoded
                if i + 1 < b:  # inside a multi-token call: scratch pass for the next token's distribution
                    if scratch is None:
                        scratch = copy.deepcopy(cache)
                    logits = forward(self.model, tokens[:, i:i + 1].to(dev), scratch, call_kwargs(plan, i, i + 1, dev))
                    probs = next_token_probs(logits[:, -1])
            del scratch
            logits = forward(self.model, tokens[:, a:b].to(dev), cache, call_kwargs(plan, a, b, dev))
            probs = next_token_probs(logits[:, -1]) if b < plan.num_tokens else None
            pos = b
        return cache

    def encode_replay(self, tokens: torch.Tensor, plan: Plan, progress=None):
        """Returns (one :class:`TokenStream` per row, the regenerated DynamicCache)."""
        tokens = torch.as_tensor(tokens).to("cpu", torch.int64)
        bsz, n = tokens.shape
        pads = plan.padding or [0] * bsz
        encs = [self._cs.queue.RangeEncoder() for _ in range(bsz)]
        bits = [[] for _ in range(bsz)]
        uniform = np.full(self.vocab, 1.0 / self.vocab)
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab):
            raise ValueError(f"token ids must be in [0, {self.vocab})")

        def step(i, probs):
            for r in range(bsz):
                if i >= pads[r]:
                    p = uniform if i == pads[r] or probs is None else probs[r]
                    bits[r].append(encode_symbol(encs[r], self._family, p, int(tokens[r, i])))
            return tokens[:, i]

        cache = self._run(plan, step, tokens.clone(), progress)
        streams = []
        for r in range(bsz):
            ids = tokens[r, pads[r]:].numpy()
            tb = np.array(bits[r])
            streams.append(TokenStream(encs[r].get_compressed().astype(np.uint32), int(ids.size), self.chunk_tokens,
                                       chunk_checksums(ids, self.chunk_tokens), float(tb.sum()), tb))
        return streams, cache

    def decode_replay(self, streams: list[TokenStream], plan: Plan, progress=None):
        """Returns (tokens ``[B, N]``, the regenerated DynamicCache); ChecksumMismatch at the first bad chunk."""
        bsz, n = len(streams), plan.num_tokens
        pads = plan.padding or [0] * bsz
        chunk = self.chunk_tokens
        for r, s in enumerate(streams):
            if s.num_tokens != n - pads[r] or len(s.chunk_checksums) != -(-s.num_tokens // chunk):
                raise FormatError(f"row {r}: {s.num_tokens} tokens and {len(s.chunk_checksums)} chunk checksums do "
                                  f"not fit {n} positions with {pads[r]} padding in chunks of {chunk}",
                                  field="Token_Stream.Num_Tokens")
        decs = [self._cs.queue.RangeDecoder(np.ascontiguousarray(s.words, dtype=np.uint32)) for s in streams]
        uniform = np.full(self.vocab, 1.0 / self.vocab)
        tokens = torch.full((bsz, n), int(plan.pad_token), dtype=torch.int64)

        def step(i, probs):
            out = tokens[:, i].clone()
            for r in range(bsz):
                if i < pads[r]:
                    continue
                p = uniform if i == pads[r] or probs is None else probs[r]
                out[r] = t = decode_symbol(decs[r], self._family, p, f"batch row {r}, token {i}")
                check_chunk(streams[r], i - pads[r],  # index among the row's coded tokens
                            lambda a, r=r, t=t: np.concatenate([tokens[r, pads[r] + a:i].numpy(), [t]]),
                            self.MISMATCH_HINT, "Token_Stream.Chunk_Checksums", f"batch row {r}, ")
            return out

        cache = self._run(plan, step, tokens, progress)
        return tokens, cache
