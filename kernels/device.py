"""What the kernel launchers ask of the device, shared by every kernel family.

- :class:`DeviceProps`: capability, SM count and shared memory per block, read once per
  device (or the nominal figures of a capability, for planning a GPU one does not have);
  launchers choose their tiles from these, never from a device's name.
- :class:`Route`: one line of a family's dispatch table (which kernel runs where, and why).
- :func:`gluon_unsupported`: whether the installed Triton's Gluon is the one the Gluon
  kernels are written for.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Callable

import torch


def interpreting() -> bool:
    """Whether Triton's interpreter runs the kernels (``TRITON_INTERPRET`` set)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Nominal figures of the GPUs the workbook is written for, by capability: (SM count of the
# reference part, shared memory a block may opt in to, in bytes). Used where no device is
# at hand (offline compiles, Triton's interpreter, "what would sm_120 run?").
NOMINAL = {
    (8, 0): ("A100", 108, 166912),
    (8, 6): ("RTX A6000", 84, 101376),
    (8, 9): ("L40S", 142, 101376),
    (9, 0): ("H200", 132, 232448),
    (10, 0): ("B200", 148, 232448),
    (12, 0): ("RTX PRO 6000", 188, 101376),
}
CAPABILITIES = ((8, 0), (8, 9), (9, 0), (10, 0), (12, 0))   # the targets the kernels are checked for


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
        """Triton's interpreter: a small pretend GPU, so that grid logic (split-KV, several
        programs a row) is exercised on the CPU too."""
        return cls((0, 0), sm_count, 1 << 30, "cpu")


@functools.lru_cache(maxsize=None)
def _cuda_props(index: int) -> DeviceProps:
    p = torch.cuda.get_device_properties(index)
    smem = getattr(p, "shared_memory_per_block_optin", 0)
    if not smem:
        smem = NOMINAL.get((p.major, p.minor), ("", 0, 101376))[2]
    return DeviceProps((p.major, p.minor), p.multi_processor_count, int(smem), p.name)


def props(device: torch.device) -> DeviceProps:
    """:class:`DeviceProps` of ``device`` (read once per CUDA device); the interpreter's
    :meth:`DeviceProps.cpu` for a CPU tensor."""
    if device.type != "cuda":
        return DeviceProps.cpu()
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_props(index)


def sm_count(device: torch.device, cpu: int) -> int:
    """Streaming multiprocessors of a CUDA ``device``; ``cpu`` for a CPU tensor."""
    return props(device).sm_count if device.type == "cuda" else cpu


def pdl_ok(device: torch.device) -> bool:
    """Whether a programmatic dependent launch (``griddepcontrol``) is available: a CUDA
    device of sm_90 or newer, not under Triton's interpreter."""
    if interpreting() or device.type != "cuda":
        return False
    return props(device).capability >= (9, 0)


@dataclass(frozen=True)
class Route:
    """One line of a kernel family's dispatch table.

    ``capabilities``: the exact GPUs the kernel was compiled and run for (``None``: portable
    Triton, every GPU Triton supports and the interpreter); ``when``: the shapes, in words;
    ``why``: one line, naming the benchmark whose rows show it; ``applies(props, **shape)``:
    the same condition in code (the table and the dispatch cannot drift apart)."""
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


# The Triton releases whose Gluon API the Gluon kernels are written for and were run with.
# Gluon is experimental and moves between releases (kernels/gluon_compat.py takes the names
# that moved); on any other release the portable Triton kernels run.
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
    """None if the installed Triton (or ``version``) is one the Gluon kernels are written for,
    else why not. ``DSV4LAB_GLUON_ANY_TRITON=1`` lets them try any release (to validate a new
    one with the GPU tests)."""
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
