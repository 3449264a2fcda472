"""What the measurement commands share: the corpus, the demo text, timing, and their report files.

The corpus is never looked up beside the package: ``--corpus DIR`` or
``$KVCODEC_CORPUS`` names it (in this repository's checkout,
``../shared/corpus``).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from importlib import resources
from pathlib import Path

import numpy as np

DEMO_TEXT = "austen_pride_and_prejudice_ch1-3.txt"


def demo_text() -> str:
    """The public-domain text shipped in the wheel (the demo's)."""
    return resources.files("kvcodec.data").joinpath(DEMO_TEXT).read_text(encoding="utf-8")


def corpus_dir(path=None) -> Path | None:
    """``path``, else ``$KVCODEC_CORPUS``; None if neither names a folder."""
    p = path or os.environ.get("KVCODEC_CORPUS")
    return Path(p) if p and Path(p).is_dir() else None


def corpus_files(path=None) -> list[Path]:
    """The corpus texts (every file of :func:`corpus_dir` but its ``.md`` notes), sorted."""
    d = corpus_dir(path)
    if d is None:
        return []
    return sorted(p for p in d.iterdir() if p.is_file() and p.suffix != ".md")


def missing_corpus(command: str) -> int:
    print(f"{command}: corpus not found; pass --corpus DIR or set KVCODEC_CORPUS (in a checkout: ../shared/corpus)")
    return 1


def selected_files(args) -> list[Path]:
    """The corpus texts ``--corpus`` names, narrowed to ``--genres`` when given."""
    files = corpus_files(args.corpus)
    if getattr(args, "genres", None):
        files = [f for f in files if f.name in set(args.genres)]
    return files


def machine_info() -> dict:
    """What a bench's results record about the machine and the libraries that set its speed."""
    import platform

    import numba
    import torch

    parts = (platform.machine(), platform.processor(), _cpu())
    return {"machine": " ".join(p for p in parts if p), "cpus": os.cpu_count(),
            "torch": torch.__version__, "numba": numba.__version__}


def _cpu() -> str:
    """The CPU as the vector kernels are compiled for it (LLVM's name and its widest vector extension, e.g.
    ``znver4, AVX-512``): speeds of different runs compare only on the same one."""
    try:
        import llvmlite.binding as llvm

        llvm.initialize_native_target()
        feats = llvm.get_host_cpu_features().flatten().split(",")
    except Exception:  # noqa: BLE001 - informative only
        return ""
    widest = "AVX-512" if "+avx512f" in feats else "AVX2" if "+avx2" in feats else "no AVX2"
    return f"({llvm.get_host_cpu_name()}, {widest})"


def corpus_caches(cdir: Path, genres, dtype_names, tokens: int):
    """``(dtype name, text name, model in that dtype, ids [1, n], canonical cache)`` of SmolLM2's cache of the
    first ``tokens`` tokens of each text, one prefill each, for every dtype (the model is loaded once)."""
    from .. import dtypes
    from ..cache import to_canonical
    from ..models import load_model, prefill, tokenize

    model, tok = load_model("smollm2")
    for dname in dtype_names:
        m = model.to(dtypes.parse(dname).torch)
        for g in genres:
            ids = tokenize(tok, (cdir / g).read_text(encoding="utf-8"), tokens)
            yield dname, g, m, ids, to_canonical(prefill(m, ids))


def text_cache(text: str, tokens: int, dtype: str = "bfloat16"):
    """``(model, ids [1, n], canonical cache)``: SmolLM2's cache of the first ``tokens`` tokens of the corpus file
    ``text`` (a study's one cache; :func:`corpus_caches`); SystemExit when ``$KVCODEC_CORPUS`` names no corpus."""
    cdir = corpus_dir(None)
    if cdir is None:
        raise SystemExit("set KVCODEC_CORPUS to the corpus folder")
    _, _, model, ids, kv = next(corpus_caches(cdir, [text], [dtype], tokens))
    return model, ids, kv


def median_time(fn, repeats: int) -> tuple[float, object]:
    """Median wall time of ``repeats`` calls of ``fn``, and the last result."""
    times, out = [], None
    for _ in range(max(1, repeats)):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def touch_fresh_memory(nbytes: int) -> None:
    """Allocate ``nbytes`` of new memory, write one byte in each 4 KiB page, free it.  A benchmark calls this (untimed)
    before each timed call whose result is new memory: the pages the system hands that call are then ones it has
    just handed out and taken back.  On a virtual machine whose host takes back the memory its guest leaves free
    (free page reporting: Firecracker and others), the first touch of memory that was free for more than a few
    seconds costs the host's page faults too, here ~15x the usual (90 MiB: ~190 ms against ~12 ms;
    ``scripts/studies/first_touch.py``), which would be charged to whichever call came first after a long one."""
    if nbytes > 0:
        block = np.empty(nbytes, dtype=np.uint8)
        block[::4096] = 0
        del block


def interleaved_medians(fns: dict, repeats: int, before=None) -> dict:
    """``{key: median seconds}`` of the calls ``fns[key]()``, every function once per round, ``repeats`` rounds:
    ratios of two of them are measured under the same load.  A call's result is freed after its time is taken.
    ``before()``, if given, runs before each call, untimed (e.g. :func:`touch_fresh_memory`)."""
    times = {key: [] for key in fns}
    for _ in range(max(1, repeats)):
        for key, fn in fns.items():
            if before is not None:
                before()
            t = time.perf_counter()
            out = fn()
            times[key].append(time.perf_counter() - t)
            del out
    return {key: statistics.median(v) for key, v in times.items()}


def write_report(out_dir, stem: str, results: dict, markdown: str) -> Path:
    """Write ``OUT/stem.json`` and ``OUT/stem.md``, the output of a bench / claims / eval command."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1, default=float))
    (out / f"{stem}.md").write_text(markdown)
    print(f"wrote {out / f'{stem}.json'} and {out / f'{stem}.md'}")
    return out


# -- the engines' venvs and driver processes (vllm_driver.py, llama_driver.py) ----------------------------------
def engine_venv(checkout: Path, script: str, timeout: float) -> str:
    """Build (once) an engine's venv with the checkout's ``scripts/<script>`` and return its python; RuntimeError
    with the script's output when it cannot be built."""
    r = subprocess.run(["bash", str(checkout / "scripts" / script)], check=False, capture_output=True, text=True,
                       timeout=timeout, cwd=checkout)
    if r.returncode:
        raise RuntimeError((r.stderr or r.stdout)[-2000:])
    return str(checkout / r.stdout.strip().splitlines()[-1])


def run_driver(python: str, module: str, cfg: dict, tmp: Path, *, env: dict | None = None,
               timeout: float = 1800) -> dict:
    """``python -m module CFG.json`` in ``tmp`` (a fresh process): the JSON of its last ``KVZ-RESULT`` line, with
    ``log`` (its output); RuntimeError when it fails."""
    path = tmp / f"cfg-{os.urandom(4).hex()}.json"
    path.write_text(json.dumps(cfg))
    r = subprocess.run([python, "-m", module, str(path)], check=False, capture_output=True, text=True,
                       timeout=timeout, env=env, cwd=tmp)
    lines = [x for x in r.stdout.splitlines() if x.startswith("KVZ-RESULT ")]
    if r.returncode or not lines:
        raise RuntimeError(f"{module} failed (rc {r.returncode}):\n{r.stderr[-4000:]}")
    out = json.loads(lines[-1][len("KVZ-RESULT "):])
    out["log"] = r.stdout + r.stderr
    return out


def disk_usage(path: Path) -> int:
    """Bytes of the files under ``path`` (0 if it does not exist)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0
