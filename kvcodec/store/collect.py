"""Collection: ``gc`` removes what no session needs, evicts to a byte budget and folds private tails
(spec/store.md §4.1, §4.2, §7, steps C1-C7).

C1  take the lease (one collection at a time; :class:`~kvcodec.errors.StoreBusy` otherwise): epoch e;
    publish record e (``mark``);
C2  the store's clock, one listing of everything, and the **mark**: every session walked from its last chunk
    (a session that cannot be read keeps what its links reach, with a warning);
C3  decide: unreachable chunk objects, temporary files no writer holds and legacy pointer objects older
    than the grace period; with a byte budget, the least recently used hot chunks - each evicted by first
    publishing its cold object (folding its private parents into it); then the prefix entries the chunks
    that stay live lack are written, and entries naming none of them condemned;
C4  publish record e with everything it will delete and why (``sweep``) - before deleting anything;
C5  list the sessions **again**: whatever a session not seen in C2 (or not readable then) reaches is taken
    out of the condemned set (kept, and no longer evicted or folded);
C6  delete the condemned objects in batches - evicted hot objects first, then folded chunks' - the lease
    renewed (object stores) before each;
C7  record e ``done``; the lease released.

A put acknowledged after C5 listed its session is safe from this collection (C5 reached what it needs); a
put whose session C5 did not see published its session after C4, so its settle step reads this record and
writes back whatever of its objects this collection deletes (write.py).  Ages compare the store's own
timestamps with the store's clock (C2), never this process's clock, and only decide what is worth deleting:
safety does not depend on them.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict

import numpy as np
import zstandard

from ..errors import ConfigError, KvzError, warn
from ..identity import model_record, split_model
from ..tokens.continuation import CONTEXT_TOKENS
from .keys import (
    ROOT_PARENT,
    canonical,
    chain_key,
    chunk_key,
    chunk_path,
    cold_path,
    entry_dir,
    entry_levels,
    entry_name,
    is_hex64,
    is_reduced_rel,
    is_temp,
    numerics_path,
    parse_entry_name,
    session_path,
    split_chunk_name,
    split_reduced_key,
)
from .lease import Lease, prune_records, write_record
from .objects import IDS_MAGIC, LM_HEAD, LM_MAGIC, MAX_BASE_DEPTH, SMALL_LIMIT
from .write import WritePath

BATCH = 256


class _Listing:
    """One namespace's objects as C2 listed them."""

    def __init__(self):
        self.chunks: dict[bytes, dict] = defaultdict(dict)  # key -> {"kvz": Item, "ids": Item}
        self.entries: list[tuple[str, str, object]] = []  # (directory, name, Item)
        self.sessions: dict[str, object] = {}  # session hex -> Item
        self.collectable: list[tuple[str, object]] = []  # temporary files, legacy pointer objects
        self.junk: list[str] = []


class Collector(WritePath):
    def delete(self, key: str) -> None:
        """Remove a session (its chunks stay until :meth:`gc` finds them unreferenced), or a reduced object;
        KeyError when there is no such session (also for the second of two deletes racing each other)."""
        if split_reduced_key(key) is not None:  # a reduced object (spec §6.1)
            return self._delete_reduced(key)
        ns, session = self._split_key(key)
        if self.backend.delete(session_path(ns, session)) < 0:
            raise KeyError(key)

    def gc(self, grace_seconds: float | None = None, max_bytes: int | None = None, *, model=None,
           cold: str = "auto", progress=None, wait: float = 0.0) -> dict:
        """Remove chunks and prefix entries no session needs, interrupted writers' temporary files and legacy
        pointer objects, once older than ``grace_seconds`` (default: the store's) by the store's clock.  With
        ``max_bytes``, then evict the least recently used hot chunks (local file systems: last read or
        written; object stores: written) until the hot chunks take at most that many bytes: their sessions
        become cold - :meth:`get` recomputes what is missing with the model, :meth:`match` stops before it.
        An evicted chunk keeps its token ids: ``cold="lm"`` codes them with the model (this store's, or
        ``model=``) conditioned on the tokens before them - a few bits per token, decoded with the same model
        on an engine with the same numerics; ``cold="ids"`` keeps them zstd-coded (any machine, no model;
        ~17 bits per token); ``"auto"``: ``lm`` when there is a model of the namespace.  ``progress(1)``
        after each eviction.

        One collection at a time per store (:class:`~kvcodec.errors.StoreBusy` when another runs and does not
        end within ``wait`` seconds); writers and readers run meanwhile and lose nothing (module docstring).
        Returns what it removed."""
        if cold not in ("auto", "lm", "ids"):
            raise ConfigError(f"cold must be 'auto', 'lm' or 'ids', not {cold!r}")
        model = self.model if model is None else model
        if cold == "lm" and model is None:
            raise ConfigError("cold='lm' needs the model (model= or the store's)")
        grace = self.grace_seconds if grace_seconds is None else float(grace_seconds)
        lease = Lease(self.backend, self.lease_seconds)
        epoch = lease.acquire(wait)  # C1
        removed = {"chunks": 0, "entries": 0, "temporary": 0, "bytes": 0}
        removed.update(evicted=0, evicted_bytes=0, cold_lm=0)
        self._headers = {}
        try:
            write_record(self.backend, epoch, "mark")
            now = self.backend.clock()  # C2
            listing = {}
            for ns in self.namespaces():
                try:
                    self.record(ns)
                except (KeyError, KvzError) as e:  # which sessions and chunks it holds is unknown: kept whole
                    warn(f"kvcodec.Store.gc: namespace {ns[:16]}… has no readable record ({e}): nothing in it is "
                         "collected")
                    continue
                listing[ns] = self._list(ns)
            gc_temps = [(rel, it) for rel, it in self.backend.walk("gc") if it.kind == "file" and is_temp(it.name)]
            marks = {ns: self._mark(ns, lst, lease) for ns, lst in listing.items()}
            condemned, sizes = {}, {}  # C3
            old = (lambda it: now - it.mtime >= grace)
            for ns, lst in listing.items():
                self._decide(ns, lst, marks[ns], old, condemned, sizes)
            for rel, it in gc_temps:
                if old(it) and not self.backend.in_use(rel):
                    condemned[rel], sizes[rel] = "collect", it.size
            if max_bytes is not None:
                self._evict(int(max_bytes), listing, marks, condemned, sizes, removed,
                            None if cold == "ids" else model, now, grace, lease, progress)
            for ns, lst in listing.items():  # what stays hot, after eviction and folding
                self._reconcile_entries(ns, lst, marks[ns], old, condemned, lease)
            write_record(self.backend, epoch, "sweep", condemned)  # C4
            lease.phase("sweep")
            self._reread(marks, condemned, lease)  # C5
            self._sweep(condemned, sizes, removed, lease)  # C6
            if max_bytes is None:
                for k in ("evicted", "evicted_bytes", "cold_lm"):
                    del removed[k]
            write_record(self.backend, epoch, "done", condemned)  # C7
            prune_records(self.backend, epoch)
            if self.backend.local:
                for ns in listing:
                    self.backend.remove_empty_dirs(f"ns/{ns}/entries")
        finally:
            self._headers = None
            lease.release()
        return removed

    # -- C2: listing and mark ------------------------------------------------------------------------------
    def _list(self, ns: str) -> _Listing:
        lst = _Listing()
        for rel, it in self.backend.walk(f"ns/{ns}"):
            parts = rel.split("/")[2:]  # below ns/<N>/
            if it.kind != "file":
                lst.junk.append(f"{rel} ({'not a plain file' if it.kind == 'other' else it.kind})")
                continue
            if is_temp(it.name):
                lst.collectable.append((rel, it))
                continue
            top = parts[0]
            if top == "chunks" and len(parts) == 3 and (got := split_chunk_name(it.name)) is not None \
                    and parts[1] == it.name[:2]:
                lst.chunks[got[0]][got[1]] = it
            elif top == "entries" and len(parts) == 4 and is_hex64(parts[2]) and parts[1] == parts[2][:2]:
                lst.entries.append(("/".join(rel.split("/")[:-1]), it.name, it))
            elif top == "sessions" and len(parts) == 3 and it.name.endswith(".kvs") and is_hex64(it.name[:-4]) \
                    and parts[1] == it.name[:2]:
                lst.sessions[it.name[:-4]] = it
            elif is_reduced_rel(parts, it.name):  # roots that only delete() removes (spec §6.1, §7.3)
                continue
            elif top == "prefix":  # pointer objects of store revisions before 2.0 (spec §9): hints, replaced
                lst.collectable.append((rel, it))
            elif len(parts) == 1 and it.name == "namespace.json" or top in ("numerics", "predictors"):
                continue
            else:
                lst.junk.append(rel)
        if lst.junk:
            shown = ", ".join(lst.junk[:3]) + (f" and {len(lst.junk) - 3} more" if len(lst.junk) > 3 else "")
            warn(f"kvcodec.Store.gc: namespace {ns[:16]}… holds {len(lst.junk)} names that are not store objects "
                 f"({shown}): left as they are")
        return lst

    def _mark(self, ns: str, lst: _Listing, lease, sessions=None) -> dict:
        """What the sessions reach: every chunk object (and the bases of delta chunks, hot or cold), how many
        sessions reach each, which are some chunk's base, and the hot chunks whose whole chain is hot (their
        prefix entries are kept).  A session that cannot be read keeps what its links reach; its namespace's
        chunks are then not folded."""
        mark = {"reached": set(), "count": defaultdict(int), "based": set(), "broken": [], "seen": set(),
                "unread": set()}
        for session in sorted(lst.sessions if sessions is None else sessions):
            lease.keepalive()
            self._mark_session(ns, session, mark)
        if mark["broken"]:
            shown = "; ".join(mark["broken"][:3])
            warn(f"kvcodec.Store.gc: {len(mark['broken'])} session(s) of namespace {ns[:16]}… cannot be read "
                 f"now ({shown}): what their links reach is kept and nothing of the namespace is folded.  A put "
                 "still running repairs its own session before it returns (spec/store.md, P4); a session that "
                 "stays so is damaged: put it again (which repairs it) or delete it")
        return mark

    def _mark_session(self, ns: str, session: str, mark: dict) -> None:
        mark["seen"].add(session)
        try:
            n = self._session_count(ns, session)
        except KeyError:  # deleted meanwhile
            return
        except KvzError:  # malformed: quarantined, so not a session
            return
        try:
            keys = [k for k, _first, _count in self._walk(ns, session, n)]
        except (KvzError, FileNotFoundError) as e:
            keys = self._follow(ns, bytes.fromhex(session), n)
            mark["broken"].append(f"{session[:16]}…: {e}")
            mark["unread"].add(session)
        for k in keys:
            mark["count"][k] += 1
            mark["reached"].add(k)
            for b in self._bases(ns, k):
                mark["reached"].add(b)
                mark["based"].add(b)

    def _follow(self, ns: str, key: bytes, n: int) -> list[bytes]:
        """The chunk objects a session's links reach, without the walk's checks (a session that cannot be read:
        what it names is kept); bounded by its declared count."""
        size = self.record(ns)["chunk_tokens"]
        out, seen, k = [], set(), key
        for _ in range(n // size + 2):
            if k == ROOT_PARENT or k in seen:
                break
            seen.add(k)
            parent = self._parent_of(ns, k)
            if parent is None:
                break
            out.append(k)
            k = parent
        return out

    def _cold_links(self, ns: str, key: bytes) -> tuple[bytes, bytes | None] | None:
        """(parent or link, base or None) from a cold object's head alone (nothing else of it read)."""
        head = self.backend.head(cold_path(ns, key), LM_HEAD.size)
        if head is None:
            return None
        if head[:4] == LM_MAGIC and len(head) == LM_HEAD.size:
            _magic, _pid, _n, m, link = LM_HEAD.unpack(head)
            return (None, link) if m else (link, None)
        if head[:8] == IDS_MAGIC and len(head) >= 40:
            return head[8:40], None
        return None

    def _parent_of(self, ns: str, key: bytes, depth: int = 0) -> bytes | None:
        if depth > MAX_BASE_DEPTH:
            return None
        try:
            hot = self._hot(ns, key)
            if hot is not None:
                return hot.parent
            links = self._cold_links(ns, key)
        except KvzError:
            return None
        if links is None:
            return None
        return links[0] if links[1] is None else self._parent_of(ns, links[1], depth + 1)

    def _bases(self, ns: str, key: bytes):
        """The keys of a chunk object's bases, nearest first (a hot delta chunk's, a model-coded cold chunk's)."""
        k, seen = key, {key}
        for _ in range(MAX_BASE_DEPTH):
            try:
                hot = self._hot(ns, k)
                if hot is not None:
                    k = hot.base
                else:
                    links = self._cold_links(ns, k)
                    k = None if links is None else links[1]
            except KvzError:
                return
            if k is None or k in seen:
                return
            seen.add(k)
            yield k

    # -- C3: what to delete ------------------------------------------------------------------------------------
    def _decide(self, ns: str, lst: _Listing, mark: dict, old, condemned: dict, sizes: dict) -> None:
        """Condemn (C3) what no session reaches, temporary files no writer holds and legacy pointer objects,
        once ``old``."""
        for rel, it in lst.collectable:
            if old(it) and not (is_temp(it.name) and self.backend.in_use(rel)):
                condemned[rel], sizes[rel] = "collect", it.size
        for key, objs in lst.chunks.items():
            if key in mark["reached"]:
                continue
            for kind, it in objs.items():
                if old(it):
                    rel = chunk_path(ns, key) if kind == "kvz" else cold_path(ns, key)
                    condemned[rel], sizes[rel] = "collect", it.size

    def _live(self, ns: str, key: bytes, mark: dict):
        """(start, parent, ids, chain keys) of a reached hot chunk whose chain is hot (what a lookup can use),
        else None."""
        memo = mark.setdefault("live", {})
        if key not in memo:
            memo[key] = None
            try:
                hot = self._hot(ns, key)
            except KvzError:
                hot = None
            if hot is not None:
                start = hot.start - hot.m
                got = self._hot_chain(ns, key, start)
                if got is not None:
                    memo[key] = (start, got[2], got[0], got[1])
        return memo[key]

    def _reconcile_entries(self, ns: str, lst: _Listing, mark: dict, old, condemned: dict, lease) -> None:
        """Entries (spec §5) for every live hot chunk: an entry naming no such chunk goes (once old enough);
        a level of a live chunk that no entry with its next ids covers gets one (written now, before anything
        is deleted, so a lookup never meets a gap)."""
        try:
            size, step = self._geometry(ns)
        except (KeyError, KvzError):
            return
        nsb = bytes.fromhex(ns)
        live = {}
        for k in mark["reached"]:
            lease.keepalive()
            v = self._live(ns, k, mark)
            if v is not None and not any(chunk_path(ns, c) in condemned for c in v[3]):
                live[k] = v  # (neither it nor a base is one this collection evicts or folds)
        needed: dict[tuple[str, str], bytes] = {}  # (directory, next ids) -> a live chunk with that level
        described = set()  # (directory, next ids, chunk): the levels of the live chunks
        for key, (_start, parent, ids, _chain) in live.items():
            for m in entry_levels(ids.size, size, step):
                at = (entry_dir(ns, chunk_key(nsb, parent, ids[:m])), "".join(f"{int(t):08x}" for t in ids[m:m + step]))
                needed.setdefault(at, key)
                described.add((*at, key))
        covered = set()
        for directory, name, it in lst.entries:
            parsed = parse_entry_name(name, step) if step else None
            if parsed is None:
                continue
            tokens = name.partition(".")[0]
            if (directory, tokens, parsed[1]) in described:
                covered.add((directory, tokens))
            elif old(it):
                condemned[f"{directory}/{name}"] = "entry"
        for (directory, tokens), key in needed.items():
            if (directory, tokens) not in covered:
                self.backend.write(f"{directory}/{tokens}.{key.hex()}", b"", create=True)

    # -- eviction and folding ------------------------------------------------------------------------------------
    def _evict(self, max_bytes: int, listing: dict, marks: dict, condemned: dict, sizes: dict, removed: dict,
               model, now: float, grace: float, lease, progress) -> None:
        """Evict the least recently used hot chunks (C3) until the hot chunks left take ``max_bytes``: each
        chunk's cold object is published first (model-coded where ``model`` is the namespace's, folding the
        session's private parents; else zstd), its hot object (and the folded chunks' objects) condemned."""
        hot = []
        for ns, lst in listing.items():
            for key, objs in lst.chunks.items():
                if "kvz" in objs and chunk_path(ns, key) not in condemned:
                    hot.append((objs["kvz"].mtime, ns, key, objs["kvz"].size))
        total = sum(h[3] for h in hot)
        written = {}  # cold objects this collection published
        for _t, ns, key, size in sorted(hot, key=lambda h: (h[0], h[1], h[2])):
            if total <= max_bytes:
                break
            if key not in marks[ns]["reached"] or chunk_path(ns, key) in condemned:
                continue  # not a session's (collected once old enough), or folded into another's object
            lease.keepalive()
            try:
                h = self._hot(ns, key)
                if h is None:
                    continue
                obj, folded = None, []
                if model is not None:
                    try:
                        obj, folded = self._cold_lm(ns, key, h, model, marks[ns], listing[ns], now, grace)
                    except (FileNotFoundError, KvzError, ConfigError) as e:  # (another engine's profile, ids the
                        warn(f"kvcodec.Store: chunk {key.hex()[:16]}… evicted with zstd-coded ids: {e}")  # model
                        obj, folded = None, []                                           # cannot code, ...)
                if obj is None:
                    ids = self._ids(ns, key, h.start - h.m, None, None)
                    frame = zstandard.ZstdCompressor(level=19, write_content_size=True).compress(
                        ids.astype("<u4").tobytes())
                    obj = IDS_MAGIC + h.parent + int(ids.size).to_bytes(4, "little") + frame
            except (FileNotFoundError, KvzError, ConfigError):
                continue
            self.backend.write(cold_path(ns, key), obj)
            written[cold_path(ns, key)] = len(obj)
            condemned[chunk_path(ns, key)], sizes[chunk_path(ns, key)] = "evict", size
            total -= size
            removed["cold_lm"] += obj[:4] == LM_MAGIC
            for k in folded:  # now covered by this chunk's object (published first: a crash leaves both)
                objs = listing[ns].chunks.get(k, {})
                if "kvz" in objs:
                    if condemned.get(chunk_path(ns, k)) is None:
                        total -= objs["kvz"].size
                    condemned[chunk_path(ns, k)], sizes[chunk_path(ns, k)] = "fold", objs["kvz"].size
                if "ids" in objs or cold_path(ns, k) in written:  # (one this collection wrote too)
                    rel = cold_path(ns, k)
                    condemned[rel], sizes[rel] = "fold", written.get(rel, objs["ids"].size if "ids" in objs else 0)
            if progress:
                progress(1)

    def _foldable(self, ns: str, key: bytes, mark: dict, lst: _Listing, now: float, grace: float) -> bool:
        """May chunk ``key`` be folded into its child's cold object: one session reaches it, it is nobody's
        base, no session of its namespace is unreadable, and it is cold or its hot object was not used for the
        grace period (folding a hot chunk evicts it too)."""
        if mark["broken"] or mark["count"].get(key) != 1 or key in mark["based"]:
            return False
        it = lst.chunks.get(key, {}).get("kvz")
        return it is None or now - it.mtime >= grace

    def _cold_lm(self, ns: str, key: bytes, h, model, mark: dict, lst: _Listing, now: float, grace: float
                 ) -> tuple[bytes | None, list[bytes]]:
        """(a hot chunk's model-coded cold object, the chunks before it that it covers) (spec §4.2): its ids
        coded with the model conditioned on the tokens before them; (None, []) where the model is not the
        namespace's.  A whole chunk that one session alone reaches also covers (folds) its parents as far as
        they are that session's alone - up to and including a delta chunk, whose base it then names - so a
        session's private tail costs one 52-byte head, not one per chunk."""
        recorded = self.record(ns).get("model") or {}
        rec = model_record(model)
        if rec is None or recorded.get("fingerprint") != rec.get("fingerprint"):
            return None, []
        from ..tokens.continuation import encode_continuation

        mdl, size = split_model(model)[0], self.record(ns)["chunk_tokens"]
        start, base, m, parent = h.start - h.m, h.base, h.m, h.parent
        first, link, lm, folded = start, (base if m else parent), m, []
        if not m and self._foldable(ns, key, mark, lst, now, grace):
            p = parent
            while p != ROOT_PARENT and self._foldable(ns, p, mark, lst, now, grace):
                plink = self._link(ns, p, first - size, expect=size)
                folded.append(p)
                first, link, lm = plink.first, (plink.base if plink.m else plink.parent), plink.m
                if plink.m:
                    break
                p = plink.parent
        first_parent = link if not lm else self._link(ns, link, first).parent
        every = self._prefix_ids(ns, parent, start, model, full=True)  # positions 0 .. start
        head = self._ids(ns, base, start, every[-CONTEXT_TOKENS:], model)[:m] if base is not None \
            else np.zeros(0, dtype=np.int64)
        if head.size != m:
            return None, []
        ids = np.concatenate([every[first:], head, h.ids])  # positions first .. the end of this chunk
        if chain_key(bytes.fromhex(ns), first_parent, ids, size) != key:  # what a reader will check, checked
            return None, []                                              # before anything is condemned
        context = np.concatenate([every[:first], ids[:lm]])[-CONTEXT_TOKENS:]
        words, _bits = encode_continuation(mdl, context, ids[lm:])
        self._remember(ns, key, first, ids)
        return (LM_HEAD.pack(LM_MAGIC, self._numerics_id(ns, mdl), ids.size, lm, link)
                + words.astype("<u4").tobytes()), folded

    def _numerics_id(self, ns: str, mdl) -> bytes:
        """The 8-byte id of this engine's profile for model-coded cold chunks (its object published once)."""
        if (ns, self._engine(mdl)) not in self._profiles:
            from .. import numerics
            from ..tokens.continuation import PROCEDURE
            from ..tokens.plan import STEP_THREADS

            data = canonical({"context_tokens": CONTEXT_TOKENS, "procedure": PROCEDURE,
                              "numerics": {**numerics.profile(mdl), "step_threads": STEP_THREADS}})
            pid = hashlib.sha256(data).digest()[:8]
            path = numerics_path(ns, pid)
            if self._read(path, SMALL_LIMIT) != data:
                self.backend.write(path, data)
            self._profiles[ns, self._engine(mdl)] = pid
        return self._profiles[ns, self._engine(mdl)]

    # -- C5, C6 --------------------------------------------------------------------------------------------------
    def _reread(self, marks: dict, condemned: dict, lease) -> None:
        """The sessions listed again: whatever a session that C2 did not see reaches is kept (not collected,
        evicted or folded), and so are the entries naming it."""
        for ns in self.namespaces():
            mark = marks.get(ns)
            fresh = {"reached": set(), "count": defaultdict(int), "based": set(), "broken": [], "seen": set(),
                     "unread": set()}
            for rel, it in self.backend.walk(f"ns/{ns}/sessions"):
                name = it.name  # new sessions, and those C2 could not read (a put may have repaired them since)
                if it.kind == "file" and name.endswith(".kvs") and is_hex64(name[:-4]) and (
                        mark is None or name[:-4] not in mark["seen"] or name[:-4] in mark["unread"]):
                    lease.keepalive()
                    self._mark_session(ns, name[:-4], fresh)
            if not fresh["reached"]:
                continue
            for k in fresh["reached"]:
                condemned.pop(chunk_path(ns, k), None)
                condemned.pop(cold_path(ns, k), None)
            keep = {k.hex() for k in fresh["reached"]}
            for rel in [r for r, why in condemned.items() if why == "entry" and r.startswith(f"ns/{ns}/")]:
                if rel.rpartition(".")[2] in keep:
                    del condemned[rel]

    def _sweep(self, condemned: dict, sizes: dict, removed: dict, lease) -> None:
        """C6.  Evicted hot objects go first, folded chunks' objects after them: while a fold is swept, a
        reader that still finds a chunk hot still finds the parent that hot object names (once the hot
        object is gone, its cold object covers the folded parents)."""
        order = {"evict": 0, "fold": 1}
        paths = sorted(condemned, key=lambda p: (order.get(condemned[p], 2), p))
        for i in range(0, len(paths), BATCH):
            lease.fence()
            batch = paths[i:i + BATCH]
            if self.backend.local:
                for rel in batch:
                    got = self.backend.delete(rel)
                    if got >= 0:
                        self._count(rel, condemned[rel], got, removed)
            else:
                self.backend.delete_many(batch)
                for rel in batch:
                    self._count(rel, condemned[rel], sizes.get(rel, 0), removed)

    @staticmethod
    def _count(rel: str, why: str, size: int, removed: dict) -> None:
        name = rel.rsplit("/", 1)[-1]
        if is_temp(name):
            removed["temporary"] += 1
        elif why == "entry":
            removed["entries"] += 1
        elif why == "collect":
            removed["entries" if "/prefix/" in rel else "chunks"] += 1
        elif why == "evict" or (why == "fold" and rel.endswith(".kvz")):
            removed["evicted"] += 1
            removed["evicted_bytes"] += size
        if why in ("collect", "entry"):
            removed["bytes"] += size


__all__ = ["Collector", "entry_name"]
