"""Where the time of a speculative decode step goes (issue #6 follow-up).

For plain decoding (k = 0) and k = 1, 2 drafts at concurrency 1, on the trained mini
model (or a random tiny one with ``--tiny`` / without a checkpoint):

1. the eager prefill's wall time (prompt + MTP layer over the prompt + first drafts),
2. one step's wall time as a CUDA-graph replay and as an eager step (CUDA events),
3. torch.profiler around a few graph replays: GPU kernels per step, their summed time,
   the busiest kernels (CUPTI reports the kernels of a graph replay one by one),
4. torch.profiler around a few eager steps: kernels (on the CPU: leaf aten ops) and their
   time per stage of the step, from the engine's ``record_function`` labels
   (``step.meta / main / accept / mtp / draft / update``, see ``_Runner.step``),
5. a whole ``generate`` of ``--new`` tokens, and its split into prefill, steps and the rest.

    python scripts/profile_spec.py                  # H200: < 60 s; writes $OUT/profile_spec.json if $OUT is set
    python scripts/profile_spec.py --drafts 0 2 --steps 10 --json /tmp/p.json

On the CPU (no CUDA) it runs the fp32 torch backends eagerly and counts leaf aten ops per
stage instead of kernels (a proxy: no fused kernels there). Explained in
notebooks/05_mtp_speculative.ipynb.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter, defaultdict

import torch

import dsv4lab  # noqa: F401  (sets up the runtime before triton is imported)
from dsv4lab import runtime
from dsv4lab.benchmarks.spec import TORCH, heldout_prompts, load_model
from dsv4lab.engine import Engine
from dsv4lab.model import DSV4, tiny_config

STAGES = ("step.meta", "step.main", "step.accept", "step.mtp", "step.draft", "step.update")
PREFILL = ("prefill.main", "prefill.mtp")
DeviceType = torch.autograd.DeviceType


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, n, dev) -> float:
    """Milliseconds per call of ``fn`` over ``n`` calls (CUDA events on a GPU)."""
    if dev.type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        for _ in range(n):
            fn()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) / n
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) * 1e3 / n


def _under(evt, leaf_ops: bool) -> list:
    """(kernel name, us) of every GPU kernel launched under a CPU event, recursively;
    ``leaf_ops`` (a CPU-only profile): the leaf ops that do work instead (name, self CPU us)."""
    out = [(k.name, k.duration) for k in evt.kernels]
    if (leaf_ops and not evt.cpu_children and evt.device_type == DeviceType.CPU
            and evt.name not in _NO_WORK and not evt.name.startswith(("step.", "prefill."))):
        out.append((evt.name, evt.self_cpu_time_total))
    for ch in evt.cpu_children:
        out += _under(ch, leaf_ops)
    return out


# leaf CPU ops that move no data (views, allocations, no-op casts): not counted on the CPU
_NO_WORK = {"aten::" + n for n in (
    "as_strided", "view", "_unsafe_view", "reshape", "expand", "slice", "select", "unsqueeze", "squeeze",
    "permute", "transpose", "t", "alias", "detach", "unbind", "split", "split_with_sizes", "empty",
    "empty_like", "empty_strided", "resize_", "to", "lift_fresh", "item", "_local_scalar_dense")}


def _activities(dev):
    acts = [torch.profiler.ProfilerActivity.CPU]
    if dev.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


def _profile(fn, n, dev):
    _sync(dev)
    with torch.profiler.profile(activities=_activities(dev)) as prof:
        for _ in range(n):
            fn()
        _sync(dev)
    return prof


def _by_stage(prof, n, names) -> dict:
    """Per stage label: kernels per step, their us per step, CPU us per step."""
    out = {}
    events = prof.events()
    leaf_ops = not any(e.device_type == DeviceType.CUDA for e in events)
    for e in events:
        if e.device_type == DeviceType.CPU and e.name in names:
            s = out.setdefault(e.name, {"kernels": 0.0, "kernel_us": 0.0, "cpu_us": 0.0, "_n": Counter()})
            ks = _under(e, leaf_ops)
            s["kernels"] += len(ks) / n
            s["kernel_us"] += sum(d for _, d in ks) / n
            s["cpu_us"] += e.cpu_time_total / n
            for name, _ in ks:
                s["_n"][name] += 1
    for s in out.values():
        s["top"] = [(k, round(c / n, 1)) for k, c in s.pop("_n").most_common(8)]
    return out


def family(name: str) -> str:
    """A kernel's family: cuBLAS GEMM/GEMV (or its split-K reduction), one Triton kernel
    of the project (by name), or a torch elementwise / reduction / indexing / copy kernel."""
    low = name.lower()
    if any(w in low for w in ("gemm", "gemv", "sgemm", "cutlass", "xmma", "splitkreduce", "cublas")):
        return "cublas " + ("gemv" if "gemv" in low else "gemm")
    if name.startswith("_") and "kernel" in name:
        return "triton " + name.split("(")[0][:40]
    if "memcpy" in low or "memset" in low:
        return "memcpy/memset"
    for w in ("index", "scatter", "gather", "cat", "copy", "reduce", "softmax", "topk", "sort", "embedding"):
        if w in low:
            return "torch " + w
    return "torch elementwise/other"


def _gpu_kernels(prof, n) -> dict:
    """Every GPU-side event of the profile (kernels, memcpy, memset) per step, by name."""
    by = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == DeviceType.CUDA and not e.name.startswith(("step.", "prefill.")):
            by[e.name][0] += 1                       # (not the stage labels' GPU spans)
            by[e.name][1] += e.time_range.elapsed_us()
    total_n = sum(c for c, _ in by.values()) / n
    total_us = sum(t for _, t in by.values()) / n
    top = sorted(by.items(), key=lambda kv: -kv[1][1])[:15]
    fam = defaultdict(lambda: [0.0, 0.0])
    for name, (c, t) in by.items():
        fam[family(name)][0] += c / n
        fam[family(name)][1] += t / n
    return {"kernels_per_step": total_n, "kernel_us_per_step": total_us,
            "top": [(name[:90], c / n, t / n) for name, (c, t) in top],
            "families": {f: (c, t) for f, (c, t) in sorted(fam.items(), key=lambda kv: -kv[1][1])}}


def profile_k(eng: Engine, prompt: list[int], k: int, steps: int, new: int) -> dict:
    dev = eng.device
    r = eng._runner(1, k)                    # captures the step's graph on a GPU
    row = {"num_draft": k, "graph": r.graph is not None, "graph_error": r.graph_error}
    pages = eng.admit(r)
    try:
        _sync(dev)
        t = time.perf_counter()
        eng.prefill(r, [prompt], 10 ** 6)    # never finishes: every profiled step is active
        _sync(dev)
        row["prefill_ms"] = (time.perf_counter() - t) * 1e3
        for _ in range(3):
            r.run_step()
        if r.graph is not None:
            row["graph_step_ms"] = _timed(r.run_step, steps, dev)
            prof = _profile(r.run_step, 5, dev)
            row["graph_replay"] = _gpu_kernels(prof, 5) if dev.type == "cuda" else None
        row["eager_step_ms"] = _timed(r.step, max(3, steps // 4), dev)
        prof = _profile(r.step, 3, dev)
        row["eager_stages"] = _by_stage(prof, 3, STAGES)
        if dev.type == "cuda":
            row["eager_kernels"] = _gpu_kernels(prof, 3)
        hist = r.hist.tolist()
        row["mean_accepted_profiled"] = sum((a + 1) * c for a, c in enumerate(hist)) / max(1, sum(hist))
    finally:
        eng.cache.release(pages)
    # prefill split by stage (eager), then a whole generation as `dsv4lab bench spec` runs it
    pages = eng.admit(r)
    try:
        prof = _profile(lambda: eng.prefill(r, [prompt], 10 ** 6), 1, dev)
        row["prefill_stages"] = _by_stage(prof, 1, PREFILL)
    finally:
        eng.cache.release(pages)
    eng.generate([prompt], new, num_draft=k, progress=False)          # warm
    _sync(dev)
    t = time.perf_counter()
    g = eng.generate([prompt], new, num_draft=k, progress=False)
    _sync(dev)
    row["generate_ms"] = (time.perf_counter() - t) * 1e3
    row["generate_steps"] = g.steps
    row["tokens_per_s"] = new / (row["generate_ms"] / 1e3)
    row["mean_accepted"] = g.mean_accepted
    step_ms = row.get("graph_step_ms", row["eager_step_ms"])
    row["split_ms"] = {"prefill": row["prefill_ms"], "steps": g.steps * step_ms,
                       "rest": row["generate_ms"] - row["prefill_ms"] - g.steps * step_ms}
    return row


def report(rows: list[dict]) -> None:
    base = rows[0] if rows and rows[0]["num_draft"] == 0 else None
    gpu = any(r.get("graph_replay") for r in rows)
    unit = "kernels" if gpu or any("eager_kernels" in r for r in rows) else "leaf ops"
    print(f"\n{'k':>2} {'tok/s':>7} {'acc/step':>8} {'steps':>5} {'prefill ms':>10} {'graph ms/step':>13} "
          f"{'eager ms/step':>13} {'x plain':>7} {'acc/x':>6} {unit + '/step (graph)':>22}")
    for r in rows:
        gs = r.get("graph_step_ms")
        rel = (gs or r["eager_step_ms"]) / (base.get("graph_step_ms") or base["eager_step_ms"]) if base else float("nan")
        gr = r.get("graph_replay") or {}
        kn = f"{gr['kernels_per_step']:.0f} / {gr['kernel_us_per_step']:.0f} us" if gr else "-"
        print(f"{r['num_draft']:>2} {r['tokens_per_s']:>7.1f} {r['mean_accepted']:>8.2f} {r['generate_steps']:>5} "
              f"{r['prefill_ms']:>10.2f} {gs if gs is not None else float('nan'):>13.3f} "
              f"{r['eager_step_ms']:>13.3f} {rel:>7.2f} {r['mean_accepted'] / rel:>6.2f} {kn:>22}")
    for r in rows:
        if r.get("graph_error"):
            print(f"  k={r['num_draft']}: CUDA graph capture failed, eager steps: {r['graph_error']}")
    print("(x plain: a step's cost over a plain step's; acc/x: the speedup of the steps alone at this "
          "acceptance, prefill left out)")
    print("\n(generate split, ms: prefill / steps x graph step / rest = syncs, host work)")
    for r in rows:
        s = r["split_ms"]
        print(f"  k={r['num_draft']}: total {r['generate_ms']:.1f} = {s['prefill']:.1f} + {s['steps']:.1f} + {s['rest']:.1f}")
    print(f"\nper stage of an EAGER step ({unit} per step, their time in us, CPU us):")
    for r in rows:
        print(f"  k={r['num_draft']}:")
        for name in STAGES + PREFILL:
            st = r["eager_stages"].get(name) or r.get("prefill_stages", {}).get(name)
            if st:
                print(f"    {name:<13} {st['kernels']:>7.1f} {unit:<8} {st['kernel_us']:>9.1f} us  "
                      f"cpu {st['cpu_us']:>9.1f} us   top: " + ", ".join(f"{n[:28]} x{c}" for n, c in st["top"][:4]))
    fams = [(r["num_draft"], r.get("graph_replay") or r.get("eager_kernels")) for r in rows]
    fams = [(k, g["families"]) for k, g in fams if g and g.get("families")]
    if fams:
        names = sorted({f for _, fa in fams for f in fa}, key=lambda f: -max(fa.get(f, (0, 0))[1] for _, fa in fams))
        print("\nGPU time per step by kernel family (count x, us), graph replays; "
              "the growth over k=0 is where a verify step's extra time goes:")
        print(f"  {'family':<44}" + "".join(f"{'k=' + str(k):>20}" for k, _ in fams))
        for f in names[:16]:
            print(f"  {f:<44}" + "".join(f"{fa.get(f, (0, 0))[0]:>8.1f}x {fa.get(f, (0, 0))[1]:>9.1f}" for _, fa in fams))
    for r in rows:
        gr = r.get("graph_replay")
        if gr:
            print(f"\nk={r['num_draft']}: busiest GPU kernels of one graph replay (count, us per step):")
            if not gr["top"]:
                print("  (no kernels reported inside graph replays: read the eager stages above)")
            for name, c, t in gr["top"][:10]:
                print(f"  {t:>8.1f} us  x{c:<5.1f} {name}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafts", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=20, help="graph replays timed per k")
    ap.add_argument("--new", type=int, default=128, help="tokens of the whole generate")
    ap.add_argument("--tiny", action="store_true", help="a random tiny model instead of the checkpoint")
    ap.add_argument("--json", default=None, help="write the rows here (default $OUT/profile_spec.json)")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    if a.tiny:
        model, source = DSV4(tiny_config()).eval().quantize_experts("mxfp4"), "random tiny model"
    else:
        model, source = load_model(smoke=True)
    gpu = runtime.has_cuda()
    if not gpu:
        torch.set_num_threads(1)            # as Engine.generate does on the CPU
    prompt = list(heldout_prompts(1, 64, 64)[0]) if not a.tiny else list(range(1, 40))
    n_steps = 3 + a.steps + max(3, a.steps // 4) + 3 + 5 + 2
    max_len = len(prompt) + max(a.new, (max(a.drafts) + 1) * n_steps) + 16
    eng = Engine(model, max_batch=1, max_len=max_len, backends={} if gpu else dict(TORCH))
    print(f"profile_spec: {source}; {runtime.versions().get('gpu') or 'CPU'}; backends {eng.backends}; "
          f"draft {eng.draft_backends}; prompt {len(prompt)} tokens", flush=True)
    t0 = time.perf_counter()
    rows = []
    for k in a.drafts:
        rows.append(profile_k(eng, prompt, k, a.steps, a.new))
        print(f"  k={k} done ({time.perf_counter() - t0:.1f} s)", flush=True)
    report(rows)
    path = a.json or (os.path.join(os.environ["OUT"], "profile_spec.json") if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump({"source": source, "versions": runtime.versions(), "rows": rows}, f, indent=1, default=str)
        print(f"\nwrote {path}")
    print(f"profile_spec: {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
