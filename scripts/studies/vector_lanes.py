"""The lossless tier's lane decoders side by side on one real cache (issue 16; BENCHMARKS "Decode speed").

    python scripts/studies/vector_lanes.py [--text prose_en_austen_pride_and_prejudice.txt] [--tokens 2048]

SmolLM2's bf16 and fp32 caches of the text, every (layer, part) coded as the lossless tier codes it
(``float_ctx_rans``, Scale_Bits 10, 8 lanes); then, on the same parsed streams and local tables, the kernels
alone (no parsing, no table building), interleaved rounds, 1 thread, MB/s of output and Msym/s (median of 7):

* ``fast_w8``: the scalar Numba kernel (``_lanes_unrolled``);
* ``vector K=1..4``: ``_lanes_simd`` with K streams per loop (the shipped decoder uses K = 3), direct tables.

Every kernel's output is checked against the cache's bit patterns first.
"""

import argparse
import time

import numpy as np
import torch

from kvcodec.codecs import float_ctx_rans as F
from kvcodec.entropy import _lanes_simd as S
from kvcodec.entropy import _lanes_unrolled as U
from kvcodec.entropy import rans
from kvcodec.lab.common import corpus_files
from kvcodec.models import load_model, prefill, tokenize


def streams(kv_layers, dtype_name):
    word = {"bfloat16": (torch.int16, np.uint16), "float32": (torch.int32, np.uint32)}[dtype_name]
    out = []
    for layer in kv_layers:
        for t in (layer.keys, layer.values):
            w = t.contiguous().view(word[0]).numpy().view(word[1])
            b, h, s, d = w.shape
            st, _ = F.parse_symbols(memoryview(F.encode(w, dtype_name, {"scale_bits": 10})), (b * h, s, d),
                                    8 * w.itemsize)
            words, refs, ctx_map, freq, raw = rans.check_stream(st.words, st.refs, st.ctx_map, st.freq, st.scale_bits,
                                                                st.ways, st.kbits, st.nclass, st.lowbits, st.raw,
                                                                b * h * d, w.size)
            res = np.empty((b * h, s, d), dtype=w.dtype)
            vec = rans._local_tables("vector_w8/direct", words, refs, ctx_map, freq, st.scale_bits, st.ways,
                                     st.nclass, st.lowbits, raw, res)
            sca = rans._local_tables("fast_w8", words, refs, ctx_map, freq, st.scale_bits, st.ways, st.nclass,
                                     st.lowbits, raw, np.empty_like(res))
            out.append((st, vec, sca, w.reshape(b * h, s, d)))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", default="prose_en_austen_pride_and_prejudice.txt")
    ap.add_argument("--tokens", type=int, default=2048)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model("smollm2")
    path = {f.name: f for f in corpus_files()}[args.text]
    ids = tokenize(tok, path.read_text(encoding="utf-8"), args.tokens)
    for dname, tdt in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        ss = streams(prefill(model, ids, tdt).layers, dname)
        st0 = ss[0][0]
        nbytes = sum(w.nbytes for *_, w in ss)
        nsym = sum(w.size for *_, w in ss)

        def scalar():
            for st, _, p, _w in ss:
                U.fast_w8(p.words, p.nwords, p.refs, p.ctx, p.table, p.info, st.scale_bits, st.kbits, st.lowbits,
                          p.raw, p.out)

        def vector(k):
            def run():
                S.STREAMS = k
                S.decode_many(st0.ways, st0.scale_bits, st0.kbits, st0.nclass, st0.lowbits, [v for _, v, _, _ in ss])
            return run

        arms = {"fast_w8 (scalar Numba)": scalar, **{f"vector K={k}": vector(k) for k in (1, 2, 3, 4)}}
        for name, fn in arms.items():
            fn()
            outs = [p.out for _, _, p, _ in ss] if name.startswith("fast") else [v.out for _, v, _, _ in ss]
            assert all(np.array_equal(o, w) for o, (*_, w) in zip(outs, ss)), name
        times = {n: [] for n in arms}
        for _ in range(7):
            for n, fn in arms.items():
                t = time.perf_counter()
                fn()
                times[n].append(time.perf_counter() - t)
        S.STREAMS = 3
        print(f"{args.text} {dname}, {args.tokens} tokens ({nbytes / 2**20:.1f} MiB): kernels alone, 1 thread")
        base = np.median(times["fast_w8 (scalar Numba)"])
        for n, ts in times.items():
            m = np.median(ts)
            print(f"  {n:24s} {nbytes / m / 1e6:6.0f} MB/s {nsym / m / 1e6:6.0f} Msym/s  {base / m:.2f}x")


if __name__ == "__main__":
    main()
