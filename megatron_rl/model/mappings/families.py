"""Each family's mapping: which shared pieces (common.py) it has and its MoE tensor names."""
from megatron_rl.model.mappings.common import (
    ATTENTION,
    DENSE_MLP,
    GLOBAL,
    MLA,
    QK_NORM,
    QKV_BIAS,
    ROUTER_BIAS,
    SHARED_EXPERTS,
    H,
    moe_mlp,
)

_QWEN_EXPERT = H + "mlp.experts.{expert}."
_MIXTRAL_EXPERT = H + "block_sparse_moe.experts.{expert}."

QWEN3 = GLOBAL + ATTENTION + QK_NORM + DENSE_MLP
QWEN3_MOE = QWEN3 + moe_mlp(H + "mlp.gate.weight", _QWEN_EXPERT + "gate_proj.weight",
                            _QWEN_EXPERT + "up_proj.weight", _QWEN_EXPERT + "down_proj.weight")
LLAMA = GLOBAL + ATTENTION + DENSE_MLP
QWEN2 = GLOBAL + ATTENTION + QKV_BIAS + DENSE_MLP
# Mixtral: w1 = gate, w3 = up, w2 = down (HF MixtralBlockSparseTop2MLP: w2(silu(w1 x) * w3 x))
MIXTRAL = GLOBAL + ATTENTION + moe_mlp(H + "block_sparse_moe.gate.weight", _MIXTRAL_EXPERT + "w1.weight",
                                       _MIXTRAL_EXPERT + "w3.weight", _MIXTRAL_EXPERT + "w2.weight")

# DeepSeek-V3: MLA, first dense layers, then MoE layers whose routed experts are named as Qwen's
DEEPSEEK_V3 = (GLOBAL + MLA + DENSE_MLP + ROUTER_BIAS + SHARED_EXPERTS
               + moe_mlp(H + "mlp.gate.weight", _QWEN_EXPERT + "gate_proj.weight", _QWEN_EXPERT + "up_proj.weight",
                         _QWEN_EXPERT + "down_proj.weight"))

REGISTRY = {"qwen3": QWEN3, "qwen3_moe": QWEN3_MOE, "llama": LLAMA, "qwen2": QWEN2, "mixtral": MIXTRAL,
            "deepseek_v3": DEEPSEEK_V3}
