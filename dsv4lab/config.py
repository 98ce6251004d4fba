"""The model's numbers, in one place.

``DSV4Config.flash()`` is DeepSeek-V4-Flash as published (the public config.json and the
reference inference code); ``mini()`` keeps every structural feature (compressed layers
of both ratios, hash-routed layers, MTP, mHC) at a size that trains in minutes and runs
in Triton's interpreter. ``from_hf_config`` reads a Hugging Face style config.json.

Explained in notebooks/00_tour.ipynb.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass(frozen=True)
class DSV4Config:
    vocab_size: int
    hidden_size: int
    num_layers: int
    # attention: 64 query heads share one latent KV vector (MQA); K and V are the same
    num_heads: int
    head_dim: int                 # nope + rope; also d_v
    rope_dim: int
    q_lora_rank: int
    o_groups: int                 # grouped output projection
    o_lora_rank: int
    window_size: int              # sliding window of raw tokens every layer attends
    compress_ratios: tuple[int, ...]   # one per layer, then the MTP layer's
    # lightning indexer (ratio-4 layers)
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    # MoE
    n_routed_experts: int
    n_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    score_func: str
    n_hash_layers: int
    swiglu_limit: float
    # mHC: residual streams mixed by Sinkhorn-normalised matrices
    hc_mult: int
    hc_sinkhorn_iters: int
    # MTP (next-n) draft layers
    num_mtp_layers: int
    max_position_embeddings: int
    expert_format: str            # "mxfp4" in the native checkpoint
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    name: str = "custom"
    extra: dict = field(default_factory=dict, compare=False)

    # ---- derived sizes -------------------------------------------------------------
    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.rope_dim

    @property
    def max_compressed_entries(self) -> int:
        """Entries a ratio-4 ("c4") layer holds at max context: 1M tokens -> 262,144."""
        return self.max_position_embeddings // 4

    def layer_ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    @property
    def mtp_compress_ratio(self) -> int:
        return self.compress_ratios[self.num_layers] if len(self.compress_ratios) > self.num_layers else 0

    def replace(self, **changes) -> "DSV4Config":
        return dataclasses.replace(self, **changes)

    # ---- the two configurations the workbook uses ----------------------------------
    @classmethod
    def flash(cls) -> "DSV4Config":
        """DeepSeek-V4-Flash (sources: the model's public config.json and inference/model.py)."""
        return cls(
            name="DeepSeek-V4-Flash",
            vocab_size=129280,          # config.json vocab_size
            hidden_size=4096,           # config.json hidden_size
            num_layers=43,              # config.json num_hidden_layers
            num_heads=64,               # config.json num_attention_heads (one shared KV head)
            head_dim=512,               # config.json head_dim: 448 nope + 64 rope; d_v = 512
            rope_dim=64,                # config.json qk_rope_head_dim
            q_lora_rank=1024,           # config.json q_lora_rank
            o_groups=8,                 # config.json o_groups (grouped output projection)
            o_lora_rank=1024,           # config.json o_lora_rank
            window_size=128,            # config.json sliding_window
            # config.json compress_ratios: [0,0] + [4,128]*20 + [4] for the 43 layers,
            # then the MTP layer's (window only)
            compress_ratios=tuple([0, 0] + [4, 128] * 20 + [4] + [0]),
            index_n_heads=64,           # config.json index_n_heads
            index_head_dim=128,         # config.json index_head_dim
            index_topk=512,             # config.json index_topk
            n_routed_experts=256,       # config.json n_routed_experts
            n_experts_per_tok=6,        # config.json num_experts_per_tok
            n_shared_experts=1,         # config.json n_shared_experts
            moe_intermediate_size=2048, # config.json moe_intermediate_size
            routed_scaling_factor=1.5,  # config.json routed_scaling_factor
            score_func="sqrtsoftplus",  # inference/model.py Gate: sqrt(softplus(logits))
            n_hash_layers=3,            # config.json num_hash_layers: token-id hash routing
            swiglu_limit=10.0,          # config.json swiglu_limit (clamped SwiGLU)
            hc_mult=4,                  # config.json hc_mult: 4 residual streams
            hc_sinkhorn_iters=20,       # config.json hc_sinkhorn_iters
            num_mtp_layers=1,           # config.json num_nextn_predict_layers
            max_position_embeddings=1048576,  # config.json max_position_embeddings (1M)
            expert_format="mxfp4",      # quantization_config: routed experts E2M1 + E8M0/32
        )

    @classmethod
    def mini(cls) -> "DSV4Config":
        """Same structure, tiny sizes: trains in minutes, runs in Triton's interpreter."""
        return cls(
            name="mini",
            vocab_size=256,             # bytes
            hidden_size=128,
            num_layers=4,
            num_heads=4,
            head_dim=64,
            rope_dim=16,
            q_lora_rank=64,
            o_groups=2,
            o_lora_rank=64,
            window_size=16,
            compress_ratios=(0, 4, 128, 4, 0),
            index_n_heads=4,
            index_head_dim=32,
            index_topk=16,
            n_routed_experts=8,
            n_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=64,
            routed_scaling_factor=1.5,
            score_func="sqrtsoftplus",
            n_hash_layers=1,
            swiglu_limit=10.0,
            hc_mult=4,
            hc_sinkhorn_iters=20,
            num_mtp_layers=1,
            max_position_embeddings=4096,
            expert_format="mxfp4",
        )


# Hugging Face config.json key -> DSV4Config field
_HF_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "head_dim": "head_dim",
    "qk_rope_head_dim": "rope_dim",
    "q_lora_rank": "q_lora_rank",
    "o_groups": "o_groups",
    "o_lora_rank": "o_lora_rank",
    "sliding_window": "window_size",
    "compress_ratios": "compress_ratios",
    "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim",
    "index_topk": "index_topk",
    "n_routed_experts": "n_routed_experts",
    "num_experts_per_tok": "n_experts_per_tok",
    "n_shared_experts": "n_shared_experts",
    "moe_intermediate_size": "moe_intermediate_size",
    "routed_scaling_factor": "routed_scaling_factor",
    "scoring_func": "score_func",
    "num_hash_layers": "n_hash_layers",
    "swiglu_limit": "swiglu_limit",
    "hc_mult": "hc_mult",
    "hc_sinkhorn_iters": "hc_sinkhorn_iters",
    "num_nextn_predict_layers": "num_mtp_layers",
    "max_position_embeddings": "max_position_embeddings",
}
_OPTIONAL = {"rms_norm_eps": "rms_norm_eps", "rope_theta": "rope_theta"}
_ALIASES = {"window_size": "sliding_window"}


def _expert_format(hf: dict) -> str:
    qc = hf.get("quantization_config") or {}
    fmt = str(qc.get("quant_method") or qc.get("expert_dtype") or qc.get("fmt") or "mxfp4").lower()
    if "nvfp4" in fmt or fmt == "modelopt_fp4":
        return "nvfp4"
    if "mxfp4" in fmt or "fp4" in fmt:
        return "mxfp4"
    if fmt in ("bf16", "bfloat16", "none"):
        return "bf16"
    raise ValueError(f"quantization_config: unknown expert format {fmt!r} (expected mxfp4, nvfp4 or bf16)")


def from_hf_config(hf: dict) -> DSV4Config:
    """Build a DSV4Config from a Hugging Face style config.json dict.

    Missing keys and contradictions (head_dim not rope + nope, a compress_ratios list
    of the wrong length, top-k over the expert count, ...) raise ValueError naming the key.
    """
    if not isinstance(hf, dict):
        raise ValueError(f"from_hf_config expects a dict parsed from config.json, got {type(hf).__name__}")
    hf = dict(hf)
    for alias, key in _ALIASES.items():
        if key not in hf and alias in hf:
            hf[key] = hf[alias]
    missing = [k for k in _HF_KEYS if k not in hf]
    if missing:
        raise ValueError(f"config.json is missing required keys: {', '.join(missing)}")
    kw = {field_: hf[key] for key, field_ in _HF_KEYS.items()}
    kw.update({field_: hf[key] for key, field_ in _OPTIONAL.items() if key in hf})
    kw["compress_ratios"] = tuple(int(r) for r in kw["compress_ratios"])
    kw["expert_format"] = _expert_format(hf)
    kw["name"] = str(hf.get("_name_or_path") or hf.get("model_type") or "hf")
    kw["extra"] = {k: v for k, v in hf.items() if k not in _HF_KEYS and k not in _OPTIONAL}
    if "nope_head_dim" in hf or "qk_nope_head_dim" in hf:
        nope = hf.get("qk_nope_head_dim", hf.get("nope_head_dim"))
        if nope + kw["rope_dim"] != kw["head_dim"]:
            raise ValueError(
                f"qk_nope_head_dim ({nope}) + qk_rope_head_dim ({kw['rope_dim']}) "
                f"must equal head_dim ({kw['head_dim']})")
    return validate(DSV4Config(**kw))


def validate(cfg: DSV4Config) -> DSV4Config:
    """Raise ValueError naming the first inconsistent field."""
    def bad(msg):
        raise ValueError(msg)

    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim",
                 "q_lora_rank", "o_groups", "o_lora_rank", "window_size", "index_n_heads",
                 "index_head_dim", "index_topk", "n_routed_experts", "n_experts_per_tok",
                 "moe_intermediate_size", "hc_mult", "max_position_embeddings"):
        v = getattr(cfg, name)
        if not isinstance(v, int) or v <= 0:
            bad(f"{name} must be a positive integer, got {v!r}")
    if not 0 < cfg.rope_dim < cfg.head_dim:
        bad(f"qk_rope_head_dim ({cfg.rope_dim}) must be in (0, head_dim={cfg.head_dim})")
    if cfg.rope_dim % 2:
        bad(f"qk_rope_head_dim ({cfg.rope_dim}) must be even")
    if cfg.num_heads % cfg.o_groups:
        bad(f"num_attention_heads ({cfg.num_heads}) must be divisible by o_groups ({cfg.o_groups})")
    n = len(cfg.compress_ratios)
    if n not in (cfg.num_layers, cfg.num_layers + cfg.num_mtp_layers):
        bad(f"compress_ratios has {n} entries; expected num_hidden_layers ({cfg.num_layers}) "
            f"or num_hidden_layers + num_nextn_predict_layers ({cfg.num_layers + cfg.num_mtp_layers})")
    if any(r not in (0, 4, 128) and r < 0 for r in cfg.compress_ratios):
        bad(f"compress_ratios entries must be 0 or a positive ratio, got {cfg.compress_ratios}")
    if cfg.n_experts_per_tok > cfg.n_routed_experts:
        bad(f"num_experts_per_tok ({cfg.n_experts_per_tok}) exceeds n_routed_experts ({cfg.n_routed_experts})")
    if cfg.n_hash_layers > cfg.num_layers:
        bad(f"num_hash_layers ({cfg.n_hash_layers}) exceeds num_hidden_layers ({cfg.num_layers})")
    if cfg.score_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
        bad(f"scoring_func must be sqrtsoftplus, sigmoid or softmax, got {cfg.score_func!r}")
    if cfg.hidden_size % 32 or cfg.moe_intermediate_size % 32:
        bad("hidden_size and moe_intermediate_size must be multiples of 32 (MXFP4 blocks)")
    return cfg
