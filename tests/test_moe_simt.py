"""kernels/moe_simt.py: the one-launch T <= 8 MoE decode on the CUDA cores.

notebooks/04_mxfp4_moe_port.ipynb. Gluon does not run in Triton's interpreter, so the CPU tests
check the refusals and the host-side x layout; the gpu-marked ones check the kernel against the
fp32 torch reference at DeepSeek-V4-Flash's hidden / intermediate sizes (and the transposed
pair, whose K slices split the other way).

Tolerance: as tests/test_moe.py (max abs error relative to max |reference|, bf16 x: 1.2e-2).
The products are summed in fp16 over a lane's 32-element block (x scaled per block so that
|x| 2**sx < 2**14: products below 6, sums below 192, relative rounding ~2**-11 a step), then
in fp32: 7.1e-4 of max |reference| for the gate/up rows alone (scripts/probe_simt_gemv.py), under
the bf16 output's own rounding (3.9e-3).
"""
import dsv4lab  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from dsv4lab.ops import fused_moe
from _moe_support import draw_routing, per_expert_globals, quantised_experts
from test_moe import assert_close, make_experts

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


_EXPERTS: dict = {}


def _experts(E, H, I, fmt):
    """Random experts quantised on the GPU (the CPU quantiser takes ~10 s at these sizes),
    kept for the module's other tests."""
    key = (E, H, I, fmt)
    if key not in _EXPERTS:
        g = torch.Generator(device="cuda").manual_seed(E * 7 + H + I)
        w13 = torch.randn(E, 2 * I, H, device="cuda", generator=g) * 0.02
        w2 = torch.randn(E, H, I, device="cuda", generator=g) * 0.02
        _EXPERTS.clear()                   # one set at a time: they are large
        _EXPERTS[key] = quantised_experts(w13, w2, fmt)
    return _EXPERTS[key]


def _case(E, H, I, T, k, fmt, routing, seed):
    ex = _experts(E, H, I, fmt)
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, H, generator=g) * 2).to(torch.bfloat16).cuda()
    ids, w = draw_routing(T, E, k, routing, g)
    return x, ex, ids.cuda(), w.cuda()


def _simt(x, ex, ids, w, fmt, limit, **kw):
    from dsv4lab.kernels import moe_simt
    glob = per_expert_globals(ex, "cuda")
    return moe_simt.fused_decode(x, ex["w13"], ex["w13_scale"], ex["w2"], ex["w2_scale"], ids, w,
                                 fmt=fmt, swiglu_limit=limit, **glob, **kw)


def _ref(x, ex, ids, w, fmt, limit):
    return fused_moe(x.float(), ex["w13"], ex["w13_scale"], ex["w2"], ex["w2_scale"], ids, w,
                     fmt=fmt, swiglu_limit=limit, backend="torch", **ex["kw"])


def test_simt_refuses_where_it_cannot_run():
    # off a GPU (or in the interpreter) the reason is named before anything launches; the
    # table's entry (SIMT None) then takes the other path instead
    from dsv4lab.kernels import moe_simt
    x = torch.randn(1, 4096)
    why = moe_simt.supported(x, 4096, 2048, 1)
    assert why is not None and ("interpreter" in why or "CUDA" in why)
    ex = make_experts(2, 64, 64, "mxfp4")
    with pytest.raises(ValueError, match="moe_simt: "):
        moe_simt.fused_decode(torch.randn(1, 64), ex["w13"], ex["w13_scale"], ex["w2"],
                              ex["w2_scale"], torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1))


def test_simt_x_pairs_layout():
    # x_pairs (the probe's host copy of x): word w's four fp16 pairs are its elements (0, 2),
    # (4, 6), (1, 3), (5, 7), each 32-element block scaled by 2**sx with |x| 2**sx in
    # [2**13, 2**14), and cx = 2**(14 - sx)
    from dsv4lab.kernels.moe_simt import x_pairs
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 3
    x[32:64] = 0.0
    xq, cx = x_pairs(x, 2)
    assert xq.shape == (2, 4, 256) and cx.shape == (2, 64)
    halves = xq.permute(1, 0, 2).reshape(4, 512).contiguous().view(torch.float16).reshape(4, 512, 2)
    back = torch.empty(512, 8, dtype=torch.float16)
    for i, (a, b) in enumerate([(0, 2), (4, 6), (1, 3), (5, 7)]):
        back[:, a], back[:, b] = halves[i, :, 0], halves[i, :, 1]
    blocks = back.float().reshape(128, 32)
    amax = blocks.abs().amax(1)
    live = amax > 0
    assert ((amax[live] >= 2**13) & (amax[live] < 2**14)).all() and not live[1]
    got = blocks * cx.reshape(128, 1) * 2.0**-14
    assert torch.allclose(got, x.reshape(128, 32), rtol=2**-11, atol=0)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("H,I", [(4096, 2048), (2048, 4096)])
@pytest.mark.parametrize("T,routing", [(1, "random"), (3, "holes"), (8, "skewed"), (2, "random")])
def test_gpu_simt_against_reference(fmt, H, I, T, routing):
    # Flash's sizes (gate/up K in two slices, down in one) and the transposed pair (one and
    # two), 8 experts, top-6; -1 slots, every token on one expert, odd T
    x, ex, ids, w = _case(8, H, I, T, 6, fmt, routing, seed=T + H // 1024)
    for limit in (10.0, None):
        out = _simt(x, ex, ids, w, fmt, limit)
        assert out.dtype == x.dtype and out.shape == x.shape
        assert_close(out, _ref(x, ex, ids, w, fmt, limit), torch.bfloat16)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_gpu_simt_launch_keys_and_repeatability(fmt):
    # other tiles, rows a warp, warps, pair decodes and fp16 chains compute the same function;
    # one launch gives the same bits every call (fixed summation order)
    x, ex, ids, w = _case(8, 4096, 2048, 2, 6, fmt, "holes", seed=5)
    ref = _ref(x, ex, ids, w, fmt, 10.0)
    base = _simt(x, ex, ids, w, fmt, 10.0)
    assert torch.equal(base, _simt(x, ex, ids, w, fmt, 10.0))
    for kw in (dict(BN1=32, BN2=32), dict(BN1=32, BN2=128, RB=1), dict(RB=4),
               dict(num_warps=8, BN1=64, BN2=64), dict(dec="cvt"), dict(chains=2),
               dict(PDL=False)):
        assert_close(_simt(x, ex, ids, w, fmt, 10.0, **kw), ref, torch.bfloat16)


@gpu
@pytest.mark.gpu
def test_gpu_simt_x_pairs_kernel_bits():
    # the decode's x copy writes exactly x_pairs' words and factors, and zeroes the counters
    from dsv4lab.kernels import moe_simt
    x = (torch.randn(3, 4096, device="cuda") * 50).to(torch.bfloat16)
    x[1, :64] = 0.0
    xq = torch.full((3, 4, 512), -1, dtype=torch.int32, device="cuda")
    xc = torch.full((3, 128), float("nan"), device="cuda")
    ctr = torch.full((37,), 7, dtype=torch.int32, device="cuda")
    moe_simt._x_pairs_kernel[(3, 2)](x, xq, xc, ctr, 37, 4096, x.stride(0), PDL=False, num_warps=2)
    assert (ctr == 0).all()
    for t in range(3):
        want_q, want_c = moe_simt.x_pairs(x[t].float(), 2)
        assert torch.equal(xq[t], want_q.permute(1, 0, 2).reshape(4, 512))
        assert torch.equal(xc[t], want_c.reshape(128))


@gpu
@pytest.mark.gpu
def test_gpu_simt_refusals_and_table_fallback():
    from dsv4lab.kernels import moe_mma2, moe_simt
    x, ex, ids, w = _case(4, 4096, 2048, 1, 2, "mxfp4", "random", seed=1)
    args = (ex["w13"], ex["w13_scale"], ex["w2"], ex["w2_scale"], ids, w)
    with pytest.raises(ValueError, match="BN1 must be a power of two, a multiple of 32"):
        moe_simt.fused_decode(x, *args, BN1=48)
    with pytest.raises(ValueError, match="XW must be a power of two with H .4096. a multiple of 1024 XW"):
        moe_simt.fused_decode(x, *args, XW=8)
    with pytest.raises(ValueError, match="dec must be one of"):
        moe_simt.fused_decode(x, *args, dec="lut")
    assert "multiples of 2048" in moe_simt.supported(x, 4096, 1536, 1)
    assert "1 to 8 tokens" in moe_simt.supported(x, 4096, 2048, 9)
    with pytest.raises(ValueError, match="SIMT is a one-launch decode"):
        moe_mma2.fused_moe(x, *args, fmt="mxfp4", SIMT=True)
    # SIMT None at sizes it cannot take: the register-ring decode instead, same function
    ex2 = _experts(4, 4096, 1536, "mxfp4")
    args2 = (ex2["w13"], ex2["w13_scale"], ex2["w2"], ex2["w2_scale"], ids, w)
    out = moe_mma2.fused_moe(x, *args2, fmt="mxfp4", FUSED=True, REGS=None, SIMT=None,
                             BN1=32, BN2=32, SPLIT1=2, SPLIT2=1, num_warps=2)
    assert_close(out, _ref(x, ex2, ids, w, "mxfp4", None), torch.bfloat16)


@gpu
@pytest.mark.gpu
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(T=st.integers(1, 8), k=st.integers(1, 8), E=st.sampled_from([1, 3, 8]),
       H=st.sampled_from([2048, 4096]), I=st.sampled_from([2048, 4096]),
       fmt=st.sampled_from(["mxfp4", "nvfp4"]), routing=st.sampled_from(["random", "holes", "skewed"]),
       seed=st.integers(0, 2**16))
def test_gpu_simt_hypothesis(T, k, E, H, I, fmt, routing, seed):
    k = min(k, E)
    x, ex, ids, w = _case(E, H, I, T, k, fmt, routing, seed)
    assert_close(_simt(x, ex, ids, w, fmt, 10.0), _ref(x, ex, ids, w, fmt, 10.0), torch.bfloat16)


@gpu
@pytest.mark.gpu
def test_gpu_simt_cuda_graph_capture():
    # no host sync: captured once, replayed on new inputs written into the same buffers
    x, ex, ids, w = _case(8, 4096, 2048, 1, 6, "mxfp4", "random", seed=9)
    graph = torch.cuda.CUDAGraph()
    _simt(x, ex, ids, w, "mxfp4", 10.0)
    with torch.cuda.graph(graph):
        out = _simt(x, ex, ids, w, "mxfp4", 10.0)
    x.copy_(torch.randn_like(x.float()).to(x.dtype))
    ids.copy_(torch.randperm(8, device="cuda")[:6].reshape(1, 6).int())
    graph.replay()
    assert_close(out, _ref(x, ex, ids, w, "mxfp4", 10.0), torch.bfloat16)
