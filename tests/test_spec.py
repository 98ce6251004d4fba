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


RAW_FIELDS = ("kv", "comp_kv", "comp_gate", "idx_kv", "idx_gate")     # one row per token
ENTRY_FIELDS = ("kv", "idx_keys", "idx_scale")                          # one row per compressed entry


def _written_rows(eng, loop, prompts, max_new):
    """Per layer, {(field, kind, request): rows} of the positions plain decoding writes
    (prompt + max_new - 1 of them): raw rows, and the compressed entries complete by then."""
    page, out = eng.page_size, []
    bt, cbt = loop.block_table.tolist(), loop.cblock_table.tolist()
    for layer, ratio in zip(eng.cache.layers, eng.cache.ratios):
        rows = {}
        for b, p in enumerate(prompts):
            n = len(p) + max_new - 1
            slots = {"raw": [bt[b][q // page] * page + q % page for q in range(n)],
                     "entry": [cbt[b][j // page] * page + j % page for j in range(n // ratio)] if ratio else []}
            for name, t in vars(layer).items():
                if not isinstance(t, torch.Tensor):
                    continue
                flat = t.flatten(0, 1) if t.shape[:2] == (eng.cache.num_pages, page) else t
                for kind, names in (("raw", RAW_FIELDS), ("entry", ENTRY_FIELDS)):
                    if name in names and slots[kind]:
                        rows[(name, kind, b)] = flat[torch.tensor(slots[kind])].float()
        out.append(rows)
    return out


def test_rollback_leaves_the_cache_as_plain_decoding_writes_it():
    """Rejected drafts write rows at positions that are rolled back; after generation every
    row at a position plain decoding wrote holds what plain decoding wrote there (main
    layers), and the draft layer's rows agree between runs with different drafts."""
    prompts = [[1, 2, 3, 4, 5, 6], [200] * 13]
    n = 14
    plain_eng = Engine(_model(seed=1), max_batch=2, max_len=48, page_size=4, backends=TORCH)
    plain = plain_eng.generate(prompts, n)
    want = _written_rows(plain_eng, plain_eng.loop(2, 0), prompts, n)
    mtp_rows = []
    for k, corrupt in ((1, 3), (3, 2)):
        m = _model(seed=1)
        eng = Engine(m, max_batch=2, max_len=48, page_size=4, backends=TORCH)
        _install_oracle(m, prompts, plain.tokens, corrupt)
        spec = eng.generate(prompts, n, num_draft=k)
        assert spec.tokens == plain.tokens and spec.accept_hist[0] > 0      # drafts were rejected
        got = _written_rows(eng, eng.loop(2, k), prompts, n)
        for layer in range(eng.cfg.num_layers):
            for key, rows in want[layer].items():
                torch.testing.assert_close(got[layer][key], rows, atol=1e-5, rtol=1e-5,
                                           msg=lambda msg: f"layer {layer} {key}: {msg}")
        mtp_rows.append(got[eng.cfg.num_layers])
    for key, rows in mtp_rows[0].items():
        torch.testing.assert_close(mtp_rows[1][key], rows, atol=1e-5, rtol=1e-5)


def test_acceptance_statistics():
    g = Generation(tokens=[[]], num_draft=2, steps=10, accept_hist=[2, 3, 5], seconds=1.0,
                   graphs=False)
    assert g.acceptance == [0.8, 0.5]
    assert g.mean_accepted == pytest.approx((2 * 1 + 3 * 2 + 5 * 3) / 10)
    assert g.accepted_drafts == pytest.approx(g.mean_accepted - 1)
    empty = Generation(tokens=[[]], num_draft=0, steps=0, accept_hist=[0], seconds=0.0, graphs=False)
    assert empty.acceptance == [] and empty.mean_accepted == 1.0


def test_engine_drafts_with_a_given_mtp_layer():
    """Any MTP layer of the model's class drafts (as a checkpoint loader would hand one):
    a copy of the model's own gives the same acceptance; a wrong object is refused."""
    m = _model(seed=2)
    prompts = [[5, 4, 3, 2, 1, 0, 9], [33, 34]]
    own = Engine(copy.deepcopy(m), max_batch=2, max_len=32, page_size=8, backends=TORCH)
    ref = own.generate(prompts, 6, num_draft=2)
    main = copy.deepcopy(m)
    layer = main.mtp[0]
    main.mtp = torch.nn.ModuleList()                          # a model without its own MTP layer
    eng = Engine(main, max_batch=2, max_len=32, page_size=8, backends=TORCH, draft=layer)
    got = eng.generate(prompts, 6, num_draft=2)
    assert got.tokens == ref.tokens and got.accept_hist == ref.accept_hist
    with pytest.raises(ValueError, match="num_draft"):
        Engine(copy.deepcopy(main), max_batch=1, max_len=32, backends=TORCH).generate([[1]], 2, num_draft=1)
    with pytest.raises(ValueError, match="draft must be"):
        Engine(copy.deepcopy(m), max_batch=1, max_len=32, backends=TORCH, draft=torch.nn.Linear(2, 2))
    other = DSV4(tiny_config(hidden_size=32, q_lora_rank=16, o_lora_rank=16)).mtp[0]
    with pytest.raises(ValueError, match="hidden size"):
        Engine(copy.deepcopy(m), max_batch=1, max_len=32, backends=TORCH, draft=other)


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
        loop = eng.loop(1, k)
        pages = eng.admit(loop)
        try:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                loop.load([[3, 1, 4, 1, 5]], 6, None)
                loop.run_prefill()
                loop.run_step()
        finally:
            eng.cache.release(pages)
        names = {e.name for e in prof.events()}
        assert {"step." + s for s in want} <= names, names
        assert not ({"step.mtp", "step.draft"} - {"step." + s for s in want}) & names
        assert ("prefill.mtp" in names) == (k > 0) and "prefill.main" in names
        assert eng.generate([[3, 1, 4, 1, 5]], 6, num_draft=k).tokens == plain.tokens


def test_admit_hands_back_pages_when_the_cache_runs_out():
    eng = Engine(_model(), max_batch=2, max_len=16, page_size=8, backends=TORCH)
    loop = eng.loop(2, 0)
    free = eng.cache.free_pages
    hog = eng.cache.alloc(free - (eng.n_raw + eng.n_comp))     # room for one request, not two
    with pytest.raises(RuntimeError, match="out of pages"):
        eng.admit(loop)
    assert eng.cache.free_pages == eng.n_raw + eng.n_comp
    eng.cache.release(hog)
    pages = eng.admit(loop)
    assert len(pages) == 2 * (eng.n_raw + eng.n_comp) and eng.cache.free_pages == free - len(pages)
    assert loop.block_table.tolist() == [pages[:eng.n_raw], pages[eng.n_raw + eng.n_comp:2 * eng.n_raw + eng.n_comp]]
    eng.cache.release(pages)


def test_stage_calls_after_a_generation_change_no_output():
    """The bench times each stage alone after a generation: every request is done then, so
    a step changes no output; the prefill restarts the requests."""
    eng = Engine(_model(seed=2), max_batch=2, max_len=40, page_size=8, backends=TORCH)
    prompts = [[5, 4, 3, 2, 1], [33, 34]]
    for k in (0, 2):
        ref = eng.generate(prompts, 5, num_draft=k)
        loop = eng.loop(2, k)
        pages = eng.admit(loop)
        try:
            loop.load(prompts, 5, None)
            loop.run_prefill()
            while max(loop.remaining()):
                loop.run_step()
            before = loop.results(5)
            calls = loop.stage_calls()
            assert list(calls) == (["step"] if k == 0 else ["verify", "draft"]) + ["prefill"]
            for name in list(calls)[:-1]:
                calls[name]()
            assert loop.results(5) == before and before[0] == ref.tokens
        finally:
            eng.cache.release(pages)


def test_bench_smoke_rows_and_figures():
    """``dsv4lab bench spec --smoke``: plain and speculative rows, each labelled with its
    ``mode`` (eager steps here: no CUDA graphs on the CPU), output identical to plain
    decoding, the step timings that explain the speedup; the figures draw these rows and the
    recorded ones (rows from before ``mode`` and the step timings existed included)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from dsv4lab import benchmarks, results
    from dsv4lab.plots import spec as P
    rows = benchmarks.run("spec", smoke=True, record=False)
    assert {(r["concurrency"], r["num_draft"]) for r in rows} == {(c, k) for c in (1, 2) for k in (0, 2)}
    assert all(r["identical"] and r["mode"] == ("graph" if r["graphs"] else "eager") for r in rows)
    assert all(r["speedup"] > 0 and r["tokens_per_s"] > 0 and r["run"] == 0 for r in rows)
    for r in rows:
        assert "_tokens" not in r and r["plain_step_ms"] > 0 and r["prefill_ms"] > 0
        if r["num_draft"]:
            assert r["step_ms"] == pytest.approx(r["verify_ms"] + r["draft_ms"])
        else:
            assert r["step_ms"] == r["plain_step_ms"] and r["verify_ms"] is None
        assert r["step_cost_ratio"] == pytest.approx(r["step_ms"] / r["plain_step_ms"])
        assert r["speedup_from_steps"] == pytest.approx(r["mean_accepted"] / r["step_cost_ratio"])
        assert r["accepted_drafts"] == pytest.approx(r["mean_accepted"] - 1)
    recorded = [r for r in results.load("spec") if not r.get("smoke")]
    assert {P.mode_of(r) for r in recorded} <= {"eager", "graph"}
    for data, smoke in ((rows, True), (recorded, False)):
        fig, ax = plt.subplots(1, 3)
        P.plot_acceptance(data, smoke=smoke, ax=ax[0])
        P.plot_speedup(data, smoke=smoke, ax=ax[1])
        P.plot_step_costs(data, smoke=smoke, ax=ax[2])
        drawn = ax[2].patches or ax[2].texts
        assert drawn                                   # bars, or the note saying why not
        plt.close(fig)
