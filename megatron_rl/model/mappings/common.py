"""HF <-> mcore name mappings shared by the families (as data); each family file composes them.

HF names are the on-disk checkpoint names (per-expert tensors), which is what safetensors
files, vLLM and `transformers.from_pretrained` use. Qwen3, Llama 3, Qwen2 and their MoE
variants name attention, norms and dense MLPs alike; DeepSeek-V3 has its own attention (MLA).
"""
from megatron_rl.model.mappings.base import Kind, Param, Scope

L = "decoder.layers.{layer}."
H = "model.layers.{layer}."

GLOBAL = (
    Param("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), Kind.COLUMN, Scope.GLOBAL,
          stage="first"),
    Param("decoder.final_layernorm.weight", ("model.norm.weight",), Kind.REPLICATED, Scope.GLOBAL,
          stage="last"),
)
UNTIED_HEAD = (
    Param("output_layer.weight", ("lm_head.weight",), Kind.COLUMN, Scope.GLOBAL, stage="last"),
)
# With tied embeddings and PP > 1, megatron keeps a copy of the embedding on the last stage.
TIED_HEAD = (
    Param("output_layer.weight", ("model.embed_tokens.weight",), Kind.COLUMN, Scope.GLOBAL, stage="last",
          export=False),
)

ATTENTION = (
    Param(L + "input_layernorm.weight", (H + "input_layernorm.weight",), Kind.REPLICATED, Scope.LAYER,
          te_mcore=L + "self_attention.linear_qkv.layer_norm_weight"),
    Param(L + "self_attention.linear_qkv.weight",
          (H + "self_attn.q_proj.weight", H + "self_attn.k_proj.weight", H + "self_attn.v_proj.weight"),
          Kind.QKV, Scope.LAYER),
    Param(L + "self_attention.linear_proj.weight", (H + "self_attn.o_proj.weight",), Kind.ROW, Scope.LAYER),
)
QK_NORM = (  # Qwen3
    Param(L + "self_attention.q_layernorm.weight", (H + "self_attn.q_norm.weight",), Kind.REPLICATED,
          Scope.LAYER),
    Param(L + "self_attention.k_layernorm.weight", (H + "self_attn.k_norm.weight",), Kind.REPLICATED,
          Scope.LAYER),
)
QKV_BIAS = (  # Qwen2 / Qwen2.5: fused and sharded like the qkv weight rows
    Param(L + "self_attention.linear_qkv.bias",
          (H + "self_attn.q_proj.bias", H + "self_attn.k_proj.bias", H + "self_attn.v_proj.bias"),
          Kind.QKV, Scope.LAYER),
)

# Multi-latent attention (DeepSeek-V3). HF's row layouts are megatron-core's: q_b_proj rows are
# per head [qk_nope | qk_rope], kv_b_proj rows per head [qk_nope | v], so TP shards the up
# projections by rows (heads); the down projections (kv_a_proj_with_mqa rows [kv_lora_rank |
# qk_rope]) are duplicated on every TP rank under both specs (model/builder.py says why).
MLA = (
    Param(L + "input_layernorm.weight", (H + "input_layernorm.weight",), Kind.REPLICATED, Scope.LAYER),
    Param(L + "self_attention.linear_kv_down_proj.weight", (H + "self_attn.kv_a_proj_with_mqa.weight",),
          Kind.REPLICATED, Scope.LAYER),
    Param(L + "self_attention.kv_layernorm.weight", (H + "self_attn.kv_a_layernorm.weight",), Kind.REPLICATED,
          Scope.LAYER, te_mcore=L + "self_attention.linear_kv_up_proj.layer_norm_weight"),
    Param(L + "self_attention.linear_kv_up_proj.weight", (H + "self_attn.kv_b_proj.weight",), Kind.COLUMN,
          Scope.LAYER),
    Param(L + "self_attention.linear_proj.weight", (H + "self_attn.o_proj.weight",), Kind.ROW, Scope.LAYER),
    Param(L + "self_attention.linear_q_down_proj.weight", (H + "self_attn.q_a_proj.weight",), Kind.REPLICATED,
          Scope.LAYER),
    Param(L + "self_attention.q_layernorm.weight", (H + "self_attn.q_a_layernorm.weight",), Kind.REPLICATED,
          Scope.LAYER, te_mcore=L + "self_attention.linear_q_up_proj.layer_norm_weight"),
    Param(L + "self_attention.linear_q_up_proj.weight", (H + "self_attn.q_b_proj.weight",), Kind.COLUMN,
          Scope.LAYER),
)

DENSE_MLP = (
    Param(L + "pre_mlp_layernorm.weight", (H + "post_attention_layernorm.weight",), Kind.REPLICATED,
          Scope.DENSE, te_mcore=L + "mlp.linear_fc1.layer_norm_weight"),
    Param(L + "mlp.linear_fc1.weight", (H + "mlp.gate_proj.weight", H + "mlp.up_proj.weight"), Kind.GATED,
          Scope.DENSE),
    Param(L + "mlp.linear_fc2.weight", (H + "mlp.down_proj.weight",), Kind.ROW, Scope.DENSE),
)


# DeepSeek-V3's MoE extras: the sigmoid router's score-correction bias (a buffer) and the shared
# experts, a plain SwiGLU MLP (TP-sharded like a dense one) added to the routed output
ROUTER_BIAS = (
    Param(L + "mlp.router.expert_bias", (H + "mlp.gate.e_score_correction_bias",), Kind.REPLICATED, Scope.MOE,
          fp32=True),
)
SHARED_EXPERTS = (
    Param(L + "mlp.shared_experts.linear_fc1.weight",
          (H + "mlp.shared_experts.gate_proj.weight", H + "mlp.shared_experts.up_proj.weight"), Kind.GATED,
          Scope.MOE),
    Param(L + "mlp.shared_experts.linear_fc2.weight", (H + "mlp.shared_experts.down_proj.weight",), Kind.ROW,
          Scope.MOE),
)


def moe_mlp(router: str, gate: str, up: str, down: str) -> tuple[Param, ...]:
    """A routed-expert MLP whose HF router and per-expert tensors have these names
    ({layer}, {expert} templates)."""
    experts = L + "mlp.experts.local_experts.{expert}."
    grouped = L + "mlp.experts."  # TE spec with moe_grouped_gemm (TEGroupedMLP): weight{j} per local expert
    return (
        Param(L + "pre_mlp_layernorm.weight", (H + "post_attention_layernorm.weight",), Kind.REPLICATED,
              Scope.MOE),
        Param(L + "mlp.router.weight", (router,), Kind.REPLICATED, Scope.MOE),
        Param(experts + "linear_fc1.weight", (gate, up), Kind.GATED, Scope.EXPERT,
              te_mcore=grouped + "linear_fc1.weight{expert}"),
        Param(experts + "linear_fc2.weight", (down,), Kind.ROW, Scope.EXPERT,
              te_mcore=grouped + "linear_fc2.weight{expert}"),
    )
