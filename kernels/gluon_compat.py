"""Gluon names that moved between Triton releases, resolved once for the Gluon kernels
(kernels/moe_mma2.py, kernels/sparse_mla_ws.py).

- ``cta_barrier``: every thread of the program waits for every other (``bar.sync``).
  Triton 3.6 calls it ``gl.thread_barrier()``; Triton 3.9 has ``gl.barrier(cluster=False)``
  instead. A jit function calls the builtin through this module-level name.

Explained in notebooks/02_mma_attention.ipynb (the Gluon kernels and the Triton they need).
"""
from triton.experimental.gluon import language as gl

cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
