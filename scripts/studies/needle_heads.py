"""Which KV heads retrieve a needle, and does KVzip keep the needle in them (issue 14; BENCHMARKS "Reduce tier").

    KVCODEC_CORPUS=../shared/corpus python scripts/studies/needle_heads.py qa_en_python_faq_general.rst [--keep 0.1]

Rebuilds ``kvz bench --reduce``'s needle items of one document (seed 0, depths 0.1 / 0.5 / 0.9, 2,048 tokens:
:func:`kvcodec.lab.bench_reduce.make_items`), prefills each on SmolLM2 (fp32), runs KVzip's replay after the
repeat instruction and derives its default per-head budgets (``allocation="heads"``, 4 sinks) at ``--keep``.
Then, with the *full* cache, it reads the question and the answer's lead with eager attention and takes, per KV
head, the largest attention mass any of its query heads puts on the code's tokens at the last lead token (the
step that emits the first digit): the heads that retrieve the needle.  For each needle it prints the eight
strongest retrieval heads with the fraction of the code's tokens that KVzip keeps in each, and the
retrieval-weighted kept fraction over all heads, and the replay's peak scores averaged over every layer and head
per tenth of the context (a position bias of the scores would show there).  Diagnostic only: it reduces
nothing and times nothing.
"""

import argparse
import copy

import torch

from kvcodec.lab.bench_reduce import _ids, make_items
from kvcodec.lab.common import corpus_files
from kvcodec.models import load_model
from kvcodec.reduction import REPEAT_PROMPT, head_budgets, plan_for, replay_observation

SINKS = 4


def kept_fraction(peak, count, positions):
    """The fraction of ``positions`` among a head's kept tokens: its sinks and its top ``count - SINKS`` scores."""
    if count <= SINKS:
        return 0.0
    top = set((peak[SINKS:].topk(count - SINKS).indices + SINKS).tolist())
    return sum(p in top for p in positions) / len(positions)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--keep", type=float, default=0.1)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    model, tok = load_model("smollm2")
    model = model.float()
    files = [f for f in corpus_files() if f.name == args.file]
    if not files:
        raise SystemExit(f"{args.file} is not in the corpus (set KVCODEC_CORPUS)")
    for it in make_items(tok, files, 2048, (0.1, 0.5, 0.9), 0)[0]["items"]:
        if it["kind"] != "needle":
            continue
        ids = _ids(tok, it["doc"] + "\n\n")
        n = ids.shape[1]
        start = len(tok(it["doc"][:it["doc"].index(it["answer"])], add_special_tokens=False)["input_ids"])
        code = list(range(start, start + len(tok(it["answer"], add_special_tokens=False)["input_ids"])))
        model.set_attn_implementation("sdpa")
        cache = model(ids, use_cache=True).past_key_values
        kept_cache = copy.deepcopy(cache)
        obs = replay_observation(cache, model, ids, _ids(tok, REPEAT_PROMPT))
        layers = sorted(obs.peak)
        per_head = head_budgets({i: obs.peak[i] for i in layers}, plan_for(n, args.keep)[2], SINKS)
        model.set_attn_implementation("eager")
        q = _ids(tok, f"Question: {it['question']}\nAnswer:{it['lead']}")
        att = model(q, past_key_values=kept_cache, output_attentions=True).attentions
        kvh = obs.peak[layers[0]].shape[1]
        rows = []
        for li in layers:
            a = att[li][0, :, -1, :n][:, code].sum(-1)  # [q_heads]: mass on the code's tokens
            a = a.view(kvh, -1).max(-1).values
            for h in range(kvh):
                count = int(per_head[li][0, h])
                rows.append((float(a[h]), li, h, kept_fraction(obs.peak[li][0, h], count, code), count))
        rows.sort(reverse=True)
        w = sum(r[0] for r in rows)
        print(f"depth {it['depth']} (code at tokens {code[0]}..{code[-1]} of {n}): retrieval weight | code kept | "
              "budget, strongest heads")
        print("   " + "; ".join(f"L{li}H{h} {m:.2f} | {k:.2f} | {c}" for m, li, h, k, c in rows[:8]))
        print(f"   retrieval-weighted fraction of the code kept: {sum(r[0] * r[3] for r in rows) / w:.3f}")
        mean = torch.stack([obs.peak[li][0] for li in layers]).mean((0, 1))  # [n]: over layers and heads
        print("   replay's mean peak score per tenth of the context: "
              + " ".join(f"{float(mean[n * t // 10:n * (t + 1) // 10].mean()):.3f}" for t in range(10)))


if __name__ == "__main__":
    main()
