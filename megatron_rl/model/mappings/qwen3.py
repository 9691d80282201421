"""HF <-> mcore name mappings for Qwen3 (dense) and Qwen3-MoE, as data.

HF names are the on-disk checkpoint names (per-expert tensors), which is what safetensors
files, vLLM and `transformers.from_pretrained` use.
"""
from megatron_rl.model.mappings.base import Kind, Param, Scope

_L = "decoder.layers.{layer}."
_H = "model.layers.{layer}."

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
    Param(_L + "input_layernorm.weight", (_H + "input_layernorm.weight",), Kind.REPLICATED, Scope.LAYER,
          te_mcore=_L + "self_attention.linear_qkv.layer_norm_weight"),
    Param(_L + "self_attention.linear_qkv.weight",
          (_H + "self_attn.q_proj.weight", _H + "self_attn.k_proj.weight", _H + "self_attn.v_proj.weight"),
          Kind.QKV, Scope.LAYER),
    Param(_L + "self_attention.q_layernorm.weight", (_H + "self_attn.q_norm.weight",), Kind.REPLICATED,
          Scope.LAYER),
    Param(_L + "self_attention.k_layernorm.weight", (_H + "self_attn.k_norm.weight",), Kind.REPLICATED,
          Scope.LAYER),
    Param(_L + "self_attention.linear_proj.weight", (_H + "self_attn.o_proj.weight",), Kind.ROW, Scope.LAYER),
)

DENSE_MLP = (
    Param(_L + "pre_mlp_layernorm.weight", (_H + "post_attention_layernorm.weight",), Kind.REPLICATED,
          Scope.DENSE, te_mcore=_L + "mlp.linear_fc1.layer_norm_weight"),
    Param(_L + "mlp.linear_fc1.weight", (_H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"), Kind.GATED,
          Scope.DENSE),
    Param(_L + "mlp.linear_fc2.weight", (_H + "mlp.down_proj.weight",), Kind.ROW, Scope.DENSE),
)

_E = _L + "mlp.experts.local_experts.{expert}."
# TE spec with moe_grouped_gemm (TEGroupedMLP): one grouped linear per projection, weight{j} per local expert
_GE = _L + "mlp.experts."
_HE = _H + "mlp.experts.{expert}."
MOE_MLP = (
    Param(_L + "pre_mlp_layernorm.weight", (_H + "post_attention_layernorm.weight",), Kind.REPLICATED,
          Scope.MOE),
    Param(_L + "mlp.router.weight", (_H + "mlp.gate.weight",), Kind.REPLICATED, Scope.MOE),
    Param(_E + "linear_fc1.weight", (_HE + "gate_proj.weight", _HE + "up_proj.weight"), Kind.GATED,
          Scope.EXPERT, te_mcore=_GE + "linear_fc1.weight{expert}"),
    Param(_E + "linear_fc2.weight", (_HE + "down_proj.weight",), Kind.ROW, Scope.EXPERT,
          te_mcore=_GE + "linear_fc2.weight{expert}"),
)

QWEN3 = GLOBAL + ATTENTION + DENSE_MLP
QWEN3_MOE = GLOBAL + ATTENTION + DENSE_MLP + MOE_MLP
