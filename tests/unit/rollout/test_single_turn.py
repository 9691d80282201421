"""single_turn's groups as units of work (rollout/single_turn.py) over a scripted engine whose
requests are coroutines: a group is scored while another group's request still waits, and the
samples and rewards equal the one-generate()-call path's, in draw order. The vLLM engine's run is
tests/vllm/test_async_requests.py."""
import asyncio
import threading

import pytest
import torch

from megatron_rl.data.types import Example
from megatron_rl.rollout.engine import SamplesEach
from megatron_rl.rollout.function import RolloutFnInputs
from megatron_rl.rollout.single_turn import SingleTurn
from megatron_rl.rollout.types import SamplingParams
from tests.unit.rollout.multi_turn_fakes import TOK, ScriptedEngine

SAMPLING = SamplingParams(temperature=1.0, max_tokens=5, stop_token_ids=TOK.stop_ids, seed=11)
N = 3


class EachEngine(ScriptedEngine):
    """ScriptedEngine (random ids from each request's stream) with its requests as coroutines; the
    requests of example 0 wait for `gate` (set by the test's reward)."""

    def __init__(self):
        super().__init__(random_ids=True)
        self.gate, self.waiting = None, 0

    async def sample(self, request):
        if request.stream[0] == 0:
            if self.gate is None:
                self.gate = asyncio.Event()
            self.waiting += 1
            await self.gate.wait()
            self.waiting -= 1
        return self.generate_requests([request])[0]


class Rewards:
    """Reward = first response id is even; scoring a group of example 1 first checks example 0's
    requests all wait, then opens their gate (on the rollout's loop: the caller's thread)."""

    def __init__(self, engine=None):
        self.engine, self.groups, self.held_then = engine, [], []

    def __call__(self, items):
        self.groups.append([prompt for prompt, *_ in items])
        if self.engine is not None and items[0][0] == "bb":
            self.held_then.append(self.engine.waiting)
            self.engine.gate.set()
        return [float(TOK.encode(response)[0] % 2 == 0) if response else 0.0 for _, response, *_ in items]


EXAMPLES = [Example("aa", "x", "t"), Example("bb", "y", "t"), Example("cc", "z", "t")]


def test_a_group_is_scored_while_another_groups_requests_wait_and_the_batch_equals_generate():
    engine = EachEngine()
    assert isinstance(engine, SamplesEach)
    rewards = Rewards(engine)
    got = SingleTurn(RolloutFnInputs(TOK, rewards))(engine, EXAMPLES, N, SAMPLING)
    assert rewards.held_then == [N]  # example 1 was scored while all of example 0's requests waited
    assert rewards.groups[-1] == ["aa"] * N  # example 0, held, scored last
    got_rewards = got.score()

    plain = ScriptedEngine(random_ids=True)  # no sample(): the one generate() call
    assert not isinstance(plain, SamplesEach)
    want = SingleTurn(RolloutFnInputs(TOK, Rewards()))(plain, EXAMPLES, N, SAMPLING)
    assert len(plain.calls) == 1 and len(plain.calls[0][0]) == len(EXAMPLES) * N
    assert [(s.prompt_index, s.sample_index) for s in got.samples] == [(k // N, k % N) for k in range(len(EXAMPLES) * N)]
    for a, b in zip(got.samples, want.samples, strict=True):
        assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.rollout_logprobs, b.rollout_logprobs)
        assert torch.equal(a.prompt_ids, b.prompt_ids)
    assert got_rewards == want.score()
    assert len({tuple(s.response_ids.tolist()) for s in got.samples}) > 1  # the streams differ


def test_off_the_main_thread_scoring_waits_for_score():
    rewards, out = Rewards(), {}

    def rollout():
        out["generated"] = SingleTurn(RolloutFnInputs(TOK, rewards))(_Open(EachEngine()), EXAMPLES, N, SAMPLING)

    thread = threading.Thread(target=rollout)
    thread.start()
    thread.join()
    assert rewards.groups == []  # nothing scored in the rollout's thread
    assert len(out["generated"].score()) == len(EXAMPLES) * N and len(rewards.groups) == 1


class _Open:
    """An EachEngine's requests, none held."""

    def __init__(self, engine):
        self.engine, self.policy_version, self.max_len = engine, 3, 512

    async def sample(self, request):
        return self.engine.generate_requests([request])[0]

    def generate(self, prompts, n, sampling):
        raise AssertionError("a SamplesEach engine is not asked for generate()")


def test_an_engine_error_reaches_the_caller_as_itself():
    class Failing(EachEngine):
        async def sample(self, request):
            if request.stream == (1, 2):
                raise RuntimeError("server died")
            return self.generate_requests([request])[0]

    with pytest.raises(RuntimeError, match="server died"):
        SingleTurn(RolloutFnInputs(TOK, Rewards()))(Failing(), EXAMPLES, N, SAMPLING)


def test_a_reward_that_batches_scores_the_whole_call_at_once():
    """A judge (RewardRunner.batches) gets every sample of the call in one call, after all groups,
    not n at a time; the rewards are those of per-group scoring."""
    class Batching(Rewards):
        batches = True

    rewards = Batching()
    got = SingleTurn(RolloutFnInputs(TOK, rewards))(_Open(EachEngine()), EXAMPLES, N, SAMPLING)
    assert rewards.groups == []  # nothing scored per group
    got_rewards = got.score()
    assert rewards.groups == [[e.prompt for e in EXAMPLES for _ in range(N)]]
    per_group = SingleTurn(RolloutFnInputs(TOK, Rewards()))(_Open(EachEngine()), EXAMPLES, N, SAMPLING)
    assert got_rewards == per_group.score()
