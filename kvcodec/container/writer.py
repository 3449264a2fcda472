"""Streaming writer of .kvz files.

The writer never seeks and never holds more than one section: the section
index, whose offsets are only known at the end, goes at the end of the file
(like a zip central directory), followed by a fixed-size footer that points
to it.  A sequential reader can therefore stream sections in order, and a
random-access reader finds any section from the footer.
"""

from __future__ import annotations

from .. import registry
from . import layout as L
from .header import (
    BLOCKS_MINOR,
    BOUND_MINOR,
    ENGINE_MINOR,
    HEADS_MINOR,
    PREDICT_MINOR,
    STATE_MINOR,
    WEIGHTS_MINOR,
    dumps,
    reduce_minor,
)


class KvzWriter:
    """Write a .kvz file to any object with ``write(bytes)``.

    Parameters
    ----------
    sink : binary file-like
        Written sequentially; never seeked.  Not closed by the writer.
    header : dict
        The header object (see ``spec/kvz.md``); written canonically.

    Examples
    --------
    >>> import io
    >>> buf = io.BytesIO()
    >>> # w = KvzWriter(buf, header); w.write_section(...); w.close()
    """

    def __init__(self, sink, header: dict):
        self._sink = sink
        self._pos = 0
        self._entries: list[tuple] = []
        self._closed = False
        body = dumps(header)
        if len(body) > L.MAX_HEADER_BYTES:
            raise ValueError(f"header of {len(body)} bytes exceeds {L.MAX_HEADER_BYTES}")
        tier = header.get("tier")
        params = (header.get("codec") or {}).get("params")
        minor = (registry.tier(tier).file_minor(params if isinstance(params, dict) else {})
                 if registry.has_tier(tier) else L.FORMAT_VERSION_MINOR)
        if any("state" in lay for lay in header["cache"]["layers"]):
            minor = max(minor, STATE_MINOR)
        if "reduce" in header:
            minor = max(minor, reduce_minor(header["reduce"]))
            if "bound" in header["reduce"]:
                minor = max(minor, BOUND_MINOR)  # (1.11) a bounded one-shot reduction, its scores
            if any("heads" in lay.get("state", {}).get("parts", {}) for lay in header["cache"]["layers"]):
                minor = max(minor, HEADS_MINOR)  # (1.8) heads of a reduced layer holding different numbers
        if "predict" in header:
            minor = max(minor, PREDICT_MINOR)
        if (header.get("tokens") or {}).get("token_model") == "blocks":
            minor = max(minor, BLOCKS_MINOR)  # (1.9)
        if "engine_file" in header:
            minor = max(minor, ENGINE_MINOR)  # (1.10)
        if "weights" in (header.get("model") or {}) or "weights" in ((header.get("tokens") or {}).get("draft") or {}):
            minor = max(minor, WEIGHTS_MINOR)  # (1.12) the model's weights fingerprint
        pre = L.PREAMBLE.pack(L.MAGIC, L.FORMAT_VERSION_MAJOR, minor, len(body))
        self._header_checksum = L.xxh3(pre + body)
        self._write(pre + body + L.HEADER_CHECKSUM.pack(self._header_checksum))

    def _write(self, b: bytes):
        self._sink.write(b)
        self._pos += len(b)

    @property
    def position(self) -> int:
        return self._pos

    def write_section(self, section_type: int, payload: bytes, *, layer: int = 0, part: int = 0,
                      chunk: int = 0, critical: bool = True) -> None:
        """Append one section (header, payload) and remember it for the index."""
        if self._closed:
            raise ValueError("write to a closed KvzWriter")
        if section_type == L.SECTION_INDEX:
            raise ValueError("the index section is written by close()")
        flags = L.FLAG_CRITICAL if critical else 0
        self._entries.append((self._pos, section_type, part, layer, chunk, len(payload)))
        self._write(L.section_header(section_type, flags, layer, part, chunk, payload))
        self._write(payload)

    def close(self) -> int:
        """Write the index and footer; returns the file length."""
        if self._closed:
            return self._pos
        index = bytearray(L.INDEX_HEAD.pack(len(self._entries), 0))
        for off, typ, part, layer, chunk, n in self._entries:
            index += L.INDEX_ENTRY.pack(off, typ, part, layer, chunk, 0, n)
        index_offset = self._pos
        self._write(L.section_header(L.SECTION_INDEX, L.FLAG_CRITICAL, 0, 0, 0, index))
        self._write(bytes(index))
        file_length = self._pos + L.FOOTER.size
        fsum = L.footer_checksum(index_offset, file_length, self._header_checksum)
        self._write(L.FOOTER.pack(index_offset, file_length, fsum, L.END_MAGIC))
        self._closed = True
        return self._pos

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
