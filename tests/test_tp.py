"""Tensor parallelism (dsv4lab.drivers.tp, tp_run, analytic): sharded layer vs world size 1,
the torchrun entry, the analytic model.

CPU: world size 1 in process; TP=2 as two gloo processes (torch.multiprocessing, and one
torchrun launch) on the mini and tiny configs. Tolerances (relative L2 of the outputs, see
dsv4lab.drivers.tp): fp32 ``TOL_FP32``
(1e-4: TP only reassociates fp32 sums), bf16 ``TOL_BF16`` (2e-2: each rank's partial sum
is rounded to bf16 before the bf16 all-reduce). GPU tests (NCCL, real-size layer) skip
with a reason when there are too few GPUs.
"""
import json
import os
import socket

import pytest
import torch
from hypothesis import given, settings, strategies as st

import dsv4lab  # noqa: F401
from dsv4lab import anatomy
from dsv4lab.config import DSV4Config
from dsv4lab.drivers import analytic as A
from dsv4lab.drivers import presets as P
from dsv4lab.drivers import tp as T
from dsv4lab.drivers import tp_run
from dsv4lab.model import tiny_config


def _errors_ok(errs, tol):
    assert errs, "no comparisons made"
    kinds = {k.split()[0] for k in errs}
    assert kinds == {"layer", "attention", "moe"}, errs
    bad = {k: v for k, v in errs.items() if not v <= tol}
    assert not bad, f"TP output differs from world size 1 beyond {tol}: {bad}"


# ---- world size 1, in process --------------------------------------------------------

def test_world1_matches_full_layer_exactly():
    drv = T.TPDriver(DSV4Config.mini(), T.Dist(), dtype=torch.float32, keep_full=True)
    st_ = drv.prepare(P.TORCH_REFERENCE, batch=3, context=37)       # odd batch, partial pages
    errs = T.check(drv, st_)
    _errors_ok(errs, T.TOL_FP32)
    assert max(errs.values()) < 1e-6                             # the same ops, the same order


def test_check_catches_a_wrong_shard():
    drv = T.TPDriver(DSV4Config.mini(), T.Dist(), kinds=[4], dtype=torch.float32, keep_full=True)
    layer = drv.layers[4]
    layer.s_w2.zero_()                                           # drop the shared expert's output
    layer.wq_b.copy_(layer.wq_b.roll(layer.blk.attn.head_dim, 0))  # heads shifted by one
    errs = T.check(drv, drv.prepare(P.TORCH_REFERENCE, batch=2, context=24))
    assert errs["moe 4"] > 100 * T.TOL_FP32
    assert errs["attention 4"] > 100 * T.TOL_FP32


def test_sharded_layer_frees_the_full_weights_and_profiles():
    drv = T.TPDriver(tiny_config(), T.Dist(), kinds=[4])
    blk = drv.layers[4].blk
    assert blk.attn.wq_b.weight.numel() == 0 and blk.moe.w13.numel() == 0
    st_ = drv.prepare(P.TORCH_REFERENCE, batch=1, context=9)
    prof = T.profile(drv, st_, reps=1)
    row = T.step_row(drv, st_, [prof])
    assert row["tp"] == 1 and row["allreduce_bytes"] == tiny_config().hidden_size * 2
    assert abs(sum(row[f"ms_{c}"] for c in T.COMPONENTS) - row["step_ms"]) <= 1e-9 * row["step_ms"]
    assert row["model_allreduce_ms_pcie"] == 0.0                 # TP1: no all-reduce
    with pytest.raises(ValueError, match="keep_full"):
        drv.reference(st_, {4: {}})


def test_divisibility_and_backend_are_checked():
    with pytest.raises(ValueError, match="o_groups"):
        A.check_divisible(DSV4Config.mini(), 4)                  # 4 heads but 2 output groups
    with pytest.raises(ValueError, match="num_heads"):
        A.check_divisible(DSV4Config.flash(), 3)
    A.check_divisible(DSV4Config.flash(), 8)
    with pytest.raises(ValueError, match="backend"):
        T.init("mpi")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            T.init("nccl")
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"


# ---- TP=2 with gloo, two processes ----------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import torch.distributed as dist
    from dsv4lab.drivers import presets as P
    from dsv4lab.drivers import tp
    try:
        d = tp.init("gloo")
        out = {}
        for dtype, batch in ((torch.float32, 3), (torch.bfloat16, 2)):
            drv = tp.TPDriver(DSV4Config.mini(), d, dtype=dtype, keep_full=True)
            s = drv.prepare(P.TORCH_REFERENCE, batch=batch, context=37)
            out[str(dtype)] = tp.check(drv, s)
        ar = tp.allreduce_sweep([512], d, trials=1)
        t = torch.full((4,), float(rank + 1))
        tp.all_reduce(t, d)
        out["sum"] = t.tolist()
        out["ar"] = ar[0]["busbw_gbs"]
        q.put((rank, out))
        dist.destroy_process_group()
    except Exception as e:  # report instead of hanging the parent
        q.put((rank, repr(e)))


def test_tp2_gloo_matches_world1():
    ctx = torch.multiprocessing.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    for r, out in got.items():
        assert isinstance(out, dict), f"rank {r} failed: {out}"
        _errors_ok(out["torch.float32"], T.TOL_FP32)
        _errors_ok(out["torch.bfloat16"], T.TOL_BF16)
        assert out["sum"] == [3.0] * 4
        assert out["ar"] > 0
    assert got[0]["torch.float32"] == got[1]["torch.float32"]    # every rank ends with the same x


# ---- the analytic model ---------------------------------------------------------------

def test_ring_arithmetic():
    assert A.ring_factor(1) == 0 and A.ring_factor(2) == 1.0 and A.ring_factor(4) == 1.5
    assert A.allreduce_time(1 << 20, 1, A.PCIE_GEN5) == 0.0
    # 64 KiB over PCIe Gen5, 4 ranks: 8 us + 6 hops x 1 us + 1.5 x 65536 B / 64 GB/s
    assert A.allreduce_time(65536, 4, A.PCIE_GEN5) == pytest.approx(8e-6 + 6e-6 + 1.5 * 65536 / 64e9)
    assert A.NVLINK_H200.bidirectional == 2 * A.NVLINK_H200.bandwidth == 900e9
    with pytest.raises(ValueError):
        A.allreduce_time(-1, 2, A.PCIE_GEN5)


@settings(max_examples=20, deadline=None)
@given(nbytes=st.integers(0, 1 << 30), n=st.sampled_from([2, 4, 8]), k=st.sampled_from(["pcie", "nvlink"]))
def test_model_bandwidth_never_beats_the_link(nbytes, n, k):
    link = A.LINKS[k]
    t = A.allreduce_time(nbytes, n, link)
    assert t >= link.base_latency
    assert nbytes * A.ring_factor(n) / t <= link.bandwidth * (1 + 1e-12)
    assert A.allreduce_time(nbytes + 4096, n, link) > t


def test_analytic_step_shards_what_tp_shards():
    cfg = DSV4Config.flash()
    one = A.analytic_step(cfg, tp=1, concurrency=8, context=512, link="pcie")
    two = A.analytic_step(cfg, tp=2, concurrency=8, context=512, link="pcie")
    assert one["ms_all-reduce"] == 0.0
    assert two["ms_MoE"] == pytest.approx(one["ms_MoE"] / 2)
    assert two["ms_indexer"] == pytest.approx(one["ms_indexer"])       # replicated
    assert two["ms_mHC"] == pytest.approx(one["ms_mHC"])
    assert one["ms_attention"] / 2 < two["ms_attention"] < one["ms_attention"]  # shared KV replicated
    calls = 2 * cfg.num_layers
    assert two["ms_all-reduce"] == pytest.approx(calls * A.allreduce_time(8 * 4096 * 2, 2, A.PCIE_GEN5) * 1e3)
    assert two["step_ms"] == pytest.approx(sum(two[f"ms_{g}"] for g in A.ANALYTIC_GROUPS))
    tot = anatomy.step_totals(anatomy.step_anatomy(cfg, concurrency=8, context=512, device="RTX PRO 6000 Blackwell"))
    assert one["step_ms"] == pytest.approx(tot["step_ms"])             # TP1 is anatomy's step
    nv = A.analytic_step(cfg, tp=2, concurrency=8, context=512, link="nvlink")
    assert nv["device"] == "H200" and nv["ms_all-reduce"] < two["ms_all-reduce"]
    with pytest.raises(ValueError, match="num_heads"):
        A.analytic_step(cfg, tp=3, concurrency=1, context=512)


def test_bench_rows_and_plots_tolerate_nothing_recorded():
    import matplotlib
    matplotlib.use("Agg")
    from dsv4lab.plots import tp as P
    assert P.usable([]) == [] and P.model_check([]) == []
    for fig in (P.plot_components([]), P.plot_allreduce([]), P.plot_analytic([])):
        assert "ANALYTIC" in " ".join(t.get_text() for ax in fig.axes for t in [ax.title])
    rows = A.analytic_rows(tps=(1, 2), concurrencies=(1, 64))
    assert len(rows) == 8 and all(r["kind"] == "analytic" for r in rows)
    cmd = tp_run.torchrun_command(4)
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--standalone"] and "--nproc-per-node=4" in cmd
    assert cmd[-2:] == ["-m", "dsv4lab.drivers.tp_run"]


# ---- the torchrun entry -------------------------------------------------------------------

def test_run_options_check_their_fields_and_travel_as_json():
    opts = tp_run.TPRunOptions(model="tiny", concurrency=[1, 3], kinds=[4], allreduce_sizes=[512])
    assert opts.concurrency == (1, 3) and opts.kinds == (4,)
    assert tp_run.TPRunOptions.from_json(opts.to_json()) == opts
    for bad, match in ((dict(concurrency=(0,)), "concurrency"), (dict(context=-1), "context"),
                       (dict(dtype="fp16"), "dtype"), (dict(backend="mpi"), "backend"),
                       (dict(allreduce_sizes=(0,)), "allreduce_sizes"), (dict(reps=0), "reps")):
        with pytest.raises(ValueError, match=match):
            tp_run.TPRunOptions(**bad)
    with pytest.raises(ValueError, match="unknown option"):
        tp_run.TPRunOptions.from_json('{"concurency": [1]}')
    with pytest.raises(ValueError, match="nproc"):
        tp_run.torchrun_command(0)


def test_run_world1_in_process_writes_checked_rows(tmp_path):
    out = tmp_path / "rows.json"
    rc = tp_run.run(tp_run.TPRunOptions(model="tiny", preset="torch", dtype="fp32", kinds=(4,), concurrency=(1, 2),
                                        reps=1, check=True, allreduce_sizes=(512,), out=str(out)))
    rows = json.loads(out.read_text())
    steps = [r for r in rows if r["kind"] == "measured"]
    assert rc == 0 and [r["concurrency"] for r in steps] == [1, 2]
    for r in steps:
        _errors_ok(r["check_rel_err"], T.TOL_FP32)
        assert r["tp"] == 1 and r["mode"] == "eager" and r["extrapolated"] is False
        assert tp_run.format_row(r).startswith("TP1 torch")
    assert [r["kind"] for r in rows if r["kind"] != "measured"] == ["allreduce"]


def test_launch_tp2_gloo_through_torchrun():
    rows = tp_run.launch(2, tp_run.TPRunOptions(model="tiny", preset="torch", backend="gloo", dtype="fp32",
                                                kinds=(4,), concurrency=(2,), reps=1, check=True,
                                                allreduce_sizes=(4096,)), timeout=240, verbose=False)
    assert not [r for r in rows if r["kind"] == "error"], rows
    steps = [r for r in rows if r["kind"] == "measured"]
    assert len(steps) == 1 and steps[0]["tp"] == 2 and steps[0]["backend"] == "gloo"
    _errors_ok(steps[0]["check_rel_err"], T.TOL_FP32)
    ar = [r for r in rows if r["kind"] == "allreduce"]
    assert len(ar) == 1 and ar[0]["busbw_gbs"] > 0
    assert all(r["command"].endswith("-m dsv4lab.drivers.tp_run") and r["tp_options"]["model"] == "tiny" for r in rows)


# ---- GPUs: NCCL -------------------------------------------------------------------------

def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_world1_real_size_layer_on_gpu():
    """The real-size ratio-4 layer, preset "after" (MMA, FP8 KV, Triton indexer and MoE)."""
    d = T.Dist(device=torch.device("cuda", 0))
    cfg = DSV4Config.flash()
    drv = T.TPDriver(cfg, d, kinds=[4], keep_full=True)
    s = drv.prepare(T.step_config("after", cfg), batch=8, context=512)
    _errors_ok(T.check(drv, s), T.TOL_BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2, 4])
def test_tp_nccl_matches_world1(n):
    if _gpus() < n:
        pytest.skip(f"TP={n} needs {n} GPUs, found {_gpus()}")
    rows = tp_run.launch(n, tp_run.TPRunOptions(model="flash", preset="after", kinds=(4,), concurrency=(1, 8),
                                                check=True, timing=False, allreduce_sizes=(65536, 1048576)),
                         timeout=600)
    assert not [r for r in rows if r["kind"] == "error"], rows
    steps = [r for r in rows if r["kind"] == "measured"]
    assert len(steps) == 2 and all(r["tp"] == n and r["backend"] == "nccl" for r in steps)
    for r in steps:
        _errors_ok(r["check_rel_err"], T.TOL_BF16)
        assert r["nccl_nvls_enable"] == "0"
    assert all(r["busbw_gbs"] > 0 for r in rows if r["kind"] == "allreduce")
