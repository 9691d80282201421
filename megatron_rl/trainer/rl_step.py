"""One synchronous RL step: rollout -> reward -> advantages -> old log-probs -> N updates -> sync.

Each phase is a plain function call on the run context; metrics come back as a flat dict of
namespaced floats (rank-0 logging happens in the loop).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import replace

import torch
import torch.distributed as dist

from megatron_rl.losses import (
    LOCAL,
    CPSeqOps,
    GlobalCounts,
    PolicyBatch,
    SeqOps,
    compute_policy_loss,
    ess_from_stats,
    finish_metrics,
    get_advantage,
    local_counts,
    p3o_ess_stats,
    zero_variance_groups,
)
from megatron_rl.metrics.mismatch import (
    combine_sums,
    finish_mismatch,
    mismatch_sums,
    ratio_quantiles,
    reduce_op,
)
from megatron_rl.moe.metrics import add_sums
from megatron_rl.rollout.types import SamplingParams
from megatron_rl.trainer.batch import (
    build_batch,
    cp_shard,
    local_rows,
    minibatch_slices,
    model_device,
    padded_length,
    row_multiple,
)
from megatron_rl.trainer.passes import PassSettings, all_reduce_dp, logprob_pass, train_pass
from megatron_rl.trainer.rollout_io import broadcast, generate_and_score, sync_weights
from megatron_rl.trainer.routing import old_pass


class RolloutFailed(RuntimeError):
    """The engine could not produce this step's samples (after its own restarts/retries)."""


@contextmanager
def timed(metrics: dict, key: str):
    t0 = time.perf_counter()
    yield
    metrics[f"timing/{key}"] = time.perf_counter() - t0


def group_advantages(rewards: torch.Tensor, group_size: int, estimator: str, filter_zero_var: bool):
    """Per-sample advantages [B*G] from rewards [B*G] (contiguous groups), and the kept-row mask."""
    r = rewards.view(-1, group_size)
    adv = get_advantage(estimator)(r).reshape(-1)
    zero_var = zero_variance_groups(r)
    keep = (~zero_var).repeat_interleave(group_size) if filter_zero_var else torch.ones_like(adv, dtype=torch.bool)
    return adv, keep, zero_var


def sampling_for(cfg, tokenizer, step: int) -> SamplingParams:
    r, keep = cfg.rollout, cfg.loss.keep_sampling_mask
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=r.max_tokens,
                          stop_token_ids=(tokenizer.eos_id,), seed=cfg.train.seed * 1_000_003 + step,
                          return_kept_ids=keep, logprobs_mode="processed" if keep else "raw")


def seq_ops(groups) -> SeqOps:
    """Per-sequence reductions: local, or finished over the CP group when rows are CP shards."""
    return CPSeqOps(groups.cp_group) if groups.config.cp > 1 else LOCAL


def global_counts(batch, slices, groups, seq: SeqOps = LOCAL) -> GlobalCounts:
    """The mini-batch's token and sequence counts summed over its micro-batches and DP x CP ranks
    (sequences counted once: on their CP owner rank)."""
    total = GlobalCounts()
    for sl in slices:
        total = total + local_counts(batch.loss_mask[sl], seq)
    vals = all_reduce_dp({"num_tokens": total.num_tokens, "num_seqs": total.num_seqs}, groups)
    return GlobalCounts(vals["num_tokens"], vals["num_seqs"])


def policy_loss_fn(loss_kw: dict, counts: GlobalCounts, old: torch.Tensor, seq: SeqOps = LOCAL):
    """The update pass's loss_fn(micro_batch, logprobs, entropy) -> (loss, metrics).

    old: [N, L] π_old log-probs of the rank's rows (indexed by the micro-batch's "rows"), in the
    same (CP-local) layout as the micro-batch; counts: the mini-batch's global normalisers.
    """

    def loss_fn(mb, logprobs, _entropy):
        batch = PolicyBatch(logprobs=logprobs, old_logprobs=old[mb["rows"]], rollout_logprobs=mb["rollout_logprobs"],
                            advantages=mb["advantages"], loss_mask=mb["loss_mask"], positions=mb["positions"],
                            seq=seq)
        loss, metrics = compute_policy_loss(batch, normaliser=counts, **loss_kw)
        for k in [k for k in metrics if not k.endswith(("/num", "/den"))]:
            # a global value (the same on every rank, e.g. p3o/ess) is summed over micro-batches and
            # ranks like the rest: log it as its mean
            metrics[f"{k}/num"], metrics[f"{k}/den"] = metrics.pop(k).double(), torch.ones((), dtype=torch.float64)
        metrics["loss/value"] = loss.detach().double()
        ratios = mismatch_sums(batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask,
                               logprobs=logprobs.detach(), seq=seq)  # r = π_θ/π_old, ρ = π_θ/μ
        metrics.update({k: v for k, v in ratios.items() if k.startswith(("mismatch/r/", "mismatch/rho/"))})
        return loss, metrics

    return loss_fn


def rl_step(ctx, step: int) -> dict[str, float]:
    cfg, groups, policy = ctx.cfg, ctx.groups, ctx.policy
    B, G = cfg.rollout.prompts_per_step, cfg.rollout.group_size
    m: dict[str, float] = {}
    t_step = time.perf_counter()

    # ---- rollout and rewards (rank 0), shared with every rank
    with timed(m, "generate"):
        examples = ctx.prompts.batch(step, B)
        payload = None
        if ctx.engine is not None:
            try:
                samples, rewards = generate_and_score(ctx.engine, ctx.tokenizer, examples, G,
                                                      sampling_for(cfg, ctx.tokenizer, step), ctx.rewards)
                payload = (samples, rewards, ctx.rewards.stats())
            except Exception as e:  # every rank must learn of it, or they wait in the broadcast forever
                payload = RolloutFailed(f"rollout engine failed at step {step + 1}: {type(e).__name__}: {e}")
        payload = broadcast(payload)
        if isinstance(payload, RolloutFailed):
            raise payload
        samples, rewards, reward_stats = payload

    # ---- advantages and the training batch
    rewards_t = torch.tensor(rewards, dtype=torch.float32)
    adv, keep_rows, zero_var = group_advantages(rewards_t, G, ctx.loss.advantages,
                                                ctx.loss.filter_zero_variance_groups)
    seq_len = padded_length(samples, row_multiple(groups.config.tp, groups.config.cp))
    full = build_batch(samples, rewards, ctx.tokenizer.pad_id, seq_len,
                       with_kept_ids=cfg.loss.keep_sampling_mask).with_advantages(adv)
    if not keep_rows.all():
        full = replace(full, loss_mask=full.loss_mask & keep_rows[:, None])
    dp, dp_rank = groups.dp_size, dist.get_rank(groups.dp_group)
    rows = local_rows(full.size, cfg.train.num_minibatches, dp, dp_rank)
    local = cp_shard(full.select(rows), groups.cp_group).to(model_device())  # CP: each row's zig-zag shard
    seq = seq_ops(groups)
    settings = PassSettings(micro_batch_size=cfg.train.micro_batch_size, temperature=cfg.rollout.temperature or 1.0)

    # ---- old log-probs (π_old: trainer, rollout weights) and mismatch diagnostics
    with timed(m, "old_logprobs"):
        old, entropy, routing = old_pass(ctx.router_replay, ctx.replay, policy, groups, local, samples, rows,
                                         settings)
    wrap = ctx.replay.wrap_forward_step if routing.replay is not None else None
    sums = {}
    if old is not None:
        sums = mismatch_sums(old, local.rollout_logprobs, local.loss_mask, entropy=entropy, seq=seq)
        # quantiles do not reduce exactly: report the most extreme per-rank value over DP ranks
        lo, hi = ratio_quantiles(old - local.rollout_logprobs, local.loss_mask)
        sums["mismatch/w/p01/min"], sums["mismatch/w/p99/max"] = lo, hi
    old = old if old is not None else torch.zeros_like(local.rollout_logprobs)

    # ---- N optimizer steps over mini-batches
    loss_kw = ctx.loss.loss_kwargs()
    step_metrics: dict[str, torch.Tensor] = {}
    grad_norms, skipped = [], 0
    with timed(m, "train"):
        for slices in minibatch_slices(local.size, cfg.train.num_minibatches, cfg.train.micro_batch_size):
            counts = global_counts(local, slices, groups, seq)
            if ctx.loss.needs_ess:
                with routing.update_context(ctx.replay, slices, settings.micro_batch_size, probe=False):
                    loss_kw["surrogate_params"]["ess"] = _global_ess(policy, groups, local, slices, settings, old,
                                                                     wrap)
            loss_fn = policy_loss_fn(loss_kw, counts, old, seq)

            probe = ctx.router_replay == "r2"  # θ_old vs θ agreement (under R3 it would be engine vs θ)
            with routing.update_context(ctx.replay, slices, settings.micro_batch_size, probe) as session:
                outs = train_pass(policy.model, policy.optimizer, groups, local, slices, settings, loss_fn,
                                  wrap_step=wrap)
            if session is not None and probe:
                routing.sums = add_sums(routing.sums, session.agreement_sums("route_agree_old_new"))
            for o in outs:
                o = {k: v.detach().double() for k, v in o.items()}
                step_metrics = combine_sums(step_metrics, o) if step_metrics else o
            ok, grad_norm, _ = policy.optimizer.step()
            if ctx.scheduler is not None:
                ctx.scheduler.step(increment=1)
            skipped += int(not ok)
            grad_norms.append(float(grad_norm) if grad_norm is not None else float("nan"))
    ratio_keys = [k for k in step_metrics if k.startswith("mismatch/")]
    sums.update({k: step_metrics.pop(k) for k in ratio_keys})
    sums = all_reduce_dp(sums, groups, {k: reduce_op(k) for k in sums})  # last stage's values, everywhere
    m.update(finish_mismatch(sums))
    for q in ("p01/min", "p99/max"):
        if f"mismatch/w/{q}" in sums:
            m[f"mismatch/w/{q.split('/')[0]}"] = float(sums[f"mismatch/w/{q}"])
    reduced = all_reduce_dp(step_metrics, groups)
    finished = finish_metrics(reduced)
    m["loss/policy"] = finished.pop("loss/value", 0.0) / cfg.train.num_minibatches
    m.update({f"loss/{k}" if not k.startswith(("loss/", "policy/")) else k: v for k, v in finished.items()})
    m.update(routing.metrics())  # collective over all ranks
    m["optim/grad_norm"] = sum(grad_norms) / len(grad_norms)
    m["optim/skipped_steps"] = skipped
    m["optim/lr"] = policy.optimizer.param_groups[0]["lr"]

    # ---- weight sync to the engine
    with timed(m, "weight_sync"):
        ctx.policy_version += 1
        sync_weights(policy, ctx.engine, ctx.policy_version)

    # ---- rollout statistics
    resp_len = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float32)
    m["rollout/reward_mean"] = float(rewards_t.mean())
    m["rollout/accuracy"] = float((rewards_t >= 1.0).float().mean())
    m["rollout/response_length"] = float(resp_len.mean())
    m["rollout/truncated_fraction"] = sum(s.finish_reason == "length" for s in samples) / len(samples)
    m["rollout/zero_variance_groups"] = float(zero_var.float().mean())
    m["rollout/advantage_abs_mean"] = float(adv.abs().mean())
    for k, v in (reward_stats or {}).items():
        m[k] = float(v)
    if ctx.engine is not None and hasattr(ctx.engine, "stats"):  # rank 0: restarts, retries, probe diff
        m.update({k: float(v) for k, v in ctx.engine.stats().items()})
    m["timing/step"] = time.perf_counter() - t_step
    return m


def _global_ess(policy, groups, local, slices, settings, old, wrap=None) -> torch.Tensor:
    """P3O: ESS of r = π_θ/π_old over the mini-batch's valid tokens on all ranks (no-grad pass)."""
    rows = slice(slices[0].start, slices[-1].stop)
    sub = local.select(rows)
    logprobs, _ = logprob_pass(policy.model, groups, sub, settings, need_entropy=False, wrap_step=wrap)
    return global_ess(logprobs, old[rows], sub.loss_mask, groups)


def global_ess(logprobs: torch.Tensor | None, old: torch.Tensor, mask: torch.Tensor, groups) -> torch.Tensor:
    """ESS of r = exp(logprobs − old) over the valid tokens of every DP×CP rank ([N, L] local
    tensors; logprobs None off the last pipeline stage, which contributes nothing)."""
    zero = torch.zeros((), dtype=torch.float64)
    stats = {"sum_r": zero, "sum_mask": zero, "sum_r2": zero}
    if logprobs is not None:
        stats = dict(zip(stats, p3o_ess_stats(logprobs, old, mask), strict=True))
    stats = all_reduce_dp(stats, groups)
    return ess_from_stats(stats["sum_r"], stats["sum_mask"], stats["sum_r2"])
