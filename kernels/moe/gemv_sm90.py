"""The MoE of one decode token in one launch, as GEMVs on the CUDA cores (Gluon): the sm_90
fast path at T = 1 (hidden and intermediate sizes multiples of 2048, as Flash's are).

At T = 1 an expert's GEMM is a GEMV: the tensor cores' tile (one token padded to eight) buys
nothing. A warp walks whole rows: lane l owns the same 64 elements of every row of a
2048-element K slice, so it loads its x once (32 fp16x2 registers) and a warp's row load reads
1 KB contiguous. Per 4-byte word (:func:`block_dot_asm`) the nibbles become e5m2 bytes
(:mod:`.gluon_shared`) that ``prmt`` pairs into fp16 ``value * 2**-14``; ``fma.rn.f16x2``
with x sums a block in fp16 (x scaled per block by a power of two into [2**13, 2**14): the
sum stays below 192), then to fp32 times the block scale and x's factor. No scale touches a
weight; MXFP4 needs no row maximum.

The schedule: :func:`x_pairs_kernel` writes x's pairs and zeroes the counters; its
programmatic dependent launch :func:`decode_kernel` hands tiles out by a ticket counter, every
gate/up tile before any down tile, so a tile waits only for running ones (no deadlock):

- a gate/up tile: BN1 gate and BN1 up rows of a pair's expert over a K slice; the last slice
  to finish sums the slices in order, takes the SwiGLU, writes the down tiles' x pairs and
  releases the pair's count;
- a down tile: BN2 down rows of a pair, its first weight bytes requested before it waits; the
  last tile of a row range sums pairs and slices in a fixed order (the same bits every call).

Weights load evict-first, the next rows in flight. Wins at T = 1 (`dsv4lab bench moe`) on the
H200, the only GPU the dispatch runs it on. Explained in notebooks/04_mxfp4_moe_port.ipynb.
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from dsv4lab.kernels.gluon_compat import cta_barrier, gdc_launch_dependents, gdc_wait
from dsv4lab.kernels.launch import Launch, planned, workspace
from dsv4lab.kernels.moe.triton_moe import contiguous_args
from dsv4lab.kernels.moe.gluon_shared import CVT8_PLACE, e4m3_bits, swiglu

# the launch: gate/up and down rows a tile, rows a warp an iteration, warps a program
BN1, BN2, RB, NUM_WARPS = 32, 32, 2, 4
K_SLICE = 2048                 # elements of a row a tile takes (32 lanes x 64)
MAX_TOKENS = 8

# fp16 pairs of the placed bytes (l, h: the low, high nibbles'): d0, d1 = bytes 0-1, 2-3 of l,
# d2, d3 the same of h, i.e. the word's elements (0, 2), (4, 6), (1, 3), (5, 7)
_PAIRS = """prmt.b32 d0, l, 0, 0x1404;
prmt.b32 d1, l, 0, 0x3424;
prmt.b32 d2, h, 0, 0x1404;
prmt.b32 d3, h, 0, 0x3424;
"""


def block_dot_asm(nv: bool = False) -> str:
    """PTX for a lane's 16-byte block ($4-$7; x pair i of word j: $8 + 4 i + j) -> fp32 sums
    in $0 (MXFP4) or its 16-element halves' in $0, $1 (NVFP4); the rest 0."""
    body = [".reg .b32 a0, a1;", ".reg .b16 q0, q1;", ".reg .f32 f0, f1, g0, g1;"]
    for j in range(4):          # a scope a word: the placement declares its registers
        body.append("{\n.reg .b32 d0, d1, d2, d3;")
        body.append(CVT8_PLACE.replace("$4", f"${4 + j}"))
        body.append(_PAIRS)
        acc = f"a{(j // 2) if nv else 0}"
        for i in range(4):
            x = f"${8 + 4 * i + j}"
            if i == 0 and (j == 0 or (nv and j == 2)):
                body.append(f"mul.rn.f16x2 {acc}, d{i}, {x};")
            else:
                body.append(f"fma.rn.f16x2 {acc}, d{i}, {x}, {acc};")
        body.append("}")

    def to_f32(a, f, g):
        return (f"mov.b32 {{q0, q1}}, {a};\ncvt.f32.f16 {f}, q0;\ncvt.f32.f16 {g}, q1;\n"
                f"add.f32 {f}, {f}, {g};")
    body.append(to_f32("a0", "f0", "g0"))
    if nv:
        body.append(to_f32("a1", "f1", "g1"))
        body.append("mov.b32 $0, f0;\nmov.b32 $1, f1;")
        body.append("mov.b32 $2, 0;\nmov.b32 $3, 0;")
    else:
        body.append("mov.b32 $0, f0;")
        for k in range(1, 4):
            body.append(f"mov.b32 ${k}, 0;")
    return "{\n" + "\n".join(body) + "\n}"


_SLEEP_ASM = gl.constexpr("nanosleep.u32 500; mov.u32 $0, $1;")   # a waiting tile's poll


@triton.constexpr_function
def _layout(RB, per, W):
    """[W RB rows, 32 per columns]: warp w rows w RB ...; lane l columns l per ... (per each)."""
    return gl.BlockedLayout([RB, per], [1, 32], [W, 1], [1, 0])


@triton.constexpr_function
def _log2(n):
    return n.bit_length() - 1


@triton.constexpr_function
def _nsc(IS_NV):
    """Scale bytes a lane a row: its 64 elements hold 2 MXFP4 blocks, 4 NVFP4 ones."""
    return 4 if IS_NV else 2


@gluon.jit
def _scale32(sb, IS_NV: gl.constexpr):
    """Scale bytes -> fp32 multipliers of a block's sum (MXFP4 ``2**(s - 127)``, s = 0 -> 0)."""
    if IS_NV:
        return e4m3_bits(sb).to(gl.float32) * 256.0
    else:
        return (sb.to(gl.int32) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _row_index(it, r, RR: gl.constexpr, HALF: gl.constexpr, JUMP):
    """Local row r of iteration it -> its matrix row (blocks of HALF rows, JUMP apart)."""
    q = it * RR + r                     # >= 0, HALF a power of two: masks and shifts
    return (q & (HALF - 1)) + (q >> _log2(HALF)) * JUMP


@gluon.jit
def _load_iteration(w_base, s_base, it, stride_w4, stride_sn, JUMP, HALF: gl.constexpr,
                    RB: gl.constexpr, IS_NV: gl.constexpr, num_warps: gl.constexpr):
    """Iteration it's weight words [W RB, 256] and scale bytes [W RB, 32 NSC], evict-first."""
    RR: gl.constexpr = num_warps * RB
    WL: gl.constexpr = _layout(RB, 8, num_warps)
    SL: gl.constexpr = _layout(RB, _nsc(IS_NV), num_warps)
    cw = gl.arange(0, 256, layout=gl.SliceLayout(0, WL))
    cs = gl.arange(0, 32 * _nsc(IS_NV), layout=gl.SliceLayout(0, SL))
    rw = _row_index(it, gl.arange(0, RR, layout=gl.SliceLayout(1, WL)), RR, HALF, JUMP)
    rs = _row_index(it, gl.arange(0, RR, layout=gl.SliceLayout(1, SL)), RR, HALF, JUMP)
    p = gl.load(w_base + cw[None, :] + (rw * stride_w4)[:, None], eviction_policy="evict_first")
    s = gl.load(s_base + cs[None, :] + (rs * stride_sn)[:, None], eviction_policy="evict_first")
    return p, s


@gluon.jit
def _rows_dot(w_base, s_base, stride_w4, stride_sn, JUMP, xq_base, plane, cx_base, out_base,
              mult, pa, sa, R: gl.constexpr, HALF: gl.constexpr, RB: gl.constexpr,
              IS_NV: gl.constexpr, ASM: gl.constexpr, num_warps: gl.constexpr):
    """R rows of a 2048-element K slice times x's (:func:`_store_pairs`) times ``mult`` ->
    out_base[row], fp32. ``pa, sa``: iteration 0's loads; the next in flight meanwhile."""
    W: gl.constexpr = num_warps
    RR: gl.constexpr = W * RB
    NSC: gl.constexpr = _nsc(IS_NV)
    WL: gl.constexpr = _layout(RB, 8, W)
    SL: gl.constexpr = _layout(RB, NSC, W)
    cw = gl.arange(0, 256, layout=gl.SliceLayout(0, WL))
    cs = gl.arange(0, 32 * NSC, layout=gl.SliceLayout(0, SL))
    rs = gl.arange(0, RR, layout=gl.SliceLayout(1, SL))
    x0 = gl.expand_dims(gl.load(xq_base + cw), 0)
    x1 = gl.expand_dims(gl.load(xq_base + plane + cw), 0)
    x2 = gl.expand_dims(gl.load(xq_base + 2 * plane + cw), 0)
    x3 = gl.expand_dims(gl.load(xq_base + 3 * plane + cw), 0)
    cx = gl.expand_dims(gl.load(cx_base + cs // (NSC // 2)), 0)
    for it in range(R // RR):
        pn, sn = _load_iteration(w_base, s_base, gl.minimum(it + 1, R // RR - 1), stride_w4,
                                 stride_sn, JUMP, HALF, RB, IS_NV, W)
        o = gl.inline_asm_elementwise(ASM, "=f,=f,=f,=f" + ",r" * 20, [pa, x0, x1, x2, x3],
                                      dtype=gl.float32, is_pure=True, pack=4)
        o = gl.reshape(o, [RR, 64, 2, 2])
        if IS_NV:       # results 0 and 1 of each block: its two 16-element halves
            o, _ = gl.split(gl.permute(o, [0, 1, 3, 2]))
            o = gl.reshape(o, [RR, 128])
        else:           # result 0: the block
            o, _ = gl.split(o)
            o, _ = gl.split(o)
        o = gl.convert_layout(o, SL, assert_trivial=True)
        tot = gl.sum(o * _scale32(sa, IS_NV) * cx, axis=1) * mult
        gl.store(out_base + _row_index(it, rs, RR, HALF, JUMP), tot)
        pa, sa = pn, sn


@triton.constexpr_function
def _block_layout(W):
    """[blocks, 32]: a thread holds a 32-element block (its largest |value| in-thread)."""
    return gl.BlockedLayout([1, 32], [32, 1], [W, 1], [1, 0])


@gluon.jit
def _block_exponent(amax):
    """sx with ``amax * 2**sx`` in [2**13, 2**14) (0 for amax 0; clamped to +-100: normal)."""
    e = (amax.to(gl.int32, bitcast=True) >> 23) & 255
    return gl.minimum(gl.maximum(gl.where(amax > 0, 140 - e, 0), -100), 100)


@gluon.jit
def _store_pairs(q16_ptr, c_ptr, n, v, K):
    """Blocks v [blocks, 32] (elements n) -> fp16 ``v * 2**sx`` in the pair words [4, K / 8]
    and ``2**(14 - sx)`` at c_ptr[n // 32]: the x operand of :func:`_rows_dot`."""
    sx = _block_exponent(gl.max(gl.abs(v), axis=1))
    xs = (v * ((sx + 127) << 23).to(gl.float32, bitcast=True)[:, None]).to(gl.float16)
    r = n % 8
    gl.store(q16_ptr + ((r % 2) * 2 + r // 4) * (K // 4) + (n // 8) * 2 + (r // 2) % 2, xs)
    first = gl.max(n, axis=1) // 32        # n's blocks are whole: any element names it
    gl.store(c_ptr + first, ((141 - sx) << 23).to(gl.float32, bitcast=True))


@gluon.jit
def x_pairs_kernel(x_ptr, xq_ptr, xc_ptr, zero_ptr, n_zero, H, stride_x,
                   num_warps: gl.constexpr):
    """Token t's x -> :func:`_store_pairs`'s words; program (0, 0) zeroes the n_zero counters."""
    BL: gl.constexpr = _block_layout(num_warps)
    ONE: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    gdc_launch_dependents(num_warps)
    t = gl.program_id(0)
    pb = gl.program_id(1)
    if (t == 0) & (pb == 0):
        z = gl.arange(0, 32 * num_warps, layout=ONE)
        for z0 in range(0, n_zero, 32 * num_warps):
            gl.store(zero_ptr + z0 + z, 0, mask=z0 + z < n_zero)
    BH: gl.constexpr = 1024 * num_warps
    n = (pb * BH + gl.arange(0, BH // 32, layout=gl.SliceLayout(1, BL))[:, None] * 32
         + gl.arange(0, 32, layout=gl.SliceLayout(0, BL))[None, :])
    v = gl.load(x_ptr + t.to(gl.int64) * stride_x + n).to(gl.float32)
    _store_pairs(xq_ptr.to(gl.pointer_type(gl.float16)) + t.to(gl.int64) * H, xc_ptr + t * (H // 32),
                 n, v, H)


@gluon.jit
def _ticket(ctr_ptr, num_warps: gl.constexpr):
    """Wait for x's pairs and the counters, then take the next ticket (tiles in start order)."""
    gdc_wait(num_warps)
    return gl.atomic_add(ctr_ptr, 1, sem="relaxed", scope="gpu")


@gluon.jit
def _wait_count(ptr, target):
    """Spin (acquire, sleeping between polls) until the counter at ptr reaches target."""
    seen = gl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = gl.inline_asm_elementwise(_SLEEP_ASM, "=r,r", [seen], dtype=gl.int32,
                                         is_pure=False, pack=1)
        seen = gl.atomic_add(ptr, 0, sem="acquire", scope="gpu")


@gluon.jit
def _sum_pairs(total, ypair_ptr, ids_ptr, out_ptr, offs_h, m, P, T, TOPK, SPLIT2, stride_y,
               stride_out):
    """out[token m, offs_h] = ``total`` plus ypair's rows of m's live pairs, in a fixed order."""
    for q in range(P):
        live = (m == q // TOPK)[None, :] & (gl.load(ids_ptr + q) >= 0)
        for q2 in range(SPLIT2):
            total += gl.load(ypair_ptr + (q2 * P + q) * stride_y + offs_h[:, None]
                             + m[None, :] * 0, mask=live, other=0.0, cache_modifier=".cg")
    gl.store(out_ptr + m[None, :].to(gl.int64) * stride_out + offs_h[:, None],
             total.to(out_ptr.dtype.element_ty), mask=(m < T)[None, :])


@gluon.jit
def _gate_up_tile(tile, xq_ptr, xc_ptr, w13_ptr, s13_ptr, g13_ptr, ids_ptr, aq_ptr, ac_ptr,
                  part_ptr, ctr_ptr, P, TOPK, I, H, n_tiles1, n_tiles2, stride_w13e,
                  stride_w13n, stride_s13e, stride_s13n, swiglu_limit, IS_NV: gl.constexpr,
                  HAS_LIMIT: gl.constexpr, BN1: gl.constexpr, RB: gl.constexpr,
                  ASM: gl.constexpr, num_warps: gl.constexpr):
    """Pair p's BN1 gate and up rows over K slice sp -> part[sp, p]; the last slice writes the
    SwiGLU as the down tiles' x and releases the pair's count."""
    S1 = H // 2048
    g = tile // S1
    sp = tile % S1
    p = g // n_tiles1
    pn = g % n_tiles1
    e = gl.load(ids_ptr + p)
    if e >= 0:
        t = p // TOPK
        row0 = pn * BN1
        w_base = (w13_ptr + e.to(gl.int64) * stride_w13e + row0.to(gl.int64) * stride_w13n
                  ).to(gl.pointer_type(gl.int32)) + sp * 256
        s_base = s13_ptr + e.to(gl.int64) * stride_s13e + row0.to(gl.int64) * stride_s13n + sp * 32 * _nsc(IS_NV)
        pa, sa = _load_iteration(w_base, s_base, 0, stride_w13n // 4, stride_s13n, I, BN1, RB,
                                 IS_NV, num_warps)
        mult = 1.0
        if IS_NV:
            mult = gl.load(g13_ptr + e)
        _rows_dot(w_base, s_base, stride_w13n // 4, stride_s13n, I,
                  xq_ptr + t.to(gl.int64) * (H // 2) + sp * 256, H // 8,
                  xc_ptr + t * (H // 32) + sp * 64, part_ptr + (sp * P + p).to(gl.int64) * (2 * I) + row0,
                  mult, pa, sa, 2 * BN1, BN1, RB, IS_NV, ASM, num_warps)
    cta_barrier()
    last = gl.atomic_add(ctr_ptr + 1 + P + n_tiles2 + g, 1, sem="acq_rel", scope="gpu") == S1 - 1
    if last & (e >= 0):     # the row tile's last slice: sum in slice order, the SwiGLU
        BL: gl.constexpr = _layout(1, 1, num_warps)    # an element a thread: few registers
        n = (pn * BN1 + gl.arange(0, BN1 // 32, layout=gl.SliceLayout(1, BL))[:, None] * 32
             + gl.arange(0, 32, layout=gl.SliceLayout(0, BL))[None, :])
        gate = gl.zeros([BN1 // 32, 32], gl.float32, layout=BL)
        up = gl.zeros([BN1 // 32, 32], gl.float32, layout=BL)
        for q in range(S1):
            row = part_ptr + (q * P + p).to(gl.int64) * (2 * I)
            gate += gl.load(row + n, cache_modifier=".cg")
            up += gl.load(row + I + n, cache_modifier=".cg")
        _store_pairs(aq_ptr.to(gl.pointer_type(gl.float16)) + p.to(gl.int64) * I,
                     ac_ptr + p * (I // 32), n, swiglu(gate, up, swiglu_limit, HAS_LIMIT), I)
    if last:
        cta_barrier()                         # every thread's stores, then one release
        gl.atomic_add(ctr_ptr + 1 + p, 1, sem="release", scope="gpu")


@gluon.jit
def _down_tile(d, w2_ptr, s2_ptr, g2_ptr, ids_ptr, topk_w_ptr, aq_ptr, ac_ptr, ypair_ptr,
               out_ptr, ctr_ptr, P, T, TOPK, I, H, n_tiles1, n_tiles2, stride_w2e, stride_w2n,
               stride_s2e, stride_s2n, stride_out, IS_NV: gl.constexpr, BN2: gl.constexpr,
               RB: gl.constexpr, ASM: gl.constexpr, num_warps: gl.constexpr):
    """Pair p's act (K slice sp) times BN2 down rows and its routing weight -> ypair[sp, p];
    the last tile of those rows sums ypair into out."""
    S2 = I // 2048
    sp = d % S2
    p = d // S2 // n_tiles2
    pn = d // S2 % n_tiles2
    e = gl.load(ids_ptr + p)
    if e >= 0:
        row0 = pn * BN2
        w_base = (w2_ptr + e.to(gl.int64) * stride_w2e + row0.to(gl.int64) * stride_w2n
                  ).to(gl.pointer_type(gl.int32)) + sp * 256
        s_base = s2_ptr + e.to(gl.int64) * stride_s2e + row0.to(gl.int64) * stride_s2n + sp * 32 * _nsc(IS_NV)
        pa, sa = _load_iteration(w_base, s_base, 0, stride_w2n // 4, stride_s2n, 0, BN2, RB,
                                 IS_NV, num_warps)
        mult = gl.load(topk_w_ptr + p).to(gl.float32)
        if IS_NV:
            mult = mult * gl.load(g2_ptr + e)
        _wait_count(ctr_ptr + 1 + p, n_tiles1)
        _rows_dot(w_base, s_base, stride_w2n // 4, stride_s2n, 0,
                  aq_ptr + p.to(gl.int64) * (I // 2) + sp * 256, I // 8, ac_ptr + p * (I // 32) + sp * 64,
                  ypair_ptr + (sp * P + p).to(gl.int64) * H + row0, mult, pa, sa, BN2,
                  BN2, RB, IS_NV, ASM, num_warps)
    cta_barrier()
    done = gl.atomic_add(ctr_ptr + 1 + P + pn, 1, sem="acq_rel", scope="gpu")
    if done == P * S2 - 1:                # the last of this row tile's down tiles
        OL: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [num_warps, 1], [0, 1])
        offs_h = pn * BN2 + gl.arange(0, BN2, layout=gl.SliceLayout(1, OL))
        m = gl.arange(0, 8, layout=gl.SliceLayout(0, OL))
        _sum_pairs(gl.zeros([BN2, 8], gl.float32, layout=OL), ypair_ptr, ids_ptr, out_ptr, offs_h,
                   m, P, T, TOPK, S2, H, stride_out)


@gluon.jit
def decode_kernel(xq_ptr, xc_ptr, w13_ptr, s13_ptr, g13_ptr, w2_ptr, s2_ptr, g2_ptr, ids_ptr,
                  topk_w_ptr, aq_ptr, ac_ptr, part_ptr, ypair_ptr, out_ptr, ctr_ptr, P, T, TOPK,
                  I, H, stride_w13e, stride_w13n, stride_s13e, stride_s13n, stride_w2e,
                  stride_w2n, stride_s2e, stride_s2n, stride_out, swiglu_limit,
                  IS_NV: gl.constexpr, HAS_LIMIT: gl.constexpr, BN1: gl.constexpr,
                  BN2: gl.constexpr, RB: gl.constexpr, ASM: gl.constexpr,
                  num_warps: gl.constexpr):
    """The MoE of T <= 8 tokens in one launch, a GEMV a pair. Counters: [0] the ticket;
    [1 + p] pair p's finished gate/up row tiles; [1 + P + n] row tile n's finished down tiles;
    [1 + P + H / BN2 + g] gate/up row tile g's finished K slices (2048 elements each)."""
    n_tiles1 = I // BN1
    n_tiles2 = H // BN2
    n_gu = P * n_tiles1 * (H // 2048)
    tile = _ticket(ctr_ptr, num_warps)
    if tile < n_gu:
        _gate_up_tile(tile, xq_ptr, xc_ptr, w13_ptr, s13_ptr, g13_ptr, ids_ptr, aq_ptr, ac_ptr,
                      part_ptr, ctr_ptr, P, TOPK, I, H, n_tiles1, n_tiles2, stride_w13e,
                      stride_w13n, stride_s13e, stride_s13n, swiglu_limit, IS_NV, HAS_LIMIT,
                      BN1, RB, ASM, num_warps)
    else:
        _down_tile(tile - n_gu, w2_ptr, s2_ptr, g2_ptr, ids_ptr, topk_w_ptr, aq_ptr, ac_ptr,
                   ypair_ptr, out_ptr, ctr_ptr, P, T, TOPK, I, H, n_tiles1, n_tiles2, stride_w2e,
                   stride_w2n, stride_s2e, stride_s2n, stride_out, IS_NV, BN2, RB, ASM, num_warps)


class DecodeLaunches:
    """The two launches of :func:`fused_decode` for one device, shape and format, with buffers."""

    def __init__(self, device, T, H, E, I, topk, fmt, has_limit):
        P = T * topk
        is_nv = fmt == "nvfp4"
        self.T, self.H, self.I, self.P, self.is_nv = T, H, I, P, is_nv
        n_ctr = 1 + P + H // BN2 + P * (I // BN1)
        self.ws_key = ("gemv_sm90", T, H, I, P)
        self.x_pairs = Launch(x_pairs_kernel, (T, H // 1024),
                              dict(n_zero=n_ctr, H=H, stride_x=H, num_warps=1), device=device,
                              guard=(0,))
        nsc = 2 if is_nv else 1                     # scale bytes a 32-element block
        grid = (P * (I // BN1) * (H // K_SLICE) + P * (H // BN2) * (I // K_SLICE),)
        self.decode = Launch(decode_kernel, grid, dict(
            P=P, T=T, TOPK=topk, I=I, H=H, stride_w13e=2 * I * H // 2, stride_w13n=H // 2,
            stride_s13e=2 * I * H // 32 * nsc, stride_s13n=H // 32 * nsc,
            stride_w2e=H * I // 2, stride_w2n=I // 2, stride_s2e=H * I // 32 * nsc,
            stride_s2n=I // 32 * nsc, stride_out=H, IS_NV=is_nv, HAS_LIMIT=has_limit, BN1=BN1,
            BN2=BN2, RB=RB, ASM=block_dot_asm(is_nv), num_warps=NUM_WARPS), device=device,
            guard=(2, 3, 4, 5, 6, 7, 8, 9), launch_pdl=True)
        self.n_ctr = n_ctr

    def _buffers(self, dev):
        T, H, I, P = self.T, self.H, self.I, self.P
        return (torch.empty(T, 4, H // 8, dtype=torch.int32, device=dev),
                torch.empty(T, H // 32, dtype=torch.float32, device=dev),
                torch.empty(P, 4, I // 8, dtype=torch.int32, device=dev),
                torch.empty(P, I // 32, dtype=torch.float32, device=dev),
                torch.empty(H // K_SLICE * P, 2 * I, dtype=torch.float32, device=dev),
                torch.empty(I // K_SLICE * P, H, dtype=torch.float32, device=dev),
                torch.empty(self.n_ctr, dtype=torch.int32, device=dev))

    def __call__(self, x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, w13_global,
                 w2_global, swiglu_limit):
        dev = x.device
        out = torch.empty(self.T, self.H, dtype=x.dtype, device=dev)
        if self.P == 0:
            return out.zero_()
        xq, xc, aq, ac, part, ypair, counters = workspace(self.ws_key, dev,
                                                          lambda: self._buffers(dev))
        if self.is_nv:
            w13_scale, w2_scale = w13_scale.view(torch.uint8), w2_scale.view(torch.uint8)
        self.x_pairs(x, xq, xc, counters)
        g13 = w13_global if self.is_nv else xc
        g2 = w2_global if self.is_nv else xc
        self.decode(xq, xc, w13, w13_scale, g13, w2, w2_scale, g2, topk_ids, topk_weights, aq, ac,
                    part, ypair, out, counters,
                    float(swiglu_limit) if swiglu_limit is not None else 0.0)
        return out


_LAUNCHES: dict = {}


def fused_decode(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, *, fmt="mxfp4",
                 w13_global=None, w2_global=None, swiglu_limit=None):
    """The FP4 MoE of T <= 8 tokens (arguments as ``dsv4lab.ops.fused_moe``, checked; sizes
    multiples of 2048, weights and scales 16-byte aligned) in two launches. No host sync."""
    T, H = x.shape
    E, two_i, _ = w13.shape
    I = two_i // 2
    if H % K_SLICE or I % K_SLICE or not 1 <= T <= MAX_TOKENS:
        raise ValueError(f"gemv_sm90: hidden and intermediate sizes must be multiples of {K_SLICE} "
                         f"and T in 1..{MAX_TOKENS}; got hidden {H}, intermediate {I}, T {T}")
    dev = x.device
    launches = planned(_LAUNCHES, (dev, T, H, E, I, topk_ids.shape[1], fmt,
                                   swiglu_limit is not None), dev,
                       lambda: DecodeLaunches(dev, T, H, E, I, topk_ids.shape[1], fmt,
                                              swiglu_limit is not None))
    return launches(*contiguous_args(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights,
                                 w13_global, w2_global), swiglu_limit)
