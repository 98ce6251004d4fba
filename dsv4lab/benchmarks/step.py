"""``dsv4lab bench step``: the decode step at real scale, before and after, per component.

Full mode (a GPU): three real-size DeepSeek-V4-Flash layers (ratio 0, 4, 128) + head, one
CUDA graph per configuration with timing events between components
(:mod:`dsv4lab.drivers.step`), tokens/s extrapolated to the 43-layer model. Every row is the
graph replay of the captured step (``mode="graph"``); the headline cases (:data:`HEADLINE`)
also record the same step called eagerly (``mode="eager"``: host gaps included). A
configuration that cannot be captured ("moe_torch") is timed eagerly only. The grid, in the
order it runs (a time budget, 120 s by default or ``$DSV4LAB_STEP_BUDGET_S``, skips what is
left and says so, because a killed benchmark records nothing):

1. the targets at concurrency 64, 512-token contexts: "before" (1M max context), the indexer
   fix alone ("indexer_triton"), the campaign's cap ("cap_8k"), "after" at max context
   8,192 / 131,072 / 1,048,576;
2. the released formats: "after" (FP8 projections) beside "after_bf16_proj" at concurrency
   1 and 64; then "before" and "after" at concurrency 1, 8, 32, 128 (512-token contexts);
3. the other single changes and the ablations of "after" at concurrency 64;
4. 131,072-token contexts: "after" at every concurrency, "before" at 1, 8, 64, 128;
5. the rest ("moe_torch", more ablations).

Smoke mode: the same driver on ``DSV4Config.mini()`` in Triton's interpreter ("before" and
"after", batch 2, 40-token contexts): seconds, and the timings are interpreter wall times.

With a checkpoint in the released layout (``dsv4lab bench step --checkpoint DIR --layers
2,3,4``; :mod:`dsv4lab.checkpoint`), the driver measures those layers' real weights (kinds not
listed: random layers in the same formats; no ``--layers``: one layer of each kind) on
:data:`CHECKPOINT_GRID`, FP8 against bf16 projections; rows say ``weights`` "checkpoint".

Explained in notebooks/06_decode_step_at_scale.ipynb.
"""
from __future__ import annotations

import gc
import os
import time

import torch

from dsv4lab import runtime
from dsv4lab.drivers import presets as P
from dsv4lab.drivers import step as S
from dsv4lab.bench import benchmark
from dsv4lab.config import DSV4Config

CONCURRENCIES = (1, 8, 32, 64, 128)
CONTEXTS = (512, 131072)
MAX_CONTEXTS = (8192, 131072, 1048576)
DEFAULT_BUDGET_S = 120.0

# (preset, concurrency, context, max_context or None = the preset's)
TARGET_GRID = [
    ("before", 64, 512, None),
    ("indexer_triton", 64, 512, None),
    ("after", 64, 512, 8192),
    ("after", 64, 512, 131072),
    ("after", 64, 512, None),
    ("cap_8k", 64, 512, None),
]
# the released formats: FP8 projections ("after") beside bf16 ones
PROJECTION_GRID = [("after_bf16_proj", 64, 512, None), ("after", 1, 512, None), ("after_bf16_proj", 1, 512, None)]
FULL_GRID = (
    TARGET_GRID + PROJECTION_GRID
    + [(p, c, 512, None) for c in (1, 8, 32, 128) for p in ("after", "before")
       if (p, c, 512, None) not in PROJECTION_GRID]
    + [("mma", 64, 512, None), ("indexer_fp8", 64, 512, None),
       ("after_kv_bf16", 64, 512, None), ("after_simt", 64, 512, None),
       ("after_mhc_torch", 64, 512, None), ("after_mhc_torch", 8, 512, None)]
    + [("after", c, 131072, None) for c in CONCURRENCIES]
    + [("before", c, 131072, None) for c in (1, 8, 64, 128)]
    + [("moe_torch", 64, 512, None), ("indexer_triton", 64, 131072, None),
       ("after_simt", 8, 512, None), ("after_kv_bf16", 8, 512, None),
       ("after_simt", 128, 512, None), ("after_kv_bf16", 128, 512, None),
       ("before", 32, 131072, None)]
)
# what notebook 06 runs live on a GPU (a few minutes at most)
NOTEBOOK_GRID = TARGET_GRID + PROJECTION_GRID \
    + [(p, c, 512, None) for c in (1, 8, 128) for p in ("after", "before")
       if (p, c, 512, None) not in PROJECTION_GRID] \
    + [("mma", 64, 512, None)]
SMOKE_GRID = [("before", 2, 40, None), ("after", 2, 40, None)]
# a checkpoint's layers: the released formats against bf16 projections, and "before"
CHECKPOINT_GRID = [("after", 1, 512, None), ("after_bf16_proj", 1, 512, None), ("after", 64, 512, None),
                   ("after_bf16_proj", 64, 512, None), ("before", 64, 512, None)]
CHECKPOINT_SMOKE_GRID = [("after", 2, 40, None), ("after_bf16_proj", 2, 40, None)]
# the cases that also record the eager step (the targets, before/after at concurrency 1, and
# the projection formats)
HEADLINE = frozenset(TARGET_GRID + PROJECTION_GRID + [("before", 1, 512, None)] + CHECKPOINT_GRID)


def measure(grid, *, cfg: DSV4Config | None = None, budget_s: float | None = None,
            reps: int | None = None, verbose: bool = True, eager=HEADLINE, checkpoint=None,
            layers=None) -> list[dict]:
    """Run ``grid`` (tuples as above) on one :class:`~dsv4lab.drivers.step.StepDriver`; rows out.

    One row per configuration (its graph replay, or its eager step where it cannot be
    captured), plus an eager row for the items in ``eager`` on a GPU. Stops starting new
    configurations once ``budget_s`` is nearly spent (reports the rest as skipped on stdout).
    ``checkpoint`` (a directory) and ``layers`` (e.g. "2,3,4"): that checkpoint's layers.
    """
    t0 = time.perf_counter()
    budget = float(budget_s if budget_s is not None else os.environ.get("DSV4LAB_STEP_BUDGET_S", DEFAULT_BUDGET_S))
    if checkpoint is not None:
        driver = S.StepDriver(checkpoint=checkpoint, layers=layers)
    else:
        driver = S.StepDriver(cfg or (DSV4Config.flash() if runtime.has_cuda() else DSV4Config.mini()))
    cfg = driver.cfg
    if verbose:
        print(f"step: {cfg.name} layers {dict(driver.measured)} (ratio: layer ids, weights "
              f"{'from ' + driver.checkpoint if driver.checkpoint else 'random'}), page {driver.page_size}, "
              f"built in {time.perf_counter() - t0:.1f} s", flush=True)
    rows, skipped, last = [], [], 0.0
    for item in grid:
        name, conc, ctx, max_ctx = item
        elapsed = time.perf_counter() - t0
        if elapsed + 1.5 * last > budget:
            skipped.append(item)
            continue
        t1 = time.perf_counter()
        sc = P.preset(name, cfg)
        if max_ctx is not None:
            sc = sc.replace(max_context=max_ctx)
        item_rows = []
        try:
            state = driver.prepare(sc, batch=conc, context=ctx)
            item_rows.append(driver.row(state, driver.profile(state, reps=reps)))
            if item in eager and runtime.has_cuda() and item_rows[0]["mode"] == "graph":
                item_rows.append(driver.row(state, driver.profile(state, reps=reps, graph=False)))
        except Exception as e:  # one failing configuration must not lose the others
            item_rows.append({"preset": name, "concurrency": conc, "context": ctx,
                              "max_context": sc.for_model(cfg).max_context, "model": cfg.name,
                              "error": f"{type(e).__name__}: {e}"[:500]})
        finally:
            state = None
            gc.collect()
            if runtime.has_cuda():
                torch.cuda.empty_cache()
        last = time.perf_counter() - t1
        for row in item_rows:
            row["wall_s"] = last
            rows.append(row)
            if verbose:
                print(format_row(row), flush=True)
    if verbose:
        for item in skipped:
            print(f"  skipped (time budget {budget:.0f} s): {item}")
        for t in S.targets(rows):
            print(f"  target: {t['target']}: {t['before_tok_s']:.1f} -> {t['after_tok_s']:.1f} tok/s = "
                  f"{t['value']:.3g} (goal {t['goal']}){'' if t['met'] is None else (' MET' if t['met'] else ' NOT MET')}")
        print(f"step: {len(rows)} rows in {time.perf_counter() - t0:.1f} s", flush=True)
    return rows


def format_row(row: dict) -> str:
    """One line: configuration, step time, tokens/s, component shares."""
    head = (f"{row['preset']:16s} c{row['concurrency']:<4d} ctx {row['context']:>7,} "
            f"max {row['max_context']:>9,} {S.row_mode(row):5s}")
    if "error" in row:
        return f"{head}  ERROR {row['error'][:160]}"
    tot = row["step_ms"]
    shares = " ".join(f"{g[:5]} {100 * sum(row[f'ms_{c}'] for c in comps) / tot:4.1f}%"
                      for g, comps in S.GROUPS.items())
    return (f"{head}  step {tot:9.2f} ms  {row['tokens_per_s']:10.1f} tok/s  {shares}  "
            f"[{row['timing']}, {row['wall_s']:.1f}s]")


@benchmark("step", "decode step at real scale: before/after per component, tokens/s (43 layers)")
def step_bench(smoke: bool, checkpoint=None, layers=None) -> list[dict]:
    """The decode-step grid (module docstring); smoke: the mini driver in the interpreter.
    ``checkpoint``/``layers``: a released-layout checkpoint's layers (``--checkpoint``,
    ``--layers``)."""
    if layers is not None and checkpoint is None:
        raise ValueError("--layers picks a checkpoint's layers: give --checkpoint DIR too")
    small = smoke or not runtime.has_cuda()
    if checkpoint is not None:
        return measure(CHECKPOINT_SMOKE_GRID if small else CHECKPOINT_GRID, checkpoint=checkpoint, layers=layers,
                       budget_s=600 if small else None)
    if small:
        return measure(SMOKE_GRID, cfg=DSV4Config.mini(), budget_s=600)
    return measure(FULL_GRID)
