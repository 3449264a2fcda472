"""``kvz bench --store``: the store on an agent workload built from the corpus, with SmolLM2.

N sessions share a system prompt + tool schema (``--prefix-tokens`` of corpus text: the Python tutorial as
instructions, the ISO 3166 JSON as a tool schema), then each has its own conversation: a run of 32-256
tokens from a corpus file chosen at random (seeded); one session in five branches from an earlier session's
conversation (its first half, then its own). Every session's cache is computed the way a server would: the
prefix once, then the rest on top of a copy of it.

Reported, for N in ``--sessions`` (default 10 and 100), all measured in one run:

* bytes stored by the store (lossless chunks; lossy chunks at 3 bits) against (a) one independent ``.kvz``
  per session in the same tier, (b) LMCache-style raw chunks (256 positions, chained hashes, bf16 bytes,
  partial last chunks included), and (c) the ideal: the prefix's cache once plus every session's own
  positions, each coded in the same tier on its own;
* put / get / match latency (median and p99) on a local directory and on an S3-compatible server on
  loopback (moto, through s3fs);
* the cold tier (for N up to ``--cold-sessions``): every chunk evicted with its token ids coded by the model
  given the tokens before them (``gc(max_bytes=0)``), against the ideal token stream (the prefix's ids coded
  once, each session's own ids coded after its prefix), the overhead per session beyond its coded tokens,
  and the time to evict and to restore a cold session;
* time to a usable cache for a stored 2,048-token prefix: ``match`` (decode) against recomputing it.
"""

from __future__ import annotations

import copy
import random
import statistics
import tempfile
import time

import torch

from .common import corpus_files, missing_corpus, write_report


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def _sessions(tok, files, n_sessions: int, prefix_tokens: int, seed: int):
    """(prefix ids [1, P], [tail ids [1, L_i]]): the tails are conversations, some branching."""
    texts = {p.name: p.read_text(encoding="utf-8", errors="replace") for p in files}
    instr = texts.get("techdoc_en_python_tutorial_controlflow.rst", next(iter(texts.values())))
    schema = texts.get("data_iso_3166-1.json", "")
    system = "System: you are a helpful assistant. Follow these notes:\n" + instr[:6000] + "\nTools:\n" + schema
    prefix = tok(system, return_tensors="pt").input_ids[:, :prefix_tokens]
    pools = [tok(t, return_tensors="pt").input_ids[0] for name, t in sorted(texts.items())]
    rng = random.Random(seed)
    tails = []
    for i in range(n_sessions):
        pool = rng.choice(pools)
        n = rng.randint(32, 256)
        a = rng.randrange(0, max(1, pool.numel() - n))
        own = pool[a:a + n]
        if tails and rng.random() < 0.2:  # branch from an earlier conversation
            base = rng.choice(tails)[0]
            own = torch.cat([base[:base.numel() // 2], own[:n // 2]])
        tails.append(own[None])
    return prefix, tails


@torch.no_grad()
def _caches(model, prefix, tails):
    from ..cache import to_canonical
    from ..tokens.plan import cache_kwarg, output_cache

    base = output_cache(model(prefix, use_cache=True))
    out = []
    for tail in tails:
        c = copy.deepcopy(base)
        model(tail, use_cache=True, **{cache_kwarg(model): c})
        out.append((torch.cat([prefix, tail], 1), to_canonical(c)))
    return to_canonical(base), out


def _lmcache_raw_bytes(sessions, chunk: int, per_token: int) -> int:
    """Unique 256-position chunks (chained SHA-256 of the token ids), raw bf16 bytes."""
    import hashlib

    seen, total = set(), 0
    for ids, _ in sessions:
        parent = b""
        t = ids[0].numpy().astype("<u4")
        for a in range(0, t.size, chunk):
            parent = hashlib.sha256(parent + t[a:a + chunk].tobytes()).digest()
            if parent not in seen:
                seen.add(parent)
                total += (min(t.size, a + chunk) - a) * per_token
    return total


def _tree_bytes(fs, root) -> dict:
    """Bytes per kind of object.  ``total``: what the sessions cost (chunks, prefix entries - empty objects -,
    session objects, namespace records and numerics profiles); the collection lease and records (``gc/``: the
    last 256 collections' condemned sets, whatever the sessions) are counted apart."""
    out = {"chunks": 0, "entries": 0, "sessions": 0, "namespace": 0, "collection": 0, "objects": 0}
    root = str(root).rstrip("/")
    for p, info in fs.find(root, detail=True).items():
        rel = p.removeprefix(root)
        kind = "collection" if rel.startswith("/gc/") else "chunks" if "/chunks/" in rel else "entries" \
            if "/entries/" in rel else "sessions" if "/sessions/" in rel else "namespace"
        out[kind] += int(info.get("size", 0))
        out["objects"] += 1
    out["total"] = sum(out[k] for k in ("chunks", "entries", "sessions", "namespace"))
    return out


def _cold_tier(model, prefix, sessions) -> dict:
    """Every chunk evicted to model-coded token ids, against the ideal token stream."""
    from pathlib import Path

    import fsspec

    from ..store import Store
    from ..tokens.continuation import CONTEXT_TOKENS, encode_continuation

    with tempfile.TemporaryDirectory() as d:
        store = Store(d, model, chunk_tokens=256, granularity=16)
        keys = [store.put(kv, tokens=ids) for ids, kv in sessions]
        hot = _tree_bytes(fsspec.filesystem("file"), d)["total"]
        t = time.perf_counter()
        removed = store.gc(max_bytes=0, cold="lm", grace_seconds=0)  # nothing else writes: fold at once
        evict_s = time.perf_counter() - t
        store.gc(grace_seconds=0)  # the cold chunks' prefix entries
        stored = _tree_bytes(fsspec.filesystem("file"), d)
        heads, words = 0, 0
        for p in Path(d).rglob("*.ids"):
            raw = p.read_bytes()
            assert raw[:4] == b"KVZL", "bench: every evicted chunk is model-coded"
            heads, words = heads + 52, words + len(raw) - 52
        t = time.perf_counter()
        back = Store(d, model).tokens(keys[-1])  # a fresh store object: nothing remembered
        tokens_s = time.perf_counter() - t
        assert torch.equal(back, sessions[-1][0])
        t = time.perf_counter()
        Store(d, model).get(keys[-1])
        get_s = time.perf_counter() - t
    # the ideal: the prefix's ids coded once, each session's own ids after its prefix (same coder, no objects)
    p = prefix.shape[1]
    ideal_words = encode_continuation(model, [], prefix[0].numpy())[0].size
    for ids, _ in sessions:
        t = ids[0].numpy()
        ideal_words += encode_continuation(model, t[max(0, p - CONTEXT_TOKENS):p], t[p:])[0].size
    n = len(sessions)
    own_tokens = sum(ids.shape[1] - p for ids, _ in sessions)
    return {"hot_bytes": hot, "cold_bytes": stored, "evicted": removed["evicted"], "evict_s": round(evict_s, 1),
            "coded_bytes": words, "heads_bytes": heads, "ideal_token_stream_bytes": 4 * ideal_words,
            "cold_vs_ideal": round(stored["total"] / (4 * ideal_words), 3),
            "coded_vs_ideal": round(words / (4 * ideal_words), 3),
            "overhead_per_session_bytes": round((stored["total"] - words - stored["namespace"]) / n, 1),
            "bits_per_token_all": round(8 * stored["total"] / (p + own_tokens), 2),
            "ideal_bits_per_token": round(32 * ideal_words / (p + own_tokens), 2),
            "hot_vs_cold": round(hot / stored["total"], 1),
            "restore_tokens_s": round(tokens_s, 1), "restore_get_s": round(get_s, 1),
            "restored_tokens": int(sessions[-1][0].shape[1]), "namespace_and_profile_bytes": stored["namespace"],
            "per_session_token_stream_bytes_mean": round(4 * ideal_words / n, 1),
            "cold_objects_per_session": round(heads / 52 / n, 2)}


def _time_store(store, sessions, model, dtype, limit: int) -> dict:
    put, get, match = [], [], []
    keys = []
    for ids, kv in sessions[:limit]:
        t = time.perf_counter()
        keys.append(store.put(kv, tokens=ids))
        put.append(time.perf_counter() - t)
    for (ids, _), key in zip(sessions[:limit], keys):
        t = time.perf_counter()
        store.get(key)
        get.append(time.perf_counter() - t)
        t = time.perf_counter()
        store.match(ids, dtype=dtype)
        match.append(time.perf_counter() - t)
    return {f"{name}_{q}_ms": round(1e3 * (statistics.median(xs) if q == "p50" else _pct(xs, 0.99)), 2)
            for name, xs in (("put", put), ("get", get), ("match", match)) for q in ("p50", "p99")}


def run_store_bench(args) -> int:
    import fsspec

    from ..api import encode
    from ..cache import KVCache
    from ..models import load_model
    from ..store import Store

    files = corpus_files(args.corpus)
    if not files:
        return missing_corpus("kvz bench --store")
    model, tok = load_model("smollm2", dtype=torch.bfloat16)
    torch.manual_seed(0)
    if args.cold_only:  # the cold tier alone (the hot tiers' numbers do not change with it)
        res = {"model": "smollm2 bf16", "prefix_tokens": args.prefix_tokens, "chunk_tokens": 256, "cases": []}
        for n in args.sessions:
            prefix, tails = _sessions(tok, files, n, args.prefix_tokens, seed=n)
            _, sessions = _caches(model, prefix, tails)
            res["cases"].append({"sessions": n, "cold": _cold_tier(model, prefix, sessions)})
            print(f"N={n} cold: {res['cases'][-1]['cold']}", flush=True)
        write_report(args.out, "bench_store_cold", res, "\n".join(_cold_markdown(res["cases"])) + "\n")
        return 0
    if args.lean:
        res = {"model": "smollm2 bf16", "prefix_tokens": args.prefix_tokens, "chunk_tokens": 256, "granularity": 16,
               "tier": "lossless", "cases": [run_lean(args, model, tok, files, n) for n in args.sessions]}
        mib = 1 << 20
        lines = ["# Store benchmark, lean (`kvz bench --store --lean`)", "",
                 "| sessions | positions | store | ideal | store / ideal | one .kvz per session (sampled) | "
                 "LMCache-style raw | chunks | put p50 / p99 |", "|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for c in res["cases"]:
            lines.append(f"| {c['sessions']} | {c['tokens']:,} | {c['store_bytes']['total'] / mib:,.1f} MiB | "
                         f"{c['ideal_bytes'] / mib:,.1f} MiB | {c['store_vs_ideal']} | "
                         f"{c['independent_kvz_bytes_estimated'] / mib:,.0f} MiB ({c['independent_vs_store']}x, "
                         f"{c['independent_sample']}) | {c['lmcache_raw_chunk_bytes'] / mib:,.0f} MiB "
                         f"({c['lmcache_raw_vs_store']}x) | {c['chunks']} | {c['put_p50_ms']} / {c['put_p99_ms']} ms |")
        write_report(args.out, "bench_store_lean", res, "\n".join(lines) + "\n")
        return 0
    results = {"model": "smollm2 bf16", "prefix_tokens": args.prefix_tokens, "chunk_tokens": 256,
               "granularity": 16, "torch_threads": torch.get_num_threads(), "cases": []}
    lines = ["# Store benchmark (`kvz bench --store`)", "",
             f"SmolLM2-135M bf16, a shared prefix of {args.prefix_tokens} tokens (system prompt + tool schema from "
             "the corpus), per-session conversations of 32-256 tokens from the corpus, one in five branching from "
             "an earlier one; chunks of 256 positions, prefix entries every 16.", ""]
    per_token = None
    for n_sessions in args.sessions:
        t0 = time.perf_counter()
        prefix, tails = _sessions(tok, files, n_sessions, args.prefix_tokens, seed=n_sessions)
        prefix_kv, sessions = _caches(model, prefix, tails)
        per_token = prefix_kv.nbytes() // prefix_kv.seq_len
        case = {"sessions": n_sessions, "tokens": int(sum(ids.shape[1] for ids, _ in sessions)),
                "raw_bytes": int(sum(kv.nbytes() for _, kv in sessions)),
                "compute_s": round(time.perf_counter() - t0, 1)}
        case["lmcache_raw_chunk_bytes"] = _lmcache_raw_bytes(sessions, 256, per_token)
        for tier, opts in (("lossless", {}), ("lossy", {"bits": 3.0})):
            with tempfile.TemporaryDirectory() as d:
                store = Store(d, chunk_tokens=256, granularity=16, tier=tier, model_id="smollm2", **opts)
                t = time.perf_counter()
                for ids, kv in sessions:
                    store.put(kv, tokens=ids)
                put_s = time.perf_counter() - t
                stored = _tree_bytes(fsspec.filesystem("file"), d)
            indep = sum(len(encode(kv, tier=tier, **opts)) for _, kv in sessions)
            p = prefix.shape[1]
            ideal = len(encode(prefix_kv, tier=tier, **opts)) + sum(
                len(encode(KVCache([k[:, :, p:] for k in kv.keys], [v[:, :, p:] for v in kv.values],
                                   start_position=p), tier=tier, **opts)) for _, kv in sessions)
            case[tier] = {"store_bytes": stored, "independent_kvz_bytes": indep, "ideal_bytes": ideal,
                          "store_vs_ideal": round(stored["total"] / ideal, 4),
                          "independent_vs_store": round(indep / stored["total"], 2),
                          "lmcache_raw_vs_store": round(case["lmcache_raw_chunk_bytes"] / stored["total"], 2),
                          "put_all_s": round(put_s, 2)}
            print(f"N={n_sessions} {tier}: store {stored['total']:,} B, ideal {ideal:,} B "
                  f"({stored['total'] / ideal:.4f}x), independent {indep:,} B, LMCache raw "
                  f"{case['lmcache_raw_chunk_bytes']:,} B", flush=True)
        man = case["lossless"]["store_bytes"]["sessions"]
        case["cold_manifest_bytes_per_session"] = round(man / n_sessions, 1)
        if n_sessions <= args.cold_sessions:
            case["cold"] = _cold_tier(model, prefix, sessions)
            print(f"N={n_sessions} cold: {case['cold']}", flush=True)
        with tempfile.TemporaryDirectory() as d:
            case["local_latency"] = _time_store(Store(d, chunk_tokens=256, model_id="smollm2"), sessions, model,
                                                torch.bfloat16,
                                                min(20, n_sessions))
        case["s3_latency"] = _s3_latency(sessions[:min(10, n_sessions)])
        results["cases"].append(case)
    results["restore_2048"] = _restore_vs_recompute(model, tok, files)
    lines += _markdown(results)
    write_report(args.out, "bench_store", results, "\n".join(lines) + "\n")
    return 0


@torch.no_grad()
def run_lean(args, model, tok, files, n_sessions: int) -> dict:
    """N sessions (lossless), one at a time: never more than one session's cache in memory, so N = 1,000 fits
    (their caches together would take ~26 GB).  Independent ``.kvz`` files are measured on every
    ``--sample``-th session and scaled (said so in the report); the ideal and LMCache-style raw chunks on all."""
    import fsspec

    from ..api import encode
    from ..cache import KVCache, to_canonical
    from ..store import Store
    from ..tokens.plan import cache_kwarg, output_cache

    prefix, tails = _sessions(tok, files, n_sessions, args.prefix_tokens, seed=n_sessions)
    p = prefix.shape[1]
    base = output_cache(model(prefix, use_cache=True))
    prefix_kv = to_canonical(base)
    per_token = prefix_kv.nbytes() // p
    ideal = len(encode(prefix_kv, tier="lossless"))
    indep_sampled, sampled, puts, t0 = 0, 0, [], time.perf_counter()
    ids_all = []
    with tempfile.TemporaryDirectory() as d:
        store = Store(d, chunk_tokens=256, granularity=16, model_id="smollm2")
        for i, tail in enumerate(tails):
            c = copy.deepcopy(base)
            model(tail, use_cache=True, **{cache_kwarg(model): c})
            ids, kv = torch.cat([prefix, tail], 1), to_canonical(c)
            t = time.perf_counter()
            store.put(kv, tokens=ids)
            puts.append(time.perf_counter() - t)
            ideal += len(encode(KVCache([k[:, :, p:] for k in kv.keys], [v[:, :, p:] for v in kv.values],
                                        start_position=p), tier="lossless"))
            if i % args.sample == 0:
                indep_sampled += len(encode(kv, tier="lossless"))
                sampled += 1
            ids_all.append((ids, None))
            del c, kv
            if (i + 1) % 50 == 0:
                print(f"  {i + 1}/{n_sessions} sessions, {time.perf_counter() - t0:.0f} s", flush=True)
        stored = _tree_bytes(fsspec.filesystem("file"), d)
        st = store.stats()
    indep = indep_sampled * n_sessions / sampled
    lm = _lmcache_raw_bytes(ids_all, 256, per_token)
    return {"sessions": n_sessions, "tokens": int(sum(x.shape[1] for x, _ in ids_all)), "store_bytes": stored,
            "ideal_bytes": ideal, "store_vs_ideal": round(stored["total"] / ideal, 4),
            "independent_kvz_bytes_estimated": int(indep), "independent_sample": f"1 in {args.sample}",
            "independent_vs_store": round(indep / stored["total"], 2), "lmcache_raw_chunk_bytes": lm,
            "lmcache_raw_vs_store": round(lm / stored["total"], 2), "chunks": st["chunks"],
            "entries": st["entries"], "session_object_bytes_per_session": stored["sessions"] / n_sessions,
            "put_p50_ms": round(1e3 * statistics.median(puts), 1), "put_p99_ms": round(1e3 * _pct(puts, 0.99), 1),
            "wall_s": round(time.perf_counter() - t0, 1)}


def _s3_latency(sessions) -> dict | str:
    try:
        import s3fs
        from moto.server import ThreadedMotoServer
    except ImportError as e:
        return f"not run: {e}"
    from ..store import Store

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    try:
        host, port = server.get_host_and_port()
        opts = {"key": "bench", "secret": "bench", "client_kwargs": {"endpoint_url": f"http://{host}:{port}"}}
        s3fs.S3FileSystem(**opts).mkdir("kvz-bench")
        store = Store("s3://kvz-bench/store", storage_options=opts, chunk_tokens=256, model_id="smollm2")
        return _time_store(store, sessions, None, torch.bfloat16, len(sessions))
    finally:
        server.stop()


@torch.no_grad()
def _restore_vs_recompute(model, tok, files) -> dict:
    """A stored 2,048-token prefix: match() (decode, lossless) against recomputing it (one prefill)."""
    from ..store import Store
    from ..tokens.plan import output_cache

    text = "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files)
    ids = tok(text, return_tensors="pt").input_ids[:, :2048]
    with tempfile.TemporaryDirectory() as d:
        store = Store(d, chunk_tokens=256, model_id="smollm2")
        store.put(output_cache(model(ids, use_cache=True)), tokens=ids)
        restore, recompute = [], []
        for _ in range(3):
            t = time.perf_counter()
            n, _ = store.match(ids, dtype=torch.bfloat16)
            restore.append(time.perf_counter() - t)
            t = time.perf_counter()
            model(ids, use_cache=True)
            recompute.append(time.perf_counter() - t)
    r, c = statistics.median(restore), statistics.median(recompute)
    return {"tokens": int(ids.shape[1]), "matched": int(n), "restore_s": round(r, 3), "recompute_s": round(c, 3),
            "speedup": round(c / r, 1)}


def _markdown(results) -> list[str]:
    out = ["| sessions | tier | store | ideal (prefix once + own positions) | store / ideal | independent .kvz | "
           "LMCache-style raw chunks | put all |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
    mib = 1 << 20
    for c in results["cases"]:
        for tier in ("lossless", "lossy"):
            d = c[tier]
            out.append(f"| {c['sessions']} | {tier}{' 3 bits' if tier == 'lossy' else ''} | "
                       f"{d['store_bytes']['total'] / mib:,.1f} MiB | {d['ideal_bytes'] / mib:,.1f} MiB | "
                       f"{d['store_vs_ideal']:.4f} | {d['independent_kvz_bytes'] / mib:,.1f} MiB "
                       f"({d['independent_vs_store']}x) | {c['lmcache_raw_chunk_bytes'] / mib:,.1f} MiB "
                       f"({d['lmcache_raw_vs_store']}x) | {d['put_all_s']} s |")
    out += ["", "| sessions | where | put p50 / p99 | get p50 / p99 | match p50 / p99 |",
            "|---:|---|---|---|---|"]
    for c in results["cases"]:
        for where in ("local", "s3"):
            lat = c[f"{where}_latency"]
            if isinstance(lat, str):
                out.append(f"| {c['sessions']} | {where} | {lat} | | |")
                continue
            out.append(f"| {c['sessions']} | {'local disk' if where == 'local' else 'S3 (moto, loopback)'} | "
                       f"{lat['put_p50_ms']} / {lat['put_p99_ms']} ms | {lat['get_p50_ms']} / {lat['get_p99_ms']} ms"
                       f" | {lat['match_p50_ms']} / {lat['match_p99_ms']} ms |")
    out += _cold_markdown(results["cases"])
    r = results["restore_2048"]
    out += ["", f"Restoring a stored {r['tokens']}-token prefix (lossless, `match`): {r['restore_s']} s; recomputing "
            f"it (one prefill): {r['recompute_s']} s: **{r['speedup']}x** (medians of 3)."]
    return out



def _cold_markdown(cases) -> list[str]:
    cold = [c for c in cases if "cold" in c]
    if not cold:
        return []
    out = ["", "Cold tier (every chunk evicted, token ids coded with the model given the tokens before them):", "",
           "| sessions | hot store | cold store | ideal token stream (prefix once + own ids) | cold / ideal | "
           "coded ids / ideal | overhead per session beyond coded ids | cold objects per session | bits per position "
           "| evict all | restore one session: ids / get |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in cold:
        d = c["cold"]
        out.append(f"| {c['sessions']} | {d['hot_bytes'] / (1 << 20):,.1f} MiB | {d['cold_bytes']['total']:,} B | "
                   f"{d['ideal_token_stream_bytes']:,} B | {d['cold_vs_ideal']} | {d['coded_vs_ideal']} | "
                   f"{d['overhead_per_session_bytes']} B | {d['cold_objects_per_session']} | "
                   f"{d['bits_per_token_all']} (ideal {d['ideal_bits_per_token']}) | {d['evict_s']} s | "
                   f"{d['restore_tokens_s']} / {d['restore_get_s']} s ({d['restored_tokens']} tokens) |")
    return out
