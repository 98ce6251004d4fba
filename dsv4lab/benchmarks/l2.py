"""``dsv4lab bench l2``: what the L2 state before a timed call costs a memory-bound figure.

``triton.testing.do_bench`` flushes the L2 between calls by zero-filling a 256 MB buffer,
which leaves the L2 full of dirty lines: the timed call's first misses write them back, and
that traffic is charged to the call. This benchmark times one kernel that only reads
(:func:`dsv4lab.kernels.stream_read.stream_read`) over sizes from 12.5 MB to 1.6 GB, once after
each L2 state of :mod:`dsv4lab.bench` (``"dirty"``: the zero fill; ``"clean"``: a reading
flush), replayed from a CUDA graph (``mode="graph"``) and called eagerly (``mode="eager"``:
the launch path included). Rows: ``MB``, ``l2``, ``mode``, ``ms``, ``GB_s`` and the fraction
of the device's recorded read bandwidth. The difference between the two L2 states is a fixed
cost per call, about the L2's size over the DRAM bandwidth: small beside a 1 GB read, a
sixth of a 50 MB one (``gap_table``).

Smoke mode (CPU): 64 KB and 256 KB in the interpreter, one eager row each (no L2 to speak of).
Explained in notebooks/00_tour.ipynb.
"""
from __future__ import annotations

import torch

from dsv4lab import runtime
from dsv4lab.bench import L2_STATES, benchmark, time_fn, time_graph, with_roofline
from dsv4lab.kernels.stream_read import stream_read

SIZES_MB = (12.5, 25, 50, 75, 100, 150, 200, 400, 800, 1600)


@benchmark("l2", "read-only kernel after a dirty vs a clean L2: the timing method's fixed cost")
def bench_l2(smoke: bool) -> list[dict]:
    dev = runtime.device()
    sizes, states = ((0.064, 0.256), (None,)) if smoke else (SIZES_MB, L2_STATES)
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    print(f"{'MB':>7} {'l2':>6} {'mode':>6} {'us':>9} {'GB/s':>7} {'frac':>6}")
    for mb in sizes:
        words = torch.randint(0, 2**30, (int(mb * 1e6) // 4,), dtype=torch.int32, device=dev, generator=gen)
        if _xor(stream_read(words)) != _xor(words):     # every word read, before any timing
            raise RuntimeError(f"stream_read at {mb} MB did not read every word")
        for state in states:
            kw = {} if state is None else {"l2": state}
            for mode, timer in (("graph", time_graph), ("eager", time_fn)):
                if smoke and mode == "graph":
                    continue                             # no graphs in the interpreter
                t = timer(lambda: stream_read(words), warmup_ms=10, rep_ms=50, **kw)
                nbytes = words.numel() * 4
                row = dict(op="stream_read", MB=mb, mode=mode, **t, GB_s=nbytes / (t["ms"] * 1e-3) / 1e9)
                rows.append(with_roofline(row, bytes_moved=nbytes, flops=0.0))
                print(f"{mb:>7.1f} {t.get('l2', '-'):>6} {mode:>6} {t['ms'] * 1e3:>9.1f} {row['GB_s']:>7.0f} "
                      f"{row['roofline_fraction']:>6.3f}")
    return rows


# (bench, label, match) of the rows :func:`gap_table` pairs: the MoE's and the attention's headline shapes
GAP_CASES = (
    ("moe", "MoE MXFP4, T 1", dict(impl="triton", fmt="mxfp4", T=1)),
    ("moe", "MoE MXFP4, T 64", dict(impl="triton", fmt="mxfp4", T=64)),
    ("sparse_mla", "sparse MLA bf16, B 64, S_q 1", dict(backend="mma", kv="bf16", B=64, S_q=1, topk=2048)),
    ("sparse_mla", "sparse MLA bf16, B 128, S_q 2", dict(backend="mma", kv="bf16", B=128, S_q=2, topk=2048)),
)


def gap_table(rows_by_bench: dict[str, list[dict]] | None = None) -> list[dict]:
    """Per size of ``bench l2`` and per :data:`GAP_CASES` shape, the newest recorded GPU rows
    after each L2 state from one commit (the newest commit with both; a dirty row of newer code
    against a clean row of older code would charge the code's change to the L2):
    ``{"case", "dirty_us", "clean_us", "gap_us", "measured", "commits"}`` (``measured``: GPU and
    date), only where some commit recorded both states. Explained in notebooks/00_tour.ipynb."""
    from dsv4lab import results
    if rows_by_bench is None:
        rows_by_bench = {b: results.load(b) for b in ("l2", "moe", "sparse_mla")}
    cases = [("l2", f"read-only kernel, {mb:g} MB", dict(op="stream_read", MB=mb)) for mb in SIZES_MB]
    out = []
    for bench_name, label, match in cases + list(GAP_CASES):
        by_commit: dict[str, dict[str, dict]] = {}      # rows in recording order: newest last
        for r in rows_by_bench.get(bench_name, []):
            if (not r.get("smoke") and r.get("l2") and r.get("mode", "graph") == "graph"
                    and all(r.get(k) == v for k, v in match.items())):
                commit = str(r.get("commit"))
                states = by_commit.pop(commit, {})
                states[r["l2"]] = r
                by_commit[commit] = states                       # re-inserted: newest last
        both = [st for st in by_commit.values() if "dirty" in st and "clean" in st]
        if both:
            d, c = both[-1]["dirty"], both[-1]["clean"]
            out.append(dict(case=label, dirty_us=d["ms"] * 1e3, clean_us=c["ms"] * 1e3,
                            gap_us=(d["ms"] - c["ms"]) * 1e3, measured=results.label([d, c]),
                            commits=f"{str(d['commit'])[:7]}/{str(c['commit'])[:7]}"))
    return out


def _xor(t: torch.Tensor) -> int:
    """Xor of all int32 elements (torch has no xor reduction): fold halves until one is left."""
    t = t.flatten()
    while t.numel() > 1:
        if t.numel() % 2:
            t = torch.cat([t, t.new_zeros(1)])
        h = t.numel() // 2
        t = torch.bitwise_xor(t[:h], t[h:])
    return int(t[0]) if t.numel() else 0
