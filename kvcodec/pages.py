"""Where a serving engine keeps each key and value in its paged KV buffer, measured from the engine's own
cache-update kernel (:class:`PageLayout`), and the copies between pages and ``[1, heads, positions, head_dim]``
tensors.  No engine is imported here: :mod:`kvcodec.vllm` hands it vLLM's attention layers."""

from __future__ import annotations

import numpy as np
import torch

from .errors import UnsupportedCache

__all__ = ["PageLayout"]


class PageLayout:
    """Where each key and value element of a block lives in one layer's paged KV buffer, as the attention
    backend's own cache-update kernel puts it (measured by :meth:`measure`, never assumed).

    ``block_dim``: the buffer dimension indexed by block id; ``k_index``/``v_index``: per other dimension, the
    coordinate of element (head, position in block, dimension) - arrays of shape [heads, block_size,
    head_size].  ``flat_k``/``flat_v``: the same as offsets inside one block's contiguous slice, when the
    buffer is block-outermost and contiguous (the fast path: one ``index_select`` per layer)."""

    def __init__(self, shape, block_dim, k_index, v_index, heads, block_size, head_size):
        self.shape, self.block_dim = tuple(shape), block_dim
        self.k_index, self.v_index = k_index, v_index
        self.heads, self.block_size, self.head_size = heads, block_size, head_size
        self.flat_k = self.flat_v = None
        if block_dim == 0:
            inner = self.shape[1:]
            self.flat_k = torch.from_numpy(np.ravel_multi_index(tuple(k_index), inner).reshape(-1))
            self.flat_v = torch.from_numpy(np.ravel_multi_index(tuple(v_index), inner).reshape(-1))

    def describe(self) -> str:
        """How keys sit in a block, in words (the buffer's shape and block dimension, then: position-major,
        transposed, or another order - a packed layout the backend chose)."""
        kind = "another order (packed)"
        k = np.stack([np.asarray(c) for c in self.k_index], -1)  # [heads, positions, dims, coordinates]
        steps = [tuple(k[0, 1, 0] - k[0, 0, 0]), tuple(k[0, 0, 1] - k[0, 0, 0])]  # one position, one dimension
        contiguous = self.flat_k is not None and self.flat_k.numel() > 1
        if contiguous:
            f = self.flat_k.view(self.heads, self.block_size, self.head_size).numpy()[0]
            f = f - f[0, 0]
            st, sd = (f[1, 0], f[0, 1]) if min(f.shape) > 1 else (0, 0)
            affine = np.array_equal(f, np.arange(f.shape[0])[:, None] * st + np.arange(f.shape[1]) * sd)
            if affine and sd == 1:
                kind = "keys position-major"
            elif affine and st == 1:
                kind = "keys transposed"
        elif all(sum(map(abs, st)) == 1 for st in steps):
            kind = "keys on their own axes"
        return f"buffer {self.shape}, block dimension {self.block_dim}: {kind}"

    @classmethod
    def measure(cls, layer, kv_cache: torch.Tensor, num_blocks: int, block_size: int, heads: int,
                head_size: int) -> PageLayout:
        """Run ``layer.impl.do_kv_cache_update`` on a scratch copy of three blocks of ``kv_cache`` with keys
        and values that spell, in base-16 digits over several passes, which (head, position, dimension) they
        are; read back where each landed.  Refused (:class:`UnsupportedCache`) unless every element of the
        probed block lands exactly once, inside that block, and nothing else is touched."""
        impl = getattr(layer, "impl", None)
        if impl is None or not hasattr(impl, "do_kv_cache_update"):
            raise UnsupportedCache(f"kvcodec.vllm: attention {type(impl).__name__} writes its cache inside the "
                                   "forward (no do_kv_cache_update): its page layout cannot be measured")
        dims = [d for d, n in enumerate(kv_cache.shape) if n == num_blocks]
        if len(dims) != 1:
            raise UnsupportedCache(f"kvcodec.vllm: cannot tell the block dimension of a KV buffer of shape "
                                   f"{tuple(kv_cache.shape)} ({num_blocks} blocks)")
        bdim = dims[0]
        scratch_shape = list(kv_cache.shape)
        scratch_shape[bdim] = 3
        count = heads * block_size * head_size
        passes = max(1, int(np.ceil(np.log(count) / np.log(16))))
        ids = np.arange(count).reshape(block_size, heads, head_size)  # token-major, as the kernel takes them
        found = None
        slots = torch.arange(block_size, 2 * block_size, dtype=torch.int64)  # block 1 of 3
        for p in range(passes):
            digit = torch.from_numpy((ids // 16 ** p) % 16)
            scratch = torch.zeros(scratch_shape, dtype=kv_cache.dtype, device=kv_cache.device)
            key = (digit + 1).to(kv_cache.dtype).to(kv_cache.device)
            value = (digit + 17).to(kv_cache.dtype).to(kv_cache.device)
            with torch.no_grad():
                impl.do_kv_cache_update(layer, key, value, scratch, slots.to(kv_cache.device))
            got = scratch.float().cpu().numpy()
            if found is None:
                found = np.zeros(got.shape, dtype=np.int64)
                touched = got != 0
            elif not np.array_equal(touched, got != 0):
                raise UnsupportedCache("kvcodec.vllm: the backend's cache update is not repeatable")
            d = np.where(got >= 17, got - 17, got - 1)
            found += np.where(touched, d.astype(np.int64), 0) * 16 ** p
        is_value = touched & (got >= 17)  # (the last pass: keys wrote 1..16, values 17..32)
        index = {}
        for name, mask in (("k", touched & ~is_value), ("v", is_value)):
            where = np.nonzero(mask)
            vals = found[where]
            if vals.size != count or np.unique(vals).size != count:
                raise UnsupportedCache(f"kvcodec.vllm: the backend's {name} layout is not one element per "
                                       f"(head, position, dimension) ({vals.size} of {count} written)")
            if not np.all(where[bdim] == 1):
                raise UnsupportedCache("kvcodec.vllm: the backend writes a block's elements outside its block")
            order = np.empty(count, dtype=np.int64)
            order[vals] = np.arange(count)  # element id -> its position in `where`
            # element id = (t * heads + h) * head_size + d -> reorder to [heads, block_size, head_size]
            t, h, dd = np.unravel_index(np.arange(count), (block_size, heads, head_size))
            target = np.empty((heads, block_size, head_size), dtype=np.int64)
            target[h, t, dd] = order
            coords = [np.asarray(w)[target] for w in where]
            index[name] = [c for i, c in enumerate(coords) if i != bdim]
        return cls(kv_cache.shape, bdim, index["k"], index["v"], heads, block_size, head_size)

    def gather(self, kv_cache: torch.Tensor, blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``blocks`` (in order) as ``[1, heads, len(blocks) * block_size, head_size]``."""
        b = torch.as_tensor(blocks, dtype=torch.int64, device=kv_cache.device)
        out = []
        for flat, idx in ((self.flat_k, self.k_index), (self.flat_v, self.v_index)):
            if flat is not None and kv_cache.is_contiguous():
                x = kv_cache.view(kv_cache.shape[0], -1).index_select(0, b)[:, flat.to(kv_cache.device)]
            else:
                x = kv_cache[self._coords(b, idx)]
            x = x.view(len(blocks), self.heads, self.block_size, self.head_size)
            out.append(x.permute(1, 0, 2, 3).reshape(1, self.heads, -1, self.head_size).cpu())
        return out[0], out[1]

    def scatter(self, kv_cache: torch.Tensor, blocks: list[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``keys``/``values`` (``[1, heads, len(blocks) * block_size, head_size]``) into ``blocks``."""
        b = torch.as_tensor(blocks, dtype=torch.int64, device=kv_cache.device)
        n = len(blocks)
        for flat, idx, x in ((self.flat_k, self.k_index, keys), (self.flat_v, self.v_index, values)):
            x = x.to(kv_cache.device, kv_cache.dtype).reshape(self.heads, n, self.block_size, self.head_size)
            x = x.permute(1, 0, 2, 3).reshape(n, -1)
            if flat is not None and kv_cache.is_contiguous():
                view = kv_cache.view(kv_cache.shape[0], -1)
                rows = view.index_select(0, b)
                rows[:, flat.to(kv_cache.device)] = x
                view.index_copy_(0, b, rows)
            else:
                kv_cache[self._coords(b, idx)] = x

    def _coords(self, b: torch.Tensor, idx: list[np.ndarray]) -> tuple:
        coords, it = [], iter(idx)
        for d in range(len(self.shape)):
            if d == self.block_dim:
                coords.append(b[:, None])
            else:
                coords.append(torch.from_numpy(next(it).reshape(1, -1)).to(b.device))
        return tuple(coords)
