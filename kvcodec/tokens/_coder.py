"""Shared machinery of the token coders: range coding under a sequence of distributions, chunk checksums."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import xxhash

from ..errors import ChecksumMismatch, FormatError


def chunk_checksums(ids: np.ndarray, chunk_tokens: int) -> list[int]:
    """XXH3-64 of each chunk's ids as u32 little-endian."""
    return [xxhash.xxh3_64_intdigest(ids[a:a + chunk_tokens].astype("<u4").tobytes())
            for a in range(0, ids.size, chunk_tokens)]


@dataclass
class TokenStream:
    """One sequence's (one batch row's) coded tokens."""

    words: np.ndarray  # uint32 words of constriction's range coder
    num_tokens: int
    chunk_tokens: int
    chunk_checksums: list[int] = field(default_factory=list)  # XXH3-64 of each chunk's ids (u32 LE)
    cross_entropy_bits: float = 0.0  # sum of -log2 p(t_i) under the coded distributions (encoder side)
    token_bits: np.ndarray | None = None  # -log2 p(t_i) of each token (encoder side)

    @property
    def nbytes(self) -> int:
        return 4 * int(self.words.size)


def decode_symbol(dec, family, p: np.ndarray, where: str) -> int:
    """One token from a constriction decoder; a stream it rejects is a FormatError, not an AssertionError."""
    try:
        return int(dec.decode(family, p[None, :])[0])
    except (AssertionError, ValueError, RuntimeError) as e:  # constriction: invalid compressed data
        raise FormatError(f"{where}: the range coder rejects the stream ({e})", field="Token_Stream.Words") from None


def check_chunk(stream: TokenStream, k: int, chunk_ids, hint: str, field: str, where: str = "") -> None:
    """After the stream's coded token ``k``: if it closes a chunk, compare the chunk's checksum.
    ``chunk_ids(a)`` returns the decoded ids ``a .. k``."""
    chunk = stream.chunk_tokens
    if (k + 1) % chunk and k + 1 != stream.num_tokens:
        return
    c = k // chunk
    if chunk_checksums(chunk_ids(c * chunk), chunk)[0] != stream.chunk_checksums[c]:
        raise ChecksumMismatch(f"{where}token chunk {c} (tokens {c * chunk}..{k}) decodes to ids whose checksum "
                               f"differs: {hint}", field=field)


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
        """Code a 1-D sequence of ids; returns a :class:`TokenStream`."""
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
            out[i] = t = decode_symbol(dec, self._family, p, f"token {i}")
            check_chunk(stream, i, lambda a, i=i: out[a:i + 1], self.MISMATCH_HINT, "Chunk_Checksums")
            if i + 1 < n:
                p = dist.send(t)
        return torch.from_numpy(out)
