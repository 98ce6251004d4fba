"""``dsv4lab bench sparse_mla``: sparse MLA decode at DeepSeek-V4-Flash's shapes, on the roofline.

Full mode (a GPU): backend "mma" (the family's dispatch) at the slots one decode query attends
in each kind of layer (:data:`LAYERS`: CSA 128 window + 512 indexed = 640; HCA 128 + ctx/128,
1,152 at 128K and 8,320 at 1M; window-only 128), B in {1, 8, 32, 64, 128} x S_q in {1, 2, 3,
4}, bf16 and FP8 caches, the indices drawn as the model draws them (:func:`decode_indices`);
DeepSeek-V3.2's topk 2048 (FlashMLA's published shape, rows ``shape="v3.2"``); the SIMT kernel
and the plain torch a user writes first at notebook 01's points; and where the dispatch picks a
fast path (the warp-specialised kernel on the H200), the portable kernel at the same shapes too
(backend "mma_portable": the evidence for the route). Graph rows replay calls from
a CUDA graph (small cases put several calls on rotated inputs into one graph, so the rows are
not served from the L2); the headline cases also record the eager call, host included, as a
notebook makes it (``mode="eager"``, the op's default checks on). Rows carry the roofline:
bytes = unique KV rows read once + q + out, flops = 2 B S_q H topk (D + d_v).

Where FlashMLA's sparse FP8 decode is installed and runs on this GPU (dsv4lab/ops/flash_mla.py),
its rows stand beside the FP8 ones (backend "flash_mla", ``peer_commit`` from its build): the
CSA layer at B in {1, 8, 32, 64, 128} x S_q in {1, 2} and V3.2's B 64 / S_q 1 and B 128 / S_q 2,
on the same inputs, each checked against the fp32 reference first (a wrong peer is reported,
never recorded). The cache is converted to its layout before anything is timed; the graph rows
replay FlashMLA's own call on it (``call="flash_mla_with_kvcache"``, as its users run it), the
eager rows the op with ``backend="flash_mla"`` (``call="sparse_mla_decode"``).
Smoke mode: tiny shapes (Triton's interpreter on the CPU).

Explained in notebooks/01_simt_baseline.ipynb and notebooks/02_mma_attention.ipynb.
"""
from __future__ import annotations

import math

import torch

from dsv4lab import bench, runtime
from dsv4lab.kernels.attention import dispatch
from dsv4lab.kernels.device import props
from dsv4lab.ops import flash_mla as flash_mla_ops
from dsv4lab.ops import sparse_mla_decode
from dsv4lab.quant import pack_kv_fp8
from dsv4lab.quant.kv_fp8 import ROW_BYTES as FP8_ROW_BYTES

H, D, D_V = 64, 512, 512
WINDOW = 128                   # the sliding window's slots
# layer -> (compressed entries a request has, how many of them a query attends: None = all)
LAYERS = {"window": (0, 0), "csa": (8192, 512), "hca_128k": (1024, None),
          "hca_1m": (8192, None)}
V32_TOPK, V32_CONTEXT = 2048, 8192     # DeepSeek-V3.2: topk 2048 of any cached token
PEER_TOL = dict(atol=2e-2, rtol=2e-2)  # bf16 out against the fp32 reference (lse: 1e-3)
MIN_CACHE_ROWS = 1 << 18       # >= 256 MB of bf16 cache, so rotated inputs miss the L2
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


def layer_topk(layer: str, window: int = WINDOW, layers: dict = LAYERS) -> int:
    """The index-list length of ``layer``: the window plus the compressed entries attended."""
    entries, pick = layers[layer]
    return window + (entries if pick is None else pick)


def decode_indices(B, S_q, entries, pick, *, window, base, generator, device):
    """Cache slots as a decode step attends them: request b's rows start at ``base[b]``, its
    window (the last ``window`` tokens, shifted by one for each later query position) first,
    then its compressed entries from ``base[b] + window + S_q``: ``pick`` of them (None: all
    of them, in order), chosen once a request (a verify step's positions select almost the same
    entries), sorted; -1 where a request has fewer than ``pick`` -> int32 [B, S_q, topk]."""
    n = entries if pick is None else pick
    idx = torch.full((B, S_q, window + n), -1, dtype=torch.int32, device=device)
    s = torch.arange(S_q, device=device)
    idx[:, :, :window] = (base[:, None, None] + s[None, :, None]
                          + torch.arange(window, device=device)[None, None, :]).to(torch.int32)
    if entries and n:
        have = min(entries, n)
        if pick is None:
            sel = torch.arange(entries, device=device).expand(B, entries)
        else:
            sel = torch.rand(B, entries, device=device, generator=generator).argsort(-1)[:, :have]
            sel = sel.sort(-1).values
        comp = base[:, None] + window + S_q + sel
        idx[:, :, window:window + have] = comp[:, None, :].to(torch.int32)
    return idx


class Cache:
    """A cache (bf16, and packed FP8 where asked) with room for ``rotate`` sets of B requests."""

    def __init__(self, B, region, *, heads, dim, min_rows, fp8, device, seed):
        self.B, self.heads, self.dim, self.region, self.device = B, heads, dim, region, device
        n = max(B * region, min_rows)
        self.rotate = max(1, min(MAX_ROTATE, n // (B * region)))
        self.g = torch.Generator(device=device).manual_seed(seed)
        self.kv = torch.randn(n, dim, device=device, generator=self.g).to(torch.bfloat16)
        self.kv_fp8 = pack_kv_fp8(self.kv) if fp8 else None
        self.sink = torch.randn(heads, device=device, generator=self.g)

    def sets(self, S_q, make_indices, rotate=None):
        """``rotate`` sets of (q, indices); set r's requests read their own regions."""
        out = []
        for r in range(rotate or self.rotate):
            q = torch.randn(self.B, S_q, self.heads, self.dim, device=self.device,
                            generator=self.g).to(torch.bfloat16)
            base = (r * self.B + torch.arange(self.B, device=self.device)) * self.region
            out.append((q, make_indices(base, self.g)))
        return out


def _row(backend, kv_fmt, B, S_q, topk, heads, dim, timing, calls, idx, row_bytes, **labels):
    uniq = int(torch.unique(idx[idx >= 0]).numel())
    t = traffic(B, S_q, topk, heads=heads, dim=dim, d_v=dim, kv_row_bytes=row_bytes,
                unique_rows=uniq)
    row = {"op": "sparse_mla_decode", "backend": backend, "kv": kv_fmt, "B": B, "S_q": S_q,
           "topk": topk, "H": heads, "D": dim, "d_v": dim, **labels, "ms": timing["ms"] / calls,
           "timing": timing["timing"], "calls_per_graph": calls, "unique_rows": uniq}
    if "l2" in timing:
        row["l2"] = timing["l2"]
    return bench.with_roofline(row, bytes_moved=t["needed_bytes"], flops=t["flops"], dtype="bf16")


def plan(smoke: bool, headline: bool = False) -> dict:
    """What the benchmark measures: sizes, and the (B, S_q) points of each kind of row
    (``headline``: the eager points, the CSA layer and the V3.2 rows there, SIMT and torch)."""
    if smoke:
        return dict(heads=16, dim=D, window=8, layers={"csa": (24, 16), "hca_1m": (12, None)},
                    v32=(40, 64), min_rows=0, warmup_ms=1, rep_ms=1,
                    grid=[(1, 1), (2, 2)], v32_grid=[(1, 1)], eager=[(1, 1)], v32_eager=[],
                    simt=[(1, 1)], torch_user=[(1, 1)], flash_mla=[], v32_flash_mla=[])
    if headline:
        return dict(plan(False), layers={"csa": LAYERS["csa"]}, grid=[(1, 1), (64, 1)],
                    v32_grid=[(64, 1), (128, 2)])
    return dict(heads=H, dim=D, window=WINDOW, layers=LAYERS, v32=(V32_TOPK, V32_CONTEXT),
                min_rows=MIN_CACHE_ROWS, warmup_ms=10, rep_ms=40,
                grid=[(B, S) for B in (1, 8, 32, 64, 128) for S in (1, 2, 3, 4)],
                v32_grid=[(B, S) for B in (1, 8, 32, 64, 128) for S in (1, 2)],
                eager=[(1, 1), (64, 1)], v32_eager=[(64, 1), (128, 2)],
                simt=[(1, 1), (8, 1), (64, 1)], torch_user=[(1, 1), (8, 1), (64, 1)],
                flash_mla=[(B, S) for B in (1, 8, 32, 64, 128) for S in (1, 2)],
                v32_flash_mla=[(64, 1), (128, 2)])


@bench.benchmark("sparse_mla", "sparse MLA decode at V4's shapes: MMA (bf16, FP8 KV), SIMT, torch, "
                 "FlashMLA where installed")
def sparse_mla_bench(smoke: bool, headline: bool = False) -> list[dict]:
    """Run the plan on this device (``headline``: its headline cases only); print the headline
    rows; return every row."""
    if not smoke and not runtime.has_cuda():
        raise RuntimeError("sparse_mla full mode needs a CUDA GPU; use smoke mode on the CPU")
    p = plan(smoke, headline and not smoke)
    dev = runtime.device()
    heads, dim, window = p["heads"], p["dim"], p["window"]
    rows = []
    peer = None                 # FlashMLA's build commit where its rows are measured here
    if p["flash_mla"] or p["v32_flash_mla"]:
        why = _flash_mla_unavailable(dev)
        if why:
            print(f"no flash_mla rows: {why}")
        else:
            peer = flash_mla_ops.peer_commit()
    print(f"{'backend':>10} {'kv':>4} {'shape':>9} {'mode':>5} {'B':>4} {'S_q':>3} {'topk':>5} "
          f"{'us':>9} {'roof us':>8} {'frac':>5}")

    def measure(cache, S_q, topk, make_indices, labels, *, eager, backends=("mma",),
                portable=False, flash_mla=False):
        sets = cache.sets(S_q, make_indices)
        B = cache.B
        if flash_mla and peer is not None:
            rows.extend(_flash_mla_rows(cache, sets, S_q, topk, labels, eager=eager, p=p,
                                        commit=peer))
        for kv_fmt in ("bf16", "fp8") if "mma" in backends else ("bf16",):
            kv = cache.kv_fp8 if kv_fmt == "fp8" else cache.kv
            row_bytes = FP8_ROW_BYTES if kv_fmt == "fp8" else dim * 2
            here = backends if kv_fmt == "bf16" else ("mma",)
            if portable and "mma" in here and _fast_path(B, S_q, heads, dim, topk,
                                                         kv_fmt == "fp8"):
                here = here + ("mma_portable",)  # the evidence for the fast path's route
            for backend in here:
                if backend == "torch_user":
                    one = (lambda q, i: torch_user_decode(q, cache.kv, i, dim ** -0.5, dim,
                                                          cache.sink))
                elif backend == "mma_portable":
                    one = (lambda q, i, kv=kv, fp8=kv_fmt == "fp8", **_: dispatch.sparse_mla_decode(
                        q, kv, i, cache.sink, dim ** -0.5, dim, fp8=fp8, kernel="mma"))
                else:
                    one = (lambda q, i, kv=kv, backend=backend, validate=False: sparse_mla_decode(
                        q, kv, i, d_v=dim, attn_sink=cache.sink, backend=backend,
                        validate=validate))
                q0, i0 = sets[0]
                one(q0, i0)                      # compile and warm up outside the graph

                def all_sets():
                    for q, i in sets:
                        one(q, i)
                timing = bench.time_graph(all_sets, warmup_ms=p["warmup_ms"], rep_ms=p["rep_ms"])
                rows.append(_row(backend, kv_fmt, B, S_q, topk, heads, dim, timing, len(sets), i0,
                                 row_bytes, mode="graph", **labels))
                if eager and backend == "mma":   # as a notebook calls it: the default checks on
                    timing = bench.time_fn(lambda: one(q0, i0, validate=True),
                                           warmup_ms=p["warmup_ms"], rep_ms=p["rep_ms"])
                    rows.append(_row(backend, kv_fmt, B, S_q, topk, heads, dim, timing, 1, i0,
                                     row_bytes, mode="eager", **labels))

    for layer, (entries, pick) in p["layers"].items():
        topk = layer_topk(layer, window, p["layers"])
        for B in sorted({b for b, _ in p["grid"]}):
            cache = _fresh(B, window + 3 + entries, heads, dim, p, dev, seed=B)
            for b, S_q in p["grid"]:
                if b != B:
                    continue
                make = (lambda base, g, S_q=S_q: decode_indices(
                    B, S_q, entries, pick, window=window, base=base, generator=g, device=dev))
                measure(cache, S_q, topk, make, dict(layer=layer), portable=layer == "csa",
                        eager=layer == "csa" and (B, S_q) in p["eager"],
                        flash_mla=layer == "csa" and (B, S_q) in p["flash_mla"])

    topk, context = p["v32"]
    for B in sorted({b for b, _ in p["v32_grid"] + p["simt"]}):
        cache = _fresh(B, context, heads, dim, p, dev, seed=1000 + B)
        for b, S_q in sorted(set(p["v32_grid"]) | set(p["simt"])):
            if b != B:
                continue
            make = (lambda base, g, S_q=S_q: (
                torch.rand(B, S_q, context, device=dev, generator=g).argsort(-1)[..., :topk]
                + base[:, None, None]).to(torch.int32).contiguous())
            extra = tuple(n for n in ("simt", "torch_user") if (B, S_q) in p[n])
            measure(cache, S_q, topk, make, dict(shape="v3.2"), eager=(B, S_q) in p["v32_eager"],
                    backends=("mma",) * ((B, S_q) in p["v32_grid"]) + extra, portable=True,
                    flash_mla=(B, S_q) in p["v32_flash_mla"])
    for r in rows:          # the headline rows: CSA and V3.2 at the eager points, SIMT, torch
        at = p["eager"] if r.get("layer") == "csa" else p["v32_eager"] if r.get("shape") else []
        if (r["B"], r["S_q"]) in at or r["backend"] in ("simt", "torch_user"):
            print(f"{r['backend']:>10} {r['kv']:>4} {r.get('layer', r.get('shape')):>9} "
                  f"{r['mode']:>5} {r['B']:>4} {r['S_q']:>3} {r['topk']:>5} {r['ms'] * 1e3:>9.1f} "
                  f"{r['roofline_ms'] * 1e3:>8.1f} {r['roofline_fraction']:>5.2f}")
    print(f"{len(rows)} rows (the headline ones above)")
    return rows


def _flash_mla_unavailable(dev) -> str | None:
    """Why FlashMLA's rows are not measured on ``dev`` (None: they are)."""
    from dsv4lab import backends
    try:
        backends.resolve("sparse_mla_decode", "flash_mla", fmt="fp8", device=dev)
    except backends.BackendUnavailable as e:
        return str(e)
    return None


def peer_mismatch(out, lse, ref, ref_lse, tol=PEER_TOL, lse_tol=1e-3) -> str | None:
    """How a peer's (out, lse) differs from the fp32 reference's beyond the bf16 tolerance
    (None: it matches): lse finite exactly where the reference's is."""
    if out.shape != ref.shape or lse.shape != ref_lse.shape:
        return f"shapes {tuple(out.shape)} / {tuple(lse.shape)}, want {tuple(ref.shape)} / " \
               f"{tuple(ref_lse.shape)}"
    err = (out.float() - ref.float()).abs() - tol["rtol"] * ref.float().abs()
    if not bool((err <= tol["atol"]).all()):
        return f"out off by up to {float(err.max()) + tol['atol']:.3g} (atol {tol['atol']})"
    fin = torch.isfinite(ref_lse)
    if not torch.equal(fin, torch.isfinite(lse)):
        return "lse finite where the reference's is not (or the other way round)"
    if fin.any():
        e = float((lse[fin] - ref_lse[fin]).abs().max())
        if e > lse_tol:
            return f"lse off by {e:.3g}"
    return None


def _flash_mla_rows(cache, sets, S_q, topk, labels, *, eager, p, commit) -> list[dict]:
    """FlashMLA's rows at one point: checked against the fp32 reference on the first set, then
    its own call replayed over every set (their inputs prepared in its layout beforehand) and,
    with ``eager``, the op with backend="flash_mla" as a notebook calls it."""
    kv, sink, B = cache.kv_fp8, cache.sink, cache.B
    heads, dim = cache.heads, cache.dim
    q0, i0 = sets[0]
    out, lse = sparse_mla_decode(q0, kv, i0, d_v=dim, attn_sink=sink, backend="flash_mla")
    ref, ref_lse = sparse_mla_decode(q0, kv, i0, d_v=dim, attn_sink=sink, backend="torch")
    wrong = peer_mismatch(out, lse, ref, ref_lse)
    del out, lse, ref, ref_lse
    if wrong:
        print(f"flash_mla at B {B} S_q {S_q} topk {topk} is WRONG ({wrong}): not recorded")
        return []
    preps = [flash_mla_ops.prepare(q, kv, i) for q, i in sets]    # outside the timed region
    scale = dim ** -0.5

    def all_sets():
        for (q, _), prep in zip(sets, preps):
            flash_mla_ops.call(q, prep, sink, scale)
    all_sets()
    labels = dict(labels, peer_commit=commit)
    timing = bench.time_graph(all_sets, warmup_ms=p["warmup_ms"], rep_ms=p["rep_ms"])
    rows = [_row("flash_mla", "fp8", B, S_q, topk, heads, dim, timing, len(sets), i0,
                 FP8_ROW_BYTES, mode="graph", call="flash_mla_with_kvcache", **labels)]
    if eager:
        timing = bench.time_fn(lambda: sparse_mla_decode(q0, kv, i0, d_v=dim, attn_sink=sink,
                                                         backend="flash_mla"),
                               warmup_ms=p["warmup_ms"], rep_ms=p["rep_ms"])
        rows.append(_row("flash_mla", "fp8", B, S_q, topk, heads, dim, timing, 1, i0,
                         FP8_ROW_BYTES, mode="eager", call="sparse_mla_decode", **labels))
    return rows


def _fast_path(B, S_q, heads, dim, topk, fp8) -> bool:
    """Whether the dispatch runs a fast path (not the portable kernel) for this shape here."""
    if not runtime.has_cuda():
        return False
    pl = dispatch.plan(props(runtime.device()), B=B, S_q=S_q, H=heads, D=dim, d_v=dim, topk=topk,
                       q_dtype=torch.bfloat16, fp8=fp8, aligned=True)
    return pl.kernel != "mma"


def _fresh(B, region, heads, dim, p, dev, seed):
    """A new cache for one batch size (the previous one freed first)."""
    if runtime.has_cuda():
        torch.cuda.empty_cache()
    return Cache(B, region, heads=heads, dim=dim, min_rows=p["min_rows"], fp8=dim == D,
                  device=dev, seed=seed)


def speedups(rows) -> list[dict]:
    """The comparisons from recorded rows (graph replays): MMA vs torch_user and SIMT, FP8 vs
    bf16, at B 1 / topk 640 and the V3.2 shapes."""
    def ms(backend, kv, B, S, T):
        hits = [r for r in rows if (r["backend"], r["kv"], r["B"], r["S_q"], r["topk"]) ==
                (backend, kv, B, S, T) and r.get("mode", "graph") == "graph"]
        return hits[-1]["ms"] if hits else math.nan
    out = []
    for B, S, T in [(1, 1, 640), (64, 1, 2048), (128, 2, 2048)]:
        m = ms("mma", "bf16", B, S, T)
        out.append({"B": B, "S_q": S, "topk": T, "mma_us": m * 1e3,
                    "vs_torch_user": ms("torch_user", "bf16", B, S, T) / m,
                    "vs_simt": ms("simt", "bf16", B, S, T) / m,
                    "fp8_speedup": m / ms("mma", "fp8", B, S, T)})
    return out
