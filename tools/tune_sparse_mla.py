"""Sweep the portable sparse-MLA kernel's launch configurations on this GPU; print a TUNED entry.

    python3 tools/tune_sparse_mla.py              # on a GPU (about 15 minutes; --only tiny,small)
    python3 tools/tune_sparse_mla.py --dry-run    # tiny shapes in Triton's interpreter, any machine

For each size class of kernels/attention/dispatch.py (query rows B x S_q: tiny, small, mid,
large) and each cache (bf16, FP8), at DeepSeek-V4's CSA-layer shape (64 heads, D = 512, 640
slots drawn as the model draws them), every candidate ``Config`` of lesson 2's Triton kernel is
checked against the fp32 reference, then timed from a CUDA graph the way ``dsv4lab bench
sparse_mla`` times it. A candidate that does not compile or does not fit is skipped. The
winner is then tried with the combine as a programmatic dependent launch (sm_90+) and, at
S_q = 1, with the L2 evict-first gathers (where ``l2_hint.active()``).

Prints a ranking per class and the entry to paste into ``TUNED`` in
kernels/attention/dispatch.py, keyed by this GPU's capability (where a fast path's route
applies, the entry is what runs when it does not).
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dsv4lab  # noqa: E402,F401  (sets TRITON_INTERPRET without a GPU, before triton)
import torch  # noqa: E402

from dsv4lab import bench, runtime  # noqa: E402
from dsv4lab.benchmarks.sparse_mla import LAYERS, WINDOW, Cache, decode_indices, traffic  # noqa: E402,E501
from dsv4lab.kernels.attention import l2_hint, mma  # noqa: E402
from dsv4lab.kernels.device import pdl_ok, props  # noqa: E402
from dsv4lab.ops import sparse_mla_decode  # noqa: E402
from dsv4lab.quant.kv_fp8 import ROW_BYTES as FP8_ROW_BYTES  # noqa: E402

SHAPES = {"tiny": (1, 1), "small": (8, 1), "mid": (64, 1), "large": (128, 2)}


def candidates(dry: bool) -> list:
    """Tiles, warps, stages, head blocks and the two loop options."""
    if dry:
        return [mma.Config(16, 4, 1, 16), mma.Config(16, 4, 2, 16, pipe_gather=True),
                mma.Config(32, 4, 1, 16, split_qk=True)]
    out = []
    for bn, w, st, bh in itertools.product((16, 32, 64), (4, 8), (2, 3), (16, 32, 64)):
        if bh == 64 and w == 4:      # a [64, 512] fp32 accumulator needs 8 warps
            continue
        out.append(mma.Config(bn, w, st, bh))
        if bh == 64:                 # the loop options (SPLIT_QK splits 8 warps' scores)
            out.append(mma.Config(bn, w, st, bh, pipe_gather=True))
            out.append(mma.Config(bn, w, st, bh, pipe_gather=True, split_qk=True))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes in the interpreter")
    ap.add_argument("--only", default="", help="size classes to sweep, e.g. tiny,small")
    args = ap.parse_args()
    if not runtime.has_cuda() and not args.dry_run:
        sys.exit("no CUDA GPU: use --dry-run (tiny shapes in Triton's interpreter)")
    dev = runtime.device()
    p = props(dev)
    heads, dim = (16, 512) if args.dry_run else (64, 512)
    entries, pick = (24, 16) if args.dry_run else LAYERS["csa"]
    window = 8 if args.dry_run else WINDOW
    topk = window + pick
    print(f"tune_sparse_mla on {p.name or p.capability} ({p.sm_count} SMs, "
          f"{p.smem_per_block // 1024} KB a block), {runtime.versions()['triton']}")
    table = {}
    for size, (B, S_q) in SHAPES.items():
        if args.only and size not in args.only.split(","):
            continue
        if args.dry_run:
            B = min(B, 2)
        cache = Cache(B, window + 3 + entries, heads=heads, dim=dim,
                       min_rows=0 if args.dry_run else 1 << 18, fp8=True, device=dev, seed=B)
        sets = cache.sets(S_q, lambda base, g: decode_indices(
            B, S_q, entries, pick, window=window, base=base, generator=g, device=dev),
            rotate=1 if args.dry_run else None)
        for kv_fmt in ("bf16", "fp8"):
            kv = cache.kv_fp8 if kv_fmt == "fp8" else cache.kv
            q0, i0 = sets[0]
            ref, ref_lse = sparse_mla_decode(q0, kv, i0, attn_sink=cache.sink, backend="torch")
            uniq = int(torch.unique(i0[i0 >= 0]).numel())
            need = traffic(B, S_q, topk, heads=heads, dim=dim, d_v=dim, unique_rows=uniq,
                           kv_row_bytes=FP8_ROW_BYTES if kv_fmt == "fp8" else 2 * dim)

            def run(cfg, q, i):
                return mma.sparse_mla_mma(q, kv, i, cache.sink, dim ** -0.5, dim, cfg,
                                          fp8=kv_fmt == "fp8")

            def measure(cfg):
                try:
                    out, lse = run(cfg, q0, i0)
                    fin = torch.isfinite(ref_lse)
                    if not (torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
                            and torch.equal(fin, torch.isfinite(lse))
                            and torch.allclose(lse[fin], ref_lse[fin], atol=1e-3, rtol=0)):
                        return None, "WRONG"
                    t = bench.time_graph(lambda: [run(cfg, q, i) for q, i in sets],
                                         warmup_ms=5, rep_ms=20)
                    return t["ms"] * 1e3 / len(sets), "ok"
                except Exception as e:          # does not compile or fit on this GPU
                    return None, f"{type(e).__name__}: {str(e)[:80]}"

            ranked = []
            for cfg in candidates(args.dry_run):
                us, status = measure(cfg)
                if us is not None:
                    ranked.append((us, cfg))
                elif status == "WRONG":
                    print(f"  WRONG result: {cfg}")
            if not ranked:
                print(f"{size} {kv_fmt}: no candidate ran")
                continue
            ranked.sort(key=lambda x: x[0])
            best_us, best = ranked[0]
            for knob, ok in (("pdl", pdl_ok(dev)), ("evict_kv", S_q == 1 and l2_hint.active())):
                if ok:
                    us, _ = measure(best._replace(**{knob: True}))
                    if us is not None and us < best_us:
                        best_us, best = us, best._replace(**{knob: True})
            roof = bench.with_roofline({"ms": best_us / 1e3}, bytes_moved=need["needed_bytes"],
                                       flops=need["flops"])
            print(f"{size:>5} {kv_fmt:>4} B{B} S_q{S_q}: best of {len(ranked)} "
                  f"{best_us:8.1f} us ({roof['roofline_fraction']:.2f} of the roofline); "
                  "then " + ", ".join(f"{us:.1f}" for us, _ in ranked[1:4]))
            table[(kv_fmt, size)] = (best, best_us)
    print(f"\n# TUNED entry for kernels/attention/dispatch.py (this GPU: {p.name}):")
    print(f"    {p.capability}: {{")
    for key, (cfg, us) in sorted(table.items()):
        knobs = "".join(f", {k}=True" for k in ("pipe_gather", "split_qk", "pdl", "evict_kv")
                        if getattr(cfg, k))
        print(f"        {key!r}: Config({cfg.block_n}, {cfg.num_warps}, {cfg.num_stages}, "
              f"{cfg.block_h}{knobs}),    # {us:.1f} us")
    print("    },")
    return 0


if __name__ == "__main__":
    sys.exit(main())
