"""Named architectures: small ones for tests, the CPU demo and the parity tool, and the real Qwen3 shapes.

    preset_arch("qwen3_moe", "tiny")                       # small sizes take any arch (model/arch.py)
    preset_arch("qwen3", "qwen3-1.7b")                     # a real shape (random init)
    preset_arch("qwen3_moe", "qwen3-moe-30b-a3b", num_layers=4)   # cut down for one GPU

In a run config: `model.arch=qwen3 model.size=qwen3-1.7b`, and `model.overrides` (ModelArch fields)
to shrink it, e.g. `{num_layers: 4}`. A real preset fixes its arch: naming the other one is an error.

The real shapes are the public Hugging Face config.json values of each release (Llama 3.x, Qwen2.5,
Mixtral and DeepSeek-V3 beside Qwen3). For the Qwen3 release (Qwen/Qwen3-*):
vocab 151936, head_dim 128, rope_theta 1e6, rms_norm_eps 1e-6, max_position_embeddings 40960, no
linear biases, QK-norm; the MoE models have 128 experts, top-8, norm_topk_prob, every layer sparse.
Their parameter counts (ModelArch.num_parameters) match the published sizes; see
tests/unit/model/test_presets.py (and tests/distributed/test_preset_builds.py builds each).
"""
from __future__ import annotations

from megatron_rl.model.arch import FAMILIES, ModelArch

_TINY = {"vocab_size": 64, "hidden_size": 64, "num_layers": 2, "num_attention_heads": 4, "num_kv_heads": 2,
         "head_dim": 16, "ffn_hidden_size": 128, "max_position_embeddings": 256}
_SMALL = {"vocab_size": 1024, "hidden_size": 128, "num_layers": 4, "num_attention_heads": 4, "num_kv_heads": 2,
          "head_dim": 32, "ffn_hidden_size": 256, "max_position_embeddings": 1024}
_MOE = {"num_experts": 4, "moe_ffn_hidden_size": 64, "moe_topk": 2}
# DeepSeek-V3 at small sizes: MLA latents, a shared expert, the first layer dense, scaled weights
# (and one shared expert as wide as a routed one, see preset_arch)
_DEEPSEEK_V3 = {"q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                "v_head_dim": 16, "mlp_only_layers": (0,), "moe_routed_scaling_factor": 2.5}

# sizes that take any arch (a MoE family adds _MOE)
PRESETS: dict[str, dict] = {
    "tiny": _TINY,
    "small": _SMALL,
}

_QWEN3 = {"vocab_size": 151936, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
          "max_position_embeddings": 40960}
_QWEN3_MOE = {**_QWEN3, "arch": "qwen3_moe", "num_experts": 128, "moe_topk": 8, "norm_topk_prob": True,
              "decoder_sparse_step": 1}


_LLAMA3 = {"arch": "llama", "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500_000.0,
           "max_position_embeddings": 131072}
_QWEN25 = {"arch": "qwen2", "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "max_position_embeddings": 32768}


def _dense(hidden, layers, heads, kv_heads, ffn, tied):
    return dict(_QWEN3, arch="qwen3", hidden_size=hidden, num_layers=layers, num_attention_heads=heads,
                num_kv_heads=kv_heads, ffn_hidden_size=ffn, tie_word_embeddings=tied)


def _moe(hidden, layers, heads, kv_heads, ffn, moe_ffn):
    return dict(_QWEN3_MOE, hidden_size=hidden, num_layers=layers, num_attention_heads=heads,
                num_kv_heads=kv_heads, ffn_hidden_size=ffn, moe_ffn_hidden_size=moe_ffn, tie_word_embeddings=False)


# real shapes, each with its arch: name -> every ModelArch field that differs from the defaults
#                                      hidden layers heads kv  intermediate (moe_intermediate) tied
REAL_PRESETS: dict[str, dict] = {
    "qwen3-0.6b": _dense(1024, 28, 16, 8, 3072, tied=True),
    "qwen3-1.7b": _dense(2048, 28, 16, 8, 6144, tied=True),
    "qwen3-4b": _dense(2560, 36, 32, 8, 9728, tied=True),
    "qwen3-8b": _dense(4096, 36, 32, 8, 12288, tied=False),
    "qwen3-14b": _dense(5120, 40, 40, 8, 17408, tied=False),
    "qwen3-32b": _dense(5120, 64, 64, 8, 25600, tied=False),
    "qwen3-moe-30b-a3b": _moe(2048, 48, 32, 4, 6144, 768),
    "qwen3-moe-235b-a22b": _moe(4096, 94, 64, 4, 12288, 1536),
    # Llama 3.x (meta-llama/*): 128k vocabulary, Llama 3 RoPE scaling, no biases, no QK-norm
    "llama-3.2-1b": dict(_LLAMA3, hidden_size=2048, num_layers=16, num_attention_heads=32, num_kv_heads=8,
                         head_dim=64, ffn_hidden_size=8192, rope_llama3_factor=32.0, tie_word_embeddings=True),
    "llama-3.1-8b": dict(_LLAMA3, hidden_size=4096, num_layers=32, num_attention_heads=32, num_kv_heads=8,
                         head_dim=128, ffn_hidden_size=14336, rope_llama3_factor=8.0, tie_word_embeddings=False),
    # Qwen2.5 (Qwen/Qwen2.5-*): q/k/v biases, no QK-norm
    "qwen2.5-0.5b": dict(_QWEN25, vocab_size=151936, hidden_size=896, num_layers=24, num_attention_heads=14,
                         num_kv_heads=2, head_dim=64, ffn_hidden_size=4864, tie_word_embeddings=True),
    "qwen2.5-7b": dict(_QWEN25, vocab_size=152064, hidden_size=3584, num_layers=28, num_attention_heads=28,
                       num_kv_heads=4, head_dim=128, ffn_hidden_size=18944, tie_word_embeddings=False),
    # Mixtral (mistralai/Mixtral-8x7B-v0.1): 8 experts, top-2, every layer sparse
    "mixtral-8x7b": dict(arch="mixtral", vocab_size=32000, hidden_size=4096, num_layers=32, num_attention_heads=32,
                         num_kv_heads=8, head_dim=128, ffn_hidden_size=14336, moe_ffn_hidden_size=14336,
                         num_experts=8, moe_topk=2, rms_norm_eps=1e-5, rope_theta=1_000_000.0,
                         max_position_embeddings=32768, tie_word_embeddings=False),
    # DeepSeek-V3 (deepseek-ai/DeepSeek-V3, without its multi-token-prediction layer and with plain
    # RoPE in place of its YaRN scaling): MLA, 256 routed experts in 8 groups (top-4 groups, top-8
    # experts), one shared expert, the first 3 layers dense
    "deepseek-v3": dict(arch="deepseek_v3", vocab_size=129280, hidden_size=7168, num_layers=61,
                        num_attention_heads=128, ffn_hidden_size=18432, moe_ffn_hidden_size=2048,
                        num_experts=256, moe_topk=8, moe_num_groups=8, moe_group_topk=4,
                        moe_shared_expert_ffn_hidden_size=2048, moe_routed_scaling_factor=2.5,
                        mlp_only_layers=(0, 1, 2), q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                        qk_rope_head_dim=64, v_head_dim=128, rms_norm_eps=1e-6, rope_theta=10000.0,
                        max_position_embeddings=163840, tie_word_embeddings=False),
}


def preset_names() -> list[str]:
    return sorted(PRESETS) + sorted(REAL_PRESETS)


def preset_arch(arch: str, size: str = "tiny", **overrides) -> ModelArch:
    """ModelArch for `arch` (a key of model.arch.FAMILIES) at a named size, with field overrides.

    A real preset (REAL_PRESETS) has its own arch; `arch` must name the same one.
    """
    if size in REAL_PRESETS:
        fields = dict(REAL_PRESETS[size])
        if arch != fields["arch"]:
            raise ValueError(f"model.size={size} is a {fields['arch']} model, but model.arch={arch}; "
                             f"set model.arch={fields['arch']}")
    elif size in PRESETS:
        fields = dict(PRESETS[size], arch=arch)
        if arch in FAMILIES and FAMILIES[arch].moe:
            fields.update(_MOE)
        if arch == "deepseek_v3":
            fields.update(_DEEPSEEK_V3)
    else:
        raise KeyError(f"unknown model size {size!r}; available: {preset_names()}")
    fields.update(overrides)
    if size in PRESETS and arch == "deepseek_v3" and "moe_shared_expert_ffn_hidden_size" not in overrides:
        fields["moe_shared_expert_ffn_hidden_size"] = fields["moe_ffn_hidden_size"]  # one shared expert
    if fields.get("arch") in FAMILIES and FAMILIES[fields["arch"]].head_dim_is_derived and "head_dim" not in overrides:
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    return ModelArch(**fields)
