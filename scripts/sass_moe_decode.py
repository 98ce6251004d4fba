"""Compile the T = 1 fused MoE decode (kernels/moe_mma2.py ``_decode_kernel``) for an NVIDIA GPU
without one, and print what its SASS costs: registers, spills, shared memory, loop lengths.

    python3 scripts/sass_moe_decode.py '{"BN1": 32, "BN2": 32, "SPLIT1": 2, "SPLIT2": 1,
        "num_warps": 2, "REGS": 4, "EVICT": true, "PREFETCH": false}' [--cc 90] [--maxnreg N]
        [--asm cvt8|fastdec|raw] [--triton-site DIR] [--out /tmp/moe_dec]

The JSON sets the kernel's constexprs over these defaults: IS_NV false, HAS_LIMIT true, BN1 /
BN2 64, SPLIT1 / SPLIT2 2, STAGES 3, NSPS1 / NSPS2 2, PREFETCH true, num_warps 4, ACC_SCALE
false, PDL false, REGS 0 (and the kernel's own defaults: EVICT false, EARLY true). ``--asm``:
the decode (``raw``: CVT8_RAW_ASM with ACC_SCALE). ``--triton-site``: a directory holding the
Triton to compile with, ahead of the installed one (the session figures used Triton 3.6, the
device's). The SASS, PTX and cubin go to ``--out`` plus .sass/.ptx/.cubin. Loop lengths are the
instruction counts of the backward branches (the K loops' unrolled bodies). The registers come
from ``cuobjdump -res-usage``, which Triton's NVIDIA backend carries. These are offline figures,
not measurements: the device's compile has differed (8 programs an SM observed where 142
registers allow 7).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gluon_sass  # noqa: E402

DEFAULTS = dict(IS_NV=False, HAS_LIMIT=True, BN1=64, BN2=64, SPLIT1=2, SPLIT2=2, STAGES=3,
                NSPS1=2, NSPS2=2, PREFETCH=True, num_warps=4, ACC_SCALE=False, PDL=False, REGS=0)


def _signature(fn, consts):
    sig = {}
    for n in fn.arg_names:
        if n in consts:
            sig[n] = "constexpr"
        elif n in ("w13_ptr", "s13_ptr", "w2_ptr", "s2_ptr"):
            sig[n] = "*u8"
        elif n in ("xp_ptr", "act_ptr"):
            sig[n] = "*fp16"
        elif n == "out_ptr":
            sig[n] = "*bf16"
        elif n in ("g13_ptr", "g2_ptr", "topk_w_ptr", "ypair_ptr", "part_ptr"):
            sig[n] = "*fp32"
        elif n == "stamps_ptr":
            sig[n] = "*i64"
        elif n.endswith("_ptr"):
            sig[n] = "*i32"
        else:
            sig[n] = "fp32" if n == "swiglu_limit" else "i32"
    return sig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("consts", nargs="?", default="{}", help="JSON: constexprs over the defaults")
    ap.add_argument("--cc", type=int, default=90, help="compute capability (90: sm_90)")
    ap.add_argument("--maxnreg", type=int, default=None)
    ap.add_argument("--asm", choices=("cvt8", "fastdec", "raw"), default="cvt8")
    ap.add_argument("--triton-site", default=None)
    ap.add_argument("--out", default="/tmp/moe_dec")
    args = ap.parse_args()
    gluon_sass.use_triton(args.triton_site)
    mod = gluon_sass.kernel_module("moe_mma2")
    # moe.py's FASTDEC asm, read as text (importing moe.py would import dsv4lab)
    fastdec = re.search(r'FASTDEC_ASM = """(.*?)"""', (gluon_sass.ROOT / "kernels/moe.py").read_text(),
                        re.S).group(1)
    consts = dict(DEFAULTS, ASM={"cvt8": mod.CVT8_ASM, "fastdec": fastdec, "raw": mod.CVT8_RAW_ASM}[args.asm])
    if args.asm == "raw":
        consts["ACC_SCALE"] = True
    consts.update(json.loads(args.consts))
    fn = mod._decode_kernel
    consts = gluon_sass.with_defaults(fn, consts)      # the kernel's own (EVICT, EARLY, ...)
    sig = _signature(fn, consts)
    aligned = [k for k, v in sig.items() if v.startswith("*") or k.startswith("stride") or k in ("I", "H")]
    report = gluon_sass.compile_report(fn, sig, consts, aligned, cc=args.cc,
                                       num_warps=consts["num_warps"], maxnreg=args.maxnreg,
                                       out=args.out)
    print(gluon_sass.summary(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
