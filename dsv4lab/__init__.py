"""dsv4lab: DeepSeek-V4-Flash decode, made fast kernel by kernel.

The tour of the whole workbook is notebooks/00_tour.ipynb.
"""
from dsv4lab import runtime as _runtime

_runtime.configure()  # before anything imports triton

__version__ = "0.1.0"
