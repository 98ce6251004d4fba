"""Sparse MLA decode: every query head attends to the same few selected latent KV rows.

DeepSeek-V4 decodes with 64 query heads that share one 512-dim latent vector per token
(448 "nope" + 64 RoPE; the same vector is K, and its first ``d_v`` values are V). Each
query position attends only to ``topk`` cache slots chosen by the lightning indexer and
the sliding window:

    out[b,s,h] = sum_j softmax_j(scale * q[b,s,h] . kv[idx[b,s,j]]) * kv[idx[b,s,j]][:d_v]

``indices`` may hold -1 (an empty slot, skipped) and duplicates (each copy counts). An
attention sink ``attn_sink[h]`` adds ``exp(sink[h])`` to the softmax denominator only.
``lse`` is the natural log of that denominator; a row with no valid slot gets out = 0
and lse = -inf (or sink[h]).

Backends (``backend=``): "torch" (the fp32 reference below), "simt" (one program per
(token, head) on CUDA cores: the campaign's baseline, notebooks/01_simt_baseline.ipynb),
"mma" (heads stacked on the tensor cores, split-KV, FP8 KV: notebooks/02_mma_attention.ipynb).
"""
from __future__ import annotations

import math

import torch

from dsv4lab import backends
from dsv4lab.kernels.launch import capturing
from dsv4lab.ops import library
from dsv4lab.quant import kv_fp8
from dsv4lab.quant.kv_fp8 import ROW_BYTES as FP8_ROW_BYTES
from dsv4lab.quant.kv_fp8 import unpack_kv_fp8

OP = "sparse_mla_decode"
FP8_DIM = 512
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------------------
# The public op
# ----------------------------------------------------------------------------------------

def sparse_mla_decode(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, *,
                      d_v: int = 512, softmax_scale: float | None = None,
                      attn_sink: torch.Tensor | None = None, backend: str = "auto",
                      validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA decode attention -> ``(out [B, S_q, H, d_v] in q's dtype, lse [B, S_q, H] fp32)``.

    q [B, S_q, H, D]; kv [N, D], paged [P, page, D] or [P, page, 1, D] (flat slot =
    page * page_size + offset) in q's dtype, or the FP8 cache uint8 [N, 584] (or paged,
    D = 512, see :func:`dsv4lab.quant.pack_kv_fp8`); indices int32 [B, S_q, topk] with
    -1 for empty slots.

    Checks. Shapes, dtypes, devices and the keywords: always, on the host (free; a call with
    the argument signature of an earlier good call skips them). Values, with ``validate`` (the
    default): every index -1 or in [0, N), and with the FP8 cache no scale byte 255 (ue8m0
    NaN) in the rows the indices select. With a Triton backend one check kernel runs before
    the attention kernels: it hands them the indices with every bad one made -1
    (so none reads outside the cache) and writes its verdict into pinned host memory; once the
    attention kernels are launched the host reads that word, waiting for the check only, not
    for them (the call's one wait); a bad value then raises the ValueError naming it and the
    output is never returned. The torch reference backend runs the same
    checks in torch before the call. Skipped while a CUDA graph is being captured.
    ``validate=False`` (the engine, the benchmarks' timed calls: they made the indices and the
    cache themselves) does no value work at all.

    Under ``torch.compile`` the call is the custom op ``torch.ops.dsv4lab.sparse_mla_decode``
    (:mod:`dsv4lab.ops.library`), without value checks.

    Explained in notebooks/01_simt_baseline.ipynb and notebooks/02_mma_attention.ipynb.
    """
    if torch.compiler.is_compiling():
        return torch.ops.dsv4lab.sparse_mla_decode(q, kv, indices, attn_sink, d_v=d_v,
                                                    softmax_scale=softmax_scale, backend=backend)
    try:
        key = (q.shape, q.dtype, q.device, kv.shape, kv.dtype, kv.device, indices.shape,
               indices.dtype, indices.device, d_v, softmax_scale, backend, validate,
               None if attn_sink is None else (attn_sink.shape, attn_sink.dtype, attn_sink.device))
        known = _SIGNATURES.get(key)
    except (AttributeError, TypeError):         # not tensors, or an unhashable keyword
        key = known = None
    if known is None:
        kv_flat, fp8, scale, sink = _check(q, kv, indices, d_v, softmax_scale, attn_sink)
        if not isinstance(validate, bool):
            raise ValueError(f"validate must be True or False, got {validate!r}")
        impl = library.resolve(OP, backend, fmt="fp8" if fp8 else "dense", device=q.device)
        if key is not None:
            if len(_SIGNATURES) >= 4096:
                _SIGNATURES.clear()
            _SIGNATURES[key] = (kv_flat.shape[-1], fp8, scale, impl)
    else:
        row, fp8, scale, impl = known
        kv_flat = kv if kv.dim() == 2 else kv.reshape(-1, row)
        sink = attn_sink
        if sink is not None and (sink.dtype != torch.float32 or not sink.is_contiguous()):
            sink = sink.float().contiguous()
    if impl.kind == "triton":
        if not kv.is_contiguous():
            raise ValueError("kv must be contiguous for the Triton backends (a cache allocated "
                             f"as one tensor is); got strides {tuple(kv.stride())}")
        if not q.is_contiguous():
            q = q.contiguous()
        if not indices.is_contiguous():
            indices = indices.contiguous()
    verdict = None
    checked = indices
    if validate and not capturing(q.device):
        if impl.kind == "triton":
            checked, verdict = _kernels().check_indices(checked, kv_flat, fp8)
        else:
            _check_values(kv, kv_flat, indices, fp8)
    out = impl.fn(q, kv_flat, checked, d_v=d_v, scale=scale, sink=sink, fp8=fp8)
    if verdict is not None and verdict.failed():
        _check_values(kv, kv_flat, indices, fp8)
    return out


_SIGNATURES: dict = {}      # argument signatures that passed _check -> what it worked out


def _kernels():
    from dsv4lab.kernels.attention import dispatch
    return dispatch


def _check(q, kv, indices, d_v, softmax_scale, attn_sink):
    """The shape, dtype, device and keyword checks; returns (kv as [N, row], fp8, scale, sink)."""
    for name, t in (("q", q), ("kv", kv), ("indices", indices)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4:
        raise ValueError(f"q must have shape [B, S_q, H, D], got {tuple(q.shape)}")
    if q.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"q must be bf16, fp16 or fp32, got {q.dtype}")
    B, S_q, H, D = q.shape
    if min(B, S_q, H, D) < 1:
        raise ValueError(f"q must have non-empty dimensions [B, S_q, H, D], got {tuple(q.shape)}")
    fp8 = kv.dtype == torch.uint8
    row = FP8_ROW_BYTES if fp8 else D
    if kv.dtype != q.dtype and not fp8:
        raise ValueError(f"kv must have q's dtype ({q.dtype}) or be the uint8 FP8 cache "
                         f"[N, {FP8_ROW_BYTES}], got {kv.dtype}")
    if fp8 and D != FP8_DIM:
        raise ValueError(f"the FP8 KV cache holds {FP8_DIM}-dim rows, so q's last dim D must be "
                         f"{FP8_DIM}; got q {tuple(q.shape)}")
    shape_ok = (kv.dim() == 2 or kv.dim() == 3 or (kv.dim() == 4 and kv.shape[2] == 1)) \
        and kv.shape[-1] == row
    if not shape_ok:
        want = f"[N, {row}], [P, page, {row}] or [P, page, 1, {row}]"
        raise ValueError(f"kv must have shape {want}"
                         + (" (FP8 layout)" if fp8 else f" (D = {D} from q)")
                         + f", got {tuple(kv.shape)}")
    kv_flat = kv.reshape(-1, row)
    N = kv_flat.shape[0]
    if N < 1:
        raise ValueError(f"kv must hold at least one row, got {tuple(kv.shape)}")
    if indices.dtype != torch.int32:
        raise ValueError(f"indices must be int32, got {indices.dtype}")
    if indices.dim() != 3 or tuple(indices.shape[:2]) != (B, S_q) or indices.shape[2] < 1:
        raise ValueError(f"indices must have shape [B, S_q, topk] = [{B}, {S_q}, topk >= 1], "
                         f"got {tuple(indices.shape)}")
    for name, t in (("kv", kv), ("indices", indices)):
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device ({q.device}), got {t.device}")
    if isinstance(d_v, bool) or not isinstance(d_v, int) or not 1 <= d_v <= D:
        raise ValueError(f"d_v must be an int in [1, D = {D}], got {d_v!r}")
    if softmax_scale is None:
        scale = D ** -0.5
    else:
        try:
            scale = float(softmax_scale)
        except (TypeError, ValueError):
            raise ValueError(f"softmax_scale must be a positive float, got {softmax_scale!r}") from None
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"softmax_scale must be a positive finite float, got {softmax_scale!r}")
    sink = None
    if attn_sink is not None:
        if not isinstance(attn_sink, torch.Tensor) or attn_sink.shape != (H,) \
                or attn_sink.dtype not in _FLOAT_DTYPES:
            got = (f"{tuple(attn_sink.shape)} {attn_sink.dtype}" if isinstance(attn_sink, torch.Tensor)
                   else type(attn_sink).__name__)
            raise ValueError(f"attn_sink must be a float tensor of shape [H] = [{H}], got {got}")
        if attn_sink.device != q.device:
            raise ValueError(f"attn_sink must be on q's device ({q.device}), got {attn_sink.device}")
        sink = attn_sink.float().contiguous()
    return kv_flat, fp8, scale, sink


def _check_values(kv, kv_flat, indices, fp8):
    """The value checks of :func:`sparse_mla_decode` in torch (one host sync; a second only to
    name what is wrong): the CPU path, and the explanation after the check kernel's flag."""
    N = kv_flat.shape[0]
    lo, hi = torch.aminmax(indices)
    flags = [lo.to(torch.int64), hi.to(torch.int64)]
    if fp8:
        rows = indices.reshape(-1).clamp(0, N - 1).long()
        nan_scale = (kv_flat[:, kv_fp8.SCALES].index_select(0, rows) == kv_fp8.NAN_SCALE).any(-1)
        nan_scale &= indices.reshape(-1) >= 0
        flags.append(nan_scale.any().to(torch.int64))
    flags = torch.stack(flags).tolist()
    if flags[0] < -1 or flags[1] >= N:
        raise ValueError(f"indices must be -1 (empty) or in [0, N = {N}) (N = kv rows"
                         f"{' = pages * page_size' if kv.dim() > 2 else ''}); found "
                         f"{flags[0] if flags[0] < -1 else flags[1]}")
    if fp8 and flags[2]:
        row = int(rows[nan_scale][0])
        raise ValueError(kv_fp8.nan_scale_message("kv", row))


# ----------------------------------------------------------------------------------------
# The fp32 torch reference
# ----------------------------------------------------------------------------------------

@backends.register(OP, "torch", kind="torch", priority=0, formats=("dense", "fp8"))
def sparse_mla_decode_torch(q, kv_flat, indices, *, d_v, scale, sink, fp8):
    """fp32 torch reference: gather, scores, masked softmax with sink, weighted sum."""
    B, S_q, H, D = q.shape
    topk = indices.shape[-1]
    out = torch.empty(B, S_q, H, d_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, S_q, H, dtype=torch.float32, device=q.device)
    qf = q.reshape(B * S_q, H, D)
    idx = indices.reshape(B * S_q, topk).long()
    # chunk the (b, s) rows so the fp32 gather stays under ~256 MB
    chunk = max(1, (64 << 20) // max(1, topk * D))
    for a in range(0, B * S_q, chunk):
        e = min(B * S_q, a + chunk)
        ix = idx[a:e]
        valid = ix >= 0
        rows = kv_flat[ix.clamp(min=0)]                       # [n, topk, row]
        k = unpack_kv_fp8(rows) if fp8 else rows.float()      # [n, topk, D]
        s = torch.einsum("nhd,ntd->nht", qf[a:e].float(), k) * scale
        s = s.masked_fill(~valid[:, None, :], float("-inf"))
        m = s.amax(dim=-1)                                    # [n, H]
        if sink is not None:
            m = torch.maximum(m, sink[None, :])
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        p = torch.exp(s - m[..., None])
        denom = p.sum(-1)
        if sink is not None:
            denom = denom + torch.exp(sink[None, :] - m)
        o = torch.einsum("nht,ntd->nhd", p, k[..., :d_v])
        has = denom > 0
        o = o / torch.where(has, denom, torch.ones_like(denom))[..., None]
        out.view(B * S_q, H, d_v)[a:e] = o.to(q.dtype)
        lse.view(B * S_q, H)[a:e] = torch.where(has, m + torch.log(denom),
                                                torch.full_like(denom, float("-inf")))
    return out, lse


# ----------------------------------------------------------------------------------------
# The Triton kernels (dsv4lab.kernels.attention)
# ----------------------------------------------------------------------------------------

@backends.register(OP, "simt", kind="triton", priority=10, formats=("dense",),
                   min_capability=(8, 0))
def sparse_mla_decode_simt(q, kv_flat, indices, *, d_v, scale, sink, fp8):
    """Lesson 1: one program per (token, head), CUDA-core dot products."""
    from dsv4lab.kernels.attention import simt
    return simt.sparse_mla_simt(q, kv_flat, indices, sink, scale, d_v)


@backends.register(OP, "mma", kind="triton", priority=20, formats=("dense", "fp8"),
                   min_capability=(8, 0))
def sparse_mla_decode_mma(q, kv_flat, indices, *, d_v, scale, sink, fp8):
    """The family's dispatch (kernels/attention/dispatch.py): lesson 2's tensor-core kernel,
    or the warp-specialised sm_90 kernel where its route applies."""
    return _kernels().sparse_mla_decode(q, kv_flat, indices, sink, scale, d_v, fp8=fp8)
