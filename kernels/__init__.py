"""Triton kernels, one folder or module per family (imported as dsv4lab.kernels).

Each family holds its lesson kernel (portable Triton, read top-down), at most the fast paths
the recorded rows show winning, and one dispatch table. Kernel modules import triton, torch
and dsv4lab.kernels only.
"""
