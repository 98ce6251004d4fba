"""The MoE of one decode token as GEMVs on the CUDA cores, x held in registers (Gluon; sm_80+).

The idea. At T = 1 an expert's GEMM is a GEMV: every weight is used once, by one token.
The tensor-core kernels of :mod:`dsv4lab.kernels.moe_mma2` feed the mma a tile padded from
one token to eight and reload x's fragments from the L1 every K-step. Here a warp walks
whole rows instead: lane l owns the same 64 elements of every row of its K slice of 2048
(32 packed bytes, two MXFP4 blocks), so it loads its x once, as 32 fp16x2 registers, and a
warp's load of a row reads 1 KB of contiguous bytes. Per 4-byte word (8 elements,
:func:`block_dot_asm`):

- the low and the high nibbles placed as e5m2 bytes ``s 000 e1 e0 m 0`` (CVT8's 7
  instructions, :mod:`dsv4lab.kernels.moe_mma2`'s ``_CVT8_PLACE``), which are the high bytes of the fp16
  ``value * 2**-14``; four ``prmt`` (or ``cvt.rn.f16x2.e5m2x2``, ``dec``) make the fp16 pairs;
- four ``fma.rn.f16x2`` with the lane's x pairs, summed in fp16 over the block's 32 elements
  (x scaled per block by a power of two so that the products stay normal and the sums
  bounded: ``|x| 2**sx`` in [2**13, 2**14), so a product is below 6 and a block's sum below
  192), then the block's sum to fp32, times its scale (E8M0 ``2**(e - 127)``, or each
  16-element half's E4M3, decoded by bit placement on every GPU: moe_mma2's ``_mult32``)
  and the factor that undoes x's;
- the row's 32 lane sums reduced across the warp.

No block scale touches a weight, MXFP4 needs no row maximum, and a pair of x elements is the
adjacent fp16 pair of a word of x's copy (:func:`x_pairs`, :func:`_store_pairs`). The gate/up
loop: 350 SASS instructions for a lane's 16 words (offline sm_90, ``python3
scripts/sass_moe_decode.py --simt``), ~22 a word; the register ring's launch executes ~24 a
word (Nsight Compute, session 21). 80 registers: 6 programs of 4 warps an SM.

The launch (:func:`_decode_kernel`) is moe_mma2's ``FUSED`` schedule: x's pairs and the
zeroed counters from a first small launch (:func:`_x_pairs_kernel`), then one ticketed
launch: gate/up tiles (BN1 gate rows and their up rows, a K slice each, the slices summed by
the last to finish, which writes the SwiGLU as the down tiles' x pairs), then down tiles
(BN2 rows of a pair's down projection, which ask for their first weight bytes before they wait
for the pair), the pairs summed by a row tile's last down tile in a fixed order. Each warp's
next RB rows are in flight while it works on these (``AHEAD``), under the L2 evict-first policy.

Measured (H200; `dsv4lab bench moe` rows at 3bae2cd, three runs, at 78e1e04, two, at 7eb340a and
at c260229): T = 1 MXFP4 37.2 / 37.4 / 37.6 / 37.3 / 37.2 / 37.4 / 37.5 us (0.509 / 0.506 / 0.504 /
0.507 / 0.508 / 0.506 / 0.504 of the FP4-bytes roofline), against 44.7-44.9 for the register ring
in the same runs (variant ``mma2_regs_t1``); NVFP4 42.0-42.1 with the fp8 conversion of its scales
(96 registers), 40.1-40.4 with the E4M3 bit placement (80). The read-only probe had shown the way
(scripts/probe_simt_gemv.py, printout at 3a6d357): these rows times x, the gate/up rows alone
21.5 us as a graph launch, as fast as reading them (stream_read 21.0, the register ring's
pattern 23.5), and with the down rows (two launches) 32.1-33.4, as the reads (33.5).
Its timeline (scripts/profile_moe.py --timeline, at 82738fe, after the L2 flush): the
gate/up loops run from 1.3 us to 15.4 (p50; 18.2 the last), 51 MB at ~3.6 TB/s while most run,
2.1 us after a loop (the slices' sum, the SwiGLU, the release); the down loops start at
19.7-22.0 us and take 5.4, and the last row's sum ends the launch at 30.7. What remains is
the stragglers at the end of each phase and the chain of latencies between them.
Measured slower (ab_moe_t1 printouts, session 22; MXFP4 against 37.3-37.9 in the same runs):
other tiles (BN1 / BN2 64 / 64 54.5, 64 / 32 48.7, 32 / 16 39.5, 32 / 8 44.1), 2 or 8 warps
(43.4-54.4), RB 1 (45.2) or 4 (40.6 at 2 warps), two iterations in flight (AHEAD 2, 128
registers: 40.1), a register cap (72: 38.8-39.5; 64: 43.1), the ``cvt`` pairs or two fp16
chains (37.6-37.8), the down tiles' weights asked of the L2 before their wait (39.7: the
gate/up tail moves later), a shorter poll (SLEEP 100 or 20: no gain); tiles over the whole
K (their slices side by side in warp columns, no partial sums; 735f3e4): 47.0, because 384
gate/up tiles leave an SM's other slots to down tiles that spin; a down tile summing a
token's pairs in registers (no combine; cabc8a2, its results wrong and not debugged): 39.8,
its pairs running one after another. x's copy in 1024-element programs (``XW`` 1): 37.4
against 37.7-38.8 with 2048. Explained in notebooks/04_mxfp4_moe_port.ipynb.

:func:`rows_times_x` (one matrix's rows, a launch of :func:`_rows_kernel`) is the probe's.
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from dsv4lab.kernels.device import pdl_ok
from dsv4lab.kernels.gluon_compat import cta_barrier, gdc_launch_dependents
from dsv4lab.kernels import moe_mma2
from dsv4lab.kernels.moe_mma2 import (TIMELINE, _mult32, _stamp, _sum_pairs,
                                      _swiglu, _ticket, _wait_count)

# the fp16 pairs of the placed bytes (moe_mma2._CVT8_PLACE: l the low nibbles' e5m2 bytes, h
# the high ones', l0 l1 h0 h1 their halves): d0 (bytes 0, 1 of l), d1 (2, 3 of l), d2, d3 (the
# same of h), i.e. the elements (0, 2), (4, 6), (1, 3), (5, 7) of the word
_PAIRS = {
    "prmt": """prmt.b32 d0, l, 0, 0x1404;
prmt.b32 d1, l, 0, 0x3424;
prmt.b32 d2, h, 0, 0x1404;
prmt.b32 d3, h, 0, 0x3424;
""",
    "cvt": """cvt.rn.f16x2.e5m2x2 d0, l0;
cvt.rn.f16x2.e5m2x2 d1, l1;
cvt.rn.f16x2.e5m2x2 d2, h0;
cvt.rn.f16x2.e5m2x2 d3, h1;
""",
}


def block_dot_asm(dec: str = "prmt", chains: int = 1, nv: bool = False) -> str:
    """PTX for one lane's 16-byte block: operands $0-$3 the fp32 results, $4-$7 the 4 words,
    $8 + 4 i + j the x pair i of word j. ``chains`` fp16x2 accumulators (1: all 16 fma in one;
    2: words 0-1 and 2-3); the results: the block's sum in $0, or (``nv``: NVFP4's two scale
    blocks, always two chains) words 0-1 in $0 and 2-3 in $1; the other results are 0."""
    chains, outs = (2, 2) if nv else (chains, 1)
    body = [".reg .b32 a0, a1;", ".reg .b16 q0, q1;", ".reg .f32 f0, f1, g0, g1;"]
    for j in range(4):          # a scope a word: the placement declares its registers
        body.append("{\n.reg .b32 d0, d1, d2, d3;")
        body.append(moe_mma2._CVT8_PLACE.replace("$4", f"${4 + j}"))
        body.append(_PAIRS[dec])
        acc = f"a{(j // 2) if chains == 2 else 0}"
        for i in range(4):
            x = f"${8 + 4 * i + j}"
            if i == 0 and (j == 0 or (chains == 2 and j == 2)):
                body.append(f"mul.rn.f16x2 {acc}, d{i}, {x};")
            else:
                body.append(f"fma.rn.f16x2 {acc}, d{i}, {x}, {acc};")
        body.append("}")
    def to_f32(a, f, g):
        return (f"mov.b32 {{q0, q1}}, {a};\ncvt.f32.f16 {f}, q0;\ncvt.f32.f16 {g}, q1;\n"
                f"add.f32 {f}, {f}, {g};")
    if chains == 1:
        body.append(to_f32("a0", "f0", "g0"))
        body.append("mov.b32 $0, f0;")
        for k in range(1, 4):
            body.append(f"mov.b32 ${k}, 0;")
    else:
        body.append(to_f32("a0", "f0", "g0"))
        body.append(to_f32("a1", "f1", "g1"))
        if outs == 1:
            body.append("add.f32 f0, f0, f1;\nmov.b32 $0, f0;\nmov.b32 $1, 0;")
        else:
            body.append("mov.b32 $0, f0;\nmov.b32 $1, f1;")
        body.append("mov.b32 $2, 0;\nmov.b32 $3, 0;")
    return "{\n" + "\n".join(body) + "\n}"


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
def _row_index(it, r, RR: gl.constexpr, HALF: gl.constexpr, JUMP):
    """Local row r of iteration it -> its row of the matrix (from the first): the tile's rows
    run in blocks of HALF, JUMP apart (a gate/up tile: its gate rows, then the up rows)."""
    q = it * RR + r                     # >= 0, HALF a power of two: masks and shifts
    return (q & (HALF - 1)) + (q >> _log2(HALF)) * JUMP


@gluon.jit
def _load_iteration(w_base, s_base, it, stride_w4, stride_sn, JUMP, HALF: gl.constexpr,
                    RB: gl.constexpr, IS_NV: gl.constexpr, num_warps: gl.constexpr):
    """Iteration it's weight words [W RB, 256] and scale bytes [W RB, 32 NSC] (each lane its
    32 bytes of a row, two 16-byte loads, and their scales) under the L2 evict-first policy.
    ``w_base``: int32 pointer to the first row's slice, ``s_base``: its scales;
    ``stride_w4``: words a row."""
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
def _rows_start(w_base, s_base, stride_w4, stride_sn, JUMP, R: gl.constexpr,
                HALF: gl.constexpr, RB: gl.constexpr, IS_NV: gl.constexpr,
                AHEAD: gl.constexpr, num_warps: gl.constexpr):
    """The loads of :func:`_rows_dot`'s first AHEAD iterations (issued apart, so that a tile
    may ask for them before it waits): (words, scales) of iteration 0, then of iteration 1
    (AHEAD 2; else iteration 0's again, unused)."""
    pa, sa = _load_iteration(w_base, s_base, 0, stride_w4, stride_sn, JUMP, HALF, RB, IS_NV,
                             num_warps)
    pb, sb = pa, sa
    if AHEAD == 2:
        pb, sb = _load_iteration(w_base, s_base, gl.minimum(1, R // (num_warps * RB) - 1),
                                 stride_w4, stride_sn, JUMP, HALF, RB, IS_NV, num_warps)
    return pa, sa, pb, sb


@gluon.jit
def _rows_dot(w_base, s_base, stride_w4, stride_sn, JUMP, xq_base, plane, cx_base, out_base,
              mult, pa, sa, pb, sb, R: gl.constexpr, HALF: gl.constexpr, RB: gl.constexpr,
              IS_NV: gl.constexpr, ASM: gl.constexpr, AHEAD: gl.constexpr,
              num_warps: gl.constexpr):
    """R rows (see :func:`_row_index`) of a 2048-element K slice times x's slice, times
    ``mult``, into out_base[row] (fp32). x's slice: the pair words ``xq_base + i plane + w``
    (i < 4, w < 256; :func:`block_dot_asm`'s order) and the factors ``cx_base[b]`` (b < 64)
    of :func:`x_pairs`. ``pa``...: :func:`_rows_start`'s loads. Each iteration a warp takes
    RB rows; the bytes of the AHEAD iterations after it are in flight while it works."""
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
        pn, sn = _load_iteration(w_base, s_base, gl.minimum(it + AHEAD, R // RR - 1), stride_w4,
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
        tot = gl.sum(o * _mult32(sa, IS_NV) * cx, axis=1) * mult
        gl.store(out_base + _row_index(it, rs, RR, HALF, JUMP), tot)
        if AHEAD == 2:
            pa, sa = pb, sb
            pb, sb = pn, sn
        else:
            pa, sa = pn, sn


@gluon.jit
def _rows_kernel(w_ptr, s_ptr, xq_ptr, cx_ptr, out_ptr, stride_wn, stride_sn, stride_xs,
                 stride_cs, stride_os, RB: gl.constexpr, R: gl.constexpr, IS_NV: gl.constexpr,
                 ASM: gl.constexpr, num_warps: gl.constexpr):
    """The probe: rows R tile .. of one matrix times K slice ``program_id(1)`` of x."""
    tile = gl.program_id(0)
    sl = gl.program_id(1)
    NSC: gl.constexpr = _nsc(IS_NV)
    w_base = (w_ptr + (tile * R).to(gl.int64) * stride_wn).to(gl.pointer_type(gl.int32)) + sl * 256
    s_base = s_ptr + (tile * R).to(gl.int64) * stride_sn + sl * 32 * NSC
    pa, sa, pb, sb = _rows_start(w_base, s_base, stride_wn // 4, stride_sn, 0, R, R, RB, IS_NV,
                                 1, num_warps)
    _rows_dot(w_base, s_base, stride_wn // 4, stride_sn, 0, xq_ptr + sl * stride_xs, 4 * stride_xs,
              cx_ptr + sl * stride_cs, out_ptr + sl * stride_os + tile * R, 1.0, pa, sa, pb, sb,
              R, R, RB, IS_NV, ASM, 1, num_warps)


def x_pairs(x: torch.Tensor, slices: int):
    """x [K] (fp32) -> (xq int32 [slices, 4, K / slices / 8]: the fp16 pairs of each word in
    :func:`block_dot_asm`'s order, each lane-block scaled by 2**sx; cx fp32 [slices, K / 32 /
    slices]: 2**(14 - sx), what a block's fp32 sum owes)."""
    blk = x.float().reshape(-1, 32)
    amax = blk.abs().amax(1)
    sx = torch.where(amax > 0, 13 - torch.floor(torch.log2(amax.clamp_min(1e-30))), torch.zeros_like(amax))
    xs = (blk * torch.exp2(sx)[:, None]).to(torch.float16).reshape(-1, 8)   # words
    order = torch.tensor([[0, 2], [4, 6], [1, 3], [5, 7]])
    pairs = xs[:, order]                                     # [words, 4, 2]
    bits = pairs.contiguous().view(torch.int32).reshape(-1, 4)   # [words, 4]
    xq = bits.t().reshape(4, slices, -1).permute(1, 0, 2).contiguous()
    cx = torch.exp2(14 - sx).reshape(slices, -1).contiguous()
    return xq, cx


def rows_times_x(w: torch.Tensor, s: torch.Tensor, x: torch.Tensor, *, slices: int = 1,
                 R: int = 64, RB: int = 2, dec: str = "prmt", chains: int = 1, num_warps: int = 4,
                 xq=None, cx=None, out=None):
    """MXFP4 rows w [N, K / 2] (uint8), scales s [N, K / 32] times x [K] -> [slices, N] fp32
    partial dot products over the K slices (the probe; N a multiple of R, K / slices = 2048)."""
    N, half_k = w.shape
    if half_k // slices != 1024 or N % R or R % (num_warps * RB):
        raise ValueError(f"rows_times_x: K / slices must be 2048 and R a multiple of num_warps x RB "
                         f"dividing N; got K {2 * half_k}, slices {slices}, N {N}, R {R}")
    if xq is None:
        xq, cx = x_pairs(x, slices)
    if out is None:
        out = torch.empty(slices, N, dtype=torch.float32, device=w.device)
    _rows_kernel[(N // R, slices)](w, s, xq, cx, out, w.stride(0), s.stride(0), xq.stride(0),
                                   cx.stride(0), out.stride(0), RB=RB, R=R, IS_NV=False,
                                   ASM=block_dot_asm(dec, chains), num_warps=num_warps)
    return out


@triton.constexpr_function
def _block_layout(W):
    """[blocks, 32]: a thread holds a 32-element block (its largest |value| in-thread)."""
    return gl.BlockedLayout([1, 32], [32, 1], [W, 1], [1, 0])


@gluon.jit
def _block_exponent(amax):
    """sx of a block whose largest |value| is amax: ``amax * 2**sx`` in [2**13, 2**14) (0 for
    an all-zero block; within +-100, so that 2**sx and 2**(14 - sx) stay normal fp32)."""
    e = (amax.to(gl.int32, bitcast=True) >> 23) & 255
    return gl.minimum(gl.maximum(gl.where(amax > 0, 140 - e, 0), -100), 100)


@gluon.jit
def _store_pairs(q16_ptr, c_ptr, n, v, K):
    """Blocks v [blocks, 32] (fp32; elements n of a K-vector) -> fp16 ``v * 2**sx`` at their
    slots of the pair words [4, K / 8] (q16_ptr: as fp16) and each block's ``2**(14 - sx)``
    at c_ptr[n // 32]: the x operand of :func:`_rows_dot`."""
    sx = _block_exponent(gl.max(gl.abs(v), axis=1))
    xs = (v * ((sx + 127) << 23).to(gl.float32, bitcast=True)[:, None]).to(gl.float16)
    r = n % 8
    gl.store(q16_ptr + ((r % 2) * 2 + r // 4) * (K // 4) + (n // 8) * 2 + (r // 2) % 2, xs)
    first = gl.max(n, axis=1) // 32        # n's blocks are whole: any element names it
    gl.store(c_ptr + first, ((141 - sx) << 23).to(gl.float32, bitcast=True))


@gluon.jit
def _x_pairs_kernel(x_ptr, xq_ptr, xc_ptr, zero_ptr, n_zero, H, stride_x, PDL: gl.constexpr,
                    num_warps: gl.constexpr):
    """Token t's x (program (t, pb): 1024 num_warps elements) -> :func:`_store_pairs`'s words
    and factors; program (0, 0) also zeroes ``n_zero`` int32 at ``zero_ptr`` (the decode's
    counters). ``PDL``: the decode is this launch's programmatic dependent launch."""
    BL: gl.constexpr = _block_layout(num_warps)
    ONE: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    if PDL:
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
def _gate_up_tile(tile, xq_ptr, xc_ptr, w13_ptr, s13_ptr, g13_ptr, ids_ptr, aq_ptr, ac_ptr,
                  part_ptr, ctr_ptr, stamps_ptr, P, TOPK, I, H, n_tiles1, n_tiles2, stride_w13e,
                  stride_w13n, stride_s13e, stride_s13n, swiglu_limit, IS_NV: gl.constexpr,
                  HAS_LIMIT: gl.constexpr, BN1: gl.constexpr, RB: gl.constexpr,
                  ASM: gl.constexpr, AHEAD: gl.constexpr, num_warps: gl.constexpr):
    """Gate/up tile ``tile`` of :func:`_decode_kernel`: pair p's BN1 gate rows and their BN1
    up rows (row tile pn) over K slice sp, into part[sp, p]; the row tile's last slice sums
    the slices, takes the SwiGLU and writes those BN1 activations as the down tiles' x
    (:func:`_store_pairs`), then releases the pair's count."""
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
        pa, sa, pb, sb = _rows_start(w_base, s_base, stride_w13n // 4, stride_s13n, I, 2 * BN1,
                                     BN1, RB, IS_NV, AHEAD, num_warps)
        mult = 1.0
        if IS_NV:
            mult = gl.load(g13_ptr + e)
        _stamp(stamps_ptr, tile, 2, num_warps)
        _rows_dot(w_base, s_base, stride_w13n // 4, stride_s13n, I,
                  xq_ptr + t.to(gl.int64) * (H // 2) + sp * 256, H // 8,
                  xc_ptr + t * (H // 32) + sp * 64, part_ptr + (sp * P + p).to(gl.int64) * (2 * I) + row0,
                  mult, pa, sa, pb, sb, 2 * BN1, BN1, RB, IS_NV, ASM, AHEAD, num_warps)
        _stamp(stamps_ptr, tile, 3, num_warps)
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
                     ac_ptr + p * (I // 32), n, _swiglu(gate, up, swiglu_limit, HAS_LIMIT), I)
    if last:
        cta_barrier()                         # every thread's stores, then one release
        gl.atomic_add(ctr_ptr + 1 + p, 1, sem="release", scope="gpu")
    _stamp(stamps_ptr, tile, 4, num_warps)


@gluon.jit
def _down_tile(d, ticket, w2_ptr, s2_ptr, g2_ptr, ids_ptr, topk_w_ptr, aq_ptr, ac_ptr, ypair_ptr,
               out_ptr, ctr_ptr, stamps_ptr, P, T, TOPK, I, H, n_tiles1, n_tiles2, stride_w2e, stride_w2n,
               stride_s2e, stride_s2n, stride_out, IS_NV: gl.constexpr, BN2: gl.constexpr,
               RB: gl.constexpr, ASM: gl.constexpr, AHEAD: gl.constexpr,
               num_warps: gl.constexpr, SLEEP: gl.constexpr):
    """Down tile d of :func:`_decode_kernel`: pair p's activations (K slice sp) times BN2 down
    rows (row tile pn), times its routing weight, into ypair[sp, p]; the last tile of those
    rows sums ypair over the pairs and slices, in order, into out. Its first weight bytes are
    asked for before it waits for the activations."""
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
        pa, sa, pb, sb = _rows_start(w_base, s_base, stride_w2n // 4, stride_s2n, 0, BN2, BN2,
                                     RB, IS_NV, AHEAD, num_warps)
        mult = gl.load(topk_w_ptr + p).to(gl.float32)
        if IS_NV:
            mult = mult * gl.load(g2_ptr + e)
        _wait_count(ctr_ptr + 1 + p, n_tiles1, SLEEP)
        _stamp(stamps_ptr, ticket, 2, num_warps)
        _rows_dot(w_base, s_base, stride_w2n // 4, stride_s2n, 0,
                  aq_ptr + p.to(gl.int64) * (I // 2) + sp * 256, I // 8, ac_ptr + p * (I // 32) + sp * 64,
                  ypair_ptr + (sp * P + p).to(gl.int64) * H + row0, mult, pa, sa, pb, sb, BN2,
                  BN2, RB, IS_NV, ASM, AHEAD, num_warps)
        _stamp(stamps_ptr, ticket, 3, num_warps)
    cta_barrier()
    done = gl.atomic_add(ctr_ptr + 1 + P + pn, 1, sem="acq_rel", scope="gpu")
    if done == P * S2 - 1:                # the last of this row tile's down tiles
        OL: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [num_warps, 1], [0, 1])
        offs_h = pn * BN2 + gl.arange(0, BN2, layout=gl.SliceLayout(1, OL))
        m = gl.arange(0, 8, layout=gl.SliceLayout(0, OL))
        _sum_pairs(gl.zeros([BN2, 8], gl.float32, layout=OL), ypair_ptr, ids_ptr, out_ptr, offs_h,
                   m, P, T, TOPK, S2, H, stride_out)
    _stamp(stamps_ptr, ticket, 4, num_warps)


@gluon.jit
def _decode_kernel(xq_ptr, xc_ptr, w13_ptr, s13_ptr, g13_ptr, w2_ptr, s2_ptr, g2_ptr, ids_ptr,
                   topk_w_ptr, aq_ptr, ac_ptr, part_ptr, ypair_ptr, out_ptr, ctr_ptr, stamps_ptr, P, T,
                   TOPK,
                   I, H, stride_w13e, stride_w13n, stride_s13e, stride_s13n, stride_w2e,
                   stride_w2n, stride_s2e, stride_s2n, stride_out, swiglu_limit,
                   IS_NV: gl.constexpr, HAS_LIMIT: gl.constexpr, BN1: gl.constexpr,
                   BN2: gl.constexpr, RB: gl.constexpr, ASM: gl.constexpr,
                   num_warps: gl.constexpr, PDL: gl.constexpr = False, AHEAD: gl.constexpr = 1,
                   SLEEP: gl.constexpr = 500):
    """The whole MoE of a few tokens (T <= 8) in one launch, every (token, slot) pair its own
    GEMV, as kernels/moe_mma2.py's ``FUSED`` decode schedules it: tiles handed out by a ticket
    counter, all gate/up tiles first, so a down tile waits only for tiles already running.
    Counters (zeroed by :func:`_x_pairs_kernel`): [0] the ticket; [1 + p] pair p's finished
    gate/up row tiles; [1 + P + n] the finished down tiles of hidden rows n BN2 ...;
    [1 + P + H / BN2 + g] the finished K slices of gate/up row tile g. K slices are 2048
    elements (H / 2048 for gate/up, I / 2048 for down). ``PDL``: launched as x's pairs'
    programmatic dependent launch; every program waits for that kernel before its ticket.
    The timeline's stamps as moe_mma2's (``DSV4LAB_MOE_TIMELINE=1``; scripts/profile_moe.py
    --timeline)."""
    n_tiles1 = I // BN1
    n_tiles2 = H // BN2
    n_gu = P * n_tiles1 * (H // 2048)
    tile = _ticket(ctr_ptr, stamps_ptr, PDL, num_warps)
    if tile < n_gu:
        _gate_up_tile(tile, xq_ptr, xc_ptr, w13_ptr, s13_ptr, g13_ptr, ids_ptr, aq_ptr, ac_ptr,
                      part_ptr, ctr_ptr, stamps_ptr, P, TOPK, I, H, n_tiles1, n_tiles2, stride_w13e,
                      stride_w13n, stride_s13e, stride_s13n, swiglu_limit, IS_NV, HAS_LIMIT,
                      BN1, RB, ASM, AHEAD, num_warps)
    else:
        _down_tile(tile - n_gu, tile, w2_ptr, s2_ptr, g2_ptr, ids_ptr, topk_w_ptr, aq_ptr, ac_ptr,
                   ypair_ptr, out_ptr, ctr_ptr, stamps_ptr, P, T, TOPK, I, H, n_tiles1, n_tiles2, stride_w2e,
                   stride_w2n, stride_s2e, stride_s2n, stride_out, IS_NV, BN2, RB, ASM, AHEAD,
                   num_warps, SLEEP)


def supported(x, H: int, I: int, T: int, tensors=()) -> str | None:
    """None if :func:`fused_decode` runs here on these sizes, else why not (no launch): its
    sizes, then :func:`dsv4lab.kernels.moe_mma2.supported`'s GPU, Triton and alignment."""
    if H % 2048 or I % 2048:
        return f"hidden and intermediate sizes must be multiples of 2048 (a lane's 64 elements of a row), got {H}, {I}"
    if not 1 <= T <= 8:
        return f"one launch takes 1 to 8 tokens, got {T}"
    return moe_mma2.supported(x, H, I, tensors)


def fused_decode(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, *, fmt="mxfp4",
                 w13_global=None, w2_global=None, swiglu_limit=None, BN1=32, BN2=32, RB=2,
                 num_warps=4, PDL=None, dec="prmt", chains=1, AHEAD=1, MAXNREG=None, SLEEP=500,
                 XW=1):
    """The FP4 MoE of T <= 8 tokens (arguments as ``moe.fused_moe``, already checked) in two
    launches: x's pairs (:func:`_x_pairs_kernel`, which zeroes the counters), then
    :func:`_decode_kernel`. ``BN1``, ``BN2``: gate/up and down row tiles (powers of two,
    multiples of ``num_warps x RB`` rows, BN1 of 32 too, dividing I and H); ``RB``: rows a warp an iteration;
    ``PDL``: the decode as the first launch's programmatic dependent launch (None: where
    :func:`dsv4lab.kernels.device.pdl_ok`); ``dec``, ``chains``: :func:`block_dot_asm`'s
    (NVFP4 always 2 chains); ``AHEAD`` (1 or 2): iterations whose loads are in flight;
    ``MAXNREG``: a register cap for the decode's programs (programs an SM are bounded by them);
    ``SLEEP``: ns a waiting down tile sleeps between polls; ``XW``: warps of each of x's
    copy programs (1024 XW elements each).
    No host synchronisation. Explained in
    notebooks/04_mxfp4_moe_port.ipynb."""
    T, H = x.shape
    E, two_i, _ = w13.shape
    I = two_i // 2
    P = topk_ids.numel()
    why = supported(x, H, I, T, (w13, w13_scale, w2, w2_scale))
    if why is not None:
        raise ValueError(f"moe_simt: {why}")
    rr = num_warps * RB
    # a gate/up tile writes whole 32-element blocks of the activations (their factors)
    for name, v, n, low in (("BN1", BN1, I, 32), ("BN2", BN2, H, 1)):
        if v % low or v % rr or n % v or v & (v - 1):
            raise ValueError(f"moe_simt: {name} must be a power of two, a multiple of {low} and "
                             f"of num_warps x RB ({rr}), dividing {n}; got {v}")
    if not isinstance(XW, int) or XW < 1 or XW & (XW - 1) or H % (1024 * XW):
        raise ValueError(f"moe_simt: XW must be a power of two with H ({H}) a multiple of 1024 XW "
                         f"(x's copy programs take 1024 XW elements each), got {XW!r}")
    if AHEAD not in (1, 2):
        raise ValueError(f"moe_simt: AHEAD must be 1 or 2 (iterations in flight), got {AHEAD!r}")
    if dec not in _PAIRS or chains not in (1, 2):
        raise ValueError(f"moe_simt: dec must be one of {sorted(_PAIRS)} and chains 1 or 2, got "
                         f"{dec!r}, {chains!r}")
    if dec == "cvt" and torch.cuda.get_device_capability(x.device) < (8, 9):
        raise ValueError("moe_simt: dec='cvt' converts fp8 (cvt.rn.f16x2.e5m2x2), which needs sm_89 "
                         "or newer; 'prmt' runs everywhere")
    dev = x.device
    is_nv = fmt == "nvfp4"
    out = torch.empty(T, H, dtype=x.dtype, device=dev)
    if P == 0:
        return out.zero_()
    w13_scale, w2_scale = w13_scale.view(torch.uint8), w2_scale.view(torch.uint8)
    pdl_able = pdl_ok(dev)
    pdl = pdl_able if PDL is None else bool(PDL)
    if pdl and not pdl_able:
        raise ValueError("moe_simt: PDL needs sm_90 or newer (griddepcontrol)")
    xq = torch.empty(T, 4, H // 8, dtype=torch.int32, device=dev)
    xc = torch.empty(T, H // 32, dtype=torch.float32, device=dev)
    aq = torch.empty(P, 4, I // 8, dtype=torch.int32, device=dev)
    ac = torch.empty(P, I // 32, dtype=torch.float32, device=dev)
    part = torch.empty(H // 2048 * P, 2 * I, dtype=torch.float32, device=dev)
    ypair = torch.empty(I // 2048 * P, H, dtype=torch.float32, device=dev)
    counters = torch.empty(1 + P + H // BN2 + P * (I // BN1), dtype=torch.int32, device=dev)
    x = x.contiguous()
    _x_pairs_kernel[(T, H // (1024 * XW))](x, xq, xc, counters, counters.numel(), H, x.stride(0),
                                           PDL=pdl, num_warps=XW)
    g13 = w13_global.contiguous() if is_nv else xc
    g2 = w2_global.contiguous() if is_nv else xc
    n_gu = P * (I // BN1) * (H // 2048)
    grid = (n_gu + P * (H // BN2) * (I // 2048),)
    stamps = counters
    if TIMELINE:
        stamps = torch.zeros(grid[0], 8, dtype=torch.int64, device=dev)
        moe_mma2._LAST_TIMELINE[:] = [stamps, n_gu]
    _decode_kernel[grid](
        xq, xc, w13, w13_scale, g13, w2, w2_scale, g2, topk_ids.contiguous(),
        topk_weights.reshape(-1).contiguous(), aq, ac, part, ypair, out, counters, stamps, P, T,
        topk_ids.shape[1], I, H, w13.stride(0), w13.stride(1), w13_scale.stride(0),
        w13_scale.stride(1), w2.stride(0), w2.stride(1), w2_scale.stride(0), w2_scale.stride(1),
        out.stride(0), float(swiglu_limit) if swiglu_limit is not None else 0.0, IS_NV=is_nv,
        HAS_LIMIT=swiglu_limit is not None, BN1=BN1, BN2=BN2, RB=RB,
        ASM=block_dot_asm(dec, chains, is_nv), num_warps=num_warps,
        PDL=pdl, AHEAD=AHEAD, SLEEP=int(SLEEP), launch_pdl=pdl, **({} if MAXNREG is None else {"maxnreg": int(MAXNREG)}))
    return out
