"""MXFP4 / NVFP4 quantisation: bit-exact unit tests (notebooks/04_mxfp4_moe_port.ipynb)."""
import dsv4lab  # noqa: F401  (sets TRITON_INTERPRET before anything imports triton)

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from dsv4lab.quant import mxfp4_dequantize, mxfp4_quantize, nvfp4_dequantize, nvfp4_quantize
from dsv4lab.quant.fp4 import E2M1_VALUES, e2m1_encode


def _block(vals, fill=0.0):
    """One 32-element block: ``vals`` then ``fill``."""
    v = list(vals) + [fill] * (32 - len(vals))
    return torch.tensor([v], dtype=torch.float32)


def _codes(packed):
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack((lo, hi), -1).flatten(-2)


def test_every_code_roundtrips_and_encodes_to_itself():
    vals = torch.tensor(list(E2M1_VALUES) + [-v for v in E2M1_VALUES])
    assert e2m1_encode(vals).tolist() == list(range(16))


def test_ties_round_to_even_code():
    # midpoints between neighbouring codes: the even code wins
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert e2m1_encode(mids).tolist() == [0, 2, 2, 4, 4, 6, 6]
    # just above / below a tie goes to the nearer value
    assert e2m1_encode(torch.tensor([0.2500001, 2.4999, 5.0001])).tolist() == [1, 4, 7]


def test_saturation_and_signs():
    c = e2m1_encode(torch.tensor([6.0, 7.0, 1e6, -6.0, -1e6]))
    assert c.tolist() == [7, 7, 7, 15, 15]


def test_negative_zero_keeps_its_sign():
    c = e2m1_encode(torch.tensor([-0.0, -0.1, 0.0, 0.1]))
    assert c.tolist() == [8, 8, 0, 0]
    packed, scales = mxfp4_quantize(_block([4.0, -0.0]))
    deq = mxfp4_dequantize(packed, scales)
    assert torch.signbit(deq[0, 1]) and deq[0, 1] == 0


def test_nibble_order_low_is_even_element():
    # scale 1 (amax 4 -> ocp exponent 0): element 0 = 1.0 (code 2), element 1 = -4 (code 14)
    packed, scales = mxfp4_quantize(_block([1.0, -4.0, 0.5, 6.0]))
    assert scales.tolist() == [[127]]
    assert packed[0, 0].item() == 2 | (14 << 4)
    assert packed[0, 1].item() == 1 | (7 << 4)


def test_all_zero_block():
    packed, scales = mxfp4_quantize(torch.zeros(2, 64))
    assert packed.eq(0).all() and scales.eq(0).all()
    assert mxfp4_dequantize(packed, scales).eq(0).all()
    p, s, g = nvfp4_quantize(torch.zeros(1, 32))
    assert p.eq(0).all() and s.float().eq(0).all() and g.item() == 1.0
    assert nvfp4_dequantize(p, s, g).eq(0).all()


def test_scale_rules_ocp_vs_ceil():
    # amax 7: ocp -> floor(log2 7) - 2 = 0 -> scale 1, 7 clips to 6;
    # ceil -> smallest 2^p with 7 / 2^p <= 6 -> p = 1, 7/2 = 3.5 ties to 4 -> 8
    x = _block([7.0, 1.0])
    p_o, s_o = mxfp4_quantize(x, scale_rule="ocp")
    p_c, s_c = mxfp4_quantize(x, scale_rule="ceil")
    assert s_o.item() == 127 and s_c.item() == 128
    assert mxfp4_dequantize(p_o, s_o)[0, :2].tolist() == [6.0, 1.0]
    assert mxfp4_dequantize(p_c, s_c)[0, :2].tolist() == [8.0, 1.0]
    # amax 6 exactly: both rules agree on scale 1 (ceil: 6/1 <= 6)
    assert mxfp4_quantize(_block([6.0]), scale_rule="ceil")[1].item() == 127
    assert mxfp4_quantize(_block([6.0]), scale_rule="ocp")[1].item() == 127
    # amax 4: ocp picks 2^0, ceil picks 2^0 too (4/1 <= 6, 4/0.5 = 8 > 6)
    assert mxfp4_quantize(_block([4.0]), scale_rule="ceil")[1].item() == 127


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from(["ocp", "ceil"]), st.floats(-20, 20))
def test_mx_roundtrip_matches_scalar_model(seed, rule, log_mag):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 64, generator=g) * (2.0 ** log_mag)
    packed, scales = mxfp4_quantize(x, scale_rule=rule)
    deq = mxfp4_dequantize(packed, scales)
    # independent scalar model: per block, the scale, then nearest E2M1 (ties: even code)
    xb = x.double().reshape(3, 2, 32)
    amax = xb.abs().amax(-1)
    for r in range(3):
        for b in range(2):
            a = amax[r, b].item()
            p = math.floor(math.log2(a)) - 2
            if rule == "ceil" and a / 2.0 ** p > 6:
                p += 1
            assert scales[r, b].item() == p + 127
            for i in range(32):
                xv = xb[r, b, i].item()
                v = min(abs(xv) / 2.0 ** p, 6.0)
                dists = [abs(v - q) for q in E2M1_VALUES]
                best = min(dists)
                ties = [c for c, dd in enumerate(dists) if dd == best]
                code = [c for c in ties if c % 2 == 0][0] if len(ties) > 1 else ties[0]
                want = E2M1_VALUES[code] * (-1.0 if xv < 0 else 1.0) * 2.0 ** p
                assert deq[r, b * 32 + i].item() == want
    if rule == "ceil":   # never clips: error <= half the top step (1 * scale), scale <= amax / 3
        assert (deq.double() - x.double()).abs().max() <= amax.max() / 3


def test_nvfp4_block_scales_and_global():
    x = torch.zeros(1, 32)
    x[0, 0] = 448.0 * 6      # tensor amax -> global = 1
    x[0, 16] = 3.0           # second block: scale 3/6 = 0.5 (exact in e4m3)
    x[0, 17] = -1.5          # -1.5 / 0.5 = -3 -> code 13
    p, s, g = nvfp4_quantize(x)
    assert g.item() == 1.0 and g.dim() == 0 and g.dtype == torch.float32
    assert s.dtype == torch.float8_e4m3fn and s.shape == (1, 2)
    assert s.float().tolist() == [[448.0, 0.5]]
    assert _codes(p)[0, 16].item() == 7 and _codes(p)[0, 17].item() == 13
    deq = nvfp4_dequantize(p, s, g)
    assert deq[0, 0].item() == 2688.0 and deq[0, 16].item() == 3.0 and deq[0, 17].item() == -1.5


def test_nvfp4_explicit_global_and_error():
    torch.manual_seed(0)
    x = torch.randn(4, 64)
    p, s, g = nvfp4_quantize(x, global_scale=0.01)
    assert g.item() == pytest.approx(0.01)
    deq = nvfp4_dequantize(p, s, g)
    # documented bound: half an E2M1 step at the top (1.0 of 6) times the block scale,
    # plus e4m3 scale rounding (2^-4 relative): <= amax16 * (1/6 + 1/16) per block
    amax16 = x.abs().reshape(4, 4, 16).amax(-1, keepdim=True)
    assert ((deq - x).abs().reshape(4, 4, 16) <= amax16 * (1 / 6 + 1 / 16) + 1e-6).all()
    p2, s2, g2 = nvfp4_quantize(x)
    assert g2.item() == pytest.approx(x.abs().max().item() / 2688, rel=1e-6)


def test_dtypes_accepted():
    x = torch.randn(2, 32)
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        p, s = mxfp4_quantize(x.to(dt))
        assert p.shape == (2, 16) and s.shape == (2, 1)
        assert mxfp4_dequantize(p, s, dtype=dt).dtype == dt


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_inf_rejected(bad):
    x = torch.zeros(1, 32)
    x[0, 3] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        mxfp4_quantize(x)
    with pytest.raises(ValueError, match="NaN or Inf"):
        nvfp4_quantize(x)


def test_bad_shapes_and_dtypes():
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4_quantize(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4_quantize(torch.zeros(2, 24))
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        mxfp4_quantize(torch.zeros(2, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="scale_rule"):
        mxfp4_quantize(torch.zeros(2, 32), scale_rule="round")
    p, s = mxfp4_quantize(torch.randn(2, 64))
    with pytest.raises(ValueError, match="scales must have shape"):
        mxfp4_dequantize(p, s[:, :1])
    with pytest.raises(ValueError, match="packed must be a uint8"):
        mxfp4_dequantize(p.to(torch.int16), s)
    with pytest.raises(ValueError, match="E8M0 NaN"):
        mxfp4_dequantize(p, torch.full_like(s, 255))
    pn, sn, g = nvfp4_quantize(torch.randn(2, 32))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        nvfp4_dequantize(pn, sn.float(), g)
    with pytest.raises(ValueError, match="global_scale"):
        nvfp4_dequantize(pn, sn, -1.0)
    with pytest.raises(ValueError, match="global_scale"):
        nvfp4_quantize(torch.randn(2, 32), global_scale=float("nan"))


def test_nvfp4_tiny_global_scale_refused():
    # a global scale under amax / (448 * 6) would push block scales past E4M3's 448, where they
    # saturate and the error grows without bound: refused, naming global_scale; at the smallest
    # allowed value (the default, rounded to fp32) the block scales stay in range
    torch.manual_seed(1)
    x = torch.randn(4, 64)
    amax = x.abs().max().item()
    with pytest.raises(ValueError, match=r"global_scale=.* is too small.*448"):
        nvfp4_quantize(x, global_scale=amax / 2688 / 10)
    with pytest.raises(ValueError, match="global_scale"):
        nvfp4_quantize(x, global_scale=torch.tensor(1e-30))
    for g in (amax / 2688, float(torch.tensor(amax / 2688, dtype=torch.float32))):
        p, s, g2 = nvfp4_quantize(x, global_scale=g)
        assert s.float().max().item() <= 448.0
        deq = nvfp4_dequantize(p, s, g2)
        amax16 = x.abs().reshape(4, 4, 16).amax(-1, keepdim=True)
        assert ((deq - x).abs().reshape(4, 4, 16) <= amax16 * (1 / 6 + 1 / 16) + 1e-6).all()


@pytest.mark.parametrize("mag", [1e38, 1e-38, 1e-45, 0.0])
def test_quantisers_never_write_a_nan_scale(mag):
    # the E8M0 byte 255 and the E4M3 bytes 0x7F / 0xFF are NaN: at the ends of fp32's range
    # (the largest finite values, subnormals, zero) no quantiser writes one, so what they make
    # always dequantises
    x = torch.full((2, 64), mag)
    x[0, ::3] = -mag
    for rule in ("ocp", "ceil"):
        p, s = mxfp4_quantize(x, scale_rule=rule)
        assert int(s.max()) <= 254
        assert torch.isfinite(mxfp4_dequantize(p, s)).all()
    p, s, g = nvfp4_quantize(x)
    assert not ((s.view(torch.uint8) & 0x7F) == 0x7F).any()
    assert torch.isfinite(nvfp4_dequantize(p, s, g)).all()
