"""Reading a checkpoint in the released layout, lazily: only the tensors of the parts asked for.

:class:`Checkpoint` opens a directory (``config.json``, ``model.safetensors.index.json`` and
its shards, or one ``model.safetensors``) without reading any weight; each shard is opened
with safetensors' ``safe_open`` when a tensor in it is first needed, and each tensor is read
on its own (``get_tensor``), checked (:func:`dsv4lab.checkpoint.layout.check`) and put in
place. A module is first built on the ``meta`` device (no memory), then every parameter is
replaced by its checkpoint tensor, so a 43-layer model's single layer costs that layer's
bytes only.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from dsv4lab import backends as B
from dsv4lab import ops  # noqa: F401  (registers the ops' backends: resolve_moe_backend needs them)
from dsv4lab.config import DSV4Config
from dsv4lab.checkpoint.layout import (CheckpointError, Slot, Spec, block_slots, check, embed_slots, head_slots,
                                       mtp_slots)
from dsv4lab.model import DSV4, MTP, Block, HCHead, RMSNorm, to_dtype

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_OTHER_FORMATS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf")


class Checkpoint:
    """A released-layout checkpoint directory, opened lazily.

    ``ckpt = Checkpoint(path)`` reads config.json (``ckpt.config``, ``ckpt.cfg`` through
    :meth:`dsv4lab.config.DSV4Config.from_hf_config`, ``ckpt.formats`` for the main and MTP
    layers through :func:`dsv4lab.config.resolve_formats`) and the index. ``ckpt.block(3)``,
    ``ckpt.mtp()``, ``ckpt.embedding()``, ``ckpt.head()`` and ``ckpt.model()`` load parts.
    What is wrong with the checkpoint raises :class:`CheckpointError` (a ValueError) naming
    the tensor or file; a bad argument (a layer index out of range) a ValueError.
    """

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: not a directory (a checkpoint is a directory holding "
                                  f"config.json and safetensors shards)")
        cfg_file = self.path / "config.json"
        if not cfg_file.is_file():
            raise CheckpointError(f"{self.path}: no config.json")
        try:
            self.config = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{cfg_file}: not valid JSON ({e})") from None
        self.weight_map = self._index()
        for shard in sorted(set(self.weight_map.values())):
            if not (self.path / shard).is_file():
                first = next(n for n, s in self.weight_map.items() if s == shard)
                raise CheckpointError(f"shard {shard} is missing from {self.path} (the index puts {first} "
                                      f"and others there)")
        self._handles: dict = {}
        try:
            cfg = DSV4Config.from_hf_config(self.config)
        except ValueError as e:
            raise CheckpointError(f"{cfg_file}: {e}") from None
        self.cfg = cfg.replace(extra={**cfg.extra, "compress_overlap": self._overlap(cfg)})
        self.formats = {"main": self.cfg.formats("main"), "mtp": self.cfg.formats("mtp")}

    # ---- files ----------------------------------------------------------------------------------
    def _index(self) -> dict:
        index = self.path / INDEX
        if index.is_file():
            try:
                wm = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a safetensors index (needs a 'weight_map'): {e}") from None
            if not isinstance(wm, dict) or not wm:
                raise CheckpointError(f"{index}: its weight_map is empty")
            bad = sorted({s for s in wm.values() if not str(s).endswith(".safetensors")})
            if bad:
                raise CheckpointError(f"{index}: shards {bad} are not .safetensors files (safetensors only)")
            return dict(wm)
        if (self.path / SINGLE).is_file():
            return {n: SINGLE for n in self._handle(SINGLE).keys()}
        other = sorted(p.name for pat in _OTHER_FORMATS for p in self.path.glob(pat))
        if other:
            raise CheckpointError(f"{self.path}: holds {other[:3]}: dsv4lab reads safetensors checkpoints only "
                                  f"({INDEX} and its shards, or {SINGLE})")
        raise CheckpointError(f"{self.path}: no {INDEX} or {SINGLE}")

    def _handle(self, shard: str):
        if shard not in self._handles:
            from safetensors import safe_open
            try:
                self._handles[shard] = safe_open(str(self.path / shard), framework="pt")
            except Exception as e:  # safetensors raises its own error type
                held = [n for n, s in getattr(self, "weight_map", {}).items() if s == shard][:2]
                raise CheckpointError(f"shard {shard} cannot be read ({e})" +
                                      (f"; it holds {', '.join(held)}, ..." if held else "") +
                                      ": a truncated or corrupt file?") from None
        return self._handles[shard]

    def names(self, prefix: str = "") -> list[str]:
        """The checkpoint's tensor names (starting with ``prefix``)."""
        return sorted(n for n in self.weight_map if n.startswith(prefix))

    def info(self, name: str) -> tuple[str, list]:
        """(safetensors dtype string, shape) of tensor ``name``, without reading it."""
        sl = self._handle(self._shard(name)).get_slice(name)
        return sl.get_dtype(), list(sl.get_shape())

    def _shard(self, name: str) -> str:
        if name not in self.weight_map:
            raise CheckpointError(f"missing tensor {name}: not in {self.path.name}'s index")
        return self.weight_map[name]

    def tensor(self, spec: Spec, device=None) -> torch.Tensor | None:
        """The tensor ``spec`` names, read, moved to ``device`` and checked; None for a missing
        optional one."""
        if spec.name not in self.weight_map:
            if spec.optional:
                return None
            raise CheckpointError(f"missing tensor {spec.name} ({spec.kind}, shape {list(spec.shape)}): not in "
                                  f"the checkpoint's index")
        shard = self.weight_map[spec.name]
        h = self._handle(shard)
        try:
            t = h.get_tensor(spec.name)
        except Exception as e:
            raise CheckpointError(f"{spec.name}: cannot be read from {shard} ({e})") from None
        if device is not None:
            t = t.to(device)
        return check(spec, t, shard)

    def _overlap(self, cfg: DSV4Config) -> bool:
        """Whether the ratio-4 compressors overlap (their projections twice ``head_dim`` wide):
        read off the first one's shape; the released layout's when there is none."""
        for i, r in enumerate(cfg.compress_ratios[:cfg.num_layers]):
            name = f"layers.{i}.attn.compressor.wkv.weight"
            if r == 4 and name in self.weight_map:
                return self.info(name)[1][0] == 2 * cfg.head_dim
        return True

    # ---- parts ----------------------------------------------------------------------------------
    def fill(self, module: nn.Module, slots: list[Slot], *, prefixes=(), device=None,
             dtype: torch.dtype | None = torch.bfloat16) -> nn.Module:
        """Install the checkpoint tensors of ``slots`` into ``module`` (built on the meta device
        or not), then cast its floats to ``dtype`` (:func:`dsv4lab.model.to_dtype`; None keeps
        the stored dtypes). A tensor under one of ``prefixes`` that no slot reads is refused
        (an unexpected tensor: an unsupported format or layout)."""
        expected = {s.name for slot in slots for s in slot.specs()}
        for p in prefixes:
            extra = [n for n in self.names(p) if n not in expected]
            if extra:
                more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
                raise CheckpointError(f"unexpected tensor {extra[0]}{more}: dsv4lab's layout has no such tensor for "
                                      "the formats config.json declares (an unsupported format or layout?)")
        get = lambda spec: self.tensor(spec, device)  # noqa: E731
        for slot in slots:
            slot.read(module, get)
        for mod in module.modules():
            if hasattr(mod, "hashed") and mod.hashed and getattr(mod, "bias", None) is not None and mod.bias.is_meta:
                mod.bias = torch.zeros(mod.n_experts, device=device)      # hash-routed: no selection bias
        left = [n for n, t in list(module.named_parameters()) + list(module.named_buffers()) if t.is_meta]
        if left:
            raise CheckpointError(f"not loaded: {', '.join(left[:4])}: the checkpoint's slots do not cover the module")
        if dtype is not None:
            to_dtype(module, dtype)
        module.eval()
        for p in module.parameters():
            p.requires_grad_(False)
        return module

    def _check_layer(self, i: int) -> None:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.cfg.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.cfg.num_layers}), got {i!r}")

    def block(self, i: int, *, device=None, dtype: torch.dtype | None = torch.bfloat16) -> Block:
        """Main decoder layer ``i`` (``layers.{i}.*``) as a :class:`dsv4lab.model.Block`: FP8
        projections with their scales, FP4 experts packed as stored."""
        self._check_layer(i)
        with torch.device("meta"):
            blk = Block(self.cfg, i, "bf16")
        P = f"layers.{i}."
        return self.fill(blk, block_slots(self.cfg, i, self.formats["main"], P), prefixes=(P,), device=device,
                         dtype=dtype)

    def mtp(self, k: int = 0, *, device=None, dtype: torch.dtype | None = torch.bfloat16) -> MTP:
        """MTP layer ``k`` (``mtp.{k}.*``) as a :class:`dsv4lab.model.MTP` (embedding and head are
        the main model's: :meth:`embedding`, :meth:`head`)."""
        if not 0 <= k < self.cfg.num_mtp_layers:
            raise ValueError(f"MTP layer must be in [0, {self.cfg.num_mtp_layers}), got {k!r}")
        with torch.device("meta"):
            m = MTP(self.cfg, "bf16")
        P = f"mtp.{k}."
        return self.fill(m, mtp_slots(self.cfg, self.formats["mtp"], k), prefixes=(P,), device=device, dtype=dtype)

    def embedding(self, *, device=None, dtype: torch.dtype | None = torch.bfloat16) -> nn.Embedding:
        """The token embedding (``embed.weight``)."""
        with torch.device("meta"):
            holder = nn.Module()
            holder.embed = nn.Embedding(self.cfg.vocab_size, self.cfg.hidden_size)
        return self.fill(holder, embed_slots(self.cfg), device=device, dtype=dtype).embed

    def head(self, *, device=None, dtype: torch.dtype | None = torch.bfloat16) -> nn.Module:
        """The final stream reduction, norm and LM head: a module with ``hc_head``
        (:class:`dsv4lab.model.HCHead`), ``norm`` and ``head`` (``nn.Linear``)."""
        cfg = self.cfg
        with torch.device("meta"):
            holder = nn.Module()
            holder.hc_head = HCHead(cfg.hc_mult, cfg.hidden_size)
            holder.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            holder.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        return self.fill(holder, head_slots(cfg), device=device, dtype=dtype)

    def model(self, *, device=None, dtype: torch.dtype | None = torch.bfloat16) -> DSV4:
        """The whole model (every layer: mind the size) as a :class:`dsv4lab.model.DSV4`."""
        cfg = self.cfg
        with torch.device("meta"):
            m = DSV4(cfg, "bf16")
        slots = embed_slots(cfg) + head_slots(cfg)
        for i in range(cfg.num_layers):
            slots += block_slots(cfg, i, self.formats["main"], f"layers.{i}.", f"layers.{i}.")
        if len(m.mtp):
            slots += mtp_slots(cfg, self.formats["mtp"], 0, "mtp.0.")
        self.fill(m, slots, prefixes=("",), device=device, dtype=dtype)
        m.checkpoint_metadata = {"path": str(self.path), "formats": {k: f.describe() for k, f in self.formats.items()}}
        return m


def open_checkpoint(path) -> Checkpoint:
    """:class:`Checkpoint` ``(path)``."""
    return Checkpoint(path)


# ---- the speculative draft --------------------------------------------------------------------

class DraftModel(nn.Module):
    """The MTP draft layer with the main model's token embedding and LM head, laid out as
    :class:`dsv4lab.model.DSV4` holds them (``embed``, ``head``, ``mtp[0]``), so DSV4's MTP
    forwards run on it unchanged."""

    def __init__(self, cfg: DSV4Config, embed: nn.Embedding, head: nn.Linear, mtp: MTP):
        super().__init__()
        self.cfg = cfg
        self.embed, self.head = embed, head
        self.mtp = nn.ModuleList([mtp])

    mtp_forward_decode = DSV4.mtp_forward_decode
    mtp_forward_train = DSV4.mtp_forward_train

    @property
    def expert_format(self) -> str:
        return self.mtp[0].block.moe.fmt

    def ratios(self) -> list[int]:
        return [self.mtp[0].block.ratio]


@dataclass
class Draft:
    """A draft loaded from a checkpoint: the model, and its MoE plan (format and backend, from
    :func:`dsv4lab.backends.resolve_moe_backend` with ``role="draft"``)."""
    model: DraftModel
    plan: B.MoEPlan

    @property
    def backends(self) -> dict:
        """The ``backends`` dict for the draft's forwards (the resolved MoE backend)."""
        return {"fused_moe": self.plan.backend.name}


def load_draft(path, *, device=None, dtype: torch.dtype | None = torch.bfloat16, moe_runner_backend: str = "auto",
               speculative_moe_runner_backend: str | None = None, embed: nn.Embedding | None = None,
               head: nn.Linear | None = None) -> Draft:
    """The speculative draft from checkpoint ``path``: its MTP layer (``mtp.0.*``) with the
    embedding and LM head (``embed``/``head`` given: the main model's own modules, shared;
    else loaded). The experts' format comes from config.json and, with the backend flags, goes
    through :func:`dsv4lab.backends.resolve_moe_backend` (``role="draft"``, ``metadata`` the
    config: the one resolution path, main model and draft alike); a backend that cannot run on
    ``device`` raises :class:`dsv4lab.backends.BackendUnavailable` before any weight is read.

    The entry point for ``dsv4lab bench spec`` with a checkpoint; without one the trained mini
    model's own MTP layer stays the draft."""
    ckpt = Checkpoint(path)
    target = B.Target.current(device)
    plan = B.resolve_moe_backend("draft", metadata=ckpt.config, moe_runner_backend=moe_runner_backend,
                                 speculative_moe_runner_backend=speculative_moe_runner_backend, target=target)
    mtp = ckpt.mtp(device=device, dtype=dtype)
    if mtp.block.moe.fmt != plan.fmt:
        raise CheckpointError(f"mtp.0's experts load as {mtp.block.moe.fmt} but resolve as {plan.fmt}")
    embed = embed if embed is not None else ckpt.embedding(device=device, dtype=dtype)
    head = head if head is not None else ckpt.head(device=device, dtype=dtype).head
    return Draft(DraftModel(ckpt.cfg, embed, head, mtp), plan)
