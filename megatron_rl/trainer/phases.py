"""The phases of one RL step, each a function with typed inputs and outputs (see rl_step.py).

    rollout = generate(ctx, step)                  # the schedule's batch for the step: rank 0's, None elsewhere
    batch = make_batch(ctx, rollout)               # rank 0: advantages, packing; every rank: its rows (scatter)
    old = old_logprobs(ctx, batch)                 # π_old (trainer, rollout weights) + mismatch values
    updates = update(ctx, batch, old)              # N optimizer steps over mini-batches
    version = sync(ctx)                            # the new version; new weights to the engine (schedule)
    metrics = step_metrics(ctx, batch, old, updates)

Every reducible value follows the one metrics convention (megatron_rl/metrics/reduce.py) and is
reduced once, in `step_metrics`. The ratio quantiles, which do not reduce like sums, are found over
all DP x CP ranks where their tokens are (`old_logprobs`: w; `update`: r and ρ) by their own
collectives (metrics/quantiles.py) and ride along as values every rank holds alike. Tensors are made on the device of the data they describe; the
training batch lives on the model's device.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from megatron_rl.losses import (
    LOCAL,
    STEP_STATISTICS,
    CPSeqOps,
    GlobalCounts,
    PolicyBatch,
    SeqOps,
    compute_policy_loss,
    get_advantage,
    zero_variance_groups,
)
from megatron_rl.losses.token_local import TokenTerms
from megatron_rl.metrics.mismatch import mismatch_sums, ratio_quantiles, valid_log_ratio
from megatron_rl.metrics.reduce import accumulate, finish, reduce_metrics
from megatron_rl.moe import RolloutRouting
from megatron_rl.parallel.layout import BatchLayout
from megatron_rl.trainer.batch import TrainBatch, pack
from megatron_rl.trainer.nonfinite import agreed_finite, check_parameters, count_in_a_row, guarded_step
from megatron_rl.trainer.passes import (
    PassSettings,
    TokenLocalLoss,
    global_counts,
    logprob_pass,
    reduce_dp,
    train_pass,
)
from megatron_rl.trainer.rollouts import Rollout
from megatron_rl.trainer.scatter import Prepared, scatter_batch
from megatron_rl.trainer.schedule import staleness, token_staleness


@dataclass
class StepBatch:
    """local: this rank's rows (its CP shard), on the model's device; rows: their global indices;
    routing: this rank's part of the engine's routing for router replay (its rows, CP columns and
    stage's MoE layers; trainer/scatter.py), or None;
    rollout_metrics: rank 0's values of the whole batch (`rollout_metrics`); bytes_received: the
    bytes of this rank's part; settings: pass settings; staleness: see trainer/schedule.py."""

    local: TrainBatch
    rows: torch.Tensor
    routing: RolloutRouting | None
    rollout_metrics: dict[str, float]
    bytes_received: int
    settings: PassSettings
    seq: SeqOps
    staleness: torch.Tensor  # [local rows, L] int64: trainer versions since each token was generated
    layout: BatchLayout  # how the step's rows split into mini-batches, DP ranks and micro-batches


@dataclass
class OldPolicy:
    """logprobs: [N, L] log π_old of the local rows (zeros off the last pipeline stage);
    values: mismatch diagnostics (metrics convention)."""

    logprobs: torch.Tensor
    values: dict


@dataclass
class Updates:
    """values: loss parts and r/ρ ratio diagnostics summed over micro-batches (metrics convention),
    and the step's r/ρ quantiles over all ranks (the same on every rank);
    grad_norms: one per optimizer step; skipped: optimizer steps skipped (fp16 overflow: megatron's
    loss scaler found inf/NaN gradients, left the weights unchanged and lowered the scale);
    nonfinite: optimizer steps skipped because their loss or gradient norm was not finite
    (trainer/nonfinite.py: the weights and optimizer state unchanged)."""

    values: dict
    grad_norms: list[float]
    skipped: int
    loss_scale: float | None = None  # fp16: megatron's dynamic loss scale after the last step
    nonfinite: int = 0


# ----------------------------------------------------------------------------- phases


def generate(ctx, step: int) -> Rollout | None:
    """This step's samples and rewards on rank 0 (None elsewhere), as the run's schedule provides
    them (trainer/schedule.py). An engine failure reaches every rank as RolloutFailed."""
    return ctx.schedule.rollout(step, ctx.policy_version)


def make_batch(ctx, rollout: Rollout | None) -> StepBatch:
    """This rank's rows of the padded training batch (DP rows, CP shard): rank 0 computes the group
    advantages and packs the whole batch (`prepare`), then sends every rank its part as tensors
    (trainer/scatter.py; no other rank sees the whole batch). `rollout`: rank 0's, None elsewhere."""
    cfg, groups = ctx.cfg, ctx.groups
    layout = cfg.layout(groups.dp_size)
    part = scatter_batch(lambda: prepare(ctx, rollout), layout, groups, ctx.replay.layer_ids)
    local = part.batch
    settings = PassSettings(micro_batch_size=cfg.train.micro_batch_size, temperature=cfg.rollout.temperature)
    return StepBatch(local, part.rows, part.routing, part.metrics, part.bytes_received, settings, seq_ops(groups),
                     staleness(local.versions, ctx.policy_version, local.token_versions,
                               local.loss_mask.shape[1]).to(local.loss_mask.device), layout)


def prepare(ctx, rollout: Rollout) -> Prepared:
    """Rank 0: group advantages, the packed batch (rows of filtered groups out of the loss mask),
    the engine's routing of every row when router replay reads it, and the rollout's metrics.
    Cost: O(B·G·S) host memory (and B·G·S·M·k routing under router replay)."""
    cfg = ctx.cfg
    adv, keep_rows, zero_var = group_advantages(rollout.rewards, cfg.rollout.group_size, ctx.loss.advantages,
                                                ctx.loss.filter_zero_variance_groups, ctx.loss.advantage_params)
    full = pack(rollout.samples, rollout.rewards.tolist(), ctx.tokenizer.pad_id, ctx.groups.config,
                with_kept_ids=cfg.loss.keep_sampling_mask).with_advantages(adv)
    stale = token_staleness(full, ctx.policy_version)  # every sampled token, the groups filtered out below included
    if not keep_rows.all():
        full = replace(full, loss_mask=full.loss_mask & keep_rows[:, None])
    routing = (RolloutRouting.from_samples(rollout.samples, full.input_len + 1) if ctx.replay.mode != "none"
               else None)
    metrics = rollout_metrics(rollout, adv, zero_var)
    metrics["schedule/staleness_mean"], metrics["schedule/staleness_max"] = stale
    return Prepared(full, routing, metrics)


def old_logprobs(ctx, batch: StepBatch) -> OldPolicy:
    """π_old log-probs and entropy of the local rows (under the replay strategy), and the mismatch
    diagnostics against the engine's μ: reducible values plus w's quantiles over all DP x CP ranks."""
    local = batch.local
    old, entropy = ctx.replay.old_pass(ctx.policy, ctx.groups, local, batch.routing, batch.settings)
    if old is None:  # not the last pipeline stage: it holds no log-probs
        return OldPolicy(torch.zeros_like(local.rollout_logprobs), {})
    values = mismatch_sums(old, local.rollout_logprobs, local.loss_mask, entropy=entropy, seq=batch.seq,
                           turn_ids=local.turns, staleness=batch.staleness, max_staleness=ctx.schedule.max_staleness)
    w = valid_log_ratio(old, local.rollout_logprobs, local.loss_mask)
    values.update(ratio_quantiles({"w": w}, ctx.groups.dp_cp_group))  # over all DP x CP ranks' tokens
    return OldPolicy(old, values)


def update(ctx, batch: StepBatch, old: OldPolicy) -> Updates:
    """train.num_minibatches optimizer steps; each mini-batch's loss is normalised by its global
    counts, and takes the per-step statistics its surrogate declared (losses/step_stats.py).

    An optimizer step whose loss or gradient norm is not finite is skipped, and the run stops at
    train.max_nonfinite_updates of them in a row (counted across RL steps in ctx.state (RunState), which
    checkpoints keep); an applied step is followed by a check that the weights are finite
    (trainer/nonfinite.py)."""
    cfg, policy, local, mbs = ctx.cfg, ctx.policy, batch.local, batch.settings.micro_batch_size
    loss_kw = ctx.loss.loss_kwargs()
    # what r = π_θ / reference is taken against (loss.ratio_reference): π_old, or the behaviour μ
    reference = local.rollout_logprobs if cfg.loss.ratio_reference == "rollout" else old.logprobs
    values: dict = {}
    grad_norms, skipped, nonfinite = [], 0, 0
    ratio_log: dict[str, list] = {"r": [], "rho": []}   # every update pass's valid log r and log ρ
    step = ctx.policy_version + 1  # the trainer's version counts completed RL steps (schedule.after_update)
    for j, slices in enumerate(batch.layout.minibatch_slices()):
        counts = global_counts(local, slices, ctx.groups, batch.seq)
        loss_kw["surrogate_params"].update(step_parameters(ctx, batch, slices, reference))
        loss_fn = policy_loss_fn(loss_kw, counts, reference, batch.seq, batch.staleness, ctx.schedule.max_staleness,
                                 ratio_log)
        if ctx.loss.gradients_in_forward:
            loss_fn = TokenLocalLoss(policy_token_terms(loss_kw, counts, reference, batch.seq), loss_fn)
        with ctx.replay.update(slices, mbs):
            outs = train_pass(policy.model, policy.optimizer, ctx.groups, local, slices, batch.settings, loss_fn,
                              wrap_step=ctx.replay.wrap)
        for o in outs:
            values = accumulate(values, o)
        # the loss is finite on every rank, or every rank skips (agreed_finite all-reduces the verdict)
        outcome = guarded_step(policy.optimizer, agreed_finite(o["loss/value/sum"] for o in outs))
        skipped += int(outcome.overflow)
        nonfinite += int(outcome.nonfinite is not None)
        grad_norms.append(outcome.grad_norm)
        where = f"RL step {step}, update {j + 1} of {cfg.train.num_minibatches}"
        ctx.state.nonfinite_in_a_row = count_in_a_row(ctx.state.nonfinite_in_a_row, outcome,
                                                      cfg.train.max_nonfinite_updates, where)
        if outcome.applied:
            check_parameters(policy.model, f"the optimizer update of {where} (finite loss, gradient norm "
                                           f"{outcome.grad_norm:g})",
                             f"The update itself wrote them: check optim.lr={cfg.optim.lr:g}, optim.adam_eps="
                             f"{cfg.optim.adam_eps:g}, optim.weight_decay={cfg.optim.weight_decay:g}, and resume from "
                             f"the last checkpoint (train.resume=true)")
    if ctx.groups.is_last_stage:  # the stage that computed log-probs; quantiles over all DP x CP ranks
        values.update(ratio_quantiles({k: torch.cat(v) if v else local.loss_mask.new_zeros(0, dtype=torch.float64)
                                       for k, v in ratio_log.items()}, ctx.groups.dp_cp_group))
    scale = policy.optimizer.get_loss_scale() if ctx.cfg.model.dtype == "fp16" else None
    return Updates(values, grad_norms, skipped, None if scale is None else float(scale), nonfinite)


def sync(ctx) -> int:
    """The trainer's new version (ctx.policy_version + 1); the new weights go to the engine when the
    schedule says so."""
    return ctx.schedule.after_update(ctx.policy_version)


def step_metrics(ctx, batch: StepBatch, old: OldPolicy, updates: Updates) -> dict[str, float]:
    """Every logged value of the step: one reduction over DP x CP (loss and mismatch values), one
    over the world (routing agreement, the bytes each rank received of the batch: max and sum over
    ranks), then host-side rollout (rank 0's, trainer/scatter.py) and optimizer numbers."""
    cfg = ctx.cfg
    m: dict[str, float] = {}
    for key, value in finish(reduce_dp(accumulate(old.values, updates.values), ctx.groups)).items():
        if key == "loss/value":
            m["loss/policy"] = value / cfg.train.num_minibatches
        elif key.startswith(("mismatch/", "policy/", "loss/")):
            m[key] = value
        else:
            m[f"loss/{key}"] = value
    received = torch.tensor(float(batch.bytes_received), dtype=torch.float64)
    m.update(finish(reduce_metrics({**ctx.replay.metrics(), "rollout/bytes_received/max/max": received,
                                    "rollout/bytes_received/sum/sum": received})))
    m["optim/grad_norm"] = sum(updates.grad_norms) / len(updates.grad_norms)
    m["optim/skipped_steps"] = updates.skipped
    m["optim/nonfinite_updates"] = updates.nonfinite
    if updates.loss_scale is not None:
        m["optim/loss_scale"] = updates.loss_scale
    m["optim/lr"] = ctx.policy.optimizer.param_groups[0]["lr"]
    m.update(batch.rollout_metrics)  # with schedule/staleness_{mean,max}: per sampled token, whole batch
    # in optimizer updates since the rollout policy, as the papers count it: a sample s versions old
    # in mini-batch j (of N equal ones) is trained s N + j updates after its policy
    n = cfg.train.num_minibatches
    m["schedule/staleness_updates_mean"] = n * m["schedule/staleness_mean"] + (n - 1) / 2
    m["schedule/staleness_updates_max"] = n * m["schedule/staleness_max"] + (n - 1)
    if ctx.engine is not None:  # rank 0: generation calls and weight syncs so far
        m.update({k: float(v) for k, v in ctx.schedule.stats().items()})
    if ctx.engine is not None:  # rank 0: the engine's own counters (vLLM: restarts, retries, probe diff)
        m.update({k: float(v) for k, v in ctx.engine.stats().items()})
    return m


# ----------------------------------------------------------------------------- helpers


def rollout_metrics(rollout: Rollout, advantages: torch.Tensor, zero_var: torch.Tensor) -> dict[str, float]:
    """Rank 0: the logged values of the whole batch. advantages: [B*G]; zero_var: [B] groups whose
    rewards are all equal."""
    r, samples = rollout.rewards, rollout.samples
    m = {"rollout/reward_mean": float(r.mean()),
         "rollout/accuracy": float((r >= 1.0).float().mean()),
         "rollout/response_length": sum(s.num_trained() for s in samples) / len(samples),  # sampled tokens
         "rollout/truncated_fraction": sum(s.finish_reason == "length" for s in samples) / len(samples),
         "rollout/zero_variance_groups": float(zero_var.float().mean()),
         "rollout/advantage_abs_mean": float(advantages.abs().mean())}
    m.update({k: float(v) for k, v in rollout.reward_stats.items()})
    return m


def group_advantages(rewards: torch.Tensor, group_size: int, estimator: str, filter_zero_var: bool,
                     params: dict | None = None):
    """Per-sample advantages [B*G] from rewards [B*G] (contiguous groups), and the kept-row mask.
    params: the estimator's keyword parameters (loss.advantage_params)."""
    r = rewards.view(-1, group_size)
    adv = get_advantage(estimator)(r, **(params or {})).reshape(-1)
    zero_var = zero_variance_groups(r)
    keep = (~zero_var).repeat_interleave(group_size) if filter_zero_var else torch.ones_like(adv, dtype=torch.bool)
    return adv, keep, zero_var


def seq_ops(groups) -> SeqOps:
    """Per-sequence reductions: local, or finished over the CP group when rows are CP shards."""
    return CPSeqOps(groups.cp_group) if groups.config.cp > 1 else LOCAL


def step_parameters(ctx, batch: StepBatch, slices, old: torch.Tensor) -> dict:
    """The surrogate's declared per-step statistics of the current weights over the mini-batch
    `slices` (one no-grad pass shared by all of them), reduced over DP x CP: {param: value}."""
    declared = ctx.loss.step_statistics
    if not declared:
        return {}
    rows = slice(slices[0].start, slices[-1].stop)
    sub = batch.local.select(rows)
    with ctx.replay.update(slices, batch.settings.micro_batch_size, probe=False):
        logprobs, _ = logprob_pass(ctx.policy.model, ctx.groups, sub, batch.settings, need_entropy=False,
                                   wrap_step=ctx.replay.wrap)
    out = {}
    for param, name in declared.items():
        stat = STEP_STATISTICS.get(name)
        local = stat.sums(logprobs, old[rows], sub.loss_mask) if logprobs is not None else {}
        out[param] = stat.value(reduce_dp(local, ctx.groups))
    return out


def policy_loss_fn(loss_kw: dict, counts: GlobalCounts, old: torch.Tensor, seq: SeqOps = LOCAL,
                   staleness: torch.Tensor | None = None, max_staleness: int = 0,
                   ratio_log: dict[str, list] | None = None):
    """The update pass's loss_fn(micro_batch, logprobs, entropy) -> (loss, values).

    old: [N, L] log-probs the ratio r is taken against (π_old, or μ with loss.ratio_reference=rollout)
    for the rank's rows (indexed by the micro-batch's "rows"), in the same (CP-local) layout as the
    micro-batch; counts: the mini-batch's global normalisers;
    staleness: [N, L] per token, for the ratio statistics split by staleness (max_staleness > 0);
    ratio_log: {"r": [...], "rho": [...]} that each call appends its valid log r and log ρ to (float64
    [n]), for the step's quantiles, which do not reduce like the values (metrics/quantiles.py).
    """

    def loss_fn(mb, logprobs, _entropy):
        batch = PolicyBatch(logprobs=logprobs, old_logprobs=old[mb["rows"]], rollout_logprobs=mb["rollout_logprobs"],
                            advantages=mb["advantages"], loss_mask=mb["loss_mask"], positions=mb["positions"],
                            seq=seq)
        loss, values = compute_policy_loss(batch, normaliser=counts, **loss_kw)
        values["loss/value/sum"] = loss.detach().double()
        stale = staleness[mb["rows"]] if staleness is not None else None
        ratios = mismatch_sums(batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask,
                               logprobs=logprobs.detach(), seq=seq, staleness=stale,
                               max_staleness=max_staleness)  # r = π_θ/π_old, ρ = π_θ/μ
        values.update({k: v for k, v in ratios.items() if _is_update_ratio(k)})
        if ratio_log is not None:
            ratio_log["r"].append(valid_log_ratio(logprobs, batch.old_logprobs, batch.loss_mask))
            ratio_log["rho"].append(valid_log_ratio(logprobs, batch.rollout_logprobs, batch.loss_mask))
        return loss, values

    return loss_fn


def policy_token_terms(loss_kw: dict, counts: GlobalCounts, old: torch.Tensor, seq: SeqOps = LOCAL):
    """terms(micro_batch) -> TokenTerms of the policy loss `policy_loss_fn` computes (same arguments),
    for the log-prob kernel that forms its gradients in the forward."""

    def terms(mb):
        mu = mb["rollout_logprobs"]
        # π_θ is not known before the pass; the terms do not read it (token_local_blocker, whose
        # declarations tests/unit/losses/test_token_local.py checks): NaN, not a plausible value
        batch = PolicyBatch(logprobs=torch.full_like(mu, math.nan), old_logprobs=old[mb["rows"]], rollout_logprobs=mu,
                            advantages=mb["advantages"], loss_mask=mb["loss_mask"], positions=mb["positions"], seq=seq)
        return TokenTerms.from_batch(batch, normaliser=counts, **loss_kw)

    return terms


def _is_update_ratio(key: str) -> bool:
    """The r = π_θ/π_old and ρ = π_θ/μ values (overall and by staleness) of an update pass."""
    return key.startswith(("mismatch/r/", "mismatch/rho/")) or (
        key.startswith("mismatch/staleness_") and ("/r/" in key or "/rho/" in key))
