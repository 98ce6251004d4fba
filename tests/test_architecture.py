"""The layout holds: which way imports run, no cycles, small modules, no lab journal in the
code, and nothing that patches Triton at import.

Imports are read from the source (every ``import`` / ``from ... import``, at module level or
inside a function: a lazy import is still a dependency).
"""
import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"dsv4lab": ROOT / "dsv4lab", "dsv4lab.kernels": ROOT / "kernels"}
MAX_MODULE_LINES = 800
MAX_KERNEL_LINES = 5500
STDLIB = set(sys.stdlib_module_names)


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg, base in PACKAGE_DIRS.items():
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            mods[".".join([pkg, *parts])] = path
    return mods


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Absolute names of everything ``path`` imports (relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                mod = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)   # `from pkg import module`
    return out


def _internal(imported: set[str]) -> set[str]:
    """The project's modules among ``imported`` (the longest known prefix of each name)."""
    hits = set()
    for n in imported:
        parts = n.split(".")
        for k in range(len(parts), 0, -1):
            cand = ".".join(parts[:k])
            if cand in MODULES:
                hits.add(cand)
                break
    return hits


GRAPH = {m: _internal(_imports(m, p)) - {m} for m, p in MODULES.items()}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_kernels_import_only_triton_torch_and_kernels():
    for mod, path in MODULES.items():
        if not mod.startswith("dsv4lab.kernels"):
            continue
        for name in _imports(mod, path):
            top = name.split(".")[0]
            ok = (top in ("triton", "torch") or top in STDLIB or top == "__future__"
                  or name == "dsv4lab" or name.startswith("dsv4lab.kernels"))
            assert ok, f"{mod} imports {name}: kernel modules import triton, torch and dsv4lab.kernels only"


# lower layers never import higher ones
FORBIDDEN = {
    "ops": {"model", "engine", "drivers", "checkpoint", "bench", "benchmarks", "plots", "widgets", "cli",
            "train", "targets", "report", "step", "tp", "workbook", "lab"},
    "backends": {"ops", "model", "engine", "drivers", "benchmarks", "plots", "widgets", "cli"},
    "quant": {"ops", "model", "engine", "drivers", "benchmarks", "plots", "widgets", "cli"},
    "model": {"engine", "drivers", "benchmarks", "plots", "widgets", "cli", "train", "targets", "report"},
    "checkpoint": {"engine", "drivers", "benchmarks", "plots", "widgets", "cli"},
    "engine": {"drivers", "benchmarks", "plots", "widgets", "cli"},
    "drivers": {"benchmarks", "plots", "widgets", "cli"},
    "bench": {"ops", "model", "engine", "drivers", "benchmarks", "plots", "widgets", "cli"},
    "results": {"ops", "model", "engine", "drivers", "bench", "benchmarks", "plots", "widgets", "cli"},
    "roofline": {"ops", "model", "engine", "drivers", "bench", "benchmarks", "plots", "widgets", "cli"},
    "config": {"ops", "model", "engine", "drivers", "bench", "benchmarks", "plots", "widgets", "cli"},
    "runtime": {"ops", "model", "engine", "drivers", "bench", "benchmarks", "plots", "widgets", "cli"},
}


def test_imports_run_downwards():
    for mod, deps in GRAPH.items():
        banned = FORBIDDEN.get(_layer(mod), set())
        for dep in deps:
            assert _layer(dep) not in banned, f"{mod} imports {dep}: {_layer(mod)} sits below {_layer(dep)}"


def test_no_import_cycles():
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):                           # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    # a package's __init__ importing its own submodules is not a cycle of logic
    cycles = [c for c in cycles if not all(m == c[0] or m.startswith(c[0] + ".") for m in c)]
    assert cycles == [], f"import cycles: {cycles}"


def test_nothing_imports_tools():
    for mod, path in MODULES.items():
        for name in _imports(mod, path):
            assert not name.split(".")[0] == "tools", f"{mod} imports {name}: nothing imports tools/"
    for path in (ROOT / "tests").glob("*.py"):
        src = path.read_text()
        assert not re.search(r"^\s*(from|import)\s+tools\b", src, re.M), f"{path.name} imports tools/"


def test_modules_are_small():
    big = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert big == {}, f"modules over {MAX_MODULE_LINES} lines: {big}"
    kernel_lines = sum(len(p.read_text().splitlines()) for m, p in MODULES.items()
                       if m.startswith("dsv4lab.kernels"))
    assert kernel_lines <= MAX_KERNEL_LINES, f"kernels/ holds {kernel_lines} lines (at most {MAX_KERNEL_LINES})"


# ---- the lesson, not the lab journal -------------------------------------------------------

def _prose_files():
    yield ROOT / "README.md"
    for base in ("dsv4lab", "kernels", "tools", "tests"):
        yield from sorted((ROOT / base).rglob("*.py"))
    yield from sorted((ROOT / "notebooks").glob("*.ipynb"))
    yield from sorted((ROOT / "tools").glob("*.md"))


SESSION = re.compile(r"\bsession\s+\d+", re.I)
HASH = re.compile(r"(?<![0-9A-Za-z_])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,12}(?![0-9A-Za-z_])")
MAX_HASHES = 10


def test_no_session_marks_and_few_commit_hashes():
    sessions, hashes = [], []
    for path in _prose_files():
        if not path.exists() or path.name == Path(__file__).name:
            continue
        text = path.read_text()
        if path.suffix == ".ipynb":          # what a reader sees: the cells' sources
            text = "\n".join("".join(c["source"]) for c in json.loads(text)["cells"])
        sessions += [f"{path.relative_to(ROOT)}: {m.group(0)}" for m in SESSION.finditer(text)]
        hashes += [f"{path.relative_to(ROOT)}: {m.group(0)}" for m in HASH.finditer(text)]
    assert sessions == [], f"session marks: {sessions[:20]}"
    assert len(hashes) <= MAX_HASHES, f"{len(hashes)} commit-hash-like strings: {hashes[:30]}"


KNOBS_CHILD = r"""
import importlib, os, pkgutil, sys
os.environ["TRITON_INTERPRET"] = "1"
import triton
def snapshot():
    out = {}
    for group in ("runtime", "compilation", "cache", "nvidia"):
        ns = getattr(triton.knobs, group, None)
        for k in dir(ns) if ns is not None else ():
            if not k.startswith("_"):
                try:
                    out[(group, k)] = repr(getattr(ns, k))
                except Exception as e:
                    out[(group, k)] = type(e).__name__
    return out
before = snapshot()
import dsv4lab, dsv4lab.ops, dsv4lab.kernels
for m in pkgutil.walk_packages(dsv4lab.kernels.__path__, "dsv4lab.kernels."):
    importlib.import_module(m.name)
after = snapshot()
changed = sorted(k for k in before if before[k] != after.get(k))
print("CHANGED", changed)
sys.exit(1 if changed else 0)
"""


def test_import_leaves_triton_knobs_untouched():
    run = subprocess.run([sys.executable, "-c", KNOBS_CHILD], capture_output=True, text=True,
                         env={**os.environ}, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
