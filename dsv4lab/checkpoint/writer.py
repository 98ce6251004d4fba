"""Writing a checkpoint in the released layout, and the tiny one the tests and users start from.

:func:`write_checkpoint` writes a :class:`dsv4lab.model.DSV4` as DeepSeek's checkpoint is laid
out: ``config.json`` (the released keys; the quantisation declared as the model stores its
weights), ``model.safetensors.index.json`` and ``shards`` files
``model-0000i-of-0000n.safetensors`` (tensors in model order, split by bytes, so a layer may
straddle two shards as in the release). Two formats are written:

- "fp8": the released one. Dense projections FP8 e4m3 + ue8m0 scales per 128 x 128 block,
  routed experts MXFP4 (``"expert_dtype": "fp4"``), ``quantization_config`` as released;
- "nvfp4": NVIDIA ModelOpt's re-quantisation. The main layers' routed experts NVFP4
  (``.weight``, ``.weight_scale`` e4m3 per 16, ``.weight_scale_2`` fp32 global); what
  ModelOpt excludes (attention, router, shared expert, the MTP layer) keeps its unquantised
  format: dense projections bf16, the MTP layer's experts MXFP4.

:func:`tiny_release_model` builds a model of :func:`tiny_release_config` (the mini model's
sizes, two layers of each attention kind plus the MTP layer, the released structure) in
either format, its stored floats already rounded to bf16 so that it equals what a reader
loads from its checkpoint; :func:`write_tiny_checkpoint` writes it.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from dsv4lab import quant
from dsv4lab.config import BF16, FP8_BLOCK, DSV4Config
from dsv4lab.checkpoint.layout import CheckpointError, block_slots, embed_slots, head_slots, mtp_slots
from dsv4lab.checkpoint.reader import INDEX
from dsv4lab.model import DSV4, HCHead, HyperConnection, MoE

FORMATS = ("fp8", "nvfp4")

# the released config.json's keys beyond the model's sizes, with their values
_CONSTANTS = {"architectures": ["DeepseekV4ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
              "bos_token_id": 0, "eos_token_id": 1, "compress_rope_theta": 160000, "hidden_act": "silu",
              "initializer_range": 0.02, "model_type": "deepseek_v4", "norm_topk_prob": True,
              "num_key_value_heads": 1, "tie_word_embeddings": False, "topk_method": "noaux_tc",
              "torch_dtype": "bfloat16", "use_cache": True}
# config.json key -> DSV4Config field
_SIZES = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_hidden_layers": "num_layers",
          "num_attention_heads": "num_heads", "head_dim": "head_dim", "qk_rope_head_dim": "rope_dim",
          "q_lora_rank": "q_lora_rank", "o_groups": "o_groups", "o_lora_rank": "o_lora_rank",
          "sliding_window": "window_size", "compress_ratios": "compress_ratios", "index_n_heads": "index_n_heads",
          "index_head_dim": "index_head_dim", "index_topk": "index_topk", "n_routed_experts": "n_routed_experts",
          "num_experts_per_tok": "n_experts_per_tok", "n_shared_experts": "n_shared_experts",
          "moe_intermediate_size": "moe_intermediate_size", "routed_scaling_factor": "routed_scaling_factor",
          "scoring_func": "score_func", "num_hash_layers": "n_hash_layers", "swiglu_limit": "swiglu_limit",
          "hc_mult": "hc_mult", "hc_sinkhorn_iters": "hc_sinkhorn_iters", "hc_eps": "hc_eps",
          "num_nextn_predict_layers": "num_mtp_layers", "max_position_embeddings": "max_position_embeddings",
          "rms_norm_eps": "rms_norm_eps", "rope_theta": "rope_theta"}
FP8_QUANTIZATION = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
                    "weight_block_size": [128, 128]}


def modelopt_quantization(num_layers: int) -> dict:
    """ModelOpt's NVFP4 ``quantization_config``: the routed experts of the main layers only."""
    return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None,
            "producer": {"name": "dsv4lab"},
            "exclude_modules": ["lm_head", "model.embed_tokens", "model.layers.*.self_attn*", "model.layers.*.mlp.gate",
                                "model.layers.*.mlp.shared_experts*", f"model.layers.{num_layers}*", "mtp*"]}


def config_json(cfg: DSV4Config, fmt: str | None) -> dict:
    """The config.json of ``cfg`` with the released keys (:data:`_CONSTANTS` and the sizes),
    declaring ``fmt`` ("fp8", "nvfp4", or None: unquantised)."""
    out = dict(_CONSTANTS)
    for key, f in _SIZES.items():
        v = getattr(cfg, f)
        out[key] = list(v) if isinstance(v, tuple) else v
    out["rope_scaling"] = {"beta_fast": 32, "beta_slow": 1, "factor": 16,
                           "original_max_position_embeddings": max(1, cfg.max_position_embeddings // 16),
                           "type": "yarn"}
    if fmt is not None:
        out["expert_dtype"] = "fp4"
        out["quantization_config"] = (FP8_QUANTIZATION if fmt == "fp8" else modelopt_quantization(cfg.num_layers))
    return dict(sorted(out.items()))


def _formats_of(model: DSV4) -> tuple[str, str, str, str]:
    """(main experts, main projections, MTP experts, MTP projections) as the model stores them."""
    from dsv4lab.model import projections_of
    main_e = model.layers[0].moe.fmt
    if any(b.moe.fmt != main_e for b in model.layers):
        raise CheckpointError("the model's main layers store their experts in different formats")
    main_p = projections_of(model.layers)
    mtp = model.mtp[0] if len(model.mtp) else None
    return main_e, main_p, (mtp.block.moe.fmt if mtp else main_e), (projections_of(mtp) if mtp else main_p)


def declared_format(model: DSV4) -> str | None:
    """Which of :data:`FORMATS` the model's weights are in (None: all bf16); CheckpointError
    for a mix the released layouts do not have."""
    got = _formats_of(model)
    if got == ("mxfp4", "fp8", "mxfp4", "fp8"):
        return "fp8"
    if got == ("nvfp4", "bf16", "mxfp4", "bf16"):
        return "nvfp4"
    if got == ("bf16", "bf16", "bf16", "bf16"):
        return None
    raise CheckpointError(f"the model stores (main experts, main projections, MTP experts, MTP projections) as {got}: "
                          "the released layouts are ('mxfp4', 'fp8', 'mxfp4', 'fp8') (DeepSeek) and ('nvfp4', "
                          "'bf16', 'mxfp4', 'bf16') (ModelOpt NVFP4)")


def model_tensors(model: DSV4, config: dict) -> dict:
    """{checkpoint name: tensor} of ``model`` as ``config`` declares its formats (model order)."""
    cfg = DSV4Config.from_hf_config(config).replace(extra=model.cfg.extra)
    main, mtp = cfg.formats("main"), cfg.formats("mtp")
    slots = list(embed_slots(cfg))
    for i in range(cfg.num_layers):
        slots += block_slots(cfg, i, main, f"layers.{i}.", f"layers.{i}.")
    if len(model.mtp):
        slots += mtp_slots(cfg, mtp, 0, "mtp.0.")
    slots += head_slots(cfg)
    out = {}
    for slot in slots:
        for name, t in slot.write(model).items():
            out[name] = t.detach().to("cpu").contiguous().clone()
    return out


def write_checkpoint(model: DSV4, path, *, shards: int = 3) -> Path:
    """Write ``model`` to directory ``path`` in the released layout (module docstring); returns
    the path. Each shard is written to a temporary file and renamed; the index last."""
    from safetensors.torch import save_file

    fmt = declared_format(model)
    config = config_json(model.cfg, fmt)
    tensors = model_tensors(model, config)
    if shards < 1 or shards > len(tensors):
        raise ValueError(f"shards must be in [1, {len(tensors)}], got {shards}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    groups, acc = [[] for _ in range(shards)], 0
    for name, t in tensors.items():
        k = min(shards - 1, acc * shards // max(total, 1))
        groups[k].append(name)
        acc += t.numel() * t.element_size()
    groups = [g for g in groups if g]
    weight_map = {}
    for i, names in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tmp = path / f".{fname}.{os.getpid()}.tmp"
        save_file({n: tensors[n] for n in names}, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, path / fname)
        weight_map.update({n: fname for n in names})
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    tmp = path / f".{INDEX}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(index, indent=2) + "\n")
    os.replace(tmp, path / INDEX)
    return path


# ---- the tiny checkpoint ------------------------------------------------------------------------

def tiny_release_config() -> DSV4Config:
    """The mini model's sizes in the released structure: six layers, two of each attention
    kind (ratio 0, 4, 128; the first three hash-routed as in Flash), the MTP layer (window
    only), overlapping ratio-4 compressors, FP8 dense projections."""
    return DSV4Config.mini().replace(
        name="deepseek_v4", num_layers=6, compress_ratios=(0, 0, 4, 128, 4, 128, 0), n_hash_layers=3,
        dense_format=FP8_BLOCK, extra={"compress_overlap": True})


def _nvfp4_per_expert(moe: MoE) -> None:
    """NVFP4 experts with one global scale per expert (as ModelOpt stores them)."""
    w13, w2 = moe.w13.detach().float(), moe.w2.detach().float()
    q13 = [quant.nvfp4_quantize(w) for w in w13]
    q2 = [quant.nvfp4_quantize(w) for w in w2]
    st = lambda qs, j: torch.stack([q[j] for q in qs])  # noqa: E731
    moe._set_quantized("nvfp4", st(q13, 0), st(q13, 1), st(q2, 0), st(q2, 1), st(q13, 2), st(q2, 2))


@torch.no_grad()
def tiny_release_model(fmt: str = "fp8", *, seed: int = 0, cfg: DSV4Config | None = None) -> DSV4:
    """A random model of ``cfg`` (default :func:`tiny_release_config`) in ``fmt`` ("fp8": the
    released formats; "nvfp4": ModelOpt's), every parameter non-trivial (norms, sinks, apes
    and router biases drawn, not left at 1 or 0) and every float the checkpoint stores in bf16
    rounded to bf16 (held in fp32): it equals the model read back from its checkpoint."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    cfg = cfg or tiny_release_config()
    if fmt == "nvfp4":
        cfg = cfg.replace(expert_format="nvfp4", mtp_expert_format="mxfp4", dense_format=BF16)
    torch.manual_seed(seed)
    m = DSV4(cfg).eval()
    for name, p in m.named_parameters():
        if name.endswith("norm.weight"):
            p.uniform_(0.5, 1.5)
        elif name.endswith(("ape", "attn_sink")):
            p.normal_(0.0, 0.5)
    for mod in m.modules():
        if isinstance(mod, MoE) and not mod.hashed:
            mod.bias.normal_(0.0, 0.05)
    keep = {id(p) for mod in m.modules() if isinstance(mod, (HyperConnection, HCHead)) for p in mod.parameters()}
    for name, p in m.named_parameters():
        if id(p) not in keep and not name.endswith(("ape", "attn_sink")):
            p.data = p.data.to(torch.bfloat16).float()
    if fmt == "fp8":
        m.quantize_experts("mxfp4")
        m.quantize_projections("fp8")
    else:
        for blk in m.layers:
            _nvfp4_per_expert(blk.moe)
        for mtp in m.mtp:
            mtp.block.moe.quantize_("mxfp4")
    for p in m.parameters():
        p.requires_grad_(False)
    return m


def write_tiny_checkpoint(path, fmt: str = "fp8", *, shards: int = 3, seed: int = 0) -> Path:
    """:func:`tiny_release_model` ``(fmt, seed=seed)`` written to ``path`` (about 3 MB in three shards)."""
    return write_checkpoint(tiny_release_model(fmt, seed=seed), path, shards=shards)
