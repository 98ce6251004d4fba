"""dsv4lab.config: the published numbers, the mini config, Hugging Face config.json parsing."""
import dataclasses

import pytest
from hypothesis import given, settings, strategies as st

from dsv4lab import config
from dsv4lab.config import DSV4Config, from_hf_config, validate


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
    assert c.expert_format == "mxfp4"
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
    d["quantization_config"] = {"quant_method": cfg.expert_format}
    d["rms_norm_eps"] = cfg.rms_norm_eps
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
    ({"quantization_config": {"quant_method": "int3"}}, "unknown expert format"),
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
                                     ({"fmt": "mxfp4"}, "mxfp4"), ({"expert_dtype": "bf16"}, "bf16"), (None, "mxfp4")])
def test_expert_format_from_quantization_config(qc, fmt):
    d = hf_dict(DSV4Config.flash())
    d["quantization_config"] = qc
    assert from_hf_config(d).expert_format == fmt


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
