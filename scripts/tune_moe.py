"""One GPU sweep of the Triton FP4 MoE's variants at DeepSeek-V4-Flash's shape.

    python3 scripts/tune_moe.py                # on the GPU: < 100 s incl. compiles
    python3 scripts/tune_moe.py --dry-run      # tiny shape in the interpreter (CPU smoke)

For every candidate config (tile sizes BM/BN/BK, split-K of the down projection,
tensor-core dot vs CUDA-core multiply-reduce for tiny M, the swap-AB dot, num_warps,
num_stages), both
formats and T in {1, 64} (then 8, 256 while the time budget lasts): CUDA-graph time,
fraction of the FP4-bytes roofline, and a check against the fp32 torch reference (a
wrong variant is flagged WRONG and never ranked). Candidates run in priority order; when
the budget (--budget, seconds since start) runs out the rest are skipped, so the script
always finishes in time. Prints a compact ranked table; writes every row to
$OUT/tune_moe.json (or ./tune_moe.json without $OUT). Winners go into
``CONFIGS`` in kernels/moe.py.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

T0 = time.time()

import dsv4lab  # noqa: E402,F401  (sets TRITON_INTERPRET before triton is imported on a CPU)
import torch  # noqa: E402

from dsv4lab import bench, runtime  # noqa: E402
from dsv4lab.benchmarks.moe import (FLASH, _quantised_experts, _random_experts, fp4_bytes,  # noqa: E402
                                    experts_for, token_case)
from dsv4lab.kernels import moe as kmoe  # noqa: E402
from dsv4lab.ops import fused_moe  # noqa: E402

LIMIT = 10.0
TOL = 1.2e-2          # x is bf16-valued and the output is bf16: as tests/test_moe.py

# every key explicit (kernels/moe.py PLAIN, the former default, at BN 32/32): a candidate
# overrides config_for()'s entries, so it must not inherit the promoted decode switches
BASE = dict(kmoe.PLAIN, BN1=32, BN2=32)


def _c(**kw):
    return dict(BASE, **kw)


def _fused(**launch):
    """A candidate running kernels/moe_mma2.py's one-launch decode with these launch keys."""
    return _c(MMA2=dict(FUSED=True, **launch))


# priority order: the most informative first (the budget may cut the tail)
CANDIDATES = [
    # XPRE (pre-split fp16 x/act, pipelined), BK 128 (half the registers), SPLIT1 (split-K of
    # gate/up), ROWMAX (MXFP4 dots chained), with FASTDEC: see "What limits the loop" in
    # kernels/moe.py (untimed so far)
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=64),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=64, BK1=128, BK2=128),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=64, BK1=128, BK2=128, SPLIT1=2, SPLIT2=2),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=64, BK1=128, BK2=128, SPLIT1=4, SPLIT2=4),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=64, BK1=128, BK2=128, SPLIT1=2, SPLIT2=2, ROWMAX=True),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=64, BK1=128, BK2=128, SPLIT1=4, SPLIT2=4, ROWMAX=True),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=64, BK1=128, BK2=128, SPLIT1=2, SPLIT2=2, num_stages=4),
    _c(FASTDEC=True, XPRE=True, BN1=32, BN2=64, BK1=128, BK2=128, SPLIT1=2, SPLIT2=2),
    _c(FASTDEC=True, XPRE=True, BN1=128, BN2=128, BK1=64, BK2=64, SPLIT1=2, SPLIT2=2),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=64, BK1=128, BK2=128, num_warps=8),
    _c(XPRE=True, BN1=64, BN2=64, BK1=128, BK2=128, SPLIT1=2, SPLIT2=2),
    # round 3: a register cap (MXFP4 gate/up 150 -> 128: 4 programs an SM), wider gate/up
    # tiles at BK 128, ROWMAX without split-K (117 registers)
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=64, BK1=128, BK2=128, MAXNREG=128),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=64, BK1=128, BK2=128, SPLIT1=2, SPLIT2=2, MAXNREG=128),
    _c(FASTDEC=True, XPRE=True, BN1=128, BN2=64, BK1=128, BK2=128),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=64, BK1=128, BK2=128, ROWMAX=True),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=64, BK1=128, BK2=128, ROWMAX=True, MAXNREG=96),
    # round 4: FOLD (combine in the down kernel, SwiGLU sum in gate/up, one prologue
    # launch: 3 launches at T = 1) and candidates around the T = 64 MXFP4 best
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=64, BK1=128, BK2=128, SPLIT1=2, SPLIT2=2, FOLD=True),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=64, BK1=128, BK2=128, SPLIT1=2, SPLIT2=2, MAXNREG=128,
       FOLD=True),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=64, BK1=128, BK2=128, MAXNREG=128, FOLD=True),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=64, BK1=128, BK2=128, MAXNREG=128, num_stages=4),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=128, BK1=128, BK2=128, MAXNREG=128),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=64, BK1=128, BK2=256, MAXNREG=128),
    # FASTDEC alone (decode + block scale in packed inline PTX)
    _c(FASTDEC=True, BN1=64, BN2=64),
    # the 2026-11-29 sweep, in its order (#2 BN64/64 and #6 BN32/64 S2 won: now CONFIGS)
    _c(),
    _c(BN1=16, BN2=16),
    _c(BN1=64, BN2=64),
    _c(USE_DOT=False, BM=1, BK1=128, BK2=128),
    _c(BK1=128, BK2=128),
    _c(BK1=512, BK2=512),
    _c(BN2=64, SPLIT2=2),
    _c(num_warps=8),
    _c(num_stages=1),
    _c(USE_DOT=False, BM=1, BN1=64, BN2=64, BK1=64, BK2=64),
    _c(USE_DOT=False, BM=2, BK1=128, BK2=128),
    _c(BN1=16, BN2=64, SPLIT2=4),
    _c(num_warps=2),
    _c(num_stages=4),
    _c(BM=32, BN1=64, BN2=64, BK1=128, BK2=128),
    _c(USE_DOT=False, BM=1, BN1=16, BN2=16, BK1=256, BK2=256),
    # round 5 (session 3): the CUDA-core path (no M padding to 16) with the round-2 decode
    # (FASTDEC + XPRE) at T = 1, and combinations around the T = 64 MXFP4 best
    _c(USE_DOT=False, BM=1, FASTDEC=True, XPRE=True, BN1=64, BN2=64, BK1=128, BK2=128, SPLIT1=2, SPLIT2=2),
    _c(USE_DOT=False, BM=1, FASTDEC=True, XPRE=True, BN1=32, BN2=32, BK1=128, BK2=128, SPLIT1=2, SPLIT2=2),
    _c(USE_DOT=False, BM=1, FASTDEC=True, XPRE=True, BN1=32, BN2=32, BK1=256, BK2=256, SPLIT1=4, SPLIT2=2),
    _c(USE_DOT=False, BM=1, FASTDEC=True, XPRE=True, BN1=16, BN2=16, BK1=256, BK2=256),
    _c(USE_DOT=False, BM=1, FASTDEC=True, XPRE=True, BN1=64, BN2=64, BK1=128, BK2=128, SPLIT1=2, SPLIT2=2,
       num_warps=8),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=128, BK1=128, BK2=256, MAXNREG=128),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=128, BK1=128, BK2=128, MAXNREG=128, num_stages=4),
    _c(FASTDEC=True, XPRE=True, BN1=32, BN2=128, BK1=128, BK2=128, MAXNREG=128),
    _c(FASTDEC=True, XPRE=True, BN1=32, BN2=64, BK1=128, BK2=128),
    _c(FASTDEC=True, XPRE=True, BN1=128, BN2=128, BK1=128, BK2=128, num_warps=8),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=128, BK1=256, BK2=256, MAXNREG=128),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=128, BK1=128, BK2=128, MAXNREG=128, num_stages=2),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=256, BK1=128, BK2=128, MAXNREG=128, num_warps=8),
    # round 6: ROWMAX with its row max read in one wide load a row (it paid a memory latency
    # per K-step before the first weight byte), deeper pipelines at T = 1 (a program there
    # has 16 K-steps and ~12 warps an SM: latency-bound)
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=64, BK1=128, BK2=128),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=64, BK1=128, BK2=128, ROWMAX=True),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=64, BK1=128, BK2=128, ROWMAX=True, MAXNREG=128),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=128, BK1=128, BK2=128, ROWMAX=True),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=128, BK1=128, BK2=128, ROWMAX=True, num_stages=4),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=128, BK1=128, BK2=128, ROWMAX=True, MAXNREG=128),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=64, BK1=128, BK2=256, ROWMAX=True),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=128, BK1=128, BK2=128, MAXNREG=128),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=64, BK1=128, BK2=128, SPLIT1=2, SPLIT2=2),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=64, BK1=128, BK2=128, SPLIT1=2, SPLIT2=2, ROWMAX=True),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=64, BK1=128, BK2=128, SPLIT1=2, SPLIT2=2, num_stages=4),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=64, BK1=128, BK2=128, SPLIT1=2, SPLIT2=2, num_stages=5),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=64, BK1=128, BK2=128, SPLIT1=2, SPLIT2=2, num_stages=6),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=128, BK1=128, BK2=128, SPLIT1=2, SPLIT2=4, num_stages=4),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=64, BK1=128, BK2=128, SPLIT1=4, SPLIT2=4, num_stages=4),
    _c(FASTDEC=True, XPRE=True, BN1=32, BN2=64, BK1=128, BK2=128, SPLIT1=2, SPLIT2=2, num_stages=5),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=64, BK1=128, BK2=128, SPLIT1=2, SPLIT2=2, ROWMAX=True,
       num_stages=5),
    # swap AB (decoded weights as the dot's A operand, from registers) with the round-2 decode
    _c(FASTDEC=True, XPRE=True, SWAP_AB=True, BN1=64, BN2=64, BK1=128, BK2=128, SPLIT1=2, SPLIT2=2),
    _c(FASTDEC=True, XPRE=True, SWAP_AB=True, BN1=64, BN2=64, BK1=128, BK2=128),
    # round 7, T = 64: the gate/up loop spends ~111 of its ~605 SASS instructions a K-step on
    # register moves that rebuild x's MMA fragments (each reused by only 2 n8 tiles a warp at
    # BN 64 and 4 warps): 2 warps (4 tiles a warp), and around the best MXFP4 row (#58)
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=64, BK1=128, BK2=128, num_warps=2),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=64, BK1=128, BK2=256, ROWMAX=True, num_warps=2),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=64, BK1=128, BK2=256, ROWMAX=True, MAXNREG=128),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=64, BK1=128, BK2=256, ROWMAX=True, num_stages=4),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=64, BK1=128, BK2=256),
    _c(FASTDEC=True, XPRE=True, BN1=32, BN2=64, BK1=128, BK2=128, num_warps=2),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=128, BK1=128, BK2=256, ROWMAX=True),
    _c(FASTDEC=True, XPRE=True, BN1=128, BN2=64, BK1=128, BK2=256, ROWMAX=True, num_warps=8),
    # round 8, T = 64 MXFP4: around the two best rows (#73, #77) of the bench's routing
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=128, BK1=128, BK2=256, ROWMAX=True, MAXNREG=128),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=64, BK1=256, BK2=256, ROWMAX=True, MAXNREG=128),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=64, BK1=128, BK2=256, ROWMAX=True, MAXNREG=160),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=64, BK1=128, BK2=512, ROWMAX=True),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=64, BK1=128, BK2=256, ROWMAX=True, MAXNREG=128,
       num_stages=4),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=32, BK1=128, BK2=256, ROWMAX=True, MAXNREG=128),
    # round 9: W16 (int16 weight words, int32 scale words: the dot's B operand descends from
    # 16/32-bit loads, kWidth 2, no register moves rebuilding x's fragments; sm_90 SASS per
    # K-step: gate/up with ROWMAX 513-546 instructions against 620, down at BK2 256 495 against 635;
    # timed at 6e90014: slower everywhere, e.g. #85 1555.9 vs #77 1052.8 us, #88 83.0 vs #60 68.3)
    _c(FASTDEC=True, XPRE=True, W16=True, BN1=64, BN2=128, BK1=128, BK2=256, ROWMAX=True),
    _c(FASTDEC=True, XPRE=True, W16=True, BN1=64, BN2=64, BK1=128, BK2=256, ROWMAX=True, MAXNREG=128),
    _c(FASTDEC=True, XPRE=True, W16=True, BN1=64, BN2=64, BK1=128, BK2=128, ROWMAX=True),
    _c(FASTDEC=True, XPRE=True, W16=True, BN1=64, BN2=64, BK1=128, BK2=128, SPLIT1=2, SPLIT2=2),
    _c(FASTDEC=True, XPRE=True, W16=True, BN1=64, BN2=64, BK1=128, BK2=128, SPLIT1=2, SPLIT2=2, ROWMAX=True),
    _c(FASTDEC=True, XPRE=True, W16=True, BN1=64, BN2=64, BK1=256, BK2=256),
    _c(FASTDEC=True, XPRE=True, W16=True, BN1=64, BN2=128, BK1=128, BK2=256, ROWMAX=True, num_stages=4),
    _c(FASTDEC=True, XPRE=True, W16=True, BN1=64, BN2=64, BK1=128, BK2=128),
    # round 10, T = 64 MXFP4: NVFP4's T = 64 winner is _FX (BK 256/256, BN 64/64: 987 us against
    # MXFP4's 1029 at 10c5467); ROWMAX at BK1 256 without a register cap, and wider down tiles.
    # Timed at de6a4d8 (H200, this script's routing, --only 77,93-96): #93 1510.8, #94 1515.8,
    # #95 1456.1, #96 1311.3 us against 1054.2 for #77 (the default): all slower
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=128, BK1=256, BK2=256, ROWMAX=True),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=64, BK1=256, BK2=256, ROWMAX=True),
    _c(FASTDEC=True, XPRE=True, BN1=32, BN2=128, BK1=256, BK2=256, ROWMAX=True),
    _c(FASTDEC=True, XPRE=True, BN1=64, BN2=256, BK1=128, BK2=256, ROWMAX=True, num_warps=8),
    # round 11 (session 9), T <= 8: kernels/moe_mma2.py's one-launch decode (FUSED): x's copy,
    # then gate/up, SwiGLU, down and the pairs' sum in one ticketed launch (#97-#104)
    _fused(BN1=64, BN2=64, STAGES=3, NSPS=2),
    _fused(BN1=64, BN2=64, STAGES=3, NSPS=2, PREFETCH=False),
    _fused(BN1=64, BN2=64, STAGES=2, NSPS=4),
    _fused(BN1=64, BN2=64, STAGES=4, NSPS=1),
    _fused(BN1=32, BN2=32, STAGES=3, NSPS=2, num_warps=2),
    _fused(BN1=32, BN2=32, STAGES=4, NSPS=2, num_warps=2),
    _fused(BN1=128, BN2=128, STAGES=2, NSPS=2, num_warps=8),
    _fused(BN1=64, BN2=64, STAGES=2, NSPS=2, NSPS2=4),
    # timed at 8b1b3ec (H200, T = 1 MXFP4): #99 best at 71.6 us, no faster than the grouped
    # kernels (6 launches): ~6 warps an SM hold too few independent chains. Split-K in the
    # same launch (#105-#110: fp32 partials, the last slice of a row tile sums them)
    _fused(BN1=64, BN2=64, SPLIT1=2, SPLIT2=2, STAGES=2, NSPS=2),
    _fused(BN1=64, BN2=64, SPLIT1=4, SPLIT2=2, STAGES=2, NSPS=2),
    _fused(BN1=64, BN2=64, SPLIT1=2, SPLIT2=1, STAGES=2, NSPS=4),
    _fused(BN1=64, BN2=64, SPLIT1=4, SPLIT2=4, STAGES=3, NSPS=1),
    _fused(BN1=32, BN2=32, SPLIT1=2, SPLIT2=2, STAGES=3, NSPS=2, num_warps=2),
    _fused(BN1=64, BN2=64, SPLIT1=8, SPLIT2=4, STAGES=2, NSPS=1),
    # timed at a7450b5 (T = 1 MXFP4): #109 59.2, #110 59.4, #108 61.9, #106 63.3 us; T = 8:
    # 338.6 at best (#105), slower than the grouped kernels. More, smaller slices (#111-#116)
    _fused(BN1=32, BN2=32, SPLIT1=4, SPLIT2=2, STAGES=3, NSPS=2, num_warps=2),
    _fused(BN1=32, BN2=32, SPLIT1=4, SPLIT2=4, STAGES=3, NSPS=1, num_warps=2),
    _fused(BN1=32, BN2=32, SPLIT1=8, SPLIT2=4, STAGES=2, NSPS=1, num_warps=2),
    _fused(BN1=64, BN2=64, SPLIT1=8, SPLIT2=8, STAGES=2, NSPS=1),
    _fused(BN1=64, BN2=64, SPLIT1=16, SPLIT2=8, STAGES=2, NSPS=1),
    _fused(BN1=32, BN2=32, SPLIT1=2, SPLIT2=2, STAGES=4, NSPS=2, num_warps=2),
    # timed at 65c3d15 (T = 1): #111 59.6 / 59.3 us (MXFP4 / NVFP4, promoted), #110 59.3 / 60.6,
    # #109 59.0 / 63.8, #113 62.2. The timeline of #111 (scripts/profile_moe.py --timeline at
    # 47e7f50): 5 tiles an SM (shared memory: 38 KB a tile), 10 warps, the loop at ~2 TB/s.
    # Smaller rings, more tiles an SM (#117-#122)
    _fused(BN1=32, BN2=32, SPLIT1=4, SPLIT2=2, STAGES=2, NSPS=2, num_warps=2),
    _fused(BN1=32, BN2=32, SPLIT1=4, SPLIT2=2, STAGES=2, NSPS=1, num_warps=2),
    _fused(BN1=32, BN2=32, SPLIT1=2, SPLIT2=2, STAGES=2, NSPS=2, num_warps=2),
    _fused(BN1=64, BN2=64, SPLIT1=4, SPLIT2=2, STAGES=2, NSPS=2),
    _fused(BN1=64, BN2=64, SPLIT1=8, SPLIT2=4, STAGES=2, NSPS=2),
    _fused(BN1=32, BN2=32, SPLIT1=4, SPLIT2=2, STAGES=3, NSPS=1, num_warps=2),
    # round 12 (session 11), T = 1: the fused decode's K loops from a register ring (REGS 2 or
    # 4 K-steps deep, no shared memory: programs an SM bounded by registers), over splits,
    # tile heights and warps a program (bench rows at 66860bc: REGS 4 at split 2 / 1, 47.8 us
    # MXFP4, against 54.7 for the shared-memory ring)
    _fused(BN1=32, BN2=32, SPLIT1=2, SPLIT2=1, num_warps=2, REGS=4),
    _fused(BN1=32, BN2=32, SPLIT1=1, SPLIT2=1, num_warps=2, REGS=4),
    _fused(BN1=32, BN2=32, SPLIT1=2, SPLIT2=2, num_warps=2, REGS=4),
    _fused(BN1=32, BN2=32, SPLIT1=4, SPLIT2=1, num_warps=2, REGS=4),
    _fused(BN1=32, BN2=32, SPLIT1=1, SPLIT2=1, num_warps=2, REGS=2),
    _fused(BN1=32, BN2=32, SPLIT1=2, SPLIT2=1, num_warps=2, REGS=2),
    _fused(BN1=16, BN2=16, SPLIT1=2, SPLIT2=1, num_warps=1, REGS=4),
    _fused(BN1=16, BN2=16, SPLIT1=1, SPLIT2=1, num_warps=1, REGS=4),
    _fused(BN1=16, BN2=16, SPLIT1=4, SPLIT2=2, num_warps=1, REGS=4),
    _fused(BN1=16, BN2=32, SPLIT1=2, SPLIT2=1, num_warps=1, REGS=4),
    _fused(BN1=32, BN2=64, SPLIT1=2, SPLIT2=1, num_warps=2, REGS=4),
    _fused(BN1=64, BN2=64, SPLIT1=2, SPLIT2=1, num_warps=4, REGS=4),
    # round 12b: around #123 (47.4 / 52.2 us): a register cap (8 programs an SM at 128, where
    # #123's 142 registers allow 7), taller down tiles, no L2 prefetch for the waiting down tiles
    _fused(BN1=32, BN2=32, SPLIT1=2, SPLIT2=1, num_warps=2, REGS=4, MAXNREG=128),
    _fused(BN1=32, BN2=64, SPLIT1=2, SPLIT2=1, num_warps=2, REGS=4),
    _fused(BN1=16, BN2=32, SPLIT1=2, SPLIT2=1, num_warps=1, REGS=4),
    _fused(BN1=32, BN2=32, SPLIT1=2, SPLIT2=1, num_warps=2, REGS=4, PREFETCH=False),
    _fused(BN1=16, BN2=16, SPLIT1=2, SPLIT2=1, num_warps=1, REGS=4, MAXNREG=128),
    _fused(BN1=32, BN2=32, SPLIT1=2, SPLIT2=1, num_warps=2, REGS=2, MAXNREG=96),
    # round 12c/d (printouts at e934bef and a working tree after it; both codes removed): the
    # 4-deep ring refilled two K-steps at a time (a row's 128 bytes of two steps requested
    # together): MXFP4 48.1-48.2 us against 47.0 for #123 in the same run; x's fragments loaded a
    # K-step ahead (168 registers, 6 programs an SM; capped at 144, 7): 47.0-47.3 against 47.1.
    # round 13 (session 12), T = 1: every gate/up tile runs at once, so the phase lasts one
    # warp's chain of instructions; 16 rows a warp (BN1 8 gate + 8 up, one warp) halves it if
    # twice the warps fit: 83 registers in an offline sm_90 compile (#123: 142), 3072 gate/up
    # tiles against 132 x 23 slots at 88 (80: 25). Printout (a working tree after 974150a):
    # MXFP4 56.3-69.8 us (#146 best) against 47.1 for #123; NVFP4 56.7 against 52.3: the chain
    # is not the bound
    _fused(BN1=8, BN2=16, SPLIT1=2, SPLIT2=1, num_warps=1, REGS=4),
    _fused(BN1=8, BN2=16, SPLIT1=2, SPLIT2=1, num_warps=1, REGS=4, MAXNREG=80),
    _fused(BN1=8, BN2=32, SPLIT1=2, SPLIT2=1, num_warps=1, REGS=4),
    _fused(BN1=8, BN2=16, SPLIT1=1, SPLIT2=1, num_warps=1, REGS=4),
    _fused(BN1=8, BN2=16, SPLIT1=2, SPLIT2=1, num_warps=1, REGS=2),
    _fused(BN1=8, BN2=16, SPLIT1=2, SPLIT2=1, num_warps=1, REGS=4, PREFETCH=False),
    _fused(BN1=8, BN2=16, SPLIT1=2, SPLIT2=2, num_warps=1, REGS=4),
    # round 13b: the weights loaded with an L2 evict-first policy (EVICT), so that streaming
    # them does not evict the L2's dirty lines (each a write-back to HBM). Printout (the same
    # tree): #149 44.8 / 48.4 us (MXFP4 / NVFP4), #148 45.2 / 49.5, #153 45.7 / 50.3, against #123
    # 47.2 / 52.5; split 2 / 2 49.1, REGS 2 52.5, BN2 64 52.4. #149 became the table's entry
    _fused(BN1=32, BN2=32, SPLIT1=2, SPLIT2=1, num_warps=2, REGS=4, EVICT=True),
    _fused(BN1=32, BN2=32, SPLIT1=2, SPLIT2=1, num_warps=2, REGS=4, EVICT=True, PREFETCH=False),
    _fused(BN1=32, BN2=32, SPLIT1=2, SPLIT2=2, num_warps=2, REGS=4, EVICT=True),
    _fused(BN1=32, BN2=32, SPLIT1=2, SPLIT2=1, num_warps=2, REGS=2, EVICT=True),
    _fused(BN1=32, BN2=64, SPLIT1=2, SPLIT2=1, num_warps=2, REGS=4, EVICT=True),
    _fused(BN1=64, BN2=64, SPLIT1=2, SPLIT2=1, num_warps=4, REGS=4, EVICT=True),
    # round 13c: the table's entry after 13b (#149), its ring's first loads issued before the
    # row maxima and a down tile's wait (168 registers offline), with register caps. Printout
    # at 122661b: #149 45.6 / 47.1 us, cap 128 53.5 / 57.4, cap 152 47.0 / 47.3, REGS 2
    # 52.7 / 57.1 (the gate/up half of that ordering was then dropped: moe_mma2 EARLY)
    _fused(BN1=32, BN2=32, SPLIT1=2, SPLIT2=1, num_warps=2, REGS=4, EVICT=True, PREFETCH=False,
           MAXNREG=128),
    _fused(BN1=32, BN2=32, SPLIT1=2, SPLIT2=1, num_warps=2, REGS=4, EVICT=True, PREFETCH=False,
           MAXNREG=152),
    _fused(BN1=32, BN2=32, SPLIT1=2, SPLIT2=1, num_warps=2, REGS=2, EVICT=True, PREFETCH=False),
    # round 14 (session 13; the code is gone): the rings 8 K-steps deep. Printout at 192e46a,
    # MXFP4 / NVFP4: the table's entry 43.9 / 46.8 us; the down tiles' ring 8 deep 45.6 / 54.2;
    # every ring 8 deep (255 registers offline) 58.8 / 57.5, with the down ring 4 57.6 / 57.7.
    # Round 15 (session 13; the code is gone): LINES, a K order in which a warp's load asks for
    # its rows' whole 128-byte lines (lane t at byte 32 t, the sector's other half a step
    # later), after scripts/probe_weight_reads.py had read that way faster. Printout at 088d083:
    # the entry 43.9 / 46.9 us; with LINES 45.0 / 52.1; its split 2 / 2 47.3 / 53.4, split 4 / 1
    # 48.1 / 55.8, BN2 64 49.6 / 58.6, REGS 2 50.4 / 54.0; with the L2 prefetch 45.9 / 47.3.
    # `dsv4lab bench moe` rows at 088d083 (LINES the default): MXFP4 45.0 us against 44.5,
    # NVFP4 52.4 against 46.8 (variant mma2_nolines_t1, the entry without it)
    # round 16 (session 13; the code is gone): BALANCE, the gate/up tiles spread evenly over the
    # SMs (a program beyond its SM's quota of ceil(768 / 132) waited until every gate/up
    # ticket was handed out), after a timeline (profile_moe --timeline at 2efb542) had SMs
    # running 1 to 8 of them, the crowded ones' loops slower (11.8 us at 1 an SM, 17.9 at 8).
    # Printout at b307d7d, MXFP4 / NVFP4: the entry 43.8 / 46.7 us; BALANCE 45.6 / 47.6, with
    # the L2 prefetch 46.9 / 48.3, split 4 / 1 50.0 / 49.9. Its own timeline (no flush, plain
    # calls) ended at 38.7 us, but with 6 programs an SM where the entry's compile holds 8.
    # `dsv4lab bench moe` rows at b307d7d (BALANCE the default): MXFP4 46.1 against 44.7,
    # NVFP4 47.4 against 46.7 (variant mma2_unbalanced_t1)
    # round 17 (session 15; the code is gone): PAIRED, each program a gate/up tile and then a
    # down tile of its pair (768 programs, every SM the same mix of work), its down weights
    # asked of the L2 before the gate/up tile or not. Printout at 87ccf91, MXFP4 / NVFP4: the
    # entry 44.0 / 46.9 us; PAIRED without the prefetch 44.2 / 48.3, with it 48.3 / 49.4, with
    # an evict-last prefetch 49.3 / 50.1 (the prefetched lines evict the L2's dirty ones);
    # split 4 / 2 58.7 / 69.3, BN2 64 unsplit 58.1 / 59.3, without EARLY 48.4 / 50.8
    # round 18 (session 16; the code is gone): RESIDENT, each program staged its down tile's
    # whole K slice in shared memory (cp.async, L2 evict-first), then ran its gate/up tile and
    # that down tile from shared memory. Printouts, MXFP4 / NVFP4: at aa8eb76 (staged before
    # the gate/up tile, x read at each down K-step) the entry 44.0 / 47.0 us, RESIDENT 57.4 /
    # 64.3, BN2 64 split 2 61.8 / 71.0, REGS 2 56.4 / 63.3, BN1 64 4 warps 61.6 / 61.7; at
    # 3f9e073 (staged after the gate/up ring's first loads, x 4 K-steps ahead in registers)
    # the entry 43.8 / 46.7, RESIDENT 57.7 / 68.0, staged first 60.0 / 65.6, 168 registers
    # 59.1 / 63.9, REGS 2 60.2 / 64.2. Timeline at 3f9e073: gate/up ends at 37.1 us (the
    # entry's 27.1), the down loop from shared memory 7.7 us a tile (the entry's 7.9)
    # round 19 (session 16; the code is gone): ACC2, the register ring's odd K-steps into a
    # second accumulator (two interleaved mma chains). Two printouts at a5f5404, MXFP4 /
    # NVFP4: the entry 43.7-43.8 / 46.6-46.7 us; both loops 44.6-44.7 / 53.5; the down loops
    # only 44.4 / 46.7-46.9; the gate/up loops only 44.9-45.1 / 53.8-53.9
    # round 20 (session 16; the code is gone): a down tile waiting only for the activations of
    # its own K slice (one count a pair's slice). Printout at 95a1527, MXFP4 / NVFP4: the entry
    # 43.8 / 46.8 us; SPLIT2 2 51.1 / 55.7 (BN2 32), 44.3 / 54.4 (BN2 64); SPLIT2 4 54.0 /
    # 63.6 (BN2 32), 53.6 / 57.0 (BN2 64)
    # round 21 (session 16): TILED, the weights packed so that a K-step of 16 rows is 1 KB
    # contiguous (moe_mma2.pack_tile_major); a read-only probe of that layout read both phases'
    # rows in 28.5 us against 33.2 (scripts/probe_weight_reads.py, printout at 8703cfc).
    # Printout at eb71511, MXFP4 / NVFP4: the entry 43.8 / 46.8 us; TILED 43.3 / 42.3, without
    # EARLY 44.0 / 43.3, split 4 / 2 47.7 / 46.3, BN2 64 48.3 / 54.5. With the scales tiled too,
    # MXFP4's row maxima read 4 bytes every 64: "weights" keeps them canonical. Printout at
    # d5a2e02: the entry 44.1 / 46.5; TILED 43.5 / 42.5, without EARLY 44.1 / 43.4; "weights"
    # 43.6 / 45.0, without EARLY 44.0 / 45.4 (`dsv4lab bench moe` rows at d5a2e02: variants
    # mma2_tiled_t1 44.1 / 43.0, the default 44.8 / 46.9; that run's mma2_tiled_w_t1 and
    # mma2_late_ring_t1 rows read weights packed twice, fixed at 353d6dc). Against
    # the entry:
    _fused(BN1=32, BN2=32, SPLIT1=2, SPLIT2=1, num_warps=2, REGS=4, EVICT=True, PREFETCH=False),
    _fused(BN1=32, BN2=32, SPLIT1=2, SPLIT2=1, num_warps=2, REGS=4, EVICT=True, PREFETCH=False,
           TILED=True),
    _fused(BN1=32, BN2=32, SPLIT1=2, SPLIT2=1, num_warps=2, REGS=4, EVICT=True, PREFETCH=False,
           TILED=True, EARLY=False),
    _fused(BN1=32, BN2=32, SPLIT1=2, SPLIT2=1, num_warps=2, REGS=4, EVICT=True, PREFETCH=False,
           TILED="weights"),
    _fused(BN1=32, BN2=32, SPLIT1=2, SPLIT2=1, num_warps=2, REGS=4, EVICT=True, PREFETCH=False,
           TILED="weights", EARLY=False),
    # round 22 (session 17; the build is scripts/moe_t1_diagnostics.patch, kept out of the
    # kernel): NOWAIT, a diagnostic build whose down tiles do not wait for their pair's
    # activations (in moe_mma2._down_tile, ``_wait_count(...)`` skipped when an env switch is
    # set: wrong results, flagged WRONG here, timings only), to time what the
    # dependency between the phases costs. Two printouts at a working tree of 076ecea, --only
    # 157,158,160, MXFP4 / NVFP4: #157 44.0 / 46.7 us, NOWAIT 43.2 / 45.5; #158 43.6 / 42.3,
    # NOWAIT 42.6 / 41.5; #160 43.6 / 44.8, NOWAIT 42.8 / 43.6. About 1 us: the wait is not it.
    # round 23 (session 17; scripts/moe_t1_diagnostics.patch): three more diagnostic builds, env
    # switches read at import like TIMELINE, wrong results, timings only; two printouts each at a
    # working tree of 9422d9d, --only 157,158, MXFP4 / NVFP4 (the entry 43.8-44.1 / 46.5-46.9 us, TILED
    # 43.5-43.7 / 42.3-42.7 in the same runs):
    # - LOADS_ONLY: _k_loop_regs's REGS 4 loop kept its ring of weight and scale loads but
    #   xor-folded the words instead of decoding and multiplying them (no x loads, no mma;
    #   offline sm_90 loops 1353 -> 190 and 710 -> 88 instructions, 138 registers). The entry
    #   38.2-38.3 / 42.8, TILED 35.5-35.6 / 35.2-35.4; with NOWAIT too 38.0-38.8 / 41.6-41.8,
    #   35.3 / 34.5-34.6; `profile_moe.py --graph`: decode kernel 34.4 us (against 40.3-40.6).
    #   So the loop's work costs 6-8 us, and with the canonical layout this launch's loads alone
    #   take 38.2 us, above 0.5's 37.8: only the packed layout leaves room (35.5);
    # - RAWDEC: CVT8_WORD_ASM without its four scale multiplies (the loops 1353 -> 911 and
    #   710 -> 499 instructions, 126 registers): the entry 43.9-44.1 / 44.3-44.4, TILED 43.4 /
    #   42.1-42.2. A third fewer loop instructions, no faster for MXFP4: the work's cost is not
    #   in proportion to its instructions;
    # - NOX: x's fragments not loaded (constants in the B operand; 127 registers): the entry
    #   47.5-47.6 / 45.6-45.9, TILED 46.3-46.4 / 40.8-41.0. Not x's loads either; the schedule
    #   ptxas makes of a step (where the refills land among the decode and the mma) changes with
    #   each of these builds, and with it the time.
    # round 24 (session 18; the code is gone): PRE, the fused launch's counters left zero by each
    # launch (its last program reset them; one set a device) instead of zeroed by x's copy, so
    # that only the gate/up tiles waited for the copy (PDL), just before their K loops: tickets
    # taken as the programs start, routing, MXFP4 row maxima and the ring's first loads under
    # the copy. Printout at a79ad12 (--only 157,158 and PRE's four), MXFP4 / NVFP4: #157 46.1 /
    # 49.3 us, TILED 45.5 / 44.6; PRE 46.5 / 50.3, PRE with TILED 44.9 / 44.2, PRE without
    # EARLY 46.4 / 50.7, PRE at SPLIT1 4 50.5 / 51.9. A same-process A/B at a79ad12 (a one-off
    # script, which scripts/ab_moe_t1.py replaced; two graph timings each): b6740c2's kernel 44.7-45.6 / 47.7-49.8, the reset counters 46.0-46.2 /
    # 48.3-48.5, PRE 46.1 / 49.1-49.2, TILED 45.1 / 43.9, TILED with PRE 44.5-44.6 / 43.5. No
    # gain outside the run-to-run spread (~1 us) but TILED's ~0.5, against a counter set that
    # two streams must not share: not kept. The device's compile (its registers read from the
    # compiled kernel): 148 registers (b6740c2, MXFP4; 7 programs an SM), NVFP4 166 (6);
    # MAXNREG 128 spills (4 / 24 words) and runs 51.5 / 58.1 us. Reproduced at 76cbdd1 by
    # `python3 scripts/ab_moe_t1.py '{"TILED": true}' '{"MAXNREG": 128}'`: the entry 44.2-44.8 /
    # 46.2-46.9 us at 148 / 166 registers, TILED 43.7-43.8 / 42.6-42.8, MAXNREG 128 50.0-50.2 /
    # 57.2-57.4.
    # round 25 (session 18): round 12's geometries again with the entry's switches since
    # (EVICT, no L2 prefetch, EARLY): fewer gate/up tiles (SPLIT1 1: 384, so that more down
    # tiles are resident, their first loads issued, when the pairs complete), taller or split
    # down tiles, programs of 1 and 4 warps. Against #157:
    _fused(BN1=32, BN2=32, SPLIT1=1, SPLIT2=1, num_warps=2, REGS=4, EVICT=True, PREFETCH=False),
    _fused(BN1=32, BN2=64, SPLIT1=1, SPLIT2=1, num_warps=2, REGS=4, EVICT=True, PREFETCH=False),
    _fused(BN1=32, BN2=64, SPLIT1=2, SPLIT2=1, num_warps=2, REGS=4, EVICT=True, PREFETCH=False),
    _fused(BN1=32, BN2=32, SPLIT1=2, SPLIT2=2, num_warps=2, REGS=4, EVICT=True, PREFETCH=False),
    _fused(BN1=64, BN2=64, SPLIT1=2, SPLIT2=1, num_warps=4, REGS=4, EVICT=True, PREFETCH=False),
    _fused(BN1=16, BN2=32, SPLIT1=2, SPLIT2=1, num_warps=1, REGS=4, EVICT=True, PREFETCH=False),
    _fused(BN1=16, BN2=16, SPLIT1=2, SPLIT2=1, num_warps=1, REGS=4, EVICT=True, PREFETCH=False),
    # Printout at 34e7451, MXFP4 / NVFP4: #157 44.3-44.4 / 47.0-47.1 us (two runs); SPLIT1 1 58.8
    # / 58.6, with BN2 64 64.1 / 56.8; BN2 64 49.8 / 60.7; SPLIT2 2 47.6 / 50.1; 4 warps at 64 /
    # 64 rows 45.1 / 47.3; one warp at 16 / 32 rows 50.5 / 54.5, at 16 / 16 46.6 / 49.8.
    # round 26 (session 18; the code is gone): the timeline after the L2 flush (profile_moe
    # --timeline, at 1cb0045) had the entry's stamped build (8 programs an SM) straggling: gate/up
    # loops ending at 22.5 / 28.2 / 29.2 us (p50 / p90 / max), the SMs holding 8 of them slowest,
    # no down loop before 31.0, the launch 45.1 us. BALANCE handed the gate/up tiles out by SM
    # (%smid and an arrival count an SM: tile s + 132 j to the j-th program on SM s, the rest down
    # tickets; not deadlock-free if an SM took too few programs, so a diagnostic only). Its
    # stamped build (6 programs an SM): gate/up ends 20.2 / 21.8 / 23.8, launch 39.2. Timed
    # (scripts/ab_moe_t1.py: three interleaved graph timings each, MXFP4 / NVFP4; at 9898529 and
    # 3d19fd3): the entry 44.2-44.8 / 46.2-47.4 us, BALANCE 44.9-45.2 / 46.3-46.8, TILED 43.6-43.8
    # / 42.5-42.7, TILED with BALANCE 44.0-44.3 / 42.7-42.9. SMEM_PAD, 32 KB of shared memory
    # held a program so that 6 fit an SM (and the L1, which x's fragments are read from, shrinks
    # with it): 52.7-52.9 / 57.4-57.7, with BALANCE 53.4-53.8 / 58.7-58.8; TILED 45.2-45.4 /
    # 44.0-44.1. The timed build (7 programs an SM) does not straggle as the stamped one does:
    # a timeline of a build with other registers is not the timed launch's.
    # round 27 (session 19; scripts/moe_t1_diagnostics.patch, MIX): does the phase boundary cost
    # the time? NOWAIT's down tiles skip the wait but still start only as gate/up programs exit;
    # MIX also alternates gate/up and down tickets, so that both kinds stream at once from the
    # launch's start (wrong results, timings only). Printout at a working tree of 61f6854,
    # --only 157,158, MXFP4 / NVFP4: the entry 43.9 / 46.7 us, TILED 43.5 / 42.5; NOWAIT 42.9 /
    # 45.3, TILED 42.4 / 41.2; NOWAIT with MIX 48.5 / 48.9, TILED 47.9 / 46.2 (slower); with
    # LOADS_ONLY too 38.0 / 41.6, TILED 34.4 / 33.6, against LOADS_ONLY with NOWAIT 38.3 / 41.6,
    # TILED 35.2 / 34.4. Mixing the phases gains nothing on the loads and costs ~5 us with the
    # work: a launch without the boundary (each gate/up tile's down work started at once) is
    # not the lead. A read-only probe in the same run (one-off, evict-first; the same calls are now
    # scripts/probe_weight_reads.py's last four lines): the down rows read as 32-byte column slices
    # (256 rows a program) 16.0 us against 13.6-13.9 for 32 rows x 1 KB, 64-byte slices 13.7;
    # the script at 1c7e29b: 16.4, 14.2, 13.8 (128 rows x 32 B 15.6).
    # round 28 (session 19; the code at 77e522d, reverted by f39571d): WS, the fused decode
    # warp-specialised (kernels/moe_ws.py there): one persistent program an SM, a producer warp
    # group copying every item's weights by cp.async into a shared-memory ring of 8 stages
    # (never waiting for activations, so the down weights stream during the last gate/up items),
    # two consumer groups of 4 warps doing the register ring's decode and mma on the stages;
    # items of 128 rows x NSEG K-steps handed out statically. Same bits as the entry at its
    # splits (NSEG 16; Flash shape, both formats, one-off check). `python3 scripts/ab_moe_t1.py
    # '{"WS": {"nseg": 16}}' '{"WS": true}' ...` at 77e522d, MXFP4 / NVFP4: the entry 44.1-45.0 /
    # 46.4-47.8 us; WS NSEG 16 70.6 / 75.9-76.3, NSEG 8 79.1-79.7 / 86.0-86.4, NSEG 4 108.0 /
    # 112.4, 6 stages 77.4 / 82.8, NSEG 16 with 4-step stages 73.1 / 80.5. About 2 us an item
    # (epilogue round trips the consumers wait out) and ~62 us for the bytes: 8 math warps an SM
    # (the entry's 14) decode at ~1.3 TB/s. The math, not the loads' issue, needs the warps.
    # round 29 (session 20; the code was on a local branch, wip/moe-tma, not kept): TMA, the entry's
    # steps with every weight and scale byte brought by TMA (sm_90+) into shared-memory stages of 4
    # K-steps (256 bytes a row), NBUF stages a program, all warps doing the math; the loads never
    # wait for it and need no registers (64-77 a thread against 148). The L2 evict-first policy on
    # the TMA loads by the l2_hint PTX rewrite. Same bits as the entry (GPU hypothesis test on the
    # branch, 47 passed with the REGS and TILED ones). `python3 scripts/ab_moe_t1.py '{"TMA": true,
    # "NBUF": 2}' ...`, two interleaved rounds, MXFP4 / NVFP4: at 4f701a2 the entry 44.0-44.7 /
    # 46.3-47.4 us; NBUF 4 (a whole tile in flight, 70 KB: 3 programs an SM) 63.7 / 60.0; NBUF 2 (6
    # an SM) 46.6-46.9 / 50.1-50.2; NBUF 1 (12 an SM) 65.2 / 65.4; 4 warps, BN1 / BN2 64, NBUF 2
    # 45.5 / 49.8; SPLIT1 4, SPLIT2 2, NBUF 2 48.0 / 49.0; without the L2 hint 1.5 / 2.4 us slower.
    # At 5d8de1f, each down tile's whole K slice requested before it waits for its activations: NBUF
    # 2 48.5 / 52.2 against the entry's 44.1-44.7 / 46.6-47.5, 4 warps 47.0 / 52.1. Bytes in flight
    # without a register cost do not raise the rate; 6 warps an SM (NBUF 4) lose 20 us; the down
    # weights requested early take bandwidth from the gate/up ones (as RESIDENT's did, round 18).
    # Then a diagnostic (branch wip/moe-tma-diag, not kept, wrong results on purpose; down tiles not
    # waiting): the TMA stages only awaited, nothing read, NBUF 1 / 2 / 4 34.0 / 34.9 / 36.4 us
    # (NVFP4 39.5 / 37.9 / 36.6), against the register ring's loads alone 38.0-39.5 (TILED 35.2) in
    # the same run: TMA streams the canonical layout as fast as the ring streams the packed one, so
    # with it the math is what is left. More math warps an SM, then (ILV at 299b210: gate and up
    # rows interleaved 8 by 8, a warp one 16-row mma block, half the shared memory a warp, up to 24
    # warps an SM): NBUF 2 / 3 / 4 56.6 / 58.9 / 54.7 (NVFP4 56.8 / 56.8 / 58.9), 4 warps BN1 32 BN2
    # 64 62.3 / 59.2, SPLIT1 4 SPLIT2 2 46.2 / 48.8, against the entry's 44.2-44.7 / 46.5-47.2.
    # Smaller tiles with more warps are slower still: the math is not paced by warps an SM alone
    # (each warp's x loads, the tiles' epilogues and counters grow as the tiles shrink). And the
    # entry's warps with TMA (667551c: stages of 2 K-steps, NBUF 3, 28 KB, 7 programs an SM):
    # 51.2-51.6 / 56.8-57.2 against 48.7-49.1 / 50.6-51.0 for KS 4 NBUF 2 and the entry's 44.3-45.0
    # / 46.8-48.0.
    # round 30 (session 20; the code at 0fa573e, reverted by 91febd0): ONLINE, the MXFP4
    # scale reference of each row raised step by step in the register ring (the accumulator
    # multiplied by 2**(old - new), exact) instead of read first from the slice's scales (the
    # row-maxima prologue, a DRAM round trip before each tile's ring loads go out): the same bits
    # (GPU hypothesis test on the branch, 15 passed with the fused-decode ones); offline sm_90
    # SASS: 132 registers against 142, gate/up loop 1353 -> 1481 instructions, down 710 -> 775.
    # `python3 scripts/ab_moe_t1.py '{"ONLINE": true}' '{"ONLINE": true, "TILED": true}'
    # '{"TILED": true}' --rounds 3` at 0fa573e, MXFP4: the entry 44.4-44.8 us, ONLINE 46.4-46.6,
    # TILED 43.7-43.9, TILED with ONLINE 43.6-43.8 (NVFP4, which has no prologue, unchanged:
    # 46.5-47.5 / 46.4-46.7, TILED 42.7-43.0). The prologue is not what MXFP4 pays for.
    # round 31 (session 21; diagnostic builds of scripts/moe_t1_diagnostics.patch at d9db561,
    # FAKEDEC at f085752, wrong results on purpose; `DSV4LAB_MOE_<SWITCH>=1 python3
    # scripts/ab_moe_t1.py ...`, printouts, MXFP4 / NVFP4 us; a switch reaches every build in its
    # process, so the entry's figures come from runs without it in the same lease: 43.9-44.5 /
    # 46.4-47.5, TILED 43.2-43.4 / 42.7-42.8):
    # - MATH_ONLY (the REGS loop without its weight loads; x's loads, the row maxima and the
    #   ring's first four K-steps kept): 39.4-39.9 / 39.3-39.5, TILED 39.2-39.5 / 38.3-39.5,
    #   with NOWAIT 39.4-39.6 / 38.5-39.3; the loads alone (LOADS_ONLY with NOWAIT) 38.3-38.6 /
    #   41.6-42.7, TILED 35.1-35.2 / 34.5-34.6. The math alone takes as long as the loads alone.
    # - Nsight Compute (scripts/ncu_moe_t1.py, MXFP4, clocks at base, 1.38 GHz): the entry
    #   48.8 us, 14.9 M warp instructions (LOP3 17%, F2FP 16%, HMUL2 16%, IMAD 15%, SHF 4%, LDG
    #   4%, HMMA 4%), 6.0 cycles a warp between issues, stalls long scoreboard 28%, wait 17%,
    #   barrier 10%; MATH_ONLY 43.7 us, 13.2 M, wait 25%, long scoreboard 22%; LOADS_ONLY
    #   35.4 us, long scoreboard 64%; FAKEDEC 49.7 us, 8.8 M.
    # - FAKEDEC (the decode cut from ~15 instructions a word to ~3: a shift, a multiply, moves):
    #   45.7-46.2 / 48.6-49.1 at 179 registers (5 programs an SM); capped at 144 (7 an SM, as
    #   the entry) 41.4-41.5 / 49.3-49.5, at 128 42.9-43.1 / 54.7-54.8, TILED at 128 39.8 /
    #   47.6-47.9. RAWDEC (the scale multiplies dropped; 126 registers): 43.9-44.3 / 44.2-44.5,
    #   TILED 43.4-43.5 / 42.2.
    # A decode 2.5x cheaper at the entry's occupancy is worth ~3 us (MXFP4 41.4), and the canonical
    # layout's loads alone through the ring (38.3-38.6) are over 0.5's 37.8 us. The design costed
    # for the decode (the nibbles bit-placed as e4m3, 7 instructions a word, into an FP8 mma.sync
    # m16n8k32 whose 8 columns hold x's two exact e4m3 halves for the lane quad's four scale blocks,
    # the block scales as 4 FFMA a K-step and lane: ~10 instructions a word against ~25 where the
    # mma takes FP8 natively, sm_89 / sm_120) is therefore not built: with these loads it cannot
    # reach 0.5.
    # Then (same lease, at e63a3dc) MATH_ONLY with FAKEDEC, the cheap decode's math alone:
    # 29.1-29.4 / 28.6-28.9 at 168 registers, 30.2-30.3 / 29.2-29.3 capped at 144 (TILED 29.8 /
    # 28.0), with NOWAIT 29.4-29.6 / 28.1. The ring's loads and math overlap to within 3-5 us of
    # the slower half (44.2 against 39.5, 41.4 against 38.4); TMA's loads alone took 34.0 (round
    # 29), so TMA loads under a decode that cheap would land near 37-39 us if they overlapped as
    # well. The FP8 decode is not that decode on the H200: Gluon's mma_v2 on float8e4nv operands
    # (k_width 4) emits mma.sync.m16n8k32 e4m3, which sm_89 and sm_120 run as one QMMA.16832,
    # but which ptxas emulates on sm_90 (FP8 only in wgmma there): 12 F2FP.F16.E4M3.UNPACK_B and
    # two HMMA.16816.F32 an mma (`python3 scripts/probe_fp8_mma.py --cc 90`, offline, Triton
    # 3.9). The per-word conversions it was to save come back (and x's with them); what stays
    # saved is the scale multiplies, which RAWDEC measured at no gain. On sm_89 / sm_120 the
    # design keeps its cost; on the H200 no decode known here is as cheap as FAKEDEC.
    # The FP8 decode as costed (sm_89 / sm_120, for whoever builds it there): lane (g, t) keeps its
    # 16-byte load of a row's K-step (MXFP4 block t); chunk c of the step (one m16n8k32) takes word
    # c of every lane, a0 / a1 its low nibbles (rows g, g + 8), a2 / a3 its high ones, each nibble
    # placed as e4m3 s 0 0 e1 e0 m 0 0 (exact: value * 2**-6; subnormals included). B's column 2 b +
    # part holds part (the hi or lo e4m3 half; bf16 = hi + lo exactly, within range) of x's elements
    # of block b, zero elsewhere: B lane (g', t') loads its 8 bytes when g' // 2 == t'. After the
    # step's 4 mma from a zero accumulator, lane (g, t)'s columns 2 t, 2 t + 1 hold block t's hi and
    # lo dots for rows g and g + 8, which its own scale bytes (times x's block scale) multiply into
    # the running fp32 sums: 4 FFMA a step and m16 tile; the columns are summed over the quad once a
    # tile. NVFP4 (two blocks a lane): the scales after chunks 0-1 and 2-3. x's copy writes the hi /
    # lo halves with a power-of-two scale per 32-element block; the gate/up epilogue writes act
    # alike (BN1 32 rows = one block of the down K).
    # round 32 (session 22): the tensor cores left out at T = 1. A read-only-style probe first
    # (scripts/probe_simt_gemv.py, printout at 3a6d357): the gate/up rows times x on the CUDA
    # cores (lane l owns 64 elements of every row, x in 32 fp16x2 registers, the CVT8 placement
    # paired by prmt, fp16x2 fma over a 32-element block, the block's scale on its fp32 sum)
    # 21.5 us against 21.0 for a plain read of the same 51 MB; with the down rows 32.1-33.4
    # against 33.5. Then kernels/moe_simt.py, the same FUSED schedule (ab_moe_t1 '{"SIMT": ...}',
    # printouts, MXFP4 / NVFP4 us, against the register ring's 43.8-45.1 / 46.4-47.6 in the same
    # runs): BN1 / BN2 64 / 64 54.5 / 50.0, 64 / 32 48.7, 32 / 32 37.3-37.9 / 41.4-42.4, 32 / 16
    # 39.5 / 40.9, 32 / 8 44.1; 2 warps 48.4-54.4, 8 warps (RB 1) 43.4; RB 1 45.2, RB 4 (2 warps,
    # BN2 16) 40.6; AHEAD 2 40.1 (128 registers); MAXNREG 72 38.8-39.5, 64 43.1; dec cvt 37.7,
    # two chains 37.6-37.8; PREFETCH 39.7; SLEEP 100 / 20 no gain; XW 1 37.4 against 37.7-38.8;
    # whole-K tiles (735f3e4) 47.0; down tiles over a token's pairs (cabc8a2) 39.8. The table's
    # T = 1 entry since (SIMT=None: BN1 = BN2 = 32, 4 warps, RB 2, XW 1): `dsv4lab bench moe` rows
    # at 3bae2cd and 78e1e04, 37.2-37.6 us (0.504-0.509), NVFP4 40.3-40.4 at 78e1e04 (the E4M3
    # scales by bit placement: 80 registers instead of 96).
]


def short(cfg: dict) -> str:
    d = dict(cfg)
    kind = ("swapAB" if d.pop("SWAP_AB", False) else "dot") if d.pop("USE_DOT") else "fma"
    flags = "".join(f" {k}" for k in ("DECODE32", "FASTDEC", "XPRE", "ROWMAX", "W16", "FOLD") if d.get(k))
    return (f"{kind} BM{d['BM']} BN{d['BN1']}/{d['BN2']} BK{d['BK1']}/{d['BK2']} "
            f"S{d.get('SPLIT1', 1)}/{d['SPLIT2']} w{d['num_warps']} s{d['num_stages']}{flags}"
            + (f" r{d['MAXNREG']}" if d.get("MAXNREG") else "")
            + (f" MMA2{d['MMA2']}" if d.get("MMA2") else ""))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny shape, interpreter-friendly")
    ap.add_argument("--budget", type=float, default=90.0, help="stop starting candidates after this many s")
    ap.add_argument("--tokens", default="1,64,8,256", help="T values, in priority order")
    ap.add_argument("--only", default="", help="candidate indices to run (e.g. 44-52,13); default: all")
    ap.add_argument("--formats", default="mxfp4,nvfp4", help="formats to time")
    args = ap.parse_args()
    dev = runtime.device()
    if args.dry_run:
        shape = dict(E=8, H=64, I=64, topk=2)
        tokens = (1, 4)
        cands = [_c(BK1=64, BK2=64), _c(USE_DOT=False, BM=1, BK1=32, BK2=32), _c(BN2=16, SPLIT2=2, BK2=32),
                 _c(SWAP_AB=True, BN1=16, BN2=16, BK1=32, BK2=32),
                 _c(FASTDEC=True, BK1=64, BK2=64),     # the interpreter: reference decode
                 _c(FASTDEC=True, XPRE=True, BK1=32, BK2=32, SPLIT1=2, SPLIT2=2, ROWMAX=True)]
        cands = list(enumerate(cands))
        gen_cpu = torch.Generator().manual_seed(0)
        experts = {f: _quantised_experts(shape["E"], shape["H"], shape["I"], f, dev, gen_cpu)
                   for f in ("mxfp4", "nvfp4")}
    else:
        if not torch.cuda.is_available():
            print("tune_moe: no CUDA GPU (use --dry-run for the CPU smoke)")
            return 2
        shape = FLASH
        tokens = tuple(int(t) for t in args.tokens.split(","))
        cands = list(enumerate(CANDIDATES))
        if args.only:
            keep = set()
            for part in args.only.split(","):
                lo, _, hi = part.partition("-")
                keep.update(range(int(lo), int(hi or lo) + 1))
            cands = [(i, c) for i, c in cands if i in keep]
        gen = torch.Generator(device=dev).manual_seed(0)
        experts = {f: _random_experts(shape["E"], shape["H"], shape["I"], f, dev, gen) for f in ("mxfp4", "nvfp4")}
    E, H, I, k = shape["E"], shape["H"], shape["I"], shape["topk"]
    for ex in experts.values():       # globals on the device once (graph capture needs it)
        ex["kw"] = {n: v.to(dev).reshape(-1).expand(E).contiguous() for n, v in ex["kw"].items()}
    gen = torch.Generator(device=dev).manual_seed(1)
    cases = {}
    for T in tokens:
        ids, w, x = token_case(T, E, H, k, dev, gen)
        hit = int(torch.unique(ids).numel())
        refs = {}
        for fmt, ex in experts.items():
            refs[fmt] = fused_moe(x.float(), ex["w13"], ex["w13_scale"], ex["w2"], ex["w2_scale"], ids, w,
                                  fmt=fmt, swiglu_limit=LIMIT, backend="torch", **ex["kw"]).float()
        cases[T] = dict(ids=ids, w=w, x=x, hit=hit, refs=refs)
    print(f"tune_moe: {runtime.versions() if hasattr(runtime, 'versions') else ''}")
    print(f"shape {shape}; setup {time.time() - T0:.1f} s; {len(cands)} candidates, budget {args.budget:.0f} s")
    rows, skipped = [], []
    out_dir = os.environ.get("OUT") or "."
    path = os.path.join(out_dir, "tune_moe.json")

    def dump():   # after every candidate too: a crash (e.g. a compiler abort) keeps the rows so far
        with open(path, "w") as f:
            json.dump(dict(shape=shape, tokens=list(tokens), dry_run=args.dry_run,
                           device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                           triton=__import__("triton").__version__, torch=torch.__version__,
                           rows=rows, skipped=skipped, wall_s=time.time() - T0), f, indent=1, default=str)
    time_kw = dict(warmup_ms=3, rep_ms=15) if not args.dry_run else {}
    fmts = args.formats.split(",")
    for ci, cfg in cands:
        for fmt, ex in experts.items():
            if fmt not in fmts:
                continue
            if time.time() - T0 > args.budget:
                skipped.append((ci, fmt))
                continue
            for T in tokens:
                c = cases[T]
                row = dict(cand=ci, cfg=short(cfg), config=cfg, fmt=fmt, T=T, experts_hit=c["hit"])

                # TILED: weights packed once, as at load (``ex`` stays canonical)
                def run(ex=experts_for(ex, cfg, fmt, T), fmt=fmt, c=c, cfg=cfg):
                    return kmoe.fused_moe(c["x"], ex["w13"], ex["w13_scale"], ex["w2"], ex["w2_scale"],
                                          c["ids"], c["w"], fmt=fmt, swiglu_limit=LIMIT, config=cfg,
                                          **ex["kw"])
                t1 = time.time()
                try:
                    out = run().float()
                    ref = c["refs"][fmt]
                    err = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
                    row.update(err=err, ok=bool(err <= TOL))
                    timing = bench.time_graph(run, **time_kw) if not args.dry_run else bench.time_fn(run, cpu_reps=1)
                    row.update(timing)
                    bench.with_roofline(row, bytes_moved=fp4_bytes(c["hit"], H, I, fmt),
                                        flops=2.0 * c["ids"].numel() * 3 * H * I)
                except Exception as exc:      # a config that does not compile/launch: record, go on
                    row.update(ok=False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
                row["wall_s"] = round(time.time() - t1, 2)
                rows.append(row)
                us = row.get("ms", float("nan")) * 1e3
                print(f"  [{time.time() - T0:5.1f}s] #{ci:<2} {fmt:<5} T={T:<4} {us:9.1f} us "
                      f"frac {row.get('roofline_fraction', 0):.3f} err {row.get('err', float('nan')):.1e} "
                      f"{'' if row['ok'] else 'WRONG/ERROR '}{row.get('error', '')} {row['cfg']}", flush=True)
        dump()
    # ---- the ranked table: per (T, fmt) best first; then the NVFP4 / MXFP4 ratio
    print("\nranked (ok rows only; us = CUDA-graph median):")
    print(f"{'T':>4} {'fmt':<6} {'us':>9} {'frac':>6}  config")
    best = {}
    for T in tokens:
        for fmt in experts:
            good = sorted((r for r in rows if r["T"] == T and r["fmt"] == fmt and r["ok"] and "ms" in r),
                          key=lambda r: r["ms"])
            for r in good[:4]:
                print(f"{T:>4} {fmt:<6} {r['ms'] * 1e3:9.1f} {r.get('roofline_fraction', 0):6.3f}  #{r['cand']} {r['cfg']}")
            if good:
                best[(T, fmt)] = good[0]
    for T in tokens:
        if (T, "mxfp4") in best and (T, "nvfp4") in best:
            print(f"T={T}: best nvfp4/mxfp4 = {best[(T, 'nvfp4')]['ms'] / best[(T, 'mxfp4')]['ms']:.2f}")
    wrong = [r for r in rows if not r["ok"]]
    print(f"{len(rows)} rows, {len(wrong)} wrong/error, skipped (budget): {skipped or 'none'}; "
          f"{time.time() - T0:.1f} s")
    dump()
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
