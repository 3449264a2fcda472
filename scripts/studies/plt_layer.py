#!/usr/bin/env python
"""The seed paper's layer 1 (probabilistic prefix deduplication), implemented and measured on SmolLM2.

    .venv/bin/python scripts/studies/plt_layer.py --out docs/plt_layer.json   # also writes docs/plt_layer.md

Protocol (papers.md A.2 "implementable algorithm" and "what to measure"; the corpus is $KVCODEC_CORPUS or
../shared/corpus; everything is seeded; one CPU thread):

1. Workloads of real corpus text, sessions of N = 384 tokens plus a 64-token continuation:
   (a) ``system_prompt``: three shared system prompts (SmolLM2 chat framing, a corpus excerpt as the system
       turn) each followed by four distinct user turns (excerpts of other corpus files);
   (b) ``near_duplicate``: three base texts and four edits of each: a word substituted early (~token 24)
       and late (~token 160) such that every later token stays at its index (the paper's "a helpful" vs
       "an AI" case), a word replaced by a two-word phrase early (later tokens shift), a real sentence (the
       GPL's first) inserted early (later tokens shift by its length);
   (c) ``unrelated``: nine excerpts of different files.
   In each workload the first session of each family (for (c): three sessions) is the library, stored
   exactly (the favourable case for every method: a reference is never lossy); the others are members.
2. Per member: the exact prefix is the longest LCP with a library session (shared when >= 16 tokens);
   the tail is coded by each method; the reconstructed cache (prefix + tail) is fed the 64 continuation
   tokens teacher-forced, against the member's own exact cache: mean KL(P_exact || P_method) in bits.
3. Methods (bits per tail component count codes, 16-bit group scales, 1 flag bit per vector where deltas
   are possible, 8 bytes per member of reference id + LCP, 2 bytes per window reference):
   ``exact+lossless`` (tail raw bfloat16; also kvcodec's lossless tier on the tail), ``exact+direct{b}``
   (the group quantizer of kvcodec.plt on the tail itself), ``kvcodec lossy 2`` (exact prefix +
   ``kvcodec.encode(tail, tier="lossy", bits=2)``), and the probabilistic layer: index-aligned deltas
   ``KV_i(member) - KV_i(centroid)`` per layer/head/K-V vector, kept when ``||delta|| / ||KV|| < tau``
   (0.25), else the vector is coded directly: ``plt-literal`` (centroid by the paper's ``d_T <= delta``,
   the option ``paper_literal_threshold``), ``plt-session`` (corrected rule: longest-LCP centroid, gate
   normalised d_tree <= 0.2), ``plt-tau`` (longest-LCP centroid, no gate: tau alone decides) and
   ``plt-window`` (per 64-token window of the tail, the library session with the smallest normalised
   windowed d_tree, gate 0.2).  ``d/x`` in a name: delta bits / direct bits.  Where >= 1% of a member's
   tail vectors pass tau, also ``kvcodec-lossy1`` and ``plt-tau+kvcodec-lossy{1,2}`` (kvcodec's lossy tier
   on the residual mixture: deltas where tau allows, values elsewhere).  A tail that starts at position 0
   keeps its first token exact (as kvcodec's sink = 1).
4. Also: per-layer ||delta|| / ||KV|| against distance from the divergence point; correlation over
   (member, library) pairs of the delta ratio with d_T, LCP length, d_tree and index-aligned token identity;
   online clustering hit rates of every rule; the storage formula 1 - f (1 - l/n) against counted bytes.

Lookup is brute force over the library (at most 4 sessions per workload here); FAISS is not installed in
this environment and is not needed at this scale.
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS", "KVCODEC_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import kvcodec  # noqa: E402
from kvcodec import plt  # noqa: E402
from kvcodec.lab.common import corpus_dir  # noqa: E402
from kvcodec.tokens.plan import cache_kwarg  # noqa: E402

N, CONT = 384, 64
MIN_SHARE = 16  # tokens: exact prefixes shorter than one page are not shared
TAU = 0.25
THETA = 0.2
WINDOW = 64
LITERAL_DELTA = 16.0  # bits
GROUP = 8
META_BYTES = 8  # per member: library id (u32) + shared prefix length (u32)
WINDOW_REF_BYTES = 2
DIST_BINS = [(0, 1), (1, 4), (4, 16), (16, 64), (64, 128), (128, N)]
LN2 = math.log(2.0)

GPL_SENTENCE = "The GNU General Public License is a free, copyleft license for software and other kinds of works."

# (a): system prompt = (file, anchor text the excerpt starts at, chars); user turns = (file, char offset)
SYSTEM_PROMPTS = [
    ("faq", "qa_en_python_faq_general.rst", "What is Python?", 700),
    ("gpl", "legal_en_gpl-3.0.txt", "  The GNU General Public License is a free", 750),
    ("chatbot", "dialogue_en_chatterbot_emotion.yml", "conversations:", 650),
]
USER_TURNS = [
    ("techdoc_en_python_tutorial_controlflow.rst", 8000), ("prose_en_austen_pride_and_prejudice.txt", 5000),
    ("code_c_curl_ephiperfifo.c", 3000), ("log_dpkg.log", 10000),
    ("nonen_de_debian_reference_ch1.txt", 5000), ("data_cran_mirrors.csv", 2000),
    ("dialogue_en_chatterbot_emotion.yml", 5000), ("code_python_textwrap.py", 6000),
    ("qa_en_python_faq_general.rst", 9000), ("nonen_zh_debian_reference_ch1.txt", 5000),
    ("data_iso_3166-1.json", 5000), ("prose_en_austen_pride_and_prejudice.txt", 25000),
]
# (b): base texts (file, char offset)
NEAR_DUP_BASES = [("prose", "prose_en_austen_pride_and_prejudice.txt", 0),
                  ("techdoc", "techdoc_en_python_tutorial_controlflow.rst", 0),
                  ("code", "code_python_textwrap.py", 0)]
# (c): library first, then members
UNRELATED = [("data_iso_3166-1.json", 0), ("nonen_de_debian_reference_ch1.txt", 0), ("log_dpkg.log", 0),
             ("code_c_curl_ephiperfifo.c", 0), ("nonen_zh_debian_reference_ch1.txt", 0),
             ("data_cran_mirrors.csv", 0), ("prose_en_austen_pride_and_prejudice.txt", 20000),
             ("legal_en_gpl-3.0.txt", 12000), ("dialogue_en_chatterbot_emotion.yml", 4000)]
UNRELATED_LIBRARY = 3


@dataclass
class Session:
    name: str
    workload: str
    family: str
    role: str  # "library" | "member"
    case: str
    ids: torch.Tensor  # [N + CONT]
    edit: dict = field(default_factory=dict)
    bits: np.ndarray | None = None  # surprisal of ids[:N]
    kv: torch.Tensor | None = None  # [S = layers * 2 * heads, N, D] bfloat16, streams ordered (layer, K/V, head)


# ------------------------------------------------------------------------------------------------ workload


def excerpt(text: str, offset: int, chars: int = 9000) -> str:
    start = 0 if offset == 0 else text.index("\n", offset) + 1
    return text[start:start + chars]


def encode_ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False).input_ids


def build_workloads(tok, corpus: Path, seed: int) -> list[Session]:
    read = {}

    def text(name):
        if name not in read:
            read[name] = (corpus / name).read_text(encoding="utf-8")
        return read[name]

    def check(ids, what):
        if len(ids) < N + CONT:
            raise SystemExit(f"{what}: only {len(ids)} tokens, need {N + CONT}")
        return torch.tensor(ids[:N + CONT])

    out = []
    # (a) shared system prompt, distinct conversations
    for k, (fam, fname, anchor, chars) in enumerate(SYSTEM_PROMPTS):
        t = text(fname)
        sys_text = t[t.index(anchor):][:chars]
        sys_text = sys_text[:sys_text.rindex("\n")]  # whole lines
        for j in range(4):
            uf, uo = USER_TURNS[4 * k + j]
            chat = f"<|im_start|>system\n{sys_text}<|im_end|>\n<|im_start|>user\n{excerpt(text(uf), uo)}"
            out.append(Session(f"a/{fam}/{j}:{uf.split('_')[0]}", "system_prompt", fam, "library" if j == 0 else
                               "member", "sibling", check(encode_ids(tok, chat), fam),
                               {"system_prompt": f"{fname} from {anchor!r}, {len(sys_text)} chars",
                                "user_turn": f"{uf} @ {uo}"}))
    # (b) near-duplicates
    rng = np.random.default_rng(seed)
    for fam, fname, off in NEAR_DUP_BASES:
        base_text = excerpt(text(fname), off)
        base_full = encode_ids(tok, base_text)
        out.append(Session(f"b/{fam}/base", "near_duplicate", fam, "library", "base", check(base_full, fam)))
        vocab = sorted(set(re.findall(r"\b[A-Za-z]{4,}\b", base_text)))
        for case, at in (("sub_same_early", 24), ("sub_same_late", 160), ("sub_shift_early", 24),
                         ("insert_early", 24)):
            edited, info = make_edit(tok, base_text, base_full, case, at, vocab, rng)
            out.append(Session(f"b/{fam}/{case}", "near_duplicate", fam, "member", case,
                               check(encode_ids(tok, edited), f"{fam}/{case}"), info))
    # (c) unrelated texts
    for j, (fname, off) in enumerate(UNRELATED):
        out.append(Session(f"c/{fname.split('.')[0]}@{off}", "unrelated", f"c{j}",
                           "library" if j < UNRELATED_LIBRARY else "member", "unrelated",
                           check(encode_ids(tok, excerpt(text(fname), off)), fname)))
    return out


def make_edit(tok, base_text, base_full, case, at, vocab, rng):
    """A real-text edit near token ``at``; for sub_same, every later token keeps its index (checked)."""
    enc = tok(base_text, add_special_tokens=False, return_offsets_mapping=True)
    starts = [a for a, _ in enc["offset_mapping"]]

    def token_of(char):
        return int(np.searchsorted(starts, char, side="right") - 1)

    if case == "insert_early":
        j = base_text.index("\n", starts[at]) + 1  # after the first line ending past token `at`
        edited = base_text[:j] + GPL_SENTENCE + "\n" + base_text[j:]
        ids = encode_ids(tok, edited)
        shift = len(ids) - len(base_full)
        assert ids[-200:] == base_full[-200:], "insertion did not re-align at the end"
        return edited, {"edit": f"inserted {GPL_SENTENCE!r} at char {j}", "token": token_of(j), "shift": shift}
    lo, hi = at, at + 40
    words = [m for m in re.finditer(r"\b[A-Za-z]{4,}\b", base_text) if lo <= token_of(m.start()) < hi]
    cands = list(vocab)
    rng.shuffle(cands)
    for m in words:
        for rep in cands[:300]:
            if rep.lower() == m.group().lower():
                continue
            if case == "sub_shift_early":
                k = vocab.index(rep)
                rep = f"{rep} {vocab[(k + 1) % len(vocab)]}"  # two words of the text for one
            edited = base_text[:m.start()] + rep + base_text[m.end():]
            ids = encode_ids(tok, edited)
            if case.startswith("sub_same"):
                if len(ids) != len(base_full):
                    continue
                diff = np.flatnonzero(np.asarray(ids) != np.asarray(base_full))
                if diff.size == 0 or diff.size > 3 or diff[-1] - diff[0] >= diff.size:
                    continue
                return edited, {"edit": f"{m.group()!r} -> {rep!r}", "token": int(diff[0]), "shift": 0,
                                "tokens_changed": int(diff.size)}
            shift = len(ids) - len(base_full)
            if shift != 0 and ids[-200:] == base_full[-200:]:
                return edited, {"edit": f"{m.group()!r} -> {rep!r}", "token": token_of(m.start()), "shift": shift}
    raise SystemExit(f"no {case} edit found near token {at}")


# ------------------------------------------------------------------------------------------------ model


def prefill_all(model, sessions):
    for s in sessions:
        bits, out = plt.token_surprisal(model, s.ids[:N])
        cache = out["cache"] if "cache" in out else out["past_key_values"]
        kv = kvcodec.to_canonical(cache)
        s.bits = bits
        s.kv = torch.stack([torch.stack([k[0], v[0]]) for k, v in zip(kv.keys, kv.values)]).reshape(
            -1, N, kv.keys[0].shape[-1]).clone()  # [L * 2 * H, N, D]


def streams_to_cache(x: torch.Tensor, layers: int, heads: int):
    """[L * 2 * H, T, D] -> KVCache."""
    y = x.reshape(layers, 2, heads, x.shape[-2], x.shape[-1])
    return kvcodec.KVCache([y[i, 0][None].contiguous() for i in range(layers)],
                           [y[i, 1][None].contiguous() for i in range(layers)])


@torch.no_grad()
def continuation_logprobs(model, kv_streams, cont, layers, heads):
    dyn = streams_to_cache(kv_streams, layers, heads).to_dynamic_cache()
    logits = model(cont[None], use_cache=True, **{cache_kwarg(model): dyn}).logits[0].double()
    return torch.log_softmax(logits, dim=-1)


def kl_bits(lp, lq) -> tuple[float, float]:
    kl = (lp.exp() * (lp - lq)).sum(-1) / LN2
    return float(kl.mean()), float((lp.argmax(-1) == lq.argmax(-1)).double().mean())


# ------------------------------------------------------------------------------------------------ coding


def code_direct(x: torch.Tensor, bits: int, sink: int = 0) -> tuple[torch.Tensor, int]:
    """The group quantizer on ``x`` [S, T, D]; the first ``sink`` vectors of each stream kept exact (bf16)."""
    q = plt.quantize_groups(x[:, sink:], bits, group=GROUP)
    return torch.cat([x[:, :sink], plt.dequantize_groups(q)], 1), q.bits_total + 16 * x[:, :sink].numel()


def code_mixed(x, ref, mask, delta_bits, direct_bits, sink: int = 0) -> tuple[torch.Tensor, int]:
    """Per stream: the vectors in ``mask`` as ``x - ref`` at delta_bits, the others as ``x`` at direct_bits
    (each set in its own groups of 8, in position order), plus one flag bit per vector; the first ``sink``
    vectors exact."""
    out = x.clone()
    total = mask[:, sink:].numel() + 16 * x[:, :sink].numel()  # flags, sink
    for s in range(x.shape[0]):
        m = mask[s].clone()
        m[:sink] = False
        d = ~mask[s]
        d[:sink] = False
        if m.any():
            q = plt.quantize_groups((x[s, m] - ref[s, m])[None], delta_bits, group=GROUP)
            out[s, m] = ref[s, m] + plt.dequantize_groups(q)[0]
            total += q.bits_total
        if d.any():
            q = plt.quantize_groups(x[s, d][None], direct_bits, group=GROUP)
            out[s, d] = plt.dequantize_groups(q)[0]
            total += q.bits_total
    return out, total


def kvcodec_lossy(x: torch.Tensor, bits: float, layers: int, heads: int) -> tuple[torch.Tensor, int]:
    """kvcodec's lossy tier on streams ``x`` [S, T, D] (bf16 in, float32 out), and its byte count."""
    data = kvcodec.encode(streams_to_cache(x.to(torch.bfloat16), layers, heads), tier="lossy", bits=bits,
                          threads=1)
    dec = kvcodec.decode(data, output="kvcache", threads=1)
    hat = torch.stack([torch.stack([k[0], v[0]]) for k, v in zip(dec.keys, dec.values)]).reshape(x.shape)
    return hat.float(), len(data)


def vector_ratio(x, ref):
    """||x - ref|| / ||x|| per vector: [S, T]."""
    return (x - ref).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-30)


def ranks(a):
    a = np.asarray(a, dtype=np.float64)
    order = np.argsort(a, kind="mergesort")
    r = np.empty(a.size)
    r[order] = np.arange(a.size, dtype=np.float64)
    for v in np.unique(a):  # average ties
        idx = a == v
        r[idx] = r[idx].mean()
    return r


def spearman(x, y) -> float:
    rx, ry = ranks(x), ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


def partial_spearman(x, y, z) -> float:
    """Spearman correlation of x and y after removing the rank-linear effect of z from both."""
    rx, ry, rz = ranks(x), ranks(y), ranks(z)
    A = np.stack([rz, np.ones_like(rz)], 1)
    ex = rx - A @ np.linalg.lstsq(A, rx, rcond=None)[0]
    ey = ry - A @ np.linalg.lstsq(A, ry, rcond=None)[0]
    if ex.std() < 1e-12 or ey.std() < 1e-12:
        return float("nan")
    return float(np.corrcoef(ex, ey)[0, 1])


# ------------------------------------------------------------------------------------------------ study


def window_refs(s: Session, library: list[Session], u: int):
    """Per 64-token window of s's tail [u, N): (library index or None, normalised windowed d_tree)."""
    best = None
    for j, c in enumerate(library):
        d = plt.window_tree_distances(s.ids[:N], c.ids[:N], s.bits, c.bits, WINDOW, start=u)
        best = d[None] if best is None else np.concatenate([best, d[None]])
    idx = best.argmin(0)
    return [(int(i) if best[i, w] <= THETA else None, float(best[i, w])) for w, i in enumerate(idx)]


def study_member(model, s: Session, library: list[Session], layers, heads, args, log) -> dict:
    x_full = s.kv.float()
    cont = s.ids[N:N + CONT]
    lp = continuation_logprobs(model, s.kv, cont, layers, heads)
    comps_session = s.kv.numel()
    lib_pairs = [(c.ids[:N], c.bits) for c in library]
    lcps = [plt.lcp_len(s.ids[:N], c.ids[:N]) for c in library]
    j_trie = int(np.argmax(lcps))
    u = lcps[j_trie] if lcps[j_trie] >= MIN_SHARE else 0
    prefix_diff = float((s.kv[:, :u].float() - library[j_trie].kv[:, :u].float()).abs().max()) if u else 0.0
    rows, cache_kl = {}, {}

    def finish(name, tail_hat, tail_bits, u_, ref_j, extra_bytes=0, hit=None, extra=None):
        tail = x_full[:, u_:]
        nbytes = META_BYTES + extra_bytes + math.ceil(tail_bits / 8)
        full = torch.cat([library[ref_j].kv[:, :u_], tail_hat.to(torch.bfloat16)], 1) if u_ else \
            tail_hat.to(torch.bfloat16)
        key = hash(full.view(torch.int16).numpy().tobytes())
        if key not in cache_kl:
            cache_kl[key] = kl_bits(lp, continuation_logprobs(model, full, cont, layers, heads))
        kl, top1 = cache_kl[key]
        tail_comps = tail.numel()
        rows[name] = {"bytes": nbytes, "bits_per_tail_component": 8 * nbytes / max(tail_comps, 1),
                      "tail_tokens": N - u_, "shared_prefix": u_,
                      "compression_ratio": 2 * comps_session / nbytes,
                      "rel_error_tail": float((tail_hat - tail).norm() / tail.norm()),
                      "mean_kl_bits": kl, "top1_agreement": top1, "hit": hit, "clustered": bool(hit) or u_ > 0,
                      **(extra or {})}

    tail = x_full[:, u:]
    sink = 1 if u == 0 else 0  # a tail that starts the session keeps its first token exact (kvcodec's sink=1)
    # (i) exact-prefix dedup
    finish("exact+lossless", tail, 16 * tail.numel(), u, j_trie, hit=u > 0)
    lossless = kvcodec.encode(streams_to_cache(s.kv[:, u:], layers, heads), tier="lossless", threads=1)
    rows["exact+lossless"]["kvcodec_lossless_bytes"] = len(lossless) + META_BYTES
    for b in args.direct_bits:
        hat, nb = code_direct(tail, b, sink)
        finish(f"exact+direct{b}", hat, nb, u, j_trie, hit=u > 0)
    # (iii) kvcodec's lossy tier on the same tail
    t0 = time.perf_counter()
    if not args.skip_kvcodec_lossy:
        hat, nbytes = kvcodec_lossy(tail, 2, layers, heads)
        finish("kvcodec-lossy2", hat, 8 * nbytes, u, j_trie, hit=u > 0)

    # (ii) the probabilistic layer
    def plt_centroid(name, choice, delta_bits, direct_bits):
        if choice.index is None:  # no centroid: the member is coded as exact-prefix dedup + direct
            hat, nb = code_direct(x_full[:, u:], direct_bits, sink)
            finish(name, hat, nb, u, j_trie, hit=False, extra={"delta_fraction": 0.0, "centroid_lcp": choice.lcp})
            return None
        c = library[choice.index]
        u_ = choice.lcp if choice.lcp >= MIN_SHARE else 0
        xt, rt = x_full[:, u_:], c.kv[:, u_:].float()
        mask = vector_ratio(xt, rt) < TAU
        hat, nb = code_mixed(xt, rt, mask, delta_bits, direct_bits, 1 if u_ == 0 else 0)
        finish(name, hat, nb, u_, choice.index, hit=True,
               extra={"delta_fraction": float(mask.double().mean()), "centroid_lcp": choice.lcp,
                      "centroid": c.name, "centroid_value_bits": choice.value_bits,
                      "centroid_normalized_distance": choice.normalized_distance})
        return u_, xt, rt, mask

    lit = plt.choose_centroid(s.ids[:N], s.bits, lib_pairs, paper_literal_threshold=args.paper_literal_threshold)
    plt_centroid("plt-literal 2/2", lit, 2, 2)
    cor = plt.choose_centroid(s.ids[:N], s.bits, lib_pairs, max_normalized_distance=THETA)
    for d, x in ((2, 2), (0, 2)):
        plt_centroid(f"plt-session {d}/{x}", cor, d, x)
    tau_only = plt.choose_centroid(s.ids[:N], s.bits, lib_pairs, max_normalized_distance=1.0)
    for d, x in args.plt_bits:
        got = plt_centroid(f"plt-tau {d}/{x}", tau_only, d, x)
    tau_frac = rows["plt-tau 2/2"]["delta_fraction"]
    if got is not None and tau_frac >= 0.01 and not args.skip_kvcodec_lossy:
        # the strong coder on both sides: kvcodec's lossy tier on the tail itself (1 bit, for the rate-distortion
        # curve) and on the probabilistic layer's residual mixture (deltas where tau allows, values elsewhere)
        hat, nbytes = kvcodec_lossy(tail, 1, layers, heads)
        finish("kvcodec-lossy1", hat, 8 * nbytes, u, j_trie, hit=u > 0)
        u_, xt, rt, mask = got
        mix = torch.where(mask[..., None], xt - rt, xt)
        for bits in (2, 1):
            y, nbytes = kvcodec_lossy(mix, bits, layers, heads)
            hat = torch.where(mask[..., None], rt + y, y)
            finish(f"plt-tau+kvcodec-lossy{bits}", hat, 8 * nbytes + mask.numel(), u_, tau_only.index, hit=True,
                   extra={"delta_fraction": float(mask.double().mean())})
    t_kvcodec = time.perf_counter() - t0
    wins = window_refs(s, library, u)
    ref = torch.zeros_like(tail)
    allowed = torch.zeros(tail.shape[:2], dtype=torch.bool)
    for w, (j, _) in enumerate(wins):
        if j is not None:
            sl = slice(w * WINDOW, min((w + 1) * WINDOW, N - u))
            ref[:, sl] = library[j].kv[:, u + sl.start:u + sl.stop].float()
            allowed[:, sl] = True
    mask = allowed & (vector_ratio(tail, ref) < TAU)
    n_acc = sum(j is not None for j, _ in wins)
    for d, x in ((2, 2), (0, 2)):
        hat, nb = code_mixed(tail, ref, mask, d, x, sink)
        finish(f"plt-window {d}/{x}", hat, nb, u, j_trie, extra_bytes=WINDOW_REF_BYTES * len(wins),
               hit=n_acc > 0, extra={"delta_fraction": float(mask.double().mean()),
                                     "windows_accepted": n_acc, "windows": len(wins)})
    log(f"{s.name}: u={u} lit_lcp={lit.lcp}{'' if lit.index is not None else '(miss)'} "
        f"cor={'hit' if cor.index is not None else 'miss'}({cor.normalized_distance:.2f}) windows {n_acc}/{len(wins)} "
        f"delta_frac={float(mask.double().mean()):.3f}; KL d2={rows['exact+direct2']['mean_kl_bits']:.4f} "
        f"tau2/2={rows['plt-tau 2/2']['mean_kl_bits']:.4f} (df {tau_frac:.2f}) "
        f"tau0/2={rows['plt-tau 0/2']['mean_kl_bits']:.4f} w2/2={rows['plt-window 2/2']['mean_kl_bits']:.4f} "
        f"kv2={rows.get('kvcodec-lossy2', {}).get('mean_kl_bits', float('nan')):.4f} "
        f"mix2={rows.get('plt-tau+kvcodec-lossy2', {}).get('mean_kl_bits', float('nan')):.4f} "
        f"({t_kvcodec:.0f}s kvcodec)")
    return {"session": s.name, "workload": s.workload, "family": s.family, "case": s.case, "edit": s.edit,
            "shared_prefix": u, "library_ref": library[j_trie].name, "prefix_max_abs_diff": prefix_diff,
            "corrected": {"index": cor.index, "lcp": cor.lcp, "normalized_distance": cor.normalized_distance},
            "literal": {"index": lit.index, "lcp": lit.lcp, "value_bits": lit.value_bits},
            "window_distances": [d for _, d in wins], "methods": rows}


def pair_stats(s: Session, c: Session, layers, heads, profile: bool = True) -> dict:
    """Delta statistics of member s against library session c (index-aligned, tail after their LCP); with
    ``profile``, per layer and distance bin too (kept for the member's exact-prefix reference only)."""
    m = plt.lcp_len(s.ids[:N], c.ids[:N])
    out = {"member": s.name, "library": c.name, "workload": s.workload, "case": s.case,
           "same_family": s.family == c.family, "lcp": m,
           "value_bits": plt.plt_value_bits(s.ids[:N], c.ids[:N], s.bits, c.bits),
           "tree_distance": plt.plt_tree_distance(s.ids[:N], c.ids[:N], s.bits, c.bits),
           "normalized_distance": plt.normalized_tree_distance(s.ids[:N], c.ids[:N], s.bits, c.bits)}
    if m >= N:
        return out
    x, r = s.kv[:, m:].float(), c.kv[:, m:].float()
    rv = vector_ratio(x, r)
    out.update(token_identity=float((s.ids[m:N] == c.ids[m:N]).double().mean()),
               median_ratio=float(rv.median()), mean_ratio=float(rv.mean()),
               fraction_below_tau=float((rv < TAU).double().mean()),
               fraction_below={str(t): float((rv < t).double().mean()) for t in (0.1, 0.25, 0.5, 1.0)})
    if not profile:
        return out
    # per layer, K and V separately (all heads of the layer together), by distance from the divergence point
    xl = x.reshape(layers, 2, heads, -1, x.shape[-1])
    rl = r.reshape(layers, 2, heads, -1, x.shape[-1])
    num = (xl - rl).pow(2).sum((2, 4)).sqrt()  # [L, 2, T]
    den = xl.pow(2).sum((2, 4)).sqrt().clamp_min(1e-30)
    lay = (num / den).numpy()
    out["per_layer_by_distance"] = {kv: {f"{a}-{b}": [float(np.median(lay[li, kvi, a:b])) if b > a and a < lay.shape[-1]
                                                      else None for li in range(layers)]
                                         for a, b in DIST_BINS}
                                    for kvi, kv in enumerate(("K", "V"))}
    return out


def online_clustering(sessions: list[Session], rng) -> dict:
    """Each rule clusters the workload's sessions online (seeded order): hit = joins an earlier centroid."""
    order = rng.permutation(len(sessions))
    rules = {"exact LCP>=16": ("exact", None), **{f"corrected theta={t}": ("corrected", t) for t in (0.1, 0.2, 0.3)},
             **{f"literal delta={d:g} bits": ("literal", d) for d in (4.0, 16.0, 64.0, 256.0)},
             **{f"window W={w} theta=0.2": ("window", w) for w in (32, 64, 128)}}
    out = {}
    for name, (kind, p) in rules.items():
        lib, hits, same, lcps = [], 0, 0, []
        for i in order:
            s = sessions[i]
            pairs = [(c.ids[:N], c.bits) for c in lib]
            idx, lcp = None, 0
            if lib:
                if kind == "exact":
                    ls = [plt.lcp_len(s.ids[:N], c.ids[:N]) for c in lib]
                    j = int(np.argmax(ls))
                    idx, lcp = (j, ls[j]) if ls[j] >= MIN_SHARE else (None, ls[j])
                elif kind == "corrected":
                    ch = plt.choose_centroid(s.ids[:N], s.bits, pairs, max_normalized_distance=p)
                    idx, lcp = ch.index, ch.lcp
                elif kind == "literal":
                    ch = plt.choose_centroid(s.ids[:N], s.bits, pairs, paper_literal_threshold=p)
                    idx, lcp = ch.index, ch.lcp
                else:
                    best = None
                    for j, c in enumerate(lib):
                        m = plt.lcp_len(s.ids[:N], c.ids[:N])
                        d = plt.window_tree_distances(s.ids[:N], c.ids[:N], s.bits, c.bits, p, start=m)
                        acc = float((d <= THETA).mean()) if d.size else 0.0
                        if acc > 0 and (best is None or acc > best[1]):
                            best = (j, acc, m)
                    if best is not None:
                        idx, lcp = best[0], best[2]
            if idx is None:
                lib.append(s)
            else:
                hits += 1
                same += lib[idx].family == s.family
                lcps.append(lcp)
        out[name] = {"hit_rate": hits / len(sessions), "centroids": len(lib), "hits_same_family": same,
                     "hits": hits, "mean_centroid_lcp": float(np.mean(lcps)) if lcps else None}
    return out


def storage_formula(members: list[dict], n_sessions: int, comps_per_token: int) -> dict:
    """1 - f (1 - l/n) against the counted bits, per coder, for one workload (library stored whole)."""
    S_tokens = n_sessions * N
    out = {}
    for coder, method, bits in (("lossless bf16", "exact+lossless", 16), ("direct 2-bit", "exact+direct2", 2),
                                ("plt-tau 2/2", "plt-tau 2/2", 2), ("plt-tau 0/2", "plt-tau 0/2", 2)):
        if any(method not in m["methods"] for m in members):
            continue
        per_token_whole = (16 * comps_per_token if bits == 16 else
                           bits * comps_per_token + 16 * comps_per_token / 64 / GROUP)  # codes + scales
        whole = S_tokens * per_token_whole / 8
        hits = [m for m in members if m["methods"][method]["clustered"]]
        f = len(hits) / n_sessions
        lbar = float(np.mean([m["methods"][method]["tail_tokens"] for m in hits])) if hits else float(N)
        predicted = 1 - f * (1 - lbar / N)
        n_lib = n_sessions - len(members)
        counted = n_lib * N * per_token_whole / 8 + sum(m["methods"][method]["bytes"] for m in members)
        out[coder] = {"f": f, "mean_tail_tokens": lbar, "n": N, "predicted_relative_storage": predicted,
                      "measured_relative_storage": counted / whole, "bytes_with_dedup": counted,
                      "bytes_without_dedup": whole}
    return out


def summarize(members: list[dict], group_key) -> dict:
    groups = {}
    for m in members:
        groups.setdefault(group_key(m), []).append(m)
    out = {}
    for g, ms in groups.items():
        names = list(dict.fromkeys(k for m in ms for k in m["methods"]))
        out[g] = {}
        for name in names:
            rs = [m["methods"][name] for m in ms if name in m["methods"]]
            tot_bytes = sum(r["bytes"] for r in rs)
            tail_comps = sum(8 * r["bytes"] / r["bits_per_tail_component"] for r in rs if r["bits_per_tail_component"])
            out[g][name] = {
                "members": len(rs), "bytes": tot_bytes,
                "bits_per_tail_component": 8 * tot_bytes / tail_comps if tail_comps else 0.0,
                "compression_ratio": sum(r["compression_ratio"] * r["bytes"] for r in rs) / tot_bytes,
                "rel_error_tail": float(np.mean([r["rel_error_tail"] for r in rs])),
                "mean_kl_bits": float(np.mean([r["mean_kl_bits"] for r in rs])),
                "median_kl_bits": float(np.median([r["mean_kl_bits"] for r in rs])),
                "top1_agreement": float(np.mean([r["top1_agreement"] for r in rs])),
                "hit_rate": float(np.mean([bool(r["hit"]) for r in rs])),
                "delta_fraction": float(np.mean([r.get("delta_fraction", 0.0) for r in rs])),
            }
    return out


def correlations(pairs: list[dict]) -> dict:
    ps = [p for p in pairs if "median_ratio" in p]
    y = [p["median_ratio"] for p in ps]
    y2 = [p["fraction_below_tau"] for p in ps]
    xs = {k: [p[k] for p in ps] for k in ("value_bits", "lcp", "tree_distance", "normalized_distance",
                                            "token_identity")}
    return {"pairs": len(ps),
            "spearman_median_ratio": {k: spearman(v, y) for k, v in xs.items()},
            "spearman_fraction_below_tau": {k: spearman(v, y2) for k, v in xs.items()},
            "partial_spearman_median_ratio_given_lcp": {
                "value_bits": partial_spearman(xs["value_bits"], y, xs["lcp"]),
                "tree_distance": partial_spearman(xs["tree_distance"], y, xs["lcp"]),
                "token_identity": partial_spearman(xs["token_identity"], y, xs["lcp"])},
            "partial_spearman_median_ratio_given_token_identity": {
                k: partial_spearman(xs[k], y, xs["token_identity"]) for k in ("value_bits", "lcp", "tree_distance")}}


def layer_profile(pairs: list[dict], layers: int) -> dict:
    """Per case: median over its reference pairs of the per-layer ratio, per distance bin, K and V."""
    out = {}
    by = {}
    for p in pairs:
        if p.get("reference") and "per_layer_by_distance" in p:
            by.setdefault(p["case"], []).append(p)
    for case, ps in by.items():
        out[case] = {}
        for kv in ("K", "V"):
            out[case][kv] = {}
            for a, b in DIST_BINS:
                key = f"{a}-{b}"
                vals = np.array([[np.nan if v is None else v for v in p["per_layer_by_distance"][kv][key]]
                                 for p in ps], dtype=np.float64)
                with np.errstate(all="ignore"):
                    med = np.nanmedian(vals, 0) if np.isfinite(vals).any() else np.full(layers, np.nan)
                out[case][kv][key] = [None if not np.isfinite(v) else float(v) for v in med]
    return out


def clean(x):
    """JSON-safe: numpy scalars to Python, NaN / inf to None, floats to 8 significant digits."""
    if isinstance(x, dict):
        return {str(k): clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
    if isinstance(x, (np.floating, float)):
        return float(f"{float(x):.8g}") if math.isfinite(float(x)) else None
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, np.bool_):
        return bool(x)
    return x


def dump_json(res: dict) -> str:
    """Indented JSON with lists of numbers kept on one line."""
    text = json.dumps(clean(res), indent=1, allow_nan=False, ensure_ascii=False)
    return re.sub(r"\[\s*((?:-?[0-9.eE+-]+|null)(?:,\s*(?:-?[0-9.eE+-]+|null))*)\s*\]",
                  lambda m: "[" + ", ".join(v.strip() for v in m.group(1).split(",")) + "]", text) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs/plt_layer.json", help="JSON report; the .md goes beside it")
    ap.add_argument("--corpus", default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--paper-literal-threshold", type=float, default=LITERAL_DELTA,
                    help="delta (bits) of the paper's literal rule d_T <= delta")
    ap.add_argument("--skip-kvcodec-lossy", action="store_true")
    ap.add_argument("--limit", type=int, default=0, help="members per workload (0: all); for a quick look")
    ap.add_argument("--report-only", action="store_true", help="rewrite the .md from the existing --out JSON")
    args = ap.parse_args()
    if args.report_only:
        out = Path(args.out)
        out.with_suffix(".md").write_text(to_markdown(json.loads(out.read_text())))
        print(f"wrote {out.with_suffix('.md')}")
        return 0
    args.direct_bits = [1, 2, 3]
    args.plt_bits = [(2, 2), (1, 1), (1, 2), (0, 2)]
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    t_start = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t_start:6.0f}s] {msg}", flush=True)

    corpus = corpus_dir(args.corpus) or corpus_dir(str(ROOT.parent / "shared" / "corpus"))
    if corpus is None:
        print("plt_layer: corpus not found; pass --corpus DIR or set KVCODEC_CORPUS")
        return 1
    dtype = getattr(torch, args.dtype)
    model, tok = kvcodec.load_model("smollm2", dtype=dtype)
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    sessions = build_workloads(tok, corpus, args.seed)
    if args.limit:
        keep, count = [], {}
        for s in sessions:
            if s.role == "member":
                count[s.workload] = count.get(s.workload, 0) + 1
                if count[s.workload] > args.limit:
                    continue
            keep.append(s)
        sessions = keep
    log(f"{len(sessions)} sessions; prefilling ({args.dtype})")
    prefill_all(model, sessions)
    comps_per_token = sessions[0].kv.numel() // N
    log("prefilled")
    members, pairs, clustering, formula = [], [], {}, {}
    rng = np.random.default_rng(args.seed)
    for wl in ("system_prompt", "near_duplicate", "unrelated"):
        ss = [s for s in sessions if s.workload == wl]
        library = [s for s in ss if s.role == "library"]
        wl_members = []
        for s in ss:
            if s.role != "member":
                continue
            r = study_member(model, s, library, layers, heads, args, log)
            wl_members.append(r)
            for c in library:
                p = pair_stats(s, c, layers, heads, profile=c.name == r["library_ref"])
                p["reference"] = c.name == r["library_ref"]
                pairs.append(p)
        members += wl_members
        clustering[wl] = online_clustering(ss, rng)
        formula[wl] = storage_formula(wl_members, len(ss), comps_per_token)
    res = {
        "command": "python scripts/studies/plt_layer.py " + " ".join(sys.argv[1:]),
        "model": f"SmolLM2-135M-Instruct ({args.dtype})", "machine": platform.machine(),
        "torch_threads": torch.get_num_threads(), "seed": args.seed,
        "settings": {"N": N, "continuation": CONT, "min_share_tokens": MIN_SHARE, "tau": TAU, "theta": THETA,
                     "window": WINDOW, "paper_literal_threshold_bits": args.paper_literal_threshold,
                     "group": GROUP, "scale_bits": plt.SCALE_BITS, "rotation": "randomized Hadamard, seed 0",
                     "meta_bytes_per_member": META_BYTES, "window_ref_bytes": WINDOW_REF_BYTES,
                     "components_per_token": comps_per_token, "lookup": "brute force (faiss not installed)"},
        "sessions": [{"name": s.name, "workload": s.workload, "family": s.family, "role": s.role, "case": s.case,
                      "edit": s.edit, "bits_total": float(s.bits.sum())} for s in sessions],
        "summary_by_workload": summarize(members, lambda m: m["workload"]),
        "summary_by_case": summarize(members, lambda m: f"{m['workload']}/{m['case']}"),
        "members": members, "pairs": pairs,
        "correlations": {"all": correlations(pairs),
                         **{wl: correlations([p for p in pairs if p["workload"] == wl])
                            for wl in ("system_prompt", "near_duplicate", "unrelated")}},
        "layer_profile": layer_profile(pairs, layers),
        "online_clustering": clustering, "storage_formula": formula,
        "seconds": time.perf_counter() - t_start,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dump_json(res))
    md = out.with_suffix(".md")
    md.write_text(to_markdown(res))
    log(f"wrote {out} and {md}")
    return 0


# ------------------------------------------------------------------------------------------------ report


METHOD_ORDER = ["exact+lossless", "exact+direct1", "exact+direct2", "exact+direct3", "kvcodec-lossy1",
                "kvcodec-lossy2", "plt-literal 2/2", "plt-session 2/2", "plt-session 0/2", "plt-tau 2/2", "plt-tau 1/2",
                "plt-tau 1/1", "plt-tau 0/2", "plt-window 2/2", "plt-window 0/2", "plt-tau+kvcodec-lossy1",
                "plt-tau+kvcodec-lossy2"]
GROUPS = [("system_prompt", "(a) shared system prompt, distinct conversations"),
          ("near_duplicate/sub_same_early", "(b) word substituted at ~token 24, later tokens keep their index"),
          ("near_duplicate/sub_same_late", "(b) word substituted at ~token 160, later tokens keep their index"),
          ("near_duplicate/sub_shift_early", "(b) word -> two words at ~token 24 (later tokens shift)"),
          ("near_duplicate/insert_early", "(b) GPL sentence inserted at ~token 24 (later tokens shift)"),
          ("unrelated", "(c) unrelated texts")]


def _f(v, nd=3):
    if v is None:
        return "–"
    if isinstance(v, float) and (v != v):
        return "–"
    return f"{v:.{nd}f}"


def _group(res, key):
    return res["summary_by_workload"].get(key) or res["summary_by_case"].get(key) or {}


def rd_points(summ: dict) -> dict:
    """name -> (bits per tail component, mean KL)."""
    return {k: (v["bits_per_tail_component"], v["mean_kl_bits"]) for k, v in summ.items()}


def verdict_numbers(res: dict) -> dict:
    """The comparisons the verdict rests on, per group: equal bits and equal KL."""
    out = {}
    for key, _ in GROUPS:
        g = _group(res, key)
        if not g:
            continue
        d2, t2 = g.get("exact+direct2"), g.get("plt-tau 2/2")
        row = {"direct2_kl": d2 and d2["mean_kl_bits"], "direct2_bits": d2 and d2["bits_per_tail_component"],
               "tau2_kl": t2 and t2["mean_kl_bits"], "tau2_bits": t2 and t2["bits_per_tail_component"],
               "kvcodec2_kl": g.get("kvcodec-lossy2", {}).get("mean_kl_bits"),
               "kvcodec2_bits": g.get("kvcodec-lossy2", {}).get("bits_per_tail_component"),
               "mix2_kl": g.get("plt-tau+kvcodec-lossy2", {}).get("mean_kl_bits"),
               "mix2_bits": g.get("plt-tau+kvcodec-lossy2", {}).get("bits_per_tail_component"),
               "tau_delta_fraction": t2 and t2["delta_fraction"]}
        # the cheapest probabilistic-layer variant at least as good (KL) as each direct coder at ~2 bits
        for ref in ("exact+direct2", "kvcodec-lossy2"):
            if ref not in g:
                continue
            ok = [(v["bits_per_tail_component"], k) for k, v in g.items()
                  if k.startswith("plt") and v["mean_kl_bits"] <= g[ref]["mean_kl_bits"]]
            row[f"cheapest_plt_matching_{ref}"] = (min(ok)[1], min(ok)[0]) if ok else None
        out[key] = row
    return out


def to_markdown(res: dict) -> str:
    st = res["settings"]
    L = []
    w = L.append
    w("# Layer 1 of the seed paper (probabilistic prefix deduplication), measured")
    w("")
    w(f"`{res['command']}` — {res['model']}, one CPU thread, seed {res['seed']}, {res['seconds'] / 60:.1f} min. "
      f"Sessions of {st['N']} tokens of real corpus text, KL measured on the next {st['continuation']} tokens "
      "teacher-forced on top of the reconstructed cache against the member's own exact cache (mean over "
      "positions of KL(P_exact || P_method), bits). Library sessions are stored exactly (the favourable case "
      "for every method). Protocol and method names: the script's docstring.")
    w("")
    w(f"Settings: tau = {st['tau']} (per layer/head/K-V vector), corrected gate theta = {st['theta']} on "
      f"d_tree / (I(s) + I(c)), windows of {st['window']} tokens, `paper_literal_threshold` = "
      f"{st['paper_literal_threshold_bits']:g} bits, exact prefixes shared from {st['min_share_tokens']} tokens; "
      f"quantizer: {st['rotation']} rotation, one float16 scale per {st['group']} vectors of 64, "
      f"{st['components_per_token']} components per token. Lookup: {st['lookup']}.")
    w("")
    w("## Verdict")
    w("")
    w(verdict(res))
    w("")
    w("## Side by side")
    w("")
    w("Per group of members: bits per *tail* component (everything counted: codes, scales, flags, window "
      "references, 8 bytes of reference + prefix length; kvcodec: its whole file), compression ratio "
      "(bfloat16 bytes of the whole member session / stored bytes: the shared prefix costs nothing), mean "
      "relative error of the tail ||KV^ - KV|| / ||KV||, mean KL (bits/token), top-1 agreement, hit rate "
      "(members for which the method's rule found a reference; for exact: a shared prefix of >= 16 tokens), "
      "and the fraction of tail vectors coded as deltas. `d/x`: delta bits / direct bits.")
    for key, title in GROUPS:
        g = _group(res, key)
        if not g:
            continue
        n = max(v["members"] for v in g.values())
        w("")
        w(f"### {title} — {n} members")
        w("")
        w("| method | bits/tail comp | ratio | rel. error | mean KL | top-1 | hit rate | delta frac |")
        w("|---|---:|---:|---:|---:|---:|---:|---:|")
        for name in [m for m in METHOD_ORDER if m in g] + [m for m in g if m not in METHOD_ORDER]:
            v = g[name]
            star = "" if v["members"] == n else f" ({v['members']})"
            w(f"| {name}{star} | {_f(v['bits_per_tail_component'])} | {_f(v['compression_ratio'], 2)} | "
              f"{_f(v['rel_error_tail'])} | {_f(v['mean_kl_bits'], 4)} | {_f(v['top1_agreement'])} | "
              f"{_f(v['hit_rate'], 2)} | {_f(v['delta_fraction'], 3)} |")
    lossless = [m["methods"]["exact+lossless"] for m in res["members"]]
    w("")
    ll_bits = sum(r["kvcodec_lossless_bytes"] for r in lossless) * 8 / sum(8 * r["bytes"] / 16 for r in lossless)
    maxdiff = max(m["prefix_max_abs_diff"] for m in res["members"])
    w(f"kvcodec's lossless tier on the same tails: {ll_bits:.2f} bits per tail component over all members "
      "(raw bfloat16: 16). Exact prefixes: the library session's KV for the shared positions equals the member's "
      f"own bit for bit (max |difference| over all members: {maxdiff:g}), so "
      "exact+lossless has KL 0 as it must.")
    w("")
    w("## Members")
    w("")
    w("| member | edit | shared prefix | corrected d̂ | literal centroid LCP | tau delta frac | KL direct2 | "
      "KL plt-tau 2/2 | KL plt-tau 0/2 | KL kvcodec2 |")
    w("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for m in res["members"]:
        r = m["methods"]
        e = m["edit"].get("edit", "") if m["edit"] else ""
        e = (e[:40] + "…") if len(e) > 41 else e
        if m["edit"] and "shift" in m["edit"]:
            e += f" (token {m['edit']['token']}, shift {m['edit']['shift']})"
        w(f"| {m['session']} | {e.replace('|', '/')} | {m['shared_prefix']} | "
          f"{_f(m['corrected']['normalized_distance'], 2)} | {m['literal']['lcp']} | "
          f"{_f(r['plt-tau 2/2']['delta_fraction'], 2)} | {_f(r['exact+direct2']['mean_kl_bits'], 4)} | "
          f"{_f(r['plt-tau 2/2']['mean_kl_bits'], 4)} | {_f(r['plt-tau 0/2']['mean_kl_bits'], 4)} | "
          f"{_f(r.get('kvcodec-lossy2', {}).get('mean_kl_bits'), 4)} |")
    w("")
    w("## ||delta|| / ||KV|| after the divergence point")
    w("")
    w("Per layer, keys and values separately (all heads of the layer together), median over the positions of a "
      "distance bin (tokens after the first differing token) and over the members of a case, against the "
      "member's exact-prefix reference. Mean over the 30 layers, then layers 0 / 15 / 29:")
    w("")
    prof = res["layer_profile"]
    bins = list(next(iter(prof.values()))["K"].keys()) if prof else []
    w("| case | K/V | layer | " + " | ".join(f"d {b}" for b in bins) + " |")
    w("|---|---|---|" + "---:|" * len(bins))
    for case, kvs in prof.items():
        for kv in ("K", "V"):
            cells = []
            for b in bins:
                vals = [v for v in kvs[kv][b] if v is not None]
                cells.append(_f(float(np.mean(vals)), 3) if vals else "–")
            w(f"| {case} | {kv} | mean | " + " | ".join(cells) + " |")
            for li in (0, 15, 29):
                w(f"| {case} | {kv} | {li} | " + " | ".join(_f(kvs[kv][b][li], 3) for b in bins) + " |")
    w("")
    w("## What predicts the delta ratio")
    w("")
    w("Spearman correlation, over (member, library session) pairs, of the median per-vector ||delta|| / ||KV|| "
      "of the pair's tail (after their LCP) with each quantity; then partial correlations (ranks, linear "
      "effect of the named variable removed). token identity = fraction of tail positions holding the same "
      "token id in both (index-aligned).")
    w("")
    w("| pairs | n | d_T (value bits) | LCP length | d_tree | d_tree normalised | token identity | "
      "d_T given LCP | d_tree given LCP | token identity given LCP | d_T given token identity | "
      "LCP given token identity |")
    w("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for k, c in res["correlations"].items():
        sp, pl, pt = (c["spearman_median_ratio"], c["partial_spearman_median_ratio_given_lcp"],
                      c["partial_spearman_median_ratio_given_token_identity"])
        w(f"| {k} | {c['pairs']} | {_f(sp['value_bits'], 2)} | {_f(sp['lcp'], 2)} | {_f(sp['tree_distance'], 2)} | "
          f"{_f(sp['normalized_distance'], 2)} | {_f(sp['token_identity'], 2)} | {_f(pl['value_bits'], 2)} | "
          f"{_f(pl['tree_distance'], 2)} | {_f(pl['token_identity'], 2)} | {_f(pt['value_bits'], 2)} | "
          f"{_f(pt['lcp'], 2)} |")
    w("")
    w("## Online clustering: hit rate of each rule")
    w("")
    w("Every session of a workload in a seeded random order; a session joins the centroid its rule picks, or "
      "becomes a centroid. hit rate = joined / sessions; same family = joins whose centroid is of the member's "
      "own family (same system prompt / same base text); LCP = mean shared prefix with the chosen centroid.")
    w("")
    wls = list(res["online_clustering"])
    w("| rule | " + " | ".join(f"{x}: hit rate (same family) / LCP" for x in wls) + " |")
    w("|---|" + "---:|" * len(wls))
    for rule in res["online_clustering"][wls[0]]:
        cells = []
        for x in wls:
            v = res["online_clustering"][x][rule]
            cells.append(f"{v['hit_rate']:.2f} ({v['hits_same_family']}/{v['hits']}) / "
                         f"{_f(v['mean_centroid_lcp'], 0)}")
        w(f"| {rule} | " + " | ".join(cells) + " |")
    w("")
    w("## The storage formula 1 − f (1 − ℓ̄/n) against counted bytes")
    w("")
    w("Per workload (library + members, library stored whole by the same coder): f = sessions that share a "
      "prefix or found a centroid / all sessions, ℓ̄ = their mean tail after the shared prefix, n = "
      f"{st['N']}.")
    w("")
    w("| workload | coder | f | ℓ̄ | predicted | measured |")
    w("|---|---|---:|---:|---:|---:|")
    for x, coders in res["storage_formula"].items():
        for coder, v in coders.items():
            w(f"| {x} | {coder} | {v['f']:.3f} | {v['mean_tail_tokens']:.1f} | "
              f"{v['predicted_relative_storage']:.4f} | {v['measured_relative_storage']:.4f} |")
    w("")
    w("## Caveats")
    w("")
    w(caveats(res))
    return "\n".join(L) + "\n"


def _pairs(res, case, key):
    ps = [p[key] for p in res["pairs"] if p["case"] == case and p.get("reference") and key in p]
    return float(np.median(ps)) if ps else float("nan")


def verdict(res: dict) -> str:
    """The verdict, its numbers read from the results (the wording was written against the seed-0 run)."""
    G = {k: _group(res, k) for k, _ in GROUPS}
    a, se, sl = G["system_prompt"], G["near_duplicate/sub_same_early"], G["near_duplicate/sub_same_late"]
    sh, ins, c = G["near_duplicate/sub_shift_early"], G["near_duplicate/insert_early"], G["unrelated"]

    def kl(g, m):
        return g[m]["mean_kl_bits"]

    def bpc(g, m):
        return g[m]["bits_per_tail_component"]

    members = res["members"]
    pays = [m for m in members if m["methods"]["plt-tau 2/2"]["mean_kl_bits"]
            < 0.5 * min(m["methods"]["exact+direct2"]["mean_kl_bits"],
                        m["methods"].get("kvcodec-lossy2", {}).get("mean_kl_bits", float("inf")))]
    sub_same = [m for m in members if m["case"].startswith("sub_same")]
    dhat = [m["corrected"]["normalized_distance"] for m in sub_same]
    lit_lcp = [m["literal"]["lcp"] for m in members]
    oc = res["online_clustering"]
    lit16 = {w: oc[w]["literal delta=16 bits"] for w in oc}
    corr = res["correlations"]["all"]
    sf = res["storage_formula"]
    prof = res["layer_profile"].get("sub_same_early", {})

    def prof_at(kv, b, li):
        return prof[kv][b][li] if prof else float("nan")

    def bin_mean(case, kv, b):
        vals = [v for v in res["layer_profile"].get(case, {}).get(kv, {}).get(b, []) if v is not None]
        return float(np.mean(vals)) if vals else float("nan")

    def count(case_prefix):
        return sum(m["case"].startswith(case_prefix) for m in members)

    def shifts(case_prefix):
        v = sorted({m["edit"].get("shift") for m in members if m["case"].startswith(case_prefix)})
        return ", ".join(str(x) for x in v)

    sib_d = [m["corrected"]["normalized_distance"] for m in members if m["case"] == "sibling"]
    cor_max = max(oc[w][f"corrected theta={t}"]["hit_rate"] for w in oc for t in (0.1, 0.2, 0.3))
    cor_txt = ("0 in every workload at every threshold tried" if cor_max == 0 else
               f"at most {cor_max:.2f} over the workloads and thresholds tried")

    def fam(name):
        return name.split("/")[1] if name[:2] in ("a/", "b/") else name

    lit_rows = [m for m in members if m["methods"]["plt-literal 2/2"].get("centroid")]
    lit_wrong = sum(fam(m["methods"]["plt-literal 2/2"]["centroid"]) != m["family"] for m in lit_rows)
    sf_a, sf_b = sf["system_prompt"]["lossless bf16"], sf["near_duplicate"]["lossless bf16"]
    tok_after_lcp = corr["partial_spearman_median_ratio_given_lcp"]["token_identity"]

    out = [
        f"**The probabilistic layer pays in one situation only, and not by the paper's rule.** It measurably "
        f"beats exact-prefix dedup + direct lossy coding at equal bits for {len(pays)} of {len(members)} members: "
        "the near-duplicates whose edit keeps every later token at its index (a word replaced by a word of the "
        "same token count, the paper's \"a helpful\" / \"an AI\" case). Everywhere else (shared system prompt "
        "then a different conversation, an edit that shifts later tokens, unrelated texts) the index-aligned "
        "deltas after the divergence point are as large as the KV itself and the layer adds nothing but flag "
        "bits. And the sessions where it pays are found by the per-vector tau test against the longest-LCP "
        "session, i.e. by index-aligned token identity, not by d_T (the paper's rule) nor by d_tree.",
        "",
        f"- **Same-length substitution ({count('sub_same')} members), equal bits:** plt-tau 2/2 at "
        f"{bpc(se, 'plt-tau 2/2'):.2f} "
        f"bits per tail component has mean KL {kl(se, 'plt-tau 2/2'):.4f} (early edit) and "
        f"{kl(sl, 'plt-tau 2/2'):.4f} (late edit) bits/token, against {kl(se, 'exact+direct2'):.3f} / "
        f"{kl(sl, 'exact+direct2'):.3f} for the same quantizer on the tail itself and "
        f"{kl(se, 'kvcodec-lossy2'):.4f} / {kl(sl, 'kvcodec-lossy2'):.4f} for kvcodec's lossy tier at "
        f"{bpc(se, 'kvcodec-lossy2'):.2f} / {bpc(sl, 'kvcodec-lossy2'):.2f} bits; with kvcodec's coder on the "
        f"residual mixture, {kl(se, 'plt-tau+kvcodec-lossy2'):.4f} / {kl(sl, 'plt-tau+kvcodec-lossy2'):.4f}. "
        f"**Fewer bytes at equal KL:** storing nothing for the deltas (plt-tau 0/2: the centroid's KV reused "
        f"where tau allows, 2 bits elsewhere) costs {bpc(se, 'plt-tau 0/2'):.3f} / {bpc(sl, 'plt-tau 0/2'):.3f} "
        f"bits per tail component at KL {kl(se, 'plt-tau 0/2'):.4f} / {kl(sl, 'plt-tau 0/2'):.4f}, "
        f"{bpc(se, 'kvcodec-lossy2') / bpc(se, 'plt-tau 0/2'):.0f}x / "
        f"{bpc(sl, 'kvcodec-lossy2') / bpc(sl, 'plt-tau 0/2'):.0f}x fewer tail bytes than kvcodec lossy 2 at a "
        "lower KL. The reason: after such an edit the deltas die out with distance (keys, mean over layers: "
        f"{bin_mean('sub_same_early', 'K', '1-4'):.2f} at 1-3 tokens, {bin_mean('sub_same_early', 'K', '16-64'):.3f} "
        f"at 16-63, {bin_mean('sub_same_early', 'K', '128-384'):.3f} beyond 128; values "
        f"{bin_mean('sub_same_early', 'V', '1-4'):.2f} / {bin_mean('sub_same_early', 'V', '16-64'):.3f} / "
        f"{bin_mean('sub_same_early', 'V', '128-384'):.3f}), exactly 0 at layer 0 "
        "(its KV depends on the token and position only), and "
        f"{se['plt-tau 2/2']['delta_fraction']:.0%} of the tail vectors pass tau = 0.25.",
        f"- **Shared system prompt ({count('sibling')} members):** median per-vector ||delta|| / ||KV|| against "
        f"the sibling with the same prompt is {_pairs(res, 'sibling', 'median_ratio'):.2f} after divergence (keys "
        f"{bin_mean('sibling', 'K', '16-64'):.2f}, values {bin_mean('sibling', 'V', '16-64'):.2f} at 16-63 "
        f"tokens): deltas are no smaller than the KV. {a['plt-tau 2/2']['delta_fraction']:.1%} of tail vectors "
        f"pass tau; plt-tau 2/2 has KL {kl(a, 'plt-tau 2/2'):.4f} vs {kl(a, 'exact+direct2'):.4f} for "
        f"exact+direct2 at {bpc(a, 'plt-tau 2/2') - bpc(a, 'exact+direct2'):+.3f} bits. All the saving is the "
        f"exact prefix (compression ratio {a['exact+direct2']['compression_ratio']:.1f} vs "
        f"{c['exact+direct2']['compression_ratio']:.1f} for unrelated texts at the same coder).",
        f"- **Edits that shift later tokens ({count('sub_shift') + count('insert')} members):** a word made "
        f"two words (shift {shifts('sub_shift')}) or an inserted sentence (shift {shifts('insert')}): median "
        f"ratio {_pairs(res, 'sub_shift_early', 'median_ratio'):.2f} / "
        f"{_pairs(res, 'insert_early', 'median_ratio'):.2f}, {sh['plt-tau 2/2']['delta_fraction']:.1%} / "
        f"{ins['plt-tau 2/2']['delta_fraction']:.1%} of vectors pass tau, KL {kl(sh, 'plt-tau 2/2'):.3f} / "
        f"{kl(ins, 'plt-tau 2/2'):.3f} vs {kl(sh, 'exact+direct2'):.3f} / {kl(ins, 'exact+direct2'):.3f} "
        "direct: index alignment, the only alignment the paper's deltas have, is lost and so is the gain. "
        "Paraphrases in general (the paper's \"semantically equivalent prefixes\") are this case.",
        f"- **The paper's rule d_T <= delta (`paper_literal_threshold` = 16 bits) picks a centroid of another "
        f"family for {lit_wrong} of {len(members)} members:** the centroid it chooses shares "
        f"{min(lit_lcp)}-{max(lit_lcp)} tokens with the member "
        f"(d_T is the bits of the shared prefix, so the session sharing least wins); online clustering with it "
        f"joins {lit16['unrelated']['hit_rate']:.0%} of unrelated texts into clusters and puts "
        f"{lit16['system_prompt']['hits_same_family']} of {lit16['system_prompt']['hits']} system-prompt "
        f"sessions and {lit16['near_duplicate']['hits_same_family']} of {lit16['near_duplicate']['hits']} "
        "near-duplicates with their own family. Coded that way a member loses its exact prefix: compression "
        f"ratio {a['plt-literal 2/2']['compression_ratio']:.2f} vs {a['exact+direct2']['compression_ratio']:.2f} "
        f"for exact dedup on (a), at a higher KL ({kl(a, 'plt-literal 2/2'):.3f} vs {kl(a, 'exact+direct2'):.3f}).",
        f"- **The corrected rule (normalised d_tree <= 0.1-0.3) finds nothing:** d̂ is "
        f"{min(dhat):.2f}-{max(dhat):.2f} for the same-length substitutions (d_tree counts every bit after the "
        "first differing token; a prefix distance cannot see that the text re-synchronises) and "
        f"{min(sib_d):.2f}-{max(sib_d):.2f} for the system-prompt siblings; its online hit rate is {cor_txt}. "
        "Windows of 32-128 tokens re-synchronise at window boundaries and "
        f"find the {count('sub_same')} good members (online hit rate "
        f"{oc['near_duplicate']['window W=64 theta=0.2']['hit_rate']:.2f} on the near-duplicate workload, all "
        "in the right family), but lose the window holding the edit: plt-window 2/2 has KL "
        f"{kl(se, 'plt-window 2/2'):.4f} / {kl(sl, 'plt-window 2/2'):.4f} vs {kl(se, 'plt-tau 2/2'):.4f} / "
        f"{kl(sl, 'plt-tau 2/2'):.4f} for the tau test alone.",
        f"- **d_T adds nothing beyond LCP length** (reviewer hypothesis 3 holds): over all {corr['pairs']} "
        f"(member, library) pairs the Spearman correlation of the delta ratio is "
        f"{corr['spearman_median_ratio']['value_bits']:.2f} with d_T and "
        f"{corr['spearman_median_ratio']['lcp']:.2f} with LCP length, and "
        f"{corr['partial_spearman_median_ratio_given_lcp']['value_bits']:.2f} for d_T once LCP is accounted "
        f"for; index-aligned token identity keeps {tok_after_lcp:.2f} after LCP. (Within the near-duplicate "
        "workload LCP and d_T still carry the family: a shifted copy of the same text has somewhat smaller "
        f"deltas than another text, median {_pairs(res, 'sub_shift_early', 'median_ratio'):.2f} / "
        f"{_pairs(res, 'insert_early', 'median_ratio'):.2f} vs {_pairs(res, 'unrelated', 'median_ratio'):.2f}, "
        "all far above tau.)",
        f"- **Storage formula 1 - f(1 - l/n):** it matches counted bytes for exact-prefix dedup to the "
        f"fourth digit (system prompt: predicted {sf_a['predicted_relative_storage']:.4f}, measured "
        f"{sf_a['measured_relative_storage']:.4f}; near-duplicates {sf_b['predicted_relative_storage']:.4f} / "
        f"{sf_b['measured_relative_storage']:.4f}) because it is the arithmetic "
        "of shared prefixes. It says nothing about the tail-delta mode: at a fixed rate deltas cost what values "
        f"cost (plt-tau 2/2: {sf['near_duplicate']['plt-tau 2/2']['measured_relative_storage']:.4f}, flags "
        "included); bytes fall only when deltas get fewer bits (plt-tau 0/2: "
        f"{sf['near_duplicate']['plt-tau 0/2']['measured_relative_storage']:.4f} on the near-duplicate workload).",
        f"- **Lipschitz bound kappa^l:** after a same-length substitution the key delta ratio at 4-15 tokens "
        f"grows from {prof_at('K', '4-16', 0):.2f} at layer 0 to {prof_at('K', '4-16', 15):.3f} at layer 15 and "
        f"{prof_at('K', '4-16', 29):.3f} at layer 29 (values {prof_at('V', '4-16', 15):.3f} / "
        f"{prof_at('V', '4-16', 29):.3f}): small and roughly linear in depth, not geometric. The paper's "
        "exponential bound (constants deferred) is not contradicted but says nothing useful at this size.",
        "",
        "**What to build, if anything:** exact-prefix sharing (already the store's job) plus, as an option, "
        "*index-aligned reuse after a same-length edit*: the encoder compares each tail vector with the "
        "longest-LCP cached session's vector at the same position and, where ||delta|| / ||KV|| < 0.25, stores "
        "a flag (and at most 1-2 bits of delta) instead of the vector. No PLT distance is involved; the workload "
        "that benefits (templated prompts with a substituted word or name of the same token length) must exist "
        "in the deployment for the flags to pay.",
    ]
    return "\n".join(out)


def caveats(res: dict) -> str:
    return "\n".join([
        "- One small model (SmolLM2-135M, 30 layers, 3 KV heads of 64), bfloat16 (the serving dtype) on CPU, "
        f"one seed, {len(res['members'])} members of 384 tokens; KL on 64 teacher-forced tokens. The six "
        "same-length substitutions carry the positive result; a larger model's deltas may decay differently.",
        "- The library (centroids) is stored exactly. In a store that keeps everything at 2 bits the reference "
        "itself is lossy and a delta inherits its error; both dedup methods get the favourable case here.",
        "- The quantizer of `kvcodec.plt` (Hadamard rotation, one float16 RMS scale per 8 vectors, uniform "
        "mid-rise, Gaussian-optimal step) is deliberately plain: at 2 bits it has 4-8x the KL of kvcodec's "
        "lossy tier. The conclusions hold with both coders (the `plt-tau+kvcodec-lossy*` rows put kvcodec's "
        "coder on the probabilistic layer's residuals); kvcodec-lossy1 and the mixture rows were run only for "
        "members where >= 1% of vectors pass tau (where they can differ).",
        "- Edits are programmatic: a word of the text replaced by another word of the same text (checked to "
        "keep every later token at its index, or to shift them), or the GPL's first sentence inserted; "
        "grammar may suffer, the rest of each session is real corpus text.",
        "- A tail that starts at position 0 (no shared prefix) keeps its first token exact (16 bits), as "
        "kvcodec's lossy tier does (sink = 1): without it the attention-sink vector dominates the KL of the "
        "plain quantizer and a delta against *any* session's first token would look like a win (the "
        "'unrelated' d 0-1 column: the sink vectors of different texts are nearly equal from layer 1 on).",
        "- Lookup is brute force over at most four library sessions per workload: FAISS is not installed here "
        "and not needed at this scale. Cross-tenant safety (sharing approximate KV across users) is not "
        "addressed, as in the paper.",
    ])


if __name__ == "__main__":
    raise SystemExit(main())
