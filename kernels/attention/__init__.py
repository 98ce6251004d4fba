"""Sparse MLA decode kernels: the SIMT baseline, the portable tensor-core kernel, the sm_90
warp-specialised fast path, and the dispatch table that picks between them."""
