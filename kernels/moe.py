"""A portable FP4 mixture-of-experts in Triton (MXFP4 and NVFP4 experts).

The idea. Decode-time MoE is a weight-streaming problem: at T = 1 each of the 6 experts
hit reads 3 * 2048 * 4096 FP4 weights (12.6 MB packed + 0.8 MB of MXFP4 scales) to do 2 FLOPs per weight for
one token. So the kernel is built around reading every packed weight byte of an expert
exactly once and applying it to all the tokens routed to that expert:

1. group the (token, expert) pairs by expert into blocks of at most BM rows
   (:mod:`dsv4lab.kernels.moe_align`; fixed upper bound on the block count, no host sync);
2. ``_moe_gate_up_kernel``: one program per (block, tile of BN intermediate columns)
   gathers the block's rows of x and walks K in steps of BK elements: each step reads
   BK/2 contiguous bytes of every gate AND up row of its tile (wide vector loads), decodes
   the FP4 nibbles in registers, applies the block scales to the decoded weights, and
   accumulates both GEMMs; it writes ``act = silu(min(g, L)) * clamp(u, -L, L)``;
3. ``_moe_down_kernel``: one program per (block, tile of BN hidden columns, split-K slice)
   streams the down-projection rows the same way and writes each pair's partial row times
   its routing weight;
4. ``_moe_combine_kernel`` sums the k rows (and split-K slices) of each token (a
   deterministic second pass, no atomics) and skips pairs whose expert id is -1.

The inner product of a step is either a tensor-core ``tl.dot`` (M padded to BM >= 16) or,
for blocks of 1..4 rows, a broadcast multiply-and-reduce on the CUDA cores (``USE_DOT``).
Tile sizes live in one table, :data:`CONFIGS`, swept by scripts/tune_moe.py.

Swap AB (``SWAP_AB``, an experimental variant, off in :data:`CONFIGS`: timed slower). At
decode the dot is [16 padded tokens] x [BN weight rows]: the decoded weights are the B
operand, which Hopper's wgmma (M >= 64 a warpgroup) and the Ampere mma alike take from
shared memory, so every decoded fp16 weight is written to and read back from shared
memory (4 bytes of shared traffic a packed byte each way), and the 16-row M side leaves
wgmma's 64 rows idle. Transposing the product, ``acc^T [BN, BM] = w [BN, BK] . x^T [BK,
BM]``, puts the weight rows on the M side (BN >= 64 fills a warpgroup) as the A operand,
which the tensor cores can read straight from registers, and the few tokens on N (>= 16).
Same decode, same scales (per weight row: ``colf[:, None]``), one transpose of the
accumulator before the epilogue.

DECODE32 (experimental, off in :data:`CONFIGS`: timed slower). The byte decode above costs
~25 PTX instructions a packed byte on sm_90 (one 16-bit op per element): the loop is
instruction-bound, not bandwidth-bound. With DECODE32 the packed bytes are loaded as int32
words and two nibbles (bytes 0 and 2, then 1 and 3 of a word) are decoded per 32-bit op into
fp16x2 words, which are split into halves. Byte r of word q is packed byte 4q + r, i.e. K
elements 8q + 2r and 8q + 2r + 1, so a step runs as four dots of K = BK/8 each, with x
gathered in the same order (a permutation of K, applied to both operands alike).

FASTDEC (the decode default in :data:`CONFIGS`, with XPRE): the byte decode and the block
scale multiply written as packed 32-bit PTX (``tl.inline_asm_elementwise``, 4 packed bytes a
call: prmt/shr/lop3 place each nibble's sign and magnitude in fp16 bit positions, two
elements a 32-bit op, then one ``mul.rn.f16x2``), the same bits as the Triton decode below
(:data:`FASTDEC_ASM`). GPU only; the interpreter runs the Triton decode.

What limits the loop (sm_90 TTGIR/SASS at BM 16, BN 64, BK 256, Triton 3.6, compiled
offline with the launch's divisibility hints). The packed weights and scales ARE
software-pipelined (cp.async into 2 shared buffers; the decode reads them straight into the
dot-operand layout, no layout round trip), but (a) the stride-2 gathers of x (and act) are
plain synchronous loads whose latency every K-step waits out, and (b) the gate/up kernel
takes 251-255 registers a thread, so an SM holds only 2 programs (8 warps: 2 a scheduler)
and at T = 1 only 192 programs exist: the decode's dependent instruction chains are left
unhidden. (c) The down kernel computed its split-K scale offset as ``(sp * KH_SPLIT + k) //
GS``, which hides its divisibility: its scale loads became byte loads outside the pipeline
(255 registers, spills, 80 KB shared); the slice base now goes into the pointers before the
loop (178 registers, 50 KB), for every config. These switches attack (a) and (b); XPRE,
SPLIT1 and BK 128 are the decode defaults in :data:`CONFIGS` (see there), ROWMAX a variant:

- ``XPRE``: x is copied once per call (``_moe_xpre_kernel``, one launch) as fp16 times
  2**-8 with its even and odd columns in two contiguous halves (``[T, 2, H/2]``), and the gate/up epilogue writes act the same way
  (fp16); the step's x tiles are then plain contiguous fp16 loads feeding the dot, which the
  pipeliner streams ahead with the weights. Same rounding as the strided path.
- ``SPLIT1``: split-K of the gate/up GEMM over a third grid axis; each slice writes fp32
  gate and up partials and ``_moe_swiglu_kernel`` sums them and applies the SwiGLU. More
  programs (resident warps) at decode, at the price of one tiny pass.
- smaller ``BK`` (128): with XPRE and FASTDEC ~100-130 registers a thread (gate/up 128,
  down 104 for MXFP4), 4 programs an SM.
- ``ROWMAX`` (MXFP4): the fp16/fp32 split of the block scales (below) is made once per row
  and K slice from the row's largest scale byte instead of every step, so the step's dots
  accumulate in place like NVFP4's and the fp32 rescale of a fresh dot per step goes.
- ``MAXNREG``: a register cap (Triton's ``maxnreg``) for the gate/up and down kernels, to fit
  more programs an SM (MXFP4 gate/up at BK 128: 150 registers, 3 programs; capped at 128: 4).
- ``FOLD`` (a bench variant; round 4): fewer launches at decode, where at T = 1 the weight
  bytes take ~19 us and each of the 6 launches (grouping, XPRE copy, gate/up, SwiGLU sum,
  down, combine) costs a few us of gap and tail. The combine runs inside the down kernel
  and (SPLIT1 > 1) the SwiGLU sum of the split-K slices inside the gate/up kernel: every
  program stores its partial as before, then counts itself in on a zeroed int32 counter of
  its tile (a barrier, then one acq_rel atomic at GPU scope); the program that completes
  the count reads the tile's partials back (L2 loads) and sums them in the separate pass's
  order, so the result is the same bits whichever program finishes last. With the
  single-program grouping (P <= 1024), one prologue launch (``_moe_prologue_kernel``) groups
  the pairs, zeroes the counters, copies x (XPRE) and writes the zero rows of tokens
  without a valid pair: 6 launches -> 3, no atomics left in the numbers.
What remains, per K-step of XPRE + FASTDEC + BK 128 (64 packed bytes a thread): ~590 SASS
instructions (~9 a byte), ~125 of them register moves that rebuild x's A fragments for
every HMMA (the kWidth = 4 mixed-precision layout; swap AB trades them for as many PRMTs).

Decoding a nibble without a table. A nibble ``c`` is sign | e1 e0 | m. Put its three
magnitude bits at bits 9..11 of a 16-bit word and its sign at bit 15, and the word, read
as an fp16, is exactly ``value(c) * 2**-14`` (codes 0 and 1 land in fp16 subnormals, which
is exactly how E2M1 treats e = 0). The even and odd elements of a row live in the low and
high nibbles, so instead of interleaving them we split x into its even and odd columns:
``x . w = x_even . w_lo + x_odd . w_hi``.

Scales, applied to the decoded fp16 weights. NVFP4 has one E4M3 scale per 16: the fp16
product ``(value * 2**-14) * scale`` is exact (2**-24 .. 0.17), so the dot accumulates
directly; ``2**22`` and the fp32 global scale multiply the result once. MXFP4 has one
``2**(s-127)`` per 32, too wide a range for fp16: per K-step and row, with ``smax`` the
largest scale byte of the step, the weights get ``2**(s - smax + 15)`` (fp16, exact for
blocks within 2**24 of the step's largest, flushed below 2**-29 of it) and the step's
dot gets ``2**(smax - 128 + 8)`` (fp32, per column). x (and the activations) enter the
dot as fp16 scaled by 2**-8 (|x| < 1.6e7).

MMA2 (the T = 1 and T = 64 rows of :data:`CONFIGS`): on a GPU of sm_80 or newer the two
GEMMs run as :mod:`dsv4lab.kernels.moe_mma2`'s Gluon ``mma.sync`` kernels, which load the
weight bytes straight into the tensor-core A operand (no register moves; ~6 SASS
instructions a byte); at one token, its one-launch decode (``FUSED``: no grouping, split-K
and the combine inside the launch), whose K loops on sm_89+ read the weight bytes straight into
registers (``REGS``). The interpreter and any shape they refuse run the Triton kernels below.

Everything runs on sm_80, sm_90 and sm_120 alike (plain loads, integer ops, ``tl.dot``
on fp16) and in Triton's interpreter; under the interpreter the dot operands are upcast
to fp32 (a constexpr flag) as the workbook does for every kernel.

Explained in notebooks/04_mxfp4_moe_port.ipynb.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from dsv4lab.kernels.device import gluon_unsupported, interpreting
from dsv4lab.kernels.moe_align import (_align_body, align_buffers, align_kernel_fits, block_rows, moe_align,
                                       num_blocks_max)

X_PRESCALE = 2.0 ** -8      # x and activations enter the fp16 dot scaled by this
W_OFFSET = 2.0 ** -14       # the fp16 bit trick yields value * 2**-14
UNDO = 2.0 ** 22            # 1 / (X_PRESCALE * W_OFFSET): the NVFP4 epilogue factor
# set on the tensors moe_mma2.pack_tile_major returns: its layout has the canonical one's
# shapes and dtypes, so the mark is how a kernel that reads one layout refuses the other
TILE_MAJOR_MARK = "_dsv4lab_tile_major"


def check_canonical(where: str, **tensors) -> None:
    """Raise if any of ``tensors`` is in moe_mma2.pack_tile_major's layout: ``where`` reads the
    canonical one (a silent wrong answer otherwise)."""
    for name, t in tensors.items():
        if getattr(t, TILE_MAJOR_MARK, False):
            raise ValueError(f"{where}: {name} is in moe_mma2.pack_tile_major's layout, and this "
                             f"path reads the canonical one (only moe_mma2's fused T <= 8 launch "
                             f"with TILED reads the packed layout)")


@triton.jit
def _e2m1_lo(p):
    """Low nibbles of packed bytes -> fp16 ``value * 2**-14``."""
    p = p.to(tl.int16)
    bits = ((p & 7) << 9) | ((p & 8) << 12)
    return bits.to(tl.float16, bitcast=True)


@triton.jit
def _e2m1_hi(p):
    """High nibbles of packed bytes -> fp16 ``value * 2**-14``."""
    p = p.to(tl.int16)
    bits = ((p & 0x70) << 5) | ((p & 0x80) << 8)
    return bits.to(tl.float16, bitcast=True)


# FASTDEC (the decode default in CONFIGS): the same decode and scale in packed
# 32-bit PTX, 4 packed bytes (8 nibbles) a call, ~19 instructions for 8 scaled fp16 weights
# where the byte decode above spends ~25 a byte. Per nibble group of a word w = [b0 b1 b2 b3]:
#   h = w & 0xF0F0F0F0                 high nibbles, in place (bits 4..7 of every byte)
#   l = (w << 4) & 0xF0F0F0F0          low nibbles, moved to bits 4..7
#   t = prmt(h or l, 0, 0x1404)        bytes 0, 1 -> bits 8..15, 24..31 (0x3424: bytes 2, 3),
#                                      so each fp16 half holds its nibble s e1 e0 m at 15..12
#   d = lop3(t, t >> 3, 0x8E008E00, 0xA8) = (t | t >> 3) & 0x8E008E00: the sign stays at 15,
#                                      e1 e0 m drop to 11..9: the fp16 ``value * 2**-14``,
#                                      bit for bit what _e2m1_lo/_e2m1_hi produce
#   mul.rn.f16x2 d, d, mexp            the block scale, two elements an instruction
# lop3's truth table 0xA8 is (a | b) & c over a = 0xF0, b = 0xCC, c = 0xAA. lop3, prmt and
# f16x2 arithmetic exist on sm_80, sm_90 and sm_120 alike. Interpreter: never (inline asm
# cannot run there; the launcher switches FASTDEC off). tests/test_moe.py runs this very
# string through a small numpy model of the five opcodes over all 256 byte values.
FASTDEC_ASM = """
{
.reg .b32 h, l, t, u;
and.b32 h, $4, 0xF0F0F0F0;
shl.b32 l, $4, 4;
and.b32 l, l, 0xF0F0F0F0;
prmt.b32 t, l, 0, 0x1404;
shr.b32 u, t, 3;
lop3.b32 t, t, u, 0x8E008E00, 0xA8;
mul.rn.f16x2 $0, t, $5;
prmt.b32 t, l, 0, 0x3424;
shr.b32 u, t, 3;
lop3.b32 t, t, u, 0x8E008E00, 0xA8;
mul.rn.f16x2 $1, t, $6;
prmt.b32 t, h, 0, 0x1404;
shr.b32 u, t, 3;
lop3.b32 t, t, u, 0x8E008E00, 0xA8;
mul.rn.f16x2 $2, t, $5;
prmt.b32 t, h, 0, 0x3424;
shr.b32 u, t, 3;
lop3.b32 t, t, u, 0x8E008E00, 0xA8;
mul.rn.f16x2 $3, t, $6;
}
"""
_FASTDEC_ASM = tl.constexpr(FASTDEC_ASM)       # jit code may read constexpr globals only


@triton.jit
def _e2m1_scaled_fast(p, mexp):
    """FASTDEC: packed bytes p (uint8) and fp16 multipliers mexp (same shape) ->
    ``(_e2m1_lo(p) * mexp, _e2m1_hi(p) * mexp)``, bit for bit, 4 bytes an inline-asm call
    (outputs $0..$3: lo of bytes 0-1, 2-3, hi of 0-1, 2-3 as fp16x2; $4 the 4 bytes; $5, $6
    the multipliers of bytes 0-1 and 2-3)."""
    return tl.inline_asm_elementwise(_FASTDEC_ASM, "=r,=r,=r,=r,r,r,r", [p, mexp],
                                     dtype=(tl.float16, tl.float16), is_pure=True, pack=4)


@triton.jit
def _e4m3_bits_to_f16(b):
    """E4M3 scale bytes (read as uint8: sm_80 has no e4m3 type) -> fp16, exactly.

    Bits s eeee mmm placed as fp16 s 0eeee mmm0000000 read ``value * 2**-8`` (e = 0 lands on
    fp16 subnormals just as E4M3's subnormals do); times 256 (exact) gives the value."""
    b = b.to(tl.int16)
    bits = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
    return bits.to(tl.float16, bitcast=True) * 256.0


@triton.jit
def _scale_split(sb, IS_NV: tl.constexpr, BN: tl.constexpr, smax_row=0,
                 ROWMAX: tl.constexpr = False):
    """A K-step's block-scale bytes [BN, NSC] -> ``(mult, colf)``: fp16 multipliers for the
    decoded weights [BN, NSC] and the fp32 factor [BN] the step's dot still needs (the split
    :func:`_w_tile` describes; NVFP4: the E4M3 scale, colf 1; MXFP4 with ROWMAX: smax is
    ``smax_row``)."""
    if IS_NV:
        mult = _e4m3_bits_to_f16(sb)
        colf = tl.full((BN,), 1.0, tl.float32)
    else:
        si = sb.to(tl.int32)
        if ROWMAX:
            smax = smax_row
        else:
            smax = tl.max(si, axis=1)
        e = si - smax[:, None] + 15
        mult = tl.where(e >= -14, (e + 15) << 10, 0).to(tl.int16).to(tl.float16, bitcast=True)
        colf = ((smax + 7) << 23).to(tl.float32, bitcast=True)
    return mult, colf


@triton.jit
def _w_tile(w_tile, s_tile, nmask, IS_NV: tl.constexpr,
            BN: tl.constexpr, BKH: tl.constexpr, GS: tl.constexpr, FASTDEC: tl.constexpr = False,
            smax_row=0, ROWMAX: tl.constexpr = False):
    """One K-step of BN weight rows: ``(w_lo, w_hi, colf)``.

    w_tile: pointers [BN, BKH] to packed bytes (BKH contiguous bytes a row: wide vector
    loads); s_tile: pointers [BN, BKH // GS] to the scale bytes (GS packed bytes a scale).
    w_lo/w_hi: fp16 [BN, BKH], the even/odd elements with their block scale applied;
    colf: fp32 [BN], what the step's dot must still be multiplied by (MXFP4 only).

    NVFP4: ``(value * 2**-14) * e4m3`` is exact in fp16 (2**-24 .. 0.17). MXFP4: the scale
    ``2**(s-127)`` does not fit fp16, so the step is split as ``2**(s - smax + 15)`` (fp16,
    applied here; exact while a block is within 2**24 of the largest block of its row in
    this step, flushed below 2**-29 of it) times ``colf = 2**(smax - 128 + 8)`` (fp32, per
    row, applied to the step's dot; the 2**8 undoes the x prescale). ROWMAX (MXFP4): smax
    is ``smax_row``, the row's largest scale byte over the whole K slice, so colf is the
    same every step and the caller applies it once, after the loop. FASTDEC: the decode
    and the scale multiply in packed PTX (:data:`FASTDEC_ASM`), the same bits.
    """
    NSC: tl.constexpr = BKH // GS
    p = tl.load(w_tile, mask=nmask[:, None], other=0)
    sb = tl.load(s_tile, mask=nmask[:, None], other=0)
    mult, colf = _scale_split(sb, IS_NV, BN, smax_row, ROWMAX)
    mexp = tl.reshape(tl.broadcast_to(mult[:, :, None], (BN, NSC, GS)), (BN, BKH))
    if FASTDEC:       # the same bits from packed 32-bit PTX (GPU only; see FASTDEC_ASM)
        wlo, whi = _e2m1_scaled_fast(p, mexp)
        return wlo, whi, colf
    return _e2m1_lo(p) * mexp, _e2m1_hi(p) * mexp, colf


@triton.jit
def _row_smax(s_row, nmask, KS, RKC: tl.constexpr, WORDS: tl.constexpr = False):
    """ROWMAX: the largest MXFP4 scale byte of each row over its KS scale bytes (``s_row``:
    [BN] pointers to each row's first scale byte of the slice), read RKC bytes a row at a
    time: one wide load a row for Flash's slices (KS <= RKC = 128), where a loop over the K
    loop's own [BN, BKH // GS] scale tiles paid one memory latency per step before the first
    weight byte was read. ``2**(s - smax + 15)`` then stays exact for blocks within 2**24 of
    the row's largest over the slice (flushed below 2**-29 of it: a contribution under 2**-29
    of the row's largest block's, per block). WORDS (W16): pointers, KS and RKC count int32
    words of 4 scale bytes."""
    kc = tl.arange(0, RKC)
    m = tl.zeros(nmask.shape, dtype=tl.int32)
    for k0 in range(0, KS, RKC):
        sb = tl.load(s_row[:, None] + (k0 + kc)[None, :],
                     mask=nmask[:, None] & (kc < KS - k0)[None, :], other=0)
        if WORDS:
            j = tl.arange(0, 4)
            sb = tl.max((sb[:, :, None] >> (8 * j)[None, None, :]) & 0xFF, axis=2)
        m = tl.maximum(m, tl.max(sb.to(tl.int32), axis=1))
    return m


# W16 (a variant): the packed weights read as int16 words (4 nibbles: elements 4q .. 4q+3 in
# bits 0-3, 4-7, 8-11, 12-15) and the block scales as int32 words (4 scale bytes), so that the
# decoded weight tile, the B operand of the dot, descends from 16- and 32-bit loads only. Triton
# (3.6) sizes a mixed-precision dot's operand layout by the narrowest load its operands descend
# from: 8-bit bytes give kWidth 4, for which x's A fragments (fp16, from shared memory) must be
# rebuilt with register moves before every HMMA (~110 of ~605 SASS instructions a gate/up K-step
# on sm_90); 16-bit words give kWidth 2, where ldmatrix fills them in place (compiled offline:
# no moves left). The K axis is split in four phases (element 4q + r: x plane r, decoded
# output r) instead of two, so x and act are pre-split in four planes ([T, 4, K/4]).
# Per int16 pair (pack = 2): output r holds nibble r of both words as fp16 ``value * 2**-14``
# (the FASTDEC bit placement: (t | t >> 3) & 0x8E008E00 with the nibble at bits 12..15 of its
# half), times the multipliers $5.
# Measured (H200, MXFP4; `dsv4lab bench moe` rows at 10c5467): slower, 83.2 vs 68.2 us at T = 1
# and 1519.6 vs 1029.0 us at T = 64 (NVFP4 alike; scripts/tune_moe.py at 6e90014 agrees: 83.0
# vs 68.3 and 1400-1556 vs 1052.8 us), although the offline SASS has fewer
# instructions a K-step (gate/up with ROWMAX 513-546 against 620; down at BK2 256, 495
# against 635): at kWidth 2 the decoded weights no longer come out of the decode in the dot
# operand's layout, so every K-step stores them to shared memory and reads them back with
# ldmatrix behind barriers (16 STS.128 and 8 BAR a gate/up step; 42 / 33 KB of shared memory
# against 25 / 17 KB), and splitting the scale words into bytes adds warp shuffles. The same
# round trip appears when the byte decode's asm is made non-pure to stop Triton's bit-width
# walk (checked offline, not timed). The register moves of kWidth 4 are the cheaper price.
# A variant, not a default.
W16_ASM = """
{
.reg .b32 t, u;
shl.b32 t, $4, 12;
and.b32 t, t, 0xF000F000;
shr.b32 u, t, 3;
lop3.b32 t, t, u, 0x8E008E00, 0xA8;
mul.rn.f16x2 $0, t, $5;
shl.b32 t, $4, 8;
and.b32 t, t, 0xF000F000;
shr.b32 u, t, 3;
lop3.b32 t, t, u, 0x8E008E00, 0xA8;
mul.rn.f16x2 $1, t, $5;
shl.b32 t, $4, 4;
and.b32 t, t, 0xF000F000;
shr.b32 u, t, 3;
lop3.b32 t, t, u, 0x8E008E00, 0xA8;
mul.rn.f16x2 $2, t, $5;
and.b32 t, $4, 0xF000F000;
shr.b32 u, t, 3;
lop3.b32 t, t, u, 0x8E008E00, 0xA8;
mul.rn.f16x2 $3, t, $5;
}
"""
_W16_ASM = tl.constexpr(W16_ASM)


@triton.jit
def _e2m1_nibble16(w, r: tl.constexpr):
    """Nibble r of int16 words -> fp16 ``value * 2**-14`` (the interpreter's W16 decode)."""
    n = (w.to(tl.int32) >> (4 * r)) & 15
    bits = ((n & 7) << 9) | ((n & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _scale_bytes16(s_tile, nmask, BN: tl.constexpr, NSC: tl.constexpr):
    """W16: NSC scale bytes of each row read as NSC // 4 int32 words -> int32 [BN, NSC]."""
    sw = tl.load(s_tile, mask=nmask[:, None], other=0)                      # [BN, NSC // 4]
    j = tl.arange(0, 4)
    sb = (sw[:, :, None] >> (8 * j)[None, None, :]) & 0xFF
    return tl.reshape(sb, (BN, NSC))


@triton.jit
def _w_tile16(w_tile, s_tile, nmask, IS_NV: tl.constexpr, BN: tl.constexpr, Q2: tl.constexpr,
              GS: tl.constexpr, FASTDEC: tl.constexpr, smax_row=0, ROWMAX: tl.constexpr = False):
    """W16: one K-step of BN rows from int16 words [BN, Q2] (4 elements each) and int32 scale
    words: ``(w0, w1, w2, w3, colf)``, wr [BN, Q2] fp16 holding elements 4q + r with their
    block scale applied; colf as in :func:`_w_tile` (the same scale split, bit for bit)."""
    NSC: tl.constexpr = (2 * Q2) // GS
    p = tl.load(w_tile, mask=nmask[:, None], other=0)
    mult, colf = _scale_split(_scale_bytes16(s_tile, nmask, BN, NSC), IS_NV, BN, smax_row, ROWMAX)
    mexp = tl.reshape(tl.broadcast_to(mult[:, :, None], (BN, NSC, GS // 2)), (BN, Q2))
    if FASTDEC:
        w0, w1, w2, w3 = tl.inline_asm_elementwise(_W16_ASM, "=r,=r,=r,=r,r,r", [p, mexp],
                                                   dtype=(tl.float16,) * 4, is_pure=True, pack=2)
        return w0, w1, w2, w3, colf
    return (_e2m1_nibble16(p, 0) * mexp, _e2m1_nibble16(p, 1) * mexp,
            _e2m1_nibble16(p, 2) * mexp, _e2m1_nibble16(p, 3) * mexp, colf)


@triton.jit
def _x_planes(x_rows, k1, plane, mmask):
    """W16: the step's four K phases of x (or act): planes ``plane`` elements apart."""
    x0 = tl.load(x_rows + k1, mask=mmask[:, None], other=0.0)
    x1 = tl.load(x_rows + plane + k1, mask=mmask[:, None], other=0.0)
    x2 = tl.load(x_rows + 2 * plane + k1, mask=mmask[:, None], other=0.0)
    x3 = tl.load(x_rows + 3 * plane + k1, mask=mmask[:, None], other=0.0)
    return x0, x1, x2, x3


@triton.jit
def _mac16(acc, x0, x1, x2, x3, w0, w1, w2, w3, colf, CHAIN: tl.constexpr, DOT_FP32: tl.constexpr):
    """W16: acc + colf * sum_r x_r . w_r^T over the four K phases (tensor cores, fp16)."""
    if DOT_FP32:      # the interpreter: same rounding as the fp16 operands
        x0, x1, x2, x3 = x0.to(tl.float32), x1.to(tl.float32), x2.to(tl.float32), x3.to(tl.float32)
        w0, w1, w2, w3 = w0.to(tl.float32), w1.to(tl.float32), w2.to(tl.float32), w3.to(tl.float32)
    if CHAIN:
        acc = tl.dot(x0, tl.trans(w0), acc)
        acc = tl.dot(x1, tl.trans(w1), acc)
        acc = tl.dot(x2, tl.trans(w2), acc)
        acc = tl.dot(x3, tl.trans(w3), acc)
    else:
        d = tl.dot(x0, tl.trans(w0))
        d = tl.dot(x1, tl.trans(w1), d)
        d = tl.dot(x2, tl.trans(w2), d)
        d = tl.dot(x3, tl.trans(w3), d)
        acc += d * colf[None, :]
    return acc


@triton.jit
def _w_words(w_tile, s_tile, nmask, IS_NV: tl.constexpr, BN: tl.constexpr, Q: tl.constexpr,
             GS: tl.constexpr):
    """DECODE32: one K-step of BN rows read as int32 words (4 packed bytes, [BN, Q]) and
    the per-element multiplier ``mexp`` [BN, Q] and ``colf`` [BN] as in :func:`_w_tile`."""
    NSC: tl.constexpr = (4 * Q) // GS
    wd = tl.load(w_tile, mask=nmask[:, None], other=0)
    sb = tl.load(s_tile, mask=nmask[:, None], other=0)
    mult, colf = _scale_split(sb, IS_NV, BN)
    mexp = tl.reshape(tl.broadcast_to(mult[:, :, None], (BN, NSC, GS // 4)), (BN, Q))
    return wd, mexp, colf


@triton.jit
def _e2m1_pairs(t):
    """Bytes 0 and 2 of int32 words -> (lo nibbles, hi nibbles) as fp16x2 words, two
    elements per 32-bit op: byte 0's nibble in the low half, byte 2's in the high half."""
    lo = ((t & 0x00070007) << 9) | ((t & 0x00080008) << 12)
    hi = ((t & 0x00700070) << 5) | ((t & 0x00800080) << 8)
    return lo, hi


@triton.jit
def _half(v, HIGH: tl.constexpr):
    """The low (or high) 16 bits of int32 words as fp16."""
    if HIGH:
        v = v >> 16
    return v.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _mac_words(acc, x_rows, k0, mmask, wd, mexp, colf, IS_NV: tl.constexpr,
               USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr, SWAP_AB: tl.constexpr):
    """DECODE32 step: byte r of word q is packed byte 4q + r of the step, i.e. elements
    8q + 2r (low nibble) and 8q + 2r + 1 (high); the dot runs as four K = Q slices (one per
    r) so that no interleave is needed: x is gathered with the same permutation."""
    for pp in tl.static_range(2):
        lo2, hi2 = _e2m1_pairs(wd >> (8 * pp))
        xe, xo = _x_tile(x_rows + 2 * pp, k0, mmask)            # byte r = pp
        acc = _mac(acc, xe, xo, _half(lo2, False) * mexp, _half(hi2, False) * mexp, colf,
                   IS_NV, USE_DOT, DOT_FP32, SWAP_AB)
        xe, xo = _x_tile(x_rows + 2 * pp + 4, k0, mmask)        # byte r = pp + 2
        acc = _mac(acc, xe, xo, _half(lo2, True) * mexp, _half(hi2, True) * mexp, colf,
                   IS_NV, USE_DOT, DOT_FP32, SWAP_AB)
    return acc


@triton.jit
def _x_tile(x_rows, k0, mmask):
    """x (or activations) at the even and odd columns of the step: fp32 [BM, BKH] * 2**-8."""
    xe = tl.load(x_rows + 2 * k0, mask=mmask[:, None], other=0.0).to(tl.float32)
    xo = tl.load(x_rows + 2 * k0 + 1, mask=mmask[:, None], other=0.0).to(tl.float32)
    return xe * 0.00390625, xo * 0.00390625


@triton.jit
def _x_tile_pre(x_rows, k0, xo_off, mmask):
    """XPRE: the even and odd columns of the step from the pre-split fp16 copy (already
    times 2**-8): two contiguous [BM, BKH] loads that feed the dot as they are, so Triton's
    pipeliner can stream them ahead (cp.async) like the weights instead of stalling on them."""
    xe = tl.load(x_rows + k0, mask=mmask[:, None], other=0.0)
    xo = tl.load(x_rows + xo_off + k0, mask=mmask[:, None], other=0.0)
    return xe, xo


@triton.jit
def _mac(acc, xe, xo, wlo, whi, colf, IS_NV: tl.constexpr, USE_DOT: tl.constexpr,
         DOT_FP32: tl.constexpr, SWAP_AB: tl.constexpr):
    """acc + colf * (x_even . w_lo^T + x_odd . w_hi^T): [BM, BN].

    USE_DOT: tensor cores (fp16 operands, fp32 accumulate; BM >= 16, tiny M is padded).
    SWAP_AB (with USE_DOT): the transposed product ``w . x^T``: acc is [BN, BM], the
    decoded weight tile is the dot's M side (its A operand, which the tensor cores can take
    from registers) and the few tokens its N side.
    Otherwise a broadcast multiply and reduce on the CUDA cores in fp32 (for BM of 1..4)."""
    if USE_DOT and SWAP_AB:
        if DOT_FP32:      # the interpreter: same rounding as the fp16 operands
            a_lo, a_hi = wlo.to(tl.float32), whi.to(tl.float32)
            b_e = tl.trans(xe.to(tl.float16).to(tl.float32))
            b_o = tl.trans(xo.to(tl.float16).to(tl.float32))
        else:
            a_lo, a_hi = wlo, whi
            b_e, b_o = tl.trans(xe.to(tl.float16)), tl.trans(xo.to(tl.float16))
        if IS_NV:
            acc = tl.dot(a_lo, b_e, acc)
            acc = tl.dot(a_hi, b_o, acc)
        else:
            d = tl.dot(a_lo, b_e)
            d = tl.dot(a_hi, b_o, d)
            acc += d * colf[:, None]
    elif USE_DOT:
        if DOT_FP32:      # the interpreter: fp16 dots are not trustworthy there; same rounding
            a_e, a_o = xe.to(tl.float16).to(tl.float32), xo.to(tl.float16).to(tl.float32)
            b_lo, b_hi = tl.trans(wlo.to(tl.float32)), tl.trans(whi.to(tl.float32))
        else:
            a_e, a_o = xe.to(tl.float16), xo.to(tl.float16)
            b_lo, b_hi = tl.trans(wlo), tl.trans(whi)
        if IS_NV:
            acc = tl.dot(a_e, b_lo, acc)
            acc = tl.dot(a_o, b_hi, acc)
        else:
            d = tl.dot(a_e, b_lo)
            d = tl.dot(a_o, b_hi, d)
            acc += d * colf[None, :]
    else:
        d = tl.sum(xe[:, None, :] * wlo.to(tl.float32)[None, :, :], axis=2)
        d += tl.sum(xo[:, None, :] * whi.to(tl.float32)[None, :, :], axis=2)
        if IS_NV:
            acc += d
        else:
            acc += d * colf[None, :]
    return acc


@triton.jit
def _moe_gate_up_kernel(x_ptr, w_ptr, s_ptr, gscale_ptr, sorted_pair_ptr,
                        block_expert_ptr, block_start_ptr, block_count_ptr, act_ptr,
                        I, TOPK, KH_SPLIT, KS_SPLIT, XO_OFF,
                        stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_act,
                        stride_part, swiglu_limit, fin_ptr, stride_fin, sem_ptr,
                        IS_NV: tl.constexpr, HAS_LIMIT: tl.constexpr, DOT_FP32: tl.constexpr,
                        USE_DOT: tl.constexpr, SWAP_AB: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr, BKH: tl.constexpr, GS: tl.constexpr,
                        DECODE32: tl.constexpr = False, FASTDEC: tl.constexpr = False,
                        XPRE: tl.constexpr = False, PARTIAL: tl.constexpr = False,
                        ROWMAX: tl.constexpr = False, CHAIN: tl.constexpr = False,
                        FOLD: tl.constexpr = False, RKC: tl.constexpr = 16,
                        W16: tl.constexpr = False, PLANES: tl.constexpr = 2):
    b = tl.program_id(0)
    pn = tl.program_id(1)
    sp = tl.program_id(2)                        # split-K slice: bytes [sp*KH_SPLIT, +KH_SPLIT)
    e = tl.load(block_expert_ptr + b)
    if e < 0:
        return
    start, cnt, offs_m, mmask, pair = block_rows(block_start_ptr, block_count_ptr,
                                                 sorted_pair_ptr, b, BM)
    tok = (pair // TOPK).to(tl.int64)
    offs_n = pn * BN + tl.arange(0, BN)
    nmask = offs_n < I
    kb = tl.arange(0, BKH)
    ks = tl.arange(0, BKH // GS)
    e64 = e.to(tl.int64)
    kbase = sp * KH_SPLIT
    if XPRE:           # x as the pre-split fp16 copy [T, 2, H/2] (odd half at XO_OFF)
        x_rows = x_ptr + tok[:, None] * stride_xt + kb[None, :]
    else:
        x_rows = x_ptr + tok[:, None] * stride_xt + 2 * kb[None, :]
    row_g = e64 * stride_we + offs_n.to(tl.int64) * stride_wn
    wg = w_ptr + row_g[:, None] + kb[None, :]
    wu = wg + I * stride_wn
    srow = e64 * stride_se + offs_n.to(tl.int64) * stride_sn
    sg = s_ptr + srow[:, None] + ks[None, :]
    su = sg + I * stride_sn
    if SWAP_AB:
        acc_g = tl.zeros((BN, BM), dtype=tl.float32)
        acc_u = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    if W16:            # int16 weight words, int32 scale words, x in four planes (W16_ASM)
        # (strides, KH_SPLIT and KS_SPLIT arrive in words: int16 for the weights, int32 for
        # the scales; x is the four-plane copy [T, 4, H/4], planes XO_OFF apart)
        Q2: tl.constexpr = BKH // 2
        kq = tl.arange(0, Q2)
        kw = tl.arange(0, BKH // GS // 4)
        wg16 = w_ptr.to(tl.pointer_type(tl.int16)) + (row_g + kbase)[:, None] + kq[None, :]
        wu16 = wg16 + I * stride_wn
        s32 = s_ptr.to(tl.pointer_type(tl.int32)) + srow + sp * KS_SPLIT
        sg32 = s32[:, None] + kw[None, :]
        su32 = sg32 + I * stride_sn
        x16 = x_ptr + tok[:, None] * stride_xt + kq[None, :] + kbase
        smax_g = tl.zeros((BN,), dtype=tl.int32)
        smax_u = tl.zeros((BN,), dtype=tl.int32)
        if ROWMAX:
            smax_g = _row_smax(s32, nmask, KS_SPLIT, RKC, True)
            smax_u = _row_smax(s32 + I * stride_sn, nmask, KS_SPLIT, RKC, True)
        for k1 in range(0, KH_SPLIT, Q2):
            x0, x1, x2, x3 = _x_planes(x16, k1, XO_OFF, mmask)
            w0, w1, w2, w3, cf = _w_tile16(wg16 + k1, sg32 + k1 // (2 * GS), nmask, IS_NV, BN, Q2,
                                           GS, FASTDEC, smax_g, ROWMAX)
            acc_g = _mac16(acc_g, x0, x1, x2, x3, w0, w1, w2, w3, cf, CHAIN, DOT_FP32)
            w0, w1, w2, w3, cf = _w_tile16(wu16 + k1, su32 + k1 // (2 * GS), nmask, IS_NV, BN, Q2,
                                           GS, FASTDEC, smax_u, ROWMAX)
            acc_u = _mac16(acc_u, x0, x1, x2, x3, w0, w1, w2, w3, cf, CHAIN, DOT_FP32)
        if ROWMAX:
            acc_g = acc_g * ((smax_g + 7) << 23).to(tl.float32, bitcast=True)[None, :]
            acc_u = acc_u * ((smax_u + 7) << 23).to(tl.float32, bitcast=True)[None, :]
    elif DECODE32:     # int32 words, 4 packed bytes each; x gathered in the same K order
        Q: tl.constexpr = BKH // 4
        kq = tl.arange(0, Q)
        x_rows = x_ptr + tok[:, None] * stride_xt + 8 * kq[None, :]
        wg = (w_ptr + row_g[:, None] + 4 * kq[None, :]).to(tl.pointer_type(tl.int32))
        wu = (w_ptr + (row_g + I * stride_wn)[:, None] + 4 * kq[None, :]).to(tl.pointer_type(tl.int32))
        for k1 in range(0, KH_SPLIT, BKH):
            k0 = kbase + k1
            wd, mexp, cf = _w_words(wg + k0 // 4, sg + k0 // GS, nmask, IS_NV, BN, Q, GS)
            acc_g = _mac_words(acc_g, x_rows, k0, mmask, wd, mexp, cf, IS_NV, USE_DOT,
                               DOT_FP32, SWAP_AB)
            wd, mexp, cf = _w_words(wu + k0 // 4, su + k0 // GS, nmask, IS_NV, BN, Q, GS)
            acc_u = _mac_words(acc_u, x_rows, k0, mmask, wd, mexp, cf, IS_NV, USE_DOT,
                               DOT_FP32, SWAP_AB)
    else:
        # the slice's base folded into the pointers, so that the step offsets k1 and
        # k1 // GS keep their known divisibility: (sp * KH_SPLIT + k1) // GS would lose it,
        # and the scale loads would become byte loads that the pipeliner cannot stream
        wg, wu = wg + kbase, wu + kbase
        sg, su = sg + sp * KS_SPLIT, su + sp * KS_SPLIT
        x_rows += kbase if XPRE else 2 * kbase
        # ROWMAX (MXFP4): one scale split per row for the whole slice, so the dots chain
        # into the accumulator like NVFP4's (no per-step fp32 rescale of a fresh dot);
        # CHAIN = IS_NV or ROWMAX comes from the launcher (a constexpr `or` in the kernel
        # turns into a tensor in Triton 3.6's code generator when both are False)
        smax_g = tl.zeros((BN,), dtype=tl.int32)
        smax_u = tl.zeros((BN,), dtype=tl.int32)
        if ROWMAX:
            srow_g = s_ptr + srow + sp * KS_SPLIT
            smax_g = _row_smax(srow_g, nmask, KS_SPLIT, RKC)
            smax_u = _row_smax(srow_g + I * stride_sn, nmask, KS_SPLIT, RKC)
        for k1 in range(0, KH_SPLIT, BKH):
            if XPRE:
                xe, xo = _x_tile_pre(x_rows, k1, XO_OFF, mmask)
            else:
                xe, xo = _x_tile(x_rows, k1, mmask)
            wlo, whi, cf = _w_tile(wg + k1, sg + k1 // GS, nmask, IS_NV, BN, BKH, GS, FASTDEC,
                                   smax_g, ROWMAX)
            acc_g = _mac(acc_g, xe, xo, wlo, whi, cf, CHAIN, USE_DOT, DOT_FP32, SWAP_AB)
            wlo, whi, cf = _w_tile(wu + k1, su + k1 // GS, nmask, IS_NV, BN, BKH, GS, FASTDEC,
                                   smax_u, ROWMAX)
            acc_u = _mac(acc_u, xe, xo, wlo, whi, cf, CHAIN, USE_DOT, DOT_FP32, SWAP_AB)
        if ROWMAX:                                # the rows' 2**(smax - 120), once
            fg = ((smax_g + 7) << 23).to(tl.float32, bitcast=True)
            fu = ((smax_u + 7) << 23).to(tl.float32, bitcast=True)
            if SWAP_AB:
                acc_g = acc_g * fg[:, None]
                acc_u = acc_u * fu[:, None]
            else:
                acc_g = acc_g * fg[None, :]
                acc_u = acc_u * fu[None, :]
    if SWAP_AB:                                   # back to [BM, BN] once, for the epilogue
        acc_g = tl.trans(acc_g)
        acc_u = tl.trans(acc_u)
    if IS_NV:
        f = 4194304.0 * tl.load(gscale_ptr + e)          # 2**22: undo x and nibble offsets
        gate = acc_g * f
        up = acc_u * f
    else:
        gate = acc_g
        up = acc_u
    rows = (start + offs_m).to(tl.int64)
    omask = mmask[:, None] & nmask[None, :]
    if PARTIAL:        # split-K: this slice's gate and up, summed by _moe_swiglu_kernel
        part = act_ptr + sp.to(tl.int64) * stride_part + rows[:, None] * stride_act + offs_n[None, :]
        tl.store(part, gate, mask=omask)
        tl.store(part + I, up, mask=omask)
        if FOLD:       # the last slice to finish this (block, tile) sums them: no SwiGLU pass
            tl.debug_barrier()                    # every thread's partial stored first
            done = tl.atomic_add(sem_ptr + b * tl.num_programs(1) + pn, 1, sem="acq_rel",
                                 scope="gpu")
            if done == tl.num_programs(2) - 1:
                src = act_ptr + rows[:, None] * stride_act + offs_n[None, :]
                gate = tl.zeros((BM, BN), dtype=tl.float32)
                up = tl.zeros((BM, BN), dtype=tl.float32)
                for s in range(0, tl.num_programs(2)):       # slice order: deterministic
                    gate += tl.load(src + s * stride_part, mask=omask, other=0.0, cache_modifier=".cg")
                    up += tl.load(src + s * stride_part + I, mask=omask, other=0.0, cache_modifier=".cg")
                _store_act(fin_ptr, rows, offs_n, gate, up, omask, I, stride_fin, swiglu_limit,
                           HAS_LIMIT, XPRE)
    else:
        _store_act(act_ptr, rows, offs_n, gate, up, omask, I, stride_act, swiglu_limit,
                   HAS_LIMIT, XPRE, PLANES)


@triton.jit
def _swiglu(gate, up, swiglu_limit, HAS_LIMIT: tl.constexpr):
    """silu(min(g, L)) * clamp(u, -L, L), or silu(g) * u; fp32."""
    if HAS_LIMIT:
        gate = tl.minimum(gate, swiglu_limit)
        up = tl.minimum(tl.maximum(up, -swiglu_limit), swiglu_limit)
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _store_act(act_ptr, rows, offs_n, gate, up, omask, I, stride_act, swiglu_limit,
               HAS_LIMIT: tl.constexpr, XPRE: tl.constexpr, PLANES: tl.constexpr = 2,
               SEG: tl.constexpr = False):
    """``act = silu(min(g, L)) * clamp(u, -L, L)`` to row ``rows`` of act: fp32 in natural
    column order, or (XPRE) as the down projection's pre-split fp16 operand: times 2**-8,
    column n in plane n % PLANES at n // PLANES (PLANES 2: even columns in [0, I/2), odd ones
    in [I/2, I); 4 for W16), the rounding _mac would do anyway."""
    act = _swiglu(gate, up, swiglu_limit, HAS_LIMIT)
    if SEG:            # kernels/moe_mma2.py's order: per 128 columns, the even ones then the odd
        col = (offs_n // 128) * 128 + (offs_n % 2) * 64 + (offs_n % 128) // 2
        tl.store(act_ptr + rows[:, None] * stride_act + col[None, :],
                 (act * 0.00390625).to(tl.float16), mask=omask)
    elif XPRE:
        col = (offs_n % PLANES) * (I // PLANES) + offs_n // PLANES
        tl.store(act_ptr + rows[:, None] * stride_act + col[None, :],
                 (act * 0.00390625).to(tl.float16), mask=omask)
    else:
        tl.store(act_ptr + rows[:, None] * stride_act + offs_n[None, :], act, mask=omask)


@triton.jit
def _moe_swiglu_kernel(part_ptr, act_ptr, block_expert_ptr, block_start_ptr, block_count_ptr,
                       I, stride_part, stride_prow, stride_act, swiglu_limit,
                       HAS_LIMIT: tl.constexpr, XPRE: tl.constexpr, SPLIT: tl.constexpr,
                       BM: tl.constexpr, BI: tl.constexpr, PLANES: tl.constexpr = 2,
                       SEG: tl.constexpr = False):
    """SPLIT1 > 1: sum the gate/up split-K partials [SPLIT, P, 2I] of one block's rows and
    write act (only rows a block owns were written: pairs with expert -1 are skipped)."""
    b = tl.program_id(0)
    if tl.load(block_expert_ptr + b) < 0:
        return
    start = tl.load(block_start_ptr + b)
    offs_m = tl.arange(0, BM)
    offs_n = tl.program_id(1) * BI + tl.arange(0, BI)
    rows = (start + offs_m).to(tl.int64)
    omask = (offs_m < tl.load(block_count_ptr + b))[:, None] & (offs_n < I)[None, :]
    src = part_ptr + rows[:, None] * stride_prow + offs_n[None, :]
    gate = tl.zeros((BM, BI), dtype=tl.float32)
    up = tl.zeros((BM, BI), dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        gate += tl.load(src + s * stride_part, mask=omask, other=0.0)
        up += tl.load(src + s * stride_part + I, mask=omask, other=0.0)
    _store_act(act_ptr, rows, offs_n, gate, up, omask, I, stride_act, swiglu_limit,
               HAS_LIMIT, XPRE, PLANES, SEG)


@triton.jit
def _moe_down_kernel(act_ptr, w_ptr, s_ptr, gscale_ptr, topk_w_ptr, sorted_pair_ptr,
                     block_expert_ptr, block_start_ptr, block_count_ptr, ypair_ptr,
                     H, KH_SPLIT, KS_SPLIT, XO_OFF,
                     stride_act, stride_we, stride_wn, stride_se, stride_sn, stride_y,
                     stride_ys, ids_ptr, out_ptr, sem_ptr, E, TOPK, stride_out,
                     IS_NV: tl.constexpr, DOT_FP32: tl.constexpr, USE_DOT: tl.constexpr,
                     SWAP_AB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     BKH: tl.constexpr, GS: tl.constexpr, DECODE32: tl.constexpr = False,
                     FASTDEC: tl.constexpr = False, XPRE: tl.constexpr = False,
                     ROWMAX: tl.constexpr = False, CHAIN: tl.constexpr = False,
                     FOLD: tl.constexpr = False, RKC: tl.constexpr = 16,
                     W16: tl.constexpr = False):
    b = tl.program_id(0)
    pn = tl.program_id(1)
    sp = tl.program_id(2)                        # split-K slice: bytes [sp*KH_SPLIT, +KH_SPLIT)
    e = tl.load(block_expert_ptr + b)
    if e < 0:
        return
    start, cnt, offs_m, mmask, pair = block_rows(block_start_ptr, block_count_ptr,
                                                 sorted_pair_ptr, b, BM)
    offs_n = pn * BN + tl.arange(0, BN)
    nmask = offs_n < H
    kb = tl.arange(0, BKH)
    ks = tl.arange(0, BKH // GS)
    e64 = e.to(tl.int64)
    kbase = sp * KH_SPLIT
    if XPRE:           # act written pre-split by the gate/up pass (odd half at XO_OFF)
        a_rows = act_ptr + (start + offs_m).to(tl.int64)[:, None] * stride_act + kb[None, :]
    else:
        a_rows = act_ptr + (start + offs_m).to(tl.int64)[:, None] * stride_act + 2 * kb[None, :]
    w_rows = w_ptr + (e64 * stride_we + offs_n.to(tl.int64) * stride_wn)[:, None] + kb[None, :]
    s_rows = s_ptr + (e64 * stride_se + offs_n.to(tl.int64) * stride_sn)[:, None] + ks[None, :]
    if SWAP_AB:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    if W16:            # as the gate/up loop: words, and act in four planes (XO_OFF apart)
        Q2: tl.constexpr = BKH // 2
        kq = tl.arange(0, Q2)
        kw = tl.arange(0, BKH // GS // 4)
        w16 = (w_ptr.to(tl.pointer_type(tl.int16)) + (e64 * stride_we + offs_n.to(tl.int64) * stride_wn
                                                       + kbase)[:, None] + kq[None, :])
        s32 = s_ptr.to(tl.pointer_type(tl.int32)) + e64 * stride_se + offs_n.to(tl.int64) * stride_sn \
            + sp * KS_SPLIT
        a16 = act_ptr + (start + offs_m).to(tl.int64)[:, None] * stride_act + kq[None, :] + kbase
        smax = tl.zeros((BN,), dtype=tl.int32)
        if ROWMAX:
            smax = _row_smax(s32, nmask, KS_SPLIT, RKC, True)
        for k1 in range(0, KH_SPLIT, Q2):
            x0, x1, x2, x3 = _x_planes(a16, k1, XO_OFF, mmask)
            w0, w1, w2, w3, cf = _w_tile16(w16 + k1, s32[:, None] + kw[None, :] + k1 // (2 * GS), nmask,
                                           IS_NV, BN, Q2, GS, FASTDEC, smax, ROWMAX)
            acc = _mac16(acc, x0, x1, x2, x3, w0, w1, w2, w3, cf, CHAIN, DOT_FP32)
        if ROWMAX:
            acc = acc * ((smax + 7) << 23).to(tl.float32, bitcast=True)[None, :]
    elif DECODE32:
        Q: tl.constexpr = BKH // 4
        kq = tl.arange(0, Q)
        a_rows = act_ptr + (start + offs_m).to(tl.int64)[:, None] * stride_act + 8 * kq[None, :]
        w_words = (w_ptr + (e64 * stride_we + offs_n.to(tl.int64) * stride_wn)[:, None]
                   + 4 * kq[None, :]).to(tl.pointer_type(tl.int32))
        for k1 in range(0, KH_SPLIT, BKH):
            k0 = kbase + k1
            wd, mexp, cf = _w_words(w_words + k0 // 4, s_rows + k0 // GS, nmask, IS_NV, BN, Q, GS)
            acc = _mac_words(acc, a_rows, k0, mmask, wd, mexp, cf, IS_NV, USE_DOT, DOT_FP32,
                             SWAP_AB)
    else:
        w_rows += kbase           # the slice's base in the pointers (see the gate/up loop)
        s_rows += sp * KS_SPLIT
        a_rows += kbase if XPRE else 2 * kbase
        # CHAIN = IS_NV or ROWMAX, from the launcher: see the gate/up loop
        smax = tl.zeros((BN,), dtype=tl.int32)
        if ROWMAX:
            smax = _row_smax(s_ptr + e64 * stride_se + offs_n.to(tl.int64) * stride_sn + sp * KS_SPLIT,
                             nmask, KS_SPLIT, RKC)
        for k1 in range(0, KH_SPLIT, BKH):
            if XPRE:
                xe, xo = _x_tile_pre(a_rows, k1, XO_OFF, mmask)
            else:
                xe, xo = _x_tile(a_rows, k1, mmask)
            wlo, whi, cf = _w_tile(w_rows + k1, s_rows + k1 // GS, nmask, IS_NV, BN, BKH, GS,
                                   FASTDEC, smax, ROWMAX)
            acc = _mac(acc, xe, xo, wlo, whi, cf, CHAIN, USE_DOT, DOT_FP32, SWAP_AB)
        if ROWMAX:
            f = ((smax + 7) << 23).to(tl.float32, bitcast=True)
            if SWAP_AB:
                acc = acc * f[:, None]
            else:
                acc = acc * f[None, :]
    if SWAP_AB:
        acc = tl.trans(acc)
    wt = tl.load(topk_w_ptr + pair, mask=mmask, other=0.0).to(tl.float32)
    if IS_NV:
        y = acc * (4194304.0 * tl.load(gscale_ptr + e)) * wt[:, None]
    else:
        y = acc * wt[:, None]
    tl.store(ypair_ptr + sp.to(tl.int64) * stride_ys + pair.to(tl.int64)[:, None] * stride_y
             + offs_n[None, :], y, mask=mmask[:, None] & nmask[None, :])
    if FOLD:
        _fold_combine(ypair_ptr, ids_ptr, out_ptr, sem_ptr, sorted_pair_ptr, start, cnt, pn,
                      offs_n, nmask, E, TOPK, stride_y, stride_ys, stride_out, BN)


@triton.jit
def _fold_combine(ypair_ptr, ids_ptr, out_ptr, sem_ptr, sorted_pair_ptr, start, cnt, pn,
                  offs_n, nmask, E, TOPK, stride_y, stride_ys, stride_out, BN: tl.constexpr):
    """FOLD: the combine inside the down kernel. Each (block, tile, slice) program counts
    itself in, per token of its rows, on a zeroed counter of (token, hidden tile); the
    program that brings it to (valid pairs of the token) * (slices) is the last one, and
    sums that token's k rows and slices of ypair in the combine kernel's order (pairs, then
    slices): the same fp32 sum, bit for bit, whichever program comes last."""
    tl.debug_barrier()                            # this program's partial rows stored first
    nh = tl.num_programs(1)
    ns = tl.num_programs(2)
    for m in range(0, cnt):
        t = (tl.load(sorted_pair_ptr + start + m) // TOPK).to(tl.int64)
        need = 0
        for j in range(0, TOPK):
            ej = tl.load(ids_ptr + t * TOPK + j)
            need += ((ej >= 0) & (ej < E)).to(tl.int32)
        done = tl.atomic_add(sem_ptr + t * nh + pn, 1, sem="acq_rel", scope="gpu")
        if done == need * ns - 1:
            acc = tl.zeros((BN,), dtype=tl.float32)
            for j in range(0, TOPK):
                ej = tl.load(ids_ptr + t * TOPK + j + offs_n * 0)     # broadcast: a vector mask
                ok = nmask & (ej >= 0) & (ej < E)
                row = t * TOPK + j
                for s in range(0, ns):
                    acc += tl.load(ypair_ptr + s * stride_ys + row * stride_y + offs_n,
                                   mask=ok, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + t * stride_out + offs_n, acc.to(out_ptr.dtype.element_ty),
                     mask=nmask)


@triton.jit
def _moe_xpre_kernel(x_ptr, xk_ptr, HP, stride_x, stride_xk, BH: tl.constexpr,
                     PLANES: tl.constexpr = 2, SEG: tl.constexpr = False):
    """XPRE: row t of x -> fp16 ``x * 2**-8`` with column c in plane c % PLANES at c // PLANES
    of row t of xk (PLANES 2: even columns in ``[0, H/2)``, odd ones in ``[H/2, H)``; 4 for
    W16; HP = H / PLANES). One launch; the fp32 product is exact, one round to nearest even
    to fp16: the rounding the strided path applies in _mac. SEG (PLANES 2): the planes per
    128-column segment instead (kernels/moe_mma2.py's order)."""
    _xpre_body(x_ptr, xk_ptr, tl.program_id(0).to(tl.int64), tl.program_id(1), HP, stride_x,
               stride_xk, BH, PLANES, SEG)


@triton.jit
def _moe_xpre_zero_kernel(x_ptr, xk_ptr, zero_ptr, n_zero, HP, stride_x, stride_xk,
                          BH: tl.constexpr, PDL: tl.constexpr = False):
    """:func:`_moe_xpre_kernel` (SEG order) that also zeroes ``n_zero`` int32 at ``zero_ptr``
    (program (0, 0)): the one-launch decode's x copy and its counters in one launch instead of
    a copy and a fill. ``PDL``: the decode that reads both is a programmatic dependent launch
    of this one (kernels/moe_mma2.py), which may be scheduled as soon as every program here
    has started."""
    if PDL:
        gdc_launch_dependents()
    pb = tl.program_id(1)
    t = tl.program_id(0)
    if (t == 0) & (pb == 0):
        offs = tl.arange(0, BH)
        for z0 in range(0, n_zero, BH):
            tl.store(zero_ptr + z0 + offs, 0, mask=z0 + offs < n_zero)
    _xpre_body(x_ptr, xk_ptr, t.to(tl.int64), pb, HP, stride_x, stride_xk, BH, 2, True)


@triton.jit
def _xpre_body(x_ptr, xk_ptr, t, pb, HP, stride_x, stride_xk, BH: tl.constexpr,
               PLANES: tl.constexpr = 2, SEG: tl.constexpr = False):
    offs = pb * BH + tl.arange(0, BH)
    m = offs < HP
    src = x_ptr + t * stride_x + PLANES * offs
    if SEG:
        dst = xk_ptr + t * stride_xk + (offs // 64) * 128 + offs % 64
        plane = 64
    else:
        dst = xk_ptr + t * stride_xk + offs
        plane = HP
    for r in tl.static_range(PLANES):
        xr = tl.load(src + r, mask=m, other=0.0).to(tl.float32) * 0.00390625
        tl.store(dst + r * plane, xr.to(tl.float16), mask=m)


@triton.jit
def _moe_prologue_kernel(ids_ptr, sorted_pair_ptr, block_expert_ptr, block_start_ptr,
                         block_count_ptr, P, E, NB_MAX, x_ptr, xk_ptr, H2, stride_x, stride_xk,
                         NXB, sem_ptr, NSEM, out_ptr, stride_out, TOPK,
                         BM: tl.constexpr, P_PAD: tl.constexpr, E_PAD: tl.constexpr,
                         BH: tl.constexpr, BZ: tl.constexpr, XPRE: tl.constexpr):
    """FOLD at decode (P <= 1024 pairs): one launch for everything before the gate/up GEMM.
    Program 0 groups the pairs (moe_align's single-program kernel, the same body) and zeroes
    the FOLD counters; program 1 + t * NXB + j copies block j of token t's x (XPRE, as
    _moe_xpre_kernel) and, for a token without a valid pair (no down program will ever
    write its row), writes that block of the output's zeros."""
    pid = tl.program_id(0)
    if pid == 0:
        _align_body(ids_ptr, sorted_pair_ptr, block_expert_ptr, block_start_ptr,
                    block_count_ptr, P, E, NB_MAX, BM, P_PAD, E_PAD)
        for z0 in range(0, NSEM, BZ):
            oz = z0 + tl.arange(0, BZ)
            tl.store(sem_ptr + oz, tl.zeros((BZ,), dtype=tl.int32), mask=oz < NSEM)
    else:
        t = ((pid - 1) // NXB).to(tl.int64)
        pb = (pid - 1) % NXB
        if XPRE:
            _xpre_body(x_ptr, xk_ptr, t, pb, H2, stride_x, stride_xk, BH)
        nvalid = 0
        for j in range(0, TOPK):
            ej = tl.load(ids_ptr + t * TOPK + j)
            nvalid += ((ej >= 0) & (ej < E)).to(tl.int32)
        if nvalid == 0:
            offs = pb * BH + tl.arange(0, BH)
            z = tl.zeros((BH,), dtype=tl.float32).to(out_ptr.dtype.element_ty)
            dst = out_ptr + t * stride_out + 2 * offs
            tl.store(dst, z, mask=offs < H2)
            tl.store(dst + 1, z, mask=offs < H2)


@triton.jit
def _moe_combine_kernel(ypair_ptr, ids_ptr, out_ptr, H, E, stride_y, stride_ys, stride_out,
                        TOPK: tl.constexpr, SPLIT: tl.constexpr, BH: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BH + tl.arange(0, BH)
    hmask = offs < H
    acc = tl.zeros((BH,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        eid = tl.load(ids_ptr + t * TOPK + j + offs * 0)      # broadcast: a vector mask
        ok = (eid >= 0) & (eid < E)
        row = (t * TOPK + j).to(tl.int64)
        for sp in tl.static_range(SPLIT):
            acc += tl.load(ypair_ptr + sp * stride_ys + row * stride_y + offs,
                           mask=hmask & ok, other=0.0)
    tl.store(out_ptr + t.to(tl.int64) * stride_out + offs, acc.to(out_ptr.dtype.element_ty), mask=hmask)


# --------------------------------------------------------------------- launcher ----------
# The tuning table: the first row whose bound is >= the average rows per expert hit
# (P / min(P, E); 1.0 at T <= 42 with k = 6 and 256 experts, ~1.5 at T = 64, 6 at T = 256,
# ~96 at T = 4096) wins; each row holds one config per format.
# BK1/BK2: K elements per step of the gate/up and down loops (BK/2 contiguous bytes a row);
# SPLIT1 (optional, default 1): split-K slices of the gate/up projection (fp32 partials,
# summed with the SwiGLU in _moe_swiglu_kernel): more programs when few experts are hit;
# SPLIT2: split-K slices of the down projection (partials summed by the combine pass);
# USE_DOT: tensor cores (BM >= 16) or CUDA-core multiply-reduce (tiny BM);
# SWAP_AB (optional, default False): the dot as ``w . x^T`` (weight rows on the M side);
# DECODE32 (optional, default False): packed bytes decoded as int32 words (see the docstring);
# FASTDEC (optional, default False): the byte decode + scale in packed PTX (FASTDEC_ASM);
# XPRE (optional, default False): x and act as pre-split fp16 operands (contiguous loads
# the pipeliner streams ahead; see the docstring);
# ROWMAX (optional, default False; MXFP4 only, ignored for NVFP4): one fp16/fp32 scale split
# per row and K slice instead of per K-step, so the MXFP4 dots chain like NVFP4's;
# GPU only: switched off under the interpreter, where the reference decode runs.
# MAXNREG (optional, default None): a cap on registers a thread for the gate/up and down
# kernels (Triton's ``maxnreg`` compile option, ptxas .maxnreg): MXFP4 gate/up at BK 128 with
# FASTDEC + XPRE takes 150 (3 programs of 4 warps an SM); 128 fits 4 (sm_90, Triton 3.6:
# 8 bytes of stack, no local spills). Not passed when None (and ignored by the interpreter).
# FOLD (optional, default False): fewer launches at decode: the combine runs inside the down
# kernel and (SPLIT1 > 1) the SwiGLU sum inside the gate/up kernel, each done by the last
# program to finish its tile (zeroed int32 counters, acq_rel atomics, a fixed summation
# order: the same bits as the separate passes); when the single-program grouping applies
# (P <= 1024) the grouping, the XPRE copy and the counters' zeroing share one launch
# (_moe_prologue_kernel). T = 1 with SPLIT 2/2 + XPRE: 6 launches -> 3.
# scripts/tune_moe.py sweeps these on a GPU; paste its winners here.
#
# Winners of the 2026-11-29 H200 sweep (triton 3.6, Flash shape E=256 H=4096 I=2048 k=6;
# CUDA-graph medians, fraction of the FP4-bytes roofline; 128 rows, none wrong):
#   T=1   mxfp4 140.2 us 0.135 (BN 64/64)            nvfp4 121.0 us 0.166 (BN 32/64, SPLIT2=2)
#   T=8   mxfp4 763.4 us 0.178 (BN 64/64)            nvfp4 716.1 us 0.200 (BN 64/64; 32/64 S2: 718.7)
#   T=64  mxfp4 3011  us 0.182 (BN 64/64)            nvfp4 2794.6 us 0.208 (BN 64/64)
#   T=256 mxfp4 4895  us 0.151 (BN 64/64)            nvfp4 4608  us 0.170 (BN 64/64)
# The CUDA-core (BM 1..2) variants were much slower (T=1: 244 us and worse). The prefill row
# (> 16 rows per expert) was not swept.
_DOT16 = dict(BM=16, BK1=256, BK2=256, USE_DOT=True, num_warps=4, num_stages=3)
# Promoted from the bench variants timed at 1b5dd53 + this kernel (H200, CUDA graph, us,
# fraction of roofline), FASTDEC + XPRE, BN 64/64:
#   T=1   BK 128, SPLIT 2/2: mxfp4 75.2 (0.25), nvfp4 75.3 (0.27)   [default tiles: 129.6 / 115.5]
#   T=64  mxfp4 BK 128: 1060 (0.48); nvfp4 BK 256: 997.7 (0.54)     [default tiles: 2366 / 2464]
#   T=8 and T=256 take the T=1 / T=64 winners untimed; their default rows re-measure them.
# So at decode (<= 16 rows per expert) the default is FASTDEC + XPRE (+ SPLIT1/SPLIT2 = 2 and
# BK 128 at <= 1 row per expert; BK 128 for MXFP4 above); SWAP_AB and DECODE32 stay
# bench/test variants (ROWMAX too, but for MXFP4 at T = 64: see _FX128_RM); prefill keeps the
# plain byte decode.
# PLAIN: the former decode default (BK 256, BN 64/64, byte decode, strided x, no split-K),
# every key explicit: the neutral base that tests build variants on and the bench's
# ``triton_plain`` reference row (a config given to fused_moe overrides config_for's entries,
# so a variant built on PLAIN does not inherit the promoted switches below).
PLAIN = dict(_DOT16, BN1=64, BN2=64, SPLIT1=1, SPLIT2=1, SWAP_AB=False, DECODE32=False,
             FASTDEC=False, XPRE=False, ROWMAX=False, MAXNREG=None, FOLD=False, W16=False,
             MMA2=None)
_FX = dict(_DOT16, BN1=64, BN2=64, FASTDEC=True, XPRE=True, SPLIT1=1, SPLIT2=1)
_FX128 = dict(_FX, BK1=128, BK2=128)
_FX128_S2 = dict(_FX128, SPLIT1=2, SPLIT2=2)
# Session 3 (H200, scripts/tune_moe.py, 164 experts hit at T = 64, CUDA-graph medians, each
# re-timed in a second sweep to within 0.1%): MXFP4 at T = 64 with ROWMAX (its row max now one
# wide load a row), a 256-element down K step and 128 hidden columns a down program: 1052.5 /
# 1058.1 us (BN2 64) against 1080.5 us for _FX128 (-2.6%); ROWMAX alone at BK2 128 was slower
# (1258.9). NVFP4 keeps _FX (ROWMAX does not apply to it). T = 1: no config beat _FX128_S2
# (deeper pipelines, split-K 4, BN 32, swap AB, the CUDA-core path: all slower). Recorded rows
# (`dsv4lab bench moe`, data/results/moe.jsonl at 29d0355 and 10c5467, 160 experts hit): the
# promoted default 1028.5 / 1029.0 us against 1050.0 us for triton_fd_xpre_bk128 (_FX128).
_FX128_RM = dict(_FX128, BN2=128, BK2=256, ROWMAX=True)
# MMA2 (session 8): on a GPU (sm_80+, not the interpreter) the GEMMs run as
# kernels/moe_mma2.py's Gluon kernels with these launch parameters (its fused_moe's keywords);
# elsewhere the Triton entries of the same row run. H200, scripts/tune-style sweep printed by
# a probe (not a recorded row; the recorded evidence is `dsv4lab bench moe`), 160 experts hit
# at T = 64, CUDA-graph medians in one process: MXFP4 963.5 us against 1069.2 us for _FX128_RM,
# NVFP4 999.5 against 1036.2 for _FX. At T = 1 the same kernels were slower (71.3 against
# 67.6 us at their best): the small-T rows keep the Triton kernels.
_MMA2_T64 = dict(BN1=64, NSPS=4, STAGES=2, BN2=128, NSPS2=2, STAGES2=2)
# Session 9: one token (MAX_T: the MMA2 entry applies up to this many tokens; the row's T = 8
# keeps the Triton kernels) runs moe_mma2's one-launch decode (FUSED) with split-K 4 / 2 over
# 2-warp programs of 32 rows. H200, scripts/tune_moe.py round 11 (#111, printout; the recorded
# evidence is `dsv4lab bench moe`): MXFP4 59.6 us, NVFP4 59.3 us at T = 1, against 67.8 for
# _FX128_S2 in the bench; at T = 8 the fused launch was slower (338.6 against 317.5 us).
# Both MMA2 entries decode with moe_mma2.CVT8_ASM on sm_89+ (rows at 8fdc283: T = 64 MXFP4
# 828.5 / 823.2 us = 0.61, T = 1 57.0 / 56.4 us = 0.33).
# Session 10: the block scales on the accumulator (moe_mma2 ACC_SCALE; bench variant
# mma2_acc_scale_t1) cut this launch's offline sm_90 SASS loops by 13-14% (gate/up 724 -> 631
# instructions, down 416 -> 357) and removed the row-maximum prologue, yet measured no faster
# (rows at b7e6296, where it was this entry's default: MXFP4 57.4 us against 57.0 with the
# scales on the weights, NVFP4 60.5 against 58.3): T = 1 is not bound by the loop's issue rate.
_MMA2_T1_SMEM = dict(FUSED=True, MAX_T=1, BN1=32, BN2=32, SPLIT1=4, SPLIT2=2, STAGES=3, NSPS=2,
                     num_warps=2)
# Session 11: the T = 1 entry's K loops from a register ring 4 K-steps deep (moe_mma2 REGS: no
# shared memory, no cp.async ring and no barrier, so an SM holds 7 programs, bounded by their
# 142 registers, instead of 5), with the gate/up K split in two and the down K unsplit.
# scripts/tune_moe.py round 12 (H200, printout at 66860bc + 1; the recorded evidence is
# `dsv4lab bench moe`): MXFP4 47.4 us, NVFP4 52.2, against 54.4 / 55.5 for _MMA2_T1_SMEM (the
# entry before, kept as the base of the T = 1 bench variants). REGS=None: 4 where the GPU
# converts fp8 (sm_89+, the word decode), else the shared-memory ring (0) at the same splits
# (sm_80: not measured; on the H200 that ring was fastest at split 4 / 2, _MMA2_T1_SMEM).
# NVFP4 without the waiting down tiles' L2 prefetch (round 12b/c, same printouts: 48.3-48.4 us
# against 52.2-52.3 with it; MXFP4 47.2-47.3 against 46.9-47.0, so MXFP4 kept it).
# REGS 5 (the ring refilled two K-steps at a time) measured no faster: 48.1 / 48.3 us.
# Session 12: the ring's loads with an L2 evict-first policy (EVICT; None: wherever REGS runs),
# both formats without the L2 prefetch (tune_moe round 13b, H200 printout: MXFP4 44.8 us,
# NVFP4 48.4, against 47.2 / 52.5 for the entry before in the same run; with the prefetch 45.2
# / 49.5), and a down tile's first ring loads ahead of its wait (EARLY, moe_mma2's default).
# The benchmark times calls after dirtying the L2 (as a decode step finds it), and weight
# bytes read once then evict lines that must first be written back. `dsv4lab bench moe` rows
# at 6956022: MXFP4 44.6 us (0.424), NVFP4 46.5, against 48.0 / 52.4 for _MMA2_T1_REGS
# (variant mma2_noevict_t1) in the same run.
_MMA2_T1_REGS = dict(FUSED=True, MAX_T=1, BN1=32, BN2=32, SPLIT1=2, SPLIT2=1, STAGES=3, NSPS=2,
                     num_warps=2, REGS=None)
# Session 22: where the hidden and intermediate sizes are multiples of 2048 (Flash's are), the
# T = 1 entry is kernels/moe_simt.py's one-launch decode (SIMT=None: GEMVs on the CUDA cores,
# x in registers, fp16x2 fma a 32-element block, the block scales on its fp32 sum; the same
# ticketed schedule), elsewhere the register ring above. `dsv4lab bench moe` rows (H200, at
# 3bae2cd, 78e1e04, 7eb340a and c260229, seven runs): MXFP4 37.2-37.6 us (0.504-0.509), NVFP4
# 40.1-40.4 (from 78e1e04), against 44.7-44.9 / 46.7-47.2 for the register ring (variant
# mma2_regs_t1, the entry before) in the same runs.
_MMA2_T1 = dict(_MMA2_T1_REGS, EVICT=None, PREFETCH=False, SIMT=None)
CONFIGS = [
    (1.0, dict(mxfp4=dict(_FX128_S2, MMA2=_MMA2_T1), nvfp4=dict(_FX128_S2, MMA2=_MMA2_T1))),  # T=1, 8
    (2.0, dict(mxfp4=dict(_FX128_RM, MMA2=_MMA2_T64), nvfp4=dict(_FX, MMA2=_MMA2_T64))),  # T=64
    (16.0, dict(mxfp4=_FX128, nvfp4=_FX)),                     # T=256
    (float("inf"), {f: dict(BM=64, BN1=64, BN2=128, BK1=128, BK2=128, SPLIT2=1, USE_DOT=True,
                            num_warps=4, num_stages=3) for f in ("mxfp4", "nvfp4")}),
]

# moe_mma2.fused_moe's launch keywords, a config's MMA2 entry (checked here, where Gluon may
# not be importable)
MMA2_LAUNCH_KEYS = ("BN1", "BN2", "SPLIT1", "SPLIT2", "STAGES", "NSPS", "STAGES2", "NSPS2",
                    "num_warps", "FUSED", "PREFETCH", "CVT8", "ACC_SCALE", "PDL", "REGS", "MAXNREG",
                    "EVICT", "EARLY", "TILED", "SIMT")
CONFIG_KEYS = ("BM", "BN1", "BN2", "BK1", "BK2", "SPLIT1", "SPLIT2", "USE_DOT", "SWAP_AB",
               "DECODE32", "FASTDEC", "XPRE", "ROWMAX", "MAXNREG", "FOLD", "W16", "MMA2",
               "num_warps", "num_stages")
assert set(PLAIN) == set(CONFIG_KEYS)


def rows_per_expert(T: int, topk: int, E: int) -> float:
    P = T * topk
    return P / max(1, min(P, E))


def config_for(T: int, topk: int, E: int, fmt: str = "mxfp4") -> dict:
    """Tile sizes from :data:`CONFIGS` by the average rows per expert hit and the format."""
    r = rows_per_expert(T, topk, E)
    cfg = next(dict(c[fmt]) for bound, c in CONFIGS if r <= bound)
    if interpreting():
        cfg.update(num_stages=1)
    return cfg


def _pick_bk(K: int, want: int) -> int:
    """Largest power of two <= want (>= 32) dividing K (K is a multiple of 32)."""
    bk = max(32, triton.next_power_of_2(want))
    while bk > 32 and K % bk:
        bk //= 2
    return bk


ROW_CHUNK = 128     # ROWMAX: at most this many scale bytes a row in one load of _row_smax


def _row_chunk(ks: int, rowmax: bool) -> int:
    """ROWMAX: scale bytes a row read at once by _row_smax (the whole slice, up to ROW_CHUNK)."""
    return min(ROW_CHUNK, triton.next_power_of_2(max(1, ks))) if rowmax else 16


def _pick_split(steps: int, want: int) -> int:
    for s in range(max(1, min(want, steps)), 0, -1):
        if steps % s == 0:
            return s
    return 1


def fused_moe(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, *, fmt="mxfp4",
              w13_global=None, w2_global=None, swiglu_limit=None, config=None):
    """Launch the grouped FP4 MoE. Arguments as ``dsv4lab.ops.fused_moe`` (already checked;
    nvfp4 globals as fp32 [E] tensors on x's device). ``config`` overrides entries of
    :func:`config_for` (keys :data:`CONFIG_KEYS`); a non-empty ``config`` without an
    ``MMA2`` key runs the Triton kernels (the table's MMA2 entry is dropped). With ``MMA2``
    set and :func:`dsv4lab.kernels.moe_mma2.supported` true (a GPU of sm_80 or newer, not
    the interpreter), the GEMMs are kernels/moe_mma2.py's. No host synchronisation:
    CUDA-graph capturable."""
    T, H = x.shape
    E, two_i, _ = w13.shape
    I = two_i // 2
    topk = topk_ids.shape[1]
    P = T * topk
    cfg = dict(config_for(T, topk, E, fmt), **(config or {}))
    if config and "MMA2" not in config:   # a caller's Triton tiles are for the Triton kernels
        cfg["MMA2"] = None
    unknown = set(cfg) - set(CONFIG_KEYS)
    if unknown:
        raise ValueError(f"config: unknown keys {sorted(unknown)}; expected some of {CONFIG_KEYS}")
    mma2 = cfg.get("MMA2")
    if mma2 is not None:
        keys = MMA2_LAUNCH_KEYS + ("MAX_T",)
        if not isinstance(mma2, dict) or set(mma2) - set(keys):
            raise ValueError(f"config: MMA2 must be None or a dict of {keys}, got {mma2!r}")
        launch = {k: v for k, v in mma2.items() if k != "MAX_T"}
        fits = T <= mma2.get("MAX_T", T)       # MAX_T: more tokens run the row's Triton entries
        # else the Triton kernels: not a Gluon this code is written for (asked before the
        # import, which needs Gluon), or not a GPU those kernels run on
        if fits and gluon_unsupported() is None:
            from dsv4lab.kernels import moe_mma2
            if moe_mma2.supported(x, H, I, (w13, w13_scale, w2, w2_scale)) is None:
                return moe_mma2.fused_moe(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights,
                                          fmt=fmt, w13_global=w13_global, w2_global=w2_global,
                                          swiglu_limit=swiglu_limit, **launch)
    check_canonical("moe.fused_moe (the Triton kernels)", w13=w13, w13_scale=w13_scale, w2=w2,
                    w2_scale=w2_scale)
    BM, use_dot = int(cfg["BM"]), bool(cfg["USE_DOT"])
    if use_dot and BM < 16:
        raise ValueError(f"config: USE_DOT needs BM >= 16 (tl.dot's smallest M), got BM={BM}")
    if BM < 1 or BM & (BM - 1):
        raise ValueError(f"config: BM must be a power of two, got {BM}")
    swap = bool(cfg.get("SWAP_AB", False))
    if swap and not use_dot:
        raise ValueError("config: SWAP_AB needs USE_DOT=True (it transposes the tensor-core dot)")
    if swap and min(cfg["BN1"], cfg["BN2"]) < 16:
        raise ValueError(f"config: SWAP_AB needs BN1, BN2 >= 16 (the dot's M side), "
                         f"got {cfg['BN1']}/{cfg['BN2']}")
    is_nv = fmt == "nvfp4"
    dev = x.device
    x = x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    w13_scale, w2_scale = w13_scale.contiguous(), w2_scale.contiguous()
    ids = topk_ids.contiguous()
    tw = topk_weights.reshape(-1).contiguous()
    if is_nv:   # E4M3 scales travel as raw bytes (decoded in the kernel; sm_80 has no e4m3 type)
        w13_scale, w2_scale = w13_scale.view(torch.uint8), w2_scale.view(torch.uint8)
    GS = 8 if is_nv else 16                      # packed bytes per scale
    BK1, BK2 = _pick_bk(H, cfg["BK1"]), _pick_bk(I, cfg["BK2"])
    split = _pick_split(I // BK2, int(cfg["SPLIT2"]))
    split1 = _pick_split(H // BK1, int(cfg.get("SPLIT1", 1)))
    # DECODE32 (experimental): words of 4 packed bytes; the dot's K slices are BK/8 long, so
    # with the tensor cores it needs BK >= 128 (K = 16 slices); smaller K falls back to bytes.
    dec32 = bool(cfg.get("DECODE32", False))
    dec1 = dec32 and (not use_dot or BK1 >= 128)
    dec2 = dec32 and (not use_dot or BK2 >= 128)
    # FASTDEC (experimental): inline PTX, so never under the interpreter (the byte decode
    # there); an alternative to DECODE32, not a companion.
    fast = bool(cfg.get("FASTDEC", False))
    if fast and dec32:
        raise ValueError("config: FASTDEC and DECODE32 are alternative decodes; set one")
    fast = fast and not interpreting()
    xpre = bool(cfg.get("XPRE", False))
    if xpre and dec32:
        raise ValueError("config: XPRE (pre-split x) and DECODE32 (x in word order) exclude each other")
    rowmax = bool(cfg.get("ROWMAX", False))
    if rowmax and dec32:
        raise ValueError("config: ROWMAX applies to the byte decode, not DECODE32")
    rowmax = rowmax and not is_nv
    w16 = bool(cfg.get("W16", False))
    if w16 and (not use_dot or not xpre or swap or dec32 or bool(cfg.get("FOLD", False))):
        raise ValueError("config: W16 needs USE_DOT and XPRE and excludes SWAP_AB, DECODE32 and FOLD")
    if w16 and ((BK1 // 2 // GS) % 4 or (BK2 // 2 // GS) % 4):
        raise ValueError(f"config: W16 reads a K-step's scale bytes as int32 words, so BK1 and BK2 "
                         f"must hold a multiple of 4 scales ({8 * GS} elements for {fmt}); got "
                         f"BK1={BK1}, BK2={BK2} (after fitting H={H}, I={I})")
    # word loads (DECODE32, W16: also the scales) from an offset view: realign
    if (dec1 or w16) and w13.data_ptr() % 16:
        w13 = w13.clone()
    if (dec2 or w16) and w2.data_ptr() % 16:
        w2 = w2.clone()
    if w16:
        w13_scale, w2_scale = (t if t.data_ptr() % 16 == 0 else t.clone()
                                for t in (w13_scale, w2_scale))
    fold = bool(cfg.get("FOLD", False))
    if fold and dec32:
        raise ValueError("config: FOLD is not implemented with DECODE32")
    BN1, BN2 = cfg["BN1"], cfg["BN2"]
    fused_pro = fold and align_kernel_fits(P) and T > 0
    if fused_pro:
        ids_flat, align_out, P_PAD, E_PAD, nbm = align_buffers(ids, E, BM)
        sorted_pair, block_expert, block_start, block_count = align_out
    else:
        sorted_pair, block_expert, block_start, block_count = moe_align(ids, E, BM)
    nbm = block_expert.numel()
    if fold:     # counters: (block, I tile) of the gate/up fold, then (token, H tile) of the down's
        n_gu = nbm * triton.cdiv(I, BN1) if split1 > 1 else 0
        sem = (torch.empty if fused_pro else torch.zeros)(n_gu + T * triton.cdiv(H, BN2) + 1,
                                                          dtype=torch.int32, device=dev)
        sem_dn = sem[n_gu:]
    else:
        sem = sem_dn = block_count
    # XPRE: x once as fp16 times 2**-8 with its even and odd columns in two contiguous
    # halves ([T, 2, H/2]; the rounding _x_tile + _mac apply anyway); act written alike
    # (one small kernel instead of four torch ops: at T = 1 every launch costs ~2 us even in
    # a CUDA graph)
    out = (torch.zeros if fold and not fused_pro else torch.empty)(T, H, dtype=x.dtype, device=dev)
    planes = 4 if w16 else 2                      # W16: x and act in four planes (K phases)
    BX = min(1024, triton.next_power_of_2(max(1, H // planes)))
    xk = torch.empty(T, H, dtype=torch.float16, device=dev) if xpre else x
    if fused_pro:
        nxb = triton.cdiv(H // 2, BX)
        _moe_prologue_kernel[(1 + T * nxb,)](
            ids_flat, sorted_pair, block_expert, block_start, block_count, P, E, nbm,
            x, xk, H // 2, x.stride(0), xk.stride(0), nxb, sem, sem.numel(), out, out.stride(0),
            topk, BM=BM, P_PAD=P_PAD, E_PAD=E_PAD, BH=BX, BZ=1024, XPRE=xpre,
            num_warps=4 if P_PAD <= 256 else 8)
    if xpre:
        if T and not fused_pro:
            _moe_xpre_kernel[(T, triton.cdiv(H // planes, BX))](x, xk, H // planes, x.stride(0),
                                                               xk.stride(0), BH=BX, PLANES=planes,
                                                               num_warps=4)
        act = torch.empty(P, I, dtype=torch.float16, device=dev)
    else:
        act = torch.empty(P, I, dtype=torch.float32, device=dev)
    part = torch.empty(split1, P, 2 * I, dtype=torch.float32, device=dev) if split1 > 1 else act
    ypair = torch.empty(split, P, H, dtype=torch.float32, device=dev)
    # MXFP4 has no global scales: the kernels never read gscale_ptr then, so any fp32
    # pointer will do (no zero-filled placeholder: one launch less)
    g13 = w13_global.contiguous() if is_nv else ypair
    g2 = w2_global.contiguous() if is_nv else ypair
    dot_fp32 = interpreting()
    limit = float(swiglu_limit) if swiglu_limit is not None else 0.0
    maxnreg = cfg.get("MAXNREG")
    if maxnreg is not None and not (isinstance(maxnreg, int) and 32 <= maxnreg <= 255):
        raise ValueError(f"config: MAXNREG must be None or an int in [32, 255], got {maxnreg!r}")
    regcap = {} if maxnreg is None or interpreting() else dict(maxnreg=maxnreg)
    # W16: the kernels address the weights in int16 words and the scales in int32 words
    wword, sword = (2, 4) if w16 else (1, 1)
    ks1 = H // 2 // split1 // GS // sword
    _moe_gate_up_kernel[(nbm, triton.cdiv(I, BN1), split1)](
        xk, w13, w13_scale, g13, sorted_pair, block_expert, block_start, block_count, part,
        I, topk, H // 2 // split1 // wword, ks1, H // planes,
        xk.stride(0), w13.stride(0) // wword, w13.stride(1) // wword, w13_scale.stride(0) // sword,
        w13_scale.stride(1) // sword,
        part.stride(-2), part.stride(0) if split1 > 1 else 0, limit, act, act.stride(0), sem,
        IS_NV=is_nv, HAS_LIMIT=swiglu_limit is not None, DOT_FP32=dot_fp32, USE_DOT=use_dot,
        SWAP_AB=swap, BM=BM, BN=BN1, BKH=BK1 // 2, GS=GS, DECODE32=dec1, FASTDEC=fast,
        XPRE=xpre, PARTIAL=split1 > 1, ROWMAX=rowmax, CHAIN=is_nv or rowmax,
        FOLD=fold and split1 > 1, RKC=_row_chunk(ks1, rowmax), W16=w16, PLANES=planes,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **regcap)
    if split1 > 1 and not fold:
        BI = max(16, min(triton.next_power_of_2(I), 4096 // BM))
        _moe_swiglu_kernel[(nbm, triton.cdiv(I, BI))](
            part, act, block_expert, block_start, block_count,
            I, part.stride(0), part.stride(1), act.stride(0), limit,
            HAS_LIMIT=swiglu_limit is not None, XPRE=xpre, SPLIT=split1, BM=BM, BI=BI,
            PLANES=planes, num_warps=4)
    ks2 = I // 2 // split // GS // sword
    _moe_down_kernel[(nbm, triton.cdiv(H, BN2), split)](
        act, w2, w2_scale, g2, tw, sorted_pair, block_expert, block_start, block_count, ypair,
        H, I // 2 // split // wword, ks2, I // planes,
        act.stride(0), w2.stride(0) // wword, w2.stride(1) // wword, w2_scale.stride(0) // sword,
        w2_scale.stride(1) // sword,
        ypair.stride(1), ypair.stride(0), ids, out, sem_dn, E, topk, out.stride(0),
        IS_NV=is_nv, DOT_FP32=dot_fp32, USE_DOT=use_dot, SWAP_AB=swap, BM=BM, BN=BN2, BKH=BK2 // 2, GS=GS,
        DECODE32=dec2, FASTDEC=fast, XPRE=xpre, ROWMAX=rowmax, CHAIN=is_nv or rowmax,
        FOLD=fold, RKC=_row_chunk(ks2, rowmax), W16=w16,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **regcap)
    if not fold:
        BH = min(1024, triton.next_power_of_2(H))
        _moe_combine_kernel[(T, triton.cdiv(H, BH))](
            ypair, ids, out, H, E, ypair.stride(1), ypair.stride(0), out.stride(0),
            TOPK=topk, SPLIT=split, BH=BH, num_warps=4)
    return out
