"""Timing, and the registry of named benchmarks behind ``dsv4lab bench NAME``.

On a GPU, :func:`time_fn` uses ``triton.testing.do_bench`` (CUDA events, warm-up,
median): the eager call, host included, as a notebook calls it. :func:`time_graph`
captures the call in a CUDA graph first and times the replay, as a captured decode step
runs it. Benchmarks label their rows ``mode="eager"`` or ``mode="graph"``. On the CPU both
report the median wall time and label it "interpreter_wall": those numbers say how slow
the interpreter is, nothing about a GPU.

The L2 state before each timed call (the row's ``l2``) is part of the method:

- ``"dirty"`` (the default, and every row recorded before the field existed):
  ``do_bench``'s own flush, which zero-fills a 256 MB buffer. The L2 ends full of dirty
  lines, so the timed call's first misses write them back to DRAM: up to an L2's worth
  of traffic the call did not cause (``dsv4lab bench l2`` measures it).
- ``"clean"``: the same loop, but the flush *reads* a 256 MB buffer, so the call starts
  with its data out of the L2 and nothing to write back.

``DSV4LAB_L2=clean`` (or ``l2="clean"``) selects the second. The campaign's goals were
set with the first, and :mod:`dsv4lab.targets` judges them on ``"dirty"`` rows only.

A benchmark is a function ``fn(smoke: bool) -> list[dict]`` registered with
:func:`benchmark`; each row holds the shape parameters, the backend, ``ms``, ``timing``,
``mode``, and where it applies ``bytes``, ``flops``, ``roofline_ms`` and
``roofline_fraction``. :func:`run` returns the rows with their provenance (GPU, versions,
commit, date: :func:`dsv4lab.results.provenance`), recorded or not, and records them with
:mod:`dsv4lab.results` when asked. The definitions live in ``dsv4lab.benchmarks``, which
registers them when imported (``dsv4lab.benchmarks.run`` imports and runs).

Explained in notebooks/00_tour.ipynb.
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from dsv4lab import results, roofline, runtime


L2_STATES = ("dirty", "clean")
_FLUSH_BYTES = 256 * 2**20          # do_bench's flush size: several times any L2 in the table


def l2_state(l2: str | None = None) -> str:
    """``l2`` if given, else ``$DSV4LAB_L2``, else ``"dirty"``; checked against :data:`L2_STATES`."""
    state = l2 if l2 is not None else (os.environ.get("DSV4LAB_L2") or "dirty")
    if state not in L2_STATES:
        raise ValueError(f"l2 (or DSV4LAB_L2) must be one of {', '.join(L2_STATES)}, got {state!r}")
    return state


def _median_after_clean_l2(fn: Callable[[], object], warmup_ms: float, rep_ms: float) -> float:
    """``do_bench``'s loop (estimate, warm-up, per-call events, median) with a reading flush."""
    buf = torch.empty(_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    total = torch.empty((), dtype=torch.int64, device="cuda")

    def flush():
        torch.sum(buf, 0, dtype=torch.int64, out=total)

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate_ms = start.elapsed_time(end) / 5
    for _ in range(max(1, int(warmup_ms / estimate_ms))):
        fn()
    n = max(1, int(rep_ms / estimate_ms))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for s, e in zip(starts, ends):
        flush()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def _median_ms(fn: Callable[[], object], warmup_ms: float, rep_ms: float, l2: str) -> float:
    if l2 == "clean":
        return _median_after_clean_l2(fn, warmup_ms, rep_ms)
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def time_fn(fn: Callable[[], object], *, warmup_ms: float = 25, rep_ms: float = 100,
            cpu_reps: int = 3, l2: str | None = None) -> dict:
    """Median time of ``fn()`` in ms: ``{"ms", "timing": "cuda_events" | "interpreter_wall",
    "l2"}`` (GPU rows; ``l2``: the cache state before each call, see the module docstring)."""
    l2 = l2_state(l2)
    if runtime.has_cuda():
        return {"ms": _median_ms(fn, warmup_ms, rep_ms, l2), "timing": "cuda_events", "l2": l2}
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
    with runtime.cuda_graph_capture(graph):
        out = fn()
    return graph, out


def time_graph(fn: Callable[[], object], *, warmup_ms: float = 25, rep_ms: float = 100,
               l2: str | None = None) -> dict:
    """Like :func:`time_fn`, but replays ``fn`` from a CUDA graph on the GPU."""
    l2 = l2_state(l2)
    if not runtime.has_cuda():
        return time_fn(fn)
    graph = capture_graph(fn)[0]
    return {"ms": _median_ms(graph.replay, warmup_ms, rep_ms, l2), "timing": "cuda_graph", "l2": l2}


def with_roofline(row: dict, *, bytes_moved: float, flops: float, dtype: str = "bf16",
                  device: str | None = None) -> dict:
    """Add bytes, flops, roofline_ms and roofline_fraction (vs the current device's roof;
    ``roofline_note`` when the device is not in :data:`dsv4lab.roofline.DEVICES` and the
    H200's figures stand in)."""
    spec = roofline.device_spec(device)
    roof_ms = roofline.roofline_time(bytes_moved, flops, spec, dtype=dtype) * 1e3
    row.update(bytes=float(bytes_moved), flops=float(flops), roofline_device=spec.name,
               roofline_ms=roof_ms)
    if spec.note:
        row["roofline_note"] = spec.note
    if row.get("ms"):
        row["roofline_fraction"] = roof_ms / row["ms"]
    return row


@dataclass(frozen=True)
class Benchmark:
    name: str
    fn: Callable[[bool], list[dict]]
    description: str


_BENCHMARKS: dict[str, Benchmark] = {}
_UNAVAILABLE: dict[str, str] = {}       # name -> why its definition could not be imported


def benchmark(name: str, description: str = "") -> Callable:
    """Decorator registering ``fn(smoke: bool) -> rows`` as ``dsv4lab bench NAME``."""
    def deco(fn):
        _BENCHMARKS[name] = Benchmark(name, fn, description or (fn.__doc__ or "").strip().split("\n")[0])
        _UNAVAILABLE.pop(name, None)
        return fn
    return deco


def unavailable(name: str, reason: str) -> None:
    """Note that benchmark ``name``'s definition failed to import (``dsv4lab.benchmarks``
    does, per module), so that asking for it says why instead of "unknown"."""
    _UNAVAILABLE[name] = reason


def registered() -> dict[str, Benchmark]:
    """The benchmarks registered so far (``import dsv4lab.benchmarks`` registers them all)."""
    return dict(_BENCHMARKS)


def unavailable_reasons() -> dict[str, str]:
    """{name: reason} of the benchmarks whose definitions could not be imported."""
    return dict(_UNAVAILABLE)


def run(name: str, *, smoke: bool = False, record: bool | None = None, **options) -> list[dict]:
    """Run benchmark ``name``; return its rows, each with this run's provenance
    (:data:`dsv4lab.results.PROVENANCE_KEYS`, ``bench`` and ``smoke``), and append them to
    data/results/<name>.jsonl when ``record``. ``options`` go to the benchmark's function
    (e.g. ``headline=True``: only the headline cases, where a benchmark offers that).

    ``record`` defaults to ``not smoke``: smoke rows (tiny shapes, often the interpreter)
    say nothing a reader should plot, so they are only kept when asked for.
    """
    if record is None:
        record = not smoke
    if name not in _BENCHMARKS:
        if name in _UNAVAILABLE:
            raise RuntimeError(f"benchmark {name!r} could not be imported: {_UNAVAILABLE[name]}")
        known = ", ".join(sorted(_BENCHMARKS)) or "none registered: import dsv4lab.benchmarks"
        raise KeyError(f"unknown benchmark {name!r}; known: {known}")
    rows = _BENCHMARKS[name].fn(smoke, **options)
    for row in rows:
        row.setdefault("smoke", smoke)
    rows = results.with_provenance(name, rows)
    if record and rows:
        results.record(name, rows)
    return rows
