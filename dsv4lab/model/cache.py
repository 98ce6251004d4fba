"""The paged cache a decode step reads and writes, and where each new token goes.

One pool per layer holds raw tokens and compressed entries in different pages of the same
page space, addressed through a request's raw and compressed block tables, so one index
list addresses both. :func:`make_meta` computes, on the device and without a host
synchronisation, every slot a step writes and every entry a query may see: the sliding
window, the block of raw tokens a compressor pools (and, for an overlapping compressor, the
block before it), the entry a token completes, and (for HCA layers) every compressed entry.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv4lab.config import DSV4Config

OVERLAP_RATIO = 4        # the compress ratio whose compressor pools overlapping windows


def compress_overlap(cfg: DSV4Config, ratio: int) -> bool:
    """Whether a compressor of ``ratio`` pools overlapping windows, as DeepSeek-V4's released
    ratio-4 compressors (main and indexer) do: each entry pools its own ``ratio`` tokens and
    the ``ratio`` before them, from a projection twice as wide. Asked for by
    ``cfg.extra["compress_overlap"]`` (set by :mod:`dsv4lab.checkpoint` for a released
    checkpoint); off by default (the mini model trains without it)."""
    return ratio == OVERLAP_RATIO and bool(cfg.extra.get("compress_overlap", False))


@dataclass
class LayerCache:
    """One layer's paged storage. Every pool has the same ``[P, page]`` page space.

    Raw tokens and compressed entries live in the same ``kv`` pool (different pages, given
    by the request's raw and compressed block tables), so one index list addresses both.
    ``kv`` is ``[P, page, D]`` in the model dtype or the FP8 cache ``uint8 [P*page, 584]``.
    ``comp_kv``/``comp_gate`` hold each raw token's projected compressor inputs;
    ``idx_kv``/``idx_gate`` the indexer compressor's; ``idx_keys [P, page, Di]`` and
    ``idx_scale [P, page]`` the compressed indexer keys (bf16 with scale 1, or e4m3). An
    overlapping compressor (:func:`compress_overlap`) keeps twice as wide projected inputs.
    Page 0 is scratch: masked-out writes land there.
    """
    kv: torch.Tensor
    comp_kv: torch.Tensor | None = None
    comp_gate: torch.Tensor | None = None
    idx_kv: torch.Tensor | None = None
    idx_gate: torch.Tensor | None = None
    idx_keys: torch.Tensor | None = None
    idx_scale: torch.Tensor | None = None

    @property
    def fp8(self) -> bool:
        return self.kv.dtype == torch.uint8

    @classmethod
    def allocate(cls, cfg: DSV4Config, ratio: int, num_pages: int, page_size: int, *,
                 dtype=torch.bfloat16, kv_format: str = "bf16", device=None) -> "LayerCache":
        """Zeroed pools for one layer of compress ratio ``ratio``."""
        D, Di = cfg.head_dim, cfg.index_head_dim
        shape = (num_pages, page_size)
        z = lambda *s, dt=dtype: torch.zeros(*s, dtype=dt, device=device)  # noqa: E731
        if kv_format == "fp8":
            if D != 512 or cfg.rope_dim != 64:
                raise ValueError(f"kv_format='fp8' needs head_dim 512 with rope_dim 64 (the 584-byte "
                                 f"layout: 448 nope + 64 rope), got head_dim {D}, rope_dim {cfg.rope_dim}")
            kv = z(num_pages * page_size, 584, dt=torch.uint8)
        elif kv_format == "bf16":
            kv = z(*shape, D)
        else:
            raise ValueError(f"kv_format must be 'bf16' or 'fp8', got {kv_format!r}")
        c = cls(kv=kv)
        wide = 2 if compress_overlap(cfg, ratio) else 1
        if ratio:
            c.comp_kv, c.comp_gate = z(*shape, wide * D), z(*shape, wide * D)
        if ratio == 4:
            c.idx_kv, c.idx_gate = z(*shape, wide * Di), z(*shape, wide * Di)
            kdt = torch.float8_e4m3fn if kv_format == "fp8" else dtype
            c.idx_keys = z(*shape, Di, dt=kdt)
            c.idx_scale = torch.ones(*shape, dtype=torch.float32, device=device)
        return c


@dataclass
class DecodeMeta:
    """Where S new tokens per request go and what they see (built on the device by
    :func:`make_meta`; no host synchronisation).

    positions [B, S] int64; slots [B, S] flat raw slots; window [B, S, W] int32 flat
    slots of the window (-1 before position 0); block_table / cblock_table the request's
    raw and compressed pages; per compress ratio r: ``block_slots[r] [B, S, r]`` the raw
    slots of positions p-r+1..p, ``entry_pos[r] [B, S]`` the first position of the entry
    the token completes, ``entry_slot[r] [B, S]`` its slot (0 = scratch when the token
    completes none), ``n_entries[r] [B, S]`` entries visible, and for HCA ratios
    ``all_entries[r] [B, S, E_r]`` their slots (-1 when not visible). For an overlapping
    compressor's ratio (:func:`compress_overlap`) also ``prev_block_slots[r] [B, S, r]``, the
    raw slots of positions p-2r+1..p-r, and ``prev_valid[r] [B, S]``, whether that block
    exists (the entry is not the first).
    """
    positions: torch.Tensor
    slots: torch.Tensor
    window: torch.Tensor
    block_table: torch.Tensor
    cblock_table: torch.Tensor
    page_size: int
    block_slots: dict
    entry_pos: dict
    entry_slot: dict
    n_entries: dict
    all_entries: dict
    memo: dict = field(default_factory=dict)     # per-forward cache (RoPE cos/sin)
    prev_block_slots: dict = field(default_factory=dict)
    prev_valid: dict = field(default_factory=dict)

    def column(self, j: int) -> "DecodeMeta":
        """Column ``j`` of a [B, S] meta as a [B, 1] meta (views; a fresh RoPE memo)."""
        col = lambda t: t[:, j:j + 1]  # noqa: E731
        per = lambda d: {r: col(t) for r, t in d.items()}  # noqa: E731
        return DecodeMeta(col(self.positions), col(self.slots), col(self.window), self.block_table,
                          self.cblock_table, self.page_size, per(self.block_slots), per(self.entry_pos),
                          per(self.entry_slot), per(self.n_entries), per(self.all_entries),
                          prev_block_slots=per(self.prev_block_slots), prev_valid=per(self.prev_valid))


def _pos_to_slot(pos: torch.Tensor, table: torch.Tensor, page: int) -> torch.Tensor:
    """Logical position -> flat slot through a block table (clamped, never out of range)."""
    B = table.shape[0]
    p = pos.clamp_min(0)
    pg = (p // page).clamp_max(table.shape[1] - 1)
    phys = table.long().gather(1, pg.reshape(B, -1)).reshape(pos.shape)
    return phys * page + p % page


def make_meta(cfg: DSV4Config, positions: torch.Tensor, block_table: torch.Tensor,
              cblock_table: torch.Tensor, page_size: int, ratios) -> DecodeMeta:
    """Build the :class:`DecodeMeta` for tokens at ``positions [B, S]`` (device-side only)."""
    positions = positions.long()
    W = cfg.window_size
    slots = _pos_to_slot(positions, block_table, page_size)
    wpos = positions.unsqueeze(-1) - torch.arange(W - 1, -1, -1, device=positions.device)
    window = torch.where(wpos >= 0, _pos_to_slot(wpos, block_table, page_size),
                         torch.full_like(wpos, -1)).int()
    meta = DecodeMeta(positions, slots, window, block_table, cblock_table, page_size,
                      {}, {}, {}, {}, {})
    cap_entries = cblock_table.shape[1] * page_size
    for r in sorted(set(int(x) for x in ratios if x)):
        bpos = positions.unsqueeze(-1) - torch.arange(r - 1, -1, -1, device=positions.device)
        meta.block_slots[r] = _pos_to_slot(bpos, block_table, page_size)
        if compress_overlap(cfg, r):
            meta.prev_block_slots[r] = _pos_to_slot(bpos - r, block_table, page_size)
            meta.prev_valid[r] = positions + 1 >= 2 * r
        done = (positions + 1) % r == 0
        j = (positions + 1) // r - 1
        meta.entry_pos[r] = (positions + 1 - r).clamp_min(0)
        meta.entry_slot[r] = torch.where(done, _pos_to_slot(j, cblock_table, page_size),
                                         torch.zeros_like(j))
        meta.n_entries[r] = ((positions + 1) // r).int()
        if r != 4:
            n_max = max(1, min(cap_entries, cfg.max_position_embeddings // r))
            e = torch.arange(n_max, device=positions.device).expand(*positions.shape, n_max)
            vis = e < meta.n_entries[r].unsqueeze(-1)
            meta.all_entries[r] = torch.where(vis, _pos_to_slot(e, cblock_table, page_size),
                                              torch.full_like(e, -1)).int()
    return meta


def flat(pool: torch.Tensor) -> torch.Tensor:
    """A ``[P, page, ...]`` pool as ``[P * page, ...]`` rows (flat slots); other pools as they are."""
    return pool.view(-1, *pool.shape[2:]) if pool.dim() == 3 else pool

