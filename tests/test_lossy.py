"""The lossy tier (codec vq_rans): rate, distortion, determinism, the spec's reconstruction, bad input."""

import struct

import numpy as np
import pytest
import torch

import kvcodec
from kvcodec.codecs import vq_rans as quant
from kvcodec.container import layout as L
from kvcodec.container.reader import KvzReader

from .common import check_rejects, fuzz_tools


def structured_cache(layers=2, heads=2, seq=96, dim=64, dtype=torch.bfloat16, seed=0):
    """Channel-structured vectors (per-channel scale and offset, a few outlier channels), like real caches."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(layers):
        pair = []
        for _ in range(2):
            scale = np.exp(rng.standard_normal((1, heads, 1, dim)))
            x = rng.standard_normal((1, heads, seq, dim)) * scale + rng.standard_normal((1, heads, 1, dim))
            pair.append(torch.from_numpy(x.astype(np.float32)).to(dtype))
        out.append(tuple(pair))
    return out


def _rel_mse(a, b):
    num = sum(float(((x.double() - y.double()) ** 2).sum()) for x, y in zip(a, b))
    return num / sum(float((y.double() ** 2).sum()) for y in b)


@pytest.mark.parametrize("d", [1, 2, 8, 64, 128, 256])
def test_fwht_numba_butterfly_equals_the_numpy_formulation(d):
    """The encoder's Numba butterfly gives the NumPy formulation's bits (the same binary32 operations)."""
    from kvcodec.codecs.hadamard import fwht, fwht_numpy

    x = (np.random.default_rng(d).standard_normal((37, d)) * np.exp(np.random.default_rng(0).normal(size=(37, 1))))
    x = x.astype(np.float32)
    assert np.array_equal(fwht(x).view(np.uint32), fwht_numpy(x).view(np.uint32))
    assert fwht(np.zeros((0, d), np.float32)).shape == (0, d)


def test_fwht_is_its_own_inverse_up_to_d():
    x = np.random.default_rng(1).standard_normal((5, 16)).astype(np.float32)
    assert np.allclose(quant.fwht(quant.fwht(x)) / 16, x, atol=1e-6)
    h = quant.fwht(np.eye(4, dtype=np.float32))
    assert (np.abs(h) == 1).all() and np.allclose(h @ h.T, 4 * np.eye(4))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rate_and_distortion_follow_bits(dtype):
    cache = structured_cache(dtype=dtype)
    kv = kvcodec.to_canonical(cache)
    comps = sum(t.numel() for t in kv.keys + kv.values)
    prev = None
    for bits in (2.0, 3.0, 4.0):
        data = kvcodec.encode(cache, tier="lossy", bits=bits, key_weight=1.0, sink=0)  # plain MSE allocation
        payload = sum(s["bytes"] for s in kvcodec.inspect(data)["sections"])
        rate = 8 * payload / comps
        assert rate <= bits + 0.15, (bits, rate)  # indices + norms + tables, at or below the target
        back = kvcodec.decode(data, output="kvcache")
        assert back.dtype == kv.dtype and [t.shape for t in back.keys] == [t.shape for t in kv.keys]
        err = _rel_mse(back.keys + back.values, kv.keys + kv.values)
        assert prev is None or err < prev / 2.5  # ~6 dB per bit for an entropy-coded uniform quantizer
        prev = err
    assert prev < 0.01
    # key_weight w: keys get a step sqrt(w) finer, so their error drops ~w-fold relative to the values'
    back = {w: kvcodec.decode(kvcodec.encode(cache, tier="lossy", bits=3.0, key_weight=w), output="kvcache")
            for w in (1.0, 16.0)}
    ratio = {w: _rel_mse(b.keys, kv.keys) / _rel_mse(b.values, kv.values) for w, b in back.items()}
    assert ratio[16.0] < ratio[1.0] / 8


def _splitmix_sign_bits(seed: int, d: int) -> list[int]:
    """Spec section 13, Sign_Rule 1, in plain integers."""
    m = (1 << 64) - 1
    out = []
    for i in range(d):
        z = (seed + (i + 1) * 0x9E3779B97F4A7C15) & m
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        out.append((z ^ (z >> 31)) >> 63)
    return out


@pytest.mark.parametrize("rule", [1, 0])
def test_decoding_is_deterministic_and_matches_the_spec_reconstruction(rule):
    """Rule 1 (SplitMix64 signs, format 1.2) as written; rule 0 (NumPy PCG64, files of format 1.1) by
    rewriting the payloads' Sign_Rule byte and the file's minor version, as a 1.1 writer stamped them."""
    cache = structured_cache(layers=1, heads=1, seq=10, dim=8, dtype=torch.float32)
    data = kvcodec.encode(cache, tier="lossy", bits=3.0, sink=0)
    if rule == 0:
        reseal = fuzz_tools().reseal
        b = bytearray(data)
        with KvzReader(data) as r:
            for e in r.sections:
                b[e.payload_offset + 3] = 0
        struct.pack_into("<H", b, 10, 1)
        data = reseal(bytes(b))
    a = kvcodec.decode(data, output="kvcache")
    b = kvcodec.decode(data, output="kvcache")
    assert a.equal(b)
    # an independent, scalar reimplementation of spec section 13 for the keys slice
    with KvzReader(data) as r:
        p = r.read_payload(r.entry(L.SECTION_KV, 0, L.PART_KEYS, 0))
    mode, method, k, sign_rule, exact, seed, step, norms_len = struct.unpack_from("<BBBBIQfI", p, 0)
    (off,) = struct.unpack_from("<i", p, 24)
    assert (mode, method, exact, sign_rule) == (1, 1, 0, rule)
    from kvcodec.codecs import float_ctx_rans as floatctx

    norms = floatctx.decode(memoryview(p)[28:28 + norms_len], (1, 1, 10, 1), "float16").view(np.float16)
    syms = np.empty((1, 10, 8), dtype=np.uint16)
    floatctx.decode_symbols(memoryview(p)[28 + norms_len:], syms, k, exact_payload=False, coded_bits=k)
    if rule == 1:
        draws = _splitmix_sign_bits(seed, 8)
    else:
        draws = np.random.Generator(np.random.PCG64(seed)).integers(0, 2, size=8, dtype=np.uint8)
    f32 = np.float32
    for t in range(10):
        z = [f32(int(syms[0, t, i]) + off) * f32(step) for i in range(8)]
        h = 1
        while h < 8:
            for blk in range(0, 8, 2 * h):
                for j in range(blk, blk + h):
                    z[j], z[j + h] = f32(z[j] + z[j + h]), f32(z[j] - z[j + h])
            h *= 2
        n = f32(norms[0, 0, t, 0])
        want = [f32(f32(z[i] * f32(-1.0 if draws[i] else 1.0)) * f32(1.0 / 8)) * n for i in range(8)]
        assert a.keys[0][0, 0, t].tolist() == [float(w) for w in want]


def test_sign_rules_differ_and_unknown_rule_is_refused():
    from pathlib import Path

    from kvcodec.codecs.hadamard import signs

    assert signs(7, 64, 1).tolist() != signs(7, 64, 0).tolist()
    assert [int(x < 0) for x in signs(0x6B767A, 32)] == _splitmix_sign_bits(0x6B767A, 32)
    spec = (Path(__file__).resolve().parent.parent / "spec" / "kvz.md").read_text()
    example = "".join("−" if x < 0 else "+" for x in signs(0x6B767A, 8))
    assert "`" + " ".join(c + "1" for c in example) + "`" in spec  # the example of spec section 13
    data = bytearray(kvcodec.encode(structured_cache(layers=1, heads=1, seq=6, dim=8), tier="lossy", sink=0))
    reseal = fuzz_tools().reseal
    with KvzReader(bytes(data)) as r:
        at = r.sections[0].payload_offset
    data[at + 3] = 2
    check_rejects(kvcodec.FormatError, reseal(bytes(data)), match="Sign_Rule")


def test_window_lloyd_and_inspect():
    cache = structured_cache(seq=50)
    kv = kvcodec.to_canonical(cache)
    data = kvcodec.encode(cache, tier="lossy", bits=2.0, window=16, chunk_tokens=20)
    back = kvcodec.decode(data, output="kvcache")
    for x, y in zip(back.keys + back.values, kv.keys + kv.values):
        assert torch.equal(x[:, :, -16:], y[:, :, -16:])  # the recent window is exact
        assert not torch.equal(x[:, :, :8], y[:, :, :8])
    info = kvcodec.inspect(data)
    assert info["tier"] == "lossy" and info["codec"]["id"] == "vq_rans" and info["format_version"] == "1.2"
    assert info["codec"]["params"]["window"] == 16
    lloyd = kvcodec.encode(cache, tier="lossy", quantizer="lloyd", lloyd_bits=3)
    err = _rel_mse(kvcodec.decode(lloyd, output="kvcache").keys, kv.keys)
    assert 0.01 < err < 0.06  # Gaussian Lloyd-Max at 3 bits: D = 0.0345 per unit-variance coordinate


def test_bad_options_and_payloads():
    check_rejects(kvcodec.ConfigError, structured_cache(dim=48), tier="lossy", match="power of two")
    check_rejects(kvcodec.ConfigError, structured_cache(), tier="lossy", bitz=3, match="unknown options")
    data = kvcodec.encode(structured_cache(layers=1, seq=20), tier="lossy", bits=3.0)
    with KvzReader(data) as r:
        e = r.entry(L.SECTION_KV, 0, L.PART_KEYS, 0)
        payload = r.read_payload(e)
    shape = (1, 2, 20, 64)
    for bad, field in ((b"\x03" + payload[1:], "VQ.Mode"), (payload[:1] + b"\x07" + payload[2:], "VQ.Method"),
                       (payload[:2] + b"\x0f" + payload[3:], "VQ.Symbol_Bits"),
                       (payload[:16] + struct.pack("<f", float("nan")) + payload[20:], "VQ.Step"),
                       # finite, but the butterfly would overflow to infinities and then CPU-dependent NaNs
                       (payload[:16] + struct.pack("<f", 3.0e38) + payload[20:], "VQ.Step"),
                       (payload[:-3], "VQ.Tail_Length"), (payload[:30], None)):
        with pytest.raises(kvcodec.FormatError) as ei:
            quant.decode(bad, shape, "bfloat16")
        assert field is None or ei.value.field == field


def test_sink_tokens_are_exact_in_mode_2():
    cache = structured_cache(layers=2, seq=40, dtype=torch.bfloat16)
    kv = kvcodec.to_canonical(cache)
    data = kvcodec.encode(cache, tier="lossy", bits=2.0, sink=3, window=4, chunk_tokens=16)
    back = kvcodec.decode(data, output="kvcache")
    for x, y in zip(back.keys + back.values, kv.keys + kv.values):
        assert torch.equal(x[:, :, :3], y[:, :, :3]) and torch.equal(x[:, :, -4:], y[:, :, -4:])
        assert not torch.equal(x[:, :, 3:8], y[:, :, 3:8])
    with KvzReader(data) as r:
        first = r.read_payload(r.entry(L.SECTION_KV, 1, L.PART_VALUES, 0))
        later = r.read_payload(r.entry(L.SECTION_KV, 1, L.PART_VALUES, 1))
    assert first[0] == 2 and struct.unpack_from("<I", first, 28)[0] == 3  # Mode 2, Head_Tokens 3
    assert later[0] == 1  # only the chunk holding the cache's first tokens has a head
    shape = (1, 2, 16, 64)
    for bad, field in ((first[:28] + struct.pack("<I", 0) + first[32:], "VQ.Head_Tokens"),
                       (first[:28] + struct.pack("<I", 17) + first[32:], "VQ.Head_Tokens"),
                       (first[:32] + struct.pack("<I", 1 << 30) + first[36:], "VQ.Head_Length"),
                       (first[:30], "VQ.Head_Tokens")):
        with pytest.raises(kvcodec.FormatError) as ei:
            quant.decode(bad, shape, "bfloat16")
        assert ei.value.field == field
    check_rejects(kvcodec.ConfigError, cache, tier="lossy", sink=-1, match="sink")


def test_kivi_keys_per_channel_values_per_token():
    cache = structured_cache(seq=70, dim=48)  # KIVI needs no power-of-two head dimension
    kv = kvcodec.to_canonical(cache)
    errs = []
    for b in (2, 4):
        data = kvcodec.encode(cache, tier="lossy", quantizer="kivi", kivi_bits=b, group=32, window=5, chunk_tokens=40)
        back = kvcodec.decode(data, output="kvcache")
        assert torch.equal(back.keys[0][:, :, -5:], kv.keys[0][:, :, -5:])
        errs.append((_rel_mse(back.keys, kv.keys), _rel_mse(back.values, kv.values)))
        # a per-token min-max with 2**b levels bounds every value error by half a step of its token's range
        v, w = back.values[0].float(), kv.values[0].float()
        rng = w.amax(-1, keepdim=True) - w.amin(-1, keepdim=True)
        assert bool(((v - w).abs()[:, :, :-5] <= rng[:, :, :-5] / (2 * (2 ** b - 1)) * 1.01 + 2e-2).all())
    assert errs[1][0] < errs[0][0] / 8 and errs[1][1] < errs[0][1] / 8


def test_cachegen_per_token_max_abs_with_layer_bins():
    cache = structured_cache(layers=4, seq=30, dim=24, dtype=torch.float16)
    kv = kvcodec.to_canonical(cache)
    data = kvcodec.encode(cache, tier="lossy", quantizer="cachegen", cachegen_bins=[32, 8], cachegen_key_fine=0.5,
                          cachegen_value_fine=0.25)
    back = kvcodec.decode(data, output="kvcache")
    for li in range(4):
        for part, (x, y) in enumerate(((back.keys[li], kv.keys[li]), (back.values[li], kv.values[li]))):
            fine = li < (2 if part == 0 else 1)
            half = 15 if fine else 3
            mx = y.float().abs().amax(dim=(1, 3), keepdim=True)  # per token, over heads and channels
            err = (x.float() - y.float()).abs()
            assert bool((err <= mx / half / 2 * 1.01 + 1e-3).all()), (li, part)
    check_rejects(kvcodec.ConfigError, cache, tier="lossy", quantizer="cachegen", cachegen_bins=[2, 16])


def test_max_kl_calibrates_the_step_with_the_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    from .common import check_rejects, model_cache

    torch.manual_seed(3)  # sharp next-token distributions (large init), so that KL reacts to the step
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.4)).eval()
    cache = model_cache(model, torch.randint(0, 64, (1, 48)))
    comps = sum(t.numel() for t in kvcodec.to_canonical(cache).keys + kvcodec.to_canonical(cache).values)
    rates = {}
    for mk in (0.05, 0.003):
        data = kvcodec.encode(cache, model, tier="lossy", max_kl=mk)
        params = kvcodec.inspect(data)["codec"]["params"]
        assert params["max_kl"] == mk and params["calibrated_kl"] <= mk
        rates[mk] = 8 * sum(s["bytes"] for s in kvcodec.inspect(data)["sections"]) / comps
        kvcodec.decode(data)  # decodes without the model
    assert rates[0.003] > rates[0.05] + 0.5
    check_rejects(kvcodec.ConfigError, cache, model, tier="lossy", max_kl=1e-9, match="not reachable")
    check_rejects(kvcodec.ConfigError, cache, tier="lossy", max_kl=0.01, match="needs the model")


def test_weighted_study_pieces():
    """kvcodec.lab.study_weighted (issue 15's direction 1): the weighted transform decodes to within half a step
    in weighted units, the RoPE-pair average is a per-channel weight equal on each pair, and the front keeps
    only points no other point beats."""
    from kvcodec.cache import KVCache
    from kvcodec.lab import study_weighted as sw

    g = torch.Generator().manual_seed(0)
    keys = [torch.randn(1, 2, 40, 8, generator=g) for _ in range(2)]
    values = [torch.randn(1, 2, 40, 8, generator=g) for _ in range(2)]
    kv = KVCache(keys, values)
    c = torch.randn(2, 8, 8, generator=g, dtype=torch.float64)
    c = c @ c.transpose(1, 2) + 0.1 * torch.eye(8, dtype=torch.float64)
    pc = sw.rope_pair_average(c)
    d = torch.diagonal(pc, dim1=-2, dim2=-1)
    assert torch.equal(pc, torch.diag_embed(d)) and torch.equal(d[:, :4], d[:, 4:])
    a, ai = sw.sqrt_and_inverse(c)
    assert torch.allclose(a @ a, c, atol=1e-9) and torch.allclose(a @ ai, torch.eye(8, dtype=torch.float64), atol=1e-9)
    w = {li: (a, ai) for li in range(2)}
    nbytes, rec = sw.transformed(kv, (w, None), 0.05, 0.05)
    for x, y in zip(kv.keys, rec.keys):
        assert torch.equal(x[:, :, :1], y[:, :, :1])  # token 0 exact
        err = torch.einsum("hde,bhte->bhtd", a, (y - x).double())[:, :, 1:]
        assert err.abs().max() <= 0.025 + 1e-5
    for x, y in zip(kv.values, rec.values):
        assert (x - y).abs().max() < 0.1
    assert nbytes > 0
    assert sw.front([(2.0, 0.5), (1.0, 1.0), (3.0, 0.6), (2.5, 0.2)]) == [(1.0, 1.0), (2.0, 0.5), (2.5, 0.2)]
    assert abs(sw.interp([(1.0, 0.1), (3.0, 0.001)], 2.0) - 0.01) < 1e-12


def _weighted_case(seq=40, dim=8, seed=3):
    rng = np.random.default_rng(seed)
    cache = kvcodec.KVCache([k for k, _ in structured_cache(layers=2, heads=2, seq=seq, dim=dim, dtype=torch.float32,
                                                             seed=seed)],
                            [v for _, v in structured_cache(layers=2, heads=2, seq=seq, dim=dim,
                                                            dtype=torch.float32, seed=seed + 1)])
    profile = kvcodec.Profile([rng.uniform(0.1, 4.0, (2, dim)).astype(np.float32) for _ in range(2)])
    return cache, profile


def test_weighted_keys_use_per_channel_steps_within_half_a_step():
    """Quantizer "weighted": keys in Method 5 with the steps step * key_ratio / w (float16), values in Method 1;
    every quantized key component is within half its channel's step; the file is stamped 1.5 (earlier ones
    keep their minor version); decoding needs no profile."""
    from kvcodec.codecs.vq_rans import channel_steps

    cache, profile = _weighted_case()
    data = kvcodec.encode(cache, tier="lossy", quantizer="weighted", step=0.2, key_ratio=0.5, profile=profile)
    assert struct.unpack_from("<H", data, 10)[0] == 5
    assert struct.unpack_from("<H", kvcodec.encode(cache, tier="lossy", step=0.2), 10)[0] == 2
    out = kvcodec.decode(data, output="kvcache")
    info = kvcodec.inspect(data)
    methods = [s["coding"]["quantizer"] for s in info["sections"] if s["type"] == "kv"]
    assert methods == ["channel", "uniform"] * 2
    for li in range(2):
        st = torch.from_numpy(channel_steps(0.2, 0.5, profile.key_weights[li]).astype(np.float32))
        err = (out.keys[li] - cache.keys[li])[:, :, 1:].abs()  # token 0: the exact sink (Mode 2)
        assert (err <= st[None, :, None, :] / 2 * (1 + 1e-6)).all()
        assert torch.equal(out.keys[li][:, :, :1], cache.keys[li][:, :, :1])
        assert 0 < float(err.max()) and float((out.values[li] - cache.values[li]).abs().max()) > 0
    # a finer key_ratio: finer keys, the values as they were
    fine = kvcodec.decode(kvcodec.encode(cache, tier="lossy", quantizer="weighted", step=0.2, key_ratio=0.1,
                                         profile=profile), output="kvcache")
    assert _rel_mse(fine.keys, cache.keys) < _rel_mse(out.keys, cache.keys) / 10
    assert all(torch.equal(a, b) for a, b in zip(fine.values, out.values))


def test_weighted_meets_bits_and_refuses_bad_profiles():
    cache, profile = _weighted_case(seq=512, dim=64)
    data = kvcodec.encode(cache, tier="lossy", quantizer="weighted", bits=3.0, profile=profile)
    comps = sum(t.numel() for t in cache.keys + cache.values)
    payload = sum(s["bytes"] for s in kvcodec.inspect(data)["sections"] if s["type"] == "kv")
    assert 2.5 < 8 * payload / comps < 3.3  # the exact sink tokens are counted here, not in the budget
    check_rejects(kvcodec.ConfigError, cache, tier="lossy", quantizer="weighted", bits=3, match="needs profile")
    check_rejects(kvcodec.ConfigError, cache, tier="lossy", bits=3, profile=profile, match="for quantizer")
    bad = kvcodec.Profile([w[:, :8] for w in profile.key_weights])
    check_rejects(kvcodec.ConfigError, cache, tier="lossy", quantizer="weighted", profile=bad, match="layer 0")
    short = kvcodec.Profile(profile.key_weights[:1])
    check_rejects(kvcodec.ConfigError, cache, tier="lossy", quantizer="weighted", profile=short, match="layers")
    check_rejects(kvcodec.ConfigError, cache, tier="lossy", quantizer="weighted", profile=profile, key_ratio=0,
                  match="key_ratio")
    bad = kvcodec.KVCache([k.clone() for k in cache.keys], cache.values)
    bad.keys[1][0, 1, 7, 3] = float("inf")
    for q, extra in (("weighted", {"profile": profile}), ("uniform", {})):
        check_rejects(kvcodec.ConfigError, bad, tier="lossy", quantizer=q, bits=3, match="layer 1 keys: a value is "
                      "not finite", **extra)


def test_hostile_method_5_fields_are_refused_by_name():
    cache, profile = _weighted_case()
    data = kvcodec.encode(cache, tier="lossy", quantizer="weighted", step=0.2, sink=0, profile=profile)
    reseal = fuzz_tools().reseal
    with KvzReader(data) as r:
        at = r.sections[0].payload_offset
    steps_at = at + 28  # fixed fields (24) + Index_Offset (4)
    for value, field in ((0.0, "Channel_Steps"), (float("inf"), "Channel_Steps"), (-1.0, "Channel_Steps"),
                         (float("nan"), "Channel_Steps")):
        bad = bytearray(data)
        bad[steps_at + 6:steps_at + 8] = np.float16(value).tobytes()
        check_rejects(kvcodec.FormatError, reseal(bytes(bad)), match=field)
    bad = bytearray(data)
    bad[at + 8] = 1  # Seed must be 0 for Method 5
    check_rejects(kvcodec.FormatError, reseal(bytes(bad)), match="Seed")
    bad = bytearray(data)
    bad[at + 20] = 1  # Norms_Length must be 0
    check_rejects(kvcodec.FormatError, reseal(bytes(bad)), match="Norms_Length")
    old = bytearray(data)
    old[10:12] = struct.pack("<H", 4)  # a Method 5 payload in a file stamped 1.4
    err = check_rejects(kvcodec.FormatError, reseal(bytes(old)), match="stamped 1.4")
    assert err.field == "VQ.Method"


def test_calibrate_profiles_pairs_and_json():
    """kvcodec.calibrate: one weight per KV head and key channel, equal on each rotary pair (Llama layout), not
    averaged without RoPE (GPT-2); a profile survives JSON and a hostile one is refused by name."""
    from .common import tiny_model

    ids = torch.randint(0, 128, (1, 48), generator=torch.Generator().manual_seed(0))
    llama = tiny_model("llama")
    p = kvcodec.calibrate(llama, ids)
    kv_heads = llama.config.num_key_value_heads
    d = llama.config.hidden_size // llama.config.num_attention_heads
    assert len(p.key_weights) == llama.config.num_hidden_layers and p.tokens == 48
    for w in p.key_weights:
        assert w.shape == (kv_heads, d) and (w > 0).all()
        assert np.array_equal(w[:, : d // 2], w[:, d // 2:])
    g = kvcodec.calibrate(tiny_model("gpt2"), ids)
    assert any(not np.array_equal(w[:, : w.shape[1] // 2], w[:, w.shape[1] // 2:]) for w in g.key_weights)
    back = kvcodec.Profile.from_json(p.to_json())
    assert back.model == p.model and all(np.array_equal(a, b) for a, b in zip(back.key_weights, p.key_weights))
    import json

    obj = json.loads(p.to_json())
    for mutate, field in ((lambda o: o.update(format="x"), "Profile.format"),
                          (lambda o: o.update(version=2), "Profile.version"),
                          (lambda o: o["key_weights"][0][0].__setitem__(0, -1.0), "Profile.key_weights"),
                          (lambda o: o["key_weights"].__setitem__(1, "x"), "Profile.key_weights")):
        o = json.loads(json.dumps(obj))
        mutate(o)
        with pytest.raises(kvcodec.FormatError) as ei:
            kvcodec.Profile.from_json(json.dumps(o))
        assert ei.value.field.startswith(field)
    with pytest.raises(kvcodec.FormatError):
        kvcodec.Profile.from_json("{")
    with pytest.raises(kvcodec.ConfigError, match="tokenizer"):
        kvcodec.calibrate(llama)


@pytest.mark.parametrize("d", [4, 8, 64, 128])
def test_fused_reconstruction_kernels_match_the_spec_arithmetic(d):
    """The Numba reconstruction (one pass per token vector) gives the bits of the spec's binary32 expressions,
    written here in NumPy in the spec's order: Methods 1 and 2 (butterfly, signs, 1/D, norm) and Method 5."""
    from kvcodec.codecs import _vq_numba
    from kvcodec.codecs.hadamard import fwht_numpy as fwht
    from kvcodec.codecs.hadamard import signs

    rng = np.random.default_rng(d)
    n = 37
    syms = rng.integers(0, 16, size=(n, d)).astype(np.uint16)
    norms = (rng.random(n) * 40).astype(np.float16).astype(np.float32)
    sign = signs(0x6B767A, d)
    step, lo = np.float32(0.3183), -7
    cb = rng.standard_normal(16).astype(np.float32)
    for use_cb in (False, True):
        z = cb[syms] if use_cb else (syms.astype(np.int64) + lo).astype(np.float32) * step
        want = (fwht(z) * sign[None, :] * np.float32(1.0 / d)) * norms[:, None]
        got = np.empty((n, d), np.float32)
        _vq_numba.rotate_back(syms, 0 if use_cb else lo, step, cb, use_cb, sign, np.float32(1.0 / d), norms, got)
        assert got.view(np.uint32).tolist() == want.astype(np.float32).view(np.uint32).tolist()
    steps = (rng.random((3, d)) + 0.01).astype(np.float16).astype(np.float32)
    s3 = rng.integers(0, 40, size=(6, 5, d)).astype(np.uint16)
    want = (s3.reshape(2, 3, 5, d).astype(np.int64) + lo).astype(np.float32) * steps[None, :, None, :]
    got = np.empty((6, 5, d), np.float32)
    _vq_numba.channel_dequant(s3, lo, steps, got)
    assert np.array_equal(got.reshape(2, 3, 5, d).view(np.uint32), want.view(np.uint32))
    # written straight into a slice of the output: float32 bits, and bfloat16 rounded as f32_to_bf16 does
    bits32 = np.zeros((2, 3, 9, d), np.uint32)
    _vq_numba.channel_dequant_into(s3, lo, steps, bits32[:, :, 2:7])
    assert np.array_equal(bits32[:, :, 2:7], want.view(np.uint32)) and not bits32[:, :, [0, 1, 7, 8]].any()
    bf, want_bf = np.zeros((2, 3, 9, d), np.uint16), np.zeros((2, 3, 9, d), np.uint16)
    _vq_numba.channel_dequant_into(s3, lo, steps, bf[:, :, 2:7])
    _vq_numba.f32_to_bf16(want.view(np.uint32), want_bf[:, :, 2:7])
    assert np.array_equal(bf, want_bf)


def test_bf16_rounding_equals_torch_on_every_non_nan():
    """The decoder rounds float32 reconstructions to bfloat16 itself (round to nearest even, spec section 13):
    the same bits as torch's conversion for random bit patterns, ties, infinities, subnormals and signed zeros."""
    from kvcodec.codecs._vq_numba import f32_to_bf16

    rng = np.random.default_rng(0)
    u = rng.integers(0, 2**32, size=(2, 3, 500, 64), dtype=np.uint64).astype(np.uint32)
    u[0, 0, 0, :9] = [0x7F800000, 0xFF800000, 0x7F7FFFFF, 0x00000001, 0x80000000, 0x3F808000, 0x3F818000,
                      0x3F807FFF, 0xFF7FFFFF]
    f = u.view(np.float32)
    ok = ~np.isnan(f)
    out = np.zeros((2, 3, 510, 64), np.uint16)
    f32_to_bf16(u, out[:, :, 7:507])  # a slice along the tokens, as the decoder writes it
    want = torch.from_numpy(f.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(out[:, :, 7:507][ok], want[ok])
    nan = out[:, :, 7:507][~ok]
    assert ((nan & 0x7F80) == 0x7F80).all() and ((nan & 0x7F) != 0).all()  # NaNs stay NaN
    assert not out[:, :, :7].any() and not out[:, :, 507:].any()


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("d", [64, 128])
def test_vector_reconstruction_equals_the_scalar_kernels(d, fused, monkeypatch):
    """The vector reconstruction (``_rotate_simd``: one token per vector register) gives the scalar kernels' bits
    - float32, and bfloat16 rounded to nearest even - written into a strided slice of a larger output, including
    all-zero tokens, values that overflow to infinity and butterflies that make NaN (a hostile Step: the bfloat16
    kernel with its NaN case; the others take the one without); the butterfly as fused multiply-adds (where the
    CPU has them) and as adds, subtracts and blends."""
    from kvcodec.codecs import _rotate_simd, _vq_numba
    from kvcodec.codecs.hadamard import signs

    monkeypatch.setattr(_rotate_simd, "FUSED", fused)

    if not _rotate_simd.usable(np.zeros((1, 1, d), np.uint16), 0, np.zeros((1, 1, 1, d), np.uint16)):
        pytest.skip("no vector kernels on this machine")
    rng = np.random.default_rng(d)
    b, h, t = 2, 3, 45
    sign = signs(0x6B767A, d)
    for step, lo, top in [(0.3183, -7, 16), (1.7e-3, -300, 700), (3.0e38, -2, 4), (0.05, 2**31 - 65536, 65535),
                          (0.5, 0, 1)]:
        syms = rng.integers(0, top, size=(b * h, t, d)).astype(np.uint16)
        norms = (rng.random((b * h, t)) * 60000).astype(np.float16).astype(np.float32)
        norms[0, :3] = [0.0, 6.1e-5, 65504.0]
        assert _rotate_simd._finite(lo, step, norms) == (step < 1e38)
        want = np.empty((b * h * t, d), np.float32)
        _vq_numba.rotate_back(syms.reshape(-1, d), lo, np.float32(step), np.zeros(1, np.float32), False, sign,
                              np.float32(1.0 / d), norms.reshape(-1), want)
        want = want.reshape(b, h, t, d)
        want_bf = np.zeros((b, h, t + 9, d), np.uint16)
        _vq_numba.f32_to_bf16(want.view(np.uint32), want_bf[:, :, 4:4 + t])
        got32 = np.zeros((b, h, t + 9, d), np.uint32)
        got_bf = np.zeros((b, h, t + 9, d), np.uint16)
        for out in (got32, got_bf):
            assert _rotate_simd.usable(syms, lo, out[:, :, 4:4 + t])
            _rotate_simd.rotate(syms, lo, np.float32(step), sign, 1.0 / d, norms, out[:, :, 4:4 + t])
        np.testing.assert_array_equal(got32[:, :, 4:4 + t], want.view(np.uint32))
        np.testing.assert_array_equal(got_bf, want_bf)  # the head and tail rows untouched (zeros)
        assert not got32[:, :, :4].any() and not got32[:, :, 4 + t:].any()
    view = got32[:, :, 4:4 + t]
    assert _rotate_simd.usable(syms, 2**31 - 65536, view) and _rotate_simd.usable(syms, -(2**31), view)
    assert not _rotate_simd.usable(syms, 2**31 - 65535, view)  # symbol + offset could leave 32 bits
    assert not _rotate_simd.usable(syms, -(2**31) - 1, view)
    frozen = view.copy()
    frozen.flags.writeable = False
    assert not _rotate_simd.usable(syms, 0, frozen)  # never written through a pointer
    with pytest.raises(ValueError, match="usable"):
        _rotate_simd.rotate(syms, 0, np.float32(1.0), sign, 1.0 / d, norms, got32)  # the whole array: wrong shape
    with pytest.raises(ValueError, match="usable"):  # signs must be +-1 (the fused form folds them into 1 / D)
        _rotate_simd.rotate(syms, 0, np.float32(1.0), sign * 2, 1.0 / d, norms, view)
    # the kernel without the NaN case only for a positive finite step within the bound and finite norms
    for step, lo in ((-0.5, 0), (float("nan"), 0), (float("inf"), 0), (2.0 ** 95, 0), (2.0 ** 80, -(2 ** 31))):
        assert not _rotate_simd._finite(lo, step, norms), (step, lo)
    assert not _rotate_simd._finite(0, 1.0, np.array([[1.0, np.inf]], np.float32))
    assert _rotate_simd._finite(-(2 ** 31), 2.0 ** 78, norms)
    # where the CPU has FMA, the fused form is what runs: the compiled kernel holds fused multiply-adds
    from kvcodec.entropy import _lanes_simd

    features = _lanes_simd._target()[1].split(",")
    assert ("vfmadd" in _rotate_simd.assembly(d, True, True)) == (fused and "+fma" in features)


def test_rate_search_counts_like_numpy(monkeypatch):
    """The rate search's one-pass index counts (Numba) pick the step the NumPy formulation picks (``python``
    backend: ``np.rint(sample / step)`` counted by value), on samples of every scale and size, with repeated
    values and one value only."""
    rng = np.random.default_rng(5)
    samples = [(rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 1)).astype(np.float32)
               for n in (1, 7, 1000, 300_000)]
    samples += [np.full(50, 0.3, np.float32), np.round(rng.standard_normal(5000), 1).astype(np.float32)]
    def unique_entropy(q):  # the formulation before the one-pass counts
        _, cnt = np.unique(q, return_counts=True)
        p = cnt / cnt.sum()
        return float(-(p * np.log2(p)).sum())

    for z in samples:
        for rate in (0.05, 1.0, 2.5, 7.0):
            got = quant.step_for_rate(z, rate)
            with monkeypatch.context() as mp:
                mp.setenv("KVCODEC_BACKEND", "python")
                assert quant.step_for_rate(z, rate) == got
        for st in 2.0 ** np.linspace(-12, 6, 37):  # the entropies themselves, against np.unique's counts
            st = np.float32(st)
            want = unique_entropy(np.rint(z / st))
            assert quant.entropy_bits(np.rint(z / st)) == want
            assert quant._index_entropy(z, st, z.min(), z.max()) == want


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("d", [64, 128])
def test_vector_forward_rotation_equals_the_numpy_formulation(d, fused, monkeypatch):
    """The encoder's forward rotation as vector code (``_rotate_simd.norms``: the binary64 norms in NumPy's
    pairwise order; ``_rotate_simd.forward``: divide by the float16 norm, signs, Walsh-Hadamard butterfly,
    ``rint(z / step)`` ties to even, in one pass) gives the NumPy formulation's bits:
    rows of every scale, a zero row, norms that round to float16 subnormals or overflow to infinity, exact ties
    of ``z / step`` at .5, and steps from tiny to huge; the butterfly fused or not (:func:`_rotate_simd._butterfly`)."""
    from kvcodec.codecs import _rotate_simd

    monkeypatch.setattr(_rotate_simd, "FUSED", fused)

    if not _rotate_simd.forward_usable(d):
        pytest.skip("no vector kernels on this machine")
    rng = np.random.default_rng(d + 1)
    x = (rng.standard_normal((300, d)) * 10.0 ** rng.uniform(-9, 5, size=(300, 1))).astype(np.float32)
    x[0] = 0.0
    x[1] = 0.0
    x[1, 3] = 3e-8  # the norm rounds to a float16 subnormal
    x[2, :] = 1e5  # the norm overflows float16: u = 0
    x[3] = 0.0
    x[3, 0] = 7.0  # u = e_0, z = +-1 everywhere: with step 2, z / step = +-0.5, a tie (to even: 0)
    for step in (np.float32(2.0 ** -12), np.float32(0.0371), np.float32(2.0), np.float32(2.0 / 3.0),
                 np.float32(3.0e38)):
        got = quant.directions_q(x, 0x6B767A, step)
        got_z = quant.directions(x, 0x6B767A)
        with monkeypatch.context() as mp:
            mp.setenv("KVCODEC_VECTOR", "0")
            want = quant.directions_q(x, 0x6B767A, step)
            want_z = quant.directions(x, 0x6B767A)
        np.testing.assert_array_equal(got[0].view(np.uint16), want[0].view(np.uint16))
        np.testing.assert_array_equal(got[1], want[1])
        np.testing.assert_array_equal(got_z[1].view(np.uint32), want_z[1].view(np.uint32))
    # the float64 norms before their float16 rounding: NumPy's pairwise order, rows of mixed magnitudes
    y = (rng.standard_normal((4000, d)) * 10.0 ** rng.uniform(-6, 6, size=(4000, d))).astype(np.float32)
    np.testing.assert_array_equal(_rotate_simd.norms(y), np.linalg.norm(y.astype(np.float64), axis=1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lossy_decode_is_the_same_with_and_without_vector_kernels(dtype, monkeypatch):
    """A head dimension the vector reconstruction takes (64), with exact head (sink) and tail (window) tokens
    around the quantized ones: KVCODEC_VECTOR=0 (scalar kernels) decodes the same bits."""
    from kvcodec.codecs import _rotate_simd

    cache = structured_cache(layers=2, seq=70, dtype=dtype)
    calls = []
    real = _rotate_simd.rotate
    monkeypatch.setattr(_rotate_simd, "rotate", lambda *a: (calls.append(a[0].shape), real(*a))[1])
    for chunk in (32, 4096):  # chunks of a layer, and one chunk that is the layer's whole output
        data = kvcodec.encode(cache, tier="lossy", bits=2.5, sink=3, window=5, chunk_tokens=chunk)
        monkeypatch.delenv("KVCODEC_VECTOR", raising=False)
        calls.clear()
        a = kvcodec.decode(data, output="kvcache")
        if _rotate_simd.usable(np.zeros((1, 1, 64), np.uint16), 0, np.zeros((1, 1, 1, 64), np.uint16)):
            assert calls, "the vector reconstruction did not run"
        monkeypatch.setenv("KVCODEC_VECTOR", "0")
        calls.clear()
        b = kvcodec.decode(data, output="kvcache")
        assert not calls and a.equal(b)
    kv = kvcodec.to_canonical(cache)
    assert torch.equal(a.keys[0][:, :, :3], kv.keys[0][:, :, :3]) and torch.equal(a.keys[0][:, :, -5:],
                                                                                  kv.keys[0][:, :, -5:])


def test_a_codebook_that_would_overflow_the_reconstruction_is_refused():
    """Method 2: a finite codebook value large enough for the butterfly to overflow binary32 (and then make
    CPU-dependent NaNs) is refused by name (spec section 13, 1.6.2), as Method 1's Step is."""
    data = kvcodec.encode(structured_cache(layers=1, seq=20), tier="lossy", quantizer="lloyd", lloyd_bits=3, sink=0)
    with KvzReader(data) as r:
        payload = bytearray(r.read_payload(r.entry(L.SECTION_KV, 0, L.PART_KEYS, 0)))
    assert payload[0] == 1 and payload[1] == 2  # Mode 1, Method 2: the codebook follows the fixed fields
    at = quant._FIXED.size + 4
    quant.decode(bytes(payload), (1, 2, 20, 64), "bfloat16")  # as written: fine
    payload[at:at + 4] = struct.pack("<f", 3.0e38)
    with pytest.raises(kvcodec.FormatError) as ei:
        quant.decode(bytes(payload), (1, 2, 20, 64), "bfloat16")
    assert ei.value.field == "VQ.Codebook"


def test_index_streams_scale_bits_follow_the_alphabet(monkeypatch):
    """The reference encoder codes index streams of up to 2**8 symbols with Scale_Bits 8 (spec revision 1.8.3:
    their tables fit a level-1 cache), wider ones (and CacheGen's) with 10; each stream states its own."""
    from kvcodec.codecs import float_ctx_rans as floatctx

    def scale_bits(data) -> dict:  # Symbol_Bits -> the Scale_Bits of the index streams (no raw bits) read
        seen, real = {}, floatctx.parse_symbols

        def spy(*args, **kwargs):
            st, used = real(*args, **kwargs)
            if st.lowbits == 0:
                seen.setdefault(st.kbits, set()).add(st.scale_bits)
            return st, used

        monkeypatch.setattr(floatctx, "parse_symbols", spy)
        kvcodec.decode(data, output="kvcache")
        monkeypatch.setattr(floatctx, "parse_symbols", real)
        return seen

    kv = structured_cache(layers=1, heads=2, seq=64, dim=16, dtype=torch.float32)
    narrow = scale_bits(kvcodec.encode(kv, tier="lossy", bits=2.0, sink=0))
    assert narrow and all(k <= 8 and sb == {8} for k, sb in narrow.items())
    wide = scale_bits(kvcodec.encode(kv, tier="lossy", step=0.03, sink=0))  # a fine step: >= 9-bit symbols
    assert any(k > 8 for k in wide) and all(sb == ({10} if k > 8 else {8}) for k, sb in wide.items())
    cachegen = scale_bits(kvcodec.encode(kv, tier="lossy", quantizer="cachegen", sink=0))
    assert cachegen and all(sb == {10} for sb in cachegen.values())


@pytest.mark.parametrize("d", [64, 128])
def test_method_5_vector_dequantization_equals_the_numba_kernel(d, monkeypatch):
    """Method 5's vector kernel (``_rotate_simd.dequant``) writes the bits of ``channel_dequant_into`` into a
    slice of the output (float32 and bfloat16 words), for extreme float16 steps and offsets near the 32-bit
    bound, and falls back to it when ``symbol + offset`` could leave 32 bits; a whole weighted file decodes to
    the same tensors with KVCODEC_VECTOR=0."""
    from kvcodec.codecs import _rotate_simd, _vq_numba

    rng = np.random.default_rng(d)
    h, t = 3, 37
    syms = rng.integers(0, 4096, size=(2 * h, t, d)).astype(np.uint16)
    steps = (rng.random((h, d)) + 0.01).astype(np.float16).astype(np.float32)
    steps[0, :4] = [65504.0, 2.0 ** -24, 1.0, 2.0 ** -14]  # float16's largest, smallest subnormal, 1, smallest normal
    if not _rotate_simd.dequant_usable(syms, 0, steps, np.zeros((2, h, t, d), np.uint16)):
        pytest.skip("no vector kernels on this machine")
    for word in (np.uint16, np.uint32):
        for lo in (-2048, 0, -(2 ** 31), 2 ** 31 - 4096 - 65536):
            want, got = np.zeros((2, h, t + 4, d), word), np.zeros((2, h, t + 4, d), word)
            _vq_numba.channel_dequant_into(syms, lo, steps, want[:, :, 2:t + 2])
            assert _rotate_simd.dequant_usable(syms, lo, steps, got[:, :, 2:t + 2])
            _rotate_simd.dequant(syms, lo, steps, got[:, :, 2:t + 2])
            assert np.array_equal(got, want), (word, lo)
    assert not _rotate_simd.dequant_usable(syms, 2 ** 31 - 1000, steps, got[:, :, 2:t + 2])
    cache, profile = _weighted_case(seq=50, dim=d)
    calls, real = [], _rotate_simd.dequant
    monkeypatch.setattr(_rotate_simd, "dequant", lambda *a: (calls.append(1), real(*a))[1])
    for dtype in (torch.bfloat16, torch.float32):
        cast = kvcodec.KVCache([k.to(dtype) for k in cache.keys], [v.to(dtype) for v in cache.values])
        data = kvcodec.encode(cast, tier="lossy", quantizer="weighted", step=1.0, profile=profile)
        calls.clear()
        monkeypatch.delenv("KVCODEC_VECTOR", raising=False)
        a = kvcodec.decode(data, output="kvcache")
        assert calls, "the vector dequantization did not run"
        monkeypatch.setenv("KVCODEC_VECTOR", "0")
        b = kvcodec.decode(data, output="kvcache")
        assert a.equal(b)
