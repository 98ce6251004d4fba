"""The model's numbers, in one place, and how a checkpoint's weights are stored.

``DSV4Config.flash()`` is DeepSeek-V4-Flash as published (the public config.json and the
reference inference code); ``mini()`` keeps every structural feature (compressed layers
of both ratios, hash-routed layers, MTP, mHC) at a size that trains in minutes and runs
in Triton's interpreter. ``from_hf_config`` reads a Hugging Face style config.json (the
released one as it is) and checks every range, with a ValueError naming the key.

:func:`resolve_formats` is the one place that reads how the weights are stored, for the
main model and the MTP layer alike, from a checkpoint's metadata and/or a flag:

- the routed experts: ``"mxfp4"`` (E2M1, an E8M0 scale per 32: DeepSeek's
  ``"expert_dtype": "fp4"``), ``"nvfp4"`` (E2M1, an E4M3 scale per 16 and an fp32 global:
  NVIDIA ModelOpt's ``"quant_algo": "NVFP4"``) or ``"bf16"``;
- the dense projections: :class:`DenseFormat`, bf16 or FP8 e4m3 with one scale per block
  (the released ``quantization_config``: ``"quant_method": "fp8"``, ``"fmt": "e4m3"``,
  ``"weight_block_size": [128, 128]``, ``"scale_fmt": "ue8m0"``).

Metadata and a flag that disagree raise :class:`QuantConfigError` naming both. The backend
choice (:func:`dsv4lab.backends.resolve_moe_backend`) starts from the same answer.

Explained in notebooks/00_tour.ipynb and notebooks/04_mxfp4_moe_port.ipynb.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import math
from dataclasses import dataclass, field

EXPERT_FORMATS = ("mxfp4", "nvfp4", "bf16")
LAYERS = ("main", "mtp")


class QuantConfigError(ValueError):
    """Checkpoint metadata and a flag disagree about how weights are stored, or one of them
    names a format dsv4lab does not read."""


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class DenseFormat:
    """How the dense projections' weights are stored: ``"bf16"``, or ``"fp8_e4m3"`` with one
    scale per ``block`` (rows, columns) in ``scale_fmt`` (``"ue8m0"``: powers of two,
    ``"fp32"``: any float)."""
    dtype: str = "bf16"
    block: tuple[int, int] | None = None
    scale_fmt: str | None = None

    def __post_init__(self):
        if self.dtype == "bf16":
            if self.block is not None or self.scale_fmt is not None:
                raise ValueError("a bf16 DenseFormat has no block or scale_fmt")
            return
        if self.dtype != "fp8_e4m3":
            raise ValueError(f"DenseFormat.dtype must be 'bf16' or 'fp8_e4m3', got {self.dtype!r}")
        block = tuple(self.block) if self.block is not None else ()
        if len(block) != 2 or not all(_is_int(b) and b > 0 for b in block):
            raise ValueError(f"weight_block_size must be two positive integers, got {self.block!r}")
        object.__setattr__(self, "block", (int(block[0]), int(block[1])))
        if self.scale_fmt not in ("ue8m0", "fp32"):
            raise ValueError(f"scale_fmt must be 'ue8m0' or 'fp32', got {self.scale_fmt!r}")

    def describe(self) -> str:
        if self.dtype == "bf16":
            return "bf16"
        return f"fp8 e4m3, {self.block[0]}x{self.block[1]} blocks, {self.scale_fmt} scales"


BF16 = DenseFormat()
FP8_BLOCK = DenseFormat("fp8_e4m3", (128, 128), "ue8m0")      # the released checkpoint's


@dataclass(frozen=True)
class LayerFormats:
    """How one layer's weights are stored (:func:`resolve_formats`)."""
    layer: str              # "main" or "mtp"
    experts: str            # one of EXPERT_FORMATS
    dense: DenseFormat
    source: str             # where the answer came from

    def describe(self) -> str:
        return f"{self.layer} layer: {self.experts} experts, {self.dense.describe()} dense ({self.source})"


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
    expert_format: str            # routed experts of the main layers: "mxfp4" in the native checkpoint
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    name: str = "custom"
    extra: dict = field(default_factory=dict, compare=False)
    hc_eps: float = 1e-6          # the Sinkhorn normalisation's epsilon
    dense_format: DenseFormat = BF16          # the main layers' dense projections
    mtp_expert_format: str = ""               # the MTP layer's experts ("": as expert_format)
    mtp_dense_format: DenseFormat | None = None   # the MTP layer's dense projections (None: as dense_format)

    def __post_init__(self):
        # a config read back from JSON holds lists and dicts where this holds tuples and formats
        object.__setattr__(self, "compress_ratios", tuple(self.compress_ratios))
        for name in ("dense_format", "mtp_dense_format"):
            v = getattr(self, name)
            if isinstance(v, dict):
                object.__setattr__(self, name, DenseFormat(**v))

    def formats(self, layer: str = "main") -> LayerFormats:
        """How the ``layer`` ("main" or "mtp") weights are stored."""
        if layer not in LAYERS:
            raise ValueError(f"layer must be 'main' or 'mtp', got {layer!r}")
        if layer == "main":
            return LayerFormats("main", self.expert_format, self.dense_format, "config")
        return LayerFormats("mtp", self.mtp_expert_format or self.expert_format,
                            self.mtp_dense_format or self.dense_format, "config")

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

    @classmethod
    def from_hf_config(cls, hf: dict, *, experts: str | None = None, dense: str | None = None) -> "DSV4Config":
        """A config.json dict (the released one as it is): :func:`from_hf_config`."""
        return from_hf_config(hf, experts=experts, dense=dense)

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
            expert_format="mxfp4",      # config.json expert_dtype "fp4": E2M1 + E8M0 per 32
            dense_format=FP8_BLOCK,     # config.json quantization_config: fp8 e4m3, 128x128, ue8m0
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


# ---- how the weights are stored: one reading for metadata and flags -----------------------

# quantization_config keys that mark a bare quantization_config (not a whole config.json)
_QC_KEYS = ("quant_method", "quant_algo", "fmt", "weight_block_size", "scale_fmt", "group_size")


def _expert_name(value, where: str) -> str | None:
    """An expert-format word (a flag, ``expert_dtype``, dsv4lab's ``expert_format``) as one of
    :data:`EXPERT_FORMATS`, or ``"fp8"`` (recognised, refused later); None for auto/empty."""
    if value is None:
        return None
    v = str(value).strip().lower().replace("-", "_")
    if v in ("", "auto"):
        return None
    if v in ("mxfp4", "fp4", "mx_fp4", "e2m1"):
        return "mxfp4"
    if v in ("nvfp4", "modelopt_fp4", "modelopt_nvfp4", "modelopt"):
        return "nvfp4"
    if v in ("bf16", "bfloat16", "unquantized", "none"):
        return "bf16"
    if v in ("fp8", "float8", "e4m3", "fp8_e4m3"):
        return "fp8"
    raise QuantConfigError(f"{where}: unknown expert format {value!r} (expected mxfp4, nvfp4 or bf16)")


def _dense_name(value, where: str) -> DenseFormat | None:
    if value is None:
        return None
    v = str(value).strip().lower().replace("-", "_")
    if v in ("", "auto"):
        return None
    if v in ("bf16", "bfloat16", "unquantized", "none"):
        return BF16
    if v in ("fp8", "fp8_e4m3", "e4m3", "fp8_block"):
        return FP8_BLOCK
    raise QuantConfigError(f"{where}: unknown dense-weight format {value!r} (expected bf16 or fp8)")


def _fp8_dense(qc: dict) -> DenseFormat:
    """The dense format of a ``"quant_method": "fp8"`` quantization_config (DeepSeek's)."""
    fmt = str(qc.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise QuantConfigError(f"quantization_config['fmt'] is {qc.get('fmt')!r}: dsv4lab reads e4m3 FP8 weights")
    block = qc.get("weight_block_size")
    if block is None:
        raise QuantConfigError("quantization_config has quant_method 'fp8' but no weight_block_size: "
                               "per-tensor FP8 weights are not read (DeepSeek's are 128x128 blocks)")
    scale_fmt = qc.get("scale_fmt") or "fp32"       # DeepSeek-V3's fp8 checkpoints: fp32 scales
    try:
        return DenseFormat("fp8_e4m3", tuple(block), str(scale_fmt).lower())
    except (TypeError, ValueError) as e:
        raise QuantConfigError(f"quantization_config: {e}") from None


def _matches(patterns, names) -> bool:
    """Whether any module name is excluded by a ModelOpt-style pattern (fnmatch, or a parent)."""
    for pat in map(str, patterns):
        for name in names:
            if fnmatch.fnmatchcase(name, pat) or ("*" not in pat and name.startswith(pat + ".")):
                return True
    return False


def _module_names(layer: str, num_layers: int | None) -> tuple[list[str], list[str]]:
    """(an expert's, a dense projection's) module names for ``layer``, in the spellings
    checkpoints use: DeepSeek's (``layers.3.ffn.experts.0.w1``, ``mtp.0.attn.wq_a``) and
    Hugging Face's (``model.layers.3.mlp.experts.0.gate_proj``, the MTP layer as layer
    ``num_hidden_layers``). The main layers are represented by layer 3 (past the
    hash-routed ones)."""
    if layer == "main":
        idx = [3]
        native = "layers.3"
    else:
        idx = [num_layers] if num_layers is not None else []
        native = "mtp.0"
    hf = [f"model.layers.{i}" for i in idx] + (["model.mtp.0", "mtp.0"] if layer == "mtp" else [])
    experts = [f"{native}.ffn.experts.0.w1"] + [f"{h}.mlp.experts.0.gate_proj" for h in hf]
    dense = [f"{native}.attn.wq_a"] + [f"{h}.self_attn.wq_a" for h in hf]
    return experts, dense


def _declared(metadata, layer: str, num_layers: int | None) -> tuple[str | None, DenseFormat | None, str]:
    """What checkpoint metadata declares for ``layer``: (experts, dense, where), None where
    it declares nothing."""
    if metadata is None:
        return None, None, ""
    if not isinstance(metadata, dict):
        raise QuantConfigError(f"checkpoint metadata must be a dict, got {type(metadata).__name__}")
    top = metadata
    if "quantization_config" in top:
        qc = top["quantization_config"] or {}
    elif isinstance(top.get("quantization"), dict):          # ModelOpt's hf_quant_config.json
        qc = top["quantization"]
    elif any(k in top for k in _QC_KEYS):                     # a bare quantization_config
        qc = top
    else:
        qc = {}
    if not isinstance(qc, dict):
        raise QuantConfigError(f"quantization_config must be a dict, got {type(qc).__name__}")
    if num_layers is None and _is_int(top.get("num_hidden_layers")):
        num_layers = top["num_hidden_layers"]

    said = []
    native = None                 # the experts' own format, as the base checkpoint declares it
    for key in ("expert_dtype", "expert_format"):
        for d in (top, qc):
            if d.get(key) is not None:
                fmt = _expert_name(d[key], f"checkpoint {key}")
                if native is not None and fmt != native:
                    raise QuantConfigError(f"checkpoint metadata contradicts itself: experts {native!r} and "
                                           f"{key} {d[key]!r}")
                native = fmt
                said.append(f"{key} {d[key]!r}")
    method = str(qc.get("quant_method") or "").strip().lower().replace("-", "_")
    if method:
        said.insert(0, f"quant_method {qc.get('quant_method')!r}")
    where = "checkpoint metadata" + (f" ({', '.join(dict.fromkeys(said))})" if said else "")

    def one(experts, dense):
        if native is not None and experts is not None and native != experts:
            raise QuantConfigError(f"checkpoint metadata contradicts itself: quant_method {method!r} means "
                                   f"{experts} experts but it also declares {native!r}")
        return experts, dense, where

    if not method:
        return native, None, where
    if method == "fp8":
        # DeepSeek's reference code: experts follow the dense format unless expert_dtype says fp4
        return native or "fp8", _fp8_dense(qc), where
    if method == "mxfp4":
        return one("mxfp4", BF16)
    if method in ("bf16", "none", "unquantized"):
        return one("bf16", BF16)
    if method in ("nvfp4", "modelopt_fp4", "modelopt"):
        algo = str(qc.get("quant_algo") or ("NVFP4" if method != "modelopt" else "")).upper()
        if algo != "NVFP4":
            raise QuantConfigError(f"quantization_config: modelopt quant_algo {qc.get('quant_algo')!r} is not read "
                                   "(dsv4lab reads NVFP4)")
        if qc.get("group_size") not in (None, 16):
            raise QuantConfigError(f"quantization_config: NVFP4 group_size must be 16, got {qc['group_size']!r}")
        where = where[:-1] + f", quant_algo {algo!r})"
        patterns = qc.get("exclude_modules", qc.get("ignore"))
        if patterns is None:          # no exclude list: read as the routed experts only
            return one("nvfp4", BF16)
        expert_names, dense_names = _module_names(layer, num_layers)
        # ModelOpt re-quantises what it does not exclude; what it excludes keeps the format
        # the base checkpoint declares (its expert_dtype; bf16 when it declares none)
        experts = (native or "bf16") if _matches(patterns, expert_names) else "nvfp4"
        if not _matches(patterns, dense_names):
            raise QuantConfigError(f"quantization_config: modelopt quantises the {layer} layer's dense projections "
                                   "to NVFP4 (they are not in exclude_modules); dsv4lab reads bf16 or fp8 e4m3 "
                                   "dense weights")
        return experts, BF16, where
    raise QuantConfigError(f"quantization_config: unknown quant_method {qc.get('quant_method')!r} "
                           "(expected fp8, modelopt, modelopt_fp4, mxfp4, nvfp4 or bf16)")


def resolve_formats(metadata: dict | None = None, *, layer: str = "main", experts: str | None = None,
                    dense: str | None = None, num_layers: int | None = None) -> LayerFormats:
    """How ``layer``'s ("main" or "mtp") weights are stored, from checkpoint metadata and/or flags.

    ``metadata``: a whole config.json dict, its ``quantization_config``, ModelOpt's
    hf_quant_config.json, or dsv4lab's own ``{"expert_format": ...}``. ``experts``
    ("mxfp4", "nvfp4", "bf16"; "fp4" and "modelopt_fp4" too) and ``dense`` ("bf16", "fp8")
    are flags. Where both speak they must agree, else :class:`QuantConfigError` naming both;
    neither: bf16 (an unquantised checkpoint). ``num_layers`` (else the metadata's
    ``num_hidden_layers``) names the MTP layer in Hugging Face spellings of ModelOpt's
    exclude list. FP8 experts (``quant_method`` fp8 without ``expert_dtype`` fp4) are refused:
    the MoE reads mxfp4, nvfp4 or bf16 experts.
    """
    if layer not in LAYERS:
        raise ValueError(f"layer must be 'main' or 'mtp', got {layer!r}")
    meta_experts, meta_dense, where = _declared(metadata, layer, num_layers)
    flag_experts = _expert_name(experts, "the experts flag")
    flag_dense = _dense_name(dense, "the dense-weights flag")
    if meta_experts and flag_experts and meta_experts != flag_experts:
        raise QuantConfigError(
            f"expert format conflict on the {layer} layer: the {where} says {meta_experts!r} but the flag "
            f"says {flag_experts!r}; drop the flag or use a checkpoint quantised as {flag_experts!r}")
    if meta_dense and flag_dense and meta_dense.dtype != flag_dense.dtype:
        raise QuantConfigError(
            f"dense-weight format conflict on the {layer} layer: the {where} says {meta_dense.describe()!r} "
            f"but the flag says {flag_dense.describe()!r}")
    fmt = meta_experts or flag_experts or "bf16"
    if fmt == "fp8":
        raise QuantConfigError(f"the {layer} layer's experts are FP8 ({where or 'flag'}): the MoE reads mxfp4, "
                               "nvfp4 or bf16 experts (the released checkpoint declares expert_dtype 'fp4')")
    parts = []
    if meta_experts or meta_dense:
        parts.append(where + (" (flag agrees)" if flag_experts or flag_dense else ""))
    if (flag_experts and not meta_experts) or (flag_dense and not meta_dense):
        parts.append("flag")
    source = " + ".join(parts) or "default (no quantization declared, no flag)"
    return LayerFormats(layer, fmt, meta_dense or flag_dense or BF16, source)


# ---- config.json -------------------------------------------------------------------------

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
_OPTIONAL = {"rms_norm_eps": "rms_norm_eps", "rope_theta": "rope_theta", "hc_eps": "hc_eps"}
_ALIASES = {"window_size": "sliding_window"}
_KEY_OF = {f: k for k, f in {**_HF_KEYS, **_OPTIONAL}.items()}      # field -> config.json key
_QUANT_KEYS = ("quantization_config", "expert_dtype", "expert_format")


def _key(name: str) -> str:
    """The config.json key of field ``name`` (and the field, where they differ)."""
    k = _KEY_OF.get(name, name)
    return k if k == name else f"{k} (DSV4Config.{name})"


def from_hf_config(hf: dict, *, experts: str | None = None, dense: str | None = None) -> DSV4Config:
    """Build a DSV4Config from a Hugging Face style config.json dict.

    Reads the released DeepSeek-V4-Flash config.json as it is (its ``quantization_config``
    and ``expert_dtype`` through :func:`resolve_formats`, for the main and the MTP layer;
    ``experts`` and ``dense`` are the flags). Missing keys, values out of range and
    contradictions (head_dim not rope + nope, a compress_ratios list of the wrong length, a
    ratio outside {0, 4, 128}, top-k over the expert count, ...) raise ValueError naming the key.
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
    ratios = kw["compress_ratios"]
    if not isinstance(ratios, (list, tuple)) or not all(_is_int(r) for r in ratios):
        raise ValueError(f"compress_ratios must be a list of integers, got {ratios!r}")
    n = kw["num_layers"] if _is_int(kw["num_layers"]) else None
    main = resolve_formats(hf, layer="main", experts=experts, dense=dense, num_layers=n)
    mtp = resolve_formats(hf, layer="mtp", experts=experts, dense=dense, num_layers=n)
    kw.update(expert_format=main.experts, dense_format=main.dense,
              mtp_expert_format="" if mtp.experts == main.experts else mtp.experts,
              mtp_dense_format=None if mtp.dense == main.dense else mtp.dense)
    kw["name"] = str(hf.get("_name_or_path") or hf.get("model_type") or "hf")
    kw["extra"] = {k: v for k, v in hf.items()
                   if k not in _HF_KEYS and k not in _OPTIONAL and k not in _QUANT_KEYS}
    kw["extra"].update({k: hf[k] for k in _QUANT_KEYS if k in hf})
    if "nope_head_dim" in hf or "qk_nope_head_dim" in hf:
        nope = hf.get("qk_nope_head_dim", hf.get("nope_head_dim"))
        if nope is not None and nope + kw["rope_dim"] != kw["head_dim"]:
            raise ValueError(
                f"qk_nope_head_dim ({nope}) + qk_rope_head_dim ({kw['rope_dim']}) "
                f"must equal head_dim ({kw['head_dim']})")
    for key in ("num_key_value_heads",):
        if key in hf and hf[key] != 1:
            raise ValueError(f"{key} must be 1 (one shared latent KV head), got {hf[key]!r}")
    return validate(DSV4Config(**kw))


_POSITIVE_INTS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "q_lora_rank",
                  "o_groups", "o_lora_rank", "window_size", "index_n_heads", "index_head_dim",
                  "index_topk", "n_routed_experts", "n_experts_per_tok", "moe_intermediate_size",
                  "hc_mult", "hc_sinkhorn_iters", "max_position_embeddings")
_COUNTS = ("n_shared_experts", "n_hash_layers", "num_mtp_layers")          # >= 0
_POSITIVE_FLOATS = ("routed_scaling_factor", "swiglu_limit", "rope_theta")
_EPSILONS = ("rms_norm_eps", "hc_eps")                                      # in (0, 1)
RATIOS = (0, 4, 128)          # window only, CSA (with the indexer), HCA


def validate(cfg: DSV4Config) -> DSV4Config:
    """Raise ValueError naming the first field (by its config.json key) out of range or
    inconsistent with another."""
    def bad(msg):
        raise ValueError(msg)

    for name in _POSITIVE_INTS:
        v = getattr(cfg, name)
        if not _is_int(v) or v <= 0:
            bad(f"{_key(name)} must be a positive integer, got {v!r}")
    for name in _COUNTS:
        v = getattr(cfg, name)
        if not _is_int(v) or v < 0:
            bad(f"{_key(name)} must be a non-negative integer, got {v!r}")
    for name in _POSITIVE_FLOATS:
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            bad(f"{_key(name)} must be a positive finite number, got {v!r}")
    for name in _EPSILONS:
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1:
            bad(f"{_key(name)} must be in (0, 1), got {v!r}")
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
    wrong = sorted({r for r in cfg.compress_ratios if r not in RATIOS}, key=str)
    if wrong:
        bad(f"compress_ratios entries must be 0, 4 or 128, got {wrong}")
    if cfg.n_experts_per_tok > cfg.n_routed_experts:
        bad(f"num_experts_per_tok ({cfg.n_experts_per_tok}) exceeds n_routed_experts ({cfg.n_routed_experts})")
    if cfg.n_hash_layers > cfg.num_layers:
        bad(f"num_hash_layers ({cfg.n_hash_layers}) exceeds num_hidden_layers ({cfg.num_layers})")
    if cfg.score_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
        bad(f"scoring_func must be sqrtsoftplus, sigmoid or softmax, got {cfg.score_func!r}")
    if cfg.hidden_size % 32 or cfg.moe_intermediate_size % 32:
        bad("hidden_size and moe_intermediate_size must be multiples of 32 (MXFP4 blocks)")
    if cfg.expert_format not in EXPERT_FORMATS:
        bad(f"expert_format must be one of {', '.join(EXPERT_FORMATS)}, got {cfg.expert_format!r}")
    if cfg.mtp_expert_format not in ("",) + EXPERT_FORMATS:
        bad(f"mtp_expert_format must be '' or one of {', '.join(EXPERT_FORMATS)}, got {cfg.mtp_expert_format!r}")
    for name in ("dense_format", "mtp_dense_format"):
        v = getattr(cfg, name)
        if not (isinstance(v, DenseFormat) or (v is None and name == "mtp_dense_format")):
            bad(f"{name} must be a DenseFormat, got {v!r}")
    return cfg
