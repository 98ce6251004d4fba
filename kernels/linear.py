"""
The linear family: ``y = x @ w^T`` for a decode step's few rows, in ONE launch
===============================================================================

1. :func:`linear_kernel`: float weights (x's dtype), 1..8 rows, fp32 multiply-adds.
2. :func:`fp8_linear_kernel`: DeepSeek-V4's released dense weights, float8 e4m3 with one
   power-of-two scale per 128 x 128 block, any row count, on the tensor cores.

1. Small-M float weights
------------------------
A small model's decode step multiplies a few rows by many small weights: latency-bound, it
pays per kernel and per memory wait. cuBLAS picks by M: a GEMV at one row, at 2..3 rows (a
speculative verify step) a GEMM plus a split-K reduce, two slower kernels that round
differently. Here every M in 1..8 runs one kernel:

- a program per ``BLOCK_N`` output columns (a fixed grid, no split-K) walks K, loads each
  ``[BLOCK_N, BLOCK_K]`` weight tile ONCE for all ``BLOCK_M = 8`` rows of x (rows past M read
  as zeros) and sums an fp32 tile of products over K at the end;
- fp32 multiply-adds on upcast operands, no ``tl.dot``: 8 rows fill no tensor core;
- more than 8 rows run as blocks of 8 in the same program: correct, not fast.

Row independence, which speculative decoding needs: the kernel and its tiles depend only on
the weight and the device, never on M or x's address or stride (not specialised), so row i
of an M = 3 call equals the M = 1 call on that row bit for bit. No host synchronisation:
CUDA-graph safe. Explained in notebooks/05_mtp_speculative.ipynb.
"""
from __future__ import annotations

import functools
import inspect

import torch
import triton
import triton.language as tl

from dsv4lab.kernels.device import DeviceProps, Route, choose, props as device_props
from dsv4lab.kernels.offline import Case

BLOCK_M = 8                 # rows per block: M <= 8 is one pass over the weights
ACC_ELEMS = 1024            # BLOCK_N * BLOCK_K (times BLOCK_M = 8192 fp32 accumulators)
NUM_WARPS = 4

# Nothing about x may change the compiled kernel: not M (1 would become a constant), not x's
# address or stride (alignment picks load layouts; x's plain loads cost nothing at 8 rows).
_X_ARGS = ["M", "x_ptr", "stride_xm"]
_JIT_KW = {"do_not_specialize": _X_ARGS}
if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
    _JIT_KW["do_not_specialize_on_alignment"] = _X_ARGS


@triton.jit(**_JIT_KW)
def linear_kernel(x_ptr, w_ptr, y_ptr, M, N, K,
                  stride_xm, stride_wn, stride_ym,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  STAGES: tl.constexpr):
    """x [M, K], w [N, K], y [M, N]; unit stride along K and N. One program: BLOCK_N columns
    of every row (rows in blocks of BLOCK_M, each block the same code)."""
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn          # [BN, 1]

    for m0 in range(0, M, BLOCK_M):               # one iteration for M <= BLOCK_M
        rm = m0 + tl.arange(0, BLOCK_M)
        m_ok = rm < M
        x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm      # [BM, 1]
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            k = k0 + rk
            k_ok = k < K
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        y = tl.sum(acc, axis=2)                                       # [BM, BN]
        y_ptrs = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
        tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def tile_config(N: int, K: int, props: DeviceProps) -> dict:
    """``BLOCK_N``, ``BLOCK_K``, ``STAGES`` for an [N, K] weight on ``props``, never of M:
    BLOCK_N the largest of 16, 8, 4 that gives a program per SM, BLOCK_K up to ACC_ELEMS."""
    block_n = 4
    for bn in (16, 8):
        if triton.cdiv(N, bn) >= props.sm_count:
            block_n = bn
            break
    block_k = max(16, min(ACC_ELEMS // block_n, triton.next_power_of_2(max(K, 1))))
    stages = 3 if K > 2 * block_k else 1
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "STAGES": stages}


def linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, *,
           props: DeviceProps | None = None) -> torch.Tensor:
    """``x [M, K] @ w [N, K]^T -> [M, N]`` in x's dtype (fp32 accumulation), made for M <= 8.
    :func:`dsv4lab.ops.linear` checks the operands; ``props`` plans for another device."""
    M, K = x.shape
    N = w.shape[0]
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("x and w need unit stride along K")
    y = out if out is not None else torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    if K == 0:
        return y.zero_()
    cfg = tile_config(N, K, props or device_props(x.device))
    linear_kernel[(triton.cdiv(N, cfg["BLOCK_N"]),)](
        x, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0),
        BLOCK_M=BLOCK_M, num_warps=NUM_WARPS, **cfg)
    return y


# ================================================================ 2. FP8 block-scaled weights
# The checkpoint's dense projections: e4m3 bytes, a power-of-two scale per 128 x 128 block.
# At decode sizes the product is a stream over those bytes, each read once:
# - a program owns BLOCK_N weight rows (one group, one scale block) and BLOCK_M rows of x and
#   walks K a scale block at a time: e4m3 -> fp16 in registers (exact), ``tl.dot`` with the
#   weight as operand A (the 16-row minimum pads x, not the weights), the block's scale on
#   the partial sum;
# - bf16 x goes to fp16 with each column scaled by a power of two putting its largest value
#   near 2^14 (exact within 2^29 of it), undone with the block scale; fp32 x, an fp32 dot.
#   x is not rounded to e4m3 (the W8A8 form: `dsv4lab bench linear`'s scaled_mm rows);
# - too few output tiles (one row, narrow N) split K: each program writes an fp32 partial and
#   takes a ticket; the last sums the partials in split order and resets the counter;
# - before sm_89 (no e4m3 type) the bytes go in as uint8, moved into an fp16 (times 2^-8).
# M counts only through BLOCK_M (16 for 1..16 rows): decode and verify steps agree bit for bit.

FP8_BLOCK = 128             # rows and columns one weight scale covers (DeepSeek-V4's)
FP8_NATIVE = (8, 9)         # the first capability with an e4m3 type (hardware conversion)
DECODE_ROWS = 64            # up to here the decode tiles, above them the prefill tiles
PROGRAMS_PER_SM = 4         # split-K aims at this many programs a streaming multiprocessor
FP8_TILES = {               # BLOCK_N weight rows by BLOCK_M x rows a program
    "decode": dict(BLOCK_N=64, num_warps=4, STAGES=3),
    "prefill": dict(BLOCK_N=128, BLOCK_M=64, num_warps=8, STAGES=3),
}


@triton.jit
def _weights_f16(w):
    """e4m3 weights as fp16: the hardware conversion, or raw bytes (uint8) moved bit by bit
    into an fp16, the value times 2^-8."""
    if w.dtype == tl.uint8:
        b = w.to(tl.uint16)
        return (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.float16, bitcast=True)
    return w.to(tl.float16)


@triton.jit
def _block_scale(s_ptr):
    """One weight block's scale: fp32, or an E8M0 byte b meaning 2^(b - 127)."""
    s = tl.load(s_ptr)
    if s.dtype == tl.uint8:
        e = s.to(tl.int32)
        s = tl.where(e == 0, 0x00400000, e << 23).to(tl.float32, bitcast=True)  # 2^-127: subnormal
    return s


@triton.jit(do_not_specialize=["M", "kb_per_split", "split"])
def fp8_linear_kernel(x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, count_ptr,
                      M, N, K, rows_per_group, stride_xm, stride_xg, stride_wn, stride_sn,
                      stride_ym, kb_per_split, split,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      STAGES: tl.constexpr):
    """x [M, groups * K], w [N, K] (e4m3 or bytes), s [N / 128, K / 128] -> y [M, N]; group g
    reads x's columns g * K ... Program (n tile, m tile, k split)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    n0 = pid_n * BLOCK_N
    rn = n0 + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn                     # [BN, 1]
    x_cols = x_ptr + (n0 // rows_per_group) * stride_xg + rm.to(tl.int64)[None, :] * stride_xm
    s_row = s_ptr + (n0 // BLOCK_K) * stride_sn
    unit = 256.0 if w_ptr.dtype.element_ty == tl.uint8 else 1.0              # see _weights_f16

    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    kb0 = pid_k * kb_per_split
    for kb in tl.range(kb0, tl.minimum(kb0 + kb_per_split, tl.cdiv(K, BLOCK_K)), num_stages=STAGES):
        k = kb * BLOCK_K + rk
        k_ok = k < K
        w = _weights_f16(tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0))
        x = tl.load(x_cols + k[:, None], mask=k_ok[:, None] & m_ok[None, :], other=0.0)  # [BK, BM]
        s = _block_scale(s_row + kb) * unit
        if x_ptr.dtype.element_ty == tl.float32:
            acc += tl.dot(w.to(tl.float32), x, input_precision="ieee") * s
        elif x_ptr.dtype.element_ty == tl.bfloat16:
            # a power of two a column: 2^(14 - floor(log2 amax)), from amax's exponent bits
            amax = tl.max(tl.abs(x.to(tl.float32)), axis=0)
            e = tl.minimum(tl.maximum(268 - ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF), 1), 253)
            up = (e << 23).to(tl.float32, bitcast=True)
            down = ((254 - e) << 23).to(tl.float32, bitcast=True)
            x16 = (x.to(tl.float32) * up[None, :]).to(tl.float16)
            acc += tl.dot(w, x16) * (s * down)[None, :]
        else:
            acc += tl.dot(w, x) * s

    y_ptrs = y_ptr + rm.to(tl.int64)[None, :] * stride_ym + rn[:, None]
    y_mask = n_ok[:, None] & m_ok[None, :]
    if split == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
    else:
        tile = pid_m * tl.num_programs(0) + pid_n
        local = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        parts = part_ptr + tile.to(tl.int64) * split * (BLOCK_N * BLOCK_M) + local
        tl.store(parts + pid_k * (BLOCK_N * BLOCK_M), acc, mask=m_ok[None, :])
        tl.debug_barrier()                                  # every thread's partial is out
        ticket = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if ticket == split - 1:                             # the last one: sum in split order
            total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for j in range(split):
                total += tl.load(parts + j * (BLOCK_N * BLOCK_M), mask=m_ok[None, :], other=0.0,
                                 cache_modifier=".cg")
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=y_mask)
            tl.atomic_xchg(count_ptr + tile, 0)


@functools.lru_cache(maxsize=1024)
def fp8_config(N: int, K: int, rows: int, props: DeviceProps, rows_per_group: int | None = None,
               x_bytes: int = 2) -> dict:
    """Tiles, split and stages of an [N, K] FP8 weight times ``rows`` rows on ``props`` (tile
    set: ``TABLES["linear_fp8"]``; STAGES fit shared memory). Cached: do not modify it."""
    route = choose(TABLES["linear_fp8"], props, rows=rows)
    cfg = dict(FP8_TILES["decode" if "decode" in route.kernel else "prefill"])
    cfg.setdefault("BLOCK_M", max(16, triton.next_power_of_2(rows)))
    if x_bytes == 4:       # fp32 x: an fp32 dot (FMAs), its operands in fp32: the smallest tiles
        cfg.update(FP8_TILES["decode"], BLOCK_M=16)
    while rows_per_group and rows_per_group % cfg["BLOCK_N"] and cfg["BLOCK_N"] > 16:
        cfg["BLOCK_N"] //= 2
    blocks = triton.cdiv(K, FP8_BLOCK)
    tiles = triton.cdiv(N, cfg["BLOCK_N"]) * triton.cdiv(rows, cfg["BLOCK_M"])
    m_pad = triton.cdiv(rows, cfg["BLOCK_M"]) * cfg["BLOCK_M"]
    # enough programs, but partials (m_pad x N fp32 a split) no more bytes than the weight
    split = max(1, min(blocks, PROGRAMS_PER_SM * props.sm_count // tiles, K // (4 * m_pad)))
    cfg["KB_PER_SPLIT"] = triton.cdiv(blocks, split)
    cfg["SPLIT"] = triton.cdiv(blocks, cfg["KB_PER_SPLIT"])      # no split left empty
    x_tile = FP8_BLOCK * cfg["BLOCK_M"] * x_bytes
    w_f32 = cfg["BLOCK_N"] * FP8_BLOCK * 4 if x_bytes == 4 else 0       # fp32 x: W as fp32 too
    while cfg["STAGES"] > 1 and ((cfg["STAGES"] - 1) * (cfg["BLOCK_N"] * FP8_BLOCK + x_tile)
                                 + x_tile + w_f32 + 4096 > props.smem_per_block):
        cfg["STAGES"] -= 1
    return cfg


_COUNTERS: dict = {}        # (device, stream) -> zeroed int32 counters of eager launches
_GRAPH_COUNTERS: dict = {}  # device -> [zeroed pool, next free]: each captured launch its own
GRAPH_COUNTER_POOL = 1 << 20


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """``n`` zeroed split-K counters (launches leave them zero): a stream's own for eager
    launches; a captured launch's own from the device's pool (or fresh, zeroed in-graph)."""
    index = device.index if device.type != "cuda" or device.index is not None else torch.cuda.current_device()
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        pool = _GRAPH_COUNTERS.get(index)
        if pool is None or pool[1] + n > pool[0].numel():
            return torch.zeros(n, dtype=torch.int32, device=device)
        pool[1] += n
        return pool[0][pool[1] - n:pool[1]]
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    buf = _COUNTERS.get((device.type, index, stream))
    if buf is None or buf.numel() < n:
        buf = _COUNTERS[(device.type, index, stream)] = torch.zeros(max(n, 4096), dtype=torch.int32,
                                                                     device=device)
        if device.type == "cuda" and index not in _GRAPH_COUNTERS:
            _GRAPH_COUNTERS[index] = [torch.zeros(GRAPH_COUNTER_POOL, dtype=torch.int32, device=device), 0]
    return buf


@functools.lru_cache(maxsize=None)
def _unused(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty fp32 and int32 tensors for the workspace arguments of an unsplit launch."""
    return (torch.empty(0, dtype=torch.float32, device=device),
            torch.empty(0, dtype=torch.int32, device=device))


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, *, groups: int = 1,
               out: torch.Tensor | None = None, props: DeviceProps | None = None) -> torch.Tensor:
    """``y[M, N] = x @ (w * scale)^T`` per group, in x's dtype: x [M, groups * K], w e4m3
    [N, K], scale fp32 or E8M0 [N / 128, K / 128] (:func:`dsv4lab.ops.linear` checks them),
    group g on x's columns g * K ... ``props`` plans for another device. No host sync."""
    M = x.shape[0]
    N, K = w.shape
    if x.stride(1) != 1 or w.stride(1) != 1 or scale.stride(1) != 1:
        raise ValueError("x, w and scale need unit stride along K")
    if groups < 1 or N % groups or (groups > 1 and (N // groups) % 16):
        raise ValueError(f"groups must divide N = {N} into groups of a multiple of 16 rows, got {groups}")
    y = out if out is not None else torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    if K == 0:
        return y.zero_()
    p = props or device_props(x.device)
    cfg = fp8_config(N, K, M, p, N // groups if groups > 1 else None, x.element_size())
    bm, bn, split = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["SPLIT"]
    grid = (triton.cdiv(N, bn), triton.cdiv(M, bm), split)
    if split > 1:
        part = torch.empty(grid[0] * grid[1] * split * bn * bm, dtype=torch.float32, device=x.device)
        count = _counters(x.device, grid[0] * grid[1])
    else:
        part, count = _unused(x.device)
    fp8_linear_kernel[grid](
        x, w if p.capability >= FP8_NATIVE else w.view(torch.uint8),
        scale if scale.dtype == torch.float32 else scale.view(torch.uint8), y, part, count,
        M, N, K, N // groups, x.stride(0), K, w.stride(0), scale.stride(0), y.stride(0),
        cfg["KB_PER_SPLIT"], split, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=FP8_BLOCK,
        STAGES=cfg["STAGES"], num_warps=cfg["num_warps"])
    return y


# ------------------------------------------------------------------- the dispatch tables
TABLES = {
    "linear": (Route("linear_kernel", None, "1..8 rows by a small weight (ops.linear's 'auto' rule)",
                     "one launch for every row count, each row's bits independent of the others "
                     "(plain and verify steps agree; `dsv4lab bench spec`)"),),
    "linear_fp8": (
        Route("fp8_linear_kernel (decode tiles)", None, f"FP8 block-scaled weights, 1..{DECODE_ROWS} rows",
              "a stream over the weight bytes: 64 weight rows a program, split-K to fill the GPU "
              "(`dsv4lab bench linear`)", lambda props, rows=1, **_: rows <= DECODE_ROWS),
        Route("fp8_linear_kernel (prefill tiles)", None, f"FP8 block-scaled weights, more than {DECODE_ROWS} rows",
              "128 x 64 tensor-core tiles, the weight tile reused by 64 rows (`dsv4lab bench linear`)"),
    ),
}


# -------------------------------------------------------------------- offline compiles
# the mini model's verify-step projections (fp32 [N, K]; V4-Flash's exceed "auto"'s limit)
VERIFY_WEIGHTS = ((4, 128), (8, 128), (24, 512), (32, 128), (64, 128), (128, 64), (128, 128),
                  (256, 64), (256, 128))
# DeepSeek-V4-Flash's FP8 projections: (name, N, K, groups); wo_a is 8 groups of 4096 -> 1024.
V4_FP8_WEIGHTS = (("q_a", 1024, 4096, 1), ("q_b", 32768, 1024, 1), ("kv", 512, 4096, 1),
                  ("wo_a", 8192, 4096, 8), ("wo_b", 4096, 8192, 1), ("shared_w13", 4096, 4096, 1),
                  ("shared_w2", 4096, 2048, 1), ("indexer_q", 8192, 1024, 1),
                  ("indexer_weights", 64, 4096, 1))
OFFLINE_ROWS = (1, 64, 256)          # decode tiles at BLOCK_M 16 and 64, the prefill tiles


def _fp8_cases(props: DeviceProps) -> list[Case]:
    """The FP8 launches at V4-Flash's shapes (fp32 scales; E8M0 bytes once per tile set)."""
    cases, seen = [], set()
    w_type = "*fp8e4nv" if props.capability >= FP8_NATIVE else "*u8"
    for rows in OFFLINE_ROWS:
        for scale_type in ("*fp32", "*u8"):
            for name, N, K, groups in V4_FP8_WEIGHTS:
                cfg = fp8_config(N, K, rows, props, N // groups if groups > 1 else None)
                ints = dict(N=N, K=K, rows_per_group=N // groups, stride_xm=K * groups, stride_xg=K,
                            stride_wn=K, stride_sn=triton.cdiv(K, FP8_BLOCK), stride_ym=N)
                consts = dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=FP8_BLOCK,
                              STAGES=cfg["STAGES"])
                key = (tuple(consts.items()), tuple(v % 16 == 0 for v in ints.values()),
                       cfg["num_warps"], scale_type)
                tile = (cfg["BLOCK_M"], cfg["BLOCK_N"], scale_type)
                if key in seen or (scale_type == "*u8" and tile in seen):
                    continue
                seen.update((key, tile))
                types = dict(x_ptr="*bf16", w_ptr=w_type, s_ptr=scale_type, y_ptr="*bf16",
                             part_ptr="*fp32", count_ptr="*i32", M="i32", kb_per_split="i32",
                             split="i32")
                aligned = ("x_ptr", "w_ptr", "s_ptr", "y_ptr", "part_ptr", "count_ptr") + tuple(
                    k for k, v in ints.items() if v % 16 == 0)
                cases.append(Case(f"fp8_linear_kernel, {name} [{N}, {K}] x {rows} rows, "
                                  f"{scale_type[1:]} scales", fp8_linear_kernel,
                                  consts, types=types, aligned=aligned, num_warps=cfg["num_warps"]))
    return cases


def offline_cases(props: DeviceProps) -> list[Case]:
    """The launches on ``props``: the verify step's float weights, V4-Flash's FP8 projections."""
    cases, seen = [], set()
    for N, K in VERIFY_WEIGHTS:
        cfg = tile_config(N, K, props)
        ints = dict(N=N, K=K, stride_wn=K, stride_ym=N)
        key = (tuple(cfg.items()), tuple(v % 16 == 0 for v in ints.values()), N == 1)
        if key in seen:
            continue
        seen.add(key)
        consts = dict(BLOCK_M=BLOCK_M, **cfg)
        aligned = ("w_ptr", "y_ptr") + tuple(k for k, v in ints.items() if v % 16 == 0)
        cases.append(Case(f"linear_kernel, weight [{N}, {K}] fp32", linear_kernel, consts,
                          types=dict(M="i32"), aligned=aligned, num_warps=NUM_WARPS))
    return cases + _fp8_cases(props)
