"""A/B of the split-KV epilogue knobs of the H200 table's sparse-MLA entries (GPU only).

    python3 scripts/ab_sparse_mla.py

For each shape (bf16 and FP8 caches, topk 640 / 2048, split-KV shapes) it times the device
table's configuration (kernels/sparse_mla_mma.py DEVICE_TABLE) with ``part16`` and ``pdl``
off and on, four ways, exactly as ``dsv4lab bench sparse_mla`` times a call (rotated inputs
from a cache far larger than L2, a CUDA graph). Prints one line a shape; records nothing: the
table's choice is then checked by the benchmark's recorded rows.
"""
from __future__ import annotations

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
    if not runtime.has_cuda():
        sys.exit("ab_sparse_mla needs a CUDA GPU")
    dev = runtime.device()
    name = torch.cuda.get_device_name(dev)
    if name not in mma.DEVICE_TABLE:
        sys.exit(f"no DEVICE_TABLE entry for {name!r}")
    for B, S, T in SHAPES:
        c = sb._Cases(B, heads=64, dim=512, context=max(sb.CONTEXT, T),
                      min_rows=sb.MIN_CACHE_ROWS, device=dev, fp8=True)
        sets = c.inputs(S, T, c.rotate)
        for fp8 in (False, True):
            kv = c.kv_fp8 if fp8 else c.kv
            base = mma.DEVICE_TABLE[name][mma.workload_class(B * S, fp8)]
            line = []
            for p16, pdl in ((False, False), (True, False), (False, True), (True, True)):
                cfg = base._replace(part16=p16, pdl=pdl)

                def fn(q, idx, cfg=cfg, kv=kv):
                    return sparse_mla_decode_with_config(q, kv, idx, config=cfg, d_v=512,
                                                         attn_sink=c.sink, check_indices=False)
                fn(*sets[0])                    # compile and warm up outside the graph
                t = sb._time(fn, sets, 10, 40)
                line.append(f"p16={int(p16)} pdl={int(pdl)}: {t['ms'] / len(sets) * 1e3:6.1f}")
            print(f"B{B} S{S} T{T} {'fp8 ' if fp8 else 'bf16'}", " | ".join(line), flush=True)


if __name__ == "__main__":
    main()
