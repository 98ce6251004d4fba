"""kernels/l2_hint.py: the PTX rewrite that puts a marked Gluon kernel's masked cp.async copies
under an L2 evict-first policy (CPU: text in, text out; the GPU test that the policy changes
no bits is tests/test_sparse_mla.py::test_gpu_ws_evict_kv_changes_no_bits, and
tests/test_gluon_compile.py compiles the marked kernel)."""
import pytest

import dsv4lab  # noqa: F401  (sets TRITON_INTERPRET before anything imports triton)
from dsv4lab.kernels import l2_hint

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


def test_the_hook_is_installed_once_and_names_itself():
    import triton
    hook = triton.knobs.runtime.add_stages_inspection_hook
    assert getattr(hook, "_dsv4lab_l2_hint", False)
    l2_hint.install()
    assert triton.knobs.runtime.add_stages_inspection_hook is hook
    # what Triton 3.9 asks the hook for its cache keys
    key, digest = hook()
    assert "l2_hint" in key and len(digest) == 64
    # the pipeline call wraps the PTX and cubin stages, no other
    llir = lambda src, md: src        # noqa: E731
    stages = {"llir": llir, "ptx": lambda src, md: src + "\n// " + l2_hint.MARK
              + "\n\tcp.async.cg.shared.global [ %r1 + 0 ], [ %rd1 + 0 ], 0x10, %r2;",
              "cubin": lambda src, md: src}
    hook(None, stages, None, None, 90)
    assert stages["llir"] is llir
    assert ".L2::cache_hint" in stages["ptx"]("x", {})


def test_sass_check_finds_unwritten_uniform_registers():
    # the ptxas 12.8 build the H200 refused (illegal instruction): a hinted LDGSTS reading UR0
    # and UR1, which nothing writes; and a good one, whose descriptor pair a ULDC.64 writes
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
    hook = __import__("triton").knobs.runtime.add_stages_inspection_hook
    marked = ("// " + l2_hint.MARK
              + "\n\tcp.async.cg.shared.global [ %r1 + 0 ], [ %rd1 + 0 ], 0x10, %r2;")
    for ok in (False, True):
        built = []
        stages = {"ptx": lambda src, md: marked, "cubin": lambda src, md: built.append(src) or src}
        monkeypatch.setattr(l2_hint, "_descriptors_ok", lambda cubin, ok=ok: ok)
        hook(None, stages, None, None, 90)
        meta = {}
        cubin = stages["cubin"](stages["ptx"]("ttgir", meta), meta)
        assert ".L2::cache_hint" in built[0]
        if ok:
            assert cubin == built[0] and meta[l2_hint.METADATA_KEY] == "hinted"
        else:
            assert cubin == marked and built[1] == marked
            assert meta[l2_hint.METADATA_KEY] == "plain (ptxas descriptor)"
