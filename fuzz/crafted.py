#!/usr/bin/env python
"""Write the hand-made hostile files of issue 10 into ``tests/data/malformed/`` (rerun after a format change).

Each file is a golden vector with one field made hostile and every checksum resealed, so it reaches the
check it is about; ``tests/test_malformed.py`` decodes each one and expects a ``KvzError``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "fuzz"))

from fuzz import header_of, with_header  # noqa: E402

OUT = ROOT / "tests" / "data" / "malformed"


def vector(case: str) -> bytes:
    return (ROOT / "spec" / "vectors" / f"{case}.kvz").read_bytes()


def raw_info(case: str, raw: str) -> bytes:
    """``case`` with ``info`` replaced by the JSON text ``raw``."""
    data = vector(case)
    h = header_of(data)
    h["info"] = "@@"
    text = json.dumps(h, sort_keys=True, separators=(",", ":"), ensure_ascii=False).replace('"@@"', raw)
    return with_header(data, None, raw=text.encode())


def huge_schedule() -> bytes:
    data = vector("exact_lm_steps")
    h = header_of(data)
    n = 10**8
    h["cache"]["num_tokens"] = n
    for lay in h["cache"]["layers"]:
        lay.update(seq_len=4, sliding_window=4, cumulative_length=n)
    h["tokens"]["schedule"] = [[1, n]]
    return with_header(data, h)


def files() -> dict[str, bytes]:
    return {
        "header-bigint.bin": raw_info("bf16_basic", '{"n":%s}' % ("7" * 4400)),
        "header-deep.bin": raw_info("bf16_basic", "[" * 985 + "]" * 985),
        "header-inf.bin": raw_info("bf16_basic", "1e400"),
        "header-surrogate.bin": raw_info("bf16_basic", '"\\udc00"'),
        "schedule-huge.bin": huge_schedule(),
        "trailing-data.bin": vector("fp16_tiny") + b"\x00" * 17,
    }


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    for name, data in files().items():
        (OUT / name).write_bytes(data)
        print(f"{name}: {len(data)} bytes")
