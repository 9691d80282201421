"""Architecture description shared by the megatron-core builder, the HF mappings and the engines.

`ModelArch` is the single source of truth for shapes. It converts to and from the Hugging Face
config of each supported architecture (`qwen3` dense, `qwen3_moe`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

ARCHS = ("qwen3", "qwen3_moe")


@dataclass(frozen=True)
class ModelArch:
    """Decoder-only transformer shape (Qwen3 family: RMSNorm, SwiGLU, RoPE, GQA, QK-norm).

    arch: "qwen3" (dense) or "qwen3_moe".
    vocab_size: V; must be divisible by TP (vocab-parallel embedding and output layer).
    hidden_size: H.  num_layers: L.  num_attention_heads / num_kv_heads: GQA heads.
    head_dim: per-head size (Qwen3 decouples it from H / heads).
    ffn_hidden_size: dense SwiGLU intermediate size (also used by dense layers of a MoE model).
    num_experts, moe_ffn_hidden_size, moe_topk: MoE layers (arch qwen3_moe).
    norm_topk_prob: renormalise the top-k softmax probabilities to sum to 1 (Qwen3-MoE default).
    mlp_only_layers: layer indices that stay dense in a MoE model (HF `mlp_only_layers`).
    decoder_sparse_step: HF Qwen-MoE: layer i is MoE when (i + 1) % step == 0.
    moe_shared_expert_ffn_hidden_size: 0 = no shared expert (Qwen3-MoE has none).
    tie_word_embeddings: output layer shares the embedding weight.
    """

    arch: str = "qwen3_moe"
    vocab_size: int = 64
    hidden_size: int = 64
    num_layers: int = 2
    num_attention_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    ffn_hidden_size: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = False
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_topk: int = 2
    norm_topk_prob: bool = True
    mlp_only_layers: tuple[int, ...] = field(default_factory=tuple)
    decoder_sparse_step: int = 1
    moe_shared_expert_ffn_hidden_size: int = 0

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ValueError(f"model.arch={self.arch!r} is not supported; choose one of {ARCHS}")
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(f"model.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"model.num_kv_heads ({self.num_kv_heads})")
        if self.is_moe:
            if self.num_experts < 1 or self.moe_ffn_hidden_size < 1:
                raise ValueError("model.arch=qwen3_moe needs model.num_experts >= 1 and model.moe_ffn_hidden_size >= 1")
            if not 1 <= self.moe_topk <= self.num_experts:
                raise ValueError(f"model.moe_topk={self.moe_topk} must be in [1, num_experts={self.num_experts}]")
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))

    @property
    def is_moe(self) -> bool:
        return self.arch == "qwen3_moe"

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer `layer` (0-based) has a MoE MLP (HF Qwen-MoE rule)."""
        return (self.is_moe and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    def num_parameters(self, active: bool = False) -> int:
        """Parameters of the model (no linear biases; QK-norm; RMSNorm weights included).

        active: count only the moe_topk routed experts of each MoE layer (the parameters one
        token passes through), as MoE model names such as "30B-A3B" do.
        """
        h, d = self.hidden_size, self.head_dim
        attention = (h * d * (self.num_attention_heads + 2 * self.num_kv_heads)  # q, k, v
                     + self.num_attention_heads * d * h  # output projection
                     + 2 * d)  # q/k norms
        total = self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h  # + final norm
        for layer in range(self.num_layers):
            total += attention + 2 * h  # + input and pre-MLP norms
            if self.is_moe_layer(layer):
                experts = self.moe_topk if active else self.num_experts
                total += self.num_experts * h + experts * 3 * h * self.moe_ffn_hidden_size  # router + SwiGLU
                total += 3 * h * self.moe_shared_expert_ffn_hidden_size
            else:
                total += 3 * h * self.ffn_hidden_size
        return total

    def to_dict(self) -> dict:
        out = asdict(self)
        out["mlp_only_layers"] = list(self.mlp_only_layers)
        return out

    # ---- Hugging Face configs ---------------------------------------------------------------
    def to_hf_config(self, **extra):
        """The matching `transformers` config (Qwen3Config / Qwen3MoeConfig)."""
        from transformers import Qwen3Config, Qwen3MoeConfig

        common = dict(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                      num_hidden_layers=self.num_layers, num_attention_heads=self.num_attention_heads,
                      num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
                      intermediate_size=self.ffn_hidden_size, rms_norm_eps=self.rms_norm_eps,
                      rope_theta=self.rope_theta, max_position_embeddings=self.max_position_embeddings,
                      tie_word_embeddings=self.tie_word_embeddings, attention_bias=False, **extra)
        if not self.is_moe:
            return Qwen3Config(**common)
        if self.moe_shared_expert_ffn_hidden_size:
            raise ValueError("Hugging Face Qwen3-MoE has no shared expert; set "
                             "model.moe_shared_expert_ffn_hidden_size=0 to export")
        return Qwen3MoeConfig(num_experts=self.num_experts, moe_intermediate_size=self.moe_ffn_hidden_size,
                              num_experts_per_tok=self.moe_topk, norm_topk_prob=self.norm_topk_prob,
                              mlp_only_layers=list(self.mlp_only_layers),
                              decoder_sparse_step=self.decoder_sparse_step, **common)

    @classmethod
    def from_hf_config(cls, cfg) -> ModelArch:
        """From a `transformers` config object or its dict (config.json)."""
        d = cfg if isinstance(cfg, dict) else cfg.to_dict()
        model_type = d.get("model_type")
        if model_type not in ("qwen3", "qwen3_moe"):
            raise ValueError(f"config.json model_type={model_type!r} is not supported; "
                             f"supported: qwen3, qwen3_moe")
        rope_theta = d.get("rope_theta")
        if rope_theta is None:  # transformers 5 keeps it under rope_parameters
            rope_theta = (d.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        heads = d["num_attention_heads"]
        kw = {"arch": model_type, "vocab_size": d["vocab_size"], "hidden_size": d["hidden_size"],
              "num_layers": d["num_hidden_layers"], "num_attention_heads": heads,
              "num_kv_heads": d.get("num_key_value_heads") or heads,
              "head_dim": d.get("head_dim") or d["hidden_size"] // heads,
              "ffn_hidden_size": d["intermediate_size"], "rms_norm_eps": d.get("rms_norm_eps", 1e-6),
              "rope_theta": float(rope_theta), "max_position_embeddings": d.get("max_position_embeddings", 4096),
              "tie_word_embeddings": bool(d.get("tie_word_embeddings", False))}
        if model_type == "qwen3_moe":
            kw.update(num_experts=d.get("num_experts") or d["num_local_experts"], moe_ffn_hidden_size=d["moe_intermediate_size"],
                      moe_topk=d["num_experts_per_tok"], norm_topk_prob=bool(d.get("norm_topk_prob", True)),
                      mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
                      decoder_sparse_step=d.get("decoder_sparse_step", 1))
        return cls(**kw)
