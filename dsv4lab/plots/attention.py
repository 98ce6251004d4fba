"""Figures of notebooks 01 and 02: sparse MLA decode against the roofline.

Every function takes rows of ``dsv4lab.results.load("sparse_mla")`` (or a live ``bench.run``
result, whose rows carry the same fields) and tolerates an empty list (it draws a note
instead). Graph replays are drawn unless ``mode="eager"`` (rows recorded before the field
existed were graph replays). FlashMLA's rows (backend "flash_mla", dsv4lab/ops/flash_mla.py) are
drawn beside the FP8 ones where they were recorded. Explained in notebooks/01_simt_baseline.ipynb
and notebooks/02_mma_attention.ipynb.
"""
from __future__ import annotations

import matplotlib.pyplot as plt

from dsv4lab import results
from dsv4lab.plots._common import note

STYLE = {("mma", "bf16"): ("#1f77b4", "o", "MMA (dispatch), bf16 KV"),
         ("mma", "fp8"): ("#2ca02c", "s", "MMA (dispatch), FP8 KV"),
         ("mma_portable", "bf16"): ("#9467bd", "o", "portable Triton kernel, bf16 KV"),
         ("mma_portable", "fp8"): ("#8c564b", "s", "portable Triton kernel, FP8 KV"),
         ("simt", "bf16"): ("#d62728", "^", "SIMT (per head)"),
         ("torch_user", "bf16"): ("#7f7f7f", "D", "plain torch (bf16)"),
         ("torch", "bf16"): ("#bcbd22", "v", "fp32 reference"),
         ("flash_mla", "fp8"): ("#ff7f0e", "*", "FlashMLA (external), FP8 KV")}
KEYS = ("backend", "kv", "B", "S_q", "topk", "H", "D", "gpu", "layer", "shape", "mode")
LAYERS = ("window", "csa", "hca_128k", "hca_1m")
LAYER_NAMES = {"window": "window only (128)", "csa": "CSA (128 + 512)",
               "hca_128k": "HCA at 128K (128 + 1,024)", "hca_1m": "HCA at 1M (128 + 8,192)",
               "v3.2": "DeepSeek-V3.2's topk 2048"}


def clean(rows, *, mode: str = "graph") -> list[dict]:
    """The newest GPU row of each configuration timed in ``mode`` (smoke rows left out)."""
    return results.latest([r for r in rows if not r.get("smoke")
                           and r.get("mode", "graph") == mode], KEYS)


def plot_time_vs_batch(rows, *, topk=2048, S_q=1, layer=None, backends=None, ax=None, title=None):
    """Time per call (us, log) against batch size for each backend, with the bf16 roofline.
    ``layer``: only rows of that V4 layer kind (None: any rows at ``topk``)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 4))
    sel = [r for r in clean(rows) if r["topk"] == topk and r["S_q"] == S_q
           and (layer is None or r.get("layer") == layer)
           and (backends is None or r["backend"] in backends)]
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
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    return ax


def plot_layers(rows, *, S_q=1, axes=None):
    """One panel per kind of V4 layer (:data:`LAYERS`): us per call against B for the bf16 and
    the FP8 cache, each with its roofline (dashed)."""
    if axes is None:
        _, axes = plt.subplots(1, len(LAYERS), figsize=(16, 3.6), sharey=True)
    sel = [r for r in clean(rows) if r.get("layer") in LAYERS and r["S_q"] == S_q
           and r["backend"] == "mma"]
    for ax, layer in zip(axes, LAYERS):
        mine = [r for r in sel if r["layer"] == layer]
        if not mine:
            note(ax, f"no recorded {layer} rows yet\n(`dsv4lab bench sparse_mla` on a GPU)")
            continue
        for kv in ("bf16", "fp8"):
            color, marker, label = STYLE[("mma", kv)]
            pts = sorted((r["B"], r["ms"] * 1e3, r["roofline_ms"] * 1e3) for r in mine
                         if r["kv"] == kv)
            if pts:
                b, us, roof = zip(*pts)
                ax.plot(b, us, marker=marker, color=color, label=f"{kv} KV")
                ax.plot(b, roof, "--", color=color, lw=1, label=f"{kv} roofline")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size B")
        ax.set_title(f"{LAYER_NAMES[layer]}, S_q {S_q}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("us per call")
    if sel:
        axes[0].legend(fontsize=7)
        axes[0].figure.suptitle(results.label(sel), fontsize=9)
    return axes


def plot_roofline_fraction(rows, *, S_q=1, ax=None):
    """Fraction of the roofline per (layer, B) at ``S_q``, bf16 and FP8 KV side by side."""
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 3.6))
    sel = [r for r in clean(rows) if r["backend"] == "mma" and r["S_q"] == S_q
           and (r.get("layer") in LAYERS or r.get("shape") == "v3.2")]
    if not sel:
        note(ax, "no recorded rows at V4's shapes yet (run `dsv4lab bench sparse_mla` on a GPU)")
        return ax
    order = {k: i for i, k in enumerate(LAYERS + ("v3.2",))}
    labels = sorted({(r.get("layer") or r.get("shape"), r["B"]) for r in sel},
                    key=lambda lb: (order[lb[0]], lb[1]))
    x = range(len(labels))
    for off, kv in ((-0.2, "bf16"), (0.2, "fp8")):
        frac = {(r.get("layer") or r.get("shape"), r["B"]): r.get("roofline_fraction", 0)
                for r in sel if r["kv"] == kv}
        ax.bar([i + off for i in x], [frac.get(lab, 0) for lab in labels], width=0.4,
               color=STYLE[("mma", kv)][0], label=f"{kv} KV")
    ax.set_xticks(list(x))
    ax.set_xticklabels([f"{k} B{b}" for k, b in labels], rotation=90, fontsize=7)
    ax.set_ylabel("fraction of the roofline")
    ax.set_title(f"fraction of the roofline, S_q {S_q}\n{results.label(sel)}", fontsize=9)
    ax.legend(fontsize=8)
    return ax


def roofline_by_layer(rows, *, B=64, S_q=1) -> list[dict]:
    """For each V4 layer kind (:data:`LAYERS`) and V3.2's shape: the newest graph replay of the
    project's kernel at ``B`` / ``S_q``, per cache: us and fraction of the roofline (None where
    none was recorded), with the slots a query attends."""
    best = {}
    for r in clean(rows):
        if r["backend"] == "mma" and r["B"] == B and r["S_q"] == S_q:
            best[(r.get("layer") or r.get("shape"), r["kv"])] = r
    out = []
    for where in LAYERS + ("v3.2",):
        got = {kv: best.get((where, kv)) for kv in ("bf16", "fp8")}
        topk = next((r["topk"] for r in got.values() if r), None)
        row = dict(layer=where, name=LAYER_NAMES[where], topk=topk)
        for kv, r in got.items():
            row[f"{kv}_us"] = r["ms"] * 1e3 if r else None
            row[f"{kv}_frac"] = r.get("roofline_fraction") if r else None
        out.append(row)
    return out


# the points FlashMLA is measured at: (label, layer or shape, B, S_q)
PEER_POINTS = tuple(("csa", "csa", b, s) for s in (1, 2) for b in (32, 64, 128)) + \
    (("v3.2", "v3.2", 64, 1), ("v3.2", "v3.2", 128, 2))


def compare_peers(rows, points=PEER_POINTS) -> list[dict]:
    """At each point, the newest graph replay of the project's kernel (bf16 and FP8 cache) and
    of FlashMLA (FP8), in us (None where none was recorded), and FlashMLA's time over the FP8
    kernel's (> 1: the project's kernel is faster)."""
    best = {}
    for r in clean(rows):
        where = r.get("layer") or r.get("shape")
        best[(r["backend"], r["kv"], where, r["B"], r["S_q"])] = r
    out = []
    for label, where, B, S_q in points:
        us = {name: (best[key]["ms"] * 1e3 if key in best else None)
              for name, key in (("bf16", ("mma", "bf16", where, B, S_q)),
                                ("fp8", ("mma", "fp8", where, B, S_q)),
                                ("flash_mla", ("flash_mla", "fp8", where, B, S_q)))}
        ratio = us["flash_mla"] / us["fp8"] if us["flash_mla"] and us["fp8"] else None
        out.append(dict(point=label, B=B, S_q=S_q, **us, flash_mla_over_fp8=ratio))
    return out


def plot_peers(rows, *, layer="csa", S_q=1, ax=None):
    """us per call against B at one V4 layer kind (or ``layer="v3.2"``): the project's kernel
    with the bf16 and the FP8 cache and FlashMLA on the FP8 cache, with both rooflines."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 4))
    keys = (("mma", "bf16"), ("mma", "fp8"), ("flash_mla", "fp8"))
    sel = [r for r in clean(rows) if (r.get("layer") or r.get("shape")) == layer
           and r["S_q"] == S_q and (r["backend"], r["kv"]) in keys]
    if not sel:
        note(ax, f"no recorded {layer} rows at S_q {S_q} yet\n"
                 "(`dsv4lab bench sparse_mla` on a GPU)")
        return ax
    for key in keys:
        color, marker, label = STYLE[key]
        pts = sorted((r["B"], r["ms"] * 1e3, r["roofline_ms"] * 1e3) for r in sel
                     if (r["backend"], r["kv"]) == key)
        if pts:
            b, us, roof = zip(*pts)
            ax.plot(b, us, marker=marker, color=color, label=label)
            if key[0] == "mma":
                ax.plot(b, roof, "--", color=color, lw=1, label=f"roofline, {key[1]} KV")
        elif key[0] == "flash_mla":
            ax.plot([], [], marker=marker, color=color, ls="none",
                    label="FlashMLA: no rows recorded yet")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size B")
    ax.set_ylabel("us per call")
    ax.set_title(f"{LAYER_NAMES.get(layer, layer)}, S_q {S_q}\n{results.label(sel)}", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
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
