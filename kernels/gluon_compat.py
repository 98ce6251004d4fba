"""What the Gluon kernels (attention/ws_sm90.py, moe/mma_sm90.py, moe/gemv_sm90.py) share:
Gluon names that moved between Triton releases, and the programmatic dependent launch's PTX.

- ``cta_barrier``: ``bar.sync`` (3.6 ``gl.thread_barrier()``, 3.9 ``gl.barrier``).
- ``async_load(smem, pointer, mask=None)``: ``cp.async`` global to shared (3.6
  ``async_copy_global_to_shared``, 3.9 ``async_load``).
- ``gdc_wait`` / ``gdc_launch_dependents(num_warps)``: ``griddepcontrol`` (sm_90+) for Gluon,
  as triton.language.extra.cuda's are for ``triton.jit``.

Explained in notebooks/02_mma_attention.ipynb.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as _async_copy

cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
async_load = getattr(_async_copy, "async_load", None) or _async_copy.async_copy_global_to_shared


@gluon.jit
def gdc_wait(num_warps: gl.constexpr):
    """``griddepcontrol.wait``: what the grid this one depends on wrote is visible from here."""
    one: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0 $1", "=r,r",
                              [gl.arange(0, 32 * num_warps, layout=one)], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def gdc_launch_dependents(num_warps: gl.constexpr):
    """``griddepcontrol.launch_dependents``: the dependent grid may start once all issued it."""
    one: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0 $1", "=r,r",
                              [gl.arange(0, 32 * num_warps, layout=one)], dtype=gl.int32,
                              is_pure=False, pack=1)
