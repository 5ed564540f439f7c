"""Config: both config.json dialects, presets, and errors that name the field."""

import json

import pytest

from dsv4.config import CSA, HCA, SLIDING, Config

# What DeepSeek's own releases ship: legacy keys, flat rope_scaling for the compress rope.
DEEPSEEK_STYLE = {
    "model_type": "deepseek_v4", "vocab_size": 1000, "hidden_size": 64, "moe_intermediate_size": 32,
    "num_hidden_layers": 5, "num_attention_heads": 4, "head_dim": 32, "q_lora_rank": 32, "qk_rope_head_dim": 8,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "o_groups": 2, "o_lora_rank": 16, "index_n_heads": 4,
    "index_head_dim": 16, "index_topk": 8, "sliding_window": 16, "compress_ratios": [0, 4, 128, 4, 128, 0],
    "num_hash_layers": 2, "rope_theta": 10000, "compress_rope_theta": 160000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
}  # fmt: skip


def test_deepseek_legacy_keys_are_folded_in():
    cfg = Config.from_hf(DEEPSEEK_STYLE)
    assert cfg.layer_types == (SLIDING, CSA, HCA, CSA, HCA)  # compress_ratios cut to num_hidden_layers
    assert cfg.mlp_layer_types == ("hash_moe", "hash_moe", "moe", "moe", "moe")
    assert cfg.qk_rope_head_dim == 8
    assert cfg.rope_main.rope_type == "default" and cfg.rope_main.rope_theta == 10000
    assert cfg.rope_compress.rope_type == "yarn" and cfg.rope_compress.factor == 16
    # The flat form gets attention_factor 1.0: the V4 reference does not scale cos/sin by YaRN's mscale.
    assert cfg.rope_compress.attention_factor == 1.0
    assert cfg.rope_compress.partial_rotary_factor == pytest.approx(8 / 32)
    assert cfg.compress_rate(CSA) == 4 and cfg.compress_rate(HCA) == 128 and cfg.compress_rate(SLIDING) == 0
    assert cfg.quantization_config == {"quant_method": "fp8", "weight_block_size": [128, 128]}


def test_transformers_dialect_round_trips(tmp_path):
    cfg = Config.preset("tiny")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg.to_hf()))
    assert Config.from_hf(tmp_path) == cfg
    assert Config.from_hf(path) == cfg
    assert hash(cfg) == hash(Config.from_hf(path))  # frozen and hashable: usable as a jit static argument


def test_nested_rope_wins_over_stale_top_level_keys():
    # transformers writes top-level partial_rotary_factor / qk_rope_head_dim that can disagree with the
    # nested per-type ones; its model reads the nested factor only.
    raw = {**Config.preset("tiny").to_hf(), "partial_rotary_factor": 0.125, "qk_rope_head_dim": 4}
    assert Config.from_hf(raw).qk_rope_head_dim == 8


def test_presets_have_real_shapes():
    flash = Config.preset("v4-flash")
    assert flash.layer_types.count(SLIDING) == 2 and flash.layer_types.count(CSA) == 21
    assert flash.layer_types.count(HCA) == 20
    shape = (flash.hidden_size, flash.num_attention_heads, flash.head_dim, flash.n_routed_experts)
    assert shape == (4096, 64, 512, 256)
    pro = Config.preset("v4-pro")
    assert (pro.hidden_size, pro.num_attention_heads, pro.o_groups) == (7168, 128, 16)
    with pytest.raises(ValueError, match="unknown preset 'v5'"):
        Config.preset("v5")


@pytest.mark.parametrize(
    "change, field",
    [
        ({"o_groups": 3}, "o_groups"),  # 4 heads do not split into 3 groups
        ({"hidden_size": 0}, "hidden_size"),
        ({"scoring_func": "relu"}, "scoring_func"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"layer_types": [SLIDING, "dense", HCA, CSA]}, "layer_types"),
        ({"mlp_layer_types": ["moe"]}, "mlp_layer_types"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"n_shared_experts": 2}, "n_shared_experts"),
        ({"compress_rates": {CSA: 4}}, "compress_rates"),
    ],
)
def test_bad_values_name_the_field(change, field):
    raw = {**Config.preset("tiny").to_hf(), **change}
    with pytest.raises(ValueError, match=field):
        Config.from_hf(raw)


def test_bad_files_and_unsupported_models(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        Config.from_hf(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        Config.from_hf(tmp_path)
    with pytest.raises(ValueError, match="DeepSeek-V4.1"):
        Config.from_hf({"model_type": "deepseek_v41", "text_config": {}})
    with pytest.raises(ValueError, match="kv_source_layer_ids"):
        Config.from_hf({**Config.preset("tiny").to_hf(), "kv_source_layer_ids": [0, 0, 1, 1]})
    with pytest.raises(ValueError, match="model_type='llama'"):
        Config.from_hf({"model_type": "llama"})
    with pytest.raises(ValueError, match="rope_type"):
        Config.from_hf({**Config.preset("tiny").to_hf(), "rope_parameters": {
            "main": {"rope_type": "dynamic", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
            "compress": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}}})
