"""Shared by the MoE test files: routings with the awkward cases drawn in, experts quantised
from their weights, and the NVFP4 globals as the kernels take them."""
import torch

from dsv4lab.ops import route
from dsv4lab.quant import mxfp4_quantize, nvfp4_quantize

ROUTINGS = ("random", "skewed", "holes")


def draw_routing(T: int, E: int, k: int, routing: str, g: torch.Generator):
    """(ids, weights) from ``route`` on random logits; "skewed" sends every token to one
    expert (k = 1 slot each, the rest -1), "holes" sprinkles -1 slots in."""
    ids, w = route(torch.randn(T, E, generator=g), None, topk=k)
    if routing == "skewed":
        ids[:, 0] = E - 1
        ids[:, 1:] = -1
    elif routing == "holes":
        ids[torch.rand(T, k, generator=g) < 0.4] = -1
    return ids, w


def quantised_experts(w13: torch.Tensor, w2: torch.Tensor, fmt: str) -> dict:
    """Weights w13 [E, 2I, H] and w2 [E, H, I] quantised to ``fmt`` where they are: the packed
    weights and scales, and ``kw`` the NVFP4 global scales (empty for MXFP4)."""
    if fmt == "mxfp4":
        (a, b), (c, d), kw = mxfp4_quantize(w13), mxfp4_quantize(w2), {}
    else:
        a, b, g13 = nvfp4_quantize(w13)
        c, d, g2 = nvfp4_quantize(w2)
        kw = dict(w13_global=g13, w2_global=g2)
    if w13.is_cuda:
        # the quantisers work in float64: at Flash's sizes the peak is many GB, which torch's
        # allocator would keep reserved in this process; with 8 xdist workers on one GPU those
        # reservations together ran it out of memory (torch.OutOfMemoryError, session 23)
        torch.cuda.empty_cache()
    return dict(w13=a, w13_scale=b, w2=c, w2_scale=d, kw=kw)


def per_expert_globals(ex: dict, device=None) -> dict:
    """``ex["kw"]``'s NVFP4 global scales (one per tensor; MXFP4 has none) expanded to [E]
    tensors on ``device`` (default: where they are), the per-expert form the kernels read."""
    E = ex["w13"].shape[0]
    return {n: v.to(device).reshape(1).expand(E).contiguous() for n, v in ex["kw"].items()}
