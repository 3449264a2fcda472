"""Wire constants of the .kvz container, mirrored from ``spec/kvz.md``.

Field names in the spec (``Header_Length``) are the UPPER_CASE names here.
Everything is little-endian.
"""

from __future__ import annotations

import struct

import xxhash

#: 8 bytes.  0x89 is not ASCII and cannot start a UTF-8 sequence, so the file is
#: never mistaken for text; CR LF / LF and 0x1A catch line-ending conversion and
#: DOS ``type`` (same reasoning as PNG's signature).
MAGIC = b"\x89KVZ\r\n\x1a\n"
#: last 8 bytes of every file
END_MAGIC = b"\x89KVZEND\n"

FORMAT_VERSION_MAJOR = 1
FORMAT_VERSION_MINOR = 12  # the highest minor version this code reads and writes
# A writer stamps the lowest minor version that can express the file - each tier's ``min_minor`` (0 for the
# lossless tier, so 1.0 readers keep reading lossless files; 1 for the token tiers, 2 for the lossy tier), 3
# when a layer carries recurrent / conv state, 4 for a reduced cache (a ``reduce`` object), 5 for the lossy
# tier's quantizer ``weighted`` (``vq_rans`` Method 5), 6 for predicted slices (``predict``), 7 for a cache
# reduced by ``tova`` or ``kvzip``, 8 for a reduced layer whose heads hold different numbers of entries
# (``parts.heads``), 9 for token model ``blocks``, 10 for engine files, 11 for bounded reduced caches, 12 for a
# ``model.weights`` fingerprint.

PREAMBLE = struct.Struct("<8sHHI")  # Magic, Version_Major, Version_Minor, Header_Length
HEADER_CHECKSUM = struct.Struct("<Q")
SECTION_HEADER = struct.Struct("<HHIHHIQQQ")  # 40 bytes; see spec "Section header"
SECTION_HEADER_CHECKED = 32  # Section_Header_Checksum covers the first 32 bytes
INDEX_HEAD = struct.Struct("<II")  # Entry_Count, Reserved
INDEX_ENTRY = struct.Struct("<QHHIIIQ")  # 32 bytes
FOOTER = struct.Struct("<QQQ8s")  # Index_Offset, File_Length, Footer_Checksum, End_Magic

# Section types (spec/registry.md).  Never reuse a retired number.
SECTION_KV = 1
SECTION_TOKEN_IDS = 2  # the cache's token ids, raw (not the token_stream)
SECTION_TOKEN_STREAM = 3  # format 1.1
SECTION_RESIDUAL = 4  # format 1.1
SECTION_TENSOR_CHECKSUMS = 5  # format 1.1
SECTION_STATE = 6  # format 1.3: one recurrent / conv state tensor
SECTION_ENGINE_BYTES = 7  # format 1.10: the verbatim bytes of an engine file (spec section 15)
SECTION_INDEX = 0xFFFF
SECTION_NAMES = {SECTION_KV: "kv", SECTION_TOKEN_IDS: "tokens", SECTION_TOKEN_STREAM: "token_stream",
                 SECTION_RESIDUAL: "residual", SECTION_TENSOR_CHECKSUMS: "tensor_checksums",
                 SECTION_STATE: "state", SECTION_ENGINE_BYTES: "engine_bytes", SECTION_INDEX: "index"}

FLAG_CRITICAL = 0x0001  # a reader that does not know the type must reject the file
FLAGS_RESERVED = 0xFFFE

PART_KEYS = 0
PART_VALUES = 1

#: the header's ``reduce`` object (1.4): what reduced the cache (``tova``, ``kvzip``: 1.7), the merge-reduce
#: reducers, the mass forms (:mod:`kvcodec.state` uses them; here, the command line lists them without torch)
REDUCE_METHODS = ("cluster", "sample", "streaming", "snapkv", "h2o", "tova", "kvzip")
REDUCERS = ("cluster", "sample")
REDUCE_FORMS = ("query", "dot", "kernel")

# Decoder limits (a decoder may lower them; these are the defaults).
MAX_HEADER_BYTES = 16 << 20
MAX_SECTIONS = 1 << 22
MAX_LAYERS = 1 << 16
MAX_BATCH = 1 << 16
MAX_HEADS = 1 << 16
MAX_HEAD_DIM = 1 << 16
MAX_SEQ_LEN = 1 << 31
#: (1.6) predicted files: (start_position + seq_len) * D / 2, the steps of the RoPE recurrence (spec 13.1, 9)
MAX_ROPE_STEPS = 1 << 30
MAX_CHUNK_TOKENS = 1 << 24
MAX_OUTPUT_BYTES_CAP = 64 << 30  # decoded tensors; callers may raise or lower the limit


def default_max_output_bytes() -> int:
    """64 GiB or three quarters of physical memory, whichever is smaller.

    A coded payload can describe far more data than its own size, so the
    default must keep a hostile header from exhausting this machine's memory.
    """
    import os

    try:
        phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return MAX_OUTPUT_BYTES_CAP
    return min(MAX_OUTPUT_BYTES_CAP, phys * 3 // 4)


def xxh3(data) -> int:
    """XXH3-64 with seed 0: the checksum of every checksummed field."""
    return xxhash.xxh3_64_intdigest(data)


def footer_checksum(index_offset: int, file_length: int, header_checksum: int) -> int:
    """Footer_Checksum: XXH3-64 of Index_Offset, File_Length and Header_Checksum (3 x u64 LE)."""
    return xxh3(struct.pack("<QQQ", index_offset, file_length, header_checksum))


def section_header(section_type: int, flags: int, layer: int, part: int, chunk: int, payload) -> bytes:
    """The 40-byte section header of ``payload``."""
    head = SECTION_HEADER.pack(section_type, flags, layer, part, 0, chunk, len(payload), xxh3(payload), 0)
    return head[:SECTION_HEADER_CHECKED] + HEADER_CHECKSUM.pack(xxh3(head[:SECTION_HEADER_CHECKED]))
