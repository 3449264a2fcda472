"""Runs llama-cpp-python for the llama.cpp tests and ``kvz bench --llama-cpp``, in the venv scripts/llama_env.sh
builds (llama-cpp-python is not a dependency of kvcodec): ``python -m kvcodec.lab.llama_driver CFG.json`` runs
the scenario ``cfg["scenario"]`` and prints ``KVZ-RESULT {json}``.  Each call is a fresh process.

Scenarios:

* ``states``: evaluates ``tokens`` in a context per ``contexts`` entry (flash attention, KV types), saves its
  sequence state file and ``save_state()`` blob into ``out``, and the greedy continuation of ``gen`` tokens
  of a fresh context that loaded each saved state file.
* ``continue``: the greedy continuation of a fresh context that loaded the state file ``file``.
* ``cache``: completions of ``prompts`` (token ids) with :class:`kvcodec.llama_cpp.KvzLlamaCache` on ``store``
  (or llama-cpp-python's own ``LlamaDiskCache`` with ``"disk": DIR``, or no cache): outputs, time to first
  token, cache statistics.
* ``determinism``: SHA-256 of the sequence state after evaluating ``tokens`` in fresh contexts that differ in
  batch size, threads and flash attention: whether llama.cpp regenerates a state bit for bit.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import sys
import time
from pathlib import Path

from .common import engine_venv, run_driver


def venv_python(checkout: Path, timeout: float = 3600) -> str:
    """Build (once) the llama.cpp venv with the checkout's scripts/llama_env.sh and return its python;
    RuntimeError with the script's output when it cannot be built."""
    return engine_venv(checkout, "llama_env.sh", timeout)


def drive(python: str, cfg: dict, tmp: Path, timeout: float = 1800) -> dict:
    """Run a scenario in a fresh ``python`` process; its result, with ``log``; RuntimeError when it fails."""
    return run_driver(python, "kvcodec.lab.llama_driver", cfg, tmp, timeout=timeout)


def _llama(cfg: dict, **kw):
    from llama_cpp import Llama

    args = {"n_ctx": cfg.get("n_ctx", 4096), "n_batch": cfg.get("n_batch", 512), "verbose": False, "seed": 1,
            "n_threads": cfg.get("threads", 2), **kw}
    return Llama(cfg["model"], **args)


def _save_seq(llm, path: str, tokens: list[int]) -> int:
    import llama_cpp

    arr = (llama_cpp.llama_token * len(tokens))(*tokens)
    n = llama_cpp.llama_state_seq_save_file(llm._ctx.ctx, path.encode(), 0, arr, len(tokens))
    if not n:
        raise RuntimeError(f"llama_state_seq_save_file({path}) failed")
    return int(n)


def _load_seq(llm, path: str) -> list[int]:
    """Load a sequence state file into ``llm`` as llama-cpp-python's own state (its tokens)."""
    import llama_cpp

    cap = llm.n_ctx()
    toks = (llama_cpp.llama_token * cap)()
    n_out = ctypes.c_size_t(0)
    if not llama_cpp.llama_state_seq_load_file(llm._ctx.ctx, path.encode(), 0, toks, cap, ctypes.byref(n_out)):
        raise RuntimeError(f"llama_state_seq_load_file({path}) refused the file")
    n = n_out.value
    llm.input_ids[:n] = toks[:n]
    llm.n_tokens = n
    llm._requires_eval = True
    return list(toks[:n])


def _greedy(llm, tokens: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``tokens`` (llama-cpp-python reuses what the context holds of them)."""
    out = []
    for t in llm.generate(tokens, temp=0.0, top_k=1, reset=True):
        out.append(int(t))
        if len(out) >= n:
            break
    return out


def scenario_states(cfg: dict) -> dict:
    out = Path(cfg["out"])
    res = {}
    for name, kw in cfg["contexts"].items():
        llm = _llama(cfg, **kw)
        tokens = cfg["tokens"]
        llm.eval(tokens)
        seq = str(out / f"{name}.ggsq")
        _save_seq(llm, seq, tokens)
        (out / f"{name}.state").write_bytes(llm.save_state().llama_state)
        # what the saving context itself generates next (from its own logits); then its state with them
        own = _greedy(llm, tokens, cfg["gen"])
        _save_seq(llm, str(out / f"{name}-gen.ggsq"), [int(t) for t in llm.input_ids[:llm.n_tokens]])
        fresh = _llama(cfg, **kw)
        held = _load_seq(fresh, seq)
        res[name] = {"own": own, "reloaded": _greedy(fresh, held, cfg["gen"]), "bytes": os.path.getsize(seq)}
    return res


def scenario_continue(cfg: dict) -> dict:
    llm = _llama(cfg, **cfg.get("context", {}))
    t0 = time.perf_counter()
    held = _load_seq(llm, cfg["file"])
    load_s = time.perf_counter() - t0
    return {"tokens": len(held), "continuation": _greedy(llm, held, cfg["gen"]), "load_s": load_s}


def scenario_cache(cfg: dict) -> dict:
    from llama_cpp.llama_cache import LlamaDiskCache

    llm = _llama(cfg, **cfg.get("context", {}))
    cache = None
    t0 = time.perf_counter()
    if cfg.get("store"):
        from kvcodec.llama_cpp import KvzLlamaCache

        cache = KvzLlamaCache(llm, cfg["store"], cfg.get("storage_options"), **cfg.get("options", {}))
    elif cfg.get("disk"):
        cache = LlamaDiskCache(cfg["disk"])
    if hasattr(cache, "ready"):  # as a server would: its warm-up done before it takes requests
        cache.ready()
    setup_s = time.perf_counter() - t0
    counts = {"hits": 0, "misses": 0}
    if cache is not None:
        get = type(cache).__getitem__

        def counted(self, key):  # every cache's lookups counted alike (llama-cpp-python logs them only verbose)
            try:
                value = get(self, key)
            except KeyError:
                counts["misses"] += 1
                raise
            counts["hits"] += 1
            return value

        type(cache).__getitem__ = counted
        llm.set_cache(cache)
    rows = []
    for prompt in cfg["prompts"]:
        t0 = time.perf_counter()
        first, toks = None, []
        for c in llm.create_completion(prompt, max_tokens=cfg.get("gen", 8), temperature=0.0, stream=True):
            if first is None:
                first = time.perf_counter() - t0
            toks.append(c["choices"][0]["text"])
        rows.append({"ttft_s": first, "total_s": time.perf_counter() - t0, "text": "".join(toks)})
    if hasattr(cache, "flush"):  # its background puts done (the process's exit would wait for them too)
        cache.flush()
    stats = dict(cache.stats) if hasattr(cache, "stats") else {}
    return {"rows": rows, "stats": stats, "setup_s": setup_s, "lookups": counts}


def scenario_determinism(cfg: dict) -> dict:
    tokens = cfg["tokens"]
    out = {}
    for name, kw in cfg["variants"].items():
        extra = {k: v for k, v in kw.items() if k not in ("n_batch", "threads")}
        llm = _llama({**cfg, **{k: v for k, v in kw.items() if k in ("n_batch", "threads")}}, **extra)
        llm.eval(tokens)
        path = Path(cfg["out"]) / f"det-{name}.ggsq"
        _save_seq(llm, str(path), tokens)
        out[name] = hashlib.sha256(path.read_bytes()).hexdigest()
        path.unlink()
    return out


def scenario_pack_tokens(cfg: dict) -> dict:
    """kvz pack --tier tokens / unpack on each of ``files`` in this process (it runs llama.cpp): sizes, whether
    unpack rebuilt the file byte for byte, the warnings (a fallback to lossless), times."""
    import warnings

    from kvcodec import llama_cpp as K

    out = {}
    for f in cfg["files"]:
        data = Path(f).read_bytes()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            t0 = time.perf_counter()
            packed = K.pack_bytes(data, cfg["model"], tier="tokens")
            t1 = time.perf_counter()
            back = K.unpack_bytes(packed, cfg["model"])
            t2 = time.perf_counter()
        out[Path(f).name] = {"bytes": len(data), "packed": len(packed), "same": back == data,
                             "warnings": [str(x.message) for x in w], "pack_s": t1 - t0, "unpack_s": t2 - t1,
                             "recomputed": b'"recompute"' in packed[:4096]}
    return out


def scenario_timings(cfg: dict) -> dict:
    """Prefill time of ``tokens`` (the state saved to ``out``/``name``.ggsq), and the time a fresh context takes to
    load that state file (median of ``repeat``)."""
    import statistics

    tokens = cfg["tokens"]
    llm = _llama(cfg, **cfg.get("context", {}))
    t0 = time.perf_counter()
    llm.eval(tokens)
    prefill = time.perf_counter() - t0
    path = str(Path(cfg["out"]) / f"{cfg['name']}.ggsq")
    _save_seq(llm, path, tokens)
    loads = []
    for _ in range(cfg.get("repeat", 3)):
        fresh = _llama(cfg, **cfg.get("context", {}))
        t0 = time.perf_counter()
        _load_seq(fresh, path)
        loads.append(time.perf_counter() - t0)
        del fresh
    return {"prefill_s": prefill, "load_s": statistics.median(loads), "file": path}


def scenario_kl(cfg: dict) -> dict:
    """Next-token distributions over ``continuation`` after loading each state file in ``files`` (the first is
    the reference): per file, KL(reference || file) per position (nats) and top-1 agreement."""
    import numpy as np

    logits = []
    for f in cfg["files"]:  # a path, or [path, context options] (a q8_0 state loads into a q8_0 context only)
        f, ctx = (f, cfg.get("context", {})) if isinstance(f, str) else f
        llm = _llama(cfg, logits_all=True, **ctx)
        held = _load_seq(llm, f)
        llm.eval(cfg["continuation"])
        n = len(held)
        logits.append(np.array(llm.scores[n:n + len(cfg["continuation"])], dtype=np.float64))
        del llm

    def logp(x):
        x = x - x.max(axis=1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=1, keepdims=True))

    ref = logp(logits[0])
    out = []
    for x in logits:
        lp = logp(x)
        kl = (np.exp(ref) * (ref - lp)).sum(axis=1)
        out.append({"kl": [float(v) for v in kl], "top1": float((lp.argmax(1) == ref.argmax(1)).mean())})
    return {"files": out}


def scenario_surprisal(cfg: dict) -> dict:
    """Bits per token of ``tokens`` under llama.cpp's own next-token distributions (what an arithmetic coder
    driven by the model would store), and the time of that one prefill."""
    import numpy as np

    tokens = cfg["tokens"]
    llm = _llama(cfg, logits_all=True)
    t0 = time.perf_counter()
    llm.eval(tokens)
    elapsed = time.perf_counter() - t0
    x = np.array(llm.scores[:len(tokens) - 1], dtype=np.float64)
    x -= x.max(axis=1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(axis=1, keepdims=True))
    bits = -logp[np.arange(len(tokens) - 1), tokens[1:]] / np.log(2)
    return {"bits_per_token": float(bits.mean()), "tokens": len(tokens), "prefill_s": elapsed,
            "vocab": int(llm.n_vocab())}


def main() -> None:
    cfg = json.loads(Path(sys.argv[1]).read_text())
    result = globals()[f"scenario_{cfg['scenario']}"](cfg)
    print("KVZ-RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
