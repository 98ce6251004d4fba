"""Recorded measurements: append-only JSONL under data/results/, one file per benchmark.

Every row carries where it was measured (GPU, capability, torch, triton, git commit,
date). Rows are never edited or dropped; newer rows simply come later. ``load`` returns
them for plotting; ``latest`` keeps the newest row per configuration.

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
import os
import subprocess
from pathlib import Path
from typing import Iterable

from dsv4lab import runtime

REPO_ROOT = Path(__file__).resolve().parents[1]
PROVENANCE_KEYS = ("gpu", "capability", "torch", "triton", "commit", "date")


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
    v = runtime.versions()
    return {
        "gpu": v["gpu"],
        "capability": v["capability"],
        "torch": v["torch"],
        "triton": v["triton"],
        "commit": git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def record(bench: str, rows: Iterable[dict], *, directory: Path | str | None = None) -> Path:
    """Append ``rows`` (dicts of shape parameters and figures) to ``<bench>.jsonl``."""
    rows = list(rows)
    path = Path(directory or results_dir()) / f"{bench}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    prov = provenance()
    with path.open("a") as f:
        for row in rows:
            full = {"bench": bench, **prov, **row}
            f.write(json.dumps(full, sort_keys=False, default=_jsonable) + "\n")
    return path


def _jsonable(x):
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, (tuple, set)):
        return list(x)
    return str(x)


WITHDRAWN_FILE = "withdrawn.json"


def withdrawn_commits(directory: Path | str | None = None) -> dict:
    """{commit: reason} of the withdrawn commits listed beside the rows (none: {})."""
    path = Path(directory or results_dir()) / WITHDRAWN_FILE
    if not path.exists():
        return {}
    return {entry["commit"]: entry["reason"] for entry in json.loads(path.read_text())}


def load(bench: str, *, directory: Path | str | None = None, withdrawn: bool = False,
         **filters) -> list[dict]:
    """Rows of ``<bench>.jsonl`` whose fields equal every ``filters`` value, without the
    rows of withdrawn commits unless ``withdrawn`` (see the module docstring)."""
    path = Path(directory or results_dir()) / f"{bench}.jsonl"
    if not path.exists():
        return []
    skip = set() if withdrawn else set(withdrawn_commits(directory))
    rows = []
    with path.open() as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            row = json.loads(line)
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
