"""`single_turn`, the default rollout function: one prompt, n sampled responses, one reward each.

    prompt text -> tokenizer.encode_prompt -> n samples -> decode each response -> reward

The reward of a sample is its task's reward function on (prompt, decoded response, label, task)
(rewards/runner.py: a failing reward scores 0 and is counted). Every response token was sampled:
the samples carry no loss_mask.

A group (one example, its n samples) is the unit of work. How its samples are drawn depends on
the engine:

    an engine whose requests are coroutines (engine.py `SamplesEach`: the vLLM engine): each group
        is a coroutine of n requests, `engine.sample(Request(prompt, sampling, (i, j)))` for sample
        j of example i; all groups run at once, bounded by the engine's own per-server concurrency
        (rollout/serving/generation.py: rollout.vllm.max_concurrency). A group is done as soon as its
        n answers are, whatever the other groups still run; called on the main thread, it is scored
        then (`score_group`), while the other groups' requests run on; unless the reward batches
        (RewardRunner.batches: a judge), which scores every sample of the call in one call after.
    any other engine (the embedded one batches itself): one `engine.generate(prompts, n)` call.

Either way request (i, j) draws from stream (i, j) of the call's seed (rollout/types.py
`stream_seed`, the derivation generate() uses too), so the samples are bit-identical on both paths
for a given seed, and the returned samples are in draw order: sample k answers example k // n.

Where the rewards run: in the calling thread. Called on the main thread (the sync schedule,
evaluation, the over-sampling of trainer/rollouts.py), a group is scored when its samples are back,
on the coordinating event loop; the requests themselves run on the engine's own loop (another
thread), so a reward that blocks delays only the scoring of the next groups, never a request in
flight, and the `math` reward keeps its SIGALRM bound (rewards/math_verify_reward.py). Called from
another thread (the async schedule's background generation), scoring waits for `Generated.score()`
on the main thread, as the Generated contract says (rollout/function.py).

Cost: one coroutine and one future per request in flight (B·n at most, no thread per request); the
samples of the call on the host; the rewards are one reward call per group (per call with
generate() or a reward that batches). A group waits only for its own n answers.
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

from megatron_rl.rollout.engine import RolloutEngine, SamplesEach
from megatron_rl.rollout.function import Generated, RolloutFnInputs, RolloutFnSpec
from megatron_rl.rollout.types import Request, Sample, SamplingParams


class SingleTurn:
    def __init__(self, inputs: RolloutFnInputs):
        self.tokenizer, self.rewards = inputs.tokenizer, inputs.rewards

    def __call__(self, engine: RolloutEngine, examples: Sequence, n: int, sampling: SamplingParams) -> Generated:
        if not isinstance(engine, SamplesEach):
            prompts = [self.tokenizer.encode_prompt(e.prompt) for e in examples]
            samples = [s for group in engine.generate(prompts, n=n, sampling=sampling) for s in group]
            return Generated(samples, lambda: self.score(examples, samples, n))
        # a reward that batches (a judge) gets the whole call at once: scored per group, it would
        # see n items per call, too few to fill its concurrent requests
        batches = bool(getattr(self.rewards, "batches", False))
        score_now = threading.current_thread() is threading.main_thread() and not batches
        groups = _run(self._groups(engine, examples, n, sampling, score_now))
        samples = [s for group, _ in groups for s in group]
        if not score_now:
            return Generated(samples, lambda: self.score(examples, samples, n))
        rewards = [r for _, group_rewards in groups for r in group_rewards]
        return Generated(samples, lambda: rewards)

    async def _groups(self, engine: SamplesEach, examples: Sequence, n: int, sampling: SamplingParams,
                      score: bool) -> list[tuple[list[Sample], list[float] | None]]:
        """Every group at once, in example order; each scored as it completes when `score`."""
        async def one(i: int, example):
            samples = await self.group(engine, self.tokenizer.encode_prompt(example.prompt), i, n, sampling)
            return samples, (self.score_group(example, samples) if score else None)

        async with asyncio.TaskGroup() as tasks:
            running = [tasks.create_task(one(i, e)) for i, e in enumerate(examples)]
        return [t.result() for t in running]

    async def group(self, engine: SamplesEach, prompt_ids: list[int], index: int, n: int,
                    sampling: SamplingParams) -> list[Sample]:
        """The n samples of one prompt, example `index` of its call (streams (index, j)), each request
        a coroutine of its own; returns once all n answered. An error in one request cancels the
        others (and is raised)."""
        async with asyncio.TaskGroup() as tasks:
            running = [tasks.create_task(engine.sample(Request(tuple(prompt_ids), sampling, (index, j))))
                       for j in range(n)]
        return [t.result() for t in running]

    def score_group(self, example, samples: list[Sample]) -> list[float]:
        """The rewards of one example's samples, in the calling thread (blocks it while they run)."""
        return self.score([example], samples, len(samples))

    def score(self, examples: Sequence, samples: list[Sample], n: int) -> list[float]:
        """The reward of every sample (sample k answers example k // n)."""
        responses = [self.tokenizer.decode(s.response_ids.tolist()) for s in samples]
        return self.rewards([(examples[i // n].prompt, responses[i], examples[i // n].label, examples[i // n].task)
                             for i in range(len(samples))])


def _run(coroutine):
    """Run `coroutine` on a loop of its own; an error of one of its task groups is raised as itself
    (the first, as multi_turn does: an engine error reaches every request it left unfinished)."""
    try:
        return asyncio.run(coroutine)
    except BaseExceptionGroup as group:
        first = group.exceptions[0]
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None


SINGLE_TURN = RolloutFnSpec(make=SingleTurn)
