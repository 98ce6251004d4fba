"""Compile the warp-specialised sparse MLA decode (kernels/sparse_mla_ws.py
``_sparse_mla_ws_kernel``) for an NVIDIA GPU without one, and print what its SASS costs.

    python3 scripts/sass_sparse_mla_ws.py ['{"NUM_BUF": 3, "FP8": true, "LAZY_SS": true}']
        [--cc 90] [--triton-site DIR] [--out /tmp/mla_ws]

The JSON sets the kernel's constexprs over these defaults: the H200 table's bf16 mid/large
launch (32-row tiles, four ring buffers, the seesaw consumers, P_SWIZZLE, with a sink, split-KV
partials, PDL; the launcher's registers: maxnreg 168, consumers 232 after setmaxnreg,
producer 40). With FP8 the cache is the 584-byte one (uint8); the split flag is a constant
here (the launcher passes it at run time), so the SASS holds that case's epilogue only.
``--triton-site``: a directory holding the Triton to compile with, ahead of the installed one.
The SASS, PTX and cubin go to ``--out`` plus .sass/.ptx/.cubin (scripts/gluon_sass.py). Offline
figures, not measurements.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gluon_sass  # noqa: E402

DEFAULTS = dict(BLOCK_N=32, NUM_BUF=4, SEESAW=True, HAS_SINK=True, SPLIT=1, SCAN_N=512,
                PRODUCER_REGS=40, CONSUMER_REGS=232, num_warps=4, FP8=False, PDL=True,
                P_SWIZZLE=True)


def main() -> int:
    args = gluon_sass.parser(__doc__, "/tmp/mla_ws").parse_args()
    gluon_sass.use_triton(args.triton_site)
    mod = gluon_sass.kernel_module("sparse_mla_ws")
    consts = dict(DEFAULTS, **json.loads(args.consts))
    consts.setdefault("S_BUFS", mod.s_bufs(consts["BLOCK_N"], consts["NUM_BUF"], consts["FP8"]))
    fn = mod._sparse_mla_ws_kernel
    consts = gluon_sass.with_defaults(fn, consts)
    # the 16-bit pointers (opart: part16 partials, the table's split-KV default), the int32
    # ones; every other pointer is fp32
    types = {"q_ptr": "*bf16", "out_ptr": "*bf16", "opart_ptr": "*bf16", "idx_ptr": "*i32",
             "cnt_ptr": "*i32", "kv_ptr": "*u8" if consts["FP8"] else "*bf16"}
    sig = gluon_sass.signature(fn, consts, types, "*fp32", {"qk_scale": "fp32"})
    aligned = [k for k, v in sig.items() if v.startswith("*")]
    report = gluon_sass.compile_report(fn, sig, consts, aligned, cc=args.cc,
                                       num_warps=consts["num_warps"], maxnreg=168, out=args.out)
    print(gluon_sass.summary(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
