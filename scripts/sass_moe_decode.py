"""Compile the T = 1 fused MoE decode (kernels/moe_mma2.py ``_decode_kernel``, or with ``--simt``
kernels/moe_simt.py's) for an NVIDIA GPU without one, and print what its SASS costs:
registers, spills, shared memory, loop lengths.

    python3 scripts/sass_moe_decode.py '{"BN1": 32, "BN2": 32, "SPLIT1": 2, "SPLIT2": 1,
        "num_warps": 2, "REGS": 4, "EVICT": true, "PREFETCH": false}' [--cc 90] [--maxnreg N]
        [--asm cvt8|fastdec|raw] [--triton-site DIR] [--out /tmp/moe_dec]
    python3 scripts/sass_moe_decode.py --simt ['{"IS_NV": true}'] [--dec prmt|cvt]

``--simt``: the constexprs over SIMT_DEFAULTS (the table's T = 1 launch: BN1 / BN2 32, RB 2,
4 warps, PDL on) and the pair decode ``--dec`` (moe_simt.block_dot_asm; NVFP4 two chains).

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

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gluon_sass  # noqa: E402

DEFAULTS = dict(IS_NV=False, HAS_LIMIT=True, BN1=64, BN2=64, SPLIT1=2, SPLIT2=2, STAGES=3,
                NSPS1=2, NSPS2=2, PREFETCH=True, num_warps=4, ACC_SCALE=False, PDL=False, REGS=0)


# the decode kernel's pointers other than int32 ones, and its float scalar
TYPES = {"w13_ptr": "*u8", "s13_ptr": "*u8", "w2_ptr": "*u8", "s2_ptr": "*u8", "xp_ptr": "*fp16",
         "act_ptr": "*fp16", "out_ptr": "*bf16", "g13_ptr": "*fp32", "g2_ptr": "*fp32",
         "topk_w_ptr": "*fp32", "ypair_ptr": "*fp32", "part_ptr": "*fp32", "stamps_ptr": "*i64",
         "xc_ptr": "*fp32", "ac_ptr": "*fp32"}
SIMT_DEFAULTS = dict(IS_NV=False, HAS_LIMIT=True, BN1=32, BN2=32, RB=2, num_warps=4, PDL=True)


def main() -> int:
    ap = gluon_sass.parser(__doc__, "/tmp/moe_dec")
    ap.add_argument("--maxnreg", type=int, default=None)
    ap.add_argument("--asm", choices=("cvt8", "fastdec", "raw"), default="cvt8")
    ap.add_argument("--simt", action="store_true", help="kernels/moe_simt.py's decode")
    ap.add_argument("--dec", choices=("prmt", "cvt"), default="prmt", help="with --simt")
    args = ap.parse_args()
    gluon_sass.use_triton(args.triton_site)
    if args.simt:
        mod = gluon_sass.kernel_module("moe_simt")
        consts = dict(SIMT_DEFAULTS, **json.loads(args.consts))
        consts.setdefault("ASM", mod.block_dot_asm(args.dec, nv=consts["IS_NV"]))
        return _report(mod._decode_kernel, consts, args)
    mod = gluon_sass.kernel_module("moe_mma2")
    # moe.py's FASTDEC asm, read as text (importing moe.py would import dsv4lab)
    fastdec = re.search(r'FASTDEC_ASM = """(.*?)"""', (gluon_sass.ROOT / "kernels/moe.py").read_text(),
                        re.S).group(1)
    consts = dict(DEFAULTS, ASM={"cvt8": mod.CVT8_ASM, "fastdec": fastdec, "raw": mod.CVT8_RAW_ASM}[args.asm])
    if args.asm == "raw":
        consts["ACC_SCALE"] = True
    consts.update(json.loads(args.consts))
    return _report(mod._decode_kernel, consts, args)


def _report(fn, consts, args) -> int:
    consts = gluon_sass.with_defaults(fn, consts)      # the kernel's own (EVICT, EARLY, ...)
    sig = gluon_sass.signature(fn, consts, TYPES, "*i32", {"swiglu_limit": "fp32"})
    aligned = [k for k, v in sig.items() if v.startswith("*") or k.startswith("stride") or k in ("I", "H")]
    report = gluon_sass.compile_report(fn, sig, consts, aligned, cc=args.cc,
                                       num_warps=consts["num_warps"], maxnreg=args.maxnreg,
                                       out=args.out)
    print(gluon_sass.summary(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
