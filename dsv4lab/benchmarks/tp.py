"""``dsv4lab bench tp``: tensor-parallel decode of real-size DeepSeek-V4-Flash layers.

Full mode (GPUs): for each TP degree in 1, 2, 4 that the machine's GPUs allow, one torchrun
world (:func:`dsv4lab.drivers.tp_run.launch`; NCCL, ``NCCL_NVLS_ENABLE=0``): the three
real-size layers (ratio 0, 4, 128) of preset "after" sharded N ways, checked against world
size 1, timed per component at concurrency 1, 8, 64 (512-token contexts) inside one CUDA
graph (``mode="graph"``), extrapolated to 43 layers; then the measured all-reduce bandwidth
(the step's message sizes and 1-256 MiB, eager calls) against NVLink's datasheet. TP degrees
the machine cannot run are recorded as ``kind: "skipped"`` rows with the reason. Every run
adds the analytic rows (:func:`dsv4lab.drivers.analytic.analytic_rows`: TP 1, 2, 4 at
concurrency 1, 8, 64 over PCIe Gen5 on the campaign's RTX PRO 6000 box and over NVLink on
H200).

Smoke mode (and no GPU): the mini config, TP=2 with gloo on the CPU, the torch reference
backends in fp32, concurrency 1 and 2, checked against world size 1: a few seconds, and the
timings are wall-clock times of two CPU processes.

A time budget (``$DSV4LAB_TP_BUDGET_S``, 420 s by default) skips the TP degrees left when it
is nearly spent; each launch has its own timeout.
Explained in notebooks/06_decode_step_at_scale.ipynb.
"""
from __future__ import annotations

import os
import time

import torch

from dsv4lab import runtime
from dsv4lab.bench import benchmark
from dsv4lab.drivers import analytic, tp_run

TPS = (1, 2, 4)
CONCURRENCIES = (1, 8, 64)
CONTEXT = 512
DEFAULT_BUDGET_S = 420.0
LAUNCH_TIMEOUT_S = 300

SMOKE_OPTIONS = tp_run.TPRunOptions(model="mini", preset="torch", backend="gloo", dtype="fp32",
                                    concurrency=(1, 2), reps=1, check=True, allreduce_sizes=(1024, 65536))
FULL_OPTIONS = tp_run.TPRunOptions(model="flash", preset="after", concurrency=CONCURRENCIES,
                                   context=CONTEXT, check=True)


def measure(*, smoke: bool, budget_s: float | None = None, verbose: bool = True) -> list[dict]:
    """The grid of the module docstring; rows out (also printed one a line)."""
    t0 = time.perf_counter()
    budget = float(budget_s if budget_s is not None else os.environ.get("DSV4LAB_TP_BUDGET_S", DEFAULT_BUDGET_S))
    n_gpu = torch.cuda.device_count() if runtime.has_cuda() else 0
    rows: list[dict] = []
    if smoke or n_gpu == 0:
        rows += tp_run.launch(2, SMOKE_OPTIONS, timeout=120, verbose=verbose)
        skipped = [(n, "smoke mode: mini config, gloo on the CPU, TP=2 only" if smoke else
                    "no CUDA GPU: gloo on the CPU, mini config, TP=2 only") for n in TPS if n != 2]
    else:
        skipped, last = [], 0.0
        for n in TPS:
            if n > n_gpu:
                skipped.append((n, f"needs {n} GPUs, this machine has {n_gpu}"))
                continue
            if time.perf_counter() - t0 + 1.2 * last > budget:
                skipped.append((n, f"time budget {budget:.0f} s spent"))
                continue
            t1 = time.perf_counter()
            rows += tp_run.launch(n, FULL_OPTIONS, verbose=verbose,
                                  timeout=min(LAUNCH_TIMEOUT_S, max(60.0, budget - (time.perf_counter() - t0))))
            last = time.perf_counter() - t1
    for n, why in skipped:
        rows.append({"kind": "skipped", "tp": n, "reason": why})
        if verbose:
            print(f"TP{n} skipped: {why}", flush=True)
    an = analytic.analytic_rows(tps=TPS, concurrencies=CONCURRENCIES, context=CONTEXT)
    rows += an
    if verbose:
        for r in an:
            print(tp_run.format_row(r))
        print(f"tp: {len(rows)} rows in {time.perf_counter() - t0:.1f} s", flush=True)
    return rows


@benchmark("tp", "tensor-parallel decode: per-component time, all-reduce bandwidth, PCIe/NVLink model")
def tp_bench(smoke: bool) -> list[dict]:
    """TP 1/2/4 per component + all-reduce bandwidth + the analytic rows (module docstring)."""
    return measure(smoke=smoke)
