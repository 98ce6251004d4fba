"""Figures of notebook 06's tensor-parallel section: where the all-reduce goes.

- :func:`plot_components`: the TP step by component group (attention, indexer, MoE,
  all-reduce, projections, mHC) for each TP degree and concurrency, from measured rows;
  without any, the analytic model's NVLink rows, labelled as such;
- :func:`plot_allreduce`: measured all-reduce bus bandwidth against message size, next to
  NVLink's datasheet and the ring model over NVLink and PCIe Gen5;
- :func:`plot_analytic`: the model's all-reduce share of the step, PCIe Gen5 (the
  campaign's RTX PRO 6000 box) against NVLink (H200), per TP degree and concurrency.

Every function takes rows of ``dsv4lab bench tp`` (``results.load("tp")``) and tolerates
none. Explained in notebooks/06_decode_step_at_scale.ipynb.
"""
from __future__ import annotations

import matplotlib.pyplot as plt

from dsv4lab import results
from dsv4lab.drivers import analytic as A
from dsv4lab.drivers import tp as T

COLORS = {"attention": "#4C72B0", "indexer": "#DD8452", "MoE": "#55A868", "all-reduce": "#C44E52",
          "projections": "#8172B3", "mHC": "#937860", "LM head + embedding": "#999999"}
KEYS = {"measured": ("kind", "tp", "preset", "concurrency", "context", "model"),
        "allreduce": ("kind", "tp", "bytes", "device"),
        "analytic": ("kind", "tp", "concurrency", "context", "link")}


def usable(rows, *, smoke: bool | None = False) -> list[dict]:
    """Rows without errors, newest per configuration; ``smoke`` False drops smoke rows,
    None keeps both."""
    rows = [r for r in rows if r.get("kind") in KEYS and "error" not in r]
    if smoke is not None:
        rows = [r for r in rows if bool(r.get("smoke", False)) == smoke]
    out = []
    for kind, keys in KEYS.items():
        out += results.latest([r for r in rows if r["kind"] == kind], keys)
    return out


def of_kind(rows, kind: str) -> list[dict]:
    return [r for r in rows if r.get("kind") == kind]


def skipped(rows) -> list[str]:
    """The TP degrees a recorded run could not measure, with the reason."""
    return sorted({f"TP{r['tp']}: {r['reason']}" for r in rows if r.get("kind") == "skipped"})


def _empty(ax, msg):
    ax.text(0.5, 0.5, msg, ha="center", va="center", transform=ax.transAxes, fontsize=10, wrap=True)
    ax.set_xticks([])
    ax.set_yticks([])


def _ax(ax, size):
    if ax is None:
        fig, ax = plt.subplots(figsize=size)
        return fig, ax
    return ax.figure, ax


def plot_components(rows, *, ax=None, model_link: str = "nvlink"):
    """Stacked bars, ms per (43-layer) step by group, one bar per (TP, concurrency).

    Measured rows when there are any; otherwise :func:`dsv4lab.drivers.analytic.analytic_rows` over
    ``model_link``, titled "analytic model".
    """
    rows = list(rows)
    fig, ax = _ax(ax, (10, 4.5))
    meas = sorted(of_kind(rows, "measured"), key=lambda r: (r["tp"], r["concurrency"]))
    if meas:
        groups = list(T.GROUPS)
        bars = [(f"TP{r['tp']}\nc{r['concurrency']}",
                 {g: sum(r.get(f"ms_{c}", 0.0) for c in cs) for g, cs in T.GROUPS.items()}, r) for r in meas]
        title = (f"TP decode step by component (measured, {'43-layer' if meas[0].get('extrapolated') else 'measured layers'}, "
                 f"preset {meas[0]['preset']})\n{results.label(meas)}")
    else:
        an = [r for r in of_kind(rows, "analytic") if model_link in r["link"].lower()] or \
            [r for r in A.analytic_rows() if model_link in r["link"].lower()]
        if not an:
            _empty(ax, "no rows")
            return fig
        an = sorted(an, key=lambda r: (r["tp"], r["concurrency"]))
        groups = list(A.ANALYTIC_GROUPS)
        bars = [(f"TP{r['tp']}\nc{r['concurrency']}", {g: r[f"ms_{g}"] for g in groups}, r) for r in an]
        title = (f"ANALYTIC MODEL (no measured TP rows yet): {an[0]['link']} on {an[0]['device']}, "
                 f"roofline compute + ring all-reduce, 43 layers")
    bottoms = [0.0] * len(bars)
    for g in groups:
        vals = [b[1].get(g, 0.0) for b in bars]
        ax.bar(range(len(bars)), vals, bottom=bottoms, color=COLORS.get(g, "#cccccc"), label=g)
        bottoms = [a + v for a, v in zip(bottoms, vals)]
    for i, (_, comp, r) in enumerate(bars):
        tot = sum(comp.values())
        if tot > 0:
            ax.text(i, bottoms[i], f"AR {100 * comp.get('all-reduce', 0.0) / tot:.0f}%", ha="center",
                    va="bottom", fontsize=8)
    ax.set_xticks(range(len(bars)), [b[0] for b in bars], fontsize=8)
    ax.set_ylabel("ms per decode step")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, ncol=4)
    return fig


def plot_allreduce(rows, *, ax=None):
    """Measured bus bandwidth (GB/s) against message size per TP degree, with NVLink's
    datasheet (900 GB/s both directions, 450 per direction) and the ring model's curves."""
    rows = list(rows)
    fig, ax = _ax(ax, (8, 4.5))
    meas = [r for r in of_kind(rows, "allreduce") if r.get("busbw_gbs")]
    sizes = sorted({r["bytes"] for r in meas}) or [2 ** k for k in range(13, 29)]
    for n in sorted({r["tp"] for r in meas}):
        sel = sorted((r for r in meas if r["tp"] == n), key=lambda r: r["bytes"])
        ax.plot([r["bytes"] for r in sel], [r["busbw_gbs"] for r in sel], "o-", label=f"measured TP{n}")
    for key, link in A.LINKS.items():
        for n in sorted({r["tp"] for r in meas} or {4}):
            model = [s * A.ring_factor(n) / A.allreduce_time(s, n, link) / 1e9 for s in sizes]
            ax.plot(sizes, model, "--", alpha=0.7, label=f"model {link.name} TP{n}")
    ax.axhline(A.NVLINK_H200.bandwidth / 1e9, color="k", lw=0.8, ls=":")
    ax.text(sizes[0], A.NVLINK_H200.bandwidth / 1e9 * 1.05,
            "NVLink datasheet: 900 GB/s both directions = 450 per direction", fontsize=7)
    ax.axhline(A.PCIE_GEN5.bandwidth / 1e9, color="gray", lw=0.8, ls=":")
    ax.text(sizes[0], A.PCIE_GEN5.bandwidth / 1e9 * 1.05, "PCIe Gen5 x16: 64 GB/s per direction", fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s) = bytes x 2(n-1)/n / t")
    ax.set_title("All-reduce bandwidth" + (f"\n{results.label(meas)}" if meas else
                                            "\nANALYTIC MODEL ONLY: no measured all-reduce rows yet"), fontsize=9)
    ax.legend(fontsize=7)
    return fig


def plot_analytic(rows=None, *, ax=None):
    """The model's all-reduce share of the step against concurrency, PCIe Gen5 vs NVLink,
    one line per TP degree (recorded analytic rows, else computed now)."""
    an = of_kind(rows or [], "analytic") or A.analytic_rows()
    fig, ax = _ax(ax, (8, 4))
    for key, link in A.LINKS.items():
        for n in sorted({r["tp"] for r in an if r["tp"] > 1}):
            sel = sorted((r for r in an if r["tp"] == n and r["link"] == link.name), key=lambda r: r["concurrency"])
            if sel:
                ax.plot([r["concurrency"] for r in sel], [100 * r["allreduce_share"] for r in sel],
                        "o-" if key == "pcie" else "s--", label=f"{link.name} ({link.device}) TP{n}")
    ax.axhline(23, color="k", lw=0.8, ls=":")
    ax.text(1, 24, "campaign: NCCL 23% of the step (PCIe)", fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("all-reduce share of the step (%)")
    ax.set_title("ANALYTIC MODEL: all-reduce share, roofline compute + ring all-reduce", fontsize=9)
    ax.legend(fontsize=7)
    return fig


def model_check(rows) -> list[dict]:
    """Measured all-reduce time against the NVLink ring model, per measured row (step rows:
    the step's all-reduces; bandwidth rows: one all-reduce)."""
    out = []
    for r in of_kind(rows, "measured"):
        if r["tp"] > 1:
            m = r["model_allreduce_ms_nvlink"]
            out.append({"what": f"step TP{r['tp']} c{r['concurrency']}", "measured_ms": r["allreduce_ms"],
                        "model_ms": m, "ratio": r["allreduce_ms"] / m if m else None})
    for r in of_kind(rows, "allreduce"):
        if r.get("busbw_gbs"):
            out.append({"what": f"all-reduce TP{r['tp']} {r['bytes']:,} B", "measured_ms": r["us"] / 1e3,
                        "model_ms": r["model_nvlink_us"] / 1e3, "ratio": r.get("measured_over_model")})
    return out
