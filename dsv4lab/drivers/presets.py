"""The configurations of a decode step: one backend per op and the formats of the caches and weights.

A :class:`StepConfig` names the sparse-MLA backend ("simt" or "mma"), the indexer backend
("torch_fallback", "torch_capped", "triton") and its matmul dtype (fp32, bf16 or fp8 keys),
the MLA KV cache (bf16 or the 584-byte FP8 layout), the routed-MoE backend ("triton" or the
"torch" reference), the mHC backend, the dense projections' format (bf16, or FP8 e4m3 with
one power-of-two scale per 128 x 128 block as the released checkpoint stores them) and the
max context the server is sized for.

The named presets (:func:`preset`):

- ``"before"``: the campaign's starting point: SIMT attention over a bf16 KV cache, the
  torch fallback indexer scoring all of a 1M max context in fp32. The routed experts run in
  the Triton MXFP4 kernel: the campaign's main model had a working MoE kernel (the SM100-only
  kernel hit the MTP draft layer only).
- ``"after"``: MMA attention over the FP8 KV cache, the capture-safe Triton indexer with FP8
  keys, the Triton MXFP4 MoE, FP8 projections as released; still a 1M max context. "before"
  and its single changes keep bf16 projections.
- single changes from "before" (:data:`SINGLE_CHANGES`): ``"mma"``, ``"indexer_triton"``,
  ``"indexer_fp8"``, ``"cap_8k"`` (the campaign's first fix: the fallback with the max context
  capped), ``"moe_torch"`` (a step without any MoE kernel);
- ablations of "after" (:data:`ABLATIONS`): ``"after_kv_bf16"``, ``"after_simt"``,
  ``"after_mhc_torch"``, ``"after_bf16_proj"`` (bf16 projections: twice the dense weights'
  bytes).

Explained in notebooks/06_decode_step_at_scale.ipynb.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from dsv4lab.config import DSV4Config

INDEXER_DTYPES = ("fp32", "bf16", "fp8")
KV_FORMATS = ("bf16", "fp8")
PROJECTIONS = ("bf16", "fp8")


@dataclass(frozen=True)
class StepConfig:
    """Backends and formats of one decode step. ``max_context`` None: the model's max
    (1,048,576 tokens for Flash)."""
    name: str = "custom"
    attention: str = "simt"            # sparse_mla_decode backend
    indexer: str = "torch_fallback"    # indexer_topk backend
    indexer_dtype: str = "fp32"        # the indexer matmul's operands: fp32, bf16 or fp8 keys
    kv_cache: str = "bf16"             # MLA latent cache: bf16 or the 584-byte FP8 layout
    moe: str = "triton"                # fused_moe backend
    mhc: str = "auto"                  # mhc backend (the hyper-connections' per-token mixing)
    projections: str = "bf16"          # dense projections: bf16, or FP8 block-scaled (released)
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
        if self.projections not in PROJECTIONS:
            raise ValueError(f"projections must be one of {PROJECTIONS}, got {self.projections!r}")
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


TORCH_REFERENCE = StepConfig(name="torch", attention="torch", indexer="torch_fallback",
                             indexer_dtype="fp32", kv_cache="bf16", moe="torch",
                             note="the fp32 torch references of every op")


def reference(step: StepConfig) -> StepConfig:
    """The fp32 torch references of every op with ``step``'s projections: what ``step``'s
    outputs are compared against (:data:`TORCH_REFERENCE` is the bf16-projection one)."""
    return TORCH_REFERENCE.replace(projections=step.projections)


_BEFORE = StepConfig(name="before", attention="simt", indexer="torch_fallback", indexer_dtype="fp32",
                     kv_cache="bf16", moe="triton",
                     note="campaign before: SIMT attention, fallback indexer (fp32) at max context")
_AFTER = StepConfig(name="after", attention="mma", indexer="triton", indexer_dtype="fp8",
                    kv_cache="fp8", moe="triton", projections="fp8",
                    note="MMA attention over FP8 KV, Triton indexer with FP8 keys, Triton MXFP4 MoE, "
                         "FP8 block-scaled projections")

PRESET_NAMES = ("before", "mma", "indexer_triton", "indexer_fp8", "cap_8k", "moe_torch",
                "after", "after_kv_bf16", "after_simt", "after_mhc_torch", "after_bf16_proj")
SINGLE_CHANGES = ("mma", "indexer_triton", "indexer_fp8", "cap_8k", "moe_torch")
ABLATIONS = ("after_kv_bf16", "after_simt", "after_mhc_torch", "after_bf16_proj")


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
        "after_bf16_proj": _AFTER.replace(name="after_bf16_proj", projections="bf16",
                                          change="after, projections fp8 -> bf16",
                                          note="after with bf16 dense projections (twice their bytes)"),
    }
    if name not in table:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESET_NAMES)}")
    return table[name].for_model(cfg) if cfg is not None else table[name]
