"""The public ops: input checks, backend selection, and the fp32 torch references.

Each op checks its inputs (ValueError naming the argument), resolves a backend through
:mod:`dsv4lab.backends`, and calls either the torch reference next to it or a kernel in
:mod:`dsv4lab.kernels`.
"""
from dsv4lab.ops.attention import sparse_mla_decode
from dsv4lab.ops.indexer import indexer_logits, indexer_topk, to_cache_slots
from dsv4lab.ops.linear import linear
from dsv4lab.ops.mhc import mhc_head, mhc_post, mhc_pre
from dsv4lab.ops.moe import fused_moe, hash_route, route
from dsv4lab.ops import moe_peers  # noqa: F401  (registers fused_moe's external "triton_kernels")
from dsv4lab.ops import flash_mla  # noqa: F401  (registers sparse_mla_decode's external "flash_mla")

__all__ = ["sparse_mla_decode", "indexer_logits", "indexer_topk", "to_cache_slots",
           "route", "hash_route", "fused_moe", "mhc_pre", "mhc_post", "mhc_head", "linear"]
