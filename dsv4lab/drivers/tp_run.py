"""One tensor-parallel run: build, check, time, measure the all-reduce, write the rows.

:func:`run` is what every rank of a torchrun world executes; :func:`launch` starts such a
world (``torchrun --standalone --nproc-per-node N -m dsv4lab.drivers.tp_run``) and returns
rank 0's rows. The run is described by :class:`TPRunOptions`, which travel to the ranks as
JSON in the environment variable ``DSV4LAB_TP_OPTIONS`` (torchrun passes the environment to
every rank). Parsing command-line flags into options is the CLI's job.

Explained in notebooks/06_decode_step_at_scale.ipynb ("Tensor parallelism").
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, fields, replace

import torch
import torch.distributed as dist

from dsv4lab import runtime
from dsv4lab.drivers.analytic import ACT_BYTES
from dsv4lab.drivers.tp import (COMPONENTS, GROUPS, TPDriver, allreduce_sweep, check, gather, init,
                                model_config, profile, step_config, step_row)

OPTIONS_ENV = "DSV4LAB_TP_OPTIONS"
MODULE = "dsv4lab.drivers.tp_run"


@dataclass(frozen=True)
class TPRunOptions:
    """What one TP run does (None: the default for where it runs)."""
    model: str | None = None                  # "flash" (default on GPUs), "mini" (default on the CPU), "tiny"
    preset: str | None = None                 # a step preset ("after" on GPUs) or "torch" (the references, CPU)
    concurrency: tuple = (1, 8, 64)           # requests decoding together, one row each
    context: int | None = None                # tokens per request (default 512; 40 below 1024 hidden)
    max_context: int | None = None            # the preset's when None
    kinds: tuple | None = None                # compress ratios to build, e.g. (4,) (default: all)
    backend: str | None = None                # "nccl" (GPUs) or "gloo" (CPU)
    dtype: str = "bf16"                       # "bf16" or "fp32" (exact CPU checks)
    reps: int | None = None                   # timed replays (10 on GPUs, 3 on the CPU)
    check: bool = False                       # compare with world size 1 (keeps the full weights)
    timing: bool = True                       # False: skip the step timing (check only)
    allreduce_sizes: tuple | None = None      # bytes (default: the step's messages + 1-256 MiB on GPUs)
    out: str | None = None                    # rank 0 writes the rows here (JSON list)

    def __post_init__(self):
        for name in ("concurrency", "kinds", "allreduce_sizes"):
            v = getattr(self, name)
            if v is not None:
                object.__setattr__(self, name, tuple(v))
        if not self.concurrency or any(not isinstance(c, int) or c < 1 for c in self.concurrency):
            raise ValueError(f"concurrency must be positive ints, got {self.concurrency!r}")
        for name in ("context", "max_context", "reps"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive int or None, got {v!r}")
        if self.dtype not in ("bf16", "fp32"):
            raise ValueError(f"dtype must be 'bf16' or 'fp32', got {self.dtype!r}")
        if self.backend not in (None, "nccl", "gloo"):
            raise ValueError(f"backend must be 'nccl' or 'gloo', got {self.backend!r}")
        if self.allreduce_sizes is not None and any(not isinstance(s, int) or s < 1 for s in self.allreduce_sizes):
            raise ValueError(f"allreduce_sizes must be positive byte counts, got {self.allreduce_sizes!r}")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "TPRunOptions":
        data = json.loads(text)
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"{OPTIONS_ENV}: unknown option(s) {sorted(unknown)}")
        return cls(**data)


def format_row(row: dict) -> str:
    """One line per row (measured step, all-reduce, analytic)."""
    k = row.get("kind")
    if k == "measured":
        sh = " ".join(f"{g[:6]} {sum(row[f'ms_{c}'] for c in cs):8.3f}" for g, cs in GROUPS.items())
        chk = ""
        if "check_rel_err" in row:
            chk = f"  check max err {max(row['check_rel_err'].values()):.1e} ({'ok' if row['check_ok'] else 'FAIL'})"
        return (f"TP{row['tp']} {row['preset']:8s} c{row['concurrency']:<3d} ctx {row['context']:>6,} "
                f"step {row['step_ms']:9.3f} ms  [{sh}]  all-reduce {100 * (row['allreduce_share'] or 0):4.1f}% "
                f"(NVLink model {row['model_allreduce_ms_nvlink']:.3f} ms) [{row['timing']}]{chk}")
    if k == "allreduce":
        if row.get("busbw_gbs") is None:
            return f"TP{row['tp']} all-reduce {row['bytes']:>11,} B  {row.get('note', '')}"
        return (f"TP{row['tp']} all-reduce {row['bytes']:>11,} B  {row['us']:9.1f} us  algbw "
                f"{row['algbw_gbs']:7.1f} GB/s  busbw {row['busbw_gbs']:7.1f} GB/s "
                f"({100 * row['busbw_fraction_nvlink']:5.1f}% of NVLink 450/dir)  model {row['model_nvlink_us']:.1f} us")
    if k == "analytic":
        return (f"model {row['link']:16s} TP{row['tp']} c{row['concurrency']:<3d} step {row['step_ms']:8.3f} ms "
                f"{row['tokens_per_s']:9.1f} tok/s  all-reduce {row['ms_all-reduce']:.3f} ms "
                f"({100 * row['allreduce_share']:4.1f}%)")
    return str(row)


def run(opts: TPRunOptions) -> int:
    """Every rank: build the sharded layers, then per concurrency check (``opts.check``) and
    time the step, then the all-reduce sweep; rank 0 prints a line per row and writes the rows
    to ``opts.out``. Returns 1 if a check failed, else 0."""
    d = init(opts.backend)
    t0 = time.perf_counter()
    cfg = model_config(opts.model or ("flash" if d.gpu else "mini"))
    sc = step_config(opts.preset or ("after" if d.gpu else "torch"), cfg, opts.max_context)
    context = opts.context or (512 if cfg.hidden_size >= 1024 else 40)
    dtype = torch.float32 if opts.dtype == "fp32" else torch.bfloat16
    drv = TPDriver(cfg, d, kinds=opts.kinds, dtype=dtype, keep_full=opts.check)
    say = (lambda *x: print(*x, flush=True)) if d.rank == 0 else (lambda *x: None)
    say(f"tp: {cfg.name} TP{d.world} backend {d.backend or 'none (single process)'} on "
        f"{runtime.device_name() if d.gpu else 'cpu'}; layers {dict(drv.driver.layer_ids)}; preset {sc.name}; "
        f"NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}; built in {time.perf_counter() - t0:.1f} s")
    rows = []
    for c in opts.concurrency:
        st = drv.prepare(sc, batch=c, context=context)
        errors = None
        if opts.check:
            errors = check(drv, st)
            st = drv.prepare(sc, batch=c, context=context)    # fresh caches for the timing
        if opts.timing:
            prof = profile(drv, st, reps=opts.reps)
        else:
            prof = {"kind_ms": {r: {k: 0.0 for k in COMPONENTS} for r in drv.layers}, "timing": "none",
                    "mode": "none", "reps": 0}
        profs = gather(prof, d)
        if d.rank == 0:
            row = step_row(drv, st, profs, errors=errors)
            rows.append(row)
            say(format_row(row))
        del st
        if d.gpu:
            torch.cuda.empty_cache()
    sizes = opts.allreduce_sizes or sorted(
        {c * cfg.hidden_size * ACT_BYTES for c in opts.concurrency}
        | ({1 << 20, 16 << 20, 64 << 20, 256 << 20} if d.gpu else {1 << 16}))
    ar = allreduce_sweep(sizes, d)
    if d.rank == 0:
        for r in ar:
            say(format_row(r))
        rows += ar
        if opts.out:
            with open(opts.out, "w") as f:
                json.dump(rows, f, default=str)
    say(f"tp: TP{d.world} done in {time.perf_counter() - t0:.1f} s")
    failed = [r for r in rows if r.get("check_ok") is False]
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 1 if failed else 0


def torchrun_command(nproc: int) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node N -m dsv4lab.drivers.tp_run``."""
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a positive int, got {nproc!r}")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", MODULE]


def launch(nproc: int, opts: TPRunOptions, *, timeout: float = 300, verbose: bool = True) -> list[dict]:
    """Run one TP world of ``nproc`` ranks; return its rows (rank 0's), or one error row."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        run_opts = replace(opts, out=out)
        env = dict(os.environ, NCCL_NVLS_ENABLE="0", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        env[OPTIONS_ENV] = run_opts.to_json()
        cmd = torchrun_command(nproc)
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
            rc, text = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            rc, text = "timeout", f"{e.stdout or ''}{e.stderr or ''}"
            text = text.decode() if isinstance(text, bytes) else text
        wall = time.perf_counter() - t0
        if verbose:
            for line in text.splitlines():
                if line.startswith(("TP", "tp:", "model ")):
                    print(line, flush=True)
        rows = []
        if os.path.exists(out):
            with open(out) as f:
                rows = json.load(f)
        if (rc != 0 and not rows) or rc not in (0, 1):
            tail = "\n".join(text.strip().splitlines()[-15:])
            if verbose:
                print(f"TP{nproc} launch failed (rc {rc}):\n{tail}", flush=True)
            rows.append({"kind": "error", "tp": nproc, "error": f"rc {rc}: {tail}"[-1500:], "wall_s": wall})
        command = " ".join(["torchrun", "--standalone", f"--nproc-per-node={nproc}", "-m", MODULE])
        for r in rows:
            r.setdefault("wall_s", wall)
            r["command"] = command
            r["tp_options"] = asdict(replace(opts, out=None))
        return rows


if __name__ == "__main__":
    if OPTIONS_ENV not in os.environ:
        sys.exit(f"{MODULE} runs under torchrun with its options in ${OPTIONS_ENV} "
                 "(see dsv4lab.drivers.tp_run.launch)")
    sys.exit(run(TPRunOptions.from_json(os.environ[OPTIONS_ENV])))
