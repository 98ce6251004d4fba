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
reference), "triton" (the kernel family :mod:`dsv4lab.kernels.moe`: its dispatch picks the
kernel), and "trtllm_fp4", flashinfer's SM100-only ``trtllm_fp4_block_scale_moe``, the one
the campaign's draft model was sent to on GPUs it cannot run on: registered to tell that
story, never picked by "auto", refused by name at resolution.

Explained in notebooks/04_mxfp4_moe_port.ipynb.
"""
from __future__ import annotations

import importlib.util

import weakref

import torch
import torch.nn.functional as F

from dsv4lab import backends
from dsv4lab.runtime import is_capturing as _is_capturing
from dsv4lab.backends import BackendUnavailable
from dsv4lab.kernels.launch import value_check
from dsv4lab.ops import library
from dsv4lab.quant.fp4 import mxfp4_dequantize, nvfp4_dequantize

__all__ = ["route", "hash_route", "fused_moe", "moe_dense", "swiglu", "check_fused_moe_args",
           "check_fused_moe_values", "SCORE_FUNCS", "FORMATS"]

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
    Under ``torch.compile``: the custom op ``torch.ops.dsv4lab.route``. Explained in
    notebooks/04_mxfp4_moe_port.ipynb.
    """
    if torch.compiler.is_compiling():
        return torch.ops.dsv4lab.route(router_logits, bias, topk=topk, score=score,
                                       routed_scaling_factor=float(routed_scaling_factor),
                                       norm_topk_prob=norm_topk_prob)
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
               norm_topk_prob: bool = True, validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Hash routing of the first layers: experts ``table[token_id]`` (``tid2eid``).

    Returns ``(topk_ids int32 [T, k], topk_weights fp32 [T, k])``. With ``router_logits
    [T, E]`` the weights are the reference design's: unbiased scores of the hashed experts,
    normalised, times ``routed_scaling_factor``; without them, uniform
    ``routed_scaling_factor / k``. Checks: shapes, dtypes and devices always; with
    ``validate`` also the values in one host sync (token ids inside the table; with logits,
    the table's expert ids inside ``[0, E)``, each table checked once), skipped while a CUDA
    graph is being captured. Under ``torch.compile``: the custom op
    ``torch.ops.dsv4lab.hash_route`` (no value checks). Explained in
    notebooks/04_mxfp4_moe_port.ipynb.
    """
    if torch.compiler.is_compiling():
        return torch.ops.dsv4lab.hash_route(token_ids, table, router_logits, score=score,
                                            routed_scaling_factor=float(routed_scaling_factor),
                                            norm_topk_prob=norm_topk_prob)
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
    T = token_ids.shape[0]
    if router_logits is not None and (not isinstance(router_logits, torch.Tensor) or router_logits.dim() != 2
                                      or router_logits.shape[0] != T or router_logits.dtype not in _FLOATS):
        raise ValueError(f"router_logits must be a float [T={T}, E] tensor, got "
                         f"{getattr(router_logits, 'dtype', None)} {list(getattr(router_logits, 'shape', []))}")
    if validate and not _is_capturing(token_ids):
        _check_hash_values(token_ids, table, None if router_logits is None else router_logits.shape[1])
    ids = table[token_ids.long()]
    if router_logits is None:
        w = torch.full((T, k), routed_scaling_factor / k, dtype=torch.float32, device=token_ids.device)
        return ids.to(torch.int32), w
    w = _scores(router_logits, score).gather(1, ids.long())
    return ids.to(torch.int32), _finish_weights(w, norm_topk_prob, routed_scaling_factor)


_CLEAN_TABLES: dict = {}


def _check_hash_values(token_ids, table, E) -> None:
    """hash_route's value checks in one host sync (a table found clean is not read again)."""
    V = table.shape[0]
    flags = [token_ids.min(), token_ids.max()] if token_ids.numel() else []
    key = (_scale_key(table), E)
    check_table = E is not None and table.numel() and key not in _CLEAN_TABLES
    if check_table:
        flags += [table.min(), table.max()]
    if not flags:
        return
    got = torch.stack([f.long() for f in flags]).tolist()      # the one host sync
    if token_ids.numel():
        lo, hi = got[:2]
        got = got[2:]
        if lo < 0 or hi >= V:
            raise ValueError(f"token_ids must lie in [0, {V}) (the table's vocab), got [{lo}, {hi}]")
    if check_table:
        if got[0] < 0 or got[1] >= E:
            raise ValueError(f"table holds expert ids outside [0, E={E}), got [{got[0]}, {got[1]}]")
        if len(_CLEAN_TABLES) >= 64:
            _CLEAN_TABLES.clear()
        _CLEAN_TABLES[key] = True


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
                         w13_global, w2_global, swiglu_limit, validate: bool = True):
    """Validate every argument of :func:`fused_moe`; return (E, I, w13_global[E], w2_global[E]).

    Shapes, dtypes and devices always (free); with ``validate`` the values too, in one host
    sync (skipped while a CUDA graph is being captured): :func:`check_fused_moe_values`.
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
    if validate and not _is_capturing(x):
        check_fused_moe_values(x, w13_scale, w2_scale, topk_ids, topk_weights, fmt=fmt)
    return E, inter, g13, g2


# Scale tensors found free of NaN bytes, by (data_ptr, shape, strides, dtype, device, version),
# each with a weak reference to the tensor checked: a model's weights are checked on their first
# call only (an in-place write bumps the version), and a new tensor that happens to reuse a freed
# one's memory is checked afresh.
_CLEAN_SCALES: dict = {}
_CLEAN_SCALES_MAX = 4096


def _scale_key(s: torch.Tensor) -> tuple:
    return (s.data_ptr(), tuple(s.shape), tuple(s.stride()), s.dtype, str(s.device), s._version)


_SEEN_CLEAN: dict = {}      # id(tensor) -> (weak ref, version, data_ptr, shape, strides): a fast look-up


def _known_clean(s: torch.Tensor) -> bool:
    seen = _SEEN_CLEAN.get(id(s))
    if seen is not None and seen[0]() is s and seen[1] == s._version \
            and seen[2] == s.data_ptr() and seen[3] == s.shape and seen[4] == s.stride():
        return True
    ref = _CLEAN_SCALES.get(_scale_key(s))
    if ref is not None and ref() is s:
        _remember_clean(s)
        return True
    return False


def _remember_clean(s: torch.Tensor) -> None:
    if len(_SEEN_CLEAN) >= _CLEAN_SCALES_MAX:
        _SEEN_CLEAN.clear()
    _SEEN_CLEAN[id(s)] = (weakref.ref(s), s._version, s.data_ptr(), s.shape, s.stride())


def _nan_scale_bytes(s: torch.Tensor, fmt: str) -> torch.Tensor:
    """Whether ``s`` holds a NaN scale (E8M0 255; E4M3 0x7F / 0xFF), as a 0-d device tensor."""
    if fmt == "mxfp4":
        return (s == 255).any()
    return ((s.view(torch.uint8) & 0x7F) == 0x7F).any()


def check_fused_moe_values(x, w13_scale, w2_scale, topk_ids, topk_weights, *, fmt) -> None:
    """The value checks of :func:`fused_moe`, in one host sync: routing ids in [-1, E), finite
    routing weights and x, and no NaN scale byte in a scale tensor not seen clean before
    (the reference refuses those; a kernel would silently give zeros)."""
    E = w13_scale.shape[0]
    flags = []
    if topk_ids.numel():
        flags += [topk_ids.min().long(), topk_ids.max().long(),
                  (~torch.isfinite(topk_weights)).any().long()]
    if x.numel():
        flags.append((~torch.isfinite(x)).any().long())
    fresh = [(n, s) for n, s in (("w13_scale", w13_scale), ("w2_scale", w2_scale))
             if s.numel() and not _known_clean(s)]
    flags += [_nan_scale_bytes(s, fmt).long() for _, s in fresh]
    if not flags:
        return
    got = torch.stack(flags).tolist()                     # the one host sync
    if topk_ids.numel():
        lo, hi, bad_w = got[:3]
        got = got[3:]
        if lo < -1 or hi >= E:
            raise ValueError(f"topk_ids must lie in [-1, E={E}) (-1 = no expert), got [{lo}, {hi}]")
        if bad_w:
            raise ValueError("topk_weights contains NaN or Inf")
    if x.numel():
        if got[0]:
            raise ValueError("x contains NaN or Inf")
        got = got[1:]
    for (name, s), bad in zip(fresh, got):
        if bad:
            what = ("contain 255, the E8M0 NaN encoding" if fmt == "mxfp4"
                    else "contain NaN (E4M3 0x7F/0xFF)")
            raise ValueError(f"{name}: scales {what}")
        if len(_CLEAN_SCALES) >= _CLEAN_SCALES_MAX:
            _CLEAN_SCALES.clear()
        _CLEAN_SCALES[_scale_key(s)] = weakref.ref(s)
        _remember_clean(s)


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
                   description="the FP4 MoE family (kernels/moe/dispatch.py): the portable Triton "
                               "kernel everywhere, the H200's Gluon fast paths on sm_90")
def _fused_moe_triton(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, *, fmt,
                      w13_global, w2_global, swiglu_limit):
    """The kernel family's dispatch (dsv4lab.kernels.moe.dispatch.TABLES)."""
    from dsv4lab.kernels.moe import dispatch
    return dispatch.fused_moe(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, fmt=fmt,
                              w13_global=w13_global, w2_global=w2_global, swiglu_limit=swiglu_limit)


def _flashinfer_importable() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def _trtllm_unavailable() -> str:
    """Why "trtllm_fp4" never runs here, on a GPU it would run on as on any other."""
    if not _flashinfer_importable():
        return "needs flashinfer (its trtllm_fp4_block_scale_moe kernel); flashinfer is not installed"
    return ("is modelled for dispatch only: dsv4lab does not ship the shuffled weight layout "
            "flashinfer's trtllm_fp4_block_scale_moe expects (use backend='triton')")


# flashinfer's SM100-only kernel, the one the campaign's draft model was sent to: registered so
# that the notebooks can show the dispatch that crashed, never a candidate for "auto", and
# refused at resolution (with the reason) when asked for by name.
@backends.register("fused_moe", "trtllm_fp4", kind="external", priority=100,
                   formats=FORMATS, min_capability=(10, 0), max_capability=(10, 3),
                   interpreter=False, auto=False, requires=_trtllm_unavailable,
                   description="flashinfer trtllm_fp4_block_scale_moe (SM100-only, external; "
                               "modelled, never run)")
def _fused_moe_trtllm(*args, **kwargs):
    """flashinfer's SM100-only ``trtllm_fp4_block_scale_moe`` (modelled: resolution refuses it)."""
    raise BackendUnavailable(f"fused_moe: backend 'trtllm_fp4' {_trtllm_unavailable()}")


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
              w2_scale: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
              fmt: str = "mxfp4", w13_global=None, w2_global=None,
              swiglu_limit: float | None = None, backend: str = "auto",
              validate: bool = True) -> torch.Tensor:
    """Routed experts over FP4 weights: ``[T, hidden]`` in x's dtype.

    ``w13 uint8 [E, 2I, hidden/2]`` (gate rows, then up rows), ``w2 uint8 [E, hidden, I/2]``;
    scales uint8 E8M0 ``[.., K/32]`` (mxfp4) or float8_e4m3fn ``[.., K/16]`` with fp32
    global scales (a float, 0-d or per-expert [E]) for nvfp4. ``topk_ids`` -1 is skipped.

    Checks: shapes, dtypes and devices always, on the host (free; a call with the argument
    signature of an earlier good call skips them). With ``validate`` (the default) also the
    values: ``topk_ids`` in [-1, E), finite ``topk_weights`` and ``x``, and no NaN scale byte
    (E8M0 255, E4M3 0x7F/0xFF) in ``w13_scale`` / ``w2_scale``. The scales are checked once
    per tensor, where a model first uses them (torch ops and one host sync; the verdict kept
    while the tensor's storage and version are the same). With the Triton backend the rest is
    one check kernel before the MoE's kernels: it hands them the expert ids with every bad one
    made -1 (no kernel reads outside the weights) and writes its verdict into pinned host
    memory; once the MoE's kernels are launched the host reads that word, waiting for the check
    only (the call's one wait, not for the MoE's kernels); a bad value raises the ValueError
    naming it and the output is never returned. Other backends check in torch
    first (one host sync). While a CUDA graph is being captured the value checks are skipped;
    callers that made the data themselves pass ``validate=False`` (no value work at all).
    Under ``torch.compile``: the custom op ``torch.ops.dsv4lab.fused_moe``. Explained in
    notebooks/04_mxfp4_moe_port.ipynb.
    """
    if torch.compiler.is_compiling():
        E = w13.shape[0]
        g13, g2 = (None, None) if fmt == "mxfp4" else (
            _global_tensor(w13_global, E, x.device), _global_tensor(w2_global, E, x.device))
        return torch.ops.dsv4lab.fused_moe(x, w13, w13_scale, w2, w2_scale, topk_ids,
                                           topk_weights, g13, g2, fmt=fmt,
                                           swiglu_limit=None if swiglu_limit is None
                                           else float(swiglu_limit), backend=backend)
    try:
        key = (x.shape, x.dtype, x.device, w13.shape, w13.dtype, w13.device, w13_scale.shape,
               w13_scale.dtype, w13_scale.device, w2.shape, w2.dtype, w2.device, w2_scale.shape,
               w2_scale.dtype, w2_scale.device, topk_ids.shape, topk_ids.dtype, topk_ids.device,
               topk_weights.shape, topk_weights.dtype, topk_weights.device, fmt, swiglu_limit,
               backend, validate, w13_global is None and w2_global is None)
        chosen = _SIGNATURES.get(key)
    except (AttributeError, TypeError):
        key = chosen = None
    if chosen is None or fmt != "mxfp4":
        E, inter, g13, g2 = check_fused_moe_args(
            x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, fmt=fmt,
            w13_global=w13_global, w2_global=w2_global, swiglu_limit=swiglu_limit,
            validate=False)
        if not isinstance(validate, bool):
            raise ValueError(f"validate must be True or False, got {validate!r}")
        chosen = library.resolve("fused_moe", backend, fmt=fmt, device=x.device)
        if key is not None:
            if len(_SIGNATURES) >= 4096:
                _SIGNATURES.clear()
            _SIGNATURES[key] = chosen
    else:
        g13 = g2 = None
    if x.shape[0] == 0:
        return torch.zeros_like(x)
    limit = None if swiglu_limit is None else float(swiglu_limit)
    verdict = None
    ids = topk_ids
    if validate and not _is_capturing(x):
        if chosen.kind == "triton":
            _check_scales(w13_scale, w2_scale, fmt)
            x, ids, topk_weights = (t if t.is_contiguous() else t.contiguous()
                                    for t in (x, topk_ids, topk_weights))
            from dsv4lab.kernels.moe import dispatch
            verdict = value_check(x.device)
            ids = dispatch.check_routing(x, ids, topk_weights, w13.shape[0], verdict)
        else:
            check_fused_moe_values(x, w13_scale, w2_scale, topk_ids, topk_weights, fmt=fmt)
    out = chosen.fn(x, w13, w13_scale, w2, w2_scale, ids, topk_weights, fmt=fmt,
                    w13_global=g13, w2_global=g2, swiglu_limit=limit)
    if verdict is not None and verdict.failed():
        check_fused_moe_values(x, w13_scale, w2_scale, topk_ids, topk_weights, fmt=fmt)
    return out


_SIGNATURES: dict = {}      # argument signatures that passed check_fused_moe_args -> backend


def _global_tensor(g, E: int, device) -> torch.Tensor | None:
    """An NVFP4 global scale as the custom op takes it: a float becomes an fp32 [E] tensor."""
    if isinstance(g, (int, float)) and not isinstance(g, bool):
        return torch.full((E,), float(g), dtype=torch.float32, device=device)
    return g


def _check_scales(w13_scale, w2_scale, fmt) -> None:
    """The scale tensors' NaN bytes, each tensor once (torch ops and one host sync)."""
    fresh = [(n, s) for n, s in (("w13_scale", w13_scale), ("w2_scale", w2_scale))
             if s.numel() and not _known_clean(s)]
    if not fresh:
        return
    got = torch.stack([_nan_scale_bytes(s, fmt).long() for _, s in fresh]).tolist()
    for (name, s), bad in zip(fresh, got):
        if bad:
            what = ("contain 255, the E8M0 NaN encoding" if fmt == "mxfp4"
                    else "contain NaN (E4M3 0x7F/0xFF)")
            raise ValueError(f"{name}: scales {what}")
        if len(_CLEAN_SCALES) >= _CLEAN_SCALES_MAX:
            _CLEAN_SCALES.clear()
        _CLEAN_SCALES[_scale_key(s)] = weakref.ref(s)
        _remember_clean(s)
