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

from . import codecs, tiers  # noqa: E402,F401  (register the built-in codecs and tiers)
from .api import Encoder, KvzFile, decode, encode, inspect, load, open_kvz, save  # noqa: E402
from .cache import KVCache, to_canonical  # noqa: E402
from .calibrate import Profile, calibrate  # noqa: E402
from .errors import (  # noqa: E402
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
from .models import load_model, model_fingerprint, tokenizer_fingerprint  # noqa: E402
from .predict import Predictors, calibrate_predictors  # noqa: E402
from .reduction import ReducedCache, reduce  # noqa: E402
from .store import Store  # noqa: E402
from .version import __version__
from ._compat import llvmlite_shim  # noqa: E402

llvmlite_shim()  # numba is loaded: let vLLM's workers start beside it (kvcodec/_compat.py)

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

