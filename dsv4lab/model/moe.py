"""The MoE: a router over 256 routed experts plus a shared expert, clamped SwiGLU.

- Scores ``sqrt(softplus(logit))``; a per-expert bias (updated without gradients, noaux_tc)
  affects selection only; weights = unbiased scores of the chosen experts, normalised, times
  ``routed_scaling_factor``. The first ``n_hash_layers`` layers choose experts by a fixed
  token-id table.
- Routed + shared experts, clamped SwiGLU (``silu(min(g, L)) * clamp(u, -L, L)``). Routed
  experts are float while training and MXFP4 (or NVFP4) after :meth:`MoE.quantize_` (or when
  built with ``expert_format=`` for random real-size layers, packed directly).
- Decode: :func:`dsv4lab.ops.route` / :func:`dsv4lab.ops.hash_route` and
  :func:`dsv4lab.ops.fused_moe`, both CUDA-graph capturable.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from dsv4lab import ops, quant
from dsv4lab.config import DSV4Config
from dsv4lab.model.layers import BlockScaledFP8Linear, apply_linear, linear_as, make_linear
from dsv4lab.ops.moe import swiglu   # the clamped SwiGLU of the MoE op (limit None or > 0)

EXPERT_FORMATS = ("bf16", "mxfp4", "nvfp4")


class MLP(nn.Module):
    """A (shared) SwiGLU expert: ``w13`` (gate rows, then up rows) and ``w2`` in float
    weights, or, block-scaled FP8 as the released checkpoint stores it, ``w1`` (gate), ``w3``
    (up) and ``w2``, each with its own 128 x 128 scale grid (:meth:`set_projections`)."""

    def __init__(self, dim: int, inter: int, limit: float | None):
        super().__init__()
        self.limit = limit
        self.w13 = make_linear(dim, 2 * inter)
        self.w2 = make_linear(inter, dim)

    @property
    def fused(self) -> bool:
        return "w13" in self._modules

    def projections(self) -> tuple[nn.Module, nn.Module, nn.Module]:
        """(gate, up, down) as modules (float halves of ``w13`` as new ``nn.Linear`` views)."""
        if not self.fused:
            return self.w1, self.w3, self.w2
        half = self.w13.weight.shape[0] // 2
        parts = []
        for w in (self.w13.weight[:half], self.w13.weight[half:]):
            lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
            lin.weight = nn.Parameter(w.detach(), requires_grad=self.w13.weight.requires_grad)
            parts.append(lin)
        return parts[0], parts[1], self.w2

    def set_projections(self, gate: nn.Module, up: nn.Module, down: nn.Module) -> None:
        """Install (gate, up, down): two float ``nn.Linear`` fuse into ``w13``; FP8 ones stay
        apart as ``w1`` and ``w3`` (their scale grids need not line up in one weight)."""
        for name in ("w13", "w1", "w3"):
            self._modules.pop(name, None)
        if not isinstance(gate, BlockScaledFP8Linear) and not isinstance(up, BlockScaledFP8Linear):
            w13 = make_linear(gate.in_features, gate.out_features + up.out_features).to(
                device=gate.weight.device, dtype=gate.weight.dtype)
            w13.weight = nn.Parameter(torch.cat([gate.weight.detach(), up.weight.detach()]),
                                      requires_grad=gate.weight.requires_grad)
            self.w13 = w13
        else:
            self.w1, self.w3 = gate, up
        self.w2 = down

    def as_projections_(self, projections: str, dtype=torch.bfloat16) -> "MLP":
        """Convert in place to ``projections`` ("fp8" or "bf16", :func:`linear_as`)."""
        self.set_projections(*(linear_as(m, projections, dtype) for m in self.projections()))
        return self

    def gate_up(self, x, backends: dict | None = None):
        if self.fused:
            return apply_linear(self.w13, x, backends)
        return torch.cat([apply_linear(self.w1, x, backends), apply_linear(self.w3, x, backends)], dim=-1)

    def forward(self, x, backends: dict | None = None):
        return apply_linear(self.w2, swiglu(self.gate_up(x, backends), self.limit), backends)


class MoE(nn.Module):
    """Routed experts (float, MXFP4 or NVFP4) + shared expert(s).

    Routed weights, ``fused_moe``'s layout: ``w13 [E, 2I, d]`` (gate rows, then up rows)
    and ``w2 [E, d, I]``; quantised along the last (reduction) dimension. NVFP4's global
    scales ``w13_global`` / ``w2_global`` are 0-d (one for all experts) or ``[E]`` (one per
    expert, as ModelOpt checkpoints store them).
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
        self.gate = make_linear(d, E)
        self.register_buffer("bias", torch.zeros(E))
        if self.hashed:
            dev = self.gate.weight.device
            if dev.type == "meta":            # a skeleton to load into: no table to draw
                table = torch.empty(cfg.vocab_size, self.topk, dtype=torch.int32, device=dev)
            else:                             # drawn on the CPU (the generator's device), then moved
                g = torch.Generator().manual_seed(1234 + layer_id)
                table = torch.rand(cfg.vocab_size, E, generator=g, device="cpu").argsort(-1)[:, :self.topk]
            self.register_buffer("tid2eid", table.to(torch.int32).to(dev))
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
        def nv(w, s, g):            # a global scale for all experts (0-d) or one each ([E])
            if g.dim() == 0:
                return quant.nvfp4_dequantize(w, s, g, dtype=dtype)
            return (quant.nvfp4_dequantize(w, s, 1.0) * g.float().view(-1, 1, 1)).to(dtype)
        return nv(self.w13, self.w13_scale, self.w13_global), nv(self.w2, self.w2_scale, self.w2_global)

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
        logits = apply_linear(self.gate, x, backends).float()
        if self.hashed:
            return ops.hash_route(tokens.reshape(-1), self.tid2eid, logits, score=cfg.score_func,
                                  routed_scaling_factor=cfg.routed_scaling_factor, validate=False)
        return ops.route(logits, self.bias, topk=self.topk, score=cfg.score_func,
                         routed_scaling_factor=cfg.routed_scaling_factor)

    def forward_decode(self, x, tokens, backends: dict | None = None):
        """x [T, d], tokens [T] -> [T, d] through ops.route/hash_route and ops.fused_moe (the
        routing is the layer's own and its weights were checked where they were made, by the
        quantisers or the checkpoint loader, so the ops' value checks are off)."""
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
                              backend=backends.get("fused_moe", "auto"), validate=False, **kw)
        if self.shared is not None:
            y = y + self.shared(x, backends)
        return y.to(x.dtype)

