"""FP4 weight rows times one token on the CUDA cores, x held in registers (Gluon; sm_80+).

The idea. At T = 1 an expert's GEMM is a GEMV: every weight is used once, by one token.
The tensor-core kernels of :mod:`dsv4lab.kernels.moe_mma2` feed the mma a tile padded from
one token to eight and reload x's fragments from the L1 every K-step. Here a warp walks
whole rows instead: lane l owns the same 64 elements of every row of its K slice (32 packed
bytes, two MXFP4 blocks), so it loads its x once, as 32 fp16x2 registers, and a warp's
load of a row reads 1 KB of contiguous bytes. Per 4-byte word (8 elements):

- the low and the high nibbles placed as e5m2 bytes ``s 000 e1 e0 m 0`` (CVT8's 7
  instructions, :mod:`dsv4lab.kernels.moe_mma2`), which are the high bytes of the fp16
  ``value * 2**-14``; four ``prmt`` (or ``cvt.rn.f16x2.e5m2x2``, ``DEC``) make the fp16 pairs;
- four ``fma.rn.f16x2`` with the lane's x pairs, accumulated in fp16 over the block's 32
  elements (x scaled per lane-block by a power of two so that the products stay normal and
  the sums bounded: ``|x| * 2**sx < 2**14``, so a product is below 6 and a block's sum below
  192), then the block's sum to fp32, times ``2**(e - 127)`` (MXFP4's scale) and the factor
  that undoes x's;
- the row's 32 lane sums reduced across the warp.

No block scale touches a weight (the fp32 block sum takes it), and nothing is read twice.
This module is the probe of that design (scripts/probe_simt_gemv.py): rows of one matrix, a
program RB rows a warp an iteration, double-buffered loads under the L2 evict-first policy.
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

# e5m2 bit placement of 4 packed bytes ($4 + 4 j: word j of the block): l holds the low
# nibbles' bytes, h the high nibbles'
_PLACE = """
shl.b32 u, {w}, 4;
shl.b32 v, {w}, 1;
and.b32 v, v, 0x0E0E0E0E;
lop3.b32 l, u, v, 0x80808080, 0xEC;
shr.b32 u, {w}, 3;
and.b32 u, u, 0x0E0E0E0E;
lop3.b32 h, {w}, u, 0x80808080, 0xEC;
"""
# fp16 pairs of l and h: d0 (bytes 0, 1 of l), d1 (2, 3 of l), d2, d3 (the same of h), i.e.
# the elements (0, 2), (4, 6), (1, 3), (5, 7) of the word
_PAIRS = {
    "prmt": """prmt.b32 d0, l, 0, 0x1404;
prmt.b32 d1, l, 0, 0x3424;
prmt.b32 d2, h, 0, 0x1404;
prmt.b32 d3, h, 0, 0x3424;
""",
    "cvt": """mov.b32 {l0, l1}, l;
mov.b32 {h0, h1}, h;
cvt.rn.f16x2.e5m2x2 d0, l0;
cvt.rn.f16x2.e5m2x2 d1, l1;
cvt.rn.f16x2.e5m2x2 d2, h0;
cvt.rn.f16x2.e5m2x2 d3, h1;
""",
}


def block_dot_asm(dec: str = "prmt", chains: int = 1, outs: int = 1) -> str:
    """PTX for one lane's 16-byte block: operands $0-$3 the fp32 results, $4-$7 the 4 words,
    $8 + 4 i + j the x pair i of word j. ``chains`` fp16x2 accumulators (1: all 16 fma in one;
    2: words 0-1 and 2-3), ``outs`` results (1: the block's sum in $0; 2: words 0-1 in $0 and
    2-3 in $1, NVFP4's two scale blocks); the other results are 0."""
    body = [".reg .b32 u, v, l, h, d0, d1, d2, d3, a0, a1, t;", ".reg .b16 l0, l1, h0, h1, q0, q1;",
            ".reg .f32 f0, f1, g0, g1;"]
    for j in range(4):
        body.append(_PLACE.format(w=f"${4 + j}"))
        body.append(_PAIRS[dec])
        acc = f"a{(j // 2) if chains == 2 else 0}"
        for i in range(4):
            x = f"${8 + 4 * i + j}"
            if i == 0 and (j == 0 or (chains == 2 and j == 2)):
                body.append(f"mul.rn.f16x2 {acc}, d{i}, {x};")
            else:
                body.append(f"fma.rn.f16x2 {acc}, d{i}, {x}, {acc};")
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


@gluon.jit
def _rows_kernel(w_ptr, s_ptr, xq_ptr, cx_ptr, out_ptr, n_rows, stride_wn, stride_sn,
                 stride_xs, stride_cs, stride_os, RB: gl.constexpr, R: gl.constexpr,
                 ASM: gl.constexpr, num_warps: gl.constexpr):
    """Rows of program (tile, slice) times x's slice: out[slice, row] (fp32)."""
    W: gl.constexpr = num_warps
    RR: gl.constexpr = W * RB
    WL: gl.constexpr = _layout(RB, 8, W)
    SL: gl.constexpr = _layout(RB, 2, W)
    tile = gl.program_id(0)
    sl = gl.program_id(1)
    cw = gl.arange(0, 256, layout=gl.SliceLayout(0, WL))
    cs = gl.arange(0, 64, layout=gl.SliceLayout(0, SL))
    rw = gl.arange(0, RR, layout=gl.SliceLayout(1, WL))
    rs = gl.arange(0, RR, layout=gl.SliceLayout(1, SL))
    xb = xq_ptr + sl * stride_xs
    x0 = gl.expand_dims(gl.load(xb + cw), 0)
    x1 = gl.expand_dims(gl.load(xb + 256 + cw), 0)
    x2 = gl.expand_dims(gl.load(xb + 512 + cw), 0)
    x3 = gl.expand_dims(gl.load(xb + 768 + cw), 0)
    cx = gl.expand_dims(gl.load(cx_ptr + sl * stride_cs + cs), 0)
    row0 = tile * R
    # int32 offsets from the first row: a program's rows span less than 2**31 bytes
    wbase = (w_ptr + row0.to(gl.int64) * stride_wn).to(gl.pointer_type(gl.int32)) + sl * 256 + cw[None, :]
    sbase = s_ptr + row0.to(gl.int64) * stride_sn + sl * 64 + cs[None, :]
    wrow = (rw * (stride_wn // 4))[:, None]
    srow = (rs * stride_sn)[:, None]
    p = gl.load(wbase + wrow, eviction_policy="evict_first")
    s = gl.load(sbase + srow, eviction_policy="evict_first")
    for it in range(R // RR):
        nxt = gl.minimum(it + 1, R // RR - 1) * RR
        pn = gl.load(wbase + (wrow + nxt * (stride_wn // 4)), eviction_policy="evict_first")
        sn = gl.load(sbase + (srow + nxt * stride_sn), eviction_policy="evict_first")
        o = gl.inline_asm_elementwise(ASM, "=f,=f,=f,=f" + ",r" * 20, [p, x0, x1, x2, x3],
                                      dtype=gl.float32, is_pure=True, pack=4)
        o = gl.reshape(o, [RR, 64, 2, 2])
        o, _ = gl.split(o)
        o, _ = gl.split(o)
        o = gl.convert_layout(o, SL, assert_trivial=True)
        f = (s.to(gl.int32) << 23).to(gl.float32, bitcast=True)
        tot = gl.sum(o * f * cx, axis=1)
        gl.store(out_ptr + sl * stride_os + row0 + it * RR + rs, tot)
        p = pn
        s = sn


def x_pairs(x: torch.Tensor, slices: int):
    """x [K] (fp32) -> (xq int32 [slices, 4, K / slices / 8]: the fp16 pairs of each word in
    :func:`block_dot_asm`'s order, each lane-block scaled by 2**sx; cx fp32 [slices, K / 32 /
    slices]: 2**(14 - sx), what a block's fp32 sum owes)."""
    K = x.numel()
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
    _rows_kernel[(N // R, slices)](w, s, xq, cx, out, N, w.stride(0), s.stride(0), xq.stride(0),
                                   cx.stride(0), out.stride(0), RB=RB, R=R,
                                   ASM=block_dot_asm(dec, chains, 1), num_warps=num_warps)
    return out
