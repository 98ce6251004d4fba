"""The grouped FP4 MoE GEMMs with hand-chosen tensor-core layouts (Gluon ``mma.sync``): the
sm_90 fast path at a few rows per expert (T ~ 64 at Flash's 256 experts).

In :mod:`.triton_moe` the byte-sourced operand forces a layout (kWidth 4) into which x's fp16
fragments are shuffled before every mma. Here the layouts are chosen so that nothing moves:

- the weights are the A operand of ``mma.sync.m16n8k16`` (N: the block's tokens, padded to 8),
  kWidth 2: lane ``(g, t)`` holds row g's columns ``k' = 16 s + 8 c + 2 t + a`` of a step;
- lane t loads bytes ``16 t .. 16 t + 15`` of a row's 64-byte step (one 16-byte load, one
  MXFP4 scale) and takes byte ``16 t + 4 s + 2 c + a`` as column ``k'``: a permutation of K
  (sigma) that x's copy and the activations share (per 128 elements, the 64 even then the 64
  odd: :func:`x_seg_kernel`, ``_seg_order``); Gluon checks the mapping is free
  (``convert_layout(..., assert_trivial=True)``);
- weights, scales and x stream through a ``STAGES``-deep ``cp.async`` ring; each lane reads
  back only the bytes it copied (no barrier); x's buffers are XOR-swizzled.

The decode is :mod:`.gluon_shared`'s e5m2 conversion times the block scales (MXFP4's split by
the row's largest scale byte, as ROWMAX). Wins at T = 64 (`dsv4lab bench moe`) on the H200,
the only GPU the dispatch runs it on. Explained in notebooks/04_mxfp4_moe_port.ipynb.
"""
import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from dsv4lab.kernels.gluon_compat import async_load
from dsv4lab.kernels.launch import Launch, planned, workspace
from dsv4lab.kernels.moe.align import align_buffers, align_kernel_fits, moe_align, num_blocks_max
from dsv4lab.kernels.moe.gluon_shared import CVT8_PLACE, e4m3_bits, swiglu
from dsv4lab.kernels.moe.triton_moe import combine_kernel, contiguous_args, pick_split

SEG_BYTES = gl.constexpr(64)   # packed bytes of one weight row a K-step (128 FP4 elements)
BM = gl.constexpr(8)           # tokens a block (mma's N)
# the launch: gate/up and down rows a program, ring stages, 64-byte steps a stage, warps
BN1, BN2, STAGES, NSPS1, NSPS2, NUM_WARPS = 64, 128, 2, 4, 2, 4

# The decode ($4: 4 bytes; $5, $6: multipliers of bytes 0-1, 2-3): low nibbles $0, $1, high $2, $3
CVT8_ASM = "\n{" + CVT8_PLACE + """cvt.rn.f16x2.e5m2x2 u, l0;
mul.rn.f16x2 $0, u, $5;
cvt.rn.f16x2.e5m2x2 u, l1;
mul.rn.f16x2 $1, u, $6;
cvt.rn.f16x2.e5m2x2 u, h0;
mul.rn.f16x2 $2, u, $5;
cvt.rn.f16x2.e5m2x2 u, h1;
mul.rn.f16x2 $3, u, $6;
}
"""


@gluon.jit
def _decode(p, mexp, ASM: gl.constexpr):
    """Packed bytes and their fp16 multipliers (same shape) -> (low, high) nibbles as fp16."""
    return gl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,r,r,r", [p, mexp],
                                     dtype=(gl.float16, gl.float16), is_pure=True, pack=4)


@triton.constexpr_function
def _weight_layout(BN, W, NS, GS):
    """Weight bytes [BN, 4 (t), NS, GS]: the A operand's distribution (kWidth 2) under sigma."""
    reg = [[0, 0, 0, 1 << i] for i in range(GS.bit_length() - 1)]
    reg += [[0, 0, 1 << i, 0] for i in range(NS.bit_length() - 1)]
    reg += [[8, 0, 0, 0]]
    r = 16 * W
    while r < BN:
        reg.append([r, 0, 0, 0])
        r *= 2
    lanes = [[0, 1, 0, 0], [0, 2, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]]
    warps = [[16 << i, 0, 0, 0] for i in range(W.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=lanes, warp_bases=warps,
                                      block_bases=[], shape=[BN, 4, NS, GS])


@triton.constexpr_function
def _copy_layout(BN, W):
    """:func:`_weight_layout`'s bytes as a [BN, 64] tile: a lane copies the chunks it reads."""
    reg = [[0, 1 << i] for i in range(4)] + [[8, 0]]
    r = 16 * W
    while r < BN:
        reg.append([r, 0])
        r *= 2
    lanes = [[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]]
    warps = [[16 << i, 0] for i in range(W.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=lanes, warp_bases=warps,
                                      block_bases=[], shape=[BN, 64])


@triton.constexpr_function
def _mma_layout(W):
    """The accumulator [weight rows, tokens]: warps stacked along the weight rows (M)."""
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1], instr_shape=[16, 8])


@gluon.jit
def _to_a_operand(w, BN: gl.constexpr, A_OP: gl.constexpr):
    """[BN, 4 (t), NS, GS] decoded weights (lane t's 16 bytes) -> the A operand [BN, 64] in
    sigma's order: byte 16 t + 4 s + 2 c + a is column 16 s + 8 c + 2 t + a. No data moves."""
    w = gl.reshape(w, [BN, 4, 4, 2, 2])
    w = gl.permute(w, [0, 2, 3, 1, 4])
    return gl.convert_layout(gl.reshape(w, [BN, 64]), A_OP, assert_trivial=True)


@gluon.jit
def _to_b_operand(x, B_OP: gl.constexpr):
    """[BM, 64] fp16 x (lane t's 16 consecutive) -> the B operand [64, BM] in sigma's order."""
    x = gl.reshape(x, [BM, 4, 4, 2, 2])
    x = gl.permute(x, [2, 3, 1, 4, 0])
    return gl.convert_layout(gl.reshape(x, [64, BM]), B_OP, assert_trivial=True)


@gluon.jit
def _mult(sb, smax, IS_NV: gl.constexpr):
    """Scale bytes -> fp16 multipliers (MXFP4: ``2**(s - smax + 15)``; NVFP4: the E4M3 value)."""
    if IS_NV:
        return e4m3_bits(sb) * 256.0
    else:
        ex = sb.to(gl.int32) - smax + 15
        return gl.where(ex >= -14, (ex + 15) << 10, 0).to(gl.int16).to(gl.float16, bitcast=True)


@gluon.jit
def _row_smax(s_row, nmask, KS, BN: gl.constexpr, num_warps: gl.constexpr):
    """The largest MXFP4 scale byte of each row over its KS scale bytes from s_row."""
    L: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [num_warps, 1], [1, 0])
    kc = gl.arange(0, 32, layout=gl.SliceLayout(0, L))
    rows = gl.convert_layout(s_row, gl.SliceLayout(1, L))
    rm = gl.convert_layout(nmask, gl.SliceLayout(1, L))
    m = gl.zeros([BN], gl.int32, layout=gl.SliceLayout(1, L))
    for k0 in range(0, KS, 32):
        sb = gl.load(rows[:, None] + (k0 + kc)[None, :],
                     mask=rm[:, None] & ((k0 + kc) < KS)[None, :], other=0)
        m = gl.maximum(m, gl.max(sb.to(gl.int32), axis=1))
    return m


@gluon.jit
def _issue_mat(w_smem, s_smem, idx, w_rows, s_rows, nm_w, nm_s, k, live,
               NSC: gl.constexpr, CPW: gl.constexpr, CPS: gl.constexpr):
    """One K-step of one matrix's rows into ring buffer idx: weight bytes and scale bytes."""
    cb = gl.arange(0, SEG_BYTES, layout=gl.SliceLayout(0, CPW))
    cs = gl.arange(0, NSC, layout=gl.SliceLayout(0, CPS))
    async_load(
        w_smem.index(idx), w_rows[:, None] + (k * SEG_BYTES + cb)[None, :], mask=nm_w[:, None] & live)
    async_load(s_smem.index(idx), s_rows[:, None] + (k * NSC + cs)[None, :], mask=nm_s[:, None] & live)


@gluon.jit
def _issue(w_smem, s_smem, x_smem, slot, w0, s0, m0w, m0s, w1, s1, m1w, m1s, x_rows, xmask, st,
           nst, NSC: gl.constexpr, CPW: gl.constexpr, CPS: gl.constexpr, CPX: gl.constexpr,
           NMAT: gl.constexpr, NSPS: gl.constexpr):
    """cp.async stage st (NSPS 64-byte steps a row) into ring slot ``slot``; none once st >= nst."""
    live = st < nst
    cx = gl.arange(0, 64, layout=gl.SliceLayout(0, CPX))
    xm = xmask[:, None] & live
    for j in gl.static_range(NSPS):
        k = st * NSPS + j
        _issue_mat(w_smem, s_smem, (slot * NMAT) * NSPS + j, w0, s0, m0w, m0s, k, live, NSC, CPW, CPS)
        if NMAT == 2:
            _issue_mat(w_smem, s_smem, (slot * NMAT + 1) * NSPS + j, w1, s1, m1w, m1s, k, live,
                       NSC, CPW, CPS)
        for h in gl.static_range(2):
            async_load(
                x_smem.index((slot * NSPS + j) * 2 + h),
                x_rows[:, None] + (k * 128 + h * 64 + cx)[None, :], mask=xm)
    async_copy.commit_group()


@gluon.jit
def _step(acc, xe, xo, w_smem, s_smem, idx, smax, IS_NV: gl.constexpr, BN: gl.constexpr,
          NS: gl.constexpr, GS: gl.constexpr, WL: gl.constexpr, SL: gl.constexpr,
          A_OP: gl.constexpr, ASM: gl.constexpr):
    """One K-step of one weight matrix from ring buffer ``idx``: decode, scale, two mmas."""
    p = w_smem.index(idx).reshape([BN, 4, NS, GS]).load(WL)
    sb = s_smem.index(idx).reshape([BN, 4, NS]).load(SL)
    mexp, p = gl.broadcast(gl.expand_dims(_mult(sb, smax[:, None, None], IS_NV), 3), p)
    lo, hi = _decode(p, mexp, ASM)
    acc = mma_v2(_to_a_operand(lo, BN, A_OP), xe, acc)
    return mma_v2(_to_a_operand(hi, BN, A_OP), xo, acc)


@gluon.jit
def _k_loop(w0, s0, m0, smax0, w1, s1, m1, smax1, x_rows, xmask, nseg,
            IS_NV: gl.constexpr, BN: gl.constexpr, NMAT: gl.constexpr, STAGES: gl.constexpr,
            NSPS: gl.constexpr, ASM: gl.constexpr, num_warps: gl.constexpr):
    """w . x^T over nseg K-steps of NMAT weight matrices -> (acc0, acc1) in the mma layout."""
    W: gl.constexpr = num_warps
    GS: gl.constexpr = 8 if IS_NV else 16              # packed bytes a scale
    NSC: gl.constexpr = SEG_BYTES // GS                # scales a row a K-step
    NS: gl.constexpr = 16 // GS                        # scales a lane a K-step
    MMA: gl.constexpr = _mma_layout(W)
    A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    CPW: gl.constexpr = _copy_layout(BN, W)
    CPS: gl.constexpr = gl.BlockedLayout([1, NSC], [32, 1], [W, 1], [1, 0])
    CPX: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [1, W], [1, 0])
    WL: gl.constexpr = _weight_layout(BN, W, NS, GS)
    SL: gl.constexpr = gl.SliceLayout(3, WL)
    RL: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, SL))
    PLAIN: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    SWZ: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [1, 0])
    w_smem = gl.allocate_shared_memory(gl.uint8, [STAGES * NMAT * NSPS, BN, SEG_BYTES], PLAIN)
    s_smem = gl.allocate_shared_memory(gl.uint8, [STAGES * NMAT * NSPS, BN, NSC], PLAIN)
    x_smem = gl.allocate_shared_memory(gl.float16, [STAGES * NSPS * 2, BM, 64], SWZ)
    RW: gl.constexpr = gl.SliceLayout(1, CPW)
    RS: gl.constexpr = gl.SliceLayout(1, CPS)
    w0 = gl.convert_layout(w0, RW)
    w1 = gl.convert_layout(w1, RW)
    m0w = gl.convert_layout(m0, RW)
    m1w = gl.convert_layout(m1, RW)
    s0 = gl.convert_layout(s0, RS)
    s1 = gl.convert_layout(s1, RS)
    m0s = gl.convert_layout(m0, RS)
    m1s = gl.convert_layout(m1, RS)
    smax0 = gl.convert_layout(smax0, RL)
    smax1 = gl.convert_layout(smax1, RL)
    xr = gl.convert_layout(x_rows, gl.SliceLayout(1, CPX))
    xm = gl.convert_layout(xmask, gl.SliceLayout(1, CPX))
    nst = nseg // NSPS
    for st in gl.static_range(STAGES - 1):
        _issue(w_smem, s_smem, x_smem, st, w0, s0, m0w, m0s, w1, s1, m1w, m1s, xr, xm, st, nst,
               NSC, CPW, CPS, CPX, NMAT, NSPS)
    acc0 = gl.zeros([BN, BM], gl.float32, layout=MMA)
    acc1 = gl.zeros([BN, BM], gl.float32, layout=MMA)
    for st in range(nst):
        _issue(w_smem, s_smem, x_smem, (st + STAGES - 1) % STAGES, w0, s0, m0w, m0s, w1, s1,
               m1w, m1s, xr, xm, st + STAGES - 1, nst, NSC, CPW, CPS, CPX, NMAT, NSPS)
        async_copy.wait_group(STAGES - 1)
        slot = st % STAGES
        for j in gl.static_range(NSPS):
            xe = _to_b_operand(x_smem.index((slot * NSPS + j) * 2).load(CPX), B_OP)
            xo = _to_b_operand(x_smem.index((slot * NSPS + j) * 2 + 1).load(CPX), B_OP)
            acc0 = _step(acc0, xe, xo, w_smem, s_smem, (slot * NMAT) * NSPS + j, smax0, IS_NV,
                         BN, NS, GS, WL, SL, A_OP, ASM)
            if NMAT == 2:
                acc1 = _step(acc1, xe, xo, w_smem, s_smem, (slot * NMAT + 1) * NSPS + j, smax1,
                             IS_NV, BN, NS, GS, WL, SL, A_OP, ASM)
    async_copy.wait_group(0)
    return acc0, acc1


@gluon.jit
def _seg_order(n):
    """Column n of an activation row -> its place in sigma's order."""
    return (n // 128) * 128 + (n % 2) * 64 + (n % 128) // 2


@gluon.jit
def _block(sorted_pair_ptr, block_start_ptr, block_count_ptr, b, ROWL: gl.constexpr):
    start = gl.load(block_start_ptr + b)
    cnt = gl.load(block_count_ptr + b)
    offs_m = gl.arange(0, BM, layout=ROWL)
    mmask = offs_m < cnt
    pair = gl.load(sorted_pair_ptr + start + offs_m, mask=mmask, other=0)
    return start, offs_m, mmask, pair


@gluon.jit
def _weight_rows(w_ptr, s_ptr, e, pn, sp, n_rows, NSEG, stride_we, stride_wn, stride_se,
                 stride_sn, IS_NV: gl.constexpr, BN: gl.constexpr, num_warps: gl.constexpr):
    """Expert e's BN rows from K slice sp: (offs_n, nmask, weight, scale pointers, MXFP4 maxima)."""
    COLL: gl.constexpr = gl.SliceLayout(1, _mma_layout(num_warps))
    NSC: gl.constexpr = SEG_BYTES // (8 if IS_NV else 16)
    offs_n = pn * BN + gl.arange(0, BN, layout=COLL)
    nmask = offs_n < n_rows
    e64 = e.to(gl.int64)
    r64 = offs_n.to(gl.int64)
    w = w_ptr + e64 * stride_we + r64 * stride_wn + sp * NSEG * SEG_BYTES
    s = s_ptr + e64 * stride_se + r64 * stride_sn + sp * NSEG * NSC
    if IS_NV:
        smax = gl.zeros([BN], gl.int32, layout=COLL)
    else:
        smax = gl.convert_layout(_row_smax(s, nmask, NSEG * NSC, BN, num_warps), COLL)
    return offs_n, nmask, w, s, smax


@gluon.jit
def _undo_scales(acc, smax, gscale_ptr, e, IS_NV: gl.constexpr):
    """acc times what decode and x's 2**-8 owe (NVFP4: 2**22 gscale; MXFP4: 2**(smax - 120))."""
    if IS_NV:
        return acc * (4194304.0 * gl.load(gscale_ptr + e))
    else:
        return acc * ((smax + 7) << 23).to(gl.float32, bitcast=True)[:, None]


@gluon.jit
def gate_up_kernel(xp_ptr, w_ptr, s_ptr, gscale_ptr, sorted_pair_ptr, block_expert_ptr,
                   block_start_ptr, block_count_ptr, out_ptr, I, TOPK, NSEG, stride_xt,
                   stride_we, stride_wn, stride_se, stride_sn, stride_out, swiglu_limit,
                   IS_NV: gl.constexpr, HAS_LIMIT: gl.constexpr, BN: gl.constexpr,
                   STAGES: gl.constexpr, NSPS: gl.constexpr, ASM: gl.constexpr,
                   num_warps: gl.constexpr):
    """The block's tokens times BN gate and BN up rows -> act in sigma's order, fp16 times
    2**-8. One K slice is launched; sp stays a program id (a constant 0 compiles otherwise)."""
    b = gl.program_id(0)
    pn = gl.program_id(1)
    sp = gl.program_id(2)
    e = gl.load(block_expert_ptr + b)
    if e >= 0:
        start, offs_m, mmask, pair = _block(sorted_pair_ptr, block_start_ptr, block_count_ptr,
                                            b, gl.SliceLayout(0, _mma_layout(num_warps)))
        offs_n, nmask, wg, sg, smax_g = _weight_rows(w_ptr, s_ptr, e, pn, sp, I, NSEG, stride_we,
                                                     stride_wn, stride_se, stride_sn, IS_NV, BN,
                                                     num_warps)
        _, _, wu, su, smax_u = _weight_rows(w_ptr + I * stride_wn, s_ptr + I * stride_sn, e, pn,
                                            sp, I, NSEG, stride_we, stride_wn, stride_se,
                                            stride_sn, IS_NV, BN, num_warps)
        x_rows = xp_ptr + (pair // TOPK).to(gl.int64) * stride_xt + sp * NSEG * 128
        acc_g, acc_u = _k_loop(wg, sg, nmask, smax_g, wu, su, nmask, smax_u,
                               x_rows, mmask, NSEG, IS_NV, BN, 2, STAGES, NSPS, ASM, num_warps)
        gate = _undo_scales(acc_g, smax_g, gscale_ptr, e, IS_NV)
        up = _undo_scales(acc_u, smax_u, gscale_ptr, e, IS_NV)
        rows = (start + offs_m).to(gl.int64)
        omask = mmask[None, :] & nmask[:, None]
        act = swiglu(gate, up, swiglu_limit, HAS_LIMIT)
        gl.store(out_ptr + rows[None, :] * stride_out + _seg_order(offs_n)[:, None],
                 (act * 0.00390625).to(gl.float16), mask=omask)


@gluon.jit
def down_kernel(act_ptr, w_ptr, s_ptr, gscale_ptr, topk_w_ptr, sorted_pair_ptr,
                block_expert_ptr, block_start_ptr, block_count_ptr, ypair_ptr, H, NSEG,
                stride_act, stride_we, stride_wn, stride_se, stride_sn, stride_y, stride_ys,
                IS_NV: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
                NSPS: gl.constexpr, ASM: gl.constexpr, num_warps: gl.constexpr):
    """The block's act times BN down rows and the routing weights -> ypair[sp]."""
    b = gl.program_id(0)
    pn = gl.program_id(1)
    sp = gl.program_id(2)
    e = gl.load(block_expert_ptr + b)
    if e >= 0:
        start, offs_m, mmask, pair = _block(sorted_pair_ptr, block_start_ptr, block_count_ptr,
                                            b, gl.SliceLayout(0, _mma_layout(num_warps)))
        offs_n, nmask, w, s, smax = _weight_rows(w_ptr, s_ptr, e, pn, sp, H, NSEG, stride_we,
                                                 stride_wn, stride_se, stride_sn, IS_NV, BN,
                                                 num_warps)
        a_rows = act_ptr + (start + offs_m).to(gl.int64) * stride_act + sp * NSEG * 128
        acc, unused = _k_loop(w, s, nmask, smax, w, s, nmask, smax, a_rows, mmask, NSEG, IS_NV,
                              BN, 1, STAGES, NSPS, ASM, num_warps)
        wt = gl.load(topk_w_ptr + pair, mask=mmask, other=0.0).to(gl.float32)
        y = _undo_scales(acc, smax, gscale_ptr, e, IS_NV) * wt[None, :]
        gl.store(ypair_ptr + sp.to(gl.int64) * stride_ys + pair.to(gl.int64)[None, :] * stride_y
                 + offs_n[:, None], y, mask=mmask[None, :] & nmask[:, None])


@triton.jit
def x_seg_kernel(x_ptr, xk_ptr, HP, stride_x, stride_xk, BH: tl.constexpr):
    """Row t of x -> fp16 ``x * 2**-8`` in sigma's order (HP = H / 2)."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BH + tl.arange(0, BH)
    m = offs < HP
    src = x_ptr + t * stride_x + 2 * offs
    dst = xk_ptr + t * stride_xk + (offs // 64) * 128 + offs % 64
    for r in tl.static_range(2):
        xr = tl.load(src + r, mask=m, other=0.0).to(tl.float32) * 0.00390625
        tl.store(dst + r * 64, xr.to(tl.float16), mask=m)


class MmaLaunches:
    """The launches of :func:`fused_moe` for one device, shape and format, and their buffers."""

    def __init__(self, device, T, H, E, I, topk, fmt, has_limit):
        P = T * topk
        is_nv = fmt == "nvfp4"
        nsc = 2 if is_nv else 1                     # scale bytes a 32-element block
        self.T, self.H, self.I, self.P, self.E, self.is_nv = T, H, I, P, E, is_nv
        self.nbm = num_blocks_max(P, E, int(BM))
        self.align_fits = align_kernel_fits(P)
        nsps1 = pick_split(H // 128, NSPS1)
        nsps2 = pick_split(I // 128, NSPS2)
        BX = min(1024, triton.next_power_of_2(max(1, H // 2)))
        self.x_seg = Launch(x_seg_kernel, (T, triton.cdiv(H // 2, BX)),
                            dict(HP=H // 2, stride_x=H, stride_xk=H, BH=BX), device=device,
                            guard=(0,), num_warps=4)
        self.gate_up = Launch(gate_up_kernel, (self.nbm, triton.cdiv(I, BN1), 1), dict(
            I=I, TOPK=topk, NSEG=H // 128, stride_xt=H, stride_we=2 * I * H // 2,
            stride_wn=H // 2, stride_se=2 * I * H // 32 * nsc, stride_sn=H // 32 * nsc,
            stride_out=I, IS_NV=is_nv, HAS_LIMIT=has_limit, BN=BN1, STAGES=STAGES, NSPS=nsps1,
            ASM=CVT8_ASM, num_warps=NUM_WARPS), device=device, guard=(1, 2, 3))
        self.down = Launch(down_kernel, (self.nbm, triton.cdiv(H, BN2), 1), dict(
            H=H, NSEG=I // 128, stride_act=I, stride_we=H * I // 2, stride_wn=I // 2,
            stride_se=H * I // 32 * nsc, stride_sn=I // 32 * nsc, stride_y=H, stride_ys=P * H,
            IS_NV=is_nv, BN=BN2, STAGES=STAGES, NSPS=nsps2, ASM=CVT8_ASM, num_warps=NUM_WARPS),
            device=device, guard=(1, 2, 3, 4))
        BH = min(1024, triton.next_power_of_2(H))
        self.combine = Launch(combine_kernel, (T, triton.cdiv(H, BH)), dict(
            H=H, E=E, stride_y=H, stride_ys=P * H, stride_out=H, TOPK=topk, SPLIT=1, BH=BH),
            device=device, guard=(1,), num_warps=4)
        self.ws_key = ("mma_sm90", T, H, I, P, self.nbm)

    def _buffers(self, dev):
        T, H, I, P = self.T, self.H, self.I, self.P
        return (torch.empty(T, H, dtype=torch.float16, device=dev),
                torch.empty(P, I, dtype=torch.float16, device=dev),
                torch.empty(1, P, H, dtype=torch.float32, device=dev),     # [K slices, P, H]
                align_buffers(P, self.nbm, dev) if self.align_fits else None)

    def __call__(self, x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, w13_global,
                 w2_global, swiglu_limit):
        dev = x.device
        xp, act, ypair, grouping = workspace(self.ws_key, dev, lambda: self._buffers(dev))
        if self.is_nv:
            w13_scale, w2_scale = w13_scale.view(torch.uint8), w2_scale.view(torch.uint8)
        self.x_seg(x, xp)
        sorted_pair, block_expert, block_start, block_count = moe_align(topk_ids, self.E,
                                                                        int(BM), out=grouping)
        g13 = w13_global if self.is_nv else ypair
        g2 = w2_global if self.is_nv else ypair
        limit = float(swiglu_limit) if swiglu_limit is not None else 0.0
        self.gate_up(xp, w13, w13_scale, g13, sorted_pair, block_expert, block_start,
                     block_count, act, limit)
        self.down(act, w2, w2_scale, g2, topk_weights, sorted_pair, block_expert, block_start,
                  block_count, ypair)
        out = torch.empty(self.T, self.H, dtype=x.dtype, device=dev)
        self.combine(ypair, topk_ids, out)
        return out


_LAUNCHES: dict = {}


def fused_moe(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, *, fmt="mxfp4",
              w13_global=None, w2_global=None, swiglu_limit=None):
    """The grouped FP4 MoE with these GEMMs (arguments as ``dsv4lab.ops.fused_moe``, checked;
    sizes multiples of 512, weights and scales 16-byte aligned). No host sync."""
    T, H = x.shape
    E, two_i, _ = w13.shape
    I = two_i // 2
    if H % 512 or I % 512:   # scale rows (H/32, I/32 bytes) stay 16-byte aligned for cp.async
        raise ValueError(f"mma_sm90: hidden and intermediate sizes must be multiples of 512, got {H}, {I}")
    dev = x.device
    launches = planned(_LAUNCHES, (dev, T, H, E, I, topk_ids.shape[1], fmt,
                                   swiglu_limit is not None), dev,
                       lambda: MmaLaunches(dev, T, H, E, I, topk_ids.shape[1], fmt,
                                           swiglu_limit is not None))
    return launches(*contiguous_args(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights,
                                 w13_global, w2_global), swiglu_limit)
