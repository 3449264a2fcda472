"""The decoder changes of issue 16's fourth pass, each against what it replaced, in one process (BENCHMARKS "The
lossy tier's decode (issue 16, fourth pass)").

    python scripts/studies/decoder_ab.py [--text prose_en_austen_pride_and_prejudice.txt] [--rounds 11] [--out F.json]

SmolLM2's bf16 cache of the first 2,048 tokens of the text, 1 thread.  Each A/B decodes the same file with the
old and the new code path alternately (one untimed decode of each first), checks that both give the same
tensors, and reports medians of ``--rounds`` whole decodes and the mean time inside the part that changed:

* ``raw``: the index streams' kernel without the raw low bits' loads (``lowbits`` 0) against the variant that
  reads them (2-bit lossy cache);
* ``prefix``: the refilling lanes' word offsets from a table against shifts and adds in registers (lossless and
  2-bit lossy caches);
* ``dequant``: Method 5 (``weighted`` keys) dequantized by the vector kernel against the Numba kernel (2-bit
  weighted cache, its profile calibrated on the text's first 128 tokens);
* ``scale_bits``: the file's bytes with index streams at ``Scale_Bits`` 8 against 10 for several quantizer
  settings (one encode each; no timing; CacheGen's streams, which stay at 10, as they would be at 8).
"""

import argparse
import collections
import json
import os
import statistics
import time

import torch

os.environ.setdefault("KVCODEC_THREADS", "1")

import kvcodec  # noqa: E402
from kvcodec.codecs import _rotate_simd, _vq_numba, vq_rans  # noqa: E402
from kvcodec.entropy import _lanes_simd  # noqa: E402
from kvcodec.lab.common import machine_info, text_cache  # noqa: E402


def ab(data: bytes, old, new, parts, rounds: int) -> dict:
    """Decode ``data`` with ``old()`` / ``new()`` applied alternately (each returns an undo), the time inside
    ``parts`` (``(module, name)`` of the functions that changed, timed where the decoder calls them) summed per
    arm."""
    spent = collections.defaultdict(float)
    arm = [None]
    reals = [(mod, name, getattr(mod, name)) for mod, name in parts]

    def timer(real):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                spent[arm[0]] += time.perf_counter() - t
        return timed

    def decode(which):
        undo = (old if which == "old" else new)()
        arm[0] = which
        try:
            return kvcodec.decode(data, output="kvcache")
        finally:
            undo()

    for mod, name, real in reals:
        setattr(mod, name, timer(real))
    try:
        a, b = decode("old"), decode("new")
        assert a.equal(b), "the two paths decode different tensors"
        del a, b
        spent.clear()
        times = {"old": [], "new": []}
        for _ in range(rounds):
            for which in ("old", "new"):
                t = time.perf_counter()
                decode(which)
                times[which].append(time.perf_counter() - t)
    finally:
        for mod, name, real in reals:
            setattr(mod, name, real)
    o, n = statistics.median(times["old"]), statistics.median(times["new"])
    return {"decode_ms_old": 1e3 * o, "decode_ms_new": 1e3 * n, "decode_speedup": o / n,
            "part_ms_old": 1e3 * spent["old"] / rounds, "part_ms_new": 1e3 * spent["new"] / rounds,
            "part_speedup": spent["old"] / spent["new"]}


def patch(obj, name, value):
    """Set ``obj.name`` to ``value``; returns the undo."""
    before = getattr(obj, name)
    setattr(obj, name, value)
    return lambda: setattr(obj, name, before)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--text", default="prose_en_austen_pride_and_prejudice.txt")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, ids, kv = text_cache(args.text, args.tokens)
    from kvcodec.calibrate import calibrate

    profile = calibrate(model, ids[:, :128])
    lossless = kvcodec.encode(kv, tier="lossless")
    lossy2 = kvcodec.encode(kv, tier="lossy", bits=2.0)
    weighted = kvcodec.encode(kv, tier="lossy", bits=2.0, quantizer="weighted", profile=profile)
    kernel = _lanes_simd.kernel
    run = [(_lanes_simd, "_run")]
    res = {"text": args.text, "tokens": args.tokens, "rounds": args.rounds, **machine_info()}
    res["raw"] = ab(lossy2, lambda: patch(_lanes_simd, "kernel", lambda W, K, ety, direct, narrow=False, raw=True:
                                          kernel(W, K, ety, direct, narrow, True)),
                    lambda: (lambda: None), run, args.rounds)
    res["prefix_lossless"] = ab(lossless, lambda: patch(_lanes_simd, "PREFIX_TABLE", False),
                                lambda: patch(_lanes_simd, "PREFIX_TABLE", True), run, args.rounds)
    res["prefix_lossy"] = ab(lossy2, lambda: patch(_lanes_simd, "PREFIX_TABLE", False),
                             lambda: patch(_lanes_simd, "PREFIX_TABLE", True), run, args.rounds)
    res["dequant"] = ab(weighted, lambda: patch(_rotate_simd, "dequant_usable", lambda *a: False),
                        lambda: (lambda: None), [(_rotate_simd, "dequant"), (_vq_numba, "channel_dequant_into")],
                        args.rounds)
    settings = [{"bits": b} for b in (1.0, 2.0, 3.0, 4.0, 6.0)] + [
        {"quantizer": "lloyd", "lloyd_bits": 3}, {"quantizer": "kivi", "kivi_bits": 2},
        {"quantizer": "kivi", "kivi_bits": 4}, {"quantizer": "cachegen"}]
    rows = []
    for opts in settings:
        sizes = {}
        for sb in (10, 8):  # CacheGen's streams stay at 10 (vq_rans._CTX): its 8 is what they would cost there
            undos = [patch(vq_rans, "SMALL_SCALE_BITS", sb)]
            if opts.get("quantizer") == "cachegen":
                undos.append(patch(vq_rans, "_CTX", {**vq_rans._CTX, "scale_bits": sb}))
            try:
                sizes[sb] = len(kvcodec.encode(kv, tier="lossy", **opts))
            finally:
                for undo in reversed(undos):
                    undo()
        rows.append({"options": opts, "bytes_10": sizes[10], "bytes_8": sizes[8], "ratio_8_10": sizes[8] / sizes[10]})
    res["scale_bits"] = rows
    for key in ("raw", "prefix_lossless", "prefix_lossy", "dequant"):
        r = res[key]
        print(f"{key}: decode {r['decode_ms_old']:.1f} -> {r['decode_ms_new']:.1f} ms ({r['decode_speedup']:.3f}x), "
              f"part {r['part_ms_old']:.1f} -> {r['part_ms_new']:.1f} ms ({r['part_speedup']:.3f}x)")
    for r in rows:
        print(f"Scale_Bits 8 vs 10, {r['options']}: {r['bytes_8']:,} / {r['bytes_10']:,} B ({r['ratio_8_10']:.5f})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
