"""Figures of notebook 03: the lightning indexer against max_context, and its cost model.

Every plot takes rows of ``dsv4lab.results.load("indexer")`` (or a live ``bench.run``
result) and draws a note instead of crashing when there are none yet. The cost model
(:func:`estimate_us`, :func:`decode_share`) fits the recorded rows when there are some
and falls back to the HBM roofline otherwise; the widget in
:mod:`dsv4lab.widgets.indexer` drives it. Explained in notebooks/03_indexer_capping.ipynb.
"""
from __future__ import annotations

import matplotlib.pyplot as plt

from dsv4lab import results, roofline
from dsv4lab.benchmarks.indexer import mode_of, newest
from dsv4lab.ops.indexer import indexer_bytes
from dsv4lab.plots._common import note

COMPRESS = 4
CSA_LAYERS = 21          # DeepSeek-V4-Flash: [0,0] + [4,128]*20 + [4] -> 21 layers with ratio 4
# The campaign: concurrency 64, --context-length 8192 -> 531.7 tok/s; the rest of a decode
# step then is 64 / 531.7 s minus 21 indexer calls at 0.30 ms.
REST_OF_STEP_MS = 64 / 531.7 * 1e3 - CSA_LAYERS * 0.30
# torch fallback, B=64, 512 actual tokens, as the campaign measured it: the fallback's line
# until recorded rows exist
CAMPAIGN_FALLBACK_MS = {8192: 0.30, 131072: 3.58, 1048576: 27.7}
LAUNCH_US = {"torch_fallback": 40.0, "torch_capped": 60.0, "triton": 6.0}   # no-row fallback
# (backend, mode): colour, marker, line style, label
STYLE = {("torch_fallback", "eager"): ("#d62728", "o", "-", "torch fallback (scores all max_context)"),
         ("torch_capped", "eager"): ("#ff7f0e", "s", "-", "torch, capped to the longest request"),
         ("triton", "graph"): ("#2ca02c", "^", "-", "Triton, paged, early exit (CUDA graph)"),
         ("triton", "eager"): ("#2ca02c", "v", "--", "Triton, called eagerly (checks, host)")}
clean = newest           # the newest row per configuration, mode included


def _rows_of_kind(rows, kind, what, *, ax, smoke, figsize):
    """(ax, the clean rows of ``kind``), a new figure of ``figsize`` when ``ax`` is None;
    with no such rows, a note on ``ax`` says so (naming ``what``)."""
    if ax is None:
        _, ax = plt.subplots(figsize=figsize)
    sel = [r for r in clean(rows, smoke=smoke) if r["kind"] == kind]
    if not sel:
        note(ax, f"no recorded {what} rows yet\n(run `dsv4lab bench indexer` on a GPU)")
    return ax, sel


def plot_topk_vs_max_context(rows, *, ax=None, smoke: bool = False):
    """us per indexer_topk call (log) against max context in tokens, one line per backend."""
    ax, sel = _rows_of_kind(rows, "topk_vs_max_context", "indexer", ax=ax, smoke=smoke,
                            figsize=(6.5, 4))
    if not sel:
        return ax
    for (be, mode), (color, marker, ls, label) in STYLE.items():
        pts = sorted((r["max_context_tokens"], r["ms"] * 1e3) for r in sel
                     if r["backend"] == be and r["mode"] == mode)
        if pts:
            ax.plot(*zip(*pts), marker=marker, ls=ls, color=color, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("max context (tokens; entries = tokens / 4)")
    ax.set_ylabel("us per indexer_topk call")
    r0 = sel[0]
    ax.set_title(f"indexer top-{r0['topk']}, B={r0['batch']}, {r0['actual_tokens']} actual tokens\n"
                 f"{results.label(sel)}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    return ax


def _fit(rows, backend):
    """(intercept_us, us per scored entry per request) fitted to the recorded rows (graph
    replays for Triton, the eager calls for the torch backends)."""
    mode = "graph" if backend == "triton" else "eager"
    pts = [(r["entries_scored"], r["ms"] * 1e3) for r in rows
           if r["backend"] == backend and mode_of(r) == mode
           and r.get("q_dtype") == "fp8" and r.get("k_dtype") == "fp8"]
    if not pts:
        return None
    pts = sorted(set(pts))
    if len(pts) == 1 or pts[0][0] == pts[-1][0]:
        return (min(p[1] for p in pts), None)
    (x0, y0), (x1, y1) = pts[0], pts[-1]
    b = max((y1 - y0) / (x1 - x0), 0.0)
    return (max(y0 - b * x0, 0.0), b)


def estimate_us(rows, max_context_tokens: int, actual_tokens: int, *, batch: int = 64,
                device=None) -> dict:
    """Estimated us per indexer_topk call for each backend, and where the figure comes from.

    With recorded GPU rows: a line through them (time = a + b * entries scored; the Triton
    slope comes from its long-context logits row). Without: the HBM roofline of the bytes
    each backend must touch plus a launch overhead.
    """
    spec = roofline.device_spec(device)
    L = max_context_tokens // COMPRESS
    n = min(actual_tokens, max_context_tokens) // COMPRESS
    scored = {"torch_fallback": L, "torch_capped": n, "triton": n}
    sel = [r for r in clean(rows) if r["batch"] == batch and r["s_q"] == 1]
    topk_rows = [r for r in sel if r["kind"] == "topk_vs_max_context"]
    out = {}
    for be, ent in scored.items():
        fit = _fit(topk_rows + ([r for r in sel if r["kind"] == "logits_roofline"]
                                if be == "triton" else []), be)
        if fit is None and be == "torch_fallback" and batch == 64:
            camp = [dict(backend=be, q_dtype="fp8", k_dtype="fp8", entries_scored=m // COMPRESS,
                         ms=v) for m, v in CAMPAIGN_FALLBACK_MS.items()]
            a, b = _fit(camp, be)
            out[be] = (a + b * ent, "the campaign's figures")
        elif fit is not None and fit[1] is not None:
            out[be] = (fit[0] + fit[1] * ent, "fit to recorded rows")
        else:
            roof = indexer_bytes(batch, 1, ent) / spec.bandwidth * 1e6
            base = fit[0] if fit is not None else LAUNCH_US[be]
            out[be] = (base + roof, "recorded intercept + roofline" if fit else "roofline model")
    return out


def decode_share(indexer_us: float) -> float:
    """Share of a decode step spent in the indexer (21 CSA layers; rest from the campaign)."""
    idx_ms = CSA_LAYERS * indexer_us / 1e3
    return idx_ms / (idx_ms + REST_OF_STEP_MS)


def plot_decode_share(rows, *, actual_tokens: int = 512, batch: int = 64, ax=None,
                      max_contexts=(8192, 32768, 131072, 262144, 524288, 1048576)):
    """Share of a decode step eaten by the indexer against max context, per backend."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 4))
    src = set()
    for (be, mode), (color, marker, ls, label) in STYLE.items():
        if mode == "eager" and be == "triton":
            continue
        pts = []
        for m in max_contexts:
            us, how = estimate_us(rows, m, actual_tokens, batch=batch)[be]
            src.add(how)
            pts.append((m, 100 * decode_share(us)))
        ax.plot(*zip(*pts), marker=marker, ls=ls, color=color, label=label)
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 100)
    ax.set_xlabel("max context (tokens)")
    ax.set_ylabel("% of a decode step in the indexer")
    ax.set_title(f"{CSA_LAYERS} indexer calls per step, B={batch}, {actual_tokens} actual tokens\n"
                 f"({'; '.join(sorted(src))}; rest of step {REST_OF_STEP_MS:.0f} ms)", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    return ax


def plot_dtype_flips(rows, *, ax=None, smoke: bool = False):
    """Time (bars) and top-k recall vs fp32 math (labels) of the logits in each matmul dtype."""
    ax, sel = _rows_of_kind(rows, "matmul_dtype", "matmul_dtype", ax=ax, smoke=smoke,
                            figsize=(6.5, 3.6))
    sel = [r for r in sel if r["mode"] == "graph"]
    if not sel:
        return ax
    names = [f"q {r['q_dtype']} / k {r['k_dtype']}\n(dot {r['dot']})" for r in sel]
    us = [r["ms"] * 1e3 for r in sel]
    bars = ax.bar(names, us, color=["#9467bd", "#1f77b4", "#2ca02c", "#8c564b"][: len(sel)])
    for b, r in zip(bars, sel):
        ax.annotate(f"recall {r['recall_vs_fp32']:.3f}\nerr {r['max_rel_logit_err']:.0e}",
                    (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                    va="bottom", fontsize=7)
    ax.set_ylabel("us per indexer_logits call")
    r0 = sel[0]
    ax.set_title(f"indexer matmul dtype, B={r0['batch']}, {r0['actual_tokens']} tokens each\n"
                 f"{results.label(sel)}", fontsize=9)
    ax.tick_params(axis="x", labelsize=7)
    ax.margins(y=0.25)
    return ax
