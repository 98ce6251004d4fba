"""Gluon names that moved between Triton releases, resolved once for the Gluon kernels
(kernels/moe_mma2.py, kernels/sparse_mla_ws.py).

- ``cta_barrier``: every thread of the program waits for every other (``bar.sync``).
  Triton 3.6 calls it ``gl.thread_barrier()``; Triton 3.9 has ``gl.barrier(cluster=False)``
  instead. A jit function calls the builtin through this module-level name.
- ``async_load(smem, pointer, mask=None)``: ``cp.async`` from global into shared memory.
  Triton 3.6 calls it ``async_copy.async_copy_global_to_shared``; Triton 3.9 renamed it
  ``async_copy.async_load`` (the old name raises) with the same arguments.

Explained in notebooks/02_mma_attention.ipynb (the Gluon kernels and the Triton they need).
"""
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as _async_copy

cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
async_load = getattr(_async_copy, "async_load", None) or _async_copy.async_copy_global_to_shared
