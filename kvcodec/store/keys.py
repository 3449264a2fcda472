"""Keys and names: what a store's objects are called and how a name is derived (spec/store.md §1-§3, §5).

Nothing here reads or writes: every function is a pure function of token ids and keys, so that a reader, a
writer and a collector agree on every name without asking each other.

* A chunk's **key** is a chained SHA-256 over (namespace id, parent chunk's key, its token ids as u32 LE):
  equal keys mean equal token prefixes, in every process and on every machine.
* A **prefix directory** ``entries/<p>/`` is named by the key the first m tokens of a chunk would have as a
  chunk of their own (m = 0, G, 2G, ...); its **entries** are empty objects whose names carry the chunk's
  next token ids (up to G) and the chunk's key, so one listing answers "which stored chunks continue this
  prefix, and how" to the exact token.
"""

from __future__ import annotations

import hashlib
import json
import re

import numpy as np
import torch

from ..errors import ConfigError

FORMAT = "kvz-store"
#: the namespace record's version (spec §2): unchanged since 1.0, so namespaces (and their ids) carry over
VERSION = 1
#: the store specification's revision this code implements (spec/store.md, change log §9)
REVISION = "2.1.0"
CHUNK_MAGIC = b"kvcodec-store-chunk-v1\x00"
ROOT_PARENT = bytes(32)
#: entry names carry at most this many token ids (8 hex digits each: a name stays under 255 bytes)
MAX_GRANULARITY = 16
TEMP_SUFFIX = ".kvz-tmp"

_HEX64 = re.compile(r"[0-9a-f]{64}\Z")
_HEX16 = re.compile(r"[0-9a-f]{16}\Z")
_ENTRY = re.compile(r"((?:[0-9a-f]{8}){1,16})\.([0-9a-f]{64})\Z")


def token_ids(tokens) -> np.ndarray:
    """Token ids as a 1-D int64 array, from a sequence, a 1-D tensor or a ``[1, n]`` tensor (as tokenizers
    return them)."""
    t = tokens.detach().cpu().numpy() if isinstance(tokens, torch.Tensor) else np.asarray(tokens)
    if t.ndim == 2 and t.shape[0] == 1:
        t = t[0]
    if t.ndim != 1:
        raise ConfigError(f"tokens must be a 1-D sequence or a [1, n] tensor, not shape {tuple(t.shape)}")
    if t.size and (not np.issubdtype(t.dtype, np.integer) or t.min() < 0 or t.max() >= 1 << 32):
        raise ConfigError("token ids must be integers in [0, 2**32)")
    return t.astype(np.int64)


def chunk_key(namespace: bytes, parent: bytes, ids: np.ndarray) -> bytes:
    """SHA-256 of ``CHUNK_MAGIC ‖ namespace id (32 bytes) ‖ parent key (32 bytes) ‖ ids as u32 LE``."""
    return hashlib.sha256(CHUNK_MAGIC + namespace + parent + np.asarray(ids).astype("<u4").tobytes()).digest()


def chain_key(namespace: bytes, parent: bytes, ids: np.ndarray, chunk_tokens: int) -> bytes:
    """The key of the last chunk of ``ids`` split into chunks of ``chunk_tokens`` after ``parent``."""
    k = parent
    for a in range(0, len(ids), chunk_tokens):
        k = chunk_key(namespace, k, ids[a:a + chunk_tokens])
    return k


def is_hex64(x) -> bool:
    return isinstance(x, str) and _HEX64.match(x) is not None


def canonical(obj) -> bytes:
    """Canonical JSON (spec §0): sorted keys, no spaces, UTF-8."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def entry_levels(n: int, chunk_tokens: int, granularity: int) -> range:
    """The prefix lengths m of a chunk of ``n`` tokens that have an entry: 0, G, 2G, ... below n (and below
    the chunk size); none for granularity 0."""
    if not granularity:
        return range(0)
    return range(0, min(n, chunk_tokens), granularity)


def entry_name(following: np.ndarray, key: bytes) -> str:
    """An entry's name: the chunk's next token ids (1 .. G of them) as 8 hex digits each, ``.``, its key."""
    return "".join(f"{int(t):08x}" for t in following) + "." + key.hex()


def parse_entry_name(name: str, granularity: int) -> tuple[np.ndarray, bytes] | None:
    """(the token ids, the chunk key) an entry's name carries, or None for a name that is not an entry's."""
    m = _ENTRY.match(name)
    if m is None or len(m.group(1)) > 8 * granularity:
        return None
    digits = m.group(1)
    ids = np.array([int(digits[i:i + 8], 16) for i in range(0, len(digits), 8)], dtype=np.int64)
    return ids, bytes.fromhex(m.group(2))


def common_length(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading ids two sequences share."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


# -- paths, relative to the store's root ('/'-separated; spec §1) -------------------------------------------------
def namespace_path(ns: str) -> str:
    return f"ns/{ns}/namespace.json"


def chunk_path(ns: str, key: bytes) -> str:
    h = key.hex()
    return f"ns/{ns}/chunks/{h[:2]}/{h}.kvz"


def cold_path(ns: str, key: bytes) -> str:
    h = key.hex()
    return f"ns/{ns}/chunks/{h[:2]}/{h}.ids"


def session_path(ns: str, session: str) -> str:
    return f"ns/{ns}/sessions/{session[:2]}/{session}.kvs"


def reduced_path(ns: str, session: str, reduction: str) -> str:
    """A reduced object (spec §6.1): a reduced cache of the token sequence whose session key is ``session``."""
    return f"ns/{ns}/reduced/{session[:2]}/{session}/{reduction}.kvz"


def reduction_id(reduce_record: dict) -> str:
    """16 lowercase hex digits: the first 8 bytes of SHA-256 of the canonical JSON of a reduced file's header
    ``reduce`` object (how it was reduced), which names its reduced object among those of one sequence."""
    return hashlib.sha256(canonical(reduce_record)).hexdigest()[:16]


def split_reduced_key(key) -> tuple[str, str, str] | None:
    """``(namespace, session, reduction)`` of a reduced object's key ``<N>:<s>:<r>``, else None."""
    parts = str(key).split(":")
    if len(parts) == 3 and is_hex64(parts[0]) and is_hex64(parts[1]) and _HEX16.match(parts[2]):
        return parts[0], parts[1], parts[2]
    return None


def is_reduced_name(name: str, kind: str = "file") -> bool:
    """Whether ``name`` is a reduced object's file name, ``<r>.kvz`` with ``r`` 16 lowercase hex digits."""
    return kind == "file" and name.endswith(".kvz") and _HEX16.match(name[:-4]) is not None


def is_reduced_rel(parts: list[str], name: str) -> bool:
    """Whether ``parts`` (a path below ``ns/<N>/``, split) name a reduced object (spec §1)."""
    return (len(parts) == 4 and parts[0] == "reduced" and is_hex64(parts[2]) and parts[1] == parts[2][:2]
            and is_reduced_name(name))


def numerics_path(ns: str, pid: bytes) -> str:
    return f"ns/{ns}/numerics/{pid.hex()}.json"


def predictors_path(ns: str, ident: str) -> str:
    return f"ns/{ns}/predictors/{ident}.safetensors"


def entry_dir(ns: str, prefix_key: bytes) -> str:
    h = prefix_key.hex()
    return f"ns/{ns}/entries/{h[:2]}/{h}"


LEASE = "gc/lease.json"
LOCK = "gc/lock"


def record_path(epoch: int) -> str:
    return f"gc/epochs/{epoch:012d}.json"


def split_chunk_name(name: str) -> tuple[bytes, str] | None:
    """(key, ``"kvz"`` or ``"ids"``) of a chunk object's file name, or None."""
    if len(name) == 68 and name[64] == "." and name[65:] in ("kvz", "ids") and is_hex64(name[:64]):
        return bytes.fromhex(name[:64]), name[65:]
    return None


def is_temp(name: str) -> bool:
    return name.startswith(".") and name.endswith(TEMP_SUFFIX)
