"""Where a fused_moe call's GPU time goes, kernel by kernel (torch.profiler, CUDA activity).

    python scripts/profile_moe.py [--tokens 1 64] [--reps 20]
    python scripts/profile_moe.py --timeline      # inside the T = 1 one-launch decode
    python scripts/profile_moe.py --timeline --variant mma2_acc_scale_t1   # a bench variant's
    python scripts/profile_moe.py --timeline --launch '{"TILED": true}'   # launch keys over it
    python scripts/profile_moe.py --graph [--variant NAME]   # kernels inside the timed replay

``--graph``: the T = 1 call as ``dsv4lab bench moe`` times it (a CUDA graph replayed after
the L2 flush), each replay's kernels with their start and end against the replay's events:
how much of the timed figure is the kernels and how much is launch and the gaps between; then
the same for a graph of one small torch kernel, the floor every graph-timed row carries.

``--timeline``: the table's T = 1 config (at Flash's sizes kernels/moe_simt.py's one-launch
decode since session 22; ``--launch '{"SIMT": false}'`` for kernels/moe_mma2.py's FUSED launch)
with each tile's %globaltimer stamps (moe_mma2.TIMELINE_POINTS): when the gate/up and down tiles
start, wait, loop and end, and how many run at once over the launch.

Flash shape (E 256, H 4096, I 2048, top-6), random MXFP4 experts as in ``dsv4lab bench moe``;
one table per (backend/variant, T): each kernel's total GPU time over ``reps`` calls, its share,
and the time per call. A diagnosis aid for kernels/moe.py and kernels/moe_scaled.py; the
benchmark (CUDA-graph timing, recorded rows) stays ``dsv4lab bench moe``.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

if "--timeline" in sys.argv:      # read when kernels/moe_mma2.py is imported
    os.environ["DSV4LAB_MOE_TIMELINE"] = "1"

import torch
from torch.profiler import ProfilerActivity, profile

import dsv4lab  # noqa: F401  (configures the runtime before triton is imported)
from dsv4lab.benchmarks.moe import (FLASH, SWIGLU_LIMIT, VARIANTS, _random_experts, experts_for,
                                    token_case)
from dsv4lab.ops import fused_moe


def _kernel_times(fn, reps: int) -> dict[str, float]:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            total[ev.name] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--cases", nargs="*", default=None, help="names to profile (default: all)")
    ap.add_argument("--timeline", action="store_true", help="stamps inside the T = 1 fused launch")
    ap.add_argument("--graph", action="store_true", help="kernels inside the timed T = 1 replay")
    ap.add_argument("--variant", default=None,
                    help="with --timeline or --graph: a fused variant of dsv4lab.benchmarks.moe.VARIANTS "
                         "instead of the table's T = 1 config")
    ap.add_argument("--launch", default=None,
                    help="with --timeline or --graph: JSON of moe_mma2 launch keys over the config's "
                         "MMA2 entry, e.g. '{\"TILED\": true}'")
    ap.add_argument("--no-flush", action="store_true",
                    help="with --timeline: no L2 flush before each stamped call (the benchmark flushes)")
    args = ap.parse_args()
    if args.timeline or args.graph:
        cfg = None
        if args.variant is not None:
            fused = {n: c for n, c in VARIANTS if (c.get("MMA2") or {}).get("FUSED")}
            if args.variant not in fused:
                ap.error(f"--variant: one of the fused variants {list(fused)}, "
                         f"got {args.variant!r}")
            cfg = fused[args.variant]
        label = args.variant or "the table's T = 1 config"
        if args.launch is not None:
            import json
            from dsv4lab.kernels.moe import config_for
            cfg = dict(cfg or config_for(1, FLASH["topk"], FLASH["E"], "mxfp4"))
            cfg["MMA2"] = dict(cfg["MMA2"], **json.loads(args.launch))
            label += f" with {args.launch}"
        if args.graph:
            graph_spans(_t1_case(cfg), args.reps, label=label)
            small = torch.zeros(4096, device="cuda")      # the floor any graph-timed row carries
            return graph_spans(lambda: small.add_(1.0), args.reps, label="one small torch kernel")
        return fused_timeline(config=cfg, label=label, flush=not args.no_flush)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    E, H, I, k = FLASH["E"], FLASH["H"], FLASH["I"], FLASH["topk"]
    ex = _random_experts(E, H, I, "mxfp4", dev, gen)
    cases = [("triton", "triton", None)] + [(name, "triton", cfg) for name, cfg in VARIANTS] \
        + [("triton_scaled", "triton_scaled", None)]
    if args.cases:
        cases = [c for c in cases if c[0] in args.cases]
    for T in args.tokens:
        ids, w, x = token_case(T, E, H, k, dev, gen)
        for name, backend, cfg in cases:
            def call():
                return fused_moe(x, ex["w13"], ex["w13_scale"], ex["w2"], ex["w2_scale"], ids, w,
                                 fmt="mxfp4", swiglu_limit=SWIGLU_LIMIT, backend=backend, kernel_config=cfg)
            try:
                times = _kernel_times(call, args.reps)
            except Exception as e:  # a variant this Triton cannot build: say so, go on
                print(f"T={T} {name}: {type(e).__name__}: {e}")
                continue
            tot = sum(times.values())
            print(f"T={T} {name}: {tot / args.reps:.1f} us a call (GPU kernel time)")
            for kname, t in sorted(times.items(), key=lambda kv: -kv[1]):
                print(f"    {t / args.reps:9.1f} us  {100 * t / tot:5.1f}%  {kname[:90]}")


def _t1_case(config):
    """The T = 1 case of the timeline and --graph: MXFP4 experts (packed as ``config`` reads
    them), one token's routing and x drawn by the benchmarks' ``token_case`` (its selection
    bias included), and the call."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    E, H, I, k = FLASH["E"], FLASH["H"], FLASH["I"], FLASH["topk"]
    ex = experts_for(_random_experts(E, H, I, "mxfp4", dev, gen), config, "mxfp4", 1)
    ids, w, x = token_case(1, E, H, k, dev, gen)
    return lambda: fused_moe(x, ex["w13"], ex["w13_scale"], ex["w2"], ex["w2_scale"], ids, w,
                             fmt="mxfp4", swiglu_limit=SWIGLU_LIMIT, backend="triton",
                             kernel_config=config)


def graph_spans(call, reps: int = 20, label="the table's T = 1 config") -> None:
    """Print, for ``call`` (e.g. :func:`_t1_case`'s) replayed from a CUDA graph after
    do_bench's L2 flush (as the benchmark times it), the median of: the replay's event-to-event
    time, each kernel's duration, the time from the flush's end to the first kernel and
    between kernels."""
    import statistics

    import triton
    from dsv4lab import bench
    graph = bench.capture_graph(call)[0]
    flush = triton.runtime.driver.active.get_empty_cache_for_benchmark()
    marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
             for _ in range(reps)]
    for _ in range(5):
        flush.zero_()
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for s, e in marks:
            flush.zero_()
            s.record()
            graph.replay()
            e.record()
        torch.cuda.synchronize()
    kernels = sorted((ev.time_range.start, ev.time_range.end, ev.name) for ev in prof.events()
                     if ev.device_type == torch.autograd.DeviceType.CUDA
                     and "memcpy" not in ev.name.lower() and "memset" not in ev.name.lower())
    # a replay's kernels: those after each flush (the fill kernel) up to the next one
    reps_k, cur = [], None
    for start, end, name in kernels:
        if "fill" in name.lower():          # torch's zero_ runs a FillFunctor kernel
            cur = [(start, end, "flush")]
            reps_k.append(cur)
        elif cur is not None:
            cur.append((start, end, name))
    figures = defaultdict(list)
    for r in reps_k:
        flush_end = r[0][1]
        prev = flush_end
        for i, (start, end, name) in enumerate(r[1:]):
            figures[f"gap before kernel {i}"].append(start - prev)
            figures[f"kernel {i}: {name[:60]}"].append(end - start)
            prev = end
        figures["flush end -> last kernel end"].append(prev - flush_end)
    figures["replay events (the benchmark's figure)"] = [s.elapsed_time(e) * 1e3 for s, e in marks]
    print(f"graph replay after the L2 flush ({label}), median of {len(reps_k)} replays, us:")
    for name, vals in figures.items():
        print(f"  {name:<70} {statistics.median(vals):8.2f}")


def fused_timeline(reps: int = 5, config=None, label="the table's T = 1 config",
                   flush: bool = True) -> None:
    """Print the T = 1 fused launch's timeline (median over ``reps`` calls of each figure), of
    the table's config or ``config`` (a full kernel config with a FUSED MMA2 entry); ``flush``:
    each call after do_bench's L2 flush, as the benchmark times it (otherwise the weights the
    last call left in the L2 are read from there)."""
    import statistics

    import triton
    from dsv4lab.kernels import moe_mma2
    call = _t1_case(config)
    cache = triton.runtime.driver.active.get_empty_cache_for_benchmark() if flush else None
    figures = defaultdict(list)
    for rep in range(reps + 1):
        if cache is not None:
            cache.zero_()
        call()
        torch.cuda.synchronize()
        st, n_gu = moe_mma2.timeline()
        st = st.cpu().double()
        if rep == 0:
            continue                            # compile and first touch
        t0 = st[:, 0].min()
        us = lambda v: float(v) / 1e3           # noqa: E731
        gu, dn = st[:n_gu], st[n_gu:]
        end = lambda a: a[:, 4]                 # noqa: E731
        figures["launch span"].append(us(end(st).max() - t0))
        figures["gate/up: last start"].append(us(gu[:, 0].max() - t0))
        figures["gate/up: last end"].append(us(end(gu).max() - t0))
        figures["gate/up: tile median"].append(us((end(gu) - gu[:, 0]).median()))
        figures["gate/up: ticket median"].append(us((gu[:, 1] - gu[:, 0]).median()))
        live = gu[:, 2] > 0
        figures["gate/up: setup median"].append(us((gu[live, 2] - gu[live, 1]).median()))
        figures["gate/up: loop median"].append(us((gu[live, 3] - gu[live, 2]).median()))
        figures["gate/up: after loop median"].append(us((gu[live, 4] - gu[live, 3]).median()))
        live = dn[:, 2] > 0
        figures["down: first start"].append(us(dn[:, 0].min() - t0))
        figures["down: last start"].append(us(dn[:, 0].max() - t0))
        figures["down: first loop start"].append(us(dn[live, 2].min() - t0))
        figures["down: last end"].append(us(end(dn).max() - t0))
        figures["down: wait median"].append(us((dn[live, 2] - dn[live, 1]).median()))
        figures["down: loop median"].append(us((dn[live, 3] - dn[live, 2]).median()))
        figures["down: after loop median"].append(us((dn[live, 4] - dn[live, 3]).median()))
        figures["SMs used"].append(float(st[:, 5].unique().numel()))
        # the stragglers: loop time against how many tiles of the same phase share the SM
        for phase, a in (("gate/up", gu), ("down", dn)):
            a = a[a[:, 2] > 0]
            sm = a[:, 5].long()
            per_sm = torch.bincount(sm, minlength=int(st[:, 5].max()) + 1)[sm]
            loop = a[:, 3] - a[:, 2]
            for n in per_sm.unique().tolist():
                figures[f"{phase}: loop median, {n} an SM"].append(us(loop[per_sm == n].median()))
            q = torch.tensor([0.1, 0.5, 0.9, 1.0], dtype=torch.float64)
            figures[f"{phase}: program start p10/p50/p90/max"].append(
                [round(us(v - t0), 1) for v in torch.quantile(a[:, 0], q)])
            figures[f"{phase}: loop start p10/p50/p90/max"].append(
                [round(us(v - t0), 1) for v in torch.quantile(a[:, 2], q)])
            figures[f"{phase}: loop end p10/p50/p90/max"].append(
                [round(us(v - t0), 1) for v in torch.quantile(a[:, 3], q)])
        span = float(end(st).max() - t0)
        bins = 12
        conc = []
        for b in range(bins):
            tb = t0 + span * (b + 0.5) / bins
            conc.append(int(((st[:, 0] <= tb) & (end(st) > tb)).sum()))
        figures["tiles running at 1/12 .. 12/12 of the span"].append(conc)
    print(f"T = 1 fused decode ({label}), {st.shape[0]} tiles ({n_gu} gate/up), median of "
          f"{reps} calls{' after the L2 flush' if flush else ' (no L2 flush)'}:")
    for name, vals in figures.items():
        if isinstance(vals[0], list):
            print(f"  {name}: {[round(statistics.median(c), 1) for c in zip(*vals)]}")
        else:
            print(f"  {name:<28} {statistics.median(vals):8.2f}" + ("" if name == "SMs used" else " us"))


if __name__ == "__main__":
    main()
