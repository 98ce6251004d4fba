"""kernels/attention/l2_hint.py: the PTX rewrite that puts a marked kernel's masked cp.async
copies under an L2 evict-first policy, switched on only around the marked kernel's launch.
CPU: text in, text out, the scope of the hook, and (slow) offline compiles of the marked
kernels; the GPU test that the policy changes no bits is
tests/test_sparse_mla.py::test_gpu_evict_kv_changes_no_bits."""
import json
import os
import subprocess
import sys

import pytest

import dsv4lab  # noqa: F401  (sets TRITON_INTERPRET before anything imports triton)
import triton
from dsv4lab.kernels.attention import l2_hint

PTX = """.visible .entry k(
)
{
\t.reg .b32 \t%r<9>;
\t// begin inline asm
\t// {mark}
mov.u32 %r1, %r2;
\t// end inline asm
\tcp.async.cg.shared.global [ %r3 + 0 ], [ %rd1 + 0 ], 0x10, 0x10;
\tcp.async.cg.shared.global [ %r4 + 0 ], [ %rd2 + 0 ], 0x10, %r5;
\tcp.async.ca.shared.global [ %r6 + 0 ], [ %rd3 + 0 ], 0x8, %r7;
\t@%p1 cp.async.cg.shared.global [ %r8 + 0 ], [ %rd4 + 0 ], 0x10, %r9;
\tret;
}
"""


def test_unmarked_ptx_is_untouched():
    ptx = PTX.replace("{mark}", "something else")
    assert l2_hint.rewrite(ptx) == ptx


def test_marked_ptx_hints_the_masked_copies_only():
    out = l2_hint.rewrite(PTX.replace("{mark}", l2_hint.MARK))
    # the unmasked copy (a constant src-size: Q's load) stays as it was
    assert "cp.async.cg.shared.global [ %r3 + 0 ], [ %rd1 + 0 ], 0x10, 0x10;" in out
    # the masked .cg and .ca copies: a scoped policy register each, then the hinted copy
    policy = "createpolicy.fractional.L2::evict_first.b64 %l2pol, 0f3F800000;"
    assert out.count(policy) == 3 and out.count("{ .reg .b64 %l2pol;") == 3
    assert ("cp.async.cg.shared.global.L2::cache_hint [ %r4 + 0 ], [ %rd2 + 0 ], 0x10, %r5, "
            "%l2pol; }") in out
    assert ("cp.async.ca.shared.global.L2::cache_hint [ %r6 + 0 ], [ %rd3 + 0 ], 0x8, %r7, "
            "%l2pol; }") in out
    # a predicated copy (Triton's pipelined loads) keeps its predicate inside the scope
    assert ("%l2pol, 0f3F800000; @%p1 cp.async.cg.shared.global.L2::cache_hint [ %r8 + 0 ], "
            "[ %rd4 + 0 ], 0x10, %r9, %l2pol; }") in out
    assert l2_hint.rewrite(out.replace(l2_hint.MARK, "gone")) == out.replace(l2_hint.MARK, "gone")


def test_marked_ptx_without_a_masked_copy_is_refused():
    ptx = PTX.replace("{mark}", l2_hint.MARK)
    ptx = "\n".join(ln for ln in ptx.splitlines() if not ln.endswith(("%r5;", "%r7;", "%r9;")))
    with pytest.raises(RuntimeError, match="no masked cp.async"):
        l2_hint.rewrite(ptx)


IMPORT_ALL = r"""
import importlib, json, pkgutil, sys
import triton
runtime = triton.knobs.runtime
def knobs():
    return {k: repr(getattr(runtime, k)) for k in sorted(vars(type(runtime)))
            if not k.startswith("_")}
before = knobs()
import dsv4lab, dsv4lab.kernels
failed = []
for m in pkgutil.walk_packages(dsv4lab.kernels.__path__, "dsv4lab.kernels."):
    try:
        importlib.import_module(m.name)
    except Exception as e:           # another family's module that does not import here
        failed.append(f"{m.name}: {type(e).__name__}")
import dsv4lab.ops, dsv4lab.kernels.attention.dispatch, dsv4lab.kernels.attention.ws_sm90
print("RESULT " + json.dumps(dict(hook=repr(runtime.add_stages_inspection_hook),
                                  same=knobs() == before, failed=failed)))
"""


@pytest.mark.parametrize("interpret", ["1", "0"])
def test_importing_dsv4lab_and_every_kernel_module_leaves_triton_untouched(interpret):
    """Nothing sets Triton's stage hook (or any other runtime knob) at import: in a fresh
    process, interpreted or compiling, after importing dsv4lab, its ops and every kernel
    module."""
    env = {**os.environ, "TRITON_INTERPRET": interpret}
    run = subprocess.run([sys.executable, "-c", IMPORT_ALL], capture_output=True, text=True,
                         env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads([ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])
    assert res["hook"] == "None" and res["same"], res
    assert not [f for f in res["failed"] if ".attention" in f], res["failed"]


def test_rewriting_sets_the_hook_for_its_scope_only():
    runtime = triton.knobs.runtime
    assert runtime.add_stages_inspection_hook is None
    with l2_hint.rewriting():
        hook = runtime.add_stages_inspection_hook
        assert hook is not None
        key, digest = hook()                 # what Triton 3.9 asks for the launch's cache key
        assert "l2_hint" in key and len(digest) == 64
    assert runtime.add_stages_inspection_hook is None
    with l2_hint.rewriting():
        assert runtime.add_stages_inspection_hook is hook     # the same key launch after launch
    with pytest.raises(KeyError):
        with l2_hint.rewriting():
            raise KeyError("inside")
    assert runtime.add_stages_inspection_hook is None
    with l2_hint.rewriting(False):
        assert runtime.add_stages_inspection_hook is None


def test_rewriting_chains_after_a_hook_already_there():
    runtime = triton.knobs.runtime
    seen = []

    def theirs(*args):
        if not args:
            return "theirs:", "0" * 64
        seen.append(args[4])

    runtime.add_stages_inspection_hook = theirs
    try:
        with l2_hint.rewriting():
            hook = runtime.add_stages_inspection_hook
            assert hook()[0].startswith("theirs:") and "l2_hint" in hook()[0]
            hook(None, {"llir": lambda src, md: src}, None, None, 90)
            assert seen == [90]
        assert runtime.add_stages_inspection_hook is theirs
    finally:
        runtime.add_stages_inspection_hook = None


def test_the_hook_wraps_the_ptx_and_cubin_stages_only():
    llir = lambda src, md: src        # noqa: E731
    stages = {"llir": llir, "ptx": lambda src, md: src + "\n// " + l2_hint.MARK
              + "\n\tcp.async.cg.shared.global [ %r1 + 0 ], [ %rd1 + 0 ], 0x10, %r2;",
              "cubin": lambda src, md: src}
    with l2_hint.rewriting():
        triton.knobs.runtime.add_stages_inspection_hook(None, stages, None, None, 90)
    assert stages["llir"] is llir
    assert ".L2::cache_hint" in stages["ptx"]("x", {})


def test_sass_check_finds_unwritten_uniform_registers():
    # a ptxas build the H200 refused (illegal instruction): a hinted LDGSTS reading UR0 and
    # UR1, which nothing writes; and a good one, whose descriptor pair a ULDC.64 writes
    bad = ("        /*1360*/      ULDC.64 UR12, c[0x0][0x208] ;\n"
           "        /*1370*/ @!P5 LDGSTS.E [R6+UR0+0x14800], desc[UR1][R12.64], P4 ;\n")
    good = ("        /*0030*/      ULDC.64 UR4, c[0x0][0x208] ;\n"
            "        /*0040*/      R2UR UR6, R9 ;\n"
            "        /*f330*/      LDGSTS.E.BYPASS.128 [R9+UR6+0x20000], desc[UR4][R2.64] ;\n"
            "        /*f340*/      LDGSTS.E.BYPASS.128 [R9+0x20400], desc[UR5][R2.64] ;\n")
    assert not l2_hint.sass_uniforms_written(bad)
    assert l2_hint.sass_uniforms_written(good)
    assert l2_hint.sass_uniforms_written("no copies at all")


def test_a_hinted_build_that_fails_the_check_is_built_again_unhinted(monkeypatch):
    # the hook's cubin stage: a marked kernel's cubin that fails the SASS check is replaced by
    # the build of the PTX before the rewrite, and the metadata says so; one that passes stays
    marked = ("// " + l2_hint.MARK
              + "\n\tcp.async.cg.shared.global [ %r1 + 0 ], [ %rd1 + 0 ], 0x10, %r2;")
    for ok in (False, True):
        built = []
        stages = {"ptx": lambda src, md: marked, "cubin": lambda src, md: built.append(src) or src}
        monkeypatch.setattr(l2_hint, "_descriptors_ok", lambda cubin, ok=ok: ok)
        with l2_hint.rewriting():
            triton.knobs.runtime.add_stages_inspection_hook(None, stages, None, None, 90)
        meta = {}
        cubin = stages["cubin"](stages["ptx"]("ttgir", meta), meta)
        assert ".L2::cache_hint" in built[0]
        if ok:
            assert cubin == built[0] and meta[l2_hint.METADATA_KEY] == "hinted"
        else:
            assert cubin == marked and built[1] == marked
            assert meta[l2_hint.METADATA_KEY] == "plain (ptxas descriptor)"


def test_launchers_mark_only_where_validated():
    assert not l2_hint.active()          # the interpreter, or a Triton the hints did not run on
    assert l2_hint.VALIDATED_TRITON == ((3, 6),)


COMPILE_MARKED = r"""
import dataclasses, json, os, sys
import dsv4lab
from dsv4lab.kernels import offline
from dsv4lab.kernels.attention import dispatch, l2_hint
from dsv4lab.kernels.device import DeviceProps
h200 = DeviceProps.nominal((9, 0))
# the H200 launches the launcher marks (S_q = 1): the ws_sm90 bf16 one, the FP8 tiny entry
cases = [dataclasses.replace(c, constexprs=dict(c.constexprs, EVICT_KV=True))
         for c in dispatch.offline_cases(h200)
         if c.name.startswith(("ws_sm90 bf16 split", "mma fp8: N32")) and "S1" in c.name]
out = []
for i, case in enumerate(cases):
    for scoped in (True, False):
        # a cache of its own each: Triton 3.6 keys a marked kernel alike in and out of the scope
        os.environ["TRITON_CACHE_DIR"] = os.path.join(sys.argv[1], f"{i}{scoped}")
        with l2_hint.rewriting(scoped):
            k = offline.compile_case(case, h200)
        out.append(dict(name=case.name, scoped=scoped, hinted=k.asm["ptx"].count(".L2::cache_hint"),
                        meta=getattr(k.metadata, "l2_evict_first", None)))
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_marked_kernels_compile_hinted_inside_the_scope_only(tmp_path):
    """The H200's marked launches compiled offline for sm_90 (Triton's ptxas): inside the scope
    the gathers are hinted (the ws_sm90 bf16 ring: 16 masked copies a thread a tile, Q's
    unmasked copies not) and the cubin passed the SASS check; outside it, a plain build."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    run = subprocess.run([sys.executable, "-c", COMPILE_MARKED, str(tmp_path)], capture_output=True,
                         text=True, env=env, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads([ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])
    assert {r["name"].split()[0] for r in res} == {"ws_sm90", "mma"}
    for r in res:
        if r["scoped"]:
            assert r["hinted"] > 0 and r["meta"] == "hinted", r
            if r["name"].startswith("ws_sm90"):
                assert r["hinted"] == 16, r
        else:
            assert r["hinted"] == 0 and r["meta"] is None, r
