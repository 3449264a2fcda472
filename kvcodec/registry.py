"""Registries of the tiers and codecs this version implements, keyed by the ids the header stores.

A tier (:class:`kvcodec.tiers.base.Tier`) or codec
(:class:`kvcodec.codecs.base.Codec`) class registers itself with
:func:`register_tier` / :func:`register_codec` when its module is imported;
the built-in ones are imported at the first look-up (``kvcodec`` sets how:
:func:`set_builtins`), so that importing the package does not import torch.  The container (header validation,
section layout, format revision), the API and the command line ask this module
which tiers exist instead of listing them.  An id is never reused for another
bitstream (``spec/registry.md``).
"""

from __future__ import annotations

import threading

from .errors import ConfigError

_TIERS: dict = {}
_CODECS: dict = {}
_builtins = None  # the package's importer of the built-in codecs and tiers, until it has run
_loading = False
_lock = threading.RLock()

#: The built-in tiers and their one line for help texts, known without importing them (their modules import
#: torch): ``kvz --help`` and ``kvz encode --help`` answer from this.  Each is its tier class's ``summary``
#: (tests/test_architecture.py checks).
BUILTIN_TIERS = {
    "exact": "tokens + residual, bit-identical; the model recomputes the cache",
    "lossless": "the tensors, bit-exact; no model needed to decode",
    "lossy": "quantized tensors (--bits or --max-kl); no model needed to decode",
    "tokens": "tokens only, or within a tolerance; the model recomputes the cache",
}


def set_builtins(load) -> None:
    """``load()`` registers the built-in codecs and tiers; it runs once, at the first look-up (``kvcodec``
    sets it: ``import kvcodec`` stays light, and every look-up still finds them)."""
    global _builtins
    _builtins = load


def _ensure_builtins() -> None:
    global _builtins, _loading
    if _builtins is None:
        return
    with _lock:  # another thread waits for the whole set; a look-up made while they load sees those so far
        if _builtins is None or _loading:
            return
        _loading = True
        try:
            _builtins()
            _builtins = None
        finally:
            _loading = False


def register_tier(cls):
    """Class decorator: make tier ``cls.tier_id`` available (one instance, tiers are stateless)."""
    _register(_TIERS, cls.tier_id, cls(), "tier")
    return cls


def register_codec(cls):
    """Class decorator: make codec ``cls.codec_id`` available."""
    _register(_CODECS, cls.codec_id, cls, "codec")
    return cls


def _register(table: dict, key: str, value, what: str) -> None:
    old = table.get(key)
    if old is not None and type(old) is not type(value) and old is not value:
        raise ValueError(f"{what} id {key!r} is already registered")
    table[key] = value


def unregister_tier(tier_id: str) -> None:
    """Remove a tier (tests that register one of their own)."""
    _TIERS.pop(tier_id, None)


def unregister_codec(codec_id: str) -> None:
    """Remove a codec (tests that register one of their own)."""
    _CODECS.pop(codec_id, None)


def tier(tier_id: str):
    """The registered tier of that id; :class:`ConfigError` if there is none."""
    _ensure_builtins()
    try:
        return _TIERS[tier_id]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown tier {tier_id!r}; this version implements {tier_ids()}") from None


def has_tier(tier_id) -> bool:
    _ensure_builtins()
    return isinstance(tier_id, str) and tier_id in _TIERS


def tier_ids() -> list[str]:
    _ensure_builtins()
    return sorted(_TIERS)


def tier_header_keys() -> set[str]:
    """The top-level header keys tiers own (each tier may own one: its ``header_key``)."""
    _ensure_builtins()
    return {t.header_key for t in _TIERS.values() if t.header_key is not None}


def codec(codec_id: str):
    """The registered codec class of that id; :class:`ConfigError` if there is none."""
    _ensure_builtins()
    try:
        return _CODECS[codec_id]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown codec {codec_id!r}; this version implements {sorted(_CODECS)}") from None


def codec_ids() -> list[str]:
    _ensure_builtins()
    return sorted(_CODECS)
