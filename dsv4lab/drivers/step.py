"""The decode step at real scale: one layer of each attention kind, timed component by component.

What is built (:class:`StepDriver`):

- one real-size decoder layer (:class:`dsv4lab.model.Block`) of each attention kind of the
  config: compress ratio 0 (sliding window only), 4 (overlapping compressor + lightning
  indexer, top-512) and 128 (compressor, every entry attended), with random weights: routed
  experts random MXFP4 (scales chosen so a row of W has norm ~1), the other projections
  PyTorch's default init cast to bf16 (the mHC mixing stays fp32, as the model keeps it). A
  preset's ``projections`` "fp8" runs the same layers with their dense projections
  block-scaled FP8 (quantised from those bf16 weights, as the released checkpoint stores
  them; :data:`dsv4lab.model.FP8_PROJECTIONS`): every other tensor is shared. The inputs
  are unit-normal residual streams and every sub-block ends in a normalised projection, so
  activations stay O(1);
- or, from a checkpoint in the released layout (``StepDriver(checkpoint=DIR, layers=[2, 3,
  4])``, :mod:`dsv4lab.checkpoint`): those layers' real weights, as stored (FP8 projections,
  MXFP4 experts), each kind's time the mean of its measured layers, kinds not listed
  random; the embedding and head from the checkpoint;
- the embedding and the LM head (with the final mHC reduction and norm);
- per request a paged cache: pages for the tokens a step actually reads (the sliding window,
  the compressor's block of raw tokens, every compressed entry up to the context), but block
  tables (and with them the indexer's logits width and the HCA entry lists) sized for
  ``max_context``, as a server sized for 1M tokens has them. Unused slots point at page 0.

What a query attends, as in V4-Flash: CSA layers 128 window tokens + the indexer's top-512
entries (640 slots); HCA layers 128 + context/128 entries; window-only layers 128.

How it is timed (:meth:`StepDriver.profile`): the three layers (each fed the same residual
streams) plus embedding and head, captured as ONE CUDA graph with timing events between the
components (:mod:`dsv4lab.drivers.timing`); medians over replays; the row's ``mode`` is
"graph". ``graph=False`` times the same step eagerly (events recorded as a notebook would
call it, host gaps included): ``mode`` "eager". A configuration that reads device values on
the host (the "torch" MoE, the "torch_capped" indexer) cannot be captured and is timed
eagerly. On the CPU the marks are wall-clock times of Triton's interpreter.

How a 43-layer step is counted (:func:`extrapolate`)::

    step_ms = sum over kinds r of count_r * layer_ms[r]  +  embed_ms + head_ms

with ``count_r`` the main-model layers of compress ratio r (Flash: 2 x 0, 21 x 4, 20 x 128)
and ``layer_ms[r]`` the measured layer of that kind (the ratio-4 and ratio-128 layers route
with the learned router, the ratio-0 one by token hash, as 3 of the 43 layers do). The MTP
layer, sampling and the scheduler's host work are left out. Tokens/s =
``concurrency * 1000 / step_ms``. Each component is extrapolated the same way, so the
components add up to ``step_ms``.

Bytes per step (:func:`step_bytes`): :func:`dsv4lab.anatomy.step_anatomy`'s count of the
43-layer step, with the dense weights counted as this step stores them: the projections of
:data:`dsv4lab.model.FP8_PROJECTIONS` at 2 bytes a parameter (bf16) or 1 byte plus an fp32
scale per 128 x 128 block (FP8), the compressors (twice as wide where they overlap), the
indexer's weights projection and the router at 2 bytes. At decode sizes those projections
are bound by their bytes, so FP8 halves their time (``roofline_step_ms``).

Explained in notebooks/06_decode_step_at_scale.ipynb.
"""
from __future__ import annotations

import math
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from dsv4lab import anatomy, backends, bench, quant, roofline, runtime
from dsv4lab import model as M
from dsv4lab.checkpoint import Checkpoint
from dsv4lab.checkpoint.layout import embed_slots, head_slots
from dsv4lab.config import DSV4Config
from dsv4lab.drivers.presets import PROJECTIONS, StepConfig
from dsv4lab.drivers.timing import Marks, capture, mode_of, no_mark, segment_medians

LAYER_COMPONENTS = M.COMPONENTS
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
FP8_MAX = 448.0

# Agreement of two presets (same weights, same cache values), relative L2 error of each
# layer's output streams, attention outputs and the logits. With bf16 KV on both sides the
# backends differ in summation order and in bf16 roundings of the attention output (~1e-2 on
# the attention term); the FP8 KV cache adds e4m3 rounding of the latent vectors (2^-4 a
# value, averaged over 512 dims and the attended entries).
TOL_SAME_KV = 2e-2
TOL_FP8_KV = 6e-2
# FP8 projections against bf16 ones (same layers): e4m3 rounds each weight by up to 2^-4 of
# itself, through q LoRA, q up, KV, output and the shared expert in turn (the attention term
# moves most: ~3.5% at the mini size)
TOL_FP8_PROJ = 1e-1


# ---- counting a 43-layer step --------------------------------------------------------------

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


# ---- bytes per step ----------------------------------------------------------------------------

def dense_weight_bytes(cfg: DSV4Config, projections: str) -> int:
    """Bytes of the dense weights one 43-layer step reads (main layers and LM head), stored
    as this step stores them (module docstring): FP8 projections at 1 byte a parameter plus an
    fp32 scale per 128 x 128 block, or bf16 at 2; compressors, indexer weights and router bf16."""
    if projections not in PROJECTIONS:
        raise ValueError(f"projections must be one of {PROJECTIONS}, got {projections!r}")

    def proj(N, K):
        return N * K + 4 * _cdiv(N, 128) * _cdiv(K, 128) if projections == "fp8" else 2 * N * K

    d, H, D, q, G, R = (cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.q_lora_rank, cfg.o_groups,
                        cfg.o_lora_rank)
    I = cfg.moe_intermediate_size * cfg.n_shared_experts
    total = 2 * cfg.vocab_size * d                                            # LM head (bf16)
    for layer in range(cfg.num_layers):
        r = cfg.compress_ratios[layer]
        total += proj(q, d) + proj(H * D, q) + proj(D, d) + proj(G * R, H // G * D) + proj(d, G * R)
        total += (2 * proj(I, d) + proj(d, I)) if I else 0                    # the shared expert
        total += 2 * cfg.n_routed_experts * d                                 # router
        wide = 2 if M.compress_overlap(cfg, r) else 1
        if r:
            total += 2 * (2 * wide * D * d)                                   # compressor wkv, wgate
        if r == 4:
            total += proj(cfg.index_n_heads * cfg.index_head_dim, q) + 2 * cfg.index_n_heads * d
            total += 2 * (2 * wide * cfg.index_head_dim * d)                  # the indexer's compressor
    return total


def _anatomy_dense_bytes(cfg: DSV4Config) -> float:
    """The same weights as :func:`dsv4lab.anatomy.step_anatomy` counts them (its assumption 1)."""
    fp8 = anatomy.weight_bytes_per_param("fp8")
    total = cfg.vocab_size * cfg.hidden_size * 2.0
    for layer in range(cfg.num_layers):
        total += sum(n * b for n, b in anatomy.layer_projections(cfg, layer).values())
        total += cfg.n_shared_experts * anatomy.expert_params(cfg) * fp8
    return total


def step_bytes(cfg: DSV4Config, *, projections: str, concurrency: int, context: int,
               max_context: int | None = None, experts: str = "mxfp4", indexer: str = "triton",
               device: str | None = None) -> dict:
    """Bytes one decode step of the whole model reads (module docstring), and its roofline.

    Returns ``bytes_per_step``, ``dense_weight_bytes`` (:func:`dense_weight_bytes`), the
    rest (``other_bytes``: KV, indexer keys, routed experts, mHC, activations, from
    :func:`dsv4lab.anatomy.step_anatomy`), ``roofline_step_ms`` (anatomy's, with the dense
    weights' time re-counted from their bytes: decode-sized projections are memory-bound)
    and ``device``. Explained in notebooks/06_decode_step_at_scale.ipynb."""
    spec = roofline.device_spec(device)
    rows = anatomy.step_anatomy(cfg, concurrency=concurrency, context=context, max_context=max_context,
                                weight_format=experts, indexer=indexer, device=spec)
    tot = anatomy.step_totals(rows)
    mine, theirs = dense_weight_bytes(cfg, projections), _anatomy_dense_bytes(cfg)
    other = tot["bytes"] - theirs
    return {"bytes_per_step": other + mine, "dense_weight_bytes": mine, "other_bytes": other,
            "roofline_step_ms": tot["step_ms"] + (mine - theirs) / spec.bandwidth * 1e3, "device": spec.name,
            "projections": projections, "concurrency": concurrency, "context": context}


# ---- the layers ------------------------------------------------------------------------------

class Head(nn.Module):
    """Embedding + the model's final mHC reduction, norm and LM head (as in the model)."""

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
    with torch.device(device):
        blk = M.Block(cfg, layer_id, expert_format)
    M.to_dtype(blk, dtype)
    blk.eval()
    for p in blk.parameters():
        p.requires_grad_(False)
    return blk


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _tile_into(dst: torch.Tensor, tile: torch.Tensor):
    """dst [N, ...] = tile [n, ...] repeated along dim 0."""
    n = tile.shape[0]
    for a in range(0, dst.shape[0], n):
        e = min(dst.shape[0], a + n)
        dst[a:e] = tile[:e - a]


# ---- the cache's tables, and what a query attends ------------------------------------------------

def request_tables(batch: int, context: int, max_context: int, page: int, ratio: int, reach: int):
    """(raw block table [batch, max_context / page], compressed block table, pages used) of
    ``batch`` requests holding ``context`` tokens in a layer of compress ``ratio``: pages for
    the last ``reach`` raw tokens and every compressed entry, the rest of each table page 0."""
    p = context - 1
    first_raw_page = max(0, p - reach + 1) // page
    raw_pages = p // page - first_raw_page + 1
    comp_pages = max(1, _cdiv(context // ratio, page)) if ratio else 0
    comp_width = max(1, _cdiv(_cdiv(max_context, ratio), page)) if ratio else 1
    bt = torch.zeros(batch, _cdiv(max_context, page), dtype=torch.int32)
    cbt = torch.zeros(batch, comp_width, dtype=torch.int32)
    nxt = 1
    for b in range(batch):
        bt[b, first_raw_page:first_raw_page + raw_pages] = torch.arange(nxt, nxt + raw_pages)
        nxt += raw_pages
        if ratio:
            cbt[b, :comp_pages] = torch.arange(nxt, nxt + comp_pages)
            nxt += comp_pages
    return bt, cbt, 1 + batch * (raw_pages + comp_pages)


def attention_slots(cfg: DSV4Config, *, context: int, max_context: int | None = None,
                    page_size: int = 64) -> dict:
    """Per compress ratio, the KV slots one decode query of the step driver hands to sparse MLA
    (``slots``: the index list's width) and how many of them hold an entry (``visible``), from
    the same tables and metadata :meth:`StepDriver.prepare` builds. V4-Flash: window-only 128;
    CSA 128 + the indexer's top-512 = 640; HCA 128 + context / 128 (the list sized for the max
    context). Explained in notebooks/06_decode_step_at_scale.ipynb."""
    max_context = max_context or cfg.max_position_embeddings
    if not 1 <= context <= max_context:
        raise ValueError(f"context must lie in [1, max_context={max_context:,}], got {context!r}")
    kinds = sorted(set(cfg.compress_ratios[:cfg.num_layers]))
    reach = max([cfg.window_size] + [r for r in kinds if r])
    positions = torch.full((1, 1), context - 1, dtype=torch.int64)
    out = {}
    for r in kinds:
        bt, cbt, _ = request_tables(1, context, max_context, page_size, r, reach)
        meta = M.make_meta(cfg, positions, bt, cbt, page_size, [r] if r else [])
        window = int((meta.window >= 0).sum())
        if r == 0:
            slots, visible = meta.window.shape[-1], window
        elif r == 4:
            slots = meta.window.shape[-1] + cfg.index_topk
            visible = window + min(cfg.index_topk, int(meta.n_entries[4].max()))
        else:
            slots = meta.window.shape[-1] + meta.all_entries[r].shape[-1]
            visible = window + int((meta.all_entries[r] >= 0).sum())
        out[r] = {"slots": slots, "visible": visible}
    return out


# ---- the driver ------------------------------------------------------------------------------

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


def parse_layers(layers) -> list[int]:
    """``"2,3,4"`` or ``[2, 3, 4]`` -> ``[2, 3, 4]`` (ValueError naming what is wrong)."""
    if isinstance(layers, str):
        try:
            layers = [int(x) for x in layers.replace(" ", "").split(",") if x]
        except ValueError:
            raise ValueError(f"layers must be comma-separated layer indices like 2,3,4, got {layers!r}") from None
    layers = list(layers or [])
    ints = all(isinstance(i, int) and not isinstance(i, bool) for i in layers)
    if not layers or not ints or len(set(layers)) < len(layers):
        raise ValueError(f"layers must be distinct layer indices, got {layers!r}")
    return layers


class StepDriver:
    """Real-size (``DSV4Config.flash()``) or ``mini()`` layers of each kind + head.

    ``driver = StepDriver(DSV4Config.flash())`` builds three layers and the head on the
    GPU (~11 GB); ``state = driver.prepare(preset("after", cfg), batch=64, context=512)``;
    ``driver.run(state)`` computes one step; ``driver.profile(state)`` times it.
    ``StepDriver(checkpoint=DIR, layers=[2, 3, 4])`` measures those layers of a checkpoint
    in the released layout instead (the module docstring). ``overlap`` (default True: the
    released structure) gives random layers overlapping ratio-4 compressors.
    Explained in notebooks/06_decode_step_at_scale.ipynb.
    """

    def __init__(self, cfg: DSV4Config | None = None, *, device=None, seed: int = 0,
                 page_size: int | None = None, with_head: bool = True, checkpoint=None, layers=None,
                 overlap: bool = True):
        self.device = torch.device(device) if device is not None else runtime.device()
        ckpt = Checkpoint(checkpoint) if checkpoint is not None else None
        if ckpt is not None:
            cfg = ckpt.cfg
        else:
            cfg = cfg or DSV4Config.flash()
            if "compress_overlap" not in cfg.extra:
                cfg = cfg.replace(extra={**cfg.extra, "compress_overlap": bool(overlap)})
        self.cfg = cfg
        self.page_size = page_size or (64 if cfg.hidden_size >= 1024 else 16)
        self.layer_ids = representative_layers(cfg)
        self.checkpoint = str(ckpt.path) if ckpt is not None else None
        kinds: "OrderedDict[int, list]" = OrderedDict()
        if ckpt is not None:
            for i in (parse_layers(layers) if layers is not None else list(self.layer_ids.values())):
                if not 0 <= i < cfg.num_layers:
                    raise ValueError(f"layers: {i} is not a layer of this checkpoint (0..{cfg.num_layers - 1})")
                kinds.setdefault(cfg.compress_ratios[i], []).append(i)
        elif layers is not None:
            raise ValueError("layers= picks a checkpoint's layers: give checkpoint= too")
        self.measured = OrderedDict((r, kinds.get(r, [lid])) for r, lid in self.layer_ids.items())
        self.weights = {r: ("checkpoint" if r in kinds else "random") for r in self.layer_ids}
        self.layer_ids = OrderedDict((r, ids[0]) for r, ids in self.measured.items())
        torch.manual_seed(seed)
        experts = ckpt.formats["main"].experts if ckpt is not None else "mxfp4"
        built: "OrderedDict[int, list]" = OrderedDict()
        for r, ids in self.measured.items():
            built[r] = [ckpt.block(i, device=self.device) if r in kinds
                        else build_layer(cfg, i, device=self.device, expert_format=experts) for i in ids]
        self.base_projections = "bf16"
        if ckpt is not None and kinds:
            self.base_projections = "fp8" if ckpt.formats["main"].dense.dtype == "fp8_e4m3" else "bf16"
            for r in built:              # random kinds in the checkpoint's format
                if r not in kinds:
                    built[r] = [M.set_projections_(b, self.base_projections) for b in built[r]]
        self._variants = {self.base_projections: built}
        self.layers: "OrderedDict[int, M.Block]" = OrderedDict((r, blks[0]) for r, blks in built.items())
        self.expert_format = experts
        self.head = None
        if with_head:
            if ckpt is not None:
                with torch.device("meta"):
                    head = Head(cfg)
                self.head = ckpt.fill(head, embed_slots(cfg) + head_slots(cfg), device=self.device)
            else:
                with torch.device(self.device):
                    self.head = Head(cfg)
                M.to_dtype(self.head, torch.bfloat16)
                self.head.eval().requires_grad_(False)

    def blocks(self, projections: str) -> "OrderedDict[int, list]":
        """Compress ratio -> the measured layers of that kind with ``projections`` ("bf16" or
        "fp8"): the layers as built, or (made once, every other tensor shared) a copy with
        their dense projections converted."""
        if projections not in PROJECTIONS:
            raise ValueError(f"projections must be one of {PROJECTIONS}, got {projections!r}")
        if projections not in self._variants:
            base = self._variants[self.base_projections]
            self._variants[projections] = OrderedDict(
                (r, [M.set_projections_(M.shared_clone(b), projections) for b in blks]) for r, blks in base.items())
        return self._variants[projections]

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
        backends.resolve("fused_moe", step.moe, fmt=self.expert_format, device=dev)
        backends.resolve("mhc", step.mhc, device=dev)

        B = batch
        gen = torch.Generator(device=dev)
        positions = torch.full((B, 1), context - 1, dtype=torch.int64, device=dev)
        # raw tokens read: the window, a compressor's block (two for an overlapping one)
        reach = max([cfg.window_size] + [2 * r if M.compress_overlap(cfg, r) else r for r in self.layers if r])
        caches, metas, pages = {}, {}, {}
        for r in self.layers:
            gen.manual_seed(seed * 1000 + r)
            bt, cbt, P = request_tables(B, context, step.max_context, page, r, reach)
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
    def run(self, state: StepState, mark: Callable = no_mark) -> dict:
        """One decode step: every layer kind on ``state.x``, then embedding and head.

        Returns {ratio: output streams [B, 1, n, d], "logits": [B, 1, vocab] fp32}, plus
        {"attention r": the attention output [B, 1, H, D]} for each kind (the residual
        streams dwarf one layer's attention term, so it is compared on its own).
        ``mark(layer, component)`` is called after each component.
        """
        be = state.step.backends()
        out = {}
        for r, blks in self.blocks(state.step.projections).items():
            for j, blk in enumerate(blks):         # more layers of a kind share its cache and inputs
                state.metas[r].memo.clear()        # RoPE tables are part of each step's work
                taps: dict = {}
                y = blk.forward_decode(state.x, state.tokens, state.metas[r], state.caches[r], be,
                                       lambda c, r=r: mark(r, c), taps)
                if j == 0:
                    out[r], out[f"attention {r}"] = y, taps["attention"]
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
        """Time one step per component (module docstring): in one CUDA graph when ``graph``
        (default: whenever the step can be captured), else eagerly.

        Returns {"kind_ms": {ratio: {component: ms}}, "head_ms": {component: ms},
        "measured_ms": the step as run (3 layers + head), "timing", "mode" ("graph" or
        "eager"), "graph_replay_ms": replay time of the whole graph (GPU graphs, else None)}.
        """
        if self.device.type != "cuda":
            marks = Marks("wall")
            samples = []
            for _ in range(reps or 1):
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
        self.run(state)                                        # compile, value checks
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
                g = capture(self.run, state, None)
                total = bench.time_fn(g.replay, warmup_ms=5, rep_ms=30)["ms"]
                del g
                res = self._eager_events(state, reps, total, "eager_event_shares_x_cuda_graph")
            except Exception as e2:
                note += f"; capture failed: {type(e2).__name__}: {e2}"
                torch.cuda.synchronize()
                res = self._eager_events(state, reps, None, "eager_events_capture_failed")
            res["timing_note"] = note[:400]
            return res

    def _graph_events(self, state, reps):
        marks = Marks("graph_events")
        g = capture(self.run, state, marks)
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
        marks = Marks("events")
        samples = []
        for _ in range(reps):
            marks.begin()
            self.run(state, marks)
            torch.cuda.synchronize()
            samples.append(marks.segments())
        res = self._summarise(samples, timing, scale_to)
        if scale_to is not None:
            f = scale_to / res["run_ms"]
            res["kind_ms"] = {r: {c: v * f for c, v in d.items()} for r, d in res["kind_ms"].items()}
            res["head_ms"] = {c: v * f for c, v in res["head_ms"].items()}
            res["measured_ms"] *= f
            res["run_ms"] = scale_to
            res["component_scale"] = f
        return res

    def _summarise(self, samples, timing, replay_ms):
        """Medians per (layer kind, component) over the samples, per layer of the kind (the
        mean of its measured layers); components sum to ``measured_ms`` (one layer of each
        kind + head). ``run_ms``: the step as run (every measured layer)."""
        med = segment_medians(samples)
        n = {r: len(ids) for r, ids in self.measured.items()}
        kind_ms = {r: {c: med.get((r, c), 0.0) / n[r] for c in LAYER_COMPONENTS} for r in self.layers}
        head_ms = {c: med.get((HEAD, c), 0.0) for c in HEAD_COMPONENTS}
        measured = sum(sum(d.values()) for d in kind_ms.values()) + sum(head_ms.values())
        run = sum(n[r] * sum(d.values()) for r, d in kind_ms.items()) + sum(head_ms.values())
        return {"kind_ms": kind_ms, "head_ms": head_ms, "measured_ms": measured, "run_ms": run, "timing": timing,
                "mode": mode_of(timing), "graph_replay_ms": replay_ms, "reps": len(samples)}

    # ---- one result row -------------------------------------------------------------
    def row(self, state: StepState, prof: dict) -> dict:
        """A flat result row: configuration, ``mode``, per-kind layer times, the extrapolated
        step (``step_ms``, ``tokens_per_s``) and each component's share of it (``ms_<comp>``)."""
        cfg, st = self.cfg, state.step
        counts = layer_counts(cfg)
        kind_total = {r: sum(d.values()) for r, d in prof["kind_ms"].items()}
        head_total = sum(prof["head_ms"].values())
        ex = extrapolate(kind_total, head_total, cfg, state.batch)
        comp = {c: sum(counts[r] * prof["kind_ms"][r][c] for r in counts) for c in LAYER_COMPONENTS}
        comp.update(prof["head_ms"])
        row = {
            "preset": st.name, "change": st.change, "model": cfg.name, "mode": prof["mode"],
            "concurrency": state.batch, "context": state.context, "max_context": st.max_context,
            "attention": st.attention, "indexer": st.indexer, "indexer_dtype": st.indexer_dtype,
            "kv_cache": st.kv_cache, "moe": st.moe, "mhc": st.mhc, "page_size": state.page_size,
            "projections": st.projections, "experts": self.expert_format,
            "compressor_overlap": M.compress_overlap(cfg, 4),
            "weights": "checkpoint" if self.checkpoint else "random",
            "layers_measured": {str(r): (ids[0] if len(ids) == 1 else ids) for r, ids in self.measured.items()},
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
        if self.checkpoint:
            row["checkpoint"] = self.checkpoint
            row["random_kinds"] = [r for r, w in self.weights.items() if w == "random"]
        try:
            by = step_bytes(cfg, projections=st.projections, concurrency=state.batch, context=state.context,
                            max_context=st.max_context, experts=self.expert_format,
                            indexer="fallback" if st.indexer == "torch_fallback" else "triton")
            row.update(bytes_per_step=by["bytes_per_step"], dense_weight_bytes=by["dense_weight_bytes"],
                       roofline_device=by["device"], roofline_step_ms=by["roofline_step_ms"],
                       roofline_tokens_per_s=state.batch * 1e3 / by["roofline_step_ms"],
                       roofline_fraction=by["roofline_step_ms"] / ex["step_ms"])
        except ValueError:
            pass
        for k in ("timing_note", "component_scale"):
            if k in prof:
                row[k] = prof[k]
        if st.note:
            row["note"] = st.note
        return row


# ---- comparing presets, and the step's targets ------------------------------------------------

def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp32."""
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def compare_outputs(out_a: dict, out_b: dict) -> dict:
    """Relative L2 error of every output (layer kinds and logits) of two runs."""
    return {k: rel_error(out_a[k], out_b[k]) for k in out_b}


def row_mode(row: dict) -> str:
    """"graph" or "eager" for a result row (rows recorded before ``mode`` existed say it
    through their ``timing``; a row with neither is a graph replay)."""
    return row.get("mode") or mode_of(row.get("timing", "cuda_graph_events"))


def _find(rows, **kw):
    sel = [r for r in rows if all(r.get(k) == v for k, v in kw.items())]
    return sel[-1] if sel else None


def targets(rows: list[dict], *, concurrency: int = 64, context: int = 512,
            max_context: int = 1048576) -> list[dict]:
    """The step's targets from graph-replay result rows of random weights (the newest row per
    configuration wins; a checkpoint's rows are its own measurement, not the targets').

    1. the indexer fix alone (preset "indexer_triton" vs "before"), concurrency 64,
       512-token contexts, 1M max context: >= 10x step throughput. ``ceiling`` is what no
       indexer could beat with that "before": its step time over its step time without
       the indexer (Amdahl; needs the row's ``step_ms`` and ``ms_indexer``);
    2. "after" at 512-token contexts keeps >= 95% of its 8,192-max-context throughput at
       131,072 and 1,048,576.
    Explained in notebooks/06_decode_step_at_scale.ipynb.
    """
    rows = [r for r in rows if row_mode(r) == "graph" and r.get("weights", "random") == "random"]
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
