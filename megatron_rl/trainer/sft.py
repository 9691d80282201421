"""Supervised warm start: teacher-forced NLL of the label (+ eos) on fresh task problems, or of the
policy's turns of a demonstrated trajectory (the rollout function's `supervised` samples).

RL from a random policy sees reward 0 everywhere (no group has mixed rewards, so no signal).
A short SFT phase on the same megatron stack brings held-out accuracy to a few tens of percent,
then stops (`target_accuracy`) so that RL has room to show what it adds.
"""
from __future__ import annotations

import signal
import sys
import time

import torch
import torch.distributed as dist

from megatron_rl.losses import token_mean
from megatron_rl.losses.token_local import NllTerms
from megatron_rl.rollout.function import ROLLOUT_FNS, RolloutFnInputs
from megatron_rl.trainer.batch import local_shard, pack
from megatron_rl.trainer.evaluation import accuracy, eval_sampling
from megatron_rl.trainer.nonfinite import agreed_finite, check_parameters, count_in_a_row, guarded_step
from megatron_rl.trainer.passes import (
    LossFn,
    PassSettings,
    TokenLocalLoss,
    global_counts,
    reduce_dp,
    train_pass,
)
from megatron_rl.trainer.stop import Stopped


def sft_loss(n_tok: torch.Tensor, in_forward: bool) -> LossFn | TokenLocalLoss:
    """The warm start's loss `token_mean(−log π, m, N)`, N = `n_tok` the global count of label
    tokens. in_forward (loss.head_gradients auto or forward: this loss is token-local): a
    TokenLocalLoss, whose output-layer gradients the log-prob kernel forms in its forward."""
    def values(mb, logprobs, _entropy):
        loss = token_mean(-logprobs, mb["loss_mask"], n_tok)
        return loss, {"nll/sum": loss.detach().double()}

    if not in_forward:
        return values
    # a zero count divides by 1 (loss 0), as token_mean does
    return TokenLocalLoss(lambda mb: NllTerms(mb["loss_mask"].float() / n_tok.float().clamp_min(1)), values)


# what a SIGTERM or Ctrl-C during SFT does (the notice it prints): the warm start is saved only
# once it ends, so a stop part-way keeps nothing
SFT_STOP = ("stopping after the current SFT step, without saving (the SFT warm start is saved only when it ends: "
            "a rerun starts it over)")


def run_sft(ctx, eval_examples, progress=None) -> dict:
    """Train until sft.steps or held-out greedy accuracy >= sft.target_accuracy. Returns a summary.

    Uses ctx.policy.optimizer at lr = sft.lr; the caller rebuilds the optimizer for RL. The stopping
    checks score the first sft.eval_size of `eval_examples` (all of them when it is null, or when it
    exceeds their number: the run's held-out set of train.eval_size problems caps it). A stop
    signal meanwhile says it saves nothing (SFT_STOP), and raises Stopped after the step.
    """
    with ctx.stop.while_(SFT_STOP):
        return _sft_steps(ctx, eval_examples, progress)


def _sft_steps(ctx, eval_examples, progress) -> dict:
    cfg, groups, policy = ctx.cfg, ctx.groups, ctx.policy
    sft = cfg.sft
    eval_examples = eval_examples[: sft.eval_size]
    for group in policy.optimizer.param_groups:
        group["lr"] = sft.lr
    layout = cfg.sft_layout(groups.dp_size)
    [slices] = layout.minibatch_slices()
    settings = PassSettings(micro_batch_size=layout.micro_batch_size)
    supervised = ROLLOUT_FNS.get(cfg.rollout.function).supervised  # label + eos, or a whole trajectory
    history, acc, t0 = [], 0.0, time.perf_counter()
    step, in_a_row = 0, 0
    for step in range(1, sft.steps + 1):
        examples = ctx.prompts.batch(10_000_000 + step, sft.batch_size)  # disjoint from RL steps' draws
        samples = supervised(RolloutFnInputs(ctx.tokenizer, ctx.rewards, cfg.env), examples)
        _, local = local_shard(pack(samples, [0.0] * len(samples), ctx.tokenizer.pad_id, groups.config), layout,
                               groups)
        n_tok = global_counts(local, slices, groups).num_tokens
        loss_fn = sft_loss(n_tok, in_forward=cfg.loss.head_gradients != "recompute")
        outs = train_pass(policy.model, policy.optimizer, groups, local, slices, settings, loss_fn)
        # as the RL updates (trainer/phases.update): a non-finite loss or gradient norm is skipped
        outcome = guarded_step(policy.optimizer, agreed_finite(o["nll/sum"] for o in outs))
        in_a_row = count_in_a_row(in_a_row, outcome, cfg.train.max_nonfinite_updates, f"SFT step {step}")
        if outcome.applied:
            check_parameters(policy.model, f"the optimizer update of SFT step {step}",
                             f"The update itself wrote them: check sft.lr={sft.lr:g}")
        elif outcome.nonfinite is not None and dist.get_rank() == 0:
            print(f"warning: SFT step {step} skipped: its {outcome.nonfinite} was not finite", file=sys.stderr,
                  flush=True)
        nll = reduce_dp({"nll/sum": sum(o["nll/sum"] for o in outs) if outs else torch.zeros(())}, groups)["nll/sum"]
        if progress is not None:
            progress.update(1)
            progress.set_postfix(nll=f"{float(nll):.3f}", acc=f"{acc:.2f}")
        ctx.sink.log(step, {"sft/nll": float(nll)}, phase="sft")
        if ctx.stop.agreed(nll.device):
            raise Stopped(ctx.stop.signum, f"stopped by {signal.Signals(ctx.stop.signum).name} during the SFT warm "
                                           f"start (step {step} of {sft.steps}); nothing was saved: rerun to start over")
        if step == sft.steps or (sft.eval_every and step % sft.eval_every == 0):  # 0: only at the end
            ctx.transport.push(policy, ctx.engine, ctx.policy_version)
            acc = accuracy(ctx.rollout_fn, ctx.engine, eval_examples, eval_sampling(ctx.tokenizer,
                                                                                   cfg.rollout.max_tokens))
            history.append((step, acc))
            ctx.sink.log(step, {"sft/heldout_accuracy": acc}, phase="sft",
                         echo=f"SFT step {step}" if progress is None else None)
            if sft.target_accuracy is not None and acc >= sft.target_accuracy:
                break
    return {"steps": step, "heldout_accuracy": acc, "history": history, "seconds": time.perf_counter() - t0}
