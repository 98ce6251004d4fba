"""Sparse MLA decode, lesson 2: the heads share each gathered KV tile, on the tensor cores.

All H query heads of one query position attend to the *same* selected latent rows (MQA), so
one program takes a block of ``BLOCK_H`` heads (64 for DeepSeek-V4) as the M side of ``tl.dot``::

    S   [BLOCK_H, BLOCK_N] = Q [BLOCK_H, D] @ K^T [D, BLOCK_N]       (scores, fp32)
    acc [BLOCK_H, d_v]    += P [BLOCK_H, BLOCK_N] @ V [BLOCK_N, d_v]   (V = K[:, :d_v])

Each tile of ``BLOCK_N`` rows is gathered once for every head of the block: 64x fewer bytes
than lesson 1 (``simt.py``), and the math on the tensor cores. The softmax is online (fp32,
base 2); a step's query positions (S_q = 1..4, a speculative verify) are more rows of the grid.

* Split-KV: when B x S_q cannot fill the GPU, the ``topk`` slots are cut into ``num_splits``
  ranges, each writing a partial (normalised output, base-2 lse) that :func:`combine_splits`
  merges, adding the sink.
* The FP8 cache (584-byte rows, dsv4lab/quant/kv_fp8.py) is dequantised in registers: e4m3 by
  the hardware on sm_89+ (``FP8_HW``), by moving bits into an fp16 on sm_80, times the group's
  power-of-two scale (exact). The 64 RoPE values are read as bf16.
* ``PIPE_GATHER``: the loop carries the next tile's indices, so the row gather depends on no
  load of its own iteration and gets all ``num_stages - 1`` tiles of lead (the plain loop: one);
  the FP8 scales then come as one 8-byte word a row, which the pipeliner can multi-buffer.
* ``SPLIT_QK``: a dot whose result feeds another dot gets all warps along M, so at 64 heads and
  8 warps both warp groups would compute the same scores; the softmax in both arms of an
  always-taken branch lets the scores' dot split by columns between them.

The interpreter upcasts bf16 operands to fp32 (its bf16 ``tl.dot`` is wrong). Explained in
notebooks/02_mma_attention.ipynb.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from dsv4lab.kernels.attention import l2_hint
from dsv4lab.kernels.attention.simt import LOG2E, trim_tail
from dsv4lab.kernels.device import interpreting, pdl_ok, props
from dsv4lab.kernels.launch import Launch, workspace

FP8_ROW_BYTES = 584      # 448 e4m3 + 64 bf16 + 7 ue8m0 scales + 1 pad
FP8_DIM = 512


# ---- gathering a tile of latent rows (bf16 as is; the FP8 cache dequantised) ---------------

@triton.jit
def _gather_kv_raw(kv_ptr, rows, valid, offs_d, D: tl.constexpr, BLOCK_D: tl.constexpr,
                   FP8: tl.constexpr, KDTYPE: tl.constexpr, FP8_WORD: tl.constexpr = False):
    """Issue the loads of latent rows ``rows`` (int64): the bf16 tile, or the FP8 cache's e4m3
    bytes [N, 8, 64], scales (bytes [N, 8, 1] or a word [N, 1, 1]) and bf16 RoPE [N, 1, 64]."""
    if FP8:
        # 8 groups of 64 values: 0..6 e4m3 (a scale each), 7 the bf16 RoPE part
        j = tl.arange(0, 8)[None, :, None]
        c = tl.arange(0, 64)[None, None, :]
        base = rows[:, None, None] * 584
        v3 = valid[:, None, None]
        nope = v3 & (j < 7)
        b = tl.load(kv_ptr + base + j * 64 + c, mask=nope, other=0)           # [N, 8, 64]
        if FP8_WORD:
            # bytes 576..583 as one 8-byte word a row (the row base 584 r is 8-byte aligned)
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
                FP8_HW: tl.constexpr, FP8_WORD: tl.constexpr, BF16_MATH: tl.constexpr,
                KDTYPE: tl.constexpr):
    """The [BLOCK_N, BLOCK_D] K tile from :func:`_gather_kv_raw`'s parts (bf16: as is)."""
    if FP8:
        j = tl.arange(0, 8)[None, :, None]
        if FP8_WORD:
            # byte j of the word is group j's scale; the fp32 product is exact, rounded once
            sbi = ((sb >> (j * 8).to(tl.int64)) & 0xFF).to(tl.int32)            # [N, 8, 1]
            x = b.to(tl.float8e4nv, bitcast=True)
            sc = (sbi << 23).to(tl.float32, bitcast=True)
            val = x.to(tl.float32) * sc
        elif FP8_HW:
            sbi = sb.to(tl.int32) & 0xFF
            # hardware e4m3 conversion; the scale 2^(s-127) is the fp32 of exponent s (0: 0)
            x = b.to(tl.float8e4nv, bitcast=True)
            sc = (sbi << 23).to(tl.float32, bitcast=True)
            if BF16_MATH:
                val = x.to(tl.bfloat16) * sc.to(tl.bfloat16)      # exact: a power of two
            else:
                val = x.to(tl.float32) * sc
        else:
            sbi = sb.to(tl.int32) & 0xFF
            # e4m3 -> fp16 by moving bits (sign to 15, exponent+mantissa to 7..13): value * 2^-8
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
                  FP8_WORD: tl.constexpr, BF16_MATH: tl.constexpr, KDTYPE: tl.constexpr):
    """Gather the latent rows ``rows`` ([BLOCK_N], int64) as a [BLOCK_N, BLOCK_D] tile."""
    b, sb, rope = _gather_kv_raw(kv_ptr, rows, valid, offs_d, D, BLOCK_D, FP8, KDTYPE, FP8_WORD)
    return _dequant_kv(b, sb, rope, BLOCK_N, BLOCK_D, FP8, FP8_HW, FP8_WORD, BF16_MATH, KDTYPE)


@triton.jit
def _tile_slots(idx_row, n0, end, BLOCK_N: tl.constexpr):
    """Slots n0 .. n0 + BLOCK_N - 1 of one query's index list (-1 from ``end`` on)."""
    offs = n0 + tl.arange(0, BLOCK_N)
    return tl.load(idx_row + offs, mask=offs < end, other=-1)


# ---- one tile of the online softmax --------------------------------------------------------

@triton.jit
def _softmax_step(s, m_i, l_i):
    """Online softmax on one tile of base-2 scores: (new max, new sum, alpha, p)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return m_new, l_i * alpha + tl.sum(p, axis=1), alpha, p


@triton.jit
def _attend_tile(q, k, v, valid, m_i, l_i, acc, qk_scale, KDTYPE: tl.constexpr,
                 DOT_PREC: tl.constexpr, SPLIT_QK: tl.constexpr, live):
    """S = Q K^T, online softmax, acc += P V -> (m_i, l_i, acc); ``live`` is always true."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
    s = tl.where(valid[None, :], s, float("-inf"))
    if SPLIT_QK:
        if live:
            m_i, l_i, alpha, p = _softmax_step(s, m_i, l_i)
        else:
            m_i, l_i, alpha, p = _softmax_step(s, m_i, l_i)
    else:
        m_i, l_i, alpha, p = _softmax_step(s, m_i, l_i)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(KDTYPE), v, acc, input_precision=DOT_PREC)
    return m_i, l_i, acc


# ---- the kernel: one program per (query position, split, head block) -----------------------

@triton.jit
def _sparse_mla_mma_kernel(
    q_ptr, kv_ptr, idx_ptr, sink_ptr, out_ptr, lse_ptr, opart_ptr, lpart_ptr,
    H, topk, n_hblk, num_splits, split_rows, qk_scale,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, V_FROM_K: tl.constexpr,
    FP8: tl.constexpr, FP8_HW: tl.constexpr, BF16_MATH: tl.constexpr,
    HAS_SINK: tl.constexpr, SPLIT: tl.constexpr, KDTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
    SCAN_N: tl.constexpr, PIPE_GATHER: tl.constexpr = False, FP8_WORD: tl.constexpr = False,
    SPLIT_QK: tl.constexpr = False, PDL: tl.constexpr = False, EVICT_KV: tl.constexpr = False,
):
    if PDL:     # the combine (a programmatic dependent launch) may be scheduled now
        gdc_launch_dependents()
    if EVICT_KV:    # the row gathers' cp.async under an L2 evict-first policy (l2_hint.py)
        l2_hint.mark_tl()
    # program -> (head block, split, query position); a query's head blocks run together (L2)
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
    # drop the -1 tail here: a branch around the loop body would stop the gathers' pipelining
    idx_row = idx_ptr + bs * topk
    end = trim_tail(idx_row, start, end, SCAN_N)
    if PIPE_GATHER:
        idx_n = _tile_slots(idx_row, start, end, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        if PIPE_GATHER:
            idx = idx_n
        else:
            idx = _tile_slots(idx_row, n0, end, BLOCK_N)
        valid = idx >= 0
        rows = tl.where(valid, idx, 0).to(tl.int64)
        if PIPE_GATHER:
            idx_n = _tile_slots(idx_row, n0 + BLOCK_N, end, BLOCK_N)
        k = _load_kv_tile(kv_ptr, rows, valid, offs_d, D, BLOCK_N, BLOCK_D, FP8, FP8_HW,
                          FP8_WORD, BF16_MATH, KDTYPE)
        if not V_FROM_K:        # V padded apart from K (d_v < D): its own load
            v = tl.load(kv_ptr + rows[:, None] * D + offs_v[None, :],
                        mask=valid[:, None] & (offs_v[None, :] < DV), other=0.0).to(KDTYPE)
        elif DV < BLOCK_D:      # V = K[:, :DV]
            v = tl.where(offs_d[None, :] < DV, k, 0.0).to(KDTYPE)
        else:
            v = k
        m_i, l_i, acc = _attend_tile(q, k, v, valid, m_i, l_i, acc, qk_scale, KDTYPE, DOT_PREC,
                                     SPLIT_QK, n0 < end)

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


# ---- split-KV: merging the partials --------------------------------------------------------

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
                          BLOCK_HC: tl.constexpr, HAS_SINK: tl.constexpr,
                          PDL: tl.constexpr = False):
    """:func:`_combine_kernel` for BLOCK_HC heads a program (for many queries)."""
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


def combine_launch(B, S_q, H, d_v, splits, *, has_sink, pdl, sm_count):
    """(kernel, grid, constexprs and options) of the split-KV combine: 8 heads a program for
    many queries (else thousands of tiny programs), one head a program for few."""
    consts = dict(DV=d_v, BLOCK_DV=triton.next_power_of_2(d_v),
                  BLOCK_S=max(2, triton.next_power_of_2(splits)), HAS_SINK=has_sink,
                  num_warps=4)
    if pdl:
        consts.update(PDL=True, launch_pdl=True)
    if B * S_q * H >= 16 * sm_count:
        block_hc = min(8, triton.next_power_of_2(H))
        grid = (B * S_q * triton.cdiv(H, block_hc),)
        return _combine_heads_kernel, grid, dict(consts, BLOCK_HC=block_hc)
    return _combine_kernel, (B * S_q * H,), consts


def combine_plan(device, B, S_q, H, d_v, splits, *, has_sink, pdl, sm_count) -> Launch:
    """The combine as a :class:`Launch` of (opart, lpart, sink or any fp32 tensor, out, lse)."""
    kernel, grid, consts = combine_launch(B, S_q, H, d_v, splits, has_sink=has_sink, pdl=pdl,
                                          sm_count=sm_count)
    options = {k: consts.pop(k) for k in ("num_warps", "launch_pdl") if k in consts}
    return Launch(kernel, grid, dict(consts, H=H, num_splits=splits), device=device, guard=(2,),
                  **options)


def combine_splits(opart, lpart, sink, out, lse, splits, pdl=False):
    """Merge ``opart`` [B*S_q, splits, H, d_v] and base-2 ``lpart`` [B*S_q, splits, H] into
    ``out`` [B, S_q, H, d_v] and ``lse``, adding ``sink`` (fp32 [H] or None). ``pdl``: as a
    programmatic dependent launch of a split kernel launched with its PDL flag."""
    B, S_q, H, d_v = out.shape
    combine_plan(out.device, B, S_q, H, d_v, splits, has_sink=sink is not None, pdl=pdl,
                 sm_count=props(out.device).sm_count)(
        opart, lpart, sink if sink is not None else lse, out, lse)


# ---- the launcher --------------------------------------------------------------------------

class Config(NamedTuple):
    """A launch configuration of :func:`sparse_mla_mma` (dispatch.py picks one): ``block_n``
    rows a tile; ``block_h`` heads a program (capped by H; 32 / 16: 2 / 4 programs a query
    sharing each tile via the L2); ``pdl``: the combine as a programmatic dependent launch
    (sm_90+); ``evict_kv``: the row gathers under an L2 evict-first policy (l2_hint.py)."""
    block_n: int
    num_warps: int
    num_stages: int
    block_h: int = 64
    pipe_gather: bool = False
    split_qk: bool = False
    pdl: bool = False
    evict_kv: bool = False


SPLIT_ROWS_MULTIPLE = 64   # split ranges are multiples of every BLOCK_N
SCAN_N = 512               # slots a load when looking for a split's last valid slot


def plan_splits(n_programs: int, topk: int, sm_count: int) -> tuple[int, int]:
    """(num_splits, split_rows): split topk when there are too few programs to fill the GPU
    (under 3/4 of its SMs); each split covers a multiple of 64 slots."""
    if n_programs >= 0.75 * sm_count:
        return 1, topk
    want = max(1, sm_count // n_programs)
    return split_rows(min(want, max(1, topk // SPLIT_ROWS_MULTIPLE)), topk)


def split_rows(splits: int, topk: int) -> tuple[int, int]:
    """At most ``splits`` ranges of a multiple of 64 slots covering topk: (num_splits, rows)."""
    splits = max(1, min(int(splits), triton.cdiv(topk, SPLIT_ROWS_MULTIPLE)))
    if splits <= 1:
        return 1, topk
    rows = triton.cdiv(triton.cdiv(topk, splits), SPLIT_ROWS_MULTIPLE) * SPLIT_ROWS_MULTIPLE
    splits = triton.cdiv(topk, rows)
    return (splits, rows) if splits > 1 else (1, topk)


def kernel_constexprs(config: Config, *, D, d_v, q_dtype, fp8, fp8_hw, split, has_sink, pdl,
                      evict, word_aligned, interp=False) -> dict:
    """Constexprs and launch options of one :func:`sparse_mla_mma` launch (as compiled offline)."""
    block_d = max(16, triton.next_power_of_2(D))      # tl.dot needs K >= 16
    v_from_k = max(16, triton.next_power_of_2(d_v)) == block_d or fp8
    upcast = interp and q_dtype == torch.bfloat16     # the interpreter's bf16 dot is wrong
    kdtype = tl.float32 if (upcast or q_dtype == torch.float32) else \
        (tl.bfloat16 if q_dtype == torch.bfloat16 else tl.float16)
    return dict(D=D, DV=d_v, BLOCK_D=block_d,
                BLOCK_DV=block_d if v_from_k else max(16, triton.next_power_of_2(d_v)),
                BLOCK_N=config.block_n, V_FROM_K=v_from_k, FP8=fp8, FP8_HW=bool(fp8 and fp8_hw),
                BF16_MATH=kdtype == tl.bfloat16, HAS_SINK=has_sink, SPLIT=split, KDTYPE=kdtype,
                DOT_PREC="ieee" if kdtype == tl.float32 else "tf32",
                SCAN_N=32 if interp else SCAN_N, PIPE_GATHER=config.pipe_gather,
                # the scale word needs an 8-byte aligned cache (a 584-byte row is 8 x 73)
                FP8_WORD=bool(fp8 and fp8_hw and config.pipe_gather and word_aligned),
                SPLIT_QK=config.split_qk, PDL=pdl, EVICT_KV=evict,
                num_warps=config.num_warps, num_stages=config.num_stages)


class SplitLaunches:
    """A sparse MLA kernel's launch and, when split, the combine's (``main``, ``combine``,
    ``out_shape``, ``lse_shape``, ``partials``: set by a subclass). A call allocates the
    outputs, takes the partials from the stream's workspace and launches."""

    def _make_partials(self, device):
        _, n_o, dtype, n_l = self.partials
        return (torch.empty(n_o, dtype=dtype, device=device),
                torch.empty(n_l, dtype=torch.float32, device=device))

    def __call__(self, q, kv, indices, sink, scale):
        dev = q.device
        out = torch.empty(self.out_shape, dtype=q.dtype, device=dev)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=dev)
        sk = lse if sink is None else sink
        if self.combine is None:
            self.main(q, kv, indices, sk, out, lse, lse, lse, scale * LOG2E)
            return out, lse
        opart, lpart = workspace(self.partials, dev, lambda: self._make_partials(dev))
        self.main(q, kv, indices, sk, out, lse, opart, lpart, scale * LOG2E)
        self.combine(opart, lpart, sk, out, lse)
        return out, lse


class MmaLaunches(SplitLaunches):
    """The launches of :func:`sparse_mla_mma` for one device, shape and config, made once."""

    def __init__(self, device, B, S_q, H, D, d_v, topk, q_dtype, config: Config, *, fp8,
                 splits, rows_per_split, has_sink, word_aligned, fp8_hw):
        interp = interpreting()
        block_h = min(config.block_h, max(16, triton.next_power_of_2(H)))
        n_hblk = triton.cdiv(H, block_h)
        split = splits > 1
        pdl = split and config.pdl and pdl_ok(device)
        consts = kernel_constexprs(config, D=D, d_v=d_v, q_dtype=q_dtype, fp8=fp8, fp8_hw=fp8_hw,
                                   split=split, has_sink=has_sink, pdl=pdl,
                                   evict=config.evict_kv and l2_hint.active(),
                                   word_aligned=word_aligned, interp=interp)
        warps, stages = consts.pop("num_warps"), consts.pop("num_stages")
        self.main = Launch(_sparse_mla_mma_kernel, (B * S_q * n_hblk * splits,),
                           dict(consts, H=H, topk=topk, n_hblk=n_hblk, num_splits=splits,
                                split_rows=rows_per_split, BLOCK_H=block_h),
                           device=device, num_warps=warps, num_stages=stages, guard=(0, 1, 2, 3),
                           jit_context=l2_hint.rewriting if consts["EVICT_KV"] else None)
        self.combine = combine_plan(device, B, S_q, H, d_v, splits, has_sink=has_sink, pdl=pdl,
                                    sm_count=props(device).sm_count) if split else None
        self.out_shape, self.lse_shape = (B, S_q, H, d_v), (B, S_q, H)
        self.partials = ("mla partials", B * S_q * splits * H * d_v, q_dtype,
                         B * S_q * splits * H)


_LAUNCHES: dict = {}


def mma_launches(device, B, S_q, H, D, d_v, topk, q_dtype, config: Config, *, fp8, splits,
                 rows_per_split, has_sink, word_aligned, fp8_hw) -> MmaLaunches:
    """:class:`MmaLaunches` of these arguments, made once."""
    key = (device, B, S_q, H, D, d_v, topk, q_dtype, config, fp8, splits, rows_per_split,
           has_sink, word_aligned, fp8_hw)
    launches = _LAUNCHES.get(key)
    if launches is None:
        launches = _LAUNCHES[key] = MmaLaunches(
            device, B, S_q, H, D, d_v, topk, q_dtype, config, fp8=fp8, splits=splits,
            rows_per_split=rows_per_split, has_sink=has_sink, word_aligned=word_aligned,
            fp8_hw=fp8_hw)
    return launches


def sparse_mla_mma(q, kv, indices, sink, scale, d_v, config: Config, *, fp8=False,
                   num_splits=None, fp8_hw=None):
    """Launch the kernel (and the combine when split) -> (out [B, S_q, H, d_v], lse fp32).
    q [B, S_q, H, D]; kv [N, D] in q's dtype or uint8 [N, 584] (``fp8``); indices int32
    [B, S_q, topk]; sink fp32 [H] or None. ``num_splits`` default: :func:`plan_splits`;
    ``fp8_hw`` default: the hardware conversion on sm_89+ and in the interpreter."""
    B, S_q, H, D = q.shape
    topk = indices.shape[-1]
    dev = q.device
    if num_splits is None:
        block_h = min(config.block_h, max(16, triton.next_power_of_2(H)))
        splits, rows_per_split = plan_splits(B * S_q * triton.cdiv(H, block_h), topk,
                                             props(dev).sm_count)
    else:
        splits, rows_per_split = split_rows(num_splits, topk)
    if fp8_hw is None:
        fp8_hw = interpreting() or dev.type != "cuda" or props(dev).capability >= (8, 9)
    return mma_launches(dev, B, S_q, H, D, d_v, topk, q.dtype, config, fp8=fp8, splits=splits,
                        rows_per_split=rows_per_split, has_sink=sink is not None,
                        word_aligned=kv.data_ptr() % 8 == 0, fp8_hw=bool(fp8_hw))(
        q, kv, indices, sink, scale)
