"""An MXFP4 mixture-of-experts on ``tl.dot_scaled`` (Triton's microscaling dot).

The idea. :mod:`dsv4lab.kernels.moe` decodes the FP4 nibbles by hand (integer ops in
registers, ~11-25 instructions a packed byte on sm_90) and reaches 0.13-0.21 of the
FP4-bytes roofline on an H200. Triton has a maintained path for exactly this product:
``tl.dot_scaled(lhs, lhs_scale, "e2m1", rhs, None, "bf16")`` takes the packed E2M1 bytes
and their E8M0 block-32 scales as they are stored, upcasts them to bf16 in registers with
its own conversion (a mixed e2m1 x bf16 product is upcast on every NVIDIA arch; a native
MX MMA needs MX formats on both sides) and runs an ordinary tensor-core dot: wgmma on
Hopper, mma.sync on sm_80/sm_120, tcgen05 on sm_100. Loads are pipelined (cp.async into
shared memory, ``num_stages``) by Triton as for any dot.

The layouts already match what ``dot_scaled`` wants, so nothing is repacked:

- ``w13 [E, 2I, H/2]`` uint8: row n of an expert holds K elements packed two a byte,
  element 2i in the LOW nibble. ``dot_scaled`` with ``lhs_k_pack=True`` (the default)
  takes an ``[M, K/2]`` uint8 tile "packed along K with the first element in the lower
  bits": a tile of weight rows is the lhs as loaded.
- ``w13_scale [E, 2I, H/32]`` uint8 E8M0: one scale per 32 K elements of a row, i.e. the
  ``[M, K/32]`` lhs scale tile as loaded.

Weights on the M side (swap AB). At decode an expert sees a handful of tokens. Putting the
MXFP4 weight on the lhs, ``acc^T [BN, BM] = W [BN, BK] . x^T [BK, BM]``, lets the weight
rows fill the MMA's M side (>= 64 rows a Hopper warpgroup) and the upcast weights feed the
MMA from registers; the few tokens of a block sit on the N side (BM >= 16, padded). The
accumulator is transposed once before the epilogue.

The pipeline (shared with :mod:`dsv4lab.kernels.moe`):

1. :func:`dsv4lab.kernels.moe_align.moe_align` groups the (token, expert) pairs by expert
   into blocks of at most BM rows (a fixed upper bound of blocks: no host sync);
2. :func:`_moe_scaled_gate_up_kernel`: one program per (block, tile of BN intermediate
   columns, split-K slice) walks K = hidden in steps of BK with two ``dot_scaled``
   accumulators (gate rows ``n`` and up rows ``I + n`` of w13) and writes
   ``act = silu(min(g, L)) * clamp(u, -L, L)`` (bf16 on the GPU: it is the next dot's bf16
   operand anyway). At decode (T = 1: 6 experts x 32 column tiles = 192 programs for 132
   SMs, each a single warpgroup) K is split (``SPLIT1``, chosen so that ~4 programs an SM
   run): the slices write fp32 partial (gate | up) rows and
   :func:`_moe_swiglu_partials_kernel` sums them in a fixed order and applies the SwiGLU;
3. :func:`_moe_scaled_down_kernel`: one program per (block, tile of BN hidden columns,
   split-K slice) streams w2 the same way and writes each pair's partial row times its
   routing weight;
4. ``_moe_combine_kernel`` of :mod:`dsv4lab.kernels.moe` sums the k rows (and split-K
   slices) of every token in a fixed order (deterministic, no atomics) and skips -1 ids.

Byte order for the MMA (``PERMK``). The MMA fragment of one thread holds K elements
{2c, 2c+1, 2c+8, 2c+9} of every 16, i.e. packed bytes c and c + 4 of every 8: loaded as
stored, every packed byte reaches its thread through a separate 8-bit shared-memory load
(and byte shuffles). A dot is a sum over K, so K may be permuted, the same way for both
operands: with ``PERMK`` the packed bytes of each 16-byte group (one scale block) are
viewed as a 4 x 4 transpose (logical byte 4m + c is stored byte 4c + m,
:func:`_permute_bytes`) and x is gathered in the same order (:func:`_k_order`). Each
thread's bytes are then 4 contiguous bytes (ldmatrix / 32-bit loads): on sm_90 the gate/up
K-loop drops from ~770 to ~650 SASS instructions a step (BN 64, BK 128) and the byte
loads disappear. The scale blocks are unchanged (the permutation stays inside a block) and
nothing is repacked in memory.

Numerics. x and the activations enter the dot as bf16 (x is usually bf16 already); the
upcast weights ``e2m1 * 2**(s-127)`` are exact in bf16 (2 mantissa bits, 8 exponent bits,
down to bf16's subnormal range); the dot accumulates in fp32. ``FAST_MATH`` (off by
default) lets Triton skip the NaN handling of the scale byte 0xFF.

Where it runs. ``tl.dot_scaled`` with an e2m1 x bf16 pair lowers on NVIDIA GPUs from sm_80
(Triton's generic decomposition into upcast + mma), see :data:`MIN_CAPABILITY`; the
launcher refuses older GPUs with a clear error. (Checked by compiling both kernels offline
for sm_80, sm_89, sm_90, sm_100 and sm_120 with Triton 3.9; first GPU run: sm_90, Triton 3.6.) Triton's
interpreter implements ``dot_scaled`` too, but (as with ``tl.dot``) its bf16 dot is not
trustworthy (it loses ~1% here), so under the interpreter the tokens side goes in as fp16
(``DOT_FMT``), which it computes exactly in fp32.

Explained in notebooks/04_mxfp4_moe_port.ipynb.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4lab.kernels.device import interpreting, sm_count
from dsv4lab.kernels.moe import _moe_combine_kernel, _swiglu, check_canonical
from dsv4lab.kernels.moe_align import block_rows, moe_align

# e2m1 x bf16 dot_scaled: Triton's decomposition (upcast + mma) needs an mma-capable GPU.
MIN_CAPABILITY = (8, 0)


@triton.jit
def _k_order(BK: tl.constexpr, PERMK: tl.constexpr):
    """Physical K index (within a step) of each logical K index the dot sees: [BK].

    PERMK: inside every 16-byte group of packed bytes (32 elements, one scale block),
    logical byte 4m + c is physical byte 4c + m (see :func:`_permute_bytes`); else identity."""
    k = tl.arange(0, BK)
    if PERMK:
        j = (k % 32) // 2
        k = (k // 32) * 32 + 2 * (4 * (j % 4) + j // 4) + k % 2
    return k


@triton.jit
def _permute_bytes(p, BN: tl.constexpr, BK: tl.constexpr, PERMK: tl.constexpr):
    """Packed bytes [BN, BK/2] as loaded -> the order the dot sees (PERMK: a 4x4 transpose
    inside every 16-byte group, so that the bytes one thread feeds to the MMA are 4
    contiguous bytes in memory instead of every 4th byte)."""
    if PERMK:
        p = tl.reshape(tl.permute(tl.reshape(p, (BN, BK // 32, 4, 4)), (0, 1, 3, 2)), (BN, BK // 2))
    return p


@triton.jit
def _dot_operand(v, DOT_FMT: tl.constexpr):
    """The tokens' side of the scaled dot in its format ("fp16" or "bf16")."""
    if DOT_FMT == "fp16":
        v = v.to(tl.float16)
    else:
        v = v.to(tl.bfloat16)
    return v


@triton.jit
def _moe_scaled_gate_up_kernel(
        x_ptr, w_ptr, s_ptr, sorted_pair_ptr, block_expert_ptr, block_start_ptr,
        block_count_ptr, act_ptr, I, K1_SPLIT,
        stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_act, stride_ps, swiglu_limit,
        TOPK: tl.constexpr, HAS_LIMIT: tl.constexpr, DOT_FMT: tl.constexpr,
        FAST_MATH: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        PERMK: tl.constexpr = False, SPLIT1: tl.constexpr = 1):
    b = tl.program_id(0)
    pn = tl.program_id(1)
    sp = tl.program_id(2)                        # split-K slice: K elements [sp*K1_SPLIT, +K1_SPLIT)
    e = tl.load(block_expert_ptr + b)
    if e < 0:                                    # unused tail block of the fixed grid
        return
    start, cnt, offs_m, mmask, pair = block_rows(block_start_ptr, block_count_ptr,
                                                 sorted_pair_ptr, b, BM)
    tok = (pair // TOPK).to(tl.int64)
    offs_n = pn * BN + tl.arange(0, BN)
    nmask = offs_n < I
    kb = tl.arange(0, BK // 2)                   # packed bytes of a step
    ks = tl.arange(0, BK // 32)                  # scale bytes of a step
    kx = _k_order(BK, PERMK)                     # K elements of a step (x side)
    e64 = e.to(tl.int64)
    row_w = e64 * stride_we + offs_n.to(tl.int64) * stride_wn
    wg = w_ptr + row_w[:, None] + kb[None, :]                    # [BN, BK/2] gate rows
    wu = wg + I * stride_wn                                      # up rows: I further
    row_s = e64 * stride_se + offs_n.to(tl.int64) * stride_sn
    sg = s_ptr + row_s[:, None] + ks[None, :]                    # [BN, BK/32]
    su = sg + I * stride_sn
    xt = x_ptr + tok[None, :] * stride_xt + kx[:, None]          # x^T tile: [BK, BM]
    acc_g = tl.zeros((BN, BM), dtype=tl.float32)
    acc_u = tl.zeros((BN, BM), dtype=tl.float32)
    for k1 in range(0, K1_SPLIT, BK):
        k0 = sp * K1_SPLIT + k1
        xv = tl.load(xt + k0, mask=mmask[None, :], other=0.0)
        xv = _dot_operand(xv, DOT_FMT)
        g = _permute_bytes(tl.load(wg + k0 // 2, mask=nmask[:, None], other=0), BN, BK, PERMK)
        gs = tl.load(sg + k0 // 32, mask=nmask[:, None], other=0)
        acc_g = tl.dot_scaled(g, gs, "e2m1", xv, None, DOT_FMT, acc_g, fast_math=FAST_MATH)
        u = _permute_bytes(tl.load(wu + k0 // 2, mask=nmask[:, None], other=0), BN, BK, PERMK)
        us = tl.load(su + k0 // 32, mask=nmask[:, None], other=0)
        acc_u = tl.dot_scaled(u, us, "e2m1", xv, None, DOT_FMT, acc_u, fast_math=FAST_MATH)
    gate = tl.trans(acc_g)                        # [BM, BN]
    up = tl.trans(acc_u)
    rows = (start + offs_m).to(tl.int64)
    omask = mmask[:, None] & nmask[None, :]
    if SPLIT1 == 1:                               # the whole K: SwiGLU here, act [P, I]
        act = _swiglu(gate, up, swiglu_limit, HAS_LIMIT)
        tl.store(act_ptr + rows[:, None] * stride_act + offs_n[None, :],
                 act.to(act_ptr.dtype.element_ty), mask=omask)
    else:                                         # partial sums [SPLIT1, P, 2I] (gate | up)
        po = act_ptr + sp.to(tl.int64) * stride_ps + rows[:, None] * stride_act + offs_n[None, :]
        tl.store(po, gate, mask=omask)
        tl.store(po + I, up, mask=omask)


@triton.jit
def _moe_swiglu_partials_kernel(part_ptr, act_ptr, block_expert_ptr, block_start_ptr,
                                block_count_ptr, I, stride_ps, stride_p, stride_act,
                                swiglu_limit, SPLIT1: tl.constexpr, HAS_LIMIT: tl.constexpr,
                                BM: tl.constexpr, BI: tl.constexpr):
    """Split-K gate/up: for the rows of block b, sum the SPLIT1 partials (fixed order),
    then SwiGLU: ``part [SPLIT1, P, 2I]`` fp32 -> ``act [P, I]``."""
    b = tl.program_id(0)
    if tl.load(block_expert_ptr + b) < 0:
        return
    rows = (tl.load(block_start_ptr + b) + tl.arange(0, BM)).to(tl.int64)
    rmask = tl.arange(0, BM) < tl.load(block_count_ptr + b)
    offs = tl.program_id(1) * BI + tl.arange(0, BI)
    m = rmask[:, None] & (offs < I)[None, :]
    g = tl.zeros((BM, BI), dtype=tl.float32)
    u = tl.zeros((BM, BI), dtype=tl.float32)
    for s1 in tl.static_range(SPLIT1):
        p = part_ptr + s1 * stride_ps + rows[:, None] * stride_p + offs[None, :]
        g += tl.load(p, mask=m, other=0.0)
        u += tl.load(p + I, mask=m, other=0.0)
    act = _swiglu(g, u, swiglu_limit, HAS_LIMIT)
    tl.store(act_ptr + rows[:, None] * stride_act + offs[None, :], act.to(act_ptr.dtype.element_ty),
             mask=m)


@triton.jit
def _moe_scaled_down_kernel(
        act_ptr, w_ptr, s_ptr, topk_w_ptr, sorted_pair_ptr, block_expert_ptr, block_start_ptr,
        block_count_ptr, ypair_ptr, H, K_SPLIT,
        stride_act, stride_we, stride_wn, stride_se, stride_sn, stride_y, stride_ys,
        DOT_FMT: tl.constexpr, FAST_MATH: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
        BK: tl.constexpr, PERMK: tl.constexpr = False):
    b = tl.program_id(0)
    pn = tl.program_id(1)
    sp = tl.program_id(2)                        # split-K slice: K elements [sp*K_SPLIT, +K_SPLIT)
    e = tl.load(block_expert_ptr + b)
    if e < 0:
        return
    start, cnt, offs_m, mmask, pair = block_rows(block_start_ptr, block_count_ptr,
                                                 sorted_pair_ptr, b, BM)
    offs_n = pn * BN + tl.arange(0, BN)
    nmask = offs_n < H
    kb = tl.arange(0, BK // 2)
    ks = tl.arange(0, BK // 32)
    kx = _k_order(BK, PERMK)
    e64 = e.to(tl.int64)
    kbase = sp * K_SPLIT
    w_rows = w_ptr + (e64 * stride_we + offs_n.to(tl.int64) * stride_wn)[:, None] + kb[None, :]
    s_rows = s_ptr + (e64 * stride_se + offs_n.to(tl.int64) * stride_sn)[:, None] + ks[None, :]
    at = act_ptr + (start + offs_m).to(tl.int64)[None, :] * stride_act + kx[:, None]   # [BK, BM]
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for k1 in range(0, K_SPLIT, BK):
        k0 = kbase + k1
        av = tl.load(at + k0, mask=mmask[None, :], other=0.0)
        av = _dot_operand(av, DOT_FMT)
        w = _permute_bytes(tl.load(w_rows + k0 // 2, mask=nmask[:, None], other=0), BN, BK, PERMK)
        ws = tl.load(s_rows + k0 // 32, mask=nmask[:, None], other=0)
        acc = tl.dot_scaled(w, ws, "e2m1", av, None, DOT_FMT, acc, fast_math=FAST_MATH)
    y = tl.trans(acc)                             # [BM, BN]
    wt = tl.load(topk_w_ptr + pair, mask=mmask, other=0.0).to(tl.float32)
    y = y * wt[:, None]
    tl.store(ypair_ptr + sp.to(tl.int64) * stride_ys + pair.to(tl.int64)[:, None] * stride_y
             + offs_n[None, :], y, mask=mmask[:, None] & nmask[None, :])


# --------------------------------------------------------------------- launcher ----------
# The tile table: the first row whose bound is >= the average rows per expert hit
# (P / min(P, E): 1.0 at T <= 42 with k = 6 and 256 experts, ~1.5 at T = 64, 6 at T = 256)
# wins. BM: tokens a block (the MMA's N side, >= 16); BN1/BN2: weight rows a program (the
# M side) of the gate/up and down kernels; BK1/BK2: K elements a step; SPLIT2: split-K
# slices of the down projection; FAST_MATH: skip the NaN handling of scale 0xFF.
# NOT yet timed on a GPU: dsv4lab/benchmarks/moe_scaled.py times these and a few variants.
# Chosen from offline sm_90 compiles (Triton 3.9, ptxas via cuobjdump resource usage):
# BN 64 / BK 128 / 4 warps / 6 stages pipelines every load (cp.async into shared), feeds
# wgmma (M = 64 weight rows) and needs ~126 registers, no spill, ~45 KB shared: 4 programs
# an SM. BK 256 at 4 warps hits 255 registers and spills (the upcast weights live in
# registers); BN 128 needs 8 warps. SPLIT1: split-K slices of the gate/up kernel, 0 = auto
# (:func:`_auto_split1`); PERMK: the K permutation described in the module docstring.
_DECODE = dict(BM=16, BN1=64, BN2=64, BK1=128, BK2=128, SPLIT2=2, FAST_MATH=False,
               SPLIT1=0, PERMK=True, num_warps=4, num_stages=6)
CONFIGS = [
    (2.0, _DECODE),                                                          # T <= ~64
    (16.0, dict(_DECODE, SPLIT2=1)),                                         # T ~ 256
    (float("inf"), dict(BM=64, BN1=128, BN2=128, BK1=128, BK2=128, SPLIT1=1, SPLIT2=1,  # prefill
                        FAST_MATH=False, PERMK=True, num_warps=8, num_stages=3)),
]
CONFIG_KEYS = ("BM", "BN1", "BN2", "BK1", "BK2", "SPLIT1", "SPLIT2", "FAST_MATH", "PERMK", "num_warps",
               "num_stages")


def config_for(T: int, topk: int, E: int) -> dict:
    """Tile sizes from :data:`CONFIGS` by the average rows per expert hit."""
    P = T * topk
    r = P / max(1, min(P, E))
    cfg = dict(next(c for bound, c in CONFIGS if r <= bound))
    if interpreting():
        cfg.update(num_stages=1)
    return cfg


def _pick_bk(K: int, want: int) -> int:
    """Largest power of two <= want (>= 32) dividing K (K is a multiple of 32)."""
    bk = max(32, triton.next_power_of_2(int(want)))
    while bk > 32 and K % bk:
        bk //= 2
    return bk


def _pick_split(steps: int, want: int) -> int:
    for s in range(max(1, min(int(want), steps)), 0, -1):
        if steps % s == 0:
            return s
    return 1


def _auto_split1(programs: int, steps: int, device: torch.device) -> int:
    """Split-K slices for the gate/up kernel so that ~4 programs an SM are launched
    (decode: 6 experts x 32 column tiles are too few for 132 SMs); a power of two <= 8."""
    sms = sm_count(device, cpu=4)
    s = 1
    while s < 8 and programs * s < 4 * sms and steps % (2 * s) == 0:
        s *= 2
    return s


def check_capability(device: torch.device) -> None:
    """Raise RuntimeError unless ``device`` can run e2m1 x bf16 ``tl.dot_scaled``."""
    if device.type != "cuda":
        if interpreting():
            return
        raise RuntimeError(f"fused_moe_scaled runs on a CUDA GPU or in Triton's interpreter "
                           f"(TRITON_INTERPRET=1); got device {device}")
    cap = torch.cuda.get_device_capability(device)
    if tuple(cap) < MIN_CAPABILITY:
        raise RuntimeError(f"fused_moe_scaled needs tl.dot_scaled (e2m1 x bf16), i.e. "
                           f"sm_{MIN_CAPABILITY[0]}{MIN_CAPABILITY[1]}+; this GPU is "
                           f"sm_{cap[0]}{cap[1]}")


def fused_moe_scaled(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, *,
                     swiglu_limit=None, config=None):
    """Grouped MXFP4 MoE on ``tl.dot_scaled``; ``[T, H]`` in x's dtype.

    Arguments as ``dsv4lab.ops.fused_moe`` with ``fmt="mxfp4"`` (callers validate them:
    ``w13 uint8 [E, 2I, H/2]`` low nibble = even K element, ``w13_scale uint8 [E, 2I, H/32]``
    E8M0, ``w2 [E, H, I/2]``, ``w2_scale [E, H, I/32]``, ``topk_ids [T, k]`` with -1 skipped).
    ``config`` overrides entries of :func:`config_for` (keys :data:`CONFIG_KEYS`). No host
    synchronisation: CUDA-graph capturable. Explained in notebooks/04_mxfp4_moe_port.ipynb.
    """
    check_capability(x.device)
    T, H = x.shape
    E, two_i, _ = w13.shape
    I = two_i // 2
    topk = topk_ids.shape[1]
    P = T * topk
    cfg = dict(config_for(T, topk, E), **(config or {}))
    unknown = set(cfg) - set(CONFIG_KEYS)
    if unknown:
        raise ValueError(f"config: unknown keys {sorted(unknown)}; expected some of {CONFIG_KEYS}")
    BM, BN1, BN2 = int(cfg["BM"]), int(cfg["BN1"]), int(cfg["BN2"])
    for name, v in (("BM", BM), ("BN1", BN1), ("BN2", BN2)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"config: {name} must be a power of two >= 16 (a dot side), got {v}")
    dev = x.device
    out = torch.empty(T, H, dtype=x.dtype, device=dev)
    if T == 0:
        return out.zero_()
    interp = interpreting()
    dot_fmt = "fp16" if interp else "bf16"
    check_canonical("moe_scaled.fused_moe_scaled", w13=w13, w13_scale=w13_scale, w2=w2,
                    w2_scale=w2_scale)
    x = x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    w13_scale, w2_scale = w13_scale.contiguous(), w2_scale.contiguous()
    ids = topk_ids.contiguous()
    tw = topk_weights.reshape(-1).contiguous()
    BK1, BK2 = _pick_bk(H, cfg["BK1"]), _pick_bk(I, cfg["BK2"])
    split = _pick_split(I // BK2, cfg["SPLIT2"])
    split1 = int(cfg.get("SPLIT1", 1))
    if split1 == 0:                               # auto: enough programs to fill the GPU
        split1 = _auto_split1(min(P, E) * triton.cdiv(I, BN1), H // BK1, dev)
    split1 = _pick_split(H // BK1, split1)
    sorted_pair, block_expert, block_start, block_count = moe_align(ids, E, BM)
    nbm = block_expert.numel()
    act = torch.empty(P, I, dtype=torch.float32 if interp else torch.bfloat16, device=dev)
    # split-K gate/up: fp32 partial (gate | up) rows, summed + SwiGLU by a small kernel
    part = torch.empty(split1, P, 2 * I, dtype=torch.float32, device=dev) if split1 > 1 else act[None]
    lim = float(swiglu_limit) if swiglu_limit is not None else 0.0
    ypair = torch.empty(split, P, H, dtype=torch.float32, device=dev)
    fast = bool(cfg["FAST_MATH"])
    permk = bool(cfg.get("PERMK", False))
    _moe_scaled_gate_up_kernel[(nbm, triton.cdiv(I, BN1), split1)](
        x, w13, w13_scale, sorted_pair, block_expert, block_start, block_count, part, I,
        H // split1, x.stride(0), w13.stride(0), w13.stride(1), w13_scale.stride(0),
        w13_scale.stride(1), part.stride(1), part.stride(0), lim,
        TOPK=topk, HAS_LIMIT=swiglu_limit is not None, DOT_FMT=dot_fmt, FAST_MATH=fast,
        BM=BM, BN=BN1, BK=BK1, PERMK=permk, SPLIT1=split1,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if split1 > 1:
        BI = max(16, min(2048 // BM, triton.next_power_of_2(I)))
        _moe_swiglu_partials_kernel[(nbm, triton.cdiv(I, BI))](
            part, act, block_expert, block_start, block_count, I, part.stride(0),
            part.stride(1), act.stride(0), lim,
            SPLIT1=split1, HAS_LIMIT=swiglu_limit is not None, BM=BM, BI=BI, num_warps=4)
    _moe_scaled_down_kernel[(nbm, triton.cdiv(H, BN2), split)](
        act, w2, w2_scale, tw, sorted_pair, block_expert, block_start, block_count, ypair,
        H, I // split,
        act.stride(0), w2.stride(0), w2.stride(1), w2_scale.stride(0), w2_scale.stride(1),
        ypair.stride(1), ypair.stride(0),
        DOT_FMT=dot_fmt, FAST_MATH=fast, BM=BM, BN=BN2, BK=BK2, PERMK=permk,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    BH = min(1024, triton.next_power_of_2(H))
    _moe_combine_kernel[(T, triton.cdiv(H, BH))](
        ypair, ids, out, H, E, ypair.stride(1), ypair.stride(0), out.stride(0),
        TOPK=topk, SPLIT=split, BH=BH, num_warps=4)
    return out
