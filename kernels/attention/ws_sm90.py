"""Sparse MLA decode, warp-specialised for sm_90 (Gluon): the gathers and the math overlap.

Lesson 2's kernel (``mma.py``) runs every step of a tile in the same warps, one after the
other, so its chain of math, not memory, sets its pace. Here each job has its own warps:

* a **producer** warp group gathers tiles of 32 latent rows by ``cp.async`` into a ring of
  shared-memory buffers (four for bf16), signalling each on an mbarrier;
* two **consumer** warp groups in a **seesaw**: consumer w owns tiles 2j + w, computes their
  scores and softmax, publishes P (bf16) with its row maxima and fp32 row sums, and
  accumulates its half of d_v ([64, 256] fp32) over *both* tiles of the pair, rescaling the
  other's P to its own running max. One's softmax runs while the other's matmuls do.

FP8 cache: the producer stages tile i + 1's raw rows by ``cp.async`` while it dequantises tile
i into its ring buffer (exact, to bf16), so the consumers run the bf16 code; the staging takes
one ring buffer. At large batch the lazy rescale (``LAZY_SS``) moves the held max only once a
head's scores exceed it by 2^8. Split-KV partials go to lesson 2's :func:`combine_splits` (a
programmatic dependent launch). Gluon constexprs do not reach the partitions: they read
BLOCK_N and the ring depth off their buffers' shapes.

Scope: bf16/fp16 q and cache or bf16 q and the FP8 cache; 64 heads, D = d_v = 512; sm_90 with
Triton 3.6 (dispatch.py). Explained in notebooks/02_mma_attention.ipynb.
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy, fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait)

from dsv4lab.kernels.attention import l2_hint
from dsv4lab.kernels.attention.mma import SplitLaunches, combine_plan
from dsv4lab.kernels.device import pdl_ok, props
from dsv4lab.kernels.launch import Launch
from dsv4lab.kernels.gluon_compat import async_load, cta_barrier, gdc_launch_dependents

HEADS = gl.constexpr(64)
DIM = gl.constexpr(512)
HALF = gl.constexpr(256)        # the columns of d_v one consumer owns
LAZY_SLACK = gl.constexpr(8.0)  # the lazy rescale's slack on the running max (base 2)
BLOCK_N = 32                    # rows a tile
FP8_ROW_BYTES = 584             # an FP8 cache row: 448 e4m3, 64 bf16 RoPE, 8 scale bytes
FP8_ROW = gl.constexpr(FP8_ROW_BYTES)
FP8_STAGES = gl.constexpr(2)    # staging slots of raw FP8 rows (the tile converting, the next)
STORE_SCRATCH = 3856            # the output store's layout conversion (sm_90, Triton 3.6)


@gluon.jit
def _trim_end(idx_row, start, end, SCAN_N: gl.constexpr, num_warps: gl.constexpr):
    """Lesson 1's ``trim_tail``: one past the last valid slot of ``idx_row[start:end]``."""
    layout: gl.constexpr = gl.BlockedLayout([SCAN_N // (32 * num_warps)], [32], [num_warps], [0])
    last = start - 1
    hi = end
    while (hi > start) & (last < start):
        offs = hi - SCAN_N + gl.arange(0, SCAN_N, layout=layout)
        ic = gl.load(idx_row + offs, mask=(offs >= start) & (offs < hi), other=-1)
        last = gl.maximum(last, gl.max(gl.where(ic >= 0, offs, start - 1), axis=0))
        hi -= SCAN_N
    return last + 1


# ---- the epilogue: this consumer's half of each output row ---------------------------------

@triton.constexpr_function
def _row_store_layout():
    """[64, 256], 8 consecutive columns a thread; warp w holds accumulator rows 16w..16w+15."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0], [0, 32], [0, 64], [0, 128]],
        lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[HEADS, HALF])


@gluon.jit
def _store_rows(ptr, rows, v, W: gl.constexpr):
    """Store consumer W's half of the 16-bit rows ``rows``, 16 bytes a thread (from the
    accumulator's layout a warp would write half of each 32-byte sector)."""
    st: gl.constexpr = _row_store_layout()
    v = gl.convert_layout(v, st)
    r = gl.convert_layout(rows, gl.SliceLayout(1, st))
    c = W * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, st))
    gl.store(ptr + r[:, None] * DIM + c[None, :], v)


@gluon.jit
def _epilogue(acc, m_i, l_i, sink_ptr, out_ptr, lse_ptr, opart_ptr, lpart_ptr, prow, orow,
              has_sink, split, W: gl.constexpr):
    """This consumer's half of each output row with the sink, or (``split``) of the partial."""
    o_layout: gl.constexpr = acc.type.layout
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    m_o = gl.convert_layout(m_i, gl.SliceLayout(1, o_layout))
    h = gl.arange(0, HEADS, layout=gl.SliceLayout(1, o_layout))
    has = l_o > 0
    o = acc / gl.where(has, l_o, 1.0)[:, None]
    lse2 = gl.where(has, m_o + gl.log2(gl.where(has, l_o, 1.0)), float("-inf"))
    if split == 0:
        if has_sink:
            sk = gl.load(sink_ptr + h).to(gl.float32) * 1.4426950408889634
            m_f = gl.maximum(lse2, sk)
            a = gl.exp2(lse2 - m_f)
            denom = a + gl.exp2(sk - m_f)
            o = o * (a / denom)[:, None]
            lse = (m_f + gl.log2(denom)) * 0.6931471805599453
        else:
            lse = lse2 * 0.6931471805599453
        _store_rows(out_ptr, orow + h, o.to(out_ptr.dtype.element_ty), W)
        if W == 0:
            gl.store(lse_ptr + orow + h, lse)
    else:
        _store_rows(opart_ptr, prow + h, o.to(opart_ptr.dtype.element_ty), W)
        if W == 0:
            gl.store(lpart_ptr + prow + h, lse2)


# ---- the producer: Q once, then the ring of KV tiles ---------------------------------------

@gluon.jit
def _load_q(q_row, q_smem, q_bar):
    """The query rows [64, 512] into shared memory by cp.async, signalled on ``q_bar``."""
    gather: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    cols = gl.arange(0, DIM, layout=gl.SliceLayout(0, gather))
    h = gl.arange(0, HEADS, layout=gl.SliceLayout(1, gather))
    async_load(q_smem, q_row + h[:, None] * DIM + cols[None, :])
    async_copy.mbarrier_arrive(q_bar)
    mbarrier.arrive(q_bar, count=1)


@gluon.jit
def _slots(idx_row, start, end, tile, BLOCK_N: gl.constexpr, layout: gl.constexpr):
    """Tile ``tile``'s cache rows (-1 past ``end``) in ``layout``."""
    offs = start + tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=layout)
    return gl.load(idx_row + offs, mask=offs < end, other=-1)


@gluon.jit
def _tile_count(start, end, BLOCK_N: gl.constexpr):
    """Tiles of the range, in whole pairs (a last odd tile's twin is all -1)."""
    return 2 * gl.cdiv(gl.cdiv(end - start, BLOCK_N), 2)


@gluon.jit
def _producer(q_row, kv_ptr, idx_row, start, end, q_smem, kv_smem, p_smem, m_smem, bars, qk_scale,
              sink_ptr, out_ptr, lse_ptr, opart_ptr, lpart_ptr, prow, orow, has_sink, split):
    """4 warps: Q once, then the KV ring (a buffer refilled once both consumers released it)."""
    q_bar, kv_ready, kv_empty, p_ready, p_free = bars
    NUM_BUF: gl.constexpr = kv_smem.type.shape[0]
    BLOCK_N: gl.constexpr = kv_smem.type.shape[1]
    gather: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    rows_l: gl.constexpr = gl.SliceLayout(1, gather)
    cols = gl.arange(0, DIM, layout=gl.SliceLayout(0, gather))
    _load_q(q_row, q_smem, q_bar)

    n_tiles = _tile_count(start, end, BLOCK_N)
    idx = _slots(idx_row, start, end, 0, BLOCK_N, rows_l)
    for i in range(n_tiles):
        buf = i % NUM_BUF
        valid = idx >= 0
        ptrs = kv_ptr + gl.where(valid, idx, 0).to(gl.int64)[:, None] * DIM + cols[None, :]
        idx = _slots(idx_row, start, end, i + 1, BLOCK_N, rows_l)     # tile i + 1's slots
        mbarrier.wait(kv_empty.index(buf), ((i // NUM_BUF) & 1) ^ 1)
        # masked rows are zero-filled: P = 0 there, and 0 * V stays 0
        async_load(kv_smem.index(buf), ptrs, mask=valid[:, None])
        async_copy.mbarrier_arrive(kv_ready.index(buf))
        mbarrier.arrive(kv_ready.index(buf), count=1)


@gluon.jit
def _stage_fp8(kv_ptr, idx, c, nope_stage, rope_stage, slot):
    """Start the cp.async of FP8 rows ``idx`` (-1: zero-filled) into staging slot ``slot``:
    seven e4m3 groups and the bf16 RoPE part, committed as one group."""
    valid = idx >= 0
    row = gl.where(valid, idx, 0).to(gl.int64)[:, None]
    m = valid[:, None]
    for j in gl.static_range(7):
        async_load(nope_stage.index(7 * slot + j), kv_ptr + row * FP8_ROW + 64 * j + c[None, :],
                   mask=m)
    rope_ptr = kv_ptr.to(gl.pointer_type(rope_stage.dtype))
    async_load(rope_stage.index(slot), rope_ptr + row * (FP8_ROW // 2) + 224 + c[None, :], mask=m)
    async_copy.commit_group()


@gluon.jit
def _scale_words(kv_ptr, idx):
    """Each FP8 row's scale bytes 576..583 as one int64 (byte j: group j's); 0 for slot -1."""
    valid = idx >= 0
    words = kv_ptr.to(gl.pointer_type(gl.int64))
    return gl.load(words + gl.where(valid, idx, 0).to(gl.int64) * (FP8_ROW // 8) + 72, mask=valid,
                   other=0)


@gluon.jit
def _store_group(tile, raw, sw, j: gl.constexpr):
    """Group j of a ring tile from e4m3 ``raw`` [BLOCK_N, 64] and scale words ``sw`` (exact)."""
    scale = (((sw >> (8 * j)) & 0xFF) << 23).to(gl.int32).to(gl.float32, bitcast=True)
    val = raw.to(gl.float8e4nv, bitcast=True).to(gl.float32) * scale[:, None]
    tile.slice(64 * j, 64, dim=1).store(val.to(tile.dtype))


@gluon.jit
def _publish(tile_ready):
    """Fence the producer's stores for the consumers' wgmma, then signal the tile."""
    fence_async_shared()
    cta_barrier()
    mbarrier.arrive(tile_ready, count=1)


@gluon.jit
def _producer_fp8(q_row, kv_ptr, idx_row, start, end, q_smem, kv_smem, p_smem, m_smem, bars,
                  qk_scale, sink_ptr, out_ptr, lse_ptr, opart_ptr, lpart_ptr, prow, orow,
                  has_sink, split, nope_stage, rope_stage):
    """4 warps, the FP8 cache: tile i + 1 staged by cp.async while tile i is dequantised into
    its ring buffer; indices are loaded two tiles ahead, so no copy waits for its addresses."""
    q_bar, kv_ready, kv_empty, p_ready, p_free = bars
    NUM_BUF: gl.constexpr = kv_smem.type.shape[0]
    BLOCK_N: gl.constexpr = kv_smem.type.shape[1]
    STAGES: gl.constexpr = rope_stage.type.shape[0]
    chunk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows_l: gl.constexpr = gl.SliceLayout(1, chunk)
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, chunk))
    _load_q(q_row, q_smem, q_bar)

    n_tiles = _tile_count(start, end, BLOCK_N)
    idx = _slots(idx_row, start, end, 0, BLOCK_N, rows_l)
    _stage_fp8(kv_ptr, idx, c, nope_stage, rope_stage, 0)
    sw = _scale_words(kv_ptr, idx)
    idx = _slots(idx_row, start, end, 1, BLOCK_N, rows_l)
    for i in range(n_tiles):
        _stage_fp8(kv_ptr, idx, c, nope_stage, rope_stage, (i + 1) % STAGES)    # tile i + 1
        sw_next = _scale_words(kv_ptr, idx)
        idx = _slots(idx_row, start, end, i + 2, BLOCK_N, rows_l)                # tile i + 2
        async_copy.wait_group(1)                  # tile i's group (tile i + 1's may fly)
        cta_barrier()                             # every thread's copies, not just its own
        slot = i % STAGES
        buf = i % NUM_BUF
        mbarrier.wait(kv_empty.index(buf), ((i // NUM_BUF) & 1) ^ 1)
        tile = kv_smem.index(buf)
        for j in gl.static_range(7):
            _store_group(tile, nope_stage.index(7 * slot + j).load(chunk), sw, j)
        tile.slice(448, 64, dim=1).store(rope_stage.index(slot).load(chunk))
        _publish(kv_ready.index(buf))             # (its barrier also frees the slot)
        sw = sw_next
    async_copy.wait_group(0)                      # the last (all -1) group, before exit


# ---- the seesaw consumers ------------------------------------------------------------------

@triton.constexpr_function
def _wgmma_layout(n):
    """A consumer's wgmma accumulator layout for [64, n] (scores: BLOCK_N; output: 256)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.jit
def _max_grew(m_i, m_seen):
    """Whether some head's ``m_seen`` exceeds its held max by LAZY_SLACK (one group branch)."""
    return gl.max(gl.where(m_seen > m_i + LAZY_SLACK, 1, 0), axis=0) > 0


@gluon.jit
def _next_max(m_i, m_seen, LAZY: gl.constexpr):
    """(next running max, whether it moved: acc to rescale). LAZY: only on :func:`_max_grew`;
    P then stays <= 2^8 (a peer's, rescaled, <= 2^16), far inside bf16 and fp32."""
    if LAZY:
        grow = _max_grew(m_i, m_seen)
        return gl.where(grow, gl.maximum(m_i, m_seen), m_i), grow
    else:
        return gl.maximum(m_i, m_seen), True


@gluon.jit
def _consumer(q_row, kv_ptr, idx_row, start, end, q_smem, kv_smem, p_smem, m_smem, bars,
              qk_scale, sink_ptr, out_ptr, lse_ptr, opart_ptr, lpart_ptr, prow, orow, has_sink,
              split, W: gl.constexpr):
    """Consumer W: tiles 2j + W's softmax published; its half of d_v over both of a pair."""
    q_bar, kv_ready, kv_empty, p_ready, p_free = bars
    NUM_BUF: gl.constexpr = kv_smem.type.shape[0]
    BLOCK_N: gl.constexpr = kv_smem.type.shape[1]
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = _wgmma_layout(HALF)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_l: gl.constexpr = gl.SliceLayout(0, s_layout)
    orow_l: gl.constexpr = gl.SliceLayout(1, o_layout)
    LAZY: gl.constexpr = m_smem.type.shape[0] > 8       # the kernel's LAZY_SS (see there)

    m_i = gl.full([HEADS], float("-inf"), gl.float32, layout=row_l)
    l_i = gl.zeros([HEADS], gl.float32, layout=row_l)
    acc = gl.zeros([HEADS, HALF], gl.float32, layout=o_layout)
    s0 = gl.zeros([HEADS, BLOCK_N], gl.float32, layout=s_layout)
    mbarrier.wait(q_bar, 0)

    n_pairs = gl.cdiv(gl.cdiv(end - start, BLOCK_N), 2)
    for j in range(n_pairs):
        par = j % 2
        t = 2 * j + W
        buf = t % NUM_BUF
        valid = _slots(idx_row, start, end, t, BLOCK_N, col_l) >= 0
        mbarrier.wait(kv_ready.index(buf), (t // NUM_BUF) & 1)
        kv = kv_smem.index(buf)
        s = warpgroup_mma(q_smem, kv.permute([1, 0]), s0, use_acc=False)
        s = gl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new, grow = _next_max(m_i, gl.max(s, axis=1), LAZY)
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p32 = gl.exp2(s - m_safe[:, None])
        rsum = gl.sum(p32, axis=1)
        p = p32.to(kv_smem.dtype)
        l_i = l_i * alpha + rsum
        m_i = m_new
        if grow:
            acc = acc * gl.convert_layout(alpha, orow_l)[:, None]
        # publish P, its max and its fp32 row sums (not the rounded P's); two buffers a side
        mine = W * 2 + par
        mbarrier.wait(p_free.index(mine), ((j // 2) & 1) ^ 1)
        p_smem.index(mine).store(p)
        m_smem.index(mine).store(m_i)
        m_smem.index(4 + mine).store(rsum)
        cta_barrier()
        mbarrier.arrive(p_ready.index(mine), count=1)
        acc = warpgroup_mma(gl.convert_layout(p, p_layout), kv.slice(W * HALF, HALF, dim=1), acc,
                            is_async=True)
        # the other consumer's tile of the pair, rescaled to this consumer's running max
        theirs = (1 - W) * 2 + par
        t2 = 2 * j + 1 - W
        buf2 = t2 % NUM_BUF
        mbarrier.wait(p_ready.index(theirs), (j // 2) & 1)
        p_o = p_smem.index(theirs).load(s_layout).to(gl.float32)
        m_o = m_smem.index(theirs).load(row_l)
        rsum_o = m_smem.index(4 + theirs).load(row_l)
        cta_barrier()
        mbarrier.arrive(p_free.index(theirs), count=1)
        m_new, grow = _next_max(m_i, m_o, LAZY)
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        beta = gl.exp2(m_o - m_safe)
        p2 = p_o * beta[:, None]
        l_i = l_i * alpha + rsum_o * beta
        m_i = m_new
        acc = warpgroup_mma_wait(0, deps=[acc])
        if grow:
            acc = acc * gl.convert_layout(alpha, orow_l)[:, None]
        mbarrier.wait(kv_ready.index(buf2), (t2 // NUM_BUF) & 1)
        acc = warpgroup_mma(gl.convert_layout(p2.to(kv_smem.dtype), p_layout),
                            kv_smem.index(buf2).slice(W * HALF, HALF, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        mbarrier.arrive(kv_empty.index(buf), count=1)        # both tiles: both consumers
        mbarrier.arrive(kv_empty.index(buf2), count=1)       # read each (count 2)
    _epilogue(acc, m_i, l_i, sink_ptr, out_ptr, lse_ptr, opart_ptr, lpart_ptr, prow, orow,
              has_sink, split, W)


@gluon.jit
def _consumer0(q_row, kv_ptr, idx_row, start, end, q_smem, kv_smem, p_smem, m_smem, bars, qk_scale,
               sink_ptr, out_ptr, lse_ptr, opart_ptr, lpart_ptr, prow, orow, has_sink, split):
    _consumer(q_row, kv_ptr, idx_row, start, end, q_smem, kv_smem, p_smem, m_smem, bars, qk_scale,
              sink_ptr, out_ptr, lse_ptr, opart_ptr, lpart_ptr, prow, orow, has_sink, split, 0)


@gluon.jit
def _consumer1(q_row, kv_ptr, idx_row, start, end, q_smem, kv_smem, p_smem, m_smem, bars, qk_scale,
               sink_ptr, out_ptr, lse_ptr, opart_ptr, lpart_ptr, prow, orow, has_sink, split):
    _consumer(q_row, kv_ptr, idx_row, start, end, q_smem, kv_smem, p_smem, m_smem, bars, qk_scale,
              sink_ptr, out_ptr, lse_ptr, opart_ptr, lpart_ptr, prow, orow, has_sink, split, 1)


@gluon.jit
def _sparse_mla_ws_kernel(q_ptr, kv_ptr, idx_ptr, sink_ptr, out_ptr, lse_ptr, opart_ptr,
                          lpart_ptr, topk, num_splits, split_rows, qk_scale,
                          BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr, HAS_SINK: gl.constexpr,
                          SPLIT: gl.constexpr, SCAN_N: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                          CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr,
                          FP8: gl.constexpr = False, PDL: gl.constexpr = False,
                          LAZY_SS: gl.constexpr = False, EVICT_KV: gl.constexpr = False):
    # program -> (query position, split)
    pid = gl.program_id(0)
    if EVICT_KV:    # the KV gathers' cp.async under an L2 evict-first policy
        l2_hint.mark(num_warps)
    if PDL:     # the combine (a programmatic dependent launch) may be scheduled now
        gdc_launch_dependents(num_warps)
    sp = pid % num_splits
    bs = (pid // num_splits).to(gl.int64)
    start = sp * split_rows
    end = gl.minimum(start + split_rows, topk)
    idx_row = idx_ptr + bs * topk
    end = _trim_end(idx_row, start, end, SCAN_N, num_warps)
    q_row = q_ptr + bs * (HEADS * DIM)

    dtype: gl.constexpr = q_ptr.dtype.element_ty
    q_smem = gl.allocate_shared_memory(dtype, [HEADS, DIM],
                                       gl.NVMMASharedLayout.get_default_for([HEADS, DIM], dtype))
    kv_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_N, DIM],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_N, DIM], dtype))
    # the P exchange, swizzled: an 8 x 8 stmatrix / ldmatrix block's rows in distinct banks
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEADS, BLOCK_N], dtype)
    p_smem = gl.allocate_shared_memory(dtype, [4, HEADS, BLOCK_N], p_layout)
    # each P buffer's row maxima [0:4] and sums [4:8]; a ninth row tells consumers LAZY_SS
    m_smem = gl.allocate_shared_memory(gl.float32, [8 + LAZY_SS, HEADS],
                                       gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    p_free = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for b in gl.static_range(NUM_BUF):
        mbarrier.init(kv_ready.index(b), count=1)
        mbarrier.init(kv_empty.index(b), count=2)          # released by both consumers
    for b in gl.static_range(4):
        mbarrier.init(p_ready.index(b), count=1)
        mbarrier.init(p_free.index(b), count=1)

    prow = (bs * num_splits + sp) * HEADS
    orow = bs * HEADS
    args = (q_row, kv_ptr, idx_row, start, end, q_smem, kv_smem, p_smem, m_smem,
            (q_bar, kv_ready, kv_empty, p_ready, p_free), qk_scale, sink_ptr, out_ptr, lse_ptr,
            opart_ptr, lpart_ptr, prow, orow, HAS_SINK, SPLIT)
    # the producer is the default partition (the kernel's 4 warps); the consumers are workers
    if FP8:         # raw rows staged by cp.async, dequantised by the producer into the ring
        stage_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        nope_stage = gl.allocate_shared_memory(gl.uint8, [7 * FP8_STAGES, BLOCK_N, 64], stage_l)
        rope_stage = gl.allocate_shared_memory(dtype, [FP8_STAGES, BLOCK_N, 64], stage_l)
        gl.warp_specialize([(_producer_fp8, args + (nope_stage, rope_stage)),
                            (_consumer0, args), (_consumer1, args)],
                           [4, 4], [CONSUMER_REGS, CONSUMER_REGS])
    else:
        gl.warp_specialize([(_producer, args), (_consumer0, args), (_consumer1, args)],
                           [4, 4], [CONSUMER_REGS, CONSUMER_REGS])


def ring_buffers(fp8: bool) -> int:
    """Ring buffers of 32-row tiles: four for bf16, three beside the FP8 staging."""
    return 3 if fp8 else 4


def smem_bytes(fp8: bool, lazy: bool = False) -> int:
    """Shared memory of a launch: Q, ring, P exchange and its rows, FP8 staging, store scratch."""
    staging = 2 * BLOCK_N * (7 * 64 + 64 * 2) if fp8 else 0
    return (64 * 512 * 2 + ring_buffers(fp8) * BLOCK_N * 512 * 2 + 4 * 64 * BLOCK_N * 2
            + (8 + int(lazy)) * 64 * 4 + staging + STORE_SCRATCH)


def kernel_constexprs(*, fp8, split, has_sink, pdl, lazy, evict) -> dict:
    """Constexprs and launch options of one :func:`sparse_mla_ws` launch (as compiled offline)."""
    return dict(BLOCK_N=BLOCK_N, NUM_BUF=ring_buffers(fp8), HAS_SINK=has_sink, SPLIT=int(split),
                SCAN_N=512, PRODUCER_REGS=40, CONSUMER_REGS=232, FP8=fp8, num_warps=4,
                maxnreg=168, PDL=pdl, LAZY_SS=lazy, EVICT_KV=evict)


class WsLaunches(SplitLaunches):
    """The launches of :func:`sparse_mla_ws` (and lesson 2's combine) for one shape, made once."""

    def __init__(self, device, B, S_q, q_dtype, topk, *, fp8, splits, split_rows, has_sink,
                 lazy, evict_kv):
        split = splits > 1
        consts = kernel_constexprs(fp8=fp8, split=split, has_sink=has_sink,
                                   pdl=split and pdl_ok(device), lazy=bool(lazy),
                                   evict=bool(evict_kv) and l2_hint.active())
        maxnreg = consts.pop("maxnreg")
        self.main = Launch(_sparse_mla_ws_kernel, (B * S_q * splits,),
                           dict(consts, topk=topk, num_splits=splits, split_rows=split_rows),
                           device=device, maxnreg=maxnreg, guard=(0, 1, 2, 3),
                           jit_context=l2_hint.rewriting if consts["EVICT_KV"] else None)
        self.combine = combine_plan(device, B, S_q, 64, 512, splits, has_sink=has_sink,
                                    pdl=consts["PDL"], sm_count=props(device).sm_count) \
            if split else None
        self.out_shape, self.lse_shape = (B, S_q, 64, 512), (B, S_q, 64)
        self.partials = ("mla partials", B * S_q * splits * 64 * 512, q_dtype,
                         B * S_q * splits * 64)


_LAUNCHES: dict = {}


def ws_launches(device, B, S_q, q_dtype, topk, *, fp8, splits, split_rows, has_sink, lazy,
                evict_kv) -> WsLaunches:
    """:class:`WsLaunches` of these arguments, made once."""
    key = (device, B, S_q, q_dtype, topk, fp8, splits, split_rows, has_sink, lazy, evict_kv)
    launches = _LAUNCHES.get(key)
    if launches is None:
        launches = _LAUNCHES[key] = WsLaunches(device, B, S_q, q_dtype, topk, fp8=fp8,
                                               splits=splits, split_rows=split_rows,
                                               has_sink=has_sink, lazy=lazy, evict_kv=evict_kv)
    return launches


def sparse_mla_ws(q, kv, indices, sink, scale, splits, split_rows, *, lazy=False, evict_kv=False):
    """Launch the kernel (and the combine when split); arguments as ``mma.sparse_mla_mma``'s
    at 64 heads x 512, ``splits`` / ``split_rows`` as ``mma.plan_splits`` plans them."""
    B, S_q, H, D = q.shape
    return ws_launches(q.device, B, S_q, q.dtype, indices.shape[-1], fp8=kv.dtype == torch.uint8,
                       splits=splits, split_rows=split_rows, has_sink=sink is not None,
                       lazy=bool(lazy), evict_kv=bool(evict_kv))(q, kv, indices, sink, scale)
