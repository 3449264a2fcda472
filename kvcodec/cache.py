"""The canonical in-memory KV cache and adapters to and from transformers.

:class:`KVCache` holds, per layer, keys ``[batch, kv_heads, seq, k_dim]`` and
values ``[batch, kv_heads, seq, v_dim]`` of one dtype (float32, float16 or
bfloat16), optional token ids ``[batch, tokens]``, and the position of the
first cached token.  Layers may differ in length (sliding-window layers keep
only their window; ``cumulative_length`` says how many tokens they have seen).

Adapters: transformers 5.x ``DynamicCache`` whose layers are exactly
``DynamicLayer`` or ``DynamicSlidingWindowLayer``, the legacy tuple of
``(k, v)`` pairs, and ``KVCache`` itself.  Any other layer class - subclasses
included: quantized layers keep most tokens outside ``keys``/``values``,
hybrid and indexed layers (FalconH1, DeepSeek-V3.2) carry extra state - raises
:class:`~kvcodec.errors.UnsupportedCache` naming the layer and its class;
uninitialised layers, mixed dtypes or batch sizes raise ``TypeError`` or
``ValueError`` naming the layer.  Nothing is silently converted or stored in
part.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .dtypes import DTYPES, of

__all__ = ["KVCache", "to_canonical"]

@dataclass
class KVCache:
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    tokens: torch.Tensor | None = None
    start_position: int = 0
    sliding_window: list[int | None] = field(default_factory=list)
    cumulative_length: list[int] = field(default_factory=list)

    def __post_init__(self):
        if len(self.keys) != len(self.values):
            raise ValueError(f"{len(self.keys)} key tensors but {len(self.values)} value tensors")
        if not self.keys:
            raise ValueError("a cache needs at least one layer")
        if not self.sliding_window:
            self.sliding_window = [None] * len(self.keys)
        if not self.cumulative_length:
            self.cumulative_length = [int(k.shape[-2]) for k in self.keys]
        dt = self.keys[0].dtype
        if dt not in {d.torch for d in DTYPES.values()}:
            raise TypeError(f"layer 0: dtype {dt} is not supported (float32, float16, bfloat16)")
        b = self.keys[0].shape[0]
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            for name, t in (("keys", k), ("values", v)):
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"layer {i} {name}: expected a torch.Tensor, got {type(t).__name__}")
                if t.dim() != 4:
                    raise ValueError(f"layer {i} {name}: expected [batch, heads, seq, dim], got shape {tuple(t.shape)}")
                if t.dtype != dt:
                    raise TypeError(f"layer {i} {name}: dtype {t.dtype} differs from layer 0's {dt}")
                if t.shape[0] != b:
                    raise ValueError(f"layer {i} {name}: batch {t.shape[0]} differs from layer 0's {b}")
            if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
                raise ValueError(f"layer {i}: keys {tuple(k.shape)} and values {tuple(v.shape)} disagree on heads/seq")
        if self.tokens is not None:
            t = self.tokens
            if t.dim() != 2 or t.shape[0] != b or t.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"tokens must be an integer tensor [batch={b}, seq], got {tuple(t.shape)} {t.dtype}")
            held, seen = self.seq_len, max(self.cumulative_length)
            if t.shape[1] not in (held, seen):  # sliding-window layers only: the ids of every position seen
                raise ValueError(f"{t.shape[1]} token ids for a cache that holds {held} tokens"
                                 + (f" and has seen {seen}" if seen != held else ""))

    # -- properties ---------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def dtype(self) -> torch.dtype:
        return self.keys[0].dtype

    @property
    def dtype_name(self) -> str:
        return of(self.dtype).name

    @property
    def batch(self) -> int:
        return int(self.keys[0].shape[0])

    @property
    def seq_len(self) -> int:
        return max(int(k.shape[2]) for k in self.keys)

    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in zip(self.keys, self.values))

    def equal(self, other: "KVCache") -> bool:
        """Bit-identical tensors (NaN payloads included)."""
        if self.num_layers != other.num_layers or self.dtype != other.dtype:
            return False
        iv = of(self.dtype).int_view
        for a, b in zip(self.keys + self.values, other.keys + other.values):
            if a.shape != b.shape or not torch.equal(a.contiguous().view(iv), b.contiguous().view(iv)):
                return False
        return True

    # -- conversions ----------------------------------------------------------
    def to_dynamic_cache(self, config=None):
        """A transformers ``DynamicCache`` holding these tensors (no copy)."""
        from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

        layers = []
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            sw = self.sliding_window[i]
            layer = DynamicSlidingWindowLayer(sliding_window=sw) if sw is not None else DynamicLayer()
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
            if sw is not None:
                layer.cumulative_length = self.cumulative_length[i]
            layers.append(layer)
        cache = DynamicCache()
        cache.layers = layers
        return cache

    def to_static_cache(self, config, max_cache_len: int):
        """A transformers ``StaticCache`` of ``max_cache_len`` positions (the cache ``torch.compile`` and
        ``cache_implementation="static"`` use) holding these tensors in its first positions (copied).  Full
        attention layers only: a static sliding-window layer keeps its positions in a ring."""
        from transformers.cache_utils import StaticCache, StaticLayer

        from .errors import ConfigError

        if any(sw is not None for sw in self.sliding_window):
            raise ConfigError("to_static_cache: this cache has sliding-window layers (use to_dynamic_cache)")
        if self.seq_len > max_cache_len:
            raise ConfigError(f"to_static_cache: {self.seq_len} tokens do not fit max_cache_len={max_cache_len}")
        cache = StaticCache(config=config, max_cache_len=max_cache_len)
        if len(cache.layers) != self.num_layers or any(type(layer) is not StaticLayer for layer in cache.layers):
            raise ConfigError(f"to_static_cache: the config gives {len(cache.layers)} layers "
                              f"({sorted({type(la).__name__ for la in cache.layers})}), this cache has "
                              f"{self.num_layers} full-attention layers")
        for layer, k, v in zip(cache.layers, self.keys, self.values):
            layer.update(k, v)
        return cache

    def to_legacy(self):
        """The legacy tuple of ``(key, value)`` pairs."""
        return tuple((k, v) for k, v in zip(self.keys, self.values))


def to_canonical(cache) -> KVCache:
    """Convert a supported cache object to :class:`KVCache` (tensors are not copied)."""
    if isinstance(cache, KVCache):
        return cache
    layers = getattr(cache, "layers", None)
    if layers is not None and not isinstance(cache, (tuple, list)):
        from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, StaticLayer

        from .errors import UnsupportedCache

        keys, values, sw, cum = [], [], [], []
        for i, layer in enumerate(layers):
            # exact classes: a subclass (QuantizedLayer, DynamicIndexedLayer, LinearAttention...Layer) holds state
            # that keys/values do not show, and storing only keys/values would lose it silently
            if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer, StaticLayer):
                raise UnsupportedCache(f"layer {i}: {type(layer).__module__}.{type(layer).__qualname__} "
                                       f"(in a {type(cache).__name__}) is not supported: only DynamicLayer, "
                                       "DynamicSlidingWindowLayer and StaticLayer are stored; its other state "
                                       "would be lost")
            if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.dim() != 4:
                raise ValueError(f"layer {i}: the cache layer holds no tensors (uninitialised)")
            if type(layer) is StaticLayer:  # max_cache_len slots, the first cumulative_length of them written
                n = int(layer.cumulative_length)
                if not 0 <= n <= layer.keys.shape[-2]:
                    raise UnsupportedCache(f"layer {i}: StaticLayer reports {n} positions of {layer.keys.shape[-2]}")
                keys.append(layer.keys[:, :, :n])
                values.append(layer.values[:, :, :n])
                sw.append(None)
                cum.append(n)
                continue
            keys.append(layer.keys)
            values.append(layer.values)
            if isinstance(layer, DynamicSlidingWindowLayer):
                sw.append(int(layer.sliding_window))
                cum.append(int(layer.cumulative_length))
            else:
                sw.append(None)
                cum.append(int(layer.keys.shape[-2]))
        return KVCache(keys, values, sliding_window=sw, cumulative_length=cum)
    if isinstance(cache, (tuple, list)):
        keys, values = [], []
        for i, pair in enumerate(cache):
            if not isinstance(pair, (tuple, list)) or len(pair) < 2:
                raise TypeError(f"layer {i}: expected a (key, value) pair")
            keys.append(pair[0])
            values.append(pair[1])
        return KVCache(keys, values)
    raise TypeError(f"unsupported cache type {type(cache).__name__}: pass a DynamicCache, a tuple of "
                    "(key, value) pairs, or a kvcodec.KVCache")
