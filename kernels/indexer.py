"""
Lightning indexer: paged logits and an O(actual length) top-k, safe inside CUDA graphs
======================================================================================

The idea
--------
For decode row ``r = (b, s)`` and each visible key entry ``j < context_lens[b, s]``::

    logit[r, j] = k_scale[j] * sum_h w[r, h] * ReLU(q[r, h] . k[j])

The keys live in a paged cache ``k_cache [P, page, D]``: logical entry ``j`` of batch
row ``b`` sits in physical page ``block_table[b, j // page]`` at offset ``j % page``.

The campaign's fallback scored every position up to the configured maximum context
(262,144 c4 entries at 1M tokens) and ran ``torch.topk`` over that width, so a request
holding 512 tokens paid for a million. These kernels cost O(actual length):

1. ``_indexer_logits_kernel``: a FIXED grid of (rows, NUM_SPLITS) programs, chosen from
   the shapes only. Each program reads its row's visible length from ``context_lens`` ON
   THE DEVICE and walks the row's tiles ``split, split + NUM_SPLITS, ...`` only up to the
   last visible page (per-page early exit); programs with nothing to do return at once.
   A tile gathers BLOCK_N keys through the block table, computes the
   [heads x BLOCK_N] dot with ``q`` on tensor cores (FP8 e4m3 x e4m3 on sm_89+; keys and
   queries upcast to bf16 elsewhere, to fp32 in the interpreter, whose bf16 ``tl.dot`` is
   wrong), then ReLU, the head weights, the head sum and the key scale.
2. ``_topk_kernel``: one program per row. If the row sees ``n <= topk`` entries it writes
   positions 0..n-1 and pads -1 (the common decode case: no sort at all). Otherwise a
   4-pass radix select over the order-preserving uint32 image of the fp32 logits (8 bits
   a pass, a 256-bin histogram of the entries that still match the prefix) finds the
   k-th largest key; a last pass writes every position above it and as many of the ties
   as are needed, in position order, compacted with a prefix sum. Every pass reads only
   the ``n`` visible logits.

Neither kernel reads a length on the host, allocates by length or changes its grid with
the data, so one captured CUDA graph serves every context length and block table
written into the same buffers.

Explained in notebooks/03_indexer_capping.ipynb.
"""
import os

import torch
import triton
import triton.language as tl

# How the indexer matmul runs (DOT_MODE): the wider of q's and k's dtypes.
DOT_FP8 = 0    # e4m3 x e4m3 tensor-core dot, fp32 accumulate (sm_89+)
DOT_BF16 = 1   # operands upcast to bf16 (e4m3 -> bf16 is exact), fp32 accumulate
DOT_FP32 = 2   # operands upcast to fp32, IEEE fp32 dot (no TF32)
DOT_NAMES = {DOT_FP8: "fp8", DOT_BF16: "bf16", DOT_FP32: "fp32"}


@triton.jit
def _e4m3_bits_to_f32(x):
    """e4m3fn bytes (uint8) -> fp32, for GPUs without an fp8 type (sm_80): the 7 magnitude
    bits shifted into an fp16 are the value times 2^-8, subnormals included."""
    x = x.to(tl.int16)
    h = ((x & 0x80) << 8) | ((x & 0x7F) << 7)
    return h.to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def _indexer_logits_kernel(
        q_ptr, k_ptr, ks_ptr, w_ptr, bt_ptr, cl_ptr, out_ptr,
        S, H, L, n_bound,
        stride_qb, stride_qs, stride_qh,
        stride_wb, stride_ws,
        stride_btb,
        stride_clb, stride_cls,
        D: tl.constexpr, PAGE: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
        DOT_MODE: tl.constexpr, FILL_TAIL: tl.constexpr,
        Q_U8: tl.constexpr, K_U8: tl.constexpr):
    row = tl.program_id(0)          # b * S + s
    split = tl.program_id(1)
    b = row // S
    s = row % S
    # visible entries of this query, read on the device (clamped: never out of bounds)
    n = tl.load(cl_ptr + b * stride_clb + s * stride_cls)
    n = tl.minimum(tl.maximum(n, 0), n_bound)
    n_tiles = tl.cdiv(n, BLOCK_N)
    out_row = out_ptr + row.to(tl.int64) * L
    offs_n = tl.arange(0, BLOCK_N)

    if split < n_tiles:             # early exit: a program past the row's last page does nothing
        offs_h = tl.arange(0, H_PAD)
        offs_d = tl.arange(0, D_PAD)
        h_ok = offs_h < H
        d_ok = offs_d < D
        q = tl.load(q_ptr + b * stride_qb + s * stride_qs + offs_h[:, None] * stride_qh
                    + offs_d[None, :], mask=h_ok[:, None] & d_ok[None, :], other=0.0)
        w = tl.load(w_ptr + b * stride_wb + s * stride_ws + offs_h, mask=h_ok, other=0.0)
        if Q_U8:
            q = _e4m3_bits_to_f32(q)
        if DOT_MODE == 1:
            q = q.to(tl.bfloat16)
        elif DOT_MODE == 2:
            q = q.to(tl.float32)
        bt_row = bt_ptr + b * stride_btb
        for t in range(split, n_tiles, NUM_SPLITS):
            pos = t * BLOCK_N + offs_n
            vis = pos < n
            phys = tl.load(bt_row + pos // PAGE, mask=vis, other=0)
            slot = phys.to(tl.int64) * PAGE + pos % PAGE
            k = tl.load(k_ptr + slot[:, None] * D + offs_d[None, :],
                        mask=vis[:, None] & d_ok[None, :], other=0.0)
            ks = tl.load(ks_ptr + slot, mask=vis, other=0.0)
            if K_U8:
                k = _e4m3_bits_to_f32(k)
            if DOT_MODE == 0:
                acc = tl.dot(q, tl.trans(k))                              # [H_PAD, BLOCK_N]
            elif DOT_MODE == 1:
                acc = tl.dot(q, tl.trans(k.to(tl.bfloat16)))
            else:
                acc = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            acc = tl.maximum(acc, 0.0) * w[:, None]
            logit = tl.sum(acc, axis=0) * ks
            logit = tl.where(vis, logit, float("-inf"))
            tl.store(out_row + pos, logit, mask=pos < L)

    if FILL_TAIL:                   # the public logits op returns all L columns (-inf tail)
        n_all = tl.cdiv(L, BLOCK_N)
        first = n_tiles + (split + NUM_SPLITS - n_tiles % NUM_SPLITS) % NUM_SPLITS
        for t in range(first, n_all, NUM_SPLITS):
            pos = t * BLOCK_N + offs_n
            tl.store(out_row + pos, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=pos < L)


@triton.jit
def _sortable(x):
    """fp32 -> uint32 with the same order (larger float, larger key)."""
    bits = x.to(tl.int32, bitcast=True)
    u = x.to(tl.uint32, bitcast=True)
    flip = tl.where(bits < 0, 0xFFFFFFFF, 0x80000000).to(tl.uint32)
    return u ^ flip


@triton.jit
def _topk_kernel(logits_ptr, cl_ptr, out_ptr,
                 S, stride_lr, n_bound,
                 stride_clb, stride_cls,
                 TOPK: tl.constexpr, BLOCK: tl.constexpr, FILL: tl.constexpr):
    row = tl.program_id(0)
    b = row // S
    s = row % S
    n = tl.load(cl_ptr + b * stride_clb + s * stride_cls)
    n = tl.minimum(tl.maximum(n, 0), n_bound)
    out_row = out_ptr + row.to(tl.int64) * TOPK
    lrow = logits_ptr + row.to(tl.int64) * stride_lr

    if n <= TOPK:
        # fast path: every visible entry is kept; no logits read at all
        for start in range(0, TOPK, FILL):
            o = start + tl.arange(0, FILL)
            tl.store(out_row + o, tl.where(o < n, o, -1), mask=o < TOPK)
    else:
        offs = tl.arange(0, BLOCK)
        bins = tl.arange(0, 256)
        prefix = tl.full([], 0, tl.uint32)
        pmask = tl.full([], 0, tl.uint32)
        remaining = tl.full([], TOPK, tl.int32)   # how many still to pick among the matches
        for p in tl.static_range(4):
            shift = 24 - 8 * p
            hist = tl.zeros([256], tl.int32)
            for start in range(0, n, BLOCK):
                pos = start + offs
                vis = pos < n
                key = _sortable(tl.load(lrow + pos, mask=vis, other=0.0))
                match = vis & ((key & pmask) == prefix)
                digit = ((key >> shift) & 0xFF).to(tl.int32)
                hist += tl.histogram(digit, 256, mask=match)
            # entries whose digit is >= d, for each d (non-increasing in d)
            ge = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
            d_star = tl.sum((ge >= remaining).to(tl.int32), axis=0) - 1
            above = tl.sum(tl.where(bins == d_star, ge - hist, 0), axis=0)
            remaining -= above
            prefix = prefix | (d_star.to(tl.uint32) << shift)
            pmask = pmask | (tl.full([], 0xFF, tl.uint32) << shift)
        # prefix is now the k-th largest key; take all above it and `remaining` ties
        emitted = tl.full([], 0, tl.int32)
        ties = tl.full([], 0, tl.int32)
        for start in range(0, n, BLOCK):
            pos = start + offs
            vis = pos < n
            key = _sortable(tl.load(lrow + pos, mask=vis, other=0.0))
            gt = vis & (key > prefix)
            eq = vis & (key == prefix)
            eq_i = eq.to(tl.int32)
            take = gt | (eq & (ties + tl.cumsum(eq_i, axis=0) - 1 < remaining))
            take_i = take.to(tl.int32)
            slot = emitted + tl.cumsum(take_i, axis=0) - 1
            tl.store(out_row + slot, pos, mask=take)
            emitted += tl.sum(take_i, axis=0)
            ties += tl.sum(eq_i, axis=0)


# ------------------------------------------------------------------------ launchers

_SM_COUNT = {}


def _sm_count(device) -> int:
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _interpreting(device) -> bool:
    return device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dot_mode(q_dtype, k_dtype, device) -> int:
    """DOT_FP8 / DOT_BF16 / DOT_FP32 for these operand dtypes on ``device``.

    The matmul runs in the wider of the two dtypes (fp8 < bf16 < fp32). FP8 tensor-core
    dots need sm_89+; elsewhere fp8 operands are upcast to bf16 (exactly). Under the
    interpreter fp8 and bf16 both run as fp32 (its bf16 ``tl.dot`` returns garbage).
    """
    rank = {torch.float8_e4m3fn: 0, torch.bfloat16: 1, torch.float32: 2}
    r = max(rank[q_dtype], rank[k_dtype])
    if r == 2:
        return DOT_FP32
    if _interpreting(device):
        return DOT_FP32
    if r == 0 and torch.cuda.get_device_capability(device) >= (8, 9):
        return DOT_FP8
    return DOT_BF16


def _logits_config(mode: int, D_PAD: int) -> dict:
    if mode == DOT_FP32:
        return dict(BLOCK_N=64, num_warps=4, num_stages=2)
    if mode == DOT_BF16:
        return dict(BLOCK_N=64 if D_PAD > 128 else 128, num_warps=4, num_stages=3)
    return dict(BLOCK_N=128, num_warps=4, num_stages=3)


def _launch_logits(q, k_cache, k_scale, weights, block_table, context_lens, out, L,
                   fill_tail: bool, fp8_bytes=None):
    B, S, H, D = q.shape
    P, page, _ = k_cache.shape
    if q.stride(3) != 1:
        q = q.contiguous()
    k_cache = k_cache.contiguous()
    k_scale = k_scale.contiguous()
    weights = weights if weights.stride(2) == 1 else weights.contiguous()
    block_table = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    mode = dot_mode(q.dtype, k_cache.dtype, q.device)
    # GPUs before sm_89 have no e4m3 type in Triton: pass the bytes, decode in the kernel
    no_fp8 = fp8_bytes if fp8_bytes is not None else (
        not _interpreting(q.device) and torch.cuda.get_device_capability(q.device) < (8, 9))
    if no_fp8 and mode == DOT_FP8:
        mode = DOT_FP32 if _interpreting(q.device) else DOT_BF16
    q_u8 = no_fp8 and q.dtype == torch.float8_e4m3fn
    k_u8 = no_fp8 and k_cache.dtype == torch.float8_e4m3fn
    q_arg = q.view(torch.uint8) if q_u8 else q
    k_arg = k_cache.view(torch.uint8) if k_u8 else k_cache
    H_PAD = max(16, triton.next_power_of_2(H))
    D_PAD = max(32, triton.next_power_of_2(D))
    cfg = _logits_config(mode, D_PAD)
    BLOCK_N = cfg["BLOCK_N"]
    if _interpreting(q.device):
        BLOCK_N = 16
    rows = B * S
    n_tiles_max = triton.cdiv(L, BLOCK_N)
    # fixed by the shapes alone (never by context_lens): ~4 programs per SM in all
    splits = max(1, min(n_tiles_max, triton.cdiv(4 * _sm_count(q.device), rows)))
    n_bound = min(L, block_table.shape[1] * page)
    _indexer_logits_kernel[(rows, splits)](
        q_arg, k_arg, k_scale, weights, block_table, context_lens, out,
        S, H, L, n_bound,
        q.stride(0), q.stride(1), q.stride(2),
        weights.stride(0), weights.stride(1),
        block_table.stride(0),
        context_lens.stride(0), context_lens.stride(1),
        D=D, PAGE=page, H_PAD=H_PAD, D_PAD=D_PAD, BLOCK_N=BLOCK_N, NUM_SPLITS=splits,
        DOT_MODE=mode, FILL_TAIL=fill_tail, Q_U8=q_u8, K_U8=k_u8,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


def indexer_logits(q, k_cache, k_scale, weights, block_table, context_lens, L, *, fp8_bytes=None):
    """Logits [B, S_q, L] fp32, -inf beyond each query's visible length.

    Inputs as :func:`dsv4lab.ops.indexer_logits` (already checked there). Writes every
    one of the L columns (the -inf tail too), so its cost has an O(L) store part.
    ``fp8_bytes=True`` forces the sm_80 path (e4m3 passed as bytes, decoded in-kernel).
    """
    B, S = q.shape[:2]
    out = torch.empty((B, S, L), dtype=torch.float32, device=q.device)
    return _launch_logits(q, k_cache, k_scale, weights, block_table, context_lens, out, L, True,
                          fp8_bytes)


def indexer_topk(q, k_cache, k_scale, weights, block_table, context_lens, L, topk, *,
                 fp8_bytes=None):
    """Top-``topk`` logical positions int32 [B, S_q, topk], -1 padded; O(actual length).

    The logits go to an uninitialised [B, S_q, L] scratch of which only each row's
    visible prefix is written and read; the grids depend on shapes only, nothing reads
    back to the host: capturable in a CUDA graph.
    """
    B, S = q.shape[:2]
    scratch = torch.empty((B, S, L), dtype=torch.float32, device=q.device)
    _launch_logits(q, k_cache, k_scale, weights, block_table, context_lens, scratch, L, False,
                   fp8_bytes)
    out = torch.empty((B, S, topk), dtype=torch.int32, device=q.device)
    interp = _interpreting(q.device)
    BLOCK = 64 if interp else 2048
    FILL = min(triton.next_power_of_2(topk), 64 if interp else 1024)
    n_bound = min(L, block_table.shape[1] * k_cache.shape[1])
    _topk_kernel[(B * S,)](
        scratch, context_lens, out,
        S, L, n_bound,
        context_lens.stride(0), context_lens.stride(1),
        TOPK=topk, BLOCK=BLOCK, FILL=FILL, num_warps=4 if interp else 8)
    return out
