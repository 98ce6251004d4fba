"""Timing, and the registry of named benchmarks behind ``dsv4lab bench NAME``.

On a GPU, :func:`time_fn` uses ``triton.testing.do_bench`` (CUDA events, warm-up,
median); :func:`time_graph` captures the call in a CUDA graph first, so launch gaps stay
out of decode-sized figures. On the CPU it reports the median wall time and labels it
"interpreter_wall": those numbers say how slow the interpreter is, nothing about a GPU.

A benchmark is a function ``fn(smoke: bool) -> list[dict]`` registered with
:func:`benchmark`; each row holds the shape parameters, the backend, ``ms``, ``timing``,
and where it applies ``bytes``, ``flops``, ``roofline_ms`` and ``roofline_fraction``.
:func:`run` records the rows with :mod:`dsv4lab.results`. The definitions live in
``dsv4lab.benchmarks`` (imported on demand).

Explained in notebooks/00_tour.ipynb.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from dsv4lab import results, roofline, runtime


def time_fn(fn: Callable[[], object], *, warmup_ms: float = 25, rep_ms: float = 100,
            cpu_reps: int = 3) -> dict:
    """Median time of ``fn()`` in ms: ``{"ms": ..., "timing": "cuda_events" | "interpreter_wall"}``."""
    if runtime.has_cuda():
        import triton.testing
        ms = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
        return {"ms": float(ms), "timing": "cuda_events"}
    fn()  # warm-up (and interpreter set-up)
    times = []
    for _ in range(cpu_reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return {"ms": statistics.median(times), "timing": "interpreter_wall" if runtime.is_interpreter() else "cpu_wall"}


def capture_graph(fn: Callable[[], object]) -> tuple[torch.cuda.CUDAGraph, object]:
    """``(graph, out)``: ``fn`` called twice on a side stream (warm-up), then captured once
    in a CUDA graph; ``out`` is what the captured call returned (its buffers are the ones
    ``graph.replay()`` rewrites). GPU only. Explained in notebooks/03_indexer_capping.ipynb."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def time_graph(fn: Callable[[], object], *, warmup_ms: float = 25, rep_ms: float = 100) -> dict:
    """Like :func:`time_fn`, but replays ``fn`` from a CUDA graph on the GPU."""
    if not runtime.has_cuda():
        return time_fn(fn)
    import triton.testing
    graph = capture_graph(fn)[0]
    ms = triton.testing.do_bench(graph.replay, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    return {"ms": float(ms), "timing": "cuda_graph"}


def with_roofline(row: dict, *, bytes_moved: float, flops: float, dtype: str = "bf16",
                  device: str | None = None) -> dict:
    """Add bytes, flops, roofline_ms and roofline_fraction (vs the current device's roof)."""
    spec = roofline.device_spec(device)
    roof_ms = roofline.roofline_time(bytes_moved, flops, spec, dtype=dtype) * 1e3
    row.update(bytes=float(bytes_moved), flops=float(flops), roofline_device=spec.name,
               roofline_ms=roof_ms)
    if row.get("ms"):
        row["roofline_fraction"] = roof_ms / row["ms"]
    return row


@dataclass(frozen=True)
class Benchmark:
    name: str
    fn: Callable[[bool], list[dict]]
    description: str


_BENCHMARKS: dict[str, Benchmark] = {}


def benchmark(name: str, description: str = "") -> Callable:
    """Decorator registering ``fn(smoke: bool) -> rows`` as ``dsv4lab bench NAME``."""
    def deco(fn):
        _BENCHMARKS[name] = Benchmark(name, fn, description or (fn.__doc__ or "").strip().split("\n")[0])
        return fn
    return deco


def registered() -> dict[str, Benchmark]:
    import dsv4lab.benchmarks  # noqa: F401  (imports every definition module)
    return dict(_BENCHMARKS)


def run(name: str, *, smoke: bool = False, record: bool | None = None) -> list[dict]:
    """Run benchmark ``name``; append its rows to data/results/<name>.jsonl when ``record``.

    ``record`` defaults to ``not smoke``: smoke rows (tiny shapes, often the interpreter)
    say nothing a reader should plot, so they are only kept when asked for.
    """
    if record is None:
        record = not smoke
    table = registered()
    if name not in table:
        raise KeyError(f"unknown benchmark {name!r}; known: {', '.join(sorted(table))}")
    rows = table[name].fn(smoke)
    for row in rows:
        row.setdefault("smoke", smoke)
    if record and rows:
        results.record(name, rows)
    return rows
