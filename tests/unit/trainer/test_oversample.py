"""DAPO over-sampling: the pure selection and round sizes against hand-built cases, and
`Batches.score`'s rounds over a scripted rollout function (a fake for orchestration: the real
engine's run is tests/distributed/test_oversample_run.py)."""
import asyncio
import random

import pytest
import torch

from megatron_rl.data.types import Example
from megatron_rl.rollout.function import Generated
from megatron_rl.rollout.types import Sample
from megatron_rl.trainer.oversample import (
    GroupPool,
    fill,
    fill_overlapped,
    has_variance,
    round_size,
    select_groups,
    settled,
    to_launch,
)
from tests.unit.rollout.multi_turn_fakes import TOK, ScriptedEngine

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


# ------------------------------------------------------------------------- overlapped extra groups


def test_has_variance():
    assert has_variance([0.0, 1.0]) and has_variance([0.5, 0.5, 0.25])
    assert not has_variance([1.0, 1.0]) and not has_variance([0.0])


@pytest.mark.parametrize("flags,wanted,expected", [
    ([True, False, True], 2, 3),
    ([True, True, None], 2, 2),          # what runs after the second with variance does not matter
    ([True, None, True, True], 2, None),  # the running group could be the second with variance
    ([False, False], 1, None),
    ([], 1, None),
    ([False, True], 1, 2),
])
def test_settled_is_the_shortest_scored_prefix_holding_the_wanted(flags, wanted, expected):
    assert settled(flags, wanted) == expected


@pytest.mark.parametrize("flags,wanted,budget,expected", [
    ([True, False], 2, 6, 2),               # round_size(1, 2, 1, 4) = 2, none in flight
    ([True, False, None], 2, 6, 1),          # ... one of them already running
    ([True, False, None, None, None], 2, 6, 0),
    ([False, False], 2, 10, 2),              # none kept: as many again as scored
    ([True, False, True, None], 2, 6, 0),    # none missing among the scored: wait for the running one
    ([False, False, False], 2, 4, 1),         # the budget of groups caps it
    ([False, False, None, None], 2, 4, 0),    # ... counting those in flight
])
def test_to_launch(flags, wanted, budget, expected):
    assert to_launch(flags, wanted, budget) == expected


def _flags_of(kinds):
    return [has_variance(REWARDS[k]) for k in kinds]


def _overlapped(batch, reserve, wanted, budget, pick):
    """fill_overlapped over scripted groups (reward kinds as REWARDS) that complete when the driver
    lets them: `pick(pending)` chooses which running group answers next. Returns the pool's take(),
    the reserve indices launched and fill_overlapped's result."""
    pool = GroupPool(wanted, 2)
    pool.add([_sample(i) for i in range(2 * len(batch))], [r for k in batch for r in REWARDS[k]])
    launched, pending = [], []

    async def group(step, r):
        launched.append(r)
        gate = asyncio.get_running_loop().create_future()
        pending.append((r, gate))
        await gate
        tag = 100 + r
        return [_sample(tag), _sample(tag)], list(REWARDS[reserve[r]])

    async def main():
        task = asyncio.ensure_future(fill_overlapped({0: pool}, budget, group))
        while not task.done():
            await asyncio.sleep(0)  # a pass of the loop (no timer): the launches run
            if pending:
                pending.pop(pick(len(pending)))[1].set_result(None)
        return task.result()

    discarded = asyncio.run(main())
    return pool.take(), launched, discarded


@pytest.mark.parametrize("batch,reserve,budget", [
    (["same", "mixed"], ["mixed", "mixed", "none", "mixed", "same", "mixed"], 6),
    (["same", "none"], ["none", "mixed", "same", "none", "mixed", "mixed", "mixed", "mixed"], 8),
    (["mixed", "mixed"], ["mixed"], 4),                        # full at once: nothing launched
    (["none", "same"], ["none"] * 6, 5),                        # the budget: pad
    (["none", "mixed"], ["same", "none", "none", "none", "mixed", "mixed"], 8),
])
def test_overlapped_selection_is_the_first_with_variance_in_draw_order_whatever_completes_first(batch, reserve, budget):
    rng = random.Random(0)
    orders = {"first launched first": lambda n: 0, "last launched first": lambda n: n - 1,
              "random": lambda n: rng.randrange(n)}
    flags = _flags_of(batch + reserve)[:budget]
    want = select_groups(flags, 2)  # the reference: every group of the budget scored, in draw order
    end = settled(flags, 2) or len(flags)  # groups the step needs scored
    for name, pick in orders.items():
        (samples, rewards, stats), launched, discarded = _overlapped(batch, reserve, 2, budget, pick)
        tags = [int(s.prompt_ids[0]) for s in samples[::2]]
        assert tags == [2 * g if g < len(batch) else 100 + g - len(batch) for g in want], name
        assert rewards == [r for g in want for r in REWARDS[(batch + reserve)[g]]], name
        assert stats["rollout/groups_generated"] == end, name
        assert stats["rollout/groups_padded"] == sum(not flags[g] for g in want), name
        assert len(launched) <= budget - len(batch), name  # never past the budget
        assert sorted(launched) == list(range(len(launched))), name  # reserve groups in draw order
        assert discarded == {0: len(batch) + len(launched) - max(end, len(batch))}, name


def test_an_error_in_a_group_cancels_the_others_and_is_raised():
    pool = GroupPool(2, 2)
    pool.add([_sample(0)] * 4, [1.0, 1.0, 0.0, 0.0])
    cancelled = []

    async def group(step, r):
        if r == 1:
            raise RuntimeError("server died")
        try:
            await asyncio.get_running_loop().create_future()  # never answers
        except asyncio.CancelledError:
            cancelled.append(r)
            raise

    with pytest.raises(RuntimeError, match="server died"):
        asyncio.run(fill_overlapped({0: pool}, 10, group))
    assert cancelled and 1 not in cancelled


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


def test_overlapped_steps_fill_apart():
    """Two steps of one call: the full one launches nothing, the short one draws its own reserve."""
    pools = {0: GroupPool(2, 2), 1: GroupPool(2, 2)}
    pools[0].add([_sample(0)] * 4, REWARDS["mixed"] * 2)
    pools[1].add([_sample(1)] * 4, REWARDS["none"] + REWARDS["mixed"])
    asked = []

    async def group(step, r):
        asked.append((step, r))
        return [_sample(10 + r)] * 2, list(REWARDS["mixed"])

    discarded = asyncio.run(fill_overlapped(pools, 6, group))
    assert asked == [(1, 0), (1, 1)]  # round_size(1, 2, 1, 4) = 2 at once; the first settles the step
    assert discarded == {0: 0, 1: 1}
    assert (pools[0].drawn, pools[1].drawn, pools[1].rounds) == (2, 3, 1)


class EachEngine(ScriptedEngine):
    """A scripted engine whose requests are coroutines (engine.py SamplesEach)."""

    async def sample(self, request):
        return self.generate_requests([request])[0]


class GroupRewards:
    """The reward of a sample: REWARDS of its example's label (single_turn scores a group at a time)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, items):
        self.calls += 1
        kinds = [label for _, _, label, _ in items]
        return [r for k in kinds[::2] for r in REWARDS[k]]

    def stats(self):
        return {"rewards/count": 0}


def test_batches_overlap_extra_groups_with_an_engine_whose_requests_are_coroutines(capsys):
    from megatron_rl.configure import load_config
    from megatron_rl.rollout.engine import SamplesEach
    from megatron_rl.rollout.function import RolloutFnInputs
    from megatron_rl.rollout.single_turn import SingleTurn
    from megatron_rl.trainer.rollouts import Batches

    cfg = load_config(None, ["rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.oversample=true",
                             "rollout.max_oversample=3", "loss.filter_zero_variance_groups=true"])
    prompts = Prompts({0: ["same", "mixed"]}, {0: ["same", "same", "none", "mixed", "mixed"]})
    engine, rewards = EachEngine(random_ids=True), GroupRewards()
    assert isinstance(engine, SamplesEach)
    batches = Batches(cfg, prompts, TOK, SingleTurn(RolloutFnInputs(TOK, rewards)), rewards, engine)
    (rollout,) = batches.score(batches.sample([0])).values()
    assert prompts.reserve_calls == [(0, 0, 4)]  # the budget's reserve, fetched once
    trained = [TOK.decode(s.prompt_ids.tolist()) for s in rollout.samples[::2]]
    assert trained == ["b0.1", "r0.3"] and rollout.rewards.tolist() == [0.0, 1.0, 0.0, 1.0]
    assert {k: rollout.reward_stats[k] for k in ("rollout/groups_generated", "rollout/groups_dropped",
                                                  "rollout/groups_padded", "rollout/groups_discarded")} == \
        {"rollout/groups_generated": 6.0, "rollout/groups_dropped": 4.0, "rollout/groups_padded": 0.0,
         "rollout/groups_discarded": 0.0}
    assert rewards.calls == 2 + 4  # a reward call per group
    lines = [line for line in capsys.readouterr().out.splitlines() if "over-sampling" in line]
    assert lines and lines[0] == ("step 1: over-sampling: 2 more prompts (1 of 2 groups with reward variance, 2 "
                                  "scored and 0 in flight of at most 6 prompts)")
