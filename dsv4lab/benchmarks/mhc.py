"""``dsv4lab bench mhc``: one hyper-connection (pre + post), torch reference vs fused Triton.

Full mode (GPU): the Flash shape (n = 4 streams, d = 4096, 20 Sinkhorn iterations, bf16
streams, fp32 mixing weights) at T = 1, 64, 128 tokens. Each timed call runs ``R``
distinct hyper-connections back to back (their own ``fn`` weights and streams, as
consecutive layers do; ``R`` is chosen so the working set exceeds the 60 MB L2, at most
the model's 86); ``ms`` is per hyper-connection. Two rows a case (field ``mode``): the
eager call, host included (:func:`dsv4lab.bench.time_fn`), and its replay from one CUDA
graph (:func:`dsv4lab.bench.time_graph`). The roofline counts the bytes one pre + post
must move: the streams read (pre) and read + written (post), ``fn`` (fp32), y written,
the sub-block output read; the flops are the ``xf @ fn.T`` GEMM's.

Smoke mode (CPU): n = 4, d = 64, T = 1 and 3, 3 iterations, R = 1, in the interpreter.
Explained in notebooks/06_decode_step_at_scale.ipynb.
"""
from __future__ import annotations

import torch

from dsv4lab import ops, runtime
from dsv4lab.bench import benchmark, time_fn, time_graph, with_roofline

L2_BYTES = 60e6
MAX_ROTATE = 86          # 43 layers x 2 hyper-connections


def _case(T, n, d, R, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    M = (2 + n) * n
    sets = []
    for _ in range(R):
        fn = (torch.randn(M, n * d, generator=g) * (1.0 / (n * d) ** 0.5)).to(device)
        base = torch.randn(M, generator=g).to(device)
        scale = (torch.rand(3, generator=g) + 0.5).to(device)
        x = torch.randn(T, 1, n, d, generator=g).to(dtype).to(device)
        out = torch.randn(T, 1, d, generator=g).to(dtype).to(device)
        sets.append((fn, base, scale, x, out))
    return sets


def _bytes_flops(T, n, d, xbytes):
    M = (2 + n) * n
    streams = T * n * d * xbytes
    b = (streams                       # pre: read the streams
         + M * n * d * 4               # pre: fn (fp32)
         + T * d * xbytes              # pre: write y
         + T * (M + n + n * n) * 4     # mixes, post, comb (tiny)
         + T * d * xbytes              # post: read the sub-block output
         + 2 * streams)                # post: read the streams, write the new ones
    flops = 2 * T * M * n * d + T * (4 * n * d + 2 * n * n * d)
    return b, flops


@benchmark("mhc", "one mHC hyper-connection (pre + post): torch reference vs fused Triton")
def bench_mhc(smoke: bool) -> list[dict]:
    live = runtime.has_cuda() and not smoke
    if live:
        n, d, iters, Ts, dtype = 4, 4096, 20, (1, 64, 128), torch.bfloat16
    else:
        n, d, iters, Ts, dtype = 4, 64, 3, (1, 3), torch.float32
    dev = runtime.device()
    xbytes = torch.tensor([], dtype=dtype).element_size()
    rows = []
    for T in Ts:
        b, flops = _bytes_flops(T, n, d, xbytes)
        R = min(MAX_ROTATE, max(1, int(2 * L2_BYTES // b) + 1)) if live else 1
        sets = _case(T, n, d, R, dtype, dev, seed=T)
        for backend in ("torch", "triton"):
            def call(backend=backend):
                res = None
                for fn, base, scale, x, out in sets:
                    y, post, comb = ops.mhc_pre(x, fn, base, scale, iters=iters, backend=backend)
                    res = ops.mhc_post(out, x, post, comb, backend=backend)
                return res

            for mode, timer in (("eager", time_fn), ("graph", time_graph)):
                with torch.no_grad():
                    t = timer(call)
                row = {"op": "mhc_pre+post", "backend": backend, "mode": mode, "T": T, "n": n,
                       "d": d, "iters": iters, "dtype": str(dtype).replace("torch.", ""),
                       "rotate": R, "ms": t["ms"] / R, "timing": t["timing"]}
                rows.append(with_roofline(row, bytes_moved=b, flops=flops, dtype="bf16"))
    by = {(r["T"], r["backend"], r["mode"]): r for r in rows}
    print(f"mhc (n={n}, d={d}, iters={iters}, {rows[0]['dtype']}; us per hyper-connection):")
    print(f"{'T':>5} {'mode':>6} {'torch us':>10} {'triton us':>10} {'speedup':>8} {'roof us':>8} "
          f"{'triton/roof':>11} {'R':>4}")
    for T in Ts:
        for mode in ("eager", "graph"):
            tr, tt = by[(T, "torch", mode)], by[(T, "triton", mode)]
            print(f"{T:>5} {mode:>6} {tr['ms'] * 1e3:>10.2f} {tt['ms'] * 1e3:>10.2f} "
                  f"{tr['ms'] / tt['ms']:>7.1f}x {tt['roofline_ms'] * 1e3:>8.2f} "
                  f"{tt['roofline_fraction']:>11.1%} {tt['rotate']:>4}")
    return rows
