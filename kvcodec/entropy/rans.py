"""Static-table, interleaved rANS with shared, context-selected frequency tables.

Public, validated wrappers around the Numba kernels (:mod:`._rans_numba`) and
the pure-Python reference (:mod:`._rans_ref`).  The wire format of a coded
stream is in ``spec/kvz.md`` ("rANS stream").  What is *not* on the wire is
how the encoder turns counts into frequencies (:func:`normalize_counts`):
any table whose rows sum to ``2**scale_bits`` decodes.

Backend choice: ``KVCODEC_BACKEND=python`` forces the reference coder
(tests use it to prove byte-identity); the default is ``numba``.
"""

from __future__ import annotations

import os
import struct
import threading
from typing import NamedTuple

import numpy as np

from .. import scratch
from ..errors import FormatError

__all__ = [
    "MIN_SCALE_BITS", "MAX_SCALE_BITS", "MAX_WAYS", "normalize_counts", "cumulative",
    "contexts", "lanes_encode", "lanes_decode", "coding_order", "pack_bits", "packed_size",
    "pack_tables", "unpack_tables", "max_tables_bytes", "backend", "decode_kernel", "row_stats", "SparseCounts",
    "pack_low_bits", "rows_of", "lanes_decode_many", "vector_kernels", "ENCODE_SYMBOLS", "KERNEL_SYMBOLS",
    "nearest_tables", "table_chooser", "Parsed",
]

MIN_SCALE_BITS = 8
MAX_SCALE_BITS = 15  # <= 16 is what the 32-bit state / 16-bit word design allows
MAX_WAYS = 32


def backend() -> str:
    """The active coder backend: ``"numba"`` (default) or ``"python"``."""
    b = os.environ.get("KVCODEC_BACKEND", "numba").lower()
    if b not in ("numba", "python"):
        raise ValueError(f"KVCODEC_BACKEND must be 'numba' or 'python', not {b!r}")
    return b


def normalize_counts(counts: np.ndarray, scale_bits: int) -> np.ndarray:
    """Turn per-context symbol counts ``[nctx, nsym]`` into frequencies.

    Each row sums to ``2**scale_bits``; every symbol with a non-zero count gets
    a frequency of at least 1.  Deterministic (encoder-only: the decoder reads
    the frequencies, never recomputes them).  Rows with no counts get all
    their mass on symbol 0.
    """
    counts = np.asarray(counts, dtype=np.int64)
    m = 1 << scale_bits
    nsym = counts.shape[1]
    if counts.size and int(counts.min()) < 0 or nsym == 0 and counts.shape[0]:
        raise ValueError("counts must be non-negative, over at least one symbol")
    if backend() == "numba":  # the same frequencies, compiled
        from ._rans_numba import normalize_counts as _normalize

        f = _normalize(np.ascontiguousarray(counts), m)
        if f.shape[0] == counts.shape[0]:
            return f
    total = counts.sum(axis=1, keepdims=True)
    if np.any((counts > 0).sum(axis=1) > m):
        raise ValueError(f"more distinct symbols than 2**{scale_bits} in one context")
    safe_total = np.maximum(total, 1)
    f = (counts * m) // safe_total
    f[(counts > 0) & (f == 0)] = 1
    f[total[:, 0] == 0, 0] = m
    diff = m - f.sum(axis=1)
    for r in np.nonzero(diff)[0]:
        row = f[r]
        d = int(diff[r])
        if d > 0:
            row[int(np.argmax(counts[r]))] += d
            continue
        # take mass from the largest frequencies first, never below 1
        order = np.argsort(-row, kind="stable")
        while d < 0:
            for s in order:
                if d == 0:
                    break
                if row[s] > 1:
                    take = min(-d, max(1, int(row[s]) // 64), int(row[s]) - 1)
                    row[s] -= take
                    d += take
    assert f.shape[1] == nsym
    return f.astype(np.uint32)


def cumulative(freq: np.ndarray) -> np.ndarray:
    """Exclusive prefix sums of each row."""
    freq = freq.astype(np.uint32)
    cum = np.zeros_like(freq)
    np.cumsum(freq[:, :-1], axis=1, out=cum[:, 1:])
    return cum


def _check_args(scale_bits: int, ways: int):
    if not MIN_SCALE_BITS <= scale_bits <= MAX_SCALE_BITS:
        raise ValueError(f"scale_bits must be in [{MIN_SCALE_BITS}, {MAX_SCALE_BITS}], not {scale_bits}")
    if not 1 <= ways <= MAX_WAYS:
        raise ValueError(f"ways must be in [1, {MAX_WAYS}], not {ways}")


def contexts(syms, refs, ctx_map, kbits: int, nclass: int) -> np.ndarray:
    """Table id of every symbol of the ``[rows, tokens]`` matrix (encoder side)."""
    from ._rans_numba import contexts as _contexts

    out = np.empty(syms.shape, dtype=np.int32)
    _contexts(np.ascontiguousarray(syms), np.ascontiguousarray(refs), np.ascontiguousarray(ctx_map),
              kbits, nclass, out)
    return out


def lanes_encode(syms, refs, ctx_map, freq, scale_bits: int, ways: int, kbits: int, nclass: int,
                 ctx=None) -> np.ndarray:
    """Encode a ``[rows, tokens]`` symbol matrix; returns uint16 words in reading order.

    ``syms`` may also be a ``[BH, tokens, D]`` array whose row ``bh * D + d`` is ``syms[bh, :, d]`` (a cache's
    own layout): with ``D % ways == 0`` a lane group's symbols at one token are then adjacent and the vector
    encoder (:mod:`._encode_simd`) reads them in place; the words are the same either way.  ``ctx`` (the table id
    of each symbol, ``[rows, tokens]``) may be passed when the caller already computed it with :func:`contexts`.
    """
    _check_args(scale_bits, ways)
    syms = np.ascontiguousarray(syms, dtype=np.uint16)
    freq = np.ascontiguousarray(freq, dtype=np.uint32)
    if syms.ndim == 3:
        bh, ntok, dim = syms.shape
        if ctx is None and backend() == "numba" and freq.shape[0] <= 256 and _vector_encoder(ways, ntok, dim):
            from . import _encode_simd

            _count(f"vector_w{ways}", syms.size, ENCODE_SYMBOLS)
            return _encode_simd.encode(syms, refs, ctx_map, freq, cumulative(freq), scale_bits, ways, kbits, nclass)
        syms = rows_of(syms)
    if backend() == "python":
        from ._rans_ref import lanes_encode_ref

        _count("python", syms.size, ENCODE_SYMBOLS)
        return lanes_encode_ref(syms, refs, ctx_map, freq, scale_bits, ways, kbits, nclass)
    from ._rans_numba import lanes_encode as _enc

    _count(f"scalar_w{ways}", syms.size, ENCODE_SYMBOLS)
    out = np.empty(syms.size + 2 * ways + 1, dtype=np.uint16)
    ctx = np.zeros((0, 0), np.int32) if ctx is None else np.ascontiguousarray(ctx, dtype=np.int32)
    nw = _enc(syms, ctx, np.ascontiguousarray(refs), np.ascontiguousarray(ctx_map), kbits, nclass, freq,
              cumulative(freq), scale_bits, ways, out)
    return out[:nw][::-1].copy()


def _vector_encoder(ways: int, ntok: int, dim: int) -> bool:
    """Whether the vector encoder takes a ``[BH, ntok, dim]`` matrix: 2..32 lanes (one lane has nothing to
    vectorise), lane groups inside one head, at least one token, and ``KVCODEC_VECTOR`` not 0 (as for the
    decoders: the scalar Numba encoder writes the same words)."""
    if not (2 <= ways and ntok >= 1 and dim % ways == 0 and vector_kernels()):
        return False
    from . import _encode_simd

    return _encode_simd.available(ways)


def nearest_tables(indptr: np.ndarray, idx: np.ndarray, val: np.ndarray, logq: np.ndarray) -> np.ndarray:
    """For each sparse row (``indptr``, column ``idx``, count ``val``) the table ``t`` of least code length
    ``-sum_k val[k] * logq[t, idx[k]]``, summed in entry order from 0.0, ties to the lowest ``t``: the vector
    kernel (:mod:`._encode_simd`, a row's tables as one vector) or the Numba loop, the same sums either way.
    ``logq`` must be finite (``ValueError``)."""
    if not np.isfinite(logq).all():
        raise ValueError("nearest_tables: logq has a non-finite entry")
    return table_chooser(indptr, idx, val, logq.shape[0], logq.shape[1])(logq)


def table_chooser(indptr: np.ndarray, idx: np.ndarray, val: np.ndarray, g: int, used: int):
    """:func:`nearest_tables` for these rows and ``g`` tables of ``used`` symbols, as a function of ``logq``
    (``[g, used]``, finite: not checked at each step) that k-means calls at every step: the rows' arrays copied,
    converted and checked and the kernel and its buffer chosen once."""
    if vector_kernels():
        from . import _encode_simd

        if _encode_simd.nearest_usable(g):
            # rows of whole vectors on 64-byte boundaries (a row split across cache lines costs two loads)
            width = _encode_simd.padded_tables(g)
            logq_p = scratch.aligned(8 * used * width, zero=True).view(np.float64).reshape(used, width)
            run = _encode_simd.table_choice(indptr, idx, val, logq_p, g)

            def choose(logq: np.ndarray) -> np.ndarray:
                logq_p[:, :g] = logq.T
                return run()
            return choose
    from ._encode_simd import checked_rows
    from ._rans_numba import nearest_tables as _near

    indptr, idx, val = checked_rows(indptr, idx, val, used)

    def choose_numba(logq: np.ndarray) -> np.ndarray:
        out = np.empty(max(indptr.size - 1, 0), dtype=np.int64)
        _near(indptr, idx, val, np.ascontiguousarray(logq.T), out)
        return out
    return choose_numba


#: symbols coded by each encoder kernel in this process: ``kvz bench`` reports which ran
ENCODE_SYMBOLS: dict[str, int] = {}


#: the lane decoders' status codes (the CPU kernels' and the Triton one's) and what they mean
STREAM_STATUS = {
    1: "stream ended before the last symbol",
    2: "an initial state is below 2**16",
    3: "a final state is not 2**16 (corrupt stream)",
    4: "words left over after the last symbol",
}


def coding_order(a: np.ndarray, ways: int) -> np.ndarray:
    """Elements of a ``[rows, tokens]`` matrix in coding order (groups of ``ways`` rows, token-major)."""
    rows, ntok = a.shape
    full = rows - rows % ways
    head = a[:full].reshape(full // ways, ways, ntok).transpose(0, 2, 1).ravel()
    return np.concatenate([head, a[full:].T.ravel()])


class Parsed(NamedTuple):
    """Two views ``parse_symbols`` made for a :class:`Stream`, which the vector kernels read in place: ``ahead``,
    the words followed by the ``ways + 2`` words after them in the payload (``None`` when the raw bits after
    them do not hold that many), and ``ctx``, the context map followed by 3 bytes of the tables after it in the
    decompressed side information; with the stream's own ``words`` and ``ctx_map`` arrays and its ``fields``
    ``(scale_bits, ways, kbits, nclass, lowbits)`` as parsed (a stream whose words, map or fields were replaced
    since is not read through them)."""

    words: np.ndarray
    ctx_map: np.ndarray
    fields: tuple
    ahead: np.ndarray | None
    ctx: np.ndarray


class Stream(NamedTuple):
    """One coded symbol stream as a payload holds it (``float_ctx_rans.parse_symbols``): what a lane decoder
    takes, and where its words and raw bits sit in the file (error messages)."""

    words: np.ndarray
    refs: np.ndarray
    ctx_map: np.ndarray
    freq: np.ndarray
    scale_bits: int
    ways: int
    kbits: int
    nclass: int
    lowbits: int
    raw: object
    offset: int | None = None
    raw_offset: int | None = None
    #: the frequency tables as the payload packs them, when ``freq`` is ``None`` (``parse_symbols(...,
    #: dense=False)``: the vector decoders' tables are built from them in one pass, :func:`lanes_decode_many`)
    tables: np.ndarray | None = None
    ntables: int = 0
    tables_offset: int | None = None
    #: set by ``parse_symbols`` (:class:`Parsed`)
    parsed: "Parsed | None" = None

    def dense(self) -> "Stream":
        """This stream with its dense frequency tables (:func:`unpack_tables`; raises :class:`FormatError` for
        invalid ones)."""
        if self.freq is not None:
            return self
        freq = unpack_tables(self.tables, self.ntables, 1 << self.kbits, self.scale_bits, field="Side",
                             offset=self.tables_offset)
        return self._replace(freq=freq, tables=None)


def check_stream(words, refs, ctx_map, freq, scale_bits: int, ways: int, kbits: int, nclass: int, lowbits: int,
                 raw, rows: int, n: int, *, field: str = "Words", offset: int | None = None,
                 raw_offset: int | None = None, ranges: bool = True):
    """Check what a lane decoder indexes by and the stream's fixed facts (:class:`FormatError`): at least
    ``2 * ways`` words with initial states >= 2**16, refs and map entries in range (unless not ``ranges``: the
    caller checked them against the tables' count, as ``parse_symbols`` does), ``raw`` exactly
    ``packed_size(n, lowbits)`` bytes with zero padding bits.  Returns (words uint16, refs uint16, ctx_map uint8,
    freq uint32, raw uint8) as the kernels take them (the CPU kernels and the Triton one; ``freq`` may be
    ``None`` only without ``ranges``, and is returned as it is then)."""
    _check_args(scale_bits, ways)
    words = np.ascontiguousarray(words, dtype=np.uint16)
    nwords = words.shape[0]
    if nwords < 2 * ways:
        raise FormatError(f"rANS stream: {STREAM_STATUS[1]}", field=field, offset=offset)
    if not words[0:2 * ways:2].all():  # an initial state (high word << 16 | low word) below 2**16
        raise FormatError(f"rANS stream: {STREAM_STATUS[2]}", field=field, offset=offset)
    raw = np.frombuffer(raw, dtype=np.uint8)
    refs = np.ascontiguousarray(refs, dtype=np.uint16)
    ctx_map = np.ascontiguousarray(ctx_map, dtype=np.uint8)
    if refs.shape != (rows,) or ctx_map.shape != (rows, nclass) or nclass not in (1, 6) or not 2 <= kbits <= 16:
        raise ValueError(f"refs {refs.shape} / ctx_map {ctx_map.shape} do not fit {rows} rows and {nclass} classes")
    if raw.shape[0] != packed_size(n, lowbits):
        raise FormatError(f"raw bits: {raw.shape[0]} bytes, {packed_size(n, lowbits)} expected", field="Raw_Bits",
                          offset=raw_offset)
    if ranges and rows and (int(refs.max()) >> (kbits - 1) or int(ctx_map.max()) >= freq.shape[0]):
        raise FormatError("a reference or a context map entry is out of range", field=field, offset=offset)
    used = (n * lowbits) % 8
    if used and int(raw[-1]) >> used:
        raise FormatError("raw bits: padding bits of the last byte are not zero", field="Raw_Bits",
                          offset=raw_offset)
    return words, refs, ctx_map, None if freq is None else np.ascontiguousarray(freq, dtype=np.uint32), raw


def lanes_decode(words, refs, ctx_map, freq, scale_bits: int, ways: int, kbits: int, nclass: int,
                 lowbits: int, raw, out: np.ndarray, *, field: str = "Words", offset: int | None = None,
                 raw_offset: int | None = None, ranges: bool = True) -> None:
    """Decode symbols and raw low bits into ``out[bh, tokens, dim]`` (uint16/uint32), in place.

    Row ``r`` of the symbol matrix is ``out[r // dim, :, r % dim]``; each output
    word is ``symbol << lowbits | next lowbits raw bits``.  ``freq``, ``refs``
    and ``ctx_map`` must already be validated (tables sum to ``2**scale_bits``,
    map entries < number of tables, refs < ``2**(kbits-1)``), and ``raw`` must
    hold exactly ``packed_size(out.size, lowbits)`` bytes.  Raises
    :class:`FormatError` on a corrupt stream.  ``ranges`` False: the refs' and the map's ranges were checked
    against ``freq`` already (``parse_symbols`` does), and are not checked again.
    """
    bh, ntok, dim = out.shape
    words, refs, ctx_map, freq, raw = check_stream(words, refs, ctx_map, freq, scale_bits, ways, kbits, nclass,
                                                   lowbits, raw, bh * dim, out.size, field=field, offset=offset,
                                                   raw_offset=raw_offset, ranges=ranges)
    nwords = words.shape[0]
    rows = bh * dim
    n = out.size
    if backend() == "python":
        from ._rans_ref import lanes_decode_ref, unpack_bits_ref

        try:
            syms = lanes_decode_ref(words, refs, ctx_map, freq, scale_bits, ways, kbits, nclass, rows, ntok)
        except ValueError as e:
            raise FormatError(f"rANS stream: {e}", field=field, offset=offset) from None
        low = unpack_bits_ref(raw.tobytes(), lowbits, n)
        order = coding_order(np.arange(n, dtype=np.int64).reshape(rows, ntok), ways)
        words_out = np.zeros(n, dtype=np.uint64)
        words_out[order] = (syms.ravel().astype(np.uint64)[order] << np.uint64(lowbits)) | low.astype(np.uint64)
        out[...] = words_out.reshape(bh, dim, ntok).transpose(0, 2, 1)
        return
    kernel = decode_kernel(ways, dim, freq, scale_bits, kbits, lowbits)
    _count(kernel, n)
    if kernel.startswith(("fast", "vector")):
        _decode_fast(kernel, words, refs, ctx_map, freq, scale_bits, ways, kbits, nclass, lowbits, raw, out, field,
                     offset)
        return
    from ._rans_numba import dense_decode_inputs, lanes_decode_fused

    # the tables, the words with their padding and the raw bits as 64-bit words, in one compiled call
    ok, entry, symt, padded, raw64 = dense_decode_inputs(freq, scale_bits, words, ways, raw)
    if not ok:
        raise ValueError("lanes_decode: a frequency table sums past 2**scale_bits (not validated)")
    # compact dtypes, as on the wire: per-row side information is bounded by the output (spec section 9)
    args = (refs, ctx_map, entry, symt, scale_bits, kbits, nclass, lowbits)
    if ways in (4, 8):  # the raw bits as 64-bit words and two zero words (read with a funnel shift)
        from . import _lanes_unrolled as U

        status, pos, rp = (U.decode_w4 if ways == 4 else U.decode_w8)(padded, nwords, *args, raw64, out)
    else:
        rawp = np.concatenate([raw, np.zeros(8, dtype=np.uint8)])
        status, pos, rp = lanes_decode_fused(padded, nwords, ways, *args, rawp, out)
    if status:
        raise FormatError(f"rANS stream: {STREAM_STATUS[int(status)]}", field=field, offset=offset)
    if rp != raw.shape[0]:  # cannot happen for a validated raw length; kept as an invariant check
        raise FormatError(f"raw bits: used {rp} of {raw.shape[0]} bytes", field="Raw_Bits", offset=raw_offset)


#: lane counts with a local-table decoder (``_lanes_unrolled.fast_w*``, ``_lanes_simd``)
FAST_WAYS = (4, 8, 16)
#: symbols decoded by each kernel in this process (``decode_kernel``'s names): ``kvz bench`` reports which ran
KERNEL_SYMBOLS: dict[str, int] = {}
_KERNEL_LOCK = threading.Lock()


def _count(kernel: str, n: int, table: dict | None = None) -> None:
    """Add ``n`` symbols to ``kernel``'s count in ``table`` (default :data:`KERNEL_SYMBOLS`)."""
    table = KERNEL_SYMBOLS if table is None else table
    with _KERNEL_LOCK:
        table[kernel] = table.get(kernel, 0) + n


def vector_kernels() -> bool:
    """Whether the local-table streams decode with the vector kernels (:mod:`._lanes_simd`, the default) or
    the scalar ``fast_w*`` ones (``KVCODEC_VECTOR=0``; same words, tests compare the two)."""
    v = os.environ.get("KVCODEC_VECTOR", "1")
    if v not in ("0", "1"):
        raise ValueError(f"KVCODEC_VECTOR must be '0' or '1', not {v!r}")
    if v == "0":
        return False
    from . import _lanes_simd

    return _lanes_simd.available()


def decode_kernel(ways: int, dim: int, freq: np.ndarray | None, scale_bits: int | None = None,
                  kbits: int | None = None, lowbits: int = 0) -> str:
    """Which decoder :func:`lanes_decode` runs for a stream of ``ways`` lanes into rows of ``dim`` channels with
    tables ``freq`` (``scale_bits``, ``kbits`` and ``lowbits`` as the stream has them; ``freq`` None: tables still
    packed, their symbol counts checked as they are built, :func:`_prepare_packed`):

    * ``vector_w4/8/16/direct`` or ``.../indexed``: explicit vector code (:mod:`._lanes_simd`) with one table entry
      per slot (when ``2 scale_bits + kbits <= 32``) or a byte index per slot and an entry per symbol;
    * ``fast_w4/8/16``: the scalar local-table kernels (``KVCODEC_VECTOR=0``, or raw low bits wider than 25);
    * both need at most 256 symbols per table and lane groups inside one head;
    * ``decode_w4/8`` (unrolled, any table), ``generic``, or ``python`` (the reference backend)."""
    if backend() == "python":
        return "python"
    sb = MAX_SCALE_BITS if scale_bits is None else scale_bits
    # a table holds at most min(its alphabet, 2**sb) symbols: counted only when that bound exceeds 256
    if ways in FAST_WAYS and dim % ways == 0 and (freq is None or min(freq.shape[1], 1 << sb) <= 256
                                                  or _max_symbols(freq) <= 256):
        from . import _lanes_simd

        if lowbits <= _lanes_simd.MAX_LOWBITS and vector_kernels():
            direct = kbits is not None and _lanes_simd.direct_fits(sb, kbits)
            return f"vector_w{ways}/{'direct' if direct else 'indexed'}"
        return f"fast_w{ways}"
    return f"decode_w{ways}" if ways in (4, 8) else "generic"


def _max_symbols(freq: np.ndarray) -> int:
    """The most symbols one table of ``freq`` holds (compiled: NumPy's count along an axis took 19 us for a
    lossless stream's 32 x 1,024 entries)."""
    from ._rans_numba import max_symbols

    return int(max_symbols(np.ascontiguousarray(freq)))


#: the vector kernels read a stream's words and raw bits where the payload holds them (:class:`._lanes_simd.Prepared`);
#: False: from padded copies, as before (the same words; for A/B timings)
IN_PLACE = True
#: the arguments :func:`._rans_numba.packed_local_tables` does not write for one kind of table (one compiled
#: form for both)
_NO_TABLE, _NO_SLOTS, _NO_INFO = np.empty(0, np.uint32), np.empty(4, np.uint8), np.empty(0, np.uint64)


def _new_tables(direct: bool, g: int, scale_bits: int, held: list | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(table, info)`` for ``g`` tables, unfilled: the direct table (``info`` is the same array), or the byte
    index per slot (zeroed, 3 bytes of padding for the 32-bit gathers) and the 64-bit entry per symbol.  With
    ``held``, the direct table (128 KiB for a lossless stream) is scratch memory (:mod:`kvcodec.scratch`),
    appended to ``held`` for the caller to give back once the kernel has run."""
    if direct:
        if held is None:
            table = np.empty(g << scale_bits, dtype=np.uint32)
        else:
            table = scratch.take(4 * (g << scale_bits), np.uint32)
            held.append(table)
        return table, table
    return np.zeros((g << scale_bits) + 4, dtype=np.uint8), np.empty(g << 8, dtype=np.uint64)


def _local_tables(kernel, words, refs, ctx_map, freq, scale_bits, ways, nclass, lowbits, raw, out, tables=None,
                  ahead=None, ctx=None, held=None):
    """A local-table stream (:func:`decode_kernel` chose a ``vector_*`` or ``fast_*`` kernel: every table has
    <= 256 symbols) as the kernels take it (:class:`._lanes_simd.Prepared`).  ``tables``: ``(table, info)``
    already built (:func:`_prepare_packed`), instead of ``freq``; ``ahead`` and ``ctx`` (vector kernels, unless
    ``IN_PLACE`` is off): the words with the ``ways + 2`` after them and the map with 3 bytes of padding, as
    views (:class:`Parsed`), instead of a view made here or a copy.  ``held``: as :func:`_new_tables`'s."""
    from ._lanes_simd import Prepared, extend_words, raw_tail
    from ._rans_numba import build_direct_table, build_local_tables

    vector = IN_PLACE and kernel.startswith("vector")
    padded = (ahead if ahead is not None else extend_words(words, raw, ways)) if vector else None
    if padded is None:
        padded = np.concatenate([words, np.zeros(ways + 2, dtype=np.uint16)])
    if kernel.startswith("fast"):  # the scalar kernels: cbase[6 r + class] = the table times 2**scale_bits
        ctx6 = ctx_map if nclass == 6 else np.repeat(ctx_map[:, :1], 6, axis=1)
        ctx = (ctx6.astype(np.uint32) << np.uint32(scale_bits)).ravel()
        raw64 = np.empty((raw.shape[0] + 7) // 8 + 2, dtype=np.uint64)  # 16 zero bytes after the raw bits
        r8 = raw64.view(np.uint8)
        r8[:raw.shape[0]] = raw
        r8[raw.shape[0]:] = 0
        rawargs = (raw64,)
    else:  # the vector kernels read the map itself (32-bit gathers: 3 bytes of padding), the raw bits in place
        if ctx is None or not IN_PLACE:
            ctx = np.concatenate([ctx_map.ravel(), np.zeros(3, dtype=np.uint8)])
        if not IN_PLACE:
            raw = np.concatenate([raw, np.zeros(72, dtype=np.uint8)])[:raw.shape[0]]
        rawargs = (raw, *raw_tail(raw, ways, lowbits))
    direct = kernel.endswith("/direct")
    if tables is None:
        table, info = _new_tables(direct, freq.shape[0], scale_bits, held)
        if direct:
            build_direct_table(freq, scale_bits, table)
        elif not build_local_tables(freq, scale_bits, table, info):  # the info table's bound; decode_kernel checked
            raise ValueError("a table has more than 256 symbols: not a local-table stream")
    else:
        table, info = tables
    return Prepared(padded, words.shape[0], refs, ctx, table, info, rawargs[0], out, *rawargs[1:])


def _decode_fast(kernel, words, refs, ctx_map, freq, scale_bits, ways, kbits, nclass, lowbits, raw, out, field,
                 offset) -> None:
    """Decode one local-table stream (:func:`decode_kernel` chose ``kernel``)."""
    held: list = []
    try:
        st = _local_tables(kernel, words, refs, ctx_map, freq, scale_bits, ways, nclass, lowbits, raw, out,
                           held=held)
        if kernel.startswith("vector"):
            from . import _lanes_simd

            [(status, pos)] = _lanes_simd.decode_many(ways, scale_bits, kbits, nclass, lowbits, [st])
        else:
            from . import _lanes_unrolled as U

            fast = {4: U.fast_w4, 8: U.fast_w8, 16: U.fast_w16}[ways]
            status, pos = fast(st.words, st.nwords, refs, st.ctx, st.table, st.info, scale_bits, kbits, lowbits,
                               st.raw, out)
    finally:
        _give_back(held)
    _check_status(status, pos, st.nwords, field, offset)


def _give_back(held: list) -> None:
    """Give the scratch arrays in ``held`` back (:mod:`kvcodec.scratch`): no kernel reads them any more."""
    while held:
        scratch.give(held.pop())


def _check_status(status, pos, nwords, field, offset) -> None:
    if status == 0 and pos != nwords:
        status = 4
    if status:
        raise FormatError(f"rANS stream: {STREAM_STATUS[int(status)]}", field=field, offset=offset)


def lanes_decode_many(jobs) -> None:
    """Decode several streams, each ``(Stream, out[bh, tokens, dim])`` as :func:`lanes_decode` takes them; the
    streams the vector kernels decode run several at a time (their dependency chains overlap in one loop, see
    :mod:`._lanes_simd`), the others one by one.  Raises :class:`FormatError` naming a corrupt stream."""
    held: list = []  # the scratch tables of this call's streams (given back once every kernel has run)
    try:
        _decode_batches(jobs, held)
    finally:
        _give_back(held)


def _decode_batches(jobs, held: list) -> None:
    from . import _lanes_simd

    batches: dict = {}
    kernels: dict = {}  # decode_kernel's answers in this call
    for s, out in jobs:
        bh, ntok, dim = out.shape
        if s.freq is None:  # packed tables: built into the vector kernels' ones as they are parsed
            prepared = _prepare_packed(s, out, kernels, held) if PACKED_TABLES else None
            if prepared is not None:
                kernel, prepared = prepared
                key = (kernel, s.ways, s.scale_bits, s.kbits, s.nclass, s.lowbits, out.shape, out.dtype.str)
                batches.setdefault(key, []).append((prepared, s.offset))
                continue
            s = s.dense()
        kernel = decode_kernel(s.ways, dim, s.freq, s.scale_bits, s.kbits, s.lowbits)
        if not kernel.startswith("vector"):
            lanes_decode(s.words, s.refs, s.ctx_map, s.freq, s.scale_bits, s.ways, s.kbits, s.nclass, s.lowbits,
                         s.raw, out, offset=s.offset, raw_offset=s.raw_offset)
            continue
        words, refs, ctx_map, freq, raw = check_stream(s.words, s.refs, s.ctx_map, s.freq, s.scale_bits, s.ways,
                                                       s.kbits, s.nclass, s.lowbits, s.raw, bh * dim, out.size,
                                                       offset=s.offset, raw_offset=s.raw_offset)
        _count(kernel, out.size)
        prepared = _local_tables(kernel, words, refs, ctx_map, freq, s.scale_bits, s.ways, s.nclass, s.lowbits, raw,
                                 out, held=held)
        key = (kernel, s.ways, s.scale_bits, s.kbits, s.nclass, s.lowbits, out.shape, out.dtype.str)
        batches.setdefault(key, []).append((prepared, s.offset))
    for (kernel, ways, sb, kbits, nclass, lowbits, _, _), items in batches.items():
        results = _lanes_simd.decode_many(ways, sb, kbits, nclass, lowbits, [p for p, _ in items])
        for (p, offset), (status, pos) in zip(items, results):
            _check_status(status, pos, p.nwords, "Words", offset)


#: streams parsed with packed tables (:attr:`Stream.tables`) have them parsed into the vector kernels' tables
#: in one pass; False: unpacked to dense frequencies first, as other streams (the same words; for A/B timings)
PACKED_TABLES = True


def _prepare_packed(s: Stream, out: np.ndarray, kernels: dict | None = None, held: list | None = None):
    """``(kernel, Prepared)`` of a stream with packed tables that a vector kernel decodes, its tables validated
    and built in one pass (:func:`._rans_numba.packed_local_tables`), or ``None`` when another kernel decodes it
    (no vector kernels, lane groups across heads, raw fields too wide, or a table of more than 256 symbols:
    :func:`decode_kernel`'s rules, the tables' size checked as they are parsed).  ``kernels``: decode_kernel's
    answers so far in this batch, by stream form; ``held``: as :func:`_new_tables`'s.  A stream as
    ``parse_symbols`` made it (its words, map and fields those of :attr:`Stream.parsed`) is read through the
    views it keeps."""
    bh, ntok, dim = out.shape
    key = (s.ways, dim, s.scale_bits, s.kbits, s.lowbits)
    kernel = None if kernels is None else kernels.get(key)
    if kernel is None:
        kernel = decode_kernel(s.ways, dim, None, s.scale_bits, s.kbits, s.lowbits)
        if kernels is not None:
            kernels[key] = kernel
    if not kernel.startswith("vector"):
        return None
    from ._rans_numba import packed_local_tables

    direct = kernel.endswith("/direct")
    table, info = _new_tables(direct, s.ntables, s.scale_bits, held)
    # the tables first, as parse_symbols(dense=True) checks them before the words
    args = (table, _NO_SLOTS, _NO_INFO) if direct else (_NO_TABLE, table, info)
    code, c, a, b = (int(v) for v in packed_local_tables(s.tables, 1 << s.kbits, s.scale_bits, direct, *args))
    if code == 5:  # a table of more than 256 symbols: not for the local-table kernels
        return None
    if code < 0:
        raise ValueError("packed_local_tables: the output arrays do not fit the tables")
    _tables_error(code, c, a, b, 1 << s.kbits, s.scale_bits, "Side", s.tables_offset)
    # the refs' and the map's ranges were checked against the tables' count when the stream was parsed
    words, refs, ctx_map, _, raw = check_stream(s.words, s.refs, s.ctx_map, None, s.scale_bits, s.ways, s.kbits,
                                                s.nclass, s.lowbits, s.raw, bh * dim, out.size, offset=s.offset,
                                                raw_offset=s.raw_offset, ranges=False)
    _count(kernel, out.size)
    p = s.parsed  # its views, while the words and the map are the ones parsed with them
    views = (p is not None and p.words is s.words and p.ctx_map is s.ctx_map
             and p.fields == (s.scale_bits, s.ways, s.kbits, s.nclass, s.lowbits))
    return kernel, _local_tables(kernel, words, refs, ctx_map, None, s.scale_bits, s.ways, s.nclass, s.lowbits, raw,
                                 out, tables=(table, info), ahead=p.ahead if views else None,
                                 ctx=p.ctx if views else None)


def pack_bits(values: np.ndarray, width: int) -> bytes:
    """Low ``width`` bits (``<= 32``) of each value, LSB-first; the last byte is zero-padded."""
    n = values.shape[0]
    if width == 0 or n == 0:
        return b""
    if backend() == "python":
        from ._rans_ref import pack_bits_ref

        return pack_bits_ref(values, width)
    return _pack(np.ascontiguousarray(values).reshape(1, n, 1), width, 1)  # one row: the values in order


def pack_low_bits(rows: np.ndarray, width: int, ways: int, *, buffer: bool = False) -> bytes:
    """``pack_bits(coding_order(rows & mask, ways), width)`` in one pass (the encoder's raw low bits).  ``rows``
    may also be a ``[BH, tokens, D]`` array whose row ``bh * D + d`` is ``rows[bh, :, d]`` (as for
    :func:`lanes_encode`), read in place when ``D % ways == 0``.  ``buffer``: return the bytes as a uint8
    array (bytes-like, not copied into a ``bytes``)."""
    if width == 0 or rows.size == 0:
        return b""
    if rows.ndim == 3 and (rows.shape[2] % ways or backend() == "python"):  # lane groups straddle heads
        rows = rows_of(rows)
    if backend() == "python":
        return pack_bits(coding_order(rows & ((1 << width) - 1), ways), width)
    return _pack(rows if rows.ndim == 3 else rows.T[None], width, ways, buffer)  # [rows, T] as a [1, T, rows] view


def _pack(words3: np.ndarray, width: int, ways: int, buffer: bool = False) -> bytes:
    """:func:`._rans_numba.pack_coding_order` into a fresh buffer: the packed bytes (``buffer``: as the uint8
    array itself)."""
    from ._rans_numba import pack_coding_order

    if not 0 < width <= 32:
        raise ValueError(f"raw bit fields are 1 to 32 bits wide, not {width}")
    n = packed_size(words3.size, width)
    out = np.empty((n + 3) // 4 * 4, dtype=np.uint8)
    got = pack_coding_order(words3, width, ways, out)
    assert got == n
    return out[:n] if buffer else out[:n].tobytes()


def rows_of(a3: np.ndarray) -> np.ndarray:
    """The ``[BH * D, tokens]`` matrix of a ``[BH, tokens, D]`` array (row ``bh * D + d`` is ``a3[bh, :, d]``),
    C-contiguous."""
    bh, ntok, dim = a3.shape
    return np.ascontiguousarray(a3.transpose(0, 2, 1)).reshape(bh * dim, ntok)


class SparseCounts(NamedTuple):
    """Symbol counts of ``nrows`` histogram rows over ``nsym`` symbols, only the non-zero ones: row ``r`` has
    the counts ``val[indptr[r]:indptr[r + 1]]`` of the symbols ``col[...]`` (ascending)."""

    nrows: int
    nsym: int
    indptr: np.ndarray  # int64 [nrows + 1]
    col: np.ndarray  # int64
    val: np.ndarray  # int64, all > 0

    def rows(self) -> np.ndarray:
        """The row of every entry."""
        return np.repeat(np.arange(self.nrows), np.diff(self.indptr))

    def dense(self) -> np.ndarray:
        out = np.zeros((self.nrows, self.nsym), dtype=np.int64)
        out[self.rows(), self.col] = self.val
        return out

    @classmethod
    def from_dense(cls, counts: np.ndarray) -> "SparseCounts":
        r, c = np.nonzero(counts)  # row-major: columns ascending within each row
        indptr = np.zeros(counts.shape[0] + 1, dtype=np.int64)
        np.cumsum(np.bincount(r, minlength=counts.shape[0]), out=indptr[1:])
        return cls(counts.shape[0], counts.shape[1], indptr, c.astype(np.int64), counts[r, c].astype(np.int64))


def row_stats(syms: np.ndarray, kbits: int, nclass: int) -> tuple[np.ndarray, SparseCounts]:
    """(refs, counts): each row's reference (the lower median magnitude) and the symbol counts per (row,
    class of the previous symbol), ``rows * nclass`` histogram rows over ``2**kbits`` symbols, sparse (encoder
    side).  ``syms`` is a ``[rows, tokens]`` matrix or a ``[BH, tokens, D]`` array whose row ``bh * D + d`` is
    ``syms[bh, :, d]``."""
    if syms.ndim == 3:  # the kernel reads rows along memory: a transposed copy is faster than strided reads
        syms = rows_of(syms)
    rows, ntok = syms.shape
    if syms.size and int(syms.max()) >> kbits:
        raise ValueError(f"a symbol exceeds {kbits} bits")
    refs = np.empty(rows, dtype=np.uint16)
    if backend() == "python":  # the same statistics in NumPy
        counts = np.zeros((rows * nclass, 1 << kbits), dtype=np.int64)
        half = 1 << (kbits - 1)
        mag = (syms & np.uint16(half - 1)).astype(np.int64)
        cdf = np.cumsum(np.bincount((mag + np.arange(rows)[:, None] * half).ravel(),
                                    minlength=rows * half).reshape(rows, half), axis=1)
        refs[:] = np.argmax(cdf >= (ntok + 1) // 2, axis=1)
        prev = np.concatenate([refs[:, None], syms[:, :-1]], axis=1).astype(np.int64)
        r = refs.astype(np.int64)[:, None]
        m = prev & (half - 1)
        c = (prev >> (kbits - 1)) * 3 + (m >= r) + (m > r) if nclass > 1 else np.zeros_like(prev)
        cls = np.arange(rows)[:, None] * nclass + c
        counts[...] = np.bincount((cls * (1 << kbits) + syms).ravel(),
                                  minlength=counts.size).reshape(counts.shape)
        return refs, SparseCounts.from_dense(counts)
    from ._rans_numba import row_stats as _stats

    indptr = np.empty(rows * nclass + 1, dtype=np.int64)
    col = np.empty(syms.size, dtype=np.int64)  # at most one entry per symbol
    val = np.empty(syms.size, dtype=np.int64)
    n = _stats(np.ascontiguousarray(syms, dtype=np.uint16), kbits, nclass, refs, indptr, col, val)
    return refs, SparseCounts(rows * nclass, 1 << kbits, indptr, col[:n].copy(), val[:n].copy())


def packed_size(n: int, width: int) -> int:
    return (n * width + 7) // 8


# --- frequency tables on the wire -------------------------------------------
#
# Per context: Lo (u16), Count_Minus_One (u16), then Count u16 frequencies for
# symbols Lo .. Lo+Count-1; all other symbols have frequency 0.  Little-endian.

def pack_tables(freq: np.ndarray) -> bytes:
    freq = np.asarray(freq, dtype=np.uint32)
    if backend() == "numba" and freq.size:
        from ._rans_numba import pack_tables as _pack_tables

        out = np.empty(freq.shape[0] * (4 + 2 * freq.shape[1]), dtype=np.uint8)
        n = _pack_tables(np.ascontiguousarray(freq), out)
        if n < 0:
            raise ValueError("a frequency table has no non-zero entry")
        return out[:n].tobytes()
    parts = []
    for row in freq:
        nz = np.nonzero(row)[0]
        if nz.size == 0:
            raise ValueError("a frequency table has no non-zero entry")
        lo, hi = int(nz[0]), int(nz[-1]) + 1
        parts.append(struct.pack("<HH", lo, hi - lo - 1))
        parts.append(row[lo:hi].astype("<u2").tobytes())
    return b"".join(parts)


def unpack_tables(buf: bytes, nctx: int, nsym: int, scale_bits: int, *,
                  field: str = "Tables", offset: int | None = None) -> np.ndarray:
    """Parse and validate ``nctx`` tables; raises FormatError naming the context."""
    freq = np.zeros((nctx, nsym), dtype=np.uint32)
    raw = np.frombuffer(buf, dtype=np.uint8)
    if backend() == "python":
        code, c, a, b = _unpack_tables_py(raw, scale_bits, freq)
    else:
        from ._rans_numba import unpack_tables as _unpack

        code, c, a, b = _unpack(raw, scale_bits, freq)
    _tables_error(code, c, a, b, nsym, scale_bits, field, offset)
    return freq


def _tables_error(code: int, c: int, a: int, b: int, nsym: int, scale_bits: int, field: str, offset) -> None:
    """Raise the :class:`FormatError` of :func:`unpack_tables`' parser result ``(code, c, a, b)`` (nothing for
    code 0)."""
    if code == 1:
        raise FormatError(f"frequency table {c}: ends early", field=field, offset=offset)
    if code == 2:
        raise FormatError(f"frequency table {c}: symbols {a}..{b} outside alphabet of {nsym}", field=field,
                          offset=offset)
    if code == 3:
        raise FormatError(f"frequency table {c}: sums to {a}, not 2**{scale_bits}", field=field, offset=offset)
    if code == 4:
        raise FormatError(f"frequency tables: {a} bytes left over", field=field, offset=offset)


def _unpack_tables_py(buf: np.ndarray, scale_bits: int, freq: np.ndarray) -> tuple[int, int, int, int]:
    """The reference of ``_rans_numba.unpack_tables`` (same results)."""
    mv = memoryview(buf.tobytes())
    nctx, nsym = freq.shape
    pos = 0
    for c in range(nctx):
        if pos + 4 > len(mv):
            return 1, c, 0, 0
        lo, cnt = struct.unpack_from("<HH", mv, pos)
        cnt += 1
        pos += 4
        if lo + cnt > nsym:
            return 2, c, lo, lo + cnt
        if pos + 2 * cnt > len(mv):
            return 1, c, 0, 0
        freq[c, lo:lo + cnt] = np.frombuffer(mv[pos:pos + 2 * cnt], dtype="<u2")
        pos += 2 * cnt
        if int(freq[c].sum()) != 1 << scale_bits:
            return 3, c, int(freq[c].sum()), 0
    if pos != len(mv):
        return 4, 0, len(mv) - pos, 0
    return 0, 0, 0, 0


def max_tables_bytes(nctx: int, nsym: int) -> int:
    """Upper bound of :func:`pack_tables`' output, used as a decode limit."""
    return nctx * (4 + 2 * nsym)

