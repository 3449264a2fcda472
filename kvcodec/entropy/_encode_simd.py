"""The lane encoder as explicit vector code (issue 16): LLVM IR compiled by llvmlite for the host CPU at first use,
like the decoders of :mod:`._lanes_simd`, writing the words :func:`._rans_numba.lanes_encode` writes.

A lane group is one ``<W x i32>`` vector of states.  Per step (tokens backwards, as rANS encodes):

* the symbols of the group's rows at this token and the previous one are two vector loads (a group's rows are
  adjacent channels of one head, so the encoder reads the cache's own ``[BH, tokens, D]`` layout); the previous
  symbol's class picks each lane's table (``ctx_map[row, class]``, gathered once per group for the six classes)
  and one gather fetches every lane's ``freq | cum << 16`` from the encoder table;
* the lanes whose state is too large (``x >> (32 - Scale_Bits) >= freq``) emit their low 16 bits.  The words are
  stored *backwards* from the end of the output, a step's words in lane order by one compress-store, so the
  buffer needs no reversal: the stored stream is read front to back, the lanes of a step in lane order, as the
  decoder takes them (spec "rANS stream");
* ``x = x + cum + (x div freq) * (2**Scale_Bits - freq)``.  The quotient is ``trunc(fma(x, 1/freq, 2**-16))``
  in binary64, which is exact: with ``v = x / freq = q + r / freq`` (``r / freq <= 1 - 2**-15`` since
  ``freq <= 2**15``), the rounded reciprocal and the fused multiply-add's one rounding are each within 2**-21 of
  exact for ``x < 2**32``, so the result lies in ``[v + 2**-16 - 2**-20, v + 2**-16 + 2**-20]``, strictly
  between ``q`` and ``q + 1``.  The reciprocal depends only on the table entry, not on the state, so the
  division is off the state's dependency chain.

The states of the lanes chain from group to group (the format's), so a stream is one dependency chain per lane;
its latency (~30 cycles per step) is what one call costs.  Integer arithmetic and an exact division: every machine
writes the same words (tests compare with the Numba encoder and the pure-Python reference).
"""

from __future__ import annotations

import ctypes

import numpy as np

from ._lanes_simd import PERMD, class_constants, class_table, jit, jit_assembly
from ._rans_numba import RANS_L


def _compact_table(W: int) -> str:
    """The constant ``@compact``: for each mask of emitting lanes, ``W`` lane numbers that move the emitting lanes'
    states, in lane order, to the vector's last positions (the others: lane 0, stored below the words and
    overwritten by later steps)."""
    rows = []
    for m in range(1 << W):
        sel = [j for j in range(W) if m >> j & 1]
        rows.append([0] * (W - len(sel)) + sel)
    body = ", ".join(f"i32 {v}" for r in rows for v in r)
    return f"@compact = private unnamed_addr constant [{W << W} x i32] [{body}], align 32"


def _ir(W: int, permd: str | None = None) -> str:
    V = f"<{W} x i32>"
    V16 = f"<{W} x i16>"
    VD = f"<{W} x double>"
    M = f"<{W} x i1>"
    P = f"<{W} x ptr>"
    iW = f"i{W}"
    g32 = f"@llvm.masked.gather.v{W}i32.v{W}p0"
    ones = f"<{W} x i1> splat (i1 true)"
    e = []
    a = e.append

    def splat(name, ty, scalar):
        a(f"  %{name}.i = insertelement <{W} x {ty}> poison, {ty} {scalar}, i64 0")
        a(f"  %{name} = shufflevector <{W} x {ty}> %{name}.i, <{W} x {ty}> poison, <{W} x i32> zeroinitializer")
        return f"%{name}"

    a(f"declare {V} {g32}({P}, i32, {M}, {V})")
    a(f"declare void @llvm.masked.compressstore.v{W}i16({V16}, ptr, {M})")
    a(f"declare {iW} @llvm.ctpop.{iW}({iW})")
    a(f"declare {VD} @llvm.fma.v{W}f64({VD}, {VD}, {VD})")
    if permd:
        a(f"declare {V} {permd}({V}, {V})")
        a(_compact_table(W))
    # syms[bh, t, d] (uint16), rows = bh * dim + d, dim a multiple of W; refs[row]; ctx[row * nclass + class]
    # (uint8, 3 bytes of padding); tab[table << kbits | symbol] = freq | cum << 16; out (uint16, outlen words)
    a("define i64 @enc(ptr noalias %syms, ptr noalias %refs, ptr noalias %ctx, ptr noalias %tab, i64 %rows, "
      "i64 %ntok, i64 %dim, i32 %sb, i32 %kbits, i32 %nclass, ptr noalias %out, i64 %outlen) {")
    a("entry:")
    lanes = ", ".join(f"i32 {j}" for j in range(W))
    a(f"  %ngroups = udiv i64 %rows, {W}")
    a("  %shift.s = sub i32 32, %sb")
    shiftv = splat("shiftv", "i32", "%shift.s")
    a("  %onesb.s = shl i32 1, %sb")
    onesbv = splat("onesbv", "i32", "%onesb.s")
    kbv = splat("kbv", "i32", "%kbits")
    kb1v, mmv = class_constants(a, splat)
    a("  %ncl64 = zext i32 %nclass to i64")
    nclv = splat("nclv", "i32", "%nclass")
    a(f"  %lanencl = mul {V} <{lanes}>, {nclv}")
    a("  %six = icmp eq i32 %nclass, 6")
    for c in range(6):
        a(f"  %coff{c}.a = add {V} %lanencl, splat (i32 {c})")
        a(f"  %coff{c} = select i1 %six, {V} %coff{c}.a, {V} %lanencl")
    a("  %tdim = mul i64 %ntok, %dim")
    a("  br label %gloop")
    # --- groups, last to first
    a("gloop:")
    a("  %g = phi i64 [%ngroups, %entry], [%gi, %gend]")
    a(f"  %xg = phi {V} [splat (i32 {RANS_L}), %entry], [%x, %gend]")
    a("  %wg = phi i64 [%outlen, %entry], [%wpos, %gend]")
    a("  %gdone = icmp eq i64 %g, 0")
    a("  br i1 %gdone, label %flush, label %gbody")
    a("gbody:")
    a("  %gi = sub i64 %g, 1")
    a(f"  %g0 = mul i64 %gi, {W}")
    a("  %rptr = getelementptr i16, ptr %refs, i64 %g0")
    a(f"  %ref16 = load {V16}, ptr %rptr, align 2")
    a(f"  %ref = zext {V16} %ref16 to {V}")
    a(f"  %rr = and {V} %ref, {mmv}")
    # the row's table for each class of the previous symbol, times 2**kbits: ctx_map[row, class] << kbits
    a("  %g0n = mul i64 %g0, %ncl64")
    a("  %cbp = getelementptr i8, ptr %ctx, i64 %g0n")
    for c in range(6):
        a(f"  %cptr{c} = getelementptr i8, ptr %cbp, {V} %coff{c}")
        a(f"  %cg{c} = call {V} {g32}({P} %cptr{c}, i32 1, {ones}, {V} zeroinitializer)")
        a(f"  %cm{c} = and {V} %cg{c}, splat (i32 255)")
        a(f"  %c{c} = shl {V} %cm{c}, {kbv}")
    # the group's first element: syms[bh, 0, d0] with bh = g0 / dim, d0 = g0 % dim
    a("  %bh = udiv i64 %g0, %dim")
    a("  %d0 = urem i64 %g0, %dim")
    a("  %bho = mul i64 %bh, %tdim")
    a("  %o0 = add i64 %bho, %d0")
    a("  %gbase = getelementptr i16, ptr %syms, i64 %o0")
    a("  %tlast = sub i64 %ntok, 1")
    a("  %olast = mul i64 %tlast, %dim")
    a("  %sp0 = getelementptr i16, ptr %gbase, i64 %olast")
    a(f"  %s016 = load {V16}, ptr %sp0, align 2")
    a(f"  %s0 = zext {V16} %s016 to {V}")
    a("  br label %tloop")
    # --- tokens, last to first
    a("tloop:")
    a("  %t = phi i64 [%ntok, %gbody], [%ti, %step]")
    a(f"  %x = phi {V} [%xg, %gbody], [%x.next, %step]")
    a("  %wpos = phi i64 [%wg, %gbody], [%wpos.next, %step]")
    a(f"  %s = phi {V} [%s0, %gbody], [%pz, %step]")
    a("  %tdone = icmp eq i64 %t, 0")
    a("  br i1 %tdone, label %gend, label %step")
    a("step:")
    a("  %ti = sub i64 %t, 1")
    a("  %hasp = icmp ugt i64 %ti, 0")
    a("  %tm1 = sub i64 %ti, 1")
    a("  %tp = select i1 %hasp, i64 %tm1, i64 0")
    a("  %op = mul i64 %tp, %dim")
    a("  %pptr = getelementptr i16, ptr %gbase, i64 %op")
    a(f"  %p16 = load {V16}, ptr %pptr, align 2")
    a(f"  %pz = zext {V16} %p16 to {V}")
    a(f"  %prev = select i1 %hasp, {V} %pz, {V} %ref")
    cb = class_table(a, W, "%prev", "%rr", mmv, kb1v)  # the class of the previous symbol picks the table
    a(f"  %idx = or {V} {cb}, %s")
    a(f"  %eptr = getelementptr i32, ptr %tab, {V} %idx")
    a(f"  %ent = call {V} {g32}({P} %eptr, i32 4, {ones}, {V} zeroinitializer)")
    a(f"  %f = and {V} %ent, splat (i32 65535)")
    a(f"  %cum = lshr {V} %ent, splat (i32 16)")
    # renormalisation: lanes with x >= freq << (32 - sb) emit their low word
    a(f"  %xhi = lshr {V} %x, {shiftv}")
    a(f"  %big = icmp uge {V} %xhi, %f")
    a(f"  %word = trunc {V} %x to {V16}")
    a(f"  %fb = bitcast {M} %big to {iW}")
    a(f"  %cnt = call {iW} @llvm.ctpop.{iW}({iW} %fb)")
    a(f"  %cnt64 = zext {iW} %cnt to i64")
    a("  %wpos.next = sub i64 %wpos, %cnt64")
    if permd:
        # no compress-store (AVX2 has none, and LLVM's expansion is a chain of branches on the mask, mispredicted
        # at random): the emitting lanes' words are permuted to the vector's last positions and all W words are
        # stored ending at the old position; the words below the new position are overwritten by later steps or
        # the flush (2 W words at least are still to come, so the store stays inside the buffer)
        a(f"  %fbx = zext {iW} %fb to i64")
        a(f"  %crow = mul i64 %fbx, {W}")
        a("  %cptr = getelementptr i32, ptr @compact, i64 %crow")
        a(f"  %ctl = load {V}, ptr %cptr, align 4")
        a(f"  %xp = call {V} {permd}({V} %x, {V} %ctl)")
        a(f"  %wp16 = trunc {V} %xp to {V16}")
        a(f"  %wlow = sub i64 %wpos, {W}")
        a("  %wptr = getelementptr i16, ptr %out, i64 %wlow")
        a(f"  store {V16} %wp16, ptr %wptr, align 2")
    else:
        a("  %wptr = getelementptr i16, ptr %out, i64 %wpos.next")
        a(f"  call void @llvm.masked.compressstore.v{W}i16({V16} %word, ptr %wptr, {M} %big)")
    a(f"  %x16 = lshr {V} %x, splat (i32 16)")
    a(f"  %xr = select {M} %big, {V} %x16, {V} %x")
    # x + cum + (x div f) * (2**sb - f); the quotient by exact binary64 division
    a(f"  %fd = uitofp {V} %f to {VD}")
    a(f"  %rcp = fdiv {VD} splat (double 1.0), %fd")
    a(f"  %xd = uitofp {V} %xr to {VD}")
    a(f"  %qd = call {VD} @llvm.fma.v{W}f64({VD} %xd, {VD} %rcp, {VD} splat (double 0x3EF0000000000000))")
    a(f"  %q = fptoui {VD} %qd to {V}")
    a(f"  %cmpl = sub {V} {onesbv}, %f")
    a(f"  %qc = mul {V} %q, %cmpl")
    a(f"  %xc = add {V} %xr, %cum")
    a(f"  %x.next = add {V} %xc, %qc")
    a("  br label %tloop")
    a("gend:")
    a("  br label %gloop")
    # flush: reading order starts with state 0's high word, then its low word, then state 1's, ...
    a("flush:")
    a(f"  %fhi32 = lshr {V} %xg, splat (i32 16)")
    a(f"  %fhi = trunc {V} %fhi32 to {V16}")
    a(f"  %flo = trunc {V} %xg to {V16}")
    inter = ", ".join(f"i32 {j // 2 + (W if j % 2 else 0)}" for j in range(2 * W))
    a(f"  %fl = shufflevector {V16} %fhi, {V16} %flo, <{2 * W} x i32> <{inter}>")
    a(f"  %wf = sub i64 %wg, {2 * W}")
    a("  %fptr = getelementptr i16, ptr %out, i64 %wf")
    a(f"  store <{2 * W} x i16> %fl, ptr %fptr, align 2")
    a("  ret i64 %wf")
    a("}")
    return "\n".join(e) + "\n"


_ARGTYPES = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
             ctypes.c_int64, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64]


def _build(W: int):
    feat, permd = PERMD.get(W, (None, None))
    return lambda features: _ir(W, permd if feat in features.split(",") else None)


def kernel(W: int):
    """The compiled encoder of ``W`` lanes for this CPU (once per process)."""
    return jit(("encode", W), _build(W), "enc", ctypes.c_int64, _ARGTYPES)[0]


def available(W: int) -> bool:
    """Whether this machine compiles the ``W``-lane encoder (checked once per ``W``)."""
    got = _AVAILABLE.get(W)
    if got is None:
        try:
            kernel(W)
            got = True
        except Exception:  # noqa: BLE001 - any failure to build means: use the Numba encoder
            got = False
        _AVAILABLE[W] = got
    return got


_AVAILABLE: dict = {}


def assembly(W: int) -> str:
    return jit_assembly(("encode", W), _build(W), "enc", ctypes.c_int64, _ARGTYPES)


def _nearest_ir(G: int) -> str:
    """``out[r]``: the first ``t < g`` of largest ``acc[t] = sum over sparse row r's entries k, in order, from
    0.0, of val[k] * logq[idx[k], t]``: one binary64 multiply and one add per term and table (no fused
    multiply-add, no reordering: the sums of :func:`._rans_numba.nearest_tables`), the ``G`` tables as one vector.
    The largest ``acc``, first on ties, is the least ``-acc``, first on ties (negation is exact, no NaN)."""
    VD = f"<{G} x double>"
    iG = f"i{G}"
    lanes = ", ".join(f"i64 {j}" for j in range(G))
    return "\n".join([
        f"declare double @llvm.vector.reduce.fmax.v{G}f64({VD})",
        f"declare {iG} @llvm.cttz.{iG}({iG}, i1)",
        "define void @near(ptr noalias %indptr, ptr noalias %idx, ptr noalias %val, ptr noalias %logq, i64 %nrows, "
        "i64 %g, ptr noalias %out) {",
        "entry:",
        f"  %gi = insertelement <{G} x i64> poison, i64 %g, i64 0",
        f"  %gv = shufflevector <{G} x i64> %gi, <{G} x i64> poison, <{G} x i32> zeroinitializer",
        f"  %live = icmp ult <{G} x i64> <{lanes}>, %gv",
        "  br label %rloop",
        "rloop:",
        "  %r = phi i64 [0, %entry], [%r.next, %rend]",
        "  %rdone = icmp eq i64 %r, %nrows",
        "  br i1 %rdone, label %done, label %rbody",
        "rbody:",
        "  %sp = getelementptr i64, ptr %indptr, i64 %r",
        "  %start = load i64, ptr %sp, align 8",
        "  %r.next = add i64 %r, 1",
        "  %ep = getelementptr i64, ptr %indptr, i64 %r.next",
        "  %end = load i64, ptr %ep, align 8",
        "  br label %kloop",
        "kloop:",
        "  %k = phi i64 [%start, %rbody], [%k.next, %kbody]",
        f"  %a = phi {VD} [zeroinitializer, %rbody], [%a.next, %kbody]",
        "  %kdone = icmp sge i64 %k, %end",
        "  br i1 %kdone, label %rend, label %kbody",
        "kbody:",
        "  %vp = getelementptr double, ptr %val, i64 %k",
        "  %v = load double, ptr %vp, align 8",
        "  %ip = getelementptr i64, ptr %idx, i64 %k",
        "  %s = load i64, ptr %ip, align 8",
        f"  %off = mul i64 %s, {G}",
        "  %lp = getelementptr double, ptr %logq, i64 %off",
        f"  %row = load {VD}, ptr %lp, align 8",
        f"  %vi = insertelement {VD} poison, double %v, i64 0",
        f"  %vv = shufflevector {VD} %vi, {VD} poison, <{G} x i32> zeroinitializer",
        f"  %prod = fmul {VD} %vv, %row",
        f"  %a.next = fadd {VD} %a, %prod",
        "  %k.next = add i64 %k, 1",
        "  br label %kloop",
        "rend:",
        f"  %am = select <{G} x i1> %live, {VD} %a, {VD} splat (double 0xFFF0000000000000)",
        f"  %mx = call nnan double @llvm.vector.reduce.fmax.v{G}f64({VD} %am)",  # finite sums, -inf: no NaN checks
        f"  %mi = insertelement {VD} poison, double %mx, i64 0",
        f"  %mv = shufflevector {VD} %mi, {VD} poison, <{G} x i32> zeroinitializer",
        f"  %eq = fcmp oeq {VD} %am, %mv",
        f"  %eqb = bitcast <{G} x i1> %eq to {iG}",
        f"  %first = call {iG} @llvm.cttz.{iG}({iG} %eqb, i1 false)",
        (f"  %first64 = zext {iG} %first to i64" if G < 64 else
         f"  %first64 = trunc {iG} %first to i64" if G > 64 else "  %first64 = add i64 %first, 0"),
        "  %op = getelementptr i64, ptr %out, i64 %r",
        "  store i64 %first64, ptr %op, align 8",
        "  br label %rloop",
        "done:",
        "  ret void",
        "}",
    ]) + "\n"


_NEAR_ARGS = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]


def padded_tables(g: int) -> int:
    """The vector width :func:`table_choice` takes ``g`` tables in: ``g`` rounded up to a multiple of 8."""
    return -(-g // 8) * 8


def nearest_usable(g: int) -> bool:
    """Whether the table-choice kernel for ``g`` tables builds on this machine (checked once per width)."""
    G = padded_tables(g)
    key = ("nearest", G)
    if key not in _AVAILABLE:
        try:
            jit(("nearest", G), lambda features: _nearest_ir(G), "near", None, _NEAR_ARGS)
            _AVAILABLE[key] = True
        except Exception:  # noqa: BLE001 - any failure to build means: use the Numba loop
            _AVAILABLE[key] = False
    return _AVAILABLE[key]


def checked_rows(indptr: np.ndarray, idx: np.ndarray, val: np.ndarray, used: int) -> tuple:
    """Copies of sparse rows (``indptr``, ``idx`` int64; ``val`` in its dtype) that index only inside their
    entries and ``used`` symbols (``ValueError`` otherwise): what the table choice reads at every k-means step
    is what was checked."""
    indptr, idx, val = np.array(indptr, dtype=np.int64), np.array(idx, dtype=np.int64), np.array(val)
    if indptr.size > 1 and not (indptr[0] == 0 and (np.diff(indptr) >= 0).all()
                                and indptr[-1] <= min(idx.size, val.size)
                                and (idx.size == 0 or 0 <= int(idx.min()) <= int(idx.max()) < used)):
        raise ValueError("table choice: the sparse rows index past their arrays or the symbols")
    return indptr, idx, val


def table_choice(indptr: np.ndarray, idx: np.ndarray, val: np.ndarray, logq_p: np.ndarray, g: int):
    """:func:`._rans_numba.nearest_tables` (the same sums in the same order, so the same tables) as a function
    of no arguments: for each sparse row the table ``t < g`` of least ``-sum_k val[k] * logq_p[idx[k], t]``,
    ties to the lowest ``t``, reading ``logq_p`` (C-contiguous float64 ``[symbols, padded_tables(g)]``, columns
    ``g..`` ignored) as it is when called: k-means fills it at every step; the rows' arrays are copied, converted
    and checked and the kernel found once.  ``logq_p``'s first ``g`` columns must be finite: the kernel's
    maximum assumes no NaN."""
    nrows = indptr.size - 1
    G = logq_p.shape[1]
    if not (G == padded_tables(g) and logq_p.flags.c_contiguous and logq_p.dtype == np.float64):
        raise ValueError(f"logq_p must be C-contiguous float64 [symbols, {padded_tables(g)}]")
    fn = jit(("nearest", G), lambda features: _nearest_ir(G), "near", None, _NEAR_ARGS)[0]
    indptr, idx, val = checked_rows(indptr, idx, val.astype(np.float64, copy=False), logq_p.shape[0])
    arrays = (indptr, idx, val, logq_p)  # held by the function: the kernel reads them through their addresses
    args = (*(a.ctypes.data for a in arrays), max(nrows, 0), g)

    def run(_alive=arrays) -> np.ndarray:
        out = np.empty(max(nrows, 0), dtype=np.int64)
        fn(*args, out.ctypes.data)
        return out
    return run


def encoder_table(freq: np.ndarray, cum: np.ndarray) -> np.ndarray:
    """``tab[c << kbits | s] = freq[c, s] | cum[c, s] << 16`` (uint32; ``freq`` and ``cum`` below 2**16)."""
    return (freq.astype(np.uint32) | (cum.astype(np.uint32) << np.uint32(16))).ravel()


def encode(syms: np.ndarray, refs: np.ndarray, ctx_map: np.ndarray, freq: np.ndarray, cum: np.ndarray,
           scale_bits: int, ways: int, kbits: int, nclass: int) -> np.ndarray:
    """The words of :func:`._rans_numba.lanes_encode` for the ``[rows, tokens]`` matrix ``syms3[bh].T``
    stacked (row ``bh * dim + d`` is ``syms3[bh, :, d]``), in reading order (uint16).  ``syms3`` is a
    C-contiguous uint16 ``[BH, tokens, dim]`` array with ``tokens >= 1`` and ``dim % ways == 0`` (a lane
    group's symbols at one token are then adjacent), ``freq`` / ``cum`` ``[tables, 2**kbits]`` with every coded
    symbol's frequency non-zero, ``nclass`` 1 or 6."""
    syms3 = syms
    bh, ntok, dim = syms3.shape
    rows = bh * dim
    assert syms3.dtype == np.uint16 and syms3.flags.c_contiguous and ntok >= 1 and dim % ways == 0
    assert nclass in (1, 6) and freq.shape[1] == 1 << kbits
    refs = np.ascontiguousarray(refs, dtype=np.uint16)
    if ctx_map.size and not 0 <= int(np.min(ctx_map)) <= int(np.max(ctx_map)) < min(256, freq.shape[0]):
        raise ValueError("ctx_map must name tables of freq (0 .. 255)")
    # the context map with 3 bytes of padding: each lookup is a 32-bit load at a byte offset
    ctx = np.zeros(rows * nclass + 3, dtype=np.uint8)
    ctx[:rows * nclass] = np.asarray(ctx_map, dtype=np.uint8).reshape(-1)
    tab = encoder_table(freq, cum)
    out = np.empty(syms3.size + 2 * ways, dtype=np.uint16)
    start = kernel(ways)(syms3.ctypes.data, refs.ctypes.data, ctx.ctypes.data, tab.ctypes.data, rows, ntok, dim,
                         scale_bits, kbits, nclass, out.ctypes.data, out.size)
    return out[start:]
