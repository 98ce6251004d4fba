"""The anatomy of one decode step: bytes moved and FLOPs per component, and their roofline.

Everything here is arithmetic on a :class:`~dsv4lab.config.DSV4Config`; nothing is typed
in. :func:`step_anatomy` answers "where does one DeepSeek-V4-Flash decode step spend its
time, at this concurrency and context, if every component ran at the roof of this GPU?"

A decode step: ``concurrency`` sequences each produce one token (one query per
sequence) with ``context`` tokens already in their caches. The components, summed over
the main model's ``num_layers`` layers:

- attention: sparse MLA over the sliding window plus compressed entries, one row per
  layer kind (compress ratio 0: window only; 4: top-``index_topk`` entries chosen by the
  indexer; any other ratio, e.g. 128: every compressed entry);
- indexer: the lightning indexer of the ratio-4 layers scores compressed keys. The
  ``"triton"`` kernel scores the entries that exist (context / 4); the ``"fallback"``
  scores ``max_context / 4`` entries whatever the context (the campaign's bottleneck);
- routed MoE: the experts the step's tokens hit, in the expert weight format;
- shared expert, projections (q LoRA, KV, grouped output, compressors, indexer
  projections, router), mHC (hyper-connection mixing), and the LM head with the
  embedding lookup.

Assumptions (each is a choice a reader may change, so they are all here):

1. Weights of the non-expert linear layers are FP8 e4m3 (1 byte a parameter plus one
   fp32 scale per 128x128 block); the router and the LM head are bf16; the mHC mixing
   projection is fp32; routed experts use ``weight_format`` (MXFP4: 0.5 byte a parameter
   plus one E8M0 byte per 32; NVFP4: plus one e4m3 byte per 16; FP8: 1 byte plus a scale
   per 128x128 block; bf16: 2 bytes). Norm weights and biases are ignored (a few KB).
2. Activations are bf16 (2 bytes); each matmul reads its input and writes its output
   once; the residual streams of mHC are bf16.
3. Every KV entry (window or compressed) uses the FP8 layout of 584 bytes
   (``KV_ENTRY_BYTES``); an indexer key is ``index_head_dim`` e4m3 bytes plus an fp32
   scale; the indexer writes fp32 logits for every scored entry and top-k reads them back.
4. Routing is uniform: with ``T`` tokens each picking ``k`` distinct experts of ``E``,
   the expected number of distinct experts hit is ``E * (1 - (1 - k/E)**T)``
   (:func:`expected_unique_experts`); each hit expert's weights are read once. Hash-routed
   layers skip the router matmul but hit experts the same way.
5. A compressor (ratio > 0) projects every new token's hidden state to a KV and a gate
   vector; for ratio 4 both are doubled (overlapping windows), and the indexer has its
   own compressor of ``index_head_dim``. The compressed entry's write is ignored.
6. FLOPs count a multiply-add as 2; attention costs ``2 * H * (D + d_v)`` per query and
   entry (softmax, RoPE, norms and top-k selection ignored). The indexer's dot products
   run at the FP8 peak, everything else at the bf16 peak (FP4/FP8 weights are widened in
   registers, as on sm_90, which has no FP4 tensor cores).
7. Each component of each layer is one kernel at its roofline; a component's time is
   the sum over layers of ``max(bytes / bandwidth, flops / peak)``. Launch gaps, the
   MTP layer, sampling and communication are left out.

Explained in notebooks/00_tour.ipynb (and used by 06_decode_step_at_scale).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from dsv4lab import roofline
from dsv4lab.config import DSV4Config

KV_ENTRY_BYTES = 584          # FlashMLA's V4 FP8 KV entry: 448 e4m3 + 64 bf16 RoPE + scales
ACT_BYTES = 2                 # bf16 activations
INDEXED_RATIO = 4             # the compress ratio whose entries the indexer selects
FP8_BLOCK = 128               # FP8 weights: one fp32 scale per 128x128 block

WEIGHT_FORMATS = ("mxfp4", "nvfp4", "fp8", "bf16")
INDEXERS = ("triton", "fallback")

GROUPS = ("attention", "indexer", "routed MoE", "shared expert", "projections", "mHC",
          "LM head + embedding")


def weight_bytes_per_param(fmt: str) -> float:
    """Bytes a parameter costs in ``fmt``, scales included (see the module's assumption 1)."""
    if fmt == "mxfp4":
        return 0.5 + 1 / 32
    if fmt == "nvfp4":
        return 0.5 + 1 / 16
    if fmt == "fp8":
        return 1.0 + 4 / (FP8_BLOCK * FP8_BLOCK)
    if fmt == "bf16":
        return 2.0
    raise ValueError(f"weight_format must be one of {', '.join(WEIGHT_FORMATS)}, got {fmt!r}")


def expected_unique_experts(tokens: int, n_experts: int, topk: int) -> float:
    """Expected distinct experts hit when ``tokens`` tokens each pick ``topk`` of ``n_experts``
    uniformly at random (without repeats within a token): ``E * (1 - (1 - k/E)**T)``."""
    if tokens < 0 or n_experts <= 0 or not 0 <= topk <= n_experts:
        raise ValueError(f"need tokens >= 0 and 0 <= topk <= n_experts, got "
                         f"tokens={tokens}, n_experts={n_experts}, topk={topk}")
    return n_experts * (1.0 - (1.0 - topk / n_experts) ** tokens)


def attended_entries(cfg: DSV4Config, ratio: int, context: int) -> int:
    """KV entries one query attends in a layer of compress ``ratio`` at ``context`` tokens."""
    window = min(context, cfg.window_size)
    if ratio == 0:
        return window
    compressed = context // ratio
    if ratio == INDEXED_RATIO:
        compressed = min(compressed, cfg.index_topk)
    return window + compressed


def layer_projections(cfg: DSV4Config, layer: int) -> "OrderedDict[str, tuple[int, float]]":
    """The projections of one layer: name -> (parameters, bytes per parameter).

    Names: q_lora (wq_a), q_up (wq_b), kv (wkv), o grouped (wo_a: per group heads*D/g ->
    o_lora; wo_b: g*o_lora -> hidden), compressor, indexer q/weights/compressor, router.
    """
    h, d, H = cfg.hidden_size, cfg.head_dim, cfg.num_heads
    fp8 = weight_bytes_per_param("fp8")
    ratio = cfg.compress_ratios[layer]
    p: "OrderedDict[str, tuple[int, float]]" = OrderedDict()
    p["q_lora (wq_a)"] = (h * cfg.q_lora_rank, fp8)
    p["q up (wq_b)"] = (cfg.q_lora_rank * H * d, fp8)
    p["kv (wkv)"] = (h * d, fp8)
    p["o grouped (wo_a)"] = (cfg.o_groups * (H // cfg.o_groups * d) * cfg.o_lora_rank, fp8)
    p["o grouped (wo_b)"] = (cfg.o_groups * cfg.o_lora_rank * h, fp8)
    if ratio > 0:
        overlap = 2 if ratio == INDEXED_RATIO else 1
        p["compressor (kv, gate)"] = (2 * h * d * overlap, fp8)
    if ratio == INDEXED_RATIO:
        p["indexer q (wq_b)"] = (cfg.q_lora_rank * cfg.index_n_heads * cfg.index_head_dim, fp8)
        p["indexer weights"] = (h * cfg.index_n_heads, fp8)
        p["indexer compressor"] = (2 * h * cfg.index_head_dim * 2, fp8)
    if layer >= cfg.n_hash_layers:
        p["router"] = (h * cfg.n_routed_experts, 2.0)
    return p


def expert_params(cfg: DSV4Config) -> int:
    """Parameters of one expert: gate and up (hidden -> I each) and down (I -> hidden)."""
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size


def _mhc_mix_params(cfg: DSV4Config) -> int:
    # (hc * hidden) -> pre (hc) + post (hc) + residual mixing (hc x hc)
    return cfg.hc_mult * cfg.hidden_size * (2 * cfg.hc_mult + cfg.hc_mult ** 2)


def model_summary(cfg: DSV4Config, *, weight_format: str | None = None) -> dict:
    """Layer kinds and parameter counts (total, active per token) of the main model."""
    fmt = weight_format or cfg.expert_format
    L = cfg.num_layers
    kinds: dict[int, int] = {}
    for r in cfg.compress_ratios[:L]:
        kinds[r] = kinds.get(r, 0) + 1
    proj = sum(n for layer in range(L) for n, _ in layer_projections(cfg, layer).values())
    routed = L * cfg.n_routed_experts * expert_params(cfg)
    shared = L * cfg.n_shared_experts * expert_params(cfg)
    mhc = (2 * L + 1) * _mhc_mix_params(cfg)
    embed = 2 * cfg.vocab_size * cfg.hidden_size          # embedding + LM head
    total = proj + routed + shared + mhc + embed
    active = proj + L * (cfg.n_experts_per_tok + cfg.n_shared_experts) * expert_params(cfg) + mhc + embed
    return {
        "model": cfg.name,
        "layers": L,
        "layer_kinds": {f"ratio {r}": n for r, n in sorted(kinds.items())},
        "params_total": total,
        "params_active": active,
        "params_routed_experts": routed,
        "routed_expert_bytes": routed * weight_bytes_per_param(fmt),
        "expert_format": fmt,
        "kv_bytes_per_token_entry": KV_ENTRY_BYTES,
    }


@dataclass
class _Acc:
    bytes: float = 0.0
    flops: float = 0.0
    roofline_s: float = 0.0
    layers: int = 0

    def add(self, nbytes: float, flops: float, spec: roofline.DeviceSpec, dtype: str, count: int = 1):
        self.bytes += nbytes * count
        self.flops += flops * count
        self.roofline_s += roofline.roofline_time(nbytes, flops, spec, dtype=dtype) * count
        self.layers += count


def step_anatomy(cfg: DSV4Config, *, concurrency: int, context: int, max_context: int | None = None,
                 weight_format: str | None = None, indexer: str = "triton",
                 device: str | roofline.DeviceSpec | None = None) -> list[dict]:
    """Bytes, FLOPs and roofline time of one decode step, one row per component.

    ``concurrency`` sequences, each decoding one token at ``context`` tokens of history;
    ``max_context`` (default ``cfg.max_position_embeddings``) is what the ``"fallback"``
    indexer scores; ``weight_format`` is the routed experts' (default the config's);
    ``device`` a name or :class:`~dsv4lab.roofline.DeviceSpec` (default: this GPU, or the
    H200 without one). The module docstring lists every assumption.

    Row keys: component, group, layers, bytes, flops, intensity (FLOP/byte), dtype (peak
    used), roofline_s, bound ("memory"/"compute"), share (of the step's roofline time),
    device, concurrency, context, max_context, indexer, weight_format, note.
    """
    T = int(concurrency)
    C = int(context)
    M = int(cfg.max_position_embeddings if max_context is None else max_context)
    fmt = weight_format or cfg.expert_format
    if T < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if C < 1:
        raise ValueError(f"context must be >= 1 token, got {context}")
    if M < C:
        raise ValueError(f"max_context ({M}) must be >= context ({C})")
    if indexer not in INDEXERS:
        raise ValueError(f"indexer must be one of {', '.join(INDEXERS)}, got {indexer!r}")
    wpp = weight_bytes_per_param(fmt)
    spec = device if isinstance(device, roofline.DeviceSpec) else roofline.device_spec(device)
    L = cfg.num_layers
    h, H, D = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    ratios = cfg.compress_ratios[:L]

    acc: "OrderedDict[str, _Acc]" = OrderedDict()
    notes: dict[str, str] = {}
    group_of: dict[str, str] = {}

    def add(component, group, nbytes, flops, dtype="bf16", count=1, note=""):
        if component not in acc:
            acc[component] = _Acc()
            group_of[component] = group
            notes[component] = note
        acc[component].add(nbytes, flops, spec, dtype, count)

    # ---- attention: per layer kind ----------------------------------------------------
    for ratio in sorted(set(ratios)):
        n_layers = sum(r == ratio for r in ratios)
        entries = attended_entries(cfg, ratio, C)
        kv_bytes = T * entries * KV_ENTRY_BYTES + T * KV_ENTRY_BYTES       # read + new entry
        io_bytes = T * H * (D + D) * ACT_BYTES                             # q in, out
        flops = 2.0 * T * H * (D + D) * entries                            # QK^T and PV (d_v = D)
        kind = {0: "window"}.get(ratio, f"c{ratio}")
        add(f"attention ({kind})", "attention", kv_bytes + io_bytes, flops, count=n_layers,
            note=f"ratio {ratio}: {entries} entries per query")

    # ---- indexer (ratio-4 layers) -----------------------------------------------------
    n_idx = sum(r == INDEXED_RATIO for r in ratios)
    if n_idx:
        scored = (M if indexer == "fallback" else C) // INDEXED_RATIO
        key_bytes = cfg.index_head_dim + 4                                 # e4m3 key + fp32 scale
        nbytes = (T * scored * key_bytes                                   # keys (each sequence's own)
                  + T * scored * 4 * 2                                     # fp32 logits written, read by top-k
                  + T * cfg.index_n_heads * (cfg.index_head_dim + 4))      # q and weights
        flops = 2.0 * T * scored * cfg.index_n_heads * cfg.index_head_dim
        add("indexer", "indexer", nbytes, flops, dtype="fp8", count=n_idx,
            note=f"{indexer}: scores {scored} entries per query ({'max' if indexer == 'fallback' else 'actual'} context / {INDEXED_RATIO})")

    # ---- routed MoE -------------------------------------------------------------------
    hit = expected_unique_experts(T, cfg.n_routed_experts, cfg.n_experts_per_tok)
    ep = expert_params(cfg)
    I = cfg.moe_intermediate_size
    moe_bytes = hit * ep * wpp + T * cfg.n_experts_per_tok * (h + 2 * I + I + h) * ACT_BYTES
    moe_flops = 2.0 * T * cfg.n_experts_per_tok * ep
    add("routed MoE", "routed MoE", moe_bytes, moe_flops, count=L,
        note=f"{hit:.1f} of {cfg.n_routed_experts} experts hit ({fmt})")

    # ---- shared expert ----------------------------------------------------------------
    sp = cfg.n_shared_experts * ep
    add("shared expert", "shared expert",
        sp * weight_bytes_per_param("fp8") + T * cfg.n_shared_experts * (h + 3 * I + h) * ACT_BYTES,
        2.0 * T * sp, count=L, note="FP8 weights")

    # ---- projections ------------------------------------------------------------------
    for layer in range(L):
        nbytes = flops = 0.0
        for name, (params, bpp) in layer_projections(cfg, layer).items():
            nbytes += params * bpp
            flops += 2.0 * T * params
        # activations: hidden in for q_lora/kv/compressors/router, q_lora out and in,
        # heads*D into the output projection, hidden out: a few vectors per token
        nbytes += T * (4 * h + 2 * cfg.q_lora_rank + 2 * H * D + 2 * cfg.o_lora_rank * cfg.o_groups) * ACT_BYTES
        add("projections", "projections", nbytes, flops,
            note="q LoRA, q up, KV, grouped output, compressors, indexer projections, router")

    # ---- mHC: two hyper-connection blocks per layer and one before the head ------------
    hc = cfg.hc_mult
    mix = _mhc_mix_params(cfg)
    block_bytes = mix * 4 + T * (hc * h + h) * ACT_BYTES + T * (hc * h + h + hc * h) * ACT_BYTES
    block_flops = (2.0 * T * mix + 2.0 * T * hc * h                        # mixing logits, pre sum
                   + 2.0 * T * (hc * hc * h + hc * h)                      # stream mixing, post add
                   + 4.0 * T * cfg.hc_sinkhorn_iters * hc * hc)            # Sinkhorn
    add("mHC", "mHC", block_bytes, block_flops, count=2 * L + 1,
        note=f"{hc} streams, Sinkhorn {cfg.hc_sinkhorn_iters} iterations")

    # ---- LM head and embedding --------------------------------------------------------
    head_bytes = cfg.vocab_size * h * 2.0 + T * h * ACT_BYTES + T * cfg.vocab_size * 4
    add("LM head + embedding", "LM head + embedding", head_bytes + T * h * ACT_BYTES,
        2.0 * T * cfg.vocab_size * h, note="bf16 head, fp32 logits")

    total_s = sum(a.roofline_s for a in acc.values()) or 1.0
    rows = []
    for comp, a in acc.items():
        dtype = "fp8" if comp == "indexer" else "bf16"
        bound_memory = a.bytes / spec.bandwidth >= a.flops / (spec.fp8_flops if dtype == "fp8" else spec.bf16_flops)
        rows.append({
            "component": comp,
            "group": group_of[comp],
            "layers": a.layers,
            "bytes": a.bytes,
            "flops": a.flops,
            "intensity": roofline.arithmetic_intensity(a.bytes, a.flops),
            "dtype": dtype,
            "roofline_s": a.roofline_s,
            "bound": "memory" if bound_memory else "compute",
            "share": a.roofline_s / total_s,
            "device": spec.name,
            "concurrency": T,
            "context": C,
            "max_context": M,
            "indexer": indexer,
            "weight_format": fmt,
            "note": notes[comp],
        })
    return rows


def step_totals(rows: list[dict]) -> dict:
    """The whole step: bytes, flops, roofline seconds, and tokens/s at that roof."""
    if not rows:
        raise ValueError("rows is empty: pass the output of step_anatomy")
    total_s = sum(r["roofline_s"] for r in rows)
    T = rows[0]["concurrency"]
    top = max(rows, key=lambda r: r["roofline_s"])
    return {
        "bytes": sum(r["bytes"] for r in rows),
        "flops": sum(r["flops"] for r in rows),
        "roofline_s": total_s,
        "step_ms": total_s * 1e3,
        "tokens_per_s": T / total_s,
        "per_sequence_tokens_per_s": 1.0 / total_s,
        "largest": top["component"],
        "largest_share": top["roofline_s"] / total_s,
        "device": rows[0]["device"],
        "concurrency": T,
        "context": rows[0]["context"],
        "max_context": rows[0]["max_context"],
        "indexer": rows[0]["indexer"],
    }


def by_group(rows: list[dict]) -> "OrderedDict[str, dict]":
    """Rows summed per group (the attention kinds become one "attention"), in GROUPS order."""
    out: "OrderedDict[str, dict]" = OrderedDict()
    for g in GROUPS:
        sel = [r for r in rows if r["group"] == g]
        if sel:
            out[g] = {"bytes": sum(r["bytes"] for r in sel), "flops": sum(r["flops"] for r in sel),
                      "roofline_s": sum(r["roofline_s"] for r in sel)}
    return out


def _si(x: float, unit: str) -> str:
    for div, p in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g} {p}{unit}"
    return f"{x:.3g} {unit}"


def format_table(rows: list[dict]) -> str:
    """A fixed-width text table of :func:`step_anatomy` rows, with the total."""
    head = f"{'component':22s} {'layers':>6s} {'bytes':>10s} {'FLOPs':>10s} {'FLOP/B':>8s} {'roof us':>9s} {'share':>6s}  bound"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['component']:22s} {r['layers']:6d} {_si(r['bytes'], 'B'):>10s} "
                     f"{_si(r['flops'], 'F'):>10s} {r['intensity']:8.1f} {r['roofline_s'] * 1e6:9.1f} "
                     f"{r['share'] * 100:5.1f}%  {r['bound']}")
    t = step_totals(rows)
    lines.append("-" * len(head))
    lines.append(f"{'step':22s} {'':6s} {_si(t['bytes'], 'B'):>10s} {_si(t['flops'], 'F'):>10s} "
                 f"{t['flops'] / t['bytes']:8.1f} {t['roofline_s'] * 1e6:9.1f} {100.0:5.1f}%")
    lines.append(f"{t['device']} roofline: {t['step_ms']:.2f} ms a step, {t['tokens_per_s']:,.0f} tokens/s "
                 f"at concurrency {t['concurrency']} (context {t['context']:,}, max context "
                 f"{t['max_context']:,}, indexer {t['indexer']})")
    return "\n".join(lines)


def html_table(rows: list[dict]) -> str:
    """The same table as HTML (for widgets and reports)."""
    t = step_totals(rows)
    cells = "".join(
        f"<tr><td>{r['component']}</td><td>{r['layers']}</td><td>{_si(r['bytes'], 'B')}</td>"
        f"<td>{_si(r['flops'], 'FLOP')}</td><td>{r['intensity']:.1f}</td>"
        f"<td>{r['roofline_s'] * 1e6:.1f}</td><td>{r['share'] * 100:.1f}%</td><td>{r['bound']}</td>"
        f"<td>{r['note']}</td></tr>" for r in rows)
    return ('<table style="white-space: nowrap"><thead><tr><th>component</th><th>layers</th><th>bytes</th><th>FLOPs</th>'
            "<th>FLOP/byte</th><th>roofline &micro;s</th><th>share</th><th>bound</th><th>note</th>"
            f"</tr></thead><tbody>{cells}</tbody><tfoot><tr><td><b>step</b></td><td></td>"
            f"<td>{_si(t['bytes'], 'B')}</td><td>{_si(t['flops'], 'FLOP')}</td><td></td>"
            f"<td>{t['roofline_s'] * 1e6:.1f}</td><td>100%</td><td></td><td></td></tr></tfoot></table>")
