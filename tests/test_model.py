"""dsv4lab.model: the training forward, the decode forward through dsv4lab.ops, and their
agreement.

Tolerances: everything here runs in fp32. Decode vs training forward: |dlogits| <= 1e-4
(the two paths sum in different orders; measured ~1e-6). Interpreter (Triton) backends vs
torch backends: 2e-3 (the kernels accumulate in fp32 but in their own order, and the FP4
MoE dequantises in-kernel). FP8 KV cache: compared with a dense cache holding the same
rounded rows (exact up to 1e-4). FP8 block-scaled projections: e4m3 keeps 3 mantissa bits, so a
weight moves by at most 2^-4 of its magnitude (the test measures it); the decode path and the
training path of an FP8 model dequantise the same weights (agreement 1e-4).
"""
import math

import pytest
import torch

from dsv4lab.config import DSV4Config
from dsv4lab.engine import Engine
from dsv4lab.model import (DSV4, Block, BlockScaledFP8Linear, HyperConnection, LayerCache, fp8_block_quantize,
                           load_checkpoint, make_meta, save_checkpoint, set_projections_, shared_clone, tiny_config)
from dsv4lab.ops.mhc import sinkhorn
from dsv4lab import ops

from _model_support import TORCH, TRITON, _one_thread  # noqa: F401  (autouse fixture)
FP32_TOL = 1e-4
KERNEL_TOL = 2e-3



def _model(seed=0, fmt="mxfp4", **changes):
    torch.manual_seed(seed)
    m = DSV4(tiny_config(**changes)).eval()
    if fmt != "bf16":
        m.quantize_experts(fmt)
    return m


def _tables(eng, B):
    raw = [eng.cache.alloc(eng.n_raw) for _ in range(B)]
    comp = [eng.cache.alloc(eng.n_comp) for _ in range(B)]
    return torch.tensor(raw, dtype=torch.int32), torch.tensor(comp, dtype=torch.int32)


def _decode_chunks(m, eng, toks, chunks, backends):
    """Feed ``toks`` [B, T] through forward_decode in chunks; return logits [B, T, V]."""
    B, T = toks.shape
    bt, cbt = _tables(eng, B)
    out, p = [], 0
    for S in chunks:
        pos = torch.arange(p, p + S).expand(B, S)
        meta = make_meta(m.cfg, pos, bt, cbt, eng.page_size, eng.ratios)
        lg, _ = m.forward_decode(toks[:, p:p + S], meta, eng.cache.main, backends)
        out.append(lg)
        p += S
    assert p == T
    eng.cache.release(bt.flatten().tolist() + cbt.flatten().tolist())
    return torch.cat(out, 1)


def test_sinkhorn_is_doubly_stochastic():
    # 20 iterations (the model's setting) converge to ~1e-2 on rows for N(0, 1) logits;
    # columns are normalised last, so they are exact up to eps
    m = sinkhorn(torch.randn(5, 4, 4), iters=20)
    assert torch.allclose(m.sum(-1), torch.ones(5, 4), atol=1e-2)
    assert torch.allclose(m.sum(-2), torch.ones(5, 4), atol=1e-4)
    assert (m > 0).all()


def test_hyper_connection_starts_as_mean_and_identity():
    hc = HyperConnection(4, 8, 20)
    x = torch.randn(3, 1, 8).expand(3, 4, 8)               # equal streams
    y, post, comb = hc.pre(x)
    assert torch.allclose(y, x[:, 0], rtol=0.15, atol=0.05)   # pre ~ 1/n each: the mean
    assert torch.allclose(comb.diagonal(dim1=-2, dim2=-1), torch.ones(3, 4), atol=0.25)


def test_training_loss_and_gradients_reach_every_part():
    m = _model(fmt="bf16").train()
    batch = torch.randint(0, 256, (2, 34))
    losses = m.loss(batch)
    for k in ("main", "mtp", "indexer", "total"):
        assert torch.isfinite(losses[k]), k
    assert abs(losses["main"].item() - math.log(256)) < 1.0   # a fresh model is near uniform
    losses["total"].backward()
    missing = [n for n, p in m.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, missing


def test_router_bias_update_moves_toward_equal_load():
    m = _model(fmt="bf16").train()
    m.loss(torch.randint(0, 256, (2, 34)))
    moe = m.layers[1].moe                                  # not hash-routed
    load = moe.load.float()
    m.update_router_bias(rate=0.5)
    assert torch.equal(torch.sign(moe.bias), torch.sign(load.mean() - load))


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_decode_forward_matches_training_forward(fmt):
    # index_topk >= visible entries: the selection keeps everything, so the two paths
    # must agree exactly (selection ties are covered by the indexer test below)
    m = _model(fmt=fmt, index_topk=16)
    toks = torch.randint(0, 256, (2, 37))
    with torch.no_grad():
        ref, streams, _ = m.forward_train(toks)
        eng = Engine(m, max_batch=2, max_len=64, page_size=8, backends=TORCH)
        for chunks in ([37], [20, 1, 1, 3, 12], [1] * 5 + [32]):
            lg = _decode_chunks(m, eng, toks, chunks, TORCH)
            assert (lg - ref).abs().max().item() < FP32_TOL, chunks
        # the MTP layer too (the cache now holds the whole sequence)
        nxt = torch.roll(toks, -1, 1)
        mref, _ = m.mtp_forward_train(streams, nxt)
        bt, cbt = _tables(eng, 2)
        pos = torch.arange(37).expand(2, 37)
        _, h = m.forward_decode(toks, make_meta(m.cfg, pos, bt, cbt, 8, eng.ratios), eng.cache.main, TORCH)
        ml, _ = m.mtp_forward_decode(h, nxt, make_meta(m.cfg, pos, bt, cbt, 8, [0]), eng.cache.mtp, TORCH)
        assert (ml - mref).abs().max().item() < FP32_TOL


def test_indexer_keys_in_cache_match_dense_indexer():
    m = _model()
    layer = m.layers[1]
    assert layer.ratio == 4
    B, T = 2, 29
    toks = torch.randint(0, 256, (B, T))
    eng = Engine(m, max_batch=B, max_len=64, page_size=4, backends=TORCH)
    bt, cbt = _tables(eng, B)
    pos = torch.arange(T).expand(B, T)
    meta = make_meta(m.cfg, pos, bt, cbt, 4, eng.ratios)
    with torch.no_grad():
        m.forward_decode(toks, meta, eng.cache.main, TORCH)
        # the layer's input, recomputed with the training path
        x = m.embed(toks).unsqueeze(-2).expand(-1, -1, m.cfg.hc_mult, -1)
        x, _ = m.layers[0].forward_train(x, toks)
        y, _, _ = layer.hc_attn.pre(x)
        y = layer.attn_norm(y)
        att = layer.attn
        qr = att.q_norm(att.wq_a(y))
        dense = att.indexer.logits_train(y, qr, torch.arange(T))               # [B, T, T//4]
        q, w = att.indexer.queries(y, qr, pos)
        c = eng.cache.main[1]
        got = ops.indexer_logits(q, c.idx_keys, c.idx_scale, w, cbt, meta.n_entries[4],
                                 max_context=cbt.shape[1] * 4, backend="torch_fallback")
    vis = (torch.arange(T // 4)[None, :] + 1) * 4 <= torch.arange(T)[:, None] + 1
    assert torch.isneginf(got[:, :, :T // 4][:, ~vis]).all()
    assert (got[:, :, :T // 4][:, vis] - dense[:, vis]).abs().max() < FP32_TOL
    assert torch.isneginf(got[:, :, T // 4:]).all()


@pytest.mark.parametrize("attn", ["mma", "simt"])
def test_decode_with_triton_backends_in_interpreter(attn):
    m = _model(seed=1)
    toks = torch.randint(0, 256, (2, 13))
    be = dict(TRITON, sparse_mla_decode=attn)
    with torch.no_grad():
        eng = Engine(m, max_batch=2, max_len=32, page_size=8, backends=TORCH)
        ref = _decode_chunks(m, eng, toks, [11, 2], TORCH)
        eng = Engine(m, max_batch=2, max_len=32, page_size=8, backends=be)
        got = _decode_chunks(m, eng, toks, [11, 2], be)
    assert (got - ref).abs().max().item() < KERNEL_TOL


def test_quantised_experts_decode_equals_dequantised_training_path():
    m = _model(fmt="bf16", index_topk=16)
    toks = torch.randint(0, 256, (1, 17))
    with torch.no_grad():
        before, _, _ = m.forward_train(toks)
        m.quantize_experts("mxfp4")
        assert all(l.moe.fmt == "mxfp4" for l in m.layers) and m.mtp[0].block.moe.fmt == "mxfp4"
        after, _, _ = m.forward_train(toks)                    # dequantised experts
        eng = Engine(m, max_batch=1, max_len=32, page_size=8, backends=TORCH)
        dec = _decode_chunks(m, eng, toks, [17], TORCH)        # ops.fused_moe on packed FP4
    assert (dec - after).abs().max().item() < FP32_TOL
    rel = ((after - before).norm() / before.norm()).item()
    # FP4 changes a random model (E2M1 keeps ~1 significant digit; the trained model's
    # held-out loss before/after is in its training log): changed, but not garbage
    assert 0 < rel < 1.0


def test_checkpoint_roundtrip(tmp_path):
    m = _model()
    path = tmp_path / "m.safetensors"
    save_checkpoint(m, path, metadata={"note": "test"})
    m2 = load_checkpoint(path)
    assert m2.cfg == m.cfg and m2.expert_format == "mxfp4"
    toks = torch.randint(0, 256, (1, 21))
    with torch.no_grad():
        assert torch.equal(m.forward_train(toks)[0], m2.forward_train(toks)[0])
    assert m2.checkpoint_metadata["note"] == "test"


def test_interrupted_save_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    import safetensors.torch
    m = _model()
    path = tmp_path / "m.safetensors"
    save_checkpoint(m, path)
    before = path.read_bytes()

    def torn(tensors, filename, metadata=None):
        open(filename, "wb").write(b"half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", torn)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(_model(seed=1), path)
    assert path.read_bytes() == before                       # the old checkpoint, untouched
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]   # no temporary left behind


def test_fp8_kv_cache_needs_the_584_byte_geometry():
    with pytest.raises(ValueError, match="head_dim 512"):
        LayerCache.allocate(tiny_config(), 0, 4, 8, kv_format="fp8")
    with pytest.raises(ValueError, match="kv_format"):
        LayerCache.allocate(tiny_config(), 0, 4, 8, kv_format="int4")


def test_fp8_kv_cache_decode_equals_dense_cache_of_rounded_rows(monkeypatch):
    # The FP8 cache must behave exactly like a dense cache holding unpack(pack(row)) for
    # every row written (raw tokens and compressed entries alike).
    from dsv4lab import quant
    from dsv4lab.model import Attention
    m = _model(head_dim=512, rope_dim=64, index_topk=16)   # top-k keeps all: no selection
    toks = torch.randint(0, 256, (2, 19))
    with torch.no_grad():
        eng = Engine(m, max_batch=2, max_len=32, page_size=8, kv_format="fp8", backends=TORCH)
        assert eng.cache.main[0].kv.dtype == torch.uint8 and eng.cache.main[0].kv.shape[-1] == 584
        got = _decode_chunks(m, eng, toks, [16, 3], TORCH)
        write = Attention.write_kv

        def rounded(kv_flat, slots, values, fp8):
            flat = values.reshape(-1, values.shape[-1])
            write(kv_flat, slots, quant.unpack_kv_fp8(quant.pack_kv_fp8(flat)).view_as(values), fp8)

        monkeypatch.setattr(Attention, "write_kv", staticmethod(rounded))
        eng = Engine(m, max_batch=2, max_len=32, page_size=8, backends=TORCH)
        ref = _decode_chunks(m, eng, toks, [16, 3], TORCH)
    assert (got - ref).abs().max().item() < FP32_TOL


@pytest.mark.parametrize("layer_id", [0, 2, 3])
def test_flash_size_layer_is_constructible(layer_id):
    cfg = DSV4Config.flash()
    with torch.device("meta"):
        blk = Block(cfg, layer_id, expert_format="mxfp4")
    assert blk.ratio == cfg.compress_ratios[layer_id]
    assert blk.moe.w13.dtype == torch.uint8
    assert tuple(blk.moe.w13.shape) == (256, 2 * 2048, 4096 // 2)
    assert tuple(blk.moe.w2_scale.shape) == (256, 4096, 2048 // 32)
    assert tuple(blk.attn.wo_a.shape) == (8, 1024, 8 * 512)
    assert (blk.attn.indexer is not None) == (blk.ratio == 4)
    assert blk.moe.hashed == (layer_id < 3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flash_size_layer_decodes_on_gpu():
    from dsv4lab.model import to_dtype
    cfg = DSV4Config.flash()
    torch.manual_seed(0)
    with torch.device("cuda"):
        blk = to_dtype(Block(cfg, 3, expert_format="mxfp4"), torch.bfloat16)   # ratio 128
    B, S, page = 2, 2, 64
    cache = LayerCache.allocate(cfg, blk.ratio, 1 + B * 8, page, kv_format="fp8", device="cuda")
    bt = torch.arange(1, 1 + B * 6, dtype=torch.int32, device="cuda").view(B, 6)
    cbt = torch.arange(1 + B * 6, 1 + B * 8, dtype=torch.int32, device="cuda").view(B, 2)
    pos = torch.tensor([[254, 255], [300, 301]], device="cuda")
    meta = make_meta(cfg, pos, bt, cbt, page, [blk.ratio])
    x = torch.randn(B, S, cfg.hc_mult, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    toks = torch.randint(0, cfg.vocab_size, (B, S), device="cuda")
    with torch.no_grad():
        y = blk.forward_decode(x, toks, meta, cache, {"sparse_mla_decode": "mma", "fused_moe": "triton"})
    assert y.shape == x.shape and torch.isfinite(y.float()).all()


# ---------------------------------------------------------------- FP8 projections, overlap ----
@pytest.mark.parametrize("shape", [(1, 1), (64, 32), (128, 128), (130, 257), (300, 129)])
def test_fp8_block_quantize_scales_are_powers_of_two_and_fit(shape):
    torch.manual_seed(0)
    w = torch.randn(*shape) * 10.0 ** torch.randint(-3, 3, (1,)).item()
    w[: min(shape[0], 3)] = 0.0                                    # some all-zero rows
    q, s = fp8_block_quantize(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.shape == (-(-shape[0] // 128), -(-shape[1] // 128)) and s.dtype == torch.float32
    assert bool((torch.frexp(s).mantissa == 0.5).all())           # powers of two (ue8m0)
    lin = BlockScaledFP8Linear(q, s)
    back = lin.dequantize()
    assert (back.abs() <= 448 * s.repeat_interleave(128, 0)[:shape[0]].repeat_interleave(128, 1)[:, :shape[1]]).all()
    err = (back - w).abs()
    assert bool((err <= w.abs() * 2 ** -4 + s.min() * 2 ** -9).all())  # round to nearest e4m3 (subnormals: abs)
    x = torch.randn(3, shape[1])
    assert torch.allclose(lin(x), x @ back.t(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="NaN or Inf"):
        fp8_block_quantize(torch.full((2, 2), float("inf")))
    with pytest.raises(ValueError, match="weight_scale"):
        BlockScaledFP8Linear(q, s[:, :0])


@pytest.mark.parametrize("overlap", [False, True])
def test_fp8_projections_and_overlap_decode_matches_training(overlap):
    m = _model(index_topk=16, extra={"compress_overlap": overlap}).quantize_projections("fp8")
    att = m.layers[1].attn
    assert m.projections == "fp8" and isinstance(att.wq_b, BlockScaledFP8Linear)
    assert isinstance(att.wo_a, BlockScaledFP8Linear) and not m.layers[1].moe.shared.fused
    assert isinstance(att.compressor.wkv, torch.nn.Linear)         # compressors stay bf16 (as released)
    D = m.cfg.head_dim
    assert att.compressor.wkv.weight.shape[0] == (2 * D if overlap else D)
    assert m.layers[2].attn.compressor.wkv.weight.shape[0] == D    # ratio 8: never overlapping
    toks = torch.randint(0, 256, (2, 37))
    with torch.no_grad():
        ref, _, _ = m.forward_train(toks)
        eng = Engine(m, max_batch=2, max_len=64, page_size=8, backends=TORCH)
        assert eng.cache.main[1].comp_kv.shape[-1] == (2 * D if overlap else D)
        for chunks in ([37], [3, 1, 1, 32]):
            lg = _decode_chunks(m, eng, toks, chunks, TORCH)
            assert (lg - ref).abs().max().item() < FP32_TOL, chunks


def test_overlapping_compressor_pools_two_blocks():
    """Entry j pools its own r tokens (second half of the projection) and the r before them
    (first half); entry 0 its own only."""
    m = _model(extra={"compress_overlap": True})
    c = m.layers[1].attn.compressor
    torch.manual_seed(3)
    x = torch.randn(1, 12, m.cfg.hidden_size)
    with torch.no_grad():
        got = c.forward_train(x)                                     # [1, 3, D]
        kv, gate = c.project(x)
        d = c.out_dim
        g = gate + torch.cat([c.ape, c.ape, c.ape])                  # position t mod 4
        want = []
        for j in range(3):
            own = slice(4 * j, 4 * j + 4)
            if j == 0:
                k, s = kv[0, own, d:], g[0, own, d:]
            else:
                prev = slice(4 * j - 4, 4 * j)
                k = torch.cat([kv[0, prev, :d], kv[0, own, d:]])
                s = torch.cat([g[0, prev, :d], g[0, own, d:]])
            want.append((s.softmax(0) * k).sum(0))
        want = c.norm(torch.stack(want)[None])
    from dsv4lab.model import rope_tail
    want = rope_tail(want, torch.arange(3) * 4, c.rope_dim, c.theta)
    assert torch.allclose(got, want, atol=1e-5)


def test_projection_variants_share_everything_else():
    m = _model(fmt="mxfp4")
    blk = m.layers[1]
    fp8 = set_projections_(shared_clone(blk), "fp8")
    assert isinstance(fp8.attn.wq_a, BlockScaledFP8Linear) and not isinstance(blk.attn.wq_a, BlockScaledFP8Linear)
    assert fp8.moe.w13 is blk.moe.w13 and fp8.attn.compressor.wkv.weight is blk.attn.compressor.wkv.weight
    assert fp8.attn.attn_sink is blk.attn.attn_sink
    back = set_projections_(shared_clone(fp8), "bf16")
    assert back.moe.shared.fused and back.attn.wo_a.shape == blk.attn.wo_a.shape
    assert torch.equal(back.attn.wq_b.weight, fp8.attn.wq_b.dequantize())
    odd = _model(o_lora_rank=48).quantize_projections("fp8")       # 48-row groups straddle 128-row blocks
    x = torch.randn(3, odd.cfg.num_heads, odd.cfg.head_dim)
    pos = torch.arange(3)
    att = odd.layers[0].attn
    want = set_projections_(shared_clone(att), "bf16").project_out(x, pos)
    assert torch.allclose(att.project_out(x, pos, backends={}), want, atol=1e-5)


def test_fp8_model_saves_and_loads(tmp_path):
    m = _model().quantize_projections("fp8")
    save_checkpoint(m, tmp_path / "m.safetensors")
    m2 = load_checkpoint(tmp_path / "m.safetensors")
    assert m2.projections == "fp8"
    toks = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        assert torch.equal(m.forward_train(toks)[0], m2.forward_train(toks)[0])


def test_nvfp4_per_expert_globals():
    from dsv4lab import quant
    m = _model(fmt="bf16")
    moe = m.layers[1].moe
    dense13, dense2 = moe.dense_experts()
    q13 = [quant.nvfp4_quantize(w) for w in dense13]
    q2 = [quant.nvfp4_quantize(w) for w in dense2]
    st = lambda qs, j: torch.stack([q[j] for q in qs])  # noqa: E731
    moe._set_quantized("nvfp4", st(q13, 0), st(q13, 1), st(q2, 0), st(q2, 1), st(q13, 2), st(q2, 2))
    assert moe.w13_global.shape == (moe.n_experts,)
    w13, _ = moe.dense_experts()
    want = torch.stack([quant.nvfp4_dequantize(*q) for q in q13])
    assert torch.equal(w13, want)
    x = torch.randn(5, m.cfg.hidden_size)
    toks = torch.randint(0, 256, (5,))
    with torch.no_grad():
        got = moe.forward_decode(x, toks, {"fused_moe": "torch"})
        ref = moe.forward_train(x[None], toks[None])[0]
    assert (got - ref).abs().max().item() < FP32_TOL
