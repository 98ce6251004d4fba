"""Shared by the MoE test files: routings with the awkward cases drawn in, experts quantised
expert by expert, and the NVFP4 globals as the kernels take them."""
import torch

from dsv4lab.ops import fused_moe, route
from dsv4lab.quant import mxfp4_quantize, nvfp4_quantize

ROUTINGS = ("random", "skewed", "holes")
# max abs error relative to max |reference| (see tests/test_moe.py's docstring)
TOL = {torch.float32: 3e-3, torch.bfloat16: 1.2e-2, torch.float16: 4e-3}


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


def quantise(w: torch.Tensor, fmt: str):
    """One expert's weights [N, K] -> (packed, scales, NVFP4 global scale as a 0-d tensor or None)."""
    if fmt == "mxfp4":
        return (*mxfp4_quantize(w), None)
    return nvfp4_quantize(w)


def make_experts(E, H, I, fmt, *, seed=0, device="cpu", scale=0.5, gen=None):
    """E random experts (w13 [E, 2I, H], w2 [E, H, I] times ``scale``) quantised to ``fmt``
    one expert at a time, on ``device``: the float64 quantiser's peak is one expert's, so that
    Flash-size experts fit many test workers on one GPU. ``kw``: the NVFP4 global scales, one
    per expert ([E] fp32 on ``device``; empty for MXFP4). ``gen(shape)`` may draw the weights."""
    g = torch.Generator(device=device).manual_seed(seed)
    draw = gen or (lambda *shape: torch.randn(*shape, generator=g, device=device) * scale)
    parts = {n: [] for n in ("w13", "w13_scale", "g13", "w2", "w2_scale", "g2")}
    for _ in range(E):
        for name, shape in (("13", (2 * I, H)), ("2", (H, I))):
            p, s, gl = quantise(draw(*shape), fmt)
            parts[f"w{name}"].append(p)
            parts[f"w{name}_scale"].append(s)
            parts[f"g{name}"].append(gl)
    ex = {n: torch.stack(parts[n]) for n in ("w13", "w13_scale", "w2", "w2_scale")}
    ex["kw"] = {} if fmt == "mxfp4" else dict(
        w13_global=torch.stack(parts["g13"]).to(device), w2_global=torch.stack(parts["g2"]).to(device))
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()     # hand the quantisers' float64 blocks back to the GPU
    return ex


def per_expert_globals(ex: dict, device=None) -> dict:
    """``ex["kw"]``'s NVFP4 global scales as contiguous fp32 [E] tensors on ``device`` (default:
    where they are), the form the kernels read (MXFP4: none)."""
    E = ex["w13"].shape[0]
    return {n: v.to(device).reshape(-1).expand(E).contiguous() for n, v in ex["kw"].items()}


def run_moe(x, ex, ids, w, fmt, limit, backend, **kw):
    """``ops.fused_moe`` on the experts ``ex``."""
    return fused_moe(x, ex["w13"], ex["w13_scale"], ex["w2"], ex["w2_scale"], ids, w, fmt=fmt,
                     swiglu_limit=limit, backend=backend, **ex["kw"], **kw)


def assert_close(out, ref, dtype):
    """max |out - ref| <= TOL[dtype] * max |ref| (+ 1e-5)."""
    err = (out.float() - ref.float()).abs().max().item()
    mag = ref.float().abs().max().item()
    assert err <= TOL[dtype] * mag + 1e-5, f"max err {err} vs max |ref| {mag} (tol {TOL[dtype]})"
