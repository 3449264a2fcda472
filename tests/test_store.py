"""kvcodec.Store: sessions as content-addressed chunks on a local directory and on a real S3-compatible server
(moto, started on loopback), through fsspec as users would; crash and concurrency safety with real processes
killed by SIGKILL."""

import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch

import kvcodec
from kvcodec.store import keys as K
from kvcodec.store import token_ids

from .common import VOCAB, cache_arg, greedy_from, model_cache, tiny_model

ROOT = Path(__file__).resolve().parent.parent


def _session(prefix, tail, layers=2, heads=2, dim=8, seed=0, dtype=torch.bfloat16):
    """A cache whose position i is a function of (token i, its predecessors' count): equal prefixes give
    equal tensors, as a model's cache would."""
    ids = torch.cat([prefix, tail], 1)
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(VOCAB, layers, 2, heads, dim, generator=g)
    pos = torch.arange(ids.shape[1], dtype=torch.float32)[:, None, None, None, None] * 1e-3
    t = (table[ids[0]] + pos).to(dtype)  # [n, layers, 2, heads, dim]
    keys = [t[:, i, 0].permute(1, 0, 2)[None].contiguous() for i in range(layers)]
    values = [t[:, i, 1].permute(1, 0, 2)[None].contiguous() for i in range(layers)]
    return kvcodec.KVCache(keys, values), ids


def _path(store, rel) -> Path:
    """A store object's path on disk (store paths are relative to its root)."""
    return Path(store.root) / rel


def _reached(store) -> set:
    """The chunk objects (hot and cold) the sessions reach, with their bases."""
    out = set()
    for key in store:
        ns, m = store._manifest(key, ids=False)
        for k, _first, _count in m["chain"]:
            for kk in (k, *store._bases(ns, k)):
                out |= {_path(store, K.chunk_path(ns, kk)), _path(store, K.cold_path(ns, kk))}
    return out


def _ids(n, seed):
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def test_sessions_sharing_a_prefix_store_it_once(tmp_path):
    store = kvcodec.Store(tmp_path, model_id="test", chunk_tokens=32, granularity=8)
    prefix = _ids(100, 1)
    keys, caches = [], []
    for i in range(6):
        kv, ids = _session(prefix, _ids(10 + 5 * i, 100 + i))
        keys.append(store.put(kv, tokens=ids))
        caches.append(kv)
    st = store.stats()
    assert st["sessions"] == 6
    # the 3 full chunks of the prefix once, then each session's own chunks from position 96 on
    assert st["chunks"] == 3 + sum(-(-(kv.seq_len - 96) // 32) for kv in caches) == 3 + 8
    for key, kv in zip(keys, caches):  # every session back, bit for bit, with its tokens
        back = store.get(key, output="kvcache")
        assert back.equal(kv) and back.tokens.shape == (1, kv.seq_len)
    assert store.put(caches[0], tokens=store.tokens(keys[0])) == keys[0]  # idempotent: same key, nothing new
    assert store.stats()["chunks"] == st["chunks"]
    # each position is stored once, to the token: chunk 3's 4 shared positions (96..99) too, found through the
    # prefix entries of level 0
    held = sum(kvcodec.inspect(p)["tokens"] for p in (tmp_path / "ns").rglob("chunks/*/*.kvz"))
    assert held == 100 + sum(kv.seq_len - 100 for kv in caches)


def test_usage_counts_what_is_shared_and_what_each_session_adds(tmp_path):
    """Store.usage (kvz store stats): positions in sessions against positions stored once, the share of those
    several sessions use, and the bytes of the rest - counted here from the sessions' own shapes, not by the
    store's code."""
    store = kvcodec.Store(tmp_path, model_id="test", chunk_tokens=32, granularity=0)
    prefix = _ids(64, 7)  # two whole chunks, shared by all three sessions
    tails = [_ids(32 * (i + 1), 70 + i) for i in range(3)]  # whole chunks each: no delta chunks
    for t in tails:
        kv, ids = _session(prefix, t)
        store.put(kv, tokens=ids)
    (u,) = store.usage().values()
    own = sum(t.shape[1] for t in tails)
    assert u["sessions"] == 3 and u["unreadable"] == 0
    assert u["positions"] == 3 * 64 + own and u["stored_positions"] == 64 + own
    assert u["shared_share"] == round(64 / (64 + own), 4)
    assert u["dedup_ratio"] == round((3 * 64 + own) / (64 + own), 3)
    comps = 2 * 2 * (8 + 8)  # layers x heads x (key + value dims)
    tail_files = [p for p in (tmp_path / "ns").rglob("chunks/*/*.kvz") if kvcodec.inspect(p)["start_position"] >= 64]
    assert len(tail_files) == own // 32
    assert u["tail_bits"] == round(8 * sum(p.stat().st_size for p in tail_files) / (own * comps), 3)
    every = sum(p.stat().st_size for p in (tmp_path / "ns").rglob("chunks/*/*.kvz"))
    assert u["chunk_bytes"] == every
    assert u["compression_ratio"] == round((64 + own) * comps * 2 / every, 3)  # bf16: 2 bytes a component


def _shared(a, b) -> int:
    """How many leading token ids two [1, n] tensors share (the oracle: no store code)."""
    n = min(a.shape[1], b.shape[1])
    diff = (a[0, :n] != b[0, :n]).nonzero()
    return int(diff[0, 0]) if len(diff) else n


def test_match_finds_the_longest_stored_prefix_to_the_token(tmp_path):
    store = kvcodec.Store(tmp_path, model_id="test", chunk_tokens=32, granularity=8)
    prefix = _ids(70, 2)
    kv, ids = _session(prefix, _ids(30, 3))
    store.put(kv, tokens=ids)
    # exact to the token: 70 shares 6 tokens of its third chunk, 5 shares 5 of the first (entries of level 0)
    for shared in (100, 70, 75, 31, 5, 0):
        q = torch.cat([ids[:, :shared], _ids(12, 50 + shared)], 1) if shared < 100 else ids
        expect = _shared(q, ids)
        assert expect >= shared
        n, cache = store.match(q, dtype=torch.bfloat16, output="kvcache")
        assert n == expect, (shared, n)
        assert store.lookup(q, dtype=torch.bfloat16) == expect  # the same answer, nothing decoded
        if n:
            assert all(torch.equal(a, b[:, :, :n]) for a, b in zip(cache.keys, kv.keys))
        else:
            assert cache is None
    assert store.match(ids[0].tolist(), dtype=torch.bfloat16)[0] == 100  # a plain list works too
    # another dtype (or model, or codec configuration) is another namespace: nothing matches there
    assert store.match(ids, dtype=torch.float16)[0] == 0


def test_real_model_round_trip_and_the_reuse_loop(tmp_path):
    """With a model: tokens recovered from the cache, match -> prefill the rest -> same logits as a full
    prefill; Store.generate() continues as plain generate() and reuses more each turn."""
    model = tiny_model("llama")
    store = kvcodec.Store(tmp_path, model, chunk_tokens=16, granularity=4)
    ids = _ids(40, 5)
    cache = model_cache(model, ids)
    key = store.put(cache)  # tokens recovered from the cache
    assert torch.equal(store.tokens(key), ids)
    assert kvcodec.to_canonical(store.get(key)).equal(kvcodec.to_canonical(cache))
    q = torch.cat([ids, _ids(6, 6)], 1)
    n, restored = store.match(q)
    assert n == 40
    a, b = greedy_from(model, q, model_cache(model, q[:, :40]), restored, 5)
    assert torch.equal(a, b)
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    seq, key2, reused = store.generate(q, **kw)
    assert reused == 40 and torch.equal(seq, model.generate(q, **kw))
    seq2, _, reused2 = store.generate(torch.cat([seq, _ids(3, 7)], 1), **kw)
    held = seq.shape[1] - 1  # the previous turn's cache: all but its last token (generate() never fed it)
    assert held - 4 < reused2 <= held  # to the store's granularity (4 tokens here)
    other = tiny_model("qwen2")  # another model: another namespace, never a hit
    assert store.match(q, other)[0] == 0
    with pytest.raises(kvcodec.ModelMismatch):  # and never recomputes a stored session's positions
        store.get(key, other)


def test_the_library_calls_transformers_by_its_current_names(tmp_path):
    """No deprecation from transformers on the library's own calls (issue 50: ``past_key_values`` is ``cache``
    since 5.2x): a store round trip with the model, Store.generate, a get that recomputes evicted positions (kvz
    store get --with-model), the exact tier and a reduction generated from - FutureWarning an error, and the
    deprecation transformers logs (once per process: its memo cleared) counted."""
    import logging

    from transformers.utils import logging as hf_logging

    class Logged(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.lines = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    model = tiny_model("llama")
    ids, more = _ids(40, 5), _ids(6, 6)
    kw = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    getattr(hf_logging.warning_once, "cache_clear", lambda: None)()
    logged = Logged()
    logging.getLogger("transformers").addHandler(logged)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            store = kvcodec.Store(tmp_path, model, chunk_tokens=16, granularity=4)
            key = store.put(model_cache(model, ids))
            assert store.match(torch.cat([ids, more], 1))[0] == 40
            store.generate(torch.cat([ids, more], 1), **kw)
            assert store.gc(max_bytes=0)["evicted"] > 0
            assert store.get(key, output="kvcache").stored_positions < 40  # recomputed with the model
            cache = model_cache(model, ids)
            kvcodec.decode(kvcodec.encode(cache, model), model)  # the exact tier: the model replays the tokens
            red = kvcodec.reduce(cache, model, keep=0.5, tokens=ids)  # kvzip: the model reads a repeat prompt
            model.generate(torch.cat([ids, more], 1), **cache_arg(model, red), **kw)
    finally:
        logging.getLogger("transformers").removeHandler(logged)
    assert not [line for line in logged.lines if "deprecated" in line], logged.lines


def test_caches_a_store_cannot_chunk_are_refused_by_name(tmp_path):
    store = kvcodec.Store(tmp_path, model_id="test")
    kv, ids = _session(_ids(4, 1), _ids(4, 2))
    two = kvcodec.KVCache([torch.cat([k, k]) for k in kv.keys], [torch.cat([v, v]) for v in kv.values])
    with pytest.raises(kvcodec.UnsupportedCache, match="batch 2"):
        store.put(two, tokens=ids)
    shifted = kvcodec.KVCache(kv.keys, kv.values, start_position=3)
    with pytest.raises(kvcodec.UnsupportedCache, match="position"):
        store.put(shifted, tokens=ids)
    with pytest.raises(kvcodec.ConfigError, match="tokens"):
        store.put(kv)  # no model to recover them
    with pytest.raises(kvcodec.ConfigError, match="token ids"):
        store.put(kv, tokens=ids[:, :3])
    with pytest.raises(kvcodec.ConfigError, match="tier"):
        kvcodec.Store(tmp_path, tier="exact")
    with pytest.raises(kvcodec.ConfigError, match="model_id"):  # two models must never share a namespace
        kvcodec.Store(tmp_path).put(kv, tokens=ids)
    with pytest.raises(kvcodec.ConfigError, match="differs"):
        store.put(kvcodec.KVCache(kv.keys, kv.values, ids.flip(1)), tokens=ids)
    with pytest.raises(kvcodec.ConfigError):
        token_ids(torch.zeros(2, 3, dtype=torch.long))


def test_lossy_store(tmp_path):
    store = kvcodec.Store(tmp_path, model_id="test", tier="lossy", bits=4, chunk_tokens=64)
    kv, ids = _session(_ids(100, 1), _ids(28, 2), dim=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tiny chunks cannot meet bits= (side information): not what is tested
        key = store.put(kv, tokens=ids)
    back = store.get(key, output="kvcache")
    rel = max(float((a.float() - b.float()).norm() / a.float().norm()) for a, b in zip(kv.keys, back.keys))
    assert 0 < rel < 0.2
    assert kvcodec.Store(tmp_path).namespaces() == [key.split(":")[0]]


def test_corrupt_objects_are_quarantined_never_returned(tmp_path):
    store = kvcodec.Store(tmp_path, model_id="test", chunk_tokens=16, granularity=4)
    kv, ids = _session(_ids(40, 1), _ids(8, 2))
    key = store.put(kv, tokens=ids)
    chunk = sorted((tmp_path / "ns").rglob("chunks/*/*.kvz"))[1]
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x10
    chunk.write_bytes(bytes(data))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        n, _ = store.match(ids, dtype=torch.bfloat16)
    assert n < 48 and any("quarantine" in str(w.message) for w in caught)
    assert not chunk.exists() and store.stats()["quarantined"] == 1
    with pytest.raises(FileNotFoundError):  # the chunk is gone: the session is incomplete, never wrong
        store.get(key)
    store.put(kv, tokens=ids)  # putting the session again repairs it
    assert store.get(key, output="kvcache").equal(kv)
    manifest = next((tmp_path / "ns").rglob("sessions/*/*.kvs"))
    manifest.write_bytes(manifest.read_bytes()[:-2])
    with pytest.raises(kvcodec.FormatError):
        store.get(key)
    with pytest.raises(KeyError):
        store.get(key)  # quarantined: no longer there


def test_gc_removes_only_unreferenced_objects_older_than_the_grace(tmp_path):
    store = kvcodec.Store(tmp_path, model_id="test", chunk_tokens=16, granularity=4)
    kept, ids = _session(_ids(30, 1), _ids(10, 2))
    gone, ids2 = _session(_ids(30, 3), _ids(10, 4))
    k1, k2 = store.put(kept, tokens=ids), store.put(gone, tokens=ids2)
    store.delete(k2)
    assert store.gc()["chunks"] == 0  # younger than the default grace (a writer may be publishing them)
    removed = store.gc(grace_seconds=0)
    assert removed["chunks"] == 3 and removed["entries"] > 0
    assert store.get(k1, output="kvcache").equal(kept) and list(store) == [k1]
    with pytest.raises(KeyError):
        store.delete(k2)


# -- processes: concurrency and kill -9 ----------------------------------------------------------------------
WRITER = textwrap.dedent("""
    import os, random, signal, sys, time
    import torch
    torch.set_num_threads(1)
    sys.path.insert(0, {root!r})
    import kvcodec
    from tests.test_store import _session, _ids
    store = kvcodec.Store({url!r}, model_id="test", chunk_tokens=32, granularity=8)
    mode = {mode!r}
    prefix = _ids(200, 1)
    def put(i):
        kv, ids = _session(prefix, _ids(20 + i % 50, 1000 + i), layers=4, heads=4, dim=32)
        store.put(kv, tokens=ids)
    put(0)  # JIT and imports done before the first fork
    if mode == "concurrent":
        kids = []
        for w in range(4):
            pid = os.fork()
            if pid == 0:
                for i in range(12):
                    put(w * 7 + i)  # overlapping sessions between writers
                os._exit(0)
            kids.append(pid)
        sys.exit(max(os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in kids))
    # every fsync takes 10 ms longer, so that kills land inside writes (a temporary file not yet renamed, a
    # chunk published before its session) as often as between them: fsync alone is too quick to be hit
    real_fsync = os.fsync
    os.fsync = lambda fd: (time.sleep(0.01), real_fsync(fd))[1]
    rng = random.Random(7 + {offset})
    for trial in range({trials}):
        pid = os.fork()
        if pid == 0:
            i = (trial + {offset}) * 1000
            while True:
                put(i)
                i += 1
        time.sleep(rng.uniform(0.0, 0.25))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    print("trials done")
""")


def _run_writer(url, mode, trials=0, timeout=600, offset=0):
    code = WRITER.format(root=str(ROOT), url=str(url), mode=mode, trials=trials, offset=offset)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)


def _check_every_session(store):
    for key in store:
        kv = store.get(key, output="kvcache")
        prefix = _ids(200, 1)
        tail = kv.tokens[:, 200:]
        want, _ = _session(prefix, tail, layers=4, heads=4, dim=32)
        assert kv.equal(want), key


def test_concurrent_writers_of_the_same_chunks(tmp_path):
    r = _run_writer(tmp_path, "concurrent")
    assert r.returncode == 0, r.stderr[-3000:]
    store = kvcodec.Store(tmp_path, model_id="test", chunk_tokens=32, granularity=8)
    assert len(store.sessions()) == 33  # sessions 0 .. 32, most written by two writers at once
    _check_every_session(store)
    assert store.gc(grace_seconds=0)["temporary"] == 0


def test_a_writer_killed_at_any_moment_leaves_no_visible_partial_entry(tmp_path):
    """50 writers killed by SIGKILL at random moments of their puts: every visible session decodes exactly,
    and gc removes the debris (temporary files, chunks of sessions never published)."""
    store = kvcodec.Store(tmp_path, model_id="test", chunk_tokens=32, granularity=8)
    for offset in range(0, 200, 50):  # 50 kills, again until one landed inside a write (a few in 50 do)
        r = _run_writer(tmp_path, "kill", trials=50, offset=offset)
        assert r.returncode == 0 and "trials done" in r.stdout, r.stderr[-3000:]
        temps = [p for p in tmp_path.rglob("*") if p.name.endswith(".kvz-tmp")]
        keep = _reached(store)
        orphans = [p for p in tmp_path.rglob("*.kvz") if p not in keep]
        if temps or orphans:
            break
    _check_every_session(store)
    removed = store.gc(grace_seconds=0)
    assert removed["temporary"] == len(temps)
    assert removed["temporary"] + removed["chunks"] + removed["entries"] > 0, "no kill landed inside a put"
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".kvz-tmp")]
    _check_every_session(store)
    assert store.gc(grace_seconds=0) == {"chunks": 0, "entries": 0, "temporary": 0, "bytes": 0}


# -- S3: a real S3-compatible server on loopback (tests/conftest.py: s3_server) ---------------------------------
def test_store_on_s3_through_fsspec(s3_server, monkeypatch):
    opts = {"key": "test", "secret": "test", "client_kwargs": {"endpoint_url": s3_server}}
    store = kvcodec.Store("s3://kvz-test/memory", model_id="test", storage_options=opts, chunk_tokens=16,
                          granularity=4)
    prefix = _ids(40, 1)
    keys, caches = [], []
    for i in range(3):
        kv, ids = _session(prefix, _ids(9 + i, 10 + i))
        keys.append(store.put(kv, tokens=ids))
        caches.append(kv)
    assert store.stats()["chunks"] == 2 + 3 * 2  # 2 shared full chunks, then each tail's 2 chunks
    for key, kv in zip(keys, caches):
        assert store.get(key, output="kvcache").equal(kv)
    n, _ = store.match(torch.cat([prefix, _ids(5, 99)], 1), dtype=torch.bfloat16)
    assert n == 40
    for i, k, v in store.layers(keys[2]):  # layer by layer, with range reads of each chunk's sections
        assert torch.equal(k, caches[2].keys[i]) and torch.equal(v, caches[2].values[i])
    # the standard AWS environment variables, as for any fsspec user
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    again = kvcodec.Store("s3://kvz-test/memory", model_id="test", chunk_tokens=16, granularity=4)
    assert sorted(again) == sorted(keys)
    store.delete(keys[0])
    removed = again.gc(grace_seconds=0)
    # the deleted session's last chunk goes; its third is the base of the others' delta chunks and stays
    assert removed["chunks"] == 1 and store.get(keys[1], output="kvcache").equal(caches[1])


@pytest.mark.filterwarnings("ignore:vq_rans")  # a tiny model's few components: 3 bits not reachable
def test_reduced_objects_on_s3_in_the_lossy_tier(s3_server):
    """A reduced cache in a lossy namespace on S3 (store spec §6.1): stored whole beside the full session,
    listed, read back as the file the lossy tier writes, kept by a collection, deleted by key."""
    opts = {"key": "test", "secret": "test", "client_kwargs": {"endpoint_url": s3_server}}
    m = tiny_model("llama")
    ids = _ids(64, 3)
    store = kvcodec.Store("s3://kvz-test/reduced", m, storage_options=opts, chunk_tokens=16, tier="lossy",
                          bits=3.0, grace_seconds=0)
    key = store.put(model_cache(m, ids), tokens=ids)
    red = kvcodec.reduce(store.get(key), m, keep=0.25, tokens=ids)
    rkey = store.put(red, tokens=ids)
    assert rkey.startswith(key + ":") and store.reductions(ids) == [rkey]
    ns, s, r = rkey.split(":")
    got = store.get(rkey, output="kvcache")
    want = kvcodec.decode(kvcodec.encode(red, tier="lossy", bits=3.0), output="kvcache")
    assert got.reduce == want.reduce and all(torch.equal(a, b) for a, b in zip(got.keys, want.keys))
    store.delete(key)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert store.gc(grace_seconds=0)["chunks"] > 0 and store.reductions() == [rkey]
    assert not [w for w in seen if "not store objects" in str(w.message)]  # a reduced object is the store's
    store.delete(rkey)
    assert store.reductions() == [] and rkey not in store


def test_command_line(tmp_path, capsys):
    import json

    from safetensors.torch import save_file

    from kvcodec.cli import main

    kv, ids = _session(_ids(40, 1), _ids(9, 2))
    t = {f"layers.{i}.{p}": x for i, (k, v) in enumerate(zip(kv.keys, kv.values))
         for p, x in (("keys", k), ("values", v))}
    save_file({**t, "tokens": ids}, str(tmp_path / "c.safetensors"))
    url = str(tmp_path / "store")
    assert main(["store", "stats", url]) == 2  # no store there yet: an error, not 0 sessions
    assert "no store" in capsys.readouterr().err
    put = ["store", "put", url, "--cache", str(tmp_path / "c.safetensors"), "--chunk-tokens", "16", "--json",
           "--model-id", "test"]
    assert main(put) == 0 and json.loads(capsys.readouterr().out)["already_stored"] == 0
    assert main(put) == 0 and json.loads(capsys.readouterr().out)["already_stored"] == 49
    assert main(["store", "ls", url, "--json"]) == 0
    (key,) = json.loads(capsys.readouterr().out)
    assert main(["store", "stats", url, "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["sessions"] == 1 and st["chunks"] == 4
    out = tmp_path / "back.safetensors"
    assert main(["store", "get", url, key, "-o", str(out)]) == 0
    from kvcodec.cli import _cache_from_safetensors

    assert _cache_from_safetensors(str(out)).equal(kv)
    capsys.readouterr()
    assert main(["store", "gc", url, "--max-bytes", "0", "--cold", "ids", "--json"]) == 0  # evict: cold, no model
    gone = json.loads(capsys.readouterr().out)
    assert gone["evicted"] == 4 and gone["cold_lm"] == 0
    assert main(["store", "stats", url, "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["chunks"] == 0 and st["cold_chunks"] == 4
    assert main(["store", "get", url, key, "-o", str(out), "-f"]) == 2  # cold without a model: refused, said why
    assert "--with-model" in capsys.readouterr().err
    assert main(["store", "rm", url, key]) == 0
    assert main(["store", "gc", url, "--grace", "0", "--json"]) == 0
    capsys.readouterr()
    assert main(["store", "get", url, key, "-o", str(out), "-f"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no session" in err[0]


def test_a_byte_budget_evicts_least_recently_used_chunks_and_get_recomputes_them(tmp_path):
    model = tiny_model("llama")
    store = kvcodec.Store(tmp_path, model, chunk_tokens=16, granularity=4)
    prefix = _ids(32, 1)
    sessions = {}
    for i in range(3):
        ids = torch.cat([prefix, _ids(20, 10 + i)], 1)
        cache = model_cache(model, ids)
        sessions[store.put(cache, tokens=ids)] = (ids, kvcodec.to_canonical(cache))
        time.sleep(0.02)  # distinct modification times
    first = next(iter(sessions))
    store.get(first)  # used now: its chunks are the most recent
    before = store.stats()["namespaces"]
    total = sum(d["chunk_bytes"] for d in before.values())
    removed = store.gc(max_bytes=total // 2)
    assert removed["evicted"] > 0 and removed["evicted_bytes"] >= total - total // 2 - 1
    assert removed["cold_lm"] == removed["evicted"]  # the store has the model: token ids coded with it
    kept_first = store.get(first, output="kvcache")  # the recently used session is still whole
    assert kept_first.equal(sessions[first][1])
    # the least recently used chunks went first: the other sessions' own tails (positions 32..51)
    assert all(store.hot_tokens(k) <= 32 for k in sessions if k != first)
    st = store.stats()
    assert st["cold_chunks"] == removed["evicted"]  # an evicted chunk keeps its token ids and parent
    cold = [k for k in sessions if k != first]
    assert all(torch.equal(store.tokens(k), sessions[k][0]) for k in cold)  # so cold sessions keep their tokens
    plain = kvcodec.Store(tmp_path, chunk_tokens=16, granularity=4)  # no model: a cold session cannot be read
    with pytest.raises((FileNotFoundError, kvcodec.ConfigError), match="model="):
        for k in cold:
            plain.get(k)
    for k in cold:  # with the model, the missing positions are recomputed on top of what is stored
        ids, original = sessions[k]
        back = store.get(k, output="kvcache")
        assert back.seq_len == original.seq_len and back.stored_positions == store.hot_tokens(k) < 52
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(back.keys, original.keys))
        a, b = greedy_from(model, torch.cat([ids, _ids(2, 3)], 1), original.to_dynamic_cache(),
                           back.to_dynamic_cache(), 4)
        assert torch.equal(a, b)


def test_a_chunk_under_another_name_or_a_bad_cold_object_is_caught(tmp_path):
    """Every chunk a session reaches is checked against its key (recomputed from its parent and token ids):
    a chunk copied over another's name is refused by field, and so is a malformed cold object."""
    store = kvcodec.Store(tmp_path, model_id="test", chunk_tokens=16, granularity=4)
    kv, ids = _session(_ids(30, 1), _ids(10, 2))
    key = store.put(kv, tokens=ids)
    other, ids2 = _session(_ids(30, 3), _ids(10, 4))
    store.put(other, tokens=ids2)
    ns = key.split(":")[0]
    mine = store._manifest(key)[1]["chain"]
    theirs = store._manifest(store.sessions()[0] if store.sessions()[0] != key else store.sessions()[1])[1]["chain"]
    _path(store, K.chunk_path(ns, mine[1][0])).write_bytes(_path(store, K.chunk_path(ns, theirs[1][0])).read_bytes())
    with pytest.warns(UserWarning, match="quarantine"), pytest.raises(kvcodec.FormatError, match="other tokens"):
        store.get(key)
    store.put(kv, tokens=ids)  # the quarantined chunk is written again
    assert store.get(key, output="kvcache").equal(kv)
    store.gc(max_bytes=0)  # everything cold: token ids and parents only
    assert torch.equal(store.tokens(key), ids)
    cold = _path(store, K.cold_path(ns, mine[0][0]))
    cold.write_bytes(cold.read_bytes()[:-3])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(kvcodec.FormatError, match="cold chunk"):
            store.tokens(key)


def test_layer_by_layer_reads_match_get(tmp_path):
    store = kvcodec.Store(tmp_path, model_id="test", chunk_tokens=16, granularity=4)
    prefix = _ids(30, 1)
    kv0, ids0 = _session(prefix, _ids(9, 2), layers=3)
    store.put(kv0, tokens=ids0)
    kv, ids = _session(prefix, _ids(12, 3), layers=3)  # its third chunk is a delta chunk on kv0's
    key = store.put(kv, tokens=ids)
    got = list(store.layers(key))
    assert [i for i, _, _ in got] == [0, 1, 2]
    for i, k, v in got:
        assert torch.equal(k, kv.keys[i]) and torch.equal(v, kv.values[i])
    query = torch.cat([ids[:, :37], _ids(5, 4)], 1)  # 37 positions stored: 2 chunks, then 5 of a delta chunk
    n, layers = store.match(query, dtype=torch.bfloat16, output="layers")
    n2, whole = store.match(query, dtype=torch.bfloat16, output="kvcache")
    assert n == n2 == 37
    for i, k, v in layers:
        assert torch.equal(k, whole.keys[i]) and torch.equal(v, kv.values[i][:, :, :37])
    with pytest.raises(kvcodec.ConfigError, match="output"):
        store.match(query, dtype=torch.bfloat16, output="tuple")
    store.gc(max_bytes=0)
    with pytest.raises(FileNotFoundError, match="hot"):
        list(store.layers(key))
    assert store.match(query, dtype=torch.bfloat16, output="layers") == (0, None)


def test_match_routes_by_the_measured_cost(tmp_path):
    """route="decode" reads the chunks; "recompute" runs the model over the matched prefix instead; "auto"
    measures both rates on this machine (decoding as chunks are read, the model's prefill once) and takes
    the faster - a valid cache of the prefix either way."""
    model = tiny_model("llama")
    ids = _ids(40, 8)
    cache = model_cache(model, ids)
    kvcodec.Store(tmp_path, model, chunk_tokens=16).put(cache, tokens=ids)
    original = kvcodec.to_canonical(cache)
    auto = kvcodec.Store(tmp_path, model, chunk_tokens=16, route="auto")
    for store in (kvcodec.Store(tmp_path, model, chunk_tokens=16, route="decode"),
                  kvcodec.Store(tmp_path, model, chunk_tokens=16, route="recompute"), auto, auto):
        n, got = store.match(ids, output="kvcache")
        assert n == 40
        for a, b in zip(got.keys, original.keys):
            assert torch.equal(a, b) if store.route == "decode" else torch.allclose(a, b, atol=1e-5)
    assert set(auto.rates) == {"decode_bytes_per_s", "prefill_tokens_per_s", "cache_bytes_per_token"}
    with pytest.raises(kvcodec.ConfigError, match="route"):
        kvcodec.Store(tmp_path, route="fastest")


def test_a_writer_that_finds_its_own_chunk_meanwhile_never_makes_it_a_delta_of_itself(tmp_path, monkeypatch):
    """Two writers of the same new chunk: the second saw it absent, then its lookup finds the first writer's
    copy.  It must not write the chunk as a delta on itself (a cycle: the session would be lost)."""
    store = kvcodec.Store(tmp_path, model_id="test", chunk_tokens=16, granularity=4)
    kv, ids = _session(_ids(20, 1), _ids(7, 2))
    key = store.put(kv, tokens=ids)
    real, asked = store._hot_chain, set()

    def first_look_misses(ns, k, start):  # the reuse check of each chunk misses, as the racing writer's did
        if k not in asked:
            asked.add(k)
            return None
        return real(ns, k, start)

    monkeypatch.setattr(store, "_hot_chain", first_look_misses)
    assert store.put(kv, tokens=ids) == key  # as the racing writer would
    monkeypatch.setattr(store, "_hot_chain", real)
    assert store.get(key, output="kvcache").equal(kv)
    ns = key.split(":")[0]
    for held in store._manifest(key)[1]["chain"]:
        assert store._hot(ns, held[0]).base != held[0]


def _cold_objects(root):
    return sorted(Path(root).rglob("*.ids"))


def test_cold_chunks_keep_their_tokens_coded_with_the_model(tmp_path):
    """gc(max_bytes=0) with the model: every chunk keeps only its token ids, range-coded with the model's
    next-token distributions given the tokens before them (a delta chunk's after its base's); a fresh store
    object decodes them, checked against the chunk keys, and recomputes the caches; pointers into cold chunks
    are collected, the objects the sessions need are not."""
    model = tiny_model("llama")
    store = kvcodec.Store(tmp_path, model, chunk_tokens=16, granularity=4)
    prefix = _ids(27, 1)
    sessions = {}
    for i in range(3):  # chunk 1 of sessions 2 and 3 is a delta chunk on session 1's (11 shared tokens)
        ids = torch.cat([prefix, _ids(9 + 7 * i, 10 + i)], 1)
        sessions[store.put(model_cache(model, ids), tokens=ids)] = ids
    removed = store.gc(max_bytes=0)
    assert removed["cold_lm"] == removed["evicted"] > 0
    objs = _cold_objects(tmp_path)
    assert objs and all(p.read_bytes()[:4] == b"KVZL" for p in objs)
    heads = [int.from_bytes(p.read_bytes()[16:20], "little") for p in objs]  # m: tokens from a base
    assert sum(m > 0 for m in heads) == 2  # the two delta chunks stay deltas when cold
    assert all((p.stat().st_size - 52) % 4 == 0 for p in objs)
    store.gc(grace_seconds=0)  # what the sessions need stays; the cold chunks' pointers go
    assert store.stats()["entries"] == 0 and len(_cold_objects(tmp_path)) == len(objs)
    fresh = kvcodec.Store(tmp_path, model, chunk_tokens=16, granularity=4)
    for key, ids in sessions.items():
        assert torch.equal(fresh.tokens(key), ids)
        back = fresh.get(key, output="kvcache")
        ref = kvcodec.to_canonical(model_cache(model, ids))
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(back.keys, ref.keys))
    with pytest.raises(kvcodec.ConfigError, match="model="):
        kvcodec.Store(tmp_path, model_id="x", chunk_tokens=16).tokens(next(iter(sessions)))
    with pytest.raises(kvcodec.ModelMismatch):
        kvcodec.Store(tmp_path, tiny_model("qwen2"), chunk_tokens=16).tokens(next(iter(sessions)))


def test_a_cold_chunk_coded_by_other_numerics_or_damaged_is_refused(tmp_path, monkeypatch):
    model = tiny_model("llama")
    store = kvcodec.Store(tmp_path, model, chunk_tokens=16, granularity=4)
    ids = _ids(40, 5)
    key = store.put(model_cache(model, ids), tokens=ids)
    store.gc(max_bytes=0)
    from kvcodec import numerics

    real = numerics.profile
    monkeypatch.setattr(numerics, "profile", lambda m: {**real(m), "cpu_isa": "sse4_2"})
    with pytest.raises(kvcodec.NumericsMismatch, match="cpu_isa"):  # refused before decoding
        kvcodec.Store(tmp_path, model, chunk_tokens=16).tokens(key)
    monkeypatch.setattr(numerics, "profile", real)
    last = max(_cold_objects(tmp_path), key=lambda p: p.stat().st_size)
    good = last.read_bytes()
    last.write_bytes(good[:52] + bytes([good[52] ^ 0x40]) + good[53:])
    with pytest.raises(kvcodec.FormatError):  # the range coder or the key check refuses it
        kvcodec.Store(tmp_path, model, chunk_tokens=16).tokens(key)
    assert last.exists()  # not quarantined: another engine might be the cause
    last.write_bytes(good[:50])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(kvcodec.FormatError, match="52-byte"):
            kvcodec.Store(tmp_path, model, chunk_tokens=16).tokens(key)
    assert not last.exists()  # malformed: quarantined
    with pytest.raises(kvcodec.ConfigError, match="cold"):
        store.gc(max_bytes=0, cold="zstd")


def test_cold_ids_without_a_model_and_the_per_session_overhead(tmp_path):
    """cold="ids" keeps zstd-coded ids (any machine, no model).  A one-chunk session costs its 12-byte
    session object and its cold object's 52-byte head beyond its coded tokens: 64 bytes."""
    model = tiny_model("llama")
    store = kvcodec.Store(tmp_path, model, chunk_tokens=64)
    ids = _ids(40, 6)
    key = store.put(model_cache(model, ids), tokens=ids)
    assert store.gc(max_bytes=0, cold="ids")["cold_lm"] == 0
    assert _cold_objects(tmp_path)[0].read_bytes()[:8] == b"KVZIDS1\x00"
    assert torch.equal(kvcodec.Store(tmp_path, model_id="x", chunk_tokens=64).tokens(key), ids)
    store.put(model_cache(model, ids), tokens=ids)  # hot again
    store.gc(max_bytes=0)
    (obj,) = _cold_objects(tmp_path)
    raw = obj.read_bytes()
    assert raw[:4] == b"KVZL"
    (session,) = Path(tmp_path).rglob("*.kvs")
    from kvcodec.tokens.continuation import encode_continuation

    words, _ = encode_continuation(model, [], ids[0].numpy())
    assert raw[52:] == words.astype("<u4").tobytes()  # the code and nothing else after the head
    assert session.stat().st_size + len(raw) - 4 * words.size == 64


def test_an_entry_naming_a_chunk_elsewhere_is_a_miss_and_the_chunk_stays(tmp_path):
    """A prefix entry names a chunk; one that names a chunk of another position or parent (a damaged or
    hostile entry) is the entry's fault: a miss for the lookup, and the innocent chunk is not quarantined."""
    store = kvcodec.Store(tmp_path, model_id="test", chunk_tokens=16, granularity=4)
    prefix = _ids(20, 1)
    kv, ids = _session(prefix, _ids(8, 2))
    key = store.put(kv, tokens=ids)
    ns = key.split(":")[0]
    chain = store._manifest(key)[1]["chain"]
    query = torch.cat([prefix[:, :16], _ids(8, 9)], 1)  # chunk 0 stored; chunk 1 starts differently
    nsb = bytes.fromhex(ns)
    q = token_ids(query)
    directory = _path(store, K.entry_dir(ns, kvcodec.store.chunk_key(nsb, chain[0][0], q[16:20])))
    directory.mkdir(parents=True, exist_ok=True)
    (directory / K.entry_name(q[20:24], chain[0][0])).write_bytes(b"")  # names chunk 0, at position 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no quarantine warning
        n, _ = store.match(query, dtype=torch.bfloat16)
    assert n == 16 and store.stats()["quarantined"] == 0
    assert store.get(key, output="kvcache").equal(kv)


def test_chunks_of_other_shapes_under_one_name_are_a_format_error(tmp_path):
    """A store without a model trusts model_id=: caches of another shape put under the same id share the
    first chunk by its tokens; reading such a session is a FormatError naming the disagreement, never a torch
    error or a mixed cache."""
    store = kvcodec.Store(tmp_path, model_id="test", chunk_tokens=16, granularity=4)
    prefix = _ids(16, 1)
    store.put(*_session(prefix, _ids(4, 2), heads=2)[:1], tokens=torch.cat([prefix, _ids(4, 2)], 1))
    kv, ids = _session(prefix, _ids(6, 3), heads=4)
    key = store.put(kv, tokens=ids)
    with pytest.raises(kvcodec.FormatError, match="shape"):
        store.get(key)
    with pytest.raises(kvcodec.FormatError, match="shape"):
        list(store.layers(key))


def test_a_sessions_private_cold_chunks_fold_into_one_object(tmp_path):
    """Evicted with the model (and past the grace period), the chunks one session alone reaches are folded
    into one cold object - its last chunk's, naming the base of the first - so a private tail costs one
    52-byte head, not one per chunk.  Shared chunks and bases keep their own objects; every session still
    decodes (keys checked chunk by chunk) and recomputes, and gc keeps what they need."""
    model = tiny_model("llama")
    prefix = _ids(27, 1)
    tails = {"a": _ids(40, 2), "b": _ids(30, 3), "c": _ids(3, 4)}
    for grace, objects in ((3600, 9), (0, 5)):
        root = tmp_path / str(grace)
        store = kvcodec.Store(root, model, chunk_tokens=16, granularity=4)
        keys = {}
        for name, tail in tails.items():
            ids = torch.cat([prefix, tail], 1)
            keys[name] = (store.put(model_cache(model, ids), tokens=ids), ids)
            time.sleep(0.02)
        store.gc(max_bytes=0, grace_seconds=grace)
        # a: chunk 0 (shared), chunk 1 (the base of b's and c's chunk 1), chunks 2-4 (a's alone); b: chunk 1
        # (delta) to 3; c: chunk 1 (delta).  Folded: a's 2-4 into one object, b's 1-3 into one.
        assert len(_cold_objects(root)) == objects
        store.gc(grace_seconds=0)
        assert len(_cold_objects(root)) == objects  # nothing a session needs is collected
        fresh = kvcodec.Store(root, model, chunk_tokens=16, granularity=4)
        for key, ids in keys.values():
            assert torch.equal(fresh.tokens(key), ids)
        key, ids = keys["b"]
        back = fresh.get(key, output="kvcache")
        ref = kvcodec.to_canonical(model_cache(model, ids))
        assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(back.keys, ref.keys))
    heads = sorted(int.from_bytes(p.read_bytes()[12:16], "little") for p in _cold_objects(tmp_path / "0"))
    # token counts: chunk 0, a's chunk 1, c's chunk 1 (11 + 3), a's 2-4 folded (32 .. 67), b's 1-3 folded (16 .. 57)
    assert heads == sorted([16, 16, 11 + 3, 67 - 32, 57 - 16])


def test_hostile_cold_objects_cost_work_in_proportion_to_their_size(tmp_path):
    """A 56-byte model-coded object declaring 100,000 tokens under a session that declares as many: the
    reader stops once the stream's words are spent (FormatError naming the field), without allocating for
    the declared count; a session declaring more tokens than its chunks hold is refused by field."""
    model = tiny_model("llama")
    store = kvcodec.Store(tmp_path, model, chunk_tokens=16, granularity=4)
    ids = _ids(20, 5)
    key = store.put(model_cache(model, ids), tokens=ids)
    store.gc(max_bytes=0)
    ns = key.split(":")[0]
    real = next(p for p in _cold_objects(tmp_path) if p.stat().st_size > 52).read_bytes()
    fake = bytes(range(32))
    n = 100_000
    _path(store, K.cold_path(ns, fake)).parent.mkdir(parents=True, exist_ok=True)
    _path(store, K.cold_path(ns, fake)).write_bytes(real[:12] + n.to_bytes(4, "little") + bytes(4) + bytes(32)
                                                    + real[52:56])
    session = _path(store, K.session_path(ns, fake.hex()))
    session.parent.mkdir(parents=True, exist_ok=True)
    session.write_bytes(b"KVZSES1\x00" + n.to_bytes(4, "little"))
    with pytest.raises(kvcodec.FormatError, match="ran out|rejects") as e:
        store.tokens(f"{ns}:{fake.hex()}")
    assert e.value.field == "Cold.Words"
    _path(store, K.session_path(ns, key.split(":")[1])).write_bytes(b"KVZSES1\x00" + (10 ** 6).to_bytes(4, "little"))
    with pytest.raises(kvcodec.FormatError) as e:
        store.tokens(key)
    assert e.value.field in ("Session", "Cold.L")


def test_ids_the_model_cannot_code_are_evicted_with_zstd(tmp_path):
    """Token ids outside the model's vocabulary (tokens= is the caller's word) cannot be model-coded: the
    chunk is evicted with zstd-coded ids, with a warning, and its session stays readable."""
    model = tiny_model("llama")
    store = kvcodec.Store(tmp_path, model, chunk_tokens=16, granularity=4)
    kv, ids = _session(_ids(0, 1), _ids(20, 6))
    ids[0, 3] = VOCAB + 1000
    key = store.put(kv, tokens=ids)
    with pytest.warns(UserWarning, match="zstd"):
        removed = store.gc(max_bytes=0)
    assert removed["evicted"] == 2 and removed["cold_lm"] == 0  # chunk 1's context holds the id too
    assert [p.read_bytes()[:4] for p in _cold_objects(tmp_path)] == [b"KVZI", b"KVZI"]
    assert torch.equal(kvcodec.Store(tmp_path, model, chunk_tokens=16).tokens(key), ids)
