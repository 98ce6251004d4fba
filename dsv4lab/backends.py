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

Below "auto", each kernel family has its own dispatch table (``TABLES`` of
``dsv4lab.kernels.<family>``: which kernel runs on which capability and shape);
:func:`capability_table` joins the two, per capability, for ``dsv4lab env`` and
``dsv4lab targets``.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from dsv4lab import runtime
from dsv4lab.config import EXPERT_FORMATS, QuantConfigError, resolve_formats
from dsv4lab.kernels.device import CAPABILITIES, NOMINAL, DeviceProps, describe


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


# ---- per capability: "auto" and the family's kernel ------------------------------------

# the kernel families' dispatch modules, each with TABLES = {op: (Route, ...)}
FAMILY_MODULES = ("dsv4lab.kernels.attention.dispatch", "dsv4lab.kernels.indexer",
                  "dsv4lab.kernels.moe.dispatch", "dsv4lab.kernels.mhc", "dsv4lab.kernels.linear")
FORMAT_OF = {"fused_moe": "mxfp4"}         # the format "auto" is asked about where it matters


def family_tables(modules: Iterable[str] = FAMILY_MODULES) -> tuple[dict, dict]:
    """``({op: routes}, {module: why it has none})`` over the families' dispatch modules; a
    family without ``TABLES`` (or not importable) is reported, not raised."""
    tables, missing = {}, {}
    for name in modules:
        try:
            mod = importlib.import_module(name)
        except ImportError as e:
            missing[name] = f"not importable ({e})"
            continue
        except Exception as e:  # noqa: BLE001  (a broken family is reported; its own tests fail)
            missing[name] = f"import failed ({type(e).__name__}: {e})"
            continue
        found = getattr(mod, "TABLES", None)
        if not isinstance(found, dict):
            missing[name] = "no TABLES yet"
            continue
        tables.update(found)
    return tables, missing


def _default_route(routes, props) -> int | None:
    """Index of the route that runs at the family's default shape (its ``applies`` called
    without a shape), or None when a route before it cannot tell without one."""
    for i, r in enumerate(routes):
        try:
            ok = r.applies(props)
        except Exception:            # noqa: BLE001  (this route needs a shape to decide)
            return None
        if ok:
            return i
    return None


def capability_table(capabilities: Iterable[tuple[int, int]] = CAPABILITIES, *,
                     tables: dict | None = None, op_names: Iterable[str] | None = None) -> list[dict]:
    """For each op and capability: the backend "auto" resolves to on ``Target("cuda", cap)``
    and, for a Triton backend, the family's routes that run there, in the table's order
    (the first that applies to a call's shape wins); ``default`` marks the one that runs at
    the family's default shape.

    Rows: ``{"op", "capability", "backend", "kernels": [{"kernel", "gpus", "when", "why",
    "default"}], "note"}``. ``tables`` defaults to :func:`family_tables`; a table named
    ``<op>_<part>`` takes registry op ``<op>``'s backend, other ops the registry does not
    hold are listed with backend "-". Needs the ops registered (``import dsv4lab.ops``)."""
    if tables is None:
        tables = family_tables()[0]
    reg_ops = list(op_names) if op_names is not None else ops()
    # a table named "<op>_<part>" (mhc_pre, mhc_post) holds a part of registry op <op>
    parent = {t: next((o for o in reg_ops if t.startswith(o + "_")), None) for t in tables}
    rows = []
    for op in reg_ops + [t for t in tables if t not in reg_ops]:
        reg_op = op if op in reg_ops else parent[op]
        parts = [t for t in tables if parent.get(t) == op and t not in reg_ops]
        for cap in map(tuple, capabilities):
            props = DeviceProps.nominal(cap) if cap in NOMINAL else DeviceProps(cap, 0, 0)
            row = {"op": op, "capability": runtime.capability_str(cap), "backend": "-",
                   "kernels": [], "note": ""}
            rows.append(row)
            if reg_op in _REGISTRY:
                try:
                    b = resolve(reg_op, "auto", fmt=FORMAT_OF.get(reg_op), target=Target("cuda", cap))
                except BackendUnavailable as e:
                    row.update(backend="(none)", note=str(e))
                    continue
                row["backend"] = b.name
                if b.kind != "triton":
                    row["note"] = b.description or b.kind
                    continue
            routes = [r for r in tables.get(op, ()) if r.runs_on(props)]
            if op not in tables:
                row["note"] = f"kernels under {', '.join(parts)}" if parts else "no dispatch table yet"
                continue
            chosen = _default_route(routes, props)
            for i, (r, d) in enumerate(zip(routes, describe(tuple(routes)))):
                row["kernels"].append(dict(d, default=i == chosen))
    return rows


def format_capability_table(rows: list[dict]) -> str:
    """:func:`capability_table` as text: per op, one line per capability (``*``: the kernel
    at the default shape), then each kernel's when and why once."""
    lines = []
    by_op: dict[str, list[dict]] = {}
    for r in rows:
        by_op.setdefault(r["op"], []).append(r)
    for op, op_rows in by_op.items():
        lines.append(op)
        legend = {}
        for r in op_rows:
            if r["kernels"]:
                what = " | ".join(k["kernel"] + ("*" if k["default"] else "") for k in r["kernels"])
                for k in r["kernels"]:
                    legend.setdefault(k["kernel"], k)
            else:
                what = r["note"] or "-"
            lines.append(f"  {r['capability']:7s} {r['backend']:10s} {what}")
        for name, k in legend.items():
            lines.append(f"    {name} [{k['gpus']}]: {k['when']}; {k['why']}")
    return "\n".join(lines)


# ---- expert formats and MoE backend resolution (main model and MTP draft alike) ----------
# The campaign's bug: the draft (MTP) layer's MXFP4 experts were auto-detected from the
# checkpoint's metadata, so the code path that honoured --speculative-moe-runner-backend
# (only taken when the quantisation came from a flag) was skipped, and the MXFP4 method
# picked flashinfer's SM100-only kernel by itself. Here the format, wherever it comes
# from, goes through :func:`dsv4lab.config.resolve_formats`, and the backend, whichever
# flag names it, through :func:`resolve_moe_backend`.

_LAYER_OF_ROLE = {"main": "main", "draft": "mtp", "mtp": "mtp"}


def resolve_expert_format(metadata: dict | None = None, flag: str | None = None, *,
                          role: str = "main") -> tuple[str, str]:
    """``(format, source)`` of the routed experts of a ``role`` layer ("main", or
    "draft"/"mtp"): :func:`dsv4lab.config.resolve_formats`'s answer (metadata and a flag
    must agree, else :class:`QuantConfigError`; neither: bf16)."""
    if role not in _LAYER_OF_ROLE:
        raise ValueError(f"role must be 'main', 'draft' or 'mtp', got {role!r}")
    f = resolve_formats(metadata, layer=_LAYER_OF_ROLE[role], experts=flag)
    return f.experts, f.source


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
    format comes from :func:`resolve_expert_format` in every case (``metadata``: a
    config.json, its quantization_config, or ``{"expert_format": ...}``; ``quantization``:
    the flag), so a format found in metadata never bypasses the backend flags. An explicit
    backend that cannot run on ``target`` raises :class:`BackendUnavailable` here, at
    resolution, saying why. Needs the op's backends registered (import ``dsv4lab.ops`` first).
    """
    if role not in _LAYER_OF_ROLE:
        raise ValueError(f"role must be 'main', 'draft' or 'mtp', got {role!r}")
    fmt, fmt_source = resolve_expert_format(metadata, quantization, role=role)
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


__all__ = ["Backend", "BackendUnavailable", "EXPERT_FORMATS", "MoEPlan", "QuantConfigError", "Target",
           "backends", "capability_table", "dispatch_table", "family_tables", "format_capability_table",
           "ops", "register", "resolve", "resolve_expert_format", "resolve_moe_backend"]
