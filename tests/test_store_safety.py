"""The store never loses an acknowledged session: a collector beside puts that reuse what it is about to
remove, collectors with other clocks, hostile directories (spec/store.md §7).  One regression test per
defect of issue 45, the interleavings forced at the collector's phase boundaries (C2 mark, C4 condemned set
published, C5 second listing, C6 sweep) by running a put from another thread there."""

import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import kvcodec
from kvcodec.store import keys as K
from kvcodec.store.collect import Collector

from .common import model_cache, tiny_model
from .test_store import _ids, _path, _session, _shared

ROOT = Path(__file__).resolve().parent.parent


def _store(root, **kw):
    return kvcodec.Store(root, **{"model_id": "test", "chunk_tokens": 16, "granularity": 4, **kw})


class _During:
    """Run ``action`` (in its own thread) when the collector reaches phase ``at`` ("decide": after the mark,
    before anything is condemned; "reread": after the condemned set is published, before the second listing;
    "sweep": after the second listing, before deleting), and let the collector go on once ``ready()`` holds
    (the put has published its session) or the action has returned."""

    def __init__(self, monkeypatch, at, action, ready=None):
        # before anything is condemned the put runs to its end (its settle step finds nothing decided yet);
        # later it may wait for this very collection, which goes on once the session is published
        ready = None if at == "decide" else ready
        self.action, self.ready, self.error, self.result = action, ready, None, None
        self.thread = None
        name = {"decide": "_decide", "reread": "_reread", "sweep": "_sweep"}[at]
        real = getattr(Collector, name)
        fired = []

        def hooked(store_self, *a, **kw):
            if not fired:
                fired.append(1)
                self.thread = threading.Thread(target=self._run)
                self.thread.start()
                t0 = time.monotonic()
                while self.thread.is_alive() and not (self.ready and self.ready()) and time.monotonic() - t0 < 60:
                    time.sleep(0.01)
            return real(store_self, *a, **kw)

        monkeypatch.setattr(Collector, name, hooked)

    def _run(self):
        try:
            self.result = self.action()
        except BaseException as e:  # noqa: BLE001 - reported by join()
            self.error = e

    def join(self):
        self.thread.join(120)
        assert not self.thread.is_alive(), "the put did not finish"
        if self.error is not None:
            raise self.error
        return self.result


def _session_exists(store, key):
    return lambda: key in store


# -- 1, 2: eviction and folding beside a put that reuses or branches off the folded chunks ---------------------
@pytest.mark.parametrize("at", ["decide", "reread", "sweep"])
def test_a_put_branching_off_chunks_a_collection_folds_is_never_lost(tmp_path, monkeypatch, at):
    """Defects 1 and 2: session A's private chunks are evicted and folded into one cold object while a put of
    session B - A's first 40 tokens (two whole chunks and a delta chunk on A's third), then its own - runs at
    each phase boundary of the collection.  B reads back bit for bit, and A keeps its tokens."""
    model = tiny_model("llama")
    store = kvcodec.Store(tmp_path, model, chunk_tokens=16, granularity=4)
    a_ids = _ids(60, 1)
    a_key = store.put(model_cache(model, a_ids), tokens=a_ids)
    b_ids = torch.cat([a_ids[:, :40], _ids(20, 2)], 1)
    b_cache = kvcodec.to_canonical(model_cache(model, b_ids))
    b_key = kvcodec.store.keys.chain_key(bytes.fromhex(a_key.split(":")[0]), K.ROOT_PARENT,
                                         K.token_ids(b_ids), 16).hex()
    writer = kvcodec.Store(tmp_path, model, chunk_tokens=16, granularity=4)
    ns = a_key.split(":")[0]
    during = _During(monkeypatch, at, lambda: writer.put(b_cache, tokens=b_ids),
                     _session_exists(writer, f"{ns}:{b_key}"))
    store.gc(max_bytes=0, grace_seconds=0)  # everything evicted; A's private chunks folded
    got = during.join()
    assert got == f"{ns}:{b_key}"
    fresh = kvcodec.Store(tmp_path, model, chunk_tokens=16, granularity=4)
    assert torch.equal(fresh.tokens(a_key), a_ids)
    assert torch.equal(fresh.tokens(got), b_ids)
    back = fresh.get(got, output="kvcache")
    assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(back.keys, b_cache.keys))
    fresh.gc(grace_seconds=0)  # and nothing either session needs is collected afterwards
    assert torch.equal(fresh.tokens(got), b_ids) and torch.equal(fresh.tokens(a_key), a_ids)


def test_a_put_settles_only_what_the_collection_condemned(tmp_path, monkeypatch):
    """A put whose objects a concurrent collection did not condemn does not wait for it; one whose objects it
    did condemn writes them back once it has ended (put after the second listing: the collection cannot know
    the session)."""
    store = _store(tmp_path)
    kv, ids = _session(_ids(30, 1), _ids(10, 2))
    key = store.put(kv, tokens=ids)
    store.delete(key)  # its chunks are unreferenced: the next collection condemns them
    writer = _store(tmp_path)
    during = _During(monkeypatch, "sweep", lambda: writer.put(kv, tokens=ids), _session_exists(writer, key))
    removed = store.gc(grace_seconds=0)
    assert during.join() == key and removed["chunks"] == 3  # it deleted them ...
    assert writer.get(key, output="kvcache").equal(kv)  # ... and the put wrote them back before returning


# -- 3, 4: reuse of old, unreferenced chunks during a collection: disk and S3 --------------------------------
@pytest.fixture(scope="module")
def s3(request):
    """fsspec options for the S3-compatible server test_store.py starts (bucket kvz-test)."""
    endpoint = request.getfixturevalue("s3_server")
    return {"key": "test", "secret": "test", "client_kwargs": {"endpoint_url": endpoint}}


@pytest.mark.parametrize("where", ["disk", "s3"])
@pytest.mark.parametrize("at", ["decide", "reread", "sweep"])
def test_reusing_unreferenced_chunks_during_a_collection(tmp_path, request, monkeypatch, where, at):
    """Defects 3 and 4: a deleted session's chunks, old enough to collect, are reused by a put of the same
    session at each phase of a collection (S3: no touch of an object's time is relied on)."""
    if where == "s3":
        opts = request.getfixturevalue("s3")
        url = f"s3://kvz-test/reuse-{at}"
        mk = lambda: _store(url, storage_options=opts, grace_seconds=1)
    else:
        mk = lambda: _store(tmp_path, grace_seconds=0)
    store = mk()
    kv, ids = _session(_ids(40, 3), _ids(9, 4))
    key = store.put(kv, tokens=ids)
    store.delete(key)
    time.sleep(2.1 if where == "s3" else 0)  # the store's clock has whole seconds on S3
    writer = mk()
    during = _During(monkeypatch, at, lambda: writer.put(kv, tokens=ids), _session_exists(writer, key))
    store.gc()
    assert during.join() == key
    assert mk().get(key, output="kvcache").equal(kv)


# -- 5: a session object with a wrong count blames the session, not shared chunks ------------------------------
def test_a_session_with_a_wrong_count_never_quarantines_shared_chunks(tmp_path):
    store = _store(tmp_path)
    prefix = _ids(32, 5)
    kv1, ids1 = _session(prefix, _ids(8, 6))
    kv2, ids2 = _session(prefix, _ids(9, 7))
    k1, k2 = store.put(kv1, tokens=ids1), store.put(kv2, tokens=ids2)
    ns, s1 = k1.split(":")
    obj = _path(store, K.session_path(ns, s1))
    obj.write_bytes(obj.read_bytes()[:8] + (41).to_bytes(4, "little"))  # one flipped bit: 40 -> 41 tokens
    with pytest.raises(kvcodec.FormatError) as e:
        store.get(k1)
    assert e.value.field == "Session"
    assert store.stats()["quarantined"] == 0  # no chunk blamed
    assert store.get(k2, output="kvcache").equal(kv2)
    junk, _ = _session(_ids(20, 8), _ids(4, 9))
    store.delete(store.put(junk, tokens=torch.cat([_ids(20, 8), _ids(4, 9)], 1)))
    with pytest.warns(UserWarning, match="cannot be read"):
        removed = store.gc(grace_seconds=0)
    assert removed["chunks"] == 2  # the namespace is still collected (the deleted session's 2 chunks)
    assert store.get(k2, output="kvcache").equal(kv2)
    store.put(kv1, tokens=ids1)  # putting it again repairs the session object
    assert store.get(k1, output="kvcache").equal(kv1)


# -- 6, 10: hostile directories ----------------------------------------------------------------------------------
def test_gc_never_follows_a_link_out_of_the_store(tmp_path):
    """Defect 6: symlinked directories inside the store (a namespace's entries or sessions, a whole namespace)
    pointing at a tree outside it: gc neither reads nor deletes anything there."""
    outside = tmp_path / "home"
    (outside / "ab" / ("ab" + "0" * 62)).mkdir(parents=True)
    victim = outside / "ab" / ("ab" + "0" * 62) / ("0" * 8 + "." + "1" * 64)
    victim.write_bytes(b"precious")
    (outside / "ab" / ("ab" + "1" * 62 + ".kvz")).write_bytes(b"also precious")
    store = _store(tmp_path / "s")
    kv, ids = _session(_ids(20, 1), _ids(5, 2))
    key = store.put(kv, tokens=ids)
    ns = key.split(":")[0]
    nsdir = tmp_path / "s" / "ns" / ns
    for sub in ("entries", "chunks"):
        os.rename(nsdir / sub, nsdir / (sub + ".real"))
        os.symlink(outside, nsdir / sub)
    os.symlink(outside, tmp_path / "s" / "ns" / ("f" * 64))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        store.gc(grace_seconds=0, max_bytes=0)
        with pytest.raises((kvcodec.KvzError, FileNotFoundError)):
            store.get(key)
    assert victim.read_bytes() == b"precious"
    assert (outside / "ab" / ("ab" + "1" * 62 + ".kvz")).read_bytes() == b"also precious"


def test_special_files_and_links_are_never_read(tmp_path):
    """Defect 10: a FIFO at a session's name, a link to /dev/zero at a cold chunk's and at a chunk's name:
    nothing hangs or reads without bound; each raises a KvzError naming the object (and is moved aside)."""
    model = tiny_model("llama")
    store = kvcodec.Store(tmp_path, model, chunk_tokens=16, granularity=4)
    ids = _ids(40, 3)
    key = store.put(model_cache(model, ids), tokens=ids)
    ns, s = key.split(":")
    chain = store._manifest(key)[1]["chain"]
    session = _path(store, K.session_path(ns, s))
    session.unlink()
    os.mkfifo(session)
    with pytest.warns(UserWarning, match="quarantine"), pytest.raises((KeyError, kvcodec.KvzError)):
        store.get(key)
    assert not session.exists() or not session.is_fifo()
    key = store.put(model_cache(model, ids), tokens=ids)
    store.gc(max_bytes=0, cold="ids")
    cold = _path(store, K.cold_path(ns, chain[1][0]))
    cold.unlink()
    os.symlink("/dev/zero", cold)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(kvcodec.KvzError):
            kvcodec.Store(tmp_path, chunk_tokens=16, model_id="x").tokens(key)
        store.gc(grace_seconds=0)  # completes
    hot = _path(store, K.chunk_path(ns, chain[0][0]))
    os.symlink("/dev/zero", hot)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        n, _ = store.match(ids)
    assert n == 0


def test_a_loop_of_cold_objects_costs_work_in_proportion_to_the_objects(tmp_path, monkeypatch):
    """Defect 9: a cold object whose parent is itself under a session declaring 2**32 - 1 tokens: get and gc
    stop at once (a key met twice is a FormatError), reading a handful of objects, not 2**28."""
    store = _store(tmp_path)
    kv, ids = _session(_ids(20, 1), _ids(4, 2))
    key = store.put(kv, tokens=ids)
    ns = key.split(":")[0]
    loop = bytes(range(1, 33))
    frame = __import__("zstandard").ZstdCompressor().compress(np.arange(16, dtype="<u4").tobytes())
    _path(store, K.cold_path(ns, loop)).parent.mkdir(parents=True, exist_ok=True)
    _path(store, K.cold_path(ns, loop)).write_bytes(b"KVZIDS1\x00" + loop + (16).to_bytes(4, "little") + frame)
    sess = _path(store, K.session_path(ns, loop.hex()))
    sess.parent.mkdir(parents=True, exist_ok=True)
    sess.write_bytes(b"KVZSES1\x00" + (2 ** 32 - 1).to_bytes(4, "little"))
    reads = []
    real = store.backend.read
    monkeypatch.setattr(store.backend, "read", lambda rel, limit: (reads.append(rel), real(rel, limit))[1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(kvcodec.FormatError):
            store.tokens(f"{ns}:{loop.hex()}")
        store.gc(grace_seconds=0)
    assert len(reads) < 200
    assert store.get(key, output="kvcache").equal(kv)


def test_junk_names_raise_only_named_errors_and_concurrent_deletes_say_keyerror(tmp_path):
    """Defect 16: a file where a namespace's sessions directory belongs, a directory at a chunk's name, a
    junk session name: listings skip them, gc warns and collects the rest; two deletes of one session racing
    each other: one succeeds, the other raises KeyError."""
    store = _store(tmp_path)
    kv, ids = _session(_ids(20, 1), _ids(4, 2))
    key = store.put(kv, tokens=ids)
    ns = key.split(":")[0]
    (tmp_path / "ns" / ns / "sessions" / "zz").mkdir()
    (tmp_path / "ns" / ns / "sessions" / "zz" / "junk.kvs").write_bytes(b"x")
    chain = store._manifest(key)[1]["chain"]
    _path(store, K.cold_path(ns, chain[0][0])).mkdir()
    (tmp_path / "ns" / ("e" * 64)).write_bytes(b"not a directory")
    with pytest.warns(UserWarning, match="not store objects"):
        store.gc(grace_seconds=0)
    assert store.sessions() == [key]
    assert store.get(key, output="kvcache").equal(kv)
    with pytest.raises(KeyError):
        store.get(f"{ns}:{'0' * 64}")
    results = []

    def rm():
        try:
            store.delete(key)
            results.append("ok")
        except KeyError:
            results.append("KeyError")
    threads = [threading.Thread(target=rm) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == ["KeyError", "ok"]


# -- 7: a damaged chunk met by a put is written again before the put returns -------------------------------
def test_a_put_that_meets_a_damaged_chunk_rewrites_it(tmp_path):
    store = _store(tmp_path)
    prefix = _ids(32, 1)
    kv1, ids1 = _session(prefix, _ids(8, 2))
    store.put(kv1, tokens=ids1)
    ns = store.namespaces()[0]
    chunk0 = _path(store, K.chunk_path(ns, K.chunk_key(bytes.fromhex(ns), K.ROOT_PARENT, K.token_ids(ids1)[:16])))
    data = bytearray(chunk0.read_bytes())
    data[30] ^= 0xFF  # the header: a reader cannot parse it
    chunk0.write_bytes(bytes(data))
    kv2, ids2 = _session(prefix, _ids(9, 3))
    with pytest.warns(UserWarning, match="quarantine"):
        k2 = store.put(kv2, tokens=ids2)
    assert store.get(k2, output="kvcache").equal(kv2)  # at once, not after a second put


# -- 8, 13: clocks and temporary files ----------------------------------------------------------------------
def test_a_collector_whose_clock_runs_hours_ahead_collects_nothing_young(tmp_path, monkeypatch):
    """Defect 8: ages compare the store's timestamps with the store's clock, so a collector whose own clock is
    two hours ahead (grace one hour) removes nothing a writer just made."""
    store = _store(tmp_path)
    kv, ids = _session(_ids(20, 1), _ids(4, 2))
    key = store.put(kv, tokens=ids)
    store.delete(key)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 7200)
    assert store.gc()["chunks"] == 0
    monkeypatch.setattr(time, "time", real)
    assert store.gc(grace_seconds=0)["chunks"] == 2


HOLDER = textwrap.dedent("""
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("held", flush=True)
    time.sleep(60)
""")


def test_a_live_writers_temporary_file_is_never_swept(tmp_path):
    """Defect 13: a temporary file whose writer is alive in another process - whose process id this one cannot
    see (another container on the same host name) - is neither swept by save() nor collected by gc, however
    old; once that writer is gone it is."""
    from kvcodec import atomic

    target = tmp_path / "c.kvz"
    temp = tmp_path / f".c.kvz.{atomic.HOST}-999999-abcd{atomic.SUFFIX}"  # a pid no process here has
    store = _store(tmp_path / "s")
    kv, ids = _session(_ids(20, 1), _ids(4, 2))
    key = store.put(kv, tokens=ids)
    ns = key.split(":")[0]
    store_temp = tmp_path / "s" / "ns" / ns / "sessions" / f".x.{'0' * 16}.kvz-tmp"
    procs = [subprocess.Popen([sys.executable, "-c", HOLDER, str(p)], stdout=subprocess.PIPE, text=True)
             for p in (temp, store_temp)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "held"
        old = time.time() - 86400
        for p in (temp, store_temp):
            os.utime(p, (old, old))
        kvcodec.save(target, kv)
        assert temp.exists()
        assert store.gc(grace_seconds=0)["temporary"] == 0 and store_temp.exists()
    finally:
        for p in procs:
            p.kill()
            p.wait()
    kvcodec.save(target, kv)
    assert not temp.exists()
    assert store.gc(grace_seconds=0)["temporary"] == 1 and not store_temp.exists()


# -- 11, 12: readers -----------------------------------------------------------------------------------------
def test_match_checks_whole_chunks_against_their_keys(tmp_path):
    """Defect 11: a whole chunk copied over another chunk's name: match stops before it (never returns the
    other chunk's tensors) and quarantines it, as get does."""
    store = _store(tmp_path)
    kv, ids = _session(_ids(32, 1), _ids(8, 2))
    store.put(kv, tokens=ids)
    other, ids2 = _session(_ids(32, 3), _ids(8, 4))
    store.put(other, tokens=ids2)
    ns = store.namespaces()[0]
    nsb = bytes.fromhex(ns)
    k0 = K.chunk_key(nsb, K.ROOT_PARENT, K.token_ids(ids)[:16])
    k1 = K.chunk_key(nsb, k0, K.token_ids(ids)[16:32])
    o0 = K.chunk_key(nsb, K.ROOT_PARENT, K.token_ids(ids2)[:16])
    o1 = K.chunk_key(nsb, o0, K.token_ids(ids2)[16:32])
    _path(store, K.chunk_path(ns, k1)).write_bytes(_path(store, K.chunk_path(ns, o1)).read_bytes())
    with pytest.warns(UserWarning, match="quarantine"):
        n, cache = store.match(ids, dtype=torch.bfloat16, output="kvcache")
    assert n == 16 and all(torch.equal(a, b[:, :, :16]) for a, b in zip(cache.keys, kv.keys))


def test_a_reader_racing_a_fold_reads_the_session(tmp_path, monkeypatch):
    """Defect 12: a reader's walk saw a chunk hot; a collection then folded it into its child's cold object
    and deleted it; the reader looks again and reads the intact session - no spurious FormatError."""
    model = tiny_model("llama")
    store = kvcodec.Store(tmp_path, model, chunk_tokens=16, granularity=4)
    ids = _ids(60, 5)
    key = store.put(model_cache(model, ids), tokens=ids)
    reader = kvcodec.Store(tmp_path, model, chunk_tokens=16, granularity=4)
    real = type(reader)._link
    fired = []

    def link(self, ns, k, start, depth=0, expect=None):
        got = real(self, ns, k, start, depth, expect)
        if not fired and self is reader:
            fired.append(1)  # the walk has read the last chunk: now a collection folds the session
            store.gc(max_bytes=0, grace_seconds=0)
        return got
    monkeypatch.setattr(type(reader), "_link", link)
    assert torch.equal(reader.tokens(key), ids)
    assert fired


# -- 14, 15, 17 ----------------------------------------------------------------------------------------------------
def test_a_root_ending_in_ns_is_collected_and_evicted(tmp_path):
    """Defect 14: a store whose root path ends in /ns (paths are relative to the root, never split on it)."""
    store = _store(tmp_path / "data" / "ns")
    kv, ids = _session(_ids(20, 1), _ids(4, 2))
    key = store.put(kv, tokens=ids)
    removed = store.gc(max_bytes=0, cold="ids")
    assert removed["evicted"] == 2 and store.stats()["chunks"] == 0
    assert torch.equal(store.tokens(key), ids)


def test_a_quarantined_chunk_or_a_junk_name_does_not_stop_collection(tmp_path):
    """Defect 15: a session whose chunk was quarantined, and a junk name among the sessions: gc warns about
    both and still collects the namespace's garbage (which chunks lie below a missing one is unknowable: they
    are collected like any unreferenced chunk; putting the session again writes back everything it lacks)."""
    store = _store(tmp_path)
    prefix = _ids(16, 1)
    kv1, ids1 = _session(prefix, _ids(20, 2))
    k1 = store.put(kv1, tokens=ids1)
    kv2, ids2 = _session(_ids(30, 3), _ids(4, 4))
    store.delete(store.put(kv2, tokens=ids2))
    ns = k1.split(":")[0]
    last = store._manifest(k1)[1]["chain"][-1][0]
    _path(store, K.chunk_path(ns, last)).write_bytes(b"garbage")
    (tmp_path / "ns" / ns / "sessions" / "00" / "not-a-session.kvs").parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "ns" / ns / "sessions" / "00" / "not-a-session.kvs").write_bytes(b"?")
    with pytest.warns(UserWarning) as caught:
        removed = store.gc(grace_seconds=0)
    text = " ".join(str(w.message) for w in caught)
    assert "cannot be read" in text and "not store objects" in text
    assert removed["chunks"] >= 3  # the deleted session's 3 chunks at least: collected
    store.put(kv1, tokens=ids1)  # the broken session, repaired
    assert store.get(k1, output="kvcache").equal(kv1)


def test_temporary_files_beside_namespace_records_are_collected(tmp_path):
    """Defect 17."""
    store = _store(tmp_path)
    kv, ids = _session(_ids(20, 1), _ids(4, 2))
    key = store.put(kv, tokens=ids)
    ns = key.split(":")[0]
    debris = tmp_path / "ns" / ns / f".namespace.json.{'1' * 16}.kvz-tmp"
    debris.write_bytes(b"{")
    assert store.gc(grace_seconds=0)["temporary"] == 1 and not debris.exists()


# -- what a new user met in the README's example -------------------------------------------------------------
def test_a_model_less_store_matches_after_its_own_put(tmp_path):
    store = _store(tmp_path)
    kv, ids = _session(_ids(20, 1), _ids(4, 2))
    store.put(kv, tokens=ids)
    assert store.match(ids)[0] == 24  # no dtype=: this object's put named it
    assert _store(tmp_path).match(ids)[0] == 24  # a fresh object: the only namespace of its configuration
    kv16 = kvcodec.KVCache([k.half() for k in kv.keys], [v.half() for v in kv.values])
    _store(tmp_path).put(kv16, tokens=ids)
    with pytest.raises(kvcodec.ConfigError, match="dtype="):  # two of them: which one is not guessed
        _store(tmp_path).match(ids)


@pytest.mark.parametrize("where", ["disk", "s3"])
def test_match_is_the_exact_longest_stored_prefix_against_a_brute_force_oracle(tmp_path, request, where):
    """Random shared-prefix workloads (sessions branching off each other at random tokens, chunks and
    entries of several sizes): match returns the longest prefix any stored session shares with the query,
    computed by comparing token lists (no store code), and that prefix's cache bit for bit."""
    rng = np.random.default_rng(45)
    opts = request.getfixturevalue("s3") if where == "s3" else None
    for trial in range(3 if where == "s3" else 6):
        size = int(rng.choice([8, 16, 32]))
        step = int(rng.choice([g for g in (1, 3, 4, 8) if g < size]))
        url = f"s3://kvz-test/oracle-{trial}" if where == "s3" else tmp_path / str(trial)
        store = _store(url, chunk_tokens=size, granularity=step, storage_options=opts)
        stored = []
        vocab = int(rng.choice([3, 128]))  # few distinct ids: long accidental common prefixes
        base = torch.from_numpy(rng.integers(0, vocab, 90))[None]
        for _ in range(8):
            if stored and rng.random() < 0.7:
                src = stored[rng.integers(len(stored))][1]
                cut = int(rng.integers(0, src.shape[1] + 1))
                own = torch.from_numpy(rng.integers(0, vocab, int(rng.integers(1, 40))))[None]
                ids = torch.cat([src[:, :cut], own], 1)
            else:
                ids = base[:, :int(rng.integers(1, 90))]
            kv, _ = _session(ids[:, :0], ids)
            store.put(kv, tokens=ids)
            stored.append((kv, ids))
        for _ in range(12):
            src = stored[rng.integers(len(stored))][1]
            cut = int(rng.integers(0, src.shape[1] + 1))
            q = torch.cat([src[:, :cut], torch.from_numpy(rng.integers(0, vocab, int(rng.integers(0, 20))))[None]],
                          1)
            if q.shape[1] == 0:
                continue
            want = max(_shared(q, ids) for _, ids in stored)
            n, cache = store.match(q, dtype=torch.bfloat16, output="kvcache")
            assert n == want, (trial, size, step, q.shape[1], n, want)
            if n:
                ref, _ = _session(q[:, :0], q[:, :n])
                assert cache.equal(ref)


def test_a_damaged_or_removed_lease_never_sends_the_epochs_back(tmp_path):
    """Puts compare collection epochs: a collector that finds the lease damaged or gone numbers its collection
    after the highest record; a link at gc/lock is refused by name."""
    store = _store(tmp_path)
    kv, ids = _session(_ids(20, 1), _ids(4, 2))
    store.put(kv, tokens=ids)
    for _ in range(3):
        store.gc()
    from kvcodec.store.lease import read_state

    assert read_state(store.backend).epoch == 3
    (tmp_path / "gc" / "lease.json").write_bytes(b"{not json")
    with pytest.raises(kvcodec.FormatError):
        store.put(kv, tokens=ids)  # a put refuses to guess (before writing anything)
    store.gc()
    assert read_state(store.backend).epoch == 4
    (tmp_path / "gc" / "lease.json").unlink()
    store.gc()
    assert read_state(store.backend).epoch == 5
    (tmp_path / "gc" / "lock").unlink()
    os.symlink(tmp_path / "elsewhere", tmp_path / "gc" / "lock")
    with pytest.raises(kvcodec.UnsafeObject, match="gc/lock"):
        store.gc()
    assert not (tmp_path / "elsewhere").exists()
