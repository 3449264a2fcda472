"""Shared machinery of the token coders: range coding under a sequence of distributions, chunk checksums."""

from __future__ import annotations

import math

import numpy as np
import torch
import xxhash

from ..errors import ChecksumMismatch, FormatError


def chunk_checksums(ids: np.ndarray, chunk_tokens: int) -> list[int]:
    """XXH3-64 of each chunk's ids as u32 little-endian."""
    return [xxhash.xxh3_64_intdigest(ids[a:a + chunk_tokens].astype("<u4").tobytes())
            for a in range(0, ids.size, chunk_tokens)]


class RangeTokenCoder:
    """Base of the token coders.

    A subclass provides :meth:`_distributions`, a generator that yields the
    (unnormalised, non-negative float64) distribution of token 0, then, each
    time it is sent token ``i``, the distribution of token ``i + 1``.  Encoder
    and decoder walk the same generator, so it must be deterministic.
    ``MISMATCH_HINT`` says what a checksum failure most likely means.
    """

    MISMATCH_HINT = "the stream is corrupt"

    def __init__(self, vocab: int, chunk_tokens: int):
        import constriction

        self.vocab = int(vocab)
        self.chunk_tokens = int(chunk_tokens)
        self._stream = constriction.stream
        self._family = constriction.stream.model.Categorical(perfect=False)

    def _distributions(self):
        raise NotImplementedError

    def encode(self, tokens):
        """Code a 1-D sequence of ids; returns a :class:`~kvcodec.tokens.lm.TokenStream`."""
        from .lm import TokenStream

        ids = np.asarray(torch.as_tensor(tokens).reshape(-1).cpu(), dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab):
            raise ValueError(f"token ids must be in [0, {self.vocab})")
        enc = self._stream.queue.RangeEncoder()
        dist = self._distributions()
        p = next(dist)
        bits = np.empty(ids.size)
        for i, t in enumerate(ids.tolist()):
            enc.encode(np.array([t], dtype=np.int32), self._family, p[None, :])
            bits[i] = -math.log2(max(float(p[t]) / float(p.sum()), 2.0 ** -24))
            if i + 1 < ids.size:
                p = dist.send(t)
        return TokenStream(enc.get_compressed().astype(np.uint32), int(ids.size), self.chunk_tokens,
                           chunk_checksums(ids, self.chunk_tokens), float(bits.sum()), bits)

    def decode(self, stream) -> torch.Tensor:
        """Decode ``stream.num_tokens`` ids; raises ChecksumMismatch at the first bad chunk."""
        n, chunk = stream.num_tokens, stream.chunk_tokens
        if chunk < 1 or len(stream.chunk_checksums) != -(-n // chunk):
            raise FormatError(f"{len(stream.chunk_checksums)} chunk checksums for {n} tokens in chunks of {chunk}",
                              field="Chunk_Checksums")
        dec = self._stream.queue.RangeDecoder(np.ascontiguousarray(stream.words, dtype=np.uint32))
        dist = self._distributions()
        p = next(dist)
        out = np.empty(n, dtype=np.int64)
        for i in range(n):
            try:
                t = int(dec.decode(self._family, p[None, :])[0])
            except (AssertionError, ValueError, RuntimeError) as e:  # constriction: invalid compressed data
                raise FormatError(f"token {i}: the range coder rejects the stream ({e})",
                                  field="Token_Stream.Words") from None
            out[i] = t
            if (i + 1) % chunk == 0 or i + 1 == n:
                k, a = i // chunk, (i // chunk) * chunk
                if chunk_checksums(out[a:i + 1], chunk)[0] != stream.chunk_checksums[k]:
                    raise ChecksumMismatch(f"token chunk {k} (tokens {a}..{i}) decodes to ids whose checksum "
                                           f"differs: {self.MISMATCH_HINT}", field="Chunk_Checksums")
            if i + 1 < n:
                p = dist.send(t)
        return torch.from_numpy(out)
