"""``kvz bench``: sizes and speeds of the lossless tier against zstd, on real caches.

For each corpus text and dtype: SmolLM2's KV cache of the first ``--tokens``
tokens (one prefill), then, side by side in one process,

* raw bytes; for 16-bit dtypes the order-0 entropy of the words (a bound for
  any coder that sees the words one at a time, without context);
* zstd -3 and zstd -19 on the raw bytes, and zstd -3 on byte-grouped planes
  (all high bytes, then all next bytes ...), the usual float trick;
* kvz lossless with one thread and with every core.

Speeds are raw (uncompressed) megabytes per second, the median of
``--repeats`` runs (zstd -19 encode: one run).  zstd's decode is timed in two
forms, ``decompress()`` (a new ``bytes``) and into a new NumPy block of the raw
size (the output kvz's decoder makes: one allocation, which the system maps in
large pages where it can), and its faster median is the one compared; zstd -3's
decodes and kvz's alternate round by round, so their ratio is measured under
the same load.  Peak memory is the tracemalloc
peak of one separate, untimed run (NumPy buffers are traced; the cache tensors
themselves are not counted).  Results: ``OUT/bench.json`` and ``OUT/bench.md``.
"""

from __future__ import annotations

import os
import time
import tracemalloc

import numpy as np
import torch
import zstandard

from .common import interleaved_medians, median_time, missing_corpus, write_report

DEFAULT_GENRES = [
    "prose_en_austen_pride_and_prejudice.txt",
    "code_python_textwrap.py",
    "data_iso_3166-1.json",
    "nonen_zh_debian_reference_ch1.txt",
]


def _peak(fn) -> float:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


def _raw_bytes(kv) -> bytes:
    return b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in kv.keys + kv.values)


def _entropy0(raw: bytes, width: int) -> float:
    words = np.frombuffer(raw, dtype={2: np.uint16, 4: np.uint32}[width])
    _, counts = np.unique(words, return_counts=True)
    p = counts / counts.sum()
    return float(-(p * np.log2(p)).sum())


def _byte_grouped(raw: bytes, width: int) -> bytes:
    return np.frombuffer(raw, dtype=np.uint8).reshape(-1, width).T.copy().tobytes()


def _zstd_block(dctx, z: bytes, n: int) -> np.ndarray:
    """zstd's decode of frame ``z`` (``n`` bytes) into a new NumPy block."""
    out = np.empty(n, dtype=np.uint8)
    mv, got = memoryview(out), 0
    with dctx.stream_reader(z) as r:
        while got < n:
            k = r.readinto(mv[got:])
            if not k:
                raise ValueError("zstd frame shorter than the raw bytes")
            got += k
        if r.read(1):
            raise ValueError("zstd frame longer than the raw bytes")
    return out


def _zstd_forms(dctx, z: bytes, raw: bytes) -> dict:
    """zstd's two decode forms of frame ``z`` of ``raw``, for :func:`interleaved_medians` (checked first)."""
    n = len(raw)
    if _zstd_block(dctx, z, n).tobytes() != raw or dctx.decompress(z) != raw:
        raise RuntimeError("zstd round trip failed")
    return {"bytes": lambda: dctx.decompress(z), "block": lambda: _zstd_block(dctx, z, n)}


def _zstd_row(method: str, z: bytes, enc_s: float, times: dict) -> dict:
    """A zstd row: ``dec_s`` the faster decode form, both forms recorded (``times``: their medians)."""
    return {"method": method, "bytes": len(z), "enc_s": enc_s, "dec_s": min(times["bytes"], times["block"]),
            "dec_s_bytes": times["bytes"], "dec_s_block": times["block"]}


def bench_cache(kv, repeats: int, zstd19: bool) -> list[dict]:
    from .. import api

    raw = _raw_bytes(kv)
    n = len(raw)
    width = kv.keys[0].element_size()
    rows = [{"method": "raw", "bytes": n}]
    if width == 2:  # for 32-bit words the empirical entropy of 2**32 symbols from ~2**24 samples means nothing
        bound = int(_entropy0(raw, width) * n / width / 8)
        rows.append({"method": "order-0 entropy of the 16-bit words", "bytes": bound})
    cctx, dctx = zstandard.ZstdCompressor(level=3), zstandard.ZstdDecompressor()
    te3, z = median_time(lambda: cctx.compress(raw), repeats)
    z3 = {"method": "zstd -3", "peak_enc_mib": _peak(lambda: cctx.compress(raw)),
          "peak_dec_mib": _peak(lambda: dctx.decompress(z))}
    rows.append(z3)  # filled below: its decode is timed interleaved with kvz's
    if zstd19:
        c19 = zstandard.ZstdCompressor(level=19)
        te, z19 = median_time(lambda: c19.compress(raw), 1)
        rows.append(_zstd_row("zstd -19", z19, te, interleaved_medians(_zstd_forms(dctx, z19, raw), repeats)))
    te, zg = median_time(lambda: cctx.compress(_byte_grouped(raw, width)), repeats)  # the grouping included
    grouped = _zstd_forms(dctx, zg, _byte_grouped(raw, width))
    rows.append(_zstd_row("zstd -3, byte-grouped", zg, te, interleaved_medians(grouped, repeats)))
    from ..entropy import rans

    encoded = {}
    for threads in thread_counts():
        api.decode(api.encode(kv, threads=threads), output="kvcache", threads=threads)  # JIT warm-up
        rans.ENCODE_SYMBOLS.clear()
        te, data = median_time(lambda: api.encode(kv, threads=threads), repeats)
        encoded[threads] = (te, data, dict(rans.ENCODE_SYMBOLS))
    # the decodes, zstd -3's two forms and kvz's at every thread count, interleaved round by round
    rans.KERNEL_SYMBOLS.clear()
    dec = interleaved_medians({**_zstd_forms(dctx, z, raw), **{
        threads: (lambda data=data, threads=threads: api.decode(data, output="kvcache", threads=threads))
        for threads, (_, data, _) in encoded.items()}}, repeats)
    kernels = dict(rans.KERNEL_SYMBOLS)
    z3.update(_zstd_row("zstd -3", z, te3, dec))
    for threads, (te, data, enc_kernels) in encoded.items():
        td = dec[threads]
        if not api.decode(data, output="kvcache", threads=threads).equal(kv):
            raise RuntimeError("lossless round trip failed")
        rows.append({"method": f"kvz lossless, {threads} thread{'s' if threads > 1 else ''}", "bytes": len(data),
                     "enc_s": te, "dec_s": td, "threads": threads,
                     "kernel": ", ".join(sorted(kernels, key=kernels.get, reverse=True)),
                     "enc_kernel": ", ".join(sorted(enc_kernels, key=enc_kernels.get, reverse=True)),
                     "msym_s": n / width / td / 1e6,
                     "peak_enc_mib": _peak(lambda: api.encode(kv, threads=threads)),
                     "peak_dec_mib": _peak(lambda: api.decode(data, output="kvcache", threads=threads))})
    for r in rows:
        r["ratio"] = n / r["bytes"]
        r["bits_per_component"] = 8 * r["bytes"] / (n / width)
        if "enc_s" in r:
            r["enc_mb_s"] = n / r["enc_s"] / 1e6
            r["dec_mb_s"] = n / r["dec_s"] / 1e6
    return rows


def thread_counts() -> list[int]:
    """1, 2, 4 ... up to the CPU count, and the CPU count: the scaling rows (16 cores: 1, 2, 4, 8, 16)."""
    cpus = os.cpu_count() or 1
    return sorted({1 << i for i in range(cpus.bit_length()) if 1 << i <= cpus} | {cpus})


def _fmt(x, spec):
    return format(x, spec) if x is not None else "-"


def to_markdown(results: dict) -> str:
    lines = [f"Command: `{results['command']}`", "",
             f"Machine: {results['machine']}; torch {results['torch']}, numba {results['numba']}, "
             f"zstandard {results['zstandard']}; {results['cpus']} CPUs.", ""]
    for case in results["cases"]:
        lines.append(f"### {case['text']} - {case['dtype']}, {case['tokens']} tokens, "
                     f"{case['raw_bytes'] / 2**20:.2f} MiB raw")
        lines.append("")
        lines.append("| method | bytes | ratio | bits/comp | enc MB/s | dec MB/s (zstd: decompress() / into a block) "
                     "| dec Msym/s (kernels used) | peak enc MiB | peak dec MiB |")
        lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in case["rows"]:
            kern = f"{r['msym_s']:.0f} ({r['kernel']}; encoder {r['enc_kernel']})" if "kernel" in r else "-"
            dec = _fmt(r.get("dec_mb_s"), ".0f")
            if "dec_s_bytes" in r:
                n = r["dec_mb_s"] * r["dec_s"]  # MB
                dec = f"{dec} ({n / r['dec_s_bytes']:.0f} / {n / r['dec_s_block']:.0f})"
            lines.append(f"| {r['method']} | {r['bytes']} | {r['ratio']:.3f} | {r['bits_per_component']:.2f} | "
                         f"{_fmt(r.get('enc_mb_s'), '.0f')} | {dec} | {kern} | "
                         f"{_fmt(r.get('peak_enc_mib'), '.1f')} | {_fmt(r.get('peak_dec_mib'), '.1f')} |")
        lines.append("")
    lines.append(summary(results))
    return "\n".join(lines) + "\n"


def summary(results: dict) -> str:
    out = ["### Summary (geometric means over texts)", "",
           "| dtype | zstd -3 | zstd -19 | byte-grouped zstd -3 | kvz lossless | kvz dec / zstd-3 dec (1 thread) | "
           "kvz dec / zstd-3 decompress() (1 thread) | kvz dec / zstd-3 dec (all threads) | kvz enc MB/s (1 thread) | "
           "kvz dec MB/s (1 thread) | zstd -3 dec MB/s |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for dtype in sorted({c["dtype"] for c in results["cases"]}):
        cases = [c for c in results["cases"] if c["dtype"] == dtype]

        def gm(method, key="ratio"):
            vals = [r[key] for c in cases for r in c["rows"] if r["method"] == method]
            return float(np.exp(np.mean(np.log(vals)))) if vals else None

        def speed_ratio(method, key="dec_s"):  # zstd -3's decode time (its faster form, or decompress()) / kvz's
            vals = []
            for c in cases:
                z = next(r for r in c["rows"] if r["method"] == "zstd -3")
                k = [r for r in c["rows"] if r["method"].startswith(method)]
                if k and key in z:
                    vals.append(z[key] / k[0]["dec_s"])
            return float(np.exp(np.mean(np.log(vals)))) if vals else None

        multi = [r["method"] for r in cases[0]["rows"] if r["method"].startswith("kvz") and "threads" in r["method"]]
        out.append(f"| {dtype} | {_fmt(gm('zstd -3'), '.3f')} | {_fmt(gm('zstd -19'), '.3f')} | "
                   f"{_fmt(gm('zstd -3, byte-grouped'), '.3f')} | {_fmt(gm('kvz lossless, 1 thread'), '.3f')} | "
                   f"{_fmt(speed_ratio('kvz lossless, 1 thread'), '.2f')} | "
                   f"{_fmt(speed_ratio('kvz lossless, 1 thread', 'dec_s_bytes'), '.2f')} | "
                   f"{_fmt(speed_ratio(multi[-1]) if multi else None, '.2f')} | "
                   f"{_fmt(gm('kvz lossless, 1 thread', 'enc_mb_s'), '.0f')} | "
                   f"{_fmt(gm('kvz lossless, 1 thread', 'dec_mb_s'), '.0f')} | "
                   f"{_fmt(gm('zstd -3', 'dec_mb_s'), '.0f')} |")
    return "\n".join(out)


def run_bench(args) -> int:
    from .common import corpus_caches, corpus_dir, machine_info

    cdir = corpus_dir(args.corpus)
    if cdir is None:
        return missing_corpus("kvz bench")
    genres = args.genres or DEFAULT_GENRES
    results = {"command": "kvz bench " + " ".join(f"--{k} {v}" for k, v in (("tokens", args.tokens),
                                                                             ("repeats", args.repeats)))
               + (" --no-zstd19" if args.no_zstd19 else ""),
               **machine_info(), "zstandard": zstandard.__version__, "cases": []}
    for dname, g, _m, ids, kv in corpus_caches(cdir, genres, args.dtypes, args.tokens):
        t = time.perf_counter()
        rows = bench_cache(kv, args.repeats, not args.no_zstd19)
        case = {"text": g, "dtype": dname, "tokens": int(ids.shape[1]), "raw_bytes": kv.nbytes(), "rows": rows}
        results["cases"].append(case)
        kvz = next(r for r in rows if r["method"] == "kvz lossless, 1 thread")
        z3 = next(r for r in rows if r["method"] == "zstd -3")
        print(f"{g} {dname}: kvz {kvz['ratio']:.3f}x (dec {kvz['dec_mb_s']:.0f} MB/s) vs zstd-3 "
              f"{z3['ratio']:.3f}x (dec {z3['dec_mb_s']:.0f} MB/s) [{time.perf_counter() - t:.0f} s]", flush=True)
    print(summary(results))
    write_report(args.out, "bench", results, to_markdown(results))
    return 0
