"""dsv4lab.checkpoint: the released layout written, read back lazily, and refused when corrupt.

Tolerances: a checkpoint written by the writer holds exactly the source model's tensors (its
bf16-stored floats are bf16 already), so the loaded model equals it bit for bit and its
forwards agree to 1e-6 (fp32, torch backends; measured 0). The interpreter's kernels against
the torch backends: 2e-3 (tests/test_model.py's KERNEL_TOL).
"""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import dsv4lab  # noqa: F401  (interpreter switch before triton)
from dsv4lab import checkpoint as C
from dsv4lab.backends import BackendUnavailable
from dsv4lab.config import DSV4Config
from dsv4lab.engine import Engine
from dsv4lab.model import BlockScaledFP8Linear, make_meta

from _model_support import TORCH, TRITON, _one_thread  # noqa: F401  (autouse fixture)

FIXTURES = Path(__file__).parent / "fixtures"
TIGHT = 1e-6
KERNEL_TOL = 2e-3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{fmt: (source model, checkpoint directory)} for the released and the ModelOpt format."""
    out = {}
    for fmt in C.FORMATS:
        src = C.tiny_release_model(fmt)
        out[fmt] = (src, C.write_checkpoint(src, tmp_path_factory.mktemp(fmt), shards=3))
    return out


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _shard_of(path: Path, name: str) -> str:
    return json.loads((path / C.reader.INDEX).read_text())["weight_map"][name]


def _rewrite(path: Path, name: str, change):
    """Rewrite the shard holding ``name`` with ``change(tensors)`` applied."""
    shard = path / _shard_of(path, name)
    tensors = load_file(str(shard))
    change(tensors)
    save_file(tensors, str(shard))


# ---------------------------------------------------------------- the layout ------------------
def test_written_config_is_the_released_one():
    """The writer's config.json for Flash's sizes is the released config.json, key for key."""
    fx = json.loads((FIXTURES / "deepseek_v4_flash_config.json").read_text())
    assert C.config_json(DSV4Config.from_hf_config(fx), "fp8") == fx
    nv = json.loads((FIXTURES / "deepseek_v4_flash_nvfp4_config.json").read_text())
    mine = C.config_json(DSV4Config.from_hf_config(nv), "nvfp4")
    assert set(mine) == set(nv) and set(mine["quantization_config"]) == set(nv["quantization_config"])
    for layer in ("main", "mtp"):
        assert DSV4Config.from_hf_config(mine).formats(layer) == DSV4Config.from_hf_config(nv).formats(layer)


def test_tiny_checkpoint_files_names_and_dtypes(tiny):
    _, path = tiny["fp8"]
    index = json.loads((path / C.reader.INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for s in shards for t in load_file(str(path / s)).values())
    ck = C.Checkpoint(path)
    assert ck.cfg.compress_ratios == (0, 0, 4, 128, 4, 128, 0) and ck.cfg.extra["compress_overlap"]
    assert ck.formats["main"].experts == ck.formats["mtp"].experts == "mxfp4"
    assert ck.formats["main"].dense.dtype == "fp8_e4m3"
    info = {n: ck.info(n) for n in ("layers.2.attn.wq_a.weight", "layers.2.attn.wq_a.scale",
                                     "layers.2.attn.compressor.wkv.weight", "layers.2.attn.indexer.wq_b.scale",
                                     "layers.3.ffn.experts.5.w2.weight", "layers.3.ffn.experts.5.w2.scale",
                                     "layers.0.ffn.gate.tid2eid", "layers.3.ffn.gate.bias", "mtp.0.e_proj.scale",
                                     "mtp.0.hc_head_scale", "layers.4.attn.wo_a.weight", "embed.weight")}
    d, D, I, E = 128, 64, 64, 8
    assert info["layers.2.attn.wq_a.weight"] == ("F8_E4M3", [64, d])
    assert info["layers.2.attn.wq_a.scale"] == ("F8_E8M0", [1, 1])
    assert info["layers.2.attn.compressor.wkv.weight"] == ("BF16", [2 * D, d])      # overlapping
    assert info["layers.3.ffn.experts.5.w2.weight"] == ("I8", [d, I // 2])
    assert info["layers.3.ffn.experts.5.w2.scale"] == ("F8_E8M0", [d, I // 32])
    assert info["layers.0.ffn.gate.tid2eid"] == ("I64", [256, 2])
    assert info["layers.3.ffn.gate.bias"] == ("F32", [E])
    assert info["mtp.0.hc_head_scale"] == ("F32", [1]) and info["mtp.0.e_proj.scale"][0] == "F8_E8M0"
    assert info["layers.4.attn.wo_a.weight"] == ("F8_E4M3", [2 * 64, 2 * 64])
    assert info["embed.weight"] == ("BF16", [256, d])
    assert "layers.0.ffn.gate.bias" not in ck.weight_map and "layers.3.ffn.gate.tid2eid" not in ck.weight_map
    assert not any(n.startswith("mtp.0.embed") or n.startswith("mtp.0.head") for n in ck.weight_map)

    nv = C.Checkpoint(tiny["nvfp4"][1])
    assert nv.formats["main"].experts == "nvfp4" and nv.formats["mtp"].experts == "mxfp4"
    assert nv.info("layers.3.ffn.experts.0.w1.weight_scale") == ("F8_E4M3", [I, d // 16])
    assert nv.info("layers.3.ffn.experts.0.w1.weight_scale_2") == ("F32", [])
    assert nv.info("layers.3.attn.wq_b.weight")[0] == "BF16" and "layers.3.attn.wq_b.scale" not in nv.weight_map
    assert nv.info("mtp.0.ffn.experts.0.w1.scale")[0] == "F8_E8M0"


# ---------------------------------------------------------------- reading back ----------------
@pytest.mark.parametrize("fmt", C.FORMATS)
def test_loaded_model_is_the_source_model(tiny, fmt):
    src, path = tiny[fmt]
    m = C.Checkpoint(path).model(dtype=torch.float32)
    assert m.cfg == src.cfg and m.expert_format == src.expert_format and m.projections == src.projections
    a, b = src.state_dict(), m.state_dict()
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    toks = torch.randint(0, 256, (2, 29))
    with torch.no_grad():
        ref, streams, _ = src.forward_train(toks)
        got, _, _ = m.forward_train(toks)
        assert (got - ref).abs().max().item() <= TIGHT
        nxt = torch.roll(toks, -1, 1)
        assert (m.mtp_forward_train(streams, nxt)[0] - src.mtp_forward_train(streams, nxt)[0]).abs().max() <= TIGHT


def _decode(model, toks, backends, chunks):
    """Logits of ``toks`` fed through forward_decode in ``chunks``, on the model's device."""
    dev = next(model.parameters()).device
    toks = toks.to(dev)
    eng = Engine(model, max_batch=toks.shape[0], max_len=48, page_size=8, backends=backends, device=dev)
    B, _ = toks.shape
    bt = torch.tensor([eng.cache.alloc(eng.n_raw) for _ in range(B)], dtype=torch.int32, device=dev)
    cbt = torch.tensor([eng.cache.alloc(eng.n_comp) for _ in range(B)], dtype=torch.int32, device=dev)
    out, p = [], 0
    for S in chunks:
        pos = torch.arange(p, p + S, device=dev).expand(B, S)
        lg, _ = model.forward_decode(toks[:, p:p + S], make_meta(model.cfg, pos, bt, cbt, 8, eng.ratios),
                                     eng.cache.main, backends)
        out.append(lg)
        p += S
    return torch.cat(out, 1)


@pytest.mark.parametrize("fmt", C.FORMATS)
def test_decode_step_of_the_loaded_model(tiny, fmt):
    """Decode through dsv4lab.ops (torch backends): the loaded model gives the source model's
    logits, which are the training forward's (index_topk keeps every entry here)."""
    src, path = tiny[fmt]
    m = C.Checkpoint(path).model(dtype=torch.float32)
    toks = torch.randint(0, 256, (2, 23))
    with torch.no_grad():
        ref = src.forward_train(toks)[0]
        a = _decode(src, toks, TORCH, [20, 1, 2])
        b = _decode(m, toks, TORCH, [20, 1, 2])
    assert (a - b).abs().max().item() <= TIGHT
    assert (b - ref).abs().max().item() < 1e-4


def test_decode_step_with_the_kernels_in_the_interpreter(tiny):
    """Every op through its Triton kernel, the FP8 projections (grouped wo_a included) too."""
    src, path = tiny["fp8"]
    m = C.Checkpoint(path).model(dtype=torch.float32)
    toks = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        ref = _decode(m, toks, TORCH, [8, 1])
        got = _decode(m, toks, dict(TRITON, linear="triton"), [8, 1])
    assert (got - ref).abs().max().item() < KERNEL_TOL


def test_one_layer_reads_only_its_tensors(tiny, monkeypatch):
    src, path = tiny["fp8"]
    ck = C.Checkpoint(path)
    read = []
    orig = C.Checkpoint.tensor
    monkeypatch.setattr(C.Checkpoint, "tensor", lambda self, spec, device=None: read.append(spec.name) or
                        orig(self, spec, device))
    blk = ck.block(4, dtype=torch.float32)
    assert read and all(n.startswith("layers.4.") for n in read)
    assert set(read) == set(ck.names("layers.4."))
    assert isinstance(blk.attn.wq_b, BlockScaledFP8Linear) and blk.moe.fmt == "mxfp4"
    for k, v in src.layers[4].state_dict().items():
        assert torch.equal(v, blk.state_dict()[k]), k
    read.clear()
    hashed = ck.block(0, dtype=torch.float32)
    assert hashed.moe.hashed and torch.equal(hashed.moe.tid2eid, src.layers[0].moe.tid2eid)
    assert not bool(hashed.moe.bias.any())
    assert all(n.startswith("layers.0.") for n in read)
    head = ck.head(dtype=torch.float32)
    assert torch.equal(head.head.weight, src.head.weight) and torch.equal(head.hc_head.fn, src.hc_head.fn)
    assert torch.equal(ck.embedding(dtype=torch.float32).weight, src.embed.weight)
    with pytest.raises(ValueError, match="layer must be"):
        ck.block(6)


@pytest.mark.parametrize("fmt", C.FORMATS)
def test_draft_from_the_checkpoint(tiny, fmt):
    src, path = tiny[fmt]
    draft = C.load_draft(path, dtype=torch.float32)
    assert draft.plan.role == "draft" and draft.plan.fmt == "mxfp4"      # ModelOpt leaves mtp.* in MXFP4
    assert draft.backends == {"fused_moe": draft.plan.backend.name}
    assert "checkpoint metadata" in draft.plan.fmt_source
    B, S = 2, 5
    streams = torch.randn(B, S, src.cfg.hc_mult, src.cfg.hidden_size)
    nxt = torch.randint(0, 256, (B, S))
    with torch.no_grad():
        want = src.mtp_forward_train(streams, nxt)[0]
        got = draft.model.mtp_forward_train(streams, nxt)[0]
    assert (got - want).abs().max().item() <= TIGHT
    shared = C.load_draft(path, dtype=torch.float32, embed=src.embed, head=src.head)
    assert shared.model.embed is src.embed and shared.model.head is src.head
    with pytest.raises(BackendUnavailable):
        C.load_draft(path, speculative_moe_runner_backend="no_such_backend")


# ---------------------------------------------------------------- corrupt checkpoints --------
def test_missing_tensor_is_named(tiny, tmp_path):
    path = _copy(tiny["fp8"][1], tmp_path / "c")
    name = "layers.2.attn.indexer.wq_b.scale"
    _rewrite(path, name, lambda t: t.pop(name))
    ck = C.Checkpoint(path)
    with pytest.raises(C.CheckpointError, match=r"layers\.2\.attn\.indexer\.wq_b\.scale.*cannot be read"):
        ck.block(2)
    idx = json.loads((path / C.reader.INDEX).read_text())
    del idx["weight_map"][name]
    (path / C.reader.INDEX).write_text(json.dumps(idx))
    with pytest.raises(C.CheckpointError, match=r"missing tensor layers\.2\.attn\.indexer\.wq_b\.scale"):
        C.Checkpoint(path).block(2)
    C.Checkpoint(path).block(3)                     # the other layers still load


def test_wrong_dtype_and_shape_are_named(tiny, tmp_path):
    path = _copy(tiny["fp8"][1], tmp_path / "c")
    name = "layers.3.attn.wq_b.weight"
    _rewrite(path, name, lambda t: t.__setitem__(name, t[name].to(torch.bfloat16)))
    with pytest.raises(C.CheckpointError,
                       match=r"layers\.3\.attn\.wq_b\.weight.*dtype bfloat16, expected float8_e4m3fn"):
        C.Checkpoint(path).block(3)
    name = "layers.4.ffn.experts.1.w3.scale"
    _rewrite(path, name, lambda t: t.__setitem__(name, t[name][:, :1].contiguous()))
    with pytest.raises(C.CheckpointError,
                       match=r"layers\.4\.ffn\.experts\.1\.w3\.scale.*shape \[64, 1\], expected \[64, 4\]"):
        C.Checkpoint(path).block(4)


def test_truncated_and_missing_shards(tiny, tmp_path):
    path = _copy(tiny["fp8"][1], tmp_path / "c")
    shard = path / "model-00002-of-00003.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:len(data) // 2])
    ck = C.Checkpoint(path)                     # opening reads only config.json and the index
    held = [n for n, s in ck.weight_map.items() if s == shard.name]
    with pytest.raises(C.CheckpointError, match=r"shard model-00002-of-00003\.safetensors cannot be read.*truncated"):
        ck.model()
    shard.unlink()
    with pytest.raises(C.CheckpointError, match=rf"shard model-00002-of-00003\.safetensors is missing.*{held[0]}"):
        C.Checkpoint(path)


def test_bad_values_are_refused_where_loaded(tiny, tmp_path):
    path = _copy(tiny["fp8"][1], tmp_path / "c")
    name = "layers.3.attn.wkv.scale"
    _rewrite(path, name, lambda t: t.__setitem__(name, torch.full_like(t[name].view(torch.uint8), 255)
                                                  .view(torch.float8_e8m0fnu)))
    with pytest.raises(C.CheckpointError, match=r"layers\.3\.attn\.wkv\.scale.*255"):
        C.Checkpoint(path).block(3)
    _rewrite(path, name, lambda t: t.__setitem__(name, torch.full(t[name].shape, 0.3)))
    with pytest.raises(C.CheckpointError, match=r"layers\.3\.attn\.wkv\.scale.*powers of two"):
        C.Checkpoint(path).block(3)
    name = "layers.5.attn_norm.weight"
    _rewrite(path, name, lambda t: t[name].__setitem__(0, float("nan")))
    with pytest.raises(C.CheckpointError, match=r"layers\.5\.attn_norm\.weight.*NaN"):
        C.Checkpoint(path).block(5)
    name = "layers.1.ffn.experts.0.w2.scale"
    _rewrite(path, name, lambda t: t[name].view(torch.uint8).__setitem__((0, 0), 255))
    with pytest.raises(C.CheckpointError, match=r"layers\.1\.ffn\.experts\.0\.w2\.scale.*E8M0 NaN"):
        C.Checkpoint(path).block(1)
    name = "layers.0.ffn.gate.tid2eid"
    _rewrite(path, name, lambda t: t[name].__setitem__((0, 0), 99))
    with pytest.raises(C.CheckpointError, match=r"layers\.0\.ffn\.gate\.tid2eid.*\[0, 8\)"):
        C.Checkpoint(path).block(0)


def test_unexpected_tensors_and_formats(tiny, tmp_path):
    path = _copy(tiny["fp8"][1], tmp_path / "c")
    name = "layers.3.attn.wq_a.weight"
    _rewrite(path, name, lambda t: t.__setitem__("layers.3.attn.wq_a.weight_scale_inv", torch.ones(1, 1)))
    idx = json.loads((path / C.reader.INDEX).read_text())
    idx["weight_map"]["layers.3.attn.wq_a.weight_scale_inv"] = _shard_of(path, name)
    (path / C.reader.INDEX).write_text(json.dumps(idx))
    with pytest.raises(C.CheckpointError, match=r"unexpected tensor layers\.3\.attn\.wq_a\.weight_scale_inv"):
        C.Checkpoint(path).block(3)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [64, 64]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(C.CheckpointError, match="128x128"):
        C.Checkpoint(path).block(2)
    cfg["quantization_config"] = {"quant_method": "awq"}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(C.CheckpointError, match="config.json.*awq"):
        C.Checkpoint(path)


def test_nvfp4_global_scales_must_pair(tiny, tmp_path):
    path = _copy(tiny["nvfp4"][1], tmp_path / "c")
    name = "layers.4.ffn.experts.2.w3.weight_scale_2"
    _rewrite(path, name, lambda t: t.__setitem__(name, t[name] * 2))
    with pytest.raises(C.CheckpointError,
                       match=r"experts\.2\.w1\.weight_scale_2.*experts\.2\.w3\.weight_scale_2.*differ"):
        C.Checkpoint(path).block(4)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(C.CheckpointError, match="not a directory"):
        C.Checkpoint(tmp_path / "nothing")
    with pytest.raises(C.CheckpointError, match="no config.json"):
        C.Checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(json.loads(
        (FIXTURES / "deepseek_v4_flash_config.json").read_text())))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0")
    with pytest.raises(C.CheckpointError, match="safetensors checkpoints only"):
        C.Checkpoint(tmp_path)


def test_writer_refuses_formats_the_release_does_not_have(tmp_path):
    m = C.tiny_release_model("fp8")
    m.quantize_projections("bf16")                  # MXFP4 experts with bf16 projections
    with pytest.raises(C.CheckpointError, match="released layouts"):
        C.write_checkpoint(m, tmp_path / "x")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", C.FORMATS)
def test_loads_and_decodes_on_the_gpu(tiny, fmt):
    """The tiny checkpoint straight onto the GPU, decoded by the kernels ("auto": the FP8
    linear, MMA attention, Triton indexer and MoE) against the CPU torch references."""
    src, path = tiny[fmt]
    m = C.Checkpoint(path).model(device="cuda", dtype=torch.float32)
    assert all(t.is_cuda for t in m.state_dict().values())
    toks = torch.randint(0, 256, (2, 21))
    with torch.no_grad():
        ref = _decode(src, toks, TORCH, [16, 1, 4])
        got = _decode(m, toks, {}, [16, 1, 4])
    assert (got.cpu() - ref).abs().max().item() < KERNEL_TOL
    draft = C.load_draft(path, device="cuda", dtype=torch.float32)
    assert draft.plan.backend.name != "torch"
