"""Read a buffer once, as fast as the memory system allows: the bandwidth yardstick.

A memory-bound kernel's figure is its bytes over its time; this kernel moves bytes and
does nothing else (an xor per 32-bit word, so the loads cannot be optimised away), which
makes it the floor any kernel reading the same bytes is compared with. ``dsv4lab bench l2``
times it at sizes from a few MB to ~1 GB after each L2 state of :mod:`dsv4lab.bench`:
the gap between the two states is what the timing method, not the kernel, costs.

Each program walks the buffer in a grid stride of ``BLOCK`` words (coalesced 16-byte loads
per thread) and writes the xor of what it read: one word a program.

:func:`rows_read` reads the same way the T = 1 MoE decode reads its weights (kernels/moe_mma2.py,
REGS): the buffer as rows, a program a tile of rows and a K slice of them, ``step`` bytes a row
a step, with ``.cg`` loads or an L2 evict-first policy (``evict``): what that access pattern
costs apart from the MoE (scripts/probe_weight_reads.py).

Explained in notebooks/00_tour.ipynb.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _stream_read_kernel(src, out, n_words, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(pid * BLOCK, n_words, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc ^= tl.load(src + offs, mask=offs < n_words, other=0)
    tl.store(out + pid, tl.xor_sum(acc, axis=0))


def _check_words(words: torch.Tensor) -> None:
    if not isinstance(words, torch.Tensor) or words.dtype != torch.int32 or words.dim() != 1:
        raise ValueError(f"words must be a 1-D int32 tensor, got "
                         f"{getattr(words, 'dtype', type(words).__name__)} of shape {tuple(getattr(words, 'shape', ()))}")
    if not words.is_contiguous():
        raise ValueError("words must be contiguous")


def stream_read(words: torch.Tensor, *, programs: int | None = None, block: int = 2048) -> torch.Tensor:
    """Read every element of ``words`` (contiguous 1-D int32) once; return the per-program xor.

    ``programs`` defaults to 8 a streaming multiprocessor on a GPU (4 under the interpreter).
    The xor of the result equals the xor of ``words``: the check that every word was read.
    """
    _check_words(words)
    if block <= 0 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    if programs is None:
        programs = (torch.cuda.get_device_properties(words.device).multi_processor_count * 8
                    if words.is_cuda else 4)
    if programs < 1:
        raise ValueError(f"programs must be >= 1, got {programs}")
    out = torch.empty(programs, dtype=torch.int32, device=words.device)
    _stream_read_kernel[(programs,)](words, out, words.numel(), BLOCK=block, num_warps=8)
    return out


@triton.jit
def _rows_read_kernel(src, out, ROWS: tl.constexpr, STEP: tl.constexpr, NSTEP: tl.constexpr,
                      SLICES: tl.constexpr, ROW_BYTES: tl.constexpr, EVICT: tl.constexpr,
                      SPREAD: tl.constexpr, TILE_MAJOR: tl.constexpr):
    """Program p: ROWS rows of tile p // SLICES, K slice p % SLICES, STEP bytes a row a step;
    writes each row's xor over its slice. SPREAD: a step's 16-byte pieces lie SPREAD pieces
    apart, so SPREAD steps cover SPREAD x STEP contiguous bytes a row. TILE_MAJOR: the tile's
    slices stored one after the other, each K-step-major (a step's ROWS x STEP bytes
    contiguous), as a weight layout packed for these reads would be."""
    pid = tl.program_id(0)
    r = tl.arange(0, ROWS)
    cols = tl.arange(0, STEP // 4)
    piece = (cols // 4) * (SPREAD * 4) + cols % 4      # words: piece t at t x SPREAD pieces
    if TILE_MAJOR:
        base = (src + (pid // SLICES).to(tl.int64) * (ROWS * ROW_BYTES // 4)
                + (pid % SLICES) * (ROWS * NSTEP * STEP // 4) + r[:, None] * (STEP // 4))
    else:
        rows = (pid // SLICES) * ROWS + r
        base = (src + rows[:, None].to(tl.int64) * (ROW_BYTES // 4)
                + (pid % SLICES) * (NSTEP * STEP // 4))
    acc = tl.zeros([ROWS, STEP // 4], tl.int32)
    for k in range(NSTEP):
        if TILE_MAJOR:
            at = k * (ROWS * STEP // 4) + piece
        else:
            at = (k // SPREAD) * (SPREAD * STEP // 4) + (k % SPREAD) * 4 + piece
        if EVICT:
            acc ^= tl.load(base + at[None, :], eviction_policy="evict_first")
        else:
            acc ^= tl.load(base + at[None, :], cache_modifier=".cg")
    tl.store(out + pid * ROWS + tl.arange(0, ROWS), tl.xor_sum(acc, axis=1))


def rows_read(words: torch.Tensor, *, row_bytes: int, rows: int, step: int, slices: int = 1,
              evict: bool = False, spread: int = 1, tile_major: bool = False,
              num_warps: int = 2) -> torch.Tensor:
    """Read ``words`` (contiguous 1-D int32) as rows of ``row_bytes`` bytes: a program ``rows``
    rows and one of ``slices`` K slices of them, ``step`` bytes a row a step (``evict``: with an
    L2 evict-first policy instead of ``.cg``; ``spread``: a step's 16-byte pieces ``spread``
    pieces apart, as a K order where a lane's loads over ``spread`` steps are contiguous;
    ``tile_major``: the same reads from a layout where a tile's K-step is ``rows`` x ``step``
    contiguous bytes, not with ``spread``).
    Returns each (program, row)'s xor: their xor
    equals the xor of ``words``, the check that every word was read. Why the MoE cares (its
    weights' L2 policy): notebooks/04_mxfp4_moe_port.ipynb."""
    _check_words(words)
    nbytes = words.numel() * 4
    for name, v in (("rows", rows), ("step", step), ("slices", slices), ("spread", spread)):
        if v <= 0 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two, got {v}")
    if step < 4 or row_bytes % (slices * step):
        raise ValueError(f"row_bytes ({row_bytes}) must be a multiple of slices x step "
                         f"({slices} x {step}), step at least 4")
    if spread > 1 and (step < 16 or (row_bytes // slices) % (spread * step)):
        raise ValueError(f"spread {spread} needs a step of at least 16 bytes and slices of "
                         f"row_bytes / slices ({row_bytes // slices}) a multiple of spread x step")
    if tile_major and spread > 1:
        raise ValueError(f"tile_major reads a step's bytes contiguously; spread must be 1, "
                         f"got {spread}")
    if nbytes % (rows * row_bytes):
        raise ValueError(f"words ({nbytes} bytes) must hold whole tiles of {rows} rows of "
                         f"{row_bytes} bytes")
    programs = nbytes // row_bytes // rows * slices
    out = torch.empty(programs * rows, dtype=torch.int32, device=words.device)
    _rows_read_kernel[(programs,)](words, out, ROWS=rows, STEP=step,
                                   NSTEP=row_bytes // slices // step, SLICES=slices,
                                   ROW_BYTES=row_bytes, EVICT=bool(evict), SPREAD=spread,
                                   TILE_MAJOR=bool(tile_major),
                                   num_warps=num_warps,
                                   num_stages=4)
    return out
