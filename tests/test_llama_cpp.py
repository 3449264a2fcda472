"""llama.cpp state files (issue 48) without llama.cpp: files written here by an independent writer that follows
llama.cpp's layout (src/llama-context.cpp state_seq_save_file, src/llama-kv-cache.cpp state_write*; the summary
in ../shared/design/engines.md), packed and unpacked byte for byte, and every malformed or hostile file refused
by name.  The end-to-end tests with llama-cpp-python and SmolLM2's GGUF are in test_llama_cpp_engine.py."""

import hashlib
import json
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcodec import llama_cpp as K
from kvcodec.container import layout as L
from kvcodec.errors import (BadMagic, ConfigError, FormatError, KvzError, ModelMismatch, TrailingData, TruncatedFile,
                            UnknownId, UnsupportedVersion)

TYPES = {"f32": (0, 4), "f16": (1, 2), "bf16": (30, 2), "q8_0": (8, 34), "q4_0": (2, 18)}


def kv_block(rng, cells, layers, width, ktype="f16", vtype="f16", v_trans=True, streams=1, held=0, ext=False,
             seqs=None):
    """One memory module's state as llama.cpp writes it."""
    out = [struct.pack("<I", streams)]
    for s in range(streams):
        if s != held:
            out.append(struct.pack("<I", 0))
            continue
        out.append(struct.pack("<I", cells))
        for i in range(cells):
            ids = (seqs or [[0]] * cells)[i]
            out.append(struct.pack("<iI", i, len(ids)))
            if ext:
                out.append(struct.pack("<iii", 0, 0, -1))
            out.append(struct.pack(f"<{len(ids)}i", *ids))
        out.append(struct.pack("<II", int(v_trans), layers))
        for _ in range(layers):
            tid, size = TYPES[ktype]
            row = width * size if ktype in ("f16", "f32", "bf16") else width // 32 * size
            out.append(struct.pack("<iQ", tid, row) + rng.bytes(row * cells))
        for _ in range(layers):
            tid, size = TYPES[vtype]
            if v_trans:
                out.append(struct.pack("<iII", tid, size, width) + rng.bytes(width * cells * size))
            else:
                row = width * size if vtype in ("f16", "f32", "bf16") else width // 32 * size
                out.append(struct.pack("<iQ", tid, row) + rng.bytes(row * cells))
    return b"".join(out)


def seq_file(rng, cells=40, layers=3, width=64, **kw):
    toks = rng.integers(0, 50000, cells).astype("<i4")
    return struct.pack("<III", 0x67677371, 3, cells) + toks.tobytes() + kv_block(rng, cells, layers, width, **kw)


def context_state(rng, cells=40, layers=3, width=64, arch=b"llama", **kw):
    return struct.pack("<I", len(arch)) + arch + kv_block(rng, cells, layers, width, **kw)


def session_file(rng, cells=40, layers=3, width=64, **kw):
    toks = rng.integers(0, 50000, cells).astype("<i4")
    return (struct.pack("<III", 0x6767736E, 10, cells) + toks.tobytes() + struct.pack("<I", 5) + b"llama"
            + kv_block(rng, cells, layers, width, **kw))


def seq_data(rng, cells=40, layers=3, width=64, **kw):
    return struct.pack("<Ii", 0xAF143CD8, 0) + kv_block(rng, cells, layers, width, **kw)


def f16_rows(rng, n):
    """Plausible f16 values (random bytes would be NaNs and huge numbers half the time)."""
    return rng.standard_normal(n).astype("<f2").tobytes()


@pytest.mark.parametrize("make", [seq_file, context_state, session_file, seq_data])
@pytest.mark.parametrize("kw", [{}, {"v_trans": False}, {"ktype": "f32", "vtype": "f32"},
                                {"ktype": "bf16", "vtype": "bf16", "v_trans": False},
                                {"ktype": "q8_0", "vtype": "q8_0", "v_trans": False},
                                {"ktype": "q8_0", "vtype": "f16", "v_trans": False},
                                {"ktype": "q4_0", "vtype": "q4_0", "v_trans": False},
                                {"ext": True}, {"streams": 3, "held": 1},
                                {"seqs": [[0, 1]] * 5 + [[1]] * 35}])
def test_round_trip_byte_identical(make, kw):
    rng = np.random.default_rng(len(json.dumps(kw)) + hash(make.__name__) % 1000)
    data = make(rng, **kw)
    st = K.parse(data)
    assert st.size == len(data) and st.layers == 3 and st.cells == 40
    assert st.cell_ext == kw.get("ext", False)
    packed = K.pack_bytes(data)
    assert K.unpack_bytes(packed, check_model=False) == data
    assert K.unpack_bytes(packed + b"", None, check_model=False) == data


def test_the_keys_and_values_become_the_layers():
    """Rows are cells x (heads x dim), head-major; transposed values are (heads x dim) x cells: the .kvz layers
    are [1, heads, cells, dim] of exactly those elements."""
    import kvcodec

    rng = np.random.default_rng(1)
    cells, width = 5, 8
    keys = rng.standard_normal((cells, width)).astype("<f2")
    values = rng.standard_normal((cells, width)).astype("<f2")
    body = (struct.pack("<II", 1, cells) + b"".join(struct.pack("<iIi", i, 1, 0) for i in range(cells))
            + struct.pack("<II", 1, 1) + struct.pack("<iQ", 1, width * 2) + keys.tobytes()
            + struct.pack("<iII", 1, 2, width) + values.T.copy().tobytes())
    data = struct.pack("<I", 5) + b"llama" + body
    geom = {"file_sha256": "0" * 64, "geometry": {"layers": 1, "kv_heads": [2], "k_dim": 4, "v_dim": 4}}
    kv = kvcodec.decode(K.pack_bytes(data, geom), output="kvcache")
    assert tuple(kv.keys[0].shape) == (1, 2, cells, 4)
    np.testing.assert_array_equal(kv.keys[0][0].numpy(), keys.reshape(cells, 2, 4).transpose(1, 0, 2))
    np.testing.assert_array_equal(kv.values[0][0].numpy(), values.reshape(cells, 2, 4).transpose(1, 0, 2))


def test_f16_rows_compress_and_lossy_rebuilds_a_loadable_state():
    rng = np.random.default_rng(2)
    cells, layers, width = 64, 2, 64
    parts = [struct.pack("<I", 5) + b"llama", struct.pack("<II", 1, cells),
             b"".join(struct.pack("<iIi", i, 1, 0) for i in range(cells)), struct.pack("<II", 0, layers)]
    for _ in range(2 * layers):
        parts.append(struct.pack("<iQ", 1, width * 2) + f16_rows(rng, cells * width))
    data = b"".join(parts)
    lossless = K.pack_bytes(data)
    lossy = K.pack_bytes(data, tier="lossy", bits=4.0)
    assert len(lossy) < len(lossless) < len(data)
    back = K.unpack_bytes(lossy, check_model=False)
    assert len(back) == len(data) and back != data
    st, st2 = K.parse(data), K.parse(back)
    assert [(r.start, r.end, r.type) for r in st.rows] == [(r.start, r.end, r.type) for r in st2.rows]
    a = np.frombuffer(data[st.rows[0].start:st.rows[0].end], "<f2").astype(np.float32)
    b = np.frombuffer(back[st.rows[0].start:st.rows[0].end], "<f2").astype(np.float32)
    assert np.corrcoef(a, b)[0, 1] > 0.95


def test_lossy_refuses_a_state_with_nothing_to_quantize():
    data = seq_file(np.random.default_rng(3), ktype="q8_0", vtype="q8_0", v_trans=False)
    with pytest.raises(ConfigError, match="quantize"):
        K.pack_bytes(data, tier="lossy")


@pytest.mark.parametrize("mutate, err, field", [
    (lambda d: b"GGUF" + d[4:], BadMagic, "magic"),
    (lambda d: d[:4] + struct.pack("<I", 2) + d[8:], UnsupportedVersion, "version"),
    (lambda d: d[:4] + struct.pack("<I", 4) + d[8:], UnsupportedVersion, "version"),
    (lambda d: d + b"\0", TrailingData, "end"),
    (lambda d: d[:-1], TruncatedFile, None),
    (lambda d: d[:8] + struct.pack("<I", 0xFFFFFFF0) + d[12:], TruncatedFile, "tokens"),
])
def test_hostile_files_are_refused_by_name(mutate, err, field):
    data = seq_file(np.random.default_rng(4))
    with pytest.raises(err) as e:
        K.parse(mutate(data))
    if field:
        assert e.value.field == field


def _offset_of_first_type(data, cells):
    # seq file: 12 + 4 cells (tokens) + 4 (n_stream) + 4 (cell_count) + 12 cells + 8 (v_trans, n_layer)
    return 12 + 4 * cells + 8 + 12 * cells + 8


@pytest.mark.parametrize("tid, name", [(13, "q5_K"), (99, "unknown")])
def test_unknown_row_types_are_refused_by_name(tid, name):
    data = bytearray(seq_file(np.random.default_rng(5), cells=10))
    at = _offset_of_first_type(data, 10)
    assert struct.unpack_from("<i", data, at)[0] == 1
    struct.pack_into("<i", data, at, tid)
    with pytest.raises(UnknownId, match=name) as e:
        K.parse(bytes(data))
    assert e.value.field == "block[0].keys[0].type" and e.value.offset == at


def test_other_fields_out_of_range_name_the_field():
    data = bytearray(seq_file(np.random.default_rng(6), cells=10))
    at = _offset_of_first_type(data, 10)
    v = bytearray(data)
    struct.pack_into("<I", v, at - 8, 2)  # v_trans
    with pytest.raises(FormatError) as e:
        K.parse(bytes(v))
    assert e.value.field == "block[0].v_trans"
    v = bytearray(data)
    struct.pack_into("<Q", v, at + 4, 3)  # a row size that is not whole f16 elements
    with pytest.raises(FormatError) as e:
        K.parse(bytes(v))
    assert e.value.field == "block[0].keys[0].row_size"
    v = bytearray(data)
    struct.pack_into("<I", v, 12 + 40 + 4, 0xFFFFFFFF)  # a cell count no file can hold: refused before allocating
    with pytest.raises(TruncatedFile):
        K.parse(bytes(v))
    v = bytearray(data)
    struct.pack_into("<I", v, 12 + 40, 0)  # zero streams
    with pytest.raises(FormatError):
        K.parse(bytes(v))


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_damaged_files_raise_kvz_errors_only(data):
    """Any truncation or byte change: a KvzError (naming a field), or a file that parses and round-trips."""
    base = seq_file(np.random.default_rng(7), cells=6, layers=2, width=32)
    kind = data.draw(st.sampled_from(["cut", "flip", "word"]))
    b = bytearray(base)
    if kind == "cut":
        b = b[:data.draw(st.integers(0, len(base) - 1))]
    elif kind == "flip":
        i = data.draw(st.integers(0, len(base) - 1))
        b[i] ^= 1 << data.draw(st.integers(0, 7))
    else:
        i = data.draw(st.integers(0, len(base) - 4))
        struct.pack_into("<I", b, i, data.draw(st.sampled_from([0, 1, 2, 3, 0xFFFFFFFF, 0x7FFFFFFF, 1 << 20])))
    try:
        K.parse(bytes(b))
    except KvzError as e:
        assert e.field
        return
    assert K.unpack_bytes(K.pack_bytes(bytes(b)), check_model=False) == bytes(b)


# -- the model: GGUF identity ------------------------------------------------------------------------------------
def _gguf(path, layers=3, heads=4, kv_heads=1, emb=256, name="tiny"):
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_block_count(layers)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_embedding_length(emb)
    w.add_tensor("token_embd.weight", np.zeros((4, emb), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_record_reads_the_geometry_and_hashes_the_file(tmp_path):
    p = _gguf(tmp_path / "a.gguf")
    rec = K.model_record(p)
    assert rec["file_sha256"] == hashlib.sha256(p.read_bytes()).hexdigest()
    assert rec["architecture"] == "llama" and rec["name"] == "tiny"
    assert rec["geometry"] == {"layers": 3, "kv_heads": [1, 1, 1], "k_dim": 64, "v_dim": 64}


def test_a_state_of_another_model_is_refused(tmp_path):
    rng = np.random.default_rng(8)
    data = seq_file(rng, cells=10, layers=3, width=64)
    ok = _gguf(tmp_path / "ok.gguf")
    packed = K.pack_bytes(data, ok)
    assert K.unpack_bytes(packed, ok) == data
    with pytest.raises(ModelMismatch, match="layers"):
        K.pack_bytes(data, _gguf(tmp_path / "deeper.gguf", layers=4))
    with pytest.raises(ModelMismatch, match="KV heads"):
        K.pack_bytes(data, _gguf(tmp_path / "wider.gguf", kv_heads=2))
    other = _gguf(tmp_path / "other.gguf", name="other")  # same shapes, another file
    with pytest.raises(ModelMismatch, match="tiny"):
        K.unpack_bytes(packed, other)
    with pytest.raises(ConfigError):
        K.unpack_bytes(packed)  # the model must be named (or the check waived)
    with pytest.raises(ModelMismatch):
        K.pack_bytes(context_state(rng, cells=10, arch=b"qwen2"), ok)


# -- the .kvz side: a file that lies about what it rebuilds ------------------------------------------------------
def _rewrite_header(data: bytes, change) -> bytes:
    """The file with its header changed by ``change(dict)`` and its header checksum recomputed; ``info.pad``
    (written 400 characters long) shrinks or grows so that the header keeps its length and the sections their
    offsets."""
    from kvcodec.container.header import dumps

    magic, major, minor, hlen = L.PREAMBLE.unpack_from(data, 0)
    h = json.loads(data[16:16 + hlen])
    change(h)
    h["info"]["pad"] = ""
    h["info"]["pad"] = "x" * (hlen - len(dumps(h)))
    body = dumps(h)
    assert len(body) == hlen
    pre = L.PREAMBLE.pack(magic, major, minor, len(body))
    return pre + body + L.HEADER_CHECKSUM.pack(L.xxh3(pre + body)) + data[16 + hlen + 8:]


def test_a_packed_file_whose_header_lies_is_refused():
    import kvcodec
    from kvcodec.errors import ChecksumMismatch

    data = seq_file(np.random.default_rng(9), cells=12)
    packed = K.pack_bytes(data, info={"pad": "x" * 400})
    assert kvcodec.inspect(packed)["format_version"] == "1.10"

    def sha(h):
        h["engine_file"]["sha256"] = "f" * 64
    with pytest.raises(ChecksumMismatch):
        K.unpack_bytes(_rewrite_header(packed, sha), check_model=False)

    def swap(h):  # keys of layer 0 where the values of layer 0 were: the SHA-256 catches it
        p = h["engine_file"]["pieces"]
        i, j = p.index(["keys", 0, "rows"]), p.index(["values", 0, "columns"])
        p[i], p[j] = ["values", 0, "rows"], ["keys", 0, "columns"]
    with pytest.raises(ChecksumMismatch):
        K.unpack_bytes(_rewrite_header(packed, swap), check_model=False)

    for change, match in [
        (lambda h: h["engine_file"]["pieces"].append(["bytes", 0, 1]), "pieces"),
        (lambda h: h["engine_file"]["pieces"].__setitem__(0, ["bytes", 10 ** 9, 1]), "verbatim"),
        (lambda h: h["engine_file"]["pieces"].__setitem__(1, ["keys", 7, "rows"]), "layer index"),
        (lambda h: h["engine_file"]["pieces"].__setitem__(1, ["keys", 0, "diagonal"]), "order"),
        (lambda h: h["engine_file"].__setitem__("length", h["engine_file"]["length"] + 1), "length"),
        (lambda h: h["engine_file"].__setitem__("sha256", None), "sha256"),
        (lambda h: h["engine_file"].pop("kind"), "missing"),
    ]:
        with pytest.raises(FormatError, match=match):
            K.unpack_bytes(_rewrite_header(packed, change), check_model=False)


def test_a_cache_file_is_not_a_state():
    import kvcodec
    import torch

    plain = kvcodec.encode([(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))])
    with pytest.raises(ConfigError, match="not a llama.cpp state"):
        K.unpack_bytes(plain, check_model=False)


def test_cli_pack_inspect_unpack(tmp_path, capsys):
    from kvcodec.cli import main

    data = seq_file(np.random.default_rng(10), cells=20)
    src = tmp_path / "slot.bin"
    src.write_bytes(data)
    assert main(["pack", str(src), "--no-model"]) == 0
    assert main(["pack", str(src), "--no-model"]) == 1  # exists: -f to replace
    assert main(["inspect", str(src) + ".kvz"]) == 0
    out = capsys.readouterr().out
    assert "engine file  : llama.cpp seq_file" in out and "byte for byte" in out
    assert main(["unpack", str(src) + ".kvz", "-o", str(tmp_path / "back.bin"), "--no-model-check"]) == 0
    assert (tmp_path / "back.bin").read_bytes() == data
    assert main(["unpack", str(src) + ".kvz", "-o", str(tmp_path / "x.bin")]) == 1  # --model required
    assert main(["inspect", str(src)]) == 0
    assert "llama.cpp seq file version 3" in capsys.readouterr().out
    (tmp_path / "bad.bin").write_bytes(data[:100])
    assert main(["pack", str(tmp_path / "bad.bin"), "--no-model"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "TruncatedFile" in err


# -- tier tokens: the state as its token ids, regenerated by llama.cpp (end to end: test_llama_cpp_engine.py) ----
def _tokens_file(state: bytes, n: int, **change) -> bytes:
    """A .kvz of the regenerated kind, written through the encoder as kvcodec.llama_cpp writes it."""
    import io

    import torch

    import kvcodec

    ids = np.arange(n, dtype="<i4").tobytes()
    rc = {"engine": "llama.cpp", "procedure": K.PROCEDURE, "length": len(state), "tokens": [0, n],
          "params": {"n_batch": 512, "n_ubatch": 512, "flash_attn": False, "type_k": "f16", "type_v": "f16"}}
    eng = {"engine": "llama.cpp", "kind": "seq_file", "length": len(state), "verbatim": len(ids),
           "sha256": hashlib.sha256(state).hexdigest(), "pieces": [["recomputed", 0, len(state)]], "model": None,
           "recompute": rc}
    for k, v in change.items():
        (rc if k in rc else eng)[k] = v
    buf = io.BytesIO()
    e = torch.empty(1, 1, 0, 1, dtype=torch.float16)
    kvcodec.Encoder(tier="lossless").write(buf, kvcodec.KVCache([e], [e.clone()]), None, engine=(eng, ids))
    return buf.getvalue()


def test_a_regenerated_file_is_rebuilt_from_the_engine_bytes_and_checked():
    import kvcodec
    from kvcodec.errors import ChecksumMismatch

    state = seq_file(np.random.default_rng(11), cells=8)
    data = _tokens_file(state, 8)
    with kvcodec.open_kvz(data) as f:
        with pytest.raises(ConfigError, match="regeneration"):
            f.engine_file()
        assert f.engine_file(regenerated=state) == state
        with pytest.raises(ChecksumMismatch):
            f.engine_file(regenerated=state[:-1] + b"\1")
        assert np.frombuffer(f.engine_verbatim(), "<i4").tolist() == list(range(8))
    for change, match in [({"tokens": [4, 8]}, "outside"), ({"length": 5}, "outside|pieces"),
                          ({"procedure": 7}, "string"), ({"sha256": None}, "sha256")]:
        with pytest.raises(FormatError, match=match):
            kvcodec.inspect(_tokens_file(state, 8, **change))


def test_a_regenerated_file_needs_llama_cpp_and_says_so():
    """The main test venv has no llama-cpp-python: refused before any work, naming what would work."""
    pytest.importorskip("gguf")
    try:
        import llama_cpp  # noqa: F401
        pytest.skip("llama-cpp-python is installed here")
    except ImportError:
        pass
    from kvcodec.errors import BackendUnavailable

    state = seq_file(np.random.default_rng(12), cells=8)
    with pytest.raises(BackendUnavailable, match="llama-cpp-python"):
        K.unpack_bytes(_tokens_file(state, 8), {"file_sha256": "0" * 64, "path": "x.gguf"}, check_model=False)
