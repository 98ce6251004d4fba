"""mHC ops (dsv4lab.ops.mhc) and the fused kernels (kernels/mhc.py).

CPU (Triton interpreter, tiny shapes): the "triton" backend against the fp32 torch
reference over hypothesis shapes (one token and odd token counts, n = 1..4 incl. a
non-power of two, d not a multiple of the block, 1 and 20 Sinkhorn iterations, bf16 /
fp16 / fp32 streams, extra leading dims), the kernels' d-slicing and blocking directly,
backend selection (autograd, CPU), the model's modules, and every bad input.
GPU (@pytest.mark.gpu): the Flash shape (n=4, d=4096, T=64, 20 iterations) incl. a
CUDA-graph capture and replay with new inputs.
"""
import dsv4lab  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4lab import backends, bench
from dsv4lab.kernels import mhc as K
from dsv4lab.model import HCHead, HyperConnection
from dsv4lab.ops import mhc_head, mhc_post, mhc_pre
from dsv4lab.ops.mhc import sinkhorn

from _model_support import _no_tf32  # noqa: F401  (autouse fixture)

CUDA = torch.cuda.is_available()
gpu = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# Tolerances (triton vs the fp32 torch reference on the same inputs).
# fp32 results (post, comb, and y/streams when the streams are fp32): the kernel sums the
# squares in another order and, on the GPU, uses approximate exp/rsqrt (~2 ulp):
# rtol 1e-4 / atol 1e-5 (20 Sinkhorn iterations do not amplify: each is a contraction).
# Results stored in bf16 / fp16 (y, new streams) may round the other way: one ulp of
# the storage dtype (2^-7 relative for bf16, 2^-10 for fp16), plus a small atol.
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-5),
       torch.bfloat16: dict(rtol=1e-2, atol=1e-4),
       torch.float16: dict(rtol=2e-3, atol=1e-4)}
FP32 = TOL[torch.float32]


def _close(got, ref, dtype):
    torch.testing.assert_close(got.float(), ref.float(), **TOL[dtype])


def _params(n, d, gen, device="cpu", head=False):
    """Random (fn, base, scale) of a hyper-connection with varied, non-trivial mixes."""
    M = n if head else (2 + n) * n
    fn = torch.randn(M, n * d, generator=gen) * (2.0 / (n * d) ** 0.5)
    base = torch.randn(M, generator=gen)
    scale = torch.rand(3, generator=gen) + 0.5
    return fn.to(device), base.to(device), scale.to(device)


def _streams(lead, n, d, dtype, gen, device="cpu"):
    return (torch.randn(*lead, n, d, generator=gen) * 2).to(dtype).to(device)


# ------------------------------------------------------------------ CPU: the ops

@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(T=st.sampled_from([1, 2, 3, 5]), n=st.sampled_from([1, 2, 3, 4]),
       d=st.sampled_from([1, 7, 33, 70]), iters=st.sampled_from([1, 2, 20]),
       dtype=st.sampled_from(["fp32", "bf16", "fp16"]), seed=st.integers(0, 2 ** 16))
def test_pre_post_match_reference(T, n, d, iters, dtype, seed):
    dt = DTYPES[dtype]
    g = torch.Generator().manual_seed(seed)
    fn, base, scale = _params(n, d, g)
    x = _streams((T,), n, d, dt, g)
    out = _streams((T,), 1, d, dt, g)[:, 0]
    ry, rpost, rcomb = mhc_pre(x, fn, base, scale, iters=iters, backend="torch")
    gy, gpost, gcomb = mhc_pre(x, fn, base, scale, iters=iters, backend="triton")
    assert gy.dtype == dt and gy.shape == (T, d)
    assert gpost.dtype == torch.float32 and gcomb.shape == (T, n, n)
    _close(gy, ry, dt)
    torch.testing.assert_close(gpost, rpost, **FP32)
    torch.testing.assert_close(gcomb, rcomb, **FP32)
    # comb is doubly stochastic up to the Sinkhorn residual (columns exact after the last step)
    torch.testing.assert_close(gcomb.sum(-2), torch.ones(T, n), rtol=0, atol=1e-5)
    rs = mhc_post(out, x, rpost, rcomb, backend="torch")
    gs = mhc_post(out, x, rpost, rcomb, backend="triton")
    assert gs.dtype == dt and gs.shape == (T, n, d)
    _close(gs, rs, dt)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lead=st.sampled_from([(2, 1), (3, 2), (1, 1, 3)]), n=st.sampled_from([3, 4]),
       d=st.sampled_from([5, 24]), dtype=st.sampled_from(["fp32", "bf16"]),
       seed=st.integers(0, 2 ** 16))
def test_leading_dims_and_head(lead, n, d, dtype, seed):
    """[B, S, n, d] as the model passes them; the head reduction (pre weights only)."""
    dt = DTYPES[dtype]
    g = torch.Generator().manual_seed(seed)
    fn, base, scale = _params(n, d, g)
    x = _streams(lead, n, d, dt, g)
    ref = mhc_pre(x, fn, base, scale, iters=20, backend="torch")
    got = mhc_pre(x, fn, base, scale, iters=20, backend="triton")
    assert got[0].shape == (*lead, d) and got[1].shape == (*lead, n) and got[2].shape == (*lead, n, n)
    _close(got[0], ref[0], dt)
    torch.testing.assert_close(got[2], ref[2], **FP32)
    out = _streams(lead, 1, d, dt, g)[..., 0, :]
    _close(mhc_post(out, x, ref[1], ref[2], backend="triton"),
           mhc_post(out, x, ref[1], ref[2], backend="torch"), dt)
    hfn, hbase, _ = _params(n, d, g, head=True)
    hy = mhc_head(x, hfn, hbase, backend="triton")
    assert hy.shape == (*lead, d) and hy.dtype == dt
    _close(hy, mhc_head(x, hfn, hbase, backend="torch"), dt)


@pytest.mark.parametrize("block_d,split", [(16, 1), (16, 2), (16, 3), (32, 5)])
def test_kernel_blocks_and_slices(block_d, split):
    """d = 70 over 16/32-wide blocks (a partial last block), y split over 1-5 slices."""
    g = torch.Generator().manual_seed(block_d + split)
    T, n, d, iters, eps = 3, 3, 70, 20, 1e-6
    fn, base, scale = _params(n, d, g)
    x = _streams((T,), n, d, torch.bfloat16, g)
    mixes = x.reshape(T, n * d).float() @ fn.t()
    y, post, comb = K.mhc_pre(x, mixes, base, scale, iters, eps, block_d=block_d, split=split)
    ry, rpost, rcomb = mhc_pre(x, fn, base, scale, iters=iters, backend="torch")
    _close(y, ry, torch.bfloat16)
    torch.testing.assert_close(post, rpost, **FP32)
    torch.testing.assert_close(comb, rcomb, **FP32)
    out = _streams((T,), 1, d, torch.bfloat16, g)[:, 0]
    _close(K.mhc_post(out, x, post, comb, block_d=block_d),
           mhc_post(out, x, post, comb, backend="torch"), torch.bfloat16)


def test_launch_shape_comes_from_the_device():
    """d-slices per token from the SM count (every SM two programs), whole blocks per slice;
    BLOCK_D from n and d only; one portable route per op."""
    from dsv4lab.kernels.device import CAPABILITIES, DeviceProps
    for cap in CAPABILITIES:
        p = DeviceProps.nominal(cap)
        assert K.pre_launch(1, 4, 4096, p) == (512, 8, 1)           # 8 blocks of 512, one each
        block, split, per = K.pre_launch(64, 4, 4096, p)
        assert block == 512 and split * per >= 8 and (split - 1) * per < 8
        assert 64 * split <= 2 * p.sm_count + 64                     # ~two programs an SM
    few = DeviceProps((9, 0), 4, 232448, "four SMs")
    assert K.pre_launch(1, 4, 4096, few)[1] == 8 and K.pre_launch(64, 4, 4096, few)[1] == 1
    assert K.post_block(4, 4096) == 256 and K.post_block(3, 70) == 128
    assert set(K.TABLES) == {"mhc_pre", "mhc_post", "mhc_head"}
    assert all(t[-1].capabilities is None for t in K.TABLES.values())


def test_zero_tokens():
    g = torch.Generator().manual_seed(0)
    fn, base, scale = _params(4, 8, g)
    x = torch.zeros(0, 4, 8)
    y, post, comb = mhc_pre(x, fn, base, scale, iters=3, backend="triton")
    assert y.shape == (0, 8) and post.shape == (0, 4) and comb.shape == (0, 4, 4)
    assert mhc_post(torch.zeros(0, 8), x, post, comb, backend="triton").shape == (0, 4, 8)


def test_sinkhorn_reference_is_doubly_stochastic():
    g = torch.Generator().manual_seed(1)
    m = sinkhorn(torch.randn(5, 4, 4, generator=g), 20)
    torch.testing.assert_close(m.sum(-2), torch.ones(5, 4), rtol=0, atol=1e-6)
    torch.testing.assert_close(m.sum(-1), torch.ones(5, 4), rtol=0, atol=1e-4)
    assert (m > 0).all()


# ---------------------------------------------------------- selection, autograd

def test_auto_and_autograd():
    g = torch.Generator().manual_seed(2)
    fn, base, scale = _params(4, 8, g)
    x = _streams((2,), 4, 8, torch.float32, g)
    fn.requires_grad_(True)
    # auto with a gradient to compute: the differentiable torch reference
    y, post, comb = mhc_pre(x, fn, base, scale, iters=5)
    (y.sum() + post.sum() + comb.square().sum()).backward()
    assert fn.grad is not None and fn.grad.abs().sum() > 0
    with pytest.raises(backends.BackendUnavailable, match="no backward"):
        mhc_pre(x, fn, base, scale, iters=5, backend="triton")
    with torch.no_grad():      # no gradient needed: the kernel is allowed
        gy, _, _ = mhc_pre(x, fn, base, scale, iters=5, backend="triton")
    torch.testing.assert_close(gy, y.detach(), **FP32)
    with pytest.raises(backends.BackendUnavailable, match="unknown backend"):
        mhc_pre(x, fn, base, scale, iters=5, backend="cutlass")
    assert backends.resolve("mhc", "triton", target=backends.Target("cuda", (9, 0))).name == "triton"
    assert backends.resolve("mhc", "auto", target=backends.Target("cuda", (9, 0))).name == "triton"
    with pytest.raises(backends.BackendUnavailable, match="sm_80"):
        backends.resolve("mhc", "triton", target=backends.Target("cuda", (7, 5)))


def test_model_modules_use_the_op():
    """HyperConnection / HCHead keep their parameter names and give the reference's
    answer with either backend (the model's fp32 mixing, bf16 streams)."""
    torch.manual_seed(3)
    n, d = 4, 24
    hc, head = HyperConnection(n, d, 20), HCHead(n, d)
    assert sorted(k for k, _ in hc.named_parameters()) == ["base", "fn", "scale"]
    assert sorted(k for k, _ in head.named_parameters()) == ["base", "fn"]
    x = torch.randn(2, 1, n, d).to(torch.bfloat16)
    out = torch.randn(2, 1, d).to(torch.bfloat16)
    with torch.no_grad():
        ry, rp, rc = hc.pre(x, {"mhc": "torch"})
        gy, gp, gc = hc.pre(x, {"mhc": "triton"})
        _close(gy, ry, torch.bfloat16)
        torch.testing.assert_close(gc, rc, **FP32)
        _close(HyperConnection.post(out, x, rp, rc, {"mhc": "triton"}),
               HyperConnection.post(out, x, rp, rc, {"mhc": "torch"}), torch.bfloat16)
        _close(head(x, {"mhc": "triton"}), head(x, {"mhc": "torch"}), torch.bfloat16)
        # the default (no backends dict) still works
        _close(hc.pre(x)[0], ry, torch.bfloat16)


def test_engine_decode_with_triton_mhc(monkeypatch):
    """The whole decode path (blocks, final head, MTP draft) with the mHC kernels in the
    interpreter ("auto" switched to them on the CPU) gives the reference's tokens (every
    other op on its torch reference)."""
    import dsv4lab.ops.mhc as mhc_ops
    from dsv4lab.engine import Engine
    from dsv4lab.model import DSV4, tiny_config

    calls = []
    real = mhc_ops._Triton.post
    monkeypatch.setattr(mhc_ops._Triton, "post", staticmethod(lambda *a: calls.append(1) or real(*a)))
    torch.manual_seed(0)
    m = DSV4(tiny_config()).eval()
    be = {"sparse_mla_decode": "torch", "indexer_topk": "torch_fallback", "fused_moe": "torch"}
    prompts = [[5, 6, 7, 8, 9], [200, 100]]
    ref = Engine(m, max_batch=2, max_len=16, page_size=8, backends=be).generate(prompts, 2)
    assert not calls
    monkeypatch.setattr(mhc_ops, "AUTO_CPU_BACKEND", "triton")
    got = Engine(m, max_batch=2, max_len=16, page_size=8, backends=be).generate(prompts, 2)
    assert calls                                     # the kernels did run
    assert got.tokens == ref.tokens


# ---------------------------------------------------------------- bad inputs

def test_bad_inputs():
    g = torch.Generator().manual_seed(4)
    n, d = 4, 8
    fn, base, scale = _params(n, d, g)
    x = _streams((2,), n, d, torch.float32, g)
    ok = dict(iters=3)
    with pytest.raises(ValueError, match="x must be a torch.Tensor"):
        mhc_pre(x.tolist(), fn, base, scale, **ok)
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., n, d\]"):
        mhc_pre(x[0], fn, base, scale, **ok)
    with pytest.raises(ValueError, match="x must be float32"):
        mhc_pre(x.to(torch.int32), fn, base, scale, **ok)
    with pytest.raises(ValueError, match="x must have n >= 1"):
        mhc_pre(x[:, :, :0], fn[:, :0], base, scale, **ok)
    with pytest.raises(ValueError, match="fn must be"):
        mhc_pre(x, fn[:, :-1], base, scale, **ok)
    with pytest.raises(ValueError, match="fn must be"):
        mhc_pre(x[:, :3], fn, base, scale, **ok)          # n = 3 needs a [15, 24] fn
    with pytest.raises(ValueError, match="base must be"):
        mhc_pre(x, fn, base[:-1], scale, **ok)
    with pytest.raises(ValueError, match="scale must be"):
        mhc_pre(x, fn, base, scale[:2], **ok)
    with pytest.raises(ValueError, match="scale must be float32"):
        mhc_pre(x, fn, base, scale.to(torch.int64), **ok)
    for bad in (0, -1, 2.0, True, None):
        with pytest.raises(ValueError, match="iters must be"):
            mhc_pre(x, fn, base, scale, iters=bad)
    for bad in (0.0, -1e-6, "1e-6", True):
        with pytest.raises(ValueError, match="eps must be"):
            mhc_pre(x, fn, base, scale, iters=3, eps=bad)
    with pytest.raises(ValueError, match="backend must be a str"):
        mhc_pre(x, fn, base, scale, iters=3, backend=None)
    post, comb = torch.rand(2, n), torch.rand(2, n, n)
    out = torch.randn(2, d)
    with pytest.raises(ValueError, match="out must be"):
        mhc_post(out[:, :-1], x, post, comb)
    with pytest.raises(ValueError, match="out must be"):
        mhc_post(out[:1], x, post, comb)
    with pytest.raises(ValueError, match="post must be"):
        mhc_post(out, x, post[:, :3], comb)
    with pytest.raises(ValueError, match="comb must be"):
        mhc_post(out, x, post, comb[:, :, :3])
    with pytest.raises(ValueError, match="residual must be"):
        mhc_post(out, x[0], post, comb)
    with pytest.raises(ValueError, match="comb must be a torch.Tensor"):
        mhc_post(out, x, post, comb.numpy())
    with pytest.raises(ValueError, match="post must be float32"):
        mhc_post(out, x, post.to(torch.int32), comb)
    hfn, hbase, _ = _params(n, d, g, head=True)
    with pytest.raises(ValueError, match="fn must be"):
        mhc_head(x, fn, hbase)
    with pytest.raises(ValueError, match="base must be"):
        mhc_head(x, hfn, base)
    with pytest.raises(ValueError, match="eps must be"):
        mhc_head(x, hfn, hbase, eps=0)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_bad_devices_gpu():
    g = torch.Generator().manual_seed(5)
    fn, base, scale = _params(4, 8, g)
    x = _streams((2,), 4, 8, torch.float32, g).cuda()
    with pytest.raises(ValueError, match="one device"):
        mhc_pre(x, fn, base, scale, iters=3)


# ------------------------------------------------------------------ GPU: Flash

def _flash_case(T, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    n, d = 4, 4096
    hc = HyperConnection(n, d, 20)          # the model's init: comb near identity, pre = 1/3
    with torch.no_grad():
        hc.base.add_(0.5 * torch.randn(hc.base.shape, generator=g))
        hc.scale.uniform_(0.5, 1.5, generator=g)
    hc = hc.cuda().requires_grad_(False)
    x = _streams((T, 1), n, d, dtype, g, "cuda")
    out = _streams((T, 1), 1, d, dtype, g, "cuda")[..., 0, :]
    return hc, x, out


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("T", [1, 64, 77])
def test_flash_shape_gpu(T):
    hc, x, out = _flash_case(T, T)
    with torch.no_grad():
        ry, rp, rc = mhc_pre(x, hc.fn, hc.base, hc.scale, iters=20, backend="torch")
        gy, gp, gc = mhc_pre(x, hc.fn, hc.base, hc.scale, iters=20, backend="triton")
        _close(gy, ry, torch.bfloat16)
        torch.testing.assert_close(gp, rp, **FP32)
        torch.testing.assert_close(gc, rc, **FP32)
        _close(mhc_post(out, x, rp, rc, backend="triton"),
               mhc_post(out, x, rp, rc, backend="torch"), torch.bfloat16)
        hfn = torch.randn(4, 4 * 4096, device="cuda") * 0.01
        hb = torch.randn(4, device="cuda")
        _close(mhc_head(x, hfn, hb, backend="triton"), mhc_head(x, hfn, hb, backend="torch"),
               torch.bfloat16)
        assert backends.resolve("mhc", "auto", device=x.device).name == "triton"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_flash_shape_cuda_graph_gpu():
    """pre + post captured once; replays with new streams in the same buffers match the
    reference (fixed grid, no host sync, nothing allocated per call outside the graph)."""
    T = 64
    hc, x, out = _flash_case(T, 7)

    def step():
        y, post, comb = mhc_pre(x, hc.fn, hc.base, hc.scale, iters=20, backend="triton")
        return y, post, comb, mhc_post(out, x, post, comb, backend="triton")

    with torch.no_grad():
        graph, res = bench.capture_graph(step)
        for seed in (11, 12):
            g = torch.Generator().manual_seed(seed)
            x.copy_(_streams((T, 1), 4, 4096, torch.bfloat16, g, "cuda"))
            out.copy_(_streams((T, 1), 1, 4096, torch.bfloat16, g, "cuda")[..., 0, :])
            graph.replay()
            torch.cuda.synchronize()
            ry, rp, rc = mhc_pre(x, hc.fn, hc.base, hc.scale, iters=20, backend="torch")
            rs = mhc_post(out, x, rp, rc, backend="torch")
            _close(res[0], ry, torch.bfloat16)
            torch.testing.assert_close(res[1], rp, **FP32)
            torch.testing.assert_close(res[2], rc, **FP32)
            _close(res[3], rs, torch.bfloat16)


def test_bench_smoke(capsys):
    """``dsv4lab bench mhc --smoke``: tiny shapes, both backends, a printed table."""
    from dsv4lab import benchmarks
    rows = benchmarks.run("mhc", smoke=True, record=False)
    assert sorted((r["backend"], r["T"], r["mode"]) for r in rows) == sorted(
        (b, T, m) for b in ("torch", "triton") for T in (1, 3) for m in ("eager", "graph"))
    for r in rows:
        assert r["ms"] > 0 and r["bytes"] > 0 and r["flops"] > 0 and r["roofline_ms"] > 0
        assert r["op"] == "mhc_pre+post" and r["smoke"] is True
    out = capsys.readouterr().out
    assert "mhc (n=4" in out and "speedup" in out
