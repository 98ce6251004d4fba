"""dsv4lab.roofline: the device table and the roofline arithmetic."""
import math

import pytest
from hypothesis import given, settings, strategies as st

from dsv4lab import roofline, runtime
from dsv4lab.roofline import DEVICES, DeviceSpec


def test_h200_is_the_measured_one():
    h = DEVICES["H200"]
    assert h.bandwidth == 4.24e12 and h.bf16_flops == 713e12 and h.capability == (9, 0)
    assert "measured" in h.source


@pytest.mark.parametrize("name", list(DEVICES))
def test_every_device_has_sane_figures_and_a_source(name):
    d = DEVICES[name]
    assert d.source and len(d.source) > 20
    assert 1e12 <= d.bandwidth <= 2e13
    assert 1e14 <= d.bf16_flops <= d.fp8_flops <= 1e16
    assert d.memory_bytes > 1e10


@pytest.mark.parametrize("query, name", [("NVIDIA H200", "H200"), ("h100", "H100"), ("NVIDIA B200", "B200"),
                                         ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "RTX PRO 6000 Blackwell"),
                                         ("Some Future GPU", "H200")])
def test_device_spec_lookup(query, name):
    assert roofline.device_spec(query).name == name


def test_device_spec_default():
    spec = roofline.device_spec()
    if not runtime.has_cuda():
        assert spec.name == roofline.DEFAULT_DEVICE == "H200"
    assert isinstance(spec, DeviceSpec)


def test_memory_and_compute_bound():
    h = DEVICES["H200"]
    assert roofline.roofline_time(4.24e12, 0, h) == pytest.approx(1.0)
    assert roofline.roofline_time(0, 713e12, "H200") == pytest.approx(1.0)
    assert roofline.roofline_time(0, 1979e12, "H200", dtype="fp8") == pytest.approx(1.0)
    assert roofline.roofline_time(1e6, 1e6, h) == pytest.approx(1e6 / 4.24e12)


def test_intensity_ridge_fraction():
    assert roofline.arithmetic_intensity(10, 50) == 5
    assert roofline.arithmetic_intensity(0, 5) == math.inf
    ridge = roofline.ridge_point("H200")
    assert ridge == pytest.approx(713e12 / 4.24e12)
    assert roofline.ridge_point("H200", dtype="fp8") > ridge
    t = roofline.roofline_time(1e9, 1e9 * ridge, "H200")
    assert t == pytest.approx(1e9 / 4.24e12) == pytest.approx(1e9 * ridge / 713e12)
    assert roofline.roofline_fraction(2 * t, 1e9, 1e9 * ridge, "H200") == pytest.approx(0.5)


@settings(max_examples=25, deadline=None)
@given(b=st.floats(0, 1e12), f=st.floats(0, 1e15), name=st.sampled_from(list(DEVICES)),
       dtype=st.sampled_from(["bf16", "fp8"]))
def test_roofline_is_the_max_of_both_limits(b, f, name, dtype):
    spec = DEVICES[name]
    peak = spec.fp8_flops if dtype == "fp8" else spec.bf16_flops
    t = roofline.roofline_time(b, f, spec, dtype=dtype)
    assert t == max(b / spec.bandwidth, f / peak)
    assert t == roofline.roofline_time(b, f, name, dtype=dtype)
