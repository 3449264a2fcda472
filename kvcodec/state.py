"""Layer state beyond keys and values: the recurrent and convolution state of linear-attention /
state-space layers (Mamba, Jamba, Zamba2, FalconH1, Qwen3-Next's gated delta net), and the indexer keys of
sparse-attention layers (DeepSeek-V3.2's lightning indexer, ``DynamicIndexedLayer``).

transformers keeps it in ``LinearAttentionLayer`` (no attention: Mamba layers) and in
``LinearAttentionAndFullAttentionLayer`` / ``LinearAttentionAndSlidingWindowAttentionLayer`` (attention beside
a state-space mixer: FalconH1, Zamba2's hybrid blocks).  Each holds ``number_of_states`` slots, each with an
optional convolution state ``[batch, channels, kernel]`` and an optional recurrent state (any shape with the
batch first; float32 even in bf16 models).  Their size does not grow with the context.

kvcodec stores every such tensor exactly, typed (spec section 5.6: ``state`` sections, format 1.3), and
restores the same layer classes with ``has_previous_state`` set, so ``generate()`` continues identically.  A
layer recording its past for ``crop()`` (speculative decoding) is refused by name: its conv state then holds
more than the kernel and the rollback bookkeeping is not stored.  Indexed layers (kind ``indexed``) hold one
more tensor, ``indexer_keys`` ``[batch, seq, index_dim]``, one row per cached token; their optional
``indexer_position_ids`` (multimodal position ids, an integer tensor) are refused by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

from .container.layout import REDUCE_FORMS, REDUCE_METHODS, REDUCERS  # noqa: F401  (the header's ids)
from .dtypes import DTYPES, bit_patterns, from_bit_patterns, of, same_bits
from .errors import FormatError, UnsupportedCache

__all__ = ["LayerState", "KINDS", "encode_payload", "decode_payload", "from_layer", "to_layer"]

#: ``state.kind`` of a layer: ``linear`` (state only, no attention: its keys/values hold 0 tokens),
#: ``hybrid`` (attention and state), ``indexed`` (attention and indexer keys) or ``reduced`` (1.4: the
#: entries of a merge-reduce summary, :mod:`kvcodec.reduction`: log-weights, anchor, parts)
KINDS = ("linear", "hybrid", "indexed", "reduced")
#: state tensor names, in the order a slot's tensors are stored (``indexer_keys``: kind ``indexed`` only;
#: ``log_weights`` and ``anchor``: kind ``reduced`` only)
NAMES = ("conv", "recurrent", "indexer_keys", "log_weights", "anchor", "scores")
#: the parts of a reduced layer's entries, in storage order (``levels``: highest level first)
REDUCED_PARTS = ("fixed", "sinks", "levels", "buffer")
MAX_LEVELS = 64
MAX_SLOTS = 256
MAX_RANK = 8

#: ``Coding`` byte of a state payload
CODING_RAW, CODING_ZSTD = 0, 1
PAYLOAD_HEAD = 8  # Coding (u8) and 7 reserved zero bytes
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"  # RFC 8878 Magic_Number 0xFD2FB528, little-endian
ZSTD_LEVEL = 19  # states are small (constant in the context length): the slow level costs little


@dataclass
class LayerState:
    """The state of one layer: ``slots`` slots, each with an optional ``conv`` and ``recurrent`` tensor."""

    kind: str
    slots: int
    conv: list[torch.Tensor | None]
    recurrent: list[torch.Tensor | None]
    indexer: torch.Tensor | None = None  #: kind ``indexed``: ``[batch, seq, index_dim]``
    #: kind ``reduced``: each entry's log-weight ``[batch, kv_heads, seq]`` float32, the anchor query
    #: ``[batch, kv_heads, k_dim]`` float32 (or None), ``parts`` ``{"fixed", "sinks", "levels", "buffer"}``
    #: (entries of each part; ``levels[l]`` the atoms at level ``l`` or None) and the attention ``scaling``
    log_weights: torch.Tensor | None = None
    anchor: torch.Tensor | None = None
    parts: dict | None = None
    scaling: float | None = None
    #: (1.11) kind ``reduced`` with a bounded reduce object: each entry's score ``[batch, kv_heads, seq]`` float32
    scores: torch.Tensor | None = None

    def tensors(self) -> list[tuple[str, int, torch.Tensor]]:
        """``(name, slot, tensor)`` in storage order: by slot, conv before recurrent before indexer keys,
        absent ones skipped (kind ``reduced``: log-weights, then the anchor if any)."""
        if self.kind == "reduced":
            return [(n, 0, t) for n, t in (("log_weights", self.log_weights), ("anchor", self.anchor),
                                           ("scores", self.scores)) if t is not None]
        out = []
        for s in range(self.slots):
            for name, t in (("conv", self.conv[s]), ("recurrent", self.recurrent[s]),
                            ("indexer_keys", self.indexer if s == 0 else None)):
                if t is not None:
                    out.append((name, s, t))
        return out

    def set(self, name: str, slot: int, t: torch.Tensor) -> None:
        """Put tensor ``t`` in its place (the inverse of :meth:`tensors`)."""
        if name == "indexer_keys":
            self.indexer = t
        elif name in ("log_weights", "anchor", "scores"):
            setattr(self, name, t)
        else:
            (self.conv if name == "conv" else self.recurrent)[slot] = t

    def descriptor(self) -> dict:
        """The header's ``layers[i].state`` object."""
        d = {"kind": self.kind, "slots": self.slots,
             "tensors": [{"name": n, "slot": s, "dtype": of(t.dtype).name, "shape": [int(x) for x in t.shape]}
                         for n, s, t in self.tensors()]}
        if self.kind == "reduced":
            d["parts"] = {"fixed": int(self.parts["fixed"]), "sinks": int(self.parts["sinks"]),
                          "levels": [None if x is None else int(x) for x in self.parts["levels"]],
                          "buffer": int(self.parts["buffer"])}
            if self.parts.get("heads") is not None:  # (1.8)
                d["parts"]["heads"] = [[int(x) for x in row] for row in self.parts["heads"]]
            d["scaling"] = float(self.scaling)
        return d

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, _, t in self.tensors())

    def equal(self, other: "LayerState | None") -> bool:
        if other is None or (self.kind, self.slots, self.parts, self.scaling) != (
                other.kind, other.slots, other.parts, other.scaling):
            return False
        if (self.indexer is None) != (other.indexer is None):
            return False
        mine, theirs = self.tensors(), other.tensors()
        return len(mine) == len(theirs) and all((a[0], a[1]) == (b[0], b[1]) and same_bits(a[2], b[2])
                                                for a, b in zip(mine, theirs))

    def check(self, i: int, batch: int) -> None:
        """Types, dtypes, ranks and batch size (``ValueError`` / ``TypeError`` naming the layer)."""
        if self.kind not in KINDS:
            raise ValueError(f"layer {i}: state kind {self.kind!r} is not one of {KINDS}")
        if not 1 <= self.slots <= MAX_SLOTS or len(self.conv) != self.slots or len(self.recurrent) != self.slots:
            raise ValueError(f"layer {i}: {self.slots} state slots with {len(self.conv)} conv and "
                             f"{len(self.recurrent)} recurrent entries")
        if (self.kind == "indexed") != (self.indexer is not None) or (
                self.kind == "indexed" and (any(c is not None for c in self.conv)
                                            or any(r is not None for r in self.recurrent) or self.slots != 1)):
            raise ValueError(f"layer {i}: kind {self.kind!r}: indexer keys (one slot, nothing else) belong to "
                             "kind 'indexed' and only to it")
        if self.kind == "reduced":
            self._check_reduced(i, batch)
            return
        if self.log_weights is not None or self.anchor is not None or self.parts is not None \
                or self.scores is not None:
            raise ValueError(f"layer {i}: log-weights, anchor, scores and parts belong to kind 'reduced' only")
        for name, s, t in self.tensors():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"layer {i} {name} state {s}: expected a torch.Tensor, got {type(t).__name__}")
            if t.dtype not in {d.torch for d in DTYPES.values()}:
                raise TypeError(f"layer {i} {name} state {s}: dtype {t.dtype} is not supported")
            if not 1 <= t.dim() <= MAX_RANK or t.shape[0] != batch or (name != "recurrent" and t.dim() != 3):
                raise ValueError(f"layer {i} {name} state {s}: shape {tuple(t.shape)} (expected the batch "
                                 f"{batch} first, at most {MAX_RANK} dimensions, conv states [batch, channels, "
                                 "kernel], indexer keys [batch, seq, index_dim])")


    def _check_reduced(self, i: int, batch: int) -> None:
        lw, a, parts = self.log_weights, self.anchor, self.parts
        if self.slots != 1 or any(c is not None for c in self.conv) or any(r is not None for r in self.recurrent) \
                or self.indexer is not None:
            raise ValueError(f"layer {i}: a reduced layer has one slot and only log-weights and an anchor")
        if not isinstance(lw, torch.Tensor) or lw.dtype != torch.float32 or lw.dim() != 3 or lw.shape[0] != batch:
            raise ValueError(f"layer {i}: reduced log-weights must be float32 [batch={batch}, kv_heads, seq]")
        if a is not None and (not isinstance(a, torch.Tensor) or a.dtype != torch.float32 or a.dim() != 3
                              or tuple(a.shape[:2]) != tuple(lw.shape[:2])):
            raise ValueError(f"layer {i}: a reduced layer's anchor must be float32 [batch, kv_heads, k_dim]")
        sc = self.scores
        if sc is not None and (not isinstance(sc, torch.Tensor) or sc.dtype != torch.float32
                               or tuple(sc.shape) != tuple(lw.shape) or bool(torch.isnan(sc).any())):
            raise ValueError(f"layer {i}: a reduced layer's scores must be float32 like its log-weights, no NaN")
        if not isinstance(parts, dict) or set(parts) - {"heads"} != set(REDUCED_PARTS) \
                or not isinstance(parts["levels"], list):
            raise ValueError(f"layer {i}: reduced parts must be {{fixed, sinks, levels, buffer}} (and heads)")
        heads = parts.get("heads")
        if heads is not None:
            b, h = lw.shape[:2]
            fixed = parts["fixed"]
            if (not isinstance(heads, list) or len(heads) != b
                    or any(not isinstance(r, list) or len(r) != h for r in heads)
                    or any(not isinstance(x, int) or isinstance(x, bool) or not 0 <= x <= fixed
                           for r in heads for x in r)
                    or max(max(r) for r in heads) != fixed or all(x == fixed for r in heads for x in r)):
                raise ValueError(f"layer {i}: reduced parts' heads must list, per batch row and KV head, the fixed "
                                 f"entries each holds (0..{fixed}, the longest {fixed}, some fewer)")
            if not torch.equal(torch.isneginf(lw[..., :fixed]), absent_entries(parts, lw.device)):
                raise ValueError(f"layer {i}: a head's absent fixed entries (past its count in heads) have "
                                 "log-weight -inf, and only they")
        if not isinstance(self.scaling, float) or not math.isfinite(self.scaling) or self.scaling <= 0:
            raise ValueError(f"layer {i}: reduced scaling must be a positive finite float")
        held = parts["fixed"] + parts["sinks"] + parts["buffer"] + sum(x or 0 for x in parts["levels"])
        if held != lw.shape[2]:
            raise ValueError(f"layer {i}: reduced parts hold {held} entries, the log-weights {lw.shape[2]}")


def absent_entries(parts: dict, device=None) -> torch.Tensor:
    """(1.8) ``[B, H, fixed]``: which fixed entries of a reduced layer whose ``parts`` has ``heads`` are absent
    (spec section 14.2: head (b, h) holds its first ``heads[b][h]``)."""
    n = torch.tensor(parts["heads"], dtype=torch.long, device=device)
    return torch.arange(parts["fixed"], device=device)[None, None, :] >= n[..., None]


# -- payloads ------------------------------------------------------------------------------------------

def encode_payload(t: torch.Tensor) -> bytes:
    """A ``state`` section payload: Coding, 7 zero bytes, the tensor's bit patterns (LE, C order) raw or as
    one zstd frame, whichever is smaller."""
    return bytes_payload(bit_patterns(t).astype(f"<u{of(t.dtype).itemsize}", copy=False).tobytes())


def bytes_payload(raw: bytes) -> bytes:
    """A ``state`` (section 5.6) or ``engine_bytes`` (section 15) payload of ``raw``: Coding, 7 zero bytes, the
    bytes raw or as one zstd frame, whichever is smaller."""
    packed = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True).compress(raw)
    if len(packed) < len(raw):
        return bytes([CODING_ZSTD]) + bytes(7) + packed
    return bytes([CODING_RAW]) + bytes(7) + bytes(raw)


def decode_payload(payload: bytes, dtype: str, shape: tuple[int, ...], offset: int) -> torch.Tensor:
    """The tensor of a ``state`` payload that starts at file offset ``offset``; :class:`FormatError` naming
    the field for a bad Coding, reserved bytes, or data of the wrong size (zstd output is bounded by the size
    the header declares before any allocation beyond it)."""
    dt = DTYPES[dtype]
    n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    data = decode_bytes_payload(payload, n, offset, "State")
    arr = np.frombuffer(data, dtype=f"<u{dt.itemsize}").astype(dt.uint).reshape(shape)
    return from_bit_patterns(arr, dt.torch)


def decode_bytes_payload(payload, n: int, offset: int, name: str) -> bytes:
    """The ``n`` bytes of a ``state`` / ``engine_bytes`` payload (``name``: the fields' prefix in errors)."""
    if len(payload) < PAYLOAD_HEAD:
        raise FormatError(f"{name.lower()} payload of {len(payload)} bytes is shorter than its {PAYLOAD_HEAD}-byte "
                          "head", field=f"{name}.Coding", offset=offset)
    coding = payload[0]
    if any(payload[1:PAYLOAD_HEAD]):
        raise FormatError(f"{name.lower()} payload reserved bytes are not zero", field=f"{name}.Reserved",
                          offset=offset + 1)
    data = payload[PAYLOAD_HEAD:]
    if coding == CODING_RAW:
        if len(data) != n:
            raise FormatError(f"raw {name.lower()} data of {len(data)} bytes, the header declares {n}",
                              field=f"{name}.Data", offset=offset + PAYLOAD_HEAD)
        return bytes(data)
    if coding == CODING_ZSTD:
        return _bounded_zstd(bytes(data), n, offset + PAYLOAD_HEAD, name)
    raise FormatError(f"{name.lower()} Coding {coding} is not 0 (raw) or 1 (zstd)", field=f"{name}.Coding",
                      offset=offset)


def _bounded_zstd(data: bytes, n: int, offset: int, name: str = "State") -> bytes:
    """One zstd frame whose header declares exactly ``n`` content bytes and nothing after it: the size is
    checked before decompressing, so a hostile frame cannot make the decoder allocate more."""
    what, field = name.lower(), f"{name}.Data"
    if data[:4] != ZSTD_MAGIC:
        raise FormatError(f"{what} data is not a zstd frame (no frame magic; skippable frames are not allowed)",
                          field=field, offset=offset)
    try:
        params = zstandard.get_frame_parameters(data)
    except zstandard.ZstdError as e:
        raise FormatError(f"{what} zstd frame header: {e}", field=field, offset=offset) from None
    if params.dict_id:
        raise FormatError(f"{what} zstd frame needs dictionary {params.dict_id}", field=field, offset=offset)
    declared = params.content_size
    if declared != n:
        said = declared if declared != zstandard.CONTENTSIZE_UNKNOWN else "no"
        raise FormatError(f"{what} zstd frame declares {said} content size; the header declares {n} bytes",
                          field=field, offset=offset)
    try:
        out = zstandard.ZstdDecompressor().decompress(data, max_output_size=n, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise FormatError(f"{what} zstd frame: {e}", field=field, offset=offset) from None
    if len(out) != n:
        raise FormatError(f"{what} zstd frame decodes to {len(out)} bytes, not {n}", field=field, offset=offset)
    return out


# -- transformers layers ----------------------------------------------------------------------------------

def from_layer(i: int, layer) -> LayerState:
    """The state of a transformers ``LinearAttention*`` or ``DynamicIndexedLayer`` (exact classes; the caller
    checked)."""
    from transformers.cache_utils import DynamicIndexedLayer, LinearAttentionLayer

    if type(layer) is DynamicIndexedLayer:
        if layer.indexer_position_ids is not None:
            raise UnsupportedCache(f"layer {i}: DynamicIndexedLayer holds indexer_position_ids (multimodal "
                                   "positions), which kvcodec does not store")
        if not layer.is_indexer_initialized or layer.indexer_keys is None or layer.indexer_keys.dim() != 3:
            raise UnsupportedCache(f"layer {i}: DynamicIndexedLayer holds no indexer keys (uninitialised)")
        return LayerState("indexed", 1, [None], [None], layer.indexer_keys)

    if layer.record_past:
        raise UnsupportedCache(f"layer {i}: {type(layer).__name__} records its past for crop() "
                               "(activate_past_recording): call cache.crop(0) before storing it")
    n = int(layer.number_of_states)
    conv = [layer.conv_states[s] if layer.is_conv_states_initialized[s] else None for s in range(n)]
    rec = [layer.recurrent_states[s] if layer.is_recurrent_states_initialized[s] else None for s in range(n)]
    for s in range(n):
        if conv[s] is not None and int(layer.conv_kernel_size[s]) != conv[s].shape[-1]:
            raise UnsupportedCache(f"layer {i}: conv state {s} holds {conv[s].shape[-1]} positions, its kernel "
                                   f"{layer.conv_kernel_size[s]}")
        if (conv[s] is not None or rec[s] is not None) and not layer.has_previous_state[s]:
            raise UnsupportedCache(f"layer {i}: state {s} is initialised but has_previous_state is False")
    return LayerState("linear" if type(layer) is LinearAttentionLayer else "hybrid", n, conv, rec)


def to_layer(state: LayerState, sliding_window: int | None):
    """A transformers layer holding copies of ``state``'s tensors (transformers updates states in place, so
    generating from the layer must not change the caller's) and nothing else: the caller sets a ``hybrid``
    layer's attention tensors."""
    from transformers.cache_utils import (
        DynamicIndexedLayer,
        LinearAttentionAndFullAttentionLayer,
        LinearAttentionAndSlidingWindowAttentionLayer,
        LinearAttentionLayer,
    )

    if state.kind == "indexed":
        layer = DynamicIndexedLayer()
        layer.lazy_initialization_indexer(state.indexer)
        layer.indexer_keys = state.indexer.clone()
        return layer
    if state.kind == "linear":
        layer = LinearAttentionLayer(number_of_states=state.slots)
    elif sliding_window is None:
        layer = LinearAttentionAndFullAttentionLayer(number_of_states=state.slots)
    else:
        layer = LinearAttentionAndSlidingWindowAttentionLayer(sliding_window=sliding_window,
                                                              number_of_states=state.slots)
    for s in range(state.slots):
        c, r = state.conv[s], state.recurrent[s]
        c, r = (None if t is None else t.clone() for t in (c, r))
        if c is not None:
            layer.conv_states[s] = c
            layer.is_conv_states_initialized[s] = True
            layer.conv_kernel_size[s] = int(c.shape[-1])
        if r is not None:
            layer.recurrent_states[s] = r
            layer.is_recurrent_states_initialized[s] = True
        if c is not None or r is not None:
            layer.has_previous_state[s] = True
            first = c if c is not None else r
            if layer.device is None:
                layer.dtype, layer.device = first.dtype, first.device
    return layer
