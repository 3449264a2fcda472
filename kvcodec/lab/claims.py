"""``kvz claims``: test the seed paper's claims on the real model and write docs/claims.md.

The paper (Magarshak, arXiv:2604.15356; see shared/design/papers.md part A)
claims that a KV cache costs no more than its tokens' conditional entropy,
3.3-4.3 bits per token at perplexity 10-20, hence ~914,000x over TurboQuant;
that compression improves with context length; and (implicitly, Theorem 1)
that layer-0 KV is injective in the token.  This command measures each on
SmolLM2-135M-Instruct with the corpus texts, using kvcodec's token channel
(LM range coder + token recovery), and writes the numbers and a verdict.
"""

from __future__ import annotations

import platform
import time

import numpy as np
import torch

from .common import missing_corpus, write_report

BUCKETS = [(0, 1), (1, 64), (64, 128), (128, 256), (256, 512), (512, 1024), (1024, 2048), (2048, 4096)]


def _bucket_table(bits: np.ndarray) -> list[dict]:
    out = []
    for a, b in BUCKETS:
        if a < bits.size:
            seg = bits[a:min(b, bits.size)]
            out.append({"positions": [a, min(b, bits.size)], "mean_bits": float(seg.mean())})
    return out


def run_claims(args) -> int:
    from ..cache import to_canonical
    from ..models import load_model, prefill, tokenize
    from ..tokens import LMTokenCoder, layer0_value_table, recover_tokens
    from ..tokens.recover import min_pairwise_distance
    from ..tokens.static import StaticTokenCoder
    from .common import corpus_files

    files = corpus_files(args.corpus)
    if not files:
        return missing_corpus("kvz claims")
    if args.files:
        files = [f for f in files if f.name in set(args.files)]
    model, tok = load_model("smollm2")
    cfg = model.config
    layers, kv_heads = cfg.num_hidden_layers, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    comps = 2 * layers * kv_heads * head_dim
    table = layer0_value_table(model)
    min_dist, dups = min_pairwise_distance(table)
    coder = LMTokenCoder(model)
    rows = []
    for f in files:
        n = args.long_tokens if f.name in args.long else args.tokens
        ids = tokenize(tok, f.read_text(encoding="utf-8"), n)
        t = time.perf_counter()
        stream = coder.encode(ids[0])
        enc_s = time.perf_counter() - t
        static = StaticTokenCoder(coder.vocab).encode(ids[0])
        kv = to_canonical(prefill(model, ids))
        rec = recover_tokens(kv.values[0], model, table=table)
        bits = stream.token_bits
        rows.append({
            "file": f.name, "tokens": int(ids.shape[1]),
            "coded_bytes": stream.nbytes,
            "cross_entropy_bits": stream.cross_entropy_bits,
            "coded_bits_per_token": 8 * stream.nbytes / ids.shape[1],
            "static_bits_per_token": 8 * static.nbytes / ids.shape[1],
            "cross_entropy_bits_per_token_after_first": float(bits[1:].mean()) if bits.size > 1 else None,
            "ratio_vs_bf16_cache": comps * 2 * ids.shape[1] / stream.nbytes,
            "ratio_vs_fp32_cache": comps * 4 * ids.shape[1] / stream.nbytes,
            "recovered_all_tokens": bool(rec.ok and torch.equal(rec.tokens, ids)),
            "recovery_margin": rec.min_relative_margin,
            "by_position": _bucket_table(bits),
            "encode_seconds": enc_s,
        })
        print(f"{f.name}: {rows[-1]['coded_bits_per_token']:.2f} bits/token coded, "
              f"{rows[-1]['cross_entropy_bits_per_token_after_first']:.2f} CE, recovered "
              f"{rows[-1]['recovered_all_tokens']} [{enc_s:.0f} s]", flush=True)
    res = {"command": f"kvz claims --tokens {args.tokens} --long-tokens {args.long_tokens}",
           "machine": platform.machine(), "torch": torch.__version__, "model": "SmolLM2-135M-Instruct (fp32)",
           "components_per_token": comps, "vocab_size": int(table.shape[0]), "vocab_min_pairwise_distance": min_dist, "vocab_duplicate_rows": dups,
           "files": rows}
    write_report(args.out, "claims", res, render(res))
    return 0


LAYER1 = (
    "## Claim 6: layer 1 (probabilistic prefix deduplication across sessions)\n\n"
    "Exact-prefix sharing is what `kvcodec.Store` does (BENCHMARKS.md: 100 sessions sharing a 1,000-token prefix "
    "store in 0.92x the bytes of the prefix once plus each session's own positions, 8.1x fewer than one `.kvz` "
    "each). The paper's probabilistic part - centroid sessions within a PLT distance, index-aligned tail deltas "
    "at <= 2 bits - is measured separately by `python scripts/studies/plt_layer.py` ([plt_layer.md](plt_layer.md); "
    "SmolLM2 bf16, 27 member sessions of corpus text, KL on 64 teacher-forced tokens). **Verdict: it pays in one "
    "situation only, and not by the paper's rule.** After a same-length word substitution (the paper's \"a "
    "helpful\" / \"an AI\" case) the deltas die out with distance (key delta / key 0.19 at 1-3 tokens, 0.009 beyond "
    "128) and reusing the other session's vectors where ||delta|| / ||KV|| < 0.25 gives mean KL 0.0035 / 0.0023 at "
    "2.05 bits per tail component against 0.064 / 0.059 for kvcodec's lossy tier at the same bits - or 0.044 bits "
    "per component at KL 0.004 when the deltas are not stored at all. Everywhere else it adds nothing: after a "
    "shared system prompt the deltas are as large as the KV (median ratio 1.01; 0.2 % of vectors pass tau), and "
    "an edit that shifts later tokens by one loses the index alignment (0.80). The paper's rule d_T <= delta "
    "picks, for 27 of 27 members, a centroid sharing 0-2 tokens (d_T is the bits of the *shared* prefix, so the "
    "least similar session wins) and loses the exact prefix (compression 7.7 vs 13.5 at higher KL); the corrected "
    "tree distance (normalised, 0.1-0.3) finds nothing (0.54-0.93 for the substitutions: a prefix distance "
    "cannot see that text re-synchronises); d_T adds nothing beyond LCP length (Spearman -0.63 vs -0.64). The "
    "storage formula 1 - f(1 - l/n) is the arithmetic of shared prefixes (matches to the fourth digit) and says "
    "nothing about the delta mode. **Not shipped in the store:** what pays is index-aligned reuse after a "
    "same-length edit, keyed by token identity, not a PLT distance; it is worth building only for deployments "
    "with templated prompts that substitute same-length names or words.")


LAYER2 = ("## Claim 5: layer 2 (predictive delta coding)\n\nMeasured separately by `python scripts/studies/layer2.py` "
          "([layer2.md](layer2.md)): the paper's top-k expected-KV predictor removes ~60 % of the KV variance and saves "
          "about 1.4 bits per component (4.72 -> 3.34) against quantizing the raw components at the same step, at k model "
          "token-steps per token (soft token: 1.1 bits for 1 step; previous token: 0.3 bit, its residual energy "
          "exceeds the variance). **Verdict:** real but modest, and dominated by the token channel: the exact tier "
          "stores a residual of zero for ~3-5 bits per token (11,520 components) at one model step per token, and "
          "any layer-2 decoder needs the model too, so it cannot serve the lossy tier's use case (decoding "
          "without a model)." + " Surprisal-adaptive allocation (b_i = max(1, floor(b0 h_i / mean h)), capped at b0 + 4, on the rotated uniform quantizer; `kvz bench --lossy`, GPL text, 1,024 tokens): b0 = 2 costs 2.44 bits per component for a mean KL of 0.138 bits and b0 = 3 costs 3.32 bits for 0.117, against 0.047 at 2.0 bits and ~0.008 at 3.3 bits with the same bits for every token: **it loses** — a surprising token's keys and values are not more important to later tokens than a predictable token's.")


def render(res: dict) -> str:
    rows = res["files"]
    comps = res["components_per_token"]
    allbits = sum(r["coded_bytes"] * 8 for r in rows) / sum(r["tokens"] for r in rows)
    ce = [r["cross_entropy_bits_per_token_after_first"] for r in rows]
    in_range = [r["file"] for r in rows if 3.3 <= r["cross_entropy_bits_per_token_after_first"] <= 4.3]
    worst_overhead = max(r["coded_bytes"] - r["cross_entropy_bits"] / 8 for r in rows)
    longest = sorted(rows, key=lambda r: -r["tokens"])[:4]

    def mean_bits(r, lo, hi):
        return [b["mean_bits"] for b in r["by_position"] if lo <= b["positions"][0] and b["positions"][1] <= hi]

    early = float(np.mean([v for r in longest for v in mean_bits(r, 1, 64)]))
    late = float(np.mean([v for r in longest for v in mean_bits(r, 256, 1 << 30)] or [float("nan")]))
    steady = sum(all(b2 <= b1 for b1, b2 in zip(mean_bits(r, 128, 1 << 30), mean_bits(r, 128, 1 << 30)[1:]))
                 for r in longest)
    if late < early - 0.25:
        verdict3 = (f"partly - tokens from position 256 on cost {early - late:.2f} bits less than tokens 1-63; the "
                    "per-token cost does not go to zero (the entropy rate of a text stays positive), so total size "
                    "grows linearly and the ratio over per-vector methods levels off.")
    else:
        verdict3 = ("not observed - beyond the first token, later tokens do not cost less than early ones on these "
                    "texts; the cost follows the content.")
    all_rec = all(r["recovered_all_tokens"] for r in rows)
    ms_per_token = 1000 * sum(r["encode_seconds"] for r in rows) / sum(r["tokens"] for r in rows)
    turbo_paper = 2 * 80 * 64 * 128 * 3
    turbo_smol = comps * 3
    lines = [
        "# The seed paper's claims, measured",
        "",
        f"Generated by `{res['command']}` ({res['model']}, torch {res['torch']}, {res['machine']}). "
        "Token streams are coded with kvcodec's LM range coder (`kvcodec.tokens.LMTokenCoder`): the model's "
        "own next-token distribution, computed incrementally exactly as a decoder would. Each text: its first "
        "tokens as listed.",
        "",
        "| text | tokens | coded bits/token (lm) | cross-entropy bits/token (after the first) | "
        "static model bits/token (no network) | ratio vs bf16 cache | ratio vs fp32 cache | "
        "tokens recovered from the cache |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(f"| {r['file']} | {r['tokens']} | {r['coded_bits_per_token']:.2f} | "
                     f"{r['cross_entropy_bits_per_token_after_first']:.2f} | {r['static_bits_per_token']:.2f} | "
                     f"{r['ratio_vs_bf16_cache']:,.0f}x | "
                     f"{r['ratio_vs_fp32_cache']:,.0f}x | {'all' if r['recovered_all_tokens'] else 'NO'} |")
    lines += [
        "",
        "## Claim 1: a cache costs its tokens' surprisal, 3.3-4.3 bits per token",
        "",
        f"Measured: {min(ce):.2f} to {max(ce):.2f} bits per token across genres (all texts together: "
        f"{allbits:.2f} coded bits per token including the uniform first token and the coder's flush). "
        f"In the 3.3-4.3 range: {len(in_range)} of {len(rows)} texts ({', '.join(in_range) or 'none'}). "
        f"Coded size vs the ideal code length: at most {worst_overhead:.1f} bytes over it per stream. "
        "**Verdict:** the bound is real and the coder reaches it; the number of bits is a property of the text "
        "under the model (its cross-entropy), not of KV caches, so a fixed range like 3.3-4.3 describes only some "
        "genres. Restoring from tokens needs the model and one forward pass per token.",
        "",
        "## Claim 2: ~914,000x over TurboQuant",
        "",
        f"Paper's dimensions (80 layers x 64 KV heads x 128, K and V, 3-bit TurboQuant): {turbo_paper:,} bits per "
        f"token; / 4.3 bits = {turbo_paper / 4.3:,.0f}x (the paper's number, reproduced). With SmolLM2's real "
        f"dimensions ({comps:,} components per token) and the measured {allbits:.2f} bits per token: "
        f"{turbo_smol:,} / {allbits:.2f} = **{turbo_smol / allbits:,.0f}x**; against the raw bf16 cache "
        f"({comps * 16:,} bits per token): {comps * 16 / allbits:,.0f}x. **Verdict: arithmetic right, comparison "
        "unlike**: a token stream is not a cache; it becomes one only by running the model (measured here: "
        f"{ms_per_token:.0f} ms per token, one incremental forward pass each, on this CPU), while a TurboQuant "
        "cache is usable as is.",
        "",
        "## Claim 3: compression improves with context length",
        "",
        "Mean coded bits per token by position (texts with the longest excerpts):",
        "",
    ]
    heads = [f"{b['positions'][0]}-{b['positions'][1]}" for b in longest[0]["by_position"]]
    lines.append("| text | " + " | ".join(heads) + " |")
    lines.append("|---|" + "---:|" * len(heads))
    for r in longest:
        vals = [f"{b['mean_bits']:.2f}" for b in r["by_position"]]
        lines.append(f"| {r['file']} | " + " | ".join(vals + [""] * (len(heads) - len(vals))) + " |")
    lines += [
        "",
        f"Over these texts, the mean cost of tokens 1-63 is {early:.2f} bits and of tokens from 256 on "
        f"{late:.2f} bits; after position 128 the bucket means never rise in {steady} of {len(longest)} texts. "
        f"**Verdict:** {verdict3}",
        "",
        "## Claim 4 (Theorem 1's premise): layer-0 KV identifies the token",
        "",
        f"The layer-0 value vectors of the model's {res['vocab_size']:,} vocabulary entries: minimum distance between two "
        f"different rows {res['vocab_min_pairwise_distance']:.3g}; {res['vocab_duplicate_rows']} rows duplicate "
        "another (tokens with identical embeddings: identical KV everywhere, so either choice regenerates the same "
        "cache). Recovery by nearest row got back every token of the texts above: "
        f"{'yes' if all_rec else 'NO'}. **Verdict:** "
        + ("holds for this checkpoint up to duplicate rows - " if all_rec and res["vocab_min_pairwise_distance"] > 0
           else "does not hold as stated - ")
        + "a property to check per model, not a generic fact; the nearest rows can be very close (distance above), "
        "models with absolute position embeddings need the position accounted for, and modified caches fail.",
        "",
    ]
    lines += ["", LAYER2, "", LAYER1]
    return "\n".join(lines) + "\n"
