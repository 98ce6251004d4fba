"""How the L2 state before a timed call changes a memory-bound figure (GPU; printout).

``triton.testing.do_bench`` empties the L2 before each timed call by writing zeros over a
256 MB buffer. That leaves the L2 full of dirty lines, and the timed kernel's first misses
must write them back to DRAM: up to an L2's worth of extra traffic charged to the kernel.
This script times the same calls after three L2 states:

- ``write``: do_bench's flush (zero a 256 MB buffer: the L2 ends full of dirty lines);
- ``read``: read a 256 MB buffer instead (the L2 ends full of clean, unrelated lines);
- ``none``: no flush (whatever the previous call left: warm where the data fits).

on (1) a plain Triton kernel that only reads N MB, and (2) the FP4 MoE at the Flash shape
(T = 1 and 64, MXFP4), each in a CUDA graph as ``dsv4lab bench`` times them.

    python3 scripts/probe_l2_flush.py
"""
from __future__ import annotations

import statistics

import torch
import triton
import triton.language as tl

from dsv4lab import bench


@triton.jit
def _read_kernel(src, out, n_words, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(pid * BLOCK, n_words, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc ^= tl.load(src + offs, mask=offs < n_words, other=0)
    tl.store(out + pid, tl.xor_sum(acc, axis=0))


def read_fn(mb: float):
    words = int(mb * 1e6) // 4
    src = torch.randint(0, 2**30, (words,), dtype=torch.int32, device="cuda")
    grid = torch.cuda.get_device_properties(0).multi_processor_count * 8
    out = torch.empty(grid, dtype=torch.int32, device="cuda")
    return lambda: _read_kernel[(grid,)](src, out, words, BLOCK=2048, num_warps=8)


def median_us(fn, flush: str, reps: int = 200) -> float:
    graph = bench.capture_graph(fn)[0]
    buf = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device="cuda")
    sink = torch.empty((), dtype=torch.int64, device="cuda")
    clear = {"write": buf.zero_, "read": lambda: torch.sum(buf, 0, dtype=torch.int64, out=sink),
             "none": lambda: None}[flush]
    for _ in range(10):
        clear()
        graph.replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        clear()
        s.record()
        graph.replay()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


def main() -> None:
    print(f"{'call':<22} {'MB':>6} {'write us':>9} {'read us':>9} {'none us':>9} "
          f"{'GB/s w':>7} {'GB/s r':>7}")
    for mb in (12.5, 25, 50, 75, 100, 200, 400, 800):
        fn = read_fn(mb)
        t = {f: median_us(fn, f) for f in ("write", "read", "none")}
        print(f"{'read kernel':<22} {mb:>6.1f} {t['write']:>9.1f} {t['read']:>9.1f} {t['none']:>9.1f} "
              f"{mb * 1e3 / t['write']:>7.0f} {mb * 1e3 / t['read']:>7.0f}")
    from dsv4lab.benchmarks.moe import FLASH, SWIGLU_LIMIT, _random_experts, fp4_bytes
    from dsv4lab.ops import fused_moe, route
    gen = torch.Generator(device="cuda").manual_seed(0)
    E, H, I, k = FLASH["E"], FLASH["H"], FLASH["I"], FLASH["topk"]
    ex = _random_experts(E, H, I, "mxfp4", "cuda", gen)
    for T in (1, 64):
        ids, w = route(torch.randn(T, E, device="cuda", generator=gen),
                       torch.randn(E, device="cuda", generator=gen) * 0.1, topk=k)
        hit = int(torch.unique(ids).numel())
        x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)

        def moe(x=x, ids=ids, w=w):
            return fused_moe(x, ex["w13"], ex["w13_scale"], ex["w2"], ex["w2_scale"], ids, w,
                             fmt="mxfp4", swiglu_limit=SWIGLU_LIMIT, backend="triton")
        mb = fp4_bytes(hit, H, I, "mxfp4") / 1e6
        t = {f: median_us(moe, f) for f in ("write", "read", "none")}
        print(f"{f'moe T={T} ({hit} hit)':<22} {mb:>6.1f} {t['write']:>9.1f} {t['read']:>9.1f} "
              f"{t['none']:>9.1f} {mb * 1e3 / t['write']:>7.0f} {mb * 1e3 / t['read']:>7.0f}")


if __name__ == "__main__":
    main()
