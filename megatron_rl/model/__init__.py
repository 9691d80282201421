"""megatron-core GPT/MoE models from a ModelArch, and HF <-> mcore weight mappings."""
from megatron_rl.model.arch import ModelArch
from megatron_rl.model.builder import BuildOptions, build_gpt_model, causal_mask, unwrap_model

__all__ = ["BuildOptions", "ModelArch", "build_gpt_model", "causal_mask", "unwrap_model"]
