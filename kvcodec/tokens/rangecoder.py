"""The range-coding base of every token coder: constriction's range coder under a sequence of distributions,
per-chunk checksums of the ids, and the ``token_stream`` payload (``spec/kvz.md``).

A coder supplies the distribution of each token; this module codes a token
under it (:func:`encode_symbol`, which also accounts its cost in bits), decodes
one back (:func:`decode_symbol`, turning constriction's rejection of garbage
into a :class:`~kvcodec.errors.FormatError`) and checks each finished chunk
(:func:`check_chunk`).  Probabilities go to constriction's
``Categorical(perfect=False)`` (24-bit fixed point; every symbol keeps a
probability >= 2**-24, so no token is ever uncodable).
"""

from __future__ import annotations

import math
import struct
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


def categorical():
    """constriction's module and the model family every coder uses (``perfect=False`` explicitly: the default
    changed between constriction releases, and the bytes depend on it)."""
    import constriction

    return constriction.stream, constriction.stream.model.Categorical(perfect=False)


def encode_symbol(enc, family, p: np.ndarray, t: int) -> float:
    """Code token ``t`` under the (unnormalised, non-negative float64) distribution ``p``; its cost in bits."""
    enc.encode(np.array([t], dtype=np.int32), family, p[None, :])
    return -math.log2(max(float(p[t]) / float(p.sum()), 2.0 ** -24))


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
        self.vocab = int(vocab)
        self.chunk_tokens = int(chunk_tokens)
        self._stream, self._family = categorical()

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
            bits[i] = encode_symbol(enc, self._family, p, t)
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


# --- the token_stream payload (spec/kvz.md) -----------------------------------------------
_STREAM_HEAD = struct.Struct("<II")  # Num_Tokens, Num_Chunks


def pack_stream(s: TokenStream) -> bytes:
    """The ``token_stream`` section payload of one batch row."""
    return (_STREAM_HEAD.pack(s.num_tokens, len(s.chunk_checksums))
            + np.asarray(s.chunk_checksums, dtype="<u8").tobytes() + s.words.astype("<u4").tobytes())


def unpack_stream(payload: bytes, *, expect_tokens: int, chunk: int, offset: int) -> TokenStream:
    """Parse a ``token_stream`` payload whose row must hold ``expect_tokens`` tokens in chunks of ``chunk``."""
    if len(payload) < _STREAM_HEAD.size:
        raise FormatError("token_stream payload shorter than its fixed fields", field="Token_Stream.Num_Tokens",
                          offset=offset)
    n, nc = _STREAM_HEAD.unpack_from(payload, 0)
    if n != expect_tokens:
        raise FormatError(f"Num_Tokens {n}, the header implies {expect_tokens}", field="Token_Stream.Num_Tokens",
                          offset=offset)
    if nc != -(-n // chunk):
        raise FormatError(f"Num_Chunks {nc} for {n} tokens in chunks of {chunk}", field="Token_Stream.Num_Chunks",
                          offset=offset + 4)
    rest = len(payload) - _STREAM_HEAD.size - 8 * nc
    if rest < 0 or rest % 4:
        raise FormatError(f"token_stream payload of {len(payload)} bytes does not hold {nc} checksums and whole "
                          "u32 words", field="Token_Stream.Words", offset=offset + 8)
    sums = np.frombuffer(payload, dtype="<u8", count=nc, offset=8).tolist()
    words = np.frombuffer(payload, dtype="<u4", offset=8 + 8 * nc).astype(np.uint32)
    return TokenStream(words, n, chunk, sums)
