"""``dsv4lab bench moe_scaled``: the MXFP4 MoE on ``tl.dot_scaled`` at the Flash shape.

kernels/moe_scaled.py with its default tile table (``triton_scaled``, every T) and a few
tile variants (``triton_scaled_<name>``, at T = 1 and 64), at DeepSeek-V4-Flash's MoE shape (256 experts, top-6,
hidden 4096, intermediate 2048) and T in {1, 8, 64, 256} tokens routed by
:func:`dsv4lab.ops.route` on random logits. CUDA-graph timed (the kernel never syncs with
the host). The roofline is the one of ``dsv4lab bench moe``: the MXFP4 bytes (packed
weights + scales) of the experts the drawn routing hits, 2 FLOPs a weight a routed token.
Each default row also records ``rel_err``: max |out - torch reference| / max |reference|.

Weights are random bytes with realistic scales (what is measured is data movement and the
upcast, which do not depend on the values). Explained in notebooks/04_mxfp4_moe_port.ipynb.
"""
from __future__ import annotations

import torch

from dsv4lab import bench, runtime
from dsv4lab.benchmarks.moe import _random_experts, fp4_bytes
from dsv4lab.kernels.moe_scaled import fused_moe_scaled
from dsv4lab.ops import fused_moe, route

FLASH = dict(E=256, H=4096, I=2048, topk=6)
TOKENS = (1, 8, 64, 256)
SWIGLU_LIMIT = 10.0

# Tile variants timed beside the default table (kernels/moe_scaled.py CONFIGS): no split-K
# of gate/up (s1), fixed 4 slices (s1x4), no K permutation (nopermk: bytes loaded as
# stored), more and smaller programs (bn32: mma.sync on sm_90, M = 32), bigger K steps with
# 8 warps (bk256w8), 4 or 1 down-projection slices (split4, s2x1), a shallower pipeline (st3).
VARIANTS = [
    ("s1", dict(SPLIT1=1)),
    ("s1x4", dict(SPLIT1=4)),
    ("nopermk", dict(PERMK=False)),
    ("bn32", dict(BN1=32, BN2=32)),
    ("bk256w8", dict(BK1=256, BK2=256, num_warps=8, num_stages=4)),
    ("split4", dict(SPLIT2=4)),
    ("s2x1", dict(SPLIT2=1)),
    ("st3", dict(num_stages=3)),
]
VARIANT_TOKENS = (1, 64)             # the targets' token counts (keeps the bench short)
SMOKE = dict(E=8, H=64, I=64, topk=2)


def _row(T, impl, hit, n_pairs, shape, timing, cfg=None):
    E, H, I, k = shape["E"], shape["H"], shape["I"], shape["topk"]
    row = dict(T=T, impl=impl, fmt="mxfp4", E=E, hidden=H, intermediate=I, topk=k,
               experts_hit=hit, roofline_basis="mxfp4 bytes of the experts hit", **timing)
    if cfg:
        row["kernel_config"] = cfg
    return bench.with_roofline(row, bytes_moved=fp4_bytes(hit, H, I, "mxfp4"),
                               flops=2.0 * n_pairs * 3 * H * I)


def print_table(rows: list[dict]) -> None:
    print(f"{'T':>4} {'impl':<22} {'hit':>4} {'us':>10} {'roof us':>9} {'frac':>7} {'rel_err':>9}  timing")
    for r in rows:
        err = f"{r['rel_err']:.2e}" if "rel_err" in r else "-"
        print(f"{r['T']:>4} {r['impl']:<22} {r['experts_hit']:>4} {r['ms'] * 1e3:>10.1f} "
              f"{r['roofline_ms'] * 1e3:>9.2f} {r.get('roofline_fraction', 0):>7.4f} {err:>9}  {r['timing']}")


@bench.benchmark("moe_scaled", "MXFP4 MoE on tl.dot_scaled at the Flash shape, tile variants")
def bench_moe_scaled(smoke: bool) -> list[dict]:
    dev = runtime.device()
    gen = torch.Generator(device=dev).manual_seed(0)
    shape, tokens = (SMOKE, (1, 3)) if smoke else (FLASH, TOKENS)
    E, H, I, k = shape["E"], shape["H"], shape["I"], shape["topk"]
    ex = _random_experts(E, H, I, "mxfp4", dev, gen)
    args = (ex["w13"], ex["w13_scale"], ex["w2"], ex["w2_scale"])
    variants = [] if smoke else VARIANTS
    rows = []
    for T in tokens:
        ids, w = route(torch.randn(T, E, device=dev, generator=gen),
                       torch.randn(E, device=dev, generator=gen) * 0.1, topk=k)
        hit = int(torch.unique(ids).numel())
        x = torch.randn(T, H, device=dev, generator=gen).to(torch.bfloat16)
        ref = fused_moe(x, *args, ids, w, fmt="mxfp4", swiglu_limit=SWIGLU_LIMIT,
                        backend="torch").float()
        mag = ref.abs().max().item()
        for name, cfg in [("", None)] + (variants if T in VARIANT_TOKENS else []):
            def run(cfg=cfg):
                return fused_moe_scaled(x, *args, ids, w, swiglu_limit=SWIGLU_LIMIT, config=cfg)
            err = (run().float() - ref).abs().max().item() / max(mag, 1e-30)
            row = _row(T, "triton_scaled" + (f"_{name}" if name else ""), hit, ids.numel(), shape,
                       bench.time_graph(run, warmup_ms=10, rep_ms=40), cfg)
            row["rel_err"] = err
            rows.append(row)
    print_table(rows)
    return rows
