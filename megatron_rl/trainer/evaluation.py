"""Held-out evaluation: the accuracy (mean reward) of the engine's current weights on the run's
held-out problems, through the run's rollout function, so an agent loop is evaluated as it trains.

    examples = heldout_examples(ctx)            # the first train.eval_size held-out problems
    metrics = evaluate_both(ctx, examples)      # eval/heldout_accuracy (greedy), .../sampled_accuracy

Rank 0 generates and scores; every rank gets the value (rollout_io.on_rank0). Cost: one engine
call of len(examples) prompts per evaluation, one sample each.
"""
from __future__ import annotations

from megatron_rl.rollout.types import SamplingParams
from megatron_rl.trainer.rollout_io import on_rank0


def accuracy(rollout_fn, engine, examples, sampling: SamplingParams) -> float:
    """Mean reward of one sample per example under `sampling` (rank 0 runs it; all ranks get it)."""

    def run():
        rewards = rollout_fn(engine, examples, 1, sampling).score()
        return sum(rewards) / max(len(rewards), 1)

    return on_rank0("during an evaluation", run)


def eval_sampling(tokenizer, max_tokens: int, temperature: float = 0.0, seed: int = 0) -> SamplingParams:
    """Greedy by default (temperature 0); one sample per problem."""
    return SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed, stop_token_ids=tokenizer.stop_ids)


def heldout_examples(ctx) -> list:
    """The first train.eval_size problems of the prompt source's held-out split (none for JSONL)."""
    return ctx.prompts.heldout()[: ctx.cfg.train.eval_size]


def evaluate_both(ctx, examples) -> dict[str, float]:
    """Greedy and sampled (rollout temperature, the run's seed) held-out accuracy."""
    cfg = ctx.cfg
    greedy = eval_sampling(ctx.tokenizer, cfg.rollout.max_tokens)
    sampled = eval_sampling(ctx.tokenizer, cfg.rollout.max_tokens, cfg.rollout.temperature, cfg.train.seed)
    return {"eval/heldout_accuracy": accuracy(ctx.rollout_fn, ctx.engine, examples, greedy),
            "eval/heldout_sampled_accuracy": accuracy(ctx.rollout_fn, ctx.engine, examples, sampled)}
