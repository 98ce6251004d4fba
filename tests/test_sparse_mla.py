"""sparse_mla_decode: every backend against the fp32 torch reference, and the input checks.

CPU runs go through Triton's interpreter at tiny shapes; the ``gpu`` tests use the real
DeepSeek-V4 shapes (H 64, D 512, topk 2048, B up to 128) with fresh random data.
"""
import dsv4lab  # noqa: F401  (sets TRITON_INTERPRET before anything imports triton)

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from dsv4lab import backends
from dsv4lab.backends import BackendUnavailable
from dsv4lab.ops import sparse_mla_decode
from dsv4lab.quant import pack_kv_fp8

# Tolerances against the fp32 reference run on the same (rounded) inputs.
# fp32: the kernels accumulate in fp32 (tl.dot with input_precision="ieee"): 1e-4.
# bf16/fp16: P is rounded to the KV dtype before P @ V and out is rounded to bf16
#   (8 mantissa bits, 2^-8 relative): 2e-2 absolute + relative on outputs of size ~1.
# lse is always fp32 from fp32-accumulated scores: 1e-3 (bf16) / 1e-4 (fp32).
# FP8 KV: the reference dequantises the same packed cache, so the bf16 tolerance holds.
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=1e-2, rtol=1e-2)}
LSE_TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-3, torch.float16: 1e-3}

ON_GPU = torch.cuda.is_available()
DEV = torch.device("cuda" if ON_GPU else "cpu")


def make_case(B, S, H, D, N, topk, *, dtype=torch.bfloat16, paged=None, empty_frac=0.2,
              dup_frac=0.1, empty_rows=(), fp8=False, sink=False, seed=0, device=DEV):
    """Random q, kv (flat, paged (page, with_unit_dim)), indices with -1s and duplicates."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, H, D, generator=g).to(dtype)
    kv = torch.randn(N, D, generator=g)
    kv = pack_kv_fp8(kv) if fp8 else kv.to(dtype)
    idx = torch.randint(0, N, (B, S, topk), generator=g, dtype=torch.int32)
    drop = torch.rand(B, S, topk, generator=g) < empty_frac
    idx[drop] = -1
    if topk > 1:
        dup = torch.rand(B, S, topk, generator=g) < dup_frac
        idx[..., 1:][dup[..., 1:]] = idx[..., :1].expand(B, S, topk - 1)[dup[..., 1:]]
    for b, s in empty_rows:
        idx[b, s] = -1
    attn_sink = torch.randn(H, generator=g) if sink else None
    if paged:
        page, unit = paged
        pad = (-N) % page
        kv = torch.cat([kv, kv[:1].expand(pad, -1)])            # extra rows never indexed
        kv = kv.view(-1, page, 1, kv.shape[-1]) if unit else kv.view(-1, page, kv.shape[-1])
    to = lambda t: None if t is None else t.to(device)           # noqa: E731
    return to(q), to(kv), to(idx), to(attn_sink)


def check_against_reference(q, kv, idx, sink, backend, d_v, scale=None):
    out, lse = sparse_mla_decode(q, kv, idx, d_v=d_v, softmax_scale=scale, attn_sink=sink,
                                 backend=backend)
    ref, ref_lse = sparse_mla_decode(q, kv, idx, d_v=d_v, softmax_scale=scale, attn_sink=sink,
                                     backend="torch")
    return assert_matches_reference(q, out, lse, ref, ref_lse)


def assert_matches_reference(q, out, lse, ref, ref_lse, out_atol_factor=1):
    """(out, lse) of a kernel against the fp32 reference's, at q's dtype tolerance (the
    output's atol times ``out_atol_factor`` where V's scale grows it): the same shapes and
    dtypes, lse finite exactly where the reference's is, -inf elsewhere."""
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert lse.shape == ref_lse.shape and lse.dtype == torch.float32
    torch.testing.assert_close(out.float(), ref.float(), atol=out_atol_factor * TOL[q.dtype]["atol"],
                               rtol=TOL[q.dtype]["rtol"])
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse))
    torch.testing.assert_close(lse[fin], ref_lse[fin], atol=LSE_TOL[q.dtype], rtol=0)
    assert (lse[~fin] == float("-inf")).all()
    return out, lse


# ---- The reference itself, against a per-element loop ----

def test_reference_matches_loop():
    q, kv, idx, sink = make_case(2, 2, 3, 16, 10, 6, dtype=torch.float32, sink=True,
                                 empty_rows=[(1, 1)], device="cpu")
    out, lse = sparse_mla_decode(q, kv, idx, d_v=8, attn_sink=sink, backend="torch")
    for b in range(2):
        for s in range(2):
            js = [j for j in idx[b, s].tolist() if j >= 0]
            for h in range(3):
                logits = torch.tensor([(q[b, s, h] @ kv[j]).item() / 4.0 for j in js] + [sink[h].item()])
                w = torch.softmax(logits, 0)
                want = sum((w[i] * kv[j, :8] for i, j in enumerate(js)), torch.zeros(8))
                torch.testing.assert_close(out[b, s, h], want, atol=1e-5, rtol=1e-5)
                assert abs(lse[b, s, h].item() - torch.logsumexp(logits, 0).item()) < 1e-5


# ---- Kernels against the reference (interpreter on the CPU) ----

@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(B=st.integers(1, 3), S=st.integers(1, 4), H=st.integers(1, 5), D=st.sampled_from([16, 48, 64]),
       topk=st.integers(1, 40), dv_frac=st.sampled_from([1.0, 0.5]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), sink=st.booleans(),
       paged=st.sampled_from([None, (4, False), (8, True)]), seed=st.integers(0, 2**16))
def test_simt_matches_reference(B, S, H, D, topk, dv_frac, dtype, sink, paged, seed):
    q, kv, idx, snk = make_case(B, S, H, D, 37, topk, dtype=dtype, sink=sink, paged=paged,
                                seed=seed, empty_rows=[(B - 1, S - 1)] if seed % 3 == 0 else ())
    check_against_reference(q, kv, idx, snk, "simt", d_v=max(1, int(D * dv_frac)))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(B=st.integers(1, 3), S=st.integers(1, 4), H=st.sampled_from([16, 20, 32]),
       D=st.sampled_from([32, 64]), topk=st.integers(1, 140), dv_frac=st.sampled_from([1.0, 0.75, 0.25]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), sink=st.booleans(),
       paged=st.sampled_from([None, (4, False), (8, True)]), seed=st.integers(0, 2**16))
def test_mma_matches_reference(B, S, H, D, topk, dv_frac, dtype, sink, paged, seed):
    # also catches the interpreter's broken bf16 tl.dot (the kernel must upcast there)
    q, kv, idx, snk = make_case(B, S, H, D, 37, topk, dtype=dtype, sink=sink, paged=paged,
                                seed=seed, empty_rows=[(0, 0)] if seed % 3 == 0 else ())
    check_against_reference(q, kv, idx, snk, "mma", d_v=max(1, int(D * dv_frac)))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(B=st.integers(1, 2), S=st.integers(1, 3), topk=st.integers(1, 40), sink=st.booleans(),
       paged=st.sampled_from([None, (4, True)]), seed=st.integers(0, 2**16))
def test_mma_fp8_matches_reference(B, S, topk, sink, paged, seed):
    q, kv, idx, snk = make_case(B, S, 16, 512, 50, topk, fp8=True, sink=sink, paged=paged, seed=seed)
    assert kv.dtype == torch.uint8
    check_against_reference(q, kv, idx, snk, "mma", d_v=512)


def _mma(q, kv, idx, sink, d_v, config=None, **kw):
    """Lesson 2's launcher with ``config`` (the interpreter's by default)."""
    from dsv4lab.kernels.attention import dispatch, mma
    return mma.sparse_mla_mma(q, kv.reshape(-1, kv.shape[-1]), idx,
                              None if sink is None else sink.float(), q.shape[-1] ** -0.5, d_v,
                              config or dispatch.INTERPRETER, **kw)


@pytest.mark.parametrize("splits", [1, 2, 3])
@pytest.mark.parametrize("sink", [False, True])
def test_mma_split_kv_matches_unsplit(splits, sink):
    """Split-KV + combine gives the reference's answer, incl. splits that see only -1."""
    q, kv, idx, snk = make_case(1, 2, 16, 32, 60, 150, dtype=torch.float32, sink=sink)
    idx[0, 1, 64:] = -1                        # splits 2 and 3 of query 1 are empty
    idx[0, 0, :] = -1                          # query 0 has nothing at all
    out, lse = _mma(q, kv, idx, snk, 32, num_splits=splits)
    ref, ref_lse = sparse_mla_decode(q, kv, idx, d_v=32, attn_sink=snk, backend="torch")
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=0)


@pytest.mark.parametrize("B, S, H", [(1, 1, 3), (2, 1, 16), (1, 2, 64), (3, 1, 64)])
@pytest.mark.parametrize("sink", [False, True])
@pytest.mark.parametrize("splits, part_dtype", [(3, torch.float32), (40, torch.float32),
                                                (3, torch.bfloat16), (2, torch.float32),
                                                (2, torch.bfloat16)])
def test_combine_splits_both_kernels(B, S, H, sink, splits, part_dtype):
    """The split-KV combine against a torch merge of the same partials, on both of its
    kernels (one head a program with few queries, 8 heads a program with B*S_q*H >= 16 x
    SMs; the CPU counts as 8 SMs, so there the last two shapes take the 8-head kernel), with
    3 and 40 splits (more than a 32-wide block of them): empty splits (lse -inf), a query with
    nothing at all; fp32 partials (fp32 q) and bf16 ones (16-bit q)."""
    from dsv4lab.kernels.attention.mma import combine_splits
    d_v = 48
    g = torch.Generator().manual_seed(B * 100 + H)
    opart = torch.randn(B * S, splits, H, d_v, generator=g).to(part_dtype)
    lpart = torch.randn(B * S, splits, H, generator=g) * 4
    lpart[0, 1] = float("-inf")                      # an empty split for every head
    lpart[-1, :, 0] = float("-inf")                  # head 0 of the last query: nothing
    snk = torch.randn(H, generator=g) if sink else None
    out = torch.empty(B, S, H, d_v, device=DEV)
    lse = torch.empty(B, S, H, device=DEV)
    combine_splits(opart.reshape(-1).to(DEV), lpart.reshape(-1).to(DEV),
                   None if snk is None else snk.to(DEV), out, lse, splits)
    out, lse = out.cpu(), lse.cpu()
    m = lpart.max(dim=1).values
    if sink:
        m = torch.maximum(m, snk * math.log2(math.e))
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    w = torch.exp2(lpart - m[:, None])
    denom = w.sum(dim=1) + (torch.exp2(snk * math.log2(math.e) - m) if sink else 0)
    ref = (w[..., None] * opart.float()).sum(dim=1) / torch.where(denom > 0, denom, 1.0)[..., None]
    ref_lse = torch.where(denom > 0, (m + torch.log2(denom)) * math.log(2), float("-inf"))
    torch.testing.assert_close(out.reshape(B * S, H, d_v), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.reshape(B * S, H), ref_lse, atol=1e-5, rtol=0)


def _every_config():
    """Every launch configuration of the Triton kernel the dispatch can pick: the tuned
    entries and the portable ones, at V4's shape and others, on every checked GPU."""
    from dsv4lab.kernels.attention import dispatch
    from dsv4lab.kernels.device import CAPABILITIES, DeviceProps
    cfgs = {c for table in dispatch.TUNED.values() for c in table.values()}
    for cap in CAPABILITIES:
        p = DeviceProps.nominal(cap)
        for rows in (1, 2, 8, 64, 256):
            for dim in (64, 512, 576):
                for fp8 in (False, True):
                    cfgs.add(dispatch.portable_config(p, rows, dim, fp8))
    return sorted(cfgs)


@pytest.mark.parametrize("config", _every_config(), ids=str)
@pytest.mark.parametrize("kv_kind, splits", [("bf16", 1), ("bf16", 3), ("fp8", 1), ("fp8", 3),
                                             ("fp8_bits", 3)])
def test_every_config_matches_reference(config, kv_kind, splits):
    """Each configuration (its tile, head block, PIPE_GATHER with the FP8 scale word,
    SPLIT_QK, PDL and evict_kv asked for) at 64 heads and D = 512: -1 slots, an all -1 query,
    a -1 tail (trimmed), topk not a multiple of any tile, split or not, bf16 and the FP8 cache
    (both dequant paths); the bf16 tolerance."""
    fp8 = kv_kind != "bf16"
    q, kv, idx, snk = make_case(1, 2, 64, 512, 90, 75, fp8=fp8, sink=True, empty_rows=[(0, 1)],
                                seed=11 + splits)
    idx[0, 0, 40:] = -1
    out, lse = _mma(q, kv, idx, snk, 512, config, fp8=fp8, num_splits=splits,
                    fp8_hw=kv_kind != "fp8_bits")
    ref, ref_lse = sparse_mla_decode(q, kv, idx, attn_sink=snk, backend="torch")
    assert_matches_reference(q, out, lse, ref, ref_lse)


@pytest.mark.parametrize("fp8_hw", [False, True])
@pytest.mark.parametrize("pipe_gather", [False, True])
def test_mma_fp8_dequant_paths(fp8_hw, pipe_gather):
    """The FP8 dequantisers (hardware e4m3 conversion with byte scales or, in the PIPE_GATHER
    loop, the scale word; portable bit moves) agree with the reference: a block scaled far from
    1, a subnormal e4m3 value, and rows whose groups get scales from 2^-20 to 2^4 (a wrong byte
    of the scale word shows)."""
    from dsv4lab.kernels.attention.mma import Config
    g = torch.Generator().manual_seed(7)
    raw = torch.randn(40, 512, generator=g)
    raw[3, :64] *= 1e-3                       # small scale
    raw[5, 64:128] *= 300.0                   # large scale
    raw[7, 0], raw[7, 1] = 1.0, 1e-3          # a subnormal after scaling
    e = torch.randint(-20, 5, (40, 8), generator=g).float()
    raw[8:] = (raw[8:].view(32, 8, 64) * torch.exp2(e[8:])[:, :, None]).view(32, 512)
    kv = pack_kv_fp8(raw)
    assert len(set(kv[:, 576:583].flatten().tolist())) > 20     # the scales really vary
    q = torch.randn(2, 1, 16, 512, generator=g).to(torch.bfloat16) * 0.05
    idx = torch.randint(0, 40, (2, 1, 33), generator=g, dtype=torch.int32)
    idx[0, 0, :8] = torch.tensor([3, 5, 7, -1, 3, 5, 7, 0], dtype=torch.int32)
    q, kv, idx = q.to(DEV), kv.to(DEV), idx.to(DEV)
    out, lse = _mma(q, kv, idx, None, 512, Config(16, 4, 2, 16, pipe_gather=pipe_gather),
                    fp8=True, fp8_hw=fp8_hw)
    ref, ref_lse = sparse_mla_decode(q, kv, idx, d_v=512, backend="torch")
    # outputs span 2^-20..2^7: compared relative to each query's output scale
    big = ref.float().abs().amax(-1, keepdim=True).clamp(min=1e-30)
    torch.testing.assert_close(out.float() / big, ref.float() / big, **TOL[torch.bfloat16])
    torch.testing.assert_close(lse, ref_lse, atol=LSE_TOL[torch.bfloat16], rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("split_qk, pipe_gather", [(True, False), (True, True), (False, True)])
@pytest.mark.parametrize("d_v", [64, 48, 16])
def test_mma_loops_with_d_v_below_d(dtype, split_qk, pipe_gather, d_v):
    """SPLIT_QK and PIPE_GATHER with V masked from the K tile (d_v 48) or loaded apart (d_v 16,
    a narrower power of two), fp32 and bf16, -1 slots, an all -1 query, splits and a sink."""
    from dsv4lab.kernels.attention.mma import Config
    q, kv, idx, snk = make_case(2, 2, 16, 64, 90, 75, dtype=dtype, sink=True,
                                empty_rows=[(0, 1)], seed=41 + d_v)
    idx[1, 0, 40:] = -1
    cfg = Config(16, 4, 3, 16, pipe_gather=pipe_gather, split_qk=split_qk)
    out, lse = _mma(q, kv, idx, snk, d_v, cfg, num_splits=3)
    ref, ref_lse = sparse_mla_decode(q, kv, idx, d_v=d_v, attn_sink=snk, backend="torch")
    assert_matches_reference(q, out, lse, ref, ref_lse)


@pytest.mark.parametrize("backend", ["simt", "mma"])
@pytest.mark.parametrize("layout", ["prefix", "scattered", "none"])
def test_mostly_empty_long_lists(backend, layout):
    """A long index list that is almost all -1 (the ratio-128 layers' max-context lists):
    the kernels drop the dead tail tiles; the answer must not change. ``prefix``: a window
    then entries then a -1 tail, as the decode step builds them; ``scattered``: a few valid
    slots anywhere, incl. the very last; ``none``: one query with no valid slot at all.
    (The interpreter scans 32 slots per load, so the tail scan takes several loads.)"""
    q, kv, idx, snk = make_case(2, 2, 16, 32, 50, 300, dtype=torch.float32, sink=True,
                                empty_frac=0.0, seed=3)
    keep = torch.zeros_like(idx, dtype=torch.bool)
    if layout == "prefix":
        for (b, s), n in zip([(0, 0), (0, 1), (1, 0), (1, 1)], [1, 17, 70, 5]):
            keep[b, s, :n] = True
    else:
        g = torch.Generator().manual_seed(4)
        keep = (torch.rand(idx.shape, generator=g) < 0.03).to(idx.device)
        keep[0, 1, -1] = True
        if layout == "none":
            keep[1, 0] = False
    idx = torch.where(keep, idx, torch.full_like(idx, -1))
    for splits in (1, 3) if backend == "mma" else (None,):
        if backend == "mma":
            out, lse = _mma(q, kv, idx, snk, 32, num_splits=splits)
        else:
            out, lse = sparse_mla_decode(q, kv, idx, d_v=32, attn_sink=snk, backend="simt")
        ref, ref_lse = sparse_mla_decode(q, kv, idx, d_v=32, attn_sink=snk, backend="torch")
        torch.testing.assert_close(out, ref, **TOL[torch.float32])
        torch.testing.assert_close(lse, ref_lse, atol=LSE_TOL[torch.float32], rtol=0)


@pytest.mark.parametrize("backend", ["torch", "simt", "mma"])
@pytest.mark.parametrize("sink", [False, True])
def test_empty_rows(backend, sink):
    q, kv, idx, snk = make_case(2, 2, 16, 32, 20, 9, dtype=torch.float32, sink=sink,
                                empty_rows=[(0, 1), (1, 0)])
    out, lse = sparse_mla_decode(q, kv, idx, d_v=32, attn_sink=snk, backend=backend)
    for b, s in [(0, 1), (1, 0)]:
        assert (out[b, s] == 0).all()
        want = snk if sink else torch.full((16,), float("-inf"), device=DEV)
        torch.testing.assert_close(lse[b, s], want)
    assert torch.isfinite(lse[0, 0]).all() and out[0, 0].abs().sum() > 0


@pytest.mark.parametrize("backend", ["torch", "simt", "mma"])
def test_duplicates_count_twice(backend):
    torch.manual_seed(1)
    q = torch.randn(1, 1, 16, 32, device=DEV)
    kv = torch.randn(5, 32, device=DEV)
    idx = torch.tensor([[[3, 3, 1, -1]]], dtype=torch.int32, device=DEV)
    out, lse = sparse_mla_decode(q, kv, idx, d_v=32, backend=backend)
    sc = (q[0, 0] @ kv[[3, 1]].T) * 32 ** -0.5             # [16, 2]
    w = torch.stack([2 * sc[:, 0].exp(), sc[:, 1].exp()], -1)
    want = (w / w.sum(-1, keepdim=True)) @ kv[[3, 1]]
    torch.testing.assert_close(out[0, 0], want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse[0, 0], w.sum(-1).log(), atol=1e-4, rtol=0)


def test_softmax_scale_and_fp16():
    q, kv, idx, sink = make_case(2, 1, 16, 32, 30, 20, dtype=torch.float16, sink=True)
    for backend in ("simt", "mma"):
        check_against_reference(q, kv, idx, sink, backend, d_v=32, scale=0.37)


# ---- The dispatch table (kernels/attention/dispatch.py) ----

V4 = dict(H=64, D=512, d_v=512, q_dtype=torch.bfloat16, aligned=True)


def test_dispatch_table_gates_the_sm90_kernel_exactly():
    """One table: the warp-specialised kernel on exactly the GPU it ran on (sm_90), the
    portable lesson kernel last, for every GPU; describe() gives its rows."""
    from dsv4lab.kernels.attention import dispatch
    from dsv4lab.kernels.device import DeviceProps, choose, describe
    table = dispatch.TABLES["sparse_mla_decode"]
    assert [r.kernel for r in table] == ["ws_sm90", "mma"]
    # in this process (the interpreter), a plan is the interpreter's
    assert dispatch.plan(DeviceProps.cpu(), B=64, S_q=1, topk=640, fp8=False, **V4).config == \
        dispatch.INTERPRETER
    assert table[0].capabilities == frozenset({(9, 0)}) and table[-1].capabilities is None
    rows = describe(table)
    assert rows[0]["gpus"] == "sm_90" and rows[1]["gpus"] == "any"
    assert all(r["why"] for r in rows)
    shape = dict(rows=64, heads=64, dim=512, d_v=512, q_dtype=torch.bfloat16, fp8=False,
                 aligned=True, offline=True)
    for cap in ((8, 0), (8, 9), (10, 0), (12, 0)):
        assert choose(table, DeviceProps.nominal(cap), **shape).kernel == "mma"
    h200 = DeviceProps.nominal((9, 0))
    assert choose(table, h200, **shape).kernel == "ws_sm90"
    for change in (dict(rows=16), dict(heads=32), dict(d_v=448), dict(aligned=False),
                   dict(q_dtype=torch.float32), dict(q_dtype=torch.float16, fp8=True)):
        assert choose(table, h200, **dict(shape, **change)).kernel == "mma", change
    assert choose(table, h200, **dict(shape, q_dtype=torch.float16)).kernel == "ws_sm90"
    assert choose(table, h200, **dict(shape, fp8=True)).kernel == "ws_sm90"
    # in the interpreter, or on a Triton the Gluon kernel was not run with: the portable kernel
    from dsv4lab.kernels.device import gluon_unsupported, interpreting
    if gluon_unsupported() is not None or interpreting():
        assert choose(table, h200, **dict(shape, offline=False)).kernel == "mma"


@pytest.mark.parametrize("cap", [(8, 0), (8, 9), (9, 0), (10, 0), (12, 0)])
def test_plans_come_from_the_device(cap):
    """A plan for each size class and cache on each GPU, from its DeviceProps alone (no
    device, no timing): the H200's measured entries on sm_90, the portable ones elsewhere;
    split-KV for the SMs the part has; cached."""
    from dsv4lab.kernels.attention import dispatch
    from dsv4lab.kernels.device import DeviceProps
    p = DeviceProps.nominal(cap)
    for fp8 in (False, True):
        for B, S_q in ((1, 1), (8, 1), (4, 4), (64, 1), (128, 2)):
            pl = dispatch.plan(p, B=B, S_q=S_q, topk=640, fp8=fp8, offline=True, **V4)
            assert pl is dispatch.plan(p, B=B, S_q=S_q, topk=640, fp8=fp8, offline=True, **V4)
            assert pl.splits >= 1 and pl.splits * pl.split_rows >= 640
            if pl.kernel == "ws_sm90":
                assert cap == (9, 0) and B * S_q > 16
                assert pl.lazy == (fp8 and B * S_q > 64) and pl.evict_kv == (S_q == 1)
                continue
            tuned = dispatch.TUNED.get(cap, {}).get(("fp8" if fp8 else "bf16",
                                                     dispatch.size_class(B * S_q)))
            want = tuned or dispatch.portable_config(p, B * S_q, 512, fp8)
            assert pl.config == want._replace(evict_kv=want.evict_kv and S_q == 1)
            if B * S_q <= 2:
                assert pl.splits > 1            # one or two queries: split to fill the SMs


def test_h200_entries_are_the_measured_defaults():
    """The H200 table's Triton entries (the ws_sm90 route takes 17+ query rows there)."""
    from dsv4lab.kernels.attention.dispatch import TUNED
    from dsv4lab.kernels.attention.mma import Config
    assert TUNED[(9, 0)] == {
        ("bf16", "tiny"): Config(64, 4, 2, 16, pdl=True),
        ("bf16", "small"): Config(64, 8, 2, 64, evict_kv=True),
        ("fp8", "tiny"): Config(32, 4, 2, 16, pdl=True, evict_kv=True),
        ("fp8", "small"): Config(64, 8, 3, 64, pipe_gather=True, split_qk=True, evict_kv=True)}


def test_offline_cases_cover_every_size_class(monkeypatch):
    """offline_cases lists, for every GPU, the Triton launches of every size class and both
    caches with their combines, and on sm_90 the warp-specialised launches too (CPU: the list
    only; tests/test_portability.py compiles them)."""
    from dsv4lab.kernels.attention import dispatch
    from dsv4lab.kernels.device import CAPABILITIES, DeviceProps
    for cap in CAPABILITIES:
        cases = dispatch.offline_cases(DeviceProps.nominal(cap))
        names = [c.name for c in cases]
        for kv in ("bf16", "fp8"):
            for size in ("tiny", "small", "mid", "large"):
                assert any(n.startswith(f"mma {kv}:") and f"{size} B" in n for n in names), \
                    (cap, kv, size)
                assert any(n.startswith(f"ws_sm90 {kv}") and f"{size} B" in n for n in names) == \
                    (cap == (9, 0) and size in ("mid", "large")), (cap, kv, size)
            assert any(n.startswith("combine:") and f"{kv} B1 S1" in n for n in names)
        assert len(set(names)) == len(names)


# ---- Bad inputs: a ValueError naming the argument, before any kernel ----

def _good():
    return make_case(1, 2, 16, 32, 10, 4, dtype=torch.bfloat16, device="cpu")


@pytest.mark.parametrize("mutate, match", [
    (lambda q, kv, i: (q.long(), kv, i), "q must be bf16"),
    (lambda q, kv, i: (q[0], kv, i), r"q must have shape \[B, S_q, H, D\]"),
    (lambda q, kv, i: (q, kv.float(), i), "kv must have q's dtype"),
    (lambda q, kv, i: (q, kv[:, :16], i), "kv must have shape"),
    (lambda q, kv, i: (q, kv.view(5, 2, 32)[:, :, None].expand(5, 2, 2, 32), i), "kv must have shape"),
    (lambda q, kv, i: (q, kv, i.long()), "indices must be int32"),
    (lambda q, kv, i: (q, kv, i[:, :1]), r"indices must have shape \[B, S_q, topk\]"),
    (lambda q, kv, i: (q, kv, i.masked_fill(i == i[0, 0, 0], 10)),
     r"indices must be -1 \(empty\) or in \[0, N = 10\).*found 10"),
    (lambda q, kv, i: (q, kv, i.masked_fill(i == i[0, 0, 0], -2)), "indices must be -1.*found -2"),
    (lambda q, kv, i: (q, torch.zeros(10, 584, dtype=torch.uint8), i), "FP8 KV cache holds 512-dim rows"),
])
@pytest.mark.parametrize("backend", ["torch", "mma"])
def test_bad_inputs(mutate, match, backend):
    q, kv, idx, _ = _good()
    q, kv, idx = mutate(q, kv, idx)
    with pytest.raises(ValueError, match=match):
        sparse_mla_decode(q, kv, idx, d_v=32, backend=backend)


def test_bad_keywords():
    q, kv, idx, _ = _good()
    with pytest.raises(ValueError, match="d_v"):
        sparse_mla_decode(q, kv, idx, d_v=64)
    with pytest.raises(ValueError, match="softmax_scale"):
        sparse_mla_decode(q, kv, idx, d_v=32, softmax_scale=-1.0)
    with pytest.raises(ValueError, match="attn_sink"):
        sparse_mla_decode(q, kv, idx, d_v=32, attn_sink=torch.zeros(8))
    with pytest.raises(ValueError, match="validate"):
        sparse_mla_decode(q, kv, idx, d_v=32, validate="yes")


def test_paged_index_range_counts_pages():
    q, kv, idx, _ = make_case(1, 1, 16, 32, 12, 4, paged=(4, True), device="cpu")
    assert kv.shape == (3, 4, 1, 32)
    idx[0, 0, 0] = 12
    with pytest.raises(ValueError, match="indices.*pages"):
        sparse_mla_decode(q, kv, idx, d_v=32, backend="torch")
    idx[0, 0, 0] = 11
    sparse_mla_decode(q, kv, idx, d_v=32, backend="torch")


def _host_syncs(fn):
    """How many times ``fn`` reads a tensor's value on the host (tolist, item, bool)."""
    calls = []
    saved = {n: getattr(torch.Tensor, n) for n in ("tolist", "item", "__bool__")}
    try:
        for n, f in saved.items():
            setattr(torch.Tensor, n, lambda self, *a, f=f, **k: calls.append(1) or f(self, *a, **k))
        fn()
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)
    return len(calls)


def test_value_checks_cost_one_sync_and_can_be_turned_off():
    q, kv, idx, _ = _good()
    fq, fkv, fidx, _ = make_case(1, 1, 16, 512, 10, 4, fp8=True, device="cpu")
    for args in ((q, kv, idx), (fq, fkv, fidx)):
        fp8 = args[1].dtype == torch.uint8
        d_v = 512 if fp8 else 32
        # the torch reference itself reads nothing for bf16 (the FP8 unpack refuses byte 255)
        base = _host_syncs(lambda: sparse_mla_decode(*args, d_v=d_v, backend="torch",
                                                     validate=False))
        assert base == (1 if fp8 else 0)
        assert _host_syncs(lambda: sparse_mla_decode(*args, d_v=d_v, backend="torch")) == base + 1


def test_fp8_scale_byte_255_is_refused_like_the_reference():
    """A ue8m0 scale byte 255 (NaN) in a selected row: the kernels' eager path refuses it with
    validate (the reference's message), a row nothing selects is not read."""
    q, kv, idx, snk = make_case(1, 2, 16, 512, 10, 4, fp8=True, sink=True)
    idx[:] = torch.tensor([1, 2, -1, 2], dtype=torch.int32)
    kv[7, 578] = 255                        # not selected: fine
    sparse_mla_decode(q, kv, idx, attn_sink=snk, backend="mma")
    kv[2, 580] = 255
    for backend in ("mma", "torch"):
        with pytest.raises(ValueError, match=r"kv has a scale byte of 255 \(ue8m0 NaN\) in row 2"):
            sparse_mla_decode(q, kv, idx, attn_sink=snk, backend=backend)
    with pytest.raises(ValueError, match=r"scale byte of 255 \(ue8m0 NaN\)"):
        sparse_mla_decode(q, kv, idx, attn_sink=snk, backend="torch", validate=False)


def test_backend_unavailable_and_auto():
    assert backends.resolve("sparse_mla_decode", "auto", fmt="dense").name == "mma"
    assert backends.resolve("sparse_mla_decode", "auto", fmt="fp8").name == "mma"
    q, kv, idx, _ = _good()
    with pytest.raises(BackendUnavailable, match="unknown backend"):
        sparse_mla_decode(q, kv, idx, d_v=32, backend="cutlass")
    fq, fkv, fidx, _ = make_case(1, 1, 16, 512, 10, 4, fp8=True, device="cpu")
    with pytest.raises(BackendUnavailable, match="does not take format 'fp8'"):
        sparse_mla_decode(fq, fkv, fidx, backend="simt")
    cpu_plain = backends.Target("cpu", None, interpreter=False)
    with pytest.raises(BackendUnavailable, match="needs a CUDA GPU"):
        backends.resolve("sparse_mla_decode", "mma", fmt="dense", target=cpu_plain)
    assert backends.resolve("sparse_mla_decode", "auto", fmt="fp8", target=cpu_plain).name == "torch"


def test_kernels_reject_noncontiguous_cache():
    q, kv, idx, _ = make_case(1, 1, 16, 32, 10, 4, device=DEV)
    wide = torch.zeros(10, 64, dtype=kv.dtype, device=DEV)
    wide[:, :32] = kv
    with pytest.raises(ValueError, match="contiguous"):
        sparse_mla_decode(q, wide[:, :32], idx, d_v=32, backend="mma")
    out, _ = sparse_mla_decode(q, wide[:, :32], idx, d_v=32, backend="torch")
    assert torch.isfinite(out.float()).all()


# ---- GPU: the real shapes, every route and H200 entry ----

GPU = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")


def _plan_of(q, kv, idx, fp8):
    from dsv4lab.kernels.attention import dispatch
    from dsv4lab.kernels.device import props
    B, S, H, D = q.shape
    return dispatch.plan(props(q.device), B=B, S_q=S, H=H, D=D, d_v=512, topk=idx.shape[-1],
                         q_dtype=q.dtype, fp8=fp8, aligned=True)


def _ws_runs_here():
    if not ON_GPU:
        return False
    from dsv4lab.kernels.attention import dispatch
    from dsv4lab.kernels.device import props
    shape = dict(rows=64, heads=64, dim=512, d_v=512, q_dtype=torch.bfloat16, fp8=False,
                 aligned=True)
    return dispatch.TABLES["sparse_mla_decode"][0].runs_on(props(DEV)) and \
        dispatch._ws_applies(props(DEV), **shape)


WS_GPU = pytest.mark.skipif(not _ws_runs_here(), reason="needs the H200 (sm_90) with Triton 3.6")


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("B, S, topk", [(1, 1, 640), (2, 1, 8320), (8, 2, 2048), (3, 4, 777),
                                        (32, 1, 640), (64, 1, 2048), (128, 2, 2048),
                                        (72, 1, 1152)])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("sink", [False, True])
def test_gpu_real_shapes(B, S, topk, fp8, sink):
    """The op at V4's shapes, every size class (on the H200: the tuned Triton entries for up to
    16 query rows, the ws_sm90 kernel above, FP8 large with its lazy rescale), -1 slots,
    duplicates, an all -1 query, topk not a multiple of any tile."""
    q, kv, idx, snk = make_case(B, S, 64, 512, 8192, topk, fp8=fp8, sink=sink,
                                seed=B * 10 + S, empty_rows=[(0, 0)], device="cuda")
    check_against_reference(q, kv, idx, snk, "mma", d_v=512)


@pytest.mark.gpu
@WS_GPU
def test_gpu_h200_plans():
    """On the H200 the plan of each size class is the measured default."""
    for fp8 in (False, True):
        for B, S, kernel in ((1, 1, "mma"), (8, 2, "mma"), (17, 1, "ws_sm90"), (64, 1, "ws_sm90"),
                             (128, 2, "ws_sm90")):
            q, kv, idx, _ = make_case(B, S, 64, 512, 4096, 640, fp8=fp8, device="cuda")
            pl = _plan_of(q, kv, idx, fp8)
            assert pl.kernel == kernel and pl.lazy == (fp8 and B * S > 64)
            assert pl.evict_kv == (S == 1 and (kernel == "ws_sm90" or fp8 or B * S > 2))


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("H", [16, 32, 128])
def test_gpu_mma_head_counts(H):
    q, kv, idx, snk = make_case(4, 3, H, 512, 4096, 1000, sink=True, device="cuda")
    check_against_reference(q, kv, idx, snk, "mma", d_v=512)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("paged", [(64, True), (64, False)])
def test_gpu_paged_and_fp32(paged):
    q, kv, idx, snk = make_case(2, 2, 64, 512, 4096, 300, paged=paged, device="cuda")
    check_against_reference(q, kv, idx, snk, "mma", d_v=512)
    q, kv, idx, snk = make_case(2, 2, 64, 64, 1000, 300, dtype=torch.float32, paged=paged,
                                sink=True, device="cuda")
    check_against_reference(q, kv, idx, snk, "mma", d_v=48)
    check_against_reference(q, kv, idx, snk, "simt", d_v=48)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("backend, fp8", [("mma", False), ("mma", True), ("simt", False)])
@pytest.mark.parametrize("B", [3, 24])
def test_gpu_ratio128_long_lists(backend, fp8, B):
    """A ratio-128 layer's list: a 128-slot window, then the entries seen so far, then -1 up
    to the max-context length (8192 entries): the -1 tail is trimmed, same answer (B 24: the
    ws_sm90 kernel on the H200)."""
    q, kv, idx, snk = make_case(B, 1, 64, 512, 16384, 128 + 8192, fp8=fp8, sink=True,
                                empty_frac=0.0, seed=5, device="cuda")
    for b in range(B):
        idx[b, :, [128 + 1, 128 + 700, 128 + 8192][b % 3]:] = -1   # the last: no -1 at all
    check_against_reference(q, kv, idx, snk, backend, d_v=512)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("B, S", [(1, 1), (8, 2)])
def test_gpu_simt_real_shapes(B, S):
    q, kv, idx, snk = make_case(B, S, 64, 512, 8192, 2048, sink=True, device="cuda")
    check_against_reference(q, kv, idx, snk, "simt", d_v=512)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("B, S", [(1, 1), (4, 2), (32, 1), (72, 2)])
def test_gpu_cuda_graph_capture(fp8, B, S):
    """Capture-safe: no host sync inside (the value checks are skipped while capturing); the
    replay with new inputs in the same buffers matches the reference (with split-KV: the
    combine's programmatic dependency captured as a graph edge)."""
    q, kv, idx, snk = make_case(B, S, 64, 512, 4096, 640, fp8=fp8, sink=True, device="cuda")
    sparse_mla_decode(q, kv, idx, attn_sink=snk, backend="mma")   # warm-up: compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = sparse_mla_decode(q, kv, idx, attn_sink=snk, backend="mma")
    q.copy_(torch.randn_like(q))                  # new inputs, same buffers
    idx.copy_(torch.randint_like(idx, -1, 4096))
    ref, ref_lse = sparse_mla_decode(q, kv, idx, attn_sink=snk, backend="torch")
    graph.replay()
    torch.cuda.synchronize()
    assert_matches_reference(q, out, lse, ref, ref_lse)


def _ws(q, kv, idx, snk, splits=None, scale=None, **kw):
    """The warp-specialised launcher with the planner's split (or ``splits``)."""
    from dsv4lab.kernels.attention import mma, ws_sm90
    from dsv4lab.kernels.device import props
    B, S, _, D = q.shape
    topk = idx.shape[-1]
    plan = mma.plan_splits(B * S, topk, props(q.device).sm_count) if splits is None else \
        mma.split_rows(splits, topk)
    return ws_sm90.sparse_mla_ws(q, kv, idx, snk, scale or D ** -0.5, *plan, **kw)


@pytest.mark.gpu
@WS_GPU
@pytest.mark.parametrize("B, S, topk", [(1, 1, 640), (8, 2, 2048), (64, 1, 2048),
                                        (128, 2, 2048), (3, 4, 777), (5, 1, 1), (2, 3, 33)])
@pytest.mark.parametrize("fp8, lazy", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("sink", [False, True])
def test_gpu_ws_shapes(B, S, topk, fp8, lazy, sink):
    """The warp-specialised kernel called directly at any batch: -1 slots, duplicates, an all
    -1 query, topk 1 / 33 / 777 (not a multiple of the 32-row tile), the planned split-KV;
    the FP8 cache eager and lazy."""
    q, kv, idx, snk = make_case(B, S, 64, 512, 8192, topk, fp8=fp8, sink=sink, seed=B * 7 + S,
                                empty_rows=[(0, 0)], device="cuda")
    out, lse = _ws(q, kv, idx, snk, lazy=lazy)
    ref, ref_lse = sparse_mla_decode(q, kv, idx, attn_sink=snk, backend="torch")
    assert_matches_reference(q, out, lse, ref, ref_lse)


@pytest.mark.gpu
@WS_GPU
@pytest.mark.parametrize("splits", [1, 2, 5])
@pytest.mark.parametrize("dtype, fp8", [(torch.bfloat16, False), (torch.float16, False),
                                        (torch.bfloat16, True)])
def test_gpu_ws_splits_and_fp16(splits, dtype, fp8):
    """Forced split counts (1 = unsplit) through the op's dispatch, fp16 q and cache; a -1 tail
    inside one split."""
    from dsv4lab.kernels.attention import dispatch
    q, kv, idx, snk = make_case(24, 2, 64, 512, 8192, 1500, dtype=dtype, fp8=fp8, sink=True,
                                seed=splits, empty_rows=[(1, 1)], device="cuda")
    idx[2, 0, 300:] = -1
    assert _plan_of(q, kv, idx, fp8).kernel == "ws_sm90"
    out, lse = dispatch.sparse_mla_decode(q, kv, idx, snk, 512 ** -0.5, 512, fp8=fp8,
                                          num_splits=splits)
    ref, ref_lse = sparse_mla_decode(q, kv, idx, attn_sink=snk, backend="torch")
    assert_matches_reference(q, out, lse, ref, ref_lse)


@pytest.mark.gpu
@WS_GPU
@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("fp8, lazy", [(False, False), (True, False), (True, True)])
def test_gpu_ws_running_max_moves(splits, fp8, lazy):
    """Scores built to move the running max, head by head (softmax_scale 1): a ramp that
    climbs ~41 (base 2) every 32-row tile (far past the lazy rescale's 2^8 slack; 1843 in all,
    so any missed rescale overflows exp), the same falling (the first tile holds the max), half
    that climb, none; half the heads add +-40 by tile parity, so each consumer's peer tiles
    outscore its own, or the reverse. Slots in row order, a few -1, one whole -1 tile."""
    B, topk, N = 3, 2048, 4096
    g = torch.Generator().manual_seed(splits)
    row = torch.arange(N, dtype=torch.float32)
    kv = torch.randn(N, 512, generator=g) * 0.5
    kv[:, 0] = row * 3e-3
    kv[:, 1] = torch.where((row // 32) % 2 == 0, 0.4, -0.4)
    q = torch.zeros(B, 1, 64, 512)
    h = torch.arange(64)
    q[:, :, :, 0] = torch.tensor([300.0, -300.0, 150.0, 0.0])[h % 4]
    q[:, :, :, 1] = 100.0 * ((h // 4) % 2)
    idx = (torch.arange(topk, dtype=torch.int32) + 512 * torch.arange(B, dtype=torch.int32)[:, None])
    idx = idx[:, None, :].clone()
    idx[:, :, 5::97] = -1
    idx[1, :, 320:352] = -1                       # a whole tile of -1
    q, idx = q.to(torch.bfloat16).cuda(), idx.cuda()
    kv = pack_kv_fp8(kv.cuda()) if fp8 else kv.to(torch.bfloat16).cuda()
    snk = torch.linspace(-2.0, 2.0, 64, device="cuda")
    out, lse = _ws(q, kv, idx, snk, splits=splits, scale=1.0, lazy=lazy)
    ref, ref_lse = sparse_mla_decode(q, kv, idx, softmax_scale=1.0, attn_sink=snk,
                                     backend="torch")
    assert torch.isfinite(out.float()).all()
    assert_matches_reference(q, out, lse, ref, ref_lse)


@pytest.mark.gpu
@WS_GPU
@pytest.mark.parametrize("splits", [1, 2, 5])
@pytest.mark.parametrize("lazy", [False, True])
def test_gpu_ws_fp8_extremes(splits, lazy):
    """Rows whose groups get scales from 2^-20 to 2^4 (a wrong byte of the scale word shows),
    e4m3 subnormals, an all-zero group, a -1 tail inside one split."""
    q, _, idx, snk = make_case(6, 2, 64, 512, 4096, 1500, sink=True, seed=splits,
                               empty_rows=[(1, 1)], device="cuda")
    g = torch.Generator(device="cuda").manual_seed(splits)
    spread = torch.randn(4096, 512, generator=g, device="cuda")
    spread[:, :448] *= torch.exp2(torch.randint(-20, 5, (4096, 7), generator=g, device="cuda")
                                  .float()).repeat_interleave(64, dim=1)
    spread[::7, 64:128] = 0.0
    spread[1::5, :32] *= 1e-3            # half a group far below its amax: e4m3 subnormals
    kv = pack_kv_fp8(spread)
    idx[2, 0, 300:] = -1
    out, lse = _ws(q, kv, idx, snk, splits=splits, lazy=lazy)
    ref, ref_lse = sparse_mla_decode(q, kv, idx, attn_sink=snk, backend="torch")
    # P enters P V as bf16 (8 bits) whatever V's scale: an output's absolute error grows with
    # |V|, here up to 2^4 x N(0, 1) values, so the bf16 atol is taken 4x (a wrong scale byte
    # errs by whole units of V)
    assert_matches_reference(q, out, lse, ref, ref_lse, out_atol_factor=4)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("B, S, topk, splits", [(1, 1, 640, None), (8, 1, 2048, None),
                                                (64, 1, 2048, None), (7, 1, 777, 1),
                                                (2, 1, 1500, 5)])
def test_gpu_evict_kv_changes_no_bits(fp8, B, S, topk, splits):
    """The row gathers under the L2 evict-first policy (the marked kernel's PTX rewritten,
    kernels/attention/l2_hint.py) give the unmarked kernel's bits: the H200 entries of the
    Triton kernel and the ws_sm90 kernel (where it runs), split and unsplit, -1 slots and an
    all -1 query; and both match the reference."""
    from dsv4lab.kernels.attention.dispatch import TUNED
    q, kv, idx, snk = make_case(B, S, 64, 512, 8192, topk, fp8=fp8, sink=True, seed=B + S,
                                empty_rows=[(0, 0)], device="cuda")
    runs = []
    for size in ("tiny", "small"):
        cfg = TUNED[(9, 0)][("fp8" if fp8 else "bf16", size)]
        runs += [lambda e, cfg=cfg: _mma(q, kv, idx, snk, 512, cfg._replace(evict_kv=e), fp8=fp8,
                                         num_splits=splits)]
    if _ws_runs_here():
        runs += [lambda e: _ws(q, kv, idx, snk, splits=splits, evict_kv=e)]
    ref, ref_lse = sparse_mla_decode(q, kv, idx, attn_sink=snk, backend="torch")
    for run in runs:
        plain, marked = run(False), run(True)
        assert torch.equal(plain[0], marked[0]) and torch.equal(plain[1], marked[1])
        assert_matches_reference(q, *marked, ref, ref_lse)
