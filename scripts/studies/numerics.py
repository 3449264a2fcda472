"""Which CPU numerics knobs change a model's regeneration, and how often they change the LM coder's integer
frequencies.

kvcodec's token tiers code ids with the model's own next-token distribution (``kvcodec/tokens/lm.py``):
float64 softmax of the float32 logits, quantized by constriction's ``Categorical(perfect=False)`` at 24-bit
precision.  The decoder regenerates the same distributions by running the model, so it only decodes if its
*integer* CDF for the coded token equals the encoder's.  This study runs the model under one knob at a time
(each configuration in a fresh subprocess, because env vars such as ``ATEN_CPU_CAPABILITY`` or ``MKL_CBWR``
are read when torch / MKL / oneDNN initialise) and compares against the default configuration:

* logits (prefill and token-by-token with a DynamicCache, the ``lm`` coder's schedule), bit for bit;
* the KV cache of every layer, bit for bit;
* the float64 softmax, bit for bit (computed in the subprocess: a decoder computes it on its own machine);
* constriction's integer CDF (reimplemented below from constriction 0.5's
  ``LazyContiguousCategoricalEntropyModel::from_floating_point_probabilities_fast``, checked against
  constriction itself): positions whose whole table differs, and whose coded token's (cumulative, frequency)
  interval differs;
* operationally: the true next tokens range-coded with the baseline's distributions, decoded with this
  configuration's (and vice versa);
* single operations at the model's shapes (Linear, lm_head, RMSNorm, softmax, SDPA, ...), bit for bit.

Run:  .venv/bin/python scripts/studies/numerics.py --out /tmp/numerics/results.md
(``--configs a,b`` picks configurations, ``--list`` names them; ``--models tiny`` skips SmolLM2.)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "spec" / "vectors" / "models" / "tiny-llama"
CORPUS = Path("/work/shared/corpus/prose_en_austen_pride_and_prejudice.txt")
PRECISION = 24

# name -> knobs.  env: set before torch is imported; threads: torch.set_num_threads; mkldnn: the
# torch.backends.mkldnn.enabled flag; attn: attn_implementation (None = transformers' default); dtype.
CONFIGS = {
    "baseline": {},
    "baseline-rerun": {},
    "cap=default": {"env": {"ATEN_CPU_CAPABILITY": "default"}},
    "cap=avx2": {"env": {"ATEN_CPU_CAPABILITY": "avx2"}},
    "cap=avx512": {"env": {"ATEN_CPU_CAPABILITY": "avx512"}},
    "threads=1": {"threads": 1},
    "ONEDNN_MAX_CPU_ISA=AVX2": {"env": {"ONEDNN_MAX_CPU_ISA": "AVX2"}},
    "MKL_CBWR=COMPATIBLE": {"env": {"MKL_CBWR": "COMPATIBLE"}},
    "MKL_CBWR=AVX2": {"env": {"MKL_CBWR": "AVX2"}},
    "MKL_ENABLE_INSTRUCTIONS=AVX2": {"env": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}},
    "mkldnn off": {"mkldnn": False},
    "attn=eager": {"attn": "eager"},
    "attn=sdpa": {"attn": "sdpa"},
    "dtype=bfloat16": {"dtype": "bfloat16"},
    "cap=avx2+CBWR=AVX2+ONEDNN=AVX2": {"env": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2",
                                               "ONEDNN_MAX_CPU_ISA": "AVX2"}},
    "cap=avx2+CBWR=AVX2,STRICT+ONEDNN=AVX2, 1 thread": {
        "env": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2,STRICT", "ONEDNN_MAX_CPU_ISA": "AVX2"},
        "threads": 1},
    "cap=default+CBWR=COMPATIBLE+ONEDNN=SSE41": {"env": {"ATEN_CPU_CAPABILITY": "default",
                                                         "MKL_CBWR": "COMPATIBLE",
                                                         "ONEDNN_MAX_CPU_ISA": "SSE41"}},
}
KNOB_ENV = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA",
            "OMP_NUM_THREADS", "MKL_NUM_THREADS", "MKL_VERBOSE", "ONEDNN_VERBOSE", "DNNL_VERBOSE")


# --- constriction's Categorical(perfect=False) quantization ----------------------------------------------
def quantize_cdf(p: np.ndarray) -> np.ndarray:
    """Integer CDF ``[..., V+1]`` (24-bit) that constriction 0.5's ``Categorical(perfect=False)`` uses for the
    float64 probabilities ``p [..., V]``: LazyContiguousCategoricalEntropyModel::from_floating_point_probabilities_fast
    with normalization = sequential sum, scale = (2**24 - V) / normalization,
    C[s] = trunc(cumsum_excl[s] * scale) + s, C[V] = 2**24; frequency(s) = C[s+1] - C[s]."""
    p = np.asarray(p, dtype=np.float64)
    v = p.shape[-1]
    cs = np.cumsum(p, axis=-1)  # sequential left fold, as Rust's iter().sum() and the running sums
    norm = cs[..., -1:]
    scale = float(2 ** PRECISION - v) / norm
    excl = np.concatenate([np.zeros_like(cs[..., :1]), cs[..., :-1]], axis=-1)
    c = np.floor(excl * scale).astype(np.int64) + np.arange(v)
    last = np.full(c.shape[:-1] + (1,), 2 ** PRECISION, dtype=np.int64)
    return np.concatenate([c, last], axis=-1)


def spec_quantize():
    """scripts/spec_rangecoder.py's ``quantize(p)`` if another helper has written it (else None)."""
    path = ROOT / "scripts" / "spec_rangecoder.py"
    if not path.is_file():
        return None
    try:
        spec = importlib.util.spec_from_file_location("spec_rangecoder", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return getattr(mod, "quantize", None)
    except Exception as e:  # noqa: BLE001 - a work in progress of someone else
        print(f"scripts/spec_rangecoder.py does not load: {e}", file=sys.stderr)
        return None


def _as_cdf(q, v: int) -> np.ndarray | None:
    """Interpret whatever spec_rangecoder.quantize returned (frequencies, CDF, or a tuple) as a CDF."""
    if isinstance(q, tuple):
        for x in q:
            r = _as_cdf(x, v)
            if r is not None:
                return r
        return None
    a = np.asarray(q, dtype=np.int64).reshape(-1)
    if a.size == v + 1 and a[0] == 0 and a[-1] == 2 ** PRECISION:
        return a
    if a.size == v and a.sum() == 2 ** PRECISION:
        return np.concatenate([[0], np.cumsum(a)])
    return None


def constriction_family():
    import constriction

    return constriction.stream, constriction.stream.model.Categorical(perfect=False)


def encode_words(probs: np.ndarray, targets: np.ndarray) -> np.ndarray:
    cs, fam = constriction_family()
    enc = cs.queue.RangeEncoder()
    for p, t in zip(probs, targets):
        enc.encode(np.array([t], dtype=np.int32), fam, p[None, :])
    return enc.get_compressed().astype(np.uint32)


def decode_words(words: np.ndarray, probs: np.ndarray) -> np.ndarray:
    cs, fam = constriction_family()
    dec = cs.queue.RangeDecoder(np.ascontiguousarray(words, dtype=np.uint32))
    out = np.empty(len(probs), dtype=np.int64)
    for i, p in enumerate(probs):
        try:
            out[i] = int(dec.decode(fam, p[None, :])[0])
        except Exception:  # noqa: BLE001 - constriction rejects the stream
            out[i:] = -1
            break
    return out


def selftest_quantizer(probs: np.ndarray, rng: np.random.Generator, trials: int = 60) -> dict:
    """Check quantize_cdf against constriction: perturb a distribution by ~1 ulp-scale noise; our port predicts
    whether the coded symbol's interval changes; constriction coding that symbol 16 times under each must give
    identical words exactly when the interval is unchanged."""
    agree = changed = 0
    for k in range(trials):
        p = probs[k % len(probs)]
        scale = 10.0 ** rng.uniform(-12, -5)
        q = p * (1 + scale * rng.standard_normal(p.shape))
        q = np.maximum(q, 0)
        t = int(rng.choice(p.size, p=p / p.sum())) if k % 2 else int(rng.integers(p.size))
        ca, cb = quantize_cdf(p), quantize_cdf(q)
        same = ca[t] == cb[t] and ca[t + 1] == cb[t + 1]
        wa = encode_words(np.repeat(p[None], 16, 0), np.full(16, t))
        wb = encode_words(np.repeat(q[None], 16, 0), np.full(16, t))
        agree += bool(same) == bool(np.array_equal(wa, wb))
        changed += not same
    return {"trials": trials, "agree": agree, "interval_changed": changed}


# --- the worker: one configuration, in a fresh process ------------------------------------------------
def worker(cfg: dict, outdir: Path, models: list[str], n_tiny: int, n_smol: int) -> None:
    import importlib.metadata as md

    import torch
    import transformers

    torch.set_num_threads(cfg.get("threads", 2))
    if "mkldnn" in cfg:
        torch.backends.mkldnn.enabled = cfg["mkldnn"]
    dtype = getattr(torch, cfg.get("dtype", "float32"))
    info = {
        "torch": torch.__version__, "transformers": transformers.__version__,
        "constriction": md.version("constriction"), "numpy": np.__version__,
        "capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
        "mkldnn_enabled": bool(torch.backends.mkldnn.enabled),
        "config_lines": [ln.strip(" -") for ln in torch.__config__.show().splitlines()
                         if re.search(r"Math Kernel|MKL-DNN|oneDNN|CPU capability|OpenMP", ln)],
        "blas": re.search(r"BLAS_INFO=(\w+)", torch.__config__.show()).group(1),
        "env": {k: os.environ[k] for k in KNOB_ENV if k in os.environ},
    }
    torch.manual_seed(0)

    def kwarg(model):
        import inspect

        return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def kv_of(cache):
        out = {}
        for i, lay in enumerate(cache.layers):
            out[f"k{i}"] = lay.keys.float().numpy()
            out[f"v{i}"] = lay.values.float().numpy()
        return out

    def probs_of(logits):  # exactly kvcodec.tokens.lm.next_token_probs
        return torch.softmax(logits.float().double(), dim=-1).numpy()

    @torch.no_grad()
    def run_model(name, model, ids):
        from transformers.cache_utils import DynamicCache

        kw = kwarg(model)
        t0 = time.time()
        out = model(ids, use_cache=True)
        cache = out["cache"] if "cache" in out else out["past_key_values"]
        res = {"prefill_logits": out.logits[0].float().numpy()}
        res.update({f"prefill_{k}": v for k, v in kv_of(cache).items()})
        t1 = time.time()
        cache = DynamicCache()  # the lm coder's lm-incremental-v1: one token per call
        inc = []
        for i in range(ids.shape[1]):
            o = model(ids[:, i:i + 1], use_cache=True, **{kw: cache})
            inc.append(o.logits[0, -1].float())
        inc = torch.stack(inc)
        res["inc_logits"] = inc.numpy()
        res.update({f"inc_{k}": v for k, v in kv_of(cache).items()})
        t2 = time.time()
        for which in ("prefill", "inc"):
            p = probs_of(torch.from_numpy(res[f"{which}_logits"]))
            res[f"{which}_probs"] = p
        ref = cfg.get("ref_dir")
        if ref and (Path(ref) / f"{name}.npz").is_file():  # this config's softmax over the baseline's logits
            with np.load(Path(ref) / f"{name}.npz") as z:
                res["ref_inc_probs"] = probs_of(torch.from_numpy(z["inc_logits"]))
        res["ids"] = ids[0].numpy()
        info[f"{name}_attn"] = getattr(model.config, "_attn_implementation", None)
        info[f"{name}_seconds"] = {"prefill": round(t1 - t0, 2), "incremental": round(t2 - t1, 2)}
        np.savez(outdir / f"{name}.npz", **res)

    from transformers import AutoModelForCausalLM

    attn = {"attn_implementation": cfg["attn"]} if cfg.get("attn") else {}
    smol = None
    if "tiny" in models:
        m = AutoModelForCausalLM.from_pretrained(TINY, dtype=dtype, local_files_only=True, **attn).eval()
        ids = torch.from_numpy(np.random.default_rng(1234).integers(0, m.config.vocab_size, (1, n_tiny)))
        run_model("tiny", m, ids)
    if "smollm2" in models:
        sys.path.insert(0, str(ROOT))
        from transformers import AutoTokenizer

        from kvcodec.models import cache_dir, load_model

        path = cache_dir() / "models" / "smollm2-v1"
        if (path / "kvcodec_conversion.json").is_file():  # load_model, but with attn_implementation
            smol = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True, **attn).eval()
            tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        else:
            smol, tok = load_model("smollm2", dtype=dtype)
        text = CORPUS.read_text(encoding="utf-8")
        ids = tok(text[:4000], return_tensors="pt").input_ids[:, :n_smol]
        run_model("smollm2", smol, ids)
    ops_probe(torch, smol, dtype, outdir, info)
    (outdir / "info.json").write_text(json.dumps(info, indent=1))


def ops_probe(torch, smol, dtype, outdir: Path, info: dict) -> None:
    """Single operations at SmolLM2's shapes, inputs from a fixed numpy generator (torch's own RNG kernels may
    be vectorized differently)."""
    import torch.nn.functional as F

    rng = np.random.default_rng(7)

    def T(*shape, scale=1.0):
        return torch.from_numpy(rng.standard_normal(shape) * scale).to(dtype)

    hid, inter, nh, nkv, hd, vocab = 576, 1536, 9, 3, 64, 49152
    if smol is not None:
        lay = smol.model.layers[0]
        q_proj, gate, down = lay.self_attn.q_proj, lay.mlp.gate_proj, lay.mlp.down_proj
        norm, lm_head, rot = lay.input_layernorm, smol.lm_head, smol.model.rotary_emb
    else:
        q_proj = torch.nn.Linear(hid, hid, bias=False, dtype=dtype)
        gate = torch.nn.Linear(hid, inter, bias=False, dtype=dtype)
        down = torch.nn.Linear(inter, hid, bias=False, dtype=dtype)
        lm_head = torch.nn.Linear(hid, vocab, bias=False, dtype=dtype)
        for m in (q_proj, gate, down, lm_head):
            m.weight.data = T(*m.weight.shape, scale=0.05)
        norm = rot = None
    x1, x128, xi = T(1, 1, hid), T(1, 128, hid), T(1, 128, inter)
    q, k, v = T(1, nh, 128, hd), T(1, nkv, 128, hd), T(1, nkv, 128, hd)
    kr, vr = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    logits = T(128, vocab, scale=4.0)
    res = {}
    with torch.no_grad():
        res["linear q_proj 1 tok"] = q_proj(x1)
        res["linear q_proj 128 tok"] = q_proj(x128)
        res["linear gate 1 tok"] = gate(x1)
        res["linear gate 128 tok"] = gate(x128)
        res["linear down 128 tok"] = down(xi)
        res["lm_head 1 tok"] = lm_head(x1)
        res["lm_head 128 tok"] = lm_head(x128)
        res["torch.matmul 128x576 @ 576x1536"] = x128[0] @ gate.weight.T
        res["F.linear bias-free, 2-D input 1x576"] = F.linear(x1[0], q_proj.weight)
        if norm is not None:
            res["RMSNorm module 128 tok"] = norm(x128)
        res["pow(2).mean(-1)"] = x128.float().pow(2).mean(-1)
        res["rsqrt"] = torch.rsqrt(x128.float().abs() + 1e-5)
        res["silu"] = F.silu(xi)
        res["exp"] = torch.exp(xi.float())
        res["sum(-1)"] = xi.float().sum(-1)
        if rot is not None:
            pos = torch.arange(128)[None]
            cos, sin = rot(x128, pos)
            res["rotary cos"], res["rotary sin"] = cos, sin
        res["cos/sin of angles"] = torch.cat([torch.cos(T(128, 32) * 30), torch.sin(T(128, 32) * 30)])
        res["softmax f32 over vocab"] = torch.softmax(logits.float(), -1)
        res["softmax f64 over vocab (lm.next_token_probs)"] = torch.softmax(logits.float().double(), -1)
        res["sdpa causal 128 q"] = F.scaled_dot_product_attention(q, kr, vr, is_causal=True)
        res["sdpa 1 q x 128 k"] = F.scaled_dot_product_attention(q[:, :, -1:], kr, vr)
        res["sdpa enable_gqa 1 q"] = F.scaled_dot_product_attention(q[:, :, -1:], k, v, enable_gqa=True)
        w = torch.matmul(q, kr.transpose(2, 3)) * hd ** -0.5
        w = w + torch.triu(torch.full((128, 128), float("-inf")), 1)
        res["eager attention 128 q"] = torch.matmul(torch.softmax(w.float(), -1).to(dtype), vr)
        res["bmm q@k^T 1 q"] = torch.matmul(q[:, :, -1:], kr.transpose(2, 3))
    np.savez(outdir / "ops.npz", **{k: (v if v.dtype == torch.float64 else v.float()).numpy() for k, v in res.items()})
    # which library / kernel a Linear runs: MKL and oneDNN verbose around one call each (printed by the C code)
    sys.stdout.flush()
    with torch.no_grad():
        with torch.backends.mkl.verbose(torch.backends.mkl.VERBOSE_ON):
            gate(x1)
            gate(x128)
        with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
            gate(x1)
            gate(x128)


def run_config(name: str, cfg: dict, workdir: Path, models: list[str], n_tiny: int, n_smol: int,
               ref_dir: Path | None = None) -> tuple[Path, str]:
    out = workdir / re.sub(r"[^A-Za-z0-9=.+_-]+", "_", name)
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in KNOB_ENV}
    env.update(cfg.get("env", {}))
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_VERBOSITY"] = "error"
    cmd = [sys.executable, __file__, "--worker", json.dumps(dict(cfg, ref_dir=str(ref_dir) if ref_dir else None)), "--workdir", str(out),
           "--models", ",".join(models), "--tiny-tokens", str(n_tiny), "--smol-tokens", str(n_smol)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if r.returncode:
        raise RuntimeError(f"{name}: worker failed\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    return out, r.stdout


def verbose_summary(stdout: str) -> dict:
    """MKL / oneDNN verbose lines of the Linear probe -> which kernel ran."""
    mkl = [ln for ln in stdout.splitlines() if ln.startswith("MKL_VERBOSE")]
    dnn = [ln for ln in stdout.splitlines() if ln.lower().startswith(("onednn_verbose", "dnnl_verbose"))]
    out = {}
    for ln in mkl:
        m = re.search(r"MKL_VERBOSE (\w+)\(", ln)
        if m:
            out.setdefault("mkl_calls", set()).add(m.group(1))
        m = re.search(r"\(Intel\(R\) ((?:AVX|SSE)[^)]*)\)", ln)
        if m and "mkl_isa" not in out:
            out["mkl_isa"] = m.group(1) + (" +DL Boost" if "DL Boost" in ln else "")
        m = re.search(r"CNR:(\w+)", ln)
        if m:
            out["mkl_cnr"] = m.group(1)
    for ln in dnn:
        if ",info,cpu,isa:" in ln:
            out["onednn_isa"] = ln.split("isa:", 1)[1].strip()
        if ",exec," in ln:
            parts = ln.split(",")
            i = parts.index("exec")
            out.setdefault("onednn_exec", set()).add(f"{parts[i + 2]}:{parts[i + 3]}")
    return {k: (sorted(v) if isinstance(v, set) else v) for k, v in out.items()}


# --- comparison against the baseline ----------------------------------------------------------------
def _rows_differ(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a.reshape(a.shape[0], -1)
    b = b.reshape(b.shape[0], -1)
    return (a.view(np.uint8 if a.dtype.itemsize == 1 else f"u{a.dtype.itemsize}")
            != b.view(f"u{b.dtype.itemsize}")).any(1)


def compare_model(base: dict, other: dict, cdf_base: dict, cdf_other: dict) -> dict:
    ids = base["ids"]
    r = {}
    nl = sum(1 for k in base if k.startswith("prefill_k"))
    for which in ("prefill", "inc"):
        la, lb = base[f"{which}_logits"], other[f"{which}_logits"]
        d = _rows_differ(la, lb)
        r[f"{which}_logits_frac"] = float(d.mean())
        r[f"{which}_logits_max"] = float(np.abs(la.astype(np.float64) - lb).max())
        r[f"{which}_probs_frac"] = float(_rows_differ(base[f"{which}_probs"], other[f"{which}_probs"]).mean())
        first, maxd, nd = None, 0.0, 0
        for i in range(nl):
            for kv in "kv":
                a, b = base[f"{which}_{kv}{i}"], other[f"{which}_{kv}{i}"]
                if a.shape != b.shape or not np.array_equal(a.view("u4"), b.view("u4")):
                    first = i if first is None else first
                    nd += 1
                    if a.shape == b.shape:
                        maxd = max(maxd, float(np.abs(a.astype(np.float64) - b).max()))
        r[f"{which}_kv_first_layer"] = first
        r[f"{which}_kv_tensors_differ"] = nd
        r[f"{which}_kv_max"] = maxd
        # integer frequencies of the coded next tokens: position i's distribution codes ids[i+1]
        ca, cb = cdf_base[which][:-1], cdf_other[which][:-1]
        t = ids[1:]
        rows = np.arange(t.size)
        table = (ca != cb).any(1)
        interval = (ca[rows, t] != cb[rows, t]) | (ca[rows, t + 1] != cb[rows, t + 1])
        r[f"{which}_cdf_table_frac"] = float(table.mean())
        r[f"{which}_interval_frac"] = float(interval.mean())
        r[f"{which}_interval_n"] = int(interval.sum())
        r[f"{which}_cdf_max_entry_diff"] = int(np.abs(ca - cb).max())
        # operational: words coded with the baseline, decoded with this config (and the reverse)
        pa, pb = base[f"{which}_probs"][:-1], other[f"{which}_probs"][:-1]
        wa, wb = encode_words(pa, t), encode_words(pb, t)
        da, db = decode_words(wa, pb), decode_words(wb, pa)
        r[f"{which}_words_equal"] = bool(np.array_equal(wa, wb))
        r[f"{which}_decode_ok"] = bool(np.array_equal(da, t) and np.array_equal(db, t))
        bad = np.flatnonzero(da != t)
        r[f"{which}_first_bad_decode"] = int(bad[0]) if bad.size else None
        r[f"{which}_predicted_ok"] = not interval.any()
    if "ref_inc_probs" in other:  # the same (baseline) logits through this configuration's softmax
        cr = quantize_cdf(other["ref_inc_probs"])[:-1]
        t = ids[1:]
        rows = np.arange(t.size)
        ca = cdf_base["inc"][:-1]
        r["softmax_probs_frac"] = float(_rows_differ(base["inc_probs"], other["ref_inc_probs"]).mean())
        r["softmax_interval_frac"] = float(((ca[rows, t] != cr[rows, t]) | (ca[rows, t + 1] != cr[rows, t + 1])).mean())
    return r


def compare_ops(a: dict, b: dict) -> dict:
    out = {}
    for k in a:
        if k not in b or a[k].shape != b[k].shape:
            out[k] = "n/a"
        elif a[k].dtype == b[k].dtype and np.array_equal(a[k].view(f"u{a[k].itemsize}"), b[k].view(f"u{b[k].itemsize}")):
            out[k] = "="
        else:
            out[k] = f"{np.abs(a[k].astype(np.float64) - b[k]).max():.1e}"
    return out


def load(path: Path) -> dict:
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def cdfs(d: dict) -> dict:
    return {w: quantize_cdf(d[f"{w}_probs"]) for w in ("prefill", "inc")}


def fmt_frac(x: float, n: int) -> str:
    return "0" if x == 0 else f"{x:.2f} ({round(x * n)}/{n})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/numerics/results.md"))
    ap.add_argument("--workdir", type=Path, default=None, help="scratch dir for the .npz (default: a temp dir)")
    ap.add_argument("--models", default="tiny,smollm2")
    ap.add_argument("--configs", default=None, help="comma-separated names (baseline is always run first)")
    ap.add_argument("--tiny-tokens", type=int, default=64)
    ap.add_argument("--smol-tokens", type=int, default=128)
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    models = [m for m in a.models.split(",") if m]
    if a.worker is not None:
        worker(json.loads(a.worker), a.workdir, models, a.tiny_tokens, a.smol_tokens)
        return 0
    if a.list:
        print("\n".join(CONFIGS))
        return 0
    names = list(CONFIGS) if a.configs is None else ["baseline"] + [c for c in a.configs.split(",")
                                                                    if c and c != "baseline"]
    for n in names:
        if n not in CONFIGS:
            ap.error(f"unknown configuration {n!r}; --list names them")
    tmp = tempfile.TemporaryDirectory(prefix="numerics-") if a.workdir is None else None
    workdir = Path(tmp.name) if tmp else a.workdir
    t_start = time.time()

    rows, infos, opsdiff = [], {}, {}
    base, base_cdf, base_ops, base_dir = {}, {}, None, None
    selftest = spec_check = None
    for name in names:
        t0 = time.time()
        out, stdout = run_config(name, CONFIGS[name], workdir, models, a.tiny_tokens, a.smol_tokens,
                                 None if name == "baseline" else base_dir)
        if name == "baseline":
            base_dir = out
        info = json.loads((out / "info.json").read_text())
        info["verbose"] = verbose_summary(stdout)
        infos[name] = info
        ops = load(out / "ops.npz")
        if name == "baseline":
            base_ops = ops
        opsdiff[name] = compare_ops(base_ops, ops)
        for m in models:
            d = load(out / f"{m}.npz")
            c = cdfs(d)
            if name == "baseline":
                base[m], base_cdf[m] = d, c
                if m == models[-1]:
                    rng = np.random.default_rng(0)
                    selftest = selftest_quantizer(d["inc_probs"], rng)
                    sq = spec_quantize()
                    if sq is not None:
                        agree = []
                        for p in d["inc_probs"][:8]:
                            got = _as_cdf(sq(p), p.size)
                            agree.append(got is not None and np.array_equal(got, quantize_cdf(p)))
                        spec_check = f"{sum(agree)}/{len(agree)} distributions quantize identically"
                # the schedule itself: prefill vs token-by-token on the same machine
                sch = {"prefill": d["prefill_logits"], "inc": d["inc_logits"]}
                dd = _rows_differ(sch["prefill"], sch["inc"])
                ca, cb = c["prefill"][:-1], c["inc"][:-1]
                t = d["ids"][1:]
                rr = np.arange(t.size)
                iv = (ca[rr, t] != cb[rr, t]) | (ca[rr, t + 1] != cb[rr, t + 1])
                infos.setdefault("_schedule", {})[m] = {
                    "logits_frac": float(dd.mean()),
                    "logits_max": float(np.abs(sch["prefill"].astype(np.float64) - sch["inc"]).max()),
                    "interval_frac": float(iv.mean()), "n": int(t.size)}
                continue
            r = compare_model(base[m], d, base_cdf[m], c)
            r.update(config=name, model=m, n=int(d["ids"].size - 1))
            rows.append(r)
            for f in out.glob(f"{m}.npz"):
                f.unlink()
        print(f"{name}: {time.time() - t0:.1f}s", file=sys.stderr, flush=True)

    md = render(rows, infos, opsdiff, names, models, selftest, spec_check, time.time() - t_start)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(md)
    print(md)
    if tmp:
        tmp.cleanup()
    return 0


def render(rows, infos, opsdiff, names, models, selftest, spec_check, seconds) -> str:
    b = infos["baseline"]
    L = ["# CPU numerics study: what changes LM-coded token regeneration", "",
         f"Machine: {b['capability']} capability, {os.cpu_count()} CPUs; torch {b['torch']}, transformers "
         f"{b['transformers']}, constriction {b['constriction']}, numpy {b['numpy']}; BLAS={b['blas']}; "
         + "; ".join(b["config_lines"]) + f". Run time {seconds / 60:.1f} min.", "",
         "Baseline: defaults, 2 threads, transformers' default attention "
         f"({b.get('smollm2_attn') or b.get('tiny_attn')}), float32.  `inc` = one token per forward call with a "
         "DynamicCache (what the `lm` coder runs), `prefill` = one call.  Position i's distribution codes token "
         "i+1.  *freq differs* = positions whose coded token's 24-bit (cumulative, frequency) interval differs "
         "from the baseline's (decoding breaks at the first); *table* = positions where any of the V+1 CDF "
         "entries differs; *decodes* = tokens coded with the baseline's distributions decode with this "
         "configuration's and vice versa (constriction); *softmax only* = the baseline's float32 logits put "
         "through this configuration's float64 softmax (lm.next_token_probs): positions whose probabilities / coded-token "
         "interval differ from the baseline's.", ""]
    if selftest:
        L += [f"Quantizer port checked against constriction: {selftest['agree']}/{selftest['trials']} perturbation "
              f"trials agree ({selftest['interval_changed']} changed the interval)."
              + (f"  scripts/spec_rangecoder.py `quantize`: {spec_check}." if spec_check else ""), ""]
    for m in models:
        rs = [r for r in rows if r["model"] == m]
        if not rs:
            continue
        n = rs[0]["n"]
        L += [f"## {m} ({n + 1} tokens)", "",
              "| config | inc logits differ (frac, max) | inc KV identical? (first layer, max) | inc probs differ "
              "| **inc freq differs** | inc table differs | inc decodes? | softmax only: probs / freq differ "
              "| prefill logits differ | prefill KV identical? | prefill freq differs | prefill decodes? |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rs:
            def kv(w):
                if r[f"{w}_kv_first_layer"] is None:
                    return "yes"
                return f"no (L{r[f'{w}_kv_first_layer']}, {r[f'{w}_kv_max']:.1e})"

            def lg(w):
                return "0" if r[f"{w}_logits_frac"] == 0 else f"{r[f'{w}_logits_frac']:.2f}, {r[f'{w}_logits_max']:.1e}"

            def dec(w):
                s = "yes" if r[f"{w}_decode_ok"] else f"no (from {r[f'{w}_first_bad_decode']})"
                if r[f"{w}_decode_ok"] != r[f"{w}_predicted_ok"]:
                    s += " (port predicted otherwise)"
                return s

            L.append(f"| {r['config']} | {lg('inc')} | {kv('inc')} | {fmt_frac(r['inc_probs_frac'], n)} | "
                     f"**{fmt_frac(r['inc_interval_frac'], n)}** | {fmt_frac(r['inc_cdf_table_frac'], n)} | "
                     f"{dec('inc')} | {fmt_frac(r.get('softmax_probs_frac', float('nan')), n)} / "
                     f"{fmt_frac(r.get('softmax_interval_frac', float('nan')), n)} | {lg('prefill')} | {kv('prefill')} | "
                     f"{fmt_frac(r['prefill_interval_frac'], n)} | {dec('prefill')} |")
        s = infos.get("_schedule", {}).get(m)
        if s:
            L += ["", f"Same machine, baseline, prefill vs token-by-token: logits differ at {s['logits_frac']:.2f} "
                  f"of positions (max {s['logits_max']:.1e}); the coded token's interval differs at "
                  f"{s['interval_frac']:.2f} ({round(s['interval_frac'] * s['n'])}/{s['n']})."]
        L.append("")
    # ops
    ops = list(next(iter(opsdiff.values())))
    L += ["## Single operations (SmolLM2 shapes; `=` bit-identical to baseline, else max abs diff)", ""]
    cols = [n for n in names if n != "baseline"]
    L += ["| op | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for op in ops:
        L.append(f"| {op} | " + " | ".join(opsdiff[c][op] for c in cols) + " |")
    L += ["", "## What each subprocess reported", "",
          "| config | capability | threads | mkldnn | attn | MKL sgemm ISA (CNR) | oneDNN ISA | env |",
          "|---|---|---|---|---|---|---|---|"]
    for n in names:
        i = infos[n]
        v = i["verbose"]
        L.append(f"| {n} | {i['capability']} | {i['threads']} | {i['mkldnn_enabled']} | "
                 f"{i.get('smollm2_attn') or i.get('tiny_attn')} | {v.get('mkl_isa', '?')} ({v.get('mkl_cnr', '?')}) "
                 f"| {v.get('onednn_isa', '-')} | {' '.join(f'{k}={x}' for k, x in i['env'].items()) or '-'} |")
    calls = {n: (infos[n]['verbose'].get('mkl_calls'), infos[n]['verbose'].get('onednn_exec')) for n in names}
    L += ["", "Linear(576->1536) on 1 and 128 tokens: MKL calls / oneDNN primitives seen per config: "
          + "; ".join(f"{n}: {c[0]} / {c[1]}" for n, c in calls.items()), ""]
    return "\n".join(L) + "\n"


if __name__ == "__main__":
    sys.exit(main())
