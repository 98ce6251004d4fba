"""Shared test setup: the Triton interpreter switch and the `gpu` marker.

``import dsv4lab`` runs first so that TRITON_INTERPRET=1 is set (on a machine without a
GPU) before any test module imports triton. Tests marked ``gpu`` are skipped without
CUDA. The markers themselves are declared in pyproject.toml.
"""
import dsv4lab  # noqa: F401  (must come before anything imports triton)

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
