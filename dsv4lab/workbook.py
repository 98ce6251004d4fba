"""What every notebook's setup cell calls: mode, device, versions.

``MODE`` in a notebook's parameters cell is "auto" (full shapes on a GPU, smoke shapes
on the CPU), "smoke" or "full". :func:`setup` also registers the benchmarks, so that a
notebook's ``bench.run(NAME)`` finds them. Explained in notebooks/00_tour.ipynb.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4lab import runtime

MODES = ("auto", "smoke", "full")


@dataclass(frozen=True)
class Lab:
    mode: str                 # "smoke" or "full", after resolving "auto"
    device: torch.device
    live: bool                # a GPU is here: benchmarks run live instead of reading rows
    versions: dict

    @property
    def smoke(self) -> bool:
        return self.mode == "smoke"

    def __repr__(self) -> str:
        v = self.versions
        return (f"Lab(mode={self.mode!r}, device={v['gpu']} ({v['capability']}), "
                f"torch {v['torch']}, triton {v['triton']}, live benchmarks={self.live})")


def setup(mode: str = "auto", *, seed: int = 0) -> Lab:
    """Resolve the mode, seed torch, and describe where this notebook runs."""
    if mode not in MODES:
        raise ValueError(f"MODE must be one of {MODES}, got {mode!r}")
    runtime.configure()
    live = runtime.has_cuda()
    resolved = mode if mode != "auto" else ("full" if live else "smoke")
    if resolved == "full" and not live:
        raise ValueError("MODE='full' needs a CUDA GPU (full DeepSeek-V4-Flash shapes); "
                         "use 'smoke' or 'auto' on the CPU")
    torch.manual_seed(seed)
    import dsv4lab.benchmarks  # noqa: F401  (registers every benchmark for bench.run)
    return Lab(mode=resolved, device=runtime.device(), live=live, versions=runtime.versions())
