"""One backend registry for every op, and honest selection.

Each op (``sparse_mla_decode``, ``indexer_topk``, ``fused_moe``, ...) registers its
implementations here with what they need: a kind ("torch", "triton", "external"), the
weight formats they take, the GPU capabilities they run on, and whether Triton's
interpreter can run them. ``resolve(op, backend)`` then either returns the one to call
or raises :class:`BackendUnavailable` saying why, before any kernel is launched:

- an explicit name always wins, or fails at once ("needs sm_100..sm_103; this is sm_90");
- ``"auto"`` picks the highest-priority backend whose requirements hold on the target.

The campaign's crash came from selection that bypassed this kind of check: the MXFP4
draft MoE went to an SM100-only kernel on an sm_120 GPU. Explained in
notebooks/04_mxfp4_moe_port.ipynb.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from dsv4lab import runtime


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run here; the message says why."""


@dataclass(frozen=True)
class Target:
    """Where a call would run: "cuda" with a capability, or "cpu" (interpreter or not).

    Tests build targets by hand to ask "what would sm_120 pick?" on any machine.
    """
    device: str = "cpu"
    capability: tuple[int, int] | None = None
    interpreter: bool = False

    @classmethod
    def current(cls, device: torch.device | str | None = None) -> "Target":
        dev = torch.device(device) if device is not None else runtime.device()
        if dev.type == "cuda":
            return cls("cuda", runtime.capability(), False)
        return cls("cpu", None, runtime.is_interpreter())

    def describe(self) -> str:
        if self.device == "cuda":
            return runtime.capability_str(self.capability)
        return "the CPU (Triton interpreter)" if self.interpreter else "the CPU"


@dataclass(frozen=True)
class Backend:
    op: str
    name: str
    fn: Callable
    kind: str = "torch"                 # "torch" | "triton" | "external"
    priority: int = 0                   # higher wins under "auto"
    formats: frozenset | None = None    # weight/KV formats taken; None = any
    min_capability: tuple[int, int] | None = None
    max_capability: tuple[int, int] | None = None
    interpreter: bool = True            # a triton backend the interpreter can run
    auto: bool = True                   # considered by "auto"
    requires: Callable[[], str | None] | None = None   # extra check: reason or None
    description: str = ""

    def unavailable_reason(self, target: Target, fmt: str | None = None) -> str | None:
        """None if this backend can run on ``target`` with ``fmt``; else why not."""
        if fmt is not None and self.formats is not None and fmt not in self.formats:
            return f"does not take format {fmt!r} (takes {', '.join(sorted(self.formats))})"
        if self.kind == "external" or self.min_capability or self.max_capability:
            if target.device != "cuda":
                if self.kind == "triton" and target.interpreter and self.interpreter:
                    pass
                else:
                    return f"needs {self._cap_range()}; this is {target.describe()}"
            else:
                cap = target.capability
                if (self.min_capability and cap < self.min_capability) or \
                        (self.max_capability and cap > self.max_capability):
                    return f"needs {self._cap_range()}; this is {target.describe()}"
        if self.kind == "triton" and target.device == "cpu":
            if not target.interpreter:
                return "tensors are on the CPU and Triton's interpreter is off (TRITON_INTERPRET=0)"
            if not self.interpreter:
                return "does not run in Triton's interpreter"
        if self.requires is not None:
            reason = self.requires()
            if reason:
                return reason
        return None

    def _cap_range(self) -> str:
        lo = runtime.capability_str(self.min_capability) if self.min_capability else "sm_00"
        if self.max_capability:
            hi = runtime.capability_str(self.max_capability)
            return f"a CUDA GPU of {lo}..{hi}" if hi != lo else f"a CUDA GPU of {lo}"
        return f"a CUDA GPU of {lo} or newer"


_REGISTRY: dict[str, dict[str, Backend]] = {}


def register(op: str, name: str, *, kind: str = "torch", priority: int = 0,
             formats: Iterable[str] | None = None,
             min_capability: tuple[int, int] | None = None,
             max_capability: tuple[int, int] | None = None,
             interpreter: bool = True, auto: bool = True,
             requires: Callable[[], str | None] | None = None,
             description: str = "") -> Callable:
    """Decorator: ``@register("fused_moe", "triton", kind="triton", priority=20)``."""
    if kind not in ("torch", "triton", "external"):
        raise ValueError(f"kind must be torch, triton or external, got {kind!r}")

    def deco(fn: Callable) -> Callable:
        _REGISTRY.setdefault(op, {})[name] = Backend(
            op=op, name=name, fn=fn, kind=kind, priority=priority,
            formats=frozenset(formats) if formats is not None else None,
            min_capability=min_capability, max_capability=max_capability,
            interpreter=interpreter, auto=auto, requires=requires,
            description=description or (fn.__doc__ or "").strip().split("\n")[0])
        return fn
    return deco


def backends(op: str) -> list[Backend]:
    """Registered backends of ``op``, best first."""
    if op not in _REGISTRY:
        raise KeyError(f"no backends registered for op {op!r} (known: {', '.join(sorted(_REGISTRY))})")
    return sorted(_REGISTRY[op].values(), key=lambda b: -b.priority)


def ops() -> list[str]:
    return sorted(_REGISTRY)


def resolve(op: str, backend: str = "auto", *, fmt: str | None = None,
            target: Target | None = None, device: torch.device | str | None = None) -> Backend:
    """The backend to run ``op`` with, or :class:`BackendUnavailable` saying why.

    ``target`` defaults to where ``device`` (or the lab's default device) would run.
    """
    target = target or Target.current(device)
    table = _REGISTRY.get(op)
    if not table:
        raise KeyError(f"no backends registered for op {op!r}")
    if backend != "auto":
        if backend not in table:
            raise BackendUnavailable(
                f"{op}: unknown backend {backend!r}; choose from auto, {', '.join(sorted(table))}")
        chosen = table[backend]
        reason = chosen.unavailable_reason(target, fmt)
        if reason:
            raise BackendUnavailable(f"{op}: backend {backend!r} {reason}")
        return chosen
    reasons = []
    for cand in backends(op):
        if not cand.auto:
            continue
        reason = cand.unavailable_reason(target, fmt)
        if reason is None:
            return cand
        reasons.append(f"{cand.name}: {reason}")
    raise BackendUnavailable(f"{op}: no backend can run on {target.describe()}"
                             + (f" with format {fmt!r}" if fmt else "") + "; " + "; ".join(reasons))


def dispatch_table(op: str, targets: Iterable[Target], *, fmt: str | None = None) -> list[dict]:
    """For each target: what "auto" picks and why each backend is or is not usable."""
    rows = []
    for t in targets:
        try:
            chosen = resolve(op, "auto", fmt=fmt, target=t).name
        except BackendUnavailable as e:
            chosen = f"(none) {e}"
        row = {"target": t.describe(), "auto": chosen}
        for b in backends(op):
            row[b.name] = b.unavailable_reason(t, fmt) or "ok"
        rows.append(row)
    return rows


# ---- expert quantisation and MoE backend resolution (main model and MTP draft alike) ----
# The campaign's bug: the draft (MTP) layer's MXFP4 experts were auto-detected from the
# checkpoint's metadata, so the code path that honoured --speculative-moe-runner-backend
# (only taken when the quantisation came from a flag) was skipped, and the MXFP4 method
# picked flashinfer's SM100-only kernel by itself. Here the format, wherever it comes
# from, and the backend, whichever flag names it, go through one function each.

EXPERT_FORMATS = ("mxfp4", "nvfp4", "bf16")


class QuantConfigError(ValueError):
    """Checkpoint metadata and a user flag disagree about the expert format (or one is unknown)."""


def _normalise_format(value, where: str) -> str | None:
    if value is None:
        return None
    v = str(value).strip().lower()
    if v in ("", "auto", "none"):
        return None
    if v in ("mxfp4", "mx_fp4", "fp4_e2m1_e8m0"):
        return "mxfp4"
    if v in ("nvfp4", "modelopt_fp4", "fp4_e2m1_e4m3", "modelopt_nvfp4"):
        return "nvfp4"
    if v in ("bf16", "bfloat16", "unquantized"):
        return "bf16"
    raise QuantConfigError(f"{where}: unknown expert format {value!r} (expected mxfp4, nvfp4 or bf16)")


def format_from_metadata(metadata: dict | None) -> str | None:
    """The expert format a checkpoint declares: a ``quantization_config``-like dict (or a
    whole config.json dict holding one); None when it declares nothing."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise QuantConfigError(f"checkpoint metadata must be a dict, got {type(metadata).__name__}")
    qc = metadata.get("quantization_config", metadata)
    if not isinstance(qc, dict):
        raise QuantConfigError("quantization_config must be a dict")
    for key in ("expert_format", "quant_method", "fmt"):
        if qc.get(key) is not None:
            return _normalise_format(qc[key], f"checkpoint quantization_config[{key!r}]")
    return None


def resolve_expert_format(metadata: dict | None = None, flag: str | None = None) -> tuple[str, str]:
    """``(format, source)`` of the routed experts from checkpoint metadata and/or a flag.

    Both sources go through this one function; when both are given they must agree
    (:class:`QuantConfigError` otherwise). Neither: bf16 (unquantised experts).
    """
    meta = format_from_metadata(metadata)
    user = _normalise_format(flag, "--quantization flag")
    if meta and user and meta != user:
        raise QuantConfigError(
            f"expert format conflict: the checkpoint's quantization_config says {meta!r} but the "
            f"flag says {user!r}; drop the flag or use a checkpoint quantised as {user!r}")
    if meta:
        return meta, "checkpoint metadata" + (" (flag agrees)" if user else "")
    if user:
        return user, "flag"
    return "bf16", "default (no quantization_config, no flag)"


@dataclass(frozen=True)
class MoEPlan:
    """What a MoE layer of a given role will run: format, backend, and where each came from."""
    role: str
    fmt: str
    fmt_source: str
    backend: Backend
    backend_source: str

    def describe(self) -> str:
        return (f"{self.role} MoE: {self.fmt} experts ({self.fmt_source}) -> backend "
                f"{self.backend.name!r} ({self.backend_source})")


def resolve_moe_backend(role: str = "main", *, metadata: dict | None = None,
                        quantization: str | None = None, moe_runner_backend: str = "auto",
                        speculative_moe_runner_backend: str | None = None,
                        target: Target | None = None, op: str = "fused_moe") -> MoEPlan:
    """Resolve the expert format and the MoE backend for a layer of ``role``.

    ``role``: "main", or "draft"/"mtp" (the speculative draft layer). The draft uses
    ``speculative_moe_runner_backend`` when given, else ``moe_runner_backend``; the
    format comes from :func:`resolve_expert_format` in every case, so a format found in
    metadata never bypasses the backend flags. An explicit backend that cannot run on
    ``target`` raises :class:`BackendUnavailable` here, at resolution, saying why.
    Needs the op's backends registered (import ``dsv4lab.ops`` first).
    """
    if role not in ("main", "draft", "mtp"):
        raise ValueError(f"role must be 'main', 'draft' or 'mtp', got {role!r}")
    fmt, fmt_source = resolve_expert_format(metadata, quantization)
    if fmt == "bf16":
        raise BackendUnavailable(
            f"{op}: the {role} layer's experts are bf16 (unquantised); fused_moe takes mxfp4 or nvfp4")
    if role != "main" and speculative_moe_runner_backend not in (None, ""):
        name, source = speculative_moe_runner_backend, "--speculative-moe-runner-backend"
    else:
        name = moe_runner_backend or "auto"
        source = "--moe-runner-backend" if name != "auto" else "auto"
    try:
        chosen = resolve(op, name, fmt=fmt, target=target)
    except BackendUnavailable as e:
        raise BackendUnavailable(f"{role} layer ({fmt} experts from {fmt_source}), {source}: {e}") from None
    return MoEPlan(role, fmt, fmt_source, chosen, source)
