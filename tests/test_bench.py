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
    mla = [row("aaaaaaa1", "dirty", 0.060), row("aaaaaaa1", "clean", 0.057),
           row("bbbbbbb2", "clean", 0.050), row("bbbbbbb2", "dirty", 0.053),
           row("ccccccc3", "dirty", 0.040),                       # newer code, dirty only
           row("ddddddd4", "clean", 0.001, smoke=True), row("ddddddd4", "dirty", 0.002, smoke=True),
           dict(row("eeeeeee5", None, 0.001))]
    out = {r["case"]: r for r in gap_table({"l2": [], "moe": [], "sparse_mla": mla})}
    r = out["sparse MLA bf16, B 64, S_q 1"]
    assert r["commits"] == "bbbbbbb/bbbbbbb"
    assert r["dirty_us"] == pytest.approx(53.0) and r["clean_us"] == pytest.approx(50.0)
    assert r["gap_us"] == pytest.approx(3.0)
    assert "MoE MXFP4, T 1" not in out                               # nothing recorded
    only_dirty = gap_table({"l2": [], "moe": [], "sparse_mla": [row("ccccccc3", "dirty", 0.04)]})
    assert only_dirty == []


@settings(max_examples=8, deadline=None)
@given(rows=st.sampled_from([1, 4]), step=st.sampled_from([16, 64]), slices=st.sampled_from([1, 2]),
       tiles=st.sampled_from([1, 3]), evict=st.booleans(), spread=st.sampled_from([1, 2, 4]),
       tile_major=st.booleans())
def test_rows_read_reads_every_word(rows, step, slices, tiles, evict, spread, tile_major):
    """scripts/probe_weight_reads.py's read: tiles of rows, K slices, a step of bytes a row a
    step, either cache policy, pieces spread or not, rows or tile-major layout: the xors of
    (program, row) fold to the xor of all words."""
    from dsv4lab.benchmarks.l2 import _xor
    from dsv4lab.kernels.stream_read import rows_read
    row_bytes = 2 * slices * step * spread
    n = tiles * rows * row_bytes // 4
    words = torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32,
                          generator=torch.Generator().manual_seed(n)).to(runtime.device())
    if tile_major and spread > 1:
        with pytest.raises(ValueError, match="spread must be 1"):
            rows_read(words, row_bytes=row_bytes, rows=rows, step=step, spread=spread,
                      tile_major=True)
        return
    out = rows_read(words, row_bytes=row_bytes, rows=rows, step=step, slices=slices, evict=evict,
                    spread=spread, tile_major=tile_major)
    assert out.shape == (tiles * slices * rows,)
    assert _xor(out) == _xor(words)
    if tile_major:      # (program, row)'s xor: its slice's words, K-step-major in the tile
        w = words.cpu().view(tiles, slices, row_bytes // slices // step, rows, step // 4)
        want = torch.zeros(tiles, slices, rows, dtype=torch.int32)
        for k in range(w.shape[2]):
            for c in range(w.shape[4]):
                want ^= w[:, :, k, :, c]
        assert torch.equal(out.cpu(), want.reshape(-1))


def test_rows_read_refuses_bad_input():
    from dsv4lab.kernels.stream_read import rows_read
    w = torch.zeros(64, dtype=torch.int32)
    with pytest.raises(ValueError, match="words must be contiguous"):
        rows_read(torch.zeros(128, dtype=torch.int32)[::2], row_bytes=64, rows=1, step=16)
    with pytest.raises(ValueError, match="step must be a power of two, got 24"):
        rows_read(w, row_bytes=64, rows=1, step=24)
    with pytest.raises(ValueError, match=r"row_bytes \(64\) must be a multiple of slices x step"):
        rows_read(w, row_bytes=64, rows=1, step=64, slices=2)
    with pytest.raises(ValueError, match="whole tiles of 8 rows of 64 bytes"):
        rows_read(w, row_bytes=64, rows=8, step=16)
    with pytest.raises(ValueError, match="spread 4 needs"):
        rows_read(w, row_bytes=64, rows=1, step=32, spread=4)
