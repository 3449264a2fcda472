"""Side study: the lossy tier's ``key_ratio`` (key step per value step) with predictors.

SmolLM2 (fp32 or bf16), the protocol of ``kvz bench --lossy`` (1,024-token caches, 256 teacher-forced tokens),
predictors fitted as that bench fits them (on up to 2,048 tokens of each corpus file that is not one of its
three evaluated texts), ``bits=1.95``, each ``key_ratio`` given.  BENCHMARKS.md ("Cross-layer prediction")
quotes its results::

    KVCODEC_CORPUS=../shared/corpus python scripts/studies/predict_key_ratio.py fp32 0.07 0.1 0.15
    KVCODEC_CORPUS=../shared/corpus python scripts/studies/predict_key_ratio.py fp32 0.05 0.07 0.15 \\
        --texts techdoc_en_python_tutorial_controlflow.rst nonen_zh_debian_reference_ch1.txt log_dpkg.log
"""

import argparse
import statistics

import torch

import kvcodec
from kvcodec import api
from kvcodec.lab.bench_lossy import CALIBRATION, PREDICTOR_TOKENS, TEXTS
from kvcodec.lab.common import corpus_files
from kvcodec.lab.evaluate import evaluate_cache, prefix_case
from kvcodec.models import load_model, tokenize


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dtype", choices=["fp32", "bf16"])
    ap.add_argument("key_ratios", nargs="+", type=float)
    ap.add_argument("--texts", nargs="*", default=None, help="corpus file names (default: the bench's three)")
    ap.add_argument("--bits", type=float, default=1.95)
    ap.add_argument("--corpus", default=None)
    args = ap.parse_args()
    model, tok = load_model("smollm2", dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype])
    files = {f.name: f for f in corpus_files(args.corpus)}
    profile = kvcodec.calibrate(model, tokenize(tok, files[CALIBRATION].read_text(encoding="utf-8"), 128))
    pred = kvcodec.calibrate_predictors(model, [files[f].read_text(encoding="utf-8") for f in sorted(files)
                                                if f not in TEXTS], tokenizer=tok, profile=profile,
                                        tokens=PREDICTOR_TOKENS)
    res = {}
    for name in args.texts or TEXTS:
        prefix, cont, exact, comps = prefix_case(model, tok, files[name], 1024, 256)
        for kr in args.key_ratios:
            data = api.encode(exact, tier="lossy", quantizer="weighted", bits=args.bits, key_ratio=kr,
                              profile=profile, predictors=pred)
            info = api.inspect(data)
            bits = 8 * sum(s["bytes"] for s in info["sections"] if s["type"] == "kv") / comps
            kl = evaluate_cache(model, tok, exact, api.decode(data, predictors=pred), prefix, cont)["mean_kl_bits"]
            res.setdefault(kr, []).append((name, round(bits, 3), round(kl, 4)))
            print(name, kr, round(bits, 3), round(kl, 4), flush=True)
    for kr, rows in res.items():
        print(f"key_ratio {kr}: median KL {statistics.median(r[2] for r in rows)}", rows)


if __name__ == "__main__":
    main()
