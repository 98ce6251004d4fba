"""Figures of notebook 04: the FP4 MoE against its memory roofline and against OpenAI's
triton_kernels, and the bytes story.

:func:`plot_moe` and :func:`plot_versus` take rows of ``dsv4lab.results.load("moe")`` (or a
live ``bench.run``) and draw a note instead of crashing when there are none; :func:`headline`
and :func:`versus` are the tables beside them. :func:`plot_bytes_per_token` needs no
measurement: it shows why FP4 decode MoE is a memory problem. Explained in
notebooks/04_mxfp4_moe_port.ipynb.
"""
from __future__ import annotations

import matplotlib.pyplot as plt

from dsv4lab import results, roofline
from dsv4lab.plots._common import latest, note

KEYS = ("T", "impl", "fmt", "mode", "E", "hidden", "intermediate", "topk", "gpu")
# (impl, fmt, mode): colour, marker, line style, label
STYLE = {("triton", "mxfp4", "graph"): ("#2ca02c", "^", "-", "Triton family, MXFP4 (CUDA graph)"),
         ("triton", "nvfp4", "graph"): ("#1f77b4", "v", "-", "Triton family, NVFP4 (CUDA graph)"),
         ("triton", "mxfp4", "eager"): ("#2ca02c", "^", ":", "Triton family, MXFP4 (eager call)"),
         ("triton", "nvfp4", "eager"): ("#1f77b4", "v", ":", "Triton family, NVFP4 (eager call)"),
         ("triton_kernels", "mxfp4", "graph"): ("#9467bd", "D", "-", "OpenAI triton_kernels, MXFP4 (CUDA graph)"),
         ("triton_kernels", "mxfp4", "eager"): ("#9467bd", "D", ":", "OpenAI triton_kernels, MXFP4 (eager call)"),
         ("torch_ref", "mxfp4", "eager"): ("#d62728", "o", "-", "torch: dequantise + fp32 matmul per expert"),
         ("torch_bf16", "bf16", "eager"): ("#ff7f0e", "s", "-", "torch: bf16 weights (dequantised at load)")}


def with_mode(row: dict) -> dict:
    """The row with its ``mode``: rows recorded before the field say it by their timing."""
    if row.get("mode"):
        return row
    return dict(row, mode="graph" if row.get("timing") == "cuda_graph" else "eager")


def clean(rows, *, smoke: bool = False) -> list[dict]:
    """Newest row per configuration (mode included); GPU rows only unless ``smoke``."""
    return latest([with_mode(r) for r in rows], KEYS, smoke=smoke)


def plot_moe(rows=None, *, smoke: bool = False, ax=None):
    """Time per MoE call vs tokens, each implementation, with the FP4 roofline."""
    rows = clean(results.load("moe") if rows is None else rows, smoke=smoke)
    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(7, 4.2))
    if not rows:
        note(ax, "no recorded moe rows yet:\nrun `dsv4lab bench moe` on a GPU")
        return fig or ax.figure
    for (impl, fmt, mode), (color, marker, ls, label) in STYLE.items():
        pts = sorted((r["T"], r["ms"] * 1e3) for r in rows
                     if r["impl"] == impl and r["fmt"] == fmt and r["mode"] == mode)
        if pts:
            ax.plot(*zip(*pts), marker=marker, color=color, ls=ls, label=label,
                    mfc="none" if mode == "eager" and impl != "torch_ref" else color)
    roof = sorted({(r["T"], r["roofline_ms"] * 1e3) for r in rows
                   if r["impl"] == "triton" and r["fmt"] == "mxfp4" and r["mode"] == "graph"})
    if roof:
        ax.plot(*zip(*roof), "k--", label="roofline: MXFP4 bytes of experts hit / HBM bandwidth")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens T (top-6 of 256 experts)")
    ax.set_ylabel("microseconds per MoE layer")
    ax.set_title(f"FP4 MoE at DeepSeek-V4-Flash's shape\n{results.label(rows)}", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    return fig or ax.figure


def headline(rows=None, *, smoke: bool = False, tokens=(1, 8, 64, 256)) -> list[dict]:
    """The Triton rows a table shows: per T and format, graph and eager microseconds, the
    fraction of the roofline (graph) and the kernel the dispatch ran."""
    rows = clean(results.load("moe") if rows is None else rows, smoke=smoke)
    out = []
    for T in tokens:
        for fmt in ("mxfp4", "nvfp4"):
            g = [r for r in rows if (r["impl"], r["fmt"], r["T"], r["mode"]) == ("triton", fmt, T, "graph")]
            e = [r for r in rows if (r["impl"], r["fmt"], r["T"], r["mode"]) == ("triton", fmt, T, "eager")]
            if not g and not e:
                continue
            g0 = g[-1] if g else {}
            out.append(dict(T=T, fmt=fmt, graph_us=round(g0["ms"] * 1e3, 1) if g else None,
                            eager_us=round(e[-1]["ms"] * 1e3, 1) if e else None,
                            roofline_fraction=round(g0.get("roofline_fraction", 0), 3) if g else None,
                            kernel=g0.get("kernel", ""), commit=str(g0.get("commit", ""))[:7],
                            date=str(g0.get("date", ""))[:10]))
    return out


PEER = "triton_kernels"


def _graph(rows, impl, fmt, T):
    hits = [r for r in rows if (r["impl"], r["fmt"], r["T"], r["mode"]) == (impl, fmt, T, "graph")]
    return hits[-1] if hits else None


def versus(rows=None, *, smoke: bool = False) -> list[dict]:
    """Per T, the Triton family's MXFP4 graph row beside triton_kernels': microseconds,
    fractions of the roofline, ``ratio`` = triton_kernels' time / the family's (above 1: the
    family is faster), the family's route and triton_kernels' tiles (``opt_flags``: block
    M x N x K of its two matmuls), and whether both rows come from one run (``same_run``:
    the same commit and day)."""
    rows = clean(results.load("moe") if rows is None else rows, smoke=smoke)
    out = []
    for T in sorted({r["T"] for r in rows if r["impl"] == "triton"}):
        ours, peer = _graph(rows, "triton", "mxfp4", T), _graph(rows, PEER, "mxfp4", T)
        if not ours:
            continue
        flags = (peer or {}).get("opt_flags") or {}
        out.append(dict(
            T=T, kernel=ours.get("kernel", ""), ours_us=round(ours["ms"] * 1e3, 1),
            ours_frac=round(ours.get("roofline_fraction", 0), 3),
            peer_us=round(peer["ms"] * 1e3, 1) if peer else None,
            peer_frac=round(peer.get("roofline_fraction", 0), 3) if peer else None,
            ratio=round(peer["ms"] / ours["ms"], 2) if peer else None,
            peer_tiles=" / ".join(f"{f['block_m']}x{f['block_n']}x{f['block_k']}" for f in flags.values()),
            same_run=bool(peer) and str(peer.get("commit"))[:7] == str(ours.get("commit"))[:7]
            and str(peer.get("date"))[:10] == str(ours.get("date"))[:10]))
    return out


def plot_versus(rows=None, *, smoke: bool = False, axes=None):
    """Left: fraction of the FP4-bytes roofline vs T, the family (MXFP4, NVFP4) and
    triton_kernels (MXFP4), CUDA-graph rows. Right: triton_kernels' time over the family's
    MXFP4 time per T (above 1: the family is faster), each bar labelled with the family's route."""
    rows = clean(results.load("moe") if rows is None else rows, smoke=smoke)
    fig = None
    if axes is None:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    left, right = axes
    if not rows:
        for ax in axes:
            note(ax, "no recorded moe rows yet:\nrun `dsv4lab bench moe` on a GPU")
        return fig or left.figure
    for impl, fmt in (("triton", "mxfp4"), ("triton", "nvfp4"), (PEER, "mxfp4")):
        color, marker, _, label = STYLE[(impl, fmt, "graph")]
        pts = sorted((r["T"], r.get("roofline_fraction", 0)) for r in rows
                     if (r["impl"], r["fmt"], r["mode"]) == (impl, fmt, "graph"))
        if pts:
            left.plot(*zip(*pts), marker=marker, color=color, label=label.replace(" (CUDA graph)", ""))
    left.set_xscale("log", base=2)
    left.set_ylim(0, 1)
    left.set_xlabel("tokens T (top-6 of 256 experts)")
    left.set_ylabel("fraction of the roofline (FP4 bytes of the experts hit)")
    left.set_title(f"How close to the memory roofline\n{results.label(rows)}", fontsize=10)
    left.legend(fontsize=7)
    left.grid(True, which="both", alpha=0.3)
    table = [v for v in versus(rows, smoke=smoke) if v["ratio"] is not None]
    if not table:
        note(right, f"no {PEER} rows recorded yet:\nrun `dsv4lab bench moe` on an H200\n"
                    f"with {PEER} importable")
        return fig or left.figure
    xs = range(len(table))
    bars = right.bar(xs, [v["ratio"] for v in table],
                     color=["#2ca02c" if v["ratio"] >= 1 else "#9467bd" for v in table])
    for b, v in zip(bars, table):                     # the family's route, inside its bar
        right.text(b.get_x() + b.get_width() / 2, 0.04, v["kernel"], ha="center", va="bottom",
                   fontsize=7, rotation=90, color="white")
    right.axhline(1.0, color="k", lw=0.8)
    right.set_xticks(list(xs), [str(v["T"]) for v in table])
    right.set_xlabel("tokens T")
    right.set_ylabel(f"{PEER} time / Triton family time (MXFP4)")
    right.set_title("Above 1: the family is faster (green); below: triton_kernels (purple)", fontsize=10)
    right.grid(True, axis="y", alpha=0.3)
    return fig or left.figure


def plot_bytes_per_token(*, E=256, H=4096, I=2048, topk=6, device="H200", ax=None, max_t=512):
    """Expected experts hit and FP4 bytes per token vs T, and the arithmetic intensity
    against the GPU's ridge point: decode MoE sits far left of the ridge."""
    spec = roofline.device_spec(device)
    ts = [2 ** i for i in range(0, max_t.bit_length())]
    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(7, 4.2))
    intensity = []
    for t in ts:
        hit = E * (1 - (1 - topk / E) ** t)                   # uniform-routing expectation
        nbytes = hit * 3 * H * I * (0.5 + 1 / 32)
        flops = 2.0 * t * topk * 3 * H * I
        intensity.append(flops / nbytes)
    ax.plot(ts, intensity, marker="o", label="MXFP4 MoE: FLOP per byte of weights read")
    ax.axhline(roofline.ridge_point(spec), color="k", ls="--",
               label=f"{spec.name} ridge point (bf16): {roofline.ridge_point(spec):.0f} FLOP/B")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens T")
    ax.set_ylabel("arithmetic intensity (FLOP/byte)")
    ax.set_title("Why decode MoE is memory-bound (expected experts hit, uniform routing)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    return fig or ax.figure
