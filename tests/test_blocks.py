"""Token model ``blocks`` (procedure ``lm-blocks-v1``, format 1.9) and the default token model ``auto``."""

from __future__ import annotations

import pytest
import torch

import kvcodec
from kvcodec.tokens.blocks import BlockTokenCoder

from .common import VOCAB, check_rejects, fuzz_tools, recorded_generate, tiny_model

header_of, with_header, reseal = fuzz_tools().header_of, fuzz_tools().with_header, fuzz_tools().reseal


def _blocks_file(model=None, block=4):
    model = model or tiny_model("llama")
    torch.manual_seed(7)
    ids = torch.randint(1, VOCAB, (1, 23))
    rec, _ = recorded_generate(model, ids, 6)
    return model, rec, kvcodec.encode(rec, model, token_model="blocks", block_tokens=block)


@pytest.mark.parametrize("kind", ["llama", "qwen2_mixed", "gpt2", "gemma3", "falcon_h1"])
@pytest.mark.parametrize("block", [1, 3, 16, 64])
def test_blocks_round_trip_bit_identical(kind, block):
    model = tiny_model(kind)
    torch.manual_seed(1)
    ids = torch.randint(1, VOCAB, (2, 19))
    rec, out = recorded_generate(model, ids, 5)
    data = kvcodec.encode(rec, model, token_model="blocks", block_tokens=block, tokens=out[:, :-1])
    assert data[8:12] == bytes([1, 0, 12, 0])  # stamped 1.12: blocks (1.9) and model.weights (1.12)
    info = kvcodec.inspect(data)["token_channel"]
    assert info["token_model"] == "blocks" and info["procedure"]["block_tokens"] == block
    back = kvcodec.decode(data, model, output="kvcache")
    assert back.equal(kvcodec.to_canonical(rec))
    assert back.tokens.tolist() == out[:, :-1].tolist()  # the last generated token is not in the cache


def test_padded_rows_are_cut_into_their_own_blocks():
    model = tiny_model("llama")
    torch.manual_seed(2)
    ids = torch.randint(1, VOCAB, (3, 14))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[2, :9] = 0
    ids[1, :5] = 0
    ids[2, :9] = 0
    rec, _ = recorded_generate(model, ids, 4, attention_mask=mask)
    full = torch.cat([mask, torch.ones(3, 3, dtype=mask.dtype)], 1)  # the 3 generated tokens in the cache
    data = kvcodec.encode(rec, model, token_model="blocks", block_tokens=4, attention_mask=full)
    assert kvcodec.inspect(data)["token_channel"]["padding"] == [0, 5, 9]
    assert kvcodec.decode(data, model, output="kvcache").equal(kvcodec.to_canonical(rec))


def test_the_coder_makes_block_length_minus_one_calls():
    model = tiny_model("llama")
    calls = []
    model.register_forward_hook(lambda m, i, o: calls.append(1))
    rows = [torch.randint(0, VOCAB, (n,)) for n in (10, 3, 0)]
    coder = BlockTokenCoder(model, 4, 256)
    streams = coder.encode(rows)
    assert len(calls) == 3  # blocks of 4, 4, 2 and 3: steps 0..3, calls after steps 0, 1, 2
    calls.clear()
    out = coder.decode(streams)
    assert len(calls) == 3 and [o.tolist() for o in out] == [r.tolist() for r in rows]


def test_corrupt_blocks_stream_is_a_checksum_mismatch_naming_the_row_and_chunk():
    from .test_tokentier import _rewrite, flip_stream_words

    model, _rec, data = _blocks_file()
    with pytest.raises((kvcodec.ChecksumMismatch, kvcodec.FormatError)) as ei:
        kvcodec.decode(_rewrite(data, flip_stream_words), model)
    assert ei.value.field.startswith("Token_Stream")


@pytest.mark.parametrize("edit, error, field", [
    (lambda h: h["tokens"]["procedure"].pop("block_tokens"), kvcodec.FormatError, "block_tokens"),
    (lambda h: h["tokens"]["procedure"].update(block_tokens=0), kvcodec.FormatError, "block_tokens"),
    (lambda h: h["tokens"]["procedure"].update(block_tokens=True), kvcodec.FormatError, "block_tokens"),
    (lambda h: h["tokens"]["procedure"].update(block_tokens=1 << 17), kvcodec.LimitExceeded, "block_tokens"),
    (lambda h: h["tokens"]["procedure"].update(id="lm-schedule-v1"), kvcodec.UnknownId, "procedure.id"),
])
def test_hostile_blocks_headers_are_refused_by_name(edit, error, field):
    _model, _rec, data = _blocks_file()
    h = header_of(data)
    edit(h)
    check_rejects(error, with_header(data, h), fn=kvcodec.inspect, match=field)


def test_a_blocks_file_stamped_before_1_9_is_refused():
    _model, _rec, data = _blocks_file()
    h = header_of(data)
    del h["model"]["weights"]  # (1.12) without it, blocks alone decide the version
    data = with_header(data, h)
    old = reseal(data[:10] + bytes([8, 0]) + data[12:])
    check_rejects(kvcodec.FormatError, old, fn=kvcodec.inspect, match="1.9")


def test_blocks_streams_need_the_encoders_thread_count_even_without_multi_token_calls():
    model = tiny_model("llama")
    ids = torch.randint(1, VOCAB, (1, 9))
    cache = kvcodec.to_canonical(recorded_generate(model, ids, 3)[0])
    data = kvcodec.encode(cache, model, token_model="blocks", block_tokens=4, schedule=[[1, 11]])
    h = header_of(data)
    h["tokens"]["procedure"]["numerics"]["threads"] += 1
    check_rejects(kvcodec.NumericsMismatch, with_header(data, h), model, match="threads")


def test_default_token_model_is_chosen_per_cache_and_recorded():
    model = tiny_model("llama")
    torch.manual_seed(3)
    ids = torch.randint(1, VOCAB, (1, 40))
    rec, _ = recorded_generate(model, ids, 8)
    enc = kvcodec.Encoder()
    data = enc.encode(rec, model)
    tc = kvcodec.inspect(data)["token_channel"]
    assert tc["token_model"] in ("static", "blocks") and enc.last_report["token_model"] == tc["token_model"]
    assert set(enc.last_report["auto"]) == {"prefill_seconds", "estimated_decode_seconds"}
    assert kvcodec.encode(rec, model) == data  # one process encodes one cache the same way
    assert kvcodec.decode(data, model, output="kvcache").equal(kvcodec.to_canonical(rec))
    check_rejects(kvcodec.ConfigError, rec, model, token_model="blockz", match="auto")
