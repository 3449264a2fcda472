"""NVIDIA kvpress presses on the reduce-tier long-context items, for a side-by-side with ``kvz bench --reduce``.

Run with the kvpress venv's python (no kvcodec import; see the end of this docstring for the venv), on the
items ``kvz bench --reduce --export-items /tmp/kvp/items_2048.json`` writes (same --context, --documents,
--seed as the bench run it is compared with):

    OMP_NUM_THREADS=1 ~/.cache/kvcodec/peers/kvpress/bin/python scripts/peers/kvpress_reduce.py \\
        --items /tmp/kvp/items_2048.json --keeps 0.05 0.1 0.25 0.5 --out kvpress_2048.json

Items: a JSON list of documents ``{"file", "text", "continuation", "items": [{"kind", "depth", "doc",
"question", "lead"?, "answer"}]}`` (what :func:`kvcodec.lab.bench_reduce.make_items` builds).  Items are grouped
by their ``doc`` text; each group's ``doc + "\\n\\n"`` is prefilled once per (press, keep) with the press active,
so the press compresses the cache during prefill, as kvpress does it (the layer outputs of the prefill are those
of exact attention; only the stored cache is pruned).  kvpress's ``compression_ratio`` is the fraction removed:
``compression_ratio = 1 - keep``.  Then, per item, on a deep copy of the compressed cache:

- ``answer_bits``: log2-likelihood of the answer ``" " + answer`` teacher-forced after
  ``"Question: <question>\\nAnswer:<lead>"``;
- ``exact``: greedy decoding, token by token, of ``len(answer tokens)`` tokens after the question, compared
  with the answer tokens.

Positions: a pruned cache holds fewer entries than the document had tokens, so the question and answer are fed
with explicit ``position_ids`` continuing from the document's length ``n`` (RoPE was applied to the cached keys
at their original positions), while ``cache_position`` is left to transformers, which counts it from the
compressed cache's size (it indexes the cache and sizes the causal mask).  This is what kvpress's own pipeline
does (``KVPressTextGenerationPipeline.generate_answer``).  ``full`` (no press) is fed the same way.

Rows (JSON list): file, kind, depth, method (``kvpress-<press>`` or ``full``), keep (1.0 for full), entries (cache
entries per KV head after the prefill, as measured on the cache: the minimum over layers and heads),
tokens (n), answer_bits, exact, seconds (the wall seconds of the prefill under the press, shared by the group's
items), score_s (the item's scoring seconds).  A sidecar ``<out>.meta.json`` holds the versions and arguments.

Venv (torch pinned to the local CPU build through a constraints file, so no CUDA build is pulled):

    python3.11 -m venv ~/.cache/kvcodec/peers/kvpress
    echo "torch==2.13.0+cpu" > ~/.cache/kvcodec/peers/kvpress/constraints.txt
    ~/.cache/kvcodec/peers/kvpress/bin/python -m pip install torch==2.13.0
    ~/.cache/kvcodec/peers/kvpress/bin/python -m pip install -c ~/.cache/kvcodec/peers/kvpress/constraints.txt \\
        kvpress==0.5.5 transformers==5.2.0
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata as md
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

MODEL_DIR = os.path.expanduser("~/.cache/kvcodec/models/smollm2-v1")

# --presses name -> kvpress class name (those missing from the installed kvpress are skipped)
PRESSES = {
    "snapkv": "SnapKVPress",
    "streamingllm": "StreamingLLMPress",
    "knorm": "KnormPress",
    "expected": "ExpectedAttentionPress",
    "tova": "TOVAPress",
}


def _v(pkg):
    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return "?"


def available_presses():
    import kvpress

    return {name: getattr(kvpress, cls) for name, cls in PRESSES.items() if hasattr(kvpress, cls)}


def _ids(tok, text):
    return torch.tensor([tok(text, add_special_tokens=False).input_ids])


def entries_of(cache) -> int:
    """Entries per KV head held by ``cache`` (the minimum over layers; kvpress's scorer presses prune every head
    and layer to the same count, which the max is checked against)."""
    lens = [layer.keys.shape[2] for layer in cache.layers]
    if min(lens) != max(lens):
        print(f"warning: uneven cache lengths over layers: {min(lens)}..{max(lens)}", file=sys.stderr)
    return min(lens)


@torch.no_grad()
def prefill(model, ids, press):
    """The document's cache, compressed by ``press`` during the prefill (None: the full cache)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    if press is None:
        model.model(input_ids=ids, past_key_values=cache, use_cache=True)
    else:
        with press(model):
            # as kvpress's pipeline: the decoder only (no lm head over the whole document)
            model.model(input_ids=ids, past_key_values=cache, use_cache=True)
    return cache


@torch.no_grad()
def score_item(model, cache, n, q_ids, a_ids):
    """(log2-likelihood of the answer, greedy exact match, greedy tokens) after ``cache`` (left untouched).

    Positions continue from ``n`` (the document's length), not from the compressed cache's size."""
    lq, la = q_ids.shape[1], a_ids.shape[1]
    # teacher-forced question + answer
    x = torch.cat([q_ids, a_ids], 1)
    pos = torch.arange(n, n + lq + la).unsqueeze(0)
    logits = model(input_ids=x, past_key_values=copy.deepcopy(cache), position_ids=pos, use_cache=True).logits
    logits = logits[0, lq - 1:-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, a_ids[0][:, None]).sum().item() / math.log(2)
    # greedy, token by token, as many tokens as the reference answer
    c = copy.deepcopy(cache)
    nxt, p, out = q_ids, n, []
    for _ in range(la):
        pos = torch.arange(p, p + nxt.shape[1]).unsqueeze(0)
        lg = model(input_ids=nxt, past_key_values=c, position_ids=pos, use_cache=True, logits_to_keep=1).logits
        p += nxt.shape[1]
        t = int(lg[0, -1].argmax())
        out.append(t)
        nxt = torch.tensor([[t]])
    return lp, out == a_ids[0].tolist(), out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", required=True, help="JSON list of documents with items")
    ap.add_argument("--keeps", type=float, nargs="+", default=[0.1, 0.25], help="fractions of entries kept")
    ap.add_argument("--presses", nargs="+", default=None, help=f"of {list(PRESSES)} (default: all that exist)")
    ap.add_argument("--out", required=True, help="output JSON (list of rows)")
    ap.add_argument("--documents", type=int, default=None, help="only the first N documents")
    ap.add_argument("--model", default=MODEL_DIR)
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"],
                    help="attention implementation (the chosen presses work with both)")
    ap.add_argument("--no-full", action="store_true", help="skip the full-cache rows")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")))
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    import kvpress  # noqa: F401  (patches transformers' attention functions; import before loading the model)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    have = available_presses()
    names = args.presses or list(have)
    for nm in names:
        if nm not in PRESSES:
            ap.error(f"unknown press {nm!r}; known: {list(PRESSES)}")
        if nm not in have:
            ap.error(f"press {nm!r} ({PRESSES[nm]}) is not in kvpress {_v('kvpress')}")
    for k in args.keeps:
        if not 0 < k <= 1:
            ap.error(f"keep {k} not in (0, 1]")

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation=args.attn)
    model.eval()

    docs = json.loads(Path(args.items).read_text())
    if args.documents is not None:
        docs = docs[:args.documents]
    out = Path(args.out)
    meta = {"items": args.items, "keeps": args.keeps, "presses": {nm: PRESSES[nm] for nm in names},
            "model": args.model, "attn": args.attn, "threads": args.threads, "documents": len(docs),
            "versions": {p: _v(p) for p in ("kvpress", "transformers", "torch", "tokenizers")}}
    Path(str(out) + ".meta.json").write_text(json.dumps(meta, indent=1))
    print(json.dumps(meta), file=sys.stderr)

    configs = ([] if args.no_full else [("full", 1.0, None)])
    for keep in args.keeps:
        for nm in names:
            configs.append((f"kvpress-{nm}", keep, (have[nm], 1.0 - keep)))

    rows, t_all = [], time.perf_counter()
    for doc in docs:
        groups = {}
        for it in doc["items"]:
            groups.setdefault(it["doc"], []).append(it)
        for text, items in groups.items():
            ids = _ids(tok, text + "\n\n")
            n = ids.shape[1]
            qa = [(it, _ids(tok, f"Question: {it['question']}\nAnswer:{it.get('lead') or ''}"),
                   _ids(tok, " " + it["answer"])) for it in items]
            for method, keep, spec in configs:
                press = None if spec is None else spec[0](compression_ratio=spec[1])
                t0 = time.perf_counter()
                try:
                    cache = prefill(model, ids, press)
                except Exception as e:  # a press that fails on this input: recorded, not fatal
                    print(f"{doc['file']} n={n} {method} keep={keep}: {type(e).__name__}: {e}", file=sys.stderr)
                    for it, _, _ in qa:
                        rows.append({"file": doc["file"], "kind": it["kind"], "depth": it["depth"],
                                     "method": method, "keep": keep, "tokens": n, "error": f"{type(e).__name__}: {e}"})
                    continue
                t_pre = time.perf_counter() - t0
                got = entries_of(cache)
                for it, q, a in qa:
                    t1 = time.perf_counter()
                    lp, em, _ = score_item(model, cache, n, q, a)
                    rows.append({"file": doc["file"], "kind": it["kind"], "depth": it["depth"], "method": method,
                                 "keep": keep, "entries": got, "tokens": n, "answer_bits": lp, "exact": em,
                                 "seconds": round(t_pre, 3), "score_s": round(time.perf_counter() - t1, 3)})
                del cache
                print(f"{doc['file']} n={n} {method} keep={keep} entries={got} ({len(qa)} items, "
                      f"prefill {t_pre:.1f}s, {time.perf_counter() - t_all:.0f}s total)", file=sys.stderr)
            out.write_text(json.dumps(rows, indent=0))  # after every group: a partial run keeps its rows
    out.write_text(json.dumps(rows, indent=0))
    print(f"{len(rows)} rows -> {out} ({time.perf_counter() - t_all:.0f}s)", file=sys.stderr)


if __name__ == "__main__":
    main()
