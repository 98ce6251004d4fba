"""``dsv4lab bench spec``: MTP speculative decoding of the trained mini model.

Prompts are held-out standard-library source (the training split's held-out files; 8
prompts of 48..104 bytes, starting at line starts). For concurrency 1 and 8 and for 0
(plain), 1, 2, 3 draft tokens: greedy generation of ``NEW`` tokens through
:class:`dsv4lab.engine.Engine` (the auto backends: MMA attention for the S_q = k + 1
verify, the Triton indexer and the Triton MXFP4 MoE), timed whole (prefill included, the
same for every row) with :func:`dsv4lab.bench.time_fn`. Field ``mode``: ``"graph"``, the
engine's decode steps replayed from CUDA graphs (every case), or ``"eager"``, the same
steps launched one kernel at a time (the headline case, concurrency 1, on a GPU). Rows
carry tokens/s, speedup over plain decoding in the same mode, whether the tokens are
identical to plain decoding, the acceptance of each draft position, and the mean accepted
length (tokens per verify step). One more row runs the draft layer's MoE on the torch
backend (dequantise + fp32 matmul) instead of Triton, at concurrency 1 and 3 drafts
(eagerly: that MoE reads routing on the host; ``ALT_NEW`` tokens, its speedup against plain
decoding of the same length).

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
ALT_NEW = 32            # the eager torch-draft-MoE row (it is ~10x slower per token)
CONCURRENCY = (1, 8)
DRAFTS = (0, 1, 2, 3)
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


def print_table(rows: list[dict]) -> None:
    print(f"{'conc':>4} {'k':>2} {'mode':<5} {'draft moe':<9} {'tok/s':>9} {'speedup':>7} {'same':>5} "
          f"{'accepted/step':>13}  acceptance per draft position")
    for r in rows:
        acc = " ".join(f"{a:.2f}" for a in r["acceptance"]) or "-"
        print(f"{r['concurrency']:>4} {r['num_draft']:>2} {mode_of(r):<5} {r['draft_moe']:<9} "
              f"{r['tokens_per_s']:>9.1f} {r['speedup']:>7.2f} {str(r['identical']):>5} "
              f"{r['mean_accepted']:>13.2f}  {acc}")


@bench.benchmark("spec", "MTP speculative decoding: acceptance and tokens/s, plain vs 1-3 drafts")
def bench_spec(smoke: bool) -> list[dict]:
    model, source = load_model(smoke)
    gpu = runtime.has_cuda()
    new = 12 if smoke else NEW
    concs = (1, 2) if smoke else CONCURRENCY
    drafts = (0, 1, 2) if smoke else DRAFTS
    prompts = heldout_prompts()
    be = {} if gpu else TORCH            # auto on a GPU; the fp32 references in the interpreter
    eng = Engine(model, max_batch=max(concs), max_len=max(map(len, prompts)) + new + 16,
                 backends=be)
    rows = []
    # a generate call takes a fraction of a second: 1.5 s of repetitions give a median of
    # several calls, so that one slow call (a host hiccup) is not the figure
    timing = dict(warmup_ms=200, rep_ms=1500) if gpu else dict(cpu_reps=1)

    def run(ps, k, engine, draft_moe, n=new):
        out = engine.generate(ps, n, num_draft=k, progress=False)
        t = bench.time_fn(lambda: engine.generate(ps, n, num_draft=k, progress=False), **timing)
        return out, t

    # the headline case (concurrency 1) also with every step launched eagerly (no graphs)
    eager = Engine(model, max_batch=1, max_len=eng.max_len, backends=be,
                   cuda_graphs=False) if gpu else None
    for conc in concs:
        ps = prompts[:conc]
        for engine in (eng, eager) if conc == 1 and eager is not None else (eng,):
            plain = None
            for k in drafts:
                out, t = run(ps, k, engine, engine.draft_backends.get("fused_moe"))
                plain = plain or (out, t)
                rows.append(_row(conc, k, out, t, plain, new, engine,
                                 engine.draft_backends["fused_moe"], source))
    # the draft layer's MoE on the torch reference backend instead of Triton. The torch
    # MoE reads routing on the host, so that engine runs eagerly (no CUDA graph): a short
    # generation (ALT_NEW tokens), against a plain run of the same length
    if not smoke or not gpu:
        k = max(drafts)
        alt = "torch" if eng.draft_backends["fused_moe"] != "torch" else "triton"
        if gpu or alt == "torch":
            alt_new = min(new, ALT_NEW)
            eng2 = Engine(model, max_batch=1, max_len=eng.max_len, backends=dict(eng.backends),
                          draft_backends=dict(eng.backends, fused_moe=alt),
                          cuda_graphs=False if alt == "torch" else None)
            out, t = run(prompts[:1], k, eng2, alt, alt_new)
            plain = run(prompts[:1], 0, eng, None, alt_new)
            rows.append(_row(1, k, out, t, plain, alt_new, eng2, alt, source))
    print_table(rows)
    return rows


def _row(conc, k, out, t, plain, new, eng, draft_moe, source) -> dict:
    tps = conc * new / (t["ms"] / 1e3)
    plain_tps = conc * new / (plain[1]["ms"] / 1e3)
    return {
        "concurrency": conc, "num_draft": k, "mode": "graph" if out.graphs else "eager",
        "new_tokens": new, "ms": t["ms"], "timing": t["timing"],
        "tokens_per_s": tps, "speedup": tps / plain_tps, "identical": out.tokens == plain[0].tokens,
        "acceptance": out.acceptance, "mean_accepted": out.mean_accepted, "steps": out.steps,
        "graphs": out.graphs, "notes": out.notes, "draft_moe": draft_moe,
        "attention": eng.backends["sparse_mla_decode"], "indexer": eng.backends["indexer_topk"],
        "moe": eng.backends.get("fused_moe", "bf16"), "dtype": str(eng.dtype).replace("torch.", ""),
        "model": source, "split": "held-out",
    }
