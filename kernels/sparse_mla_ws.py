"""Sparse MLA decode, warp-specialised (Hopper and newer; Gluon): gather and math overlap.

kernels/sparse_mla_mma.py runs every step of a tile (gather the rows, Q K^T, softmax,
P V) in the same warps, one after the other; measured on an H200
(scripts/profile_sparse_mla.py) its loop costs about as much with the rows in L2 as from
HBM: the math chain, not memory, sets its pace. This kernel gives each job its own warps
(Triton's Gluon dialect, which exposes shared memory, mbarriers, ``cp.async`` and
``wgmma`` directly):

* a **producer** warp group gathers tile after tile of selected latent rows by
  ``cp.async`` into a ring of ``NUM_BUF`` shared-memory buffers, signalling each full
  buffer on an mbarrier, and waits only for a buffer the consumers have released;
* two **consumer** warp groups share the math. Each holds a [64 heads, 256] fp32
  accumulator: half of d_v (V is the latent row itself, d_v = D = 512), so the two
  halves of every output row are written by their consumer.

How the consumers share the scores is the whole difference, and was measured both ways:

* **Seesaw** (``SEESAW``, the H200 default for 17+ query rows): consumer w owns the
  tiles 2j + w. It computes their full scores Q K^T (all of D), runs their softmax,
  publishes P (bf16) with the row maxima it is relative to and its fp32 row sums, and
  accumulates its half of d_v over *both* tiles of the pair, rescaling the other
  consumer's P to its own running max as it arrives. Each consumer so keeps a complete
  online-softmax state (max, sum, half the output); the two meet only through the P
  buffers (two a side), and one consumer's softmax runs while the other's matmuls do.
  H200, B 128 / S_q 2 / topk 2048: 181.6 us (rows at e167caf; 188 before the output
  rows were stored 16 bytes a thread, see :func:`_store_rows`), against 240 for the MMA
  kernel.
* **D split** (the ``ws_n*`` variants): consumer w computes the scores' half-sum
  Q[:, w] K[:, w]^T and swaps it with the other consumer through shared memory; both then
  run the same softmax. Its time from HBM equals its time from L2 (the gathers are fully
  hidden), but the swap puts the consumers in lock-step (both multiply, then both wait,
  then both run the softmax), and it is no faster than the MMA kernel (258 us).

Where the seesaw kernel's time goes (H200, recorded by scripts/profile_sparse_mla.py at
a41adc1): at B 128 / S_q 2 it takes 191.3 us from HBM and 182.2 us with every row in L2, so
the consumers' chain (scores, softmax, P exchange, P V), not memory, sets its pace; a
one-off Nsight Compute reading at B 64 / S_q 1 (not a recorded row) agreed: neither the
tensor pipe nor DRAM near saturation, the warps waiting on the slots' index loads and on
the warp groups' barriers around the exchange. Issuing a consumer's next scores
asynchronously during the exchange, carried across the loop's back edge (tried, not kept),
made ptxas serialise every wgmma of the kernel (C7514: accumulator registers of an
in-flight wgmma read by other instructions). Queuing them instead behind the other tile's P
V, both waited at the end of the pair, with the slots' validity loaded a pair ahead,
compiled unserialised but ran slower (variant ws_ssq_n32_b4, recorded at a41adc1: 66.8 /
205.1 us at B64 S1 / B128 S2 against 63.2 / 191.8; the code is gone): the consumer then
waits for both products before its next softmax, which the plain seesaw overlaps with the
other consumer's.

The split-KV partials (normalised output and base-2 log-sum-exp) are those of the MMA
kernel and are merged by its ``_combine_kernel`` (or, a variant measured slower, by the two
programs of a pair themselves: ``merge_pair``, see :func:`_epilogue`). With ``part16`` they
are stored in q's dtype, 16 bytes a thread like the output rows (:func:`_store_partial`), and
with ``pdl`` the combine is a programmatic dependent launch that this kernel lets start at
once: H200, B 64 / S_q 1, rows at 12dd69a, 61.6 us -> 59.7 (part16) -> 58.5 (both), the
table's default since 19bca93 (58.5 us, 0.575 of the roofline). Measured slower and reverted:
Q's copy issued before the -1 trim's index scan (the scan's load then queued behind Q's 64 KB:
producer start 1.3 -> 3.1 us, B 128 / S_q 2 181.6 -> 188.7, rows at 2b3eae7, together with
split-KV programs holding the rest of the ring until tile 0 had landed, which moved the
first tile no earlier: 5.6 -> 5.9 us on the timeline). Constexprs do not
cross into Gluon's warp-specialised partitions (Triton 3.6): the partitions read BLOCK_N,
NUM_BUF and the design off their shared-memory buffers' shapes and types.

The FP8 cache (584-byte rows: 448 e4m3, 64 bf16 RoPE, the groups' scale bytes). The
producer copies tile i + 1's raw rows by ``cp.async`` into one of two staging slots while
it dequantises tile i from the other into its ring buffer (e4m3 to fp32, times the
group's power of two, to bf16: exact), fences those plain stores for the consumers'
wgmma and signals the tile; the consumers run the bf16 code unchanged. Staging takes the
shared memory of a fourth ring buffer, so FP8 runs three. H200, rows at e167caf: 262.2 us
at B 128 / S_q 2 and 78.0 at B 64 / S_q 1 (the MMA kernel's FP8 path, rows at 9b970d6:
317.1 / 96.8; bf16 here with three buffers: 207.6 / 67.7, with four: 181.6 / 61.5).
Why FP8 is not faster than bf16 here, and 1.4x is out of this design's reach: at 64 heads
a 584-byte FP8 row carries 2 x 64 x 1024 FLOPs, 224 FLOP a byte, above the H200's
measured ridge (713 TFLOP/s over 4.24 TB/s: 168), so FP8 decode is bound by the bf16
tensor cores (roofline 96.4 us at B 128 / S_q 2, against bf16's 118.7 us of bytes). 1.4x
bf16's 181.6 us is 129.7 us: the consumers would have to run their [64 x 32] MMAs at 74%
of the dense-GEMM peak while the producer dequantises, where the bf16 kernel reaches 53%.
Scores in FP8 (e4m3 wgmma, twice the rate) would lift that bound but round q to e4m3,
a change of numerics, not of speed. Measured slower
and reverted (rows withdrawn from newest-first readers, data/results/withdrawn.json): a
third staging slot paid for with one P buffer a side (281.4 / 82.8, 250b8c8); a tile's
e4m3 bytes staged by one [32, 512] copy instead of seven group copies (472.8 / 106.0,
93df762: Triton's barrier analysis puts a bar.sync between any two copies into one
buffer, six a tile, but 512-byte staged rows put the conversion's reads of four rows in
one shared-memory bank). Offline only: the raw rows held in the producer's registers
instead of staged (a fourth ring buffer) spilled 1.4-2 KB at 72-104 registers (byte
tensors take a register a byte).

Where a program's time goes (the timeline: DSV4LAB_WS_TIMELINE=1, see TIMELINE_POINTS;
scripts/profile_sparse_mla.py --timeline, rows at 2878c6b; median program, five calls).
At B 64 / S_q 1 / topk 2048 (two split-KV ranges, 128 programs) the first tile is ready
5.6 us after the call's first program starts (128 programs load Q's 8 MB at once, and the
first gather waits behind it; loading tile 0's indices before Q and moving the -1 trim off
the kernel's top changed nothing: rows at ee7fead, reverted), the 32 tiles take 1.25 us
each (40.0 us), the epilogue (normalise, store the fp32 partials) 3.8 us, and the last
program ends 2.6 us after the median; then the combine kernel (~5 us in a torch profiler
reading). At B 128 / S_q 1 (no split, 64 tiles): 6.4 us, 1.25 us a tile, 3.1 us. (Rows at
1b1e7ca, with bf16 partials and the swizzled exchange: B 64 / S_q 1 5.9 us, 1.24 us a tile,
a 2.0 us epilogue, the last program 3.1 us after the median; B 128 / S_q 1 6.4, 1.24, 2.8.)
Reaching 60% of the roofline at B 64 / S_q 1 (56 us by the benchmark) needed that fixed cost
roughly halved, or the tiles faster (it came from the L2 instead: ``EVICT_KV`` below). By
arithmetic (not measured): each wgmma of a tile's scores (M 64, N 32, K 16) reads 3 KB of
shared memory (Q's 2 KB, K's 1 KB) for 32K multiply-adds, 24 clocks at 128 bytes a clock
against the tensor cores' 16, so the scores wait on shared memory; 64-row units (4 KB for
64K) would balance them, but the seesaw's ring of three such units does not fit beside Q.

The seesaw's knobs, and what they were worth (H200; "A/B" is a scripts/ab_sparse_mla.py
printout, "rows" are `dsv4lab bench sparse_mla` rows). A Nsight Compute reading of the
consumers at B 64 / S_q 1 (at 45aeb45, a printout, clocks at base) put their stall samples in
the scores' wgmma (about 27%), the softmax (18%), publishing P (8-15%) and waiting for the
other consumer's P (10-14%, consumer 0 more: it runs ahead); the producer mostly waits for
a free buffer. So the chain's latency, not its instruction count, sets the pace:

* ``P_SWIZZLE`` (the H200 table's mid/large entries since 45aeb45): the P exchange buffers
  NVMMA-swizzled. Unswizzled 64-byte rows put an 8 x 8 stmatrix / ldmatrix block's eight
  rows in two bank groups. A/B at 3b2a51d: faster at all eight mid/large shapes, 0.3-2.8%
  (B128 S2 184.7 -> 179.5 us, B64 S1 58.4 -> 58.0).
* ``LAZY_SS`` (Config.lazy; the table's FP8 large entry): the held max moves, and the two
  [64, 256] rescales of a pair run, only once a head's scores exceed it by 2^8
  (:func:`_next_max`). Its decision is a warp-group reduction; bf16 is slower everywhere
  (B128 S2 182.8 -> 202.3, B64 S1 58.2 -> 61.5, A/B at 5db5ef5), FP8 faster at large
  shapes, where the producer's dequantisation shares the issue slots (B128 S2 266.7 ->
  259.9, B128 S4 527.2 -> 510.0) and slower at mid ones (B64 S1 74.5 -> 76.4).
* Tried and removed: PINGPONG, the two consumers' scores taking turns on a pair of
  mbarriers so that one's softmax overlaps the other's wgmma: slower at all eight shapes
  (A/B at 3b2a51d: B128 S4 358.4 -> 387.8; rows at 45aeb45, ws_ss_n32_b4_pp 62.1 / 187.6
  against 61.3 / 183.1). PAIR_MAX, the held max moved once a pair (P published against the
  tile's max, one rescale a pair, both P V issued back to back; 224 fewer FMUL in the
  sm_90 SASS): slower at all nine bf16 shapes of an A/B at 542956a (B128 S4 336.6 ->
  346.6, B64 S1 57.4 -> 58.1), as the own tile's P V then waits for the other's P.
  Staging the output rows through Q's freed shared memory (stmatrix, one barrier) compiled
  to as many instructions as the register conversion and was not timed.
* ``EVICT_KV`` (Config.evict_kv; the table's ws entries since session 15, at S_q = 1): the
  KV gathers under an L2 evict-first policy (kernels/l2_hint.py rewrites the marked kernel's
  PTX: Gluon's cp.async drops the policy on Triton 3.6). The benchmark's calls meet an L2
  full of dirty lines; rows read once then stop pushing them out (each a write-back first).
  A/B at ec05afa: B64 S1 57.9 -> 54.3 us, B32 S1 39.1 -> 36.2, FP8 B64 S1 73.3 -> 71.9; at
  S_q > 1, where a verify step's positions share rows in L2, no faster (B128 S2 179.1 both)
  or slower (B128 S4 339.1 -> 348.2), so the launcher applies it at S_q = 1 only. Rows at
  a861507: B64 S1 54.1 us (0.621 of the roofline) against 58.0 without it in the same run.

Scope: bf16 (or fp16) q and KV cache, or bf16 q and the FP8 cache, H = 64 heads (one
block), D = d_v = 512, on capability 9.x and 10.x with Triton's Gluon; everything else
(the interpreter, sm_80, sm_120, fp16 q with FP8, other shapes) runs
kernels/sparse_mla_mma.py. Explained in notebooks/02_mma_attention.ipynb.
"""
import os

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy, fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait)

from dsv4lab.kernels.device import gluon_unsupported
from dsv4lab.kernels import l2_hint
from dsv4lab.kernels.gluon_compat import async_load, cta_barrier, gdc_launch_dependents

HEADS = gl.constexpr(64)
DIM = gl.constexpr(512)
HALF = gl.constexpr(256)      # the columns of D (and d_v) one consumer owns
LAZY_SLACK = gl.constexpr(8.0)  # the lazy rescale's slack on the running max (base 2)
FP8_ROW_BYTES = 584           # an FP8 cache row: 448 e4m3, 64 bf16 RoPE, 8 scale bytes
FP8_ROW = gl.constexpr(FP8_ROW_BYTES)
_FP8_SLOTS = 2                # staging slots of raw FP8 rows (the tile converting, the next)
FP8_STAGES = gl.constexpr(_FP8_SLOTS)
# The timeline (scripts/profile_sparse_mla.py --timeline): with DSV4LAB_WS_TIMELINE=1 in the
# environment when this module is imported, each program reads %globaltimer at the points
# of TIMELINE_POINTS into a buffer (:func:`timeline`); otherwise the reads compile away.
TIMELINE = gl.constexpr(os.environ.get("DSV4LAB_WS_TIMELINE", "0") == "1")
TIMELINE_POINTS = ("program start", "producer start", "first gather issued", "producer done",
                   "consumer start", "Q ready", "first tile ready", "loop end",
                   "epilogue end (consumer 0)", "epilogue end (consumer 1)")
_TIMELINE_SLOTS = 16
_LAST_TIMELINE: list = []


@gluon.jit
def _stamp(stamps, prog, point: gl.constexpr):
    """TIMELINE: program ``prog`` records %globaltimer (ns) at ``point``; nothing otherwise."""
    if TIMELINE:
        one: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        i = gl.arange(0, 128, layout=one)
        t = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [i], dtype=gl.int64,
                                      is_pure=False, pack=1)
        gl.store(stamps.to(gl.pointer_type(gl.int64)) + prog * 16 + point + 0 * i, t, mask=i == 0)


@gluon.jit
def _trim_end(idx_row, start, end, SCAN_N: gl.constexpr, num_warps: gl.constexpr):
    """One past the last valid slot of ``idx_row[start:end]`` (``start`` if none): the
    -1 tail of a long list costs no tile (as kernels/sparse_mla_mma.py's _trim_tail)."""
    layout: gl.constexpr = gl.BlockedLayout([SCAN_N // (32 * num_warps)], [32], [num_warps], [0])
    last = start - 1
    hi = end
    while (hi > start) & (last < start):
        offs = hi - SCAN_N + gl.arange(0, SCAN_N, layout=layout)
        ic = gl.load(idx_row + offs, mask=(offs >= start) & (offs < hi), other=-1)
        last = gl.maximum(last, gl.max(gl.where(ic >= 0, offs, start - 1), axis=0))
        hi -= SCAN_N
    return last + 1


@triton.constexpr_function
def _row_store_layout():
    """[64, 256] with 8 consecutive columns a thread, warp w keeping the wgmma
    accumulator's rows 16 w .. 16 w + 15 (Triton 3.6 still converts through a small
    shared-memory scratch, in rounds)."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0], [0, 32], [0, 64], [0, 128]],
        lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[HEADS, HALF])


@gluon.jit
def _store_rows(ptr, rows, v, W: gl.constexpr):
    """Store consumer W's half (columns W * 256 ..) of the 16-bit output rows ``rows``,
    16 bytes a thread.

    Straight from the accumulator layout a thread holds 2 consecutive columns, so a warp's
    bf16 store writes 8 rows x 16 bytes, half of each 32-byte sector it touches. Converted
    first, a store writes 8 rows x 64 bytes. H200, `dsv4lab bench sparse_mla` rows at
    e167caf against 9b970d6, shapes without split-KV: 190.6 -> 181.6 us at B 128 / S_q 2
    (FP8 268.8 -> 262.2), 101.9 -> 96.6 at B 128 / S_q 1, 83.4 -> 74.2 at B 128 / S_q 2 /
    topk 640. The fp32 split partials are stored as they are: a thread's 2 columns already
    fill 32-byte sectors there, and converting them made B 64 / S_q 1 4.4 us slower (an
    A/B on the H200 before e167caf, not a recorded row: the conversion's rounds through
    shared memory)."""
    st: gl.constexpr = _row_store_layout()
    v = gl.convert_layout(v, st)
    r = gl.convert_layout(rows, gl.SliceLayout(1, st))
    c = W * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, st))
    gl.store(ptr + r[:, None] * DIM + c[None, :], v)


@gluon.jit
def _finish(o, lse2, sink_ptr, out_ptr, lse_ptr, orow, h, has_sink, W: gl.constexpr):
    """Write this consumer's half of the output rows from their normalised output ``o`` and
    base-2 log-sum-exp ``lse2`` (-inf: no valid slot), with the attention sink."""
    if has_sink:
        sk = gl.load(sink_ptr + h).to(gl.float32) * 1.4426950408889634
        m_f = gl.maximum(lse2, sk)
        a = gl.exp2(lse2 - m_f)
        denom = a + gl.exp2(sk - m_f)
        o = o * (a / denom)[:, None]
        lse = (m_f + gl.log2(denom)) * 0.6931471805599453
    else:
        lse = lse2 * 0.6931471805599453
    _store_rows(out_ptr, orow + h, o.to(out_ptr.dtype.element_ty), W)
    if W == 0:
        gl.store(lse_ptr + orow + h, lse)


@gluon.jit
def _store_partial(opart_ptr, prow, h, c, o, W: gl.constexpr):
    """A split's normalised output half: fp32 as the accumulator holds it (2 columns a
    thread already fill 32-byte sectors), 16-bit partials (Config.part16) as the output
    rows are stored, 16 bytes a thread."""
    if opart_ptr.dtype.element_ty.primitive_bitwidth == 16:
        _store_rows(opart_ptr, prow + h, o.to(opart_ptr.dtype.element_ty), W)
    else:
        gl.store(opart_ptr + (prow + h)[:, None] * DIM + c[None, :], o)


@gluon.jit
def _epilogue(acc, m_i, l_i, sink_ptr, out_ptr, lse_ptr, opart_ptr, lpart_ptr, cnt_ptr, prow, orow,
              has_sink, split, W: gl.constexpr):
    """This consumer's half of each output row (lse from consumer 0). ``split`` 0: the
    output, with the sink. 1: the split partial (normalised output, base-2 lse) for the MMA
    kernel's combine. 2 (two splits): the pair merges itself, no combine launch. At each
    half W the two programs count themselves in on their query's counter (one acq_rel
    atomic at GPU scope; the counters grow by 2 a call and are never reset, so an even
    count before means first). The first stores its partial half and lse, then (after a
    barrier of its warp group, so the release covers every thread's stores) bumps a second
    counter; the second waits for that bump, reads the partial back (L2), merges it with its
    own and writes the output half. Only a program that has already counted itself in is
    waited for, so nothing waits on a program not yet started.

    H200, B 64 / S_q 1 / topk 2048, rows at 69834a0: 62.3 us against 61.4 with the combine
    kernel (an A/B printout at 7b719d9 by the benchmark's method had it 0.4 us faster there,
    1.0 faster at B 32 / S_q 2 and 0.4 slower at B 48 / S_q 1: within a microsecond either
    way). The combine kernel's 4.9 us mostly comes back as the merge on the critical path (the first's stores drained, an atomic round
    trip, the partial read back), hence a variant (``merge_pair``; Config.merge_pair,
    variant ws_ss_n32_b4_merge), not the default. (Before 7b719d9 both programs stored their
    partials and the last to count itself in merged: 63.4 us, rows at e167caf.)"""
    o_layout: gl.constexpr = acc.type.layout
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    m_o = gl.convert_layout(m_i, gl.SliceLayout(1, o_layout))
    h = gl.arange(0, HEADS, layout=gl.SliceLayout(1, o_layout))
    c = W * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, o_layout))
    has = l_o > 0
    o = acc / gl.where(has, l_o, 1.0)[:, None]
    lse2 = gl.where(has, m_o + gl.log2(gl.where(has, l_o, 1.0)), float("-inf"))
    if split == 0:
        _finish(o, lse2, sink_ptr, out_ptr, lse_ptr, orow, h, has_sink, W)
    elif split == 1:
        _store_partial(opart_ptr, prow, h, c, o, W)
        if W == 0:
            gl.store(lpart_ptr + prow + h, lse2)
    else:
        # counters of query q: [4 q + W] arrivals at half W (2 a call), [4 q + 2 + W] the
        # first arriver's "my half is stored" (1 a call); neither is ever reset
        one: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])   # an element a thread
        i = gl.arange(0, 128, layout=one)
        lead = i == 0
        q_cnt = cnt_ptr + 4 * (orow // HEADS) + 0 * i
        old = gl.atomic_add(q_cnt + W, gl.full([128], 1, gl.int32, one), mask=lead,
                            sem="acq_rel", scope="gpu")
        old = gl.max(gl.where(lead, old, 0), axis=0)
        if (old & 1) == 0:
            # first of the pair at this half: ship it and signal; the other program writes
            _store_partial(opart_ptr, prow, h, c, o, W)
            gl.store(lpart_ptr + 2 * prow + W * HEADS + h, lse2)   # [query, split, half, head]
            cta_barrier()
            gl.atomic_add(q_cnt + 2 + W, gl.full([128], 1, gl.int32, one), mask=lead,
                          sem="release", scope="gpu")
        else:
            # second: wait for the first's half (it is running: it has counted itself in),
            # read it back, merge, write the output. The bound only turns a broken counter
            # into a wrong answer the tests catch instead of a hang.
            want = old // 2 + 1
            seen = want - 1
            spins = 0
            while (seen < want) & (spins < 1 << 24):
                v = gl.atomic_add(q_cnt + 2 + W, gl.full([128], 0, gl.int32, one), mask=lead,
                                  sem="acquire", scope="gpu")
                seen = gl.max(gl.where(lead, v, 0), axis=0)
                spins += 1
            cta_barrier()
            sp = prow // HEADS - 2 * (orow // HEADS)
            other = prow + (1 - 2 * sp) * HEADS
            o2 = gl.load(opart_ptr + (other + h)[:, None] * DIM + c[None, :], cache_modifier=".cg")
            l2 = gl.load(lpart_ptr + 2 * other + W * HEADS + h, cache_modifier=".cg")
            m = gl.maximum(lse2, l2)
            m_safe = gl.where(m == float("-inf"), 0.0, m)
            w1 = gl.exp2(lse2 - m_safe)
            w2 = gl.exp2(l2 - m_safe)
            denom = w1 + w2
            ok = denom > 0
            o = (o * w1[:, None] + o2 * w2[:, None]) / gl.where(ok, denom, 1.0)[:, None]
            lse2 = gl.where(ok, m_safe + gl.log2(gl.where(ok, denom, 1.0)), float("-inf"))
            _finish(o, lse2, sink_ptr, out_ptr, lse_ptr, orow, h, has_sink, W)


@gluon.jit
def _load_q(q_row, q_smem, q_bar):
    """The query rows [64, 512] into shared memory by cp.async, signalled on ``q_bar``."""
    gather: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    cols = gl.arange(0, DIM, layout=gl.SliceLayout(0, gather))
    h = gl.arange(0, HEADS, layout=gl.SliceLayout(1, gather))
    async_load(q_smem, q_row + h[:, None] * DIM + cols[None, :])
    async_copy.mbarrier_arrive(q_bar)
    mbarrier.arrive(q_bar, count=1)


@gluon.jit
def _slots(idx_row, start, end, tile, BLOCK_N: gl.constexpr, layout: gl.constexpr):
    """The cache rows of tile ``tile``'s slots of the range (-1 past ``end``), laid out as
    ``layout`` (a slice layout of the tensor they address)."""
    offs = start + tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=layout)
    return gl.load(idx_row + offs, mask=offs < end, other=-1)


@gluon.jit
def _tile_count(start, end, BLOCK_N: gl.constexpr, s_smem):
    """Tiles of the range; seesaw (a 16-bit exchange buffer) takes whole pairs: a last odd
    tile's twin is all -1."""
    n_tiles = gl.cdiv(end - start, BLOCK_N)
    if s_smem.dtype.primitive_bitwidth == 16:
        n_tiles = 2 * gl.cdiv(n_tiles, 2)
    return n_tiles


@gluon.jit
def _producer(q_row, kv_ptr, idx_row, start, end, q_smem, kv_smem, s_smem, m_smem, bars, qk_scale,
              sink_ptr, out_ptr, lse_ptr, opart_ptr, lpart_ptr, cnt_ptr, prow, orow, has_sink, split,
              lazy):
    """4 warps: Q once, then the KV ring (cp.async; a buffer is refilled once both
    consumers released it). The next tile's indices are loaded before the wait for its
    buffer, so their latency hides behind the consumers' work."""
    q_bar, kv_ready, kv_empty, s_ready, s_free = bars
    NUM_BUF: gl.constexpr = kv_smem.type.shape[0]
    BLOCK_N: gl.constexpr = kv_smem.type.shape[1]
    gather: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    rows_l: gl.constexpr = gl.SliceLayout(1, gather)
    cols = gl.arange(0, DIM, layout=gl.SliceLayout(0, gather))
    _stamp(cnt_ptr, prow // HEADS, 1)
    _load_q(q_row, q_smem, q_bar)

    n_tiles = _tile_count(start, end, BLOCK_N, s_smem)
    idx = _slots(idx_row, start, end, 0, BLOCK_N, rows_l)
    for i in range(n_tiles):
        buf = i % NUM_BUF
        valid = idx >= 0
        ptrs = kv_ptr + gl.where(valid, idx, 0).to(gl.int64)[:, None] * DIM + cols[None, :]
        idx = _slots(idx_row, start, end, i + 1, BLOCK_N, rows_l)     # tile i + 1's slots
        mbarrier.wait(kv_empty.index(buf), ((i // NUM_BUF) & 1) ^ 1)
        # masked rows are zero-filled: P = 0 there, and 0 * V stays 0
        async_load(kv_smem.index(buf), ptrs, mask=valid[:, None])
        async_copy.mbarrier_arrive(kv_ready.index(buf))
        mbarrier.arrive(kv_ready.index(buf), count=1)
        if i == 0:
            _stamp(cnt_ptr, prow // HEADS, 2)
    _stamp(cnt_ptr, prow // HEADS, 3)


@gluon.jit
def _stage_fp8(kv_ptr, idx, c, nope_stage, rope_stage, slot):
    """Start copying the FP8 rows ``idx`` ([BLOCK_N]; -1: zero-filled) into staging slot
    ``slot``: the seven 64-byte e4m3 groups and the bf16 RoPE part, 8-byte cp.async (a
    584-byte row starts 8-byte aligned), committed as one group."""
    valid = idx >= 0
    row = gl.where(valid, idx, 0).to(gl.int64)[:, None]
    m = valid[:, None]
    for j in gl.static_range(7):
        async_load(nope_stage.index(7 * slot + j), kv_ptr + row * FP8_ROW + 64 * j + c[None, :],
                   mask=m)
    rope_ptr = kv_ptr.to(gl.pointer_type(rope_stage.dtype))
    async_load(rope_stage.index(slot), rope_ptr + row * (FP8_ROW // 2) + 224 + c[None, :], mask=m)
    async_copy.commit_group()


@gluon.jit
def _scale_words(kv_ptr, idx):
    """The eight scale bytes (576..583) of each FP8 row as one int64 (byte j: group j's
    ``s``, the group's scale is 2^(s - 127)); 0 for a -1 slot."""
    valid = idx >= 0
    words = kv_ptr.to(gl.pointer_type(gl.int64))
    return gl.load(words + gl.where(valid, idx, 0).to(gl.int64) * (FP8_ROW // 8) + 72, mask=valid,
                   other=0)


@gluon.jit
def _store_group(tile, raw, sw, j: gl.constexpr):
    """Group j (columns 64 j ..) of a ring tile from its e4m3 bytes ``raw`` [BLOCK_N, 64]
    and the rows' scale words: e4m3 to fp32, times 2^(s - 127) (exact), rounded once to
    the tile's dtype (exact too: 3 mantissa bits)."""
    scale = (((sw >> (8 * j)) & 0xFF) << 23).to(gl.int32).to(gl.float32, bitcast=True)
    val = raw.to(gl.float8e4nv, bitcast=True).to(gl.float32) * scale[:, None]
    tile.slice(64 * j, 64, dim=1).store(val.to(tile.dtype))


@gluon.jit
def _publish(tile_ready):
    """The producer's plain shared-memory stores of a tile made visible to the consumers'
    wgmma (the async proxy), then the tile signalled once every producer thread is done."""
    fence_async_shared()
    cta_barrier()
    mbarrier.arrive(tile_ready, count=1)


@gluon.jit
def _producer_fp8(q_row, kv_ptr, idx_row, start, end, q_smem, kv_smem, s_smem, m_smem, bars,
                  qk_scale, sink_ptr, out_ptr, lse_ptr, opart_ptr, lpart_ptr, cnt_ptr, prow, orow,
                  has_sink, split, lazy, nope_stage, rope_stage):
    """4 warps, the FP8 cache: the raw rows of tile i + 1 travel by cp.async into a staging
    slot while tile i is dequantised from the other slot into its ring buffer (e4m3 to
    fp32, times the group's power-of-two scale: exact in bf16) with plain shared-memory
    stores, fenced for the consumers' wgmma before the ready signal. The slots' indices
    are loaded two tiles ahead, so no copy waits for its addresses. The consumers see the
    same bf16 tiles as with a bf16 cache."""
    q_bar, kv_ready, kv_empty, s_ready, s_free = bars
    NUM_BUF: gl.constexpr = kv_smem.type.shape[0]
    BLOCK_N: gl.constexpr = kv_smem.type.shape[1]
    STAGES: gl.constexpr = rope_stage.type.shape[0]
    chunk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows_l: gl.constexpr = gl.SliceLayout(1, chunk)
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, chunk))
    _load_q(q_row, q_smem, q_bar)

    n_tiles = _tile_count(start, end, BLOCK_N, s_smem)
    idx = _slots(idx_row, start, end, 0, BLOCK_N, rows_l)
    _stage_fp8(kv_ptr, idx, c, nope_stage, rope_stage, 0)
    sw = _scale_words(kv_ptr, idx)
    idx = _slots(idx_row, start, end, 1, BLOCK_N, rows_l)
    for i in range(n_tiles):
        _stage_fp8(kv_ptr, idx, c, nope_stage, rope_stage, (i + 1) % STAGES)    # tile i + 1
        sw_next = _scale_words(kv_ptr, idx)
        idx = _slots(idx_row, start, end, i + 2, BLOCK_N, rows_l)                # tile i + 2
        async_copy.wait_group(1)                  # tile i's group (tile i + 1's may fly)
        cta_barrier()                             # every thread's copies, not just its own
        slot = i % STAGES
        buf = i % NUM_BUF
        mbarrier.wait(kv_empty.index(buf), ((i // NUM_BUF) & 1) ^ 1)
        tile = kv_smem.index(buf)
        for j in gl.static_range(7):
            _store_group(tile, nope_stage.index(7 * slot + j).load(chunk), sw, j)
        tile.slice(448, 64, dim=1).store(rope_stage.index(slot).load(chunk))
        _publish(kv_ready.index(buf))             # (its barrier also frees the slot)
        sw = sw_next
    async_copy.wait_group(0)                      # the last (all -1) group, before exit


@triton.constexpr_function
def _wgmma_layout(n):
    """One consumer warp group's wgmma accumulator layout for [64, n] (the scores: n =
    BLOCK_N; its output half: n = 256)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.jit
def _consumer(q_row, kv_ptr, idx_row, start, end, q_smem, kv_smem, s_smem, m_smem, bars, qk_scale,
              sink_ptr, out_ptr, lse_ptr, opart_ptr, lpart_ptr, cnt_ptr, prow, orow, has_sink, split,
              lazy, W: gl.constexpr):
    """4 warps, columns [W * 256, W * 256 + 256) of D and of d_v."""
    q_bar, kv_ready, kv_empty, s_ready, s_free = bars
    NUM_BUF: gl.constexpr = kv_smem.type.shape[0]
    BLOCK_N: gl.constexpr = kv_smem.type.shape[1]
    S_BUFS: gl.constexpr = s_smem.type.shape[0] // 2     # 2: parity-double-buffered swap
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = _wgmma_layout(HALF)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_l: gl.constexpr = gl.SliceLayout(0, s_layout)

    m_i = gl.full([HEADS], float("-inf"), gl.float32, layout=row_l)
    l_i = gl.zeros([HEADS], gl.float32, layout=row_l)
    acc = gl.zeros([HEADS, HALF], gl.float32, layout=o_layout)
    s0 = gl.zeros([HEADS, BLOCK_N], gl.float32, layout=s_layout)
    q_half = q_smem.slice(W * HALF, HALF, dim=1)
    mbarrier.wait(q_bar, 0)

    n_tiles = gl.cdiv(end - start, BLOCK_N)
    for i in range(n_tiles):
        buf = i % NUM_BUF
        valid = _slots(idx_row, start, end, i, BLOCK_N, col_l) >= 0
        mbarrier.wait(kv_ready.index(buf), (i // NUM_BUF) & 1)
        kv = kv_smem.index(buf)
        s = warpgroup_mma(q_half, kv.slice(W * HALF, HALF, dim=1).permute([1, 0]), s0,
                          use_acc=False)
        # swap the half-scores with the other consumer. Two buffers a side: a buffer is
        # rewritten two tiles later, after the other consumer signalled the tile in between
        # (so after it read this one). One buffer a side: the reader frees it (s_free).
        sb = W * S_BUFS + i % S_BUFS
        ob = (1 - W) * S_BUFS + i % S_BUFS
        if S_BUFS == 1:
            mbarrier.wait(s_free.index(W), (i & 1) ^ 1)
        s_smem.index(sb).store(s)
        cta_barrier()
        mbarrier.arrive(s_ready.index(sb), count=1)
        mbarrier.wait(s_ready.index(ob), (i // S_BUFS) & 1)
        s = (s + s_smem.index(ob).load(s_layout)) * qk_scale
        if S_BUFS == 1:
            cta_barrier()
            mbarrier.arrive(s_free.index(1 - W), count=1)
        s = gl.where(valid[None, :], s, float("-inf"))

        m_tile = gl.max(s, axis=1)
        if lazy:
            # move the running max (and rescale acc) only once some head's max grew by more
            # than 2^8: p <= 256 meanwhile, and most tiles skip the [64, 256] multiply.
            # Both consumers hold the same S, so they decide alike.
            if _max_grew(m_i, m_tile):
                m_new = gl.maximum(m_i, m_tile)
                alpha = gl.exp2(m_i - gl.where(m_new == float("-inf"), 0.0, m_new))
                l_i = l_i * alpha
                acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
                m_i = m_new
            p = gl.exp2(s - gl.where(m_i == float("-inf"), 0.0, m_i)[:, None])
            l_i += gl.sum(p, axis=1)
        else:
            m_new = gl.maximum(m_i, m_tile)
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_safe)
            p = gl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p_op = gl.convert_layout(p.to(kv_smem.dtype), p_layout)
        acc = warpgroup_mma(p_op, kv.slice(W * HALF, HALF, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        mbarrier.arrive(kv_empty.index(buf), count=1)     # the tile's last reader is done

    _epilogue(acc, m_i, l_i, sink_ptr, out_ptr, lse_ptr, opart_ptr, lpart_ptr, cnt_ptr, prow, orow,
              has_sink, split, W)


@gluon.jit
def _max_grew(m_i, m_seen):
    """The lazy rescale's test: some head's ``m_seen`` exceeds its held max ``m_i`` by more
    than LAZY_SLACK (base 2). One warp-group reduction, so the whole group branches alike."""
    return gl.max(gl.where(m_seen > m_i + LAZY_SLACK, 1, 0), axis=0) > 0


@gluon.jit
def _next_max(m_i, m_seen, LAZY: gl.constexpr):
    """The seesaw's next running max from the maxima ``m_seen`` of scores it takes in, and
    whether it moved (so acc must be rescaled). Eager: always max(m_i, m_seen). LAZY:
    only once some head's ``m_seen`` exceeds ``m_i`` by more than LAZY_SLACK (base 2),
    so most pairs skip both [64, 256] rescales; P stays <= 2^8 relative to the held max
    (a peer's P, rescaled to it, <= 2^16), far inside bf16 and fp32 (:func:`_max_grew`)."""
    if LAZY:
        grow = _max_grew(m_i, m_seen)
        return gl.where(grow, gl.maximum(m_i, m_seen), m_i), grow
    else:
        return gl.maximum(m_i, m_seen), True


@gluon.jit
def _consumer_ss(q_row, kv_ptr, idx_row, start, end, q_smem, kv_smem, p_smem, m_smem, bars,
                 qk_scale, sink_ptr, out_ptr, lse_ptr, opart_ptr, lpart_ptr, cnt_ptr, prow, orow, has_sink,
                 split, lazy, W: gl.constexpr):
    """Seesaw: consumer W owns tiles 2j + W. It computes their full scores (all of D) and
    softmax, publishes P (bf16) with its row maxima, and accumulates its half of d_v over
    both tiles of the pair, rescaling the other consumer's P to its own running max on
    arrival. Each consumer keeps a complete online-softmax state (max, sum, half the
    output), so the two only meet through the P buffers, never in lock-step."""
    q_bar, kv_ready, kv_empty, p_ready, p_free = bars
    NUM_BUF: gl.constexpr = kv_smem.type.shape[0]
    BLOCK_N: gl.constexpr = kv_smem.type.shape[1]
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = _wgmma_layout(HALF)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_l: gl.constexpr = gl.SliceLayout(0, s_layout)
    orow_l: gl.constexpr = gl.SliceLayout(1, o_layout)
    LAZY: gl.constexpr = m_smem.type.shape[0] > 8       # the kernel's LAZY_SS (see there)

    m_i = gl.full([HEADS], float("-inf"), gl.float32, layout=row_l)
    l_i = gl.zeros([HEADS], gl.float32, layout=row_l)
    acc = gl.zeros([HEADS, HALF], gl.float32, layout=o_layout)
    s0 = gl.zeros([HEADS, BLOCK_N], gl.float32, layout=s_layout)
    if W == 0:
        _stamp(cnt_ptr, prow // HEADS, 4)
    mbarrier.wait(q_bar, 0)
    if W == 0:
        _stamp(cnt_ptr, prow // HEADS, 5)

    n_pairs = gl.cdiv(gl.cdiv(end - start, BLOCK_N), 2)
    for j in range(n_pairs):
        par = j % 2
        t = 2 * j + W
        buf = t % NUM_BUF
        valid = _slots(idx_row, start, end, t, BLOCK_N, col_l) >= 0
        mbarrier.wait(kv_ready.index(buf), (t // NUM_BUF) & 1)
        if W == 0:
            if j == 0:
                _stamp(cnt_ptr, prow // HEADS, 6)
        kv = kv_smem.index(buf)
        s = warpgroup_mma(q_smem, kv.permute([1, 0]), s0, use_acc=False)
        s = gl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new, grow = _next_max(m_i, gl.max(s, axis=1), LAZY)
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p32 = gl.exp2(s - m_safe[:, None])
        rsum = gl.sum(p32, axis=1)
        p = p32.to(kv_smem.dtype)
        l_i = l_i * alpha + rsum
        m_i = m_new
        if grow:
            acc = acc * gl.convert_layout(alpha, orow_l)[:, None]
        # publish P, the max it is relative to and its fp32 row sums (the sums of the
        # rounded P would put a bf16 rounding into the other consumer's log-sum-exp); two
        # buffers a side, the reader frees one
        mine = W * 2 + par
        mbarrier.wait(p_free.index(mine), ((j // 2) & 1) ^ 1)
        p_smem.index(mine).store(p)
        m_smem.index(mine).store(m_i)
        m_smem.index(4 + mine).store(rsum)
        cta_barrier()
        mbarrier.arrive(p_ready.index(mine), count=1)
        acc = warpgroup_mma(gl.convert_layout(p, p_layout), kv.slice(W * HALF, HALF, dim=1), acc,
                            is_async=True)
        # the other consumer's tile of the pair, rescaled to this consumer's running max
        theirs = (1 - W) * 2 + par
        t2 = 2 * j + 1 - W
        buf2 = t2 % NUM_BUF
        mbarrier.wait(p_ready.index(theirs), (j // 2) & 1)
        p_o = p_smem.index(theirs).load(s_layout).to(gl.float32)
        m_o = m_smem.index(theirs).load(row_l)
        rsum_o = m_smem.index(4 + theirs).load(row_l)
        cta_barrier()
        mbarrier.arrive(p_free.index(theirs), count=1)
        m_new, grow = _next_max(m_i, m_o, LAZY)
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        beta = gl.exp2(m_o - m_safe)
        p2 = p_o * beta[:, None]
        l_i = l_i * alpha + rsum_o * beta
        m_i = m_new
        acc = warpgroup_mma_wait(0, deps=[acc])
        if grow:
            acc = acc * gl.convert_layout(alpha, orow_l)[:, None]
        mbarrier.wait(kv_ready.index(buf2), (t2 // NUM_BUF) & 1)
        acc = warpgroup_mma(gl.convert_layout(p2.to(kv_smem.dtype), p_layout),
                            kv_smem.index(buf2).slice(W * HALF, HALF, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        mbarrier.arrive(kv_empty.index(buf), count=1)        # both tiles: both consumers
        mbarrier.arrive(kv_empty.index(buf2), count=1)       # read each (count 2)
    if W == 0:
        _stamp(cnt_ptr, prow // HEADS, 7)
    _epilogue(acc, m_i, l_i, sink_ptr, out_ptr, lse_ptr, opart_ptr, lpart_ptr, cnt_ptr, prow, orow,
              has_sink, split, W)
    _stamp(cnt_ptr, prow // HEADS, 8 + W)


@gluon.jit
def _consumer0(q_row, kv_ptr, idx_row, start, end, q_smem, kv_smem, s_smem, m_smem, bars, qk_scale,
               sink_ptr, out_ptr, lse_ptr, opart_ptr, lpart_ptr, cnt_ptr, prow, orow, has_sink, split,
               lazy):
    _consumer(q_row, kv_ptr, idx_row, start, end, q_smem, kv_smem, s_smem, m_smem, bars, qk_scale,
              sink_ptr, out_ptr, lse_ptr, opart_ptr, lpart_ptr, cnt_ptr, prow, orow, has_sink, split,
              lazy, 0)


@gluon.jit
def _consumer1(q_row, kv_ptr, idx_row, start, end, q_smem, kv_smem, s_smem, m_smem, bars, qk_scale,
               sink_ptr, out_ptr, lse_ptr, opart_ptr, lpart_ptr, cnt_ptr, prow, orow, has_sink, split,
               lazy):
    _consumer(q_row, kv_ptr, idx_row, start, end, q_smem, kv_smem, s_smem, m_smem, bars, qk_scale,
              sink_ptr, out_ptr, lse_ptr, opart_ptr, lpart_ptr, cnt_ptr, prow, orow, has_sink, split,
              lazy, 1)


@gluon.jit
def _seesaw0(q_row, kv_ptr, idx_row, start, end, q_smem, kv_smem, s_smem, m_smem, bars, qk_scale,
             sink_ptr, out_ptr, lse_ptr, opart_ptr, lpart_ptr, cnt_ptr, prow, orow, has_sink, split, lazy):
    _consumer_ss(q_row, kv_ptr, idx_row, start, end, q_smem, kv_smem, s_smem, m_smem, bars,
                 qk_scale, sink_ptr, out_ptr, lse_ptr, opart_ptr, lpart_ptr, cnt_ptr, prow, orow, has_sink,
                 split, lazy, 0)


@gluon.jit
def _seesaw1(q_row, kv_ptr, idx_row, start, end, q_smem, kv_smem, s_smem, m_smem, bars, qk_scale,
             sink_ptr, out_ptr, lse_ptr, opart_ptr, lpart_ptr, cnt_ptr, prow, orow, has_sink, split, lazy):
    _consumer_ss(q_row, kv_ptr, idx_row, start, end, q_smem, kv_smem, s_smem, m_smem, bars,
                 qk_scale, sink_ptr, out_ptr, lse_ptr, opart_ptr, lpart_ptr, cnt_ptr, prow, orow, has_sink,
                 split, lazy, 1)


@gluon.jit
def _sparse_mla_ws_kernel(q_ptr, kv_ptr, idx_ptr, sink_ptr, out_ptr, lse_ptr, opart_ptr,
                          lpart_ptr, cnt_ptr, topk, num_splits, split_rows, qk_scale, lazy,
                          BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr, S_BUFS: gl.constexpr,
                          SEESAW: gl.constexpr, HAS_SINK: gl.constexpr, SPLIT: gl.constexpr,
                          SCAN_N: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                          CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr,
                          FP8: gl.constexpr = False, PDL: gl.constexpr = False,
                          LAZY_SS: gl.constexpr = False, P_SWIZZLE: gl.constexpr = False,
                          EVICT_KV: gl.constexpr = False):
    # program -> (query position, split). (Constexprs do not cross into warp_specialize's
    # partitions: the partitions read BLOCK_N, NUM_BUF and S_BUFS off the buffers' shapes and
    # the design off the exchange buffer's dtype, and take HAS_SINK and SPLIT as uniform
    # runtime flags.)
    pid = gl.program_id(0)
    _stamp(cnt_ptr, pid, 0)
    if EVICT_KV:    # the KV gathers' cp.async under an L2 evict-first policy
        l2_hint.mark(num_warps)
    if PDL:     # the combine (a programmatic dependent launch) may be scheduled now
        gdc_launch_dependents(num_warps)
    sp = pid % num_splits
    bs = (pid // num_splits).to(gl.int64)
    start = sp * split_rows
    end = gl.minimum(start + split_rows, topk)
    idx_row = idx_ptr + bs * topk
    end = _trim_end(idx_row, start, end, SCAN_N, num_warps)
    q_row = q_ptr + bs * (HEADS * DIM)

    dtype: gl.constexpr = q_ptr.dtype.element_ty
    q_smem = gl.allocate_shared_memory(dtype, [HEADS, DIM],
                                       gl.NVMMASharedLayout.get_default_for([HEADS, DIM], dtype))
    kv_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_N, DIM],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_N, DIM], dtype))
    if SEESAW:      # P exchange: bf16 [4, 64, BLOCK_N] and the row maxima it is relative to
        if P_SWIZZLE:   # the 16-byte rows of stmatrix / ldmatrix in distinct banks
            p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEADS, BLOCK_N], dtype)
        else:           # plain 64-byte rows: an 8 x 8 matrix's 8 rows fall in 2 bank groups
            p_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        s_smem = gl.allocate_shared_memory(dtype, [4, HEADS, BLOCK_N], p_layout)
    else:           # score swap: fp32 halves
        s_smem = gl.allocate_shared_memory(gl.float32, [2 * S_BUFS, HEADS, BLOCK_N],
                                           gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    # seesaw: the row maxima [0:4] and fp32 row sums [4:8] that go with each P buffer; a
    # ninth (unused) row tells the seesaw consumers LAZY_SS, as no constexpr reaches them
    m_smem = gl.allocate_shared_memory(gl.float32, [8 + LAZY_SS, HEADS],
                                       gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    s_ready = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    s_free = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for b in gl.static_range(NUM_BUF):
        mbarrier.init(kv_ready.index(b), count=1)
        mbarrier.init(kv_empty.index(b), count=2)          # released by both consumers
    for b in gl.static_range(4):
        mbarrier.init(s_ready.index(b), count=1)
        mbarrier.init(s_free.index(b), count=1)

    prow = (bs * num_splits + sp) * HEADS
    orow = bs * HEADS
    args = (q_row, kv_ptr, idx_row, start, end, q_smem, kv_smem, s_smem, m_smem,
            (q_bar, kv_ready, kv_empty, s_ready, s_free), qk_scale, sink_ptr, out_ptr, lse_ptr,
            opart_ptr, lpart_ptr, cnt_ptr, prow, orow, HAS_SINK, SPLIT, lazy)
    # the producer is the default partition (the kernel's 4 warps); the consumers are workers
    if FP8:         # raw rows staged by cp.async, dequantised by the producer into the ring
        stage_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        nope_stage = gl.allocate_shared_memory(gl.uint8, [7 * FP8_STAGES, BLOCK_N, 64], stage_l)
        rope_stage = gl.allocate_shared_memory(dtype, [FP8_STAGES, BLOCK_N, 64], stage_l)
        fp8_args = args + (nope_stage, rope_stage)
        if SEESAW:
            gl.warp_specialize([(_producer_fp8, fp8_args), (_seesaw0, args), (_seesaw1, args)],
                               [4, 4], [CONSUMER_REGS, CONSUMER_REGS])
        else:
            gl.warp_specialize([(_producer_fp8, fp8_args), (_consumer0, args), (_consumer1, args)],
                               [4, 4], [CONSUMER_REGS, CONSUMER_REGS])
    elif SEESAW:
        gl.warp_specialize([(_producer, args), (_seesaw0, args), (_seesaw1, args)],
                           [4, 4], [CONSUMER_REGS, CONSUMER_REGS])
    else:
        gl.warp_specialize([(_producer, args), (_consumer0, args), (_consumer1, args)],
                           [4, 4], [CONSUMER_REGS, CONSUMER_REGS])


def timeline() -> torch.Tensor:
    """TIMELINE: the last launch's stamps, int64 ns [programs, len(TIMELINE_POINTS)]
    (program = query position x splits + split; 0 where a point was not reached, e.g.
    the seesaw consumers' points in the D-split design)."""
    if not TIMELINE or not _LAST_TIMELINE:
        raise RuntimeError("timeline: set DSV4LAB_WS_TIMELINE=1 before importing "
                           "dsv4lab.kernels.sparse_mla_ws, then launch the kernel")
    return _LAST_TIMELINE[0].view(-1, _TIMELINE_SLOTS)[:, :len(TIMELINE_POINTS)]


SMEM_LIMIT = 227 * 1024      # shared memory a block may use on sm_90 / sm_100


def _fp8_staging_bytes(block_n: int) -> int:
    """Two staging slots of raw FP8 rows: 7 x 64 e4m3 bytes and 64 bf16 RoPE values a row."""
    return _FP8_SLOTS * block_n * (7 * 64 + 64 * 2)


def s_bufs(block_n: int, num_buf: int, staged: bool = False) -> int:
    """Score-swap buffers a consumer: two (parity) when they fit beside Q (64 KB), the ring
    (and the FP8 staging), else one (64-row tiles, two ring buffers: 224 KB of the 227 KB)."""
    ring = num_buf * block_n * DIM * 2 + (_fp8_staging_bytes(block_n) if staged else 0)
    return 2 if HEADS * DIM * 2 + ring + 4 * HEADS * block_n * 4 <= 200 * 1024 else 1


STORE_SCRATCH = 3856         # the output store's layout conversion (sm_90 compile, Triton 3.6)


def smem_bytes(block_n: int, num_buf: int, seesaw: bool, staged: bool, lazy: bool = False) -> int:
    """Shared memory of a launch: Q, the ring, the exchange (seesaw: bf16 P [4, 64, block_n];
    D split: fp32 score halves), the row maxima and sums (and the seesaw's LAZY_SS row), the
    FP8 staging (``staged``), the output store's conversion scratch (:func:`_store_rows`)."""
    exchange = 4 * HEADS * block_n * 2 if seesaw else 2 * s_bufs(block_n, num_buf, staged) * HEADS * block_n * 4
    return (HEADS * DIM * 2 + num_buf * block_n * DIM * 2 + exchange
            + (8 + int(lazy and seesaw)) * HEADS * 4
            + (_fp8_staging_bytes(block_n) if staged else 0) + STORE_SCRATCH)


def supported(q, kv, fp8: bool, d_v: int, block_n: int = 32, num_buf: int = 3,
              seesaw: bool = True, lazy: bool = False) -> bool:
    """Whether this kernel takes the call: a Hopper-or-newer datacenter GPU (227 KB of
    shared memory; sm_120 has 99 KB), 64 heads, D = d_v = 512, and either a 16-bit cache
    in q's dtype or (``fp8``) the 584-byte FP8 cache with bf16 q (its RoPE part is bf16,
    copied as is into the bf16 tile) in 32-row tiles, the staging beside at most three
    ring buffers (a fourth would need 246 KB of the 227)."""
    if q.device.type != "cuda" or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    if gluon_unsupported() is not None:       # Gluon moved (kernels/device.py GLUON_TRITON)
        return False
    if torch.cuda.get_device_capability(q.device)[0] not in (9, 10):
        return False
    B, S_q, H, D = q.shape
    if not (H == HEADS and D == DIM and d_v == DIM and q.is_contiguous() and q.data_ptr() % 16 == 0
            and kv.dim() == 2 and kv.is_contiguous() and kv.data_ptr() % 16 == 0):
        return False
    if smem_bytes(block_n, num_buf, seesaw, fp8, lazy) > SMEM_LIMIT:
        return False
    if fp8:
        return (q.dtype == torch.bfloat16 and kv.dtype == torch.uint8 and kv.shape[-1] == FP8_ROW_BYTES
                and block_n == 32)
    return kv.dtype == q.dtype and kv.shape[-1] == DIM        # 16-byte cp.async


_PAIR_COUNTERS: dict = {}     # (device, stream) -> int32 counters of the self-merging pairs


def _pair_counters(dev, n: int) -> torch.Tensor:
    """At least ``n`` zeroed int32 counters for this device and stream, kept across calls:
    each call adds exactly 2 to every counter it uses, so a counter is even between calls
    and never needs resetting (one buffer per stream: calls on one stream never overlap)."""
    key = (dev, torch.cuda.current_stream(dev).cuda_stream)
    cnt = _PAIR_COUNTERS.get(key)
    if cnt is None or cnt.numel() < n:
        cnt = _PAIR_COUNTERS[key] = torch.zeros(max(n, 1024), dtype=torch.int32, device=dev)
    return cnt


def sparse_mla_ws(q, kv, indices, sink, scale, splits, split_rows, *, block_n=32, num_buf=3,
                  lazy=False, seesaw=False, scan_n=512, merge_pair=False, part16=False,
                  pdl=False, p_swizzle=False, evict_kv=False):
    """Launch the warp-specialised kernel (and the MMA kernel's combine when split).

    q [B, S_q, 64, 512] bf16/fp16, kv [N, 512] same dtype or (bf16 q) the FP8 cache uint8
    [N, 584], indices int32 [B, S_q, topk], sink fp32 [64] or None; ``splits`` / ``split_rows`` as planned by
    kernels/sparse_mla_mma.py -> (out [B, S_q, 64, 512], lse fp32 [B, S_q, 64]).
    ``block_n`` rows a tile, ``num_buf`` ring buffers, ``seesaw`` the consumers' design (see
    the module docstring; seesaw needs ``num_buf`` >= 3 to prefetch while a pair is in
    use), ``lazy`` the consumers' lazy rescale (D split: decided alike by both from the
    same scores; seesaw: LAZY_SS, each consumer for its own state); ``merge_pair``:
    with exactly two split-KV ranges the two programs of a query merge their partials
    themselves (see :func:`_epilogue`) instead of a combine kernel; ``part16``: the split
    partials in q's dtype instead of fp32; ``pdl``: the combine as a programmatic dependent
    launch (sm_90+; see kernels/sparse_mla_mma.py Config); ``p_swizzle``: the seesaw's P
    exchange buffers swizzled (P_SWIZZLE); ``evict_kv``: the KV gathers under an L2
    evict-first policy (EVICT_KV, kernels/l2_hint.py) where
    :func:`dsv4lab.kernels.sparse_mla_mma.evict_kv_applies` (S_q = 1)."""
    from dsv4lab.kernels.device import pdl_ok
    from dsv4lab.kernels.sparse_mla_mma import LOG2E, combine_splits, evict_kv_applies
    fp8 = kv.dtype == torch.uint8
    need = smem_bytes(block_n, num_buf, seesaw, fp8, lazy)
    if (fp8 and block_n != 32) or need > SMEM_LIMIT:
        # Q 64 KB + the ring + the exchange (+ FP8: two staging slots of raw rows, 36 KB)
        rule = "the FP8 cache takes 32-row tiles in at most 3 ring buffers; " if fp8 else ""
        raise ValueError(f"block_n / num_buf: {rule}{num_buf} ring buffers of {block_n} rows need "
                         f"{need} bytes of shared memory, at most {SMEM_LIMIT} fit; got "
                         f"block_n={block_n}, num_buf={num_buf}")
    B, S_q, H, D = q.shape
    topk = indices.shape[-1]
    dev = q.device
    out = torch.empty(B, S_q, H, D, dtype=q.dtype, device=dev)
    lse = torch.empty(B, S_q, H, dtype=torch.float32, device=dev)
    split = 0 if splits == 1 else 2 if (splits == 2 and merge_pair) else 1
    pdl = bool(pdl) and split == 1 and pdl_ok(dev)
    # the counters only when the pair merges itself; otherwise any int32 pointer stands in
    # (never read), so the default path neither looks up nor allocates them
    cnt = _pair_counters(dev, 4 * B * S_q) if split == 2 else indices
    if TIMELINE:       # the stamps travel in cnt_ptr (the pair's counters are not used then)
        if split == 2:
            raise ValueError("merge_pair: the timeline needs cnt_ptr, which the pair's merge uses")
        cnt = torch.zeros(B * S_q * splits * _TIMELINE_SLOTS, dtype=torch.int64, device=dev)
        _LAST_TIMELINE[:] = [cnt]
    if split:
        opart = torch.empty(B * S_q * splits * H * D, dtype=q.dtype if part16 else torch.float32,
                            device=dev)
        # split 2: an lse copy per consumer (each merges its own half)
        lpart = torch.empty(B * S_q * splits * H * split, dtype=torch.float32, device=dev)
    else:
        opart = lpart = lse       # unused
    _sparse_mla_ws_kernel[(B * S_q * splits,)](
        q, kv, indices, sink if sink is not None else lse, out, lse, opart, lpart, cnt,
        topk, splits, split_rows, scale * LOG2E, int(lazy),
        BLOCK_N=block_n, NUM_BUF=num_buf, S_BUFS=s_bufs(block_n, num_buf, fp8), SEESAW=seesaw,
        HAS_SINK=sink is not None, SPLIT=split,
        SCAN_N=scan_n, PRODUCER_REGS=40, CONSUMER_REGS=232, FP8=fp8, num_warps=4, maxnreg=168,
        PDL=pdl, LAZY_SS=bool(lazy) and seesaw, P_SWIZZLE=bool(p_swizzle) and seesaw,
        EVICT_KV=evict_kv_applies(evict_kv, S_q))
    if split == 1:
        combine_splits(opart, lpart, sink, out, lse, splits, pdl=pdl)
    return out, lse
