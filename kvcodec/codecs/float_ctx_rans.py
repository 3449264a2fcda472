"""Lossless float coding of one KV tensor slice: codec ``float_ctx_rans``.

Each element is a W-byte word (bf16/fp16: 16 bits, fp32: 32 bits).  Its top
``k`` bits (by default sign + exponent) are a *symbol*, entropy-coded with the
lane coder (:mod:`kvcodec.entropy.rans`); the remaining ``8W - k`` mantissa bits
are stored raw, bit-packed: measured on SmolLM2 they are within 1 % of
incompressible (7 mantissa bits of bf16: 6.93 bits of entropy).

Why this model (SmolLM2, 2,048-token bf16 cache, bits per component):

* sign+exponent per channel: K 3.17, V 3.49 (a global table: 3.77 / 3.92) -
  channels have very different magnitudes (outlier channels);
* conditioning also on the previous token's symbol of the same channel
  (its sign, and whether its exponent is below / at / above the channel's
  reference) saves another 0.41 (K) / 0.10 (V) bits: RoPE rotates key pairs
  slowly, so neighbouring tokens share signs;
* one table per (channel, class) costs too much side information, and too
  many tables slow decoding (they fall out of L1), so the (channel, class)
  histograms are clustered into at most ``max_tables`` shared tables (k-means
  on code length); 32 tables lose ~0.04 bits against one table per context.

The tensor ``[B, H, S, D]`` is viewed as rows ``(b, h, d)`` of ``S`` tokens;
see ``spec/kvz.md`` ("float_ctx_rans payload") for the exact bytes.
"""

from __future__ import annotations

import struct
import threading

import numpy as np
import zstandard

from ..dtypes import DTYPES, bit_patterns
from ..entropy import rans
from ..errors import ConfigError, FormatError, LimitExceeded
from ..registry import register_codec
from .base import Codec, Slice

CODEC_ID = "float_ctx_rans"

MODE_RAW = 0
MODE_CODED = 1

_FIXED = struct.Struct("<BBBBBBHIII")  # Mode .. Num_Words: 20 bytes
FIXED_SIZE = _FIXED.size
MAX_TABLE_ENTRIES = 1 << 22  # Num_Tables * 2**Scale_Bits: bounds the decoder's tables (24 MiB)

DEFAULTS = {"scale_bits": 12, "ways": 8, "max_tables": 32, "context": "prev", "coded_bits": None}


def _uint(width: int):
    return np.uint16 if width == 2 else np.uint32


def check_config(cfg: dict, dtype: str) -> dict:
    """Fill defaults and validate encoder options; returns a JSON-able dict."""
    unknown = set(cfg) - set(DEFAULTS)
    if unknown:
        raise ConfigError(f"{CODEC_ID}: unknown options {sorted(unknown)}")
    out = {**DEFAULTS, **cfg}
    width, ebits = DTYPES[dtype].itemsize, DTYPES[dtype].exponent_bits
    if out["coded_bits"] is None:
        # sign + exponent + the top mantissa bit: the top mantissa bit is skewed
        # within a binade (K 1.6285x vs 1.6174x at sign+exponent, bf16 SmolLM2)
        out["coded_bits"] = 2 + ebits
    k = out["coded_bits"]
    if not (isinstance(k, int) and 2 <= k <= min(16, 8 * width)):
        raise ConfigError(f"{CODEC_ID}: coded_bits must be an int in [2, {min(16, 8 * width)}], not {k!r}")
    if not (isinstance(out["scale_bits"], int) and rans.MIN_SCALE_BITS <= out["scale_bits"] <= rans.MAX_SCALE_BITS):
        raise ConfigError(f"{CODEC_ID}: scale_bits must be in [{rans.MIN_SCALE_BITS}, {rans.MAX_SCALE_BITS}]")
    if not (isinstance(out["ways"], int) and 1 <= out["ways"] <= rans.MAX_WAYS):
        raise ConfigError(f"{CODEC_ID}: ways must be in [1, {rans.MAX_WAYS}]")
    if not (isinstance(out["max_tables"], int) and 1 <= out["max_tables"] <= 255):
        raise ConfigError(f"{CODEC_ID}: max_tables must be in [1, 255]")
    if out["context"] not in ("prev", "none"):
        raise ConfigError(f"{CODEC_ID}: context must be 'prev' or 'none'")
    return out


# --- encoder ---------------------------------------------------------------

def table_counts(assign: np.ndarray, counts: rans.SparseCounts, g: int) -> np.ndarray:
    """``out[t]``: the sum of the histogram rows assigned to table ``t`` (int64; exact, counts being far below
    2**53)."""
    if rans.backend() == "numba":  # the clustering's table sums, over all the symbols
        from ..entropy._rans_numba import table_sums

        q = np.empty(g * counts.nsym)
        table_sums(counts.indptr, counts.col, counts.val, np.ascontiguousarray(assign, dtype=np.int64), counts.nsym, q)
        return q.reshape(g, counts.nsym).astype(np.int64)
    flat = assign[counts.rows()] * counts.nsym + counts.col
    return np.bincount(flat, weights=counts.val, minlength=g * counts.nsym).reshape(g, counts.nsym).astype(np.int64)


def _nearest(indptr: np.ndarray, idx: np.ndarray, val: np.ndarray, logq: np.ndarray) -> np.ndarray:
    """For each sparse row, the table ``t`` of least code length ``-sum_k val[k] * logq[t, idx[k]]`` (the sum
    accumulated over the row's entries in column order, from 0.0; ties to the lowest ``t``): a fixed order of
    binary64 operations, so both backends pick the same tables from the same ``logq``."""
    return _chooser(indptr, idx, val, logq.shape[0], logq.shape[1])(logq)


def _chooser(indptr: np.ndarray, idx: np.ndarray, val: np.ndarray, g: int, used: int):
    """:func:`_nearest` for these rows as a function of ``logq`` (the compiled backends set up once for a
    k-means run)."""
    if rans.backend() != "python":
        return rans.table_chooser(indptr, idx, val, g, used)
    return lambda logq: _nearest_numpy(indptr, idx, val, logq)


def _nearest_numpy(indptr: np.ndarray, idx: np.ndarray, val: np.ndarray, logq: np.ndarray) -> np.ndarray:
    """:func:`_nearest` in NumPy (the python backend)."""
    logq_t = np.ascontiguousarray(logq.T)
    out = np.empty(indptr.size - 1, dtype=np.int64)
    nnz = np.diff(indptr)
    acc = np.zeros((out.size, logq.shape[0]))
    for k in range(int(nnz.max()) if nnz.size else 0):
        rr = np.nonzero(nnz > k)[0]
        e = indptr[rr] + k
        acc[rr] += val[e][:, None] * logq_t[idx[e]]
    out[:] = np.argmin(-acc, axis=1)
    return out


def _cluster(counts: rans.SparseCounts, n_tables: int, iters: int = 8) -> np.ndarray:
    """Assign each histogram row to one of ``n_tables`` tables (k-means on code length).

    Deterministic for given code lengths (no BLAS: they are summed in a fixed order over each row's non-zero
    counts, the same in both backends).  The code lengths come from NumPy's ``log2``, whose last bit differs
    between its SIMD paths for ~0.1 % of inputs (AVX-512 against AVX2, measured): a near-tie between two tables
    could then go the other way on another machine, giving another valid file (none did in 16 real encodes
    with NumPy's AVX-512 paths switched off, BENCHMARKS "Decode and encode, seventh pass").  Rows with no
    counts go to table 0.  Returns int array.
    """
    assign = np.zeros(counts.nrows, dtype=np.int64)
    python = rans.backend() == "python"
    if not python:  # the same arrays in one compiled pass each
        from ..entropy._rans_numba import cluster_prep

        live, indptr, idx, val, mean, used = cluster_prep(counts.indptr, counts.col, counts.val, counts.nsym)
    else:
        nnz = np.diff(counts.indptr)
        live = np.nonzero(nnz)[0]
        present = np.bincount(counts.col, minlength=counts.nsym) > 0
        used = np.nonzero(present)[0]
        colmap = np.cumsum(present) - 1
        idx = colmap[counts.col]
        row = np.repeat(np.arange(live.size), nnz[live])  # live row of every entry
        indptr = np.append(counts.indptr[live], counts.indptr[-1])
        val = counts.val.astype(np.float64)
        # integer sums: exact in binary64 whatever the order
        tot = np.bincount(row, weights=val, minlength=live.size)
        mean = np.bincount(row, weights=val * idx, minlength=live.size) / tot
    if live.size == 0:
        return assign
    g = min(n_tables, live.size)
    a = np.empty(live.size, dtype=np.int64)
    a[np.argsort(mean, kind="stable")] = np.arange(live.size) * g // live.size
    qs = np.empty(g * used.size)
    if not python:  # the same exact integer sums in one pass; later passes move only the rows that changed table
        from ..entropy._rans_numba import move_rows, table_sums

        table_sums(indptr, idx, val, a, used.size, qs)
    nearest = _chooser(indptr, idx, val, g, used.size)
    for _ in range(iters):
        if python:
            qs = np.bincount(a[row] * used.size + idx, weights=val, minlength=g * used.size)
        q = qs.reshape(g, used.size) + 1e-3
        logq = np.log2(q / q.sum(axis=1, keepdims=True))
        na = nearest(logq)
        if np.array_equal(na, a):
            break
        if not python:
            move_rows(indptr, idx, val, a, na, used.size, qs)
        a = na
    # renumber used tables densely, in order of first use
    _, first = np.unique(a, return_index=True)
    remap = np.empty(g, dtype=np.int64)
    remap[a[np.sort(first)]] = np.arange(first.size)
    assign[live] = remap[a]
    return assign


def encode(words: np.ndarray, dtype: str, cfg: dict) -> bytes:
    """Encode a ``[B, H, S, D]`` array of raw float bit patterns (uint16/uint32)."""
    width = DTYPES[dtype].itemsize
    cfg = check_config(cfg, dtype)
    b, h, s, d = words.shape
    n = words.size
    if n == 0:
        return bytes([MODE_RAW])
    k, ways = cfg["coded_bits"], cfg["ways"]
    lowbits = 8 * width - k
    w3 = np.ascontiguousarray(words).reshape(b * h, s, d)
    syms = (w3 >> lowbits).astype(np.uint16, copy=False)
    low = rans.pack_low_bits(w3, lowbits, ways, buffer=True)
    # the parts joined once (each extra copy of a ~30 MB payload is a few ms of fresh pages)
    out = b"".join([*symbol_parts(syms, k, cfg), low])
    if len(out) >= 1 + n * width:  # coding does not pay: store the words as they are
        return bytes([MODE_RAW]) + np.ascontiguousarray(words).astype(f"<u{width}", copy=False).tobytes()
    return out


def encode_symbols(syms: np.ndarray, k: int, cfg: dict) -> bytes:
    """The coded part of a Mode 1 payload: :func:`symbol_parts` joined."""
    return b"".join(symbol_parts(syms, k, cfg))


def symbol_parts(syms: np.ndarray, k: int, cfg: dict) -> list:
    """The coded part of a Mode 1 payload (fixed fields, side information, rANS words) for a
    ``[rows, tokens]`` matrix of ``k``-bit symbols, or a ``[BH, tokens, D]`` array whose rows are its
    ``(bh, d)`` channels (a cache's own layout, which the vector encoder reads in place); the caller appends
    the raw low bits.  Returned as a list of bytes-like parts (the rANS words uncopied), to be joined."""
    sb, ways = cfg["scale_bits"], cfg["ways"]
    syms = np.ascontiguousarray(syms, dtype=np.uint16)
    n = syms.size
    nclass = 6 if cfg["context"] == "prev" else 1
    # reference symbol of each row (sign 0, the lower median magnitude) and histograms per (row, class)
    refs, counts = rans.row_stats(syms, k, nclass)
    n_tables = max(1, min(cfg["max_tables"], n // 4096, (1 << sb) // 2))
    assign = _cluster(counts, n_tables)
    g = int(assign.max()) + 1
    tcounts = table_counts(assign, counts, g)
    if (tcounts > 0).sum(axis=1).max() > (1 << sb):
        raise ConfigError(f"{CODEC_ID}: a table has more distinct symbols than 2**scale_bits; raise scale_bits")
    freq = rans.normalize_counts(tcounts, sb)
    ctx_map = assign.reshape(refs.size, nclass).astype(np.uint8)
    words_out = rans.lanes_encode(syms, refs, ctx_map, freq, sb, ways, k, nclass)
    side = refs.astype("<u2").tobytes() + ctx_map.tobytes() + rans.pack_tables(freq)
    side_z = _side_compressor().compress(side)
    return [_FIXED.pack(MODE_CODED, k, sb, ways, nclass, 0, g, len(side_z), len(side), words_out.size),
            side_z, np.ascontiguousarray(words_out, dtype="<u2")]


_LOCAL = threading.local()

#: zstd level of the side information (an encoder choice: any level decodes).  Level 19 until spec revision
#: 1.6.3 took 3.3 ms of a bf16 payload's ~17 ms to save 0.04 % of the file (SmolLM2, 2,048 tokens: 139,439
#: against 151,932 bytes of side information in a 29.9 MB file); level 3 takes 0.07 ms.
SIDE_LEVEL = 3


def _side_compressor():
    """This thread's zstd compressor for side information, made once per thread rather than per payload (the
    bytes are the same)."""
    got = getattr(_LOCAL, "side", None)
    if got is None or got[0] != SIDE_LEVEL:
        got = _LOCAL.side = (SIDE_LEVEL, zstandard.ZstdCompressor(level=SIDE_LEVEL, write_content_size=True))
    return got[1]


# --- decoder ---------------------------------------------------------------

def _side_decompressor():
    """This thread's zstd decompressor for side information, made once per thread rather than per payload (8.6
    against 1.0 us a frame here; a decompression context holds no state between frames)."""
    got = getattr(_LOCAL, "unside", None)
    if got is None:
        got = _LOCAL.unside = zstandard.ZstdDecompressor()
    return got


def decode(payload, shape: tuple[int, int, int, int], dtype: str, *, offset: int = 0,
           out: np.ndarray | None = None) -> np.ndarray:
    """Decode a payload into a ``[B, H, S, D]`` array of uint16/uint32 bit patterns.

    ``offset`` is the payload's position in the file, for error messages.
    ``out``, if given, is a C-contiguous array of that shape and dtype to decode
    into (saves a copy).  Every field is validated before anything is allocated
    from it.
    """
    width = DTYPES[dtype].itemsize
    mv = memoryview(payload)
    b, h, s, d = shape
    n = b * h * s * d
    if len(mv) < 1:
        raise FormatError("empty payload", field="Mode", offset=offset)
    mode = mv[0]
    if mode == MODE_RAW:
        if len(mv) != 1 + n * width:
            raise FormatError(f"raw payload has {len(mv) - 1} bytes, expected {n * width}",
                              field="Payload_Length", offset=offset)
        data = np.frombuffer(mv[1:], dtype=f"<u{width}").reshape(shape)
        if out is None:
            return data.astype(_uint(width))
        out[...] = data
        return out
    if mode != MODE_CODED:
        raise FormatError(f"unknown mode {mode}", field="Mode", offset=offset)
    if n == 0:
        raise FormatError("coded payload for an empty tensor", field="Mode", offset=offset)
    out = _output(out, (b, h, s, d), width)
    decode_symbols(mv, out.reshape(b * h, s, d), 8 * width, offset=offset, exact_payload=True)
    return out


def _output(out, shape: tuple, width: int) -> np.ndarray:
    """``out`` checked to be a C-contiguous array of ``shape`` and ``width``-byte words, or a new one."""
    if out is None:
        return np.empty(shape, dtype=_uint(width))
    if out.shape != shape or out.dtype != _uint(width) or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous {_uint(width).__name__} array of shape {shape}")
    return out


def decode_many(items: list) -> list:
    """:func:`decode` of each ``(payload, shape, dtype, offset, out)``, the coded payloads' streams decoded
    together (:func:`~kvcodec.entropy.rans.lanes_decode_many`).  Every payload is parsed first and its
    frequency tables validated as they are built, so with several faulty payloads a later one's parse error
    is the one raised before an earlier one's table error."""
    results, coded = [], []
    for payload, shape, dtype, offset, out in items:
        width = DTYPES[dtype].itemsize
        mv = memoryview(payload)
        b, h, s, d = shape
        if len(mv) < 1 or mv[0] != MODE_CODED or b * h * s * d == 0:
            results.append(decode(payload, shape, dtype, offset=offset, out=out))
            continue
        out = _output(out, tuple(shape), width)
        flat = out.reshape(b * h, s, d)
        st, _ = parse_symbols(mv, flat.shape, 8 * width, offset=offset, exact_payload=True, dense=False)
        coded.append((st, flat))
        results.append(out)
    rans.lanes_decode_many(coded)
    return results


def decode_symbols(mv: memoryview, out: np.ndarray, word_bits: int, *, offset: int = 0,
                   exact_payload: bool = True, coded_bits: int | None = None) -> int:
    """Decode a Mode 1 payload's coded part (and its raw low bits) into ``out[bh, tokens, dim]``.

    ``word_bits`` is the width of one output word (16/32 for floats); the low
    ``word_bits - Coded_Bits`` bits of each word are read raw after the rANS
    words.  With ``exact_payload`` the payload must end there; otherwise the
    number of bytes used is returned (the caller reads what follows).
    ``coded_bits``, if given, is the only Coded_Bits value accepted.
    """
    st, used = parse_symbols(mv, out.shape, word_bits, offset=offset, exact_payload=exact_payload,
                             coded_bits=coded_bits)
    rans.lanes_decode(st.words, st.refs, st.ctx_map, st.freq, st.scale_bits, st.ways, st.kbits, st.nclass,
                      st.lowbits, st.raw, out, field="Words", offset=st.offset, raw_offset=st.raw_offset,
                      ranges=False)  # parse_symbols checked the refs and the map against the tables
    return used


def parse_symbols(mv: memoryview, shape: tuple[int, int, int], word_bits: int, *, offset: int = 0,
                  exact_payload: bool = True, coded_bits: int | None = None,
                  dense: bool = True) -> tuple[rans.Stream, int]:
    """(the stream, bytes used) of a Mode 1 payload's coded part for ``[bh, tokens, dim]`` words of
    ``word_bits`` bits: every field validated as :func:`decode_symbols` does, nothing decoded yet (the Triton
    decoder takes the same stream).  Not ``dense``: the frequency tables are left packed (the stream's
    ``tables``, ``freq`` None), to be validated as they are built into a decoder's tables
    (:func:`~kvcodec.entropy.rans.lanes_decode_many`, or :meth:`~kvcodec.entropy.rans.Stream.dense`)."""
    bh, s, d = shape
    n = bh * s * d
    if len(mv) < FIXED_SIZE:
        raise FormatError("payload shorter than its fixed fields", field="Mode", offset=offset)
    _, k, sb, ways, nclass, reserved, g, side_len, side_raw_len, nwords = _FIXED.unpack_from(mv, 0)
    if not 2 <= k <= min(16, word_bits) or (coded_bits is not None and k != coded_bits):
        want = f"[2, {min(16, word_bits)}]" if coded_bits is None else str(coded_bits)
        raise FormatError(f"Coded_Bits {k} outside {want}", field="Coded_Bits", offset=offset + 1)
    if not rans.MIN_SCALE_BITS <= sb <= rans.MAX_SCALE_BITS:
        raise FormatError(f"Scale_Bits {sb} outside [8, 15]", field="Scale_Bits", offset=offset + 2)
    if not 1 <= ways <= rans.MAX_WAYS:
        raise FormatError(f"Ways {ways} outside [1, {rans.MAX_WAYS}]", field="Ways", offset=offset + 3)
    if nclass not in (1, 6):
        raise FormatError(f"Num_Classes {nclass} is not 1 or 6", field="Num_Classes", offset=offset + 4)
    if reserved:
        raise FormatError("reserved byte is not zero", field="Reserved", offset=offset + 5)
    if not 1 <= g <= 255:
        raise FormatError(f"Num_Tables {g} outside [1, 255]", field="Num_Tables", offset=offset + 6)
    if g << sb > MAX_TABLE_ENTRIES:
        raise LimitExceeded(f"Num_Tables * 2**Scale_Bits = {g << sb} > {MAX_TABLE_ENTRIES}",
                            field="Num_Tables", offset=offset + 6)
    rows = bh * d
    lowbits = word_bits - k
    min_side = 2 * rows + rows * nclass + 6 * g
    max_side = 2 * rows + rows * nclass + rans.max_tables_bytes(g, 1 << k)
    if not min_side <= side_raw_len <= max_side:
        raise FormatError(f"Side_Raw_Length {side_raw_len} outside [{min_side}, {max_side}]",
                          field="Side_Raw_Length", offset=offset + 12)
    if nwords > n + 2 * ways or nwords < 2 * ways:
        raise FormatError(f"Num_Words {nwords} impossible for {n} symbols", field="Num_Words", offset=offset + 16)
    low_len = rans.packed_size(n, lowbits)
    expect = FIXED_SIZE + side_len + 2 * nwords + low_len
    if len(mv) != expect if exact_payload else len(mv) < expect:
        raise FormatError(f"payload has {len(mv)} bytes, its fields add up to {expect}",
                          field="Side_Length", offset=offset + 8)
    p = FIXED_SIZE
    side_z = mv[p:p + side_len]
    # The frame must declare its content size, and it must be Side_Raw_Length:
    # python-zstandard allocates whatever a frame declares, so check first.
    try:
        declared = zstandard.frame_content_size(side_z)
    except zstandard.ZstdError as e:
        raise FormatError(f"side information is not a zstd frame: {e}", field="Side", offset=offset + p) from None
    if declared != side_raw_len:
        raise FormatError(f"zstd frame declares {declared} bytes, Side_Raw_Length says {side_raw_len}",
                          field="Side", offset=offset + p)
    try:
        side = _side_decompressor().decompress(side_z, max_output_size=side_raw_len, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise FormatError(f"side information is not a valid zstd frame: {e}", field="Side", offset=offset + p) from None
    if len(side) != side_raw_len:
        raise FormatError(f"side information is {len(side)} bytes, Side_Raw_Length says {side_raw_len}",
                          field="Side", offset=offset + p)
    refs = np.frombuffer(side, dtype="<u2", count=rows)
    if refs.size and int(refs.max()) >= 1 << (k - 1):
        raise FormatError("a reference symbol has its sign bit set or exceeds the alphabet", field="Side",
                          offset=offset + p)
    # the context map, seen with the 3 bytes of the tables after it (the vector kernels read each entry with a
    # 32-bit load)
    ctx_padded = np.frombuffer(side, dtype=np.uint8, count=rows * nclass + 3, offset=2 * rows)
    ctx_map = ctx_padded[:rows * nclass].reshape(rows, nclass)
    if ctx_map.size and int(ctx_map.max()) >= g:
        raise FormatError(f"context map names table {int(ctx_map.max())} of {g}", field="Side", offset=offset + p)
    tables = np.frombuffer(side, dtype=np.uint8, offset=2 * rows + rows * nclass)
    tables_offset = offset + p
    p += side_len
    ahead = ways + 2  # the words the vector kernels read past a stream's last one: in place if the raw bits hold them
    if low_len >= 2 * ahead:
        words_ahead = np.frombuffer(mv, dtype="<u2", count=nwords + ahead, offset=p)
        words = words_ahead[:nwords]
    else:
        words_ahead, words = None, np.frombuffer(mv[p:p + 2 * nwords], dtype="<u2")
    parsed = rans.Parsed(words, ctx_map, (sb, ways, k, nclass, lowbits), words_ahead, ctx_padded)
    st = rans.Stream(words, refs, ctx_map, None, sb, ways, k, nclass, lowbits, mv[p + 2 * nwords:expect], offset + p,
                     offset + p + 2 * nwords, tables, g, tables_offset, parsed)
    return (st.dense() if dense else st), expect


@register_codec
class FloatCtxRans(Codec):
    """Bit-exact float coding (tier ``lossless``); ``params`` are the encoder options, filled by
    :func:`check_config` (all of them are also recorded in each payload)."""

    codec_id = CODEC_ID

    @classmethod
    def configure(cls, options: dict, dtype: str) -> "FloatCtxRans":
        return cls(check_config(dict(options), dtype))

    def encode(self, t, where: Slice, prediction=None) -> bytes:
        return encode(bit_patterns(t), where.dtype, self.params)

    def decode(self, payload, where: Slice, prediction=None, out=None) -> np.ndarray:
        return decode(payload, where.shape, where.dtype, offset=where.offset, out=out)

    decode_batch = 3  # the vector kernels' streams per loop (entropy/_lanes_simd.py)

    def decode_many(self, items: list) -> list:
        return decode_many([(payload, where.shape, where.dtype, where.offset, out) for payload, where, out in items])
