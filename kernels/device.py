"""What the kernel launchers ask of the device: :class:`DeviceProps` (capability, SMs, shared
memory a block; launchers choose tiles from these, never from a name), :class:`Route` (a line
of a dispatch table) and :func:`gluon_unsupported` (is this Triton's Gluon the kernels' one)."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Callable

import torch


def interpreting() -> bool:
    """Whether Triton's interpreter runs the kernels (``TRITON_INTERPRET`` set)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# (reference part, SMs, shared memory a block may opt in to) by capability, for planning
# without the device (offline compiles, "what would sm_120 run?")
NOMINAL = {
    (8, 0): ("A100", 108, 166912),
    (8, 6): ("RTX A6000", 84, 101376),
    (8, 9): ("L40S", 142, 101376),
    (9, 0): ("H200", 132, 232448),
    (10, 0): ("B200", 148, 232448),
    (12, 0): ("RTX PRO 6000", 188, 101376),
}
CAPABILITIES = ((8, 0), (8, 9), (9, 0), (10, 0), (12, 0))   # the targets kernels are checked for


@dataclass(frozen=True)
class DeviceProps:
    """The device facts a launch plan depends on."""
    capability: tuple[int, int]     # (0, 0): the CPU (Triton's interpreter)
    sm_count: int
    smem_per_block: int             # bytes a block may opt in to
    name: str = ""

    @property
    def is_gpu(self) -> bool:
        return self.capability != (0, 0)

    @classmethod
    def nominal(cls, capability: tuple[int, int]) -> "DeviceProps":
        """The reference part of ``capability`` (:data:`NOMINAL`)."""
        cap = tuple(capability)
        if cap not in NOMINAL:
            raise ValueError(f"no nominal figures for sm_{cap[0]}{cap[1]}; known: "
                             + ", ".join(f"sm_{a}{b}" for a, b in NOMINAL))
        name, sms, smem = NOMINAL[cap]
        return cls(cap, sms, smem, name)

    @classmethod
    def cpu(cls, sm_count: int = 8) -> "DeviceProps":
        """Triton's interpreter: a small pretend GPU, so grid logic runs on the CPU too."""
        return cls((0, 0), sm_count, 1 << 30, "cpu")


@functools.lru_cache(maxsize=None)
def _cuda_props(index: int) -> DeviceProps:
    p = torch.cuda.get_device_properties(index)
    smem = getattr(p, "shared_memory_per_block_optin", 0)
    if not smem:
        smem = NOMINAL.get((p.major, p.minor), ("", 0, 101376))[2]
    return DeviceProps((p.major, p.minor), p.multi_processor_count, int(smem), p.name)


def props(device: torch.device) -> DeviceProps:
    """:class:`DeviceProps` of ``device`` (read once); :meth:`DeviceProps.cpu` off CUDA."""
    if device.type != "cuda":
        return DeviceProps.cpu()
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_props(index)


def sm_count(device: torch.device, cpu: int) -> int:
    """Streaming multiprocessors of a CUDA ``device``; ``cpu`` for a CPU tensor."""
    return props(device).sm_count if device.type == "cuda" else cpu


def pdl_ok(device: torch.device) -> bool:
    """Whether a programmatic dependent launch is available (sm_90+, not interpreted)."""
    if interpreting() or device.type != "cuda":
        return False
    return props(device).capability >= (9, 0)


@dataclass(frozen=True)
class Route:
    """One line of a dispatch table: ``capabilities`` the kernel was run for (None: portable);
    ``when`` in words; ``why``, naming the benchmark that shows it; ``applies(props, **shape)``:
    ``when`` in code (the table and the dispatch cannot drift apart)."""
    kernel: str
    capabilities: frozenset | None
    when: str
    why: str
    applies: Callable[..., bool] = lambda props, **shape: True

    def runs_on(self, props: DeviceProps) -> bool:
        return self.capabilities is None or props.capability in self.capabilities


def choose(table: tuple[Route, ...], props: DeviceProps, **shape) -> Route:
    """The first route of ``table`` that runs on ``props`` and applies to ``shape``."""
    for route in table:
        if route.runs_on(props) and route.applies(props, **shape):
            return route
    raise LookupError(f"no route of the table applies on {props} for {shape}")


def describe(table: tuple[Route, ...]) -> list[dict]:
    """The table as rows for `dsv4lab env` and the notebooks."""
    return [dict(kernel=r.kernel,
                 gpus="any" if r.capabilities is None
                 else ", ".join(f"sm_{a}{b}" for a, b in sorted(r.capabilities)),
                 when=r.when, why=r.why) for r in table]


# The Triton releases the Gluon kernels were written and run for (Gluon moves between
# releases; gluon_compat.py takes the moved names); elsewhere the portable kernels run.
GLUON_TRITON = ((3, 6),)


def triton_release(version: str | None = None) -> tuple[int, ...]:
    """(major, minor) of the installed Triton (or of ``version``); () for a nightly's name."""
    if version is None:
        import triton
        version = triton.__version__
    try:
        return tuple(int(p) for p in version.split(".")[:2])
    except ValueError:
        return ()


def gluon_unsupported(version: str | None = None) -> str | None:
    """None if the Gluon kernels are written for this Triton (or ``version``), else why not.
    ``DSV4LAB_GLUON_ANY_TRITON=1`` lets them try any release."""
    if version is None:
        import triton
        version = triton.__version__
    return _gluon_reason(version, os.environ.get("DSV4LAB_GLUON_ANY_TRITON", "0") == "1")


@functools.lru_cache(maxsize=None)
def _gluon_reason(version: str, any_release: bool) -> str | None:
    if triton_release(version) in GLUON_TRITON or any_release:
        return None
    tested = ", ".join(f"{a}.{b}" for a, b in GLUON_TRITON)
    return (f"the Gluon kernels are written for Triton {tested}'s Gluon API (found Triton "
            f"{version}); set DSV4LAB_GLUON_ANY_TRITON=1 to try them")
