"""The campaign's goals, checked against the recorded rows (never against a live run).

Each goal is a number on an H200; :func:`check` reads the newest GPU row of each
configuration from ``data/results/`` and says, per goal, what was measured, the goal,
whether it is met, and at which commit and date. Smoke rows and CPU rows never count.

Which rows count (:func:`gpu_rows`): the L2 state the goals were set with (``l2="dirty"``,
see :mod:`dsv4lab.bench`), and graph replays: a row's ``mode`` is ``"eager"`` (the call,
host included) or ``"graph"`` (its CUDA-graph replay); rows recorded before rows carried
``mode`` count as they always did. ``mode="eager"`` shows the eager rows on their own.
Every notebook's "Targets" cell shows :func:`table`; notebooks 02 to 06 explain them.
"""
from __future__ import annotations

from dsv4lab import results

BENCHES = ("sparse_mla", "indexer", "moe", "spec", "step")
MODES = ("graph", "eager")


def gpu_rows(bench: str, l2: str = "dirty", mode: str = "graph") -> list[dict]:
    """Recorded full-mode GPU rows of ``bench`` timed after the L2 state ``l2``, oldest first.

    The goals were set with ``do_bench``'s flush (``"dirty"``, also every row recorded
    before rows carried ``l2``); ``"clean"`` rows (:mod:`dsv4lab.bench`) are a second view,
    never mixed into the first. ``mode="graph"`` keeps graph replays and the rows without a
    ``mode``; ``mode="eager"`` keeps the eager rows only."""
    if mode not in MODES:
        raise ValueError(f"mode must be 'graph' or 'eager', got {mode!r}")
    keep = (lambda m: m in (None, "graph")) if mode == "graph" else (lambda m: m == "eager")
    return [r for r in results.load(bench) if not r.get("smoke") and r.get("capability") not in (None, "cpu")
            and r.get("l2", "dirty") == l2 and keep(r.get("mode"))]


def _newest(rows: list[dict], **match) -> dict | None:
    hits = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    return hits[-1] if hits else None


def _verdict(target: str, value, goal: str, met, *rows) -> dict:
    rows = [r for r in rows if r]
    return {"target": target, "value": value, "goal": goal, "met": met,
            "commit": ",".join(sorted({str(r.get("commit", ""))[:7] for r in rows})),
            "date": ",".join(sorted({str(r.get("date", ""))[:10] for r in rows}))}


def _missing(target: str, goal: str) -> dict:
    return {"target": target, "value": None, "goal": goal, "met": None, "commit": "", "date": ""}


def _sparse_mla(rows):
    out = []
    for B, S in ((64, 1), (128, 2)):
        r = _newest(rows, backend="mma", kv="bf16", B=B, S_q=S, topk=2048, H=64)
        name = f"MMA bf16 KV, B {B}, topk 2048, S_q {S}: fraction of roofline"
        out.append(_verdict(name, r["roofline_fraction"], ">= 0.60", r["roofline_fraction"] >= 0.60, r)
                   if r else _missing(name, ">= 0.60"))
    m = _newest(rows, backend="mma", kv="bf16", B=64, S_q=1, topk=2048, H=64)
    s = _newest(rows, backend="simt", kv="bf16", B=64, S_q=1, topk=2048, H=64)
    name = "MMA vs SIMT, B 64, topk 2048, S_q 1: speedup"
    out.append(_verdict(name, s["ms"] / m["ms"], ">= 10x", s["ms"] / m["ms"] >= 10, m, s)
               if m and s else _missing(name, ">= 10x"))
    b = _newest(rows, backend="mma", kv="bf16", B=128, S_q=2, topk=2048, H=64)
    f = _newest(rows, backend="mma", kv="fp8", B=128, S_q=2, topk=2048, H=64)
    name = "MMA FP8 KV vs bf16 KV, B 128, topk 2048, S_q 2: speedup"
    out.append(_verdict(name, b["ms"] / f["ms"], ">= 1.4x", b["ms"] / f["ms"] >= 1.4, b, f)
               if b and f else _missing(name, ">= 1.4x"))
    t = _newest(rows, backend="mma", kv="bf16", B=1, S_q=1, topk=640, H=64)
    name = "MMA, B 1, topk 640, S_q 1: us per call"
    out.append(_verdict(name, t["ms"] * 1e3, "< 15 us", t["ms"] * 1e3 < 15, t) if t else _missing(name, "< 15 us"))
    return out


def _indexer(rows):
    out = []
    key = dict(op="indexer_topk", backend="triton", actual_tokens=512, q_dtype="fp8", k_dtype="fp8")
    lo = _newest(rows, max_context_tokens=8192, **key)
    hi = _newest(rows, max_context_tokens=1048576, **key)
    name = "Triton indexer_topk, 512 actual tokens: time at 1M / time at 8K max context"
    if lo and hi:
        ratio = hi["ms"] / lo["ms"]
        out.append(_verdict(name, ratio, "<= 1.05x", ratio <= 1.05, lo, hi))
        worst = max(lo["ms"], hi["ms"]) * 1e3
        out.append(_verdict("Triton indexer_topk, 512 actual tokens: us at 8K and 1M (the slower)",
                            worst, "< 20 us", worst < 20, lo, hi))
    else:
        out.append(_missing(name, "<= 1.05x"))
    r = _newest(rows, op="indexer_logits", backend="triton", actual_tokens=131072, q_dtype="fp8", k_dtype="fp8")
    name = "Triton indexer_logits, 131,072 actual tokens: fraction of HBM roofline"
    out.append(_verdict(name, r["roofline_fraction"], ">= 0.60", r["roofline_fraction"] >= 0.60, r)
               if r else _missing(name, ">= 0.60"))
    return out


def _moe(rows):
    out = []
    for T in (1, 64):
        r = _newest(rows, impl="triton", fmt="mxfp4", T=T)
        name = f"Triton MXFP4 MoE, T {T}: fraction of roofline"
        out.append(_verdict(name, r["roofline_fraction"], ">= 0.50", r["roofline_fraction"] >= 0.5, r)
                   if r else _missing(name, ">= 0.50"))
    ratios, used = [], []
    for T in sorted({r["T"] for r in rows if r.get("impl") == "triton"}):
        mx, nv = _newest(rows, impl="triton", fmt="mxfp4", T=T), _newest(rows, impl="triton", fmt="nvfp4", T=T)
        if mx and nv:
            ratios.append(nv["ms"] / mx["ms"])
            used += [mx, nv]
    name = "Triton NVFP4 / MXFP4 time, worst over T"
    out.append(_verdict(name, max(ratios), "<= 1.2x", max(ratios) <= 1.2, *used) if ratios else _missing(name, "<= 1.2x"))
    return out


def _spec(rows):
    c1 = [r for r in rows if r.get("concurrency") == 1 and r.get("num_draft", 0) > 0 and r.get("draft_moe") == "triton"]
    newest = {}
    for r in c1:
        newest[r["num_draft"]] = r
    name = "speculative vs plain tokens/s, concurrency 1 (best draft count)"
    if not newest:
        return [_missing(name, ">= 1.5x")]
    best = max(newest.values(), key=lambda r: r["speedup"])
    same = all(r.get("identical") for r in rows)
    return [_verdict(name, best["speedup"], ">= 1.5x", best["speedup"] >= 1.5, best),
            _verdict("greedy output identical with and without speculation (every recorded row)",
                     same, "True", same, *rows[-1:])]


def _step(rows):
    from dsv4lab.drivers import step
    out = []
    for t in step.targets(rows):
        if t["met"] is None:
            continue
        ref = [r for r in rows if r.get("tokens_per_s") in (t["before_tok_s"], t["after_tok_s"])]
        goal = t["goal"]
        if t.get("ceiling"):
            goal += f"; no indexer can beat {t['ceiling']:.2g}x with this before"
        out.append(_verdict(t["target"], t["value"], goal, t["met"], *ref))
    return out


_CHECKS = {"sparse_mla": _sparse_mla, "indexer": _indexer, "moe": _moe, "spec": _spec, "step": _step}


def check(bench: str, rows: list[dict] | None = None, *, l2: str = "dirty", mode: str = "graph") -> list[dict]:
    """Per goal of ``bench``: target, value, goal, met (None: no recorded row), commit, date.

    ``l2`` and ``mode`` pick which recorded rows count (see :func:`gpu_rows`); ``"dirty"``
    and ``"graph"`` are the method the goals were set with."""
    if bench not in _CHECKS:
        raise ValueError(f"bench must be one of {', '.join(BENCHES)}, got {bench!r}")
    if l2 not in ("dirty", "clean"):
        raise ValueError(f"l2 must be 'dirty' or 'clean', got {l2!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be 'graph' or 'eager', got {mode!r}")
    return _CHECKS[bench](gpu_rows(bench, l2, mode) if rows is None else rows)


def table(bench: str, rows: list[dict] | None = None, *, l2: str = "dirty", mode: str = "graph") -> str:
    """The verdicts of :func:`check` as aligned text, for a notebook cell or the terminal."""
    lines = []
    for v in check(bench, rows, l2=l2, mode=mode):
        val = v["value"]
        shown = "no recorded row" if val is None else (f"{val:.3g}" if isinstance(val, float) else str(val))
        verdict = {True: "MET", False: "NOT MET", None: "-"}[v["met"]]
        lines.append(f"{verdict:8s} {v['target']}: {shown} (goal {v['goal']})"
                     + (f"  [{v['commit']}, {v['date']}]" if v["commit"] else ""))
    return "\n".join(lines)
