"""The residual channel: codec ``int_residual_rans``.

A cache regenerated from its tokens (``tokens`` / ``exact`` tiers) is a
*prediction* of the original.  This codec stores what the prediction got
wrong, per tensor slice ``[B, H, T, D]``:

* every float is mapped to an integer key that is monotone in its value
  (``key = bits ^ 0x8000`` for positive, ``~bits`` for negative; 16- or 32-bit),
  so ``d = key(original) - key(regenerated)`` (modulo 2^W, read as signed) is the
  distance in units in the last place, and ``+0 / -0`` are neighbours;
* ``z = zigzag(d)`` is split into a *bucket* symbol (``z`` itself below 16,
  else ``16 + bitlength(z) - 5``) coded with the lane rANS coder of
  ``float_ctx_rans`` (same tables, same previous-token contexts, 6-bit
  alphabet), and ``bitlength(z) - 1`` extra bits for buckets >= 16, bit-packed in
  C order.

Modes: 0 = no residual (regeneration is bit-identical, or within tolerance
everywhere), 1 = coded as above, 2 = the original slice coded directly with
``float_ctx_rans`` (when the prediction is so poor that a residual would cost
more, e.g. after a token the model cannot reproduce).  With a tolerance the
encoder zeroes every difference within ``eps``; the decoder does not need to
know.  See ``spec/kvz.md`` section 9.
"""

from __future__ import annotations

import numpy as np
import xxhash

from ..dtypes import DTYPES, bit_patterns, from_bit_patterns
from ..errors import FormatError
from ..registry import register_codec
from . import float_ctx_rans
from .base import Codec, Slice

CODEC_ID = "int_residual_rans"
MODE_ZERO = 0
MODE_CODED = 1
MODE_DIRECT = 2
SYMBOL_BITS = 6
EXACT_BUCKETS = 16


def _keys(bits: np.ndarray, width: int) -> np.ndarray:
    u = np.uint16 if width == 2 else np.uint32
    top = u(1 << (8 * width - 1))
    neg = (bits & top) != 0
    return np.where(neg, ~bits, bits ^ top).astype(u)


def _from_keys(keys: np.ndarray, width: int) -> np.ndarray:
    u = np.uint16 if width == 2 else np.uint32
    top = u(1 << (8 * width - 1))
    pos = (keys & top) != 0
    return np.where(pos, keys ^ top, ~keys).astype(u)


def _bitlength(z: np.ndarray) -> np.ndarray:
    """Bit length of each non-negative integer (exact for < 2**32)."""
    z = z.astype(np.uint64)
    out = np.zeros(z.shape, dtype=np.int64)
    for sh in (16, 8, 4, 2, 1):
        m = (z >> np.uint64(sh)) != 0
        out[m] += sh
        z = np.where(m, z >> np.uint64(sh), z)
    return out + (z != 0)


def differences(orig: np.ndarray, regen: np.ndarray, width: int) -> np.ndarray:
    """``zigzag(key(orig) - key(regen) mod 2**W)`` as uint64."""
    bits = 8 * width
    mask = (1 << bits) - 1
    d = (_keys(orig, width).astype(np.int64) - _keys(regen, width).astype(np.int64)) & mask
    d = np.where(d >= 1 << (bits - 1), d - (1 << bits), d)  # signed
    return np.where(d >= 0, 2 * d, -2 * d - 1).astype(np.uint64)


def apply(regen: np.ndarray, z: np.ndarray, width: int) -> np.ndarray:
    """Inverse of :func:`differences`: the original bit patterns."""
    bits = 8 * width
    z = z.astype(np.int64)
    d = np.where(z & 1, -((z + 1) >> 1), z >> 1)
    k = (_keys(regen, width).astype(np.int64) + d) & ((1 << bits) - 1)
    return _from_keys(k.astype(np.uint16 if width == 2 else np.uint32), width)


def _pack_var(values: np.ndarray, widths: np.ndarray) -> bytes:
    total = int(widths.sum())
    if not total:
        return b""
    offs = np.concatenate([[0], np.cumsum(widths)[:-1]])
    out = np.zeros(total, dtype=np.uint8)
    values = values.astype(np.uint64)
    for j in range(int(widths.max())):
        m = widths > j
        out[offs[m] + j] = ((values[m] >> np.uint64(j)) & np.uint64(1)).astype(np.uint8)
    return np.packbits(out, bitorder="little").tobytes()


def _unpack_var(buf, widths: np.ndarray) -> np.ndarray:
    bits = np.unpackbits(np.frombuffer(buf, dtype=np.uint8), bitorder="little")
    offs = np.concatenate([[0], np.cumsum(widths)[:-1]]).astype(np.int64)
    out = np.zeros(widths.shape, dtype=np.uint64)
    for j in range(int(widths.max()) if widths.size else 0):
        m = widths > j
        out[m] |= bits[offs[m] + j].astype(np.uint64) << np.uint64(j)
    return out


def checksum(bits: np.ndarray) -> int:
    """Tensor_Checksum of a slice: XXH3-64 of its bit patterns, little-endian, C order."""
    width = bits.dtype.itemsize
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(bits).astype(f"<u{width}", copy=False).tobytes())


def _encode(orig, regen, dtype, tolerance, width) -> bytes:
    z = differences(orig, regen, width)
    if tolerance:
        a = from_bit_patterns(orig, DTYPES[dtype].torch).double().numpy()
        b = from_bit_patterns(regen, DTYPES[dtype].torch).double().numpy()
        with np.errstate(invalid="ignore"):
            z[np.abs(a - b) <= tolerance] = 0
    if not z.any():
        return bytes([MODE_ZERO])
    b, h, s, d = orig.shape
    bl = _bitlength(z)
    big = z >= EXACT_BUCKETS
    sym = np.where(big, EXACT_BUCKETS + bl - 5, z).astype(np.uint16)
    rows = np.ascontiguousarray(sym.transpose(0, 1, 3, 2)).reshape(b * h * d, s)
    extra_w = np.where(big, bl - 1, 0).ravel()
    extra_v = (z.ravel() - np.where(big.ravel(), np.uint64(1) << (bl.ravel().astype(np.uint64) - np.uint64(1)), 0)
               ).astype(np.uint64)
    sel = extra_w > 0
    coded = bytes([MODE_CODED]) + float_ctx_rans.encode_symbols(rows, SYMBOL_BITS, float_ctx_rans.DEFAULTS) + _pack_var(extra_v[sel],
                                                                                                extra_w[sel])
    direct = None
    if len(coded) > orig.size * width // 2:  # a poor prediction: see whether coding the slice itself is smaller
        direct = bytes([MODE_DIRECT]) + float_ctx_rans.encode(orig, dtype, {})
    return direct if direct is not None and len(direct) < len(coded) else coded


def _decode(mv, regen: np.ndarray, dtype: str, offset: int, width: int) -> np.ndarray:
    if len(mv) < 1:
        raise FormatError("empty residual payload", field="Residual.Mode", offset=offset)
    mode = mv[0]
    if mode == MODE_ZERO:
        if len(mv) != 1:
            raise FormatError(f"Mode 0 residual has {len(mv) - 1} bytes after the mode", field="Residual.Mode",
                              offset=offset)
        return regen
    if mode == MODE_DIRECT:
        return float_ctx_rans.decode(mv[1:], regen.shape, dtype, offset=offset + 1)
    if mode != MODE_CODED:
        raise FormatError(f"unknown residual mode {mode}", field="Residual.Mode", offset=offset)
    b, h, s, d = regen.shape
    if regen.size == 0:
        raise FormatError("coded residual for an empty tensor", field="Residual.Mode", offset=offset)
    sym = np.empty((b, h, s, d), dtype=np.uint16)
    used = 1 + float_ctx_rans.decode_symbols(mv[1:], sym.reshape(b * h, s, d), SYMBOL_BITS, offset=offset + 1,
                                       exact_payload=False, coded_bits=SYMBOL_BITS)
    max_bucket = EXACT_BUCKETS + 8 * width - 5  # bitlength(z) <= 8W
    if int(sym.max()) > max_bucket:
        raise FormatError(f"residual bucket {int(sym.max())} > {max_bucket}", field="Residual.Words",
                          offset=offset + 1)
    sym = sym.ravel().astype(np.int64)
    big = sym >= EXACT_BUCKETS
    bl = np.where(big, sym - EXACT_BUCKETS + 5, 0)
    widths = np.where(big, bl - 1, 0)
    need = -(-int(widths.sum()) // 8)
    if len(mv) - used != need:
        raise FormatError(f"residual extra bits take {len(mv) - used} bytes, the symbols need {need}",
                          field="Residual.Extra_Bits", offset=offset + used)
    extra = _unpack_var(mv[used:], widths[big])
    if need and (int(widths.sum()) % 8) and (mv[len(mv) - 1] >> (int(widths.sum()) % 8)):
        raise FormatError("padding bits of the last extra-bits byte are not zero", field="Residual.Extra_Bits",
                          offset=offset + len(mv) - 1)
    z = sym.astype(np.uint64)
    z[big] = (np.uint64(1) << (bl[big].astype(np.uint64) - np.uint64(1))) + extra
    if width == 2 and int(z.max()) >= 1 << 16:
        raise FormatError("a residual exceeds the word width", field="Residual.Extra_Bits", offset=offset + used)
    return apply(regen, z.reshape(regen.shape), width)


@register_codec
class IntResidualRans(Codec):
    """The residual channel of the token tiers: ``encode(original, where, prediction=regenerated)``.  No wire
    parameters; ``tolerance`` (encoder only) zeroes every difference within it."""

    codec_id = CODEC_ID

    def __init__(self, params: dict | None = None, tolerance: float = 0.0):
        super().__init__(params)
        self.tolerance = float(tolerance or 0.0)

    def encode(self, t, where: Slice, prediction=None) -> bytes | None:
        if prediction is None:
            raise ValueError(f"{CODEC_ID} codes a slice against its prediction: pass prediction=")
        body = _encode(bit_patterns(t), bit_patterns(prediction), where.dtype, self.tolerance,
                       DTYPES[where.dtype].itemsize)
        return None if body == bytes([MODE_ZERO]) else body

    def decode(self, payload, where: Slice, prediction=None, out=None) -> np.ndarray:
        if prediction is None:
            raise ValueError(f"{CODEC_ID} decodes against the prediction: pass prediction=")
        if payload is None:
            return prediction
        return _decode(memoryview(payload), prediction, where.dtype, where.offset, DTYPES[where.dtype].itemsize)
