"""``kvz demo``: the main job, end to end, on the embedded default model.

Loads SmolLM2-135M-Instruct (offline), builds a real KV cache from text, saves
it as .kvz, inspects the file, loads it back, checks the tensors are
bit-identical, checks that greedy generation continues identically from the
restored cache, and prints a size table.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import torch
import zstandard


def run_demo(args) -> int:
    from . import api
    from .cache import to_canonical
    from .cli import _human, cmd_inspect
    from .models import load_model
    from .runtime import DTYPE_ALIASES, cache_kwarg, demo_text, prefill, tokenize

    dtype = DTYPE_ALIASES[args.dtype]
    t0 = time.perf_counter()
    model, tok = load_model("smollm2", dtype=dtype)
    print(f"[1/6] loaded SmolLM2-135M-Instruct ({args.dtype}) in {time.perf_counter() - t0:.1f} s")

    text = Path(args.text).read_text(encoding="utf-8") if args.text else demo_text()
    ids = tokenize(tok, text, args.tokens + 1)
    prompt, nxt = ids[:, :-1], ids
    cache = prefill(model, prompt)
    kv = to_canonical(cache)
    print(f"[2/6] built a real cache: {prompt.shape[1]} tokens x {kv.num_layers} layers, "
          f"{_human(kv.nbytes())} of {kv.dtype_name}")

    original = copy.deepcopy(cache)
    t = time.perf_counter()
    n = api.save(args.output, kv, (model, tok), tokens=prompt)
    print(f"[3/6] saved {args.output}: {_human(n)} ({kv.nbytes() / n:.3f}x) in {time.perf_counter() - t:.2f} s")

    print("[4/6] kvz inspect:")
    ns = type("A", (), {"file": args.output, "json": False, "verify": True, "sections": False})
    cmd_inspect(ns)

    t = time.perf_counter()
    restored = api.load(args.output, (model, tok))
    back = to_canonical(restored)
    same = back.equal(kv)
    print(f"[5/6] loaded back in {time.perf_counter() - t:.2f} s: tensors bit-identical: {same}")
    if not same:
        print("ERROR: decoded cache differs from the original")
        return 1

    gen_kw = dict(max_new_tokens=32, do_sample=False, pad_token_id=tok.eos_token_id)
    with torch.no_grad():
        a = model.generate(nxt, **{cache_kwarg(model): original}, **gen_kw)
        b = model.generate(nxt, **{cache_kwarg(model): restored}, **gen_kw)
    ok = torch.equal(a, b)
    cont = tok.decode(a[0, nxt.shape[1]:], skip_special_tokens=True).replace("\n", " ")
    print(f"[6/6] greedy generation from the original and the restored cache is identical: {ok}")
    print(f"      continuation: {cont!r}")
    if not ok:
        print("ERROR: generation differs")
        return 1

    raw = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in kv.keys + kv.values)
    z3 = len(zstandard.ZstdCompressor(level=3).compress(raw))
    kv_bytes = sum(sec["bytes"] for sec in api.inspect(args.output)["sections"] if sec["type"] == "kv")
    print("\nsize of this cache:")
    print(f"  {'method':32s} {'bytes':>12s} {'ratio':>8s} {'bits/comp':>10s}")
    comps = len(raw) / kv.keys[0].element_size()
    for name, size in (("raw tensors", len(raw)), ("zstd -3", z3), ("kvz lossless, whole file", n),
                       ("kvz lossless, kv payloads only", kv_bytes)):
        print(f"  {name:32s} {size:12d} {len(raw) / size:8.3f} {8 * size / comps:10.3f}")
    return 0
