"""Sparse MLA decode, lesson 1: one program per (query position, head), on the CUDA cores.

Each program walks its query's ``topk`` selected slots in blocks of ``BLOCK_N``, gathers those
latent rows, and computes the dots and the weighted sum with elementwise multiplies and
reductions, keeping an online softmax (running max and sum, fp32). Nothing is shared between
heads, so with DeepSeek-V4's 64 heads every row is fetched 64 times and the tensor cores sit
idle (notebooks/01_simt_baseline.ipynb); lesson 2 (``mma.py``) is the fix.

Both lessons: scores in base 2 (``q.k * scale * log2(e)``, then ``exp2``); slot -1 adds nothing,
a duplicate counts twice; a sink adds ``exp(sink[h])`` to the denominator only; ``lse`` is the
natural log of the denominator (-inf for nothing to attend to and no sink).
"""
import torch
import triton
import triton.language as tl


LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def trim_tail(idx_ptr, start, end, SCAN_N: tl.constexpr):
    """One past the last valid slot of ``idx_ptr[start:end]`` (``start`` if none), scanning back
    ``SCAN_N`` slots at a time: a list's -1 tail costs no tile (a dense list, one load)."""
    last = tl.zeros([], tl.int32) + (start - 1)
    hi = end
    while (hi > start) & (last < start):
        offs = hi - SCAN_N + tl.arange(0, SCAN_N)
        ic = tl.load(idx_ptr + offs, mask=(offs >= start) & (offs < hi), other=-1)
        last = tl.maximum(last, tl.max(tl.where(ic >= 0, offs, start - 1), axis=0))
        hi -= SCAN_N
    return last + 1


@triton.jit
def _sparse_mla_simt_kernel(
    q_ptr, kv_ptr, idx_ptr, sink_ptr, out_ptr, lse_ptr,
    H, topk, qk_scale,                       # qk_scale = softmax_scale * log2(e)
    D: tl.constexpr, DV: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SINK: tl.constexpr, SCAN_N: tl.constexpr,
):
    pid = tl.program_id(0)                   # one program per (b * S_q + s) * H + h
    bs = pid // H
    h = pid % H
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    v_mask = offs_d < DV
    q = tl.load(q_ptr + pid.to(tl.int64) * D + offs_d, mask=d_mask, other=0.0).to(tl.float32)

    m_i = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), axis=0)   # running max
    l_i = tl.sum(tl.zeros([BLOCK_N], tl.float32), axis=0)                 # running sum
    acc = tl.zeros([BLOCK_D], tl.float32)
    end = trim_tail(idx_ptr + bs.to(tl.int64) * topk, 0, topk, SCAN_N)    # drop a -1 tail
    for n0 in range(0, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_ptr + bs.to(tl.int64) * topk + offs_n, mask=offs_n < end, other=-1)
        valid = idx >= 0
        rows = tl.where(valid, idx, 0).to(tl.int64)
        k = tl.load(kv_ptr + rows[:, None] * D + offs_d[None, :],
                    mask=valid[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1) * qk_scale                 # CUDA-core dot
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        v = tl.where(v_mask[None, :], k, 0.0)                        # V = K[:, :DV]
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new

    if HAS_SINK:
        sk = tl.load(sink_ptr + h).to(tl.float32) * 1.4426950408889634
        m_f = tl.maximum(m_i, sk)
        a = tl.exp2(m_i - m_f)
        denom = l_i * a + tl.exp2(sk - m_f)
        o = acc * (a / denom)
        lse = (m_f + tl.log2(denom)) * 0.6931471805599453
    else:
        has = l_i > 0
        o = acc / tl.where(has, l_i, 1.0)
        lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453,
                       float("-inf"))
    tl.store(out_ptr + pid.to(tl.int64) * DV + offs_d, o.to(out_ptr.dtype.element_ty), mask=v_mask)
    tl.store(lse_ptr + pid, lse)


def sparse_mla_simt(q, kv, indices, sink, scale, d_v, *, block_n=None, num_warps=4):
    """Launch the SIMT kernel. q [B, S_q, H, D], kv [N, D] (contiguous), indices int32
    [B, S_q, topk], sink fp32 [H] or None -> (out [B, S_q, H, d_v], lse fp32 [B, S_q, H])."""
    B, S_q, H, D = q.shape
    topk = indices.shape[-1]
    out = torch.empty(B, S_q, H, d_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, S_q, H, dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(D)
    if block_n is None:
        # keep the gathered [BLOCK_N, BLOCK_D] fp32 tile at about 8K values
        block_n = max(1, min(64, 8192 // block_d, triton.next_power_of_2(topk)))
    grid = (B * S_q * H,)
    _sparse_mla_simt_kernel[grid](
        q, kv, indices, sink if sink is not None else lse, out, lse,
        H, topk, scale * LOG2E,
        D=D, DV=d_v, BLOCK_D=block_d, BLOCK_N=block_n, HAS_SINK=sink is not None,
        SCAN_N=32 if q.device.type != "cuda" else 512,
        num_warps=num_warps,
    )
    return out, lse
