"""Handing a finished prefill's cache to a decode worker: which pages, one message, adopted.

What a decode worker needs of a request whose prompt (``L`` tokens) is prefilled, per layer
(:func:`layout`, page-granular, as serving engines move KV pages):

- the **raw pages** covering the last ``reach`` tokens (the window, or a compressor's block,
  two when it overlaps: 128 for V4-Flash): the sliding window's latent rows (bf16, or the FP8
  layout) and the compressors' per-token state (``comp_kv``/``comp_gate``; ``idx_kv``/
  ``idx_gate`` of the indexer's compressor in CSA layers), from which the next entries are
  pooled;
- the **compressed pages** holding every complete entry (CSA: L // 4, HCA: L // 128) and, in
  CSA layers, the indexer's keys and their scales.

Earlier raw tokens are never read again (a query sees 128 window tokens plus entries), so they
stay behind. :func:`extract` gathers the pages into one flat byte buffer (one message, in
layout order); :func:`adopt` writes it into the decode worker's own pages (other page numbers,
the same bytes). :func:`dsv4lab.drivers.pd_model.kv_bytes` counts the same bytes analytically.

Transport (:class:`Sender`, :class:`Receiver`): ``torch.distributed`` point-to-point
``send``/``recv`` (NCCL between GPUs, gloo between CPU processes): a float64 header (request
id, prompt length, first token and its top-2 logit margin, payload bytes, prefill start and
finish times), then the payload. The receiver times the payload alone: it starts its clock
once the header is in (the sender posts the payload right behind it), so waiting for the
sender is not counted.
:func:`transfer_sweep` measures the same path at chosen sizes.

Explained in notebooks/07_prefill_decode.ipynb.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

RAW_POOLS = ("kv", "comp_kv", "comp_gate", "idx_kv", "idx_gate")
COMP_POOLS = ("kv", "idx_keys", "idx_scale")
HEADER_FIELDS = ("rid", "prompt_len", "first_token", "nbytes", "prefill_start_ms", "finish_ms", "first_margin")
END = -1.0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def page_view(pool: torch.Tensor, page_size: int) -> torch.Tensor:
    """A pool as ``uint8 [pages, bytes per page]`` (a view: writes land in the pool)."""
    if pool.dim() == 2 and pool.dtype == torch.uint8:       # the FP8 KV pool: [P * page, 584]
        return pool.view(-1, page_size * pool.shape[-1])
    if not pool.is_contiguous():
        raise ValueError("page_view needs a contiguous pool")
    return pool.view(torch.uint8).reshape(pool.shape[0], -1)


@dataclass(frozen=True)
class Piece:
    """One pool's pages in the message: ``count`` logical pages from ``first`` of the raw or
    compressed (ratio ``ratio``) block table."""
    ratio: int
    pool: str
    table: str                # "raw" or "comp"
    first: int
    count: int
    page_bytes: int

    @property
    def nbytes(self) -> int:
        return self.count * self.page_bytes


def layout(cache, prompt_len: int) -> list[Piece]:
    """The pieces of a request's hand-off after a prompt of ``prompt_len`` tokens (module
    docstring), in message order: per layer kind, raw pools, then compressed pools."""
    if prompt_len < 1:
        raise ValueError(f"prompt_len must be >= 1, got {prompt_len}")
    pg = cache.page_size
    first_raw = max(0, prompt_len - cache.reach) // pg
    n_raw = (prompt_len - 1) // pg - first_raw + 1
    out = []
    for r, lc in cache.layers.items():
        for name in RAW_POOLS:
            t = getattr(lc, name)
            if t is not None:
                out.append(Piece(r, name, "raw", first_raw, n_raw, page_view(t, pg).shape[1]))
        n_comp = _cdiv(prompt_len // r, pg) if r else 0
        if n_comp:
            for name in COMP_POOLS:
                t = getattr(lc, name)
                if t is not None:
                    out.append(Piece(r, name, "comp", 0, n_comp, page_view(t, pg).shape[1]))
    return out


def payload_bytes(cache, prompt_len: int) -> int:
    return sum(p.nbytes for p in layout(cache, prompt_len))


def first_raw_token(cache, prompt_len: int) -> int:
    """The first raw token a decode worker must hold for a prompt of ``prompt_len``."""
    return max(0, prompt_len - cache.reach)


def _pages(tables, piece: Piece, device) -> torch.Tensor:
    src = tables.raw if piece.table == "raw" else tables.comp[piece.ratio]
    ids = src[piece.first:piece.first + piece.count]
    if len(ids) != piece.count or not all(ids):
        raise ValueError(f"the request does not hold the {piece.table} pages {piece.first}.."
                         f"{piece.first + piece.count - 1} of ratio {piece.ratio}")
    return torch.tensor(ids, dtype=torch.long, device=device)


def extract(cache, tables, prompt_len: int) -> torch.Tensor:
    """The request's hand-off as one flat ``uint8`` tensor on the cache's device."""
    parts = []
    for p in layout(cache, prompt_len):
        view = page_view(getattr(cache.layers[p.ratio], p.pool), cache.page_size)
        parts.append(view.index_select(0, _pages(tables, p, view.device)).reshape(-1))
    return torch.cat(parts)


def adopt(cache, tables, prompt_len: int, payload: torch.Tensor) -> None:
    """Write a hand-off into the pages ``tables`` holds in ``cache`` (bit for bit)."""
    pieces = layout(cache, prompt_len)
    need = sum(p.nbytes for p in pieces)
    if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() != need:
        raise ValueError(f"payload must be uint8 [{need}] for a {prompt_len}-token prompt in this cache, "
                         f"got {payload.dtype} {list(payload.shape)}")
    off = 0
    for p in pieces:
        view = page_view(getattr(cache.layers[p.ratio], p.pool), cache.page_size)
        view.index_copy_(0, _pages(tables, p, view.device),
                         payload[off:off + p.nbytes].view(p.count, p.page_bytes).to(view.device))
        off += p.nbytes


# ---- torch.distributed transport ----------------------------------------------------------------

def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def warmup(peer: int, rank: int, device) -> None:
    """One tiny exchange, so that the first hand-off does not pay for NCCL's connection."""
    t = torch.zeros(1, dtype=torch.float64, device=device)
    if rank == 0:
        dist.send(t, peer)
        dist.recv(t, peer)
    else:
        dist.recv(t, peer)
        dist.send(t, peer)
    _sync(device)


class Sender:
    """The prefill worker's side: a header, then the payload, to rank ``dst``."""

    def __init__(self, dst: int, device):
        self.dst, self.device = dst, torch.device(device)

    def send(self, *, rid: int, prompt_len: int, first_token: int, prefill_start_ms: float,
             finish_ms: float, payload: torch.Tensor, first_margin: float = float("nan")) -> None:
        h = torch.tensor([rid, prompt_len, first_token, payload.numel(), prefill_start_ms, finish_ms,
                          first_margin], dtype=torch.float64, device=self.device)
        dist.send(h, self.dst)
        dist.send(payload.contiguous(), self.dst)

    def close(self) -> None:
        """The end of the stream (a header with request id -1)."""
        h = torch.full((len(HEADER_FIELDS),), END, dtype=torch.float64, device=self.device)
        dist.send(h, self.dst)
        _sync(self.device)


class Receiver:
    """The decode worker's side: :meth:`recv` takes the next hand-off into ``cache``."""

    def __init__(self, src: int, device):
        self.src, self.device = src, torch.device(device)

    def recv(self, cache, alloc) -> dict | None:
        """The next hand-off, adopted into the pages ``alloc(header)`` returns, or None at the
        end. Returns the header's fields, ``tables``, ``transfer_ms`` (the payload alone),
        ``adopt_ms`` (writing it into the pages) and ``nbytes``."""
        h = torch.zeros(len(HEADER_FIELDS), dtype=torch.float64, device=self.device)
        dist.recv(h, self.src)
        vals = h.tolist()                                  # waits for the header
        if vals[0] == END:
            return None
        head = dict(zip(HEADER_FIELDS, vals))
        for k in ("rid", "prompt_len", "first_token", "nbytes"):
            head[k] = int(head[k])
        tables = alloc(head)
        buf = torch.empty(head["nbytes"], dtype=torch.uint8, device=self.device)
        t0 = time.perf_counter()
        dist.recv(buf, self.src)
        _sync(self.device)
        t1 = time.perf_counter()
        adopt(cache, tables, head["prompt_len"], buf)
        _sync(self.device)
        t2 = time.perf_counter()
        head.update(tables=tables, transfer_ms=(t1 - t0) * 1e3, adopt_ms=(t2 - t1) * 1e3)
        return head


def transfer_sweep(sizes, *, rank: int, peer: int, device, reps: int = 5) -> list[dict]:
    """Rank 0 sends ``reps`` messages of each size (bytes) to rank 1, each behind a small
    header, as a hand-off does; rank 1 times the payloads. Returns rank 1's rows (rank 0: [])."""
    device = torch.device(device)
    rows = []
    for n in sizes:
        n = int(n)
        if n < 1:
            raise ValueError(f"sizes must be positive byte counts, got {n}")
        buf = torch.zeros(n, dtype=torch.uint8, device=device)
        h = torch.zeros(1, dtype=torch.float64, device=device)
        times = []
        for _ in range(reps + 1):
            if rank == 0:
                dist.send(h, peer)
                dist.send(buf, peer)
            else:
                dist.recv(h, peer)
                h.tolist()
                t0 = time.perf_counter()
                dist.recv(buf, peer)
                _sync(device)
                times.append((time.perf_counter() - t0) * 1e3)
        _sync(device)
        if rank != 0:
            ms = statistics.median(times[1:])
            rows.append({"kind": "transfer", "bytes": n, "ms": ms, "gbs": n / (ms * 1e-3) / 1e9,
                         "reps": reps, "mode": "eager",
                         "timing": "host_clock_after_header" + ("_cuda_sync" if device.type == "cuda" else "")})
    return rows
