"""The ops as torch.library custom ops: fake implementations that agree with the real outputs,
and the mini model's decode step under torch.compile (fullgraph) matching the eager step.

CPU: the step is compiled with the "aot_eager" backend (the custom ops' fake implementations
trace it, the kernels run in Triton's interpreter when the graph runs); the ``gpu`` test
compiles it with inductor and mode="reduce-overhead" (a CUDA graph of the whole step).
"""
import dsv4lab  # noqa: F401  (sets TRITON_INTERPRET before anything imports triton)

import pytest
import torch

from dsv4lab import ops
from dsv4lab.engine import Engine
from dsv4lab.model import DSV4, make_meta, tiny_config
from dsv4lab.ops import library
from dsv4lab.quant import mxfp4_quantize

ON_GPU = torch.cuda.is_available()
DEV = torch.device("cuda" if ON_GPU else "cpu")
KERNELS = {"sparse_mla_decode": "mma", "indexer_topk": "triton", "fused_moe": "triton",
           "mhc": "triton", "linear": "triton"}


def test_every_public_op_is_a_custom_op():
    for name in library.OPS:
        assert hasattr(torch.ops.dsv4lab, name), name
    assert set(library.OPS) == set(ops.__all__)


def _fake_agrees(op, *args, **kwargs):
    """The custom op on fake tensors gives the real call's shapes and dtypes."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    real = op(*args, **kwargs)
    real = real if isinstance(real, tuple) else (real,)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake = op(*fake_args, **kwargs)
    fake = fake if isinstance(fake, tuple) else (fake,)
    assert len(fake) == len(real)
    for f, r in zip(fake, real):
        assert f.shape == r.shape and f.dtype == r.dtype, (op, f.shape, r.shape, f.dtype, r.dtype)


def test_fake_implementations_match_the_real_outputs():
    g = torch.Generator().manual_seed(0)
    d = torch.ops.dsv4lab
    q = torch.randn(2, 1, 16, 32, generator=g)
    kv = torch.randn(10, 32, generator=g)
    idx = torch.randint(-1, 10, (2, 1, 6), generator=g, dtype=torch.int32)
    sink = torch.randn(16, generator=g)
    _fake_agrees(d.sparse_mla_decode, q, kv, idx, sink, d_v=32, softmax_scale=None,
                 backend="torch")
    iq = torch.randn(2, 1, 2, 16, generator=g)
    k = torch.randn(4, 4, 16, generator=g)
    ks = torch.rand(4, 4, generator=g)
    w = torch.randn(2, 1, 2, generator=g)
    bt = torch.randint(0, 4, (2, 3), generator=g, dtype=torch.int32)
    cl = torch.tensor([[7], [3]], dtype=torch.int32)
    for mc in (None, 10):
        _fake_agrees(d.indexer_logits, iq, k, ks, w, bt, cl, max_context=mc,
                     backend="torch_fallback")
        _fake_agrees(d.indexer_topk, iq, k, ks, w, bt, cl, max_context=mc, topk=3,
                     backend="torch_fallback")
    _fake_agrees(d.to_cache_slots, torch.randint(-1, 12, (2, 1, 3), dtype=torch.int32), bt, 4)
    logits = torch.randn(3, 8, generator=g)
    _fake_agrees(d.route, logits, torch.randn(8, generator=g), topk=2, score="sqrtsoftplus",
                 routed_scaling_factor=1.5, norm_topk_prob=True)
    table = torch.randint(0, 8, (20, 2), generator=g, dtype=torch.int32)
    tokens = torch.randint(0, 20, (3,), generator=g)
    for lg in (None, logits):
        _fake_agrees(d.hash_route, tokens, table, lg, score="sqrtsoftplus",
                     routed_scaling_factor=1.5, norm_topk_prob=True)
    w13, s13 = mxfp4_quantize(torch.randn(3, 64, 64, generator=g) * 0.1)
    w2, s2 = mxfp4_quantize(torch.randn(3, 64, 32, generator=g) * 0.1)
    ids, tw = ops.route(torch.randn(2, 3, generator=g), None, topk=2)
    _fake_agrees(d.fused_moe, torch.randn(2, 64, generator=g), w13, s13, w2, s2, ids, tw, None,
                 None, fmt="mxfp4", swiglu_limit=10.0, backend="torch")
    x = torch.randn(2, 3, 2, 16, generator=g)
    n, dd = 2, 16
    fn = torch.randn((2 + n) * n, n * dd, generator=g) * 0.1
    base = torch.randn((2 + n) * n, generator=g)
    scale = torch.rand(3, generator=g)
    _fake_agrees(d.mhc_pre, x, fn, base, scale, iters=3, eps=1e-6, backend="torch")
    y, post, comb = ops.mhc_pre(x, fn, base, scale, iters=3)
    _fake_agrees(d.mhc_post, y, x, post, comb, backend="torch")
    _fake_agrees(d.mhc_head, x, fn[:n], base[:n], eps=1e-6, backend="torch")
    _fake_agrees(d.linear, torch.randn(3, 16, generator=g), torch.randn(5, 16, generator=g),
                 None, block=[128, 128], groups=1, backend="torch")


def test_eager_calls_do_not_go_through_the_dispatcher(monkeypatch):
    """Outside torch.compile the public functions never call their custom op."""
    def boom(*args, **kwargs):
        raise AssertionError("an eager call went through the custom op")
    for name in library.OPS:
        monkeypatch.setattr(torch.ops.dsv4lab, name, boom, raising=False)
    q = torch.randn(1, 1, 16, 32)
    kv = torch.randn(8, 32)
    ops.sparse_mla_decode(q, kv, torch.zeros(1, 1, 4, dtype=torch.int32), d_v=32,
                          backend="torch")
    ops.route(torch.randn(2, 8), None, topk=2)


# --------------------------------------------------------- the mini model's decode step ----

def _step_setup(device, backends):
    torch.manual_seed(0)
    m = DSV4(tiny_config()).eval().to(device)
    m.quantize_experts("mxfp4")
    eng = Engine(m, max_batch=2, max_len=32, page_size=8, backends=backends)
    raw = [eng.cache.alloc(eng.n_raw) for _ in range(2)]
    comp = [eng.cache.alloc(eng.n_comp) for _ in range(2)]
    bt = torch.tensor(raw, dtype=torch.int32, device=device)
    cbt = torch.tensor(comp, dtype=torch.int32, device=device)
    toks = torch.randint(0, m.cfg.vocab_size, (2, 1), device=device)
    pos = torch.full((2, 1), 5, device=device)
    meta = make_meta(m.cfg, pos, bt, cbt, eng.page_size, eng.ratios)
    return m, eng, toks, meta


def _snapshot(caches):
    return [{k: v.clone() for k, v in vars(c).items() if isinstance(v, torch.Tensor)}
            for c in caches]


def _restore(caches, snap):
    for c, s in zip(caches, snap):
        for k, v in s.items():
            getattr(c, k).copy_(v)


def _compare_compiled(device, backends, **compile_kw):
    m, eng, toks, meta = _step_setup(device, backends)
    caches = eng.cache.main
    before = _snapshot(caches)

    def step(tokens):
        return m.forward_decode(tokens, meta, caches, backends)

    with torch.no_grad():
        want, _ = step(toks)
        _restore(caches, before)
        compiled = torch.compile(step, fullgraph=True, **compile_kw)
        for _ in range(2 if compile_kw.get("mode") == "reduce-overhead" else 1):
            _restore(caches, before)
            got, _ = compiled(toks)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


def test_the_decode_step_traces_without_graph_breaks():
    m, eng, toks, meta = _step_setup(torch.device("cpu"), KERNELS)
    with torch.no_grad():
        explain = torch._dynamo.explain(
            lambda t: m.forward_decode(t, meta, eng.cache.main, KERNELS))(toks)
    assert explain.graph_break_count == 0, explain.break_reasons
    names = {str(n.target) for g in explain.graphs for n in g.graph.nodes
             if n.op == "call_function"}
    for op in ("sparse_mla_decode", "indexer_topk", "to_cache_slots", "fused_moe", "mhc_pre",
               "mhc_post", "mhc_head", "linear"):
        assert any(f"dsv4lab.{op}" in n for n in names), op


def test_the_compiled_decode_step_matches_eager_on_the_cpu():
    _compare_compiled(torch.device("cpu"), KERNELS, backend="aot_eager")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_the_compiled_decode_step_matches_eager_in_a_cuda_graph():
    _compare_compiled(torch.device("cuda"), KERNELS, mode="reduce-overhead")
