"""dsv4lab.config: the published numbers, the mini config, Hugging Face config.json parsing
(the released DeepSeek-V4-Flash config.json and NVIDIA's ModelOpt NVFP4 one, as fixtures),
range checks, and the one reading of how weights are stored."""
import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from dsv4lab import config
from dsv4lab.config import (BF16, FP8_BLOCK, DenseFormat, DSV4Config, QuantConfigError, from_hf_config,
                            resolve_formats, validate)

FIXTURES = Path(__file__).resolve().parent / "fixtures"
# the released config.json, key for key (DeepSeek-V4-Flash: the public config's keys, as the
# DeepseekV4 loaders of transformers, vLLM and SGLang read them)
RELEASED = json.loads((FIXTURES / "deepseek_v4_flash_config.json").read_text())
# the same model re-quantised by NVIDIA ModelOpt: routed experts NVFP4, attention, router,
# shared experts and the MTP layer excluded
MODELOPT = json.loads((FIXTURES / "deepseek_v4_flash_nvfp4_config.json").read_text())


def test_flash_matches_the_published_facts():
    c = DSV4Config.flash()
    assert (c.hidden_size, c.num_layers, c.vocab_size) == (4096, 43, 129280)
    assert (c.num_heads, c.head_dim, c.rope_dim, c.nope_dim) == (64, 512, 64, 448)
    assert (c.q_lora_rank, c.o_groups, c.o_lora_rank, c.window_size) == (1024, 8, 1024, 128)
    assert list(c.compress_ratios[:43]) == [0, 0] + [4, 128] * 20 + [4]
    assert len(c.compress_ratios) == 44 and c.mtp_compress_ratio == c.compress_ratios[43]
    assert (c.index_n_heads, c.index_head_dim, c.index_topk) == (64, 128, 512)
    assert (c.n_routed_experts, c.n_experts_per_tok, c.n_shared_experts, c.moe_intermediate_size) == (256, 6, 1, 2048)
    assert c.routed_scaling_factor == 1.5 and c.score_func == "sqrtsoftplus"
    assert (c.n_hash_layers, c.swiglu_limit) == (3, 10.0)
    assert (c.hc_mult, c.hc_sinkhorn_iters, c.num_mtp_layers) == (4, 20, 1)
    assert c.max_position_embeddings == 1048576 and c.max_compressed_entries == 262144
    assert c.expert_format == "mxfp4" and c.dense_format == FP8_BLOCK
    assert c.formats("mtp").experts == "mxfp4" and c.formats("mtp").dense == FP8_BLOCK
    assert validate(c) is c


def test_mini_keeps_the_structure():
    m = validate(DSV4Config.mini())
    f = DSV4Config.flash()
    ratios = set(m.compress_ratios[:m.num_layers])
    assert {0, 4, 128} <= ratios
    assert m.n_hash_layers >= 1 and m.num_mtp_layers >= 1 and m.hc_mult == f.hc_mult
    assert m.head_dim - m.rope_dim == m.nope_dim > 0
    assert m.hidden_size < f.hidden_size and m.num_layers < f.num_layers
    assert m.expert_format == f.expert_format
    assert [fld.name for fld in dataclasses.fields(m)] == [fld.name for fld in dataclasses.fields(f)]


def test_layer_ratio_and_replace():
    c = DSV4Config.flash()
    assert c.layer_ratio(0) == 0 and c.layer_ratio(2) == 4 and c.layer_ratio(3) == 128
    d = c.replace(window_size=256)
    assert d.window_size == 256 and c.window_size == 128


def hf_dict(cfg: DSV4Config) -> dict:
    d = {hf: getattr(cfg, field) for hf, field in config._HF_KEYS.items()}
    d["compress_ratios"] = list(cfg.compress_ratios)
    d["expert_dtype"] = cfg.expert_format
    if cfg.dense_format.dtype == "fp8_e4m3":
        d["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": cfg.dense_format.scale_fmt,
                                    "weight_block_size": list(cfg.dense_format.block)}
    d["rms_norm_eps"] = cfg.rms_norm_eps
    d["hc_eps"] = cfg.hc_eps
    return d


@pytest.mark.parametrize("make", [DSV4Config.flash, DSV4Config.mini])
def test_from_hf_config_round_trip(make):
    cfg = make()
    back = from_hf_config(hf_dict(cfg))
    for f in dataclasses.fields(cfg):
        if f.name not in ("name", "extra"):
            assert getattr(back, f.name) == getattr(cfg, f.name), f.name


@pytest.mark.parametrize("key", sorted(config._HF_KEYS))
def test_missing_key_is_named(key):
    d = hf_dict(DSV4Config.flash())
    del d[key]
    with pytest.raises(ValueError, match=key):
        from_hf_config(d)


def test_window_size_alias():
    d = hf_dict(DSV4Config.flash())
    d["window_size"] = d.pop("sliding_window")
    assert from_hf_config(d).window_size == 128


@pytest.mark.parametrize("change, match", [
    ({"qk_nope_head_dim": 400}, "qk_nope_head_dim"),
    ({"compress_ratios": [0, 4]}, "compress_ratios"),
    ({"num_experts_per_tok": 300}, "num_experts_per_tok"),
    ({"num_hash_layers": 99}, "num_hash_layers"),
    ({"num_attention_heads": 60}, "o_groups"),
    ({"qk_rope_head_dim": 600}, "qk_rope_head_dim"),
    ({"scoring_func": "relu"}, "scoring_func"),
    ({"hidden_size": 4100}, "multiples of 32"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"quantization_config": {"quant_method": "int3"}}, "unknown quant_method 'int3'"),
    ({"expert_dtype": "int3"}, "unknown expert format 'int3'"),
    ({"compress_ratios": [0, 0] + [4, 128] * 20 + [8, 0]}, r"compress_ratios entries must be 0, 4 or 128, got \[8\]"),
    ({"compress_ratios": [0, 0] + [4, 128] * 20 + [-4, 0]}, "compress_ratios entries"),
    ({"compress_ratios": "0,4"}, "compress_ratios must be a list"),
    ({"hc_sinkhorn_iters": 0}, "hc_sinkhorn_iters must be a positive integer"),
    ({"hc_sinkhorn_iters": 2.5}, "hc_sinkhorn_iters"),
    ({"hc_mult": -1}, "hc_mult"),
    ({"index_topk": 0}, "index_topk"),
    ({"swiglu_limit": 0.0}, "swiglu_limit must be a positive finite number"),
    ({"swiglu_limit": float("inf")}, "swiglu_limit"),
    ({"routed_scaling_factor": -1.5}, "routed_scaling_factor"),
    ({"rms_norm_eps": 0.0}, r"rms_norm_eps must be in \(0, 1\)"),
    ({"rms_norm_eps": 2.0}, "rms_norm_eps"),
    ({"hc_eps": -1e-6}, "hc_eps"),
    ({"rope_theta": 0}, "rope_theta"),
    ({"num_nextn_predict_layers": -1}, r"num_nextn_predict_layers \(DSV4Config.num_mtp_layers\) must be"),
    ({"num_hidden_layers": True}, "num_hidden_layers"),
    ({"n_shared_experts": -1}, "n_shared_experts"),
    ({"num_key_value_heads": 8}, "num_key_value_heads must be 1"),
])
def test_contradictions_are_clear_errors(change, match):
    d = hf_dict(DSV4Config.flash())
    d.update(change)
    with pytest.raises(ValueError, match=match):
        from_hf_config(d)


def test_not_a_dict():
    with pytest.raises(ValueError, match="expects a dict"):
        from_hf_config(["hidden_size"])


@pytest.mark.parametrize("qc, fmt", [({"quant_method": "modelopt_fp4"}, "nvfp4"), ({"quant_method": "NVFP4"}, "nvfp4"),
                                     ({"quant_method": "mxfp4"}, "mxfp4"), ({"expert_dtype": "bf16"}, "bf16"),
                                     (None, "bf16")])
def test_expert_format_from_quantization_config(qc, fmt):
    d = hf_dict(DSV4Config.flash())
    del d["expert_dtype"]
    d["quantization_config"] = qc
    assert from_hf_config(d).expert_format == fmt


def test_the_released_config_json_reads_as_flash():
    cfg = DSV4Config.from_hf_config(RELEASED)
    assert cfg == from_hf_config(RELEASED)
    flash = DSV4Config.flash()
    for f in dataclasses.fields(flash):
        if f.name not in ("name", "extra"):
            assert getattr(cfg, f.name) == getattr(flash, f.name), f.name
    assert cfg.name == "deepseek_v4"
    main, mtp = cfg.formats("main"), cfg.formats("mtp")
    assert (main.experts, main.dense) == (mtp.experts, mtp.dense) == ("mxfp4", FP8_BLOCK)
    assert cfg.dense_format == DenseFormat("fp8_e4m3", (128, 128), "ue8m0")
    assert cfg.extra["rope_scaling"]["factor"] == 16 and cfg.extra["compress_rope_theta"] == 160000
    assert cfg.extra["quantization_config"]["quant_method"] == "fp8"


def test_the_modelopt_nvfp4_config_json():
    cfg = from_hf_config(MODELOPT)
    assert cfg.expert_format == "nvfp4" and cfg.dense_format == BF16
    mtp = cfg.formats("mtp")            # the MTP layer is excluded: it keeps the base's MXFP4
    assert mtp.experts == "mxfp4" and mtp.dense == BF16


@pytest.mark.parametrize("layer", ["main", "mtp"])
def test_resolve_formats_released(layer):
    f = resolve_formats(RELEASED, layer=layer)
    assert (f.layer, f.experts, f.dense) == (layer, "mxfp4", FP8_BLOCK)
    assert f.source == "checkpoint metadata (quant_method 'fp8', expert_dtype 'fp4')"
    # the quantization_config alone: experts follow the dense format (FP8), which the MoE refuses
    with pytest.raises(QuantConfigError, match=f"the {layer} layer's experts are FP8"):
        resolve_formats(RELEASED["quantization_config"], layer=layer)
    with pytest.raises(QuantConfigError, match="'fp8' but the flag says 'mxfp4'"):
        resolve_formats(RELEASED["quantization_config"], layer=layer, experts="mxfp4")


def test_resolve_formats_modelopt_and_its_hf_quant_config():
    assert resolve_formats(MODELOPT, layer="main").experts == "nvfp4"
    assert resolve_formats(MODELOPT, layer="mtp").experts == "mxfp4"
    # hf_quant_config.json's shape ({"producer", "quantization"}), MTP named as native "mtp.0"
    hf_quant = {"producer": {"name": "modelopt"}, "quantization": {
        "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["*self_attn*", "mtp.0*", "*.attn.*"]}}
    hf_quant["quantization"]["quant_method"] = "modelopt"
    assert resolve_formats(hf_quant).experts == "nvfp4"
    assert resolve_formats(hf_quant, layer="mtp").experts == "bf16"       # no expert_dtype: bf16
    # an MTP layer ModelOpt did not exclude is NVFP4 too
    both = dict(MODELOPT, quantization_config=dict(MODELOPT["quantization_config"], exclude_modules=[
        "model.layers.*.self_attn*"]))
    assert resolve_formats(both, layer="mtp").experts == "nvfp4"
    # ... and dense projections it quantised are refused, not misread
    with pytest.raises(QuantConfigError, match="dense projections to NVFP4"):
        resolve_formats(dict(MODELOPT, quantization_config={"quant_method": "modelopt", "quant_algo": "NVFP4",
                                                            "exclude_modules": ["lm_head"]}))
    # without an exclude list at all: the routed experts only
    assert resolve_formats({"quant_method": "modelopt", "quant_algo": "NVFP4"}).dense == BF16
    with pytest.raises(QuantConfigError, match="quant_algo 'FP8'"):
        resolve_formats({"quant_method": "modelopt", "quant_algo": "FP8"})
    with pytest.raises(QuantConfigError, match="group_size must be 16"):
        resolve_formats({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32,
                         "exclude_modules": ["*attn*"]})


def test_flags_and_conflicts():
    assert resolve_formats(None, experts="mxfp4").source == "flag"
    assert resolve_formats(None, experts="fp4", dense="fp8").dense == FP8_BLOCK
    assert resolve_formats(None).source.startswith("default")
    assert resolve_formats(RELEASED, experts="mxfp4", dense="fp8").source.endswith("(flag agrees)")
    with pytest.raises(QuantConfigError, match=r"expert format conflict on the mtp layer: .*'mxfp4'.*'nvfp4'"):
        resolve_formats(RELEASED, layer="mtp", experts="nvfp4")
    with pytest.raises(QuantConfigError, match=r"dense-weight format conflict.*fp8 e4m3.*'bf16'"):
        resolve_formats(RELEASED, dense="bf16")
    with pytest.raises(QuantConfigError, match="conflict"):
        from_hf_config(RELEASED, experts="nvfp4")
    with pytest.raises(QuantConfigError, match="unknown expert format 'int3'"):
        resolve_formats(None, experts="int3")
    with pytest.raises(QuantConfigError, match="unknown dense-weight format"):
        resolve_formats(None, dense="int8")
    with pytest.raises(QuantConfigError, match="contradicts itself"):
        resolve_formats({"quantization_config": {"quant_method": "mxfp4"}, "expert_dtype": "bf16"})
    with pytest.raises(QuantConfigError, match="no weight_block_size"):
        resolve_formats({"quant_method": "fp8", "expert_dtype": "fp4"})
    with pytest.raises(QuantConfigError, match="e4m3"):
        resolve_formats({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]})
    with pytest.raises(QuantConfigError, match="must be a dict"):
        resolve_formats(["fp8"])
    with pytest.raises(ValueError, match="layer must be"):
        resolve_formats(None, layer="draft")


def test_quant_config_error_is_a_value_error():
    assert issubclass(QuantConfigError, ValueError)
    from dsv4lab import backends
    assert backends.QuantConfigError is QuantConfigError


def test_a_config_survives_json():
    """What a checkpoint's metadata holds (dataclasses.asdict -> json) reads back equal."""
    for cfg in (DSV4Config.flash(), from_hf_config(MODELOPT), DSV4Config.mini()):
        d = json.loads(json.dumps(dataclasses.asdict(cfg)))
        assert DSV4Config(**d) == cfg


def test_dense_format_checks():
    with pytest.raises(ValueError, match="weight_block_size"):
        DenseFormat("fp8_e4m3", (128,), "ue8m0")
    with pytest.raises(ValueError, match="scale_fmt"):
        DenseFormat("fp8_e4m3", (128, 128), "e8m0x")
    with pytest.raises(ValueError, match="dtype"):
        DenseFormat("int8")
    assert FP8_BLOCK.describe() == "fp8 e4m3, 128x128 blocks, ue8m0 scales" and BF16.describe() == "bf16"


def test_unknown_keys_are_kept_in_extra():
    d = hf_dict(DSV4Config.flash())
    d["model_type"] = "deepseek_v4"
    d["some_future_key"] = 7
    c = from_hf_config(d)
    assert c.extra["some_future_key"] == 7 and c.name == "deepseek_v4"


@settings(max_examples=20, deadline=None)
@given(layers=st.integers(1, 12), mtp=st.integers(0, 2), data=st.data())
def test_compress_ratio_length_is_checked(layers, mtp, data):
    base = DSV4Config.mini()
    n = data.draw(st.integers(0, layers + 3))
    ratios = tuple(data.draw(st.sampled_from([0, 4, 128])) for _ in range(n))
    cfg = base.replace(num_layers=layers, num_mtp_layers=mtp, n_hash_layers=min(base.n_hash_layers, layers),
                       compress_ratios=ratios)
    if n in (layers, layers + mtp):
        assert validate(cfg) is cfg
    else:
        with pytest.raises(ValueError, match="compress_ratios"):
            validate(cfg)
