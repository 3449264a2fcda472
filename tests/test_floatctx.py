"""The float_ctx_rans codec on raw bit patterns: exactness for every dtype and odd input."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvcodec.codecs import float_ctx_rans as fc
from kvcodec.errors import ConfigError, FormatError, LimitExceeded

DTYPES = {"bfloat16": (torch.bfloat16, np.uint16, torch.int16), "float16": (torch.float16, np.uint16, torch.int16),
          "float32": (torch.float32, np.uint32, torch.int32)}


def bits(t, name):
    _, npu, ti = DTYPES[name]
    return t.contiguous().view(ti).numpy().view(npu)


def kv_like(shape, name, seed=0):
    """Channel-structured values like a real cache: per-channel scale and offset, a few outliers."""
    g = torch.Generator().manual_seed(seed)
    b, h, s, d = shape
    scale = torch.exp(torch.randn(1, h, 1, d, generator=g) * 1.5)
    off = torch.randn(1, h, 1, d, generator=g) * 2
    x = torch.randn(shape, generator=g) * scale + off
    return bits(x.to(DTYPES[name][0]), name)


@pytest.mark.parametrize("name", list(DTYPES))
@pytest.mark.parametrize("shape", [(1, 3, 64, 64), (2, 1, 7, 5), (1, 1, 1, 1), (3, 2, 1, 9), (1, 2, 33, 3)])
def test_round_trip_exact(name, shape):
    x = kv_like(shape, name)
    p = fc.encode(x, name, {})
    np.testing.assert_array_equal(fc.decode(p, shape, name), x)


@pytest.mark.parametrize("name", list(DTYPES))
def test_special_values_round_trip(name):
    tdt, npu, _ = DTYPES[name]
    vals = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-40, 6e-8, 65504.0,
                         1.0, -1.0, 3.0e38], dtype=torch.float32).to(tdt)
    x = bits(vals.repeat(40).reshape(1, 2, 20, 12), name).copy()
    # NaN payloads and signs must survive bit-exactly
    x.ravel()[5] = np.array(0xFFFFFFFF if npu is np.uint32 else 0xFFFF, dtype=npu)
    x.ravel()[17] = np.array(0x7F800001 if npu is np.uint32 else 0x7C01, dtype=npu)
    for cfg in ({}, {"context": "none"}, {"coded_bits": 2}, {"coded_bits": 16}):
        p = fc.encode(x, name, cfg)
        np.testing.assert_array_equal(fc.decode(p, x.shape, name), x)


@given(st.data())
def test_arbitrary_bit_patterns(data):
    name = data.draw(st.sampled_from(list(DTYPES)))
    npu = DTYPES[name][1]
    shape = tuple(data.draw(st.integers(1, n)) for n in (2, 3, 40, 9))
    maxv = np.iinfo(npu).max
    flat = data.draw(st.lists(st.integers(0, int(maxv)), min_size=int(np.prod(shape)), max_size=int(np.prod(shape))))
    x = np.array(flat, dtype=npu).reshape(shape)
    width = 8 * np.dtype(npu).itemsize
    cfg = {"coded_bits": data.draw(st.integers(2, min(16, width))), "ways": data.draw(st.integers(1, 8)),
           "scale_bits": data.draw(st.integers(12, 15)), "context": data.draw(st.sampled_from(["prev", "none"])),
           "max_tables": data.draw(st.integers(1, 40))}
    try:
        p = fc.encode(x, name, cfg)
    except ConfigError:
        return  # more distinct symbols in one table than 2**scale_bits: refused, never mis-coded
    np.testing.assert_array_equal(fc.decode(p, shape, name), x)


def test_incompressible_data_is_stored_raw():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 2**16, size=(1, 2, 50, 8), dtype=np.uint16)
    p = fc.encode(x, "float16", {})
    assert p[0] == fc.MODE_RAW and len(p) == 1 + x.nbytes
    np.testing.assert_array_equal(fc.decode(p, x.shape, "float16"), x)


def test_compresses_structured_data():
    x = kv_like((1, 3, 512, 64), "bfloat16")
    p = fc.encode(x, "bfloat16", {})
    assert len(p) < 0.8 * x.nbytes


def test_empty_tensor():
    x = np.zeros((1, 2, 0, 4), np.uint16)
    p = fc.encode(x, "bfloat16", {})
    assert fc.decode(p, x.shape, "bfloat16").shape == x.shape


@pytest.mark.parametrize("bad", [{"coded_bits": 1}, {"coded_bits": 17}, {"scale_bits": 16}, {"ways": 0},
                                 {"max_tables": 256}, {"context": "next"}, {"colour": 1}])
def test_bad_config(bad):
    with pytest.raises(ConfigError):
        fc.encode(np.zeros((1, 1, 4, 4), np.uint16), "bfloat16", bad)


def _coded():
    x = kv_like((1, 2, 64, 16), "bfloat16", seed=3)
    p = fc.encode(x, "bfloat16", {})
    assert p[0] == fc.MODE_CODED
    return x, p


@pytest.mark.parametrize("offset,value,match", [
    (0, 7, "unknown mode"), (1, 1, "Coded_Bits"), (1, 17, "Coded_Bits"), (2, 7, "Scale_Bits"), (2, 16, "Scale_Bits"),
    (3, 0, "Ways"), (4, 2, "Num_Classes"), (5, 1, "reserved"), (6, 0, "Num_Tables"),
])
def test_fixed_field_violations(offset, value, match):
    x, p = _coded()
    b = bytearray(p)
    b[offset] = value
    with pytest.raises(FormatError, match=match):
        fc.decode(bytes(b), x.shape, "bfloat16")


def test_table_limit():
    x, p = _coded()
    b = bytearray(p)
    b[2] = 15
    b[6:8] = (255).to_bytes(2, "little")
    with pytest.raises(LimitExceeded):
        fc.decode(bytes(b), x.shape, "bfloat16")


def test_length_fields_and_truncation():
    x, p = _coded()
    for cut in (0, 1, 10, 19, len(p) - 1):
        with pytest.raises(FormatError):
            fc.decode(p[:cut], x.shape, "bfloat16")
    with pytest.raises(FormatError):
        fc.decode(p + b"\0", x.shape, "bfloat16")
    for off in (8, 12, 16):  # Side_Length, Side_Raw_Length, Num_Words
        b = bytearray(p)
        b[off:off + 4] = (int.from_bytes(b[off:off + 4], "little") + 1).to_bytes(4, "little")
        with pytest.raises(FormatError):
            fc.decode(bytes(b), x.shape, "bfloat16")
    with pytest.raises(FormatError):  # the right bytes for another shape
        fc.decode(p, (1, 2, 63, 16), "bfloat16")


def test_lossless_tier_default_scale_bits_and_wide_symbols():
    """The lossless tier codes with Scale_Bits 10 by default, but not when coded_bits asks for symbols that
    2**10 slots cannot hold (then the codec's 12); explicit options win."""
    import torch

    import kvcodec

    rng = np.random.default_rng(3)
    bits = rng.integers(0, 2**32, size=(1, 2, 2048, 8), dtype=np.uint64).astype(np.uint32)
    t = torch.from_numpy(bits.view(np.float32))
    kv = kvcodec.KVCache([t], [t.clone()])
    for opts, want in (({}, 10), ({"coded_bits": 12}, 12), ({"scale_bits": 13}, 13)):
        data = kvcodec.encode(kv, **opts)
        assert kvcodec.inspect(data)["codec"]["params"]["scale_bits"] == want, opts
        assert kvcodec.decode(data, output="kvcache").equal(kv)


@pytest.mark.parametrize("g", [1, 7, 8, 9, 56, 57, 64, 65, 100, 255])
def test_table_choice_kernels_agree_at_every_table_count(g, monkeypatch):
    """The table choice of one k-means step (for each sparse histogram row, the table of least code length, ties
    to the lowest) is the same from the vector kernel (one vector of G = g rounded up to 8 tables; built for every
    G up to 256), the Numba loop and the NumPy formulation, including rows tied between duplicate tables."""
    from kvcodec.entropy import _encode_simd, rans

    rng = np.random.default_rng(g)
    nrows, used = 300, 40
    nnz = rng.integers(0, 12, size=nrows)
    indptr = np.concatenate([[0], np.cumsum(nnz)]).astype(np.int64)
    idx = np.concatenate([np.sort(rng.choice(used, size=k, replace=False)) for k in nnz]).astype(np.int64)
    val = rng.integers(1, 50, size=idx.size).astype(np.float64)
    q = rng.random((g, used)) + 1e-3
    q[g // 2] = q[0]  # a duplicate table: exact ties
    logq = np.log2(q / q.sum(axis=1, keepdims=True))
    if rans.vector_kernels():
        assert _encode_simd.nearest_usable(g)
    got = fc._nearest(indptr, idx, val, logq)
    monkeypatch.setenv("KVCODEC_VECTOR", "0")
    np.testing.assert_array_equal(fc._nearest(indptr, idx, val, logq), got)
    monkeypatch.setenv("KVCODEC_BACKEND", "python")
    np.testing.assert_array_equal(fc._nearest(indptr, idx, val, logq), got)
    assert got.max() < g


@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 80), nsym=st.sampled_from([4, 64, 1024]),
       density=st.floats(0.0, 1.0), tables=st.integers(1, 32))
def test_table_clustering_is_backend_independent(seed, rows, nsym, density, tables):
    """The encoder's k-means over histogram rows (sparse, no BLAS) picks the same tables with the vector kernel,
    the Numba kernel and the NumPy formulation (so the bytes cannot depend on the backend or the machine's BLAS);
    its table sums are the dense sums; empty rows go to table 0 and tables are numbered in order of first use."""
    from kvcodec.entropy import rans

    rng = np.random.default_rng(seed)
    dense = rng.poisson(3.0, (rows, nsym)) * (rng.random((rows, nsym)) < density)
    counts = rans.SparseCounts.from_dense(dense)
    np.testing.assert_array_equal(counts.dense(), dense)
    got = fc._cluster(counts, tables)  # the vector kernel where this machine builds it
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVCODEC_VECTOR", "0")  # the Numba loop
        np.testing.assert_array_equal(fc._cluster(counts, tables), got)
        mp.setenv("KVCODEC_BACKEND", "python")
        want = fc._cluster(counts, tables)
    np.testing.assert_array_equal(got, want)
    assert (got[dense.sum(1) == 0] == 0).all() and got.max(initial=0) < tables
    live = got[dense.sum(1) > 0]
    if live.size:
        _, first = np.unique(live, return_index=True)
        np.testing.assert_array_equal(live[np.sort(first)], np.arange(first.size))
    g = int(got.max()) + 1
    want_sums = np.stack([dense[got == t].sum(0) for t in range(g)])
    np.testing.assert_array_equal(fc.table_counts(got, counts, g), want_sums)


def test_table_chooser_holds_its_own_checked_rows(monkeypatch):
    """The k-means' table choice, set up once per run, keeps its own copies of the rows it checked (changing the
    caller's arrays afterwards changes nothing), takes no rows, refuses rows that index past their arrays or the
    symbols, and (one-shot) a non-finite code length, on the vector kernel and the Numba loop alike."""
    from kvcodec.entropy import rans

    rng = np.random.default_rng(11)
    nnz = rng.integers(0, 6, size=50)
    indptr = np.concatenate([[0], np.cumsum(nnz)]).astype(np.int64)
    idx = np.concatenate([np.sort(rng.choice(20, size=k, replace=False)) for k in nnz]).astype(np.int64)
    val = rng.integers(1, 30, size=idx.size).astype(np.int64)
    q = rng.random((9, 20)) + 1e-3
    logq = np.log2(q / q.sum(axis=1, keepdims=True))
    for vector in ("1", "0"):
        monkeypatch.setenv("KVCODEC_VECTOR", vector)
        want = fc._nearest_numpy(indptr, idx, val.astype(np.float64), logq)
        i2, v2 = idx.copy(), val.copy()
        choose = rans.table_chooser(indptr, i2, v2, 9, 20)
        i2[:] = 0
        v2[:] = 1
        np.testing.assert_array_equal(choose(logq), want)
        assert rans.table_chooser(np.zeros(1, np.int64), idx[:0], val[:0], 9, 20)(logq).shape == (0,)
        bad = logq.copy()
        bad[3, 4] = np.nan
        with pytest.raises(ValueError, match="non-finite"):
            rans.nearest_tables(indptr, idx, val, bad)
        for bad_rows in ((indptr, np.where(idx == idx.max(), 20, idx), val),  # a symbol past logq
                         (indptr + np.arange(indptr.size), idx, val)):  # rows past their entries
            with pytest.raises(ValueError, match="index past"):
                rans.table_chooser(*bad_rows, 9, 20)
