"""Study (issue 15, direction 2): predict each layer's keys and values before quantizing them (AQUA-KV).

AQUA-KV (Shutova et al. 2025, arXiv 2501.19392; reference code ``goodevening13/aquakv``,
``train_predictors.py``) fits, per layer l ≥ 1, two linear regressors with intercept (ridge, damping 1e-3 of
the mean diagonal of XᵀX) on a calibration set, layer after layer, each on the *reconstructed* inputs the
decoder will have:

- keys: the previous layer's reconstructed pre-RoPE keys (all KV heads concatenated) → this layer's pre-RoPE
  keys;
- values: this layer's reconstructed pre-RoPE keys and the previous layer's reconstructed values → this
  layer's values;

and quantizes the residual (target − prediction); the decoder adds the prediction back.  The paper quantizes
the residual with HIGGS (Hadamard rotation + a vector grid); here every arm uses this project's own quantizer
so that only the prediction differs: the tier's Hadamard rotation with per-vector norms (``rotated``,
``vq_rans`` Method 1) or, for keys, the ``weighted`` quantizer's per-channel steps (Method 5: ``w_d · k``
quantized with one step, no norms; RoPE-pair weights commute with the position rotation, so they apply to
pre-RoPE residuals unchanged).  The index coder is the tier's (``index_payload``: real bytes); the first
token is stored exactly, as the tier does.  Layer 0 (no previous layer): keys predicted by the intercept
alone, values from the layer's own keys — an extension of the paper's scheme, which leaves layer 0 alone.

Arms (each over a grid of steps; KL interpolated at 2 and 3 bits on each arm's front):

- ``rotated``: no prediction, post-RoPE keys (what the tier's ``uniform`` quantizer does);
- ``weighted``: no prediction, keys per-channel weighted (what the tier's ``weighted`` quantizer does);
- ``mean (pre-RoPE), weighted``: the intercept alone (a calibrated pre-RoPE mean, rotated to each position);
- ``aqua, rotated`` and ``aqua, weighted``: the full predictors;
- ``equivariant (per file), rotated / weighted``: no calibration — each layer's post-RoPE keys predicted from
  the previous layer's reconstructed post-RoPE keys by a complex ``H × H`` map per rotary pair, fitted on the
  file itself (least squares) and counted as float16 side information: a map that commutes with every
  position's rotation, so a decoder would need no RoPE tables; values unpredicted.

``--calibrate-at KS VS`` fits the predictors once at one step pair and uses them at every rate (one profile
per model); ``--calibration-texts N`` uses fewer calibration texts; ``--open-loop`` fits on exact inputs.

Rates count indices, norms and the exact first token; the predictors are a per-model table (reported apart,
f16 bytes: SmolLM2 6.5 MB, more than a 1,024-token cache at 2 bits — they could only be a per-namespace
profile, never per file).  Calibration: the corpus files that are not evaluated (2,048 tokens each by
default), fitted again for every step pair (unless ``--calibrate-at``), closed-loop as in the paper.

    python -m kvcodec.lab.study_predict --corpus ../shared/corpus --out bench_out
"""

from __future__ import annotations

import time

import numpy as np
import torch

from . import study_weighted as sw
from .study_weighted import exact_bytes, kl, logp, row_table, study_parser

DAMP = 1e-3
SEED = 0x6B767A


def rope_tables(model, n: int):
    """(cos, sin) ``[n, D]`` float64 of the model's rotary embedding at positions 0 … n−1."""
    x = torch.zeros(1, n, 1, dtype=torch.float32)
    cos, sin = model.model.rotary_emb(x, torch.arange(n)[None])
    return cos[0].double(), sin[0].double()


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], -1)


def rope(x, cos, sin, inverse: bool = False):
    """Rotate ``x [..., T, D]`` (rotate-half layout) by each position's angle (or back, ``inverse``)."""
    s = -sin if inverse else sin
    return x * cos + _rotate_half(x) * s


def _flat(x):
    """[H, T, D] → [T, H·D]."""
    return x.permute(1, 0, 2).reshape(x.shape[1], -1)


def _unflat(x, h):
    """[T, H·D] → [H, T, D]."""
    return x.reshape(x.shape[0], h, -1).permute(1, 0, 2)


def fit(x, y, damp: float = DAMP):
    """Ridge regression with intercept: ``W [in + 1, out]`` (rows of x: samples; x may have 0 columns)."""
    x1 = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1)
    g = x1.T @ x1
    g += damp * g.diagonal().mean() * torch.eye(len(g), dtype=g.dtype)
    return torch.linalg.solve(g, x1.T @ y)


def apply(w, x):
    return torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1) @ w


def _identity(x, step, weights=None, *, count=False):
    return 0, x


def quantize(x, step: float, weights=None, *, count: bool = False):
    """(bytes or 0, reconstruction) of ``x [H, T, D]`` float64: the tier's rotated path with per-vector norms
    (``weights`` None) or ``weights [H, D]`` · x quantized with one step, no norms."""
    from ..codecs import float_ctx_rans as floatctx
    from ..codecs.vq_rans import directions, fwht, index_payload, signs

    h, t, d = x.shape
    nbytes = 0
    if weights is None:
        norms16, z = directions(x.reshape(-1, d).float().numpy(), SEED)
        q = np.rint(z / step).astype(np.int64)
        if count:
            nbytes = len(index_payload(q.reshape(1, h, t, d))[0]) + 4
            nbytes += len(floatctx.encode(norms16.view(np.uint16).reshape(1, h, t, 1), "float16", {}))
        y = fwht((q * step).astype(np.float32)) * signs(SEED, d)[None, :] / np.float32(d)
        rec = torch.from_numpy(y * norms16.astype(np.float32)[:, None]).double().reshape(h, t, d)
    else:
        w = torch.as_tensor(weights, dtype=torch.float64)[:, None, :]
        q = np.rint((x * w).numpy() / step).astype(np.int64)
        if count:
            nbytes = len(index_payload(q.reshape(1, h, t, d))[0]) + 4
        rec = torch.from_numpy(q * step) / w
    return nbytes, rec


_quantize = quantize


class Arm:
    """One coding scheme: prediction (none / intercept / full) and the key quantizer (rotated / weighted)."""

    def __init__(self, name: str, predict: str, key_weights):
        self.name, self.predict, self.key_weights = name, predict, key_weights

    def _equivariant(self, k, prev_k, sk, kw, count):
        """Keys of one layer predicted from the previous layer's reconstructed keys by a per-file complex
        map per rotary pair (the coefficients counted as float16 side information); layer 0 unpredicted."""
        if prev_k is None:
            return quantize(k, sk, kw, count=count)
        c = fit_equivariant(prev_k, k)
        pk = predict_equivariant(c, prev_k)
        nb, res = quantize(k - pk, sk, kw, count=count)
        side = 2 * 2 * c.numel() if count else 0
        return nb + side, res + pk

    def run(self, keys, values, cos, sin, sk, sv, predictors=None, count=False, open_loop=False):
        """Code one cache (per layer ``[H, T, D]`` float64, post-RoPE keys; token 0 excluded by the caller).
        With ``predictors`` None they are fitted on the way (calibration, closed loop: on the reconstructions)
        and returned; ``open_loop``: fitted on the exact inputs instead (nothing quantized)."""
        quantize = _identity if open_loop else _quantize
        fitting = predictors is None
        predictors = [] if fitting else predictors
        nbytes, rk, rv = 0, [], []
        prev_k = prev_v = None
        for li, (k, v) in enumerate(zip(keys, values)):
            h = k.shape[0]
            kw = None if self.key_weights is None else self.key_weights[li]
            if self.predict == "equivariant":
                nb, kq = self._equivariant(k, prev_k, sk, kw, count)
                nb2, vq = quantize(v, sv, None, count=count)
                nbytes += nb + nb2
                prev_k = kq
                rk.append(kq)
                rv.append(vq)
                continue
            if self.predict == "none":
                nb, kq = quantize(k, sk, kw, count=count)
                nb2, vq = quantize(v, sv, None, count=count)
                nbytes += nb + nb2
                rk.append(kq)
                rv.append(vq)
                continue
            kp = _flat(rope(k, cos, sin, inverse=True))
            xk = kp[:, :0] if li == 0 or self.predict == "mean" else _flat(prev_k)
            if fitting:
                wk = fit(xk, kp)
            else:
                wk = predictors[li][0]
            pk = apply(wk, xk)
            nb, res = quantize(_unflat(kp - pk, h), sk, kw, count=count)
            kq_pre = _flat(res) + pk
            xv = kq_pre[:, :0] if self.predict == "mean" else (
                kq_pre if li == 0 else torch.cat([kq_pre, _flat(prev_v)], 1))
            vf = _flat(v)
            wv = fit(xv, vf) if fitting else predictors[li][1]
            pv = apply(wv, xv)
            nb2, res_v = quantize(_unflat(vf - pv, h), sv, None, count=count)
            vq = _unflat(_flat(res_v) + pv, h)
            if fitting:
                predictors.append((wk, wv))
            nbytes += nb + nb2
            prev_k, prev_v = _unflat(kq_pre, h), vq
            rk.append(rope(prev_k, cos, sin))
            rv.append(vq)
        return nbytes, rk, rv, predictors


def pairs(x):
    """[H, T, D] real (rotate-half layout) → [D/2, T, H] complex: channel i and i + D/2 as one number."""
    d = x.shape[-1] // 2
    return torch.complex(x[..., :d], x[..., d:]).permute(2, 1, 0)


def unpairs(z):
    """Inverse of :func:`pairs`."""
    z = z.permute(2, 1, 0)
    return torch.cat([z.real, z.imag], -1)


def fit_equivariant(ref, target, damp: float = 1e-6):
    """Per rotary pair i, the complex matrix ``C_i [H_in, H_out]`` minimising Σ_t |y_t − x_t C_i|² (x: the
    reference layer's pairs, y: the target's): a linear map that commutes with every RoPE rotation, so it
    predicts post-RoPE keys from post-RoPE keys without knowing the positions.  Rounded to float16 parts
    (what a file would store)."""
    x, y = pairs(ref), pairs(target)
    g = x.conj().transpose(1, 2) @ x
    g = g + damp * g.diagonal(dim1=1, dim2=2).real.mean(-1)[:, None, None] * torch.eye(g.shape[-1])
    c = torch.linalg.solve(g, x.conj().transpose(1, 2) @ y)
    return torch.complex(c.real.half().double(), c.imag.half().double())


def predict_equivariant(c, ref):
    return unpairs(pairs(ref) @ c)


def relative_mse(arm_predictors, keys, values, cos, sin):
    """Per layer (keys, values): ‖target − prediction‖² / ‖target‖² with exact inputs (no quantization)."""
    out = []
    prev_k = prev_v = None
    for li, (k, v) in enumerate(zip(keys, values)):
        wk, wv = arm_predictors[li]
        kp = _flat(rope(k, cos, sin, inverse=True))
        xk = kp[:, :0] if li == 0 else prev_k
        ek = float(((kp - apply(wk, xk)) ** 2).sum() / (kp ** 2).sum())
        xv = kp if li == 0 else torch.cat([kp, prev_v], 1)
        vf = _flat(v)
        ev = float(((vf - apply(wv, xv)) ** 2).sum() / (vf ** 2).sum())
        out.append((ek, ev))
        prev_k, prev_v = kp, vf
    return out


def main(argv=None) -> int:
    from ..cache import KVCache, to_canonical
    from ..calibrate import calibrate
    from ..models import load_model, prefill, tokenize
    from .common import corpus_files, write_report

    p = study_parser(__doc__)
    p.add_argument("--calibration-tokens", type=int, default=2048, help="per calibration text")
    p.add_argument("--calibration-texts", type=int, default=0, help="use only the first N (0: all not evaluated)")
    p.add_argument("--arms", nargs="*", default=None)
    p.add_argument("--calibrate-at", type=float, nargs=2, metavar=("KEY_STEP", "VALUE_STEP"),
                   help="fit the predictors once, at these steps, and use them at every step of the grid")
    p.add_argument("--open-loop", action="store_true", help="fit the predictors on exact inputs")
    args = p.parse_args(argv)
    t0 = time.time()
    torch.manual_seed(0)
    model, tok = load_model("smollm2", dtype=torch.float32)
    files = {f.name: f for f in corpus_files(args.corpus)}
    cal_names = sorted(n for n in files if n not in args.texts)
    if args.calibration_texts:
        cal_names = cal_names[: args.calibration_texts]

    def cache_of(name, n):
        ids = tokenize(tok, files[name].read_text(encoding="utf-8"), n)
        exact = prefill(model, ids[:, :n])
        kv = to_canonical(exact)
        return ids, exact, [k[0].double() for k in kv.keys], [v[0].double() for v in kv.values]

    # calibration set: every text's tokens 1 … n−1, concatenated along T (positions kept per text)
    ck, cv, ccos, csin = None, None, [], []
    for name in cal_names:
        ids, _, ks, vs = cache_of(name, args.calibration_tokens)
        n = ids.shape[1]
        cos, sin = rope_tables(model, n)
        ccos.append(cos[1:])
        csin.append(sin[1:])
        ks, vs = [k[:, 1:] for k in ks], [v[:, 1:] for v in vs]
        ck = ks if ck is None else [torch.cat([a, b], 1) for a, b in zip(ck, ks)]
        cv = vs if cv is None else [torch.cat([a, b], 1) for a, b in zip(cv, vs)]
    ccos, csin = torch.cat(ccos), torch.cat(csin)
    cal_tokens = ck[0].shape[1]
    print(f"calibration: {len(cal_names)} texts, {cal_tokens} tokens ({time.time() - t0:.0f} s)", flush=True)

    # check the de-rotation against the model's own pre-RoPE keys (layer 0's k_proj)
    ids0, _, ks0, _ = cache_of(cal_names[0], 64)
    with torch.no_grad():
        emb = model.model.embed_tokens(ids0)
        hcur = model.model.layers[0].input_layernorm(emb)
        kpre = model.model.layers[0].self_attn.k_proj(hcur)[0].double()  # [T, H·D]
    c0, s0 = rope_tables(model, ids0.shape[1])
    err = float((_flat(rope(ks0[0], c0, s0, inverse=True)) - kpre).abs().max() / kpre.abs().max())
    print(f"de-rotation check: max relative error {err:.2e}", flush=True)
    assert err < 1e-5, err

    profile = calibrate(model, tokenizer=tok)
    kw = [np.asarray(w, dtype=np.float64) for w in profile.key_weights]
    arms = [Arm("rotated", "none", None), Arm("weighted", "none", kw),
            Arm("mean (pre-RoPE), weighted", "mean", kw), Arm("aqua, rotated", "full", None),
            Arm("aqua, weighted", "full", kw), Arm("equivariant (per file), rotated", "equivariant", None),
            Arm("equivariant (per file), weighted", "equivariant", kw)]
    if args.arms:
        arms = [a for a in arms if a.name in args.arms]
    grids = {"rotated": [(s, s) for s in (0.4, 0.55, 0.75, 1.0, 1.4)],
             "weighted": [(a, b) for a in (0.1, 0.15, 0.2, 0.3) for b in (0.75, 1.0, 1.4, 2.0)]}

    evals = {}
    for name in args.texts:
        ids, _, _, _ = cache_of(name, args.prefix + args.continuation)
        prefix, cont = ids[:, :args.prefix], ids[:, args.prefix:]
        exact = prefill(model, prefix)
        kv = to_canonical(exact)
        cos, sin = rope_tables(model, args.prefix)
        evals[name] = (exact, kv, cont, logp(model, exact, cont), cos[1:], sin[1:],
                       sum(t.numel() for t in kv.keys + kv.values))

    rows, diag = [], {}
    fixed = {}
    for arm in arms:
        grid = grids["rotated" if arm.key_weights is None else "weighted"]
        for sk, sv in grid:
            preds = None
            if arm.predict in ("mean", "full"):
                at = tuple(args.calibrate_at) if args.calibrate_at else (sk, sv)
                if at not in fixed.get(arm.name, {}):
                    fixed.setdefault(arm.name, {})[at] = arm.run(ck, cv, ccos, csin, *at,
                                                                 open_loop=args.open_loop)[3]
                preds = fixed[arm.name][at]
                if arm.predict == "full" and arm.name not in diag:
                    diag[arm.name] = {n: relative_mse(preds, [k[0].double()[:, 1:] for k in e[1].keys],
                                                      [v[0].double()[:, 1:] for v in e[1].values], e[4], e[5])
                                      for n, e in evals.items()}
            for name, (exact, kv, cont, lp, cos, sin, comps) in evals.items():
                keys = [k[0].double()[:, 1:] for k in kv.keys]
                values = [v[0].double()[:, 1:] for v in kv.values]
                nb, rk, rv, _ = arm.run(keys, values, cos, sin, sk, sv, predictors=preds, count=True)
                nbytes = nb + sum(exact_bytes(t.float()[:, :, :1]) for t in kv.keys + kv.values)
                dec = KVCache([torch.cat([k.float()[:, :, :1], r[None].to(k.dtype)], 2) for k, r in zip(kv.keys, rk)],
                              [torch.cat([v.float()[:, :, :1], r[None].to(v.dtype)], 2)
                               for v, r in zip(kv.values, rv)])
                r = {"text": name, "arm": arm.name, "config": {"key_step": sk, "value_step": sv},
                     "bits_per_component": 8 * nbytes / comps,
                     "mean_kl_bits": kl(lp, logp(model, dec.to_dynamic_cache(), cont))}
                rows.append(r)
                print(f"{name} {arm.name} {sk}/{sv}: {r['bits_per_component']:.3f} bits, KL {r['mean_kl_bits']:.4f} "
                      f"({time.time() - t0:.0f} s)", flush=True)

    cfg = model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    width = cfg.num_key_value_heads * d
    per_layer = (width + 1) * width + (2 * width + 1) * width  # keys from keys, values from keys + values
    pred_params = (cfg.num_hidden_layers - 1) * per_layer + width + (width + 1) * width  # layer 0
    res = {"command": "python -m kvcodec.lab.study_predict " + " ".join(argv or []),
           "model": "SmolLM2-135M-Instruct (float32)", "prefix": args.prefix, "continuation": args.continuation,
           "calibration_texts": cal_names, "calibration_tokens": cal_tokens, "damp": DAMP,
           "calibrate_at": args.calibrate_at, "open_loop": args.open_loop,
           "predictor_bytes_f16": 2 * pred_params, "rows": rows, "at_bits": at_bits(rows),
           "relative_mse": diag, "seconds": round(time.time() - t0, 1)}
    write_report(args.out, "study_predict", res, to_markdown(res))
    return 0


TARGETS = (2.0, 2.5, 3.0)


def at_bits(rows, targets=TARGETS):
    """:func:`study_weighted.at_bits` per text and arm, then per arm the median over the texts."""
    out = sw.at_bits(rows, targets)
    for a in dict.fromkeys(r["arm"] for r in out):
        vals = [r for r in out if r["arm"] == a]
        med = {}
        for b in targets:
            xs = [r[f"kl_at_{b:g}"] for r in vals]
            med[f"kl_at_{b:g}"] = None if any(x is None for x in xs) else float(np.median(xs))
        out.append({"text": "median", "arm": a, **med})
    return out


def to_markdown(res) -> str:
    lines = [f"{res['model']}, prefix {res['prefix']}, continuation {res['continuation']} teacher-forced; "
             f"predictors calibrated on {res['calibration_tokens']} tokens of {len(res['calibration_texts'])} "
             f"other texts ({', '.join(res['calibration_texts'])}); predictors {res['predictor_bytes_f16'] / 1e6:.2f}"
             " MB f16 per model, not counted in the rates; fitted "
             + ("on exact inputs" if res.get("open_loop") else "closed loop (on reconstructed inputs)")
             + (f" once, at key/value steps {res['calibrate_at']}" if res.get("calibrate_at") else " at each step pair")
             + ". KL interpolated on each arm's front over its step grid "
             "('—' outside the measured range).", "", *sw.kl_table(res["at_bits"], TARGETS)]
    for arm, per_text in res["relative_mse"].items():
        lines += ["", f"Relative MSE of the `{arm}` predictors with exact inputs (‖target − prediction‖² / "
                      "‖target‖², pre-RoPE keys), per layer, median over the texts:", "",
                  "| layer | keys | values |", "|---:|---:|---:|"]
        per = list(per_text.values())
        for li in range(len(per[0])):
            lines.append(f"| {li} | {np.median([p[li][0] for p in per]):.3f} | "
                         f"{np.median([p[li][1] for p in per]):.3f} |")
    return "\n".join(lines + row_table(res["rows"])) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
