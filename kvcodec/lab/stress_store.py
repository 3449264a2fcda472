"""A randomized stress test of :class:`kvcodec.Store` with an oracle: does any acknowledged session get lost?

Processes, each a fresh Python (``python -m kvcodec.lab.stress_store ROLE CONFIG``), on one store - a local
directory or an S3-compatible server on loopback (moto, started here, through s3fs as a user would):

* **workers** put sessions (sharing prefixes with each other and branching off each other at random tokens,
  across workers), get and match them (every tensor returned is compared bit for bit with what the session
  holds), and delete some of their own;
* **collectors** run ``gc`` in a loop - with and without a byte budget (eviction to model-coded or zstd ids,
  folding), grace 0 or 1 s - optionally two at once (the second is told the store is busy), optionally one
  whose clock runs two hours ahead;
* a **reader** checks acknowledged sessions while all this runs.

The controller SIGKILLs a random process every ``kill_every`` seconds (a worker, a collector or the reader)
and starts another.  Every process appends to its own log, one line per event, before and after each
operation: ``begin``/``ack`` of puts and deletes.  The oracle, at the end (everything killed, then one more
collection): every session whose put was acknowledged and that was not deleted (no delete of it begun) is
listed and reads back - its token ids exactly, its positions bit for bit up to its first evicted chunk, the
rest recomputed by the model -; every session whose delete was acknowledged (and never put again) is gone.
The tensors of a session are a fixed function of its token ids and positions (the test's own, no model), so
the oracle needs nothing the store wrote.

``kvz bench --store-stress --seconds N`` runs it as long as asked and reports operations, kills, collections
and losses.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

VOCAB, LAYERS, HEADS, DIM = 128, 2, 2, 16
CHUNK, STEP = 16, 4
SETTLE = ("records_read", "waits", "chunks_rewritten", "entries_rewritten")


# -- what sessions hold: a function of their ids alone ----------------------------------------------------------
def _roots():
    rng = np.random.default_rng(12345)
    return [rng.integers(0, VOCAB, 70) for _ in range(3)]


_ROOTS = None
_MEMO: dict[int, np.ndarray] = {}


def session_tokens(sid: int) -> np.ndarray:
    """Session ``sid``'s token ids: a cut of one of three shared roots, or of another session (a branch, of a
    session of any worker), then a tail of its own (so no two sessions have the same ids)."""
    global _ROOTS
    if sid in _MEMO:
        return _MEMO[sid]
    if _ROOTS is None:
        _ROOTS = _roots()
    rng = np.random.default_rng([sid, 7])
    if sid % 1000 and rng.random() < 0.5:  # a branch off an earlier session of the same thousand
        src = session_tokens(sid - 1 - int(rng.integers(0, sid % 1000)))
    else:
        src = _ROOTS[int(rng.integers(0, len(_ROOTS)))]
    cut = int(rng.integers(0, src.size + 1))
    tail = np.concatenate([rng.integers(0, VOCAB, int(rng.integers(1, 30))), [sid % VOCAB, (sid // VOCAB) % VOCAB,
                                                                             (sid // VOCAB ** 2) % VOCAB]])
    out = np.concatenate([src[:cut], tail]).astype(np.int64)
    _MEMO[sid] = out
    return out


_TABLE = None


def session_cache(ids: np.ndarray):
    """The cache a session holds: position i of layer l a fixed function of (token i, i) - equal prefixes give
    equal tensors, as a model's cache would."""
    import torch

    from ..cache import KVCache

    global _TABLE
    if _TABLE is None:
        g = torch.Generator().manual_seed(99)
        _TABLE = torch.randn(VOCAB, LAYERS, 2, HEADS, DIM, generator=g)
    t = torch.from_numpy(ids)
    pos = torch.arange(len(ids), dtype=torch.float32)[:, None, None, None, None] * 1e-3
    x = _TABLE[t] + pos  # [n, layers, 2, heads, dim]
    keys = [x[:, i, 0].permute(1, 0, 2)[None].contiguous() for i in range(LAYERS)]
    values = [x[:, i, 1].permute(1, 0, 2)[None].contiguous() for i in range(LAYERS)]
    return KVCache(keys, values)


def tiny_model():
    """The namespace's model (for model-coded cold chunks and recomputing evicted positions): a small random
    Llama, the same weights in every process."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HEADS * DIM, intermediate_size=64, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=HEADS, head_dim=DIM,
                      max_position_embeddings=4096)
    return LlamaForCausalLM(cfg).eval()


def open_store(cfg: dict, model=None):
    from .. import Store

    return Store(cfg["url"], model, storage_options=cfg.get("storage_options"), chunk_tokens=CHUNK,
                 granularity=STEP, route="decode", lease_seconds=cfg.get("lease_seconds", 10.0))


class Log:
    def __init__(self, path: str):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def __call__(self, *parts) -> None:
        os.write(self.fd, (" ".join(str(p) for p in (time.time_ns(), *parts)) + "\n").encode())


# -- roles ---------------------------------------------------------------------------------------------------------
def check_session(store, key: str, ids: np.ndarray) -> str | None:
    """None when the session reads back as it must (module docstring), else what is wrong.  The positions the
    get read from the store must be bit for bit the session's (those it recomputed because a collection had
    evicted them are the model's: not compared)."""
    import torch

    got = store.get(key, output="kvcache")
    if not np.array_equal(got.tokens[0].numpy(), ids):
        return "other token ids"
    if got.seq_len != ids.size:
        return f"{got.seq_len} positions, not {ids.size}"
    hot = got.stored_positions  # what this get read from the store: the rest was recomputed by the model
    want = session_cache(ids)
    for a, b in zip(got.keys + got.values, want.keys + want.values):
        if not torch.equal(a[:, :, :hot], b[:, :, :hot]):
            return f"other tensors in its first {hot} (hot) positions"
    return None


def worker(cfg: dict, log: Log) -> None:
    import torch

    torch.set_num_threads(1)
    model = tiny_model()
    store = open_store(cfg, model)
    rng = random.Random(cfg["seed"])
    base, count, mine = cfg["spawn"] * 1000, 0, []
    while True:
        r = rng.random()
        try:
            if r < 0.5 or not mine:
                sid = base + count
                count = (count + 1) % 1000
                ids = session_tokens(sid)
                log("begin", "put", sid)
                before = dict(store.settle_stats)
                key = store.put(session_cache(ids), tokens=ids)
                log("ack", "put", sid, key, *(store.settle_stats[k] - before[k] for k in SETTLE))
                mine.append((sid, key))
            elif r < 0.65:
                sid, key = mine.pop(rng.randrange(len(mine)))
                log("begin", "del", sid, key)
                store.delete(key)
                log("ack", "del", sid, key)
            elif r < 0.82:
                sid, key = rng.choice(mine)
                why = check_session(store, key, session_tokens(sid))
                log("get", sid, key, "ok" if why is None else f"WRONG {why}")
            else:
                sid, key = rng.choice(mine)
                ids = session_tokens(sid)
                q = np.concatenate([ids[:rng.randrange(ids.size + 1)], [rng.randrange(VOCAB) for _ in range(5)]])
                n, cache = store.match(q, output="kvcache")
                ok = n == 0 or all(torch.equal(a, b[:, :, :n]) for a, b in zip(
                    cache.keys + cache.values, session_cache(q[:n]).keys + session_cache(q[:n]).values))
                log("match", sid, n, "ok" if ok else "WRONG tensors")
        except Exception as e:  # noqa: BLE001 - every exception is a finding the report lists
            where = " <- ".join(f"{f.name}:{f.lineno}" for f in reversed(traceback.extract_tb(e.__traceback__)[-6:]))
            log("error", type(e).__name__, repr(str(e))[:300].replace("\n", " "), "at", where.replace(" ", ""))


def collector(cfg: dict, log: Log) -> None:
    import torch

    torch.set_num_threads(1)
    if cfg.get("skew"):  # this collector's clock runs ahead of the store's by more than any grace
        real = time.time
        time.time = lambda: real() + cfg["skew"]
    model = tiny_model()
    store = open_store(cfg, model)
    rng = random.Random(cfg["seed"])
    from ..errors import StoreBusy

    while True:
        budget = rng.choice([None, None, 0, 60_000])
        cold = rng.choice(["auto", "ids"])
        grace = rng.choice([0, 0, 1])
        log("begin", "gc", budget, cold, grace)
        try:
            removed = store.gc(grace_seconds=grace, max_bytes=budget, cold=cold)
            log("ack", "gc", json.dumps(removed, separators=(",", ":")))
        except StoreBusy:
            log("busy")
        except Exception as e:  # noqa: BLE001
            log("error", type(e).__name__, repr(str(e))[:300].replace("\n", " "))
        time.sleep(rng.uniform(0, cfg.get("gc_pause", 0.5)))


def reader(cfg: dict, log: Log) -> None:
    import torch

    torch.set_num_threads(1)
    model = tiny_model()
    store = open_store(cfg, model)
    rng = random.Random(cfg["seed"])
    while True:
        events = read_logs(cfg["log_dir"])
        live = [(sid, key) for sid, (key, st) in events["sessions"].items() if st == "acked"]
        if not live:
            time.sleep(0.2)
            continue
        sid, key = rng.choice(live)
        try:
            why = check_session(store, key, session_tokens(sid))
        except Exception as e:  # noqa: BLE001
            why = f"{type(e).__name__}: {str(e)[:200]}"
        if why is not None:  # a delete of it may have begun meanwhile: then it is no finding
            again = read_logs(cfg["log_dir"])["sessions"].get(sid, (key, "acked"))
            if again[1] == "acked":
                time.sleep(1.0)  # read again: a session that reads back now was not lost, but its read failed
                try:
                    second = check_session(store, key, session_tokens(sid))
                except Exception as e:  # noqa: BLE001
                    second = f"{type(e).__name__}: {str(e)[:200]}"
                kind = "LOST-DURING" if second is not None else "TRANSIENT"
                log(kind, sid, key, repr(why).replace("\n", " "))
                continue
        log("checked", sid, "ok" if why is None else "deleted-meanwhile")


# -- the oracle ----------------------------------------------------------------------------------------------------
def read_logs(log_dir: str) -> dict:
    """Every process's events, merged: per session its key and state (``acked``: put acknowledged and no delete
    begun; ``deleting``: a delete begun, not acknowledged; ``deleted``), and counts."""
    lines = []
    for p in Path(log_dir).glob("*.log"):
        for line in p.read_text().splitlines():
            parts = line.split(" ")
            if len(parts) >= 2 and parts[0].isdigit():
                lines.append((int(parts[0]), p.stem, parts[1:]))
    lines.sort(key=lambda x: x[0])
    sessions: dict[int, tuple[str, str]] = {}
    counts = {"puts": 0, "deletes": 0, "gets": 0, "matches": 0, "collections": 0, "evicting_collections": 0,
              "busy": 0, "errors": 0, "wrong": 0, "lost_during": 0, "transient_reads": 0, "checks": 0,
              **{f"settle_{k}": 0 for k in SETTLE}, "puts_that_settled": 0}
    errors, wrong, transient = [], [], []
    for _t, who, ev in lines:
        kind = ev[0]
        if kind == "ack" and ev[1] == "put":
            sessions[int(ev[2])] = (ev[3], "acked")
            counts["puts"] += 1
            work = [int(x) for x in ev[4:4 + len(SETTLE)]]
            for k, v in zip(SETTLE, work):
                counts[f"settle_{k}"] += v
            counts["puts_that_settled"] += any(work[1:])
        elif kind == "begin" and ev[1] == "del":
            sessions[int(ev[2])] = (ev[3], "deleting")
        elif kind == "ack" and ev[1] == "del":
            sessions[int(ev[2])] = (ev[3], "deleted")
            counts["deletes"] += 1
        elif kind == "ack" and ev[1] == "gc":
            counts["collections"] += 1
            counts["evicting_collections"] += '"evicted"' in ev[2] and '"evicted":0' not in ev[2]
        elif kind == "busy":
            counts["busy"] += 1
        elif kind == "get":
            counts["gets"] += 1
        elif kind == "match":
            counts["matches"] += 1
        elif kind == "checked":
            counts["checks"] += 1
        elif kind == "error":
            counts["errors"] += 1
            errors.append(f"{who}: {' '.join(ev[1:])}")
        elif kind == "LOST-DURING":
            counts["lost_during"] += 1
            wrong.append(f"{who}: {' '.join(ev)}")
        elif kind == "TRANSIENT":  # an acknowledged session's read failed, and the next one a second later read it
            counts["transient_reads"] += 1
            transient.append(f"{who}: {' '.join(ev)}")
        if kind in ("get", "match") and any(p.startswith("WRONG") for p in ev):
            counts["wrong"] += 1
            wrong.append(f"{who}: {' '.join(ev)}")
    return {"sessions": sessions, "counts": counts, "errors": errors, "wrong": wrong, "transient": transient}


def final_check(cfg: dict, events: dict) -> dict:
    """Everything stopped: one more collection, then every acknowledged session must read back, every deleted
    one must be gone."""
    import torch

    torch.set_num_threads(1)
    store = open_store(cfg, tiny_model())
    final_gc = store.gc(grace_seconds=0, wait=120)
    listed = set(store.sessions())
    lost, resurrected, checked = [], [], 0
    for sid, (key, state) in sorted(events["sessions"].items()):
        if state == "acked":
            checked += 1
            try:
                why = None if key in listed else "not listed"
                why = why or check_session(store, key, session_tokens(sid))
            except Exception as e:  # noqa: BLE001
                why = f"{type(e).__name__}: {str(e)[:200]}"
            if why is not None:
                lost.append(f"session {sid} {key[:24]}…: {why}")
        elif state == "deleted" and key in listed and not any(
                k == key and st != "deleted" for k, st in events["sessions"].values()):
            resurrected.append(f"session {sid} {key[:24]}…")  # (no other session has its ids: tails are unique)
    return {"final_gc": final_gc, "checked": checked, "lost": lost, "resurrected": resurrected}


# -- the controller ------------------------------------------------------------------------------------------------
def _moto_server():
    """An S3-compatible server on loopback (moto) whose conditional PUTs are atomic, as S3's are (moto checks
    ``If-None-Match`` / ``If-Match`` and then writes, in two steps that two requests may interleave)."""
    import threading

    from moto.s3 import responses
    from moto.server import ThreadedMotoServer

    lock = threading.Lock()
    real = responses.S3Response.put_object
    if not getattr(real, "_kvz_atomic", False):
        def put_object(self, *a, **kw):
            with lock:
                return real(self, *a, **kw)
        put_object._kvz_atomic = True
        responses.S3Response.put_object = put_object
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, {"key": "stress", "secret": "stress", "client_kwargs": {"endpoint_url": f"http://{host}:{port}"}}


def run_stress(*, seconds: float, where: str = "disk", workers: int = 3, collectors: int = 1, skew: float = 0.0,
               kill_every: tuple[float, float] = (1.0, 6.0), seed: int = 0, root: str | None = None,
               progress=None, until: dict | None = None, max_seconds: float | None = None) -> dict:
    """Run the stress test for ``seconds`` (module docstring) and return the report.  ``until``: minimum
    counts (of :func:`read_logs`: ``puts``, ``collections``, ``busy``...) the run must reach - it goes on past
    ``seconds`` until they are, up to ``max_seconds`` (a slow or loaded machine does less per second)."""
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    rng = random.Random(seed)
    tmp = tempfile.mkdtemp(prefix="kvz-stress-", dir=root)
    log_dir = os.path.join(tmp, "logs")
    os.makedirs(log_dir)
    server = None
    cfg = {"log_dir": log_dir, "lease_seconds": 10.0}
    if where == "s3":
        server, opts = _moto_server()
        import s3fs

        with contextlib.suppress(FileExistsError):  # (moto's state is the process's: a second run finds it)
            s3fs.S3FileSystem(**opts).mkdir("kvz-stress")
        cfg.update(url=f"s3://kvz-stress/store-{seed}", storage_options=opts)
    else:
        cfg["url"] = os.path.join(tmp, "store")
    roles = ["worker"] * workers + ["collector"] * collectors + ["reader"]
    procs: dict[int, tuple[str, subprocess.Popen]] = {}
    spawn = [0]

    def start(slot: int, role: str) -> None:
        spawn[0] += 1
        c = {**cfg, "spawn": spawn[0], "seed": rng.randrange(1 << 30),
             "skew": skew if role == "collector" and slot == len(roles) - 2 else 0.0}
        log = os.path.join(log_dir, f"{role}-{spawn[0]}.log")
        with open(log + ".err", "w") as err:  # the child keeps its own descriptor
            procs[slot] = (role, subprocess.Popen([sys.executable, "-m", "kvcodec.lab.stress_store", role,
                                                   json.dumps(c), log], stdout=subprocess.DEVNULL, stderr=err))

    t0 = time.monotonic()
    kills = {"worker": 0, "collector": 0, "reader": 0}
    try:
        for slot, role in enumerate(roles):
            start(slot, role)
        next_kill = t0 + 5 + rng.uniform(*kill_every)  # the first processes import and warm up first
        checked_at = 0.0

        def more() -> bool:
            nonlocal checked_at
            elapsed = time.monotonic() - t0
            if elapsed < seconds:
                return True
            if not until or elapsed >= (max_seconds or seconds):
                return False
            if elapsed - checked_at < 2.0:
                return True
            checked_at = elapsed
            counts = read_logs(log_dir)["counts"]
            return any(counts.get(k, 0) < v for k, v in until.items())

        while more():
            time.sleep(0.05)
            for slot, (role, p) in list(procs.items()):
                if p.poll() is not None:  # died by itself: a finding (its .err says why), and replaced
                    kills.setdefault("crashed", 0)
                    kills["crashed"] += 1
                    start(slot, role)
            if time.monotonic() >= next_kill:
                slot = rng.choice([s for s, (r, _) in procs.items() if r != "reader"] * 4 + [len(roles) - 1])
                role, p = procs[slot]
                p.send_signal(signal.SIGKILL)
                p.wait()
                kills[role] += 1
                start(slot, role)
                next_kill = time.monotonic() + rng.uniform(*kill_every)
            if progress:
                progress(time.monotonic() - t0)
    finally:
        for _role, p in procs.values():
            p.kill()
            p.wait()
    crashed = kills.pop("crashed", 0)
    events = read_logs(log_dir)
    final = final_check(cfg, events)
    stderr = [Path(p).read_text()[-2000:] for p in Path(log_dir).glob("*.err") if Path(p).stat().st_size]
    report = {
        "where": where, "seconds": round(time.monotonic() - t0, 1), "workers": workers, "collectors": collectors,
        "skew_seconds": skew, **events["counts"], "kills": sum(kills.values()), "kills_by_role": kills,
        "crashed": crashed, "acknowledged_live": final["checked"], "lost": len(final["lost"]) + events["counts"][
            "lost_during"], "lost_final": final["lost"][:20], "resurrected": final["resurrected"][:20],
        "wrong_reads": events["wrong"][:20], "transient_lines": events["transient"][:20],
        "error_lines": events["errors"][:20], "stderr": [s for s in stderr if
                                                                                        "Traceback" in s][:5],
        "final_gc": final["final_gc"], "log_dir": log_dir,
    }
    if server is not None:
        server.stop()
    return report


def run_stress_bench(args) -> int:
    """``kvz bench --store-stress``: :func:`run_stress` on a directory and/or S3 for ``--seconds`` each; a
    report per backend (bench_store_stress.json / .md).  Exit status 1 when anything was lost."""
    import platform

    from .common import write_report

    where = ["disk", "s3"] if args.where == "both" else [args.where]
    runs = []
    for w in where:
        print(f"store stress on {w} for {args.seconds:.0f} s ...", flush=True)
        r = run_stress(seconds=args.seconds, where=w, collectors=args.collectors, skew=args.skew,
                       kill_every=tuple(args.kill_every), seed=int(time.time()) % 100000)
        runs.append(r)
        print(f"  {w}: {r['puts']} acknowledged puts, {r['deletes']} deletes, {r['gets'] + r['matches']} reads, "
              f"{r['collections']} collections ({r['busy']} refused: busy), {r['kills']} kills, "
              f"{r['puts_that_settled']} puts rewrote what a collection removed, lost {r['lost']}", flush=True)
    res = {"command": "kvz bench " + " ".join(getattr(args, "argv", [])), "date": time.strftime("%Y-%m-%d %H:%M"),
           "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "runs": runs}
    lines = ["# Store stress test (`kvz bench --store-stress`)", "",
             f"{res['date']}, {res['machine']}; `{res['command']}`", "",
             ("| where | seconds | acknowledged puts | deletes | gets + matches | collections (evicting) | busy | "
             "kills | puts that settled | acknowledged sessions checked at the end | lost | wrong reads | errors |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        lines.append(f"| {r['where']} | {r['seconds']:.0f} | {r['puts']} | {r['deletes']} | {r['gets'] + r['matches']} "
                     f"| {r['collections']} ({r['evicting_collections']}) | {r['busy']} | {r['kills']} | "
                     f"{r['puts_that_settled']} | {r['acknowledged_live']} | **{r['lost']}** | {r['wrong']} | "
                     f"{r['errors']} |")
    lines += ["", (f"{args.collectors} collectors at once (one with its clock {args.skew:.0f} s ahead), 3 workers, a "
              "reader; SIGKILL of a random process every 1-6 s. 'Puts that settled': puts that found a collection "
              "had condemned what they needed and wrote it back before returning (spec/store.md §7).")]
    for r in runs:
        for k in ("lost_final", "resurrected", "wrong_reads", "transient_lines", "error_lines"):
            if r[k]:
                lines += ["", f"{r['where']} {k}:", *[f"- {x}" for x in r[k]]]
    write_report(args.out, "bench_store_stress", res, "\n".join(lines) + "\n")
    return 1 if any(r["lost"] or r["resurrected"] or r["wrong"] for r in runs) else 0


def main(argv: list[str]) -> None:
    role, cfg, log_path = argv[0], json.loads(argv[1]), argv[2]
    log = Log(log_path)
    log("start", role, os.getpid())
    try:
        {"worker": worker, "collector": collector, "reader": reader}[role](cfg, log)
    except Exception:
        log("error", "crash", repr(traceback.format_exc()[-500:]).replace("\n", " "))
        raise


if __name__ == "__main__":
    main(sys.argv[1:])
