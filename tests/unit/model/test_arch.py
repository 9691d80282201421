import pytest

from megatron_rl.model.arch import ModelArch
from megatron_rl.model.presets import preset_arch


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("tied", [False, True])
def test_hf_config_roundtrip(arch, tied):
    a = preset_arch(arch, tie_word_embeddings=tied, mlp_only_layers=(1,) if arch == "qwen3_moe" else ())
    assert ModelArch.from_hf_config(a.to_hf_config()) == a
    assert ModelArch.from_hf_config(a.to_hf_config().to_dict()) == a


def test_moe_layer_rule_follows_hf():
    a = preset_arch("qwen3_moe", num_layers=4, decoder_sparse_step=2, mlp_only_layers=(3,))
    assert [a.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    assert not preset_arch("qwen3").is_moe_layer(0)


@pytest.mark.parametrize("kw,msg", [
    ({"arch": "llama"}, "not supported"),
    ({"num_attention_heads": 4, "num_kv_heads": 3}, "multiple"),
    ({"arch": "qwen3_moe", "num_experts": 0}, "num_experts"),
    ({"arch": "qwen3_moe", "num_experts": 4, "moe_ffn_hidden_size": 8, "moe_topk": 5}, "moe_topk"),
])
def test_validation_messages(kw, msg):
    with pytest.raises(ValueError, match=msg):
        ModelArch(**kw)


def test_unsupported_model_type_is_named():
    with pytest.raises(ValueError, match="model_type='llama'"):
        ModelArch.from_hf_config({"model_type": "llama"})
