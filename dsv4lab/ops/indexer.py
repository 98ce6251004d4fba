"""The DSA lightning indexer: score every visible compressed entry, keep the top-k.

For one decode query (row ``b, s``) and each visible key entry ``j`` of its request::

    logit[b, s, j] = k_scale[j] * sum_h weights[b, s, h] * ReLU(q[b, s, h] . k[j])

with 64 indexer heads of 128 dims, keys stored paged as FP8 e4m3 (one fp32 scale per
key) or bf16. ``indexer_topk`` keeps the ``topk`` (512) best logical positions; the
sparse-MLA decode then attends to only those. Positions ``j >= context_lens[b, s]`` are
invisible (logit -inf, never selected; -1 pads the result when fewer than ``topk`` are
visible).

Three backends, which are the story of notebooks/03_indexer_capping.ipynb:

- ``"torch_fallback"``: scores all ``L = max_context`` positions and runs ``torch.topk``
  over that width, as the campaign's fallback did. Kept on purpose: it is the
  bottleneck (O(max_context) per step whatever the request length).
- ``"torch_capped"``: the same fp32 math, but only up to the batch's longest visible
  length (one host read of ``context_lens``: not capture-safe).
- ``"triton"``: the paged kernels in :mod:`dsv4lab.kernels.indexer`; they read
  ``context_lens`` on the device, stop at each row's last visible page, use a fixed grid
  and never synchronise with the host, so one CUDA graph serves every context length.
  Cost O(actual context), not O(max_context).

Explained in notebooks/03_indexer_capping.ipynb.
"""
from __future__ import annotations

import torch

from dsv4lab import backends
from dsv4lab.kernels.launch import capturing, value_check
from dsv4lab.ops import library

FP8 = torch.float8_e4m3fn
Q_DTYPES = (FP8, torch.bfloat16, torch.float32)
K_DTYPES = (FP8, torch.bfloat16, torch.float32)


def _dtype_names(dts) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dts)


# --------------------------------------------------------------------------- checks

def _check_inputs(q, k_cache, k_scale, weights, block_table, context_lens, max_context,
                  topk=None, validate=True) -> int:
    """The shape, dtype, device and keyword checks. Returns L, the logical width of the
    logits. Raises ValueError naming the argument."""
    for name, x in (("q", q), ("k_cache", k_cache), ("k_scale", k_scale),
                    ("weights", weights), ("block_table", block_table),
                    ("context_lens", context_lens)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if q.dim() != 4:
        raise ValueError(f"q must be [B, S_q, Hi, Di], got shape {tuple(q.shape)}")
    if q.dtype not in Q_DTYPES:
        raise ValueError(f"q must be one of {_dtype_names(Q_DTYPES)}, got {q.dtype}")
    B, S, H, D = q.shape
    if B == 0 or S == 0 or H == 0 or D == 0:
        raise ValueError(f"q must have non-empty dimensions, got shape {tuple(q.shape)}")
    if k_cache.dim() != 3:
        raise ValueError(f"k_cache must be [P, page, Di], got shape {tuple(k_cache.shape)}")
    if k_cache.dtype not in K_DTYPES:
        raise ValueError(f"k_cache must be one of {_dtype_names(K_DTYPES)}, got {k_cache.dtype}")
    P, page, Dk = k_cache.shape
    if Dk != D:
        raise ValueError(f"k_cache's last dimension must equal q's head dim {D}, got {Dk}")
    if P == 0 or page == 0:
        raise ValueError(f"k_cache must hold at least one page of at least one entry, "
                         f"got shape {tuple(k_cache.shape)}")
    if tuple(k_scale.shape) != (P, page):
        raise ValueError(f"k_scale must be [P, page] = {(P, page)} (one scale per key), "
                         f"got shape {tuple(k_scale.shape)}")
    if k_scale.dtype != torch.float32:
        raise ValueError(f"k_scale must be float32, got {k_scale.dtype}")
    if tuple(weights.shape) != (B, S, H):
        raise ValueError(f"weights must be [B, S_q, Hi] = {(B, S, H)}, got shape {tuple(weights.shape)}")
    if weights.dtype != torch.float32:
        raise ValueError(f"weights must be float32, got {weights.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != B or block_table.shape[1] == 0:
        raise ValueError(f"block_table must be [B, max_pages] with B = {B} and max_pages >= 1, "
                         f"got shape {tuple(block_table.shape)}")
    if block_table.dtype != torch.int32:
        raise ValueError(f"block_table must be int32, got {block_table.dtype}")
    if tuple(context_lens.shape) != (B, S):
        raise ValueError(f"context_lens must be [B, S_q] = {(B, S)}, got shape {tuple(context_lens.shape)}")
    if context_lens.dtype != torch.int32:
        raise ValueError(f"context_lens must be int32, got {context_lens.dtype}")
    dev = q.device
    if any(x.device != dev for x in (k_cache, k_scale, weights, block_table, context_lens)):
        devs = {x.device for x in (q, k_cache, k_scale, weights, block_table, context_lens)}
        raise ValueError(f"q, k_cache, k_scale, weights, block_table and context_lens must be on "
                         f"one device, got {sorted(str(d) for d in devs)}")
    max_pages = block_table.shape[1]
    if max_context is None:
        L = max_pages * page
    else:
        if isinstance(max_context, bool) or not isinstance(max_context, int) or max_context <= 0:
            raise ValueError(f"max_context must be a positive int (entries) or None, got {max_context!r}")
        if max_context > max_pages * page:
            raise ValueError(f"max_context ({max_context}) exceeds what block_table can address "
                             f"(max_pages * page = {max_pages} * {page} = {max_pages * page})")
        L = max_context
    if topk is not None:
        if isinstance(topk, bool) or not isinstance(topk, int) or topk <= 0:
            raise ValueError(f"topk must be a positive int, got {topk!r}")
    if not isinstance(validate, bool):
        raise ValueError(f"validate must be a bool, got {validate!r}")
    return L


_SIGNATURES: dict = {}      # argument signatures that passed _check_inputs -> (L, backend)


def _prepare(op, q, k_cache, k_scale, weights, block_table, context_lens, max_context, topk,
             validate, backend):
    """(L, backend) of a call: worked out by :func:`_check_inputs` and resolution, once per
    argument signature."""
    try:
        key = (op, q.shape, q.dtype, q.device, k_cache.shape, k_cache.dtype, k_cache.device,
               k_scale.shape, k_scale.dtype, k_scale.device, weights.shape, weights.dtype,
               weights.device, block_table.shape, block_table.dtype, block_table.device,
               context_lens.shape, context_lens.dtype, context_lens.device, max_context, topk,
               validate, backend)
        known = _SIGNATURES.get(key)
    except (AttributeError, TypeError):
        key = known = None
    if known is not None:
        return known
    L = _check_inputs(q, k_cache, k_scale, weights, block_table, context_lens, max_context,
                      topk, validate)
    known = (L, library.resolve(op, backend, device=q.device))
    if key is not None:
        if len(_SIGNATURES) >= 4096:
            _SIGNATURES.clear()
        _SIGNATURES[key] = known
    return known


def _value_check(block_table, context_lens, k_cache, L, validate):
    """-> (the block table the backend reads, the check's verdict or None). With
    ``validate`` (and no capture): on a GPU or in the interpreter the check kernel (it hands
    over a copy with every entry clamped to a page id); else the torch checks, at once."""
    dev = block_table.device
    if not validate or capturing(dev):
        return block_table, None
    P, page = k_cache.shape[:2]
    if not library.triton_runs(dev):
        _check_values(block_table, context_lens, P, page, L)
        return block_table, None
    from dsv4lab.kernels import indexer as K
    verdict = value_check(dev)
    return K.check_tables(block_table, context_lens, P, page, L, verdict), verdict


def _check_values(block_table, context_lens, P, page, L):
    """The value checks in torch, one device->host read: context_lens in [0, L]; the page ids
    of visible pages (those holding an entry below the row's longest context) in [0, P)."""
    c_lo, c_hi = torch.aminmax(context_lens)
    starts = torch.arange(0, block_table.shape[1] * page, page, dtype=torch.int32,
                          device=block_table.device)                 # each page's first entry
    visible = starts[None, :] < context_lens.amax(dim=1, keepdim=True)
    b_lo, b_hi = torch.aminmax(torch.where(visible, block_table, 0))
    c_lo, c_hi, b_lo, b_hi = torch.stack([c_lo, c_hi, b_lo, b_hi]).tolist()
    if c_lo < 0 or c_hi > L:
        raise ValueError(f"context_lens must lie in [0, L = {L}] (visible entries per query), "
                         f"got min {c_lo}, max {c_hi}")
    if b_lo < 0 or b_hi >= P:
        raise ValueError(f"block_table entries of visible pages must be page ids in [0, {P}) "
                         f"(P = k_cache.shape[0]), got {b_lo if b_lo < 0 else b_hi}")


# ------------------------------------------------------------------- fp32 reference

def reference_logits(q, k_cache, k_scale, weights, block_table, context_lens, width: int):
    """fp32 logits over logical positions [0, width): [B, S_q, width], -inf where invisible.

    The math of the indexer, gathered through the block table; every dtype is upcast to
    fp32 first (e4m3 and bf16 convert exactly), so this is the reference the kernels are
    checked against.
    """
    B, S, H, D = q.shape
    P, page, _ = k_cache.shape
    dev = q.device
    pos = torch.arange(width, device=dev)
    pidx = (pos // page).clamp(max=block_table.shape[1] - 1)
    phys = block_table.long()[:, pidx].clamp(0, P - 1)                    # [B, width]
    slot = phys * page + (pos % page)[None, :]
    flat = k_cache.reshape(P * page, D)
    if flat.dtype == FP8:                         # gather the bytes (any device), then upcast
        k = flat.view(torch.uint8)[slot].view(FP8).float()                # [B, width, D]
    else:
        k = flat[slot].float()
    sc = k_scale.reshape(P * page)[slot]                                  # [B, width]
    qf = q.float().reshape(B, S * H, D)
    s = torch.bmm(qf, k.transpose(1, 2)).reshape(B, S, H, width)          # [B, S, H, width]
    logits = (s.relu_() * weights[..., None]).sum(dim=2) * sc[:, None, :]
    visible = pos[None, None, :] < context_lens[..., None].long()
    return logits.masked_fill_(~visible, float("-inf"))


def _topk_from_logits(logits, topk: int):
    """Top-k logical positions of fp32 logits [B, S, W] (-inf = invisible), -1 padded."""
    B, S, W = logits.shape
    k = min(topk, W)
    out = torch.full((B, S, topk), -1, dtype=torch.int32, device=logits.device)
    if k > 0:
        vals, idx = torch.topk(logits, k, dim=-1)
        out[..., :k] = torch.where(torch.isneginf(vals), -1, idx).to(torch.int32)
    return out


def _pad_logits(logits, L: int):
    B, S, W = logits.shape
    if W == L:
        return logits
    out = torch.full((B, S, L), float("-inf"), dtype=torch.float32, device=logits.device)
    out[..., :W] = logits
    return out


def _capped_width(context_lens, page: int, L: int) -> int:
    w = int(context_lens.max().item())            # the host sync that makes this uncapturable
    return min(L, max(page, -(-w // page) * page))


# ----------------------------------------------------------------------- backends

@backends.register("indexer_logits", "torch_fallback", kind="torch", priority=0,
                   description="fp32 torch over all L = max_context positions (the bottleneck)")
def _logits_fallback(q, k_cache, k_scale, weights, block_table, context_lens, L):
    return reference_logits(q, k_cache, k_scale, weights, block_table, context_lens, L)


@backends.register("indexer_logits", "torch_capped", kind="torch", priority=5,
                   description="fp32 torch up to the batch's longest visible length (host sync)")
def _logits_capped(q, k_cache, k_scale, weights, block_table, context_lens, L):
    W = _capped_width(context_lens, k_cache.shape[1], L)
    return _pad_logits(reference_logits(q, k_cache, k_scale, weights, block_table,
                                        context_lens, W), L)


@backends.register("indexer_logits", "triton", kind="triton", priority=10,
                   min_capability=(8, 0), interpreter=True,
                   description="paged Triton kernel, per-page early exit, capture-safe")
def _logits_triton(q, k_cache, k_scale, weights, block_table, context_lens, L):
    from dsv4lab.kernels import indexer as K
    return K.indexer_logits(q, k_cache, k_scale, weights, block_table, context_lens, L)


@backends.register("indexer_topk", "torch_fallback", kind="torch", priority=0,
                   description="fp32 torch logits over all L + torch.topk over L (the bottleneck)")
def _topk_fallback(q, k_cache, k_scale, weights, block_table, context_lens, L, topk):
    logits = reference_logits(q, k_cache, k_scale, weights, block_table, context_lens, L)
    return _topk_from_logits(logits, topk)


@backends.register("indexer_topk", "torch_capped", kind="torch", priority=5,
                   description="fp32 torch + torch.topk up to the batch's longest length (host sync)")
def _topk_capped(q, k_cache, k_scale, weights, block_table, context_lens, L, topk):
    W = _capped_width(context_lens, k_cache.shape[1], L)
    logits = reference_logits(q, k_cache, k_scale, weights, block_table, context_lens, W)
    return _topk_from_logits(logits, topk)


@backends.register("indexer_topk", "triton", kind="triton", priority=10,
                   min_capability=(8, 0), interpreter=True,
                   description="paged Triton logits + per-row radix select, O(actual), capture-safe")
def _topk_triton(q, k_cache, k_scale, weights, block_table, context_lens, L, topk):
    from dsv4lab.kernels import indexer as K
    return K.indexer_topk(q, k_cache, k_scale, weights, block_table, context_lens, L, topk)


# -------------------------------------------------------------------- public ops

def indexer_logits(q, k_cache, k_scale, weights, block_table, context_lens, *,
                   max_context=None, backend="auto", validate=True):
    """Indexer logits [B, S_q, L] fp32; -inf at positions ``j >= context_lens[b, s]``.

    q [B, S_q, Hi, Di] (float8_e4m3fn, bf16 or fp32); k_cache [P, page, Di] (e4m3, bf16
    or fp32); k_scale [P, page] fp32; weights [B, S_q, Hi] fp32; block_table int32
    [B, max_pages] (logical page i of row b lives in physical page block_table[b, i]);
    context_lens int32 [B, S_q] (visible entries of each query). L = ``max_context``
    (in entries) or max_pages * page. The matmul runs in the wider of q's and k's dtypes
    (fp8 x fp8 on FP8 tensor cores where the GPU has them), accumulating in fp32.

    Checks: shapes, dtypes and devices always, on the host (no device work; a call with the
    argument signature of an earlier good call skips them). With ``validate=True`` also the
    values: ``context_lens`` in [0, L] and the block-table entries of visible pages in [0, P).
    On a GPU (or in the interpreter) one check kernel runs before the indexer's kernels: it
    hands them a copy of the block table with every entry clamped to a page id (no read
    outside the cache) and writes its verdict into pinned host memory; once the indexer's
    kernels are launched the host reads that word, waiting for the check only (the call's one
    wait, not for the indexer's kernels); a bad value raises the ValueError naming it, the
    result is never returned.
    On the CPU without the interpreter the torch checks run first. Skipped while a CUDA graph
    is being captured; ``validate=False`` (callers that wrote the tables themselves: the
    engine, a captured step) does no value work, and a bad page id then reads outside the
    cache. Under ``torch.compile``: the custom op ``torch.ops.dsv4lab.indexer_logits``.

    Explained in notebooks/03_indexer_capping.ipynb.
    """
    if torch.compiler.is_compiling():
        return torch.ops.dsv4lab.indexer_logits(q, k_cache, k_scale, weights, block_table,
                                                 context_lens, max_context=max_context,
                                                 backend=backend)
    L, be = _prepare("indexer_logits", q, k_cache, k_scale, weights, block_table,
                     context_lens, max_context, None, validate, backend)
    bt, verdict = _value_check(block_table, context_lens, k_cache, L, validate)
    out = be.fn(q, k_cache, k_scale, weights, bt, context_lens, L)
    if verdict is not None and verdict.failed():
        _check_values(block_table, context_lens, *k_cache.shape[:2], L)
    return out


def indexer_topk(q, k_cache, k_scale, weights, block_table, context_lens, *,
                 max_context=None, topk=512, backend="auto", validate=True):
    """Top-``topk`` logical entry positions per query: int32 [B, S_q, topk].

    Same inputs and checks as :func:`indexer_logits` (``validate`` included: one check
    kernel, read back after the logits and top-k kernels). Positions are in
    [0, context_lens[b, s]); -1 fills the slots when fewer than ``topk`` entries are
    visible (the -1 come last). Ties at the k-th score are broken arbitrarily; the order of
    the kept positions is unspecified (torch backends: by descending score; triton: by
    ascending position). Under ``torch.compile``: ``torch.ops.dsv4lab.indexer_topk``.

    Explained in notebooks/03_indexer_capping.ipynb.
    """
    if torch.compiler.is_compiling():
        return torch.ops.dsv4lab.indexer_topk(q, k_cache, k_scale, weights, block_table,
                                               context_lens, max_context=max_context, topk=topk,
                                               backend=backend)
    L, be = _prepare("indexer_topk", q, k_cache, k_scale, weights, block_table, context_lens,
                     max_context, topk, validate, backend)
    bt, verdict = _value_check(block_table, context_lens, k_cache, L, validate)
    out = be.fn(q, k_cache, k_scale, weights, bt, context_lens, L, topk)
    if verdict is not None and verdict.failed():
        _check_values(block_table, context_lens, *k_cache.shape[:2], L)
    return out


def to_cache_slots(indices, block_table, page_size, *, validate=True):
    """Logical entry positions -> flat cache slots ``block_table[b, pos // page] * page + pos % page``.

    indices int32 [B, S_q, topk] (-1 kept as -1); block_table int32 [B, max_pages]. The
    result indexes a cache viewed as [P * page, ...] (what ``sparse_mla_decode`` takes).
    Shapes and dtypes are checked always; with ``validate=True`` also that every index is -1
    or below max_pages * page_size (skipped while capturing). On a GPU the mapping is one
    kernel that also sets the check's flag, read back after it (one host sync); on the CPU
    torch ops, the check first. An index outside the range maps to -1. Under
    ``torch.compile``: ``torch.ops.dsv4lab.to_cache_slots``.

    Explained in notebooks/03_indexer_capping.ipynb.
    """
    if torch.compiler.is_compiling():
        return torch.ops.dsv4lab.to_cache_slots(indices, block_table, page_size)
    if not isinstance(indices, torch.Tensor):
        raise ValueError(f"indices must be a torch.Tensor, got {type(indices).__name__}")
    if not isinstance(block_table, torch.Tensor):
        raise ValueError(f"block_table must be a torch.Tensor, got {type(block_table).__name__}")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    if indices.dtype not in (torch.int32, torch.int64) or indices.dim() != 3:
        raise ValueError(f"indices must be int32 [B, S_q, topk], got {indices.dtype} "
                         f"shape {tuple(indices.shape)}")
    if block_table.dtype != torch.int32 or block_table.dim() != 2:
        raise ValueError(f"block_table must be int32 [B, max_pages], got {block_table.dtype} "
                         f"shape {tuple(block_table.shape)}")
    if block_table.shape[0] != indices.shape[0]:
        raise ValueError(f"block_table must have B = {indices.shape[0]} rows (indices' batch), "
                         f"got {block_table.shape[0]}")
    if indices.device != block_table.device:
        raise ValueError(f"indices and block_table must be on one device, got "
                         f"{indices.device} and {block_table.device}")
    max_pages = block_table.shape[1]
    check = validate and not capturing(indices.device)
    if indices.is_cuda:
        from dsv4lab.kernels import indexer as K
        if not indices.is_contiguous():
            indices = indices.contiguous()
        if block_table.stride(1) != 1:
            block_table = block_table.contiguous()
        check = check and indices.numel() > 0
        verdict = value_check(indices.device) if check else None
        out = K.cache_slots(indices, block_table, page_size, check=verdict)
        if check and verdict.failed():
            _bad_positions(indices, max_pages * page_size)
        return out
    idx = indices.long()
    valid = (idx >= 0) & (idx < max_pages * page_size)
    if check:
        _bad_positions(indices, max_pages * page_size)
    safe = torch.where(valid, idx, 0)
    pidx = safe // page_size
    B = indices.shape[0]
    phys = torch.gather(block_table.long(), 1, pidx.reshape(B, -1)).reshape(idx.shape)
    slots = phys * page_size + safe % page_size
    return torch.where(valid, slots, -1).to(torch.int32)


def _bad_positions(indices, width: int) -> None:
    """ValueError if an index is neither -1 nor in [0, width) (one host sync)."""
    idx = indices.long()
    if bool(((idx < -1) | (idx >= width)).any()):
        raise ValueError(f"indices must be -1 or logical positions in [0, max_pages * "
                         f"page_size = {width})")


# -------------------------------------------------------------------- cost model

def indexer_bytes(batch: int, s_q: int, entries: int, *, heads: int = 64, head_dim: int = 128,
                  key_bytes: int = 1, q_bytes: int = 1, page: int = 64,
                  write_logits: bool = True) -> int:
    """HBM bytes to score ``entries`` keys for each of ``batch * s_q`` queries, at least.

    Keys (``key_bytes`` each: 1 = e4m3, 2 = bf16) and their fp32 scales are read once per
    query row (each batch row owns its pages), plus q, the head weights, the block
    table, and the fp32 logits written. The roofline of notebooks/03_indexer_capping.ipynb.
    """
    rows = batch * s_q
    keys = rows * entries * (head_dim * key_bytes + 4)
    q = rows * heads * (head_dim * q_bytes + 4)
    bt = batch * -(-entries // page) * 4
    return keys + q + bt + (rows * entries * 4 if write_logits else 0)


def indexer_flops(batch: int, s_q: int, entries: int, *, heads: int = 64,
                  head_dim: int = 128) -> int:
    """FLOPs of the indexer matmul plus ReLU/weight/sum epilogue for ``entries`` keys per row."""
    return batch * s_q * entries * heads * (2 * head_dim + 3)
