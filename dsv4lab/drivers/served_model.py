"""The model a serving loop runs: a few layers in order over a paged cache, one forward per
iteration over a batch of token *rows*.

What is built:

- :class:`ServedModel`: the layers of :class:`dsv4lab.drivers.step.StepDriver` (one real-size
  layer of each attention kind of the config, random weights), run **in order** (ratio 0, 4,
  128 for V4-Flash) between the embedding and the LM head: a 3-layer model that produces
  real greedy tokens, so the co-located and the disaggregated runs can be compared token for
  token. Its times are extrapolated to the 43-layer model as the decode-step driver does
  (:func:`iteration_ms`).
- :class:`PagedCache`: one pool per layer kind (:class:`dsv4lab.model.LayerCache`), all with
  the same ``[num_pages, page]`` page space, and a page allocator. A request holds
  :class:`Tables`: the physical page of each logical raw page (0 = not held: scratch) and,
  per compress ratio, its compressed pages.
- :class:`Runner`: one iteration of a serving loop. Every token of the iteration is a row of
  its own (position, token, its request's block tables): a decode request contributes one
  row, a prefill chunk one row per prompt token, so a chunk of prefill and a decode batch go
  through the same ``Block.forward_decode`` as one batch. Within a chunk a token sees the
  tokens before it because every layer writes the chunk's cache entries before it reads
  (the window and the entries are masked by position). Logits are computed only for the rows
  that need a token (decode rows, the last row of a finished prompt).

How an iteration is timed: on a GPU each (decode rows, prefill rows) shape bucket is captured
once as a CUDA graph (rows padded to a power of two with rows that write only the scratch
page, as serving engines pad to their graph sizes) with timing events between the layers
(:mod:`dsv4lab.drivers.timing`); ``graphs=False`` runs it eagerly (events, host gaps
included). On the CPU the marks are wall-clock times. A :class:`CostModel` replaces the
measurement by a formula of the row counts (tests, and the notebook's CPU demonstration).

The scheduler's host work, sampling beyond argmax and the MTP layer are left out.
Explained in notebooks/07_prefill_decode.ipynb.
"""
from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from dsv4lab import model as M
from dsv4lab import runtime
from dsv4lab.config import DSV4Config
from dsv4lab.drivers.presets import StepConfig
from dsv4lab.drivers.step import HEAD, StepDriver, layer_counts
from dsv4lab.drivers.timing import Marks, no_mark

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


# ---- the paged cache ---------------------------------------------------------------------------

def reach(cfg: DSV4Config, ratios) -> int:
    """The raw tokens decoding reads back: the window, or a compressor's block (two blocks when
    it overlaps), whichever is longer."""
    return max([cfg.window_size] + [2 * r if M.compress_overlap(cfg, r) else r for r in ratios if r])


@dataclass
class Tables:
    """A request's pages: ``raw[j]`` the physical page of logical raw page j (0: not held),
    ``comp[r][j]`` of logical compressed page j of the ratio-r layers."""
    raw: list
    comp: dict

    def held(self) -> list[int]:
        return [p for p in self.raw if p] + [p for ps in self.comp.values() for p in ps if p]


class PagedCache:
    """Per layer kind one :class:`~dsv4lab.model.LayerCache` of ``num_pages`` pages, one
    allocator for all of them (page 0 is scratch). Block tables are ``raw_width`` raw pages
    (``max_context`` tokens) and ``comp_width[r]`` compressed pages per ratio."""

    def __init__(self, cfg: DSV4Config, ratios, num_pages: int, page_size: int, *, max_context: int,
                 kv_format: str = "bf16", dtype=torch.bfloat16, device=None):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is scratch), got {num_pages}")
        self.cfg, self.page_size, self.num_pages = cfg, page_size, num_pages
        self.max_context, self.kv_format, self.dtype = max_context, kv_format, dtype
        self.ratios = sorted(set(ratios))
        self.layers = OrderedDict((r, M.LayerCache.allocate(cfg, r, num_pages, page_size, dtype=dtype,
                                                            kv_format=kv_format, device=device))
                                  for r in self.ratios)
        self.raw_width = _cdiv(max_context, page_size)
        self.comp_width = {r: max(1, _cdiv(_cdiv(max_context, r), page_size)) for r in self.ratios if r}
        self.reach = reach(cfg, self.ratios)
        self._free = list(range(num_pages - 1, 0, -1))

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def _take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"KV cache out of pages: need {n}, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def pages_needed(self, total_len: int, first_raw_token: int = 0) -> int:
        first = first_raw_token // self.page_size
        return (_cdiv(total_len, self.page_size) - first
                + sum(_cdiv(total_len // r, self.page_size) for r in self.comp_width))

    def alloc(self, total_len: int, *, first_raw_token: int = 0) -> Tables:
        """Pages for a request of ``total_len`` tokens (prompt + output): every raw page from
        the one holding ``first_raw_token`` on (earlier ones stay 0: a decode worker holds only
        what decoding reads), and the compressed pages of every complete entry."""
        if not 1 <= total_len <= self.max_context:
            raise ValueError(f"a request of {total_len} tokens does not fit max_context={self.max_context}")
        first = first_raw_token // self.page_size
        n_raw = _cdiv(total_len, self.page_size)
        need = self.pages_needed(total_len, first_raw_token)
        pages = self._take(need)
        raw = [0] * self.raw_width
        raw[first:n_raw] = pages[:n_raw - first]
        comp, k = {}, n_raw - first
        for r, w in self.comp_width.items():
            n = _cdiv(total_len // r, self.page_size)
            comp[r] = pages[k:k + n] + [0] * (w - n)
            k += n
        return Tables(raw, comp)

    def release(self, tables: Tables) -> None:
        self._free.extend(tables.held())
        tables.raw, tables.comp = [], {}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for c in self.layers.values()
                   for t in vars(c).values() if isinstance(t, torch.Tensor))


# ---- the model ---------------------------------------------------------------------------------

class ServedModel:
    """The layers of a :class:`~dsv4lab.drivers.step.StepDriver` run in order, with its head.

    ``step`` names the backends, the KV format and the projections' format (its
    ``max_context`` is ignored: the caches are sized by the serving run). ``dtype`` "bf16"
    (the model's) or "fp32" (exact CPU checks: floats, caches and the residual streams
    widened; bf16 projections only).
    """

    def __init__(self, cfg: DSV4Config, step: StepConfig, *, device=None, seed: int = 0,
                 dtype: str = "bf16", page_size: int | None = None, backends: dict | None = None):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        self.dtype = DTYPES[dtype]
        self.device = torch.device(device) if device is not None else runtime.device()
        self.driver = StepDriver(cfg, device=self.device, seed=seed, page_size=page_size)
        self.cfg = self.driver.cfg                 # the driver's (its compressors' structure)
        self.step = step.for_model(self.cfg)
        if self.dtype != torch.bfloat16 and self.step.projections != "bf16":
            raise ValueError(f"dtype {dtype!r} widens bf16 projections only; preset {self.step.name!r} "
                             f"has {self.step.projections} projections")
        self.layers = OrderedDict((r, blks[0]) for r, blks in self.driver.blocks(self.step.projections).items())
        if self.dtype != torch.bfloat16:
            for blk in self.layers.values():
                M.to_dtype(blk, self.dtype)
            M.to_dtype(self.driver.head, self.dtype)
        self.head = self.driver.head
        self.page_size = self.driver.page_size
        self.backends = {**self.step.backends(), **(backends or {})}
        self.counts = layer_counts(self.cfg)
        self.pool = None                 # the CUDA graph memory pool every runner shares

    @property
    def ratios(self) -> list[int]:
        return list(self.layers)

    def tensors(self) -> list[torch.Tensor]:
        """Every weight and buffer (to make two processes' copies equal)."""
        mods = list(self.layers.values()) + [self.head]
        return [t for m in mods for t in list(m.parameters()) + list(m.buffers())]

    def cache(self, num_pages: int, *, max_context: int) -> PagedCache:
        return PagedCache(self.cfg, self.ratios, num_pages, self.page_size, max_context=max_context,
                          kv_format=self.step.kv_cache, dtype=self.dtype, device=self.device)

    @torch.no_grad()
    def forward(self, buf: "RowBuffers", cache: PagedCache, mark=no_mark) -> None:
        """Embedding, every layer in order, the head on ``buf.logit_rows``; the greedy tokens
        land in ``buf.next_tokens`` and the gap between the two largest logits in
        ``buf.margins`` (how near a tie each choice was). No host synchronisation: capturable."""
        x = self.head.embed_streams(buf.tokens)                 # [R, 1, n, d]
        mark(HEAD, "embed")
        pg = cache.page_size
        for r, blk in self.layers.items():
            meta = M.make_meta(self.cfg, buf.positions, buf.block_table, buf.cblock_table[r], pg,
                               [r] if r else [])
            x = blk.forward_decode(x, buf.tokens, meta, cache.layers[r], self.backends)
            mark(r, "layer")
        logits = self.head.logits(x.index_select(0, buf.logit_rows))[:, 0]
        buf.next_tokens.copy_(logits.argmax(-1))
        top2 = logits.topk(2, dim=-1).values
        buf.margins.copy_(top2[:, 0] - top2[:, 1])
        mark(HEAD, "head")


def iteration_ms(segments: dict, counts: dict) -> float:
    """A whole-model iteration from its measured segments: ``embed + sum_r count_r * layer_r
    + head`` (``counts``: main-model layers per compress ratio, V4-Flash 2 / 21 / 20)."""
    return (segments.get((HEAD, "embed"), 0.0) + segments.get((HEAD, "head"), 0.0)
            + sum(n * segments.get((r, "layer"), 0.0) for r, n in counts.items()))


@dataclass(frozen=True)
class CostModel:
    """An iteration's time from its row counts instead of a measurement:
    ``base_ms + decode_ms * decode rows + prefill_ms * prefill rows``."""
    base_ms: float = 1.0
    decode_ms: float = 0.05
    prefill_ms: float = 0.01

    def __call__(self, n_decode: int, n_prefill: int) -> float:
        return self.base_ms + self.decode_ms * n_decode + self.prefill_ms * n_prefill


# ---- one iteration ---------------------------------------------------------------------------

@dataclass
class Rows:
    """The tokens of one iteration: decode rows first (``n_decode`` of them), then prefill
    rows. ``owner[i]`` indexes ``tables``; ``logits`` lists the rows that need a token."""
    tokens: list = field(default_factory=list)
    positions: list = field(default_factory=list)
    owner: list = field(default_factory=list)
    tables: list = field(default_factory=list)
    logits: list = field(default_factory=list)
    n_decode: int = 0

    def add(self, tables: Tables, tokens, start: int, want_logits: bool) -> None:
        """Rows for ``tokens`` at positions ``start, start + 1, ...`` of one request."""
        k = len(self.tables)
        self.tables.append(tables)
        n = len(tokens)
        self.tokens += list(tokens)
        self.positions += range(start, start + n)
        self.owner += [k] * n
        if want_logits:
            self.logits.append(len(self.tokens) - 1)

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class Step:
    """What one iteration returns: per logit row its greedy token and top-2 logit margin; the
    iteration's ms (whole model, or the cost model's); the measured segments
    {(layer, component): ms}."""
    tokens: list
    margins: list
    ms: float
    segments: dict


class RowBuffers:
    """Static device buffers of one shape: ``R`` rows, ``K`` logit rows."""

    def __init__(self, cache: PagedCache, R: int, K: int, device):
        i32 = dict(dtype=torch.int32, device=device)
        self.R, self.K = R, K
        self.tokens = torch.zeros(R, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(R, 1, dtype=torch.long, device=device)
        self.block_table = torch.zeros(R, cache.raw_width, **i32)
        self.cblock_table = {r: torch.zeros(R, cache.comp_width.get(r, 1), **i32) for r in cache.ratios}
        self.logit_rows = torch.zeros(K, dtype=torch.long, device=device)
        self.next_tokens = torch.zeros(K, dtype=torch.long, device=device)
        self.margins = torch.zeros(K, dtype=torch.float32, device=device)
        self.graph = None
        self.marks = None

    def fill(self, rows: Rows, cache: PagedCache, layout: list[int], device) -> None:
        """Copy ``rows`` in, row i at ``layout[i]``; every other row is a scratch row."""
        self.tokens.zero_()
        self.positions.zero_()
        self.block_table.zero_()
        for t in self.cblock_table.values():
            t.zero_()
        self.logit_rows.zero_()
        if not len(rows):
            return
        dst = torch.tensor(layout, dtype=torch.long)
        self.tokens[dst.to(device), 0] = torch.tensor(rows.tokens, dtype=torch.long).to(device)
        self.positions[dst.to(device), 0] = torch.tensor(rows.positions, dtype=torch.long).to(device)
        owner = torch.tensor(rows.owner, dtype=torch.long).to(device)
        dst = dst.to(device)
        bt = torch.tensor([t.raw for t in rows.tables], dtype=torch.int32).to(device)
        self.block_table[dst] = bt[owner]
        for r, buf in self.cblock_table.items():
            if r:
                cbt = torch.tensor([t.comp[r] for t in rows.tables], dtype=torch.int32).to(device)
                buf[dst] = cbt[owner]
        lr = torch.tensor([layout[i] for i in rows.logits], dtype=torch.long)
        self.logit_rows[:len(lr)] = lr.to(device)


class Runner:
    """Runs iterations of ``model`` over ``cache``; returns the greedy tokens and the time.

    ``graphs`` (default: on a GPU, when the step is capturable) captures one CUDA graph per
    shape bucket; ``cost`` (a
    :class:`CostModel`) replaces the measured time. ``max_finishers`` bounds the prompts
    that may finish in one iteration (the logit rows a graph holds for the prefill part).
    """

    def __init__(self, model: ServedModel, cache: PagedCache, *, graphs: bool | None = None,
                 cost: CostModel | None = None, max_finishers: int = 8):
        self.model, self.cache, self.cost = model, cache, cost
        self.device = model.device
        gpu = self.device.type == "cuda"
        # a step that reads device values on the host (the torch MoE) cannot be captured
        self.graphs = (gpu if graphs is None else (graphs and gpu)) and model.step.capturable
        self.mark_kind = ("graph_events" if self.graphs else "events") if gpu else "wall"
        self.max_finishers = max_finishers
        self._buffers: dict = {}
        self.graph_errors: list[str] = []

    @property
    def timing(self) -> str:
        if self.cost is not None:
            return "cost_model"
        return {"graph_events": "cuda_graph_events", "events": "eager_events"}.get(
            self.mark_kind, "interpreter_wall" if runtime.is_interpreter() else "cpu_wall")

    @property
    def mode(self) -> str:
        """"graph" (every shape replayed from a CUDA graph), "eager", or "graph+eager" (some
        shapes could not be captured: ``graph_errors`` says why)."""
        if self.mark_kind != "graph_events":
            return "eager"
        return "graph+eager" if self.graph_errors else "graph"

    def _shape(self, n_decode: int, n_prefill: int, n_logits: int):
        """(R, K, layout offset of the prefill rows): exact on the CPU and eagerly, padded to
        power-of-two buckets for graphs."""
        if not self.graphs:
            return n_decode + n_prefill, max(1, n_logits), n_decode
        bd = _pow2(n_decode) if n_decode else 0
        bp = _pow2(n_prefill) if n_prefill else 0
        return bd + bp, max(1, bd + (min(self.max_finishers, bp) if bp else 0)), bd

    def _buffers_for(self, R: int, K: int) -> RowBuffers:
        key = (R, K)
        if key not in self._buffers:
            buf = RowBuffers(self.cache, R, K, self.device)
            if self.graphs:
                self._capture(buf)
            self._buffers[key] = buf
        return self._buffers[key]

    def _capture(self, buf: RowBuffers) -> None:
        """Warm up on scratch rows (compiles every kernel), then capture with marks; on a
        failure the bucket runs eagerly and ``graph_errors`` says why."""
        m = self.model
        if m.pool is None:
            m.pool = torch.cuda.graph_pool_handle()
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    m.forward(buf, self.cache)
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            marks = Marks("graph_events")
            g = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(g, pool=m.pool):
                    marks.begin()
                    m.forward(buf, self.cache, marks)
            except BaseException:
                for gen in torch.cuda.default_generators:   # as runtime.cuda_graph_capture does
                    if hasattr(gen, "clone_state"):
                        gen.graphsafe_set_state(gen.clone_state())
                raise
            buf.graph, buf.marks = g, marks
        except Exception as e:  # noqa: BLE001  (an op that syncs with the host: run eagerly)
            torch.cuda.synchronize()
            self.graph_errors.append(f"R={buf.R}: {type(e).__name__}: {e}".splitlines()[0][:300])

    @torch.no_grad()
    def run(self, rows: Rows) -> "Step":
        """One iteration: the greedy token (and top-2 margin) of each ``rows.logits`` row, the
        iteration's ms for the whole model, the measured segments."""
        n_dec = rows.n_decode
        n_pre = len(rows) - n_dec
        R, K, off = self._shape(n_dec, n_pre, len(rows.logits))
        layout = list(range(n_dec)) + [off + i for i in range(n_pre)]
        buf = self._buffers_for(R, K)
        buf.fill(rows, self.cache, layout, self.device)
        if buf.graph is not None:
            buf.graph.replay()
            torch.cuda.synchronize()
            marks = buf.marks
        else:
            marks = Marks(self.mark_kind)
            marks.begin()
            self.model.forward(buf, self.cache, marks)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
        segs: dict = {}
        for layer, comp, ms in marks.segments():
            segs[(layer, comp)] = segs.get((layer, comp), 0.0) + ms
        k = len(rows.logits)
        ms = self.cost(n_dec, n_pre) if self.cost is not None else iteration_ms(segs, self.model.counts)
        return Step(buf.next_tokens[:k].tolist(), buf.margins[:k].tolist(), ms, segs)


def wall_ms(fn) -> float:
    """Milliseconds ``fn()`` takes, the GPU finished (host clock)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def size_pages(cache_tokens: int, page_size: int, n_requests: int, ratios, *, first_raw_token: int = 0) -> int:
    """Pages for ``n_requests`` of ``cache_tokens`` tokens each holding raw tokens from
    ``first_raw_token`` on (as :meth:`PagedCache.alloc` takes them), plus scratch."""
    per = (_cdiv(cache_tokens, page_size) - first_raw_token // page_size
           + sum(_cdiv(cache_tokens // r, page_size) for r in ratios if r))
    return 1 + n_requests * per


def default_max_context(total_len: int) -> int:
    """The server sized for the run: the power of two at or above the longest request."""
    return 1 << max(4, math.ceil(math.log2(max(total_len, 1))))
