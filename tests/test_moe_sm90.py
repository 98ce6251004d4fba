"""The MoE family's H200 fast paths, called directly: kernels/moe/gemv_sm90.py (the one-launch
T = 1 decode, GEMVs on the CUDA cores) and kernels/moe/mma_sm90.py (the grouped mma.sync
GEMMs), against the fp32 torch reference.

notebooks/04_mxfp4_moe_port.ipynb. Gluon does not run in Triton's interpreter, so the CPU tests
check the refusals and the host-side layouts; the gpu-marked ones run on sm_90, the only GPU
the dispatch sends these kernels to (tests/test_moe.py checks the dispatch itself).

Tolerance: as tests/test_moe.py (max abs error relative to max |reference|, bf16 x: 1.2e-2).
The GEMV decode sums the products in fp16 over a lane's 32-element block (x scaled per block
so that |x| 2**sx < 2**14: products below 6, sums below 192, relative rounding ~2**-11 a
step), then in fp32: well under the bf16 output's own rounding (3.9e-3).
"""
import dsv4lab  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from _moe_support import assert_close, draw_routing, make_experts, per_expert_globals, run_moe

sm90 = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                          reason="the Gluon fast paths run on the H200 (sm_90) only")


def x_pairs(x: torch.Tensor, slices: int):
    """The GEMV decode's x operand, by torch: x [K] -> (xq int32 [slices, 4, K / slices / 8],
    the fp16 pairs of each word in block_dot_asm's order, each 32-element block scaled by
    2**sx; cx fp32 [slices, K / 32 / slices]: 2**(14 - sx), what a block's fp32 sum owes)."""
    blk = x.float().reshape(-1, 32)
    amax = blk.abs().amax(1)
    sx = torch.where(amax > 0, 13 - torch.floor(torch.log2(amax.clamp_min(1e-30))), torch.zeros_like(amax))
    xs = (blk * torch.exp2(sx)[:, None]).to(torch.float16).reshape(-1, 8)   # words
    order = torch.tensor([[0, 2], [4, 6], [1, 3], [5, 7]])
    bits = xs[:, order].contiguous().view(torch.int32).reshape(-1, 4)       # [words, 4]
    xq = bits.t().reshape(4, slices, -1).permute(1, 0, 2).contiguous()
    cx = torch.exp2(14 - sx).reshape(slices, -1).contiguous()
    return xq, cx


# ---------------------------------------------------------------- CPU ----------------------
def test_launchers_refuse_sizes_they_cannot_take():
    from dsv4lab.kernels.moe import gemv_sm90, mma_sm90
    ex = make_experts(2, 64, 64, "mxfp4")
    args = (torch.randn(1, 64), ex["w13"], ex["w13_scale"], ex["w2"], ex["w2_scale"],
            torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1))
    with pytest.raises(ValueError, match="gemv_sm90: hidden and intermediate sizes must be multiples of 2048"):
        gemv_sm90.fused_decode(*args)
    with pytest.raises(ValueError, match="mma_sm90: hidden and intermediate sizes must be multiples of 512"):
        mma_sm90.fused_moe(*args)


@pytest.mark.parametrize("nv", [False, True])
def test_block_dot_asm_chains(nv):
    # a lane's 16-byte block: 4 words x 4 fp16x2 products; MXFP4 sums them in one fp16 chain
    # (its 32-element scale block), NVFP4 in two (words 0-1, 2-3: its two 16-element blocks)
    from dsv4lab.kernels.moe import gemv_sm90
    from dsv4lab.kernels.moe.gluon_shared import CVT8_PLACE
    asm = gemv_sm90.block_dot_asm(nv)
    lines = [ln.strip() for ln in asm.splitlines()]
    muls = [ln for ln in lines if ln.startswith("mul.rn.f16x2")]
    fmas = [ln for ln in lines if ln.startswith("fma.rn.f16x2")]
    assert len(muls) + len(fmas) == 16 and len(muls) == (2 if nv else 1)
    chains = {ln.split()[1].rstrip(",") for ln in muls + fmas}
    assert chains == ({"a0", "a1"} if nv else {"a0"})
    assert asm.count(CVT8_PLACE.strip().splitlines()[1]) == 4        # one placement a word
    assert f"mov.b32 $1, {'f1' if nv else '0'};" in asm


def test_x_pairs_layout():
    # word w's four fp16 pairs are its elements (0, 2), (4, 6), (1, 3), (5, 7), each 32-element
    # block scaled by 2**sx with |x| 2**sx in [2**13, 2**14), and cx = 2**(14 - sx)
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


# --------------------------------------------------------- the GEMV decode (GPU) ----------
_EXPERTS: dict = {}


def _experts(E, H, I, fmt):
    """Experts quantised on the GPU, one set kept for the module's other tests (they are large)."""
    key = (E, H, I, fmt)
    if key not in _EXPERTS:
        _EXPERTS.clear()
        _EXPERTS[key] = make_experts(E, H, I, fmt, seed=E * 7 + H + I, device="cuda", scale=0.02)
    return _EXPERTS[key]


def _case(E, H, I, T, k, fmt, routing, seed):
    ex = _experts(E, H, I, fmt)
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, H, generator=g) * 2).to(torch.bfloat16).cuda()
    ids, w = draw_routing(T, E, k, routing, g)
    return x, ex, ids.cuda(), w.cuda()


def _gemv(x, ex, ids, w, fmt, limit):
    from dsv4lab.kernels.moe import gemv_sm90
    return gemv_sm90.fused_decode(x, ex["w13"], ex["w13_scale"], ex["w2"], ex["w2_scale"], ids, w,
                                  fmt=fmt, swiglu_limit=limit, **per_expert_globals(ex, "cuda"))


def _ref(x, ex, ids, w, fmt, limit):
    return run_moe(x.float(), ex, ids, w, fmt, limit, "torch")


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("H,I", [(4096, 2048), (2048, 4096)])
@pytest.mark.parametrize("T,routing", [(1, "random"), (3, "holes"), (8, "skewed"), (2, "random")])
def test_gpu_gemv_against_reference(fmt, H, I, T, routing):
    # Flash's sizes (gate/up K in two slices, down in one) and the transposed pair, 8 experts,
    # top-6; -1 slots, every token on one expert, odd T; with and without the clamp; two
    # calls give the same bits (the slices and pairs are summed in a fixed order)
    x, ex, ids, w = _case(8, H, I, T, 6, fmt, routing, seed=T + H // 1024)
    for limit in (10.0, None):
        out = _gemv(x, ex, ids, w, fmt, limit)
        assert out.dtype == x.dtype and out.shape == x.shape
        assert_close(out, _ref(x, ex, ids, w, fmt, limit), torch.bfloat16)
        assert torch.equal(_gemv(x, ex, ids, w, fmt, limit), out)


@sm90
@pytest.mark.gpu
def test_gpu_gemv_x_pairs_kernel_bits():
    # the decode's x copy writes exactly x_pairs' words and factors, and zeroes the counters
    from dsv4lab.kernels.moe import gemv_sm90
    x = (torch.randn(3, 4096, device="cuda") * 50).to(torch.bfloat16)
    x[1, :64] = 0.0
    xq = torch.full((3, 4, 512), -1, dtype=torch.int32, device="cuda")
    xc = torch.full((3, 128), float("nan"), device="cuda")
    ctr = torch.full((37,), 7, dtype=torch.int32, device="cuda")
    gemv_sm90.x_pairs_kernel[(3, 4)](x, xq, xc, ctr, 37, 4096, x.stride(0), num_warps=1)
    torch.cuda.synchronize()
    assert (ctr == 0).all()
    for t in range(3):
        want_q, want_c = x_pairs(x[t].float(), 2)
        assert torch.equal(xq[t], want_q.permute(1, 0, 2).reshape(4, 512))
        assert torch.equal(xc[t], want_c.reshape(128))


@sm90
@pytest.mark.gpu
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(T=st.integers(1, 8), k=st.integers(1, 8), E=st.sampled_from([1, 3, 8]),
       H=st.sampled_from([2048, 4096]), I=st.sampled_from([2048, 4096]),
       fmt=st.sampled_from(["mxfp4", "nvfp4"]), routing=st.sampled_from(["random", "holes", "skewed"]),
       seed=st.integers(0, 2**16))
def test_gpu_gemv_hypothesis(T, k, E, H, I, fmt, routing, seed):
    k = min(k, E)
    x, ex, ids, w = _case(E, H, I, T, k, fmt, routing, seed)
    assert_close(_gemv(x, ex, ids, w, fmt, 10.0), _ref(x, ex, ids, w, fmt, 10.0), torch.bfloat16)


@sm90
@pytest.mark.gpu
def test_gpu_gemv_cuda_graph_capture():
    # no host sync: captured once, replayed on new inputs written into the same buffers (the
    # counters are zeroed by the launch's first kernel, every replay)
    x, ex, ids, w = _case(8, 4096, 2048, 1, 6, "mxfp4", "random", seed=9)
    _gemv(x, ex, ids, w, "mxfp4", 10.0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _gemv(x, ex, ids, w, "mxfp4", 10.0)
    for rep in range(2):
        x.copy_(torch.randn_like(x.float()).to(x.dtype))
        ids.copy_(torch.randperm(8, device="cuda")[:6].reshape(1, 6).int())
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, _ref(x, ex, ids, w, "mxfp4", 10.0), torch.bfloat16)


# ------------------------------------------------------- the mma.sync GEMMs (GPU) ----------
@sm90
@pytest.mark.gpu
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(T=st.integers(1, 40), E=st.integers(2, 12), k=st.integers(1, 6),
       H=st.sampled_from([512, 1024]), I=st.sampled_from([512, 1536]),
       fmt=st.sampled_from(["mxfp4", "nvfp4"]), limit=st.sampled_from([None, 10.0]),
       routing=st.sampled_from(["random", "skewed", "holes"]), seed=st.integers(0, 1000))
def test_gpu_mma_matches_reference(T, E, k, H, I, fmt, limit, routing, seed):
    # the grouped GEMMs over drawn shapes: tokens past one block of 8 (skewed: every token on
    # one expert), -1 slots, both formats, with and without the clamp; the same bits twice
    from dsv4lab.kernels.moe import mma_sm90
    k = min(k, E)
    ex = make_experts(E, H, I, fmt, seed=seed, device="cuda", scale=0.05)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).cuda().to(torch.bfloat16)
    ids, w = draw_routing(T, E, k, routing, g)
    ids, w = ids.cuda(), w.cuda()

    def run():
        return mma_sm90.fused_moe(x, ex["w13"], ex["w13_scale"], ex["w2"], ex["w2_scale"], ids, w,
                                  fmt=fmt, swiglu_limit=limit, **per_expert_globals(ex, "cuda"))
    out = run()
    assert out.shape == (T, H) and out.dtype == x.dtype
    assert_close(out, _ref(x, ex, ids, w, fmt, limit), torch.bfloat16)
    assert torch.equal(run(), out)
