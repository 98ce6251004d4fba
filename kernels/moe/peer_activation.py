"""The project's clamped SwiGLU as a fused activation for OpenAI's ``triton_kernels`` MoE.

``dsv4lab.ops.moe_peers`` hands it to triton_kernels' matmul (``FnSpecs``), which applies it
to each accumulator tile, so the peer's rows compute the same activation as ours.
"""
import triton
import triton.language as tl


@triton.jit
def clamped_swiglu(acc, swiglu_limit):
    """``acc`` [BM, 2n] holds (gate, up) column pairs; returns silu(min(g, L)) *
    clamp(u, -L, L), or silu(g) * u when ``swiglu_limit`` is None, [BM, n] in fp32."""
    g, u = tl.split(tl.reshape(acc, (acc.shape[0], acc.shape[1] // 2, 2)))
    if swiglu_limit is not None:
        g = tl.minimum(g, swiglu_limit)
        u = tl.clamp(u, -swiglu_limit, swiglu_limit)
    return g / (1.0 + tl.exp(-g)) * u
