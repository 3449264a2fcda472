"""``kvz demo``: the main job, end to end, on the embedded default model.

Loads SmolLM2-135M-Instruct (offline), builds a real KV cache from text, saves
it as .kvz, inspects the file, loads it back, checks the tensors are
bit-identical, checks that greedy generation continues identically from the
restored cache, stores it once more in the lossy tier (3 bits per component) and
reports how long greedy generation agrees from that, and prints a size table.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import torch
import zstandard


def run_demo(args) -> int:
    from .. import api, dtypes
    from ..cache import to_canonical
    from ..formatting import human as _human
    from ..formatting import inspection_text, progress_bar
    from ..models import load_model, prefill, tokenize
    from ..tokens.plan import cache_kwarg
    from .common import demo_text

    dtype = dtypes.parse(args.dtype).torch
    t0 = time.perf_counter()
    model, tok = load_model("smollm2", dtype=dtype)
    print(f"[1/8] loaded SmolLM2-135M-Instruct ({args.dtype}) in {time.perf_counter() - t0:.1f} s")

    text = Path(args.text).read_text(encoding="utf-8") if args.text else demo_text()
    ids = tokenize(tok, text, args.tokens + 1)
    prompt, nxt = ids[:, :-1], ids
    t = time.perf_counter()
    cache = prefill(model, prompt)
    t_prefill = time.perf_counter() - t
    kv = to_canonical(cache)
    print(f"[2/8] built a real cache: {prompt.shape[1]} tokens x {kv.num_layers} layers, "
          f"{_human(kv.nbytes())} of {kv.dtype_name} (prefill {t_prefill:.2f} s)")

    original = copy.deepcopy(cache)
    lossless_path = str(Path(args.output).with_suffix(".lossless.kvz"))
    t = time.perf_counter()
    n_lossless = api.save(lossless_path, kv, (model, tok), tier="lossless", tokens=prompt)
    print(f"[3/8] lossless tier -> {lossless_path}: {_human(n_lossless)} ({kv.nbytes() / n_lossless:.3f}x) "
          f"in {time.perf_counter() - t:.2f} s (decodes without the model)")
    t = time.perf_counter()
    with progress_bar(prompt.shape[1], "      encoding", "token") as bar:
        # tier "exact": tokens recovered from the cache itself
        n = api.save(args.output, cache, (model, tok), progress=bar.update)
    t_enc = time.perf_counter() - t
    tm = api.inspect(args.output)["token_channel"]
    coder = tm["token_model"] + (f" (blocks of {tm['procedure']['block_tokens']})" if tm["token_model"] == "blocks"
                                 else "")
    print(f"[4/8] exact tier -> {args.output}: {_human(n)} ({kv.nbytes() / n:,.0f}x) in {t_enc:.1f} s "
          f"(tokens recovered from the cache and arithmetic-coded by the {coder} token model, chosen for a restore "
          "in about two prefills; a residual against the recompute. token_model='lm' codes fewer bits and "
          "restores one model step per token)")

    print("[5/8] kvz inspect:")
    print(inspection_text(api.inspect(args.output, verify_checksums=True), args.output, sections=False))

    t = time.perf_counter()
    same_lossless = to_canonical(api.load(lossless_path)).equal(kv)
    t_ll = time.perf_counter() - t
    t = time.perf_counter()
    with progress_bar(prompt.shape[1], "      restoring", "token") as bar:
        restored = api.load(args.output, (model, tok), progress=bar.update)
    t_dec = time.perf_counter() - t
    same = to_canonical(restored).equal(kv)
    print(f"[6/8] loaded back: lossless in {t_ll:.2f} s, bit-identical: {same_lossless}; exact (recomputed with the "
          f"model) in {t_dec:.1f} s, bit-identical: {same}")
    if not (same and same_lossless):
        print("ERROR: a decoded cache differs from the original")
        return 1

    gen_kw = dict(max_new_tokens=32, do_sample=False, pad_token_id=tok.eos_token_id)
    with torch.no_grad():
        a = model.generate(nxt, **{cache_kwarg(model): original}, **gen_kw)
        b = model.generate(nxt, **{cache_kwarg(model): restored}, **gen_kw)
    ok = torch.equal(a, b)
    cont = tok.decode(a[0, nxt.shape[1]:], skip_special_tokens=True).replace("\n", " ")
    print(f"[7/8] greedy generation from the original and the exact-restored cache is identical: {ok}")
    print(f"      continuation: {cont!r}")
    if not ok:
        print("ERROR: generation differs")
        return 1

    lossy_path = str(Path(args.output).with_suffix(".lossy.kvz"))
    t = time.perf_counter()
    n_lossy = api.save(lossy_path, kv, tier="lossy", bits=3.0)
    t_lossy = time.perf_counter() - t
    with torch.no_grad():
        c = model.generate(nxt, **{cache_kwarg(model): api.load(lossy_path)}, **gen_kw)
    agree = 0
    for x, y in zip(a[0, nxt.shape[1]:].tolist(), c[0, nxt.shape[1]:].tolist()):
        if x != y:
            break
        agree += 1
    print(f"[8/8] lossy tier, 3 bits/component -> {lossy_path}: {_human(n_lossy)} in {t_lossy:.1f} s (decodes "
          f"without the model); greedy continuation from it agrees for {agree}/32 tokens")
    print("      (greedy decoding follows the first different choice away, so this count is a strict test: "
          "the quality measure is the KL of next-token distributions, `kvz eval`; at 3 bits SmolLM2's mean "
          "KL is ~0.008 bits, BENCHMARKS.md)")

    raw = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in kv.keys + kv.values)
    z3 = len(zstandard.ZstdCompressor(level=3).compress(raw))
    tc = api.inspect(args.output)["token_channel"]
    print("\nsize of this cache:")
    comps = len(raw) / kv.keys[0].element_size()
    rows = (("raw tensors", len(raw)), ("zstd -3", z3), ("kvz lossless (no model to decode)", n_lossless),
            ("kvz lossy, 3 bits (no model to decode)", n_lossy),
            ("kvz exact, whole file", n), ("kvz exact, token stream only", tc["token_stream_bytes"]))
    w = max(len(name) for name, _ in rows)  # every label fits: the columns line up
    print(f"  {'method':{w}s} {'bytes':>12s} {'ratio':>10s} {'bits/comp':>10s}")
    for name, size in rows:
        print(f"  {name:{w}s} {size:12d} {len(raw) / size:10.1f} {8 * size / comps:10.5f}")
    print(f"  token stream ({tc['token_model']}): {tc['bits_per_token']} bits/token; restoring decodes the tokens "
          f"and runs the model over them again ({t_dec:.1f} s here, vs {t_prefill:.2f} s for a bare prefill); "
          "token_model='lm' spends about half the bits and restores one model step per token (BENCHMARKS.md, "
          "\"Token models\")")
    return 0
