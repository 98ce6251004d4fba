"""OpenAI's triton_kernels as fused_moe's external backend "triton_kernels"
(dsv4lab/ops/moe_peers.py; notebooks/04_mxfp4_moe_port.ipynb).

triton_kernels is not a dependency: it is put on PYTHONPATH where it is measured. Without it
the tests here check the registration and the conversions that are the project's own code
(gate/up interleaving, the routing tensors, the activation); with it, also the conversions
through its code on the CPU (its Hopper layouts round-tripped and dequantised by its own torch
reference, its routing metadata built by its own kernels in the interpreter) and the whole
data flow emulated with torch. Its kernels need a GPU: the gpu-marked tests run the backend on
an H200 against the fp32 reference at small and Flash sizes.

Tolerance (max abs error relative to max |reference|): 1.2e-2, as tests/test_moe.py for bf16
activations: triton_kernels' Hopper path multiplies bf16 x by exact bf16 weights with fp32
accumulation, and rounds the activation between its matmuls and the output to bf16 (rel. 3.9e-3
each).
"""
import dsv4lab  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)

import gc
import importlib.util

import pytest
import torch
import triton
import triton.language as tl

from dsv4lab import backends, runtime
from dsv4lab.ops import fused_moe, moe_peers, route
from dsv4lab.ops.moe import swiglu
from dsv4lab.quant import mxfp4_dequantize, mxfp4_quantize

from _moe_support import assert_close, draw_routing, make_experts, run_moe

HAS_TK = importlib.util.find_spec("triton_kernels") is not None
needs_tk = pytest.mark.skipif(not HAS_TK, reason="needs triton_kernels on PYTHONPATH")
ON_H200 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
gpu_peer = pytest.mark.skipif(not (HAS_TK and ON_H200), reason="needs triton_kernels and an sm_90 GPU")
PEER = moe_peers.PEER


# ------------------------------------------------------------------ registration ----------
def test_registered_external_mxfp4_sm90_never_auto():
    b = {x.name: x for x in backends.backends("fused_moe")}[PEER]
    assert (b.kind, b.auto, b.formats) == ("external", False, frozenset({"mxfp4"}))
    T = backends.Target
    for target in (T("cpu", None, True), T("cpu"), T("cuda", (8, 0)), T("cuda", (10, 0)), T("cuda", (12, 0))):
        assert "needs a CUDA GPU of sm_90" in b.unavailable_reason(target, "mxfp4")
        assert backends.resolve("fused_moe", "auto", fmt="mxfp4", target=target).name != PEER
    assert "does not take format 'nvfp4'" in b.unavailable_reason(T("cuda", (9, 0)), "nvfp4")
    reason = b.unavailable_reason(T("cuda", (9, 0)), "mxfp4")
    assert (reason is None) if HAS_TK else "triton_kernels" in reason
    assert backends.resolve("fused_moe", "auto", fmt="mxfp4", target=T("cuda", (9, 0))).name == "triton"


def test_reason_names_triton_kernels_where_it_does_not_import(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(moe_peers.importlib.util, "find_spec",
                        lambda name, *a: None if name == "triton_kernels" else real(name, *a))
    moe_peers.unavailable_reason.cache_clear()
    try:
        reason = moe_peers.unavailable_reason()
        assert "triton_kernels" in reason and "PYTHONPATH" in reason
        with pytest.raises(backends.BackendUnavailable, match="triton_kernels.*PYTHONPATH"):
            backends.resolve("fused_moe", PEER, fmt="mxfp4", target=backends.Target("cuda", (9, 0)))
    finally:
        moe_peers.unavailable_reason.cache_clear()


def test_refused_by_name_before_any_kernel_off_sm90():
    w13, s13 = mxfp4_quantize(torch.randn(2, 256, 128))
    w2, s2 = mxfp4_quantize(torch.randn(2, 128, 128))
    x, ids, w = torch.randn(1, 128), torch.tensor([[0, 1]]), torch.tensor([[0.5, 1.0]])
    with pytest.raises(backends.BackendUnavailable, match="triton_kernels.*sm_90"):
        fused_moe(x, w13, s13, w2, s2, ids, w, backend=PEER)          # CPU tensors: not sm_90
    with pytest.raises(backends.BackendUnavailable, match="does not take format 'nvfp4'"):
        backends.resolve("fused_moe", PEER, fmt="nvfp4", target=backends.Target("cuda", (9, 0)))


def test_shapes_its_layouts_do_not_tile_are_refused():
    with pytest.raises(ValueError, match="hidden and intermediate.*multiples of 128.*64 and 256"):
        moe_peers._check_shape(64, 256, 8)
    with pytest.raises(ValueError, match="E must be < 65535"):
        moe_peers._check_shape(128, 128, 70000)
    moe_peers._check_shape(4096, 2048, 256)


# ------------------------------------------------------------------ the project's conversions
def test_interleave_gate_up_pairs_rows():
    E, inter = 2, 3
    t = torch.randint(0, 256, (E, 2 * inter, 5), dtype=torch.uint8)
    il = moe_peers.interleave_gate_up(t)
    assert il.shape == t.shape
    for j in range(inter):
        assert torch.equal(il[:, 2 * j], t[:, j])              # gate j
        assert torch.equal(il[:, 2 * j + 1], t[:, inter + j])  # up j
    s = torch.arange(E * 2 * inter, dtype=torch.uint8).view(E, 2 * inter, 1)
    assert moe_peers.interleave_gate_up(s)[0, :, 0].tolist() == [0, 3, 1, 4, 2, 5]


def _routing_by_loop(ids, w, E):
    """The Routing, pair by pair in Python."""
    T, k = ids.shape
    flat, wf = ids.reshape(-1).tolist(), w.reshape(-1).tolist()
    valid = [p for p in range(T * k) if 0 <= flat[p] < E]
    order = sorted(valid, key=lambda p: (flat[p], p)) + [p for p in range(T * k) if p not in valid]
    sizes = [sum(1 for p in valid if flat[p] == e) for e in range(E)]
    return order, [p // k for p in order], [wf[p] for p in order], sizes, [int(p in valid) for p in range(T * k)]


@pytest.mark.parametrize("routing", ["random", "skewed", "holes"])
@pytest.mark.parametrize("T,k", [(1, 1), (1, 6), (5, 2), (17, 6)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_routing_tensors_against_a_loop(routing, T, k, dtype):
    E = 8
    ids, w = draw_routing(T, E, k, routing, torch.Generator().manual_seed(T * 7 + k))
    ids = ids.to(dtype)
    if T > 1:
        ids[1, 0] = E                # an id past E (unchecked with validate=False) counts as none
    r = moe_peers.routing_tensors(ids, w, E)
    order, gather, gammas, sizes, mask = _routing_by_loop(ids, w, E)
    assert r.scatter.dtype == r.gather.dtype == r.slice_sizes.dtype == torch.int32
    assert r.scatter.tolist() == order and r.gather.tolist() == gather
    assert r.slice_sizes.tolist() == sizes and sum(sizes) == sum(mask)
    torch.testing.assert_close(r.gammas, torch.tensor(gammas))
    assert r.mask.shape == (T, k, 1) and r.mask.reshape(-1).tolist() == mask


@triton.jit
def _activation_tile(acc_ptr, out_ptr, limit, BM: tl.constexpr, BN: tl.constexpr):
    rows = tl.arange(0, BM)[:, None]
    acc = tl.load(acc_ptr + rows * BN + tl.arange(0, BN)[None, :])
    out = moe_peers.clamped_swiglu(acc, limit)
    tl.store(out_ptr + rows * (BN // 2) + tl.arange(0, BN // 2)[None, :], out)


@pytest.mark.parametrize("limit", [None, 10.0, 0.75])
def test_fused_activation_is_the_projects_clamped_swiglu(limit):
    # the activation triton_kernels' matmul applies to its accumulator, on interleaved
    # (gate, up) columns, equals ops.moe.swiglu on the project's (gate | up) halves
    dev = runtime.device()
    BM, BN = 4, 16
    acc = (torch.randn(BM, BN, generator=torch.Generator().manual_seed(1)) * 8).to(dev)
    acc[0, 0], acc[0, 1], acc[1, 2], acc[1, 3] = 30.0, -30.0, -40.0, 25.0     # both clamps
    out = torch.empty(BM, BN // 2, device=dev)
    _activation_tile[(1,)](acc, out, limit, BM=BM, BN=BN)
    want = swiglu(torch.cat((acc[:, 0::2], acc[:, 1::2]), dim=1), limit)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ through triton_kernels' code
@needs_tk
@pytest.mark.parametrize("gate_up", [True, False])
def test_hopper_layouts_hold_the_projects_bytes(gate_up):
    from triton_kernels.numerics_details.mxfp import upcast_from_mxfp_torch
    from triton_kernels.tensor import FP4, convert_layout, wrap_torch_tensor
    from triton_kernels.tensor_details import layout
    E, N, K = 3, 256, 256
    w, s = mxfp4_quantize(torch.randn(E, N, K, generator=torch.Generator().manual_seed(2)))
    hw = moe_peers.hopper_mx_weight(w, s, gate_up=gate_up, chunk=2)     # chunked: 2 + 1 experts
    wi, si = (moe_peers.interleave_gate_up(w), moe_peers.interleave_gate_up(s)) if gate_up else (w, s)
    # what its own convert_layout makes of the whole tensor at once
    v = convert_layout(wrap_torch_tensor(wi.mT, dtype=FP4), layout.HopperMXValueLayout, mx_axis=1)
    q = convert_layout(wrap_torch_tensor(si.mT), layout.HopperMXScaleLayout, mx_axis=1,
                       num_warps=moe_peers.NUM_WARPS)
    for got, want in ((hw.value, v), (hw.scale, q)):
        assert got.shape == want.shape and got.storage.layout.name == want.storage.layout.name
        assert got.storage.data.stride() == want.storage.data.stride()
        assert torch.equal(got.storage.data, want.storage.data)
    uv = hw.value.storage.layout.unswizzle_data(hw.value.storage.data)
    us = hw.scale.storage.layout.unswizzle_data(hw.scale.storage.data)
    assert torch.equal(uv, wi.mT) and torch.equal(us, si.mT)
    # its dequantisation of what it reads is the project's, [E, K, N] = ours [E, N, K] transposed
    assert torch.equal(upcast_from_mxfp_torch(uv, us, torch.float32, axis=1), mxfp4_dequantize(wi, si).mT)


@needs_tk
@pytest.mark.parametrize("k", [1, 2, 4])
def test_routing_equals_triton_kernels_own_metadata(k):
    # where its top-k's metadata kernels compile (k a power of two; k = 6 does not), they give
    # the same grouping from the same ids; its ragged metadata kernels run in the interpreter
    from triton_kernels.tensor import make_ragged_tensor_metadata, make_ragged_tensor_metadata_torch
    from triton_kernels.topk import topk_torch
    T, E = 7, 8
    dev = runtime.device()
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(k)).to(dev)
    ids, w = route(logits, None, topk=k)
    r = moe_peers.routing_tensors(ids, w, E)
    meta = topk_torch(logits, k, apply_softmax=False, y_indx=ids).mask_metadata
    assert torch.equal(meta.col_sorted_indx, r.scatter)
    assert torch.equal(meta.col_sum, r.slice_sizes)
    assert torch.equal(meta.col_sorted_indx // k, r.gather)
    holes, _ = draw_routing(T, E, k, "holes", torch.Generator().manual_seed(3))
    for sizes in (r.slice_sizes, moe_peers.routing_tensors(holes.to(dev), w, E).slice_sizes):
        got, want = make_ragged_tensor_metadata(sizes, T * k), make_ragged_tensor_metadata_torch(sizes, T * k)
        for f in ("slice_sizes", "slice_offs", "block_offs_data", "block_schedule_data"):
            assert torch.equal(getattr(got, f), getattr(want, f)), f


def _emulate(x, w13, s13, w2, s2, ids, w, limit):
    """The backend's data flow with torch in place of triton_kernels' kernels, reading the
    weights through its layouts and its own dequantisation: matmul #1 over each expert's
    slice of sorted pairs (x rows gathered, interleaved gate/up columns, the activation),
    matmul #2 times gammas scattered to pair rows (rows never written hold NaN), the masked
    sum over k."""
    from triton_kernels.numerics_details.mxfp import upcast_from_mxfp_torch
    T, H = x.shape
    E, k = w13.shape[0], ids.shape[1]
    deq = []
    for t in (moe_peers.hopper_mx_weight(w13, s13, gate_up=True), moe_peers.hopper_mx_weight(w2, s2, gate_up=False)):
        v = t.value.storage.layout.unswizzle_data(t.value.storage.data)
        q = t.scale.storage.layout.unswizzle_data(t.scale.storage.data)
        deq.append(upcast_from_mxfp_torch(v, q, torch.float32, axis=1))      # [E, K, N]
    r = moe_peers.routing_tensors(ids, w, E)
    offs = [0] + torch.cumsum(r.slice_sizes, 0).tolist()
    y = torch.full((T * k, H), float("nan"))
    for e in range(E):
        lo, hi = offs[e], offs[e + 1]
        acc = x[r.gather[lo:hi].long()].float() @ deq[0][e]
        h = swiglu(torch.cat((acc[:, 0::2], acc[:, 1::2]), dim=1), limit)
        y[r.scatter[lo:hi].long()] = (h @ deq[1][e]) * r.gammas[lo:hi, None]
    return torch.where(r.mask.bool(), y.view(T, k, H), 0.0).sum(1)


@needs_tk
@pytest.mark.parametrize("routing", ["random", "holes", "skewed"])
@pytest.mark.parametrize("limit", [None, 10.0])
def test_emulated_data_flow_equals_reference(routing, limit):
    E, H, I, T, k = 4, 128, 128, 6, 3
    ex = make_experts(E, H, I, "mxfp4", seed=5)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(6))
    ids, w = draw_routing(T, E, k, routing, torch.Generator().manual_seed(7))
    ref = run_moe(x, ex, ids, w, "mxfp4", limit, "torch")
    got = _emulate(x, ex["w13"], ex["w13_scale"], ex["w2"], ex["w2_scale"], ids, w, limit)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@needs_tk
def test_conversion_cached_per_tensor_version_and_dropped_with_it(monkeypatch):
    w, s = mxfp4_quantize(torch.randn(2, 256, 128))
    first = moe_peers._converted(w, s, gate_up=True)
    assert moe_peers._converted(w, s, gate_up=True) is first
    assert moe_peers._converted(w, s, gate_up=False) is not first           # another conversion
    w[0, 0, 0] = w[0, 0, 0]                                                  # an in-place write
    again = moe_peers._converted(w, s, gate_up=True)
    assert again is not first
    keys = [key for key in moe_peers._CONVERTED if key[0][0] == w.data_ptr()]
    assert keys
    del w, again
    gc.collect()
    assert not any(key in moe_peers._CONVERTED for key in keys)              # gone with its tensor
    w2, s2 = mxfp4_quantize(torch.randn(2, 256, 128))
    monkeypatch.setattr(moe_peers.runtime, "is_capturing", lambda t: True)
    with pytest.raises(ValueError, match="call once before capturing"):
        moe_peers._converted(w2, s2, gate_up=True)


# ------------------------------------------------------------------ on the H200 -----------
def _case(E, H, I, T, routing, seed, x_dtype=torch.bfloat16):
    ex = make_experts(E, H, I, "mxfp4", seed=seed, device="cuda", scale=0.02 if H >= 1024 else 0.1)
    g = torch.Generator().manual_seed(seed)
    ids, w = draw_routing(T, E, 6 if E >= 6 else 2, routing, g)
    ids[0, -1] = -1
    x = torch.randn(T, H, generator=g).to(x_dtype).cuda()
    return ex, x, ids.cuda(), w.cuda()


@gpu_peer
@pytest.mark.gpu
@pytest.mark.parametrize("E,H,I,T", [(8, 512, 256, 1), (8, 512, 256, 5), (8, 512, 256, 33),
                                     (32, 4096, 2048, 1), (32, 4096, 2048, 8), (32, 4096, 2048, 64),
                                     (32, 4096, 2048, 300)],
                         ids=["small-T1", "small-T5", "small-T33", "flash-T1", "flash-T8", "flash-T64",
                              "flash-T300"])
@pytest.mark.parametrize("routing", ["random", "holes"])
def test_gpu_matches_reference(E, H, I, T, routing):
    ex, x, ids, w = _case(E, H, I, T, routing, seed=T)
    for limit in (10.0, None):
        ref = run_moe(x.float(), ex, ids, w, "mxfp4", limit, "torch")
        out = run_moe(x, ex, ids, w, "mxfp4", limit, PEER)
        assert out.dtype == x.dtype and out.shape == x.shape
        assert_close(out, ref, torch.bfloat16)


@gpu_peer
@pytest.mark.gpu
def test_gpu_fp32_input_and_skewed_prefill():
    # x fp32 (rounded to bf16 inside, output fp32) and every token on one expert: large slices
    ex, x, ids, w = _case(8, 1024, 512, 300, "skewed", seed=11, x_dtype=torch.float32)
    out = run_moe(x, ex, ids, w, "mxfp4", 10.0, PEER)
    assert out.dtype == torch.float32
    assert_close(out, run_moe(x, ex, ids, w, "mxfp4", 10.0, "torch"), torch.bfloat16)


@gpu_peer
@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 64])
def test_gpu_cuda_graph_capture_and_replay(T):
    # no host sync after the first call (the layouts): captured, replayed on new routing and x
    from dsv4lab import bench
    E, H, I = 32, 4096, 2048
    ex, x, ids, w = _case(E, H, I, T, "random", seed=50 + T)

    def run():
        return run_moe(x, ex, ids, w, "mxfp4", 10.0, PEER, validate=False)
    assert_close(run(), run_moe(x.float(), ex, ids, w, "mxfp4", 10.0, "torch"), torch.bfloat16)
    graph, out = bench.capture_graph(run)
    for seed in range(2):
        torch.manual_seed(seed)
        new_ids, new_w = route(torch.randn(T, E, device="cuda"), None, topk=6)
        new_ids[-1, 0] = -1
        ids.copy_(new_ids)
        w.copy_(new_w)
        x.copy_(torch.randn_like(x.float()).to(x.dtype))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, run_moe(x.float(), ex, ids, w, "mxfp4", 10.0, "torch"), torch.bfloat16)


@gpu_peer
@pytest.mark.gpu
def test_gpu_opt_flags_on_the_h200():
    # what its opt_flags picks for the Hopper layouts at Flash's shape (notebook 04 says so)
    E, H, I = 32, 4096, 2048
    ex = make_experts(E, H, I, "mxfp4", seed=3, device="cuda", scale=0.02)
    for T in (1, 8, 256):
        flags = moe_peers.opt_flags(T, 6, E, H, I, ex["w13"], ex["w13_scale"], ex["w2"], ex["w2_scale"])
        for f in flags.values():
            assert (f["block_n"], f["block_k"], f["num_warps"], f["split_k"]) == (256, 128, 8, 1)
            assert not f["is_persistent"] and f["block_m"] in (16, 32, 64, 128)


# ------------------------------------------------------------------ the benchmark and the figures
def test_bench_keeps_the_familys_rows_when_the_peer_fails(monkeypatch, capsys):
    # smoke shapes in the interpreter, timers stubbed: the family's cases are checked against the
    # reference (rel_err on every row); a peer that fails is reported and leaves them be
    from dsv4lab import bench
    from dsv4lab.benchmarks import moe as moe_bench
    fake = {"ms": 1.0, "timing": "stub"}
    monkeypatch.setattr(bench, "time_graph", lambda fn, **kw: dict(fake))
    monkeypatch.setattr(bench, "time_fn", lambda fn, **kw: dict(fake))
    monkeypatch.setattr(moe_bench, "peer_unavailable", lambda shape, device: None)
    rows = moe_bench.bench_moe(smoke=True)
    out = capsys.readouterr().out
    fam = [r for r in rows if r["impl"] == "triton"]
    assert {(r["fmt"], r["T"]) for r in fam} == {(f, t) for f in ("mxfp4", "nvfp4") for t in (1, 4)}
    assert all(r["rel_err"] <= moe_bench.TOL for r in fam)
    assert not any(r["impl"] == PEER for r in rows)
    assert f"{PEER} T=1: BackendUnavailable" in out and "no triton_kernels rows from here on" in out
    assert "tk/ours" in out


def _rows():
    base = dict(E=256, hidden=4096, intermediate=2048, topk=6, gpu="NVIDIA H200", capability="sm_90",
                commit="abc1234", date="2030-01-01T00:00:00", smoke=False, mode="graph", fmt="mxfp4")
    flags = {n: dict(block_m=16, block_n=256, block_k=128, num_warps=8, num_stages=3, split_k=1,
                     is_persistent=False) for n in ("gate_up", "down")}
    rows = []
    for T, ours, peer in ((1, 0.04, 0.09), (8, 0.34, 0.27)):
        rows.append(dict(base, T=T, impl="triton", kernel="gemv_sm90" if T == 1 else "triton_moe", ms=ours,
                         roofline_ms=0.02, roofline_fraction=0.02 / ours))
        rows.append(dict(base, T=T, impl=PEER, kernel="matmul", ms=peer, roofline_ms=0.02,
                         roofline_fraction=0.02 / peer, opt_flags=flags))
    rows.append(dict(base, T=64, impl="triton", kernel="mma_sm90", ms=0.8, roofline_ms=0.5, roofline_fraction=0.62))
    return rows


def test_versus_pairs_the_newest_rows_per_t():
    from dsv4lab.plots import moe as moe_plots
    v = {r["T"]: r for r in moe_plots.versus(_rows())}
    assert sorted(v) == [1, 8, 64]
    assert v[1]["ratio"] == pytest.approx(2.25) and v[8]["ratio"] == pytest.approx(0.79)
    assert v[8]["peer_tiles"] == "16x256x128 / 16x256x128" and v[8]["same_run"]
    assert v[64]["peer_us"] is None and v[64]["ratio"] is None and v[64]["kernel"] == "mma_sm90"
    assert moe_plots.versus([]) == []


def test_plot_versus_draws_rows_or_says_why_not():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from dsv4lab.plots import moe as moe_plots
    fig = moe_plots.plot_versus(_rows())
    left, right = fig.axes
    assert len(left.get_lines()) == 2 and len(right.patches) == 2       # family MXFP4, peer; 2 T
    no_peer = [r for r in _rows() if r["impl"] == "triton"]
    fig2 = moe_plots.plot_versus(no_peer)
    assert "no triton_kernels rows" in fig2.axes[1].texts[0].get_text()
    fig3 = moe_plots.plot_versus([])
    assert all("no recorded moe rows" in ax.texts[0].get_text() for ax in fig3.axes)
    assert moe_plots.plot_moe(_rows()) is not None
    plt.close("all")
