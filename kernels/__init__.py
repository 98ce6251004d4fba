"""Triton kernels, one module per family. They import triton and torch only."""
