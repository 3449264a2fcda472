"""Every golden vector decodes with the independent implementation in tests/independent (written from spec/
alone): container, lossless, lossy, static token streams, residuals applied to the recorded regenerations,
(1.3) layer state tensors from state sections or the recorded regenerations, (1.6) predicted slices with the
predictors file beside the vector."""

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
                 [np.ascontiguousarray(st[f"values.{i}"]).view(f"<u{w}") for i in range(n)],
                 # (1.3) state tensors, state.<layer>.<index> in state order (Appendix A)
                 [None if x["state"] is None else
                  [np.ascontiguousarray(st[f"state.{i}.{j}"]).view(f"<u{t['W']}")
                   for j, t in enumerate(x["state"]["tensors"])]
                  for i, x in enumerate(info0["layers"])])
    # (1.6) predicted slices: the predictors file named by the header lies beside the vector (Appendix A)
    pp = VECTORS / f"{case}.predictors.safetensors"
    predictors = pp.read_bytes() if pp.exists() else None
    info, tokens, ks, vs, _notes = K.decode_file(buf, regen, predictors=predictors)
    if meta.get("tokens") is not None and tokens is not None and all(t is not None for t in tokens):
        assert tokens == meta["tokens"]
    w = info["W"]
    assert [hashlib.sha256(x.astype(f"<u{w}").tobytes()).hexdigest() for x in ks] == meta["keys_sha256"]
    assert [hashlib.sha256(x.astype(f"<u{w}").tobytes()).hexdigest() for x in vs] == meta["values_sha256"]
    if "states_sha256" in meta:
        states = info["states"]
        assert states is not None
        got = [None if x is None else
               [hashlib.sha256(np.ascontiguousarray(a).astype(f"<u{a.dtype.itemsize}").tobytes()).hexdigest()
                for a in x]
               for x in states]
        assert got == meta["states_sha256"]
    else:
        assert info["states"] is None or all(x is None for x in info["states"])
