"""Recording how a cache was filled: the computation schedule.

A cache regenerated from its tokens is bit-identical to the original only if
the same forward calls are replayed with the same chunk boundaries (measured on
SmolLM2: a prefill of 400 tokens and one of 300 differ on the first 300
positions; single-token steps differ from a prefill).  :class:`RecordingCache`
is a transformers ``DynamicCache`` that logs the number of new tokens of every
forward call, so ``model.generate(..., cache=RecordingCache())`` or a manual
prefill + steps leaves the schedule in ``cache.schedule``; :func:`runs` packs it
as run-lengths, ``[[400, 1], [1, 100]]`` = one call of 400 tokens then 100
calls of 1, the form the header of a token-tier file stores.
"""

from __future__ import annotations

from transformers.cache_utils import DynamicCache


class RecordingCache(DynamicCache):
    """A ``DynamicCache`` that records the size of every update of layer 0."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.schedule: list[int] = []

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx == 0:
            self.schedule.append(int(key_states.shape[-2]))
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def runs(schedule: list[int]) -> list[list[int]]:
    """Run-length form ``[[size, count], ...]`` of a list of call sizes."""
    out: list[list[int]] = []
    for n in schedule:
        if out and out[-1][0] == n:
            out[-1][1] += 1
        else:
            out.append([n, 1])
    return out


def expand(run_list: list[list[int]]) -> list[int]:
    """Inverse of :func:`runs`."""
    return [size for size, count in run_list for _ in range(count)]
