"""A/B of on/off knobs of the H200 table's sparse-MLA entries (GPU only).

    python3 scripts/ab_sparse_mla.py                       # part16 x pdl, the split-KV shapes
    python3 scripts/ab_sparse_mla.py --knobs lazy --shapes 64,1,2048 128,2,2048

For each shape (B,S_q,topk; bf16 and FP8 caches) it times the device table's configuration
(kernels/sparse_mla_mma.py DEVICE_TABLE) with every on/off combination of the knobs (fields
of its ``Config``), exactly as ``dsv4lab bench sparse_mla`` times a call (rotated inputs
from a cache far larger than L2, a CUDA graph). Prints one line a shape; records nothing: the
table's choice is then checked by the benchmark's recorded rows.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dsv4lab  # noqa: E402,F401  (configures the runtime before triton is imported)
import torch  # noqa: E402

SHAPES = ((1, 4, 2048), (1, 4, 640), (1, 1, 640), (8, 1, 2048), (8, 4, 2048), (64, 1, 2048))


def main() -> None:
    from dsv4lab import runtime
    from dsv4lab.benchmarks import sparse_mla as sb
    from dsv4lab.kernels import sparse_mla_mma as mma
    from dsv4lab.ops.attention import sparse_mla_decode_with_config
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--knobs", default="part16,pdl", help="Config fields to flip, comma-separated")
    ap.add_argument("--shapes", nargs="*", default=[",".join(map(str, s)) for s in SHAPES],
                    help="B,S_q,topk each")
    ap.add_argument("--formats", default="bf16,fp8")
    args = ap.parse_args()
    knobs = args.knobs.split(",")
    if unknown := [k for k in knobs if k not in mma.Config._fields]:
        sys.exit(f"--knobs: not Config fields: {unknown}")
    if not runtime.has_cuda():
        sys.exit("ab_sparse_mla needs a CUDA GPU")
    dev = runtime.device()
    name = torch.cuda.get_device_name(dev)
    if name not in mma.DEVICE_TABLE:
        sys.exit(f"no DEVICE_TABLE entry for {name!r}")
    for B, S, T in (tuple(int(v) for v in shape.split(",")) for shape in args.shapes):
        c = sb._Cases(B, heads=64, dim=512, context=max(sb.CONTEXT, T),
                      min_rows=sb.MIN_CACHE_ROWS, device=dev, fp8=True)
        sets = c.inputs(S, T, c.rotate)
        for fmt in args.formats.split(","):
            kv = c.kv_fp8 if fmt == "fp8" else c.kv
            base = mma.DEVICE_TABLE[name][mma.workload_class(B * S, fmt == "fp8")]
            line = []
            for flags in itertools.product((False, True), repeat=len(knobs)):
                cfg = base._replace(**dict(zip(knobs, flags)))

                def fn(q, idx, cfg=cfg, kv=kv):
                    return sparse_mla_decode_with_config(q, kv, idx, config=cfg, d_v=512,
                                                         attn_sink=c.sink, check_indices=False)
                fn(*sets[0])                    # compile and warm up outside the graph
                t = sb._time(fn, sets, 10, 40)
                label = " ".join(f"{k}={int(f)}" for k, f in zip(knobs, flags))
                line.append(f"{label}: {t['ms'] / len(sets) * 1e3:6.1f}")
            print(f"B{B} S{S} T{T} {fmt:4s}", " | ".join(line), flush=True)


if __name__ == "__main__":
    main()
