"""Build a megatron-core `GPTModel` (any family of model/arch.py, dense or MoE) from a `ModelArch`.

Transformer Engine's layer spec when TE is usable (importable, and CUDA), else megatron-core's
local spec. Where the model lives and which fused kernels it uses follow from this process's
capabilities (`build_plan`, a pure function). Parallel sizes come from the `ParallelGroups`
built by megatron_rl.parallel (megatron reads its own globals for the layer layout, set there).
"""
from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from megatron_rl.model.arch import ModelArch
from megatron_rl.parallel import ParallelGroups
from megatron_rl.platform.capabilities import Capabilities, capabilities
from megatron_rl.platform.mcore_api import grad_accum_fusion_available

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Activation recompute (BuildOptions.recompute, model.recompute) -> megatron-core TransformerConfig
# fields (the same in megatron-core 0.16 and 0.19). "core_attn": megatron's selective recompute of
# core attention: in training, each layer keeps only its attention's inputs (q, k, v) for the
# backward and runs QK^T, softmax and the product with V again there. Without Transformer Engine
# (megatron's local DotProductAttention: no flash attention) that drops the [heads, s, s]
# scores and probabilities each layer would keep (fp32 scores + bf16 probabilities: 6 bytes a
# score, 1.8 GB a layer at 16 heads and 4351 tokens), at the cost of one more attention forward
# per layer. The loss and gradients are the same (attention has no dropout here). With TE's fused
# attention, which keeps no scores, it only costs time.
RECOMPUTE = ("none", "core_attn")


def recompute_fields(recompute: str) -> dict:
    """TransformerConfig's activation-recompute fields for BuildOptions.recompute (a new list each
    call: TransformerConfig may append to recompute_modules)."""
    if recompute == "core_attn":
        return {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    return {}


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
    fp8: Transformer Engine FP8 training, "e4m3" | "hybrid" (None: off), with megatron-core's
        `fp8_recipe` ("tensorwise" | "delayed" | "blockwise" | "mxfp8"); needs TE on CUDA.
    recompute: activation recompute, "none" | "core_attn" (see RECOMPUTE).
    """

    dtype: str = "fp32"
    spec: str = "auto"
    init_std: float = 0.02
    seed: int = 1234
    moe_aux_loss_coeff: float = 0.0
    moe_token_dispatcher: str = "alltoall"
    routing_replay: bool = False
    fp8: str | None = None
    fp8_recipe: str = "tensorwise"
    recompute: str = "none"

    def __post_init__(self):
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r}; choose one of {sorted(_DTYPES)}")
        if self.fp8 not in (None, "e4m3", "hybrid"):
            raise ValueError(f"fp8={self.fp8!r}; choose e4m3, hybrid or None")
        if self.spec not in ("auto", "local", "te"):
            raise ValueError(f"spec={self.spec!r}; choose auto, local or te")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute={self.recompute!r}; choose one of {', '.join(RECOMPUTE)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


@dataclass(frozen=True)
class Kernels:
    """Optional fused kernels, as megatron-core itself finds them at import (TE version dependent).

    te_grouped_gemm: TE's grouped linear layers (megatron's TEGroupedMLP).
    te_fused_rope: TE's fused RoPE (megatron's rope_utils.fused_apply_rotary_pos_emb).
    te_fused_router: TE's fused top-k + score function (moe_utils.fused_topk_with_score_function).
    te_fused_permute: TE's fused token (un)permutation (moe_utils.fused_permute and friends).
    wgrad_accum_fusion: the `fused_weight_gradient_mlp_cuda` extension (Apex built with --cuda_ext).
    fused_softmax: the `scaled_*masked_softmax_cuda` extensions (Apex / Megatron-LM fused kernels).
    """

    te_grouped_gemm: bool = False
    te_fused_rope: bool = False
    te_fused_router: bool = False
    te_fused_permute: bool = False
    wgrad_accum_fusion: bool = False
    fused_softmax: bool = False


def detect_kernels(caps: Capabilities) -> Kernels:
    """The fused kernels available to megatron-core in this process (none without CUDA)."""
    if not caps.cuda:
        return Kernels()
    softmax = all(importlib.util.find_spec(m) is not None for m in (
        "scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda", "scaled_softmax_cuda"))
    found = {"wgrad_accum_fusion": grad_accum_fusion_available(),
             "fused_softmax": softmax}
    if caps.te_usable:
        from megatron.core.extensions import transformer_engine as te_ext
        from megatron.core.models.common.embeddings import rope_utils
        from megatron.core.transformer.moe import moe_utils

        permute = ("fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
                   "fused_sort_chunks_by_index_with_probs", "fused_unpermute")
        found.update(
            te_grouped_gemm=getattr(te_ext, "TEColumnParallelGroupedLinear", None) is not None,
            te_fused_rope=getattr(rope_utils, "fused_apply_rotary_pos_emb", None) is not None,
            te_fused_router=getattr(moe_utils, "fused_topk_with_score_function", None) is not None,
            te_fused_permute=all(getattr(moe_utils, name, None) is not None for name in permute))
    return Kernels(**found)


@dataclass(frozen=True)
class BuildPlan:
    """Where the model lives, which layer spec builds it, and the TransformerConfig switches that
    depend on the platform. `build_plan` decides it; see its table."""

    device: str  # "cuda" | "cpu"
    use_te: bool
    use_cpu_initialization: bool
    moe_grouped_gemm: bool
    bias_activation_fusion: bool
    masked_softmax_fusion: bool
    bias_dropout_fusion: bool
    apply_rope_fusion: bool
    persist_layer_norm: bool
    gradient_accumulation_fusion: bool
    moe_router_fusion: bool
    moe_permute_fusion: bool

    def config_kwargs(self) -> dict:
        """The TransformerConfig fields of the plan."""
        out = asdict(self)
        del out["device"], out["use_te"]
        return out


def build_plan(caps: Capabilities, kernels: Kernels = Kernels(), spec: str = "auto",
               routing_replay: bool = False) -> BuildPlan:
    """Platform capabilities -> how to build the model (a pure function: tested on CPU for every case).

    spec: "auto" (TE when usable) | "local" | "te" (raises without usable TE).
    What each switch needs, from megatron-core's code:
      device                  CUDA when available: megatron allocates its parallel layers on the current
                              CUDA device, torch norms are created on the CPU, so the model is moved
                              (Megatron-LM's `model.cuda(torch.cuda.current_device())`).
      use_cpu_initialization  only without CUDA (init on the CPU, then nothing moves it).
      moe_grouped_gemm        TE in use and TE has grouped linears (TEGroupedMLP); never the legacy
                              GroupedMLP, which needs the separate `grouped_gemm` package.
      bias_activation_fusion  CUDA: megatron's jit_fuser (torch.compile) SwiGLU; needs no TE.
                              (transformer_config turns it off for MoE experts run one at a time.)
      bias_dropout_fusion     CUDA: megatron's jit_fuser residual add; needs no TE.
      masked_softmax_fusion   only megatron's local DotProductAttention reads it (TE attention fuses
                              its own softmax): CUDA, local spec and the compiled softmax extensions,
                              which it imports at forward time when the shapes fit.
      apply_rope_fusion       TE in use and TE's fused RoPE present (TransformerConfig rejects it otherwise).
      persist_layer_norm      never: only Apex's persistent LayerNorm kernel reads it; these models use
                              RMSNorm (TENorm, or torch's RMSNorm whose wrapper asserts it is off).
      gradient_accumulation_fusion  CUDA and `fused_weight_gradient_mlp_cuda` (Apex): megatron's own
                              ColumnParallelLinear (the output layer under either spec) raises without it.
      moe_router_fusion       TE in use and TE's fused top-k present, and no routing replay: the fused
                              path skips megatron's RouterReplay entirely.
      moe_permute_fusion      TE in use and TE's fused permutation ops present.
    Without CUDA every switch is off: the CPU lane's numbers do not depend on this function.
    """
    if spec not in ("auto", "local", "te"):
        raise ValueError(f"spec={spec!r}; choose auto, local or te")
    if spec == "te" and not caps.te_usable:
        raise RuntimeError(f"spec='te' needs Transformer Engine and CUDA; this process has {caps.describe()}. "
                           "Use spec='local' or 'auto'.")
    use_te = caps.te_usable and spec in ("auto", "te")
    cuda = caps.cuda
    return BuildPlan(
        device="cuda" if cuda else "cpu",
        use_te=use_te,
        use_cpu_initialization=not cuda,
        moe_grouped_gemm=use_te and kernels.te_grouped_gemm,
        bias_activation_fusion=cuda,
        masked_softmax_fusion=cuda and not use_te and kernels.fused_softmax,
        bias_dropout_fusion=cuda,
        apply_rope_fusion=use_te and kernels.te_fused_rope,
        persist_layer_norm=False,
        gradient_accumulation_fusion=cuda and kernels.wgrad_accum_fusion,
        moe_router_fusion=use_te and kernels.te_fused_router and not routing_replay,
        moe_permute_fusion=use_te and kernels.te_fused_permute,
    )


def plan_for(opts: BuildOptions, spec: str | None = None) -> BuildPlan:
    """This process's plan for `opts` (spec: override opts.spec)."""
    caps = capabilities()
    return build_plan(caps, detect_kernels(caps), spec or opts.spec, opts.routing_replay)


def transformer_config(arch: ModelArch, groups: ParallelGroups, opts: BuildOptions, use_te: bool,
                       plan: BuildPlan | None = None):
    """The megatron-core TransformerConfig for `arch` under `groups`' parallel sizes.

    plan: the platform switches (default: this process's plan for the TE or local spec).
    """
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    par = groups.config
    plan = plan if plan is not None else plan_for(opts, "te" if use_te else "local")
    fused = plan.config_kwargs()
    moe_only = {k: fused.pop(k) for k in ("moe_grouped_gemm", "moe_router_fusion", "moe_permute_fusion")}
    if arch.is_moe and not plan.moe_grouped_gemm:
        # Experts one at a time (SequentialMLP) call the compiled SwiGLU with each expert's token
        # count, 0 and 1 included, which Dynamo specialises: it recompiles until its recompile limit
        # (8) and then runs eagerly anyway, after seconds of compiling per process.
        fused["bias_activation_fusion"] = False
    moe = {}
    if arch.is_moe:
        moe = dict(
            num_moe_experts=arch.num_experts,
            moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
            moe_router_topk=arch.moe_topk,
            **router_fields(arch),
            moe_router_load_balancing_type="aux_loss" if opts.moe_aux_loss_coeff > 0 else "none",
            moe_aux_loss_coeff=opts.moe_aux_loss_coeff,
            moe_token_dispatcher_type=opts.moe_token_dispatcher,
            moe_layer_freq=[1 if arch.is_moe_layer(i) else 0 for i in range(arch.num_layers)],
            moe_shared_expert_intermediate_size=arch.moe_shared_expert_ffn_hidden_size or None,
            moe_enable_routing_replay=opts.routing_replay,
            **moe_only,
        )
    dtype = opts.torch_dtype
    config_cls, attention = (MLATransformerConfig, mla_fields(arch)) if arch.family.mla else (TransformerConfig, {})
    return config_cls(
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
        # Platform workaround #4: with the local spec (no TE, any device) a linear bias breaks the
        # MoE backward (in-place add on a custom-Function view); no supported family has MLP or
        # output-projection biases. Qwen2's q/k/v biases are a separate switch.
        add_bias_linear=False,
        add_qkv_bias=arch.family.qkv_bias,
        # MLA: the RMSNorms of the q and kv latents (megatron-core builds them only with this on)
        qk_layernorm=arch.family.qk_norm or arch.family.mla,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=opts.init_std,
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
        # device-dependent switches: use_cpu_initialization and the fused kernels (see build_plan)
        **fused,
        # Our losses arrive already divided by a global normaliser (tokens or sequences summed
        # over every DP/CP rank and micro-batch of the step). Per-token mode makes megatron's
        # DDP sum (not average) gradients over DP and its schedules not divide by the number of
        # micro-batches; the trainer calls finalize_model_grads itself with num_tokens=None.
        calculate_per_token_loss=True,
        **fp8_fields(opts),
        **recompute_fields(opts.recompute),
        **moe,
        **attention,
    )


def router_fields(arch: ModelArch) -> dict:
    """TransformerConfig fields of the family's router (model/arch.py: Family.router)."""
    if arch.family.router == "sigmoid":
        grouped = arch.moe_num_groups > 1
        return dict(
            # sigmoid scores, top-k of scores + expert_bias, the k scores renormalised (top-k > 1)
            moe_router_score_function="sigmoid",
            moe_router_pre_softmax=False,
            moe_router_enable_expert_bias=True,
            # RL keeps the checkpoint's score-correction bias: megatron-core's load-balancing update
            # of it (finalize_model_grads) would move routing between rollout and training
            moe_router_bias_update_rate=0.0,
            moe_router_topk_scaling_factor=arch.moe_routed_scaling_factor,
            moe_router_num_groups=arch.moe_num_groups if grouped else None,
            moe_router_group_topk=arch.moe_group_topk if grouped else None,
        )
    # top-k on logits then softmax over the k == renormalised top-k softmax (HF
    # norm_topk_prob=True); pre-softmax keeps the un-renormalised probabilities.
    return dict(moe_router_score_function="softmax", moe_router_pre_softmax=not arch.norm_topk_prob)


def mla_fields(arch: ModelArch) -> dict:
    """MLATransformerConfig fields (multi-latent attention, plain RoPE on the qk_rope part).

    megatron-core's MLA rotates the de-interleaved halves of the RoPE dims (HF rope_interleave=true)
    and scales scores by 1 / sqrt(qk_nope + qk_rope) with rope_type "rope".
    """
    return dict(q_lora_rank=arch.q_lora_rank, kv_lora_rank=arch.kv_lora_rank,
                qk_head_dim=arch.qk_nope_head_dim, qk_pos_emb_head_dim=arch.qk_rope_head_dim,
                v_head_dim=arch.v_head_dim, rope_type="rope", rotary_base=arch.rope_theta,
                rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)


def fp8_fields(opts: BuildOptions) -> dict:
    """TransformerConfig's FP8 training fields (none when opts.fp8 is None). Megatron-core runs the
    GEMMs of every TE layer in FP8 with this scaling recipe; the local spec ignores them."""
    return {} if opts.fp8 is None else {"fp8": opts.fp8, "fp8_recipe": opts.fp8_recipe}


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
    plan = plan_for(opts)
    use_te = plan.use_te
    if par.cp > 1 and not use_te:
        raise RuntimeError(
            f"parallel.context_parallel_size={par.cp} (--context-parallel-size) needs Transformer Engine "
            "attention on CUDA (megatron-core: 'Context parallelism is only supported by "
            f"TEDotProductAttention'); this process has {capabilities().describe()}. "
            "CP is a GPU-only path: install the 'te' extra on a GPU machine, or use "
            "parallel.context_parallel_size=1 on CPU.")
    if opts.fp8 is not None and not use_te:
        raise RuntimeError(
            f"precision.fp8={opts.fp8} (FP8 training) runs through Transformer Engine layers on CUDA; this "
            f"process has {capabilities().describe()}. Use precision.recipe=bf16 here, or run on a GPU "
            "with the 'te' extra installed.")
    config = transformer_config(arch, groups, opts, use_te, plan)
    torch.manual_seed(opts.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(opts.seed)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization="RMSNorm")
    if arch.family.mla and not use_te:
        _duplicate_mla_down_projections(spec)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=groups.is_first_stage,
        post_process=groups.is_last_stage,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(arch.rope_theta),
        rope_scaling=bool(arch.rope_llama3_factor),
        rope_scaling_factor=arch.rope_llama3_factor or 8.0,
        pg_collection=groups.pgs,
    )
    if arch.family.mla and not use_te:
        _init_mla_down_projections(model, config)
    if plan.device == "cuda":
        # As Megatron-LM's get_model: megatron builds its parallel layers on the current device
        # (torch.cuda.set_device(LOCAL_RANK) in init_distributed), torch's norms on the CPU.
        model.cuda(torch.cuda.current_device())
    return model


def _duplicate_mla_down_projections(block_spec) -> None:
    """MLA's q and kv down projections as megatron's duplicated `Linear` (one full copy per TP
    rank, gradients all-reduced over TP under sequence parallelism), as TE's spec has them
    (`TELinear`, parallel_mode "duplicated").

    Why: the local spec makes them TP-sharded ColumnParallelLinears, whose MLA branch gathers the
    [kv latent | RoPE key] columns with an all-gather whose backward only splits; but each TP rank
    uses the shared RoPE key for its own heads only, so its gradient there is a per-rank partial
    sum that is never reduced: the loss is right and the gradients below it are wrong (measured:
    TP=2 vs one rank, tests/distributed/test_model_parallel.py). The duplicated branch gathers the
    RoPE key over the sequence instead, whose backward reduce-scatters (sums) it. (megatron-core
    0.17+ recognises this Linear only with platform workaround #17.)
    """
    from megatron.core.post_training.modelopt.layers import Linear

    for layer in block_spec.layer_specs:
        attention = layer.submodules.self_attention.submodules
        attention.linear_q_down_proj = Linear
        attention.linear_kv_down_proj = Linear


@torch.no_grad()
def _init_mla_down_projections(model, config) -> None:
    """megatron's `Linear` keeps torch.nn.Linear's own init; give its weights the model's
    init_method, as every other layer (and TE's TELinear) has. Drawn from the same seeded
    generator on every TP rank, so the duplicated copies agree."""
    for name, module in model.named_modules():
        if name.endswith(("linear_q_down_proj", "linear_kv_down_proj")):
            config.init_method(module.weight)


def causal_mask(seq_len: int, device=None) -> torch.Tensor:
    """[1, 1, S, S] boolean mask, True = masked (megatron's local attention convention)."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1).view(
        1, 1, seq_len, seq_len)


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside megatron's wrappers (DDP, Float16Module: each keeps what it wraps in
    `.module`). Checkpoints and weight export use its names, the same whatever wraps it."""
    while hasattr(model, "module"):
        model = model.module
    return model
