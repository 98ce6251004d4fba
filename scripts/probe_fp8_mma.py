"""What Gluon's ``mma_v2`` on FP8 (e4m3) operands becomes for a GPU target: an offline compile, no
GPU needed, of one m16n8k32 product of float8e4nv tiles (dot-operand k_width 4); prints the PTX
``mma.sync`` it emits, the SASS mma instructions and the SASS e4m3 -> fp16 conversions.

    python3 scripts/probe_fp8_mma.py [--cc 90] [--triton-site DIR] [--out STEM]

The FP8 decode costed for the T = 1 MoE (scripts/tune_moe.py round 31, kernels/moe_mma2.py's
docstring) rests on this product. Session 21 (Triton 3.9): the PTX is
``mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32`` for every target; sm_89 and sm_120 run
it as one QMMA.16832.F32.E4M3.E4M3, but sm_90 (Hopper: FP8 only in wgmma) has ptxas emulate it:
12 F2FP.F16.E4M3.UNPACK_B (every operand byte converted to fp16) and two HMMA.16816.F32. A
printout, not a measurement.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gluon_sass  # noqa: E402


def main() -> int:
    ap = gluon_sass.parser(__doc__, "/tmp/probe_fp8_mma")
    args = ap.parse_args()
    gluon_sass.use_triton(args.triton_site)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    @gluon.jit
    def fp8_mma(a_ptr, b_ptr, c_ptr):
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1],
                                                      instr_shape=[16, 8])
        A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
        B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=4)
        ra = gl.arange(0, 16, layout=gl.SliceLayout(1, A_OP))
        ka = gl.arange(0, 32, layout=gl.SliceLayout(0, A_OP))
        kb = gl.arange(0, 32, layout=gl.SliceLayout(1, B_OP))
        nb = gl.arange(0, 8, layout=gl.SliceLayout(0, B_OP))
        a = gl.load(a_ptr + ra[:, None] * 32 + ka[None, :])
        b = gl.load(b_ptr + kb[:, None] * 8 + nb[None, :])
        acc = mma_v2(a, b, gl.zeros([16, 8], gl.float32, layout=MMA))
        rc = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
        nc = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
        gl.store(c_ptr + rc[:, None] * 8 + nc[None, :], acc)

    sig = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "c_ptr": "*fp32"}
    r = gluon_sass.compile_report(fp8_mma, sig, {}, (), cc=args.cc, num_warps=1, out=args.out)
    ptx = Path(args.out).with_suffix(".ptx").read_text()
    print(gluon_sass.summary(r))
    print("PTX:", sorted(set(re.findall(r"mma\.sync[\w.]*", ptx))))
    print("SASS mma:", sorted(set(re.findall(r"\b[HQ]MMA[\w.]*", r["sass"]))),
          "e4m3 -> fp16 conversions:", len(re.findall(r"F2FP\.F16\.E4M3", r["sass"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
