"""dsv4lab.roofline: the device table, finding the device by capability and SM count, and the
roofline arithmetic."""
import math
from types import SimpleNamespace

import pytest
from hypothesis import given, settings, strategies as st

from dsv4lab import roofline, runtime
from dsv4lab.roofline import DEVICES, DeviceSpec


def test_h200_is_the_measured_one():
    h = DEVICES["H200"]
    assert h.bandwidth == 4.24e12 and h.bf16_flops == 713e12 and h.capability == (9, 0)
    assert "measured" in h.source and h.sm_count == 132 and h.matched


@pytest.mark.parametrize("name", list(DEVICES))
def test_every_device_has_sane_figures_and_a_source(name):
    d = DEVICES[name]
    assert d.source and len(d.source) > 20
    assert 5e11 <= d.bandwidth <= 2e13
    assert 1e14 <= d.bf16_flops <= d.fp8_flops <= 1e16
    assert d.memory_bytes > 1e10 and d.sm_count > 0 and not d.note


def test_table_entries_are_told_apart_by_capability_sms_and_memory():
    keys = [(d.capability, d.sm_count) for d in DEVICES.values()]
    for key in set(keys):
        same = [d for d in DEVICES.values() if (d.capability, d.sm_count) == key]
        assert len({d.memory_bytes for d in same}) == len(same), f"{key}: memory does not tell {same} apart"


@pytest.mark.parametrize("query, name", [("NVIDIA H200", "H200"), ("h100", "H100"), ("NVIDIA B200", "B200"),
                                         ("NVIDIA H100 PCIe", "H100 PCIe"), ("NVIDIA H100 80GB HBM3", "H100"),
                                         ("NVIDIA A100-SXM4-40GB", "A100 40GB"), ("NVIDIA L40S", "L40S"),
                                         ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "RTX PRO 6000 Blackwell")])
def test_device_spec_by_name(query, name):
    spec = roofline.device_spec(query)
    assert spec.name == name and spec.matched


def test_unknown_name_shows_h200_figures_and_says_so():
    spec = roofline.device_spec("Some Future GPU")
    assert (spec.name, spec.bandwidth) == ("H200", DEVICES["H200"].bandwidth)
    assert not spec.matched and "unknown device 'Some Future GPU': showing H200 figures" in spec.note
    assert spec.note in spec.describe() and spec.source.startswith(spec.note)


def fake_gpu(monkeypatch, name, cap, sms, memory):
    """Pretend the current device is ``name``: what device_spec reads of torch.cuda."""
    import torch
    monkeypatch.setattr(runtime, "has_cuda", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(
        name=name, major=cap[0], minor=cap[1], multi_processor_count=sms, total_memory=memory))


@pytest.mark.parametrize("gpu, expect", [
    (("NVIDIA H200", (9, 0), 132, 150_754_820_096), "H200"),
    (("NVIDIA H100 80GB HBM3", (9, 0), 132, 85_520_809_984), "H100"),
    (("NVIDIA A100-SXM4-80GB", (8, 0), 108, 85_100_000_000), "A100 80GB"),
    (("NVIDIA A100-SXM4-40GB", (8, 0), 108, 42_300_000_000), "A100 40GB"),
    (("NVIDIA L40S", (8, 9), 142, 47_700_000_000), "L40S"),
    (("NVIDIA B200", (10, 0), 148, 191_000_000_000), "B200"),
    (("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", (12, 0), 188, 102_000_000_000),
     "RTX PRO 6000 Blackwell"),
])
def test_current_device_found_by_capability_and_sm_count(monkeypatch, gpu, expect):
    fake_gpu(monkeypatch, *gpu)
    spec = roofline.device_spec()
    assert spec.name == expect and spec.matched, spec


def test_an_a100_no_longer_gets_the_h200_roof(monkeypatch):
    fake_gpu(monkeypatch, "NVIDIA A100-SXM4-80GB", (8, 0), 108, 85_100_000_000)
    assert roofline.roofline_time(2.039e12, 0) == pytest.approx(1.0)
    from dsv4lab import bench
    row = bench.with_roofline({"ms": 1.0}, bytes_moved=1e9, flops=0)
    assert row["roofline_device"] == "A100 80GB" and "roofline_note" not in row


def test_unknown_gpu_is_named_in_the_note(monkeypatch):
    fake_gpu(monkeypatch, "NVIDIA RTX A4000", (8, 6), 48, 17_000_000_000)
    spec = roofline.device_spec()
    assert spec.name == "H200" and not spec.matched
    assert spec.note == "unknown device NVIDIA RTX A4000 (sm_86, 48 SMs): showing H200 figures"
    from dsv4lab import bench
    row = bench.with_roofline({"ms": 1.0}, bytes_moved=1e9, flops=0)
    assert row["roofline_device"] == "H200" and row["roofline_note"] == spec.note
    assert "unknown device NVIDIA RTX A4000" in spec.describe()      # what `dsv4lab env` prints


@pytest.mark.skipif(runtime.has_cuda(), reason="the no-GPU label")
def test_device_spec_without_a_gpu_says_whose_figures():
    spec = roofline.device_spec()
    assert spec.name == roofline.DEFAULT_DEVICE == "H200"
    assert spec.note == "no GPU here: showing H200 figures"


def test_lookup_by_capability_and_sms():
    assert roofline.lookup((9, 0), 132, 150e9).name == "H200"
    assert roofline.lookup((9, 0), 132, 85e9).name == "H100"
    assert roofline.lookup((9, 0), 114).name == "H100 PCIe"
    assert roofline.lookup((8, 6), 84) is None and roofline.lookup((9, 0), 133) is None


def test_memory_and_compute_bound():
    h = DEVICES["H200"]
    assert roofline.roofline_time(4.24e12, 0, h) == pytest.approx(1.0)
    assert roofline.roofline_time(0, 713e12, "H200") == pytest.approx(1.0)
    assert roofline.roofline_time(0, 1.979e15, "H200", dtype="fp8") == pytest.approx(1.0)
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
    assert isinstance(spec, DeviceSpec)


@pytest.mark.gpu
@pytest.mark.skipif(not runtime.has_cuda(), reason="needs a CUDA GPU")
def test_the_gpu_here_is_found_or_named():
    import torch
    spec = roofline.device_spec()
    name = torch.cuda.get_device_name()
    if "H200" in name:
        assert spec.name == "H200" and spec.matched
    else:
        assert spec.matched or name in spec.note
