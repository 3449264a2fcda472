"""Per-vector normalization vs one absolute step per slice (BENCHMARKS.md, "tried and not shipped").

    python scripts/studies/absolute_step.py [TEXT ...]

vq_rans divides every vector by its norm before the rotation (equal *relative* error per vector, plus
fp16 norms as side information).  The alternative: rotate the raw vectors and quantize with one step
per slice (step = factor x the slice's RMS vector norm, keys sqrt(8) finer), no norms stored — equal
*absolute* error, MSE-optimal for the sum of squared errors.  Same rANS index coder; the first token is
kept exact in both; SmolLM2 fp32, 1,024-token prefix, mean KL over 256 teacher-forced tokens.
"""

import math
import sys

import numpy as np
import torch
from allocation import setup  # the same prefix, continuation and KL measure (scripts/studies/allocation.py)

from kvcodec import api
from kvcodec.cache import KVCache, to_canonical
from kvcodec.codecs import float_ctx_rans as floatctx
from kvcodec.codecs import vq_rans as quant
from kvcodec.models import load_model


def absolute(x, step, part):
    b, h, t, d = x.shape
    st = np.float32(step / (math.sqrt(8) if part == 0 else 1))
    y = quant.fwht(x.reshape(-1, d).astype(np.float32) * quant.signs(7, d)[None, :])
    q = np.rint(y / st).astype(np.int64)
    lo = int(q.min())
    k = max(2, math.ceil(math.log2(int(q.max()) - lo + 1)))
    syms = (q - lo).astype(np.uint16).reshape(b, h, t, d)
    rows = np.ascontiguousarray(syms.transpose(0, 1, 3, 2)).reshape(b * h * d, t)
    nbytes = len(floatctx.encode_symbols(rows, k, floatctx.DEFAULTS))
    rec = quant.fwht(q.astype(np.float32) * st) * quant.signs(7, d)[None, :] * np.float32(1 / d)
    return rec.reshape(x.shape), nbytes


def main(texts):
    torch.set_num_threads(2)
    model, tok = load_model("smollm2", dtype=torch.float32)
    for name in texts or ["legal_en_gpl-3.0.txt", "code_python_textwrap.py"]:
        _, kv, comps, kl = setup(name, model, tok)
        for bits in (2.0, 2.5):
            data = api.encode(KVCache(kv.keys, kv.values), tier="lossy", bits=bits)
            payload = sum(s["bytes"] for s in api.inspect(data)["sections"] if s["type"] == "kv")
            dec = to_canonical(api.decode(data))
            print(f"{name} normalized (vq_rans) bits={bits}: {8 * payload / comps:.3f} bits/comp, "
                  f"KL {kl(dec.keys, dec.values):.4f}", flush=True)
        for factor in (1.3, 1.6, 2.0):
            ks, vs, nbytes = [], [], 0
            for li in range(kv.num_layers):
                for part, t, dst in ((0, kv.keys[li], ks), (1, kv.values[li], vs)):
                    x = t.float().numpy()
                    rms = float(np.sqrt((x[:, :, 1:] ** 2).sum(-1).mean()))
                    rec, n = absolute(x[:, :, 1:], factor * rms, part)
                    out = t.float().clone()
                    out[:, :, 1:] = torch.from_numpy(rec)
                    dst.append(out)
                    nbytes += n
            print(f"{name} absolute step {factor} x RMS norm: {8 * nbytes / comps + 16 / 1024:.3f} bits/comp, "
                  f"KL {kl(ks, vs):.4f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
