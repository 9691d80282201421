"""Architecture description shared by the megatron-core builder, the HF mappings and the engines.

`ModelArch` is the single source of truth for shapes. It converts to and from the Hugging Face
config of each supported family (`FAMILIES`): Qwen3 and Qwen3-MoE, Llama 3, Qwen2 / Qwen2.5,
Mixtral and DeepSeek-V3. All are pre-norm RMSNorm decoders with SwiGLU MLPs and RoPE; they differ
in the switches a `Family` records (QK-norm, qkv bias, MoE, multi-latent attention, the router's
score function) and in their HF names (mappings/). Features megatron-core cannot express for a
family are refused in `from_hf_config` with the reason, never silently dropped.
"""
from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, field, fields


@dataclass(frozen=True)
class Family:
    """What one HF model family fixes, beyond the shapes.

    hf_architecture: the `architectures` entry of its config.json (the HF model class).
    moe: every (or every sparse-step) layer has a routed-expert MLP.
    qk_norm: RMSNorm on each query and key head before RoPE (Qwen3).
    qkv_bias: biases on the q, k and v projections only (Qwen2 / Qwen2.5).
    head_dim_is_derived: head_dim must be hidden_size / num_attention_heads: the family's configs
        have no head_dim key and vLLM's model class derives it (a decoupled one serves garbage).
    mla: multi-latent attention (DeepSeek-V2/V3): low-rank q and kv projections, a RoPE part of
        qk_rope_head_dim shared by all heads; megatron-core's MLASelfAttention.
    router: "softmax" (top-k of softmax scores) | "sigmoid" (top-k of sigmoid scores plus a
        per-expert score-correction bias, renormalised and scaled: DeepSeek-V3).
    """

    hf_architecture: str
    moe: bool = False
    qk_norm: bool = False
    qkv_bias: bool = False
    head_dim_is_derived: bool = False
    mla: bool = False
    router: str = "softmax"


FAMILIES: dict[str, Family] = {
    "qwen3": Family("Qwen3ForCausalLM", qk_norm=True),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", moe=True, qk_norm=True),
    "llama": Family("LlamaForCausalLM"),
    "qwen2": Family("Qwen2ForCausalLM", qkv_bias=True, head_dim_is_derived=True),
    "mixtral": Family("MixtralForCausalLM", moe=True),
    "deepseek_v3": Family("DeepseekV3ForCausalLM", moe=True, mla=True, router="sigmoid"),
}
ARCHS = tuple(FAMILIES)

# Families users ask for that megatron-core's GPTModel specs cannot build as HF computes them, and why.
UNSUPPORTED = {
    "deepseek_v2": "its group-limited routing ranks groups by their best expert, megatron-core's by the "
                   "sum of their top experts; DeepSeek-V3 (model_type deepseek_v3) is supported",
}

# megatron-core's RotaryEmbedding applies Llama 3.x frequency scaling with only the factor
# configurable; the other three constants are fixed in its `_apply_scaling`.
LLAMA3_ROPE_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class ModelArch:
    """Decoder-only transformer shape (RMSNorm, SwiGLU, RoPE, GQA; per-family switches in FAMILIES).

    arch: a key of FAMILIES ("qwen3", "qwen3_moe", "llama", "qwen2", "mixtral", "deepseek_v3").
    vocab_size: V; must be divisible by TP (vocab-parallel embedding and output layer).
    hidden_size: H.  num_layers: L.  num_attention_heads / num_kv_heads: GQA heads.
    head_dim: per-head size (Qwen3 decouples it from H / heads).
    ffn_hidden_size: dense SwiGLU intermediate size (also used by dense layers of a MoE model;
        Mixtral has none, so there it is set to moe_ffn_hidden_size).
    rope_llama3_factor: Llama 3.x RoPE frequency scaling with this factor (0: none).
    num_experts, moe_ffn_hidden_size, moe_topk: MoE layers (MoE families).
    norm_topk_prob: renormalise the top-k softmax probabilities to sum to 1 (Qwen3-MoE default;
        Mixtral always).
    mlp_only_layers: layer indices that stay dense in a MoE model (HF `mlp_only_layers`).
    decoder_sparse_step: HF Qwen-MoE: layer i is MoE when (i + 1) % step == 0.
    moe_shared_expert_ffn_hidden_size: 0 = no shared expert (Qwen3-MoE and Mixtral have none).
    tie_word_embeddings: output layer shares the embedding weight.
    Multi-latent attention (family.mla), per head h of n:
        q_h = W_uq RMSNorm(W_dq x)                                           [qk_nope + qk_rope]
        [c_kv, k_rope] = W_dkv x;  [k_nope_h, v_h] = W_ukv RMSNorm(c_kv)          c_kv: [kv_lora_rank]
        k_h = [k_nope_h, RoPE(k_rope)] (one RoPE key shared by all heads), softmax scale
        1 / sqrt(qk_nope + qk_rope), v_h: [v_head_dim].
    Sigmoid router (family.router == "sigmoid"), expert bias b (a buffer, not trained by RL):
        s = sigmoid(W_r x); top-k of s + b (within the moe_group_topk best of moe_num_groups
        groups, a group scored by the sum of its top two); weights = s_topk / sum(s_topk) *
        moe_routed_scaling_factor.
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
    rope_llama3_factor: float = 0.0
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = False
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_topk: int = 2
    norm_topk_prob: bool = True
    mlp_only_layers: tuple[int, ...] = field(default_factory=tuple)
    decoder_sparse_step: int = 1
    moe_shared_expert_ffn_hidden_size: int = 0
    moe_routed_scaling_factor: float = 1.0
    moe_num_groups: int = 1
    moe_group_topk: int = 1
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self):
        self._check_types()
        if self.arch not in FAMILIES:
            why = f" ({UNSUPPORTED[self.arch]})" if self.arch in UNSUPPORTED else ""
            raise ValueError(f"model.arch={self.arch!r} is not supported{why}; choose one of {ARCHS}")
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(f"model.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"model.num_kv_heads ({self.num_kv_heads})")
        if self.family.head_dim_is_derived and self.head_dim * self.num_attention_heads != self.hidden_size:
            raise ValueError(f"model.arch={self.arch} derives head_dim from hidden_size / num_attention_heads "
                             f"({self.hidden_size} / {self.num_attention_heads}); model.head_dim={self.head_dim} "
                             "differs: change hidden_size, num_attention_heads or head_dim to agree")
        if self.rope_llama3_factor and self.arch != "llama":
            raise ValueError(f"model.rope_llama3_factor is Llama 3 RoPE scaling; model.arch={self.arch} has none")
        if self.is_moe:
            if self.num_experts < 1 or self.moe_ffn_hidden_size < 1:
                raise ValueError(f"model.arch={self.arch} needs model.num_experts >= 1 and "
                                 "model.moe_ffn_hidden_size >= 1")
            if not 1 <= self.moe_topk <= self.num_experts:
                raise ValueError(f"model.moe_topk={self.moe_topk} must be in [1, num_experts={self.num_experts}]")
        if self.arch == "mixtral" and (self.mlp_only_layers or self.decoder_sparse_step != 1
                                       or self.moe_shared_expert_ffn_hidden_size or not self.norm_topk_prob):
            raise ValueError("model.arch=mixtral has a renormalised top-k MoE MLP in every layer and no shared "
                             "expert: leave mlp_only_layers, decoder_sparse_step, "
                             "moe_shared_expert_ffn_hidden_size and norm_topk_prob at their defaults")
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        self._check_mla()
        self._check_router()
        if self.arch == "mixtral":  # no dense MLP: HF's intermediate_size is the experts' size
            object.__setattr__(self, "ffn_hidden_size", self.moe_ffn_hidden_size)

    def _check_types(self) -> None:
        """Every field holds its type in its range, whatever built the arch (a config.json, a
        checkpoint's record, overrides): sizes are integers >= 1 (>= 0 where the default 0 means
        none), floats finite and > 0 (>= 0 where 0 means off). A string, a list or a negative
        count failed later as a TypeError, a ZeroDivisionError or a math domain error."""
        for spec in fields(self):
            value, kind, where = getattr(self, spec.name), str(spec.type), f"model.{spec.name}"
            default = spec.default if spec.default is not MISSING else None
            if kind == "str":
                ok = isinstance(value, str)
            elif kind == "bool":
                ok = isinstance(value, bool)
            elif kind == "int":
                ok = _is_int(value) and value >= (1 if default else 0)
            elif kind == "float":
                ok = (_is_number(value) and math.isfinite(value) and value >= 0
                      and (value > 0 or not default))
            else:  # layer indices
                ok = isinstance(value, (list, tuple)) and all(_is_int(i) and i >= 0 for i in value)
            if not ok:
                need = {"str": "a name", "bool": "true or false",
                        "int": f"an integer >= {1 if default else 0}",
                        "float": f"a finite number {'> 0' if default else '>= 0'}"}.get(kind, "a list of layer indices")
                raise ValueError(f"{where}={value!r}: must be {need}")

    def _check_mla(self) -> None:
        mla = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        if not self.family.mla:
            if any(getattr(self, k) for k in ("q_lora_rank", *mla)):
                raise ValueError(f"model.arch={self.arch} has no multi-latent attention: leave q_lora_rank, "
                                 f"{', '.join(mla)} at 0")
            return
        if any(getattr(self, k) < 1 for k in mla):
            raise ValueError(f"model.arch={self.arch} (multi-latent attention) needs model.{', '.join(mla)} >= 1")
        if self.q_lora_rank < 1:
            # megatron-core 0.19 builds a direct query projection (HF q_lora_rank null) as a fused
            # norm + linear whenever the kv latent is normalised: a norm HF's model does not have
            raise ValueError(f"model.q_lora_rank={self.q_lora_rank}: multi-latent attention needs a query latent "
                             "(q_lora_rank >= 1); megatron-core's MLA adds a norm to a direct query projection "
                             "that the Hugging Face model does not have")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"model.qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates pairs)")
        # HF's convention for MLA configs: head_dim is the RoPE part, every head is its own kv head
        object.__setattr__(self, "head_dim", self.qk_rope_head_dim)
        object.__setattr__(self, "num_kv_heads", self.num_attention_heads)

    def _check_router(self) -> None:
        if self.family.router != "sigmoid":
            if (self.moe_routed_scaling_factor, self.moe_num_groups, self.moe_group_topk) != (1.0, 1, 1):
                raise ValueError(f"model.arch={self.arch}: moe_routed_scaling_factor, moe_num_groups and "
                                 "moe_group_topk belong to the sigmoid router (deepseek_v3); leave them at 1")
            return
        groups, picked = self.moe_num_groups, self.moe_group_topk
        if groups < 1 or self.num_experts % groups or not 1 <= picked <= groups:
            raise ValueError(f"model.moe_num_groups={groups} must divide num_experts={self.num_experts} and "
                             f"model.moe_group_topk={picked} must be in [1, moe_num_groups]")
        # HF scores a group by its top two experts, megatron-core by its top moe_topk // moe_group_topk
        if groups > 1 and self.moe_topk // picked != 2:
            raise ValueError(f"model.moe_topk // model.moe_group_topk = {self.moe_topk} // {picked} must be 2 with "
                             "group-limited routing (HF scores a group by its two best experts; megatron-core "
                             "by its moe_topk // moe_group_topk best)")
        if not self.norm_topk_prob and self.moe_topk > 1:
            raise ValueError("model.norm_topk_prob=false: megatron-core's sigmoid router always renormalises "
                             "the top-k scores; set it true")
        dense = tuple(range(len(self.mlp_only_layers)))
        if self.mlp_only_layers != dense or self.decoder_sparse_step != 1:
            raise ValueError(f"model.arch={self.arch}: the dense layers are the first k (HF first_k_dense_replace): "
                             f"set mlp_only_layers to {list(dense)} and decoder_sparse_step to 1")
        shared = self.moe_shared_expert_ffn_hidden_size
        if shared < 1 or shared % self.moe_ffn_hidden_size:
            raise ValueError(f"model.moe_shared_expert_ffn_hidden_size={shared} must be a positive multiple of "
                             f"moe_ffn_hidden_size={self.moe_ffn_hidden_size} (HF n_shared_experts >= 1)")

    @property
    def family(self) -> Family:
        return FAMILIES[self.arch]

    @property
    def is_moe(self) -> bool:
        return self.family.moe

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer `layer` (0-based) has a MoE MLP (HF Qwen-MoE rule)."""
        return (self.is_moe and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    def num_parameters(self, active: bool = False) -> int:
        """Parameters of the model (RMSNorm weights, QK-norms and qkv biases where the family has them).

        active: count only the moe_topk routed experts of each MoE layer (the parameters one
        token passes through), as MoE model names such as "30B-A3B" do.
        """
        h = self.hidden_size
        attention = self._mla_parameters() if self.family.mla else self._gqa_parameters()
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

    def _gqa_parameters(self) -> int:
        h, d = self.hidden_size, self.head_dim
        qkv_rows = d * (self.num_attention_heads + 2 * self.num_kv_heads)
        return (h * qkv_rows + self.num_attention_heads * d * h  # q, k, v and output projection
                + (2 * d if self.family.qk_norm else 0) + (qkv_rows if self.family.qkv_bias else 0))

    def _mla_parameters(self) -> int:
        h, n, r = self.hidden_size, self.num_attention_heads, self.q_lora_rank
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        q = h * r + r + r * n * qk  # down, norm, up
        kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank \
            + self.kv_lora_rank * n * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + n * self.v_head_dim * h

    def to_dict(self) -> dict:
        out = asdict(self)
        out["mlp_only_layers"] = list(self.mlp_only_layers)
        return out

    # ---- Hugging Face configs ---------------------------------------------------------------
    def to_hf_config(self, **extra):
        """The matching `transformers` config object of this family."""
        import transformers

        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_llama3_factor:
            rope = {"rope_type": "llama3", "rope_theta": self.rope_theta, "factor": self.rope_llama3_factor,
                    **LLAMA3_ROPE_FIXED}
        common = dict(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                      num_hidden_layers=self.num_layers, num_attention_heads=self.num_attention_heads,
                      num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
                      intermediate_size=self.ffn_hidden_size, rms_norm_eps=self.rms_norm_eps,
                      rope_parameters=rope, max_position_embeddings=self.max_position_embeddings,
                      tie_word_embeddings=self.tie_word_embeddings, **extra)
        if self.arch == "qwen3":
            return transformers.Qwen3Config(attention_bias=False, **common)
        if self.arch == "llama":
            return transformers.LlamaConfig(attention_bias=False, mlp_bias=False, **common)
        if self.arch == "qwen2":
            return transformers.Qwen2Config(use_sliding_window=False, **common)
        if self.arch == "mixtral":
            common["intermediate_size"] = self.moe_ffn_hidden_size  # Mixtral's experts are its MLPs
            return transformers.MixtralConfig(num_local_experts=self.num_experts,
                                              num_experts_per_tok=self.moe_topk, router_jitter_noise=0.0,
                                              **common)
        if self.arch == "deepseek_v3":
            return self._deepseek_v3_config(common)
        if self.moe_shared_expert_ffn_hidden_size:
            raise ValueError("Hugging Face Qwen3-MoE has no shared expert; set "
                             "model.moe_shared_expert_ffn_hidden_size=0 to export")
        return transformers.Qwen3MoeConfig(
            attention_bias=False, num_experts=self.num_experts, moe_intermediate_size=self.moe_ffn_hidden_size,
            num_experts_per_tok=self.moe_topk, norm_topk_prob=self.norm_topk_prob,
            mlp_only_layers=list(self.mlp_only_layers), decoder_sparse_step=self.decoder_sparse_step, **common)

    def _deepseek_v3_config(self, common: dict):
        import transformers

        del common["head_dim"]  # DeepseekV3Config derives it (= qk_rope_head_dim)
        return transformers.DeepseekV3Config(
            attention_bias=False, rope_interleave=True, q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim,
            n_routed_experts=self.num_experts, moe_intermediate_size=self.moe_ffn_hidden_size,
            n_shared_experts=self.moe_shared_expert_ffn_hidden_size // self.moe_ffn_hidden_size,
            num_experts_per_tok=self.moe_topk, norm_topk_prob=self.norm_topk_prob,
            routed_scaling_factor=self.moe_routed_scaling_factor, n_group=self.moe_num_groups,
            topk_group=self.moe_group_topk, first_k_dense_replace=len(self.mlp_only_layers),
            # DeepSeek's own config.json keys for this router, which transformers keeps as extras
            # and vLLM's model class reads (without them it builds no score-correction bias)
            topk_method="noaux_tc", scoring_func="sigmoid", **common)

    @classmethod
    def from_hf_config(cls, cfg) -> ModelArch:
        """From a `transformers` config object or its dict (config.json).

        Raises ValueError naming the config.json key for anything the family's megatron-core
        model would not compute the same way (sliding windows, extra biases, other RoPE types).
        """
        d = cfg if isinstance(cfg, dict) else cfg.to_dict()
        model_type = d.get("model_type")
        if not isinstance(model_type, str) or model_type not in FAMILIES:
            why = f" ({UNSUPPORTED[model_type]})" if isinstance(model_type, str) and model_type in UNSUPPORTED else ""
            raise ValueError(f"config.json model_type={model_type!r} is not supported{why}; "
                             f"supported: {', '.join(ARCHS)}")
        heads, hidden = _hf_int(d, "num_attention_heads"), _hf_int(d, "hidden_size")
        layers = _hf_int(d, "num_hidden_layers")
        kw = {"arch": model_type, "vocab_size": _hf_int(d, "vocab_size"), "hidden_size": hidden,
              "num_layers": layers, "num_attention_heads": heads,
              "num_kv_heads": _hf_int(d, "num_key_value_heads", default=heads),
              "head_dim": _hf_int(d, "head_dim", default=None) or _derived_head_dim(hidden, heads),
              "ffn_hidden_size": _hf_int(d, "intermediate_size"),
              "rms_norm_eps": _hf_float(d, "rms_norm_eps", 1e-6),
              "max_position_embeddings": _hf_int(d, "max_position_embeddings", default=4096),
              "tie_word_embeddings": _hf_bool(d, "tie_word_embeddings", False),
              **_rope_fields(d, model_type)}
        for key in ("attention_bias", "mlp_bias", "use_sliding_window"):
            if d.get(key) and not (key == "attention_bias" and FAMILIES[model_type].qkv_bias):
                raise ValueError(f"config.json {key}=true is not supported for model_type={model_type} "
                                 "(megatron-core's model for it has no such path here)")
        if model_type == "qwen3_moe":
            experts = "num_experts" if d.get("num_experts") is not None else "num_local_experts"
            kw.update(num_experts=_hf_int(d, experts), moe_ffn_hidden_size=_hf_int(d, "moe_intermediate_size"),
                      moe_topk=_hf_int(d, "num_experts_per_tok"),
                      norm_topk_prob=_hf_bool(d, "norm_topk_prob", True),
                      mlp_only_layers=_hf_layers(d, "mlp_only_layers", layers),
                      decoder_sparse_step=_hf_int(d, "decoder_sparse_step", default=1))
        if model_type == "mixtral":
            if _hf_float(d, "router_jitter_noise", 0.0, lo_open=False):
                raise ValueError("config.json router_jitter_noise is a training-time router noise that "
                                 "megatron-core's router does not apply; set it to 0")
            kw.update(num_experts=_hf_int(d, "num_local_experts"), moe_ffn_hidden_size=kw["ffn_hidden_size"],
                      moe_topk=_hf_int(d, "num_experts_per_tok"))
        if model_type == "deepseek_v3":
            kw.update(_deepseek_v3_fields(d, layers))
        return cls(**kw)


def _deepseek_v3_fields(d: dict, layers: int) -> dict:
    """ModelArch fields of a DeepSeek-V3 config.json (MLA, sigmoid router, shared and dense MLPs).

    Its multi-token-prediction layers (num_nextn_predict_layers) are not part of the causal LM
    (transformers skips them too); their tensors stay unread in the checkpoint.
    """
    if not d.get("rope_interleave", True):
        raise ValueError("config.json rope_interleave=false is not supported: megatron-core's multi-latent "
                         "attention always rotates the de-interleaved halves of the RoPE dims (rope_interleave=true)")
    if d.get("scoring_func", "sigmoid") != "sigmoid" or d.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ValueError(f"config.json scoring_func={d.get('scoring_func')!r} / topk_method={d.get('topk_method')!r} "
                         "is not supported for deepseek_v3: its router is sigmoid with a score-correction bias "
                         "(scoring_func 'sigmoid', topk_method 'noaux_tc')")
    if _hf_float(d, "rms_norm_eps", 1e-6) != 1e-6:
        raise ValueError(f"config.json rms_norm_eps={d['rms_norm_eps']} is not supported for deepseek_v3: HF fixes "
                         "the q and kv latent norms' epsilon at 1e-6 while megatron-core uses rms_norm_eps for all")
    moe = _hf_int(d, "moe_intermediate_size")
    return dict(num_experts=_hf_int(d, "n_routed_experts"), moe_ffn_hidden_size=moe,
                moe_topk=_hf_int(d, "num_experts_per_tok"), norm_topk_prob=_hf_bool(d, "norm_topk_prob", True),
                mlp_only_layers=tuple(range(_hf_int(d, "first_k_dense_replace", lo=0, default=0, hi=layers))),
                moe_shared_expert_ffn_hidden_size=moe * _hf_int(d, "n_shared_experts", default=1),
                moe_routed_scaling_factor=_hf_float(d, "routed_scaling_factor", 1.0),
                moe_num_groups=_hf_int(d, "n_group", default=1), moe_group_topk=_hf_int(d, "topk_group", default=1),
                q_lora_rank=_hf_int(d, "q_lora_rank", lo=0, default=0), kv_lora_rank=_hf_int(d, "kv_lora_rank"),
                qk_nope_head_dim=_hf_int(d, "qk_nope_head_dim"), qk_rope_head_dim=_hf_int(d, "qk_rope_head_dim"),
                v_head_dim=_hf_int(d, "v_head_dim"))


_REQUIRED = object()


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _hf_int(d: dict, key: str, lo: int = 1, default=_REQUIRED, hi: int | None = None) -> int:
    """config.json's integer `key`, >= lo (and <= hi); null or absent means `default` where the
    key has one (HF's convention: num_key_value_heads null = num_attention_heads)."""
    value = d.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ValueError(f"config.json {key} is {'null' if key in d else 'missing'}; the model needs it")
        return default
    if not _is_int(value) or value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" + (f" and <= {hi}" if hi is not None else "")
        raise ValueError(f"config.json {key}={value!r}: must be an integer {bound}")
    return value


def _derived_head_dim(hidden: int, heads: int) -> int:
    if hidden < heads:
        raise ValueError(f"config.json head_dim is missing, and hidden_size={hidden} / num_attention_heads={heads} "
                         "leaves none to derive")
    return hidden // heads


def _hf_float(d: dict, key: str, default: float, lo_open: bool = True) -> float:
    """config.json's number `key`: finite and > 0 (>= 0 with lo_open=False); null or absent = default."""
    value = d.get(key)
    if value is None:
        return default
    if not _is_number(value) or not math.isfinite(value) or value < 0 or (lo_open and value == 0):
        raise ValueError(f"config.json {key}={value!r}: must be a finite number {'> 0' if lo_open else '>= 0'}")
    return float(value)


def _hf_bool(d: dict, key: str, default: bool) -> bool:
    value = d.get(key)
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    raise ValueError(f"config.json {key}={value!r}: must be true or false")


def _hf_layers(d: dict, key: str, layers: int) -> tuple[int, ...]:
    """config.json's list of layer indices `key`, each in [0, layers)."""
    value = d.get(key) or []
    if not isinstance(value, list) or not all(_is_int(i) and 0 <= i < layers for i in value):
        raise ValueError(f"config.json {key}={value!r}: must be a list of layer indices in [0, {layers})")
    return tuple(value)


def _rope_fields(d: dict, model_type: str) -> dict:
    """rope_theta and Llama 3 scaling from a config dict (transformers 4: rope_theta + rope_scaling;
    transformers 5: rope_parameters)."""
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not hasattr(params, "get"):
        raise ValueError(f"config.json rope_parameters / rope_scaling={params!r}: must be a mapping")
    theta = _hf_float(d, "rope_theta", 0.0) or _hf_float(params, "rope_theta", 10000.0)
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return {"rope_theta": theta}
    if kind != "llama3" or model_type != "llama":
        raise ValueError(f"config.json rope type {kind!r} is not supported for model_type={model_type} "
                         "(megatron-core's GPTModel applies plain RoPE or Llama 3 scaling)")
    for key, fixed in LLAMA3_ROPE_FIXED.items():
        if _hf_float(params, key, fixed) != fixed:
            raise ValueError(f"config.json rope {key}={params[key]} is not supported: megatron-core's "
                             f"Llama 3 RoPE scaling fixes it at {fixed} (only the factor is configurable)")
    if params.get("factor") is None:
        raise ValueError("config.json rope factor is missing; Llama 3 RoPE scaling needs it")
    return {"rope_theta": theta, "rope_llama3_factor": _hf_float(params, "factor", 0.0)}
