"""The codec contract: one signature for every byte-level stage of a ``kv`` or ``residual`` section.

A codec turns one slice of a cache - the keys or the values of one layer over
a range of tokens, ``[batch, heads, tokens, dim]`` - into a section payload
and back.  Its wire parameters are the header's ``codec`` object,
``{"id": codec_id, "params": {...}}`` (JSON only); everything a decoder needs
beyond them is in the payload or in the :class:`Slice` (shape, dtype, where the
slice sits in the cache), so ``from_config(header["codec"]).decode(...)``
works on any file of that codec.  Encoder-only knobs (a tolerance, a kernel)
are constructor arguments that are not part of ``params``.

Subclasses register with :func:`kvcodec.registry.register_codec`; their module
is named after their ``codec_id`` and holds the payload's layout as in
``spec/kvz.md``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

__all__ = ["Slice", "Codec"]


@dataclass(frozen=True)
class Slice:
    """Where a slice sits in its cache (what a codec may depend on besides the payload)."""

    shape: tuple[int, int, int, int]  #: [batch, heads, tokens, dim]
    dtype: str  #: the cache's dtype name (``kvcodec.dtypes``)
    layer: int = 0
    part: int = 0  #: 0 keys, 1 values
    start: int = 0  #: index of the slice's first token in its layer
    layer_tokens: int = 0  #: tokens held by the whole layer
    num_layers: int = 1
    offset: int = 0  #: byte offset of the payload in the file (decoder error messages)
    minor: int = 99  #: the file's Version_Minor (what its payloads may use); encoders: the latest
    #: (1.8) the (batch row, KV head) of a slice of a reduced layer whose heads hold different numbers of entries
    #: (shape ``[1, 1, T, D]``; ``start`` and ``layer_tokens`` then count the head's stored entries), else None
    row: tuple[int, int] | None = None
    #: ``(lo, hi, position)``: the slice's entries ``[lo, hi)`` are its layer's from ``position`` on
    #: (:meth:`kvcodec.container.header.Run.spans`); empty: ``[0, T)`` from ``start``
    spans: tuple = ()


class Codec(ABC):
    """A byte-level stage: ``encode(tensor slice) -> payload``, ``decode(payload) -> bit patterns``."""

    codec_id: ClassVar[str]

    def __init__(self, params: dict | None = None):
        self.params = dict(params or {})

    @classmethod
    def configure(cls, options: dict, dtype: str) -> "Codec":
        """An encoder from user options: validated, defaults filled (:class:`~kvcodec.errors.ConfigError`)."""
        return cls(options)

    @classmethod
    def from_config(cls, config: dict) -> "Codec":
        """A decoder from the header's ``codec`` object."""
        return cls(config.get("params"))

    def get_config(self) -> dict:
        """The header's ``codec`` object."""
        return {"id": self.codec_id, "params": self.params}

    @abstractmethod
    def encode(self, t: torch.Tensor, where: Slice, prediction: torch.Tensor | None = None) -> bytes | None:
        """The payload of slice ``t`` (any device); None when nothing needs storing (``prediction`` is exact)."""

    @abstractmethod
    def decode(self, payload, where: Slice, prediction: np.ndarray | None = None,
               out: np.ndarray | None = None) -> np.ndarray:
        """The slice's bit patterns (uint16/uint32, ``where.shape``); ``payload`` None means "no section"."""

    #: payloads a decoder takes at once in :meth:`decode_many` (the file decoders batch their sections so)
    decode_batch: ClassVar[int] = 1

    def decode_many(self, items: list) -> list:
        """:meth:`decode` of each ``(payload, where, out)`` (no predictions), in order; a codec whose decoder
        gains from several payloads at once overrides it."""
        return [self.decode(payload, where, out=out) for payload, where, out in items]

    def __eq__(self, other):
        return type(other) is type(self) and other.get_config() == self.get_config()

    def __repr__(self):
        return f"{type(self).__name__}({self.params!r})"
