"""How fast a kernel could possibly be: bytes over bandwidth, FLOPs over peak.

``roofline_time(bytes, flops, device)`` is max(bytes / bandwidth, flops / peak); a
measured time is reported as the fraction roofline / measured (1.0 = at the roof).

:func:`device_spec` finds the GPU it runs on in :data:`DEVICES` by capability and SM count
(memory size breaks a tie, as between an H100 and an H200). A GPU that is not in the table,
or no GPU at all, gets the H200's figures (the GPU the recorded rows were measured on), and
the spec's ``note`` says so: "unknown device ...: showing H200 figures". Show
:meth:`DeviceSpec.describe`, which carries the note, wherever the figures are shown.

Explained in notebooks/00_tour.ipynb.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    capability: tuple[int, int]
    bandwidth: float        # bytes/s of HBM (or GDDR) read bandwidth
    bf16_flops: float       # dense bf16 tensor-core FLOP/s
    fp8_flops: float        # dense fp8 tensor-core FLOP/s (the bf16 figure where there is no fp8)
    memory_bytes: float
    source: str
    sm_count: int = 0       # streaming multiprocessors of the part
    note: str = ""          # set when these figures stand in for another device

    @property
    def matched(self) -> bool:
        """True when these are the figures of the device asked about."""
        return not self.note

    def describe(self) -> str:
        """One line: name, bandwidth and peaks, and the note when there is one."""
        line = (f"{self.name}: {self.bandwidth / 1e12:.2f} TB/s, {self.bf16_flops / 1e12:.0f} TFLOP/s bf16, "
                f"{self.fp8_flops / 1e12:.0f} TFLOP/s fp8")
        return f"{line} ({self.note})" if self.note else line


DEVICES: dict[str, DeviceSpec] = {
    "H200": DeviceSpec(
        "H200", (9, 0), bandwidth=4.24e12, bf16_flops=713e12, fp8_flops=1.979e15,
        memory_bytes=141e9, sm_count=132,
        source="bandwidth and bf16 measured on an H200 (device-to-device read bandwidth, "
               "an 8192^3 bf16 matmul; DESIGN.md); fp8 from NVIDIA's H200 datasheet (dense). "
               "Datasheet: 4.8 TB/s, 989 TFLOP/s bf16."),
    "H100": DeviceSpec(
        "H100", (9, 0), bandwidth=3.35e12, bf16_flops=989e12, fp8_flops=1.979e15,
        memory_bytes=80e9, sm_count=132,
        source="NVIDIA H100 SXM datasheet: 3.35 TB/s HBM3, 989 TFLOP/s bf16 and "
               "1979 TFLOP/s fp8 dense (half the with-sparsity figures)"),
    "H100 PCIe": DeviceSpec(
        "H100 PCIe", (9, 0), bandwidth=2.0e12, bf16_flops=756e12, fp8_flops=1.513e15,
        memory_bytes=80e9, sm_count=114,
        source="NVIDIA H100 PCIe datasheet: 2.0 TB/s HBM2e, 756 TFLOP/s bf16 and "
               "1513 TFLOP/s fp8 dense"),
    "A100 80GB": DeviceSpec(
        "A100 80GB", (8, 0), bandwidth=2.039e12, bf16_flops=312e12, fp8_flops=312e12,
        memory_bytes=80e9, sm_count=108,
        source="NVIDIA A100 SXM4 80GB datasheet: 2039 GB/s HBM2e, 312 TFLOP/s bf16 dense; "
               "no fp8 tensor cores (fp8 data runs at the bf16 rate)"),
    "A100 40GB": DeviceSpec(
        "A100 40GB", (8, 0), bandwidth=1.555e12, bf16_flops=312e12, fp8_flops=312e12,
        memory_bytes=40e9, sm_count=108,
        source="NVIDIA A100 40GB datasheet: 1555 GB/s HBM2, 312 TFLOP/s bf16 dense; "
               "no fp8 tensor cores (fp8 data runs at the bf16 rate)"),
    "L40S": DeviceSpec(
        "L40S", (8, 9), bandwidth=0.864e12, bf16_flops=362e12, fp8_flops=733e12,
        memory_bytes=48e9, sm_count=142,
        source="NVIDIA L40S datasheet: 864 GB/s GDDR6, 362 TFLOP/s bf16 and 733 TFLOP/s "
               "fp8 dense (half the with-sparsity figures)"),
    "B200": DeviceSpec(
        "B200", (10, 0), bandwidth=8.0e12, bf16_flops=2.25e15, fp8_flops=4.5e15,
        memory_bytes=180e9, sm_count=148,
        source="NVIDIA DGX/HGX B200 datasheet per GPU: 8 TB/s HBM3e, 2.25 PFLOP/s bf16 "
               "and 4.5 PFLOP/s fp8 dense"),
    "RTX PRO 6000 Blackwell": DeviceSpec(
        "RTX PRO 6000 Blackwell", (12, 0), bandwidth=1.792e12, bf16_flops=250e12,
        fp8_flops=500e12, memory_bytes=96e9, sm_count=188,
        source="NVIDIA RTX PRO 6000 Blackwell datasheet: 1792 GB/s GDDR7; 4000 AI TOPS is "
               "fp4 with sparsity, so ~250 TFLOP/s bf16 and ~500 fp8 dense (/16, /8)"),
}

DEFAULT_DEVICE = "H200"


def _stand_in(note: str) -> DeviceSpec:
    """The H200's figures, labelled as standing in for another device (in ``note`` and at the
    head of ``source``, so that a cell printing either shows it)."""
    h200 = DEVICES[DEFAULT_DEVICE]
    return dataclasses.replace(h200, note=note, source=f"{note}. {h200.source}")


def lookup(capability: tuple[int, int], sm_count: int, memory_bytes: float = 0.0) -> DeviceSpec | None:
    """The table's entry for a GPU of ``capability`` with ``sm_count`` SMs (the closest in
    memory when several match), or None."""
    hits = [s for s in DEVICES.values() if s.capability == tuple(capability) and s.sm_count == sm_count]
    if not hits:
        return None
    return min(hits, key=lambda s: abs(s.memory_bytes - memory_bytes)) if memory_bytes else hits[0]


def _tokens(name: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", name.lower()))


def _by_name(name: str) -> DeviceSpec | None:
    """The entry whose name's words all occur in ``name`` (the most specific first: "H100
    PCIe" before "H100"), else the first entry holding every word of ``name``."""
    words = _tokens(name)
    for key in sorted(DEVICES, key=lambda k: -len(_tokens(k))):
        if _tokens(key) <= words:
            return DEVICES[key]
    for key, spec in DEVICES.items():
        if words and words <= _tokens(key):
            return spec
    return None


def _current() -> DeviceSpec:
    from dsv4lab import runtime
    if not runtime.has_cuda():
        return _stand_in("no GPU here: showing H200 figures")
    import torch
    p = torch.cuda.get_device_properties(torch.cuda.current_device())
    cap = (p.major, p.minor)
    spec = lookup(cap, p.multi_processor_count, float(p.total_memory))
    if spec is not None:
        return spec
    return _stand_in(f"unknown device {p.name} (sm_{cap[0]}{cap[1]}, {p.multi_processor_count} SMs): "
                     "showing H200 figures")


def device_spec(name: str | None = None) -> DeviceSpec:
    """The spec of the current GPU (``name`` None), or of ``name`` ("H200", "NVIDIA H200").

    A device the table does not hold gets the H200's figures with a ``note`` saying so.
    """
    if name is None:
        return _current()
    spec = _by_name(name)
    return spec if spec is not None else _stand_in(f"unknown device {name!r}: showing H200 figures")


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
