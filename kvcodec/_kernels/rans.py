"""Triton entropy decoder of kvcodec's interleaved rANS streams (spec/kvz.md section 8), bit-exact with the
CPU decoders (:func:`kvcodec.entropy.rans.lanes_decode`), optionally fused with ``vq_rans`` Method 5's
dequantization.

* :func:`decode` — streams of one shape and a power-of-two ``Ways`` (the lane vector; other lane counts
  decode on the CPU) (a ``float_ctx_rans`` payload's coded part, parsed by
  :func:`kvcodec.codecs.float_ctx_rans.parse_symbols`) -> output words ``symbol << lowbits | raw low bits``
  (int64), or with ``steps`` (Method 5) the dequantized values ``float32(symbol + offset) * step[h][d]``.

One program decodes one stream; its ``Ways`` lanes are one vector.  The lanes share one word cursor (the
bitstream as it is): at each token every lane decodes its symbol, and the lanes that need a new word take
consecutive words in lane order, at the cursor plus the exclusive prefix sum of the lanes' needs — exactly the
order in which the sequential decoder reads them.  Lane groups follow each other within a stream (a group's
words start where the previous group's ended), so a stream's parallelism is its lanes; a launch decodes many
streams at once (a cache's sections).  Everything is integer arithmetic except Method 5's one binary32
product, so the result is the CPU decoder's on every device; corrupt streams report the CPU decoder's status
codes (the host raises the same :class:`~kvcodec.errors.FormatError`).  On CPU tensors it runs under
``TRITON_INTERPRET=1`` (how the tests check it).
"""

from __future__ import annotations

import numpy as np
import torch

from kvcodec.entropy import rans
from kvcodec.errors import FormatError

from . import require_triton


def _build():
    require_triton()
    from . import _rans_triton as k

    return k._lanes_decode_kernel


def decode_tables(freq: np.ndarray, scale_bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(frequency, slot − cumulative, symbol) of every slot of every table, ``[tables << scale_bits]`` int32 each:
    the CPU decoder's tables (``build_decode_tables``), split into the three fields the kernel gathers."""
    from kvcodec.entropy._rans_numba import build_decode_tables

    if (freq.sum(axis=1) != 1 << scale_bits).any():
        raise ValueError(f"every table must sum to 2**{scale_bits}")
    entry = np.zeros((freq.shape[0], 1 << scale_bits), dtype=np.uint32)
    sym = np.zeros((freq.shape[0], 1 << scale_bits), dtype=np.uint16)
    build_decode_tables(np.ascontiguousarray(freq, dtype=np.uint32), rans.cumulative(freq), entry, sym)
    entry = entry.reshape(-1)
    return (entry >> 16).astype(np.int32), (entry & 0xFFFF).astype(np.int32), sym.reshape(-1).astype(np.int32)


def decode(streams: list[rans.Stream], shape: tuple[int, int, int], *, device="cpu", steps=None,
           heads: int = 1, index_offsets=None) -> torch.Tensor:
    """Decode ``streams`` (same ``Ways`` and ``Num_Classes``), each into ``shape`` = ``[bh, tokens, dim]``:
    int64 words ``[len(streams), bh, tokens, dim]``; or, with ``steps`` (float32 ``[len(streams), heads, dim]``,
    Method 5), float32 values ``float32(symbol + index_offsets[i]) * steps[i][h][d]`` where ``h`` is the
    row's head (``(row // dim) % heads``).  Every stream is checked first (:func:`rans.check_stream`)."""
    kernel = _build()
    bh, ntok, dim = shape
    rows, n = bh * dim, bh * ntok * dim
    if not streams:
        return torch.empty((0, bh, ntok, dim), dtype=torch.float32 if steps is not None else torch.int64)
    ways, nclass = streams[0].ways, streams[0].nclass
    if any(s.ways != ways or s.nclass != nclass for s in streams):
        raise ValueError("one launch decodes streams of one Ways and Num_Classes")
    if ways & (ways - 1):
        raise ValueError(f"the Triton decoder needs a power-of-two Ways, not {ways}")
    if steps is not None and any(s.lowbits for s in streams):
        raise ValueError("Method 5 dequantization takes index streams (no raw low bits)")
    words, refs, cbase, tf, tb, ts, raws = [], [], [], [], [], [], []
    word_off, nwords, raw_off, nraw, sbs, kbits, lowbits = [], [], [], [], [], [], []
    woff = roff = toff = 0
    for s in streams:
        w, rf, cm, fq, raw = rans.check_stream(s.words, s.refs, s.ctx_map, s.freq, s.scale_bits, s.ways, s.kbits,
                                               s.nclass, s.lowbits, s.raw, rows, n, offset=s.offset,
                                               raw_offset=s.raw_offset)
        f, bias, y = decode_tables(fq, s.scale_bits)
        words.append(w.astype(np.int32))
        refs.append(rf.astype(np.int32))
        cbase.append(toff + (cm.astype(np.int64) << s.scale_bits))
        tf.append(f)
        tb.append(bias)
        ts.append(y)
        raws.append(raw.astype(np.int32))
        word_off.append(woff)
        nwords.append(w.size)
        raw_off.append(roff)
        nraw.append(raw.size)
        sbs.append(s.scale_bits)
        kbits.append(s.kbits)
        lowbits.append(s.lowbits)
        woff += w.size
        roff += raw.size
        toff += f.size

    def dev(a, dtype):
        return torch.from_numpy(np.ascontiguousarray(np.concatenate(a) if isinstance(a, list) else a)
                                .astype(dtype)).to(device)

    m = len(streams)
    raw_all = dev(raws, np.int32) if roff else torch.zeros(1, dtype=torch.int32, device=device)
    status = torch.zeros(m, dtype=torch.int32, device=device)
    dequant = steps is not None
    if dequant:
        st = torch.as_tensor(np.asarray(steps, dtype=np.float32).reshape(-1)).to(device)
        offs = dev(np.zeros(m) if index_offsets is None else np.asarray(index_offsets), np.int64)
    else:
        st = offs = status  # not read
    out = torch.empty((m, bh, ntok, dim), dtype=torch.float32 if dequant else torch.int64, device=device)
    args = (dev(words, np.int32), dev(np.array(word_off), np.int64), dev(np.array(nwords), np.int64),
            dev(refs, np.int32), dev(cbase, np.int64), dev(tf, np.int32), dev(tb, np.int32), dev(ts, np.int32),
            raw_all, dev(np.array(raw_off), np.int64), dev(np.array(nraw), np.int64), dev(np.array(sbs), np.int32),
            dev(np.array(kbits), np.int32), dev(np.array(lowbits), np.int32))
    kernel[(m,)](*args, st, status, offs, out, rows, ntok, dim, heads, WAYS=ways, NCLASS=nclass, DEQUANT=dequant)
    for i, code in enumerate(status.cpu().tolist()):
        if code:
            raise FormatError(f"rANS stream: {rans.STREAM_STATUS[code]}", field="Words", offset=streams[i].offset)
    return out
