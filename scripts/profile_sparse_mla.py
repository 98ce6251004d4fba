"""Where the MMA sparse-MLA decode kernel's time goes, at the target shapes (GPU only).

    python3 scripts/profile_sparse_mla.py [--quick | --timeline]

For each shape it times (CUDA graphs, like ``dsv4lab bench sparse_mla``):

* ``kernel``: the default launch (the device table's configuration) on random rows of a
  cache far larger than L2: what the benchmark measures;
* ``kernel_l2``: the same launch with every index folded into the first 4096 rows
  (4 MB bf16: the gathers hit L2), so the time is the loop's compute and latency chain;
* ``kernel_empty``: every index -1 (each program trims its list to nothing): launch, Q
  load, epilogue and split-KV combine, the per-call overhead;
* ``gather_only``: a bare gather of the same rows with the same tiles and pipelining
  (each program sums its rows), the memory side alone;
* ``index_select``: ``torch.index_select`` of the same rows (reads and writes them);
* ``kernel_splitsN``: the default configuration with N split-KV ranges;
* ``ws_*`` (bf16): the warp-specialised kernel's variants, on the same three index sets.

``--timeline`` records instead, for the default (warp-specialised seesaw) launch at
B 64 / S_q 1, B 128 / S_q 1 and B 128 / S_q 2 (bf16, topk 2048, L2 flushed before each of
five calls), when each program passes the points of ``sparse_mla_ws.TIMELINE_POINTS``
(%globaltimer, read in the kernel built with DSV4LAB_WS_TIMELINE=1): rows ``timeline:
<point>`` with the median, min and max over programs and calls, in us from the call's
first program start, and the program's tile count.

Prints a table and records its rows (with their provenance) to
``sparse_mla_profile.jsonl`` in the results directory ($DSV4LAB_RESULTS_DIR on the device,
data/results/ otherwise).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if "--timeline" in sys.argv:      # before the kernel module is imported: it reads this once
    os.environ["DSV4LAB_WS_TIMELINE"] = "1"

import dsv4lab  # noqa: E402,F401
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

H, D = 64, 512
L2_ROWS = 4096
# the warp-specialised kernel's variants (kernels/sparse_mla_ws.py)
WS_VARIANTS = ("ws_n32_b3", "ws_n32_b3_lazy", "ws_ss_n32_b3", "ws_ss_n32_b4")


@triton.jit
def _gather_sum_kernel(kv_ptr, idx_ptr, out_ptr, topk, split_rows, num_splits,
                       D: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (query, split): gather its rows tile by tile and sum them (fp32)."""
    pid = tl.program_id(0)
    sp = pid % num_splits
    bs = (pid // num_splits).to(tl.int64)
    start = sp * split_rows
    end = tl.minimum(start + split_rows, topk)
    offs_d = tl.arange(0, D)
    acc = tl.zeros([BLOCK_N, D], tl.float32)
    offs = start + tl.arange(0, BLOCK_N)
    idx_n = tl.load(idx_ptr + bs * topk + offs, mask=offs < end, other=-1)
    for n0 in range(start, end, BLOCK_N):
        idx = idx_n
        offs = n0 + BLOCK_N + tl.arange(0, BLOCK_N)
        idx_n = tl.load(idx_ptr + bs * topk + offs, mask=offs < end, other=-1)
        rows = tl.where(idx >= 0, idx, 0).to(tl.int64)
        k = tl.load(kv_ptr + rows[:, None] * D + offs_d[None, :], mask=(idx >= 0)[:, None],
                    other=0.0)
        acc += k.to(tl.float32)
    tl.store(out_ptr + pid.to(tl.int64) * D + offs_d, tl.sum(acc, axis=0))


def gather_only(kv, idx, splits, rows, block_n, warps, stages):
    """``splits`` ranges of ``rows`` slots, as kernels/sparse_mla_mma.py plans them."""
    B, S, T = idx.shape
    out = torch.empty(B * S * splits, D, device=kv.device, dtype=torch.float32)
    _gather_sum_kernel[(B * S * splits,)](kv, idx, out, T, rows, splits, D=D, BLOCK_N=block_n,
                                          num_warps=warps, num_stages=stages)
    return out


def timeline_rows(kv, sink, n_rows, dev, g, record, reps=5):
    """The --timeline rows (see the module docstring)."""
    from dsv4lab.kernels import sparse_mla_mma as mma
    from dsv4lab.kernels import sparse_mla_ws as ws
    from dsv4lab.kernels.device import sm_count
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device=dev)
    for B, S, T in ((64, 1, 2048), (128, 1, 2048), (128, 2, 2048)):
        shape = f"B{B} S{S} T{T} bf16"
        q = torch.randn(B, S, H, D, device=dev, generator=g).to(torch.bfloat16)
        idx = torch.randint(0, n_rows, (B, S, T), device=dev, generator=g, dtype=torch.int32)
        splits, rows = mma.plan_splits(B * S, T, sm_count(dev, cpu=8))
        mma.sparse_mla_mma(q, kv, idx, sink, D ** -0.5, D)          # compile
        stamps = []
        for _ in range(reps):
            flush.zero_()
            torch.cuda.synchronize()
            mma.sparse_mla_mma(q, kv, idx, sink, D ** -0.5, D)
            torch.cuda.synchronize()
            stamps.append(ws.timeline().clone())
        st = torch.stack(stamps).double()                                # [reps, programs, points]
        start = st[:, :, 0].min(dim=1).values[:, None, None]
        rel = torch.where(st > 0, (st - start) / 1e3, float("nan"))
        for k, point in enumerate(ws.TIMELINE_POINTS):
            v = rel[:, :, k].flatten()
            v = v[~v.isnan()]
            if v.numel():
                record(shape, f"timeline: {point}", v.median().item(),
                       extra={"us_min": round(v.min().item(), 2), "us_max": round(v.max().item(), 2),
                              "programs": st.shape[1], "tiles_per_program": -(-rows // 32)})


def main():
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="only the kernel rows (no split sweep, bare gathers or index_select)")
    ap.add_argument("--timeline", action="store_true",
                    help="only the warp-specialised kernel's per-program timeline rows")
    args = ap.parse_args()
    from dsv4lab import bench, runtime
    from dsv4lab.benchmarks.sparse_mla import traffic
    from dsv4lab.kernels import sparse_mla_mma as mma
    from dsv4lab.kernels.device import sm_count
    from dsv4lab.quant import pack_kv_fp8
    from dsv4lab import roofline

    if not runtime.has_cuda():
        sys.exit("profile_sparse_mla needs a CUDA GPU")
    dev = runtime.device()
    spec = roofline.device_spec()
    print(f"profile_sparse_mla on {torch.cuda.get_device_name()}, {runtime.versions()}", flush=True)
    results = []
    g = torch.Generator(device=dev).manual_seed(0)
    n_rows = 64 * 1024 * 1024 // 1024 * 8          # 512 MB bf16 cache: far beyond L2
    kv = torch.randn(n_rows, D, device=dev, generator=g).to(torch.bfloat16)
    kv8 = pack_kv_fp8(kv)
    sink = torch.randn(H, device=dev, generator=g)

    def t(fn):
        return bench.time_graph(fn, warmup_ms=10, rep_ms=30)["ms"] * 1e3

    def record(shape, what, us, nbytes=None, extra=None):
        row = {"shape": shape, "what": what, "us": round(us, 2), **(extra or {})}
        if nbytes:
            row["GB_per_s"] = round(nbytes / us / 1e3, 1)
            row["frac_of_roof_bw"] = round(nbytes / (us * 1e-6) / spec.bandwidth, 3)
        results.append(row)
        print(f"{shape:>22} {what:>28} {us:9.1f} us" + (f"  {row['GB_per_s']:8.1f} GB/s {row['frac_of_roof_bw']:.2f}" if nbytes else ""),
              flush=True)

    if args.timeline:
        timeline_rows(kv, sink, n_rows, dev, g, record)
        from dsv4lab import results as recorded
        print(f"recorded {len(results)} rows to {recorded.record('sparse_mla_profile', results)}")
        return
    for B, S, T, fp8 in ((64, 1, 2048, False), (128, 1, 2048, False), (128, 2, 2048, False),
                         (128, 2, 2048, True), (64, 1, 2048, True)):
        shape = f"B{B} S{S} T{T} {'fp8' if fp8 else 'bf16'}"
        q = torch.randn(B, S, H, D, device=dev, generator=g).to(torch.bfloat16)
        pick = torch.randint(0, n_rows, (B, S, T), device=dev, generator=g, dtype=torch.int64)
        idx = pick.to(torch.int32).contiguous()
        idx_l2 = (pick % L2_ROWS).to(torch.int32).contiguous()
        idx_empty = torch.full_like(idx, -1)
        cache = kv8 if fp8 else kv
        row_bytes = mma.FP8_ROW_BYTES if fp8 else D * 2
        uniq = B * S * T
        need = traffic(B, S, T, kv_row_bytes=row_bytes, unique_rows=uniq)["needed_bytes"]

        def call(ix, splits=None, config=None):
            return mma.sparse_mla_mma(q, cache, ix, sink, D ** -0.5, D, fp8=fp8, num_splits=splits,
                                      config=config)

        for what, ix in (("kernel", idx), ("kernel_l2", idx_l2), ("kernel_empty", idx_empty)):
            call(ix)
            record(shape, what, t(lambda ix=ix: call(ix)), need if what == "kernel" else None)
        base_out = call(idx)[0].float()
        for name in () if fp8 else WS_VARIANTS:
            cfg = mma.VARIANTS[name]
            diff = (call(idx, config=cfg)[0].float() - base_out).abs().max().item()
            print(f"{shape:>22} {name:>28} max |out - default kernel's out| = {diff:.2e}")
            for what, ix in (("", idx), ("_l2", idx_l2), ("_empty", idx_empty)):
                call(ix, config=cfg)
                record(shape, name + what, t(lambda ix=ix: call(ix, config=cfg)),
                       need if not what else None)
        if args.quick:
            continue
        for sp in (1, 2, 4):
            call(idx, sp)
            record(shape, f"kernel_splits{sp}", t(lambda sp=sp: call(idx, sp)))
        if not fp8:
            n_prog = B * S
            splits, rows = mma.plan_splits(n_prog, T, sm_count(dev, cpu=8))
            for bn, w, st in ((64, 8, 3), (32, 8, 4), (64, 4, 2), (32, 4, 3)):
                try:
                    gather_only(kv, idx, splits, rows, bn, w, st)
                    us = t(lambda bn=bn, w=w, st=st: gather_only(kv, idx, splits, rows, bn, w, st))
                    record(shape, f"gather_only N{bn} w{w} s{st} sp{splits}", us, uniq * row_bytes)
                except Exception as e:   # e.g. out of shared memory
                    print(f"gather_only N{bn} w{w} s{st}: {type(e).__name__}: {str(e)[:120]}")
            flat = idx.flatten()
            record(shape, "index_select (r+w)",
                   t(lambda: torch.index_select(kv, 0, flat)), 2 * uniq * row_bytes)
    from dsv4lab import results as recorded
    print(f"recorded {len(results)} rows to {recorded.record('sparse_mla_profile', results)}")


if __name__ == "__main__":
    main()
