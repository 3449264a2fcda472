"""Public API on tiny random HF models (Llama, Qwen2, Mistral, GPT-2 layouts)."""

import copy
import json

import pytest
import torch

import kvcodec

from .common import VOCAB, check_rejects, check_roundtrip, greedy_from, model_cache, random_cache, tiny_model

LAYOUTS = ["llama", "qwen2", "qwen2_mixed", "mistral_sw", "gpt2"]


@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_model_cache_round_trip_bit_identical(kind, dtype):
    model = tiny_model(kind, dtype)
    ids = torch.randint(0, VOCAB, (2, 21))  # batch 2; longer than the sliding windows
    cache = model_cache(model, ids)
    data = check_roundtrip(cache, model)  # sliding-window layers keep their window and cumulative length too
    back = kvcodec.decode(data, model, output="kvcache")
    assert kvcodec.encode(back, model) == data  # canonical: re-encoding gives the same bytes


@pytest.mark.parametrize("kind", LAYOUTS)
def test_generation_continues_identically(kind):
    model = tiny_model(kind)
    ids = torch.randint(0, VOCAB, (2, 21))
    cache = model_cache(model, ids[:, :-1])
    restored = kvcodec.decode(kvcodec.encode(cache, model), model)
    a, b = greedy_from(model, ids, cache, restored, 12)
    assert torch.equal(a, b)
    fresh = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(a, fresh)  # sanity: the cache path is the normal path


def test_different_lengths_per_layer_are_kept():
    model = tiny_model("qwen2_mixed")
    cache = model_cache(model, torch.randint(0, VOCAB, (1, 30)))
    kv = kvcodec.to_canonical(cache)
    assert kv.keys[0].shape[2] == 30 and kv.keys[1].shape[2] < 30
    check_roundtrip(cache, chunk_tokens=7)


def test_legacy_tuple_and_kvcache_inputs():
    legacy = random_cache(layers=3, batch=2, heads=2, seq=9, dim=4)
    data = kvcodec.encode(legacy)
    out = kvcodec.decode(data, output="legacy")
    assert isinstance(out, tuple) and len(out) == 3
    for (k, v), (k2, v2) in zip(legacy, out):
        assert torch.equal(k.view(torch.int16), k2.view(torch.int16))
        assert torch.equal(v.view(torch.int16), v2.view(torch.int16))
    dyn = kvcodec.decode(data)
    assert type(dyn).__name__ == "DynamicCache" and dyn.get_seq_length() == 9


def test_different_v_head_dim():
    check_roundtrip([(torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 3))])


def test_tokens_and_start_position_stored():
    kv = kvcodec.KVCache(*zip(*random_cache(layers=1, seq=5)), tokens=torch.tensor([[5, 6, 7, 8, 9]]),
                         start_position=11)
    kv.keys, kv.values = list(kv.keys), list(kv.values)
    back = kvcodec.decode(kvcodec.encode(kv), output="kvcache")
    assert back.tokens.tolist() == [[5, 6, 7, 8, 9]] and back.start_position == 11


@pytest.mark.parametrize("bad,err", [
    ([(torch.randn(1, 2, 5, 4), torch.randn(1, 2, 6, 4))], ValueError),  # seq mismatch
    ([(torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4).half())], TypeError),  # mixed dtype
    ([(torch.randn(1, 2, 5, 4).double(), torch.randn(1, 2, 5, 4).double())], TypeError),  # float64
    ([(torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)), (torch.randn(2, 2, 5, 4), torch.randn(2, 2, 5, 4))],
     ValueError),  # batch differs across layers
    ([(torch.randn(2, 5, 4), torch.randn(2, 5, 4))], ValueError),  # 3-d
    ("not a cache", TypeError),
    ([], ValueError),
])
def test_unsupported_caches_raise_clear_errors(bad, err):
    check_rejects(err, bad)


def test_quantized_cache_layers_are_refused():
    from transformers.cache_utils import DynamicCache, DynamicLayer

    class FakeQuantizedLayer:  # not a DynamicLayer: must not be silently read
        keys = torch.zeros(1, 1, 1, 1)
        values = torch.zeros(1, 1, 1, 1)

    c = DynamicCache()
    c.layers = [FakeQuantizedLayer()]
    check_rejects(kvcodec.UnsupportedCache, c, match="not supported")
    c.layers = [DynamicLayer()]  # never filled
    check_rejects(ValueError, c, match="uninitialised")


def test_transformers_quantized_cache_is_refused_not_truncated():
    """Quantized layers keep their tokens outside layer.keys/values (quanto's kept 7 of 31 there): reading keys
    and values would store part of the cache.  It must be refused by name (regression; fp8 needs no extra
    package, quanto and HQQ layers are subclasses of the same BaseQuantizedLayer)."""
    from transformers.cache_utils import QuantizedCache

    from kvcodec.tokens.plan import cache_kwarg

    m = tiny_model("llama")
    qc = QuantizedCache(backend="fp8", config=m.config)
    ids = torch.randint(0, VOCAB, (1, 31))
    with torch.no_grad():
        m(ids[:, :24], use_cache=True, **{cache_kwarg(m): qc})
        for j in range(24, 31):
            m(ids[:, j:j + 1], use_cache=True, **{cache_kwarg(m): qc})
    assert qc.get_seq_length() == 31
    check_rejects(kvcodec.UnsupportedCache, qc, match="Fp8QuantizedLayer")
    with pytest.raises(kvcodec.UnsupportedCache):
        kvcodec.encode(qc, m)  # the token tiers read the cache through the same adapter


@pytest.mark.parametrize("name", ["QuantoQuantizedLayer", "HQQQuantizedLayer"])
def test_quanto_and_hqq_layers_are_refused_by_name(name):
    """quanto and HQQ need packages this project does not install, so their layers are made without running
    their constructors: whatever they hold, the adapter refuses them by class before reading anything."""
    import transformers.cache_utils as cu
    from transformers.cache_utils import DynamicCache

    layer = object.__new__(getattr(cu, name))
    layer.keys = layer.values = torch.zeros(1, 1, 7, 4)  # what such a layer shows: its unquantized tail only
    layer.is_initialized = True
    c = DynamicCache()
    c.layers = [layer]
    check_rejects(kvcodec.UnsupportedCache, c, match=name)


@pytest.mark.parametrize("layer_class", ["indexed subclass", "subclass", "linear subclass"])
def test_layers_with_extra_state_are_refused(layer_class):
    """A subclass of a supported layer may hold state its parent's tensors do not show (an attention, an
    indexed or a state-space layer): refused by name, with the list of what is stored."""
    import transformers.cache_utils as cu
    from transformers.cache_utils import DynamicCache, DynamicLayer

    k = torch.randn(1, 2, 5, 4)
    if layer_class == "subclass":
        layer = type("MyLayer", (DynamicLayer,), {})()
    elif layer_class == "linear subclass":
        layer = type("MyMambaLayer", (cu.LinearAttentionLayer,), {})()
        layer.update_conv_state(torch.randn(1, 6, 4))
    else:
        layer = type("MyIndexedLayer", (cu.DynamicIndexedLayer,), {})()
    if layer_class != "linear subclass":
        layer.lazy_initialization(k, k)
        layer.keys, layer.values = k, k.clone()
    c = DynamicCache()
    c.layers = [DynamicLayer(), layer]
    c.layers[0].lazy_initialization(k, k)
    c.layers[0].keys, c.layers[0].values = k, k
    check_rejects(kvcodec.UnsupportedCache, c, match="layer 1: .*(Layer|MyLayer).*stores DynamicLayer, ")
    with pytest.raises(kvcodec.ConfigError):  # the CLI's one-line class of errors
        kvcodec.encode(c)
    c.layers = c.layers[:1]  # the known class alone is stored
    check_roundtrip(c)


def test_model_fingerprint_and_mismatch():
    m1, m2 = tiny_model("llama"), tiny_model("qwen2")
    cache = model_cache(m1, torch.randint(0, VOCAB, (1, 6)))
    m3 = copy.deepcopy(m1)
    with torch.no_grad():
        next(m3.parameters())[0, 0] += 1e-3  # one weight changed: another model
    for tier in ("lossless", "exact", "tokens"):
        data = kvcodec.encode(cache, m1, tier=tier)
        info = kvcodec.inspect(data)
        assert info["model"]["fingerprint"] == kvcodec.model_fingerprint(m1)
        assert info["tier"] == tier
        kvcodec.decode(data, m1)
        if tier == "lossless":
            kvcodec.decode(data)  # the lossless tier does not need the model
        else:
            check_rejects(kvcodec.ConfigError, data, match="decode\\(data, model\\)")
        check_rejects(kvcodec.ModelMismatch, data, m2)
        check_rejects(kvcodec.ModelMismatch, data, m3)


def test_save_load_paths_and_fsspec(tmp_path):
    cache = random_cache(layers=2, seq=12)
    p = tmp_path / "c.kvz"
    n = kvcodec.save(p, cache, chunk_tokens=5)
    assert p.stat().st_size == n and [q.name for q in tmp_path.iterdir()] == ["c.kvz"]
    assert kvcodec.load(p, output="kvcache").equal(kvcodec.to_canonical(cache))
    kvcodec.save("memory://bucket/c.kvz", cache)
    assert kvcodec.load("memory://bucket/c.kvz", output="kvcache").equal(kvcodec.to_canonical(cache))
    assert kvcodec.inspect("memory://bucket/c.kvz")["num_layers"] == 2


def test_failed_save_leaves_no_file(tmp_path):
    p = tmp_path / "x.kvz"
    with pytest.raises(TypeError):
        kvcodec.save(p, [(torch.randn(1, 1, 2, 2), torch.randn(1, 1, 2, 2).half())])
    assert list(tmp_path.iterdir()) == []


def test_inspect_is_json_and_header_only():
    data = kvcodec.encode(random_cache(layers=2, seq=8), tokens=torch.arange(8).unsqueeze(0))
    info = kvcodec.inspect(data)
    json.dumps(info)
    assert info["num_layers"] == 2 and info["tokens"] == 8 and info["has_token_ids"]
    assert [s["type"] for s in info["sections"]] == ["tokens", "kv", "kv", "kv", "kv"]
    # a corrupted payload does not disturb inspect (it never reads payloads) unless asked to verify
    bad = bytearray(data)
    first_kv = info["sections"][1]
    bad[first_kv["offset"] + 45] ^= 1
    assert kvcodec.inspect(bytes(bad))["num_layers"] == 2
    with pytest.raises(kvcodec.ChecksumMismatch):
        kvcodec.inspect(bytes(bad), verify_checksums=True)


def test_threads_do_not_change_bytes():
    cache = random_cache(layers=5, seq=20)
    assert kvcodec.encode(cache, threads=1, chunk_tokens=6) == kvcodec.encode(cache, threads=4, chunk_tokens=6)
    data = kvcodec.encode(cache)
    assert kvcodec.decode(data, threads=1, output="kvcache").equal(kvcodec.decode(data, threads=3, output="kvcache"))


def test_bad_options():
    check_rejects(kvcodec.ConfigError, random_cache(), tier="exact", match="needs the model")
    check_rejects(kvcodec.ConfigError, random_cache(), chunk_tokens=0, match="chunk_tokens")
    check_rejects(kvcodec.ConfigError, random_cache(), colour="red", match="unknown options")
    check_rejects(kvcodec.ConfigError, random_cache(), tier="nonesuch", match="unknown tier")
    check_rejects(kvcodec.ConfigError, random_cache(), tolerance=1e-3, match="unknown options")


def test_encoder_is_reusable_and_equals_encode():
    enc = kvcodec.Encoder(tier="lossless", chunk_tokens=4, ways=4)
    a, b = random_cache(seed=1), random_cache(seed=2)
    assert enc.encode(a) == kvcodec.encode(a, tier="lossless", chunk_tokens=4, ways=4)
    assert enc.encode(b) == kvcodec.encode(b, tier="lossless", chunk_tokens=4, ways=4)
    assert enc.tier_for(None) == "lossless" and kvcodec.Encoder().tier_for(object()) == "exact"
    assert kvcodec.Encoder(tolerance=1e-3).tier_for(object()) == "tokens"


from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@given(st.data())
def test_round_trip_property(data):
    """Any shapes, dtypes, chunkings and codec options round-trip bit-exactly and re-encode identically."""
    dtype = data.draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    nl = data.draw(st.integers(1, 3))
    b, h = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3))
    seed = data.draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    cache = []
    for _ in range(nl):
        s = data.draw(st.integers(0, 30))
        kd, vd = data.draw(st.integers(1, 9)), data.draw(st.integers(1, 9))
        scale = data.draw(st.sampled_from([1e-4, 1.0, 300.0]))
        cache.append(((torch.randn(b, h, s, kd, generator=g) * scale).to(dtype),
                      (torch.randn(b, h, s, vd, generator=g) * scale).to(dtype)))
    kv = kvcodec.KVCache([k for k, _ in cache], [v for _, v in cache])
    opts = {"chunk_tokens": data.draw(st.sampled_from([1, 4, 7, 4096])),
            "ways": data.draw(st.sampled_from([1, 3, 4, 8])),
            "context": data.draw(st.sampled_from(["prev", "none"]))}
    blob = check_roundtrip(kv, **opts)
    assert kvcodec.encode(kvcodec.decode(blob, output="kvcache"), **opts) == blob
    assert kvcodec.inspect(blob)["num_layers"] == nl


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_static_cache_stores_its_valid_positions_and_restores_into_either_class(kind):
    """Issue 12: a StaticCache (torch.compile, cache_implementation="static") holds max_cache_len slots of
    which cumulative_length are written: only those are stored; decode gives a DynamicCache or, with
    KVCache.to_static_cache, a StaticCache again, and generate() continues identically from both."""
    from transformers.cache_utils import StaticCache

    from kvcodec.tokens.plan import cache_kwarg

    model = tiny_model(kind)
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(0))
    sc = StaticCache(config=model.config, max_cache_len=32)
    with torch.no_grad():
        model(ids, use_cache=True, **{cache_kwarg(model): sc})
    kv = kvcodec.to_canonical(sc)
    assert [k.shape[2] for k in kv.keys] == [10] * kv.num_layers
    nxt = torch.cat([ids, torch.randint(0, VOCAB, (1, 1))], 1)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    want = model.generate(nxt, **{cache_kwarg(model): copy.deepcopy(sc)}, **kw)
    for data in (kvcodec.encode(sc), kvcodec.encode(sc, model)):  # lossless, exact
        back = kvcodec.decode(data, model, output="kvcache")
        assert back.equal(kv)
        assert torch.equal(model.generate(nxt, **{cache_kwarg(model): back.to_static_cache(model.config, 32)}, **kw),
                           want)
        assert torch.equal(model.generate(nxt, **{cache_kwarg(model): back.to_dynamic_cache()}, **kw), want)
    check_rejects(kvcodec.ConfigError, kvcodec.encode(sc), fn=lambda d: kvcodec.decode(
        d, output="kvcache").to_static_cache(model.config, 4), match="max_cache_len=4")


def test_static_sliding_window_layers_are_refused_by_name():
    from transformers.cache_utils import StaticCache

    from kvcodec.tokens.plan import cache_kwarg

    model = tiny_model("mistral_sw")
    sc = StaticCache(config=model.config, max_cache_len=32)
    with torch.no_grad():
        model(torch.randint(0, VOCAB, (1, 12)), use_cache=True, **{cache_kwarg(model): sc})
    check_rejects(kvcodec.UnsupportedCache, sc, match="StaticSlidingWindowLayer|Sliding")


@pytest.mark.parametrize("kind,tier", [("llama", "lossless"), ("mistral_sw", "lossless"), ("qwen2", "lossy"),
                                       ("llama", "exact")])
def test_decode_into_writes_the_callers_tensors(kind, tier):
    """decode(into=cache): the decoded tensors are written into that cache's tensors (the direct tiers decode
    straight into them, the token tiers copy theirs in) and the returned cache holds them; the result is the
    one a plain decode gives, for a DynamicCache, a KVCache or legacy pairs as the destination."""
    from kvcodec import scratch

    model = tiny_model(kind, torch.bfloat16)
    cache = model_cache(model, torch.randint(0, VOCAB, (2, 21)))
    data = kvcodec.encode(cache, model, tier=tier, **({"bits": 8} if tier == "lossy" else {}))
    want = kvcodec.decode(data, model, output="kvcache")
    for form in ("dynamic", "kvcache", "legacy"):
        buf = kvcodec.decode(data, model, output=form)  # a restore of the same shape, kept as a buffer
        dest = kvcodec.to_canonical(buf)
        for t in dest.keys + dest.values:
            t.fill_(float("nan"))
        got = kvcodec.decode(data, model, output="kvcache", into=buf)
        assert got.equal(want)
        assert got.sliding_window == want.sliding_window and got.cumulative_length == want.cumulative_length
        assert [t.data_ptr() for t in got.keys + got.values] == [t.data_ptr() for t in dest.keys + dest.values]
        assert kvcodec.to_canonical(buf).equal(want)  # the destination itself holds the values
    dyn = kvcodec.decode(data, model, into=want)  # output="dynamic" by default
    assert kvcodec.to_canonical(dyn).equal(kvcodec.decode(data, model, output="kvcache"))
    assert scratch.outstanding() == 0


def test_decode_into_refuses_what_does_not_fit():
    """into= is checked against the file before anything is written: layer count, shape, dtype, layout,
    autograd, tensors sharing memory; a failed decode leaves no scratch buffer handed out."""
    from kvcodec import scratch

    cache = random_cache(layers=2, heads=2, seq=16, dim=8)
    data = kvcodec.encode(cache)
    fresh = lambda: kvcodec.decode(data, output="kvcache")  # noqa: E731
    short = random_cache(layers=2, heads=2, seq=15, dim=8)
    cases = [
        (random_cache(layers=3, heads=2, seq=16, dim=8), "3 layers, the file 2"),
        (short, r"layer 0 keys is torch.bfloat16 \[1, 2, 15, 8\], the file's is torch.bfloat16 \[1, 2, 16, 8\]"),
        (random_cache(layers=2, heads=2, seq=16, dim=8, dtype=torch.float32), "layer 0 keys is torch.float32"),
        ("not a cache", "into= takes a cache"),
    ]
    bad = fresh()
    bad.keys[1] = bad.keys[1].transpose(2, 3).contiguous().transpose(2, 3)
    cases.append((bad, "layer 1 keys must be a C-contiguous CPU tensor"))
    bad = fresh()
    bad.values[0] = bad.values[0].clone().requires_grad_()
    cases.append((bad, "layer 0 values must be .* requires_grad: True"))
    bad = fresh()
    bad.values[1] = bad.keys[1]
    cases.append((bad, "layer 1 keys and layer 1 values share memory"))
    for into, match in cases:
        with pytest.raises(kvcodec.ConfigError, match=match):
            kvcodec.decode(data, output="kvcache", into=into)
    bad = bytearray(data)
    info = kvcodec.inspect(data)
    sec = info["sections"][-1]
    bad[sec["offset"] + sec["bytes"] - 3] ^= 0x40  # inside the last payload: its checksum fails
    with pytest.raises(kvcodec.FormatError):
        kvcodec.decode(bytes(bad), output="kvcache", into=fresh())
    assert scratch.outstanding() == 0
