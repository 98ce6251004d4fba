"""dsv4lab.bench: timing helpers, roofline columns, the benchmark registry."""
import pytest
import torch

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


def test_unknown_benchmark():
    with pytest.raises(KeyError, match="unknown benchmark 'no_such_bench'"):
        bench.run("no_such_bench")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_timers():
    x = torch.randn(1024, 1024, device="cuda")
    out = bench.time_fn(lambda: x @ x)
    assert out["timing"] == "cuda_events" and out["ms"] > 0
    out = bench.time_graph(lambda: x @ x)
    assert out["timing"] == "cuda_graph" and out["ms"] > 0
