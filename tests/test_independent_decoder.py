"""Every golden vector decodes with the independent implementation in tests/independent (written from spec/
alone): container, lossless, lossy, static token streams, residuals applied to the recorded regenerations."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from .independent import decoder as K

VECTORS = Path(__file__).resolve().parent.parent / "spec" / "vectors"
CASES = sorted(p.stem for p in VECTORS.glob("*.kvz"))


@pytest.mark.parametrize("case", CASES)
def test_independent_decoder_reads_the_vector(case):
    meta = json.loads((VECTORS / f"{case}.json").read_text())
    buf = (VECTORS / f"{case}.kvz").read_bytes()
    regen = None
    rp = VECTORS / f"{case}.regen.safetensors"
    if rp.exists():
        info0, _ = K.parse_container(buf)
        st, w = load_file(str(rp)), info0["W"]
        n = len(info0["layers"])
        regen = ([np.ascontiguousarray(st[f"keys.{i}"]).view(f"<u{w}") for i in range(n)],
                 [np.ascontiguousarray(st[f"values.{i}"]).view(f"<u{w}") for i in range(n)])
    info, tokens, ks, vs, _notes = K.decode_file(buf, regen)
    if meta.get("tokens") is not None and tokens is not None and all(t is not None for t in tokens):
        assert tokens == meta["tokens"]
    w = info["W"]
    assert [hashlib.sha256(x.astype(f"<u{w}").tobytes()).hexdigest() for x in ks] == meta["keys_sha256"]
    assert [hashlib.sha256(x.astype(f"<u{w}").tobytes()).hexdigest() for x in vs] == meta["values_sha256"]
