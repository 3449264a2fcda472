"""kvcodec.pages.PageLayout: an engine's page layout measured from its own cache-update kernel.  Fake kernels
with known layouts (position-major, keys transposed in each page, an arbitrary packed permutation, a
[2, blocks, positions, heads, dim] buffer whose block dimension is not the first) stand in for vLLM's; the
layout found must read back exactly what the kernel wrote, write exactly what the kernel would, and refuse a
kernel that does not place every element once."""

import numpy as np
import pytest
import torch

from kvcodec.errors import UnsupportedCache
from kvcodec.pages import PageLayout

H, BS, D, N = 3, 32, 16, 7


class Layer:
    def __init__(self, where):
        self.impl = self
        self.where = where  # (block, head, position, dim, 0 keys | 1 values) -> index tuple

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        for i, slot in enumerate(slot_mapping.tolist()):
            b, t = divmod(slot, BS)
            for h in range(H):
                for d in range(D):
                    kv_cache[self.where(b, h, t, d, 0)] = key[i, h, d]
                    kv_cache[self.where(b, h, t, d, 1)] = value[i, h, d]


_PERM = np.random.default_rng(5).permutation(BS * 2 * D)

LAYOUTS = {
    "position-major": ((N, H, BS, 2 * D), lambda b, h, t, d, v: (b, h, t, v * D + d)),
    "keys transposed": ((N, H, BS, 2 * D), lambda b, h, t, d, v: (b, h) + divmod(
        (d * BS + t) if v == 0 else BS * D + t * D + d, 2 * D)),
    "packed": ((N, H, BS, 2 * D), lambda b, h, t, d, v: (b, h) + divmod(int(_PERM[(v * BS + t) * D + d]), 2 * D)),
    "block dimension 1": ((2, N, BS, H, D), lambda b, h, t, d, v: (v, b, t, h, d)),
}


def fill(layer, shape, blocks, dtype=torch.bfloat16, seed=0):
    """Write random keys and values for ``blocks`` with the kernel; return the buffer and the canonical tensors."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.zeros(shape, dtype=dtype)
    n = len(blocks) * BS
    k = torch.randn(n, H, D, generator=g).to(dtype)
    v = torch.randn(n, H, D, generator=g).to(dtype)
    slots = torch.tensor([b * BS + t for b in blocks for t in range(BS)])
    layer.do_kv_cache_update(layer, k, v, buf, slots)
    canon = (k.permute(1, 0, 2)[None].contiguous(), v.permute(1, 0, 2)[None].contiguous())
    return buf, canon


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_the_measured_layout_reads_and_writes_what_the_kernel_does(name):
    shape, where = LAYOUTS[name]
    layer = Layer(where)
    layout = PageLayout.measure(layer, torch.zeros(shape, dtype=torch.bfloat16), N, BS, H, D)
    blocks = [5, 2, 6]
    buf, (k, v) = fill(layer, shape, blocks)
    gk, gv = layout.gather(buf, blocks)
    assert torch.equal(gk, k) and torch.equal(gv, v)  # bit for bit, in the order of the blocks given
    other = torch.zeros(shape, dtype=torch.bfloat16)
    layout.scatter(other, blocks, k, v)
    assert torch.equal(other, buf)  # exactly the kernel's bytes, nothing else touched
    if name in ("position-major", "keys transposed"):
        assert name in layout.describe()


def test_a_kernel_that_does_not_place_every_element_once_is_refused():
    shape, _ = LAYOUTS["position-major"]
    lossy = Layer(lambda b, h, t, d, v: (b, h, t, d))  # values overwrite keys
    with pytest.raises(UnsupportedCache, match="layout"):
        PageLayout.measure(lossy, torch.zeros(shape, dtype=torch.bfloat16), N, BS, H, D)
    spill = Layer(lambda b, h, t, d, v: ((b + 1) % N, h, t, v * D + d))  # writes into the next block
    with pytest.raises(UnsupportedCache, match="outside its block"):
        PageLayout.measure(spill, torch.zeros(shape, dtype=torch.bfloat16), N, BS, H, D)


def test_a_backend_without_a_cache_update_is_refused():
    class Fused:
        impl = object()

    with pytest.raises(UnsupportedCache, match="do_kv_cache_update"):
        PageLayout.measure(Fused(), torch.zeros(N, H, BS, 2 * D), N, BS, H, D)
