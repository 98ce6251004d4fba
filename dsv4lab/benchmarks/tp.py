"""``dsv4lab bench tp``: tensor-parallel decode of real-size DeepSeek-V4-Flash layers.

Full mode (GPUs): for each TP degree in 1, 2, 4 that the machine's GPUs allow, one
``torchrun --standalone --nproc-per-node N -m dsv4lab.tp`` launch (NCCL,
``NCCL_NVLS_ENABLE=0``): the three real-size layers (ratio 0, 4, 128) of preset "after"
sharded N ways, checked against world size 1 (``--check``), timed per component at
concurrency 1, 8, 64 (512-token contexts) inside one CUDA graph, extrapolated to 43
layers; then the measured all-reduce bandwidth (the step's message sizes and 1-256 MiB)
against NVLink's datasheet. TP degrees the machine cannot run are recorded as
``kind: "skipped"`` rows with the reason, and printed. Every run adds the analytic rows
(:func:`dsv4lab.tp.analytic_rows`: TP 1, 2, 4 at concurrency 1, 8, 64 over PCIe Gen5 on
the campaign's RTX PRO 6000 box and over NVLink on H200).

Smoke mode (and no GPU): the mini config, TP=2 with gloo on the CPU, the torch reference
backends in fp32, concurrency 1 and 2, checked against world size 1: a few seconds, and
the timings are wall-clock times of two CPU processes.

A time budget (``$DSV4LAB_TP_BUDGET_S``, 420 s by default) skips the TP degrees left
when it is nearly spent; each launch has its own timeout.
Explained in notebooks/06_decode_step_at_scale.ipynb.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from dsv4lab import runtime
from dsv4lab import tp as T
from dsv4lab.bench import benchmark

TPS = (1, 2, 4)
CONCURRENCIES = (1, 8, 64)
CONTEXT = 512
DEFAULT_BUDGET_S = 420.0
LAUNCH_TIMEOUT_S = 300


def torchrun_command(nproc: int, args: list[str]) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node N -m dsv4lab.tp ARGS``."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "dsv4lab.tp", *args]


def launch(nproc: int, args: list[str], *, timeout: float = LAUNCH_TIMEOUT_S, verbose: bool = True) -> list[dict]:
    """Run one TP world; return its rows (rank 0's ``--out``), or one error row."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        env = dict(os.environ, NCCL_NVLS_ENABLE="0", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        cmd = torchrun_command(nproc, [*args, "--out", out])
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
            rc, text = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            rc, text = "timeout", f"{e.stdout or ''}{e.stderr or ''}"
            text = text.decode() if isinstance(text, bytes) else text
        wall = time.perf_counter() - t0
        if verbose:
            for line in text.splitlines():
                if line.startswith(("TP", "tp:", "model ")):
                    print(line, flush=True)
        rows = []
        if os.path.exists(out):
            with open(out) as f:
                rows = json.load(f)
        if (rc != 0 and not rows) or rc not in (0, 1):
            tail = "\n".join(text.strip().splitlines()[-15:])
            if verbose:
                print(f"TP{nproc} launch failed (rc {rc}):\n{tail}", flush=True)
            rows.append({"kind": "error", "tp": nproc, "error": f"rc {rc}: {tail}"[-1500:], "wall_s": wall})
        for r in rows:
            r.setdefault("wall_s", wall)
            r["command"] = " ".join(["torchrun", "--standalone", f"--nproc-per-node={nproc}", "-m", "dsv4lab.tp", *args])
        return rows


def measure(*, smoke: bool, budget_s: float | None = None, verbose: bool = True) -> list[dict]:
    """The grid of the module docstring; rows out (also printed one a line)."""
    t0 = time.perf_counter()
    budget = float(budget_s if budget_s is not None else os.environ.get("DSV4LAB_TP_BUDGET_S", DEFAULT_BUDGET_S))
    n_gpu = torch.cuda.device_count() if runtime.has_cuda() else 0
    rows: list[dict] = []
    if smoke or n_gpu == 0:
        args = ["--model", "mini", "--preset", "torch", "--backend", "gloo", "--dtype", "fp32",
                "--concurrency", "1,2", "--reps", "1", "--check", "--allreduce-sizes", "1024,65536"]
        rows += launch(2, args, timeout=120, verbose=verbose)
        skipped = [(n, "smoke mode: mini config, gloo on the CPU, TP=2 only" if smoke else
                    "no CUDA GPU: gloo on the CPU, mini config, TP=2 only") for n in TPS if n != 2]
    else:
        args = ["--model", "flash", "--preset", "after", "--concurrency", ",".join(map(str, CONCURRENCIES)),
                "--context", str(CONTEXT), "--check"]
        skipped, last = [], 0.0
        for n in TPS:
            if n > n_gpu:
                skipped.append((n, f"needs {n} GPUs, this machine has {n_gpu}"))
                continue
            if time.perf_counter() - t0 + 1.2 * last > budget:
                skipped.append((n, f"time budget {budget:.0f} s spent"))
                continue
            t1 = time.perf_counter()
            rows += launch(n, args, timeout=min(LAUNCH_TIMEOUT_S, max(60.0, budget - (time.perf_counter() - t0))),
                           verbose=verbose)
            last = time.perf_counter() - t1
    for n, why in skipped:
        rows.append({"kind": "skipped", "tp": n, "reason": why})
        if verbose:
            print(f"TP{n} skipped: {why}", flush=True)
    an = T.analytic_rows(tps=TPS, concurrencies=CONCURRENCIES, context=CONTEXT)
    rows += an
    if verbose:
        for r in an:
            print(T.format_row(r))
        print(f"tp: {len(rows)} rows in {time.perf_counter() - t0:.1f} s", flush=True)
    return rows


@benchmark("tp", "tensor-parallel decode: per-component time, all-reduce bandwidth, PCIe/NVLink model")
def tp_bench(smoke: bool) -> list[dict]:
    """TP 1/2/4 per component + all-reduce bandwidth + the analytic rows (module docstring)."""
    return measure(smoke=smoke)
