"""Tensor parallelism for one DeepSeek-V4 decoder layer, and where its all-reduce goes.

The campaign served DeepSeek-V4-Flash with tensor parallelism (TP) over PCIe GPUs and found
NCCL's all-reduce at the PCIe floor, 23% of the step. This module shards one real-size layer
(:class:`dsv4lab.model.Block`) across the ranks of a ``torch.distributed`` group, times its
decode step component by component and measures the all-reduce's bandwidth;
:mod:`dsv4lab.drivers.analytic` models the same step over PCIe Gen5 and NVLink.

How the layer is split (:class:`TPLayer`; ``n`` = world size, ``r`` = this rank):

- attention: the 64 query heads split into ``n`` contiguous blocks; rank r keeps the rows of
  ``wq_b`` for its heads, their sinks, and the output groups those heads feed (heads are
  grouped contiguously, so ``o_groups`` must be a multiple of ``n``): its slice of ``wo_a``
  and the matching input columns of ``wo_b`` (a row-parallel projection). The q LoRA, the
  **shared latent KV** (and its cache), the compressor and the lightning indexer are
  replicated: every rank writes the same cache and reads all of it for its own heads (MQA:
  the KV bytes do not shrink with TP). Each rank's attention output is a partial sum ->
  **all-reduce #1**.
- MoE: the router is replicated; the routed experts split into ``n`` contiguous blocks
  (expert parallelism inside the TP group): a rank runs ``ops.fused_moe`` over its experts
  only, the other experts' ids set to -1 (skipped). The shared expert is split on its
  intermediate dimension. Routed + shared partial sums -> **all-reduce #2**.
- mHC, the norms and the residual streams are replicated.

The layers come from :class:`dsv4lab.drivers.step.StepDriver` (random real-size weights,
paged caches sized for the max context) and are broadcast from rank 0, so every rank holds
the same weights and caches. With world size 1 the same code runs with no process group.
Process groups: ``"nccl"`` on GPUs, ``"gloo"`` on the CPU; NVLink multicast (NVLS) is never
used: :func:`init` sets ``NCCL_NVLS_ENABLE=0`` before NCCL starts.

Timing (:func:`profile`): a mark after each component; on GPUs one CUDA graph with timing
events between the components and the NCCL all-reduces inside it (every rank falls back to
eager events together when capture fails); medians over replays per rank, then the mean
over ranks. An all-reduce's time includes waiting for the slowest rank: that wait is part of
what TP costs. A 43-layer step is extrapolated as in :func:`dsv4lab.drivers.step.extrapolate`
(head and embedding excluded).

All-reduce bandwidth (:func:`allreduce_sweep`): a fixed count of back-to-back
``dist.all_reduce`` calls between two CUDA events, the same count on every rank (an adaptive
timer picks its repetition count per rank, and ranks that disagree deadlock inside NCCL), the
max over ranks. ``busbw = bytes / t * 2(n-1)/n`` (nccl-tests' convention).

Run it with :func:`dsv4lab.drivers.tp_run.run` under torchrun; ``dsv4lab bench tp`` launches
TP 1, 2, 4 (as many as the GPUs allow). Explained in notebooks/06_decode_step_at_scale.ipynb.
"""
from __future__ import annotations

import math
import os
import statistics
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dsv4lab import model as M
from dsv4lab import ops, runtime
from dsv4lab.config import DSV4Config
from dsv4lab.drivers.analytic import ACT_BYTES, LINKS, NVLINK_H200, allreduce_time, check_divisible, ring_factor
from dsv4lab.drivers.presets import TORCH_REFERENCE, StepConfig, preset
from dsv4lab.drivers.step import StepDriver, StepState, layer_counts, rel_error
from dsv4lab.drivers.timing import Marks, capture, mode_of, no_mark, segment_medians
from dsv4lab.ops.moe import swiglu

COMPONENTS = ("mhc", "qkv", "compressor", "indexer", "attention", "out_proj", "allreduce_attn",
              "moe", "allreduce_moe")
GROUPS = OrderedDict([
    ("attention", ("attention",)),
    ("indexer", ("indexer",)),
    ("MoE", ("moe",)),
    ("all-reduce", ("allreduce_attn", "allreduce_moe")),
    ("projections", ("qkv", "compressor", "out_proj")),
    ("mHC", ("mhc",)),
])

# TP output vs world size 1, relative L2 error (same weights, caches and backends; only the
# order of summation differs). fp32: the split sums of wo_b / experts / shared expert
# reassociate fp32 additions (~1e-7 a term). bf16: every rank rounds its partial sum to bf16
# (2^-9 relative) before the bf16 all-reduce, which rounds again per ring step; the residual
# streams, identical on both sides, dominate a layer's output.
TOL_FP32 = 1e-4
TOL_BF16 = 2e-2


# ---- the process group ------------------------------------------------------------------------

@dataclass(frozen=True)
class Dist:
    """Where this process sits: rank, world size, device, backend (None: no group)."""
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: str | None = None

    @property
    def group(self):
        return None       # the default group (one TP group spans the whole world)

    @property
    def gpu(self) -> bool:
        return self.device.type == "cuda"


def init(backend: str | None = None) -> Dist:
    """Join the process group torchrun describes (RANK/WORLD_SIZE/LOCAL_RANK) or, without
    those variables, run alone (world size 1, no group).

    ``backend`` defaults to "nccl" with CUDA and "gloo" without. ``NCCL_NVLS_ENABLE=0`` is
    set first: NVLink multicast is never used.
    """
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    cuda = runtime.has_cuda()
    backend = backend or ("nccl" if cuda else "gloo")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
    if backend == "nccl" and not cuda:
        raise ValueError("backend 'nccl' needs CUDA GPUs; use 'gloo' on the CPU")
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return Dist(device=torch.device("cuda", 0) if cuda else torch.device("cpu"))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    if backend == "nccl":
        if local >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK {local} but only {torch.cuda.device_count()} GPU(s) visible")
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cuda", local) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group(backend)
    return Dist(rank, world, local, device, backend)


def all_reduce(t: torch.Tensor, d: Dist) -> torch.Tensor:
    """Sum ``t`` over the ranks in place (nothing at world size 1); returns ``t``."""
    if d.world > 1:
        dist.all_reduce(t, group=d.group)
    return t


def broadcast_tensors(tensors, d: Dist, src: int = 0):
    """Make every rank's copy of ``tensors`` equal rank ``src``'s (bytes, any dtype)."""
    if d.world == 1:
        return
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        flat = t.detach().reshape(-1)
        if flat.data_ptr() != t.data_ptr() or not t.is_contiguous():
            raise ValueError("broadcast_tensors needs contiguous tensors")
        dist.broadcast(flat.view(torch.uint8), src, group=d.group)


def gather(obj, d: Dist) -> list:
    """Every rank's ``obj`` (picklable), in rank order."""
    if d.world == 1:
        return [obj]
    out = [None] * d.world
    dist.all_gather_object(out, obj)
    return out


def _agree(ok: bool, d: Dist) -> bool:
    """True only if every rank says True."""
    if d.world == 1:
        return ok
    t = torch.tensor([1 if ok else 0], dtype=torch.int32,
                     device=d.device if d.backend == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _barrier(d: Dist):
    if d.world > 1:
        dist.barrier()


# ---- the sharded layer ------------------------------------------------------------------------

class TPLayer(nn.Module):
    """Rank ``rank``'s shard of a :class:`dsv4lab.model.Block` (module docstring).

    Built from a full block (the same weights on every rank); the sharded weights are copied
    out and, unless ``keep_full``, the full ones are freed (the forward never reads them).
    ``forward(x, tokens, meta, cache, backends, mark, taps)`` is ``Block.forward_decode``
    with the two all-reduces; ``taps`` receives the attention input/output and the MoE
    input/output.
    """

    def __init__(self, blk: M.Block, d: Dist, *, keep_full: bool = False):
        super().__init__()
        cfg = blk.attn.cfg
        check_divisible(cfg, d.world)
        self.blk, self.dist = blk, d
        n, r = d.world, d.rank
        attn, moe = blk.attn, blk.moe
        H, D, G, R = cfg.num_heads, cfg.head_dim, cfg.o_groups, cfg.o_lora_rank
        self.n_heads, self.o_groups = H // n, G // n
        h0, g0 = r * self.n_heads, r * self.o_groups
        take = lambda t, dim, a, b: t.detach().narrow(dim, a, b - a).clone()  # noqa: E731
        self.register_buffer("wq_b", take(attn.wq_b.weight, 0, h0 * D, (h0 + self.n_heads) * D))
        self.register_buffer("sink", take(attn.attn_sink, 0, h0, h0 + self.n_heads))
        self.register_buffer("wo_a", take(attn.wo_a, 0, g0, g0 + self.o_groups))
        self.register_buffer("wo_b", take(attn.wo_b.weight, 1, g0 * R, (g0 + self.o_groups) * R))
        # routed experts: a contiguous block per rank
        E = moe.n_experts
        self.n_experts = E // n
        self.expert0 = r * self.n_experts
        self.fmt = moe.fmt
        names = ["w13", "w2"] + (["w13_scale", "w2_scale"] if moe.fmt != "bf16" else []) \
            + (["w13_global", "w2_global"] if moe.fmt == "nvfp4" else [])
        self._expert_names = names
        for name in names:
            t = getattr(moe, name)
            if t.dim() == 0:                      # a global scale shared by all experts
                self.register_buffer(name, t.detach().clone())
            else:
                self.register_buffer(name, take(t, 0, self.expert0, self.expert0 + self.n_experts))
        # shared expert: split on the intermediate dimension
        self.has_shared = moe.shared is not None
        if self.has_shared:
            I = moe.shared.w2.weight.shape[1]
            Il = I // n
            w13 = moe.shared.w13.weight
            self.register_buffer("s_w13", torch.cat([take(w13, 0, r * Il, (r + 1) * Il),
                                                     take(w13, 0, I + r * Il, I + (r + 1) * Il)]))
            self.register_buffer("s_w2", take(moe.shared.w2.weight, 1, r * Il, (r + 1) * Il))
        if not keep_full:
            self._free_full()

    def _free_full(self):
        attn, moe = self.blk.attn, self.blk.moe
        empty = lambda t: torch.empty(0, dtype=t.dtype, device=t.device)  # noqa: E731
        attn.wq_b.weight = nn.Parameter(empty(attn.wq_b.weight), requires_grad=False)
        attn.wo_b.weight = nn.Parameter(empty(attn.wo_b.weight), requires_grad=False)
        attn.wo_a = nn.Parameter(empty(attn.wo_a), requires_grad=False)
        attn.attn_sink = nn.Parameter(empty(attn.attn_sink), requires_grad=False)
        for name in self._expert_names:
            t = getattr(moe, name)
            if t.dim():
                setattr(moe, name, empty(t) if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter)
                        else nn.Parameter(empty(t), requires_grad=False))
        if self.has_shared:
            moe.shared.w13.weight = nn.Parameter(empty(moe.shared.w13.weight), requires_grad=False)
            moe.shared.w2.weight = nn.Parameter(empty(moe.shared.w2.weight), requires_grad=False)

    def _out(self, o, pos):
        """This rank's heads [.., H/n, D] -> its partial sum of the output [.., d]."""
        attn = self.blk.attn
        o = M.rope_tail(o, pos, attn.rope_dim, attn.cfg.rope_theta, inverse=True, heads=True)
        o = o.flatten(-2).unflatten(-1, (self.o_groups, -1))
        o = torch.einsum("...gk,gok->...go", o, self.wo_a.to(o.dtype))
        return F.linear(o.flatten(-2), self.wo_b.to(o.dtype))

    def moe_partial(self, x, tokens, backends: dict | None = None):
        """x [T, d] -> this rank's partial MoE output [T, d] (its experts + its slice of the
        shared expert)."""
        backends = backends or {}
        moe = self.blk.moe
        ids, w = moe.route_decode(x, tokens)      # the replicated router, as MoE.forward_decode
        ids = ids.long()
        local = (ids >= self.expert0) & (ids < self.expert0 + self.n_experts)
        lids = torch.where(local, ids - self.expert0, torch.full_like(ids, -1))
        if self.fmt == "bf16":
            combine = torch.zeros(x.shape[0], self.n_experts, device=x.device, dtype=torch.float32)
            combine.scatter_add_(1, lids.clamp_min(0), torch.where(local, w.float(), torch.zeros_like(w.float())))
            h = torch.einsum("nd,efd->nef", x, self.w13.to(x.dtype))
            a = swiglu(h, moe.limit) * combine.unsqueeze(-1).to(h.dtype)
            y = torch.einsum("nei,edi->nd", a, self.w2.to(a.dtype))
        else:
            kw = dict(w13_global=self.w13_global, w2_global=self.w2_global) if self.fmt == "nvfp4" else {}
            y = ops.fused_moe(x, self.w13, self.w13_scale, self.w2, self.w2_scale, lids.int(), w,
                              fmt=self.fmt, swiglu_limit=moe.limit,
                              backend=backends.get("fused_moe", "auto"), validate=False, **kw)
        if self.has_shared:
            y = y + F.linear(swiglu(F.linear(x, self.s_w13.to(x.dtype)), moe.limit), self.s_w2.to(x.dtype))
        return y.to(x.dtype)

    @torch.no_grad()
    def forward(self, x, tokens, meta: M.DecodeMeta, cache: M.LayerCache, backends: dict | None = None,
                mark: Callable = no_mark, taps: dict | None = None):
        """x [B, S, n, d], tokens [B, S] -> x [B, S, n, d] (the same on every rank)."""
        be = backends or {}
        blk, attn = self.blk, self.blk.attn
        cfg = attn.cfg
        y, post, comb = blk.hc_attn.pre(x, be)
        mark("mhc")
        h = blk.attn_norm(y)
        if taps is not None:
            taps["attn_in"] = h
        pos = meta.positions
        qr = attn.q_norm(attn.wq_a(h))
        q = F.linear(qr, self.wq_b.to(qr.dtype)).unflatten(-1, (self.n_heads, attn.head_dim))
        q = M.rope_tail(M.rms_norm(q, None, cfg.rms_norm_eps), pos, attn.rope_dim, cfg.rope_theta, heads=True)
        kv = M.rope_tail(attn.kv_norm(attn.wkv(h)), pos, attn.rope_dim, cfg.rope_theta)
        idx = attn.write_and_select(h, qr, kv, meta, cache, be, mark)
        o = attn.attend(q.to(h.dtype).contiguous(), idx, cache, be, sink=self.sink)
        mark("attention")
        a = self._out(o.to(h.dtype), pos).contiguous()
        mark("out_proj")
        all_reduce(a, self.dist)
        mark("allreduce_attn")
        if taps is not None:
            taps["attention"] = a
        x = M.HyperConnection.post(a, x, post, comb, be)
        y, post, comb = blk.hc_ffn.pre(x, be)
        mark("mhc")
        B, S_, d = y.shape
        m_in = blk.ffn_norm(y).reshape(B * S_, d)
        m = self.moe_partial(m_in, tokens.reshape(-1), be).contiguous()
        mark("moe")
        all_reduce(m, self.dist)
        mark("allreduce_moe")
        if taps is not None:
            taps["moe_in"], taps["moe"] = m_in, m
        x = M.HyperConnection.post(m.view(B, S_, d), x, post, comb, be)
        mark("mhc")
        return x


# ---- the driver: layers, caches, the step ------------------------------------------------------

def model_config(name: str) -> DSV4Config:
    """"flash" (real size), "mini", or "tiny" (:func:`dsv4lab.model.tiny_config`)."""
    if name == "flash":
        return DSV4Config.flash()
    if name == "mini":
        return DSV4Config.mini()
    if name == "tiny":
        return M.tiny_config()
    raise ValueError(f"model must be 'flash', 'mini' or 'tiny', got {name!r}")


def step_config(name: str, cfg: DSV4Config, max_context: int | None = None) -> StepConfig:
    """A :mod:`dsv4lab.drivers.presets` preset by name, or "torch" (the references), for ``cfg``."""
    sc = TORCH_REFERENCE if name == "torch" else preset(name)
    if max_context is not None:
        sc = sc.replace(max_context=max_context)
    return sc.for_model(cfg)


class TPDriver:
    """The real-size layers of :class:`dsv4lab.drivers.step.StepDriver` (one per attention
    kind), identical on every rank (broadcast from rank 0) and sharded into :class:`TPLayer`.

    ``kinds`` picks the compress ratios built (default all of the config's); ``dtype``
    float32 casts the float weights and caches (exact CPU checks); ``keep_full`` keeps the
    unsharded weights for :meth:`reference`.
    """

    def __init__(self, cfg: DSV4Config, d: Dist, *, kinds=None, seed: int = 0,
                 dtype: torch.dtype = torch.bfloat16, keep_full: bool = False):
        check_divisible(cfg, d.world)
        self.cfg, self.dist, self.dtype = cfg, d, dtype
        self.driver = StepDriver(cfg, device=d.device, seed=seed, with_head=False)
        if kinds is not None:
            missing = [k for k in kinds if k not in self.driver.layers]
            if missing:
                raise ValueError(f"kinds {missing} not in this config's compress ratios "
                                 f"{sorted(self.driver.layers)}")
            self.driver.layers = OrderedDict((k, v) for k, v in self.driver.layers.items() if k in kinds)
            self.driver.layer_ids = OrderedDict((k, v) for k, v in self.driver.layer_ids.items() if k in kinds)
        for blk in self.driver.layers.values():
            if dtype != torch.bfloat16:
                M.to_dtype(blk, dtype)
            broadcast_tensors(list(blk.parameters()) + list(blk.buffers()), d)
        self.layers = OrderedDict((r, TPLayer(blk, d, keep_full=keep_full))
                                  for r, blk in self.driver.layers.items())

    def prepare(self, sc: StepConfig, *, batch: int, context: int, seed: int = 1) -> StepState:
        """The step's caches and inputs (:meth:`dsv4lab.drivers.step.StepDriver.prepare`), the
        same on every rank."""
        st = self.driver.prepare(sc, batch=batch, context=context, seed=seed)
        if self.dtype != torch.bfloat16:
            st.x = st.x.to(self.dtype)
            for c in st.caches.values():
                for f in ("kv", "comp_kv", "comp_gate", "idx_kv", "idx_gate"):
                    t = getattr(c, f)
                    if t is not None and t.dtype == torch.bfloat16:
                        setattr(c, f, t.to(self.dtype))
        ts = [st.x, st.tokens]
        for c in st.caches.values():
            ts += [c.kv, c.comp_kv, c.comp_gate, c.idx_kv, c.idx_gate, c.idx_keys, c.idx_scale]
        broadcast_tensors(ts, self.dist)
        return st

    @torch.no_grad()
    def run(self, st: StepState, mark: Callable = no_mark, taps: dict | None = None) -> dict:
        """One step: every layer kind on ``st.x`` -> {ratio: output streams}."""
        be = st.step.backends()
        out = {}
        for r, layer in self.layers.items():
            st.metas[r].memo.clear()               # RoPE tables are part of each step's work
            t = {} if taps is not None else None
            out[r] = layer(st.x, st.tokens, st.metas[r], st.caches[r], be, lambda c, r=r: mark(r, c), t)
            if taps is not None:
                taps[r] = t
        return out

    @torch.no_grad()
    def reference(self, st: StepState, taps: dict) -> dict:
        """World-size-1 references from the full weights (``keep_full=True``): per kind the
        whole layer (``Block.forward_decode``) and, given the TP run's ``taps``, the attention
        and MoE outputs on the same inputs. Returns {name: (ref, tp)} ("layer r": ref only)."""
        be = st.step.backends()
        pairs = {}
        for r, layer in self.layers.items():
            blk = layer.blk
            if blk.attn.wq_b.weight.numel() == 0:
                raise ValueError("reference() needs TPDriver(..., keep_full=True)")
            t = taps[r]
            pairs[f"layer {r}"] = blk.forward_decode(st.x, st.tokens, st.metas[r], st.caches[r], be)
            pairs[f"attention {r}"] = (blk.attn.forward_decode(t["attn_in"], st.metas[r], st.caches[r], be),
                                       t["attention"])
            pairs[f"moe {r}"] = (blk.moe.forward_decode(t["moe_in"], st.tokens.reshape(-1), be), t["moe"])
        return pairs


def check(drv: TPDriver, st: StepState) -> dict:
    """Relative L2 error of TP against world size 1, per kind: the layer's output streams, the
    attention output and the MoE output (both after their all-reduce, against the full modules
    on the same inputs). Needs ``keep_full=True``.
    Explained in notebooks/06_decode_step_at_scale.ipynb.
    """
    taps: dict = {}
    out = drv.run(st, taps=taps)
    pairs = drv.reference(st, taps)
    errs = {}
    for name, v in pairs.items():
        if name.startswith("layer"):
            errs[name] = rel_error(out[int(name.split()[1])], v)
        else:
            errs[name] = rel_error(v[1], v[0])
    return errs


# ---- timing ----------------------------------------------------------------------------------

def profile(drv: TPDriver, st: StepState, *, reps: int | None = None, graph: bool = True) -> dict:
    """Time one step per component on this rank (module docstring).

    Returns {"kind_ms": {ratio: {component: ms}}, "timing", "mode", "reps", "timing_note"?}.
    Every rank calls it with the same arguments (the collectives must match).
    """
    d = drv.dist
    if not d.gpu:
        marks = Marks("wall")
        samples = []
        drv.run(st)                                    # warm-up
        for _ in range(reps or 3):
            _barrier(d)
            marks.begin()
            drv.run(st, marks)
            samples.append(marks.segments())
        return _summarise(drv, samples, "interpreter_wall" if runtime.is_interpreter() else "cpu_wall")
    reps = reps or 10
    torch.cuda.synchronize()
    drv.run(st)                                        # compile, NCCL set-up
    torch.cuda.synchronize()
    note = ""
    g = marks = None
    ok = graph and st.step.capturable
    if ok:
        try:
            marks = Marks("graph_events")
            g = capture(drv.run, st, marks, free_cache=False)
        except Exception as e:  # capture unsupported here: every rank falls back together
            note = f"graph capture failed: {type(e).__name__}: {e}"[:300]
            ok, g = False, None
            torch.cuda.synchronize()
    elif graph:
        note = f"preset {st.step.name!r} cannot be captured: eager events"
    ok = _agree(ok, d)
    samples = []
    timing = "eager_events"
    if ok:
        timing = "cuda_graph_events"
        for _ in range(reps + 1):
            _barrier(d)
            g.replay()
            torch.cuda.synchronize()
            samples.append(marks.segments())
        samples = samples[1:]
        bad = any(not math.isfinite(ms) or ms < 0 for seg in samples for _, _, ms in seg)
        if not _agree(not bad, d):
            ok, note = False, "non-finite or negative event times from the graph: eager events"
    del g
    if not ok:
        timing = "eager_events"
        if graph and not note:
            note = "graph capture failed on another rank: eager events"
        marks = Marks("events")
        samples = []
        for _ in range(reps):
            _barrier(d)
            marks.begin()
            drv.run(st, marks)
            torch.cuda.synchronize()
            samples.append(marks.segments())
    res = _summarise(drv, samples, timing)
    if note:
        res["timing_note"] = note
    return res


def _summarise(drv, samples, timing):
    med = segment_medians(samples)
    kind_ms = {r: {c: med.get((r, c), 0.0) for c in COMPONENTS} for r in drv.layers}
    return {"kind_ms": kind_ms, "timing": timing, "mode": mode_of(timing), "reps": len(samples)}


def step_row(drv: TPDriver, st: StepState, profiles: list[dict], *, errors: dict | None = None) -> dict:
    """A result row from every rank's :func:`profile`: per component the mean over ranks,
    extrapolated to the model's layers (head excluded); the all-reduce's share; the
    NVLink/PCIe model of the same all-reduces."""
    cfg, d, sc = drv.cfg, drv.dist, st.step
    counts = layer_counts(cfg)
    kinds = list(drv.layers)
    kind_ms = {r: {c: statistics.fmean(p["kind_ms"][r][c] for p in profiles) for c in COMPONENTS}
               for r in kinds}
    row = {
        "kind": "measured", "model": cfg.name, "tp": d.world, "backend": d.backend or "none",
        "device": runtime.device_name() if d.gpu else "cpu",
        "preset": sc.name, "attention": sc.attention, "indexer": sc.indexer, "kv_cache": sc.kv_cache,
        "moe": sc.moe, "dtype": str(drv.dtype).replace("torch.", ""),
        "concurrency": st.batch, "context": st.context, "max_context": sc.max_context,
        "timing": profiles[0]["timing"], "mode": profiles[0].get("mode", mode_of(profiles[0]["timing"])),
        "reps": profiles[0]["reps"],
        "layers_measured": {str(r): drv.driver.layer_ids[r] for r in kinds},
        "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
    }
    notes = sorted({p["timing_note"] for p in profiles if p.get("timing_note")})
    if notes:
        row["timing_note"] = "; ".join(notes)[:400]
    full = all(r in kind_ms for r in counts)
    weights = counts if full else {r: 1 for r in kinds}
    row["extrapolated"] = bool(full)
    row["layer_counts"] = {str(r): n for r, n in weights.items()}
    for c in COMPONENTS:
        row[f"ms_{c}"] = sum(n * kind_ms[r][c] for r, n in weights.items())
    row["step_ms"] = sum(row[f"ms_{c}"] for c in COMPONENTS)
    row["ms"] = row["step_ms"]
    row["tokens_per_s"] = st.batch * 1e3 / row["step_ms"] if row["step_ms"] > 0 else None
    row["head"] = "excluded"            # embedding and LM head are not in step_ms
    row["allreduce_ms"] = row["ms_allreduce_attn"] + row["ms_allreduce_moe"]
    row["allreduce_share"] = row["allreduce_ms"] / row["step_ms"] if row["step_ms"] > 0 else None
    for r in kinds:
        row[f"layer_ms_r{r}"] = sum(kind_ms[r].values())
    row["components_by_kind"] = {str(r): v for r, v in kind_ms.items()}
    row["rank_step_ms"] = [sum(n * sum(p["kind_ms"][r].values()) for r, n in weights.items()) for p in profiles]
    nbytes = st.batch * cfg.hidden_size * ACT_BYTES
    n_calls = 2 * sum(weights.values())
    row["allreduce_bytes"] = nbytes
    row["allreduce_calls"] = n_calls
    for key, link in LINKS.items():
        row[f"model_allreduce_ms_{key}"] = n_calls * allreduce_time(nbytes, d.world, link) * 1e3
    if errors is not None:
        row["check_rel_err"] = errors
        row["check_tol"] = TOL_FP32 if drv.dtype == torch.float32 else TOL_BF16
        row["check_ok"] = max(errors.values()) <= row["check_tol"]
    return row


# ---- all-reduce bandwidth ------------------------------------------------------------------------

def _iters(nbytes: int) -> int:
    return 100 if nbytes < (1 << 20) else (40 if nbytes < (16 << 20) else 10)


def allreduce_sweep(sizes, d: Dist, *, dtype=torch.bfloat16, trials: int = 3) -> list[dict]:
    """Measured all-reduce time and bandwidth for each message size (bytes), max over ranks.

    A fixed count of back-to-back eager all-reduces between two events (the same on every
    rank; module docstring), the median of ``trials``. Rows: bytes, us, algbw_gbs, busbw_gbs,
    against NVLink's datasheet and the analytic model. Every rank calls it.
    Explained in notebooks/06_decode_step_at_scale.ipynb.
    """
    rows = []
    esize = torch.tensor([], dtype=dtype).element_size()
    for nbytes in sizes:
        numel = max(1, int(nbytes) // esize)
        nb = numel * esize
        if d.world == 1:
            rows.append({"kind": "allreduce", "tp": 1, "bytes": nb, "us": 0.0, "algbw_gbs": None,
                         "busbw_gbs": None, "note": "world size 1: no all-reduce"})
            continue
        buf = torch.randn(numel, device=d.device).to(dtype)
        n_it = _iters(nb)
        times = []
        for _ in range(2):
            dist.all_reduce(buf)
        for _ in range(trials):
            _barrier(d)
            if d.gpu:
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(n_it):
                    dist.all_reduce(buf)
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b) * 1e3 / n_it)
            else:
                t0 = time.perf_counter()
                for _ in range(n_it):
                    dist.all_reduce(buf)
                times.append((time.perf_counter() - t0) * 1e6 / n_it)
            # (the sums may overflow to inf over the iterations: NCCL's time does not depend on values)
        us = statistics.median(times)
        t = torch.tensor([us], dtype=torch.float64)
        if d.backend == "nccl":
            t = t.to(d.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        us = float(t.item())
        alg = nb / (us * 1e-6) / 1e9
        bus = alg * ring_factor(d.world)
        model_us = allreduce_time(nb, d.world, NVLINK_H200) * 1e6
        rows.append({
            "kind": "allreduce", "tp": d.world, "backend": d.backend, "bytes": nb,
            "dtype": str(dtype).replace("torch.", ""), "iters": n_it, "us": us, "mode": "eager",
            "algbw_gbs": alg, "busbw_gbs": bus,
            "device": runtime.device_name() if d.gpu else "cpu",
            "timing": "cuda_events_fixed_count" if d.gpu else "cpu_wall_fixed_count",
            "nvlink_datasheet_gbs": NVLINK_H200.bidirectional / 1e9,
            "nvlink_per_direction_gbs": NVLINK_H200.bandwidth / 1e9,
            "busbw_fraction_nvlink": bus * 1e9 / NVLINK_H200.bandwidth,
            "model_nvlink_us": model_us, "measured_over_model": us / model_us if model_us else None,
            "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
        })
    return rows
