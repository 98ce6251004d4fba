"""``dsv4lab bench pd``: prefill-decode disaggregation against co-located serving.

Full mode (GPUs): one process world of :mod:`dsv4lab.drivers.pd_run` over the real-size
layers of DeepSeek-V4-Flash (one of each attention kind, preset "after": MMA attention over
the FP8 KV cache, the Triton indexer and MoE), iterations replayed from CUDA graphs and
extrapolated to 43 layers: 16 requests of 2,048 and of 8,192 prompt tokens wanting 64 tokens
each, arriving at 0.25, 0.5 and 0.75 of what one prefill GPU absorbs, chunks of 2,048
tokens; the first prompt length's middle load also eagerly (``mode`` "eager").

- with two or more GPUs: a torchrun world of two ranks (NCCL, ``NCCL_NVLS_ENABLE=0``): rank 0
  serves co-located, then prefills and hands the caches to rank 1, which decodes: the transfer
  measured on the link, and the link's bandwidth at the payload sizes and 1-256 MiB;
- with one GPU: both workers on it, one after the other in virtual time (the schedule of two
  GPUs), the link's time from the analytic model; ``link`` says "modelled".

Rows: ``kind`` "calibration", "colocated", "disaggregated" (``tokens_identical``: the greedy
tokens equal the co-located run's), "transfer", "skipped", "error", plus the analytic rows
(:func:`dsv4lab.drivers.pd_model.model_rows`, ``kind`` "model"; hand-off bytes by context,
``kind`` "kv_bytes").

Smoke mode (and no GPU): the tiny config, the fp32 torch references, two gloo processes on
the CPU, 4 requests: a few seconds, wall-clock times of the CPU (mechanics only).

A time budget (``$DSV4LAB_PD_BUDGET_S``, 360 s of serving by default) skips the points left.
Explained in notebooks/07_prefill_decode.ipynb.
"""
from __future__ import annotations

import os
import time
from dataclasses import replace

import torch

from dsv4lab import runtime
from dsv4lab.bench import benchmark
from dsv4lab.drivers import pd_model, pd_run

DEFAULT_BUDGET_S = 360.0
LAUNCH_TIMEOUT_S = 590

SMOKE_OPTIONS = pd_run.PDRunOptions(model="tiny", preset="torch", dtype="fp32", backend="gloo", n_requests=4,
                                    prompt_lens=(24,), output_len=6, loads=(0.5,), chunk=16, max_batch=8)
FULL_OPTIONS = pd_run.PDRunOptions(model="flash", preset="after", dtype="bf16", n_requests=16,
                                   prompt_lens=(2048, 8192), output_len=64, loads=(0.25, 0.5, 0.75),
                                   chunk=2048, max_batch=64, eager_headline=True)
NOTEBOOK_OPTIONS = replace(FULL_OPTIONS, prompt_lens=(8192,), loads=(0.25, 0.75), eager_headline=False)


def measure(*, smoke: bool, options: pd_run.PDRunOptions | None = None, budget_s: float | None = None,
            verbose: bool = True) -> list[dict]:
    """The runs of the module docstring (``options`` instead of :data:`FULL_OPTIONS` on GPUs:
    notebook 07 measures :data:`NOTEBOOK_OPTIONS`); rows out (also printed one a line)."""
    t0 = time.perf_counter()
    budget = float(budget_s if budget_s is not None else os.environ.get("DSV4LAB_PD_BUDGET_S", DEFAULT_BUDGET_S))
    n_gpu = torch.cuda.device_count() if runtime.has_cuda() else 0
    if smoke or n_gpu == 0:
        rows = pd_run.launch(SMOKE_OPTIONS, nproc=2, timeout=300, verbose=verbose)
    else:
        nproc = 2 if n_gpu >= 2 else 1
        opts = replace(options or FULL_OPTIONS, budget_s=budget)
        rows = pd_run.launch(opts, nproc=nproc, timeout=LAUNCH_TIMEOUT_S, verbose=verbose)
    rows += pd_model.model_rows()
    rows += pd_model.context_rows()
    if verbose:
        print(f"pd: {len(rows)} rows in {time.perf_counter() - t0:.1f} s", flush=True)
    return rows


@benchmark("pd", "prefill-decode disaggregation: TPOT/TTFT co-located vs split, the KV hand-off, its model")
def pd_bench(smoke: bool) -> list[dict]:
    """Co-located vs disaggregated serving + the hand-off's bandwidth + the analytic rows."""
    return measure(smoke=smoke)
