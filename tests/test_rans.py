"""The lane coder: Numba kernels vs the pure-Python reference, round trips, bad streams."""

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kvcodec.entropy import _lanes_simd, rans
from kvcodec.entropy._rans_ref import unpack_bits_ref
from kvcodec.errors import FormatError


def decode_syms(words, refs, ctx_map, freq, sb, ways, kbits, nclass, rows, ntok):
    """Symbols only: lowbits 0, one output column per row."""
    out = np.zeros((rows, ntok, 1), dtype=np.uint16)
    rans.lanes_decode(words, refs, ctx_map, freq, sb, ways, kbits, nclass, 0, b"", out)
    return out[:, :, 0]


def _problem(rng, rows, ntok, kbits, nclass, ntables, skew):
    a = 1 << kbits
    if skew:
        base = rng.integers(0, a - 4, size=(rows, 1))
        syms = (base + rng.integers(0, 4, size=(rows, ntok))).astype(np.uint16)
    else:
        syms = rng.integers(0, a, size=(rows, ntok)).astype(np.uint16)
    refs = rng.integers(0, a >> 1, size=rows).astype(np.uint16)
    ctx_map = rng.integers(0, ntables, size=(rows, nclass)).astype(np.uint8)
    ctx = rans.contexts(syms, refs, ctx_map, kbits, nclass)
    counts = np.zeros((ntables, a), np.int64)
    np.add.at(counts, (ctx.ravel(), syms.ravel().astype(np.int64)), 1)
    return syms, refs, ctx_map, counts


@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 9), ntok=st.integers(1, 40),
       kbits=st.integers(3, 10), nclass=st.sampled_from([1, 6]), ntables=st.integers(1, 4),
       ways=st.integers(1, 9), skew=st.booleans(), extra_bits=st.integers(1, 5))
def test_numba_matches_reference_and_round_trips(seed, rows, ntok, kbits, nclass, ntables, ways, skew,
                                                 extra_bits):
    rng = np.random.default_rng(seed)
    syms, refs, ctx_map, counts = _problem(rng, rows, ntok, kbits, nclass, ntables, skew)
    sb = min(15, max(8, kbits + extra_bits))
    freq = rans.normalize_counts(counts, sb)
    words = rans.lanes_encode(syms, refs, ctx_map, freq, sb, ways, kbits, nclass)
    got = decode_syms(words, refs, ctx_map, freq, sb, ways, kbits, nclass, rows, ntok)
    np.testing.assert_array_equal(got, syms)
    given = rans.contexts(syms, refs, ctx_map, kbits, nclass)  # the tables given instead of found on the way
    np.testing.assert_array_equal(rans.lanes_encode(syms, refs, ctx_map, freq, sb, ways, kbits, nclass, ctx=given),
                                  words)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVCODEC_BACKEND", "python")
        ref_words = rans.lanes_encode(syms, refs, ctx_map, freq, sb, ways, kbits, nclass)
        np.testing.assert_array_equal(ref_words, words)
        np.testing.assert_array_equal(
            decode_syms(words, refs, ctx_map, freq, sb, ways, kbits, nclass, rows, ntok), syms)


@given(seed=st.integers(0, 2**32 - 1), bh=st.integers(1, 3), groups=st.integers(1, 3), ntok=st.integers(1, 40),
       kbits=st.integers(3, 12), nclass=st.sampled_from([1, 6]), ntables=st.sampled_from([1, 2, 3, 4, 255]),
       ways=st.sampled_from([2, 3, 4, 5, 8, 16, 32]), skew=st.booleans(), extra_bits=st.integers(0, 5),
       width=st.integers(0, 25))
def test_vector_encoder_writes_the_scalar_encoders_words(seed, bh, groups, ntok, kbits, nclass, ntables, ways,
                                                         skew, extra_bits, width):
    """The vector encoder (:mod:`kvcodec.entropy._encode_simd`), reading a ``[BH, tokens, D]`` array in place,
    writes the words of the scalar Numba encoder and of the pure-Python reference on the same matrix laid out as
    ``[rows, tokens]``; the raw low bits packed in place equal the reference's too.  Frequencies reach both
    extremes: ``Scale_Bits`` 15 and single-symbol tables (``freq = 2**Scale_Bits``, no renormalisation ever)."""
    rng = np.random.default_rng(seed)
    dim = ways * groups
    rows = bh * dim
    syms, refs, ctx_map, counts = _problem(rng, rows, ntok, kbits, nclass, ntables, skew)
    if rng.random() < 0.2:  # one symbol everywhere: each used table holds all the mass on it
        syms[:] = syms[0, 0]
        ctx = rans.contexts(syms, refs, ctx_map, kbits, nclass)
        counts[:] = 0
        np.add.at(counts, (ctx.ravel(), syms.ravel().astype(np.int64)), 1)
    sb = min(15, max(8, kbits + extra_bits))
    freq = rans.normalize_counts(counts, sb)
    syms3 = np.ascontiguousarray(syms.reshape(bh, dim, ntok).transpose(0, 2, 1))
    before = dict(rans.ENCODE_SYMBOLS)
    got = rans.lanes_encode(syms3, refs, ctx_map, freq, sb, ways, kbits, nclass)
    if rans.vector_kernels():  # the vector encoder ran (else this machine has none and the test compares less)
        assert rans.ENCODE_SYMBOLS.get(f"vector_w{ways}", 0) == before.get(f"vector_w{ways}", 0) + syms.size
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVCODEC_VECTOR", "0")
        np.testing.assert_array_equal(got, rans.lanes_encode(syms, refs, ctx_map, freq, sb, ways, kbits, nclass))
        mp.setenv("KVCODEC_BACKEND", "python")
        np.testing.assert_array_equal(got, rans.lanes_encode(syms, refs, ctx_map, freq, sb, ways, kbits, nclass))
    np.testing.assert_array_equal(decode_syms(got, refs, ctx_map, freq, sb, ways, kbits, nclass, rows, ntok), syms)
    words = rng.integers(0, 1 << 32, size=(rows, ntok), dtype=np.uint64).astype(np.uint32)
    words3 = np.ascontiguousarray(words.reshape(bh, dim, ntok).transpose(0, 2, 1))
    packed = rans.pack_low_bits(words3, width, ways)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVCODEC_BACKEND", "python")
        assert packed == rans.pack_low_bits(words, width, ways)


def test_dense_decoder_inputs_in_one_call():
    """The dense decoders' inputs made in one compiled call are the tables build_decode_tables makes from the
    cumulative frequencies, the words with ``ways`` zero words, the raw bits as 64-bit words with two zero
    words; a table summing past 2**scale_bits builds nothing (lanes_decode: ValueError)."""
    from kvcodec.entropy._rans_numba import build_decode_tables, dense_decode_inputs

    rng = np.random.default_rng(4)
    counts = rng.integers(0, 50, size=(3, 40)) * (rng.random((3, 40)) < 0.5)
    counts[:, 0] += 1
    freq = rans.normalize_counts(counts, 10)
    words = rng.integers(0, 1 << 16, size=37).astype(np.uint16)
    raw = rng.integers(0, 256, size=13).astype(np.uint8)
    ok, entry, symt, padded, raw64 = dense_decode_inputs(freq, 10, words, 8, raw)
    want_e, want_s = np.zeros((3, 1024), np.uint32), np.zeros((3, 1024), np.uint16)
    build_decode_tables(freq, rans.cumulative(freq), want_e, want_s)
    assert ok
    np.testing.assert_array_equal(entry, want_e)
    np.testing.assert_array_equal(symt, want_s)
    np.testing.assert_array_equal(padded, np.concatenate([words, np.zeros(8, np.uint16)]))
    r8 = raw64.view(np.uint8)
    assert raw64.shape == (4,) and r8[:13].tobytes() == raw.tobytes() and not r8[13:].any()
    bad = freq.copy()
    bad[1, 5] += 1
    assert not dense_decode_inputs(bad, 10, words, 8, raw)[0]
    out = np.zeros((1, 37, 1), np.uint16)
    with pytest.raises(ValueError, match="sums past"):
        rans.lanes_decode(words, np.zeros(1, np.uint16), np.zeros((1, 1), np.uint8), bad[1:2], 10, 8, 6, 1, 0, b"",
                          out)


def test_hand_computed_stream():
    # One lane, one table over 2 symbols with freq [3, 1] at scale 2**8... scaled: f = [192, 64] of 256.
    # Encoding "1" from state L = 65536: x < f << 24, so no output; x' = (x // 64) << 8 + x % 64 + 192.
    freq = np.array([[192, 64]], dtype=np.uint32)
    syms = np.array([[1]], dtype=np.uint16)
    refs = np.zeros(1, np.uint16)
    cmap = np.zeros((1, 1), np.uint8)
    x = ((65536 // 64) << 8) + 65536 % 64 + 192
    words = rans.lanes_encode(syms, refs, cmap, freq, 8, 1, 2, 1)
    assert words.tolist() == [x >> 16, x & 0xFFFF]


def test_normalize_counts_properties():
    rng = np.random.default_rng(5)
    for _ in range(50):
        counts = rng.integers(0, 1000, size=(3, 70)) * (rng.random((3, 70)) < 0.3)
        counts[0, 0] += 1
        f = rans.normalize_counts(counts, 10)
        assert (f.sum(axis=1) == 1024).all()
        assert ((counts > 0) <= (f > 0)).all()


@pytest.mark.parametrize("backend", ["numba", "python"])
def test_encoder_statistics_reject_what_they_cannot_code(backend, monkeypatch):
    """Both backends refuse the same inputs with ValueError: more distinct symbols than 2**scale_bits, negative
    counts, no symbols, a table with no frequency, a symbol wider than kbits."""
    monkeypatch.setenv("KVCODEC_BACKEND", backend)
    with pytest.raises(ValueError, match="distinct"):
        rans.normalize_counts(np.ones((1, 300), np.int64), 8)
    with pytest.raises(ValueError, match="non-negative"):
        rans.normalize_counts(np.array([[1, -1]]), 8)
    with pytest.raises(ValueError, match="non-negative"):
        rans.normalize_counts(np.zeros((3, 0), np.int64), 8)
    with pytest.raises(ValueError, match="no non-zero"):
        rans.pack_tables(np.array([[0, 3, 0], [0, 0, 0]]))
    with pytest.raises(ValueError, match="exceeds 3 bits"):
        rans.row_stats(np.array([[0, 9, 9, 1]], np.uint16), 3, 1)


@given(seed=st.integers(0, 2**32 - 1), nctx=st.integers(1, 6), nsym=st.integers(1, 300), sb=st.integers(8, 15),
       kind=st.sampled_from(["small", "heavy", "huge", "one"]))
def test_tables_from_counts_match_numpy(seed, nctx, nsym, sb, kind):
    """The compiled frequency normalisation and table packing give the NumPy formulation's (the python backend's)
    frequencies and bytes: with many rare symbols (mass taken back from the largest), heavy tails, counts near
    2**31, empty rows and single symbols."""
    rng = np.random.default_rng(seed)
    if kind == "small":
        counts = rng.integers(0, 5, size=(nctx, nsym))
    elif kind == "heavy":
        counts = (rng.pareto(1.0, size=(nctx, nsym)) * 10).astype(np.int64) * (rng.random((nctx, nsym)) < 0.3)
    elif kind == "huge":
        counts = rng.integers(0, 2**31, size=(nctx, nsym)) * (rng.random((nctx, nsym)) < 0.5)
    else:
        counts = np.zeros((nctx, nsym), np.int64)
        counts[:, rng.integers(0, nsym)] = rng.integers(0, 3, nctx)
    if ((counts > 0).sum(axis=1) > 1 << sb).any():
        with pytest.raises(ValueError):
            rans.normalize_counts(counts, sb)
        return
    got = rans.normalize_counts(counts, sb)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVCODEC_BACKEND", "python")
        want = rans.normalize_counts(counts, sb)
        want_bytes = rans.pack_tables(want)
    assert got.dtype == want.dtype == np.uint32
    np.testing.assert_array_equal(got, want)
    assert rans.pack_tables(got) == want_bytes


@pytest.mark.parametrize("backend", ["numba", "python"])
@pytest.mark.parametrize("rows,ways", [(4, 4), (3, 4), (11, 8), (5, 8)])  # full groups, partial ones
def test_corrupt_streams_raise_format_error(monkeypatch, backend, rows, ways):
    monkeypatch.setenv("KVCODEC_BACKEND", backend)
    rng = np.random.default_rng(1)
    syms, refs, cmap, counts = _problem(rng, rows, 30, 6, 6, 2, True)
    freq = rans.normalize_counts(counts, 10)
    words = rans.lanes_encode(syms, refs, cmap, freq, 10, ways, 6, 6)
    np.testing.assert_array_equal(decode_syms(words, refs, cmap, freq, 10, ways, 6, 6, rows, 30), syms)
    for bad in (words[:-1], words[:3], np.concatenate([words, [7]]).astype(np.uint16)):
        with pytest.raises(FormatError):
            decode_syms(bad, refs, cmap, freq, 10, ways, 6, 6, rows, 30)
    zero_state = words.copy()
    zero_state[0] = 0
    with pytest.raises(FormatError):
        decode_syms(zero_state, refs, cmap, freq, 10, ways, 6, 6, rows, 30)


def test_single_bit_flips_are_mostly_caught_by_the_stream_itself():
    rng = np.random.default_rng(2)
    syms, refs, cmap, counts = _problem(rng, 3, 20, 5, 6, 2, True)
    freq = rans.normalize_counts(counts, 9)
    words = rans.lanes_encode(syms, refs, cmap, freq, 9, 2, 5, 6)
    raw = words.tobytes()
    caught = silent_same = 0
    for bit in range(len(raw) * 8):
        b = bytearray(raw)
        b[bit // 8] ^= 1 << (bit % 8)
        w = np.frombuffer(bytes(b), dtype=np.uint16)
        try:
            out = decode_syms(w, refs, cmap, freq, 9, 2, 5, 6, 3, 20)
        except FormatError:
            caught += 1
            continue
        silent_same += np.array_equal(out, syms)
    # The final-state check (every state must return to 2**16) catches nearly every flip;
    # what slips through is caught by the container's payload checksum.
    assert caught >= 0.9 * len(raw) * 8, caught
    assert silent_same == 0


@given(st.lists(st.integers(0, 2**23 - 1), max_size=200), st.integers(1, 23))
def test_bit_packing_round_trip_and_reference(values, width):
    v = np.array(values, dtype=np.uint32) & np.uint32((1 << width) - 1)
    packed = rans.pack_bits(v, width)
    assert len(packed) == rans.packed_size(len(v), width)
    np.testing.assert_array_equal(unpack_bits_ref(packed, width, len(v)), v)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVCODEC_BACKEND", "python")
        assert rans.pack_bits(v, width) == packed


@pytest.mark.parametrize("ways", [1, 3, 4, 8])
@pytest.mark.parametrize("backend", ["numba", "python"])
def test_fused_decode_assembles_words(monkeypatch, backend, ways):
    """Symbols and raw low bits land in out[bh, t, d] for row bh * dim + d (unrolled and generic kernels)."""
    monkeypatch.setenv("KVCODEC_BACKEND", backend)
    rng = np.random.default_rng(ways)
    bh, ntok, dim, kbits, lowbits = 3, 17, 5, 7, 9
    full = rng.integers(0, 1 << 16, size=(bh, ntok, dim)).astype(np.uint16)
    rows = full.transpose(0, 2, 1).reshape(bh * dim, ntok)
    syms = rows >> lowbits
    refs = rng.integers(0, 1 << (kbits - 1), size=bh * dim).astype(np.uint16)
    cmap = rng.integers(0, 3, size=(bh * dim, 6)).astype(np.uint8)
    ctx = rans.contexts(syms.astype(np.uint16), refs, cmap, kbits, 6)
    counts = np.zeros((3, 1 << kbits), np.int64)
    np.add.at(counts, (ctx.ravel(), syms.ravel().astype(np.int64)), 1)
    freq = rans.normalize_counts(counts, 12)
    words = rans.lanes_encode(syms, refs, cmap, freq, 12, ways, kbits, 6)
    raw = rans.pack_bits(rans.coding_order(rows & ((1 << lowbits) - 1), ways), lowbits)
    out = np.zeros_like(full)
    rans.lanes_decode(words, refs, cmap, freq, 12, ways, kbits, 6, lowbits, raw, out)
    np.testing.assert_array_equal(out, full)
    bad = bytearray(raw)
    bad[-1] |= 0x80  # 3*17*5*9 bits = 2295: the last byte has one used bit
    with pytest.raises(FormatError, match="padding"):
        rans.lanes_decode(words, refs, cmap, freq, 12, ways, kbits, 6, lowbits, bytes(bad), out)


@pytest.mark.parametrize("backend", ["numba", "python"])
def test_table_round_trip_and_validation(backend, monkeypatch):
    monkeypatch.setenv("KVCODEC_BACKEND", backend)
    f = rans.normalize_counts(np.array([[0, 5, 0, 9, 0], [1, 0, 0, 0, 0]]), 8)
    packed = rans.pack_tables(f)
    np.testing.assert_array_equal(rans.unpack_tables(packed, 2, 5, 8), f)
    with pytest.raises(FormatError, match="sums to"):
        rans.unpack_tables(packed, 2, 5, 9)
    with pytest.raises(FormatError, match="ends early"):
        rans.unpack_tables(packed[:-1], 2, 5, 8)
    with pytest.raises(FormatError, match="left over"):
        rans.unpack_tables(packed + b"\0", 2, 5, 8)
    with pytest.raises(FormatError, match="outside alphabet"):
        rans.unpack_tables(packed, 2, 3, 8)


def _words_problem(rng, bh, ntok, dim, kbits, lowbits, nclass, ntables, skew):
    """A full [bh, ntok, dim] matrix of (kbits + lowbits)-bit words, its symbols' context problem and raw bits."""
    dtype = np.uint16 if kbits + lowbits <= 16 else np.uint32
    a = 1 << kbits
    rows_n = bh * dim
    if skew and a > 4:
        base = rng.integers(0, a - 4, size=(rows_n, 1))
        syms = (base + rng.integers(0, 4, size=(rows_n, ntok))).astype(np.uint16)
    else:
        syms = rng.integers(0, a, size=(rows_n, ntok)).astype(np.uint16)
    low = rng.integers(0, 1 << lowbits, size=(rows_n, ntok)).astype(np.uint64) if lowbits else np.zeros(
        (rows_n, ntok), np.uint64)
    rows = (syms.astype(np.uint64) << np.uint64(lowbits)) | low
    full = np.ascontiguousarray(rows.reshape(bh, dim, ntok).transpose(0, 2, 1).astype(dtype))
    refs = rng.integers(0, a >> 1, size=rows_n).astype(np.uint16)
    cmap = rng.integers(0, ntables, size=(rows_n, nclass)).astype(np.uint8)
    ctx = rans.contexts(syms, refs, cmap, kbits, nclass)
    counts = np.zeros((ntables, a), np.int64)
    np.add.at(counts, (ctx.ravel(), syms.ravel().astype(np.int64)), 1)
    return full, syms, low, refs, cmap, counts


@given(seed=st.integers(0, 2**32 - 1), bh=st.integers(1, 3), groups=st.integers(1, 3), ntok=st.integers(1, 30),
       kbits=st.integers(2, 11), lowbits=st.integers(0, 21), nclass=st.sampled_from([1, 6]),
       ntables=st.integers(1, 4), ways=st.sampled_from(rans.FAST_WAYS), skew=st.booleans(), sb=st.integers(8, 15))
def test_local_table_decoder_matches_the_reference(seed, bh, groups, ntok, kbits, lowbits, nclass, ntables, ways,
                                                   skew, sb):
    """The fast_w* kernels (lane groups inside one head, <= 256 symbols per table) decode every stream the
    general kernels and the pure-Python reference decode, to the same words."""
    rng = np.random.default_rng(seed)
    dim = ways * groups
    full, syms, low, refs, cmap, counts = _words_problem(rng, bh, ntok, dim, kbits, lowbits, nclass, ntables, skew)
    if (counts > 0).sum(axis=1).max() > 1 << sb:
        sb = 15 if kbits <= 11 else sb
    freq = rans.normalize_counts(counts, sb)
    words = rans.lanes_encode(syms, refs, cmap, freq, sb, ways, kbits, nclass)
    raw = rans.pack_bits(rans.coding_order(low, ways), lowbits)
    local = (freq > 0).sum(axis=1).max() <= 256
    table = "direct" if 2 * sb + kbits <= 32 else "indexed"
    for vector in ("1", "0"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("KVCODEC_VECTOR", vector)
            want = (f"vector_w{ways}/{table}" if vector == "1" else f"fast_w{ways}") if local else {
                4: "decode_w4", 8: "decode_w8"}.get(ways, "generic")
            assert rans.decode_kernel(ways, dim, freq, sb, kbits, lowbits) == want
            for prefix_table in ((True, False) if vector == "1" else (True,)):  # refill offsets: table or shifts
                mp.setattr(_lanes_simd, "PREFIX_TABLE", prefix_table)
                out = np.zeros_like(full)
                rans.lanes_decode(words, refs, cmap, freq, sb, ways, kbits, nclass, lowbits, raw, out)
                np.testing.assert_array_equal(out, full)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVCODEC_BACKEND", "python")
        ref = np.zeros_like(full)
        rans.lanes_decode(words, refs, cmap, freq, sb, ways, kbits, nclass, lowbits, raw, ref)
        np.testing.assert_array_equal(ref, full)


def test_kernel_choice_and_fallbacks():
    """More than 256 symbols in a table, or lane groups across heads: the general kernels, same words."""
    rng = np.random.default_rng(5)
    cases = ((8, 10, 6, False, "decode_w8"), (12, 6, 6, True, "decode_w8"), (16, 6, 6, True, "vector_w8/direct"),
             (16, 10, 6, True, "vector_w8/indexed"), (16, 6, 26, True, "fast_w8"))
    for dim, kbits, lowbits, skew, want in cases:
        full, syms, low, refs, cmap, counts = _words_problem(rng, 2, 300, dim, kbits, lowbits, 6, 2, skew)
        freq = rans.normalize_counts(counts, 12)
        assert rans.decode_kernel(8, dim, freq, 12, kbits, lowbits) == want
        words = rans.lanes_encode(syms, refs, cmap, freq, 12, 8, kbits, 6)
        raw = rans.pack_bits(rans.coding_order(low, 8), lowbits)
        out = np.zeros_like(full)
        rans.lanes_decode(words, refs, cmap, freq, 12, 8, kbits, 6, lowbits, raw, out)
        np.testing.assert_array_equal(out, full)
    assert rans.decode_kernel(3, 9, freq) == "generic"


def test_vector_kernels_build_here():
    """The vector decoders compile on this machine (llvmlite, a Numba dependency): the speed BENCHMARKS quotes."""
    assert rans.vector_kernels()


@pytest.mark.parametrize("vector", ["1", "0", "table-off"])
@pytest.mark.parametrize("ways", rans.FAST_WAYS)
@pytest.mark.parametrize("sb, lowbits", [(8, 0), (10, 5), (12, 5)])
def test_local_table_decoder_refuses_corrupt_streams(ways, vector, sb, lowbits, monkeypatch):
    """Truncated, over-long and zero-state streams are refused by name by every local-table kernel: the vector
    ones (refill offsets from a table or from shifts; with raw low bits, and without as index streams have
    them) and the scalar ones."""
    monkeypatch.setenv("KVCODEC_VECTOR", "0" if vector == "0" else "1")
    monkeypatch.setattr(_lanes_simd, "PREFIX_TABLE", vector != "table-off")
    rng = np.random.default_rng(ways)
    full, syms, low, refs, cmap, counts = _words_problem(rng, 2, 40, ways, 6, lowbits, 6, 2, True)
    freq = rans.normalize_counts(counts, sb)
    assert rans.decode_kernel(ways, ways, freq, sb, 6, lowbits) == (f"fast_w{ways}" if vector == "0" else
                                                                    f"vector_w{ways}/direct")
    words = rans.lanes_encode(syms, refs, cmap, freq, sb, ways, 6, 6)
    raw = rans.pack_bits(rans.coding_order(low, ways), lowbits)
    out = np.zeros_like(full)
    rans.lanes_decode(words, refs, cmap, freq, sb, ways, 6, 6, lowbits, raw, out)
    np.testing.assert_array_equal(out, full)
    zero_state = words.copy()
    zero_state[0] = 0
    for bad, what in ((words[:-1], "ended|final"), (np.concatenate([words, [7]]).astype(np.uint16), "left over"),
                      (zero_state, "initial")):
        with pytest.raises(FormatError, match=what):
            rans.lanes_decode(bad, refs, cmap, freq, sb, ways, 6, 6, lowbits, raw, np.zeros_like(full))


@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 12), ntok=st.integers(1, 50), kbits=st.integers(2, 12),
       nclass=st.sampled_from([1, 6]), width=st.integers(0, 20), ways=st.integers(1, 9))
def test_encoder_statistics_and_low_bits_match_numpy(seed, rows, ntok, kbits, nclass, width, ways):
    """The encoder's one-pass Numba statistics and low-bit packing equal the NumPy formulation (the python
    backend), so every encoder choice built on them, hence every byte, is the same."""
    rng = np.random.default_rng(seed)
    syms = rng.integers(0, 1 << kbits, size=(rows, ntok)).astype(np.uint16)
    words = rng.integers(0, 1 << 31, size=(rows, ntok)).astype(np.uint32)
    got = rans.row_stats(syms, kbits, nclass), rans.pack_low_bits(words, width, ways)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVCODEC_BACKEND", "python")
        want = rans.row_stats(syms, kbits, nclass), rans.pack_low_bits(words, width, ways)
    np.testing.assert_array_equal(got[0][0], want[0][0])
    for a, b in zip(got[0][1], want[0][1]):
        np.testing.assert_array_equal(a, b)
    assert got[1] == want[1]


def _stream(rng, bh, ntok, dim, kbits, lowbits, ways, sb, skew=True, offset=0):
    full, syms, low, refs, cmap, counts = _words_problem(rng, bh, ntok, dim, kbits, lowbits, 6, 3, skew)
    freq = rans.normalize_counts(counts, sb)
    words = rans.lanes_encode(syms, refs, cmap, freq, sb, ways, kbits, 6)
    raw = rans.pack_bits(rans.coding_order(low, ways), lowbits)
    st = rans.Stream(words, refs, cmap, freq, sb, ways, kbits, 6, lowbits, raw, offset, offset + 1)
    return st, full


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7])
def test_streams_decoded_together_equal_each_alone(n):
    """lanes_decode_many runs the vector kernels' streams several at a time; every stream's words are the ones
    it decodes to alone, whatever the mix of kernels, shapes and batch sizes."""
    rng = np.random.default_rng(n)
    kinds = [(2, 40, 16, 6, 6, 8, 10), (2, 40, 16, 10, 6, 8, 12), (1, 33, 16, 6, 26, 8, 10),
             (2, 40, 16, 9, 7, 8, 11), (1, 20, 32, 6, 6, 16, 10), (2, 40, 16, 6, 6, 8, 10), (1, 9, 8, 10, 22, 8, 10)]
    jobs, want = [], []
    for i in range(n):
        bh, ntok, dim, kbits, lowbits, ways, sb = kinds[i % len(kinds)]
        st, full = _stream(rng, bh, ntok, dim, kbits, lowbits, ways, sb, skew=i != 3)
        jobs.append((st, np.zeros(full.reshape(bh, ntok, dim).shape, dtype=full.dtype)))
        want.append(full)
    rans.KERNEL_SYMBOLS.clear()
    rans.lanes_decode_many(jobs)
    for (st, out), full in zip(jobs, want):
        np.testing.assert_array_equal(out, full)
    assert sum(rans.KERNEL_SYMBOLS.values()) == sum(f.size for f in want)
    if n >= 3:
        assert {"vector_w8/direct", "vector_w8/indexed", "fast_w8"} <= set(rans.KERNEL_SYMBOLS)


@pytest.mark.parametrize("bad", [0, 1, 2])
def test_a_corrupt_stream_among_others_is_named(bad):
    """One damaged stream in a batch decoded together: the error names that stream's offset."""
    rng = np.random.default_rng(bad)
    jobs = []
    for i in range(3):
        st, full = _stream(rng, 2, 40, 16, 6, 6, 8, 10, offset=1000 * (i + 1))
        if i == bad:
            st = st._replace(words=st.words[:-1])
        jobs.append((st, np.zeros_like(full)))
    with pytest.raises(FormatError, match="ended|final") as e:
        rans.lanes_decode_many(jobs)
    assert e.value.offset == 1000 * (bad + 1)


def test_max_symbols_counts_like_numpy():
    """decode_kernel's count of the largest table's symbols (compiled) is NumPy's count along the rows."""
    rng = np.random.default_rng(3)
    for shape in [(1, 1), (32, 1024), (5, 300), (0, 7)]:
        freq = (rng.random(shape) < rng.random()).astype(np.uint32) * rng.integers(1, 9, shape, dtype=np.uint32)
        want = int(np.count_nonzero(freq, axis=1).max()) if shape[0] else 0
        assert rans._max_symbols(freq) == want


def _skewed_words(rng, dtype: str, shape) -> np.ndarray:
    """Float bit patterns whose top 6 bits take a few values and low 4 bits are random (a payload that codes)."""
    dt = np.uint32 if dtype == "float32" else np.uint16
    sym = rng.integers(0, 6, size=shape).astype(np.uint64)
    low = rng.integers(0, 1 << 4, size=shape).astype(np.uint64)
    return ((sym << np.uint64(8 * np.dtype(dt).itemsize - 6)) | low).astype(dt)


def _packed_problem(seed, ntables, nsym, sb, wide):
    """Packed tables of ``ntables`` random tables over ``nsym`` symbols (``wide``: one with more than 256
    symbols, when the alphabet and 2**sb allow it) and their dense frequencies."""
    rng = np.random.default_rng(seed)
    counts = np.zeros((ntables, nsym), np.int64)
    for t in range(ntables):
        most = min(nsym, 300, 1 << sb)  # as many symbols as the alphabet and 2**sb allow, up to 300
        k = most if wide and t == ntables - 1 else int(rng.integers(1, min(most, 60) + 1))
        cols = rng.choice(nsym, size=k, replace=False)
        counts[t, cols] = rng.integers(1, 1000, size=k)
    freq = rans.normalize_counts(counts, sb)
    return rans.pack_tables(freq), freq


@given(seed=st.integers(0, 2**32 - 1), ntables=st.integers(1, 6), kbits=st.integers(2, 11), sb=st.integers(8, 15),
       wide=st.booleans(), cut=st.integers(-3, 3), flip=st.integers(-1, 400))
@example(seed=1, ntables=2, kbits=10, sb=10, wide=True, cut=0, flip=-1)  # a valid table of 300 symbols: code 5
@example(seed=2, ntables=3, kbits=9, sb=12, wide=True, cut=0, flip=3)  # a damaged first table, then a wide one
def test_packed_tables_build_what_unpacking_builds(seed, ntables, kbits, sb, wide, cut, flip):
    """The vector decoders' tables built straight from the packed bytes (one pass) are those built from the
    unpacked frequencies, and damaged bytes give unpack_tables' own verdict (code, table, values); code 5 only
    for a table of more than 256 symbols, which the local-table kernels do not take."""
    from kvcodec.entropy._rans_numba import build_direct_table, build_local_tables, packed_local_tables, unpack_tables

    nsym = 1 << kbits
    packed, freq = _packed_problem(seed, ntables, nsym, sb, wide)
    buf = bytearray(packed)
    if cut < 0:
        buf = buf[:cut]
    elif cut:
        buf += bytes(cut)
    if 0 <= flip < len(buf):
        buf[flip] ^= 1 + flip % 255
    buf = np.frombuffer(bytes(buf), np.uint8)
    dense = np.zeros((ntables, nsym), np.uint32)
    want = tuple(int(v) for v in unpack_tables(buf, sb, dense))
    most = int((dense > 0).sum(axis=1).max())
    for direct in (True, False):
        table = np.zeros((ntables << sb) if direct else 0, np.uint32)
        slot8 = np.zeros(4 if direct else (ntables << sb) + 4, np.uint8)
        info = np.zeros(0 if direct else ntables << 8, np.uint64)
        got = tuple(int(v) for v in packed_local_tables(buf, nsym, sb, direct, table, slot8, info))
        if wide and kbits >= 9 and sb >= 9 and cut == 0 and flip < 0:
            assert got[0] == 5  # undamaged, with a table of more than 256 symbols
        if got[0] == 5:  # a wide table, valid: unpacking finds no fault, or one in a later table or after them
            assert want[0] in (0, 4) or want[1] > got[1]
            assert (dense[got[1]] > 0).sum() > 256
            continue
        assert got == want
        if want[0] == 0:
            assert most <= 256
            if direct:
                ref = np.zeros_like(table)
                build_direct_table(dense, sb, ref)
                np.testing.assert_array_equal(table, ref)
            else:
                ref8, refi = np.zeros_like(slot8), np.zeros_like(info)
                assert build_local_tables(dense, sb, ref8, refi)
                np.testing.assert_array_equal(slot8, ref8)
                np.testing.assert_array_equal(info, refi)


@pytest.mark.parametrize("dtype,ways,shape", [("bfloat16", 8, (1, 3, 64, 64)), ("float16", 4, (2, 1, 40, 8)),
                                              ("float32", 8, (1, 2, 40, 16)), ("bfloat16", 16, (1, 1, 9, 32)),
                                              ("float32", 16, (1, 1, 24, 16))])
def test_packed_streams_decode_as_dense_ones(dtype, ways, shape):
    """A payload parsed with its tables left packed (the lossless and lossy decoders' path) decodes to the words
    of the same payload parsed with dense tables, for narrow (one 64-bit load per step) and wide (a load per
    lane) raw fields, 4, 8 and 16 lanes; a damaged table gives the dense path's error."""
    from kvcodec.codecs import float_ctx_rans as fc

    words = _skewed_words(np.random.default_rng(sum(shape)), dtype, shape)
    b, h, s, d = shape
    payload = fc.encode(words, dtype, {"ways": ways, "scale_bits": 10})
    assert payload[0] == fc.MODE_CODED
    mv = memoryview(payload)
    flat = (b * h, s, d)
    dense, _ = fc.parse_symbols(mv, flat, 8 * words.itemsize)
    packed, _ = fc.parse_symbols(mv, flat, 8 * words.itemsize, dense=False)
    assert packed.freq is None and dense.tables is None
    np.testing.assert_array_equal(packed.dense().freq, dense.freq)
    outs = [np.zeros(flat, words.dtype) for _ in range(2)]
    rans.KERNEL_SYMBOLS.clear()
    from kvcodec.entropy import _rans_numba

    built = []
    real = _rans_numba.packed_local_tables
    with pytest.MonkeyPatch.context() as mp:  # the packed stream takes the one-pass builder
        mp.setattr(_rans_numba, "packed_local_tables", lambda *a: built.append(1) or real(*a))
        rans.lanes_decode_many([(dense, outs[0]), (packed, outs[1])])
    assert built == [1]
    for o in outs:
        np.testing.assert_array_equal(o, words.reshape(flat))
    assert all(k.startswith("vector") for k in rans.KERNEL_SYMBOLS)
    bad = bytearray(packed.tables.tobytes())
    bad[4] ^= 0x40  # the first table's first frequency: the sum no longer holds
    zeroed = packed.words.copy()
    zeroed[:2] = 0  # an initial state below 2**16 too: the tables' fault is still the one reported, as before
    for st_ in (packed._replace(tables=np.frombuffer(bytes(bad), np.uint8)),
                packed._replace(tables=np.frombuffer(bytes(bad), np.uint8), words=zeroed)):
        with pytest.raises(FormatError, match="frequency table 0: sums to") as e:
            rans.lanes_decode_many([(st_, np.zeros(flat, words.dtype))])
        with pytest.raises(FormatError, match="frequency table 0: sums to") as e2:
            st_.dense()
        assert e.value.offset == e2.value.offset == packed.tables_offset


@pytest.mark.skipif(not _lanes_simd.available(), reason="the vector kernels do not build here")
@pytest.mark.parametrize("dtype,ways,shape,opts", [("bfloat16", 8, (1, 3, 40, 64), {}),
                                                   ("bfloat16", 8, (1, 2, 30, 16), {"context": "none"}),
                                                   ("float32", 16, (1, 2, 40, 16), {}),
                                                   ("float16", 4, (1, 1, 3, 4), {"coded_bits": 9}),
                                                   ("float32", 16, (1, 1, 1, 16), {"coded_bits": 16})])
def test_parsed_streams_are_read_through_the_payloads_views(dtype, ways, shape, opts, monkeypatch):
    """A stream as parse_symbols made it is read through the views it keeps (the words with their look-ahead
    in the payload, the context map with 3 bytes after it), after check_stream's checks: a zero high word of an
    initial state and non-zero padding bits give the same errors (message, field, offset) as without the views;
    a stream whose words or map were replaced since parsing, even by views of the same arrays, is read from its
    own arrays (one whose refs were replaced, through the views: they do not depend on the refs)."""
    from kvcodec.codecs import float_ctx_rans as fc

    words = _skewed_words(np.random.default_rng(7), dtype, shape)
    b, h, s, d = shape
    flat = (b * h, s, d)
    width = words.itemsize
    cfg = fc.check_config({"ways": ways, "scale_bits": 10, **opts}, dtype)
    lowbits = 8 * width - cfg["coded_bits"]
    w3 = words.reshape(flat)  # a Mode 1 payload even where storing the words raw would be smaller
    payload = b"".join([*fc.symbol_parts((w3 >> lowbits).astype(np.uint16), cfg["coded_bits"], cfg),
                        rans.pack_low_bits(w3, lowbits, ways)])

    def parsed(data):
        return fc.parse_symbols(memoryview(data), flat, 8 * width, offset=100, dense=False)[0]

    st = parsed(payload)
    ahead, ctx = st.parsed.ahead, st.parsed.ctx
    assert (ahead is None) == (len(st.raw) < 2 * (ways + 2))
    seen = []
    real_many, real_check = _lanes_simd.decode_many, rans.check_stream
    monkeypatch.setattr(_lanes_simd, "decode_many", lambda *a: seen.extend(a[-1]) or real_many(*a))
    monkeypatch.setattr(rans, "check_stream", lambda *a, **k: seen.append("check") or real_check(*a, **k))

    def decode(st_):  # (the words, or the error's message, field and offset; what the kernels were given)
        seen.clear()
        try:
            out = np.zeros(flat, words.dtype)
            rans.lanes_decode_many([(st_, out)])
            got = out
        except FormatError as e:
            got = (str(e), e.field, e.offset)
        return got, list(seen)

    out, calls = decode(st)
    np.testing.assert_array_equal(out, words.reshape(flat))
    assert calls[0] == "check"
    [prep] = calls[1:]
    assert prep.ctx is ctx and (prep.words is ahead if ahead is not None else prep.words.flags.owndata)

    def same_errors(st_):  # through the parsed path and through check_stream
        (a, _), (b, _) = decode(st_), decode(st_._replace(parsed=None))
        assert isinstance(a, tuple) and a == b
        return a

    nw = st.words.shape[0]
    words_at = len(payload) - len(st.raw) - 2 * nw  # the words' offset in the payload
    bad = bytearray(payload)
    bad[words_at:words_at + 2] = b"\0\0"  # lane 0's initial state: high word 0
    assert "initial state" in same_errors(parsed(bytes(bad)))[0]
    if (words.size * lowbits) % 8:
        bad = bytearray(payload)
        bad[-1] |= 0x80
        assert same_errors(parsed(bytes(bad)))[1] == "Raw_Bits"
    # replaced since parsing (copies, or other views of the same arrays): read from themselves
    base_words = ahead if ahead is not None else st.words
    replaced = [st._replace(words=st.words.copy()), st._replace(words=st.words[::-1]),
                st._replace(words=base_words[1:nw + 1]), st._replace(refs=st.refs.copy()),
                st._replace(ctx_map=ctx[1:1 + st.ctx_map.size].reshape(st.ctx_map.shape)),
                st._replace(ctx_map=st.ctx_map.copy())]
    for i, st_ in enumerate(replaced):
        got, calls = decode(st_)
        want, _ = decode(st_._replace(parsed=None))
        assert "check" in calls, i
        if isinstance(want, tuple):
            assert got == want, i
        else:
            np.testing.assert_array_equal(got, want)
            if i in (0, 3, 5):  # the same values: the same words
                np.testing.assert_array_equal(got, words.reshape(flat))
        preps = [c for c in calls if c != "check"]
        if i == 3:  # the refs replaced: the words and the map are still the parsed ones
            assert all(p.ctx is ctx and (ahead is None or p.words is ahead) for p in preps), i
        else:
            assert all(p.words is not ahead and p.ctx is not ctx for p in preps), i


def test_words_and_raw_bits_are_read_in_place_only_where_they_can_be():
    """The vector kernels read a payload's words in place when its raw bits follow them and hold the lanes'
    look-ahead, else a padded copy; the raw bits' last steps come from a zero-padded copy of their tail."""
    buf = np.arange(100, dtype=np.uint8)
    words, raw = buf[:40].view(np.uint16), buf[40:]
    ext = _lanes_simd.extend_words(words, raw, 8)
    assert ext is not None and ext.shape == (30,) and not ext.flags.writeable
    np.testing.assert_array_equal(ext, buf[:60].view(np.uint16))
    assert _lanes_simd.extend_words(words, raw[:19], 8) is None  # 20 bytes needed
    assert _lanes_simd.extend_words(words, buf[42:], 8) is None  # not adjacent
    assert _lanes_simd.extend_words(words.copy(), raw, 8) is None
    for n in (0, 1, 7, 8, 50, 63, 64, 65, 1000):
        raw = np.arange(n, dtype=np.uint8)
        for ways, lowbits in ((8, 6), (8, 22), (16, 25), (4, 1)):
            rtail, rlim, rts = _lanes_simd.raw_tail(raw, ways, lowbits)
            span = _lanes_simd.step_span(ways, lowbits)
            assert rlim + span <= n and rts <= max(0, rlim + 1)
            assert rtail.shape[0] >= n - rts + span and not rtail[n - rts:].any()
            np.testing.assert_array_equal(rtail[:n - rts], raw[rts:])


_GUARD = r"""
import ctypes, mmap, sys
import numpy as np
from kvcodec.codecs import float_ctx_rans as fc
from kvcodec.entropy import _lanes_simd, rans
from kvcodec.errors import FormatError
libc = ctypes.CDLL(None)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
page = mmap.PAGESIZE
in_place = []
real_many = _lanes_simd.decode_many
def spy(*a):
    in_place.extend(not st.words.flags.owndata for st in a[-1])  # a view of the payload, not a padded copy
    return real_many(*a)
_lanes_simd.decode_many = spy

def guarded(payload):
    # the payload between two unreadable pages: it ends where the second begins
    npages = len(payload) // page + 3
    m = mmap.mmap(-1, npages * page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    for at in (0, (npages - 1) * page):
        if libc.mprotect(base + at, page, 0) != 0:  # PROT_NONE
            raise OSError("mprotect failed")
    start = (npages - 1) * page - len(payload)
    m[start:start + len(payload)] = payload
    return m, memoryview(m)[start:start + len(payload)]

cases = [("bfloat16", 8, (1, 2, 40, 16), {}), ("float32", 8, (1, 2, 33, 16), {}),
         ("bfloat16", 16, (1, 1, 40, 32), {}), ("float16", 4, (2, 1, 40, 8), {}),
         ("float32", 16, (1, 1, 4, 16), {"coded_bits": 7}),  # 25 raw bits a value: 200 raw bytes
         ("float32", 16, (1, 1, 1, 16), {"coded_bits": 7}),  # 50 raw bytes, fewer than one step's loads
         ("float32", 16, (1, 1, 1, 16), {"coded_bits": 16}),  # 32 raw bytes: the words' look-ahead is 36
         ("bfloat16", 8, (1, 2, 40, 16), {"coded_bits": 16})]  # no raw bits: the words end the payload
ok = bad = 0
for i, (name, ways, shape, opts) in enumerate(cases):
    rng = np.random.default_rng(i)
    dt = np.uint32 if name == "float32" else np.uint16
    sym = rng.integers(0, 3, size=shape).astype(np.uint64)
    words = ((sym << np.uint64(8 * np.dtype(dt).itemsize - 2)) |
             rng.integers(0, 1 << 4, size=shape).astype(np.uint64)).astype(dt)
    # a Mode 1 payload even where storing the words raw would be smaller (fc.encode's choice)
    cfg = fc.check_config({"ways": ways, "scale_bits": 10, **opts}, name)
    lowbits = 8 * np.dtype(dt).itemsize - cfg["coded_bits"]
    w3 = words.reshape(shape[0] * shape[1], shape[2], shape[3])
    syms = (w3 >> lowbits).astype(np.uint16)
    payload = b"".join([*fc.symbol_parts(syms, cfg["coded_bits"], cfg), rans.pack_low_bits(w3, lowbits, ways)])
    m, view = guarded(payload)
    rans.KERNEL_SYMBOLS.clear()
    [got] = fc.decode_many([(view, shape, name, 0, None)])
    assert (got == words).all() and rans.KERNEL_SYMBOLS and all(k.startswith("vector") for k in rans.KERNEL_SYMBOLS)
    del view, got
    m.close()
    for j in range(40):  # damaged copies: any byte after the fixed fields, or a shorter payload
        dmg = bytearray(payload)
        at = int(rng.integers(20, len(dmg)))
        dmg[at] ^= int(rng.integers(1, 256))
        if j % 5 == 0:
            dmg = dmg[:-int(rng.integers(1, 4))]
        m, view = guarded(bytes(dmg))
        try:
            fc.decode_many([(view, shape, name, 0, None)])
            ok += 1
        except FormatError:
            bad += 1
        del view
        m.close()
if not any(in_place):
    raise SystemExit("no stream was read in place")
print("ok", ok, bad)
"""


@pytest.mark.skipif(not _lanes_simd.available(), reason="the vector kernels do not build here")
def test_in_place_reads_stay_inside_the_payload():
    """Payloads between two unreadable pages decode (whole, and damaged: a FormatError or words): the vector
    kernels' in-place reads of words and raw bits never leave them, raw bits shorter than one step's loads
    included (a child process: a stray read is a crash; with the raw bits' tail copy switched off it does
    crash)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONOPTIMIZE"}
    r = subprocess.run([sys.executable, "-c", _GUARD], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0 and r.stdout.startswith("ok "), (r.returncode, r.stderr[-2000:])
