"""The small-M linear (kernels/linear.py) and its op, dsv4lab.ops.linear.

CPU (Triton interpreter, tiny shapes): the kernel against the fp32 torch reference over
hypothesis shapes (one row, 1..8 rows and a few more, K and N not multiples of the block,
K = 1, N = 1, 3-D and strided x) in fp32 / bf16 / fp16; a row's result equal bit for bit
whatever the row count (what keeps speculative output identical to plain decoding); the
tile configuration per device; the "auto" rule per row count, weight format and target;
FP8 block-scaled weights (the torch path); every bad input; the model's decode path going
through the op (and its training path not), and speculative == plain with the kernel.
GPU (@pytest.mark.gpu): real sizes (128..4096, odd ones included), row independence for
M = 1..8, CUDA-graph capture and replay, the model's decode step on "auto".
"""
import dsv4lab  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)

import copy
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4lab import backends, ops
from dsv4lab.kernels import linear as K
from dsv4lab.kernels.device import CAPABILITIES, DeviceProps
from dsv4lab.ops.linear import AUTO_MAX_WEIGHT, MAX_ROWS, pick_backend

from _model_support import TORCH, _no_tf32, _one_thread  # noqa: F401  (autouse fixtures)

CUDA = torch.cuda.is_available()
CKPT = Path(__file__).resolve().parent.parent / "data" / "checkpoints" / "mini.safetensors"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
H200 = backends.Target("cuda", (9, 0))
RTX_PRO = backends.Target("cuda", (12, 0))
TURING = backends.Target("cuda", (7, 5))
INTERP = backends.Target("cpu", None, True)
PLAIN_CPU = backends.Target("cpu", None, False)

# Tolerance, kernel vs the fp32 torch reference ``x.float() @ w.float().T`` on the same
# (already rounded) inputs. Both sum K + 1 rounded fp32 terms in different orders: each is
# within gamma = (K + 1) * 2^-24 (first order) of the exact sum of |x| |w|, so they differ
# by at most 2 * gamma * (|x| @ |w|^T) (ACC below, with a 5% margin). The kernel then
# stores in x's dtype: fp32 nothing more; bf16 one ulp (2^-7 relative: the interpreter
# truncates fp32 -> bf16, the GPU rounds to nearest, half that); fp16 one ulp (2^-10),
# plus fp16's smallest subnormal step (2^-24) near zero.
OUT_ULP = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}
OUT_ABS = {torch.float32: 0.0, torch.bfloat16: 0.0, torch.float16: 2.0 ** -24}
ACC = 2.1 * 2.0 ** -24


def _check(y, x, w):
    """y (the kernel's x @ w^T) within the documented tolerance of the fp32 reference."""
    dt = x.dtype
    assert y.dtype == dt and y.shape == (*x.shape[:-1], w.shape[0])
    xf, wf = x.float().reshape(-1, x.shape[-1]), w.float()
    ref = xf @ wf.t()
    k = x.shape[-1]
    acc = ACC * (k + 1) * (xf.abs() @ wf.abs().t())
    bound = acc + OUT_ULP[dt] * (ref.abs() + acc) + OUT_ABS[dt]
    err = (y.float().reshape(ref.shape) - ref).abs()
    bad = err > bound
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} outside tolerance; worst excess "
                           f"{float((err - bound).max()):.3g}, {dt}, shape {tuple(x.shape)} @ {tuple(w.shape)}")


def _data(m, n, k, dtype, gen, device="cpu", scale=1.0):
    x = (torch.randn(m, k, generator=gen) * scale).to(device=device, dtype=dtype)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(device=device, dtype=dtype)
    return x, w


# ------------------------------------------------------------------ kernel vs reference

@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=st.integers(1, 8), n=st.integers(1, 40), k=st.integers(1, 150),
       dt=st.sampled_from(list(DTYPES)), seed=st.integers(0, 2 ** 16))
def test_kernel_matches_reference_in_interpreter(m, n, k, dt, seed):
    gen = torch.Generator().manual_seed(seed)
    x, w = _data(m, n, k, DTYPES[dt], gen)
    _check(ops.linear(x, w, backend="triton"), x, w)


@pytest.mark.parametrize("shape", [(1, 1, 1), (1, 37, 129), (8, 3, 16), (2, 64, 64)])
def test_kernel_edge_shapes(shape):
    """One row, one column, K = 1, exact multiples of the block."""
    m, n, k = shape
    x, w = _data(m, n, k, torch.float32, torch.Generator().manual_seed(1))
    _check(K.linear(x, w), x, w)


def test_more_rows_than_a_block_and_3d_strided_x():
    """Past 8 rows the kernel runs row blocks (correct, row-independent); x may be 3-D and
    strided (a slice of a wider tensor)."""
    gen = torch.Generator().manual_seed(2)
    x, w = _data(19, 21, 70, torch.float32, gen)
    y = ops.linear(x, w, backend="triton")
    _check(y, x, w)
    for i in (0, 8, 18):
        assert torch.equal(y[i], K.linear(x[i:i + 1], w)[0])
    wide = torch.randn(2, 3, 100, generator=gen)
    x3 = wide[..., 10:80]                         # [2, 3, 70], row stride 100
    y3 = ops.linear(x3, w, backend="triton")
    assert y3.shape == (2, 3, 21)
    _check(y3, x3, w)


def test_empty_inputs():
    w = torch.randn(5, 7)
    assert ops.linear(torch.randn(0, 7), w, backend="triton").shape == (0, 5)
    assert ops.linear(torch.randn(3, 7), torch.randn(0, 7), backend="triton").shape == (3, 0)
    y = ops.linear(torch.randn(3, 0), torch.randn(5, 0), backend="triton")
    assert y.shape == (3, 5) and torch.equal(y, torch.zeros(3, 5))


def test_bf16_in_interpreter_is_not_garbage():
    """bf16 operands are upcast before the math: a bf16 result must match the reference
    (tl.dot of bf16 tiles returns garbage in the interpreter; this kernel never uses it)."""
    x, w = _data(4, 24, 96, torch.bfloat16, torch.Generator().manual_seed(3))
    y = ops.linear(x, w, backend="triton")
    _check(y, x, w)
    assert y.float().abs().sum() > 0


# ----------------------------------------------------------------------- row independence

@settings(max_examples=12, deadline=None)
@given(m=st.integers(2, 8), n=st.integers(1, 33), k=st.integers(1, 140),
       dt=st.sampled_from(list(DTYPES)), seed=st.integers(0, 2 ** 16))
def test_row_result_independent_of_row_count_in_interpreter(m, n, k, dt, seed):
    x, w = _data(m, n, k, DTYPES[dt], torch.Generator().manual_seed(seed))
    y = ops.linear(x, w, backend="triton")
    for i in range(m):
        assert torch.equal(y[i], ops.linear(x[i:i + 1], w, backend="triton")[0]), (i, m)


def test_tile_config_depends_on_the_weight_and_the_device_only():
    """The tile config is a function of (N, K, device properties): no M anywhere; more SMs
    ask for narrower column blocks (more programs)."""
    import inspect
    assert list(inspect.signature(K.tile_config).parameters) == ["N", "K", "props"]
    cpu = DeviceProps.cpu()
    cfg = K.tile_config(128, 128, cpu)
    assert cfg["BLOCK_N"] * cfg["BLOCK_K"] <= K.ACC_ELEMS
    assert K.tile_config(7, 1, cpu)["BLOCK_K"] == 16
    for cap in CAPABILITIES:
        p = DeviceProps.nominal(cap)
        assert K.tile_config(4096, 4096, p)["BLOCK_N"] == 16          # 256 programs >= SMs
        assert K.tile_config(256, 128, p) == {"BLOCK_N": 4, "BLOCK_K": 128, "STAGES": 1}
        assert K.tile_config(128, 4096, p)["STAGES"] == 3             # a long K loop: pipelined
    assert set(K.TABLES) == {"linear"} and K.TABLES["linear"][-1].capabilities is None


# ------------------------------------------------------------------------- backend choice

MINI_W = 256 * 128            # the mini model's largest weight (the LM head)
FLASH_WQB = 64 * 512 * 1024   # a Flash-size projection (wq_b): bandwidth-bound, cuBLAS's


@pytest.mark.parametrize("rows, weight, target, want", [
    (1, MINI_W, H200, "triton"), (4, MINI_W, H200, "triton"), (8, MINI_W, H200, "triton"),
    (9, MINI_W, H200, "torch"), (64, MINI_W, H200, "torch"),
    (1, AUTO_MAX_WEIGHT, H200, "triton"), (1, AUTO_MAX_WEIGHT + 1, H200, "torch"),
    (1, FLASH_WQB, H200, "torch"), (64, FLASH_WQB, H200, "torch"),
    (1, MINI_W, RTX_PRO, "triton"), (9, MINI_W, RTX_PRO, "torch"),
    (1, MINI_W, TURING, "torch"),               # the kernel needs sm_80+: cuBLAS there
    (1, MINI_W, INTERP, "torch"), (4, MINI_W, INTERP, "torch"), (9, MINI_W, INTERP, "torch"),
    (1, MINI_W, PLAIN_CPU, "torch"),
])
def test_auto_rule(rows, weight, target, want):
    assert pick_backend(rows, weight_elems=weight, target=target).name == want


def test_explicit_backends_and_gradients():
    assert MAX_ROWS == K.BLOCK_M == 8
    assert pick_backend(1, weight_elems=MINI_W, fmt="fp8_block", target=H200).name == "torch"
    with pytest.raises(backends.BackendUnavailable, match="fp8_block"):
        pick_backend(1, "triton", fmt="fp8_block", target=H200)
    assert pick_backend(1, "triton", target=INTERP).name == "triton"
    assert pick_backend(100, "torch", target=H200).name == "torch"
    assert pick_backend(1, "auto", target=H200, requires_grad=True).name == "torch"
    with pytest.raises(backends.BackendUnavailable, match="no backward"):
        pick_backend(1, "triton", target=H200, requires_grad=True)
    with pytest.raises(backends.BackendUnavailable, match="sm_80"):
        pick_backend(1, "triton", target=TURING)
    with pytest.raises(backends.BackendUnavailable, match="the CPU"):
        pick_backend(1, "triton", target=PLAIN_CPU)
    with pytest.raises(backends.BackendUnavailable, match="unknown backend"):
        pick_backend(1, "cutlass", target=H200)
    # registered like every op: resolve/dispatch_table know it
    assert backends.resolve("linear", "auto", target=H200).name == "triton"
    assert {b.name for b in backends.backends("linear")} == {"torch", "triton"}
    # autograd: "auto" takes torch and the gradient flows
    x = torch.randn(2, 5, requires_grad=True)
    w = torch.randn(3, 5)
    ops.linear(x, w).sum().backward()
    torch.testing.assert_close(x.grad, w.sum(0).expand(2, 5))


@pytest.mark.parametrize("call, match", [
    (lambda: ops.linear([[1.0]], torch.randn(1, 1)), "x must be a torch.Tensor"),
    (lambda: ops.linear(torch.randn(2, 3), "w"), "weight must be a torch.Tensor"),
    (lambda: ops.linear(torch.ones(2, 3, dtype=torch.int32), torch.randn(4, 3)), "x must be float32"),
    (lambda: ops.linear(torch.randn(2, 3), torch.randn(12)), "weight must be 2-D"),
    (lambda: ops.linear(torch.randn(3), torch.randn(4, 3)), "x must be 2-D"),
    (lambda: ops.linear(torch.randn(1, 2, 2, 3), torch.randn(4, 3)), "x must be 2-D"),
    (lambda: ops.linear(torch.randn(2, 5), torch.randn(4, 3)), "K = 3"),
    (lambda: ops.linear(torch.randn(2, 3), torch.randn(4, 3).double()), "weight must have x's dtype"),
    (lambda: ops.linear(torch.randn(2, 3).half(), torch.randn(4, 3)), "weight must have x's dtype"),
    (lambda: ops.linear(torch.randn(2, 3), torch.randn(4, 3, device="meta")), "weight must be on x's device"),
    (lambda: ops.linear(torch.randn(2, 3), torch.randn(4, 3), backend=None), "backend must be a str"),
])
def test_bad_inputs(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---------------------------------------------------------------- FP8 block-scaled weights

def _fp8_weight(n, k, gen, block=(128, 128)):
    """An e4m3 weight and its power-of-two block scales, and the fp32 weight they mean."""
    w8 = (torch.randn(n, k, generator=gen) * 4).to(torch.float8_e4m3fn)
    exps = torch.randint(-4, 3, (-(-n // block[0]), -(-k // block[1])), generator=gen)
    scale = torch.exp2(exps.float())
    dense = w8.float() * scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return w8, scale, exps, dense


@pytest.mark.parametrize("dt", ["fp32", "bf16"])
@pytest.mark.parametrize("n,k,block", [(130, 200, (128, 128)), (5, 7, (2, 3)), (256, 128, (128, 128))])
def test_fp8_block_scaled_weight(dt, n, k, block):
    """y = x @ (w8 * scale)^T: the scales per block of (128 x 128 or another) weights,
    float32 or as E8M0 bytes (2^(s - 127)); the result in x's dtype, fp32 math."""
    gen = torch.Generator().manual_seed(n + k)
    w8, scale, exps, dense = _fp8_weight(n, k, gen, block)
    x = torch.randn(3, k, generator=gen).to(DTYPES[dt])
    want = (x.float() @ dense.t()).to(x.dtype)
    y = ops.linear(x, w8, weight_scale=scale, block=block)
    assert y.dtype == x.dtype and y.shape == (3, n)
    tol = dict(rtol=1e-5, atol=1e-4) if dt == "fp32" else dict(rtol=2 ** -7, atol=1e-3)
    torch.testing.assert_close(y.float(), want.float(), **tol)     # the summation order
    as_bytes = (exps + 127).to(torch.uint8)
    assert torch.equal(ops.linear(x, w8, weight_scale=as_bytes, block=block), y)
    with pytest.raises(backends.BackendUnavailable, match="fp8_block"):
        ops.linear(x, w8, weight_scale=scale, block=block, backend="triton")


@pytest.mark.parametrize("kw, match", [
    (dict(), "pass its weight_scale"),
    (dict(weight_scale=torch.ones(1, 1)), r"weight_scale must be \[ceil"),
    (dict(weight_scale=torch.ones(2, 2).double()), "weight_scale must be float32"),
    (dict(weight_scale=torch.ones(2, 2), block=(128,)), "block must be two positive ints"),
    (dict(weight_scale=torch.ones(2, 2), block=(0, 128)), "block must be two positive ints"),
    (dict(weight_scale=[[1.0]]), "weight_scale must be a torch.Tensor"),
])
def test_fp8_bad_inputs(kw, match):
    w8 = torch.zeros(200, 130).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=match):
        ops.linear(torch.randn(2, 130), w8, **kw)
    with pytest.raises(ValueError, match="goes with float8_e4m3fn"):
        ops.linear(torch.randn(2, 3), torch.randn(4, 3), weight_scale=torch.ones(1, 1))


# ------------------------------------------------------------------------------ the model

def _tiny_model():
    from dsv4lab.model import DSV4, tiny_config
    torch.manual_seed(0)
    return DSV4(tiny_config()).eval().quantize_experts("mxfp4")


def test_model_decode_path_uses_the_op_and_training_does_not(monkeypatch):
    """Every nn.Linear the decode step runs goes through ops.linear; forward_train runs
    none of them through it; triton and torch decode agree (fp32 tolerance)."""
    from dsv4lab.engine import Engine
    calls = []
    real = ops.linear

    def counting(x, weight, *, backend="auto", **kw):
        calls.append((tuple(x.shape), backend))
        return real(x, weight, backend=backend, **kw)

    monkeypatch.setattr(ops, "linear", counting)
    m = _tiny_model()
    with torch.no_grad():
        m.forward_train(torch.randint(0, 256, (1, 9)))
    assert calls == []
    prompts = [[1, 2, 3, 4, 5]]
    out = {}
    for name in ("torch", "triton"):
        calls.clear()
        eng = Engine(copy.deepcopy(m), max_batch=1, max_len=32, page_size=8,
                     backends=dict(TORCH, linear=name))
        out[name] = eng.generate(prompts, 3, num_draft=1)
        assert calls and all(b == name for _, b in calls)
    assert out["triton"].tokens == out["torch"].tokens


def test_speculative_equals_plain_with_the_kernel():
    """Plain steps (1 row) and verify steps (1 + k rows) both run the kernel."""
    from dsv4lab.engine import Engine
    eng = Engine(_tiny_model(), max_batch=1, max_len=32, page_size=8, backends=dict(TORCH, linear="triton"))
    prompts = [[7, 3, 9, 1, 200, 17]]
    plain = eng.generate(prompts, 5)
    assert eng.generate(prompts, 5, num_draft=2).tokens == plain.tokens


def test_engine_accepts_the_linear_key():
    from dsv4lab.engine import Engine
    from dsv4lab.model import OPS
    assert "linear" in OPS
    Engine(_tiny_model(), max_batch=1, max_len=16, page_size=8, backends=dict(TORCH, linear="auto"))


# -------------------------------------------------------------------------------- the GPU

SIZES = [128, 129, 256, 512, 1000, 1024, 4095, 4096]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("n, k", [(128, 128), (256, 64), (4, 128), (8, 128), (1024, 1024),
                                  (129280 // 32, 4096), (4096, 4096), (1000, 4095), (33, 129)])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
def test_gpu_real_sizes(m, n, k, dt):
    dtype = DTYPES[dt]
    x, w = _data(m, n, k, dtype, torch.Generator().manual_seed(m * 7 + k), device="cuda")
    y = ops.linear(x, w, backend="triton")
    _check(y, x, w)
    # row independence: every row equals the one-row call bit for bit
    for i in range(m):
        assert torch.equal(y[i], ops.linear(x[i:i + 1], w, backend="triton")[0]), (i, m, n, k, dt)
    # "auto" on the GPU: the kernel for a small weight, cuBLAS for a big one
    want = "triton" if n * k <= AUTO_MAX_WEIGHT else "torch"
    assert pick_backend(m, weight_elems=n * k, device="cuda").name == want
    if want == "triton":
        assert torch.equal(ops.linear(x, w), y)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@settings(max_examples=30, deadline=None)
@given(m=st.integers(1, 8), n=st.sampled_from(SIZES), k=st.sampled_from(SIZES),
       dt=st.sampled_from(list(DTYPES)), seed=st.integers(0, 2 ** 16))
def test_gpu_hypothesis_sizes(m, n, k, dt, seed):
    x, w = _data(8, n, k, DTYPES[dt], torch.Generator().manual_seed(seed), device="cuda")
    y8 = ops.linear(x, w, backend="triton")
    _check(y8, x, w)
    ym = ops.linear(x[:m], w, backend="triton")
    assert torch.equal(ym, y8[:m])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_cuda_graph_capture_and_replay():
    gen = torch.Generator().manual_seed(5)
    x, w = _data(3, 640, 128, torch.float32, gen, device="cuda")
    ops.linear(x, w)                             # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = ops.linear(x, w)
    x.copy_(torch.randn(3, 128, generator=gen).cuda())
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, ops.linear(x, w))
    _check(y, x, w)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.skipif(not CKPT.exists(), reason="no trained checkpoint in data/checkpoints")
def test_gpu_model_decode_auto_uses_the_kernel(monkeypatch):
    """On the GPU the decode step's projections (1..8 rows) run the kernel under "auto",
    and speculative output equals plain output at concurrency 1 (every step <= 8 rows),
    eager and in CUDA graphs."""
    from dsv4lab.engine import Engine
    from dsv4lab.model import load_checkpoint
    import dsv4lab.kernels.linear as KL
    launched = []
    real = KL.linear
    monkeypatch.setattr(KL, "linear", lambda x, w, out=None, **kw: launched.append(x.shape) or real(x, w, out, **kw))
    m = load_checkpoint(CKPT)
    be = {"sparse_mla_decode": "mma", "indexer_topk": "triton", "fused_moe": "triton"}
    prompts = ["def main(argv=None):\n    "]
    for graphs in (False, True):
        eng = Engine(copy.deepcopy(m), max_batch=1, max_len=160, cuda_graphs=graphs, backends=be)
        plain = eng.generate(prompts, 96)
        assert launched and max(s[0] for s in launched) <= MAX_ROWS
        for k in (1, 2, 3):
            spec = eng.generate(prompts, 96, num_draft=k)
            assert spec.graphs == graphs, spec.notes          # the kernel is capturable
            assert spec.tokens == plain.tokens, (k, graphs)
            assert spec.acceptance[0] > 0.2
