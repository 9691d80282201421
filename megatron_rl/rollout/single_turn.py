"""`single_turn`, the default rollout function: one prompt, n sampled responses, one reward each.

    prompt text -> tokenizer.encode_prompt -> engine.generate(n) -> decode each response -> reward

The reward of a sample is its task's reward function on (prompt, decoded response, label, task)
(rewards/runner.py: a failing reward scores 0 and is counted). Every response token was sampled:
the samples carry no loss_mask.
"""
from __future__ import annotations

from collections.abc import Sequence

from megatron_rl.rollout.engine import RolloutEngine
from megatron_rl.rollout.function import Generated, RolloutFnInputs, RolloutFnSpec
from megatron_rl.rollout.types import Sample, SamplingParams


class SingleTurn:
    def __init__(self, inputs: RolloutFnInputs):
        self.tokenizer, self.rewards = inputs.tokenizer, inputs.rewards

    def __call__(self, engine: RolloutEngine, examples: Sequence, n: int, sampling: SamplingParams) -> Generated:
        prompts = [self.tokenizer.encode_prompt(e.prompt) for e in examples]
        samples = [s for group in engine.generate(prompts, n=n, sampling=sampling) for s in group]
        return Generated(samples, lambda: self.score(examples, samples, n))

    def score(self, examples: Sequence, samples: list[Sample], n: int) -> list[float]:
        """The reward of every sample (sample k answers example k // n)."""
        responses = [self.tokenizer.decode(s.response_ids.tolist()) for s in samples]
        return self.rewards([(examples[i // n].prompt, responses[i], examples[i // n].label, examples[i // n].task)
                             for i in range(len(samples))])


SINGLE_TURN = RolloutFnSpec(make=SingleTurn)
