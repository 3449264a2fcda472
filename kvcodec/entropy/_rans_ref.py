"""Pure-Python reference of the lane coder in :mod:`._rans_numba`.

Slow and obvious on purpose: it is the executable form of the spec's
pseudo-code ("rANS lane stream" in ``spec/kvz.md``), and the tests require the
Numba kernels to produce the same words and symbols.  It raises
:class:`ValueError` where the kernels return a status code.
"""

from __future__ import annotations

import numpy as np

RANS_L = 1 << 16


def symbol_class(prev: int, ref: int, kbits: int, nclass: int) -> int:
    if nclass == 1:
        return 0
    mmask = (1 << (kbits - 1)) - 1
    mag, rmag = prev & mmask, ref & mmask
    return 3 * (prev >> (kbits - 1)) + (0 if mag < rmag else 1 if mag == rmag else 2)


def coding_order(rows: int, ntok: int, ways: int):
    """Yield ``(row, token, state)`` in decoding order."""
    for g0 in range(0, rows, ways):
        lanes = min(ways, rows - g0)
        for t in range(ntok):
            for j in range(lanes):
                yield g0 + j, t, j


def lanes_encode_ref(syms, refs, ctx_map, freq, scale_bits, ways, kbits, nclass) -> np.ndarray:
    """Return the stored word stream (already in reading order)."""
    rows, ntok = syms.shape
    order = list(coding_order(rows, ntok, ways))
    ctx = {}
    for r in range(rows):
        prev = int(refs[r])
        for t in range(ntok):
            ctx[r, t] = int(ctx_map[r, symbol_class(prev, int(refs[r]), kbits, nclass)])
            prev = int(syms[r, t])
    cum = np.concatenate([np.zeros((freq.shape[0], 1), np.int64), np.cumsum(freq, axis=1)[:, :-1]], axis=1)
    states = [RANS_L] * ways
    emitted: list[int] = []
    for r, t, j in reversed(order):
        c, s = ctx[r, t], int(syms[r, t])
        f, b = int(freq[c, s]), int(cum[c, s])
        x = states[j]
        if x >= f << (32 - scale_bits):
            emitted.append(x & 0xFFFF)
            x >>= 16
        states[j] = ((x // f) << scale_bits) + (x % f) + b
    for j in range(ways - 1, -1, -1):
        emitted.append(states[j] & 0xFFFF)
        emitted.append(states[j] >> 16)
    return np.array(emitted[::-1], dtype=np.uint16)


def lanes_decode_ref(words, refs, ctx_map, freq, scale_bits, ways, kbits, nclass, rows, ntok) -> np.ndarray:
    w = [int(v) for v in words]
    if len(w) < 2 * ways:
        raise ValueError("stream shorter than the initial states")
    states, pos = [], 0
    for _ in range(ways):
        x = (w[pos] << 16) | w[pos + 1]
        pos += 2
        if x < RANS_L:
            raise ValueError("initial state below 2**16")
        states.append(x)
    cum = np.concatenate([np.zeros((freq.shape[0], 1), np.int64), np.cumsum(freq, axis=1)[:, :-1]], axis=1)
    mask = (1 << scale_bits) - 1
    out = np.zeros((rows, ntok), dtype=np.int64)
    prev = {}
    for r, t, j in coding_order(rows, ntok, ways):
        p = prev.get(r, int(refs[r]))
        c = int(ctx_map[r, symbol_class(p, int(refs[r]), kbits, nclass)])
        x = states[j]
        slot = x & mask
        s = next(s for s in range(freq.shape[1]) if freq[c, s] and cum[c, s] <= slot < cum[c, s] + freq[c, s])
        x = int(freq[c, s]) * (x >> scale_bits) + slot - int(cum[c, s])
        if x < RANS_L:
            if pos >= len(w):
                raise ValueError("stream ended early")
            x = (x << 16) | w[pos]
            pos += 1
        states[j] = x
        prev[r] = s
        out[r, t] = s
    if any(x != RANS_L for x in states):
        raise ValueError("final state is not 2**16")
    if pos != len(w):
        raise ValueError("words left over")
    return out


def pack_bits_ref(values, width: int) -> bytes:
    acc, nacc, out = 0, 0, bytearray()
    for v in values.tolist():
        acc |= (int(v) & ((1 << width) - 1)) << nacc
        nacc += width
        while nacc >= 8:
            out.append(acc & 0xFF)
            acc >>= 8
            nacc -= 8
    if nacc:
        out.append(acc & 0xFF)
    return bytes(out)


def unpack_bits_ref(data: bytes, width: int, n: int) -> np.ndarray:
    out, acc, nacc, pos = [], 0, 0, 0
    for _ in range(n):
        while nacc < width:
            acc |= data[pos] << nacc
            pos += 1
            nacc += 8
        out.append(acc & ((1 << width) - 1))
        acc >>= width
        nacc -= width
    return np.array(out, dtype=np.uint64)
