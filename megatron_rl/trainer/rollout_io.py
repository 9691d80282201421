"""Talking to the rollout engine from a multi-rank trainer.

The engine lives on global rank 0 (one embedded engine or one vLLM server, as in production);
rank 0 generates and scores, then broadcasts the samples to every rank. Weight export is
collective (all ranks iterate it); only rank 0 feeds the engine.
"""
from __future__ import annotations

import torch.distributed as dist

from megatron_rl.rollout.types import Sample, SamplingParams


def broadcast(obj, src: int = 0):
    """Pickle-broadcast a Python object from `src` to all ranks."""
    if dist.get_world_size() == 1:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def sync_weights(policy, engine, version: int) -> None:
    """Push the policy's current weights to the engine (collective export; rank 0 loads)."""
    named = policy.export()
    if engine is not None:
        engine.update_weights(named, version)
    else:
        for _ in named:  # keep step with rank 0's gathers
            pass


def generate_and_score(engine, tokenizer, examples, n: int, sampling: SamplingParams, reward_runner):
    """Rank 0: n samples per example and their rewards. Returns (samples flat [B*n], rewards [B*n]);
    groups are contiguous (sample j of prompt i at index i*n + j). The reward runner counts its
    failures itself (`reward_runner.stats()`)."""
    prompts = [tokenizer.encode(e.prompt) for e in examples]
    groups = engine.generate(prompts, n=n, sampling=sampling)
    samples: list[Sample] = [s for g in groups for s in g]
    responses = [tokenizer.decode(s.response_ids.tolist()) for s in samples]
    items = [(examples[i // n].prompt, responses[i], examples[i // n].label, examples[i // n].task)
             for i in range(len(samples))]
    rewards = reward_runner(items)
    return samples, rewards


def evaluate(engine, tokenizer, examples, reward_runner, max_tokens: int, temperature: float = 0.0,
             seed: int = 0) -> float:
    """Rank 0: held-out accuracy (mean reward) of the engine's current weights, greedy by default
    or sampled at `temperature` (one sample per problem); other ranks get it by broadcast."""
    acc = None
    if engine is not None:
        sampling = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed,
                                  stop_token_ids=(tokenizer.eos_id,))
        _, rewards = generate_and_score(engine, tokenizer, examples, 1, sampling, reward_runner)
        acc = sum(rewards) / max(len(rewards), 1)
    return broadcast(acc)
