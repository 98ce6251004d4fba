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
registers: e4m3 bytes are turned into fp16 by moving their bits (no fp8 hardware
needed, so the same code runs on sm_80), times the per-64 power-of-two scale; the 64
RoPE values are read as bf16. Fewer bytes per row, same math.

Launch configurations come from a small per-device table; on a GPU the first call for a
workload bucket times the few candidates and caches the winner (``_TUNED``), outside
CUDA-graph capture. In Triton's interpreter bf16 operands are upcast to fp32 before
``tl.dot`` (the interpreter's bf16 dot is wrong).
"""
import math

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
FP8_ROW_BYTES = 584      # 448 e4m3 + 64 bf16 + 7 ue8m0 scales + 1 pad
FP8_DIM = 512


@triton.jit
def _load_kv_tile(kv_ptr, rows, valid, offs_d, D: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr, FP8: tl.constexpr, KDTYPE: tl.constexpr):
    """Gather the latent rows ``rows`` ([BLOCK_N], int64) as a [BLOCK_N, BLOCK_D] tile."""
    if FP8:
        # view the 512 values as 8 groups of 64: groups 0..6 are e4m3 (scale per group),
        # group 7 is the bf16 RoPE part
        j = tl.arange(0, 8)[None, :, None]
        c = tl.arange(0, 64)[None, None, :]
        base = rows[:, None, None] * 584
        v3 = valid[:, None, None]
        nope = v3 & (j < 7)
        b = tl.load(kv_ptr + base + j * 64 + c, mask=nope, other=0).to(tl.int32)
        sc = tl.load(kv_ptr + base + 576 + j, mask=nope, other=127).to(tl.float32)
        # e4m3 -> fp16 by moving bits: sign to bit 15, exponent+mantissa to bits 7..13;
        # the fp16 value is the e4m3 value * 2^-8 (normals and subnormals alike)
        h16 = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True)
        val = h16.to(tl.float32) * tl.exp2(sc - 119.0)            # * 2^8 * 2^(s-127)
        rope_ptr = kv_ptr.to(tl.pointer_type(tl.bfloat16))
        rope = tl.load(rope_ptr + rows[:, None, None] * 292 + 224 + c,
                       mask=v3, other=0.0).to(tl.float32)           # [BLOCK_N, 1, 64]
        k3 = tl.where(j < 7, val, rope)
        k = tl.reshape(k3, [BLOCK_N, BLOCK_D]).to(KDTYPE)
    else:
        k = tl.load(kv_ptr + rows[:, None] * D + offs_d[None, :],
                    mask=valid[:, None] & (offs_d[None, :] < D), other=0.0).to(KDTYPE)
    return k


@triton.jit
def _sparse_mla_mma_kernel(
    q_ptr, kv_ptr, idx_ptr, sink_ptr, out_ptr, lse_ptr, opart_ptr, lpart_ptr,
    H, topk, n_hblk, num_splits, split_rows, qk_scale,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, V_FROM_K: tl.constexpr,
    FP8: tl.constexpr, HAS_SINK: tl.constexpr, SPLIT: tl.constexpr,
    KDTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
):
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
    q = tl.load(q_ptr + (bs * H + offs_h)[:, None] * D + offs_d[None, :],
                mask=h_mask[:, None] & (offs_d[None, :] < D), other=0.0).to(KDTYPE)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    start = sp * split_rows
    end = tl.minimum(start + split_rows, topk)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_ptr + bs * topk + offs_n, mask=offs_n < end, other=-1)
        valid = idx >= 0
        rows = tl.where(valid, idx, 0).to(tl.int64)
        k = _load_kv_tile(kv_ptr, rows, valid, offs_d, D, BLOCK_N, BLOCK_D, FP8, KDTYPE)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if V_FROM_K:
            if DV < BLOCK_D:
                v = tl.where(offs_d[None, :] < DV, k, 0.0).to(KDTYPE)
            else:
                v = k
        else:
            v = tl.load(kv_ptr + rows[:, None] * D + offs_v[None, :],
                        mask=valid[:, None] & (offs_v[None, :] < DV), other=0.0).to(KDTYPE)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(KDTYPE), v, acc, input_precision=DOT_PREC)
        m_i = m_new

    has = l_i > 0
    if SPLIT:
        # partial: normalised output and base-2 log-sum-exp of this split (-inf if empty)
        o = acc / tl.where(has, l_i, 1.0)[:, None]
        lse2 = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        prow = (bs * num_splits + sp) * H + offs_h
        tl.store(opart_ptr + prow[:, None] * DV + offs_v[None, :], o,
                 mask=h_mask[:, None] & (offs_v[None, :] < DV))
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
                 mask=h_mask[:, None] & (offs_v[None, :] < DV))
        tl.store(lse_ptr + orow, lse, mask=h_mask)


@triton.jit
def _combine_kernel(opart_ptr, lpart_ptr, sink_ptr, out_ptr, lse_ptr, H, num_splits,
                    DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr,
                    HAS_SINK: tl.constexpr):
    """Merge the split partials of one (query position, head): weights 2^(lse_i - max)."""
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


# ----------------------------------------------------------------------------------------
# Launcher: split heuristic, per-device configuration table, cached tuning
# ----------------------------------------------------------------------------------------

# Candidate (BLOCK_N, num_warps, num_stages) per (capability major, BLOCK_H). The first
# entry is the untuned default. A [64, 512] fp32 accumulator needs 8 warps (128
# registers a thread); Hopper/Blackwell datacenter parts have 227 KB of shared memory,
# sm_80 164 KB, sm_120 99 KB, so the smaller parts get shallower pipelines.
_CONFIGS = {
    "big_smem": {64: [(32, 8, 2), (64, 8, 2), (32, 8, 3)],
                 32: [(32, 4, 2), (64, 4, 2), (32, 8, 2)],
                 16: [(32, 4, 2), (64, 4, 2), (32, 4, 3)]},
    "small_smem": {64: [(32, 8, 1), (16, 8, 2), (32, 8, 2)],
                   32: [(32, 4, 1), (32, 4, 2), (16, 4, 2)],
                   16: [(32, 4, 1), (32, 4, 2), (16, 4, 2)]},
}
_TUNED: dict = {}          # (device, workload key) -> (BLOCK_N, num_warps, num_stages)
_SM_COUNT: dict = {}
INTERPRETER_BLOCK_N = 16   # small tiles in the interpreter so topk spans several of them
SPLIT_ROWS_MULTIPLE = 64   # split ranges are multiples of every BLOCK_N candidate


def _is_interpreter():
    import os
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _sm_count(device) -> int:
    if device.type != "cuda":
        return 8           # the interpreter: pretend a small GPU so split-KV gets exercised
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SM_COUNT:
        _SM_COUNT[key] = torch.cuda.get_device_properties(key).multi_processor_count
    return _SM_COUNT[key]


def plan_splits(n_programs: int, topk: int, sm_count: int) -> tuple[int, int]:
    """(num_splits, split_rows): split topk when there are too few programs to fill
    the GPU; each split covers a multiple of 64 slots."""
    if n_programs >= 0.75 * sm_count:
        return 1, topk
    want = max(1, sm_count // n_programs)
    most = max(1, topk // SPLIT_ROWS_MULTIPLE)
    splits = min(want, most)
    if splits <= 1:
        return 1, topk
    rows = triton.cdiv(triton.cdiv(topk, splits), SPLIT_ROWS_MULTIPLE) * SPLIT_ROWS_MULTIPLE
    splits = triton.cdiv(topk, rows)
    return (splits, rows) if splits > 1 else (1, topk)


def _candidates(device, block_h):
    major = torch.cuda.get_device_capability(device)[0] if device.type == "cuda" else 9
    table = _CONFIGS["big_smem" if major in (9, 10) else "small_smem"]
    return table[block_h]


def _bucket(x: int) -> int:
    return int(math.log2(max(1, x)))


def sparse_mla_mma(q, kv, indices, sink, scale, d_v, *, fp8=False, num_splits=None,
                   config=None, tune=True):
    """Launch the MMA kernel (and the combine kernel when split).

    q [B, S_q, H, D]; kv [N, D] in q's dtype, or uint8 [N, 584] with ``fp8``; indices int32
    [B, S_q, topk]; sink fp32 [H] or None -> (out [B, S_q, H, d_v] q.dtype, lse fp32).
    ``num_splits`` and ``config`` = (BLOCK_N, num_warps, num_stages) override the plan.
    """
    B, S_q, H, D = q.shape
    topk = indices.shape[-1]
    dev = q.device
    interp = _is_interpreter()
    out = torch.empty(B, S_q, H, d_v, dtype=q.dtype, device=dev)
    lse = torch.empty(B, S_q, H, dtype=torch.float32, device=dev)

    block_h = min(64, max(16, triton.next_power_of_2(H)))
    n_hblk = triton.cdiv(H, block_h)
    block_d = max(16, triton.next_power_of_2(D))      # tl.dot needs K >= 16
    if fp8:
        assert D == FP8_DIM and kv.shape[-1] == FP8_ROW_BYTES
    v_from_k = max(16, triton.next_power_of_2(d_v)) == block_d or fp8
    block_dv = block_d if v_from_k else max(16, triton.next_power_of_2(d_v))
    n_prog = B * S_q * n_hblk
    if num_splits is None:
        splits, split_rows = plan_splits(n_prog, topk, _sm_count(dev))
    else:
        splits = max(1, min(int(num_splits), triton.cdiv(topk, SPLIT_ROWS_MULTIPLE)))
        split_rows = triton.cdiv(triton.cdiv(topk, splits), SPLIT_ROWS_MULTIPLE) * SPLIT_ROWS_MULTIPLE
        splits = triton.cdiv(topk, split_rows)
    split = splits > 1
    if split:
        opart = torch.empty(B * S_q * splits * H * d_v, dtype=torch.float32, device=dev)
        lpart = torch.empty(B * S_q * splits * H, dtype=torch.float32, device=dev)
    else:
        opart = lpart = lse       # unused
    upcast = interp and q.dtype == torch.bfloat16
    kdtype = tl.float32 if (upcast or q.dtype == torch.float32) else \
        (tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float16)
    dot_prec = "ieee" if kdtype == tl.float32 else "tf32"
    tune_key = _bucket(n_prog * splits) * 32 + _bucket(split_rows)
    grid = (n_prog * splits,)

    def launch(cfg):
        bn, warps, stages = cfg
        _sparse_mla_mma_kernel[grid](
            q, kv, indices, sink if sink is not None else lse, out, lse, opart, lpart,
            H, topk, n_hblk, splits, split_rows, scale * LOG2E,
            D=D, DV=d_v, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_DV=block_dv, BLOCK_N=bn,
            V_FROM_K=v_from_k, FP8=fp8, HAS_SINK=sink is not None, SPLIT=split,
            KDTYPE=kdtype, DOT_PREC=dot_prec, num_warps=warps, num_stages=stages)

    if config is None:
        if interp or dev.type != "cuda":
            config = (INTERPRETER_BLOCK_N, 4, 1)
        else:
            config = _pick_config(dev, block_h, (block_h, D, d_v, fp8, split, str(q.dtype), tune_key),
                                  launch, tune)
    launch(config)
    if split:
        _combine_kernel[(B * S_q * H,)](
            opart, lpart, sink if sink is not None else lse, out, lse, H, splits,
            DV=d_v, BLOCK_DV=triton.next_power_of_2(d_v),
            BLOCK_S=max(2, triton.next_power_of_2(splits)), HAS_SINK=sink is not None,
            num_warps=4)
    return out, lse


def _pick_config(dev, block_h, key, launch, tune):
    """The cached winner for this workload bucket; times the candidates on first use
    (never while a CUDA graph is being captured: then the table's default is used)."""
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
