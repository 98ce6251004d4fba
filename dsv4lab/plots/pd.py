"""Figures and tables of notebook 07: prefill and decode on one GPU or two.

- :func:`plot_tpot`: measured TPOT p50/p99 against arrival rate, co-located against
  disaggregated, per prompt length (without recorded rows, a note saying so);
- :func:`plot_model`: the analytic model's mean and p99 TPOT against load: one co-located
  GPU, a co-located pair, one prefill + one decode GPU;
- :func:`plot_kv_bytes`: a hand-off's bytes by part against context, beside a cache that
  kept every token in every layer, and its time over NVLink and PCIe Gen5;
- :func:`plot_timeline`: one serving run's iterations on its clock (decode only vs carrying
  a chunk), with each request's tokens;
- :func:`headline_rows`: the measured rows as a small table; :func:`transfer_check`: measured
  hand-offs against the link model.

Every function tolerates no recorded rows. Explained in notebooks/07_prefill_decode.ipynb.
"""
from __future__ import annotations

import math

import matplotlib.pyplot as plt

from dsv4lab import results
from dsv4lab.drivers import pd_model as PM

KEYS = ("kind", "model", "preset", "prompt_len", "output_len", "n_requests", "chunk", "rate", "mode", "world", "link")
SERVED = ("colocated", "disaggregated")
COLORS = {"colocated": "#C44E52", "disaggregated": "#4C72B0", "pair": "#DD8452"}
PART_COLORS = {"window": "#4C72B0", "compressed entries": "#55A868", "indexer keys": "#DD8452",
               "compressor state": "#8172B3"}


def usable(rows, *, smoke: bool | None = False, mode: str | None = "graph") -> list[dict]:
    """Served rows without errors, newest per configuration; ``smoke`` False drops smoke rows
    (None keeps both); ``mode`` "graph" (default), "eager" or None (both)."""
    rows = [r for r in rows if r.get("kind") in SERVED and r.get("tpot_p50_ms") is not None]
    if smoke is not None:
        rows = [r for r in rows if bool(r.get("smoke", False)) == smoke]
    if mode is not None:
        rows = [r for r in rows if r.get("mode") == mode]
    return results.latest(rows, KEYS)


def _ax(ax, size):
    if ax is None:
        fig, ax = plt.subplots(figsize=size)
        return fig, ax
    return ax.figure, ax


def _note(ax, text):
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=9, wrap=True)
    ax.set_xticks([])
    ax.set_yticks([])


def headline_rows(rows) -> list[dict]:
    """One dict per (prompt length, rate): co-located and disaggregated TPOT p50/p99, TTFT p50,
    the transfer's share of TTFT and whether the tokens matched."""
    rows = list(rows)
    out = []
    for key in sorted({(r["prompt_len"], r["rate"], r.get("mode")) for r in rows}):
        pick = {k: [r for r in rows if (r["prompt_len"], r["rate"], r.get("mode")) == key and r["kind"] == k]
                for k in SERVED}
        c, d = (pick[k][-1] if pick[k] else None for k in SERVED)
        get = lambda r, f: None if r is None else r.get(f)  # noqa: E731
        out.append({"prompt_len": key[0], "rate": key[1], "mode": key[2], "load": get(c or d, "load"),
                    "colo_tpot_p50": get(c, "tpot_p50_ms"), "colo_tpot_p99": get(c, "tpot_p99_ms"),
                    "dis_tpot_p50": get(d, "tpot_p50_ms"), "dis_tpot_p99": get(d, "tpot_p99_ms"),
                    "colo_ttft_p50": get(c, "ttft_p50_ms"), "dis_ttft_p50": get(d, "ttft_p50_ms"),
                    "transfer_share": get(d, "transfer_share_of_ttft"), "link": get(d, "link"),
                    "identical": get(d, "tokens_identical")})
    return out


def transfer_check(rows, *, smoke: bool | None = False) -> list[dict]:
    """Measured transfers (``kind`` "transfer" rows, and the hand-offs of disaggregated rows
    whose link was measured) against :func:`dsv4lab.drivers.pd_model.transfer_ms` over NVLink
    (``smoke`` False drops smoke rows, None keeps both)."""
    out = []
    for r in rows:
        if smoke is not None and bool(r.get("smoke", False)) != smoke:
            continue
        if r.get("kind") == "transfer" and r.get("ms"):
            nbytes, ms, what = r["bytes"], r["ms"], "sweep"
        elif r.get("kind") == "disaggregated" and r.get("link") == "measured" and r.get("transfer_mean_ms"):
            nbytes, ms, what = r["payload_bytes"], r["transfer_mean_ms"], f"hand-off P {r['prompt_len']:,}"
        else:
            continue
        model = PM.transfer_ms(nbytes, "nvlink")
        out.append({"what": what, "bytes": nbytes, "measured_ms": ms, "model_ms": model,
                    "gbs": nbytes / (ms * 1e-3) / 1e9, "measured_over_model": ms / model})
    return out


def plot_tpot(rows):
    """TPOT p50 (solid) and p99 (dashed) against arrival rate, one panel per prompt length
    (without measured rows: a note saying so; :func:`plot_model` draws the model)."""
    rows = list(rows)
    lens = sorted({r["prompt_len"] for r in rows})
    if not lens:
        fig, ax = plt.subplots(figsize=(6, 1.6))
        _note(ax, "TPOT against load: no recorded rows yet. `dsv4lab bench pd` on a GPU records them\n"
                  "(two GPUs: the hand-off measured over NVLink; one GPU: the link modelled)")
        return fig
    fig, axes = plt.subplots(1, len(lens), figsize=(5.5 * len(lens), 4), squeeze=False)
    for ax, P in zip(axes[0], lens):
        for kind in SERVED:
            sel = sorted((r for r in rows if r["prompt_len"] == P and r["kind"] == kind), key=lambda r: r["rate"])
            if not sel:
                continue
            x = [r["rate"] for r in sel]
            ax.plot(x, [r["tpot_p50_ms"] for r in sel], "o-", color=COLORS[kind], label=f"{kind} p50")
            ax.plot(x, [r["tpot_p99_ms"] for r in sel], "s--", color=COLORS[kind], label=f"{kind} p99")
        link = next((r.get("link") for r in rows if r["kind"] == "disaggregated" and r["prompt_len"] == P), "")
        ax.set_xlabel("arrival rate (requests/s)")
        ax.set_ylabel("time per output token (ms)")
        ax.set_title(f"prompt {P:,} tokens; disaggregated link: {link}", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"TPOT against load, 43 layers extrapolated from one of each kind\n{results.label(rows)}", fontsize=9)
    fig.tight_layout()
    return fig


def plot_model(model_rows=None, *, ax=None, prompt_len: int = 8192, link: str = "NVLink 4 (H200)"):
    """The analytic model's mean (solid) and p99 (dashed) TPOT against load (a fraction of a
    prefill GPU) for one co-located GPU, a co-located pair and 1 prefill + 1 decode GPU."""
    rows = [r for r in (model_rows or PM.model_rows()) if r.get("kind") == "model"
            and r["prompt_len"] == prompt_len and r["link"] == link]
    fig, ax = _ax(ax, (6, 4))
    if not rows:
        _note(ax, "no model rows")
        return fig
    rows = sorted(rows, key=lambda r: r["load"])
    x = [r["load"] for r in rows]
    for key, label, color in (("colocated", "co-located, 1 GPU", COLORS["colocated"]),
                              ("pair", "co-located pair (2 GPUs, half each)", COLORS["pair"]),
                              ("disagg", "1 prefill + 1 decode GPU", COLORS["disaggregated"])):
        mean = [r[f"{key}_tpot_ms"] for r in rows]
        p99 = [r[f"{key}_tpot_p99_ms"] for r in rows]
        ax.plot(x, [m if math.isfinite(m) else float("nan") for m in mean], "o-", color=color, label=f"{label}: mean")
        ax.plot(x, [m if math.isfinite(m) else float("nan") for m in p99], "s--", color=color, alpha=0.7,
                label=f"{label}: p99")
    ax.set_xlabel("load (fraction of what one prefill GPU absorbs)")
    ax.set_ylabel("TPOT (ms)")
    ax.set_title(f"ANALYTIC MODEL (roofline, {rows[0]['device']}): batch {rows[0]['batch']}, "
                 f"prompt {prompt_len:,}, chunk {rows[0]['chunk']:,}", fontsize=9)
    ax.legend(fontsize=7)
    return fig


def plot_kv_bytes(cfg=None, *, contexts=(1024, 4096, 16384, 65536, 262144, 1048576), kv_format: str = "fp8"):
    """Left: a hand-off's bytes by part against context (stacked), beside a cache keeping every
    token in every layer. Right: its time over NVLink (H200) and PCIe Gen5 (analytic)."""
    rows = PM.context_rows(cfg, contexts, kv_format=kv_format)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    x = [r["context"] for r in rows]
    bottom = [0.0] * len(rows)
    for part in PM.PARTS:
        v = [r[f"bytes_{part.replace(' ', '_')}"] / 1e6 for r in rows]
        a.bar(range(len(rows)), v, bottom=bottom, color=PART_COLORS[part], label=part)
        bottom = [p + q for p, q in zip(bottom, v)]
    a.plot(range(len(rows)), [r["full_cache_bytes"] / 1e6 for r in rows], "k^:", label="every token, every layer")
    a.set_yscale("log")
    a.set_xticks(range(len(rows)), [f"{c // 1024}K" for c in x])
    a.set_xlabel("prompt (tokens)")
    a.set_ylabel("MB handed off (43 layers)")
    a.set_title(f"ANALYTIC: a request's hand-off, {kv_format.upper()} KV", fontsize=9)
    a.legend(fontsize=7)
    for key, style in (("nvlink", "o-"), ("pcie", "s--")):
        b.plot(x, [r[f"transfer_ms_{key}"] for r in rows], style, label=PM.LINKS[key].name)
    b.set_xscale("log", base=2)
    b.set_yscale("log")
    b.set_xlabel("prompt (tokens)")
    b.set_ylabel("transfer (ms)")
    b.set_title("ANALYTIC: one message at the link's nominal bandwidth", fontsize=9)
    b.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_timeline(served, *, ax=None, title: str = ""):
    """A serving run's iterations on its clock (grey: decode only, red: carrying a chunk) and
    each request's tokens (dots), one line per request."""
    fig, ax = _ax(ax, (10, 3.5))
    n = len(served.requests)
    for it in served.iterations:
        color = "#C44E52" if it["prefill_rows"] else "#BBBBBB"
        ax.axvspan(it["start_ms"], it["start_ms"] + it["ms"], ymin=0, ymax=0.06, color=color, lw=0)
    for i, r in enumerate(served.requests):
        y = i + 1
        ax.plot([r.arrival_ms], [y], "k|", ms=10)
        ax.plot(r.token_ms, [y] * len(r.token_ms), ".", color="#4C72B0", ms=4)
    ax.set_ylim(-0.5, n + 1)
    ax.set_xlabel("virtual time (ms)")
    ax.set_ylabel("request")
    ax.set_title(title or "iterations (bottom: red carries a prompt chunk) and tokens (|: arrival)", fontsize=9)
    return fig
