"""The dsv4lab command as users meet it: help, run, report, bench, env, train, lab, tp
(in-process, on temporary folders)."""
import json
import re

import pytest

nbformat = pytest.importorskip("nbformat")   # jupyter tooling is absent on some GPU hosts

from dsv4lab import bench, cli, results


def tiny_notebook(path, body):
    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell('MODE = "auto"')
    params.metadata["tags"] = ["parameters"]
    nb.cells = [nbformat.v4.new_markdown_cell("# tiny"), params, nbformat.v4.new_code_cell(body)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(path))


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    nbdir, build = tmp_path / "notebooks", tmp_path / "build"
    nbdir.mkdir()
    monkeypatch.setattr(cli, "NOTEBOOKS", nbdir)
    monkeypatch.setattr(cli, "BUILD", build)
    monkeypatch.setattr(cli, "SUMMARY", build / "notebooks" / "summary.json")
    return nbdir, build


def test_run_only_on_tiny_notebooks(sandbox, capfd):
    nbdir, build = sandbox
    tiny_notebook(nbdir / "90_tiny.ipynb", 'assert MODE == "smoke", MODE\nprint("tiny ran in", MODE)')
    tiny_notebook(nbdir / "91_broken.ipynb", 'raise ValueError("broken on purpose")')
    out = build / "notebooks"
    assert cli.main(["run", "--only", "90", "--smoke", "--out", str(out)]) == 0
    executed = nbformat.read(out / "90_tiny.ipynb", as_version=4)
    assert any("tiny ran in smoke" in o.get("text", "") for c in executed.cells for o in c.get("outputs", []))
    assert cli.main(["run", "--only", "91", "--smoke", "--out", str(out)]) == 1
    captured = capfd.readouterr()                # the kernels' own output too (file descriptors)
    assert "without encryption" not in captured.out + captured.err
    printed = captured.out
    assert "FAILED 91_broken" in printed and "broken on purpose" in printed
    summary = {r["notebook"]: r for r in json.loads(cli.SUMMARY.read_text())}
    assert summary["90_tiny"]["status"] == "pass" and summary["91_broken"]["status"] == "fail"
    assert "broken on purpose" in summary["91_broken"]["error"]
    for r in summary.values():
        assert set(r) >= {"notebook", "status", "seconds", "mode", "output", "error", "device"}
        assert r["mode"] == "smoke"


def test_run_only_unknown_notebook(sandbox):
    nbdir, _ = sandbox
    tiny_notebook(nbdir / "90_tiny.ipynb", "pass")
    with pytest.raises(SystemExit, match="no notebook matches 77"):
        cli.main(["run", "--only", "77", "--smoke"])


def fake_executed(dirpath):
    """Two executed notebooks (one with an error output) and a summary naming a third."""
    dirpath.mkdir(parents=True)
    for name, err in (("00_ok", False), ("01_bad", True)):
        nb = nbformat.v4.new_notebook()
        cell = nbformat.v4.new_code_cell("print(1)")
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="1\n")]
        if err:
            cell.outputs.append(nbformat.v4.new_output("error", ename="ValueError", evalue="boom", traceback=[]))
        else:   # a widget with a static fallback, as dsv4lab.widgets.tour displays it
            cell.outputs.append(nbformat.v4.new_output("display_data", data={
                "application/vnd.jupyter.widget-view+json": {"version_major": 2, "version_minor": 0,
                                                            "model_id": "0" * 32},
                "text/plain": "AnatomyExplorer(...)", "text/html": "<p class='fallback-here'>static view</p>"}))
        cell.source = "# NBVAL_IGNORE_OUTPUT\nprint(1)"
        nb.cells = [nbformat.v4.new_markdown_cell(f"# {name} title\n\nWhat {name} shows, in one line of a summary. And more."),
                    cell]
        nbformat.write(nb, str(dirpath / f"{name}.ipynb"))
    summary = [
        {"notebook": "00_ok", "status": "pass", "seconds": 1.5, "mode": "smoke", "output": "x", "error": "", "device": "cpu"},
        {"notebook": "02_missing", "status": "fail", "seconds": 0.1, "mode": "smoke", "output": "x",
         "error": "KeyError: gone", "device": "cpu"},
    ]
    (dirpath / "summary.json").write_text(json.dumps(summary))


def test_report_on_a_fake_executed_dir(sandbox, capsys):
    _, build = sandbox
    fake_executed(build / "notebooks")
    assert cli.main(["report"]) == 0
    index = build / "html" / "index.html"
    assert str(index) in capsys.readouterr().out
    page = index.read_text()
    assert 'data-notebook="00_ok" data-status="pass"' in page
    assert 'data-notebook="01_bad" data-status="fail"' in page          # from the error output
    assert 'data-notebook="02_missing" data-status="fail"' in page      # summary only
    assert "no executed copy" in page and "1.5" in page
    import re
    links = re.findall(r'href="([^"]+)"', page)
    assert sorted(links) == ["00_ok.html", "01_bad.html"]
    for link in links:
        assert (build / "html" / link).read_text().count("<html") >= 1
    assert "fallback-here" in (build / "html" / "00_ok.html").read_text()
    # each notebook's title and one-line summary, from its first markdown cell
    assert '<a href="00_ok.html">00_ok title</a><div class="summary">What 00_ok shows, in one line of a summary.</div>' in page
    for link in links:                                 # the NBVAL markers stay out of the HTML
        assert "NBVAL" not in (build / "html" / link).read_text()


def test_report_without_executed_notebooks(sandbox, capsys):
    """A clear message that says to run first (an exception or a non-zero exit)."""
    try:
        rc = cli.main(["report"])
    except FileNotFoundError as e:
        assert "dsv4lab run" in str(e)
    else:
        captured = capsys.readouterr()
        assert rc != 0 and "dsv4lab run" in captured.out + captured.err


def test_env(capsys):
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    for key in ("gpu", "capability", "torch", "triton", "roofline"):
        assert key in out
    from dsv4lab import roofline
    assert roofline.device_spec().describe() in out          # with its note when it stands in
    assert "kernels by GPU" in out
    for op in ("sparse_mla_decode", "indexer_topk", "fused_moe"):
        assert f"\n{op}\n" in out
    for cap in ("sm_80", "sm_89", "sm_90", "sm_100", "sm_120"):
        assert f"  {cap} " in out


def test_help_describes_every_verb(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for verb in cli.COMMANDS:
        line = next((ln for ln in out.splitlines() if ln.strip().startswith(verb + " ")), None)
        assert line and len(line.split(None, 1)[1]) > 10, f"`dsv4lab --help` does not describe {verb}"


def test_bench_help_lists_the_benchmarks(capsys, toy):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    out = capsys.readouterr().out
    assert re.search(rf"^  {toy}\s+a toy for the CLI$", out, re.M), out
    from dsv4lab import benchmarks
    for name, b in benchmarks.registered().items():
        assert name in out and b.description in out
    for name in benchmarks.unavailable():
        assert re.search(rf"^  {name}\s+\(cannot be imported: ", out, re.M)


@pytest.fixture
def toy():
    name = "_test_cli_toy"

    @bench.benchmark(name, "a toy for the CLI")
    def run(smoke):
        if not smoke:
            raise AssertionError("full mode ran without a GPU")
        return [{"ms": 1.0}]
    yield name
    bench._BENCHMARKS.pop(name, None)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="what happens without a GPU")
def test_bench_without_a_gpu_runs_smoke_mode_and_says_so(toy, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DSV4LAB_RESULTS_DIR", str(tmp_path))
    assert cli.main(["bench", toy]) == 0
    out = capsys.readouterr().out
    assert "no CUDA GPU here: running in smoke mode" in out and f"bench {toy}: 1 rows" in out
    assert results.load(toy) == []


def test_a_failing_benchmark_is_one_line_not_a_traceback(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DSV4LAB_RESULTS_DIR", str(tmp_path))
    name = "_test_cli_broken"

    @bench.benchmark(name, "fails")
    def broken(smoke):
        raise RuntimeError("no kernel for this shape")
    try:
        assert cli.main(["bench", name, "--smoke"]) == 1
        err = capsys.readouterr().err
        assert err.strip().splitlines() == [f"bench {name} failed: RuntimeError: no kernel for this shape "
                                            "(--traceback shows where)"]
        assert cli.main(["bench", name, "--smoke", "--traceback"]) == 1
        assert "Traceback" in capsys.readouterr().err
    finally:
        bench._BENCHMARKS.pop(name, None)


def test_a_benchmark_that_cannot_be_imported_says_why(monkeypatch, capsys):
    monkeypatch.setitem(bench._UNAVAILABLE, "_test_cli_gone", "ImportError: no module named x")
    assert cli.main(["bench", "_test_cli_gone", "--smoke"]) == 1
    assert capsys.readouterr().err.strip() == "bench _test_cli_gone: cannot be imported: ImportError: no module named x"


def test_bench_without_names_lists_them(capsys, toy):
    assert cli.main(["bench"]) == 2
    assert re.search(rf"^  {toy}\s+a toy for the CLI$", capsys.readouterr().out, re.M)


def test_bench_unknown_name_exit_code(capsys):
    assert cli.main(["bench", "no_such_benchmark_xyz"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("unknown benchmark(s): no_such_benchmark_xyz; known: ")


def test_bench_runs_and_records(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DSV4LAB_RESULTS_DIR", str(tmp_path))
    name = "_test_cli_bench"

    @bench.benchmark(name)
    def toy(smoke):
        return [{"smoke_arg": smoke, "ms": 0.5}]
    monkeypatch.setattr(cli.runtime, "has_cuda", lambda: True)      # full mode is for GPUs
    monkeypatch.setattr(results, "provenance", lambda: dict(gpu="NVIDIA H200", capability="sm_90", torch="2",
                                                            triton="3", commit="rev-cli", date="2026-12-01"))
    try:
        assert cli.main(["bench", name, "--smoke"]) == 0
        assert f"bench {name}: 1 rows" in capsys.readouterr().out
        assert results.load(name) == []            # smoke rows are not recorded unless asked
        assert cli.main(["bench", name, "--smoke", "--record"]) == 0
        assert results.load(name)[0]["smoke_arg"] is True
        assert cli.main(["bench", name, "--no-record"]) == 0
        assert len(results.load(name)) == 1
        assert cli.main(["bench", name]) == 0
        assert results.load(name)[-1]["smoke_arg"] is False
    finally:
        bench._BENCHMARKS.pop(name, None)


def test_lab_dry_run(capsys, tmp_path):
    assert cli.main(["lab", "--dry-run", "--port", "0", "--token", "t0k3n", "--notebook-dir", str(tmp_path)]) == 0
    url, cmd = capsys.readouterr().out.strip().splitlines()
    assert url.startswith("http://127.0.0.1:") and url.endswith("/lab?token=t0k3n")
    assert "--ServerApp.ip=127.0.0.1" in cmd and "--IdentityProvider.token=t0k3n" in cmd
    assert f"--ServerApp.root_dir={tmp_path}" in cmd and "--ServerApp.open_browser=False" in cmd


def test_lab_bad_folder(tmp_path, capsys):
    assert cli.main(["lab", "--dry-run", "--notebook-dir", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip() == f"dsv4lab lab: error: --notebook-dir {tmp_path / 'nope'} is not a folder"


def test_register_kernel(tmp_path):
    from dsv4lab import lab
    where = lab.register_kernel(prefix=str(tmp_path))
    spec = json.loads((tmp_path / "share" / "jupyter" / "kernels" / "dsv4lab" / "kernel.json").read_text())
    assert "dsv4lab" in where and spec["display_name"] == "Python (dsv4lab)"
    assert "ipykernel" in " ".join(spec["argv"])


# ---- train: bad arguments never touch the checkpoint ------------------------------------

@pytest.fixture
def checkpoint(tmp_path):
    out = tmp_path / "mini.safetensors"
    out.write_bytes(b"the committed checkpoint")
    return out


@pytest.mark.parametrize("args, message", [
    (["--steps", "-5"], "--steps must be >= 1, got -5"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--batch", "0"], "--batch must be >= 1, got 0"),
    (["--layers", "0"], "--layers must be >= 2, got 0"),
    (["--layers", "1"], "--layers must be >= 2, got 1"),
    (["--seq", "0"], "--seq must be >= 8, got 0"),
    (["--minutes", "-1"], "--minutes must be a positive number, got -1.0"),
    (["--minutes", "nan"], "--minutes must be a positive number, got nan"),
    (["--lr", "0"], "--lr must be a positive number, got 0.0"),
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--max-files", "0"], "--max-files must be >= 1, got 0"),
    (["--device", "tpu"], "--device 'tpu' is not a device"),
    (["--steps", "abc"], "argument --steps: invalid int value: 'abc'"),
])
def test_train_refuses_bad_arguments_in_one_line(checkpoint, capsys, args, message):
    with pytest.raises(SystemExit) if "invalid" in message else _no_exit() as e:
        rc = cli.main(["train", "--out", str(checkpoint), *args])
    rc = e.value.code if e is not None and hasattr(e, "value") else rc
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dsv4lab train: error: ") and message in err[0], err
    assert checkpoint.read_bytes() == b"the committed checkpoint"


class _no_exit:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="what happens without a GPU")
def test_train_on_cuda_without_a_gpu_is_one_line(checkpoint, capsys):
    assert cli.main(["train", "--device", "cuda", "--out", str(checkpoint)]) == 2
    assert capsys.readouterr().err.strip() == ("dsv4lab train: error: --device cuda: this machine has no "
                                               "CUDA GPU (use --device cpu)")
    assert checkpoint.read_bytes() == b"the committed checkpoint"


def test_train_that_runs_no_step_writes_nothing(checkpoint, monkeypatch, capsys):
    from dsv4lab import train
    monkeypatch.setattr(train, "train", lambda cfg, **kw: (None, {"steps": 0}))
    assert cli.main(["train", "--minutes", "0.0001", "--device", "cpu", "--out", str(checkpoint)]) == 1
    assert "nothing written" in capsys.readouterr().out
    assert checkpoint.read_bytes() == b"the committed checkpoint"
    assert not checkpoint.with_suffix(".json").exists()


def test_train_that_fails_midway_leaves_the_checkpoint(checkpoint, monkeypatch):
    from dsv4lab import train

    def boom(cfg, **kw):
        raise KeyboardInterrupt
    monkeypatch.setattr(train, "train", boom)
    with pytest.raises(KeyboardInterrupt):
        cli.main(["train", "--steps", "3", "--device", "cpu", "--out", str(checkpoint)])
    assert checkpoint.read_bytes() == b"the committed checkpoint"
    assert [p.name for p in checkpoint.parent.iterdir()] == [checkpoint.name]


def test_train_two_steps_writes_the_checkpoint_and_log(tmp_path, capsys):
    out = tmp_path / "ckpt" / "mini.safetensors"
    assert cli.main(["train", "--steps", "2", "--device", "cpu", "--config", "tiny", "--batch", "2",
                     "--seq", "16", "--max-files", "60", "--quiet", "--out", str(out)]) == 0
    log = json.loads(out.with_suffix(".json").read_text())
    assert log["steps"] == 2 and log["checkpoint"] == out.name and out.stat().st_size == log["checkpoint_bytes"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["mini.json", "mini.safetensors"]   # no temp files
    from dsv4lab.model import load_checkpoint
    assert load_checkpoint(out).expert_format == "mxfp4"
    assert "trained 2 steps" in capsys.readouterr().out


# ---- tp: the CLI parses, the driver runs ------------------------------------------------

def test_tp_arguments_become_the_drivers_options(monkeypatch):
    from dsv4lab.drivers import tp_run
    seen = {}
    monkeypatch.setattr(tp_run, "run", lambda opts: seen.setdefault("opts", opts) and 0)
    assert cli.main(["tp", "--model", "mini", "--concurrency", "1,2", "--kinds", "4", "--dtype", "fp32",
                     "--check", "--no-timing", "--allreduce-sizes", "65536", "--out", "rows.json"]) == 0
    o = seen["opts"]
    assert (o.model, o.concurrency, o.kinds, o.dtype, o.check, o.timing, o.allreduce_sizes, o.out) == \
        ("mini", (1, 2), (4,), "fp32", True, False, (65536,), "rows.json")


@pytest.mark.parametrize("args, message", [
    (["--concurrency", "1,x"], "--concurrency takes comma-separated integers"),
    (["--concurrency", "0"], "concurrency must be positive ints"),
    (["--context", "0"], "context must be a positive int"),
    (["--nproc", "0"], "--nproc must be >= 1"),
])
def test_tp_bad_arguments_are_one_line(capsys, args, message, monkeypatch):
    from dsv4lab.drivers import tp_run
    monkeypatch.setattr(tp_run, "run", lambda opts: pytest.fail("ran with bad arguments"))
    monkeypatch.setattr(tp_run, "launch", lambda *a, **k: pytest.fail("launched with bad arguments"))
    try:
        rc = cli.main(["tp", *args])
    except SystemExit as e:
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
