"""Compile a kernel for a GPU that is not here, and read what it costs.

Each family lists its dispatch's launches (``offline_cases(props)``, one :class:`Case` each);
:func:`compile_case` compiles one for ``props.capability`` with Triton's ptxas, so "runs on
sm_80 .. sm_120" and each launch's shared memory are checked without a GPU
(tests/test_portability.py). Needs ``TRITON_INTERPRET=0``; the device's own compile may differ.
"""
from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from dsv4lab.kernels.device import DeviceProps


@dataclass(frozen=True)
class Case:
    """One launch as the compiler sees it. ``types``: Triton types of non-constexprs (default:
    ``pointer`` for a ``*_ptr`` name, else "i32"); ``aligned``: those 16-aligned ("*": pointers)."""
    name: str
    fn: object
    constexprs: dict
    types: dict = field(default_factory=dict)
    pointer: str = "*fp32"
    aligned: tuple = ("*",)
    num_warps: int = 4
    num_stages: int = 3
    options: dict = field(default_factory=dict)


def _signature(fn, consts: dict, case: Case) -> dict:
    sig = {}
    for n in fn.arg_names:
        if n in consts:
            sig[n] = "constexpr"
        elif n in case.types:
            sig[n] = case.types[n]
        else:
            sig[n] = case.pointer if n.endswith("_ptr") else "i32"
    return sig


def _with_defaults(fn, consts: dict) -> dict:
    out = dict(consts)
    for p in fn.params:
        if p.is_constexpr and p.name not in out and p.has_default:
            out[p.name] = p.default
    return out


def compile_case(case: Case, props: DeviceProps):
    """The compiled kernel of ``case`` for ``props.capability`` (``.metadata.shared``,
    ``.asm["ptx"]``, ``.asm["cubin"]``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    fn = case.fn
    try:
        from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction
        source = GluonASTSource if isinstance(fn, GluonJITFunction) else ASTSource
    except ImportError:          # a Triton without Gluon
        source = ASTSource
    consts = _with_defaults(fn, case.constexprs)
    sig = _signature(fn, consts, case)
    aligned = [n for n, t in sig.items()
               if n in case.aligned or ("*" in case.aligned and t.startswith("*"))]
    src = source(fn=fn, signature=sig,
                 constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                 attrs={(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in aligned})
    cc = props.capability[0] * 10 + props.capability[1]
    opts = dict(num_warps=case.num_warps, num_stages=case.num_stages, **case.options)
    return triton.compile(src, target=GPUTarget("cuda", cc, 32), options=opts)


def report(kernel) -> dict:
    """Registers, stack, spills, instruction and MMA counts of a compiled kernel, and its SASS."""
    import triton
    tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.TemporaryDirectory() as d:
        cubin = Path(d) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([tool, "-res-usage", cubin], capture_output=True, text=True,
                               check=True).stdout
    reg = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    return dict(registers=int(reg.group(1)) if reg else None,
                stack=int(stack.group(1)) if stack else None,
                spill_stores=len(re.findall(r"\bSTL", sass)), shared=kernel.metadata.shared,
                instructions=len(re.findall(r"/\*[0-9a-f]{4,5}\*/", sass)),
                mma=len(re.findall(r"\b[HQ]G?MMA\b", sass)), sass=sass)
