"""Token ids coded with a model's next-token distribution *given a context*: ``lm-continuation-v1``.

The store's cold chunks (``spec/store.md`` §4.2) keep only their token ids, coded with the namespace's model
conditioned on the tokens before them, so a tail costs its surprisal (a few bits per token) and a shared
prefix is never paid twice.  The procedure, which encoder and decoder both run:

1. the context - the ``CONTEXT_TOKENS`` (1,024) ids before the coded ones, or all of them when fewer - goes
   through the model in **one** forward call on a fresh cache (position 0 is the context's first token); the
   last logits give the first coded token's distribution (uniform over the vocabulary when the context is
   empty);
2. each coded token is then fed in a **one-token** call (on ``STEP_THREADS`` intra-op threads), whose logits
   give the next one's distribution.

Distributions are those of ``spec/kvz.md`` §11.2.1 (float64 softmax of the float32 logits, constriction's
categorical model, ``perfect=False``), so this is the ``lm`` procedure with a context instead of a replayed
plan.  Its numbers depend on the engine exactly as ``lm-schedule-v1``'s do (kvz.md §11.4): the store records
the encoder's numerics profile once per namespace and a decoder refuses a profile that differs.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import FormatError
from .lm import next_token_probs
from .plan import STEP_THREADS, forward, step_threads
from .rangecoder import categorical, decode_symbol, encode_symbol

__all__ = ["PROCEDURE", "CONTEXT_TOKENS", "encode_continuation", "decode_continuation"]

PROCEDURE = "lm-continuation-v1"
CONTEXT_TOKENS = 1024  #: at most this many ids before the coded ones condition them


def _vocab(model) -> int:
    return int(model.get_output_embeddings().weight.shape[0])


def _distributions(model, context: np.ndarray):
    """Yield token 0's distribution, then - sent each coded token - the next one's (module docstring)."""
    from transformers.cache_utils import DynamicCache

    dev = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    ctx = np.asarray(context, dtype=np.int64)[-CONTEXT_TOKENS:]
    v = _vocab(model)
    if ctx.size and (ctx.min() < 0 or ctx.max() >= v):
        raise FormatError(f"a context token id is outside the model's vocabulary [0, {v})", field="Cold.context")
    if ctx.size:
        p = next_token_probs(forward(model, torch.from_numpy(ctx)[None].to(dev), cache, {})[:, -1])[0]
    else:
        p = np.full(_vocab(model), 1.0 / _vocab(model))
    while True:
        t = yield p
        p = next_token_probs(forward(model, torch.tensor([[int(t)]], device=dev), cache, {})[:, -1])[0]


@torch.no_grad()
def encode_continuation(model, context, ids) -> tuple[np.ndarray, float]:
    """(range-coder words ``uint32``, ideal bits) of ``ids`` coded after ``context`` (1-D id sequences)."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    v = _vocab(model)
    if ids.size and (ids.min() < 0 or ids.max() >= v):
        raise FormatError(f"token ids must be in [0, {v}) to be coded with this model", field="Cold.ids")
    cs, family = categorical()
    enc = cs.queue.RangeEncoder()
    bits = 0.0
    with step_threads(STEP_THREADS):
        dist = _distributions(model, context)
        p = next(dist)
        for i, t in enumerate(ids.tolist()):
            bits += encode_symbol(enc, family, p, t)
            if i + 1 < ids.size:
                p = dist.send(t)
        dist.close()
    return enc.get_compressed().astype(np.uint32), bits


#: bits of the coded distributions a decoder may still spend once it has read every word: the coder's state
#: holds 64 (kvz.md 11.2.2); the rest is slack for the float estimate of each cost
EXHAUSTED_BITS = 128.0


@torch.no_grad()
def decode_continuation(model, context, words: np.ndarray, n: int) -> np.ndarray:
    """``n`` ids decoded from ``words`` after ``context``.  Wrong numerics give wrong ids, not an error: the
    caller checks them (the store against the chunk keys).  A stream that declares more ids than its words can
    hold - more than ``EXHAUSTED_BITS`` of information decoded after its last word - is refused
    (:class:`FormatError`), so a hostile ``n`` costs work in proportion to the object's size; the output grows
    as ids are decoded (nothing of size ``n`` is allocated up front)."""
    import math

    cs, family = categorical()
    if n and not np.asarray(words).size:
        raise FormatError(f"{n} coded tokens in an empty stream", field="Cold.Words")
    dec = cs.queue.RangeDecoder(np.ascontiguousarray(words, dtype=np.uint32))
    out: list[int] = []
    spent = 0.0
    with step_threads(STEP_THREADS):
        dist = _distributions(model, context)
        p = next(dist)
        for i in range(n):
            try:
                t = decode_symbol(dec, family, p, f"cold chunk token {i}")
            except FormatError as e:
                raise FormatError(str(e).split(" (field")[0], field="Cold.Words") from None
            out.append(t)
            if dec.maybe_exhausted():
                spent -= math.log2(max(float(p[t]) / float(p.sum()), 2.0 ** -24))
                if spent > EXHAUSTED_BITS:
                    raise FormatError(f"the stream declares {n} token ids; its words ran out after {i + 1}",
                                      field="Cold.Words")
            if i + 1 < n:
                p = dist.send(t)
        dist.close()
    return np.asarray(out, dtype=np.int64)
