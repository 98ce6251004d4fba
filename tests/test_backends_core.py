"""dsv4lab.backends: the registry core (on private op names, removed after each test)."""
import itertools

import pytest
from hypothesis import given, settings, strategies as st

from dsv4lab import backends
from dsv4lab.backends import BackendUnavailable, Target, register, resolve

H200 = Target("cuda", (9, 0))
A100 = Target("cuda", (8, 0))
B200 = Target("cuda", (10, 0))
RTX_PRO = Target("cuda", (12, 0))
CPU_INTERP = Target("cpu", None, True)
CPU = Target("cpu", None, False)


@pytest.fixture
def op(request):
    name = f"_test_op_{request.node.name}"
    yield name
    backends._REGISTRY.pop(name, None)


def make_moe_like(op):
    calls = []

    @register(op, "torch", kind="torch", priority=0)
    def ref(x):
        calls.append("torch")
        return ("torch", x)

    @register(op, "triton", kind="triton", priority=20, min_capability=(8, 0))
    def tri(x):
        calls.append("triton")
        return ("triton", x)

    @register(op, "trtllm", kind="external", priority=30, formats=["mxfp4", "nvfp4"],
              min_capability=(10, 0), max_capability=(10, 3))
    def ext(x):
        calls.append("trtllm")
        return ("trtllm", x)
    return calls


def test_auto_picks_the_best_supported(op):
    make_moe_like(op)
    assert resolve(op, target=B200, fmt="mxfp4").name == "trtllm"
    assert resolve(op, target=H200, fmt="mxfp4").name == "triton"
    # the campaign's crash: sm_120 is not sm_100; auto must not pick the SM100-only kernel
    assert resolve(op, target=RTX_PRO, fmt="mxfp4").name == "triton"
    assert resolve(op, target=CPU_INTERP).name == "triton"
    assert resolve(op, target=CPU).name == "torch"


def test_explicit_override_wins_over_priority(op):
    make_moe_like(op)
    b = resolve(op, "torch", target=B200)
    assert b.name == "torch" and b.fn(3) == ("torch", 3)


def test_explicit_unavailable_fails_at_once_with_the_reason(op):
    calls = make_moe_like(op)
    with pytest.raises(BackendUnavailable) as e:
        resolve(op, "trtllm", target=RTX_PRO, fmt="mxfp4")
    msg = str(e.value)
    assert "trtllm" in msg and "sm_100..sm_103" in msg and "sm_120" in msg
    with pytest.raises(BackendUnavailable, match="sm_100..sm_103; this is the CPU"):
        resolve(op, "trtllm", target=CPU_INTERP)
    with pytest.raises(BackendUnavailable, match="needs a CUDA GPU of sm_80 or newer; this is the CPU"):
        resolve(op, "triton", target=CPU)
    assert calls == []          # nothing ran


def test_unknown_backend_lists_the_choices(op):
    make_moe_like(op)
    with pytest.raises(BackendUnavailable, match="unknown backend 'cutlass'.*auto, torch, triton, trtllm"):
        resolve(op, "cutlass", target=H200)


def test_formats_filter_and_explain(op):
    make_moe_like(op)

    @register(op, "mx_only", kind="triton", priority=25, formats=["mxfp4"], min_capability=(9, 0))
    def mx(x):
        return x

    assert resolve(op, target=H200, fmt="mxfp4").name == "mx_only"
    assert resolve(op, target=H200, fmt="nvfp4").name == "triton"
    with pytest.raises(BackendUnavailable, match="does not take format 'nvfp4' \\(takes mxfp4\\)"):
        resolve(op, "mx_only", target=H200, fmt="nvfp4")


def test_requires_and_auto_false(op):
    @register(op, "needs_lib", kind="torch", priority=50, requires=lambda: "flashinfer is not installed")
    def a(x):
        return x

    @register(op, "manual", kind="torch", priority=40, auto=False)
    def b(x):
        return x

    @register(op, "plain", kind="torch", priority=1)
    def c(x):
        return x

    assert resolve(op, target=H200).name == "plain"
    assert resolve(op, "manual", target=H200).name == "manual"
    with pytest.raises(BackendUnavailable, match="flashinfer is not installed"):
        resolve(op, "needs_lib", target=H200)


def test_triton_on_the_cpu_needs_the_interpreter(op):
    @register(op, "portable", kind="triton", priority=5)
    def a(x):
        return x

    assert resolve(op, target=CPU_INTERP).name == "portable"
    with pytest.raises(BackendUnavailable, match="interpreter is off"):
        resolve(op, "portable", target=CPU)


def test_interpreter_false_triton_backend(op):
    @register(op, "gpu_only", kind="triton", priority=5, interpreter=False)
    def a(x):
        return x

    with pytest.raises(BackendUnavailable, match="does not run in Triton's interpreter"):
        resolve(op, "gpu_only", target=CPU_INTERP)
    with pytest.raises(BackendUnavailable, match="no backend can run on the CPU \\(Triton interpreter\\)"):
        resolve(op, target=CPU_INTERP)
    assert resolve(op, target=A100).name == "gpu_only"


def test_dispatch_table(op):
    make_moe_like(op)
    rows = backends.dispatch_table(op, [B200, H200, RTX_PRO, CPU], fmt="mxfp4")
    assert [r["auto"] for r in rows] == ["trtllm", "triton", "triton", "torch"]
    assert rows[0]["trtllm"] == "ok"
    assert "sm_100..sm_103" in rows[2]["trtllm"]
    assert [r["target"] for r in rows] == ["sm_100", "sm_90", "sm_120", "the CPU"]


def test_dispatch_table_reports_no_backend(op):
    @register(op, "ext", kind="external", min_capability=(10, 0))
    def a(x):
        return x
    rows = backends.dispatch_table(op, [H200])
    assert rows[0]["auto"].startswith("(none)") and "sm_100" in rows[0]["auto"]


def test_bad_registration_and_unknown_op(op):
    with pytest.raises(ValueError, match="kind must be"):
        register(op, "x", kind="cuda")
    with pytest.raises(KeyError):
        resolve("_no_such_op_", target=H200)
    with pytest.raises(KeyError):
        backends.backends("_no_such_op_")


def test_backends_sorted_best_first(op):
    make_moe_like(op)
    assert [b.name for b in backends.backends(op)] == ["trtllm", "triton", "torch"]
    assert op in backends.ops()


def test_target_current_matches_runtime():
    from dsv4lab import runtime
    t = Target.current()
    if runtime.has_cuda():
        assert t.device == "cuda" and t.capability == runtime.capability()
    else:
        assert t.device == "cpu" and t.interpreter == runtime.is_interpreter()
    assert Target.current("cpu").device == "cpu"


CAPS = [None, (8, 0), (8, 9), (9, 0), (10, 0), (10, 3), (12, 0)]
TARGETS = [Target("cuda", c) for c in CAPS if c] + [CPU, CPU_INTERP]


@settings(max_examples=25, deadline=None)
@given(specs=st.lists(st.tuples(st.sampled_from(["torch", "triton", "external"]), st.integers(0, 50),
                                st.sampled_from(CAPS), st.sampled_from(CAPS), st.booleans(), st.booleans(),
                                st.sampled_from([None, ("mxfp4",), ("nvfp4",), ("mxfp4", "nvfp4")])),
                      min_size=1, max_size=5),
       target=st.sampled_from(TARGETS), fmt=st.sampled_from([None, "mxfp4", "nvfp4"]))
def test_auto_is_the_best_available(specs, target, fmt):
    op = "_test_op_hypothesis"
    backends._REGISTRY.pop(op, None)
    try:
        for i, (kind, prio, lo, hi, interp, auto, formats) in enumerate(specs):
            register(op, f"b{i}", kind=kind, priority=prio, min_capability=lo, max_capability=hi,
                     interpreter=interp, auto=auto, formats=formats)(lambda x: x)
        avail = [b for b in backends.backends(op) if b.auto and b.unavailable_reason(target, fmt) is None]
        if avail:
            chosen = resolve(op, target=target, fmt=fmt)
            assert chosen.unavailable_reason(target, fmt) is None and chosen.auto
            assert chosen.priority == max(b.priority for b in avail)
        else:
            with pytest.raises(BackendUnavailable):
                resolve(op, target=target, fmt=fmt)
        # an explicit name resolves exactly when that backend is available
        for b in backends.backends(op):
            if b.unavailable_reason(target, fmt) is None:
                assert resolve(op, b.name, target=target, fmt=fmt) is b
            else:
                with pytest.raises(BackendUnavailable, match=b.name):
                    resolve(op, b.name, target=target, fmt=fmt)
    finally:
        backends._REGISTRY.pop(op, None)
