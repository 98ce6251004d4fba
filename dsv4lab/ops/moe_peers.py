"""A peer of ``fused_moe``: OpenAI's ``triton_kernels`` MXFP4 MoE, as an external backend.

``triton_kernels`` (python/triton_kernels of the Triton repository; the Hopper MXFP4 path vLLM
runs for gpt-oss) is not a dependency: where it imports (put it on ``PYTHONPATH``) and the GPU
is sm_90, ``fused_moe(..., backend="triton_kernels")`` runs the project's call through it, so
that ``dsv4lab bench moe`` times both on the same bytes, routing and activation. "auto" never
picks it. It is gated on sm_90 because the H200 is the only GPU it has been run on here
(the library also has Blackwell layouts, not wired up). It takes MXFP4 only: its microscales
are E8M0 per 32 (no E4M3-per-16 NVFP4).

What the call does, once per weight tensor and then per call:

- **weights** (once, cached by storage, shape, version and a weak reference): w13's gate and up
  rows interleaved (row 2j gate j, row 2j+1 up j, the pairs its fused activation reads), each
  [E, N, K/2] tensor seen as its [E, K, N] with K packed (the project's bytes and E8M0 scales
  are exactly its strided MXFP4), then converted to its Hopper layouts: values
  (``HopperMXValueLayout``: each thread's 16-byte load lands in the register layout of the
  MMA operand, bits pre-shuffled so E2M1 -> bf16 is a few masks and one multiply) and scales
  (``HopperMXScaleLayout``, 8 warps);
- **routing** (per call, on the GPU, no host sync): its top-k does not compile for k = 6, so
  the project's ``topk_ids`` become its ragged metadata: pairs sorted by expert (stable, -1
  last), the sorted pair's token (gather), its destination row (scatter), its weight
  (``gammas``), experts' row counts -> ``make_ragged_tensor_metadata``;
- **compute**: ``matmul`` #1 gathers x's rows and applies the project's clamped SwiGLU,
  silu(min(g, L)) * clamp(u, -L, L), as its fused activation (its own ``swiglu`` is gpt-oss's
  g*sigmoid(alpha*g)*(u + 1), a different function); ``matmul`` #2 scales by the routing
  weights and scatters each pair's row; ``reduce`` sums a token's k rows, -1 slots masked.

x is rounded to bf16 (its Hopper MXFP4 path multiplies bf16 activations). Explained in
notebooks/04_mxfp4_moe_port.ipynb.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import types
import weakref
from dataclasses import dataclass

import torch

from dsv4lab import backends, runtime
from dsv4lab.kernels.moe.peer_activation import clamped_swiglu

__all__ = ["PEER", "PEER_SOURCE", "clamped_swiglu", "hopper_mx_weight", "interleave_gate_up",
           "opt_flags", "peer_source", "routing_tensors", "unavailable_reason"]

PEER = "triton_kernels"
# the source measured: python/triton_kernels of this mirror's commit (the version for Triton
# 3.6); $DSV4LAB_TRITON_KERNELS_SOURCE names another where one is used
PEER_SOURCE = "triton-lang/Triton-to-tile-IR@d5689405e:python/triton_kernels"
NUM_WARPS = 8            # HopperMXScaleLayout's warps: its matmul runs with as many


def peer_source() -> str:
    """Which triton_kernels a row was measured with (recorded beside the rows)."""
    return os.environ.get("DSV4LAB_TRITON_KERNELS_SOURCE") or PEER_SOURCE


@functools.lru_cache(maxsize=1)
def _tk() -> types.SimpleNamespace:
    """triton_kernels' entry points (imported on first use: it is not a dependency)."""
    matmul = importlib.import_module("triton_kernels.matmul")
    tensor = importlib.import_module("triton_kernels.tensor")
    layout = importlib.import_module("triton_kernels.tensor_details.layout")
    reduce = importlib.import_module("triton_kernels.reduce")
    specialize = importlib.import_module("triton_kernels.specialize")
    opt = importlib.import_module("triton_kernels.matmul_details.opt_flags")
    return types.SimpleNamespace(
        matmul=matmul.matmul, PrecisionConfig=matmul.PrecisionConfig,
        FusedActivation=matmul.FusedActivation, FnSpecs=specialize.FnSpecs, reduce=reduce.reduce,
        Tensor=tensor.Tensor, Storage=tensor.Storage, FP4=tensor.FP4,
        make_ragged_tensor_metadata=tensor.make_ragged_tensor_metadata,
        HopperMXValueLayout=layout.HopperMXValueLayout, HopperMXScaleLayout=layout.HopperMXScaleLayout,
        make_opt_flags=opt.make_opt_flags)


@functools.lru_cache(maxsize=1)
def unavailable_reason() -> str | None:
    """None where triton_kernels imports; else why the backend cannot run (the backend's
    ``requires``: asked after the GPU and format checks)."""
    if importlib.util.find_spec("triton_kernels") is None:
        return ("needs OpenAI's triton_kernels (python/triton_kernels of the Triton repository, "
                "the version for this Triton) on PYTHONPATH; it is not importable here")
    try:
        _tk()
    except Exception as e:  # noqa: BLE001  (any import failure is the reason it cannot run)
        return f"needs OpenAI's triton_kernels; it does not import here ({type(e).__name__}: {e})"
    return None


# ---------------------------------------------------------------- weights -----------------
def interleave_gate_up(t: torch.Tensor) -> torch.Tensor:
    """[E, 2I, ...] with rows 0..I-1 gate and I..2I-1 up -> rows (gate 0, up 0, gate 1, ...)."""
    inter = t.shape[1] // 2
    return torch.stack((t[:, :inter], t[:, inter:]), dim=2).reshape(t.shape)


@dataclass(frozen=True)
class HopperWeight:
    """One weight tensor in triton_kernels' form: values and scales (its ``Tensor``s)."""
    value: object
    scale: object


def hopper_mx_weight(w: torch.Tensor, s: torch.Tensor, *, gate_up: bool, chunk: int = 16) -> HopperWeight:
    """The project's MXFP4 ``w`` uint8 [E, N, K/2] and E8M0 ``s`` [E, N, K/32] -> triton_kernels'
    [E, K, N] MXFP4 in its Hopper value and scale layouts (``gate_up``: interleave w13's gate and
    up rows first). Converted ``chunk`` experts at a time (the layouts keep experts apart), so
    the peak extra memory is a chunk's, not the whole tensor's."""
    tk = _tk()
    E, N, half_k = w.shape
    vals, scales = [], []
    for e0 in range(0, E, chunk):
        wc, sc = w[e0:e0 + chunk], s[e0:e0 + chunk]
        if gate_up:
            wc, sc = interleave_gate_up(wc), interleave_gate_up(sc)
        wc, sc = wc.contiguous().mT, sc.contiguous().mT          # [c, K/2, N], [c, K/32, N]
        v = tk.HopperMXValueLayout(list(wc.shape), mx_axis=1).swizzle_data(wc)
        q = tk.HopperMXScaleLayout(list(sc.shape), mx_axis=1, num_warps=NUM_WARPS).swizzle_data(sc)
        vals.append(v.mT)            # both layouts return a transposed view of a contiguous tensor:
        scales.append(q.mT)          # joined along experts as such, then seen the same way
    v, q = torch.cat(vals).mT, torch.cat(scales).mT
    value = tk.Tensor(tk.Storage(v, tk.HopperMXValueLayout([E, half_k, N], mx_axis=1)),
                      dtype=tk.FP4, shape=[E, 2 * half_k, N], shape_max=[E, 2 * half_k, N])
    scale_shape = [E, s.shape[2], N]
    scale = tk.Tensor(tk.Storage(q, tk.HopperMXScaleLayout(scale_shape, mx_axis=1, num_warps=NUM_WARPS)),
                      dtype=torch.uint8, shape=scale_shape, shape_max=list(scale_shape))
    return HopperWeight(value, scale)


# Converted weights by (storage, shape, strides, dtype, device, version) of the packed bytes and
# of their scales, with weak references to both: a model's weights are converted on their first
# call; an in-place write (a new version) converts again; an entry goes when its tensors do.
_CONVERTED: dict = {}
_CONVERTED_MAX = 8


def _key(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device), t._version)


def _converted(w: torch.Tensor, s: torch.Tensor, *, gate_up: bool) -> HopperWeight:
    key = (_key(w), _key(s), gate_up)
    hit = _CONVERTED.get(key)
    if hit is not None and hit[0]() is w and hit[1]() is s:
        return hit[2]
    if runtime.is_capturing(w):
        raise ValueError("backend 'triton_kernels' converts each weight tensor to its layouts on the "
                         "first call, which a CUDA graph cannot capture: call once before capturing")
    if len(_CONVERTED) >= _CONVERTED_MAX:
        _CONVERTED.pop(next(iter(_CONVERTED)))

    def drop(_ref, key=key):
        _CONVERTED.pop(key, None)
    _CONVERTED[key] = (weakref.ref(w, drop), weakref.ref(s, drop), hopper_mx_weight(w, s, gate_up=gate_up))
    return _CONVERTED[key][2]


# ---------------------------------------------------------------- routing -----------------
@dataclass(frozen=True)
class Routing:
    """The project's routing as triton_kernels reads it, pairs (t, j) numbered t*k + j.

    ``scatter`` int32 [T*k]: the pairs sorted by expert (stable; -1 and other invalid ids last);
    ``gather`` int32 [T*k]: each sorted pair's token; ``gammas`` fp32 [T*k]: its routing
    weight; ``slice_sizes`` int32 [E]: pairs per expert; ``mask`` int8 [T, k, 1]: 1 where the
    slot holds an expert.
    """
    scatter: torch.Tensor
    gather: torch.Tensor
    gammas: torch.Tensor
    slice_sizes: torch.Tensor
    mask: torch.Tensor


_BOUNDS: dict = {}


def _bounds(E: int, device) -> torch.Tensor:
    """0..E (int32) on ``device``, kept: the expert boundaries searched in the sorted ids."""
    key = (E, str(device))
    if key not in _BOUNDS:
        _BOUNDS[key] = torch.arange(E + 1, dtype=torch.int32, device=device)
    return _BOUNDS[key]


def routing_tensors(topk_ids: torch.Tensor, topk_weights: torch.Tensor, E: int) -> Routing:
    """:class:`Routing` from ``topk_ids`` [T, k] (int32/int64, -1 = none) and ``topk_weights``,
    by a few torch ops on their device (no host sync: CUDA-graph capturable)."""
    T, k = topk_ids.shape
    # an id outside [0, E) becomes E: clamped into [-1, E], then -1 -> E (mod E + 1)
    key = topk_ids.reshape(-1).clamp(-1, E).remainder(E + 1).to(torch.int32)
    sorted_key, order = torch.sort(key, stable=True)               # invalid slots sort last
    offs = torch.searchsorted(sorted_key, _bounds(E, key.device), out_int32=True)
    scatter = order.to(torch.int32)
    return Routing(scatter=scatter, gather=scatter // k,
                   gammas=topk_weights.reshape(-1)[order].float(), slice_sizes=offs.diff(),
                   mask=(key != E).view(T, k, 1).view(torch.int8))


# ---------------------------------------------------------------- the backend -------------
def _check_shape(H: int, inter: int, E: int) -> None:
    if H % 128 or inter % 128:
        raise ValueError(f"backend 'triton_kernels' needs hidden and intermediate sizes that are "
                         f"multiples of 128 (its Hopper layouts' tiles), got {H} and {inter}")
    if E >= 65535:
        raise ValueError(f"backend 'triton_kernels' numbers experts in 16 bits: E must be < 65535, got {E}")


def _activation(swiglu_limit):
    tk = _tk()
    spec = tk.FnSpecs("dsv4lab_clamped_swiglu", clamped_swiglu, ("swiglu_limit",), reduction_n=2)
    return tk.FusedActivation(spec, (swiglu_limit,))


@backends.register("fused_moe", PEER, kind="external", priority=10, formats=("mxfp4",),
                   min_capability=(9, 0), max_capability=(9, 0), interpreter=False, auto=False,
                   requires=unavailable_reason,
                   description="OpenAI's triton_kernels MXFP4 MoE (external peer; run on sm_90 only here)")
def _fused_moe_triton_kernels(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, *, fmt,
                              w13_global, w2_global, swiglu_limit):
    """triton_kernels' ragged ``matmul`` x2 and ``reduce`` on the project's arguments."""
    T, H = x.shape
    E, two_i, _ = w13.shape
    _check_shape(H, two_i // 2, E)
    tk = _tk()
    k = topk_ids.shape[1]
    with torch.cuda.device(x.device):
        w1 = _converted(w13, w13_scale, gate_up=True)
        w2c = _converted(w2, w2_scale, gate_up=False)
        r = routing_tensors(topk_ids, topk_weights, E)
        ragged = tk.make_ragged_tensor_metadata(r.slice_sizes, T * k)
        h = tk.matmul(x.to(torch.bfloat16).contiguous(), w1.value, None, a_ragged_metadata=ragged,
                      gather_indx=r.gather, precision_config=tk.PrecisionConfig(b_mx_scale=w1.scale),
                      fused_activation=_activation(swiglu_limit))
        y = tk.matmul(h, w2c.value, None, a_ragged_metadata=ragged, scatter_indx=r.scatter,
                      precision_config=tk.PrecisionConfig(b_mx_scale=w2c.scale), gammas=r.gammas)
        out, _ = tk.reduce(y.view(T, k, H), dim=1, mask=r.mask.expand(T, k, H))
    return out.to(x.dtype)


def opt_flags(T: int, topk: int, E: int, H: int, inter: int, w13, w13_scale, w2, w2_scale) -> dict:
    """The tiles triton_kernels' ``opt_flags`` picks for the two matmuls of a T-token call
    (the same arguments its ``matmul`` passes; GPU only) -> {"gate_up": {...}, "down": {...}}."""
    tk = _tk()
    M = T * topk
    ragged = tk.make_ragged_tensor_metadata(torch.zeros(E, dtype=torch.int32, device=w13.device), M)
    out = {}
    for name, w, s, N, K in (("gate_up", w13, w13_scale, 2 * inter, H), ("down", w2, w2_scale, H, inter)):
        conv = _converted(w, s, gate_up=name == "gate_up")
        pc = tk.PrecisionConfig(b_mx_scale=conv.scale)
        f = tk.make_opt_flags(torch.bfloat16, torch.bfloat16, tk.FP4, pc, 1, M, N, K, ragged,
                              True, False, None, False, False, None)
        out[name] = dict(block_m=f.block_m, block_n=f.block_n, block_k=f.block_k, num_warps=f.num_warps,
                         num_stages=f.num_stages, split_k=f.split_k, is_persistent=f.is_persistent)
    return out
