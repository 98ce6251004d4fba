"""Compile a Gluon kernel of kernels/ for an NVIDIA GPU on a machine without one, and read
what its SASS costs. Shared by scripts/sass_moe_decode.py and scripts/sass_sparse_mla_ws.py
(and the compile test, tests/test_gluon_compile.py).

The kernel modules are imported on their own: ``import dsv4lab`` would switch a machine
without a GPU to Triton's interpreter, which cannot compile for a GPU target. The figures are
offline, not measurements: the device's own compile has differed (kernels/moe_mma2.py).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parser(doc: str, out: str) -> argparse.ArgumentParser:
    """The scripts' common arguments: the constexprs (JSON), --cc, --triton-site, --out."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("consts", nargs="?", default="{}", help="JSON: constexprs over the defaults")
    ap.add_argument("--cc", type=int, default=90, help="compute capability (90: sm_90)")
    ap.add_argument("--triton-site", default=None,
                    help="a directory holding the Triton to compile with, ahead of the installed one")
    ap.add_argument("--out", default=out, help="where .ptx / .cubin / .sass go (a path stem)")
    return ap


def signature(fn, consts: dict, types: dict, pointer: str, scalars: dict) -> dict:
    """``fn``'s parameter types for compiling: "constexpr" for those in ``consts``, else
    ``types[name]``, else ``pointer`` for a *_ptr, else ``scalars.get(name, "i32")``."""
    sig = {}
    for n in fn.arg_names:
        if n in consts:
            sig[n] = "constexpr"
        elif n in types:
            sig[n] = types[n]
        else:
            sig[n] = pointer if n.endswith("_ptr") else scalars.get(n, "i32")
    return sig


def use_triton(site: str | None = None):
    """Import Triton for compiling (not interpreting), from ``site`` ahead of the installed
    one when given (a directory holding another release) -> the triton module."""
    if site:
        sys.path.insert(0, site)
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    return triton


def kernel_module(name: str):
    """kernels/<name>.py imported as dsv4lab.kernels.<name> without importing dsv4lab."""
    for pkg in ("dsv4lab", "dsv4lab.kernels"):
        sys.modules.setdefault(pkg, types.ModuleType(pkg)).__path__ = [str(ROOT / "kernels")]
    spec = importlib.util.spec_from_file_location(f"dsv4lab.kernels.{name}", ROOT / f"kernels/{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def with_defaults(fn, consts: dict) -> dict:
    """``consts`` plus the kernel's own constexpr defaults it does not set."""
    out = dict(consts)
    for p in fn.params:
        if p.is_constexpr and p.name not in out and p.has_default:
            out[p.name] = p.default
    return out


def compile_report(fn, sig: dict, consts: dict, aligned, *, cc: int = 90, num_warps: int = 4,
                   maxnreg: int | None = None, out: str | None = None) -> dict:
    """Compile Gluon kernel ``fn`` (``sig``: Triton type strings a parameter, "constexpr" for
    those in ``consts``; ``aligned``: parameters taken 16-divisible) for sm_``cc`` -> its
    figures: triton, registers, stack (bytes a thread), spill_stores (STL instructions),
    shared (bytes), instructions, mma (HMMA + HGMMA), loops (instruction counts of the
    backward branches), sass. ``out``: also write .ptx / .cubin / .sass there."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    src = GluonASTSource(fn=fn, signature=sig,
                         constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                         attrs={(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in aligned})
    opts = dict(num_warps=num_warps, **({"maxnreg": maxnreg} if maxnreg else {}))
    ck = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=opts)
    tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    stem = Path(out) if out else Path(os.environ.get("TMPDIR", "/tmp")) / f"gluon_sass_{os.getpid()}"
    stem.with_suffix(".cubin").write_bytes(ck.asm["cubin"])
    sass = subprocess.run([tool, "-sass", stem.with_suffix(".cubin")], capture_output=True,
                          text=True, check=True).stdout
    usage = subprocess.run([tool, "-res-usage", stem.with_suffix(".cubin")], capture_output=True,
                           text=True, check=True).stdout
    if out:
        stem.with_suffix(".ptx").write_text(ck.asm["ptx"])
        stem.with_suffix(".sass").write_text(sass)
    else:
        stem.with_suffix(".cubin").unlink()
    loops = []
    for m in re.finditer(r"/\*([0-9a-f]{4,5})\*/[^;]*BRA (0x[0-9a-f]+)", sass):
        at, to = int(m.group(1), 16), int(m.group(2), 16)
        if to < at:
            loops.append((at - to) // 16 + 1)
    reg = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    return dict(triton=triton.__version__, cc=cc, registers=int(reg.group(1)) if reg else None,
                stack=int(stack.group(1)) if stack else None,
                spill_stores=len(re.findall(r"\bSTL", sass)), shared=ck.metadata.shared,
                instructions=len(re.findall(r"/\*[0-9a-f]{4,5}\*/", sass)),
                mma=len(re.findall(r"\bH(?:G)?MMA\b", sass)), loops=loops, sass=sass,
                l2_hint=getattr(ck.metadata, "l2_evict_first", None))


def summary(r: dict) -> str:
    """One line of :func:`compile_report`'s figures."""
    return (f"triton {r['triton']}, sm_{r['cc']}: registers {r['registers']}, stack {r['stack']} B, "
            f"spill stores {r['spill_stores']}, shared {r['shared']} B, {r['instructions']} "
            f"instructions, MMA {r['mma']}, loop lengths {r['loops']}"
            + (f", L2 hint {r['l2_hint']}" if r.get("l2_hint") else ""))
