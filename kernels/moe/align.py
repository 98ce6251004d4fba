"""Grouping token-expert pairs by expert, without asking the host anything.

P = T*k (token, expert) pairs, pair ``p = t*k + j``, grouped by expert into blocks of at most
BM rows:

    sorted_pair [P]        pair ids, grouped by expert (stable), invalid ids (-1) last
    block_expert [NB_MAX]  expert of block b, or -1 for the unused tail
    block_start [NB_MAX]   where block b starts in sorted_pair
    block_count [NB_MAX]   how many rows (1..BM) block b has

The GEMMs launch over NB_MAX = min(P, E) + P // BM blocks, the unused ones return at once:
no count reaches the host (CUDA-graph capturable). A single-program Triton kernel (sort of
``expert * P_PAD + pair``, one-hot count) serves decode-sized P, torch ops prefill.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4lab.kernels.launch import Launch, planned

# largest padded pair count the single-program kernel handles (the one-hot is P_PAD x E_PAD)
ALIGN_KERNEL_MAX_P = 1024


def num_blocks_max(P: int, E: int, BM: int) -> int:
    """Upper bound on blocks: sum_e ceil(n_e / BM) <= P // BM + #experts hit."""
    return min(P, E) + P // BM


@triton.jit
def block_rows(block_start_ptr, block_count_ptr, sorted_pair_ptr, b, BM: tl.constexpr):
    """Block ``b``'s rows: (start, count, offsets [BM], mask, pair ids (0 for padding))."""
    start = tl.load(block_start_ptr + b)
    cnt = tl.load(block_count_ptr + b)
    offs_m = tl.arange(0, BM)
    mmask = offs_m < cnt
    pair = tl.load(sorted_pair_ptr + start + offs_m, mask=mmask, other=0)
    return start, cnt, offs_m, mmask, pair


@triton.jit
def align_kernel(ids_ptr, sorted_pair_ptr, block_expert_ptr, block_start_ptr,
                 block_count_ptr, P, E, NB_MAX,
                 BM: tl.constexpr, P_PAD: tl.constexpr, E_PAD: tl.constexpr):
    """The grouping, in one program."""
    offs = tl.arange(0, P_PAD)
    inb = offs < P
    ids = tl.load(ids_ptr + offs, mask=inb, other=-1).to(tl.int32)
    valid = (ids >= 0) & (ids < E) & inb
    eid = tl.where(valid, ids, E)                     # invalid -> bucket E, sorted last
    key = eid * P_PAD + offs                          # stable: pair index breaks ties
    skey = tl.sort(key)
    tl.store(sorted_pair_ptr + offs, skey % P_PAD, mask=inb)

    ex = tl.arange(0, E_PAD)
    onehot = (eid[:, None] == ex[None, :]).to(tl.int32)
    counts = tl.sum(onehot, axis=0)
    counts = tl.where(ex < E, counts, 0)
    start = tl.cumsum(counts, axis=0) - counts
    nb = (counts + BM - 1) // BM
    bstart = tl.cumsum(nb, axis=0) - nb
    total = tl.sum(nb, axis=0)
    max_nb = tl.max(nb, axis=0)
    for q in range(0, max_nb):
        m = q < nb
        b = bstart + q
        tl.store(block_expert_ptr + b, ex, mask=m)
        tl.store(block_start_ptr + b, start + q * BM, mask=m)
        tl.store(block_count_ptr + b, tl.minimum(counts - q * BM, BM), mask=m)
    for b0 in range(0, NB_MAX, E_PAD):                # the unused tail: disjoint stores
        bb = b0 + ex
        tl.store(block_expert_ptr + bb, -1, mask=(bb >= total) & (bb < NB_MAX))


def align_kernel_fits(P: int) -> bool:
    """Whether the single-program kernel handles P pairs (else the torch grouping)."""
    return max(16, triton.next_power_of_2(P)) <= ALIGN_KERNEL_MAX_P


def align_launch(P: int, E: int) -> tuple[int, int, int]:
    """``(P_PAD, E_PAD, num_warps)`` of :func:`align_kernel` for P pairs over E experts."""
    P_PAD = max(16, triton.next_power_of_2(P))
    return P_PAD, max(16, triton.next_power_of_2(E)), 4 if P_PAD <= 256 else 8


_ALIGN: dict = {}


def moe_align_triton(topk_ids: torch.Tensor, E: int, BM: int, out=None):
    """Single-program grouping for decode-sized P, into ``out`` (four int32) or fresh buffers."""
    P = topk_ids.numel()
    if not align_kernel_fits(P):
        raise ValueError(f"moe_align_triton handles up to {ALIGN_KERNEL_MAX_P} pairs, got {P}")
    dev = topk_ids.device
    nbm = num_blocks_max(P, E, BM)
    launch = planned(_ALIGN, (dev, P, E, BM), dev, lambda: _align_launch(dev, P, E, BM, nbm))
    if out is None:
        out = align_buffers(P, nbm, dev)
    launch(topk_ids, *out)
    return out


def align_buffers(P: int, nbm: int, device):
    """(sorted_pair [P], block_expert, block_start, block_count [nbm]) int32, uninitialised."""
    return (torch.empty(P, dtype=torch.int32, device=device),
            *(torch.empty(nbm, dtype=torch.int32, device=device) for _ in range(3)))


def _align_launch(device, P, E, BM, nbm):
    P_PAD, E_PAD, warps = align_launch(P, E)
    return Launch(align_kernel, (1,), dict(P=P, E=E, NB_MAX=nbm, BM=BM, P_PAD=P_PAD,
                                           E_PAD=E_PAD), device=device, guard=(0,),
                  num_warps=warps)


def moe_align_torch(topk_ids: torch.Tensor, E: int, BM: int, out=None):
    """The same grouping with torch ops (no host sync either) for prefill; ``out`` unused."""
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    P = flat.numel()
    valid = (flat >= 0) & (flat < E)
    eid = torch.where(valid, flat, torch.full_like(flat, E))
    key = eid * P + torch.arange(P, device=dev)
    sorted_pair = (torch.sort(key).values % P).to(torch.int32)
    counts = torch.zeros(E + 1, dtype=torch.long, device=dev).scatter_add_(0, eid, torch.ones_like(eid))[:E]
    start = torch.cumsum(counts, 0) - counts
    nb = (counts + BM - 1) // BM
    cum_nb = torch.cumsum(nb, 0)
    nbm = num_blocks_max(P, E, BM)
    b = torch.arange(nbm, device=dev)
    e = torch.searchsorted(cum_nb, b, right=True)
    used = e < E
    ec = e.clamp(max=E - 1)
    q = b - (cum_nb[ec] - nb[ec])
    block_expert = torch.where(used, e, torch.full_like(e, -1)).to(torch.int32)
    block_start = torch.where(used, start[ec] + q * BM, torch.zeros_like(e)).to(torch.int32)
    block_count = torch.where(used, torch.clamp(counts[ec] - q * BM, max=BM), torch.zeros_like(e)).to(torch.int32)
    return sorted_pair, block_expert, block_start, block_count


def moe_align(topk_ids: torch.Tensor, E: int, BM: int, out=None):
    """``(sorted_pair, block_expert, block_start, block_count)``: Triton for small P, else torch."""
    if align_kernel_fits(topk_ids.numel()):
        return moe_align_triton(topk_ids, E, BM, out)
    return moe_align_torch(topk_ids, E, BM)
