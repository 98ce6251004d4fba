"""A small paged decode engine: prefill, batched greedy decode, MTP speculative decoding.

- **Paged cache** (:class:`PagedKVCache`): per layer one pool of ``[pages, page_size]``
  rows (bf16 latents, or the 584-byte FP8 layout of :func:`dsv4lab.quant.pack_kv_fp8`),
  raw tokens and compressed entries in different pages of the same pool; a request owns a
  raw block table and a compressed one. Page 0 is scratch (masked-out writes land there).
- **Prefill** runs the prompt (padded to the longest in the batch) through the same
  decode forward (S = prompt length); then **decode** feeds one token per request per
  step. Every step is a fixed-shape function of static device buffers (tokens, positions,
  block tables, counters), so on a GPU it is captured once in a CUDA graph and replayed:
  a tiny model is launch-bound, and graphs are what make it fast.
- **Speculative decoding** (``num_draft`` k = 1..3): the MTP layer drafts k tokens; the
  main model verifies the pending token and the k drafts in one forward (S_q = k + 1);
  the longest prefix of drafts equal to the main model's greedy choices is kept, plus the
  main model's next token (so a step yields 1..k+1 tokens). Rolling the cache back is
  free: every write is addressed by position and every read is masked by position, so
  rejected tokens' rows are simply overwritten by the next step. The MTP layer is then
  run over the k+1 verified positions with the main model's hidden states ("extend"),
  and recursively k-1 more times to draft the next k tokens. Acceptance, per-request
  positions and outputs all stay on the device: one graph replay per step, a host sync
  only every ``sync_every`` steps to test for completion.
- Greedy output is token-for-token the plain decoding's (up to floating-point
  near-ties: see notebooks/05_mtp_speculative.ipynb).

Explained in notebooks/05_mtp_speculative.ipynb.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from dsv4lab import backends as B
from dsv4lab import runtime
from dsv4lab.model import DSV4, OPS, LayerCache, make_meta, to_dtype


class PagedKVCache:
    """Per-layer page pools for a model (main layers, then the MTP layer) + a page allocator."""

    def __init__(self, model: DSV4, num_pages: int, page_size: int = 16, *,
                 kv_format: str = "bf16", dtype=torch.bfloat16, device=None):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is scratch), got {num_pages}")
        self.cfg = model.cfg
        self.page_size, self.num_pages, self.kv_format = page_size, num_pages, kv_format
        self.ratios = model.ratios()
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
    """Output of :meth:`Engine.generate`: ``tokens[b]`` (new tokens only) and statistics."""
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


def _stage(name: str):
    """Profiler label of one stage of a decode step (see :meth:`_Runner.step`)."""
    return torch.profiler.record_function("step." + name)


class _Runner:
    """Static buffers + the step function for one (batch, num_draft) shape."""

    def __init__(self, eng: "Engine", B: int, k: int):
        dev = eng.device
        self.eng, self.B, self.k = eng, B, k
        self.block_table = torch.zeros(B, eng.n_raw, dtype=torch.int32, device=dev)
        self.cblock_table = torch.zeros(B, eng.n_comp, dtype=torch.int32, device=dev)
        self.cur_tok = torch.zeros(B, dtype=torch.long, device=dev)
        self.cur_pos = torch.zeros(B, dtype=torch.long, device=dev)
        self.drafts = torch.zeros(B, max(k, 1), dtype=torch.long, device=dev)
        self.out = torch.zeros(B, eng.max_len + 1, dtype=torch.long, device=dev)  # last col: dump
        self.n_out = torch.zeros(B, dtype=torch.long, device=dev)
        self.max_new = torch.zeros(B, dtype=torch.long, device=dev)
        self.hist = torch.zeros(k + 1, dtype=torch.long, device=dev)
        self.n_steps = torch.zeros((), dtype=torch.long, device=dev)   # steps with work to do
        self.graph = None
        self.graph_error = None

    # -- pieces -----------------------------------------------------------------------
    def meta(self, positions, ratios):
        e = self.eng
        return make_meta(e.cfg, positions, self.block_table, self.cblock_table, e.page_size, ratios)

    def commit(self, g, a, active):
        """Write g[:, :a+1] after each request's outputs; count it."""
        k1 = g.shape[1]
        j = torch.arange(k1, device=g.device)
        cap = self.out.shape[1] - 1
        dst = (self.n_out.unsqueeze(1) + j).clamp_max(cap - 1)
        ok = (j <= a.unsqueeze(1)) & active.unsqueeze(1)
        self.out.scatter_(1, torch.where(ok, dst, torch.full_like(dst, cap)), g)
        self.n_out += torch.where(active, a + 1, torch.zeros_like(a))
        self.hist += (torch.nn.functional.one_hot(a, self.k + 1) * active.unsqueeze(1)).sum(0)

    def draft_rest(self, hm, d1, new_pos):
        """Drafts 2..k by running the MTP layer on its own hidden state. The k - 1 draft
        positions are known up front, so one meta serves every pass (sliced: views only)."""
        e = self.eng
        drafts = [d1]
        if self.k < 2:
            return d1.unsqueeze(1)
        pos = new_pos.unsqueeze(1) + torch.arange(self.k - 1, device=new_pos.device)
        full = self.meta(pos, [e.mtp_ratio])
        for j in range(self.k - 1):
            ml, h = e.model.mtp_forward_decode(hm.unsqueeze(1), drafts[-1].unsqueeze(1),
                                               full.column(j), e.cache.mtp, e.draft_backends)
            hm = h[:, 0]
            drafts.append(ml[:, 0].argmax(-1))
        return torch.stack(drafts, 1)

    # -- one decode step ----------------------------------------------------------------
    @torch.no_grad()
    def step(self):
        """One decode (k = 0) or draft-verify-accept (k >= 1) step for every request.

        Each stage runs under a ``torch.profiler.record_function`` label (``step.meta``,
        ``step.main``, ``step.accept``, ``step.mtp``, ``step.draft``, ``step.update``) so a
        profile of eager steps splits their kernels by stage; the labels cost nothing inside
        a CUDA graph replay."""
        e = self.eng
        active = self.n_out < self.max_new
        self.n_steps += active.any().long()
        if self.k == 0:
            toks = self.cur_tok.unsqueeze(1)
            with _stage("meta"):
                meta = self.meta(self.cur_pos.unsqueeze(1), e.ratios)
            with _stage("main"):
                logits, _ = e.model.forward_decode(toks, meta, e.cache.main, e.backends)
            with _stage("accept"):
                g = logits.argmax(-1)
                a = torch.zeros_like(self.cur_pos)
                self.commit(g, a, active)
            with _stage("update"):
                self.cur_tok.copy_(torch.where(active, g[:, 0], self.cur_tok))
                self.cur_pos.add_(active.long())
            return
        k = self.k
        with _stage("meta"):
            toks = torch.cat([self.cur_tok.unsqueeze(1), self.drafts], 1)
            pos = self.cur_pos.unsqueeze(1) + torch.arange(k + 1, device=toks.device)
            meta = self.meta(pos, e.ratios)
        with _stage("main"):
            logits, h = e.model.forward_decode(toks, meta, e.cache.main, e.backends)
        with _stage("accept"):
            g = logits.argmax(-1)                                            # [B, k+1]
            a = (self.drafts == g[:, :k]).long().cumprod(1).sum(1)           # accepted drafts
            self.commit(g, a, active)
        # draft the next k: MTP over the verified positions, then recursively
        # the MTP layer (compress ratio 0) reads only positions, slots and the window:
        # the verify's meta (same positions) serves it as is
        with _stage("mtp"):
            mmeta = meta if not e.mtp_ratio else self.meta(pos, [e.mtp_ratio])
            ml, mh = e.model.mtp_forward_decode(h, g, mmeta, e.cache.mtp, e.draft_backends)
            ia = a.view(-1, 1)
            d1 = ml.gather(1, ia.view(-1, 1, 1).expand(-1, 1, ml.shape[-1]))[:, 0].argmax(-1)
            hm = mh[torch.arange(self.B, device=a.device), a]
            new_pos = self.cur_pos + a + 1
        with _stage("draft"):
            drafts = self.draft_rest(hm, d1, new_pos)
        with _stage("update"):
            bonus = g.gather(1, ia)[:, 0]
            self.cur_tok.copy_(torch.where(active, bonus, self.cur_tok))
            self.cur_pos.copy_(torch.where(active, new_pos, self.cur_pos))
            self.drafts.copy_(torch.where(active.unsqueeze(1), drafts, self.drafts))

    def run_step(self):
        if self.graph is not None:
            self.graph.replay()
        else:
            self.step()

    def capture(self):
        """Warm up (compiles kernels; state is the dummy all-scratch one) and capture."""
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    self.step()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with runtime.cuda_graph_capture(g):
                self.step()
            torch.cuda.synchronize()
            self.graph = g
        except Exception as exc:  # an op that syncs with the host cannot be captured
            self.graph = None
            self.graph_error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            torch.cuda.synchronize()


class Engine:
    """Greedy generation from a :class:`~dsv4lab.model.DSV4` with a paged cache.

    ``backends`` / ``draft_backends``: op name -> backend for the main model / the MTP
    layer (the keys of :data:`dsv4lab.model.OPS`: "sparse_mla_decode", "indexer_topk", "fused_moe",
    "mhc", "linear"; missing = "auto").
    ``kv_format``: "bf16" (the model dtype) or "fp8" (584-byte rows; head_dim 512 only).
    ``cuda_graphs``: capture each step (default: on a GPU). ``dtype``: the model's float
    dtype for decoding (default fp32). ``cpu_threads``: torch intra-op threads while
    generating on the CPU (default 1: decode-sized ops only pay for thread hand-offs;
    restored afterwards; None leaves torch's setting alone).
    """

    def __init__(self, model: DSV4, *, max_batch: int = 8, max_len: int = 1024,
                 page_size: int = 16, kv_format: str = "bf16", dtype: torch.dtype | None = None,
                 device=None, backends: dict | None = None, draft_backends: dict | None = None,
                 cuda_graphs: bool | None = None, cpu_threads: int | None = 1):
        self.device = torch.device(device) if device is not None else runtime.device()
        # fp32 by default: the mini model is launch-bound, so fp32 costs ~nothing, and it
        # keeps the S_q = 1 decode and the S_q = k + 1 verify numerically interchangeable
        # (bf16 rounding differs with the GEMM shape and can flip near-tied argmaxes)
        self.dtype = dtype or torch.float32
        self.model = to_dtype(model, self.dtype).to(self.device).eval()
        self.cfg = model.cfg
        self.max_batch, self.max_len, self.page_size = max_batch, max_len, page_size
        self.backends = dict(backends or {})
        self.draft_backends = dict(draft_backends if draft_backends is not None else self.backends)
        self.moe_plans = self._resolve_backends(model, kv_format)
        self.ratios = [b.ratio for b in model.layers]
        self.mtp_ratio = model.mtp[0].block.ratio if len(model.mtp) else 0
        pos_ratios = [r for r in self.ratios + [self.mtp_ratio] if r]
        self.n_raw = math.ceil(max_len / page_size)
        if pos_ratios:
            self.n_comp = max(math.ceil(max_len / min(pos_ratios) / page_size),
                              math.ceil(self.cfg.index_topk / page_size), 1)
        else:
            self.n_comp = 1
        self.cache = PagedKVCache(model, 1 + max_batch * (self.n_raw + self.n_comp), page_size,
                                  kv_format=kv_format, dtype=self.dtype, device=self.device)
        self.cuda_graphs = (self.device.type == "cuda") if cuda_graphs is None else cuda_graphs
        self.cpu_threads = cpu_threads
        self._runners: dict = {}

    # -------------------------------------------------------------------------------
    def _resolve_backends(self, model: DSV4, kv_format: str) -> dict:
        """Resolve every op's backend now (BackendUnavailable here, before any kernel).

        The routed experts' format comes from the model (as from checkpoint metadata) and
        goes through :func:`dsv4lab.backends.resolve_moe_backend` for the main model and the
        draft alike.
        """
        target = B.Target.current(self.device)
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
            if model.expert_format != "bf16":
                plan = B.resolve_moe_backend(role, metadata={"expert_format": model.expert_format},
                                             moe_runner_backend=table.get("fused_moe", "auto"),
                                             target=target)
                table["fused_moe"] = plan.backend.name
                plans[role] = plan
        return plans

    def _runner(self, B: int, k: int) -> _Runner:
        key = (B, k)
        if key not in self._runners:
            r = _Runner(self, B, k)
            if self.cuda_graphs and self.device.type == "cuda":
                r.capture()
            self._runners[key] = r
        return self._runners[key]

    def admit(self, r: _Runner) -> list[int]:
        """Give each of the runner's ``B`` request slots its raw and compressed pages (the
        block tables); returns the pages, for :meth:`PagedKVCache.release`."""
        pages, bt, cbt = [], [], []
        try:
            for _ in range(r.B):
                raw, comp = self.cache.alloc(self.n_raw), self.cache.alloc(self.n_comp)
                pages += raw + comp
                bt.append(raw)
                cbt.append(comp)
        except RuntimeError:
            self.cache.release(pages)
            raise
        r.block_table.copy_(torch.tensor(bt, dtype=torch.int32))
        r.cblock_table.copy_(torch.tensor(cbt, dtype=torch.int32))
        return pages

    @torch.no_grad()
    def prefill(self, r: _Runner, prompts: list[list[int]], max_new: int) -> None:
        """Run the prompts; set the runner's pending token, position, outputs (and drafts)."""
        B, dev = len(prompts), self.device
        lens = torch.tensor([len(p) for p in prompts], device=dev)
        L = int(max(len(p) for p in prompts))
        toks = torch.zeros(B, L, dtype=torch.long, device=dev)
        for b, p in enumerate(prompts):
            toks[b, :len(p)] = torch.as_tensor(p, dtype=torch.long)
        pos = torch.arange(L, device=dev).expand(B, L)
        with torch.profiler.record_function("prefill.main"):
            meta = r.meta(pos, self.ratios)
            logits, h = self.model.forward_decode(toks, meta, self.cache.main, self.backends)
        last = (lens - 1).view(B, 1)
        first = logits.gather(1, last.unsqueeze(-1).expand(-1, 1, logits.shape[-1]))[:, 0].argmax(-1)
        r.out.zero_()
        r.out[:, 0] = first
        r.n_out.fill_(1)
        r.max_new.fill_(max_new)
        r.hist.zero_()
        r.n_steps.zero_()
        r.cur_tok.copy_(first)
        r.cur_pos.copy_(lens)
        if r.k:
            self._prefill_drafts(r, toks, pos, h, first, lens, last)

    def _prefill_drafts(self, r: _Runner, toks, pos, h, first, lens, last) -> None:
        """The MTP layer over the prompt (its cache), then the first k drafts."""
        B, dev = toks.shape[0], self.device
        with torch.profiler.record_function("prefill.mtp"):
            nt = torch.cat([toks[:, 1:], toks[:, :1]], 1)
            nt.scatter_(1, last, first.view(B, 1))
            ml, mh = self.model.mtp_forward_decode(h, nt, r.meta(pos, [self.mtp_ratio]),
                                                   self.cache.mtp, self.draft_backends)
            d1 = ml.gather(1, last.unsqueeze(-1).expand(-1, 1, ml.shape[-1]))[:, 0].argmax(-1)
            hm = mh[torch.arange(B, device=dev), lens - 1]
            r.drafts.copy_(r.draft_rest(hm, d1, lens))

    def generate(self, prompts, max_new_tokens: int, *, num_draft: int = 0,
                 progress: bool | None = None, sync_every: int = 16) -> Generation:
        threads = torch.get_num_threads()
        if self.device.type == "cpu" and self.cpu_threads:
            torch.set_num_threads(self.cpu_threads)
        try:
            return self._generate(prompts, max_new_tokens, num_draft, progress, sync_every)
        finally:
            torch.set_num_threads(threads)

    def _generate(self, prompts, max_new_tokens, num_draft, progress, sync_every) -> Generation:
        """Greedy continuation of each prompt (lists of token ids, or bytes/str for the
        byte-level mini model) by ``max_new_tokens`` tokens; ``num_draft`` MTP drafts per
        step (0 = plain decoding)."""
        prompts = [list(p.encode() if isinstance(p, str) else p) for p in prompts]
        B = len(prompts)
        if not 1 <= B <= self.max_batch:
            raise ValueError(f"prompts: need 1..max_batch={self.max_batch} prompts, got {B}")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("prompts: every prompt needs at least one token")
        if not 0 <= num_draft <= 3 or (num_draft and not len(self.model.mtp)):
            raise ValueError(f"num_draft must be 0..3 (and the model needs an MTP layer), got {num_draft}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        need = max(len(p) for p in prompts) + max_new_tokens + 2 * num_draft + 2
        if need > self.max_len:
            raise ValueError(f"prompt + max_new_tokens (+ {2 * num_draft + 2} for drafts) = {need} "
                             f"exceeds the engine's max_len={self.max_len}")
        V = self.cfg.vocab_size
        if any(t < 0 or t >= V for p in prompts for t in p):
            raise ValueError(f"prompts: token ids must lie in [0, {V})")
        r = self._runner(B, num_draft)
        pages = []
        try:
            pages = self.admit(r)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            self.prefill(r, prompts, max_new_tokens)
            show = progress if progress is not None else B * max_new_tokens >= 4096
            bar = None
            if show:
                from tqdm.auto import tqdm
                bar = tqdm(total=B * max_new_tokens, desc=f"generate (k={num_draft})", leave=False)
            # Launch steps in chunks, reading the outputs' counts between chunks. A chunk is
            # never longer than the steps the slowest request can still use (every step
            # gives each unfinished request 1..k+1 tokens): no step runs after all are done.
            launched, left = 0, max_new_tokens - 1   # the prefill made one token
            limit = left                             # every step makes >= 1 more
            while left > 0 and launched < limit:
                n = min(sync_every, -(-left // (num_draft + 1)), limit - launched)
                for _ in range(n):
                    r.run_step()
                launched += n
                n_out = r.n_out.clamp_max(max_new_tokens)
                counts = n_out.tolist()
                left = max_new_tokens - min(counts)
                if bar is not None:
                    bar.update(sum(counts) - bar.n)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            if bar is not None:
                bar.close()
            out = r.out[:, :max_new_tokens].tolist()
            hist = r.hist.tolist()
            steps = int(r.n_steps)
        finally:
            self.cache.release(pages)
        notes = [f"CUDA graph capture failed, ran eagerly: {r.graph_error}"] if r.graph_error else []
        return Generation(tokens=out, num_draft=num_draft, steps=steps, accept_hist=hist,
                          seconds=seconds, graphs=r.graph is not None, notes=notes)


def decode_text(tokens) -> str:
    """Bytes -> str for the byte-level mini model (invalid UTF-8 replaced)."""
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")
