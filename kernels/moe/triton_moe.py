"""The FP4 mixture of experts in portable Triton (MXFP4 and NVFP4 experts): the lesson kernel.

Decode-time MoE streams weights (at T = 1 each of the 6 experts hit reads 12.6 MB of packed
FP4 for one token), so the kernel reads each packed byte of an expert once for all the tokens
routed to that expert:

1. group the (token, expert) pairs by expert into blocks of at most BM rows (:mod:`.align`);
2. :func:`gate_up_kernel`: a program per (block, BN1 intermediate columns, K slice) decodes
   its gate and up rows in registers, applies the block scales and feeds both GEMMs to the
   tensor cores; it writes ``act = silu(min(g, L)) * clamp(u, -L, L)`` (split-K: fp32
   partials that :func:`swiglu_kernel` sums);
3. :func:`down_kernel`: the same over BN2 hidden columns, each row times its routing weight;
4. :func:`combine_kernel` sums each token's k rows in a fixed order, no atomics.

Decoding without a table: a nibble's magnitude bits placed at bits 9..11 of a 16-bit word and
its sign at bit 15 read, as fp16, exactly ``value * 2**-14``. The even and odd elements of a
row are the low and high nibbles, so x is split instead of the weights:
``x . w = x_even . w_lo + x_odd . w_hi``. ``FASTDEC``: the same bits in packed 32-bit PTX.

Scales: NVFP4's E4M3 scale times the decoded weight is exact in fp16; ``2**22`` times the
global scale fixes the result once. MXFP4's ``2**(s - 127)`` is too wide for fp16: the weights
get ``2**(s - smax + 15)`` and the dot ``2**(smax - 120)``, ``smax`` the K-step's largest scale
byte (``ROWMAX``: the row's over its K slice, so the dots chain like NVFP4's). x and act enter
the dot as fp16 times 2**-8 (``XPRE``: a copy with even and odd columns as contiguous halves).

Runs on sm_80 .. sm_120 and in Triton's interpreter (dot operands upcast to fp32); tiles from
:mod:`.dispatch`. Explained in notebooks/04_mxfp4_moe_port.ipynb.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsv4lab.kernels.device import interpreting
from dsv4lab.kernels.launch import Launch, planned, workspace
from dsv4lab.kernels.moe.align import (align_buffers, align_kernel_fits, block_rows, moe_align,
                                       num_blocks_max)

X_PRESCALE = 2.0 ** -8      # x and activations enter the fp16 dot scaled by this
ROW_CHUNK = 128             # ROWMAX: scale bytes of a row read by one load


# ------------------------------------------------------------------ decoding ------------
@triton.jit
def _e2m1_lo(p):
    """Low nibbles of packed bytes -> fp16 ``value * 2**-14``."""
    p = p.to(tl.int16)
    bits = ((p & 7) << 9) | ((p & 8) << 12)
    return bits.to(tl.float16, bitcast=True)


@triton.jit
def _e2m1_hi(p):
    """High nibbles of packed bytes -> fp16 ``value * 2**-14``."""
    p = p.to(tl.int16)
    bits = ((p & 0x70) << 5) | ((p & 0x80) << 8)
    return bits.to(tl.float16, bitcast=True)


# FASTDEC: decode and scale in packed 32-bit PTX (sm_80+), 4 bytes a call. Per word w:
#   h = w & 0xF0F0F0F0, l = (w << 4) & 0xF0F0F0F0    high / low nibbles at bits 4..7
#   t = prmt(h or l, 0, 0x1404 or 0x3424)            bytes 0, 1 (or 2, 3): a nibble a half
#   d = (t | t >> 3) & 0x8E008E00 (one lop3)         _e2m1_lo / _e2m1_hi's bits
#   mul.rn.f16x2 d, d, mexp                          the block scale, two elements at once
# tests/test_moe.py checks this string with a numpy model of its opcodes.
FASTDEC_ASM = """
{
.reg .b32 h, l, t, u;
and.b32 h, $4, 0xF0F0F0F0;
shl.b32 l, $4, 4;
and.b32 l, l, 0xF0F0F0F0;
prmt.b32 t, l, 0, 0x1404;
shr.b32 u, t, 3;
lop3.b32 t, t, u, 0x8E008E00, 0xA8;
mul.rn.f16x2 $0, t, $5;
prmt.b32 t, l, 0, 0x3424;
shr.b32 u, t, 3;
lop3.b32 t, t, u, 0x8E008E00, 0xA8;
mul.rn.f16x2 $1, t, $6;
prmt.b32 t, h, 0, 0x1404;
shr.b32 u, t, 3;
lop3.b32 t, t, u, 0x8E008E00, 0xA8;
mul.rn.f16x2 $2, t, $5;
prmt.b32 t, h, 0, 0x3424;
shr.b32 u, t, 3;
lop3.b32 t, t, u, 0x8E008E00, 0xA8;
mul.rn.f16x2 $3, t, $6;
}
"""
_FASTDEC_ASM = tl.constexpr(FASTDEC_ASM)       # jit code may read constexpr globals only


@triton.jit
def _e2m1_scaled_fast(p, mexp):
    """FASTDEC: ``(_e2m1_lo(p) * mexp, _e2m1_hi(p) * mexp)``, bit for bit (p uint8, mexp
    fp16 of the same shape)."""
    return tl.inline_asm_elementwise(_FASTDEC_ASM, "=r,=r,=r,=r,r,r,r", [p, mexp],
                                     dtype=(tl.float16, tl.float16), is_pure=True, pack=4)


@triton.jit
def _e4m3_bits_to_f16(b):
    """E4M3 scale bytes (read as uint8: sm_80 has no e4m3 type) -> fp16, exactly: the bits
    s eeee mmm placed as fp16 s 0eeee mmm0000000 read ``value * 2**-8``; times 256."""
    b = b.to(tl.int16)
    bits = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
    return bits.to(tl.float16, bitcast=True) * 256.0


@triton.jit
def _scale_split(sb, IS_NV: tl.constexpr, BN: tl.constexpr, smax_row=0,
                 ROWMAX: tl.constexpr = False):
    """A K-step's scale bytes [BN, NSC] -> ``(mult, colf)``: fp16 multipliers of the decoded
    weights and the fp32 factor [BN] the step's dot still owes (NVFP4: 1)."""
    if IS_NV:
        mult = _e4m3_bits_to_f16(sb)
        colf = tl.full((BN,), 1.0, tl.float32)
    else:
        si = sb.to(tl.int32)
        if ROWMAX:
            smax = smax_row
        else:
            smax = tl.max(si, axis=1)
        e = si - smax[:, None] + 15
        mult = tl.where(e >= -14, (e + 15) << 10, 0).to(tl.int16).to(tl.float16, bitcast=True)
        colf = ((smax + 7) << 23).to(tl.float32, bitcast=True)
    return mult, colf


@triton.jit
def _w_tile(w_tile, s_tile, nmask, IS_NV: tl.constexpr, BN: tl.constexpr, BKH: tl.constexpr,
            GS: tl.constexpr, FASTDEC: tl.constexpr, smax_row=0, ROWMAX: tl.constexpr = False):
    """One K-step of BN weight rows -> ``(w_lo, w_hi, colf)``: the even / odd elements
    [BN, BKH], fp16 with their block scales applied."""
    NSC: tl.constexpr = BKH // GS
    p = tl.load(w_tile, mask=nmask[:, None], other=0)
    sb = tl.load(s_tile, mask=nmask[:, None], other=0)
    mult, colf = _scale_split(sb, IS_NV, BN, smax_row, ROWMAX)
    mexp = tl.reshape(tl.broadcast_to(mult[:, :, None], (BN, NSC, GS)), (BN, BKH))
    if FASTDEC:
        wlo, whi = _e2m1_scaled_fast(p, mexp)
        return wlo, whi, colf
    return _e2m1_lo(p) * mexp, _e2m1_hi(p) * mexp, colf


@triton.jit
def _row_smax(s_row, nmask, KS, RKC: tl.constexpr):
    """ROWMAX: each row's largest MXFP4 scale byte over its KS bytes, RKC a load."""
    kc = tl.arange(0, RKC)
    m = tl.zeros(nmask.shape, dtype=tl.int32)
    for k0 in range(0, KS, RKC):
        sb = tl.load(s_row[:, None] + (k0 + kc)[None, :],
                     mask=nmask[:, None] & (kc < KS - k0)[None, :], other=0)
        m = tl.maximum(m, tl.max(sb.to(tl.int32), axis=1))
    return m


# ------------------------------------------------------------ the inner product --------
@triton.jit
def _x_tile(x_rows, k0, mmask):
    """x (or act) at the step's even and odd columns, strided: fp32 [BM, BKH] times 2**-8."""
    xe = tl.load(x_rows + 2 * k0, mask=mmask[:, None], other=0.0).to(tl.float32)
    xo = tl.load(x_rows + 2 * k0 + 1, mask=mmask[:, None], other=0.0).to(tl.float32)
    return xe * 0.00390625, xo * 0.00390625


@triton.jit
def _x_tile_pre(x_rows, k0, xo_off, mmask):
    """XPRE: the step's even and odd columns from the split fp16 copy, as the dot takes them."""
    xe = tl.load(x_rows + k0, mask=mmask[:, None], other=0.0)
    xo = tl.load(x_rows + xo_off + k0, mask=mmask[:, None], other=0.0)
    return xe, xo


@triton.jit
def _mac(acc, xe, xo, wlo, whi, colf, CHAIN: tl.constexpr, DOT_FP32: tl.constexpr):
    """acc + colf * (x_even . w_lo^T + x_odd . w_hi^T) on the tensor cores. ``CHAIN``: no
    per-step factor (NVFP4, ROWMAX); ``DOT_FP32``: the interpreter, same rounding in fp32."""
    if DOT_FP32:
        a_e, a_o = xe.to(tl.float16).to(tl.float32), xo.to(tl.float16).to(tl.float32)
        b_lo, b_hi = tl.trans(wlo.to(tl.float32)), tl.trans(whi.to(tl.float32))
    else:
        a_e, a_o = xe.to(tl.float16), xo.to(tl.float16)
        b_lo, b_hi = tl.trans(wlo), tl.trans(whi)
    if CHAIN:
        acc = tl.dot(a_e, b_lo, acc)
        acc = tl.dot(a_o, b_hi, acc)
    else:
        d = tl.dot(a_e, b_lo)
        d = tl.dot(a_o, b_hi, d)
        acc += d * colf[None, :]
    return acc


# --------------------------------------------------------------------- kernels ----------
@triton.jit
def gate_up_kernel(x_ptr, w_ptr, s_ptr, gscale_ptr, sorted_pair_ptr,
                   block_expert_ptr, block_start_ptr, block_count_ptr, act_ptr,
                   I, TOPK, KH_SPLIT, KS_SPLIT, XO_OFF,
                   stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_act,
                   stride_part, swiglu_limit,
                   IS_NV: tl.constexpr, HAS_LIMIT: tl.constexpr, DOT_FP32: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BKH: tl.constexpr, GS: tl.constexpr,
                   FASTDEC: tl.constexpr, XPRE: tl.constexpr, PARTIAL: tl.constexpr,
                   ROWMAX: tl.constexpr, CHAIN: tl.constexpr, RKC: tl.constexpr):
    """Block b's tokens times BN gate and BN up rows over K slice sp -> act (``PARTIAL``:
    this slice's fp32 gate and up, for :func:`swiglu_kernel`)."""
    b = tl.program_id(0)
    pn = tl.program_id(1)
    sp = tl.program_id(2)
    e = tl.load(block_expert_ptr + b)
    if e < 0:
        return
    start, cnt, offs_m, mmask, pair = block_rows(block_start_ptr, block_count_ptr,
                                                 sorted_pair_ptr, b, BM)
    tok = (pair // TOPK).to(tl.int64)
    offs_n = pn * BN + tl.arange(0, BN)
    nmask = offs_n < I
    kb = tl.arange(0, BKH)
    ks = tl.arange(0, BKH // GS)
    e64 = e.to(tl.int64)
    kbase = sp * KH_SPLIT
    if XPRE:           # the split fp16 copy [T, 2, H/2] (odd half at XO_OFF)
        x_rows = x_ptr + tok[:, None] * stride_xt + kb[None, :]
    else:
        x_rows = x_ptr + tok[:, None] * stride_xt + 2 * kb[None, :]
    row_g = e64 * stride_we + offs_n.to(tl.int64) * stride_wn
    wg = w_ptr + row_g[:, None] + kb[None, :]
    wu = wg + I * stride_wn
    srow = e64 * stride_se + offs_n.to(tl.int64) * stride_sn
    sg = s_ptr + srow[:, None] + ks[None, :]
    su = sg + I * stride_sn
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    # the slice's base in the pointers: k1 and k1 // GS keep their divisibility (wide loads)
    wg, wu = wg + kbase, wu + kbase
    sg, su = sg + sp * KS_SPLIT, su + sp * KS_SPLIT
    x_rows += kbase if XPRE else 2 * kbase
    smax_g = tl.zeros((BN,), dtype=tl.int32)
    smax_u = tl.zeros((BN,), dtype=tl.int32)
    if ROWMAX:
        srow_g = s_ptr + srow + sp * KS_SPLIT
        smax_g = _row_smax(srow_g, nmask, KS_SPLIT, RKC)
        smax_u = _row_smax(srow_g + I * stride_sn, nmask, KS_SPLIT, RKC)
    for k1 in range(0, KH_SPLIT, BKH):
        if XPRE:
            xe, xo = _x_tile_pre(x_rows, k1, XO_OFF, mmask)
        else:
            xe, xo = _x_tile(x_rows, k1, mmask)
        wlo, whi, cf = _w_tile(wg + k1, sg + k1 // GS, nmask, IS_NV, BN, BKH, GS, FASTDEC,
                               smax_g, ROWMAX)
        acc_g = _mac(acc_g, xe, xo, wlo, whi, cf, CHAIN, DOT_FP32)
        wlo, whi, cf = _w_tile(wu + k1, su + k1 // GS, nmask, IS_NV, BN, BKH, GS, FASTDEC,
                               smax_u, ROWMAX)
        acc_u = _mac(acc_u, xe, xo, wlo, whi, cf, CHAIN, DOT_FP32)
    if ROWMAX:                                    # the rows' 2**(smax - 120), once
        fg = ((smax_g + 7) << 23).to(tl.float32, bitcast=True)
        fu = ((smax_u + 7) << 23).to(tl.float32, bitcast=True)
        acc_g = acc_g * fg[None, :]
        acc_u = acc_u * fu[None, :]
    if IS_NV:
        f = 4194304.0 * tl.load(gscale_ptr + e)          # 2**22: undo x and nibble offsets
        gate = acc_g * f
        up = acc_u * f
    else:
        gate = acc_g
        up = acc_u
    rows = (start + offs_m).to(tl.int64)
    omask = mmask[:, None] & nmask[None, :]
    if PARTIAL:        # split-K: this slice's gate and up, summed by swiglu_kernel
        part = act_ptr + sp.to(tl.int64) * stride_part + rows[:, None] * stride_act + offs_n[None, :]
        tl.store(part, gate, mask=omask)
        tl.store(part + I, up, mask=omask)
    else:
        _store_act(act_ptr, rows, offs_n, gate, up, omask, I, stride_act, swiglu_limit,
                   HAS_LIMIT, XPRE)


@triton.jit
def _swiglu(gate, up, swiglu_limit, HAS_LIMIT: tl.constexpr):
    """silu(min(g, L)) * clamp(u, -L, L), or silu(g) * u; fp32."""
    if HAS_LIMIT:
        gate = tl.minimum(gate, swiglu_limit)
        up = tl.minimum(tl.maximum(up, -swiglu_limit), swiglu_limit)
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _store_act(act_ptr, rows, offs_n, gate, up, omask, I, stride_act, swiglu_limit,
               HAS_LIMIT: tl.constexpr, XPRE: tl.constexpr):
    """act = SwiGLU(gate, up): fp32 in column order, or (XPRE) fp16 times 2**-8, even first."""
    act = _swiglu(gate, up, swiglu_limit, HAS_LIMIT)
    if XPRE:
        col = (offs_n % 2) * (I // 2) + offs_n // 2
        tl.store(act_ptr + rows[:, None] * stride_act + col[None, :],
                 (act * 0.00390625).to(tl.float16), mask=omask)
    else:
        tl.store(act_ptr + rows[:, None] * stride_act + offs_n[None, :], act, mask=omask)


@triton.jit
def swiglu_kernel(part_ptr, act_ptr, block_expert_ptr, block_start_ptr, block_count_ptr,
                  I, stride_part, stride_prow, stride_act, swiglu_limit,
                  HAS_LIMIT: tl.constexpr, XPRE: tl.constexpr, SPLIT: tl.constexpr,
                  BM: tl.constexpr, BI: tl.constexpr):
    """Split-K gate/up: sum a block's SPLIT partials [SPLIT, P, 2I] and write act."""
    b = tl.program_id(0)
    if tl.load(block_expert_ptr + b) < 0:
        return
    start = tl.load(block_start_ptr + b)
    offs_m = tl.arange(0, BM)
    offs_n = tl.program_id(1) * BI + tl.arange(0, BI)
    rows = (start + offs_m).to(tl.int64)
    omask = (offs_m < tl.load(block_count_ptr + b))[:, None] & (offs_n < I)[None, :]
    src = part_ptr + rows[:, None] * stride_prow + offs_n[None, :]
    gate = tl.zeros((BM, BI), dtype=tl.float32)
    up = tl.zeros((BM, BI), dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        gate += tl.load(src + s * stride_part, mask=omask, other=0.0)
        up += tl.load(src + s * stride_part + I, mask=omask, other=0.0)
    _store_act(act_ptr, rows, offs_n, gate, up, omask, I, stride_act, swiglu_limit,
               HAS_LIMIT, XPRE)


@triton.jit
def down_kernel(act_ptr, w_ptr, s_ptr, gscale_ptr, topk_w_ptr, sorted_pair_ptr,
                block_expert_ptr, block_start_ptr, block_count_ptr, ypair_ptr,
                H, KH_SPLIT, KS_SPLIT, XO_OFF,
                stride_act, stride_we, stride_wn, stride_se, stride_sn, stride_y, stride_ys,
                IS_NV: tl.constexpr, DOT_FP32: tl.constexpr, BM: tl.constexpr,
                BN: tl.constexpr, BKH: tl.constexpr, GS: tl.constexpr, FASTDEC: tl.constexpr,
                XPRE: tl.constexpr, ROWMAX: tl.constexpr, CHAIN: tl.constexpr,
                RKC: tl.constexpr):
    """Block b's act times BN down rows over K slice sp and routing weights -> ypair[sp]."""
    b = tl.program_id(0)
    pn = tl.program_id(1)
    sp = tl.program_id(2)
    e = tl.load(block_expert_ptr + b)
    if e < 0:
        return
    start, cnt, offs_m, mmask, pair = block_rows(block_start_ptr, block_count_ptr,
                                                 sorted_pair_ptr, b, BM)
    offs_n = pn * BN + tl.arange(0, BN)
    nmask = offs_n < H
    kb = tl.arange(0, BKH)
    ks = tl.arange(0, BKH // GS)
    e64 = e.to(tl.int64)
    kbase = sp * KH_SPLIT
    if XPRE:           # act as the gate/up pass wrote it (odd half at XO_OFF)
        a_rows = act_ptr + (start + offs_m).to(tl.int64)[:, None] * stride_act + kb[None, :]
    else:
        a_rows = act_ptr + (start + offs_m).to(tl.int64)[:, None] * stride_act + 2 * kb[None, :]
    w_rows = w_ptr + (e64 * stride_we + offs_n.to(tl.int64) * stride_wn)[:, None] + kb[None, :]
    s_rows = s_ptr + (e64 * stride_se + offs_n.to(tl.int64) * stride_sn)[:, None] + ks[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    w_rows += kbase           # the slice's base in the pointers (see gate_up_kernel)
    s_rows += sp * KS_SPLIT
    a_rows += kbase if XPRE else 2 * kbase
    smax = tl.zeros((BN,), dtype=tl.int32)
    if ROWMAX:
        smax = _row_smax(s_ptr + e64 * stride_se + offs_n.to(tl.int64) * stride_sn + sp * KS_SPLIT,
                         nmask, KS_SPLIT, RKC)
    for k1 in range(0, KH_SPLIT, BKH):
        if XPRE:
            xe, xo = _x_tile_pre(a_rows, k1, XO_OFF, mmask)
        else:
            xe, xo = _x_tile(a_rows, k1, mmask)
        wlo, whi, cf = _w_tile(w_rows + k1, s_rows + k1 // GS, nmask, IS_NV, BN, BKH, GS,
                               FASTDEC, smax, ROWMAX)
        acc = _mac(acc, xe, xo, wlo, whi, cf, CHAIN, DOT_FP32)
    if ROWMAX:
        f = ((smax + 7) << 23).to(tl.float32, bitcast=True)
        acc = acc * f[None, :]
    wt = tl.load(topk_w_ptr + pair, mask=mmask, other=0.0).to(tl.float32)
    if IS_NV:
        y = acc * (4194304.0 * tl.load(gscale_ptr + e)) * wt[:, None]
    else:
        y = acc * wt[:, None]
    tl.store(ypair_ptr + sp.to(tl.int64) * stride_ys + pair.to(tl.int64)[:, None] * stride_y
             + offs_n[None, :], y, mask=mmask[:, None] & nmask[None, :])


@triton.jit
def combine_kernel(ypair_ptr, ids_ptr, out_ptr, H, E, stride_y, stride_ys, stride_out,
                   TOPK: tl.constexpr, SPLIT: tl.constexpr, BH: tl.constexpr):
    """out[t] = token t's k rows of ypair over its K slices, in order (ids outside [0, E): 0)."""
    t = tl.program_id(0)
    offs = tl.program_id(1) * BH + tl.arange(0, BH)
    hmask = offs < H
    acc = tl.zeros((BH,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        eid = tl.load(ids_ptr + t * TOPK + j + offs * 0)      # broadcast: a vector mask
        ok = (eid >= 0) & (eid < E)
        row = (t * TOPK + j).to(tl.int64)
        for sp in tl.static_range(SPLIT):
            acc += tl.load(ypair_ptr + sp * stride_ys + row * stride_y + offs,
                           mask=hmask & ok, other=0.0)
    tl.store(out_ptr + t.to(tl.int64) * stride_out + offs, acc.to(out_ptr.dtype.element_ty), mask=hmask)


@triton.jit
def x_split_kernel(x_ptr, xk_ptr, HP, stride_x, stride_xk, BH: tl.constexpr):
    """XPRE: row t of x -> fp16 ``x * 2**-8`` in row t of xk, even columns first (HP = H / 2):
    the rounding the strided path applies in the dot anyway."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BH + tl.arange(0, BH)
    m = offs < HP
    src = x_ptr + t * stride_x + 2 * offs
    dst = xk_ptr + t * stride_xk + offs
    for r in tl.static_range(2):
        xr = tl.load(src + r, mask=m, other=0.0).to(tl.float32) * 0.00390625
        tl.store(dst + r * HP, xr.to(tl.float16), mask=m)


# -------------------------------------------------------------------- launcher ----------
@dataclass(frozen=True)
class Tiles:
    """A launch configuration. BM: pairs a block (>= 16); BN1 / BN2: columns a gate/up / down
    program; BK1 / BK2: K elements a step (fitted to divide K); SPLIT1 / SPLIT2: K slices;
    FASTDEC, XPRE, ROWMAX: the module docstring's."""
    BM: int = 16
    BN1: int = 64
    BN2: int = 64
    BK1: int = 256
    BK2: int = 256
    SPLIT1: int = 1
    SPLIT2: int = 1
    FASTDEC: bool = True
    XPRE: bool = True
    ROWMAX: bool = False
    num_warps: int = 4
    num_stages: int = 3

    def check(self) -> None:
        """ValueError naming the field that no launch can take."""
        for name in ("BM", "BN1", "BN2", "BK1", "BK2"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 16 or v & (v - 1):
                raise ValueError(f"tiles: {name} must be a power of two >= 16 (tl.dot's least), got {v!r}")
        for name in ("SPLIT1", "SPLIT2", "num_warps", "num_stages"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"tiles: {name} must be a positive int, got {getattr(self, name)!r}")


def pick_bk(K: int, want: int) -> int:
    """Largest power of two <= want (>= 32) dividing K (K is a multiple of 32)."""
    bk = max(32, triton.next_power_of_2(want))
    while bk > 32 and K % bk:
        bk //= 2
    return bk


def pick_split(steps: int, want: int) -> int:
    """Largest split <= want that divides ``steps`` evenly."""
    for s in range(max(1, min(want, steps)), 0, -1):
        if steps % s == 0:
            return s
    return 1


class MoeLaunches:
    """The launches of :func:`fused_moe` for one device, shape, format and tiles, with buffers."""

    def __init__(self, device, T, H, E, I, topk, x_dtype, ids_dtype, fmt, has_limit,
                 tiles: Tiles):
        tiles.check()
        P = T * topk
        is_nv = fmt == "nvfp4"
        GS = 8 if is_nv else 16                      # packed bytes a scale
        BM, BN1, BN2 = tiles.BM, tiles.BN1, tiles.BN2
        BK1, BK2 = pick_bk(H, tiles.BK1), pick_bk(I, tiles.BK2)
        split1 = pick_split(H // BK1, tiles.SPLIT1)
        split2 = pick_split(I // BK2, tiles.SPLIT2)
        interp = interpreting()
        fast = tiles.FASTDEC and not interp          # inline PTX: GPU only
        xpre = tiles.XPRE
        rowmax = tiles.ROWMAX and not is_nv
        num_stages = 1 if interp else tiles.num_stages
        nbm = num_blocks_max(P, E, BM)
        self.T, self.H, self.I, self.P, self.E, self.BM = T, H, I, P, E, BM
        self.is_nv, self.xpre, self.split1, self.split2, self.nbm = is_nv, xpre, split1, split2, nbm
        self.align_fits = align_kernel_fits(P)
        gu_w = dict(stride_we=2 * I * H // 2, stride_wn=H // 2, stride_se=2 * I * H // 2 // GS,
                    stride_sn=H // 2 // GS)
        dn_w = dict(stride_we=H * I // 2, stride_wn=I // 2, stride_se=H * I // 2 // GS,
                    stride_sn=I // 2 // GS)
        self.x_split = None
        if xpre and T:
            BX = min(1024, triton.next_power_of_2(max(1, H // 2)))
            self.x_split = Launch(x_split_kernel, (T, triton.cdiv(H // 2, BX)),
                                  dict(HP=H // 2, stride_x=H, stride_xk=H, BH=BX), device=device,
                                  guard=(0,), num_warps=4)
        act_stride = I
        ks1 = H // 2 // split1 // GS
        self.gate_up = Launch(gate_up_kernel, (nbm, triton.cdiv(I, BN1), split1), dict(
            I=I, TOPK=topk, KH_SPLIT=H // 2 // split1, KS_SPLIT=ks1, XO_OFF=H // 2,
            stride_xt=H, **gu_w, stride_act=2 * I if split1 > 1 else act_stride,
            stride_part=P * 2 * I if split1 > 1 else 0,
            IS_NV=is_nv, HAS_LIMIT=has_limit, DOT_FP32=interp, BM=BM, BN=BN1, BKH=BK1 // 2,
            GS=GS, FASTDEC=fast, XPRE=xpre, PARTIAL=split1 > 1, ROWMAX=rowmax,
            CHAIN=is_nv or rowmax,
            RKC=min(ROW_CHUNK, triton.next_power_of_2(ks1)) if rowmax else 16),
            device=device, guard=(0, 1, 2, 3), num_warps=tiles.num_warps, num_stages=num_stages)
        self.swiglu = None
        if split1 > 1:
            BI = max(16, min(triton.next_power_of_2(I), 4096 // BM))
            self.swiglu = Launch(swiglu_kernel, (nbm, triton.cdiv(I, BI)), dict(
                I=I, stride_part=P * 2 * I, stride_prow=2 * I, stride_act=act_stride,
                HAS_LIMIT=has_limit, XPRE=xpre, SPLIT=split1, BM=BM, BI=BI), device=device,
                guard=(), num_warps=4)
        ks2 = I // 2 // split2 // GS
        self.down = Launch(down_kernel, (nbm, triton.cdiv(H, BN2), split2), dict(
            H=H, KH_SPLIT=I // 2 // split2, KS_SPLIT=ks2, XO_OFF=I // 2, stride_act=act_stride,
            **dn_w, stride_y=H, stride_ys=P * H,
            IS_NV=is_nv, DOT_FP32=interp, BM=BM, BN=BN2, BKH=BK2 // 2, GS=GS, FASTDEC=fast,
            XPRE=xpre, ROWMAX=rowmax, CHAIN=is_nv or rowmax,
            RKC=min(ROW_CHUNK, triton.next_power_of_2(ks2)) if rowmax else 16),
            device=device, guard=(1, 2, 3, 4), num_warps=tiles.num_warps, num_stages=num_stages)
        BH = min(1024, triton.next_power_of_2(H))
        self.combine = Launch(combine_kernel, (T, triton.cdiv(H, BH)), dict(
            H=H, E=E, stride_y=H, stride_ys=P * H, stride_out=H, TOPK=topk, SPLIT=split2, BH=BH),
            device=device, guard=(1,), num_warps=4)
        self.ws_key = ("triton_moe", T, H, I, P, nbm, xpre, split1, split2)

    def _buffers(self, device):
        T, H, I, P, nbm = self.T, self.H, self.I, self.P, self.nbm
        f32 = torch.float32
        xk = torch.empty(T, H, dtype=torch.float16, device=device) if self.xpre else None
        act = torch.empty(P, I, dtype=torch.float16 if self.xpre else f32, device=device)
        part = torch.empty(self.split1, P, 2 * I, dtype=f32, device=device) \
            if self.split1 > 1 else act
        ypair = torch.empty(self.split2, P, H, dtype=f32, device=device)
        grouping = align_buffers(P, nbm, device) if self.align_fits else None
        return xk, act, part, ypair, grouping

    def __call__(self, x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, w13_global,
                 w2_global, swiglu_limit):
        dev = x.device
        xk, act, part, ypair, grouping = workspace(self.ws_key, dev, lambda: self._buffers(dev))
        if self.is_nv:   # E4M3 scales travel as raw bytes (decoded in the kernel; sm_80 has none)
            w13_scale, w2_scale = w13_scale.view(torch.uint8), w2_scale.view(torch.uint8)
        sorted_pair, block_expert, block_start, block_count = moe_align(
            topk_ids, self.E, self.BM, out=grouping)
        out = torch.empty(self.T, self.H, dtype=x.dtype, device=dev)
        if self.x_split is not None:
            self.x_split(x, xk)
        else:
            xk = x
        # MXFP4 has no global scales: the kernels never read gscale_ptr then
        g13 = w13_global if self.is_nv else ypair
        g2 = w2_global if self.is_nv else ypair
        limit = float(swiglu_limit) if swiglu_limit is not None else 0.0
        self.gate_up(xk, w13, w13_scale, g13, sorted_pair, block_expert, block_start,
                     block_count, part, limit)
        if self.swiglu is not None:
            self.swiglu(part, act, block_expert, block_start, block_count, limit)
        self.down(act, w2, w2_scale, g2, topk_weights, sorted_pair, block_expert, block_start,
                  block_count, ypair)
        self.combine(ypair, topk_ids, out)
        return out


_LAUNCHES: dict = {}


def fused_moe(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, *, fmt="mxfp4",
              w13_global=None, w2_global=None, swiglu_limit=None, tiles: Tiles = Tiles()):
    """The grouped FP4 MoE (arguments as ``dsv4lab.ops.fused_moe``, checked; NVFP4 globals
    fp32 [E]) with ``tiles``. No host sync: CUDA-graph capturable."""
    T, H = x.shape
    E, two_i, _ = w13.shape
    topk = topk_ids.shape[1]
    dev = x.device
    launches = planned(_LAUNCHES, (dev, T, H, E, two_i, topk, x.dtype, topk_ids.dtype, fmt,
                                   swiglu_limit is not None, tiles), dev,
                       lambda: MoeLaunches(dev, T, H, E, two_i // 2, topk, x.dtype,
                                           topk_ids.dtype, fmt, swiglu_limit is not None, tiles))
    return launches(*contiguous_args(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights,
                                 w13_global, w2_global), swiglu_limit)


def contiguous_args(*tensors):
    """The tensors (None kept), each made contiguous if it is not."""
    return tuple(t if t is None or t.is_contiguous() else t.contiguous() for t in tensors)
