"""Packaging and notebook hygiene: environment.yml agrees with pyproject.toml; committed
notebooks carry no outputs, define no kernels or library logic and speak of the workbook;
every tool parses and tools/README.md names it."""
import ast
import re
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")   # jupyter tooling is absent on some GPU hosts

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

# conda-forge package name -> PyPI name, where they differ
CONDA_TO_PYPI = {"pytorch": "torch", "pytorch-cpu": "torch", "jupyterlab": "jupyterlab",
                 "py-triton": "triton"}
NOT_REQUIREMENTS = {"python", "pip"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def split_requirement(req: str) -> tuple[str, str]:
    """'torch>=2.4' -> ('torch', '>=2.4'); conda's 'numpy >=1.26' and 'numpy=1.26' too."""
    req = req.split(";")[0].split("#")[0].strip()
    m = re.match(r"^([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*(.*)$", req)
    if not m:
        raise ValueError(f"cannot parse requirement {req!r}")
    spec = m.group(3).replace(" ", "")
    if spec.startswith("=") and not spec.startswith("=="):
        spec = "=" + spec                                   # conda's =1.2 means ==1.2.*
    return _norm(m.group(1)), spec


def pyproject_requirements() -> dict[str, str]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    reqs = list(data["project"]["dependencies"])
    for extra in data["project"].get("optional-dependencies", {}).values():
        reqs += extra
    return dict(split_requirement(r) for r in reqs)


def environment_requirements() -> dict[str, str]:
    import yaml

    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    out = {}
    for dep in env.get("dependencies", []):
        if isinstance(dep, dict):
            for pip_req in dep.get("pip", []):
                if pip_req.startswith(("-e", ".", "-r", "--")):
                    continue                                # the project itself, or options
                name, spec = split_requirement(pip_req)
                out[name] = spec
        else:
            name, spec = split_requirement(str(dep))
            name = CONDA_TO_PYPI.get(name, name)
            if name not in NOT_REQUIREMENTS:
                out[name] = spec
    return out


def test_environment_yml_installs_the_project_on_python_311():
    import yaml

    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    deps = env["dependencies"]
    assert "conda-forge" in env.get("channels", [])
    assert any(str(d).replace(" ", "").startswith("python=3.11") for d in deps if not isinstance(d, dict))
    pip = [r for d in deps if isinstance(d, dict) for r in d.get("pip", [])]
    assert any(r.startswith("-e") and "." in r for r in pip), "the pip section must install the project (-e .)"


def test_environment_yml_agrees_with_pyproject():
    py, env = pyproject_requirements(), environment_requirements()
    assert sorted(set(py) - set(env)) == [], "in pyproject.toml but not environment.yml"
    assert sorted(set(env) - set(py)) == [], "in environment.yml but not pyproject.toml"
    for name, spec in py.items():
        if spec and env[name]:
            assert spec == env[name], f"{name}: pyproject says {spec!r}, environment.yml {env[name]!r}"


def test_requirement_parser():
    assert split_requirement("torch>=2.4") == ("torch", ">=2.4")
    assert split_requirement("numpy >=1.26") == ("numpy", ">=1.26")
    assert split_requirement("Py_Yaml") == ("py-yaml", "")
    assert split_requirement("pkg[extra]>=1; python_version<'3.11'") == ("pkg", ">=1")
    assert split_requirement("numpy=1.26") == ("numpy", "==1.26")


# ---- notebooks ----------------------------------------------------------------------

FORBIDDEN = [
    (re.compile(r"@\s*triton\s*\.\s*(jit|autotune|heuristics)"), "a Triton kernel (@triton.jit)"),
    (re.compile(r"^\s*(import\s+triton\.language|from\s+triton\s+import\s+language|from\s+triton\.language\s+import)", re.M),
     "triton.language (kernel code)"),
    (re.compile(r"\btl\.(program_id|load|store|arange|dot)\b"), "Triton kernel code (tl.*)"),
]
MAX_DEF_STATEMENTS = 4   # a notebook may define a trivial helper, never real logic


def _code(cell) -> str:
    # IPython magics and shell escapes are not Python
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in cell.source.splitlines())


TOOLS = sorted((ROOT / "tools").glob("*.py"))


@pytest.mark.parametrize("path", TOOLS, ids=lambda p: p.name)
def test_tool_parses_and_is_documented(path):
    # the tools run on a GPU host (most need a GPU), so nothing else imports them here
    ast.parse(path.read_text(), filename=str(path))
    assert path.name in (ROOT / "tools" / "README.md").read_text(), f"tools/README.md does not name {path.name}"


def test_tools_readme_names_only_existing_tools():
    readme = (ROOT / "tools" / "README.md").read_text()
    named = set(re.findall(r"`([A-Za-z0-9_]+\.(?:py|sh))`", readme))
    assert named, "tools/README.md names no tool"
    assert named <= {p.name for p in (ROOT / "tools").iterdir()}, named


# the notebooks speak of the workbook and the campaign, never of the project's tracker or the
# machines it borrowed
JOURNAL = re.compile(r"\b(?:the|this|that|an|our|each|every) issue\b|\bissue(?:'s| ?#\d)|\bsessions?\b|"
                     r"\blent\b|\blease\b", re.I)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_speaks_of_the_workbook(path):
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        m = JOURNAL.search(cell.source)
        assert not m, f"{path.name} cell {i}: {m.group(0)!r}: notebooks speak of the workbook and the campaign"
        if cell.cell_type == "markdown":
            assert len(cell.source) <= 3000, f"{path.name} markdown cell {i}: {len(cell.source)} characters"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_notebook_has_no_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.get("outputs", []) == [], f"cell {i} of {path.name} has outputs"
            assert cell.get("execution_count") is None, f"cell {i} of {path.name} has an execution count"
    assert "widgets" not in nb.metadata, f"{path.name} carries saved widget state"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_defines_no_kernel_or_library_logic(path):
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        src = _code(cell)
        for pattern, what in FORBIDDEN:
            assert not pattern.search(src), f"{path.name} cell {i} defines {what}: put it in the package"
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                n = sum(isinstance(x, ast.stmt) for x in ast.walk(node)) - 1
                assert n <= MAX_DEF_STATEMENTS, (
                    f"{path.name} cell {i} defines {node.name} ({n} statements): library logic belongs "
                    f"in dsv4lab, not in a notebook")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_skeleton(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert nb.cells[0].cell_type == "markdown", f"{path.name} starts with a title and what you will learn"
    params = code[0]
    assert "parameters" in params.metadata.get("tags", []), f"{path.name}: first code cell must be tagged parameters"
    tree = ast.parse(params.source)
    for node in tree.body:
        assert isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant), \
            f"{path.name}: the parameters cell holds literals only"
    assert re.search(r'^MODE\s*=\s*"auto"', params.source, re.M), f'{path.name}: MODE = "auto" in parameters'
    setup = code[1].source
    assert setup.startswith("# NBVAL_IGNORE_OUTPUT"), f"{path.name}: setup cell starts with # NBVAL_IGNORE_OUTPUT"
    assert "import dsv4lab" in setup and "workbook.setup(MODE)" in setup


def test_hygiene_checks_catch_violations(tmp_path):
    """The checks above fail on a notebook that breaks the rules."""
    nb = nbformat.v4.new_notebook()
    bad = nbformat.v4.new_code_cell("import triton\n@triton.jit\ndef k(x):\n    pass")
    bad.outputs = [nbformat.v4.new_output("stream", name="stdout", text="x")]
    logic = nbformat.v4.new_code_cell("def f(x):\n" + "".join(f"    x = x + {i}\n" for i in range(6)) + "    return x")
    nb.cells = [nbformat.v4.new_markdown_cell("# t"), bad, logic]
    path = tmp_path / "99_bad.ipynb"
    nbformat.write(nb, str(path))
    with pytest.raises(AssertionError, match="has outputs"):
        test_committed_notebook_has_no_outputs(path)
    with pytest.raises(AssertionError, match="Triton kernel"):
        test_notebook_defines_no_kernel_or_library_logic(path)
    nb.cells = [nb.cells[0], logic]
    nbformat.write(nb, str(path))
    with pytest.raises(AssertionError, match="library logic"):
        test_notebook_defines_no_kernel_or_library_logic(path)
    with pytest.raises(AssertionError, match="parameters"):
        test_notebook_skeleton(path)
