"""Numba kernels of kvcodec's interleaved, context-modelled rANS ("lane coder").

READ ME FIRST (after ryg_rans):

1. rANS is a stack: the encoder walks the symbols **backwards** and the
   decoder reads them forwards.  The encoder collects 16-bit words in emission
   order; the caller reverses them, so the stored stream is read front to back.
2. Symbols form a matrix ``[rows, tokens]`` (a row is one channel of one head).
   Rows are taken ``ways`` at a time ("a group"); inside a group the order is
   token-major, lane ``j`` (row ``g0 + j``) always uses state ``j``.  So the
   ``ways`` states are independent dependency chains the CPU can overlap, and
   each lane's previous symbol (same channel, previous token) is known when its
   next symbol is decoded: that is the context model.
3. The context of symbol ``(r, t)`` is ``ctx_map[r, cls]`` where ``cls`` is a
   class of the previous symbol of row ``r`` (see :func:`symbol_class`), and
   the first symbol of a row uses the row's reference ``ref[r]`` as its
   "previous symbol".  ``ctx_map`` picks one of the shared frequency tables.

State ``x`` lives in ``[L, 2**32)`` with ``L = 2**16``; words are 16 bits, so at
most one renormalisation per symbol; ``scale_bits`` <= 15.

Kernels never raise: they return a status code (0 = ok) and the Python wrapper
turns it into a :class:`~kvcodec.errors.FormatError`.  Decoder inputs are
untrusted: every read of the word stream is bounds-checked here, and the
wrapper validates tables, maps and references before calling.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from .._compat import llvmlite_shim

llvmlite_shim()  # numba is loaded: let vLLM's workers start beside it (kvcodec/_compat.py)

RANS_L = 1 << 16  # lower bound of the state; also the final state the decoder must reach

OK = 0
ERR_STREAM_SHORT = 1  # the word stream ended before the symbols did
ERR_BAD_INIT_STATE = 2  # an initial state below L
ERR_FINAL_STATE = 3  # a state did not return to L at the end
ERR_STREAM_LONG = 4  # words left over after the last symbol


@nb.njit(cache=True, nogil=True, inline="always")
def symbol_class(prev, ref, kbits, nclass):
    """Class of the previous symbol: 0 when ``nclass == 1``, else
    ``3 * sign + (0 if mag < ref_mag else 1 if mag == ref_mag else 2)``
    where ``sign`` is the symbol's top bit and ``mag`` the rest."""
    if nclass == 1:
        return 0
    mmask = (1 << (kbits - 1)) - 1
    sign = prev >> (kbits - 1)
    mag = prev & mmask
    rmag = ref & mmask
    if mag < rmag:
        b = 0
    elif mag == rmag:
        b = 1
    else:
        b = 2
    return sign * 3 + b


@nb.njit(cache=True, nogil=True)
def contexts(syms, refs, ctx_map, kbits, nclass, out):
    """Table id of every symbol, for the encoder: ``out[r, t]``."""
    rows, ntok = syms.shape
    for r in range(rows):
        prev = refs[r]
        for t in range(ntok):
            out[r, t] = ctx_map[r, symbol_class(prev, refs[r], kbits, nclass)]
            prev = syms[r, t]


@nb.njit(cache=True, nogil=True)
def lanes_encode(syms, ctx, refs, ctx_map, kbits, nclass, freq, cum, scale_bits, ways, out):
    """Encode the ``[rows, tokens]`` matrix ``syms``; each symbol's table is ``ctx[r, t]`` when ``ctx`` is given
    (a study's own contexts), else found on the way: ``ctx_map[r, class of the previous symbol]`` as
    :func:`contexts` computes it (``ctx`` then has 0 rows).

    Every coded symbol must have a non-zero frequency in its table (the caller guarantees it).  States stay
    below 2**32; the renormalisation is written without a branch (the word is stored every step and kept
    only when the state was too large), so ``out`` must hold ``rows * tokens + 2 * ways + 1`` words.
    Returns the number of words written, in emission order (to be reversed).
    """
    rows, ntok = syms.shape
    given = ctx.shape[0] > 0
    states = np.empty(ways, dtype=np.uint32)
    for j in range(ways):
        states[j] = RANS_L
    pos = 0
    shift = np.uint64(32 - scale_bits)  # x_max = ((L >> sb) << 16) * f = f << (32 - sb)
    sb = np.uint32(scale_bits)
    ngroups = (rows + ways - 1) // ways
    for g in range(ngroups - 1, -1, -1):
        g0 = g * ways
        lanes = min(ways, rows - g0)
        for t in range(ntok - 1, -1, -1):
            for j in range(lanes - 1, -1, -1):
                r = g0 + j
                if given:
                    c = np.int64(ctx[r, t])
                else:
                    ref = np.int64(refs[r])
                    prev = np.int64(syms[r, t - 1]) if t > 0 else ref
                    c = np.int64(ctx_map[r, symbol_class(prev, ref, kbits, nclass)])
                s = syms[r, t]
                f = np.uint32(freq[c, s])
                x = states[j]
                out[pos] = np.uint16(x & np.uint32(0xFFFF))
                big = np.uint64(x) >= (np.uint64(f) << shift)
                pos += np.int64(big)
                x = (x >> np.uint32(16)) if big else x
                q = x // f
                states[j] = (q << sb) + (x - q * f) + np.uint32(cum[c, s])
    # Flush so that, after reversal, state 0 comes first, high word first.
    for j in range(ways - 1, -1, -1):
        x = states[j]
        out[pos] = np.uint16(x & np.uint32(0xFFFF))
        out[pos + 1] = np.uint16(x >> np.uint32(16))
        pos += 2
    return pos


@nb.njit(cache=True, nogil=True)
def row_stats(syms, kbits, nclass, refs, indptr, col, val):
    """Encoder statistics of a ``[rows, tokens]`` symbol matrix, row by row: ``refs[r]``, the lower median of the
    row's magnitudes (``sym & (2**(kbits-1) - 1)``), and the counts of histogram row ``r * nclass + class`` (the
    symbols counted by the class of their previous symbol, the reference before the first) as sparse rows:
    ``indptr``, then the symbols ``col`` (ascending) and their counts ``val``.  Returns the number of entries."""
    rows, ntok = syms.shape
    nsym = 1 << kbits
    half = nsym >> 1
    hist = np.zeros(half, dtype=np.int32)
    h2 = np.zeros(nclass * nsym, dtype=np.int32)
    key = np.empty(ntok, dtype=np.int32)  # class * nsym + symbol of each token
    mags = np.empty(half, dtype=np.int64)  # the magnitudes present in the row, ascending
    need = (ntok + 1) // 2
    pos = 0
    for r in range(rows):
        for t in range(ntok):
            hist[syms[r, t] & (half - 1)] += 1
        c = 0
        ref = 0
        found = need == 0
        nm = 0
        for m in range(half):
            v = hist[m]
            if v:
                mags[nm] = m
                nm += 1
                c += v
                hist[m] = 0
                if not found and c >= need:
                    ref = m
                    found = True
        refs[r] = ref
        prev = ref
        for t in range(ntok):
            s = np.int64(syms[r, t])
            key[t] = symbol_class(prev, ref, kbits, nclass) * nsym + s
            prev = s
        for t in range(ntok):
            h2[key[t]] += 1
        # a present symbol is a present magnitude with either sign: only those are scanned, in ascending order
        for k in range(nclass):
            indptr[r * nclass + k] = pos
            for sg in range(2):
                base = k * nsym + sg * half
                for i in range(nm):
                    s = base + mags[i]
                    v = h2[s]
                    if v:
                        col[pos] = s - k * nsym
                        val[pos] = v
                        pos += 1
                        h2[s] = 0
    indptr[rows * nclass] = pos
    return pos


@nb.njit(cache=True, nogil=True)
def nearest_tables(indptr, idx, val, logq_t, out):
    """``out[r]``: the table t of least ``-sum_k val[k] * logq_t[idx[k], t]`` over sparse row r's entries k, the
    sum accumulated in entry order from 0.0, ties to the lowest t (float_ctx_rans._nearest, which also holds the
    NumPy version: both must pick the same tables)."""
    g = logq_t.shape[1]
    acc = np.empty(g, dtype=np.float64)
    for r in range(indptr.size - 1):
        acc[:] = 0.0
        for k in range(indptr[r], indptr[r + 1]):
            v = val[k]
            s = idx[k]
            for t in range(g):
                acc[t] += v * logq_t[s, t]
        best = 0
        bv = -acc[0]
        for t in range(1, g):
            c = -acc[t]
            if c < bv:
                best = t
                bv = c
        out[r] = best


@nb.njit(cache=True, nogil=True)
def normalize_counts(counts, m):
    """``rans.normalize_counts`` of non-negative int64 ``counts [nctx, nsym >= 1]`` to rows summing to ``m``: the
    NumPy formulation's frequencies (it is the python backend's reference; zero counts skip its division, whose
    result is 0), as uint32, or an empty array if a row has more than ``m`` distinct symbols."""
    nctx, nsym = counts.shape
    f = np.zeros((nctx, nsym), dtype=np.int64)
    for r in range(nctx):
        total = 0
        distinct = 0
        for s in range(nsym):
            total += counts[r, s]
            distinct += counts[r, s] > 0
        if distinct > m:
            return np.zeros(0, dtype=np.uint32).reshape(0, nsym)
        if total == 0:
            f[r, 0] = m
            continue
        fs = 0
        for s in range(nsym):
            c = counts[r, s]
            if c == 0:  # most symbols: no division
                continue
            v = (c * m) // total
            if v == 0:
                v = 1
            f[r, s] = v
            fs += v
        d = m - fs
        if d > 0:
            best = 0
            for s in range(1, nsym):
                if counts[r, s] > counts[r, best]:
                    best = s
            f[r, best] += d
        elif d < 0:
            # take mass from the largest frequencies first (a stable sort of -f), never below 1
            order = np.argsort(-f[r], kind="mergesort")
            while d < 0:
                for i in range(nsym):
                    if d == 0:
                        break
                    s = order[i]
                    if f[r, s] > 1:
                        take = min(-d, max(1, f[r, s] // 64), f[r, s] - 1)
                        f[r, s] -= take
                        d += take
    return f.astype(np.uint32)


@nb.njit(cache=True, nogil=True)
def cluster_prep(indptr, col, val, nsym):
    """The table clustering's inputs from sparse histogram rows, in one pass each (what
    ``float_ctx_rans._cluster`` computed with NumPy): ``(live, lindptr, idx, valf, mean, used)`` with ``live``
    the rows with counts, ``lindptr`` their entry offsets (and the end), ``idx`` each entry's column among the
    ``used`` symbols (those with a count anywhere, ascending), ``valf`` the counts as binary64 and ``mean`` each
    live row's count-weighted mean column (integer sums, exact in any order, then one division)."""
    nrows = indptr.size - 1
    present = np.zeros(nsym, dtype=np.bool_)
    for e in range(col.size):
        present[col[e]] = True
    colmap = np.empty(nsym, dtype=np.int64)
    nu = 0
    for s in range(nsym):
        colmap[s] = nu
        if present[s]:
            nu += 1
    used = np.empty(nu, dtype=np.int64)
    for s in range(nsym):
        if present[s]:
            used[colmap[s]] = s
    idx = np.empty(col.size, dtype=np.int64)
    valf = np.empty(col.size, dtype=np.float64)
    for e in range(col.size):
        idx[e] = colmap[col[e]]
        valf[e] = np.float64(val[e])
    nlive = 0
    for r in range(nrows):
        if indptr[r + 1] > indptr[r]:
            nlive += 1
    live = np.empty(nlive, dtype=np.int64)
    lindptr = np.empty(nlive + 1, dtype=np.int64)
    mean = np.empty(nlive, dtype=np.float64)
    i = 0
    for r in range(nrows):
        if indptr[r + 1] > indptr[r]:
            live[i] = r
            lindptr[i] = indptr[r]
            tot = 0.0
            ws = 0.0
            for e in range(indptr[r], indptr[r + 1]):
                tot += valf[e]
                ws += valf[e] * np.float64(idx[e])
            mean[i] = ws / tot
            i += 1
    lindptr[nlive] = indptr[nrows]
    return live, lindptr, idx, valf, mean, used


@nb.njit(cache=True, nogil=True)
def pack_tables(freq, out):
    """The tables on the wire (``rans.pack_tables``) into ``out`` (uint8, large enough); returns the bytes
    written, or -1 if a row has no non-zero frequency."""
    pos = 0
    for c in range(freq.shape[0]):
        lo = -1
        hi = -1
        for s in range(freq.shape[1]):
            if freq[c, s]:
                if lo < 0:
                    lo = s
                hi = s
        if lo < 0:
            return -1
        n = hi - lo
        out[pos] = lo & 0xFF
        out[pos + 1] = lo >> 8
        out[pos + 2] = n & 0xFF
        out[pos + 3] = n >> 8
        pos += 4
        for s in range(lo, hi + 1):
            f = freq[c, s]
            out[pos] = f & 0xFF
            out[pos + 1] = (f >> 8) & 0xFF
            pos += 2
    return pos


@nb.njit(cache=True, nogil=True)
def table_sums(indptr, idx, val, assign, nused, q):
    """``q[assign[r] * nused + idx[k]] += val[k]`` over sparse row r's entries k, from zeros: the symbol counts
    of each table (integer-valued binary64 sums, exact in any order)."""
    q[:] = 0.0
    for r in range(indptr.size - 1):
        base = assign[r] * nused
        for k in range(indptr[r], indptr[r + 1]):
            q[base + idx[k]] += val[k]


@nb.njit(cache=True, nogil=True)
def move_rows(indptr, idx, val, old, new, nused, q):
    """:func:`table_sums` ``q`` of ``old`` made that of ``new``: each row whose table changed has its counts taken
    from its old table and added to its new one (integer-valued binary64 sums below 2**53 stay exact, so ``q`` is
    the same as :func:`table_sums` of ``new`` computes)."""
    for r in range(indptr.size - 1):
        a, b = old[r], new[r]
        if a != b:
            for k in range(indptr[r], indptr[r + 1]):
                q[a * nused + idx[k]] -= val[k]
                q[b * nused + idx[k]] += val[k]


@nb.njit(cache=True, nogil=True)
def pack_coding_order(words3, width, ways, out):
    """:func:`pack_bits` of the low ``width`` bits (``<= 32``) of the ``[rows, tokens]`` matrix whose row
    ``bh * D + d`` is ``words3[bh, :, d]``, taken in coding order (groups of ``ways`` rows, token-major), read in
    place (any strides).  Groups are taken within each ``bh``, so ``D % ways`` must be 0 when ``BH > 1`` (a
    ``[rows, tokens]`` matrix is the view ``[1, tokens, rows]``: its last group may be partial).  ``out`` (uint8)
    needs ``ceil(n * width / 8)`` bytes rounded up to a multiple of 4 (whole 32-bit words are stored).  Returns
    the bytes the packed stream has (the last one zero-padded)."""
    bh, ntok, dim = words3.shape
    out32 = out.view(np.uint32)
    acc = np.uint64(0)
    nacc = np.uint64(0)
    pos = 0
    m = np.uint64((1 << width) - 1)
    w = np.uint64(width)
    for b in range(bh):
        for d0 in range(0, dim, ways):
            lanes = min(ways, dim - d0)
            for t in range(ntok):
                for j in range(lanes):
                    acc |= (np.uint64(words3[b, t, d0 + j]) & m) << nacc
                    nacc += w
                    if nacc >= np.uint64(32):
                        out32[pos] = np.uint32(acc & np.uint64(0xFFFFFFFF))
                        pos += 1
                        acc >>= np.uint64(32)
                        nacc -= np.uint64(32)
    nbytes = 4 * pos
    while nacc > np.uint64(0):
        out[nbytes] = np.uint8(acc & np.uint64(0xFF))
        nbytes += 1
        acc >>= np.uint64(8)
        nacc = nacc - np.uint64(8) if nacc > np.uint64(8) else np.uint64(0)
    return nbytes


@nb.njit(cache=True, nogil=True)
def build_decode_tables(freq, cum, entry, sym):
    """``entry[c, slot] = freq << 16 | (slot - cum)`` and ``sym[c, slot]``."""
    for c in range(freq.shape[0]):
        for s in range(freq.shape[1]):
            f = freq[c, s]
            b = cum[c, s]
            for k in range(f):
                entry[c, b + k] = (f << 16) | k
                sym[c, b + k] = s


@nb.njit(cache=True, nogil=True)
def dense_decode_inputs(freq, scale_bits, words, ways, raw):
    """What the dense-table decoders (``decode_w4/8``, :func:`lanes_decode_fused`) take, made in one call:
    ``(ok, entry, symt, padded, raw64)``: :func:`build_decode_tables`' tables of ``freq`` (uint32, each row
    summing to ``2**scale_bits``: ``ok`` False, and nothing built, when a row sums to more), ``words`` followed
    by ``ways`` zero words, and the raw bytes as little-endian 64-bit words followed by two zero words."""
    nctx, nsym = freq.shape
    m = 1 << scale_bits
    entry = np.zeros((nctx, m), dtype=np.uint32)
    symt = np.zeros((nctx, m), dtype=np.uint16)
    n = words.shape[0]
    padded = np.zeros(n + ways, dtype=np.uint16)
    raw64 = np.zeros((raw.shape[0] + 7) // 8 + 2, dtype=np.uint64)
    cum = np.zeros((nctx, nsym), dtype=np.uint32)
    for c in range(nctx):
        total = 0
        for s in range(nsym):
            cum[c, s] = total
            total += np.int64(freq[c, s])
        if total > m:
            return False, entry, symt, padded, raw64
    build_decode_tables(freq, cum, entry, symt)
    padded[:n] = words
    r8 = raw64.view(np.uint8)
    r8[:raw.shape[0]] = raw
    return True, entry, symt, padded, raw64


@nb.njit(cache=True, nogil=True)
def build_local_tables(freq, scale_bits, slot8, info):
    """The local tables of the ``fast_w*`` decoders: ``slot8[c << scale_bits | slot]`` = the index of the slot's
    symbol among table c's symbols of non-zero frequency (in symbol order), ``info[c << 8 | index]`` = ``freq |
    cum << 16 | symbol << 32``.  Returns False (tables left partly built) when a table has more than 256
    symbols, which ``info`` cannot index."""
    for c in range(freq.shape[0]):
        li = 0
        cum = 0
        base = c << scale_bits
        for s in range(freq.shape[1]):
            f = freq[c, s]
            if f == 0:
                continue
            if li == 256:
                return False
            info[(c << 8) | li] = np.uint64(f) | (np.uint64(cum) << np.uint64(16)) | (np.uint64(s) << np.uint64(32))
            for k in range(f):
                slot8[base + cum + k] = li
            cum += f
            li += 1
    return True


@nb.njit(cache=True, nogil=True, inline="always")
def _table_head(buf, pos, nsym):
    """``(code, Lo, Count)`` of the table whose fields start at byte ``pos`` (spec "rANS stream"): code 0, or 1
    when it ends early (its fields or its frequencies past the buffer; Lo and Count then 0), or 2 when its
    symbols ``Lo .. Lo + Count - 1`` pass the alphabet of ``nsym``."""
    n = buf.shape[0]
    if pos + 4 > n:
        return 1, 0, 0
    lo = np.int64(buf[pos]) | (np.int64(buf[pos + 1]) << 8)
    cnt = (np.int64(buf[pos + 2]) | (np.int64(buf[pos + 3]) << 8)) + 1
    if lo + cnt > nsym:
        return 2, lo, cnt
    if pos + 4 + 2 * cnt > n:
        return 1, 0, 0
    return 0, lo, cnt


@nb.njit(cache=True, nogil=True)
def unpack_tables(buf, scale_bits, freq):
    """Parse ``freq.shape[0]`` frequency tables (spec "rANS stream": per context Lo u16, Count_Minus_One u16,
    Count u16 frequencies, little-endian) into ``freq`` (zeroed by the caller).  Returns (code, context, a, b):
    0 ok; 1 table ``context`` ends early; 2 its symbols a..b lie outside the alphabet; 3 it sums to a; 4 ``a``
    bytes are left over."""
    nctx, nsym = freq.shape
    pos = 0
    n = buf.shape[0]
    for c in range(nctx):
        code, lo, cnt = _table_head(buf, pos, nsym)
        if code:
            return code, c, lo, lo + cnt if code == 2 else 0
        pos += 4
        total = 0
        for k in range(cnt):
            f = np.int64(buf[pos + 2 * k]) | (np.int64(buf[pos + 2 * k + 1]) << 8)
            freq[c, lo + k] = f
            total += f
        pos += 2 * cnt
        if total != 1 << scale_bits:
            return 3, c, total, 0
    if pos != n:
        return 4, 0, n - pos, 0
    return 0, 0, 0, 0


@nb.njit(cache=True, nogil=True)
def packed_local_tables(buf, nsym, scale_bits, direct, table, slot8, info):
    """:func:`unpack_tables` of ``table.shape[0] >> scale_bits`` (direct) or ``slot8.shape[0] - 4 >>
    scale_bits`` tables and the vector decoders' tables built from them in the same pass, without the dense
    frequencies: with ``direct`` the one-level ``table`` (as :func:`build_direct_table`), else ``slot8`` and
    ``info`` (as :func:`build_local_tables`).  Returns ``unpack_tables``' (code, context, a, b) with the same
    codes and values for the same bytes (a sum is reported whole; no slot past a table's ``2**scale_bits`` is
    written), code 5 when table ``context`` has more than 256 symbols (a valid stream for the other decoders;
    the tables are then left partly built), and -1 when ``info`` is too short for the tables (a caller's error).

    A table's frequencies are mostly zeros (SmolLM2 bf16: ~50 symbols in a span of ~730), so they are read in
    blocks of 8 and a block of zeros is skipped after one test; the tests and the fills index through slices
    (non-negative offsets, no wraparound test), which LLVM vectorises (~3x faster than unpacking, then
    building)."""
    m = 1 << scale_bits
    nctx = (table.shape[0] if direct else slot8.shape[0] - 4) >> scale_bits
    if not direct and info.shape[0] < nctx << 8:
        return -1, 0, 0, 0  # the caller's arrays do not fit (no file is at fault)
    sb = np.uint32(scale_bits)
    pos = 0
    n = buf.shape[0]
    for c in range(nctx):
        code, lo, cnt = _table_head(buf, pos, nsym)
        if code:
            return code, c, lo, lo + cnt if code == 2 else 0
        pos += 4
        fb = buf[pos:pos + 2 * cnt]
        tab = table[c << scale_bits:(c + 1) << scale_bits]
        slots = slot8[c << scale_bits:(c + 1) << scale_bits]
        cum = 0
        li = 0
        k = 0
        while k < cnt:
            kend = min(k + 8, cnt)
            if kend - k == 8:
                z = np.uint8(0)
                for j in range(16):
                    z |= fb[2 * k + j]
                if z == 0:
                    k = kend
                    continue
            for kk in range(k, kend):
                f = np.int64(fb[2 * kk]) | (np.int64(fb[2 * kk + 1]) << 8)
                if f == 0:
                    continue
                if cum + f <= m:
                    if direct:
                        e = np.uint32(f - 1) | (np.uint32(lo + kk) << (sb + sb))
                        t = tab[cum:cum + f]
                        for j in range(t.shape[0]):
                            t[j] = e | (np.uint32(j) << sb)
                    elif li < 256:
                        info[(c << 8) | li] = (np.uint64(f) | (np.uint64(cum) << np.uint64(16))
                                               | (np.uint64(lo + kk) << np.uint64(32)))
                        t8 = slots[cum:cum + f]
                        for j in range(t8.shape[0]):
                            t8[j] = li
                cum += f
                li += 1
            k = kend
        pos += 2 * cnt
        if cum != m:
            return 3, c, cum, 0
        if li > 256:
            return 5, c, li, 0
    if pos != n:
        return 4, 0, n - pos, 0
    return 0, 0, 0, 0


@nb.njit(cache=True, nogil=True)
def max_symbols(freq):
    """The most non-zero entries in one row of ``freq`` (``np.count_nonzero(freq, axis=1).max()``, 0 for no
    rows)."""
    best = 0
    for c in range(freq.shape[0]):
        n = 0
        for s in range(freq.shape[1]):
            n += freq[c, s] != 0
        best = max(best, n)
    return best


@nb.njit(cache=True, nogil=True)
def build_direct_table(freq, scale_bits, table):
    """The vector decoder's one-level table: ``table[c << scale_bits | slot]`` = ``freq - 1 | (slot - cum) <<
    scale_bits | symbol << 2 scale_bits`` of the symbol that owns the slot in table c (needs ``2 scale_bits +
    kbits <= 32``)."""
    sb = np.uint32(scale_bits)
    for c in range(freq.shape[0]):
        cum = 0
        base = c << scale_bits
        for s in range(freq.shape[1]):
            f = freq[c, s]
            if f == 0:
                continue
            e = np.uint32(f - 1) | (np.uint32(s) << (sb + sb))
            for k in range(f):
                table[base + cum + k] = e | (np.uint32(k) << sb)
            cum += f


@nb.njit(cache=True, nogil=True)
def lanes_decode_tail(words, nwords, pos, states, start_row, refs, ctx_map, entry, symt, scale_bits, kbits, nclass,
                      lowbits, raw, rp, acc, nacc, out):
    """Fused decode of the groups from ``start_row`` on, any number of ways.

    Decodes each symbol, takes the next ``lowbits`` raw bits, and writes the
    assembled word to ``out[bh, t, d]`` for row ``r = bh * dim + d``.  The
    renormalisation is branch-free (a data-dependent branch mispredicts on
    every other symbol: 123 -> 183 MB/s measured), so ``words`` must carry
    ``ways`` zero words of padding after its ``nwords`` real ones, and ``raw``
    8 zero bytes.  Returns ``(status, pos, rp)``; on success the caller checks
    ``pos == nwords`` and that ``rp`` used exactly the raw bytes.
    """
    bh_n, ntok, dim = out.shape
    rows = bh_n * dim
    ways = states.shape[0]
    prev = np.empty(ways, dtype=np.int64)
    rref = np.empty(ways, dtype=np.int64)
    base = np.empty(ways, dtype=np.int64)
    mask = np.uint64((1 << scale_bits) - 1)
    sb = np.uint64(scale_bits)
    lo = np.uint64(RANS_L)
    kb1 = kbits - 1
    mm = (1 << kb1) - 1
    use_cls = 1 if nclass > 1 else 0
    lmask = np.uint64((1 << lowbits) - 1)
    lb = np.uint64(lowbits)
    flat = out.reshape(bh_n * ntok * dim)
    for g0 in range(start_row, rows, ways):
        lanes = min(ways, rows - g0)
        for j in range(lanes):
            r = g0 + j
            prev[j] = refs[r]
            rref[j] = refs[r] & mm
            base[j] = (r // dim) * ntok * dim + r % dim
        for t in range(ntok):
            for j in range(lanes):
                pv = prev[j]
                g = pv & mm
                c = ctx_map[g0 + j, ((pv >> kb1) * 3 + (g >= rref[j]) + (g > rref[j])) * use_cls]
                x = states[j]
                slot = x & mask
                e = entry[c, slot]
                s = np.int64(symt[c, slot])
                x = np.uint64(e >> 16) * (x >> sb) + np.uint64(e & 0xFFFF)
                n = np.uint64(x < lo)
                x = (x << (n << np.uint64(4))) | (np.uint64(words[pos]) & (np.uint64(0) - n))
                pos += np.int64(n)
                states[j] = x
                prev[j] = s
                while nacc < lowbits:
                    acc |= np.uint64(raw[rp]) << np.uint64(nacc)
                    rp += 1
                    nacc += 8
                flat[base[j] + t * dim] = (np.uint64(s) << lb) | (acc & lmask)
                acc >>= lb
                nacc -= lowbits
            if pos > nwords:
                return ERR_STREAM_SHORT, pos, rp
    for j in range(ways):
        if states[j] != lo:
            return ERR_FINAL_STATE, pos, rp
    if pos != nwords:
        return ERR_STREAM_LONG, pos, rp
    return OK, pos, rp


@nb.njit(cache=True, nogil=True)
def lanes_decode_fused(words, nwords, ways, refs, ctx_map, entry, symt, scale_bits, kbits, nclass, lowbits, raw, out):
    """Generic-``ways`` fused decoder (see :func:`lanes_decode_tail`)."""
    states = np.empty(ways, dtype=np.uint64)
    for j in range(ways):
        states[j] = (np.uint64(words[2 * j]) << np.uint64(16)) | np.uint64(words[2 * j + 1])
    return lanes_decode_tail(words, nwords, 2 * ways, states, 0, refs, ctx_map, entry, symt, scale_bits, kbits,
                             nclass, lowbits, raw, 0, np.uint64(0), 0, out)
