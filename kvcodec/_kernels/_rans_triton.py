"""The jitted kernel of kvcodec/_kernels/rans.py (imported only when Triton is; see rans.py for what it computes)."""

import triton
import triton.language as tl


@triton.jit
def _lanes_decode_kernel(words_ptr, word_off_ptr, nwords_ptr, refs_ptr, cbase_ptr, tf_ptr, tb_ptr, ts_ptr,
                         raw_ptr, raw_off_ptr, nraw_ptr, sb_ptr, kbits_ptr, lowbits_ptr, steps_ptr, status_ptr,
                         offs_ptr, out_ptr, rows, ntok, dim, heads,
                         WAYS: tl.constexpr, NCLASS: tl.constexpr, DEQUANT: tl.constexpr):
    # one program decodes one stream (a payload's rANS words); its WAYS lanes are one vector
    s = tl.program_id(0) + tl.zeros((), dtype=tl.int64)
    lane = tl.arange(0, WAYS)
    w0 = tl.load(word_off_ptr + s)
    nw = tl.load(nwords_ptr + s)
    r0 = tl.load(raw_off_ptr + s)
    nraw = tl.load(nraw_ptr + s)
    sb = tl.load(sb_ptr + s).to(tl.int64)
    kb1 = tl.load(kbits_ptr + s).to(tl.int64) - 1
    lowbits = tl.load(lowbits_ptr + s).to(tl.int64)
    smask = (1 << sb) - 1
    mm = (1 << kb1) - 1
    lmask = (1 << lowbits) - 1
    n_sym = rows * ntok
    # initial states: 2 words per lane, high word first (the host checked nw >= 2 * WAYS)
    x = (tl.load(words_ptr + w0 + 2 * lane).to(tl.int64) << 16) | tl.load(words_ptr + w0 + 2 * lane + 1).to(tl.int64)
    pos = w0 * 0 + 2 * WAYS
    ngroups = (rows + WAYS - 1) // WAYS
    for g in range(ngroups):
        r = g * WAYS + lane
        act = r < rows
        nl = tl.minimum(rows - g * WAYS, WAYS)
        p = tl.load(refs_ptr + s * rows + r, mask=act, other=0).to(tl.int64)
        ref = p & mm
        o = (s * n_sym + (r // dim) * ntok * dim + r % dim).to(tl.int64)
        ci0 = (s * 0 + g) * WAYS * ntok  # coding index of the group's first symbol (raw bits are in coding order)
        for t in range(ntok):
            if NCLASS > 1:
                m = p & mm
                cls = (p >> kb1) * 3 + (m >= ref).to(tl.int64) + (m > ref).to(tl.int64)
            else:
                cls = p * 0
            cb = tl.load(cbase_ptr + (s * rows + r) * NCLASS + cls, mask=act, other=0).to(tl.int64)
            slot = x & smask
            f = tl.load(tf_ptr + cb + slot, mask=act, other=1).to(tl.int64)
            bias = tl.load(tb_ptr + cb + slot, mask=act, other=0).to(tl.int64)  # slot - cumulative
            sym = tl.load(ts_ptr + cb + slot, mask=act, other=0).to(tl.int64)
            xn = f * (x >> sb) + bias
            need = (xn < 65536) & act
            ni = need.to(tl.int32)
            at = pos + tl.cumsum(ni, 0) - ni  # the shared cursor: lanes refill in lane order
            w = tl.load(words_ptr + w0 + at, mask=need & (at < nw), other=0).to(tl.int64)
            x = tl.where(act, tl.where(need, (xn << 16) | w, xn), x)
            pos += tl.sum(ni, 0)
            if DEQUANT:
                h = (r // dim) % heads
                st = tl.load(steps_ptr + (s * heads + h) * dim + r % dim, mask=act, other=0.0)
                val = (sym + tl.load(offs_ptr + s)).to(tl.float32) * st
                tl.store(out_ptr + o + t * dim, val, mask=act)
            else:
                bit = (ci0 + t * nl + lane).to(tl.int64) * lowbits
                byte = bit >> 3
                acc = bit * 0
                for k in tl.static_range(5):  # lowbits + (bit & 7) <= 30 + 7 bits
                    b = tl.load(raw_ptr + r0 + byte + k, mask=act & (byte + k < nraw), other=0)
                    acc = acc | (b.to(tl.int64) << (8 * k))
                low = (acc >> (bit & 7)) & lmask
                tl.store(out_ptr + o + t * dim, (sym << lowbits) | low, mask=act)
            p = tl.where(act, sym, p)
    # status: 1 the stream ended before the last symbol, 3 a final state is not 2**16, 4 words left over
    bad_final = tl.sum((x != 65536).to(tl.int32), 0)
    code = tl.where(pos > nw, 1, tl.where(bad_final > 0, 3, tl.where(pos < nw, 4, 0)))
    tl.store(status_ptr + s, code)
