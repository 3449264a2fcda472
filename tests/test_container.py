"""The .kvz container: one test per error class, single-bit flips, limits, lazy reads."""

import io
import json
import struct

import pytest
import torch

import kvcodec
from kvcodec.container import layout as L
from kvcodec.container.header import dumps
from kvcodec.container.reader import KvzReader
from kvcodec.container.writer import KvzWriter
from kvcodec.errors import (
    BadMagic,
    ChecksumMismatch,
    FormatError,
    KvzError,
    LimitExceeded,
    OffsetError,
    ReservedBitSet,
    TrailingData,
    TruncatedFile,
    UnknownId,
    UnsupportedVersion,
)

from .common import check_rejects, flip_bit, patch, random_cache


@pytest.fixture(scope="module")
def small():
    return kvcodec.encode(random_cache(layers=2, seq=6, dim=4, heads=1), chunk_tokens=4,
                          tokens=torch.arange(6).unsqueeze(0))


def _header_len(data):
    return struct.unpack_from("<I", data, 12)[0]


def _rewrite_header(data: bytes, mutate) -> bytes:
    """Re-emit a file with a modified header (valid checksums) to test semantic validation."""
    r = KvzReader(data)
    hdr = json.loads(json.dumps(r.header.raw))
    mutate(hdr)
    buf = io.BytesIO()
    w = KvzWriter(buf, hdr)
    for e in r.sections:
        w.write_section(e.section_type, r.read_payload(e), layer=e.layer, part=e.part, chunk=e.chunk)
    w.close()
    return buf.getvalue()


def test_round_trip_and_canonical(small):
    kv = kvcodec.decode(small, output="kvcache")
    assert kvcodec.encode(kv, chunk_tokens=4) == small


# --- one test per error class, each made by corrupting one field -------------

def test_bad_magic(small):
    with pytest.raises(BadMagic) as ei:
        KvzReader(patch(small, 1, b"X"))
    assert ei.value.field == "Magic" and ei.value.offset == 0
    with pytest.raises(BadMagic):
        KvzReader(b"PK\x03\x04" + b"\0" * 200)


def test_unsupported_version(small):
    with pytest.raises(UnsupportedVersion) as ei:
        KvzReader(patch(small, 8, struct.pack("<H", 2)))
    assert ei.value.field == "Version_Major" and ei.value.offset == 8
    newer = L.FORMAT_VERSION_MINOR + 1  # a later revision may give a known field a new meaning: refused
    with pytest.raises(UnsupportedVersion, match=f"1.{newer}.*newer kvcodec") as ei:
        KvzReader(patch(small, 10, struct.pack("<H", newer)))
    assert ei.value.field == "Version_Minor" and ei.value.offset == 10


def test_truncated_file(small):
    for n in (0, 5, 16, 60, len(small) // 2, len(small) - 1):
        with pytest.raises((TruncatedFile, BadMagic)):
            KvzReader(small[:n])
    with pytest.raises(TruncatedFile) as ei:
        KvzReader(small[:-1])
    assert ei.value.field == "End_Magic"


def test_trailing_data(small):
    with pytest.raises(TrailingData) as ei:
        KvzReader(small + small)  # two files back to back: the footer declares the second's length
    assert ei.value.field == "File_Length"


def test_checksum_mismatch_header(small):
    with pytest.raises(ChecksumMismatch) as ei:
        KvzReader(flip_bit(small, 8 * 30))
    assert ei.value.field == "Header_Checksum"


def test_checksum_mismatch_payload(small):
    r = KvzReader(small)
    e = r.sections[-1]
    bad = flip_bit(small, 8 * (e.payload_offset + 3))
    r2 = KvzReader(bad)  # opening reads no payload
    with pytest.raises(ChecksumMismatch) as ei:
        r2.read_payload(r2.sections[-1])
    assert ei.value.field == "Payload_Checksum" and ei.value.offset == e.offset + 24
    check_rejects(ChecksumMismatch, bad)


def test_limit_exceeded_header_length(small):
    with pytest.raises(LimitExceeded) as ei:
        KvzReader(patch(small, 12, struct.pack("<I", L.MAX_HEADER_BYTES + 1)))
    assert ei.value.field == "Header_Length"


def test_limit_exceeded_output_bytes(small):
    check_rejects(LimitExceeded, small, limits={"max_output_bytes": 100})
    def grow(h):
        h["cache"]["layers"][0].update(seq_len=2**31, cumulative_length=2**31)
        h["cache"]["num_tokens"] = 2**31
        h["cache"]["chunk_tokens"] = 2**24

    huge = _rewrite_header(small, grow)
    with pytest.raises(LimitExceeded) as ei:
        KvzReader(huge, limits={"max_output_bytes": 1 << 30})
    assert "max_output_bytes" in str(ei.value) and ei.value.field == "Header.cache.layers"


def test_reserved_bit_set(small):
    r = KvzReader(small)
    e = r.sections[1]
    raw = bytearray(small[e.offset:e.offset + 40])
    raw[2] |= 0x02  # a reserved Section_Flags bit
    raw[32:40] = struct.pack("<Q", L.xxh3(bytes(raw[:32])))
    bad = patch(small, e.offset, bytes(raw))
    r2 = KvzReader(bad)
    with pytest.raises(ReservedBitSet) as ei:
        r2.read_payload(r2.sections[1])
    assert ei.value.field == "Section_Flags"


def test_offset_error(small):
    r = KvzReader(small)
    # index entry 1 claims a different offset: rebuild the index payload + checksums consistently
    ip = r.index_offset + 40
    idx = bytearray(small[ip:len(small) - 32])
    off = struct.unpack_from("<Q", idx, 8 + 32)[0]
    struct.pack_into("<Q", idx, 8 + 32, off + 1)
    head = L.section_header(L.SECTION_INDEX, L.FLAG_CRITICAL, 0, 0, 0, bytes(idx))
    bad = small[:r.index_offset] + head + bytes(idx) + small[-32:]
    with pytest.raises(OffsetError) as ei:
        KvzReader(bad)
    assert ei.value.field == "Index.Offset"


def test_unknown_id(small):
    with pytest.raises(UnknownId) as ei:
        KvzReader(_rewrite_header(small, lambda h: h["cache"].update(dtype="float8")))
    assert ei.value.field == "Header.cache.dtype"
    with pytest.raises(UnknownId):
        KvzReader(_rewrite_header(small, lambda h: h["codec"].update(id="zfp")))


def test_unknown_critical_section_rejected_noncritical_skipped(small):
    r = KvzReader(small)
    for critical, ok in ((False, True), (True, False)):
        buf = io.BytesIO()
        w = KvzWriter(buf, r.header.raw)
        w.write_section(999, b"future data", critical=critical)
        for e in r.sections:
            w.write_section(e.section_type, r.read_payload(e), layer=e.layer, part=e.part, chunk=e.chunk)
        w.close()
        if ok:
            out = kvcodec.decode(buf.getvalue(), output="kvcache")
            assert out.equal(kvcodec.decode(small, output="kvcache"))
        else:
            with pytest.raises(UnknownId):
                KvzReader(buf.getvalue())


def test_header_semantics():
    data = kvcodec.encode(random_cache(layers=1, seq=3, dim=2, heads=1))
    cases = [
        lambda h: h.update(format="kvx"),
        lambda h: h.update(extra=1),
        lambda h: h["cache"].update(batch=0),
        lambda h: h["cache"].update(batch="1"),
        lambda h: h["cache"]["layers"][0].update(kv_heads=True),
        lambda h: h["cache"].update(num_tokens=5),
        lambda h: h["cache"]["layers"][0].update(cumulative_length=7),
        lambda h: h.update(model={"fingerprint": "abc"}),
        lambda h: h["cache"].update(layers=[]),
    ]
    for mutate in cases:
        with pytest.raises(FormatError):
            KvzReader(_rewrite_header(data, mutate))
    # x- keys and info are allowed
    KvzReader(_rewrite_header(data, lambda h: h.update({"x-acme": 1, "info": {"anything": [1, 2]}})))


def test_header_json_attacks():
    def file_with_header(body: bytes) -> bytes:
        pre = L.PREAMBLE.pack(L.MAGIC, 1, 0, len(body))
        hs = L.xxh3(pre + body)
        idx = struct.pack("<II", 0, 0)
        data_start = len(pre) + len(body) + 8
        foot = L.FOOTER.pack(data_start, data_start + 40 + len(idx) + 32, L.footer_checksum(
            data_start, data_start + 40 + len(idx) + 32, hs), L.END_MAGIC)
        return pre + body + struct.pack("<Q", hs) + L.section_header(0xFFFF, 1, 0, 0, 0, idx) + idx + foot

    good = dumps({"format": "kvz"})
    with pytest.raises(FormatError, match="missing keys"):
        KvzReader(file_with_header(good))
    for body in (b"\xff\xfe", b"[" * 100000, b'{"a":1,"a":2}', b'{"x": NaN}', b"not json"):
        with pytest.raises(FormatError):
            KvzReader(file_with_header(body))


def test_every_single_bit_flip_is_detected(small):
    """Flipping any one bit of a small valid file raises a KvzError on full decode."""
    ref = kvcodec.decode(small, output="kvcache")
    undetected = []
    for bit in range(len(small) * 8):
        try:
            out = kvcodec.decode(flip_bit(small, bit), output="kvcache")
        except KvzError:
            continue
        undetected.append((bit, out.equal(ref)))
    assert undetected == []


def test_lazy_layer_read_touches_only_that_layer():
    data = kvcodec.encode(random_cache(layers=4, seq=40, dim=8), chunk_tokens=16)

    class Spy(io.BytesIO):
        def __init__(self, b):
            super().__init__(b)
            self.ranges = []

        def read(self, n=-1):
            start = self.tell()
            out = super().read(n)
            self.ranges.append((start, start + len(out)))
            return out

    spy = Spy(data)
    with kvcodec.open_kvz(spy) as f:
        spy.ranges.clear()
        k, v = f.layer(2)
        sections = f.reader.sections
    mine = [(e.offset, e.payload_offset + e.length) for e in sections if e.layer == 2 and e.section_type == L.SECTION_KV]
    for a, b in spy.ranges:
        assert any(lo <= a and b <= hi for lo, hi in mine), (a, b)
    full = kvcodec.decode(data, output="kvcache")
    assert torch.equal(k.view(torch.int16), full.keys[2].view(torch.int16))
    assert torch.equal(v.view(torch.int16), full.values[2].view(torch.int16))


def test_writer_streams_without_seeking():
    class WriteOnly:
        def __init__(self):
            self.chunks = []

        def write(self, b):
            self.chunks.append(bytes(b))
            return len(b)

    sink = WriteOnly()
    cache = random_cache(layers=3, seq=10)
    n = kvcodec.Encoder(tier="lossless", chunk_tokens=4, threads=1).write(sink, cache)
    data = b"".join(sink.chunks)
    assert len(data) == n
    assert kvcodec.decode(data, output="kvcache").equal(kvcodec.to_canonical(cache))
    # one write per section header / payload: no part of the file is buffered whole
    assert max(len(c) for c in sink.chunks) < len(data) / 3
