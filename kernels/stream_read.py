"""Read a buffer once, as fast as the memory system allows: the bandwidth yardstick.

It moves bytes and nothing else (an xor per 32-bit word, so the loads stay): the floor any
kernel reading the same bytes is compared with. Each program walks the buffer in a grid stride
of ``BLOCK`` words and writes the xor of what it read; the output's xor is the input's, the
check that every word was read. ``dsv4lab bench l2`` times it after each L2 state: the gap is
what the timing method costs. Explained in notebooks/00_tour.ipynb.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4lab.kernels.device import DeviceProps, Route, props
from dsv4lab.kernels.offline import Case

BLOCK = 2048            # words a program reads per step of its grid stride
PROGRAMS_PER_SM = 8     # enough loads in flight to saturate DRAM


@triton.jit
def _stream_read_kernel(src, out, n_words, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(pid * BLOCK, n_words, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc ^= tl.load(src + offs, mask=offs < n_words, other=0)
    tl.store(out + pid, tl.xor_sum(acc, axis=0))


def stream_read(words: torch.Tensor, *, programs: int | None = None, block: int = BLOCK) -> torch.Tensor:
    """Read every element of ``words`` (contiguous 1-D int32) once; return the per-program xor
    (``programs``: default 8 an SM, 4 on the CPU)."""
    if not isinstance(words, torch.Tensor) or words.dtype != torch.int32 or words.dim() != 1:
        raise ValueError(f"words must be a 1-D int32 tensor, got "
                         f"{getattr(words, 'dtype', type(words).__name__)} of shape {tuple(getattr(words, 'shape', ()))}")
    if not words.is_contiguous():
        raise ValueError("words must be contiguous")
    if block <= 0 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    if programs is None:
        programs = PROGRAMS_PER_SM * props(words.device).sm_count if words.is_cuda else 4
    if programs < 1:
        raise ValueError(f"programs must be >= 1, got {programs}")
    out = torch.empty(programs, dtype=torch.int32, device=words.device)
    _stream_read_kernel[(programs,)](words, out, words.numel(), BLOCK=block, num_warps=8)
    return out


# ---- the family contract -------------------------------------------------------------------

TABLES = {"stream_read": (
    Route("stream_read", None, "any contiguous 1-D int32 buffer",
          "the yardstick is portable Triton by design: a floor every GPU can run"),
)}


def offline_cases(props_: DeviceProps) -> list[Case]:
    """The one launch :func:`stream_read` makes (the same on every GPU)."""
    return [Case("stream_read", _stream_read_kernel, {"BLOCK": BLOCK},
                 types={"src": "*i32", "out": "*i32", "n_words": "i32"}, num_warps=8)]
