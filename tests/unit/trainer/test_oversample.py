"""DAPO over-sampling: the pure selection and round sizes against hand-built cases, and
`Batches.score`'s rounds over a scripted rollout function (a fake for orchestration: the real
engine's run is tests/distributed/test_oversample_run.py)."""
import pytest
import torch

from megatron_rl.data.types import Example
from megatron_rl.rollout.function import Generated
from megatron_rl.rollout.types import Sample
from megatron_rl.trainer.oversample import GroupPool, fill, round_size, select_groups

# ---------------------------------------------------------------------------------- pure parts


def test_select_groups_keeps_the_first_with_variance_in_draw_order():
    flags = [False, True, False, True, True, False, True]
    assert select_groups(flags, 3) == [1, 3, 4]
    assert select_groups(flags, 4) == [1, 3, 4, 6]
    # only 4 with variance: all of them, then the first zero-variance ones, in draw order
    assert select_groups(flags, 6) == [0, 1, 2, 3, 4, 6]
    assert select_groups([False, False], 2) == [0, 1]
    assert select_groups([True], 3) == [0]  # fewer drawn than wanted: what there is


@pytest.mark.parametrize("missing,drawn,kept,left,expected", [
    (0, 4, 4, 10, 0),    # full: stop
    (2, 4, 1, 0, 0),     # budget spent: stop
    (2, 4, 1, 100, 8),   # keep rate 1/4: 2 more groups need ceil(2 * 4 / 1) = 8 prompts
    (1, 4, 3, 100, 2),   # ceil(1 * 4 / 3) = 2
    (2, 4, 1, 5, 5),     # capped by the budget left
    (3, 4, 0, 100, 4),   # nothing kept yet: as many again as drawn
    (3, 2, 0, 100, 3),   # ... but never fewer than are missing
])
def test_round_size(missing, drawn, kept, left, expected):
    assert round_size(missing, drawn, kept, left) == expected


def _sample(tag: int) -> Sample:
    return Sample(prompt_ids=torch.tensor([tag]), response_ids=torch.tensor([1]), rollout_logprobs=torch.zeros(1),
                  finish_reason="stop", policy_version=0)


def test_group_pool_takes_the_wanted_groups_and_counts():
    pool = GroupPool(wanted=2, group_size=2)
    # groups: [1, 1] [0, 1] [0, 0] [1, 0] [0.5, 0.5]  -> variance: F T F T F
    rewards = [1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.5, 0.5]
    pool.add([_sample(i) for i in range(4)], rewards[:4])
    assert (pool.drawn, pool.kept(), pool.missing()) == (2, 1, 1)
    pool.add([_sample(i) for i in range(4, 10)], rewards[4:])
    pool.rounds = 1
    samples, kept_rewards, stats = pool.take()
    assert [int(s.prompt_ids[0]) for s in samples] == [2, 3, 6, 7]  # groups 1 and 3, samples in order
    assert kept_rewards == [0.0, 1.0, 1.0, 0.0]
    assert stats == {"rollout/groups_generated": 5.0, "rollout/groups_dropped": 3.0, "rollout/groups_padded": 0.0,
                     "rollout/oversample_rounds": 1.0}
    with pytest.raises(ValueError, match="not whole groups of 2"):
        pool.add([_sample(0)], [1.0])


def test_group_pool_pads_with_zero_variance_groups_when_short():
    pool = GroupPool(wanted=3, group_size=2)
    pool.add([_sample(i) for i in range(8)], [1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0])  # F T F F
    samples, rewards, stats = pool.take()
    assert [int(s.prompt_ids[0]) for s in samples[::2]] == [0, 2, 4]  # group 1, padded by groups 0 and 2
    assert rewards == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    assert stats["rollout/groups_padded"] == 2.0 and stats["rollout/groups_dropped"] == 1.0


def test_fill_asks_once_per_round_for_every_short_step():
    """Step 0 is full from the start; step 1 (keep rate 1/2) gets ceil(1 * 2 / 1) = 2 prompts in
    round 1, both without variance, then min(ceil(1 * 4 / 1), 5 - 4) = 1 in round 2: the bound."""
    pools = {0: GroupPool(2, 2), 1: GroupPool(2, 2)}
    pools[0].add([_sample(0)] * 4, [0.0, 1.0, 1.0, 0.0])
    pools[1].add([_sample(1)] * 4, [0.0, 1.0, 1.0, 1.0])
    asked = []

    def draw(round_, sizes):
        asked.append((round_, dict(sizes)))
        n = 2 * sum(sizes.values())
        return [_sample(9)] * n, [1.0] * n

    fill(pools, 5, draw)
    assert asked == [(1, {1: 2}), (2, {1: 1})]
    assert (pools[0].drawn, pools[0].rounds, pools[1].drawn, pools[1].rounds) == (2, 0, 5, 2)
    assert pools[1].take()[2]["rollout/groups_padded"] == 1.0


# ---------------------------------------------------------------------- Batches over a fake engine

REWARDS = {"mixed": [0.0, 1.0], "same": [1.0, 1.0], "none": [0.0, 0.0]}


class Prompts:
    """batch: the step's labels; reserve: a scripted reserve stream per step (label = its reward kind)."""

    def __init__(self, batches: dict, reserves: dict):
        self.batches, self.reserves, self.reserve_calls = batches, reserves, []

    def batch(self, step, size):
        return [Example(f"b{step}.{i}", kind, "t") for i, kind in enumerate(self.batches[step][:size])]

    def reserve(self, step, start, count):
        self.reserve_calls.append((step, start, count))
        return [Example(f"r{step}.{i}", self.reserves[step][i], "t") for i in range(start, start + count)]


class Engine:
    """A scripted rollout function: every sample's prompt_ids holds its prompt's name's index; each
    call is recorded with its prompts and seed."""

    def __init__(self):
        self.names, self.calls = [], []

    def __call__(self, engine, examples, n, sampling):
        assert n == 2
        self.calls.append(([e.prompt for e in examples], sampling.seed))
        samples, rewards = [], []
        for e in examples:
            self.names.append(e.prompt)
            samples += [_sample(len(self.names) - 1) for _ in range(n)]
            rewards += REWARDS[e.label]
        return Generated(samples, lambda: rewards, {"env/failures": float(len(self.calls))})


class Tokenizer:
    stop_ids = (0,)


class Runner:
    def stats(self):
        return {"rewards/count": 0}


def _batches(prompts, max_oversample=3.0, oversample=True):
    from megatron_rl.configure import load_config
    from megatron_rl.trainer.rollouts import Batches

    over = [f"rollout.max_oversample={max_oversample}"] if oversample else []
    cfg = load_config(None, ["rollout.prompts_per_step=2", "rollout.group_size=2", f"rollout.oversample={oversample}",
                             "loss.filter_zero_variance_groups=true"] + over)
    engine = Engine()
    return Batches(cfg, prompts, Tokenizer(), engine, Runner(), None), engine


def _trained(engine, rollout):
    return [engine.names[int(s.prompt_ids[0])] for s in rollout.samples[::2]]


def test_batches_draw_reserve_rounds_until_the_step_is_full():
    # budget floor(3 * 2) = 6 prompts. Batch: 1 of 2 groups has variance. Round 1: keep rate 1/2
    # asks ceil(1 * 2 / 1) = 2 reserve prompts, both "same"; round 2: min(ceil(1 * 4 / 1), 6 - 4) = 2
    prompts = Prompts({0: ["same", "mixed"]}, {0: ["same", "same", "none", "mixed", "mixed"]})
    batches, engine = _batches(prompts)
    (rollout,) = batches.score(batches.sample([0])).values()
    assert prompts.reserve_calls == [(0, 0, 2), (0, 2, 2)]
    assert _trained(engine, rollout) == ["b0.1", "r0.3"]  # the first two with variance, in draw order
    assert rollout.rewards.tolist() == [0.0, 1.0, 0.0, 1.0]
    assert {k: rollout.reward_stats[k] for k in ("rollout/groups_generated", "rollout/groups_dropped",
                                                  "rollout/groups_padded", "rollout/oversample_rounds")} == \
        {"rollout/groups_generated": 6.0, "rollout/groups_dropped": 4.0, "rollout/groups_padded": 0.0,
         "rollout/oversample_rounds": 2.0}
    assert rollout.reward_stats["env/failures"] == 1.0  # the rollout function's stats: the first call's
    seeds = [seed for _, seed in engine.calls]
    assert len(set(seeds)) == 3  # every round samples from streams of its own


def test_every_over_sampling_round_prints_a_line(capsys):
    prompts = Prompts({0: ["same", "mixed"]}, {0: ["same", "same", "none", "mixed", "mixed"]})
    batches, _ = _batches(prompts)
    batches.score(batches.sample([0]))
    lines = [line for line in capsys.readouterr().out.splitlines() if "over-sampling" in line]
    line = "step 1: over-sampling round {}: 2 more prompts (1 of 2 groups with reward variance, {} of at most 6 prompts drawn)"
    assert lines == [line.format(1, 2), line.format(2, 4)]


def test_batches_stop_at_the_bound_and_pad(caplog):
    prompts = Prompts({0: ["same", "none"]}, {0: ["none"] * 10})
    batches, engine = _batches(prompts, max_oversample=2.5)  # floor(2.5 * 2) = 5 prompts at most
    with caplog.at_level("WARNING"):
        (rollout,) = batches.score(batches.sample([0])).values()
    assert prompts.reserve_calls == [(0, 0, 2), (0, 2, 1)]  # 2 (none kept: as many again), then the last 1
    assert _trained(engine, rollout) == ["b0.0", "b0.1"]  # no variance anywhere: the first two, masked
    assert rollout.reward_stats["rollout/groups_generated"] == 5.0
    assert rollout.reward_stats["rollout/groups_padded"] == 2.0
    assert "rollout.max_oversample=2.5 reached after 5 prompts with 0 of 2 groups" in caplog.text


def test_batches_fill_several_steps_in_shared_rounds():
    """A staged schedule's call holds several steps: each step keeps its own groups and counts, and
    a round asks the engine once for every step still short."""
    prompts = Prompts({0: ["mixed", "mixed"], 1: ["none", "mixed"]}, {0: [], 1: ["mixed"] * 4})
    batches, engine = _batches(prompts)
    out = batches.score(batches.sample([0, 1]))
    assert prompts.reserve_calls == [(1, 0, 2)] and len(engine.calls) == 2
    assert _trained(engine, out[0]) == ["b0.0", "b0.1"] and _trained(engine, out[1]) == ["b1.1", "r1.0"]
    assert out[0].reward_stats["rollout/oversample_rounds"] == 0.0 and "rewards/count" in out[0].reward_stats
    assert out[1].reward_stats["rollout/oversample_rounds"] == 1.0 and "rewards/count" not in out[1].reward_stats


def test_batches_without_oversampling_are_unchanged():
    prompts = Prompts({0: ["none", "none"]}, {})
    batches, engine = _batches(prompts, oversample=False)
    (rollout,) = batches.score(batches.sample([0])).values()
    assert _trained(engine, rollout) == ["b0.0", "b0.1"] and prompts.reserve_calls == []
    assert "rollout/groups_generated" not in rollout.reward_stats
