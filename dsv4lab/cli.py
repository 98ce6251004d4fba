"""The ``dsv4lab`` command: every verb's arguments are parsed here, and each verb calls one
function of the module that does the work.

    dsv4lab run [--only 00,03] [--smoke | --full]   execute the notebooks headless
    dsv4lab report                                  the executed notebooks as HTML, with an index
    dsv4lab bench NAME... [--smoke] [--record]      run benchmarks and record their rows
                [--checkpoint DIR --layers 2,3,4]   (step: a checkpoint's real layers)
    dsv4lab env                                     device, versions, roofline, kernels per GPU
    dsv4lab targets [NAME...]                       the campaign's goals against the recorded rows
    dsv4lab train [--steps N | --minutes M] ...     train the mini model and its MTP layer
    dsv4lab lab [--port P]                          JupyterLab on the notebooks
    dsv4lab tp [--nproc N] ...                      tensor-parallel decode of real-size layers

Explained in notebooks/00_tour.ipynb.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
import traceback
from pathlib import Path

from dsv4lab import runtime

REPO_ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO_ROOT / "notebooks"
BUILD = REPO_ROOT / "build"
SUMMARY = BUILD / "notebooks" / "summary.json"
# the kernels' own log, not the notebook's: ipykernel warns at every start that its TCP
# sockets are not encrypted (they listen on 127.0.0.1 only)
KERNEL_ARGS = ["--IPKernelApp.log_level=ERROR"]


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (and exit status 2)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _fail(prog: str, message: str, status: int = 2) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return status


# ---------------------------------------------------------------------------- run, report
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
                                log_output=False, extra_arguments=KERNEL_ARGS)
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
    if args.full and not runtime.has_cuda():
        return _fail("dsv4lab run", "--full needs a CUDA GPU (DeepSeek-V4-Flash's shapes); "
                                    "without one, run --smoke (the default here)")
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
        index = report.build_report(BUILD / "notebooks", BUILD / "html", NOTEBOOKS)
    except FileNotFoundError as e:  # nothing executed yet
        print(f"dsv4lab report: {e} (run 'dsv4lab run' first)", file=sys.stderr)
        return 1
    print(f"report: {index}")
    return 0


# ---------------------------------------------------------------------------- bench
def _benchmarks():
    """(registered, unavailable) once every definition module has been imported."""
    from dsv4lab import benchmarks
    return benchmarks.registered(), benchmarks.unavailable()


def bench_listing() -> str:
    """One line per benchmark: its name and description (or why it cannot be imported)."""
    known, broken = _benchmarks()
    width = max((len(n) for n in [*known, *broken]), default=0)
    lines = [f"  {n.ljust(width)}  {known[n].description}" for n in sorted(known)]
    lines += [f"  {n.ljust(width)}  (cannot be imported: {why})" for n, why in sorted(broken.items())]
    return "benchmarks:\n" + "\n".join(lines) + "\n  " + "all".ljust(width) + "  every benchmark above"


def cmd_bench(args) -> int:
    from dsv4lab import bench
    known, broken = _benchmarks()
    names = sorted(known) if args.names == ["all"] else args.names
    if not names:
        print(bench_listing())
        return 2
    unknown = [n for n in names if n not in known and n not in broken]
    if unknown:
        print(f"unknown benchmark(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}", file=sys.stderr)
        return 2
    smoke = args.smoke
    if not smoke and not runtime.has_cuda():
        print("no CUDA GPU here: running in smoke mode (tiny shapes in Triton's interpreter; "
              "pass --smoke to say so, --record to keep the rows)")
        smoke = True
    if args.l2:
        os.environ["DSV4LAB_L2"] = args.l2      # read by dsv4lab.bench's timers
    record = not args.no_record and (args.record or not smoke)
    # options a benchmark takes as keyword arguments (its function's parameters say which)
    options = {k: v for k, v in (("checkpoint", args.checkpoint), ("layers", args.layers)) if v is not None}
    for name in names:
        if options and name in known:
            takes = inspect.signature(known[name].fn).parameters
            refused = [k for k in options if k not in takes]
            if refused:
                print(f"bench {name} takes no --{refused[0]} (it applies to: step)", file=sys.stderr)
                return 2
    failed = 0
    for name in names:
        if name in broken:
            print(f"bench {name}: cannot be imported: {broken[name]}", file=sys.stderr)
            failed += 1
            continue
        t0 = time.perf_counter()
        try:
            rows = bench.run(name, smoke=smoke, record=record, **options)
        except Exception as e:  # one line per failed benchmark; --traceback shows where
            if args.traceback:
                traceback.print_exc()
            print(f"bench {name} failed: {type(e).__name__}: {e}"
                  + ("" if args.traceback else " (--traceback shows where)"), file=sys.stderr)
            failed += 1
            continue
        print(f"bench {name}: {len(rows)} rows in {time.perf_counter() - t0:.1f} s"
              + (" (recorded)" if record else " (not recorded)"))
    return 1 if failed else 0


# ---------------------------------------------------------------------------- env, targets
def dispatch_text() -> str:
    """What "auto" runs on each capability the kernels are checked for, op by op."""
    import dsv4lab.ops  # noqa: F401  (registers every op's backends)
    from dsv4lab import backends
    tables, missing = backends.family_tables()
    text = backends.format_capability_table(backends.capability_table(tables=tables))
    if missing:
        text += "\n  (no dispatch table: " + "; ".join(f"{m}: {why}" for m, why in missing.items()) + ")"
    return ('kernels by GPU ("auto" backend, then the family\'s kernels in the order they are tried; '
            "* runs at the default shape):\n" + text)


def cmd_env(args) -> int:
    for k, val in runtime.versions().items():
        print(f"{k:12s} {val}")
    from dsv4lab import roofline
    print(f"{'roofline':12s} {roofline.device_spec().describe()}")
    print(dispatch_text())
    return 0


def cmd_targets(args) -> int:
    from dsv4lab import targets
    names = args.names or list(targets.BENCHES)
    unknown = [n for n in names if n not in targets.BENCHES]
    if unknown:
        print(f"unknown benchmark(s): {', '.join(unknown)}; known: {', '.join(targets.BENCHES)}", file=sys.stderr)
        return 2
    for name in names:
        views = [] if args.l2 == "dirty" else [f"rows timed after a {args.l2} L2"]
        views += [] if args.mode == "graph" else [f"{args.mode} rows"]
        print(f"== {name}" + (f" ({', '.join(views)}: not the method the goals were set with)" if views else ""))
        print(targets.table(name, l2=args.l2, mode=args.mode))
    print(dispatch_text())
    return 0


# ---------------------------------------------------------------------------- train, lab, tp
def cmd_train(args) -> int:
    from dsv4lab import train
    try:
        return train.run(train.Settings.from_args(args))
    except train.SettingsError as e:
        return _fail("dsv4lab train", str(e))


def cmd_lab(args) -> int:
    from dsv4lab import lab
    root = Path(args.notebook_dir)
    if not root.is_dir():
        return _fail("dsv4lab lab", f"--notebook-dir {root} is not a folder")
    if args.port < 0 or args.port > 65535:
        return _fail("dsv4lab lab", f"--port must be in 0..65535, got {args.port}")
    return lab.start(root, port=args.port, token=args.token, browser=args.browser,
                     install_kernel=not args.no_kernel_install, dry_run=args.dry_run)


def _ints(flag: str):
    def parse(s: str) -> tuple[int, ...]:
        try:
            out = tuple(int(x) for x in s.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes comma-separated integers, got {s!r}") from None
        if not out:
            raise argparse.ArgumentTypeError(f"{flag} takes at least one integer")
        return out
    return parse


def cmd_tp(args) -> int:
    from dsv4lab.drivers import tp_run
    try:
        opts = tp_run.TPRunOptions(
            model=args.model, preset=args.preset, concurrency=args.concurrency, context=args.context,
            max_context=args.max_context, kinds=args.kinds, backend=args.backend, dtype=args.dtype,
            reps=args.reps, check=args.check, timing=not args.no_timing,
            allreduce_sizes=args.allreduce_sizes, out=None if args.nproc is not None else args.out)
    except ValueError as e:
        return _fail("dsv4lab tp", str(e))
    if args.nproc is None:             # this process is the world (or one rank under torchrun)
        return tp_run.run(opts)
    if args.nproc < 1:
        return _fail("dsv4lab tp", f"--nproc must be >= 1, got {args.nproc}")
    rows = tp_run.launch(args.nproc, opts)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, default=str))
    bad = [r for r in rows if r.get("kind") == "error" or r.get("check_ok") is False]
    return 1 if bad else 0


# ---------------------------------------------------------------------------- the parser
def build_parser(*, list_benchmarks: bool = False) -> Parser:
    """The command's parser; ``list_benchmarks`` puts the benchmark names into ``bench --help``
    (it imports every benchmark definition, so only ``bench`` asks for it)."""
    parser = Parser(prog="dsv4lab", formatter_class=argparse.RawDescriptionHelpFormatter,
                    description="DeepSeek-V4-Flash decode, made fast kernel by kernel: a runnable workbook.",
                    epilog="Start with notebooks/00_tour.ipynb (`dsv4lab lab`). "
                           "`dsv4lab VERB --help` describes a verb's options.")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="VERB", parser_class=Parser)

    p = sub.add_parser("run", help="execute the notebooks headless (papermill) into build/notebooks/")
    p.add_argument("--only", type=lambda s: [x for x in s.split(",") if x], default=None,
                   help="comma-separated notebook prefixes or names, e.g. 00,03")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--smoke", action="store_true", help="CPU-sized shapes (default without a GPU)")
    g.add_argument("--full", action="store_true", help="DeepSeek-V4-Flash shapes (default on a GPU)")
    p.add_argument("--out", default=str(BUILD / "notebooks"), help="folder for the executed notebooks")

    sub.add_parser("report", help="the executed notebooks as HTML in build/html/, with an index")

    p = sub.add_parser("bench", help="run benchmarks by name; record their rows in data/results/",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=bench_listing() if list_benchmarks else None,
                       description="Run benchmarks. On a GPU at DeepSeek-V4-Flash's shapes, rows recorded; "
                                   "without one in smoke mode (tiny shapes, not recorded).")
    p.add_argument("names", nargs="*", help="benchmark names (listed below), or 'all'")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (the default without a GPU)")
    p.add_argument("--no-record", action="store_true", help="print only; do not append rows")
    p.add_argument("--record", action="store_true", help="also record --smoke rows (not recorded by default)")
    p.add_argument("--l2", choices=("dirty", "clean"), default=None,
                   help="L2 state before each timed call (default $DSV4LAB_L2, else dirty); see dsv4lab.bench")
    p.add_argument("--traceback", action="store_true", help="show where a failing benchmark failed")
    p.add_argument("--checkpoint", metavar="DIR", default=None,
                   help="step: run the real layers of a checkpoint in the released layout (config.json, "
                        "model.safetensors.index.json, shards)")
    p.add_argument("--layers", metavar="LIST", default=None,
                   help="step, with --checkpoint: the layers to measure, e.g. 2,3,4 (default: one of each kind)")

    sub.add_parser("env", help="device, versions, roofline, and the kernel each op runs per GPU")

    p = sub.add_parser("targets", help="the campaign's goals checked against the recorded rows")
    p.add_argument("names", nargs="*", help="benchmarks (default: all)")
    p.add_argument("--l2", choices=("dirty", "clean"), default="dirty",
                   help="which rows count: timed after do_bench's zero-fill flush (dirty, the goals' "
                        "method) or after a reading flush (clean); see dsv4lab.bench")
    p.add_argument("--mode", choices=("graph", "eager"), default="graph",
                   help="graph replays (the goals' method) or the eager calls, host included")

    p = sub.add_parser("train", help="train the mini DeepSeek-V4 and its MTP layer")
    p.add_argument("--minutes", type=float, default=None, help="time budget (default 2.5 unless --steps)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (>= 1)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: the lab's device)")
    p.add_argument("--out", default=None, help="checkpoint path (.safetensors; default data/checkpoints/mini.safetensors)")
    p.add_argument("--log", default=None, help="JSON log path (default: next to --out)")
    p.add_argument("--config", default="mini", choices=["mini", "tiny"])
    p.add_argument("--layers", type=int, default=8,
                   help="main layers of the mini config (>= 2; default 8: [0,0]+[4,128]*3, Flash's pattern)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (>= 1; default 64 on GPU, 8 on CPU)")
    p.add_argument("--seq", type=int, default=None, help="bytes per sequence (>= 8; default 512 on GPU, 256 on CPU)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (> 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-files", type=int, default=None, help="use only the first N files (quick runs)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    p.add_argument("--quiet", action="store_true")

    p = sub.add_parser("lab", help="JupyterLab on the notebooks (127.0.0.1), dsv4lab kernel")
    p.add_argument("--port", type=int, default=8888, help="port on 127.0.0.1 (0: any free port)")
    p.add_argument("--token", default=None, help="access token (default: a random one)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--no-browser", dest="browser", action="store_false", help="do not open a browser (default)")
    g.add_argument("--browser", dest="browser", action="store_true", help="open the default browser")
    p.set_defaults(browser=False)
    p.add_argument("--notebook-dir", default=str(NOTEBOOKS), help="folder JupyterLab opens (default: notebooks/)")
    p.add_argument("--no-kernel-install", action="store_true", help="skip registering the dsv4lab kernel")
    p.add_argument("--dry-run", action="store_true", help="print the URL and the command, start nothing")

    p = sub.add_parser("tp", help="tensor-parallel decode of real-size layers",
                       description="Tensor-parallel decode step. --nproc N starts a torchrun world of N ranks; "
                                   "without it this process runs (world size 1, or one rank under torchrun).")
    p.add_argument("--nproc", type=int, default=None, help="ranks to launch with torchrun (NCCL on GPUs, gloo on the CPU)")
    p.add_argument("--model", default=None, choices=("flash", "mini", "tiny"),
                   help="default flash on GPUs, mini on the CPU")
    p.add_argument("--preset", default=None, help="a step preset (default 'after' on GPUs) or 'torch' (the references)")
    p.add_argument("--concurrency", type=_ints("--concurrency"), default=(1, 8, 64), help="e.g. 1,8,64")
    p.add_argument("--context", type=int, default=None, help="tokens per request (default 512; mini 40)")
    p.add_argument("--max-context", type=int, default=None)
    p.add_argument("--kinds", type=_ints("--kinds"), default=None, help="compress ratios to build, e.g. 4 (default: all)")
    p.add_argument("--backend", default=None, choices=("nccl", "gloo"))
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--reps", type=int, default=None, help="timed replays")
    p.add_argument("--check", action="store_true", help="compare with world size 1 (keeps the full weights)")
    p.add_argument("--no-timing", action="store_true", help="skip the step timing (with --check: check only)")
    p.add_argument("--allreduce-sizes", type=_ints("--allreduce-sizes"), default=None,
                   help="bytes, comma-separated (default: the step's messages + 1 MiB..256 MiB on GPUs)")
    p.add_argument("--out", default=None, help="write the rows (JSON list) here")
    return parser


COMMANDS = {"run": cmd_run, "report": cmd_report, "bench": cmd_bench, "env": cmd_env,
            "targets": cmd_targets, "train": cmd_train, "lab": cmd_lab, "tp": cmd_tp}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    verb = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(list_benchmarks=verb == "bench").parse_args(argv)
    return COMMANDS[args.cmd](args) or 0


if __name__ == "__main__":
    sys.exit(main())
