"""The few-token FP4 MoE decode, warp-specialised (Gluon; sm_90 and newer, not under the
interpreter): the weight bytes stream into shared memory on their own warps, whatever the
math is doing.

The idea. :func:`dsv4lab.kernels.moe_mma2._decode_kernel` (the table's T = 1 entry) loads each
K-step's weights into the registers of the warps that decode and multiply them, a few steps
ahead: the bytes in flight rise and fall with the math, and a tile's down loads wait for the
gate/up tiles to leave their SM. Here each program (one an SM, persistent) splits its warps
by job:

* a **producer** (the default partition, 4 warps) copies item after item by ``cp.async``
  (L2 evict-first where :mod:`dsv4lab.kernels.l2_hint` applies) into a ring of ``NUM_BUF``
  shared-memory stages of ``CH`` K-steps of the item's 128 rows, and signals each stage on an
  mbarrier; it waits only for a stage the consumers released, never for the activations a
  down item needs, so the down weights arrive while the last gate/up items finish;
* two **consumers** (4 warps each) take the item's rows 0-63 and 64-127: the register ring's
  decode and ``mma.sync`` (:func:`moe_mma2._regs_step`, the same bits a K-step), the words read
  from the stage instead of from global memory.

Items, all 128 rows x ``NSEG`` K-steps (64 KB of FP4 at Flash's shape), are handed out
statically (item i to program i mod G, in order; the G programs are all resident, one an SM
by shared memory): first every gate/up item (pair p, 64 intermediate rows, K slice sp), then
every down item (pair p, 128 hidden rows, K slice sp). A consumer's gate/up half is 32 gate
and the 32 matching up rows, alternating every 8 matrix rows so that a lane holds a gate row
and its up row; it ends as the fused decode's gate/up tile of BN1 32 (split-K partials, the
last slice's SwiGLU, the pair's count), and a down half as its down tile of BN2 64 (it waits
for the pair's activations; the last of a row tile's pairs and slices sums them in order), so
two calls give the same bits. Deadlock-free: a program's items run in index order, every
gate/up index is below every down index, and every program is resident.

Explained in notebooks/04_mxfp4_moe_port.ipynb.
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from dsv4lab.kernels import l2_hint
from dsv4lab.kernels import moe_mma2 as mm
from dsv4lab.kernels.gluon_compat import async_load, cta_barrier

ROWS = gl.constexpr(128)     # an item's weight rows
HALF = gl.constexpr(64)      # a consumer's rows
CWARPS = gl.constexpr(4)     # a consumer's warps (16 rows each)
BN1 = gl.constexpr(32)       # a consumer's gate rows (and as many up rows)
BN2 = gl.constexpr(64)       # a consumer's down rows


@gluon.jit
def _item(i, n_gu, n_blk1, n_blk2, SPLIT1, SPLIT2):
    """Item i -> (gate/up or not, pair, row block, K slice)."""
    gu = i < n_gu
    d = i - n_gu
    sp = gl.where(gu, i % SPLIT1, d % SPLIT2)
    j = gl.where(gu, i // SPLIT1 % n_blk1, d // SPLIT2 % n_blk2)
    p = gl.where(gu, i // SPLIT1 // n_blk1, d // SPLIT2 // n_blk2)
    return gu, p, j, sp


@gluon.jit
def _gu_rows(r, I):
    """A gate/up item's matrix row r (consumer r // 64, its row 16 a + 8 b + c) -> its w13 row
    within the item's 64-row block: intermediate row 32 (r // 64) + 8 a + c, gate (b = 0) or
    up (b = 1)."""
    rr = r % 64
    return 32 * (r // 64) + 8 * (rr // 16) + rr % 8 + (rr // 8 % 2) * I


@gluon.jit
def _producer(xp_ptr, w13_ptr, s13_ptr, g13_ptr, w2_ptr, s2_ptr, g2_ptr, ids_ptr, topk_w_ptr,
              act_ptr, part_ptr, ypair_ptr, out_ptr, ctr_ptr, P, T, TOPK, I, H, n_items, n_gu,
              stride_xt, stride_w13e, stride_w13n, stride_s13e, stride_s13n, stride_w2e,
              stride_w2n, stride_s2e, stride_s2n, stride_act, stride_part, stride_y, stride_out,
              swiglu_limit, ring, scl, cfg, ready, empty, sfree):
    """4 warps: each item's scale words (all its K-steps, into the item's slot), then its
    K-steps, CH a stage, into the ring. (Constexprs do not reach warp_specialize's partitions:
    sizes come off the buffers' shapes.)"""
    CH: gl.constexpr = cfg.type.shape[2]
    NUM_BUF: gl.constexpr = ring.type.shape[0] // CH
    NW: gl.constexpr = scl.type.shape[0] // 2         # scale words a row an item
    NSEG: gl.constexpr = cfg.type.shape[1]
    PL: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
    SLW: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    split1 = H // 128 // NSEG
    split2 = I // 128 // NSEG
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, PL))
    cw = gl.arange(0, 16, layout=gl.SliceLayout(0, PL))
    rs = gl.arange(0, ROWS, layout=SLW)
    on3 = (r[:, None] + cw[None, :]) >= 0
    on2 = rs >= 0
    it = 0
    for i in range(gl.program_id(0), n_items, gl.num_programs(0)):
        gu, p, j, sp = _item(i, n_gu, I // 64, H // ROWS, split1, split2)
        e = gl.load(ids_ptr + p)
        live = e >= 0
        e64 = gl.maximum(e, 0).to(gl.int64)
        if gu:
            wrow = (w13_ptr + e64 * stride_w13e + (64 * j + _gu_rows(r, I)).to(gl.int64) * stride_w13n
                    + sp * NSEG * 64)
            srow = (s13_ptr + e64 * stride_s13e + (64 * j + _gu_rows(rs, I)).to(gl.int64) * stride_s13n
                    + sp * NW * 4)
        else:
            wrow = (w2_ptr + e64 * stride_w2e + (ROWS * j + r).to(gl.int64) * stride_w2n
                    + sp * NSEG * 64)
            srow = (s2_ptr + e64 * stride_s2e + (ROWS * j + rs).to(gl.int64) * stride_s2n
                    + sp * NW * 4)
        wrow = wrow.to(gl.pointer_type(gl.int32))
        srow = srow.to(gl.pointer_type(gl.int32))
        slot = it % 2
        mbarrier.wait(sfree.index(slot), ((it // 2) & 1) ^ 1)
        for wi in gl.static_range(NW):
            async_load(scl.index(slot * NW + wi), srow + wi, mask=on2 & live)
        for c in range(NSEG // CH):
            q = it * (NSEG // CH) + c
            buf = q % NUM_BUF
            mbarrier.wait(empty.index(buf), ((q // NUM_BUF) & 1) ^ 1)
            for kk in gl.static_range(CH):
                async_load(ring.index(buf * CH + kk), wrow[:, None] + ((c * CH + kk) * 16 + cw)[None, :],
                           mask=on3 & live)
            async_copy.mbarrier_arrive(ready.index(buf))
            mbarrier.arrive(ready.index(buf), count=1)
        it += 1


@gluon.jit
def _scale_bytes(scl, w, k, CP: gl.constexpr, NS: gl.constexpr, NSC: gl.constexpr, RL: gl.constexpr,
                 t4, si):
    """K-step k's scale bytes of the consumer's rows, [64, 4, NS] as :func:`moe_mma2._load_step`
    gives them, from the item's scale words (its first at row w of ``scl``)."""
    w0 = scl.index(w + k * (NSC // 4)).slice(CP * HALF, HALF, dim=0).load(RL)[:, None, None]
    b = t4[None, :, None] * NS + si[None, None, :]
    if NSC == 8:
        w1 = scl.index(w + k * 2 + 1).slice(CP * HALF, HALF, dim=0).load(RL)[:, None, None]
        w0 = gl.where(b < 4, w0, w1)
    return ((w0 >> ((b % 4) * 8)) & 0xFF).to(gl.uint8)


@gluon.jit
def _row_max(scl, w0, CP: gl.constexpr, NW: gl.constexpr, RL: gl.constexpr):
    """MXFP4: the largest scale byte of each of the consumer's rows over the item's K slice
    (its NW words from row w0 of ``scl``)."""
    mx = gl.zeros([HALF], gl.int32, layout=RL)
    for wi in gl.static_range(NW):
        w = scl.index(w0 + wi).slice(CP * HALF, HALF, dim=0).load(RL)
        mx = gl.maximum(gl.maximum(mx, w & 0xFF), gl.maximum((w >> 8) & 0xFF, (w >> 16) & 0xFF))
        mx = gl.maximum(mx, (w >> 24) & 0xFF)
    return mx


@gluon.jit
def _consumer(xp_ptr, w13_ptr, s13_ptr, g13_ptr, w2_ptr, s2_ptr, g2_ptr, ids_ptr, topk_w_ptr,
              act_ptr, part_ptr, ypair_ptr, out_ptr, ctr_ptr, P, T, TOPK, I, H, n_items, n_gu,
              stride_xt, stride_w13e, stride_w13n, stride_s13e, stride_s13n, stride_w2e,
              stride_w2n, stride_s2e, stride_s2n, stride_act, stride_part, stride_y, stride_out,
              swiglu_limit, ring, scl, cfg, ready, empty, sfree, CP: gl.constexpr):
    """4 warps, rows [64 CP, 64 CP + 64) of every item of this program."""
    CH: gl.constexpr = cfg.type.shape[2]
    NUM_BUF: gl.constexpr = ring.type.shape[0] // CH
    NW: gl.constexpr = scl.type.shape[0] // 2
    IS_NV: gl.constexpr = cfg.type.shape[0] == 2
    NSEG: gl.constexpr = cfg.type.shape[1]
    MMA: gl.constexpr = mm._mma_layout(CWARPS)
    A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    CPW: gl.constexpr = mm._regs_layouts(HALF, CWARPS, IS_NV)[0]
    WW: gl.constexpr = mm._regs_layouts(HALF, CWARPS, IS_NV)[1]
    RL: gl.constexpr = mm._regs_layouts(HALF, CWARPS, IS_NV)[2]
    NS: gl.constexpr = mm._regs_layouts(HALF, CWARPS, IS_NV)[3]
    NSC: gl.constexpr = mm._regs_layouts(HALF, CWARPS, IS_NV)[4]
    SL: gl.constexpr = gl.SliceLayout(3, WW)
    CPX: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [1, CWARPS], [1, 0])
    t4 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, SL)))
    si = gl.arange(0, NS, layout=gl.SliceLayout(0, gl.SliceLayout(1, SL)))
    cx = gl.arange(0, 64, layout=gl.SliceLayout(0, CPX))
    m = gl.arange(0, mm.BM, layout=gl.SliceLayout(0, MMA))
    split1 = H // 128 // NSEG
    split2 = I // 128 // NSEG
    n_tiles1 = I // BN1
    n_tiles2 = H // BN2
    it = 0
    for i in range(gl.program_id(0), n_items, gl.num_programs(0)):
        gu, p, j, sp = _item(i, n_gu, I // 64, H // ROWS, split1, split2)
        e = gl.load(ids_ptr + p)
        t = p // TOPK
        col = m == t
        slot = it % 2
        if gu:
            x_rows = xp_ptr + t.to(gl.int64) * stride_xt + sp * NSEG * 128 + m * 0
        else:
            if e >= 0:      # the pair's activations (the producer streams on meanwhile)
                mm._wait_count(ctr_ptr + 1 + p, n_tiles1)
            x_rows = act_ptr + p.to(gl.int64) * stride_act + sp * NSEG * 128 + m * 0
        xr = gl.convert_layout(x_rows, gl.SliceLayout(1, CPX))
        xm = gl.convert_layout(col & (e >= 0), gl.SliceLayout(1, CPX))[:, None]
        acc = gl.zeros([HALF, mm.BM], gl.float32, layout=MMA)
        smax = gl.zeros([HALF], gl.int32, layout=RL)
        for c in range(NSEG // CH):
            q = it * (NSEG // CH) + c
            buf = q % NUM_BUF
            mbarrier.wait(ready.index(buf), (q // NUM_BUF) & 1)
            if not IS_NV:
                if c == 0:      # (the first stage's copies follow the item's scale words)
                    smax = _row_max(scl, slot * NW, CP, NW, RL)
            for kk in gl.static_range(CH):
                k = c * CH + kk
                pw = ring.index(buf * CH + kk).slice(CP * HALF, HALF, dim=0).load(CPW)
                sb = _scale_bytes(scl, slot * NW, k, CP, NS, NSC, RL, t4, si)
                acc = mm._regs_step(acc, pw, sb, smax, xr, xm, k, NSEG, cx, IS_NV, HALF, WW,
                                    A_OP, B_OP)
            cta_barrier()
            mbarrier.arrive(empty.index(buf), count=1)
        cta_barrier()
        mbarrier.arrive(sfree.index(slot), count=1)
        smax_r = gl.convert_layout(smax, gl.SliceLayout(1, MMA))
        if gu:
            _gate_up_end(acc, smax_r, e, p, t, 2 * j + CP, sp, g13_ptr, act_ptr, part_ptr,
                         ctr_ptr, P, I, n_tiles1, n_tiles2, split1, stride_act, stride_part,
                         swiglu_limit, IS_NV)
        else:
            _down_end(acc, smax_r, e, p, 2 * j + CP, sp, m, col, g2_ptr, ids_ptr, topk_w_ptr,
                      ypair_ptr, out_ptr, ctr_ptr, P, T, TOPK, split2, stride_y, stride_out,
                      IS_NV)
        it += 1


@gluon.jit
def _gate_up_end(acc, smax, e, p, t, pn, sp, g13_ptr, act_ptr, part_ptr, ctr_ptr, P, I,
                 n_tiles1, n_tiles2, split1, stride_act, stride_part, swiglu_limit,
                 IS_NV: gl.constexpr):
    """A consumer's gate/up half -> the fused decode's gate/up tile pn (BN1 32) of pair p,
    K slice sp: partials, the last slice's SwiGLU into act[p], the pair's count released."""
    if e >= 0:
        acc = mm._undo_scales(acc, smax, g13_ptr, e, IS_NV)
    # rows 16 a + 8 b + c -> (gate, up)[8 a + c]: b is a register bit of the mma layout
    gate, up = gl.split(gl.permute(gl.reshape(acc, [4, 2, 8, mm.BM]), [0, 2, 3, 1]))
    gate = gl.reshape(gate, [BN1, mm.BM])
    up = gl.reshape(up, [BN1, mm.BM])
    GL: gl.constexpr = gate.type.layout
    offs_n = pn * BN1 + gl.arange(0, BN1, layout=gl.SliceLayout(1, GL))
    m = gl.arange(0, mm.BM, layout=gl.SliceLayout(0, GL))
    col = m == t
    if e >= 0:
        if split1 > 1:
            part = mm._pair_tile(part_ptr, sp * P + p, stride_part, offs_n, m)
            gl.store(part, gate, mask=col[None, :])
            gl.store(part + I, up, mask=col[None, :])
        else:
            mm._store_act(act_ptr, p, stride_act, offs_n, m, col, gate, up, swiglu_limit, True)
    last = True
    if split1 > 1:
        cta_barrier()
        last = gl.atomic_add(ctr_ptr + 1 + P + n_tiles2 + p * n_tiles1 + pn, 1, sem="acq_rel",
                             scope="gpu") == split1 - 1
        if last & (e >= 0):                 # the row tile's last slice: sum in slice order
            gate = gl.zeros([BN1, mm.BM], gl.float32, layout=GL)
            up = gl.zeros([BN1, mm.BM], gl.float32, layout=GL)
            for q in range(split1):
                part = mm._pair_tile(part_ptr, q * P + p, stride_part, offs_n, m)
                gate += gl.load(part, mask=col[None, :], other=0.0, cache_modifier=".cg")
                up += gl.load(part + I, mask=col[None, :], other=0.0, cache_modifier=".cg")
            mm._store_act(act_ptr, p, stride_act, offs_n, m, col, gate, up, swiglu_limit, True)
    if last:
        cta_barrier()                         # every thread's act stores, then one release
        gl.atomic_add(ctr_ptr + 1 + p, 1, sem="release", scope="gpu")


@gluon.jit
def _down_end(acc, smax, e, p, pn, sp, m, col, g2_ptr, ids_ptr, topk_w_ptr, ypair_ptr, out_ptr,
              ctr_ptr, P, T, TOPK, split2, stride_y, stride_out, IS_NV: gl.constexpr):
    """A consumer's down half -> the fused decode's down tile pn (BN2 64) of pair p, K slice
    sp: weighted into ypair; the last of the row tile's P x split2 sums them in order."""
    MMA: gl.constexpr = acc.type.layout
    offs_h = pn * BN2 + gl.arange(0, BN2, layout=gl.SliceLayout(1, MMA))
    if e >= 0:
        wt = gl.load(topk_w_ptr + p).to(gl.float32)
        y = mm._undo_scales(acc, smax, g2_ptr, e, IS_NV) * wt
        gl.store(mm._pair_tile(ypair_ptr, sp * P + p, stride_y, offs_h, m), y, mask=col[None, :])
    cta_barrier()
    done = gl.atomic_add(ctr_ptr + 1 + P + pn, 1, sem="acq_rel", scope="gpu")
    if done == P * split2 - 1:                # the last of this row tile's down tiles
        total = gl.zeros([BN2, mm.BM], gl.float32, layout=MMA)
        for q in range(P):                    # pairs and slices in order: the same sum every call
            tq = q // TOPK
            live = (m == tq)[None, :] & (gl.load(ids_ptr + q) >= 0)
            for q2 in range(split2):
                total += gl.load(ypair_ptr + (q2 * P + q) * stride_y + offs_h[:, None] + m[None, :] * 0,
                                 mask=live, other=0.0, cache_modifier=".cg")
        gl.store(out_ptr + m[None, :].to(gl.int64) * stride_out + offs_h[:, None],
                 total.to(out_ptr.dtype.element_ty), mask=(m < T)[None, :])


@gluon.jit
def _consumer0(xp_ptr, w13_ptr, s13_ptr, g13_ptr, w2_ptr, s2_ptr, g2_ptr, ids_ptr, topk_w_ptr,
               act_ptr, part_ptr, ypair_ptr, out_ptr, ctr_ptr, P, T, TOPK, I, H, n_items, n_gu,
               stride_xt, stride_w13e, stride_w13n, stride_s13e, stride_s13n, stride_w2e,
               stride_w2n, stride_s2e, stride_s2n, stride_act, stride_part, stride_y, stride_out,
               swiglu_limit, ring, scl, cfg, ready, empty, sfree):
    _consumer(xp_ptr, w13_ptr, s13_ptr, g13_ptr, w2_ptr, s2_ptr, g2_ptr, ids_ptr, topk_w_ptr,
              act_ptr, part_ptr, ypair_ptr, out_ptr, ctr_ptr, P, T, TOPK, I, H, n_items, n_gu,
              stride_xt, stride_w13e, stride_w13n, stride_s13e, stride_s13n, stride_w2e,
              stride_w2n, stride_s2e, stride_s2n, stride_act, stride_part, stride_y, stride_out,
              swiglu_limit, ring, scl, cfg, ready, empty, sfree, 0)


@gluon.jit
def _consumer1(xp_ptr, w13_ptr, s13_ptr, g13_ptr, w2_ptr, s2_ptr, g2_ptr, ids_ptr, topk_w_ptr,
               act_ptr, part_ptr, ypair_ptr, out_ptr, ctr_ptr, P, T, TOPK, I, H, n_items, n_gu,
               stride_xt, stride_w13e, stride_w13n, stride_s13e, stride_s13n, stride_w2e,
               stride_w2n, stride_s2e, stride_s2n, stride_act, stride_part, stride_y, stride_out,
               swiglu_limit, ring, scl, cfg, ready, empty, sfree):
    _consumer(xp_ptr, w13_ptr, s13_ptr, g13_ptr, w2_ptr, s2_ptr, g2_ptr, ids_ptr, topk_w_ptr,
              act_ptr, part_ptr, ypair_ptr, out_ptr, ctr_ptr, P, T, TOPK, I, H, n_items, n_gu,
              stride_xt, stride_w13e, stride_w13n, stride_s13e, stride_s13n, stride_w2e,
              stride_w2n, stride_s2e, stride_s2n, stride_act, stride_part, stride_y, stride_out,
              swiglu_limit, ring, scl, cfg, ready, empty, sfree, 1)


@gluon.jit
def _ws_decode_kernel(xp_ptr, w13_ptr, s13_ptr, g13_ptr, w2_ptr, s2_ptr, g2_ptr, ids_ptr,
                      topk_w_ptr, act_ptr, part_ptr, ypair_ptr, out_ptr, ctr_ptr, P, T, TOPK, I,
                      H, stride_xt, stride_w13e, stride_w13n, stride_s13e, stride_s13n,
                      stride_w2e, stride_w2n, stride_s2e, stride_s2n, stride_act, stride_part,
                      stride_y, stride_out, swiglu_limit, IS_NV: gl.constexpr,
                      NSEG: gl.constexpr, CH: gl.constexpr, NUM_BUF: gl.constexpr,
                      CONSUMER_REGS: gl.constexpr, PDL: gl.constexpr, EVICT: gl.constexpr,
                      num_warps: gl.constexpr):
    """The whole MoE of a few tokens (T <= 8) in one persistent launch: see the module."""
    if PDL:     # x's copy (and the zeroed counters) first
        mm._gdc_wait(num_warps)
    if EVICT:
        l2_hint.mark(num_warps)
    NSC: gl.constexpr = 8 if IS_NV else 4
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    # a stage: CH K-steps, each [128 rows, 64 bytes]
    ring = gl.allocate_shared_memory(gl.int32, [NUM_BUF * CH, ROWS, 16], plain)
    # the scale words of two items: [2 x NSEG NSC / 4, 128 rows] (rows of them read alone)
    scl = gl.allocate_shared_memory(gl.int32, [2 * NSEG * NSC // 4, ROWS],
                                    gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    # the partitions' constexprs, as a shape: [1 + IS_NV, NSEG, CH] (never read)
    cfg = gl.allocate_shared_memory(gl.int8, [1 + IS_NV, NSEG, CH],
                                    gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0]))
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    sfree = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(NUM_BUF):
        mbarrier.init(ready.index(b), count=1)
        mbarrier.init(empty.index(b), count=2)          # released by both consumers
    for b in gl.static_range(2):
        mbarrier.init(sfree.index(b), count=2)
    n_gu = P * (I // 64) * (H // 128 // NSEG)
    n_items = n_gu + P * (H // ROWS) * (I // 128 // NSEG)
    args = (xp_ptr, w13_ptr, s13_ptr, g13_ptr, w2_ptr, s2_ptr, g2_ptr, ids_ptr, topk_w_ptr,
            act_ptr, part_ptr, ypair_ptr, out_ptr, ctr_ptr, P, T, TOPK, I, H, n_items, n_gu,
            stride_xt, stride_w13e, stride_w13n, stride_s13e, stride_s13n, stride_w2e,
            stride_w2n, stride_s2e, stride_s2n, stride_act, stride_part, stride_y, stride_out,
            swiglu_limit, ring, scl, cfg, ready, empty, sfree)
    gl.warp_specialize([(_producer, args), (_consumer0, args), (_consumer1, args)],
                       [CWARPS, CWARPS], [CONSUMER_REGS, CONSUMER_REGS])


def nseg_for(H: int, I: int, nseg: int = 8) -> int:
    """K-steps an item (both kinds alike): ``nseg`` or the largest power of two below it
    that divides both K's steps (H / 128 and I / 128)."""
    while nseg > 1 and ((H // 128) % nseg or (I // 128) % nseg):
        nseg //= 2
    return nseg


def decode(xp, T, w13, w13_scale, w2, w2_scale, ids, tw, is_nv, w13_global, w2_global,
           swiglu_limit, out_dtype, counters, pdl, *, nseg=8, ch=2, num_buf=8, consumer_regs=208,
           maxnreg=168, evict=True):
    """:func:`_ws_decode_kernel` on x's copy ``xp`` (sigma's order) and its zeroed
    ``counters`` (1 + P + H / 64 + P I / 32 of them): T <= 8 tokens, weights in the canonical
    layout, H a multiple of 128 and I of 64 (the launcher checks). One program an SM."""
    H = xp.shape[1]
    I = w13.shape[1] // 2
    P = ids.numel()
    dev = xp.device
    nseg = nseg_for(H, I, nseg)
    ch = min(ch, nseg)
    split1, split2 = H // 128 // nseg, I // 128 // nseg
    act = torch.empty(P, I, dtype=torch.float16, device=dev)
    part = torch.empty(split1 * P, 2 * I, dtype=torch.float32, device=dev) if split1 > 1 else act
    ypair = torch.empty(split2 * P, H, dtype=torch.float32, device=dev)
    out = torch.empty(T, H, dtype=out_dtype, device=dev)
    g13 = w13_global.contiguous() if is_nv else ypair
    g2 = w2_global.contiguous() if is_nv else ypair
    n_items = P * (I // 64) * split1 + P * (H // 128) * split2
    grid = (min(n_items, torch.cuda.get_device_properties(dev).multi_processor_count),)
    _ws_decode_kernel[grid](
        xp, w13, w13_scale, g13, w2, w2_scale, g2, ids, tw, act, part, ypair, out, counters,
        P, T, ids.shape[1], I, H, xp.stride(0), w13.stride(0), w13.stride(1),
        w13_scale.stride(0), w13_scale.stride(1), w2.stride(0), w2.stride(1), w2_scale.stride(0),
        w2_scale.stride(1), act.stride(0), part.stride(0), ypair.stride(0), out.stride(0),
        float(swiglu_limit) if swiglu_limit is not None else float("inf"), IS_NV=is_nv,
        NSEG=nseg, CH=ch, NUM_BUF=num_buf, CONSUMER_REGS=consumer_regs, PDL=pdl,
        EVICT=bool(evict) and l2_hint.active(), num_warps=4, launch_pdl=pdl, maxnreg=maxnreg)
    return out
