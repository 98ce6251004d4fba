"""Sweep the lightning indexer's logits launch configurations on this GPU; print a TUNED entry.

    python tools/tune_indexer.py              # B 64, 131,072 actual tokens a row (a few minutes)
    python tools/tune_indexer.py --dry-run    # tiny shapes, two candidates a path (interpreter)

For each dtype path (e4m3 q and keys, bf16 q with e4m3 keys, bf16 q and keys, fp32 q with
e4m3 keys) the tool runs every candidate :class:`dsv4lab.kernels.indexer.LogitsConfig`,
checks it against the fp32 reference (the tolerances of tests/test_indexer.py), times it as
a CUDA-graph replay, and prints the fastest correct one of each path as the entry of
``TUNED`` in kernels/indexer.py for this GPU's capability. Every timing goes to
``tune_indexer.json`` in ``--out`` (default: ``$OUT`` or the current folder).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import dsv4lab  # noqa: F401  (sets TRITON_INTERPRET before triton is imported on a CPU)
import torch

from dsv4lab import bench, runtime
from dsv4lab.benchmarks.indexer import make_inputs
from dsv4lab.kernels import indexer as K
from dsv4lab.kernels.device import props as device_props
from dsv4lab.ops.indexer import reference_logits

FP8 = torch.float8_e4m3fn
FULL = dict(batch=64, heads=64, head_dim=128, page=64, entries=32768)
DRY = dict(batch=2, heads=4, head_dim=32, page=16, entries=64)
PATHS = {"fp8": (FP8, FP8), "bf16q": (torch.bfloat16, FP8), "bf16": (torch.bfloat16, torch.bfloat16),
         "fp32q": (torch.float32, FP8)}
TOL = {"fp8": 2e-2, "bf16q": 1e-4, "bf16": 1e-4, "fp32q": 1e-4}
C = K.LogitsConfig
# (block_n, block_d, num_warps, num_stages, programs_per_sm), the defaults among them
TENSOR_CORE = [C(128, None, 4, 2, 8), C(128, None, 4, 3, 8), C(128, None, 4, 3, 4), C(128, None, 4, 3, 12),
               C(128, None, 4, 3, 16), C(128, None, 8, 3, 8), C(256, None, 8, 3, 4), C(256, None, 8, 2, 8),
               C(64, None, 4, 3, 8), C(64, None, 4, 4, 8), C(64, None, 4, 4, 12), C(64, None, 4, 6, 16)]
FP32 = [C(64, 16, 4, 2, 8), C(32, 16, 4, 2, 8), C(64, 16, 4, 3, 8), C(128, 16, 8, 2, 8), C(64, 32, 8, 2, 8)]


def rel_err(out, ref) -> float:
    """Largest error relative to each row's largest |logit|; inf if visibility differs."""
    inv = torch.isneginf(ref)
    if not torch.equal(inv, torch.isneginf(out)):
        return float("inf")
    fin = ref.masked_fill(inv, 0)
    scale = fin.abs().amax(dim=-1, keepdim=True).clamp(min=1e-6)
    return ((out.masked_fill(inv, 0) - fin).abs() / scale).max().item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes (the interpreter on a CPU)")
    ap.add_argument("--out", default=None, help="folder for tune_indexer.json (default $OUT, else .)")
    args = ap.parse_args(argv)
    if not args.dry_run and not runtime.has_cuda():
        print("tune_indexer: needs a CUDA GPU (--dry-run runs tiny shapes in the interpreter)")
        return 2
    shape = DRY if args.dry_run else FULL
    B, H, D, page, L = (shape[k] for k in ("batch", "heads", "head_dim", "page", "entries"))
    (q0, k8, ks, w, bt, ctx), kf = make_inputs(batch=B, s_q=1, heads=H, head_dim=D, page=page, L=L,
                                               actual=L, q_dtype=torch.float32, keys_fp32=True)
    keys = {FP8: k8, torch.bfloat16: kf.to(torch.bfloat16)}
    props = device_props(q0.device)
    out = torch.empty(B, 1, L, device=q0.device)
    rows, best = [], {}
    for path, (qd, kd) in PATHS.items():
        a = (q0.to(qd), keys[kd], ks, w, bt, ctx)
        ref = reference_logits(*a, L)
        dot = K.dot_path(qd, kd, props)
        key = (K.DOT_NAMES[dot], "fp8" if dot == K.DOT_BF16 and kd == FP8 else "*")
        default = K.logits_config(dot, kd, props, head_dim=D, heads=H)
        cands = FP32 if dot == K.DOT_FP32 else TENSOR_CORE
        cands = [default] + [c for c in cands if c != default]
        for cfg in cands[:2] if args.dry_run else cands:
            row = dict(path=path, key=list(key), default=cfg == default, **cfg.__dict__)
            try:
                K.check_config(cfg, dot)
                K.indexer_logits(*a, L, config=cfg, out=out)
                row["max_rel_err"] = rel_err(out, ref)
                row["ok"] = row["max_rel_err"] <= TOL[path]
                timer = bench.time_fn if args.dry_run else bench.time_graph
                row["us"] = timer(lambda: K.indexer_logits(*a, L, config=cfg, out=out))["ms"] * 1e3
            except Exception as e:  # noqa: BLE001  (a config that fails is reported, not fatal)
                row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:200]}")
            rows.append(row)
            print(f"{path:<6} {str(cfg):<90} " + (f"{row['us']:9.1f} us  err {row['max_rel_err']:.1e}"
                                                   if "us" in row else row.get("error", "")), flush=True)
            if row["ok"] and (key not in best or row["us"] < best[key][1]["us"]):
                best[key] = (cfg, row)
    cap = props.capability
    print(f"# fastest correct config per path on {props.name or 'this device'}: paste into "
          f"kernels/indexer.py's TUNED")
    print(f"    {cap}: {{")
    for key, (cfg, row) in best.items():
        print(f"        {key!r}: LogitsConfig{tuple(cfg.__dict__.values())!r},   # {row['us']:.1f} us")
    print("    },")
    folder = args.out or os.environ.get("OUT") or "."
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "tune_indexer.json")
    with open(path, "w") as f:
        json.dump(dict(device=props.name, capability=cap, versions=runtime.versions(), shape=shape,
                       tolerances=TOL, rows=rows), f, indent=1, default=str)
    print(f"wrote {path} ({len(rows)} configs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
