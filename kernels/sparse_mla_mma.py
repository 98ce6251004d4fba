"""Sparse MLA decode on the tensor cores: heads share each gathered KV tile.

All H query heads of one query position attend to the *same* selected latent rows (MQA).
So instead of one program per head (kernels/sparse_mla_simt.py), one program takes a
block of ``BLOCK_H`` heads (64 for DeepSeek-V4) and stacks them as the M side of
``tl.dot``:

    S   [BLOCK_H, BLOCK_N] = Q [BLOCK_H, D] @ K^T [D, BLOCK_N]       (scores, fp32)
    acc [BLOCK_H, d_v]    += P [BLOCK_H, BLOCK_N] @ V [BLOCK_N, d_v]   (V = K[:, :d_v])

Each tile of ``BLOCK_N`` selected rows is gathered from memory once (a bf16 row of 512
values is 1 KB, so row gathers coalesce) and used by every head in the block: the bytes
drop 64x against the SIMT kernel and the math moves to the tensor cores. The softmax is
online (running max and sum per head, fp32, base 2). The query positions of a step
(S_q = 1..4: MTP/EAGLE verify) are just more rows of the grid; nothing assumes one.

Split-KV. With B x S_q small (decode at batch 1) there are too few programs to fill the
GPU, so the ``topk`` slots are cut into ``num_splits`` ranges, each program writes an
un-merged partial (its normalised output and its log-sum-exp), and
``_combine_kernel`` merges them (and adds the attention sink).

FP8 KV. With the 584-byte cache (dsv4lab/quant/kv_fp8.py) the tile is dequantised in
registers. On sm_89 and newer (``FP8_HW``) the e4m3 bytes are bitcast to
``tl.float8e4nv`` and converted by the hardware, then multiplied by the per-64
power-of-two scale (built from its exponent byte by a shift, exact) in bf16. The portable
path (sm_80) moves the bits instead: sign to bit 15, exponent+mantissa to bits 7..13 of an
fp16, which is the e4m3 value times 2^-8 for normals and subnormals alike. The 64 RoPE
values are read as bf16. Fewer bytes per row, same math.

Empty slots. A -1 slot adds nothing; each program first finds its range's last valid
slot (``_trim_tail``, one 512-slot load for a dense list) and stops there, so the
ratio-128 layers' max-context lists, mostly a -1 tail, cost only their valid tiles. (A
branch around the loop body would do it too, but Triton then stops pipelining the gathers.)

Prefetch (``PREFETCH``, a variant). In the default loop the row gather's addresses come
from the index load of the same iteration. Triton's pipeliner (3.6 and 3.9 alike) then
splits its ``num_stages - 1`` stages of lead between the two loads ((stages - 1) // 2
each), so at 2-4 stages the gather gets one: it is a cp.async, but issued at the end of
tile i-1 and waited for (``async_wait`` num 0, which also drains the next indices) at the
top of tile i, so each tile waits for its rows. With ``PREFETCH`` the loop carries the next tile's indices and raw rows (bf16
tile, or e4m3 bytes + scale bytes + RoPE) in registers: tile i+1's loads are issued before
tile i's dequant, MMAs and softmax, and the dequantised tile feeds both MMAs.
``PIPE_GATHER`` (a variant) lets the pipeliner do it: the loop carries the next tile's
indices (a register load one tile ahead), so the gather depends on no load of its own
iteration and gets all ``num_stages - 1`` stages: at 3 stages a cp.async into 3 shared
buffers with one tile in flight behind the MMAs (``async_wait`` num 1), at 4 stages two.

FP8 fast path (``FP8_HW == 2``, ``Config.fp8_fast``, a variant). Compiled for sm_90 with
the JIT's 16-byte pointer alignment, the FP8 gathers are 8-byte cp.async (rows are
584 = 8 x 73 bytes apart), but the seven one-byte scale loads a row are too narrow for a
cp.async and stay synchronous inside the loop, right after the wait for the tile's bytes:
every tile pays one more full memory latency than the bf16 loop. The fast path reads the
scale bytes 576..583 as one 8-byte word a row (a cp.async with the rest; byte j is group
j's scale) and dequantises in fp32 (hardware e4m3x2 -> f16x2, to fp32, times the
power-of-two scale, one rounding to the MMA dtype: exact up to that rounding), which also
drops the scalar bf16 multiplies and their repacking.

Transposed scores (``KQ_T``, a variant; bf16/fp16 KV). Triton lays out a dot whose result
feeds another dot with all warps along M; at M = 64 heads and 8 warps both warp groups
compute the same 64 x BLOCK_N scores. ``KQ_T`` computes S^T = K Q^T [BLOCK_N, heads] at
BLOCK_N = 128 instead, so each warp group owns 64 tile rows, and transposes P back for
the P V dot.

Scores split between the warp groups (``SPLIT_QK``, a variant; bf16 and FP8). The same
duplication in the plain loop, without transposing: Triton picks all warps along M only
for a dot whose result reaches another dot, and finds that dot by following the uses of
the result. With the softmax written in both arms of an always-taken branch (``n0 <
end``), the uses stop at the branch's yield, so the scores' dot gets warps [4, 2]: each
warp group computes half of the tile's columns (the row max and sum then cross the warp
groups through shared memory, and P goes through shared memory to the P V dot, whose
warp groups each own half of d_v as before). Both arms are the same code, so the result
does not depend on the branch.

Online softmax, lazily (``LAZY``). Rescaling the [heads, d_v] fp32 accumulator costs as
many multiplies per tile as the tile has outputs; with ``LAZY`` the running max only moves
(and the accumulator is only rescaled) when some head's max grew by more than 2^8, so
p <= 256 and most tiles skip the rescale.

Launch configurations (``Config``: BLOCK_N, warps, stages, head block, LAZY, splits) come
from a per-device table of measured winners per workload class (``DEVICE_TABLE``, written
from the output of scripts/tune_sparse_mla.py); otherwise the first call for a workload
bucket times a few candidates and caches the winner (``_TUNED``), outside CUDA-graph
capture. In Triton's interpreter bf16 operands are upcast to fp32 before ``tl.dot`` (the
interpreter's bf16 dot, and bf16 multiply, are wrong).
"""
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from dsv4lab.kernels import l2_hint
from dsv4lab.kernels.device import gluon_unsupported, interpreting, pdl_ok, sm_count

LOG2E = 1.4426950408889634
FP8_ROW_BYTES = 584      # 448 e4m3 + 64 bf16 + 7 ue8m0 scales + 1 pad
FP8_DIM = 512
RESCALE_SLACK = tl.constexpr(8.0)   # LAZY: move the running max once 2^8 stale (p <= 256)


@triton.jit
def _gather_kv_raw(kv_ptr, rows, valid, offs_d, D: tl.constexpr, BLOCK_D: tl.constexpr,
                   FP8: tl.constexpr, KDTYPE: tl.constexpr, FP8_WORD: tl.constexpr = False):
    """Issue the loads of the latent rows ``rows`` ([BLOCK_N], int64): the bf16 tile, or
    the FP8 cache's raw parts (e4m3 bytes [N, 8, 64], scale bytes [N, 8, 1], bf16 RoPE
    [N, 1, 64]). Split from :func:`_dequant_kv` so ``PREFETCH`` can issue tile i+1's loads
    before tile i's math (a load only stalls where its registers are first read)."""
    if FP8:
        # view the 512 values as 8 groups of 64: groups 0..6 are e4m3 (scale per group),
        # group 7 is the bf16 RoPE part
        j = tl.arange(0, 8)[None, :, None]
        c = tl.arange(0, 64)[None, None, :]
        base = rows[:, None, None] * 584
        v3 = valid[:, None, None]
        nope = v3 & (j < 7)
        b = tl.load(kv_ptr + base + j * 64 + c, mask=nope, other=0)           # [N, 8, 64]
        if FP8_WORD:
            # the 8 scale bytes (576..583) as one 8-byte word a row: the row base 584 r is
            # 8-byte aligned, so this is one 8-byte load (a cp.async the pipeliner can
            # multi-buffer) where 7 one-byte loads stay synchronous inside the loop
            w_ptr = kv_ptr.to(tl.pointer_type(tl.int64))
            sb = tl.load(w_ptr + rows[:, None, None] * 73 + 72, mask=v3,
                         other=0x7F7F7F7F7F7F7F7F)                           # [N, 1, 1]
        else:
            sb = tl.load(kv_ptr + base + 576 + j, mask=nope, other=127)       # [N, 8, 1]
        rope_ptr = kv_ptr.to(tl.pointer_type(tl.bfloat16))
        rope = tl.load(rope_ptr + rows[:, None, None] * 292 + 224 + c, mask=v3, other=0.0)
        return b, sb, rope
    else:
        if BLOCK_D == D:       # no column mask: keeps the row gathers 16-byte vectorised
            k = tl.load(kv_ptr + rows[:, None] * D + offs_d[None, :],
                        mask=valid[:, None], other=0.0).to(KDTYPE)
        else:
            k = tl.load(kv_ptr + rows[:, None] * D + offs_d[None, :],
                        mask=valid[:, None] & (offs_d[None, :] < D), other=0.0).to(KDTYPE)
        return k, k, k


@triton.jit
def _dequant_kv(b, sb, rope, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
                FP8_HW: tl.constexpr, BF16_MATH: tl.constexpr, KDTYPE: tl.constexpr):
    """The [BLOCK_N, BLOCK_D] K tile from :func:`_gather_kv_raw`'s parts (bf16: as is)."""
    if FP8:
        j = tl.arange(0, 8)[None, :, None]
        if FP8_HW == 2:
            # FP8_WORD scales (one int64 a row, little-endian: byte j = group j's scale);
            # dequantise in fp32 (exact: e4m3 and 2^(s-127) are fp32 values, so is their
            # product) and round once to the MMA dtype: no scalar bf16 multiply and repacking
            sbi = ((sb >> (j * 8).to(tl.int64)) & 0xFF).to(tl.int32)            # [N, 8, 1]
            x = b.to(tl.float8e4nv, bitcast=True)
            sc = (sbi << 23).to(tl.float32, bitcast=True)
            val = x.to(tl.float32) * sc
        elif FP8_HW:
            sbi = sb.to(tl.int32) & 0xFF
            # hardware e4m3 conversion; the scale 2^(s-127) is the fp32 with exponent s
            # (s = 0, a block with amax < 2^-118, reads as 0)
            x = b.to(tl.float8e4nv, bitcast=True)
            sc = (sbi << 23).to(tl.float32, bitcast=True)
            if BF16_MATH:
                val = x.to(tl.bfloat16) * sc.to(tl.bfloat16)      # exact: power of two
            else:
                val = x.to(tl.float32) * sc
        else:
            sbi = sb.to(tl.int32) & 0xFF
            # e4m3 -> fp16 by moving bits: sign to bit 15, exponent+mantissa to bits 7..13;
            # the fp16 value is the e4m3 value * 2^-8 (normals and subnormals alike)
            bi = b.to(tl.int32)
            h16 = (((bi & 0x80) << 8) | ((bi & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True)
            val = h16.to(tl.float32) * tl.exp2(sbi.to(tl.float32) - 119.0)   # * 2^8 * 2^(s-127)
        k3 = tl.where(j < 7, val.to(KDTYPE), rope.to(KDTYPE))      # [N, 8, 64]
        k = tl.reshape(k3, [BLOCK_N, BLOCK_D])
    else:
        k = b
    return k


@triton.jit
def _load_kv_tile(kv_ptr, rows, valid, offs_d, D: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr, FP8: tl.constexpr, FP8_HW: tl.constexpr,
                  BF16_MATH: tl.constexpr, KDTYPE: tl.constexpr):
    """Gather the latent rows ``rows`` ([BLOCK_N], int64) as a [BLOCK_N, BLOCK_D] tile."""
    b, sb, rope = _gather_kv_raw(kv_ptr, rows, valid, offs_d, D, BLOCK_D, FP8, KDTYPE,
                                 FP8_HW == 2)
    return _dequant_kv(b, sb, rope, BLOCK_N, BLOCK_D, FP8, FP8_HW, BF16_MATH, KDTYPE)


@triton.jit
def _trim_tail(idx_ptr, start, end, SCAN_N: tl.constexpr):
    """One past the last valid (>= 0) slot of ``idx_ptr[start:end]`` (``start`` if none),
    scanning back from ``end`` ``SCAN_N`` slots at a time. A dense list costs one load;
    a long list that is mostly a tail of -1 (the ratio-128 layers' max-context lists)
    is cut to its valid part, and the main loop never sees the dead tiles."""
    last = tl.zeros([], tl.int32) + (start - 1)
    hi = end
    while (hi > start) & (last < start):
        offs = hi - SCAN_N + tl.arange(0, SCAN_N)
        ic = tl.load(idx_ptr + offs, mask=(offs >= start) & (offs < hi), other=-1)
        last = tl.maximum(last, tl.max(tl.where(ic >= 0, offs, start - 1), axis=0))
        hi -= SCAN_N
    return last + 1


@triton.jit
def _tile_slots(idx_row, n0, end, BLOCK_N: tl.constexpr):
    """Slots n0 .. n0 + BLOCK_N - 1 of one query's index list (-1 from ``end`` on)."""
    offs = n0 + tl.arange(0, BLOCK_N)
    return tl.load(idx_row + offs, mask=offs < end, other=-1)


@triton.jit
def _softmax_step(s, m_i, l_i):
    """Online softmax on one tile of base-2 scores: (new max, new sum, alpha, p)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return m_new, l_i * alpha + tl.sum(p, axis=1), alpha, p


@triton.jit
def _softmax_update(s, m_i, l_i, acc, LAZY: tl.constexpr):
    """The online-softmax update of one tile of base-2 scores, with the accumulator's
    rescale: (m_i, l_i, acc, p). ``LAZY``: the running max only moves (and ``acc`` is only
    rescaled) once some head's max grew by more than RESCALE_SLACK (first tile: always)."""
    m_tile = tl.max(s, axis=1)
    if LAZY:
        grow = tl.max(tl.where(m_tile > m_i + RESCALE_SLACK, 1, 0), axis=0)
        if grow > 0:
            m_new = tl.maximum(m_i, m_tile)
            alpha = tl.exp2(m_i - tl.where(m_new == float("-inf"), 0.0, m_new))
            l_i = l_i * alpha
            acc = acc * alpha[:, None]
            m_i = m_new
        p = tl.exp2(s - tl.where(m_i == float("-inf"), 0.0, m_i)[:, None])
        l_i += tl.sum(p, axis=1)
    else:
        m_new = tl.maximum(m_i, m_tile)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        m_i = m_new
    return m_i, l_i, acc, p


@triton.jit
def _attend_tile(q, k, valid, m_i, l_i, acc, qk_scale, offs_d, DV: tl.constexpr,
                 BLOCK_D: tl.constexpr, LAZY: tl.constexpr, KDTYPE: tl.constexpr,
                 DOT_PREC: tl.constexpr, SPLIT_QK: tl.constexpr = False, live=True):
    """One tile of the online softmax: S = Q K^T, running max/sum, acc += P V with
    V = K[:, :DV] (the same tile feeds both MMAs). Returns (m_i, l_i, acc).

    ``SPLIT_QK`` (``live`` a runtime condition that is always true, e.g. n0 < end): the
    softmax sits in both arms of a branch on ``live``. Triton lays out a dot whose result
    reaches another dot with all warps along M (at M = 64 heads and 8 warps both warp
    groups then compute the same scores); it looks for that dot by following the uses of
    the result, which stop at the branch's yield, so the scores' dot gets warps [4, 2]:
    each warp group computes half the tile's columns (the softmax reductions then cross
    the warp groups through shared memory). Both arms are the same code: the answer does
    not depend on ``live``."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
    s = tl.where(valid[None, :], s, float("-inf"))
    if SPLIT_QK:
        if live:
            m_i, l_i, alpha, p = _softmax_step(s, m_i, l_i)
        else:
            m_i, l_i, alpha, p = _softmax_step(s, m_i, l_i)
        acc = acc * alpha[:, None]
    else:
        m_i, l_i, acc, p = _softmax_update(s, m_i, l_i, acc, LAZY)
    if DV < BLOCK_D:
        v = tl.where(offs_d[None, :] < DV, k, 0.0).to(KDTYPE)
    else:
        v = k
    acc = tl.dot(p.to(KDTYPE), v, acc, input_precision=DOT_PREC)
    return m_i, l_i, acc


@triton.jit
def _attend_tile_t(qt, k, valid, m_i, l_i, acc, qk_scale, offs_d, DV: tl.constexpr,
                   BLOCK_D: tl.constexpr, KDTYPE: tl.constexpr, DOT_PREC: tl.constexpr):
    """:func:`_attend_tile` with the scores transposed (``KQ_T``): S^T [BLOCK_N, heads] =
    K Q^T puts the tile's rows on the MMA's M side. Triton gives a dot whose result feeds
    another dot all warps along M; with M = 64 heads and 8 warps both warp groups then
    compute the same 64 x BLOCK_N scores (the sm_90 TTGIR of the plain loop: warpsPerCTA
    [8, 1], a duplicated QK^T). With M = BLOCK_N = 128 each warp group has its own 64
    rows. P^T is transposed back for acc += P V."""
    s = tl.dot(k, qt, input_precision=DOT_PREC) * qk_scale                 # [N, H]
    s = tl.where(valid[:, None], s, float("-inf"))
    m_tile = tl.max(s, axis=0)
    m_new = tl.maximum(m_i, m_tile)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[None, :])
    l_i = l_i * alpha + tl.sum(p, axis=0)
    acc = acc * alpha[:, None]
    if DV < BLOCK_D:
        v = tl.where(offs_d[None, :] < DV, k, 0.0).to(KDTYPE)
    else:
        v = k
    acc = tl.dot(tl.trans(p.to(KDTYPE)), v, acc, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _sparse_mla_mma_kernel(
    q_ptr, kv_ptr, idx_ptr, sink_ptr, out_ptr, lse_ptr, opart_ptr, lpart_ptr,
    H, topk, n_hblk, num_splits, split_rows, qk_scale,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, V_FROM_K: tl.constexpr,
    FP8: tl.constexpr, FP8_HW: tl.constexpr, BF16_MATH: tl.constexpr, LAZY: tl.constexpr,
    HAS_SINK: tl.constexpr, SPLIT: tl.constexpr, KDTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
    SCAN_N: tl.constexpr, PREFETCH: tl.constexpr = False, PIPE_GATHER: tl.constexpr = False,
    KQ_T: tl.constexpr = False, SPLIT_QK: tl.constexpr = False, PDL: tl.constexpr = False,
    EVICT_KV: tl.constexpr = False,
):
    if PDL:     # the combine (a programmatic dependent launch) may be scheduled now
        gdc_launch_dependents()
    if EVICT_KV:    # the row gathers' cp.async under an L2 evict-first policy (l2_hint)
        l2_hint.mark_tl()
    # program -> (head block, split, query position); head blocks of one query are
    # neighbours so they gather the same rows at about the same time (L2 hits)
    pid = tl.program_id(0)
    hb = pid % n_hblk
    rest = pid // n_hblk
    sp = rest % num_splits
    bs = (rest // num_splits).to(tl.int64)

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    offs_d = tl.arange(0, BLOCK_D)
    offs_v = tl.arange(0, BLOCK_DV)
    if BLOCK_D == D:
        q_mask = h_mask[:, None]
    else:
        q_mask = h_mask[:, None] & (offs_d[None, :] < D)
    if BLOCK_DV == DV:
        o_mask = h_mask[:, None]
    else:
        o_mask = h_mask[:, None] & (offs_v[None, :] < DV)
    q = tl.load(q_ptr + (bs * H + offs_h)[:, None] * D + offs_d[None, :],
                mask=q_mask, other=0.0).to(KDTYPE)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    start = sp * split_rows
    end = tl.minimum(start + split_rows, topk)
    # skip the trailing -1 tiles (an all -1 tile adds nothing: p = 0, alpha = 1); a
    # branch around the loop body instead would stop Triton pipelining the KV gathers
    idx_row = idx_ptr + bs * topk
    end = _trim_tail(idx_row, start, end, SCAN_N)
    if PREFETCH:
        # software pipeline in registers: tile i+1's index and row loads are issued before
        # tile i's math, so their latency hides behind two MMAs and a softmax (Triton's
        # pipeliner does not multi-buffer these data-dependent row gathers)
        idx_c = _tile_slots(idx_row, start, end, BLOCK_N)
        rb, rs, rr = _gather_kv_raw(kv_ptr, tl.where(idx_c >= 0, idx_c, 0).to(tl.int64),
                                    idx_c >= 0, offs_d, D, BLOCK_D, FP8, KDTYPE,
                                    FP8_HW == 2)
        for n0 in range(start, end, BLOCK_N):
            valid = idx_c >= 0
            k = _dequant_kv(rb, rs, rr, BLOCK_N, BLOCK_D, FP8, FP8_HW, BF16_MATH, KDTYPE)
            idx_c = _tile_slots(idx_row, n0 + BLOCK_N, end, BLOCK_N)
            rb, rs, rr = _gather_kv_raw(kv_ptr, tl.where(idx_c >= 0, idx_c, 0).to(tl.int64),
                                        idx_c >= 0, offs_d, D, BLOCK_D, FP8, KDTYPE,
                                    FP8_HW == 2)
            m_i, l_i, acc = _attend_tile(q, k, valid, m_i, l_i, acc, qk_scale, offs_d, DV,
                                         BLOCK_D, LAZY, KDTYPE, DOT_PREC)
    elif PIPE_GATHER:
        # the loop carries the next tile's indices (a register load one tile ahead), so the
        # row gather's addresses depend on no load of its own iteration: Triton's pipeliner
        # then gives the gather the full num_stages - 1 tiles of lead (a cp.async into
        # num_stages shared buffers) instead of splitting it with the index load
        idx_n = _tile_slots(idx_row, start, end, BLOCK_N)
        for n0 in range(start, end, BLOCK_N):
            idx = idx_n
            valid = idx >= 0
            rows = tl.where(valid, idx, 0).to(tl.int64)
            idx_n = _tile_slots(idx_row, n0 + BLOCK_N, end, BLOCK_N)
            k = _load_kv_tile(kv_ptr, rows, valid, offs_d, D, BLOCK_N, BLOCK_D, FP8, FP8_HW,
                              BF16_MATH, KDTYPE)
            m_i, l_i, acc = _attend_tile(q, k, valid, m_i, l_i, acc, qk_scale, offs_d, DV,
                                         BLOCK_D, LAZY, KDTYPE, DOT_PREC, SPLIT_QK, n0 < end)
    elif KQ_T:
        qt = tl.trans(q)
        for n0 in range(start, end, BLOCK_N):
            idx = _tile_slots(idx_row, n0, end, BLOCK_N)
            valid = idx >= 0
            rows = tl.where(valid, idx, 0).to(tl.int64)
            k = _load_kv_tile(kv_ptr, rows, valid, offs_d, D, BLOCK_N, BLOCK_D, FP8, FP8_HW,
                              BF16_MATH, KDTYPE)
            m_i, l_i, acc = _attend_tile_t(qt, k, valid, m_i, l_i, acc, qk_scale, offs_d, DV,
                                           BLOCK_D, KDTYPE, DOT_PREC)
    else:
        for n0 in range(start, end, BLOCK_N):
            idx = _tile_slots(idx_row, n0, end, BLOCK_N)
            valid = idx >= 0
            rows = tl.where(valid, idx, 0).to(tl.int64)
            k = _load_kv_tile(kv_ptr, rows, valid, offs_d, D, BLOCK_N, BLOCK_D, FP8, FP8_HW,
                              BF16_MATH, KDTYPE)
            if V_FROM_K:       # SPLIT_QK: the scores' dot split between the warp groups
                m_i, l_i, acc = _attend_tile(q, k, valid, m_i, l_i, acc, qk_scale, offs_d, DV,
                                             BLOCK_D, LAZY, KDTYPE, DOT_PREC, SPLIT_QK, n0 < end)
            else:              # V padded apart from K (d_v < D): its own load
                s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
                s = tl.where(valid[None, :], s, float("-inf"))
                m_i, l_i, acc, p = _softmax_update(s, m_i, l_i, acc, LAZY)
                v = tl.load(kv_ptr + rows[:, None] * D + offs_v[None, :],
                            mask=valid[:, None] & (offs_v[None, :] < DV), other=0.0).to(KDTYPE)
                acc = tl.dot(p.to(KDTYPE), v, acc, input_precision=DOT_PREC)

    has = l_i > 0
    if SPLIT:
        # partial: normalised output and base-2 log-sum-exp of this split (-inf if empty)
        o = acc / tl.where(has, l_i, 1.0)[:, None]
        lse2 = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        prow = (bs * num_splits + sp) * H + offs_h
        tl.store(opart_ptr + prow[:, None] * DV + offs_v[None, :], o, mask=o_mask)
        tl.store(lpart_ptr + prow, lse2, mask=h_mask)
    else:
        if HAS_SINK:
            sk = tl.load(sink_ptr + offs_h, mask=h_mask, other=0.0).to(tl.float32) * 1.4426950408889634
            m_f = tl.maximum(m_i, sk)
            a = tl.exp2(m_i - m_f)
            denom = l_i * a + tl.exp2(sk - m_f)
            o = acc * (a / denom)[:, None]
            lse = (m_f + tl.log2(denom)) * 0.6931471805599453
        else:
            o = acc / tl.where(has, l_i, 1.0)[:, None]
            lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453,
                           float("-inf"))
        orow = bs * H + offs_h
        tl.store(out_ptr + orow[:, None] * DV + offs_v[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=o_mask)
        tl.store(lse_ptr + orow, lse, mask=h_mask)


@triton.jit
def _combine_kernel(opart_ptr, lpart_ptr, sink_ptr, out_ptr, lse_ptr, H, num_splits,
                    DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr,
                    HAS_SINK: tl.constexpr, PDL: tl.constexpr = False):
    """Merge the split partials of one (query position, head): weights 2^(lse_i - max)."""
    if PDL:     # launched ahead of the split kernel's end: wait for its partials
        gdc_wait()
    pid = tl.program_id(0)                       # (b * S_q + s) * H + h
    bs = (pid // H).to(tl.int64)
    h = pid % H
    offs_s = tl.arange(0, BLOCK_S)
    offs_v = tl.arange(0, BLOCK_DV)
    lrow = (bs * num_splits + offs_s) * H + h
    l = tl.load(lpart_ptr + lrow, mask=offs_s < num_splits, other=float("-inf"))
    m = tl.max(l, axis=0)
    if HAS_SINK:
        sk = tl.load(sink_ptr + h).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sk)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(l - m_safe)                      # 0 for empty splits
    denom = tl.sum(w, axis=0)
    if HAS_SINK:
        denom += tl.exp2(sk - m_safe)
    acc = tl.zeros([BLOCK_DV], tl.float32)
    for i in range(0, num_splits):
        wi = tl.sum(tl.where(offs_s == i, w, 0.0), axis=0)
        o = tl.load(opart_ptr + ((bs * num_splits + i) * H + h) * DV + offs_v,
                    mask=offs_v < DV, other=0.0)
        acc += wi * o
    has = denom > 0
    o = acc / tl.where(has, denom, 1.0)
    lse = tl.where(has, (m_safe + tl.log2(tl.where(has, denom, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    tl.store(out_ptr + pid.to(tl.int64) * DV + offs_v, o.to(out_ptr.dtype.element_ty),
             mask=offs_v < DV)
    tl.store(lse_ptr + pid, lse)


@triton.jit
def _combine_heads_kernel(opart_ptr, lpart_ptr, sink_ptr, out_ptr, lse_ptr, H, num_splits,
                    DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr,
                    BLOCK_HC: tl.constexpr, HAS_SINK: tl.constexpr, PDL: tl.constexpr = False):
    """:func:`_combine_kernel` for BLOCK_HC heads a program: with many queries one program
    a head means thousands of programs of 4 KB each (4096 at B 64 / S_q 1), paced by how
    fast the GPU starts programs."""
    if PDL:
        gdc_wait()
    pid = tl.program_id(0)
    n_hc = tl.cdiv(H, BLOCK_HC)
    bs = (pid // n_hc).to(tl.int64)
    h = (pid % n_hc) * BLOCK_HC + tl.arange(0, BLOCK_HC)
    h_mask = h < H
    offs_s = tl.arange(0, BLOCK_S)
    offs_v = tl.arange(0, BLOCK_DV)
    lrow = (bs * num_splits + offs_s[:, None]) * H + h[None, :]
    l = tl.load(lpart_ptr + lrow, mask=(offs_s[:, None] < num_splits) & h_mask[None, :],
                other=float("-inf"))                                    # [BLOCK_S, BLOCK_HC]
    m = tl.max(l, axis=0)
    if HAS_SINK:
        sk = tl.load(sink_ptr + h, mask=h_mask, other=0.0).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sk)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(l - m_safe[None, :])             # 0 for empty splits
    denom = tl.sum(w, axis=0)
    if HAS_SINK:
        denom += tl.exp2(sk - m_safe)
    acc = tl.zeros([BLOCK_HC, BLOCK_DV], tl.float32)
    o_mask = h_mask[:, None] & (offs_v < DV)[None, :]
    for i in range(0, num_splits):
        wi = tl.sum(tl.where(offs_s[:, None] == i, w, 0.0), axis=0)
        o = tl.load(opart_ptr + ((bs * num_splits + i) * H + h[:, None]) * DV + offs_v[None, :],
                    mask=o_mask, other=0.0)
        acc += wi[:, None] * o
    has = denom > 0
    o = acc / tl.where(has, denom, 1.0)[:, None]
    lse = tl.where(has, (m_safe + tl.log2(tl.where(has, denom, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    orow = bs * H + h
    tl.store(out_ptr + orow[:, None] * DV + offs_v[None, :], o.to(out_ptr.dtype.element_ty),
             mask=o_mask)
    tl.store(lse_ptr + orow, lse, mask=h_mask)


def combine_splits(opart, lpart, sink, out, lse, splits, pdl=False):
    """Launch the split-KV combine: partials ``opart`` [B*S_q, splits, H, d_v] (fp32, or
    q's dtype: Config.part16) and base-2 lse ``lpart`` [B*S_q, splits, H] -> ``out`` [B,
    S_q, H, d_v], ``lse`` (with the sink, fp32 [H] or None); ``pdl``: launched as a
    programmatic dependent launch of the split kernel (which must have been launched with
    its PDL flag; see :func:`pdl_ok`). Explained in notebooks/02_mma_attention.ipynb."""
    B, S_q, H, d_v = out.shape
    common = dict(DV=d_v, BLOCK_DV=triton.next_power_of_2(d_v),
                  BLOCK_S=max(2, triton.next_power_of_2(splits)), HAS_SINK=sink is not None,
                  num_warps=4)
    if pdl:
        common.update(PDL=True, launch_pdl=True)
    sink = sink if sink is not None else lse
    # 8 heads a program where one a head would start thousands of tiny programs (H200, B 64
    # / S_q 1 / topk 2048: 62.9 us a call at b4e4c83 -> 61.7 at e5f938d);
    # with few queries one a head, whose loop carries no reduction (8 heads a program cost
    # B 1 / topk 640 14.2 us at 3703e09, and even one a head through the 8-head kernel 11.6
    # at e5f938d, against 10.8 with this kernel). Loading a two-split pair's partials with the
    # lse, before any arithmetic (one round trip instead of three; rows at a793cc5: B 64 / S_q 1
    # 59.5 us, against 58.5 at 19bca93 in a run ~2% slower throughout) was no faster: reverted.
    if B * S_q * H >= 16 * sm_count(out.device, cpu=8):
        block_hc = min(8, triton.next_power_of_2(H))
        _combine_heads_kernel[(B * S_q * triton.cdiv(H, block_hc),)](
            opart, lpart, sink, out, lse, H, splits, BLOCK_HC=block_hc, **common)
    else:
        _combine_kernel[(B * S_q * H,)](opart, lpart, sink, out, lse, H, splits, **common)


# ----------------------------------------------------------------------------------------
# Launcher: split heuristic, per-device configuration table, cached tuning
# ----------------------------------------------------------------------------------------

class Config(NamedTuple):
    """One launch configuration. ``block_h``: heads per program (capped by H; 64 stacks
    all of DeepSeek-V4's heads, 32/16 give 2/4 programs per query that share each tile
    through L2); ``lazy``: the LAZY rescale; ``splits``: 0 = :func:`plan_splits`, else the
    number of split-KV ranges (1 = never split); ``fp8_hw``: the FP8 dequant path
    (None: hardware conversion on sm_89+); ``prefetch``: the PREFETCH software pipeline
    (tile i+1's index and row loads issued before tile i's math, in registers);
    ``pipe_gather``: the PIPE_GATHER loop (indices carried one tile ahead, so Triton's
    pipeliner multi-buffers the row gather itself, ``num_stages`` deep); ``fp8_fast``: with
    the hardware FP8 path, the scales as one 8-byte word a row (pipelinable) and the
    dequant in fp32 (FP8 KV only; no effect on bf16); ``kq_t``: the KQ_T loop (scores
    transposed, S^T = K Q^T, so the tile rows are the MMA's M side; ignores ``lazy``);
    ``split_qk``: SPLIT_QK (the scores' dot split by columns between the warp groups instead
    of computed by both; the plain or PIPE_GATHER loop, bf16 and FP8; ignores ``lazy``);
    ``ws``: the warp-specialised kernel (kernels/sparse_mla_ws.py: a producer warp group
    gathers ``block_n``-row tiles into a ring of ``num_stages`` buffers, two consumer warp
    groups compute) where it applies (capability 9.x/10.x, bf16/fp16 q and cache or bf16 q
    and the FP8 cache at ``block_n`` 32 and <= 3 buffers, 64 heads, D = d_v = 512;
    ``num_warps`` unused), this configuration's plain loop elsewhere;
    ``seesaw``: with ``ws``, the consumers own alternate tiles (full scores each) instead of
    halves of D; ``merge_pair``: with ``ws`` and exactly two split-KV ranges, the two
    programs of a query merge their partials themselves instead of the combine kernel (a
    variant: measured slower, see kernels/sparse_mla_ws.py); ``part16``: split-KV partials
    stored in q's dtype (bf16/fp16) instead of fp32, half the bytes the split programs store
    and the combine reads (each partial rounded once more: at most half an ulp of q's dtype
    on a normalised output, before the combine's fp32 sum); ``pdl``: the combine kernel
    launched as a programmatic dependent launch (sm_90+; ignored elsewhere): the split
    kernel lets it be scheduled at once, and it waits (``griddepcontrol.wait``) for the
    split kernel's results, so its launch overlaps the split kernel's tail; ``p_swizzle``:
    with ``ws`` and ``seesaw``, the P exchange buffers swizzled; ``evict_kv``: at S_q = 1,
    the KV gathers' cp.async under an L2 evict-first policy (kernels/l2_hint.py; on a GPU,
    where the compiler hook is in place)."""
    block_n: int
    num_warps: int
    num_stages: int
    block_h: int = 64
    lazy: bool = False
    splits: int = 0
    fp8_hw: bool | None = None
    prefetch: bool = False
    pipe_gather: bool = False
    fp8_fast: bool = False
    kq_t: bool = False
    split_qk: bool = False
    ws: bool = False
    seesaw: bool = False
    merge_pair: bool = False
    part16: bool = False
    pdl: bool = False
    p_swizzle: bool = False
    evict_kv: bool = False


# Measured winners per device name and workload class (see :func:`workload_class`), for
# H >= 64, D = d_v = 512 with bf16/fp16 q. scripts/tune_sparse_mla.py prints these entries
# from its sweep; paste them here. A class missing here falls back to timing the
# capability's candidates on first use.
#
# From the 2026-11-29 H200 sweep (scripts/tune_sparse_mla.py; CUDA-graph timings, H 64,
# D 512). 'fp8 small' was swept last (session 3, fbf6a61, B8 S1 and B4 S2 at topk 2048): the
# mid/large loop (N64 w8 s3, PIPE_GATHER, fp8_fast, SPLIT_QK) won both, 27.0 / 25.9 us against
# 38.4 / 37.4 for N32 w8 s2 and 97 us for the tiny class's N32 w4 h16. No H100 entry: the same sm_90 die, but not measured, less HBM bandwidth
# (3.35 vs 4.8 TB/s) moves the balance these winners strike, and torch reports it as
# "NVIDIA H100 80GB HBM3" / "NVIDIA H100 PCIe" (114 SMs), which this exact-name lookup
# would have to list one by one.
DEVICE_TABLE: dict = {
    "NVIDIA H200": {
        # bf16 large/mid: variant ws_ss_n32_b4, the warp-specialised seesaw kernel
        # (kernels/sparse_mla_ws.py). Recorded at 3e241a5 (sparse_mla.jsonl, variant rows):
        # 187.9 us at B128 S2 T2048 and 63.1 us at B64 S1 (181.6 / 61.5 at e167caf, the
        # output rows stored 16 bytes a thread) against 241.6 / 79.6 for the
        # previous entry, sqk_n64 = Config(64, 8, 2, 64, split_qk=True) (which had replaced
        # Config(64, 8, 2): 294.9 / 91.9 us); the whole mid/large sweep moved 1.1-1.3x, none
        # slower. Elsewhere (H != 64, sm_80, sm_120) this entry runs the plain loop, N32 w8 s4.
        # part16 and pdl act on split-KV launches only. B64 S1: 61.6 -> 58.5 us with both,
        # rows at 12dd69a (variants ws_ss_n32_b4 / ws_ss_n32_b4_p16_pdl; p16 alone 59.7, pdl
        # alone 61.0). An A/B printout at 69d57c9 (scripts/ab_sparse_mla.py's method, run from
        # an untracked copy; base / p16 / pdl / both, us; its B64 S1 line met the one-load
        # combine, since reverted, the shapes below the one-a-head combine): p16 faster everywhere (B1 S4
        # T2048 22.1 / 19.5, B8 S1 T2048 26.6 / 24.3, B8 S4 T2048 36.2 / 33.4, B1 S1 T640
        # 10.8 / 10.7); pdl faster at B1 S1 T640 (9.9 with both) and B1 S4 T640 (15.9 / 13.7
        # with both) but slower at B1 S4 T2048 (27.8) and B8 S1 T2048 (29.3), so the small
        # class (3-16 query rows) takes p16 alone
        # p_swizzle (the P exchange swizzled) since 45aeb45: faster at all eight mid/large
        # shapes of an A/B printout at 3b2a51d (scripts/ab_sparse_mla.py --knobs
        # pingpong,p_swizzle; e.g. B128 S2 T2048 184.7 -> 179.5 us, B128 S1 97.9 -> 95.8, B16 S4
        # 54.1 -> 53.0, B64 S1 58.4 -> 58.0); rows at 45aeb45: B64 S1 58.1, B128 S2 181.2
        # evict_kv (session 15): at S_q = 1 the KV gathers under an L2 evict-first policy, so
        # rows read once stop evicting the L2's dirty lines (each a write to HBM first).
        # A/B printout at ec05afa (scripts/ab_sparse_mla.py --knobs evict_kv): B64 S1 T2048
        # 57.9 -> 54.3 us, B32 S1 39.1 -> 36.2; not at S_q > 1 (B128 S2 179.1 both, B8 S4
        # 32.4 both, B128 S4 339.1 -> 348.2: a verify step's positions share rows in L2)
        ("bf16", "large"): Config(32, 8, 4, 64, ws=True, seesaw=True, part16=True, pdl=True,
                                  p_swizzle=True, evict_kv=True),
        ("bf16", "mid"): Config(32, 8, 4, 64, ws=True, seesaw=True, part16=True, pdl=True,
                                p_swizzle=True, evict_kv=True),
        # evict_kv on the Triton kernel's small entries and FP8's tiny one (A/B printout at
        # 28f946c: B16 S1 T2048 34.5 -> 33.6 us, FP8 36.1 -> 35.6; B8 S1 T2048 24.2 -> 24.0,
        # FP8 24.8 -> 24.2; B2 S1 FP8 29.0 -> 28.6; none slower). bf16 tiny (16 heads a
        # program) is left out: ptxas built its hinted copies wrongly, so l2_hint builds it
        # unhinted anyway
        ("bf16", "small"): Config(64, 8, 2, 64, False, 0, None,   # 25.5 us at B8 S1 T2048
                                  part16=True, evict_kv=True),
        ("bf16", "tiny"): Config(64, 4, 2, 16, False, 0, None,    # 10.1 us at B1 S1 T640
                                 part16=True, pdl=True),
        # fp8 large/mid: variant ws_ss_n32_b3 with the FP8 producer (kernels/sparse_mla_ws.py):
        # 269.3 us at B128 S2 T2048 and 77.4 at B64 S1 (rows at 9b970d6; 262.2 / 78.0 at
        # e167caf) against 317.1 / 96.8
        # for the previous entry, fp8fast_sqk_pg_n64_s3 = Config(64, 8, 3, 64, pipe_gather=True,
        # fp8_fast=True, split_qk=True) (which had replaced Config(64, 8, 2): 571.3 us). Elsewhere
        # (sm_80, sm_120, fp16 q) this entry runs the plain loop at N32 w8 s3.
        # fp8 large takes the seesaw's lazy rescale since 45aeb45: faster at the four large
        # shapes of A/B printouts at 5db5ef5 and 3b2a51d (B128 S2 T2048 266.7 -> 259.9 and
        # 262.6 -> 259.6 us, B128 S4 527.2 -> 510.0 and 513.3 -> 506.0, B128 S1 135.8 -> 134.8,
        # B64 S2 T640 54.0 -> 53.5), slower at the mid ones (B64 S1 74.5 -> 76.4, B32 S2 74.3
        # -> 76.6, B16 S4 70.9 -> 73.3; bf16 slower everywhere: B128 S2 182.8 -> 202.3);
        # p_swizzle as bf16's. Rows at 45aeb45: B128 S2 247.0 us, B64 S1 72.6 (263.3 / 74.8
        # at 50c1cf7)
        # evict_kv as bf16's: A/B at ec05afa, B64 S1 T2048 73.3 -> 71.9 us, B32 S1 46.0 -> 44.2
        ("fp8", "large"): Config(32, 8, 3, 64, lazy=True, ws=True, seesaw=True, part16=True,
                                 pdl=True, p_swizzle=True, evict_kv=True),
        ("fp8", "mid"): Config(32, 8, 3, 64, ws=True, seesaw=True, part16=True, pdl=True,
                               p_swizzle=True, evict_kv=True),
        ("fp8", "small"): Config(64, 8, 3, 64, pipe_gather=True, fp8_fast=True, split_qk=True,
                                 part16=True, evict_kv=True),
        ("fp8", "tiny"): Config(32, 4, 2, 16, False, 0, None,    # 17.6 us at B1 S1 T640
                                part16=True, pdl=True, evict_kv=True),
    },
}

# Named experimental variants, recorded by ``dsv4lab bench sparse_mla`` beside the table's
# default at the target shapes (not picked automatically until measured). PREFETCH: in the
# sm_90 TTGIR of the default loop only the index load becomes a cp.async; the KV row gather
# is a plain ld.global whose latency every tile pays (bf16 and FP8 alike), so these issue
# tile i+1's gathers before tile i's MMAs. (Correction, 2026-11-29: that reading came from
# compiles without the JIT's 16-byte pointer alignment. With it (triton 3.6, sm_90) the
# default bf16 N64 s2 loop gathers by 16-byte cp.async into 2 buffers, issued at the end of
# tile i-1 behind the asynchronous P V MMA, waited (num 0) at the top of tile i; the FP8
# raw bytes / RoPE by 8-byte cp.async, the FP8 scale bytes synchronously: see fp8fast_*.)
# Compiled for sm_90 (triton 3.9, 8 warps):
# 131 KB (N64) / 98 KB (N32) shared memory, the register file full (255 a thread, as the
# default's), N32 spilling about as little as the default; 16 warps spill KBs (128 regs).
# PIPE_GATHER (sm_90 TTGIR, triton 3.6, 8 warps, bf16): the gather is a cp.async into
# 3 (s3) / 4 (s4) [32, 512] buffers, async_wait num 1 / 2, 164 / 197 KB shared memory
# (N64 s3 needs 262 KB: too much). stages5_n32 is the default loop at 5 stages, where
# the split lead is 2 stages each: gather 3-buffered, async_wait num 3, 164 KB.
VARIANTS: dict = {
    "prefetch_n32": Config(32, 8, 2, 64, False, 0, None, True),
    "prefetch_n64": Config(64, 8, 2, 64, False, 0, None, True),
    "pipe_gather_n32_s3": Config(32, 8, 3, 64, pipe_gather=True),
    "pipe_gather_n32_s4": Config(32, 8, 4, 64, pipe_gather=True),
    "stages5_n32": Config(32, 8, 5, 64),
    # FP8_FAST (fp8_fast=True; FP8 KV only, bf16 runs the plain kernel): compiled for sm_90
    # with triton 3.6 and the JIT's 16-byte pointer alignment, the default FP8 loop's scale
    # bytes are the one load left synchronous inside the loop (1-byte loads are never made
    # cp.async), so every tile pays a full global-memory latency after the raw-byte wait;
    # read as one 8-byte word a row they become a cp.async with the rest. Dequant in fp32
    # (one cvt e4m3x2 -> f16x2, two cvt to f32, two mul.f32, one cvt to bf16x2 per 2
    # values, no scalar bf16 repacking). N64 s2: 0 spills (default FP8: 96 B), 169 KB shared;
    # PIPE_GATHER N32 s3: async_wait num 3 (the raw bytes, scales and RoPE of the next
    # tiles in flight behind the MMAs), 24 B spills, 137 KB.
    "fp8fast_n64": Config(64, 8, 2, 64, fp8_fast=True),
    "fp8fast_n32": Config(32, 8, 2, 64, fp8_fast=True),
    "fp8fast_pg_n32_s3": Config(32, 8, 3, 64, pipe_gather=True, fp8_fast=True),
    "fp8fast_pg_n32_s4": Config(32, 8, 4, 64, pipe_gather=True, fp8_fast=True),
    "fp8fast_prefetch_n32": Config(32, 8, 2, 64, prefetch=True, fp8_fast=True),
    # KQ_T (kq_t=True; bf16 KV only): scores as S^T = K Q^T at BLOCK_N 128, so each of the
    # two warp groups computes its own 64 tile rows (sm_90, triton 3.6: QK^T 32 wgmma
    # m64n64k16 a warp group for 128 rows, where the plain loop issues 64 m64n32k16 in
    # BOTH warp groups for 64 rows: 4x fewer tensor instructions per row). The cost: at
    # 1 stage (2 need 2 x 128 KB) the gather goes through registers (ld.global.v4, no
    # cp.async), 492 B spills, 208 KB shared. Untimed.
    "kqt_n128_s1": Config(128, 8, 1, 64, kq_t=True),
    # SPLIT_QK (split_qk=True; bf16 and FP8): the softmax in both arms of an always-taken
    # branch hides the P V dot from Triton's chained-dot test, so the scores' dot gets
    # warps [4, 2] (each warp group half the tile's columns) instead of [8, 1] (both warp
    # groups the whole tile). sm_90, triton 3.6, 8 warps, compiled offline (untimed):
    # bf16 N64 s2: 36 wgmma in the PTX (default: 68), the gather still a 16-byte cp.async
    # into 2 buffers (async_wait num 0), 44 B spills unsplit / 0 split-KV (default: 0 / 0),
    # 205 KB shared; bf16 PIPE_GATHER N32 s3 / s4: 32 B / 0 spills, 168 / 201 KB,
    # async_wait num 1 / 2. FP8_FAST N64 s2: 0 spills, 181 KB; FP8_FAST PIPE_GATHER N32
    # s3 / s4: 16 B / 0 spills (fp8fast_pg_n32_s4: 36 B / 4 B), 144 / 165 KB, async_wait
    # num 3 / 6. Without FP8_FAST (FP8 KV, tests only): 52-64 B spills.
    "sqk_n64": Config(64, 8, 2, 64, split_qk=True),
    "sqk_pg_n32_s3": Config(32, 8, 3, 64, pipe_gather=True, split_qk=True),
    "sqk_pg_n32_s4": Config(32, 8, 4, 64, pipe_gather=True, split_qk=True),
    "fp8fast_sqk_n64": Config(64, 8, 2, 64, fp8_fast=True, split_qk=True),
    "fp8fast_sqk_pg_n32_s3": Config(32, 8, 3, 64, pipe_gather=True, fp8_fast=True,
                                    split_qk=True),
    "fp8fast_sqk_pg_n32_s4": Config(32, 8, 4, 64, pipe_gather=True, fp8_fast=True,
                                    split_qk=True),
    # FP8_FAST PIPE_GATHER at N64 s3 (two 64-row tiles of raw bytes in flight, async_wait
    # num 3): 222 KB shared (fits the 227 KB of sm_90; bf16 N64 s3 needs 262 KB), 0 spills
    # (4 B when split-KV)
    "fp8fast_sqk_pg_n64_s3": Config(64, 8, 3, 64, pipe_gather=True, fp8_fast=True,
                                    split_qk=True),
    # 16 warps (128 registers a thread, the [64, 512] accumulator 64 of them): the FP8
    # dequant spread over twice the threads and warps; SPLIT_QK gives the scores' dot
    # warps [4, 4] (m64n8k16 at N32: each warp group reads all of Q from shared memory for
    # a quarter of the columns), P V [4, 4]. 0 spills (4 B split-KV), 165 KB, async_wait
    # num 6. (bf16 at 16 warps: the same layouts, N32 s3 0 spills; not a row.)
    "fp8fast_sqk_pg_n32_s4_w16": Config(32, 16, 4, 64, pipe_gather=True, fp8_fast=True,
                                        split_qk=True),
    # The warp-specialised kernel (kernels/sparse_mla_ws.py; bf16/fp16 KV on sm_90/sm_100, and
    # the FP8 cache with bf16 q at 32-row tiles and <= 3 buffers; elsewhere the plain loop at
    # N32 w8 s3): a ring of three 32-row tiles, the lazy rescale or not. sm_90, triton 3.6,
    # compiled offline: 197 KB shared memory, 168 registers a thread at launch (producer 40,
    # consumers 232 after setmaxnreg), no spills. Retired at 709fa69: ws_n64_b2_lazy (two
    # 64-row tiles, 230 KB), which the output store's conversion scratch (3.9 KB) put past
    # the 227 KB a block may have; it was slower anyway (85.7 / 293.9 us at B64 S1 / B128 S2,
    # rows at 3e241a5).
    "ws_n32_b3": Config(32, 8, 3, 64, ws=True),
    "ws_n32_b3_lazy": Config(32, 8, 3, 64, lazy=True, ws=True),
    "ws_ss_n32_b3": Config(32, 8, 3, 64, ws=True, seesaw=True),
    "ws_ss_n32_b4": Config(32, 8, 4, 64, ws=True, seesaw=True),
    # the same with two split-KV ranges merged by the pair itself instead of the combine
    # kernel (kernels/sparse_mla_ws.py, _epilogue). Recorded at eae6a6d (sparse_mla.jsonl),
    # where it was the default and this table's name for the combine kernel was
    # "ws_ss_n32_b4_combine": B64 S1 64.4 us merged against 62.7 with the combine kernel
    # (B128 S2, never split: 188.5 / 188.8).
    "ws_ss_n32_b4_merge": Config(32, 8, 4, 64, ws=True, seesaw=True, merge_pair=True),
    # the split-KV epilogue's bytes (B 64 / S_q 1, two ranges: 128 programs store 16 MB of
    # fp32 partials at once, ~3.8 us on the timeline, and the combine reads them back):
    # partials in bf16 (part16), the combine launched early (pdl), both, and the
    # self-merging pair with bf16 partials
    "ws_ss_n32_b4_p16": Config(32, 8, 4, 64, ws=True, seesaw=True, part16=True),
    "ws_ss_n32_b4_pdl": Config(32, 8, 4, 64, ws=True, seesaw=True, pdl=True),
    "ws_ss_n32_b4_p16_pdl": Config(32, 8, 4, 64, ws=True, seesaw=True, part16=True, pdl=True),
    "ws_ss_n32_b4_merge_p16": Config(32, 8, 4, 64, ws=True, seesaw=True, merge_pair=True,
                                     part16=True),
    # the seesaw consumers' lazy rescale (kernels/sparse_mla_ws.py, _next_max): the running
    # max moves, and the two [64, 256] fp32 rescales of a pair run, only once a head's scores
    # exceed it by 2^8. sm_90, triton 3.6, offline: 20-60 B spills (eager 0-8 B)
    "ws_ss_n32_b4_lazy": Config(32, 8, 4, 64, lazy=True, ws=True, seesaw=True),
    "ws_ss_n32_b4_lazy_p16_pdl": Config(32, 8, 4, 64, lazy=True, ws=True, seesaw=True,
                                        part16=True, pdl=True),
    "ws_ss_n32_b3_lazy": Config(32, 8, 3, 64, lazy=True, ws=True, seesaw=True),
    # the P exchange swizzled (P_SWIZZLE; in the table since 45aeb45). Tried and removed
    # (kernels/sparse_mla_ws.py's docstring has the figures): PINGPONG, the consumers'
    # scores in turn (rows at 45aeb45: ws_ss_n32_b4_pp), and PAIR_MAX, the held max moved
    # once a pair (A/B printout at 542956a)
    "ws_ss_n32_b4_psw": Config(32, 8, 4, 64, ws=True, seesaw=True, p_swizzle=True),
    "ws_ss_n32_b3_psw": Config(32, 8, 3, 64, ws=True, seesaw=True, p_swizzle=True),
    "ws_ss_n32_b4_psw_p16_pdl": Config(32, 8, 4, 64, ws=True, seesaw=True, p_swizzle=True,
                                       part16=True, pdl=True),
    # the table's ws entries before evict_kv (the KV gathers under L2 evict-first at S_q = 1,
    # in the table since session 15): the rows it is compared with
    "ws_ss_n32_b3_psw_p16_pdl": Config(32, 8, 3, 64, ws=True, seesaw=True, p_swizzle=True,
                                       part16=True, pdl=True),
    "ws_ss_n32_b3_lazy_psw_p16_pdl": Config(32, 8, 3, 64, lazy=True, ws=True, seesaw=True,
                                            p_swizzle=True, part16=True, pdl=True),
}

# Candidates timed on first use when the table has no entry, per shared-memory class
# and head block. The first entry is the untuned default (used inside graph capture).
# A [64, 512] fp32 accumulator needs 8 warps (128 registers a thread) or 16 (64);
# Hopper/Blackwell datacenter parts have 227 KB of shared memory, sm_80 164 KB, sm_120
# 99 KB, so the smaller parts get shallower pipelines.
_CANDIDATES = {
    "big_smem": {64: [Config(32, 8, 2), Config(64, 8, 2), Config(32, 8, 3)],
                 32: [Config(32, 4, 2, 32), Config(64, 4, 2, 32), Config(32, 8, 2, 32)],
                 16: [Config(32, 4, 2, 16), Config(64, 4, 2, 16), Config(32, 4, 3, 16)]},
    "small_smem": {64: [Config(32, 8, 1), Config(16, 8, 2), Config(32, 8, 2)],
                   32: [Config(32, 4, 1, 32), Config(32, 4, 2, 32), Config(16, 4, 2, 32)],
                   16: [Config(32, 4, 1, 16), Config(32, 4, 2, 16), Config(16, 4, 2, 16)]},
}
_TUNED: dict = {}          # (device, workload key) -> Config
INTERPRETER_BLOCK_N = 16   # small tiles in the interpreter so topk spans several of them
SPLIT_ROWS_MULTIPLE = 64   # split ranges are multiples of every BLOCK_N candidate
SCAN_N = 512               # slots per load when looking for a split's last valid slot


def plan_splits(n_programs: int, topk: int, sm_count: int) -> tuple[int, int]:
    """(num_splits, split_rows): split topk when there are too few programs to fill
    the GPU; each split covers a multiple of 64 slots."""
    if n_programs >= 0.75 * sm_count:
        return 1, topk
    want = max(1, sm_count // n_programs)
    return _split_rows(min(want, max(1, topk // SPLIT_ROWS_MULTIPLE)), topk)


def _split_rows(splits: int, topk: int) -> tuple[int, int]:
    """At most ``splits`` ranges of a multiple of 64 slots covering topk."""
    splits = max(1, min(int(splits), triton.cdiv(topk, SPLIT_ROWS_MULTIPLE)))
    if splits <= 1:
        return 1, topk
    rows = triton.cdiv(triton.cdiv(topk, splits), SPLIT_ROWS_MULTIPLE) * SPLIT_ROWS_MULTIPLE
    splits = triton.cdiv(topk, rows)
    return (splits, rows) if splits > 1 else (1, topk)


def workload_class(rows: int, fp8: bool) -> tuple[str, str]:
    """The table's key for ``rows`` = B x S_q query positions: (kv format, size class)."""
    size = "tiny" if rows <= 2 else "small" if rows <= 16 else "mid" if rows <= 64 else "large"
    return ("fp8" if fp8 else "bf16", size)


def _capability(device):
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)


def _candidates(device, block_h):
    major = _capability(device)[0] if device.type == "cuda" else 9
    table = _CANDIDATES["big_smem" if major in (9, 10) else "small_smem"]
    return table[block_h]


def _bucket(x: int) -> int:
    return int(math.log2(max(1, x)))


def sparse_mla_mma(q, kv, indices, sink, scale, d_v, *, fp8=False, num_splits=None,
                   config=None, tune=True, fp8_hw=None):
    """Launch the MMA kernel (and the combine kernel when split).

    q [B, S_q, H, D]; kv [N, D] in q's dtype, or uint8 [N, 584] with ``fp8``; indices int32
    [B, S_q, topk]; sink fp32 [H] or None -> (out [B, S_q, H, d_v] q.dtype, lse fp32).
    ``num_splits`` and ``config`` (a :class:`Config` or a (BLOCK_N, num_warps,
    num_stages, ...) tuple) override the plan; ``fp8_hw`` forces the FP8 dequant path
    (default: the config's, else hardware conversion on sm_89+ and in the interpreter,
    bit moves before).
    """
    B, S_q, H, D = q.shape
    topk = indices.shape[-1]
    dev = q.device
    interp = interpreting()
    if fp8:
        assert D == FP8_DIM and kv.shape[-1] == FP8_ROW_BYTES
    hw_default = interp or dev.type != "cuda" or _capability(dev) >= (8, 9)
    h_cap = min(64, max(16, triton.next_power_of_2(H)))
    if config is not None:
        config = Config(*config)
    elif interp or dev.type != "cuda":
        config = Config(INTERPRETER_BLOCK_N, 4, 1, h_cap)
    else:
        key = workload_class(B * S_q, fp8)
        entry = DEVICE_TABLE.get(torch.cuda.get_device_name(dev), {}).get(key)
        if entry is not None and H >= 64 and D == 512 and d_v == 512 and q.dtype != torch.float32:
            config = entry
    block_h = min(config.block_h, h_cap) if config is not None else h_cap
    n_hblk = triton.cdiv(H, block_h)
    n_prog = B * S_q * n_hblk
    if num_splits is None and config is not None and config.splits:
        num_splits = config.splits
    if num_splits is None:
        splits, split_rows = plan_splits(n_prog, topk, sm_count(dev, cpu=8))   # CPU: a small GPU, so split-KV runs
    else:
        splits, split_rows = _split_rows(num_splits, topk)

    out = torch.empty(B, S_q, H, d_v, dtype=q.dtype, device=dev)
    lse = torch.empty(B, S_q, H, dtype=torch.float32, device=dev)
    block_d = max(16, triton.next_power_of_2(D))      # tl.dot needs K >= 16
    v_from_k = max(16, triton.next_power_of_2(d_v)) == block_d or fp8
    block_dv = block_d if v_from_k else max(16, triton.next_power_of_2(d_v))
    split = splits > 1
    if split:
        # partials in q's dtype with Config.part16 (the tuner's candidates keep fp32; the
        # kernels store and the combine reads either)
        part16 = config is not None and config.part16 and q.dtype != torch.float32
        opart = torch.empty(B * S_q * splits * H * d_v, dtype=q.dtype if part16 else torch.float32,
                            device=dev)
        lpart = torch.empty(B * S_q * splits * H, dtype=torch.float32, device=dev)
    else:
        opart = lpart = lse       # unused
    upcast = interp and q.dtype == torch.bfloat16
    kdtype = tl.float32 if (upcast or q.dtype == torch.float32) else \
        (tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float16)
    dot_prec = "ieee" if kdtype == tl.float32 else "tf32"
    grid = (n_prog * splits,)
    scan_n = INTERPRETER_BLOCK_N * 2 if interp else SCAN_N

    # FP8_FAST reads each row's scales as an 8-byte word: only from an 8-byte aligned cache
    fast_ok = fp8 and kv.data_ptr() % 8 == 0

    def launch(cfg):
        hw = fp8_hw if fp8_hw is not None else (cfg.fp8_hw if cfg.fp8_hw is not None else hw_default)
        _sparse_mla_mma_kernel[grid](
            q, kv, indices, sink if sink is not None else lse, out, lse, opart, lpart,
            H, topk, n_hblk, splits, split_rows, scale * LOG2E,
            D=D, DV=d_v, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_DV=block_dv,
            BLOCK_N=cfg.block_n, V_FROM_K=v_from_k, FP8=fp8, FP8_HW=(2 if fast_ok and cfg.fp8_fast else 1) if (fp8 and hw) else 0,
            BF16_MATH=kdtype == tl.bfloat16, LAZY=bool(cfg.lazy), HAS_SINK=sink is not None,
            SPLIT=split, KDTYPE=kdtype, DOT_PREC=dot_prec, SCAN_N=scan_n,
            PREFETCH=bool(cfg.prefetch and v_from_k),
            PIPE_GATHER=bool(cfg.pipe_gather and v_from_k),
            KQ_T=bool(cfg.kq_t and v_from_k and not (cfg.prefetch or cfg.pipe_gather or fp8)),
            SPLIT_QK=bool(cfg.split_qk and v_from_k and not (cfg.prefetch or cfg.kq_t)),
            PDL=split and bool(cfg.pdl) and pdl_ok(dev),
            EVICT_KV=evict_kv_applies(cfg.evict_kv, S_q),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    if config is not None and config.kq_t and fp8 and not (interp or dev.type != "cuda"):
        # a [128, 512] dequantised tile plus the raw bytes does not fit next to Q (sm_90:
        # 320 KB shared, 600 B spills): KQ_T is for bf16/fp16 KV only
        raise ValueError("Config.kq_t is for bf16/fp16 KV; the FP8 cache needs kq_t=False")
    if config is None:
        tune_key = _bucket(n_prog * splits) * 32 + _bucket(split_rows)
        config = _pick_config(dev, block_h, (block_h, D, d_v, fp8, split, str(q.dtype), tune_key),
                              launch, tune)
    # the warp-specialised kernel (Gluon) where this Triton's Gluon is the one it is written for
    # (asked before the import) and the GPU and shapes suit it; else the kernel here
    if config.ws and block_h == 64 and gluon_unsupported() is None:
        from dsv4lab.kernels import sparse_mla_ws
        if sparse_mla_ws.supported(q, kv, fp8, d_v, config.block_n, config.num_stages, config.seesaw,
                                   config.lazy):
            return sparse_mla_ws.sparse_mla_ws(q, kv, indices, sink, scale, splits, split_rows,
                                               **ws_launch_args(config))
    launch(config)
    if split:
        combine_splits(opart, lpart, sink, out, lse, splits, pdl=bool(config.pdl) and pdl_ok(dev))
    return out, lse


def evict_kv_applies(evict_kv: bool, S_q: int) -> bool:
    """Whether a launch asked for ``evict_kv`` marks its kernel (both launchers ask here): at
    S_q = 1 only, since a verify step's positions share rows through the L2 (A/B printout at
    ec05afa: B 128 / S_q 4 bf16 339.1 -> 348.2 us with it), and where
    :func:`dsv4lab.kernels.l2_hint.active`."""
    return bool(evict_kv) and S_q == 1 and l2_hint.active()


def ws_launch_args(config: Config) -> dict:
    """The keyword arguments of kernels/sparse_mla_ws.py's launcher that ``config`` sets
    (a CPU test keeps them equal to its keywords, so a knob added to one side only fails
    there, not on the first GPU call)."""
    return dict(block_n=config.block_n, num_buf=config.num_stages, lazy=config.lazy,
                seesaw=config.seesaw, merge_pair=config.merge_pair, part16=config.part16,
                pdl=config.pdl, p_swizzle=config.p_swizzle, evict_kv=config.evict_kv)


def _pick_config(dev, block_h, key, launch, tune):
    """The cached winner for this workload bucket; times the candidates on first use
    (never while a CUDA graph is being captured: then the first candidate is used)."""
    name = torch.cuda.get_device_name(dev)
    full = (name,) + key
    if full in _TUNED:
        return _TUNED[full]
    cands = _candidates(dev, block_h)
    if not tune or torch.cuda.is_current_stream_capturing():
        return cands[0]
    from triton.testing import do_bench
    best, best_ms = None, float("inf")
    for cfg in cands:
        try:
            ms = do_bench(lambda: launch(cfg), warmup=5, rep=20, return_mode="median")
        except Exception:      # e.g. out of shared memory on this part: skip the candidate
            continue
        if ms < best_ms:
            best, best_ms = cfg, ms
    if best is None:
        raise RuntimeError(f"sparse_mla_mma: no launch configuration compiles on {name} "
                           f"(tried {cands})")
    _TUNED[full] = best
    return best
