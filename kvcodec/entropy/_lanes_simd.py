"""The local-table lane decoders as explicit vector code (issue 16): LLVM IR written here, compiled by llvmlite
(Numba's own LLVM binding; Numba's typed Python has no vector types) for the host CPU at first use, ~60 ms.

The scalar ``fast_w*`` kernels (:mod:`._lanes_unrolled`) spend ~60 instructions per symbol because eight lanes'
states, previous symbols and references do not fit the general-purpose registers.  Here a lane group is one
vector: the states, the previous symbols and the context classes are ``<W x i32>`` registers and every table
lookup is one gather for all lanes.  The shared word cursor of the interleaved stream (lanes that need a word
take consecutive words in lane order, spec "rANS stream") is an exclusive prefix sum of the lanes' refill flags,
computed in registers; the W words after the cursor are loaded at once and moved to their lanes by a variable
permutation (AVX2 ``vpermd``; a gather elsewhere).  With one 32-bit table entry per slot (``direct``: freq - 1,
slot - cum and the symbol, when ``2 Scale_Bits + Coded_Bits <= 32``) a symbol costs one gather; when a step's
raw low bits fit 64 bits (bf16, fp16: 8 lanes x 6 bits) they come from one load, shifted apart per lane.

A single stream is latency-bound (gather -> state -> gather), so :func:`decode_many` runs :data:`STREAMS`
independent streams in one loop and their chains overlap (measured on SmolLM2 bf16 payloads, 1 thread: one
stream 1.9x the scalar kernel's speed, three 3.9x, four no better than three).

The bitstream is the one the scalar kernels read, and the arithmetic is integer only, so every machine decodes
the same words (tests compare with the scalar kernels and the pure-Python reference).  On a CPU without vector
gathers LLVM emits scalar loads for them: slower, never different.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import threading
from typing import NamedTuple

import numpy as np

from ._rans_numba import RANS_L

_LOCK = threading.Lock()
_COMPILED: dict = {}

#: raw low bits a lane reads with one 32-bit load at a byte offset (shift <= 7)
MAX_LOWBITS = 25


def _ir(W: int, K: int, ety: str, direct: bool, permd: str | None, narrow: bool = False, raw: bool = True,
        lut: bool = False) -> str:
    """The decoder of ``K`` streams of ``W`` lanes each (same shape and parameters, decoded in one loop so that
    their dependency chains overlap) writing ``ety`` (i16 / i32) words; see :func:`decode_many`.  ``narrow``:
    a step's ``W * lowbits`` raw bits fit one 64-bit load after a shift of up to 7 (:func:`narrow_raw`).
    ``raw`` False: the streams have no raw low bits (``lowbits`` 0, the lossy tier's index streams): the output
    words are the symbols, and the raw bits' loads and shifts are left out of the loop.  ``lut``: the refilling
    lanes' word offsets (an exclusive prefix sum of their flags) come from a table indexed by the flags' mask
    (:func:`_expand_table`, ``W <= 8``) instead of log2(W) shifts and adds in registers."""
    V = f"<{W} x i32>"
    M = f"<{W} x i1>"
    P = f"<{W} x ptr>"
    V64 = f"<{W} x i64>"
    iW = f"i{W}"
    gather = f"@llvm.masked.gather.v{W}i32.v{W}p0"
    ones = f"<{W} x i1> splat (i1 true)"
    e = []
    a = e.append

    def fold(op, name, flags):  # the i1 flags of the K streams combined by ``op``: the result's name
        acc = flags[0]
        for k in range(1, len(flags)):
            a(f"  %{name}.{k} = {op} i1 {acc}, {flags[k]}")
            acc = f"%{name}.{k}"
        return acc

    def splat(name, ty, scalar):
        a(f"  %{name}.i = insertelement <{W} x {ty}> poison, {ty} {scalar}, i64 0")
        a(f"  %{name} = shufflevector <{W} x {ty}> %{name}.i, <{W} x {ty}> poison, <{W} x i32> zeroinitializer")
        return f"%{name}"

    a(f"declare {V} {gather}({P}, i32, {M}, {V})")
    a(f"declare {iW} @llvm.ctpop.{iW}({iW})")
    a(f"declare {V64} @llvm.masked.gather.v{W}i64.v{W}p0({P}, i32, {M}, {V64})")
    if permd:
        a(f"declare {V} {permd}({V}, {V})")
    if lut:
        a(_expand_table(W))
    # args: per stream k, ptrs[8 k ..] = words, refs, ctx, tab, info, raw, out, rtail; nw[3 k ..] = nwords, rlim,
    # rts (the raw bits' tail copy, :class:`Prepared`); res[k] = final pos
    a("define i32 @dec(ptr noalias %ptrs, ptr noalias %nw, i64 %rows, i64 %ntok, i64 %dim, i32 %sb, i32 %kbits, "
      "i32 %lb, i32 %nclass, ptr noalias %res) {")
    a("entry:")
    names = ("words", "refs", "ctx", "tab", "info", "raw", "out", "rtail")
    even = ", ".join(f"i32 {2 * j}" for j in range(W))
    odd = ", ".join(f"i32 {2 * j + 1}" for j in range(W))
    for k in range(K):
        for i, nm in enumerate(names):
            a(f"  %{nm}.{k}.p = getelementptr ptr, ptr %ptrs, i64 {8 * k + i}")
            a(f"  %{nm}.{k} = load ptr, ptr %{nm}.{k}.p, align 8")
        for i, nm in enumerate(("nwords", "rlim", "rts")):
            a(f"  %{nm}.{k}.p = getelementptr i64, ptr %nw, i64 {3 * k + i}")
            a(f"  %{nm}.{k} = load i64, ptr %{nm}.{k}.p, align 8")
        a(f"  %w0.{k} = load <{2 * W} x i16>, ptr %words.{k}, align 1")
        a(f"  %hi.{k} = shufflevector <{2 * W} x i16> %w0.{k}, <{2 * W} x i16> poison, <{W} x i32> <{even}>")
        a(f"  %lo.{k} = shufflevector <{2 * W} x i16> %w0.{k}, <{2 * W} x i16> poison, <{W} x i32> <{odd}>")
        a(f"  %hi32.{k} = zext <{W} x i16> %hi.{k} to {V}")
        a(f"  %lo32.{k} = zext <{W} x i16> %lo.{k} to {V}")
        a(f"  %hish.{k} = shl {V} %hi32.{k}, splat (i32 16)")
        a(f"  %x0.{k} = or {V} %hish.{k}, %lo32.{k}")
    a("  %one.sb = shl i32 1, %sb")
    a("  %mask.s = sub i32 %one.sb, 1")
    maskv = splat("maskv", "i32", "%mask.s")
    sbv = splat("sbv", "i32", "%sb")
    a("  %sb8 = sub i32 %sb, 8")
    sb8v = splat("sb8v", "i32", "%sb8")
    kb1v, mmv = class_constants(a, splat)
    a("  %one.lb = shl i32 1, %lb")
    a("  %lmask.s = sub i32 %one.lb, 1")
    lmaskv = splat("lmaskv", "i32", "%lmask.s")
    lbv = splat("lbv", "i32", "%lb")
    Lv = f"splat (i32 {RANS_L})"
    lanes = ", ".join(f"i32 {j}" for j in range(W))
    a(f"  %lanelb = mul {V} <{lanes}>, {lbv}")
    a(f"  %lanelb64 = zext {V} %lanelb to {V64}")
    # offsets of the context map entries of a group's rows: lane * nclass + class (one column if nclass is 1)
    a("  %ncl64 = zext i32 %nclass to i64")
    nclv = splat("nclv", "i32", "%nclass")
    a(f"  %lanencl = mul {V} <{lanes}>, {nclv}")
    a("  %six = icmp eq i32 %nclass, 6")
    a(f"  %coff0.s = add {V} %lanencl, zeroinitializer")
    for c in range(1, 6):
        a(f"  %coff{c} = add {V} %lanencl, splat (i32 {c})")
        a(f"  %coff{c}.s = select i1 %six, {V} %coff{c}, {V} %lanencl")
    a("  %lb64 = zext i32 %lb to i64")
    a(f"  %steplb = mul i64 %lb64, {W}")
    a(f"  %ngroups = udiv i64 %rows, {W}")
    a("  %tdim = mul i64 %ntok, %dim")
    a("  br label %gloop")
    # --- groups of W rows
    a("gloop:")
    a("  %g = phi i64 [0, %entry], [%g.next, %gend]")
    for k in range(K):
        a(f"  %xg.{k} = phi {V} [%x0.{k}, %entry], [%x.{k}, %gend]")
        a(f"  %posg.{k} = phi i64 [{2 * W}, %entry], [%pos.{k}, %gend]")
    a("  %bpg = phi i64 [0, %entry], [%bp, %gend]")
    a("  %gdone = icmp uge i64 %g, %ngroups")
    a("  br i1 %gdone, label %finish, label %gbody")
    a("gbody:")
    a(f"  %g0 = mul i64 %g, {W}")
    a("  %g0n = mul i64 %g0, %ncl64")
    for k in range(K):
        a(f"  %rptr.{k} = getelementptr i16, ptr %refs.{k}, i64 %g0")
        a(f"  %rv16.{k} = load <{W} x i16>, ptr %rptr.{k}, align 2")
        a(f"  %pinit.{k} = zext <{W} x i16> %rv16.{k} to {V}")
        a(f"  %rr.{k} = and {V} %pinit.{k}, {mmv}")
        # the row's table for each class of the previous symbol, times 2**sb: ctx_map[row, class] << sb
        a(f"  %cbp.{k} = getelementptr i8, ptr %ctx.{k}, i64 %g0n")
        for c in range(6):
            a(f"  %cptr{c}.{k} = getelementptr i8, ptr %cbp.{k}, {V} %coff{c}.s")
            a(f"  %cg{c}.{k} = call {V} {gather}({P} %cptr{c}.{k}, i32 1, {ones}, {V} zeroinitializer)")
            a(f"  %cm{c}.{k} = and {V} %cg{c}.{k}, splat (i32 255)")
            a(f"  %c{c}.{k} = shl {V} %cm{c}.{k}, {sbv}")
    a("  %bh = udiv i64 %g0, %dim")
    a("  %dd = urem i64 %g0, %dim")
    a("  %bho = mul i64 %bh, %tdim")
    a("  %o0 = add i64 %bho, %dd")
    a("  br label %tloop")
    # --- tokens
    a("tloop:")
    a("  %t = phi i64 [0, %gbody], [%t.next, %store]")
    for k in range(K):
        a(f"  %x.{k} = phi {V} [%xg.{k}, %gbody], [%x.next.{k}, %store]")
        a(f"  %p.{k} = phi {V} [%pinit.{k}, %gbody], [%p.next.{k}, %store]")
        a(f"  %pos.{k} = phi i64 [%posg.{k}, %gbody], [%pos.next.{k}, %store]")
    a("  %bp = phi i64 [%bpg, %gbody], [%bp.next, %store]")
    a("  %tdone = icmp uge i64 %t, %ntok")
    a("  br i1 %tdone, label %gend, label %step")
    a("step:")
    shorts = []
    for k in range(K):
        class_table(a, W, f"%p.{k}", f"%rr.{k}", mmv, kb1v, f".{k}")
        a(f"  %slot.{k} = and {V} %x.{k}, {maskv}")
        a(f"  %a.{k} = or {V} %cb.{k}, %slot.{k}")
        a(f"  %xs.{k} = lshr {V} %x.{k}, {sbv}")
        if direct:  # one entry per slot: freq - 1 | (slot - cum) << sb | symbol << 2 sb
            a(f"  %dptr.{k} = getelementptr i32, ptr %tab.{k}, {V} %a.{k}")
            a(f"  %de.{k} = call {V} {gather}({P} %dptr.{k}, i32 4, {ones}, {V} zeroinitializer)")
            a(f"  %fm1.{k} = and {V} %de.{k}, {maskv}")
            a(f"  %freq.{k} = add {V} %fm1.{k}, splat (i32 1)")
            a(f"  %bias.s.{k} = lshr {V} %de.{k}, {sbv}")
            a(f"  %bias.{k} = and {V} %bias.s.{k}, {maskv}")
            a(f"  %p.next.{k} = lshr {V} %bias.s.{k}, {sbv}")
            a(f"  %m1.{k} = mul {V} %freq.{k}, %xs.{k}")
            a(f"  %x1.{k} = add {V} %m1.{k}, %bias.{k}")
        else:  # slot -> the symbol's index in its table (a byte) -> freq | cum << 16 | symbol << 32
            a(f"  %sptr.{k} = getelementptr i8, ptr %tab.{k}, {V} %a.{k}")
            a(f"  %s32.{k} = call {V} {gather}({P} %sptr.{k}, i32 1, {ones}, {V} zeroinitializer)")
            a(f"  %idx.{k} = and {V} %s32.{k}, splat (i32 255)")
            a(f"  %cbs.{k} = lshr {V} %cb.{k}, {sb8v}")
            a(f"  %ti.{k} = or {V} %cbs.{k}, %idx.{k}")
            a(f"  %iptr.{k} = getelementptr i64, ptr %info.{k}, {V} %ti.{k}")
            a(f"  %inf.{k} = call {V64} @llvm.masked.gather.v{W}i64.v{W}p0({P} %iptr.{k}, i32 8, {ones}, "
              f"{V64} zeroinitializer)")
            a(f"  %fcv.{k} = trunc {V64} %inf.{k} to {V}")
            a(f"  %inf.hi.{k} = lshr {V64} %inf.{k}, splat (i64 32)")
            a(f"  %p.next.{k} = trunc {V64} %inf.hi.{k} to {V}")
            a(f"  %freq.{k} = and {V} %fcv.{k}, splat (i32 65535)")
            a(f"  %cum.{k} = lshr {V} %fcv.{k}, splat (i32 16)")
            a(f"  %m1.{k} = mul {V} %freq.{k}, %xs.{k}")
            a(f"  %m2.{k} = add {V} %m1.{k}, %slot.{k}")
            a(f"  %x1.{k} = sub {V} %m2.{k}, %cum.{k}")
        # renormalisation: the lanes below L take the next words in lane order (exclusive prefix sum)
        a(f"  %n.{k} = icmp ult {V} %x1.{k}, {Lv}")
        a(f"  %nb.{k} = bitcast {M} %n.{k} to {iW}")
        if lut:  # the exclusive prefix sum of the flags: one row of @expand, indexed by the mask
            a(f"  %nbx.{k} = zext {iW} %nb.{k} to i64")
            a(f"  %erow.{k} = mul i64 %nbx.{k}, {W}")
            a(f"  %eptr.{k} = getelementptr i8, ptr @expand, i64 %erow.{k}")
            a(f"  %e8.{k} = load <{W} x i8>, ptr %eptr.{k}, align 1")
            a(f"  %excl.{k} = zext <{W} x i8> %e8.{k} to {V}")
        else:  # in registers: log2(W) shifts and adds
            a(f"  %nv.{k} = zext {M} %n.{k} to {V}")
            acc = f"%nv.{k}"
            sh = 1
            while sh < W:
                idx = ", ".join(f"i32 {W if j < sh else j - sh}" for j in range(W))
                a(f"  %sh{sh}.{k} = shufflevector {V} {acc}, {V} zeroinitializer, <{W} x i32> <{idx}>")
                a(f"  %ps{sh}.{k} = add {V} {acc}, %sh{sh}.{k}")
                acc = f"%ps{sh}.{k}"
                sh *= 2
            a(f"  %excl.{k} = sub {V} {acc}, %nv.{k}")
        a(f"  %cnt.{k} = call {iW} @llvm.ctpop.{iW}({iW} %nb.{k})")
        a(f"  %cnt64.{k} = zext {iW} %cnt.{k} to i64")
        a(f"  %wbase.{k} = getelementptr i16, ptr %words.{k}, i64 %pos.{k}")
        if permd:  # the next W words in one load, moved to their lanes by a variable permutation
            a(f"  %wnext.{k} = load <{W} x i16>, ptr %wbase.{k}, align 1")
            a(f"  %wn32.{k} = zext <{W} x i16> %wnext.{k} to {V}")
            a(f"  %wl.{k} = call {V} {permd}({V} %wn32.{k}, {V} %excl.{k})")
        else:
            a(f"  %wptr.{k} = getelementptr i16, ptr %wbase.{k}, {V} %excl.{k}")
            a(f"  %wv.{k} = call {V} {gather}({P} %wptr.{k}, i32 1, {M} %n.{k}, {V} zeroinitializer)")
            a(f"  %wl.{k} = and {V} %wv.{k}, splat (i32 65535)")
        a(f"  %xsh.{k} = shl {V} %x1.{k}, splat (i32 16)")
        a(f"  %xo.{k} = or {V} %xsh.{k}, %wl.{k}")
        a(f"  %x.next.{k} = select {M} %n.{k}, {V} %xo.{k}, {V} %x1.{k}")
        a(f"  %pos.next.{k} = add i64 %pos.{k}, %cnt64.{k}")
        a(f"  %short.{k} = icmp ugt i64 %pos.next.{k}, %nwords.{k}")
        shorts.append(f"%short.{k}")
    a(f"  br i1 {fold('or', 'anyshort', shorts)}, label %fail, label %store")
    # raw low bits: lane j's are bits bp + j lb .. of the packed stream (LSB first); then the output words
    a("store:")
    a("  %bpq = lshr i64 %bp, 3")
    a("  %bpr64 = and i64 %bp, 7")
    a("  %bpr = trunc i64 %bpr64 to i32")
    bprv = splat("bprv", "i32", "%bpr")
    a(f"  %boff = add {V} {bprv}, %lanelb")
    a(f"  %bbyte = lshr {V} %boff, splat (i32 3)")
    a(f"  %bsh = and {V} %boff, splat (i32 7)")
    a("  %tt = mul i64 %t, %dim")
    a("  %oi = add i64 %o0, %tt")
    for k in range(K):
        if not raw:  # no raw bits: the word is the symbol
            a(f"  %ov.{k} = or {V} %p.next.{k}, zeroinitializer")
        else:
            _raw_bits(a, W, k, narrow, lmaskv, lbv)
        a(f"  %optr.{k} = getelementptr {ety}, ptr %out.{k}, i64 %oi")
        if ety == "i32":
            a(f"  store {V} %ov.{k}, ptr %optr.{k}, align 4")
        else:
            a(f"  %ovt.{k} = trunc {V} %ov.{k} to <{W} x {ety}>")
            a(f"  store <{W} x {ety}> %ovt.{k}, ptr %optr.{k}, align 2")
    a("  %bp.next = add i64 %bp, %steplb")
    a("  %t.next = add i64 %t, 1")
    a("  br label %tloop")
    a("gend:")
    a("  %g.next = add i64 %g, 1")
    a("  br label %gloop")
    # every state back at L, else status 3; the caller compares each final position with the stream's length
    a("finish:")
    oks = []
    for k in range(K):
        a(f"  %fin.{k} = icmp eq {V} %xg.{k}, {Lv}")
        a(f"  %finb.{k} = bitcast {M} %fin.{k} to {iW}")
        a(f"  %allok.{k} = icmp eq {iW} %finb.{k}, -1")
        a(f"  %resp.{k} = getelementptr i64, ptr %res, i64 {k}")
        a(f"  store i64 %posg.{k}, ptr %resp.{k}, align 8")
        oks.append(f"%allok.{k}")
    a(f"  %st = select i1 {fold('and', 'ok', oks)}, i32 0, i32 3")
    a("  ret i32 %st")
    a("fail:")
    a("  ret i32 1")
    a("}")
    return "\n".join(e) + "\n"


def _expand_table(W: int) -> str:
    """The constant ``@expand``: for each mask of refilling lanes, lane j's offset among them (the number of
    refilling lanes below j), one byte per lane."""
    body = ", ".join(f"i8 {bin(m & ((1 << j) - 1)).count('1')}" for m in range(1 << W) for j in range(W))
    return f"@expand = private unnamed_addr constant [{W << W} x i8] [{body}], align 8"


def _raw_bits(a, W: int, k: int, narrow: bool, lmaskv: str, lbv: str) -> None:
    """Emit stream ``k``'s output words ``%ov.k`` (in :func:`_ir`'s loop, ``W`` lanes): its symbols ``%p.next.k``
    above the lanes' raw low bits (lane j's are bits ``bp + j lb ..`` of the packed stream, LSB first: one 64-bit
    load if ``narrow``, else a 32-bit load per lane at its byte)."""
    V, V64, P = f"<{W} x i32>", f"<{W} x i64>", f"<{W} x ptr>"
    gather, ones = f"@llvm.masked.gather.v{W}i32.v{W}p0", f"<{W} x i1> splat (i1 true)"
    # the raw bits in place while a step's loads stay inside them (byte bpq <= rlim), else their tail's copy
    a(f"  %rin.{k} = icmp sle i64 %bpq, %rlim.{k}")
    a(f"  %rtq.{k} = sub i64 %bpq, %rts.{k}")
    a(f"  %rq.{k} = select i1 %rin.{k}, i64 %bpq, i64 %rtq.{k}")
    a(f"  %rptr0.{k} = select i1 %rin.{k}, ptr %raw.{k}, ptr %rtail.{k}")
    a(f"  %rbase.{k} = getelementptr i8, ptr %rptr0.{k}, i64 %rq.{k}")
    if narrow:  # one 64-bit load, each lane's field shifted out of it
        a(f"  %r64.{k} = load i64, ptr %rbase.{k}, align 1")
        a(f"  %r64s.{k} = lshr i64 %r64.{k}, %bpr64")
        a(f"  %r64v.i.{k} = insertelement {V64} poison, i64 %r64s.{k}, i64 0")
        a(f"  %r64v.{k} = shufflevector {V64} %r64v.i.{k}, {V64} poison, <{W} x i32> zeroinitializer")
        a(f"  %r64f.{k} = lshr {V64} %r64v.{k}, %lanelb64")
        a(f"  %rs.{k} = trunc {V64} %r64f.{k} to {V}")
    else:  # a 32-bit load per lane at its byte
        a(f"  %rp.{k} = getelementptr i8, ptr %rbase.{k}, {V} %bbyte")
        a(f"  %rv.{k} = call {V} {gather}({P} %rp.{k}, i32 1, {ones}, {V} zeroinitializer)")
        a(f"  %rs.{k} = lshr {V} %rv.{k}, %bsh")
    a(f"  %low.{k} = and {V} %rs.{k}, {lmaskv}")
    a(f"  %hsym.{k} = shl {V} %p.next.{k}, {lbv}")
    a(f"  %ov.{k} = or {V} %hsym.{k}, %low.{k}")


def class_constants(a, splat) -> tuple[str, str]:
    """Emit the context-class constants from ``%kbits``: the sign bit's position ``kbits - 1`` and the magnitude
    mask ``2**(kbits - 1) - 1`` as vectors (``splat(name, type, scalar)`` makes one); their names."""
    a("  %kb1 = sub i32 %kbits, 1")
    kb1v = splat("kb1v", "i32", "%kb1")
    a("  %one.kb1 = shl i32 1, %kb1")
    a("  %mm.s = sub i32 %one.kb1, 1")
    return kb1v, splat("mmv", "i32", "%mm.s")


def class_table(a, W: int, prev: str, ref_mag: str, mmv: str, kb1v: str, sfx: str = "") -> str:
    """Emit the selection of each lane's table by the class of its previous symbol ``prev`` (spec "rANS stream":
    ``3 * sign + (mag >= ref) + (mag > ref)``, ``ref_mag`` the reference's magnitude) among the six vectors
    ``%c0 .. %c5`` (suffixed ``sfx``); the result is ``%cb`` + ``sfx``."""
    V, M = f"<{W} x i32>", f"<{W} x i1>"
    a(f"  %mag{sfx} = and {V} {prev}, {mmv}")
    a(f"  %sgn.v{sfx} = lshr {V} {prev}, {kb1v}")
    a(f"  %sgn{sfx} = icmp ne {V} %sgn.v{sfx}, zeroinitializer")
    a(f"  %ge{sfx} = icmp uge {V} %mag{sfx}, {ref_mag}")
    a(f"  %gt{sfx} = icmp ugt {V} %mag{sfx}, {ref_mag}")
    a(f"  %s01{sfx} = select {M} %ge{sfx}, {V} %c1{sfx}, {V} %c0{sfx}")
    a(f"  %s012{sfx} = select {M} %gt{sfx}, {V} %c2{sfx}, {V} %s01{sfx}")
    a(f"  %s34{sfx} = select {M} %ge{sfx}, {V} %c4{sfx}, {V} %c3{sfx}")
    a(f"  %s345{sfx} = select {M} %gt{sfx}, {V} %c5{sfx}, {V} %s34{sfx}")
    a(f"  %cb{sfx} = select {M} %sgn{sfx}, {V} %s345{sfx}, {V} %s012{sfx}")
    return f"%cb{sfx}"


_ARGTYPES = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int32,
             ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p]
#: the target feature and LLVM intrinsic of a lane permute, by lane count (shared with the encoder)
PERMD = {8: ("+avx2", "@llvm.x86.avx2.permd"), 16: ("+avx512f", "@llvm.x86.avx512.permvar.si.512")}
#: streams decoded together (one loop, independent chains: the gathers' latencies overlap)
STREAMS = 3
#: the refilling lanes' word offsets from a table (:func:`_expand_table`) when ``W <= 8``, else in registers
PREFIX_TABLE = True


def _target():
    import llvmlite.binding as llvm

    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    features = llvm.get_host_cpu_features().flatten()
    tm = llvm.Target.from_default_triple().create_target_machine(cpu=llvm.get_host_cpu_name(), features=features,
                                                                   opt=3)
    return tm, features


def jit(key, build, symbol: str, restype, argtypes):
    """``(function, engine, target machine, module)``: the function ``symbol`` of the LLVM IR ``build(features)``
    returns (``features``: the host CPU's, comma-separated), optimised and compiled for this CPU once per
    process and ``key``; the machine code is kept on disk (:func:`object_path`), so a later process loads it
    instead of compiling it again (``module`` is then ``None``; :func:`jit_assembly` lists the machine code
    either way).  Calls through the function release the GIL."""
    got = _COMPILED.get(key)
    if got is not None:
        return got
    with _LOCK:
        if key not in _COMPILED:
            import llvmlite.binding as llvm

            tm, features = _target()
            ir = build(features)
            path = object_path(ir, features)
            cached = _read_object(path)
            mod = llvm.parse_assembly(ir)
            mod.verify()
            if cached is None:
                _optimize(tm, mod)
            ee = llvm.create_mcjit_compiler(mod, tm)
            # MCJIT asks for the module's machine code before it compiles it, and hands over what it compiled
            ee.set_object_cache(lambda m, code: _write_object(path, code), lambda m: cached)
            ee.finalize_object()
            OBJECTS["loaded" if cached is not None else "compiled"] += 1
            # the engine must outlive the function pointer
            fn = ctypes.CFUNCTYPE(restype, *argtypes)(ee.get_function_address(symbol))
            _COMPILED[key] = (fn, ee, tm, mod if cached is None else None)
        return _COMPILED[key]


def _optimize(tm, mod) -> None:
    import llvmlite.binding as llvm

    pb = llvm.create_pass_builder(tm, llvm.create_pipeline_tuning_options(speed_level=3))
    pb.getModulePassManager().run(mod, pb)


def jit_assembly(key, build, symbol: str, restype, argtypes) -> str:
    """The machine code of :func:`jit`'s kernel, as text: from the module it compiled, or (its machine code
    came from disk, so no optimised module was kept) from ``build(features)`` optimised again."""
    _, _, tm, mod = jit(key, build, symbol, restype, argtypes)
    if mod is None:
        import llvmlite.binding as llvm

        mod = llvm.parse_assembly(build(_target()[1]))
        _optimize(tm, mod)
    return tm.emit_assembly(mod)


#: the kernels of this process whose machine code was ``loaded`` from disk or ``compiled`` (:func:`jit`)
OBJECTS = {"loaded": 0, "compiled": 0}
#: what the machine code kept on disk depends on besides the IR; bump to set aside every file written before
_OBJECT_VERSION = 1
_OBJECT_MAGIC = b"KVZOBJ1\0"


def object_path(ir: str, features: str):
    """Where the machine code of ``ir`` compiled for this CPU is kept: ``<cache_dir>/kernels/<key>.o``, the key a
    SHA-256 of the IR, the CPU's name and features, the target triple and llvmlite's version (a cache shared by
    machines of different CPUs holds one file each); ``None`` when ``KVCODEC_KERNEL_CACHE`` is ``0``."""
    import llvmlite
    import llvmlite.binding as llvm

    from ..models import cache_dir

    v = os.environ.get("KVCODEC_KERNEL_CACHE", "1")
    if v not in ("0", "1"):
        raise ValueError(f"KVCODEC_KERNEL_CACHE must be '0' or '1', not {v!r}")
    if v == "0":
        return None
    key = "\0".join([str(_OBJECT_VERSION), ir, llvm.get_process_triple(), llvm.get_host_cpu_name(), features,
                     llvmlite.__version__, str(llvm.llvm_version_info)])
    return cache_dir() / "kernels" / f"{hashlib.sha256(key.encode()).hexdigest()}.o"


def _read_object(path) -> bytes | None:
    """The machine code kept at ``path``, or ``None`` (no file, unreadable, or not as written: the magic, then
    the SHA-256 of the code, then the code)."""
    if path is None:
        return None
    try:
        data = path.read_bytes()
    except OSError:
        return None
    n = len(_OBJECT_MAGIC)
    code = data[n + 32:]
    if data[:n] != _OBJECT_MAGIC or not code or hashlib.sha256(code).digest() != data[n:n + 32]:
        return None
    return code


def _write_object(path, code: bytes) -> None:
    """Keep ``code`` at ``path`` (atomically: a reader sees no file or the whole of it); where the cache
    directory cannot be written, nothing is kept."""
    if path is None:
        return
    from ..atomic import atomic_output

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_output(path) as f:
            f.write(_OBJECT_MAGIC + hashlib.sha256(code).digest() + code)
    except OSError:
        pass


def _build(W: int, K: int, ety: str, direct: bool, narrow: bool = False, raw: bool = True):
    """(the kernel's key, the function of the CPU's features that writes its IR)."""
    feat, permd = PERMD.get(W, (None, None))
    lut = PREFIX_TABLE and W <= 8
    return (("lanes", W, K, ety, direct, narrow, raw, lut),
            lambda features: _ir(W, K, ety, direct, permd if feat in features.split(",") else None, narrow, raw,
                                 lut))


def _compiled(W: int, K: int, ety: str, direct: bool, narrow: bool = False, raw: bool = True):
    return jit(*_build(W, K, ety, direct, narrow, raw), "dec", ctypes.c_int32, _ARGTYPES)


def kernel(W: int, K: int, ety: str, direct: bool, narrow: bool = False, raw: bool = True):
    """The compiled decoder of ``K`` streams of ``W`` lanes, ``ety`` output words and the direct (one 32-bit
    entry per slot) or two-level (byte index, then 64-bit entry) tables, reading a step's raw bits with one load
    if ``narrow``, none if not ``raw`` (``lowbits`` 0); compiled once per process for this CPU (~60 ms), or its
    machine code loaded from an earlier process's (:func:`jit`)."""
    return _compiled(W, K, ety, direct, narrow, raw)[0]


def assembly(W: int, K: int, ety: str, direct: bool, narrow: bool = False, raw: bool = True) -> str:
    """The decoder's machine code for this CPU, as text."""
    return jit_assembly(*_build(W, K, ety, direct, narrow, raw), "dec", ctypes.c_int32, _ARGTYPES)


def narrow_raw(ways: int, lowbits: int) -> bool:
    """Whether one step's raw bits (``ways * lowbits``, after a shift of up to 7) fit one 64-bit load."""
    return ways * lowbits + 7 <= 64


def available() -> bool:
    """Whether this machine compiles the vector kernels (llvmlite JIT for the host CPU); checked once."""
    global _AVAILABLE
    if _AVAILABLE is None:
        try:
            kernel(8, STREAMS, "i16", True, True)  # the variant bf16 / fp16 lossless files use: no wasted build
            _AVAILABLE = True
        except Exception:  # noqa: BLE001 - any failure to build means: use the scalar kernels
            _AVAILABLE = False
    return _AVAILABLE


_AVAILABLE: bool | None = None


class Prepared(NamedTuple):
    """One stream as the vector kernels take it:

    * ``words``: the stream's ``nwords`` words and at least ``ways + 2`` readable words after them (a padded
      copy, or the payload's own raw bits that follow them, :func:`extend_words`); ``refs`` (uint16 per row);
    * ``ctx`` the context map (uint8 ``[rows, nclass]``, 3 bytes of padding: row r's table for the previous
      symbol's class; the scalar ``fast_w*`` kernels take ``cbase[6 r + class]`` = that table times
      ``2**scale_bits``, uint32, instead);
    * ``table`` the direct table (uint32, :func:`._rans_numba.build_direct_table`; ``info`` unused) or the byte
      index per slot with 3 bytes of padding and ``info`` the 64-bit entry per symbol
      (:func:`._rans_numba.build_local_tables`);
    * ``raw`` the raw bits, read in place (:func:`raw_tail`; the scalar kernels take them as uint64 words with 16
      zero bytes after them instead), ``rtail`` a copy of their last bytes from byte ``rts`` on, zero-padded,
      which a step reads from when its loads would pass the raw bits' end (its byte > ``rlim``);
    * ``out[bh, t, d]`` uint16 / uint32, C-contiguous, ``d % ways == 0``."""

    words: np.ndarray
    nwords: int
    refs: np.ndarray
    ctx: np.ndarray
    table: np.ndarray
    info: np.ndarray
    raw: np.ndarray
    out: np.ndarray
    rtail: np.ndarray | None = None
    rlim: int = 0
    rts: int = 0


def step_span(ways: int, lowbits: int) -> int:
    """Bytes a step's raw-bit loads read from its first byte on: one 64-bit load (:func:`narrow_raw`), else a
    32-bit load per lane at the byte of its field."""
    return 8 if narrow_raw(ways, lowbits) else ((7 + (ways - 1) * lowbits) >> 3) + 4


def raw_tail(raw: np.ndarray, ways: int, lowbits: int) -> tuple[np.ndarray, int, int]:
    """``(rtail, rlim, rts)`` of :class:`Prepared` for the raw bits ``raw`` (uint8): a step whose first byte is
    at most ``rlim`` reads inside ``raw``; later ones read ``rtail``, the bytes from ``rts`` on and 72 zero
    bytes: a step's first byte is at most ``len(raw)`` and it reads at most 51 bytes (16 lanes of 25 bits), and
    ``rts <= rlim + 1``."""
    n = raw.shape[0]
    rts = max(0, n - 64)
    rtail = np.zeros(n - rts + 72, dtype=np.uint8)
    rtail[:n - rts] = raw[rts:]
    return rtail, n - step_span(ways, lowbits), rts


def extend_words(words: np.ndarray, raw: np.ndarray, ways: int) -> np.ndarray | None:
    """``words`` (uint16) seen with the ``ways + 2`` words after them, when the raw bits ``raw`` follow them in
    memory and hold that many bytes (a payload's coded part: the kernels then read the words in place); else
    ``None``."""
    extra = ways + 2
    if words.ndim != 1 or words.strides[0] != 2 or raw.shape[0] < 2 * extra:
        return None
    if words.ctypes.data + 2 * words.shape[0] != raw.ctypes.data:
        return None
    return np.lib.stride_tricks.as_strided(words, shape=(words.shape[0] + extra,), strides=(2,), writeable=False)


def decode_many(ways: int, scale_bits: int, kbits: int, nclass: int, lowbits: int, streams: list) -> list:
    """Decode ``streams`` (:class:`Prepared`, all of one shape, output dtype and table kind) with the same
    ``ways``, ``scale_bits``, ``kbits``, ``nclass`` (1 or 6) and ``lowbits``: (status, final word position) of
    each, as the scalar ``fast_w*`` kernels return them.  Streams run :data:`STREAMS` at a time in one loop."""
    first = streams[0]
    bh, ntok, dim = first.out.shape
    ety = "i16" if first.out.dtype.itemsize == 2 else "i32"
    direct = first.table.dtype == np.uint32
    if dim % ways or lowbits > MAX_LOWBITS:
        raise ValueError(f"decode_many: {ways} lanes across heads of {dim} channels, or {lowbits} raw bits")
    span = step_span(ways, lowbits)
    for st in streams:  # what keeps every read inside the arrays (checked, not asserted: -O keeps them)
        if not (st.out.shape == first.out.shape and st.out.dtype == first.out.dtype and st.out.flags.c_contiguous
                and (st.table.dtype == np.uint32) == direct and st.ctx.dtype == np.uint8 and nclass in (1, 6)
                and st.ctx.shape[0] >= bh * dim * nclass + 3 and st.refs.shape[0] == bh * dim
                and st.refs.dtype == np.uint16 and st.words.dtype == np.uint16
                and st.words.shape[0] >= st.nwords + ways + 2
                and st.raw.dtype == np.uint8 and st.raw.shape[0] >= (st.out.size * lowbits + 7) // 8
                and st.rtail is not None and st.rtail.dtype == np.uint8
                and st.rts <= st.raw.shape[0] and st.rlim <= st.raw.shape[0] - span
                and st.rtail.shape[0] >= st.raw.shape[0] - st.rts + 72 and st.rts <= max(0, st.rlim + 1)):
            raise ValueError("decode_many: a prepared stream does not fit its kernel (see Prepared)")
    results = []
    i = 0
    while i < len(streams):
        group = streams[i:i + STREAMS]
        results += _run(ways, group, ety, direct, bh * dim, ntok, dim, scale_bits, kbits, nclass, lowbits)
        i += len(group)
    return results


def _run(ways, group, ety, direct, rows, ntok, dim, scale_bits, kbits, nclass, lowbits) -> list:
    fn = kernel(ways, len(group), ety, direct, narrow_raw(ways, lowbits), lowbits > 0)
    ptrs = np.array([a.ctypes.data for st in group
                     for a in (st.words, st.refs, st.ctx, st.table, st.info, st.raw, st.out, st.rtail)],
                    dtype=np.uint64)
    nw = np.array([v for st in group for v in (st.nwords, st.rlim, st.rts)], dtype=np.int64)
    res = np.zeros(len(group), dtype=np.int64)
    status = fn(ptrs.ctypes.data, nw.ctypes.data, rows, ntok, dim, scale_bits, kbits, lowbits, nclass,
                res.ctypes.data)
    if status and len(group) > 1:  # which stream: decode each alone (a corrupt file only)
        return [r for st in group
                for r in _run(ways, [st], ety, direct, rows, ntok, dim, scale_bits, kbits, nclass, lowbits)]
    return [(int(status), int(r)) for r in res]


def direct_fits(scale_bits: int, kbits: int) -> bool:
    """Whether a direct entry (freq - 1, slot - cum, symbol) fits 32 bits."""
    return 2 * scale_bits + kbits <= 32
