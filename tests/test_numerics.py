"""Token tiers across machines (spec 11.4): the file records the numerics profile of its encoder, and a decoder
that cannot reproduce it refuses before any work, saying what would work.  Another machine is simulated by
editing the recorded profile (and resealing the file)."""

import copy
import time
import warnings
from pathlib import Path

import pytest
import torch

import kvcodec
from kvcodec import numerics

from .common import check_rejects, fuzz_tools

ROOT = Path(__file__).resolve().parent.parent
VECTORS = ROOT / "spec" / "vectors"
header_of, with_header = fuzz_tools().header_of, fuzz_tools().with_header


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(VECTORS / "models" / "tiny-llama", dtype=torch.float32).eval()


def elsewhere(case: str, **changes) -> bytes:
    """Vector ``case`` as if encoded on a machine whose profile differs by ``changes``."""
    data = (VECTORS / f"{case}.kvz").read_bytes()
    h = header_of(data)
    h["tokens"]["procedure"]["numerics"].update(changes)
    return with_header(data, h)


def test_the_profile_is_recorded(model):
    h = header_of((VECTORS / "exact_lm_steps.kvz").read_bytes())
    rec = h["tokens"]["procedure"]["numerics"]
    assert {"engine", "torch", "transformers", "device", "dtype", "attention", "threads"} <= rec.keys()
    assert rec["device"] == "cpu" and {"cpu_capability", "cpu_isa", "blas"} <= rec.keys()
    here = numerics.profile(model)
    assert numerics.differences(here, here) == []
    assert numerics.differences({**here, "threads": 99}, here, multi_token_calls=False) == []
    assert numerics.differences({**here, "threads": 99}, here) == [f"threads 99 (file) vs {here['threads']} (here)"]


def test_lm_tokens_refused_before_any_work(model):
    other = "AVX2" if torch.backends.cpu.get_cpu_capability() != "AVX2" else "DEFAULT"  # not this machine's
    data = elsewhere("exact_lm_steps", cpu_capability=other)
    t = time.perf_counter()
    e = check_rejects(kvcodec.NumericsMismatch, data, model, match=f"cpu_capability {other} .file.")
    assert "ATEN_CPU_CAPABILITY" in str(e) and "'lossless'" in str(e) and time.perf_counter() - t < 5
    with kvcodec.open_kvz(data, model) as f:  # opening and reading the header is fine; decoding is refused
        assert f.header.tier == "exact"
        with pytest.raises(kvcodec.NumericsMismatch):
            f.tokens()


def test_try_attempts_and_the_checksums_decide(model):
    # the recorded profile says AVX2, but this machine is the one that wrote the vector: "try" succeeds where the
    # numbers agree (the `numerics` marker's condition), otherwise a checksum names the difference
    data = elsewhere("exact_lm_steps", attention="eager")
    try:
        kvcodec.decode(data, model, numerics="try", output="kvcache")
    except kvcodec.ChecksumMismatch as e:
        assert "attention" in str(e) or "procedure" in str(e)


def test_static_tokens_recompute_where_numerics_differ(model):
    data = elsewhere("exact_static_prefill", cpu_capability="AVX2", torch="0.0")
    check_rejects(kvcodec.NumericsMismatch, data, model, match="bit for bit.*recompute")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = kvcodec.decode(data, model, numerics="recompute", output="kvcache")
    assert any("without the file's residuals" in str(x.message) for x in w)
    with kvcodec.open_kvz(data, model, numerics="try") as f:
        assert got.equal(f.regenerated())  # this machine's regeneration, residuals not applied


def test_tokens_tier_without_residual_is_a_local_recompute_anywhere(model):
    with warnings.catch_warnings():  # a cache of the vector's tokens: where this machine's numerics differ from
        warnings.simplefilter("ignore")  # the vector's, its own regeneration (what "recompute" returns)
        cache = kvcodec.decode((VECTORS / "exact_static_prefill.kvz").read_bytes(), model, output="kvcache",
                               numerics="recompute")
    data = kvcodec.encode(cache, model, tier="tokens", token_model="static")
    h = header_of(data)
    h["tokens"]["procedure"]["numerics"]["cpu_capability"] = "AVX2"
    kvcodec.decode(with_header(data, h), model)  # no residual: restore = recompute here, by definition


def test_bad_numerics_mode():
    check_rejects(kvcodec.ConfigError, (VECTORS / "fp16_tiny.kvz").read_bytes(), numerics="sloppy")


def test_canary_catches_what_the_list_cannot(model):
    import copy

    other = copy.deepcopy(model)
    with torch.no_grad():
        other.lm_head.weight[0, 0] += 1e-3  # same everything, other float results
    diffs = numerics.differences(numerics.profile(model), numerics.profile(other))
    assert diffs and all(d.startswith("canary") for d in diffs)


def test_one_token_calls_run_on_the_recorded_thread_count(model):
    """The encoder runs one-token calls on STEP_THREADS threads and records it; the decoder does the same
    whatever torch's thread count (in bf16 the bits of a one-token call depend on it)."""
    from kvcodec.tokens.plan import STEP_THREADS

    h = header_of((VECTORS / "exact_lm_steps.kvz").read_bytes())
    assert h["tokens"]["procedure"]["numerics"]["step_threads"] == STEP_THREADS == 1


def test_the_canary_is_computed_once_per_model_state(model, monkeypatch):
    """The probe runs once per (model, determinants, weights); an in-place weight change or another thread
    count runs it again, and the memo gives what a fresh probe gives."""
    calls = []
    real = numerics.canary
    monkeypatch.setattr(numerics, "canary", lambda m: calls.append(1) or real(m))
    m = copy.deepcopy(model)
    first = numerics.profile(m)["canary"]
    assert numerics.profile(m)["canary"] == first and len(calls) == 1
    with torch.no_grad():
        next(m.parameters()).mul_(1.5)
    changed = numerics.profile(m)["canary"]
    assert len(calls) == 2 and changed != first and changed == real(m)
    base = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if base > 1 else 2)
        numerics.profile(m)
    finally:
        torch.set_num_threads(base)
    assert len(calls) == 3
