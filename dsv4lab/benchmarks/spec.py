"""``dsv4lab bench spec``: MTP speculative decoding of the trained mini model.

Prompts are held-out standard-library source (the training split's held-out files; 8
prompts of 48..104 bytes, starting at line starts). For concurrency 1 and 8 and for 0
(plain), 1, 2, 3 draft tokens: greedy generation of ``NEW`` tokens through
:class:`dsv4lab.engine.Engine` (the auto backends), timed whole (prefill included, the same
for every row) with :func:`dsv4lab.bench.time_fn`. Each row also times the loop's stages
alone (after the generation, so the replays change no output): one plain step, or one
verify and one draft step, and the prefill. What speculation buys is then readable from
two numbers: tokens per step (``mean_accepted``) over the cost of a speculative step against
a plain one (``step_cost_ratio``); ``speedup_from_steps`` is their quotient, the decode-only
speedup the measured ``speedup`` approaches as generations get longer.

Field ``mode``: ``"graph"``, every stage replayed from its CUDA graph (every case), or
``"eager"``, the stages launched kernel by kernel (concurrency 1, ``EAGER_NEW`` tokens, on a
GPU). Concurrency 1 in graphs runs ``RUNS`` times (field ``run``), each with a fresh engine
(its own captures), so three independent runs come from one call. Rows carry tokens/s,
speedup over plain decoding in the same run and mode, whether the tokens are identical to
plain decoding's, the acceptance of each draft position and the mean accepted length.

Needs data/checkpoints/mini.safetensors (``dsv4lab train``); without it (smoke mode
only) a random tiny model is used. Explained in notebooks/05_mtp_speculative.ipynb.
"""
from __future__ import annotations

from pathlib import Path

import torch

from dsv4lab import bench, runtime
from dsv4lab.engine import Engine
from dsv4lab.model import DSV4, load_checkpoint, tiny_config

CKPT = Path(__file__).resolve().parents[2] / "data" / "checkpoints" / "mini.safetensors"
NEW = 128
EAGER_NEW = 32          # eager rows: a step launched kernel by kernel costs ~10x a replay
CONCURRENCY = (1, 8)
DRAFTS = (0, 1, 2, 3)
RUNS = 3                # independent repetitions of concurrency 1 (graph mode)
TORCH = {"sparse_mla_decode": "torch", "indexer_topk": "torch_fallback", "fused_moe": "torch"}


def heldout_prompts(n: int = 8, lo: int = 48, hi: int = 104) -> list[bytes]:
    """``n`` prompts from the held-out split, of lengths spread over [lo, hi]."""
    from dsv4lab.train import load_corpus
    _, held, _ = load_corpus()
    data = bytes(held.numpy())
    out = []
    for i in range(n):
        start = data.find(b"\n", (i + 1) * len(data) // (n + 1)) + 1
        length = lo + (hi - lo) * i // max(1, n - 1)
        out.append(data[start:start + length])
    return out


def load_model(smoke: bool) -> tuple[DSV4, str]:
    if CKPT.exists():
        m = load_checkpoint(CKPT)
        return m, f"{CKPT.name} ({m.checkpoint_metadata.get('trained_on', '?')}, " \
                  f"{m.checkpoint_metadata.get('steps', '?')} steps)"
    if not smoke:
        raise FileNotFoundError(f"{CKPT} is missing: run `dsv4lab train` first")
    torch.manual_seed(0)
    return DSV4(tiny_config()).eval().quantize_experts("mxfp4"), "random tiny model (no checkpoint)"


def mode_of(r: dict) -> str:
    """A row's ``mode``; rows recorded before the field: from whether graphs ran."""
    return r.get("mode") or ("graph" if r.get("graphs") else "eager")


def _f(x, spec: str, width: int) -> str:
    return f"{x:{width}{spec}}" if isinstance(x, (int, float)) else f"{'-':>{width}}"


def print_table(rows: list[dict]) -> None:
    """One line a row: throughput, speedup, identical output, tokens a step, and the step
    timings that explain the speedup (ms; ratio = speculative step / plain step)."""
    print(f"{'conc':>4} {'k':>2} {'mode':<5} {'run':>3} {'tok/s':>8} {'speedup':>7} {'same':>5} "
          f"{'tok/step':>8} {'plain':>6} {'verify':>6} {'draft':>6} {'ratio':>5} {'from steps':>10}")
    for r in rows:
        print(f"{r['concurrency']:>4} {r['num_draft']:>2} {mode_of(r):<5} {_f(r.get('run'), 'd', 3)} "
              f"{r['tokens_per_s']:>8.1f} {r['speedup']:>7.2f} {str(r['identical']):>5} "
              f"{r['mean_accepted']:>8.2f} {_f(r.get('plain_step_ms'), '.3f', 6)} "
              f"{_f(r.get('verify_ms'), '.3f', 6)} {_f(r.get('draft_ms'), '.3f', 6)} "
              f"{_f(r.get('step_cost_ratio'), '.2f', 5)} {_f(r.get('speedup_from_steps'), '.2f', 10)}")


def breakdown(rows: list[dict], concurrency: int = 1, mode: str = "graph") -> list[dict]:
    """Where the speedup comes from, per draft count at ``concurrency`` in ``mode``: the median
    over runs of tokens a step, the plain / verify / draft step times (ms), the step cost
    ratio, the speedup they make, and the measured speedup (median, lowest, highest)."""
    import statistics
    out = []
    mine = [r for r in rows if r["concurrency"] == concurrency and mode_of(r) == mode and r.get("step_ms")]
    for k in sorted({r["num_draft"] for r in mine}):
        rk = [r for r in mine if r["num_draft"] == k]
        med = {f: statistics.median(r[f] for r in rk) if all(r.get(f) is not None for r in rk) else None
               for f in ("mean_accepted", "plain_step_ms", "verify_ms", "draft_ms", "step_cost_ratio",
                         "speedup_from_steps", "speedup")}
        out.append(dict(med, num_draft=k, runs=len(rk), speedup_lo=min(r["speedup"] for r in rk),
                        speedup_hi=max(r["speedup"] for r in rk)))
    return out


def print_breakdown(rows: list[dict], concurrency: int = 1, mode: str = "graph") -> None:
    """:func:`breakdown` as a table (a note when the rows carry no step timings)."""
    parts = breakdown(rows, concurrency, mode)
    if not parts:
        print(f"no {mode} rows with step timings at concurrency {concurrency}")
        return
    print(f"{'k':>2} {'runs':>4} {'tok/step':>8} {'plain ms':>8} {'verify':>7} {'draft':>7} {'ratio':>6} "
          f"{'from steps':>10} {'measured (lo-hi)':>18}")
    for p in parts:
        print(f"{p['num_draft']:>2} {p['runs']:>4} {p['mean_accepted']:>8.2f} {_f(p['plain_step_ms'], '.3f', 8)} "
              f"{_f(p['verify_ms'], '.3f', 7)} {_f(p['draft_ms'], '.3f', 7)} {p['step_cost_ratio']:>6.2f} "
              f"{p['speedup_from_steps']:>10.2f} {p['speedup']:>6.2f} ({p['speedup_lo']:.2f}-{p['speedup_hi']:.2f})")


def measure(eng: Engine, prompts, drafts, new: int, timing: dict, stage_timing: dict, run: int,
            source: str) -> list[dict]:
    """Rows for ``prompts`` at every draft count in ``drafts`` (0 first: the plain baseline)."""
    rows, plain = [], None
    for k in drafts:
        def call():
            return eng.generate(prompts, new, num_draft=k, progress=False)
        out = call()                           # captures this (batch, k)'s graphs
        t = bench.time_fn(call, **timing)
        # after a generation every request is done: a replay recomputes its rows past the
        # end and changes nothing else; the prefill (it restarts the requests) goes last
        stages = {name: bench.time_fn(fn, **stage_timing)["ms"]
                  for name, fn in eng.loop(len(prompts), k).stage_calls().items()}
        if plain is None:
            plain = (out, t, stages)
        rows.append(_row(len(prompts), k, out, t, stages, plain, new, eng, run, source))
    return rows


@bench.benchmark("spec", "MTP speculative decoding: acceptance, step costs and tokens/s, plain vs 1-3 drafts")
def bench_spec(smoke: bool) -> list[dict]:
    model, source = load_model(smoke)
    gpu = runtime.has_cuda()
    new = 8 if smoke else NEW
    concs = (1, 2) if smoke else CONCURRENCY
    drafts = (0, 2) if smoke else DRAFTS
    prompts = heldout_prompts()
    be = {} if gpu else TORCH            # auto on a GPU; the fp32 references in the interpreter
    max_len = max(map(len, prompts)) + new + 16
    # a generate call takes a fraction of a second: 0.8 s of repetitions gives a median of
    # several calls, so that one slow call (a host hiccup) is not the figure
    timing = dict(warmup_ms=200, rep_ms=800) if gpu else dict(cpu_reps=1)
    stage_timing = dict(warmup_ms=25, rep_ms=200) if gpu else dict(cpu_reps=1)
    rows = []
    for conc in concs:
        for run in range(RUNS if conc == 1 and not smoke else 1):
            eng = Engine(model, max_batch=conc, max_len=max_len, backends=be)
            rows += measure(eng, prompts[:conc], drafts, new, timing, stage_timing, run, source)
    if gpu and not smoke:                # concurrency 1 with every stage launched eagerly
        eager = Engine(model, max_batch=1, max_len=max_len, backends=be, cuda_graphs=False)
        quick = dict(warmup_ms=1, rep_ms=1)
        graph_plain = next(r for r in rows if r["concurrency"] == 1 and r["num_draft"] == 0)
        for r in measure(eager, prompts[:1], drafts, EAGER_NEW, quick, quick, 0, source):
            r["identical_to_graph"] = r.pop("_tokens") == [t[:EAGER_NEW] for t in graph_plain["_tokens"]]
            rows.append(r)
    for r in rows:
        r.pop("_tokens", None)
    print_table(rows)
    return rows


def _row(conc, k, out, t, stages, plain, new, eng, run, source) -> dict:
    tps = conc * new / (t["ms"] / 1e3)
    plain_tps = conc * new / (plain[1]["ms"] / 1e3)
    plain_step = plain[2]["step"]
    step = stages["step"] if k == 0 else stages["verify"] + stages["draft"]
    ratio = step / plain_step
    return {
        "concurrency": conc, "num_draft": k, "mode": "graph" if out.graphs else "eager", "run": run,
        "new_tokens": new, "ms": t["ms"], "timing": t["timing"],
        "tokens_per_s": tps, "speedup": tps / plain_tps, "identical": out.tokens == plain[0].tokens,
        "acceptance": out.acceptance, "mean_accepted": out.mean_accepted,
        "accepted_drafts": out.accepted_drafts, "steps": out.steps,
        "plain_step_ms": plain_step, "step_ms": step, "verify_ms": stages.get("verify"),
        "draft_ms": stages.get("draft"), "prefill_ms": stages["prefill"],
        "stage_timing": "cuda_graph" if out.graphs else t["timing"],
        "step_cost_ratio": ratio, "speedup_from_steps": out.mean_accepted / ratio,
        "graphs": out.graphs, "notes": out.notes, "draft_moe": eng.draft_backends.get("fused_moe", "bf16"),
        "attention": eng.backends["sparse_mla_decode"], "indexer": eng.backends["indexer_topk"],
        "moe": eng.backends.get("fused_moe", "bf16"), "dtype": str(eng.dtype).replace("torch.", ""),
        "model": source, "split": "held-out", "_tokens": out.tokens,
    }
