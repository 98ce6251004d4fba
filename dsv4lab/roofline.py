"""How fast a kernel could possibly be: bytes over bandwidth, FLOPs over peak.

``roofline_time(bytes, flops, device)`` is max(bytes / bandwidth, flops / peak); a
measured time is reported as the fraction roofline / measured (1.0 = at the roof).

Explained in notebooks/00_tour.ipynb.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    capability: tuple[int, int]
    bandwidth: float        # bytes/s of HBM (or GDDR) read bandwidth
    bf16_flops: float       # dense bf16 tensor-core FLOP/s
    fp8_flops: float        # dense fp8 tensor-core FLOP/s
    memory_bytes: float
    source: str


DEVICES: dict[str, DeviceSpec] = {
    "H200": DeviceSpec(
        "H200", (9, 0), bandwidth=4.24e12, bf16_flops=713e12, fp8_flops=1979e12,
        memory_bytes=141e9,
        source="bandwidth and bf16 measured on the lent H200 on 2026-11-29 (DESIGN.md: "
               "device-to-device read bandwidth, 8192^3 bf16 matmul); fp8 from NVIDIA's "
               "H200 datasheet (dense). Datasheet: 4.8 TB/s, 989 TFLOP/s bf16."),
    "H100": DeviceSpec(
        "H100", (9, 0), bandwidth=3.35e12, bf16_flops=989e12, fp8_flops=1979e12,
        memory_bytes=80e9,
        source="NVIDIA H100 SXM datasheet: 3.35 TB/s HBM3, 989 TFLOP/s bf16 and "
               "1979 TFLOP/s fp8 dense (half the with-sparsity figures)"),
    "B200": DeviceSpec(
        "B200", (10, 0), bandwidth=8.0e12, bf16_flops=2250e12, fp8_flops=4500e12,
        memory_bytes=180e9,
        source="NVIDIA DGX/HGX B200 datasheet per GPU: 8 TB/s HBM3e, 2.25 PFLOP/s bf16 "
               "and 4.5 PFLOP/s fp8 dense"),
    "RTX PRO 6000 Blackwell": DeviceSpec(
        "RTX PRO 6000 Blackwell", (12, 0), bandwidth=1.792e12, bf16_flops=250e12,
        fp8_flops=500e12, memory_bytes=96e9,
        source="NVIDIA RTX PRO 6000 Blackwell datasheet: 1792 GB/s GDDR7; 4000 AI TOPS is "
               "fp4 with sparsity, so ~250 TFLOP/s bf16 and ~500 fp8 dense (/16, /8)"),
}

DEFAULT_DEVICE = "H200"


def device_spec(name: str | None = None) -> DeviceSpec:
    """The spec for ``name`` ("H200", "NVIDIA H200", ...), or for the current GPU.

    Without a GPU, or with one not in the table, the H200's figures are used (the GPU
    every recorded figure in this workbook was measured on).
    """
    if name is None:
        from dsv4lab import runtime
        name = runtime.device_name() if runtime.has_cuda() else DEFAULT_DEVICE
    for key, spec in DEVICES.items():
        if key.lower() in name.lower():
            return spec
    return DEVICES[DEFAULT_DEVICE]


def _spec(device) -> DeviceSpec:
    return device if isinstance(device, DeviceSpec) else device_spec(device)


def roofline_time(bytes_moved: float, flops: float, device: str | DeviceSpec | None = None,
                  *, dtype: str = "bf16") -> float:
    """Seconds: max(bytes / bandwidth, flops / peak) on ``device``; dtype picks the peak."""
    spec = _spec(device)
    peak = spec.fp8_flops if dtype == "fp8" else spec.bf16_flops
    return max(bytes_moved / spec.bandwidth, flops / peak)


def arithmetic_intensity(bytes_moved: float, flops: float) -> float:
    """FLOPs per byte of memory traffic."""
    return flops / bytes_moved if bytes_moved else float("inf")


def ridge_point(device: str | DeviceSpec | None = None, *, dtype: str = "bf16") -> float:
    """The intensity (FLOP/byte) above which ``device`` is compute-bound."""
    spec = _spec(device)
    return (spec.fp8_flops if dtype == "fp8" else spec.bf16_flops) / spec.bandwidth


def roofline_fraction(measured_s: float, bytes_moved: float, flops: float,
                      device: str | DeviceSpec | None = None, *, dtype: str = "bf16") -> float:
    """roofline time / measured time: 1.0 means at the roof."""
    return roofline_time(bytes_moved, flops, device, dtype=dtype) / measured_s
