"""The linear family (kernels/linear.py) and its op, dsv4lab.ops.linear.

CPU (Triton interpreter, tiny shapes): the small-M float kernel against the fp32 torch
reference over hypothesis shapes (one row, 1..8 rows and a few more, K and N not multiples
of the block, K = 1, N = 1, 3-D and strided x) in fp32 / bf16 / fp16; a row's result equal
bit for bit whatever the row count (what keeps speculative output identical to plain
decoding); the tile configuration per device; the "auto" rule per row count, weight format,
groups and target; every bad input. FP8 block-scaled weights: the kernel against the fp32
reference (1..8, 17, 64 and 70 rows, partial blocks, bf16 / fp16 / fp32 x, float32 / E8M0 /
uint8 scales, the raw-bytes and the e4m3 paths), split-K and its counters, groups, shaped
x, row independence, the tiles per device, the value checks once per weight. The model's
decode path going through the op (and its training path not), speculative == plain.
GPU (@pytest.mark.gpu): float weights at real sizes, row independence for M = 1..8, CUDA
graphs, the model's decode step on "auto"; FP8 weights at V4-Flash's projection shapes on
every route and both weight paths, odd sizes, row independence, CUDA graphs (both counter
paths), the value checks.
"""
import dsv4lab  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)

import copy
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4lab import backends, ops
from dsv4lab.kernels import linear as K
from dsv4lab.kernels.device import CAPABILITIES, DeviceProps
from dsv4lab.kernels.device import props as device_props
from dsv4lab.ops.linear import AUTO_MAX_WEIGHT, MAX_ROWS, dequantize, pick_backend

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
    assert K.TABLES["linear"][-1].capabilities is None


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
    assert pick_backend(1, weight_elems=MINI_W, fmt="fp8_block", target=H200).name == "triton"
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
    (lambda: ops.linear(torch.randn(()), torch.randn(4, 3)), "at least one dim"),
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

E8M0 = torch.float8_e8m0fnu
SPECIAL_BYTES = (0x00, 0x01, 0x07, 0x08, 0x81, 0x7E, 0xFE, 0x80)   # zeros, subnormals, +-448
H200_PROPS = DeviceProps.nominal((9, 0))        # plans as on the H200: the native e4m3 path


def _fp8_weight(n, k, gen, device="cpu"):
    """An e4m3 weight (every special byte in its first row), its power-of-two block scales
    as float32, E8M0 and uint8, and the fp32 weight they mean."""
    w8 = (torch.randn(n, k, generator=gen) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    if n and k:
        special = torch.tensor(SPECIAL_BYTES, dtype=torch.uint8)[:k]
        w8.view(torch.uint8)[0, :len(special)] = special
    exps = torch.randint(-6, 3, (-(-n // 128), -(-k // 128)), generator=gen)
    scales = {"fp32": torch.exp2(exps.float()), "e8m0": (exps + 127).to(torch.uint8).view(E8M0),
              "u8": (exps + 127).to(torch.uint8)}
    dense = w8.float() * scales["fp32"].repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return w8.to(device), {f: s.to(device) for f, s in scales.items()}, dense.to(device)


def _ref_fp8(x, dense, groups=1):
    """fp32 reference of a (grouped) FP8 linear, and the same sums over |x| |W|."""
    N, K = dense.shape
    xf = x.float().reshape(-1, groups, K)
    wg = dense.view(groups, N // groups, K)
    ref = torch.einsum("mgk,gnk->mgn", xf, wg).flatten(1)
    mag = torch.einsum("mgk,gnk->mgn", xf.abs(), wg.abs()).flatten(1)
    amax = xf.abs().amax(-1, keepdim=True)                               # [M, G, 1]
    wsum = wg.abs().sum(-1)                                             # [G, N/G]
    return ref, mag, (amax * wsum[None]).flatten(1)


def _check_fp8(y, x, dense, groups=1):
    """y within the documented tolerance of the fp32 reference x @ dense^T (per group).

    Both sums add at most A = K + ceil(K/128) + 33 rounded fp32 terms (the products, one
    per block scale, up to 32 split-K partials and the last); each is within A * 2^-23 of
    the exact sum of |x| |W| (2^-23: tensor cores may truncate, not round), so they differ
    by at most 2 * A * 2^-23 * (|x| @ |W|^T). bf16 x goes to fp16 scaled to its K block's
    largest value: exact within 2^29 of it, at most 2^-38 of it off below, so add
    2^-37 * max|x| * sum|W|. Then the store in x's dtype (OUT_ULP, OUT_ABS above)."""
    N, K = dense.shape
    dt = x.dtype
    assert y.dtype == dt and y.shape == (*x.shape[:-1], N)
    ref, mag, conv = _ref_fp8(x, dense, groups)
    adds = K + -(-K // 128) + 33
    acc = 2 * adds * 2.0 ** -23 * mag + (2.0 ** -37 * conv if dt == torch.bfloat16 else 0)
    bound = acc + OUT_ULP[dt] * (ref.abs() + acc) + OUT_ABS[dt]
    err = (y.float().reshape(ref.shape) - ref).abs()
    bad = err > bound
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} outside tolerance; worst excess "
                           f"{float((err - bound).max()):.3g}, {dt}, x {tuple(x.shape)}, W {tuple(dense.shape)}")


@pytest.mark.parametrize("m, n, k, dt, fmt", [
    (1, 130, 200, "bf16", "fp32"), (2, 64, 384, "bf16", "e8m0"), (3, 33, 129, "fp16", "u8"),
    (5, 256, 128, "fp32", "fp32"), (8, 70, 300, "bf16", "u8"), (7, 1, 1, "bf16", "fp32"),
    (17, 40, 140, "bf16", "e8m0"), (64, 48, 260, "fp16", "fp32"), (70, 130, 256, "bf16", "fp32"),
    (66, 40, 130, "fp32", "e8m0"),
])
@pytest.mark.parametrize("native", [False, True], ids=["bytes", "e4m3"])
def test_fp8_kernel_matches_reference_in_interpreter(m, n, k, dt, fmt, native):
    """The FP8 kernel against the fp32 reference: 1..8 rows, 17, 64 (decode tiles) and 70
    (prefill tiles); N and K not multiples of 128 (partial blocks); bf16 (x scaled to fp16),
    fp16 and fp32 x; float32, E8M0 and uint8 scales; the weight as raw bytes (GPUs before
    sm_89, the interpreter) and as e4m3 (sm_89+, planned as on the H200)."""
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w8, scales, dense = _fp8_weight(n, k, gen)
    x = (torch.randn(m, k, generator=gen) * 3).to(DTYPES[dt])
    if native:
        y = K.fp8_linear(x, w8, scales[fmt], props=H200_PROPS)
    else:
        y = ops.linear(x, w8, weight_scale=scales[fmt], backend="triton")
    _check_fp8(y, x, dense)
    assert y.float().abs().sum() > 0 or dense.abs().sum() == 0


def test_fp8_split_k_and_the_counters():
    """Split-K (several programs a column tile, the last one sums their partials in order)
    equals the unsplit launch, and leaves its counters zero for the next launch."""
    gen = torch.Generator().manual_seed(11)
    w8, scales, dense = _fp8_weight(64, 640, gen)
    x = torch.randn(3, 640, generator=gen).to(torch.bfloat16)
    cpu = DeviceProps.cpu()
    assert K.fp8_config(64, 640, 3, cpu)["SPLIT"] == 5                   # one tile, 5 K blocks
    assert K.fp8_config(64, 640, 3, DeviceProps.cpu(sm_count=1))["SPLIT"] == 3   # 2, 2, 1 blocks
    split = K.fp8_linear(x, w8, scales["fp32"], props=cpu)
    whole = K.fp8_linear(x, w8, scales["fp32"], props=DeviceProps.cpu(sm_count=0))
    _check_fp8(split, x, dense)
    assert K.fp8_config(64, 640, 3, DeviceProps.cpu(sm_count=0))["SPLIT"] == 1
    torch.testing.assert_close(split.float(), whole.float(), rtol=2 ** -7, atol=0)
    assert all(int(c.abs().sum()) == 0 for c in K._COUNTERS.values())


def test_fp8_grouped_and_shaped_x():
    """groups: the weight's row groups applied to x's column groups (wo_a); x with leading
    dims, 1-D, strided; empty inputs."""
    gen = torch.Generator().manual_seed(12)
    w8, scales, dense = _fp8_weight(64, 130, gen)
    x = torch.randn(2, 3, 4 * 130, generator=gen).to(torch.bfloat16)
    y = ops.linear(x, w8, weight_scale=scales["e8m0"], groups=4, backend="triton")
    assert y.shape == (2, 3, 64)
    _check_fp8(y, x, dense, groups=4)
    ref = ops.linear(x, w8, weight_scale=scales["e8m0"], groups=4, backend="torch")
    _check_fp8(ref, x, dense, groups=4)
    wide = torch.randn(5, 300, generator=gen).to(torch.bfloat16)
    xs = wide[:, 20:150]                                                 # row stride 300
    _check_fp8(ops.linear(xs, w8, weight_scale=scales["fp32"], backend="triton"), xs, dense)
    y1 = ops.linear(xs[0], w8, weight_scale=scales["fp32"], backend="triton")
    assert y1.shape == (64,)
    assert ops.linear(xs[:0], w8, weight_scale=scales["fp32"], backend="triton").shape == (0, 64)
    w0, s0, _ = _fp8_weight(5, 0, gen)
    assert torch.equal(ops.linear(torch.ones(2, 0), w0, weight_scale=s0["fp32"], backend="triton"),
                       torch.zeros(2, 5))


@settings(max_examples=8, deadline=None)
@given(m=st.integers(2, 8), n=st.integers(1, 70), k=st.integers(1, 300), seed=st.integers(0, 2 ** 16))
def test_fp8_row_result_independent_of_row_count_in_interpreter(m, n, k, seed):
    """1..16 rows share BLOCK_M and the split: each row's bits do not depend on the others."""
    gen = torch.Generator().manual_seed(seed)
    w8, scales, _ = _fp8_weight(n, k, gen)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    y = K.fp8_linear(x, w8, scales["fp32"])
    for i in range(m):
        assert torch.equal(y[i], K.fp8_linear(x[i:i + 1], w8, scales["fp32"])[0]), (i, m)


def test_fp8_torch_reference_and_scale_formats():
    """The reference dequantises (e4m3 * its block's scale) and multiplies in fp32; float32,
    E8M0 and uint8 scales mean the same weights."""
    gen = torch.Generator().manual_seed(13)
    w8, scales, dense = _fp8_weight(130, 200, gen)
    for fmt, s in scales.items():
        assert torch.equal(dequantize(w8, s), dense), fmt
    x = torch.randn(3, 200, generator=gen)
    want = x @ dense.t()
    for fmt, s in scales.items():
        torch.testing.assert_close(ops.linear(x, w8, weight_scale=s, backend="torch"), want,
                                   rtol=1e-6, atol=1e-5)


def test_fp8_config_per_device():
    """Tiles from the device's properties only, M only through BLOCK_M (1..16 rows share
    one config), BLOCK_N dividing the group, pipelines within shared memory, and at one row
    enough programs to cover the SMs wherever the weight's K blocks allow."""
    for cap in CAPABILITIES:
        p = DeviceProps.nominal(cap)
        for name, N, Kk, groups in K.V4_FP8_WEIGHTS:
            rpg = N // groups if groups > 1 else None
            one = K.fp8_config(N, Kk, 1, p, rpg)
            assert all(K.fp8_config(N, Kk, m, p, rpg) == one for m in (2, 5, 8, 16)), name
            assert K.fp8_config(N, Kk, 17, p, rpg)["BLOCK_M"] == 32
            assert (N // groups) % one["BLOCK_N"] == 0 and 128 % one["BLOCK_N"] == 0
            programs = -(-N // one["BLOCK_N"]) * one["SPLIT"]
            blocks = -(-Kk // 128)
            assert programs >= min(p.sm_count, -(-N // one["BLOCK_N"]) * blocks), (name, cap)
            assert (one["SPLIT"] - 1) * one["KB_PER_SPLIT"] < blocks <= one["SPLIT"] * one["KB_PER_SPLIT"]
            for rows in (1, 64, 256):
                c = K.fp8_config(N, Kk, rows, p, rpg)
                x_tile = 128 * c["BLOCK_M"] * 2
                assert (c["STAGES"] - 1) * (c["BLOCK_N"] * 128 + x_tile) + x_tile < p.smem_per_block
        assert K.fp8_config(4096, 4096, 256, p)["BLOCK_N"] == 128            # the prefill tiles
    assert set(K.TABLES) == {"linear", "linear_fp8"}
    assert all(t[-1].capabilities is None for t in K.TABLES.values())
    assert K.TABLES["linear_fp8"][0].applies(H200_PROPS, rows=64)
    assert not K.TABLES["linear_fp8"][0].applies(H200_PROPS, rows=65)


@pytest.mark.parametrize("rows, fmt, groups, target, grad, want", [
    (1, "fp8_block", 1, H200, False, "triton"), (8, "fp8_block", 1, H200, False, "triton"),
    (256, "fp8_block", 1, H200, False, "triton"), (4096, "fp8_block", 8, H200, False, "triton"),
    (1, "fp8_block", 1, RTX_PRO, False, "triton"), (1, "fp8_block", 1, TURING, False, "torch"),
    (1, "fp8_block", 1, INTERP, False, "torch"), (1, "fp8_block", 1, H200, True, "torch"),
    (1, "fp8_block", 64 * 1024 // 8, H200, False, "torch"),          # groups of 8 rows
    (1, "float", 2, H200, False, "torch"),
])
def test_fp8_auto_rule(rows, fmt, groups, target, grad, want):
    be = pick_backend(rows, weight_elems=64 * 1024 * 128, fmt=fmt, groups=groups,
                      weight_rows=64 * 1024, requires_grad=grad, target=target)
    assert be.name == want


def test_fp8_explicit_backends():
    assert pick_backend(1, "triton", fmt="fp8_block", target=INTERP).name == "triton"
    with pytest.raises(backends.BackendUnavailable, match="groups > 1 only with FP8"):
        pick_backend(1, "triton", groups=2, weight_rows=64, target=H200)
    with pytest.raises(backends.BackendUnavailable, match="multiple of 16"):
        pick_backend(1, "triton", fmt="fp8_block", groups=2, weight_rows=40, target=H200)
    with pytest.raises(backends.BackendUnavailable, match="sm_80"):
        pick_backend(1, "triton", fmt="fp8_block", target=TURING)


W8 = torch.zeros(200, 130).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("kw, match", [
    (dict(), "pass its weight_scale"),
    (dict(weight_scale=torch.ones(1, 1)), r"weight_scale must be \[ceil"),
    (dict(weight_scale=torch.ones(2, 2).double()), "weight_scale must be float32 or E8M0"),
    (dict(weight_scale=torch.ones(2, 2, dtype=torch.int32)), "weight_scale must be float32 or E8M0"),
    (dict(weight_scale=torch.ones(2, 2, device="meta")), "weight_scale must be on x's device"),
    (dict(weight_scale=[[1.0]]), "weight_scale must be a torch.Tensor"),
    (dict(weight_scale=torch.ones(2, 2), block=(128,)), r"block must be \(128, 128\)"),
    (dict(weight_scale=torch.ones(2, 2), block=(2, 3)), r"block must be \(128, 128\)"),
    (dict(weight_scale=torch.ones(2, 2), groups=3), "groups must be a positive int dividing"),
    (dict(weight_scale=torch.ones(2, 2), groups=True), "groups must be a positive int dividing"),
    (dict(weight_scale=torch.ones(2, 2), groups=2), "groups \\* K = 2 \\* 130 = 260"),
    (dict(weight_scale=torch.full((2, 2), 3.0)), "finite positive powers of two"),
    (dict(weight_scale=torch.tensor([[1.0, 0.5], [float("inf"), 2.0]])), "finite positive powers"),
    (dict(weight_scale=torch.tensor([[1.0, 0.0], [1.0, 2.0]])), "finite positive powers"),
    (dict(weight_scale=torch.tensor([[1.0, -0.5], [1.0, 2.0]])), "finite positive powers"),
    (dict(weight_scale=torch.tensor([[127, 255], [1, 2]], dtype=torch.uint8)), "255, the E8M0 NaN"),
    (dict(weight_scale=torch.tensor([[127, 255], [1, 2]], dtype=torch.uint8).view(E8M0)), "255"),
])
def test_fp8_bad_inputs(kw, match):
    """Each bad argument: a ValueError naming it, before any kernel (on every backend)."""
    for backend in ("torch", "triton"):
        with pytest.raises(ValueError, match=match):
            ops.linear(torch.randn(2, 130), W8, backend=backend, **kw)
    with pytest.raises(ValueError, match="goes with float8_e4m3fn"):
        ops.linear(torch.randn(2, 3), torch.randn(4, 3), weight_scale=torch.ones(1, 1))
    with pytest.raises(ValueError, match=r"block must be \(128, 128\)"):
        ops.linear(torch.randn(2, 3), torch.randn(4, 3), block=(2, 3))


def test_fp8_value_checks_once_per_weight(monkeypatch):
    """A NaN weight byte is refused; validate=False skips the value checks; a clean pair is
    not read again (no host sync), an in-place write (a new version) or another tensor in
    the same memory is checked afresh."""
    L = sys.modules["dsv4lab.ops.linear"]
    x = torch.randn(2, 130)
    bad = W8.clone()
    bad.view(torch.uint8)[3, 7] = 0xFF
    with pytest.raises(ValueError, match="e4m3 NaN"):
        ops.linear(x, bad, weight_scale=torch.ones(2, 2))
    ops.linear(x, bad, weight_scale=torch.ones(2, 2), validate=False)
    ops.linear(x, W8, weight_scale=torch.full((2, 2), 3.0), backend="torch", validate=False)
    w, s = W8.clone(), torch.ones(2, 2)
    ops.linear(x, w, weight_scale=s)
    reads = []
    real = torch.frexp
    monkeypatch.setattr(torch, "frexp", lambda t: reads.append(1) or real(t))
    ops.linear(x, w, weight_scale=s)
    assert reads == []                                      # seen clean: not read again
    s.mul_(3.0)                                             # in place: a new version
    with pytest.raises(ValueError, match="powers of two"):
        ops.linear(x, w, weight_scale=s)
    assert reads == [1]
    monkeypatch.setattr(L, "_key", lambda t: ("same memory",))   # reused memory, other tensors
    ops.linear(x, w, weight_scale=torch.ones(2, 2))
    with pytest.raises(ValueError, match="powers of two"):
        ops.linear(x, w.clone(), weight_scale=torch.full((2, 2), 3.0))


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


V4_ROWS = (1, 2, 3, 5, 8, 16, 33, 64, 65, 256)      # decode tiles (BLOCK_M 16, 64), prefill tiles


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("native", [True, False], ids=["e4m3", "bytes"])
@pytest.mark.parametrize("name, n, k, groups", K.V4_FP8_WEIGHTS, ids=[w[0] for w in K.V4_FP8_WEIGHTS])
def test_gpu_fp8_v4_shapes(name, n, k, groups, native):
    """Every route at V4-Flash's projection shapes (decode tiles at 1..64 rows, prefill tiles
    above; split-K where the tiles are few) against the fp32 reference, bf16 x, float32 and
    E8M0 scales: the GPU's own e4m3 path, and the bytes path of GPUs before sm_89 (planned
    as on an A100, run on this GPU)."""
    gen = torch.Generator().manual_seed(n + k)
    w8, scales, dense = _fp8_weight(n, k, gen, device="cuda")
    props = None if native else DeviceProps.nominal((8, 0))
    for m in V4_ROWS:
        x = (torch.randn(m, groups * k, generator=gen) * 2).to("cuda", torch.bfloat16)
        for fmt in ("fp32", "e8m0"):
            _check_fp8(K.fp8_linear(x, w8, scales[fmt], groups=groups, props=props), x, dense, groups)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("m, n, k", [(1, 130, 200), (3, 1000, 4095), (8, 33, 129), (64, 4096, 1000),
                                     (100, 1000, 2050)])
def test_gpu_fp8_odd_sizes(m, n, k, dt):
    """Partial blocks along N and K, x in fp32 / bf16 / fp16, through the op's "auto"."""
    gen = torch.Generator().manual_seed(m + n + k)
    w8, scales, dense = _fp8_weight(n, k, gen, device="cuda")
    x = torch.randn(m, k, generator=gen).to("cuda", DTYPES[dt])
    assert pick_backend(m, weight_elems=n * k, fmt="fp8_block", device="cuda").name == "triton"
    _check_fp8(ops.linear(x, w8, weight_scale=scales["u8"]), x, dense)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name, n, k, groups", [w for w in K.V4_FP8_WEIGHTS if w[0] in ("q_a", "kv", "wo_a", "q_b")])
def test_gpu_fp8_rows_independent_of_the_row_count(name, n, k, groups):
    """1..16 rows run one compiled kernel with one split: row i of a 16-row call equals the
    call on that row alone, bit for bit (plain and verify steps agree)."""
    gen = torch.Generator().manual_seed(7)
    w8, scales, _ = _fp8_weight(n, k, gen, device="cuda")
    x = torch.randn(16, groups * k, generator=gen).to("cuda", torch.bfloat16)
    y = ops.linear(x, w8, weight_scale=scales["fp32"], groups=groups)
    for m in (1, 2, 3, 8):
        assert torch.equal(ops.linear(x[:m], w8, weight_scale=scales["fp32"], groups=groups), y[:m])
    assert torch.equal(ops.linear(x[5:6], w8, weight_scale=scales["fp32"], groups=groups), y[5:6])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_fp8_cuda_graphs_and_counters():
    """Split-K launches captured in CUDA graphs: a first call inside a capture (fresh
    counters whose zeroing the graph captures), then after an eager call (counters of its
    own from the device's pool); replays match eager calls on new x; counters stay zero."""
    gen = torch.Generator().manual_seed(8)
    w8, scales, dense = _fp8_weight(512, 4096, gen, device="cuda")       # kv: split-K at one row
    x = torch.randn(2, 4096, generator=gen).to("cuda", torch.bfloat16)
    assert K.fp8_config(512, 4096, 2, device_props(x.device))["SPLIT"] > 1
    ops.linear(x, w8, weight_scale=scales["fp32"])                      # compile outside capture
    K._COUNTERS.clear()
    K._GRAPH_COUNTERS.clear()
    for first in (True, False):
        if not first:
            ops.linear(x, w8, weight_scale=scales["fp32"])              # makes the pool
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = ops.linear(x, w8, weight_scale=scales["fp32"])
        for _ in range(3):
            x.copy_(torch.randn(2, 4096, generator=gen).to("cuda", torch.bfloat16))
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(y, ops.linear(x, w8, weight_scale=scales["fp32"]))
            _check_fp8(y, x, dense)
    pool, used = K._GRAPH_COUNTERS[x.device.index or 0]
    assert used > 0 and int(pool.abs().sum()) == 0
    assert all(int(c.abs().sum()) == 0 for c in K._COUNTERS.values())


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_fp8_value_checks():
    w8 = torch.zeros(200, 130, device="cuda").to(torch.float8_e4m3fn)
    x = torch.randn(2, 130, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="powers of two"):
        ops.linear(x, w8, weight_scale=torch.full((2, 2), 3.0, device="cuda"))
    with pytest.raises(ValueError, match="255"):
        ops.linear(x, w8, weight_scale=torch.full((2, 2), 255, dtype=torch.uint8, device="cuda"))
    assert ops.linear(x, w8, weight_scale=torch.ones(2, 2, device="cuda")).abs().sum() == 0
