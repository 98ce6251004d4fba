"""MTP speculative decoding: greedy output identical to plain decoding, token for token.

Three kinds of drafter: the model's own MTP layer (random model: almost every draft is
rejected, so rollback is exercised at every step), an "oracle" MTP that knows the plain
decoding's continuation but is corrupted at pseudo-random positions (every acceptance
length 0..k occurs), and the trained checkpoint's MTP layer (real acceptance).
"""
import copy
from pathlib import Path

import pytest
import torch

from dsv4lab.engine import Engine, Generation
from dsv4lab.model import DSV4, load_checkpoint, tiny_config

from _model_support import TORCH, TRITON, _one_thread  # noqa: F401  (autouse fixture)
CKPT = Path(__file__).resolve().parent.parent / "data" / "checkpoints" / "mini.safetensors"



_BASE = {}


def _model(seed=0):
    if seed not in _BASE:
        torch.manual_seed(seed)
        _BASE[seed] = DSV4(tiny_config()).eval().quantize_experts("mxfp4")
    return copy.deepcopy(_BASE[seed])


def _install_oracle(model, prompts, plain_tokens, corrupt_every=3):
    """Replace the MTP logits by one-hot guesses of the plain continuation (the MTP at
    position p predicts token p + 2), wrong at a fixed pseudo-random 1/corrupt_every of
    the positions."""
    seqs = [list(p) + list(t) for p, t in zip(prompts, plain_tokens)]
    L = max(len(s) for s in seqs) + 8
    table = torch.zeros(len(seqs), L, dtype=torch.long)
    for b, s in enumerate(seqs):
        table[b, :len(s)] = torch.tensor(s)
    real = model.mtp_forward_decode
    wrong = torch.rand(len(seqs), L, generator=torch.Generator().manual_seed(corrupt_every)) < 1 / corrupt_every

    def oracle(streams, next_tokens, meta, cache, backends=None, k=0):
        logits, h = real(streams, next_tokens, meta, cache, backends, k)
        pos = meta.positions
        B = pos.shape[0]
        tgt = table.to(pos.device)[torch.arange(B, device=pos.device)[:, None], (pos + 2).clamp_max(L - 1)]
        bad = wrong.to(pos.device)[torch.arange(B, device=pos.device)[:, None], pos.clamp_max(L - 1)]
        tgt = torch.where(bad, (tgt + 1) % logits.shape[-1], tgt)
        return torch.nn.functional.one_hot(tgt, logits.shape[-1]).float() * 100, h

    model.mtp_forward_decode = oracle


@pytest.mark.parametrize("k", [1, 2, 3])
def test_speculative_equals_plain_with_own_mtp(k):
    eng = Engine(_model(), max_batch=3, max_len=64, page_size=8, backends=TORCH)
    prompts = [[10, 20, 30, 40, 50], [7] * 19, [99]]
    plain = eng.generate(prompts, 12)
    spec = eng.generate(prompts, 12, num_draft=k)
    assert spec.tokens == plain.tokens
    assert sum(spec.accept_hist) > 0 and len(spec.accept_hist) == k + 1
    assert 1.0 <= spec.mean_accepted <= k + 1


@pytest.mark.parametrize("k,corrupt", [(1, 3), (2, 4), (3, 4), (3, 10 ** 6)])
def test_speculative_equals_plain_with_oracle_drafts(k, corrupt):
    m = _model(seed=1)
    prompts = [[1, 2, 3, 4, 5, 6], [200] * 13, [17, 18]]
    eng = Engine(m, max_batch=3, max_len=64, page_size=4, backends=TORCH)
    plain = eng.generate(prompts, 16)
    _install_oracle(m, prompts, plain.tokens, corrupt)
    spec = eng.generate(prompts, 16, num_draft=k)
    assert spec.tokens == plain.tokens
    hist = spec.accept_hist
    if corrupt > 10 ** 5:                   # a perfect drafter: every step accepts all k
        assert hist[k] > 0 and sum(hist[:k]) <= len(prompts)   # (except near the end)
        assert spec.steps < plain.steps
    else:                                   # rejections, partial and full acceptance
        assert hist[0] > 0 and hist[k] > 0 and (k == 1 or sum(hist[1:k]) > 0), hist
    acc = spec.acceptance
    assert len(acc) == k and all(0 <= a <= 1 for a in acc)
    assert all(acc[i] >= acc[i + 1] for i in range(k - 1))   # draft i+1 needs draft i


def test_acceptance_statistics():
    g = Generation(tokens=[[]], num_draft=2, steps=10, accept_hist=[2, 3, 5], seconds=1.0,
                   graphs=False)
    assert g.acceptance == [0.8, 0.5]
    assert g.mean_accepted == pytest.approx((2 * 1 + 3 * 2 + 5 * 3) / 10)


def test_speculative_with_triton_backends_in_interpreter():
    m = _model(seed=2)
    prompts = [[5, 4, 3, 2, 1, 0, 9], [33, 34]]
    ref = Engine(m, max_batch=2, max_len=32, page_size=8, backends=TORCH).generate(prompts, 4)
    eng = Engine(m, max_batch=2, max_len=32, page_size=8, backends=TRITON)
    _install_oracle(m, prompts, ref.tokens, 3)
    spec = eng.generate(prompts, 4, num_draft=2)
    assert spec.tokens == ref.tokens


@pytest.mark.skipif(not CKPT.exists(), reason="no trained checkpoint in data/checkpoints")
def test_trained_checkpoint_drafts_are_accepted_and_output_is_identical():
    m = load_checkpoint(CKPT)
    prompts = ["import os\nimport sys\n\n\ndef main(", "class Foo:\n    def __init__(self"]
    eng = Engine(m, max_batch=2, max_len=96, page_size=16, backends=TORCH)
    plain = eng.generate(prompts, 24)
    spec = eng.generate(prompts, 24, num_draft=2)
    assert spec.tokens == plain.tokens
    assert spec.acceptance[0] > 0.2          # the trained MTP layer predicts its model


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(not CKPT.exists(), reason="no trained checkpoint in data/checkpoints")
@pytest.mark.parametrize("backends", [
    {"sparse_mla_decode": "mma", "indexer_topk": "triton", "fused_moe": "triton"},
    {"sparse_mla_decode": "simt", "indexer_topk": "triton", "fused_moe": "triton"},
    {"sparse_mla_decode": "torch", "indexer_topk": "torch_fallback", "fused_moe": "torch"},
])
def test_gpu_speculative_equals_plain_on_every_backend(backends):
    m = load_checkpoint(CKPT)
    prompts = ["import os\n", "def main(argv=None):\n    ", "class A(B):\n", "    return self._",
               "# Copyright", "if __name__ == '__main__':\n", "try:\n    import ", "x = ["]
    eng = Engine(m, max_batch=8, max_len=256, backends=backends)
    plain = eng.generate(prompts, 160)
    for k in (1, 2, 3):
        spec = eng.generate(prompts, 160, num_draft=k)
        if backends["fused_moe"] != "torch":   # the torch MoE reference asks the host which experts were hit
            assert spec.graphs, spec.notes
        assert spec.tokens == plain.tokens, (k, backends)
        assert spec.acceptance[0] > 0.2


def test_draft_moe_backend_resolves_up_front():
    from dsv4lab.backends import BackendUnavailable
    m = _model()
    with pytest.raises(BackendUnavailable, match="trtllm_fp4"):
        Engine(m, max_batch=1, max_len=16, backends=TORCH, draft_backends=dict(TORCH, fused_moe="trtllm_fp4"))
    eng = Engine(m, max_batch=1, max_len=16, backends=TORCH, draft_backends=dict(TORCH, fused_moe="triton"))
    assert eng.moe_plans["draft"].backend.name == "triton" and eng.moe_plans["main"].backend.name == "torch"
    assert eng.moe_plans["draft"].fmt == "mxfp4"
    with pytest.raises(ValueError, match="unknown op"):
        Engine(m, max_batch=1, max_len=16, backends={"attention": "mma"})


def test_step_stages_are_labelled_for_the_profiler():
    """Every stage of an eager step runs under its record_function label (a profile splits a
    step's kernels by them); the labels change no token."""
    eng = Engine(_model(), max_batch=1, max_len=48, page_size=8, backends=TORCH)
    plain = eng.generate([[3, 1, 4, 1, 5]], 6)
    for k, want in ((0, {"meta", "main", "accept", "update"}),
                    (2, {"meta", "main", "accept", "mtp", "draft", "update"})):
        r = eng._runner(1, k)
        pages = eng.admit(r)
        try:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                eng.prefill(r, [[3, 1, 4, 1, 5]], 6)
                r.step()
        finally:
            eng.cache.release(pages)
        names = {e.name for e in prof.events()}
        assert {"step." + s for s in want} <= names, names
        assert not ({"step.mtp", "step.draft"} - {"step." + s for s in want}) & names
        assert ("prefill.mtp" in names) == (k > 0) and "prefill.main" in names
        assert eng.generate([[3, 1, 4, 1, 5]], 6, num_draft=k).tokens == plain.tokens


def test_admit_hands_back_pages_when_the_cache_runs_out():
    eng = Engine(_model(), max_batch=2, max_len=16, page_size=8, backends=TORCH)
    r = eng._runner(2, 0)
    free = eng.cache.free_pages
    hog = eng.cache.alloc(free - (eng.n_raw + eng.n_comp))     # room for one request, not two
    with pytest.raises(RuntimeError, match="out of pages"):
        eng.admit(r)
    assert eng.cache.free_pages == eng.n_raw + eng.n_comp
    eng.cache.release(hog)
    pages = eng.admit(r)
    assert len(pages) == 2 * (eng.n_raw + eng.n_comp) and eng.cache.free_pages == free - len(pages)
    assert r.block_table.tolist() == [pages[:eng.n_raw], pages[eng.n_raw + eng.n_comp:2 * eng.n_raw + eng.n_comp]]
    eng.cache.release(pages)


def test_bench_smoke_rows_and_figures():
    """``dsv4lab bench spec --smoke``: plain and speculative rows, each labelled with its
    ``mode`` (eager steps here: no CUDA graphs on the CPU), output identical to plain
    decoding; the figures draw these rows and the recorded ones (rows from before ``mode``
    existed included)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from dsv4lab import benchmarks, results
    from dsv4lab.plots import spec as P
    rows = benchmarks.run("spec", smoke=True, record=False)
    assert {(r["concurrency"], r["num_draft"]) for r in rows} == {(c, k) for c in (1, 2) for k in (0, 1, 2)}
    assert all(r["identical"] and r["mode"] == ("graph" if r["graphs"] else "eager") for r in rows)
    assert all(r["speedup"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    recorded = [r for r in results.load("spec") if not r.get("smoke")]
    assert {P.mode_of(r) for r in recorded} <= {"eager", "graph"}
    for data, smoke in ((rows, True), (recorded, False)):
        fig, ax = plt.subplots(1, 2)
        P.plot_acceptance(data, smoke=smoke, ax=ax[0])
        P.plot_speedup(data, smoke=smoke, ax=ax[1])
        plt.close(fig)
