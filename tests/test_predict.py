"""kvcodec.predict: the arithmetic of predicted lossy files (spec/kvz.md 13.1), the predictors, their fit, the
tier and the store with them."""

import numpy as np

from kvcodec import predict as P


def test_rope_recurrence_is_accurate_and_position_consistent():
    theta = 1.0 / (10000 ** (np.arange(0, 64, 2) / 64))
    c, s = P.rope_tables(np.cos(theta), np.sin(theta), 1.0, 0, 4096)
    t = np.arange(4096)[:, None] * theta[None]
    assert np.abs(c - np.cos(t)).max() < 1e-6 and np.abs(s - np.sin(t)).max() < 1e-6
    c2, s2 = P.rope_tables(np.cos(theta), np.sin(theta), 1.0, 100, 50)  # a cache starting at position 100
    assert np.array_equal(c2, c[100:150]) and np.array_equal(s2, s[100:150])
    c3, _ = P.rope_tables(np.cos(theta), np.sin(theta), 0.5, 0, 10)
    assert np.array_equal(c3, c[:10] * np.float32(0.5))


def test_rotation_and_its_inverse():
    theta = 1.0 / (500 ** (np.arange(0, 16, 2) / 16))
    c, s = P.rope_tables(np.cos(theta), np.sin(theta), 1.0, 0, 33)
    x = np.random.default_rng(0).normal(size=(2, 33, 16)).astype(np.float32)
    y = P.rotate(x, c, s)
    assert y.dtype == np.float32 and np.abs(np.linalg.norm(y, axis=-1) - np.linalg.norm(x, axis=-1)).max() < 1e-5
    assert np.abs(P.rotate(y, c, s, inverse=True) - x).max() < 1e-5
    assert np.array_equal(y[:, 0], x[:, 0])  # position 0: no rotation


def test_parallel_predictions_equal_serial_and_leave_torch_threads_alone(monkeypatch):
    """Predictions on every core give the serial bits, for any thread count, and do not change torch's thread
    count (Numba's OpenMP layer did: the token tiers record that count in their numerics)."""
    import torch

    rng = np.random.default_rng(3)
    x = rng.normal(size=(83, 24)).astype(np.float32)
    w = rng.normal(size=(24, 16)).astype(np.float16)
    b = rng.normal(size=16).astype(np.float16)
    want = P.predict(x, w, b, parallel=False)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for n in ("1", "3", "16"):
            monkeypatch.setenv("KVCODEC_THREADS", n)
            assert np.array_equal(P.predict(x, w, b), want)
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_predict_follows_the_specified_binary32_order():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(7, 13)).astype(np.float32)
    w = rng.normal(size=(13, 5)).astype(np.float16)
    b = rng.normal(size=5).astype(np.float16)
    want = np.broadcast_to(b.astype(np.float32), (7, 5)).copy()
    for i in range(13):  # acc = acc + x[i] * W[i], each product and sum rounded to binary32
        want = (want + (x[:, i:i + 1] * w[i].astype(np.float32)).astype(np.float32)).astype(np.float32)
    assert np.array_equal(P.predict(x, w, b), want)


def test_fit_and_code_layers_round_trip_on_a_structured_cache():
    rng = np.random.default_rng(2)
    h, t, d, nl = 2, 40, 8, 3
    theta = 1.0 / (100 ** (np.arange(0, d, 2) / d))
    c, s = P.rope_tables(np.cos(theta), np.sin(theta), 1.0, 0, t)
    base = rng.normal(size=(h, t, d)).astype(np.float32)
    layers = []
    for li in range(nl):  # layers that are linear images of one another: predictable
        pre = (base * (li + 1) + rng.normal(size=base.shape) * 0.1).astype(np.float32)
        layers.append((P.rotate(pre, c, s), (pre * 0.5 + rng.normal(size=base.shape) * 0.1).astype(np.float32)))
    kw = [np.ones((h, d), np.float32)] * nl
    pred = P.fit([layers], np.cos(theta), np.sin(theta), 1.0, kw, 0.5)
    assert len(pred.keys) == nl and pred.keys[0][0].shape == (0, h * d)
    assert pred.values[1][0].shape == (2 * h * d, h * d)
    sizes, rec = P.code_layers(layers, pred, 0.5, kw)
    for (k, v), (rk, rv) in zip(layers, rec):
        assert np.array_equal(rk[:, 0], k[:, 0]) and np.array_equal(rv[:, 0], v[:, 0])  # token 0 exact
        assert np.abs(rk - k).max() < 0.2 and np.abs(rv - v).max() < 1.0
    plain, _ = P.code_layers(layers, P.Predictors([(np.zeros((0 if i == 0 else h * d, h * d), np.float16),
                                                    np.zeros(h * d, np.float16)) for i in range(nl)],
                                                  [(np.zeros((h * d if i == 0 else 2 * h * d, h * d), np.float16),
                                                    np.zeros(h * d, np.float16)) for i in range(nl)],
                                                  np.cos(theta), np.sin(theta)), 0.5, kw)
    assert sum(map(sum, sizes[1:])) < 0.8 * sum(map(sum, plain[1:]))  # prediction pays on predictable layers


def _tiny_predictors():
    import pytest
    import torch

    from kvcodec import calibrate
    from tests.common import tiny_model

    model = tiny_model("llama")
    ids = torch.randint(0, model.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    prof = calibrate(model, ids)
    with pytest.warns(UserWarning, match="calibration tokens"):  # 76 tokens: too few for its inputs, and said so
        pred = P.calibrate_predictors(model, [ids, ids[:, :30]], profile=prof)
    return model, prof, pred


def test_calibrated_predictors_round_trip_through_their_file():
    model, prof, pred = _tiny_predictors()
    cfg = model.config
    width = cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    assert len(pred.keys) == cfg.num_hidden_layers and pred.values[0][0].shape == (width, width)
    data = P.to_bytes(pred)
    back = P.from_bytes(data)
    for a, b in zip(pred.keys + pred.values, back.keys + back.values):
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert np.array_equal(back.cos_theta, pred.cos_theta) and back.scale == pred.scale and back.meta == pred.meta
    assert P.identity(data) == P.identity(P.to_bytes(back)) and len(P.identity(data)) == 64


def test_hostile_predictor_files_are_refused_by_field():
    import pytest

    from kvcodec.errors import FormatError

    _, _, pred = _tiny_predictors()
    data = P.to_bytes(pred)
    for bad, field in ((data[:5], "Predictors"), (data[:-10], "Predictors"), (b"\xff" * 8 + data[8:], "header"),
                       (P.to_bytes(P.Predictors(pred.keys[:1], pred.values[:1] + pred.values[1:2], pred.cos_theta,
                                                pred.sin_theta)), "Predictors"),
                       (P.to_bytes(P.Predictors([(pred.keys[0][0], pred.keys[0][1][:-1])] + pred.keys[1:],
                                                pred.values, pred.cos_theta, pred.sin_theta)), "keys.0")):
        with pytest.raises(FormatError, match=field):
            P.from_bytes(bad)
    nan = [(w, b.copy()) for w, b in pred.values]
    nan[1][1][0] = np.float16("nan")
    with pytest.raises(FormatError, match="values.1"):
        P.from_bytes(P.to_bytes(P.Predictors(pred.keys, nan, pred.cos_theta, pred.sin_theta)))


def test_models_without_rope_cannot_be_predicted():
    import pytest

    from kvcodec.errors import ConfigError
    from tests.common import tiny_model

    with pytest.raises(ConfigError, match="RoPE"):
        P.model_rope(tiny_model("gpt2"))


def test_predicted_lossy_files_round_trip_and_name_their_predictors():
    """Tier ``lossy`` with ``predictors=``: the file is stamped 1.6, refuses to decode without the predictors
    or with others (before any tensor), decodes deterministically with them, layer by layer as a whole, and
    its tensors stay as close to the cache as the unpredicted tier's (a random tiny model is not predictable:
    this checks the plumbing; BENCHMARKS has the real model's numbers)."""
    import pytest
    import torch

    import kvcodec
    from kvcodec.codecs import vq_rans as quant
    from kvcodec.models import prefill

    model, prof, pred = _tiny_predictors()
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(5))
    cache = prefill(model, ids)
    kv = kvcodec.to_canonical(cache)
    for opts in ({"step": 0.7}, {"step": 1.0, "window": 4, "sink": 2, "chunk_tokens": 16}):
        data = kvcodec.encode(cache, tier="lossy", quantizer="weighted", profile=prof, predictors=pred, **opts)
        plain = kvcodec.encode(cache, tier="lossy", quantizer="weighted", profile=prof, **opts)
        assert kvcodec.inspect(data)["format_version"] == "1.6"
        with pytest.raises(kvcodec.PredictorsRequired, match=P.identity(P.to_bytes(pred))):
            kvcodec.decode(data)
        other = P.Predictors(pred.keys, [(w, b + np.float16(1)) for w, b in pred.values], pred.cos_theta,
                             pred.sin_theta)
        with pytest.raises(kvcodec.PredictorsRequired, match="these are"):
            kvcodec.decode(data, predictors=other)
        out = kvcodec.decode(data, output="kvcache", predictors=pred)
        again = kvcodec.decode(data, output="kvcache", predictors=pred)
        ref = kvcodec.decode(plain, output="kvcache")
        for li, (a, b, x) in enumerate(zip(out.keys + out.values, again.keys + again.values, kv.keys + kv.values)):
            assert torch.equal(a, b)
            if opts.get("sink"):
                assert torch.equal(a[:, :, :2], x[:, :, :2]) and torch.equal(a[:, :, -4:], x[:, :, -4:])
            if li < len(kv.keys):  # keys: a pre-RoPE error of at most half a channel step, rotated (pairs)
                steps = quant.channel_steps(opts["step"], quant.PREDICTED_KEY_RATIO, prof.key_weights[li])
                steps = steps.astype(np.float32)
                assert (a.float() - x.float()).abs().max() <= 0.75 * float(steps.max()) + 1e-4
        # with predictions of zero the values are the unpredicted tier's, bit for bit
        zero = P.Predictors([(np.zeros_like(w), np.zeros_like(b)) for w, b in pred.keys],
                            [(np.zeros_like(w), np.zeros_like(b)) for w, b in pred.values], pred.cos_theta,
                            pred.sin_theta)
        z = kvcodec.decode(kvcodec.encode(cache, tier="lossy", quantizer="weighted", profile=prof, predictors=zero,
                                          **opts), output="kvcache", predictors=zero)
        for a, c in zip(z.values, ref.values):
            assert torch.equal(a, c)
        with kvcodec.open_kvz(data, predictors=pred) as f:
            k1, v1 = f.layer(1)
        assert torch.equal(k1, out.keys[1]) and torch.equal(v1, out.values[1])
    with pytest.raises(kvcodec.ConfigError, match="quantizer 'weighted'"):
        kvcodec.encode(cache, tier="lossy", quantizer="uniform", predictors=pred, step=0.5)
    windowed = kvcodec.KVCache(kv.keys, kv.values, sliding_window=[None] * (len(kv.keys) - 1) + [64])
    with pytest.raises(kvcodec.ConfigError, match="sliding window"):
        kvcodec.encode(windowed, tier="lossy", quantizer="weighted", profile=prof, predictors=pred, step=0.7)


def test_hostile_predict_objects_are_refused_by_field():
    """The golden vector lossy_predicted with its header's predict object changed (checksums resealed): every
    violation of spec section 13.1 is a FormatError / UnknownId naming the field, before any tensor."""
    import copy
    from pathlib import Path

    import pytest

    import kvcodec
    from kvcodec.errors import FormatError, UnknownId

    from .common import fuzz_tools, vector_predictors

    fz = fuzz_tools()
    data = (Path(__file__).resolve().parent.parent / "spec" / "vectors" / "lossy_predicted.kvz").read_bytes()
    pred = vector_predictors("lossy_predicted")
    header = fz.header_of(data)

    def variant(change):
        h = copy.deepcopy(header)
        change(h)
        return fz.with_header(data, h)

    cases = [(lambda h: h["predict"].update(predictors="00" * 31), FormatError, "predict.predictors"),
             (lambda h: h["predict"].update(layout="interleaved"), UnknownId, "predict.layout"),
             (lambda h: h["predict"].pop("exact_tail"), FormatError, "predict"),
             (lambda h: h["predict"].update(extra=1), FormatError, "predict"),
             (lambda h: h["predict"].update(exact_head=10, exact_tail=10), FormatError, "predict.exact_tail"),
             (lambda h: h["predict"].update(exact_head=2), FormatError, "predict.exact_head")]
    for change, err, field in cases:
        with pytest.raises(err, match=field.replace(".", r"\.")):
            kvcodec.decode(variant(change), predictors=pred)
    kvcodec.decode(data, predictors=pred)  # the vector itself decodes


def test_encoder_reconstruction_equals_the_decoders():
    """vq_rans.encode(recon=...) gives the decoder's binary32 values of the quantized tokens without
    entropy-decoding (Method 5 keys, Method 1 values; with exact head and tail tokens, and none quantized)."""
    from kvcodec.codecs import vq_rans as quant

    rng = np.random.default_rng(7)
    x = (rng.normal(size=(1, 2, 23, 16)) * np.exp(rng.normal(size=(1, 2, 23, 1)))).astype(np.float32)
    w = rng.uniform(0.3, 3.0, (2, 16)).astype(np.float32)
    bits = x.view(np.uint32)
    for part, extra in ((0, {"weights": w}), (1, {})):
        for head, tail in ((0, 0), (1, 3), (20, 3)):
            r = {}
            payload = quant.encode(x, {"quantizer": "weighted"}, step=0.4, part=part, exact_tokens=tail,
                                   exact_bits=bits[:, :, 23 - tail:] if tail else None, head_tokens=head,
                                   head_bits=bits[:, :, :head] if head else None, recon=r, **extra)
            want = quant.decode(payload, x.shape, "float32").values
            assert r["values"].shape == want.shape == (1, 2, 23 - head - tail, 16)
            assert np.array_equal(r["values"].view(np.uint32), want.view(np.uint32))


def test_predictors_are_taken_as_objects_bytes_or_paths(tmp_path):
    """Predictors.save / load (atomic, strict), identity = SHA-256 of the file; encode / decode accept the
    object, its bytes or its path alike; a wrong type is a ConfigError."""
    import hashlib

    import pytest
    import torch

    import kvcodec
    from kvcodec.models import prefill

    model, prof, pred = _tiny_predictors()
    path = tmp_path / "p.safetensors"
    n = pred.save(path)
    raw = path.read_bytes()
    assert n == len(raw) and pred.identity == hashlib.sha256(raw).hexdigest()
    back = kvcodec.Predictors.load(path)
    assert back.identity == pred.identity and back.meta["model"] == kvcodec.model_fingerprint(model)
    cache = prefill(model, torch.randint(0, model.config.vocab_size, (1, 24),
                                         generator=torch.Generator().manual_seed(9)))
    data = kvcodec.encode(cache, tier="lossy", quantizer="weighted", profile=prof, predictors=str(path), step=0.7)
    want = kvcodec.decode(data, output="kvcache", predictors=pred)
    for given in (raw, path, back):
        assert kvcodec.decode(data, output="kvcache", predictors=given).equal(want)
    assert kvcodec.encode(cache, tier="lossy", quantizer="weighted", profile=prof, predictors=raw, step=0.7) == data
    with pytest.raises(kvcodec.ConfigError, match="predictors="):
        kvcodec.encode(cache, tier="lossy", quantizer="weighted", profile=prof, predictors=[1], step=0.7)
    with pytest.raises(kvcodec.PredictorsRequired, match="these are"):  # the hash is checked first (spec)
        kvcodec.decode(data, predictors=raw[:-3])
    with pytest.raises(kvcodec.FormatError, match="Predictors"):
        kvcodec.Predictors.from_bytes(raw[:-3])


def test_layer_by_layer_reads_reconstruct_each_layer_once(monkeypatch):
    """KvzFile.layer(i) in order continues from the layer kept (no O(L^2) re-decoding), out of order restarts;
    every layer equals the whole decode's."""
    import torch

    import kvcodec
    from kvcodec import predict as PR
    from kvcodec.models import prefill

    model, prof, pred = _tiny_predictors()
    cache = prefill(model, torch.randint(0, model.config.vocab_size, (1, 20),
                                         generator=torch.Generator().manual_seed(3)))
    data = kvcodec.encode(cache, tier="lossy", quantizer="weighted", profile=prof, predictors=pred, step=0.7)
    whole = kvcodec.decode(data, output="kvcache", predictors=pred)
    calls = []
    real = PR.predict
    monkeypatch.setattr(PR, "predict", lambda *a, **k: calls.append(1) or real(*a, **k))
    nl = len(whole.keys)
    with kvcodec.open_kvz(data, predictors=pred) as f:
        for i in range(nl):
            k, v = f.layer(i)
            assert torch.equal(k, whole.keys[i]) and torch.equal(v, whole.values[i])
        assert len(calls) == 2 * nl  # one key and one value prediction per layer
        k, v = f.layer(0)  # backwards: restarts from layer 0
        assert torch.equal(k, whole.keys[0]) and torch.equal(v, whole.values[0])


def test_a_store_keeps_its_namespace_predictors_once(tmp_path):
    """Store(tier="lossy", quantizer="weighted", profile=, predictors=): the namespace names the predictors by
    hash and keeps their file once; any Store object reads the sessions without being given them; a missing
    predictors file is PredictorsRequired (the chunks stay), a damaged one is quarantined."""
    import shutil

    import pytest
    import torch

    import kvcodec
    from kvcodec.models import prefill

    model, prof, pred = _tiny_predictors()
    store = kvcodec.Store(tmp_path, model, tier="lossy", quantizer="weighted", profile=prof, predictors=pred,
                          step=0.7, chunk_tokens=16)
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(4))
    cache = prefill(model, ids)
    key = store.put(cache, tokens=ids)
    key2 = store.put(prefill(model, torch.cat([ids[:, :32], ids[:, :8]], 1)), tokens=torch.cat([ids[:, :32],
                                                                                                ids[:, :8]], 1))
    ns = key.split(":")[0]
    files = sorted((tmp_path / "ns" / ns / "predictors").iterdir())
    assert [f.name for f in files] == [pred.identity + ".safetensors"]
    rec = store.record(ns)
    assert rec["options"]["predictors"] == pred.identity and len(rec["options"]["profile"]) == 64
    back = store.get(key, output="kvcache")
    assert kvcodec.inspect(next((tmp_path / "ns" / ns / "chunks").rglob("*.kvz")))["format_version"] == "1.6"
    reader = kvcodec.Store(tmp_path)  # opened without predictors, profile or model
    assert reader.get(key, output="kvcache").equal(back)
    layers = list(reader.layers(key2))
    assert len(layers) == len(back.keys)
    # chunks decode each with its own file's positions: the first 32 positions agree across the two sessions
    other = reader.get(key2, output="kvcache")
    for a, b in zip(back.keys, other.keys):
        assert torch.equal(a[:, :, :32], b[:, :, :32])
    chunks = sorted(p.name for p in (tmp_path / "ns" / ns / "chunks").rglob("*.kvz"))
    shutil.move(files[0], tmp_path / "aside")
    with pytest.raises(kvcodec.PredictorsRequired, match="missing"):
        kvcodec.Store(tmp_path).get(key)
    assert sorted(p.name for p in (tmp_path / "ns" / ns / "chunks").rglob("*.kvz")) == chunks  # all kept
    bad = bytearray((tmp_path / "aside").read_bytes())
    bad[-1] ^= 1
    files[0].write_bytes(bytes(bad))
    with pytest.warns(UserWarning, match="corrupt"), pytest.raises(kvcodec.PredictorsRequired, match="damaged"):
        kvcodec.Store(tmp_path).get(key)
    assert not files[0].exists() and any((tmp_path / "quarantine").glob("*predictors*"))
    shutil.move(tmp_path / "aside", files[0])
    assert kvcodec.Store(tmp_path).get(key, output="kvcache").equal(back)


def test_scaled_rotary_keys_keep_the_models_scale():
    """Predictors whose RoPE scale is not 1 (YaRN, longrope: cos and sin times attention_scaling): the encoder
    takes keys back before RoPE with the tables divided by the scale, so decoded keys are the cache's, not
    scale^2 times them."""
    import torch

    import kvcodec
    from kvcodec.models import prefill

    model, prof, pred = _tiny_predictors()
    cache = kvcodec.to_canonical(prefill(model, torch.randint(0, model.config.vocab_size, (1, 30),
                                                               generator=torch.Generator().manual_seed(8))))
    for scale in (0.5, 1.7):
        p = P.Predictors(pred.keys, pred.values, pred.cos_theta, pred.sin_theta, scale)
        data = kvcodec.encode(cache, tier="lossy", quantizer="weighted", profile=prof, predictors=p, step=0.005)
        back = kvcodec.decode(data, output="kvcache", predictors=p)
        for a, x in zip(back.keys, cache.keys):  # scale^2 times the keys would be a relative error >= 0.75
            err = float((a.float() - x.float()).norm() / x.float().norm())
            assert err < 0.15, (scale, err)


def test_caches_without_quantized_tokens_round_trip():
    """Every token exact (T <= sink + window, a 1-token cache): nothing is predicted, and both rate modes work."""
    import torch

    import kvcodec
    from kvcodec.models import prefill

    model, prof, pred = _tiny_predictors()
    for n, opts in ((1, {"step": 0.5}), (1, {"bits": 2.0}), (5, {"bits": 2.0, "window": 4}),
                    (6, {"step": 0.5, "sink": 3, "window": 3})):
        cache = kvcodec.to_canonical(prefill(model, torch.randint(0, model.config.vocab_size, (1, n),
                                                                   generator=torch.Generator().manual_seed(n))))
        data = kvcodec.encode(cache, tier="lossy", quantizer="weighted", profile=prof, predictors=pred, **opts)
        assert kvcodec.decode(data, output="kvcache", predictors=pred).equal(cache)


def test_hostile_predictors_files_are_format_errors(tmp_path):
    """Every malformed predictors file is a FormatError naming the field, never another exception; a file with
    safetensors metadata or other meta.json keys (valid by the spec) is read, with the SHA-256 of its own
    bytes as identity."""
    import hashlib
    import json

    import pytest
    from safetensors.numpy import load, save

    from kvcodec.errors import FormatError

    _, _, pred = _tiny_predictors()
    base = load(pred.to_bytes())

    def variant(meta=None, drop=(), extra=None, metadata=None):
        t = {k: v for k, v in base.items() if k not in drop}
        if meta is not None:
            t["meta.json"] = np.frombuffer(meta.encode(), np.uint8).copy()
        t.update(extra or {})
        return save(t, metadata=metadata)

    good = {"format": "kvz-predictors", "version": "1", "scale": 1.0, "meta": {}}
    bad = [variant(json.dumps({**good, "scale": 10 ** 400})), variant(json.dumps({**good, "scale": True})),
           variant(json.dumps({**good, "scale": 1e300})), variant(json.dumps({**good, "scale": 0})),
           variant('{"format": "kvz-predictors", "version": "1", "scale": 1, "scale": 2, "meta": {}}'),
           variant(json.dumps({k: v for k, v in good.items() if k != "meta"})),
           variant("[" * 100000 + "]" * 100000), variant(drop=("meta.json",)),
           variant(extra={"rope.cos_theta": np.zeros(0), "rope.sin_theta": np.zeros(0)}),
           variant(extra={"meta.json": np.frombuffer(json.dumps(good).encode(), np.uint8).astype(np.float32)})]
    for data in bad:
        with pytest.raises(FormatError, match="Predictors"):
            P.from_bytes(data)
    ok = variant(json.dumps({**good, "x-note": "ignored"}), metadata={"written_by": "another tool"})
    back = P.from_bytes(ok)
    assert back.identity == hashlib.sha256(ok).hexdigest() != pred.identity
    assert P.as_predictors(back) is back


def test_positions_beyond_the_recurrence_limit_are_refused():
    """A predicted file whose positions would need more than 2^30 recurrence steps is LimitExceeded before any
    work (a hostile start_position cannot make the decoder spin), and the encoder refuses to write one."""
    import copy
    from pathlib import Path

    import pytest

    import kvcodec
    from kvcodec.errors import LimitExceeded

    from .common import fuzz_tools, vector_predictors

    fz = fuzz_tools()
    data = (Path(__file__).resolve().parent.parent / "spec" / "vectors" / "lossy_predicted.kvz").read_bytes()
    h = copy.deepcopy(fz.header_of(data))
    h["cache"]["start_position"] = (1 << 31) - 20
    with pytest.raises(LimitExceeded, match="predict"):
        kvcodec.decode(fz.with_header(data, h), predictors=vector_predictors("lossy_predicted"))
    kv = kvcodec.to_canonical(kvcodec.decode(data, output="kvcache", predictors=vector_predictors("lossy_predicted")))
    far = kvcodec.KVCache(kv.keys, kv.values, start_position=(1 << 31) - 20)
    with pytest.raises(kvcodec.ConfigError, match="RoPE recurrence"):
        kvcodec.encode(far, tier="lossy", quantizer="weighted", step=0.3,
                       profile=kvcodec.Profile([np.ones((2, 8), np.float32)] * 2),
                       predictors=vector_predictors("lossy_predicted"))
