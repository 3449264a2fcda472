"""``kvz bench --restore``: how fast a cache comes back, per tier, against reading it raw and recomputing it.

For each corpus text and dtype: SmolLM2's KV cache of the first ``--tokens`` tokens (one prefill), written
to a temporary folder once per tier (lossless; lossy at 2 and 3 bits per component; exact; tokens), as a raw
safetensors file, and as that raw file compressed by zstd -3.  Then, side by side in one process, the wall
time from the file on disk to a ``DynamicCache`` the model takes as ``past_key_values``:

* ``kvcodec.load(path, model)`` for each tier, with one thread and with every core (the token tiers with the
  static token model; ``--lm`` adds the exact tier with the model-coded token channel, minutes per restore);
  lossless and lossy 2 bits also with ``into=`` a cache kept from an earlier restore (written in place: no
  new memory, as the memcpy row);
* ``safetensors.torch.load_file`` + the same conversion, and zstd -3 decompression + the same conversion;
* recomputing the cache from its token ids with one prefill (the token ids are assumed known: the cheapest
  recompute there is);
* with ``--peers``, the peer packages' decoders on the same cache (:func:`peer_rows`).

The rows of one thread count are timed round by round (each once per round), so their ratios are measured under
the same load.  The direct tiers' rows also time the encoder (the cache to ``.kvz`` bytes, same thread count). Quantizer
``weighted`` and its predictors are calibrated on the cache's own text (128 and ``--tokens`` tokens): these
rows measure speed, not quality (``kvz bench --lossy`` calibrates on other texts).

The files are read from the page cache (they were just written; dropping it needs root): these are times of
the decoders, not of the disk.  Before each timed call, untimed, the process touches and frees fresh memory of
three times the cache's raw size (:func:`~.common.touch_fresh_memory`), so each call's new memory is memory the
system has just handed out, whatever ran before it: on a virtual machine whose host takes back its guest's free
memory, the first touch of memory left free for seconds (after a recompute row) costs ~15x more, which landed on
whichever row came next (``--memory-as-found`` measures without it; ``scripts/studies/first_touch.py``).  Each
time is the median of ``--repeats`` runs after one warm-up run (Numba compilation, allocator).  Besides the
times, each row reports the restored cache's megabytes per second (its raw bytes over the time), and a
``memcpy`` row: copying those raw bytes once with NumPy, the ceiling of any decoder; and, for each file, the
storage speeds below which its restore beats reading the raw file and above which it beats recomputing, had its
bytes come from storage instead of the page cache (:func:`storage_speeds`: a model of the measured times).
Results: ``OUT/bench_restore.json``, ``OUT/bench_restore.md`` and ``OUT/bench_restore.svg`` (:mod:`kvcodec.lab.plots`).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import zstandard

from .common import interleaved_medians, median_time, missing_corpus, touch_fresh_memory, write_report
from .plots import restore_plot

DEFAULT_GENRES = ["prose_en_austen_pride_and_prejudice.txt"]

#: (row name, encode keyword arguments) of the .kvz files measured
TIERS = [
    ("lossless", {"tier": "lossless"}),
    ("lossy 3 bits", {"tier": "lossy", "bits": 3.0}),
    ("lossy 2 bits", {"tier": "lossy", "bits": 2.0}),
    ("lossy 2 bits, weighted", {"tier": "lossy", "bits": 2.0, "quantizer": "weighted", "profile": True}),
    ("lossy 2 bits, weighted + predictors", {"tier": "lossy", "bits": 2.0, "quantizer": "weighted", "profile": True,
                                             "predictors": True}),
    ("exact", {"tier": "exact", "token_model": "static"}),
    ("tokens", {"tier": "tokens", "token_model": "static", "tolerance": None}),
]
#: the tiers also restored into the tensors of a cache kept from an earlier restore (``kvcodec.decode(into=)``)
INTO_ROWS = ("lossless", "lossy 2 bits")
#: the token tiers with the model-coded token channel (``--lm``): restoring decodes one token per model step,
#: about the time of an incremental pass over the text (BENCHMARKS.md, "Times"), so 2,048 tokens take minutes
LM_TIERS = [
    ("exact, lm token model", {"tier": "exact", "token_model": "lm"}),
]


def _set_threads(n: int) -> None:
    torch.set_num_threads(n)
    os.environ["KVCODEC_THREADS"] = str(n)


def _raw_tensors(kv) -> dict:
    out = {}
    for i, (k, v) in enumerate(zip(kv.keys, kv.values)):
        out[f"k{i}"], out[f"v{i}"] = k.contiguous(), v.contiguous()
    return out


def _from_tensors(tensors: dict, n_layers: int, model):
    from ..cache import KVCache

    kv = KVCache([tensors[f"k{i}"] for i in range(n_layers)], [tensors[f"v{i}"] for i in range(n_layers)])
    return kv.to_dynamic_cache(model=model)


def restore_rows(model, ids, kv, folder: Path, repeats: int, thread_counts: list[int], lm: bool = False,
                 peers: list | None = None, prime: bool = True) -> list[dict]:
    """Rows of one cache (see the module docstring); ``peers``: also their decoders (:func:`peer_rows`);
    ``prime``: touch fresh memory before each timed call (untimed)."""
    tiers = TIERS + (LM_TIERS if lm else [])
    import safetensors.torch

    from .. import api
    from ..cache import to_canonical
    from ..tokens.plan import output_cache

    n_layers = len(kv.keys)
    raw = kv.nbytes()
    rows = []

    pending = []  # the rows of one thread count, timed together by run_pending()

    def add(name, path, fn, threads, check=None):
        _set_threads(threads)
        out = fn()  # warm-up: Numba compilation, first-touch allocations
        if check is not None:
            check(out)
        del out
        pending.append((name, path, fn, threads))

    def run_pending():
        """Time the pending rows round by round (each once per round): their ratios are measured under the same
        load, which on a shared machine drifts by tens of percent within a minute."""
        if not pending:
            return
        _set_threads(pending[0][3])
        fns = {i: fn for i, (_, _, fn, _) in enumerate(pending)}
        times = interleaved_medians(fns, repeats, before=(lambda: touch_fresh_memory(3 * raw)) if prime else None)
        for i, (name, path, _, threads) in enumerate(pending):
            rows.append({"method": name, "threads": threads, "bytes": path.stat().st_size if path else None,
                         "restore_s": times[i], "mb_s": raw / times[i] / 1e6})
        pending.clear()

    def same_as(ref):
        def check(out):
            back = to_canonical(out)
            assert all(torch.equal(a, b) for a, b in zip(back.keys + back.values, ref.keys + ref.values)), "round trip"
        return check

    same = same_as(kv)
    calibrated = {}

    def resolve(opts: dict) -> dict:
        """Encoder options with ``profile`` / ``predictors`` calibrated once (on this cache's own tokens)."""
        if not (opts.get("profile") or opts.get("predictors")):
            return opts
        if not calibrated:
            from ..calibrate import calibrate
            from ..predict import calibrate_predictors

            calibrated["profile"] = calibrate(model, ids[:, :128])
            calibrated["predictors"] = calibrate_predictors(model, [ids], profile=calibrated["profile"])
        return {**opts, **{k: calibrated[k] for k in ("profile", "predictors") if opts.get(k)}}

    st_path = folder / "cache.safetensors"
    safetensors.torch.save_file(_raw_tensors(kv), str(st_path))
    zst_path = folder / "cache.safetensors.zst"
    zst_path.write_bytes(zstandard.ZstdCompressor(level=3).compress(st_path.read_bytes()))

    def write_files(threads):
        # A token tier regenerates the cache with this machine's float results, which depend on torch's thread
        # count (and the lm token model refuses another count): its files are written per thread count, from
        # the cache a prefill with that count makes (what a user restoring on the machine that made it has)
        _set_threads(threads)
        with torch.no_grad():
            own = to_canonical(output_cache(model(ids, use_cache=True)))
        out = {}
        for name, opts in tiers:
            needs_model = opts["tier"] in ("exact", "tokens")
            p = folder / f"{name.replace(' ', '_').replace(',', '')}{f'_{threads}' if needs_model else ''}.kvz"
            if not p.exists():
                api.save(p, own if needs_model else kv, model if needs_model else None, tokens=ids,
                         **({"schedule": "prefill"} if needs_model else {}), **resolve(opts))
            out[name] = (p, own if needs_model else kv, opts["tier"] != "tokens" and "lossy" not in name,
                         None if needs_model else resolve(opts))
        return out
    # one memcpy of the raw bytes: the ceiling of any decoder
    src = np.frombuffer(st_path.read_bytes(), dtype=np.uint8)
    dst = np.empty_like(src)
    t, _ = median_time(lambda: np.copyto(dst, src), repeats)
    rows.append({"method": "memcpy of the raw bytes", "threads": 1, "bytes": None, "restore_s": t,
                 "mb_s": raw / t / 1e6})
    for threads in thread_counts:
        # read, not mapped: safetensors.torch.load_file maps the file and defers the reads to first use (4 ms for
        # 47 MB here), which would time nothing; the bytes read and turned into tensors are what a restore costs
        add("raw safetensors", st_path,
            lambda: _from_tensors(safetensors.torch.load(st_path.read_bytes()), n_layers, model), threads, same)

        def from_zst():
            data = zstandard.ZstdDecompressor().decompress(zst_path.read_bytes())
            return _from_tensors(safetensors.torch.load(data), n_layers, model)

        add("raw safetensors, zstd -3", zst_path, from_zst, threads, same)
        files = write_files(threads)
        pred = calibrated.get("predictors")
        encoders = {}
        for name, (p, ref, exact, enc) in files.items():
            add(f"kvz {name}", p,
                lambda p=p, threads=threads, pred=pred: api.load(p, model, threads=threads, predictors=pred),
                threads, same_as(ref) if exact else None)
            if enc is not None:  # the encoder of a direct tier, same thread count (timed after the restores)
                encoders[f"kvz {name}"] = enc
            if name in INTO_ROWS:  # into the tensors of a cache kept from an earlier restore (no new memory)
                buf = api.load(p, model, threads=threads, predictors=pred, output="kvcache")
                add(f"kvz {name}, into a kept cache", p,
                    lambda p=p, threads=threads, buf=buf: api.load(p, model, threads=threads, into=buf),
                    threads, same_as(ref) if exact else None)

        def recompute():  # the cheapest recompute: the cache, and the logits of the last position only
            with torch.no_grad():
                return output_cache(model(ids, use_cache=True, logits_to_keep=1))

        add("recompute (one prefill)", None, recompute, threads)
        run_pending()
        for row in rows:
            enc = encoders.get(row["method"]) if row["threads"] == threads else None
            if enc is not None:
                _set_threads(threads)
                row["encode_s"], _ = median_time(lambda enc=enc: api.encode(kv, tokens=ids, threads=threads, **enc),
                                                 repeats)
        if peers is not None:
            rows += peer_rows(peers, kv, folder, threads, repeats)
    _set_threads(os.cpu_count() or 1)
    return rows


#: the peers whose decoders ``--peers`` times (``scripts/peers/dequant.py``)
DECODE_PEERS = ["quanto", "hqq", "turboquant", "fused-turboquant"]


def peer_rows(peers, kv, folder: Path, threads: int, repeats: int) -> list[dict]:
    """The peers' decoders alone on the same cache, each in its own venv (``scripts/peers/dequant.py``): the
    whole cache's dequantization from their in-memory quantized form (no file read, no cache object), torch on
    ``threads`` threads.  A peer that is not set up or fails gets a row saying why."""
    import json
    import subprocess

    from safetensors.torch import save_file

    from .bench_lossy import PEER_SCRIPTS, PEER_VENV, peers_root

    script = PEER_SCRIPTS / "dequant.py"
    src = folder / "peers_in.safetensors"
    if not src.exists():
        save_file({**{f"keys.{i}": k.float().contiguous() for i, k in enumerate(kv.keys)},
                   **{f"values.{i}": v.float().contiguous() for i, v in enumerate(kv.values)}}, str(src))
    raw = kv.nbytes()
    rows = []
    for peer in peers or DECODE_PEERS:
        py = peers_root() / PEER_VENV.get(peer, peer) / "bin" / "python"
        base = {"method": f"peer {peer}", "threads": threads, "bytes": None}
        if not py.exists():
            rows.append({**base, "error": f"not set up: scripts/peers/setup.sh {peer}"})
            continue
        proc = subprocess.run([str(py), str(script), peer, str(src), str(threads), str(repeats)],
                              capture_output=True, text=True, timeout=3600)
        lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
        if proc.returncode or not lines:
            rows.append({**base, "error": (proc.stderr or proc.stdout).strip()[-300:]})
        for r in lines:
            row = {**base, "method": f"peer decode: {r['config']}", "version": r["version"]}
            if "error" in r:
                rows.append({**row, "error": r["error"]})
                continue
            rows.append({**row, "restore_s": r["seconds"], "mb_s": raw / r["seconds"] / 1e6,
                         "peer_output_dtype": r["dtype"]})
        print(f"peer {peer} ({threads} threads): " + ", ".join(
            f"{r['config']} {1e3 * r['seconds']:.0f} ms" if "seconds" in r else f"{r['config']} failed"
            for r in lines), flush=True)
    return rows


def to_markdown(results: dict) -> str:
    lines = [f"Command: `{results['command']}`", "",
             f"Machine: {results['machine']}; torch {results['torch']}, numba {results['numba']}; "
             f"{results['cpus']} CPUs. Medians of {results['repeats']} runs; files in the page cache; "
             + ("fresh memory touched (untimed) before each timed call." if results.get("fresh_memory_touched")
                else "memory as found (no touch of fresh memory before the timed calls)."), ""]
    for case in results["cases"]:
        lines += [f"### {case['text']} - {case['dtype']}, {case['tokens']} tokens, "
                  f"{case['raw_bytes'] / 2**20:.2f} MiB raw", "",
                  "| method | threads | file bytes | restore ms | MB/s of cache | × raw safetensors | "
                  "× recompute | encode ms | faster than raw from storage below (MB/s) | faster than recompute "
                  "from storage above (MB/s) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in case["rows"]:
            if "error" in r:
                lines.append(f"| {r['method']} | {r['threads']} | - | failed: {r['error'][:80]} | | | | | | |")
                continue
            enc = f"{1e3 * r['encode_s']:.0f}" if r.get("encode_s") else "-"
            lines.append(f"| {r['method']} | {r['threads']} | {r['bytes'] if r['bytes'] else '-'} | "
                         f"{1e3 * r['restore_s']:.1f} | {r['mb_s']:.0f} | {_x(r.get('vs_raw'))} | "
                         f"{_x(r.get('vs_recompute'))} | {enc} | {_speed(r.get('beats_raw_below_mb_s'))} | "
                         f"{_speed(r.get('beats_recompute_above_mb_s'))} |")
        lines.append("")
    lines.append("× raw safetensors, × recompute: that row's time over theirs at the same thread count "
                 "(below 1: faster).")
    lines += ["", "From storage: the files above were read from the page cache. Read from storage delivering B MB/s "
              "instead, a restore takes its time here plus its file's bytes / B (reading not overlapped with "
              "decoding, as in every row): \"faster than raw below\" is the B under which that restore beats reading "
              "the raw safetensors file (any: at every speed; none: its file is not smaller), \"faster than "
              "recompute above\" the B over which it beats the prefill (none: its restore alone is slower). A "
              "model of the measured times, not a measurement of a disk."]
    if any(r["method"].startswith("peer") for c in results["cases"] for r in c["rows"]):
        lines += ["", "Peer rows (`--peers`, scripts/peers/dequant.py in each peer's venv): the peer's decoder alone "
                  "on the same cache (its dequantization of every layer from its in-memory quantized form, float32 "
                  "output; no file read, no cache object), MB/s of the cache's raw bytes as in every other row."]
    return "\n".join(lines) + "\n"


def _x(v):
    return "-" if v is None else f"{v:.2f}"


def _speed(v) -> str:
    """A speed in MB/s as the table shows it: whole numbers from 10, two significant digits below."""
    return "-" if v is None else v if isinstance(v, str) else f"{v:,.0f}" if v >= 10 else f"{v:.2g}"


def storage_speeds(row: dict, raw: dict | None, recompute: dict | None) -> dict:
    """Where a file's restore stands once its bytes come from storage of ``B`` bytes a second instead of the
    page cache, modelled as the measured restore plus ``file bytes / B`` (reading not overlapped with decoding,
    as in every row here), in MB/s: ``beats_raw_below_mb_s``, the speed below which this restore is faster than
    the raw safetensors file's (``"any"``: at any speed, its time and its bytes both smaller; ``"none"``: its
    file is not smaller), and ``beats_recompute_above_mb_s``, the speed above which it is faster than
    recomputing (``"none"``: its restore alone is slower).  Only for rows with a file (``bytes``)."""
    out: dict = {}
    n, t = row.get("bytes"), row.get("restore_s")
    if not n or t is None:
        return out
    if raw is not None and raw is not row and raw.get("bytes"):
        saved, extra = raw["bytes"] - n, t - raw["restore_s"]
        out["beats_raw_below_mb_s"] = "none" if saved <= 0 else "any" if extra <= 0 else saved / extra / 1e6
    if recompute is not None:
        spare = recompute["restore_s"] - t
        out["beats_recompute_above_mb_s"] = n / spare / 1e6 if spare > 0 else "none"
    return out


def run_restore_bench(args) -> int:
    from .common import corpus_caches, corpus_dir, machine_info

    cdir = corpus_dir(args.corpus)
    if cdir is None:
        return missing_corpus("kvz bench --restore")
    genres = args.genres or DEFAULT_GENRES
    tokens = args.tokens or 2048
    repeats = args.repeats or 3
    thread_counts = sorted({1, os.cpu_count() or 1})
    results = {"command": f"kvz bench --restore --tokens {tokens} --repeats {repeats} --dtypes "
                          + " ".join(args.dtypes) + (" --lm" if args.lm else "")
                          + ("" if args.peers is None else " ".join([" --peers"] + args.peers))
                          + (" --memory-as-found" if args.memory_as_found else ""),
               **machine_info(), "repeats": repeats, "fresh_memory_touched": not args.memory_as_found, "cases": []}
    for dname, g, m, ids, kv in corpus_caches(cdir, genres, args.dtypes, tokens):
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="kvz-restore-") as d:
            rows = restore_rows(m, ids, kv, Path(d), repeats, thread_counts, args.lm, args.peers,
                                not args.memory_as_found)
        for r in rows:
            base = {n: next((x for x in rows if x["method"] == n and x["threads"] == r["threads"]), None)
                    for n in ("raw safetensors", "recompute (one prefill)")}
            if base["raw safetensors"]:
                r["vs_raw"] = r["restore_s"] / base["raw safetensors"]["restore_s"]
            if base["recompute (one prefill)"]:
                r["vs_recompute"] = r["restore_s"] / base["recompute (one prefill)"]["restore_s"]
            r.update(storage_speeds(r, base["raw safetensors"], base["recompute (one prefill)"]))
        results["cases"].append({"text": g, "dtype": dname, "tokens": int(ids.shape[1]),
                                 "raw_bytes": kv.nbytes(), "rows": rows})
        one = {r["method"]: r for r in rows if r["threads"] == 1}
        print(f"{g} {dname}: " + ", ".join(f"{k} {1e3 * v['restore_s']:.0f} ms" for k, v in one.items())
              + f" [{time.perf_counter() - t0:.0f} s]", flush=True)
    out = write_report(args.out, "bench_restore", results, to_markdown(results))
    restore_plot(results, out / "bench_restore.svg")
    return 0
