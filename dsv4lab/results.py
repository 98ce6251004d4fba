"""Recorded measurements: append-only JSONL under data/results/, one file per benchmark.

Every row carries where it was measured (GPU, capability, torch, triton, git commit,
date). Rows are never edited or dropped; newer rows simply come later. ``load`` returns
them for plotting; ``latest`` keeps the newest row per configuration.

Nothing recorded can be lost:

- :func:`record` writes a batch of rows with one ``write`` of whole lines, starting with a
  newline when the file does not end in one (so a line torn by a crash stays on its own);
- :func:`load` skips a line that does not parse, with a warning naming the file and line;
- a figure that is not finite (NaN, inf) is written as ``null``, and the row's
  ``"nonfinite"`` field lists the fields that were (JSON has no NaN).

Withdrawn commits. An experiment measured and then reverted leaves rows of code that is
not in the project any more; newest-first readers (``dsv4lab targets``, the notebooks'
recorded-row cells) would take them for the shipped kernels' figures. Such commits are
listed, with the reason, in ``withdrawn.json`` beside the rows: ``load`` leaves their rows
out unless asked (``withdrawn=True``); the rows themselves stay in the files.

Explained in notebooks/00_tour.ipynb.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import subprocess
import warnings
from pathlib import Path
from typing import Iterable

from dsv4lab import runtime

REPO_ROOT = Path(__file__).resolve().parents[1]
PROVENANCE_KEYS = ("gpu", "capability", "torch", "triton", "commit", "date")
WITHDRAWN_FILE = "withdrawn.json"


class TornLineWarning(UserWarning):
    """A results file holds a line that is not a JSON row (a write cut short)."""


def results_dir() -> Path:
    """data/results/ of the checkout, or $DSV4LAB_RESULTS_DIR when set (device runs)."""
    return Path(os.environ.get("DSV4LAB_RESULTS_DIR") or REPO_ROOT / "data" / "results")


def git_commit() -> str:
    """The commit the code was run at ($DSV4LAB_COMMIT wins: device copies have no .git)."""
    if os.environ.get("DSV4LAB_COMMIT"):
        return os.environ["DSV4LAB_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=5)
        commit = out.stdout.strip()
        if not commit:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO_ROOT, capture_output=True, text=True, timeout=5).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def provenance() -> dict:
    """Where and when a row is measured: :data:`PROVENANCE_KEYS`."""
    v = runtime.versions()
    return {
        "gpu": v["gpu"],
        "capability": v["capability"],
        "torch": v["torch"],
        "triton": v["triton"],
        "commit": git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def with_provenance(bench: str, rows: Iterable[dict], prov: dict | None = None) -> list[dict]:
    """``rows`` as they are recorded: ``{"bench", provenance..., row...}`` (a row's own
    fields win, so a row that already carries its provenance keeps it)."""
    prov = provenance() if prov is None else prov
    return [{"bench": bench, **prov, **row} for row in rows]


def _plain(x):
    """``x`` as JSON can hold it: tensors and numpy scalars as numbers, tuples and sets as lists."""
    if hasattr(x, "item") and getattr(x, "ndim", 0) == 0:
        return x.item()
    if hasattr(x, "tolist"):
        return x.tolist()
    if isinstance(x, (tuple, set, frozenset)):
        return list(x)
    return x


def _finite(value, path: str, bad: list[str]):
    """``value`` with every non-finite float replaced by None (its dotted path noted in ``bad``)."""
    value = _plain(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        bad.append(path)
        return None
    if isinstance(value, dict):
        return {k: _finite(v, f"{path}.{k}" if path else str(k), bad) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v, f"{path}.{i}", bad) for i, v in enumerate(value)]
    return value


def _line(row: dict) -> str:
    bad: list[str] = []
    clean = _finite(row, "", bad)
    if bad:
        clean["nonfinite"] = sorted(set(clean.get("nonfinite") or []) | set(bad))
    return json.dumps(clean, default=str, allow_nan=False)


def record(bench: str, rows: Iterable[dict], *, directory: Path | str | None = None) -> Path:
    """Append ``rows`` (dicts of shape parameters and figures) to ``<bench>.jsonl``, each
    with the provenance of this run (:func:`with_provenance`), in one write."""
    rows = with_provenance(bench, rows)
    path = Path(directory or results_dir()) / f"{bench}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not rows:
        return path
    text = "".join(_line(r) + "\n" for r in rows)          # serialised before the file is touched
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size:
            with path.open("rb") as f:
                f.seek(size - 1)
                if f.read(1) != b"\n":
                    text = "\n" + text
        data = text.encode()
        written = os.write(fd, data)
        while written < len(data):                         # a short write: finish the batch
            written += os.write(fd, data[written:])
    finally:
        os.close(fd)
    return path


def withdrawn_commits(directory: Path | str | None = None) -> dict:
    """{commit: reason} of the withdrawn commits listed beside the rows (none: {})."""
    path = Path(directory or results_dir()) / WITHDRAWN_FILE
    if not path.exists():
        return {}
    return {entry["commit"]: entry["reason"] for entry in json.loads(path.read_text())}


def load(bench: str, *, directory: Path | str | None = None, withdrawn: bool = False,
         **filters) -> list[dict]:
    """Rows of ``<bench>.jsonl`` whose fields equal every ``filters`` value, without the
    rows of withdrawn commits unless ``withdrawn`` (see the module docstring). A line that
    does not parse is skipped with a :class:`TornLineWarning` naming the file and line."""
    path = Path(directory or results_dir()) / f"{bench}.jsonl"
    if not path.exists():
        return []
    skip = set() if withdrawn else set(withdrawn_commits(directory))
    rows = []
    with path.open(encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                warnings.warn(f"{path}:{n}: skipped a line that is not a JSON row ({e.msg}): "
                              f"{line[:80]!r}", TornLineWarning, stacklevel=2)
                continue
            if not isinstance(row, dict):
                warnings.warn(f"{path}:{n}: skipped a line that is not a JSON object",
                              TornLineWarning, stacklevel=2)
                continue
            if str(row.get("commit", ""))[:7] in skip:
                continue
            if all(row.get(k) == v for k, v in filters.items()):
                rows.append(row)
    return rows


def latest(rows: Iterable[dict], keys: Iterable[str]) -> list[dict]:
    """The newest row (by file order) for each distinct combination of ``keys``."""
    keys = tuple(keys)
    out: dict[tuple, dict] = {}
    for row in rows:
        out[tuple(json.dumps(row.get(k), default=str) for k in keys)] = row
    return list(out.values())


def label(rows: Iterable[dict]) -> str:
    """'NVIDIA H200 (sm_90), 2026-11-29' for a figure's caption."""
    rows = list(rows)
    if not rows:
        return "no recorded rows"
    gpus = sorted({f"{r.get('gpu')} ({r.get('capability')})" for r in rows})
    dates = sorted({str(r.get("date", ""))[:10] for r in rows})
    return f"{', '.join(gpus)}, {dates[0]}" + (f" to {dates[-1]}" if len(dates) > 1 else "")
