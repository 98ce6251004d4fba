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
    assert [x["met"] for x in v.values()] == [True, False, True, True, False]
    assert v["MMA vs SIMT, B 64, topk 2048, S_q 1: speedup"]["value"] == pytest.approx(80.0)
    assert v["MMA FP8 KV vs bf16 KV, B 128, topk 2048, S_q 2: speedup"]["value"] == pytest.approx(1.5)
    assert all(x["commit"] == "rev-one" for x in v.values())


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
    assert [x["met"] for x in v] == [True, True, False]
    assert v[0]["value"] == pytest.approx(1.04)


def test_moe_and_spec_verdicts():
    moe = [dict(PROV, impl="triton", fmt=f, T=T, ms=ms, roofline_fraction=fr)
           for f, T, ms, fr in (("mxfp4", 1, 1.0, 0.6), ("nvfp4", 1, 1.3, 0.5), ("mxfp4", 64, 2.0, 0.4),
                                ("nvfp4", 64, 2.0, 0.4))]
    assert [x["met"] for x in targets.check("moe", moe)] == [True, False, False]
    spec = [dict(PROV, concurrency=1, num_draft=k, draft_moe="triton", speedup=s, identical=True)
            for k, s in ((1, 1.2), (2, 1.6), (3, 1.4))]
    v = targets.check("spec", spec)
    assert v[0]["met"] and v[0]["value"] == pytest.approx(1.6) and v[1]["met"]
    spec[0]["identical"] = False
    assert targets.check("spec", spec)[1]["met"] is False


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
    """The committed rows (recorded before rows carried ``mode``) still judge every goal."""
    for bench in ("sparse_mla", "indexer", "moe", "spec"):
        verdicts = targets.check(bench)
        assert verdicts and all(v["met"] is not None for v in verdicts), (bench, verdicts)
