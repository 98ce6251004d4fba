"""Mixture-of-experts: routing, and the FP4 expert computation ``fused_moe``.

- :func:`route`: DeepSeek-V4's gate. Scores ``sqrt(softplus(logit))``; a per-expert bias
  (noaux_tc) is added for SELECTION only; the weights are the unbiased scores of the
  chosen experts, normalised to sum 1, times ``routed_scaling_factor`` (1.5).
- :func:`hash_route`: the first ``n_hash_layers`` layers pick experts by a token-id table
  (``tid2eid``). Weights follow the reference design (inference/model.py ``Gate``): the
  unbiased scores of the hashed experts, normalised, times 1.5, when the router logits are
  given; without logits, uniform ``routed_scaling_factor / k`` (what the normalised weights
  become when every score is equal).
- :func:`fused_moe`: ``y[t] = sum_j w[t,j] * W2[e] act(W13[e] x[t])`` over MXFP4 or NVFP4
  experts; ``act = silu(min(g, L)) * clamp(u, -L, L)`` with ``swiglu_limit`` L (the
  reference clamps the gate from above only), else ``silu(g) * u``. Expert id -1 (or any id
  outside ``[0, E)``) is skipped.

Backends of op "fused_moe": "torch" (dequantise the experts hit, fp32 matmuls: the
reference), "triton" (the portable port in :mod:`dsv4lab.kernels.moe`), and "trtllm_fp4",
flashinfer's ``trtllm_fp4_block_scale_moe`` modelled as an external, SM100-only backend,
the one the campaign's draft model was sent to on GPUs it cannot run on.

Explained in notebooks/04_mxfp4_moe_port.ipynb.
"""
from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from dsv4lab import backends
from dsv4lab.runtime import is_capturing as _is_capturing
from dsv4lab.backends import BackendUnavailable
from dsv4lab.quant.fp4 import mxfp4_dequantize, nvfp4_dequantize

__all__ = ["route", "hash_route", "fused_moe", "moe_dense", "swiglu", "check_fused_moe_args",
           "SCORE_FUNCS", "FORMATS"]

SCORE_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")
FORMATS = ("mxfp4", "nvfp4")
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_INTS = (torch.int32, torch.int64)


# ---------------------------------------------------------------- routing -----------------
def _scores(logits: torch.Tensor, score: str) -> torch.Tensor:
    lf = logits.float()
    if score == "sqrtsoftplus":
        return F.softplus(lf).sqrt()
    if score == "sigmoid":
        return lf.sigmoid()
    return lf.softmax(dim=-1)


def _finish_weights(w: torch.Tensor, norm_topk_prob: bool, routed_scaling_factor: float) -> torch.Tensor:
    if norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    return (w * routed_scaling_factor).float()


def _check_route_opts(score, routed_scaling_factor):
    if score not in SCORE_FUNCS:
        raise ValueError(f"score must be one of {', '.join(SCORE_FUNCS)}, got {score!r}")
    if not isinstance(routed_scaling_factor, (int, float)) or not routed_scaling_factor > 0:
        raise ValueError(f"routed_scaling_factor must be a positive number, got {routed_scaling_factor!r}")


def route(router_logits: torch.Tensor, bias: torch.Tensor | None, *, topk: int = 6,
          score: str = "sqrtsoftplus", routed_scaling_factor: float = 1.5,
          norm_topk_prob: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts per token: ``(topk_ids int32 [T, k], topk_weights fp32 [T, k])``.

    ``bias [E]`` shifts the scores for selection only (noaux_tc); weights are the unbiased
    scores of the chosen experts, normalised to sum 1 (``norm_topk_prob``) and scaled.
    Explained in notebooks/04_mxfp4_moe_port.ipynb.
    """
    if not isinstance(router_logits, torch.Tensor) or router_logits.dim() != 2:
        raise ValueError(f"router_logits must be a [T, E] tensor, got "
                         f"{getattr(router_logits, 'shape', type(router_logits).__name__)}")
    if router_logits.dtype not in _FLOATS:
        raise ValueError(f"router_logits must be float32, float16 or bfloat16, got {router_logits.dtype}")
    T, E = router_logits.shape
    if not isinstance(topk, int) or not 1 <= topk <= E:
        raise ValueError(f"topk must be an int in [1, E={E}], got {topk!r}")
    _check_route_opts(score, routed_scaling_factor)
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (E,):
            raise ValueError(f"bias must be None or a [E={E}] tensor, got "
                             f"{getattr(bias, 'shape', type(bias).__name__)}")
        if bias.device != router_logits.device:
            raise ValueError(f"bias is on {bias.device}, router_logits on {router_logits.device}")
    scores = _scores(router_logits, score)
    select = scores if bias is None else scores + bias.float()
    ids = select.topk(topk, dim=-1).indices
    w = scores.gather(1, ids)
    return ids.to(torch.int32), _finish_weights(w, norm_topk_prob, routed_scaling_factor)


def hash_route(token_ids: torch.Tensor, table: torch.Tensor, router_logits: torch.Tensor | None = None,
               *, score: str = "sqrtsoftplus", routed_scaling_factor: float = 1.5,
               norm_topk_prob: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Hash routing of the first layers: experts ``table[token_id]`` (``tid2eid``).

    Returns ``(topk_ids int32 [T, k], topk_weights fp32 [T, k])``. With ``router_logits
    [T, E]`` the weights are the reference design's: unbiased scores of the hashed experts,
    normalised, times ``routed_scaling_factor``; without them, uniform
    ``routed_scaling_factor / k``. No host synchronisation while a CUDA graph is being
    captured: the value checks (token ids inside the table, expert ids inside ``[0, E)``)
    then are skipped, as in :func:`fused_moe`; shape/dtype/device checks always run.
    Explained in notebooks/04_mxfp4_moe_port.ipynb.
    """
    if not isinstance(token_ids, torch.Tensor) or token_ids.dtype not in _INTS or token_ids.dim() != 1:
        raise ValueError(f"token_ids must be a 1-D int32/int64 tensor [T], got "
                         f"{getattr(token_ids, 'dtype', type(token_ids).__name__)} "
                         f"{list(getattr(token_ids, 'shape', []))}")
    if not isinstance(table, torch.Tensor) or table.dtype not in _INTS or table.dim() != 2:
        raise ValueError("table must be a 2-D int32/int64 tensor [vocab, k] (token id -> experts)")
    if table.device != token_ids.device:
        raise ValueError(f"table is on {table.device}, token_ids on {token_ids.device}")
    _check_route_opts(score, routed_scaling_factor)
    V, k = table.shape
    capturing = _is_capturing(token_ids)      # value checks need the host: skipped in a capture
    if token_ids.numel() and not capturing and (int(token_ids.min()) < 0 or int(token_ids.max()) >= V):
        raise ValueError(f"token_ids must lie in [0, {V}) (the table's vocab), got "
                         f"[{int(token_ids.min())}, {int(token_ids.max())}]")
    ids = table[token_ids.long()]
    T = token_ids.shape[0]
    if router_logits is None:
        w = torch.full((T, k), routed_scaling_factor / k, dtype=torch.float32, device=token_ids.device)
        return ids.to(torch.int32), w
    if not isinstance(router_logits, torch.Tensor) or router_logits.dim() != 2 or \
            router_logits.shape[0] != T or router_logits.dtype not in _FLOATS:
        raise ValueError(f"router_logits must be a float [T={T}, E] tensor, got "
                         f"{getattr(router_logits, 'dtype', None)} {list(getattr(router_logits, 'shape', []))}")
    E = router_logits.shape[1]
    if ids.numel() and not capturing and (int(ids.min()) < 0 or int(ids.max()) >= E):
        raise ValueError(f"table holds expert ids outside [0, E={E})")
    w = _scores(router_logits, score).gather(1, ids.long())
    return ids.to(torch.int32), _finish_weights(w, norm_topk_prob, routed_scaling_factor)


# ---------------------------------------------------------------- fused_moe ---------------
def swiglu(h13: torch.Tensor, swiglu_limit: float | None) -> torch.Tensor:
    """``[.., 2I]`` (gate | up) -> ``[.., I]``: silu(min(g, L)) * clamp(u, -L, L), or silu(g) * u."""
    inter = h13.shape[-1] // 2
    g, u = h13[..., :inter], h13[..., inter:]
    if swiglu_limit is not None:
        g = g.clamp(max=swiglu_limit)
        u = u.clamp(-swiglu_limit, swiglu_limit)
    return F.silu(g) * u


def _scalar_or_per_expert(g, name: str, E: int, device) -> torch.Tensor:
    """NVFP4 global scale: a float, 0-d or [E] fp32 tensor -> fp32 [E] on ``device``.

    Capturable: a Python float becomes a device fill, a device tensor a device copy. A CPU
    tensor needs a host->device copy, which a CUDA graph cannot capture, so while capturing
    it is refused with a ValueError (move the global scales to the GPU once, at load time).
    """
    device = torch.device(device)
    if isinstance(g, bool) or not isinstance(g, (int, float, torch.Tensor)):
        raise ValueError(f"{name} must be given for fmt='nvfp4' (a float, 0-d or [E] fp32 tensor), "
                         f"got {type(g).__name__}")
    if isinstance(g, (int, float)):
        return torch.full((E,), float(g), dtype=torch.float32, device=device)
    if g.dtype != torch.float32:
        raise ValueError(f"{name} must be float32, got {g.dtype}")
    if g.dim() == 0 or (g.dim() == 1 and g.shape[0] == 1):
        g = g.reshape(1).expand(E)
    elif tuple(g.shape) != (E,):
        raise ValueError(f"{name} must be a scalar or [E={E}], got {list(g.shape)}")
    if g.device != device:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise ValueError(f"{name} is on {g.device} but x is on {device} and a CUDA graph is being "
                             f"captured: a host->device copy cannot be captured; pass {name} as a "
                             f"{device.type} tensor (or a Python float)")
        g = g.to(device)
    return g.contiguous()


def check_fused_moe_args(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, *, fmt,
                         w13_global, w2_global, swiglu_limit):
    """Validate every argument of :func:`fused_moe`; return (E, I, w13_global[E], w2_global[E]).

    Value checks that need the host (expert ids in range, finite weights) are skipped while
    a CUDA graph is being captured; the kernels skip out-of-range ids either way.
    """
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a [T, hidden] tensor, got {getattr(x, 'shape', type(x).__name__)}")
    if x.dtype not in _FLOATS:
        raise ValueError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    T, H = x.shape
    if H == 0 or H % 32:
        raise ValueError(f"x: hidden={H} must be a positive multiple of 32")
    for name, w in (("w13", w13), ("w2", w2)):
        if not isinstance(w, torch.Tensor) or w.dtype != torch.uint8 or w.dim() != 3:
            raise ValueError(f"{name} must be a packed FP4 uint8 tensor [E, N, K/2], got "
                             f"{getattr(w, 'dtype', type(w).__name__)} {list(getattr(w, 'shape', []))}")
        if w.device != x.device:
            raise ValueError(f"{name} is on {w.device}, x on {x.device}")
    E, two_i, hk = w13.shape
    if hk * 2 != H:
        raise ValueError(f"w13 must be [E, 2I, hidden/2={H // 2}], got {list(w13.shape)}")
    if two_i == 0 or two_i % 64:
        raise ValueError(f"w13: 2I={two_i} must be 2x a positive multiple of 32 (gate rows then up rows)")
    inter = two_i // 2
    if tuple(w2.shape) != (E, H, inter // 2):
        raise ValueError(f"w2 must be [E={E}, hidden={H}, I/2={inter // 2}], got {list(w2.shape)}")
    blk, sdt, sdesc = (32, torch.uint8, "uint8 E8M0") if fmt == "mxfp4" else (16, torch.float8_e4m3fn, "float8_e4m3fn")
    for name, s, n, k in (("w13_scale", w13_scale, two_i, H), ("w2_scale", w2_scale, H, inter)):
        if not isinstance(s, torch.Tensor) or s.dtype != sdt:
            raise ValueError(f"{name} must be {sdesc} for fmt={fmt!r}, got {getattr(s, 'dtype', type(s).__name__)}")
        if tuple(s.shape) != (E, n, k // blk):
            raise ValueError(f"{name} must be [E={E}, {n}, {k // blk}] (one per {blk}) for fmt={fmt!r}, "
                             f"got {list(s.shape)}")
        if s.device != x.device:
            raise ValueError(f"{name} is on {s.device}, x on {x.device}")
    if fmt == "mxfp4":
        if w13_global is not None or w2_global is not None:
            raise ValueError("w13_global/w2_global are NVFP4 global scales; they must be None for fmt='mxfp4'")
        g13 = g2 = None
    else:
        g13 = _scalar_or_per_expert(w13_global, "w13_global", E, x.device)
        g2 = _scalar_or_per_expert(w2_global, "w2_global", E, x.device)
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dtype not in _INTS or topk_ids.dim() != 2 \
            or topk_ids.shape[0] != T:
        raise ValueError(f"topk_ids must be an int32/int64 [T={T}, k] tensor, got "
                         f"{getattr(topk_ids, 'dtype', None)} {list(getattr(topk_ids, 'shape', []))}")
    if not isinstance(topk_weights, torch.Tensor) or topk_weights.dtype not in _FLOATS \
            or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights must be a float tensor shaped like topk_ids {list(topk_ids.shape)}, got "
                         f"{getattr(topk_weights, 'dtype', None)} {list(getattr(topk_weights, 'shape', []))}")
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    if topk_ids.shape[1] == 0:
        raise ValueError("topk_ids: k must be at least 1")
    if swiglu_limit is not None and not (isinstance(swiglu_limit, (int, float)) and swiglu_limit > 0):
        raise ValueError(f"swiglu_limit must be None or a positive number, got {swiglu_limit!r}")
    if topk_ids.numel() and not _is_capturing(x):
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < -1 or hi >= E:
            raise ValueError(f"topk_ids must lie in [-1, E={E}) (-1 = no expert), got [{lo}, {hi}]")
        if not bool(torch.isfinite(topk_weights).all()):
            raise ValueError("topk_weights contains NaN or Inf")
        if not bool(torch.isfinite(x).all()):
            raise ValueError("x contains NaN or Inf")
    return E, inter, g13, g2


def moe_dense(x, w13, w2, topk_ids, topk_weights, *, swiglu_limit=None, compute_dtype=None):
    """MoE over dense (already dequantised) weights ``w13 [E, 2I, H]``, ``w2 [E, H, I]``.

    A loop over the experts hit: the "torch" reference (fp32) and the "bf16 weights
    dequantised at load" baseline of the benchmark. Host-syncs (it asks which experts
    were hit), so it is not CUDA-graph capturable.
    """
    cdt = compute_dtype or w13.dtype
    T, k = topk_ids.shape
    E = w13.shape[0]
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    flat = topk_ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < E)
    pair = torch.arange(flat.numel(), device=x.device)[valid]
    eid = flat[valid]
    order = torch.argsort(eid, stable=True)
    pair, eid = pair[order], eid[order]
    experts, counts = torch.unique_consecutive(eid, return_counts=True)
    wflat = topk_weights.reshape(-1).float()
    start = 0
    for e, c in zip(experts.tolist(), counts.tolist()):
        p = pair[start:start + c]
        start += c
        tok = p // k
        xe = x[tok].to(cdt)
        h = xe @ w13[e].to(cdt).t()
        a = swiglu(h.float(), swiglu_limit).to(cdt)
        y = (a @ w2[e].to(cdt).t()).float()
        out.index_add_(0, tok, y * wflat[p, None])
    return out.to(x.dtype)


@backends.register("fused_moe", "torch", kind="torch", priority=0, formats=FORMATS,
                   description="dequantise the experts hit to fp32, matmul: the reference")
def _fused_moe_torch(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, *, fmt,
                     w13_global, w2_global, swiglu_limit):
    """Dequantise the experts hit to fp32 and matmul (the reference)."""
    from dsv4lab.kernels.moe import check_canonical
    check_canonical("fused_moe (torch)", w13=w13, w13_scale=w13_scale, w2=w2, w2_scale=w2_scale)
    T, k = topk_ids.shape
    E = w13.shape[0]
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    flat = topk_ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < E)
    wflat = topk_weights.reshape(-1).float()
    pairs = torch.arange(flat.numel(), device=x.device)
    for e in torch.unique(flat[valid]).tolist():
        p = pairs[valid & (flat == e)]
        tok = p // k
        if fmt == "mxfp4":
            W13 = mxfp4_dequantize(w13[e], w13_scale[e])
            W2 = mxfp4_dequantize(w2[e], w2_scale[e])
        else:
            W13 = nvfp4_dequantize(w13[e], w13_scale[e], w13_global[e])
            W2 = nvfp4_dequantize(w2[e], w2_scale[e], w2_global[e])
        h = x[tok].float() @ W13.t()
        y = swiglu(h, swiglu_limit) @ W2.t()
        out.index_add_(0, tok, y * wflat[p, None])
    return out.to(x.dtype)


@backends.register("fused_moe", "triton", kind="triton", priority=20, formats=FORMATS,
                   description="the portable Triton port (kernels/moe.py): sm_80/90/120, interpreter")
def _fused_moe_triton(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, *, fmt,
                      w13_global, w2_global, swiglu_limit, kernel_config=None):
    """Grouped FP4 MoE in Triton: dequantise in registers, fused SwiGLU, weighted combine."""
    from dsv4lab.kernels import moe as kmoe
    return kmoe.fused_moe(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, fmt=fmt,
                          w13_global=w13_global, w2_global=w2_global, swiglu_limit=swiglu_limit,
                          config=kernel_config)


@backends.register("fused_moe", "triton_scaled", kind="triton", priority=10, formats=("mxfp4",),
                   min_capability=(8, 0), auto=False,
                   description="MXFP4 MoE on tl.dot_scaled (kernels/moe_scaled.py): sm_80+, interpreter")
def _fused_moe_triton_scaled(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, *, fmt,
                             w13_global, w2_global, swiglu_limit, kernel_config=None):
    """Grouped MXFP4 MoE on Triton's ``tl.dot_scaled`` (e2m1 upcast in registers + MMA)."""
    from dsv4lab.kernels import moe_scaled as kms
    return kms.fused_moe_scaled(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights,
                                swiglu_limit=swiglu_limit, config=kernel_config)


def _flashinfer_missing() -> str | None:
    if importlib.util.find_spec("flashinfer") is None:
        return "needs flashinfer (its trtllm_fp4_block_scale_moe kernel); flashinfer is not installed"
    return None


@backends.register("fused_moe", "trtllm_fp4", kind="external", priority=100,
                   formats=FORMATS, min_capability=(10, 0), max_capability=(10, 3),
                   interpreter=False, requires=_flashinfer_missing,
                   description="flashinfer trtllm_fp4_block_scale_moe (SM100-only, external)")
def _fused_moe_trtllm(*args, **kwargs):
    """flashinfer's SM100-only ``trtllm_fp4_block_scale_moe`` (modelled for dispatch)."""
    raise BackendUnavailable(
        "fused_moe: backend 'trtllm_fp4' is modelled for dispatch only: dsv4lab does not ship "
        "the shuffled weight layout flashinfer's trtllm_fp4_block_scale_moe expects; "
        "use backend='triton'")


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
              w2_scale: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
              fmt: str = "mxfp4", w13_global=None, w2_global=None,
              swiglu_limit: float | None = None, backend: str = "auto",
              kernel_config: dict | None = None) -> torch.Tensor:
    """Routed experts over FP4 weights: ``[T, hidden]`` in x's dtype.

    ``w13 uint8 [E, 2I, hidden/2]`` (gate rows, then up rows), ``w2 uint8 [E, hidden, I/2]``;
    scales uint8 E8M0 ``[.., K/32]`` (mxfp4) or float8_e4m3fn ``[.., K/16]`` with fp32
    global scales (a float, 0-d or per-expert [E]) for nvfp4. ``topk_ids`` -1 is skipped.
    ``kernel_config`` overrides the Triton kernel's launch table (keys of
    ``dsv4lab.kernels.moe.CONFIG_KEYS``; benchmarks use it to time named variants).
    Explained in notebooks/04_mxfp4_moe_port.ipynb.
    """
    E, inter, g13, g2 = check_fused_moe_args(
        x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, fmt=fmt,
        w13_global=w13_global, w2_global=w2_global, swiglu_limit=swiglu_limit)
    chosen = backends.resolve("fused_moe", backend, fmt=fmt, device=x.device)
    extra = {}
    if kernel_config is not None:
        if chosen.name not in ("triton", "triton_scaled"):
            raise ValueError(f"kernel_config applies to the 'triton' backend only (and 'triton_scaled'); "
                             f"resolved {chosen.name!r}")
        extra["kernel_config"] = dict(kernel_config)
    if x.shape[0] == 0:
        return torch.zeros_like(x)
    return chosen.fn(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, fmt=fmt,
                     w13_global=g13, w2_global=g2,
                     swiglu_limit=None if swiglu_limit is None else float(swiglu_limit), **extra)
