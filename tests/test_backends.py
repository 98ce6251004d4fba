"""Backend selection for the MoE, and the campaign's crash reproduced as a resolution test.

notebooks/04_mxfp4_moe_port.ipynb. The story: the MTP draft layer's MXFP4 experts were
auto-detected from checkpoint metadata, no flag; the would-be auto choice was
flashinfer's SM100-only trtllm_fp4_block_scale_moe; on sm_120 speculative decoding
crashed, and --speculative-moe-runner-backend triton was ignored.
"""
import dataclasses
import json
from pathlib import Path

import dsv4lab  # noqa: F401

import pytest

import dsv4lab.ops  # noqa: F401  (registers the fused_moe backends)
from dsv4lab import backends as B

SM90 = B.Target("cuda", (9, 0))
SM100 = B.Target("cuda", (10, 0))
SM103 = B.Target("cuda", (10, 3))
SM120 = B.Target("cuda", (12, 0))
CPU = B.Target("cpu", None, True)
MXFP4_META = {"quantization_config": {"quant_method": "mxfp4"}}


@pytest.fixture
def flashinfer_installed(monkeypatch):
    """Pretend flashinfer is importable, as on the campaign's SM100 machines (trtllm_fp4 then
    still cannot run: dsv4lab ships no weight layout for it)."""
    import dsv4lab.ops.moe as moe_ops
    monkeypatch.setattr(moe_ops, "_flashinfer_importable", lambda: True)


def test_fused_moe_backends_declared():
    by_name = {b.name: b for b in B.backends("fused_moe")}
    assert set(by_name) >= {"torch", "triton", "trtllm_fp4"}
    t = by_name["trtllm_fp4"]
    assert t.kind == "external" and t.min_capability == (10, 0) and t.max_capability == (10, 3)
    assert t.formats == frozenset({"mxfp4", "nvfp4"})
    assert not t.auto                                   # modelled: never a candidate for "auto"
    assert by_name["triton"].kind == "triton" and by_name["triton"].interpreter


def test_flashinfer_requirement_reported():
    # whatever this machine has, trtllm_fp4 cannot run on SM100, and the reason names flashinfer
    reason = B._REGISTRY["fused_moe"]["trtllm_fp4"].unavailable_reason(SM100, "mxfp4")
    assert reason is not None and "flashinfer" in reason


@pytest.mark.parametrize("target", [SM90, SM120, CPU], ids=["sm_90", "sm_120", "cpu"])
def test_campaign_draft_mxfp4_from_metadata_resolves_to_triton(flashinfer_installed, target):
    plan = B.resolve_moe_backend("draft", metadata=MXFP4_META, target=target)
    assert plan.fmt == "mxfp4" and plan.fmt_source.startswith("checkpoint metadata")
    assert plan.backend.name == "triton"
    # the main model resolves the same way
    assert B.resolve_moe_backend("main", metadata=MXFP4_META, target=target).backend.name == "triton"


def test_sm100_auto_never_picks_the_modelled_kernel(flashinfer_installed):
    # the campaign's bug must not come back: with flashinfer importable, "auto" on SM100 takes a
    # backend that runs, and trtllm_fp4 by name fails at resolution, saying why, never at the
    # first MoE call
    for t in (SM100, SM103):
        for role in ("main", "draft"):
            assert B.resolve_moe_backend(role, metadata=MXFP4_META, target=t).backend.name == "triton"
        with pytest.raises(B.BackendUnavailable, match="trtllm_fp4.*weight layout"):
            B.resolve_moe_backend("draft", metadata=MXFP4_META, target=t,
                                  speculative_moe_runner_backend="trtllm_fp4")


@pytest.mark.parametrize("target,desc", [(SM90, "sm_90"), (SM120, "sm_120"), (CPU, "CPU")])
def test_explicit_sm100_override_fails_at_resolution(flashinfer_installed, target, desc):
    for kw in (dict(moe_runner_backend="trtllm_fp4"),
               dict(speculative_moe_runner_backend="trtllm_fp4")):
        with pytest.raises(B.BackendUnavailable) as err:
            B.resolve_moe_backend("draft", metadata=MXFP4_META, target=target, **kw)
        msg = str(err.value)
        assert "trtllm_fp4" in msg and "sm_100" in msg and desc in msg and "draft" in msg


def test_speculative_flag_honoured_with_metadata_quant(flashinfer_installed):
    # the draft flag wins over auto (and over the metadata-found format's path)
    plan = B.resolve_moe_backend("draft", metadata=MXFP4_META, target=SM100,
                                 speculative_moe_runner_backend="triton")
    assert plan.backend.name == "triton" and plan.backend_source == "--speculative-moe-runner-backend"
    assert plan.fmt_source.startswith("checkpoint metadata")
    # ... and only for the draft: the main model keeps its own flag
    main = B.resolve_moe_backend("main", metadata=MXFP4_META, target=SM100, moe_runner_backend="torch",
                                 speculative_moe_runner_backend="triton")
    assert main.backend.name == "torch" and main.backend_source == "--moe-runner-backend"
    # the same flag with the format given as a flag instead of metadata: same answer
    same = B.resolve_moe_backend("mtp", quantization="mxfp4", target=SM100,
                                 speculative_moe_runner_backend="triton")
    assert (same.fmt, same.backend.name) == ("mxfp4", "triton")


def test_draft_falls_back_to_main_flag():
    plan = B.resolve_moe_backend("draft", metadata=MXFP4_META, target=SM90, moe_runner_backend="torch")
    assert plan.backend.name == "torch" and plan.backend_source == "--moe-runner-backend"


def test_format_resolution_one_path():
    assert B.resolve_expert_format(MXFP4_META) == ("mxfp4", "checkpoint metadata (quant_method 'mxfp4')")
    assert B.resolve_expert_format(None, "mxfp4") == ("mxfp4", "flag")
    assert B.resolve_expert_format({"quant_method": "modelopt_fp4"})[0] == "nvfp4"
    assert B.resolve_expert_format({"expert_format": "mxfp4"})[0] == "mxfp4"       # dsv4lab's checkpoints
    assert B.resolve_expert_format(MXFP4_META, "MXFP4")[0] == "mxfp4"
    assert B.resolve_expert_format(MXFP4_META, "auto")[0] == "mxfp4"
    assert B.resolve_expert_format(None, None)[0] == "bf16"
    with pytest.raises(B.QuantConfigError, match="conflict.*'mxfp4'.*'nvfp4'"):
        B.resolve_expert_format(MXFP4_META, "nvfp4")
    with pytest.raises(B.QuantConfigError, match="unknown quant_method 'int3'"):
        B.resolve_expert_format({"quant_method": "int3"})
    with pytest.raises(B.QuantConfigError, match="conflict"):
        B.resolve_moe_backend("draft", metadata=MXFP4_META, quantization="nvfp4", target=SM90)


def test_nvfp4_main_model_and_bad_role():
    plan = B.resolve_moe_backend("main", metadata={"quant_method": "nvfp4"}, target=SM120)
    assert (plan.fmt, plan.backend.name) == ("nvfp4", "triton")
    with pytest.raises(ValueError, match="role"):
        B.resolve_moe_backend("verifier", metadata=MXFP4_META, target=SM90)
    with pytest.raises(B.BackendUnavailable, match="bf16"):
        B.resolve_moe_backend("main", target=SM90)
    with pytest.raises(B.BackendUnavailable, match="unknown backend"):
        B.resolve_moe_backend("main", metadata=MXFP4_META, moe_runner_backend="cutlass", target=SM90)


def test_dispatch_table_tells_the_story(flashinfer_installed):
    rows = B.dispatch_table("fused_moe", [SM90, SM100, SM120, CPU], fmt="mxfp4")
    auto = {r["target"]: r["auto"] for r in rows}
    assert auto == {"sm_90": "triton", "sm_100": "triton", "sm_120": "triton",
                    "the CPU (Triton interpreter)": "triton"}
    assert "weight layout" in rows[1]["trtllm_fp4"]     # sm_100: why the modelled kernel cannot run
    assert "sm_100" in rows[2]["trtllm_fp4"]            # sm_120 row says why not


def test_cpu_without_interpreter_uses_torch():
    plan = B.resolve_moe_backend("draft", metadata=MXFP4_META, target=B.Target("cpu", None, False))
    assert plan.backend.name == "torch"


# ---- the checkpoints people have: the released config.json and ModelOpt's NVFP4 ----------
FIXTURES = Path(__file__).resolve().parent / "fixtures"
RELEASED = json.loads((FIXTURES / "deepseek_v4_flash_config.json").read_text())
MODELOPT = json.loads((FIXTURES / "deepseek_v4_flash_nvfp4_config.json").read_text())
SM80 = B.Target("cuda", (8, 0))


@pytest.mark.parametrize("target", [SM80, SM90, SM120], ids=["sm_80", "sm_90", "sm_120"])
@pytest.mark.parametrize("role", ["main", "draft"])
@pytest.mark.parametrize("meta, fmt", [(RELEASED, {"main": "mxfp4", "draft": "mxfp4"}),
                                       (MODELOPT, {"main": "nvfp4", "draft": "mxfp4"})],
                         ids=["released", "modelopt_nvfp4"])
def test_real_configs_resolve_on_every_gpu(meta, fmt, role, target):
    plan = B.resolve_moe_backend(role, metadata=meta, target=target)
    assert plan.fmt == fmt[role] and plan.fmt_source.startswith("checkpoint metadata")
    assert plan.backend.name == "triton" and plan.backend_source == "auto"
    # the flag that agrees changes nothing; one that disagrees is refused, naming both
    assert B.resolve_moe_backend(role, metadata=meta, quantization=fmt[role], target=target).fmt == fmt[role]
    other = "nvfp4" if fmt[role] == "mxfp4" else "mxfp4"
    with pytest.raises(B.QuantConfigError, match=f"says '{fmt[role]}' but the flag says '{other}'"):
        B.resolve_moe_backend(role, metadata=meta, quantization=other, target=target)


def test_capability_table_joins_auto_and_the_family_table(monkeypatch):
    """A fake family table: the route gated on sm_90 is listed there only; the portable
    route everywhere; the default-shape route is marked."""
    from dsv4lab.kernels.device import Route
    fast = Route("fast_sm90", frozenset({(9, 0)}), "T = 1", "wins at T = 1 (`dsv4lab bench moe`)",
                 lambda p, T=1, **_: T == 1)
    lesson = Route("triton_moe", None, "any shape", "the portable lesson kernel")
    rows = B.capability_table(tables={"fused_moe": (fast, lesson), "moe_align": (lesson,)},
                              op_names=["fused_moe"])
    by_cap = {r["capability"]: r for r in rows if r["op"] == "fused_moe"}
    assert set(by_cap) == {"sm_80", "sm_89", "sm_90", "sm_100", "sm_120"}
    assert [k["kernel"] for k in by_cap["sm_90"]["kernels"]] == ["fast_sm90", "triton_moe"]
    assert [k["default"] for k in by_cap["sm_90"]["kernels"]] == [True, False]
    for cap in ("sm_80", "sm_89", "sm_100", "sm_120"):
        assert [(k["kernel"], k["default"]) for k in by_cap[cap]["kernels"]] == [("triton_moe", True)]
        assert by_cap[cap]["backend"] == "triton"
    align = [r for r in rows if r["op"] == "moe_align"]            # an op the registry does not hold
    assert len(align) == 5 and all(r["backend"] == "-" for r in align)
    # a table named <op>_<part> takes <op>'s backend; <op> points at its parts
    parts = B.capability_table(tables={"fused_moe_gate": (lesson,)}, op_names=["fused_moe"])
    assert {r["note"] for r in parts if r["op"] == "fused_moe"} == {"kernels under fused_moe_gate"}
    assert {r["backend"] for r in parts if r["op"] == "fused_moe_gate"} == {"triton"}
    text = B.format_capability_table(rows)
    assert "  sm_90   triton     fast_sm90* | triton_moe" in text
    assert "  sm_120  triton     triton_moe*" in text
    assert "fast_sm90 [sm_90]: T = 1; wins at T = 1" in text


def test_capability_table_tolerates_families_without_tables(monkeypatch):
    import sys
    import types
    fake = types.ModuleType("_fake_family_with_table")
    from dsv4lab.kernels.device import Route
    fake.TABLES = {"sparse_mla_decode": (Route("mma_triton", None, "any shape", "the lesson kernel"),)}
    bare = types.ModuleType("_fake_family_without_table")
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    monkeypatch.setitem(sys.modules, bare.__name__, bare)
    tables, missing = B.family_tables([fake.__name__, bare.__name__, "_no_such_family_module"])
    assert list(tables) == ["sparse_mla_decode"]
    assert missing == {bare.__name__: "no TABLES yet",
                       "_no_such_family_module": "not importable (No module named '_no_such_family_module')"}
    rows = B.capability_table(tables=tables)
    mla = {r["capability"]: r for r in rows if r["op"] == "sparse_mla_decode"}
    assert all(r["backend"] == "mma" and r["kernels"][0]["kernel"] == "mma_triton" for r in mla.values())
    other = [r for r in rows if r["op"] not in tables and r["backend"] not in ("-", "(none)")]
    assert other and all(r["note"] == "no dispatch table yet" or not r["kernels"] for r in other)
    assert B.capability_table() and B.format_capability_table(B.capability_table())   # the real families
