"""The lossy tier's reconstruction (spec section 13, Method 1) as explicit vector code (issue 16).

A token's ``D`` components are one ``<D x float>`` value: ``z = float32(symbol + Index_Offset) * Step``, the
Walsh-Hadamard butterfly (stage ``h``: ``p = z[j ^ h]``, then ``z[j] + p`` where bit ``h`` of ``j`` is clear and
``p - z[j]`` where it is set: the pair ``(a + b, a - b)`` of the spec), then ``((z * sign) * (1 / D)) * norm``, and
for bfloat16 output the rounding to nearest even of :func:`kvcodec.codecs._vq_numba.f32_to_bf16`.  LLVM IR
written here and compiled by llvmlite for the host CPU (as :mod:`kvcodec.entropy._lanes_simd`): the stages
become register shuffles, adds, subtracts and blends, with no transposes and no scalar loop.

No fast-math flag is set, so every operation is the binary32 operation the spec writes, in its order (no fused
multiply-add, no reassociation); each output is computed from the same two inputs as in the scalar kernel, so
the bits are the same (``tests/test_lossy.py`` compares both).  ``float32(symbol + Index_Offset)`` is converted
from a 32-bit integer, exact as the spec's 64-bit sum whenever the sum fits 32 bits (:func:`usable` checks).
"""

from __future__ import annotations

import ctypes

import numpy as np

from ..entropy import _lanes_simd, rans

__all__ = ["DIMS", "usable", "rotate", "assembly", "dequant_usable", "dequant", "forward_usable", "forward", "norms"]

#: head dimensions compiled here (others take the Numba kernel)
DIMS = (64, 128)

_ARGTYPES = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 6 + [ctypes.c_int32, ctypes.c_float, ctypes.c_float]


def _vec(d: int, ty: str, values) -> str:
    return "<" + ", ".join(f"{ty} {v}" for v in values) + ">"


def _row_loop_end(a: list) -> str:
    """Close a kernel's loop over rows ``%i < %n`` (to ``%loop``, else ``%done``: return); the module's text."""
    a += ["  %i1 = add i64 %i, 1", "  %more = icmp ult i64 %i1, %n", "  br i1 %more, label %loop, label %done",
          "done:", "  ret void", "}"]
    return "\n".join(a) + "\n"


def _butterfly(w, d: int, fma: bool = False) -> int:
    """Emit the unnormalised Walsh-Hadamard butterfly of ``%z0`` (``<d x float>``): stage ``h`` is ``p = z[j ^ h]``
    then ``z[j] + p`` where bit ``h`` of ``j`` is clear and ``p - z[j]`` where it is set (the pair ``(a + b, a -
    b)``); the result is ``%z{k}`` for the returned ``k``.  ``fma``: each stage is one fused multiply-add
    ``fma(z[j], +-1, p)`` (``@llvm.fma``; the caller declares it): ``z[j] * +-1`` is exact, so its one rounding is
    that of ``z[j] + p`` or ``p - z[j]`` (the same bits, signed zeros included), in one instruction where the
    other form takes an add, a subtract and a blend."""
    F = f"<{d} x float>"
    h, k = 1, 0
    while h < d:
        perm = _vec(d, "i32", [j ^ h for j in range(d)])
        w(f"  %p{k} = shufflevector {F} %z{k}, {F} poison, <{d} x i32> {perm}")
        if fma:
            pm = _vec(d, "float", ["-1.0" if j & h else "1.0" for j in range(d)])
            w(f"  %z{k + 1} = call {F} @llvm.fma.v{d}f32({F} %z{k}, {F} {pm}, {F} %p{k})")
        else:
            bits = _vec(d, "i1", ["true" if j & h else "false" for j in range(d)])
            w(f"  %add{k} = fadd {F} %z{k}, %p{k}")
            w(f"  %sub{k} = fsub {F} %p{k}, %z{k}")
            w(f"  %z{k + 1} = select <{d} x i1> {bits}, {F} %sub{k}, {F} %add{k}")
        h, k = 2 * h, k + 1
    return k


def _ir(d: int, bf16: bool, fma: bool = False, finite: bool = False) -> str:
    """``void rot(i16* syms, float* norms, float* sign, out*, rows, T, heads, sB, sH, sT, i32 off, float step,
    float inv_d)``: row ``i = r * T + t`` of ``syms [rows, T, D]`` (and ``norms [rows, T]``) is written at byte
    ``(r / heads) * sB + (r % heads) * sH + t * sT`` of ``out``, ``D`` float32 or bfloat16 words.  ``fma``: the
    butterfly's stages as fused multiply-adds (:func:`_butterfly`), and ``(z * sign) * (1 / D)`` as ``z * (sign *
    (1 / D))`` (``sign`` is +-1 and rounding is symmetric in sign: the same bits).  ``finite``: no value is NaN
    (:func:`_finite`), so the bfloat16 rounding leaves out its NaN case."""
    F, I32 = f"<{d} x float>", f"<{d} x i32>"
    splat = f"<{d} x i32> zeroinitializer"
    a = []
    w = a.append
    if fma:
        w(f"declare {F} @llvm.fma.v{d}f32({F}, {F}, {F})")
    w("define void @rot(ptr %syms, ptr %norms, ptr %sign, ptr %out, i64 %rows, i64 %T, i64 %heads, i64 %sB, "
      "i64 %sH, i64 %sT, i32 %off, float %step, float %invd) {")
    w("entry:")
    w(f"  %sg = load {F}, ptr %sign, align 4")
    for name, ty, val in (("offv", "i32", "%off"), ("stepv", "float", "%step"), ("invdv", "float", "%invd")):
        vt = I32 if ty == "i32" else F
        w(f"  %{name}.0 = insertelement {vt} poison, {ty} {val}, i64 0")
        w(f"  %{name} = shufflevector {vt} %{name}.0, {vt} poison, {splat}")
    if fma:
        w(f"  %sgi = fmul {F} %sg, %invdv")
    w("  %n = mul i64 %rows, %T")
    w("  %empty = icmp eq i64 %n, 0")
    w("  br i1 %empty, label %done, label %loop")
    w("loop:")
    w("  %i = phi i64 [0, %entry], [%i1, %loop]")
    w("  %r = udiv i64 %i, %T")
    w("  %t = urem i64 %i, %T")
    w("  %ob = udiv i64 %r, %heads")
    w("  %oh = urem i64 %r, %heads")
    _symbols(w, d)
    w(f"  %z0 = fmul {F} %qf, %stepv")
    k = _butterfly(w, d, fma)
    w("  %np = getelementptr float, ptr %norms, i64 %i")
    w("  %nr = load float, ptr %np, align 4")
    w(f"  %nrv.0 = insertelement {F} poison, float %nr, i64 0")
    w(f"  %nrv = shufflevector {F} %nrv.0, {F} poison, {splat}")
    if fma:
        w(f"  %y2 = fmul {F} %z{k}, %sgi")
    else:
        w(f"  %y1 = fmul {F} %z{k}, %sg")
        w(f"  %y2 = fmul {F} %y1, %invdv")
    w(f"  %y3 = fmul {F} %y2, %nrv")
    w("  %o1 = mul i64 %ob, %sB")
    w("  %o2 = mul i64 %oh, %sH")
    w("  %o3 = mul i64 %t, %sT")
    w("  %o12 = add i64 %o1, %o2")
    w("  %o = add i64 %o12, %o3")
    w("  %op = getelementptr i8, ptr %out, i64 %o")
    _store(w, d, bf16, "%y3", "%op", finite)
    return _row_loop_end(a)


def _symbols(w, d: int) -> None:
    """Emit ``%qf`` (``<d x float>``): row ``%i`` of ``%syms`` (``d`` uint16 symbols) plus ``%offv``, converted
    from 32-bit integers (exact as the spec's 64-bit sum whenever the sum fits 32 bits)."""
    F, I32, I16 = f"<{d} x float>", f"<{d} x i32>", f"<{d} x i16>"
    w(f"  %si = mul i64 %i, {d}")
    w("  %sp = getelementptr i16, ptr %syms, i64 %si")
    w(f"  %s = load {I16}, ptr %sp, align 2")
    w(f"  %s32 = zext {I16} %s to {I32}")
    w(f"  %q = add {I32} %s32, %offv")
    w(f"  %qf = sitofp {I32} %q to {F}")


def _store(w, d: int, bf16: bool, value: str, ptr: str, finite: bool = False) -> None:
    """Emit the store of ``value`` (``<d x float>``) at ``ptr``: as float32, or rounded to bfloat16 (nearest
    even, :func:`kvcodec.codecs._vq_numba.f32_to_bf16`'s rule: a NaN stays a quiet NaN) in integer ops; with
    ``finite`` (the caller knows no value is NaN) without the NaN case."""
    F, I32, I16 = f"<{d} x float>", f"<{d} x i32>", f"<{d} x i16>"
    if not bf16:
        w(f"  store {F} {value}, ptr {ptr}, align 4")
        return

    def c(v):
        return _vec(d, "i32", [v] * d)
    w(f"  %wb = bitcast {F} {value} to {I32}")
    w(f"  %hi = lshr {I32} %wb, {c(16)}")
    w(f"  %lsb = and {I32} %hi, {c(1)}")
    w(f"  %rb = add {I32} %wb, {c(0x7FFF)}")
    w(f"  %rb2 = add {I32} %rb, %lsb")
    w(f"  %rn = lshr {I32} %rb2, {c(16)}")
    sel = "%rn"
    if not finite:
        w(f"  %abs = and {I32} %wb, {c(0x7FFFFFFF)}")
        w(f"  %isnan = icmp ugt {I32} %abs, {c(0x7F800000)}")
        w(f"  %qn = or {I32} %hi, {c(0x40)}")
        w(f"  %sel = select <{d} x i1> %isnan, {I32} %qn, {I32} %rn")
        sel = "%sel"
    w(f"  %bf = trunc {I32} {sel} to {I16}")
    w(f"  store {I16} %bf, ptr {ptr}, align 2")


#: the butterflies as fused multiply-adds where the CPU has them (the same bits; a study knob: False builds the
#: add / subtract / blend form everywhere)
FUSED = True


def _fused(features: str) -> bool:
    """Whether the kernels built for a CPU with these (comma-separated) features use fused multiply-adds:
    without the instruction LLVM would call a library function per element."""
    return FUSED and "+fma" in features.split(",")


def _kernel(d: int, bf16: bool, finite: bool = False):
    return _lanes_simd.jit(*_rotation(d, bf16, finite), "rot", None, _ARGTYPES)[0]


def _rotation(d: int, bf16: bool, finite: bool):
    """(the reconstruction kernel's key, the function of the CPU's features that writes its IR)."""
    return ("rotate", d, bf16, finite, FUSED), lambda features: _ir(d, bf16, _fused(features), finite)


def assembly(d: int, bf16: bool, finite: bool = False) -> str:
    """The reconstruction kernel's machine code for this CPU, as text."""
    return _lanes_simd.jit_assembly(*_rotation(d, bf16, finite), "rot", None, _ARGTYPES)


def _finite(offset: int, step, norms) -> bool:
    """Whether no reconstructed value can be NaN (nor infinite): finite ``norms`` (float16 values widened, so below
    65536) and ``|symbol + offset| * step < 2**110`` for every 16-bit symbol; then ``|z| < 2**118`` after the
    butterfly (``D <= 128`` stages of sums, roundings included), ``|z / D| < 2**111`` and the result, times a norm,
    stays below ``2**127``.  Any file with a sane Step passes; a hostile one takes the kernel with the NaN case."""
    step = float(step)
    return (0 < step and max(abs(offset), abs(offset + 65535)) * step < 2.0 ** 110
            and bool(np.isfinite(norms).all()))


def _layout(syms, offset: int, out) -> bool:
    """What :func:`rotate` and :func:`dequant` both need: a compiled ``D``, aligned contiguous uint16 symbols
    ``[B*H, T, D]``, an aligned writeable ``out [B, H, T, D]`` of float32 / uint32 / uint16 words with rows
    contiguous, ``symbol + offset`` inside 32 bits, and the vector kernels on (``KVCODEC_VECTOR=0``: never)."""
    if syms.ndim != 3 or syms.shape[2] not in DIMS:
        return False
    if not (syms.flags.c_contiguous and syms.flags.aligned and syms.dtype == np.uint16 and out.ndim == 4):
        return False
    if out.shape[3] != syms.shape[2] or out.shape[0] * out.shape[1] != syms.shape[0] or out.shape[2] != syms.shape[1]:
        return False
    if out.dtype not in (np.float32, np.uint32, np.uint16) or out.strides[3] != out.itemsize:
        return False
    if not (out.flags.writeable and out.flags.aligned) or not -(2 ** 31) <= offset or offset + 65535 >= 2 ** 31:
        return False
    return rans.vector_kernels()


def usable(syms, offset: int, out) -> bool:
    """Whether :func:`rotate` takes these arrays (:func:`_layout`) on this machine."""
    bf16 = out.dtype == np.uint16
    return _layout(syms, offset, out) and _builds(("rotate", syms.shape[2], bf16),
                                                  lambda: _kernel(syms.shape[2], bf16, bf16))


_BUILT: dict = {}


def _builds(key, build) -> bool:
    """Whether this machine compiles the kernel ``build()`` makes (checked once per ``key``; a failure means: use
    the Numba kernels or the NumPy formulation)."""
    if key not in _BUILT:
        try:
            build()
            _BUILT[key] = True
        except Exception:  # noqa: BLE001 - any failure to build means: use the other path
            _BUILT[key] = False
    return _BUILT[key]


def rotate(syms, offset: int, step, sign, inv_d, norms, out) -> None:
    """Method 1's reconstruction of ``syms [B*H, T, D]`` (uint16) with ``norms [B*H, T]`` into ``out [B, H, T,
    D]`` (float32 or its uint32 bit patterns, or uint16 bfloat16 patterns rounded to nearest even); callers check
    :func:`usable` first; ``sign`` is +-1."""
    rows, t, d = syms.shape
    norms = np.ascontiguousarray(norms, dtype=np.float32)
    sign = np.ascontiguousarray(sign, dtype=np.float32)
    if not usable(syms, offset, out) or norms.shape != (rows, t) or sign.shape != (d,) or (abs(sign) != 1).any():
        raise ValueError(f"rotate: symbols {syms.shape} {syms.dtype}, norms {norms.shape}, signs {sign.shape}, "
                         f"output {out.shape} {out.dtype} do not fit the vector kernel (check usable() first)")
    bf16 = out.dtype == np.uint16
    fn = _kernel(d, bf16, bf16 and _finite(offset, step, norms))
    fn(syms.ctypes.data, norms.ctypes.data, sign.ctypes.data, out.ctypes.data, rows, t, out.shape[1],
       out.strides[0], out.strides[1], out.strides[2], int(offset), float(step), float(inv_d))


# --- Method 5: a step per head and channel ----------------------------------------------------------------------

_DQ_ARGS = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 7 + [ctypes.c_int32]


def _dequant_ir(d: int, bf16: bool) -> str:
    """``void dq(i16* syms, float* steps, out*, rows, T, heads, nsteps, sB, sH, sT, i32 off)``: row ``r`` of
    ``syms [rows, T, D]`` times the steps ``steps[r % nsteps]`` (``<D x float>``) is written at byte ``(r / heads)
    * sB + (r % heads) * sH + t * sT`` of ``out``: ``float32(symbol + off) * step``, one binary32 product (the
    Numba kernel's), stored as float32 or rounded to bfloat16."""
    F, I32 = f"<{d} x float>", f"<{d} x i32>"
    a = []
    w = a.append
    w("define void @dq(ptr %syms, ptr %steps, ptr %out, i64 %rows, i64 %T, i64 %heads, i64 %nsteps, i64 %sB, "
      "i64 %sH, i64 %sT, i32 %off) {")
    w("entry:")
    w(f"  %offv.0 = insertelement {I32} poison, i32 %off, i64 0")
    w(f"  %offv = shufflevector {I32} %offv.0, {I32} poison, <{d} x i32> zeroinitializer")
    w("  %n = mul i64 %rows, %T")
    w("  %empty = icmp eq i64 %n, 0")
    w("  br i1 %empty, label %done, label %rloop")
    w("rloop:")
    w("  %r = phi i64 [0, %entry], [%r1, %rend]")
    w("  %ob = udiv i64 %r, %heads")
    w("  %oh = urem i64 %r, %heads")
    w("  %o1 = mul i64 %ob, %sB")
    w("  %o2 = mul i64 %oh, %sH")
    w("  %o12 = add i64 %o1, %o2")
    w("  %sr = urem i64 %r, %nsteps")
    w(f"  %sri = mul i64 %sr, {d}")
    w("  %stp = getelementptr float, ptr %steps, i64 %sri")
    w(f"  %st = load {F}, ptr %stp, align 4")
    w("  %ibase = mul i64 %r, %T")
    w("  br label %loop")
    w("loop:")
    w("  %t = phi i64 [0, %rloop], [%t1, %loop]")
    w("  %i = add i64 %ibase, %t")
    _symbols(w, d)
    w(f"  %y = fmul {F} %qf, %st")
    w("  %o3 = mul i64 %t, %sT")
    w("  %o = add i64 %o12, %o3")
    w("  %op = getelementptr i8, ptr %out, i64 %o")
    _store(w, d, bf16, "%y", "%op")
    a += ["  %t1 = add i64 %t, 1", "  %tmore = icmp ult i64 %t1, %T", "  br i1 %tmore, label %loop, label %rend",
          "rend:", "  %r1 = add i64 %r, 1", "  %rmore = icmp ult i64 %r1, %rows",
          "  br i1 %rmore, label %rloop, label %done", "done:", "  ret void", "}"]
    return "\n".join(a) + "\n"


def _dequant_kernel(d: int, bf16: bool):
    return _lanes_simd.jit(("dequant", d, bf16), lambda features: _dequant_ir(d, bf16), "dq", None, _DQ_ARGS)[0]


def dequant_usable(syms, offset: int, steps, out) -> bool:
    """Whether :func:`dequant` takes these arrays (:func:`_layout`, and aligned contiguous float32 steps
    ``[H, D]``) on this machine."""
    if steps.ndim != 2 or steps.shape[0] < 1 or steps.shape[1:] != syms.shape[2:] or steps.dtype != np.float32:
        return False
    if not (steps.flags.c_contiguous and steps.flags.aligned) or not _layout(syms, offset, out):
        return False
    bf16 = out.dtype == np.uint16
    return _builds(("dequant", syms.shape[2], bf16), lambda: _dequant_kernel(syms.shape[2], bf16))


def dequant(syms, offset: int, steps, out) -> None:
    """Method 5's reconstruction of ``syms [B*H, T, D]`` (uint16) with ``steps [H, D]`` (float32; row ``r`` takes
    ``steps[r % H]``) into ``out [B, H, T, D]`` (float32 or its uint32 bit patterns, or uint16 bfloat16 patterns
    rounded to nearest even): :func:`kvcodec.codecs._vq_numba.channel_dequant_into`'s bits; callers check
    :func:`dequant_usable` first."""
    if not dequant_usable(syms, offset, steps, out):
        raise ValueError(f"dequant: symbols {syms.shape} {syms.dtype}, steps {steps.shape} {steps.dtype}, output "
                         f"{out.shape} {out.dtype} do not fit the vector kernel (check dequant_usable() first)")
    rows, t, d = syms.shape
    fn = _dequant_kernel(d, out.dtype == np.uint16)
    fn(syms.ctypes.data, steps.ctypes.data, out.ctypes.data, rows, t, out.shape[1], steps.shape[0], out.strides[0],
       out.strides[1], out.strides[2], int(offset))


# --- the encoder's forward rotation -----------------------------------------------------------------------------

_FWD_ARGS = [ctypes.c_void_p] * 5 + [ctypes.c_int64, ctypes.c_float]


def _forward_ir(d: int, fma: bool = False) -> str:
    """``void fwd(float* x, float* norms, float* sign, float* z, float* q, i64 n, float step)``: for each row
    ``i`` of ``x [n, D]``, ``u = x / (norm if norm > 0 else 1)`` (0 where the norm is 0), ``z = WHT(u * sign)``
    (unnormalised, the butterfly of :func:`kvcodec.codecs.hadamard.fwht`) and ``q = rint(z / step)`` (ties to
    even), each a binary32 operation in the NumPy formulation's order (:func:`kvcodec.codecs.vq_rans.directions`,
    then ``np.rint(z / step)``): the same bits."""
    F = f"<{d} x float>"
    splat = f"<{d} x i32> zeroinitializer"
    a = []
    w = a.append
    w(f"declare {F} @llvm.roundeven.v{d}f32({F})")
    if fma:
        w(f"declare {F} @llvm.fma.v{d}f32({F}, {F}, {F})")
    w("define void @fwd(ptr %x, ptr %norms, ptr %sign, ptr %zout, ptr %qout, i64 %n, float %step) {")
    w("entry:")
    w(f"  %sg = load {F}, ptr %sign, align 4")
    w(f"  %stepv.0 = insertelement {F} poison, float %step, i64 0")
    w(f"  %stepv = shufflevector {F} %stepv.0, {F} poison, {splat}")
    w("  %empty = icmp eq i64 %n, 0")
    w("  br i1 %empty, label %done, label %loop")
    w("loop:")
    w("  %i = phi i64 [0, %entry], [%i1, %next]")
    w(f"  %xi = mul i64 %i, {d}")
    w("  %xp = getelementptr float, ptr %x, i64 %xi")
    w(f"  %xv = load {F}, ptr %xp, align 4")
    w("  %np = getelementptr float, ptr %norms, i64 %i")
    w("  %nr = load float, ptr %np, align 4")
    w("  %pos = fcmp ogt float %nr, 0.0")
    w("  %safe = select i1 %pos, float %nr, float 1.0")
    w(f"  %sv.0 = insertelement {F} poison, float %safe, i64 0")
    w(f"  %sv = shufflevector {F} %sv.0, {F} poison, {splat}")
    w(f"  %u0 = fdiv {F} %xv, %sv")
    w("  %zero = fcmp oeq float %nr, 0.0")
    w(f"  %u1 = select i1 %zero, {F} zeroinitializer, {F} %u0")
    w(f"  %z0 = fmul {F} %u1, %sg")
    k = _butterfly(w, d, fma)
    w("  %zp = getelementptr float, ptr %zout, i64 %xi")
    w(f"  store {F} %z{k}, ptr %zp, align 4")
    w("  %hasq = icmp ne ptr %qout, null")
    w("  br i1 %hasq, label %quant, label %next")
    w("quant:")
    w(f"  %zs = fdiv {F} %z{k}, %stepv")
    w(f"  %qr = call {F} @llvm.roundeven.v{d}f32({F} %zs)")
    w("  %qp = getelementptr float, ptr %qout, i64 %xi")
    w(f"  store {F} %qr, ptr %qp, align 4")
    w("  br label %next")
    w("next:")
    return _row_loop_end(a)


def _forward_kernel(d: int):
    return _lanes_simd.jit(("forward", d, FUSED), lambda features: _forward_ir(d, _fused(features)), "fwd", None,
                           _FWD_ARGS)[0]


def forward_usable(d: int) -> bool:
    """Whether :func:`forward` runs for head dimension ``d`` on this machine (``KVCODEC_VECTOR=0``: never)."""
    return d in DIMS and rans.vector_kernels() and _builds(("forward", d), lambda: _forward_kernel(d))


def forward(x: np.ndarray, n32: np.ndarray, sign: np.ndarray, step=None):
    """``(z, q)``: the encoder's rotated coordinates of ``x [N, D]`` (float32) with norms ``n32 [N]`` (float32,
    the float16 norms widened) and, if ``step`` is given, ``q = rint(z / step)`` (float32); ``q`` is None
    otherwise.  Callers check :func:`forward_usable` first."""
    n, d = x.shape
    x = np.ascontiguousarray(x, dtype=np.float32)
    n32 = np.ascontiguousarray(n32, dtype=np.float32)
    sign = np.ascontiguousarray(sign, dtype=np.float32)
    if not forward_usable(d) or n32.shape != (n,) or sign.shape != (d,):
        raise ValueError(f"forward: vectors {x.shape}, norms {n32.shape}, signs {sign.shape} do not fit the vector "
                         "kernel (check forward_usable() first)")
    z = np.empty((n, d), dtype=np.float32)
    q = None if step is None else np.empty((n, d), dtype=np.float32)
    _forward_kernel(d)(x.ctypes.data, n32.ctypes.data, sign.ctypes.data, z.ctypes.data,
                       None if q is None else q.ctypes.data, n, float(np.float32(0.0 if step is None else step)))
    return z, q


def _norms_ir(d: int) -> str:
    """``void norms(float* x, double* out, i64 n)``: ``out[i] = sqrt(sum_j x[i, j]**2)`` in binary64, summed in
    the order of NumPy's pairwise sum for a row of ``d <= 128`` values (what ``np.linalg.norm(x.astype(np.float64),
    axis=1)`` computes): eight partial sums ``r[k]`` over ``x[i, 8 m + k]`` for m = 0, 1, ..., then
    ``((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))``."""
    F8, D8 = "<8 x float>", "<8 x double>"
    a = []
    w = a.append
    w("declare double @llvm.sqrt.f64(double)")
    w("define void @norms(ptr %x, ptr %out, i64 %n) {")
    w("entry:")
    w("  %empty = icmp eq i64 %n, 0")
    w("  br i1 %empty, label %done, label %loop")
    w("loop:")
    w("  %i = phi i64 [0, %entry], [%i1, %loop]")
    w(f"  %xi = mul i64 %i, {d}")
    for m in range(d // 8):
        w(f"  %p{m} = getelementptr float, ptr %x, i64 %xi")
        w(f"  %q{m} = getelementptr float, ptr %p{m}, i64 {8 * m}")
        w(f"  %v{m} = load {F8}, ptr %q{m}, align 4")
        w(f"  %e{m} = fpext {F8} %v{m} to {D8}")
        w(f"  %s{m} = fmul {D8} %e{m}, %e{m}")
    acc = "%s0"
    for m in range(1, d // 8):
        w(f"  %r{m} = fadd {D8} {acc}, %s{m}")
        acc = f"%r{m}"
    for k in range(8):
        w(f"  %k{k} = extractelement {D8} {acc}, i64 {k}")
    w("  %a01 = fadd double %k0, %k1")
    w("  %a23 = fadd double %k2, %k3")
    w("  %a45 = fadd double %k4, %k5")
    w("  %a67 = fadd double %k6, %k7")
    w("  %a03 = fadd double %a01, %a23")
    w("  %a47 = fadd double %a45, %a67")
    w("  %sum = fadd double %a03, %a47")
    w("  %nr = call double @llvm.sqrt.f64(double %sum)")
    w("  %op = getelementptr double, ptr %out, i64 %i")
    w("  store double %nr, ptr %op, align 8")
    return _row_loop_end(a)


def norms(x: np.ndarray) -> np.ndarray:
    """``np.linalg.norm(x.astype(np.float64), axis=1)`` of float32 ``x [N, D]`` (D in :data:`DIMS`) in one pass,
    the same binary64 operations in NumPy's order (the tests compare with the installed NumPy)."""
    n, d = x.shape
    x = np.ascontiguousarray(x, dtype=np.float32)
    if d not in DIMS:
        raise ValueError(f"norms: head dimension {d} is not compiled here")
    out = np.empty(n, dtype=np.float64)
    fn = _lanes_simd.jit(("norms", d), lambda features: _norms_ir(d), "norms", None,
                         [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64])[0]
    fn(x.ctypes.data, out.ctypes.data, n)
    return out
