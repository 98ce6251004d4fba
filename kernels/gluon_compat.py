"""What the Gluon kernels (kernels/attention/ws_sm90.py, kernels/moe/mma_sm90.py,
kernels/moe/gemv_sm90.py) share: Gluon names that moved between Triton releases, resolved
once, and the programmatic dependent launch's two PTX instructions, which Gluon has no
builtin for.

- ``cta_barrier``: every thread of the program waits for every other (``bar.sync``).
  Triton 3.6 calls it ``gl.thread_barrier()``; Triton 3.9 has ``gl.barrier(cluster=False)``
  instead. A jit function calls the builtin through this module-level name.
- ``async_load(smem, pointer, mask=None)``: ``cp.async`` from global into shared memory.
  Triton 3.6 calls it ``async_copy.async_copy_global_to_shared``; Triton 3.9 renamed it
  ``async_copy.async_load`` (the old name raises) with the same arguments.
- ``gdc_wait(num_warps)`` / ``gdc_launch_dependents(num_warps)``: ``griddepcontrol.wait`` and
  ``griddepcontrol.launch_dependents`` (sm_90+; kernels/device.py ``pdl_ok``), every thread of
  a program of ``num_warps`` warps issuing them (triton.language.extra.cuda's are for
  ``triton.jit`` kernels).

Explained in notebooks/02_mma_attention.ipynb (the Gluon kernels and the Triton they need).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as _async_copy

cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
async_load = getattr(_async_copy, "async_load", None) or _async_copy.async_copy_global_to_shared


@gluon.jit
def gdc_wait(num_warps: gl.constexpr):
    """``griddepcontrol.wait``: everything the grid this one depends on (a programmatic
    dependent launch) wrote is visible from here on."""
    one: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0 $1", "=r,r",
                              [gl.arange(0, 32 * num_warps, layout=one)], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def gdc_launch_dependents(num_warps: gl.constexpr):
    """``griddepcontrol.launch_dependents``: the grid launched as this one's programmatic
    dependent launch may be scheduled once every program here has issued it."""
    one: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0 $1", "=r,r",
                              [gl.arange(0, 32 * num_warps, layout=one)], dtype=gl.int32,
                              is_pure=False, pack=1)
