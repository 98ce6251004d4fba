"""What the kernel launchers ask of the device, shared by every kernel family."""
import functools
import os

import torch

_SM_COUNT: dict[int, int] = {}


def sm_count(device: torch.device, cpu: int) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (cached per device index); ``cpu``
    for a CPU tensor (Triton's interpreter), each family choosing a count that exercises
    its grid logic there."""
    if device.type != "cuda":
        return cpu
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def interpreting() -> bool:
    """Whether Triton's interpreter runs the kernels (``TRITON_INTERPRET`` set)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pdl_ok(device: torch.device) -> bool:
    """Whether a programmatic dependent launch (``launch_pdl``; ``griddepcontrol``) is
    available: a CUDA device of sm_90 or newer, not under Triton's interpreter."""
    if interpreting() or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


# The Triton releases whose Gluon API kernels/moe_mma2.py and kernels/sparse_mla_ws.py are
# written for and measured with. Gluon is experimental and moves between releases: Triton 3.9
# renamed async_copy_global_to_shared (async_load) and thread_barrier (barrier). Through
# kernels/gluon_compat.py both kernels compile for sm_90 with 3.9 too (offline, no spills),
# but no GPU has run them there: 3.9 stays out until the GPU tests pass with it.
GLUON_TRITON = ((3, 6),)


def gluon_unsupported(version: str | None = None) -> str | None:
    """None if the installed Triton (or ``version``) is one the Gluon kernels are written for
    (GLUON_TRITON), else why not; asked before those modules are imported, so that any other
    Triton falls back to the Triton kernels instead of failing to import or compile.
    ``DSV4LAB_GLUON_ANY_TRITON=1`` lets them try any release (to validate a new one with the
    GPU tests). Explained in notebooks/02_mma_attention.ipynb."""
    if version is None:
        import triton
        version = triton.__version__
    return _gluon_reason(version, os.environ.get("DSV4LAB_GLUON_ANY_TRITON", "0") == "1")


def triton_release(version: str | None = None) -> tuple[int, ...]:
    """(major, minor) of the installed Triton (or of ``version``); () if it does not read as
    numbers (a nightly's name)."""
    if version is None:
        import triton
        version = triton.__version__
    try:
        return tuple(int(p) for p in version.split(".")[:2])
    except ValueError:
        return ()


@functools.lru_cache(maxsize=None)
def _gluon_reason(version: str, any_release: bool) -> str | None:
    """:func:`gluon_unsupported`'s answer, worked out once a (version, opt-in): the ops ask
    on every call."""
    if triton_release(version) in GLUON_TRITON or any_release:
        return None
    tested = ", ".join(f"{a}.{b}" for a, b in GLUON_TRITON)
    return (f"the Gluon kernels are written for Triton {tested}'s Gluon API (found Triton "
            f"{version}); set DSV4LAB_GLUON_ANY_TRITON=1 to try them")
