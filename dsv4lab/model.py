"""DeepSeek-V4 in small, flat torch (gpt-fast style).

One file, read top-down: helpers (RMSNorm, RoPE, the mHC hyper-connections, whose
Sinkhorn mixing is :mod:`dsv4lab.ops.mhc`), then the attention (low-rank queries, one
shared latent KV, sliding window + compressed entries, the lightning indexer), the MoE,
the decoder block, the MTP draft layer, the model.

Every module has two forwards:

- ``forward_train``: full sequences, plain differentiable torch (dense masked attention).
  Used by :mod:`dsv4lab.train` and as the reference the decode path is tested against.
- ``forward_decode``: a few new tokens per request against a paged cache; attention goes
  through :func:`dsv4lab.ops.sparse_mla_decode`, the CSA top-k through
  :func:`dsv4lab.ops.indexer_topk`, the MoE through :func:`dsv4lab.ops.route` /
  :func:`dsv4lab.ops.hash_route` and :func:`dsv4lab.ops.fused_moe`, the projections
  through :func:`dsv4lab.ops.linear` (one launch for the 1 + k rows of a step, see
  ``_lin``). The backend of each op comes from a ``backends`` dict (op name -> backend
  name, missing = "auto"). No host synchronisation, fixed shapes: one CUDA graph can hold
  a whole decode step.

Architecture (DESIGN.md, "DeepSeek-V4-Flash facts"):

- Queries: ``x -> wq_a -> RMSNorm (q_lora) -> wq_b -> [H, D]``, then a per-head RMSNorm
  (no weight) and RoPE on the last ``rope_dim`` dims.
- One latent KV vector per token (MQA): ``x -> wkv -> RMSNorm -> RoPE on the tail``. It is
  both K and V (d_v = D). Because V carries rotated dims, the attention output's RoPE tail
  is rotated back by the query position (``inverse`` RoPE), as the reference does.
- A learned sink per head adds ``exp(sink)`` to the softmax denominator.
- Grouped output projection: heads split into ``o_groups`` groups, each projected to
  ``o_lora_rank`` by its own matrix, then concatenated and projected to hidden.
- Keys a query at position p sees: the last ``window_size`` raw tokens, plus, by
  ``compress_ratios[layer]``: 0 nothing; 4 (CSA) the ``index_topk`` compressed entries the
  lightning indexer scores best; any other ratio r (HCA, 128 in V4) every complete
  compressed entry. Entry j covers tokens ``[j*r, (j+1)*r)`` and is visible once its last
  token is (``(j+1)*r <= p+1``).
- The compressor (kept simple on purpose): entry j = RMSNorm(sum over the r tokens of
  ``softmax_t(gate_t + ape[t mod r]) * kv_t``), a learned per-channel weighted pooling of
  the block's projected tokens, then RoPE at the block's first position j*r. The reference
  code overlaps ratio-4 windows; we do not.
- Lightning indexer (ratio-4 layers): its own compressor makes ``index_head_dim`` keys;
  queries come from the q latent; ``score_j = sum_h w_h ReLU(q_h . k_j)`` with ``w`` a
  projection of the hidden state. Trained (on detached inputs) to match the main
  attention's distribution over compressed entries (KL), as in DeepSeek-V3.2.
- MoE: ``sqrt(softplus(logit))`` scores; a per-expert bias (updated without gradients,
  noaux_tc) affects selection only; weights = unbiased scores of the chosen experts,
  normalised, times ``routed_scaling_factor``. The first ``n_hash_layers`` layers choose
  experts by a fixed token-id table. Routed + shared experts, clamped SwiGLU
  (``silu(min(g, L)) * clamp(u, -L, L)``). Routed experts are float while training and
  MXFP4 (or NVFP4) after :meth:`DSV4.quantize_experts` (or when built with
  ``expert_format=`` for random real-size layers).
- mHC: ``hc_mult`` residual streams. Before each sub-block the streams are reduced with
  weights ``pre``; after it, ``streams = post * out + comb @ streams`` where ``comb`` is a
  Sinkhorn-normalised (doubly stochastic) matrix. pre/post/comb are computed per token
  from the RMS-normalised streams.
- MTP: ``h' = h_proj(norm(h)) + e_proj(norm(embed(next token)))`` on each stream, one
  decoder block, its own stream reduction and norm, the shared LM head. It predicts the
  token after next; the engine runs it recursively to draft 1-3 tokens.

Explained in notebooks/05_mtp_speculative.ipynb.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from dsv4lab import ops, quant
from dsv4lab.config import DSV4Config
from dsv4lab.ops.moe import swiglu   # the clamped SwiGLU of the MoE op (limit None or > 0)

OPS = ("sparse_mla_decode", "indexer_topk", "fused_moe", "mhc", "linear")
EXPERT_FORMATS = ("bf16", "mxfp4", "nvfp4")


def tiny_config(**changes) -> DSV4Config:
    """A test-sized config with every feature (window, CSA ratio 4, HCA ratio 8, hash
    layer, MTP, mHC): runs in Triton's interpreter in seconds."""
    base = DSV4Config.mini().replace(
        name="tiny", hidden_size=64, num_layers=3, num_heads=2, head_dim=32, rope_dim=8,
        q_lora_rank=32, o_groups=2, o_lora_rank=32, window_size=8, compress_ratios=(0, 4, 8, 0),
        index_n_heads=2, index_head_dim=16, index_topk=4, n_routed_experts=4,
        n_experts_per_tok=2, moe_intermediate_size=32, hc_mult=2, max_position_embeddings=256)
    return base.replace(**changes)


# ======================================================================================
# Helpers
# ======================================================================================

def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def _cos_sin(pos: torch.Tensor, rope_dim: int, theta: float, memo: dict | None = None):
    key = (id(pos), rope_dim, theta)
    if memo is not None and key in memo:
        return memo[key][1:]
    half = rope_dim // 2
    inv_freq = theta ** (-torch.arange(half, device=pos.device, dtype=torch.float32) / half)
    ang = pos.to(torch.float32).unsqueeze(-1) * inv_freq
    cs = (ang.cos(), ang.sin())
    if memo is not None:
        memo[key] = (pos,) + cs          # keep pos alive: its id stays unique
    return cs


def rope_tail(x: torch.Tensor, pos: torch.Tensor, rope_dim: int, theta: float,
              inverse: bool = False, heads: bool = False, memo: dict | None = None) -> torch.Tensor:
    """Rotate the last ``rope_dim`` dims of ``x`` (half-split pairs) by position ``pos``.

    ``pos`` has ``x``'s leading shape (``heads``: all but the head dimension, the one
    before last). ``inverse`` rotates by ``-pos``. ``memo`` (a dict living for one
    forward) shares cos/sin between the layers.
    """
    cos, sin = _cos_sin(pos, rope_dim, theta, memo)
    if heads:
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if inverse:
        sin = -sin
    half = rope_dim // 2
    nope, r = x[..., :-rope_dim], x[..., -rope_dim:].float()
    r1, r2 = r[..., :half], r[..., half:]
    rot = torch.cat([r1 * cos - r2 * sin, r1 * sin + r2 * cos], dim=-1)
    return torch.cat([nope, rot.to(x.dtype)], dim=-1)


class HyperConnection(nn.Module):
    """mHC around one sub-block: reduce ``n`` streams to one input, mix them back after.

    ``mixes = (flatten(streams) @ fn.T) * rsqrt(mean(streams^2))`` gives, per token,
    ``pre`` (n), ``post`` (n) and ``comb`` (n x n, Sinkhorn-normalised).
    """

    def __init__(self, n: int, dim: int, iters: int, eps: float = 1e-6):
        super().__init__()
        self.n, self.iters, self.eps = n, iters, eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * dim))
        self.base = nn.Parameter(torch.zeros((2 + n) * n))
        self.scale = nn.Parameter(torch.ones(3))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        n = self.n
        nn.init.normal_(self.fn, std=0.1 / math.sqrt(self.fn.shape[1]))
        self.base.zero_()
        self.base[:n] = math.log(1.0 / (n - 1)) if n > 1 else 4.0   # pre = 1/n: mean of streams
        self.base[2 * n:] = 4.0 * torch.eye(n).flatten()             # comb near identity
        self.scale.fill_(1.0)

    def pre(self, x: torch.Tensor, backends: dict | None = None):
        """x [.., n, d] -> (y [.., d], post [.., n], comb [.., n, n]) via :func:`dsv4lab.ops.mhc_pre`
        (backend ``backends["mhc"]``, default "auto")."""
        return ops.mhc_pre(x, self.fn, self.base, self.scale, iters=self.iters, eps=self.eps,
                           backend=(backends or {}).get("mhc", "auto"))

    @staticmethod
    def post(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
             backends: dict | None = None):
        """streams_i = post_i * out + sum_j comb_ij * residual_j (:func:`dsv4lab.ops.mhc_post`)."""
        return ops.mhc_post(out, residual, post, comb, backend=(backends or {}).get("mhc", "auto"))


class HCHead(nn.Module):
    """The final reduction of the streams to one vector (pre weights only)."""

    def __init__(self, n: int, dim: int, eps: float = 1e-6):
        super().__init__()
        self.n, self.eps = n, eps
        self.fn = nn.Parameter(torch.empty(n, n * dim))
        self.base = nn.Parameter(torch.full((n,), math.log(1.0 / (n - 1)) if n > 1 else 4.0))
        nn.init.normal_(self.fn, std=0.1 / math.sqrt(n * dim))

    def forward(self, x, backends: dict | None = None):
        """x [.., n, d] -> y [.., d] via :func:`dsv4lab.ops.mhc_head`."""
        return ops.mhc_head(x, self.fn, self.base, eps=self.eps,
                            backend=(backends or {}).get("mhc", "auto"))


def _linear(i: int, o: int) -> nn.Linear:
    return nn.Linear(i, o, bias=False)


def _lin(module: nn.Linear, x: torch.Tensor, backends: dict | None) -> torch.Tensor:
    """``module(x)``; on the decode path (``backends`` a dict) through :func:`dsv4lab.ops.linear`
    with backend ``backends["linear"]`` (the one-launch small-M kernel for a few rows).
    ``backends=None`` (the training forwards) is the plain ``nn.Linear``."""
    if backends is None:
        return module(x)
    w = module.weight
    y = ops.linear(x.reshape(-1, x.shape[-1]), w, backend=backends.get("linear", "auto"))
    return y.view(*x.shape[:-1], w.shape[0])


# ======================================================================================
# Paged cache layout the decode forward reads and writes
# ======================================================================================

@dataclass
class LayerCache:
    """One layer's paged storage. Every pool has the same ``[P, page]`` page space.

    Raw tokens and compressed entries live in the same ``kv`` pool (different pages, given
    by the request's raw and compressed block tables), so one index list addresses both.
    ``kv`` is ``[P, page, D]`` in the model dtype or the FP8 cache ``uint8 [P*page, 584]``.
    ``comp_kv``/``comp_gate`` hold each raw token's projected compressor inputs;
    ``idx_kv``/``idx_gate`` the indexer compressor's; ``idx_keys [P, page, Di]`` and
    ``idx_scale [P, page]`` the compressed indexer keys (bf16 with scale 1, or e4m3).
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
        if ratio:
            c.comp_kv, c.comp_gate = z(*shape, D), z(*shape, D)
        if ratio == 4:
            c.idx_kv, c.idx_gate = z(*shape, Di), z(*shape, Di)
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
    ``all_entries[r] [B, S, E_r]`` their slots (-1 when not visible).
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


def _pos_to_slot(pos: torch.Tensor, table: torch.Tensor, page: int) -> torch.Tensor:
    """Logical position -> flat slot through a block table (clamped, never out of range)."""
    B = table.shape[0]
    p = pos.clamp_min(0)
    pg = (p // page).clamp_max(table.shape[1] - 1)
    flat = pg.reshape(B, -1)
    phys = table.long().gather(1, flat).reshape(pos.shape)
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


def _flat(pool: torch.Tensor) -> torch.Tensor:
    return pool.view(-1, *pool.shape[2:]) if pool.dim() == 3 else pool


# ======================================================================================
# Attention
# ======================================================================================

class Compressor(nn.Module):
    """Learned weighted pooling of each block of ``ratio`` tokens into one entry."""

    def __init__(self, dim: int, out_dim: int, ratio: int, rope_dim: int, theta: float, eps: float):
        super().__init__()
        self.ratio, self.rope_dim, self.theta = ratio, rope_dim, theta
        self.wkv = _linear(dim, out_dim)
        self.wgate = _linear(dim, out_dim)
        self.ape = nn.Parameter(torch.zeros(ratio, out_dim))
        self.norm = RMSNorm(out_dim, eps)

    def project(self, x, backends: dict | None = None):
        """Per-token state: (kv, gate), each [.., out_dim]."""
        return _lin(self.wkv, x, backends), _lin(self.wgate, x, backends)

    def pool(self, kv, gate, first_pos, memo=None):
        """kv, gate [.., r, out] (the block's tokens in order) -> entry [.., out], RoPE'd at
        ``first_pos`` (the block's first position)."""
        w = (gate.float() + self.ape.float()).softmax(dim=-2)
        e = self.norm((w * kv.float()).sum(-2).to(kv.dtype))
        return rope_tail(e, first_pos, self.rope_dim, self.theta, memo=memo)

    def forward_train(self, x):
        """x [B, T, d] -> entries [B, T // r, out] of the complete blocks."""
        B, T, _ = x.shape
        r = self.ratio
        n = T // r
        kv, gate = self.project(x[:, :n * r])
        kv = kv.view(B, n, r, kv.shape[-1])
        gate = gate.view(B, n, r, gate.shape[-1])
        first = torch.arange(n, device=x.device) * r
        return self.pool(kv, gate, first)


class Indexer(nn.Module):
    """The lightning indexer of ratio-4 (CSA) layers."""

    def __init__(self, cfg: DSV4Config):
        super().__init__()
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.rope_dim = min(cfg.rope_dim, cfg.index_head_dim // 2) // 2 * 2
        self.theta = cfg.rope_theta
        self.topk = cfg.index_topk
        self.wq = _linear(cfg.q_lora_rank, self.n_heads * self.head_dim)
        self.wweights = _linear(cfg.hidden_size, self.n_heads)
        self.compressor = Compressor(cfg.hidden_size, self.head_dim, 4, self.rope_dim,
                                     cfg.rope_theta, cfg.rms_norm_eps)

    def queries(self, x, qr, pos, memo=None, backends: dict | None = None):
        """-> q [.., Hi, Di], weights [.., Hi] fp32 (with both softmax scales folded in)."""
        q = _lin(self.wq, qr, backends).unflatten(-1, (self.n_heads, self.head_dim))
        q = rope_tail(q, pos, self.rope_dim, self.theta, heads=True, memo=memo)
        w = _lin(self.wweights, x, backends).float() * (self.n_heads ** -0.5 * self.head_dim ** -0.5)
        return q, w

    def logits_train(self, x, qr, pos):
        """Dense indexer logits [B, T, T//4] (no visibility mask)."""
        q, w = self.queries(x, qr, pos)
        k = self.compressor.forward_train(x)                                 # [B, Tc, Di]
        s = torch.einsum("bthd,bjd->bthj", q.float(), k.float()).relu()
        return (s * w.unsqueeze(-1)).sum(2)


class Attention(nn.Module):
    def __init__(self, cfg: DSV4Config, layer_id: int):
        super().__init__()
        self.cfg = cfg
        self.ratio = cfg.compress_ratios[layer_id] if layer_id < len(cfg.compress_ratios) else 0
        d, H, D = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        self.n_heads, self.head_dim, self.rope_dim = H, D, cfg.rope_dim
        self.window = cfg.window_size
        self.scale = D ** -0.5
        self.wq_a = _linear(d, cfg.q_lora_rank)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = _linear(cfg.q_lora_rank, H * D)
        self.wkv = _linear(d, D)
        self.kv_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.attn_sink = nn.Parameter(torch.zeros(H))
        G = cfg.o_groups
        self.o_groups = G
        self.wo_a = nn.Parameter(torch.empty(G, cfg.o_lora_rank, H // G * D))
        self.wo_b = _linear(G * cfg.o_lora_rank, d)
        nn.init.normal_(self.wo_a, std=0.02)
        self.compressor = Compressor(d, D, self.ratio, cfg.rope_dim, cfg.rope_theta,
                                     cfg.rms_norm_eps) if self.ratio else None
        self.indexer = Indexer(cfg) if self.ratio == 4 else None

    # ---- pieces shared by both forwards ------------------------------------------------
    def _qkv(self, x, pos, memo=None, backends: dict | None = None):
        cfg = self.cfg
        qr = self.q_norm(_lin(self.wq_a, x, backends))
        q = _lin(self.wq_b, qr, backends).unflatten(-1, (self.n_heads, self.head_dim))
        q = rope_tail(rms_norm(q, None, cfg.rms_norm_eps), pos, self.rope_dim, cfg.rope_theta,
                      heads=True, memo=memo)
        kv = rope_tail(self.kv_norm(_lin(self.wkv, x, backends)), pos, self.rope_dim, cfg.rope_theta,
                       memo=memo)
        return qr, q, kv

    def _out(self, o, pos, memo=None, backends: dict | None = None):
        """o [.., H, D] -> undo RoPE on the tail, grouped output projection -> [.., d]."""
        o = rope_tail(o, pos, self.rope_dim, self.cfg.rope_theta, inverse=True, heads=True, memo=memo)
        o = o.flatten(-2).unflatten(-1, (self.o_groups, -1))                 # [.., G, H/G*D]
        o = torch.einsum("...gk,gok->...go", o, self.wo_a.to(o.dtype))
        return _lin(self.wo_b, o.flatten(-2), backends)

    # ---- training: full sequences ----------------------------------------------------
    def forward_train(self, x: torch.Tensor):
        """x [B, T, d] -> (out [B, T, d], indexer KL loss (0-d) or None)."""
        B, T, _ = x.shape
        pos = torch.arange(T, device=x.device)
        qr, q, kv = self._qkv(x, pos)
        qp, kp = pos[:, None], pos[None, :]
        mask = (kp <= qp) & (kp > qp - self.window)                          # [T, T]
        keys = kv
        idx_loss = None
        if self.ratio:
            r = self.ratio
            ent = self.compressor.forward_train(x)                           # [B, Tc, D]
            Tc = ent.shape[1]
            vis = (torch.arange(Tc, device=x.device)[None, :] + 1) * r <= qp + 1   # [T, Tc]
            keys = torch.cat([kv, ent], dim=1)
        scores = torch.einsum("bthd,bkd->bhtk", q, keys).float() * self.scale
        if self.ratio:
            cmask = vis.expand(B, T, Tc)
            if self.indexer is not None and Tc > 0:
                ilog = self.indexer.logits_train(x.detach(), qr.detach(), pos)    # [B, T, Tc]
                ilog = ilog.masked_fill(~vis, float("-inf"))
                k = min(self.indexer.topk, Tc)
                top = ilog.topk(k, dim=-1).indices
                sel = torch.zeros_like(cmask).scatter_(-1, top, True)
                cmask = sel & vis
                # indexer loss: match the main attention's distribution over the entries
                with torch.no_grad():
                    cs = scores[..., T:].masked_fill(~vis, float("-inf"))
                    target = torch.nan_to_num(cs.softmax(-1)).mean(1)        # [B, T, Tc]
                logp = torch.log_softmax(ilog, dim=-1).masked_fill(~vis, 0.0)
                rows = vis.any(-1).expand(B, T)
                ce = -(target * logp).sum(-1)
                idx_loss = (ce * rows).sum() / rows.sum().clamp_min(1)
            mask = torch.cat([mask.expand(B, T, T), cmask], dim=-1)
        else:
            mask = mask.expand(B, T, T)
        scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
        sink = self.attn_sink.float().view(1, -1, 1, 1).expand(B, -1, T, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        o = torch.einsum("bhtk,bkd->bthd", probs.to(keys.dtype), keys)
        return self._out(o, pos), idx_loss

    # ---- decode: a few new tokens against the paged cache ------------------------------
    def forward_decode(self, x: torch.Tensor, meta: DecodeMeta, cache: LayerCache,
                       backends: dict | None = None) -> torch.Tensor:
        """x [B, S, d] at ``meta.positions`` -> [B, S, d]; writes this layer's cache."""
        backends = backends or {}
        pos, memo = meta.positions, meta.memo
        qr, q, kv = self._qkv(x, pos, memo, backends)
        kv_flat = cache.kv if cache.fp8 else _flat(cache.kv)
        self._write(kv_flat, meta.slots, kv, cache.fp8)
        parts = [meta.window]
        if self.ratio:
            r = self.ratio
            ckv, cgate = self.compressor.project(x, backends)
            _flat(cache.comp_kv)[meta.slots] = ckv.to(cache.comp_kv.dtype)
            _flat(cache.comp_gate)[meta.slots] = cgate.to(cache.comp_gate.dtype)
            bs = meta.block_slots[r]
            ent = self.compressor.pool(_flat(cache.comp_kv)[bs], _flat(cache.comp_gate)[bs],
                                       meta.entry_pos[r], memo)
            self._write(kv_flat, meta.entry_slot[r], ent, cache.fp8)
            if self.indexer is not None:
                parts.append(self._select(x, qr, meta, cache, backends))
            else:
                parts.append(meta.all_entries[r])
        idx = torch.cat(parts, dim=-1).int()
        kv_arg = cache.kv
        o, _ = ops.sparse_mla_decode(
            q.to(x.dtype), kv_arg, idx, d_v=self.head_dim, softmax_scale=self.scale,
            attn_sink=self.attn_sink.float(), backend=backends.get("sparse_mla_decode", "auto"))
        return self._out(o.to(x.dtype), pos, memo, backends)

    @staticmethod
    def _write(kv_flat, slots, values, fp8):
        if fp8:
            kv_flat[slots.reshape(-1)] = quant.pack_kv_fp8(values.reshape(-1, values.shape[-1]))
        else:
            kv_flat[slots] = values.to(kv_flat.dtype)

    def _select(self, x, qr, meta, cache, backends):
        """CSA: write the indexer's keys, let the indexer choose top-k entries -> slots."""
        ix = self.indexer
        pos = meta.positions
        ikv, igate = ix.compressor.project(x, backends)
        _flat(cache.idx_kv)[meta.slots] = ikv.to(cache.idx_kv.dtype)
        _flat(cache.idx_gate)[meta.slots] = igate.to(cache.idx_gate.dtype)
        bs = meta.block_slots[4]
        key = ix.compressor.pool(_flat(cache.idx_kv)[bs], _flat(cache.idx_gate)[bs], meta.entry_pos[4],
                                 meta.memo)
        es = meta.entry_slot[4]
        if cache.idx_keys.dtype == torch.float8_e4m3fn:
            amax = key.float().abs().amax(-1).clamp_min(1e-12)
            sc = amax / 448.0
            _flat(cache.idx_keys)[es] = (key.float() / sc.unsqueeze(-1)).to(torch.float8_e4m3fn)
            cache.idx_scale.view(-1)[es] = sc
        else:
            _flat(cache.idx_keys)[es] = key.to(cache.idx_keys.dtype)
        q, w = ix.queries(x, qr, pos, meta.memo, backends)
        qdt = torch.float32 if cache.idx_keys.dtype == torch.float32 else torch.bfloat16
        top = ops.indexer_topk(
            q.to(qdt), cache.idx_keys, cache.idx_scale, w, meta.cblock_table,
            meta.n_entries[4], max_context=meta.cblock_table.shape[1] * meta.page_size,
            topk=ix.topk, backend=backends.get("indexer_topk", "auto"))
        return ops.to_cache_slots(top, meta.cblock_table, meta.page_size)


# ======================================================================================
# MoE
# ======================================================================================

class MLP(nn.Module):
    """A (shared) SwiGLU expert in float weights."""

    def __init__(self, dim: int, inter: int, limit: float | None):
        super().__init__()
        self.limit = limit
        self.w13 = _linear(dim, 2 * inter)
        self.w2 = _linear(inter, dim)

    def forward(self, x, backends: dict | None = None):
        return _lin(self.w2, swiglu(_lin(self.w13, x, backends), self.limit), backends)


class MoE(nn.Module):
    """Routed experts (float, MXFP4 or NVFP4) + shared expert(s).

    Routed weights, ``fused_moe``'s layout: ``w13 [E, 2I, d]`` (gate rows, then up rows)
    and ``w2 [E, d, I]``; quantised along the last (reduction) dimension.
    """

    def __init__(self, cfg: DSV4Config, layer_id: int, expert_format: str = "bf16"):
        super().__init__()
        if expert_format not in EXPERT_FORMATS:
            raise ValueError(f"expert_format must be one of {EXPERT_FORMATS}, got {expert_format!r}")
        d, E, I = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
        self.cfg = cfg
        self.n_experts, self.topk, self.inter = E, cfg.n_experts_per_tok, I
        self.limit = cfg.swiglu_limit or None
        self.hashed = layer_id < cfg.n_hash_layers
        self.gate = _linear(d, E)
        self.register_buffer("bias", torch.zeros(E))
        if self.hashed:
            g = torch.Generator().manual_seed(1234 + layer_id)
            table = torch.rand(cfg.vocab_size, E, generator=g).argsort(-1)[:, :self.topk]
            self.register_buffer("tid2eid", table.to(torch.int32))
        self.shared = MLP(d, I * cfg.n_shared_experts, self.limit) if cfg.n_shared_experts else None
        self.fmt = "bf16"
        self.w13 = nn.Parameter(torch.empty(0))
        self.w2 = nn.Parameter(torch.empty(0))
        if expert_format == "bf16":
            self.w13 = nn.Parameter(torch.randn(E, 2 * I, d) * d ** -0.5)
            self.w2 = nn.Parameter(torch.randn(E, d, I) * I ** -0.5 / math.sqrt(2 * cfg.num_layers))
        else:
            self._random_quantized(expert_format)
        self.load = None   # last training forward's per-expert token counts

    # ---- formats ----------------------------------------------------------------------
    def _set_quantized(self, fmt, w13, s13, w2, s2, g13=None, g2=None):
        del self.w13, self.w2
        self.fmt = fmt
        self.register_buffer("w13", w13)
        self.register_buffer("w13_scale", s13)
        self.register_buffer("w2", w2)
        self.register_buffer("w2_scale", s2)
        if fmt == "nvfp4":
            self.register_buffer("w13_global", g13)
            self.register_buffer("w2_global", g2)

    def _random_quantized(self, fmt):
        """Random FP4 experts built directly in packed form (no float copy: real size fits)."""
        E, I, d = self.n_experts, self.inter, self.cfg.hidden_size
        dev = self.gate.weight.device
        w13 = torch.randint(0, 256, (E, 2 * I, d // 2), dtype=torch.uint8, device=dev)
        w2 = torch.randint(0, 256, (E, d, I // 2), dtype=torch.uint8, device=dev)
        if fmt == "mxfp4":
            # E2M1 magnitudes average ~2.2; 2^(s-127) brings rows to ~1/sqrt(K)
            s13 = torch.full((E, 2 * I, d // 32), 127 - round(math.log2(2.2 * math.sqrt(d))),
                             dtype=torch.uint8, device=dev)
            s2 = torch.full((E, d, I // 32), 127 - round(math.log2(2.2 * math.sqrt(I))),
                            dtype=torch.uint8, device=dev)
            self._set_quantized(fmt, w13, s13, w2, s2)
        else:
            s13 = torch.full((E, 2 * I, d // 16), 1.0, device=dev).to(torch.float8_e4m3fn)
            s2 = torch.full((E, d, I // 16), 1.0, device=dev).to(torch.float8_e4m3fn)
            g13 = torch.tensor(1 / (2.2 * math.sqrt(d)), device=dev)
            g2 = torch.tensor(1 / (2.2 * math.sqrt(I)), device=dev)
            self._set_quantized(fmt, w13, s13, w2, s2, g13, g2)

    @torch.no_grad()
    def quantize_(self, fmt: str = "mxfp4"):
        """Replace the float routed experts by packed FP4 (fmt "mxfp4" or "nvfp4")."""
        if self.fmt != "bf16":
            raise ValueError(f"experts are already quantised ({self.fmt})")
        w13, w2 = self.w13.detach().float(), self.w2.detach().float()
        if fmt == "mxfp4":
            self._set_quantized(fmt, *quant.mxfp4_quantize(w13), *quant.mxfp4_quantize(w2))
        elif fmt == "nvfp4":
            p13, s13, g13 = quant.nvfp4_quantize(w13)
            p2, s2, g2 = quant.nvfp4_quantize(w2)
            self._set_quantized(fmt, p13, s13, p2, s2, g13, g2)
        else:
            raise ValueError(f"fmt must be 'mxfp4' or 'nvfp4', got {fmt!r}")

    def dense_experts(self, dtype=torch.float32):
        """(w13 [E, 2I, d], w2 [E, d, I]) as floats (dequantised when packed)."""
        if self.fmt == "bf16":
            return self.w13.to(dtype), self.w2.to(dtype)
        if self.fmt == "mxfp4":
            return (quant.mxfp4_dequantize(self.w13, self.w13_scale, dtype=dtype),
                    quant.mxfp4_dequantize(self.w2, self.w2_scale, dtype=dtype))
        return (quant.nvfp4_dequantize(self.w13, self.w13_scale, self.w13_global, dtype=dtype),
                quant.nvfp4_dequantize(self.w2, self.w2_scale, self.w2_global, dtype=dtype))

    # ---- routing ----------------------------------------------------------------------
    def _route_train(self, logits, tokens):
        cfg = self.cfg
        lf = logits.float()
        if cfg.score_func == "sqrtsoftplus":
            scores = F.softplus(lf).sqrt()
        elif cfg.score_func == "sigmoid":
            scores = lf.sigmoid()
        else:
            scores = lf.softmax(-1)
        if self.hashed:
            ids = self.tid2eid[tokens].long()
        else:
            ids = (scores + self.bias).topk(self.topk, dim=-1).indices
        w = scores.gather(-1, ids)
        w = w / w.sum(-1, keepdim=True).clamp_min(1e-20) * cfg.routed_scaling_factor
        return ids, w

    # ---- forwards ---------------------------------------------------------------------
    def forward_train(self, x, tokens):
        """x [B, T, d], tokens [B, T] -> [B, T, d]. Dense over experts (fine at mini size)."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        ids, w = self._route_train(self.gate(x2), tokens.reshape(-1))
        combine = torch.zeros(x2.shape[0], self.n_experts, device=x.device, dtype=torch.float32)
        combine.scatter_(1, ids, w)
        if self.training and not self.hashed:
            self.load = torch.bincount(ids.flatten(), minlength=self.n_experts).detach()
        w13, w2 = self.dense_experts(torch.float32) if self.fmt != "bf16" else (self.w13, self.w2)
        h = torch.einsum("nd,efd->nef", x2, w13.to(x2.dtype))
        a = swiglu(h, self.limit) * combine.unsqueeze(-1).to(h.dtype)
        y = torch.einsum("nei,edi->nd", a, w2.to(a.dtype))
        if self.shared is not None:
            y = y + self.shared(x2)
        return y.view(shape)

    def route_decode(self, x, tokens, backends: dict | None = None):
        """x [T, d], tokens [T] -> (ids int32 [T, k], weights fp32 [T, k]) through
        ops.hash_route (hash layers) or ops.route; both are CUDA-graph capturable."""
        cfg = self.cfg
        logits = _lin(self.gate, x, backends).float()
        if self.hashed:
            return ops.hash_route(tokens.reshape(-1), self.tid2eid, logits, score=cfg.score_func,
                                  routed_scaling_factor=cfg.routed_scaling_factor)
        return ops.route(logits, self.bias, topk=self.topk, score=cfg.score_func,
                         routed_scaling_factor=cfg.routed_scaling_factor)

    def forward_decode(self, x, tokens, backends: dict | None = None):
        """x [T, d], tokens [T] -> [T, d] through ops.route/hash_route and ops.fused_moe."""
        backends = backends or {}
        ids, w = self.route_decode(x, tokens, backends)
        if self.fmt == "bf16":
            combine = torch.zeros(x.shape[0], self.n_experts, device=x.device, dtype=torch.float32)
            combine.scatter_(1, ids.long(), w)
            h = torch.einsum("nd,efd->nef", x, self.w13.to(x.dtype))
            a = swiglu(h, self.limit) * combine.unsqueeze(-1).to(h.dtype)
            y = torch.einsum("nei,edi->nd", a, self.w2.to(a.dtype))
        else:
            kw = dict(w13_global=self.w13_global, w2_global=self.w2_global) if self.fmt == "nvfp4" else {}
            y = ops.fused_moe(x, self.w13, self.w13_scale, self.w2, self.w2_scale, ids, w,
                              fmt=self.fmt, swiglu_limit=self.limit,
                              backend=backends.get("fused_moe", "auto"), **kw)
        if self.shared is not None:
            y = y + self.shared(x, backends)
        return y.to(x.dtype)


# ======================================================================================
# Block, MTP, model
# ======================================================================================

class Block(nn.Module):
    """One decoder layer: mHC(attention) then mHC(MoE).

    ``Block(DSV4Config.flash(), 2, expert_format="mxfp4")`` under ``torch.device("cuda")``
    builds one real-size layer with random weights (ratio 4 at layer 2).
    """

    def __init__(self, cfg: DSV4Config, layer_id: int, expert_format: str = "bf16"):
        super().__init__()
        self.layer_id = layer_id
        d, n = cfg.hidden_size, cfg.hc_mult
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer_id)
        self.ffn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.moe = MoE(cfg, layer_id, expert_format)
        self.hc_attn = HyperConnection(n, d, cfg.hc_sinkhorn_iters)
        self.hc_ffn = HyperConnection(n, d, cfg.hc_sinkhorn_iters)

    @property
    def ratio(self) -> int:
        return self.attn.ratio

    def forward_train(self, x, tokens):
        """x [B, T, n, d] -> (x, indexer loss or None)."""
        y, post, comb = self.hc_attn.pre(x)
        a, idx_loss = self.attn.forward_train(self.attn_norm(y))
        x = HyperConnection.post(a, x, post, comb)
        y, post, comb = self.hc_ffn.pre(x)
        x = HyperConnection.post(self.moe.forward_train(self.ffn_norm(y), tokens), x, post, comb)
        return x, idx_loss

    def forward_decode(self, x, tokens, meta: DecodeMeta, cache: LayerCache, backends=None):
        """x [B, S, n, d], tokens [B, S] -> x [B, S, n, d]."""
        y, post, comb = self.hc_attn.pre(x, backends)
        a = self.attn.forward_decode(self.attn_norm(y), meta, cache, backends)
        x = HyperConnection.post(a, x, post, comb, backends)
        y, post, comb = self.hc_ffn.pre(x, backends)
        B, S, d = y.shape
        m = self.moe.forward_decode(self.ffn_norm(y).reshape(B * S, d), tokens.reshape(-1), backends)
        return HyperConnection.post(m.view(B, S, d), x, post, comb, backends)


class MTP(nn.Module):
    """The next-n (MTP) draft layer: (streams at p, token p+1) -> logits for token p+2."""

    def __init__(self, cfg: DSV4Config, expert_format: str = "bf16"):
        super().__init__()
        d = cfg.hidden_size
        self.enorm = RMSNorm(d, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps)
        self.e_proj = _linear(d, d)
        self.h_proj = _linear(d, d)
        self.block = Block(cfg, cfg.num_layers, expert_format)
        self.hc_head = HCHead(cfg.hc_mult, d)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)

    def _input(self, h, e, backends: dict | None = None):
        return (_lin(self.h_proj, self.hnorm(h), backends)
                + _lin(self.e_proj, self.enorm(e), backends).unsqueeze(-2))


class DSV4(nn.Module):
    """The model. ``DSV4(DSV4Config.mini())`` trains in minutes; see :mod:`dsv4lab.train`."""

    def __init__(self, cfg: DSV4Config, expert_format: str = "bf16"):
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.embed = nn.Embedding(cfg.vocab_size, d)
        self.layers = nn.ModuleList(Block(cfg, i, expert_format) for i in range(cfg.num_layers))
        self.hc_head = HCHead(cfg.hc_mult, d)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.head = _linear(d, cfg.vocab_size)
        self.mtp = nn.ModuleList(MTP(cfg, expert_format) for _ in range(min(1, cfg.num_mtp_layers)))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        for name, p in self.named_parameters():
            if name.endswith("weight") and p.dim() == 2 and "norm" not in name:
                std = 0.02
                if name.endswith(("wo_b.weight", "w2.weight")):
                    std = 0.02 / math.sqrt(2 * self.cfg.num_layers)
                nn.init.normal_(p, std=std)

    @property
    def expert_format(self) -> str:
        return self.layers[0].moe.fmt

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def quantize_experts(self, fmt: str = "mxfp4") -> "DSV4":
        """Quantise every routed expert (main layers and the MTP layer) in place."""
        for m in self.modules():
            if isinstance(m, MoE) and m.fmt == "bf16":
                m.quantize_(fmt)
        return self

    def logits(self, x, backends: dict | None = None):
        """streams [.., n, d] -> logits [.., vocab] (fp32)."""
        return _lin(self.head, self.norm(self.hc_head(x, backends)), backends).float()

    # ---- training ---------------------------------------------------------------------
    def forward_train(self, tokens: torch.Tensor):
        """tokens [B, T] -> (logits [B, T, V], streams [B, T, n, d], indexer loss)."""
        x = self.embed(tokens).unsqueeze(-2).expand(-1, -1, self.cfg.hc_mult, -1).contiguous()
        idx_losses = []
        for layer in self.layers:
            x, il = layer.forward_train(x, tokens)
            if il is not None:
                idx_losses.append(il)
        idx_loss = torch.stack(idx_losses).mean() if idx_losses else x.new_zeros(())
        return self.logits(x), x, idx_loss

    def mtp_forward_train(self, streams, next_tokens, k: int = 0):
        """MTP over a full sequence: streams [B, T, n, d] at p, next_tokens [B, T] (token
        p+1) -> (logits for token p+2 [B, T, V], MTP streams)."""
        m = self.mtp[k]
        x = m._input(streams, self.embed(next_tokens))
        x, _ = m.block.forward_train(x, next_tokens)
        return self.head(m.norm(m.hc_head(x))).float(), x

    def loss(self, batch: torch.Tensor, mtp_weight: float = 0.3, idx_weight: float = 0.1) -> dict:
        """batch [B, T+2] -> dict(total, main, mtp, indexer): next-token CE, MTP CE on the
        token after next, and the indexer's KL term."""
        inp = batch[:, :-2]
        logits, streams, idx_loss = self.forward_train(inp)
        V = self.cfg.vocab_size
        main = F.cross_entropy(logits.reshape(-1, V), batch[:, 1:-1].reshape(-1))
        out = {"main": main, "indexer": idx_loss}
        total = main + idx_weight * idx_loss
        if len(self.mtp):
            mlog, _ = self.mtp_forward_train(streams, batch[:, 1:-1])
            mtp = F.cross_entropy(mlog.reshape(-1, V), batch[:, 2:].reshape(-1))
            out["mtp"] = mtp
            total = total + mtp_weight * mtp
        out["total"] = total
        return out

    @torch.no_grad()
    def update_router_bias(self, rate: float = 1e-3):
        """noaux_tc load balancing: nudge each expert's selection bias toward equal load."""
        for m in self.modules():
            if isinstance(m, MoE) and m.load is not None:
                load = m.load.float()
                m.bias += rate * torch.sign(load.mean() - load)
                m.load = None

    # ---- decode -----------------------------------------------------------------------
    def forward_decode(self, tokens, meta: DecodeMeta, caches: list, backends: dict | None = None):
        """tokens [B, S] at ``meta.positions`` -> (logits [B, S, V] fp32, streams [B, S, n, d])."""
        backends = {} if backends is None else backends
        x = self.embed(tokens).unsqueeze(-2).expand(-1, -1, self.cfg.hc_mult, -1).contiguous()
        for layer, cache in zip(self.layers, caches):
            x = layer.forward_decode(x, tokens, meta, cache, backends)
        return self.logits(x, backends), x

    def mtp_forward_decode(self, streams, next_tokens, meta: DecodeMeta, cache: LayerCache,
                           backends: dict | None = None, k: int = 0):
        """The draft layer at ``meta.positions``: (streams [B, S, n, d] at p, token p+1)
        -> (logits for token p+2, MTP streams)."""
        backends = {} if backends is None else backends
        m = self.mtp[k]
        x = m._input(streams, self.embed(next_tokens), backends)
        x = m.block.forward_decode(x, next_tokens, meta, cache, backends)
        return _lin(self.head, m.norm(m.hc_head(x, backends)), backends).float(), x

    def ratios(self) -> list[int]:
        """Compress ratio of each main layer, then the MTP layer's."""
        return [b.ratio for b in self.layers] + [m.block.ratio for m in self.mtp]


# ======================================================================================
# Checkpoints
# ======================================================================================

def config_to_json(cfg: DSV4Config) -> str:
    d = asdict(cfg)
    d["compress_ratios"] = list(cfg.compress_ratios)
    return json.dumps(d)


def config_from_json(s: str) -> DSV4Config:
    d = json.loads(s)
    d["compress_ratios"] = tuple(d["compress_ratios"])
    return DSV4Config(**d)


def save_checkpoint(model: DSV4, path, metadata: dict | None = None) -> None:
    """safetensors file: the state dict (packed experts as uint8) + config in metadata."""
    from safetensors.torch import save_file

    meta = {"config": config_to_json(model.cfg), "expert_format": model.expert_format}
    meta.update({k: v if isinstance(v, str) else json.dumps(v) for k, v in (metadata or {}).items()})
    sd = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(sd, str(path), metadata=meta)


def load_checkpoint(path, *, device=None, dtype: torch.dtype | None = None) -> DSV4:
    """Load a checkpoint written by :func:`save_checkpoint` (floats cast to ``dtype``)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    cfg = config_from_json(meta["config"])
    fmt = meta.get("expert_format", "bf16")
    model = DSV4(cfg)
    if fmt != "bf16":
        model.quantize_experts(fmt)
    sd = load_file(str(path))
    model.load_state_dict(sd)
    model.checkpoint_metadata = meta
    if dtype is not None:
        to_dtype(model, dtype)
    return model.to(device) if device is not None else model


def to_dtype(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast float parameters to ``dtype``; keep packed experts, scales, router bias and
    the mHC parameters as they are (the mixing runs in fp32)."""
    for mod in model.modules():
        keep = isinstance(mod, (HyperConnection, HCHead))
        for name, p in list(mod.named_parameters(recurse=False)):
            if p.is_floating_point() and not keep:
                p.data = p.data.to(dtype)
    return model
