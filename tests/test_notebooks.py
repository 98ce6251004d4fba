"""Every notebook, headless: papermill executes it in smoke mode into build/notebooks-test/,
then nbval (lax, sanitised with tests/nbval_sanitize.cfg) re-executes the executed copy and
checks it runs clean and that cells marked NBVAL_CHECK_OUTPUT reproduce their outputs.

Notebooks are discovered by glob, one test each (pytest-xdist spreads them over cores:
``pytest -m notebooks -n 2``). Deselect with ``-m 'not notebooks'``.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")   # jupyter tooling is absent on some GPU hosts

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
OUT = ROOT / "build" / "notebooks-test"
SANITIZE = Path(__file__).resolve().parent / "nbval_sanitize.cfg"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))
CELL_TIMEOUT = 600          # seconds a cell may take (smoke mode aims at < 60 s a notebook)
MAX_OUTPUT_LINES = 40       # what one code cell may print: a screen
MAX_MARKDOWN_CHARS = 3000   # one markdown cell


def output_lines(cell) -> int:
    """Lines a code cell shows: its streams, and the text of its results (a figure counts as
    one line: the plot shows the rest)."""
    n = 0
    for o in cell.get("outputs", []):
        if o.get("output_type") == "stream":
            n += len(str(o.get("text", "")).splitlines())
        elif o.get("output_type") in ("execute_result", "display_data"):
            data = o.get("data", {})
            text = data.get("text/plain", "") if not any(k.startswith("image/") for k in data) else "x"
            n += len(("".join(text) if isinstance(text, list) else str(text)).splitlines())
        elif o.get("output_type") == "error":
            n += len(o.get("traceback", []))
    return n


def screen_problems(nb) -> list[str]:
    """Cells of an executed notebook that break the screen rules."""
    out = []
    for i, c in enumerate(nb.cells):
        if c.cell_type == "code" and (n := output_lines(c)) > MAX_OUTPUT_LINES:
            out.append(f"cell {i} prints {n} lines (at most {MAX_OUTPUT_LINES})")
        if c.cell_type == "markdown" and len(c.source) > MAX_MARKDOWN_CHARS:
            out.append(f"markdown cell {i} has {len(c.source)} characters (at most {MAX_MARKDOWN_CHARS})")
    return out


def _errors(nb) -> list[str]:
    return [f"cell {i}: {o.get('ename')}: {o.get('evalue')}" for i, c in enumerate(nb.cells)
            if c.cell_type == "code" for o in c.get("outputs", []) if o.get("output_type") == "error"]


@pytest.mark.notebooks
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_smoke_then_nbval(path):
    import papermill as pm

    OUT.mkdir(parents=True, exist_ok=True)
    out = OUT / path.name
    try:
        pm.execute_notebook(str(path), str(out), parameters={"MODE": "smoke"}, kernel_name="python3",
                            cwd=str(NOTEBOOK_DIR), progress_bar=False, execution_timeout=CELL_TIMEOUT,
                            log_output=False)
    except pm.PapermillExecutionError as e:
        pytest.fail(f"{path.name} failed under papermill (smoke) in cell {e.exec_count}: {e.ename}: {e.evalue}",
                    pytrace=False)
    executed = nbformat.read(out, as_version=4)
    assert _errors(executed) == []
    assert screen_problems(executed) == [], f"{path.name}: {screen_problems(executed)}"
    assert any("# Parameters" in c.source and 'MODE = "smoke"' in c.source for c in executed.cells), \
        "papermill did not inject MODE"

    # nbval re-executes the executed copy in a fresh kernel of this Python
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PYTEST_XDIST_WORKER", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-p", "no:randomly",
         "--nbval-lax", "--nbval-current-env", f"--nbval-sanitize-with={SANITIZE}",
         f"--nbval-cell-timeout={CELL_TIMEOUT}", "--rootdir", str(OUT), "-c", str(OUT / "pytest.ini"), str(out)],
        cwd=str(OUT), capture_output=True, text=True, env=env, timeout=CELL_TIMEOUT * 4)
    assert proc.returncode == 0, f"nbval failed on {out.name}:\n{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}"
    assert re.search(r"\b\d+ passed\b", proc.stdout), proc.stdout[-2000:]


@pytest.fixture(scope="session", autouse=True)
def _nbval_ini():
    """An empty pytest config for the nbval runs, so the repo's settings don't apply to them."""
    OUT.mkdir(parents=True, exist_ok=True)
    ini = OUT / "pytest.ini"
    if not ini.exists():
        ini.write_text("[pytest]\n")


def _sanitize(text: str) -> str:
    """What nbval does with the file: its own parser, then each pattern in order."""
    from nbval.plugin import get_sanitize_patterns

    patterns = dict(get_sanitize_patterns(SANITIZE.read_text()))
    assert len(patterns) >= 8, "the sanitize file did not parse"
    for regex, replace in patterns.items():
        text = re.sub(regex, replace, text)
    return text


@pytest.mark.parametrize("raw, clean", [
    ("Lab(mode='smoke', device=cpu (Triton interpreter) (cpu), torch 2.13.0+cpu, triton 3.9.0)",
     "Lab(mode='smoke', device=DEVICE (cpu), torch VERSION, triton VERSION)"),
    ("NVIDIA H200 (sm_90), 2026-11-29", "DEVICE (SM), DATE"),
    ("date 2026-11-29T10:00:00+00:00 took 12.5 ms", "date DATE took DURATION"),
    ("<Figure at 0x7f1629c4d310>", "<Figure at ADDRESS>"),
    ("2.59 ms a step, 2,139 tokens/s", "DURATION a step, RATE"),
    ('{"model_id": "0123456789abcdef0123456789abcdef"}', '{"model_id": "MODEL-ID"}'),
])
def test_sanitize_file_covers_versions_times_addresses(raw, clean):
    assert _sanitize(raw) == clean


def test_every_notebook_is_covered():
    assert NOTEBOOKS, "no notebooks found"
    assert NOTEBOOKS[0].name == "00_tour.ipynb"


def test_screen_rules_catch_long_outputs():
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("print('x')")
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="line\n" * 41)]
    nb.cells = [nbformat.v4.new_markdown_cell("y" * 3001), cell]
    problems = screen_problems(nb)
    assert len(problems) == 2 and "41 lines" in problems[1] and "3001 characters" in problems[0]


@pytest.mark.gpu
@pytest.mark.notebooks
def test_every_notebook_runs_in_full_mode_on_the_gpu():
    """What `dsv4lab run --full` does: every notebook at real shapes, live benchmarks included."""
    from dsv4lab import cli

    rows = cli.run_notebooks(NOTEBOOKS, mode="full", out_dir=ROOT / "build" / "notebooks-full")
    failed = [r for r in rows if r.get("status") != "pass"]
    assert not failed, failed
    for path in NOTEBOOKS:
        executed = nbformat.read(ROOT / "build" / "notebooks-full" / path.name, as_version=4)
        assert screen_problems(executed) == [], f"{path.name}: {screen_problems(executed)}"
