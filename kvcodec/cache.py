"""The canonical in-memory KV cache and adapters to and from transformers.

:class:`KVCache` holds, per layer, keys ``[batch, kv_heads, seq, k_dim]`` and
values ``[batch, kv_heads, seq, v_dim]`` of one dtype (float32, float16 or
bfloat16), optional token ids ``[batch, tokens]``, and the position of the
first cached token.  Layers may differ in length (sliding-window layers keep
only their window; ``cumulative_length`` says how many tokens they have seen).

Layers of state-space / linear-attention mixers carry a :class:`~kvcodec.state.LayerState` in ``states``
(conv and recurrent tensors): ``linear`` layers hold no attention (their keys and values have 0 tokens),
``hybrid`` layers both.

Adapters: transformers 5.x caches (``DynamicCache``, ``StaticCache``) whose layers are exactly one of
:data:`SUPPORTED_LAYERS`, the legacy tuple of ``(k, v)`` pairs, and ``KVCache`` itself.  Any other layer
class - subclasses included: quantized layers keep most tokens outside ``keys``/``values``, indexed layers
(DeepSeek-V3.2) carry indexer keys - raises :class:`~kvcodec.errors.UnsupportedCache` naming the layer, its
class and the supported list; so do uninitialised layers.  Mixed dtypes or batch sizes raise ``TypeError`` or
``ValueError`` naming the layer.  Nothing is silently converted or stored in part.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .dtypes import DTYPES, nonzero_entries, of, same_bits
from .state import LayerState, absent_entries

__all__ = ["KVCache", "to_canonical", "SUPPORTED_LAYERS"]

#: the transformers cache layer classes :func:`to_canonical` stores (exact classes, not subclasses)
SUPPORTED_LAYERS = ("DynamicLayer", "DynamicSlidingWindowLayer", "StaticLayer", "LinearAttentionLayer",
                    "LinearAttentionAndFullAttentionLayer", "LinearAttentionAndSlidingWindowAttentionLayer",
                    "DynamicIndexedLayer")

@dataclass
class KVCache:
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    tokens: torch.Tensor | None = None
    start_position: int = 0
    sliding_window: list[int | None] = field(default_factory=list)
    cumulative_length: list[int] = field(default_factory=list)
    states: list[LayerState | None] = field(default_factory=list)
    #: a reduced cache (:mod:`kvcodec.reduction`): the header's ``reduce`` object (how it was reduced); its
    #: reduced layers carry a state of kind ``reduced``
    reduce: dict | None = None

    def __post_init__(self):
        if len(self.keys) != len(self.values):
            raise ValueError(f"{len(self.keys)} key tensors but {len(self.values)} value tensors")
        if not self.keys:
            raise ValueError("a cache needs at least one layer")
        if not self.sliding_window:
            self.sliding_window = [None] * len(self.keys)
        if not self.cumulative_length:
            self.cumulative_length = [int(k.shape[-2]) for k in self.keys]
        if not self.states:
            self.states = [None] * len(self.keys)
        if len(self.states) != len(self.keys):
            raise ValueError(f"{len(self.states)} layer states for {len(self.keys)} layers")
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
            st = self.states[i]
            if st is not None:
                if not isinstance(st, LayerState):
                    raise TypeError(f"layer {i}: state must be a kvcodec.state.LayerState, not {type(st).__name__}")
                st.check(i, b)
                if st.kind == "linear" and (k.shape[2] or self.cumulative_length[i]):
                    raise ValueError(f"layer {i}: a linear (state-only) layer holds no attention tokens")
                if st.kind == "indexed" and (st.indexer.shape[1] != k.shape[2] or self.sliding_window[i] is not None):
                    raise ValueError(f"layer {i}: indexer keys {tuple(st.indexer.shape)} for {k.shape[2]} tokens "
                                     "(one row per token, full attention)")
                if st.kind == "reduced" and (tuple(st.log_weights.shape[1:]) != tuple(k.shape[1:3])
                                             or (st.anchor is not None and st.anchor.shape[2] != k.shape[3])
                                             or self.sliding_window[i] is not None or self.reduce is None
                                             or self.cumulative_length[i] < k.shape[2]):
                    raise ValueError(f"layer {i}: a reduced layer needs log-weights [batch, kv_heads, seq] and an "
                                     "anchor [batch, kv_heads, k_dim] matching its keys, full attention, "
                                     "cumulative_length >= seq and the cache's reduce plan")
                if st.kind == "reduced" and st.parts.get("heads") is not None:  # (1.8) absent entries are not
                    fixed = st.parts["fixed"]  # stored: they must be what the decoder restores, +0.0
                    gone = absent_entries(st.parts, k.device)
                    for name, t in (("keys", k), ("values", v)):
                        if (nonzero_entries(t[:, :, :fixed]) & gone).any():
                            raise ValueError(f"layer {i}: {name} of absent entries (parts.heads) are not zero: the "
                                             "file would not restore them")
        if self.reduce is not None and not any(st is not None and st.kind == "reduced" for st in self.states):
            raise ValueError("a cache with a reduce plan needs at least one reduced layer")
        if self.reduce is not None and self.tokens is not None:
            raise ValueError("a reduced cache holds entries, not tokens: it stores no token ids")
        if self.tokens is not None:
            t = self.tokens
            if t.dim() != 2 or t.shape[0] != b or t.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"tokens must be an integer tensor [batch={b}, seq], got {tuple(t.shape)} {t.dtype}")
            held, seen = self.seq_len, max(self.cumulative_length)
            state_only = all(st is not None and st.kind == "linear" for st in self.states)  # Mamba: no count
            if t.shape[1] not in (held, seen) and not state_only:  # sliding windows: the ids of every position seen
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

    @property
    def has_state(self) -> bool:
        """Some layer carries recurrent / conv state."""
        return any(st is not None for st in self.states)

    def nbytes(self) -> int:
        kv = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in zip(self.keys, self.values))
        return kv + sum(st.nbytes() for st in self.states if st is not None)

    def equal(self, other: "KVCache") -> bool:
        """Bit-identical tensors (NaN payloads included), states included."""
        if self.num_layers != other.num_layers or self.dtype != other.dtype or self.reduce != other.reduce:
            return False
        for a, b in zip(self.states, other.states):
            if (a is None) != (b is None) or (a is not None and not a.equal(b)):
                return False
        return all(same_bits(a, b) for a, b in zip(self.keys + self.values, other.keys + other.values))

    # -- conversions ----------------------------------------------------------
    def to_dynamic_cache(self, config=None, *, model=None, plain: bool = False):
        """A transformers ``DynamicCache`` holding these tensors (no copy).  A reduced cache (``reduce`` set)
        becomes a :class:`kvcodec.reduction.ReducedCache` (``model``, optional, is switched to the attention
        that applies its masses); ``plain=True`` gives its non-reduced layers only (reduced ones as None)."""
        from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

        from .state import to_layer

        if self.reduce is not None and not plain:
            from .reduction.cache import ReducedCache

            return ReducedCache.from_canonical(self, model)
        layers = []
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            sw, st = self.sliding_window[i], self.states[i]
            if st is not None and st.kind == "reduced":
                layers.append(None)
                continue
            if st is not None:
                layer = to_layer(st, sw)
                if st.kind == "linear":
                    layers.append(layer)
                    continue
                layer.lazy_initialization(k, v)  # two positional arguments: the attention part's
            else:
                layer = DynamicSlidingWindowLayer(sliding_window=sw) if sw is not None else DynamicLayer()
                layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
            if sw is not None:
                layer.cumulative_length = self.cumulative_length[i]
            layers.append(layer)
        # transformers >= 5.25: a linear-attention layer counts the tokens it has seen (its get_seq_length,
        # which sets the next positions): the count the attention layers imply (to_canonical checked they agree)
        seen, _ = tokens_seen(self.cumulative_length, self.states)
        for layer in layers:
            if layer is not None and isinstance(getattr(layer, "cumulative_length_linear", None), torch.Tensor):
                layer.cumulative_length_linear = torch.tensor(seen, dtype=torch.int64,
                                                              device=layer.device or "cpu")
        cache = DynamicCache()
        cache.layers = layers
        return cache

    def to_static_cache(self, config, max_cache_len: int):
        """A transformers ``StaticCache`` of ``max_cache_len`` positions (the cache ``torch.compile`` and
        ``cache_implementation="static"`` use) holding these tensors in its first positions (copied).  Full
        attention layers only: a static sliding-window layer keeps its positions in a ring."""
        from transformers.cache_utils import StaticCache, StaticLayer

        from .errors import ConfigError

        if any(sw is not None for sw in self.sliding_window) or self.has_state:
            raise ConfigError("to_static_cache: this cache has sliding-window or state-space layers "
                              "(use to_dynamic_cache)")
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
        """The legacy tuple of ``(key, value)`` pairs (not for a reduced cache: it would drop the masses)."""
        if self.reduce is not None:
            from .errors import ConfigError

            raise ConfigError("a reduced cache has no legacy form: its atoms' log-weights would be lost "
                              "(use output='dynamic')")
        return tuple((k, v) for k, v in zip(self.keys, self.values))


def tokens_seen(cumulative_length, states) -> tuple[int, bool]:
    """(the tokens a cache has seen as its attention layers count them, whether it has any attention layer):
    the count a linear-attention layer of transformers >= 5.25 keeps (``cumulative_length_linear``), which
    kvcodec does not store but restores from this (0 in a cache without attention layers)."""
    counts = [c for c, st in zip(cumulative_length, states) if st is None or st.kind != "linear"]
    return max(counts, default=0), bool(counts)


def to_canonical(cache) -> KVCache:
    """Convert a supported cache object to :class:`KVCache` (tensors are not copied)."""
    from .errors import UnsupportedCache

    if isinstance(cache, KVCache):
        return cache
    layers = getattr(cache, "layers", None)
    if layers is not None and not isinstance(cache, (tuple, list)):
        import transformers.cache_utils as cu

        from .state import from_layer

        if getattr(cache, "offloading", False) and torch.cuda.is_available():
            torch.cuda.synchronize()  # offloaded layers are copied to the CPU with non_blocking=True
        keys, values, sw, cum, states = [], [], [], [], []
        placeholders = []  # linear layers: keys/values of 0 tokens, made once the cache's dtype is known
        reduce = cache.kvcodec_reduce() if hasattr(cache, "kvcodec_reduce") else None
        for i, layer in enumerate(layers):
            if reduce is not None and hasattr(layer, "to_state"):  # a ReducedLayer (kvcodec.reduction)
                if layer.keys is None or layer.keys.dim() != 4:
                    raise UnsupportedCache(f"layer {i}: the reduced layer holds no tensors yet")
                keys.append(layer.keys)
                values.append(layer.values)
                sw.append(None)
                cum.append(int(layer.cumulative_length))
                states.append(layer.to_state())
                continue
            # exact classes: a subclass (QuantizedLayer, DynamicIndexedLayer ...) holds state that the supported
            # classes' tensors do not show, and storing only those would lose it silently
            name = type(layer).__name__
            if name not in SUPPORTED_LAYERS or type(layer) is not getattr(cu, name, None):
                raise UnsupportedCache(f"layer {i}: {type(layer).__module__}.{type(layer).__qualname__} (in a "
                                       f"{type(cache).__name__}) is not supported: kvcodec stores "
                                       f"{', '.join(SUPPORTED_LAYERS)}; its other state would be lost")
            state = from_layer(i, layer) if isinstance(layer, (cu.LinearAttentionCacheLayerMixin,
                                                                cu.DynamicIndexedLayer)) else None
            states.append(state)
            if state is not None and state.kind == "linear":
                keys.append(None)
                values.append(None)
                sw.append(None)
                cum.append(0)
                placeholders.append(i)
                continue
            if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.dim() != 4:
                raise UnsupportedCache(f"layer {i}: the {name} holds no tensors (uninitialised: the model has "
                                       "not run on this cache yet)")
            if type(layer) is cu.StaticLayer:  # max_cache_len slots, the first cumulative_length of them written
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
            if isinstance(layer, cu.DynamicSlidingWindowLayer):
                sw.append(int(layer.sliding_window))
                cum.append(int(layer.cumulative_length))
            else:
                sw.append(None)
                cum.append(int(layer.keys.shape[-2]))
        # transformers >= 5.25 counts the tokens a linear-attention layer has seen (``cumulative_length_linear``,
        # its get_seq_length): not stored, it is restored as the count the attention layers imply (0 without
        # any), so a cache whose count says otherwise would come back different and is refused here
        seen, attention = tokens_seen(cum, states)
        for i, layer in enumerate(layers):
            count = getattr(layer, "cumulative_length_linear", None)
            if attention and count is not None and int(count) != seen:
                raise UnsupportedCache(f"layer {i}: {type(layer).__name__} counts {int(count)} tokens seen, its "
                                       f"cache's attention layers {seen}; kvcodec restores the latter")
        if placeholders:
            ref = next((k for k in keys if k is not None), None)
            if ref is None:  # state only (Mamba): the first state tensor gives dtype and batch
                first = next((t for st in states if st is not None for _, _, t in st.tensors()), None)
                if first is None:
                    raise UnsupportedCache("the cache's layers hold no state yet (the model has not run on it)")
                ref = torch.empty(first.shape[0], 1, 0, 1, dtype=first.dtype, device=first.device)
            for i in placeholders:
                keys[i] = values[i] = ref.new_empty(ref.shape[0], 1, 0, 1)
        return KVCache(keys, values, sliding_window=sw, cumulative_length=cum, states=states, reduce=reduce)
    if isinstance(cache, (tuple, list)):
        keys, values = [], []
        for i, pair in enumerate(cache):
            if not isinstance(pair, (tuple, list)) or len(pair) < 2:
                raise TypeError(f"layer {i}: expected a (key, value) pair")
            keys.append(pair[0])
            values.append(pair[1])
        return KVCache(keys, values)
    raise UnsupportedCache(f"unsupported cache type {type(cache).__name__}: pass a transformers cache "
                           "(DynamicCache, StaticCache), a tuple of (key, value) pairs, or a kvcodec.KVCache")
