"""dsv4lab.bench: timing helpers, roofline columns, the benchmark registry."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from dsv4lab import bench, results, roofline, runtime


@pytest.fixture
def rdir(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV4LAB_RESULTS_DIR", str(tmp_path))
    monkeypatch.setenv("DSV4LAB_COMMIT", "test")
    return tmp_path


@pytest.fixture
def toy_bench():
    name = "_test_toy_bench"
    calls = []

    @bench.benchmark(name, "a toy benchmark")
    def toy(smoke: bool):
        calls.append(smoke)
        return [{"n": 4 if smoke else 4096, "ms": 1.0}]
    yield name, calls
    bench._BENCHMARKS.pop(name, None)


@pytest.mark.skipif(runtime.has_cuda(), reason="CPU timing path")
def test_time_fn_on_cpu_calls_and_labels():
    calls = []
    out = bench.time_fn(lambda: calls.append(1), cpu_reps=3)
    assert len(calls) == 4                   # one warm-up, three timed
    assert out["timing"] == ("interpreter_wall" if runtime.is_interpreter() else "cpu_wall")
    assert isinstance(out["ms"], float) and out["ms"] >= 0


@pytest.mark.skipif(runtime.has_cuda(), reason="CPU timing path")
def test_time_graph_falls_back_on_cpu():
    calls = []
    out = bench.time_graph(lambda: calls.append(1))
    assert out["timing"] in ("interpreter_wall", "cpu_wall") and calls


def test_with_roofline_adds_columns():
    row = bench.with_roofline({"ms": 2.0}, bytes_moved=4.24e9, flops=1e9, device="H200")
    assert row["roofline_device"] == "H200"
    assert row["roofline_ms"] == pytest.approx(1.0)
    assert row["roofline_fraction"] == pytest.approx(0.5)
    assert row["bytes"] == 4.24e9 and row["flops"] == 1e9
    no_ms = bench.with_roofline({}, bytes_moved=1, flops=1)
    assert "roofline_fraction" not in no_ms
    assert no_ms["roofline_device"] == roofline.device_spec().name


def test_registry_and_run_records(rdir, toy_bench):
    name, calls = toy_bench
    assert name in bench.registered()
    assert bench.registered()[name].description == "a toy benchmark"
    rows = bench.run(name, smoke=True, record=True)
    assert calls == [True] and rows[0]["smoke"] is True and rows[0]["n"] == 4
    (rec,) = results.load(name)
    assert rec["n"] == 4 and rec["smoke"] is True and rec["commit"] == "test"
    assert rec == rows[0]                        # what run returns is what was recorded


@pytest.mark.parametrize("record", [True, False])
def test_live_rows_carry_their_provenance(rdir, toy_bench, record):
    """A notebook reads row["commit"] and row["date"] of live rows too (recorded or not)."""
    name, _ = toy_bench
    (row,) = bench.run(name, smoke=False, record=record)
    for key in results.PROVENANCE_KEYS:
        assert row[key] not in (None, ""), key
    assert row["bench"] == name and row["commit"] == "test" and row["smoke"] is False
    assert len(results.load(name)) == (1 if record else 0)


def test_every_benchmark_definition_imports():
    from dsv4lab import benchmarks
    assert benchmarks.unavailable() == {}, benchmarks.unavailable()
    assert {"sparse_mla", "indexer", "moe", "spec", "step"} <= set(benchmarks.registered())
    for b in benchmarks.registered().values():
        assert b.description, f"{b.name} has no one-line description (`dsv4lab bench --help` shows it)"


def test_a_definition_that_failed_to_import_says_why(monkeypatch):
    monkeypatch.setitem(bench._UNAVAILABLE, "_test_broken", "ImportError: cannot import name 'X'")
    with pytest.raises(RuntimeError, match="benchmark '_test_broken' could not be imported: ImportError"):
        bench.run("_test_broken")


def test_smoke_rows_not_recorded_by_default(rdir, toy_bench):
    name, calls = toy_bench
    rows = bench.run(name, smoke=True)
    assert calls == [True] and rows[0]["smoke"] is True
    assert results.load(name) == []
    bench.run(name, smoke=False)
    (rec,) = results.load(name)
    assert rec["smoke"] is False


def test_run_without_record(rdir, toy_bench):
    name, _ = toy_bench
    bench.run(name, smoke=False, record=False)
    assert results.load(name) == []


def test_unknown_benchmark(toy_bench):
    with pytest.raises(KeyError, match="unknown benchmark 'no_such_bench'"):
        bench.run("no_such_bench")
    from dsv4lab import benchmarks
    with pytest.raises(KeyError, match=f"known: .*{toy_bench[0]}"):
        benchmarks.run("no_such_bench")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_timers():
    x = torch.randn(1024, 1024, device="cuda")
    out = bench.time_fn(lambda: x @ x)
    assert out["timing"] == "cuda_events" and out["ms"] > 0
    out = bench.time_graph(lambda: x @ x)
    assert out["timing"] == "cuda_graph" and out["ms"] > 0


def test_l2_state_default_env_and_refusal(monkeypatch):
    monkeypatch.delenv("DSV4LAB_L2", raising=False)
    assert bench.l2_state() == "dirty"                 # do_bench's flush: the targets' method
    monkeypatch.setenv("DSV4LAB_L2", "clean")
    assert bench.l2_state() == "clean"
    assert bench.l2_state("dirty") == "dirty"          # an explicit argument wins
    monkeypatch.setenv("DSV4LAB_L2", "warm")
    with pytest.raises(ValueError, match="DSV4LAB_L2.*dirty, clean.*'warm'"):
        bench.l2_state()
    with pytest.raises(ValueError, match="got 'hot'"):
        bench.time_fn(lambda: None, l2="hot")            # refused before anything runs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_timers_label_the_l2_state():
    x = torch.randn(1024, 1024, device="cuda")
    for state in bench.L2_STATES:
        out = bench.time_graph(lambda: x @ x, warmup_ms=2, rep_ms=5, l2=state)
        assert out["l2"] == state and out["timing"] == "cuda_graph" and out["ms"] > 0
        out = bench.time_fn(lambda: x @ x, warmup_ms=2, rep_ms=5, l2=state)
        assert out["l2"] == state and out["timing"] == "cuda_events" and out["ms"] > 0


@settings(max_examples=12, deadline=None)
@given(n=st.sampled_from([0, 1, 3, 2047, 2048, 2049, 5000]), programs=st.sampled_from([1, 3, 4]),
       block=st.sampled_from([64, 2048]))
def test_stream_read_reads_every_word(n, programs, block):
    """The bandwidth yardstick of ``bench l2``: the per-program xors fold to the xor of all words
    (empty buffer, one word, a block and one, more programs than blocks)."""
    from dsv4lab.benchmarks.l2 import _xor
    from dsv4lab.kernels.stream_read import stream_read
    words = torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32,
                          generator=torch.Generator().manual_seed(n)).to(runtime.device())
    out = stream_read(words, programs=programs, block=block)
    assert out.shape == (programs,)
    expect = 0
    for w in words.cpu().tolist():
        expect ^= w
    assert _xor(out) == expect


def test_stream_read_refuses_bad_input():
    from dsv4lab.kernels.stream_read import stream_read
    with pytest.raises(ValueError, match="words must be a 1-D int32 tensor, got torch.float32"):
        stream_read(torch.zeros(8))
    with pytest.raises(ValueError, match="words must be a 1-D int32 tensor.*shape \\(2, 4\\)"):
        stream_read(torch.zeros(2, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="words must be contiguous"):
        stream_read(torch.zeros(8, dtype=torch.int32)[::2])
    with pytest.raises(ValueError, match="block must be a power of two, got 100"):
        stream_read(torch.zeros(8, dtype=torch.int32), block=100)
    with pytest.raises(ValueError, match="programs must be >= 1, got 0"):
        stream_read(torch.zeros(8, dtype=torch.int32), programs=0)


def test_gap_table_pairs_the_states_of_one_commit():
    """The L2 gap of a kernel is the difference of its two L2 states measured on the same code:
    a newer commit with only a dirty row does not pair with an older clean row; the newest
    commit with both wins; rows without an ``l2`` and smoke rows are ignored."""
    from dsv4lab.benchmarks.l2 import gap_table

    def row(commit, l2, ms, **kw):
        return dict(backend="mma", kv="bf16", B=64, S_q=1, topk=2048, commit=commit, l2=l2,
                    ms=ms, **kw)
    mla = [row("rev-one-x", "dirty", 0.060), row("rev-one-x", "clean", 0.057),
           row("rev-two-x", "clean", 0.050), row("rev-two-x", "dirty", 0.053),
           row("rev-new-x", "dirty", 0.040),                      # newer code, dirty only
           row("rev-smk-x", "clean", 0.001, smoke=True), row("rev-smk-x", "dirty", 0.002, smoke=True),
           dict(row("rev-nol-x", None, 0.001))]
    out = {r["case"]: r for r in gap_table({"l2": [], "moe": [], "sparse_mla": mla})}
    r = out["sparse MLA bf16, B 64, S_q 1"]
    assert r["commits"] == "rev-two/rev-two"
    assert r["dirty_us"] == pytest.approx(53.0) and r["clean_us"] == pytest.approx(50.0)
    assert r["gap_us"] == pytest.approx(3.0)
    assert "MoE MXFP4, T 1" not in out                               # nothing recorded
    only_dirty = gap_table({"l2": [], "moe": [], "sparse_mla": [row("rev-new-x", "dirty", 0.04)]})
    assert only_dirty == []


def test_a_notebooks_setup_registers_the_benchmarks():
    """Notebooks call ``bench.run(NAME)`` after ``workbook.setup``: the names are there."""
    from dsv4lab import benchmarks, workbook
    lab = workbook.setup("auto")
    assert lab.mode in ("smoke", "full")
    import pkgutil
    modules = {m.name for m in pkgutil.iter_modules(benchmarks.__path__)}
    assert modules and modules <= set(bench.registered()) | set(bench.unavailable_reasons())
    with pytest.raises(ValueError, match="MODE must be one of"):
        workbook.setup("fast")
