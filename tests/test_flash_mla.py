"""The FlashMLA backend (dsv4lab/ops/flash_mla.py).

On the CPU: the MODEL1 layout conversion, byte for byte and through a dequantisation written
here from the layout's description (never from the module's code) against
``unpack_kv_fp8``; the kept conversions; the adapter's conventions (index padding, lse, empty
rows, the sink) against a stand-in module that follows FlashMLA's documented call; the
registration. On a GPU where ``import flash_mla`` works (``-m gpu``): FlashMLA's kernel
against the fp32 reference, and inside CUDA graphs.

Tolerances: the stand-in computes in fp32 like the reference, so its bf16 output is held to
bf16's rounding (1e-2) and its lse to 1e-4; FlashMLA's kernel rounds P to bf16 before P V,
so it is held to the bf16 tolerance of tests/test_sparse_mla.py (2e-2, lse 1e-3).
"""
import dsv4lab  # noqa: F401  (sets TRITON_INTERPRET before anything imports triton)

import gc
import sys
import types

import pytest
import torch

from dsv4lab import backends as B
from dsv4lab.ops import flash_mla as fm
from dsv4lab.ops import sparse_mla_decode
from dsv4lab.quant import pack_kv_fp8, unpack_kv_fp8

H, D = 64, 512
SM90, SM100, SM103 = B.Target("cuda", (9, 0)), B.Target("cuda", (10, 0)), B.Target("cuda", (10, 3))
SM80, SM120 = B.Target("cuda", (8, 0)), B.Target("cuda", (12, 0))
CPU = B.Target("cpu", None, True)


def packed_cache(n, seed=0, *, wide=True):
    """uint8 [n, 584], some rows zero; ``wide``: rows of very different magnitudes (scale bytes
    from about 97 to 157), else unit-scale values."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(n, D, generator=g)
    if wide:
        kv = kv * 2.0 ** torch.randint(-30, 30, (n, 1), generator=g)
    kv[::7] = 0
    return pack_kv_fp8(kv)


def documented_stride(bs):
    """A block's stride: bs x 584 bytes rounded up to a multiple of 576."""
    return (bs * 584 + 575) // 576 * 576


def storage_bytes(t):
    """Every byte of ``t``'s storage, from its start, as uint8 [nbytes]."""
    return torch.as_strided(t, (t.untyped_storage().nbytes(),), (1,), 0)


def read_model1(kcache, bs):
    """Dequantise every slot of a MODEL1 cache from its raw bytes, as the layout is documented:
    block b at b x stride; token t's 448 e4m3 + 64 bf16 at t x 576 in it, its 7 ue8m0 scales
    (+1 pad) at bs x 576 + t x 8 -> (fp32 [blocks x bs, 512], value bytes, scale bytes)."""
    raw = storage_bytes(kcache)
    stride = kcache.stride(0)
    blocks = kcache.shape[0]
    vals, scales, rows = [], [], []
    for b in range(blocks):
        for t in range(bs):
            v = raw[b * stride + t * 576:b * stride + t * 576 + 576]
            s = raw[b * stride + bs * 576 + t * 8:b * stride + bs * 576 + t * 8 + 8]
            nope = v[:448].clone().view(torch.float8_e4m3fn).float()
            scale = torch.pow(2.0, s[:7].float() - 127).repeat_interleave(64)
            rope = v[448:].clone().view(torch.bfloat16).float()
            rows.append(torch.cat([nope * scale, rope]))
            vals.append(v)
            scales.append(s)
    return torch.stack(rows), torch.stack(vals), torch.stack(scales)


# ---- the layout --------------------------------------------------------------------------

@pytest.mark.parametrize("bs", [1, 3, 64, 256])
def test_block_stride_is_the_documented_one(bs):
    s = fm.block_stride(bs)
    assert s == documented_stride(bs) and s % 576 == 0 and bs * 584 <= s < bs * 584 + 576


@pytest.mark.parametrize("n,bs", [(1, 64), (63, 64), (64, 64), (65, 64), (130, 64), (7, 3),
                                  (9, 3), (5, 1), (20, 256)])
def test_model1_layout_byte_for_byte_and_round_trip(n, bs):
    kv = packed_cache(n, seed=n + bs)
    kc = fm.to_model1(kv, bs)
    blocks = -(-n // bs)
    stride = documented_stride(bs)
    assert kc.dtype == torch.uint8 and kc.shape == (blocks, bs, 1, 584)
    assert kc.stride() == (stride, 584, 584, 1)            # what FlashMLA checks: stride(1) == 584
    assert kc.untyped_storage().nbytes() == blocks * stride
    deq, vals, scales = read_model1(kc, bs)
    # byte for byte: each token's 576 value bytes and its 8 scale bytes, the rest zero
    assert torch.equal(vals[:n], kv[:, :576]) and torch.equal(scales[:n], kv[:, 576:])
    assert not vals[n:].any() and not scales[n:].any()
    raw = storage_bytes(kc).view(blocks, stride)
    assert not raw[:, bs * 584:].any()                      # the padding up to the stride
    # the round trip: the layout read back dequantises to exactly unpack_kv_fp8's values
    assert torch.equal(deq[:n], unpack_kv_fp8(kv))


def test_to_model1_refuses_what_is_not_the_fp8_cache():
    with pytest.raises(ValueError, match="kv must be the FP8 cache"):
        fm.to_model1(torch.zeros(4, 512, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="kv must be the FP8 cache"):
        fm.to_model1(torch.zeros(2, 4, 584, dtype=torch.uint8))
    with pytest.raises(ValueError, match="block_size"):
        fm.to_model1(torch.zeros(4, 584, dtype=torch.uint8), 0)


def test_indices_pass_unchanged_padded_and_made_safe():
    idx = torch.tensor([[[0, 5, -1, 9, 10, -7, 3]]], dtype=torch.int32)
    out = fm.model1_indices(idx, 10)
    assert out.dtype == torch.int32 and out.shape == (1, 1, 64)
    assert out[0, 0, :7].tolist() == [0, 5, -1, 9, -1, -1, 3]      # >= N and < -1: empty
    assert (out[0, 0, 7:] == -1).all()
    full = torch.randint(-1, 50, (2, 3, 128), dtype=torch.int32)
    assert torch.equal(fm.model1_indices(full, 50), full)           # a multiple of 64: as is


# ---- the kept conversion -----------------------------------------------------------------

def test_conversion_is_kept_per_live_unwritten_tensor():
    fm.clear_cache()
    kv = packed_cache(70)
    a = fm.converted(kv)
    assert fm.converted(kv) is a                                    # the same tensor: kept
    assert fm.converted(kv.view(7, 10, 584).reshape(-1, 584)) is a   # a view of it: the same bytes
    other = kv.clone()
    assert fm.converted(other) is not a                             # another tensor: its own
    kv[3] = pack_kv_fp8(torch.ones(1, D))[0]                        # written: converted again
    b = fm.converted(kv)
    assert b is not a and torch.equal(read_model1(b, fm.BLOCK_SIZE)[1][3], kv[3, :576])
    assert fm.converted(kv) is b
    n = len(fm._CONVERTED)
    del kv, a, b
    gc.collect()
    assert len(fm._CONVERTED) == n - 1                              # freed with its tensor
    fm.clear_cache()
    assert not fm._CONVERTED


# ---- the adapter, against a stand-in that follows FlashMLA's documented call ----------------

def _stand_in_call(q, k_cache, block_table, cache_seqlens, head_dim_v, meta, num_splits,
                   softmax_scale, causal, is_fp8_kvcache, indices=None, attn_sink=None, **kw):
    """flash_mla_with_kvcache's sparse FP8 decode as its docstring and tests/ref.py define it:
    q bf16 [b, s_q, h, 512]; k_cache [blocks, bs, 1, 584] with stride(1) 584; indices int32,
    topk a multiple of 64, -1 empty -> (out bf16 [b, s_q, h, 512] scaled by
    1 / (1 + exp(sink - lse)), 0 where no slot; lse [b, h, s_q] without the sink, +inf there)."""
    assert q.dtype == torch.bfloat16 and q.dim() == 4 and q.shape[-1] == 512 and q.is_contiguous()
    assert k_cache.dim() == 4 and k_cache.shape[2:] == (1, 584) and k_cache.stride(1) == 584
    assert block_table is None and cache_seqlens is None and num_splits is None
    assert head_dim_v == 512 and is_fp8_kvcache and not causal and not kw
    assert indices.dtype == torch.int32 and indices.shape[-1] % 64 == 0
    blocks, bs = k_cache.shape[:2]
    assert int(indices.min()) >= -1 and int(indices.max()) < blocks * bs
    meta.calls += 1
    kv = read_model1(k_cache, bs)[0]
    b, s_q, h, _ = q.shape
    valid = indices >= 0
    k = kv[indices.clamp(min=0).long()]                                  # [b, s, t, 512]
    s = torch.einsum("bshd,bstd->bsht", q.float(), k) * softmax_scale
    s = s.masked_fill(~valid[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)                                         # [b, s, h]
    out = torch.einsum("bsht,bstd->bshd", torch.exp(s - lse[..., None]).nan_to_num(0.0), k)
    if attn_sink is not None:
        out = out / (1 + torch.exp(attn_sink[None, None, :] - lse))[..., None]
    lonely = lse == float("-inf")
    out[lonely] = 0.0
    lse = lse.masked_fill(lonely, float("inf"))
    return out.to(torch.bfloat16), lse.transpose(1, 2)


@pytest.fixture
def stand_in(monkeypatch):
    """A ``flash_mla`` module with the documented call, in place of the real one."""
    mod = types.ModuleType("flash_mla")
    mod.get_mla_metadata = lambda *a, **k: (types.SimpleNamespace(calls=0), None)
    mod.flash_mla_with_kvcache = _stand_in_call
    monkeypatch.setitem(sys.modules, "flash_mla", mod)
    fm.clear_cache()
    yield mod
    fm.clear_cache()


@pytest.mark.parametrize("Bsz,S_q,topk,sink,empty", [
    (1, 1, 64, True, ()), (2, 2, 100, True, ((1, 0),)), (3, 1, 7, False, ((0, 0), (2, 0))),
    (1, 3, 130, False, ()), (2, 1, 1, True, ((1, 0),))])
def test_adapter_matches_the_reference_through_the_stand_in(stand_in, Bsz, S_q, topk, sink, empty):
    g = torch.Generator().manual_seed(topk)
    n = 150
    kv = packed_cache(n, seed=1, wide=False)
    q = torch.randn(Bsz, S_q, H, D, generator=g).to(torch.bfloat16)
    idx = torch.randint(-1, n, (Bsz, S_q, topk), generator=g, dtype=torch.int32)
    dup = torch.rand(Bsz, S_q, topk - 1, generator=g) < 0.2
    idx[..., 1:][dup] = idx[..., :1].expand(Bsz, S_q, topk - 1)[dup]     # duplicates count twice
    for b, s in empty:
        idx[b, s] = -1
    attn_sink = torch.randn(H, generator=g) if sink else None
    out, lse = fm.sparse_mla_decode_flash_mla(q, kv, idx, d_v=D, scale=D ** -0.5, sink=attn_sink,
                                              fp8=True)
    ref, ref_lse = sparse_mla_decode(q, kv, idx, attn_sink=attn_sink, backend="torch")
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    assert lse.shape == ref_lse.shape and lse.dtype == torch.float32 and lse.is_contiguous()
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=1e-2)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse))
    torch.testing.assert_close(lse[fin], ref_lse[fin], atol=1e-4, rtol=0)
    assert (lse[~fin] == float("-inf")).all()
    for b, s in empty:                       # no slot: out 0, lse the sink (or -inf)
        assert not out[b, s].float().any()
        want = attn_sink if sink else torch.full((H,), float("-inf"))
        assert torch.equal(lse[b, s], want.float())


def test_adapter_converts_once_and_reuses_the_metadata(stand_in):
    kv = packed_cache(100)
    q = torch.randn(1, 1, H, D).to(torch.bfloat16)
    idx = torch.randint(0, 100, (1, 1, 64), dtype=torch.int32)
    for _ in range(3):
        fm.sparse_mla_decode_flash_mla(q, kv, idx, d_v=D, scale=D ** -0.5, sink=None, fp8=True)
    assert len(fm._CONVERTED) == 1 and len(fm._METADATA) == 1
    assert next(iter(fm._METADATA.values())).calls == 3
    fm.sparse_mla_decode_flash_mla(torch.randn(2, 1, H, D).to(torch.bfloat16), kv,
                                   idx.expand(2, 1, 64).contiguous(), d_v=D, scale=1.0, sink=None,
                                   fp8=True)
    assert len(fm._CONVERTED) == 1 and len(fm._METADATA) == 2      # a new shape: new metadata


@pytest.mark.parametrize("what,kw,match", [
    ("heads", dict(q=torch.zeros(1, 1, 32, D, dtype=torch.bfloat16)), "64 heads"),
    ("dtype", dict(q=torch.zeros(1, 1, H, D, dtype=torch.float16)), "bf16 q"),
    ("d_v", dict(d_v=256), "d_v = 512"),
    ("dense", dict(fp8=False), "FP8 cache"),
])
def test_adapter_refuses_shapes_flash_mla_has_no_kernel_for(stand_in, what, kw, match):
    args = dict(q=torch.zeros(1, 1, H, D, dtype=torch.bfloat16),
                kv=torch.zeros(4, 584, dtype=torch.uint8),
                indices=torch.zeros(1, 1, 4, dtype=torch.int32), d_v=D, scale=1.0, sink=None,
                fp8=True)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        fm.sparse_mla_decode_flash_mla(args.pop("q"), args.pop("kv"), args.pop("indices"), **args)


# ---- registration and resolution ---------------------------------------------------------

def test_registered_as_an_external_backend_auto_never_takes():
    b = {x.name: x for x in B.backends("sparse_mla_decode")}["flash_mla"]
    assert b.kind == "external" and not b.auto and not b.interpreter
    assert b.formats == frozenset({"fp8"})
    assert (b.min_capability, b.max_capability) == ((9, 0), (10, 3))
    for t in (SM80, SM90, SM100, SM120, CPU):
        fmt_ok = [x for x in ("fp8", "dense")
                  if B._REGISTRY["sparse_mla_decode"]["mma"].unavailable_reason(t, x) is None]
        for fmt in fmt_ok:
            assert B.resolve("sparse_mla_decode", "auto", fmt=fmt, target=t).name != "flash_mla"


@pytest.mark.parametrize("target,desc", [(SM80, "sm_80"), (SM120, "sm_120"), (CPU, "CPU")])
def test_no_flash_mla_off_sm90_and_sm100(target, desc):
    with pytest.raises(B.BackendUnavailable) as err:
        B.resolve("sparse_mla_decode", "flash_mla", fmt="fp8", target=target)
    msg = str(err.value)
    assert "flash_mla" in msg and "sm_90" in msg and desc in msg


def test_needs_the_package_and_the_fp8_cache():
    b = B._REGISTRY["sparse_mla_decode"]["flash_mla"]
    assert "dense" in b.unavailable_reason(SM90, "dense")
    if not fm.available():
        for t in (SM90, SM100, SM103):
            assert "flash_mla" in b.unavailable_reason(t, "fp8")


def test_the_op_refuses_it_here_before_any_kernel():
    if torch.cuda.is_available() and fm.available():
        pytest.skip("FlashMLA is installed on this GPU")
    kv = pack_kv_fp8(torch.randn(16, D))
    q = torch.randn(1, 1, H, D).to(torch.bfloat16)
    with pytest.raises(B.BackendUnavailable, match="flash_mla"):
        sparse_mla_decode(q, kv, torch.zeros(1, 1, 8, dtype=torch.int32), backend="flash_mla")


# ---- FlashMLA's kernel on the GPU ----------------------------------------------------------

def _runs_here() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    cap = torch.cuda.get_device_capability()
    if not (9, 0) <= cap <= (10, 3):
        return f"FlashMLA's sparse FP8 decode needs sm_90 or sm_100, this is sm_{cap[0]}{cap[1]}"
    return None if fm.available() else "flash_mla does not import here"


def gpu_case(Bsz, S_q, topk, n, *, sink, empty=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    kv = pack_kv_fp8(torch.randn(n, D, generator=g)).cuda()
    q = torch.randn(Bsz, S_q, H, D, generator=g).to(torch.bfloat16).cuda()
    idx = torch.randint(0, n, (Bsz, S_q, topk), generator=g, dtype=torch.int32)
    idx[torch.rand(Bsz, S_q, topk, generator=g) < 0.1] = -1
    for b, s in empty:
        idx[b, s] = -1
    attn_sink = torch.randn(H, generator=g).cuda() if sink else None
    return q, kv, idx.cuda(), attn_sink


def assert_reference(q, kv, idx, sink, out, lse):
    ref, ref_lse = sparse_mla_decode(q, kv, idx, attn_sink=sink, backend="torch")
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse))
    torch.testing.assert_close(lse[fin], ref_lse[fin], atol=1e-3, rtol=0)
    assert (lse[~fin] == float("-inf")).all()


@pytest.mark.gpu
@pytest.mark.parametrize("Bsz,S_q,topk,n,sink,empty", [
    (1, 1, 640, 8192, True, ()), (64, 1, 640, 65536, True, ()), (3, 2, 100, 1000, False, ((2, 1),)),
    (2, 4, 2048, 16384, True, ((0, 3),)), (5, 1, 1, 50, True, ((4, 0),))])
def test_flash_mla_matches_the_reference(Bsz, S_q, topk, n, sink, empty):
    if _runs_here():
        pytest.skip(_runs_here())
    fm.clear_cache()
    q, kv, idx, attn_sink = gpu_case(Bsz, S_q, topk, n, sink=sink, empty=empty, seed=topk)
    out, lse = sparse_mla_decode(q, kv, idx, attn_sink=attn_sink, backend="flash_mla")
    assert_reference(q, kv, idx, attn_sink, out, lse)
    first = fm.converted(kv)
    sparse_mla_decode(q, kv, idx, attn_sink=attn_sink, backend="flash_mla")
    assert fm.converted(kv) is first                     # converted once
    for b, s in empty:
        assert not out[b, s].float().any()


@pytest.mark.gpu
def test_flash_mla_in_cuda_graphs():
    if _runs_here():
        pytest.skip(_runs_here())
    from dsv4lab import bench
    fm.clear_cache()
    q, kv, idx, sink = gpu_case(8, 2, 640, 20000, sink=True)
    eager = sparse_mla_decode(q, kv, idx, attn_sink=sink, backend="flash_mla")
    # FlashMLA's own call on inputs prepared outside the graph (what the benchmark replays)
    prep = fm.prepare(q, kv, idx)
    graph, (out, lse) = bench.capture_graph(lambda: fm.call(q, prep, sink, D ** -0.5))
    graph.replay()
    assert_reference(q, kv, idx, sink, out, fm.to_op_lse(lse, sink))
    torch.testing.assert_close(out.float(), eager[0].float(), atol=2e-2, rtol=2e-2)
    # the op captured whole converts the cache in the graph: a cache written between replays
    # is read as it is at each replay
    graph2, (out2, lse2) = bench.capture_graph(lambda: sparse_mla_decode(
        q, kv, idx, attn_sink=sink, backend="flash_mla", validate=False))
    kv.copy_(pack_kv_fp8(torch.randn(kv.shape[0], D, device=kv.device)))
    graph2.replay()
    assert_reference(q, kv, idx, sink, out2, lse2)


# ---- the benchmark's FlashMLA rows and their plots ----------------------------------------------

def test_the_benchmark_measures_flash_mla_at_the_fp8_headline_shapes_only_in_full_mode():
    from dsv4lab.benchmarks import sparse_mla as bench_mla
    full = bench_mla.plan(False)
    assert full["flash_mla"] == [(b, s) for b in (1, 8, 32, 64, 128) for s in (1, 2)]
    assert full["v32_flash_mla"] == [(64, 1), (128, 2)]
    head = bench_mla.plan(False, headline=True)
    assert set(head["flash_mla"]) >= set(head["grid"]) and head["v32_flash_mla"] == [(64, 1), (128, 2)]
    smoke = bench_mla.plan(True)
    assert smoke["flash_mla"] == [] and smoke["v32_flash_mla"] == []


def test_a_wrong_peer_is_caught_before_it_is_timed():
    from dsv4lab.benchmarks.sparse_mla import peer_mismatch
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(2, 1, 4, 8, generator=g)
    ref_lse = torch.randn(2, 1, 4, generator=g)
    ref_lse[1, 0, 2] = float("-inf")
    assert peer_mismatch(ref.to(torch.bfloat16), ref_lse.clone(), ref, ref_lse) is None
    bad = ref.clone()
    bad[0, 0, 1, 3] += 0.5
    assert "out off" in peer_mismatch(bad, ref_lse, ref, ref_lse)
    nan = ref.clone()
    nan[1, 0, 0, 0] = float("nan")
    assert "out off" in peer_mismatch(nan, ref_lse, ref, ref_lse)
    lse = ref_lse.clone()
    lse[1, 0, 2] = 0.0
    assert "finite" in peer_mismatch(ref, lse, ref, ref_lse)
    lse = ref_lse.clone()
    lse[0, 0, 0] += 0.01
    assert "lse off" in peer_mismatch(ref, lse, ref, ref_lse)
    assert "shapes" in peer_mismatch(ref[:1], ref_lse, ref, ref_lse)


def _row(backend, kv, B, S_q, us, mode="graph", **labels):
    return dict(op="sparse_mla_decode", backend=backend, kv=kv, B=B, S_q=S_q, topk=640, H=H, D=D,
                gpu="NVIDIA H200", capability="sm_90", date="2026-12-02T00:00:00+00:00",
                mode=mode, ms=us / 1e3, roofline_ms=0.0076, roofline_fraction=7.6 / us, **labels)


def test_plots_set_flash_mla_beside_the_fp8_kernel():
    import matplotlib
    matplotlib.use("Agg")
    from dsv4lab.plots import attention as attn_plots
    rows = [_row("mma", "bf16", 64, 1, 29.0, layer="csa"), _row("mma", "fp8", 64, 1, 34.0, layer="csa"),
            _row("flash_mla", "fp8", 64, 1, 44.2, layer="csa", peer_commit="abc"),
            _row("flash_mla", "fp8", 128, 2, 90.0, layer="csa", mode="eager")]
    table = {(r["point"], r["B"], r["S_q"]): r for r in attn_plots.compare_peers(rows)}
    got = table[("csa", 64, 1)]
    assert (got["bf16"], got["fp8"]) == pytest.approx((29.0, 34.0))
    assert got["flash_mla"] == pytest.approx(44.2) and got["flash_mla_over_fp8"] == pytest.approx(44.2 / 34)
    assert table[("csa", 128, 2)]["flash_mla"] is None           # an eager row is not a replay
    ax = attn_plots.plot_peers(rows, layer="csa", S_q=1)
    labels = [ln.get_label() for ln in ax.get_lines()]
    assert "FlashMLA (external), FP8 KV" in labels and "MMA (dispatch), FP8 KV" in labels
    ax = attn_plots.plot_peers(rows[:2], layer="csa", S_q=1)
    assert "FlashMLA: no rows recorded yet" in [ln.get_label() for ln in ax.get_lines()]
    assert attn_plots.plot_peers([], layer="csa", S_q=2) is not None   # a note, no error
