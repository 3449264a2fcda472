"""The collection protocol's shared state (spec/store.md §7): one lease, one record per collection.

* ``gc/lease.json`` names the current (or last) collection: its **epoch** (1, 2, ... in the order collections
  start), its **phase** (``mark``: deciding; ``sweep``: its condemned set is published and it deletes;
  ``done``) and its holder.  One collection at a time: on a local file system the collector holds an
  exclusive ``flock`` on ``gc/lock`` for its whole run (the kernel releases it when the process dies, so a
  dead collector never blocks); on an object store the lease object itself is the lock, taken with a
  conditional PUT (``If-None-Match: *``, or ``If-Match`` of the lease it replaces), renewed (again
  ``If-Match``) before every batch of deletions and at least every third of ``lease_seconds``, and taken over
  only once the store's own clock says it was not renewed for ``lease_seconds``.
* ``gc/epochs/<epoch>.json`` is that collection's **record**: what it condemned (each object with the reason:
  ``collect``, ``evict``, ``fold``, ``entry``), published before it deletes anything, and its status.  A put
  that overlapped a collection reads the records of the epochs it overlapped (write.py: *settle*).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from dataclasses import dataclass

from ..errors import FormatError, KvzError, StoreBusy, warn
from .keys import LEASE, canonical, record_path

LEASE_LIMIT = 1 << 16
RECORD_LIMIT = 1 << 30
#: records of this many most recent collections are kept for the puts that overlapped them
KEEP_RECORDS = 256
PHASES = ("mark", "sweep", "done")
REASONS = ("collect", "evict", "fold", "entry")


@dataclass(frozen=True)
class State:
    epoch: int
    phase: str
    holder: str = ""
    renewals: int = 0
    etag: str | None = None
    mtime: float = 0.0

    @property
    def active(self) -> bool:
        return self.phase != "done"


def read_state(backend, etag: bool = False) -> State:
    """The lease as it is now (epoch 0, done, when no collection ever ran); ``etag``: with the object store's
    ETag and time of it (one more request)."""
    st = backend.stat(LEASE) if etag and not backend.local else None
    try:
        raw = backend.read(LEASE, LEASE_LIMIT)
    except KvzError as e:
        raise FormatError(f"{LEASE}: {e}", field="Lease") from None
    if raw is None:
        return State(0, "done")
    try:
        d = json.loads(raw)
        epoch, phase = d["epoch"], d["phase"]
        if not (isinstance(epoch, int) and epoch >= 0 and phase in PHASES):
            raise ValueError("epoch/phase")
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise FormatError(f"{LEASE} is not a collection lease ({e}): remove it only when no collector runs",
                          field="Lease") from None
    return State(epoch, phase, str(d.get("holder", "")), int(d.get("renewals", 0) or 0),
                 None if st is None else st.etag, 0.0 if st is None else st.mtime)


def _last_epoch(backend, known: int | None = None) -> int:
    """The last collection's epoch: the lease's, or - when the lease is damaged or missing - the highest record's
    (epochs must never go back: puts compare them)."""
    if known is None:
        try:
            known = read_state(backend).epoch
        except FormatError:
            known = 0
    for item in backend.listdir("gc/epochs") or []:
        name = item.name
        if item.kind == "file" and name.endswith(".json") and name[:-5].isdigit():
            known = max(known, int(name[:-5]))
    return known


def _holder() -> str:
    return f"{socket.gethostname()} pid {os.getpid()} {secrets.token_hex(4)}"


class Lease:
    """The collector's hold on a store: :meth:`acquire` (or :class:`StoreBusy`), :meth:`phase`,
    :meth:`keepalive` during long work, :meth:`fence` before each batch of deletions, :meth:`release`."""

    def __init__(self, backend, lease_seconds: float = 120.0):
        self.backend, self.lease_seconds = backend, float(lease_seconds)
        self.holder, self.epoch, self._phase = _holder(), 0, "done"
        self._lock, self._etag, self._renewals, self._renewed = None, None, 0, 0.0

    def _payload(self, phase: str) -> bytes:
        self._renewals += 1
        return canonical({"format": "kvz-store-lease", "epoch": self.epoch, "phase": phase, "holder": self.holder,
                          "renewals": self._renewals, "lease_seconds": self.lease_seconds})

    def acquire(self, wait: float = 0.0) -> int:
        """Take the lease for a new collection (its epoch); :class:`StoreBusy` naming the holder when another
        collection runs and does not end within ``wait`` seconds."""
        deadline = time.monotonic() + max(0.0, wait)
        while True:
            why = self._try()
            if why is None:
                return self.epoch
            if time.monotonic() >= deadline:
                raise StoreBusy(why)
            time.sleep(min(1.0, max(0.05, deadline - time.monotonic())))

    def _try(self) -> str | None:
        b = self.backend
        if b.local:
            self._lock = b.lock()
            if self._lock is None:
                try:
                    s = read_state(b)
                    who = f"{s.holder or 'unknown'}, collection {s.epoch}, {s.phase}"
                except FormatError:
                    who = "its lease is unreadable"
                return (f"another collector holds {b.describe()}/gc/lock ({who}): one collection at a time; it is "
                        "released when that process ends")
            try:
                self.epoch = _last_epoch(b) + 1
                b.write(LEASE, self._payload("mark"))
            except BaseException:
                b.unlock(self._lock)
                self._lock = None
                raise
            self._renewed = time.monotonic()
            self._phase = "mark"
            return None
        st = b.stat(LEASE)
        try:
            prev = read_state(b)
        except FormatError:  # damaged: replaced (conditionally) as if stale, its epoch taken from the records
            prev = State(_last_epoch(b), "done")
        if st is None and prev.epoch:  # deleted meanwhile: take it as another collector's
            return f"the lease of {b.describe()} changed while it was read"
        if st is None:
            self.epoch = _last_epoch(b, prev.epoch) + 1
            ok = b.write(LEASE, self._payload("mark"), create=True)
        else:
            if prev.active:
                age = b.clock() - st.mtime  # the store's clock against the store's time: never the local one
                if age <= self.lease_seconds:
                    return (f"collection {prev.epoch} ({prev.holder or 'unknown'}) holds the lease of "
                            f"{b.describe()}, renewed {age:.0f} s ago (it lapses after {self.lease_seconds:.0f} s "
                            "without renewal; a collector that died is taken over then)")
                warn(f"kvcodec.Store: collection {prev.epoch} ({prev.holder}) did not renew its lease for "
                     f"{age:.0f} s: taken over")
            self.epoch = max(prev.epoch, _last_epoch(b, prev.epoch)) + 1
            ok = b.write(LEASE, self._payload("mark"), if_match=st.etag)
        if not ok:
            return f"another collector took the lease of {b.describe()} at the same moment"
        mine = b.stat(LEASE)
        self._etag = None if mine is None else mine.etag
        self._renewed = time.monotonic()
        self._phase = "mark"
        return None

    def phase(self, phase: str) -> None:
        """Publish a new phase (a renewal)."""
        self._renew(phase)

    def keepalive(self) -> None:
        """Renew when a third of the lease has passed (object stores; a lock needs none)."""
        if not self.backend.local and time.monotonic() - self._renewed > self.lease_seconds / 3:
            self._renew(self._phase)

    def fence(self) -> None:
        """Before deleting: renew on object stores (fails with StoreBusy if the lease was taken over), so that
        at least the whole lease period lies ahead of the deletions that follow."""
        if not self.backend.local:
            self._renew(self._phase)

    def _renew(self, phase: str) -> None:
        b = self.backend
        if b.local:
            b.write(LEASE, self._payload(phase))
        else:
            if not b.write(LEASE, self._payload(phase), if_match=self._etag):
                raise StoreBusy(f"collection {self.epoch} lost its lease of {b.describe()} (not renewed within "
                                f"{self.lease_seconds:.0f} s and taken over): it stops before deleting anything more")
            mine = b.stat(LEASE)
            self._etag = None if mine is None else mine.etag
        self._phase = phase
        self._renewed = time.monotonic()

    def release(self) -> None:
        try:
            if self._phase != "done":
                self._renew("done")
        except StoreBusy:  # taken over: the lease is no longer this collector's to end
            pass
        finally:
            self.backend.unlock(self._lock)
            self._lock = None


# -- records -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Record:
    epoch: int
    status: str
    condemned: dict  # path -> reason


def write_record(backend, epoch: int, status: str, condemned: dict | None = None) -> None:
    items = sorted((condemned or {}).items())
    backend.write(record_path(epoch), canonical({"format": "kvz-store-collection", "epoch": epoch, "status": status,
                                                 "condemned": [[p, r] for p, r in items]}))


def read_record(backend, epoch: int) -> Record | None:
    """A collection's record, or None when it is gone (pruned) or unreadable."""
    try:
        raw = backend.read(record_path(epoch), RECORD_LIMIT)
        if raw is None:
            return None
        d = json.loads(raw)
        if d.get("epoch") != epoch or d.get("status") not in PHASES:
            return None
        return Record(epoch, d["status"], {str(p): str(r) for p, r in d.get("condemned", [])})
    except (KvzError, ValueError, TypeError, AttributeError, RecursionError):
        return None


def prune_records(backend, epoch: int) -> None:
    """Remove the records of collections more than KEEP_RECORDS before ``epoch``."""
    for item in backend.listdir("gc/epochs") or []:
        name = item.name
        if item.kind == "file" and name.endswith(".json") and name[:-5].isdigit() \
                and int(name[:-5]) <= epoch - KEEP_RECORDS:
            backend.delete(f"gc/epochs/{name}")


def _fence_out(backend, s: State) -> bool:
    """End a collection whose lease was not renewed for a whole lease period (object stores): a conditional
    write of its lease (``If-Match`` the lease as last seen) marks it done, so that the collector - if it was
    only slow - fails its next renewal and deletes nothing more.  False when the lease changed meanwhile."""
    data = canonical({"format": "kvz-store-lease", "epoch": s.epoch, "phase": "done",
                      "holder": f"ended by {_holder()}: {s.holder} did not renew its lease",
                      "renewals": s.renewals + 1})
    return bool(s.etag) and backend.write(LEASE, data, if_match=s.etag)


def wait_finished(backend, epoch: int, lease_seconds: float, timeout: float) -> State:
    """Wait until collection ``epoch`` is over: done, followed by another, or dead (local: nobody holds the
    lock; object stores: its lease was not renewed for ``lease_seconds`` as seen from here, and is then ended
    with a conditional write so that it cannot resume).  StoreBusy after ``timeout`` seconds."""
    t0 = time.monotonic()
    seen, since, delay = None, t0, 0.02
    while True:
        s = read_state(backend, etag=not backend.local)
        if s.epoch > epoch or not s.active:
            return s
        if backend.local:
            if not backend.lock_held():
                return s
        else:
            mark = (s.etag, s.renewals)
            if mark != seen:
                seen, since = mark, time.monotonic()
            elif time.monotonic() - since > lease_seconds and _fence_out(backend, s):
                return read_state(backend)
        if time.monotonic() - t0 > timeout:
            raise StoreBusy(f"collection {epoch} of {backend.describe()} condemned objects this put needs and did "
                            f"not end within {timeout:.0f} s: the session is published but not settled; put it "
                            "again once the collection ends")
        time.sleep(delay)
        delay = min(0.5, delay * 2)
