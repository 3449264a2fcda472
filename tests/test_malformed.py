"""Regression files: every input the fuzzer ever found a problem with, plus hand-made ones.

Each must be rejected with a KvzError - no other exception, no hang.
"""

from pathlib import Path

import pytest

import kvcodec

from .common import check_rejects

MALFORMED = sorted((Path(__file__).parent / "data" / "malformed").glob("*.bin"))


def test_there_are_regression_files():
    assert MALFORMED


@pytest.mark.parametrize("path", MALFORMED, ids=[p.name for p in MALFORMED])
def test_malformed_file_raises_kvz_error(path):
    check_rejects(kvcodec.KvzError, path.read_bytes(), limits={"max_output_bytes": 1 << 24})


def test_fuzz_smoke():
    """A few seconds of each fuzz target, so the harness itself stays working."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, str(root / "fuzz" / "fuzz.py"), "--seconds", "8", "--seed", "11"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 findings" in r.stdout
