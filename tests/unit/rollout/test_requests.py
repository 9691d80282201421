"""Requests as coroutines (rollout/requests.py) and the multi-turn rollout on them: a trajectory goes
on without waiting for another's environment (async), every call holds one request of every running
trajectory (lockstep), both give the same greedy trajectories on a real model, an engine error
reaches the caller as itself, and the embedded engine's requests equal its generate() samples.

The environments wait on events the other trajectories set; their deadline (env.timeout_s) only
ends a test that would otherwise hang."""
import asyncio
import dataclasses
import itertools
import threading

import pytest
import torch

from megatron_rl.config.env_section import EnvSection
from megatron_rl.data.envs import ENVS, Environment, Step, register_env
from megatron_rl.data.types import Example
from megatron_rl.rollout.function import RolloutFnInputs
from megatron_rl.rollout.multi_turn import MultiTurn
from megatron_rl.rollout.pausing import GenerationAborted
from megatron_rl.rollout.requests import RequestQueue
from megatron_rl.rollout.types import Request, SamplingParams
from tests.unit.rollout.multi_turn_fakes import TOK, ScriptedEngine

SAMPLING = SamplingParams(temperature=1.0, max_tokens=6, stop_token_ids=TOK.stop_ids, seed=3)


class Turns(Environment):
    """Ends after as many turns as the example's label says ("slow:N": its first step first waits
    until every "fast" trajectory has finished)."""

    max_turns = 8
    fast_done = threading.Event()
    fast_left = 0
    lock = threading.Lock()

    def reset(self, example):
        self.slow, self.turns, self.target = example.label.startswith("slow"), 0, int(example.label.split(":")[-1])
        return example.prompt

    def step(self, generated_text, generated_ids):
        if self.slow and self.turns == 0:
            assert Turns.fast_done.wait(30), "the fast trajectories never finished: they waited for this one"
        self.turns += 1
        done = self.turns >= self.target
        if done and not self.slow:
            with Turns.lock:
                Turns.fast_left -= 1
                if Turns.fast_left == 0:
                    Turns.fast_done.set()
        return Step(",", None, done)


@pytest.fixture
def turns_env():
    register_env("turns")(Turns)
    Turns.fast_done.clear()
    yield
    ENVS.pop("turns")


def _rollout(engine, labels, turns, n=1, sampling=SAMPLING):
    env = EnvSection(name="turns", max_turns=8, max_tokens=64, timeout_s=60.0, turns=turns)
    Turns.fast_left = sum(not label.startswith("slow") for label in labels) * n
    examples = [Example(f"{k}+1=", label, "addition") for k, label in enumerate(labels)]
    return MultiTurn(RolloutFnInputs(TOK, rewards=None, env=env))(engine, examples, n, sampling)


def test_async_a_trajectory_goes_on_while_another_environment_is_busy(turns_env):
    engine = ScriptedEngine(random_ids=True)
    gen = _rollout(engine, ["slow:1", "fast:3"], "async")
    assert gen.stats["env/failures"] == 0 and [len(s.response_ids) > 0 for s in gen.samples] == [True, True]
    # turn 0 of both together; the fast one's turns 1 and 2 alone, while the slow environment waits for them
    assert [len(prompts) for prompts, _ in engine.calls] == [2, 1, 1]


def test_lockstep_every_call_holds_one_request_of_every_running_trajectory_in_stream_order(turns_env):
    engine = ScriptedEngine(random_ids=True)
    gen = _rollout(engine, ["fast:3", "fast:1", "fast:2"], "lockstep", n=2)
    assert gen.stats["env/failures"] == 0
    assert [len(prompts) for prompts, _ in engine.calls] == [6, 4, 2]
    # turn 1: trajectories 0, 1 (example 0) and 4, 5 (example 2), in that order whatever the environments' timing
    turn1 = engine.calls[1][0]
    assert turn1 == [s.prompt_ids.tolist() + s.response_ids.tolist()[:len(p) - len(s.prompt_ids)]
                     for s, p in zip([gen.samples[k] for k in (0, 1, 4, 5)], turn1)]


def test_async_and_lockstep_give_the_same_greedy_trajectories_on_a_real_model(turns_env, moe_checkpoint):
    from megatron_rl.rollout.embedded import EmbeddedEngine

    arch, _, ckpt = moe_checkpoint
    engine = EmbeddedEngine(arch)
    engine.update_weights(ckpt.items(), version=1)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, stop_token_ids=TOK.stop_ids, seed=5)
    labels = ["fast:1", "fast:3", "fast:2", "fast:3"]
    runs = [_rollout(engine, labels, mode, n=2, sampling=greedy) for mode in ("async", "lockstep")]
    assert runs[0].stats["env/turns"] == runs[1].stats["env/turns"] > 1.5
    for a, b in zip(*(r.samples for r in runs), strict=True):
        assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.loss_mask, b.loss_mask)
        torch.testing.assert_close(a.rollout_logprobs, b.rollout_logprobs, rtol=0, atol=1e-5)


def test_async_on_a_serving_engine_a_trajectory_goes_on_while_another_environment_is_busy(turns_env, moe_checkpoint):
    from megatron_rl.rollout.embedded import EmbeddedEngine

    arch, _, ckpt = moe_checkpoint
    engine = EmbeddedEngine(arch)
    engine.update_weights(ckpt.items(), version=1)
    gen = _rollout(engine, ["slow:1", "fast:3", "fast:2"], "async", n=2)
    assert gen.stats["env/failures"] == 0 and gen.stats["env/turns"] == (1 + 3 + 2) / 3


def _engine(moe_checkpoint, **kw):
    from megatron_rl.rollout.embedded import EmbeddedEngine

    arch, _, ckpt = moe_checkpoint
    engine = EmbeddedEngine(arch, **kw)
    engine.update_weights(ckpt.items(), version=1)
    return engine


def _same(got, want):
    assert torch.equal(got.response_ids, want.response_ids), (got.response_ids, want.response_ids)
    torch.testing.assert_close(got.rollout_logprobs, want.rollout_logprobs, rtol=0, atol=1e-5)
    assert torch.equal(got.routed_experts, want.routed_experts) and torch.equal(got.kept_ids, want.kept_ids)
    assert (got.finish_reason, got.prompt_index, got.sample_index) == (want.finish_reason, want.prompt_index,
                                                                       want.sample_index)


KEEP = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=10, seed=4, return_kept_ids=True, logprobs_mode="processed")


@pytest.mark.parametrize("trim", [False, True])
def test_a_request_that_joins_a_running_batch_gets_what_it_gets_alone(moe_checkpoint, trim):
    """A decodes 4 steps alone, then B (a longer prompt: the caches are padded) and C join it; A and
    B leave together (trim: C's padding columns are dropped)."""
    from megatron_rl.rollout.decoding import Decoding

    engine = _engine(moe_checkpoint)
    a = Request([5, 9, 13], KEEP, (0, 0))
    b = Request([7, 8, 2, 2, 2, 2, 2, 11], dataclasses.replace(KEEP, max_tokens=6, seed=8), (1, 0))
    c = Request([7, 8], KEEP, (2, 1))
    alone = {r.stream: engine.generate_requests([r])[0] for r in (a, b, c)}
    d, got, step, widths = Decoding(engine, KEEP, trim=trim), {}, 0, []
    d.join([a])
    while d.running():
        if step == 4:
            d.join([b, c])
        widths.append(d.mask.shape[1])
        for s in d.step(step):
            got[d.requests[s].stream] = d.sample(s)
        step += 1
    assert sorted(got) == sorted(alone)
    for stream, sample in got.items():
        _same(sample, alone[stream])
    # A and B leave after step 9; C's 2-token prompt was padded by 6 to B's 8: those columns go
    assert (widths[10] - widths[9] == 1 - 6) if trim else all(w2 - w1 == 1 for w1, w2 in itertools.pairwise(widths[4:]))


def test_serve_delivers_each_sample_and_hands_an_error_to_what_it_leaves(moe_checkpoint):
    from megatron_rl.rollout.decoding import Inbox

    engine = _engine(moe_checkpoint, max_batch_size=2)
    other = dataclasses.replace(KEEP, temperature=0.5)  # another sampling class: a batch of its own
    requests = [Request([5, 9, 13], KEEP, (0, 0)), Request([7, 8], other, (1, 0)), Request([4, 4, 6], KEEP, (2, 0)),
                Request([9], KEEP, (3, 0))]
    inbox, got = Inbox(), {}
    inbox.put([(r, lambda out, k=k: got.__setitem__(k, out)) for k, r in enumerate(requests)])
    inbox.close()
    engine.serve(inbox)
    assert sorted(got) == [0, 1, 2, 3]
    for k, r in enumerate(requests):
        _same(got[k], engine.generate_requests([r])[0])

    inbox, got = Inbox(), {}
    inbox.put([(r, lambda out, k=k: got.__setitem__(k, out)) for k, r in enumerate(requests)])
    engine.gate.park_after(2)  # the first batch parks after decode step 2, and is aborted there
    thread = threading.Thread(target=lambda: pytest.raises(GenerationAborted, engine.serve, inbox))
    thread.start()
    assert engine.gate.wait_parked(60)
    engine.abort()
    thread.join(60)
    assert sorted(got) == [0, 1, 2, 3] and all(isinstance(x, GenerationAborted) for x in got.values())
    engine.resume()


class Aborting(ScriptedEngine):
    def generate_requests(self, requests):
        if self.calls:
            raise GenerationAborted("a weight update")
        return super().generate_requests(requests)


def test_an_engine_error_reaches_the_caller_as_itself(turns_env):
    with pytest.raises(GenerationAborted, match="a weight update"):
        _rollout(Aborting(random_ids=True), ["fast:2", "fast:3"], "async")


def test_the_embedded_engines_requests_equal_its_generate_samples(moe_checkpoint):
    from megatron_rl.rollout.embedded import EmbeddedEngine

    arch, _, ckpt = moe_checkpoint
    engine = EmbeddedEngine(arch, max_batch_size=3)
    engine.update_weights(ckpt.items(), version=1)
    prompts = [[5, 9, 13], [7, 8], [21, 4, 4, 30]]
    long, short = SamplingParams(max_tokens=6, seed=2), SamplingParams(max_tokens=3, seed=9)
    by_call = {s: engine.generate(prompts, 2, s) for s in (long, short)}
    # one call, the two settings interleaved: each request gets what its (settings, stream) gets alone
    mixed = [Request(prompts[i], s, (i, j)) for i in range(3) for j in range(2) for s in (short, long)]
    for r, got in zip(mixed, engine.generate_requests(mixed), strict=True):
        want = by_call[r.sampling][r.stream[0]][r.stream[1]]
        assert torch.equal(got.response_ids, want.response_ids) and (got.prompt_index, got.sample_index) == r.stream
        torch.testing.assert_close(got.rollout_logprobs, want.rollout_logprobs, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="request 1: prompt 0 has token ids outside"):
        engine.generate_requests([mixed[0], Request([arch.vocab_size], short)])


class EachEngine(ScriptedEngine):
    """An engine whose requests are coroutines (engine.py SamplesEach, as the vLLM engine's): request
    k's sample waits for `release[k]`."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.release: dict[int, asyncio.Event] = {}

    async def sample(self, request):
        await self.release.setdefault(request.stream[0], asyncio.Event()).wait()
        return super().generate_requests([request])[0]


def test_async_each_request_of_a_samples_each_engine_comes_back_as_soon_as_its_own_answer():
    engine = EachEngine(random_ids=True)
    order = []

    async def main():
        async with RequestQueue(engine) as queue:
            async def one(k):
                sample = await queue.sample(Request([5, 6, 7], SAMPLING, (k, 0)))
                order.append(sample.prompt_index)

            tasks = [asyncio.ensure_future(one(k)) for k in range(3)]
            await asyncio.sleep(0)
            engine.release.setdefault(1, asyncio.Event()).set()  # request 1 answers; 0 and 2 still run
            await tasks[1]
            assert order == [1] and not tasks[0].done() and not tasks[2].done()
            for k in (2, 0):
                engine.release.setdefault(k, asyncio.Event()).set()
                await tasks[k]
            return queue.calls

    assert asyncio.run(main()) == [1, 1, 1] and order == [1, 2, 0]  # one hand-over per request, no batch call
    assert [len(prompts) for prompts, _ in engine.calls] == [1, 1, 1]
