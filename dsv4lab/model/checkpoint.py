"""Checkpoints in the workbook's own format: one safetensors file, the state dict (packed
experts as uint8, FP8 projections as e4m3 with fp32 scales) and the config in its metadata.
The released checkpoint's sharded layout is :mod:`dsv4lab.checkpoint`.

:func:`save_checkpoint` writes a temporary file beside the target and renames it only once
it is complete, so an interrupted save never leaves a torn checkpoint in place of a good one.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import torch

from dsv4lab.config import DSV4Config
from dsv4lab.model.dsv4 import DSV4, to_dtype


def config_to_json(cfg: DSV4Config) -> str:
    d = asdict(cfg)
    d["compress_ratios"] = list(cfg.compress_ratios)
    return json.dumps(d)


def config_from_json(s: str) -> DSV4Config:
    d = json.loads(s)
    d["compress_ratios"] = tuple(d["compress_ratios"])
    return DSV4Config(**d)


def save_checkpoint(model: DSV4, path, metadata: dict | None = None) -> None:
    """Write ``model`` to ``path`` (safetensors; the config and expert format in the metadata,
    with ``metadata``'s entries, JSON-encoded unless strings). Atomic: a temporary file in the
    same directory, renamed over ``path`` when complete."""
    from safetensors.torch import save_file

    meta = {"config": config_to_json(model.cfg), "expert_format": model.expert_format,
            "projections": model.projections}
    meta.update({k: v if isinstance(v, str) else json.dumps(v) for k, v in (metadata or {}).items()})
    sd = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(sd, str(tmp), metadata=meta)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load_checkpoint(path, *, device=None, dtype: torch.dtype | None = None) -> DSV4:
    """Load a checkpoint written by :func:`save_checkpoint` (floats cast to ``dtype``)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    cfg = config_from_json(meta["config"])
    fmt = meta.get("expert_format", "bf16")
    model = DSV4(cfg)
    if fmt != "bf16":
        model.quantize_experts(fmt)
    if meta.get("projections", "bf16") != "bf16":
        model.quantize_projections(meta["projections"])
    sd = load_file(str(path))
    model.load_state_dict(sd)
    model.checkpoint_metadata = meta
    if dtype is not None:
        to_dtype(model, dtype)
    return model.to(device) if device is not None else model
