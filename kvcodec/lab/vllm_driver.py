"""Run prompts through vLLM (its CPU build, in the venv scripts/vllm_env.sh builds), with kvcodec's connector,
vLLM's example connector or none, and print one JSON line: per prompt its greedy output ids, how many prompt
tokens the engine did not compute (``num_cached_tokens``) and its seconds, the connector's metrics and its store
namespace's model id.  Used by tests/test_vllm.py and ``kvz bench --vllm`` (each engine a fresh process).

    python -m kvcodec.lab.vllm_driver CONFIG.json

:func:`drive` runs it from another Python (the tests', the bench's) and :func:`venv_python` builds the venv.

CONFIG: ``model`` (directory), ``prompts`` (lists of token ids, served one at a time), ``max_tokens``,
``store`` (None: no connector), ``connector`` (``"kvz"``, default, or ``"example"``: vLLM's ExampleConnector
with ``store`` as its directory), ``storage_options``, ``extra`` (more kv_connector_extra_config), ``dtype``,
``max_model_len``, ``prefix_caching``.
"""

import json
import os
import sys
import time
from pathlib import Path

from .common import engine_venv, run_driver


def venv_python(checkout: Path, timeout: float = 1800) -> str:
    """Build (once) the vLLM venv with the checkout's scripts/vllm_env.sh and return its python; RuntimeError
    with the script's output when it cannot be built."""
    return engine_venv(checkout, "vllm_env.sh", timeout)


def drive(python: str, cfg: dict, tmp: Path, *, multiprocess: bool = False, timeout: float = 1800) -> dict:
    """Run this module on ``cfg`` with ``python`` (a fresh engine process; vLLM's engine core in it unless
    ``multiprocess``) and return its result, with ``log`` (the engine's output); RuntimeError when it fails."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0",
           "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return run_driver(python, "kvcodec.lab.vllm_driver", cfg, tmp, env=env, timeout=timeout)


def main() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    cfg = json.loads(Path(sys.argv[1]).read_text())
    from vllm import LLM, SamplingParams

    kw = {}
    kvz = cfg.get("store") is not None and cfg.get("connector", "kvz") == "kvz"
    if kvz:
        from kvcodec.vllm import transfer_config

        kw["kv_transfer_config"] = transfer_config(cfg["store"], storage_options=cfg.get("storage_options"),
                                                   **cfg.get("extra", {}))
    elif cfg.get("store") is not None:
        from vllm.config import KVTransferConfig

        kw["kv_transfer_config"] = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                                                    kv_connector_extra_config={"shared_storage_path": cfg["store"]})
    t0 = time.perf_counter()
    llm = LLM(model=cfg["model"], enforce_eager=True, max_model_len=cfg.get("max_model_len", 2048),
              dtype=cfg.get("dtype", "bfloat16"), enable_prefix_caching=cfg.get("prefix_caching", False),
              disable_log_stats=False, seed=0, **kw)
    started = time.perf_counter() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=cfg.get("max_tokens", 12), logprobs=cfg.get("logprobs"))
    results = []
    for ids in cfg["prompts"]:  # one at a time: each request's time to first token is its own
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
        r = {"output": list(out.outputs[0].token_ids), "cached": int(out.num_cached_tokens or 0),
             "prompt": len(ids), "seconds": round(time.perf_counter() - t, 3)}
        if cfg.get("logprobs") and out.outputs[0].logprobs:  # the first position's top tokens
            r["logprobs"] = [[int(k), float(v.logprob)] for k, v in out.outputs[0].logprobs[0].items()]
        results.append(r)
    flush = 0
    if kvz:
        # saves run in the background and their counters reach the metrics with the engine's next step:
        # wait for them (in-process engine), then step once with a one-token prompt (nothing looked up or saved)
        try:
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            get_kv_transfer_group().wait_for_saves(timeout=600)
        except Exception:  # noqa: BLE001 - a multiprocess engine: its worker is elsewhere
            time.sleep(3.0)
        llm.generate([{"prompt_token_ids": [1]}], SamplingParams(max_tokens=1), use_tqdm=False)
        flush = 1
    metrics = {}
    try:
        for m in llm.get_metrics():
            if m.name.startswith("vllm:kvz_"):
                metrics[m.name] = metrics.get(m.name, 0) + getattr(m, "value", 0)
    except Exception as e:  # noqa: BLE001 - metrics are reported, not required here
        metrics["error"] = repr(e)
    model_id = None
    if kvz:
        from kvcodec.vllm import model_identity

        model_id = model_identity(llm.llm_engine.vllm_config)
    print("KVZ-RESULT " + json.dumps({"results": results, "metrics": metrics, "model_id": model_id,
                                      "start_seconds": round(started, 2), "flush_tokens": flush}), flush=True)


if __name__ == "__main__":
    main()
