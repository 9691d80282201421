"""The vLLM engine's requests as coroutines (generation.py), against the fake server: a request's
sample comes back as soon as its own answer does while another still runs, the threads do not grow
with the requests in flight, each request's sample is the one generate() gives it, and abort()
ends the requests in flight. single_turn's groups (rollout/single_turn.py): one is scored while
another's requests are held, the batch is generate()'s; over-sampling's overlapping groups
(trainer/oversample.py fill_overlapped): the same selection whichever group the server answers
first, never more groups than the budget. The fake holds answers on events, never timers."""
import asyncio
import dataclasses
import threading

import pytest
import torch

from megatron_rl.data.types import Example, derive_seed
from megatron_rl.rollout.function import RolloutFnInputs
from megatron_rl.rollout.pausing import GenerationAborted
from megatron_rl.rollout.requests import RequestQueue
from megatron_rl.rollout.single_turn import SingleTurn
from megatron_rl.rollout.types import Request, SamplingParams, requests_of
from megatron_rl.rollout.vllm import VllmConfig, VllmEngine
from megatron_rl.trainer.oversample import has_variance, select_groups
from tests.vllm.conftest import hf_weights, push, tiny_arch
from tests.vllm.fake_server import FakeVllm

pytestmark = pytest.mark.vllm

ARCH = tiny_arch()
SAMPLING = SamplingParams(max_tokens=6, seed=5)
GUARD_S = 600.0  # hang guards only
LONG = 9  # the first token of the prompts whose answers wait for `release`


@pytest.fixture(scope="module")
def weights():
    return hf_weights(ARCH, seed=0)[1]


class Held:
    """The fake's behaviour: an answer to a prompt starting with LONG waits for `release`; `arrived`
    is set once `expect` requests are on the server at once."""

    def __init__(self, expect: int = 1 << 30):
        self.release, self.arrived, self.expect = threading.Event(), threading.Event(), expect
        self.waiting, self.lock = 0, threading.Lock()

    def __call__(self, body, answer):
        if body["token_ids"][0] != LONG:
            return answer
        with self.lock:
            self.waiting += 1
            if self.waiting >= self.expect:
                self.arrived.set()
        self.release.wait(GUARD_S)
        return answer


def make_engine(tmp_path, weights, behaviour, **cfg):
    fake = FakeVllm(ARCH.vocab_size, behaviour)
    options = {"warmup": False, "probe_every": 0, "retry_backoff_s": 0.01, "health_interval_s": GUARD_S,
               "health_timeout_s": 120.0, **cfg}
    engine = VllmEngine(ARCH, VllmConfig(**options), str(tmp_path), weight_sync="reload", server=fake, device="cpu")
    push(engine, weights, 3)
    return engine, fake


def test_a_short_request_returns_while_a_long_one_runs_and_samples_match_generate(tmp_path, weights):
    held = Held(expect=1)
    engine, _ = make_engine(tmp_path, weights, held)
    long, short = Request([LONG, 10, 11], SAMPLING, (0, 1)), Request([4, 5], SAMPLING, (1, 0))

    async def main():
        async with RequestQueue(engine) as queue:
            slow = asyncio.ensure_future(queue.sample(long))
            assert await asyncio.to_thread(held.arrived.wait, GUARD_S)  # the long one is on the server
            quick = await queue.sample(short)
            assert not slow.done()  # still held by the server: the short one did not wait for it
            held.release.set()
            return quick, await slow, queue.calls

    try:
        quick, slow, calls = asyncio.run(main())
        assert calls == [1, 1]  # each request handed over on its own
        want = engine.generate_requests([long, short])  # the same streams: the same seeds, the same samples
        for got, ref in zip([slow, quick], want, strict=True):
            assert got.response_ids.tolist() == ref.response_ids.tolist()
            assert (got.prompt_index, got.sample_index) == (ref.prompt_index, ref.sample_index)
    finally:
        held.release.set()
        engine.close()


def _threads() -> int:
    """Threads of this process but the fake server's (it runs one per connection)."""
    return sum("process_request" not in t.name for t in threading.enumerate())


def test_threads_do_not_grow_with_the_requests_in_flight(tmp_path, weights):
    n = 16
    held = Held(expect=n)
    engine, _ = make_engine(tmp_path, weights, held, max_concurrency=n)

    async def main():
        await engine.sample(Request([4, 5], SAMPLING, (0, 0)))  # the engine's loop runs from here on
        before = _threads()
        tasks = [asyncio.ensure_future(engine.sample(Request([LONG, k], SAMPLING, (k, 0)))) for k in range(n)]
        assert await asyncio.to_thread(held.arrived.wait, GUARD_S)  # all n on the server at once
        during = _threads() - 1  # less the to_thread worker, which may have just started
        held.release.set()
        samples = await asyncio.gather(*tasks)
        return before, during, samples

    try:
        before, during, samples = asyncio.run(main())
        assert during <= before, (before, during)
        assert [s.prompt_index for s in samples] == list(range(n))
    finally:
        held.release.set()
        engine.close()


def test_abort_ends_the_requests_in_flight_and_the_next_request_samples(tmp_path, weights):
    arrived, lock, seen = threading.Event(), threading.Lock(), []

    def hang_two(body, answer):  # the fake's "hang": until an abort reaches it (or the server stops)
        if body["token_ids"][0] != LONG:
            return answer
        with lock:
            seen.append(body)
            if len(seen) == 2:
                arrived.set()
        return "hang"

    engine, fake = make_engine(tmp_path, weights, hang_two)

    async def main():
        tasks = [asyncio.ensure_future(engine.sample(Request([LONG, k], SAMPLING, (k, 0)))) for k in range(2)]
        assert await asyncio.to_thread(arrived.wait, GUARD_S)
        await asyncio.to_thread(engine.abort)  # the trainer's thread; returns once both have ended
        assert engine.replicas[0].in_flight == 0  # none of them still runs
        return await asyncio.gather(*tasks, return_exceptions=True)

    try:
        outcome = asyncio.run(main())
        assert all(isinstance(e, GenerationAborted) for e in outcome), outcome
        stats = engine.stats()
        assert fake.aborts == 1 and stats["vllm/aborts"] == 1 and stats["vllm/bad_responses"] == 0
        engine.resume()
        assert asyncio.run(engine.sample(Request([4, 5], SAMPLING, (0, 0)))).prompt_index == 0
    finally:
        fake.release_hung()
        engine.close()


# ------------------------------------------------------------------ single_turn's groups, over-sampling


class Tok:
    """Prompts are space-separated token ids; a response decodes to its ids the same way."""

    stop_ids = ()

    def encode_prompt(self, text):
        return [int(t) for t in text.split()]

    def decode(self, ids):
        return " ".join(map(str, ids))


class HoldGroup:
    """The fake's behaviour: the answers to prompts starting with `held` wait for `release`;
    `arrived` is set once one of them is on the server."""

    def __init__(self, held: int):
        self.held, self.release, self.arrived = held, threading.Event(), threading.Event()

    def __call__(self, body, answer):
        if body["token_ids"][0] == self.held:
            self.arrived.set()
            self.release.wait(GUARD_S)
        return answer


class Rewards:
    """Reward: label "flat" 0, "vary" the parity of the first response token. Scoring a group of
    the prompt starting with `releaser` (on the caller's thread) waits until a held request is on
    the server, records whether it is still held, then releases it."""

    def __init__(self, hold: HoldGroup | None = None, releaser: int | None = None):
        self.hold, self.releaser, self.held_then, self.scored = hold, releaser, [], []

    def __call__(self, items):
        first = int(items[0][0].split()[0])
        self.scored.append(first)
        if self.hold is not None and first == self.releaser:
            assert self.hold.arrived.wait(GUARD_S)
            self.held_then.append(not self.hold.release.is_set())
            self.hold.release.set()
        return [0.0 if label == "flat" else float(int(response.split()[0]) % 2) for _, response, label, _ in items]

    def stats(self):
        return {}


class Generates:
    """The engine's generate() alone: single_turn's one-call path."""

    def __init__(self, engine):
        self.engine = engine

    def generate(self, prompts, n, sampling):
        return self.engine.generate(prompts, n, sampling)


def test_a_group_is_scored_while_another_is_held_and_the_batch_equals_generate(tmp_path, weights):
    hold = HoldGroup(LONG)
    engine, _ = make_engine(tmp_path, weights, hold)
    examples = [Example(f"{LONG} 10 11", "vary", "t"), Example("4 5", "vary", "t"), Example("6 7 8", "flat", "t")]
    rewards = Rewards(hold, releaser=4)
    try:
        got = SingleTurn(RolloutFnInputs(Tok(), rewards))(engine, examples, 3, SAMPLING)
        assert rewards.held_then == [True]  # group 1 scored while group 0's requests were held
        assert rewards.scored.index(4) < rewards.scored.index(LONG)  # the held group after it
        got_rewards = got.score()
        want = SingleTurn(RolloutFnInputs(Tok(), Rewards()))(Generates(engine), examples, 3, SAMPLING)
        assert [(s.prompt_index, s.sample_index) for s in got.samples] == [(k // 3, k % 3) for k in range(9)]
        for a, b in zip(got.samples, want.samples, strict=True):
            assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.rollout_logprobs, b.rollout_logprobs)
        assert got_rewards == want.score()
    finally:
        hold.release.set()
        engine.close()


B, G, BATCH, RESERVE = 2, 4, 20, 40  # prompts: batch i is "20+i", reserve r is "40+r"


class Prompts:
    def __init__(self, batch: list[str], reserve: list[str]):
        self.labels, self.reserve_labels = batch, reserve

    def batch(self, step, size):
        return [Example(f"{BATCH + i}", label, "t") for i, label in enumerate(self.labels[:size])]

    def reserve(self, step, start, count):
        return [Example(f"{RESERVE + r}", self.reserve_labels[r], "t") for r in range(start, start + count)]


def _config(max_oversample: float = 3.0):
    from megatron_rl.configure import load_config

    return load_config(None, [f"rollout.prompts_per_step={B}", f"rollout.group_size={G}", "rollout.oversample=true",
                              f"rollout.max_oversample={max_oversample}", "loss.filter_zero_variance_groups=true",
                              f"rollout.max_tokens={SAMPLING.max_tokens}"])


def _oversampled(engine, fake, cfg, prompts, hold=None, releaser=None):
    """One step's batch over-sampled on the fake (its answers held as told): the step's Rollout,
    the reserve prompts the server saw, and the rewards' record."""
    from megatron_rl.trainer.rollouts import Batches

    fake.behaviour, rewards = hold or (lambda body, answer: answer), Rewards(hold, releaser)
    fake.requests.clear()
    try:
        batches = Batches(cfg, prompts, Tok(), SingleTurn(RolloutFnInputs(Tok(), rewards)), rewards, engine)
        (rollout,) = batches.score(batches.sample([0])).values()
    finally:
        if hold is not None:
            hold.release.set()
    seen = {body["token_ids"][0] for body in fake.requests} - set(range(BATCH, BATCH + B))
    return rollout, seen, rewards


def _reference(engine, prompts, cfg, budget):
    """Every group of the budget sampled by generate_requests (the batch: the step's seed, streams
    (i, j); the reserve: the seed derived for over-sampling, streams (r, j)) and scored, in draw
    order: (prompt, samples, rewards) each."""
    from megatron_rl.trainer.rollouts import sampling_for

    first = sampling_for(cfg, Tok(), 0)
    extra = dataclasses.replace(first, seed=derive_seed(first.seed, "oversample", "step", 0) & (2**63 - 1))
    groups = []
    for examples, sampling in ((prompts.batch(0, B), first), (prompts.reserve(0, 0, budget - B), extra)):
        ids = [Tok().encode_prompt(e.prompt) for e in examples]
        samples = engine.generate_requests(requests_of(ids, G, sampling))
        for i, e in enumerate(examples):
            group = samples[i * G:(i + 1) * G]
            items = [(e.prompt, Tok().decode(s.response_ids.tolist()), e.label, "t") for s in group]
            groups.append((e.prompt, group, Rewards()(items)))
    return groups


def test_oversampling_selects_the_same_groups_whichever_the_server_answers_first(tmp_path, weights):
    prompts, cfg, budget = Prompts(["flat", "vary"], ["vary", "vary", "vary", "flat"]), _config(3.0), 3 * B
    engine, fake = make_engine(tmp_path, weights, None, max_concurrency=64)
    try:
        groups = _reference(engine, prompts, cfg, budget)
        flags = [has_variance(rewards) for _, _, rewards in groups]
        # the case this is about: the batch misses one group, the first two reserve groups (launched
        # together) both vary, so the first to complete is not always the one to train on
        assert flags[:4] == [False, True, True, True], flags
        want = [groups[g] for g in select_groups(flags, B)]
        assert [p for p, _, _ in want] == [f"{BATCH + 1}", f"{RESERVE}"]
        runs = {"in order": _oversampled(engine, fake, cfg, prompts, HoldGroup(RESERVE + 1), RESERVE),
                "reversed": _oversampled(engine, fake, cfg, prompts, HoldGroup(RESERVE), RESERVE + 1),
                "unheld": _oversampled(engine, fake, cfg, prompts)}
    finally:
        engine.close()
    for name, (rollout, seen, rewards) in runs.items():
        if name != "unheld":
            assert rewards.held_then == [True], name  # one reserve group scored while the other was held
        trained = [rollout.samples[g * G:(g + 1) * G] for g in range(B)]
        for got, (_, ref, _) in zip(trained, want, strict=True):
            assert [s.response_ids.tolist() for s in got] == [s.response_ids.tolist() for s in ref], name
        assert rollout.rewards.tolist() == [r for _, _, group_rewards in want for r in group_rewards], name
        assert len(seen) <= budget - B and seen <= set(range(RESERVE, RESERVE + budget - B)), (name, seen)
        assert rollout.reward_stats["rollout/groups_generated"] == 3.0, name  # the settled prefix
        assert rollout.reward_stats["rollout/groups_padded"] == 0.0, name


def test_oversampling_draws_the_budget_and_no_more(tmp_path, weights):
    engine, fake = make_engine(tmp_path, weights, None, max_concurrency=64)
    try:  # floor(2.5 B) = 5 groups at most
        rollout, seen, _ = _oversampled(engine, fake, _config(2.5), Prompts(["flat", "flat"], ["flat"] * 10))
    finally:
        engine.close()
    assert seen == set(range(RESERVE, RESERVE + 3))  # 5 - B reserve prompts, each once
    assert rollout.reward_stats["rollout/groups_generated"] == 5.0
    assert rollout.reward_stats["rollout/groups_padded"] == B
