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
   the shapes only (about ``programs_per_sm`` programs per SM in all, so that thousands
   of tile loads are in flight even for 64 decode rows). Each program reads its row's
   visible length from ``context_lens`` ON THE DEVICE and walks its share of the row's
   tiles (every NUM_SPLITS-th tile, or one contiguous run) only up to the last visible
   page (per-page early exit); programs with nothing to do return at once. A tile
   gathers BLOCK_N keys through the block table (each key row is 128 contiguous bytes)
   and computes ``keys [BLOCK_N, D] @ q^T [D, heads]`` on tensor cores (FP8 e4m3 x e4m3
   on sm_89+; bf16 elsewhere, the e4m3 upcast being exact; fp32 in the interpreter, whose
   bf16 ``tl.dot`` is wrong). Keys are the dot's M side on purpose: the ReLU, head
   weights and the sum over the 64 heads then run along each accumulator row, inside a
   warp, with no cross-warp reduction per tile. The IEEE fp32 dot (CUDA cores) takes the
   head dim in BLOCK_D chunks: one [D = 128] operand would not fit in registers.
2. ``_topk_kernel``: one program per row. If the row sees ``n <= topk`` entries it writes
   positions 0..n-1 and pads -1 (the common decode case: no sort at all; the logits
   kernel does not even score such rows when it feeds the top-k). Otherwise a
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

import torch
import triton
import triton.language as tl

from dsv4lab.kernels.device import interpreting, sm_count

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
def _tile_dot(k, qt, DOT_MODE: tl.constexpr, FP32_PRECISION: tl.constexpr):
    """[BLOCK_N, Dc] keys x [Dc, H_PAD] queries -> fp32 [BLOCK_N, H_PAD]."""
    if DOT_MODE == 0:
        acc = tl.dot(k, qt)
    elif DOT_MODE == 1:
        acc = tl.dot(k.to(tl.bfloat16), qt)
    else:
        acc = tl.dot(k.to(tl.float32), qt, input_precision=FP32_PRECISION)
    return acc


@triton.jit
def _load_qt(q_row, offs_h, offs_c, h_ok, c_ok, stride_qh,
             DOT_MODE: tl.constexpr, Q_U8: tl.constexpr):
    """q's [H_PAD, Dc] slice, transposed to the dot's [Dc, H_PAD] operand in its dtype."""
    q = tl.load(q_row + offs_h[:, None] * stride_qh + offs_c[None, :],
                mask=h_ok[:, None] & c_ok[None, :], other=0.0)
    if Q_U8:
        q = _e4m3_bits_to_f32(q)
    if DOT_MODE == 1:
        q = q.to(tl.bfloat16)
    elif DOT_MODE == 2:
        q = q.to(tl.float32)
    return tl.trans(q)


@triton.jit
def _score_tile(t, qt, q_row, w, bt_row, k_ptr, ks_ptr, out_row, n, L,
                offs_n, offs_h, h_ok, stride_qh,
                D: tl.constexpr, PAGE: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                DOT_MODE: tl.constexpr, FP32_PRECISION: tl.constexpr,
                Q_U8: tl.constexpr, K_U8: tl.constexpr):
    """Score logical entries [t * BLOCK_N, (t + 1) * BLOCK_N) of one row and store them."""
    pos = t * BLOCK_N + offs_n
    vis = pos < n
    phys = tl.load(bt_row + pos // PAGE, mask=vis, other=0)
    slot = phys.to(tl.int64) * PAGE + pos % PAGE
    ks = tl.load(ks_ptr + slot, mask=vis, other=0.0)
    if BLOCK_D == D_PAD:
        # the whole head dim at once: q^T stays resident in the program
        offs_d = tl.arange(0, D_PAD)
        k = tl.load(k_ptr + slot[:, None] * D + offs_d[None, :],
                    mask=vis[:, None] & (offs_d < D)[None, :], other=0.0)
        if K_U8:
            k = _e4m3_bits_to_f32(k)
        acc = _tile_dot(k, qt, DOT_MODE, FP32_PRECISION)                # [BLOCK_N, H_PAD]
    else:
        # the CUDA-core fp32 dot: chunks of BLOCK_D dims keep its operands in registers
        acc = tl.zeros([BLOCK_N, H_PAD], dtype=tl.float32)
        for d0 in tl.static_range(0, D_PAD, BLOCK_D):
            offs_c = d0 + tl.arange(0, BLOCK_D)
            c_ok = offs_c < D
            k = tl.load(k_ptr + slot[:, None] * D + offs_c[None, :],
                        mask=vis[:, None] & c_ok[None, :], other=0.0)
            if K_U8:
                k = _e4m3_bits_to_f32(k)
            qc = _load_qt(q_row, offs_h, offs_c, h_ok, c_ok, stride_qh, DOT_MODE, Q_U8)
            acc += _tile_dot(k, qc, DOT_MODE, FP32_PRECISION)
    # ReLU, head weights, and the sum over heads: along the accumulator's rows (in-warp)
    logit = tl.sum(tl.maximum(acc, 0.0) * w[None, :], axis=1) * ks
    logit = tl.where(vis, logit, float("-inf"))
    tl.store(out_row + pos, logit, mask=pos < L)


@triton.jit
def _indexer_logits_kernel(
        q_ptr, k_ptr, ks_ptr, w_ptr, bt_ptr, cl_ptr, out_ptr,
        S, H, L, n_bound, skip_upto,
        stride_qb, stride_qs, stride_qh,
        stride_wb, stride_ws,
        stride_btb,
        stride_clb, stride_cls,
        D: tl.constexpr, PAGE: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
        CONTIGUOUS: tl.constexpr, DOT_MODE: tl.constexpr, FP32_PRECISION: tl.constexpr,
        FILL_TAIL: tl.constexpr, Q_U8: tl.constexpr, K_U8: tl.constexpr):
    row = tl.program_id(0)          # b * S + s
    split = tl.program_id(1)
    b = row // S
    s = row % S
    # visible entries of this query, read on the device (clamped: never out of bounds)
    n = tl.load(cl_ptr + b * stride_clb + s * stride_cls)
    n = tl.minimum(tl.maximum(n, 0), n_bound)
    n_tiles = tl.cdiv(n, BLOCK_N)
    # rows with n <= skip_upto need no scores (top-k keeps all of them): no tiles
    n_work = tl.where(n > skip_upto, n_tiles, 0)
    out_row = out_ptr + row.to(tl.int64) * L
    offs_n = tl.arange(0, BLOCK_N)
    # which of the row's tiles are this program's: a contiguous run, or every NUM_SPLITS-th
    if CONTIGUOUS:
        per = tl.cdiv(n_work, NUM_SPLITS)
        t_lo = split * per
        t_hi = tl.minimum(t_lo + per, n_work)
    else:
        t_lo = split
        t_hi = n_work

    if t_lo < t_hi:                 # early exit: a program past the row's last page does nothing
        offs_h = tl.arange(0, H_PAD)
        h_ok = offs_h < H
        q_row = q_ptr + b * stride_qb + s * stride_qs
        w = tl.load(w_ptr + b * stride_wb + s * stride_ws + offs_h, mask=h_ok, other=0.0)
        if BLOCK_D == D_PAD:
            offs_d = tl.arange(0, D_PAD)
            qt = _load_qt(q_row, offs_h, offs_d, h_ok, offs_d < D, stride_qh, DOT_MODE, Q_U8)
        else:
            qt = tl.zeros([BLOCK_D, H_PAD], dtype=tl.float32)      # unused: chunks reload q
        bt_row = bt_ptr + b * stride_btb
        if CONTIGUOUS:
            for t in range(t_lo, t_hi):
                _score_tile(t, qt, q_row, w, bt_row, k_ptr, ks_ptr, out_row, n, L,
                            offs_n, offs_h, h_ok, stride_qh, D, PAGE, H_PAD, D_PAD, BLOCK_N,
                            BLOCK_D, DOT_MODE, FP32_PRECISION, Q_U8, K_U8)
        else:
            for t in range(t_lo, t_hi, NUM_SPLITS):
                _score_tile(t, qt, q_row, w, bt_row, k_ptr, ks_ptr, out_row, n, L,
                            offs_n, offs_h, h_ok, stride_qh, D, PAGE, H_PAD, D_PAD, BLOCK_N,
                            BLOCK_D, DOT_MODE, FP32_PRECISION, Q_U8, K_U8)

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

def _interpreting(device) -> bool:
    return device.type != "cuda" or interpreting()


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


# Launch configurations of the logits kernel, per (dot, key dtype); "*" matches any key.
# Fields: block_n (entries per tile), block_d (head dims per dot; None = all of them, q
# resident; the CUDA-core fp32 dot needs chunks), num_warps, num_stages, programs_per_sm
# (the grid is (rows, splits) with splits = floor(programs_per_sm * SMs / rows), from the
# shapes only), contiguous (each split takes a run of tiles, else every splits-th tile),
# fp32_precision ("ieee" or "tf32x3", the fp32 path's tl.dot). scripts/tune_indexer.py
# sweeps these on a GPU and prints a replacement table; check_logits_config says which
# values compile.
# Winners of the 2026-11-29 H200 sweep (sm_90, triton 3.6; B=64, 32,768 entries a row):
# fp8 x fp8 88.9 us (0.76 of the HBM roofline), bf16 q x fp8 k 168 us, bf16 x bf16
# 162 us, fp32 q (IEEE dot, CUDA cores) 2.9 ms. 3xTF32 ran the fp32 path in 0.51 ms
# within 1e-4, but the fp32 row is kept IEEE on purpose (exact fp32 math).
LOGITS_CONFIGS = {
    ("fp8", "*"): dict(block_n=128, block_d=None, num_warps=4, num_stages=2, programs_per_sm=8,
                       contiguous=False, fp32_precision="ieee"),
    ("bf16", "fp8"): dict(block_n=64, block_d=None, num_warps=4, num_stages=4,
                          programs_per_sm=12, contiguous=False, fp32_precision="ieee"),
    ("bf16", "*"): dict(block_n=64, block_d=None, num_warps=4, num_stages=3, programs_per_sm=8,
                        contiguous=False, fp32_precision="ieee"),
    ("fp32", "*"): dict(block_n=64, block_d=16, num_warps=4, num_stages=2, programs_per_sm=8,
                        contiguous=False, fp32_precision="ieee"),
}
_DTYPE_KEY = {torch.float8_e4m3fn: "fp8", torch.bfloat16: "bf16", torch.float32: "fp32"}
_CONFIG_FIELDS = ("block_n", "block_d", "num_warps", "num_stages", "programs_per_sm",
                  "contiguous", "fp32_precision")


def logits_config(mode: int, k_dtype) -> dict:
    """The launch configuration for dot mode ``mode`` with keys of ``k_dtype``."""
    dot = DOT_NAMES[mode]
    key = _DTYPE_KEY.get(k_dtype, "*")
    return dict(LOGITS_CONFIGS.get((dot, key)) or LOGITS_CONFIGS[(dot, "*")])


def _pow2(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0 and x & (x - 1) == 0


def gpu_dot_modes(q_dtype, k_dtype) -> list:
    """Every dot mode these operand dtypes can take on a CUDA GPU (sm_80 .. sm_120)."""
    rank = {torch.float8_e4m3fn: 0, torch.bfloat16: 1, torch.float32: 2}
    r = max(rank[q_dtype], rank[k_dtype])
    return [[DOT_FP8, DOT_BF16], [DOT_BF16], [DOT_FP32]][r]


def check_logits_config(cfg: dict, mode: int) -> None:
    """Raise ValueError unless ``cfg`` compiles for dot mode ``mode`` on every CUDA target.

    The interpreter accepts any shape, the compiler does not: NVIDIA ``tl.dot`` needs a
    reduction (K) side of at least 16 (32 for the 8-bit e4m3 x e4m3 dot), so a head-dim
    chunk ``block_d`` below that fails to compile on sm_80/90/120 (the 2026-11-29 sweep's
    block_d=8 fp32 candidates did). Block sizes are powers of two (``tl.arange``);
    ``block_n`` >= 16 keeps every dot's M side at an MMA tile.
    """
    unknown = set(cfg) - set(_CONFIG_FIELDS)
    if unknown:
        raise ValueError(f"config: unknown field(s) {sorted(unknown)}; expected {_CONFIG_FIELDS}")
    if not (_pow2(cfg["block_n"]) and cfg["block_n"] >= 16):
        raise ValueError(f"config block_n: expected a power of two >= 16, got {cfg['block_n']!r}")
    bd = cfg["block_d"]
    min_k = 32 if mode == DOT_FP8 else 16
    if bd is not None and not (_pow2(bd) and bd >= min_k):
        raise ValueError(
            f"config block_d: expected None or a power of two >= {min_k} (tl.dot's K side "
            f"for the {DOT_NAMES[mode]} dot), got {bd!r}")
    if not (_pow2(cfg["num_warps"]) and cfg["num_warps"] <= 32):
        raise ValueError(f"config num_warps: expected 1..32, a power of two, got "
                         f"{cfg['num_warps']!r}")
    if not (isinstance(cfg["num_stages"], int) and cfg["num_stages"] >= 1):
        raise ValueError(f"config num_stages: expected an int >= 1, got {cfg['num_stages']!r}")
    if not (isinstance(cfg["programs_per_sm"], int) and cfg["programs_per_sm"] >= 1):
        raise ValueError(f"config programs_per_sm: expected an int >= 1, got "
                         f"{cfg['programs_per_sm']!r}")
    if cfg["fp32_precision"] not in ("ieee", "tf32", "tf32x3"):
        raise ValueError(f"config fp32_precision: expected 'ieee', 'tf32' or 'tf32x3', got "
                         f"{cfg['fp32_precision']!r}")


def logits_splits(rows: int, L: int, block_n: int, programs_per_sm: int, sm_count: int) -> int:
    """Programs per row of the logits kernel: about ``programs_per_sm`` per SM in all.

    Fixed by the shapes alone (never by ``context_lens``). Rounded down: a grid just past
    a multiple of the resident programs would add a nearly empty last wave. The cap at
    ``cdiv(L, block_n)`` tiles is the only way L enters, and it saturates: once
    ``L >= block_n * programs_per_sm * sm_count // rows`` the grid no longer depends on L
    (on an H200, fp8 config, 64 rows: 16 splits from 2,048 entries = 8K tokens up).
    """
    return max(1, min(triton.cdiv(L, block_n), programs_per_sm * sm_count // rows))


def _int_specialization(**ints) -> dict:
    """How Triton specialises integer arguments (== 1, divisible by 16): two launches
    whose ints agree on these reuse one compiled kernel."""
    return {k: (v == 1, v % 16 == 0) for k, v in ints.items()}


def _launch_logits(q, k_cache, k_scale, weights, block_table, context_lens, out, L,
                   fill_tail: bool, fp8_bytes=None, skip_upto: int = -1, config=None,
                   info=None):
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
    cfg = dict(logits_config(mode, k_cache.dtype), **(config or {}))
    check_logits_config(cfg, mode)
    BLOCK_N = cfg["block_n"]
    if _interpreting(q.device):
        BLOCK_N = 16
    BLOCK_D = min(D_PAD, cfg["block_d"] or D_PAD)
    rows = B * S
    splits = logits_splits(rows, L, BLOCK_N, cfg["programs_per_sm"], sm_count(q.device, cpu=4))
    n_bound = min(L, block_table.shape[1] * page)
    if fill_tail:
        skip_upto = -1              # every visible column is scored when the tail is filled
    kernel = _indexer_logits_kernel[(rows, splits)](
        q_arg, k_arg, k_scale, weights, block_table, context_lens, out,
        S, H, L, n_bound, skip_upto,
        q.stride(0), q.stride(1), q.stride(2),
        weights.stride(0), weights.stride(1),
        block_table.stride(0),
        context_lens.stride(0), context_lens.stride(1),
        D=D, PAGE=page, H_PAD=H_PAD, D_PAD=D_PAD, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
        NUM_SPLITS=splits, CONTIGUOUS=bool(cfg["contiguous"]), DOT_MODE=mode,
        FP32_PRECISION=cfg["fp32_precision"], FILL_TAIL=fill_tail, Q_U8=q_u8, K_U8=k_u8,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if info is not None:            # launch facts (compiled-kernel ones: none in the interpreter)
        info.update(splits=splits, programs=rows * splits, block_n=BLOCK_N, block_d=BLOCK_D,
                    dot=DOT_NAMES[mode], grid=(rows, splits),
                    constexprs=dict(D=D, PAGE=page, H_PAD=H_PAD, D_PAD=D_PAD, BLOCK_N=BLOCK_N,
                                    BLOCK_D=BLOCK_D, NUM_SPLITS=splits,
                                    CONTIGUOUS=bool(cfg["contiguous"]), DOT_MODE=mode,
                                    FILL_TAIL=fill_tail, Q_U8=q_u8, K_U8=k_u8),
                    int_specialization=_int_specialization(L=L, n_bound=n_bound,
                                                           skip_upto=skip_upto))
        for name in ("n_regs", "n_spills"):
            info[name] = getattr(kernel, name, None)
        info["shared"] = getattr(getattr(kernel, "metadata", None), "shared", None)
    return out


def indexer_logits(q, k_cache, k_scale, weights, block_table, context_lens, L, *, fp8_bytes=None,
                   config=None, out=None, info=None):
    """Logits [B, S_q, L] fp32, -inf beyond each query's visible length.

    Inputs as :func:`dsv4lab.ops.indexer_logits` (already checked there). Writes every
    one of the L columns (the -inf tail too), so its cost has an O(L) store part.
    ``fp8_bytes=True`` forces the sm_80 path (e4m3 passed as bytes, decoded in-kernel);
    ``config`` overrides fields of :data:`LOGITS_CONFIGS` (the tuner's sweep); ``out``, a
    preallocated fp32 [B, S_q, L] to write into; ``info``, a dict that receives the grid
    and the compiled kernel's registers, spills and shared memory.

    Explained in notebooks/03_indexer_capping.ipynb.
    """
    B, S = q.shape[:2]
    if out is None:
        out = torch.empty((B, S, L), dtype=torch.float32, device=q.device)
    return _launch_logits(q, k_cache, k_scale, weights, block_table, context_lens, out, L, True,
                          fp8_bytes, config=config, info=info)


def indexer_topk(q, k_cache, k_scale, weights, block_table, context_lens, L, topk, *,
                 fp8_bytes=None, config=None, scratch=None, info=None):
    """Top-``topk`` logical positions int32 [B, S_q, topk], -1 padded; O(actual length).

    The logits go to an uninitialised [B, S_q, L] fp32 scratch (``scratch``: one to reuse,
    e.g. shared by several captured graphs; else allocated) of which only the visible
    prefix of rows with more than ``topk`` entries is written and read (a row that keeps
    everything needs no scores, so nothing of it is written). The grids depend on shapes
    only, nothing reads back to the host: capturable in a CUDA graph. ``info``, a dict
    that receives both launches' grids, constexprs and integer specialisations (with
    ``logits_`` / ``topk_`` prefixes).

    Explained in notebooks/03_indexer_capping.ipynb.
    """
    B, S = q.shape[:2]
    # the result first: its place in the allocator's pool must not depend on L's scratch
    out = torch.empty((B, S, topk), dtype=torch.int32, device=q.device)
    if scratch is None:
        scratch = torch.empty((B, S, L), dtype=torch.float32, device=q.device)
    elif (scratch.shape != (B, S, L) or scratch.dtype != torch.float32
          or not scratch.is_contiguous() or scratch.device != q.device):
        raise ValueError(f"scratch must be a contiguous float32 [B, S_q, L] = {(B, S, L)} on "
                         f"{q.device}, got {scratch.dtype} {tuple(scratch.shape)} on "
                         f"{scratch.device}")
    linfo = {} if info is not None else None
    _launch_logits(q, k_cache, k_scale, weights, block_table, context_lens, scratch, L, False,
                   fp8_bytes, skip_upto=topk, config=config, info=linfo)
    interp = _interpreting(q.device)
    BLOCK = 64 if interp else 2048
    FILL = min(triton.next_power_of_2(topk), 64 if interp else 1024)
    num_warps = 4 if interp else 8
    n_bound = min(L, block_table.shape[1] * k_cache.shape[1])
    _topk_kernel[(B * S,)](
        scratch, context_lens, out,
        S, L, n_bound,
        context_lens.stride(0), context_lens.stride(1),
        TOPK=topk, BLOCK=BLOCK, FILL=FILL, num_warps=num_warps)
    if info is not None:
        info.update({f"logits_{k}": v for k, v in linfo.items()})
        info.update(topk_grid=(B * S,), topk_constexprs=dict(TOPK=topk, BLOCK=BLOCK, FILL=FILL),
                    topk_num_warps=num_warps,
                    topk_int_specialization=_int_specialization(stride_lr=L, n_bound=n_bound))
    return out
