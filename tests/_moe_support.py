"""Shared by the MoE test files: routings with the awkward cases drawn in, and the NVFP4
globals as the kernels take them."""
import torch

from dsv4lab.ops import route

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


def per_expert_globals(ex: dict, device=None) -> dict:
    """``ex["kw"]``'s NVFP4 global scales (one per tensor; MXFP4 has none) expanded to [E]
    tensors on ``device`` (default: where they are), the per-expert form the kernels read."""
    E = ex["w13"].shape[0]
    return {n: v.to(device).reshape(1).expand(E).contiguous() for n, v in ex["kw"].items()}
