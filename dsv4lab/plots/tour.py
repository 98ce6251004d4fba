"""Figures of the tour: one decode step's components on a GPU's roofline, and stacked bars.

Both take the rows of :func:`dsv4lab.anatomy.step_anatomy`, keyed by a label (e.g.
"concurrency 1", "concurrency 64"). Explained in notebooks/00_tour.ipynb.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from dsv4lab import anatomy, roofline

# one colour per component group, stable across figures
GROUP_COLORS = {
    "attention": "#1f77b4",
    "indexer": "#d62728",
    "routed MoE": "#2ca02c",
    "shared expert": "#98df8a",
    "projections": "#ff7f0e",
    "mHC": "#9467bd",
    "LM head + embedding": "#8c564b",
}
_MARKERS = ("o", "s", "^", "D", "v", "P", "X")


def _as_labelled(rows_by_label) -> dict[str, list[dict]]:
    if isinstance(rows_by_label, list):
        if not rows_by_label:
            return {}
        return {f"concurrency {rows_by_label[0]['concurrency']}": rows_by_label}
    return dict(rows_by_label)


def _spec(rows_by_label, device):
    if device is not None:
        return device if isinstance(device, roofline.DeviceSpec) else roofline.device_spec(device)
    for rows in rows_by_label.values():
        if rows:
            return roofline.device_spec(rows[0]["device"])
    return roofline.device_spec()


def plot_roofline(rows_by_label, *, device=None, ax=None):
    """Each component as a point (FLOP/byte, attained FLOP/s at its roofline time) under the
    device's bf16 and fp8 roofs. ``rows_by_label``: {label: step_anatomy rows} or one list."""
    data = _as_labelled(rows_by_label)
    spec = _spec(data, device)
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4.5))
    if not data:
        ax.text(0.5, 0.5, "no anatomy rows to plot", ha="center", va="center", transform=ax.transAxes)
        return ax
    intens = [r["intensity"] for rows in data.values() for r in rows if r["flops"] > 0]
    lo = min(min(intens), 0.1) / 2
    hi = max(max(intens), roofline.ridge_point(spec, dtype="fp8")) * 4
    x = np.logspace(np.log10(lo), np.log10(hi), 200)
    for dtype, peak, style in (("bf16", spec.bf16_flops, "-"), ("fp8", spec.fp8_flops, "--")):
        ax.plot(x, np.minimum(peak, spec.bandwidth * x), "k" + style, lw=1.2,
                label=f"{spec.name} roof, {dtype} ({peak / 1e12:.0f} TFLOP/s, {spec.bandwidth / 1e12:.2f} TB/s)")
    for i, (label, rows) in enumerate(data.items()):
        marker = _MARKERS[i % len(_MARKERS)]
        for r in rows:
            if r["flops"] <= 0 or r["roofline_s"] <= 0:
                continue
            y = r["flops"] / r["roofline_s"]
            # marker area follows the component's share of the step's time
            ax.scatter(r["intensity"], y, marker=marker, s=25 + 400 * r["share"], alpha=0.85,
                       color=GROUP_COLORS.get(r["group"], "grey"), edgecolor="k", linewidth=0.5, zorder=3)
            if r["share"] >= 0.2:
                ax.annotate(f"{r['component']} ({r['share'] * 100:.0f}%)", (r["intensity"], y),
                            textcoords="offset points", xytext=(8, -10), fontsize=7)
        ax.scatter([], [], marker=marker, color="white", edgecolor="k", label=label)
    for group, color in GROUP_COLORS.items():
        if any(r["group"] == group for rows in data.values() for r in rows):
            ax.scatter([], [], marker="o", color=color, label=group)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("FLOP/s at the roofline")
    ax.set_title(f"One decode step on the {spec.name} roofline")
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(True, which="both", alpha=0.2)
    return ax


def plot_stacked(rows_by_label, *, ax=None, normalize: bool = True):
    """Stacked bars of the step's roofline time per component group, one bar per label:
    as a share of the step (``normalize``, the default) or in ms; totals on top."""
    data = _as_labelled(rows_by_label)
    if ax is None:
        _, ax = plt.subplots(figsize=(5, 4.5))
    if not data:
        ax.text(0.5, 0.5, "no anatomy rows to plot", ha="center", va="center", transform=ax.transAxes)
        return ax
    labels = list(data)
    totals = np.array([anatomy.step_totals(data[lab])["roofline_s"] * 1e3 for lab in labels])
    groups = [g for g in anatomy.GROUPS if any(r["group"] == g for rows in data.values() for r in rows)]
    bottom = np.zeros(len(labels))
    for g in groups:
        ms = np.array([anatomy.by_group(data[lab]).get(g, {"roofline_s": 0.0})["roofline_s"] * 1e3
                       for lab in labels])
        vals = 100 * ms / totals if normalize else ms
        ax.bar(labels, vals, bottom=bottom, color=GROUP_COLORS.get(g, "grey"), label=g, edgecolor="white")
        bottom += vals
    for i, total in enumerate(totals):
        per_tok = total / data[labels[i]][0]["concurrency"]
        ax.text(i, bottom[i], f"{total:.2f} ms/step\n{per_tok:.3f} ms/token", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("share of the step's roofline time (%)" if normalize else "roofline time of one step (ms)")
    ax.set_ylim(0, bottom.max() * 1.15)
    ax.set_title("Where the step's time goes")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    return ax


def plot_anatomy(rows_by_label, *, device=None):
    """The roofline and the stacked bars side by side; returns the figure."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1.7, 1]})
    plot_roofline(rows_by_label, device=device, ax=a)
    plot_stacked(rows_by_label, ax=b)
    fig.tight_layout()
    return fig


def plot_l2_states(rows, *, ax=None):
    """``dsv4lab bench l2`` rows (graph replays): GB/s of a read-only kernel against its size,
    one line per L2 state before the call (dirty: do_bench's zero fill; clean: a reading
    flush), with the device's recorded bandwidth. The gap is the timing method's fixed cost,
    not the kernel's."""
    from dsv4lab import results
    from dsv4lab.plots._common import latest, note

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    rows = [r for r in latest([r for r in rows if r.get("mode", "graph") == "graph"], ("op", "MB", "l2", "gpu"))
            if r.get("op") == "stream_read" and r.get("l2")]
    if not rows:
        note(ax, "no recorded GPU rows of `dsv4lab bench l2` yet")
        return ax
    for state, style in (("dirty", "o-"), ("clean", "s--")):
        pts = sorted((r["MB"], r["GB_s"]) for r in rows if r["l2"] == state)
        if pts:
            ax.plot(*zip(*pts), style, label=f"after a {state} L2")
    bw = roofline.device_spec(rows[0].get("roofline_device")).bandwidth
    ax.axhline(bw / 1e9, color="grey", lw=1, ls=":", label=f"recorded bandwidth {bw / 1e12:.2f} TB/s")
    ax.set_xscale("log")
    ax.set_xlabel("bytes read by the call (MB)")
    ax.set_ylabel("GB/s (bytes / timed call)")
    ax.set_title(f"one read-only kernel, two timing methods\n{results.label(rows)}", fontsize=10)
    ax.legend(fontsize=8)
    ax.figure.tight_layout()
    return ax


def figure_png(fig) -> bytes:
    """The figure as PNG bytes (for static HTML fallbacks)."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    return buf.getvalue()


__all__ = ["plot_roofline", "plot_stacked", "plot_anatomy", "plot_l2_states", "figure_png", "GROUP_COLORS"]
