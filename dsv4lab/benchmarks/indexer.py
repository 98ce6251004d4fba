"""``dsv4lab bench indexer``: the lightning indexer's cost against max_context.

Three sets of rows (field ``kind``), for DeepSeek-V4-Flash's indexer (64 heads x 128
dims, FP8 e4m3 keys with fp32 scales, pages of 64 c4 entries, one query per request):

- ``"topk_vs_max_context"``: ``indexer_topk`` (top-512) for every backend at a fixed
  512 actual tokens while the configured max context grows 8K -> 1M tokens. Lengths are
  given both in TOKENS (``*_tokens``) and in c4 ENTRIES (``*_entries`` = tokens / 4):
  the indexer scores entries. ``entries_scored`` is what the backend touches per row.
- ``"logits_roofline"``: the Triton ``indexer_logits`` kernel on 131,072 actual tokens
  (32,768 entries per request, each request its own pages) against the HBM roofline.
- ``"matmul_dtype"``: the same logits with the matmul in fp32, bf16 and fp8 (the q/k
  dtypes the kernel switches on), timed, with the top-512 recall and logit error vs
  fp32 math on the unquantised keys.

Field ``mode``: ``"graph"``, the launches replayed from a CUDA graph (the Triton rows; the
top-k ones are medians of interleaved rounds, see :func:`_triton_interleaved`), or
``"eager"``, the public op called as a notebook calls it, its default value checks and the
host included (the torch backends, which read lengths on the host, and the headline Triton
cases: top-k at the shortest and the longest max context, the logits roofline).

Full mode: B = 64 on the GPU. Smoke mode: tiny CPU shapes, in the interpreter.
Explained in notebooks/03_indexer_capping.ipynb.
"""
from __future__ import annotations

import dataclasses
import statistics

import torch

from dsv4lab import backends, bench, results, runtime
from dsv4lab.bench import benchmark
from dsv4lab.kernels import indexer as K
from dsv4lab.kernels.device import props as device_props
from dsv4lab.ops import indexer as ops_indexer
from dsv4lab.ops.indexer import indexer_bytes, indexer_flops, reference_logits

COMPRESS = 4          # one c4 entry per 4 tokens
FP8 = torch.float8_e4m3fn
DTYPE_NAMES = {FP8: "fp8", torch.bfloat16: "bf16", torch.float32: "fp32"}

FULL = dict(batch=64, s_q=1, heads=64, head_dim=128, page=64, topk=512,
            max_context_tokens=(8192, 32768, 131072, 1048576), actual_tokens=512,
            logits_actual_tokens=131072, rounds=5)
SMOKE = dict(batch=2, s_q=1, heads=4, head_dim=32, page=16, topk=8,
             max_context_tokens=(256, 1024), actual_tokens=64,
             logits_actual_tokens=512, rounds=2)


def make_inputs(*, batch, s_q, heads, head_dim, page, L, actual, q_dtype=FP8, k_dtype=FP8,
                device=None, seed=0, keys_fp32=False):
    """Indexer inputs: each request owns ceil(actual/page) pages; unused table slots -> page 0.

    ``L`` and ``actual`` are in entries. With ``keys_fp32`` also returns the unquantised
    fp32 keys (for accuracy against exact math).
    """
    device = device or runtime.device()
    g = torch.Generator(device=device).manual_seed(seed)
    ppr = max(1, -(-actual // page))
    P = batch * ppr
    max_pages = -(-L // page)
    kf = torch.randn(P, page, head_dim, generator=g, device=device)
    k = kf.to(k_dtype)
    ks = torch.rand(P, page, generator=g, device=device) * 0.5 + 0.75
    q = torch.randn(batch, s_q, heads, head_dim, generator=g, device=device).to(q_dtype)
    w = torch.randn(batch, s_q, heads, generator=g, device=device) * heads ** -0.5
    bt = torch.zeros(batch, max_pages, dtype=torch.int32, device=device)
    bt[:, :ppr] = torch.arange(P, dtype=torch.int32, device=device).reshape(batch, ppr)
    ctx = torch.full((batch, s_q), actual, dtype=torch.int32, device=device)
    args = (q, k, ks, w, bt, ctx)
    return (args, kf) if keys_fp32 else args


def _base(cfg, **kw):
    row = dict(batch=cfg["batch"], s_q=cfg["s_q"], heads=cfg["heads"], head_dim=cfg["head_dim"],
               page_entries=cfg["page"], compress_ratio=COMPRESS, topk=cfg["topk"])
    row.update(kw)
    return row


def _free():
    if runtime.has_cuda():
        torch.cuda.empty_cache()


def _triton_interleaved(cfg, actual) -> dict:
    """Triton timings per max context, in ``rounds`` interleaved passes (forward, then
    backward, ...), each a fresh capture: time drift and graph placement then average
    out instead of lining up with L (one pass in increasing L cannot tell a slow GPU
    minute from an L-dependent cost). Returns {L: [ms per round]}."""
    fn = backends.resolve("indexer_topk", "triton").fn
    inputs = {}
    for mct in cfg["max_context_tokens"]:
        L = mct // COMPRESS
        inputs[L] = make_inputs(batch=cfg["batch"], s_q=cfg["s_q"], heads=cfg["heads"],
                                head_dim=cfg["head_dim"], page=cfg["page"], L=L, actual=actual)
        ops_indexer.indexer_topk(*inputs[L], max_context=L, topk=cfg["topk"], backend="triton")
    times = {L: [] for L in inputs}
    order = list(inputs)
    for r in range(cfg["rounds"]):
        for L in (order if r % 2 == 0 else order[::-1]):
            t = bench.time_graph(lambda a=inputs[L], L=L: fn(*a, L, cfg["topk"]))
            times[L].append(t)
    return times


def topk_vs_max_context(cfg) -> list[dict]:
    rows = []
    actual = cfg["actual_tokens"] // COMPRESS
    tri = _triton_interleaved(cfg, actual)
    _free()
    headline = (min(cfg["max_context_tokens"]), max(cfg["max_context_tokens"]))
    runs = [(name, "eager") for name in ("torch_fallback", "torch_capped")]
    runs += [("triton", "graph"), ("triton", "eager")]
    for name, mode in runs:
        for mct in cfg["max_context_tokens"]:
            if name == "triton" and mode == "eager" and mct not in headline:
                continue
            L = mct // COMPRESS
            if mode == "graph":
                ts = [t["ms"] for t in tri[L]]
                t = dict(ms=statistics.median(ts), timing=tri[L][0]["timing"],
                         ms_rounds=ts, ms_min=min(ts), ms_max=max(ts))
            else:
                args = make_inputs(batch=cfg["batch"], s_q=cfg["s_q"], heads=cfg["heads"],
                                   head_dim=cfg["head_dim"], page=cfg["page"], L=L,
                                   actual=actual)
                t = bench.time_fn(lambda a=args, L=L, name=name: ops_indexer.indexer_topk(
                    *a, max_context=L, topk=cfg["topk"], backend=name))
                del args
            scored = L if name == "torch_fallback" else (
                -(-actual // cfg["page"]) * cfg["page"] if name == "torch_capped" else actual)
            row = _base(cfg, kind="topk_vs_max_context", op="indexer_topk", backend=name,
                        mode=mode, q_dtype="fp8", k_dtype="fp8", dot=_dot_name(FP8, FP8),
                        max_context_tokens=mct, max_context_entries=L,
                        actual_tokens=cfg["actual_tokens"], actual_entries=actual,
                        entries_scored=scored, **t)
            bench.with_roofline(row, bytes_moved=indexer_bytes(
                cfg["batch"], cfg["s_q"], scored, heads=cfg["heads"], head_dim=cfg["head_dim"],
                page=cfg["page"]), flops=indexer_flops(cfg["batch"], cfg["s_q"], scored,
                                                       heads=cfg["heads"], head_dim=cfg["head_dim"]),
                dtype="fp8")
            rows.append(row)
            _free()
    return rows


def _dot_name(q_dtype, k_dtype) -> str:
    return K.DOT_NAMES[K.dot_path(q_dtype, k_dtype, device_props(runtime.device()))]


def logits_and_dtypes(cfg) -> list[dict]:
    """Triton logits at a long actual length: the roofline row, then the dtype flips."""
    rows = []
    actual = cfg["logits_actual_tokens"] // COMPRESS
    L = actual
    B, S, H, D = cfg["batch"], cfg["s_q"], cfg["heads"], cfg["head_dim"]
    (q0, k0, ks, w, bt, ctx), kf = make_inputs(batch=B, s_q=S, heads=H, head_dim=D,
                                                page=cfg["page"], L=L, actual=actual,
                                                q_dtype=torch.float32, keys_fp32=True)
    del k0
    truth = reference_logits(q0, kf, ks, w, bt, ctx, L)      # fp32 math, unquantised keys
    k_truth = min(cfg["topk"], L)
    top_truth = torch.topk(truth, k_truth, dim=-1).indices
    scale = truth.abs().amax(dim=-1, keepdim=True)
    fn = backends.resolve("indexer_logits", "triton").fn
    variants = [(FP8, FP8, "logits_roofline"), (torch.float32, FP8, "matmul_dtype"),
                (torch.bfloat16, FP8, "matmul_dtype"), (FP8, FP8, "matmul_dtype"),
                (torch.bfloat16, torch.bfloat16, "matmul_dtype")]
    for q_dt, k_dt, kind in variants:
        if kind == "matmul_dtype" and (q_dt, k_dt) == (FP8, FP8):   # the roofline row again
            rows.append(dict(next(r for r in rows if r["mode"] == "graph"), kind=kind))
            continue
        q, k = q0.to(q_dt), kf.to(k_dt)
        args = (q, k, ks, w, bt, ctx)
        out = ops_indexer.indexer_logits(*args, max_context=L, backend="triton")
        top = torch.topk(out, k_truth, dim=-1).indices
        hit = (top[..., :, None] == top_truth[..., None, :]).any(-1).float().mean().item()
        err = ((out - truth).abs() / scale).max().item()
        del out, top
        props = device_props(q.device)
        dot = K.dot_path(q_dt, k_dt, props)
        modes = ("eager", "graph") if kind == "logits_roofline" else ("graph",)
        for mode in modes:
            if mode == "graph":
                t = bench.time_graph(lambda a=args: fn(*a, L))
            else:
                t = bench.time_fn(lambda a=args: ops_indexer.indexer_logits(
                    *a, max_context=L, backend="triton"))
            row = _base(cfg, kind=kind, op="indexer_logits", backend="triton", mode=mode,
                        q_dtype=DTYPE_NAMES[q_dt], k_dtype=DTYPE_NAMES[k_dt], dot=K.DOT_NAMES[dot],
                        max_context_tokens=cfg["logits_actual_tokens"], max_context_entries=L,
                        actual_tokens=cfg["logits_actual_tokens"], actual_entries=actual,
                        entries_scored=actual, recall_vs_fp32=hit, max_rel_logit_err=err,
                        kernel_config=dataclasses.asdict(K.logits_config(dot, k_dt, props)), **t)
            bench.with_roofline(row, bytes_moved=indexer_bytes(
                B, S, actual, heads=H, head_dim=D, key_bytes=k.element_size(),
                q_bytes=q.element_size(), page=cfg["page"]),
                flops=indexer_flops(B, S, actual, heads=H, head_dim=D),
                dtype="fp8" if dot == K.DOT_FP8 else "bf16")
            rows.append(row)
        del q, k, args
        _free()
    return rows


# a configuration of the recorded rows: the newest row of each is the one shown
KEYS = ("kind", "backend", "mode", "q_dtype", "k_dtype", "batch", "s_q", "max_context_tokens",
        "actual_tokens", "gpu")


def mode_of(r: dict) -> str:
    """A row's ``mode``; rows recorded before the field: "graph" for CUDA-graph timings."""
    return r.get("mode") or ("graph" if r.get("timing") == "cuda_graph" else "eager")


def newest(rows, *, smoke: bool = False) -> list[dict]:
    """The newest row per configuration (:data:`KEYS`, with :func:`mode_of` filled in);
    full-mode rows only unless ``smoke``."""
    return results.latest([dict(r, mode=mode_of(r)) for r in rows
                           if bool(r.get("smoke")) == smoke], KEYS)


def headline_table(rows, *, smoke: bool = False) -> str:
    """The headline rows as a small table: us per ``indexer_topk`` call for each backend
    and mode against max context, and the logits roofline row."""
    sel = newest(rows, smoke=smoke)
    top = [r for r in sel if r["kind"] == "topk_vs_max_context"]
    if not top:
        return "no indexer rows"
    ctxs = sorted({r["max_context_tokens"] for r in top})
    r0 = top[0]
    where = results.label(top) if r0.get("gpu") else "this run"
    lines = [f"indexer_topk, top-{r0['topk']}, B {r0['batch']}, {r0['actual_tokens']} actual tokens: "
             f"us per call ({where})",
             f"{'backend':<15} {'mode':<6}" + "".join(f"{_tokens(c):>10}" for c in ctxs)
             + f"{'last/first':>11}"]
    for be in ("torch_fallback", "torch_capped", "triton"):
        for mode in ("graph", "eager"):
            us = {r["max_context_tokens"]: r["ms"] * 1e3 for r in top
                  if r["backend"] == be and r["mode"] == mode}
            if us:
                ratio = f"{us[ctxs[-1]] / us[ctxs[0]]:.2f}x" if ctxs[0] in us and ctxs[-1] in us else "-"
                lines.append(f"{be:<15} {mode:<6}" + "".join(
                    f"{us[c]:>10.1f}" if c in us else f"{'-':>10}" for c in ctxs) + f"{ratio:>11}")
    roof = {r["mode"]: r for r in sel if r["kind"] == "logits_roofline"}
    if "graph" in roof:
        g = roof["graph"]
        lines.append(f"indexer_logits, {g['actual_tokens']:,} tokens a row: {g['ms'] * 1e3:.1f} us "
                     f"replayed ({g['roofline_fraction']:.2f} of the HBM roofline)"
                     + (f", {roof['eager']['ms'] * 1e3:.1f} us called eagerly" if "eager" in roof else ""))
    return "\n".join(lines)


def _tokens(n: int) -> str:
    return f"{n // 1048576}M" if n >= 1048576 and n % 1048576 == 0 else (
        f"{n // 1024}K" if n % 1024 == 0 else str(n))


@benchmark("indexer", "lightning indexer: top-k vs max_context per backend (eager and graph); "
                      "logits roofline; fp32/bf16/fp8 matmul")
def run_indexer(smoke: bool) -> list[dict]:
    cfg = SMOKE if smoke else FULL
    rows = topk_vs_max_context(cfg) + logits_and_dtypes(cfg)
    print(f"indexer bench ({'smoke' if smoke else 'full'}, {cfg['heads']}x{cfg['head_dim']} heads, "
          f"page={cfg['page']} entries, 1 entry = {COMPRESS} tokens)")
    print(headline_table([dict(r, smoke=smoke) for r in rows], smoke=smoke))
    return rows


def graph_replay_demo(*, smoke: bool = True, scenarios=None) -> list[dict]:
    """Capture one decode-step ``indexer_topk`` (triton) and replay it with new lengths.

    On a GPU: one ``torch.cuda.CUDAGraph`` captured once; each scenario writes new
    ``context_lens`` and a shuffled block table into the SAME buffers, replays, and
    compares with an eager call. On the CPU (no graphs) the same buffers are rewritten and
    the kernel is called again, showing it reads the lengths from the tensors, not from
    Python. Returns one row per scenario.
    """
    cfg = SMOKE if smoke or not runtime.has_cuda() else dict(FULL, batch=8)
    B, page, topk = cfg["batch"], cfg["page"], cfg["topk"]
    max_pages = 8 if smoke else 48
    L = page * max_pages
    args = make_inputs(batch=B, s_q=1, heads=cfg["heads"], head_dim=cfg["head_dim"], page=page,
                       L=L, actual=L, seed=3)
    q, k, ks, w, bt, ctx = args
    P = k.shape[0]
    fn = lambda: ops_indexer.indexer_topk(*args, topk=topk, backend="triton")  # noqa: E731
    graph, out = bench.capture_graph(fn) if runtime.has_cuda() else (None, None)
    g = torch.Generator().manual_seed(0)
    scenarios = scenarios or [[L] * B, [0, 1] + [topk - 1, topk + 1] * ((B - 2) // 2),
                              torch.randint(0, L + 1, (B,), generator=g).tolist()]
    rows = []
    for i, lens in enumerate(scenarios):
        lens = (list(lens) * B)[:B]
        ctx.copy_(torch.tensor(lens, dtype=torch.int32).reshape(B, 1))
        bt.copy_(torch.randperm(P, generator=g).reshape(B, -1)[:, :max_pages].to(torch.int32))
        if graph is not None:
            graph.replay()
            torch.cuda.synchronize()
            got = out.clone()
        else:
            got = fn()
        eager = ops_indexer.indexer_topk(*args, topk=topk, backend="torch_fallback")
        ref = reference_logits(*args, L)
        sc = lambda idx: torch.where(idx >= 0, torch.gather(ref, 2, idx.clamp(min=0).long()),  # noqa: E731
                                     float("-inf")).sort(-1).values
        rows.append(dict(scenario=i, context_lens=lens, replayed=graph is not None,
                         valid_counts=(got >= 0).sum(-1).flatten().tolist(),
                         same_scores_as_fp32_topk=bool(torch.allclose(sc(got), sc(eager),
                                                                      rtol=2e-2, atol=2e-2))))
    return rows
