"""``kvz bench --llama-cpp``: kvcodec with llama.cpp (llama-cpp-python in the venv scripts/llama_env.sh builds,
SmolLM2's own GGUF), each llama.cpp run a fresh process (kvcodec/lab/llama_driver.py).

* **State files**: for prompts of 512 to 4,096 tokens (the corpus's Austen novel where ``$KVCODEC_CORPUS`` names
  it, else the embedded chapters), llama.cpp's sequence state file (f16 KV, and q8_0 with flash attention):
  its size raw, with zstd -3 and packed per tier (lossless; lossy at 4 and 3 bits), pack and unpack speed
  (median of 3), and the time a fresh context takes to load the state file against re-evaluating the prompt.
  Lossy: the KL divergence of llama.cpp's next-token distributions over the 32 tokens after the prompt (the
  state loaded, then those tokens evaluated) from the original state's, and top-1 agreement.
* **Shared prefix**: a 1,024-token document and five questions after it; a first process answers the first,
  then each other question is answered by a fresh process (a restart: only the cache can help): with no cache,
  llama-cpp-python's ``LlamaDiskCache`` and :class:`kvcodec.llama_cpp.KvzLlamaCache` (lossless): bytes on
  disk after all, requests that restored a prefix, time to first token (median of the fresh processes), and
  whether every answer equals the no-cache run's."""

from __future__ import annotations

import hashlib
import json
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from .common import corpus_dir, disk_usage, demo_text, write_report
from .llama_driver import drive, venv_python

LENGTHS = (512, 1024, 2048, 4096)
Q8 = {"flash_attn": True, "type_k": 8, "type_v": 8}  # llama.cpp's q8_0 KV cache (quantized V needs flash attention)
CONTINUATION = 32
QUESTIONS = ["\n\nQuestion: Who is Mr. Bingley? Answer:", "\n\nQuestion: What does Mrs. Bennet want? Answer:",
             "\n\nQuestion: Where is Netherfield? Answer:", "\n\nSummarise the passage in one sentence:",
             "\n\nQuestion: How many daughters do the Bennets have? Answer:"]


def _python(args) -> str:
    if getattr(args, "llama_python", None):
        return args.llama_python
    checkout = Path(__file__).resolve().parents[2]
    if not (checkout / "scripts" / "llama_env.sh").is_file():
        raise SystemExit("kvz bench --llama-cpp: give --llama-python (a venv with llama-cpp-python and kvcodec), or "
                         "run it from a checkout (scripts/llama_env.sh builds one)")
    try:
        return venv_python(checkout)
    except RuntimeError as e:
        raise SystemExit(f"scripts/llama_env.sh failed: {e}") from None


def _tokenize(py: str, gguf: str, text: str, tmp: Path) -> list[int]:
    src = tmp / "text.txt"
    src.write_text(text, encoding="utf-8")
    code = ("import json; from llama_cpp import Llama; "
            f"l = Llama({gguf!r}, vocab_only=True, verbose=False); "
            f"print(json.dumps(l.tokenize(open({str(src)!r}, 'rb').read())))")
    r = subprocess.run([py, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def _timed(fn, repeat: int = 3):
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def _states(py, gguf, tokens, tmp) -> list[dict]:
    import zstandard

    from ..llama_cpp import pack_bytes, unpack_bytes

    rows = []
    for n in LENGTHS:
        if n + CONTINUATION > len(tokens):
            print(f"  {n} tokens: the text has {len(tokens)}; skipped")
            continue
        print(f"  {n} tokens ...", flush=True)
        cfg = {"model": gguf, "tokens": tokens[:n], "out": str(tmp), "n_ctx": n + CONTINUATION + 16}
        f16 = drive(py, {**cfg, "scenario": "timings", "name": f"f16-{n}"}, tmp)
        q8 = drive(py, {**cfg, "scenario": "timings", "name": f"q8-{n}", "context": Q8}, tmp)
        row = {"tokens": n, "prefill_s": f16["prefill_s"], "load_state_file_s": f16["load_s"],
               "q8_prefill_s": q8["prefill_s"], "q8_load_s": q8["load_s"]}
        files = [f16["file"]]
        for name, path in (("f16", f16["file"]), ("q8_0", q8["file"])):
            data = Path(path).read_bytes()
            r = {"raw": len(data), "zstd3": len(zstandard.ZstdCompressor(level=3).compress(data))}
            pack_s, packed = _timed(lambda: pack_bytes(data, gguf))
            unpack_s, back = _timed(lambda: unpack_bytes(packed, gguf))
            if back != data:
                raise SystemExit(f"{path}: unpack did not rebuild the state byte for byte")
            r.update(lossless=len(packed), pack_s=pack_s, unpack_s=unpack_s,
                     pack_mb_s=len(data) / pack_s / 1e6, unpack_mb_s=len(data) / unpack_s / 1e6)
            if name == "f16":
                for bits in (4, 3):
                    lossy = pack_bytes(data, gguf, tier="lossy", bits=float(bits))
                    r[f"lossy{bits}"] = len(lossy)
                    out = tmp / f"f16-{n}-lossy{bits}.ggsq"
                    out.write_bytes(unpack_bytes(lossy, gguf))
                    files.append(str(out))
                t0 = time.perf_counter()
                unpack_bytes(packed, gguf)
                r["unpack_then_load_s"] = time.perf_counter() - t0 + f16["load_s"]
            row[name] = r
        tok = drive(py, {"scenario": "pack_tokens", "model": gguf, "files": [f16["file"]]}, tmp)[
            Path(f16["file"]).name]
        if not tok["same"]:
            raise SystemExit(f"{f16['file']}: tier tokens did not rebuild the state byte for byte")
        row["f16"].update(tokens=tok["packed"], tokens_recomputed=tok["recomputed"], tokens_unpack_s=tok["unpack_s"],
                          tokens_pack_s=tok["pack_s"])
        kl = drive(py, {"scenario": "kl", "model": gguf, "files": files + [[q8["file"], Q8]],
                        "continuation": tokens[n:n + CONTINUATION], "n_ctx": n + CONTINUATION + 16}, tmp)["files"]
        for key, got in zip(("lossless", "lossy4", "lossy3", "q8_0"), kl):
            row[f"kl_{key}"] = {"median": statistics.median(got["kl"]), "max": max(got["kl"]), "top1": got["top1"]}
        rows.append(row)
    return rows


def _shared_prefix(py, gguf, tokens, tmp) -> dict:
    prefix = tokens[:1024]
    prompts = [prefix + _tokenize(py, gguf, q, tmp) for q in QUESTIONS]
    out = {}
    for name in ("none", "disk", "kvz"):
        where = tmp / f"cache-{name}"
        cfg = {"scenario": "cache", "model": gguf, "gen": 8, "n_ctx": 2048}
        if name == "disk":
            cfg["disk"] = str(where)
        elif name == "kvz":
            cfg["store"] = str(where)
        runs = [drive(py, {**cfg, "prompts": [p]}, tmp) for p in prompts]
        ttft = [r["rows"][0]["ttft_s"] for r in runs[1:]]
        hits = sum(1 for r in runs[1:] if r["lookups"]["hits"])
        out[name] = {"bytes": disk_usage(where), "ttft_median_s": statistics.median(ttft), "ttft_s": ttft,
                     "first_ttft_s": runs[0]["rows"][0]["ttft_s"], "restored": hits, "requests": len(runs) - 1,
                     "texts": [r["rows"][0]["text"] for r in runs],
                     "setup_s": statistics.median(r["setup_s"] for r in runs)}
    for name in ("disk", "kvz"):
        out[name]["same_answers"] = out[name]["texts"] == out["none"]["texts"]
    return out


def _mib(n) -> str:
    return f"{n / 2**20:.2f}"


def _markdown(res: dict) -> str:
    lines = ["# kvcodec with llama.cpp", "",
             f"`kvz bench --llama-cpp` on {res['machine']}, llama-cpp-python {res['llama_cpp_python']} (portable "
             f"x86-64-v3 build), SmolLM2-135M-Instruct Q4_1 GGUF, text: {res['text']}. Each llama.cpp run is a "
             "fresh process; times are medians of 3 where stated, one run otherwise.", "",
             "## State files: size", "",
             "llama.cpp's sequence state file (`llama_state_seq_save_file`); MiB, and the ratio to the raw file.", "",
             "| tokens | f16 raw | zstd -3 | packed lossless | lossy 4 bit | lossy 3 bit | tier tokens | q8_0 raw "
             "| q8_0 zstd -3 | q8_0 packed |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["states"]:
        a, q = r["f16"], r["q8_0"]

        def c(x, raw):
            return f"{_mib(x)} ({raw / x:.2f}x)"
        lines.append(f"| {r['tokens']} | {_mib(a['raw'])} | {c(a['zstd3'], a['raw'])} | "
                     f"{c(a['lossless'], a['raw'])} | {c(a['lossy4'], a['raw'])} | {c(a['lossy3'], a['raw'])} | "
                     f"{a['tokens'] / 1024:.2f} KiB ({a['raw'] / a['tokens']:.0f}x) | {_mib(q['raw'])} | "
                     f"{c(q['zstd3'], q['raw'])} | {c(q['lossless'], q['raw'])} |")
    lines += ["", "## State files: speed and restore", "",
              "| tokens | pack f16 MB/s | unpack f16 MB/s | load the state file (fresh context) | unpack + load "
              "| re-evaluate the prompt | prefill / load | tier tokens: pack, unpack (each a prefill) |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["states"]:
        a = r["f16"]
        lines.append(f"| {r['tokens']} | {a['pack_mb_s']:.1f} | {a['unpack_mb_s']:.1f} | "
                     f"{r['load_state_file_s'] * 1e3:.0f} ms | "
                     f"{a['unpack_then_load_s'] * 1e3:.0f} ms | {r['prefill_s'] * 1e3:.0f} ms | "
                     f"{r['prefill_s'] / r['load_state_file_s']:.1f}x | {a['tokens_pack_s']:.1f} s, "
                     f"{a['tokens_unpack_s']:.1f} s |")
    lines += ["", "## Lossy states through llama.cpp's logits", "",
              f"KL (nats) of the next-token distribution over the {CONTINUATION} tokens after the prompt, the state "
              "loaded into a fresh context, from the original state's; median / max, and top-1 agreement. `q8_0` is "
              "llama.cpp's own quantized cache (a context made with it), for scale.", "",
              "| tokens | lossless | lossy 4 bit | lossy 3 bit | q8_0 cache |", "|---:|---:|---:|---:|---:|"]
    for r in res["states"]:
        cells = [f"{r[f'kl_{k}']['median']:.2g} / {r[f'kl_{k}']['max']:.2g}, top-1 {r[f'kl_{k}']['top1']:.2f}"
                 for k in ("lossless", "lossy4", "lossy3", "q8_0")]
        lines.append(f"| {r['tokens']} | " + " | ".join(cells) + " |")
    su, det = res["surprisal"], res["determinism"]
    ref = det["n_batch 512"]
    lines += ["", "## The token channel", "",
              f"The first {su['tokens']} tokens cost {su['bits_per_token']:.2f} bits per token under llama.cpp's own "
              f"next-token distributions (SmolLM2, vocabulary {su['vocab']}): an arithmetic-coded token stream of "
              f"about {su['bits_per_token'] * su['tokens'] / 8 / 1024:.1f} KiB, against "
              f"{_mib(23052 * su['tokens'])} MiB of f16 state (tier tokens stores the ids as 4-byte integers, "
              "zstd-coded where it pays: an arithmetic coder would make them about 8x smaller still). Recomputing "
              "the state from the tokens is a prefill "
              f"({su['prefill_s'] * 1e3:.0f} ms here, logits of every position kept). Does llama.cpp regenerate the "
              "same state bytes (SHA-256 of the sequence state file, fresh contexts, the reference is n_batch 512, "
              "2 threads)?", "", "| context | same bytes |", "|---|---|"]
    lines += [f"| {name} | {'yes' if h == ref else 'no'} |" for name, h in det.items() if name != "n_batch 512"]
    sp = res["shared_prefix"]
    lines += ["", "## Shared prefix: KvzLlamaCache against LlamaDiskCache", "",
              f"A 1,024-token document and {len(QUESTIONS)} questions; the first answered by one process, each other "
              "by a fresh process (8 tokens, greedy). Set-up: constructing the cache (KvzLlamaCache: the GGUF's "
              "identity, the context's state layout, and a warm-up of the decoder's compiled kernels, which a "
              "server does before it takes requests); TTFT counts from the request.", "",
              "| cache | bytes on disk | prefixes restored | cache set-up | TTFT, fresh process (median) "
              "| answers = no cache |",
              "|---|---:|---:|---:|---:|---|"]
    for name, label in (("none", "none"), ("disk", "llama-cpp-python `LlamaDiskCache`"),
                        ("kvz", "`KvzLlamaCache` (lossless)")):
        x = sp[name]
        lines.append(f"| {label} | {_mib(x['bytes'])} MiB | {x['restored']} of {x['requests']} | "
                     f"{x['setup_s'] * 1e3:.0f} ms | {x['ttft_median_s'] * 1e3:.0f} ms | "
                     f"{x.get('same_answers', '-')} |")
    lines.append("")
    return "\n".join(lines)


def run_llama_bench(args) -> int:
    from ..llama_cpp import gguf_path

    py = _python(args)
    gguf = str(gguf_path("smollm2"))
    corpus = corpus_dir()
    if corpus is not None and (corpus / "prose_en_austen_pride_and_prejudice.txt").is_file():
        text, label = (corpus / "prose_en_austen_pride_and_prejudice.txt").read_text(encoding="utf-8"), \
            "the corpus's Pride and Prejudice"
    else:
        text, label = demo_text(), "the embedded chapters of Pride and Prejudice"
    version = subprocess.run([py, "-c", "import llama_cpp; print(llama_cpp.__version__)"], capture_output=True,
                             text=True, check=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="kvz-bench-llama-") as d:
        tmp = Path(d)
        tokens = _tokenize(py, gguf, text, tmp)
        print(f"llama.cpp bench: {len(tokens)} tokens of text")
        res = {"machine": f"{platform.machine()}, {platform.processor() or 'cpu'}", "llama_cpp_python": version,
               "text": label, "text_sha256": hashlib.sha256(text.encode()).hexdigest()}
        res["states"] = _states(py, gguf, tokens, tmp)
        print("  token channel ...", flush=True)
        n = min(1024, len(tokens))
        res["surprisal"] = drive(py, {"scenario": "surprisal", "model": gguf, "tokens": tokens[:n],
                                      "n_ctx": n + 16}, tmp)
        res["surprisal"].pop("log", None)
        res["determinism"] = drive(py, {"scenario": "determinism", "model": gguf, "tokens": tokens[:n],
                                        "out": str(tmp), "n_ctx": n + 16, "variants": {
                                            "n_batch 512": {}, "again": {}, "1 thread": {"threads": 1},
                                            "n_batch 64": {"n_batch": 64}, "n_batch 1": {"n_batch": 1},
                                            "flash attention": {"flash_attn": True}}}, tmp)
        res["determinism"].pop("log", None)
        print("  shared prefix ...", flush=True)
        res["shared_prefix"] = _shared_prefix(py, gguf, tokens, tmp)
    write_report(args.out, "bench_llama_cpp", res, _markdown(res))
    return 0
