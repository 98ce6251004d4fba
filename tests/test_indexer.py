"""The lightning indexer (dsv4lab.ops.indexer, dsv4lab.kernels.indexer).

CPU: Triton interpreter, tiny shapes (4 heads x 32 dims, pages of 16 or odd sizes).
Also the dispatch table and the launch configurations per capability (DeviceProps), the sm_80
byte-decode route (planned for sm_80, run in the interpreter), and the value checks.
GPU (@pytest.mark.gpu): the DeepSeek-V4 shape (64 x 128), long rows that take the radix
select, the sm_80 byte-decode route, and the CUDA-graph replay with new lengths and
block tables.

Tolerances (vs the fp32 torch reference, relative to the row's largest |logit|; in the
hypothesis sweep relative to the row's largest sum over heads of |w_h| relu(q_h . k), the
magnitude of the terms: random signed head weights can cancel a row's logits far below its
terms, e.g. a row with one visible position, and the summation-order error scales with the
terms, not with what is left of them):
- interpreter, every dtype: 1e-5. e4m3 and bf16 upcast exactly, products of those are exact
  in fp32, so only the summation order (and, for fp32 inputs, the products' rounding) differs.
- GPU fp32 (IEEE dot) and bf16 (tensor cores, fp32 accumulate): 1e-4.
- GPU fp8 (e4m3 tensor cores): 2e-2; Hopper's FP8 MMA accumulates with reduced
  precision inside each instruction (Triton's default max_num_imprecise_acc).
Top-k sets are compared through the scores they select (ties may pick either entry).
"""
import dsv4lab  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4lab import backends, bench
from dsv4lab.kernels import indexer as K
from dsv4lab.kernels.device import CAPABILITIES, DeviceProps, choose
from dsv4lab.ops import indexer_logits, indexer_topk, to_cache_slots
from dsv4lab.ops.indexer import reference_logits

FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16
F32 = torch.float32
DTYPES = [(F32, FP8), (BF16, FP8), (FP8, FP8), (BF16, BF16), (F32, F32)]
TOL_INTERPRETER = 1e-5
TOL_GPU = {F32: 1e-4, BF16: 1e-4, FP8: 2e-2}
CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
gpu = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]
CPU_PROPS = DeviceProps.cpu()
SM80 = DeviceProps.nominal((8, 0))


def make(B=2, S=1, H=4, D=32, page=16, max_pages=4, ctx=None, q_dtype=F32, k_dtype=FP8,
         spare_pages=1, seed=0, device=DEV, unused=-1):
    """Random indexer inputs; each batch row owns its own (shuffled) physical pages."""
    g = torch.Generator().manual_seed(seed)
    P = B * max_pages + spare_pages
    q = torch.randn(B, S, H, D, generator=g).to(q_dtype)
    k = (torch.randn(P, page, D, generator=g) * 2).to(k_dtype)
    ks = torch.rand(P, page, generator=g) + 0.25
    w = torch.randn(B, S, H, generator=g)
    bt = torch.randperm(P, generator=g)[: B * max_pages].reshape(B, max_pages).to(torch.int32)
    if ctx is None:
        ctx = torch.randint(0, max_pages * page + 1, (B, S), generator=g)
    ctx = torch.as_tensor(ctx, dtype=torch.int32).reshape(B, S)
    # pages past a row's longest context hold `unused` (-1: nothing there)
    need = (ctx.max(dim=1).values.long() + page - 1) // page
    bt = torch.where(torch.arange(max_pages)[None, :] < need[:, None], bt, unused).to(torch.int32)
    return [t.to(device) for t in (q, k, ks, w, bt, ctx)]


def tol_for(q_dtype, k_dtype, device):
    if str(device).startswith("cpu"):
        return TOL_INTERPRETER
    wide = {FP8: 0, BF16: 1, F32: 2}
    d = q_dtype if wide[q_dtype] >= wide[k_dtype] else k_dtype
    return TOL_GPU[d]


def _row_scale(ref, mag=None):
    """The row's largest finite |value| of ``mag`` (the terms' magnitude) or else of ``ref``."""
    base = ref if mag is None else mag
    return base.masked_fill(torch.isinf(base), 0).abs().amax(dim=-1, keepdim=True).clamp(min=1e-6)


def assert_logits_close(out, ref, tol, mag=None):
    assert out.shape == ref.shape and out.dtype == torch.float32
    inv_ref, inv_out = torch.isneginf(ref), torch.isneginf(out)
    assert torch.equal(inv_ref, inv_out), "visibility (-inf) pattern differs"
    fin = ref.masked_fill(inv_ref, 0)
    scale = _row_scale(ref, mag)
    err = (out.masked_fill(inv_out, 0) - fin).abs() / scale
    assert err.max().item() <= tol, f"max relative error {err.max().item():.3g} > {tol}"


def selected_scores(idx, logits):
    """Scores of the selected positions, sorted descending; -1 slots give -inf."""
    g = torch.gather(logits, 2, idx.clamp(min=0).long())
    return torch.where(idx >= 0, g, float("-inf")).sort(dim=-1, descending=True).values


def check_topk(idx, ref_logits, ctx, topk, tol, own_logits=None, mag=None):
    """Valid, distinct, visible positions; -1 padding last; the scores of the top-k."""
    B, S, _ = idx.shape
    assert idx.dtype == torch.int32 and idx.shape[-1] == topk
    n_expect = ctx.long().clamp(max=topk)
    n_valid = (idx >= 0).sum(-1)
    assert torch.equal(n_valid, n_expect), f"valid counts {n_valid.tolist()} != {n_expect.tolist()}"
    for b in range(B):
        for s in range(S):
            row = idx[b, s]
            n = int(n_expect[b, s])
            assert bool((row[n:] == -1).all()), "-1 padding must come last"
            kept = row[:n].long()
            assert kept.unique().numel() == n, "duplicate positions"
            assert bool(((kept >= 0) & (kept < ctx[b, s])).all()), "invisible position kept"
    want = torch.topk(ref_logits, min(topk, ref_logits.shape[-1]), dim=-1).values
    if want.shape[-1] < topk:
        want = torch.cat([want, want.new_full((B, S, topk - want.shape[-1]), float("-inf"))], -1)
    got = selected_scores(idx, ref_logits)
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got))
    scale = _row_scale(ref_logits, mag)
    err = ((got - want).masked_fill(~fin, 0) / scale).abs().max().item()
    assert err <= 2 * tol, f"selected scores differ by {err:.3g} (relative)"
    if own_logits is not None:  # exactly the top-k of the kernel's own logits
        own_want = torch.topk(own_logits, min(topk, own_logits.shape[-1]), dim=-1).values
        own_got = selected_scores(idx, own_logits)[..., : own_want.shape[-1]]
        assert torch.equal(own_got, own_want)


# ------------------------------------------------------------------ interpreter/CPU

@pytest.mark.parametrize("q_dtype,k_dtype", DTYPES)
def test_logits_match_reference(q_dtype, k_dtype):
    args = make(B=3, S=2, q_dtype=q_dtype, k_dtype=k_dtype, ctx=[[0, 5], [17, 40], [64, 33]])
    ref = reference_logits(*args, 64)
    for be in ("torch_fallback", "torch_capped", "triton"):
        out = indexer_logits(*args, backend=be)
        assert_logits_close(out, ref, tol_for(q_dtype, k_dtype, args[0].device))
    assert torch.isneginf(out[0, 0]).all()           # a zero-length row is all -inf


def _plan(args, L, *, fill_tail=True, props=CPU_PROPS, config=None):
    q, k, _, _, bt, _ = args
    B, S, H, D = q.shape
    return K.logits_plan(props, not CUDA, B * S, S, H, D, k.shape[1], bt.shape[1], L, q.dtype,
                         k.dtype, fill_tail, config)


def test_bf16_dot_is_upcast_in_interpreter():
    """Triton's interpreter returns garbage for bf16 x bf16 tl.dot: the kernel must upcast.

    If the plan ever kept bf16 tiles under the interpreter (whatever device it plans for),
    the bf16 logits test above (and this one, at a larger head dim) would fail.
    """
    if CUDA:
        pytest.skip("interpreter only")
    args = make(B=2, S=1, H=16, D=64, q_dtype=BF16, k_dtype=BF16, ctx=[[64], [31]])
    for props in (CPU_PROPS, SM80, DeviceProps.nominal((9, 0))):
        assert _plan(args, 64, props=props).meta["DOT"] == K.DOT_FP32
    assert_logits_close(indexer_logits(*args, backend="triton"), reference_logits(*args, 64),
                        TOL_INTERPRETER)


def test_fp8_byte_decode_route_all_codes():
    """The sm_80 route (e4m3 passed as bytes, decoded in the kernel) on every finite e4m3
    code: planned for an sm_80 device, run here (the interpreter, or this GPU)."""
    codes = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=torch.uint8)
    q, _, ks, w, bt, ctx = make(B=2, S=1, H=4, D=32, page=16, max_pages=4, ctx=[[64], [50]],
                                q_dtype=FP8, k_dtype=FP8)
    P = ks.shape[0]
    k = codes.repeat(P * 16 * 32 // codes.numel() + 1)[: P * 16 * 32].reshape(P, 16, 32)
    k = k.to(q.device).view(FP8)
    args = (q, k, ks, w, bt, ctx)
    plan = _plan(args, 64, props=SM80)
    assert plan.q_u8 and plan.k_u8
    ref = reference_logits(*args, 64)
    out = K.indexer_logits(*args, 64, props=SM80)
    assert_logits_close(out, ref, tol_for(BF16, BF16, q.device))
    idx = K.indexer_topk(*args, 64, 16, props=SM80)
    check_topk(idx, ref, ctx, 16, tol_for(BF16, BF16, q.device))


@pytest.mark.parametrize("topk", [1, 7, 16, 40, 64, 100])
def test_topk_matches_reference(topk):
    args = make(B=3, S=2, ctx=[[0, 5], [17, 40], [64, 33]], seed=topk)
    ref = reference_logits(*args, 64)
    own = indexer_logits(*args, backend="triton")
    for be in ("torch_fallback", "torch_capped", "triton"):
        idx = indexer_topk(*args, topk=topk, backend=be)
        check_topk(idx, ref, args[5], topk, TOL_INTERPRETER, own if be == "triton" else None)


def test_topk_padding_when_few_visible():
    args = make(B=2, S=1, ctx=[[3], [1]])
    idx = indexer_topk(*args, topk=8, backend="triton")
    assert sorted(idx[0, 0, :3].tolist()) == [0, 1, 2] and idx[0, 0, 3:].eq(-1).all()
    assert idx[1, 0, 0].item() == 0 and idx[1, 0, 1:].eq(-1).all()


def test_topk_all_ties_and_all_negative():
    q, k, ks, w, bt, ctx = make(B=2, S=1, ctx=[[64], [40]])
    zero_w = torch.zeros_like(w)                      # every logit is exactly 0
    idx = indexer_topk(q, k, ks, zero_w, bt, ctx, topk=10, backend="triton")
    check_topk(idx, reference_logits(q, k, ks, zero_w, bt, ctx, 64), ctx, 10, TOL_INTERPRETER)
    neg_w = -w.abs() - 0.1                            # every logit <= 0, many distinct
    ref = reference_logits(q, k, ks, neg_w, bt, ctx, 64)
    idx = indexer_topk(q, k, ks, neg_w, bt, ctx, topk=10, backend="triton")
    check_topk(idx, ref, ctx, 10, TOL_INTERPRETER, indexer_logits(q, k, ks, neg_w, bt, ctx,
                                                                  backend="triton"))


def test_logits_grid_saturates_at_h200_shapes():
    """The one way L enters the logits grid (the cap at cdiv(L, block_n) tiles) is gone
    from 8K tokens up: at the bench's H200 shape (64 rows, fp8 config) the grid is the same
    at 8K, 32K, 128K and 1M max-context tokens (2,048 .. 262,144 entries)."""
    h200 = DeviceProps.nominal((9, 0))
    grids = {L: K.logits_plan(h200, False, 64, 1, 64, 128, 64, L // 64, L, FP8, FP8, False).grid
             for L in (2048, 8192, 32768, 262144)}
    cfg = K.logits_config(K.DOT_FP8, FP8, h200)
    per_row = cfg.programs_per_sm * h200.sm_count // 64
    assert set(grids.values()) == {(64, per_row)}, grids
    assert K.logits_splits(64, 1024, cfg.block_n, cfg.programs_per_sm, h200.sm_count) < per_row


def _int_specialisation(*ints):
    """How Triton specialises integer arguments (== 1, divisible by 16)."""
    return [(v == 1, v % 16 == 0) for v in ints]


def test_topk_launches_and_result_independent_of_max_context():
    """Same actual lengths, max context 256 vs 4,096 entries: identical grids, constexprs
    and integer specialisations (so one compiled kernel and the same work), same result."""
    q, k, ks, w, bt, ctx = make(B=2, S=2, page=16, max_pages=256, ctx=[[40, 7], [16, 0]])
    launches, outs = [], []
    for L in (256, 4096):
        bt_l = bt[:, : L // 16].contiguous()
        args = (q, k, ks, w, bt_l, ctx)
        lp = _plan(args, L, fill_tail=False)
        tp = K.topk_plan(not CUDA, 4, L, lp.n_bound, 16)
        launches.append((lp.grid, lp.meta, tp.grid, tp.meta,
                         _int_specialisation(L, lp.n_bound, bt_l.stride(0))))
        outs.append(K.indexer_topk(*args, L, 16))
    assert launches[0] == launches[1]
    assert launches[0][0][1] > 1 and launches[0][2] == (4,)
    assert torch.equal(outs[0], outs[1])
    check_topk(outs[0], reference_logits(q, k, ks, w, bt, ctx, 256), ctx, 16, TOL_INTERPRETER)


def test_topk_writes_no_logits_for_rows_that_keep_everything():
    """No O(L) write: the scratch is touched only over the visible tiles of rows with more
    than topk entries (NaN sentinels elsewhere survive); nothing at all when n <= topk."""
    q, k, ks, w, bt, ctx = make(B=3, S=2, page=16, max_pages=8, ctx=[[40, 7], [16, 0], [128, 3]])
    L, topk = 128, 16
    ref = reference_logits(q, k, ks, w, bt, ctx, L)
    small = ctx.clamp(max=topk)
    scratch = torch.full((3, 2, L), float("nan"))
    idx = K.indexer_topk(q, k, ks, w, bt, small, L, topk, scratch=scratch)
    assert torch.isnan(scratch).all(), "a row with n <= topk wrote logits"
    check_topk(idx, reference_logits(q, k, ks, w, bt, small, L), small, topk, TOL_INTERPRETER)
    idx = K.indexer_topk(q, k, ks, w, bt, ctx, L, topk, scratch=scratch)
    check_topk(idx, ref, ctx, topk, TOL_INTERPRETER)
    bn = _plan((q, k, ks, w, bt, ctx), L, fill_tail=False).meta["BLOCK_N"]
    for b in range(3):
        for s in range(2):
            n = int(ctx[b, s])
            written = -(-n // bn) * bn if n > topk else 0
            assert not torch.isnan(scratch[b, s, :n if n > topk else 0]).any()
            assert torch.isnan(scratch[b, s, written:]).all(), (b, s, n)
    with pytest.raises(ValueError, match="scratch"):
        K.indexer_topk(q, k, ks, w, bt, ctx, L, topk, scratch=torch.empty(3, 2, L - 1))


def test_max_context_narrower_than_block_table():
    args = make(B=2, S=2, max_pages=5, ctx=[[30, 0], [45, 45]])
    ref = reference_logits(*args, 45)
    out = indexer_logits(*args, max_context=45, backend="triton")
    assert out.shape == (2, 2, 45)
    assert_logits_close(out, ref, TOL_INTERPRETER)
    for be in ("torch_fallback", "triton"):
        check_topk(indexer_topk(*args, max_context=45, topk=20, backend=be), ref, args[5], 20,
                   TOL_INTERPRETER)


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(B=st.integers(1, 5), S=st.integers(1, 3), page=st.sampled_from([4, 5, 16, 12]),
       max_pages=st.integers(1, 5), topk=st.sampled_from([1, 3, 16, 33]),
       dt=st.sampled_from(DTYPES), seed=st.integers(0, 2**16), data=st.data())
def test_sweep_shapes(B, S, page, max_pages, topk, dt, seed, data):
    L = max_pages * page
    ctx = data.draw(st.lists(st.integers(0, L), min_size=B * S, max_size=B * S))
    args = make(B=B, S=S, page=page, max_pages=max_pages, ctx=ctx, q_dtype=dt[0],
                k_dtype=dt[1], seed=seed)
    ref = reference_logits(*args, L)
    q, k, ks, w, bt, lens = args
    mag = reference_logits(q, k, ks, w.abs(), bt, lens, L)     # the terms' magnitude (see top)
    own = indexer_logits(*args, backend="triton")
    tol = tol_for(*dt, args[0].device)
    assert_logits_close(own, ref, tol, mag)
    check_topk(indexer_topk(*args, topk=topk, backend="triton"), ref, args[5], topk, tol, own, mag)


# launch shapes other than the device's (what tools/tune_indexer.py sweeps)
CONFIG_VARIANTS = [
    K.LogitsConfig(16, None, 4, 2, 1),      # q^T resident, few splits
    K.LogitsConfig(16, None, 4, 2, 64),     # more splits than tiles
    K.LogitsConfig(32, 16, 4, 3, 3),        # the head dim in two chunks
]


@pytest.mark.parametrize("config", CONFIG_VARIANTS)
def test_config_variants(config):
    args = make(B=3, S=2, max_pages=5, ctx=[[0, 5], [17, 80], [64, 33]], q_dtype=BF16, seed=7)
    ref = reference_logits(*args, 80)
    own = K.indexer_logits(*args, 80, config=config)
    assert_logits_close(own, ref, tol_for(BF16, FP8, args[0].device))
    # top-k skips scoring rows with n <= topk; the longer rows are still exact
    check_topk(K.indexer_topk(*args, 80, 20, config=config), ref, args[5], 20,
               tol_for(BF16, FP8, args[0].device), own)


def test_dispatch_table_per_capability():
    """The route each GPU takes: e4m3 tensor cores from sm_89, bf16 on sm_80 (bytes decoded
    in the kernel), fp32 for an fp32 operand and in the interpreter."""
    want = {(8, 0): "bf16", (8, 9): "fp8", (9, 0): "fp8", (10, 0): "fp8", (12, 0): "fp8"}
    for cap in CAPABILITIES:
        p = DeviceProps.nominal(cap)
        assert K.DOT_NAMES[K.dot_path(FP8, FP8, p)] == want[cap]
        assert K.dot_path(BF16, FP8, p) == K.dot_path(FP8, BF16, p) == K.DOT_BF16
        assert K.dot_path(F32, FP8, p) == K.DOT_FP32
        for op, table in K.TABLES.items():
            assert table[-1].capabilities is None           # the portable lesson kernel last
            assert choose(table, p) is table[K.dot_path(FP8, FP8, p)]
    assert K.dot_path(FP8, FP8, CPU_PROPS) == K.DOT_FP32
    assert set(K.TABLES) == {"indexer_logits", "indexer_topk"}


def test_configs_come_from_the_device():
    """A tuned entry where one was measured (sm_90), the portable rule elsewhere; every
    config of every capability passes the compile rules; a GPU with little shared memory
    gets fewer pipeline stages, never a config that cannot fit."""
    for cap in CAPABILITIES:
        p = DeviceProps.nominal(cap)
        for q_dt, k_dt in itertools.product((FP8, BF16, F32), repeat=2):
            dot = K.dot_path(q_dt, k_dt, p)
            K.check_config(K.logits_config(dot, k_dt, p), dot)
    h200 = DeviceProps.nominal((9, 0))
    assert K.logits_config(K.DOT_BF16, FP8, h200) == K.TUNED[(9, 0)][("bf16", "fp8")]
    assert K.logits_config(K.DOT_FP8, FP8, h200) == K.TUNED[(9, 0)][("fp8", "*")]
    roomy = K.logits_config(K.DOT_BF16, BF16, DeviceProps.nominal((12, 0)))
    small = K.logits_config(K.DOT_BF16, BF16, DeviceProps((12, 0), 188, 48 * 1024, "small"))
    assert roomy.num_stages == 3 and 1 <= small.num_stages < roomy.num_stages


@pytest.mark.parametrize("bad,field", [
    (dict(block_d=8), "block_d"), (dict(block_d=24), "block_d"), (dict(block_n=8), "block_n"),
    (dict(block_n=96), "block_n"), (dict(num_warps=3), "num_warps"),
    (dict(num_stages=0), "num_stages"), (dict(programs_per_sm=0), "programs_per_sm")])
def test_bad_launch_config_rejected_before_the_kernel(bad, field):
    args = make(B=2, S=1, ctx=[[10], [20]], q_dtype=F32)
    cfg = K.LogitsConfig(**{**K.LogitsConfig(64, 16, 4, 2, 8).__dict__, **bad})
    with pytest.raises(ValueError, match=field):
        K.indexer_logits(*args, 64, config=cfg)
    with pytest.raises(ValueError, match="LogitsConfig"):
        K.indexer_logits(*args, 64, config=dict(block_n=64))
    with pytest.raises(ValueError, match="block_d"):  # an e4m3 x e4m3 dot needs K >= 32
        K.check_config(K.LogitsConfig(128, 16, 4, 2, 8), K.DOT_FP8)
    K.check_config(K.LogitsConfig(128, 16, 4, 2, 8), K.DOT_BF16)


def test_to_cache_slots():
    bt = torch.tensor([[5, 2, 7], [0, 1, 3]], dtype=torch.int32)
    idx = torch.tensor([[[0, 15, 16, 40, -1]], [[47, -1, 3, 17, 32]]], dtype=torch.int32)
    out = to_cache_slots(idx, bt, 16)
    want = [[[80, 95, 32, 120, -1]], [[63, -1, 3, 17, 48]]]
    assert out.dtype == torch.int32 and out.tolist() == want
    # round trip with the indexer: slots address the flat cache at the chosen keys
    q, k, ks, w, bt, ctx = make(B=2, S=1, ctx=[[50], [7]])
    idx = indexer_topk(q, k, ks, w, bt, ctx, topk=8, backend="triton")
    slots = to_cache_slots(idx, bt, 16)
    assert torch.equal(slots < 0, idx < 0)
    flat = k.view(torch.uint8).reshape(-1, 32)
    pos = idx[0, 0].long()
    pages = bt[0].long()[pos // 16]
    assert torch.equal(flat[slots[0, 0].long()], k.view(torch.uint8)[pages, pos % 16])


def test_backends_registered_and_resolved():
    for op in ("indexer_logits", "indexer_topk"):
        names = {b.name for b in backends.backends(op)}
        assert {"torch_fallback", "torch_capped", "triton"} <= names
    tgt = backends.Target("cpu", None, interpreter=True)
    assert backends.resolve("indexer_topk", "auto", target=tgt).name == "triton"
    assert backends.resolve("indexer_topk", "auto",
                            target=backends.Target("cpu", None, False)).name == "torch_capped"
    with pytest.raises(backends.BackendUnavailable, match="nope"):
        backends.resolve("indexer_topk", "nope")


def _bad(**over):
    q, k, ks, w, bt, ctx = make(B=2, S=1, ctx=[[10], [20]])
    kw = dict(q=q, k_cache=k, k_scale=ks, weights=w, block_table=bt, context_lens=ctx)
    extra = {n: over.pop(n) for n in ("max_context", "topk") if n in over}
    kw.update(over)
    return kw, extra


@pytest.mark.parametrize("change,name", [
    (dict(q=torch.randn(2, 4, 32)), "q"),
    (dict(q=torch.randint(0, 3, (2, 1, 4, 32))), "q"),
    (dict(k_cache=torch.randn(9, 16, 16).to(FP8)), "k_cache"),
    (dict(k_cache=torch.randn(9, 16, 32).half()), "k_cache"),
    (dict(k_scale=torch.rand(9, 8)), "k_scale"),
    (dict(k_scale=torch.rand(9, 16).double()), "k_scale"),
    (dict(weights=torch.randn(2, 1, 3)), "weights"),
    (dict(weights=torch.randn(2, 1, 4).half()), "weights"),
    (dict(block_table=torch.zeros(2, 4, dtype=torch.int64)), "block_table"),
    (dict(block_table=torch.zeros(3, 4, dtype=torch.int32)), "block_table"),
    (dict(block_table=torch.full((2, 4), 99, dtype=torch.int32)), "block_table"),
    (dict(context_lens=torch.zeros(2, 2, dtype=torch.int32)), "context_lens"),
    (dict(context_lens=torch.zeros(2, 1, dtype=torch.int64)), "context_lens"),
    (dict(context_lens=torch.tensor([[10], [65]], dtype=torch.int32)), "context_lens"),
    (dict(context_lens=torch.tensor([[-1], [5]], dtype=torch.int32)), "context_lens"),
    (dict(max_context=65), "max_context"),
    (dict(max_context=0), "max_context"),
    (dict(max_context=15), "context_lens"),           # 20 visible > L = 15
    (dict(topk=0), "topk"),
])
def test_bad_inputs_name_the_argument(change, name):
    kw, extra = _bad(**change)
    kw = {k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    with pytest.raises(ValueError, match=name):
        indexer_topk(*kw.values(), backend="torch_capped", **extra)
    if "topk" not in extra:
        with pytest.raises(ValueError, match=name):
            indexer_logits(*kw.values(), backend="triton", **extra)


def test_validate_false_skips_the_value_checks_only():
    """validate=False skips the value checks (one host read) and nothing else: the shape and
    dtype checks stay; the torch reference clamps a bad page id instead of failing."""
    kw, _ = _bad(block_table=torch.full((2, 4), 99, dtype=torch.int32))
    kw = {k: v.to(DEV) for k, v in kw.items()}
    with pytest.raises(ValueError, match=r"block_table .* got 99"):
        indexer_topk(*kw.values(), backend="torch_fallback")
    assert indexer_topk(*kw.values(), backend="torch_fallback", validate=False).shape == (2, 1, 512)
    assert indexer_logits(*kw.values(), backend="torch_fallback", validate=False).shape == (2, 1, 64)
    with pytest.raises(ValueError, match="weights"):
        indexer_logits(*list(kw.values())[:3], kw["weights"][:, :, :2], *list(kw.values())[4:],
                       validate=False)
    with pytest.raises(ValueError, match="validate"):
        indexer_logits(*kw.values(), validate="yes")
    bt = torch.zeros(2, 3, dtype=torch.int32)
    far = torch.full((2, 1, 4), 48, dtype=torch.int32)
    assert to_cache_slots(far, bt, 16, validate=False).shape == (2, 1, 4)


def test_value_checks_see_only_visible_pages():
    """Pages past a row's longest context may hold anything (-1 here): not read, not checked;
    a bad id on a visible page is refused."""
    args = make(B=2, S=2, ctx=[[20, 3], [0, 0]], unused=-1)
    assert (args[4] == -1).any()
    indexer_topk(*args, topk=4, backend="torch_capped")
    bt = args[4].clone()
    bt[0, 1] = -1                                    # row 0 sees entries 0..19: pages 0 and 1
    with pytest.raises(ValueError, match="block_table"):
        indexer_topk(*args[:4], bt, args[5], topk=4, backend="torch_capped")


def test_bad_inputs_to_cache_slots():
    bt = torch.zeros(2, 3, dtype=torch.int32)
    idx = torch.zeros(2, 1, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="page_size"):
        to_cache_slots(idx, bt, 0)
    with pytest.raises(ValueError, match="indices"):
        to_cache_slots(idx.float(), bt, 16)
    with pytest.raises(ValueError, match="indices"):
        to_cache_slots(torch.full((2, 1, 4), 48, dtype=torch.int32), bt, 16)
    with pytest.raises(ValueError, match="block_table"):
        to_cache_slots(idx, bt[:1], 16)
    with pytest.raises(ValueError, match="block_table"):
        to_cache_slots(idx, bt.long(), 16)


def test_bench_smoke_rows_and_figures():
    """``dsv4lab bench indexer --smoke``: every backend, eager and graph rows labelled by
    ``mode``, the fields the targets and plots read; the figures draw the smoke rows and the
    recorded ones (rows from before ``mode`` existed included)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from dsv4lab import benchmarks, results
    from dsv4lab.plots import indexer as P
    from dsv4lab.widgets import indexer as WI
    rows = benchmarks.run("indexer", smoke=True, record=False)
    seen = {(r["kind"], r["backend"], r["mode"]) for r in rows}
    assert seen == {("topk_vs_max_context", b, "eager") for b in ("torch_fallback", "torch_capped", "triton")} | {
        ("topk_vs_max_context", "triton", "graph"), ("logits_roofline", "triton", "eager"),
        ("logits_roofline", "triton", "graph"), ("matmul_dtype", "triton", "graph")}
    for r in rows:
        for field in ("op", "backend", "actual_tokens", "max_context_tokens", "q_dtype", "k_dtype",
                      "ms", "roofline_fraction"):
            assert field in r, field
    recorded = [r for r in results.load("indexer") if not r.get("smoke")]
    assert {P.mode_of(r) for r in recorded} <= {"eager", "graph"}
    for data, smoke in ((rows, True), (recorded, False)):
        fig, ax = plt.subplots(1, 3)
        P.plot_topk_vs_max_context(data, ax=ax[0], smoke=smoke)
        P.plot_dtype_flips(data, ax=ax[1], smoke=smoke)
        P.plot_decode_share(data, ax=ax[2])
        plt.close(fig)
    html = WI.table_html(recorded, 1048576, 512)
    assert "torch_fallback" in html and "triton" in html


# ------------------------------------------------------------------------------ GPU

@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("q_dtype,k_dtype", DTYPES)
@pytest.mark.parametrize("S", [1, 2])
def test_gpu_full_shape_logits_and_topk(q_dtype, k_dtype, S):
    """64 heads x 128 dims, pages of 64, rows shorter and longer than topk = 512."""
    B, page, max_pages = 6, 64, 40
    L = page * max_pages
    ctx = torch.tensor([0, 1, 300, 512, 513, 2500, 1999, 2560, 777, 64, 4096 // 2, 100][: B * S])
    args = make(B=B, S=S, H=64, D=128, page=page, max_pages=max_pages, ctx=ctx,
                q_dtype=q_dtype, k_dtype=k_dtype, device="cuda", seed=S)
    ref = reference_logits(*args, L)
    tol = tol_for(q_dtype, k_dtype, "cuda")
    own = indexer_logits(*args, backend="triton")
    assert_logits_close(own, ref, tol)
    idx = indexer_topk(*args, topk=512, backend="triton")
    check_topk(idx, ref, args[5], 512, tol, own)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("config,q_dtype,k_dtype", [
    (K.LogitsConfig(128, None, 4, 3, 1), FP8, FP8), (K.LogitsConfig(128, None, 4, 2, 64), FP8, FP8),
    (K.LogitsConfig(256, None, 8, 3, 8), FP8, FP8), (K.LogitsConfig(64, None, 4, 4, 8), FP8, FP8),
    (K.LogitsConfig(64, None, 4, 3, 1), BF16, FP8), (K.LogitsConfig(64, 32, 4, 2, 3), F32, FP8)])
def test_gpu_config_variants(config, q_dtype, k_dtype):
    """Launch shapes the tuner sweeps (the tuner also checks each against the reference)."""
    B, page, max_pages = 5, 64, 24
    L = page * max_pages
    args = make(B=B, S=1, H=64, D=128, page=page, max_pages=max_pages,
                ctx=[[0], [1], [700], [L], [513]], q_dtype=q_dtype, k_dtype=k_dtype,
                device="cuda", seed=11)
    ref = reference_logits(*args, L)
    tol = tol_for(q_dtype, k_dtype, "cuda")
    own = K.indexer_logits(*args, L, config=config)
    assert_logits_close(own, ref, tol)
    check_topk(K.indexer_topk(*args, L, 512, config=config), ref, args[5], 512, tol, own)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_fp8_byte_route_and_long_rows():
    """The sm_80 route (planned for an sm_80 device, run on this GPU) and rows long enough
    for the radix select, top-512 and top-2048."""
    args = make(B=3, S=1, H=64, D=128, page=64, max_pages=300, ctx=[[19200], [513], [4000]],
                q_dtype=FP8, k_dtype=FP8, device="cuda")
    L = 64 * 300
    ref = reference_logits(*args, L)
    own = K.indexer_logits(*args, L, props=SM80)
    assert_logits_close(own, ref, TOL_GPU[BF16])
    check_topk(K.indexer_topk(*args, L, 512, props=SM80), ref, args[5], 512, TOL_GPU[BF16], own)
    check_topk(K.indexer_topk(*args, L, 2048), ref, args[5], 2048, TOL_GPU[FP8])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_cuda_graph_replay_new_lengths_and_block_tables():
    """Capture one decode-step indexer_topk (triton); replay with new context_lens and
    block tables written into the same buffers; match eager results, no re-capture."""
    B, H, D, page, max_pages, topk = 8, 64, 128, 64, 48, 512
    L = page * max_pages
    q, k, ks, w, bt, ctx = make(B=B, S=1, H=H, D=D, page=page, max_pages=max_pages,
                                ctx=[[L]] * B, q_dtype=FP8, k_dtype=FP8, device="cuda",
                                spare_pages=16)
    P = k.shape[0]

    def step():
        return indexer_topk(q, k, ks, w, bt, ctx, topk=topk, backend="triton")

    graph, out = bench.capture_graph(step)

    g = torch.Generator().manual_seed(1)
    scenarios = [
        torch.tensor([0, 1, 511, 512, 513, 3000, L, 64]),
        torch.randint(0, L + 1, (B,), generator=g),
        torch.tensor([L] * B),
        torch.tensor([5] * B),
    ]
    for i, lens in enumerate(scenarios):
        ctx.copy_(lens.reshape(B, 1).to(torch.int32))
        bt.copy_(torch.randperm(P, generator=g)[: B * max_pages].reshape(B, max_pages)
                 .to(torch.int32))
        k.view(torch.uint8).copy_(torch.randint(0, 0x7F, k.shape, generator=g, dtype=torch.uint8))
        graph.replay()
        torch.cuda.synchronize()
        replayed = out.clone()
        eager = step()
        assert torch.equal(replayed, eager), f"scenario {i}: replay differs from eager"
        ref = reference_logits(q, k, ks, w, bt, ctx, L)
        check_topk(replayed, ref, ctx, topk, TOL_GPU[FP8])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_first_call_plans_from_the_device():
    """What this GPU reports picks the launch: its route and config fit its shared memory,
    and an H200 gets the measured entry, the plan the offline compiles (and the recorded
    rows) describe."""
    from dsv4lab.kernels.device import props
    here = props(torch.device("cuda"))
    for q_dt, k_dt in DTYPES:
        dot = K.dot_path(q_dt, k_dt, here)
        cfg = K.logits_config(dot, k_dt, here)
        K.check_config(cfg, dot)
        if here.capability == (9, 0):
            key = (K.DOT_NAMES[dot], "fp8" if dot == K.DOT_BF16 and k_dt == FP8 else "*")
            assert cfg == K.TUNED[(9, 0)].get(key, K.TUNED[(9, 0)].get((key[0], "*")))
    args = make(B=64, S=1, H=64, D=128, page=64, max_pages=8, ctx=[[300]] * 64, q_dtype=FP8,
                k_dtype=FP8, device="cuda")
    idx = indexer_topk(*args, topk=512, backend="triton")      # a first call: nothing timed first
    check_topk(idx, reference_logits(*args, 512), args[5], 512, TOL_GPU[FP8])
