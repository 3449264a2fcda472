"""The kvcodec exception tree.

Every problem with a file's bytes raises a :class:`KvzError` subclass whose
message names the field and, where there is one, the byte offset::

    KvzError
    ├── FormatError (ValueError)        malformed or unsupported file
    │   ├── BadMagic
    │   ├── UnsupportedVersion
    │   ├── UnknownId                   unknown codec / dtype / critical section type
    │   ├── ReservedBitSet
    │   ├── TruncatedFile
    │   ├── TrailingData
    │   ├── OffsetError                 holes, overlaps, index disagreeing with sections
    │   ├── LimitExceeded               a declared size beyond the decoder's limits
    │   ├── ChecksumMismatch
    │   └── UnsafeObject                a store object that is not a plain file (a link, a FIFO, a directory)
    ├── ObjectMissing (+FileNotFoundError) a store object a session needs is not there
    ├── StoreBusy                       another collector holds the store's collection lease
    ├── ModelMismatch                   the file needs another model than the one given
    ├── NumericsMismatch                this machine cannot reproduce the file's float results
    ├── PredictorsRequired              a predicted lossy file needs the predictors it names
    ├── ConfigError (ValueError)        bad options / pipeline config at the API
    │   └── UnsupportedCache (+TypeError) a cache (layer) class kvcodec cannot store faithfully
    └── BackendUnavailable (ImportError)

API misuse that is not about bytes (a closed writer, a tensor of the wrong
type) raises plain ``TypeError`` / ``ValueError``.
"""

from __future__ import annotations

import os
import sys
import warnings

__all__ = [
    "KvzError", "FormatError", "BadMagic", "UnsupportedVersion", "UnknownId",
    "ReservedBitSet", "TruncatedFile", "TrailingData", "OffsetError",
    "LimitExceeded", "ChecksumMismatch", "UnsafeObject", "ObjectMissing", "StoreBusy", "ModelMismatch",
    "NumericsMismatch", "PredictorsRequired", "UnsupportedCache",
    "ConfigError",
    "BackendUnavailable", "FallbackWarning", "warn",
]


class KvzError(Exception):
    """Base class of every kvcodec error.

    Attributes
    ----------
    field : str or None
        The spec name of the field at fault (``Header_Length``, ``Payload_Checksum`` ...).
    offset : int or None
        Absolute byte offset of that field in the file, when known.
    """

    def __init__(self, message: str, *, field: str | None = None, offset: int | None = None):
        self.message = message
        self.field = field
        self.offset = offset
        where = []
        if field is not None:
            where.append(f"field {field}")
        if offset is not None:
            where.append(f"offset {offset}")
        super().__init__(f"{message} ({', '.join(where)})" if where else message)


class FormatError(KvzError, ValueError):
    """The bytes are not a valid .kvz file (or not one this decoder supports)."""


class BadMagic(FormatError):
    """The file does not start (or end) with the .kvz magic."""


class UnsupportedVersion(FormatError):
    """The file's format version is newer than (or incompatible with) this decoder."""


class UnknownId(FormatError):
    """An id (codec, dtype, critical section type) is not in this decoder's registry."""


class ReservedBitSet(FormatError):
    """A reserved field or bit is not zero."""


class TruncatedFile(FormatError):
    """The file ends before a structure it declares."""


class TrailingData(FormatError):
    """Bytes follow the end of the file's last structure."""


class OffsetError(FormatError):
    """Sections overlap, leave holes, or disagree with the section index."""


class LimitExceeded(FormatError):
    """A size declared in the file exceeds this decoder's limits."""


class ChecksumMismatch(FormatError):
    """A stored checksum does not match the bytes it covers."""


class UnsafeObject(FormatError):
    """A store object (or a directory on its path) that is not a plain file or directory: a symbolic link, a
    FIFO, a device, a directory where a file belongs.  Never followed, read or deleted; a reader moves it to
    the store's ``quarantine/`` where it stands at an object's name."""


class ObjectMissing(KvzError, FileNotFoundError):
    """A store object that a session needs (a chunk, a cold chunk, a numerics profile) is not there: the
    session was evicted without the model that recomputes it, or is damaged.  Also a ``FileNotFoundError``
    (earlier versions raised that)."""


class StoreBusy(KvzError):
    """Another process holds the store's collection lease (spec/store.md §7): one collection at a time.  The
    message names the holder and when its lease lapses."""


class ModelMismatch(KvzError):
    """The file was made with a different model than the one supplied (or needs one)."""


class NumericsMismatch(KvzError):
    """This machine cannot reproduce the floating-point results the file's token tier needs (another CPU
    kernel level, BLAS code path, attention implementation, dtype, device or library version: the file's
    ``tokens.procedure.numerics``), found before any work.  The message says what would work."""


class PredictorsRequired(KvzError):
    """The file's lossy tensors are residuals of a prediction whose predictors (named by their SHA-256) were not
    given, or other predictors were: decode with ``predictors=`` the file names."""


class ConfigError(KvzError, ValueError):
    """Invalid options or codec configuration passed to the API."""


class UnsupportedCache(ConfigError, TypeError):
    """The cache, or one of its layers, is of a class kvcodec does not know how to store without loss
    (quantized, offloaded or indexed layers, a subclass with extra state): refused by name, with the list of
    supported classes, rather than stored in part.  A :class:`ConfigError` (the CLI prints it in one line) and,
    for code written against earlier versions, a ``TypeError``."""


class BackendUnavailable(KvzError, ImportError):
    """An optional backend (Triton, a GPU) is not available."""


class FallbackWarning(UserWarning):
    """An encoder could not use the tier asked for and used another one (the reason is in the message and in
    the file's ``info.fallback``)."""


class ResidualWarning(UserWarning):
    """A token tier's regeneration does not reproduce the cache at many positions, so the file carries a large
    residual (the message names the fraction of positions that differ, the likely cause and the sizes)."""


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def warn(message: str, category=UserWarning) -> None:
    """``warnings.warn`` attributed to the first caller outside kvcodec (the user's line, whatever the depth)."""
    level, frame = 2, sys._getframe(1)  # stacklevel 2 is warn()'s caller
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
