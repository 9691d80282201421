"""The vLLM engine's requests as coroutines (generation.py), against the fake server: a request's
sample comes back as soon as its own answer does while another still runs, the threads do not grow
with the requests in flight, each request's sample is the one generate() gives it, and abort()
ends the requests in flight. The fake holds answers on events, never timers."""
import asyncio
import threading

import pytest

from megatron_rl.rollout.pausing import GenerationAborted
from megatron_rl.rollout.requests import RequestQueue
from megatron_rl.rollout.types import Request, SamplingParams
from megatron_rl.rollout.vllm import VllmConfig, VllmEngine
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
