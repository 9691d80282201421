"""Named small architectures for tests, the CPU demo and the parity tool."""
from __future__ import annotations

from megatron_rl.model.arch import ModelArch

_TINY = dict(vocab_size=64, hidden_size=64, num_layers=2, num_attention_heads=4, num_kv_heads=2, head_dim=16,
             ffn_hidden_size=128, max_position_embeddings=256)
_SMALL = dict(vocab_size=1024, hidden_size=128, num_layers=4, num_attention_heads=4, num_kv_heads=2, head_dim=32,
              ffn_hidden_size=256, max_position_embeddings=1024)
_MOE = dict(num_experts=4, moe_ffn_hidden_size=64, moe_topk=2)

PRESETS: dict[str, dict] = {
    "tiny": _TINY,
    "small": _SMALL,
}


def preset_arch(arch: str, size: str = "tiny", **overrides) -> ModelArch:
    """ModelArch for `arch` ("qwen3" | "qwen3_moe") at a named size, with field overrides."""
    if size not in PRESETS:
        raise KeyError(f"unknown model size {size!r}; available: {sorted(PRESETS)}")
    fields = dict(PRESETS[size], arch=arch)
    if arch == "qwen3_moe":
        fields.update(_MOE)
    fields.update(overrides)
    return ModelArch(**fields)
