"""The dsv4lab command: run, report, bench, env, lab (in-process, on temporary folders)."""
import json

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


def test_run_only_on_tiny_notebooks(sandbox, capsys):
    nbdir, build = sandbox
    tiny_notebook(nbdir / "90_tiny.ipynb", 'assert MODE == "smoke", MODE\nprint("tiny ran in", MODE)')
    tiny_notebook(nbdir / "91_broken.ipynb", 'raise ValueError("broken on purpose")')
    out = build / "notebooks"
    assert cli.main(["run", "--only", "90", "--smoke", "--out", str(out)]) == 0
    executed = nbformat.read(out / "90_tiny.ipynb", as_version=4)
    assert any("tiny ran in smoke" in o.get("text", "") for c in executed.cells for o in c.get("outputs", []))
    assert cli.main(["run", "--only", "91", "--smoke", "--out", str(out)]) == 1
    printed = capsys.readouterr().out
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
        nb.cells = [nbformat.v4.new_markdown_cell(f"# {name}"), cell]
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


def test_bench_unknown_name_exit_code(capsys):
    assert cli.main(["bench", "no_such_benchmark_xyz"]) == 2
    assert "unknown benchmark(s): no_such_benchmark_xyz" in capsys.readouterr().err


def test_bench_runs_and_records(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DSV4LAB_RESULTS_DIR", str(tmp_path))
    name = "_test_cli_bench"

    @bench.benchmark(name)
    def toy(smoke):
        return [{"smoke_arg": smoke, "ms": 0.5}]
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


def test_lab_bad_folder(tmp_path):
    with pytest.raises(SystemExit):
        cli.main(["lab", "--dry-run", "--notebook-dir", str(tmp_path / "nope")])


def test_register_kernel(tmp_path):
    from dsv4lab import lab
    where = lab.register_kernel(prefix=str(tmp_path))
    spec = json.loads((tmp_path / "share" / "jupyter" / "kernels" / "dsv4lab" / "kernel.json").read_text())
    assert "dsv4lab" in where and spec["display_name"] == "Python (dsv4lab)"
    assert "ipykernel" in " ".join(spec["argv"])
