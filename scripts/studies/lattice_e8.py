"""The E8 lattice against the entropy-coded scalar quantizer at equal bits (issue 15, direction 3).

    python scripts/studies/lattice_e8.py [TEXT ...]      # ~10 min on 2 cores; default: GPL, textwrap

Both arms work in the domain of the lossy tier's Method 1: each key / value vector divided by its norm (fp16
norms stored, 16 bits per vector), randomized Hadamard rotation (the tier's own signs and butterfly), then
quantized with step ``s`` (keys ``s / sqrt(8)``, values ``s``: one ratio for both arms):

* scalar: ``q = round(y / s)`` per coordinate (Method 1);
* E8: each run of 8 coordinates to the nearest point of ``s * E8`` (Conway & Sloane's algorithm: the nearer of
  the nearest points of D8 and D8 + 1/2).  A point is ``c = m + h / 2`` with integers ``m`` and the coset bit
  ``h``; ``sum(m)`` is always even, so the eighth ``m`` is stored halved (its parity follows from the others).

Rates are **real bytes**: both arms' integers go through the tier's own context-modelled rANS index coder
(``float_ctx_rans.encode_symbols``: rows = coordinates, one row per coordinate of a head, tokens along a row),
E8's coset bits through the same coder as a separate stream of 0/1 symbols; plus the fp16 norms.  The first
token stays exact in both arms (as in the tier).  Distortion: mean KL (bits/token) of the next-token
distributions over 256 teacher-forced tokens after a 1,024-token SmolLM2 fp32 cache (scripts/studies/
allocation.py's measure); KL at equal rate by interpolating each arm's curve in log KL.  E8's normalized
second moment is 0.0717 against 1/12 = 0.0833 for the integers (0.65 dB, ~0.11 bit per dimension at high
rate, Conway & Sloane); this measures what is left of it at 2-3 bits, under this model and coder.
"""

import math
import sys

import numpy as np
import torch
from allocation import setup  # the same prefix, continuation and KL measure (scripts/studies/allocation.py)

from kvcodec.codecs import float_ctx_rans as floatctx
from kvcodec.codecs import vq_rans as quant
from kvcodec.models import load_model

SEED = 7


def _nearest_d8(x):
    f = np.rint(x)
    odd = (f.sum(axis=1) % 2) != 0
    if odd.any():
        r = np.nonzero(odd)[0]
        err = x[r] - f[r]
        j = np.abs(err).argmax(axis=1)
        f[r, j] += np.where(err[np.arange(r.size), j] > 0, 1.0, -1.0)
    return f


def nearest_e8(x):
    """Nearest point of E8 = D8 u (D8 + 1/2) to each row of ``x [N, 8]``: (points, coset bit)."""
    a = _nearest_d8(x)
    b = _nearest_d8(x - 0.5) + 0.5
    use_b = ((x - b) ** 2).sum(axis=1) < ((x - a) ** 2).sum(axis=1)
    return np.where(use_b[:, None], b, a), use_b


def _code_bytes(ints, b, h, t, d):
    """Bytes of integer indices ``[b * h * t, d]`` through the tier's index coder (rows = coordinates)."""
    q = ints.astype(np.int64).reshape(b, h, t, d)
    lo = int(q.min())
    k = max(2, math.ceil(math.log2(int(q.max()) - lo + 1)))
    rows = np.ascontiguousarray((q - lo).astype(np.uint16).transpose(0, 1, 3, 2)).reshape(b * h * d, t)
    return len(floatctx.encode_symbols(rows, k, floatctx.DEFAULTS))


def quantize(x, step, arm):
    """(reconstruction, bytes) of ``x [b, h, t, d]`` float32 (every token quantized)."""
    b, h, t, d = x.shape
    norms16, y = quant.directions(x.reshape(-1, d), SEED)
    z = y / np.float32(step)
    if arm == "scalar":
        c = np.rint(z)
        nbytes = _code_bytes(c, b, h, t, d)
    else:
        pts, coset = nearest_e8(z.reshape(-1, 8).astype(np.float64))
        c = pts.reshape(z.shape)
        m = np.floor(pts).astype(np.int64)  # c = m + coset / 2, sum(m) even
        m[:, 7] = np.floor_divide(m[:, 7], 2)  # its parity follows from the other seven
        nbytes = _code_bytes(m.reshape(z.shape), b, h, t, d) + _code_bytes(coset.astype(np.int64).reshape(-1, d // 8),
                                                                           b, h, t, d // 8)
    rec = quant.fwht(c.astype(np.float32) * np.float32(step)) * quant.signs(SEED, d)[None, :] * np.float32(1 / d)
    rec = rec * norms16.astype(np.float32)[:, None]
    return rec.reshape(x.shape), nbytes + 2 * norms16.size


def main(texts):
    torch.set_num_threads(2)
    model, tok = load_model("smollm2", dtype=torch.float32)
    summary = []
    for name in texts or ["legal_en_gpl-3.0.txt", "code_python_textwrap.py"]:
        _, kv, comps, kl = setup(name, model, tok)
        curves = {}
        for arm in ("scalar", "e8"):
            for s in (0.5, 0.7, 1.0, 1.4, 2.0):
                ks, vs, nbytes = [], [], 0
                for li in range(kv.num_layers):
                    for part, t, dst in ((0, kv.keys[li], ks), (1, kv.values[li], vs)):
                        x = t.float().numpy()
                        rec, n = quantize(x[:, :, 1:], s / (math.sqrt(8) if part == 0 else 1), arm)
                        out = t.float().clone()
                        out[:, :, 1:] = torch.from_numpy(rec)
                        dst.append(out)
                        nbytes += n
                bits, d = 8 * nbytes / comps, kl(ks, vs)
                curves.setdefault(arm, []).append((bits, d))
                print(f"{name} {arm} step {s}: {bits:.3f} bits/comp, KL {d:.4f}", flush=True)
        for rate in (2.0, 2.5, 3.0):
            at = {}
            for arm, pts in curves.items():
                r, k = zip(*sorted(pts))
                at[arm] = float(np.exp(np.interp(rate, r, np.log(k)))) if r[0] <= rate <= r[-1] else None
            summary.append((name, rate, at))
    print("\ntext | bits/comp | scalar KL | E8 KL | E8 / scalar")
    for name, rate, at in summary:
        s, e = at["scalar"], at["e8"]
        ratio = f"{e / s:.2f}" if s and e else "-"
        print(f"{name} | {rate} | {s if s is None else round(s, 4)} | {e if e is None else round(e, 4)} | {ratio}")


if __name__ == "__main__":
    main(sys.argv[1:])
