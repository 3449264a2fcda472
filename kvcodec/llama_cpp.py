"""kvcodec for llama.cpp: its state files packed into .kvz files, and llama-cpp-python's prompt cache on the store.

llama.cpp saves a sequence's KV cache as a state file (``llama_state_seq_save_file``, llama-server's
``POST /slots/{id}?action=save``), a session file (``llama_state_save_file``) or a buffer
(``llama_state_get_data``: llama-cpp-python's ``Llama.save_state().llama_state``; ``llama_state_seq_get_data``).
They carry no model identity and are as large as the cache (f16: 23,052 bytes per token for SmolLM2-135M).

* :func:`pack` / :func:`unpack` (``kvz pack`` / ``kvz unpack``): the file is parsed strictly (:func:`parse`:
  unknown versions, ggml types or fields are refused by name), its key and value rows become the layers of a
  .kvz file coded by tier ``lossless`` (or ``lossy``), everything else is kept verbatim (spec/kvz.md section
  15, format 1.10), and :func:`unpack` rebuilds the file **byte for byte** (tier lossless: checked against the
  SHA-256 the .kvz records).  The GGUF's identity (SHA-256 of the model file: metadata and tensor data) is
  recorded and checked, so a state is never rebuilt for another model.  Rows of a quantized type (q8_0, q4_0
  ...) or of mixed types are kept verbatim, zstd-coded where it pays.
* :class:`KvzLlamaCache`: a llama-cpp-python cache (``Llama.set_cache``) whose states live in a
  :class:`kvcodec.Store` (directory or fsspec URL): longest-prefix lookup by token ids, shared prefixes stored
  once.

The layout parsed is llama.cpp's (``src/llama-context.cpp`` ``state_seq_save_file`` / ``state_write_data``,
``src/llama-kv-cache.cpp`` ``state_write`` / ``state_write_meta`` / ``state_write_data``) as vendored by
llama-cpp-python 0.3.36 (sequence state version 3, session version 10); docs/llama_cpp.md has it field by field.
"""

from __future__ import annotations

import atexit
import collections
import hashlib
import io
import os
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .errors import (BackendUnavailable, BadMagic, ChecksumMismatch, ConfigError, FallbackWarning, FormatError,
                     KvzError, LimitExceeded, ModelMismatch, NumericsMismatch, TrailingData, TruncatedFile, UnknownId,
                     UnsupportedVersion, warn)
from .tiers.base import Fallback

__all__ = ["parse", "pack", "unpack", "pack_bytes", "unpack_bytes", "model_record", "StateFile", "KvzLlamaCache",
           "SEQ_VERSION", "SESSION_VERSION"]

#: ``LLAMA_STATE_SEQ_MAGIC`` ('ggsq') and the one version this reads (llama.cpp refuses any other, too)
SEQ_MAGIC, SEQ_VERSION = 0x67677371, 3
#: ``LLAMA_SESSION_MAGIC`` ('ggsn') and its version
SESSION_MAGIC, SESSION_VERSION = 0x6767736E, 10
#: ``llama_state_seq_get_data``'s buffer magic (``io_magic`` in llama-context.cpp)
SEQ_DATA_MAGIC = 0xAF143CD8

#: the ggml types llama.cpp allows for a KV cache (``--cache-type-k/-v``): id -> (name, block elements, block bytes)
KV_TYPES = {0: ("f32", 1, 4), 1: ("f16", 1, 2), 2: ("q4_0", 32, 18), 3: ("q4_1", 32, 20), 6: ("q5_0", 32, 22),
            7: ("q5_1", 32, 24), 8: ("q8_0", 32, 34), 20: ("iq4_nl", 32, 18), 30: ("bf16", 1, 2)}
#: the other ggml type ids, to name them in errors
OTHER_TYPES = {9: "q8_1", 10: "q2_K", 11: "q3_K", 12: "q4_K", 13: "q5_K", 14: "q6_K", 15: "q8_K", 16: "iq2_xxs",
               17: "iq2_xs", 18: "iq3_xxs", 19: "iq1_s", 21: "iq3_s", 22: "iq2_s", 23: "iq4_xs", 24: "i8",
               25: "i16", 26: "i32", 27: "i64", 28: "f64", 29: "iq1_m", 34: "tq1_0", 35: "tq2_0", 39: "mxfp4"}
#: row types stored as tensors (the .kvz dtype each becomes)
FLOAT_TYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}
#: llama_kv_cell_ext: x, y (2-D positions of M-RoPE), tok (n-gram hash input), three i32
CELL_EXT_BYTES = 12
MAX_STREAMS = 4096
MAX_LAYERS = 1 << 16
MAX_ROW_BYTES = 1 << 32
MAX_ARCH_BYTES = 256
MAX_SEQ_IDS = 1 << 16


@dataclass
class Rows:
    """One layer's keys or values in the file: ``cells`` rows of ``width`` elements of ggml type ``type``, as rows
    (one per cell) or columns (``order`` 'columns': llama.cpp's transposed V, one run of cells per element)."""

    part: str  # "keys" or "values"
    layer: int  # the layer's index in the file (blocks counted one after the other)
    type: str
    width: int
    cells: int
    order: str  # "rows" or "columns"
    start: int  # offset of the first row byte in the file
    end: int


@dataclass
class StateFile:
    """What :func:`parse` read: the file's kind, tokens, cells and rows, and the byte ranges it is made of."""

    kind: str  # "seq_file" (ggsq), "session_file" (ggsn), "context_state" (llama_state_get_data), "seq_state"
    size: int
    version: int | None = None
    tokens: np.ndarray | None = None  # int32 token ids (seq / session files)
    arch: str | None = None  # session files and context states
    seq_id: int | None = None  # seq_state buffers
    cell_ext: bool = False
    v_trans: list = field(default_factory=list)  # per KV block
    positions: list = field(default_factory=list)  # per KV block: the cells' positions (int32 array)
    single_seq: list = field(default_factory=list)  # per KV block: the seq id every cell has alone, or None
    streams: list = field(default_factory=list)  # per KV block: (stream count, the stream holding the cells)
    rows: list = field(default_factory=list)  # Rows, keys then values of each block, file order

    @property
    def layers(self) -> int:
        return sum(1 for r in self.rows if r.part == "keys")

    @property
    def cells(self) -> int:
        return max((r.cells for r in self.rows), default=0)

    def row_types(self) -> list[str]:
        return sorted({r.type for r in self.rows})

    def describe(self) -> dict:
        return {"kind": self.kind, "bytes": self.size, "version": self.version, "arch": self.arch,
                "tokens": None if self.tokens is None else int(self.tokens.size), "cells": self.cells,
                "layers": self.layers, "row_types": self.row_types(), "v_trans": self.v_trans,
                "cell_ext": self.cell_ext}


class _Cursor:
    def __init__(self, data, pos: int = 0):
        self.data, self.pos, self.size = data, pos, len(data)

    def need(self, n: int, what: str):
        if n < 0 or self.pos + n > self.size:
            raise TruncatedFile(f"llama.cpp state: {what} needs {n} bytes at offset {self.pos}, the file has "
                                f"{self.size - self.pos} left", field=what, offset=self.pos)

    def u32(self, what: str) -> int:
        self.need(4, what)
        v = struct.unpack_from("<I", self.data, self.pos)[0]
        self.pos += 4
        return v

    def i32(self, what: str) -> int:
        self.need(4, what)
        v = struct.unpack_from("<i", self.data, self.pos)[0]
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        v = struct.unpack_from("<Q", self.data, self.pos)[0]
        self.pos += 8
        return v

    def skip(self, n: int, what: str) -> tuple[int, int]:
        self.need(n, what)
        a = self.pos
        self.pos += n
        return a, self.pos


def _fail(msg: str, what: str, at: int, cls=FormatError):
    raise cls(f"llama.cpp state: {msg}", field=what, offset=at)


def _type(c: _Cursor, what: str) -> tuple[str, int, int]:
    at = c.pos
    t = c.i32(what)
    if t in KV_TYPES:
        return KV_TYPES[t]
    name = OTHER_TYPES.get(t)
    if name is not None:
        _fail(f"{what} is ggml type {t} ({name}), which llama.cpp does not use for a KV cache", what, at, UnknownId)
    _fail(f"{what} is ggml type {t}, unknown (this reads {sorted(v[0] for v in KV_TYPES.values())})", what, at,
          UnknownId)


def _arch(c: _Cursor) -> str:
    at = c.pos
    n = c.u32("arch.length")
    if not 1 <= n <= MAX_ARCH_BYTES:
        _fail(f"architecture name of {n} bytes (1 to {MAX_ARCH_BYTES})", "arch.length", at)
    a, b = c.skip(n, "arch")
    raw = bytes(c.data[a:b])
    if not all(0x21 <= x < 0x7F for x in raw):
        _fail(f"architecture name {raw[:32]!r} is not printable ASCII", "arch", a)
    return raw.decode()


def _cells(c: _Cursor, n: int, ext: bool, block: int) -> tuple[np.ndarray, int | None]:
    """The cells' metadata: positions and, when every cell belongs to exactly one and the same sequence, it."""
    what = f"block[{block}].cells"
    stride = 8 + (CELL_EXT_BYTES if ext else 0) + 4
    c.need(0, what)
    if c.pos + n * stride <= c.size:  # fast path: every cell in one sequence
        rec = np.frombuffer(c.data, dtype=np.uint8, count=n * stride, offset=c.pos).reshape(n, stride)
        counts = rec[:, 4:8].copy().view("<u4").ravel()
        if n and (counts == 1).all():
            pos = rec[:, 0:4].copy().view("<i4").ravel()
            seqs = rec[:, stride - 4:].copy().view("<i4").ravel()
            c.pos += n * stride
            one = int(seqs[0]) if (seqs == seqs[0]).all() else None
            if (seqs < 0).any():
                _fail("a cell's sequence id is negative", what, c.pos - n * stride)
            return pos.astype(np.int32), one
    pos = np.empty(n, dtype=np.int32)
    one, mixed = None, False
    for i in range(n):
        pos[i] = c.i32(f"{what}[{i}].pos")
        at = c.pos
        k = c.u32(f"{what}[{i}].n_seq_id")
        if k > MAX_SEQ_IDS:
            _fail(f"cell {i} belongs to {k} sequences (at most {MAX_SEQ_IDS})", f"{what}[{i}].n_seq_id", at)
        if ext:
            c.skip(CELL_EXT_BYTES, f"{what}[{i}].ext")
        c.need(4 * k, f"{what}[{i}].seq_id")
        ids = np.frombuffer(c.data, dtype="<i4", count=k, offset=c.pos)
        if (ids < 0).any():
            _fail(f"cell {i} has a negative sequence id", f"{what}[{i}].seq_id", c.pos)
        c.pos += 4 * k
        if k != 1:
            mixed = True
        elif one is None and not mixed:
            one = int(ids[0])
        elif one != int(ids[0]):
            mixed = True
    return pos, (None if mixed or n == 0 else one)


def _rows(c: _Cursor, part: str, layer: int, cells: int, transposed: bool, block: int) -> Rows:
    what = f"block[{block}].{part}[{layer}]"
    name, blck, bsize = _type(c, f"{what}.type")
    if not transposed:
        at = c.pos
        row = c.u64(f"{what}.row_size")
        if not 0 < row <= MAX_ROW_BYTES or row % bsize:
            _fail(f"row size {row} is not a positive multiple of {name}'s {bsize}-byte blocks (at most "
                  f"{MAX_ROW_BYTES})", f"{what}.row_size", at)
        a, b = c.skip(row * cells, f"{what}.rows")
        return Rows(part, layer, name, row // bsize * blck, cells, "rows", a, b)
    if blck != 1:
        _fail(f"transposed values of the block type {name} (llama.cpp transposes float values only)",
              f"{what}.type", c.pos - 4)
    at = c.pos
    el = c.u32(f"{what}.element_size")
    if el != bsize:
        _fail(f"element size {el}, {name}'s is {bsize}", f"{what}.element_size", at)
    at = c.pos
    width = c.u32(f"{what}.n_embd_v_gqa")
    if not 0 < width <= MAX_ROW_BYTES // bsize:
        _fail(f"n_embd_v_gqa {width} out of range", f"{what}.n_embd_v_gqa", at)
    a, b = c.skip(width * cells * el, f"{what}.columns")
    return Rows(part, layer, name, width, cells, "columns", a, b)


def _block(c: _Cursor, out: StateFile, ext: bool, block: int, first_layer: int) -> None:
    """One memory module's state (``llama_kv_cache::state_write``): its streams, of which one may hold cells."""
    at = c.pos
    n_stream = c.u32(f"block[{block}].n_stream")
    if not 1 <= n_stream <= MAX_STREAMS:
        _fail(f"{n_stream} streams (1 to {MAX_STREAMS})", f"block[{block}].n_stream", at)
    held = None
    for s in range(n_stream):
        at = c.pos
        cells = c.u32(f"block[{block}].stream[{s}].cell_count")
        if cells == 0:
            continue
        if held is not None:
            _fail("two streams hold cells: kvcodec packs the state of one sequence (save it with "
                  "llama_state_seq_save_file / llama_state_seq_get_data)", f"block[{block}].stream[{s}]", at)
        held = s
        if cells > (c.size - c.pos) // 12:
            _fail(f"{cells} cells cannot fit in the {c.size - c.pos} bytes left", f"block[{block}].cell_count", at,
                  TruncatedFile)
        pos, one = _cells(c, cells, ext, block)
        at = c.pos
        v_trans = c.u32(f"block[{block}].v_trans")
        if v_trans > 1:
            _fail(f"v_trans {v_trans} (0 or 1)", f"block[{block}].v_trans", at)
        at = c.pos
        n_layer = c.u32(f"block[{block}].n_layer")
        if not 1 <= n_layer <= MAX_LAYERS:
            _fail(f"{n_layer} layers (1 to {MAX_LAYERS})", f"block[{block}].n_layer", at)
        for li in range(n_layer):
            out.rows.append(_rows(c, "keys", first_layer + li, cells, False, block))
        for li in range(n_layer):
            out.rows.append(_rows(c, "values", first_layer + li, cells, bool(v_trans), block))
        out.v_trans.append(bool(v_trans))
        out.positions.append(pos)
        out.single_seq.append(one)
    out.streams.append((n_stream, held))
    if held is None:
        out.v_trans.append(None)
        out.positions.append(np.zeros(0, np.int32))
        out.single_seq.append(None)


def parse(data, *, cell_ext: bool | None = None) -> StateFile:
    """Parse a llama.cpp state (bytes-like): a sequence state file (``ggsq``, version 3), a session file
    (``ggsn``, version 10), a ``llama_state_seq_get_data`` buffer or a ``llama_state_get_data`` buffer (what
    llama-cpp-python's ``save_state()`` holds).  Strict: every byte is accounted for, or a :class:`FormatError`
    subclass names the field and offset.  ``cell_ext``: whether cells carry llama.cpp's 12-byte extension
    (M-RoPE and n-gram models); None tries without, then with."""
    data = memoryview(data).cast("B") if not isinstance(data, (bytes, bytearray)) else data
    if cell_ext is None:
        try:
            return parse(data, cell_ext=False)
        except FormatError as first:
            try:
                return parse(data, cell_ext=True)
            except FormatError:
                raise first from None
    c = _Cursor(data)
    if len(data) < 8:
        raise TruncatedFile(f"llama.cpp state of {len(data)} bytes is too short", field="magic", offset=0)
    magic = struct.unpack_from("<I", data, 0)[0]
    out = StateFile("context_state", len(data), cell_ext=bool(cell_ext))
    if magic in (SEQ_MAGIC, SESSION_MAGIC):
        out.kind = "seq_file" if magic == SEQ_MAGIC else "session_file"
        want = SEQ_VERSION if magic == SEQ_MAGIC else SESSION_VERSION
        c.pos = 4
        out.version = c.u32("version")
        if out.version != want:
            raise UnsupportedVersion(f"llama.cpp {out.kind.replace('_', ' ')} version {out.version}: this reads "
                                     f"version {want} (llama.cpp itself loads only its own version)",
                                     field="version", offset=4)
        n = c.u32("token_count")
        c.need(4 * n, "tokens")
        out.tokens = np.frombuffer(data, dtype="<i4", count=n, offset=c.pos).astype(np.int32)
        c.pos += 4 * n
        if magic == SESSION_MAGIC:
            out.arch = _arch(c)
    elif magic == SEQ_DATA_MAGIC:
        out.kind = "seq_state"
        c.pos = 4
        out.seq_id = c.i32("seq_id")
    else:
        n = magic
        if not 1 <= n <= MAX_ARCH_BYTES or not all(0x21 <= x < 0x7F for x in bytes(data[4:4 + min(n, 64)])):
            raise BadMagic(f"not a llama.cpp state: starts {bytes(data[:8]).hex()} (a sequence file starts 'qsgg', "
                           "a session file 'nsgg', a context state with its architecture's name)", field="magic",
                           offset=0)
        out.arch = _arch(c)
    block = 0
    while c.pos < c.size:
        if block >= MAX_STREAMS:
            _fail(f"more than {MAX_STREAMS} memory blocks", "block", c.pos, LimitExceeded)
        at = c.pos
        if block == 0:
            _block(c, out, bool(cell_ext), block, out.layers)
        else:  # a second memory module (llama.cpp's SWA caches write two), or bytes that are none
            try:
                _block(c, out, bool(cell_ext), block, out.layers)
            except FormatError as e:
                raise TrailingData(f"llama.cpp state: {c.size - at} bytes after the KV cache that are not a KV "
                                   f"cache block ({e}; a hybrid model's recurrent state is not read)", field="end",
                                   offset=at) from None
        block += 1
    if block == 0:
        raise TruncatedFile("llama.cpp state ends before its KV cache", field="block[0].n_stream", offset=c.pos)
    if c.pos != c.size:
        raise TrailingData(f"llama.cpp state: {c.size - c.pos} bytes after the KV cache", field="end", offset=c.pos)
    return out


# -- the model: a GGUF file --------------------------------------------------------------------------------------
def gguf_path(model) -> Path:
    """The GGUF file ``model`` names: a path, or an embedded model's name (``"smollm2"``)."""
    if isinstance(model, (str, os.PathLike)) and Path(model).is_file():
        return Path(model)
    from .models import EMBEDDED_MODELS as GGUF_MODELS
    from .models import gguf_file

    if isinstance(model, str) and model in GGUF_MODELS:
        return gguf_file(model)
    raise ConfigError(f"model {model!r} is not a GGUF file nor an embedded model ({sorted(GGUF_MODELS)})")


#: GGUF metadata value types: id -> struct format of a scalar (8 string, 9 array)
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                 12: "<d"}
_GGUF_MAX_KV = 1 << 20


def gguf_metadata(path, keys: set[str]) -> dict:
    """The values of ``keys`` in a GGUF file's metadata (scalars, strings, arrays of scalars), reading only its
    metadata: llama.cpp's GGUF reader is not needed, and gguf-py's parses every tensor and array (2.6 s for
    SmolLM2's 49,152-token vocabulary).  :class:`FormatError` on a file that is not GGUF version 2 or 3."""
    out = {}
    with open(path, "rb") as f:
        head = f.read(24)
        if len(head) < 24 or head[:4] != b"GGUF":
            raise FormatError(f"{path}: not a GGUF file", field="magic", offset=0)
        version, _, n_kv = struct.unpack_from("<IQQ", head, 4)
        if version not in (2, 3):
            raise UnsupportedVersion(f"{path}: GGUF version {version} (this reads 2 and 3)", field="version",
                                     offset=4)
        if n_kv > _GGUF_MAX_KV:
            raise LimitExceeded(f"{path}: {n_kv} metadata entries", field="n_kv", offset=16)

        def read(n: int) -> bytes:
            b = f.read(n)
            if len(b) != n:
                raise TruncatedFile(f"{path}: metadata ends early", field="metadata", offset=f.tell())
            return b

        def string() -> str:
            (n,) = struct.unpack("<Q", read(8))
            if n > 1 << 24:
                raise LimitExceeded(f"{path}: a metadata string of {n} bytes", field="metadata", offset=f.tell())
            return read(n).decode("utf-8", "replace")

        def value(t: int, keep: bool):
            if t in _GGUF_SCALARS:
                fmt = _GGUF_SCALARS[t]
                return struct.unpack(fmt, read(struct.calcsize(fmt)))[0]
            if t == 8:
                return string()
            if t == 9:
                et, n = struct.unpack("<IQ", read(12))
                if et in _GGUF_SCALARS:
                    size = struct.calcsize(_GGUF_SCALARS[et])
                    if not keep:
                        f.seek(size * n, 1)
                        return None
                    if n > 1 << 24:
                        raise LimitExceeded(f"{path}: a metadata array of {n}", field="metadata", offset=f.tell())
                    return list(struct.unpack(f"<{n}{_GGUF_SCALARS[et][1]}", read(size * n)))
                if et == 8:
                    for _ in range(n):
                        (m,) = struct.unpack("<Q", read(8))
                        f.seek(m, 1)
                    return None
                raise FormatError(f"{path}: metadata array of type {et}", field="metadata", offset=f.tell())
            raise FormatError(f"{path}: metadata value type {t}", field="metadata", offset=f.tell())

        for _ in range(n_kv):
            key = string()
            (t,) = struct.unpack("<I", read(4))
            v = value(t, key in keys)
            if key in keys:
                out[key] = v
            if len(out) == len(keys):
                break
    return out


_RECORDS: dict = {}


def model_record(model) -> dict:
    """What a packed state records about its model: ``file_sha256`` (SHA-256 of the GGUF file, its metadata and
    tensor data: hashed once per machine, remembered by path, size and modification time), and the GGUF's
    ``general.name`` and ``general.architecture`` where it has them; and ``geometry``, what :func:`pack` checks a
    state against (layers, KV heads per layer, key and value head sizes; not stored)."""
    from .identity import file_digest

    path = gguf_path(model)
    st = path.stat()
    memo = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if memo in _RECORDS:
        return _RECORDS[memo]
    arch = gguf_metadata(path, {"general.architecture"}).get("general.architecture")
    names = [f"{arch}.{k}" for k in ("block_count", "attention.head_count", "attention.head_count_kv",
                                     "embedding_length", "attention.key_length", "attention.value_length")]
    meta = gguf_metadata(path, {"general.name", *names}) if isinstance(arch, str) else {}
    layers, heads, kv, emb, kd, vd = (meta.get(k) for k in names)
    rec = {"file_sha256": file_digest(path), "path": str(path)}
    if isinstance(meta.get("general.name"), str):
        rec["name"] = meta["general.name"]
    if isinstance(arch, str):
        rec["architecture"] = arch
    kv = heads if kv is None else kv
    if kd is None and isinstance(emb, int) and isinstance(heads, int) and heads:
        kd = emb // heads
    vd = kd if vd is None else vd
    if isinstance(layers, int) and isinstance(kd, int) and isinstance(vd, int) and kd and vd:
        kv_list = kv if isinstance(kv, list) else [kv] * layers
        if len(kv_list) == layers and all(isinstance(x, int) for x in kv_list):
            rec["geometry"] = {"layers": layers, "kv_heads": kv_list, "k_dim": kd, "v_dim": vd}
    _RECORDS[memo] = rec
    return rec


def _stored(rec: dict | None) -> dict | None:
    return None if rec is None else {k: v for k, v in rec.items() if k not in ("geometry", "path")}


def _check_geometry(st: StateFile, rec: dict) -> None:
    """A state made with another model is refused before any work (:class:`ModelMismatch`)."""
    arch = rec.get("architecture")
    if st.arch is not None and arch is not None and st.arch != arch:
        raise ModelMismatch(f"the state is of a {st.arch!r} model, {rec.get('name', 'the GGUF')} is {arch!r}")
    g = rec.get("geometry")
    if g is None or not st.rows or len(st.v_trans) != 1:
        return  # several memory blocks (SWA / hybrid caches): each holds some of the layers
    if st.layers != g["layers"]:
        raise ModelMismatch(f"the state holds {st.layers} layers, {rec.get('name', 'the GGUF')} has {g['layers']}")
    for r in st.rows:
        want = g["kv_heads"][r.layer] * (g["k_dim"] if r.part == "keys" else g["v_dim"])
        if r.width != want:
            raise ModelMismatch(f"the state's layer {r.layer} {r.part} have {r.width} elements per cell, "
                                f"{rec.get('name', 'the GGUF')} has {g['kv_heads'][r.layer]} KV heads x "
                                f"{g['k_dim'] if r.part == 'keys' else g['v_dim']}")


# -- pack / unpack -----------------------------------------------------------------------------------------------
def _heads(width_k: int, width_v: int, geometry: dict | None) -> tuple[int, int, int]:
    if geometry is not None:
        kd, vd = geometry["k_dim"], geometry["v_dim"]
        if width_k % kd == 0 and width_v % vd == 0 and width_k // kd == width_v // vd:
            return width_k // kd, kd, vd
    return 1, width_k, width_v


def _tensor(data, r: Rows, heads: int, dim: int, torch_dtype) -> torch.Tensor:
    """``[1, heads, cells, dim]`` of a layer's rows (or transposed columns), bit for bit."""
    from .dtypes import from_bit_patterns

    item = {torch.float16: 2, torch.bfloat16: 2, torch.float32: 4}[torch_dtype]
    flat = np.frombuffer(data, dtype=f"<u{item}", count=r.cells * r.width, offset=r.start)
    if r.order == "rows":
        arr = flat.reshape(r.cells, heads, dim).transpose(1, 0, 2)
    else:
        arr = flat.reshape(heads, dim, r.cells).transpose(0, 2, 1)
    return from_bit_patterns(np.array(arr, dtype=f"=u{item}", order="C")[None], torch_dtype)


def to_cache(st: StateFile, data, geometry: dict | None = None):
    """``(KVCache, pieces, verbatim bytes)`` of a parsed state: the key and value rows as the cache's layers
    (one per layer of the file) when they are all of one float type, else nothing but verbatim bytes."""
    from .cache import KVCache

    types = {r.type for r in st.rows}
    dtype = FLOAT_TYPES.get(next(iter(types))) if len(types) == 1 else None
    by_layer: dict[int, dict] = {}
    for r in st.rows:
        by_layer.setdefault(r.layer, {})[r.part] = r
    if dtype is None or any(len(parts) != 2 or parts["keys"].cells != parts["values"].cells
                            for parts in by_layer.values()):
        dtype = None
    tensors = set()
    keys, values = [], []
    if dtype is not None:
        td = getattr(torch, dtype)
        for li in range(len(by_layer)):
            k, v = by_layer[li]["keys"], by_layer[li]["values"]
            h, kd, vd = _heads(k.width, v.width, geometry)
            keys.append(_tensor(data, k, h, kd, td))
            values.append(_tensor(data, v, h, vd, td))
        tensors = {(r.start, r.end) for r in st.rows}
    else:  # nothing but bytes: one empty layer carries the file's shapes
        keys, values = [torch.empty(1, 1, 0, 1, dtype=torch.float16)], [torch.empty(1, 1, 0, 1, dtype=torch.float16)]
    pieces, verbatim, at = [], bytearray(), 0
    for r in (st.rows if tensors else []):
        if r.start > at:
            pieces.append(["bytes", len(verbatim), r.start - at])
            verbatim += data[at:r.start]
        pieces.append([r.part, r.layer, r.order])
        at = r.end
    if at < len(data):
        pieces.append(["bytes", len(verbatim), len(data) - at])
        verbatim += data[at:]
    return KVCache(keys, values), pieces, bytes(verbatim)


#: the one regeneration procedure (spec section 15.2): a fresh context evaluates the token ids and saves the
#: sequence state file
PROCEDURE = "llama.cpp-seq-prefill-v1"
#: KvzLlamaCache: states waiting for the background put, at most
MAX_WAITING = 4


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError as e:
        raise BackendUnavailable(f"tier 'tokens' runs llama.cpp: install llama-cpp-python ({e})") from None
    return llama_cpp


def build_info() -> str:
    """The llama.cpp build that regenerates states: llama-cpp-python's version and the CPU features it uses."""
    llama_cpp = _llama_cpp()
    info = llama_cpp.llama_print_system_info()
    return f"llama-cpp-python {llama_cpp.__version__}; " + (info.decode() if isinstance(info, bytes) else
                                                           str(info)).strip()


def regenerate(gguf, tokens, params: dict) -> bytes:
    """Procedure ``llama.cpp-seq-prefill-v1``: a fresh context of ``gguf`` with ``params`` (``n_batch``,
    ``n_ubatch``, ``flash_attn``, ``type_k``, ``type_v``: ggml type names) evaluates ``tokens`` and saves
    sequence 0's state file; its bytes."""
    import tempfile

    llama_cpp = _llama_cpp()
    code = {v[0]: k for k, v in KV_TYPES.items()}
    tokens = [int(t) for t in tokens]
    llm = llama_cpp.Llama(str(gguf), n_ctx=max(256, len(tokens) + 1), n_batch=params["n_batch"],
                          n_ubatch=params["n_ubatch"], flash_attn=params["flash_attn"],
                          type_k=code[params["type_k"]], type_v=code[params["type_v"]], verbose=False)
    try:
        llm.eval(tokens)
        arr = (llama_cpp.llama_token * len(tokens))(*tokens)
        with tempfile.TemporaryDirectory(prefix="kvz-llama-") as d:
            path = os.path.join(d, "state")
            if not llama_cpp.llama_state_seq_save_file(llm._ctx.ctx, path.encode(), 0, arr, len(tokens)):
                raise KvzError("llama.cpp could not save the regenerated state")
            with open(path, "rb") as f:
                return f.read()
    finally:
        llm.close()


def _pack_tokens(data: bytes, st: StateFile, rec: dict | None, options) -> tuple[dict, bytes, object]:
    """Tier ``tokens``: the state as its token ids, when llama.cpp regenerates it byte for byte here."""
    from .cache import KVCache

    if options:
        raise ConfigError(f"tier tokens takes no options ({sorted(options)})")
    if rec is None:
        raise ConfigError("tier tokens recomputes the state with the model: pass model= (the GGUF)")
    if st.kind != "seq_file":
        raise ConfigError(f"tier tokens needs a sequence state file, which carries its token ids (this is a "
                          f"{st.kind})")
    n = int(st.tokens.size)
    if n == 0 or (len(st.positions) != 1 or st.cell_ext or st.single_seq[0] != 0 or st.positions[0].size != n
            or not np.array_equal(st.positions[0], np.arange(n))):
        raise Fallback("its cells are not the token ids at positions 0 .. n-1 of sequence 0")
    params = {"n_batch": 512, "n_ubatch": 512, "flash_attn": not st.v_trans[0],
              "type_k": next(r.type for r in st.rows if r.part == "keys"),
              "type_v": next(r.type for r in st.rows if r.part == "values")}
    again = regenerate(gguf_path_of(rec), st.tokens.tolist(), params)
    if again != data:
        raise Fallback("llama.cpp does not regenerate it byte for byte from its token ids here (a state filled "
                       "by generating tokens one at a time, or by another llama.cpp build, is not)")
    params["build"] = build_info()
    verbatim = st.tokens.astype("<i4").tobytes()
    engine = {"engine": "llama.cpp", "kind": st.kind, "length": len(data), "verbatim": len(verbatim),
              "sha256": hashlib.sha256(data).hexdigest(), "pieces": [["recomputed", 0, len(data)]],
              "model": _stored(rec), "recompute": {"engine": "llama.cpp", "procedure": PROCEDURE,
                                                   "length": len(data), "tokens": [0, n], "params": params}}
    empty = torch.empty(1, 1, 0, 1, dtype=torch.float16)
    return engine, verbatim, KVCache([empty], [empty.clone()])


def gguf_path_of(rec: dict) -> Path:
    """The GGUF file a record was made from (:func:`model_record` remembers it)."""
    path = rec.get("path")
    if path is None:
        raise ConfigError("tier tokens needs the GGUF file itself, not only its record: pass its path")
    return Path(path)


def pack_bytes(data, model=None, *, tier: str = "lossless", info: dict | None = None, progress=None,
               **options) -> bytes:
    """A llama.cpp state (bytes-like; :func:`parse`) as .kvz bytes.  ``model``: its GGUF (path, or an embedded
    model's name), recorded and checked against the state (:class:`ModelMismatch`); None records none.
    ``tier``: ``"lossless"`` (rebuilt byte for byte) or ``"lossy"`` (``bits=`` ...: a state llama.cpp loads,
    not the same bytes).  ``options``: the tier's (:class:`kvcodec.Encoder`)."""
    data = bytes(data)
    return _pack(data, parse(data), model, tier, info, progress, options)


def _pack(data: bytes, st: StateFile, model, tier: str, info, progress, options: dict) -> bytes:
    """:func:`pack_bytes` of a state already parsed."""
    from .api import Encoder
    from .version import __version__

    if tier not in ("lossless", "lossy", "tokens"):
        raise ConfigError(f"a llama.cpp state is packed with tier 'lossless', 'lossy' or 'tokens', not {tier!r}")
    rec = None if model is None else (model if isinstance(model, dict) else model_record(model))
    if rec is not None:
        _check_geometry(st, rec)
    info = {"kvcodec_version": __version__, "llama_cpp": st.describe()} if info is None else info
    if tier == "tokens":
        try:
            engine, verbatim, cache = _pack_tokens(data, st, rec, options)
        except Fallback as e:
            warn(f"tier 'tokens' cannot store this state ({e}); stored losslessly instead", FallbackWarning)
        else:
            buf = io.BytesIO()
            Encoder(tier="lossless").write(buf, cache, None, info=info, engine=(engine, verbatim))
            return buf.getvalue()
        tier = "lossless"
    cache, pieces, verbatim = to_cache(st, data, None if rec is None else rec.get("geometry"))
    if tier == "lossy" and not any(p[0] != "bytes" for p in pieces):
        raise ConfigError(f"tier lossy quantizes f16/bf16/f32 rows; this state's are {st.row_types()} (already "
                          "quantized, or of mixed types): nothing to quantize, pack it with tier lossless")
    engine = {"engine": "llama.cpp", "kind": st.kind, "length": len(data), "verbatim": len(verbatim),
              "sha256": hashlib.sha256(data).hexdigest() if tier == "lossless" else None, "pieces": pieces,
              "model": _stored(rec)}
    buf = io.BytesIO()
    Encoder(tier=tier, **options).write(buf, cache, None, info=info, engine=(engine, verbatim), progress=progress)
    return buf.getvalue()


def unpack_bytes(source, model=None, *, check_model: bool = True, limits: dict | None = None,
                 progress=None) -> bytes:
    """The llama.cpp state a packed .kvz file (bytes, path, URL or file object) rebuilds.  ``model``: the GGUF
    it will be loaded into; a file packed for another model is refused (:class:`ModelMismatch`) - pass
    ``check_model=False`` to rebuild without checking (the bytes are the same; loading them into another
    model is the caller's risk)."""
    from .file import KvzFile

    with KvzFile(source, limits=limits) as f:
        eng = f.header.engine
        if eng is None:
            raise ConfigError("this .kvz file holds a cache, not a llama.cpp state (kvz decode reads it)")
        if eng.get("engine") != "llama.cpp":
            raise ConfigError(f"this .kvz file rebuilds a state of engine {eng.get('engine')!r}, not llama.cpp's")
        if check_model:
            if model is None:
                raise ConfigError("pass model= (the GGUF the state will be loaded into) or check_model=False")
            want = eng["model"]
            if want is None:
                raise ModelMismatch("the file records no model (it was packed without one): pass check_model=False "
                                    "to rebuild it anyway")
            have = model if isinstance(model, dict) else model_record(model)
            if have["file_sha256"] != want["file_sha256"]:
                raise ModelMismatch(f"the state was packed for {want.get('name', 'another model')} (GGUF SHA-256 "
                                    f"{want['file_sha256'][:16]}...), not {have.get('name', 'this one')} "
                                    f"({have['file_sha256'][:16]}...)")
        rc = eng.get("recompute")
        if rc is None:
            return f.engine_file(progress)
        if rc["engine"] != "llama.cpp" or rc["procedure"] != PROCEDURE:
            raise UnknownId(f"regeneration procedure {rc['engine']}/{rc['procedure']} (this reads llama.cpp/"
                            f"{PROCEDURE})", field="Header.engine_file.recompute.procedure", offset=16)
        if model is None:
            raise ConfigError("this state is stored as its token ids: unpacking runs llama.cpp on its GGUF (pass "
                              "model=)")
        _llama_cpp()  # BackendUnavailable before any work
        params = rc["params"]
        names = {v[0] for v in KV_TYPES.values()}
        if not (isinstance(params.get("n_batch"), int) and 1 <= params["n_batch"] <= 1 << 20
                and isinstance(params.get("n_ubatch"), int) and 1 <= params["n_ubatch"] <= params["n_batch"]
                and isinstance(params.get("flash_attn"), bool) and params.get("type_k") in names
                and params.get("type_v") in names):
            raise FormatError(f"regeneration parameters {params} are not n_batch, n_ubatch, flash_attn, type_k, "
                              "type_v", field="Header.engine_file.recompute.params", offset=16)
        a, n = rc["tokens"]
        tokens = np.frombuffer(f.engine_verbatim(), dtype="<i4", count=n, offset=a)
        again = regenerate(gguf_path(model) if not isinstance(model, dict) else gguf_path_of(model),
                           tokens.tolist(), params)
        try:
            return f.engine_file(progress, regenerated=again)
        except ChecksumMismatch:
            raise NumericsMismatch(f"this llama.cpp ({build_info()}) does not regenerate the state the file "
                                   f"recorded (made with {params.get('build', 'an unrecorded build')}): unpack it "
                                   "where that build runs, or pack states with tier 'lossless'") from None


def _default_output(src: Path, suffix_in: str | None) -> Path:
    if suffix_in is None:
        return src.with_name(src.name + ".kvz")
    return src.with_name(src.name[:-len(".kvz")] if src.name.endswith(".kvz") else src.name + ".state")


def _with_bar(show: bool, total: int, desc: str, work):
    """``work(progress)`` with a progress bar of ``total`` sections on stderr when ``show`` (the CLI's)."""
    if not show:
        return work(None)
    from .formatting import progress_bar

    bar = progress_bar(total, desc)
    try:
        return work(bar.update)
    finally:
        bar.close()


def pack(src, dst=None, model=None, *, overwrite: bool = False, **kwargs) -> dict:
    """``kvz pack``: the llama.cpp state file ``src`` packed into ``dst`` (default ``src`` + ``.kvz``), written
    atomically; returns what was done (sizes, tokens, layers, row types)."""
    from .atomic import atomic_output

    src = Path(src)
    dst = Path(dst) if dst is not None else _default_output(src, None)
    data = src.read_bytes()
    st = parse(data)
    tier, info = kwargs.pop("tier", "lossless"), kwargs.pop("info", None)
    # the CLI's bar counts sections coded (tier tokens: a prefill, not counted)
    total = sum(-(-r.cells // kwargs.get("chunk_tokens", 4096)) for r in st.rows)
    out = _with_bar(kwargs.pop("progress_bar", False), total, "packing",
                    lambda progress: _pack(data, st, model, tier, info, progress, kwargs))
    with atomic_output(dst, overwrite=overwrite) as f:
        f.write(out)
    return {**st.describe(), "file": str(dst), "packed_bytes": len(out), "ratio": round(len(data) / len(out), 4)}


def unpack(src, dst=None, model=None, *, overwrite: bool = False, **kwargs) -> dict:
    """``kvz unpack``: the state file a packed ``src`` rebuilds, written to ``dst`` (default: ``src`` without
    ``.kvz``) atomically."""
    from .atomic import atomic_output

    src = Path(src)
    dst = Path(dst) if dst is not None else _default_output(src, ".kvz")
    bar = kwargs.pop("progress_bar", False)  # the CLI's: sections decoded
    total = 0
    if bar:
        from .api import inspect

        total = sum(1 for x in inspect(src)["sections"] if x["type"] == "kv")
    data = _with_bar(bar, total, "unpacking", lambda progress: unpack_bytes(src, model, progress=progress, **kwargs))
    with atomic_output(dst, overwrite=overwrite) as f:
        f.write(data)
    return {"file": str(dst), "bytes": len(data)}


# -- llama-cpp-python's prompt cache on the store ----------------------------------------------------------------
@dataclass
class _Template:
    """How this context lays out a state (``llama_state_get_data``): everything but the cells and the rows."""

    arch: str
    n_stream: int
    stream: int  # the stream that holds the sequence
    seq: int  # the sequence id of every cell
    v_trans: bool
    k_types: list
    v_types: list
    dtype: torch.dtype

    @classmethod
    def of(cls, st: StateFile) -> _Template:
        return cls(st.arch, *st.streams[0], st.single_seq[0], st.v_trans[0],
                   [r.type for r in st.rows if r.part == "keys"],
                   [r.type for r in st.rows if r.part == "values"],
                   getattr(torch, FLOAT_TYPES[st.rows[0].type]))

    def build(self, tokens: int, keys, values) -> bytes:
        """The state of a context holding ``tokens`` positions 0.. of one sequence, with these layers."""
        from .dtypes import bit_patterns

        arch = self.arch.encode()
        out = [struct.pack("<I", len(arch)), arch, struct.pack("<I", self.n_stream)]
        for s in range(self.n_stream):
            if s != self.stream:
                out.append(struct.pack("<I", 0))
                continue
            out.append(struct.pack("<I", tokens))
            cells = np.zeros((tokens, 3), dtype="<i4")
            cells[:, 0] = np.arange(tokens)
            cells[:, 1] = 1
            cells[:, 2] = self.seq
            out += [cells.tobytes(), struct.pack("<II", int(self.v_trans), len(keys))]
            code = {v[0]: k for k, v in KV_TYPES.items()}
            for k, t in zip(keys, self.k_types):
                bits = bit_patterns(k[0])  # [H, S, D]
                out += [struct.pack("<iQ", code[t], bits.shape[0] * bits.shape[2] * bits.itemsize),
                        np.ascontiguousarray(bits.transpose(1, 0, 2)).astype(f"<u{bits.itemsize}").tobytes()]
            for v, t in zip(values, self.v_types):
                bits = bit_patterns(v[0])
                if self.v_trans:
                    out += [struct.pack("<iII", code[t], bits.itemsize, bits.shape[0] * bits.shape[2]),
                            np.ascontiguousarray(bits.transpose(0, 2, 1)).astype(f"<u{bits.itemsize}").tobytes()]
                else:
                    out += [struct.pack("<iQ", code[t], bits.shape[0] * bits.shape[2] * bits.itemsize),
                            np.ascontiguousarray(bits.transpose(1, 0, 2)).astype(f"<u{bits.itemsize}").tobytes()]
        return b"".join(out)


def _warm_up(dtype) -> None:
    from . import api

    try:
        x = torch.randn(1, 2, 256, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
        api.decode(api.encode([(x, x)], threads=1), output="kvcache", threads=1)
    except Exception:  # noqa: BLE001 - a warm-up that fails costs only the time it would have saved
        pass


def _base_cache():
    try:
        from llama_cpp.llama_cache import BaseLlamaCache
    except ImportError:  # the class is defined without llama-cpp-python; set_cache needs it installed
        class BaseLlamaCache:  # type: ignore[no-redef]
            def __init__(self, capacity_bytes: int = 2 << 30):
                self.capacity_bytes = capacity_bytes
    return BaseLlamaCache


class KvzLlamaCache(_base_cache()):
    """llama-cpp-python's prompt cache on a :class:`kvcodec.Store`::

        llm = Llama("model.gguf")
        llm.set_cache(KvzLlamaCache(llm, "/var/kvz"))        # or "s3://bucket/kvz", storage_options=...

    Each completion's state (prompt and generated tokens) is put in the store, where every prefix shared
    with an earlier state is stored once; a later prompt restores the longest stored prefix of its tokens
    (then llama.cpp evaluates the rest).  Any number of processes and machines may share the store.  The
    namespace is the GGUF's SHA-256 and the KV dtype, so a state never reaches another model; the context's own
    layout (transposed values or not) is rebuilt on load, so contexts with and without flash attention share
    the states.  ``tier``/``**store_options``: as :class:`kvcodec.Store` (``tier="lossy", bits=4`` ...).
    ``capacity_bytes``: when given, a put that leaves the store larger runs its collector with that bound
    (``Store.gc(max_bytes=...)``); else the store grows until ``kvz store gc`` says otherwise.
    ``background`` (default): a completion's state is put by a thread of this object, one at a time, so a
    completion does not wait for its state to be coded; at most ``MAX_WAITING`` states wait (beyond, the oldest
    waiting one is dropped and counted in ``stats["dropped"]``: each is the whole KV of its tokens); ``flush()``
    waits for them, and so does the process's exit.  ``False``: put before the completion returns.

    Not restored: the logits of every prompt position (llama-cpp-python's ``logits_all=True``, for prompt
    log-probabilities) - refused with that setting.  The states of contexts whose cells carry llama.cpp's
    extension (M-RoPE models) or hold several sequences are not put (``stats["refused"]``).
    """

    def __init__(self, llm, store, storage_options: dict | None = None, *, capacity_bytes: int | None = None,
                 tier: str = "lossless", chunk_tokens: int = 256, background: bool = True, **store_options):
        super().__init__(capacity_bytes if capacity_bytes is not None else (2 << 30))
        from .store import Store

        if getattr(llm, "_logits_all", False) or getattr(getattr(llm, "context_params", None), "logits_all", False):
            raise ConfigError("KvzLlamaCache does not restore every position's logits: create the Llama with "
                              "logits_all=False (the default)")
        self.llm = llm
        self.record = model_record(llm.model_path)
        self.model_id = f"llama.cpp:gguf-sha256:{self.record['file_sha256']}"
        if isinstance(store, Store):
            self.store = store
        else:
            self.store = Store(store, None, storage_options, model_id=self.model_id, tier=tier,
                               chunk_tokens=chunk_tokens, **store_options)
        self.template = self._learn_template()
        self.stats = {"hits": 0, "misses": 0, "tokens_restored": 0, "puts": 0, "refused": 0}
        # a process's first decode loads the coder's compiled kernels (about 0.45 s here): done now, beside
        # whatever the process does next, instead of in its first request's time to first token
        self._warm = threading.Thread(target=_warm_up, args=(self.template.dtype,), name="kvz-warm-up", daemon=True)
        self._warm.start()
        self._capacity = capacity_bytes
        self._lock = threading.Lock()
        self._waiting: collections.deque = collections.deque()  # states not yet put: (tokens, state bytes)
        self._worker: threading.Thread | None = None
        self._background = background
        if background:
            # before the interpreter stops the executors the encoder uses (as concurrent.futures registers its
            # own exit): a state handed over is put before the process ends
            getattr(threading, "_register_atexit", atexit.register)(self.flush)

    def flush(self) -> None:
        """Wait until every state handed to the cache is in the store."""
        while True:
            with self._lock:
                worker = self._worker
            if worker is None:
                return
            worker.join()

    def ready(self, timeout: float | None = None) -> bool:
        """Wait for the warm-up begun at construction (a server calls it before taking requests); True when
        done."""
        self._warm.join(timeout)
        return not self._warm.is_alive()

    def _learn_template(self) -> _Template:
        """The context's state layout, from a state of it (its current one; an empty context evaluates one
        token first and forgets it)."""
        llm = self.llm
        n = llm.n_tokens
        if n == 0:
            bos = llm.token_bos()
            llm.eval([bos if bos >= 0 else 0])
        try:
            st = parse(llm.save_state().llama_state)
        finally:
            if n == 0:
                llm.reset()
        _check_geometry(st, self.record)
        if st.kind != "context_state" or len(st.v_trans) != 1 or st.cell_ext or len(st.row_types()) != 1 \
                or st.row_types()[0] not in FLOAT_TYPES or st.single_seq[0] is None:
            raise ConfigError(f"KvzLlamaCache stores the f16/bf16/f32 KV cache of one sequence; this context's "
                              f"state is {st.describe()}")
        return _Template.of(st)

    # -- BaseLlamaCache ------------------------------------------------------------------------------------------
    @property
    def cache_size(self) -> int:
        """Bytes the store holds (every namespace: chunks and session objects)."""
        return int(self.store.stats()["bytes"])

    def __contains__(self, key) -> bool:
        return self.store.lookup(list(key), dtype=self.template.dtype) > 0

    def __getitem__(self, key):
        import llama_cpp

        key = list(key)
        n, kv = self.store.match(key, dtype=self.template.dtype, output="kvcache")
        if not n:
            self.stats["misses"] += 1
            raise KeyError("no stored prefix")
        data = self.template.build(n, kv.keys, kv.values)
        ids = np.full(self.llm.n_ctx(), -1, dtype=np.intc)
        ids[:n] = key[:n]
        self.stats["hits"] += 1
        self.stats["tokens_restored"] += n
        # the logits are not stored: llama-cpp-python evaluates the last prompt token again after a load
        scores = np.zeros((1, self.llm.n_vocab()), dtype=np.single)
        return llama_cpp.llama.LlamaState(input_ids=ids, scores=scores, n_tokens=n, llama_state=data,
                                          llama_state_size=len(data), seed=self.llm._seed)

    def __setitem__(self, key, value) -> None:
        n = int(value.n_tokens)
        if n == 0:
            return
        ids = np.array(value.input_ids[:n], dtype=np.int64)
        if not self._background:
            self._put(ids, value.llama_state)
            return
        with self._lock:  # llama-cpp-python's arrays are reused: the ids are copied, the state bytes are its own
            if len(self._waiting) >= MAX_WAITING:
                self._waiting.popleft()
                self.stats["dropped"] = self.stats.get("dropped", 0) + 1
            self._waiting.append((ids, value.llama_state))
            if self._worker is None:
                self._worker = threading.Thread(target=self._run, name="kvz-llama-put", daemon=True)
                self._worker.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._waiting:
                    self._worker = None
                    return
                job = self._waiting.popleft()
            try:
                self._put(*job)
            except Exception as e:  # noqa: BLE001 - a failed put is a miss later, never a failed completion
                self.stats["failed"] = self.stats.get("failed", 0) + 1
                warn(f"KvzLlamaCache: a state was not stored ({type(e).__name__}: {e})")

    def _put(self, ids: np.ndarray, state: bytes) -> None:
        n = ids.size
        st = parse(state)
        if (st.kind != "context_state" or len(st.positions) != 1 or st.cell_ext or st.single_seq[0] is None
                or st.positions[0].size != n or not np.array_equal(st.positions[0], np.arange(n))
                or len(st.row_types()) != 1 or st.row_types()[0] not in FLOAT_TYPES):
            self.stats["refused"] += 1
            return
        kv, _, _ = to_cache(st, state, self.record.get("geometry"))
        self.store.put(kv, tokens=ids)
        self.stats["puts"] += 1
        if self._capacity is not None and self.cache_size > self._capacity:
            # the store's own eviction (least recently used sessions' chunks first; spec/store.md), safe beside
            # any other process's puts and reads
            self.store.gc(max_bytes=self._capacity)
