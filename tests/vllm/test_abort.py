"""VllmEngine.abort() and pause() (train.in_flight_update=abort | pause) against the fake server:
abort makes the generate() call in flight raise GenerationAborted once none of its requests runs
any more, and the engine serves the next call; pause freezes the servers' requests for the
update, and the samples carry each token's version as the server reports it. The fake holds
requests until the abort or release reaches it (an event, never a timer). The real server's
pause: tests/vllm/test_server.py."""
import threading

import pytest

from megatron_rl.rollout.pausing import GenerationAborted
from megatron_rl.rollout.serving.errors import ServerDiedError, UnsupportedError
from megatron_rl.rollout.types import SamplingParams
from megatron_rl.rollout.vllm import VllmConfig, VllmEngine
from tests.vllm.conftest import hf_weights, push, tiny_arch
from tests.vllm.fake_server import FakeVllm

pytestmark = pytest.mark.vllm

ARCH = tiny_arch()
SAMPLING = SamplingParams(max_tokens=6, seed=5)
PROMPTS = [[4, 5, 6], [7, 8], [9, 10, 11, 12]]
GUARD_S = 600.0  # hang guards only: every wait below ends on an event


@pytest.fixture(scope="module")
def weights():
    return hf_weights(ARCH, seed=0)[1]


def make_engine(tmp_path, weights, hold, **fake_options):
    """An engine on a fake whose answers hang while `hold` is non-empty (until an abort or release)."""
    fake = FakeVllm(ARCH.vocab_size, lambda body, answer: "hang" if hold else answer, **fake_options)
    cfg = VllmConfig(warmup=False, probe_every=0, retry_backoff_s=0.01, health_interval_s=0.5, health_timeout_s=120.0,
                     max_concurrency=4)
    engine = VllmEngine(ARCH, cfg, str(tmp_path), weight_sync="reload", server=fake, device="cpu")
    push(engine, weights, 3)
    return engine, fake


def generate_in_background(engine, prompts=PROMPTS, sampling=SAMPLING):
    """generate() (2 samples a prompt) in a thread, as the async schedule runs it; -> (thread, outcome dict)."""
    outcome = {}

    def run():
        try:
            outcome["samples"] = engine.generate(prompts, 2, sampling)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            outcome["error"] = e

    thread = threading.Thread(target=run, name="rollout-generation", daemon=True)  # a failing test never waits for it
    thread.start()
    return thread, outcome


def test_abort_ends_the_call_in_flight_and_the_next_call_samples(tmp_path, weights):
    hold = ["the first call"]
    engine, fake = make_engine(tmp_path, weights, hold)
    thread, outcome = generate_in_background(engine)
    assert fake.hanging.wait(GUARD_S)  # a request of the call is on the server
    hold.clear()  # what reaches the server from now on answers at once, as a finite generation ends
    engine.abort()  # returns once the call has ended
    thread.join(GUARD_S)
    assert not thread.is_alive()
    assert isinstance(outcome.get("error"), GenerationAborted), outcome
    assert fake.aborts == 1  # the server was told to end its requests
    assert engine.replicas[0].in_flight == 0  # no request of the aborted call is still running
    stats = engine.stats()
    assert stats["vllm/aborts"] == 1 and stats["vllm/bad_responses"] == 0 and stats["vllm/restarts"] == 0
    engine.resume()
    out = engine.generate(PROMPTS, 2, SAMPLING)
    assert [[(s.prompt_index, s.sample_index) for s in g] for g in out] == [[(i, 0), (i, 1)] for i in range(3)]
    assert all(s.finish_reason == "length" for g in out for s in g)
    engine.close()


def test_a_call_started_after_abort_waits_for_resume_and_carries_the_new_version(tmp_path, weights):
    engine, fake = make_engine(tmp_path, weights, [])
    engine.abort()  # none in flight: returns at once, and holds the next call
    started = threading.Event()
    fake.behaviour = lambda body, answer: started.set() or answer
    thread, outcome = generate_in_background(engine)
    push(engine, weights, 4)  # the push the schedule makes between abort() and resume()
    assert not started.is_set()  # held: no request was sent before resume()
    engine.resume()
    thread.join(GUARD_S)
    assert all(s.policy_version == 4 for g in outcome["samples"] for s in g)
    engine.close()


def test_without_the_abort_endpoint_the_requests_run_to_their_end(tmp_path, weights):
    """A server without VLLM_SERVER_DEV_MODE answers 404: abort() still ends the call, once the
    requests the server keeps have ended."""
    hold = ["the first call"]
    engine, fake = make_engine(tmp_path, weights, hold, abort_endpoint=False)
    thread, outcome = generate_in_background(engine)
    assert fake.hanging.wait(GUARD_S)
    hold.clear()
    releaser = threading.Thread(target=lambda: fake.abort_refused.wait(GUARD_S) and fake.release_hung())
    releaser.start()  # the requests end (as a finite generation does) once the abort was refused
    engine.abort()
    thread.join(GUARD_S)
    releaser.join(GUARD_S)
    assert isinstance(outcome.get("error"), GenerationAborted) and fake.aborts == 0
    engine.resume()
    assert len(engine.generate(PROMPTS, 1, SAMPLING)) == 3
    engine.close()


def test_pause_freezes_the_servers_for_the_update_and_samples_carry_each_token_s_version(tmp_path, weights):
    hold = ["the call"]
    engine, fake = make_engine(tmp_path, weights, hold)
    thread, outcome = generate_in_background(engine)
    assert fake.hanging.wait(GUARD_S)  # a request of the call is on the server
    engine.pause()
    assert fake.posts[-1] == "/pause?mode=keep&clear_cache=false"  # frozen where they are, not aborted
    push(engine, weights, 4)  # the schedule's push between pause() and resume(): reload, then the label
    assert "/collective_rpc" in fake.posts[-3:] and fake.posts[-1] == "/update_weight_version"
    # what vLLM reports once resumed: each answer's first 2 tokens from version 3, the rest from 4
    fake.weight_versions = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 6}]
    engine.resume()  # the old weights' KV dropped, the requests recomputed on the new ones; then on
    assert fake.posts[-2:] == ["/reset_prefix_cache?reset_running_requests=true", "/resume"]
    fake.release_hung()  # every request of the call hung until now (hold): all answer with those spans
    thread.join(GUARD_S)
    assert not thread.is_alive() and "error" not in outcome, outcome
    hold.clear()
    for s in (s for g in outcome["samples"] for s in g):
        assert s.policy_version == 3 and s.token_versions.tolist() == [3, 3, 4, 4, 4, 4]
        assert s.versions().tolist() == [3, 3, 4, 4, 4, 4]
    stats = engine.stats()
    assert fake.aborts == 0 and stats["vllm/bad_responses"] == 0 and stats["vllm/pauses"] == 1
    fake.weight_versions = [{"version": "4", "start": 0, "end": 6}]
    out = engine.generate(PROMPTS, 1, SAMPLING)  # one version throughout: no per-token versions
    assert all(g[0].policy_version == 4 and g[0].token_versions is None for g in out)
    engine.close()


def test_pause_with_no_call_in_flight_holds_the_next_call_until_resume(tmp_path, weights):
    engine, fake = make_engine(tmp_path, weights, [])
    engine.pause()  # none in flight: nothing to freeze on the servers
    started = threading.Event()
    fake.behaviour = lambda body, answer: started.set() or answer
    thread, outcome = generate_in_background(engine)
    push(engine, weights, 4)
    assert not started.is_set() and "/pause?mode=keep&clear_cache=false" not in fake.posts
    engine.resume()
    thread.join(GUARD_S)
    assert started.is_set() and all(s.policy_version == 4 for g in outcome["samples"] for s in g)
    assert "/resume" not in fake.posts and "vllm/pauses" not in engine.stats()
    engine.close()


def test_a_server_that_cannot_pause_is_refused_naming_why_and_the_engine_is_not_left_held(tmp_path, weights):
    hold = ["the call"]
    engine, fake = make_engine(tmp_path, weights, hold)
    fake.refused.add("/pause?mode=keep&clear_cache=false")  # VLLM_SERVER_DEV_MODE=0
    thread, outcome = generate_in_background(engine)
    assert fake.hanging.wait(GUARD_S)
    with pytest.raises(UnsupportedError, match="refused to pause .*VLLM_SERVER_DEV_MODE=1"):
        engine.pause()
    hold.clear()
    fake.release_hung()
    thread.join(GUARD_S)
    assert len(outcome["samples"]) == 3 and len(engine.generate(PROMPTS, 1, SAMPLING)) == 3  # nothing held
    engine.close()


def test_a_failed_sync_while_paused_ends_the_frozen_requests_and_never_resumes_the_server(tmp_path, weights):
    """What the async schedule does when its push fails under train.in_flight_update=pause:
    abort(), then resume(). The frozen requests are ended (/pause?mode=abort: nothing more is
    computed on the half-loaded weights) and the server is never resumed; the pool has it out,
    so the next call fails naming why instead of sampling from it."""
    hold = ["the call"]
    engine, fake = make_engine(tmp_path, weights, hold)
    thread, outcome = generate_in_background(engine)
    assert fake.hanging.wait(GUARD_S)
    engine.pause()
    fake.refused.add("/collective_rpc")  # the reload fails: the server is left half updated
    with pytest.raises(ServerDiedError, match="weight sync to .* failed"):
        push(engine, weights, 4)
    engine.abort()
    engine.resume()
    thread.join(GUARD_S)
    assert isinstance(outcome.get("error"), GenerationAborted), outcome
    assert fake.posts[-1] == "/pause?mode=abort&clear_cache=false" and "/resume" not in fake.posts
    with pytest.raises(ServerDiedError, match="no vLLM server of the pool can serve"):
        engine.generate(PROMPTS, 1, SAMPLING)
    engine.close()
