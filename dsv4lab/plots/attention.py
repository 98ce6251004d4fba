"""Figures of notebooks 01 and 02: sparse MLA decode against the roofline.

Every function takes rows of ``dsv4lab.results.load("sparse_mla")`` (or a live
``bench.run`` result) and tolerates an empty list (it draws a note instead).
Explained in notebooks/01_simt_baseline.ipynb and notebooks/02_mma_attention.ipynb.
"""
from __future__ import annotations

import matplotlib.pyplot as plt

from dsv4lab import results
from dsv4lab.plots._common import note

STYLE = {("mma", "bf16"): ("#1f77b4", "o", "MMA, bf16 KV"),
         ("mma", "fp8"): ("#2ca02c", "s", "MMA, FP8 KV"),
         ("simt", "bf16"): ("#d62728", "^", "SIMT (per head)"),
         ("torch_user", "bf16"): ("#7f7f7f", "D", "plain torch (bf16)"),
         ("torch", "bf16"): ("#bcbd22", "v", "fp32 reference")}
KEYS = ("backend", "kv", "B", "S_q", "topk", "H", "D", "gpu")


def _clean(rows):
    return results.latest([r for r in rows if not r.get("smoke")], KEYS)


def plot_time_vs_batch(rows, *, topk=2048, S_q=1, ax=None, title=None):
    """Time per call (us, log) against batch size for each backend, with the roofline."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 4))
    sel = [r for r in _clean(rows) if r["topk"] == topk and r["S_q"] == S_q]
    if not sel:
        note(ax, f"no recorded sparse_mla rows for topk {topk}, S_q {S_q} yet\n"
                  "(run `dsv4lab bench sparse_mla` on a GPU)")
        return ax
    roof = {}
    for key, (color, marker, label) in STYLE.items():
        pts = sorted((r["B"], r["ms"] * 1e3) for r in sel if (r["backend"], r["kv"]) == key)
        if pts:
            ax.plot(*zip(*pts), marker=marker, color=color, label=label)
        for r in sel:
            if (r["backend"], r["kv"]) == key and key[1] == "bf16":
                roof[r["B"]] = r["roofline_ms"] * 1e3
    if roof:
        ax.plot(*zip(*sorted(roof.items())), "k--", lw=1, label="roofline (bf16 KV)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size B")
    ax.set_ylabel("us per call")
    ax.set_title(title or f"sparse MLA decode, topk {topk}, S_q {S_q}\n{results.label(sel)}",
                 fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    return ax


def plot_roofline_fraction(rows, *, backend="mma", ax=None):
    """Fraction of the roofline per (B, S_q) for topk 640 and 2048, bf16 and FP8 KV."""
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.8))
    sel = sorted((r for r in _clean(rows) if r["backend"] == backend),
                 key=lambda r: (r["topk"], r["S_q"], r["B"]))
    if not sel:
        note(ax, f"no recorded {backend} rows yet (run `dsv4lab bench sparse_mla` on a GPU)")
        return ax
    labels = sorted({(r["topk"], r["S_q"], r["B"]) for r in sel})
    x = range(len(labels))
    for off, kv in ((-0.2, "bf16"), (0.2, "fp8")):
        frac = {(r["topk"], r["S_q"], r["B"]): r.get("roofline_fraction", 0) for r in sel if r["kv"] == kv}
        if frac:
            color = STYLE[(backend, kv)][0]
            ax.bar([i + off for i in x], [frac.get(lab, 0) for lab in labels], width=0.4,
                   color=color, label=f"{kv} KV")
    ax.axhline(0.6, color="k", ls=":", lw=1, label="target 60%")
    ax.set_xticks(list(x))
    ax.set_xticklabels([f"{t}/{s}/{b}" for t, s, b in labels], rotation=90, fontsize=7)
    ax.set_xlabel("topk / S_q / B")
    ax.set_ylabel("roofline fraction (bf16 KV roof)")
    ax.set_title(f"{backend}: fraction of the roofline\n{results.label(sel)}", fontsize=9)
    ax.legend(fontsize=8)
    return ax


def plot_bytes_model(models, *, ax=None):
    """Bars: KV bytes one step needs vs what one-program-per-head reads.

    ``models``: {label: dsv4lab.benchmarks.sparse_mla.traffic(...) dict}.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5))
    if not models:
        note(ax, "no shapes given")
        return ax
    labels = list(models)
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], [models[k]["shared_kv_bytes"] / 1e6 for k in labels], width=0.4,
           color="#1f77b4", label="each row once (heads share it)")
    ax.bar([i + 0.2 for i in x], [models[k]["simt_kv_bytes"] / 1e6 for k in labels], width=0.4,
           color="#d62728", label="once per head (SIMT)")
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("KV MB read per step")
    ax.legend(fontsize=8)
    return ax


PROFILE_BARS = (("kernel", "HBM rows (what the benchmark times)", "#1f77b4"),
                ("kernel_l2", "rows in L2: the math chain alone", "#9467bd"),
                ("gather_only", "bare gather of the same rows", "#ff7f0e"),
                ("ws_n32_b3", "warp-specialised (ws_n32_b3)", "#2ca02c"),
                ("ws_n32_b3_l2", "warp-specialised, rows in L2", "#98df8a"),
                ("kernel_empty", "every slot -1: the per-call overhead", "#7f7f7f"))


def plot_time_split(rows, *, ax=None):
    """Bars per target shape from ``results.load("sparse_mla_profile")``
    (scripts/profile_sparse_mla.py): the kernel on HBM rows, on L2-resident rows, a bare
    gather of the same rows (the best of its tilings), the warp-specialised kernel, and an
    empty call. Newest row per (shape, what)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 4))
    rows = results.latest([r for r in rows if "bf16" in r.get("shape", "")], ("shape", "what", "gpu"))
    shapes = sorted({r["shape"] for r in rows}, key=lambda s: (len(s), s))
    if not shapes:
        note(ax, "no recorded profile rows yet (scripts/profile_sparse_mla.py on a GPU)")
        return ax
    width = 0.8 / len(PROFILE_BARS)
    for k, (what, label, color) in enumerate(PROFILE_BARS):
        ys = []
        for shape in shapes:
            us = [r["us"] for r in rows if r["shape"] == shape and
                  (r["what"] == what or (what == "gather_only" and r["what"].startswith(what)))]
            ys.append(min(us) if us else 0.0)
        ax.bar([i + (k - len(PROFILE_BARS) / 2 + 0.5) * width for i in range(len(shapes))], ys,
               width=width, color=color, label=label)
    ax.set_xticks(range(len(shapes)))
    ax.set_xticklabels(shapes, fontsize=8)
    ax.set_ylabel("us per call")
    ax.legend(fontsize=7, loc="upper left")
    return ax


TIMELINE_PHASES = (("program start", "first tile ready", "Q and the first tile arrive", "#ff7f0e"),
                   ("first tile ready", "loop end", "the tiles", "#1f77b4"),
                   ("loop end", "epilogue end (consumer 0)", "epilogue (normalise, store)", "#2ca02c"))


def plot_timeline(rows, *, ax=None):
    """One bar per shape from the ``timeline: <point>`` rows of
    ``results.load("sparse_mla_profile")`` (scripts/profile_sparse_mla.py --timeline): when
    the median program of the warp-specialised kernel reaches each point, in us from the
    call's first program start, and (thin line) until the last program ends. Returns
    the axes; prints nothing. Explained in notebooks/02_mma_attention.ipynb."""
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 2.8))
    rows = results.latest([r for r in rows if r.get("what", "").startswith("timeline: ")],
                          ("shape", "what", "gpu"))
    at = {(r["shape"], r["what"][len("timeline: "):]): r for r in rows}
    shapes = sorted({r["shape"] for r in rows}, key=lambda s: (len(s), s))
    if not shapes:
        note(ax, "no recorded timeline rows yet\n(python3 scripts/profile_sparse_mla.py "
                 "--timeline on a GPU)")
        return ax
    for y, shape in enumerate(shapes):
        for first, last, label, color in TIMELINE_PHASES:
            a, b = at.get((shape, first)), at.get((shape, last))
            if a and b:
                ax.barh(y, b["us"] - a["us"], left=a["us"], color=color, height=0.6,
                        label=label if y == 0 else None)
        end = at.get((shape, "epilogue end (consumer 0)"))
        if end:
            ax.plot([end["us"], end["us_max"]], [y, y], color="k", lw=1.5,
                    label="to the last program's end" if y == 0 else None)
    ax.set_yticks(range(len(shapes)))
    ax.set_yticklabels(shapes, fontsize=8)
    ax.set_xlabel("us from the call's first program start (median program)")
    ax.legend(fontsize=7, loc="lower right")
    return ax
