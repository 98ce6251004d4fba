"""DeepSeek-V4 in small, flat torch (gpt-fast style), read in this order:

- :mod:`~dsv4lab.model.layers`: RMSNorm, RoPE, the mHC hyper-connections, the linear layers
  (float, or block-scaled FP8 as the released checkpoint stores them);
- :mod:`~dsv4lab.model.cache`: the paged cache and where each new token goes;
- :mod:`~dsv4lab.model.attention`: low-rank queries, one shared latent KV, sliding window +
  compressed entries, the lightning indexer;
- :mod:`~dsv4lab.model.moe`: the router, routed (float, MXFP4 or NVFP4) and shared experts;
- :mod:`~dsv4lab.model.dsv4`: the decoder block, the MTP draft layer, the model;
- :mod:`~dsv4lab.model.checkpoint`: save and load in the workbook's own one-file format
  (the released checkpoint's sharded layout is :mod:`dsv4lab.checkpoint`).

Every module has two forwards: ``forward_train`` (full sequences, differentiable torch: the
reference) and ``forward_decode`` (a few new tokens against the paged cache through
:mod:`dsv4lab.ops`, no host synchronisation, one CUDA graph can hold a step). The facts it
implements are DESIGN.md's "DeepSeek-V4-Flash facts".

Explained in notebooks/05_mtp_speculative.ipynb.
"""
from dsv4lab.model.attention import Attention, Compressor, Indexer
from dsv4lab.model.cache import DecodeMeta, LayerCache, compress_overlap, flat, make_meta
from dsv4lab.model.checkpoint import config_from_json, config_to_json, load_checkpoint, save_checkpoint
from dsv4lab.model.dsv4 import (COMPONENTS, DSV4, FP8_PROJECTIONS, MTP, OPS, PROJECTIONS, Block, projections_of,
                                set_projections_, shared_clone, tiny_config, to_dtype)
from dsv4lab.model.layers import (FP8_BLOCK, BlockScaledFP8Linear, HCHead, HyperConnection, RMSNorm, apply_linear,
                                  expand_block_scale, fp8_block_quantize, linear_as, make_linear, rms_norm,
                                  rope_tail)
from dsv4lab.model.moe import EXPERT_FORMATS, MLP, MoE

__all__ = [
    "Attention", "Compressor", "Indexer",
    "DecodeMeta", "LayerCache", "compress_overlap", "flat", "make_meta",
    "config_from_json", "config_to_json", "load_checkpoint", "save_checkpoint",
    "COMPONENTS", "DSV4", "FP8_PROJECTIONS", "MTP", "OPS", "PROJECTIONS", "Block", "projections_of",
    "set_projections_", "shared_clone", "tiny_config", "to_dtype",
    "FP8_BLOCK", "BlockScaledFP8Linear", "HCHead", "HyperConnection", "RMSNorm", "apply_linear",
    "expand_block_scale", "fp8_block_quantize", "linear_as", "make_linear", "rms_norm", "rope_tail",
    "EXPERT_FORMATS", "MLP", "MoE",
]
