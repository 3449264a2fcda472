"""Triton kernels (kvcodec/_kernels/vq.py) against the NumPy reference of the lossy tier, bit for bit.

On machines without a GPU they run under TRITON_INTERPRET=1 (set in tests/conftest.py before Triton is
imported); skipped where Triton is not installed.
"""

import numpy as np
import pytest
import torch

from kvcodec import _kernels
from kvcodec.codecs import vq_rans as quant

pytestmark = pytest.mark.skipif(not _kernels.triton_available(), reason="Triton is not installed")

SHAPES = [(1, 1, 1, 2), (1, 2, 5, 8), (2, 3, 17, 64), (1, 1, 33, 128), (1, 2, 3, 256)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def _data(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape[:-1] + (1,), generator=g))
    x[..., : shape[-1] // 4] *= 8  # outlier channels, as keys have
    if shape[2] > 2:
        x[:, :, 1] = 0  # a zero vector
    return x.to(dtype)


def _reference_quantize(x, step, seed, pred=None):
    r = x.float() - (pred.float() if pred is not None else 0)
    vecs = r.reshape(-1, x.shape[-1]).numpy().astype(np.float32)
    norms16, z = quant.directions(vecs, seed)
    return norms16, np.rint(z / np.float32(step)).astype(np.int64)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotate_quantize_matches_the_reference(shape, dtype):
    from kvcodec._kernels import vq

    x = _data(shape, dtype, 1)
    for step, seed, pred in ((0.37, 7, None), (0.05, 123456789, _data(shape, torch.float32, 2))):
        want_n, want_q = _reference_quantize(x, step, seed, pred)
        dev = _device()
        n, q = vq.rotate_quantize(x.to(dev), step, seed, None if pred is None else pred.to(dev))
        assert n.dtype == torch.float16 and q.dtype == torch.int32
        np.testing.assert_array_equal(n.cpu().numpy().view(np.uint16), want_n.view(np.uint16))
        np.testing.assert_array_equal(q.cpu().numpy(), want_q)


def test_ties_round_to_even_like_numpy():
    from kvcodec._kernels import vq

    # a vector whose rotated coordinates are exactly +-0.5, +-1.5, +-2.5 steps: ties
    d = 4
    z = np.array([[0.5, 1.5, -2.5, -0.5]], dtype=np.float32)
    s = quant.signs(3, d)
    u = quant.fwht(z) * s * np.float32(1 / d)  # z = WHT(s * u) exactly (powers of two)
    x = torch.from_numpy(u * np.float32(2.0)).reshape(1, 1, 1, d)  # norm 2 * |u| = 2 * 1.5 ... any
    n, q = vq.rotate_quantize(x.to(_device()), 1.0, 3)
    want_n, want_q = _reference_quantize(x, 1.0, 3)
    np.testing.assert_array_equal(q.cpu().numpy(), want_q)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_add_matches_the_decoder(shape, dtype):
    from kvcodec._kernels import vq

    b, h, s, d = shape
    rng = np.random.default_rng(5)
    q = rng.integers(-9, 10, size=(b * h * s, d)).astype(np.int32)
    norms = (np.abs(rng.standard_normal(b * h * s)) * 4).astype(np.float16)
    step, seed, lo = 0.3, 99, -3
    # the decoder's reconstruction (quant.decode, Method 1), then rounded to dtype by torch
    zq = (q.astype(np.int64) + lo).astype(np.float32) * np.float32(step)
    u = quant.fwht(zq) * quant.signs(seed, d)[None, :] * np.float32(1.0 / d)
    ref32 = (u * norms.astype(np.float32)[:, None]).reshape(shape)
    dev = _device()
    out = vq.dequantize_add(torch.from_numpy(q).to(dev), torch.from_numpy(norms).to(dev), step, seed, shape, dtype,
                            offset=lo)
    assert out.dtype == dtype and tuple(out.shape) == shape
    assert torch.equal(out.cpu(), torch.from_numpy(ref32).to(dtype))
    base = _data(shape, dtype, 4)
    out = vq.dequantize_add(torch.from_numpy(q).to(dev), torch.from_numpy(norms).to(dev), step, seed, shape, dtype,
                            offset=lo, base=base.to(dev))
    assert torch.equal(out.cpu(), (torch.from_numpy(ref32) + base.float()).to(dtype))


def test_round_trip_reconstructs_residual_plus_prediction():
    from kvcodec._kernels import vq

    shape = (1, 2, 9, 32)
    x, pred = _data(shape, torch.float32, 7), _data(shape, torch.float32, 8)
    dev = _device()
    n, q = vq.rotate_quantize(x.to(dev), 0.01, 5, pred.to(dev))
    back = vq.dequantize_add(q, n, 0.01, 5, shape, torch.float32, base=pred.to(dev)).cpu()
    err = (back - x).norm(dim=-1) / (x - pred).norm(dim=-1).clamp_min(1e-30)
    assert float(err.max()) < 0.02  # step 0.01 on unit directions, fp16 norms


def test_bad_arguments_are_refused():
    from kvcodec._kernels import vq

    with pytest.raises(ValueError, match="power of two"):
        vq.rotate_quantize(torch.zeros(1, 1, 2, 48), 0.1, 0)
    with pytest.raises(ValueError, match="dtype"):
        vq.rotate_quantize(torch.zeros(1, 1, 2, 8, dtype=torch.float64), 0.1, 0)
    with pytest.raises(ValueError, match="does not match"):
        vq.rotate_quantize(torch.zeros(1, 1, 2, 8), 0.1, 0, pred=torch.zeros(1, 1, 3, 8))
    with pytest.raises(ValueError, match="int32"):
        vq.dequantize_add(torch.zeros(4, 8, dtype=torch.int64), torch.zeros(4, dtype=torch.float16), 0.1, 0,
                          (1, 1, 4, 8), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_encoder_writes_the_same_bytes_through_the_kernel(dtype, monkeypatch):
    import kvcodec
    from tests.test_lossy import structured_cache

    cache = structured_cache(layers=2, heads=2, seq=21, dim=16, dtype=dtype)
    opts = {"tier": "lossy", "bits": 2.5, "window": 3, "sink": 2, "chunk_tokens": 8}
    monkeypatch.delenv("KVCODEC_TRITON", raising=False)
    want = kvcodec.encode(cache, **opts)
    monkeypatch.setenv("KVCODEC_TRITON", "1")
    calls = []
    from kvcodec._kernels import vq

    real = vq.rotate_quantize
    monkeypatch.setattr(vq, "rotate_quantize", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert kvcodec.encode(cache, **opts) == want
    assert calls  # the kernel did the quantization


# --- the entropy decoder (kvcodec/_kernels/rans.py) -------------------------------------------------------

def _coded_payload(shape, dtype, ways, seed):
    """A float_ctx_rans Mode 1 payload of a structured tensor (channel scales, as caches have) and its words."""
    from kvcodec.codecs import float_ctx_rans as fc

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 4).round() / 4 * torch.exp(torch.randn(1, shape[1], 1, shape[3],
                                                                                  generator=g) * 2)
    x = x.to(dtype)
    iview, uview = (torch.int32, np.uint32) if dtype == torch.float32 else (torch.int16, np.uint16)
    words = x.contiguous().view(iview).numpy().view(uview)
    name = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
    payload = fc.encode(words, name, {"ways": ways})
    assert payload[0] == 1, "the test needs a coded payload"
    return payload, fc.decode(payload, shape, name), 8 * words.itemsize


@pytest.mark.parametrize("dtype,ways,shape", [(torch.bfloat16, 8, (1, 2, 40, 16)),  # full lane groups
                                              (torch.float32, 32, (1, 3, 60, 8)),  # one partial group, 22 raw bits
                                              (torch.float16, 4, (2, 1, 50, 6))])  # groups across heads
def test_triton_entropy_decoder_is_bit_exact(dtype, ways, shape):
    """The Triton lane decoder gives the CPU decoder's words (symbols and raw low bits) for every dtype, lane
    count and group layout, several streams of one shape in one launch."""
    from kvcodec._kernels import rans as kr
    from kvcodec.codecs import float_ctx_rans as fc

    b, h, s, d = shape
    cases = [_coded_payload(shape, dtype, ways, seed) for seed in (1, 2)]
    streams = [fc.parse_symbols(memoryview(p), (b * h, s, d), bits)[0] for p, _, bits in cases]
    out = kr.decode(streams, (b * h, s, d), device=_device()).cpu().numpy()
    for i, (_, want, _) in enumerate(cases):
        np.testing.assert_array_equal(out[i].astype(want.dtype).reshape(shape), want)


def test_triton_entropy_decoder_fused_with_method5_dequantization():
    """Method 5 payloads (quantizer ``weighted``'s keys): indices decoded and dequantized in one kernel,
    ``float32(symbol + Index_Offset) * step[h][d]``, equal to the CPU decoder's values bit for bit."""
    import struct

    from kvcodec._kernels import rans as kr
    from kvcodec.codecs import float_ctx_rans as fc

    shape = (1, 2, 48, 16)
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(shape, generator=g) * torch.exp(torch.randn(1, 2, 1, 16, generator=g))).numpy()
    weights = np.exp(np.random.default_rng(0).normal(size=(2, 16))).astype(np.float32)
    payload = quant.encode(x, {"quantizer": "weighted", "sink": 0}, step=0.5, part=0, weights=weights)
    want = quant.decode(payload, shape, "float32")
    fixed = quant._FIXED
    (lo,) = struct.unpack_from("<i", payload, fixed.size)
    k = payload[2]
    p = fixed.size + 4
    steps = np.frombuffer(payload[p:p + 2 * 32], dtype="<f2").astype(np.float32).reshape(1, 2, 16)
    stream, _ = fc.parse_symbols(memoryview(payload)[p + 64:], (2, 48, 16), k, exact_payload=False, coded_bits=k)
    got = kr.decode([stream], (2, 48, 16), device=_device(), steps=steps, heads=2, index_offsets=[lo])
    np.testing.assert_array_equal(got[0].cpu().numpy().reshape(shape), want.values)
    # several streams in one launch, each with its own steps and offset: stream i gets its own
    both = kr.decode([stream, stream, stream], (2, 48, 16), device=_device(),
                     steps=np.stack([steps, steps * 2, steps]), heads=2, index_offsets=[lo, lo, lo + 1]).cpu().numpy()
    np.testing.assert_array_equal(both[0].reshape(shape), want.values)
    np.testing.assert_array_equal(both[1], both[0] * 2)  # exact: times two is exact in binary32
    syms = kr.decode([stream], (2, 48, 16), device=_device())[0].cpu().numpy().reshape(shape)
    np.testing.assert_array_equal(both[2].reshape(shape),
                                  (syms + lo + 1).astype(np.float32) * steps[0][None, :, None, :])
    with pytest.raises(ValueError, match="no raw low bits"):
        kr.decode([stream._replace(lowbits=2)], (2, 48, 16), device=_device(), steps=steps, heads=2)


def test_triton_entropy_decoder_refuses_corrupt_streams():
    """A stream with a word changed or a word missing: the Triton decoder raises FormatError wherever the CPU
    decoder does (final state, words left over or too few), and decodes the same words where it does not."""
    from kvcodec._kernels import rans as kr
    from kvcodec.codecs import float_ctx_rans as fc
    from kvcodec.entropy import rans
    from kvcodec.errors import FormatError

    shape = (1, 2, 40, 16)
    payload, _, bits = _coded_payload(shape, torch.bfloat16, 8, 4)
    st, _ = fc.parse_symbols(memoryview(payload), (2, 40, 16), bits)
    for words in (st.words[:-1], np.concatenate([st.words, [7]]), st.words ^ (np.arange(st.words.size) == 40),
                  st.words ^ (np.arange(st.words.size) == st.words.size - 3)):
        bad = st._replace(words=words.astype(np.uint16))
        cpu = np.zeros((2, 40, 16), dtype=np.uint16)
        try:
            rans.lanes_decode(bad.words, bad.refs, bad.ctx_map, bad.freq, bad.scale_bits, bad.ways, bad.kbits,
                              bad.nclass, bad.lowbits, bad.raw, cpu)
        except FormatError:
            with pytest.raises(FormatError):
                kr.decode([bad], (2, 40, 16), device=_device())
        else:
            np.testing.assert_array_equal(kr.decode([bad], (2, 40, 16), device=_device())[0].cpu().numpy(), cpu)
