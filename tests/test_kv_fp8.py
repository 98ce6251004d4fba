"""The 584-byte FP8 KV layout: pack_kv_fp8 / unpack_kv_fp8 (dsv4lab/quant/kv_fp8.py)."""
import dsv4lab  # noqa: F401  (sets TRITON_INTERPRET before anything imports triton)

import pytest
import torch
from hypothesis import given, settings, strategies as st

from dsv4lab.quant import pack_kv_fp8, unpack_kv_fp8

# e4m3 keeps 3 mantissa bits: round-to-nearest error <= 2^-4 of the value for normals;
# values below the block's subnormal range (|x| < 2^-6 * scale) are off by at most
# half a subnormal step, 2^-10 * scale.
E4M3_REL = 2.0 ** -4
E4M3_SUB_ABS = 2.0 ** -10


def _scales(packed):
    return torch.ldexp(torch.ones(packed.shape[:-1] + (7,)), packed[..., 576:583].long() - 127)


def test_layout_bytes():
    torch.manual_seed(0)
    kv = torch.randn(6, 512) * 5
    p = pack_kv_fp8(kv)
    assert p.dtype == torch.uint8 and p.shape == (6, 584)
    assert (p[:, 583] == 0).all()
    # RoPE part: the bf16 bytes verbatim
    assert torch.equal(p[:, 448:576].contiguous().view(torch.bfloat16), kv[:, 448:].bfloat16())
    # nope part: e4m3 codes times the block's power-of-two scale
    codes = p[:, :448].contiguous().view(torch.float8_e4m3fn).float().view(6, 7, 64)
    s = _scales(p)
    amax = kv[:, :448].view(6, 7, 64).abs().amax(-1)
    assert (amax / s <= 448).all() and (amax / s > 224).all()   # smallest power of two that fits
    assert torch.equal(unpack_kv_fp8(p)[:, :448], (codes * s[..., None]).view(6, 448))


def test_exact_values_roundtrip():
    # values that e4m3 x power-of-two hold exactly come back exactly
    kv = torch.zeros(3, 512)
    kv[0, :448] = torch.tensor([1.0, -2.0, 0.5, 448.0, -0.125, 3.5, 0.0, 6.0]).repeat(56)
    kv[1, :64] = 2.0 ** -20
    kv[2, 448:] = torch.linspace(-3, 3, 64).bfloat16().float()
    assert torch.equal(unpack_kv_fp8(pack_kv_fp8(kv)), kv)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 5), log_mag=st.integers(-30, 30), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_roundtrip_error_bound(n, log_mag, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    mag = 2.0 ** log_mag
    if dtype == torch.float16:
        mag = min(mag, 2.0 ** 10)
    kv = (torch.randn(n, 2, 512, generator=g) * mag).to(dtype)
    p = pack_kv_fp8(kv)
    assert p.shape == (n, 2, 584)
    back = unpack_kv_fp8(p)
    x = kv.float()
    s = _scales(p).repeat_interleave(64, dim=-1)
    err = (back[..., :448] - x[..., :448]).abs()
    assert (err <= E4M3_REL * x[..., :448].abs() + E4M3_SUB_ABS * s).all()
    assert torch.equal(back[..., 448:], x[..., 448:].bfloat16().float())
    assert unpack_kv_fp8(p, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_zeros():
    p = pack_kv_fp8(torch.zeros(2, 512))
    assert torch.equal(unpack_kv_fp8(p), torch.zeros(2, 512))


@pytest.mark.parametrize("bad, match", [
    (torch.full((2, 512), float("nan")), "NaN"),
    (torch.full((2, 512), float("inf")), "NaN or Inf"),
    (torch.zeros(2, 576), "512"),
    (torch.zeros(2, 512, dtype=torch.int32), "bf16"),
    (torch.full((2, 512), 3.3e38), "above 2\\^127"),
])
def test_pack_bad_input(bad, match):
    with pytest.raises(ValueError, match=match):
        pack_kv_fp8(bad)


def test_unpack_bad_input():
    with pytest.raises(ValueError, match="uint8"):
        unpack_kv_fp8(torch.zeros(2, 584))
    with pytest.raises(ValueError, match="584"):
        unpack_kv_fp8(torch.zeros(2, 583, dtype=torch.uint8))
    p = pack_kv_fp8(torch.ones(1, 512))
    p[0, 577] = 255
    with pytest.raises(ValueError, match=r"packed has a scale byte of 255 \(ue8m0 NaN\)"):
        unpack_kv_fp8(p)


@pytest.mark.parametrize("magnitude", [2.0 ** 127, 1e30, 1.0, 1e-30, 1e-45, 0.0])
def test_pack_never_writes_the_nan_scale_byte(magnitude):
    """Scale bytes stay in 0..254 for any finite input, from fp32's largest values to its
    smallest subnormals and zero (255 is ue8m0's NaN); the round trip stays finite."""
    kv = torch.full((2, 512), magnitude)
    kv[1, ::2] = -magnitude
    p = pack_kv_fp8(kv)
    assert int(p[:, 576:583].max()) <= 254
    assert torch.isfinite(unpack_kv_fp8(p)).all()
