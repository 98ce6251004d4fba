"""DeepSeek-V4's released checkpoint: read it lazily into dsv4lab.model, write one like it.

A checkpoint is a directory: ``config.json`` (read by
:meth:`dsv4lab.config.DSV4Config.from_hf_config`; its ``quantization_config`` and
``expert_dtype`` through :func:`dsv4lab.config.resolve_formats`, for the main layers and the
MTP layer alike), ``model.safetensors.index.json`` and its safetensors shards. Only
safetensors are read.

- :class:`Checkpoint` (:mod:`~dsv4lab.checkpoint.reader`): ``Checkpoint(path).block(3)`` loads
  main layer 3 as a :class:`dsv4lab.model.Block` without reading any other tensor;
  ``.mtp()``, ``.embedding()``, ``.head()`` and ``.model()`` the other parts. FP8 projections
  keep their e4m3 weights and scales (:class:`dsv4lab.model.BlockScaledFP8Linear`), FP4
  experts stay packed as stored (MXFP4: nibbles + E8M0 bytes; NVFP4: nibbles, e4m3 scales,
  an fp32 global per expert). Every tensor is checked once where it is loaded
  (:func:`~dsv4lab.checkpoint.layout.check`), so the decode step runs its ops without value
  checks. Errors (:class:`CheckpointError`, a ValueError) name the tensor or shard: missing,
  unexpected, wrong shape or dtype, bad values, unsupported format, unreadable shard.
- :func:`load_draft`: the speculative draft (the MTP layer with the main model's embedding
  and head), its MoE format and backend resolved by
  :func:`dsv4lab.backends.resolve_moe_backend` (``role="draft"``).
- :func:`write_checkpoint` (:mod:`~dsv4lab.checkpoint.writer`): a model in the released
  layout ("fp8": DeepSeek's formats; "nvfp4": ModelOpt's); :func:`write_tiny_checkpoint` a
  small one at the mini model's sizes.

The names, read off the public loaders of ``DeepseekV4ForCausalLM`` (vLLM's
``deepseek_v4.py`` and ``deepseek_v4_mtp.py``) and the released shards' headers, and the
dsv4lab parameters they fill (``P`` = ``layers.{i}.`` for main layer i, ``mtp.0.`` for the
MTP layer, whose block is ``MTP.block``; FP8 = e4m3 ``.weight`` + ue8m0 ``.scale`` per
128 x 128 block in the fp8 format, a bf16 ``.weight`` in the nvfp4 one):

==========================================  ==========================================  ==================
checkpoint                                  dsv4lab                                     stored as
==========================================  ==========================================  ==================
embed.weight                                DSV4.embed.weight                           bf16 [V, d]
head.weight                                 DSV4.head.weight                            bf16 [V, d]
norm.weight                                 DSV4.norm.weight                            bf16 [d]
hc_head_fn, hc_head_base, hc_head_scale     DSV4.hc_head.fn (times the scale), .base    fp32
P attn_norm.weight, P ffn_norm.weight       Block.attn_norm / ffn_norm .weight          bf16 [d]
P hc_attn_fn / _base / _scale               Block.hc_attn.fn / .base / .scale           fp32
P hc_ffn_fn / _base / _scale                Block.hc_ffn.fn / .base / .scale            fp32
P attn.wq_a                                 Attention.wq_a                              FP8 [q_lora, d]
P attn.q_norm.weight                        Attention.q_norm.weight                     bf16
P attn.wq_b                                 Attention.wq_b                              FP8 [H*D, q_lora]
P attn.wkv, P attn.kv_norm.weight           Attention.wkv, .kv_norm.weight              FP8 [D, d], bf16
P attn.attn_sink                            Attention.attn_sink                         fp32 [H]
P attn.wo_a                                 Attention.wo_a (groups of o_lora rows)      FP8 [G*o_lora, H/G*D]
P attn.wo_b                                 Attention.wo_b                              FP8 [d, G*o_lora]
P attn.compressor.wkv / .wgate .weight      Attention.compressor.wkv / .wgate           bf16 [2D, d] (ratio 4), [D, d]
P attn.compressor.ape, .norm.weight         Attention.compressor.ape, .norm.weight      fp32 [r, 2D or D], bf16
P attn.indexer.wq_b                         Attention.indexer.wq                        FP8 [Hi*Di, q_lora]
P attn.indexer.weights_proj.weight          Attention.indexer.wweights.weight           bf16 [Hi, d]
P attn.indexer.compressor.*                 Attention.indexer.compressor.*              bf16 [2Di, d], fp32 ape
P ffn.gate.weight                           MoE.gate.weight                             bf16 [E, d]
P ffn.gate.bias (learned-routing layers)    MoE.bias (selection only)                   fp32 [E]
P ffn.gate.tid2eid (hash layers)            MoE.tid2eid                                 int [V, k]
P ffn.experts.{e}.w1 / .w3 / .w2            MoE.w13[e] (w1 rows, w3 rows), MoE.w2[e]    MXFP4: int8 [N, K/2] + E8M0
                                                                                        .scale [N, K/32]; NVFP4: uint8,
                                                                                        .weight_scale e4m3 [N, K/16],
                                                                                        .weight_scale_2 fp32
P ffn.shared_experts.w1 / .w3 / .w2         MoE.shared (MLP.w1, .w3, .w2)               FP8
mtp.0.enorm / hnorm / norm .weight          MTP.enorm / .hnorm / .norm .weight          bf16 [d]
mtp.0.e_proj, mtp.0.h_proj                  MTP.e_proj, MTP.h_proj                      FP8 [d, d]
mtp.0.hc_head_fn / _base / _scale           MTP.hc_head.fn (times the scale), .base     fp32
==========================================  ==========================================  ==================

Where dsv4lab's layer computes differently from DeepSeek's reference inference code (the
weights load the same; the outputs are not the reference's): RoPE uses ``rope_theta``
everywhere, without YaRN scaling or the compressed layers' ``compress_rope_theta``
(config.json's ``rope_scaling`` and ``compress_rope_theta`` are read and not applied); the
indexer's keys and queries are not Hadamard-rotated, and activations are not rounded to FP8
or FP4 between ops.
"""
from dsv4lab.checkpoint.layout import CheckpointError, Spec, block_slots, check, head_slots, mtp_slots
from dsv4lab.checkpoint.reader import Checkpoint, Draft, DraftModel, load_draft, open_checkpoint
from dsv4lab.checkpoint.writer import (FORMATS, config_json, tiny_release_config, tiny_release_model,
                                       write_checkpoint, write_tiny_checkpoint)

__all__ = ["Checkpoint", "CheckpointError", "Draft", "DraftModel", "FORMATS", "Spec", "block_slots", "check",
           "config_json", "head_slots", "load_draft", "mtp_slots", "open_checkpoint", "tiny_release_config",
           "tiny_release_model", "write_checkpoint", "write_tiny_checkpoint"]
