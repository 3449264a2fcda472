#!/usr/bin/env python
"""Where the lossless tier's bits go: the numbers behind BENCHMARKS.md's "Why the ratio stops".

    python scripts/studies/entropy.py [--tokens 2048] [--text FILE]

Builds SmolLM2's bf16 cache of the text (default: the corpus' Austen excerpt, else the shipped
demo text), then prints (a) entropies of the sign+exponent symbol under simple context models
(no side information) and (b) the real coded size of float_ctx_rans and of variants with more
context classes or tables (side information included).  Variants (b) reuse the codec's own
clustering, table normalisation and rANS encoder; only the class function changes.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import zstandard

from kvcodec.cache import to_canonical
from kvcodec.codecs import float_ctx_rans as fc
from kvcodec.entropy import rans
from kvcodec.lab.common import corpus_dir, demo_text
from kvcodec.models import load_model, prefill, tokenize


def cond_entropy(ctx: np.ndarray, x: np.ndarray) -> float:
    key = ctx.astype(np.int64) * (int(x.max()) + 1) + x
    _, c = np.unique(key, return_counts=True)
    _, cc = np.unique(ctx, return_counts=True)
    n = x.size
    return float(-(c / n * np.log2(c / n)).sum() + (cc / n * np.log2(cc / n)).sum())


def classes(syms, refs, k, q):
    mm = (1 << (k - 1)) - 1
    s, r = syms.astype(np.int64), refs.astype(np.int64)[:, None]
    p1 = np.concatenate([r, s[:, :-1]], axis=1)
    p2 = np.concatenate([r, r, s[:, :-2]], axis=1)[:, :s.shape[1]]
    b3 = lambda p: ((p & mm) >= (r & mm)).astype(np.int64) + ((p & mm) > (r & mm))  # noqa: E731
    sg = lambda p: p >> (k - 1)  # noqa: E731
    return {6: 3 * sg(p1) + b3(p1), 12: 6 * sg(p2) + 3 * sg(p1) + b3(p1),
            36: 18 * sg(p2) + 6 * b3(p2) + 3 * sg(p1) + b3(p1)}[q]


def coded_bytes(words, q, tables, k=10, sb=12) -> float:
    b, h, s, d = words.shape
    rows = np.ascontiguousarray(words.transpose(0, 1, 3, 2)).reshape(b * h * d, s)
    syms = (rows >> (16 - k)).astype(np.uint16)
    refs = np.median(syms & ((1 << (k - 1)) - 1), axis=1).astype(np.uint16)
    ident = np.arange(b * h * d)[:, None] * q + classes(syms, refs, k, q)
    counts = np.bincount((ident * (1 << k) + syms).ravel(), minlength=b * h * d * q << k).reshape(-1, 1 << k)
    counts = rans.SparseCounts.from_dense(counts)
    assign = fc._cluster(counts, tables)
    g = int(assign.max()) + 1
    freq = rans.normalize_counts(fc.table_counts(assign, counts, g), sb)
    ctx = assign[ident].astype(np.int32)
    w = rans.lanes_encode(syms, refs, np.zeros((b * h * d, 1), np.uint8), freq, sb, 8, k, 1, ctx=ctx)
    side = zstandard.ZstdCompressor(level=19).compress(refs.tobytes() + assign.astype(np.uint8).tobytes()
                                                        + rans.pack_tables(freq))
    return 20 + len(side) + 2 * w.size + words.size * (16 - k) / 8


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--text")
    args = ap.parse_args()
    cdir = corpus_dir()
    if args.text:
        text = open(args.text, encoding="utf-8").read()
    elif cdir is not None:
        text = (cdir / "prose_en_austen_pride_and_prejudice.txt").read_text(encoding="utf-8")
    else:
        text = demo_text()
    model, tok = load_model("smollm2", dtype=torch.bfloat16)
    kv = to_canonical(prefill(model, tokenize(tok, text, args.tokens)))
    print(f"{kv.seq_len} tokens, bf16, bits per component")
    print(f"{'what':80s} {'keys':>6s} {'values':>6s}")
    for name, tensors in (("keys", kv.keys), ("values", kv.values)):
        a = np.stack([t.contiguous().view(torch.int16).numpy().view(np.uint16)[0] for t in tensors])  # L,H,S,D
        L_, H, S, D = a.shape
        hi = (a >> 7).astype(np.int64)
        ch = np.broadcast_to((np.arange(L_)[:, None, None, None] * H + np.arange(H)[None, :, None, None]) * D
                             + np.arange(D), a.shape)
        lay = np.broadcast_to(np.arange(L_)[:, None, None, None], a.shape)
        med = np.median(hi & 0xFF, axis=2, keepdims=True).astype(np.int64)
        prev = np.concatenate([hi[:, :, :1], hi[:, :, :-1]], axis=2)
        rel = (prev & 0xFF) - med
        cls = (prev >> 8) * 3 + (rel >= 0) + (rel > 0)
        rows = {
            "sign+exponent symbol, one table per layer (entropy)": cond_entropy(lay, hi),
            "... one table per channel (entropy)": cond_entropy(ch, hi),
            "... per channel x previous token's class (entropy, tables for free)": cond_entropy(ch * 6 + cls, hi),
            "mantissa bits 0-6 (order-0 entropy of the 7 bits)": cond_entropy(np.zeros_like(hi), a & 0x7F),
        }
        for q, g in ((6, 32), (12, 32), (36, 32), (6, 64)):
            tot = sum(coded_bytes(np.ascontiguousarray(t.contiguous().view(torch.int16).numpy().view(np.uint16)), q, g)
                      for t in tensors)
            label = "total as shipped (6 classes, 32 tables)" if (q, g) == (6, 32) else f"total, {q} classes, {g} tables"
            rows[label] = tot * 8 / a.size
        if name == "keys":
            results = {k: [v] for k, v in rows.items()}
        else:
            for k, v in rows.items():
                results[k].append(v)
    for k, (kk, vv) in results.items():
        print(f"{k:80s} {kk:6.2f} {vv:6.2f}")


if __name__ == "__main__":
    main()
