"""What the kernel launchers ask of the device, shared by every kernel family."""
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


def pdl_ok(device: torch.device) -> bool:
    """Whether a programmatic dependent launch (``launch_pdl``; ``griddepcontrol``) is
    available: a CUDA device of sm_90 or newer, not under Triton's interpreter."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)
