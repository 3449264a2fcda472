"""Helpers to build real caches from text with a transformers model."""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path

import torch

DEMO_TEXT = "austen_pride_and_prejudice_ch1-3.txt"
DTYPE_ALIASES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
                 "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def demo_text() -> str:
    return resources.files("kvcodec.data").joinpath(DEMO_TEXT).read_text(encoding="utf-8")


def corpus_dir() -> Path | None:
    """``$KVCODEC_CORPUS``, else ``../shared/corpus`` or ``shared/corpus`` from the cwd or the checkout."""
    env = os.environ.get("KVCODEC_CORPUS")
    if env:
        return Path(env)
    here = Path(__file__).resolve().parent.parent
    for base in (Path.cwd(), here):
        for rel in ("../shared/corpus", "shared/corpus"):
            p = (base / rel).resolve()
            if p.is_dir():
                return p
    return None


def corpus_files() -> list[Path]:
    d = corpus_dir()
    if d is None:
        return []
    return sorted(p for p in d.iterdir() if p.is_file() and p.suffix != ".md")


def write_report(out_dir, stem: str, results: dict, markdown: str) -> Path:
    """Write ``OUT/stem.json`` and ``OUT/stem.md``, the output of a bench / claims / eval command."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1, default=float))
    (out / f"{stem}.md").write_text(markdown)
    print(f"wrote {out / f'{stem}.json'} and {out / f'{stem}.md'}")
    return out


def tokenize(tokenizer, text: str, max_tokens: int) -> torch.Tensor:
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :max_tokens]
    return ids


@torch.no_grad()
def prefill(model, ids: torch.Tensor, dtype=None):
    """Run ``model`` over ``ids`` once; return its ``DynamicCache``."""
    if dtype is not None and next(model.parameters()).dtype != dtype:
        model = model.to(dtype)
    out = model(ids, use_cache=True)
    return out["cache"] if "cache" in out else out["past_key_values"]  # renamed in transformers 5.x


def cache_kwarg(model) -> str:
    """Name of ``generate``'s cache argument: ``cache`` (transformers >= 5.2x) or ``past_key_values``."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"
