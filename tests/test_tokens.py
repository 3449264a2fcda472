"""Token channel building blocks: recovery from layer-0 values, LM coding with chunk checksums."""

import pytest
import torch

import kvcodec
from kvcodec.tokens import LMTokenCoder, layer0_value_table, recover_tokens
from kvcodec.tokens.lm import TokenStream
from kvcodec.tokens.recover import min_pairwise_distance, position_free_part, recover

from .common import VOCAB, model_cache, tiny_model


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral_sw"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recover_tokens_exactly(kind, dtype):
    model = tiny_model(kind, dtype)
    ids = torch.randint(0, VOCAB, (2, 30))
    kv = kvcodec.to_canonical(model_cache(model, ids))
    r = recover_tokens(kv.values[0], model)
    s = kv.values[0].shape[2]  # a sliding-window layer keeps only the last tokens
    assert r.ok, r.reason
    assert torch.equal(r.tokens, ids[:, -s:])


def test_recovery_does_not_depend_on_position():
    """A cache continued after a prefix (not starting at position 0) still identifies its tokens."""
    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (1, 40))
    kv = kvcodec.to_canonical(model_cache(model, ids))
    tail = kv.values[0][:, :, 25:]
    r = recover_tokens(tail, model)
    assert r.ok and torch.equal(r.tokens, ids[:, 25:])


def test_modified_cache_is_refused_not_guessed():
    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (1, 20))
    v0 = kvcodec.to_canonical(model_cache(model, ids)).values[0]
    noisy = v0 + 0.2 * v0.abs().mean() * torch.randn_like(v0)  # like a coarse quantizer
    r = recover_tokens(noisy, model)
    assert not r.ok and r.tokens is None and "modified" in r.reason


def test_duplicate_vocab_rows_resolve_to_one_token():
    model = tiny_model("llama")
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[7] = emb[3]  # tokens 3 and 7 now have identical KV everywhere
    ids = torch.tensor([[7, 1, 3, 7, 2]])
    r = recover_tokens(kvcodec.to_canonical(model_cache(model, ids)).values[0], model)
    assert r.ok and r.tokens.tolist() == [[3, 1, 3, 3, 2]]
    d, dups = min_pairwise_distance(layer0_value_table(model))
    assert dups == 1 and d > 0


@pytest.mark.parametrize("kind", ["gpt2", "opt", "opt_post_ln"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_absolute_position_models_recover_by_inversion(kind, dtype):
    """Learned positions added to the embedding (pre-LN GPT-2 / OPT, post-LN OPT-350m): the position's part is
    removed by inverting the first layer, every position matches, and the re-run layer agrees."""
    model = tiny_model(kind, dtype)
    ids = torch.randint(0, VOCAB, (2, 40))
    kv = kvcodec.to_canonical(model_cache(model, ids))
    r = recover(kv, model)
    assert r.ok and r.method == "absolute", r.reason
    assert torch.equal(r.tokens, ids)
    r = recover_tokens(kv.values[0][:, :, :, :].roll(1, dims=2), model)  # positions shuffled: must not match
    assert not r.ok and r.tokens is None


@pytest.mark.parametrize("kind,part", [("llama", "values"), ("phi3", "values"), ("gemma2", "values"),
                                       ("deepseek_v3", "keys"), ("gpt2", None)])
def test_the_position_free_part_is_found_by_running_the_model(kind, part):
    """Fused projections (Phi-3), scaled embeddings (Gemma) and MLA (DeepSeek-V3: the latent sits in the keys
    slot, the rotary part in the values slot) need no code of their own; absolute positions have none."""
    assert position_free_part(tiny_model(kind)) == part


@pytest.mark.parametrize("kind", ["phi3", "gemma2", "deepseek_v3", "gpt_neox", "falcon"])
def test_recovery_runs_the_models_own_first_layer(kind):
    model = tiny_model(kind, torch.bfloat16)
    ids = torch.randint(0, VOCAB, (1, 7))  # shorter than Gemma 2's window: layer 0 holds every token
    kv = kvcodec.to_canonical(model_cache(model, ids))
    r = recover(kv, model)
    assert r.ok and r.method == "table", r.reason
    assert torch.equal(r.tokens, ids)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_lm_coder_round_trip_and_size(kind):
    model = tiny_model(kind)
    ids = torch.randint(0, VOCAB, (300,))
    coder = LMTokenCoder(model, chunk_tokens=64)
    stream = coder.encode(ids)
    assert torch.equal(coder.decode(stream), ids)
    assert len(stream.chunk_checksums) == 5
    # within the range coder's flush of the ideal code length
    assert stream.nbytes <= stream.cross_entropy_bits / 8 * 1.005 + 16


def test_lm_decoder_with_other_numerics_fails_at_a_chunk():
    a, b = tiny_model("llama"), tiny_model("llama")
    with torch.no_grad():
        for p in b.parameters():  # another model: other probabilities everywhere
            p.mul_(1.5)
    ids = torch.randint(0, VOCAB, (200,))
    stream = LMTokenCoder(a, chunk_tokens=50).encode(ids)
    with pytest.raises(kvcodec.ChecksumMismatch, match="token chunk"):
        LMTokenCoder(b, chunk_tokens=50).decode(stream)


def test_lm_truncated_stream_is_detected():
    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (120,))
    coder = LMTokenCoder(model, chunk_tokens=40)
    s = coder.encode(ids)
    short = TokenStream(s.words[: max(1, s.words.size // 2)], s.num_tokens, s.chunk_tokens, s.chunk_checksums)
    with pytest.raises(kvcodec.KvzError):
        coder.decode(short)
    with pytest.raises(kvcodec.FormatError):
        coder.decode(TokenStream(s.words, s.num_tokens, s.chunk_tokens, s.chunk_checksums[:-1]))


@pytest.mark.slow
def test_smollm2_tokens_recovered_and_coded_near_cross_entropy(smollm2):
    from kvcodec.lab.common import demo_text
    from kvcodec.models import prefill, tokenize

    model, tok = smollm2
    ids = tokenize(tok, demo_text(), 96)
    kv = kvcodec.to_canonical(prefill(model, ids))
    r = recover_tokens(kv.values[0], model)
    assert r.ok and torch.equal(r.tokens, ids)
    stream = LMTokenCoder(model).encode(ids[0])
    assert stream.nbytes <= stream.cross_entropy_bits / 8 * 1.005 + 16
    assert stream.nbytes * 8 / ids.shape[1] < 8  # fluent English: a few bits per token


def test_static_coder_round_trip_and_adaptivity():
    from kvcodec.tokens.static import StaticTokenCoder

    rng = torch.Generator().manual_seed(3)
    pattern = torch.randint(0, 1000, (20,), generator=rng)
    ids = pattern.repeat(30)  # a repetitive text: the adaptive model must learn it
    coder = StaticTokenCoder(50000, chunk_tokens=100)
    s = coder.encode(ids)
    assert torch.equal(coder.decode(s), ids)
    assert s.nbytes * 8 <= s.cross_entropy_bits * 1.01 + 64
    assert s.nbytes * 8 / ids.numel() < 2.5  # vs log2(50000) = 15.6 bits for an unadaptive code
    bad = s.words.copy()
    bad[len(bad) // 2] ^= 1
    with pytest.raises(kvcodec.KvzError):
        coder.decode(TokenStream(bad, s.num_tokens, s.chunk_tokens, s.chunk_checksums))


def test_static_coder_frequencies_are_integers():
    from kvcodec.tokens.static import StaticTokenCoder

    model = StaticTokenCoder(300)._distributions()
    f = next(model)
    for t in [5, 7, 5, 7, 5, 9]:
        assert (f == torch.from_numpy(f).floor().numpy()).all() and f.min() >= 1 and f.max() < 2**53
        f = model.send(t)


def test_recording_cache_records_generate_schedule_and_replay_is_bit_exact():
    from kvcodec.tokens import RecordingCache
    from kvcodec.tokens.plan import cache_kwarg
    from kvcodec.tokens.schedule import expand, runs

    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (1, 12))
    rec = RecordingCache()
    out = model.generate(ids, **{cache_kwarg(model): rec}, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert runs(rec.schedule) == [[12, 1], [1, 5]]  # prefill, then one call per new token (the last is not cached)
    assert expand(runs(rec.schedule)) == rec.schedule
    # replaying the recorded schedule over the same tokens regenerates the cache bit for bit
    tokens = out[:, :sum(rec.schedule)]
    replay = RecordingCache()
    pos = 0
    with torch.no_grad():
        for n in rec.schedule:
            model(tokens[:, pos:pos + n], use_cache=True, **{cache_kwarg(model): replay})
            pos += n
    assert kvcodec.to_canonical(replay).equal(kvcodec.to_canonical(rec))
