"""The decode step at real scale: one layer of each attention kind, before and after.

The campaign's headline figures were for whole decode steps of DeepSeek-V4-Flash. This
module rebuilds such a step from :mod:`dsv4lab.model` and times it, component by
component, under a configuration of backends that can be switched one piece at a time.

What is built (:class:`StepDriver`):

- one real-size decoder layer (:class:`dsv4lab.model.Block`) of each attention kind of
  the config: compress ratio 0 (sliding window only), 4 (compressor + lightning indexer,
  top-512) and 128 (compressor, every entry attended), with random weights: routed
  experts random MXFP4 (``Block(..., expert_format="mxfp4")``, scales chosen so a row of
  W has norm ~1), the other projections PyTorch's default init, cast to bf16 (the mHC
  mixing stays fp32, as the model keeps it). Activations stay O(1): the inputs are unit
  normal residual streams and every sub-block ends in a normalised projection.
- the embedding and the LM head (with the final mHC reduction and norm).
- per request a paged cache: pages are allocated for the tokens a step actually reads
  (the sliding window and the compressor's block of raw tokens; every compressed entry
  up to the context), but the block tables, and with them the indexer's logits width
  and the HCA entry lists, are sized for ``max_context``, as a server sized for 1M
  tokens has them. Unused block-table slots point at page 0 (scratch).

What is configured (:class:`StepConfig`, :data:`PRESETS`): the sparse-MLA backend
("simt" or "mma"), the indexer backend ("torch_fallback", "torch_capped", "triton") and
its matmul dtype (fp32, bf16 or fp8 keys), the MLA KV cache (bf16 or the 584-byte FP8
layout), the routed-MoE backend ("triton" or the "torch" reference) and the max context.

- ``"before"``: the campaign's starting point: SIMT attention over a bf16 KV cache, the
  torch fallback indexer scoring all of a 1M max context with its matmul in fp32. The
  routed experts already run in the Triton MXFP4 kernel: the campaign's main model had a
  working MoE kernel (the SM100-only kernel only hit the MTP draft layer), and the
  campaign's 29.7 -> 531.7 tok/s was measured with it. ``"moe_torch"`` shows what a step
  without any MoE kernel costs.
- ``"after"``: MMA attention over the FP8 KV cache, the capture-safe Triton indexer with
  FP8 keys, the Triton MXFP4 MoE; still 1M max context.
- single changes from "before" (:data:`SINGLE_CHANGES`): ``"mma"``, ``"indexer_triton"``,
  ``"indexer_fp8"``, ``"cap_8k"`` (the campaign's actual first fix: the fallback with the
  max context capped at 8,192), ``"moe_torch"``; and ablations of "after"
  (:data:`ABLATIONS`): ``"after_kv_bf16"`` (no FP8 KV flip), ``"after_simt"`` (SIMT over
  bf16 KV: the MMA kernel's end-to-end share on the fixed step).

How it is timed (:meth:`StepDriver.profile`): one step = the three layers (each fed the
same random residual streams) plus embedding and head, captured as ONE CUDA graph with
timing events (``torch.cuda.Event(external=True)``) between the components; each replay
gives every component's GPU time, so the components add up to the step by construction.
Medians over replays. If the events cannot live in a graph (older torch) the component
shares come from eagerly recorded events and are scaled to the graph's replay time
(``timing`` says which); a configuration that cannot be captured (the "torch" MoE and
"torch_capped" indexer read values on the host) is timed eagerly. On the CPU the marks
are wall-clock times of the Triton interpreter: they say nothing about a GPU.

Components (:data:`COMPONENTS`): ``mhc`` (both hyper-connection mixes of the layer),
``qkv`` (attention norm, q LoRA + up, KV projection, RoPE, KV write), ``compressor``
(per-token compressor state, pooled entry, its write), ``indexer`` (the indexer's
compressor, key write, queries, top-k: the whole of ``Attention._select``),
``attention`` (sparse MLA decode), ``out_proj`` (inverse RoPE, grouped output
projection), ``moe`` (FFN norm, router, routed experts, shared expert), and once a step
``embed`` and ``head``.

How a 43-layer step is extrapolated (:func:`extrapolate`)::

    step_ms = sum over kinds r of count_r * layer_ms[r]  +  embed_ms + head_ms

with ``count_r`` the number of main-model layers of compress ratio r in
``cfg.compress_ratios[:num_layers]`` (Flash: 2 x ratio 0, 21 x ratio 4, 20 x ratio 128)
and ``layer_ms[r]`` the measured layer of that kind (3 of the 43 layers route by token
hash; the measured ratio-4 and ratio-128 layers use the learned router, the ratio-0 one
the hash: the difference is one small top-k). The MTP layer is excluded (a plain decode
step does not run it; notebook 05 does), and so are sampling and the scheduler's host
work (the metadata of the step is built once, outside the graph). Tokens/s =
``concurrency * 1000 / step_ms``: every request gains one token per step. Each
component's step time is extrapolated the same way, so they add up to ``step_ms``.

Explained in notebooks/06_decode_step_at_scale.ipynb.
"""
from __future__ import annotations

import math
import statistics
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.nn as nn

from dsv4lab import anatomy, backends, model as M, ops, quant, runtime
from dsv4lab.config import DSV4Config

KINDS = (0, 4, 128)
LAYER_COMPONENTS = ("mhc", "qkv", "compressor", "indexer", "attention", "out_proj", "moe")
HEAD_COMPONENTS = ("embed", "head")
COMPONENTS = LAYER_COMPONENTS + HEAD_COMPONENTS
# groups for the stacked bars and the campaign's profile (attention / MoE / the rest)
GROUPS = OrderedDict([
    ("attention", ("attention",)),
    ("indexer", ("indexer",)),
    ("MoE", ("moe",)),
    ("projections", ("qkv", "compressor", "out_proj")),
    ("mHC", ("mhc",)),
    ("embedding + head", ("embed", "head")),
])
HEAD = "head"                    # the key of the embedding/head pseudo-layer
INDEXER_DTYPES = ("fp32", "bf16", "fp8")
KV_FORMATS = ("bf16", "fp8")
FP8_MAX = 448.0

# Before/after numerical agreement (same weights, same cache values, different backends),
# relative L2 error of each layer's output streams and of the logits. With bf16 KV on
# both sides the backends differ only in summation order and in bf16 roundings of the
# attention output (~1e-2 relative on the attention term); the FP8 KV cache adds e4m3
# rounding of the latent vectors (2^-4 relative per value, averaged over 512 dims and
# over the attended entries). The residual streams carry the rest of the output, so the
# relative error of a layer's output is a fraction of the attention term's.
TOL_SAME_KV = 2e-2
TOL_FP8_KV = 6e-2


# ======================================================================================
# Configuration
# ======================================================================================

@dataclass(frozen=True)
class StepConfig:
    """Backends and formats of one decode step (see the module docstring).

    ``max_context`` None means the model's max (1,048,576 tokens for Flash).
    """
    name: str = "custom"
    attention: str = "simt"            # sparse_mla_decode backend
    indexer: str = "torch_fallback"    # indexer_topk backend
    indexer_dtype: str = "fp32"        # the indexer matmul's operands: fp32, bf16 or fp8 keys
    kv_cache: str = "bf16"             # MLA latent cache: bf16 or the 584-byte FP8 layout
    moe: str = "triton"                # fused_moe backend
    mhc: str = "auto"                  # mhc backend (the hyper-connections' per-token mixing)
    max_context: int | None = None
    change: str = ""                   # what differs from "before"
    note: str = ""

    def backends(self) -> dict:
        """The ``backends`` dict :meth:`dsv4lab.model.Block.forward_decode` takes."""
        return {"sparse_mla_decode": self.attention, "indexer_topk": self.indexer,
                "fused_moe": self.moe, "mhc": self.mhc}

    @property
    def capturable(self) -> bool:
        """Whether one CUDA graph can hold the step (no host reads of device values)."""
        return self.moe != "torch" and self.indexer != "torch_capped"

    def replace(self, **changes) -> "StepConfig":
        return replace(self, **changes)

    def for_model(self, cfg: DSV4Config) -> "StepConfig":
        """Resolve ``max_context`` and adapt what the model's sizes cannot take.

        The FP8 KV layout is 448 e4m3 + 64 bf16 RoPE values: at other head sizes (the mini
        config) the cache stays bf16 and ``note`` says so.
        """
        if self.indexer_dtype not in INDEXER_DTYPES:
            raise ValueError(f"indexer_dtype must be one of {INDEXER_DTYPES}, got {self.indexer_dtype!r}")
        if self.kv_cache not in KV_FORMATS:
            raise ValueError(f"kv_cache must be one of {KV_FORMATS}, got {self.kv_cache!r}")
        out = self
        if self.max_context is None:
            out = out.replace(max_context=cfg.max_position_embeddings)
        elif isinstance(self.max_context, bool) or not isinstance(self.max_context, int) \
                or self.max_context < 1:
            raise ValueError(f"max_context must be a positive int or None, got {self.max_context!r}")
        if self.kv_cache == "fp8" and (cfg.head_dim != 512 or cfg.rope_dim != 64):
            note = (f"FP8 KV needs head_dim 512 / rope 64 (this model: {cfg.head_dim}/{cfg.rope_dim}): "
                    "bf16 KV instead")
            out = out.replace(kv_cache="bf16", note="; ".join(x for x in (out.note, note) if x))
        return out


def cap_context(cfg: DSV4Config) -> int:
    """The campaign's cap (``--context-length 8192``), scaled to the model: max / 128,
    at least 4 x index_topk tokens (Flash: 8,192; mini: 64)."""
    return max(cfg.max_position_embeddings // 128, 4 * cfg.index_topk)


_BEFORE = StepConfig(name="before", attention="simt", indexer="torch_fallback", indexer_dtype="fp32",
                     kv_cache="bf16", moe="triton",
                     note="campaign before: SIMT attention, fallback indexer (fp32) at max context")
_AFTER = StepConfig(name="after", attention="mma", indexer="triton", indexer_dtype="fp8",
                    kv_cache="fp8", moe="triton",
                    note="MMA attention over FP8 KV, Triton indexer with FP8 keys, Triton MXFP4 MoE")

PRESET_NAMES = ("before", "mma", "indexer_triton", "indexer_fp8", "cap_8k", "moe_torch",
                "after", "after_kv_bf16", "after_simt", "after_mhc_torch")
SINGLE_CHANGES = ("mma", "indexer_triton", "indexer_fp8", "cap_8k", "moe_torch")
ABLATIONS = ("after_kv_bf16", "after_simt", "after_mhc_torch")


def preset(name: str, cfg: DSV4Config | None = None) -> StepConfig:
    """A named :class:`StepConfig` (``PRESET_NAMES``), resolved for ``cfg`` when given.

    Explained in notebooks/06_decode_step_at_scale.ipynb.
    """
    cfg_ = cfg or DSV4Config.flash()
    table = {
        "before": _BEFORE,
        "after": _AFTER,
        "mma": _BEFORE.replace(name="mma", attention="mma", change="attention: simt -> mma",
                               note="before + the MMA sparse-MLA kernel (bf16 KV)"),
        "indexer_triton": _BEFORE.replace(name="indexer_triton", indexer="triton",
                                          change="indexer: torch_fallback -> triton",
                                          note="before + the capture-safe Triton indexer (fp32 keys)"),
        "indexer_fp8": _BEFORE.replace(name="indexer_fp8", indexer_dtype="fp8",
                                       change="indexer keys: fp32 -> fp8",
                                       note="before + FP8 indexer keys (the fallback still upcasts to fp32)"),
        "cap_8k": _BEFORE.replace(name="cap_8k", max_context=cap_context(cfg_),
                                  change=f"max context: {cfg_.max_position_embeddings:,} -> {cap_context(cfg_):,}",
                                  note="before with the max context capped (the campaign's first fix)"),
        "moe_torch": _BEFORE.replace(name="moe_torch", moe="torch", change="MoE: triton -> torch",
                                     note="before without an MoE kernel: the fp32 torch reference "
                                          "(host syncs: timed eagerly)"),
        "after_kv_bf16": _AFTER.replace(name="after_kv_bf16", kv_cache="bf16",
                                        change="after, KV cache fp8 -> bf16",
                                        note="after without the FP8 KV flip"),
        "after_simt": _AFTER.replace(name="after_simt", attention="simt", kv_cache="bf16",
                                     change="after, attention mma -> simt (bf16 KV)",
                                     note="after with the SIMT kernel (SIMT takes bf16 KV only)"),
        "after_mhc_torch": _AFTER.replace(name="after_mhc_torch", mhc="torch",
                                          change="after, mHC triton -> torch",
                                          note="after with the hyper-connections' mixing in plain torch "
                                               "(dozens of tiny kernels a layer)"),
    }
    if name not in table:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESET_NAMES)}")
    return table[name].for_model(cfg) if cfg is not None else table[name]


# ======================================================================================
# Timing marks
# ======================================================================================

class _Marks:
    """Called as ``mark(layer, component)`` after each component: closes a segment."""

    def __init__(self, kind: str):
        self.kind = kind            # "wall", "events", "graph_events"
        self.names: list[tuple] = []
        self.points: list = []

    def _point(self):
        if self.kind == "wall":
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True, external=True) if self.kind == "graph_events" \
            else torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def begin(self):
        self.names.clear()
        self.points = [self._point()]

    def __call__(self, layer, component: str):
        self.points.append(self._point())
        self.names.append((layer, component))

    def segments(self) -> list[tuple]:
        """[(layer, component, ms)] of the last run (after the GPU finished it)."""
        out = []
        for i, name in enumerate(self.names):
            a, b = self.points[i], self.points[i + 1]
            ms = (b - a) * 1e3 if self.kind == "wall" else a.elapsed_time(b)
            out.append((name[0], name[1], float(ms)))
        return out


def _nomark(layer, component):
    return None


# ======================================================================================
# The driver
# ======================================================================================

def representative_layers(cfg: DSV4Config) -> "OrderedDict[int, int]":
    """Compress ratio -> the layer id measured for it: the first layer of that ratio that
    routes with the learned router, else (all hash-routed) the last one of that ratio."""
    ratios = cfg.compress_ratios[:cfg.num_layers]
    out: "OrderedDict[int, int]" = OrderedDict()
    for r in sorted(set(ratios)):
        ids = [i for i, x in enumerate(ratios) if x == r]
        learned = [i for i in ids if i >= cfg.n_hash_layers]
        out[r] = learned[0] if learned else ids[-1]
    return out


def layer_counts(cfg: DSV4Config) -> dict:
    """Main-model layers per compress ratio (Flash: {0: 2, 4: 21, 128: 20})."""
    return dict(sorted(Counter(cfg.compress_ratios[:cfg.num_layers]).items()))


def extrapolate(kind_ms: dict, head_ms: float, cfg: DSV4Config, concurrency: int) -> dict:
    """A ``cfg.num_layers``-layer step from per-kind layer times (module docstring).

    ``kind_ms`` maps compress ratio -> measured layer time (ms); ``head_ms`` is embedding
    + head. Returns step_ms, tokens_per_s and the layer counts used.
    Explained in notebooks/06_decode_step_at_scale.ipynb.
    """
    counts = layer_counts(cfg)
    missing = [r for r in counts if r not in kind_ms]
    if missing:
        raise ValueError(f"no measured layer for compress ratio(s) {missing}; measured: {sorted(kind_ms)}")
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    step_ms = sum(n * float(kind_ms[r]) for r, n in counts.items()) + float(head_ms)
    if not step_ms > 0:
        raise ValueError(f"step time must be positive, got {step_ms} ms")
    return {"step_ms": step_ms, "tokens_per_s": concurrency * 1e3 / step_ms,
            "layer_counts": counts, "model_layers": cfg.num_layers}


class _Head(nn.Module):
    """Embedding + the model's final mHC reduction, norm and LM head (as in model.DSV4)."""

    def __init__(self, cfg: DSV4Config):
        super().__init__()
        d = cfg.hidden_size
        self.hc = cfg.hc_mult
        self.embed = nn.Embedding(cfg.vocab_size, d)
        self.hc_head = M.HCHead(cfg.hc_mult, d)
        self.norm = M.RMSNorm(d, cfg.rms_norm_eps)
        self.head = nn.Linear(d, cfg.vocab_size, bias=False)
        with torch.no_grad():
            nn.init.normal_(self.embed.weight, std=1.0)
            nn.init.normal_(self.head.weight, std=d ** -0.5)

    def embed_streams(self, tokens):
        return self.embed(tokens).unsqueeze(-2).expand(*tokens.shape, self.hc, -1).contiguous()

    def logits(self, x):
        return self.head(self.norm(self.hc_head(x))).float()


def build_layer(cfg: DSV4Config, layer_id: int, *, device=None, dtype=torch.bfloat16,
                expert_format: str = "mxfp4") -> M.Block:
    """One decoder layer with random weights, built directly on ``device`` (real size fits:
    the packed MXFP4 experts are ~3.3 GB a layer), floats cast to ``dtype``."""
    device = torch.device(device) if device is not None else runtime.device()
    hashed = layer_id < cfg.n_hash_layers
    with torch.device(device):
        try:
            blk = M.Block(cfg, layer_id, expert_format)
        except (RuntimeError, TypeError, ValueError):
            if not hashed:
                raise
            # the hash table is drawn with a CPU generator; under a CUDA default device that
            # fails in some versions: build without it and draw the table on the CPU
            blk = M.Block(cfg.replace(n_hash_layers=0), layer_id, expert_format)
            g = torch.Generator().manual_seed(1234 + layer_id)
            table = torch.rand(cfg.vocab_size, cfg.n_routed_experts, generator=g,
                               device="cpu").argsort(-1)[:, :cfg.n_experts_per_tok]
            blk.moe.hashed = True
            blk.moe.register_buffer("tid2eid", table.to(torch.int32).to(device))
    M.to_dtype(blk, dtype)
    blk.eval()
    for p in blk.parameters():
        p.requires_grad_(False)
    return blk


@dataclass
class StepState:
    """One prepared step: config, caches, metadata and inputs for each layer kind."""
    step: StepConfig
    batch: int
    context: int
    page_size: int
    caches: dict
    metas: dict
    x: torch.Tensor
    tokens: torch.Tensor
    pages: dict = field(default_factory=dict)


class StepDriver:
    """Real-size (``DSV4Config.flash()``) or ``mini()`` layers of each kind + head.

    ``driver = StepDriver(DSV4Config.flash())`` builds three layers and the head on the
    GPU (~11 GB); ``state = driver.prepare(preset("after", cfg), batch=64, context=512)``;
    ``driver.run(state)`` computes one step; ``driver.profile(state)`` times it.
    Explained in notebooks/06_decode_step_at_scale.ipynb.
    """

    def __init__(self, cfg: DSV4Config | None = None, *, device=None, seed: int = 0,
                 page_size: int | None = None, with_head: bool = True):
        self.cfg = cfg or DSV4Config.flash()
        self.device = torch.device(device) if device is not None else runtime.device()
        self.page_size = page_size or (64 if self.cfg.hidden_size >= 1024 else 16)
        self.layer_ids = representative_layers(self.cfg)
        torch.manual_seed(seed)
        self.layers: "OrderedDict[int, M.Block]" = OrderedDict(
            (r, build_layer(self.cfg, lid, device=self.device)) for r, lid in self.layer_ids.items())
        self.head = None
        if with_head:
            with torch.device(self.device):
                self.head = _Head(self.cfg)
            M.to_dtype(self.head, torch.bfloat16)
            self.head.eval().requires_grad_(False)

    # ---- the cache ------------------------------------------------------------------
    def prepare(self, step: StepConfig, *, batch: int, context: int, seed: int = 1) -> StepState:
        """Caches, block tables, metadata and inputs for ``batch`` requests that each hold
        ``context`` tokens (the new token is at position ``context - 1``).

        Cache values depend only on (seed, batch, context), not on the step config: the
        FP8 pools hold the e4m3 encodings of the bf16 pools' values, so presets compare.
        """
        cfg, dev, page = self.cfg, self.device, self.page_size
        step = step.for_model(cfg)
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch must be a positive int, got {batch!r}")
        if isinstance(context, bool) or not isinstance(context, int) or context < 1:
            raise ValueError(f"context must be a positive int (tokens incl. the new one), got {context!r}")
        if context > step.max_context:
            raise ValueError(f"context ({context:,}) exceeds max_context ({step.max_context:,}) of "
                             f"preset {step.name!r}")
        # fail early, with the registry's reason, if a backend cannot run here
        backends.resolve("sparse_mla_decode", step.attention,
                         fmt="fp8" if step.kv_cache == "fp8" else "dense", device=dev)
        backends.resolve("indexer_topk", step.indexer, device=dev)
        backends.resolve("fused_moe", step.moe, fmt="mxfp4", device=dev)
        backends.resolve("mhc", step.mhc, device=dev)

        B, p = batch, context - 1
        gen = torch.Generator(device=dev)
        positions = torch.full((B, 1), p, dtype=torch.int64, device=dev)
        reach = max([cfg.window_size] + [r for r in self.layers if r])     # raw tokens read
        first_raw_page = max(0, p - reach + 1) // page
        raw_pages = p // page - first_raw_page + 1
        raw_width = _cdiv(step.max_context, page)
        caches, metas, pages = {}, {}, {}
        for r in self.layers:
            gen.manual_seed(seed * 1000 + r)
            n_entries = context // r if r else 0
            comp_pages = max(1, _cdiv(n_entries, page)) if r else 0
            comp_width = max(1, _cdiv(_cdiv(step.max_context, r), page)) if r else 1
            P = 1 + B * (raw_pages + comp_pages)
            bt = torch.zeros(B, raw_width, dtype=torch.int32)
            cbt = torch.zeros(B, comp_width, dtype=torch.int32)
            nxt = 1
            for b in range(B):
                bt[b, first_raw_page:first_raw_page + raw_pages] = torch.arange(nxt, nxt + raw_pages)
                nxt += raw_pages
                if r:
                    cbt[b, :comp_pages] = torch.arange(nxt, nxt + comp_pages)
                    nxt += comp_pages
            bt, cbt = bt.to(dev), cbt.to(dev)
            cache = M.LayerCache.allocate(cfg, r, P, page, dtype=torch.bfloat16,
                                          kv_format=step.kv_cache, device=dev)
            self._fill(cache, step, gen)
            caches[r] = cache
            metas[r] = M.make_meta(cfg, positions, bt, cbt, page, [r] if r else [])
            pages[r] = P
        gen.manual_seed(seed)
        x = torch.randn(B, 1, cfg.hc_mult, cfg.hidden_size, generator=gen, device=dev).to(torch.bfloat16)
        tokens = torch.randint(0, cfg.vocab_size, (B, 1), generator=gen, device=dev)
        return StepState(step, B, context, page, caches, metas, x, tokens, pages)

    def _fill(self, cache: M.LayerCache, step: StepConfig, gen: torch.Generator):
        """Random cache contents: unit-normal latent rows (bf16, or their FP8 encoding) and
        compressor states; indexer keys in ``step.indexer_dtype`` (fp8: one scale a key).

        The pools are filled by tiling one block of rows (real-size pools hold millions)."""
        cfg, dev = self.cfg, self.device
        D = cfg.head_dim
        chunk = 1 << 16
        n_rows = cache.kv.shape[0] * (cache.kv.shape[1] if cache.kv.dim() == 3 else 1)
        base = torch.randn(min(chunk, n_rows), D, generator=gen, device=dev)
        tile = quant.pack_kv_fp8(base) if cache.fp8 else base.to(torch.bfloat16)
        _tile_into(cache.kv.view(n_rows, -1), tile)
        for pool in (cache.comp_kv, cache.comp_gate, cache.idx_kv, cache.idx_gate):
            if pool is not None:
                pool.normal_(generator=gen)
        if cache.idx_keys is not None:
            P, page, Di = cache.idx_keys.shape
            kbase = torch.randn(min(chunk, P * page), Di, generator=gen, device=dev)
            if step.indexer_dtype == "fp8":
                sc = kbase.abs().amax(-1).clamp_min(1e-12) / FP8_MAX
                keys = torch.empty(P, page, Di, dtype=torch.float8_e4m3fn, device=dev)
                _tile_into(keys.view(P * page, Di), (kbase / sc[:, None]).to(torch.float8_e4m3fn))
                scale = torch.empty(P, page, dtype=torch.float32, device=dev)
                _tile_into(scale.view(P * page, 1), sc[:, None])
            else:
                dt = torch.float32 if step.indexer_dtype == "fp32" else torch.bfloat16
                keys = torch.empty(P, page, Di, dtype=dt, device=dev)
                _tile_into(keys.view(P * page, Di), kbase.to(dt))
                scale = torch.ones(P, page, dtype=torch.float32, device=dev)
            cache.idx_keys, cache.idx_scale = keys, scale

    # ---- one step -------------------------------------------------------------------
    @torch.no_grad()
    def run(self, state: StepState, mark: Callable = _nomark) -> dict:
        """One decode step: every layer kind on ``state.x``, then embedding and head.

        Returns {ratio: output streams [B, 1, n, d], "logits": [B, 1, vocab] fp32}, plus
        {"attention r": the attention output [B, 1, H, D]} for each kind (the residual
        streams dwarf one layer's attention term, so it is compared on its own).
        ``mark(layer, component)`` is called after each component.
        """
        be = state.step.backends()
        out = {}
        for r, blk in self.layers.items():
            t: dict = {}
            out[r] = layer_forward(blk, state.x, state.tokens, state.metas[r], state.caches[r],
                                   be, lambda c, r=r: mark(r, c), taps=t)
            out[f"attention {r}"] = t["attention"]
        if self.head is not None:
            # a real step embeds its tokens into the first layer and reads the last layer's
            # streams; here every layer reads state.x, so the head reads the last kind's output
            self.head.embed_streams(state.tokens)
            mark(HEAD, "embed")
            out["logits"] = self.head.logits(out[next(reversed(self.layers))])
            mark(HEAD, "head")
        return out

    # ---- timing ---------------------------------------------------------------------
    def profile(self, state: StepState, *, reps: int | None = None, graph: bool | None = None) -> dict:
        """Time one step per component: see the module docstring.

        Returns {"kind_ms": {ratio: {component: ms}}, "head_ms": {component: ms},
        "measured_ms": the step as run (3 layers + head), "timing": how,
        "graph_replay_ms": replay time of the whole graph (GPU, None otherwise)}.
        """
        on_gpu = self.device.type == "cuda"
        if not on_gpu:
            reps = reps or 1
            marks = _Marks("wall")
            samples = []
            for _ in range(reps):
                marks.begin()
                outputs = self.run(state, marks)
                samples.append(marks.segments())
            res = self._summarise(samples, "interpreter_wall" if runtime.is_interpreter() else "cpu_wall",
                                  None)
            res["outputs"] = outputs
            return res
        reps = reps or 10
        graph = state.step.capturable if graph is None else (graph and state.step.capturable)
        torch.cuda.synchronize()
        self.run(state)                                        # compile, autotune, value checks
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        if not graph:
            return self._eager_events(state, reps, None, "eager_events")
        try:
            return self._graph_events(state, reps)
        except Exception as e1:
            # events inside the graph unsupported here: eager shares x the graph's replay
            # time; if the step cannot be captured at all, eager events (timing says so)
            note = f"graph events failed: {type(e1).__name__}: {e1}"
            torch.cuda.synchronize()
            try:
                g = self._capture(state, None)
                from dsv4lab import bench
                total = bench.time_fn(g.replay, warmup_ms=5, rep_ms=30)["ms"]
                del g
                res = self._eager_events(state, reps, total, "eager_event_shares_x_cuda_graph")
            except Exception as e2:
                note += f"; capture failed: {type(e2).__name__}: {e2}"
                torch.cuda.synchronize()
                res = self._eager_events(state, reps, None, "eager_events_capture_failed")
            res["timing_note"] = note[:400]
            return res

    def _capture(self, state, marks):
        return _capture_run(self.run, state, marks)

    def _graph_events(self, state, reps):
        from dsv4lab import bench
        marks = _Marks("graph_events")
        g = self._capture(state, marks)
        samples = []
        for _ in range(reps + 1):
            g.replay()
            torch.cuda.synchronize()
            samples.append(marks.segments())
        samples = samples[1:]
        for seg in samples:
            if any(not math.isfinite(ms) or ms < 0 for _, _, ms in seg):
                raise RuntimeError("non-finite or negative event times from the graph")
        replay = bench.time_fn(g.replay, warmup_ms=5, rep_ms=30)["ms"]
        del g
        return self._summarise(samples, "cuda_graph_events", replay)

    def _eager_events(self, state, reps, scale_to, timing):
        marks = _Marks("events")
        samples = []
        for _ in range(reps):
            marks.begin()
            self.run(state, marks)
            torch.cuda.synchronize()
            samples.append(marks.segments())
        res = self._summarise(samples, timing, scale_to)
        if scale_to is not None:
            f = scale_to / res["measured_ms"]
            res["kind_ms"] = {r: {c: v * f for c, v in d.items()} for r, d in res["kind_ms"].items()}
            res["head_ms"] = {c: v * f for c, v in res["head_ms"].items()}
            res["measured_ms"] = scale_to
            res["component_scale"] = f
        return res

    def _summarise(self, samples, timing, replay_ms):
        """Medians per (layer, component) over the samples; components sum to the totals."""
        med = _segment_medians(samples)
        kind_ms = {r: {c: med.get((r, c), 0.0) for c in LAYER_COMPONENTS} for r in self.layers}
        head_ms = {c: med.get((HEAD, c), 0.0) for c in HEAD_COMPONENTS}
        measured = sum(sum(d.values()) for d in kind_ms.values()) + sum(head_ms.values())
        return {"kind_ms": kind_ms, "head_ms": head_ms, "measured_ms": measured, "timing": timing,
                "graph_replay_ms": replay_ms, "reps": len(samples)}

    # ---- one result row -------------------------------------------------------------
    def row(self, state: StepState, prof: dict) -> dict:
        """A flat result row: configuration, per-kind layer times, the extrapolated step
        (``step_ms``, ``tokens_per_s``) and each component's share of it (``ms_<comp>``)."""
        cfg, st = self.cfg, state.step
        counts = layer_counts(cfg)
        kind_total = {r: sum(d.values()) for r, d in prof["kind_ms"].items()}
        head_total = sum(prof["head_ms"].values())
        ex = extrapolate(kind_total, head_total, cfg, state.batch)
        comp = {c: sum(counts[r] * prof["kind_ms"][r][c] for r in counts) for c in LAYER_COMPONENTS}
        comp.update(prof["head_ms"])
        row = {
            "preset": st.name, "change": st.change, "model": cfg.name,
            "concurrency": state.batch, "context": state.context, "max_context": st.max_context,
            "attention": st.attention, "indexer": st.indexer, "indexer_dtype": st.indexer_dtype,
            "kv_cache": st.kv_cache, "moe": st.moe, "mhc": st.mhc, "page_size": state.page_size,
            "layers_measured": {str(r): lid for r, lid in self.layer_ids.items()},
            "layer_counts": {str(r): n for r, n in counts.items()},
            "model_layers": cfg.num_layers, "mtp": "excluded",
            "step_ms": ex["step_ms"], "ms": ex["step_ms"], "tokens_per_s": ex["tokens_per_s"],
            "measured_ms": prof["measured_ms"], "graph_replay_ms": prof.get("graph_replay_ms"),
            "timing": prof["timing"], "reps": prof.get("reps"),
        }
        for r, t in kind_total.items():
            row[f"layer_ms_r{r}"] = t
        row["head_ms"] = head_total
        for c in COMPONENTS:
            row[f"ms_{c}"] = comp.get(c, 0.0)
        row["components_by_kind"] = {str(r): d for r, d in prof["kind_ms"].items()}
        try:
            an = anatomy.step_totals(anatomy.step_anatomy(
                cfg, concurrency=state.batch, context=state.context, max_context=st.max_context,
                weight_format="mxfp4", indexer="fallback" if st.indexer == "torch_fallback" else "triton"))
            row.update(roofline_device=an["device"], roofline_step_ms=an["step_ms"],
                       roofline_tokens_per_s=an["tokens_per_s"],
                       roofline_fraction=an["step_ms"] / ex["step_ms"])
        except ValueError:
            pass
        for k in ("timing_note", "component_scale"):
            if k in prof:
                row[k] = prof[k]
        if st.note:
            row["note"] = st.note
        return row


def _capture_run(run: Callable, state, marks, *, free_cache: bool = True):
    """A CUDA graph of ``run(state, marks)`` (``marks.begin()`` first; ``run(state)`` when
    ``marks`` is None), after one warm-up ``run(state)`` on a side stream and a sync (and
    ``torch.cuda.empty_cache()`` when ``free_cache``). Shared with :mod:`dsv4lab.tp`."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run(state)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    if free_cache:
        torch.cuda.empty_cache()
    g = torch.cuda.CUDAGraph()
    with runtime.cuda_graph_capture(g):
        if marks is not None:
            marks.begin()
            run(state, marks)
        else:
            run(state)
    return g


def _segment_medians(samples) -> dict:
    """{(layer, component): median ms over the samples}, each sample's segments of the same
    (layer, component) summed first. Shared with :mod:`dsv4lab.tp`."""
    acc: dict = {}
    for seg in samples:
        per: dict = {}
        for layer, comp, ms in seg:
            per[(layer, comp)] = per.get((layer, comp), 0.0) + ms
        for k, v in per.items():
            acc.setdefault(k, []).append(v)
    return {k: statistics.median(v) for k, v in acc.items()}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _tile_into(dst: torch.Tensor, tile: torch.Tensor):
    """dst [N, ...] = tile [n, ...] repeated along dim 0."""
    n = tile.shape[0]
    for a in range(0, dst.shape[0], n):
        e = min(dst.shape[0], a + n)
        dst[a:e] = tile[:e - a]


# ======================================================================================
# One layer, component by component
# ======================================================================================

def layer_forward(blk: M.Block, x, tokens, meta: M.DecodeMeta, cache: M.LayerCache,
                  be: dict, mark: Callable = lambda c: None, taps: dict | None = None):
    """``Block.forward_decode`` with a ``mark(component)`` after each component.

    The same sequence of calls as ``Block.forward_decode`` / ``Attention.forward_decode``
    (tests check the outputs are identical); only the boundaries are new. ``taps``, when
    given, receives the attention output ("attention") and the MoE output ("moe").
    Explained in notebooks/06_decode_step_at_scale.ipynb.
    """
    attn = blk.attn
    y, post, comb = blk.hc_attn.pre(x, be)
    mark("mhc")
    h = blk.attn_norm(y)
    pos = meta.positions
    qr, q, kv = attn._qkv(h, pos, backends=be)
    idx = write_and_select(attn, h, qr, kv, meta, cache, be, mark)
    o, _ = ops.sparse_mla_decode(
        q.to(h.dtype), cache.kv, idx, d_v=attn.head_dim, softmax_scale=attn.scale,
        attn_sink=attn.attn_sink.float(), backend=be.get("sparse_mla_decode", "auto"))
    mark("attention")
    if taps is not None:
        taps["attention"] = o
    a = attn._out(o.to(h.dtype), pos, backends=be)
    mark("out_proj")
    x = M.HyperConnection.post(a, x, post, comb, be)
    y, post, comb = blk.hc_ffn.pre(x, be)
    mark("mhc")
    B, S, d = y.shape
    m = blk.moe.forward_decode(blk.ffn_norm(y).reshape(B * S, d), tokens.reshape(-1), be)
    mark("moe")
    if taps is not None:
        taps["moe"] = m
    x = M.HyperConnection.post(m.view(B, S, d), x, post, comb, be)
    mark("mhc")
    return x


def write_and_select(attn: M.Attention, h, qr, kv, meta: M.DecodeMeta, cache: M.LayerCache,
                     be: dict, mark: Callable = lambda c: None) -> torch.Tensor:
    """The middle of ``Attention.forward_decode``: write ``kv`` into ``cache``, then (for a
    compressed layer) the compressor's new entries; return the KV indices attention reads
    (the sliding window, then every compressed entry or the indexer's top-k), int32.

    ``mark`` after "qkv", "compressor" and "indexer" as in :func:`layer_forward`; the
    tensor-parallel layer (:mod:`dsv4lab.tp`) runs the same code.
    Explained in notebooks/06_decode_step_at_scale.ipynb.
    """
    kv_flat = cache.kv if cache.fp8 else M._flat(cache.kv)
    attn._write(kv_flat, meta.slots, kv, cache.fp8)
    mark("qkv")
    parts = [meta.window]
    if attn.ratio:
        r = attn.ratio
        ckv, cgate = attn.compressor.project(h, be)
        M._flat(cache.comp_kv)[meta.slots] = ckv.to(cache.comp_kv.dtype)
        M._flat(cache.comp_gate)[meta.slots] = cgate.to(cache.comp_gate.dtype)
        bs = meta.block_slots[r]
        ent = attn.compressor.pool(M._flat(cache.comp_kv)[bs], M._flat(cache.comp_gate)[bs],
                                   meta.entry_pos[r])
        attn._write(kv_flat, meta.entry_slot[r], ent, cache.fp8)
        mark("compressor")
        if attn.indexer is not None:
            parts.append(attn._select(h, qr, meta, cache, be))
            mark("indexer")
        else:
            parts.append(meta.all_entries[r])
    return torch.cat(parts, dim=-1).int()


# ======================================================================================
# Comparing presets, and the campaign's targets
# ======================================================================================

def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp32."""
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def compare_outputs(out_a: dict, out_b: dict) -> dict:
    """Relative L2 error of every output (layer kinds and logits) of two runs."""
    return {k: rel_error(out_a[k], out_b[k]) for k in out_b}


def _find(rows, **kw):
    sel = [r for r in rows if all(r.get(k) == v for k, v in kw.items())]
    return sel[-1] if sel else None


def targets(rows: list[dict], *, concurrency: int = 64, context: int = 512,
            max_context: int = 1048576) -> list[dict]:
    """The issue's targets from result rows (the newest row per configuration wins).

    1. the indexer fix alone (preset "indexer_triton" vs "before"), concurrency 64,
       512-token contexts, 1M max context: >= 10x step throughput. ``ceiling`` is what no
       indexer could beat with that "before": its step time over its step time without
       the indexer (Amdahl; needs the row's ``step_ms`` and ``ms_indexer``);
    2. "after" at 512-token contexts keeps >= 95% of its 8,192-max-context throughput at
       131,072 and 1,048,576.
    Explained in notebooks/06_decode_step_at_scale.ipynb.
    """
    out = []
    base = dict(concurrency=concurrency, context=context)
    b = _find(rows, preset="before", max_context=max_context, **base)
    for name in ("indexer_triton", "cap_8k"):
        f = _find(rows, preset=name, **base)
        if b and f:
            x = f["tokens_per_s"] / b["tokens_per_s"]
            ceiling = None
            if b.get("step_ms") and b.get("ms_indexer") is not None and b["step_ms"] > b["ms_indexer"]:
                ceiling = b["step_ms"] / (b["step_ms"] - b["ms_indexer"])
            out.append({"target": f"{name} alone vs before (c{concurrency}, ctx {context}, "
                                  f"before at {max_context:,} max)",
                        "before_tok_s": b["tokens_per_s"], "after_tok_s": f["tokens_per_s"],
                        "value": x, "goal": ">= 10x" if name == "indexer_triton" else "(campaign: 17.9x)",
                        "met": (x >= 10) if name == "indexer_triton" else None,
                        "ceiling": ceiling})
    ref = _find(rows, preset="after", max_context=8192, **base)
    for mc in (131072, 1048576):
        a = _find(rows, preset="after", max_context=mc, **base)
        if ref and a:
            x = a["tokens_per_s"] / ref["tokens_per_s"]
            out.append({"target": f"after: max context 8,192 -> {mc:,} (c{concurrency}, ctx {context})",
                        "before_tok_s": ref["tokens_per_s"], "after_tok_s": a["tokens_per_s"],
                        "value": x, "goal": ">= 0.95", "met": x >= 0.95})
    return out
