"""Named architectures: small ones for tests, the CPU demo and the parity tool, and the real Qwen3 shapes.

    preset_arch("qwen3_moe", "tiny")                       # small sizes take either arch
    preset_arch("qwen3", "qwen3-1.7b")                     # a real shape (random init)
    preset_arch("qwen3_moe", "qwen3-moe-30b-a3b", num_layers=4)   # cut down for one GPU

In a run config: `model.arch=qwen3 model.size=qwen3-1.7b`, and `model.overrides` (ModelArch fields)
to shrink it, e.g. `{num_layers: 4}`. A real preset fixes its arch: naming the other one is an error.

The real shapes are the public Hugging Face config.json values of the Qwen3 release (Qwen/Qwen3-*):
vocab 151936, head_dim 128, rope_theta 1e6, rms_norm_eps 1e-6, max_position_embeddings 40960, no
linear biases, QK-norm; the MoE models have 128 experts, top-8, norm_topk_prob, every layer sparse.
Their parameter counts (ModelArch.num_parameters) match the published sizes; see
tests/unit/model/test_presets.py.
"""
from __future__ import annotations

from megatron_rl.model.arch import ModelArch

_TINY = {"vocab_size": 64, "hidden_size": 64, "num_layers": 2, "num_attention_heads": 4, "num_kv_heads": 2,
         "head_dim": 16, "ffn_hidden_size": 128, "max_position_embeddings": 256}
_SMALL = {"vocab_size": 1024, "hidden_size": 128, "num_layers": 4, "num_attention_heads": 4, "num_kv_heads": 2,
          "head_dim": 32, "ffn_hidden_size": 256, "max_position_embeddings": 1024}
_MOE = {"num_experts": 4, "moe_ffn_hidden_size": 64, "moe_topk": 2}

# sizes that take either arch (qwen3_moe adds _MOE)
PRESETS: dict[str, dict] = {
    "tiny": _TINY,
    "small": _SMALL,
}

_QWEN3 = {"vocab_size": 151936, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
          "max_position_embeddings": 40960}
_QWEN3_MOE = {**_QWEN3, "arch": "qwen3_moe", "num_experts": 128, "moe_topk": 8, "norm_topk_prob": True,
              "decoder_sparse_step": 1}


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
}


def preset_names() -> list[str]:
    return sorted(PRESETS) + sorted(REAL_PRESETS)


def preset_arch(arch: str, size: str = "tiny", **overrides) -> ModelArch:
    """ModelArch for `arch` ("qwen3" | "qwen3_moe") at a named size, with field overrides.

    A real preset (REAL_PRESETS) has its own arch; `arch` must name the same one.
    """
    if size in REAL_PRESETS:
        fields = dict(REAL_PRESETS[size])
        if arch != fields["arch"]:
            raise ValueError(f"model.size={size} is a {fields['arch']} model, but model.arch={arch}; "
                             f"set model.arch={fields['arch']}")
    elif size in PRESETS:
        fields = dict(PRESETS[size], arch=arch)
        if arch == "qwen3_moe":
            fields.update(_MOE)
    else:
        raise KeyError(f"unknown model size {size!r}; available: {preset_names()}")
    fields.update(overrides)
    return ModelArch(**fields)
