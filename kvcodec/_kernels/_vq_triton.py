"""The jitted kernels of kvcodec/_kernels/vq.py (imported only when Triton is; see vq.py for what they compute)."""

import triton
import triton.language as tl


@triton.jit
def _wht(x, BN: tl.constexpr, D: tl.constexpr, LOG_D: tl.constexpr):
    # unnormalised Walsh-Hadamard butterfly, stage h = 1, 2, 4, ...: (a, b) <- (a + b, a - b) over the
    # two halves of every block of 2h (the reference's reshape(n, d / 2h, 2, h) order)
    for s in tl.static_range(LOG_D):
        H: tl.constexpr = 1 << s
        y = tl.permute(tl.reshape(x, (BN, D // (2 * H), 2, H)), (0, 1, 3, 2))
        a, b = tl.split(y)
        y = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
        x = tl.reshape(y, (BN, D))
    return x


@triton.jit
def _rotate_quantize_kernel(x_ptr, pred_ptr, signs_ptr, norms_ptr, q_ptr, n_rows, step,
                            HAS_PRED: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, LOG_D: tl.constexpr):
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    cols = tl.arange(0, D)
    ok = rows < n_rows
    offs = rows[:, None].to(tl.int64) * D + cols[None, :]
    x = tl.load(x_ptr + offs, mask=ok[:, None], other=0.0).to(tl.float32)
    if HAS_PRED:
        x = x - tl.load(pred_ptr + offs, mask=ok[:, None], other=0.0).to(tl.float32)
    x64 = x.to(tl.float64)
    n16 = tl.sqrt(tl.sum(x64 * x64, axis=1)).to(tl.float16)
    n32 = n16.to(tl.float32)
    pos = n32 > 0
    safe = tl.where(pos, n32, 1.0)
    u = tl.math.div_rn(x, safe[:, None])
    u = tl.where(pos[:, None], u, 0.0)
    u = u * tl.load(signs_ptr + cols)[None, :]
    z = _wht(u, BN, D, LOG_D)
    v = tl.math.div_rn(z, tl.full((BN, D), step, tl.float32))
    v = tl.minimum(tl.maximum(v, -4194304.0), 4194304.0)  # |v| <= 2**22
    r = (v + 12582912.0) - 12582912.0  # 1.5 * 2**23: round to integer, ties to even
    tl.store(norms_ptr + rows, n16, mask=ok)
    tl.store(q_ptr + offs, r.to(tl.int32), mask=ok[:, None])


@triton.jit
def _dequantize_add_kernel(q_ptr, norms_ptr, signs_ptr, base_ptr, out_ptr, n_rows, offset, step, inv_d,
                           HAS_BASE: tl.constexpr, OUT_BF16: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, LOG_D: tl.constexpr):
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    cols = tl.arange(0, D)
    ok = rows < n_rows
    offs = rows[:, None].to(tl.int64) * D + cols[None, :]
    q = tl.load(q_ptr + offs, mask=ok[:, None], other=0)
    z = (q + offset).to(tl.float32) * step
    y = _wht(z, BN, D, LOG_D)
    n32 = tl.load(norms_ptr + rows, mask=ok, other=0.0).to(tl.float32)
    x = ((y * tl.load(signs_ptr + cols)[None, :]) * inv_d) * n32[:, None]
    if HAS_BASE:
        x = x + tl.load(base_ptr + offs, mask=ok[:, None], other=0.0).to(tl.float32)
    if OUT_BF16:
        # round to nearest even by hand: Triton's interpreter truncates float32 -> bfloat16 (the values are
        # finite: the decoder has checked the norms and the step)
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + (((bits >> 16) & 1) + 0x7FFF)
        tl.store(out_ptr + offs, (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=ok[:, None])
    else:
        tl.store(out_ptr + offs, x.to(out_ptr.dtype.element_ty), mask=ok[:, None])
