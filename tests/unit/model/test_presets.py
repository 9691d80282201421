"""Real Qwen3 shapes: parameter counts match the published sizes; arch consistency; a shrunk one builds.

References: the Qwen3 model cards on Hugging Face (Qwen/Qwen3-*) state total parameters and, for
the dense models, non-embedding parameters; the MoE cards state total and activated parameters:
0.6B (0.44B non-embedding), 1.7B (1.4B), 4B (3.6B), 8B (8.2B; 6.95B), 14B (14.8B; 13.2B),
32B (32.8B; 31.2B), 30B-A3B (30.5B total, 3.3B activated), 235B-A22B (235B total, 22B activated).
"""
import pytest

from megatron_rl.model.arch import ModelArch
from megatron_rl.model.presets import REAL_PRESETS, preset_arch, preset_names

B = 1e9
# name: (total, non-embedding or None, activated or None), in parameters
PUBLISHED = {
    "qwen3-0.6b": (0.6 * B, 0.44 * B, None),
    "qwen3-1.7b": (1.7 * B, 1.4 * B, None),
    "qwen3-4b": (4.0 * B, 3.6 * B, None),
    "qwen3-8b": (8.2 * B, 6.95 * B, None),
    "qwen3-14b": (14.8 * B, 13.2 * B, None),
    "qwen3-32b": (32.8 * B, 31.2 * B, None),
    "qwen3-moe-30b-a3b": (30.5 * B, None, 3.3 * B),
    "qwen3-moe-235b-a22b": (235 * B, None, 22 * B),
    "llama-3.2-1b": (1.24 * B, None, None),
    "llama-3.1-8b": (8.03 * B, None, None),
    "qwen2.5-0.5b": (0.49 * B, 0.36 * B, None),
    "qwen2.5-7b": (7.61 * B, 6.53 * B, None),
    "mixtral-8x7b": (46.7 * B, None, 12.9 * B),
    "deepseek-v3": (671 * B, None, 37 * B),  # the model card: 671B total, 37B activated (without MTP)
}


def _arch(name: str, **kw) -> ModelArch:
    return preset_arch(REAL_PRESETS[name]["arch"], name, **kw)


def test_every_real_preset_has_a_reference():
    assert sorted(PUBLISHED) == sorted(REAL_PRESETS)
    assert set(REAL_PRESETS) <= set(preset_names())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_count_matches_published(name):
    arch = _arch(name)
    total, non_embedding, activated = PUBLISHED[name]
    # the model cards round to one or two significant digits ("0.6B" is 0.596B): 4% covers that
    assert arch.num_parameters() == pytest.approx(total, rel=0.04)
    if non_embedding is not None:
        embeddings = arch.vocab_size * arch.hidden_size * (1 if arch.tie_word_embeddings else 2)
        assert arch.num_parameters() - embeddings == pytest.approx(non_embedding, rel=0.04)
    if activated is not None:
        assert arch.num_parameters(active=True) == pytest.approx(activated, rel=0.04)


# exact counts: the bf16 checkpoints' safetensors index total_size / 2
EXACT = {"llama-3.2-1b": 1_235_814_400, "llama-3.1-8b": 8_030_261_248, "qwen2.5-0.5b": 494_032_768,
         "qwen2.5-7b": 7_615_616_512, "mixtral-8x7b": 46_702_792_704}


@pytest.mark.parametrize("name", sorted(EXACT))
def test_parameter_count_exact(name):
    assert _arch(name).num_parameters() == EXACT[name]


def test_shared_shape_facts():
    for name in REAL_PRESETS:
        if not name.startswith("qwen3"):
            continue
        a = _arch(name)
        assert (a.vocab_size, a.head_dim, a.rope_theta, a.rms_norm_eps) == (151936, 128, 1e6, 1e-6), name
        assert a.max_position_embeddings == 40960, name
        assert a.tie_word_embeddings == (name in ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b")), name
        if a.is_moe:
            assert (a.num_experts, a.moe_topk, a.norm_topk_prob) == (128, 8, True), name
            assert all(a.is_moe_layer(i) for i in range(a.num_layers)), name


@pytest.mark.parametrize("name", sorted(REAL_PRESETS))
def test_hf_config_roundtrip(name):
    a = _arch(name)
    assert ModelArch.from_hf_config(a.to_hf_config().to_dict()) == a


def test_arch_must_agree_with_the_preset():
    with pytest.raises(ValueError, match="model.size=qwen3-1.7b is a qwen3 model, but model.arch=qwen3_moe"):
        preset_arch("qwen3_moe", "qwen3-1.7b")
    with pytest.raises(ValueError, match="set model.arch=qwen3_moe"):
        preset_arch("qwen3", "qwen3-moe-30b-a3b")


def test_unknown_size_lists_the_presets():
    with pytest.raises(KeyError, match="qwen3-moe-30b-a3b"):
        preset_arch("qwen3", "qwen3-2b")


def test_overrides_shrink_a_real_preset():
    a = _arch("qwen3-moe-30b-a3b", num_layers=2)
    assert (a.num_layers, a.hidden_size, a.num_experts) == (2, 2048, 128)
    assert a.num_parameters() < 2 * B


def test_small_presets_unchanged():
    assert preset_arch("qwen3_moe") == ModelArch(arch="qwen3_moe", vocab_size=64, hidden_size=64, num_layers=2,
                                                 num_attention_heads=4, num_kv_heads=2, head_dim=16,
                                                 ffn_hidden_size=128, max_position_embeddings=256, num_experts=4,
                                                 moe_ffn_hidden_size=64, moe_topk=2)


