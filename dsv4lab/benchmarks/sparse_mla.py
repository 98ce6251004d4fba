"""``dsv4lab bench sparse_mla``: sparse MLA decode, MMA vs SIMT vs plain torch, on the roofline.

Full mode (a GPU): the MMA kernel over B in {1, 8, 32, 64, 128} x topk in {640, 2048} x
S_q in {1, 2, 4} with bf16 and with FP8 KV; the plain torch code a user would write
("torch_user", bf16 gather-einsum-softmax) and the SIMT kernel at a few points. Every
call is timed from a CUDA graph; small cases put several calls on rotated inputs into
one graph (``calls_per_graph``) so the KV rows are not served from L2. Smoke mode: tiny
shapes (Triton's interpreter on the CPU). Named kernel variants (``VARIANTS`` of
kernels/sparse_mla_mma.py, e.g. the PREFETCH software pipeline) are timed at the target
shapes only, as rows with backend "mma_variant", a ``variant`` name and the exact
``config`` (a separate backend name, so they never shadow the default "mma" rows). Rows carry the roofline of the problem:
bytes = unique KV rows read once + q + out, flops = 2 B S_q H topk (D + d_v).

Explained in notebooks/01_simt_baseline.ipynb and notebooks/02_mma_attention.ipynb.
"""
from __future__ import annotations

import math

import torch

from dsv4lab import bench, runtime
from dsv4lab.ops import sparse_mla_decode
from dsv4lab.ops.attention import mma_variants, sparse_mla_decode_with_config
from dsv4lab.quant import pack_kv_fp8
from dsv4lab.quant.kv_fp8 import ROW_BYTES as FP8_ROW_BYTES

H, D, D_V = 64, 512, 512
CONTEXT = 8192                 # cache rows per sequence: each query picks topk of them
MIN_CACHE_ROWS = 1 << 18       # >= 256 MB of bf16 cache, so rotated inputs miss L2
MAX_ROTATE = 32


def torch_user_decode(q, kv, indices, scale, d_v, attn_sink=None):
    """The plain torch a user writes first: gather the rows, einsum, softmax, einsum (bf16)."""
    k = kv[indices.clamp(min=0).long()]                              # [B, S, T, D]
    s = torch.einsum("bshd,bstd->bsht", q, k).float() * scale
    s = s.masked_fill(indices[:, :, None, :] < 0, float("-inf"))
    if attn_sink is not None:
        sink = attn_sink.float()[None, None, :, None].expand(*s.shape[:3], 1)
        p = torch.softmax(torch.cat([s, sink], -1), -1)[..., :-1]
    else:
        p = torch.softmax(s, -1)
    return torch.einsum("bsht,bstd->bshd", p.to(q.dtype), k[..., :d_v])


def traffic(B, S_q, topk, *, heads=H, dim=D, d_v=D_V, kv_row_bytes=None, unique_rows=None,
            elem_bytes=2) -> dict:
    """The bytes model: what the problem needs vs what one-program-per-head reads.

    ``needed_bytes``: each unique KV row once + q + out (the roofline's bytes);
    ``simt_kv_bytes``: every selected row once per head (H x topk x row per query).
    """
    row = kv_row_bytes or dim * elem_bytes
    uniq = unique_rows if unique_rows is not None else B * S_q * topk
    qo = B * S_q * heads * (dim + d_v) * elem_bytes
    return {"needed_bytes": uniq * row + qo,
            "simt_kv_bytes": B * S_q * heads * topk * row,
            "shared_kv_bytes": B * S_q * topk * row,
            "flops": 2.0 * B * S_q * heads * topk * (dim + d_v)}


class _Cases:
    """Caches (bf16 and FP8) and rotated inputs for one batch size."""

    def __init__(self, B, *, heads, dim, context, min_rows, device, fp8):
        self.B, self.heads, self.dim, self.context = B, heads, dim, context
        self.device = device
        n = max(B * context, min_rows)
        self.rotate = max(1, min(MAX_ROTATE, n // (B * context)))
        g = torch.Generator(device=device).manual_seed(B)
        self.kv = torch.randn(n, dim, device=device, generator=g, dtype=torch.float32).to(torch.bfloat16)
        self.kv_fp8 = pack_kv_fp8(self.kv) if fp8 else None
        self.sink = torch.randn(heads, device=device, generator=g)
        self.g = g

    def inputs(self, S_q, topk, rotate):
        """``rotate`` sets of (q, indices); set r picks rows in its own region of the cache."""
        B, ctx = self.B, self.context
        out = []
        for r in range(rotate):
            q = torch.randn(B, S_q, self.heads, self.dim, device=self.device,
                            generator=self.g).to(torch.bfloat16)
            pick = torch.rand(B, S_q, ctx, device=self.device, generator=self.g).argsort(-1)[..., :topk]
            base = (r * B + torch.arange(B, device=self.device)) * ctx
            idx = (pick + base[:, None, None]).to(torch.int32).contiguous()
            out.append((q, idx))
        return out


def _row(backend, kv_fmt, B, S_q, topk, heads, dim, d_v, timing, calls, idx, row_bytes):
    uniq = int(torch.unique(idx[idx >= 0]).numel())
    t = traffic(B, S_q, topk, heads=heads, dim=dim, d_v=d_v, kv_row_bytes=row_bytes,
                unique_rows=uniq)
    row = {"op": "sparse_mla_decode", "backend": backend, "kv": kv_fmt, "B": B, "S_q": S_q,
           "topk": topk, "H": heads, "D": dim, "d_v": d_v, "ms": timing["ms"] / calls,
           "timing": timing["timing"], "calls_per_graph": calls, "unique_rows": uniq}
    if "l2" in timing:
        row["l2"] = timing["l2"]
    return bench.with_roofline(row, bytes_moved=t["needed_bytes"], flops=t["flops"], dtype="bf16")


def _time(fn_one, sets, warmup_ms, rep_ms):
    def fn():
        for q, idx in sets:
            fn_one(q, idx)
    return bench.time_graph(fn, warmup_ms=warmup_ms, rep_ms=rep_ms)


# (variant, kv format) rows timed at the target shapes; keys of sparse_mla_mma.VARIANTS.
# Timed on the H200 on 2026-11-29 and dropped from the rows (slower than the default or
# than fp8fast_pg_n32_s4 at both shapes): prefetch_n32, prefetch_n64, pipe_gather_n32_s3/s4,
# stages5_n32, fp8fast_n32, fp8fast_prefetch_n32, kqt_n128_s1. fp8fast_n64 and
# fp8fast_pg_n32_s3/s4 stay as the references for the SPLIT_QK rows (sqk_*).
VARIANT_ROWS = (("sqk_n64", "bf16"), ("sqk_pg_n32_s3", "bf16"), ("sqk_pg_n32_s4", "bf16"),
                ("fp8fast_n64", "fp8"), ("fp8fast_pg_n32_s3", "fp8"), ("fp8fast_pg_n32_s4", "fp8"),
                ("fp8fast_sqk_n64", "fp8"), ("fp8fast_sqk_pg_n32_s3", "fp8"),
                ("fp8fast_sqk_pg_n32_s4", "fp8"), ("fp8fast_sqk_pg_n64_s3", "fp8"),
                ("fp8fast_sqk_pg_n32_s4_w16", "fp8"),
                ("ws_n32_b3", "bf16"), ("ws_n32_b3_lazy", "bf16"),
                ("ws_ss_n32_b3", "bf16"), ("ws_ss_n32_b4", "bf16"), ("ws_ss_n32_b4_merge", "bf16"),
                ("ws_ss_n32_b4_p16", "bf16"), ("ws_ss_n32_b4_pdl", "bf16"),
                ("ws_ss_n32_b4_p16_pdl", "bf16"), ("ws_ss_n32_b4_merge_p16", "bf16"),
                ("ws_n32_b3", "fp8"), ("ws_ss_n32_b3", "fp8"),
                ("ws_ss_n32_b4_lazy", "bf16"), ("ws_ss_n32_b4_lazy_p16_pdl", "bf16"),
                ("ws_ss_n32_b3_lazy", "fp8"), ("ws_ss_n32_b4_psw", "bf16"),
                ("ws_ss_n32_b3_psw", "fp8"), ("ws_ss_n32_b4_psw_p16_pdl", "bf16"),
                ("ws_ss_n32_b3_psw_p16_pdl", "fp8"), ("ws_ss_n32_b3_lazy_psw_p16_pdl", "fp8"))
VARIANT_NAMES = tuple(dict.fromkeys(v for v, _ in VARIANT_ROWS))


def plan(smoke: bool) -> dict:
    """Which (backend, kv, B, S_q, topk) points the benchmark measures."""
    if smoke:
        return {"heads": 16, "dim": 64, "context": 64, "min_rows": 0, "warmup_ms": 1, "rep_ms": 1,
                "variant_rep_ms": 1, "variants": [("sqk_pg_n32_s3", "bf16", 1, 1, 40),
                                                  ("fp8fast_sqk_n64", "fp8", 1, 1, 24)],
                "mma": [(1, 1, 40), (2, 2, 40)], "mma_fp8": [(1, 1, 24)],
                "simt": [(1, 1, 40)], "torch_user": [(1, 1, 40)], "torch": [(1, 1, 40)]}
    sweep = [(B, S, T) for B in (1, 8, 32, 64, 128) for T in (640, 2048) for S in (1, 2, 4)]
    return {"heads": H, "dim": D, "context": CONTEXT, "min_rows": MIN_CACHE_ROWS,
            "warmup_ms": 10, "rep_ms": 40, "variant_rep_ms": 20,
            "variants": [(v, kv, B, S, T) for v, kv in VARIANT_ROWS
                         for (B, S, T) in ((64, 1, 2048), (128, 2, 2048))],
            "mma": sweep, "mma_fp8": sweep,
            "simt": [(1, 1, 2048), (8, 1, 2048), (64, 1, 2048), (128, 2, 2048)],
            "torch_user": [(1, 1, 640), (1, 1, 2048), (8, 1, 2048), (64, 1, 2048), (128, 2, 2048)],
            "torch": []}


@bench.benchmark("sparse_mla", "sparse MLA decode: MMA (bf16, FP8 KV) vs SIMT vs plain torch")
def sparse_mla_bench(smoke: bool) -> list[dict]:
    """Run the plan on this device; print one line per row; return the rows."""
    if not smoke and not runtime.has_cuda():
        raise RuntimeError("sparse_mla full mode needs a CUDA GPU; use smoke mode on the CPU")
    p = plan(smoke)
    dev = runtime.device()
    heads, dim = p["heads"], p["dim"]
    d_v = dim
    scale = dim ** -0.5
    fp8_dim = D
    rows = []
    print(f"{'backend':>12} {'kv':>4} {'B':>4} {'S_q':>3} {'topk':>5} {'us':>10} {'roof us':>8} {'frac':>6}")
    jobs = [(name, B, S, T) for name in ("mma", "mma_fp8", "simt", "torch_user", "torch")
            for (B, S, T) in p[name]]
    jobs += [(f"var:{v}:{kv}", B, S, T) for (v, kv, B, S, T) in p.get("variants", [])]
    by_b: dict[tuple, _Cases] = {}
    is_fp8 = lambda name: name == "mma_fp8" or name.endswith(":fp8")   # noqa: E731
    for name, B, S, T in sorted(jobs, key=lambda j: (j[1], not is_fp8(j[0]))):
        fp8 = is_fp8(name)
        this_dim = fp8_dim if fp8 else dim
        key = (B, this_dim)
        if key not in by_b:
            by_b.clear()            # one batch size's caches at a time
            if runtime.has_cuda():
                torch.cuda.empty_cache()
            need_fp8 = any(is_fp8(j[0]) and j[1] == B for j in jobs) and this_dim == fp8_dim
            by_b[key] = _Cases(B, heads=heads, dim=this_dim, context=max(p["context"], T),
                               min_rows=p["min_rows"], device=dev, fp8=need_fp8)
        c = by_b[key]
        sets = c.inputs(S, T, c.rotate)
        variant, rep_ms = None, p["rep_ms"]
        if name.startswith("var:"):
            variant, rep_ms = name.split(":")[1], p["variant_rep_ms"]
            backend = "mma_variant"
            kv = c.kv_fp8 if fp8 else c.kv
            fn = (lambda q, idx, kv=kv, dd=this_dim, v=variant: sparse_mla_decode_with_config(
                q, kv, idx, config=v, d_v=dd, softmax_scale=dd ** -0.5, attn_sink=c.sink,
                check_indices=False))
            row_bytes = FP8_ROW_BYTES if fp8 else this_dim * 2
            kv_fmt = "fp8" if fp8 else "bf16"
        elif name in ("mma", "mma_fp8", "simt", "torch"):
            backend = "mma" if name.startswith("mma") else name
            kv = c.kv_fp8 if fp8 else c.kv
            fn = (lambda q, idx, kv=kv, backend=backend, dd=this_dim: sparse_mla_decode(
                q, kv, idx, d_v=dd, softmax_scale=dd ** -0.5, attn_sink=c.sink,
                backend=backend, check_indices=False))
            row_bytes = FP8_ROW_BYTES if fp8 else this_dim * 2
            kv_fmt = "fp8" if fp8 else "bf16"
        else:   # torch_user
            backend = "torch_user"
            fn = (lambda q, idx: torch_user_decode(q, c.kv, idx, scale, d_v, c.sink))
            row_bytes, kv_fmt = this_dim * 2, "bf16"
        for q, idx in sets[:1]:
            fn(q, idx)              # compile, tune, warm up outside the graph
        timing = _time(fn, sets, p["warmup_ms"], rep_ms)
        row = _row(backend, kv_fmt, B, S, T, heads, this_dim, this_dim, timing, len(sets),
                   sets[0][1], row_bytes)
        if variant is not None:
            row["variant"], row["config"] = variant, list(mma_variants()[variant])
        rows.append(row)
        print(f"{(variant or backend):>12} {kv_fmt:>4} {B:>4} {S:>3} {T:>5} {row['ms'] * 1e3:>10.1f} "
              f"{row['roofline_ms'] * 1e3:>8.1f} {row['roofline_fraction']:>6.2f}")
    return rows


def speedups(rows) -> list[dict]:
    """The target comparisons from recorded rows: MMA vs torch_user/SIMT, FP8 vs bf16."""
    def ms(backend, kv, B, S, T):
        for r in rows:
            if (r["backend"], r["kv"], r["B"], r["S_q"], r["topk"]) == (backend, kv, B, S, T):
                return r["ms"]
        return math.nan
    out = []
    for B, S, T in [(1, 1, 640), (64, 1, 2048), (128, 2, 2048)]:
        m = ms("mma", "bf16", B, S, T)
        out.append({"B": B, "S_q": S, "topk": T, "mma_us": m * 1e3,
                    "vs_torch_user": ms("torch_user", "bf16", B, S, T) / m,
                    "vs_simt": ms("simt", "bf16", B, S, T) / m,
                    "fp8_speedup": m / ms("mma", "fp8", B, S, T)})
    return out
