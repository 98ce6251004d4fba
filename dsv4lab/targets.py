"""The campaign's goals, checked against the recorded rows (never against a live run).

Each goal is a number on an H200; :func:`check` reads the newest GPU row of each
configuration from ``data/results/`` and says, per goal, what was measured, the goal,
whether it is met, and at which commit and date. Smoke rows and CPU rows never count.

Which rows count (:func:`gpu_rows`): the L2 state the goals were set with (``l2="dirty"``,
see :mod:`dsv4lab.bench`), and graph replays: a row's ``mode`` is ``"eager"`` (the call,
host included) or ``"graph"`` (its CUDA-graph replay); rows recorded before rows carried
``mode`` count as they always did. ``mode="eager"`` shows the eager rows on their own.
The host-cost goals compare the two: an eager call may cost at most ``HOST_US`` over its
graph replay. Peers' rows (FlashMLA, triton_kernels, cuBLAS) judge only where they were
measured in the same bench beside the project's.
Every notebook's "Targets" cell shows :func:`table`; notebooks 02 to 06 explain them.
"""
from __future__ import annotations

from dsv4lab import results

BENCHES = ("sparse_mla", "indexer", "moe", "spec", "linear", "step")
HOST_US = 30.0      # an eager call may cost at most this much over its graph replay
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


def _host_cost(name: str, graph: dict | None, eager: dict | None) -> dict:
    """The eager call's time over its graph replay's, in us (host cost: checks and launch)."""
    goal = f"<= {HOST_US:.0f} us"
    if not (graph and eager):
        return _missing(name, goal)
    extra = (eager["ms"] - graph["ms"]) * 1e3
    return _verdict(name, extra, goal, extra <= HOST_US, graph, eager)


def _fraction(rows, name: str, goal: float, **match) -> dict:
    r = _newest(rows, **match)
    return (_verdict(name, r["roofline_fraction"], f">= {goal:.2f}", r["roofline_fraction"] >= goal, r)
            if r else _missing(name, f">= {goal:.2f}"))


def _sparse_mla_v4(rows, eager):
    """V4-Flash's shapes: CSA 640 slots, HCA 1,152 (128K) and 8,320 (1M) slots."""
    key = dict(backend="mma", H=64)
    out = [_fraction(rows, "V4 CSA bf16, 640 slots, B 64, S_q 1: fraction of roofline", 0.50,
                     kv="bf16", B=64, S_q=1, topk=640, **key),
           _fraction(rows, "V4 CSA bf16, 640 slots, B 128, S_q 2: fraction of roofline", 0.70,
                     kv="bf16", B=128, S_q=2, topk=640, **key)]
    for slots, ctx in ((1152, "128K"), (8320, "1M")):
        out.append(_fraction(rows, f"V4 HCA bf16 at {ctx} ({slots:,} slots), B 64, S_q 1: fraction of roofline",
                             0.60, kv="bf16", B=64, S_q=1, topk=slots, **key))
    pairs = [(_newest(rows, kv="bf16", B=B, S_q=S, topk=640, **key),
              _newest(rows, kv="fp8", B=B, S_q=S, topk=640, **key)) for B in (32, 64, 128) for S in (1, 2)]
    name = "V4 CSA FP8 vs bf16 cache, 640 slots, B 32/64/128 x S_q 1/2: slowest speedup"
    if all(b and f for b, f in pairs):
        worst = min(b["ms"] / f["ms"] for b, f in pairs)
        out.append(_verdict(name, worst, "> 1.0x", worst > 1.0, *[r for p in pairs for r in p]))
    else:
        out.append(_missing(name, "> 1.0x"))
    for B, S in ((64, 1), (128, 2)):
        f = _newest(rows, kv="fp8", B=B, S_q=S, topk=640, **key)
        peer = _newest(rows, backend="flash_mla", kv="fp8", B=B, S_q=S, topk=640)
        name = f"V4 CSA FP8 vs FlashMLA, 640 slots, B {B}, S_q {S}: speedup"
        out.append(_verdict(name, peer["ms"] / f["ms"], ">= 1.2x", peer["ms"] / f["ms"] >= 1.2, f, peer)
                   if f and peer else _missing(name, ">= 1.2x"))
    for B in (1, 64):
        match = dict(kv="bf16", B=B, S_q=1, topk=640, **key)
        out.append(_host_cost(f"eager call over graph replay, bf16, 640 slots, B {B}: us",
                              _newest(rows, **match), _newest(eager, **match)))
    return out


def _sparse_mla(rows, eager=()):
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
    return out + _sparse_mla_v4(rows, eager)


def _indexer(rows, eager=()):
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
    match = dict(key, max_context_tokens=1048576, batch=64)
    out.append(_host_cost("eager call over graph replay, indexer_topk, B 64, 512 tokens, 1M max: us",
                          _newest(rows, **match), _newest(eager, **match)))
    return out


def _moe(rows, eager=()):
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
    out.append(_verdict(name, max(ratios), "<= 1.1x", max(ratios) <= 1.1, *used) if ratios else _missing(name, "<= 1.1x"))
    for T in (8, 256):
        out.append(_fraction(rows, f"Triton MXFP4 MoE, T {T}: fraction of roofline", 0.60,
                             impl="triton", fmt="mxfp4", T=T))
    for T, goal in ((1, 2.0), (8, 1.0), (64, 1.0), (256, 1.0)):
        ours = _newest(rows, impl="triton", fmt="mxfp4", T=T)
        peer = _newest(rows, impl="triton_kernels", fmt="mxfp4", T=T)
        name = f"Triton MXFP4 MoE vs triton_kernels, T {T}: speedup"
        out.append(_verdict(name, peer["ms"] / ours["ms"], f">= {goal:.1f}x", peer["ms"] / ours["ms"] >= goal,
                            ours, peer) if ours and peer else _missing(name, f">= {goal:.1f}x"))
    match = dict(impl="triton", fmt="mxfp4", T=1)
    out.append(_host_cost("eager call over graph replay, fused_moe MXFP4, T 1: us",
                          _newest(rows, **match), _newest(eager, **match)))
    return out


def _spec(rows, eager=(), runs: int = 3):
    """Concurrency 1: the best draft count's slowest of its newest ``runs`` runs (rows of one
    commit), so that one lucky run is not the figure."""
    c1 = [r for r in rows if r.get("concurrency") == 1 and r.get("num_draft", 0) > 0 and r.get("draft_moe") == "triton"]
    name = f"speculative vs plain tokens/s, concurrency 1 (best draft count, slowest of {runs} runs)"
    if not c1:
        return [_missing(name, ">= 1.6x")]
    commit = c1[-1].get("commit")
    by_k = {}
    for r in c1:
        if r.get("commit") == commit:
            by_k.setdefault(r["num_draft"], {})[r.get("run", 0)] = r
    best = max((sorted(v.values(), key=lambda r: r["speedup"]) for v in by_k.values()),
               key=lambda rs: rs[0]["speedup"])
    enough = len(best) >= runs
    same = all(r.get("identical") for r in rows)
    return [_verdict(name, best[0]["speedup"], ">= 1.6x", enough and best[0]["speedup"] >= 1.6, *best),
            _verdict("greedy output identical with and without speculation (every recorded row)",
                     same, "True", same, *rows[-1:])]


LINEAR_LARGEST = 3      # the FP8-bytes roofline goal holds on this many of the largest shapes


def _linear(rows, eager=()):
    """FP8 block-scaled linear at V4-Flash's projections, M 1..8: the roofline of its FP8 bytes
    on the largest shapes, and against cuBLAS bf16 on the same weights at every shape."""
    ours = [r for r in rows if r.get("impl") == "triton_fp8" and r.get("M", 99) <= 8]
    if not ours:
        return [_missing("FP8 linear, M 1..8, largest shapes: lowest fraction of FP8-bytes roofline", ">= 0.60"),
                _missing("FP8 linear vs cuBLAS bf16, M 1..8, every shape: slowest speedup", "> 1.0x")]
    sizes = {r["shape"]: r["N"] * r["K"] for r in ours}
    largest = sorted(sizes, key=sizes.get)[-LINEAR_LARGEST:]
    cells = {(r["shape"], r["M"]): r for r in ours}
    big = [cells[k] for k in sorted(cells) if k[0] in largest]
    low = min(r["roofline_fraction"] for r in big)
    out = [_verdict(f"FP8 linear, M 1..8, largest shapes ({', '.join(largest)}): lowest fraction of roofline",
                    low, ">= 0.60", low >= 0.60, *big)]
    pairs = [(c, _newest(rows, impl="cublas_bf16", shape=s, M=m)) for (s, m), c in sorted(cells.items())]
    name = "FP8 linear vs cuBLAS bf16, M 1..8, every shape: slowest speedup"
    if all(b for _, b in pairs):
        worst = min(b["ms"] / c["ms"] for c, b in pairs)
        out.append(_verdict(name, worst, "> 1.0x", worst > 1.0, *[r for p in pairs for r in p]))
    else:
        out.append(_missing(name, "> 1.0x"))
    return out


def _step(rows, eager=()):
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


_CHECKS = {"sparse_mla": _sparse_mla, "indexer": _indexer, "moe": _moe, "spec": _spec, "linear": _linear,
           "step": _step}


def check(bench: str, rows: list[dict] | None = None, *, l2: str = "dirty", mode: str = "graph") -> list[dict]:
    """Per goal of ``bench``: target, value, goal, met (None: no recorded row), commit, date.

    ``l2`` and ``mode`` pick which recorded rows count (see :func:`gpu_rows`); ``"dirty"``
    and ``"graph"`` are the method the goals were set with. The host-cost goals (an eager
    call over its graph replay) read the eager rows beside the graph ones; given ``rows``,
    those with ``mode="eager"`` are the eager ones."""
    if bench not in _CHECKS:
        raise ValueError(f"bench must be one of {', '.join(BENCHES)}, got {bench!r}")
    if l2 not in ("dirty", "clean"):
        raise ValueError(f"l2 must be 'dirty' or 'clean', got {l2!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be 'graph' or 'eager', got {mode!r}")
    if rows is None:
        graph = gpu_rows(bench, l2, mode)
        eager = gpu_rows(bench, l2, "eager") if mode == "graph" else []
    else:
        graph = [r for r in rows if r.get("mode") != "eager"] if mode == "graph" else list(rows)
        eager = [r for r in rows if r.get("mode") == "eager"] if mode == "graph" else []
    return _CHECKS[bench](graph, eager)


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
