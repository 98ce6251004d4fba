"""The KV gathers' ``cp.async`` under an L2 evict-first policy, for the kernels that ask for it.

Why. A decode step meets the L2 full of dirty lines; each line a gather brings in for a row
read once evicts one, written back to HBM first. Under evict-first the rows read once replace
each other instead: a gain at S_q = 1 (rows: dsv4lab bench sparse_mla). Neither Triton's nor
Gluon's ``cp.async`` emits the policy on Triton 3.6.

How. A kernel calls :func:`mark_tl` (Triton) or :func:`mark` (Gluon) under a constexpr flag (a
PTX comment and one move) and is launched inside ``with rewriting():``, which sets Triton's
stage hook for that launch only. There :func:`rewrite` gives each masked ``cp.async`` of a
marked kernel's PTX ``.L2::cache_hint`` and a ``createpolicy.fractional.L2::evict_first``
register (PTX ISA 7.4, sm_80+). Unmarked kernels compile untouched; nothing is set at import.

Caching. A marked kernel has its own cache key, and the mark carries this file's hash. Triton
3.9 also asks the hook for a key on every launch in the scope (:func:`_hook` with no args). A
marked kernel compiled outside the scope is a plain build: no harm, no policy.

Guarded twice. ptxas has built some hinted copies wrongly (an ``LDGSTS`` reading uniform
registers nothing writes), so a marked cubin is checked (:func:`sass_uniforms_written`) and,
failing, rebuilt from the plain PTX (metadata ``l2_evict_first`` says which); and launchers mark
only on validated releases (:func:`active`). The results' bits never change.
"""
import contextlib
import functools
import hashlib
import os
import re
import subprocess
import tempfile

import triton
import triton.language as tl

from dsv4lab.kernels.device import interpreting, triton_release

try:        # Gluon (Triton 3.4+) for the warp-specialised kernel's mark
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:
    gluon = None

MARK = "dsv4lab: cp.async L2::evict_first"
_SOURCE = hashlib.sha256(open(__file__, "rb").read()).hexdigest()[:16]
METADATA_KEY = "l2_evict_first"     # "hinted", or "plain (ptxas descriptor)"
_MARK_ASM = tl.constexpr(f"// {MARK} {_SOURCE}\nmov.u32 $0, $1;")
# a masked copy (.cg or .ca) with a register src-size, perhaps under a predicate
_CP_ASYNC = re.compile(r"(@!?%p\d+ +)?cp\.async\.(c[ag])\.shared\.global \[([^\]]*)\], "
                       r"\[([^\]]*)\], (0x[0-9a-f]+, %r\d+);")


@triton.jit
def mark_tl():
    """Ask for the policy on this Triton (``tl``) kernel's masked ``cp.async`` copies."""
    tl.inline_asm_elementwise(_MARK_ASM, "=r,r", [tl.zeros([1], tl.int32)], dtype=tl.int32,
                              is_pure=False, pack=1)


if gluon is not None:
    @gluon.jit
    def mark(num_warps: gl.constexpr):
        """The same for a Gluon kernel, called where ``num_warps`` warps run."""
        one: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        gl.inline_asm_elementwise(_MARK_ASM, "=r,r", [gl.arange(0, 32 * num_warps, layout=one)],
                                  dtype=gl.int32, is_pure=False, pack=1)


def rewrite(ptx: str) -> str:
    """Marked PTX -> its masked ``cp.async`` under the policy (raises if none); unmarked: as is."""
    if MARK not in ptx:
        return ptx
    out, n = _CP_ASYNC.subn(
        lambda m: ("{ .reg .b64 %l2pol; "
                   "createpolicy.fractional.L2::evict_first.b64 %l2pol, 0f3F800000; "
                   f"{m.group(1) or ''}cp.async.{m.group(2)}.shared.global.L2::cache_hint "
                   f"[{m.group(3)}], [{m.group(4)}], {m.group(5)}, %l2pol; }}"), ptx)
    if n == 0:
        raise RuntimeError("l2_hint: the marked kernel has no masked cp.async to give the "
                           "policy to")
    return out


def _descriptors_ok(cubin: bytes) -> bool:
    """:func:`sass_uniforms_written` on the cubin's SASS; False if it cannot be read."""
    tool = getattr(getattr(getattr(triton, "knobs", None), "nvidia", None), "cuobjdump", None)
    path = getattr(tool, "path", None)
    if not path:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        binary = os.path.join(tmp, "kernel.cubin")
        with open(binary, "wb") as f:
            f.write(cubin)
        run = subprocess.run([path, "-sass", binary], capture_output=True, text=True)
    return run.returncode == 0 and sass_uniforms_written(run.stdout)


def sass_uniforms_written(sass: str) -> bool:
    """Whether every uniform register an ``LDGSTS`` (cp.async) reads is written by some
    instruction (a ``.64`` destination writes two). Necessary, not a proof."""
    written = set()
    for m in re.finditer(r"\*/\s+(?:@!?U?P\w+\s+)?[A-Z][A-Z0-9_]*(\.[A-Z0-9_.]+)?\s+UR(\d+)\b",
                         sass):
        n = int(m.group(2))
        written.update((n, n + 1) if ".64" in (m.group(1) or "") else (n,))
    read = set()
    for ldgsts in re.findall(r"LDGSTS[^;]*", sass):
        read.update(int(n) for n in re.findall(r"\bUR(\d+)\b", ldgsts))
    return read <= written


_KEY = f"dsv4lab.l2_hint:{_SOURCE}"


def _hook(*args, _chained=None):
    """Triton's stage hook: PTX through :func:`rewrite`, a marked cubin checked (and rebuilt
    plain if it fails). With no args (Triton 3.9's cache key): -> (key, hash)."""
    if not args:
        key = _KEY if _chained is None else _chained()[0] + _KEY
        return key, hashlib.sha256(key.encode()).hexdigest()
    if _chained is not None:
        _chained(*args)
    stages = args[1]
    make_ptx, make_cubin = stages.get("ptx"), stages.get("cubin")
    if make_ptx is None or make_cubin is None:
        return
    plain = {}       # this compile's PTX before the rewrite, when the rewrite changed it

    def ptx_stage(src, metadata):
        ptx = make_ptx(src, metadata)
        hinted = rewrite(ptx)
        if hinted is not ptx:
            plain["ptx"] = ptx
        return hinted

    def cubin_stage(src, metadata):
        cubin = make_cubin(src, metadata)
        if "ptx" in plain:       # a marked kernel: the outcome goes into its metadata
            metadata[METADATA_KEY] = "hinted"
            if not _descriptors_ok(cubin):
                cubin = make_cubin(plain["ptx"], metadata)
                metadata[METADATA_KEY] = "plain (ptxas descriptor)"
        return cubin

    stages["ptx"], stages["cubin"] = ptx_stage, cubin_stage


@functools.lru_cache(maxsize=8)
def _hook_after(previous):
    """The hook chained after ``previous``, one object each (a stable key for Triton 3.9)."""
    hook = functools.partial(_hook, _chained=previous)
    key = _hook(_chained=previous)
    hook_key = lambda *args: key if not args else hook(*args)     # noqa: E731
    return hook_key


def _runtime_knobs():
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    return runtime if hasattr(runtime, "add_stages_inspection_hook") else None


@contextlib.contextmanager
def _rewriting():
    runtime = _runtime_knobs()
    previous = runtime.add_stages_inspection_hook
    runtime.add_stages_inspection_hook = _hook_after(previous)
    try:
        yield
    finally:
        runtime.add_stages_inspection_hook = previous


def rewriting(enabled: bool = True):
    """The context of a marked kernel's launch: the rewrite in Triton's pipeline inside (a
    no-op if not ``enabled`` or Triton has no stage hook)."""
    if not enabled or _runtime_knobs() is None:
        return contextlib.nullcontext()
    return _rewriting()


# Triton releases whose hinted kernels have run on a GPU; on others launchers do not mark
VALIDATED_TRITON = ((3, 6),)
_VALIDATED = triton_release() in VALIDATED_TRITON


def active() -> bool:
    """Whether launchers mark: compiled (not interpreted), stage hook, a VALIDATED_TRITON."""
    return _VALIDATED and not interpreting() and _runtime_knobs() is not None
