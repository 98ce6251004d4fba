"""Greedy generation with a paged cache: prefill, plain decoding and MTP speculative decoding,
every stage a fixed-shape function of static device buffers, captured once in a CUDA graph.

One :class:`DecodeLoop` per (batch, drafts k) holds the buffers and the graphs:

- **prefill** (one graph per prompt-length bucket, a power of two): the prompts, padded,
  through the main model; the first token; with drafts, the MTP layer over the prompt and
  the first k drafts. It also fills the loop's position table, :func:`make_meta` of every
  position the requests' pages can hold, so that a step's :class:`DecodeMeta` is one gather a
  field instead of the arithmetic again.
- **step** (k = 0): the pending token through the main model, its argmax appended.
- **verify** (k >= 1): the pending token and the k drafts through the main model in one
  forward (S = k + 1 rows); greedy acceptance keeps the longest prefix of drafts equal to the
  main model's argmaxes, plus the main model's next token: 1 to k + 1 tokens a step.
- **rollback** (inside verify, nothing to undo): every cache write is addressed by position
  and every read is masked by position, so the rows written for rejected positions are
  invisible until the step that reaches those positions overwrites them.
- **draft** (k >= 1): the MTP layer over the k + 1 verified positions with the main model's
  streams (its cache for them, and draft 1 read at the accepted position), then k - 1 passes
  on its own streams for drafts 2..k.

Acceptance, positions, outputs and the end of each request (``max_new_tokens`` or its EOS
token) stay on the device: a step is one graph replay (plain) or two (verify, draft), and the
host synchronises only every ``sync_every`` steps, to read how many tokens each request still
needs. The output is the plain greedy output token for token.

Explained in notebooks/05_mtp_speculative.ipynb.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from dsv4lab import backends as B
from dsv4lab import runtime
from dsv4lab.model import DSV4, MTP, OPS, DecodeMeta, LayerCache, make_meta, to_dtype

PER_REQUEST_FIELDS = ("block_table", "cblock_table")   # DecodeMeta tensors not indexed by position
MIN_BUCKET = 16                                          # the shortest padded prompt


class PagedKVCache:
    """Per-layer page pools (main layers, then the draft layer) + a page allocator.

    ``ratios``: each pool's compress ratio (default ``model.ratios()``: the main layers', then
    the model's own MTP layer's)."""

    def __init__(self, model: DSV4, num_pages: int, page_size: int = 16, *,
                 kv_format: str = "bf16", dtype=torch.bfloat16, device=None, ratios=None):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is scratch), got {num_pages}")
        self.cfg = model.cfg
        self.page_size, self.num_pages, self.kv_format = page_size, num_pages, kv_format
        self.ratios = list(model.ratios() if ratios is None else ratios)
        self.layers = [LayerCache.allocate(model.cfg, r, num_pages, page_size, dtype=dtype,
                                           kv_format=kv_format, device=device)
                       for r in self.ratios]
        self._free = list(range(num_pages - 1, 0, -1))

    @property
    def main(self) -> list[LayerCache]:
        return self.layers[:self.cfg.num_layers]

    @property
    def mtp(self) -> LayerCache | None:
        return self.layers[self.cfg.num_layers] if len(self.layers) > self.cfg.num_layers else None

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"KV cache out of pages: need {n}, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def release(self, pages) -> None:
        self._free.extend(int(p) for p in pages if p)

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for c in self.layers
                   for t in vars(c).values() if isinstance(t, torch.Tensor))


@dataclass
class Generation:
    """Output of :meth:`Engine.generate`: ``tokens[b]`` (new tokens only, ending with the EOS
    token when one was produced) and statistics."""
    tokens: list
    num_draft: int
    steps: int
    accept_hist: list            # accept_hist[a]: steps that accepted a drafts (0..k)
    seconds: float
    graphs: bool
    notes: list = field(default_factory=list)

    @property
    def acceptance(self) -> list[float]:
        """Per draft position i = 1..k: fraction of steps whose draft i was accepted."""
        tot = sum(self.accept_hist)
        if not tot:
            return []
        return [sum(self.accept_hist[i:]) / tot for i in range(1, len(self.accept_hist))]

    @property
    def mean_accepted(self) -> float:
        """Tokens per verify step (accepted drafts + the main model's own token)."""
        tot = sum(self.accept_hist)
        return sum((a + 1) * n for a, n in enumerate(self.accept_hist)) / tot if tot else 1.0

    @property
    def accepted_drafts(self) -> float:
        """Mean accepted drafts a step (``mean_accepted - 1``)."""
        return self.mean_accepted - 1.0


class DraftLayer(nn.Module):
    """An MTP layer with the main model's embedding and LM head, laid out as
    :class:`~dsv4lab.model.DSV4` holds them (``embed``, ``head``, ``mtp[0]``), so the model's
    own MTP forward drafts with it."""

    def __init__(self, model: DSV4, mtp: MTP):
        super().__init__()
        self.cfg = model.cfg
        self.embed, self.head = model.embed, model.head
        self.mtp = nn.ModuleList([mtp])

    mtp_forward_decode = DSV4.mtp_forward_decode


def _stage(name: str):
    """Profiler label of one stage (see :meth:`DecodeLoop.verify`): free inside a replay."""
    return torch.profiler.record_function(name)


def _copy_meta(dst: DecodeMeta, src: DecodeMeta) -> None:
    """``src``'s per-position tensors into ``dst``'s (in place: graphs read ``dst``)."""
    for f in dataclasses.fields(DecodeMeta):
        if f.name in ("positions", "memo") + PER_REQUEST_FIELDS:
            continue
        d, s = getattr(dst, f.name), getattr(src, f.name)
        if isinstance(d, dict):
            for r in d:
                d[r].copy_(s[r])
        elif isinstance(d, torch.Tensor):
            d.copy_(s)


def _capture(fns: list[Callable], side: torch.cuda.Stream) -> list:
    """Warm ``fns`` up twice, in order, on the ``side`` stream (kernels compile, the allocator
    settles), then capture each in its own CUDA graph."""
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            for fn in fns:
                fn()
    torch.cuda.current_stream().wait_stream(side)
    graphs = []
    for fn in fns:
        g = torch.cuda.CUDAGraph()
        with runtime.cuda_graph_capture(g):
            fn()
        graphs.append(g)
    torch.cuda.synchronize()
    return graphs


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


class DecodeLoop:
    """Static buffers, the stages and their graphs for one (batch ``B``, drafts ``k``).

    Host side: :meth:`load` (the prompts, one copy to the device), :meth:`run_prefill`,
    :meth:`run_step` (a replay of each step graph, or the stages eagerly), :meth:`remaining`
    and :meth:`results` (the loop's host synchronisations). Device side, what the graphs hold:
    :meth:`prefill`, :meth:`step` (k = 0), :meth:`verify` and :meth:`draft` (k >= 1)."""

    def __init__(self, eng: "Engine", B: int, k: int):
        dev, self.eng, self.B, self.k = eng.device, eng, B, k
        z = lambda *s, dt=torch.long: torch.zeros(*s, dtype=dt, device=dev)  # noqa: E731
        self.P = eng.n_raw * eng.page_size                 # positions a request's pages hold
        self.inputs = z(B, 3 + eng.max_len)                # per request: length, max_new, eos, prompt
        self.block_table = z(B, eng.n_raw, dt=torch.int32)
        self.cblock_table = z(B, eng.n_comp, dt=torch.int32)
        self.cur_tok, self.cur_pos = z(B), z(B)            # the pending token and its position
        self.drafts = z(B, max(k, 1))
        self.out = z(B, eng.max_len + 1)                   # new tokens; the last column is a dump
        self.n_out, self.max_new, self.eos = z(B), z(B), z(B)
        self.done = z(B, dt=torch.bool)
        self.hist = z(k + 1)                               # steps that accepted 0..k drafts
        self.n_steps = z(())                               # steps with a request still running
        self.offsets = torch.arange(k + 1, device=dev)
        self.draft_offsets = torch.arange(max(k - 1, 1), device=dev)
        self.rows = torch.arange(B, device=dev)
        self.no_drafts = z(B)
        positions = torch.arange(self.P, device=dev).expand(B, self.P)
        self.table = make_meta(eng.cfg, positions, self.block_table, self.cblock_table,
                               eng.page_size, eng.table_ratios)
        self.verified = None       # (g, a, h, meta, active) of the last verify: what draft reads
        self.bucket = MIN_BUCKET
        self.graphs: dict[str, torch.cuda.CUDAGraph] = {}
        self.prefill_graphs: dict[int, torch.cuda.CUDAGraph | None] = {}
        self.notes: list[str] = []
        if eng.cuda_graphs:
            names = ["step"] if k == 0 else ["verify", "draft"]
            try:
                self.graphs = dict(zip(names, _capture([getattr(self, n) for n in names], eng.side_stream())))
            except Exception as exc:   # an op that syncs with the host cannot be captured
                self.graphs = {}
                self.notes.append(f"CUDA graph capture failed, steps ran eagerly: {_why(exc)}")
                torch.cuda.synchronize()

    # ---- host side -------------------------------------------------------------------
    def load(self, prompts: list[list[int]], max_new: int, eos: int | None) -> None:
        """The prompts, their lengths, ``max_new`` and the EOS id (-1: none) to the device."""
        L = max(len(p) for p in prompts)
        self.bucket = min(max(MIN_BUCKET, 1 << (L - 1).bit_length()), self.eng.max_len)
        host = torch.zeros(self.B, self.inputs.shape[1], dtype=torch.long)
        for b, p in enumerate(prompts):
            host[b, :3] = torch.tensor([len(p), max_new, -1 if eos is None else eos])
            host[b, 3:3 + len(p)] = torch.as_tensor(p, dtype=torch.long)
        self.inputs.copy_(host)

    def run_prefill(self) -> None:
        L = self.bucket
        if self.eng.cuda_graphs and self.graphs and L not in self.prefill_graphs:
            try:
                self.prefill_graphs[L] = _capture([lambda: self.prefill(L)], self.eng.side_stream())[0]
            except Exception as exc:
                self.prefill_graphs[L] = None
                self.notes.append(f"CUDA graph capture of the {L}-token prefill failed, it ran "
                                  f"eagerly: {_why(exc)}")
                torch.cuda.synchronize()
        g = self.prefill_graphs.get(L)
        g.replay() if g is not None else self.prefill(L)

    def run_step(self) -> None:
        for name in ("step",) if self.k == 0 else ("verify", "draft"):
            g = self.graphs.get(name)
            g.replay() if g is not None else getattr(self, name)()

    def stage_calls(self) -> dict[str, Callable[[], None]]:
        """Each stage as :meth:`Engine.generate` runs it (a graph replay when captured), to
        time alone: "step", or "verify" and "draft", then "prefill" (the last bucket). Called
        after a generation, when every request is done, a step recomputes rows past the
        requests' ends and changes nothing else; "prefill" restarts the requests."""
        calls = {}
        for name in ("step",) if self.k == 0 else ("verify", "draft"):
            g = self.graphs.get(name)
            calls[name] = g.replay if g is not None else getattr(self, name)
        calls["prefill"] = self.run_prefill
        return calls

    def remaining(self) -> list[int]:
        """Tokens each request still needs (0 once it has ``max_new`` or its EOS): a sync."""
        return torch.where(self.done, 0, self.max_new - self.n_out).tolist()

    def results(self, max_new: int) -> tuple[list, list, int]:
        """(tokens per request, acceptance histogram, steps): one sync."""
        B, k = self.B, self.k
        flat = torch.cat([self.n_out, self.hist, self.n_steps.view(1),
                          self.out[:, :max_new].flatten()]).tolist()
        n, hist, steps, out = flat[:B], flat[B:B + k + 1], flat[B + k + 1], flat[B + k + 2:]
        return [out[b * max_new:b * max_new + n[b]] for b in range(B)], hist, steps

    # ---- device side: what the graphs hold -------------------------------------------
    def meta_at(self, pos: torch.Tensor, ratios) -> DecodeMeta:
        """The :class:`DecodeMeta` of tokens at ``pos [B, S]``: every per-position field of the
        position table gathered at ``pos`` (the values :func:`make_meta` computes), for the
        compress ratios in ``ratios``."""
        idx = pos.clamp_max(self.P - 1)      # generate keeps positions below max_len
        keep = {r for r in ratios if r}

        def at(t):
            return t.gather(1, idx if t.dim() == 2 else idx.unsqueeze(-1).expand(*idx.shape, t.shape[-1]))

        vals = {}
        for f in dataclasses.fields(DecodeMeta):
            v = getattr(self.table, f.name)
            if f.name == "positions":
                v = pos
            elif f.name == "memo":
                v = {}
            elif isinstance(v, dict):
                v = {r: at(t) for r, t in v.items() if r in keep}
            elif isinstance(v, torch.Tensor) and f.name not in PER_REQUEST_FIELDS:
                v = at(v)
            vals[f.name] = v
        return DecodeMeta(**vals)

    def commit(self, g: torch.Tensor, a: torch.Tensor, active: torch.Tensor) -> None:
        """Append ``g[:, :a+1]`` to each running request's output, up to its ``max_new`` and
        through its first EOS; mark the requests that are done; count ``a``."""
        j = self.offsets[:g.shape[1]]
        dst = self.n_out.unsqueeze(1) + j
        keep = (j <= a.unsqueeze(1)) & (dst < self.max_new.unsqueeze(1)) & active.unsqueeze(1)
        hit = keep & (g == self.eos.unsqueeze(1))
        keep &= (hit.cumsum(1) - hit.long()) == 0            # nothing after the first EOS
        self.out.scatter_(1, torch.where(keep, dst, self.out.shape[1] - 1), g)
        self.n_out += keep.sum(1)
        self.done |= hit.any(1) | (self.n_out >= self.max_new)
        self.hist.index_add_(0, a, active.long())

    @torch.no_grad()
    def prefill(self, L: int) -> None:
        """Prompts padded to ``L`` tokens -> the first token, the loop's state (and drafts).
        Padded positions write rows that no query sees before a step overwrites them."""
        e, inp = self.eng, self.inputs
        lens, max_new, eos, toks = inp[:, 0], inp[:, 1], inp[:, 2], inp[:, 3:3 + L]
        with _stage("prefill.main"):
            _copy_meta(self.table, make_meta(e.cfg, self.table.positions, self.block_table,
                                             self.cblock_table, e.page_size, e.table_ratios))
            pos = self.table.positions[:, :L]
            meta = self.meta_at(pos, e.table_ratios)
            logits, h = e.model.forward_decode(toks, meta, e.cache.main, e.backends)
            last = (lens - 1).view(-1, 1)
            first = logits.argmax(-1).gather(1, last)[:, 0]
            self.out[:, 0] = first
            self.n_out.fill_(1)
            self.max_new.copy_(max_new)
            self.eos.copy_(eos)
            self.done.copy_((first == eos) | (max_new <= 1))
            self.hist.zero_()
            self.n_steps.zero_()
            self.cur_tok.copy_(first)
            self.cur_pos.copy_(lens)
        if self.k:
            with _stage("prefill.mtp"):
                nt = torch.cat([toks[:, 1:], toks[:, :1]], 1).scatter_(1, last, first.view(-1, 1))
                ml, mh = e.drafter.mtp_forward_decode(h, nt, meta, e.cache.mtp, e.draft_backends)
                d1 = ml.argmax(-1).gather(1, last)[:, 0]
                self.drafts.copy_(self.draft_rest(mh[self.rows, lens - 1], d1, lens))

    @torch.no_grad()
    def step(self) -> None:
        """Plain decoding (k = 0): the pending token through the main model."""
        e = self.eng
        active = ~self.done
        self.n_steps += active.any()
        with _stage("step.meta"):
            meta = self.meta_at(self.cur_pos.unsqueeze(1), e.ratios)
        with _stage("step.main"):
            logits, _ = e.model.forward_decode(self.cur_tok.unsqueeze(1), meta, e.cache.main, e.backends)
        with _stage("step.accept"):
            g = logits.argmax(-1)
            self.commit(g, self.no_drafts, active)
        with _stage("step.update"):
            self.cur_tok.copy_(g[:, 0])
            self.cur_pos += active

    @torch.no_grad()
    def verify(self) -> None:
        """The pending token and the k drafts through the main model (S = k + 1); accept the
        agreeing prefix plus the main model's next token. Rolling back is nothing to do: the
        rejected positions' rows are never read before a later step rewrites them."""
        e, k = self.eng, self.k
        active = ~self.done
        self.n_steps += active.any()
        with _stage("step.meta"):
            toks = torch.cat([self.cur_tok.unsqueeze(1), self.drafts], 1)
            pos = self.cur_pos.unsqueeze(1) + self.offsets
            meta = self.meta_at(pos, e.table_ratios)     # the MTP layer's ratio too: draft reuses it
        with _stage("step.main"):
            logits, h = e.model.forward_decode(toks, meta, e.cache.main, e.backends)
        with _stage("step.accept"):
            g = logits.argmax(-1)                                        # [B, k+1]
            a = (self.drafts == g[:, :k]).cumprod(1).sum(1)              # drafts accepted
            self.commit(g, a, active)
        self.verified = (g, a, h, meta, active)

    @torch.no_grad()
    def draft(self) -> None:
        """The MTP layer over the verified positions (S = k + 1: its cache, draft 1 at the
        accepted position), then drafts 2..k; advance the pending token and position."""
        e = self.eng
        g, a, h, meta, active = self.verified
        with _stage("step.mtp"):
            ml, mh = e.drafter.mtp_forward_decode(h, g, meta, e.cache.mtp, e.draft_backends)
            ia = a.view(-1, 1)
            d1 = ml.argmax(-1).gather(1, ia)[:, 0]
            new_pos = self.cur_pos + a + 1
        with _stage("step.draft"):
            drafts = self.draft_rest(mh[self.rows, a], d1, new_pos)
        with _stage("step.update"):
            self.cur_tok.copy_(g.gather(1, ia)[:, 0])
            self.cur_pos.copy_(torch.where(active, new_pos, self.cur_pos))
            self.drafts.copy_(drafts)

    def draft_rest(self, hm: torch.Tensor, d1: torch.Tensor, new_pos: torch.Tensor) -> torch.Tensor:
        """Drafts 2..k: the MTP layer on its own streams, one position at a time (the k - 1
        positions are known up front: one meta, sliced). -> drafts [B, k]."""
        if self.k < 2:
            return d1.unsqueeze(1)
        e = self.eng
        full = self.meta_at(new_pos.unsqueeze(1) + self.draft_offsets, [e.mtp_ratio])
        drafts = [d1]
        for j in range(self.k - 1):
            ml, h = e.drafter.mtp_forward_decode(hm.unsqueeze(1), drafts[-1].unsqueeze(1),
                                                 full.column(j), e.cache.mtp, e.draft_backends)
            hm = h[:, 0]
            drafts.append(ml[:, 0].argmax(-1))
        return torch.stack(drafts, 1)


class Engine:
    """Greedy generation from a :class:`~dsv4lab.model.DSV4` with a paged cache.

    ``backends`` / ``draft_backends``: op name -> backend for the main model / the draft
    layer (the keys of :data:`dsv4lab.model.OPS`: "sparse_mla_decode", "indexer_topk",
    "fused_moe", "mhc", "linear"; missing = "auto").
    ``draft``: what drafts: None for the model's own MTP layer; an :class:`~dsv4lab.model.MTP`
    layer (it shares the model's embedding and LM head); or a module holding one as DSV4
    does (``mtp[0]``, ``mtp_forward_decode``, e.g. a checkpoint loader's draft model).
    ``kv_format``: "bf16" (the model dtype) or "fp8" (584-byte rows; head_dim 512 only).
    ``cuda_graphs``: capture each stage (default: on a GPU). ``dtype``: the model's float
    dtype for decoding (default fp32). ``cpu_threads``: torch intra-op threads while
    generating on the CPU (default 1: decode-sized ops only pay for thread hand-offs;
    restored afterwards; None leaves torch's setting alone).
    """

    def __init__(self, model: DSV4, *, max_batch: int = 8, max_len: int = 1024,
                 page_size: int = 16, kv_format: str = "bf16", dtype: torch.dtype | None = None,
                 device=None, backends: dict | None = None, draft_backends: dict | None = None,
                 draft: nn.Module | None = None, cuda_graphs: bool | None = None,
                 cpu_threads: int | None = 1):
        for name, value, low in (("max_batch", max_batch, 1), ("max_len", max_len, 2), ("page_size", page_size, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        self.device = torch.device(device) if device is not None else runtime.device()
        # fp32 by default: the mini model is launch-bound, so fp32 costs ~nothing, and it
        # keeps the S_q = 1 decode and the S_q = k + 1 verify numerically interchangeable
        # (bf16 rounding differs with the GEMM shape and can flip near-tied argmaxes)
        self.dtype = dtype or torch.float32
        self.model = to_dtype(model, self.dtype).to(self.device).eval()
        self.cfg = model.cfg
        self.drafter = self._drafter(draft)
        self.max_batch, self.max_len, self.page_size = max_batch, max_len, page_size
        self.backends = dict(backends or {})
        self.draft_backends = dict(draft_backends if draft_backends is not None else self.backends)
        self.moe_plans = self._resolve_backends(kv_format)
        self.ratios = [b.ratio for b in model.layers]
        self.mtp_ratio = self.drafter.mtp[0].block.ratio if self.drafter is not None else 0
        self.table_ratios = sorted({r for r in self.ratios + [self.mtp_ratio] if r})
        self.n_raw = math.ceil(max_len / page_size)
        if self.table_ratios:
            self.n_comp = max(math.ceil(max_len / min(self.table_ratios) / page_size),
                              math.ceil(self.cfg.index_topk / page_size), 1)
        else:
            self.n_comp = 1
        ratios = self.ratios + ([self.mtp_ratio] if self.drafter is not None else [])
        self.cache = PagedKVCache(self.model, 1 + max_batch * (self.n_raw + self.n_comp), page_size,
                                  kv_format=kv_format, dtype=self.dtype, device=self.device, ratios=ratios)
        self.cuda_graphs = self.device.type == "cuda" and (cuda_graphs is None or bool(cuda_graphs))
        self.cpu_threads = cpu_threads
        self._loops: dict = {}
        self._side = None

    def side_stream(self) -> torch.cuda.Stream:
        """The stream the captures warm up on (one per engine)."""
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        return self._side

    # -------------------------------------------------------------------------------
    def _drafter(self, draft):
        """The module whose ``mtp_forward_decode`` drafts (None: the model has no MTP layer)."""
        if draft is None:
            return self.model if len(self.model.mtp) else None
        if isinstance(draft, MTP):
            draft = DraftLayer(self.model, draft)
        elif not (callable(getattr(draft, "mtp_forward_decode", None)) and len(getattr(draft, "mtp", ()))
                  and isinstance(draft.mtp[0], MTP)):
            raise ValueError("draft must be an MTP layer (dsv4lab.model.MTP) or a module holding one "
                             f"as DSV4 does (mtp[0], mtp_forward_decode), got {type(draft).__name__}")
        d = draft.mtp[0].norm.weight.shape[0]
        if d != self.cfg.hidden_size:
            raise ValueError(f"draft: its MTP layer has hidden size {d}, the model {self.cfg.hidden_size}")
        return to_dtype(draft, self.dtype).to(self.device).eval()

    def _resolve_backends(self, kv_format: str) -> dict:
        """Resolve every op's backend now (BackendUnavailable here, before any kernel).

        The routed experts' format comes from the model and the draft (as from checkpoint
        metadata) and goes through :func:`dsv4lab.backends.resolve_moe_backend` for the main
        model and the draft alike.
        """
        target = B.Target.current(self.device)
        fmts = {"main": self.model.expert_format,
                "draft": self.drafter.mtp[0].block.moe.fmt if self.drafter is not None else "bf16"}
        plans = {}
        for role, table in (("main", self.backends), ("draft", self.draft_backends)):
            unknown = set(table) - set(OPS)
            if unknown:
                raise ValueError(f"backends: unknown op(s) {sorted(unknown)}; ops are {list(OPS)}")
            fmt = "fp8" if kv_format == "fp8" else "dense"
            table["sparse_mla_decode"] = B.resolve("sparse_mla_decode", table.get("sparse_mla_decode", "auto"),
                                                   fmt=fmt, target=target).name
            table["indexer_topk"] = B.resolve("indexer_topk", table.get("indexer_topk", "auto"),
                                              target=target).name
            if table.get("mhc", "auto") != "auto":      # "auto" is decided per call (grad, device)
                B.resolve("mhc", table["mhc"], target=target)
            if fmts[role] != "bf16":
                plan = B.resolve_moe_backend(role, metadata={"expert_format": fmts[role]},
                                             moe_runner_backend=table.get("fused_moe", "auto"),
                                             target=target)
                table["fused_moe"] = plan.backend.name
                plans[role] = plan
        return plans

    def loop(self, batch: int, num_draft: int) -> DecodeLoop:
        """The :class:`DecodeLoop` of ``batch`` requests and ``num_draft`` drafts, made (and
        its step graphs captured) on first use."""
        key = (batch, num_draft)
        if key not in self._loops:
            self._loops[key] = DecodeLoop(self, batch, num_draft)
        return self._loops[key]

    def admit(self, loop: DecodeLoop) -> list[int]:
        """Give each of the loop's ``B`` request slots its raw and compressed pages (the
        block tables); returns the pages, for :meth:`PagedKVCache.release`."""
        pages, bt, cbt = [], [], []
        try:
            for _ in range(loop.B):
                raw, comp = self.cache.alloc(self.n_raw), self.cache.alloc(self.n_comp)
                pages += raw + comp
                bt.append(raw)
                cbt.append(comp)
        except RuntimeError:
            self.cache.release(pages)
            raise
        loop.block_table.copy_(torch.tensor(bt, dtype=torch.int32))
        loop.cblock_table.copy_(torch.tensor(cbt, dtype=torch.int32))
        return pages

    def _check_request(self, prompts, max_new_tokens: int, num_draft: int, eos_token_id) -> list[list[int]]:
        """The prompts as lists of token ids; ValueError naming what is wrong."""
        prompts = [list(p.encode() if isinstance(p, str) else p) for p in prompts]
        if not 1 <= len(prompts) <= self.max_batch:
            raise ValueError(f"prompts: need 1..max_batch={self.max_batch} prompts, got {len(prompts)}")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("prompts: every prompt needs at least one token")
        if isinstance(num_draft, bool) or not isinstance(num_draft, int) or not 0 <= num_draft <= 3 \
                or (num_draft and self.drafter is None):
            raise ValueError(f"num_draft must be 0..3 (and the model needs an MTP layer), got {num_draft}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        need = max(len(p) for p in prompts) + max_new_tokens + 2 * num_draft + 2
        if need > self.max_len:
            raise ValueError(f"prompt + max_new_tokens (+ {2 * num_draft + 2} for drafts) = {need} "
                             f"exceeds the engine's max_len={self.max_len}")
        V = self.cfg.vocab_size
        if any(not 0 <= t < V for p in prompts for t in p):
            raise ValueError(f"prompts: token ids must lie in [0, {V})")
        if eos_token_id is not None and (isinstance(eos_token_id, bool) or not isinstance(eos_token_id, int)
                                         or not 0 <= eos_token_id < V):
            raise ValueError(f"eos_token_id must be None or an int in [0, {V}), got {eos_token_id!r}")
        return prompts

    def generate(self, prompts, max_new_tokens: int, *, num_draft: int = 0,
                 eos_token_id: int | None = None, progress: bool | None = None,
                 sync_every: int = 16) -> Generation:
        """Greedy continuation of each prompt (lists of token ids, or bytes/str for the
        byte-level mini model) by ``max_new_tokens`` tokens, or through its first
        ``eos_token_id``; ``num_draft`` MTP drafts a step (0 = plain decoding)."""
        prompts = self._check_request(prompts, max_new_tokens, num_draft, eos_token_id)
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every must be an int >= 1, got {sync_every!r}")
        threads = torch.get_num_threads()
        if self.device.type == "cpu" and self.cpu_threads:
            torch.set_num_threads(self.cpu_threads)
        try:
            return self._generate(prompts, max_new_tokens, num_draft, eos_token_id, progress, sync_every)
        finally:
            torch.set_num_threads(threads)

    def _generate(self, prompts, max_new, k, eos, progress, sync_every) -> Generation:
        loop = self.loop(len(prompts), k)
        pages = []
        try:
            pages = self.admit(loop)
            loop.load(prompts, max_new, eos)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            loop.run_prefill()
            show = progress if progress is not None else len(prompts) * max_new >= 4096
            bar = None
            if show:
                from tqdm.auto import tqdm
                bar = tqdm(total=len(prompts) * max_new, desc=f"generate (k={k})", leave=False)
            # Steps in chunks, reading between chunks how many tokens each request still needs.
            # A step gives every running request 1..k+1 tokens, so a chunk is never longer than
            # the neediest request can use: no step runs after all are done.
            launched = 0
            need = max(loop.remaining()) if eos is not None else max_new - 1   # EOS may come first
            while need > 0 and launched < max_new - 1:
                n = min(sync_every, -(-need // (k + 1)), max_new - 1 - launched)
                for _ in range(n):
                    loop.run_step()
                launched += n
                left = loop.remaining()
                need = max(left)
                if bar is not None:
                    bar.update(len(prompts) * max_new - sum(left) - bar.n)
            tokens, hist, steps = loop.results(max_new)
            seconds = time.perf_counter() - t0
            if bar is not None:
                bar.close()
        finally:
            self.cache.release(pages)
        return Generation(tokens=tokens, num_draft=k, steps=steps, accept_hist=hist, seconds=seconds,
                          graphs=bool(loop.graphs), notes=list(loop.notes))


def decode_text(tokens) -> str:
    """Bytes -> str for the byte-level mini model (invalid UTF-8 replaced)."""
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")
