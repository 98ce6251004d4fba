"""dsv4lab.engine: paged cache, prefill + batched greedy decode, EOS, backends, CUDA graphs.

The reference for greedy decoding is the training forward run on the whole growing
sequence (fp32): the engine's tokens must equal its argmaxes exactly. The tiny models keep
``index_topk`` >= the visible entries where exact agreement with the dense path is
asserted (indexer selection ties are tested in test_model.py).
"""
import copy
import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4lab.engine import Engine, PagedKVCache, decode_text
from dsv4lab.model import DSV4, DecodeMeta, make_meta, tiny_config

from _model_support import TORCH, TRITON, _one_thread  # noqa: F401  (autouse fixture)


_MODELS = {}


def _model(seed=0, **changes):
    key = (seed, tuple(sorted(changes.items())))
    if key not in _MODELS:
        torch.manual_seed(seed)
        _MODELS[key] = DSV4(tiny_config(**changes)).eval().quantize_experts("mxfp4")
    return copy.deepcopy(_MODELS[key])      # the engine casts/moves its model in place


@torch.no_grad()
def _greedy_reference(m, prompt, n):
    seq = list(prompt)
    for _ in range(n):
        logits, _, _ = m.forward_train(torch.tensor([seq]))
        seq.append(int(logits[0, -1].argmax()))
    return seq[len(prompt):]


def _until_eos(tokens, eos):
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


@settings(max_examples=10, deadline=None)
@given(lens=st.lists(st.integers(1, 23), min_size=1, max_size=3),
       max_new=st.integers(1, 7), page=st.sampled_from([4, 8, 16]), seed=st.integers(0, 2 ** 16))
def test_greedy_generation_equals_reference(lens, max_new, page, seed):
    m = _model(index_topk=64)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lens]
    eng = Engine(m, max_batch=3, max_len=48, page_size=page, backends=TORCH)
    free = eng.cache.free_pages
    out = eng.generate(prompts, max_new, progress=False)
    assert eng.cache.free_pages == free                         # pages handed back
    assert len(out.tokens) == len(prompts)
    for p, toks in zip(prompts, out.tokens):
        assert toks == _greedy_reference(m, p, max_new)


def test_triton_backends_in_interpreter_generate_the_same_tokens():
    m = _model(seed=3)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [200, 100]]
    ref = Engine(m, max_batch=2, max_len=24, page_size=8, backends=TORCH).generate(prompts, 3)
    got = Engine(m, max_batch=2, max_len=24, page_size=8, backends=TRITON).generate(prompts, 3)
    assert got.tokens == ref.tokens


def test_position_table_gathers_what_make_meta_computes():
    """A step's DecodeMeta is gathered from the loop's position table (filled by the
    prefill); every field must equal make_meta's, at any position the pages hold."""
    eng = Engine(_model(), max_batch=2, max_len=40, page_size=4, backends=TORCH)
    loop = eng.loop(2, 2)
    pages = eng.admit(loop)
    try:
        loop.load([[1, 2, 3], [4, 5]], 4, None)
        loop.run_prefill()
        pos = torch.tensor([[0, 1, 2, 3, 7], [5, 17, 31, 38, loop.P - 1]])
        got = loop.meta_at(pos, eng.table_ratios)
        want = make_meta(eng.cfg, pos, loop.block_table, loop.cblock_table, eng.page_size, eng.table_ratios)
    finally:
        eng.cache.release(pages)
    assert eng.table_ratios == [4, 8]
    for f in dataclasses.fields(DecodeMeta):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), f.name
        elif isinstance(b, dict) and f.name != "memo":
            assert a.keys() == b.keys(), f.name
            for r in b:
                assert a[r].dtype == b[r].dtype and torch.equal(a[r], b[r]), (f.name, r)
    window_only = loop.meta_at(pos, [0])
    assert window_only.block_slots == {} and torch.equal(window_only.window, want.window)


def test_prompts_are_padded_to_a_power_of_two():
    eng = Engine(_model(), max_batch=2, max_len=48, page_size=8, backends=TORCH)
    loop = eng.loop(2, 0)
    for lens, bucket in (((1, 3), 16), ((17, 2), 32), ((33,), 48)):
        loop.load([[7] * n for n in lens] + [[7]] * (2 - len(lens)), 4, None)
        assert loop.bucket == bucket
        assert loop.inputs[:, 0].tolist()[:len(lens)] == list(lens)


@pytest.mark.parametrize("k", [0, 1, 3])
def test_eos_ends_each_request_at_its_first_eos(k):
    m = _model(seed=6, index_topk=64)
    prompts = [[3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8, 1, 8], [9]]
    eng = Engine(m, max_batch=3, max_len=48, page_size=8, backends=TORCH)
    plain = eng.generate(prompts, 10)
    eos = plain.tokens[0][3]                        # request 0 stops at its 4th token or earlier
    out = eng.generate(prompts, 10, num_draft=k, eos_token_id=eos)
    assert out.tokens == [_until_eos(t, eos) for t in plain.tokens]
    assert len(out.tokens[0]) <= 4 and out.tokens[0][-1] == eos
    assert out.steps <= plain.steps


def test_eos_as_the_first_token_runs_no_step():
    m = _model(seed=6, index_topk=64)
    eng = Engine(m, max_batch=1, max_len=32, page_size=8, backends=TORCH)
    first = eng.generate([[3, 1, 4]], 1).tokens[0][0]
    for k in (0, 2):
        out = eng.generate([[3, 1, 4]], 8, num_draft=k, eos_token_id=first)
        assert out.tokens == [[first]] and out.steps == 0


def test_paged_cache_allocates_and_releases_pages():
    m = _model()
    c = PagedKVCache(m, num_pages=6, page_size=4, dtype=torch.float32)
    assert c.free_pages == 5                                    # page 0 is scratch
    a = c.alloc(3)
    assert 0 not in a and len(set(a)) == 3 and c.free_pages == 2
    with pytest.raises(RuntimeError, match="out of pages"):
        c.alloc(3)
    c.release(a)
    assert c.free_pages == 5
    assert len(c.layers) == m.cfg.num_layers + 1                # + the MTP layer
    assert c.layers[1].idx_keys is not None and c.layers[0].comp_kv is None
    assert c.nbytes() > 0
    assert len(PagedKVCache(m, 6, 4, dtype=torch.float32, ratios=[0, 4]).layers) == 2


def test_generate_rejects_bad_requests():
    eng = Engine(_model(), max_batch=2, max_len=16, page_size=4, backends=TORCH)
    with pytest.raises(ValueError, match="max_batch"):
        eng.generate([[1]] * 3, 2)
    with pytest.raises(ValueError, match="at least one token"):
        eng.generate([[]], 2)
    with pytest.raises(ValueError, match="max_len"):
        eng.generate([[1] * 12], 4)
    with pytest.raises(ValueError, match="num_draft"):
        eng.generate([[1]], 2, num_draft=4)
    with pytest.raises(ValueError, match="token ids"):
        eng.generate([[1, 256]], 2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.generate([[1]], 0)
    with pytest.raises(ValueError, match="eos_token_id"):
        eng.generate([[1]], 2, eos_token_id=256)
    with pytest.raises(ValueError, match="sync_every"):
        eng.generate([[1]], 2, sync_every=0)
    for bad in (dict(max_batch=0), dict(max_len=1), dict(page_size=0), dict(max_batch=2.0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Engine(_model(), backends=TORCH, **bad)


def test_text_prompts_and_progress_bar(capsys):
    eng = Engine(_model(), max_batch=1, max_len=32, page_size=8, backends=TORCH)
    out = eng.generate(["def f(x):"], 4, progress=True)
    assert len(out.tokens[0]) == 4 and isinstance(decode_text(out.tokens[0]), str)
    assert out.seconds > 0 and not out.graphs


def test_sync_every_changes_no_token():
    m = _model(seed=7)
    eng = Engine(m, max_batch=2, max_len=40, page_size=8, backends=TORCH)
    prompts = [[1, 2, 3], [4] * 9]
    ref = eng.generate(prompts, 9, num_draft=2)
    for every in (1, 3, 100):
        out = eng.generate(prompts, 9, num_draft=2, sync_every=every)
        assert out.tokens == ref.tokens and out.accept_hist == ref.accept_hist


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_cuda_graph_loop_equals_eager_and_replays_new_inputs(dtype, k):
    """The captured loop (prefill, step or verify + draft) gives the eager loop's tokens;
    a second request with other prompts (same bucket) replays the same graphs."""
    m = _model(seed=4)
    eager = Engine(m, max_batch=3, max_len=128, dtype=dtype, cuda_graphs=False)
    graph = Engine(m, max_batch=3, max_len=128, dtype=dtype, cuda_graphs=True)
    first = [[1, 2, 3, 4, 5, 6, 7], [9] * 30, [42]]
    second = [[8, 8, 1], [3] * 17, [200, 100, 50, 25]]
    out = graph.generate(first, 40, num_draft=k)
    assert out.graphs, out.notes
    loop = graph.loop(3, k)
    graphs, prefills = dict(loop.graphs), dict(loop.prefill_graphs)
    assert set(graphs) == ({"step"} if k == 0 else {"verify", "draft"}) and all(prefills.values())
    assert out.tokens == eager.generate(first, 40, num_draft=k).tokens
    again = graph.generate(second, 40, num_draft=k, eos_token_id=out.tokens[1][5])
    assert loop.graphs == graphs and loop.prefill_graphs == prefills     # nothing re-captured
    assert again.tokens == eager.generate(second, 40, num_draft=k, eos_token_id=out.tokens[1][5]).tokens


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_stage_calls_replay_the_graphs():
    eng = Engine(_model(seed=4), max_batch=1, max_len=96, cuda_graphs=True)
    eng.generate([[5, 4, 3]], 16, num_draft=2)
    calls = eng.loop(1, 2).stage_calls()
    assert set(calls) == {"prefill", "verify", "draft"}
    for fn in calls.values():
        fn()
    torch.cuda.synchronize()
    assert eng.generate([[5, 4, 3]], 16, num_draft=2).tokens == eng.generate([[5, 4, 3]], 16).tokens


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_generation_equals_reference_on_every_backend():
    m = _model(seed=5, index_topk=64)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]]
    ref = [_greedy_reference(m.float().cpu(), p, 12) for p in prompts]
    for attn in ("mma", "simt", "torch"):
        for moe in ("triton", "torch"):
            be = {"sparse_mla_decode": attn, "indexer_topk": "triton", "fused_moe": moe}
            out = Engine(m, max_batch=2, max_len=64, backends=be).generate(prompts, 12)
            assert out.tokens == ref, be
