"""The ops as ``torch.library`` custom ops, and what the eager calls share.

``torch.compile`` cannot trace into a Triton launcher or a host-side check, so each public op
is also the custom op ``torch.ops.dsv4lab.<name>``, with a fake (meta) implementation that
gives its outputs' shapes and dtypes: Dynamo records one node a call and no graph break, and
``mode="reduce-overhead"`` captures the whole step in a CUDA graph. A public function hands
off to its custom op only while it is being compiled (``torch.compiler.is_compiling()``), so
an eager call never pays the dispatcher; the custom op's implementation is the eager function
with ``validate=False`` (no host synchronisation inside a compiled region: a compiled caller
made its inputs itself, as the engine does).

The eager calls share :func:`resolve` (a backend by name, with the device's capability read
once per device) and :func:`triton_runs`. tests/test_compile.py compiles the mini model's
decode step with these ops (fullgraph) and checks it against the eager step.
"""
from __future__ import annotations

from typing import Optional

import torch

from dsv4lab import backends
from dsv4lab.kernels.device import interpreting

# ----------------------------------------------------------------------------------------
# What the eager calls share
# ----------------------------------------------------------------------------------------

_TARGETS: dict = {}


def target(device: torch.device) -> backends.Target:
    """:meth:`dsv4lab.backends.Target.current` of ``device``, asked once per device."""
    key = (device.type, device.index)
    t = _TARGETS.get(key)
    if t is None:
        t = _TARGETS[key] = backends.Target.current(device)
    return t


def resolve(op: str, backend: str, *, fmt: str | None = None,
            device: torch.device) -> backends.Backend:
    """:func:`dsv4lab.backends.resolve` on ``device``'s (cached) target."""
    return backends.resolve(op, backend, fmt=fmt, target=target(device))


def triton_runs(device: torch.device) -> bool:
    """Whether Triton kernels can run on ``device``'s tensors: a GPU, or the interpreter."""
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


# ----------------------------------------------------------------------------------------
# The custom ops: eager implementation (validate=False) and fake implementation each
# ----------------------------------------------------------------------------------------

def _op(name: str):
    return torch.library.custom_op(f"dsv4lab::{name}", mutates_args=())


@_op("sparse_mla_decode")
def sparse_mla_decode(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                      attn_sink: Optional[torch.Tensor], *, d_v: int,
                      softmax_scale: Optional[float],
                      backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    from dsv4lab.ops.attention import sparse_mla_decode as eager
    return eager(q, kv, indices, d_v=d_v, softmax_scale=softmax_scale, attn_sink=attn_sink,
                 backend=backend, validate=False)


@sparse_mla_decode.register_fake
def _(q, kv, indices, attn_sink, *, d_v, softmax_scale, backend):
    B, S, H, _ = q.shape
    return q.new_empty((B, S, H, d_v)), q.new_empty((B, S, H), dtype=torch.float32)


def _logits_width(block_table, k_cache, max_context):
    return max_context if max_context is not None else block_table.shape[1] * k_cache.shape[1]


@_op("indexer_logits")
def indexer_logits(q: torch.Tensor, k_cache: torch.Tensor, k_scale: torch.Tensor,
                   weights: torch.Tensor, block_table: torch.Tensor, context_lens: torch.Tensor,
                   *, max_context: Optional[int], backend: str) -> torch.Tensor:
    from dsv4lab.ops.indexer import indexer_logits as eager
    return eager(q, k_cache, k_scale, weights, block_table, context_lens,
                 max_context=max_context, backend=backend, validate=False)


@indexer_logits.register_fake
def _(q, k_cache, k_scale, weights, block_table, context_lens, *, max_context, backend):
    B, S = q.shape[:2]
    return q.new_empty((B, S, _logits_width(block_table, k_cache, max_context)),
                       dtype=torch.float32)


@_op("indexer_topk")
def indexer_topk(q: torch.Tensor, k_cache: torch.Tensor, k_scale: torch.Tensor,
                 weights: torch.Tensor, block_table: torch.Tensor, context_lens: torch.Tensor,
                 *, max_context: Optional[int], topk: int, backend: str) -> torch.Tensor:
    from dsv4lab.ops.indexer import indexer_topk as eager
    return eager(q, k_cache, k_scale, weights, block_table, context_lens,
                 max_context=max_context, topk=topk, backend=backend, validate=False)


@indexer_topk.register_fake
def _(q, k_cache, k_scale, weights, block_table, context_lens, *, max_context, topk, backend):
    B, S = q.shape[:2]
    return q.new_empty((B, S, topk), dtype=torch.int32)


@_op("to_cache_slots")
def to_cache_slots(indices: torch.Tensor, block_table: torch.Tensor,
                   page_size: int) -> torch.Tensor:
    from dsv4lab.ops.indexer import to_cache_slots as eager
    return eager(indices, block_table, page_size, validate=False)


@to_cache_slots.register_fake
def _(indices, block_table, page_size):
    return indices.new_empty(indices.shape, dtype=torch.int32)


@_op("route")
def route(router_logits: torch.Tensor, bias: Optional[torch.Tensor], *, topk: int, score: str,
          routed_scaling_factor: float,
          norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from dsv4lab.ops.moe import route as eager
    return eager(router_logits, bias, topk=topk, score=score,
                 routed_scaling_factor=routed_scaling_factor, norm_topk_prob=norm_topk_prob)


@route.register_fake
def _(router_logits, bias, *, topk, score, routed_scaling_factor, norm_topk_prob):
    T = router_logits.shape[0]
    return (router_logits.new_empty((T, topk), dtype=torch.int32),
            router_logits.new_empty((T, topk), dtype=torch.float32))


@_op("hash_route")
def hash_route(token_ids: torch.Tensor, table: torch.Tensor,
               router_logits: Optional[torch.Tensor], *, score: str,
               routed_scaling_factor: float,
               norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from dsv4lab.ops.moe import hash_route as eager
    return eager(token_ids, table, router_logits, score=score,
                 routed_scaling_factor=routed_scaling_factor, norm_topk_prob=norm_topk_prob,
                 validate=False)


@hash_route.register_fake
def _(token_ids, table, router_logits, *, score, routed_scaling_factor, norm_topk_prob):
    T, k = token_ids.shape[0], table.shape[1]
    return (token_ids.new_empty((T, k), dtype=torch.int32),
            token_ids.new_empty((T, k), dtype=torch.float32))


@_op("fused_moe")
def fused_moe(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
              w2_scale: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
              w13_global: Optional[torch.Tensor], w2_global: Optional[torch.Tensor], *,
              fmt: str, swiglu_limit: Optional[float], backend: str) -> torch.Tensor:
    from dsv4lab.ops.moe import fused_moe as eager
    return eager(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, fmt=fmt,
                 w13_global=w13_global, w2_global=w2_global, swiglu_limit=swiglu_limit,
                 backend=backend, validate=False)


@fused_moe.register_fake
def _(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, w13_global, w2_global, *, fmt,
      swiglu_limit, backend):
    return torch.empty_like(x)


@_op("mhc_pre")
def mhc_pre(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *,
            iters: int, eps: float, backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from dsv4lab.ops.mhc import mhc_pre as eager
    return eager(x, fn, base, scale, iters=iters, eps=eps, backend=backend)


@mhc_pre.register_fake
def _(x, fn, base, scale, *, iters, eps, backend):
    lead, (n, d) = tuple(x.shape[:-2]), tuple(x.shape[-2:])
    return (x.new_empty(lead + (d,)), x.new_empty(lead + (n,), dtype=torch.float32),
            x.new_empty(lead + (n, n), dtype=torch.float32))


@_op("mhc_post")
def mhc_post(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
             *, backend: str) -> torch.Tensor:
    from dsv4lab.ops.mhc import mhc_post as eager
    return eager(out, residual, post, comb, backend=backend)


@mhc_post.register_fake
def _(out, residual, post, comb, *, backend):
    return torch.empty_like(residual, memory_format=torch.contiguous_format)


@_op("mhc_head")
def mhc_head(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, *, eps: float,
             backend: str) -> torch.Tensor:
    from dsv4lab.ops.mhc import mhc_head as eager
    return eager(x, fn, base, eps=eps, backend=backend)


@mhc_head.register_fake
def _(x, fn, base, *, eps, backend):
    return x.new_empty(tuple(x.shape[:-2]) + (x.shape[-1],))


@_op("linear")
def linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: Optional[torch.Tensor], *,
           block: list[int], groups: int, backend: str) -> torch.Tensor:
    from dsv4lab.ops.linear import linear as eager
    return eager(x, weight, weight_scale=weight_scale, block=tuple(block), groups=groups,
                 backend=backend, validate=False)


@linear.register_fake
def _(x, weight, weight_scale, *, block, groups, backend):
    return x.new_empty(tuple(x.shape[:-1]) + (weight.shape[0],))


OPS = ("sparse_mla_decode", "indexer_logits", "indexer_topk", "to_cache_slots", "route",
       "hash_route", "fused_moe", "mhc_pre", "mhc_post", "mhc_head", "linear")
