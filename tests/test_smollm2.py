"""Integration tests on the real embedded model (SmolLM2-135M-Instruct)."""

import copy
import json
from pathlib import Path

import pytest
import torch

import kvcodec
from kvcodec.lab.common import demo_text
from kvcodec.models import prefill, tokenize

from .common import NUMERICS_SKIP, check_rejects, greedy_from, numerics_like_the_vectors, recorded_generate

pytestmark = pytest.mark.slow


def test_conversion_gives_identical_logits(smollm2):
    """The safetensors cache reproduces the GGUF-loaded model exactly."""
    from transformers import AutoModelForCausalLM

    from kvcodec.models import _gguf_location

    model, tok = smollm2
    d, fname = _gguf_location("smollm2")
    gguf_model = AutoModelForCausalLM.from_pretrained(d, gguf_file=fname, dtype=torch.float32,
                                                      local_files_only=True).eval()
    ids = tokenize(tok, demo_text(), 64)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, gguf_model(ids).logits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_real_cache_round_trip_and_generation(smollm2, dtype):
    model, tok = smollm2
    model = copy.deepcopy(model).to(dtype)
    ids = tokenize(tok, demo_text(), 257)
    cache = prefill(model, ids[:, :-1])
    kv = kvcodec.to_canonical(cache)
    data = kvcodec.encode(cache, (model, tok), tier="lossless", tokens=ids[:, :-1])
    back = kvcodec.decode(data, (model, tok))
    assert kvcodec.to_canonical(back).equal(kv)
    ratio = kv.nbytes() / len(data)
    # measured 1.57x (bf16) / 1.14x (fp32) on 1-2k tokens; a regression below these bounds fails
    assert ratio > (1.45 if dtype == torch.bfloat16 else 1.08), ratio
    a, b = greedy_from(model, ids, cache, back, 16, tok.eos_token_id)
    assert torch.equal(a, b)


def test_batch_of_two_with_padding(smollm2):
    model, tok = smollm2
    tok.padding_side = "left"
    batch = tok(["The quick brown fox", "A much longer second prompt that has more tokens in it"],
                return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model(**batch, use_cache=True)
    cache = out["cache"] if "cache" in out else out["past_key_values"]
    back = kvcodec.decode(kvcodec.encode(cache), output="kvcache")
    assert back.equal(kvcodec.to_canonical(cache)) and back.batch == 2


def _chat_ids(tok):
    """A three-turn conversation through the model's chat template, ready for the assistant's answer."""
    msgs = [{"role": "user", "content": "What is a KV cache?"},
            {"role": "assistant", "content": "The keys and values of past tokens."},
            {"role": "user", "content": "Why store it?"}]
    return tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]


def test_chat_template_conversation(smollm2):
    model, tok = smollm2
    ids = _chat_ids(tok)
    cache = prefill(model, ids)
    assert kvcodec.decode(kvcodec.encode(cache), output="kvcache").equal(kvcodec.to_canonical(cache))


def test_model_mismatch_on_real_model(smollm2):
    model, tok = smollm2
    ids = tokenize(tok, demo_text(), 8)
    data = kvcodec.encode(prefill(model, ids), (model, tok))
    other = copy.deepcopy(model).to(torch.bfloat16)
    check_rejects(kvcodec.ModelMismatch, data, other)


def test_demo_command(tmp_path, monkeypatch, smollm2):
    from kvcodec.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--tokens", "96", "-o", str(tmp_path / "d.kvz")]) == 0


# --- the token tiers (issue 3) ------------------------------------------------------------
def _gen(model, tok, ids, new, **kw):
    return recorded_generate(model, ids, new, tok.eos_token_id, **kw)


def _residual_bytes(data):
    return kvcodec.inspect(data)["token_channel"]["residual_bytes"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_tier_prefill_and_generation_bit_identical(smollm2, dtype):
    model, tok = smollm2
    model = copy.deepcopy(model).to(dtype)
    ids = tokenize(tok, demo_text(), 48)
    cache = prefill(model, ids)
    data = kvcodec.encode(cache, (model, tok))  # tokens recovered from the cache; schedule verified
    info = kvcodec.inspect(data)
    assert info["tier"] == "exact" and info["token_channel"]["schedule"] == [[48, 1]]
    assert _residual_bytes(data) == 0  # the same prefill recomputed: bit-identical, no residual section at all
    assert kvcodec.to_canonical(kvcodec.decode(data, (model, tok))).equal(kvcodec.to_canonical(cache))
    # prefill + greedy generation, recorded, then the same cache without its record (schedule inferred)
    rec, out = _gen(model, tok, ids[:, :32], 12)
    plain = kvcodec.to_canonical(rec).to_dynamic_cache()
    residual = False
    for c in (rec, plain):
        data = kvcodec.encode(c, (model, tok))
        schedule = kvcodec.inspect(data)["token_channel"]["schedule"]
        if c is rec:
            assert schedule == [[32, 1], [1, 11]]
        else:
            # inferred: the smallest prefill whose later positions all reproduce as single steps. Where this
            # CPU's bf16 kernels give position 31 the same bits either way, prefill 31 is as exact as prefill 32
            # (float-dependent, hence a range; the residual below proves whichever was chosen is bit-exact)
            # where no prefill does (a CPU whose single steps never give a prefill's bits), one prefill of all 43
            # positions, and the residual carries the difference (numerics-bound, below)
            assert schedule == [[43, 1]] or (len(schedule) == 2 and 1 <= schedule[0][0] <= 32
                                             and schedule[0][1] == 1 and schedule[1] == [1, 43 - schedule[0][0]])
        residual = residual or _residual_bytes(data) > 0  # bit-identical steps: numerics-bound
        restored = kvcodec.decode(data, (model, tok))
        assert kvcodec.to_canonical(restored).equal(kvcodec.to_canonical(rec))
    a, b = greedy_from(model, out, plain, restored, 12, tok.eos_token_id)
    assert torch.equal(a, b)
    if residual:  # required on the vectors' machine's numerics, skipped (said so) elsewhere
        assert not numerics_like_the_vectors(), "regeneration is not bit-identical: residuals were coded"
        pytest.skip(NUMERICS_SKIP)


def test_exact_tier_chat_batch_and_static(smollm2):
    model, tok = smollm2
    ids = _chat_ids(tok)
    cache = prefill(model, ids)
    for tm in ("lm", "static"):
        data = kvcodec.encode(cache, (model, tok), token_model=tm)
        assert kvcodec.to_canonical(kvcodec.decode(data, (model, tok))).equal(kvcodec.to_canonical(cache))
    # a padded batch of two prompts of different lengths, continued by generate()
    tok.padding_side = "left"
    batch = tok(["The quick brown fox", "A much longer second prompt that has more tokens in it"],
                return_tensors="pt", padding=True)
    rec, _ = _gen(model, tok, batch["input_ids"], 6, attention_mask=batch["attention_mask"])
    data = kvcodec.encode(rec, (model, tok))
    tc = kvcodec.inspect(data)["token_channel"]
    assert kvcodec.to_canonical(kvcodec.decode(data, (model, tok))).equal(kvcodec.to_canonical(rec))
    if not (tc["padding"][0] > 0 and tc["padding"][1] == 0 and tc["positions"] == "mask"):
        # the padding is inferred by recomputing: required on the vectors' machine's numerics, skipped elsewhere
        assert not numerics_like_the_vectors(), tc
        pytest.skip(NUMERICS_SKIP)


def test_token_tier_wrong_model_and_tokenizer(smollm2):
    model, tok = smollm2
    cache = prefill(model, tokenize(tok, demo_text(), 8))
    data = kvcodec.encode(cache, (model, tok), token_model="static")
    check_rejects(kvcodec.ModelMismatch, data, copy.deepcopy(model).to(torch.bfloat16), match="fingerprint|model")
    other = copy.deepcopy(tok)
    other.add_tokens(["<kvcodec-test-token>"])
    check_rejects(kvcodec.ModelMismatch, data, (model, other), match="tokenizer")


def test_kvz_encode_reduce_on_real_text(tmp_path, capsys, smollm2):
    """`kvz encode --reduce`: SmolLM2 over a real text, reduced to 10 % (the default: kvzip, its fit and its
    bound), stored lossy; the file says what it is and decodes to a cache SmolLM2 generates from."""
    from kvcodec.cli import main

    text = tmp_path / "t.txt"
    text.write_text(demo_text())
    out = tmp_path / "t.kvz"
    assert main(["encode", "--text", str(text), "--max-tokens", "400", "--reduce", "0.1", "--tier", "lossy",
                 "--bits", "3", "--dtype", "fp32", "-o", str(out), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    info = kvcodec.inspect(out)
    assert info["tier"] == "lossy" and info["reduce"]["method"] == "kvzip" and info["format_version"] == "1.11"
    assert info["reduce"]["bound"] == {"recent": 16, "step": 16}
    assert info["reduce"]["tokens"] == 400 and info["reduce"]["entries"] <= 40 and rep["tokens"] == info["tokens"]
    model, tok = smollm2
    cache = kvcodec.load(out, model)
    nxt = model.generate(tokenize(tok, demo_text(), 401), cache=cache, max_new_tokens=3, do_sample=False)
    assert nxt.shape[1] == 404


def test_kvz_encode_reduce_kvzip_reads_the_repeat_instruction(tmp_path, capsys, smollm2):
    """`kvz encode --reduce-method kvzip`: a 1.11 file (the heads of a layer keep different numbers: KVzip's
    default allocation, 1.8; its bound, 1.11) holding what kvcodec.reduce keeps with KVzip's repeat instruction in SmolLM2's tokens
    (not what it keeps without it), values and log-weights refitted (its default fit); with `--no-reduce-fit`
    the same keys with the selected tokens' own values, log-weight 0."""
    from kvcodec.cli import main
    from kvcodec.reduction import REPEAT_PROMPT

    text = tmp_path / "t.txt"
    text.write_text(demo_text())
    out = tmp_path / "t.kvz"
    assert main(["encode", "--text", str(text), "--max-tokens", "300", "--reduce", "0.25", "--reduce-method",
                 "kvzip", "--tier", "lossless", "--dtype", "fp32", "-o", str(out), "--json"]) == 0
    info = kvcodec.inspect(out)
    assert info["format_version"] == "1.11" and info["reduce"]["method"] == "kvzip"
    model, tok = smollm2
    ids = tokenize(tok, demo_text(), 300)
    cache = prefill(model, ids)
    prompt = tok(REPEAT_PROMPT, add_special_tokens=False)["input_ids"]
    want = kvcodec.reduce(cache, model, 0.25, "kvzip", tokens=ids, prompt=prompt)
    plain = kvcodec.reduce(cache, model, 0.25, "kvzip", tokens=ids)
    got = kvcodec.load(out, model)
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(got.layers, want.layers))
    assert not all(torch.equal(a.keys, b.keys) for a, b in zip(got.layers, plain.layers))
    kept = [la.counted() for la in got.reduced_layers()]  # the budget spread over the layers and heads (default)
    assert len(set(kept)) > 1 and info["reduce"]["entries_range"] == [round(min(kept)), round(max(kept))]
    assert info["reduce"]["held"] == got.entries() > info["reduce"]["entries"]  # the longest heads'
    assert info["reduce"]["entries"] == round(got.counted())
    same = tmp_path / "u.kvz"
    assert main(["encode", "--text", str(text), "--max-tokens", "300", "--reduce", "0.25", "--reduce-method",
                 "kvzip", "--reduce-allocation", "uniform", "--tier", "lossless", "--dtype", "fp32", "-o", str(same),
                 "--json"]) == 0
    assert kvcodec.inspect(same)["reduce"]["entries_range"] == [info["reduce"]["entries"]] * 2
    plain_file = tmp_path / "p.kvz"  # --no-reduce-fit: the same keys, the selected tokens' own values
    assert main(["encode", "--text", str(text), "--max-tokens", "300", "--reduce", "0.25", "--reduce-method",
                 "kvzip", "--no-reduce-fit", "--tier", "lossless", "--dtype", "fp32", "-o", str(plain_file),
                 "--json"]) == 0
    unfitted = kvcodec.reduce(cache, model, 0.25, "kvzip", tokens=ids, prompt=prompt, fit=False)
    got_plain = kvcodec.load(plain_file, model)

    def beta(la):  # None: every entry at log-weight 0
        return la.beta if la.beta is not None else torch.zeros(la.keys.shape[:3])

    for a, b, c, d in zip(got.reduced_layers(), want.reduced_layers(), got_plain.reduced_layers(),
                          unfitted.reduced_layers()):
        assert torch.equal(a.values, b.values) and torch.equal(beta(a), beta(b))  # the default: fitted
        assert torch.equal(c.keys, a.keys) and torch.equal(c.values, d.values) and torch.equal(beta(c), beta(d))
        assert not torch.isfinite(beta(c)).logical_and(beta(c) != 0).any()
    assert not all(torch.equal(a.values, c.values) for a, c in zip(got.layers, got_plain.layers))


def test_kvz_calibrate_encode_decode_eval_with_predictors(tmp_path, capsys, smollm2):
    """The predicted lossy tier from the command line on the real model: `kvz calibrate` writes a profile and
    predictors (2,048 tokens of the embedded text), `kvz encode --predictors` a 1.6 file that
    `kvz decode` refuses without them and decodes with them, `kvz eval` scores it on a text file outside the
    corpus and predicted coding beats unpredicted at the same rate there."""
    from kvcodec.cli import main

    text = tmp_path / "t.txt"
    text.write_text(demo_text())
    prof, pred = tmp_path / "p.json", tmp_path / "p.safetensors"
    assert main(["calibrate", "--profile", str(prof), "--predictors", str(pred), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rep["predictors_sha256"] == kvcodec.Predictors.load(pred).identity
    out = tmp_path / "t.kvz"
    weighted = ["--lossy-options", '{"quantizer": "weighted"}', "--profile", str(prof)]
    assert main(["encode", "--text", str(text), "--max-tokens", "200", "--tier", "lossy", "--bits", "2",
                 "--dtype", "fp32", *weighted, "--predictors", str(pred), "-o", str(out)]) == 0
    assert kvcodec.inspect(out)["predict"]["predictors"] == rep["predictors_sha256"]
    assert main(["decode", str(out), "-o", str(tmp_path / "a.safetensors")]) != 0  # PredictorsRequired
    assert "PredictorsRequired" in capsys.readouterr().err
    assert main(["decode", str(out), "-o", str(tmp_path / "a.safetensors"), "--predictors", str(pred)]) == 0
    assert main(["encode", "--text", str(text), "--tier", "lossless", "--predictors", str(pred), "-o",
                 str(tmp_path / "x.kvz")]) == 1  # refused before any work
    assert "lossy with quantizer weighted" in capsys.readouterr().err and not (tmp_path / "x.kvz").exists()
    other = tmp_path / "other.txt"  # not the calibration text
    other.write_text((Path(__file__).resolve().parent.parent / "spec" / "kvz.md").read_text()[:6000])
    assert main(["eval", "--texts", str(other), "--prefix", "192", "--continuation", "48", "--profile", str(prof),
                 "--predictors", str(pred), "--out", str(tmp_path / "ev"), "--config",
                 '{"bits": 2, "quantizer": "weighted"}',
                 '{"bits": 2, "quantizer": "weighted", "predictors": true}']) == 0
    rows = json.loads((tmp_path / "ev" / "eval.json").read_text())["rows"]
    assert len(rows) == 2 and rows[1]["mean_kl_bits"] < rows[0]["mean_kl_bits"]


def test_kvz_store_put_text_then_the_same_cache_from_a_file_is_one_namespace(tmp_path, capsys):
    """`kvz store put --text` then `kvz store get -o` then `kvz store put --cache` of that file: the cache file
    lands in the model's namespace (its fingerprint), so it is already stored, not stored again under a
    model-less name; a typo'd store path is an error, not an empty store."""
    from kvcodec.cli import main

    text = tmp_path / "t.txt"
    text.write_text(demo_text())
    url = str(tmp_path / "store")
    assert main(["store", "put", url, "--text", str(text), "--max-tokens", "96", "--chunk-tokens", "32",
                 "--json"]) == 0
    key = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["key"]
    out = tmp_path / "c.safetensors"
    assert main(["store", "get", url, key, "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["store", "put", url, "--cache", str(out), "--chunk-tokens", "32", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rep["key"] == key and rep["already_stored"] == 96
    assert len(kvcodec.Store(url).namespaces()) == 1
    assert main(["store", "stats", url + "-typo"]) == 2
    assert "no store" in capsys.readouterr().err
