"""kernels/moe_scaled.py (the MXFP4 MoE on tl.dot_scaled) against the fp32 torch reference.

notebooks/04_mxfp4_moe_port.ipynb. CPU runs go through Triton's interpreter (tiny shapes);
the gpu-marked tests run DeepSeek-V4-Flash's full MoE shape (E=256, H=4096, I=2048, top-6).

Tolerances (max abs error relative to max |reference|):
- interpreter, x fp32: 3e-3. There x and the SwiGLU activations enter the dot as fp16
  (rel. 4.9e-4 each; the interpreter's bf16 dot is not trustworthy), the upcast weights are
  exact and the accumulation is fp32.
- interpreter, x bf16: 1.2e-2: the bf16 output rounding (rel. 3.9e-3) on top of the above.
- GPU: 1.5e-2. x and the activations enter the dot as bf16 (rel. 3.9e-3 each, errors of
  random sign that mostly cancel over K), the output is bf16 (rel. 3.9e-3).
"""
import dsv4lab  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)

import pytest
import torch
from hypothesis import given, settings, strategies as st

from dsv4lab.kernels import moe_scaled as kms
from dsv4lab.ops import fused_moe, route
from dsv4lab.quant import mxfp4_quantize

from _moe_support import draw_routing

TOL_INTERP = {torch.float32: 3e-3, torch.bfloat16: 1.2e-2}
TOL_GPU = 1.5e-2
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def quantised_experts(E, H, I, *, seed=0, device="cpu", scale=0.5):
    g = torch.Generator().manual_seed(seed)
    w13, s13 = mxfp4_quantize(torch.randn(E, 2 * I, H, generator=g) * scale)
    w2, s2 = mxfp4_quantize(torch.randn(E, H, I, generator=g) * scale)
    return dict(w13=w13.to(device), w13_scale=s13.to(device), w2=w2.to(device), w2_scale=s2.to(device))


def random_experts(E, H, I, *, seed=0, device="cpu", lo=118, hi=122):
    """Uniform packed bytes (every nibble code, -0 included) and E8M0 scales in [lo, hi)."""
    g = torch.Generator(device=device).manual_seed(seed)

    def rb(*shape, a=0, b=256):
        return torch.randint(a, b, shape, dtype=torch.uint8, device=device, generator=g)
    return dict(w13=rb(E, 2 * I, H // 2), w13_scale=rb(E, 2 * I, H // 32, a=lo, b=hi),
                w2=rb(E, H, I // 2), w2_scale=rb(E, H, I // 32, a=lo, b=hi))


def reference(x, ex, ids, w, limit):
    return fused_moe(x.float(), ex["w13"], ex["w13_scale"], ex["w2"], ex["w2_scale"], ids, w,
                     fmt="mxfp4", swiglu_limit=limit, backend="torch")


def scaled(x, ex, ids, w, limit, config=None):
    return kms.fused_moe_scaled(x, ex["w13"], ex["w13_scale"], ex["w2"], ex["w2_scale"], ids, w,
                                swiglu_limit=limit, config=config)


def assert_close(out, ref, tol):
    err = (out.float() - ref.float()).abs().max().item()
    mag = ref.float().abs().max().item()
    assert err <= tol * mag + 1e-5, f"max err {err} vs max |ref| {mag} (tol {tol})"


# ------------------------------------------------------------------ interpreter ----------
@settings(max_examples=16, deadline=None)
@given(T=st.sampled_from([1, 2, 3, 5, 7, 9, 17]), E=st.integers(1, 6), k=st.integers(1, 3),
       H=st.sampled_from([32, 64, 96]), I=st.sampled_from([32, 64, 96]),
       limit=st.sampled_from([None, 1.0, 10.0]),
       routing=st.sampled_from(["random", "skewed", "holes"]), seed=st.integers(0, 1000))
def test_scaled_matches_reference(T, E, k, H, I, limit, routing, seed):
    # sizes that are not multiples of the tiles (I = 96 vs BN 64, K = 96 steps of 32)
    k = min(k, E)
    ex = quantised_experts(E, H, I, seed=seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    ids, w = draw_routing(T, E, k, routing, g)
    out = scaled(x, ex, ids, w, limit)
    assert out.shape == (T, H) and out.dtype == x.dtype
    assert_close(out, reference(x, ex, ids, w, limit), TOL_INTERP[torch.float32])


# split-K of both projections (SPLIT1: fp32 gate/up partials + the SwiGLU pass), the K
# permutation on and off (PERMK), tile sizes not dividing the problem
TILES = [dict(BM=16, BN1=16, BN2=16, BK1=32, BK2=32, SPLIT1=4, SPLIT2=2),
         dict(BM=32, BN1=32, BN2=16, BK1=64, BK2=32, SPLIT1=2, SPLIT2=3, PERMK=False),
         dict(BM=16, BN1=64, BN2=32, BK1=32, BK2=64, SPLIT1=1, PERMK=False),
         dict(BM=64, BN1=128, BN2=128, BK1=128, BK2=128, num_warps=8, num_stages=3)]


@pytest.mark.parametrize("cfg", TILES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_scaled_tiles_random_bytes_wide_scales(cfg):
    # every nibble code and block scales 2**-15 .. 1 within a row; split-K of the down proj
    E, H, I, T, k = 3, 128, 96, 6, 2         # H/BK1 = 4 steps: SPLIT1 up to 4
    ex = random_experts(E, H, I, seed=1, lo=112, hi=128)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g)
    ids, w = draw_routing(T, E, k, "random", g)
    out = scaled(x, ex, ids, w, 10.0, cfg)
    assert_close(out, reference(x, ex, ids, w, 10.0), TOL_INTERP[torch.float32])


def test_scaled_bf16_input():
    # bf16 activations: would expose a bf16 dot in the interpreter (it loses ~1% there)
    ex = quantised_experts(4, 64, 32, seed=3)
    torch.manual_seed(3)
    x = torch.randn(5, 64).to(torch.bfloat16)
    ids, w = route(torch.randn(5, 4), None, topk=2)
    out = scaled(x, ex, ids, w, 10.0)
    assert out.dtype == torch.bfloat16
    assert_close(out, reference(x, ex, ids, w, 10.0), TOL_INTERP[torch.bfloat16])


def test_scaled_nibble_order_single_weight():
    # one nonzero weight at an odd K index: the high nibble of its byte is element 2i + 1
    E, H, I = 1, 32, 32
    ex = dict(w13=torch.zeros(E, 2 * I, H // 2, dtype=torch.uint8),
              w13_scale=torch.full((E, 2 * I, H // 32), 127, dtype=torch.uint8),
              w2=torch.zeros(E, H, I // 2, dtype=torch.uint8),
              w2_scale=torch.full((E, H, I // 32), 127, dtype=torch.uint8))
    ex["w13"][0, 0, 2] = 0x20           # gate row 0, K = 5 (high nibble of byte 2): 1.0
    ex["w13"][0, I, 2] = 0x02           # up row 0, K = 4 (low nibble of byte 2): 1.0
    ex["w2"][0, 3, 0] = 0x02            # out row 3 <- act column 0: 1.0
    x = torch.zeros(1, H)
    x[0, 5], x[0, 4] = 2.0, 3.0          # gate = 2, up = 3
    ids = torch.zeros(1, 1, dtype=torch.int32)
    out = scaled(x, ex, ids, torch.ones(1, 1), None)
    want = torch.zeros(1, H)
    want[0, 3] = torch.nn.functional.silu(torch.tensor(2.0)) * 3.0
    torch.testing.assert_close(out, want, rtol=1e-3, atol=1e-4)
    assert_close(out, reference(x, ex, ids, torch.ones(1, 1), None), TOL_INTERP[torch.float32])


def test_scaled_all_invalid_ids_int64_and_empty():
    ex = quantised_experts(2, 32, 32)
    x = torch.randn(3, 32)
    ids = torch.full((3, 2), -1, dtype=torch.int64)
    assert scaled(x, ex, ids, torch.ones(3, 2), None).eq(0).all()
    ids[0, 1] = 1
    out = scaled(x, ex, ids, torch.ones(3, 2), None)
    assert_close(out, reference(x, ex, ids, torch.ones(3, 2), None), TOL_INTERP[torch.float32])
    assert out[1:].eq(0).all()
    empty = scaled(x[:0], ex, ids[:0], torch.ones(0, 2), None)
    assert empty.shape == (0, 32)


def test_scaled_torch_align_path(monkeypatch):
    # the prefill grouping (torch ops) and the prefill tile row of CONFIGS
    from dsv4lab.kernels import moe_align
    monkeypatch.setattr(kms, "moe_align", moe_align.moe_align_torch)
    ex = quantised_experts(2, 64, 32, seed=5)
    torch.manual_seed(5)
    x = torch.randn(40, 64)
    ids, w = route(torch.randn(40, 2), None, topk=2)
    assert kms.config_for(40, 2, 2)["BM"] == 64
    out = scaled(x, ex, ids, w, 10.0)
    assert_close(out, reference(x, ex, ids, w, 10.0), TOL_INTERP[torch.float32])


def test_auto_split1():
    # ~4 programs an SM: T = 1 at the Flash shape (6 x 32 tiles) on 132 SMs -> 4 slices
    assert kms._auto_split1(6 * 32, 32, torch.device("cpu")) == 1          # 4 "SMs" on the CPU
    assert kms._auto_split1(1, 32, torch.device("cpu")) == 8
    assert kms._auto_split1(1, 2, torch.device("cpu")) == 2                 # K steps bound it
    assert kms.config_for(1, 6, 256)["SPLIT1"] == 0 and kms.config_for(4096, 6, 256)["SPLIT1"] == 1


def test_scaled_config_checks(monkeypatch):
    ex = quantised_experts(2, 32, 32)
    x = torch.randn(2, 32)
    ids = torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="unknown keys"):
        scaled(x, ex, ids, torch.ones(2, 1), None, dict(BLOCK=3))
    with pytest.raises(ValueError, match="BN1 must be a power of two >= 16"):
        scaled(x, ex, ids, torch.ones(2, 1), None, dict(BN1=8))
    monkeypatch.setattr(kms, "interpreting", lambda: False)   # CPU without the interpreter
    with pytest.raises(RuntimeError, match="CUDA GPU or in Triton's interpreter"):
        kms.check_capability(torch.device("cpu"))


def test_capability_check_refuses_old_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    with pytest.raises(RuntimeError, match=r"sm_80\+; this GPU is sm_75"):
        kms.check_capability(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    kms.check_capability(torch.device("cuda"))


# ------------------------------------------------------------------ GPU ----------------
def _flash_tokens(T, E, H, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    ids, w = route(torch.randn(T, E, device="cuda", generator=g),
                   torch.randn(E, device="cuda", generator=g) * 0.1, topk=6)
    ids[0, -1] = -1
    return x, ids, w


def _flash_case(T, seed):
    E, H, I = 256, 4096, 2048
    ex = random_experts(E, H, I, seed=seed, device="cuda")
    x, ids, w = _flash_tokens(T, E, H, seed)
    return x, ex, ids, w


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64])
def test_gpu_flash_shape(T):
    # DeepSeek-V4-Flash's MoE: 256 experts, hidden 4096, intermediate 2048, top-6
    x, ex, ids, w = _flash_case(T, seed=T)
    ref = reference(x, ex, ids, w, 10.0)
    out = scaled(x, ex, ids, w, 10.0)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert_close(out, ref, TOL_GPU)
    # the variants `dsv4lab bench moe_scaled` times, and the prefill tile row
    from dsv4lab.benchmarks.moe_scaled import VARIANTS
    for cfg in [c for _, c in VARIANTS] + [dict(FAST_MATH=True),
                                           dict(BN1=128, BN2=128, num_warps=8, num_stages=4),
                                           dict(BM=64, BN1=128, BN2=128, SPLIT1=1, num_warps=8,
                                                num_stages=3)]:
        assert_close(scaled(x, ex, ids, w, 10.0, cfg), ref, TOL_GPU)


@gpu
@pytest.mark.gpu
def test_gpu_cuda_graph_replay():
    # capture once, replay with new x and routing in the same buffers (no host sync inside)
    from dsv4lab.bench import capture_graph
    x, ex, ids, w = _flash_case(8, seed=3)
    graph, out = capture_graph(lambda: scaled(x, ex, ids, w, 10.0))
    x2, ids2, w2 = _flash_tokens(8, 256, 4096, seed=4)
    x.copy_(x2)
    ids.copy_(ids2)
    w.copy_(w2)
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, reference(x, ex, ids, w, 10.0), TOL_GPU)


@gpu
@pytest.mark.gpu
def test_gpu_fp32_input_and_wide_scales():
    # fp32 x (rounded to bf16 for the dot) and block scales 2**-15 .. 1 within a row
    E, H, I, T = 16, 4096, 2048, 5
    ex = random_experts(E, H, I, seed=9, device="cuda", lo=112, hi=128)
    g = torch.Generator(device="cuda").manual_seed(9)
    x = torch.randn(T, H, device="cuda", generator=g)
    ids, w = route(torch.randn(T, E, device="cuda", generator=g), None, topk=6)
    out = scaled(x, ex, ids, w, None)
    assert out.dtype == torch.float32
    assert_close(out, reference(x, ex, ids, w, None), TOL_GPU)
