"""sparse_mla_decode: every backend against the fp32 torch reference, and the input checks.

CPU runs go through Triton's interpreter at tiny shapes; the ``gpu`` tests use the real
DeepSeek-V4 shapes (H 64, D 512, topk 2048, B up to 128) with fresh random data.
"""
import dsv4lab  # noqa: F401  (sets TRITON_INTERPRET before anything imports triton)

import math
import os

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


# ----------------------------------------------------------------------------------------
# The reference itself, against a per-element loop
# ----------------------------------------------------------------------------------------

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


# ----------------------------------------------------------------------------------------
# Kernels against the reference (interpreter on the CPU)
# ----------------------------------------------------------------------------------------

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


def test_mma_d512_h64_bf16():
    """The real head block (64 heads) and the real latent width, tiny B/topk."""
    q, kv, idx, sink = make_case(1, 2, 64, 512, 80, 35, sink=True)
    check_against_reference(q, kv, idx, sink, "mma", d_v=512)


@pytest.mark.parametrize("splits", [1, 2, 3])
@pytest.mark.parametrize("sink", [False, True])
def test_mma_split_kv_matches_unsplit(splits, sink):
    """Split-KV + combine gives the reference's answer, incl. splits that see only -1."""
    from dsv4lab.kernels.sparse_mla_mma import sparse_mla_mma
    q, kv, idx, snk = make_case(1, 2, 16, 32, 60, 150, dtype=torch.float32, sink=sink)
    idx[0, 1, 64:] = -1                        # splits 2 and 3 of query 1 are empty
    idx[0, 0, :] = -1                          # query 0 has nothing at all
    scale = 32 ** -0.5
    out, lse = sparse_mla_mma(q, kv, idx, snk, scale, 32, num_splits=splits)
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
    SMs; the CPU counts as 8 SMs, so there the last two shapes take the 8-head kernel; on a GPU
    the real-shape tests reach it), with 3 and 40 splits (more than a 32-wide block of
    them): empty splits (lse -inf), a query with nothing at all; fp32 and bf16
    (Config.part16) partials."""
    from dsv4lab.kernels.sparse_mla_mma import combine_splits
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


@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("block_h, splits", [(16, 0), (64, 1), (16, 3)])
def test_mma_config_variants(lazy, block_h, splits):
    """Every launch-configuration knob the tuner sweeps gives the reference's answer:
    the lazy rescale (large scores so the running max moves several times), head blocks
    smaller than H (H = 20: two blocks, one partial), forced split counts."""
    from dsv4lab.kernels.sparse_mla_mma import Config, sparse_mla_mma
    q, kv, idx, snk = make_case(2, 2, 20, 32, 90, 150, dtype=torch.float32, sink=True,
                                empty_rows=[(1, 0)], seed=block_h + splits)
    q = q * 6.0
    kv = kv * torch.linspace(0.1, 3.0, kv.shape[0])[:, None]   # later rows score higher
    idx[0, 0] = torch.arange(150, dtype=torch.int32) % 90      # ascending: max keeps growing
    scale = 32 ** -0.5
    out, lse = sparse_mla_mma(q, kv, idx, snk, scale, 32,
                              config=Config(16, 4, 1, block_h, lazy, splits))
    ref, ref_lse = sparse_mla_decode(q, kv, idx, d_v=32, attn_sink=snk, backend="torch")
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=0)


@pytest.mark.parametrize("fp8_hw", [False, True])
def test_mma_fp8_dequant_paths(fp8_hw):
    """Both FP8 dequantisers (hardware e4m3 conversion, portable bit moves) agree with the
    reference, including a block scaled far from 1 and a subnormal e4m3 value."""
    from dsv4lab.kernels.sparse_mla_mma import Config, sparse_mla_mma
    g = torch.Generator().manual_seed(7)
    raw = torch.randn(40, 512, generator=g)
    raw[3, :64] *= 1e-3                       # small scale
    raw[5, 64:128] *= 300.0                   # large scale
    raw[7, 0], raw[7, 1] = 1.0, 1e-3          # a subnormal after scaling
    kv = pack_kv_fp8(raw)
    q = torch.randn(2, 1, 16, 512, generator=g).to(torch.bfloat16) * 0.05
    idx = torch.randint(0, 40, (2, 1, 33), generator=g, dtype=torch.int32)
    idx[0, 0, :8] = torch.tensor([3, 5, 7, -1, 3, 5, 7, 0], dtype=torch.int32)
    scale = 512 ** -0.5
    out, lse = sparse_mla_mma(q, kv, idx, None, scale, 512, fp8=True, fp8_hw=fp8_hw,
                              config=Config(16, 4, 1, 16, True, 0))
    ref, ref_lse = sparse_mla_decode(q, kv, idx, d_v=512, backend="torch")
    torch.testing.assert_close(out.float(), ref.float(), **TOL[torch.bfloat16])
    torch.testing.assert_close(lse, ref_lse, atol=LSE_TOL[torch.bfloat16], rtol=0)


@pytest.mark.parametrize("backend", ["simt", "mma"])
@pytest.mark.parametrize("layout", ["prefix", "scattered", "none"])
def test_mostly_empty_long_lists(backend, layout):
    """A long index list that is almost all -1 (the ratio-128 layers' max-context lists):
    the kernels drop the dead tail tiles; the answer must not change. ``prefix``: a window
    then entries then a -1 tail, as dsv4lab/step.py builds them; ``scattered``: a few valid
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
            from dsv4lab.kernels.sparse_mla_mma import sparse_mla_mma
            out, lse = sparse_mla_mma(q, kv, idx, snk, 32 ** -0.5, 32, num_splits=splits)
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


def test_auto_picks_mma():
    assert backends.resolve("sparse_mla_decode", "auto", fmt="dense").name == "mma"
    assert backends.resolve("sparse_mla_decode", "auto", fmt="fp8").name == "mma"


# ----------------------------------------------------------------------------------------
# Bad inputs: a ValueError naming the argument, before any kernel
# ----------------------------------------------------------------------------------------

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
    (lambda q, kv, i: (q, kv, i.masked_fill(i == i[0, 0, 0], 10)), r"indices must be -1 \(empty\) or in \[0, N = 10\)"),
    (lambda q, kv, i: (q, kv, i.masked_fill(i == i[0, 0, 0], -2)), "indices must be -1"),
    (lambda q, kv, i: (q, torch.zeros(10, 584, dtype=torch.uint8), i), "FP8 KV cache holds 512-dim rows"),
])
def test_bad_inputs(mutate, match):
    q, kv, idx, _ = _good()
    q, kv, idx = mutate(q, kv, idx)
    with pytest.raises(ValueError, match=match):
        sparse_mla_decode(q, kv, idx, d_v=32, backend="torch")


def test_bad_keywords():
    q, kv, idx, _ = _good()
    with pytest.raises(ValueError, match="d_v"):
        sparse_mla_decode(q, kv, idx, d_v=64)
    with pytest.raises(ValueError, match="softmax_scale"):
        sparse_mla_decode(q, kv, idx, d_v=32, softmax_scale=-1.0)
    with pytest.raises(ValueError, match="attn_sink"):
        sparse_mla_decode(q, kv, idx, d_v=32, attn_sink=torch.zeros(8))


def test_paged_index_range_counts_pages():
    q, kv, idx, _ = make_case(1, 1, 16, 32, 12, 4, paged=(4, True), device="cpu")
    assert kv.shape == (3, 4, 1, 32)
    idx[0, 0, 0] = 12
    with pytest.raises(ValueError, match="indices"):
        sparse_mla_decode(q, kv, idx, d_v=32, backend="torch")
    idx[0, 0, 0] = 11
    sparse_mla_decode(q, kv, idx, d_v=32, backend="torch")


def test_check_indices_can_be_turned_off():
    q, kv, idx, _ = _good()
    calls = []
    orig = torch.Tensor.any
    try:
        torch.Tensor.any = lambda self, *a, **k: calls.append(1) or orig(self, *a, **k)
        sparse_mla_decode(q, kv, idx, d_v=32, backend="torch", check_indices=False)
        assert not calls
        sparse_mla_decode(q, kv, idx, d_v=32, backend="torch", check_indices=True)
        assert calls
    finally:
        torch.Tensor.any = orig


def test_backend_unavailable():
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


# ----------------------------------------------------------------------------------------
# GPU: the real shapes
# ----------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("B, S, topk", [(1, 1, 640), (8, 2, 2048), (64, 1, 2048), (128, 2, 2048),
                                        (3, 4, 777)])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("sink", [False, True])
def test_gpu_mma_real_shapes(B, S, topk, fp8, sink):
    q, kv, idx, snk = make_case(B, S, 64, 512, 8192, topk, fp8=fp8, sink=sink,
                                seed=B * 10 + S, empty_rows=[(0, 0)], device="cuda")
    check_against_reference(q, kv, idx, snk, "mma", d_v=512)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("H", [16, 32, 128])
def test_gpu_mma_head_counts(H):
    q, kv, idx, snk = make_case(4, 3, H, 512, 4096, 1000, sink=True, device="cuda")
    check_against_reference(q, kv, idx, snk, "mma", d_v=512)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("paged", [(64, True), (64, False)])
def test_gpu_paged_and_fp32(paged):
    q, kv, idx, snk = make_case(2, 2, 64, 512, 4096, 300, paged=paged, device="cuda")
    check_against_reference(q, kv, idx, snk, "mma", d_v=512)
    q, kv, idx, snk = make_case(2, 2, 64, 64, 1000, 300, dtype=torch.float32, paged=paged,
                                sink=True, device="cuda")
    check_against_reference(q, kv, idx, snk, "mma", d_v=48)
    check_against_reference(q, kv, idx, snk, "simt", d_v=48)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend, fp8", [("mma", False), ("mma", True), ("simt", False)])
def test_gpu_ratio128_long_lists(backend, fp8):
    """A ratio-128 layer's list: a 128-slot window, then the entries seen so far, then
    -1 up to the max-context length (8192 entries): the -1 tail is trimmed, same answer."""
    q, kv, idx, snk = make_case(3, 1, 64, 512, 16384, 128 + 8192, fp8=fp8, sink=True,
                                empty_frac=0.0, seed=5, device="cuda")
    for b, n in enumerate([128 + 1, 128 + 700, 128 + 8192]):   # last: no -1 at all
        idx[b, :, n:] = -1
    check_against_reference(q, kv, idx, snk, backend, d_v=512)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("B, S", [(1, 1), (8, 2)])
def test_gpu_simt_real_shapes(B, S):
    q, kv, idx, snk = make_case(B, S, 64, 512, 8192, 2048, sink=True, device="cuda")
    check_against_reference(q, kv, idx, snk, "simt", d_v=512)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_cuda_graph_capture(fp8):
    """Capture-safe: no host sync inside (the index check is skipped while capturing)."""
    q, kv, idx, snk = make_case(1, 1, 64, 512, 4096, 640, fp8=fp8, sink=True, device="cuda")
    ref, ref_lse = sparse_mla_decode(q, kv, idx, attn_sink=snk, backend="torch")
    sparse_mla_decode(q, kv, idx, attn_sink=snk, backend="mma")   # warm-up: compile + tune
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = sparse_mla_decode(q, kv, idx, attn_sink=snk, backend="mma")
    q.copy_(torch.randn_like(q))                  # new inputs, same buffers
    ref, ref_lse = sparse_mla_decode(q, kv, idx, attn_sink=snk, backend="torch")
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), ref.float(), **TOL[torch.bfloat16])
    torch.testing.assert_close(lse, ref_lse, atol=LSE_TOL[torch.bfloat16], rtol=0)


# ----------------------------------------------------------------------------------------
# Named kernel variants (kernels/sparse_mla_mma.py VARIANTS, e.g. PREFETCH)
# ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("pipe", ["prefetch", "pipe_gather"])
@pytest.mark.parametrize("fp8, fp8_hw", [(False, None), (True, True), (True, False)])
@pytest.mark.parametrize("lazy, splits", [(False, 0), (True, 3)])
def test_mma_prefetch_matches_reference(pipe, fp8, fp8_hw, lazy, splits):
    """PREFETCH (next tile's rows loaded before this tile's math) and PIPE_GATHER (next
    tile's indices carried by the loop): same answer as the reference with -1 slots, a
    query with only -1, a -1 tail (trimmed), topk not a multiple of the tile, splits and
    the lazy rescale; bf16 tolerance."""
    from dsv4lab.kernels.sparse_mla_mma import Config, sparse_mla_mma
    D = 512 if fp8 else 64
    q, kv, idx, snk = make_case(2, 2, 16, D, 90, 75, fp8=fp8, sink=True, empty_rows=[(0, 1)],
                                seed=11 + splits)
    idx[1, 0, 40:] = -1
    cfg = Config(16, 4, 1, 16, lazy, splits, fp8_hw, prefetch=pipe == "prefetch",
                 pipe_gather=pipe == "pipe_gather")
    out, lse = sparse_mla_mma(q, kv.reshape(-1, kv.shape[-1]), idx, snk.float(), D ** -0.5, D,
                              fp8=fp8, config=cfg)
    ref, ref_lse = sparse_mla_decode(q, kv, idx, d_v=D, attn_sink=snk, backend="torch")
    torch.testing.assert_close(out.float(), ref.float(), **TOL[torch.bfloat16])
    torch.testing.assert_close(lse, ref_lse, atol=LSE_TOL[torch.bfloat16], rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_mma_part16_partials(dtype):
    """Config.part16: split partials stored in q's dtype (fp32 q keeps fp32) give the
    reference's answer at q's tolerance, with -1 slots, an empty query and an empty split,
    and differ from the fp32 partials by at most one rounding of a partial plus the output's
    (a bf16/fp16 ulp of |out| <= max|V|, twice, taken as 2 * 2^-7 * max|V| for bf16)."""
    from dsv4lab.kernels.sparse_mla_mma import Config, sparse_mla_mma
    q, kv, idx, snk = make_case(2, 2, 16, 64, 90, 75, dtype=dtype, sink=True,
                                empty_rows=[(0, 1)], seed=21)
    idx[1, 0, :40] = -1                          # the first split of this query is empty
    cfg = Config(16, 4, 1, 16, False, 3)
    args = (q, kv.reshape(-1, kv.shape[-1]), idx, snk.float(), 64 ** -0.5, 64)
    out16, lse16 = sparse_mla_mma(*args, config=cfg._replace(part16=True, pdl=True))
    out32, lse32 = sparse_mla_mma(*args, config=cfg)
    ref, ref_lse = sparse_mla_decode(q, kv, idx, d_v=64, attn_sink=snk, backend="torch")
    torch.testing.assert_close(out16.float(), ref.float(), **TOL[dtype])
    torch.testing.assert_close(lse16, ref_lse, atol=LSE_TOL[dtype], rtol=0)
    ulp = 0.0 if dtype == torch.float32 else 2.0 ** (-7 if dtype == torch.bfloat16 else -10)
    bound = 2 * ulp * kv.float().abs().max().item()
    assert (out16.float() - out32.float()).abs().max().item() <= bound
    assert torch.equal(lse16, lse32)             # the lse path is fp32 either way
    if dtype == torch.float32:
        assert torch.equal(out16, out32)


def test_named_variants_through_the_op():
    """Every name in VARIANTS runs through sparse_mla_decode_with_config (the bench's entry)
    and matches the reference; an unknown name is a ValueError."""
    from dsv4lab.ops.attention import mma_variants, sparse_mla_decode_with_config
    q, kv, idx, snk = make_case(1, 2, 16, 64, 70, 50, sink=True, seed=4)
    ref, ref_lse = sparse_mla_decode(q, kv, idx, d_v=64, attn_sink=snk, backend="torch")
    assert mma_variants()
    for name in mma_variants():
        out, lse = sparse_mla_decode_with_config(q, kv, idx, config=name, d_v=64, attn_sink=snk)
        torch.testing.assert_close(out.float(), ref.float(), **TOL[torch.bfloat16])
        torch.testing.assert_close(lse, ref_lse, atol=LSE_TOL[torch.bfloat16], rtol=0)
    with pytest.raises(ValueError, match="config"):
        sparse_mla_decode_with_config(q, kv, idx, config="no_such_variant", d_v=64)


def _variant_names():
    from dsv4lab.ops.attention import mma_variants
    return sorted(mma_variants())


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("variant", _variant_names())
@pytest.mark.parametrize("B, S, fp8", [(64, 1, False), (8, 2, True), (3, 4, False)])
def test_gpu_mma_variants(variant, B, S, fp8):
    """Each named variant at real shapes (B 64 splits, B 8 / 3 x 4 too), bf16 and FP8."""
    from dsv4lab.ops.attention import mma_variants, sparse_mla_decode_with_config
    if not fp8 and mma_variants()[variant].fp8_fast:
        # an FP8 KV configuration (fp8_fast has no effect on bf16 KV, and fp8fast_*_n64_s3's
        # three 64-row stages fit in shared memory only as FP8 bytes): FP8 cases only
        pytest.skip("fp8_fast variants are FP8 KV configurations")
    q, kv, idx, snk = make_case(B, S, 64, 512, 8192, 2048 if B > 3 else 777, fp8=fp8,
                                sink=True, seed=B + S, empty_rows=[(0, 0)], device="cuda")
    idx[-1, -1, 1000:] = -1
    if fp8 and mma_variants()[variant].kq_t:
        with pytest.raises(ValueError, match="kq_t"):      # KQ_T is bf16/fp16 KV only
            sparse_mla_decode_with_config(q, kv, idx, config=variant, d_v=512, attn_sink=snk)
        return
    out, lse = sparse_mla_decode_with_config(q, kv, idx, config=variant, d_v=512, attn_sink=snk)
    ref, ref_lse = sparse_mla_decode(q, kv, idx, d_v=512, attn_sink=snk, backend="torch")
    torch.testing.assert_close(out.float(), ref.float(), **TOL[torch.bfloat16])
    torch.testing.assert_close(lse, ref_lse, atol=LSE_TOL[torch.bfloat16], rtol=0)


def _unsplit_variant_cases():
    """The benchmark's variant rows (variant, FP8 KV?): timed unsplit at (B 128, S_q 2)."""
    from dsv4lab.benchmarks.sparse_mla import VARIANT_ROWS
    return [(name, kv == "fp8") for name, kv in VARIANT_ROWS]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("variant, fp8", _unsplit_variant_cases())
def test_gpu_mma_variants_unsplit(variant, fp8):
    """The benchmark's variant rows without split-KV, in their KV format (the (B 128, S_q 2)
    target shape runs unsplit; B 26 x S_q 4 here): -1 slots, an all -1 query, a -1 tail."""
    from dsv4lab.ops.attention import mma_variants, sparse_mla_decode_with_config
    q, kv, idx, snk = make_case(26, 4, 64, 512, 8192, 2048, fp8=fp8, sink=True, seed=7,
                                empty_rows=[(0, 0)], device="cuda")
    idx[-1, -1, 1000:] = -1
    cfg = mma_variants()[variant]._replace(splits=1)            # never split
    out, lse = sparse_mla_decode_with_config(q, kv, idx, config=cfg, d_v=512, attn_sink=snk)
    ref, ref_lse = sparse_mla_decode(q, kv, idx, d_v=512, attn_sink=snk, backend="torch")
    torch.testing.assert_close(out.float(), ref.float(), **TOL[torch.bfloat16])
    torch.testing.assert_close(lse, ref_lse, atol=LSE_TOL[torch.bfloat16], rtol=0)


@pytest.mark.parametrize("loop", ["plain", "prefetch", "pipe_gather"])
@pytest.mark.parametrize("lazy, splits", [(False, 0), (True, 3)])
def test_mma_fp8_fast_matches_reference(loop, lazy, splits):
    """FP8_FAST (scales read as one 8-byte word a row, dequant in fp32) in each loop: the
    groups of a row get different scales (each 64-value group multiplied by its own power
    of two from 2^-20 to 2^4 before packing), so a wrong byte of the scale word shows;
    -1 slots, an all -1 query, a -1 tail, topk not a multiple of the tile; bf16 tolerance
    (the reference dequantises the same packed cache)."""
    from dsv4lab.kernels.sparse_mla_mma import Config, sparse_mla_mma
    from dsv4lab.quant import unpack_kv_fp8
    g = torch.Generator().manual_seed(5 + splits)
    N, D = 90, 512
    kv = torch.randn(N, D, generator=g)
    e = torch.randint(-20, 5, (N, 8), generator=g).float()
    kv = (kv.view(N, 8, 64) * torch.exp2(e)[:, :, None]).view(N, D)
    packed = pack_kv_fp8(kv)
    assert len(set(packed[:, 576:583].flatten().tolist())) > 20     # scales really vary
    q, _, idx, snk = make_case(2, 2, 16, D, N, 75, sink=True, empty_rows=[(0, 1)],
                               seed=21 + splits)
    idx[1, 0, 40:] = -1
    packed = packed.to(q.device)
    cfg = Config(16, 4, 1, 16, lazy, splits, True, prefetch=loop == "prefetch",
                 pipe_gather=loop == "pipe_gather", fp8_fast=True)
    out, lse = sparse_mla_mma(q, packed, idx, snk.float(), D ** -0.5, D, fp8=True, config=cfg)
    ref, ref_lse = sparse_mla_decode(q, packed, idx, d_v=D, attn_sink=snk, backend="torch")
    # the values span 2^-20..2^7: compare relative to each query's output scale; lse (up
    # to a few hundred here) to the bf16 tolerance plus fp32 rounding of its size
    big = ref.float().abs().amax(-1, keepdim=True).clamp(min=1e-30)
    torch.testing.assert_close(out.float() / big, ref.float() / big, **TOL[torch.bfloat16])
    torch.testing.assert_close(lse, ref_lse, atol=LSE_TOL[torch.bfloat16], rtol=1e-5)
    # the scale word really carries per-group scales: dequantised groups differ in size
    deq = unpack_kv_fp8(packed.cpu()).view(N, 8, 64)[:, :7].abs().amax(-1)
    assert (deq.amax(-1) / deq.amin(-1).clamp(min=1e-30)).median() > 100


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("splits, d_v", [(0, 64), (3, 64), (0, 48)])
def test_mma_kq_t_matches_reference(dtype, splits, d_v):
    """KQ_T (scores transposed, S^T = K Q^T): -1 slots, an all -1 query, a -1 tail, topk
    not a multiple of the tile, splits, d_v < D (V masked from the K tile), sink; the
    dtype's tolerance."""
    from dsv4lab.kernels.sparse_mla_mma import Config, sparse_mla_mma
    q, kv, idx, snk = make_case(2, 2, 16, 64, 90, 75, dtype=dtype, sink=True,
                                empty_rows=[(0, 1)], seed=31 + splits + d_v)
    idx[1, 0, 40:] = -1
    cfg = Config(16, 4, 1, 16, False, splits, None, kq_t=True)
    out, lse = sparse_mla_mma(q, kv, idx, snk.float(), 64 ** -0.5, d_v, config=cfg)
    ref, ref_lse = sparse_mla_decode(q, kv, idx, d_v=d_v, attn_sink=snk, backend="torch")
    assert out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])
    torch.testing.assert_close(lse, ref_lse, atol=LSE_TOL[dtype], rtol=0)


@pytest.mark.parametrize("loop", ["plain", "pipe_gather"])
@pytest.mark.parametrize("dtype, splits, d_v, lazy", [(torch.bfloat16, 0, 64, False),
                                                      (torch.float32, 3, 48, True),
                                                      ("fp8", 3, 512, False)])
def test_mma_split_qk_matches_reference(loop, dtype, splits, d_v, lazy):
    """SPLIT_QK (the softmax in both arms of an always-taken branch, so the scores' dot is
    split between the warp groups on sm_90): plain and PIPE_GATHER loops, bf16, fp32 with
    d_v < D and ``lazy`` (ignored by SPLIT_QK), FP8 with FP8_FAST; -1 slots, an all -1
    query, a -1 tail, topk not a multiple of the tile, splits, sink; the dtype's
    tolerance (FP8: bf16, the reference dequantises the same packed cache)."""
    from dsv4lab.kernels.sparse_mla_mma import Config, sparse_mla_mma
    fp8 = dtype == "fp8"
    D = 512 if fp8 else 64
    q, kv, idx, snk = make_case(2, 2, 16, D, 90, 75, dtype=torch.bfloat16 if fp8 else dtype,
                                fp8=fp8, sink=True, empty_rows=[(0, 1)], seed=41 + splits)
    idx[1, 0, 40:] = -1
    cfg = Config(16, 4, 2 if loop == "plain" else 3, 16, lazy, splits, True if fp8 else None,
                 pipe_gather=loop == "pipe_gather", fp8_fast=fp8, split_qk=True)
    out, lse = sparse_mla_mma(q, kv, idx, snk.float(), D ** -0.5, d_v, fp8=fp8, config=cfg)
    ref, ref_lse = sparse_mla_decode(q, kv, idx, d_v=d_v, attn_sink=snk, backend="torch")
    tol = torch.bfloat16 if fp8 else dtype
    assert out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), **TOL[tol])
    torch.testing.assert_close(lse, ref_lse, atol=LSE_TOL[tol], rtol=0)


# ----------------------------------------------------------------------------------------
# The warp-specialised kernel (kernels/sparse_mla_ws.py): sm_90 / sm_100, bf16/fp16 KV
# ----------------------------------------------------------------------------------------

def _ws_applies():
    if not ON_GPU:
        return False
    from dsv4lab.kernels import sparse_mla_ws
    q = torch.empty(1, 1, 64, 512, dtype=torch.bfloat16, device="cuda")
    return sparse_mla_ws.supported(q, torch.empty(4, 512, dtype=torch.bfloat16, device="cuda"),
                                   False, 512)


WS_GPU = pytest.mark.skipif(not _ws_applies(), reason="needs a Hopper/Blackwell datacenter GPU")


def test_ws_applies_only_where_it_can():
    """The warp-specialised kernel takes 16-bit q and cache (or bf16 q and the FP8 cache),
    64 heads, D = d_v = 512 on a CUDA GPU of capability 9/10; anything else (CPU, fp16 q
    with FP8, other shapes) stays on the MMA kernel. Its score-swap buffers: two a side while they fit, one at 64-row tiles."""
    from dsv4lab.kernels import sparse_mla_ws
    q = torch.empty(1, 1, 64, 512, dtype=torch.bfloat16)
    kv = torch.empty(8, 512, dtype=torch.bfloat16)
    assert not sparse_mla_ws.supported(q, kv, False, 512)                 # CPU tensors
    if ON_GPU:
        cq, ckv = q.cuda(), kv.cuda()
        packed = pack_kv_fp8(ckv.float())
        assert sparse_mla_ws.supported(cq, packed, True, 512) == _ws_applies()
        assert not sparse_mla_ws.supported(cq.half(), packed, True, 512)    # RoPE is bf16
        assert not sparse_mla_ws.supported(cq, packed[1:], True, 512)      # 584-byte offset
        assert not sparse_mla_ws.supported(cq, packed, True, 512, 32, 4, True)     # no room
        assert not sparse_mla_ws.supported(cq, packed, True, 512, 64, 2, False)
        assert not sparse_mla_ws.supported(cq[:, :, :32].contiguous(), ckv, False, 512)
        assert not sparse_mla_ws.supported(cq, ckv, False, 448)
        assert not sparse_mla_ws.supported(cq.float(), ckv.float(), False, 512)
    assert sparse_mla_ws.s_bufs(32, 3) == 2 and sparse_mla_ws.s_bufs(64, 2) == 1
    # the FP8 staging fits beside 32-row tiles in at most three ring buffers (the D split
    # then swaps its scores through one buffer a side); the sizes the sm_90 compile reports
    assert sparse_mla_ws.s_bufs(32, 3, staged=True) == 1
    assert sparse_mla_ws.smem_bytes(32, 3, True, True) == 222992          # + 384 B of barriers
    assert sparse_mla_ws.smem_bytes(32, 4, True, False) == 218896
    for n, b, ss in [(32, 3, True), (32, 3, False), (32, 2, True)]:
        assert sparse_mla_ws.smem_bytes(n, b, ss, True) <= sparse_mla_ws.SMEM_LIMIT
    for n, b, ss in [(32, 4, True), (64, 2, False), (64, 2, True)]:
        assert sparse_mla_ws.smem_bytes(n, b, ss, True) > sparse_mla_ws.SMEM_LIMIT
    # bf16: two 64-row tiles no longer fit beside the output store's scratch (233584 B
    # compiled): supported() declines them, the dispatcher runs the MMA loop
    assert sparse_mla_ws.smem_bytes(64, 2, False, False) > sparse_mla_ws.SMEM_LIMIT
    assert sparse_mla_ws.smem_bytes(32, 4, True, False) <= sparse_mla_ws.SMEM_LIMIT
    q1 = torch.zeros(1, 1, 64, 512, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="block_n / num_buf"):     # refused before any launch
        sparse_mla_ws.sparse_mla_ws(q1, torch.zeros(8, 512, dtype=torch.bfloat16),
                                    torch.zeros(1, 1, 64, dtype=torch.int32), None, 0.04, 1, 64,
                                    block_n=64, num_buf=2)


def test_ws_launch_args_match_the_launcher():
    """Every keyword the dispatcher hands the warp-specialised launcher is one of its
    keywords, and every keyword of the launcher but ``scan_n`` (a fixed scan width) comes
    from the Config (CPU: the signature only, no launch)."""
    import inspect
    from dsv4lab.kernels import sparse_mla_ws
    from dsv4lab.kernels.sparse_mla_mma import VARIANTS, ws_launch_args
    params = inspect.signature(sparse_mla_ws.sparse_mla_ws).parameters
    keywords = {n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    for cfg in VARIANTS.values():
        assert set(ws_launch_args(cfg)) == keywords - {"scan_n"}


def _ws_check(q, kv, idx, snk, variant="ws_n32_b3", splits=None, out_atol_factor=1):
    """The variant (forced split count) against the reference -> its (out, lse)."""
    from dsv4lab.ops.attention import mma_variants, sparse_mla_decode_with_config
    cfg = mma_variants()[variant]
    if splits is not None:
        cfg = cfg._replace(splits=splits)
    out, lse = sparse_mla_decode_with_config(q, kv, idx, config=cfg, d_v=512, attn_sink=snk)
    ref, ref_lse = sparse_mla_decode(q, kv, idx, d_v=512, attn_sink=snk, backend="torch")
    return assert_matches_reference(q, out, lse, ref, ref_lse, out_atol_factor)


@pytest.mark.gpu
@WS_GPU
@pytest.mark.parametrize("B, S, topk", [(1, 1, 640), (8, 2, 2048), (64, 1, 2048),
                                        (128, 2, 2048), (3, 4, 777), (5, 1, 1), (2, 3, 33)])
@pytest.mark.parametrize("sink", [False, True])
@pytest.mark.parametrize("variant", ["ws_n32_b3", "ws_n32_b3_lazy", "ws_ss_n32_b3",
                                     "ws_ss_n32_b4", "ws_ss_n32_b4_lazy", "ws_ss_n32_b4_psw"])
def test_gpu_ws_real_shapes(B, S, topk, sink, variant):
    """Real shapes, -1 slots, duplicates, an all -1 query, topk 1 / 33 / 777 (not a
    multiple of the 32-row tile), with the planned split-KV."""
    q, kv, idx, snk = make_case(B, S, 64, 512, 8192, topk, sink=sink, seed=B * 7 + S,
                                empty_rows=[(0, 0)], device="cuda")
    _ws_check(q, kv, idx, snk, variant)


@pytest.mark.gpu
@WS_GPU
@pytest.mark.parametrize("splits", [1, 2, 5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", ["ws_n32_b3", "ws_ss_n32_b4", "ws_ss_n32_b4_p16_pdl",
                                     "ws_ss_n32_b4_lazy_p16_pdl", "ws_ss_n32_b4_psw_p16_pdl"])
def test_gpu_ws_splits_and_fp16(splits, dtype, variant):
    """Forced split counts (1 = unsplit) and fp16; a -1 tail inside one split."""
    q, kv, idx, snk = make_case(6, 2, 64, 512, 8192, 1500, dtype=dtype, sink=True, seed=splits,
                                empty_rows=[(1, 1)], device="cuda")
    idx[2, 0, 300:] = -1
    _ws_check(q, kv, idx, snk, variant, splits=splits)


@pytest.mark.gpu
@WS_GPU
@pytest.mark.parametrize("variant", ["ws_n32_b3", "ws_ss_n32_b4", "ws_ss_n32_b4_lazy",
                                     "ws_ss_n32_b4_psw"])
def test_gpu_ws_ratio128_long_lists(variant):
    """A ratio-128 layer's max-context list (-1 up to 8320 slots): trimmed, same answer."""
    q, kv, idx, snk = make_case(3, 1, 64, 512, 16384, 128 + 8192, sink=True, empty_frac=0.0,
                                seed=5, device="cuda")
    for b, n in enumerate([128 + 1, 128 + 700, 128 + 8192]):
        idx[b, :, n:] = -1
    _ws_check(q, kv, idx, snk, variant)


@pytest.mark.gpu
@WS_GPU
@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("variant", ["ws_ss_n32_b4", "ws_ss_n32_b4_lazy", "ws_ss_n32_b4_lazy_p16_pdl",
                                     "ws_n32_b3_lazy", "ws_ss_n32_b4_psw_p16_pdl"])
def test_gpu_ws_running_max_moves(splits, variant):
    """Scores built to move the running max, head by head (softmax_scale 1): a ramp that
    climbs ~41 (base 2) every 32-row tile (far past the lazy rescale's 2^8 slack; 1843
    in all, so any missed rescale overflows exp), the same falling (the first tile holds
    the max), half that climb, none; half the heads add +-40 by tile parity, so each seesaw
    consumer's peer tiles outscore its own, or the reverse. Slots in row order, a few -1,
    one whole -1 tile. Eager and lazy, split or not, against the fp32 reference."""
    from dsv4lab.ops.attention import mma_variants, sparse_mla_decode_with_config
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
    q, kv, idx = q.to(torch.bfloat16).cuda(), kv.to(torch.bfloat16).cuda(), idx.cuda()
    snk = torch.linspace(-2.0, 2.0, 64, device="cuda")
    cfg = mma_variants()[variant]._replace(splits=splits)
    out, lse = sparse_mla_decode_with_config(q, kv, idx, config=cfg, softmax_scale=1.0,
                                             attn_sink=snk)
    ref, ref_lse = sparse_mla_decode(q, kv, idx, softmax_scale=1.0, attn_sink=snk,
                                     backend="torch")
    assert torch.isfinite(out.float()).all()
    assert_matches_reference(q, out, lse, ref, ref_lse)


@pytest.mark.gpu
@WS_GPU
@pytest.mark.parametrize("B, S, topk", [(1, 1, 640), (64, 1, 2048), (128, 2, 2048), (3, 4, 777),
                                        (5, 1, 1), (2, 3, 33)])
@pytest.mark.parametrize("sink", [False, True])
@pytest.mark.parametrize("variant", ["ws_n32_b3", "ws_ss_n32_b3", "ws_ss_n32_b3_lazy",
                                     "ws_ss_n32_b3_psw"])
def test_gpu_ws_fp8_real_shapes(B, S, topk, sink, variant):
    """The FP8 cache (staged raw rows, dequantised by the producer) at real shapes, -1
    slots, duplicates, an all -1 query, topk not a multiple of the tile; the reference
    dequantises the same packed rows. Also against the MMA kernel's FP8 path."""
    from dsv4lab.ops.attention import sparse_mla_decode_with_config
    q, kv, idx, snk = make_case(B, S, 64, 512, 8192, topk, fp8=True, sink=sink, seed=B * 5 + S,
                                empty_rows=[(0, 0)], device="cuda")
    out, lse = _ws_check(q, kv, idx, snk, variant)
    out_mma, lse_mma = sparse_mla_decode_with_config(q, kv, idx, config="fp8fast_sqk_pg_n64_s3",
                                                     attn_sink=snk)
    torch.testing.assert_close(out.float(), out_mma.float(), atol=2e-2, rtol=0)
    torch.testing.assert_close(lse, lse_mma, atol=LSE_TOL[torch.bfloat16], rtol=0)


@pytest.mark.gpu
@WS_GPU
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("B, S, topk, splits", [(1, 1, 640, None), (64, 1, 2048, None),
                                                (7, 1, 777, 1), (2, 1, 1500, 5),
                                                (3, 4, 777, None)])
def test_gpu_ws_evict_kv_changes_no_bits(fp8, B, S, topk, splits):
    """The KV gathers under an L2 evict-first policy (``evict_kv``, S_q = 1: the marked
    kernel's PTX rewritten, kernels/l2_hint.py; S_q > 1 runs unmarked) give the unmarked
    kernel's bits, bf16 and FP8, split and unsplit, -1 slots and an all -1 query; and both
    match the reference."""
    from dsv4lab.ops.attention import mma_variants
    _check_evict_kv(mma_variants()["ws_ss_n32_b3" if fp8 else "ws_ss_n32_b4_psw"], fp8, B, S,
                    topk, splits, seed=B + S)


def _check_evict_kv(cfg, fp8, B, S, topk, splits, seed):
    """``cfg`` (split ``splits`` ways unless None) with and without ``evict_kv``: the same bits,
    and both the reference's."""
    from dsv4lab.ops.attention import sparse_mla_decode_with_config
    if splits is not None:
        cfg = cfg._replace(splits=splits)
    q, kv, idx, snk = make_case(B, S, 64, 512, 8192, topk, fp8=fp8, sink=True, seed=seed,
                                empty_rows=[(0, 0)], device="cuda")
    plain = sparse_mla_decode_with_config(q, kv, idx, config=cfg, d_v=512, attn_sink=snk)
    out, lse = sparse_mla_decode_with_config(q, kv, idx, config=cfg._replace(evict_kv=True),
                                             d_v=512, attn_sink=snk)
    assert torch.equal(out, plain[0]) and torch.equal(lse, plain[1])
    ref, ref_lse = sparse_mla_decode(q, kv, idx, d_v=512, attn_sink=snk, backend="torch")
    assert_matches_reference(q, out, lse, ref, ref_lse)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("variant, fp8", [("sqk_n64", False), ("sqk_pg_n32_s3", False),
                                          ("fp8fast_sqk_pg_n64_s3", True), ("fp8fast_n64", True),
                                          ("table:small", False), ("table:tiny", False),
                                          ("table:tiny", True)])
@pytest.mark.parametrize("B, S, topk, splits", [(1, 1, 640, None), (8, 1, 2048, None),
                                                (7, 1, 777, 1), (2, 3, 300, None)])
def test_gpu_mma_evict_kv_changes_no_bits(variant, fp8, B, S, topk, splits):
    """The Triton MMA kernel's row gathers under an L2 evict-first policy (``evict_kv`` at
    S_q = 1: its pipelined, predicated cp.async rewritten, kernels/l2_hint.py) give the
    unmarked kernel's bits, bf16 and FP8, split and unsplit, -1 slots and an all -1 query.
    ``table:<class>``: the H200 table's entry of that class (bf16 tiny: a launch whose hinted
    build ptxas got wrong, so l2_hint builds it unhinted)."""
    from dsv4lab.kernels.sparse_mla_mma import DEVICE_TABLE
    from dsv4lab.ops.attention import mma_variants
    if variant.startswith("table:"):
        entry = DEVICE_TABLE["NVIDIA H200"][("fp8" if fp8 else "bf16", variant[6:])]
        cfg = entry._replace(evict_kv=False)
    else:
        cfg = mma_variants()[variant]
    _check_evict_kv(cfg, fp8, B, S, topk, splits, seed=B * 3 + S)


@pytest.mark.gpu
@WS_GPU
@pytest.mark.parametrize("splits", [1, 2, 5])
@pytest.mark.parametrize("variant", ["ws_n32_b3", "ws_ss_n32_b3", "ws_ss_n32_b3_lazy"])
def test_gpu_ws_fp8_splits_and_extremes(splits, variant):
    """Forced split counts; rows whose groups get scales from 2^-20 to 2^4 (a wrong byte of
    the scale word shows), e4m3 subnormals, an all-zero group, a -1 tail inside one split."""
    q, kv, idx, snk = make_case(6, 2, 64, 512, 4096, 1500, sink=True, seed=splits, empty_rows=[(1, 1)],
                                device="cuda")
    g = torch.Generator(device="cuda").manual_seed(splits)
    spread = torch.randn(4096, 512, generator=g, device="cuda")
    spread[:, :448] *= torch.exp2(torch.randint(-20, 5, (4096, 7), generator=g, device="cuda")
                                  .float()).repeat_interleave(64, dim=1)
    spread[::7, 64:128] = 0.0
    spread[1::5, :32] *= 1e-3            # half a group far below its amax: e4m3 subnormals
    kv = pack_kv_fp8(spread)
    idx[2, 0, 300:] = -1
    # P enters P V as bf16 (8 bits) whatever V's scale: the absolute error of an output grows
    # with |V|, here up to 2^4 x N(0, 1) values, so the bf16 atol is taken 4x (measured on the
    # H200: at most 0.055 on 1 of 393,216 outputs against 0.02; a wrong scale byte errs by
    # whole units of V)
    _ws_check(q, kv, idx, snk, variant, splits=splits, out_atol_factor=4)


@pytest.mark.gpu
@WS_GPU
def test_gpu_ws_fp8_cuda_graph_and_ring_limit():
    """FP8 replays from a CUDA graph with new inputs; a fourth ring buffer is refused by name
    when the kernel is called directly (through the op, such a config runs the MMA loop)."""
    from dsv4lab.ops.attention import sparse_mla_decode_with_config
    q, kv, idx, snk = make_case(4, 2, 64, 512, 4096, 640, fp8=True, sink=True, device="cuda")
    graph, out, lse = _captured(q, kv, idx, snk, "ws_ss_n32_b3")
    q.copy_(torch.randn_like(q))
    idx.copy_(torch.randint_like(idx, -1, 4096))
    ref, ref_lse = sparse_mla_decode(q, kv, idx, attn_sink=snk, backend="torch")
    graph.replay()
    torch.cuda.synchronize()
    assert_matches_reference(q, out, lse, ref, ref_lse)
    from dsv4lab.kernels import sparse_mla_ws
    with pytest.raises(ValueError, match="block_n / num_buf"):      # called directly: refused
        sparse_mla_ws.sparse_mla_ws(q, kv, idx, snk, 0.04, 1, 640, num_buf=4, seesaw=True)


def _captured(q, kv, idx, snk, config):
    """One warm-up call, then the call captured in a CUDA graph: (graph, out, lse)."""
    from dsv4lab.ops.attention import sparse_mla_decode_with_config
    sparse_mla_decode_with_config(q, kv, idx, config=config, attn_sink=snk, check_indices=False)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = sparse_mla_decode_with_config(q, kv, idx, config=config, attn_sink=snk,
                                                 check_indices=False)
    return graph, out, lse


@pytest.mark.gpu
@WS_GPU
@pytest.mark.parametrize("variant", ["ws_n32_b3", "ws_ss_n32_b4", "ws_ss_n32_b4_p16_pdl",
                                     "ws_ss_n32_b4_lazy_p16_pdl", "ws_ss_n32_b4_psw_p16_pdl"])
def test_gpu_ws_cuda_graph_capture(variant):
    """Replays from a CUDA graph with new inputs in the same buffers (with ``pdl``: the
    combine's programmatic dependency captured as a graph edge)."""
    q, kv, idx, snk = make_case(4, 2, 64, 512, 4096, 640, sink=True, device="cuda")
    graph, out, lse = _captured(q, kv, idx, snk, variant)
    q.copy_(torch.randn_like(q))
    idx.copy_(torch.randint_like(idx, 0, 4096))
    ref, ref_lse = sparse_mla_decode(q, kv, idx, attn_sink=snk, backend="torch")
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), ref.float(), **TOL[torch.bfloat16])
    torch.testing.assert_close(lse, ref_lse, atol=LSE_TOL[torch.bfloat16], rtol=0)


@pytest.mark.gpu
@WS_GPU
@pytest.mark.parametrize("variant", ["ws_ss_n32_b4_merge", "ws_ss_n32_b4_merge_p16"])
@pytest.mark.parametrize("sink", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_ws_pair_merges_itself(sink, dtype, variant):
    """Two split-KV ranges merged by the pair itself (kernels/sparse_mla_ws.py, variant
    ws_ss_n32_b4_merge) against the reference and against the combine kernel, over
    repeated calls (the counters carry over) and with one range empty, the other empty, or
    both, for some queries; B 64 / S_q 1 / topk 2048 is where the planner picks two."""
    from dsv4lab.ops.attention import mma_variants, sparse_mla_decode_with_config
    q, kv, idx, snk = make_case(64, 1, 64, 512, 8192, 2048, dtype=dtype, sink=sink, seed=11,
                                empty_rows=[(5, 0)], device="cuda")
    idx[0, 0, 1024:] = -1          # second range empty
    idx[1, 0, :1024] = -1          # first range empty
    idx[2, 0, 1000:1100] = -1      # a -1 run across the boundary
    ref, ref_lse = sparse_mla_decode(q, kv, idx, d_v=512, attn_sink=snk, backend="torch")
    cfg = mma_variants()[variant]._replace(splits=2)
    for _ in range(3):
        out, lse = sparse_mla_decode_with_config(q, kv, idx, config=cfg, d_v=512, attn_sink=snk)
        assert_matches_reference(q, out, lse, ref, ref_lse)
    out2, lse2 = sparse_mla_decode_with_config(q, kv, idx, config=cfg._replace(merge_pair=False),
                                               d_v=512, attn_sink=snk)
    torch.testing.assert_close(out.float(), out2.float(), atol=2e-2, rtol=0)
    torch.testing.assert_close(lse, lse2, atol=1e-5, rtol=0)


@pytest.mark.gpu
@WS_GPU
def test_gpu_ws_pair_merge_cuda_graph():
    """The self-merging pair replayed from a CUDA graph, several times, with new inputs."""
    from dsv4lab.ops.attention import mma_variants
    q, kv, idx, snk = make_case(64, 1, 64, 512, 4096, 1024, sink=True, device="cuda")
    cfg = mma_variants()["ws_ss_n32_b4_merge"]._replace(splits=2)
    graph, out, lse = _captured(q, kv, idx, snk, cfg)
    for seed in range(3):
        g = torch.Generator(device="cuda").manual_seed(seed)
        q.copy_(torch.randn(q.shape, generator=g, device="cuda").to(q.dtype))
        idx.copy_(torch.randint(-1, 4096, idx.shape, generator=g, device="cuda", dtype=idx.dtype))
        ref, ref_lse = sparse_mla_decode(q, kv, idx, attn_sink=snk, backend="torch")
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), ref.float(), **TOL[torch.bfloat16])
        torch.testing.assert_close(lse, ref_lse, atol=LSE_TOL[torch.bfloat16], rtol=0)


def test_timeline_plot_and_off_by_default():
    """The warp-specialised kernel's timeline: off unless asked for at import (the kernel
    then compiles as without it), and its figure draws each shape's phases from rows."""
    import matplotlib
    matplotlib.use("Agg")
    from dsv4lab.kernels import sparse_mla_ws
    from dsv4lab.plots.attention import plot_timeline
    assert not sparse_mla_ws.TIMELINE
    with pytest.raises(RuntimeError, match="DSV4LAB_WS_TIMELINE"):
        sparse_mla_ws.timeline()
    assert plot_timeline([]).texts                                     # a note, no bars
    points = {"program start": 0.0, "first tile ready": 5.0, "loop end": 45.0,
              "epilogue end (consumer 0)": 49.0}
    rows = [{"shape": "B64 S1 T2048 bf16", "what": f"timeline: {p}", "us": us, "us_max": us + 3.0,
             "gpu": "H200", "date": "2026-11-30T00:00:00", "commit": "test"} for p, us in points.items()]
    ax = plot_timeline(rows)
    spans = sorted((round(b.get_x(), 6), round(b.get_width(), 6)) for b in ax.patches)
    assert spans == [(0.0, 5.0), (5.0, 40.0), (45.0, 4.0)]
    (line,) = ax.lines
    assert list(line.get_xdata()) == [49.0, 52.0]


@pytest.mark.gpu
@WS_GPU
def test_gpu_timeline_points_in_order():
    """With DSV4LAB_WS_TIMELINE=1 (a fresh process: the module reads it at import) every
    program passes its points in order and the output still matches the reference."""
    import subprocess
    import sys
    code = """
import torch, dsv4lab
from dsv4lab.kernels import sparse_mla_mma as mma, sparse_mla_ws as ws
from dsv4lab.ops import sparse_mla_decode
assert ws.TIMELINE
g = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(64, 1, 64, 512, device="cuda", generator=g).to(torch.bfloat16)
kv = torch.randn(8192, 512, device="cuda", generator=g).to(torch.bfloat16)
idx = torch.randint(-1, 8192, (64, 1, 2048), device="cuda", generator=g, dtype=torch.int32)
out, lse = mma.sparse_mla_mma(q, kv, idx, None, 512 ** -0.5, 512)
ref, _ = sparse_mla_decode(q, kv, idx, backend="torch")
assert (out.float() - ref.float()).abs().max().item() < 3e-2
st = ws.timeline()
assert st.shape == (128, len(ws.TIMELINE_POINTS)) and bool((st > 0).all())
assert bool((st[:, 1:4] >= st[:, 0:3]).all())
for a, b in [(0, 4), (4, 5), (5, 6), (2, 6), (6, 7), (7, 8)]:
    assert bool((st[:, b] >= st[:, a]).all()), (a, b)
print("ok")
"""
    env = dict(os.environ, DSV4LAB_WS_TIMELINE="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
