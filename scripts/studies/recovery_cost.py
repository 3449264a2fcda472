"""Cost of token recovery on a 2,048-token cache at real model dimensions (random weights: the cost depends
on the shapes, not the values): GPT-2 small and OPT-125m (absolute positions, inverted), and a Llama layout
of SmolLM2's shape (the vocabulary table built by running the model's first layer).  Only the first layer
runs, so one layer is built.  Writes ``docs/recovery_cost.json``.

    python scripts/studies/recovery_cost.py [--tokens 2048] [--out docs/recovery_cost.json]
"""

import argparse
import json
import time
from pathlib import Path

import torch
import transformers

import kvcodec
from kvcodec.tokens.recover import recover


def build(kind):
    torch.manual_seed(0)
    if kind == "gpt2-small":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_positions=2048))
    if kind == "opt-125m":
        return transformers.OPTForCausalLM(transformers.OPTConfig(
            vocab_size=50272, hidden_size=768, num_hidden_layers=1, ffn_dim=3072, num_attention_heads=12,
            max_position_embeddings=2048, word_embed_proj_dim=768))
    if kind == "smollm2-135m-shape":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=1, num_attention_heads=9,
            num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True))
    raise ValueError(kind)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048, help="cache length")
    ap.add_argument("--out", default="docs/recovery_cost.json", help="JSON results file")
    a = ap.parse_args()
    rows = []
    for kind in ("gpt2-small", "opt-125m", "smollm2-135m-shape"):
        for dtype in (torch.float32, torch.bfloat16):
            model = build(kind).to(dtype).eval()
            ids = torch.randint(0, model.config.vocab_size, (1, a.tokens))
            with torch.no_grad():
                kv = kvcodec.to_canonical(model(ids, use_cache=True).past_key_values)
            t0 = time.perf_counter()
            r = recover(kv, model)  # first call: builds the table where there is one
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            r = recover(kv, model)
            again = time.perf_counter() - t0
            rows.append({"model": kind, "dtype": str(dtype)[6:], "tokens": a.tokens, "method": r.method,
                         "exact": bool(r.ok and torch.equal(r.tokens, ids)), "first_call_s": round(first, 2),
                         "later_call_s": round(again, 2), "threads": torch.get_num_threads(),
                         "max_relative_distance": r.max_relative_distance})
            print(json.dumps(rows[-1]), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
