"""A portable FP4 mixture-of-experts in Triton (MXFP4 and NVFP4 experts).

The idea. Decode-time MoE is a weight-streaming problem: at T = 1 each of the 6 experts
hit reads 3 * 2048 * 4096 FP4 weights (6.3 MB with scales) to do 2 FLOPs per weight for
one token. So the kernel is built around reading every packed weight byte of an expert
exactly once and applying it to all the tokens routed to that expert:

1. group the (token, expert) pairs by expert into blocks of at most BM rows
   (:mod:`dsv4lab.kernels.moe_align`; fixed upper bound on the block count, no host sync);
2. ``_moe_gate_up_kernel``: one program per (block, tile of BN intermediate columns)
   gathers the block's rows of x, streams the gate AND up rows of its tile in 16-byte
   loads, decodes the FP4 nibbles in registers, accumulates both GEMMs and writes
   ``act = silu(min(g, L)) * clamp(u, -L, L)`` (or ``silu(g) * u``);
3. ``_moe_down_kernel``: one program per (block, tile of BN hidden columns) streams the
   down-projection rows and writes each pair's row times its routing weight;
4. ``_moe_combine_kernel`` sums the k rows of each token (a deterministic second pass,
   no atomics) and skips pairs whose expert id is -1.

Decoding a nibble without a table. A nibble ``c`` is sign | e1 e0 | m. Put its three
magnitude bits at bits 9..11 of a 16-bit word and its sign at bit 15, and the word, read
as an fp16, is exactly ``value(c) * 2**-14`` (codes 0 and 1 land in fp16 subnormals, which
is exactly how E2M1 treats e = 0). Every E2M1 value is exact in fp16, so the tensor-core
dot sees exact weights. The even and odd elements of a row live in the low and high
nibbles, so instead of interleaving them we split x into its even and odd columns:
``x . w = x_even . w_lo + x_odd . w_hi``.

Scales. MXFP4 has one power of two per 32 weights of a row, so per 32-element group the
two dots (K = 16 each) are computed in fp32 and multiplied by ``2**(s-127)`` (built from
the scale byte's bits) per output column. NVFP4 has one E4M3 scale per 16: the fp16
product ``(value * 2**-14) * scale`` is exact, so the scale is applied to the weights and
the dot accumulates directly; the fp32 global scale multiplies the result once. x (and
the activations) enter the dot as fp16 scaled by 2**-8 (|x| < 1.6e7), undone at the end.

Everything runs on sm_80, sm_90 and sm_120 alike (plain loads, integer ops, ``tl.dot``
on fp16) and in Triton's interpreter; under the interpreter the dot operands are upcast
to fp32 (a constexpr flag) as the workbook does for every kernel.

Explained in notebooks/04_mxfp4_moe_port.ipynb.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from dsv4lab.kernels.moe_align import moe_align, num_blocks_max

X_PRESCALE = 2.0 ** -8      # x and activations enter the fp16 dot scaled by this
W_OFFSET = 2.0 ** -14       # the fp16 bit trick yields value * 2**-14
UNDO = 2.0 ** 22            # 1 / (X_PRESCALE * W_OFFSET)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


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


@triton.jit
def _e4m3_bits_to_f32(b):
    """E4M3 scale bytes (read as uint8: sm_80 has no e4m3 type) -> fp32, exactly.

    Bits s eeee mmm placed as fp16 s 0eeee mmm0000000 read ``value * 2**-8`` (e = 0 lands on
    fp16 subnormals just as E4M3's subnormals do)."""
    b = b.to(tl.int16)
    bits = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
    return bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def _group_dot(acc, xe, xo, p, s_a, s_b, kb, IS_NV: tl.constexpr, DOT_FP32: tl.constexpr):
    """acc + x_even . w_lo + x_odd . w_hi for one 32-element group of BN weight rows.

    p: packed bytes [16, BN]; MXFP4: s_a = 2**(s-127) fp32 [BN] (s_b unused);
    NVFP4: s_a, s_b = the two E4M3 block scales [BN] as fp32 (elements 0-15 and 16-31).
    """
    wlo = _e2m1_lo(p)
    whi = _e2m1_hi(p)
    if IS_NV:
        sc = tl.where(kb[:, None] < 8, s_a[None, :], s_b[None, :]).to(tl.float16)
        wlo = wlo * sc
        whi = whi * sc
        if DOT_FP32:
            acc = tl.dot(xe.to(tl.float32), wlo.to(tl.float32), acc)
            acc = tl.dot(xo.to(tl.float32), whi.to(tl.float32), acc)
        else:
            acc = tl.dot(xe, wlo, acc)
            acc = tl.dot(xo, whi, acc)
    else:
        if DOT_FP32:
            d = tl.dot(xe.to(tl.float32), wlo.to(tl.float32))
            d = tl.dot(xo.to(tl.float32), whi.to(tl.float32), d)
        else:
            d = tl.dot(xe, wlo)
            d = tl.dot(xo, whi, d)
        acc += d * s_a[None, :]
    return acc


@triton.jit
def _load_group(w_rows, s_rows, x_rows, kb, g, nmask, mmask, IS_NV: tl.constexpr):
    """Packed bytes [16, BN], scales and x even/odd [BM, 16] of 32-element group g."""
    p = tl.load(w_rows + g * 16, mask=nmask[None, :], other=0)
    if IS_NV:
        s_a = _e4m3_bits_to_f32(tl.load(s_rows + 2 * g, mask=nmask, other=0))
        s_b = _e4m3_bits_to_f32(tl.load(s_rows + 2 * g + 1, mask=nmask, other=0))
    else:
        sbyte = tl.load(s_rows + g, mask=nmask, other=0).to(tl.int32)
        s_a = (sbyte << 23).to(tl.float32, bitcast=True)     # 2**(s-127); byte 0 -> 0
        s_b = s_a
    xe = tl.load(x_rows + g * 32, mask=mmask[:, None], other=0.0).to(tl.float32)
    xo = tl.load(x_rows + g * 32 + 1, mask=mmask[:, None], other=0.0).to(tl.float32)
    xe = (xe * 0.00390625).to(tl.float16)
    xo = (xo * 0.00390625).to(tl.float16)
    return p, s_a, s_b, xe, xo


@triton.jit
def _moe_gate_up_kernel(x_ptr, w_ptr, s_ptr, gscale_ptr, sorted_pair_ptr,
                        block_expert_ptr, block_start_ptr, block_count_ptr, act_ptr,
                        I, TOPK, NG,
                        stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_act,
                        swiglu_limit,
                        IS_NV: tl.constexpr, HAS_LIMIT: tl.constexpr, DOT_FP32: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, G: tl.constexpr):
    b = tl.program_id(0)
    pn = tl.program_id(1)
    e = tl.load(block_expert_ptr + b)
    if e < 0:
        return
    start = tl.load(block_start_ptr + b)
    cnt = tl.load(block_count_ptr + b)
    offs_m = tl.arange(0, BM)
    mmask = offs_m < cnt
    pair = tl.load(sorted_pair_ptr + start + offs_m, mask=mmask, other=0)
    tok = (pair // TOPK).to(tl.int64)
    offs_n = pn * BN + tl.arange(0, BN)
    nmask = offs_n < I
    kb = tl.arange(0, 16)
    e64 = e.to(tl.int64)
    x_rows = x_ptr + tok[:, None] * stride_xt + 2 * kb[None, :]
    wg_rows = w_ptr + e64 * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + kb[:, None]
    wu_rows = wg_rows + I * stride_wn
    sg_rows = s_ptr + e64 * stride_se + offs_n.to(tl.int64) * stride_sn
    su_rows = sg_rows + I * stride_sn
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for g0 in range(0, NG, G):
        for gi in tl.static_range(G):
            g = g0 + gi
            p, s_a, s_b, xe, xo = _load_group(wg_rows, sg_rows, x_rows, kb, g, nmask, mmask, IS_NV)
            acc_g = _group_dot(acc_g, xe, xo, p, s_a, s_b, kb, IS_NV, DOT_FP32)
            p, s_a, s_b, xe, xo = _load_group(wu_rows, su_rows, x_rows, kb, g, nmask, mmask, IS_NV)
            acc_u = _group_dot(acc_u, xe, xo, p, s_a, s_b, kb, IS_NV, DOT_FP32)
    f = 4194304.0                                   # 2**22: undo x and weight offsets
    if IS_NV:
        f = f * tl.load(gscale_ptr + e)
    gate = acc_g * f
    up = acc_u * f
    if HAS_LIMIT:
        gate = tl.minimum(gate, swiglu_limit)
        up = tl.minimum(tl.maximum(up, -swiglu_limit), swiglu_limit)
    act = gate / (1.0 + tl.exp(-gate)) * up
    rows = (start + offs_m).to(tl.int64)
    tl.store(act_ptr + rows[:, None] * stride_act + offs_n[None, :], act,
             mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _moe_down_kernel(act_ptr, w_ptr, s_ptr, gscale_ptr, topk_w_ptr, sorted_pair_ptr,
                     block_expert_ptr, block_start_ptr, block_count_ptr, ypair_ptr,
                     H, NG,
                     stride_act, stride_we, stride_wn, stride_se, stride_sn, stride_y,
                     IS_NV: tl.constexpr, DOT_FP32: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, G: tl.constexpr):
    b = tl.program_id(0)
    pn = tl.program_id(1)
    e = tl.load(block_expert_ptr + b)
    if e < 0:
        return
    start = tl.load(block_start_ptr + b)
    cnt = tl.load(block_count_ptr + b)
    offs_m = tl.arange(0, BM)
    mmask = offs_m < cnt
    pair = tl.load(sorted_pair_ptr + start + offs_m, mask=mmask, other=0)
    offs_n = pn * BN + tl.arange(0, BN)
    nmask = offs_n < H
    kb = tl.arange(0, 16)
    e64 = e.to(tl.int64)
    a_rows = act_ptr + (start + offs_m).to(tl.int64)[:, None] * stride_act + 2 * kb[None, :]
    w_rows = w_ptr + e64 * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + kb[:, None]
    s_rows = s_ptr + e64 * stride_se + offs_n.to(tl.int64) * stride_sn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for g0 in range(0, NG, G):
        for gi in tl.static_range(G):
            g = g0 + gi
            p, s_a, s_b, xe, xo = _load_group(w_rows, s_rows, a_rows, kb, g, nmask, mmask, IS_NV)
            acc = _group_dot(acc, xe, xo, p, s_a, s_b, kb, IS_NV, DOT_FP32)
    f = 4194304.0
    if IS_NV:
        f = f * tl.load(gscale_ptr + e)
    wt = tl.load(topk_w_ptr + pair, mask=mmask, other=0.0).to(tl.float32)
    y = acc * f * wt[:, None]
    tl.store(ypair_ptr + pair.to(tl.int64)[:, None] * stride_y + offs_n[None, :], y,
             mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _moe_combine_kernel(ypair_ptr, ids_ptr, out_ptr, H, E, stride_y, stride_out,
                        TOPK: tl.constexpr, BH: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BH + tl.arange(0, BH)
    hmask = offs < H
    acc = tl.zeros((BH,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        eid = tl.load(ids_ptr + t * TOPK + j + offs * 0)      # broadcast: a vector mask
        ok = (eid >= 0) & (eid < E)
        row = (t * TOPK + j).to(tl.int64)
        acc += tl.load(ypair_ptr + row * stride_y + offs, mask=hmask & ok, other=0.0)
    tl.store(out_ptr + t.to(tl.int64) * stride_out + offs, acc.to(out_ptr.dtype.element_ty), mask=hmask)


# --------------------------------------------------------------------- launcher ----------
def _pick_g(ng: int, want: int) -> int:
    for g in (want, 4, 2, 1):
        if g <= want and ng % g == 0:
            return g
    return 1


def config_for(T: int, topk: int, E: int) -> dict:
    """Tile sizes: small BM and narrow N tiles (many programs) for decode; bigger for prefill."""
    P = T * topk
    avg_rows = P / max(E, 1)
    if avg_rows <= 16:
        cfg = dict(BM=16, BN1=32, BN2=64, G=4, num_warps=4, num_stages=4)
    else:
        cfg = dict(BM=64, BN1=64, BN2=128, G=2, num_warps=4, num_stages=3)
    if _interpreting():
        cfg.update(G=1, num_stages=1)
    return cfg


def fused_moe(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, *, fmt="mxfp4",
              w13_global=None, w2_global=None, swiglu_limit=None, config=None):
    """Launch the grouped FP4 MoE. Arguments as ``dsv4lab.ops.fused_moe`` (already checked;
    nvfp4 globals as fp32 [E] tensors). No host synchronisation: CUDA-graph capturable."""
    T, H = x.shape
    E, two_i, _ = w13.shape
    I = two_i // 2
    topk = topk_ids.shape[1]
    P = T * topk
    cfg = dict(config_for(T, topk, E), **(config or {}))
    BM = cfg["BM"]
    is_nv = fmt == "nvfp4"
    dev = x.device
    x = x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    w13_scale, w2_scale = w13_scale.contiguous(), w2_scale.contiguous()
    ids = topk_ids.contiguous()
    tw = topk_weights.reshape(-1).contiguous()
    dummy = torch.zeros(1, dtype=torch.float32, device=dev)
    g13 = w13_global.contiguous() if is_nv else dummy
    g2 = w2_global.contiguous() if is_nv else dummy
    if is_nv:   # E4M3 scales travel as raw bytes (decoded in the kernel; sm_80 has no e4m3 type)
        w13_scale, w2_scale = w13_scale.view(torch.uint8), w2_scale.view(torch.uint8)
    sorted_pair, block_expert, block_start, block_count = moe_align(ids, E, BM)
    nbm = block_expert.numel()
    act = torch.empty(P, I, dtype=torch.float32, device=dev)
    ypair = torch.empty(P, H, dtype=torch.float32, device=dev)
    out = torch.empty(T, H, dtype=x.dtype, device=dev)
    dot_fp32 = _interpreting()
    ng1, ng2 = H // 32, I // 32
    BN1, BN2 = cfg["BN1"], cfg["BN2"]
    _moe_gate_up_kernel[(nbm, triton.cdiv(I, BN1))](
        x, w13, w13_scale, g13, sorted_pair, block_expert, block_start, block_count, act,
        I, topk, ng1,
        x.stride(0), w13.stride(0), w13.stride(1), w13_scale.stride(0), w13_scale.stride(1),
        act.stride(0), float(swiglu_limit) if swiglu_limit is not None else 0.0,
        IS_NV=is_nv, HAS_LIMIT=swiglu_limit is not None, DOT_FP32=dot_fp32,
        BM=BM, BN=BN1, G=_pick_g(ng1, cfg["G"]),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    _moe_down_kernel[(nbm, triton.cdiv(H, BN2))](
        act, w2, w2_scale, g2, tw, sorted_pair, block_expert, block_start, block_count, ypair,
        H, ng2,
        act.stride(0), w2.stride(0), w2.stride(1), w2_scale.stride(0), w2_scale.stride(1),
        ypair.stride(0),
        IS_NV=is_nv, DOT_FP32=dot_fp32, BM=BM, BN=BN2, G=_pick_g(ng2, cfg["G"]),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    BH = min(1024, triton.next_power_of_2(H))
    _moe_combine_kernel[(T, triton.cdiv(H, BH))](
        ypair, ids, out, H, E, ypair.stride(0), out.stride(0), TOPK=topk, BH=BH, num_warps=4)
    return out
