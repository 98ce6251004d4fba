"""
Lightning indexer: paged logits and an O(actual length) top-k, safe inside CUDA graphs
======================================================================================

The idea
--------
For decode row ``r = (b, s)`` and each visible key entry ``j < context_lens[b, s]``::

    logit[r, j] = k_scale[j] * sum_h w[r, h] * ReLU(q[r, h] . k[j])

The keys live in a paged cache ``k_cache [P, page, D]``: logical entry ``j`` of batch row
``b`` sits in physical page ``block_table[b, j // page]`` at offset ``j % page``.

Scoring every position up to the maximum context (262,144 c4 entries at 1M tokens) and
sorting that width costs O(max_context) a step. The two kernels here cost O(actual length):

1. :func:`logits_kernel`: a FIXED grid of (rows, NUM_SPLITS) programs, from the shapes and
   the device only. Each program reads its row's visible length from ``context_lens`` ON THE
   DEVICE and walks every NUM_SPLITS-th tile up to the last visible page. A tile gathers
   BLOCK_N keys through the block table and computes ``keys [BLOCK_N, D] @ q^T [D, heads]``:
   keys on the M side, so the ReLU, head weights and sum over heads stay inside a warp.
2. :func:`topk_kernel`: one program per row. A row of ``n <= topk`` entries keeps them all
   (positions 0..n-1, then -1; no logits read or even scored). Otherwise a 4-pass radix
   select (8 bits a pass, a 256-bin histogram) over the order-preserving uint32 image of the
   logits finds the k-th largest; a last pass writes every position above it and the ties
   needed, in position order. Every pass reads only the ``n`` visible logits.

Neither kernel reads a length on the host, allocates by length or changes its grid with the
data: one captured CUDA graph serves every context length. Which dot runs where is
:data:`TABLES`. Explained in notebooks/03_indexer_capping.ipynb.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsv4lab.kernels.device import DeviceProps, Route, choose, interpreting, props as device_props
from dsv4lab.kernels.launch import Launch, report_verdict, workspace
from dsv4lab.kernels.offline import Case

# How the matmul runs (the DOT constexpr): the wider of q's and k's dtypes.
DOT_FP8 = 0    # e4m3 x e4m3 tensor-core dot, fp32 accumulate
DOT_BF16 = 1   # operands upcast to bf16 (e4m3 -> bf16 is exact), fp32 accumulate
DOT_FP32 = 2   # operands upcast to fp32, IEEE fp32 dot (no TF32)
DOT_NAMES = {DOT_FP8: "fp8", DOT_BF16: "bf16", DOT_FP32: "fp32"}


@triton.jit
def _e4m3_bits_to_f32(x):
    """e4m3fn bytes -> fp32 without an fp8 type (sm_80): shifted into an fp16, value * 2^-8."""
    x = x.to(tl.int16)
    h = ((x & 0x80) << 8) | ((x & 0x7F) << 7)
    return h.to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def _tile_dot(k, qt, DOT: tl.constexpr):
    """[BLOCK_N, Dc] keys x [Dc, H_PAD] queries -> fp32 [BLOCK_N, H_PAD]."""
    if DOT == 0:
        acc = tl.dot(k, qt)
    elif DOT == 1:
        acc = tl.dot(k.to(tl.bfloat16), qt)
    else:
        acc = tl.dot(k.to(tl.float32), qt, input_precision="ieee")
    return acc


@triton.jit
def _load_qt(q_row, offs_h, offs_c, h_ok, c_ok, stride_qh, DOT: tl.constexpr, Q_U8: tl.constexpr):
    """q's [H_PAD, Dc] slice as the dot's [Dc, H_PAD] operand."""
    q = tl.load(q_row + offs_h[:, None] * stride_qh + offs_c[None, :],
                mask=h_ok[:, None] & c_ok[None, :], other=0.0)
    if Q_U8:
        q = _e4m3_bits_to_f32(q)
    if DOT == 1:
        q = q.to(tl.bfloat16)
    elif DOT == 2:
        q = q.to(tl.float32)
    return tl.trans(q)


@triton.jit
def _score_tile(t, qt, q_row, w, bt_row, k_ptr, ks_ptr, out_row, n, L,
                offs_n, offs_h, h_ok, stride_qh,
                D: tl.constexpr, PAGE: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT: tl.constexpr,
                Q_U8: tl.constexpr, K_U8: tl.constexpr):
    """Score logical entries [t * BLOCK_N, (t + 1) * BLOCK_N) of one row and store them."""
    pos = t * BLOCK_N + offs_n
    vis = pos < n
    phys = tl.load(bt_row + pos // PAGE, mask=vis, other=0)
    slot = phys.to(tl.int64) * PAGE + pos % PAGE
    ks = tl.load(ks_ptr + slot, mask=vis, other=0.0)
    if BLOCK_D == D_PAD:
        offs_d = tl.arange(0, D_PAD)                # the whole head dim: q^T stays resident
        k = tl.load(k_ptr + slot[:, None] * D + offs_d[None, :],
                    mask=vis[:, None] & (offs_d < D)[None, :], other=0.0)
        if K_U8:
            k = _e4m3_bits_to_f32(k)
        acc = _tile_dot(k, qt, DOT)                                     # [BLOCK_N, H_PAD]
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
            qc = _load_qt(q_row, offs_h, offs_c, h_ok, c_ok, stride_qh, DOT, Q_U8)
            acc += _tile_dot(k, qc, DOT)
    # ReLU, head weights, and the sum over heads: along the accumulator's rows (in-warp)
    logit = tl.sum(tl.maximum(acc, 0.0) * w[None, :], axis=1) * ks
    logit = tl.where(vis, logit, float("-inf"))
    tl.store(out_row + pos, logit, mask=pos < L)


@triton.jit
def logits_kernel(
        q_ptr, k_ptr, ks_ptr, w_ptr, bt_ptr, cl_ptr, out_ptr,
        S, H, L, n_bound, skip_upto,
        stride_qb, stride_qs, stride_qh,
        stride_wb, stride_ws,
        stride_btb,
        stride_clb, stride_cls,
        D: tl.constexpr, PAGE: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
        DOT: tl.constexpr, FILL_TAIL: tl.constexpr, Q_U8: tl.constexpr, K_U8: tl.constexpr):
    """Logits of row ``program_id(0)`` over its tiles ``split, split + NUM_SPLITS, ...``."""
    row = tl.program_id(0)          # b * S + s
    split = tl.program_id(1)
    b = row // S
    s = row % S
    n = tl.load(cl_ptr + b * stride_clb + s * stride_cls)     # visible entries, on the device
    n = tl.minimum(tl.maximum(n, 0), n_bound)
    n_tiles = tl.cdiv(n, BLOCK_N)
    n_work = tl.where(n > skip_upto, n_tiles, 0)    # top-k keeps all of a short row: no tiles
    out_row = out_ptr + row.to(tl.int64) * L
    offs_n = tl.arange(0, BLOCK_N)

    if split < n_work:              # early exit: a program past the row's last page does nothing
        offs_h = tl.arange(0, H_PAD)
        h_ok = offs_h < H
        q_row = q_ptr + b * stride_qb + s * stride_qs
        w = tl.load(w_ptr + b * stride_wb + s * stride_ws + offs_h, mask=h_ok, other=0.0)
        if BLOCK_D == D_PAD:
            offs_d = tl.arange(0, D_PAD)
            qt = _load_qt(q_row, offs_h, offs_d, h_ok, offs_d < D, stride_qh, DOT, Q_U8)
        else:
            qt = tl.zeros([BLOCK_D, H_PAD], dtype=tl.float32)      # unused: chunks reload q
        bt_row = bt_ptr + b * stride_btb
        for t in range(split, n_work, NUM_SPLITS):
            _score_tile(t, qt, q_row, w, bt_row, k_ptr, ks_ptr, out_row, n, L,
                        offs_n, offs_h, h_ok, stride_qh, D, PAGE, H_PAD, D_PAD, BLOCK_N,
                        BLOCK_D, DOT, Q_U8, K_U8)

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
def topk_kernel(logits_ptr, cl_ptr, out_ptr,
                S, stride_lr, n_bound,
                stride_clb, stride_cls,
                TOPK: tl.constexpr, BLOCK: tl.constexpr, FILL: tl.constexpr):
    """The top-TOPK positions of row ``program_id(0)``'s visible logits, -1 padded."""
    row = tl.program_id(0)
    b = row // S
    s = row % S
    n = tl.load(cl_ptr + b * stride_clb + s * stride_cls)
    n = tl.minimum(tl.maximum(n, 0), n_bound)
    out_row = out_ptr + row.to(tl.int64) * TOPK
    lrow = logits_ptr + row.to(tl.int64) * stride_lr

    if n <= TOPK:
        for start in range(0, TOPK, FILL):          # every visible entry kept, no logits read
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


# ------------------------------------------------------------------- the dispatch table

FP8 = torch.float8_e4m3fn
_RANK = {FP8: DOT_FP8, torch.bfloat16: DOT_BF16, torch.float32: DOT_FP32}


def _widest(q_dtype, k_dtype) -> int:
    return max(_RANK[q_dtype], _RANK[k_dtype])


# The routes, in DOT_* order; shape arguments default to e4m3 q and keys.
LOGITS_ROUTES = (
    Route("logits_kernel, e4m3 x e4m3 dot", None, "q and keys e4m3 on sm_89 and newer",
          "FP8 tensor cores, half the key bytes of bf16 (`dsv4lab bench indexer`, matmul_dtype rows)",
          lambda p, q_dtype=FP8, k_dtype=FP8, **_: (p.capability >= (8, 9)
                                                   and _widest(q_dtype, k_dtype) == DOT_FP8)),
    Route("logits_kernel, bf16 dot", None,
          "the wider operand bf16, or e4m3 on sm_80 (read as bytes, decoded in the kernel)",
          "bf16 tensor cores; e4m3 -> bf16 is exact",
          lambda p, q_dtype=FP8, k_dtype=FP8, **_: p.is_gpu and _widest(q_dtype, k_dtype) <= DOT_BF16),
    Route("logits_kernel, fp32 dot", None, "an fp32 operand; every dtype in Triton's interpreter",
          "exact fp32 math (IEEE dot); the interpreter's bf16 tl.dot is wrong, so it upcasts"),
)
TABLES = {
    "indexer_logits": LOGITS_ROUTES,
    "indexer_topk": tuple(dataclasses.replace(r, kernel=r.kernel + " + topk_kernel")
                          for r in LOGITS_ROUTES),
}


def dot_path(q_dtype, k_dtype, props: DeviceProps) -> int:
    """DOT_FP8 / DOT_BF16 / DOT_FP32: the route these dtypes take on ``props``."""
    return LOGITS_ROUTES.index(choose(LOGITS_ROUTES, props, q_dtype=q_dtype, k_dtype=k_dtype))


# --------------------------------------------------------------- launch configurations

@dataclass(frozen=True)
class LogitsConfig:
    """Launch shape of :func:`logits_kernel`: ``block_n`` keys a tile; ``block_d`` head dims a
    dot (None: all, q^T resident); ``programs_per_sm``: splits = about that * SMs / rows."""
    block_n: int
    block_d: int | None
    num_warps: int
    num_stages: int
    programs_per_sm: int


# Measured best (tools/tune_indexer.py prints such entries), by capability and (dot, key dtype)
TUNED = {
    (9, 0): {("fp8", "*"): LogitsConfig(128, None, 4, 2, 8),
             ("bf16", "fp8"): LogitsConfig(64, None, 4, 4, 12),
             ("bf16", "*"): LogitsConfig(64, None, 4, 3, 8),
             ("fp32", "*"): LogitsConfig(64, 16, 4, 2, 8)},
}
_KEY_NAMES = {FP8: "fp8", torch.bfloat16: "bf16", torch.float32: "fp32"}
_SMEM_SLACK = 16 * 1024          # layout conversions and reductions beside the pipelined tiles


def logits_config(dot: int, k_dtype, props: DeviceProps, *, head_dim: int = 128,
                  heads: int = 64) -> LogitsConfig:
    """The launch configuration of ``dot`` with ``k_dtype`` keys on ``props``: :data:`TUNED`'s,
    else 128-key tiles for e4m3 (64 else) and the stages shared memory holds beside q^T."""
    tuned = TUNED.get(props.capability, {})
    name = DOT_NAMES[dot]
    cfg = tuned.get((name, _KEY_NAMES[k_dtype])) or tuned.get((name, "*"))
    if cfg is not None:
        return cfg
    if dot == DOT_FP32:
        return LogitsConfig(64, 16, 4, 2, 8)
    block_n, want = (128, 2) if dot == DOT_FP8 else (64, 3)
    d_pad, h_pad = max(32, triton.next_power_of_2(head_dim)), max(16, triton.next_power_of_2(heads))
    resident = d_pad * h_pad * (1 if dot == DOT_FP8 else 2)
    per_stage = block_n * d_pad * k_dtype.itemsize
    fit = (props.smem_per_block - resident - _SMEM_SLACK) // per_stage
    return LogitsConfig(block_n, None, 4, max(1, min(want, fit)), 8)


def _pow2(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0 and x & (x - 1) == 0


def check_config(cfg: LogitsConfig, dot: int) -> None:
    """ValueError unless ``cfg`` compiles for ``dot`` on every CUDA target (``tl.arange``'s
    powers of two, ``tl.dot``'s smallest sides)."""
    if not (_pow2(cfg.block_n) and cfg.block_n >= 16):
        raise ValueError(f"config block_n: expected a power of two >= 16, got {cfg.block_n!r}")
    min_k = 32 if dot == DOT_FP8 else 16
    if cfg.block_d is not None and not (_pow2(cfg.block_d) and cfg.block_d >= min_k):
        raise ValueError(f"config block_d: expected None or a power of two >= {min_k} (tl.dot's "
                         f"K side for the {DOT_NAMES[dot]} dot), got {cfg.block_d!r}")
    if not (_pow2(cfg.num_warps) and cfg.num_warps <= 32):
        raise ValueError(f"config num_warps: expected a power of two <= 32, got {cfg.num_warps!r}")
    for field in ("num_stages", "programs_per_sm"):
        v = getattr(cfg, field)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"config {field}: expected an int >= 1, got {v!r}")


def logits_splits(rows: int, L: int, block_n: int, programs_per_sm: int, sm_count: int) -> int:
    """Programs per row of the logits kernel: about ``programs_per_sm`` per SM in all, from
    the shapes only (rounded down: no nearly empty last wave), at most one a tile of L."""
    return max(1, min(triton.cdiv(L, block_n), programs_per_sm * sm_count // rows))


@dataclass(frozen=True)
class Plan:
    """One launch, worked out once per shapes and device: grid, constexprs and options."""
    grid: tuple
    meta: dict
    n_bound: int
    q_u8: bool = False
    k_u8: bool = False


@functools.lru_cache(maxsize=512)
def logits_plan(props: DeviceProps, interpreted: bool, rows: int, S: int, H: int, D: int,
                page: int, max_pages: int, L: int, q_dtype, k_dtype, fill_tail: bool,
                config: LogitsConfig | None = None) -> Plan:
    """The launch of :func:`logits_kernel` on ``props`` (``interpreted``: small tiles, fp32)."""
    dot = dot_path(q_dtype, k_dtype, props)
    bytes_in = props.is_gpu and props.capability < (8, 9)   # no e4m3 type in Triton there
    if config is None:
        config = logits_config(dot, k_dtype, props, head_dim=D, heads=H)
    check_config(config, dot)
    if interpreted:
        dot = DOT_FP32
    H_PAD = max(16, triton.next_power_of_2(H))
    D_PAD = max(32, triton.next_power_of_2(D))
    block_n = 16 if interpreted else config.block_n
    block_d = min(D_PAD, config.block_d or D_PAD)
    splits = logits_splits(rows, L, block_n, config.programs_per_sm, props.sm_count)
    meta = dict(D=D, PAGE=page, H_PAD=H_PAD, D_PAD=D_PAD, BLOCK_N=block_n, BLOCK_D=block_d,
                NUM_SPLITS=splits, DOT=dot, FILL_TAIL=fill_tail,
                Q_U8=bytes_in and q_dtype == FP8, K_U8=bytes_in and k_dtype == FP8,
                num_warps=config.num_warps, num_stages=config.num_stages)
    return Plan((rows, splits), meta, min(L, max_pages * page), meta["Q_U8"], meta["K_U8"])


@functools.lru_cache(maxsize=512)
def topk_plan(interpreted: bool, rows: int, L: int, n_bound: int, topk: int) -> Plan:
    """The launch of :func:`topk_kernel`: one program per row."""
    block = 64 if interpreted else 2048
    fill = min(triton.next_power_of_2(topk), 64 if interpreted else 1024)
    return Plan((rows,), dict(TOPK=topk, BLOCK=block, FILL=fill, num_warps=4 if interpreted else 8),
                n_bound)


# ----------------------------------------------------------------------------- launchers

def _interpreted(device) -> bool:
    return device.type != "cuda" or interpreting()


_LOGITS: dict = {}
_TOPK: dict = {}


def _logits_launch(q, k_cache, weights, block_table, context_lens, L, fill_tail, skip_upto,
                   config, props):
    """(plan, Launch) of :func:`logits_kernel` for these shapes and strides, made once."""
    key = (q.device, q.shape, q.stride(), q.dtype, k_cache.shape, k_cache.dtype,
           weights.stride(), block_table.shape, block_table.stride(0), context_lens.stride(),
           L, fill_tail, skip_upto, config, props)
    entry = _LOGITS.get(key)
    if entry is None:
        B, S, H, D = q.shape
        P, page, _ = k_cache.shape
        plan = logits_plan(props or device_props(q.device), _interpreted(q.device), B * S, S, H,
                           D, page, block_table.shape[1], L, q.dtype, k_cache.dtype, fill_tail,
                           config)
        meta = dict(plan.meta)
        options = dict(num_warps=meta.pop("num_warps"), num_stages=meta.pop("num_stages"))
        fixed = dict(meta, S=S, H=H, L=L, n_bound=plan.n_bound,
                     skip_upto=-1 if fill_tail else skip_upto,
                     stride_qb=q.stride(0), stride_qs=q.stride(1), stride_qh=q.stride(2),
                     stride_wb=weights.stride(0), stride_ws=weights.stride(1),
                     stride_btb=block_table.stride(0), stride_clb=context_lens.stride(0),
                     stride_cls=context_lens.stride(1))
        entry = _LOGITS[key] = (plan, Launch(logits_kernel, plan.grid, fixed, device=q.device,
                                             guard=(0, 1, 2, 3, 4, 5), **options))
    return entry


def _launch_logits(q, k_cache, k_scale, weights, block_table, context_lens, out, L, *,
                   fill_tail: bool, skip_upto: int, config, props):
    if config is not None and not isinstance(config, LogitsConfig):
        raise ValueError(f"config must be a LogitsConfig, got {type(config).__name__}")
    if q.stride(3) != 1:
        q = q.contiguous()
    if not k_cache.is_contiguous():
        k_cache = k_cache.contiguous()
    if not k_scale.is_contiguous():
        k_scale = k_scale.contiguous()
    if weights.stride(2) != 1:
        weights = weights.contiguous()
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    plan, launch = _logits_launch(q, k_cache, weights, block_table, context_lens, L, fill_tail,
                                  skip_upto, config, props)
    launch(q.view(torch.uint8) if plan.q_u8 else q,
           k_cache.view(torch.uint8) if plan.k_u8 else k_cache,
           k_scale, weights, block_table, context_lens, out)
    return plan


def indexer_logits(q, k_cache, k_scale, weights, block_table, context_lens, L, *, out=None,
                   config: LogitsConfig | None = None, props: DeviceProps | None = None):
    """Logits [B, S_q, L] fp32, -inf beyond each query's visible length (all L columns: an
    O(L) store). Inputs as :func:`dsv4lab.ops.indexer_logits`. ``out``: fp32 [B, S_q, L] to
    write into; ``config``: instead of the device's; ``props``: plan for another device."""
    B, S = q.shape[:2]
    if out is None:
        out = torch.empty((B, S, L), dtype=torch.float32, device=q.device)
    _launch_logits(q, k_cache, k_scale, weights, block_table, context_lens, out, L,
                   fill_tail=True, skip_upto=-1, config=config, props=props)
    return out


def indexer_topk(q, k_cache, k_scale, weights, block_table, context_lens, L, topk, *,
                 scratch=None, config: LogitsConfig | None = None,
                 props: DeviceProps | None = None):
    """Top-``topk`` logical positions int32 [B, S_q, topk], -1 padded; O(actual length), CUDA
    graph capturable. ``scratch``: fp32 [B, S_q, L] for the logits (uninitialised; only the
    visible prefix is used); ``config``, ``props``: as :func:`indexer_logits`."""
    B, S = q.shape[:2]
    # the result first: its place in the allocator's pool must not depend on L's scratch
    out = torch.empty((B, S, topk), dtype=torch.int32, device=q.device)
    if scratch is None:
        scratch = torch.empty((B, S, L), dtype=torch.float32, device=q.device)
    elif (scratch.shape != (B, S, L) or scratch.dtype != torch.float32
          or not scratch.is_contiguous() or scratch.device != q.device):
        raise ValueError(f"scratch must be a contiguous float32 [B, S_q, L] = {(B, S, L)} on "
                         f"{q.device}, got {scratch.dtype} {tuple(scratch.shape)} on {scratch.device}")
    lp = _launch_logits(q, k_cache, k_scale, weights, block_table, context_lens, scratch, L,
                        fill_tail=False, skip_upto=topk, config=config, props=props)
    key = (q.device, B * S, S, L, lp.n_bound, topk, context_lens.stride())
    launch = _TOPK.get(key)
    if launch is None:
        plan = topk_plan(_interpreted(q.device), B * S, L, lp.n_bound, topk)
        meta = dict(plan.meta)
        warps = meta.pop("num_warps")
        launch = _TOPK[key] = Launch(topk_kernel, plan.grid, dict(
            meta, S=S, stride_lr=L, n_bound=plan.n_bound, stride_clb=context_lens.stride(0),
            stride_cls=context_lens.stride(1)), device=q.device, guard=(0, 1), num_warps=warps)
    launch(scratch, context_lens, out)
    return out


# ------------------------------------------------------------- value checks, cache slots

@triton.jit(do_not_specialize=["slot", "stamp"])
def check_tables_kernel(bt_ptr, cl_ptr, safe_ptr, flag_ptr, host_ptr, S, MAXP, P, L, n_bound,
                        stride_btb, stride_clb, stride_cls, slot, stamp,
                        PAGE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr):
    """The block table clamped into [0, P) for the kernels; the verdict (launch's
    ``report_verdict``) bad for a context length outside [0, L] or a visible entry no page id."""
    b = tl.program_id(0)
    c = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    n_max = tl.zeros([], tl.int32)
    bad = tl.zeros([], tl.int32)
    for s0 in range(0, S, BLOCK_S):
        s = s0 + offs_s
        cl = tl.load(cl_ptr + b * stride_clb + s * stride_cls, mask=s < S, other=0)
        bad = tl.maximum(bad, tl.max(((cl < 0) | (cl > L)).to(tl.int32), axis=0))
        n_max = tl.maximum(n_max, tl.max(tl.minimum(tl.maximum(cl, 0), n_bound), axis=0))
    j = c * BLOCK_P + tl.arange(0, BLOCK_P)
    m = j < MAXP
    bt = tl.load(bt_ptr + b.to(tl.int64) * stride_btb + j, mask=m, other=0)
    vis = m & (j < tl.cdiv(n_max, PAGE))
    bad = tl.maximum(bad, tl.max((vis & ((bt < 0) | (bt >= P))).to(tl.int32), axis=0))
    tl.store(safe_ptr + b.to(tl.int64) * MAXP + j, tl.minimum(tl.maximum(bt, 0), P - 1), mask=m)
    report_verdict(flag_ptr, host_ptr, slot, stamp, bad)


_CHECKS: dict = {}


def check_tables(block_table, context_lens, P: int, page: int, L: int, verdict):
    """Launch the check of ``block_table`` and ``context_lens`` -> the block table the kernels
    should read (``verdict``: the call's :func:`~dsv4lab.kernels.launch.value_check`)."""
    B, maxp = block_table.shape
    S = context_lens.shape[1]
    key = (block_table.device, B, maxp, block_table.stride(), S, context_lens.stride(), P,
           page, L)
    launch = _CHECKS.get(key)
    if launch is None:
        block_p = min(1024, max(16, triton.next_power_of_2(maxp)))
        launch = _CHECKS[key] = Launch(check_tables_kernel, (B, triton.cdiv(maxp, block_p)), dict(
            S=S, MAXP=maxp, P=P, L=L, n_bound=min(L, maxp * page),
            stride_btb=block_table.stride(0), stride_clb=context_lens.stride(0),
            stride_cls=context_lens.stride(1), PAGE=page,
            BLOCK_S=max(2, triton.next_power_of_2(S)), BLOCK_P=block_p),
            device=block_table.device, guard=(0, 1), num_warps=4)
    dev = block_table.device
    safe = workspace(("indexer block table", B, maxp), dev,
                     lambda: torch.empty((B, maxp), dtype=torch.int32, device=dev))
    launch(block_table, context_lens, safe, *verdict.args)
    return safe


@triton.jit(do_not_specialize=["slot", "stamp"])
def cache_slots_kernel(idx_ptr, bt_ptr, out_ptr, flag_ptr, host_ptr, n_row, MAXP, stride_btb,
                       slot, stamp, PAGE: tl.constexpr, BLOCK: tl.constexpr, CHECK: tl.constexpr):
    """Logical positions -> flat cache slots (outside [0, MAXP * PAGE): -1); ``CHECK``: the
    verdict (launch's ``report_verdict``), bad for one outside [-1, MAXP * PAGE)."""
    b = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n_row
    idx = tl.load(idx_ptr + b.to(tl.int64) * n_row + offs, mask=m, other=-1)
    ok = (idx >= 0) & (idx < MAXP * PAGE)
    pos = tl.where(ok, idx, 0)
    phys = tl.load(bt_ptr + b.to(tl.int64) * stride_btb + pos // PAGE, mask=m & ok, other=0)
    slots = phys.to(tl.int64) * PAGE + pos % PAGE
    tl.store(out_ptr + b.to(tl.int64) * n_row + offs, tl.where(ok, slots, -1).to(tl.int32),
             mask=m)
    if CHECK:
        bad = m & ((idx < -1) | (idx >= MAXP * PAGE))
        report_verdict(flag_ptr, host_ptr, slot, stamp, tl.max(bad.to(tl.int32), axis=0))


_SLOTS: dict = {}


def cache_slots(indices, block_table, page_size: int, check=None):
    """:func:`dsv4lab.ops.to_cache_slots` in one launch -> int32 slots. ``check``: the call's
    :func:`~dsv4lab.kernels.launch.value_check` verdict, or None (the caller reads it only
    for a non-empty ``indices``: an empty one launches nothing)."""
    B = indices.shape[0]
    n_row = indices.numel() // max(1, B)
    maxp = block_table.shape[1]
    key = (indices.device, indices.dtype, B, n_row, maxp, block_table.stride(0), page_size,
           check is not None)
    launch = _SLOTS.get(key)
    if launch is None:
        block = min(1024, max(16, triton.next_power_of_2(n_row)))
        launch = _SLOTS[key] = Launch(cache_slots_kernel, (B, triton.cdiv(n_row, block)), dict(
            n_row=n_row, MAXP=maxp, stride_btb=block_table.stride(0), PAGE=page_size,
            BLOCK=block, CHECK=check is not None), device=indices.device, guard=(0, 1),
            num_warps=4)
    out = torch.empty(indices.shape, dtype=torch.int32, device=indices.device)
    if out.numel():
        launch(indices, block_table, out, *(check.args if check is not None else (out, out, 0, 0)))
    return out


# -------------------------------------------------------------------- offline compiles

_TYPES = {FP8: "*fp8e4nv", torch.bfloat16: "*bf16", torch.float32: "*fp32"}


def _case(name, fn, meta, ptrs, ints, out_ptr="*fp32") -> Case:
    """A launch as Triton specialises it: ints of 1 constants, multiples of 16 aligned."""
    consts = {k: v for k, v in meta.items() if k not in ("num_warps", "num_stages")}
    consts.update({k: 1 for k, v in ints.items() if v == 1})
    aligned = ("*",) + tuple(k for k, v in ints.items() if v != 1 and v % 16 == 0)
    return Case(name, fn, consts, types=dict(ptrs), pointer=out_ptr, aligned=aligned,
                num_warps=meta["num_warps"], num_stages=meta.get("num_stages", 3))


def offline_cases(props: DeviceProps) -> list[Case]:
    """The launches "auto" makes on ``props`` at V4-Flash's indexer shape (64 heads x 128,
    pages of 64, 262,144 entries, top-512), B 1 and 64, e4m3, bf16 and fp32 operands."""
    H, D, page, L, topk = 64, 128, 64, 262144, 512
    pairs = [(FP8, FP8), (torch.bfloat16, FP8), (torch.bfloat16, torch.bfloat16),
             (torch.float32, torch.float32)]
    cases = []
    for q_dt, k_dt in pairs:
        for B, fill in ((1, False), (64, False), (64, True)):
            plan = logits_plan(props, False, B, 1, H, D, page, L // page, L, q_dt, k_dt, fill)
            u8 = "*u8"
            ptrs = dict(q_ptr=u8 if plan.q_u8 else _TYPES[q_dt], k_ptr=u8 if plan.k_u8 else _TYPES[k_dt],
                        bt_ptr="*i32", cl_ptr="*i32")
            ints = dict(S=1, H=H, L=L, n_bound=plan.n_bound, skip_upto=-1 if fill else topk,
                        stride_qb=H * D, stride_qs=H * D, stride_qh=D, stride_wb=H, stride_ws=H,
                        stride_btb=L // page, stride_clb=1, stride_cls=1)
            name = f"logits {DOT_NAMES[plan.meta['DOT']]} dot, q {_KEY_NAMES[q_dt]} k {_KEY_NAMES[k_dt]}, " \
                   f"B {B}{', -inf tail' if fill else ''}"
            cases.append(_case(name, logits_kernel, plan.meta, ptrs, ints))
    plan = topk_plan(False, 64, L, L, topk)
    cases.append(_case("topk_kernel, top-512", topk_kernel, plan.meta,
                       dict(cl_ptr="*i32", out_ptr="*i32"),
                       dict(S=1, stride_lr=L, n_bound=L, stride_clb=1, stride_cls=1)))
    return cases
