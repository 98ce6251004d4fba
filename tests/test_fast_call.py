"""The eager call path: kernels/launch.py's planned launches, workspaces and value checks, and
the ops' checks without a host sync before their kernels.

CPU tests drive :class:`Launch` with a stand-in compiled kernel (the launcher a GPU's JIT
returns), and the ops' value checks through Triton's interpreter at tiny shapes; the ``gpu``
tests check that the fast launches give the JIT launches' results bit for bit.
"""
import dsv4lab  # noqa: F401  (sets TRITON_INTERPRET before anything imports triton)

import pytest
import torch
import triton
import triton.language as tl

from dsv4lab.kernels import launch as L
from dsv4lab.ops import fused_moe, indexer_topk, route, sparse_mla_decode, to_cache_slots
from dsv4lab.quant import mxfp4_quantize, pack_kv_fp8

ON_GPU = torch.cuda.is_available()
DEV = torch.device("cuda" if ON_GPU else "cpu")


@triton.jit
def _axpy_kernel(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr, TWICE: tl.constexpr = False):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    v = alpha * tl.load(x_ptr + offs, mask=m) + tl.load(y_ptr + offs, mask=m)
    if TWICE:
        v = v * 2
    tl.store(out_ptr + offs, v, mask=m)


# ------------------------------------------------------------------- Launch (stand-ins) ----

class _Compiled:
    """What the JIT returns on a GPU: ``run`` (the launcher), ``function``, ``packed_metadata``."""

    def __init__(self):
        self.runs = []
        self.function, self.packed_metadata = "function", "metadata"

    def run(self, *args):
        self.runs.append(args)


class _Kernel:
    """A stand-in for a triton.jit kernel: ``kernel[grid](*args, **kw)`` records the JIT call
    and returns one compiled kernel; ``fn`` is the real kernel (its parameters)."""

    def __init__(self, fn):
        self.fn, self.jit_calls, self.compiled = fn, [], _Compiled()

    def __getitem__(self, grid):
        def call(*args, **kw):
            self.jit_calls.append((grid, args, kw))
            return self.compiled
        return call


class _FakeTensor:
    def __init__(self, ptr, dtype=torch.float32):
        self.ptr, self.dtype = ptr, dtype

    def data_ptr(self):
        return self.ptr


@pytest.fixture
def gpu_like(monkeypatch):
    """The launch path as on device 0 of a GPU, with no GPU: current device 0, a fixed raw
    stream, no launch hooks, compiled kernels kept (not the interpreter)."""
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda i: 1234, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(L, "interpreting", lambda: False)
    monkeypatch.setattr(L, "_hooks_active", lambda: False)
    monkeypatch.setattr(L, "_TENSOR", _FakeTensor)         # per-call tensors are the stand-ins


def test_first_call_goes_through_the_jit_then_the_compiled_launcher(gpu_like):
    k = _Kernel(_axpy_kernel)
    launch = L.Launch(k, (3,), dict(n=100, BLOCK=64), device=torch.device("cuda", 0), num_warps=2)
    x, y, out = _FakeTensor(0x1000), _FakeTensor(0x2000), _FakeTensor(0x3000)
    launch(x, y, out, 0.5)
    assert len(k.jit_calls) == 1
    grid, pos, kw = k.jit_calls[0]
    # before the first constexpr by position, the rest (and the options) by name, as by hand
    assert grid == (3, 1, 1) and pos == (x, y, out, 100, 0.5)
    assert kw == dict(BLOCK=64, TWICE=False, num_warps=2)
    launch(x, y, out, 0.25)
    assert len(k.jit_calls) == 1
    (run,) = k.compiled.runs
    # grid, stream, function, metadata, no launch metadata or hooks, every parameter in order
    # tensors as their data pointers (no per-pointer driver query in the launcher)
    assert run == (3, 1, 1, 1234, "function", "metadata", None, None, None,
                   0x1000, 0x2000, 0x3000, 100, 0.25, 64, False)


def test_a_tensor_that_breaks_the_specialisation_takes_the_jit(gpu_like):
    k = _Kernel(_axpy_kernel)
    launch = L.Launch(k, (1,), dict(n=8, BLOCK=16), device=torch.device("cuda", 0))
    x, y, out = _FakeTensor(0x1000), _FakeTensor(0x2000), _FakeTensor(0x3000)
    launch(x, y, out, 1.0)
    launch(_FakeTensor(0x1008), y, out, 1.0)                   # not 16-byte aligned
    launch(_FakeTensor(0x1000, torch.float16), y, out, 1.0)    # another dtype
    assert len(k.jit_calls) == 3 and not k.compiled.runs
    launch(x, y, out, 1.0)
    assert len(k.compiled.runs) == 1


def test_another_current_device_or_a_launch_hook_takes_the_jit(gpu_like, monkeypatch):
    k = _Kernel(_axpy_kernel)
    launch = L.Launch(k, (1,), dict(n=8, BLOCK=16), device=torch.device("cuda", 0))
    args = (_FakeTensor(0x1000), _FakeTensor(0x2000), _FakeTensor(0x3000), 1.0)
    launch(*args)
    monkeypatch.setattr(L, "_hooks_active", lambda: True)
    launch(*args)
    monkeypatch.setattr(L, "_hooks_active", lambda: False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 1, raising=False)
    launch(*args)
    assert len(k.jit_calls) == 3 and not k.compiled.runs


def test_guard_names_the_tensors_each_fast_launch_checks(gpu_like):
    k = _Kernel(_axpy_kernel)
    launch = L.Launch(k, (1,), dict(n=8, BLOCK=16), device=torch.device("cuda", 0), guard=(0,))
    x, y, out = _FakeTensor(0x1000), _FakeTensor(0x2000), _FakeTensor(0x3000)
    launch(x, y, out, 1.0)
    launch(x, y, _FakeTensor(0x3004), 1.0)        # out is the launcher's own: not checked
    launch(_FakeTensor(0x1004), y, out, 1.0)      # x is the caller's: checked
    assert len(k.jit_calls) == 2 and len(k.compiled.runs) == 1


def test_an_unaligned_first_call_keeps_no_compiled_kernel(gpu_like):
    k = _Kernel(_axpy_kernel)
    launch = L.Launch(k, (1,), dict(n=8, BLOCK=16), device=torch.device("cuda", 0))
    launch(_FakeTensor(0x1004), _FakeTensor(0x2000), _FakeTensor(0x3000), 1.0)
    assert launch.compiled is None


def test_launch_refuses_unknown_parameters_and_missing_constexprs():
    with pytest.raises(TypeError, match="no parameter"):
        L.Launch(_axpy_kernel, (1,), dict(N=8, BLOCK=16), device=torch.device("cpu"))
    with pytest.raises(TypeError, match="BLOCK"):
        L.Launch(_axpy_kernel, (1,), dict(n=8), device=torch.device("cpu"))


def test_launch_in_the_interpreter_computes_the_kernel():
    x, y = torch.arange(10.0), torch.ones(10)
    out = torch.empty(10)
    launch = L.Launch(_axpy_kernel, (1,), dict(n=10, BLOCK=16, TWICE=True),
                      device=torch.device("cpu"))
    for alpha in (0.5, 2.0):
        launch(x, y, out, alpha)
        torch.testing.assert_close(out, 2 * (alpha * x + y))
    assert launch.compiled is None          # the interpreter's calls are JIT calls


# ------------------------------------------------------------- workspaces, value flags ----

def test_workspace_is_kept_per_key_and_fresh_for_meta_and_large_buffers():
    cpu = torch.device("cpu")
    a = L.workspace(("test ws", 4), cpu, lambda: torch.empty(4))
    assert L.workspace(("test ws", 4), cpu, lambda: torch.empty(4)) is a
    assert L.workspace(("test ws", 8), cpu, lambda: torch.empty(8)) is not a
    meta = torch.device("meta")
    assert L.workspace(("test ws", 4), meta, lambda: torch.empty(4, device=meta)) is not \
        L.workspace(("test ws", 4), meta, lambda: torch.empty(4, device=meta))
    big = L.WORKSPACE_MAX_BYTES // 4 + 1
    assert L.workspace(("test ws big",), cpu, lambda: torch.empty(big)) is not \
        L.workspace(("test ws big",), cpu, lambda: torch.empty(big))


@triton.jit
def _report_kernel(bad_ptr, flag_ptr, host_ptr, slot, stamp):
    """A check kernel's shape: each program's verdict (one of several) into report_verdict."""
    L.report_verdict(flag_ptr, host_ptr, slot, stamp, tl.load(bad_ptr + tl.program_id(0)))


def test_the_last_program_of_a_check_reports_the_verdict_to_the_host_word():
    """Good, bad in one of five programs, good again: the host word tells each call from the
    earlier ones, and every ticket is reset for the slot's next use."""
    cpu = torch.device("cpu")
    got = []
    for bad in ([0] * 5, [0, 0, 1, 0, 0], [0] * 5):
        verdict = L.value_check(cpu)
        _report_kernel[(5,)](torch.tensor(bad, dtype=torch.int32), *verdict.args)
        got.append(verdict.failed())
    assert got == [False, True, False]
    ring = verdict.ring
    assert int(ring.flags[L.RING:].abs().sum()) == 0


def test_a_check_that_did_not_report_is_not_a_pass(monkeypatch):
    monkeypatch.setattr(L, "SPIN_S", 0.001)
    assert L.value_check(torch.device("cpu")).failed()


# ----------------------------------------------------------------- the ops' value checks ----

def _attention_case(fp8=False):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 1, 16, 64 if not fp8 else 512, generator=g).to(torch.bfloat16)
    kv = torch.randn(12, q.shape[-1], generator=g)
    kv = pack_kv_fp8(kv) if fp8 else kv.to(torch.bfloat16)
    idx = torch.randint(-1, 12, (2, 1, 8), generator=g, dtype=torch.int32)
    return q.to(DEV), kv.to(DEV), idx.to(DEV)


@pytest.mark.parametrize("bad", [12, 99, -2])
def test_sparse_mla_bad_index_raises_after_the_kernels_without_reading_outside(bad):
    q, kv, idx = _attention_case()
    good = sparse_mla_decode(q, kv, idx, d_v=64, backend="mma")
    idx[1, 0, 3] = bad
    with pytest.raises(ValueError, match=f"indices must be -1 .* found {bad}"):
        sparse_mla_decode(q, kv, idx, d_v=64, backend="mma")
    # the kernels saw the bad index as -1: the rows not using it are the good call's
    safe = idx.clone()
    safe[1, 0, 3] = -1
    out, lse = sparse_mla_decode(q, kv, safe, d_v=64, backend="mma", validate=False)
    torch.testing.assert_close(out[0], good[0][0])
    assert torch.equal(idx[1, 0, 3], torch.tensor(bad, dtype=torch.int32, device=DEV))


def test_sparse_mla_check_kernel_reads_the_fp8_scale_bytes_of_selected_rows():
    q, kv, idx = _attention_case(fp8=True)
    idx[:] = torch.tensor([0, 1, 2, -1, 3, 4, -1, 5], dtype=torch.int32)
    kv[9, 579] = 255                                   # a row nothing selects
    sparse_mla_decode(q, kv, idx, backend="mma")
    kv[4, 577] = 255
    with pytest.raises(ValueError, match="scale byte of 255"):
        sparse_mla_decode(q, kv, idx, backend="mma")


def test_repeated_calls_reuse_the_plan_and_agree():
    q, kv, idx = _attention_case()
    first = sparse_mla_decode(q, kv, idx, d_v=64, backend="mma")
    for _ in range(2):
        again = sparse_mla_decode(q, kv, idx, d_v=64, backend="mma")
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
        assert again[0].data_ptr() != first[0].data_ptr()        # outputs are fresh tensors


def _experts(E=3, H=64, I=32):
    g = torch.Generator().manual_seed(5)
    w13, s13 = mxfp4_quantize(torch.randn(E, 2 * I, H, generator=g) * 0.1)
    w2, s2 = mxfp4_quantize(torch.randn(E, H, I, generator=g) * 0.1)
    return [t.to(DEV) for t in (w13, s13, w2, s2)]


@pytest.mark.parametrize("what", ["id", "weight", "x"])
def test_fused_moe_bad_routing_raises_after_the_kernels(what):
    w13, s13, w2, s2 = _experts()
    x = torch.randn(3, 64, device=DEV)
    ids, w = route(torch.randn(3, 3, device=DEV), None, topk=2)
    fused_moe(x, w13, s13, w2, s2, ids, w, backend="triton")
    message = {"id": r"topk_ids must lie in \[-1, E=3\)", "weight": "topk_weights contains NaN",
               "x": "x contains NaN"}[what]
    if what == "id":
        ids = ids.clone()
        ids[1, 0] = 7
    elif what == "weight":
        w = w.clone()
        w[2, 1] = float("nan")
    else:
        x = x.clone()
        x[0, 5] = float("inf")
    with pytest.raises(ValueError, match=message):
        fused_moe(x, w13, s13, w2, s2, ids, w, backend="triton")


def _indexer_case(B=2, S=1, P=6, page=4, H=2, D=16, max_pages=3):
    g = torch.Generator().manual_seed(7)
    q = torch.randn(B, S, H, D, generator=g)
    k = torch.randn(P, page, D, generator=g)
    ks = torch.rand(P, page, generator=g) + 0.5
    w = torch.randn(B, S, H, generator=g)
    bt = torch.randint(0, P, (B, max_pages), generator=g, dtype=torch.int32)
    cl = torch.tensor([[9], [5]], dtype=torch.int32)[:B, :S]
    return [t.to(DEV) for t in (q, k, ks, w, bt, cl)]


def test_indexer_bad_page_id_raises_after_the_kernels_and_an_invisible_one_is_fine():
    q, k, ks, w, bt, cl = _indexer_case()
    want = indexer_topk(q, k, ks, w, bt, cl, topk=4, backend="triton")
    bt[1, 2] = 1000                          # row 1 sees 5 entries: pages 0 and 1 only
    assert torch.equal(indexer_topk(q, k, ks, w, bt, cl, topk=4, backend="triton"), want)
    bt[0, 2] = -3                            # row 0 sees 9 entries: page 2 is visible
    with pytest.raises(ValueError, match=r"block_table entries of visible pages .* got -3"):
        indexer_topk(q, k, ks, w, bt, cl, topk=4, backend="triton")
    cl[1, 0] = 13
    bt[0, 2] = 0
    with pytest.raises(ValueError, match=r"context_lens must lie in \[0, L = 12\]"):
        indexer_topk(q, k, ks, w, bt, cl, topk=4, backend="triton")


def test_cache_slots_kernel_matches_the_torch_mapping():
    from dsv4lab.kernels import indexer as K
    g = torch.Generator().manual_seed(9)
    bt = torch.randint(0, 50, (3, 4), generator=g, dtype=torch.int32)
    for dtype in (torch.int32, torch.int64):
        idx = torch.randint(-1, 16, (3, 2, 5), generator=g).to(dtype)
        want = to_cache_slots(idx, bt, 4)                         # CPU: torch
        assert torch.equal(K.cache_slots(idx, bt, 4), want)       # the kernel (interpreter)
        verdict = L.value_check(idx.device)
        idx[2, 1, 4] = 16
        K.cache_slots(idx, bt, 4, check=verdict)
        assert verdict.failed()
    with pytest.raises(ValueError, match="indices must be -1 or logical positions"):
        to_cache_slots(idx, bt, 4)


# ------------------------------------------------------------------------------ GPU ----

@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_fast_launches_match_the_jit_launches_bit_for_bit():
    """The compiled kernel's launcher after the first call gives the JIT launch's bits, for
    each family's eager call (the second call of a plan is a fast launch)."""
    q, kv, idx = _attention_case()
    calls = [
        lambda: sparse_mla_decode(q, kv, idx, d_v=64, backend="mma"),
        lambda: sparse_mla_decode(*_attention_case(fp8=True), backend="mma"),
    ]
    w13, s13, w2, s2 = _experts()
    x = torch.randn(3, 64, device=DEV)
    ids, w = route(torch.randn(3, 3, device=DEV), None, topk=2)
    calls.append(lambda: (fused_moe(x, w13, s13, w2, s2, ids, w, backend="triton"),))
    ic = _indexer_case()
    calls.append(lambda: (indexer_topk(*ic, topk=4, backend="triton"),))
    for call in calls:
        first = call()
        torch.cuda.synchronize()
        for _ in range(3):
            again = call()
            for a, b in zip(first, again):
                assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_verdicts_reach_pinned_host_memory_while_the_ops_kernels_still_run():
    """The check kernel's last program writes the verdict over the bus: the host reads it
    (good, bad in one of 300 programs, good) while a long kernel queued behind the check still
    runs; a check that never ran is not a pass (after the spin, a stream sync)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    got = []
    for bad_program in (None, 217, None):
        bad = torch.zeros(300, dtype=torch.int32, device=dev)
        if bad_program is not None:
            bad[bad_program] = 1
        verdict = L.value_check(dev)
        _report_kernel[(300,)](bad, *verdict.args)
        torch.cuda._sleep(50_000_000)                            # the op's kernels, still running
        got.append((verdict.failed(), torch.cuda.current_stream().query()))
    assert got == [(False, False), (True, False), (False, False)]
    assert verdict.ring.host.is_pinned()
    assert L.value_check(dev).failed()
