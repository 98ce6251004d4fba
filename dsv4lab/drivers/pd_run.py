"""One prefill-decode run: co-located against disaggregated on the same request stream.

:func:`run` is what every process executes:

- **world size 2** (``torchrun --standalone --nproc-per-node 2 -m dsv4lab.drivers.pd_run``,
  NCCL on two GPUs with ``NCCL_NVLS_ENABLE=0``, gloo on the CPU): both ranks build the same
  model (rank 0's weights broadcast); for each arrival rate rank 0 first serves the stream
  co-located (rank 1 waits), then rank 0 is the prefill worker and rank 1 the decode worker,
  the hand-offs going over ``torch.distributed`` and timed on the link; then the link's
  bandwidth at several message sizes (:func:`dsv4lab.drivers.kv_transfer.transfer_sweep`);
- **world size 1** (no torchrun): the same, both workers in one process on one GPU, the link's
  time from the analytic model (:func:`dsv4lab.drivers.pd_model.transfer_ms` over NVLink),
  rows labelled ``link: "modelled"``.

Rates are chosen as ``loads`` of what one prefill GPU absorbs, measured first: ``1 / (ceil(P /
chunk) * t_p)`` with ``t_p`` one iteration of a full chunk alone. Rank 0 writes the rows
(co-located, disaggregated, calibration, transfer) to ``opts.out``. Options travel as JSON in
``$DSV4LAB_PD_OPTIONS`` (:func:`launch` sets it) or as flags (:func:`parse_args`).

Explained in notebooks/07_prefill_decode.ipynb.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, fields, replace

import torch
import torch.distributed as dist

from dsv4lab import runtime
from dsv4lab.drivers import kv_transfer as KV
from dsv4lab.drivers import pd_model, serving as S
from dsv4lab.drivers import tp
from dsv4lab.drivers.served_model import (CostModel, Rows, Runner, ServedModel, default_max_context, reach,
                                          size_pages)

OPTIONS_ENV = "DSV4LAB_PD_OPTIONS"
MODULE = "dsv4lab.drivers.pd_run"
CPU_BACKENDS = {"mhc": "torch", "linear": "torch"}      # the references' own projections and mixing


@dataclass(frozen=True)
class PDRunOptions:
    """What one run does (None: the default for where it runs: GPU / CPU)."""
    model: str | None = None            # "flash" / "tiny"; also "mini"
    preset: str | None = None           # "after" / "torch" (the fp32 references)
    dtype: str | None = None            # "bf16" / "fp32"
    n_requests: int = 16
    prompt_lens: tuple | None = None    # (2048, 8192) / (24,)
    output_len: int | None = None       # 64 / 6
    loads: tuple = (0.25, 0.5, 0.75)    # arrival rates as fractions of one prefill GPU's capacity
    rates: tuple | None = None          # requests per second instead of loads
    chunk: int | None = None            # prompt tokens an iteration carries: 2048 / 16
    max_batch: int = 64
    seed: int = 0
    backend: str | None = None          # "nccl" (GPUs) or "gloo" (CPU)
    graphs: bool = True                 # CUDA graphs on GPUs (False: eager iterations)
    eager_headline: bool = False        # also run the first prompt length's middle load eagerly
    budget_s: float = 1e9               # skip the points left once the run has taken this long
    cost: tuple | None = None           # (base, per decode row, per prefill row) ms instead of measuring
    transfer_sizes: tuple | None = None  # bytes (world 2; default: the payloads + 1-256 MiB on GPUs)
    out: str | None = None              # rank 0 writes the rows here (JSON list)

    def __post_init__(self):
        for name in ("prompt_lens", "loads", "rates", "cost", "transfer_sizes"):
            v = getattr(self, name)
            if v is not None:
                object.__setattr__(self, name, tuple(v))
        if self.prompt_lens is not None and (not self.prompt_lens or any(
                isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in self.prompt_lens)):
            raise ValueError(f"prompt_lens must be positive ints, got {self.prompt_lens!r}")
        for name in ("n_requests", "output_len", "chunk", "max_batch"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not self.loads or any(not (isinstance(x, (int, float)) and 0 < x) for x in self.loads):
            raise ValueError(f"loads must be positive fractions, got {self.loads!r}")
        if self.rates is not None and any(not (isinstance(x, (int, float)) and x > 0) for x in self.rates):
            raise ValueError(f"rates must be positive requests per second, got {self.rates!r}")
        if self.cost is not None and (len(self.cost) != 3 or any(x < 0 for x in self.cost)):
            raise ValueError(f"cost must be (base_ms, decode_ms, prefill_ms) >= 0, got {self.cost!r}")
        if self.dtype not in (None, "bf16", "fp32"):
            raise ValueError(f"dtype must be 'bf16' or 'fp32', got {self.dtype!r}")
        if self.backend not in (None, "nccl", "gloo"):
            raise ValueError(f"backend must be 'nccl' or 'gloo', got {self.backend!r}")
        if self.model not in (None, "flash", "mini", "tiny"):
            raise ValueError(f"model must be 'flash', 'mini' or 'tiny', got {self.model!r}")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "PDRunOptions":
        data = json.loads(text)
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"{OPTIONS_ENV}: unknown option(s) {sorted(unknown)}")
        return cls(**data)

    def resolved(self, gpu: bool) -> "PDRunOptions":
        """The defaults for a GPU run (real-size layers) or a CPU one (the tiny model)."""
        big = (self.model or ("flash" if gpu else "tiny")) == "flash"
        return replace(self, model=self.model or ("flash" if gpu else "tiny"),
                       preset=self.preset or ("after" if gpu else "torch"),
                       dtype=self.dtype or ("bf16" if gpu else "fp32"),
                       prompt_lens=self.prompt_lens or ((2048, 8192) if big else (24,)),
                       output_len=self.output_len or (64 if big else 6),
                       chunk=self.chunk or (2048 if big else 16))


def parse_args(argv=None) -> PDRunOptions:
    """Flags -> :class:`PDRunOptions` (``--loads 0.25,0.5``; ``--json '{...}'`` for the rest)."""
    p = argparse.ArgumentParser(prog=MODULE, description="co-located vs disaggregated serving")
    p.add_argument("--json", default=None, help="options as a JSON object (flags below win)")
    for f in fields(PDRunOptions):
        if f.name in ("out",):
            p.add_argument("--out", default=None)
        elif f.name in ("prompt_lens", "loads", "rates", "cost", "transfer_sizes"):
            p.add_argument(f"--{f.name.replace('_', '-')}", default=None, help="comma-separated")
        elif f.name == "graphs":
            p.add_argument("--eager", action="store_true", help="no CUDA graphs")
        elif f.name == "eager_headline":
            p.add_argument("--eager-headline", action="store_true", help="the headline point eagerly too")
        elif f.name == "budget_s":
            p.add_argument("--budget-s", type=float, default=None)
        elif f.type in ("int | None", "int"):
            p.add_argument(f"--{f.name.replace('_', '-')}", type=int, default=None)
        else:
            p.add_argument(f"--{f.name.replace('_', '-')}", default=None)
    a = p.parse_args(argv)
    base = PDRunOptions.from_json(a.json) if a.json else PDRunOptions()
    changes = {}
    for f in fields(PDRunOptions):
        if f.name in ("graphs", "eager_headline"):
            if f.name == "graphs" and a.eager:
                changes["graphs"] = False
            if f.name == "eager_headline" and a.eager_headline:
                changes["eager_headline"] = True
            continue
        v = getattr(a, f.name)
        if v is None:
            continue
        if f.name in ("loads", "rates", "cost"):
            v = tuple(float(x) for x in str(v).split(","))
        elif f.name in ("transfer_sizes", "prompt_lens"):
            v = tuple(int(x) for x in str(v).split(","))
        changes[f.name] = v
    return replace(base, **changes)


# ---- one run -------------------------------------------------------------------------------

def _runner(model, cache, opts, graphs: bool) -> Runner:
    cost = CostModel(*opts.cost) if opts.cost else None
    return Runner(model, cache, graphs=graphs, cost=cost)


def prefill_chunk_ms(runner: Runner, chunk: int, vocab: int) -> float:
    """One iteration of ``chunk`` prompt tokens alone (the second of two: the first compiles
    and captures), ms of the whole model."""
    tables = runner.cache.alloc(chunk)
    try:
        ms = 0.0
        for _ in range(2):
            rows = Rows()
            rows.add(tables, [i % vocab for i in range(chunk)], 0, True)
            ms = runner.run(rows).ms
        return ms
    finally:
        runner.cache.release(tables)


def _base_row(opts, model, spec, d, max_context, runner) -> dict:
    cfg = model.cfg
    return {
        "model": cfg.name, "preset": model.step.name, "kv_cache": model.step.kv_cache,
        "attention": model.step.attention, "indexer": model.step.indexer, "moe": model.step.moe,
        "dtype": opts.dtype, "n_requests": spec.n_requests, "prompt_len": spec.prompt_len,
        "output_len": spec.output_len, "rate": spec.rate, "chunk": opts.chunk, "max_batch": opts.max_batch,
        "max_context": max_context, "seed": spec.seed, "timing": runner.timing, "mode": runner.mode,
        "layers_measured": {str(r): i for r, i in model.driver.layer_ids.items()},
        "layer_counts": {str(r): n for r, n in model.counts.items()}, "model_layers": cfg.num_layers,
        "extrapolated": "one measured layer per attention kind, counted as the model's layers",
        "world": d.world, "backend": d.backend or "none",
        "device": runtime.device_name() if d.gpu else "cpu",
        "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
    }


def _row(kind: str, served: S.Served, base: dict, **extra) -> dict:
    row = {"kind": kind, **base, **S.summarize(served.requests)}
    row["iterations"] = len(served.iterations)
    row["mixed_iterations"] = sum(1 for it in served.iterations if it["prefill_rows"] and it["decode_rows"])
    if served.notes:
        row["timing_note"] = "; ".join(served.notes)[:400]
    row.update(extra)
    return row


def run(opts: PDRunOptions) -> int:
    """Every process (module docstring); rank 0 prints a line per row and writes the rows.
    Returns 1 if the disaggregated tokens differ from the co-located ones, else 0."""
    d = tp.init(opts.backend)
    if d.world > 2:
        raise ValueError(f"a prefill-decode run takes 1 or 2 processes, got world size {d.world}")
    opts = opts.resolved(d.gpu)
    threads = torch.get_num_threads()
    if not d.gpu:
        torch.set_num_threads(1)          # decode-sized CPU ops only pay for thread hand-offs
    try:
        return _run(opts, d)
    finally:
        torch.set_num_threads(threads)
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def _run(opts: PDRunOptions, d) -> int:
    t0 = time.perf_counter()
    say = (lambda *x: print(*x, flush=True)) if d.rank == 0 else (lambda *x: None)
    cfg = tp.model_config(opts.model)
    model = ServedModel(cfg, tp.step_config(opts.preset, cfg), device=d.device, seed=opts.seed,
                        dtype=opts.dtype, backends=CPU_BACKENDS if opts.preset == "torch" else None)
    tp.broadcast_tensors(model.tensors(), d)
    total = max(opts.prompt_lens) + opts.output_len
    max_context = default_max_context(total + 1)
    pg = model.page_size
    n_pages = size_pages(total, pg, opts.max_batch + 1, model.ratios)
    caches = {}
    if d.rank == 0:
        caches["colocated"] = model.cache(n_pages, max_context=max_context)
        caches["prefill"] = model.cache(n_pages, max_context=max_context)
    if d.rank == 1 or d.world == 1:
        held = size_pages(total, pg, 2 * opts.max_batch + 1, model.ratios,     # window pages + entries
                          first_raw_token=max(0, min(opts.prompt_lens) - reach(model.cfg, model.ratios)))
        caches["decode"] = model.cache(held, max_context=max_context)
    runners = {k: _runner(model, c, opts, opts.graphs) for k, c in caches.items()}
    say(f"pd: {cfg.name} world {d.world} backend {d.backend or 'none'} on "
        f"{runtime.device_name() if d.gpu else 'cpu'}; preset {model.step.name} (KV {model.step.kv_cache}); "
        f"NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}; built in {time.perf_counter() - t0:.1f} s")
    if d.world == 2:
        KV.warmup(1 - d.rank, d.rank, d.device)
    ctx = dict(opts=opts, model=model, d=d, max_context=max_context, say=say)
    rows, failed, last = [], False, 0.0
    for P in opts.prompt_lens:
        # calibration: what one prefill GPU absorbs at this prompt length
        info = [None]
        if d.rank == 0:
            t_p = prefill_chunk_ms(runners["prefill"], opts.chunk, cfg.vocab_size)
            cap = 1e3 / (math.ceil(P / opts.chunk) * t_p)
            rates = list(opts.rates) if opts.rates else [x * cap for x in opts.loads]
            info = [{"t_prefill_chunk_ms": t_p, "capacity_per_s": cap, "rates": rates}]
        if d.world == 2:
            dist.broadcast_object_list(info, src=0)
        cal = info[0]
        spec0 = S.StreamSpec(opts.n_requests, cal["rates"][0], P, opts.output_len, opts.seed)
        if d.rank == 0:
            base = _base_row(opts, model, spec0, d, max_context, runners["prefill"])
            rows.append({"kind": "calibration", **{k: v for k, v in base.items() if k != "rate"}, **cal})
            say(format_row(rows[-1]))
        for i, rate in enumerate(cal["rates"]):
            spent = time.perf_counter() - t0
            skip = [spent + 1.2 * last > opts.budget_s]
            if d.world == 2:
                dist.broadcast_object_list(skip, src=0)
            spec = replace(spec0, rate=rate)
            if skip[0]:
                if d.rank == 0:
                    rows.append({"kind": "skipped", "prompt_len": P, "rate": rate, "model": cfg.name,
                                 "reason": f"time budget {opts.budget_s:.0f} s spent"})
                continue
            t1 = time.perf_counter()
            modes = [opts.graphs] + ([False] if opts.eager_headline and d.gpu and opts.graphs
                                      and P == opts.prompt_lens[0] and i == len(cal["rates"]) // 2 else [])
            for graphs in modes:
                use = runners if graphs == opts.graphs else \
                    {k: _runner(model, r.cache, opts, False) for k, r in runners.items()}
                new, bad = _serve_point(spec, rate / cal["capacity_per_s"], use, **ctx)
                rows += new
                failed |= bad
                _write(rows, opts.out, d)                 # a run cut short keeps what it measured
            last = time.perf_counter() - t1
    if d.world == 2:
        sizes = opts.transfer_sizes or sorted(
            {KV.payload_bytes(next(iter(caches.values())), P) for P in opts.prompt_lens}
            | ({1 << 20, 16 << 20, 64 << 20, 256 << 20} if d.gpu else {1 << 16}))
        tr = KV.transfer_sweep(sizes, rank=d.rank, peer=1 - d.rank, device=d.device)
        tr = tp.gather(tr, d)[1]
        if d.rank == 0:
            for r in tr:
                r.update(world=2, backend=d.backend, device=runtime.device_name() if d.gpu else "cpu",
                         model_ms_nvlink=pd_model.transfer_ms(r["bytes"], "nvlink"),
                         nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"))
                rows.append(r)
                say(format_row(r))
    _write(rows, opts.out, d)
    say(f"pd: done in {time.perf_counter() - t0:.1f} s")
    return 1 if failed else 0


def _write(rows: list, path: str | None, d) -> None:
    if d.rank == 0 and path:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(rows, f, default=str)
        os.replace(tmp, path)


def _serve_point(spec, load, runners, *, opts, model, d, max_context, say) -> tuple[list, bool]:
    """Co-located then disaggregated on one request stream; rank 0's rows and whether the
    tokens differ."""
    reqs = S.request_stream(spec, model.cfg.vocab_size)
    serve = S.ServeOptions(chunk=opts.chunk, max_batch=opts.max_batch)
    rows, colo = [], None
    if d.rank == 0:
        colo = S.serve_colocated(runners["colocated"], reqs, serve)
        base = _base_row(opts, model, spec, d, max_context, runners["colocated"])
        rows.append(_row("colocated", colo, base, load=load))
        say(format_row(rows[-1]))
    if d.world == 2:
        dist.barrier()
        dis = None
        if d.rank == 0:
            sender = KV.Sender(1, d.device)
            cache = runners["prefill"].cache
            for r in S.prefill_worker(runners["prefill"], reqs, serve):
                L = len(r.prompt)
                sender.send(rid=r.rid, prompt_len=L, first_token=r.tokens[0], first_margin=r.margins[0],
                            prefill_start_ms=r.prefill_start_ms, finish_ms=r.prefill_end_ms,
                            payload=KV.extract(cache, r.tables, L))
                cache.release(r.tables)
            sender.close()
        else:
            dis = _portable(S.serve_decode(runners["decode"], S.DistHandoff(0, d.device), reqs, serve))
        dis = tp.gather(dis, d)[1]
        link = "measured"
    else:
        dis, _ = S.serve_disaggregated_local(runners["prefill"], runners["decode"], reqs, serve,
                                             transfer_ms=lambda n: pd_model.transfer_ms(n, "nvlink"))
        link = "modelled (NVLink H200, one GPU)"
    if d.rank != 0:
        return rows, False
    same = S.same_tokens(colo, dis)
    nbytes = KV.payload_bytes(runners["colocated"].cache, spec.prompt_len)
    xfer = [r.transfer_ms for r in dis.requests]
    stats = S.summarize(dis.requests)
    base = _base_row(opts, model, spec, d, max_context, runners["colocated"])
    rows.append(_row("disaggregated", dis, base, load=load, link=link, payload_bytes=nbytes,
                     transfer_gbs=(nbytes / (sum(xfer) / len(xfer) * 1e-3) / 1e9) if sum(xfer) else None,
                     model_transfer_ms_nvlink=pd_model.transfer_ms(nbytes, "nvlink"),
                     adopt_ms_mean=(sum(dis.adopt_ms) / len(dis.adopt_ms)) if dis.adopt_ms else None,
                     tokens_identical=same["identical"], requests_differing=same["requests_differing"],
                     first_difference={str(k): v for k, v in same["first_difference"].items()},
                     colocated_over_disaggregated_tpot_p50=_ratio(rows[0]["tpot_p50_ms"], stats["tpot_p50_ms"]),
                     colocated_over_disaggregated_tpot_p99=_ratio(rows[0]["tpot_p99_ms"], stats["tpot_p99_ms"])))
    say(format_row(rows[-1]))
    return rows, not same["identical"]


def _ratio(a, b):
    return a / b if a is not None and b else None


def _portable(served: S.Served) -> S.Served:
    """The decode worker's result without device tensors (to send it to rank 0)."""
    for r in served.requests:
        r.tables = None
    return served


def _f(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_row(row: dict) -> str:
    """One line per row (co-located, disaggregated, calibration, transfer)."""
    k = row.get("kind")
    if k in ("colocated", "disaggregated"):
        s = (f"{k:13s} P {row['prompt_len']:>6,} load {_f(row.get('load'), '4.2f')} rate {row['rate']:7.3f}/s  "
             f"TPOT p50 {_f(row['tpot_p50_ms'], '8.2f')} p99 {_f(row['tpot_p99_ms'], '8.2f')} ms  "
             f"TTFT p50 {row['ttft_p50_ms']:9.1f} p99 {row['ttft_p99_ms']:9.1f} ms  [{row['mode']}]")
        if k == "disaggregated":
            s += (f"  transfer {row['transfer_mean_ms']:.3f} ms ({_f(100 * (row['transfer_share_of_ttft'] or 0), '.3f')}% "
                  f"of TTFT, {row['link']})  tokens {'identical' if row['tokens_identical'] else 'DIFFER'}")
        return s
    if k == "transfer":
        return (f"transfer {row['bytes']:>12,} B  {row['ms']:8.3f} ms  {row['gbs']:7.1f} GB/s  "
                f"(NVLink model {row['model_ms_nvlink']:.3f} ms)")
    if k == "calibration":
        return (f"calibration P {row['prompt_len']:,}: a {row['chunk']}-token chunk alone "
                f"{row['t_prefill_chunk_ms']:.1f} ms, one prefill GPU absorbs {row['capacity_per_s']:.3f} requests/s")
    if k == "skipped":
        return f"skipped P {row['prompt_len']:,} rate {row['rate']:.3f}: {row['reason']}"
    return str(row)


# ---- launching a torchrun world ----------------------------------------------------------------

def torchrun_command(nproc: int = 2) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node N -m dsv4lab.drivers.pd_run``."""
    if nproc not in (1, 2):
        raise ValueError(f"nproc must be 1 or 2, got {nproc!r}")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", MODULE]


def launch(opts: PDRunOptions, *, nproc: int = 2, timeout: float = 600, verbose: bool = True) -> list[dict]:
    """Run one torchrun world; return rank 0's rows, or one error row."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        env = dict(os.environ, NCCL_NVLS_ENABLE="0", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        env[OPTIONS_ENV] = replace(opts, out=out).to_json()
        t0 = time.perf_counter()
        try:
            p = subprocess.run(torchrun_command(nproc), env=env, capture_output=True, text=True, timeout=timeout)
            rc, text = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            rc, text = "timeout", f"{e.stdout or ''}{e.stderr or ''}"
            text = text.decode() if isinstance(text, bytes) else text
        wall = time.perf_counter() - t0
        if verbose:
            for line in text.splitlines():
                if line.startswith(("pd:", "colocated", "disaggregated", "transfer", "calibration")):
                    print(line, flush=True)
        rows = []
        if os.path.exists(out):
            with open(out) as f:
                rows = json.load(f)
        if (rc != 0 and not rows) or rc not in (0, 1):
            tail = "\n".join(text.strip().splitlines()[-15:])
            rows.append({"kind": "error", "world": nproc, "error": f"rc {rc}: {tail}"[-1500:]})
        command = " ".join(["torchrun", "--standalone", f"--nproc-per-node={nproc}", "-m", MODULE])
        for r in rows:
            r.setdefault("wall_s", wall)
            r["command"] = command
            r["pd_options"] = asdict(replace(opts, out=None))
        return rows


if __name__ == "__main__":
    options = PDRunOptions.from_json(os.environ[OPTIONS_ENV]) if OPTIONS_ENV in os.environ else parse_args()
    sys.exit(run(options))
