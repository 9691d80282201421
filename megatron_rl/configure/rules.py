"""The config's rules across sections, one component at a time: `validate(cfg)` runs each check.

    validate(cfg)              # configure.load_config calls it; every rule names the field and the fix
    cfg.check_layout(world)    # the rules that need the world size, at launch (pretrain_rl.py)

A section checks its own values (config/schema.py); what a registered component declares is
checked here the same way for every entry of its registry: the loss (losses/setup.py:
resolve_loss), the rollout engine (its EngineSpec's refusals), the rollout function and the
schedule (their specs). A new engine, rollout function or schedule adds no rule here: it declares
its facts in its spec. This module sits above the registries it reads (rollout, trainer), so the
config layer below stays free of them.
"""
from __future__ import annotations

from dataclasses import fields

from megatron_rl.losses.policy_loss import RECIPES, recipe_variant
from megatron_rl.losses.setup import resolve_loss
from megatron_rl.model.arch import FAMILIES
from megatron_rl.parallel.layout import BatchLayout
from megatron_rl.rollout import ENGINES, ROLLOUT_FNS, WEIGHT_SYNCS
from megatron_rl.rollout.function import max_trained
from megatron_rl.trainer.schedule import SCHEDULES
from megatron_rl.trainer.transport import TRANSPORTS


def validate(cfg) -> None:
    """Raise ValueError on the first rule `cfg` (a RunConfig) breaks."""
    for check in (check_loss, check_batch, check_oversample, check_router_replay, check_engine, check_rollout_function, check_schedule,
                  check_in_flight_update,
                  check_precision, check_sampling, check_tokenizer, check_sft):
        check(cfg)


def check_loss(cfg) -> None:
    try:
        resolve_loss(cfg.loss, max_trained(cfg))
    except KeyError as e:  # a registry's unknown name
        raise ValueError(f"loss: {e.args[0]}") from None


def check_batch(cfg) -> None:
    """The split into mini-batches (the world size is not known yet: check_layout completes it)."""
    BatchLayout(cfg.rollout.prompts_per_step * cfg.rollout.group_size, cfg.train.num_minibatches, 1, 1).check()


def check_oversample(cfg) -> None:
    """Over-sampling fills a step with groups that have reward variance; the filter is what masks
    the zero-variance groups a step that reached rollout.max_oversample still trains on."""
    r = cfg.rollout
    if r.oversample and not cfg.loss.filter_zero_variance_groups:
        raise ValueError("rollout.oversample=true fills each step with groups whose rewards differ and masks the "
                         "rest with the zero-variance filter, which is off: set loss.filter_zero_variance_groups=true "
                         "(or rollout.oversample=false)")
    if r.oversample and r.max_oversample * r.prompts_per_step < r.prompts_per_step + 1:
        raise ValueError(f"rollout.max_oversample={r.max_oversample:g} leaves no extra prompt to draw "
                         f"(floor({r.max_oversample:g} x rollout.prompts_per_step={r.prompts_per_step}) = "
                         f"{r.prompts_per_step}): raise it, e.g. to 4, or set rollout.oversample=false")
    default = next(f.default for f in fields(r) if f.name == "max_oversample")
    if not r.oversample and r.max_oversample != default:
        raise ValueError(f"rollout.max_oversample={r.max_oversample:g} bounds over-sampling, which is off: set "
                         f"rollout.oversample=true, or leave rollout.max_oversample out")


def check_engine(cfg) -> None:
    """rollout.backend names a registered engine, its spec's own rules hold, and the engine can give
    what the run needs."""
    if cfg.rollout.backend not in ENGINES:
        raise ValueError(f"rollout.backend={cfg.rollout.backend!r}: choose one of {', '.join(ENGINES.names())}")
    spec = ENGINES.get(cfg.rollout.backend)
    why = spec.no_routing(cfg.rollout) if cfg.moe.router_replay == "r3" else None
    if why:
        raise ValueError(f"moe.router_replay=r3 needs the rollout engine's routing, which {why}, or R2 "
                         f"({_router_replay_fix(cfg, 'r2')})")
    if cfg.precision.fp32_lm_head and spec.no_fp32_lm_head:
        raise ValueError(f"precision.fp32_lm_head: {spec.no_fp32_lm_head}")
    quant = cfg.rollout.quantization
    if quant is not None and quant not in spec.quantizations:
        vllm = " (a vLLM server on a GPU quantizes with rollout.vllm.quantization=fp8)" \
            if cfg.rollout.backend == "vllm" else ""
        raise ValueError(f"rollout.quantization={quant}: rollout.backend={cfg.rollout.backend} does not run it; use "
                         f"rollout.backend={' or '.join(_engines_with(quant)) or '(none registered)'}, or "
                         f"rollout.quantization=null{vllm}")
    check_weight_sync(cfg.rollout.backend, cfg.rollout.weight_sync)
    if spec.check is not None:
        spec.check(cfg.rollout)


def check_weight_sync(backend: str, name: str) -> None:
    """rollout.weight_sync names a registered weight sync that engine `backend` takes ("auto": its
    default), sent by a registered transport. The registries are the only source: WEIGHT_SYNCS says
    each one's transport, the engine's spec which names it takes."""
    spec = ENGINES.get(backend)
    unknown = [n for n in spec.weight_syncs if n not in WEIGHT_SYNCS or WEIGHT_SYNCS.get(n).transport not in TRANSPORTS]
    if unknown:
        raise ValueError(f"rollout.backend={backend}: its spec names weight syncs {unknown} that are not registered "
                         f"with a registered transport; weight syncs: {', '.join(WEIGHT_SYNCS.names())}; "
                         f"transports: {', '.join(TRANSPORTS.names())}")
    if spec.weight_sync(name) not in spec.weight_syncs:
        others = [n for n in ENGINES.names() if name in ENGINES.get(n).weight_syncs]
        taken = f"; rollout.backend={' or '.join(others)} takes it" if others else ""
        raise ValueError(f"rollout.weight_sync={name!r}: rollout.backend={backend} takes "
                         f"{', '.join(spec.weight_syncs)} (auto = {spec.weight_syncs[0]}){taken}")


def _engines_with(quant: str) -> list[str]:
    return [n for n in ENGINES.names() if quant in ENGINES.get(n).quantizations]


def check_rollout_function(cfg) -> None:
    if cfg.rollout.function not in ROLLOUT_FNS:
        raise ValueError(f"rollout.function={cfg.rollout.function!r}: choose one of {', '.join(ROLLOUT_FNS.names())}")
    ROLLOUT_FNS.get(cfg.rollout.function).check(cfg)


def check_schedule(cfg) -> None:
    """train.schedule names a registered schedule, and the schedule's own rules hold."""
    if cfg.train.schedule not in SCHEDULES:
        raise ValueError(f"train.schedule={cfg.train.schedule!r}: choose one of {', '.join(SCHEDULES.names())}")
    SCHEDULES.get(cfg.train.schedule).check(cfg.train)


def check_in_flight_update(cfg) -> None:
    """train.in_flight_update=pause|abort: the async schedule (the only one that generates while
    it updates), an engine whose spec says it can park its generation, and for pause no router
    replay r3 (a position's routing would differ before and after the update)."""
    mode = cfg.train.in_flight_update
    if mode == "wait":
        return
    if cfg.train.schedule != "async":
        raise ValueError(f"train.in_flight_update={mode} acts on a generation that overlaps an update, which only "
                         f"train.schedule=async has (it is {cfg.train.schedule!r}): set train.schedule=async or "
                         f"train.in_flight_update=wait")
    spec = ENGINES.get(cfg.rollout.backend)
    if mode not in spec.in_flight_updates:
        raise ValueError(f"train.in_flight_update={mode}: rollout.backend={cfg.rollout.backend} supports "
                         f"{', '.join(spec.in_flight_updates)}; use one of them, or rollout.backend=embedded")
    why = spec.no_in_flight(cfg.rollout, mode) if spec.no_in_flight is not None else None
    if why:
        raise ValueError(f"train.in_flight_update={mode} with rollout.backend={cfg.rollout.backend}: {why}")
    if mode == "pause" and cfg.moe.router_replay == "r3":
        raise ValueError("train.in_flight_update=pause with moe.router_replay=r3: a sample resumed on new weights "
                         "was routed by two versions, which one replayed routing cannot hold; use "
                         "train.in_flight_update=abort (or wait), or moe.router_replay=r2")


def check_router_replay(cfg) -> None:
    if cfg.moe.router_replay != "none" and cfg.model.hf_dir is None and not FAMILIES[cfg.model.arch].moe:
        raise ValueError(f"moe.router_replay={cfg.moe.router_replay} needs a MoE model; model.arch={cfg.model.arch}. "
                         f"Use model.arch=qwen3_moe (or mixtral, deepseek_v3) or {_router_replay_fix(cfg, 'none')}")


def _router_replay_fix(cfg, replay: str) -> str:
    """How to get router replay `replay`: a recipe that implies moe.router_replay is switched by the
    registered recipe that is the same loss with the other setting, not by the field (which the
    recipe would then contradict)."""
    recipe = cfg.loss.recipe
    if recipe in RECIPES and "moe.router_replay" in RECIPES.get(recipe).implies:
        other = recipe_variant(recipe, {"moe.router_replay": replay} if replay != "none" else {})
        if other:
            return f"loss.recipe={other}"
    return f"moe.router_replay={replay}"


def check_precision(cfg) -> None:
    if cfg.precision.fp8 is not None and cfg.model.dtype == "fp32":
        raise ValueError("precision.fp8 trains FP8 GEMMs inside a bf16/fp16 model: set model.dtype=bf16")


def check_sampling(cfg) -> None:
    if cfg.loss.keep_sampling_mask and cfg.rollout.top_p >= 1.0 and cfg.rollout.top_k == -1:
        raise ValueError("loss.keep_sampling_mask needs truncated sampling: set rollout.top_p < 1 or "
                         "rollout.top_k > 0 (without truncation the kept set is the whole vocabulary)")


def check_tokenizer(cfg) -> None:
    if cfg.data.tokenizer == "hf" and not cfg.model.hf_dir:
        raise ValueError("data.tokenizer=hf reads model.hf_dir's tokenizer, and model.hf_dir is not set; set it, "
                         "or name a tokenizer folder (data.tokenizer=/path/to/folder)")


def check_sft(cfg) -> None:
    """SFT's checks score the first sft.eval_size of the run's held-out set, which is the first
    train.eval_size held-out problems of the tasks (JSONL prompts have none): refuse a target
    accuracy that an empty set can never reach."""
    sft, train = cfg.sft, cfg.train
    if sft.steps == 0 or sft.target_accuracy is None:
        return
    empty_because = ("data.jsonl is set (JSONL prompts have no held-out set)" if cfg.data.jsonl else
                     "train.eval_size=0" if train.eval_size == 0 else
                     "data.heldout_size=0" if cfg.data.heldout_size == 0 else None)
    if empty_because:
        raise ValueError(f"sft.target_accuracy={sft.target_accuracy} can never stop SFT: its checks score the "
                         f"held-out set, which is empty because {empty_because}; set sft.target_accuracy=null "
                         f"to run all sft.steps={sft.steps}")
