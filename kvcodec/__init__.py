"""kvcodec: store transformer KV caches compactly and safely (the .kvz format).

Public API::

    data = kvcodec.encode(cache)                      # tier "lossless"
    data = kvcodec.encode(cache, tier="lossy", bits=3) # ~3 bits per component, no model to decode
    data = kvcodec.encode(cache, model)               # tier "exact": tokens + residual, needs the model
    cache = kvcodec.decode(data, model=None)          # a transformers DynamicCache
    kvcodec.save("cache.kvz", cache); kvcodec.load("cache.kvz")
    kvcodec.inspect("cache.kvz")                      # header only, JSON-able dict
    model, tokenizer = kvcodec.load_model("smollm2")  # the embedded default, offline
    store = kvcodec.Store("s3://bucket/memory", model)  # many sessions, shared prefixes stored once
    small = kvcodec.reduce(cache, model, keep=0.1)     # 10 % of the entries, atoms with masses; generate() on it
    profile = kvcodec.calibrate(model, tokenizer=tok)    # once per model: key channel weights (quantizer weighted)
    pred = kvcodec.calibrate_predictors(model, tokenizer=tok, profile=profile)  # once per model (AQUA-KV)
    data = kvcodec.encode(cache, tier="lossy", bits=2, quantizer="weighted", profile=profile, predictors=pred)
    cache = kvcodec.decode(data, predictors=pred)     # the predictors, never the model
"""

# The public names load on first use (PEP 562): the tiers and codecs import torch, transformers and numba
# (seconds), and ``import kvcodec.cli`` - ``kvz --version``, ``kvz --help`` - needs none of them.
import importlib
import importlib.util
from typing import TYPE_CHECKING

from . import registry

# calibrate is bound now, not on first use: it is also its module's name, and the first import of
# kvcodec.calibrate (by any module) would set the package's attribute to the module (light: numpy and torch load
# inside its functions)
from .calibrate import Profile, calibrate
from .errors import (
    BackendUnavailable,
    BadMagic,
    ChecksumMismatch,
    ConfigError,
    FallbackWarning,
    FormatError,
    KvzError,
    LimitExceeded,
    ModelMismatch,
    NumericsMismatch,
    ObjectMissing,
    OffsetError,
    PredictorsRequired,
    ReservedBitSet,
    ResidualWarning,
    StoreBusy,
    TrailingData,
    TruncatedFile,
    UnknownId,
    UnsafeObject,
    UnsupportedCache,
    UnsupportedVersion,
)
from .version import __version__

if TYPE_CHECKING:  # the same names, as type checkers and editors see them
    from .api import Encoder, KvzFile, decode, encode, inspect, load, open_kvz, save
    from .cache import KVCache, to_canonical
    from .models import load_model, model_fingerprint, tokenizer_fingerprint
    from .predict import Predictors, calibrate_predictors
    from .reduction import ReducedCache, reduce
    from .store import Store

#: public name -> the module that defines it, imported when the name is first asked for
_LAZY = {
    **dict.fromkeys(["Encoder", "KvzFile", "decode", "encode", "inspect", "load", "open_kvz", "save"], "api"),
    **dict.fromkeys(["KVCache", "to_canonical"], "cache"),
    **dict.fromkeys(["load_model", "model_fingerprint", "tokenizer_fingerprint"], "models"),
    **dict.fromkeys(["Predictors", "calibrate_predictors"], "predict"),
    **dict.fromkeys(["ReducedCache", "reduce"], "reduction"),
    "Store": "store",
}


def _load_builtins() -> None:
    """Register the built-in codecs and tiers (the registry calls this before its first look-up)."""
    from . import codecs, tiers  # noqa: F401  (registers them)


registry.set_builtins(_load_builtins)


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value  # once: later look-ups are plain attribute reads
        return value
    if not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f".{name}", __name__)  # a submodule: kvcodec.tokens, kvcodec.tiers, ...
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "__version__", "Encoder", "encode", "decode", "save", "load", "inspect", "open_kvz", "KvzFile", "load_model",
    "model_fingerprint", "tokenizer_fingerprint", "KVCache", "to_canonical", "Store", "reduce", "ReducedCache",
    "calibrate", "Profile", "calibrate_predictors", "Predictors",
    "KvzError", "FormatError", "BadMagic", "UnsupportedVersion", "UnknownId", "ReservedBitSet", "TruncatedFile",
    "TrailingData", "OffsetError", "LimitExceeded", "ChecksumMismatch", "ModelMismatch", "NumericsMismatch",
    "PredictorsRequired", "UnsupportedCache", "UnsafeObject", "ObjectMissing", "StoreBusy",
    "ConfigError",
    "BackendUnavailable", "FallbackWarning", "ResidualWarning",
]

