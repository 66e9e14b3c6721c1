import json

import pytest

from dblock.config import ConfigError, llada_config_from_dict, load_config
from dblock.decoding.params import DecodeConfig

# LLaDA2.0-mini config.json values (docs/models.md, third-party fixture copies)
MINI = {
    "model_type": "llada2_moe", "architectures": ["LLaDA2MoeModelLM"], "hidden_size": 2048, "num_hidden_layers": 20,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 5120,
    "moe_intermediate_size": 512, "num_experts": 256, "num_experts_per_tok": 8, "num_shared_experts": 1,
    "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "first_k_dense_replace": 1,
    "score_function": "sigmoid", "moe_router_enable_expert_bias": True, "norm_topk_prob": True,
    "use_qk_norm": True, "use_qkv_bias": False, "use_bias": False, "partial_rotary_factor": 0.5,
    "rope_theta": 600000, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "vocab_size": 157184,
    "pad_token_id": 156892, "tie_word_embeddings": False,
}
LLADA_MOE = {
    "model_type": "llada", "architectures": ["LLaDAMoEModelLM"], "hidden_size": 2048, "num_hidden_layers": 16,
    "num_attention_heads": 16, "num_key_value_heads": 16, "expert_intermediate_size": 1024, "num_experts": 64,
    "num_experts_per_tok": 8, "moe_layer_freq": 1, "dense_intermediate_size": 8192,
    "shared_expert_intermediate_size": None, "rope_theta": 50000, "max_position_embeddings": 8192,
    "qk_layernorm": True, "vocab_size": 157184, "partial_rotary_factor": 1.0,
}


def test_llada2_mini_fields():
    c = llada_config_from_dict(MINI)
    assert (c.family, c.head_dim, c.rotary_dim, c.num_key_value_heads) == ("llada2_moe", 128, 64, 4)
    assert (c.num_experts, c.num_experts_per_tok, c.n_group, c.topk_group) == (256, 8, 8, 4)
    assert c.moe_layers == list(range(1, 20)) and c.num_shared_experts == 1 and c.routed_scaling_factor == 2.5
    assert (c.mask_token_id, c.eos_token_id, c.pad_token_id, c.block_size) == (156895, 156892, 156892, 32)
    assert c.score_function == "sigmoid" and c.use_expert_bias and c.norm_topk_prob


@pytest.mark.parametrize("mt", ["llada", "lladamoe"])
def test_llada_moe_fields(mt):
    c = llada_config_from_dict({**LLADA_MOE, "model_type": mt})
    assert c.family == "llada_moe" and c.head_dim == 128 and c.moe_intermediate_size == 1024
    assert c.score_function == "softmax" and not c.norm_topk_prob and c.routed_scaling_factor == 1.0
    assert c.moe_layers == list(range(16)) and c.num_shared_experts == 0


@pytest.mark.parametrize("patch, needle", [
    ({"model_type": "gpt2"}, "model_type"),
    ({"score_function": "softmax"}, "score_function"),
    ({"use_qkv_bias": True}, "use_qkv_bias"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"num_key_value_heads": 5}, "num_key_value_heads"),
    ({"n_group": 7}, "n_group"),
    ({"topk_group": 9}, "topk_group"),
    ({"partial_rotary_factor": 0.3}, "partial_rotary_factor"),
    ({"num_experts_per_tok": 300}, "num_experts_per_tok"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"type": "yarn", "factor": 4}}, "rope_scaling"),
])
def test_unsupported_values_are_named(patch, needle):
    with pytest.raises(ConfigError, match=needle):
        llada_config_from_dict({**MINI, **patch})


def test_missing_key_and_token_ids():
    d = dict(MINI)
    del d["hidden_size"]
    with pytest.raises(ConfigError, match="hidden_size"):
        llada_config_from_dict(d)
    # a non-LLaDA vocabulary must say its MASK id
    with pytest.raises(ConfigError, match="mask_token_id"):
        llada_config_from_dict({**MINI, "vocab_size": 1000, "pad_token_id": 1, "eos_token_id": 2})
    c = llada_config_from_dict({**MINI, "vocab_size": 1000, "mask_token_id": 3, "eos_token_id": 2,
                                "pad_token_id": None})
    assert (c.mask_token_id, c.eos_token_id, c.pad_token_id) == (3, 2, 2)


def test_llada_moe_refuses_non_moe_layers():
    with pytest.raises(ConfigError, match="moe_layer_freq"):
        llada_config_from_dict({**LLADA_MOE, "moe_layer_freq": 2})


def test_load_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(MINI))
    assert load_config(str(tmp_path)).num_hidden_layers == 20


@pytest.mark.parametrize("kw", [dict(max_new_tokens=0), dict(rule="greedy"), dict(threshold=1.5),
                                dict(block_size=0), dict(temperature=(0.8,))])
def test_decode_config_validation(kw):
    with pytest.raises(ConfigError):
        DecodeConfig(**kw).validate()
