"""Build a megatron-core `GPTModel` (dense Qwen3 or Qwen3-MoE) from a `ModelArch`.

Local (pure megatron-core) layer spec on CPU; Transformer Engine spec when TE is importable
and CUDA is present. Parallel sizes come from the `ParallelGroups` built by
megatron_rl.parallel (megatron reads its own globals for the layer layout, set there).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_rl.model.arch import ModelArch
from megatron_rl.parallel import ParallelGroups

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def have_transformer_engine() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or a broken build without CUDA
        return False
    return torch.cuda.is_available()


@dataclass(frozen=True)
class BuildOptions:
    """How to instantiate the model (not what it is: that is ModelArch).

    dtype: parameter dtype, "fp32" | "bf16" | "fp16" (megatron's Float16Module wraps bf16/fp16
        for training; see trainer). fp32 is the CPU default.
    spec: "auto" (TE when available, else local) | "local" | "te".
    init_std: std of the normal init of random weights (HF checkpoints overwrite it).
    seed: RNG seed of random init (megatron tracker and torch).
    moe_aux_loss_coeff: load-balancing aux loss coefficient (0 disables it).
    moe_token_dispatcher: "alltoall" | "allgather".
    routing_replay: enable megatron-core's RouterReplay hooks in every MoE router.
    """

    dtype: str = "fp32"
    spec: str = "auto"
    init_std: float = 0.02
    seed: int = 1234
    moe_aux_loss_coeff: float = 0.0
    moe_token_dispatcher: str = "alltoall"
    routing_replay: bool = False

    def __post_init__(self):
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r}; choose one of {sorted(_DTYPES)}")
        if self.spec not in ("auto", "local", "te"):
            raise ValueError(f"spec={self.spec!r}; choose auto, local or te")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


def transformer_config(arch: ModelArch, groups: ParallelGroups, opts: BuildOptions, use_te: bool):
    """The megatron-core TransformerConfig for `arch` under `groups`' parallel sizes."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    par = groups.config
    cpu = not torch.cuda.is_available()
    moe = {}
    if arch.is_moe:
        moe = dict(
            num_moe_experts=arch.num_experts,
            moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
            moe_router_topk=arch.moe_topk,
            # top-k on logits then softmax over the k == renormalised top-k softmax (HF
            # norm_topk_prob=True); pre-softmax keeps the un-renormalised probabilities.
            moe_router_pre_softmax=not arch.norm_topk_prob,
            moe_router_score_function="softmax",
            moe_router_load_balancing_type="aux_loss" if opts.moe_aux_loss_coeff > 0 else "none",
            moe_aux_loss_coeff=opts.moe_aux_loss_coeff,
            moe_token_dispatcher_type=opts.moe_token_dispatcher,
            moe_grouped_gemm=False,
            moe_layer_freq=[1 if arch.is_moe_layer(i) else 0 for i in range(arch.num_layers)],
            moe_shared_expert_intermediate_size=arch.moe_shared_expert_ffn_hidden_size or None,
            moe_enable_routing_replay=opts.routing_replay,
            moe_router_fusion=False,
            moe_permute_fusion=False,
        )
    dtype = opts.torch_dtype
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        # Platform workaround #4: a linear bias breaks the MoE backward on CPU (in-place add on a
        # custom-Function view); Qwen3 has no linear biases anyway.
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=opts.init_std,
        use_cpu_initialization=cpu,
        bf16=opts.dtype == "bf16",
        fp16=opts.dtype == "fp16",
        params_dtype=dtype,
        pipeline_dtype=dtype if par.pp > 1 else None,
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        context_parallel_size=par.cp,
        expert_model_parallel_size=par.ep,
        expert_tensor_parallel_size=par.etp,
        sequence_parallel=par.tp > 1 and arch.is_moe,
        # fused kernels need CUDA/Apex/TE
        gradient_accumulation_fusion=False,
        bias_activation_fusion=not cpu and use_te,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        # Our losses arrive already divided by a global normaliser (tokens or sequences summed
        # over every DP/CP rank and micro-batch of the step). Per-token mode makes megatron's
        # DDP sum (not average) gradients over DP and its schedules not divide by the number of
        # micro-batches; the trainer calls finalize_model_grads itself with num_tokens=None.
        calculate_per_token_loss=True,
        **moe,
    )


def build_gpt_model(arch: ModelArch, groups: ParallelGroups, opts: BuildOptions = BuildOptions()):
    """A megatron-core GPTModel for this rank's pipeline stage (random init with `opts.seed`).

    Returns the bare GPTModel (no Float16Module/DDP wrapping: the trainer adds those).
    """
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    par = groups.config
    if arch.vocab_size % par.tp:
        raise ValueError(f"model.vocab_size={arch.vocab_size} must be divisible by "
                         f"tensor_model_parallel_size={par.tp} (pad the vocabulary)")
    if arch.is_moe and arch.num_experts % par.ep:
        raise ValueError(f"model.num_experts={arch.num_experts} must be divisible by "
                         f"expert_model_parallel_size={par.ep}")
    if arch.num_layers % par.pp:
        raise ValueError(f"model.num_layers={arch.num_layers} must be divisible by "
                         f"pipeline_model_parallel_size={par.pp}")
    te_ok = have_transformer_engine()
    if opts.spec == "te" and not te_ok:
        raise RuntimeError("spec='te' needs Transformer Engine and CUDA; this process has "
                           f"CUDA={torch.cuda.is_available()}. Use spec='local' or 'auto'.")
    use_te = opts.spec == "te" or (opts.spec == "auto" and te_ok)
    if par.cp > 1 and not use_te:
        raise RuntimeError(
            f"parallel.context_parallel_size={par.cp} (--context-parallel-size) needs Transformer Engine "
            "attention on CUDA (megatron-core: 'Context parallelism is only supported by "
            f"TEDotProductAttention'); this process has TE={te_ok}, CUDA={torch.cuda.is_available()}. "
            "CP is a GPU-only path: install the 'te' extra on a GPU machine, or use "
            "parallel.context_parallel_size=1 on CPU.")
    config = transformer_config(arch, groups, opts, use_te)
    torch.manual_seed(opts.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(opts.seed)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization="RMSNorm")
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=groups.is_first_stage,
        post_process=groups.is_last_stage,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(arch.rope_theta),
        pg_collection=groups.pgs,
    )


def causal_mask(seq_len: int, device=None) -> torch.Tensor:
    """[1, 1, S, S] boolean mask, True = masked (megatron's local attention convention)."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1).view(
        1, 1, seq_len, seq_len)
