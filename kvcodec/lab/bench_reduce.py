"""`kvz bench --reduce`: the reduce tier against the full cache and the baselines on long-context tasks.

Tasks, built from any folder of texts (none is tuned to a file; the needles and questions are drawn with a
seeded generator from each document):

- **needle**: a sentence "The access code for the <colour> <object> is <5 digits>." inserted at a line break at
  several depths of a document of ``--context`` tokens; question "What is the access code for the <colour>
  <object>?", the answer led in with "The access code for the <colour> <object> is", reference answer the
  digits.
- **cloze QA**: a line of the document (at several depths) is quoted by its first words; question "In the
  text above, which words come right after ...?", reference answer its next words (the answer is in the text).
- **continuation**: the document's next ``--continuation`` tokens after the cache, teacher-forced.

The document (with the needle) is prefilled once with exact attention; every method reduces that cache (the
question comes after the reduction, as in an agent memory: the question is not known when the memory is
compressed), then the question and the reference answer are teacher-forced.  Metrics, paired by item against
the full cache: the answer's log-likelihood (bits; primary), greedy exact match of the answer, and the mean KL
(bits/token) of the next-token distributions over the continuation.  Every method keeps the same number of
entries per KV head (:func:`kvcodec.reduction.plan_for`; ``kvzip`` on average over the layers, its budget
spread over them by default, ``kvzip,allocation=uniform`` in every layer).  ``cluster+scan`` computes the
prefill itself under merge-reduce attention (:func:`kvcodec.reduction.prefill`) and so approximates the
document's cache too; ``<reducer>-<form>`` (``cluster-kernel``, ``sample-dot``) runs a reducer with another mass form
(:data:`kvcodec.reduction.cache.FORMS`; the default is ``query``); ``,sinks=N``, ``,window=F`` and ``,allocation=A``
pass :func:`kvcodec.reduce`'s options (``cluster,sinks=0``: the sinks ablation; ``cluster,window=0.5``: half the
budget a raw recent window); ``+lossyN`` stores the reduced cache in the lossy tier at N bits and decodes it.
``kvzip`` replays each document once after its cache (after the repeat instruction
:data:`kvcodec.reduction.REPEAT_PROMPT`), for every budget; its reduce time includes that replay.
"""

from __future__ import annotations

import copy
import math
import time

import numpy as np
import torch

from .common import missing_corpus, selected_files, write_report
from .plots import reduce_plot

COLOURS = ["red", "blue", "green", "yellow", "purple", "orange", "silver", "golden", "black", "white"]
OBJECTS = ["door", "box", "gate", "locker", "safe", "cabinet", "drawer", "vault", "trunk", "chest"]
METHODS = ["full", "cluster", "sample", "cluster-kernel", "cluster+scan", "snapkv", "h2o", "streaming", "tova",
           "kvzip"]


def lines_at(text: str, frac: float) -> int:
    """The index of a line break near ``frac`` of ``text``."""
    pos = int(len(text) * frac)
    nl = text.rfind("\n", 0, pos)
    return nl + 1 if nl >= 0 else pos


def make_items(tok, files, context: int, depths, seed: int = 0):
    """Per document: its text cut to ``context`` tokens, needle items, cloze items and the continuation."""
    rng = np.random.default_rng(seed)
    docs = []
    for f in files:
        raw = f.read_text(encoding="utf-8", errors="replace")
        ids = tok(raw, add_special_tokens=False)["input_ids"]
        if len(ids) < context + 64:
            continue
        text = tok.decode(ids[:context])
        cont = ids[context:context + 64]
        items = []
        for d in depths:
            colour, obj = COLOURS[rng.integers(len(COLOURS))], OBJECTS[rng.integers(len(OBJECTS))]
            code = "".join(str(x) for x in rng.integers(0, 10, 5))
            at = lines_at(text, d)
            hay = text[:at] + f"The access code for the {colour} {obj} is {code}.\n" + text[at:]
            items.append({"kind": "needle", "depth": d, "doc": hay,
                          "question": f"What is the access code for the {colour} {obj}?",
                          "lead": f" The access code for the {colour} {obj} is", "answer": code})
        lines = [(i, ln) for i, ln in enumerate(text.split("\n")) if len(ln.split()) >= 10]
        starts = np.cumsum([0] + [len(ln) + 1 for ln in text.split("\n")])
        for d in depths:
            if not lines:
                break
            target = d * len(text)
            i, ln = min(lines, key=lambda t: abs(starts[t[0]] - target))
            words = ln.split()
            items.append({"kind": "cloze", "depth": round(float(starts[i] / len(text)), 2), "doc": text,
                          "question": f'In the text above, which words come right after "{" ".join(words[:6])}"?',
                          "answer": " ".join(words[6:10])})
        docs.append({"file": f.name, "text": text, "continuation": cont, "items": items})
    return docs


def _ids(tok, text):
    return torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])


@torch.no_grad()
def _answer_scores(model, cache, q_ids, a_ids):
    """(log2-likelihood of the answer, greedy exact match) after ``cache``; ``cache`` is consumed."""
    from ..tokens.plan import cache_kwarg

    ka = cache_kwarg(model)
    gen_cache = copy.deepcopy(cache)
    x = torch.cat([q_ids, a_ids], 1)
    logits = model(x, **{ka: cache}).logits[0, q_ids.shape[1] - 1:-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, a_ids[0][:, None]).sum().item() / math.log(2)
    # greedy: as many tokens as the reference
    out, nxt, c = [], q_ids, gen_cache
    for _ in range(a_ids.shape[1]):
        lg = model(nxt, **{ka: c}).logits[0, -1]
        t = int(lg.argmax())
        out.append(t)
        nxt = torch.tensor([[t]])
    return lp, out == a_ids[0].tolist()


@torch.no_grad()
def _continuation_kl(model, cache, cont, ref_logp):
    from ..tokens.plan import cache_kwarg

    logits = model(cont, **{cache_kwarg(model): cache}).logits[0].float()
    lq = torch.log_softmax(logits, -1)
    return float((ref_logp.exp() * (ref_logp - lq)).sum(-1).mean() / math.log(2))


def _asks(method: str) -> bool:
    """Whether ``method`` is reduced knowing the question (the ``,question`` option)."""
    return "question" in method.split(",")[1:]


#: method options that set one of reduce()'s keywords: ``rest`` (the evicted tokens as one atom per head) and
#: kvzip's attention matching - ``fit`` on the replay's queries (its default), ``nofit`` (the selection alone),
#: ``fit=policy`` (fitted layer by layer on a second replay)
FLAGS = {"rest": ("rest", True), "fit": ("fit", True), "nofit": ("fit", False), "fit=policy": ("fit", "policy")}


def _reduced(model, method, full, ids, keep, obs, seed, question=None):
    """(the method's cache, bytes of its .kvz or None); ``question`` (token ids) for ``,question`` methods."""
    from ..api import decode, encode
    from ..reduction import prefill, reduce

    if method == "full":
        return copy.deepcopy(full), None
    if method == "cluster+scan":
        return prefill(model, ids, keep, "cluster", seed=seed)[0], None
    method, *options = method.split(",")  # "cluster,sinks=0", "cluster,window=0.5": reduce()'s options
    method, _, bits = method.partition("+lossy")  # "cluster+lossy3": reduced, then stored in the lossy tier
    name, _, form = method.partition("-")  # "cluster-kernel": the reducer with another mass form
    kw = {}
    for o in options:
        key, _, value = o.partition("=")
        if o == "question":
            if question is None:
                raise ValueError(f"method {method!r} is reduced knowing the question, and no question was given")
            kw["question"] = question
            continue
        if o in FLAGS:  # reduce(rest=True), reduce(fit=...)
            kw[FLAGS[o][0]] = FLAGS[o][1]
            continue
        if key == "chunk":  # kvzip's replay in passes of N tokens: reduce() runs it, or obs is one made so
            if name != "kvzip":
                raise ValueError(f"method option {o!r} sets kvzip's replay; method {name!r} has no replay")
            kw["replay_chunk"] = int(value)
            if obs is not None and getattr(obs, "replay_chunk", None) != int(value):
                raise ValueError(f"method {method!r} replays in passes of {value} tokens; the observation given was "
                                 f"replayed in passes of {getattr(obs, 'replay_chunk', None)}")
            continue
        if key not in ("sinks", "window", "allocation"):
            raise ValueError(f"unknown method option {o!r} (sinks=N, window=F, allocation=A, chunk=N, question, "
                             "rest, fit, fit=policy, nofit)")
        kw[key] = int(value) if key == "sinks" else value if key == "allocation" else float(value)
    if "question" in kw:
        obs = None
    red = reduce(full, model, keep, name, tokens=ids, observation=obs, seed=seed, form=form or "query", **kw)
    if not bits:
        return red, None
    data = encode(red, tier="lossy", bits=float(bits))
    return decode(data, model), len(data)


@torch.no_grad()
def run_items(model, tok, docs, keeps, methods, seed=0, progress=print):
    from ..reduction import REPEAT_PROMPT, plan_for, replay_observation
    from ..reduction.attention import enable, observe
    from ..tokens.plan import cache_kwarg

    enable(model)
    ka = cache_kwarg(model)
    rows = []
    for doc in docs:
        groups = {}
        for it in doc["items"]:
            groups.setdefault(it["doc"], []).append(it)
        groups.setdefault(doc["text"], [])
        for text, items in groups.items():
            ids = _ids(tok, text + "\n\n")
            n = ids.shape[1]
            t0 = time.perf_counter()
            with observe(model, window=64, received=any(_base(m) == "h2o" for m in methods)) as obs:
                full = model(ids, **{ka: None}, use_cache=True)
            full = full["cache"] if "cache" in full else full["past_key_values"]
            t_prefill = time.perf_counter() - t0
            replays, t_replay = {}, {}
            for c in sorted({_replay_chunk(m) for m in methods if _base(m) == "kvzip"}):  # once for every budget
                t0 = time.perf_counter()
                replays[c] = replay_observation(full, model, ids, _ids(tok, REPEAT_PROMPT), chunk=c)
                t_replay[c] = time.perf_counter() - t0
            cont = None
            if text == doc["text"]:
                cont = torch.tensor([doc["continuation"]])
                ref = model(cont, **{ka: copy.deepcopy(full)}).logits[0].float()
                ref_logp = torch.log_softmax(ref, -1)
            for keep in keeps:
                k, _, entries = plan_for(n, keep)
                for m in methods:
                    if m == "full" and keep != keeps[0]:
                        continue
                    asks = _asks(m)
                    if not asks:
                        t1 = time.perf_counter()
                        mobs, t_rep = obs, 0.0
                        if _base(m) == "kvzip":  # the prefill's observation with the replay this method reads
                            c = _replay_chunk(m)
                            mobs, t_rep = copy.copy(obs), t_replay[c]
                            for a in ("peak", "reference", "prompt", "replay_chunk"):
                                setattr(mobs, a, getattr(replays[c], a))
                        red, nbytes = _reduced(model, m, full, ids, keep, mobs, seed)
                        t_red = time.perf_counter() - t1 + t_rep
                        got = red.entries() if hasattr(red, "entries") else n
                        held = got
                        if hasattr(red, "counted"):  # heads that keep fewer than their layer holds: padding
                            got = round(red.counted(), 1)
                    for it in items:
                        q = _ids(tok, f"Question: {it['question']}\nAnswer:{it.get('lead', '')}")
                        a = _ids(tok, " " + it["answer"])
                        if asks:  # reduced knowing this item's question (its first line, not the answer's lead)
                            t1 = time.perf_counter()
                            red, nbytes = _reduced(model, m, full, ids, keep, obs, seed,
                                                   question=_ids(tok, f"Question: {it['question']}\n"))
                            t_red = time.perf_counter() - t1
                            got = red.entries() if hasattr(red, "entries") else n
                            held = got
                            if hasattr(red, "counted"):  # heads that keep fewer than their layer holds: padding
                                got = round(red.counted(), 1)
                        lp, em = _answer_scores(model, copy.deepcopy(red), q, a)
                        rows.append({"file": doc["file"], "kind": it["kind"], "depth": it["depth"], "tokens": n,
                                     "method": m, "keep": 1.0 if m == "full" else keep, "k": k,
                                     "entries": got, "held": held, "answer_bits": lp, "exact": em,
                                     "kvz_bytes": nbytes, "reduce_s": round(t_red, 3),
                                     "prefill_s": round(t_prefill, 3)})
                    if cont is not None and not asks:  # a continuation has no question to know
                        kl = _continuation_kl(model, copy.deepcopy(red), cont, ref_logp)
                        rows.append({"file": doc["file"], "kind": "continuation", "depth": 1.0, "tokens": n,
                                     "method": m, "keep": 1.0 if m == "full" else keep, "k": k, "entries": got,
                                     "held": held, "kl_bits": kl, "reduce_s": round(t_red, 3)})
                progress(f"{doc['file']} n={n} keep={keep} done ({len(items)} questions)")
    return rows


@torch.no_grad()
def sizes(model, tok, doc, keeps, bits=(2.0, 3.0), progress=print):
    """Bytes of one document's cache (bf16, as stored in practice): the full cache in the lossless and exact
    tiers, and reduced by clustering at each keep, lossless and lossy at each of ``bits``."""
    import warnings

    from ..api import encode
    from ..reduction import reduce
    from ..tokens.plan import cache_kwarg

    ids = _ids(tok, doc["text"])
    mb = copy.deepcopy(model).to(torch.bfloat16)
    out = mb(ids, **{cache_kwarg(mb): None}, use_cache=True)
    full = out["cache"] if "cache" in out else out["past_key_values"]
    raw = sum(la.keys.numel() * 2 * 2 for la in full.layers)
    rows = [{"what": "full cache, raw bf16", "entries": ids.shape[1], "bytes": raw},
            {"what": "full cache, lossless", "entries": ids.shape[1], "bytes": len(encode(full))},
            {"what": "full cache, exact (tokens + residual; needs the model)", "entries": ids.shape[1],
             "bytes": len(encode(full, mb, tokens=ids))}]
    for keep in keeps:
        red = reduce(full, mb, keep, "cluster", tokens=ids)
        rows.append({"what": f"cluster, keep {keep:g}, lossless", "entries": red.entries(),
                     "bytes": len(encode(red))})
        for b in bits:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                rows.append({"what": f"cluster, keep {keep:g}, lossy {b:g} bits", "entries": red.entries(),
                             "bytes": len(encode(red, tier="lossy", bits=b))})
        progress(f"sizes: keep {keep} done")
    for r in rows:
        r["ratio_vs_raw"] = raw / r["bytes"]
    return {"file": doc["file"], "tokens": int(ids.shape[1]), "rows": rows}


def _boot_ci(x, reps=2000, seed=0):
    x = np.asarray(x, float)
    if len(x) < 2:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    means = rng.choice(x, (reps, len(x))).mean(1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def _sign_test(d):
    """Two-sided exact sign test p-value of paired differences ``d`` (zeros dropped)."""
    d = [x for x in d if x != 0]
    n = len(d)
    if n == 0:
        return 1.0
    k = min(sum(1 for x in d if x > 0), sum(1 for x in d if x < 0))
    p = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * p)


def summarise(rows, keeps, methods):
    full = {(r["file"], r["kind"], r["depth"]): r for r in rows if r["method"] == "full"}
    out = []
    for keep in keeps:
        for m in methods:
            if m == "full":
                continue
            sel = [r for r in rows if r["method"] == m and r["keep"] == keep]
            qa = [r for r in sel if r["kind"] in ("needle", "cloze")]
            pairs = [(r, full[(r["file"], r["kind"], r["depth"])]) for r in qa
                     if (r["file"], r["kind"], r["depth"]) in full]
            if not pairs:
                continue
            d = [r["answer_bits"] - f["answer_bits"] for r, f in pairs]
            tot_r = sum(-r["answer_bits"] for r, _ in pairs)
            tot_f = sum(-f["answer_bits"] for _, f in pairs)
            needles = [(r, f) for r, f in pairs if r["kind"] == "needle"]
            acc = sum(r["exact"] for r, _ in needles) / len(needles) if needles else float("nan")
            acc_f = sum(f["exact"] for _, f in needles) / len(needles) if needles else float("nan")
            kls = [r["kl_bits"] for r in sel if r["kind"] == "continuation"]
            out.append({"keep": keep, "method": m, "items": len(pairs),
                        "entries_mean": float(np.mean([r["entries"] for r, _ in pairs])),
                        # entries held per KV head (absent places of heads keeping fewer than their layer included)
                        "held_mean": float(np.mean([r.get("held", r["entries"]) for r, _ in pairs])),
                        "delta_bits_mean": float(np.mean(d)), "delta_bits_ci95": _boot_ci(d),
                        "sign_test_p": _sign_test(d),
                        "nll_ratio": tot_r / tot_f if tot_f else float("nan"),
                        "needle_exact": acc, "needle_exact_full": acc_f,
                        "kl_bits_mean": float(np.mean(kls)) if kls else None,
                        "reduce_s_median": float(np.median([r["reduce_s"] for r in sel]))})
    # each merge-reduce method, TOVA and KVzip vs each other baseline, and each variant ("cluster,sinks=0") vs
    # its method, per item
    present = {r["method"] for r in rows}
    pairs = [(a, b) for a in methods if _base(a) in ("cluster", "sample", "tova", "kvzip") and "-" not in a
             for b in ("snapkv", "streaming", "h2o", "tova") + (("snapkv,question",) if _asks(a) else ())
             if b != _base(a)]
    pairs += [(a, a.split(",")[0]) for a in methods if "," in a]
    vs = []
    for keep in keeps:
        for a, b in pairs:
            if a not in present or b not in present:
                continue
            ra = {(r["file"], r["kind"], r["depth"]): r for r in rows if r["method"] == a and r["keep"] == keep
                  and "answer_bits" in r}
            rb = {(r["file"], r["kind"], r["depth"]): r for r in rows if r["method"] == b and r["keep"] == keep
                  and "answer_bits" in r}
            common = sorted(set(ra) & set(rb))
            if not common:
                continue
            d = [ra[c]["answer_bits"] - rb[c]["answer_bits"] for c in common]
            vs.append({"keep": keep, "a": a, "b": b, "items": len(d), "delta_bits_mean": float(np.mean(d)),
                       "ci95": _boot_ci(d), "sign_test_p": _sign_test(d),
                       "a_better": sum(x > 0 for x in d), "b_better": sum(x < 0 for x in d)})
    return out, vs


def _replay_chunk(method: str) -> int:
    """The replay's tokens per pass for a ``kvzip`` method: N of its ``chunk=N`` option, else reduce()'s default."""
    from ..reduction import REPLAY_CHUNK

    for o in method.split(",")[1:]:
        if o.startswith("chunk="):
            return int(o[len("chunk="):])
    return REPLAY_CHUNK


def _base(method: str) -> str:
    """``"cluster"`` of ``"cluster-kernel+lossy3,sinks=0"``."""
    return method.split(",")[0].split("+")[0].split("-")[0]


def to_markdown(res) -> str:
    lines = ["# Reduce tier (`kvz bench --reduce`)", "",
             f"Model {res['model']}; {res['documents']} documents of {res['context']} tokens "
             f"({', '.join(res['files'])}); {res['questions']} questions (needle + cloze) per method and budget; "
             "every method keeps the same entries per KV head (kvzip: on average over the layers; with allocation "
             "heads or layer-heads over the heads too: attention then pads each layer to its longest head, the "
             "others' extra places masked: \"pads to\"; the cache holds only the kept entries); seed "
             f"{res['seed']}. Answer NLL ratio = total answer NLL under the method / under the full cache "
             "(1.00 = no loss). Δ bits = mean paired change of the answer's log2-likelihood (negative = worse), "
             "95 % bootstrap CI, exact sign-test p. Needle: greedy exact match (full cache in brackets). "
             "KL: mean bits/token over the 64-token continuation (none for methods reduced knowing the "
             "question: a continuation has no question)." + (
                 f" Methods {', '.join(m for m in res['methods'] if m not in res['merged']['ran'])} from an earlier "
                 f"run with the same settings ({', '.join(x['path'] for x in res['merged']['from'])}; its full "
                 "cache gave the same answers), paired item by item" + "".join(
                     f"; its {o} as {n}" for x in res["merged"]["from"] for o, n in x.get("renamed", {}).items())
                 + "." if res.get("merged") else ""), "",
             "| keep | method | entries | answer NLL ratio | Δ bits [95 % CI] | p | needle EM (full) | KL bits/tok | "
             "reduce s |", "|---:|---|---:|---:|---|---:|---|---:|---:|"]
    for s in res["summary"]:
        lo, hi = s["delta_bits_ci95"]
        held = s.get("held_mean", s["entries_mean"])  # heads keeping fewer than their layer: attention pads to more
        ent = f"{s['entries_mean']:.0f}" + (f" (pads to {held:.0f})" if held - s["entries_mean"] >= 0.5 else "")
        lines.append(f"| {s['keep']:g} | {s['method']} | {ent} | {s['nll_ratio']:.3f} | "
                     f"{s['delta_bits_mean']:+.2f} [{lo:+.2f}, {hi:+.2f}] | {s['sign_test_p']:.3f} | "
                     f"{s['needle_exact']:.2f} ({s['needle_exact_full']:.2f}) | "
                     f"{'-' if s['kl_bits_mean'] is None else format(s['kl_bits_mean'], '.4f')} | "
                     f"{s['reduce_s_median']:.2f} |")
    lines += ["", "Paired comparisons (answer log2-likelihood, method A − method B; positive = A better):", "",
              "| keep | A | B | items | mean Δ bits [95 % CI] | A better / B better | sign-test p |",
              "|---:|---|---|---:|---|---|---:|"]
    for v in res["versus"]:
        lo, hi = v["ci95"]
        lines.append(f"| {v['keep']:g} | {v['a']} | {v['b']} | {v['items']} | {v['delta_bits_mean']:+.2f} "
                     f"[{lo:+.2f}, {hi:+.2f}] | {v['a_better']} / {v['b_better']} | {v['sign_test_p']:.3f} |")
    if res.get("sizes"):
        sz = res["sizes"]
        lines += ["", f"Bytes of one document's cache ({sz['file']}, {sz['tokens']} tokens, SmolLM2 bf16):", "",
                  "| stored as | entries | bytes | × smaller than raw |", "|---|---:|---:|---:|"]
        for r in sz["rows"]:
            lines.append(f"| {r['what']} | {r['entries']} | {r['bytes']:,} | {r['ratio_vs_raw']:.1f} |")
    return "\n".join(lines) + "\n"


#: bits by which the full cache's answers of two merged runs may differ (float rounding of two machines)
MERGE_TOLERANCE = 1e-3


def _earlier_run(path, settings: dict) -> tuple[bytes, dict]:
    """The bytes and the JSON of an earlier run's ``bench_reduce.json``, refused unless it had ``settings``."""
    import json
    from pathlib import Path

    raw = Path(path).read_bytes()
    old = json.loads(raw)
    for key, value in settings.items():
        if old.get(key) != value:
            raise ValueError(f"--merge {path}: {key} {old.get(key)!r}, this run {value!r}")
    return raw, old


def merge_earlier(rows, methods, keeps, settings: dict, path, rename: dict | None = None) -> tuple[list, list, dict]:
    """Rows and methods of an earlier run (``path``, its ``bench_reduce.json``) added to this run's: its methods
    this run did not run, at this run's budgets, and where they came from (path, SHA-256, kvcodec version).
    Refused unless both runs had the same settings, their full caches gave the same answers (the same items
    and model: the same greedy answers, the same likelihoods to :data:`MERGE_TOLERANCE` bits - another
    machine's float rounding moves them by ~1e-4), and the earlier run has every added method at every budget
    for every item."""
    import hashlib

    raw, old = _earlier_run(path, settings)

    def answers(rs, method, keep=None):
        got = [((r["file"], r["kind"], r["depth"]), r["answer_bits"]) for r in rs
               if r["method"] == method and "answer_bits" in r and (keep is None or r["keep"] == keep)]
        out = dict(got)
        if len(out) != len(got):
            raise ValueError(f"--merge {path}: two {method} items share a file, kind and depth")
        return out

    a, b = answers(rows, "full"), answers(old["rows"], "full")
    exact = {(r["file"], r["kind"], r["depth"]): r.get("exact") for r in rows if r["method"] == "full"}
    if (a.keys() != b.keys() or any(abs(a[x] - b[x]) > MERGE_TOLERANCE for x in a)
            or any(exact.get((r["file"], r["kind"], r["depth"])) != r.get("exact")
                   for r in old["rows"] if r["method"] == "full")):
        worst = max((abs(a[x] - b[x]) for x in a if x in b), default=float("nan"))
        raise ValueError(f"--merge {path}: its full cache gave other answers (not the same items or model; "
                         f"largest difference {worst:.2g} bits)")
    rename = {o: n for o, n in (rename or {}).items() if o in old["methods"]}  # the renames this run's file has
    if rename:  # an earlier run's method under the name it has now (its default options changed since)
        taken = [n for n in rename.values() if n in old["methods"] or n in methods]
        if taken:
            raise ValueError(f"--merge {path}: --merge-rename's new name {', '.join(taken)} is already a method of "
                             "it or of this run (its rows would not be merged)")
        old = {**old, "methods": [rename.get(m, m) for m in old["methods"]],
               "rows": [{**r, "method": rename.get(r["method"], r["method"])} for r in old["rows"]]}
    extra = [m for m in old["methods"] if m not in methods]
    for m in extra:
        for keep in keeps:
            if answers(old["rows"], m, keep).keys() != a.keys():
                raise ValueError(f"--merge {path}: {m} at keep {keep} does not have every item")
    source = {"path": str(path), "sha256": hashlib.sha256(raw).hexdigest(), "kvcodec": old.get("kvcodec")}
    if rename:
        source["renamed"] = dict(rename)
    return rows + [r for r in old["rows"] if r["method"] in extra and r["keep"] in keeps], methods + extra, source


def merge_renames(pairs, methods, earlier: list) -> dict:
    """``--merge-rename OLD=NEW`` pairs as a dict, checked before the run against this run's ``methods`` and the
    earlier runs' JSON objects ``earlier``: every OLD run by one of them (not the full cache), no OLD twice, the
    NEWs distinct and none of them a method of this run or of an earlier one."""
    rename = {}
    for pair in pairs or []:
        old_name, eq, new_name = pair.partition("=")
        if not eq or not old_name or not new_name:
            raise ValueError(f"--merge-rename {pair!r}: OLD=NEW, e.g. kvzip=kvzip,allocation=layers")
        if old_name in rename:
            raise ValueError(f"--merge-rename names {old_name} twice")
        rename[old_name] = new_name
    if not rename:
        return rename
    if not earlier:
        raise ValueError("--merge-rename renames the methods of the runs given to --merge; there are none")
    ran = {m for e in earlier for m in e["methods"]}
    bad = [o for o in rename if o == "full" or o not in ran]
    if bad:
        raise ValueError(f"--merge-rename: no --merge run has {', '.join(bad)} to rename (the full cache is "
                         "never renamed)")
    news = list(rename.values())
    bad = [n for n in news if n == "full" or n in methods or n in ran or news.count(n) > 1]
    if bad:
        raise ValueError(f"--merge-rename: new name {', '.join(dict.fromkeys(bad))} is given twice, or is already "
                         "a method of this run or of a --merge run")
    return rename


def run_reduce_bench(args) -> int:
    from pathlib import Path

    from ..models import load_model

    files = selected_files(args)
    if not files:
        return missing_corpus("kvz bench --reduce")
    model, tok = load_model("smollm2", dtype=torch.float32)
    keeps = sorted(args.keeps)
    methods = ["full"] + [m for m in args.methods if m != "full"]
    docs = make_items(tok, files, args.context, args.depths, seed=args.seed)[: args.documents]
    if not docs:
        print(f"kvz bench --reduce: no document of the corpus has {args.context} + 64 tokens")
        return 1
    if getattr(args, "export_items", None):  # for the peers' runner (scripts/peers/kvpress_reduce.py)
        import json

        Path(args.export_items).write_text(json.dumps(
            [{**d, "continuation": [int(t) for t in d["continuation"]]} for d in docs]))
        print(f"wrote {len(docs)} documents' items to {args.export_items}")
        return 0
    settings = {"context": args.context, "documents": len(docs), "files": [d["file"] for d in docs],
                "depths": args.depths, "seed": args.seed}
    earlier = [_earlier_run(path, settings)[1]  # the settings before the run (the answers after it)
               for path in getattr(args, "merge", None) or []]
    rename = merge_renames(getattr(args, "merge_rename", None), methods, earlier)
    t0 = time.perf_counter()
    rows = run_items(model, tok, docs, keeps, methods, seed=args.seed)
    seconds = round(time.perf_counter() - t0, 1)
    ran, own, sources = list(methods), rows, []
    try:
        for path in getattr(args, "merge", None) or []:
            rows, methods, source = merge_earlier(rows, methods, keeps, settings, path, rename)
            sources.append(source)
    except ValueError:  # this run's own rows are not lost: its report is written unmerged, then the error
        _report(args, keeps, ran, own, settings, seconds, docs, model, tok, [])
        raise
    return _report(args, keeps, methods, rows, settings, seconds, docs, model, tok, sources, ran)


def _report(args, keeps, methods, rows, settings, seconds, docs, model, tok, sources, ran=None) -> int:
    from pathlib import Path

    ran = ran or methods
    summary, versus = summarise(rows, keeps, methods)
    from .. import __version__

    res = {"model": "smollm2 fp32", "kvcodec": __version__, **settings,
           "questions": sum(len(d["items"]) for d in docs), "keeps": keeps, "methods": methods, "seconds": seconds,
           "summary": summary, "versus": versus, "rows": rows}
    if methods != ran:
        res["merged"] = {"ran": ran, "from": sources}
    if getattr(args, "sizes", False):
        res["sizes"] = sizes(model, tok, docs[0], keeps)
    out = write_report(args.out, "bench_reduce", res, to_markdown(res))
    reduce_plot(res, Path(out) / "bench_reduce.svg")
    return 0
