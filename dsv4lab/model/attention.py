"""DeepSeek-V4's attention: low-rank queries, one shared latent KV, a sliding window plus
compressed entries, and the lightning indexer that picks the CSA entries.

- Queries: ``x -> wq_a -> RMSNorm (q_lora) -> wq_b -> [H, D]``, then a per-head RMSNorm
  (no weight) and RoPE on the last ``rope_dim`` dims.
- One latent KV vector per token (MQA): ``x -> wkv -> RMSNorm -> RoPE on the tail``. It is
  both K and V (d_v = D). Because V carries rotated dims, the attention output's RoPE tail
  is rotated back by the query position (``inverse`` RoPE), as the reference does.
- A learned sink per head adds ``exp(sink)`` to the softmax denominator.
- Grouped output projection: heads split into ``o_groups`` groups, each projected to
  ``o_lora_rank`` by its own matrix (``wo_a [G, o_lora, H/G*D]``; FP8: one block-scaled
  ``[G*o_lora, H/G*D]`` weight, group g its rows g*o_lora.., applied by
  :func:`dsv4lab.ops.linear` with ``groups=G``), then concatenated and projected to hidden.
- Keys a query at position p sees: the last ``window_size`` raw tokens, plus, by
  ``compress_ratios[layer]``: 0 nothing; 4 (CSA) the ``index_topk`` compressed entries the
  lightning indexer scores best; any other ratio r (HCA, 128 in V4) every complete
  compressed entry. Entry j covers tokens ``[j*r, (j+1)*r)`` and is visible once its last
  token is (``(j+1)*r <= p+1``).
- The compressor: entry j = RMSNorm(sum over the r tokens of
  ``softmax_t(gate_t + ape[t mod r]) * kv_t``), a learned per-channel weighted pooling of
  the block's projected tokens, then RoPE at the block's first position j*r. Overlapping
  (the released ratio-4 compressors, :func:`~dsv4lab.model.cache.compress_overlap`): the
  projections are twice as wide and the softmax runs over 2r tokens, the block's own
  (second half of each projection) and the block before it (first half; none for entry 0).
- Lightning indexer (ratio-4 layers): its own compressor makes ``index_head_dim`` keys;
  queries come from the q latent; ``score_j = sum_h w_h ReLU(q_h . k_j)`` with ``w`` a
  projection of the hidden state. Trained (on detached inputs) to match the main
  attention's distribution over compressed entries (KL), as in DeepSeek-V3.2.

The decode forward is built from public pieces (:meth:`Attention.project_qkv`,
:meth:`~Attention.write_and_select`, :meth:`~Attention.attend`,
:meth:`~Attention.project_out`) so that the drivers time each one and the tensor-parallel
layer swaps in its sharded projections.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from dsv4lab import ops, quant
from dsv4lab.config import DSV4Config
from dsv4lab.model.cache import DecodeMeta, LayerCache, compress_overlap, flat
from dsv4lab.model.layers import (BlockScaledFP8Linear, RMSNorm, apply_linear, make_linear, rms_norm,
                                  rope_tail)

FP8_MAX = 448.0          # the largest e4m3 value: an FP8 indexer key's scale is amax / FP8_MAX


def _no_mark(component: str) -> None:
    return None


class Compressor(nn.Module):
    """Learned weighted pooling of each block of ``ratio`` tokens into one entry (``overlap``:
    of the block and the one before it)."""

    def __init__(self, dim: int, out_dim: int, ratio: int, rope_dim: int, theta: float, eps: float,
                 overlap: bool = False):
        super().__init__()
        self.ratio, self.rope_dim, self.theta = ratio, rope_dim, theta
        self.out_dim, self.overlap = out_dim, overlap
        wide = 2 * out_dim if overlap else out_dim
        self.wkv = make_linear(dim, wide)
        self.wgate = make_linear(dim, wide)
        self.ape = nn.Parameter(torch.zeros(ratio, wide))
        self.norm = RMSNorm(out_dim, eps)

    def project(self, x, backends: dict | None = None):
        """Per-token state: (kv, gate), each [.., out_dim] (twice that when overlapping)."""
        return apply_linear(self.wkv, x, backends), apply_linear(self.wgate, x, backends)

    def pool(self, kv, gate, first_pos, memo=None, prev=None):
        """kv, gate [.., r, out] (the block's tokens in order; 2 * out wide when overlapping)
        -> entry [.., out], RoPE'd at ``first_pos`` (the block's first position). Overlapping:
        ``prev`` = (kv, gate, valid)
        of the block before (``valid [..]`` False for the first entry, whose softmax then
        covers its own tokens only)."""
        g = gate.float() + self.ape.float()
        if self.overlap:
            d = self.out_dim
            pkv, pgate, valid = prev
            pg = (pgate.float() + self.ape.float())[..., :d]
            pg = pg.masked_fill(~valid[..., None, None], float("-inf"))
            kv = torch.cat([pkv[..., :d], kv[..., d:]], dim=-2)
            g = torch.cat([pg, g[..., d:]], dim=-2)
        w = g.softmax(dim=-2)
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
        prev = None
        if self.overlap:
            shift = lambda t: torch.cat([torch.zeros_like(t[:, :1]), t[:, :-1]], dim=1)  # noqa: E731
            prev = (shift(kv), shift(gate), (torch.arange(n, device=x.device) >= 1).expand(B, n))
        return self.pool(kv, gate, first, prev=prev)

    def pool_cached(self, kv_pool, gate_pool, meta: DecodeMeta, memo=None):
        """The entry each new token's block pools, from a layer cache's projected inputs."""
        r = self.ratio
        bs = meta.block_slots[r]
        prev = None
        if self.overlap:
            ps = meta.prev_block_slots[r]
            prev = (flat(kv_pool)[ps], flat(gate_pool)[ps], meta.prev_valid[r])
        return self.pool(flat(kv_pool)[bs], flat(gate_pool)[bs], meta.entry_pos[r], memo, prev)


class Indexer(nn.Module):
    """The lightning indexer of ratio-4 (CSA) layers."""

    def __init__(self, cfg: DSV4Config):
        super().__init__()
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.rope_dim = min(cfg.rope_dim, cfg.index_head_dim // 2) // 2 * 2
        self.theta = cfg.rope_theta
        self.topk = cfg.index_topk
        self.wq = make_linear(cfg.q_lora_rank, self.n_heads * self.head_dim)
        self.wweights = make_linear(cfg.hidden_size, self.n_heads)
        self.compressor = Compressor(cfg.hidden_size, self.head_dim, 4, self.rope_dim,
                                     cfg.rope_theta, cfg.rms_norm_eps, compress_overlap(cfg, 4))

    def queries(self, x, qr, pos, memo=None, backends: dict | None = None):
        """-> q [.., Hi, Di], weights [.., Hi] fp32 (with both softmax scales folded in)."""
        q = apply_linear(self.wq, qr, backends).unflatten(-1, (self.n_heads, self.head_dim))
        q = rope_tail(q, pos, self.rope_dim, self.theta, heads=True, memo=memo)
        w = apply_linear(self.wweights, x, backends).float() * (self.n_heads ** -0.5 * self.head_dim ** -0.5)
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
        self.wq_a = make_linear(d, cfg.q_lora_rank)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = make_linear(cfg.q_lora_rank, H * D)
        self.wkv = make_linear(d, D)
        self.kv_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.attn_sink = nn.Parameter(torch.zeros(H))
        G = cfg.o_groups
        self.o_groups = G
        self.wo_a = nn.Parameter(torch.empty(G, cfg.o_lora_rank, H // G * D))
        self.wo_b = make_linear(G * cfg.o_lora_rank, d)
        nn.init.normal_(self.wo_a, std=0.02)
        self.compressor = Compressor(d, D, self.ratio, cfg.rope_dim, cfg.rope_theta, cfg.rms_norm_eps,
                                     compress_overlap(cfg, self.ratio)) if self.ratio else None
        self.indexer = Indexer(cfg) if self.ratio == 4 else None

    # ---- pieces shared by both forwards ------------------------------------------------
    def project_qkv(self, x, pos, memo=None, backends: dict | None = None):
        """x [.., d] -> (q latent [.., q_lora], q [.., H, D], kv [.., D]), RoPE applied."""
        cfg = self.cfg
        qr = self.q_norm(apply_linear(self.wq_a, x, backends))
        q = apply_linear(self.wq_b, qr, backends).unflatten(-1, (self.n_heads, self.head_dim))
        q = rope_tail(rms_norm(q, None, cfg.rms_norm_eps), pos, self.rope_dim, cfg.rope_theta,
                      heads=True, memo=memo)
        kv = rope_tail(self.kv_norm(apply_linear(self.wkv, x, backends)), pos, self.rope_dim,
                       cfg.rope_theta, memo=memo)
        return qr, q, kv

    def project_out(self, o, pos, memo=None, backends: dict | None = None):
        """o [.., H, D] -> undo RoPE on the tail, grouped output projection -> [.., d]."""
        o = rope_tail(o, pos, self.rope_dim, self.cfg.rope_theta, inverse=True, heads=True, memo=memo)
        o = o.flatten(-2).unflatten(-1, (self.o_groups, -1))                 # [.., G, H/G*D]
        if isinstance(self.wo_a, BlockScaledFP8Linear):      # one weight, G row groups: one launch
            o = apply_linear(self.wo_a, o.flatten(-2), backends, groups=self.o_groups)
        else:
            o = torch.einsum("...gk,gok->...go", o, self.wo_a.to(o.dtype)).flatten(-2)
        return apply_linear(self.wo_b, o, backends)

    # ---- training: full sequences ----------------------------------------------------
    def forward_train(self, x: torch.Tensor):
        """x [B, T, d] -> (out [B, T, d], indexer KL loss (0-d) or None)."""
        B, T, _ = x.shape
        pos = torch.arange(T, device=x.device)
        qr, q, kv = self.project_qkv(x, pos)
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
        return self.project_out(o, pos), idx_loss

    # ---- decode: a few new tokens against the paged cache ------------------------------
    def forward_decode(self, x: torch.Tensor, meta: DecodeMeta, cache: LayerCache,
                       backends: dict | None = None, mark: Callable = _no_mark,
                       taps: dict | None = None) -> torch.Tensor:
        """x [B, S, d] at ``meta.positions`` -> [B, S, d]; writes this layer's cache.

        ``mark(component)`` is called after "qkv", "compressor", "indexer", "attention" and
        "out_proj" (a timing hook: :mod:`dsv4lab.drivers.timing`); ``taps``, when given,
        receives the attention output [B, S, H, D] under "attention"."""
        backends = backends or {}
        pos, memo = meta.positions, meta.memo
        qr, q, kv = self.project_qkv(x, pos, memo, backends)
        idx = self.write_and_select(x, qr, kv, meta, cache, backends, mark)
        o = self.attend(q.to(x.dtype), idx, cache, backends)
        mark("attention")
        if taps is not None:
            taps["attention"] = o
        out = self.project_out(o.to(x.dtype), pos, memo, backends)
        mark("out_proj")
        return out

    def write_and_select(self, x, qr, kv, meta: DecodeMeta, cache: LayerCache, backends: dict,
                         mark: Callable = _no_mark) -> torch.Tensor:
        """Write ``kv`` into ``cache``, then (for a compressed layer) the compressor's new
        entries; return the KV slots attention reads (the sliding window, then every
        compressed entry or the indexer's top-k), int32. ``mark`` after "qkv",
        "compressor" and "indexer"."""
        memo = meta.memo
        kv_flat = cache.kv if cache.fp8 else flat(cache.kv)
        self.write_kv(kv_flat, meta.slots, kv, cache.fp8)
        mark("qkv")
        parts = [meta.window]
        if self.ratio:
            r = self.ratio
            ckv, cgate = self.compressor.project(x, backends)
            flat(cache.comp_kv)[meta.slots] = ckv.to(cache.comp_kv.dtype)
            flat(cache.comp_gate)[meta.slots] = cgate.to(cache.comp_gate.dtype)
            ent = self.compressor.pool_cached(cache.comp_kv, cache.comp_gate, meta, memo)
            self.write_kv(kv_flat, meta.entry_slot[r], ent, cache.fp8)
            mark("compressor")
            if self.indexer is not None:
                parts.append(self.select_topk(x, qr, meta, cache, backends))
                mark("indexer")
            else:
                parts.append(meta.all_entries[r])
        return torch.cat(parts, dim=-1).int()

    def attend(self, q, idx, cache: LayerCache, backends: dict, sink: torch.Tensor | None = None):
        """Sparse MLA over the cache slots ``idx`` (:func:`dsv4lab.ops.sparse_mla_decode`; the
        slots come from this layer's own tables, so the op's value checks are off); ``sink`` defaults to this layer's (the tensor-parallel layer passes its heads')."""
        sink = self.attn_sink if sink is None else sink
        o, _ = ops.sparse_mla_decode(
            q, cache.kv, idx, d_v=self.head_dim, softmax_scale=self.scale, attn_sink=sink.float(),
            backend=backends.get("sparse_mla_decode", "auto"), validate=False)
        return o

    @staticmethod
    def write_kv(kv_flat, slots, values, fp8):
        """Latent rows into their flat slots (packed to the 584-byte layout for an FP8 cache)."""
        if fp8:
            kv_flat[slots.reshape(-1)] = quant.pack_kv_fp8(values.reshape(-1, values.shape[-1]))
        else:
            kv_flat[slots] = values.to(kv_flat.dtype)

    def select_topk(self, x, qr, meta: DecodeMeta, cache: LayerCache, backends: dict):
        """CSA: write the indexer's keys, let the indexer choose top-k entries -> slots."""
        ix = self.indexer
        pos = meta.positions
        ikv, igate = ix.compressor.project(x, backends)
        flat(cache.idx_kv)[meta.slots] = ikv.to(cache.idx_kv.dtype)
        flat(cache.idx_gate)[meta.slots] = igate.to(cache.idx_gate.dtype)
        key = ix.compressor.pool_cached(cache.idx_kv, cache.idx_gate, meta, meta.memo)
        es = meta.entry_slot[4]
        if cache.idx_keys.dtype == torch.float8_e4m3fn:
            sc = key.float().abs().amax(-1).clamp_min(1e-12) / FP8_MAX
            flat(cache.idx_keys)[es] = (key.float() / sc.unsqueeze(-1)).to(torch.float8_e4m3fn)
            cache.idx_scale.view(-1)[es] = sc
        else:
            flat(cache.idx_keys)[es] = key.to(cache.idx_keys.dtype)
        q, w = ix.queries(x, qr, pos, meta.memo, backends)
        qdt = torch.float32 if cache.idx_keys.dtype == torch.float32 else torch.bfloat16
        top = ops.indexer_topk(
            q.to(qdt), cache.idx_keys, cache.idx_scale, w, meta.cblock_table,
            meta.n_entries[4], max_context=meta.cblock_table.shape[1] * meta.page_size,
            topk=ix.topk, backend=backends.get("indexer_topk", "auto"), validate=False)
        return ops.to_cache_slots(top, meta.cblock_table, meta.page_size, validate=False)
