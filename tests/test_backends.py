"""Backend selection for the MoE, and the campaign's crash reproduced as a resolution test.

notebooks/04_mxfp4_moe_port.ipynb. The story: the MTP draft layer's MXFP4 experts were
auto-detected from checkpoint metadata, no flag; the would-be auto choice was
flashinfer's SM100-only trtllm_fp4_block_scale_moe; on sm_120 speculative decoding
crashed, and --speculative-moe-runner-backend triton was ignored.
"""
import dataclasses

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
    """Pretend flashinfer is importable, so trtllm_fp4 IS the auto choice on SM100."""
    table = B._REGISTRY["fused_moe"]
    monkeypatch.setitem(table, "trtllm_fp4", dataclasses.replace(table["trtllm_fp4"], requires=None))


def test_fused_moe_backends_declared():
    by_name = {b.name: b for b in B.backends("fused_moe")}
    assert set(by_name) >= {"torch", "triton", "trtllm_fp4"}
    t = by_name["trtllm_fp4"]
    assert t.kind == "external" and t.min_capability == (10, 0) and t.max_capability == (10, 3)
    assert t.formats == frozenset({"mxfp4", "nvfp4"})
    assert t.priority == max(b.priority for b in by_name.values())
    assert by_name["triton"].kind == "triton" and by_name["triton"].interpreter


def test_flashinfer_requirement_reported():
    # whatever this machine has, the reason (if any) names flashinfer
    reason = B._REGISTRY["fused_moe"]["trtllm_fp4"].unavailable_reason(SM100, "mxfp4")
    assert reason is None or "flashinfer" in reason


@pytest.mark.parametrize("target", [SM90, SM120, CPU], ids=["sm_90", "sm_120", "cpu"])
def test_campaign_draft_mxfp4_from_metadata_resolves_to_triton(flashinfer_installed, target):
    plan = B.resolve_moe_backend("draft", metadata=MXFP4_META, target=target)
    assert plan.fmt == "mxfp4" and plan.fmt_source.startswith("checkpoint metadata")
    assert plan.backend.name == "triton"
    # the main model resolves the same way
    assert B.resolve_moe_backend("main", metadata=MXFP4_META, target=target).backend.name == "triton"


def test_sm100_auto_would_pick_the_external_kernel(flashinfer_installed):
    for t in (SM100, SM103):
        assert B.resolve_moe_backend("draft", metadata=MXFP4_META, target=t).backend.name == "trtllm_fp4"


@pytest.mark.parametrize("target,desc", [(SM90, "sm_90"), (SM120, "sm_120"), (CPU, "CPU")])
def test_explicit_sm100_override_fails_at_resolution(flashinfer_installed, target, desc):
    for kw in (dict(moe_runner_backend="trtllm_fp4"),
               dict(speculative_moe_runner_backend="trtllm_fp4")):
        with pytest.raises(B.BackendUnavailable) as err:
            B.resolve_moe_backend("draft", metadata=MXFP4_META, target=target, **kw)
        msg = str(err.value)
        assert "trtllm_fp4" in msg and "sm_100" in msg and desc in msg and "draft" in msg


def test_speculative_flag_honoured_with_metadata_quant(flashinfer_installed):
    # on SM100 auto would take trtllm_fp4; the draft flag must still win
    plan = B.resolve_moe_backend("draft", metadata=MXFP4_META, target=SM100,
                                 speculative_moe_runner_backend="triton")
    assert plan.backend.name == "triton" and plan.backend_source == "--speculative-moe-runner-backend"
    assert plan.fmt_source.startswith("checkpoint metadata")
    # ... and only for the draft: the main model keeps its own flag / auto
    main = B.resolve_moe_backend("main", metadata=MXFP4_META, target=SM100,
                                 speculative_moe_runner_backend="triton")
    assert main.backend.name == "trtllm_fp4"
    # the same flag with the format given as a flag instead of metadata: same answer
    same = B.resolve_moe_backend("mtp", quantization="mxfp4", target=SM100,
                                 speculative_moe_runner_backend="triton")
    assert (same.fmt, same.backend.name) == ("mxfp4", "triton")


def test_draft_falls_back_to_main_flag():
    plan = B.resolve_moe_backend("draft", metadata=MXFP4_META, target=SM90, moe_runner_backend="torch")
    assert plan.backend.name == "torch" and plan.backend_source == "--moe-runner-backend"


def test_format_resolution_one_path():
    assert B.resolve_expert_format(MXFP4_META) == ("mxfp4", "checkpoint metadata")
    assert B.resolve_expert_format(None, "mxfp4") == ("mxfp4", "flag")
    assert B.resolve_expert_format({"quant_method": "modelopt_fp4"})[0] == "nvfp4"
    assert B.resolve_expert_format(MXFP4_META, "MXFP4")[0] == "mxfp4"
    assert B.resolve_expert_format(MXFP4_META, "auto")[0] == "mxfp4"
    assert B.resolve_expert_format(None, None)[0] == "bf16"
    with pytest.raises(B.QuantConfigError, match="conflict.*'mxfp4'.*'nvfp4'"):
        B.resolve_expert_format(MXFP4_META, "nvfp4")
    with pytest.raises(B.QuantConfigError, match="unknown expert format"):
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
    assert auto == {"sm_90": "triton", "sm_100": "trtllm_fp4", "sm_120": "triton",
                    "the CPU (Triton interpreter)": "triton"}
    assert "sm_100" in rows[2]["trtllm_fp4"]            # sm_120 row says why not


def test_cpu_without_interpreter_uses_torch():
    plan = B.resolve_moe_backend("draft", metadata=MXFP4_META, target=B.Target("cpu", None, False))
    assert plan.backend.name == "torch"
