"""``cp.async`` with an L2 evict-first policy for the Gluon kernels, on the Triton releases whose
Gluon drops the policy.

Why. The benchmarks time a call after ``do_bench``'s zero-fill flush, which leaves the L2 full
of dirty lines, as a decode step finds it after the rest of the step's writes. Every line a
kernel then brings in for bytes it reads once (weights, a KV gather) evicts one of them, and
that line is first written back to HBM. Loaded with an L2 evict-first policy, the bytes read
once take each other's place instead (kernels/moe_mma2.py ``EVICT`` measured that on its
register loads). Gluon's ``cp.async`` takes an ``eviction_policy`` on Triton 3.6 but drops it
(its PTX is a plain ``cp.async.cg``), and Triton 3.9's ``async_load`` has a ``cache_policy``
that no GPU here has run.

How. A kernel that wants the policy calls :func:`mark` once (a PTX comment, no instruction);
the compiler hook :func:`install` puts in place rewrites the PTX of every kernel that carries
the mark: each ``cp.async.cg.shared.global`` given ``.L2::cache_hint`` and a policy register
made by ``createpolicy.fractional.L2::evict_first`` just before it (PTX ISA 7.4, sm_80+). Kernels without the mark compile untouched; the mark is a constexpr branch, so a
kernel with and one without it differ in their cache key, and the hook is installed when this
module is imported, before any kernel that calls :func:`mark` can compile.

Explained in notebooks/02_mma_attention.ipynb.
"""
import re

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

MARK = "dsv4lab: cp.async L2::evict_first"
_MARK_ASM = gl.constexpr("// " + MARK + "\nmov.u32 $0, $1;")
# a masked copy (.cg 16 bytes, or .ca 4 / 8 / 16) with a register src-size (0: a masked-off
# row, zero-filled)
_CP_ASYNC = re.compile(r"cp\.async\.(c[ag])\.shared\.global \[([^\]]*)\], \[([^\]]*)\], "
                       r"(0x[0-9a-f]+, %r\d+);")


@gluon.jit
def mark(num_warps: gl.constexpr):
    """Ask :func:`install`'s hook to give this kernel's ``cp.async`` copies the L2
    evict-first policy (a PTX comment and a register move; call it where ``num_warps``
    warps run)."""
    one: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    gl.inline_asm_elementwise(_MARK_ASM, "=r,r", [gl.arange(0, 32 * num_warps, layout=one)],
                              dtype=gl.int32, is_pure=False, pack=1)


def rewrite(ptx: str) -> str:
    """PTX with the mark -> every ``cp.async.cg`` under an L2 evict-first policy (a kernel
    without the mark comes back unchanged). Each copy gets its own scoped policy register
    (ptxas merges them): one register made at the entry would have to live across a
    warp-specialised kernel's register reallocation (``setmaxnreg``), and on the H200 such a
    build raised an illegal instruction. Raises if a marked kernel has no ``cp.async`` to
    give the policy to."""
    if MARK not in ptx:
        return ptx
    out, n = _CP_ASYNC.subn(
        lambda m: ("{ .reg .b64 %l2pol; "
                   "createpolicy.fractional.L2::evict_first.b64 %l2pol, 0f3F800000; "
                   f"cp.async.{m.group(1)}.shared.global.L2::cache_hint [{m.group(2)}], "
                   f"[{m.group(3)}], {m.group(4)}, %l2pol; }}"), ptx)
    if n == 0:
        raise RuntimeError("l2_hint: the marked kernel has no cp.async.cg to give the policy to")
    return out


def _hook(backend, stages, options, language, capability, _chained=None):
    if _chained is not None:
        _chained(backend, stages, options, language, capability)
    make_ptx = stages.get("ptx")
    if make_ptx is not None:
        stages["ptx"] = lambda src, metadata: rewrite(make_ptx(src, metadata))


def install() -> None:
    """Put the PTX rewrite in Triton's compiler pipeline (once; a hook already there keeps
    running first)."""
    runtime = triton.knobs.runtime
    current = runtime.add_stages_inspection_hook
    if getattr(current, "_dsv4lab_l2_hint", False):
        return
    hook = (lambda *a: _hook(*a, _chained=current)) if current is not None else _hook
    hook._dsv4lab_l2_hint = True
    runtime.add_stages_inspection_hook = hook


install()
