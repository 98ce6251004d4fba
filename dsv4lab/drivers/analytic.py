"""The analytic model of a tensor-parallel decode step: every component at its roofline plus
ring all-reduces over the link.

Assumptions:

1. A ring all-reduce of ``B`` bytes over ``n`` ranks moves ``2(n-1)/n * B`` bytes over each
   link, one direction at a time, at the link's per-direction bandwidth; its time is
   ``latency + 2(n-1)/n * B / bandwidth`` with ``latency = base + 2(n-1) * hop`` (the ring's
   2(n-1) steps). ``n = 1`` costs nothing.
2. Links (:data:`LINKS`): PCIe Gen5 x16, 64 GB/s per direction nominal (the campaign's RTX
   PRO 6000 box; GPUs talk through the host's root complex, no NVLink); NVLink 4 on H200,
   900 GB/s bidirectional in the datasheet = 450 GB/s per direction. Bandwidth is nominal (a
   floor on the time); the latency terms (``base`` 8 us, ``hop`` 1 us PCIe / 0.5 us NVLink)
   are this workbook's assumptions, of the order of NCCL's own tuning model for small ring
   all-reduces (LL protocol); they dominate decode-sized messages.
3. Per layer two all-reduces of ``concurrency * hidden`` bf16 values (the attention output
   and the MoE output, before the mHC mixing); nothing overlaps them with compute.
4. Compute per rank from :func:`dsv4lab.anatomy.step_anatomy` on the box's GPU with
   ``num_heads / n`` heads and ``o_groups / n`` groups (attention FLOPs and query bytes,
   q-up and output projections shrink; the shared-KV bytes and the replicated q LoRA, KV,
   compressor, indexer projections and router do not); routed MoE, shared expert and LM head
   (vocab-parallel; its logits gather left out) divided by ``n``; indexer and mHC
   replicated. Every component at its roofline, as in ``anatomy``.

Explained in notebooks/06_decode_step_at_scale.ipynb ("Tensor parallelism").
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from dsv4lab import anatomy, roofline
from dsv4lab.config import DSV4Config

ACT_BYTES = 2                      # bf16 activations (the all-reduce payload)


def check_divisible(cfg: DSV4Config, world: int) -> None:
    """ValueError naming the first size that ``world`` ranks cannot split evenly."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    for name, v in (("num_heads", cfg.num_heads), ("o_groups", cfg.o_groups),
                    ("n_routed_experts", cfg.n_routed_experts),
                    ("moe_intermediate_size * n_shared_experts",
                     cfg.moe_intermediate_size * max(1, cfg.n_shared_experts))):
        if v % world:
            raise ValueError(f"{name} ({v}) is not divisible by the TP world size ({world})")


@dataclass(frozen=True)
class Link:
    """A GPU-GPU link for the ring model (assumptions 1-2)."""
    name: str
    bandwidth: float          # bytes/s per direction
    bidirectional: float      # bytes/s both directions (the datasheet's headline)
    base_latency: float       # s per all-reduce
    hop_latency: float        # s per ring step
    device: str               # the GPU of the box (a roofline.DEVICES key)
    source: str


PCIE_GEN5 = Link("PCIe Gen5 x16", 64e9, 128e9, 8e-6, 1.0e-6, "RTX PRO 6000 Blackwell",
                 "PCIe 5.0 x16: 32 GT/s x 16 lanes, 128b/130b = 63 GB/s, '64 GB/s per direction' "
                 "nominal; the campaign's RTX PRO 6000 box (no NVLink). Latencies: assumed.")
NVLINK_H200 = Link("NVLink 4 (H200)", 450e9, 900e9, 8e-6, 0.5e-6, "H200",
                   "NVIDIA H200 SXM datasheet: NVLink 900 GB/s (both directions) = 450 GB/s per "
                   "direction. Latencies: assumed.")
LINKS = OrderedDict([("pcie", PCIE_GEN5), ("nvlink", NVLINK_H200)])


def ring_factor(n: int) -> float:
    """Bytes a ring all-reduce moves over each link per byte of message: 2(n-1)/n."""
    if n < 1:
        raise ValueError(f"world size must be >= 1, got {n}")
    return 2.0 * (n - 1) / n


def allreduce_time(nbytes: float, n: int, link: Link) -> float:
    """Seconds for a ring all-reduce of ``nbytes`` over ``n`` ranks on ``link``:
    ``base + 2(n-1) * hop + 2(n-1)/n * nbytes / bandwidth`` (0 when n == 1).
    Explained in notebooks/06_decode_step_at_scale.ipynb."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if n == 1:
        return 0.0
    return link.base_latency + 2 * (n - 1) * link.hop_latency + ring_factor(n) * nbytes / link.bandwidth


ANALYTIC_GROUPS = ("attention", "indexer", "MoE", "all-reduce", "projections", "mHC", "LM head + embedding")
_SHARDED_BY_N = ("routed MoE", "shared expert", "LM head + embedding")


def analytic_step(cfg: DSV4Config, *, tp: int, concurrency: int, context: int, link: Link | str = "pcie",
                  device: str | None = None, max_context: int | None = None,
                  weight_format: str = "mxfp4", indexer: str = "triton") -> dict:
    """One TP decode step of the whole model at the roofline plus ring all-reduces
    (assumptions 1-4). ``link`` a :class:`Link` or a :data:`LINKS` key; ``device`` defaults
    to the link's box. Returns ms per group (``ms_<group>``), ``step_ms``, ``tokens_per_s``
    and ``allreduce_share``.
    Explained in notebooks/06_decode_step_at_scale.ipynb.
    """
    link = LINKS[link] if isinstance(link, str) else link
    check_divisible(cfg, tp)
    spec = roofline.device_spec(device or link.device)
    rank_cfg = cfg.replace(num_heads=cfg.num_heads // tp, o_groups=cfg.o_groups // tp)
    rows = anatomy.step_anatomy(rank_cfg, concurrency=concurrency, context=context, max_context=max_context,
                                weight_format=weight_format, indexer=indexer, device=spec)
    ms = {g: 0.0 for g in ANALYTIC_GROUPS}
    for r in rows:
        s = r["roofline_s"] / (tp if r["group"] in _SHARDED_BY_N else 1)
        g = {"routed MoE": "MoE", "shared expert": "MoE"}.get(r["group"], r["group"])
        ms[g] += s * 1e3
    nbytes = concurrency * cfg.hidden_size * ACT_BYTES
    calls = 2 * cfg.num_layers
    ms["all-reduce"] = calls * allreduce_time(nbytes, tp, link) * 1e3
    step_ms = sum(ms.values())
    out = {"kind": "analytic", "model": cfg.name, "tp": tp, "concurrency": concurrency, "context": context,
           "link": link.name, "link_gbs_per_direction": link.bandwidth / 1e9, "device": spec.name,
           "weight_format": weight_format, "indexer": indexer, "allreduce_bytes": nbytes,
           "allreduce_calls": calls, "step_ms": step_ms, "tokens_per_s": concurrency * 1e3 / step_ms,
           "allreduce_share": ms["all-reduce"] / step_ms,
           # does a rank hold its share of the routed experts? (the rest of the weights is small)
           "expert_gb_per_rank": anatomy.model_summary(cfg, weight_format=weight_format)["routed_expert_bytes"] / tp / 1e9,
           "device_memory_gb": spec.memory_bytes / 1e9}
    out.update({f"ms_{g}": v for g, v in ms.items()})
    return out


def analytic_rows(cfg: DSV4Config | None = None, *, tps=(1, 2, 4), concurrencies=(1, 8, 64),
                  context: int = 512, links=("pcie", "nvlink")) -> list[dict]:
    """:func:`analytic_step` over a grid (the rows ``dsv4lab bench tp`` records)."""
    cfg = cfg or DSV4Config.flash()
    return [analytic_step(cfg, tp=n, concurrency=c, context=context, link=k)
            for k in links for n in tps for c in concurrencies]
