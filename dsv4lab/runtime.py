"""Where the lab runs: a CUDA GPU, or the CPU through Triton's interpreter.

Triton reads ``TRITON_INTERPRET`` once, when it is first imported, so the choice has to
be made before anything imports triton. ``import dsv4lab`` calls :func:`configure`
first thing; notebooks also set the variable in their parameters cell.

Explained in notebooks/00_tour.ipynb.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys

import torch

from dsv4lab.kernels.device import interpreting   # torch and os only: triton is not imported

_CONFIGURED = False


def has_cuda() -> bool:
    return torch.cuda.is_available()


def configure() -> None:
    """Turn on Triton's interpreter when there is no GPU (before triton is imported)."""
    global _CONFIGURED
    if _CONFIGURED:
        return
    _CONFIGURED = True
    if not has_cuda() and "TRITON_INTERPRET" not in os.environ:
        if "triton" in sys.modules:
            raise RuntimeError(
                "triton was imported before dsv4lab on a machine without a GPU: "
                "set TRITON_INTERPRET=1 before importing triton (or import dsv4lab first)"
            )
        os.environ["TRITON_INTERPRET"] = "1"
    if interpreting():
        check_interpreter()


class InterpreterVersionError(RuntimeError):
    """The installed Triton's interpreter cannot run under the installed numpy."""


def interpreter_problem(numpy_version: str, index_source: str) -> str | None:
    """Why Triton's interpreter cannot run the kernels here, or None. Triton 3.6's interpreter
    turns a scalar into an index with ``int()`` of a one-element array (``index_source`` is its
    ``__index__`` patch), which numpy 2.4 and later refuse (every ``range`` over a runtime
    bound fails); Triton 3.9's does not."""
    major_minor = tuple(int(p) for p in re.findall(r"\d+", numpy_version)[:2])
    if major_minor >= (2, 4) and "int(self.handle.data)" in index_source:
        return (f"Triton's interpreter in this release cannot run under numpy {numpy_version}: "
                "use numpy < 2.4 with it (pip install 'numpy<2.4'), or Triton 3.9 or newer")
    return None


def check_interpreter() -> None:
    """Raise :class:`InterpreterVersionError` (one line) where :func:`interpreter_problem` says so."""
    import inspect

    import numpy
    from triton.runtime import interpreter
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    source = inspect.getsource(patch) if patch is not None else ""
    problem = interpreter_problem(numpy.__version__, source)
    if problem:
        raise InterpreterVersionError(problem)


def is_interpreter() -> bool:
    """True when Triton kernels run in the numpy interpreter (no GPU, or forced): the kernels'
    own check, :func:`dsv4lab.kernels.device.interpreting`."""
    return interpreting()


def device() -> torch.device:
    """The device the lab computes on: the current CUDA GPU, else the CPU."""
    return torch.device("cuda") if has_cuda() else torch.device("cpu")


def is_capturing(t: torch.Tensor) -> bool:
    """True while ``t``'s CUDA stream is being captured into a CUDA graph: value checks that
    read a tensor on the host must be skipped then."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


@contextlib.contextmanager
def cuda_graph_capture(graph: torch.cuda.CUDAGraph):
    """``torch.cuda.graph(graph)`` that, when the capture fails (a host sync, an op that
    cannot be captured), hands the default CUDA generators back from capture mode before the
    error propagates. torch marks them capturing at ``capture_begin`` and unmarks them only
    when ``capture_end`` succeeds, so after an aborted capture the process's next CUDA random
    draw (a layer's init, ``torch.randn``) fails with "Offset increment outside graph capture
    encountered unexpectedly". The lab's captures go through here: the decode-step profile's
    and the engine's, which fall back to eager after a failure, and
    :func:`dsv4lab.bench.capture_graph`'s, whose caller sees the error.
    Explained in notebooks/03_indexer_capping.ipynb (capturing a decode step)."""
    try:
        with torch.cuda.graph(graph):
            yield graph
    except BaseException:
        for gen in torch.cuda.default_generators:
            if hasattr(gen, "clone_state"):     # a fresh state object: same seed and offset
                gen.graphsafe_set_state(gen.clone_state())
        raise


def capability() -> tuple[int, int] | None:
    """CUDA compute capability of the current GPU, e.g. (9, 0); None on the CPU."""
    return torch.cuda.get_device_capability() if has_cuda() else None


def device_name() -> str:
    """'NVIDIA H200' and the like; 'cpu (Triton interpreter)' without a GPU."""
    if has_cuda():
        return torch.cuda.get_device_name()
    return "cpu (Triton interpreter)" if is_interpreter() else "cpu"


def capability_str(cap: tuple[int, int] | None = None) -> str:
    cap = capability() if cap is None else cap
    return "cpu" if cap is None else f"sm_{cap[0]}{cap[1]}"


class CapabilityError(RuntimeError):
    """The current device cannot run what was asked for."""


def require_capability(minimum: tuple[int, int], *, what: str = "this code",
                       maximum: tuple[int, int] | None = None) -> tuple[int, int]:
    """Return the GPU's capability, or raise naming the GPU that ``what`` needs.

    ``require_capability((10, 0), maximum=(10, 3), what="trtllm fp4 MoE")`` fails on an
    H200 with "trtllm fp4 MoE needs sm_100..sm_103 (a B200/GB200-class GPU); this is
    NVIDIA H200 (sm_90)".
    """
    cap = capability()
    need = capability_str(minimum) + (f"..{capability_str(maximum)}" if maximum else "+")
    if cap is None:
        raise CapabilityError(f"{what} needs a CUDA GPU with {need}; this machine has no GPU")
    if cap < minimum or (maximum is not None and cap > maximum):
        raise CapabilityError(
            f"{what} needs {need}; this is {device_name()} ({capability_str(cap)})")
    return cap


def versions() -> dict:
    """Versions and device, as recorded with every result row."""
    import platform

    try:
        import triton
        triton_version = triton.__version__
    except Exception:  # pragma: no cover - triton is a hard dependency
        triton_version = None
    return {
        "gpu": device_name(),
        "capability": capability_str(),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "interpreter": is_interpreter(),
    }
