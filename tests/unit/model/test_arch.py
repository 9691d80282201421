import pytest

from megatron_rl.model.arch import ARCHS, FAMILIES, ModelArch
from megatron_rl.model.presets import preset_arch


def _variants(arch):
    yield preset_arch(arch)
    if arch == "qwen3_moe":
        yield preset_arch(arch, tie_word_embeddings=True, mlp_only_layers=(1,))
    elif arch == "llama":
        yield preset_arch(arch, rope_llama3_factor=8.0, max_position_embeddings=16384)
    elif arch == "deepseek_v3":
        yield preset_arch(arch, tie_word_embeddings=True, moe_num_groups=2, moe_group_topk=1,
                          num_layers=3, mlp_only_layers=(0, 1))
    elif not FAMILIES[arch].moe:
        yield preset_arch(arch, tie_word_embeddings=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_config_roundtrip(arch):
    for a in _variants(arch):
        cfg = a.to_hf_config()
        assert type(cfg).model_type == arch
        assert ModelArch.from_hf_config(cfg) == a
        assert ModelArch.from_hf_config(cfg.to_dict()) == a


def test_moe_layer_rule_follows_hf():
    a = preset_arch("qwen3_moe", num_layers=4, decoder_sparse_step=2, mlp_only_layers=(3,))
    assert [a.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    assert not preset_arch("qwen3").is_moe_layer(0)
    assert all(preset_arch("mixtral", num_layers=3).is_moe_layer(i) for i in range(3))


def test_mixtral_experts_are_its_mlp():
    a = preset_arch("mixtral", ffn_hidden_size=999, moe_ffn_hidden_size=48)
    assert a.ffn_hidden_size == 48  # HF's intermediate_size is the experts' width
    assert a.to_hf_config().intermediate_size == 48


@pytest.mark.parametrize("kw,msg", [
    ({"arch": "deepseek_v2"}, "group-limited routing"),
    ({"arch": "gemma"}, "not supported"),
    ({"arch": "qwen3", "kv_lora_rank": 8}, "no multi-latent attention"),
    ({"arch": "qwen3_moe", "num_experts": 4, "moe_ffn_hidden_size": 8, "moe_routed_scaling_factor": 2.0},
     "sigmoid router"),
    ({"num_attention_heads": 4, "num_kv_heads": 3}, "multiple"),
    ({"arch": "qwen3_moe", "num_experts": 0}, "num_experts"),
    ({"arch": "qwen3_moe", "num_experts": 4, "moe_ffn_hidden_size": 8, "moe_topk": 5}, "moe_topk"),
    ({"arch": "qwen3", "rope_llama3_factor": 8.0}, "Llama 3 RoPE scaling"),
    ({"arch": "qwen2", "hidden_size": 64, "head_dim": 32}, "derives head_dim"),
    ({"arch": "mixtral", "num_experts": 4, "moe_ffn_hidden_size": 8, "mlp_only_layers": (0,)}, "every layer"),
])
def test_validation_messages(kw, msg):
    with pytest.raises(ValueError, match=msg):
        ModelArch(**kw)


def _deepseek(**kw):
    return preset_arch("deepseek_v3", **kw)


@pytest.mark.parametrize("kw,msg", [
    ({"kv_lora_rank": 0}, "needs model.kv_lora_rank"),
    ({"q_lora_rank": 0}, "needs a query latent"),
    ({"qk_rope_head_dim": 7}, "must be even"),
    ({"moe_num_groups": 3}, "must divide num_experts"),
    ({"num_experts": 8, "moe_num_groups": 4, "moe_group_topk": 2, "moe_topk": 2}, "must be 2"),
    ({"norm_topk_prob": False}, "always renormalises"),
    ({"mlp_only_layers": (1,)}, "first k"),
    ({"moe_shared_expert_ffn_hidden_size": 0}, "positive multiple"),
])
def test_deepseek_v3_validation_names_the_field(kw, msg):
    with pytest.raises(ValueError, match=msg):
        _deepseek(**kw)


def test_deepseek_v3_head_fields_follow_hf():
    a = _deepseek(head_dim=99, num_kv_heads=1)
    assert (a.head_dim, a.num_kv_heads) == (a.qk_rope_head_dim, a.num_attention_heads)  # HF's MLA convention
    assert a.is_moe_layer(1) and not a.is_moe_layer(0)


def _hf(arch, **fields):
    d = preset_arch(arch).to_hf_config().to_dict()
    d.update(fields)
    return d


@pytest.mark.parametrize("d,msg", [
    ({"model_type": "deepseek_v2"}, "model_type='deepseek_v2' is not supported \\(its group-limited"),
    (_hf("deepseek_v3", rope_interleave=False), "rope_interleave=false"),
    (_hf("deepseek_v3", q_lora_rank=None), "needs a query latent"),
    (_hf("deepseek_v3", scoring_func="softmax"), "scoring_func='softmax'"),
    (_hf("deepseek_v3", rms_norm_eps=1e-5), "rms_norm_eps=1e-05"),
    (_hf("deepseek_v3", rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "'yarn'"),
    ({"model_type": "gemma2"}, "model_type='gemma2'"),
    (_hf("llama", attention_bias=True), "attention_bias=true"),
    (_hf("llama", mlp_bias=True), "mlp_bias=true"),
    (_hf("qwen2", use_sliding_window=True), "use_sliding_window=true"),
    (_hf("mixtral", router_jitter_noise=0.1), "router_jitter_noise"),
    (_hf("llama", rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "'yarn'"),
    (_hf("qwen2", rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 4.0}), "'llama3'"),
    (_hf("llama", rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0,
                                   "low_freq_factor": 2.0}), "low_freq_factor=2.0"),
])
def test_hf_config_refusals_name_the_key(d, msg):
    with pytest.raises(ValueError, match=msg):
        ModelArch.from_hf_config(d)


def test_transformers4_rope_keys_are_read():
    d = _hf("llama")
    del d["rope_parameters"]
    d.update(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    a = ModelArch.from_hf_config(d)
    assert (a.rope_theta, a.rope_llama3_factor) == (500000.0, 32.0)
    # qwen2 models ship attention_bias-free configs: the family's own qkv bias is not a refusal
    assert ModelArch.from_hf_config(_hf("qwen2", attention_bias=True)).arch == "qwen2"
