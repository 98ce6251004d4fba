"""Sweep sparse-MLA decode launch configurations on this GPU; print the winners.

    python3 tools/tune_sparse_mla.py --only csa,hca      # V4's layer shapes (under 5 minutes)
    python3 tools/tune_sparse_mla.py --only tiny,small   # the Triton kernel's size classes
    python3 tools/tune_sparse_mla.py                     # everything (the classes take longest)
    python3 tools/tune_sparse_mla.py --dry-run           # tiny shapes in Triton's interpreter

Every candidate is checked against the fp32 reference, then timed from a CUDA graph the way
``dsv4lab bench sparse_mla`` times it (rotated inputs where they fit, indices drawn as the model
draws them); one that does not compile or does not fit is skipped. Two sweeps:

* size classes (query rows B x S_q: tiny 1, small 8, mid 64, large 128 x 2) at a CSA layer's
  640 slots: every ``Config`` of lesson 2's Triton kernel, then the winner with the combine as a
  programmatic dependent launch and, at S_q = 1, the L2 evict-first gathers. Prints the entry to
  paste into ``TUNED`` in kernels/attention/dispatch.py, keyed by this GPU's capability.
* V4's layer shapes (``csa``: B 64 / S_q 1 and B 128 / S_q 2 at 640 slots; ``hca``: B 64 /
  S_q 1 at 1,152 and 8,320): the split-KV count of the kernel the dispatch runs there (the
  warp-specialised kernel where its route applies, splits 1..4, then the winner with and
  without the lazy rescale and, at S_q = 1, the evict-first gathers) and a few Triton
  configurations at their own split count, 1 and 2; beside the dispatch's own plan. Prints a
  ranking per shape and cache, and the winners.

``--kernels ws`` or ``--kernels triton`` keeps one kernel; ``--splits 1,2`` other split counts.
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dsv4lab  # noqa: E402,F401  (sets TRITON_INTERPRET without a GPU, before triton)
import torch  # noqa: E402

from dsv4lab import bench, runtime  # noqa: E402
from dsv4lab.benchmarks.sparse_mla import (LAYERS, WINDOW, Cache, decode_indices,  # noqa: E402
                                           layer_topk, traffic)
from dsv4lab.kernels.attention import dispatch, l2_hint, mma  # noqa: E402
from dsv4lab.kernels.device import pdl_ok, props  # noqa: E402
from dsv4lab.ops import sparse_mla_decode  # noqa: E402
from dsv4lab.quant.kv_fp8 import ROW_BYTES as FP8_ROW_BYTES  # noqa: E402

CLASSES = {"tiny": (1, 1), "small": (8, 1), "mid": (64, 1), "large": (128, 2)}
SHAPES = {"csa": (("csa", 64, 1), ("csa", 128, 2)),
          "hca": (("hca_128k", 64, 1), ("hca_1m", 64, 1))}
SPLITS = (1, 2, 3, 4)
C = mma.Config
# the Triton kernel's candidates at the layer shapes: the H200's 64-head tile (bf16) and the
# 16- and 32-head tiles that fit two programs an SM (FP8), beside what the dispatch picks
TRITON_AT_LAYERS = {"bf16": (C(32, 8, 2, 64), C(16, 8, 3, 64), C(32, 8, 2, 32)),
                    "fp8": (C(32, 4, 2, 16), C(16, 4, 3, 16), C(16, 8, 3, 32, pipe_gather=True),
                            C(32, 8, 2, 64, pipe_gather=True, split_qk=True))}


def candidates(dry: bool) -> list:
    """The size-class sweep: tiles, warps, stages, head blocks and the two loop options."""
    if dry:
        return [C(16, 4, 1, 16), C(16, 4, 2, 16, pipe_gather=True), C(32, 4, 1, 16, split_qk=True)]
    out = []
    for bn, w, st, bh in itertools.product((16, 32, 64), (4, 8), (2, 3), (16, 32, 64)):
        if bh == 64 and w == 4:      # a [64, 512] fp32 accumulator needs 8 warps
            continue
        out.append(C(bn, w, st, bh))
        if bh == 64:                 # the loop options (SPLIT_QK splits 8 warps' scores)
            out.append(C(bn, w, st, bh, pipe_gather=True))
            out.append(C(bn, w, st, bh, pipe_gather=True, split_qk=True))
    return out


class Point:
    """One shape on this GPU: a cache, rotated input sets, the fp32 reference, the roofline."""

    def __init__(self, B, S_q, entries, pick, window, heads, dim, dry, dev):
        self.B, self.S_q, self.heads, self.dim = B, S_q, heads, dim
        self.topk = window + (entries if pick is None else pick)
        self.cache = Cache(B, window + 3 + entries, heads=heads, dim=dim,
                           min_rows=0 if dry else 1 << 18, fp8=True, device=dev, seed=B)
        self.sets = self.cache.sets(S_q, lambda base, g: decode_indices(
            B, S_q, entries, pick, window=window, base=base, generator=g, device=dev),
            rotate=1 if dry else None)
        q0, i0 = self.sets[0]
        self.uniq = int(torch.unique(i0[i0 >= 0]).numel())
        self.ref = {}
        for kv_fmt in ("bf16", "fp8"):
            self.ref[kv_fmt] = sparse_mla_decode(q0, self.kv(kv_fmt), i0, attn_sink=self.cache.sink,
                                                 backend="torch")

    def kv(self, kv_fmt):
        return self.cache.kv_fp8 if kv_fmt == "fp8" else self.cache.kv

    def fraction(self, kv_fmt, us) -> float:
        need = traffic(self.B, self.S_q, self.topk, heads=self.heads, dim=self.dim, d_v=self.dim,
                       unique_rows=self.uniq,
                       kv_row_bytes=FP8_ROW_BYTES if kv_fmt == "fp8" else 2 * self.dim)
        return bench.with_roofline({"ms": us / 1e3}, bytes_moved=need["needed_bytes"],
                                   flops=need["flops"])["roofline_fraction"]

    def measure(self, kv_fmt, run) -> tuple[float | None, str]:
        """(us a call, "ok") of ``run(q, kv, indices)``; None and why when it is wrong or fails."""
        kv = self.kv(kv_fmt)
        ref, ref_lse = self.ref[kv_fmt]
        try:
            q0, i0 = self.sets[0]
            out, lse = run(q0, kv, i0)
            fin = torch.isfinite(ref_lse)
            if not (torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
                    and torch.equal(fin, torch.isfinite(lse))
                    and torch.allclose(lse[fin], ref_lse[fin], atol=1e-3, rtol=0)):
                return None, "WRONG"
            t = bench.time_graph(lambda: [run(q, kv, i) for q, i in self.sets],
                                 warmup_ms=5, rep_ms=20)
            return t["ms"] * 1e3 / len(self.sets), "ok"
        except Exception as e:          # does not compile or fit on this GPU
            return None, f"{type(e).__name__}: {str(e)[:80]}"


def sweep_classes(names, args, p, dev, geometry) -> dict:
    """The size-class sweep of the Triton kernel -> {(kv, class): (Config, us)}."""
    heads, dim, window, entries, pick = geometry
    table = {}
    for size in names:
        B, S_q = CLASSES[size]
        if args.dry_run:
            B = min(B, 2)
        pt = Point(B, S_q, entries, pick, window, heads, dim, args.dry_run, dev)
        for kv_fmt in ("bf16", "fp8"):
            def run_cfg(cfg):
                return lambda q, kv, i: mma.sparse_mla_mma(q, kv, i, pt.cache.sink, dim ** -0.5,
                                                           dim, cfg, fp8=kv_fmt == "fp8")
            ranked = []
            for cfg in candidates(args.dry_run):
                us, status = pt.measure(kv_fmt, run_cfg(cfg))
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
                    us, _ = pt.measure(kv_fmt, run_cfg(best._replace(**{knob: True})))
                    if us is not None and us < best_us:
                        best_us, best = us, best._replace(**{knob: True})
            print(f"{size:>5} {kv_fmt:>4} B{B} S_q{S_q}: best of {len(ranked)} {best_us:8.1f} us "
                  f"({pt.fraction(kv_fmt, best_us):.2f} of the roofline); then "
                  + ", ".join(f"{us:.1f}" for us, _ in ranked[1:4]))
            table[(kv_fmt, size)] = (best, best_us)
    return table


def _name(kind, splits, cfg=None, lazy=False, evict=False) -> str:
    what = "ws_sm90" if kind == "ws" else (
        f"triton N{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} h{cfg.block_h}"
        + "".join(f" {k}" for k in ("pipe_gather", "split_qk") if getattr(cfg, k)))
    return what + f" x{splits}" + " lazy" * lazy + " evict" * evict


def sweep_layers(names, args, p, dev, geometry) -> list[dict]:
    """The split-KV and kernel sweep at V4's layer shapes -> one winner a (shape, cache)."""
    heads, dim, window = geometry[:3]
    layers = dict(LAYERS) if not args.dry_run else {"csa": (24, 16), "hca_128k": (12, None),
                                                    "hca_1m": (40, None)}
    splits_to_try = tuple(int(s) for s in args.splits.split(",")) if args.splits else SPLITS
    kinds = set(args.kernels.split(",")) if args.kernels else {"ws", "triton"}
    winners = []
    for group in names:
        for layer, B, S_q in SHAPES[group]:
            if args.dry_run:
                B = min(B, 2)
            entries, pick = layers[layer]
            pt = Point(B, S_q, entries, pick, window, heads, dim, args.dry_run, dev)
            topk = layer_topk(layer, window, layers)
            for kv_fmt in ("bf16", "fp8"):
                fp8 = kv_fmt == "fp8"
                sink, scale = pt.cache.sink, dim ** -0.5
                plan = dispatch.plan(p, B=B, S_q=S_q, H=heads, D=dim, d_v=dim, topk=topk,
                                     q_dtype=torch.bfloat16, fp8=fp8, aligned=True)
                base_us, _ = pt.measure(kv_fmt, lambda q, kv, i: dispatch.sparse_mla_decode(
                    q, kv, i, sink, scale, dim, fp8=fp8))
                results = []          # (us, name, description)

                def ws(splits, lazy, evict):
                    from dsv4lab.kernels.attention import ws_sm90
                    n, rows = mma.split_rows(splits, topk)
                    return lambda q, kv, i: ws_sm90.sparse_mla_ws(q, kv, i, sink, scale, n, rows,
                                                                  lazy=lazy, evict_kv=evict)

                if "ws" in kinds and plan.kernel == "ws_sm90":
                    seen = set()
                    for s in splits_to_try:
                        n = mma.split_rows(s, topk)[0]
                        if n in seen:
                            continue
                        seen.add(n)
                        us, status = pt.measure(kv_fmt, ws(n, plan.lazy, plan.evict_kv))
                        if us is not None:
                            results.append((us, _name("ws", n, lazy=plan.lazy, evict=plan.evict_kv),
                                            ("ws", n, plan.lazy, plan.evict_kv)))
                        elif status == "WRONG":
                            print(f"  WRONG result: ws_sm90 x{n}")
                    if results:
                        _, _, (_, n, lazy, evict) = min(results, key=lambda r: r[0])
                        knobs = [(not lazy, evict)]
                        if S_q == 1 and l2_hint.active():
                            knobs.append((lazy, not evict))
                        for lz, ev in knobs:
                            us, _ = pt.measure(kv_fmt, ws(n, lz, ev))
                            if us is not None:
                                results.append((us, _name("ws", n, lazy=lz, evict=ev),
                                                ("ws", n, lz, ev)))
                if "triton" in kinds:
                    cfgs = [dispatch.triton_config(p, rows=B * S_q, heads=heads, dim=dim, d_v=dim,
                                                   q_dtype=torch.bfloat16, fp8=fp8)]
                    cfgs += [c for c in (TRITON_AT_LAYERS[kv_fmt] if not args.dry_run else ())
                             if c not in cfgs]
                    for cfg in cfgs:
                        own = mma.plan_splits(B * S_q * -(-heads // min(cfg.block_h, heads)), topk,
                                              p.sm_count)[0]
                        for n in sorted({own, 1, 2}):
                            us, status = pt.measure(kv_fmt, lambda q, kv, i, cfg=cfg, n=n:
                                                    mma.sparse_mla_mma(q, kv, i, sink, scale, dim,
                                                                       cfg, fp8=fp8, num_splits=n))
                            if us is not None:
                                results.append((us, _name("triton", n, cfg), ("triton", n, cfg)))
                            elif status == "WRONG":
                                print(f"  WRONG result: {_name('triton', n, cfg)}")
                head = (f"{layer} B{B} S_q{S_q} T{topk} {kv_fmt}: the dispatch ({plan.kernel} "
                        f"x{plan.splits}{' lazy' * plan.lazy}) "
                        + (f"{base_us:.1f} us ({pt.fraction(kv_fmt, base_us):.2f})" if base_us
                           else "did not run"))
                print(head)
                results.sort(key=lambda r: r[0])
                for us, name, _ in results[:6]:
                    print(f"    {name:<44} {us:8.1f} us  {pt.fraction(kv_fmt, us):.2f}")
                if results:
                    us, name, _ = results[0]
                    winners.append(dict(shape=f"{layer} B{B} S_q{S_q}", kv=kv_fmt, best=name,
                                        us=us, frac=pt.fraction(kv_fmt, us), dispatch_us=base_us))
            del pt
            if runtime.has_cuda():
                torch.cuda.empty_cache()
    return winners


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes in the interpreter")
    ap.add_argument("--only", default="", help="what to sweep: size classes (tiny, small, mid, "
                    "large, or classes) and layer shapes (csa, hca, or layers); default all")
    ap.add_argument("--kernels", default="", help="at the layer shapes: ws, triton (default both)")
    ap.add_argument("--splits", default="",
                    help="split-KV counts of the ws kernel (default 1,2,3,4)")
    args = ap.parse_args()
    if not runtime.has_cuda() and not args.dry_run:
        sys.exit("no CUDA GPU: use --dry-run (tiny shapes in Triton's interpreter)")
    only = [s for s in args.only.split(",") if s]
    known = set(CLASSES) | set(SHAPES) | {"classes", "layers"}
    if set(only) - known:
        sys.exit(f"--only takes {', '.join(sorted(known))}; "
                 f"got {', '.join(sorted(set(only) - known))}")
    if args.kernels and set(args.kernels.split(",")) - {"ws", "triton"}:
        sys.exit(f"--kernels takes ws and/or triton, got {args.kernels}")
    classes = [c for c in CLASSES if not only or c in only or "classes" in only]
    shapes = [s for s in SHAPES if not only or s in only or "layers" in only]
    dev = runtime.device()
    p = props(dev)
    geometry = (16, 512, 8, 24, 16) if args.dry_run else (64, 512, WINDOW) + LAYERS["csa"]
    print(f"tune_sparse_mla on {p.name or p.capability} ({p.sm_count} SMs, "
          f"{p.smem_per_block // 1024} KB a block), {runtime.versions()['triton']}")
    t0 = time.time()
    if classes:
        table = sweep_classes(classes, args, p, dev, geometry)
        print(f"\n# TUNED entry for kernels/attention/dispatch.py (this GPU: {p.name}):")
        print(f"    {p.capability}: {{")
        for key, (cfg, us) in sorted(table.items()):
            knobs = "".join(f", {k}=True" for k in ("pipe_gather", "split_qk", "pdl", "evict_kv")
                            if getattr(cfg, k))
            print(f"        {key!r}: Config({cfg.block_n}, {cfg.num_warps}, {cfg.num_stages}, "
                  f"{cfg.block_h}{knobs}),    # {us:.1f} us")
        print("    },")
    if shapes:
        winners = sweep_layers(shapes, args, p, dev, geometry)
        print("\n# winners at V4's layer shapes (us a call, fraction of the roofline, the "
              "dispatch's plan)")
        for w in winners:
            base = f"{w['dispatch_us']:.1f}" if w["dispatch_us"] else "-"
            print(f"  {w['shape']:<22} {w['kv']:>4}: {w['best']:<44} {w['us']:8.1f} us "
                  f"{w['frac']:.2f}  (dispatch {base})")
    print(f"({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
