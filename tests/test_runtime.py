"""dsv4lab.runtime: device detection, the interpreter switch, capability checks."""
import os
import subprocess
import sys

import pytest
import torch

from dsv4lab import runtime

NO_GPU = not torch.cuda.is_available()


def _python(code: str, **env_changes) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(env_changes)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.skipif(not NO_GPU, reason="the interpreter is switched on only without a GPU")
def test_import_sets_interpreter_before_triton():
    out = _python("import os, dsv4lab, triton; print(os.environ['TRITON_INTERPRET'])")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"


@pytest.mark.skipif(not NO_GPU, reason="only an error without a GPU")
def test_triton_imported_first_is_a_clear_error():
    out = _python("import triton, dsv4lab")
    assert out.returncode != 0
    assert "TRITON_INTERPRET=1 before importing triton" in out.stderr


def test_explicit_setting_is_respected():
    out = _python("import os, dsv4lab; print(os.environ['TRITON_INTERPRET'])", TRITON_INTERPRET="0")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0"


def test_is_interpreter_reads_the_variable(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert runtime.is_interpreter()
    for off in ("0", ""):
        monkeypatch.setenv("TRITON_INTERPRET", off)
        assert not runtime.is_interpreter()
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not runtime.is_interpreter()


def test_configure_is_idempotent():
    before = os.environ.get("TRITON_INTERPRET")
    runtime.configure()
    runtime.configure()
    assert os.environ.get("TRITON_INTERPRET") == before


def test_device_and_capability_agree_with_torch():
    assert runtime.has_cuda() == torch.cuda.is_available()
    assert runtime.device().type == ("cuda" if torch.cuda.is_available() else "cpu")
    if NO_GPU:
        assert runtime.capability() is None
        assert runtime.capability_str() == "cpu"
        assert runtime.device_name().startswith("cpu")
    else:
        assert runtime.capability() == torch.cuda.get_device_capability()
        assert runtime.capability_str().startswith("sm_")


@pytest.mark.parametrize("cap, text", [((9, 0), "sm_90"), ((12, 0), "sm_120"), ((10, 3), "sm_103"), ((8, 6), "sm_86")])
def test_capability_str(cap, text):
    assert runtime.capability_str(cap) == text


@pytest.mark.skipif(not NO_GPU, reason="checks the no-GPU message")
def test_require_capability_without_gpu_names_what_is_needed():
    with pytest.raises(runtime.CapabilityError, match=r"trtllm fp4 MoE needs a CUDA GPU with sm_100\.\.sm_103; this machine has no GPU"):
        runtime.require_capability((10, 0), maximum=(10, 3), what="trtllm fp4 MoE")


@pytest.fixture
def fake_h200(monkeypatch):
    monkeypatch.setattr(runtime, "capability", lambda: (9, 0))
    monkeypatch.setattr(runtime, "device_name", lambda: "NVIDIA H200")


def test_require_capability_names_the_gpu_it_is_on(fake_h200):
    with pytest.raises(runtime.CapabilityError) as e:
        runtime.require_capability((10, 0), maximum=(10, 3), what="trtllm fp4 MoE")
    assert "needs sm_100..sm_103" in str(e.value)
    assert "NVIDIA H200 (sm_90)" in str(e.value)
    with pytest.raises(runtime.CapabilityError, match=r"needs sm_100\+"):
        runtime.require_capability((10, 0))


def test_require_capability_passes_and_returns(fake_h200):
    assert runtime.require_capability((8, 0)) == (9, 0)
    assert runtime.require_capability((9, 0), maximum=(9, 0)) == (9, 0)
    with pytest.raises(runtime.CapabilityError, match="sm_80..sm_89"):
        runtime.require_capability((8, 0), maximum=(8, 9))


def test_versions_has_every_provenance_field():
    v = runtime.versions()
    for key in ("gpu", "capability", "torch", "triton", "cuda", "python", "interpreter"):
        assert key in v
    assert v["torch"] == torch.__version__
    assert v["interpreter"] == runtime.is_interpreter()
    assert v["triton"]


def test_gluon_kernels_only_on_the_triton_they_are_written_for(monkeypatch):
    # the Gluon kernels (attention.ws_sm90, moe.mma_sm90, moe.gemv_sm90) follow one release's Gluon API: any other
    # Triton falls back to the Triton kernels with a reason, unless the user opts in
    from dsv4lab.kernels.device import GLUON_TRITON, gluon_unsupported
    monkeypatch.delenv("DSV4LAB_GLUON_ANY_TRITON", raising=False)
    major, minor = GLUON_TRITON[0]
    assert gluon_unsupported(f"{major}.{minor}.1") is None
    why = gluon_unsupported("3.9.0")
    assert "written for Triton 3.6" in why and "found Triton 3.9.0" in why
    assert "DSV4LAB_GLUON_ANY_TRITON=1" in why
    assert gluon_unsupported("3.10.0") is not None and gluon_unsupported("nightly") is not None
    monkeypatch.setenv("DSV4LAB_GLUON_ANY_TRITON", "1")
    assert gluon_unsupported("3.9.0") is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_aborted_capture_leaves_random_draws_working():
    # a capture that fails (here a host sync inside it) must not leave the CUDA generator in
    # capture mode: the decode-step profile falls back to eager after one, then builds the
    # next configuration's layers with CUDA random draws ("Offset increment outside graph
    # capture encountered unexpectedly" otherwise)
    from dsv4lab import runtime
    x = torch.randn(8, device="cuda")
    torch.cuda.synchronize()
    with pytest.raises(Exception):
        with runtime.cuda_graph_capture(torch.cuda.CUDAGraph()):
            y = torch.randn(8, device="cuda") + x
            torch.cuda.synchronize()           # not allowed while capturing
    torch.cuda.synchronize()
    torch.manual_seed(5)
    a = torch.randn(1000, device="cuda")
    torch.manual_seed(5)
    assert torch.equal(torch.randn(1000, device="cuda"), a) and a.std() > 0.5
    g = torch.cuda.CUDAGraph()                 # and a good capture still works after it
    with runtime.cuda_graph_capture(g):
        y = x * 2
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, x * 2)


OLD_INDEX = 'scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))'


@pytest.mark.parametrize("numpy_version, source, refused", [
    ("2.4.6", OLD_INDEX, True),           # Triton 3.6's interpreter under numpy 2.4
    ("2.3.5", OLD_INDEX, False),
    ("2.4.6", "lambda self: int(self.handle.data.squeeze())", False),   # Triton 3.9's
    ("3.0.0", OLD_INDEX, True),
])
def test_interpreter_numpy_combination(numpy_version, source, refused):
    problem = runtime.interpreter_problem(numpy_version, source)
    assert (problem is not None) == refused
    if refused:
        assert "numpy < 2.4" in problem and "\n" not in problem


def test_installed_interpreter_is_usable():
    if runtime.is_interpreter():
        runtime.check_interpreter()       # this environment passed configure(): no error
