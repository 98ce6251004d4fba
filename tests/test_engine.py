"""dsv4lab.engine: paged cache, prefill + batched greedy decode, backends, CUDA graphs.

The reference for greedy decoding is the training forward run on the whole growing
sequence (fp32): the engine's tokens must equal its argmaxes exactly. The tiny models keep
``index_topk`` >= the visible entries where exact agreement with the dense path is
asserted (indexer selection ties are tested in test_model.py).
"""
import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4lab.engine import Engine, PagedKVCache, decode_text
from dsv4lab.model import DSV4, tiny_config

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


def test_text_prompts_and_progress_bar(capsys):
    eng = Engine(_model(), max_batch=1, max_len=32, page_size=8, backends=TORCH)
    out = eng.generate(["def f(x):"], 4, progress=True)
    assert len(out.tokens[0]) == 4 and isinstance(decode_text(out.tokens[0]), str)
    assert out.seconds > 0 and not out.graphs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_decode_equals_eager(dtype):
    m = _model(seed=4)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9] * 30, [42]]
    eager = Engine(m, max_batch=3, max_len=128, dtype=dtype, cuda_graphs=False).generate(prompts, 40)
    graph = Engine(m, max_batch=3, max_len=128, dtype=dtype, cuda_graphs=True).generate(prompts, 40)
    assert graph.graphs, graph.notes
    assert graph.tokens == eager.tokens


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
