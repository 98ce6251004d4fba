"""``dsv4lab bench moe``: the FP4 MoE at DeepSeek-V4-Flash's shape, across token counts.

256 experts, top-6, hidden 4096, intermediate 2048; T tokens routed by
:func:`dsv4lab.ops.route` on random logits (a realistic spread of experts). Rows:

- ``triton``, MXFP4 and NVFP4 experts: ``ops.fused_moe`` with the kernel family's default
  dispatch (the row's ``kernel`` names the route taken), replayed from a CUDA graph
  (``mode="graph"``) at every T, and called eagerly with its default checks (``mode="eager"``:
  host included, as a notebook calls it) at the headline T;
- ``triton_kernels``, MXFP4 only (it takes no NVFP4), where that backend is available
  (:mod:`dsv4lab.ops.moe_peers`: OpenAI's triton_kernels importable, sm_90): the same call,
  bytes, routing and activation through OpenAI's MoE, graph at every T and eager at the headline
  T, with the tiles its ``opt_flags`` chose (``opt_flags``) and the source measured
  (``peer_source``);
- ``torch_ref`` (the reference: dequantise each expert hit to fp32, matmul) and
  ``torch_bf16`` ("just dequantise at load": bf16 weights, a bf16 matmul per expert hit),
  eager, at small T only (they are slow).

Before a Triton or triton_kernels case is timed, its output for the first tokens (up to
:data:`CHECK_TOKENS`; the MoE is per token) is compared with the fp32 reference: ``rel_err``
is max |out - ref| / max |ref|, and a case over :data:`TOL` is reported and not timed.

Every row's roofline uses the FP4 bytes (packed weights + scales) of the experts the drawn
routing hits, at the row's format (MXFP4's for the torch rows, the yardstick they are
compared with), and 2 FLOPs per weight per routed token.

Weights are random bytes (every nibble, a realistic scale range), not a quantised
checkpoint: what is measured is data movement and decoding, which do not depend on the
values. Explained in notebooks/04_mxfp4_moe_port.ipynb.
"""
from __future__ import annotations

import torch

from dsv4lab import backends, bench, runtime
from dsv4lab.ops import fused_moe, moe_peers, route
from dsv4lab.ops.moe import moe_dense
from dsv4lab.quant import mxfp4_dequantize, mxfp4_quantize, nvfp4_quantize

FLASH = dict(E=256, H=4096, I=2048, topk=6)
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)
EAGER_TOKENS = (1, 8, 64, 256)          # the headline cases: an eager row beside the graph row
REFERENCE_TOKENS = (1, 8)               # the torch rows (slow)
SWIGLU_LIMIT = 10.0
CHECK_TOKENS = 8                        # tokens compared with the reference before timing
TOL = 1.2e-2                            # bf16 x and output: as tests/test_moe.py


def fp4_bytes(n_experts: int, H: int, I: int, fmt: str) -> float:
    """Packed weights + scales of ``n_experts`` experts (w13 and w2)."""
    weights = n_experts * 3 * H * I
    scales = weights / 32 if fmt == "mxfp4" else weights / 16
    return weights / 2 + scales


def random_experts(E, H, I, fmt, device, gen):
    """Random FP4 experts: uniform bytes, scales in a realistic range."""
    def packed(*shape):
        return torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=gen)
    w13, w2 = packed(E, 2 * I, H // 2), packed(E, H, I // 2)
    if fmt == "mxfp4":
        s13 = torch.randint(118, 122, (E, 2 * I, H // 32), dtype=torch.uint8, device=device, generator=gen)
        s2 = torch.randint(118, 122, (E, H, I // 32), dtype=torch.uint8, device=device, generator=gen)
        return dict(w13=w13, w13_scale=s13, w2=w2, w2_scale=s2, kw={})
    s13 = (torch.rand(E, 2 * I, H // 16, device=device, generator=gen) * 4 + 0.5).to(torch.float8_e4m3fn)
    s2 = (torch.rand(E, H, I // 16, device=device, generator=gen) * 4 + 0.5).to(torch.float8_e4m3fn)
    g = torch.full((E,), 2e-3, device=device)
    return dict(w13=w13, w13_scale=s13, w2=w2, w2_scale=s2, kw=dict(w13_global=g, w2_global=g.clone()))


def quantised_experts(E, H, I, fmt, device, gen: torch.Generator | None = None, scale: float = 0.1):
    """E experts of random normal weights (times ``scale``) quantised to ``fmt`` one expert at a
    time on ``device`` (the quantisers work in float64: one expert's peak, not E's) ->
    ``dict(w13, w13_scale, w2, w2_scale, kw)``, ``kw`` the NVFP4 global scales ([E] fp32)."""
    gen = gen or torch.Generator(device=device).manual_seed(0)
    parts = []
    for _ in range(E):
        w13 = torch.randn(2 * I, H, generator=gen, device=device) * scale
        w2 = torch.randn(H, I, generator=gen, device=device) * scale
        if fmt == "mxfp4":
            parts.append((*mxfp4_quantize(w13), None, *mxfp4_quantize(w2), None))
        else:
            parts.append((*nvfp4_quantize(w13), *nvfp4_quantize(w2)))
    a, b, g1, c, d, g2 = zip(*parts)
    kw = {} if fmt == "mxfp4" else dict(w13_global=torch.stack(g1).to(device),
                                       w2_global=torch.stack(g2).to(device))
    return dict(w13=torch.stack(a), w13_scale=torch.stack(b), w2=torch.stack(c),
                w2_scale=torch.stack(d), kw=kw)


def _dequant_bf16(ex, E):
    """mxfp4 -> bf16 once, expert by expert (the 'dequantise at load' baseline)."""
    w13 = torch.stack([mxfp4_dequantize(ex["w13"][e], ex["w13_scale"][e], dtype=torch.bfloat16) for e in range(E)])
    w2 = torch.stack([mxfp4_dequantize(ex["w2"][e], ex["w2_scale"][e], dtype=torch.bfloat16) for e in range(E)])
    return w13, w2


def token_case(T: int, E: int, H: int, topk: int, dev, gen: torch.Generator):
    """One step's routing and input as the MoE benchmarks draw them from ``gen``: T tokens'
    router logits and a small selection bias, routed (sqrt-softplus, top-k), then x in bf16
    -> (topk_ids, topk_weights, x). Shared with tools/tune_moe.py and tools/profile_moe.py."""
    logits = torch.randn(T, E, device=dev, generator=gen)
    bias = torch.randn(E, device=dev, generator=gen) * 0.1
    ids, w = route(logits, bias, topk=topk)
    return ids, w, torch.randn(T, H, device=dev, generator=gen).to(torch.bfloat16)


def _row(T, impl, fmt, hit, n_pairs, shape, timing, basis_fmt, mode, kernel=None, **extra):
    E, H, I, k = shape["E"], shape["H"], shape["I"], shape["topk"]
    row = dict(T=T, impl=impl, fmt=fmt, mode=mode, E=E, hidden=H, intermediate=I, topk=k,
               experts_hit=hit, roofline_basis=f"{basis_fmt} bytes of the experts hit", **timing)
    if kernel is not None:
        row["kernel"] = kernel
    row.update(extra)
    return bench.with_roofline(row, bytes_moved=fp4_bytes(hit, H, I, basis_fmt),
                               flops=2.0 * n_pairs * 3 * H * I)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| (the tolerance :data:`TOL` applies to it)."""
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


def check_against_reference(out, ex, fmt, x, ids, w, n: int = CHECK_TOKENS) -> float:
    """The first ``n`` rows of ``out`` (a T-token call's output) against the fp32 torch
    reference on those tokens (the MoE is per token) -> :func:`rel_err`."""
    ref = fused_moe(x[:n].float(), ex["w13"], ex["w13_scale"], ex["w2"], ex["w2_scale"], ids[:n], w[:n],
                    fmt=fmt, swiglu_limit=SWIGLU_LIMIT, backend="torch", **ex["kw"])
    return rel_err(out[:n], ref)


def peer_unavailable(shape: dict, device) -> str | None:
    """None where the triton_kernels backend can run this benchmark's shape; else why not."""
    try:
        backends.resolve("fused_moe", moe_peers.PEER, fmt="mxfp4", device=device)
    except backends.BackendUnavailable as e:
        return str(e)
    if shape["H"] % 128 or shape["I"] % 128:
        return f"{moe_peers.PEER} needs hidden and intermediate sizes that are multiples of 128"
    return None


def print_table(rows: list[dict]) -> None:
    """One line a T: Triton graph and eager us and fraction of roofline a format, then
    triton_kernels' MXFP4 graph us and its time over the Triton MXFP4 graph row's."""
    by = {(r["T"], r["impl"], r["fmt"], r.get("mode", "graph")): r for r in rows}
    print(f"{'T':>5} {'mxfp4 graph':>12} {'eager':>9} {'frac':>6} {'nvfp4 graph':>12} {'eager':>9} "
          f"{'frac':>6} {'tk graph':>9} {'tk/ours':>8}  kernel")
    def us(r):
        return r["ms"] * 1e3 if r else float("nan")
    for T in sorted({key[0] for key in by if key[1] == "triton"}):
        cells = []
        for fmt in ("mxfp4", "nvfp4"):
            g, e = by.get((T, "triton", fmt, "graph")), by.get((T, "triton", fmt, "eager"))
            cells.append(f"{us(g):>12.1f} {us(e):>9.1f} {g.get('roofline_fraction', 0) if g else 0:>6.3f}")
        ours, peer = by.get((T, "triton", "mxfp4", "graph")), by.get((T, moe_peers.PEER, "mxfp4", "graph"))
        ratio = peer["ms"] / ours["ms"] if peer and ours else float("nan")
        kern = (ours or {}).get("kernel", "")
        print(f"{T:>5} {cells[0]} {cells[1]} {us(peer):>9.1f} {ratio:>8.2f}  {kern}")


def _flags_label(flags: dict) -> str:
    return ", ".join(f"{name} {f['block_m']}x{f['block_n']}x{f['block_k']} w{f['num_warps']} "
                     f"s{f['num_stages']}{' persistent' if f['is_persistent'] else ''}"
                     for name, f in flags.items())


@bench.benchmark("moe", "FP4 MoE at the Flash shape across T: Triton MXFP4/NVFP4 (graph and eager) "
                        "vs OpenAI's triton_kernels (MXFP4) vs the torch reference vs bf16")
def bench_moe(smoke: bool) -> list[dict]:
    from dsv4lab.kernels.moe import dispatch
    dev = runtime.device()
    gen = torch.Generator(device=dev).manual_seed(0)
    if smoke:
        shape, tokens, eager_t, ref_t = dict(E=8, H=64, I=64, topk=2), (1, 4), (1,), (1,)
        experts = {f: quantised_experts(shape["E"], shape["H"], shape["I"], f, dev, gen)
                   for f in ("mxfp4", "nvfp4")}
    else:
        shape, tokens, eager_t, ref_t = FLASH, TOKENS, EAGER_TOKENS, REFERENCE_TOKENS
        experts = {f: random_experts(shape["E"], shape["H"], shape["I"], f, dev, gen)
                   for f in ("mxfp4", "nvfp4")}
    E, H, I, k = shape["E"], shape["H"], shape["I"], shape["topk"]
    peer_off = peer_unavailable(shape, dev)
    if peer_off:
        print(f"no {moe_peers.PEER} rows: {peer_off}")
    bf16 = None
    rows = []
    for T in tokens:
        ids, w, x = token_case(T, E, H, k, dev, gen)
        hit = int(torch.unique(ids).numel())
        pairs = ids.numel()
        cases = [("triton", "mxfp4"), ("triton", "nvfp4")] + ([] if peer_off else [(moe_peers.PEER, "mxfp4")])
        for impl, fmt in cases:
            ex = experts[fmt]

            def run(ex=ex, fmt=fmt, backend=impl, validate=True):
                return fused_moe(x, ex["w13"], ex["w13_scale"], ex["w2"], ex["w2_scale"], ids, w,
                                 fmt=fmt, swiglu_limit=SWIGLU_LIMIT, backend=backend,
                                 validate=validate, **ex["kw"])

            try:
                err = check_against_reference(run(), ex, fmt, x, ids, w)
                if impl == "triton":
                    extra = dict(kernel=dispatch.route_for(x, ex["w13"], ex["w13_scale"], ex["w2"],
                                                           ex["w2_scale"], ids).kernel)
                else:
                    flags = moe_peers.opt_flags(T, k, E, H, I, ex["w13"], ex["w13_scale"], ex["w2"],
                                                ex["w2_scale"])
                    extra = dict(kernel=f"matmul ({_flags_label(flags)})", opt_flags=flags,
                                 peer_source=moe_peers.peer_source())
            except Exception as e:  # noqa: BLE001  (a peer that fails leaves the project's rows)
                if impl == "triton":
                    raise
                print(f"{impl} T={T}: {type(e).__name__}: {e}; no {impl} rows from here on")
                peer_off = str(e)
                continue
            if not err <= TOL:
                print(f"{impl} {fmt} T={T}: max error / max |ref| {err:.2e} > {TOL}: not timed")
                continue
            timing = bench.time_graph(lambda run=run: run(validate=False))
            rows.append(_row(T, impl, fmt, hit, pairs, shape, timing, fmt, "graph", rel_err=err, **extra))
            if T in eager_t:
                rows.append(_row(T, impl, fmt, hit, pairs, shape, bench.time_fn(run), fmt, "eager",
                                 rel_err=err, **extra))
        if T in ref_t:
            ex = experts["mxfp4"]

            def ref():
                return fused_moe(x, ex["w13"], ex["w13_scale"], ex["w2"], ex["w2_scale"], ids, w,
                                 fmt="mxfp4", swiglu_limit=SWIGLU_LIMIT, backend="torch")
            rows.append(_row(T, "torch_ref", "mxfp4", hit, pairs, shape,
                             bench.time_fn(ref, warmup_ms=1, rep_ms=50), "mxfp4", "eager"))
            if bf16 is None:
                bf16 = _dequant_bf16(experts["mxfp4"], E)

            def dense():
                return moe_dense(x, *bf16, ids, w, swiglu_limit=SWIGLU_LIMIT)
            rows.append(_row(T, "torch_bf16", "bf16", hit, pairs, shape,
                             bench.time_fn(dense, warmup_ms=5, rep_ms=50), "mxfp4", "eager"))
    print_table(rows)
    return rows
