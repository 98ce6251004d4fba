"""The analytic model of prefill-decode disaggregation: what a hand-off moves, how long the
link takes, and when splitting prefill from decode pays.

Assumptions (each a choice a reader may change):

1. **What is handed off** (:func:`kv_bytes`), per main-model layer (the MTP layer's cache is
   left out: plain decoding does not read it), for a prompt of ``L`` tokens:
   the sliding window's ``min(L, 128)`` latent rows; the compressed entries (CSA ``L // 4``,
   HCA ``L // 128``); in CSA layers the indexer's keys, ``index_head_dim`` e4m3 bytes plus an
   fp32 scale per entry (bf16 keys with a bf16 cache, as this workbook's cache keeps them); and
   the compressors' state, the ``L mod r`` tokens of the block not yet pooled (a ``head_dim``
   kv and gate vector each in bf16, plus the indexer compressor's ``index_head_dim`` pair in
   CSA layers; the released ratio-4 compressors overlap: twice as wide, and the next entry
   also reads the previous block's first halves). A latent row is 584 bytes in the FP8
   layout, ``2 * head_dim`` in bf16.
   ``page_size`` counts instead what :mod:`dsv4lab.drivers.kv_transfer` sends: whole pages of
   the last ``reach`` raw tokens (every pool) and of the entries.
2. **The link** (:data:`dsv4lab.drivers.analytic.LINKS`): a hand-off is one message in one
   direction, ``base latency + bytes / per-direction bandwidth``; NVLink 4 on H200 450 GB/s,
   PCIe Gen5 x16 64 GB/s (the campaign's RTX PRO 6000 box). Nominal bandwidth: a floor.
3. **Iterations at the roofline** (:func:`iteration_ms`, from :func:`dsv4lab.anatomy.step_anatomy`):
   ``n`` prompt tokens in an iteration cost what ``n`` more decode queries at the same context
   cost (every query attends the same slots and the weights are read once an iteration); the
   LM head runs only for the decode rows.
4. **Steady state** (:func:`pd_point`): ``batch`` requests keep decoding; prompts of ``P``
   tokens arrive at ``rate`` per second, so ``x = rate * P / chunk`` chunks a second must be
   prefilled. Co-located, an iteration takes ``t_d`` (decode only) or ``t_m`` (with a chunk);
   a fraction ``f`` of them carries a chunk, and the mean iteration, the mean TPOT, is
   ``t_d / (1 - x (t_m - t_d))`` (stable while ``x t_m < 1``); the p99 gap is ``t_m`` once
   ``f`` passes 1%. Disaggregated, the decode GPU runs ``t_d`` every iteration; the prefill GPU
   runs chunks alone (``t_p``) and is stable while ``x t_p < 1``. TTFT (no queueing):
   co-located ``ceil(P / chunk) * t_m``, disaggregated ``ceil(P / chunk) * t_p`` + the
   transfer. The fair comparison for two GPUs is a **co-located pair**: two GPUs each with
   half the rate and half the batch. Splitting *pays* on the tail when the decode GPU's
   ``t_d`` beats the pair's p99 gap, on the mean when it beats the pair's mean TPOT.

Explained in notebooks/07_prefill_decode.ipynb.
"""
from __future__ import annotations

import math
from collections import OrderedDict

from dsv4lab import anatomy
from dsv4lab.config import DSV4Config
from dsv4lab.drivers.analytic import LINKS, Link
from dsv4lab.drivers.served_model import CostModel

FP8_ROW = 584                # the FP8 latent row: 448 e4m3 + 64 bf16 RoPE + 7 scales + 1 pad
SCALE_BYTES = 4              # an indexer key's fp32 scale
STATE_BYTES = 2              # the compressors' per-token state (bf16)
PARTS = ("window", "compressed entries", "indexer keys", "compressor state")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def row_bytes(cfg: DSV4Config, kv_format: str, float_bytes: int = STATE_BYTES) -> int:
    """A latent row: the FP8 layout, or ``head_dim`` floats of the model's dtype ("bf16")."""
    if kv_format == "fp8":
        return FP8_ROW
    if kv_format == "bf16":
        return float_bytes * cfg.head_dim
    raise ValueError(f"kv_format must be 'fp8' or 'bf16', got {kv_format!r}")


def key_bytes(cfg: DSV4Config, kv_format: str, float_bytes: int = STATE_BYTES) -> int:
    """An indexer key with its scale (e4m3 with an FP8 cache, the model's floats otherwise)."""
    return cfg.index_head_dim * (1 if kv_format == "fp8" else float_bytes) + SCALE_BYTES


def overlaps(cfg: DSV4Config, ratio: int) -> bool:
    """Whether the ratio-``ratio`` compressor pools overlapping windows: the released structure
    (ratio 4) unless ``cfg.extra["compress_overlap"]`` says otherwise."""
    return ratio == 4 and bool(cfg.extra.get("compress_overlap", True))


def _state_per_token(cfg: DSV4Config, ratio: int, float_bytes: int) -> int:
    """A raw token's compressor state (kv and gate, the indexer's too in CSA layers), one width."""
    if not ratio:
        return 0
    s = 2 * cfg.head_dim * float_bytes
    if ratio == 4:
        s += 2 * cfg.index_head_dim * float_bytes
    return s


def kv_bytes(cfg: DSV4Config, context: int, *, kv_format: str = "fp8", page_size: int | None = None,
             float_bytes: int = STATE_BYTES, layers=None) -> dict:
    """Bytes of one request's hand-off after a prompt of ``context`` tokens (assumption 1):
    ``{part: bytes}`` for :data:`PARTS` and ``"total"``. ``page_size`` None: what decoding reads;
    an int: what whole pages of that size hold (what the workbook sends). ``float_bytes``: the
    model's floats (2: bf16; 4: an fp32 model's cache). An overlapping compressor
    (:func:`overlaps`) keeps twice as wide a state, and its next entry also reads the first
    half of the previous block's. ``layers``: the compress ratios of the layers whose caches
    are sent, one per layer (default: every main layer of ``cfg``; a served model that runs
    one layer per kind sends ``model.ratios``)."""
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ValueError(f"context must be a positive int, got {context!r}")
    kinds = (0, *cfg.compress_ratios)
    if layers is not None and not all(type(r) is int and r in kinds for r in layers):
        raise ValueError(f"layers must be compress ratios of cfg's layers, got {layers!r}")
    L, W = context, cfg.window_size
    row, key = row_bytes(cfg, kv_format, float_bytes), key_bytes(cfg, kv_format, float_bytes)
    ratios = list(cfg.compress_ratios[:cfg.num_layers] if layers is None else layers)
    out = OrderedDict((p, 0) for p in PARTS)
    if page_size is None:
        for r in ratios:
            out["window"] += min(L, W) * row
            if r:
                n = L // r
                s = _state_per_token(cfg, r, float_bytes)
                out["compressed entries"] += n * row
                if overlaps(cfg, r):
                    out["compressor state"] += (L % r) * 2 * s + (r * s if n else 0)
                else:
                    out["compressor state"] += (L % r) * s
                if r == 4:
                    out["indexer keys"] += n * key
    else:
        pg = page_size
        reach = max([W] + [2 * r if overlaps(cfg, r) else r for r in ratios if r])
        first = max(0, L - reach) // pg
        raw_slots = ((L - 1) // pg - first + 1) * pg
        for r in ratios:
            out["window"] += raw_slots * row
            out["compressor state"] += raw_slots * _state_per_token(cfg, r, float_bytes) * (2 if overlaps(cfg, r) else 1)
            if r:
                slots = _cdiv(L // r, pg) * pg
                out["compressed entries"] += slots * row
                if r == 4:
                    out["indexer keys"] += slots * key
    out["total"] = sum(out[p] for p in PARTS)
    return out


def full_cache_bytes(cfg: DSV4Config, context: int, *, kv_format: str = "fp8") -> int:
    """What a hand-off would move if every layer kept every token's latent row (no window,
    no compression): the comparison that shows what V4's compressed attention saves."""
    return cfg.num_layers * context * row_bytes(cfg, kv_format)


def transfer_ms(nbytes: float, link: Link | str = "nvlink") -> float:
    """One message of ``nbytes`` over ``link`` (assumption 2), ms."""
    link = LINKS[link] if isinstance(link, str) else link
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    return (link.base_latency + nbytes / link.bandwidth) * 1e3


def iteration_ms(cfg: DSV4Config, *, decode_rows: int, prefill_rows: int, context: int,
                 device: str | None = "H200") -> float:
    """One iteration of the whole model at the roofline (assumption 3), ms."""
    T = decode_rows + prefill_rows
    if decode_rows < 0 or prefill_rows < 0 or T < 1:
        raise ValueError(f"need at least one row, got decode_rows={decode_rows}, prefill_rows={prefill_rows}")
    rows = anatomy.step_anatomy(cfg, concurrency=T, context=context, max_context=max(context, 8192), device=device)
    body = sum(r["roofline_s"] for r in rows if r["group"] != "LM head + embedding")
    head = anatomy.step_anatomy(cfg, concurrency=max(1, decode_rows), context=context,
                                max_context=max(context, 8192), device=device)
    head_s = sum(r["roofline_s"] for r in head if r["group"] == "LM head + embedding")
    return (body + head_s) * 1e3


def roofline_cost(cfg: DSV4Config | None = None, *, context: int = 8192, device: str | None = "H200",
                  batch: int = 64, chunk: int = 2048) -> CostModel:
    """A :class:`~dsv4lab.drivers.served_model.CostModel` fitted to :func:`iteration_ms`: the
    cost of one decode row from 1 to ``batch`` rows, of one prompt row from a ``chunk``. A
    serving loop of a small model can then keep V4-Flash's clock at the roofline."""
    cfg = cfg or DSV4Config.flash()
    one = iteration_ms(cfg, decode_rows=1, prefill_rows=0, context=context, device=device)
    many = iteration_ms(cfg, decode_rows=batch, prefill_rows=0, context=context, device=device)
    mixed = iteration_ms(cfg, decode_rows=1, prefill_rows=chunk, context=context, device=device)
    per_decode = (many - one) / (batch - 1)
    return CostModel(base_ms=one - per_decode, decode_ms=per_decode, prefill_ms=(mixed - one) / chunk)


def colocated_tpot(t_d: float, t_m: float, chunks_per_s: float) -> float:
    """Mean time per output token of a co-located GPU (assumption 4), ms; inf when the
    prefill work does not fit."""
    x = chunks_per_s / 1e3                                     # chunks a ms
    if x * t_m >= 1:
        return math.inf
    return t_d / (1 - x * (t_m - t_d))


def pd_point(cfg: DSV4Config, *, batch: int, context: int, prompt_len: int, rate: float,
             chunk: int = 2048, link: Link | str = "nvlink", device: str | None = "H200",
             kv_format: str = "fp8") -> dict:
    """Co-located (one GPU, and a pair at half the rate and batch each) against disaggregated
    (1 prefill + 1 decode GPU) in the model (assumption 4). Times in ms."""
    link = LINKS[link] if isinstance(link, str) else link
    n_chunks = _cdiv(prompt_len, chunk)
    x = rate * prompt_len / chunk                              # chunks a second
    t_d = iteration_ms(cfg, decode_rows=batch, prefill_rows=0, context=context, device=device)
    t_m = iteration_ms(cfg, decode_rows=batch, prefill_rows=chunk, context=context, device=device)
    half = max(1, batch // 2)
    t_d2 = iteration_ms(cfg, decode_rows=half, prefill_rows=0, context=context, device=device)
    t_m2 = iteration_ms(cfg, decode_rows=half, prefill_rows=chunk, context=context, device=device)
    t_p = iteration_ms(cfg, decode_rows=0, prefill_rows=chunk, context=context, device=device)
    nbytes = kv_bytes(cfg, prompt_len, kv_format=kv_format)["total"]
    xfer = transfer_ms(nbytes, link)
    colo = colocated_tpot(t_d, t_m, x)
    pair = colocated_tpot(t_d2, t_m2, x / 2)

    def chunked(tpot: float, chunks_per_s: float) -> bool:       # do more than 1% of iterations carry one?
        return not math.isfinite(tpot) or chunks_per_s / 1e3 * tpot > 0.01

    disagg_ok = x / 1e3 * t_p < 1
    out = {
        "kind": "model", "model": cfg.name, "device": device, "link": link.name, "batch": batch,
        "context": context, "prompt_len": prompt_len, "rate": rate, "chunk": chunk, "kv_format": kv_format,
        "t_decode_ms": t_d, "t_mixed_ms": t_m, "t_prefill_ms": t_p,
        "colocated_tpot_ms": colo, "colocated_tpot_p99_ms": t_m if chunked(colo, x) else t_d,
        "pair_tpot_ms": pair, "pair_tpot_p99_ms": t_m2 if chunked(pair, x / 2) else t_d2,
        "disagg_tpot_ms": t_d if disagg_ok else math.inf, "disagg_tpot_p99_ms": t_d if disagg_ok else math.inf,
        "colocated_ttft_ms": n_chunks * t_m, "pair_ttft_ms": n_chunks * t_m2,
        "disagg_ttft_ms": n_chunks * t_p + xfer if disagg_ok else math.inf,
        "kv_bytes": nbytes, "transfer_ms": xfer,
        "transfer_share_of_ttft": xfer / (n_chunks * t_p + xfer),
    }
    out["pays_p99"] = bool(disagg_ok and out["disagg_tpot_p99_ms"] < out["pair_tpot_p99_ms"])
    out["pays_mean"] = bool(disagg_ok and out["disagg_tpot_ms"] < out["pair_tpot_ms"])
    return out


def model_rows(cfg: DSV4Config | None = None, *, batch: int = 32, prompt_lens=(2048, 8192),
               loads=(0.1, 0.25, 0.5, 0.75, 0.9), chunk: int = 2048, links=("nvlink", "pcie")) -> list[dict]:
    """:func:`pd_point` over a grid: for each prompt length, arrival rates at ``loads`` of what
    a dedicated prefill GPU absorbs (``1 / (ceil(P / chunk) * t_p)``); the rows ``dsv4lab
    bench pd`` records and notebook 07 plots."""
    cfg = cfg or DSV4Config.flash()
    rows = []
    for key in links:
        dev = "H200" if key == "nvlink" else LINKS[key].device
        for P in prompt_lens:
            t_p = iteration_ms(cfg, decode_rows=0, prefill_rows=chunk, context=P, device=dev)
            cap = 1e3 / (_cdiv(P, chunk) * t_p)
            for load in loads:
                r = pd_point(cfg, batch=batch, context=P, prompt_len=P, rate=load * cap, chunk=chunk,
                             link=key, device=dev)
                r["load"] = load
                rows.append(r)
    return rows


def context_rows(cfg: DSV4Config | None = None, contexts=(1024, 4096, 16384, 65536, 262144, 1048576),
                 kv_format: str = "fp8") -> list[dict]:
    """Hand-off bytes by part and transfer time over each link, per context."""
    cfg = cfg or DSV4Config.flash()
    rows = []
    for L in contexts:
        b = kv_bytes(cfg, L, kv_format=kv_format)
        r = {"kind": "kv_bytes", "context": L, "kv_format": kv_format,
             "full_cache_bytes": full_cache_bytes(cfg, L, kv_format=kv_format)}
        r.update({f"bytes_{k.replace(' ', '_')}": v for k, v in b.items()})
        for key, link in LINKS.items():
            r[f"transfer_ms_{key}"] = transfer_ms(b["total"], link)
        rows.append(r)
    return rows
