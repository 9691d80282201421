"""Schedule bookkeeping with a fake engine (an orchestration test: which weights version every
sample was generated with, when weights are synced, the staleness bound), in one gloo rank.

The fake engine's generate() can be held until the test releases it, so the background
generation of the async schedule finishes either before or after the trainer's update; the
versions must not depend on it, and the engine's weights must never change mid-generation.
"""
import threading
from types import SimpleNamespace

import pytest
import torch

from tests.spawn import run_ranks


class FakeEngine:
    """Samples tagged with the engine's weights version. hold: a background (non-main thread)
    generate() waits until `release` is set."""

    def __init__(self, hold: bool):
        self.policy_version = -1
        self.generating = 0
        self.calls = []  # the weights version of every generate()
        self.release = threading.Event()
        if not hold:
            self.release.set()

    def generate(self, prompts, n, sampling):
        from megatron_rl.rollout.types import Sample

        self.generating += 1
        try:
            if threading.current_thread() is not threading.main_thread():
                self.release.wait()
            self.calls.append(self.policy_version)
            return [[Sample(prompt_ids=torch.tensor(p), response_ids=torch.tensor([5, 1]),
                            rollout_logprobs=torch.tensor([-0.5, -0.1]), finish_reason="stop",
                            policy_version=self.policy_version, prompt_index=i, sample_index=j)
                     for j in range(n)] for i, p in enumerate(prompts)]
        finally:
            self.generating -= 1

    def update_weights(self, named, version):
        assert self.generating == 0, "weights written while the engine samples"
        list(named)
        self.policy_version = version


def _schedule(overrides, hold):
    """The run's schedule over the real batch maker (prompts, the single-turn rollout function) and
    the memory transport, with the fake engine; no model (the policy exports nothing)."""
    from megatron_rl.configure import load_config
    from megatron_rl.data import CharTokenizer, PromptStream, make_task
    from megatron_rl.rewards import RewardRunner
    from megatron_rl.rollout import RolloutFnInputs
    from megatron_rl.rollout.single_turn import SingleTurn
    from megatron_rl.trainer.rollouts import Batches, EngineWeights
    from megatron_rl.trainer.schedule import SCHEDULES, ScheduleInputs
    from megatron_rl.trainer.transport import MemoryTransport

    cfg = load_config(None, ["rollout.prompts_per_step=2", "rollout.group_size=2", "train.micro_batch_size=2",
                             "train.num_minibatches=1", "data.tasks=[sorting]", *overrides])
    tokenizer, rewards, engine = CharTokenizer(), RewardRunner("exact_match"), FakeEngine(hold)
    batches = Batches(cfg, PromptStream([make_task("sorting")], seed=0), tokenizer,
                      SingleTurn(RolloutFnInputs(tokenizer, rewards)), rewards, engine)
    weights = EngineWeights(SimpleNamespace(export=lambda to="all": iter(())), MemoryTransport(None), engine)
    engine.update_weights([], 0)  # the run's initial sync
    return cfg, engine, SCHEDULES.get(cfg.train.schedule).make(ScheduleInputs(cfg.train, batches, weights))


def _drive(rank, world, overrides, hold):
    """Run the schedule through train.steps steps as rl_step does; return per step (staleness of
    its samples, the trainer version) and the engine's generate() versions."""
    cfg, engine, schedule = _schedule(overrides, hold)
    seen, version = [], 0
    for step in range(cfg.train.steps):
        rollout = schedule.rollout(step, version)
        versions = {s.policy_version for s in rollout.samples}
        assert len(rollout.samples) == 4 and len(versions) == 1
        seen.append(version - versions.pop())
        if hold:  # the background generation is still held: the update "runs" first, then it finishes
            engine.release.set()
        else:  # the background generation finishes before the update
            schedule.wait()
        version = schedule.after_update(version)
        assert version == step + 1  # the schedule returns the trainer's new version
        if hold:
            engine.release.clear()
    schedule.close()
    return seen, engine.calls, schedule.stats()


@pytest.mark.parametrize("hold", [False, True], ids=["generation-first", "update-first"])
@pytest.mark.parametrize("overrides,staleness,versions,syncs", [
    (["train.steps=4"], [0, 0, 0, 0], [0, 1, 2, 3], 4),
    (["train.steps=6", "train.schedule=staged", "train.stages=2"], [0, 1, 2, 0, 1, 2], [0, 3], 1),
    (["train.steps=5", "train.schedule=async", "train.max_staleness=1"], [0, 1, 1, 1, 1], [0, 0, 1, 2, 3], 5),
    (["train.steps=5", "train.schedule=async", "train.max_staleness=2"], [0, 1, 2, 2, 2], [0, 0, 1, 2], 5),
], ids=["sync", "staged2", "async1", "async2"])
def test_versions_staleness_and_syncs(overrides, staleness, versions, syncs, hold):
    [(seen, calls, stats)] = run_ranks(_drive, world_size=1, timeout=120, overrides=overrides, hold=hold)
    assert seen == staleness
    assert calls == versions  # the weights version of every engine call, in order
    assert stats["schedule/weight_syncs"] == syncs and stats["schedule/generate_calls"] == len(versions)
    bound = max(staleness)
    assert all(0 <= s <= bound for s in seen)
