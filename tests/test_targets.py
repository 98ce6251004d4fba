"""dsv4lab.targets: the campaign's goals evaluated from rows (synthetic rows here, so the
verdict logic is tested independently of what the GPU happened to measure)."""
import pytest

from dsv4lab import cli, targets

PROV = dict(gpu="NVIDIA H200", capability="sm_90", commit="rev-one-of-many", date="2026-11-29T00:00:00", smoke=False)


def mla(backend, kv, B, S, topk, ms, frac=None):
    return dict(PROV, backend=backend, kv=kv, B=B, S_q=S, topk=topk, H=64, ms=ms, roofline_fraction=frac)


def test_sparse_mla_verdicts_use_the_newest_row():
    rows = [mla("mma", "bf16", 64, 1, 2048, 0.1, 0.30),
            mla("mma", "bf16", 64, 1, 2048, 0.05, 0.65),           # newer row of the same config wins
            mla("mma", "bf16", 128, 2, 2048, 0.3, 0.40),
            mla("simt", "bf16", 64, 1, 2048, 4.0),
            mla("mma", "fp8", 128, 2, 2048, 0.2),
            mla("mma", "bf16", 1, 1, 640, 0.016)]
    v = {x["target"]: x for x in targets.check("sparse_mla", rows)}
    assert [x["met"] for x in v.values()][:5] == [True, False, True, True, False]
    assert v["MMA vs SIMT, B 64, topk 2048, S_q 1: speedup"]["value"] == pytest.approx(80.0)
    assert v["MMA FP8 KV vs bf16 KV, B 128, topk 2048, S_q 2: speedup"]["value"] == pytest.approx(1.5)
    assert all(x["commit"] == "rev-one" for x in v.values() if x["met"] is not None)


def test_v4_attention_goals_fp8_against_bf16_flash_mla_and_host_cost():
    rows = []
    for B in (32, 64, 128):
        for S in (1, 2):
            rows += [mla("mma", "bf16", B, S, 640, 0.050, 0.55), mla("mma", "fp8", B, S, 640, 0.040)]
    rows += [mla("flash_mla", "fp8", 64, 1, 640, 0.050), mla("flash_mla", "fp8", 128, 2, 640, 0.044),
             mla("mma", "bf16", 64, 1, 1152, 0.03, 0.61), mla("mma", "bf16", 1, 1, 640, 0.010),
             dict(mla("mma", "bf16", 1, 1, 640, 0.035), mode="eager"),
             dict(mla("mma", "bf16", 64, 1, 640, 0.100), mode="eager")]
    v = {x["target"]: x for x in targets.check("sparse_mla", rows)}
    assert v["V4 CSA bf16, 640 slots, B 64, S_q 1: fraction of roofline"]["met"] is True
    assert v["V4 CSA bf16, 640 slots, B 128, S_q 2: fraction of roofline"]["met"] is False     # 0.55 < 0.70
    assert v["V4 HCA bf16 at 128K (1,152 slots), B 64, S_q 1: fraction of roofline"]["met"] is True
    assert v["V4 HCA bf16 at 1M (8,320 slots), B 64, S_q 1: fraction of roofline"]["met"] is None
    fp8 = v["V4 CSA FP8 vs bf16 cache, 640 slots, B 32/64/128 x S_q 1/2: slowest speedup"]
    assert fp8["met"] and fp8["value"] == pytest.approx(1.25)
    assert v["V4 CSA FP8 vs FlashMLA, 640 slots, B 64, S_q 1: speedup"]["met"] is True          # 1.25x
    assert v["V4 CSA FP8 vs FlashMLA, 640 slots, B 128, S_q 2: speedup"]["met"] is False        # 1.1x
    b1 = v["eager call over graph replay, bf16, 640 slots, B 1: us"]
    assert b1["met"] and b1["value"] == pytest.approx(25.0)
    assert v["eager call over graph replay, bf16, 640 slots, B 64: us"]["met"] is False         # 50 us


def test_missing_rows_are_reported_not_guessed():
    for bench in targets.BENCHES[:-1]:
        out = targets.check(bench, [])
        assert out and all(x["met"] is None and x["value"] is None for x in out)
    assert "no recorded row" in targets.table("moe", [])


def test_indexer_ratio_and_absolute_time():
    key = dict(PROV, op="indexer_topk", backend="triton", actual_tokens=512, q_dtype="fp8", k_dtype="fp8")
    rows = [dict(key, max_context_tokens=8192, ms=0.010), dict(key, max_context_tokens=1048576, ms=0.0104),
            dict(PROV, op="indexer_logits", backend="triton", actual_tokens=131072, q_dtype="fp8", k_dtype="fp8",
                 ms=0.09, roofline_fraction=0.59)]
    v = targets.check("indexer", rows)
    assert [x["met"] for x in v] == [True, True, False, None]        # no eager row: no host-cost verdict
    assert v[0]["value"] == pytest.approx(1.04)
    rows += [dict(key, max_context_tokens=1048576, batch=64, ms=0.0104, mode="graph"),
             dict(key, max_context_tokens=1048576, batch=64, ms=0.0304, mode="eager")]
    assert targets.check("indexer", rows)[3]["value"] == pytest.approx(20.0)


def test_moe_and_spec_verdicts():
    moe = [dict(PROV, impl="triton", fmt=f, T=T, ms=ms, roofline_fraction=fr)
           for f, T, ms, fr in (("mxfp4", 1, 1.0, 0.6), ("nvfp4", 1, 1.3, 0.5), ("mxfp4", 64, 2.0, 0.4),
                                ("nvfp4", 64, 2.0, 0.4))]
    assert [x["met"] for x in targets.check("moe", moe)][:3] == [True, False, False]
    spec = [dict(PROV, concurrency=1, num_draft=k, draft_moe="triton", speedup=s + 0.01 * run, run=run,
                 identical=True) for run in range(3) for k, s in ((1, 1.2), (2, 1.62), (3, 1.4))]
    v = targets.check("spec", spec)
    assert v[0]["met"] and v[0]["value"] == pytest.approx(1.62) and v[1]["met"]   # the slowest run
    assert targets.check("spec", spec[:6])[0]["met"] is False       # two runs are not three
    spec[4]["speedup"] = 1.55                                       # one slow run of k = 2
    assert targets.check("spec", spec)[0]["met"] is False
    spec[0]["identical"] = False
    assert targets.check("spec", spec)[1]["met"] is False


def test_moe_against_triton_kernels_and_its_host_cost():
    def row(impl, T, ms, frac=0.5, **kw):
        return dict(PROV, impl=impl, fmt="mxfp4", T=T, ms=ms, roofline_fraction=frac, **kw)
    rows = [row("triton", 1, 0.040), row("triton_kernels", 1, 0.090), row("triton", 8, 0.25, 0.62),
            row("triton_kernels", 8, 0.26), row("triton", 64, 1.0), row("triton_kernels", 64, 0.9),
            row("triton", 1, 0.060, mode="eager")]
    v = {x["target"]: x for x in targets.check("moe", rows)}
    assert v["Triton MXFP4 MoE vs triton_kernels, T 1: speedup"]["met"] is True          # 2.25x
    assert v["Triton MXFP4 MoE vs triton_kernels, T 8: speedup"]["met"] is True
    assert v["Triton MXFP4 MoE vs triton_kernels, T 64: speedup"]["met"] is False
    assert v["Triton MXFP4 MoE vs triton_kernels, T 256: speedup"]["met"] is None
    assert v["Triton MXFP4 MoE, T 8: fraction of roofline"]["met"] is True
    assert v["eager call over graph replay, fused_moe MXFP4, T 1: us"]["value"] == pytest.approx(20.0)


def test_linear_goals_on_the_largest_shapes_and_against_cublas():
    def row(impl, shape, N, K, M, ms, frac=None):
        return dict(PROV, impl=impl, shape=shape, N=N, K=K, M=M, mode="graph", ms=ms, roofline_fraction=frac)
    rows = []
    for shape, N, K, frac in (("tiny", 128, 128, 0.1), ("a", 1024, 4096, 0.7), ("b", 4096, 1024, 0.65),
                              ("c", 8192, 4096, 0.61)):
        for M in (1, 8, 64):
            rows += [row("triton_fp8", shape, N, K, M, 0.01, frac), row("cublas_bf16", shape, N, K, M, 0.02)]
    v = targets.check("linear", rows)
    assert [x["met"] for x in v] == [True, True]
    assert v[0]["value"] == pytest.approx(0.61) and v[1]["value"] == pytest.approx(2.0)
    rows[-4]["roofline_fraction"] = 0.5                       # shape c, M 8
    rows[1]["ms"] = 0.009                                     # cuBLAS faster on "tiny", M 1
    assert [x["met"] for x in targets.check("linear", rows)] == [False, False]


def test_smoke_and_cpu_rows_never_count(tmp_path, monkeypatch):
    from dsv4lab import results
    monkeypatch.setenv("DSV4LAB_RESULTS_DIR", str(tmp_path))
    results.record("moe", [dict(impl="triton", fmt="mxfp4", T=1, ms=1.0, roofline_fraction=0.9, smoke=True)])
    assert targets.gpu_rows("moe") == []          # recorded here on the CPU, and smoke


def test_unknown_bench_and_cli(capsys):
    with pytest.raises(ValueError, match="bench must be one of"):
        targets.check("nope")
    assert cli.main(["targets", "nope"]) == 2
    assert cli.main(["targets", "moe"]) == 0
    out = capsys.readouterr().out
    assert "== moe" in out
    # ... and which kernel each op runs, per capability
    assert "kernels by GPU" in out and "fused_moe" in out
    for cap in ("sm_80", "sm_89", "sm_90", "sm_100", "sm_120"):
        assert f"  {cap} " in out


def test_clean_l2_rows_are_a_separate_view(tmp_path, monkeypatch):
    """Rows timed after a clean L2 never judge the targets (set with do_bench's dirty flush);
    ``l2="clean"`` shows them on their own. Rows without ``l2`` are the original method."""
    from dsv4lab import results
    monkeypatch.setenv("DSV4LAB_RESULTS_DIR", str(tmp_path))
    monkeypatch.setattr(results, "provenance", lambda: dict(PROV))
    key = dict(impl="triton", fmt="mxfp4", T=1, smoke=False)
    results.record("moe", [dict(key, ms=0.068, roofline_fraction=0.28),
                           dict(key, ms=0.064, roofline_fraction=0.30, l2="dirty"),
                           dict(key, ms=0.030, roofline_fraction=0.63, l2="clean")])
    assert [r["ms"] for r in targets.gpu_rows("moe")] == [0.068, 0.064]
    assert [r["ms"] for r in targets.gpu_rows("moe", "clean")] == [0.030]
    assert targets.check("moe")[0]["value"] == pytest.approx(0.30)
    assert targets.check("moe", l2="clean")[0]["value"] == pytest.approx(0.63)
    with pytest.raises(ValueError, match="l2 must be 'dirty' or 'clean'"):
        targets.check("moe", l2="warm")
    assert cli.main(["targets", "moe", "--l2", "clean"]) == 0


def test_graph_rows_judge_eager_rows_are_a_view(tmp_path, monkeypatch):
    """Rows with mode "eager" never judge the goals (set on graph replays); rows without a
    mode count as they always did; ``mode="eager"`` shows the eager rows on their own."""
    from dsv4lab import results
    monkeypatch.setenv("DSV4LAB_RESULTS_DIR", str(tmp_path))
    monkeypatch.setattr(results, "provenance", lambda: dict(PROV))
    key = dict(impl="triton", fmt="mxfp4", T=1, smoke=False)
    results.record("moe", [dict(key, ms=0.07, roofline_fraction=0.40),                 # before `mode`
                           dict(key, ms=0.04, roofline_fraction=0.55, mode="graph"),
                           dict(key, ms=0.30, roofline_fraction=0.07, mode="eager")])
    assert [r["ms"] for r in targets.gpu_rows("moe")] == [0.07, 0.04]
    assert [r["ms"] for r in targets.gpu_rows("moe", mode="eager")] == [0.30]
    assert targets.check("moe")[0]["value"] == pytest.approx(0.55)
    assert targets.check("moe", mode="eager")[0]["value"] == pytest.approx(0.07)
    with pytest.raises(ValueError, match="mode must be 'graph' or 'eager'"):
        targets.check("moe", mode="replay")
    assert cli.main(["targets", "moe", "--mode", "eager"]) == 0


def test_the_recorded_rows_still_give_verdicts():
    """The committed rows judge the goals they have rows for; the others say "no recorded row"."""
    for bench in ("sparse_mla", "indexer", "moe", "spec"):
        verdicts = targets.check(bench)
        assert verdicts and any(v["met"] is not None for v in verdicts), (bench, verdicts)
        assert all(v["met"] is not None or v["value"] is None for v in verdicts), (bench, verdicts)
