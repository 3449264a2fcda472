"""Random-access reader of .kvz files.

Opening a file reads the preamble, the header, the footer and the section
index, and validates all of them (checksums, limits, tiling, canonical order);
payloads are read only on demand, one section at a time, so reading one layer
never touches the others.  Every violation raises a specific
:class:`~kvcodec.errors.KvzError` naming the spec field and byte offset.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass

from ..errors import (
    BadMagic,
    ChecksumMismatch,
    FormatError,
    LimitExceeded,
    OffsetError,
    ReservedBitSet,
    TrailingData,
    TruncatedFile,
    UnknownId,
    UnsupportedVersion,
)
from . import layout as L
from .header import Header, parse

MIN_FILE = L.PREAMBLE.size + 2 + L.HEADER_CHECKSUM.size + L.SECTION_HEADER.size + L.INDEX_HEAD.size + L.FOOTER.size


@dataclass(frozen=True)
class SectionEntry:
    offset: int  # of the section header
    section_type: int
    part: int
    layer: int
    chunk: int
    length: int  # payload bytes

    @property
    def payload_offset(self) -> int:
        return self.offset + L.SECTION_HEADER.size

    @property
    def name(self) -> str:
        return L.SECTION_NAMES.get(self.section_type, f"type{self.section_type}")


class KvzReader:
    """Open a .kvz file for validated, lazy reading.

    Parameters
    ----------
    source : bytes-like, path, or seekable binary file object
    limits : dict, optional
        Override decoder limits: ``max_output_bytes``, ``max_layers``, ``max_seq_len``,
        ``max_heads``, ``max_head_dim``, ``max_batch``, ``max_header_bytes``.
    """

    def __init__(self, source, *, limits: dict | None = None):
        self._own = False
        self._mem = None  # the file's bytes, when they are in memory: payloads are read as views, not copies
        if isinstance(source, (bytes, bytearray, memoryview)):
            data = bytes(source)  # immutable: a view of it stays valid
            self._mem = memoryview(data)
            self._f = io.BytesIO(data)
        elif isinstance(source, (str, os.PathLike)):
            self._f = open(source, "rb")
            self._own = True
        else:
            self._f = source
        seekable = getattr(self._f, "seekable", None)
        if seekable is not None and not seekable():
            # pipes and sockets: buffer (the index is at the end, so a random-access
            # reader needs all of it anyway)
            data = self._f.read()
            if self._own:
                self._f.close()
                self._own = False
            self._f = io.BytesIO(data)
            self._mem = memoryview(data)
        self.limits = dict(limits or {})
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    # -- low-level reads --------------------------------------------------
    def _seek_span(self, offset: int, n: int, field: str) -> None:
        """Refuse ``n`` bytes at ``offset`` that run past the file, else seek there."""
        if offset + n > self.size:
            raise TruncatedFile(f"need {n} bytes at offset {offset}, file has {self.size}", field=field, offset=offset)
        self._f.seek(offset)

    def _read_at(self, offset: int, n: int, field: str) -> bytes:
        self._seek_span(offset, n, field)
        b = self._f.read(n)
        if len(b) != n:
            raise TruncatedFile(f"short read: {len(b)} of {n} bytes", field=field, offset=offset)
        return b

    def _read_into(self, offset: int, n: int, field: str, into) -> memoryview:
        """:meth:`_read_at` into the first ``n`` bytes of ``into``: a read-only view of them."""
        view = memoryview(into).cast("B")
        if view.nbytes < n:
            raise ValueError(f"a buffer of {view.nbytes} bytes cannot hold {n}")
        self._seek_span(offset, n, field)
        got = 0
        readinto = getattr(self._f, "readinto", None)
        while got < n:
            if readinto is not None:
                k = readinto(view[got:n])
            else:
                b = self._f.read(n - got)
                k = len(b)
                view[got:got + k] = b
            if not k:
                raise TruncatedFile(f"short read: {got} of {n} bytes", field=field, offset=offset)
            got += k
        return view[:n].toreadonly()

    def _open(self):
        f = self._f
        f.seek(0, os.SEEK_END)
        self.size = f.tell()
        head = self._read_at(0, min(self.size, L.PREAMBLE.size), "Magic")
        if head[:len(L.MAGIC)] != L.MAGIC[:len(head)]:
            raise BadMagic("not a .kvz file (magic mismatch)", field="Magic", offset=0)
        if self.size < MIN_FILE:
            raise TruncatedFile(f"file of {self.size} bytes is shorter than the smallest .kvz file ({MIN_FILE})",
                                field="Magic", offset=self.size)
        _, major, minor, hlen = L.PREAMBLE.unpack(head)
        if major != L.FORMAT_VERSION_MAJOR:
            raise UnsupportedVersion(f"format version {major}.{minor}; this decoder reads {L.FORMAT_VERSION_MAJOR}.x",
                                     field="Version_Major", offset=8)
        if minor > L.FORMAT_VERSION_MINOR:
            raise UnsupportedVersion(f"format version {major}.{minor}; this decoder reads 1.0 to "
                                     f"1.{L.FORMAT_VERSION_MINOR} (a newer kvcodec reads it)",
                                     field="Version_Minor", offset=10)
        self.version = (major, minor)
        max_header = self.limits.get("max_header_bytes", L.MAX_HEADER_BYTES)
        if hlen > max_header:
            raise LimitExceeded(f"Header_Length {hlen} exceeds the limit of {max_header}",
                                field="Header_Length", offset=12)
        hend = L.PREAMBLE.size + hlen
        if hend + 8 + L.SECTION_HEADER.size + L.INDEX_HEAD.size + L.FOOTER.size > self.size:
            raise TruncatedFile(f"Header_Length {hlen} runs past the end of a {self.size}-byte file",
                                field="Header_Length", offset=12)
        body = self._read_at(L.PREAMBLE.size, hlen, "Header")
        (hsum,) = L.HEADER_CHECKSUM.unpack(self._read_at(hend, 8, "Header_Checksum"))
        self.header_checksum = L.xxh3(head + body)
        if hsum != self.header_checksum:
            raise ChecksumMismatch(f"header checksum {hsum:016x} != computed {self.header_checksum:016x}",
                                   field="Header_Checksum", offset=hend)
        self.header: Header = parse(body, offset=L.PREAMBLE.size, limits=self.limits)
        if minor < self.header.read_minor:
            raise FormatError(f"tier {self.header.tier!r} with what this header uses needs format "
                              f"1.{self.header.read_minor} or later, the file says 1.{minor}",
                              field="Version_Minor", offset=10)
        self.data_start = hend + 8
        self._read_footer_and_index()

    def _find_earlier_footer(self, window: int = 64 << 10):
        """No End_Magic at the end: a valid footer that ends earlier (within ``window`` bytes of the end) means
        bytes were appended to a complete file: TrailingData, not TruncatedFile."""
        start = max(self.data_start, self.size - window)
        tail = self._read_at(start, self.size - start, "End_Magic")
        at = tail.rfind(L.END_MAGIC)
        while at >= L.FOOTER.size - 8:
            fo = start + at + 8 - L.FOOTER.size
            index_offset, file_length, fsum, _ = L.FOOTER.unpack_from(tail, at + 8 - L.FOOTER.size)
            if file_length == fo + L.FOOTER.size and fsum == L.footer_checksum(index_offset, file_length,
                                                                                 self.header_checksum):
                raise TrailingData(f"{self.size - file_length} bytes follow the end of the file",
                                   field="File_Length", offset=fo + 8)
            at = tail.rfind(L.END_MAGIC, 0, at)

    def _read_footer_and_index(self):
        fo = self.size - L.FOOTER.size
        index_offset, file_length, fsum, end = L.FOOTER.unpack(self._read_at(fo, L.FOOTER.size, "End_Magic"))
        if end != L.END_MAGIC:
            self._find_earlier_footer()
            raise TruncatedFile("the file does not end with End_Magic (truncated, or not closed by its writer)",
                                field="End_Magic", offset=self.size - 8)
        if fsum != L.footer_checksum(index_offset, file_length, self.header_checksum):
            raise ChecksumMismatch("footer checksum mismatch (or footer of another file)", field="Footer_Checksum",
                                   offset=fo + 16)
        if file_length < self.size:
            raise TrailingData(f"{self.size - file_length} bytes beyond the length the footer declares",
                               field="File_Length", offset=fo + 8)
        if file_length > self.size:
            raise TruncatedFile(f"File_Length {file_length} > actual size {self.size}", field="File_Length",
                                offset=fo + 8)
        if not self.data_start <= index_offset <= fo - L.SECTION_HEADER.size - L.INDEX_HEAD.size:
            raise OffsetError(f"Index_Offset {index_offset} outside [{self.data_start}, {fo}]",
                              field="Index_Offset", offset=fo)
        ihead = self._section_header_at(index_offset)
        typ, flags, layer, part, chunk, plen = ihead[:6]
        if typ != L.SECTION_INDEX:
            raise OffsetError(f"Index_Offset points at a section of type {typ}", field="Index_Offset", offset=fo)
        if flags != L.FLAG_CRITICAL:  # its reserved bits were checked with its header: Critical is clear
            raise FormatError("index section header: Section_Flags must be 1 (Critical)", field="Section_Flags",
                              offset=index_offset + 2)
        for name, value, at in (("Layer", layer, 4), ("Part", part, 8), ("Chunk", chunk, 12)):
            if value:
                raise FormatError(f"index section header: {name} {value} must be 0", field=name,
                                  offset=index_offset + at)
        if plen != fo - index_offset - L.SECTION_HEADER.size:
            raise OffsetError(f"index payload of {plen} bytes does not end at the footer", field="Payload_Length",
                              offset=index_offset + 16)
        if (plen - L.INDEX_HEAD.size) % L.INDEX_ENTRY.size or plen > L.INDEX_HEAD.size + L.INDEX_ENTRY.size * L.MAX_SECTIONS:
            raise FormatError(f"index payload of {plen} bytes is not a whole number of entries",
                              field="Payload_Length", offset=index_offset + 16)
        payload = self._read_at(index_offset + L.SECTION_HEADER.size, plen, "Index")
        if L.xxh3(payload) != ihead[6]:
            raise ChecksumMismatch("index payload checksum mismatch", field="Payload_Checksum",
                                   offset=index_offset + 24)
        count, reserved = L.INDEX_HEAD.unpack_from(payload, 0)
        ip = index_offset + L.SECTION_HEADER.size
        if reserved:
            raise ReservedBitSet("index Reserved is not zero", field="Index.Reserved", offset=ip + 4)
        if count != (plen - L.INDEX_HEAD.size) // L.INDEX_ENTRY.size:
            raise FormatError(f"Entry_Count {count} disagrees with the index length", field="Entry_Count", offset=ip)
        entries = []
        pos = self.data_start
        for i in range(count):
            eo = ip + L.INDEX_HEAD.size + i * L.INDEX_ENTRY.size
            off, typ, part, layer, chunk, res, n = L.INDEX_ENTRY.unpack_from(payload, L.INDEX_HEAD.size + i * L.INDEX_ENTRY.size)
            if res:
                raise ReservedBitSet(f"index entry {i}: Reserved is not zero", field="Index.Reserved", offset=eo + 20)
            if off != pos:
                raise OffsetError(f"index entry {i}: section at {off}, expected {pos} (holes or overlaps)",
                                  field="Index.Offset", offset=eo)
            if typ == L.SECTION_INDEX:
                raise OffsetError(f"index entry {i}: an index inside the index", field="Index.Section_Type", offset=eo + 8)
            pos = off + L.SECTION_HEADER.size + n
            if pos > index_offset:
                raise OffsetError(f"index entry {i}: section runs past the index", field="Index.Payload_Length",
                                  offset=eo + 24)
            entries.append(SectionEntry(off, typ, part, layer, chunk, n))
        if pos != index_offset:
            raise OffsetError(f"{index_offset - pos} bytes between the last section and the index",
                              field="Index_Offset", offset=fo)
        # known sections must be exactly the expected ones, in canonical order
        known = []
        for e in entries:
            if e.section_type in L.SECTION_NAMES:
                known.append(e)
            else:
                flags = self._section_header_at(e.offset)[1]
                if flags & L.FLAG_CRITICAL:
                    raise UnknownId(f"critical section of unknown type {e.section_type}", field="Section_Type",
                                    offset=e.offset)
        got = [(e.section_type, e.layer, e.part, e.chunk) for e in known]
        i = 0
        for want, optional in self.header.expected_sections():
            if i < len(got) and got[i] == want:
                i += 1
            elif not optional:
                at = known[i].offset if i < len(known) else index_offset
                have = got[i] if i < len(got) else "no more sections"
                raise OffsetError(f"section {i}: found {have}, header implies {want} (type, layer, part, chunk)",
                                  field="Section_Type", offset=at)
        if i < len(got):
            raise OffsetError(f"section {i}: {got[i]} is not expected here (type, layer, part, chunk)",
                              field="Section_Type", offset=known[i].offset)
        self.sections = entries
        self._by_key = {(e.section_type, e.layer, e.part, e.chunk): e for e in known}
        self.index_offset = index_offset

    def _section_header_at(self, offset: int):
        raw = self._read_at(offset, L.SECTION_HEADER.size, "Section_Type")
        typ, flags, layer, part, res, chunk, n, psum, hsum = L.SECTION_HEADER.unpack(raw)
        if L.xxh3(raw[:L.SECTION_HEADER_CHECKED]) != hsum:
            raise ChecksumMismatch("section header checksum mismatch", field="Section_Header_Checksum",
                                   offset=offset + 32)
        if res:
            raise ReservedBitSet("section Reserved is not zero", field="Section.Reserved", offset=offset + 10)
        if flags & L.FLAGS_RESERVED:
            raise ReservedBitSet(f"reserved Section_Flags bits set: {flags:#06x}", field="Section_Flags",
                                 offset=offset + 2)
        return typ, flags, layer, part, chunk, n, psum

    # -- public -----------------------------------------------------------
    def entry(self, section_type: int, layer: int = 0, part: int = 0, chunk: int = 0) -> SectionEntry:
        return self._by_key[(section_type, layer, part, chunk)]

    def has(self, section_type: int, layer: int = 0, part: int = 0, chunk: int = 0) -> bool:
        return (section_type, layer, part, chunk) in self._by_key

    def read_payload(self, e: SectionEntry) -> bytes:
        """Read one section's payload, checking its header against the index and its checksum."""
        data = self.read_payload_view(e)
        return data if isinstance(data, bytes) else data.tobytes()

    def in_memory(self) -> bool:
        """Whether the file's bytes are in memory (payloads are then read as views of them, not copies)."""
        return self._mem is not None

    def read_payload_view(self, e: SectionEntry, into=None) -> bytes | memoryview:
        """:meth:`read_payload`, as a read-only view of the file's bytes when they are in memory (no copy), or,
        given ``into`` (a writable byte buffer of at least the payload's length), a read-only view of ``into``
        holding the payload read there (a file on disk: no new memory a payload)."""
        typ, flags, layer, part, chunk, n, psum = self._section_header_at(e.offset)
        if (typ, layer, part, chunk, n) != (e.section_type, e.layer, e.part, e.chunk, e.length):
            raise OffsetError("section header disagrees with the index", field="Section_Type", offset=e.offset)
        if not flags & L.FLAG_CRITICAL and typ in L.SECTION_NAMES:
            raise FormatError(f"a {e.name} section is not marked critical", field="Section_Flags", offset=e.offset + 2)
        if self._mem is not None and e.payload_offset + n <= self.size:
            data = self._mem[e.payload_offset:e.payload_offset + n]
        elif into is not None:
            data = self._read_into(e.payload_offset, n, "Payload", into)
        else:
            data = self._read_at(e.payload_offset, n, "Payload")
        if L.xxh3(data) != psum:
            raise ChecksumMismatch(f"{e.name} section (layer {e.layer}, part {e.part}, chunk {e.chunk}): "
                                   "payload checksum mismatch", field="Payload_Checksum", offset=e.offset + 24)
        return data

    def read_payload_prefix(self, e: SectionEntry, n: int) -> bytes:
        """The first ``min(n, length)`` bytes of a payload, unchecked (for ``inspect``'s per-section facts)."""
        return self._read_at(e.payload_offset, min(n, e.length), "Payload")

    def verify_checksums(self) -> None:
        """Read every section and check every checksum (no decoding)."""
        for e in self.sections:
            self.read_payload(e)

    def close(self):
        if self._own:
            self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
