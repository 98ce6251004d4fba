"""Figures of notebook 05: training curve, acceptance per draft position, speedup vs drafts,
and what a plain, a verify and a draft step cost.

Every function takes rows of ``dsv4lab.results.load("spec")`` (or a live ``bench.run``) or a
training log dict, and draws a note instead of crashing when there is nothing to draw.
Explained in notebooks/05_mtp_speculative.ipynb.
"""
from __future__ import annotations

import statistics

import matplotlib.pyplot as plt

from dsv4lab import results
from dsv4lab.benchmarks.spec import mode_of
from dsv4lab.plots._common import latest, note

KEYS = ("concurrency", "num_draft", "draft_moe", "mode", "run", "gpu")


def clean(rows, *, smoke: bool = False) -> list[dict]:
    """Newest row per configuration (``mode`` and repetition ``run`` included: rows from
    before ``run`` count as run 0); GPU (full-mode) rows only unless ``smoke``. Rows of the
    draft MoE on another backend than the main model's are left out."""
    rows = [dict(r, mode=mode_of(r), run=r.get("run") or 0) for r in rows or []
            if r.get("draft_moe") == r.get("moe")]
    return latest(rows, KEYS, smoke=smoke)


def _last_run(rows) -> list[dict]:
    """Of rows differing only in ``run``, the last run's."""
    return results.latest(sorted(rows, key=lambda r: r.get("run") or 0),
                          ("concurrency", "num_draft", "mode", "gpu"))


def _axes(ax, n=1, figsize=(7, 4)):
    if ax is not None:
        return None, ax
    return plt.subplots(1, n, figsize=figsize)


def plot_training(log: dict | None, ax=None):
    """Training loss (main and MTP) against step, with the held-out losses."""
    fig, ax = _axes(ax)
    if not log or not log.get("curve"):
        note(ax, "no training log yet:\nrun `dsv4lab train`")
        return fig or ax.figure
    c = log["curve"]
    steps = [r["step"] for r in c]
    ax.plot(steps, [r["main"] for r in c], label="next byte (train batch)")
    if "mtp" in c[0]:
        ax.plot(steps, [r["mtp"] for r in c], label="MTP: byte after next (train batch)")
    b, a = log.get("heldout_before_quant", {}), log.get("heldout_after_quant", {})
    if b:
        ax.axhline(b["main"], color="C0", ls="--", lw=1, label=f"held-out main {b['main']:.3f}")
        ax.axhline(a["main"], color="C3", ls=":", lw=1, label=f"held-out main, MXFP4 experts {a['main']:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.set_ylim(0, min(6, max(r["main"] for r in c[1:] or c) * 1.2))
    ax.set_title(f"mini DeepSeek-V4 on stdlib source: {log.get('steps')} steps, "
                 f"{log.get('minutes')} min, {log.get('device')}", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig or ax.figure


def plot_acceptance(rows=None, *, smoke: bool = False, ax=None):
    """Acceptance of each draft position (k = 3 drafts), concurrency 1 and 8."""
    rows = clean(results.load("spec") if rows is None else rows, smoke=smoke)
    fig, ax = _axes(ax)
    k = max((x["num_draft"] for x in rows), default=0)
    main = [r for r in rows if r["num_draft"] == k]
    main = _last_run([r for r in main if r["mode"] == "graph"] or main)   # eager only where no graph ran
    if not main or not main[0]["acceptance"]:
        note(ax, "no recorded spec rows yet:\nrun `dsv4lab bench spec` on a GPU")
        return fig or ax.figure
    width = 0.8 / len(main)
    for i, r in enumerate(sorted(main, key=lambda r: r["concurrency"])):
        xs = [p + 1 + (i - (len(main) - 1) / 2) * width for p in range(len(r["acceptance"]))]
        bars = ax.bar(xs, r["acceptance"], width, label=f"concurrency {r['concurrency']} "
                      f"(mean accepted {r['mean_accepted']:.2f} tokens/step)")
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks(range(1, len(main[0]["acceptance"]) + 1))
    ax.set_xlabel("draft position")
    ax.set_ylabel("fraction of steps accepted")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"MTP drafts accepted on held-out source\n{results.label(main)}", fontsize=10)
    ax.legend(fontsize=8)
    return fig or ax.figure


def plot_speedup(rows=None, *, smoke: bool = False, ax=None):
    """Tokens/s of speculative over plain decoding (in the same run and mode) vs number of
    drafts: one line per concurrency and mode (CUDA graphs solid, eager steps dashed), through
    the median of the runs; each run a dot."""
    rows = clean(results.load("spec") if rows is None else rows, smoke=smoke)
    fig, ax = _axes(ax)
    if not rows:
        note(ax, "no recorded spec rows yet:\nrun `dsv4lab bench spec` on a GPU")
        return fig or ax.figure
    for i, conc in enumerate(sorted({r["concurrency"] for r in rows})):
        for mode, ls in (("graph", "-"), ("eager", "--")):
            mine = [r for r in rows if r["concurrency"] == conc and r["mode"] == mode]
            ks = sorted({r["num_draft"] for r in mine})
            if not ks:
                continue
            runs = {k: [r["speedup"] for r in mine if r["num_draft"] == k] for k in ks}
            ax.plot(ks, [statistics.median(runs[k]) for k in ks], marker="o", ls=ls, color=f"C{i}",
                    label=f"concurrency {conc}, {'CUDA graphs' if mode == 'graph' else 'eager steps'}"
                          + (f" ({max(map(len, runs.values()))} runs)" if max(map(len, runs.values())) > 1 else ""))
            for k in ks:
                if len(runs[k]) > 1:
                    ax.plot([k] * len(runs[k]), runs[k], ".", color=f"C{i}", alpha=0.6)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xlabel("draft tokens per step (0 = plain decoding)")
    ax.set_ylabel("speedup in tokens/s")
    ax.set_xticks(sorted({r["num_draft"] for r in rows}))
    ax.set_title(f"Speculative decoding speedup\n{results.label(rows)}", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig or ax.figure


def plot_step_costs(rows=None, *, smoke: bool = False, concurrency: int = 1, ax=None):
    """What one step costs (graph replays, ms), by number of drafts, at ``concurrency``: the
    plain step, and a speculative step as its verify and draft parts; above each bar the
    tokens it yields (mean accepted) and the speedup the two make, ``tokens a step / (step
    cost / plain step cost)``, against the measured one."""
    rows = clean(results.load("spec") if rows is None else rows, smoke=smoke)
    fig, ax = _axes(ax)
    rows = [r for r in rows if r["concurrency"] == concurrency and r.get("step_ms")]
    rows = _last_run([r for r in rows if r["mode"] == "graph"] or rows)
    if not rows:
        note(ax, "no step timings recorded yet:\nrun `dsv4lab bench spec` on a GPU")
        return fig or ax.figure
    rows = sorted(rows, key=lambda r: r["num_draft"])
    ks = [r["num_draft"] for r in rows]
    plain = [r["step_ms"] if r["num_draft"] == 0 else 0.0 for r in rows]
    verify = [r.get("verify_ms") or 0.0 for r in rows]
    draft = [r.get("draft_ms") or 0.0 for r in rows]
    ax.bar(ks, plain, color="C7", label="plain step")
    ax.bar(ks, verify, color="C0", label="verify (1 + k rows, main model)")
    ax.bar(ks, draft, bottom=verify, color="C1", label="draft (MTP layer, k passes)")
    top = max(r["step_ms"] for r in rows)
    for r in rows:
        text = "1 token/step" if r["num_draft"] == 0 else (
            f"{r['mean_accepted']:.2f} tok/step\n{r['speedup_from_steps']:.2f}x from steps\n"
            f"{r['speedup']:.2f}x measured")
        ax.text(r["num_draft"], r["step_ms"] + 0.02 * top, text, ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, top * 1.45)
    ax.set_xticks(ks)
    ax.set_xlabel("draft tokens per step (0 = plain decoding)")
    ax.set_ylabel("ms per step")
    mode = "CUDA-graph replays" if rows[0]["mode"] == "graph" else "eager"
    ax.set_title(f"One step's cost, concurrency {concurrency} ({mode})\n{results.label(rows)}", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    return fig or ax.figure
