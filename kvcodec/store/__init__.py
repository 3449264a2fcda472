"""``kvcodec.Store``: many caches on a local directory or object storage, each shared prefix stored once.

A store keeps **sessions** (a token sequence and its cache) as content-addressed **chunks** of
``chunk_tokens`` positions (default 256), so sessions that share a prefix - a system prompt, tool schemas,
a conversation that branches - share its chunks.  Layout, bytes and the collection protocol:
``spec/store.md``.  The modules follow the protocol, one guarantee each:

========================  =====================================================================================
``keys``                  names: chunk keys (chained SHA-256 over namespace, parent and token ids), prefix
                          entries, every object's path; pure functions
``backend``               where bytes live (local directory, fsspec object store): atomic and create-only
                          writes, bounded reads of plain objects only (no link is ever followed), one clock
``objects``               each object kind read with its own bound and form checked; quarantine only of what
                          its own bytes prove bad
``read``                  the read path: sessions walked from their last chunk (bounded, loop-free), chunks
                          checked against their keys, ``match``'s exact longest stored prefix
``write``                 the write path: ``put`` (P1-P5), settled against every collection it overlapped
``lease``                 the collection state shared by writers and the collector: lease and records
``collect``               ``gc``: mark, condemn, publish, mark again, sweep (C1-C7); eviction and folding
========================  =====================================================================================

Safety: every object is published atomically; a put is acknowledged only once no collection that
overlapped it can have removed what it needs (spec §7.4); a corrupt object raises a named
:class:`~kvcodec.errors.KvzError`, is moved to ``quarantine/`` when its own bytes prove it bad, and is never
returned.

Limits (refused with :class:`~kvcodec.errors.UnsupportedCache`): batch 1 per session; caches that start at
position 0 and whose every layer holds every token (sliding windows that dropped tokens and recurrent state
have no per-token slices to share).
"""

from __future__ import annotations

from ..errors import ConfigError
from .backend import backend_for
from .collect import Collector
from .keys import MAX_GRANULARITY, REVISION, chunk_key, token_ids
from .read import ROUTES

__all__ = ["REVISION", "Store", "chunk_key", "token_ids"]

#: tiers a store keeps chunks in (the direct tiers: restoring a chunk needs no model)
CHUNK_TIERS = ("lossless", "lossy")


class Store(Collector):
    """Sessions of one model (or of none) under ``url``: a local path, ``file://``, ``s3://bucket/prefix`` or
    any fsspec URL (``storage_options`` go to fsspec; the AWS environment variables work as for any fsspec
    user).

    ::

        store = kvcodec.Store("s3://bucket/memory", model)
        n, cache = store.match(ids)          # the longest stored prefix of ids, and its cache
        key = store.put(cache, tokens=ids)   # after running the model on ids[n:]

    ``tier`` (``"lossless"`` or ``"lossy"``) and ``**tier_options`` are how chunks are coded (as
    :func:`kvcodec.encode`); they are part of the namespace.  ``granularity`` (default 16, at most 16): the
    step of the prefix entries that let :meth:`match` and :meth:`put` find a stored chunk that starts like a
    new one, to the exact token (0: whole chunks only).  ``grace_seconds``: how old (by the store's clock) an
    unreferenced object must be before :meth:`gc` removes it - a cost bound (a put still writing is not
    made to write again), not what safety rests on.  ``lease_seconds``: how long a collector's lease on an
    object store lasts without renewal.
    """

    def __init__(self, url, model=None, storage_options: dict | None = None, *, chunk_tokens: int = 256,
                 granularity: int | None = None, tier: str = "lossless", grace_seconds: float = 3600.0,
                 route: str = "auto", model_id: str | None = None, lease_seconds: float = 120.0, **tier_options):
        if route not in ROUTES:
            raise ConfigError(f"route must be one of {ROUTES}, not {route!r}")
        if tier not in CHUNK_TIERS:
            raise ConfigError(f"a store keeps chunks in tier {CHUNK_TIERS}, not {tier!r} (the token tiers are "
                              "a session's own business: save() them)")
        if granularity is None:  # 16 tokens, or half a chunk for small chunks
            granularity = MAX_GRANULARITY if chunk_tokens > MAX_GRANULARITY else chunk_tokens // 2
        if not 1 <= chunk_tokens <= 1 << 20 or not 0 <= granularity < chunk_tokens:
            raise ConfigError("chunk_tokens must be in [1, 2**20] and granularity in [0, chunk_tokens)")
        if granularity > MAX_GRANULARITY:
            raise ConfigError(f"granularity must be at most {MAX_GRANULARITY} (a prefix entry's name carries the "
                              "next granularity token ids), not {granularity}")
        if lease_seconds <= 0:
            raise ConfigError("lease_seconds must be positive")
        self.route, self._rates, self.model_id = route, {}, model_id
        self.backend = backend_for(url, storage_options)
        self.root = self.backend.describe()
        self.model = model
        self.chunk_tokens, self.granularity = chunk_tokens, granularity
        self.grace_seconds, self.lease_seconds = float(grace_seconds), float(lease_seconds)
        self.tier, self.tier_options = tier, dict(tier_options)
        if tier_options.get("predictors") is not None:  # kept once per namespace (ns/<N>/predictors/)
            from ..predict import as_predictors

            self.tier_options["predictors"] = as_predictors(tier_options["predictors"])
        if tier_options.get("profile") is not None:
            from ..calibrate import Profile

            if not isinstance(tier_options["profile"], Profile):
                raise ConfigError("profile= takes a kvcodec.Profile (kvcodec.calibrate)")
        self._predictors: dict[str, object] = {}  # SHA-256 -> Predictors read from a namespace
        from ..api import Encoder

        self._encoder = Encoder(tier=tier, chunk_tokens=chunk_tokens, **tier_options)
        self._namespaces: dict[str, dict] = {}
        # content addressing makes this safe to remember: a chunk key fixes its token ids
        self._ids_memo: dict = {}
        self._profiles: dict = {}
        self._headers: dict | None = None  # chunk headers, remembered during one collection
        self._last_dtype = None  # the dtype of this object's last put (a model-less store's default)

    def __repr__(self) -> str:
        return f"Store({self.root!r}, tier={self.tier!r}, chunk_tokens={self.chunk_tokens})"
