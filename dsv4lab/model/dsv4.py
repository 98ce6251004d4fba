"""The decoder block, the MTP draft layer and the model, with its two forwards.

- ``forward_train``: full sequences, plain differentiable torch (dense masked attention).
  Used by :mod:`dsv4lab.train` and as the reference the decode path is tested against.
- ``forward_decode``: a few new tokens per request against a paged cache
  (:mod:`dsv4lab.model.cache`); every op goes through :mod:`dsv4lab.ops` with the backend a
  ``backends`` dict names (op name -> backend, missing = "auto"; the op names are
  :data:`OPS`). No host synchronisation, fixed shapes: one CUDA graph can hold a whole
  decode step.
- MTP: ``h' = h_proj(norm(h)) + e_proj(norm(embed(next token)))`` on each stream, one
  decoder block, its own stream reduction and norm, the shared LM head. It predicts the
  token after next; the engine runs it recursively to draft 1-3 tokens.
"""
from __future__ import annotations

import copy
import math
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from dsv4lab.config import DSV4Config
from dsv4lab.model.attention import Attention, Indexer
from dsv4lab.model.cache import DecodeMeta, LayerCache
from dsv4lab.model.layers import (BlockScaledFP8Linear, HCHead, HyperConnection, RMSNorm, apply_linear,
                                  linear_as, make_linear)
from dsv4lab.model.moe import MLP, MoE

OPS = ("sparse_mla_decode", "indexer_topk", "fused_moe", "mhc", "linear")
PROJECTIONS = ("bf16", "fp8")      # how the dense projections are stored
# the projections the released checkpoint stores in FP8 (module class -> attributes); the
# compressors, the indexer's weights projection, the router, embedding and head stay bf16
FP8_PROJECTIONS = {"Attention": ("wq_a", "wq_b", "wkv", "wo_a", "wo_b"), "Indexer": ("wq",),
                   "MLP": ("w1", "w3", "w2"), "MTP": ("e_proj", "h_proj")}
COMPONENTS = ("mhc", "qkv", "compressor", "indexer", "attention", "out_proj", "moe")


def _no_mark(component: str) -> None:
    return None


def tiny_config(**changes) -> DSV4Config:
    """A test-sized config with every feature (window, CSA ratio 4, HCA ratio 8, hash
    layer, MTP, mHC): runs in Triton's interpreter in seconds."""
    base = DSV4Config.mini().replace(
        name="tiny", hidden_size=64, num_layers=3, num_heads=2, head_dim=32, rope_dim=8,
        q_lora_rank=32, o_groups=2, o_lora_rank=32, window_size=8, compress_ratios=(0, 4, 8, 0),
        index_n_heads=2, index_head_dim=16, index_topk=4, n_routed_experts=4,
        n_experts_per_tok=2, moe_intermediate_size=32, hc_mult=2, max_position_embeddings=256)
    return base.replace(**changes)


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

    def forward_decode(self, x, tokens, meta: DecodeMeta, cache: LayerCache, backends=None,
                       mark: Callable = _no_mark, taps: dict | None = None):
        """x [B, S, n, d], tokens [B, S] -> x [B, S, n, d].

        ``mark(component)`` closes a timing segment after each component (:data:`COMPONENTS`
        order: "mhc", "qkv", "compressor", "indexer", "attention", "out_proj", "mhc", "moe",
        "mhc"; a layer without a compressor or indexer skips those); ``taps``, when given,
        receives the attention output ("attention") and the MoE output ("moe")."""
        y, post, comb = self.hc_attn.pre(x, backends)
        mark("mhc")
        a = self.attn.forward_decode(self.attn_norm(y), meta, cache, backends, mark, taps)
        x = HyperConnection.post(a, x, post, comb, backends)
        y, post, comb = self.hc_ffn.pre(x, backends)
        mark("mhc")
        B, S, d = y.shape
        m = self.moe.forward_decode(self.ffn_norm(y).reshape(B * S, d), tokens.reshape(-1), backends)
        mark("moe")
        if taps is not None:
            taps["moe"] = m
        x = HyperConnection.post(m.view(B, S, d), x, post, comb, backends)
        mark("mhc")
        return x


class MTP(nn.Module):
    """The next-n (MTP) draft layer: (streams at p, token p+1) -> logits for token p+2."""

    def __init__(self, cfg: DSV4Config, expert_format: str = "bf16"):
        super().__init__()
        d = cfg.hidden_size
        self.enorm = RMSNorm(d, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps)
        self.e_proj = make_linear(d, d)
        self.h_proj = make_linear(d, d)
        self.block = Block(cfg, cfg.num_layers, expert_format)
        self.hc_head = HCHead(cfg.hc_mult, d)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)

    def _input(self, h, e, backends: dict | None = None):
        return (apply_linear(self.h_proj, self.hnorm(h), backends)
                + apply_linear(self.e_proj, self.enorm(e), backends).unsqueeze(-2))


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
        self.head = make_linear(d, cfg.vocab_size)
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

    @property
    def projections(self) -> str:
        """How the dense projections are stored: "bf16" or "fp8" (:data:`FP8_PROJECTIONS`)."""
        return projections_of(self)

    def quantize_experts(self, fmt: str = "mxfp4") -> "DSV4":
        """Quantise every routed expert (main layers and the MTP layer) in place."""
        for m in self.modules():
            if isinstance(m, MoE) and m.fmt == "bf16":
                m.quantize_(fmt)
        return self

    def quantize_projections(self, projections: str = "fp8") -> "DSV4":
        """Store the dense projections as the released checkpoint does (FP8 e4m3, one
        power-of-two scale per 128 x 128 block; :data:`FP8_PROJECTIONS`), in place; "bf16"
        dequantises them back."""
        set_projections_(self, projections)
        return self

    def logits(self, x, backends: dict | None = None):
        """streams [.., n, d] -> logits [.., vocab] (fp32)."""
        return apply_linear(self.head, self.norm(self.hc_head(x, backends)), backends).float()

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
        return apply_linear(self.head, m.norm(m.hc_head(x, backends)), backends).float(), x

    def ratios(self) -> list[int]:
        """Compress ratio of each main layer, then the MTP layer's."""
        return [b.ratio for b in self.layers] + [m.block.ratio for m in self.mtp]



# ---- the dense projections' format ------------------------------------------------------------

def _float_dtype(module: nn.Module) -> torch.dtype:
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.bfloat16


def set_projections_(module: nn.Module, projections: str) -> nn.Module:
    """Convert, in place, every projection of :data:`FP8_PROJECTIONS` under ``module`` to
    ``projections``: "fp8" (block-scaled e4m3, :func:`~dsv4lab.model.layers.fp8_block_quantize`)
    or "bf16" (dequantised, in the module's float dtype). Returns ``module``."""
    if projections not in PROJECTIONS:
        raise ValueError(f"projections must be one of {PROJECTIONS}, got {projections!r}")
    dtype = _float_dtype(module)
    for m in list(module.modules()):
        if isinstance(m, Attention):
            for name in ("wq_a", "wq_b", "wkv", "wo_b"):
                setattr(m, name, linear_as(getattr(m, name), projections, dtype))
            G = m.o_groups
            if projections == "fp8" and not isinstance(m.wo_a, BlockScaledFP8Linear):
                w = m.wo_a.detach()
                del m.wo_a
                m.wo_a = BlockScaledFP8Linear.quantize(w.reshape(G * w.shape[1], w.shape[2]))
            elif projections == "bf16" and isinstance(m.wo_a, BlockScaledFP8Linear):
                w = m.wo_a.dequantize(dtype)
                del m.wo_a
                m.wo_a = nn.Parameter(w.view(G, -1, w.shape[1]), requires_grad=False)
        elif isinstance(m, Indexer):
            m.wq = linear_as(m.wq, projections, dtype)
        elif isinstance(m, MLP):
            m.as_projections_(projections, dtype)
        elif isinstance(m, MTP):
            m.e_proj = linear_as(m.e_proj, projections, dtype)
            m.h_proj = linear_as(m.h_proj, projections, dtype)
    return module


def projections_of(module: nn.Module) -> str:
    """"fp8" when ``module``'s dense projections are block-scaled FP8, else "bf16"."""
    return "fp8" if any(isinstance(m, BlockScaledFP8Linear) for m in module.modules()) else "bf16"


def shared_clone(module: nn.Module) -> nn.Module:
    """A copy of ``module``'s tree of modules holding the very same tensors: converting the
    copy's projections (:func:`set_projections_`) leaves ``module`` as it is, and nothing else
    is duplicated."""
    new = copy.copy(module)
    new._parameters = dict(module._parameters)
    new._buffers = dict(module._buffers)
    new._modules = {k: (shared_clone(v) if v is not None else None) for k, v in module._modules.items()}
    return new


def to_dtype(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast float parameters to ``dtype``; keep packed experts, scales, router bias and
    the mHC parameters as they are (the mixing runs in fp32)."""
    for mod in model.modules():
        keep = isinstance(mod, (HyperConnection, HCHead))
        for name, p in list(mod.named_parameters(recurse=False)):
            if p.is_floating_point() and not keep:
                p.data = p.data.to(dtype)
    return model
