"""Does a per-lane word stream let Numba vectorize the rANS decoder? (issue 16; BENCHMARKS "Decode speed")

    python scripts/studies/lane_simd.py [--text prose_en_austen_pride_and_prejudice.txt] [--layer 10]

The shipped lossless stream interleaves the words of all lanes in one stream: a lane's refill position depends
on how many words the lanes before it took (a shared cursor).  Here each of 16 lanes gets its own word stream
(what a revised format would store, with per-lane lengths), and the decode loop over the lanes is branchless
32-bit arithmetic with split (frequency, cumulative, symbol) tables: what LLVM's loop vectorizer needs to emit
gathers.  The script checks the round trips, times the shipped kernels (``fast_w8``, ``fast_w16``: same
symbols and tables, no raw bits) against the per-lane loop with the lane count a constant and a runtime value
(a constant trip count gets fully unrolled before vectorization), and counts gather instructions in the
per-lane kernels' assembly.  Symbols: one SmolLM2 bf16 key slice's coded symbols (sign, exponent and one
mantissa bit, as the lossless tier codes them), tiled 8x along the channels (~3 M symbols per call).
"""

import argparse
import time

import numba as nb
import numpy as np
import torch

from kvcodec.cache import to_canonical
from kvcodec.codecs import float_ctx_rans as F
from kvcodec.entropy import rans
from kvcodec.lab.common import corpus_files
from kvcodec.models import load_model, prefill, tokenize

W = 16
RANS_L = 1 << 16


@nb.njit(nogil=True)
def encode_per_lane(syms, ctx, freq, cum, sb, out, lens):
    """The shipped encoder's steps with one word stream per lane: ``out[lane]`` in emission order."""
    rows, ntok = syms.shape
    states = np.full(W, RANS_L, dtype=np.uint64)
    shift = np.uint64(32 - sb)
    for g in range((rows + W - 1) // W - 1, -1, -1):
        for t in range(ntok - 1, -1, -1):
            for j in range(W - 1, -1, -1):
                r = g * W + j
                c = ctx[r, t]
                s = syms[r, t]
                f = np.uint64(freq[c, s])
                x = states[j]
                if x >= (f << shift):
                    out[j, lens[j]] = np.uint16(x & np.uint64(0xFFFF))
                    lens[j] += 1
                    x >>= np.uint64(16)
                q = x // f
                states[j] = (q << np.uint64(sb)) + (x - q * f) + np.uint64(cum[c, s])
    for j in range(W):
        x = states[j]
        out[j, lens[j]] = np.uint16(x & np.uint64(0xFFFF))
        out[j, lens[j] + 1] = np.uint16(x >> np.uint64(16))
        lens[j] += 2


_DECODE = """
def decode(NL_ARG words, refs, cbase, slot8, finfo, cinfo, sinfo, sb, kbits, ntok, rows, out):
    x = np.empty(W, dtype=np.uint32)
    pos = np.zeros(W, dtype=np.int32)
    p = np.empty(W, dtype=np.uint32)
    rr = np.empty(W, dtype=np.uint32)
    nw = words.shape[1]
    wflat = words.reshape(-1)
    for j in range(W):
        x[j] = (np.uint32(words[j, 0]) << np.uint32(16)) | np.uint32(words[j, 1])
        pos[j] = 2
    mask = np.uint32((1 << sb) - 1)
    sbu = np.uint32(sb)
    sb8 = np.uint32(sb - 8)
    kb1 = np.uint32(kbits - 1)
    mm = np.uint32((1 << (kbits - 1)) - 1)
    lo = np.uint32(RANS_L)
    for g0 in range(0, rows, W):
        for j in range(W):
            p[j] = refs[g0 + j]
            rr[j] = p[j] & mm
        cb0 = cbase[g0 * 6:(g0 + W) * 6]
        o = out[g0:g0 + W]
        for t in range(ntok):
            for j in range(NL):
                pj = p[j]
                gq = pj & mm
                cls = (pj >> kb1) * np.uint32(3) + np.uint32(gq >= rr[j]) + np.uint32(gq > rr[j])
                cb = cb0[np.int32(j * 6) + np.int32(cls)]
                xj = x[j]
                slot = xj & mask
                ii = np.int32((cb >> sb8) | np.uint32(slot8[np.int32(cb | slot)]))
                sym = sinfo[ii]
                xj = finfo[ii] * (xj >> sbu) + slot - cinfo[ii]
                n = np.uint32(xj < lo)
                w = np.uint32(wflat[np.int32(j * nw) + pos[j]])
                xj = (xj << (n * np.uint32(16))) | (w & (np.uint32(0) - n))
                pos[j] += np.int32(n)
                x[j] = xj
                p[j] = sym
                o[j, t] = sym
    return pos
"""


def _compile(runtime: bool):
    """The per-lane decoder (per-lane streams ``words[lane]`` in reading order -> symbols ``out[row, token]``,
    branchless uint32), its lane loop over the constant W or over a runtime argument ``nl``."""
    src = _DECODE.replace("NL_ARG ", "nl, " if runtime else "")
    src = src.replace("range(NL)", "range(nl)" if runtime else "range(W)")
    ns = {"np": np, "W": W, "RANS_L": RANS_L}
    exec(src, ns)
    return nb.njit(nogil=True, fastmath=True)(ns["decode"])


decode_constant = _compile(False)
decode_runtime = _compile(True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", default="../shared/corpus")
    p.add_argument("--text", default="prose_en_austen_pride_and_prejudice.txt")
    p.add_argument("--layer", type=int, default=10)
    args = p.parse_args()
    model, tok = load_model("smollm2", dtype=torch.bfloat16)
    text = {f.name: f for f in corpus_files(args.corpus)}[args.text].read_text(encoding="utf-8")
    kv = to_canonical(prefill(model, tokenize(tok, text, 2048)))
    k, sb = 10, 10
    words16 = kv.keys[args.layer][0].contiguous().view(torch.uint16).numpy()
    rows16 = np.ascontiguousarray(words16.transpose(0, 2, 1)).reshape(-1, words16.shape[1])
    syms = np.ascontiguousarray(np.tile((rows16 >> (16 - k)).astype(np.uint16), (8, 1)))
    rows, ntok = syms.shape
    refs, counts = rans.row_stats(syms, k, 6)
    assign = F._cluster(counts, 32)
    freq = rans.normalize_counts(F.table_counts(assign, counts, int(assign.max()) + 1), sb).astype(np.uint32)
    ctx_map = assign.reshape(-1, 6).astype(np.uint8)
    ctx = rans.contexts(syms, refs, ctx_map, k, 6)
    cum = rans.cumulative(freq)
    ntab = freq.shape[0]
    slot8 = np.zeros(ntab << sb, np.uint8)
    finfo, cinfo, sinfo = (np.zeros(ntab << 8, np.uint32) for _ in range(3))
    for c in range(ntab):
        for i, s in enumerate(np.nonzero(freq[c])[0]):
            slot8[(c << sb) + cum[c, s]:(c << sb) + cum[c, s] + freq[c, s]] = i
            finfo[(c << 8) | i], cinfo[(c << 8) | i], sinfo[(c << 8) | i] = freq[c, s], cum[c, s], s
    cbase = (ctx_map.astype(np.uint32) << np.uint32(sb)).reshape(-1)
    out = np.zeros((W, syms.size // W + 8), np.uint16)
    lens = np.zeros(W, np.int64)
    encode_per_lane(syms, ctx, freq, cum, sb, out, lens)
    wl = np.zeros((W, lens.max() + 4), np.uint16)
    for j in range(W):
        wl[j, :lens[j]] = out[j, :lens[j]][::-1]
    res = np.zeros_like(syms, dtype=np.uint32)
    targs = (wl, refs, cbase, slot8, finfo, cinfo, sinfo, sb, k, ntok, rows, res)
    for f in (decode_constant, lambda *a: decode_runtime(W, *a)):
        res[:] = 0
        assert np.array_equal(f(*targs), lens) and np.array_equal(res, syms)
    streams = {ways: rans.lanes_encode(syms, refs, ctx_map, freq, sb, ways, k, 6, ctx=ctx) for ways in (8, 16)}
    o = np.zeros((rows // 64, ntok, 64), np.uint16)
    for ways, w in streams.items():
        rans.lanes_decode(w, refs, ctx_map, freq, sb, ways, k, 6, 0, b"", o)
        assert np.array_equal(o.transpose(0, 2, 1).reshape(rows, ntok), syms)
    print(f"{syms.size} symbols; interleaved stream {streams[8].size * 2} bytes, per-lane streams "
          f"{int(lens.sum()) * 2} bytes (+ {W} lengths)")

    def median(f, reps=9):
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t)
        return float(np.median(ts))

    n = syms.size / 1e6
    for _ in range(3):  # interleaved rounds: this machine is noisy
        line = []
        for ways, w in streams.items():
            secs = median(lambda: rans.lanes_decode(w, refs, ctx_map, freq, sb, ways, k, 6, 0, b"", o))
            line.append(f"{rans.decode_kernel(ways, 64, freq)} (shipped) {n / secs:.0f}")
        line.append(f"per-lane, 16 lanes constant {n / median(lambda: decode_constant(*targs)):.0f}")
        line.append(f"per-lane, lane count at run time {n / median(lambda: decode_runtime(W, *targs)):.0f}")
        print("Msym/s: " + "; ".join(line))
    for name, f in (("constant", decode_constant), ("runtime", decode_runtime)):
        asm = "".join(f.inspect_asm(sig) for sig in f.signatures)
        print(f"gather instructions in the per-lane kernel's assembly ({name} lane count): {asm.count('gather')}")


if __name__ == "__main__":
    main()
