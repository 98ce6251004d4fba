"""The ``dsv4lab`` command.

    dsv4lab run [--only 01,02] [--smoke | --full]   execute notebooks headless into build/notebooks/
    dsv4lab report                                  executed notebooks -> build/html/ with an index
    dsv4lab bench NAME... [--smoke] [--no-record] [--l2 clean]   run benchmarks, record rows
    dsv4lab env                                     device and versions
    dsv4lab targets [NAME...] [--l2 clean]          the issues' targets, checked against recorded rows
    dsv4lab train ...                               train the mini model (see dsv4lab.train)
    dsv4lab lab ...                                 start JupyterLab on the notebooks

Explained in notebooks/00_tour.ipynb.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from dsv4lab import runtime

REPO_ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO_ROOT / "notebooks"
BUILD = REPO_ROOT / "build"
SUMMARY = BUILD / "notebooks" / "summary.json"


def notebook_paths(only: list[str] | None = None) -> list[Path]:
    """Committed notebooks in order; ``only`` keeps those whose name starts with or contains an entry."""
    paths = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    if only:
        keep = [p for p in paths if any(p.stem.startswith(o) or o in p.stem for o in only)]
        missing = [o for o in only if not any(p.stem.startswith(o) or o in p.stem for p in paths)]
        if missing:
            raise SystemExit(f"--only: no notebook matches {', '.join(missing)} "
                             f"(have: {', '.join(p.stem for p in paths)})")
        paths = keep
    return paths


def run_notebooks(paths: list[Path], *, mode: str, out_dir: Path = BUILD / "notebooks",
                  kernel: str = "python3", timeout: int = 1800) -> list[dict]:
    """Execute each notebook with papermill (parameter MODE) and return a summary row each."""
    import papermill as pm
    from tqdm.auto import tqdm

    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    bar = tqdm(paths, desc="notebooks", unit="nb")
    for path in bar:
        bar.set_postfix_str(path.stem)
        out = out_dir / path.name
        t0 = time.perf_counter()
        status, error = "pass", ""
        try:
            pm.execute_notebook(str(path), str(out), parameters={"MODE": mode}, kernel_name=kernel,
                                cwd=str(NOTEBOOKS), progress_bar=False, execution_timeout=timeout,
                                log_output=False)
        except Exception as e:  # papermill raises PapermillExecutionError with the cell's error
            status = "fail"
            error = (getattr(e, "ename", type(e).__name__) + ": " + str(getattr(e, "evalue", e)))[:500]
        rows.append({"notebook": path.stem, "status": status, "seconds": round(time.perf_counter() - t0, 1),
                     "mode": mode, "output": str(out.relative_to(BUILD.parent) if out.is_relative_to(BUILD.parent) else out),
                     "error": error, "device": runtime.device_name()})
    return rows


def _table(rows: list[dict], cols: list[str]) -> str:
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols}
    lines = ["  ".join(c.ljust(widths[c]) for c in cols), "  ".join("-" * widths[c] for c in cols)]
    lines += ["  ".join(str(r.get(c, "")).ljust(widths[c]) for c in cols) for r in rows]
    return "\n".join(lines)


def cmd_run(args) -> int:
    mode = "smoke" if args.smoke else "full" if args.full else ("full" if runtime.has_cuda() else "smoke")
    paths = notebook_paths(args.only)
    print(f"dsv4lab run: {len(paths)} notebook(s), mode {mode}, on {runtime.device_name()}")
    rows = run_notebooks(paths, mode=mode, out_dir=Path(args.out))
    SUMMARY.parent.mkdir(parents=True, exist_ok=True)
    previous = {}
    if SUMMARY.exists():
        previous = {r["notebook"]: r for r in json.loads(SUMMARY.read_text())}
    previous.update({r["notebook"]: r for r in rows})
    SUMMARY.write_text(json.dumps(sorted(previous.values(), key=lambda r: r["notebook"]), indent=1))
    print(_table(rows, ["notebook", "status", "seconds", "mode"]))
    for r in rows:
        if r["status"] != "pass":
            print(f"FAILED {r['notebook']}: {r['error']}")
    failed = sum(r["status"] != "pass" for r in rows)
    print(f"{len(rows) - failed} passed, {failed} failed")
    return 1 if failed else 0


def cmd_report(args) -> int:
    from dsv4lab import report
    try:
        index = report.build_report(BUILD / "notebooks", BUILD / "html")
    except FileNotFoundError as e:  # nothing executed yet
        print(f"dsv4lab report: {e} (run 'dsv4lab run' first)", file=sys.stderr)
        return 1
    print(f"report: {index}")
    return 0


def cmd_bench(args) -> int:
    from dsv4lab import bench
    names = args.names
    known = bench.registered()
    if names == ["all"]:
        names = sorted(known)
    unknown = [n for n in names if n not in known]
    if unknown:
        print(f"unknown benchmark(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}", file=sys.stderr)
        return 2
    if args.l2:
        os.environ["DSV4LAB_L2"] = args.l2      # read by dsv4lab.bench's timers
    for name in names:
        t0 = time.perf_counter()
        record = not args.no_record and (args.record or not args.smoke)
        rows = bench.run(name, smoke=args.smoke, record=record)
        print(f"bench {name}: {len(rows)} rows in {time.perf_counter() - t0:.1f} s"
              + (" (recorded)" if record else " (not recorded)"))
    return 0


def cmd_env(args) -> int:
    v = runtime.versions()
    for k, val in v.items():
        print(f"{k:12s} {val}")
    from dsv4lab import roofline
    spec = roofline.device_spec()
    print(f"{'roofline':12s} {spec.name}: {spec.bandwidth / 1e12:.2f} TB/s, {spec.bf16_flops / 1e12:.0f} TFLOP/s bf16")
    return 0


def cmd_targets(args) -> int:
    from dsv4lab import targets
    names = args.names or list(targets.BENCHES)
    unknown = [n for n in names if n not in targets.BENCHES]
    if unknown:
        print(f"unknown benchmark(s): {', '.join(unknown)}; known: {', '.join(targets.BENCHES)}", file=sys.stderr)
        return 2
    for name in names:
        print(f"== {name}" + ("" if args.l2 == "dirty" else f" (rows timed after a {args.l2} L2: "
                                                               "not the method the targets were set with)"))
        print(targets.table(name, l2=args.l2))
    return 0


def cmd_train(args, rest) -> int:
    from dsv4lab import train
    return train.main(rest) or 0


def cmd_lab(args, rest) -> int:
    from dsv4lab import lab
    return lab.main(rest) or 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dsv4lab", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run", help="execute notebooks headless with papermill into build/notebooks/")
    p.add_argument("--only", type=lambda s: [x for x in s.split(",") if x], default=None,
                   help="comma-separated notebook prefixes or names, e.g. 00,03")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--smoke", action="store_true", help="CPU-sized shapes (default without a GPU)")
    g.add_argument("--full", action="store_true", help="DeepSeek-V4-Flash shapes (default on a GPU)")
    p.add_argument("--out", default=str(BUILD / "notebooks"))
    sub.add_parser("report", help="executed notebooks to HTML under build/html/ with an index page")
    p = sub.add_parser("bench", help="run registered benchmarks and record their rows")
    p.add_argument("names", nargs="+", help="benchmark names, or 'all'")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU)")
    p.add_argument("--no-record", action="store_true", help="print only; do not append rows")
    p.add_argument("--record", action="store_true", help="also record --smoke rows (not recorded by default)")
    p.add_argument("--l2", choices=("dirty", "clean"), default=None,
                   help="L2 state before each timed call (default $DSV4LAB_L2, else dirty); see dsv4lab.bench")
    sub.add_parser("env", help="device and versions")
    p = sub.add_parser("targets", help="the issues' targets, checked against the recorded rows")
    p.add_argument("names", nargs="*", help="benchmarks (default: all)")
    p.add_argument("--l2", choices=("dirty", "clean"), default="dirty",
                   help="which rows count: timed after do_bench's zero-fill flush (dirty, the "
                        "targets' method) or after a reading flush (clean); see dsv4lab.bench")
    sub.add_parser("train", help="train the mini model (dsv4lab train --help)", add_help=False)
    sub.add_parser("lab", help="start JupyterLab on the notebooks (dsv4lab lab --help)", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.cmd == "train":
        return cmd_train(args, rest)
    if args.cmd == "lab":
        return cmd_lab(args, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return {"run": cmd_run, "report": cmd_report, "bench": cmd_bench, "env": cmd_env,
            "targets": cmd_targets}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
