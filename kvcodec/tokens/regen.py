"""Regenerating a cache from its tokens: schedule replay, padding, and the schedule-following LM coder.

A cache is regenerated bit for bit only by the same sequence of forward calls
(same chunk boundaries, same batch, same attention mask and position ids) on
the same engine.  A :class:`Plan` holds everything that decides those calls:

* ``schedule``: the number of new tokens of each forward call (sums to N);
* ``padding``: left-padding length of each batch row (0 for an unpadded batch);
* ``positions``: how position ids of a padded batch were made - ``"mask"`` as
  ``generate()`` does (``cumsum(mask) - 1``, padding at 0) or ``"arange"`` as a
  plain forward call does (0..N-1 whatever the mask);
* ``pad_token``: the id at padded positions.

:class:`ScheduleLMCoder` codes tokens with the model's own distribution *while*
replaying the plan, so the decoder's one sequential pass both decodes the
tokens and regenerates the cache: a call of one token gives the distribution
of the next token as a by-product; inside a call of several tokens (a
prefill) the decoder does not know the tokens yet, so their distributions
come from an incremental "scratch" pass over a copy of the cache, which is
then dropped and the real call is made.  Restoring therefore costs one
incremental pass plus the prefills, and the encoder computes the
probabilities by exactly the same procedure.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import FormatError
from ..runtime import cache_kwarg
from ._coder import TokenStream, check_chunk, chunk_checksums, decode_symbol
from .lm import lm_procedure


@dataclass
class Plan:
    schedule: list[int]
    padding: list[int] = field(default_factory=list)
    positions: str = "mask"
    pad_token: int = 0
    #: per layer: the sliding window of the cache layer to fill (None = full attention), as in the original
    #: cache (a cache built without the model's config holds full layers even for sliding-window attention)
    windows: list | None = None

    @property
    def num_tokens(self) -> int:
        return sum(self.schedule)

    def padded(self) -> bool:
        return any(self.padding)


def _call_kwargs(plan: Plan, a: int, b: int, device) -> dict:
    """attention_mask / position_ids of the forward call over positions [a, b)."""
    if not plan.padded():
        return {}
    pad = torch.tensor(plan.padding, device=device)[:, None]
    mask = (torch.arange(b, device=device)[None, :] >= pad).long()
    if plan.positions == "mask":
        pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)[:, a:b]
    else:
        pos = torch.arange(a, b, device=device)[None, :].expand(len(plan.padding), -1)
    return {"attention_mask": mask, "position_ids": pos}


def new_cache(model, plan: Plan):
    """An empty DynamicCache whose layers are of the kinds ``plan.windows`` names."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    if plan.windows is None:
        return DynamicCache(config=model.config)
    cache = DynamicCache()
    cache.layers = [DynamicSlidingWindowLayer(sliding_window=w) if w else DynamicLayer() for w in plan.windows]
    return cache


def _forward(model, ids, cache, kw):
    out = model(ids, use_cache=True, **{cache_kwarg(model): cache}, **kw)
    return out.logits


@torch.no_grad()
def replay(model, tokens: torch.Tensor, plan: Plan):
    """Run ``plan``'s forward calls over ``tokens [B, N]``; returns the DynamicCache."""
    dev = next(model.parameters()).device
    tokens = tokens.to(dev)
    cache = new_cache(model, plan)
    pos = 0
    for n in plan.schedule:
        _forward(model, tokens[:, pos:pos + n], cache, _call_kwargs(plan, pos, pos + n, dev))
        pos += n
    return cache


def _probs(logits: torch.Tensor) -> np.ndarray:
    """float64 softmax of the float32 logits of each row: the coded distributions."""
    return torch.softmax(logits.float().double(), dim=-1).cpu().numpy()


class ScheduleLMCoder:
    """Code the tokens of a batch with ``model`` while replaying ``plan`` (module docstring)."""

    MISMATCH_HINT = ("this decoder computes different probabilities than the encoder did (another model, dtype, "
                     "device, library version or thread count; see the file's tokens.procedure), or the stream is "
                     "corrupt")

    def __init__(self, model, chunk_tokens: int = 256):
        import constriction

        self.model = model.eval()
        self.vocab = int(model.get_output_embeddings().weight.shape[0])
        self.chunk_tokens = int(chunk_tokens)
        self._cs = constriction.stream
        self._family = constriction.stream.model.Categorical(perfect=False)

    def procedure(self) -> dict:
        return lm_procedure(self.model, "lm-schedule-v1")

    @torch.no_grad()
    def _run(self, plan: Plan, step, tokens: torch.Tensor):
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
                if i + 1 < b:  # inside a multi-token call: scratch pass for the next token's distribution
                    if scratch is None:
                        scratch = copy.deepcopy(cache)
                    logits = _forward(self.model, tokens[:, i:i + 1].to(dev), scratch,
                                      _call_kwargs(plan, i, i + 1, dev))
                    probs = _probs(logits[:, -1])
            del scratch
            logits = _forward(self.model, tokens[:, a:b].to(dev), cache, _call_kwargs(plan, a, b, dev))
            probs = _probs(logits[:, -1]) if b < plan.num_tokens else None
            pos = b
        return cache

    def encode(self, tokens: torch.Tensor, plan: Plan):
        """Returns (one :class:`TokenStream` per row, the regenerated DynamicCache)."""
        tokens = torch.as_tensor(tokens).to("cpu", torch.int64)
        bsz, n = tokens.shape
        pads = plan.padding or [0] * bsz
        encs = [self._cs.queue.RangeEncoder() for _ in range(bsz)]
        bits = [[] for _ in range(bsz)]
        uniform = np.full(self.vocab, 1.0 / self.vocab)
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab):
            raise ValueError(f"token ids must be in [0, {self.vocab})")
        work = tokens.clone()

        def step(i, probs):
            for r in range(bsz):
                if i < pads[r]:
                    continue
                p = uniform if i == pads[r] or probs is None else probs[r]
                t = int(tokens[r, i])
                encs[r].encode(np.array([t], dtype=np.int32), self._family, p[None, :])
                bits[r].append(-math.log2(max(float(p[t]) / float(p.sum()), 2.0 ** -24)))
            return tokens[:, i]

        cache = self._run(plan, step, work)
        streams = []
        for r in range(bsz):
            ids = tokens[r, pads[r]:].numpy()
            tb = np.array(bits[r])
            streams.append(TokenStream(encs[r].get_compressed().astype(np.uint32), int(ids.size), self.chunk_tokens,
                                       chunk_checksums(ids, self.chunk_tokens), float(tb.sum()), tb))
        return streams, cache

    def decode(self, streams: list[TokenStream], plan: Plan):
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

        cache = self._run(plan, step, tokens)
        return tokens, cache
