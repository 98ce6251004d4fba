"""How fast the T = 1 MoE's way of reading its weights can go, apart from the MoE (GPU only).

    python3 scripts/probe_weight_reads.py

The fused T = 1 decode (kernels/moe_mma2.py) reads each expert row's K slice 64 bytes a step,
eight rows a warp instruction, one tile of rows a program, after ``do_bench``'s zero-fill
flush has left the L2 full of dirty lines. This probe reads 48 MB laid out as the 6 experts'
gate/up rows (24576 rows of 2 KB, each program 64 rows x one 1 KB half) and then 24 MB as
their down rows (1 KB rows, 32 a program), timed as ``dsv4lab bench`` times (CUDA graph,
dirty L2), with :func:`dsv4lab.kernels.stream_read.rows_read` and

* the bytes a row a step (64, as the MoE; 256),
* the loads' cache policy (``.cg``, as the MoE before session 12; L2 evict-first, ``EVICT``),
* where a step's 16-byte pieces lie (``spread``: 1, contiguous as the MoE; 2 or 4 pieces apart,
  a K order in which a lane's loads over 2 or 4 steps are contiguous),
* the layout (``tile-major``: a tile's K-step, its rows x 64 bytes, contiguous, as weights
  packed for these reads would lie; the lead for a faster T = 1 read),

against :func:`dsv4lab.kernels.stream_read.stream_read` of the same 48 MB. Its printout is the
reason for moe_mma2's ``EVICT`` (session 12); the recorded evidence is ``dsv4lab bench moe``
(variant ``mma2_noevict_t1`` against the default in the same run).

H200 printout at cacf1ed (the read kernel then lived here and ended on a sum, now an xor;
us; gate/up rows alone, then with the down rows after them):
stream_read 21.1; 64 B a step, ``.cg`` 28.6 / 39.3, evict-first 23.3 / 33.3; 256 B a step,
``.cg`` 22.9 / 34.0, evict-first 20.2 / 29.0.

H200 printout at 192e46a (session 13, evict-first unless named): stream_read 20.9; 64 B a
step, ``.cg`` 29.0 / 38.8, contiguous 23.6 / 33.5, pieces 2 apart 21.9 / 31.1, pieces 4 apart
29.2 / 38.4; 256 B a step, ``.cg`` 23.0 / 34.0, evict-first 20.1 / 29.1. A warp instruction that
asks for a row's whole 128-byte line (pieces 2 apart: half of each sector, the other half a
step later) reads faster than one that asks for half of it (64 contiguous bytes); spread over
two lines it is slower. The reason for moe_mma2's ``LINES`` K order.

H200 printouts at 8703cfc (session 16, two runs): the tile-major layout (a tile's K-step, 64
rows x 64 bytes, contiguous) 19.6 / 28.5 and 19.7 / 28.6 us against 23.4 / 33.2 and 23.6 / 33.5
for the rows layout, 20.0 / 29.0 for 256 B a step; stream_read 20.7 / 21.0. The reason for
moe_mma2's ``TILED`` (pack_tile_major), which gained less in the MoE itself.

The down rows as column slices (session 19, evict-first), H200 printout at 1c7e29b, alone /
after the gate/up rows: 32 rows x 1 KB a program 14.2 / 33.2 us; 32-byte slices of 256 rows
16.4 / 35.4, of 128 rows 15.6 / 35.0; 64-byte slices of 256 rows 13.8 / 32.8. A launch doing
each gate/up tile's down work at once would read its down weights so (tune_moe round 27).
"""
from __future__ import annotations

import sys

import dsv4lab  # noqa: F401  (configures the runtime before triton is imported)
import torch
import triton

from dsv4lab import bench
from dsv4lab.kernels.stream_read import rows_read, stream_read


def main() -> int:
    if not torch.cuda.is_available():
        print("probe_weight_reads: needs a CUDA GPU")
        return 2
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    gate_up = torch.randint(0, 2**30, ((48 << 20) // 4,), dtype=torch.int32, device=dev, generator=gen)
    down = torch.randint(0, 2**30, ((24 << 20) // 4,), dtype=torch.int32, device=dev, generator=gen)
    print(f"{torch.cuda.get_device_name()}, triton {triton.__version__}; CUDA graph, dirty L2")
    us = lambda fn: bench.time_graph(fn)["ms"] * 1e3      # noqa: E731
    print(f"  stream_read, 48 MB                               {us(lambda: stream_read(gate_up)):6.1f} us")
    for step, evict, spread, tiled in ((64, False, 1, False), (64, True, 1, False),
                                       (64, True, 2, False), (64, True, 4, False),
                                       (256, False, 1, False), (256, True, 1, False),
                                       (64, True, 1, True)):
        tag = (f"gate/up rows, {step:3d} B a row a step, {'evict-first' if evict else '.cg        '}"
               f", pieces {spread} apart{', tile-major' if tiled else ''}")
        gu = dict(row_bytes=2048, rows=64, step=step, slices=2, evict=evict, spread=spread,
                  tile_major=tiled)
        dn = dict(row_bytes=1024, rows=32, step=step, slices=1, evict=evict, spread=spread,
                  tile_major=tiled)
        one = us(lambda: rows_read(gate_up, **gu))
        both = us(lambda: (rows_read(gate_up, **gu), rows_read(down, **dn)))
        print(f"  {tag}  {one:6.1f} us; then the down rows: {both:6.1f} us")
    # the down rows read as column slices (a program: 32 or 64 bytes of many rows), as a launch
    # that did each gate/up tile's down work at once (its K slice of every row) would read them
    gu = dict(row_bytes=2048, rows=64, step=64, slices=2, evict=True)
    for tag, dn in (("down rows, 32 rows x 1 KB a program      ", dict(rows=32, step=64, slices=1)),
                    ("down columns, 256 rows x 32 B a program  ", dict(rows=256, step=32, slices=32)),
                    ("down columns, 128 rows x 32 B a program  ", dict(rows=128, step=32, slices=32)),
                    ("down columns, 256 rows x 64 B a program  ", dict(rows=256, step=64, slices=16))):
        dn = dict(dn, row_bytes=1024, evict=True)
        alone = us(lambda: rows_read(down, **dn))
        after = us(lambda: (rows_read(gate_up, **gu), rows_read(down, **dn)))
        print(f"  {tag} alone {alone:6.1f} us; after the gate/up rows {after:6.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
