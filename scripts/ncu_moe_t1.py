"""Where the T = 1 fused MoE decode's warps stall, and what they issue (Nsight Compute; GPU only).

    python3 scripts/ncu_moe_t1.py [--fmt mxfp4|nvfp4] [--launch '{"TILED": true}'] [--top 25]
        [--out DIR]

Profiles one call of the ``_decode_kernel`` of the table's T = 1 config at Flash's shape
(kernels/moe_simt.py's since session 22; ``--launch '{"SIMT": false}'`` for kernels/moe_mma2.py's,
which the session-21 figures profiled), ``--launch`` keys over its MMA2 entry, the weights packed
as the keys ask (as ``dsv4lab bench moe`` packs them), after warm-up calls, with ``ncu``
(SpeedOfLight, WarpStateStats, SourceCounters; ncu locks the clocks to base and flushes the caches before the profiled call).
Prints the kernel's duration and throughputs, the stall samples by reason and the instructions
with the most samples, then the executed warp instructions by opcode (scripts/ncu_report.py
reads the report). The diagnostic builds of scripts/moe_t1_diagnostics.patch are profiled the same way
(their switches in the environment). Records nothing: a printout.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import ncu_report  # noqa: E402


def drive(fmt: str, launch: str | None, calls: int) -> None:
    """The profiled process: the T = 1 call, ``calls`` times."""
    sys.path.insert(0, str(ROOT))
    import dsv4lab  # noqa: F401  (configures the runtime before triton is imported)
    import torch
    from dsv4lab.benchmarks.moe import FLASH, SWIGLU_LIMIT, _random_experts, experts_for, token_case
    from dsv4lab.kernels.moe import config_for
    from dsv4lab.ops import fused_moe
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    E, H, I, k = FLASH["E"], FLASH["H"], FLASH["I"], FLASH["topk"]
    cfg = dict(config_for(1, k, E, fmt))
    if launch:
        cfg["MMA2"] = dict(cfg["MMA2"], **json.loads(launch))
    ex = experts_for(_random_experts(E, H, I, fmt, dev, gen), cfg, fmt, 1)
    ids, w, x = token_case(1, E, H, k, dev, gen)
    print(cfg, flush=True)
    for _ in range(calls):
        fused_moe(x, ex["w13"], ex["w13_scale"], ex["w2"], ex["w2_scale"], ids, w, fmt=fmt,
                  swiglu_limit=SWIGLU_LIMIT, backend="triton", kernel_config=cfg, **ex["kw"])
    torch.cuda.synchronize()


def main() -> int:
    ap = ncu_report.parser(__doc__, "build/ncu_moe_t1", calls=6)
    ap.add_argument("--fmt", default="mxfp4", choices=("mxfp4", "nvfp4"))
    ap.add_argument("--launch", default=None, help="JSON of moe_mma2 launch keys over the config")
    args = ap.parse_args()
    if args.drive:
        drive(args.fmt, args.launch, args.calls)
        return 0
    driver = [sys.executable, __file__, "--drive", "--fmt", args.fmt, "--calls", str(args.calls)]
    if args.launch:
        driver += ["--launch", args.launch]
    source = ncu_report.profile("_decode_kernel", driver, args.calls, Path(args.out), args.top)
    if source is None:
        return 1
    ncu_report.opcodes(source, 20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
