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

_STATUS = {1: "stream ended before the last symbol", 3: "a final state is not 2**16 (corrupt stream)",
           4: "words left over after the last symbol"}


def _build():
    require_triton()
    from . import _rans_triton as k

    return k._lanes_decode_kernel


def decode_tables(freq: np.ndarray, scale_bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(frequency, cumulative, symbol) of every slot of every table, ``[tables << scale_bits]`` int32 each."""
    if (freq.sum(axis=1) != 1 << scale_bits).any():
        raise ValueError(f"every table must sum to 2**{scale_bits}")
    cum = rans.cumulative(freq)
    g, nsym = freq.shape
    sym = np.concatenate([np.repeat(np.arange(nsym, dtype=np.int64), freq[c]) for c in range(g)])
    tab = np.repeat(np.arange(g), 1 << scale_bits)
    return (freq[tab, sym].astype(np.int32), cum[tab, sym].astype(np.int32), sym.astype(np.int32))


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
    words, refs, cbase, tf, tc, ts, raws = [], [], [], [], [], [], []
    word_off, nwords, raw_off, nraw, sbs, kbits, lowbits = [], [], [], [], [], [], []
    woff = roff = toff = 0
    for s in streams:
        w, rf, cm, fq, raw = rans.check_stream(s.words, s.refs, s.ctx_map, s.freq, s.scale_bits, s.ways, s.kbits,
                                               s.nclass, s.lowbits, s.raw, rows, n, offset=s.offset,
                                               raw_offset=s.raw_offset)
        f, c, y = decode_tables(fq, s.scale_bits)
        words.append(w.astype(np.int32))
        refs.append(rf.astype(np.int32))
        cbase.append(toff + (cm.astype(np.int64) << s.scale_bits))
        tf.append(f)
        tc.append(c)
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
    if steps is not None:
        st = torch.as_tensor(np.asarray(steps, dtype=np.float32).reshape(m, heads * dim)).to(device)
        offs = np.zeros(m, dtype=np.int64) if index_offsets is None else np.asarray(index_offsets, dtype=np.int64)
        out = torch.empty((m, bh, ntok, dim), dtype=torch.float32, device=device)
    else:
        out = torch.empty((m, bh, ntok, dim), dtype=torch.int64, device=device)
    args = (dev(words, np.int32), dev(np.array(word_off), np.int64), dev(np.array(nwords), np.int64),
            dev(refs, np.int32), dev(cbase, np.int64), dev(tf, np.int32), dev(tc, np.int32), dev(ts, np.int32),
            raw_all, dev(np.array(raw_off), np.int64), dev(np.array(nraw), np.int64), dev(np.array(sbs), np.int32),
            dev(np.array(kbits), np.int32), dev(np.array(lowbits), np.int32))
    if steps is None:
        kernel[(m,)](*args, status, status, out, rows, ntok, dim, heads, 0, WAYS=ways, NCLASS=nclass, DEQUANT=False)
    else:  # one launch per distinct index offset (a scalar argument)
        for o in np.unique(offs):
            sel = np.nonzero(offs == o)[0]
            part = [streams[i] for i in sel]
            if len(sel) != m:
                out[torch.from_numpy(sel).to(device)] = decode(part, shape, device=device, steps=np.asarray(
                    steps, dtype=np.float32).reshape(m, heads, dim)[sel], heads=heads, index_offsets=offs[sel])
                continue
            kernel[(m,)](*args, st.reshape(-1), status, out, rows, ntok, dim, heads, int(o), WAYS=ways,
                         NCLASS=nclass, DEQUANT=True)
    for i, code in enumerate(status.cpu().tolist()):
        if code:
            raise FormatError(f"rANS stream: {_STATUS[code]}", field="Words", offset=streams[i].offset)
    return out
