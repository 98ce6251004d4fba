"""Same-process A/B of the T = 1 fused MoE decode against launch-key changes.

    python3 scripts/ab_moe_t1.py '{"TILED": true}' '{"EARLY": false}' [--rounds 3]

Each argument is a JSON object of moe_mma2 launch keys over the table's T = 1 config (the
entry, which runs first; at Flash's sizes kernels/moe_simt.py's decode since session 22, whose
own keys go in ``{"SIMT": {...}}``; ``{"SIMT": false}`` selects kernels/moe_mma2.py's launch,
which the other keys then set). Every variant is timed ``--rounds`` times, the variants interleaved
round by round (CUDA-graph replays after do_bench's L2 flush, as ``dsv4lab bench moe`` times
them), so that a drift of the machine reaches them all alike; both formats, Flash's shape, one
token. "same bits": the variant's output equals the entry's; "registers": those of the decode
kernel the variant compiled (programs an SM are bounded by them). A diagnosis aid (printouts), not
the benchmark: runs on one machine have differed by ~1 us, runs on two leases of the same GPU
type by ~2. The A/B printouts of scripts/tune_moe.py round 26 came from this script (at the
commits named there: the keys it compared, BALANCE and SMEM_PAD, are gone from the kernel).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

import dsv4lab  # noqa: F401  (configures the runtime before triton is imported)
from dsv4lab import bench
from dsv4lab.benchmarks.moe import FLASH, SWIGLU_LIMIT, _random_experts, experts_for, token_case
from dsv4lab.kernels import moe as kmoe


def _decode_kernels() -> dict:
    """The compiled builds of the fused decode kernels so far (moe_mma2's, moe_simt's):
    cache key -> kernel."""
    from dsv4lab.kernels import moe_mma2, moe_simt
    return {(i, key): kern for i, fn in enumerate((moe_mma2._decode_kernel, moe_simt._decode_kernel))
            for cache in fn.device_caches.values() for key, kern in cache[0].items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("launch", nargs="*", help="JSON objects of moe_mma2 launch keys")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("ab_moe_t1: needs a CUDA GPU")
        return 2
    dev = torch.device("cuda")
    E, H, I, k = FLASH["E"], FLASH["H"], FLASH["I"], FLASH["topk"]
    gen = torch.Generator(device=dev).manual_seed(0)
    variants = [("entry", {})] + [(a, json.loads(a)) for a in args.launch]
    for fmt in ("mxfp4", "nvfp4"):
        entry = kmoe.config_for(1, k, E, fmt)
        ex = _random_experts(E, H, I, fmt, dev, gen)     # NVFP4's globals: [E] on dev already
        gen_case = torch.Generator(device=dev).manual_seed(1)
        ids, w, x = token_case(1, E, H, k, dev, gen_case)
        calls, outs, times, regs = {}, {}, {}, {}
        for name, keys in variants:
            cfg = dict(entry, MMA2=dict(entry["MMA2"], **keys))
            exv = experts_for(ex, cfg, fmt, 1)

            def call(exv=exv, cfg=cfg):
                return kmoe.fused_moe(x, exv["w13"], exv["w13_scale"], exv["w2"], exv["w2_scale"],
                                      ids, w, fmt=fmt, swiglu_limit=SWIGLU_LIMIT, config=cfg,
                                      **exv["kw"])
            before = _decode_kernels()
            calls[name], outs[name], times[name] = call, call(), []
            built = [kern for key, kern in _decode_kernels().items() if key not in before]
            for kern in built:
                kern._init_handles()        # n_regs is read when the kernel is loaded
            regs[name] = ", ".join(str(kern.n_regs) for kern in built) or "as built before"
        for _ in range(args.rounds):
            for name, _keys in variants:
                times[name].append(bench.time_graph(calls[name], warmup_ms=3, rep_ms=15)["ms"] * 1e3)
        for name, _keys in variants:
            print(f"{fmt} {name:<48} " + " ".join(f"{t:5.1f}" for t in times[name])
                  + f" us  same bits {bool(torch.equal(outs[name], outs['entry']))}"
                  + f", registers {regs[name]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
