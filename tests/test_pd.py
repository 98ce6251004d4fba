"""Prefill-decode disaggregation (dsv4lab.drivers.served_model, serving, kv_transfer, pd_model,
pd_run; benchmarks/pd, plots/pd).

CPU: the tiny config in fp32 with the torch references (exact up to fp32 summation order:
``TOL_FP32``); the KV hand-off between two gloo processes, compared bit for bit; the serving
loop's statistics with a cost model, checked by hand; the analytic bytes against a hand count.
GPU tests (``-m gpu``): the hand-off over NCCL between two GPUs (skipped with fewer), the
real-size layers served with CUDA graphs.
"""
import json
import math
import os
import socket

import numpy as np
import pytest
import torch

import dsv4lab  # noqa: F401
from dsv4lab import model as M
from dsv4lab.config import DSV4Config
from dsv4lab.drivers import kv_transfer as KV
from dsv4lab.drivers import pd_model as PM
from dsv4lab.drivers import pd_run
from dsv4lab.drivers import presets as P
from dsv4lab.drivers import serving as S
from dsv4lab.drivers.served_model import (CostModel, PagedCache, Rows, Runner, ServedModel, iteration_ms,
                                          size_pages)

TOL_FP32 = 1e-5          # the row batch against the rectangular prefill: fp32, other summation order
CPU = {"mhc": "torch", "linear": "torch"}


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return ServedModel(M.tiny_config(), P.TORCH_REFERENCE, device="cpu", dtype="fp32", backends=CPU)


def _runner(model, *, requests=8, max_context=64, cost=CostModel(1.0, 0.5, 0.1)):
    cache = model.cache(size_pages(max_context, model.page_size, requests, model.ratios), max_context=max_context)
    return Runner(model, cache, cost=cost)


def _fill_random(cache: PagedCache, seed: int):
    g = torch.Generator().manual_seed(seed)
    for lc in cache.layers.values():
        for t in vars(lc).values():
            if isinstance(t, torch.Tensor):
                u8 = t.view(torch.uint8)
                u8.copy_(torch.randint(0, 256, u8.shape, generator=g, dtype=torch.uint8))


def _cfg_fp8(overlap: bool = False):
    # the 584-byte layout needs 448 + 64; ``overlap``: the released ratio-4 compressors
    return M.tiny_config(head_dim=512, rope_dim=64, extra={"compress_overlap": overlap})


# ---- the served model: rows of tokens ----------------------------------------------------------

def test_row_batch_prefill_matches_the_rectangular_forward(tiny):
    """A prompt as one row per token gives the logits of the same layers run over the prompt as
    one [1, L] sequence, and chunking it changes no token."""
    cfg = tiny.cfg
    L = 37                                                  # partial pages, entries of both ratios
    prompt = torch.randint(0, cfg.vocab_size, (L,), generator=torch.Generator().manual_seed(3)).tolist()
    run = _runner(tiny)
    t = run.cache.alloc(L + 4)
    rows = Rows()
    rows.add(t, prompt, 0, True)
    rows.logits = list(range(L))                           # every row's logits, to compare them all
    step = run.run(rows)
    # the same layers over the [1, L] sequence, against a fresh cache
    ref_cache = tiny.cache(size_pages(64, tiny.page_size, 2, tiny.ratios), max_context=64)
    tr = ref_cache.alloc(L + 4)
    toks = torch.tensor([prompt])
    pos = torch.arange(L).view(1, L)
    x = tiny.head.embed_streams(toks)
    with torch.no_grad():
        for r, blk in tiny.layers.items():
            bt = torch.tensor([tr.raw], dtype=torch.int32)
            cbt = torch.tensor([tr.comp.get(r, [0])], dtype=torch.int32)
            meta = M.make_meta(cfg, pos, bt, cbt, tiny.page_size, [r] if r else [])
            x = blk.forward_decode(x, toks, meta, ref_cache.layers[r], tiny.backends)
        ref = tiny.head.logits(x)[0].argmax(-1).tolist()
    assert step.tokens == ref
    outs = []
    for chunk in (L, 16, 5):
        r2 = _runner(tiny)
        t2 = r2.cache.alloc(L + 4)
        p = 0
        while p < L:
            b = min(L, p + chunk)
            rows = Rows()
            rows.add(t2, prompt[p:b], p, b == L)
            last = r2.run(rows)
            p = b
        outs.append(last.tokens[0])
    assert outs == [ref[-1]] * 3


def test_a_chunk_beside_decode_rows_changes_no_token(tiny):
    spec = S.StreamSpec(n_requests=3, rate=50.0, prompt_len=30, output_len=4, seed=2)
    reqs = S.request_stream(spec, tiny.cfg.vocab_size)
    alone = {}
    for r in reqs:                                          # each request served by itself
        alone.update(S.serve_colocated(_runner(tiny), [r], S.ServeOptions(chunk=16)).tokens())
    together = S.serve_colocated(_runner(tiny), reqs, S.ServeOptions(chunk=16))
    assert any(it["decode_rows"] and it["prefill_rows"] for it in together.iterations), "no mixed iteration"
    assert together.tokens() == alone


def test_cache_pages_are_counted_and_checked(tiny):
    c = tiny.cache(12, max_context=64)
    assert c.free_pages == 11 and c.reach == 8
    t = c.alloc(40)                                          # 3 raw pages, entries 10 (r4) and 5 (r8): 1 page each
    assert c.free_pages == 11 - 5 == 11 - c.pages_needed(40)
    assert sum(1 for p in t.raw if p) == 3 and t.raw[3:] == [0] * (c.raw_width - 3)
    d = c.alloc(40, first_raw_token=40 - c.reach)            # a decode worker holds the window only
    assert [bool(p) for p in d.raw[:3]] == [False, False, True]
    c.release(t)
    c.release(d)
    assert c.free_pages == 11
    with pytest.raises(ValueError, match="max_context"):
        c.alloc(65)
    with pytest.raises(RuntimeError, match="out of pages"):
        c.alloc(64), c.alloc(64)
    with pytest.raises(ValueError, match="num_pages"):
        PagedCache(tiny.cfg, [0, 4], 1, 16, max_context=64)


def test_iteration_is_extrapolated_to_the_models_layers():
    segs = {("head", "embed"): 1.0, (0, "layer"): 2.0, (4, "layer"): 3.0, (128, "layer"): 4.0, ("head", "head"): 5.0}
    flash = {0: 2, 4: 21, 128: 20}
    assert iteration_ms(segs, flash) == 1.0 + 5.0 + 2 * 2.0 + 21 * 3.0 + 20 * 4.0
    assert CostModel(1.0, 0.5, 0.1)(4, 20) == pytest.approx(1.0 + 2.0 + 2.0)


# ---- the KV hand-off ----------------------------------------------------------------------------

@pytest.mark.parametrize("kv_format, cfg", [("bf16", M.tiny_config()), ("fp8", _cfg_fp8()),
                                            ("fp8", _cfg_fp8(overlap=True))], ids=["bf16", "fp8", "fp8-overlap"])
@pytest.mark.parametrize("prompt_len", [1, 7, 16, 37, 64])
def test_handoff_round_trips_bit_for_bit_in_process(kv_format, cfg, prompt_len):
    kw = dict(max_context=128, kv_format=kv_format, dtype=torch.bfloat16)
    src = PagedCache(cfg, [0, 4, 8], 40, 16, **kw)
    dst = PagedCache(cfg, [0, 4, 8], 40, 16, **kw)
    _fill_random(src, 0)
    _fill_random(dst, 1)
    dst.alloc(50)                                            # other page numbers on the decode side
    ts = src.alloc(prompt_len)
    payload = KV.extract(src, ts, prompt_len)
    assert payload.dtype == torch.uint8 and payload.numel() == KV.payload_bytes(src, prompt_len)
    td = S.decode_alloc(dst, prompt_len, 4)
    KV.adopt(dst, td, prompt_len, payload)
    assert torch.equal(KV.extract(dst, td, prompt_len), payload)
    # every piece landed where the decode worker's tables say
    for p in KV.layout(src, prompt_len):
        sv = KV.page_view(getattr(src.layers[p.ratio], p.pool), 16)
        dv = KV.page_view(getattr(dst.layers[p.ratio], p.pool), 16)
        s_ids = (ts.raw if p.table == "raw" else ts.comp[p.ratio])[p.first:p.first + p.count]
        d_ids = (td.raw if p.table == "raw" else td.comp[p.ratio])[p.first:p.first + p.count]
        assert torch.equal(sv[s_ids], dv[d_ids]), p
    if kv_format == "fp8":
        assert any(p.page_bytes == 16 * 584 for p in KV.layout(src, prompt_len))


def test_handoff_checks_its_input(tiny):
    c = tiny.cache(20, max_context=64)
    t = c.alloc(30)
    with pytest.raises(ValueError, match="payload"):
        KV.adopt(c, t, 30, torch.zeros(10, dtype=torch.uint8))
    with pytest.raises(ValueError, match="prompt_len"):
        KV.layout(c, 0)
    short = c.alloc(40, first_raw_token=32)                   # holds no raw page of the window
    with pytest.raises(ValueError, match="does not hold"):
        KV.extract(c, short, 30)


@pytest.mark.parametrize("overlap", [False, True])
def test_handoff_bytes_are_the_models_paged_count(overlap):
    cfg = _cfg_fp8(overlap)
    for kv_format in ("bf16", "fp8"):
        c = PagedCache(cfg, [0, 4, 8], 30, 16, max_context=128, kv_format=kv_format, dtype=torch.bfloat16)
        for L in (1, 9, 37, 100):
            assert KV.payload_bytes(c, L) == PM.kv_bytes(cfg, L, kv_format=kv_format, page_size=16)["total"], (kv_format, L)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _handoff_worker(rank, port, backend, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import torch.distributed as dist
    from dsv4lab.drivers import tp
    try:
        d = tp.init(backend)
        cfg = _cfg_fp8()
        out = {}
        for kv_format in ("bf16", "fp8"):
            cache = PagedCache(cfg, [0, 4, 8], 40, 16, max_context=128, kv_format=kv_format,
                               dtype=torch.bfloat16, device=d.device)
            _fill_random(cache, 10 + rank)
            for L in (5, 37):
                if rank == 0:
                    t = cache.alloc(L)
                    payload = KV.extract(cache, t, L)
                    KV.Sender(1, d.device).send(rid=L, prompt_len=L, first_token=3, prefill_start_ms=1.5,
                                                finish_ms=2.5, payload=payload)
                    back = torch.empty_like(payload)
                    dist.recv(back, 1)
                    out[f"{kv_format} {L}"] = bool(torch.equal(back, payload))
                    cache.release(t)
                else:
                    cache.alloc(23)                          # other pages on this side
                    h = KV.Receiver(0, d.device).recv(cache, lambda head: S.decode_alloc(cache, head["prompt_len"], 2))
                    assert (h["rid"], h["prompt_len"], h["first_token"], h["finish_ms"]) == (L, L, 3, 2.5)
                    assert h["transfer_ms"] >= 0 and h["nbytes"] == KV.payload_bytes(cache, L)
                    dist.send(KV.extract(cache, h["tables"], L), 0)
        if rank == 0:
            KV.Sender(1, d.device).close()
        else:
            out["end"] = KV.Receiver(0, d.device).recv(None, None) is None
        out["sweep"] = KV.transfer_sweep([1000, 4096], rank=rank, peer=1 - rank, device=d.device, reps=2)
        q.put((rank, out))
        dist.destroy_process_group()
    except Exception as e:  # report instead of hanging the parent
        q.put((rank, repr(e)))


def _two_processes(backend):
    ctx = torch.multiprocessing.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_handoff_worker, args=(r, port, backend, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=180) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    for r, out in got.items():
        assert isinstance(out, dict), f"rank {r} failed: {out}"
    assert all(got[0][k] for k in ("bf16 5", "bf16 37", "fp8 5", "fp8 37")), got[0]
    assert got[1]["end"] is True
    assert got[0]["sweep"] == [] and [r["bytes"] for r in got[1]["sweep"]] == [1000, 4096]
    assert all(r["gbs"] > 0 and r["kind"] == "transfer" for r in got[1]["sweep"])


def test_handoff_round_trips_bit_for_bit_over_gloo():
    _two_processes("gloo")


@pytest.mark.gpu
def test_handoff_round_trips_bit_for_bit_over_nccl():
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        pytest.skip(f"the NCCL hand-off needs 2 GPUs, found {n}")
    _two_processes("nccl")


# ---- the serving loops and their statistics ------------------------------------------------------

def test_percentile_is_numpys_linear():
    xs = [3.0, 1.0, 7.5, 2.0, 10.0, 4.0]
    for q in (0, 1, 50, 90, 99, 100):
        assert S.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert S.percentile([5.0], 99) == 5.0
    with pytest.raises(ValueError):
        S.percentile([], 50)


def test_summary_by_hand():
    a = S.Request(0, 10.0, [1], 3, tokens=[1, 2, 3], token_ms=[14.0, 16.0, 20.0], transfer_ms=1.0)
    b = S.Request(1, 12.0, [1], 2, tokens=[1, 2], token_ms=[20.0, 21.0])
    s = S.summarize([a, b])
    assert s["requests"] == 2 and s["output_tokens"] == 5
    assert s["ttft_p50_ms"] == pytest.approx((4.0 + 8.0) / 2) and s["ttft_mean_ms"] == pytest.approx(6.0)
    assert s["tpot_mean_ms"] == pytest.approx((3.0 + 1.0) / 2)        # (20-14)/2 and (21-20)/1
    assert s["itl_p50_ms"] == pytest.approx(2.0)                       # gaps 2, 4, 1
    assert s["makespan_ms"] == pytest.approx(11.0)
    assert s["transfer_share_of_ttft"] == pytest.approx((1.0 / 4.0 + 0.0) / 2)
    with pytest.raises(ValueError, match="no request"):
        S.summarize([S.Request(2, 0.0, [1], 1)])


def test_one_request_scheduled_by_hand(tiny):
    """Prompt 20 in chunks of 16, 3 tokens, cost 1 + 0.5 / decode row + 0.1 / prompt row."""
    r = S.Request(0, 5.0, list(range(20)), 3)
    out = S.serve_colocated(_runner(tiny), [r], S.ServeOptions(chunk=16))
    (q,) = out.requests
    assert [it["prefill_rows"] for it in out.iterations] == [16, 4, 0, 0]
    assert q.token_ms == pytest.approx([5.0 + 2.6 + 1.4, 5.0 + 4.0 + 1.5, 5.0 + 4.0 + 3.0])
    assert q.ttft_ms == pytest.approx(4.0) and q.tpot_ms == pytest.approx(1.5)
    assert q.prefill_start_ms == 5.0 and q.prefill_end_ms == pytest.approx(9.0)
    # disaggregated: the same prompt's chunks alone, a 0.25 ms link, decode rows alone
    dis, plog = S.serve_disaggregated_local(_runner(tiny), _runner(tiny), [r], S.ServeOptions(chunk=16),
                                            transfer_ms=lambda n: 0.25)
    (d,) = dis.requests
    assert [it["prefill_rows"] for it in plog] == [16, 4]
    assert d.token_ms == pytest.approx([9.25, 10.75, 12.25]) and d.transfer_ms == 0.25
    assert d.tokens == q.tokens
    assert S.summarize(dis.requests)["transfer_share_of_ttft"] == pytest.approx(0.25 / 4.25)


def test_disaggregation_keeps_chunks_out_of_the_decode_batch(tiny):
    spec = S.StreamSpec(n_requests=5, rate=40.0, prompt_len=40, output_len=6, seed=1)
    reqs = S.request_stream(spec, tiny.cfg.vocab_size)
    opts = S.ServeOptions(chunk=16, max_batch=4)
    runners = [_runner(tiny) for _ in range(3)]
    free = [r.cache.free_pages for r in runners]
    colo = S.serve_colocated(runners[0], reqs, opts)
    dis, plog = S.serve_disaggregated_local(runners[1], runners[2], reqs, opts, transfer_ms=lambda n: 0.1)
    assert S.same_tokens(colo, dis) == {"identical": True, "requests_differing": 0, "first_difference": {}}
    assert all(len(r.tokens) == 6 for r in colo.requests + dis.requests)
    assert all(it["prefill_rows"] == 0 for it in dis.iterations) and all(it["decode_rows"] == 0 for it in plog)
    sc, sd = S.summarize(colo.requests), S.summarize(dis.requests)
    assert sc["tpot_p99_ms"] > sd["tpot_p99_ms"]           # chunks stall co-located decode steps
    for r in dis.requests:                                   # a hand-off ends after its prompt
        assert r.token_ms[0] >= r.prefill_end_ms + r.transfer_ms - 1e-9
    assert [r.cache.free_pages for r in runners] == free    # every page came back


def _continuation(model, runner_a, runner_b, prompt, n_new):
    """Prefill in A, hand the pages to B, then decode alone in each: (tokens, margins) of A and B."""
    L = len(prompt)
    ta = runner_a.cache.alloc(L + n_new)
    rows = Rows()
    rows.add(ta, prompt, 0, True)
    first = runner_a.run(rows).tokens[0]
    runner_b.cache.alloc(L)                                   # other page numbers in B
    tb = S.decode_alloc(runner_b.cache, L, n_new)
    KV.adopt(runner_b.cache, tb, L, KV.extract(runner_a.cache, ta, L))
    out = []
    for run, t in ((runner_a, ta), (runner_b, tb)):
        toks, margins = [first], []
        for k in range(n_new - 1):
            rows = Rows(n_decode=1)
            rows.add(t, [toks[-1]], L + k, True)
            step = run.run(rows)
            toks.append(step.tokens[0])
            margins.append(step.margins[0])
        out.append((toks, margins))
    return out


def test_decode_after_the_handoff_continues_bit_for_bit(tiny):
    prompt = torch.randint(0, tiny.cfg.vocab_size, (45,), generator=torch.Generator().manual_seed(7)).tolist()
    a, b = _continuation(tiny, _runner(tiny), _runner(tiny), prompt, 6)
    assert a == b


def test_same_tokens_reports_the_first_difference():
    a = S.Served([S.Request(0, 0.0, [1], 3, tokens=[5, 6, 7], margins=[1.0, 0.02, 0.5])], [], "t", "graph")
    b = S.Served([S.Request(0, 0.0, [1], 3, tokens=[5, 8, 9], margins=[1.0, 0.03, 0.4])], [], "t", "graph")
    out = S.same_tokens(a, b)
    assert out["identical"] is False and out["first_difference"] == {0: {"position": 1, "margin": 0.02}}


def test_stream_and_options_check_their_fields():
    s = S.request_stream(S.StreamSpec(n_requests=50, rate=10.0, prompt_len=8, output_len=2, seed=4), 100)
    gaps = np.diff([0.0] + [r.arrival_ms for r in s])
    assert all(g > 0 for g in gaps) and 30 < np.mean(gaps) < 300           # 100 ms on average
    assert s[0].prompt == S.request_stream(S.StreamSpec(50, 10.0, 8, 2, 4), 100)[0].prompt
    for bad, match in ((dict(rate=0), "rate"), (dict(rate=math.inf), "rate"), (dict(prompt_len=0), "prompt_len"),
                       (dict(n_requests=True), "n_requests")):
        with pytest.raises(ValueError, match=match):
            S.StreamSpec(**bad)
    with pytest.raises(ValueError, match="chunk"):
        S.ServeOptions(chunk=0)


# ---- the analytic model --------------------------------------------------------------------------

def test_handoff_bytes_by_hand():
    flat = DSV4Config.flash().replace(extra={"compress_overlap": False})   # 2 window-only, 21 CSA, 20 HCA
    L = 8200                                                  # 2050 CSA entries, 64 HCA, 8 tokens unpooled
    b = PM.kv_bytes(flat, L, kv_format="fp8")
    assert b["window"] == 43 * 128 * 584
    assert b["compressed entries"] == 21 * 2050 * 584 + 20 * 64 * 584
    assert b["indexer keys"] == 21 * 2050 * (128 + 4)
    assert b["compressor state"] == 20 * 8 * (2 * 512 * 2)    # 8200 % 4 == 0: CSA holds none
    assert b["total"] == sum(b[p] for p in PM.PARTS)
    csa_state = (2 * 512 + 2 * 128) * 2                       # kv + gate, the indexer's too, bf16
    short = PM.kv_bytes(flat, 101, kv_format="bf16")          # under the window
    assert short["window"] == 43 * 101 * 1024
    assert short["compressed entries"] == 21 * 25 * 1024 and short["indexer keys"] == 21 * 25 * (256 + 4)
    assert short["compressor state"] == 21 * 1 * csa_state + 20 * 101 * 2 * 512 * 2
    # the released structure: ratio-4 state twice as wide, plus the previous block's first halves
    cfg = DSV4Config.flash()
    assert PM.overlaps(cfg, 4) and not PM.overlaps(cfg, 128) and not PM.overlaps(flat, 4)
    rel = PM.kv_bytes(cfg, 101, kv_format="bf16")
    assert rel["compressor state"] == 21 * (1 * 2 * csa_state + 4 * csa_state) + 20 * 101 * 2 * 512 * 2
    assert PM.kv_bytes(cfg, L)["compressor state"] == 21 * 4 * csa_state + 20 * 8 * 2 * 512 * 2
    assert PM.full_cache_bytes(cfg, 8192) == 43 * 8192 * 584 > 5 * PM.kv_bytes(cfg, 8192)["total"]
    with pytest.raises(ValueError, match="context"):
        PM.kv_bytes(cfg, 0)
    with pytest.raises(ValueError, match="kv_format"):
        PM.kv_bytes(cfg, 10, kv_format="fp4")


def test_handoff_bytes_of_chosen_layers():
    """``layers``: a served model that runs one layer per kind sends those layers' caches only."""
    cfg, L = DSV4Config.flash(), 4093
    every = PM.kv_bytes(cfg, L, page_size=64)
    assert PM.kv_bytes(cfg, L, page_size=64, layers=list(cfg.compress_ratios[:cfg.num_layers])) == every
    one = {r: PM.kv_bytes(cfg, L, page_size=64, layers=[r]) for r in (0, 4, 128)}
    kinds = PM.kv_bytes(cfg, L, page_size=64, layers=[0, 4, 128])
    assert all(kinds[p] == sum(one[r][p] for r in one) for p in (*PM.PARTS, "total"))
    assert one[0]["compressed entries"] == 0 < one[128]["compressed entries"] < one[4]["compressed entries"]
    assert kinds["total"] < every["total"]
    for bad in ([2], [True], [4.0], "4"):
        with pytest.raises(ValueError, match="layers"):
            PM.kv_bytes(cfg, L, layers=bad)


def test_transfer_time_and_when_splitting_pays():
    assert PM.transfer_ms(450e6, "nvlink") == pytest.approx(8e-3 + 1.0)
    assert PM.transfer_ms(64e6, "pcie") == pytest.approx(8e-3 + 1.0)
    assert PM.colocated_tpot(10.0, 50.0, 0.0) == 10.0
    assert PM.colocated_tpot(10.0, 50.0, 10.0) == pytest.approx(10.0 / (1 - 0.01 * 40.0))
    assert PM.colocated_tpot(10.0, 50.0, 20.0) == math.inf     # 20 chunks/s x 50 ms: no room
    cfg = DSV4Config.flash()
    p = PM.pd_point(cfg, batch=32, context=8192, prompt_len=8192, rate=0.5, chunk=2048)
    assert p["t_decode_ms"] < p["t_prefill_ms"] < p["t_mixed_ms"]
    assert p["disagg_tpot_ms"] == p["t_decode_ms"] < p["colocated_tpot_ms"] < p["t_mixed_ms"]
    assert p["colocated_tpot_p99_ms"] == p["t_mixed_ms"] and p["pays_p99"]
    assert p["disagg_ttft_ms"] == pytest.approx(4 * p["t_prefill_ms"] + p["transfer_ms"])
    assert 0 < p["transfer_share_of_ttft"] < 1e-2
    rows = PM.model_rows(cfg, prompt_lens=(2048,), loads=(0.5,), links=("nvlink", "pcie"))
    assert [r["link"] for r in rows] == ["NVLink 4 (H200)", "PCIe Gen5 x16"]
    assert rows[0]["transfer_ms"] < rows[1]["transfer_ms"]


# ---- the run, the benchmark, the figures ---------------------------------------------------------

def test_run_options_check_their_fields_and_parse_flags():
    o = pd_run.PDRunOptions(prompt_lens=[24, 40], loads=[0.5], cost=[1, 0.5, 0.1])
    assert o.prompt_lens == (24, 40) and pd_run.PDRunOptions.from_json(o.to_json()) == o
    for bad, match in ((dict(prompt_lens=(0,)), "prompt_lens"), (dict(loads=()), "loads"), (dict(chunk=0), "chunk"),
                       (dict(backend="mpi"), "backend"), (dict(model="huge"), "model"), (dict(cost=(1, 2)), "cost")):
        with pytest.raises(ValueError, match=match):
            pd_run.PDRunOptions(**bad)
    with pytest.raises(ValueError, match="unknown option"):
        pd_run.PDRunOptions.from_json('{"prompt_len": 3}')
    f = pd_run.parse_args(["--prompt-lens", "24,40", "--loads", "0.25,0.5", "--n-requests", "3", "--eager",
                           "--json", '{"chunk": 16}'])
    assert (f.prompt_lens, f.loads, f.n_requests, f.graphs, f.chunk) == ((24, 40), (0.25, 0.5), 3, False, 16)
    assert pd_run.torchrun_command(2)[-2:] == ["-m", "dsv4lab.drivers.pd_run"]
    with pytest.raises(ValueError, match="nproc"):
        pd_run.torchrun_command(3)


def test_run_in_one_process_writes_rows(tmp_path):
    out = tmp_path / "rows.json"
    rc = pd_run.run(pd_run.PDRunOptions(n_requests=3, prompt_lens=(24,), loads=(0.5,), cost=(1.0, 0.5, 0.1),
                                        out=str(out)))
    rows = json.loads(out.read_text())
    kinds = [r["kind"] for r in rows]
    assert rc == 0 and kinds == ["calibration", "colocated", "disaggregated"]
    dis = rows[2]
    assert dis["tokens_identical"] and dis["link"].startswith("modelled") and dis["world"] == 1
    assert dis["timing"] == "cost_model" and rows[1]["layer_counts"] == {"0": 1, "4": 1, "8": 1}
    assert rows[0]["t_prefill_chunk_ms"] == pytest.approx(1.0 + 0.1 * 16)
    assert pd_run.format_row(dis).startswith("disaggregated")


def test_launch_two_gloo_processes_through_torchrun():
    rows = pd_run.launch(pd_run.PDRunOptions(n_requests=3, prompt_lens=(24,), loads=(0.5,), backend="gloo",
                                             cost=(1.0, 0.5, 0.1), transfer_sizes=(4096,)), timeout=300, verbose=False)
    assert not [r for r in rows if r["kind"] == "error"], rows
    dis = [r for r in rows if r["kind"] == "disaggregated"]
    assert len(dis) == 1 and dis[0]["tokens_identical"] and dis[0]["link"] == "measured" and dis[0]["world"] == 2
    assert dis[0]["transfer_mean_ms"] > 0 and dis[0]["backend"] == "gloo"
    tr = [r for r in rows if r["kind"] == "transfer"]
    assert [r["bytes"] for r in tr] == [4096] and tr[0]["gbs"] > 0
    assert all(r["command"].endswith("-m dsv4lab.drivers.pd_run") for r in rows)


def test_benchmark_and_figures_tolerate_nothing_recorded(tiny):
    import matplotlib
    matplotlib.use("Agg")
    from dsv4lab import benchmarks
    from dsv4lab.plots import pd as PP
    assert "pd" in benchmarks.registered()
    assert PP.usable([]) == [] and PP.headline_rows([]) == [] and PP.transfer_check([]) == []
    (chk,) = PP.transfer_check([{"kind": "transfer", "bytes": 450_000_000, "ms": 2.016}])
    assert chk["model_ms"] == pytest.approx(1.008) and chk["measured_over_model"] == pytest.approx(2.0)
    fig = PP.plot_tpot([])
    texts = " ".join(t.get_text() for ax in fig.axes for t in ax.texts + [ax.title])
    assert "no recorded rows" in texts
    assert PP.plot_kv_bytes().axes and PP.plot_model().axes
    served = S.serve_colocated(_runner(tiny), S.request_stream(S.StreamSpec(2, 50.0, 20, 3), 256), S.ServeOptions(chunk=16))
    assert PP.plot_timeline(served).axes
    row = {"kind": "colocated", "prompt_len": 24, "rate": 1.0, "mode": "graph", "tpot_p50_ms": 1.0,
           "tpot_p99_ms": 2.0, "ttft_p50_ms": 3.0, "load": 0.5}
    assert PP.headline_rows(PP.usable([row]))[0]["colo_tpot_p99"] == 2.0
    assert PP.plot_tpot([row, {**row, "kind": "disaggregated", "tpot_p99_ms": 1.5, "link": "measured"}]).axes


# ---- GPUs ------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_real_size_layers_served_with_graphs():
    """V4-Flash's layers (preset "after": MMA attention over the FP8 cache, Triton indexer and MoE),
    a short stream co-located and split on one GPU, iterations from CUDA graphs."""
    cfg = DSV4Config.flash()
    model = ServedModel(cfg, P.preset("after"), device="cuda")
    assert model.step.kv_cache == "fp8"
    mc = 4096
    mk = lambda: Runner(model, model.cache(size_pages(mc, model.page_size, 5, model.ratios), max_context=mc))  # noqa: E731
    reqs = S.request_stream(S.StreamSpec(n_requests=3, rate=2.0, prompt_len=1024, output_len=8), cfg.vocab_size)
    opts = S.ServeOptions(chunk=512, max_batch=4)
    colo = S.serve_colocated(mk(), reqs, opts)
    dis, _ = S.serve_disaggregated_local(mk(), mk(), reqs, opts, transfer_ms=lambda n: PM.transfer_ms(n))
    assert colo.mode == "graph" and not colo.notes, colo.notes
    for served in (colo, dis):
        assert all(len(r.tokens) == 8 and all(0 <= t < cfg.vocab_size for t in r.tokens) for r in served.requests)
        assert all(it["ms"] > 0 and math.isfinite(it["ms"]) for it in served.iterations)
    same = S.same_tokens(colo, dis)
    assert same["requests_differing"] <= len(reqs)
    # with the same batch, decoding after the hand-off is decoding without it: the same tokens,
    # the same margins up to the order of a kernel's atomic additions
    prompt = reqs[0].prompt[:700]
    a, b = _continuation(model, mk(), mk(), prompt, 6)
    assert a[0] == b[0] and np.allclose(a[1], b[1], rtol=0, atol=1e-2)


@pytest.mark.gpu
def test_pd_run_over_nccl_matches_colocated_tokens():
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        pytest.skip(f"a two-rank NCCL run needs 2 GPUs, found {n}")
    rows = pd_run.launch(pd_run.PDRunOptions(model="tiny", preset="torch", dtype="fp32", n_requests=4,
                                             prompt_lens=(40,), output_len=6, loads=(0.5,), chunk=16, max_batch=8,
                                             transfer_sizes=(1 << 20, 16 << 20)), timeout=600)
    assert not [r for r in rows if r["kind"] == "error"], rows
    dis = [r for r in rows if r["kind"] == "disaggregated"]
    assert dis and all(r["tokens_identical"] and r["backend"] == "nccl" and r["nccl_nvls_enable"] == "0" for r in dis)
    assert all(r["gbs"] > 0 for r in rows if r["kind"] == "transfer")
