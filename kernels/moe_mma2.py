"""Decode-sized FP4 MoE GEMMs whose weight bytes load straight into the tensor-core operand
(Gluon, ``mma.sync``: sm_80, sm_90 and sm_120 alike; not under the interpreter).

The idea. At decode the MoE streams FP4 weights, and on a GPU the cost of a weight byte
is the instructions that turn it into tensor-core input. The Triton kernel of
:mod:`dsv4lab.kernels.moe` spends ~9 SASS instructions a byte on sm_90, ~2 of them
register moves that rebuild x's fragments for every HMMA: Triton picks the operand
layouts, and the byte-sourced operand forces a layout (kWidth 4) the fp16 x operand has to
be shuffled into. Here the layouts are chosen by hand, so that nothing moves:

- the weights are the B operand of ``mma.sync.m16n8k16`` (N: weight rows; M: the block's
  tokens, padded to 16), in the kWidth-2 layout, where lane ``(g, t)`` (g = lane // 4,
  t = lane % 4) holds, for its row g, the operand columns ``k' = 16 s + 8 c + 2 t + a``
  (s < 4, c < 2, a < 2) of a 64-column step;
- a weight row's 64-byte segment (128 FP4 elements) is read so that lane t holds bytes
  ``16 t .. 16 t + 15``: one 16-byte load, and, for MXFP4, exactly one 32-element scale
  block; byte ``16 t + 4 s + 2 c + a`` is taken as operand column ``k'`` above. That is a
  permutation of the K axis (sigma), which costs nothing if x is permuted alike: the
  operand built from the low nibbles pairs with x's even elements, the one from the high
  nibbles with the odd ones, each in sigma's order. The launcher's copy of x (and the
  gate/up epilogue's activations) is written in that order: per 128-element segment, the
  64 even elements then the 64 odd ones (``seg_order``); the A operand's lanes then read
  16 consecutive fp16 a row, again without moves;
- the byte -> operand correspondence is a reshape and a permute of the loaded tile, which
  Gluon checks is free (``convert_layout(..., assert_trivial=True)`` fails at compile time
  otherwise);
- weights, scales and x stream through a ring of ``STAGES`` shared-memory buffers by
  ``cp.async`` (Ampere's, portable); every lane reads back exactly the bytes it copied, so
  the ring needs no barrier; x's buffers are XOR-swizzled so that the eight rows of a
  read land in different banks.

The decode and the scales are those of :mod:`dsv4lab.kernels.moe` (FASTDEC's packed PTX;
MXFP4's scale split with the row's largest scale byte over the K slice, as ROWMAX; NVFP4's
E4M3 scales exact in fp16), so the numbers are the same but for the summation order.

Measured (H200, `dsv4lab bench moe` rows at 41566e0 and 7cb4e2c): the default at T = 64
(160 experts hit), MXFP4 915.8 / 915.0 us = 0.551 of the FP4-bytes roofline against 1017.0 /
1028.8 us for the Triton kernels' former default in the same runs; NVFP4 944.4 / 953.4 us.
Offline sm_90 SASS of the gate/up loop at 128 rows a program: ~6.3 instructions a weight
byte (decode 4.5, 32 HMMA a 128-byte step), against ~9 for the Triton kernel. On sm_89 and
newer the decode is CVT8_ASM (the e5m2 conversion places the bits: 15 instructions per 4
bytes against FASTDEC's 19, the same fp16 values): offline sm_90 SASS of the T = 1 fused
launch, gate/up loop 852 -> 724 instructions, down loop 481 -> 416; `dsv4lab bench moe` rows
at 8fdc283 (two runs): T = 64 MXFP4 828.5 / 823.2 us = 0.61 of the roofline against 915.0 /
917.3 with FASTDEC (``mma2_fastdec_t64``), NVFP4 886.0 / 885.1; T = 1 57.0 / 56.4 against
59.4 / 59.2. The grouped
launches at T = 1 (6 experts) were slower than the Triton kernels (70.6 against 67.6 us).

The one-launch decode (``FUSED``, :func:`_decode_kernel`, up to BM tokens; the table's T = 1
row). Grouping, the SwiGLU sum, the combine and four of the six launches go: every (token,
slot) pair is its own block (at decode the pairs rarely share an expert), the token in column
t of the mma tile; tiles are handed out by a ticket counter, all gate/up tiles before any down
tile, so a tile that waits (a down tile, for its pair's activations) only ever waits for tiles
already running; split-K slices (fp32 partials) and the pairs' down rows are summed in a fixed
order by whichever tile of the group finishes last (an acq_rel counter), so two calls give the
same bits; a down tile asks the L2 for its weight bytes before it waits. H200, `dsv4lab bench
moe` rows at 194a2e6 (two runs, FASTDEC's decode): T = 1 59.0 / 59.0 us (MXFP4, 0.32 of the
roofline), 58.9 / 59.0 (NVFP4), against 68.2 / 68.3 for the Triton kernels' six launches; with
CVT8 (rows at 8fdc283) 57.0 / 56.4 us, 0.33. Where its time goes
(scripts/profile_moe.py --timeline at 47e7f50, and a one-off Nsight Compute reading): 3072
tiles, five an SM (38 KB of shared memory each), gate/up done 34.6 us after the launch
starts, the last down tile 48.9 us; each scheduler issues every other cycle with 2.4 warps on
it. Smaller rings (more tiles an SM), other split and tile sizes all land at 59-65 us
(scripts/tune_moe.py round 11).

The block scales on the accumulator (``ACC_SCALE``, the fused launch on sm_89+; a variant).
A pair's tile holds one token, so 7 of the mma's 8 token columns were zeros: here x's row n
holds only the K-step's elements of scale block n (MXFP4: a lane's 16 bytes, one block;
NVFP4: half of them), so column n of the product is block n's partial dot; the weights are
decoded without their scales (CVT8_RAW_ASM, 11 instructions per 4 bytes), each K-step's
product goes into a fresh accumulator that one FFMA a column multiplies by its block's fp32
scale into the running one, and the columns are summed once at the end. The MXFP4 row
maximum (and its prologue of scale loads) goes, and every E8M0 scale is exact but 2**-127
(byte 0, flushed to 0). Offline sm_90 SASS of the T = 1 launch: gate/up loop 724 -> 631
instructions, down 416 -> 357 (the 128 HMUL2 gone, 16 FFMA and the scale loads added).
Measured (H200, `dsv4lab bench moe` rows at b7e6296, where it was the T = 1 default): MXFP4
57.4 us against 57.0 with the scales on the weights, NVFP4 60.5 against 58.3. So the loop's
issue rate does not bound T = 1 either, and the default keeps the scales on the weights.
Nor does occupancy: x's ring one row deep (a pair's single token broadcast to every column of
the B operand from [1, 64] buffers; 38.7 -> 27.9 KB of shared memory a tile, 7 tiles an SM
instead of 5, loop 724 -> 697 instructions) measured 58.4 us against the default's 56.7
(MXFP4; NVFP4 57.6 / 57.7), and with a 4-stage ring of one K-step a stage (18.7 KB, 11 tiles
an SM) 66.4 (bench variants mma2_x1_t1, mma2_x1_s4_n1_t1, rows at cd112ea; the code is gone).
A one-off Nsight Compute reading of the default (clocks locked to base, not a recorded row):
DRAM 29% and L2 50% of peak, one instruction issued every 2.1 cycles a scheduler: no unit near
its limit, so each tile's chain of dependent latencies (ticket, routing, the ring's first
stage, the split-K and pair counters) is what remains to overlap. A persistent launch (5
programs an SM taking tickets until none is left, a gate/up tile asking for its next ticket
before it starts) did not overlap enough of it: 58.5 us against the default's 56.8 (MXFP4;
NVFP4 61.4 / 57.9; bench variant mma2_persist_t1, rows at 60b3647; the code is gone). What
it does not overlap is the next tile's routing loads and first ring stage, which a program
would have to issue while the current tile's loop runs.

The prelude. x's copy (``moe._moe_xpre_zero_kernel``) also zeroes the launch's counters, and
on sm_90+ the decode is its programmatic dependent launch (``PDL``: its programs are scheduled
while the copy runs and wait for it before their ticket): 56.7 -> 54.7 us at T = 1 (55.4 with the
copy zeroing the counters but no PDL; bench variant mma2_nopdl_t1, rows at a793cc5).

The K loops in registers (``REGS``, :func:`_k_loop_regs`; sm_89+, the T = 1 default there).
Each lane loads the 16 bytes of a row it decodes as four 32-bit words, REGS K-steps ahead, into
a ring of registers that the unrolled loop refills in place, decodes a word at a time
(CVT8_WORD_ASM: a loop-carried byte tensor would sit a byte a register and cost a PRMT each)
and reads its x fragments from the L1. No shared memory, no cp.async ring, no barrier: the
programs an SM holds are bounded by registers (REGS 4: 142 a thread in an offline sm_90 compile;
8 tiles an SM on the H200's timeline, against 5 with the shared-memory ring), and a gate/up tile
runs its gate and up rows as one matrix of 2 BN1 rows. Offline sm_90 SASS: 0.163 instructions a
weight byte against 0.177, with no LDS and no BAR in the loop. Measured (H200, `dsv4lab bench moe` rows at e934bef;
scripts/tune_moe.py rounds 12-12d for the layout): T = 1 MXFP4 47.6 us (0.40 of the roofline)
with the gate/up K split in two and the down K unsplit, against 55.0 for the shared-memory ring
in the same run (variant mma2_smem_t1); NVFP4 48.7 without the down tiles' L2 prefetch. Its
timeline: all 768 gate/up tiles run at once and are done by 30.0 us, the last down tile ends at
44.8 us; a one-off Nsight Compute reading has DRAM at ~2.0 TB/s and loads (long scoreboard) as
the main stall. Measured no faster (printouts; code removed): the ring refilled two K-steps at a
time, so that a row's 128 bytes reach the memory system together (48.1 against 47.0 us), x's
fragments loaded a K-step ahead (47.0-47.3 against 47.1); and slower: a register cap of 128
(MAXNREG, 53.2), REGS 2 at the same splits (54.3).

The L2 policy of the weight loads (``EVICT``, the T = 1 default with REGS, session 12). The
benchmark times a call after ``do_bench``'s zero-fill flush, which leaves the L2 full of dirty
lines (as a decode step finds it after the rest of the step's writes); every weight line a
``.cg`` load brings in then evicts one of them, and that line is first written back to HBM.
Loaded with an L2 evict-first policy, the weights, read once, take the place of each other
instead. Measured (H200, `dsv4lab bench moe` rows at 6956022): T = 1 MXFP4 44.6 us (0.424 of
the roofline), NVFP4 46.5, against 48.0 / 52.4 for the entry before (variant
mma2_noevict_t1) in the same run; a read-only probe of the same layout had shown it first
(printout, ``python3 scripts/probe_weight_reads.py``). The shared-memory ring cannot take it:
Gluon's cp.async carries no L2 policy. ``EARLY`` (REGS, default on): a down tile issues its
ring's first K-steps before it waits for its activations (45.1 / 47.8 us without, same run);
issuing a gate/up tile's before its MXFP4 row maxima instead made MXFP4 slower (rows at
50c1cf7: 45.9 against 45.3): the row maxima's scale loads then queue behind them. Measured
slower (tune_moe round 13, printouts): 16 rows a warp (BN1 8, one warp a tile, 3072 gate/up
tiles; 83 registers): 56.3-69.8 us against 47.1. Where it stands: a read-only kernel of 75 MB
reaches 0.63 of the roofline by the same method (`dsv4lab bench l2`, rows at bea1bb9), so 0.5
at T = 1 (80 MB in two dependent phases) asks for 80% of a plain read's speed.
Measured slower (session 13, code removed): the rings 8 K-steps deep (the down tiles' only:
45.6 against 43.9 us; every ring: 255 registers, 58.8; tune_moe round 14, printouts); and
``LINES``, a K order in which a warp's load asks for its rows' whole 128-byte lines (lane t
16 bytes at byte 32 t, the other half of each sector a step later), which a read-only probe
had read faster (scripts/probe_weight_reads.py: 31.1 against 33.5 us): `dsv4lab bench moe`
rows at 088d083, MXFP4 45.0 against 44.5 us, NVFP4 52.4 against 46.8. Nor did spreading the
gate/up tiles evenly over the SMs (a program beyond its SM's quota waiting until every gate/up
ticket was handed out; the timeline had SMs running 1 to 8 of them, the crowded ones' loops
17.9 us against 11.8): rows at b307d7d, MXFP4 46.1 against 44.7 us (its compile held 6
programs an SM, not 8).
Nor did ``PAIRED`` (session 15, code removed): each of 768 programs ran a gate/up tile and then
a down tile of its pair, so every SM held the same mix of work, with the down weights asked of
the L2 before the gate/up tile or not (scripts/tune_moe.py round 17, printout at 87ccf91; MXFP4
/ NVFP4): 44.2 / 48.3 us without the prefetch, 48.3 / 49.4 with it and 49.3 / 50.1 with an
evict-last prefetch, against the entry's 44.0 / 46.9. The prefetched lines take the L2's place
as ordinary lines and so push its dirty ones out (each a write to HBM), which the evict-first
loads avoid.
Nor did ``RESIDENT`` (session 16, code removed): each of 768 programs copied its down tile's
whole K slice (32 rows x 1 KB and the scales, 35 KB) into shared memory by cp.async under the
L2 evict-first policy (kernels/l2_hint.py; the copies unrolled, the only form ptxas 12.8 built
with valid descriptors), then ran its gate/up tile and that down tile from shared memory, so
that the down bytes streamed while the gate/up tiles ran (6 programs an SM, all 768 resident).
scripts/tune_moe.py round 18, printouts at aa8eb76 and 3f9e073, MXFP4 / NVFP4: the entry
43.8-44.0 / 46.7-47.0 us; RESIDENT 57.4 / 64.3 staged first, 57.7 / 68.0 staged after the
gate/up ring's first loads with x 4 K-steps ahead, 59.1 / 63.9 at 168 registers. Its timeline
(profile_moe --timeline, no flush): the gate/up tiles end at 37 us against 27 (their loads
queue behind the staging: the 75 MB still arrive at ~2 TB/s, more bytes in flight do not raise
it), and the down loop from shared memory takes 7.7 us a tile, as from the ring (7.9): it is
bound by its ~210 instructions a K-step and warp (12 warps an SM), not by its loads, so the
down phase cannot shrink below ~6 us once it runs after the gate/up phase. Nor did ``ACC2``
(session 16, code removed): the register ring's odd K-steps summed into a second accumulator,
so that two mma chains interleave (tune_moe round 19, two printouts at a5f5404, MXFP4 / NVFP4):
the entry 43.7-43.8 / 46.6-46.7 us; both loops 44.6-44.7 / 53.5, the down loops only 44.4 /
46.7-46.9, the gate/up loops only 44.9-45.1 / 53.8-53.9. The mma chain's latency is not what
paces the loops. Nor did down tiles that wait only for the activations of their own K slice
(session 16, code removed: one count a pair's down slice, so that with the down K split the
first slices' down tiles run while the last gate/up tiles do; tune_moe round 20, printout at
95a1527, MXFP4 / NVFP4): the entry 43.8 / 46.8 us; SPLIT2 2 51.1 / 55.7 (BN2 32), 44.3 / 54.4
(BN2 64); SPLIT2 4 54.0 / 63.6 (BN2 32), 53.6 / 57.0 (BN2 64). The dirty L2 is not what is
left: the default takes 43.2 us after a clean L2 against 44.4 after the dirty flush (MXFP4; two
runs each, ``DSV4LAB_L2=clean|dirty python3 scripts/tune_moe.py --tokens 1 --only 123,149``,
printouts at 32a2fde; without EVICT 42.8-43.1 / 47.6-47.7).

Weights packed for the register ring (``TILED``, session 16; :func:`pack_tile_major`, done once
when the weights are loaded, a copy in a second layout): per expert, per 16-row group, per
K-step, the 16 rows' 64 bytes one after the other, so that a warp's load of a K-step reads 512
contiguous bytes instead of 64 bytes from each of 8 rows; ``TILED=True`` packs the scales alike,
``"weights"`` leaves them canonical (MXFP4's row maxima then still read them contiguously).
Only the addresses change: the same bits (GPU test). A read-only probe of the layout had read
both phases' rows in 28.5 us against 33.2 (scripts/probe_weight_reads.py, printout at 8703cfc);
in the MoE (`dsv4lab bench moe` rows at d5a2e02): MXFP4 44.1 us (0.429) against 44.8 for the
default in the same run, NVFP4 43.0 (0.465) against 46.9; weights only (tune_moe round 21,
printout at d5a2e02) 43.6 / 45.0 against 44.1 / 46.5. (That run's rows of mma2_tiled_w_t1 and
mma2_late_ring_t1 read wrongly packed weights, fixed at 353d6dc: timings of the right
addresses, not of the right call.) So the
read pattern is worth ~1 us to MXFP4 and ~4 us to NVFP4 (its 8 scale bytes a row a step come
contiguous too), not the probe's 5 us: the rest of T = 1's time is not its reads' pattern. The
op layer (``ops.fused_moe``) takes the canonical layout, so the table's entry does not use it.

Where the timed figure goes (session 17; ``python3 scripts/profile_moe.py --graph``: the call's
kernels inside the graph replay the benchmark times, printouts at a working tree of 076ecea,
medians of 20 replays after the L2 flush). Of the 44.8-45.5 us a replay takes, 3.3-3.9 us pass
before x's copy starts (for a graph of one small torch kernel: 2.9-3.3 us, a floor every
graph-timed row carries), the copy takes 1.6 us, 0.7 of them under the decode (PDL), and the decode 40.5 us:
80 MB at 2.0 TB/s. So 0.5 of the roofline (37.8 us) asks ~33.5 us of the decode, 2.4 TB/s. Nor
is the wait between the phases what holds it: a diagnostic build whose down tiles skip it (wrong
results, timings only; tune_moe round 22, two printouts at the same tree) took 43.2 against 44.0
us (MXFP4; NVFP4 45.5 against 46.7; TILED 42.6 / 41.5 against 43.6 / 42.3): ~1 us. Down tiles
that start at once then share the bandwidth with the gate/up tiles instead of waiting; the bytes
arrive no faster.
What the loops' work costs (tune_moe round 23, diagnostic builds, printouts at a working tree of
9422d9d): with the register ring kept but its words xor-folded instead of decoded and multiplied,
the call took 38.2 us (MXFP4; NVFP4 42.8) and with TILED 35.5 (35.2), against 44.0 / 43.6: the
work costs 6-8 us, and with the canonical layout the launch's loads alone are above 0.5's 37.8 us.
That cost is not in proportion to the instructions: without the decode's scale multiplies (a
third fewer loop instructions) MXFP4 took 43.9-44.1, and without x's loads 47.5.
Nor did ``PRE`` (session 18, code removed; tune_moe round 24, printouts at a79ad12): the
counters left zero by each launch instead of zeroed by x's copy, so that only the gate/up tiles
waited for the copy, just before their K loops (tickets, routing, row maxima and the first ring
loads under the copy): MXFP4 46.1-46.5 us against 46.0-46.2 for that build without PRE and
44.7-45.6 for this kernel in the same runs, NVFP4 49.1-50.3 against 48.3-49.3 and 47.7-49.8;
with TILED 44.5-44.9 against 45.1-45.5. Its timeline (``--timeline``, same tree, then
without the L2 flush; that build held 6 programs an SM): the gate/up loops start at 3.3 us and end at 19.5
(medians; the last at 22.8), their 52 MB at ~3.2 TB/s; the down loops start at 24.3-27.9 us,
end by 35.3, and the launch ends at 37.9. The device's compile of the entry holds 148 registers
(MXFP4, 7 programs an SM; NVFP4 166, 6); capped at 128 it spills and takes 51.5 us (NVFP4 58.1).
Nor did handing the gate/up tiles out by SM (``BALANCE``, session 18, code removed; tune_moe
round 26): in the timeline after the L2 flush, the stamped build of the entry (8 programs an SM)
had its gate/up loops straggling to 29.2 us on the SMs that drew 8 of them, and a balanced
build ended its launch at 39.2 us against 45.1; timed, 44.9-45.2 us against 44.2-44.8 (MXFP4;
NVFP4 46.3-46.8 against 46.2-47.4): the timed build (7 an SM) does not straggle so.
Nor did the phases streaming together (session 19; tune_moe round 27, a diagnostic build:
gate/up and down tickets alternating, the down tiles not waiting): 48.5 us against 42.9 for the
down tiles not waiting alone (MXFP4; NVFP4 48.9 / 45.3); and loads alone 38.0 against 38.3: the
boundary between the phases is not what costs the time. Nor a warp-specialised launch (session
19; tune_moe round 28, code at 77e522d, reverted by f39571d): a producer warp group per SM
streaming every weight byte into a shared-memory ring while two consumer groups (8 warps) do
this kernel's math on it, the same bits: 70.6 us at best against 44.5 (NVFP4 76.3 / 47.8). With
8 math warps an SM instead of 14 the decode runs at ~1.3 TB/s: the math needs the warps the
loads here share.
Nor TMA (session 20; tune_moe round 29; its code was on a local branch that was not kept): every
weight and scale byte brought by the tensor memory accelerator (sm_90+) into shared-memory
stages of 4 K-steps, all warps doing this kernel's math on them, the loads never waiting for it
and holding no registers (64-77 a thread), under the L2 evict-first policy; the same bits. MXFP4
/ NVFP4, two stages a program (6 an SM) 46.6 / 50.1 us, with 4 warps and 64-row tiles 45.5 /
49.8, a whole tile in flight (3 an SM) 63.7 / 60.0, against the entry's 44.0-44.7 / 46.3-47.4 in
the same run; each down tile's whole K slice requested before its wait 48.5 / 52.2. More bytes
in flight, without a register cost, do not raise the rate. Its loads alone (stages awaited,
nothing read; a diagnostic) take 34.0-36.4 us, as fast as the register ring's loads of the
packed layout (35.2; the canonical layout's 38.0-39.5): with TMA the math is what is left, and
smaller tiles with more warps an SM (up to 24) are slower still (54.7-62.3), and so are the
entry's 14 warps an SM on stages of 2 K-steps (51.2-51.6).
Nor the MXFP4 row maxima read first (session 20; tune_moe round 30, code at 0fa573e, reverted by
91febd0): each row's scale reference raised step by step in the ring instead (the
accumulator multiplied by exact powers of two; the same bits) took 46.4-46.6 us against the
entry's 44.4-44.8, and with TILED 43.6-43.8 against 43.7-43.9.
Nor would a cheaper decode (session 21; tune_moe round 31, diagnostic builds of
scripts/moe_t1_diagnostics.patch, wrong results on purpose). The loop's math without its weight
loads (MATH_ONLY) takes 39.4-39.9 us, as long as the loads without the math (38.3-38.6; the
entry 44.0-44.5); Nsight Compute (scripts/ncu_moe_t1.py) counts 14.9 M warp instructions for the
entry, about two thirds of them the decode's (LOP3, F2FP, HMUL2, IMAD), one issued every 6
cycles a warp. A decode cut from ~15 instructions a word to ~3 (FAKEDEC: 41% fewer
instructions), held to the entry's 7 programs an SM, took 41.4-41.5 us (packed layout, 128
registers: 39.8); without the scale multiplies (RAWDEC) 43.9-44.3. A decode 2.5x cheaper is
worth ~3 us, and the canonical layout's loads through the ring alone are over 0.5's 37.8 us: the
design costed for it (the weights bit-placed as e4m3 into an FP8 ``mma.sync`` with x split
exactly into two e4m3 halves, ~10 instructions a word against ~25 where the mma takes FP8
natively) cannot reach 0.5 with these loads. The cheap decode's math alone (MATH_ONLY with
FAKEDEC) takes 29.1-30.3 us, and the register ring's loads and math have overlapped to within
3-5 us of the slower half (44.2 against 39.5; 41.4 against 38.4), so TMA's loads (34.0 alone)
under a decode that cheap might land near 37-39 us. The FP8 decode is not that decode on sm_90:
Gluon's ``mma_v2`` on float8e4nv operands emits ``mma.sync.m16n8k32...e4m3.e4m3.f32``, which
sm_89 and sm_120 run as one QMMA, but which ptxas emulates on sm_90 with every operand byte
converted to fp16 (12 F2FP.F16.E4M3 and two HMMA.16816 an mma; scripts/probe_fp8_mma.py,
offline, Triton 3.9): the conversions it was to save come back, and what remains saved is the
scale multiplies, RAWDEC's no-gain. On the H200 no decode known here is that cheap.
Superseded at T = 1 (session 22): where the sizes allow (multiples of 2048), the table's T = 1
entry is :mod:`dsv4lab.kernels.moe_simt`'s launch (``SIMT``), GEMVs on the CUDA cores with x in
registers: 37.2-37.6 us (0.504-0.509) against this launch's 44.7-44.9 in the same `dsv4lab
bench moe` runs (variant ``mma2_regs_t1``). The same bit placement, paired by ``prmt`` and
multiplied by fp16x2 fma, reads at the speed of a plain read of the rows; what this kernel paid
was the mma tile at one token (seven of eight columns zeros, x's fragments from the L1 every
K-step, the MXFP4 row maxima, the 64-byte reads a row a step), not the decode alone.

Explained in notebooks/04_mxfp4_moe_port.ipynb.
"""
import os

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from dsv4lab.kernels.device import gluon_unsupported, interpreting, pdl_ok
from dsv4lab.kernels.gluon_compat import async_load, cta_barrier, gdc_wait

SEG_BYTES = gl.constexpr(64)   # packed bytes of one weight row a K-step (128 FP4 elements)
BM = gl.constexpr(8)           # tokens a block (mma's N)
# The fused decode's timeline (scripts/profile_moe.py --timeline): with DSV4LAB_MOE_TIMELINE=1
# in the environment when this module is imported, each tile of :func:`_decode_kernel` reads
# %globaltimer at the points of TIMELINE_POINTS (and its SM) into a buffer (:func:`timeline`);
# otherwise the reads compile away.
TIMELINE = gl.constexpr(os.environ.get("DSV4LAB_MOE_TIMELINE", "0") == "1")
TIMELINE_POINTS = ("program start", "ticket", "loop start", "loop end", "end", "sm")
_LAST_TIMELINE: list = []


@gluon.jit
def _decode(p, mexp, ASM: gl.constexpr):
    """Packed bytes and their fp16 multipliers (same shape) -> (low, high) nibbles as fp16
    ``value * 2**-14 * mult``: FASTDEC's asm, 4 bytes a call."""
    return gl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,r,r,r", [p, mexp],
                                     dtype=(gl.float16, gl.float16), is_pure=True, pack=4)


# CVT8's bit placement ($4: 4 packed bytes): the bytes of the low nibbles as e5m2 in l, of the
# high nibbles in h, each split into 16-bit halves (l0 l1, h0 h1) for the conversions.
_CVT8_PLACE = """
.reg .b32 u, v, l, h;
.reg .b16 l0, l1, h0, h1;
shl.b32 u, $4, 4;
shl.b32 v, $4, 1;
and.b32 v, v, 0x0E0E0E0E;
lop3.b32 l, u, v, 0x80808080, 0xEC;
shr.b32 u, $4, 3;
and.b32 u, u, 0x0E0E0E0E;
lop3.b32 h, $4, u, 0x80808080, 0xEC;
mov.b32 {l0, l1}, l;
mov.b32 {h0, h1}, h;
"""


# CVT8 (sm_89 and newer): FASTDEC's decode with the hardware's fp8 -> fp16 conversion doing
# the bit placement. An E2M1 nibble s e1 e0 m written as the e5m2 byte s 000 e1 e0 m 0 reads
# ``value * 2**-14`` exactly (e1 e0 the low exponent bits, bias 15; e = 0 lands on e5m2's
# subnormals as E2M1's does), the same fp16 FASTDEC builds, so the two decodes agree bit for
# bit. Per 4 packed bytes: the low nibbles' bytes (shl, shl, and, lop3), the high nibbles'
# (shr, and, lop3), four ``cvt.rn.f16x2.e5m2x2`` and the four block-scale multiplies: 15
# instructions against FASTDEC's 19. Outputs as FASTDEC's ($0, $1: low nibbles of bytes 0-1,
# 2-3; $2, $3: high nibbles; $5, $6 the multipliers of bytes 0-1 and 2-3).
CVT8_ASM = "\n{" + _CVT8_PLACE + """cvt.rn.f16x2.e5m2x2 u, l0;
mul.rn.f16x2 $0, u, $5;
cvt.rn.f16x2.e5m2x2 u, l1;
mul.rn.f16x2 $1, u, $6;
cvt.rn.f16x2.e5m2x2 u, h0;
mul.rn.f16x2 $2, u, $5;
cvt.rn.f16x2.e5m2x2 u, h1;
mul.rn.f16x2 $3, u, $6;
}
"""


# ACC_SCALE's decode (sm_89 and newer): CVT8_ASM without the four multiplies (11 instructions
# per 4 bytes): the nibbles as fp16 ``value * 2**-14``; the block scales go on the
# accumulator instead (see :func:`_step_acc_scale`).
CVT8_RAW_ASM = "\n{" + _CVT8_PLACE + """cvt.rn.f16x2.e5m2x2 $0, l0;
cvt.rn.f16x2.e5m2x2 $1, l1;
cvt.rn.f16x2.e5m2x2 $2, h0;
cvt.rn.f16x2.e5m2x2 $3, h1;
}
"""


@gluon.jit
def _decode_raw(p, ASM: gl.constexpr):
    """Packed bytes -> (low, high) nibbles as fp16 ``value * 2**-14``: CVT8_RAW_ASM."""
    return gl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,r", [p], dtype=(gl.float16, gl.float16),
                                     is_pure=True, pack=4)


def _decode_asm(device, cvt8=None) -> str:
    """CVT8_ASM where the GPU converts fp8 (sm_89+) unless ``cvt8`` is False, else FASTDEC's."""
    from dsv4lab.kernels import moe as base
    able = torch.cuda.get_device_capability(device) >= (8, 9)
    if cvt8 and not able:
        raise ValueError("moe_mma2: CVT8 needs sm_89 or newer (cvt.f16x2.e5m2x2)")
    return CVT8_ASM if (able if cvt8 is None else cvt8) else base.FASTDEC_ASM


@triton.constexpr_function
def _weight_layout(BN, W, NS, GS):
    """Packed weight bytes [BN rows, 4 (t), NS, GS]: lane (g, t) holds rows g and g + 8 of
    its warp's 16 (then 16 W further, per repetition), 16 consecutive bytes each; warp w
    rows 16 w ... That is the A operand's distribution (kWidth 2) under sigma, up to the
    order of registers."""
    reg = [[0, 0, 0, 1 << i] for i in range(GS.bit_length() - 1)]
    reg += [[0, 0, 1 << i, 0] for i in range(NS.bit_length() - 1)]
    reg += [[8, 0, 0, 0]]
    r = 16 * W
    while r < BN:
        reg.append([r, 0, 0, 0])
        r *= 2
    lanes = [[0, 1, 0, 0], [0, 2, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]]
    warps = [[16 << i, 0, 0, 0] for i in range(W.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=lanes, warp_bases=warps,
                                      block_bases=[], shape=[BN, 4, NS, GS])


@triton.constexpr_function
def _scale_cols(NSC, ACC_SCALE):
    """Scale bytes a row a K-step in shared memory: NSC, or with ACC_SCALE one per column of
    the mma (BM = 8; MXFP4's 4 padded with zeros)."""
    return 8 if ACC_SCALE else NSC


@triton.constexpr_function
def _copy_layout(BN, W, WORD=1):
    """The same bytes as :func:`_weight_layout`, as a [BN, 64 / WORD] tile of WORD-byte
    elements (1: bytes; 4: 32-bit words, REGS): each lane copies (cp.async or a load, 16 bytes)
    exactly the chunks it later reads."""
    per = 16 // WORD                                   # elements in a lane's 16 bytes
    reg = [[0, 1 << i] for i in range(per.bit_length() - 1)] + [[8, 0]]
    r = 16 * W
    while r < BN:
        reg.append([r, 0])
        r *= 2
    lanes = [[0, per], [0, 2 * per], [1, 0], [2, 0], [4, 0]]
    warps = [[16 << i, 0] for i in range(W.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=lanes, warp_bases=warps,
                                      block_bases=[], shape=[BN, 4 * per])


@gluon.jit
def _to_a_operand(w, BN: gl.constexpr, A_OP: gl.constexpr):
    """[BN, 4 (t), NS, GS] decoded weights (lane t's 16 bytes) -> the A operand [BN, 64] in
    sigma's order: byte 16 t + 4 s + 2 c + a is column 16 s + 8 c + 2 t + a. No data moves."""
    w = gl.reshape(w, [BN, 4, 4, 2, 2])
    w = gl.permute(w, [0, 2, 3, 1, 4])
    return gl.convert_layout(gl.reshape(w, [BN, 64]), A_OP, assert_trivial=True)


@gluon.jit
def _to_b_operand(x, B_OP: gl.constexpr):
    """[BM, 64] fp16 x (lane t's 16 consecutive) -> the B operand [64, BM] in sigma's order."""
    x = gl.reshape(x, [BM, 4, 4, 2, 2])
    x = gl.permute(x, [2, 3, 1, 4, 0])
    return gl.convert_layout(gl.reshape(x, [64, BM]), B_OP, assert_trivial=True)


@gluon.jit
def _mult(sb, smax, IS_NV: gl.constexpr):
    """Scale bytes -> fp16 multipliers of the decoded weights (MXFP4: ``2**(s - smax + 15)``,
    exact within 2**24 of the row's largest scale, flushed below 2**-29 of it; NVFP4: the
    E4M3 value, exactly)."""
    if IS_NV:
        b = sb.to(gl.int16)
        bits = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
        return bits.to(gl.float16, bitcast=True) * 256.0
    else:
        ex = sb.to(gl.int32) - smax + 15
        return gl.where(ex >= -14, (ex + 15) << 10, 0).to(gl.int16).to(gl.float16, bitcast=True)


@gluon.jit
def _mult32(sb, IS_NV: gl.constexpr):
    """ACC_SCALE: scale bytes -> fp32 multipliers of the accumulator (MXFP4: ``2**(s - 127)``,
    exact but for s = 0, 2**-127, which flushes to 0; NVFP4: the E4M3 value, exactly)."""
    if IS_NV:
        b = sb.to(gl.int16)
        bits = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
        return bits.to(gl.float16, bitcast=True).to(gl.float32) * 256.0
    else:
        return (sb.to(gl.int32) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _row_smax(s_row, nmask, KS, BN: gl.constexpr, num_warps: gl.constexpr,
              SSTEP: gl.constexpr = 0):
    """The largest MXFP4 scale byte of each row over its K slice (KS bytes from s_row;
    ``SSTEP``: TILED, a K-step's 4 bytes of the row SSTEP bytes after the step before's)."""
    L: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [num_warps, 1], [1, 0])
    kc = gl.arange(0, 32, layout=gl.SliceLayout(0, L))
    if SSTEP:
        kc = (kc // 4) * SSTEP + kc % 4
    rows = gl.convert_layout(s_row, gl.SliceLayout(1, L))
    rm = gl.convert_layout(nmask, gl.SliceLayout(1, L))
    m = gl.zeros([BN], gl.int32, layout=gl.SliceLayout(1, L))
    kk = gl.arange(0, 32, layout=gl.SliceLayout(0, L))
    for k0 in range(0, KS, 32):
        at = k0
        if SSTEP:
            at = k0 // 4 * SSTEP
        sb = gl.load(rows[:, None] + (at + kc)[None, :],
                     mask=rm[:, None] & ((k0 + kk) < KS)[None, :], other=0)
        m = gl.maximum(m, gl.max(sb.to(gl.int32), axis=1))
    return m


@gluon.jit
def _issue_mat(w_smem, s_smem, idx, w_rows, s_rows, nm_w, nm_s, k, live,
               NSC: gl.constexpr, CPW: gl.constexpr, CPS: gl.constexpr):
    """One K-step of one matrix's rows: weight bytes, and the step's NSC scale bytes into the
    first NSC of the scale buffer's columns (the rest, ACC_SCALE's padding, zero-filled)."""
    SCW: gl.constexpr = s_smem.type.shape[2]
    cb = gl.arange(0, SEG_BYTES, layout=gl.SliceLayout(0, CPW))
    cs = gl.arange(0, SCW, layout=gl.SliceLayout(0, CPS))
    async_load(
        w_smem.index(idx), w_rows[:, None] + (k * SEG_BYTES + cb)[None, :], mask=nm_w[:, None] & live)
    async_load(
        s_smem.index(idx), s_rows[:, None] + (k * NSC + cs % NSC)[None, :],
        mask=nm_s[:, None] & live & (cs < NSC)[None, :])


@gluon.jit
def _issue(w_smem, s_smem, x_smem, slot, w0, s0, m0w, m0s, w1, s1, m1w, m1s, x_rows, xmask, st,
           nst, NSC: gl.constexpr, CPW: gl.constexpr, CPS: gl.constexpr, CPX: gl.constexpr,
           NMAT: gl.constexpr, NSPS: gl.constexpr, XBLK: gl.constexpr = 0):
    """cp.async stage st (K-steps st * NSPS ..) of the slice into ring slot ``slot``
    (nothing when st >= nst): NSPS consecutive 64-byte steps of every row at once, so
    that a row's bytes reach the memory system as 64 * NSPS contiguous bytes. ``XBLK``
    (ACC_SCALE: packed bytes a scale block): x's row n keeps only the columns of scale block
    n (sigma puts the element of weight byte b in column b: block b // XBLK), zero-filled
    elsewhere; whole 16-byte chunks either way."""
    live = st < nst
    cx = gl.arange(0, 64, layout=gl.SliceLayout(0, CPX))
    xm = xmask[:, None] & live
    if XBLK:
        n = gl.arange(0, BM, layout=gl.SliceLayout(1, CPX))
        xm = xm & ((cx // XBLK)[None, :] == n[:, None])
    for j in gl.static_range(NSPS):
        k = st * NSPS + j
        _issue_mat(w_smem, s_smem, (slot * NMAT) * NSPS + j, w0, s0, m0w, m0s, k, live, NSC, CPW, CPS)
        if NMAT == 2:
            _issue_mat(w_smem, s_smem, (slot * NMAT + 1) * NSPS + j, w1, s1, m1w, m1s, k, live,
                       NSC, CPW, CPS)
        for h in gl.static_range(2):
            async_load(
                x_smem.index((slot * NSPS + j) * 2 + h),
                x_rows[:, None] + (k * 128 + h * 64 + cx)[None, :], mask=xm)
    async_copy.commit_group()


@gluon.jit
def _step(acc, xe, xo, w_smem, s_smem, idx, smax, IS_NV: gl.constexpr, BN: gl.constexpr,
          NS: gl.constexpr, GS: gl.constexpr, WL: gl.constexpr, SL: gl.constexpr,
          A_OP: gl.constexpr, ASM: gl.constexpr):
    """One K-step of one weight matrix from ring buffer ``idx``: decode, scale, two mmas."""
    p = w_smem.index(idx).reshape([BN, 4, NS, GS]).load(WL)
    sb = s_smem.index(idx).reshape([BN, 4, NS]).load(SL)
    mexp, p = gl.broadcast(gl.expand_dims(_mult(sb, smax[:, None, None], IS_NV), 3), p)
    lo, hi = _decode(p, mexp, ASM)
    acc = mma_v2(_to_a_operand(lo, BN, A_OP), xe, acc)
    return mma_v2(_to_a_operand(hi, BN, A_OP), xo, acc)


@gluon.jit
def _step_acc_scale(acc, zero, xe, xo, w_smem, s_smem, idx, IS_NV: gl.constexpr,
                    BN: gl.constexpr, NS: gl.constexpr, GS: gl.constexpr, WL: gl.constexpr,
                    A_OP: gl.constexpr, MMA: gl.constexpr, ASM: gl.constexpr):
    """ACC_SCALE's K-step: the weights decoded without their scales, the two mmas into a
    fresh accumulator whose column n holds block n's partial dot (x's row n holds the K-step's
    elements of scale block n, zeros elsewhere: see :func:`_issue`), then each column times
    its block's scale into ``acc``."""
    p = w_smem.index(idx).reshape([BN, 4, NS, GS]).load(WL)
    lo, hi = _decode_raw(p, ASM)
    c = mma_v2(_to_a_operand(lo, BN, A_OP), xe, zero)
    c = mma_v2(_to_a_operand(hi, BN, A_OP), xo, c)
    return gl.fma(c, _mult32(s_smem.index(idx).load(MMA), IS_NV), acc)


@gluon.jit
def _k_loop(w0, s0, m0, smax0, w1, s1, m1, smax1, x_rows, xmask, nseg,
            IS_NV: gl.constexpr, BN: gl.constexpr, NMAT: gl.constexpr, STAGES: gl.constexpr,
            NSPS: gl.constexpr, ASM: gl.constexpr, num_warps: gl.constexpr,
            ACC_SCALE: gl.constexpr = False):
    """sum over the slice's K-steps of w . x^T for one or two (NMAT) weight matrices, given
    their rows' first weight byte (w*), first scale byte (s*), validity (m*) and MXFP4 row
    maximum (smax*), [BN] each: (acc0, acc1), [BN, BM] in the mma layout. ``ACC_SCALE`` (one
    token, whose row x_rows gives for every column; ASM = CVT8_RAW_ASM): the block scales
    applied to the accumulator (:func:`_step_acc_scale`), the result in every column."""
    W: gl.constexpr = num_warps
    GS: gl.constexpr = 8 if IS_NV else 16              # packed bytes a scale
    NSC: gl.constexpr = SEG_BYTES // GS                # scales a row a K-step
    NS: gl.constexpr = 16 // GS                        # scales a lane a K-step
    MMA: gl.constexpr = _mma_layout(W)
    A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    CPW: gl.constexpr = _copy_layout(BN, W)
    SCW: gl.constexpr = _scale_cols(NSC, ACC_SCALE)    # scale columns in shared memory
    CPS: gl.constexpr = gl.BlockedLayout([1, SCW], [32, 1], [W, 1], [1, 0])
    CPX: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [1, W], [1, 0])
    WL: gl.constexpr = _weight_layout(BN, W, NS, GS)
    SL: gl.constexpr = gl.SliceLayout(3, WL)
    RL: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, SL))
    PLAIN: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    SWZ: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [1, 0])
    w_smem = gl.allocate_shared_memory(gl.uint8, [STAGES * NMAT * NSPS, BN, SEG_BYTES], PLAIN)
    s_smem = gl.allocate_shared_memory(gl.uint8, [STAGES * NMAT * NSPS, BN, SCW], PLAIN)
    x_smem = gl.allocate_shared_memory(gl.float16, [STAGES * NSPS * 2, BM, 64], SWZ)
    RW: gl.constexpr = gl.SliceLayout(1, CPW)
    RS: gl.constexpr = gl.SliceLayout(1, CPS)
    w0 = gl.convert_layout(w0, RW)
    w1 = gl.convert_layout(w1, RW)
    m0w = gl.convert_layout(m0, RW)
    m1w = gl.convert_layout(m1, RW)
    s0 = gl.convert_layout(s0, RS)
    s1 = gl.convert_layout(s1, RS)
    m0s = gl.convert_layout(m0, RS)
    m1s = gl.convert_layout(m1, RS)
    smax0 = gl.convert_layout(smax0, RL)
    smax1 = gl.convert_layout(smax1, RL)
    xr = gl.convert_layout(x_rows, gl.SliceLayout(1, CPX))
    xm = gl.convert_layout(xmask, gl.SliceLayout(1, CPX))
    nst = nseg // NSPS
    XBLK: gl.constexpr = GS if ACC_SCALE else 0
    for st in gl.static_range(STAGES - 1):
        _issue(w_smem, s_smem, x_smem, st, w0, s0, m0w, m0s, w1, s1, m1w, m1s, xr, xm, st, nst,
               NSC, CPW, CPS, CPX, NMAT, NSPS, XBLK)
    acc0 = gl.zeros([BN, BM], gl.float32, layout=MMA)
    acc1 = gl.zeros([BN, BM], gl.float32, layout=MMA)
    zero = gl.zeros([BN, BM], gl.float32, layout=MMA)
    for st in range(nst):
        _issue(w_smem, s_smem, x_smem, (st + STAGES - 1) % STAGES, w0, s0, m0w, m0s, w1, s1,
               m1w, m1s, xr, xm, st + STAGES - 1, nst, NSC, CPW, CPS, CPX, NMAT, NSPS, XBLK)
        async_copy.wait_group(STAGES - 1)
        slot = st % STAGES
        for j in gl.static_range(NSPS):
            xe = _to_b_operand(x_smem.index((slot * NSPS + j) * 2).load(CPX), B_OP)
            xo = _to_b_operand(x_smem.index((slot * NSPS + j) * 2 + 1).load(CPX), B_OP)
            if ACC_SCALE:
                acc0 = _step_acc_scale(acc0, zero, xe, xo, w_smem, s_smem, (slot * NMAT) * NSPS + j,
                                       IS_NV, BN, NS, GS, WL, A_OP, MMA, ASM)
                if NMAT == 2:
                    acc1 = _step_acc_scale(acc1, zero, xe, xo, w_smem, s_smem,
                                           (slot * NMAT + 1) * NSPS + j, IS_NV, BN, NS, GS, WL,
                                           A_OP, MMA, ASM)
            else:
                acc0 = _step(acc0, xe, xo, w_smem, s_smem, (slot * NMAT) * NSPS + j, smax0, IS_NV,
                             BN, NS, GS, WL, SL, A_OP, ASM)
                if NMAT == 2:
                    acc1 = _step(acc1, xe, xo, w_smem, s_smem, (slot * NMAT + 1) * NSPS + j, smax1,
                                 IS_NV, BN, NS, GS, WL, SL, A_OP, ASM)
    async_copy.wait_group(0)
    if ACC_SCALE:       # the blocks' columns summed; every column holds the rows' dot
        acc0 = gl.expand_dims(gl.sum(acc0, axis=1), 1) + zero
        acc1 = gl.expand_dims(gl.sum(acc1, axis=1), 1) + zero
    return acc0, acc1


# REGS's decode (sm_89 and newer): CVT8_ASM on one 32-bit word of packed bytes ($8) with its
# fp16 multiplier ($9), the eight nibbles' fp16 values as separate 16-bit outputs: the low
# nibbles of bytes 0..3 ($0..$3), then the high ones ($4..$7). The words come straight from
# a loop-carried int32 register ring (:func:`_k_loop_regs`); byte tensors carried by the loop
# would sit a byte a register and cost a PRMT each to repack.
CVT8_WORD_ASM = "\n{\n.reg .b32 m2;\nmov.b32 m2, {$9, $9};" + _CVT8_PLACE.replace("$4", "$8") + """\
cvt.rn.f16x2.e5m2x2 u, l0;
mul.rn.f16x2 u, u, m2;
mov.b32 {$0, $1}, u;
cvt.rn.f16x2.e5m2x2 u, l1;
mul.rn.f16x2 u, u, m2;
mov.b32 {$2, $3}, u;
cvt.rn.f16x2.e5m2x2 u, h0;
mul.rn.f16x2 u, u, m2;
mov.b32 {$4, $5}, u;
cvt.rn.f16x2.e5m2x2 u, h1;
mul.rn.f16x2 u, u, m2;
mov.b32 {$6, $7}, u;
}
"""
_CVT8_WORD = gl.constexpr(CVT8_WORD_ASM)     # (a jit function reads globals as constexprs)


@gluon.jit
def _decode_words(wd, mult, BN: gl.constexpr, NS: gl.constexpr, GS: gl.constexpr):
    """REGS: packed words [BN, 4, NS, GS / 4] and their fp16 multipliers (same shape) ->
    (low, high) nibbles as fp16 [BN, 4, NS, GS], byte order as :func:`_decode`'s."""
    o = gl.inline_asm_elementwise(_CVT8_WORD, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [wd, mult],
                                  dtype=(gl.float16,) * 8, is_pure=True, pack=1)
    lo = gl.permute(gl.join(gl.join(o[0], o[1]), gl.join(o[2], o[3])), [0, 1, 2, 3, 5, 4])
    hi = gl.permute(gl.join(gl.join(o[4], o[5]), gl.join(o[6], o[7])), [0, 1, 2, 3, 5, 4])
    return gl.reshape(lo, [BN, 4, NS, GS]), gl.reshape(hi, [BN, 4, NS, GS])


@gluon.jit
def _load_step(w_rows, s_rows, k, cw, t4, si, NSC: gl.constexpr, NS: gl.constexpr,
               EVICT: gl.constexpr = False, TILED: gl.constexpr = False):
    """REGS: K-step k's weight words [BN, 16] (lane t's 16 bytes of a row, one 16-byte load)
    and scale bytes [BN, 4, NS] (the lane's own blocks), straight into registers. Unmasked:
    the fused launch's row tiles divide the matrix, and k is clamped by the caller. ``TILED``:
    the weights in :func:`pack_tile_major`'s layout (a step's 16 rows x 64 bytes contiguous:
    the next step of a row lies 1024 bytes on), and (TILED 2) their scales (16 NSC bytes on)."""
    CACHE: gl.constexpr = _load_hints(EVICT)[0]
    POLICY: gl.constexpr = _load_hints(EVICT)[1]
    WSTEP: gl.constexpr = 16 * SEG_BYTES // 4 if TILED else SEG_BYTES // 4
    SSTEP: gl.constexpr = 16 * NSC if TILED == 2 else NSC
    p = gl.load(w_rows[:, None] + (k * WSTEP + cw)[None, :], cache_modifier=CACHE,
                eviction_policy=POLICY)
    sb = gl.load(s_rows[:, None, None] + k * SSTEP + t4[None, :, None] * NS + si[None, None, :],
                 cache_modifier=CACHE, eviction_policy=POLICY)
    return p, sb


@triton.constexpr_function
def _load_hints(EVICT):
    """REGS's weight loads: (cache modifier, eviction policy). ``EVICT``: L2 evict-first (PTX
    takes no ``.cg`` with it); otherwise ``.cg``, the L2's default policy."""
    return ("", "evict_first") if EVICT else (".cg", "")


@gluon.jit
def _regs_step(acc, p, sb, smax, xr, xm, k, nseg, cx, IS_NV: gl.constexpr, BN: gl.constexpr,
               WW: gl.constexpr, A_OP: gl.constexpr, B_OP: gl.constexpr):
    """REGS: acc plus K-step k of the words ``p`` and scale bytes ``sb``; a step past the
    slice (k >= nseg, the unrolled loop's tail) multiplies zeros of x and adds nothing."""
    NS: gl.constexpr = sb.type.shape[2]
    GS: gl.constexpr = 16 // NS
    live = xm & (k < nseg)
    xe = _to_b_operand(gl.load(xr[:, None] + (k * 128 + cx)[None, :], mask=live, other=0.0), B_OP)
    xo = _to_b_operand(gl.load(xr[:, None] + (k * 128 + 64 + cx)[None, :], mask=live, other=0.0),
                       B_OP)
    wd = gl.convert_layout(gl.reshape(p, [BN, 4, NS, GS // 4]), WW, assert_trivial=True)
    mult, wd = gl.broadcast(gl.expand_dims(_mult(sb, smax[:, None, None], IS_NV), 3), wd)
    lo, hi = _decode_words(wd, mult, BN, NS, GS)
    acc = mma_v2(_to_a_operand(lo, BN, A_OP), xe, acc)
    return mma_v2(_to_a_operand(hi, BN, A_OP), xo, acc)


@triton.constexpr_function
def _regs_layouts(BN, W, IS_NV):
    """REGS: (the copy layout of the weight words, the words' layout as the decode takes them,
    the row layout of the scale pointers, scales a lane a K-step, scales a row a K-step)."""
    GS = 8 if IS_NV else 16                            # packed bytes a scale
    NS = 16 // GS                                      # scales a lane a K-step
    WW = _weight_layout(BN, W, NS, GS // 4)            # the words, [BN, 4, NS, GS / 4]
    RL = gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, WW)))
    return _copy_layout(BN, W, 4), WW, RL, NS, 64 // GS


@gluon.jit
def _ring_addrs(w, s, IS_NV: gl.constexpr, BN: gl.constexpr, num_warps: gl.constexpr):
    """REGS: the rows' first weight words and scale bytes and the lane offsets of a K-step's
    loads (:func:`_load_step`), from the rows' first bytes ``w`` and ``s``."""
    CPW: gl.constexpr = _regs_layouts(BN, num_warps, IS_NV)[0]
    WW: gl.constexpr = _regs_layouts(BN, num_warps, IS_NV)[1]
    RL: gl.constexpr = _regs_layouts(BN, num_warps, IS_NV)[2]
    NS: gl.constexpr = _regs_layouts(BN, num_warps, IS_NV)[3]
    SL: gl.constexpr = gl.SliceLayout(3, WW)
    w_rows = gl.convert_layout(w, gl.SliceLayout(1, CPW)).to(gl.pointer_type(gl.int32))
    s_rows = gl.convert_layout(s, RL)
    cw = gl.arange(0, SEG_BYTES // 4, layout=gl.SliceLayout(0, CPW))
    t4 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, SL)))
    si = gl.arange(0, NS, layout=gl.SliceLayout(0, gl.SliceLayout(1, SL)))
    return w_rows, s_rows, cw, t4, si


@gluon.jit
def _ring_start(w, s, nseg, IS_NV: gl.constexpr, BN: gl.constexpr, RING: gl.constexpr,
                num_warps: gl.constexpr, EVICT: gl.constexpr = False,
                TILED: gl.constexpr = False):
    """REGS: the loads of a slice's first RING K-steps (see :func:`_k_loop_regs`), issued on
    their own so that a down tile can request its first weight bytes before it waits for its
    activations (``EARLY``). For RING 2 the last two of the eight results repeat the first two
    (unused)."""
    NS: gl.constexpr = _regs_layouts(BN, num_warps, IS_NV)[3]
    NSC: gl.constexpr = _regs_layouts(BN, num_warps, IS_NV)[4]
    w_rows, s_rows, cw, t4, si = _ring_addrs(w, s, IS_NV, BN, num_warps)
    last = nseg - 1
    pa, sa = _load_step(w_rows, s_rows, 0, cw, t4, si, NSC, NS, EVICT, TILED)
    pb, sb = _load_step(w_rows, s_rows, gl.minimum(1, last), cw, t4, si, NSC, NS, EVICT, TILED)
    if RING == 4:
        pc, sc = _load_step(w_rows, s_rows, gl.minimum(2, last), cw, t4, si, NSC, NS, EVICT, TILED)
        pd, sd = _load_step(w_rows, s_rows, gl.minimum(3, last), cw, t4, si, NSC, NS, EVICT, TILED)
    else:
        pc, sc, pd, sd = pa, sa, pb, sb
    return pa, sa, pb, sb, pc, sc, pd, sd


@gluon.jit
def _k_loop_regs(w, s, pa, sa, pb, sb, pc, sc, pd, sd, smax, x_rows, xmask, nseg,
                 IS_NV: gl.constexpr, BN: gl.constexpr, RING: gl.constexpr,
                 num_warps: gl.constexpr, EVICT: gl.constexpr = False,
                 TILED: gl.constexpr = False):
    """:func:`_k_loop` for one matrix of BN rows without shared memory (``REGS``; the CVT8
    decode, sm_89+): every lane loads the weight words and scale bytes it decodes straight
    into registers, ``RING`` (2 or 4) K-steps of them in flight, and its x fragments from
    global memory (the L1) at the step. The loop is unrolled RING times so that each step's
    registers are refilled with the step RING further on as soon as they are multiplied
    (no moves). No cp.async and no shared-memory ring, so no barrier between the warps: each
    warp runs its own chain, and the programs an SM holds are bounded by registers, not
    shared memory. Gate and up run as one matrix of 2 BN1 rows (see :func:`_decode_kernel`);
    every row is valid (the fused launch's row tiles divide the matrix). The ring's first
    RING steps (pa, sa ...) come from :func:`_ring_start`. ``TILED``: see :func:`_load_step`."""
    W: gl.constexpr = num_warps
    MMA: gl.constexpr = _mma_layout(W)
    A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    WW: gl.constexpr = _regs_layouts(BN, W, IS_NV)[1]
    RL: gl.constexpr = _regs_layouts(BN, W, IS_NV)[2]
    NS: gl.constexpr = _regs_layouts(BN, W, IS_NV)[3]
    NSC: gl.constexpr = _regs_layouts(BN, W, IS_NV)[4]
    CPX: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [1, W], [1, 0])
    w_rows, s_rows, cw, t4, si = _ring_addrs(w, s, IS_NV, BN, num_warps)
    smax = gl.convert_layout(smax, RL)
    xr = gl.convert_layout(x_rows, gl.SliceLayout(1, CPX))
    xm = gl.convert_layout(xmask, gl.SliceLayout(1, CPX))[:, None]
    cx = gl.arange(0, 64, layout=gl.SliceLayout(0, CPX))
    last = nseg - 1
    acc = gl.zeros([BN, BM], gl.float32, layout=MMA)
    if RING == 2:
        for k in range(0, nseg, 2):
            acc = _regs_step(acc, pa, sa, smax, xr, xm, k, nseg, cx, IS_NV, BN, WW, A_OP, B_OP)
            pa, sa = _load_step(w_rows, s_rows, gl.minimum(k + 2, last), cw, t4, si, NSC, NS, EVICT, TILED)
            acc = _regs_step(acc, pb, sb, smax, xr, xm, k + 1, nseg, cx, IS_NV, BN, WW, A_OP, B_OP)
            pb, sb = _load_step(w_rows, s_rows, gl.minimum(k + 3, last), cw, t4, si, NSC, NS, EVICT, TILED)
    else:
        for k in range(0, nseg, 4):
            acc = _regs_step(acc, pa, sa, smax, xr, xm, k, nseg, cx, IS_NV, BN, WW, A_OP, B_OP)
            pa, sa = _load_step(w_rows, s_rows, gl.minimum(k + 4, last), cw, t4, si, NSC, NS, EVICT, TILED)
            acc = _regs_step(acc, pb, sb, smax, xr, xm, k + 1, nseg, cx, IS_NV, BN, WW, A_OP, B_OP)
            pb, sb = _load_step(w_rows, s_rows, gl.minimum(k + 5, last), cw, t4, si, NSC, NS, EVICT, TILED)
            acc = _regs_step(acc, pc, sc, smax, xr, xm, k + 2, nseg, cx, IS_NV, BN, WW, A_OP, B_OP)
            pc, sc = _load_step(w_rows, s_rows, gl.minimum(k + 6, last), cw, t4, si, NSC, NS, EVICT, TILED)
            acc = _regs_step(acc, pd, sd, smax, xr, xm, k + 3, nseg, cx, IS_NV, BN, WW, A_OP, B_OP)
            pd, sd = _load_step(w_rows, s_rows, gl.minimum(k + 7, last), cw, t4, si, NSC, NS, EVICT, TILED)
    return acc


@gluon.jit
def _seg_order(n):
    """Column n of an activation row -> its place in sigma's order (per 128-element segment,
    the 64 even columns, then the 64 odd ones)."""
    return (n // 128) * 128 + (n % 2) * 64 + (n % 128) // 2


@gluon.jit
def _block(sorted_pair_ptr, block_start_ptr, block_count_ptr, b, ROWL: gl.constexpr):
    start = gl.load(block_start_ptr + b)
    cnt = gl.load(block_count_ptr + b)
    offs_m = gl.arange(0, BM, layout=ROWL)
    mmask = offs_m < cnt
    pair = gl.load(sorted_pair_ptr + start + offs_m, mask=mmask, other=0)
    return start, offs_m, mmask, pair


@triton.constexpr_function
def _mma_layout(W):
    """The accumulator [weight rows, tokens]: warps stacked along the weight rows (M)."""
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1], instr_shape=[16, 8])


@gluon.jit
def _weight_rows(w_ptr, s_ptr, e, pn, sp, n_rows, NSEG, stride_we, stride_wn, stride_se,
                 stride_sn, IS_NV: gl.constexpr, BN: gl.constexpr, num_warps: gl.constexpr,
                 ACC_SCALE: gl.constexpr = False, TILED: gl.constexpr = False):
    """This program's BN rows of expert e's matrix at w_ptr / s_ptr, from its K slice
    (NSEG steps of slice sp): ``(offs_n, nmask, first weight bytes, first scale bytes,
    MXFP4 row maxima (0 for NVFP4 and with ACC_SCALE))``, [BN] each, in the accumulator's row
    layout."""
    COLL: gl.constexpr = gl.SliceLayout(1, _mma_layout(num_warps))
    offs_n = pn * BN + gl.arange(0, BN, layout=COLL)
    nmask = offs_n < n_rows
    w, s, smax = _rows_at(w_ptr, s_ptr, e, offs_n, nmask, sp, NSEG, stride_we, stride_wn,
                          stride_se, stride_sn, IS_NV, BN, num_warps, ACC_SCALE, TILED)
    return offs_n, nmask, w, s, smax


@gluon.jit
def _rows_at(w_ptr, s_ptr, e, rows, nmask, sp, NSEG, stride_we, stride_wn, stride_se, stride_sn,
             IS_NV: gl.constexpr, BN: gl.constexpr, num_warps: gl.constexpr,
             ACC_SCALE: gl.constexpr = False, TILED: gl.constexpr = False):
    """Rows ``rows`` (valid where ``nmask``; [BN], the accumulator's row layout) of expert e's
    matrix at w_ptr / s_ptr, from K slice sp (NSEG steps): ``(first weight bytes, first scale
    bytes, MXFP4 row maxima (0 for NVFP4 and with ACC_SCALE))``. ``TILED``: the matrix in
    :func:`pack_tile_major`'s layout (1: its weights; 2: its scales too), which keeps the
    canonical shape, so a 16-row group spans 16 rows' strides."""
    COLL: gl.constexpr = gl.SliceLayout(1, _mma_layout(num_warps))
    NSC: gl.constexpr = SEG_BYTES // (8 if IS_NV else 16)
    e64 = e.to(gl.int64)
    r64 = rows.to(gl.int64)
    if TILED:       # [16-row group][K-step][16 rows][64 bytes]
        w = (w_ptr + e64 * stride_we + (r64 // 16) * (16 * stride_wn)
             + (r64 % 16) * SEG_BYTES + sp * NSEG * 16 * SEG_BYTES)
    else:
        w = w_ptr + e64 * stride_we + r64 * stride_wn + sp * NSEG * SEG_BYTES
    if TILED == 2:  # the scales alike: [16-row group][K-step][16 rows][NSC]
        s = (s_ptr + e64 * stride_se + (r64 // 16) * (16 * stride_sn) + (r64 % 16) * NSC
             + sp * NSEG * 16 * NSC)
    else:
        s = s_ptr + e64 * stride_se + r64 * stride_sn + sp * NSEG * NSC
    if IS_NV or ACC_SCALE:
        smax = gl.zeros([BN], gl.int32, layout=COLL)
    else:
        smax = gl.convert_layout(_row_smax(s, nmask, NSEG * NSC, BN, num_warps,
                                           16 * NSC if TILED == 2 else 0), COLL)
    return w, s, smax


@gluon.jit
def _undo_scales(acc, smax, gscale_ptr, e, IS_NV: gl.constexpr, ACC_SCALE: gl.constexpr = False):
    """acc [BN, BM] times what the decoded weights and x's 2**-8 still owe: NVFP4, 2**22 times
    expert e's global scale; MXFP4, ``2**(smax - 120)`` per row (the scale split), or with
    ACC_SCALE (the block scales already applied) 2**22."""
    if IS_NV:
        return acc * (4194304.0 * gl.load(gscale_ptr + e))
    elif ACC_SCALE:
        return acc * 4194304.0
    else:
        return acc * ((smax + 7) << 23).to(gl.float32, bitcast=True)[:, None]


@gluon.jit
def _swiglu(gate, up, swiglu_limit, HAS_LIMIT: gl.constexpr):
    if HAS_LIMIT:
        gate = gl.minimum(gate, swiglu_limit)
        up = gl.minimum(gl.maximum(up, -swiglu_limit), swiglu_limit)
    return gate / (1.0 + gl.exp(-gate)) * up


@gluon.jit
def _gate_up_kernel(xp_ptr, w_ptr, s_ptr, gscale_ptr, sorted_pair_ptr, block_expert_ptr,
                    block_start_ptr, block_count_ptr, out_ptr, I, TOPK, NSEG, stride_xt,
                    stride_we, stride_wn, stride_se, stride_sn, stride_out, stride_part,
                    swiglu_limit, IS_NV: gl.constexpr, HAS_LIMIT: gl.constexpr,
                    PARTIAL: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
                    NSPS: gl.constexpr, ASM: gl.constexpr, num_warps: gl.constexpr):
    """One program: the block's tokens times BN gate rows and the BN matching up rows over a
    K slice of NSEG steps (grid: blocks, I / BN, slices). Writes act in sigma's order (fp16
    times 2**-8, as the down kernel reads it) or, split over K (PARTIAL), fp32 gate and up
    partials for moe._moe_swiglu_kernel."""
    b = gl.program_id(0)
    pn = gl.program_id(1)
    sp = gl.program_id(2)
    e = gl.load(block_expert_ptr + b)
    if e >= 0:
        start, offs_m, mmask, pair = _block(sorted_pair_ptr, block_start_ptr, block_count_ptr,
                                            b, gl.SliceLayout(0, _mma_layout(num_warps)))
        offs_n, nmask, wg, sg, smax_g = _weight_rows(w_ptr, s_ptr, e, pn, sp, I, NSEG, stride_we,
                                                     stride_wn, stride_se, stride_sn, IS_NV, BN,
                                                     num_warps)
        _, _, wu, su, smax_u = _weight_rows(w_ptr + I * stride_wn, s_ptr + I * stride_sn, e, pn,
                                            sp, I, NSEG, stride_we, stride_wn, stride_se,
                                            stride_sn, IS_NV, BN, num_warps)
        x_rows = xp_ptr + (pair // TOPK).to(gl.int64) * stride_xt + sp * NSEG * 128
        acc_g, acc_u = _k_loop(wg, sg, nmask, smax_g, wu, su, nmask, smax_u,
                               x_rows, mmask, NSEG, IS_NV, BN, 2, STAGES, NSPS, ASM, num_warps)
        gate = _undo_scales(acc_g, smax_g, gscale_ptr, e, IS_NV)
        up = _undo_scales(acc_u, smax_u, gscale_ptr, e, IS_NV)
        rows = (start + offs_m).to(gl.int64)
        omask = mmask[None, :] & nmask[:, None]
        if PARTIAL:
            part = out_ptr + sp.to(gl.int64) * stride_part + rows[None, :] * stride_out + offs_n[:, None]
            gl.store(part, gate, mask=omask)
            gl.store(part + I, up, mask=omask)
        else:
            act = _swiglu(gate, up, swiglu_limit, HAS_LIMIT)
            gl.store(out_ptr + rows[None, :] * stride_out + _seg_order(offs_n)[:, None],
                     (act * 0.00390625).to(gl.float16), mask=omask)


@gluon.jit
def _down_kernel(act_ptr, w_ptr, s_ptr, gscale_ptr, topk_w_ptr, sorted_pair_ptr,
                 block_expert_ptr, block_start_ptr, block_count_ptr, ypair_ptr, H, NSEG,
                 stride_act, stride_we, stride_wn, stride_se, stride_sn, stride_y, stride_ys,
                 IS_NV: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
                 NSPS: gl.constexpr, ASM: gl.constexpr, num_warps: gl.constexpr):
    """One program: the block's activations times BN down-projection rows over a K slice;
    writes each pair's partial row times its routing weight (moe._moe_combine_kernel sums)."""
    b = gl.program_id(0)
    pn = gl.program_id(1)
    sp = gl.program_id(2)
    e = gl.load(block_expert_ptr + b)
    if e >= 0:
        start, offs_m, mmask, pair = _block(sorted_pair_ptr, block_start_ptr, block_count_ptr,
                                            b, gl.SliceLayout(0, _mma_layout(num_warps)))
        offs_n, nmask, w, s, smax = _weight_rows(w_ptr, s_ptr, e, pn, sp, H, NSEG, stride_we,
                                                 stride_wn, stride_se, stride_sn, IS_NV, BN,
                                                 num_warps)
        a_rows = act_ptr + (start + offs_m).to(gl.int64) * stride_act + sp * NSEG * 128
        acc, unused = _k_loop(w, s, nmask, smax, w, s, nmask, smax, a_rows, mmask, NSEG, IS_NV,
                              BN, 1, STAGES, NSPS, ASM, num_warps)
        wt = gl.load(topk_w_ptr + pair, mask=mmask, other=0.0).to(gl.float32)
        y = _undo_scales(acc, smax, gscale_ptr, e, IS_NV) * wt[None, :]
        gl.store(ypair_ptr + sp.to(gl.int64) * stride_ys + pair.to(gl.int64)[None, :] * stride_y
                 + offs_n[:, None], y, mask=mmask[None, :] & nmask[:, None])


@gluon.jit
def _prefetch_l2(rows, nbytes, BN: gl.constexpr, num_warps: gl.constexpr):
    """Ask the L2 for nbytes from each of the BN row pointers (128-byte lines), no wait."""
    L: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [num_warps, 1], [1, 0])
    r = gl.convert_layout(rows, gl.SliceLayout(1, L))
    lines = gl.arange(0, 8, layout=gl.SliceLayout(0, L)) * 128
    for off in range(0, nbytes, 1024):
        gl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l",
                                  [r[:, None] + (off + lines)[None, :]], dtype=gl.int32,
                                  is_pure=False, pack=1)


@triton.constexpr_function
def _sleep_asm(ns):
    return f"nanosleep.u32 {int(ns)}; mov.u32 $0, $1;"


@gluon.jit
def _wait_count(ptr, target, SLEEP: gl.constexpr):
    """Spin until the counter at ptr reaches target (acquire: what its writers stored
    before their release is then visible to this program); SLEEP ns between polls."""
    seen = gl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        # back off ~0.5 us between polls, so pollers leave the issue slots to working tiles
        # (at T = 1 no faster or slower, measured: tune_moe #99 71.7 -> 71.6 us)
        seen = gl.inline_asm_elementwise(_sleep_asm(SLEEP), "=r,r", [seen], dtype=gl.int32,
                                         is_pure=False, pack=1)
        seen = gl.atomic_add(ptr, 0, sem="acquire", scope="gpu")


@gluon.jit
def _sum_pairs(total, ypair_ptr, ids_ptr, out_ptr, offs_h, m, P, T, TOPK, SPLIT2, stride_y,
               stride_out):
    """out[token m, rows offs_h] = ``total`` (zeros [rows, tokens]) plus the rows of ypair
    [SPLIT2 slices x P pairs, stride_y] of every live pair of token m, pairs and slices in
    order: the same sum every call."""
    for q in range(P):
        live = (m == q // TOPK)[None, :] & (gl.load(ids_ptr + q) >= 0)
        for q2 in range(SPLIT2):
            total += gl.load(ypair_ptr + (q2 * P + q) * stride_y + offs_h[:, None]
                             + m[None, :] * 0, mask=live, other=0.0, cache_modifier=".cg")
    gl.store(out_ptr + m[None, :].to(gl.int64) * stride_out + offs_h[:, None],
             total.to(out_ptr.dtype.element_ty), mask=(m < T)[None, :])


@gluon.jit
def _ticket(ctr_ptr, stamps_ptr, PDL: gl.constexpr, num_warps: gl.constexpr):
    """A ticketed launch's program: (``PDL``) wait for the launch it depends on, then take the
    next ticket from the counter at ctr_ptr (its tile; the order programs start in, so tiles
    handed out earlier are running); TIMELINE: its start, ticket and SM stamped."""
    if PDL:     # (the timeline's "program start" is then the end of this wait)
        gdc_wait(num_warps)
    t0 = 0
    if TIMELINE:
        t0 = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [t0], dtype=gl.int64,
                                       is_pure=False, pack=1)
    tile = gl.atomic_add(ctr_ptr, 1, sem="relaxed", scope="gpu")
    if TIMELINE:
        gl.store(stamps_ptr + tile * 8, t0)
        _stamp(stamps_ptr, tile, 1, num_warps)
        _stamp(stamps_ptr, tile, 5, num_warps)
    return tile


@gluon.jit
def _stamp(stamps, tile, point: gl.constexpr, num_warps: gl.constexpr):
    """TIMELINE: tile ``tile`` records %globaltimer (ns; point 5: %smid) at ``point``."""
    if TIMELINE:
        one: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        i = gl.arange(0, 32 * num_warps, layout=one)
        if point == 5:
            t = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [i], dtype=gl.int32,
                                          is_pure=False, pack=1).to(gl.int64)
        else:
            t = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [i], dtype=gl.int64,
                                          is_pure=False, pack=1)
        gl.store(stamps + tile * 8 + point + 0 * i, t, mask=i == 0)


@gluon.jit
def _pair_tile(ptr, row, stride, offs_n, m):
    """[BN, BM] pointers to columns offs_n of row ``row`` of a [rows, stride] buffer, the same
    row for every token column (a pair's block holds one token; masks pick its column)."""
    return ptr + row.to(gl.int64) * stride + offs_n[:, None] + m[None, :] * 0


@gluon.jit
def _store_act(act_ptr, p, stride_act, offs_n, m, col, gate, up, swiglu_limit,
               HAS_LIMIT: gl.constexpr):
    """act[p] = the SwiGLU of token column ``col`` of gate and up, in sigma's order, fp16
    times 2**-8 (as the down tiles read it)."""
    gl.store(_pair_tile(act_ptr, p, stride_act, _seg_order(offs_n), m),
             (_swiglu(gate, up, swiglu_limit, HAS_LIMIT) * 0.00390625).to(gl.float16),
             mask=col[None, :])


@gluon.jit
def _gate_up_tile(xp_ptr, w13_ptr, s13_ptr, g13_ptr, ids_ptr, act_ptr, part_ptr, ctr_ptr,
                  stamps_ptr, tile, m, P, TOPK, I, n_tiles1, n_tiles2, nseg1, stride_xt,
                  stride_w13e, stride_w13n, stride_s13e, stride_s13n, stride_act, stride_part,
                  swiglu_limit, IS_NV: gl.constexpr, HAS_LIMIT: gl.constexpr,
                  BN1: gl.constexpr, SPLIT1: gl.constexpr, STAGES: gl.constexpr,
                  NSPS1: gl.constexpr, ASM: gl.constexpr, num_warps: gl.constexpr,
                  ACC_SCALE: gl.constexpr, REGS: gl.constexpr, EVICT: gl.constexpr,
                  TILED: gl.constexpr = False):
    """Gate/up tile ``tile`` of :func:`_decode_kernel` (its pair p, BN1 row tile pn, K slice
    sp): the gate and up rows' dot products with the token, the split-K sum by the last
    slice, the SwiGLU into act[p], and pair p's count released."""
    MMA: gl.constexpr = _mma_layout(num_warps)
    ROWS: gl.constexpr = gl.SliceLayout(1, MMA)
    g = tile // SPLIT1                      # the gate/up row tile (p, pn)
    sp = tile % SPLIT1
    p = g // n_tiles1
    pn = g % n_tiles1
    e = gl.load(ids_ptr + p)
    t = p // TOPK
    col = m == t
    offs_n = pn * BN1 + gl.arange(0, BN1, layout=ROWS)
    if e >= 0:
        x_rows = xp_ptr + t.to(gl.int64) * stride_xt + sp * nseg1 * 128 + m * 0
        xmask = col
        if REGS:    # gate rows, then the matching up rows, as one matrix
            r = gl.arange(0, 2 * BN1, layout=ROWS)
            own = pn * BN1 + r % BN1
            w, sc, smax = _rows_at(w13_ptr, s13_ptr, e, own + (r // BN1) * I, own < I, sp,
                                   nseg1, stride_w13e, stride_w13n, stride_s13e, stride_s13n,
                                   IS_NV, 2 * BN1, num_warps, False, TILED)
            pa, sa, pb, sb, pc, sc2, pd, sd = _ring_start(w, sc, nseg1, IS_NV, 2 * BN1, REGS,
                                                          num_warps, EVICT, TILED)
            _stamp(stamps_ptr, tile, 2, num_warps)
            acc = _k_loop_regs(w, sc, pa, sa, pb, sb, pc, sc2, pd, sd, smax, x_rows, xmask,
                               nseg1, IS_NV, 2 * BN1, REGS, num_warps, EVICT, TILED)
            _stamp(stamps_ptr, tile, 3, num_warps)
            acc = _undo_scales(acc, smax, g13_ptr, e, IS_NV)
            # rows 2 BN1 -> (gate, up): the top row bit is a register repetition of MMA
            gate, up = gl.split(gl.permute(gl.reshape(acc, [2, BN1, BM]), [1, 2, 0]))
            gate = gl.convert_layout(gate, MMA, assert_trivial=True)
            up = gl.convert_layout(up, MMA, assert_trivial=True)
        else:
            _, nmask, wg, sg, smax_g = _weight_rows(w13_ptr, s13_ptr, e, pn, sp, I, nseg1,
                                                    stride_w13e, stride_w13n, stride_s13e,
                                                    stride_s13n, IS_NV, BN1, num_warps, ACC_SCALE)
            _, _, wu, su, smax_u = _weight_rows(w13_ptr + I * stride_w13n,
                                                s13_ptr + I * stride_s13n, e, pn, sp, I, nseg1,
                                                stride_w13e, stride_w13n, stride_s13e,
                                                stride_s13n, IS_NV, BN1, num_warps, ACC_SCALE)
            if ACC_SCALE:                       # the token's row in every column, by block
                xmask = m >= 0
            _stamp(stamps_ptr, tile, 2, num_warps)
            acc_g, acc_u = _k_loop(wg, sg, nmask, smax_g, wu, su, nmask, smax_u, x_rows, xmask,
                                   nseg1, IS_NV, BN1, 2, STAGES, NSPS1, ASM, num_warps, ACC_SCALE)
            _stamp(stamps_ptr, tile, 3, num_warps)
            gate = _undo_scales(acc_g, smax_g, g13_ptr, e, IS_NV, ACC_SCALE)
            up = _undo_scales(acc_u, smax_u, g13_ptr, e, IS_NV, ACC_SCALE)
        if SPLIT1 > 1:
            part = _pair_tile(part_ptr, sp * P + p, stride_part, offs_n, m)
            gl.store(part, gate, mask=col[None, :])
            gl.store(part + I, up, mask=col[None, :])
        else:
            _store_act(act_ptr, p, stride_act, offs_n, m, col, gate, up, swiglu_limit, HAS_LIMIT)
    last = True
    if SPLIT1 > 1:
        cta_barrier()
        last = gl.atomic_add(ctr_ptr + 1 + P + n_tiles2 + g, 1, sem="acq_rel", scope="gpu") == SPLIT1 - 1
        if last & (e >= 0):                 # the row tile's last slice: sum in slice order
            gate = gl.zeros([BN1, BM], gl.float32, layout=MMA)
            up = gl.zeros([BN1, BM], gl.float32, layout=MMA)
            for q in range(SPLIT1):
                part = _pair_tile(part_ptr, q * P + p, stride_part, offs_n, m)
                gate += gl.load(part, mask=col[None, :], other=0.0, cache_modifier=".cg")
                up += gl.load(part + I, mask=col[None, :], other=0.0, cache_modifier=".cg")
            _store_act(act_ptr, p, stride_act, offs_n, m, col, gate, up, swiglu_limit, HAS_LIMIT)
    if last:
        cta_barrier()                         # every thread's act stores, then one release
        gl.atomic_add(ctr_ptr + 1 + p, 1, sem="release", scope="gpu")
    _stamp(stamps_ptr, tile, 4, num_warps)


@gluon.jit
def _down_tile(d, ticket, w2_ptr, s2_ptr, g2_ptr, ids_ptr, topk_w_ptr, act_ptr, ypair_ptr, out_ptr,
               ctr_ptr, stamps_ptr, m, P, T, TOPK, H, n_tiles1, n_tiles2, nseg2, stride_w2e,
               stride_w2n, stride_s2e, stride_s2n, stride_act, stride_y, stride_out,
               IS_NV: gl.constexpr, BN2: gl.constexpr, SPLIT2: gl.constexpr,
               STAGES: gl.constexpr, NSPS2: gl.constexpr, PREFETCH: gl.constexpr,
               ASM: gl.constexpr, num_warps: gl.constexpr, ACC_SCALE: gl.constexpr,
               REGS: gl.constexpr, EVICT: gl.constexpr, EARLY: gl.constexpr,
               TILED: gl.constexpr = False):
    """Down tile ``d`` of :func:`_decode_kernel` (its pair p, BN2 row tile pn, K slice sp;
    ``ticket``: the program's ticket, its row of the timeline's stamps): pair p's activations
    times the rows, weighted, into ypair; the last tile of its rows sums them over the pairs
    into out."""
    MMA: gl.constexpr = _mma_layout(num_warps)
    ROWS: gl.constexpr = gl.SliceLayout(1, MMA)
    sp = d % SPLIT2
    p = d // SPLIT2 // n_tiles2
    pn = d // SPLIT2 % n_tiles2
    e = gl.load(ids_ptr + p)
    offs_h = pn * BN2 + gl.arange(0, BN2, layout=ROWS)
    if e >= 0:
        t = p // TOPK
        col = m == t
        _, nmask, w, s, smax = _weight_rows(w2_ptr, s2_ptr, e, pn, sp, H, nseg2, stride_w2e,
                                            stride_w2n, stride_s2e, stride_s2n, IS_NV, BN2,
                                            num_warps, ACC_SCALE, TILED)
        if REGS and EARLY:    # the ring's first weight bytes requested before the wait
            pa, sa, pb, sb, pc, sc, pd, sd = _ring_start(w, s, nseg2, IS_NV, BN2, REGS,
                                                         num_warps, EVICT, TILED)
        if PREFETCH:
            _prefetch_l2(w, nseg2 * 64, BN2, num_warps)
        _wait_count(ctr_ptr + 1 + p, n_tiles1, 500)
        _stamp(stamps_ptr, ticket, 2, num_warps)
        a_rows = act_ptr + p.to(gl.int64) * stride_act + sp * nseg2 * 128 + m * 0
        amask = col
        if ACC_SCALE:
            amask = m >= 0
        if REGS:
            if not EARLY:
                pa, sa, pb, sb, pc, sc, pd, sd = _ring_start(w, s, nseg2, IS_NV, BN2, REGS,
                                                             num_warps, EVICT, TILED)
            acc = _k_loop_regs(w, s, pa, sa, pb, sb, pc, sc, pd, sd, smax, a_rows, amask, nseg2,
                               IS_NV, BN2, REGS, num_warps, EVICT, TILED)
        else:
            acc, unused = _k_loop(w, s, nmask, smax, w, s, nmask, smax, a_rows, amask, nseg2,
                                  IS_NV, BN2, 1, STAGES, NSPS2, ASM, num_warps, ACC_SCALE)
        _stamp(stamps_ptr, ticket, 3, num_warps)
        wt = gl.load(topk_w_ptr + p).to(gl.float32)
        y = _undo_scales(acc, smax, g2_ptr, e, IS_NV, ACC_SCALE) * wt
        gl.store(_pair_tile(ypair_ptr, sp * P + p, stride_y, offs_h, m), y, mask=col[None, :])
    cta_barrier()
    done = gl.atomic_add(ctr_ptr + 1 + P + pn, 1, sem="acq_rel", scope="gpu")
    if done == P * SPLIT2 - 1:                # the last of this row tile's down tiles
        _sum_pairs(gl.zeros([BN2, BM], gl.float32, layout=MMA), ypair_ptr, ids_ptr, out_ptr,
                   offs_h, m, P, T, TOPK, SPLIT2, stride_y, stride_out)
    _stamp(stamps_ptr, ticket, 4, num_warps)


@gluon.jit
def _decode_kernel(xp_ptr, w13_ptr, s13_ptr, g13_ptr, w2_ptr, s2_ptr, g2_ptr, ids_ptr, topk_w_ptr,
                   act_ptr, part_ptr, ypair_ptr, out_ptr, ctr_ptr, stamps_ptr, P, T, TOPK, I, H,
                   stride_xt, stride_w13e, stride_w13n, stride_s13e, stride_s13n, stride_w2e,
                   stride_w2n, stride_s2e, stride_s2n, stride_act, stride_part, stride_y,
                   stride_out, swiglu_limit, IS_NV: gl.constexpr, HAS_LIMIT: gl.constexpr,
                   BN1: gl.constexpr, BN2: gl.constexpr, SPLIT1: gl.constexpr,
                   SPLIT2: gl.constexpr, STAGES: gl.constexpr, NSPS1: gl.constexpr,
                   NSPS2: gl.constexpr, PREFETCH: gl.constexpr, ASM: gl.constexpr,
                   num_warps: gl.constexpr, ACC_SCALE: gl.constexpr = False,
                   PDL: gl.constexpr = False, REGS: gl.constexpr = 0, EVICT: gl.constexpr = False,
                   EARLY: gl.constexpr = True, TILED: gl.constexpr = False):
    """The whole MoE of a few tokens (T <= BM) in one launch, without grouping: every
    (token, slot) pair is its own block of one token, in column t of the mma tile.

    Tiles are handed out in the order programs start (a ticket counter), gate/up tiles
    first, pair by pair, then the down tiles, pair by pair: a program that waits only ever
    waits for tiles already handed to running programs, so the launch cannot deadlock
    whatever order the hardware starts programs in. Counters (ctr_ptr, zeroed by the
    launcher): [0] the ticket; [1 + p] pair p's finished gate/up row tiles; [1 + P + n] the
    finished down tiles of hidden rows n * BN2 ...; [1 + P + H / BN2 + g] the finished K
    slices of gate/up row tile g (split-K only).
    - a gate/up tile: BN1 gate and the BN1 matching up rows of pair p's expert over a K
      slice of H; split over K (SPLIT1), fp32 partials, the last slice to finish sums them
      in order; then the SwiGLU, act[p] stored in sigma's order (fp16 times 2**-8), released;
    - a down tile: BN2 rows of pair p's down projection over a K slice of I (their bytes
      prefetched to L2 while it waits for act[p]), times the routing weight, stored to
      ypair[slice, p]; the last of the P * SPLIT2 tiles of those rows to finish sums ypair
      over the pairs and slices in order and writes out.
    ``ACC_SCALE``: the K loops apply the block scales to the accumulator (see :func:`_k_loop`;
    ASM = CVT8_RAW_ASM): row n of x's buffers holds the token's elements of scale block n.
    ``PDL``: launched as a programmatic dependent launch of the kernel that copies x and zeroes
    the counters; every program waits for that kernel before its ticket.
    ``REGS`` (2 or 4; 0: the shared-memory ring): the K loops read their bytes into registers,
    REGS K-steps in flight (:func:`_k_loop_regs`), and a gate/up tile runs its BN1 gate and
    BN1 up rows as one matrix of 2 BN1 rows. ``EARLY`` (REGS): a down tile requests its ring's
    first REGS K-steps before it waits for its activations (otherwise after).
    ``EVICT`` (REGS): see :func:`fused_moe`. ``TILED`` (REGS; 1 the weights, 2 the weights and
    scales): in :func:`pack_tile_major`'s layout."""
    MMA: gl.constexpr = _mma_layout(num_warps)
    COLS: gl.constexpr = gl.SliceLayout(0, MMA)
    ROWS: gl.constexpr = gl.SliceLayout(1, MMA)
    n_tiles1 = I // BN1
    n_tiles2 = H // BN2
    n_gu = P * n_tiles1 * SPLIT1
    nseg1 = H // 128 // SPLIT1
    nseg2 = I // 128 // SPLIT2
    tile = _ticket(ctr_ptr, stamps_ptr, PDL, num_warps)
    m = gl.arange(0, BM, layout=COLS)
    if tile < n_gu:
        _gate_up_tile(xp_ptr, w13_ptr, s13_ptr, g13_ptr, ids_ptr, act_ptr, part_ptr, ctr_ptr,
                      stamps_ptr, tile, m, P, TOPK, I, n_tiles1, n_tiles2, nseg1, stride_xt,
                      stride_w13e, stride_w13n, stride_s13e, stride_s13n, stride_act,
                      stride_part, swiglu_limit, IS_NV, HAS_LIMIT, BN1, SPLIT1, STAGES, NSPS1,
                      ASM, num_warps, ACC_SCALE, REGS, EVICT, TILED)
    else:
        _down_tile(tile - n_gu, tile, w2_ptr, s2_ptr, g2_ptr, ids_ptr, topk_w_ptr, act_ptr,
                   ypair_ptr, out_ptr, ctr_ptr, stamps_ptr, m, P, T, TOPK, H, n_tiles1, n_tiles2,
                   nseg2, stride_w2e, stride_w2n, stride_s2e, stride_s2n, stride_act, stride_y,
                   stride_out, IS_NV, BN2, SPLIT2, STAGES, NSPS2, PREFETCH, ASM, num_warps,
                   ACC_SCALE, REGS, EVICT, EARLY, TILED)


def supported(x, H: int, I: int, tensors=()) -> str | None:
    """None if these kernels run here, else why not (a capability check, no launch).
    ``tensors``: the weights and scales, whose storage must be 16-byte aligned."""
    if interpreting():
        return "Gluon kernels do not run in Triton's interpreter"
    why = gluon_unsupported()
    if why is not None:
        return why
    if x.device.type != "cuda":
        return "needs a CUDA GPU"
    if torch.cuda.get_device_capability(x.device) < (8, 0):
        return "mma.sync with fp16 operands needs sm_80 or newer"
    if H % 512 or I % 512:   # scale rows (H/32, I/32 bytes) must stay 16-byte aligned for cp.async
        return f"hidden and intermediate sizes must be multiples of 512 (got {H}, {I})"
    if any(t.data_ptr() % 16 for t in tensors):
        return "the weights and scales must start 16-byte aligned"
    return None


def fused_moe(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, *, fmt="mxfp4",
              w13_global=None, w2_global=None, swiglu_limit=None, BN1=64, BN2=64, SPLIT1=1,
              SPLIT2=1, STAGES=4, NSPS=1, STAGES2=None, NSPS2=None, num_warps=4, FUSED=False,
              PREFETCH=True, CVT8=None, ACC_SCALE=False, PDL=None, REGS=0, MAXNREG=None,
              EVICT=False, EARLY=True, TILED=False, SIMT=False):
    """The grouped FP4 MoE with these GEMMs (arguments as ``moe.fused_moe``, already checked):
    grouping, x's copy in sigma's order, gate/up (+ the split-K SwiGLU sum), down, combine.
    With ``FUSED`` and at most BM (8) tokens: x's copy, then everything else in one launch
    (:func:`_decode_kernel`; STAGES2 unused, PREFETCH: the down tiles' L2 prefetch).
    ``CVT8``: the decode (None: CVT8_ASM on sm_89+, FASTDEC's elsewhere; True / False force).
    ``ACC_SCALE`` (the fused launch only; sm_89+, the CVT8 decode): the block scales on the
    accumulator instead of on every decoded weight (see :func:`_step_acc_scale`); None: where
    it can run, else not.
    ``PDL`` (the fused launch only): x's copy also zeroes the launch's counters, and the launch
    is its programmatic dependent launch, so its programs are scheduled while the copy runs
    (None: where :func:`dsv4lab.kernels.device.pdl_ok`, sm_90+; False: two plain launches).
    ``REGS`` (0, 2 or 4; the fused launch only; sm_89+, the CVT8 decode, not with ACC_SCALE):
    the K loops without shared memory, REGS K-steps in flight (see :func:`_k_loop_regs`;
    STAGES and NSPS unused); 0: the shared-memory ring; None: 4 where it can run (sm_89+, the
    CVT8 decode, ACC_SCALE off once resolved), else 0.
    ``MAXNREG`` (the fused launch only): a register cap for its programs (Triton's ``maxnreg``):
    with REGS, programs an SM are bounded by registers.
    ``EVICT`` (REGS only): the register ring loads the weights and scales with an L2
    evict-first policy instead of ``.cg``, so that bytes read once do not push the L2's other
    lines out (a dirty line pushed out is a write to HBM); None: on wherever REGS is.
    ``EARLY`` (REGS only): a down tile's first ring loads go out before its wait for the
    activations (see :func:`_decode_kernel`).
    ``TILED`` (the fused launch with REGS only): w13, w2 and their scales are in
    :func:`pack_tile_major`'s layout (the caller packed them once), not the canonical one;
    ``"weights"``: the weights only (``pack_tile_major(..., scales=False)``).
    ``SIMT`` (True, or a dict of :func:`dsv4lab.kernels.moe_simt.fused_decode`'s launch
    keywords): that one-launch decode instead (GEMVs on the CUDA cores; FUSED, at most 8
    tokens, the canonical layout; PDL is passed on, the other keys here are unused: its tiles
    are its own); None: that decode where :func:`dsv4lab.kernels.moe_simt.supported` (hidden
    and intermediate sizes multiples of 2048), else the one the other keys name.
    No host synchronisation."""
    from dsv4lab.kernels import moe as base
    T, H = x.shape
    E, two_i, _ = w13.shape
    I = two_i // 2
    topk = topk_ids.shape[1]
    P = T * topk
    if REGS not in (None, 0, 2, 4):
        raise ValueError(f"moe_mma2: REGS must be 0, 2 or 4 (K-steps in flight), got {REGS!r}")
    if REGS and ACC_SCALE:
        raise ValueError("moe_mma2: REGS and ACC_SCALE do not combine (ACC_SCALE's x rows are "
                         "per scale block; REGS reads x as the token's row)")
    if TILED not in (False, True, "weights"):
        raise ValueError(f"moe_mma2: TILED must be False, True or 'weights', got {TILED!r}")
    # the layouts the call reads against the ones pack_tile_major marked (same shapes otherwise)
    for name, t, packed in (("w13", w13, bool(TILED)), ("w2", w2, bool(TILED)),
                            ("w13_scale", w13_scale, TILED is True),
                            ("w2_scale", w2_scale, TILED is True)):
        if bool(getattr(t, base.TILE_MAJOR_MARK, False)) != packed:
            raise ValueError(f"moe_mma2: TILED={TILED!r} reads {name} in the "
                             f"{'packed' if packed else 'canonical'} layout, and it is in the "
                             f"{'canonical' if packed else 'packed'} one (pack_tile_major)")
    if SIMT is not False:
        from dsv4lab.kernels import moe_simt
        if SIMT is None:
            SIMT = FUSED and not TILED and moe_simt.supported(
                x, H, I, T, (w13, w13_scale, w2, w2_scale)) is None
    if SIMT:
        if not FUSED or TILED:
            raise ValueError(f"moe_mma2: SIMT is a one-launch decode (FUSED) of the canonical "
                             f"layout; got FUSED={FUSED!r}, TILED={TILED!r}")
        return moe_simt.fused_decode(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights,
                                     fmt=fmt, w13_global=w13_global, w2_global=w2_global,
                                     swiglu_limit=swiglu_limit,
                                     **{"PDL": PDL, **(SIMT if isinstance(SIMT, dict) else {})})
    if TILED and (not FUSED or T > int(BM) or REGS == 0):
        raise ValueError("moe_mma2: TILED weights are read by the fused launch's register ring "
                         f"only (FUSED, at most {int(BM)} tokens, REGS 2, 4 or None); got "
                         f"FUSED={FUSED!r}, T={T}, REGS={REGS!r}")
    if EVICT and REGS == 0:
        raise ValueError("moe_mma2: EVICT applies to REGS's loads (cp.async takes no L2 policy "
                         "here); give REGS 2 or 4, or None where it resolves to them")
    why = supported(x, H, I, (w13, w13_scale, w2, w2_scale))
    if why is not None:
        raise ValueError(f"moe_mma2: {why}")
    # ACC_SCALE's and REGS's decodes convert fp8 (cvt.f16x2.e5m2x2: sm_89+)
    cvt8_ok = CVT8 is not False and torch.cuda.get_device_capability(x.device) >= (8, 9)
    if ACC_SCALE is None:
        ACC_SCALE = cvt8_ok
    if ACC_SCALE and not cvt8_ok:
        raise ValueError("moe_mma2: ACC_SCALE decodes with CVT8_RAW_ASM, which needs sm_89 or "
                         "newer (cvt.f16x2.e5m2x2) and CVT8 not False")
    if REGS is None:      # the register ring where its decode runs, else shared memory
        REGS = 4 if cvt8_ok and not ACC_SCALE else 0
    if TILED and not REGS:
        raise ValueError("moe_mma2: TILED weights are read by the register ring only, and REGS "
                         "resolved to 0 here (the GPU does not convert fp8, or ACC_SCALE is on)")
    if REGS and not cvt8_ok:
        raise ValueError("moe_mma2: REGS decodes with CVT8_WORD_ASM, which needs sm_89 or newer "
                         "(cvt.f16x2.e5m2x2) and CVT8 not False")
    if EVICT is None:     # evict-first where the register ring loads the weights
        EVICT = bool(REGS)
    if EVICT and not REGS:
        raise ValueError("moe_mma2: EVICT applies to REGS's loads, and REGS resolved to 0 here "
                         "(the GPU does not convert fp8, or ACC_SCALE is on)")
    # a warp's mma rows: 16. REGS's fused gate/up tile runs its BN1 gate and BN1 up rows as one
    # matrix of 2 BN1 rows and splits it on its top row bit, which must be a register bit of the
    # accumulator: the mma's own (rows g and g + 8: BN1 8, one warp) or a repetition over the
    # warps (2 BN1 >= 32 num_warps); with BN1 8 num_warps and more warps it is a warp's bit,
    # which no compile can split
    low1 = 8 if REGS and FUSED and T <= int(BM) and num_warps == 1 else 16 * num_warps
    for name, v, low in (("BN1", BN1, low1), ("BN2", BN2, 16 * num_warps)):
        if v < low or v & (v - 1):
            raise ValueError(f"moe_mma2: {name} must be a power of two >= {low} with num_warps "
                             f"{num_warps}, got {v}")
    if P == 0:
        return torch.zeros(T, H, dtype=x.dtype, device=x.device)
    is_nv = fmt == "nvfp4"
    dev = x.device
    x = x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    w13_scale, w2_scale = w13_scale.contiguous(), w2_scale.contiguous()
    if is_nv:
        w13_scale, w2_scale = w13_scale.view(torch.uint8), w2_scale.view(torch.uint8)
    ids = topk_ids.contiguous()
    tw = topk_weights.reshape(-1).contiguous()
    if FUSED and T <= int(BM):
        for name, v, n in (("BN1", BN1, I), ("BN2", BN2, H)):
            if n % v:
                raise ValueError(f"moe_mma2: {name} ({v}) must divide {n}")
    nsps1 = base._pick_split(H // 128, NSPS)
    nsps2 = base._pick_split(I // 128, NSPS if NSPS2 is None else NSPS2)
    split1 = base._pick_split(H // 128 // nsps1, SPLIT1)
    split2 = base._pick_split(I // 128 // nsps2, SPLIT2)
    xp = torch.empty(T, H, dtype=torch.float16, device=dev)     # x in sigma's order (P > 0: T > 0)
    BX = min(1024, triton.next_power_of_2(max(1, H // 2)))
    if FUSED and T <= int(BM):
        pdl_able = pdl_ok(dev)
        pdl = pdl_able if PDL is None else bool(PDL)
        if pdl and not pdl_able:
            raise ValueError("moe_mma2: PDL needs sm_90 or newer (griddepcontrol)")
        # the ticket, one count a pair, one a down row tile, one a gate/up row tile (see
        # _decode_kernel), zeroed by x's copy
        counters = torch.empty(1 + P + H // BN2 + P * (I // BN1), dtype=torch.int32, device=dev)
        base._moe_xpre_zero_kernel[(T, triton.cdiv(H // 2, BX))](
            x, xp, counters, counters.numel(), H // 2, x.stride(0), xp.stride(0), BH=BX, PDL=pdl,
            num_warps=4)
        return _fused_decode(xp, T, w13, w13_scale, w2, w2_scale, ids, tw, is_nv, w13_global,
                             w2_global, swiglu_limit, x.dtype, BN1, BN2, split1, split2, STAGES,
                             nsps1, nsps2, PREFETCH, num_warps, CVT8, ACC_SCALE, counters, pdl,
                             int(REGS), MAXNREG, bool(EVICT), bool(EARLY),
                             1 if TILED == "weights" else 2 if TILED else 0)
    base._moe_xpre_kernel[(T, triton.cdiv(H // 2, BX))](x, xp, H // 2, x.stride(0), xp.stride(0),
                                                       BH=BX, PLANES=2, SEG=True, num_warps=4)
    sorted_pair, block_expert, block_start, block_count = base.moe_align(ids, E, int(BM))
    nbm = block_expert.numel()
    act = torch.empty(P, I, dtype=torch.float16, device=dev)
    part = torch.empty(split1, P, 2 * I, dtype=torch.float32, device=dev) if split1 > 1 else act
    ypair = torch.empty(split2, P, H, dtype=torch.float32, device=dev)
    g13 = w13_global.contiguous() if is_nv else ypair
    g2 = w2_global.contiguous() if is_nv else ypair
    limit = float(swiglu_limit) if swiglu_limit is not None else 0.0
    asm = _decode_asm(dev, CVT8)
    _gate_up_kernel[(nbm, triton.cdiv(I, BN1), split1)](
        xp, w13, w13_scale, g13, sorted_pair, block_expert, block_start, block_count, part,
        I, topk, H // 128 // split1, xp.stride(0), w13.stride(0), w13.stride(1),
        w13_scale.stride(0), w13_scale.stride(1), part.stride(-2), part.stride(0) if split1 > 1 else 0,
        limit, IS_NV=is_nv, HAS_LIMIT=swiglu_limit is not None, PARTIAL=split1 > 1, BN=BN1,
        STAGES=STAGES, NSPS=nsps1, ASM=asm, num_warps=num_warps)
    if split1 > 1:
        BI = max(16, min(triton.next_power_of_2(I), 4096 // int(BM)))
        base._moe_swiglu_kernel[(nbm, triton.cdiv(I, BI))](
            part, act, block_expert, block_start, block_count, I, part.stride(0), part.stride(1),
            act.stride(0), limit, HAS_LIMIT=swiglu_limit is not None, XPRE=True, SPLIT=split1,
            BM=int(BM), BI=BI, SEG=True, num_warps=4)
    _down_kernel[(nbm, triton.cdiv(H, BN2), split2)](
        act, w2, w2_scale, g2, tw, sorted_pair, block_expert, block_start, block_count, ypair,
        H, I // 128 // split2, act.stride(0), w2.stride(0), w2.stride(1), w2_scale.stride(0),
        w2_scale.stride(1), ypair.stride(1), ypair.stride(0), IS_NV=is_nv, BN=BN2,
        STAGES=STAGES if STAGES2 is None else STAGES2, NSPS=nsps2, ASM=asm, num_warps=num_warps)
    out = torch.empty(T, H, dtype=x.dtype, device=dev)
    BH = min(1024, triton.next_power_of_2(H))
    base._moe_combine_kernel[(T, triton.cdiv(H, BH))](
        ypair, ids, out, H, E, ypair.stride(1), ypair.stride(0), out.stride(0),
        TOPK=topk, SPLIT=split2, BH=BH, num_warps=4)
    return out


def _fused_decode(xp, T, w13, w13_scale, w2, w2_scale, ids, tw, is_nv, w13_global, w2_global,
                  swiglu_limit, out_dtype, BN1, BN2, split1, split2, STAGES, nsps1, nsps2,
                  PREFETCH, num_warps, CVT8, ACC_SCALE, counters, pdl, regs=0, maxnreg=None,
                  evict=False, early=True, tiled=0):
    """:func:`_decode_kernel` on x's copy ``xp`` and its zeroed ``counters`` (T <= BM tokens;
    the splits already picked); ``pdl``: as the copy's programmatic dependent launch."""
    H = xp.shape[1]
    I = w13.shape[1] // 2
    P = ids.numel()
    dev = xp.device
    act = torch.empty(P, I, dtype=torch.float16, device=dev)
    part = torch.empty(split1 * P, 2 * I, dtype=torch.float32, device=dev) if split1 > 1 else act
    ypair = torch.empty(split2 * P, H, dtype=torch.float32, device=dev)
    out = torch.empty(T, H, dtype=out_dtype, device=dev)
    g13 = w13_global.contiguous() if is_nv else ypair
    g2 = w2_global.contiguous() if is_nv else ypair
    grid = (P * (I // BN1) * split1 + P * (H // BN2) * split2,)
    stamps = counters
    if TIMELINE:
        stamps = torch.zeros(grid[0], 8, dtype=torch.int64, device=dev)
        _LAST_TIMELINE[:] = [stamps, P * (I // BN1) * split1]
    _decode_kernel[grid](
        xp, w13, w13_scale, g13, w2, w2_scale, g2, ids, tw, act, part, ypair, out, counters,
        stamps, P, T,
        ids.shape[1], I, H, xp.stride(0), w13.stride(0), w13.stride(1), w13_scale.stride(0),
        w13_scale.stride(1), w2.stride(0), w2.stride(1), w2_scale.stride(0), w2_scale.stride(1),
        act.stride(0), part.stride(0), ypair.stride(0), out.stride(0),
        float(swiglu_limit) if swiglu_limit is not None else 0.0, IS_NV=is_nv,
        HAS_LIMIT=swiglu_limit is not None, BN1=BN1, BN2=BN2, SPLIT1=split1, SPLIT2=split2,
        STAGES=STAGES, NSPS1=nsps1, NSPS2=nsps2, PREFETCH=PREFETCH,
        ASM=CVT8_RAW_ASM if ACC_SCALE else _decode_asm(dev, CVT8), num_warps=num_warps,
        ACC_SCALE=bool(ACC_SCALE), PDL=pdl, REGS=regs, EVICT=evict, EARLY=early, TILED=tiled,
        launch_pdl=pdl,
        **({} if maxnreg is None else {"maxnreg": int(maxnreg)}))
    return out


def pack_tile_major(w: torch.Tensor, scale: torch.Tensor, fmt: str = "mxfp4", *,
                    scales: bool = True):
    """Packed FP4 weights [E, N, K / 2] and their block scales [E, N, K / block] (the canonical
    layout) -> the same tensors (shapes, dtypes) laid out for the fused decode's register ring
    (``TILED``): per expert, per group of 16 rows, per K-step of 128 elements, the 16 rows'
    64 bytes one after the other (and their scales alike, 4 or 8 a row a step): a warp's
    load of a K-step then reads 512 contiguous bytes instead of 64 from each of 8 rows
    (``scales=False``: the scales stay as they are, for ``TILED="weights"``). Done once, when
    the weights are loaded (a copy of them). Explained in notebooks/04_mxfp4_moe_port.ipynb."""
    from dsv4lab.kernels import moe as base
    GS = 16 if fmt == "nvfp4" else 32
    if w.dim() != 3 or scale.dim() != 3 or w.dtype != torch.uint8:
        raise ValueError(f"pack_tile_major: w must be uint8 [E, N, K/2] and scale [E, N, K/{GS}], "
                         f"got {w.dtype} {tuple(w.shape)} and {tuple(scale.shape)}")
    if any(getattr(t, base.TILE_MAJOR_MARK, False) for t in (w, scale)):
        raise ValueError("pack_tile_major: w or scale is already in the packed layout (packing "
                         "it again would scramble it)")
    E, N, half_k = w.shape
    if N % 16 or half_k % 64 or tuple(scale.shape) != (E, N, 2 * half_k // GS):
        raise ValueError(f"pack_tile_major: rows N ({N}) must be a multiple of 16 and K ({2 * half_k}) "
                         f"of 128, scale [E, N, K/{GS}] = {(E, N, 2 * half_k // GS)}, got "
                         f"{tuple(scale.shape)}")
    kst = half_k // 64

    def tiles(t, per_step):
        t = (t.reshape(E, N // 16, 16, kst, per_step).permute(0, 1, 3, 2, 4).contiguous()
             .reshape(E, N, kst * per_step))
        setattr(t, base.TILE_MAJOR_MARK, True)   # what the kernels check the call against
        return t
    return tiles(w, 64), (tiles(scale, 128 // GS) if scales else scale)


def timeline() -> tuple[torch.Tensor, int]:
    """TIMELINE: the last fused launch's stamps, int64 [tiles, 8] (columns: TIMELINE_POINTS;
    ns, but "sm"; 0 where a tile skipped a point), and how many of the tiles are gate/up."""
    if not TIMELINE or not _LAST_TIMELINE:
        raise RuntimeError("timeline: set DSV4LAB_MOE_TIMELINE=1 before importing "
                           "dsv4lab.kernels.moe_mma2, then run a FUSED launch")
    return _LAST_TIMELINE[0], _LAST_TIMELINE[1]
