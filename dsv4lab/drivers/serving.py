"""Serving a stream of requests: prefill and decode on one GPU, or on two.

The campaign split prefill and decode onto different GPUs and measured ~2.7x lower time per
output token (TPOT): a long prompt stops stalling the decode batch. This module replays that
with the lab's own paged model (:mod:`dsv4lab.drivers.served_model`).

- **The request stream** (:func:`request_stream`): ``n_requests`` arrivals of a Poisson
  process at ``rate`` per second, each a random prompt of ``prompt_len`` tokens that wants
  ``output_len`` tokens (greedy).
- **Co-located** (:func:`serve_colocated`), as serving engines run one GPU: every iteration
  carries one row per decoding request and, while prompts wait, a **chunk** of up to
  ``chunk`` prompt tokens (first come first served, a prompt may span iterations and a chunk
  several prompts). A decode step that carries a chunk takes as long as the chunk: that is
  the interference.
- **Disaggregated**: a prefill worker (:func:`prefill_worker`: chunks only) hands each
  finished prompt's cache to a decode worker (:func:`serve_decode`: decode rows only), over
  ``torch.distributed`` (:mod:`dsv4lab.drivers.kv_transfer`, two processes:
  :mod:`dsv4lab.drivers.pd_run`) or, in one process, through :class:`LocalHandoff` (the
  link's time from :mod:`dsv4lab.drivers.pd_model`: one GPU can emulate the schedule, not
  the link).

Time is **virtual**: each worker keeps a clock that advances by each iteration's time as
measured on the GPU and extrapolated to the 43-layer model (or a
:class:`~dsv4lab.drivers.served_model.CostModel`), and a
request is admitted when the clock passes its arrival. So two workers in two processes need
no common wall clock, and one GPU can stand in for two. A hand-off starts when the prompt is
done, the link is free and the decode worker has room; it ends ``transfer_ms`` later (as
measured on the link), when the request joins the decode batch.

What the statistics mean (:func:`summarize`): TTFT = arrival to the first output token being
available where the tokens stream from (co-located: the end of the prompt's last chunk;
disaggregated: the hand-off's end, so the transfer is part of it); TPOT = (last token's time
- first token's time) / (tokens - 1) per request; ITL = the gaps between one request's
tokens. Percentiles interpolate linearly between ranks (numpy's default).

Explained in notebooks/07_prefill_decode.ipynb.
"""
from __future__ import annotations

import heapq
import math
import statistics
from collections import deque
from dataclasses import dataclass, field

import torch

from dsv4lab.drivers import kv_transfer as KV
from dsv4lab.drivers.served_model import Rows, Runner, wall_ms


# ---- the request stream ----------------------------------------------------------------------

@dataclass(frozen=True)
class StreamSpec:
    """``n_requests`` Poisson arrivals at ``rate`` per second (virtual time), prompts of
    ``prompt_len`` random tokens, ``output_len`` tokens each."""
    n_requests: int = 16
    rate: float = 1.0
    prompt_len: int = 2048
    output_len: int = 64
    seed: int = 0

    def __post_init__(self):
        for name in ("n_requests", "prompt_len", "output_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not (isinstance(self.rate, (int, float)) and math.isfinite(self.rate) and self.rate > 0):
            raise ValueError(f"rate must be a positive number of requests per second, got {self.rate!r}")


@dataclass
class Request:
    """One request and what happened to it (times in virtual ms)."""
    rid: int
    arrival_ms: float
    prompt: list
    max_new: int
    tokens: list = field(default_factory=list)
    token_ms: list = field(default_factory=list)
    margins: list = field(default_factory=list)      # top-2 logit gap behind each token
    prefill_start_ms: float | None = None
    prefill_end_ms: float | None = None
    transfer_ms: float = 0.0
    progress: int = 0
    tables: object = None

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.max_new

    @property
    def ttft_ms(self) -> float:
        return self.token_ms[0] - self.arrival_ms

    @property
    def tpot_ms(self) -> float | None:
        n = len(self.token_ms)
        return (self.token_ms[-1] - self.token_ms[0]) / (n - 1) if n > 1 else None

    def fresh(self) -> "Request":
        return Request(self.rid, self.arrival_ms, list(self.prompt), self.max_new)


def request_stream(spec: StreamSpec, vocab_size: int) -> list[Request]:
    """The requests of ``spec``, in arrival order (the same on every process for a seed)."""
    g = torch.Generator().manual_seed(spec.seed)
    gaps = torch.empty(spec.n_requests, dtype=torch.float64).exponential_(spec.rate, generator=g)
    arrivals = (gaps.cumsum(0) * 1e3).tolist()
    prompts = torch.randint(0, vocab_size, (spec.n_requests, spec.prompt_len), generator=g).tolist()
    return [Request(i, arrivals[i], prompts[i], spec.output_len) for i in range(spec.n_requests)]


@dataclass(frozen=True)
class ServeOptions:
    """``chunk``: prompt tokens an iteration carries; ``max_batch``: requests decoding (and
    prefilling) at once; ``max_pending``: handed-off requests a decode worker holds before they
    join the batch (None: ``max_batch``)."""
    chunk: int = 2048
    max_batch: int = 64
    max_pending: int | None = None

    def __post_init__(self):
        for name in ("chunk", "max_batch"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.max_pending is not None and (not isinstance(self.max_pending, int) or self.max_pending < 1):
            raise ValueError(f"max_pending must be a positive int or None, got {self.max_pending!r}")


# ---- statistics -------------------------------------------------------------------------------

def percentile(values, q: float) -> float:
    """The ``q``-th percentile (0..100), linear between ranks (numpy's default method)."""
    xs = sorted(float(v) for v in values)
    if not xs:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must lie in [0, 100], got {q}")
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(requests) -> dict:
    """TTFT, TPOT (per request) and ITL (per gap) p50 / p99 / mean in ms, output tokens per
    second of virtual time, and the requests counted (module docstring)."""
    reqs = [r for r in requests if r.token_ms]
    if not reqs:
        raise ValueError("no request produced a token")
    ttft = [r.ttft_ms for r in reqs]
    tpot = [r.tpot_ms for r in reqs if r.tpot_ms is not None]
    itl = [b - a for r in reqs for a, b in zip(r.token_ms, r.token_ms[1:])]
    out = {"requests": len(reqs), "output_tokens": sum(len(r.tokens) for r in reqs)}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        if xs:
            out.update({f"{name}_p50_ms": percentile(xs, 50), f"{name}_p99_ms": percentile(xs, 99),
                        f"{name}_mean_ms": statistics.fmean(xs)})
        else:
            out.update({f"{name}_p50_ms": None, f"{name}_p99_ms": None, f"{name}_mean_ms": None})
    span = max(r.token_ms[-1] for r in reqs) - min(r.arrival_ms for r in reqs)
    out["makespan_ms"] = span
    out["output_tokens_per_s"] = out["output_tokens"] * 1e3 / span if span > 0 else None
    transfer = [r.transfer_ms for r in reqs]
    out["transfer_mean_ms"] = statistics.fmean(transfer)
    out["transfer_share_of_ttft"] = statistics.fmean(r.transfer_ms / r.ttft_ms for r in reqs if r.ttft_ms > 0) \
        if any(r.ttft_ms > 0 for r in reqs) else None
    return out


# ---- co-located: chunked prefill interleaved with decode ------------------------------------------

@dataclass
class Served:
    """What a serving run returns: its requests (with their tokens and times) and one entry per
    iteration (start, ms, decode rows, prefill rows)."""
    requests: list
    iterations: list
    timing: str
    mode: str
    notes: list = field(default_factory=list)
    adopt_ms: list = field(default_factory=list)       # decode worker: writing each hand-off in

    def tokens(self) -> dict:
        return {r.rid: list(r.tokens) for r in self.requests}


def _admit_arrivals(reqs, i: int, now: float, waiting: deque) -> int:
    while i < len(reqs) and reqs[i].arrival_ms <= now:
        waiting.append(reqs[i])
        i += 1
    return i


def _add_chunk(rows: Rows, prefilling: list, budget: int, max_finishers: int) -> list:
    """Fill ``budget`` prompt tokens first come first served; returns [(request, tokens taken)]."""
    taken, finishers = [], 0
    for r in prefilling:
        if budget <= 0:
            break
        n = min(budget, len(r.prompt) - r.progress)
        finishes = r.progress + n == len(r.prompt)
        if finishes:
            if finishers == max_finishers:
                break
            finishers += 1
        rows.add(r.tables, r.prompt[r.progress:r.progress + n], r.progress, finishes)
        taken.append((r, n))
        budget -= n
    return taken


def _iterate(runner: Runner, decoding: list, taken_fn, now: float, log: list):
    """Run one iteration: decode rows of ``decoding``, then the chunk ``taken_fn(rows)`` adds.
    Returns (new clock, (token, margin) of each decode row, [(request, taken, (token, margin)
    or None)])."""
    rows = Rows()
    for r in decoding:
        rows.add(r.tables, [r.tokens[-1]], len(r.prompt) + len(r.tokens) - 1, True)
    rows.n_decode = len(rows)
    taken = taken_fn(rows)
    step = runner.run(rows)
    log.append({"start_ms": now, "ms": step.ms, "decode_rows": rows.n_decode,
                "prefill_rows": len(rows) - rows.n_decode})
    now += step.ms
    out = list(zip(step.tokens, step.margins))
    dec, k = out[:len(decoding)], len(decoding)
    chunk = []
    for r, n in taken:
        if r.progress + n == len(r.prompt):
            chunk.append((r, n, out[k]))
            k += 1
        else:
            chunk.append((r, n, None))
    return now, dec, chunk


def _commit(r: Request, tok, now: float) -> None:
    r.tokens.append(tok[0])
    r.margins.append(tok[1])
    r.token_ms.append(now)


def _commit_decode(decoding: list, tokens, now: float, release) -> list:
    still = []
    for r, t in zip(decoding, tokens):
        _commit(r, t, now)
        if r.done:
            release(r)
        else:
            still.append(r)
    return still


def serve_colocated(runner: Runner, requests, opts: ServeOptions = ServeOptions()) -> Served:
    """One worker: every iteration decodes the running requests and carries up to
    ``opts.chunk`` prompt tokens (module docstring)."""
    cache = runner.cache
    reqs = sorted((r.fresh() for r in requests), key=lambda r: r.arrival_ms)
    waiting, prefilling, running, log = deque(), [], [], []
    now, i = 0.0, 0

    def release(r):
        cache.release(r.tables)

    while i < len(reqs) or waiting or prefilling or running:
        i = _admit_arrivals(reqs, i, now, waiting)
        while waiting and len(running) + len(prefilling) < opts.max_batch:
            r = waiting.popleft()
            r.tables = cache.alloc(len(r.prompt) + r.max_new)
            prefilling.append(r)
        if not running and not prefilling:
            now = max(now, reqs[i].arrival_ms)
            continue
        start = now
        now, dec, chunk = _iterate(runner, running, lambda rows: _add_chunk(
            rows, prefilling, opts.chunk, runner.max_finishers), now, log)
        running = _commit_decode(running, dec, now, release)
        for r, n, tok in chunk:
            if r.prefill_start_ms is None:
                r.prefill_start_ms = start
            r.progress += n
            if tok is not None:
                prefilling.remove(r)
                r.prefill_end_ms = now
                _commit(r, tok, now)
                if r.done:
                    release(r)
                else:
                    running.append(r)
    return Served(reqs, log, runner.timing, runner.mode, list(runner.graph_errors))


# ---- disaggregated: a prefill worker and a decode worker -----------------------------------------

def prefill_worker(runner: Runner, requests, opts: ServeOptions = ServeOptions(), log: list | None = None):
    """Yield each request as its prompt finishes (``prefill_end_ms`` on this worker's clock, its
    first token in ``tokens``, its pages still held: the consumer hands them off and releases
    them). Iterations carry prompt chunks only."""
    cache = runner.cache
    reqs = sorted((r.fresh() for r in requests), key=lambda r: r.arrival_ms)
    waiting, prefilling = deque(), []
    log = [] if log is None else log
    now, i = 0.0, 0
    while i < len(reqs) or waiting or prefilling:
        i = _admit_arrivals(reqs, i, now, waiting)
        while waiting and len(prefilling) < opts.max_batch:
            r = waiting.popleft()
            r.tables = cache.alloc(len(r.prompt))
            prefilling.append(r)
        if not prefilling:
            now = max(now, reqs[i].arrival_ms)
            continue
        start = now
        now, _, chunk = _iterate(runner, [], lambda rows: _add_chunk(
            rows, prefilling, opts.chunk, runner.max_finishers), now, log)
        for r, n, tok in chunk:
            if r.prefill_start_ms is None:
                r.prefill_start_ms = start
            r.progress += n
            if tok is not None:
                prefilling.remove(r)
                r.prefill_end_ms = now
                r.tokens.append(tok[0])
                r.margins.append(tok[1])
                yield r


def decode_alloc(cache, prompt_len: int, max_new: int):
    """The pages a decode worker takes for a handed-off prompt: from the first raw token it
    must hold (:func:`dsv4lab.drivers.kv_transfer.first_raw_token`) to the last output token."""
    return cache.alloc(prompt_len + max_new, first_raw_token=KV.first_raw_token(cache, prompt_len))


class LocalHandoff:
    """A decode worker's source in one process: runs :func:`prefill_worker` on demand over its
    own cache and copies each hand-off's pages (:func:`~dsv4lab.drivers.kv_transfer.extract`,
    :func:`~dsv4lab.drivers.kv_transfer.adopt`); ``transfer_ms(nbytes)`` gives the link's time
    (the link is modelled, not measured)."""

    def __init__(self, prefill_runner: Runner, requests, opts: ServeOptions, transfer_ms):
        self.prefill_cache = prefill_runner.cache
        self.log: list = []
        self.gen = prefill_worker(prefill_runner, requests, opts, self.log)
        self.transfer_ms = transfer_ms

    def fetch(self, cache, max_new_of) -> dict | None:
        r = next(self.gen, None)
        if r is None:
            return None
        L = len(r.prompt)
        tables = decode_alloc(cache, L, max_new_of(r.rid))
        payload = KV.extract(self.prefill_cache, r.tables, L)
        self.prefill_cache.release(r.tables)
        adopt = wall_ms(lambda: KV.adopt(cache, tables, L, payload))
        return {"rid": r.rid, "prompt_len": L, "first_token": r.tokens[0], "first_margin": r.margins[0],
                "nbytes": payload.numel(),
                "prefill_start_ms": r.prefill_start_ms, "finish_ms": r.prefill_end_ms, "tables": tables,
                "transfer_ms": float(self.transfer_ms(payload.numel())), "adopt_ms": adopt}


class DistHandoff:
    """A decode worker's source in a torchrun world: the hand-offs rank ``src`` sends
    (:class:`~dsv4lab.drivers.kv_transfer.Receiver`; the transfer is measured)."""

    def __init__(self, src: int, device):
        self.receiver = KV.Receiver(src, device)

    def fetch(self, cache, max_new_of) -> dict | None:
        return self.receiver.recv(cache, lambda h: decode_alloc(cache, h["prompt_len"], max_new_of(h["rid"])))


def serve_decode(runner: Runner, source, requests, opts: ServeOptions = ServeOptions()) -> Served:
    """The decode worker: takes hand-offs from ``source`` while it has room (``max_batch +
    max_pending`` requests held), admits each when its clock passes the hand-off's end, and
    decodes the running requests every iteration (module docstring)."""
    by_id = {r.rid: r.fresh() for r in requests}
    cache = runner.cache
    n_slots = opts.max_batch + (opts.max_pending or opts.max_batch)
    slot_free = [0.0] * n_slots                       # when each slot of room frees (a heap)
    pending, running, log = [], [], []
    now, link_free, exhausted, adopt_ms = 0.0, 0.0, False, []

    def release(r):
        cache.release(r.tables)
        heapq.heappush(slot_free, now)

    while True:
        while not exhausted and slot_free:
            room_at = heapq.heappop(slot_free)
            h = source.fetch(cache, lambda rid: by_id[rid].max_new)
            if h is None:
                exhausted = True
                heapq.heappush(slot_free, room_at)
                break
            r = by_id[h["rid"]]
            start = max(h["finish_ms"], link_free, room_at)
            link_free = start + h["transfer_ms"]
            r.tables, r.transfer_ms = h["tables"], h["transfer_ms"]
            r.prefill_start_ms, r.prefill_end_ms = h["prefill_start_ms"], h["finish_ms"]
            r.tokens, r.token_ms = [h["first_token"]], [link_free]
            r.margins = [h.get("first_margin", float("nan"))]
            adopt_ms.append(h["adopt_ms"])
            pending.append(r)
        for r in [p for p in pending if p.token_ms[0] <= now]:
            if len(running) >= opts.max_batch:
                break
            pending.remove(r)
            if r.done:
                release(r)
            else:
                running.append(r)
        if not running:
            if pending:
                now = max(now, min(p.token_ms[0] for p in pending))
                continue
            if exhausted:
                break
            continue
        now, dec, _ = _iterate(runner, running, lambda rows: [], now, log)
        running = _commit_decode(running, dec, now, release)
    notes = list(runner.graph_errors)
    return Served(sorted(by_id.values(), key=lambda r: r.arrival_ms), log, runner.timing, runner.mode,
                  notes, adopt_ms)


def serve_disaggregated_local(prefill_runner: Runner, decode_runner: Runner, requests,
                              opts: ServeOptions = ServeOptions(), *, transfer_ms) -> tuple[Served, list]:
    """Both workers in one process (one GPU standing in for two; the link's time from
    ``transfer_ms(nbytes)``). Returns the decode worker's :class:`Served` and the prefill
    worker's iterations."""
    src = LocalHandoff(prefill_runner, requests, opts, transfer_ms)
    served = serve_decode(decode_runner, src, requests, opts)
    return served, src.log


def same_tokens(a: Served, b: Served) -> dict:
    """Whether two runs' greedy tokens agree: ``identical``, how many requests differ and, per
    differing request, the first differing position and the smaller top-2 logit margin of the
    two runs there (a near tie: rounding that differs with the batch can flip it)."""
    ra, rb = {r.rid: r for r in a.requests}, {r.rid: r for r in b.requests}
    diff = {}
    for rid, x in ra.items():
        y = rb.get(rid)
        if y is None or x.tokens != y.tokens:
            ty = [] if y is None else y.tokens
            i = next((k for k, (p, q) in enumerate(zip(x.tokens, ty)) if p != q), min(len(x.tokens), len(ty)))
            margins = [m[i] for m in (x.margins, [] if y is None else y.margins) if i < len(m)]
            diff[rid] = {"position": i, "margin": min(margins) if margins else None}
    return {"identical": not diff and set(ra) == set(rb), "requests_differing": len(diff),
            "first_difference": diff}
