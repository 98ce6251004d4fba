"""dsv4lab.results: append-only JSONL with provenance, loading and labels; nothing recorded
is lost to a torn line or a non-finite figure."""
import json
import math
import os

import numpy as np
import pytest
import torch

from dsv4lab import results


@pytest.fixture
def rdir(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV4LAB_RESULTS_DIR", str(tmp_path))
    monkeypatch.setenv("DSV4LAB_COMMIT", "abc123")
    return tmp_path


def test_results_dir_honours_the_environment(rdir, monkeypatch):
    assert results.results_dir() == rdir
    monkeypatch.delenv("DSV4LAB_RESULTS_DIR")
    assert results.results_dir() == results.REPO_ROOT / "data" / "results"


def test_record_writes_provenance_and_shape(rdir):
    path = results.record("toy", [{"B": 2, "topk": 512, "ms": 1.5}])
    assert path == rdir / "toy.jsonl"
    (row,) = [json.loads(line) for line in path.read_text().splitlines()]
    for key in results.PROVENANCE_KEYS:
        assert key in row and row[key] not in (None, "")
    assert row["commit"] == "abc123" and row["bench"] == "toy"
    assert (row["B"], row["topk"], row["ms"]) == (2, 512, 1.5)
    assert row["date"][:4].isdigit() and "T" in row["date"]


def test_record_is_append_only(rdir):
    results.record("toy", [{"i": 0}, {"i": 1}])
    before = (rdir / "toy.jsonl").read_bytes()
    results.record("toy", [{"i": 2}])
    after = (rdir / "toy.jsonl").read_bytes()
    assert after.startswith(before) and len(after) > len(before)
    assert [r["i"] for r in results.load("toy")] == [0, 1, 2]


def test_record_converts_tensors_and_tuples(rdir):
    results.record("toy", [{"x": torch.tensor(2.5), "y": np.float32(1.25), "shape": (4, 8), "dev": torch.device("cpu")}])
    (row,) = results.load("toy")
    assert row["x"] == 2.5 and row["y"] == 1.25 and row["shape"] == [4, 8] and row["dev"] == "cpu"


def test_load_filters_and_missing(rdir, tmp_path):
    results.record("toy", [{"backend": "mma", "B": 1}, {"backend": "simt", "B": 1}, {"backend": "mma", "B": 64}])
    assert len(results.load("toy")) == 3
    assert [r["B"] for r in results.load("toy", backend="mma")] == [1, 64]
    assert results.load("toy", backend="mma", B=64)[0]["B"] == 64
    assert results.load("toy", backend="cutlass") == []
    assert results.load("never_recorded") == []


def test_explicit_directory(rdir, tmp_path):
    other = tmp_path / "elsewhere"
    results.record("toy", [{"a": 1}], directory=other)
    assert results.load("toy") == []
    assert results.load("toy", directory=other)[0]["a"] == 1


def test_blank_lines_are_skipped(rdir):
    results.record("toy", [{"a": 1}])
    with (rdir / "toy.jsonl").open("a") as f:
        f.write("\n\n")
    results.record("toy", [{"a": 2}])
    assert [r["a"] for r in results.load("toy")] == [1, 2]


def test_latest_keeps_the_newest_per_key():
    rows = [{"B": 1, "ms": 3.0}, {"B": 2, "ms": 5.0}, {"B": 1, "ms": 2.0}]
    out = results.latest(rows, ["B"])
    assert sorted((r["B"], r["ms"]) for r in out) == [(1, 2.0), (2, 5.0)]


def test_label():
    assert results.label([]) == "no recorded rows"
    r = {"gpu": "NVIDIA H200", "capability": "sm_90", "date": "2026-11-29T10:00:00+00:00"}
    assert results.label([r]) == "NVIDIA H200 (sm_90), 2026-11-29"
    r2 = dict(r, date="2026-12-02T10:00:00+00:00")
    assert results.label([r2, r]) == "NVIDIA H200 (sm_90), 2026-11-29 to 2026-12-02"


def test_git_commit_env_wins(monkeypatch):
    monkeypatch.setenv("DSV4LAB_COMMIT", "from-the-env")
    assert results.git_commit() == "from-the-env"
    monkeypatch.delenv("DSV4LAB_COMMIT")
    assert isinstance(results.git_commit(), str) and results.git_commit()


def test_committed_rows_carry_provenance():
    """Every row recorded in data/results/ says where and when it was measured, and none is
    a smoke (interpreter) row: those are never recorded by default."""
    from pathlib import Path

    files = sorted((Path(__file__).resolve().parents[1] / "data" / "results").glob("*.jsonl"))
    for path in files:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            row = json.loads(line)
            missing = [k for k in results.PROVENANCE_KEYS if not row.get(k)]
            assert not missing, f"{path.name}:{n} lacks {missing}"
            assert row.get("smoke") is not True, f"{path.name}:{n} is a smoke row"
            assert row["bench"] == path.stem, f"{path.name}:{n} belongs to bench {row['bench']!r}"


def test_withdrawn_commits_are_left_out_unless_asked(rdir):
    """Rows of a commit listed in withdrawn.json (a reverted experiment) stay in the file
    but not in what load() returns, so newest-first readers see the shipped code's rows."""
    results.record("x", [{"n": 1}])
    with (rdir / "x.jsonl").open("a") as f:
        f.write(json.dumps({"bench": "x", "commit": "gone-commit", "n": 2}) + "\n")
    (rdir / "withdrawn.json").write_text(json.dumps(
        [{"commit": "gone-co", "bench": "x", "reason": "reverted"}]))
    assert results.withdrawn_commits() == {"gone-co": "reverted"}
    assert [r["n"] for r in results.load("x")] == [1]
    assert [r["n"] for r in results.load("x", withdrawn=True)] == [1, 2]
    assert len((rdir / "x.jsonl").read_text().splitlines()) == 2      # nothing dropped


def test_committed_withdrawals_name_recorded_commits_and_reasons():
    """Each withdrawn commit has rows in its bench's file and a reason that names the revert."""
    from pathlib import Path

    directory = Path(__file__).resolve().parents[1] / "data" / "results"
    entries = json.loads((directory / results.WITHDRAWN_FILE).read_text())
    for entry in entries:
        rows = results.load(entry["bench"], directory=directory, withdrawn=True, commit=entry["commit"])
        assert rows, f"no {entry['bench']} rows at {entry['commit']}"
        assert not results.load(entry["bench"], directory=directory, commit=entry["commit"])
        assert "reverted" in entry["reason"]


# ---- nothing recorded is lost ------------------------------------------------------------

def test_a_torn_last_line_is_skipped_with_a_warning_and_the_next_append_survives(rdir):
    results.record("toy", [{"i": 0}, {"i": 1}])
    path = rdir / "toy.jsonl"
    with path.open("a") as f:
        f.write('{"bench": "toy", "i": 2, "ms": 0.')          # a write cut short: no newline
    with pytest.warns(results.TornLineWarning, match=r"toy\.jsonl:3: skipped a line"):
        assert [r["i"] for r in results.load("toy")] == [0, 1]
    results.record("toy", [{"i": 3}, {"i": 4}])             # starts on a line of its own
    lines = path.read_text().splitlines()
    assert lines[2].startswith('{"bench": "toy", "i": 2') and json.loads(lines[3])["i"] == 3
    with pytest.warns(results.TornLineWarning, match="toy.jsonl:3"):
        assert [r["i"] for r in results.load("toy")] == [0, 1, 3, 4]


@pytest.mark.parametrize("garbage", ["[1, 2]", "NaN", "{not json}", "\x00\x00"])
def test_lines_that_are_not_rows_are_skipped(rdir, garbage):
    results.record("toy", [{"i": 0}])
    with (rdir / "toy.jsonl").open("a") as f:
        f.write(garbage + "\n")
    results.record("toy", [{"i": 1}])
    with pytest.warns(results.TornLineWarning, match="toy.jsonl:2"):
        assert [r["i"] for r in results.load("toy")] == [0, 1]


def test_a_batch_is_one_write_of_whole_lines(rdir, monkeypatch):
    writes = []
    real = os.write

    def spy(fd, data):
        writes.append(bytes(data))
        return real(fd, data)
    monkeypatch.setattr(os, "write", spy)
    results.record("toy", [{"i": i} for i in range(50)])
    assert len(writes) == 1 and writes[0].endswith(b"\n") and writes[0].count(b"\n") == 50


def test_a_row_that_cannot_be_serialised_writes_nothing(rdir):
    results.record("toy", [{"i": 0}])
    before = (rdir / "toy.jsonl").read_bytes()
    with pytest.raises(TypeError):                         # json keys must be strings
        results.record("toy", [{"i": 1}, {"bad": {(1, 2): 3}}])
    assert (rdir / "toy.jsonl").read_bytes() == before    # not even the good first row


def test_nonfinite_figures_are_null_with_the_reason(rdir):
    import numpy as np
    import torch
    results.record("toy", [{"ms": float("nan"), "roofline_fraction": math.inf, "ok": 1.5,
                            "per": {"attn": -math.inf, "moe": 2.0}, "list": [1.0, float("nan")],
                            "t": torch.tensor(float("nan")), "n": np.float32("inf")}])
    text = (rdir / "toy.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    (row,) = results.load("toy")
    assert row["ms"] is None and row["roofline_fraction"] is None and row["ok"] == 1.5
    assert row["per"] == {"attn": None, "moe": 2.0} and row["list"] == [1.0, None]
    assert row["t"] is None and row["n"] is None
    assert row["nonfinite"] == sorted(["ms", "roofline_fraction", "per.attn", "list.1", "t", "n"])
    results.record("toy", [{"ms": 1.0}])
    assert "nonfinite" not in results.load("toy")[-1]


def test_with_provenance_keeps_a_rows_own_fields(rdir):
    (row,) = results.with_provenance("toy", [{"ms": 1.0, "commit": "recorded-at"}])
    assert row["bench"] == "toy" and row["commit"] == "recorded-at"
    assert set(results.PROVENANCE_KEYS) <= set(row)
