"""`kvz bench --reduce-turns`: the reduce tier as agent memory - one reduction, then a conversation.

Each document (corpus files the reduce bench does not use: it takes the first ``--documents`` long enough, this
bench the next ones, so nothing here was measured while the methods were chosen) gets three needle sentences
("The access code for the <colour> <object> is <5 digits>.", at 15 %, 50 % and 85 % of its lines) and two cloze
questions (a line quoted by its first six words, the next four asked).  Its cache is reduced **once**, before any
question; then the five questions are asked one after the other on that same cache, each question and its
reference answer teacher-forced and left in the cache (as a chat keeps its turns), so later turns run on a cache
that has grown by the earlier turns - and, for a bounded method, that has compacted them into its budget.

Per turn: the answer's log2-likelihood (primary; paired with the full cache, which grows with every turn), greedy
exact match of the answer (on a copy of the cache), and the entries the cache holds per KV head after the turn.
Per method: reduce time and the peak of the process's resident memory above what it held before the call, per
1,000 tokens of the document (the replay, the recovery of the token ids and the fit included where the method
runs them).

``default`` is ``kvcodec.reduce(cache, model, keep=KEEP)`` with nothing else (kvzip, its fit and its bound, the
token ids recovered from the cache); the other methods get the document's token ids.
"""

from __future__ import annotations

import copy
import math
import os
import threading
import time

import numpy as np
import torch

from .bench_reduce import COLOURS, OBJECTS, lines_at
from .common import missing_corpus, selected_files, write_report

METHODS = ["default", "kvzip,nobound", "kvzip,nofit", "snapkv,fit", "snapkv", "tova,fit", "streaming", "cluster"]
DEPTHS = (0.15, 0.5, 0.85)
CLOZE = (0.3, 0.7)


def make_conversations(tok, files, context: int, documents: int, skip: int, seed: int = 0) -> list[dict]:
    """Per document: the text with its needles and the five turns (questions, in a seeded order)."""
    rng = np.random.default_rng(seed)
    out, long_enough = [], 0
    for f in files:
        raw = f.read_text(encoding="utf-8", errors="replace")
        ids = tok(raw, add_special_tokens=False)["input_ids"]
        if len(ids) < context + 64:
            continue
        long_enough += 1
        if long_enough <= skip:
            continue
        text = tok.decode(ids[:context])
        turns = []
        lines = [(i, ln) for i, ln in enumerate(text.split("\n")) if len(ln.split()) >= 10]
        starts = np.cumsum([0] + [len(ln) + 1 for ln in text.split("\n")])
        for d in CLOZE:
            if lines:
                i, ln = min(lines, key=lambda t: abs(starts[t[0]] - d * len(text)))
                w = ln.split()
                turns.append({"kind": "cloze", "depth": d,
                              "question": f'In the text above, which words come right after "{" ".join(w[:6])}"?',
                              "lead": "", "answer": " ".join(w[6:10])})
        picks = rng.permutation(len(COLOURS) * len(OBJECTS))[:len(DEPTHS)]
        for d in sorted(DEPTHS, reverse=True):  # inserted from the end, so the earlier positions hold
            p = int(picks[len(turns) % len(DEPTHS)])
            colour, obj = COLOURS[p // len(OBJECTS)], OBJECTS[p % len(OBJECTS)]
            code = "".join(str(x) for x in rng.integers(0, 10, 5))
            at = lines_at(text, d)
            text = text[:at] + f"The access code for the {colour} {obj} is {code}.\n" + text[at:]
            turns.append({"kind": "needle", "depth": d, "question": f"What is the access code for the {colour} {obj}?",
                          "lead": f" The access code for the {colour} {obj} is", "answer": code})
        order = rng.permutation(len(turns))
        out.append({"file": f.name, "text": text, "turns": [turns[i] for i in order]})
        if len(out) == documents:
            break
    return out


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _trim() -> None:
    """Hand the memory freed so far back to the system (glibc's malloc_trim), so that the resident size before a
    call is what the process holds, not what an earlier call freed: the peak above it is then the call's."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def measured(fn):
    """(fn(), seconds, peak resident bytes above the start) - the process's RSS sampled every 5 ms, after the
    memory freed before the call was handed back."""
    _trim()
    base, peak, stop = _rss(), [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _rss())
            stop.wait(0.005)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    t0 = time.perf_counter()
    try:
        out = fn()
    finally:
        seconds = time.perf_counter() - t0
        stop.set()
        t.join()
    return out, seconds, max(0, max(peak[0], _rss()) - base)


def _ids(tok, text):
    return torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])


@torch.no_grad()
def _turn(model, cache, q_ids, a_ids):
    """(answer log2-likelihood, greedy exact match): the match on a copy; the question and the reference answer
    are then in ``cache`` (teacher-forced)."""
    from ..tokens.plan import cache_kwarg

    ka = cache_kwarg(model)
    probe = copy.deepcopy(cache)
    out, nxt = [], q_ids
    for _ in range(a_ids.shape[1]):
        t = int(model(nxt, **{ka: probe}).logits[0, -1].argmax())
        out.append(t)
        nxt = torch.tensor([[t]])
    logits = model(torch.cat([q_ids, a_ids], 1), **{ka: cache}).logits[0, q_ids.shape[1] - 1:-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, a_ids[0][:, None]).sum().item() / math.log(2)
    return lp, out == a_ids[0].tolist()


def _held(cache, n_full: int) -> float:
    return round(cache.counted(), 1) if hasattr(cache, "counted") else float(n_full)


def _fitted_summary(model, red, full, replay):
    """``cluster,fit``: a merge-reduce cache whose every entry (atoms, sinks, raw buffer) keeps its key while its
    value and log-weight are refitted to the whole cache's attention on kvzip's replay queries, as kvzip's
    selection is (an experiment: held as a one-shot cache, it no longer reduces what is appended)."""
    from ..reduction import Plan, ReducedCache, ReducedLayer
    from ..reduction import fit_layer
    from ..reduction.attention import scalings

    scale = scalings(model)
    plan = Plan(k=1, block=1, sinks=red.plan.sinks, method=None, form="dot")
    layers = []
    for i, la in enumerate(red.layers):
        if not isinstance(la, ReducedLayer):
            layers.append(la)
            continue
        k, v, beta = la.assemble()
        beta = torch.zeros(k.shape[:3]) if beta is None else beta
        gv, gb = fit_layer(full.layers[i].keys, full.layers[i].values, k, v, beta, replay.reference[i], scale[i])
        out = ReducedLayer(plan, i, scale[i])
        out.set_fixed(k, gv, la.get_seq_length(), gb)
        layers.append(out)
    return ReducedCache(model, plan, layers=layers, method="cluster")


def _reduce(model, method: str, full, ids, keep: float, replay):
    from ..reduction import reduce

    if method == "default":
        return reduce(full, model, keep=keep)
    name, *opts = method.split(",")
    kw = {"tokens": ids}
    for o in opts:
        if o == "nobound":
            kw["bound"] = False
        elif o == "nofit":
            kw["fit"] = False
        elif o == "fit" and name != "cluster":
            kw["fit"] = True
        elif o == "own":  # kvzip: its own replay, timed with it (not the one shared by the kvzip rows)
            replay = None
        elif o.startswith("allocation="):
            kw["allocation"] = o.partition("=")[2]
        elif o != "fit":
            raise ValueError(f"unknown method option {o!r} (nobound, nofit, fit, own, allocation=A)")
    if name == "kvzip":
        kw["observation"] = replay
    red = reduce(full, model, keep, name, **kw)
    if name == "cluster" and "fit" in opts:
        red = _fitted_summary(model, red, full, replay)
    return red


@torch.no_grad()
def run_turns(model, tok, convs, keep: float, methods, progress=print) -> list[dict]:
    from ..reduction import replay_observation
    from ..reduction.attention import enable
    from ..tokens.plan import cache_kwarg

    enable(model)
    ka = cache_kwarg(model)
    rows = []
    for conv in convs:
        ids = _ids(tok, conv["text"] + "\n\n")
        n = int(ids.shape[1])
        out = model(ids, **{ka: None}, use_cache=True)
        full = out["cache"] if "cache" in out else out["past_key_values"]
        replay = None
        if any(m.split(",")[0] == "kvzip" or m == "cluster,fit" for m in methods):
            replay = replay_observation(full, model, ids)  # shared by the kvzip variants (default runs its own)
        for m in ["full"] + [x for x in methods if x != "full"]:
            if m == "full":
                cache, seconds, peak = copy.deepcopy(full), 0.0, 0
            else:
                cache, seconds, peak = measured(lambda: _reduce(model, m, full, ids, keep, replay))
            held0 = _held(cache, n)
            for t, turn in enumerate(conv["turns"]):
                q = _ids(tok, ("" if t == 0 else "\n\n") + f"Question: {turn['question']}\nAnswer:{turn['lead']}")
                a = _ids(tok, " " + turn["answer"])
                lp, em = _turn(model, cache, q, a)
                rows.append({"file": conv["file"], "tokens": n, "method": m, "turn": t, "kind": turn["kind"],
                             "depth": turn["depth"], "answer_bits": lp, "exact": em, "held_before": held0,
                             "held_after": _held(cache, n), "reduce_s": round(seconds, 3), "peak_bytes": peak,
                             "appended": int(q.shape[1] + a.shape[1])})
            progress(f"{conv['file']} n={n} {m}: reduce {seconds:.1f} s, held {held0} -> {_held(cache, n)}")
    return rows


def summarise(rows, methods) -> dict:
    by = {}
    for r in rows:
        by.setdefault(r["method"], []).append(r)
    full = {(r["file"], r["turn"]): r for r in by["full"]}
    out = {}
    for m in ["full"] + [x for x in methods if x != "full"]:
        rs = by.get(m, [])
        if not rs:
            continue
        turns = sorted({r["turn"] for r in rs})
        per_turn = []
        for t in turns:
            sel = [r for r in rs if r["turn"] == t]
            ref = sum(full[(r["file"], t)]["answer_bits"] for r in sel)
            per_turn.append({"turn": t + 1, "nll_ratio": sum(r["answer_bits"] for r in sel) / ref,
                             "exact": float(np.mean([r["exact"] for r in sel])),
                             "held": float(np.mean([r["held_after"] for r in sel]))})
        ref = sum(full[(r["file"], r["turn"])]["answer_bits"] for r in rs)
        docs = {r["file"]: r for r in rs}
        per_k = [(r["reduce_s"] / r["tokens"] * 1000, r["peak_bytes"] / r["tokens"] * 1000) for r in docs.values()]
        out[m] = {"nll_ratio": sum(r["answer_bits"] for r in rs) / ref,
                  "first_turn_nll_ratio": per_turn[0]["nll_ratio"],
                  "later_turns_nll_ratio": (sum(r["answer_bits"] for r in rs if r["turn"] > 0)
                                            / sum(full[(r["file"], r["turn"])]["answer_bits"] for r in rs
                                                  if r["turn"] > 0)),
                  "needle_exact": float(np.mean([r["exact"] for r in rs if r["kind"] == "needle"])),
                  "held_start": float(np.mean([r["held_before"] for r in docs.values()])),
                  "held_end": float(np.mean([r["held_after"] for r in rs if r["turn"] == turns[-1]])),
                  "reduce_s_per_1k": float(np.median([x[0] for x in per_k])),
                  "peak_mib_per_1k": float(np.median([x[1] for x in per_k])) / 2**20,
                  "turns": per_turn}
    return out


def to_markdown(res) -> str:
    s = res["summary"]
    lines = [f"Model smollm2 fp32; {res['documents']} documents of {res['context']} tokens "
             f"({', '.join(res['files'])}); keep {res['keep']}; 5 turns each (3 needles, 2 cloze questions, "
             "in a seeded order), every question and its reference answer left in the cache; the full cache grows "
             "with the turns. Answer NLL ratio = the method's total answer NLL / the full cache's (1.00 = no loss). "
             "Entries: per KV head, mean over layers, heads and documents (the full cache: its tokens). Reduce time "
             "and peak memory (resident, above the process's before the call) per 1,000 document tokens, medians "
             f"over the documents; {res['seconds']:.0f} s in all.", "",
             "| method | answer NLL ratio | turn 1 | turns 2-5 | needle EM | entries at reduction -> after turn 5 | "
             "reduce s / 1k tokens | peak MiB / 1k tokens |", "|---|---:|---:|---:|---:|---|---:|---:|"]
    for m, r in s.items():
        lines.append(f"| {m} | {r['nll_ratio']:.3f} | {r['first_turn_nll_ratio']:.3f} | "
                     f"{r['later_turns_nll_ratio']:.3f} | {r['needle_exact']:.2f} | {r['held_start']:.0f} -> "
                     f"{r['held_end']:.0f} | {r['reduce_s_per_1k']:.2f} | {r['peak_mib_per_1k']:.1f} |")
    lines += ["", "Per turn (answer NLL ratio / entries held after the turn):", "",
              "| method | " + " | ".join(f"turn {t['turn']}" for t in s["full"]["turns"]) + " |",
              "|---|" + "---:|" * len(s["full"]["turns"])]
    for m, r in s.items():
        lines.append(f"| {m} | " + " | ".join(f"{t['nll_ratio']:.3f} / {t['held']:.0f}" for t in r["turns"]) + " |")
    return "\n".join(lines) + "\n"


def run_turns_bench(args) -> int:
    from ..models import load_model

    files = selected_files(args)
    if not files:
        return missing_corpus("kvz bench --reduce-turns")
    model, tok = load_model("smollm2", dtype=torch.float32)
    convs = make_conversations(tok, files, args.context, args.documents, args.skip_documents, seed=args.seed)
    if not convs:
        print(f"kvz bench --reduce-turns: no document of the corpus past the first {args.skip_documents} has "
              f"{args.context} + 64 tokens")
        return 1
    methods = args.turn_methods
    keep = args.keeps[0] if len(args.keeps) == 1 else 0.1
    t0 = time.perf_counter()
    rows = run_turns(model, tok, convs, keep, methods)
    res = {"context": args.context, "documents": len(convs), "files": [c["file"] for c in convs], "keep": keep,
           "methods": methods, "seed": args.seed, "seconds": round(time.perf_counter() - t0, 1),
           "summary": summarise(rows, methods), "rows": rows}
    write_report(args.out, "bench_reduce_turns", res, to_markdown(res))
    print(to_markdown(res))
    return 0
