"""``cp.async`` with an L2 evict-first policy for the Gluon and Triton kernels, whose copies
drop the policy on the Triton releases here.

Why. The benchmarks time a call after ``do_bench``'s zero-fill flush, which leaves the L2 full
of dirty lines, as a decode step finds it after the rest of the step's writes. Every line a
kernel then brings in for bytes it reads once (weights, a KV gather) evicts one of them, and
that line is first written back to HBM. Loaded with an L2 evict-first policy, the bytes read
once take each other's place instead (kernels/moe_mma2.py ``EVICT`` measured that on its
register loads). Gluon's ``cp.async`` takes an ``eviction_policy`` on Triton 3.6 but drops it
(its PTX is a plain ``cp.async.cg``), and Triton 3.9's ``async_load`` has a ``cache_policy``
that no GPU here has run.

How. A kernel that wants the policy calls :func:`mark` (Gluon) or :func:`mark_tl` (Triton)
once (a PTX comment and one move); the compiler hook :func:`install` puts in place rewrites
the PTX of every kernel that carries the mark: each masked ``cp.async`` (a register src-size:
the gathers) is given ``.L2::cache_hint`` and a policy register made by
``createpolicy.fractional.L2::evict_first`` just before it (PTX ISA 7.4, sm_80+). Kernels
without the mark compile untouched; the mark is a constexpr branch, so a kernel with and one
without it differ in their cache key, and the hook is installed when this module is imported,
before any kernel that calls :func:`mark` can compile. (Triton 3.9 also asks the hook for a
name that joins every kernel's cache key, so there the first launch of each kernel after the
import compiles anew.)

Guarded twice. ptxas has miscompiled some hinted copies (the Triton kernel's tiny-batch
launch, 16 heads a program: an LDGSTS reading uniform registers nothing writes, an illegal
instruction on the H200), so the hook reads a marked kernel's SASS and, if a copy reads such a
register, builds the unhinted PTX instead (:func:`_descriptors_ok`; the compiled kernel's
metadata ``l2_evict_first`` says which). And the launchers mark their kernels only on the
Triton releases the hinted kernels have run on (:func:`active`).

Measured (H200, sparse MLA's ws kernel, ``evict_kv``): A/B printout at ec05afa
(scripts/ab_sparse_mla.py --knobs evict_kv), B 64 / S_q 1 / topk 2048 bf16 57.9 -> 54.3 us,
FP8 73.3 -> 71.9; `dsv4lab bench sparse_mla` rows at a861507: 54.1 us against 58.0 for the
entry without it in the same run.

Explained in notebooks/02_mma_attention.ipynb.
"""
import functools
import hashlib
import os
import re
import subprocess
import tempfile

import triton
import triton.language as tl

from dsv4lab.kernels.device import interpreting, triton_release

try:        # Gluon (Triton 3.4+) for the warp-specialised kernels' mark
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:
    gluon = None

MARK = "dsv4lab: cp.async L2::evict_first"
# this file's hash, in the mark and in the hook's cache key: a change to the rewrite or to its
# check then compiles the marked kernels anew (Triton 3.6 keys its cache on the kernel's
# source and the globals it reads, not on the hook)
_SOURCE = hashlib.sha256(open(__file__, "rb").read()).hexdigest()[:16]
# a marked kernel's compiled metadata: "hinted", or "plain (ptxas descriptor)" when its
# hinted build failed :func:`_descriptors_ok` and the unhinted PTX was built instead
METADATA_KEY = "l2_evict_first"
_MARK_ASM = tl.constexpr(f"// {MARK} {_SOURCE}\nmov.u32 $0, $1;")
# a masked copy (.cg 16 bytes, or .ca 4 / 8 / 16) with a register src-size (0: a masked-off
# row, zero-filled), perhaps under a predicate (Triton's pipelined loads)
_CP_ASYNC = re.compile(r"(@!?%p\d+ +)?cp\.async\.(c[ag])\.shared\.global \[([^\]]*)\], "
                       r"\[([^\]]*)\], (0x[0-9a-f]+, %r\d+);")


@triton.jit
def mark_tl():
    """:func:`mark` for a Triton (``tl``) kernel."""
    tl.inline_asm_elementwise(_MARK_ASM, "=r,r", [tl.zeros([1], tl.int32)], dtype=tl.int32,
                              is_pure=False, pack=1)


if gluon is not None:
    @gluon.jit
    def mark(num_warps: gl.constexpr):
        """Ask :func:`install`'s hook to give this Gluon kernel's masked ``cp.async`` copies
        the L2 evict-first policy (a PTX comment and a register move; call it where
        ``num_warps`` warps run)."""
        one: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        gl.inline_asm_elementwise(_MARK_ASM, "=r,r", [gl.arange(0, 32 * num_warps, layout=one)],
                                  dtype=gl.int32, is_pure=False, pack=1)


def rewrite(ptx: str) -> str:
    """PTX with the mark -> its masked ``cp.async`` copies under an L2 evict-first policy (a
    kernel without the mark comes back unchanged), each with its own scoped policy register.
    Two other builds failed: one policy register made at the entry with every copy hinted
    raised an illegal instruction on the H200 (why is not established; that register would
    have had to live across a warp-specialised kernel's ``setmaxnreg``), and hinting Q's
    unmasked copies as well gave, in an offline sm_90 compile, LDGSTS instructions that read
    uniform registers nothing writes (not run). Raises if a marked kernel has no masked copy
    to give the policy to."""
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
    """Whether every uniform register the cubin's ``LDGSTS`` (cp.async) instructions read, for
    their shared-memory offset or their memory descriptor (which holds the L2 policy), is
    written by some instruction. ptxas 12.8 (Triton 3.6's, sm_90) built some hinted copies as
    ``LDGSTS [R+UR0+...], desc[UR1]`` with nothing writing UR0 or UR1, and the H200 raised an
    illegal instruction on such a build. A necessary check, not a proof. False also when the
    SASS cannot be read (no cuobjdump): then nothing is hinted."""
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
    """:func:`_descriptors_ok` on cuobjdump's SASS text: every ``URn`` an ``LDGSTS`` reads is
    the destination of some instruction (a ``.64`` destination writes ``URn`` and ``URn+1``)."""
    written = set()
    for m in re.finditer(r"\*/\s+(?:@!?U?P\w+\s+)?[A-Z][A-Z0-9_]*(\.[A-Z0-9_.]+)?\s+UR(\d+)\b",
                         sass):
        n = int(m.group(2))
        written.update((n, n + 1) if ".64" in (m.group(1) or "") else (n,))
    read = set()
    for ldgsts in re.findall(r"LDGSTS[^;]*", sass):
        read.update(int(n) for n in re.findall(r"\bUR(\d+)\b", ldgsts))
    return read <= written


# what the rewrite is, for the cache key of the releases that ask the hook for one (3.9)
_KEY = f"dsv4lab.l2_hint:{_SOURCE}"


def _hook(*args, _chained=None):
    """Triton's stage hook. Called with the pipeline (backend, stages, options, language,
    capability): its PTX stage through :func:`rewrite`, and a marked kernel's cubin checked
    (:func:`_descriptors_ok`) and, if it fails, built again from the unhinted PTX. Called with
    nothing (Triton 3.9, for its cache keys): -> (key, hash) naming the rewrite (and any hook
    chained before it)."""
    if not args:
        key = _KEY
        if _chained is not None:
            key = _chained()[0] + key
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


def install() -> bool:
    """Put the PTX rewrite in Triton's compiler pipeline (once; a hook already there keeps
    running first) -> whether it is in place: Triton releases without the stage hook
    (``triton.knobs.runtime.add_stages_inspection_hook``, 3.5 and later) cannot take it, and
    their launchers then leave the policy out (:func:`installed`)."""
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "add_stages_inspection_hook"):
        return False
    current = runtime.add_stages_inspection_hook
    if getattr(current, "_dsv4lab_l2_hint", False):
        return True
    hook = functools.partial(_hook, _chained=current)
    hook._dsv4lab_l2_hint = True
    runtime.add_stages_inspection_hook = hook
    return True


# Triton releases whose hinted kernels have run on a GPU here (the H200's Triton 3.6); on the
# others the hook still rewrites a marked kernel (tests/test_gluon_compile.py compiles one on
# CI's Triton), but the launchers do not mark theirs (:func:`active`)
VALIDATED_TRITON = ((3, 6),)
_VALIDATED = triton_release() in VALIDATED_TRITON


def active() -> bool:
    """Whether the launchers should mark their kernels: compiled kernels (not Triton's
    interpreter), the rewrite in Triton's pipeline, and this Triton release one of
    :data:`VALIDATED_TRITON`. (The policy is a speed-up, never a change of results: an
    unmarked kernel computes the same bits.) Asked on every launch: the release is read once."""
    if interpreting():
        return False
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    hook = getattr(runtime, "add_stages_inspection_hook", None)
    return _VALIDATED and bool(getattr(hook, "_dsv4lab_l2_hint", False))


install()
