"""The client against a fake HTTP server: validation of answers and fault handling (no vLLM).
The fake refuses requests without its key, so every test here also checks that the client sends
the key with each request. No test depends on how fast this machine is: a hang lasts until the
test ends it, and the timeouts that are not under test are generous hang guards."""
import json
import math
import threading

import pytest

from megatron_rl.rollout.serving.errors import (
    BadResponseError,
    RequestError,
    ServerDiedError,
    ServerStartError,
)
from megatron_rl.rollout.serving.http import HttpStatusError, request
from megatron_rl.rollout.types import SamplingParams
from megatron_rl.rollout.vllm import VllmConfig, VllmEngine
from tests.vllm.conftest import hf_weights, push, tiny_arch
from tests.vllm.fake_server import FakeVllm

pytestmark = pytest.mark.vllm

ARCH = tiny_arch()
SAMPLING = SamplingParams(max_tokens=6, stop_token_ids=(1,), seed=5)
PROMPTS = [[4, 5, 6], [7, 8], [9, 10, 11, 12]]


@pytest.fixture(scope="module")
def weights():
    return hf_weights(ARCH, seed=0)[1]


def make_engine(tmp_path, weights, behaviour=None, **cfg):
    fake = FakeVllm(ARCH.vocab_size, behaviour)
    options = {"warmup": False, "probe_every": 0, "retry_backoff_s": 0.01, "health_interval_s": 0.5,
               "health_timeout_s": 120.0}
    options.update(cfg)
    engine = VllmEngine(ARCH, VllmConfig(**options), str(tmp_path), weight_sync="reload", server=fake, device="cpu")
    push(engine, weights, 3)
    return engine, fake


def test_good_answers_make_samples_keyed_by_prompt_and_sample(tmp_path, weights):
    engine, fake = make_engine(tmp_path, weights)
    out = engine.generate(PROMPTS, 2, SAMPLING)
    assert [[(s.prompt_index, s.sample_index) for s in g] for g in out] == [[(i, 0), (i, 1)] for i in range(3)]
    assert all(s.policy_version == 3 and s.rollout_logprobs.tolist() == [-1.0] * len(s.response_ids)
               for g in out for s in g)
    seeds = sorted(r["sampling_params"]["seed"] for r in fake.requests)
    assert len(set(seeds)) == 6  # one distinct stream per (i, j)
    # each answer's tokens derive from its own seed, so sample (i, j) got its own answer
    for g in out:
        for s in g:
            assert s.finish_reason in ("stop", "length")
    assert engine.stats()["vllm/bad_responses"] == 0
    engine.close()


@pytest.mark.parametrize("corrupt, why", [
    (lambda a: b"{not json", "malformed JSON"),
    (lambda a: {**a, "choices": []}, "exactly one choice"),
    (lambda a: _edit(a, lambda c: c["logprobs"]["content"].pop()), "lengths differ"),
    (lambda a: _edit(a, lambda c: c.__setitem__("logprobs", None)), "logprobs.content missing"),
    (lambda a: _edit(a, lambda c: c["logprobs"]["content"][0].__setitem__("logprob", math.nan)), "not finite"),
    (lambda a: _edit(a, lambda c: c["logprobs"]["content"][1].__setitem__("logprob", None)), "not a number"),
    (lambda a: _edit(a, lambda c: c["logprobs"]["content"][1].__setitem__("logprob", -9999.0)), "not finite"),
    (lambda a: _edit(a, lambda c: c["logprobs"]["content"][1].__setitem__("logprob", 0.5)), "> 0"),
    (lambda a: _edit(a, lambda c: c["token_ids"].__setitem__(0, 64)), "outside"),
    (lambda a: _edit(a, lambda c: c["logprobs"]["content"][0].__setitem__("token_id", 63)), "do not match"),
    (lambda a: _edit(a, lambda c: c["weight_versions"][0].__setitem__("version", "x")), "not a trainer version"),
    (lambda a: _edit(a, lambda c: c.__setitem__("weight_versions", [{"version": "3", "start": 0, "end": 1}])),
     "cover 1 of"),
    (lambda a: _edit(a, lambda c: c.__setitem__("finish_reason", "abort")), "finish_reason"),
    (lambda a: _edit(a, lambda c: _shorten(c)), "finish_reason 'length' after"),
])
def test_bad_answers_are_retried_then_raise_the_named_error(tmp_path, weights, corrupt, why):
    engine, fake = make_engine(tmp_path, weights, behaviour=lambda body, answer: corrupt(answer), max_retries=2)
    with pytest.raises(BadResponseError, match=why) as info:
        engine.generate([[4, 5]], 1, SAMPLING)
    assert len(fake.requests) == 3 and info.value.count == 3  # first try + 2 retries, all counted
    assert engine.stats()["vllm/bad_responses"] == 3
    engine.close()


def _edit(answer, fn):
    fn(answer["choices"][0])
    return answer


def _shorten(choice):
    choice["token_ids"].pop()
    choice["logprobs"]["content"].pop()
    choice["weight_versions"][-1]["end"] -= 1
    choice["finish_reason"] = "length"


def test_nan_json_literal_is_rejected(tmp_path, weights):
    def nan_answer(body, answer):
        return json.dumps(answer).replace("-1.0", "NaN", 1).encode()

    engine, _ = make_engine(tmp_path, weights, behaviour=nan_answer, max_retries=0)
    with pytest.raises(BadResponseError, match="not finite"):
        engine.generate([[4, 5]], 1, SAMPLING)
    engine.close()


def test_transient_bad_answers_and_5xx_are_retried_and_counted(tmp_path, weights):
    seen: dict[int, int] = {}
    lock = threading.Lock()

    def flaky(body, answer):
        with lock:
            seed = body["sampling_params"]["seed"]
            seen[seed] = seen.get(seed, 0) + 1
            first = seen[seed] == 1
        if first and body["token_ids"][0] == 4:
            return b"garbage"
        if first and body["token_ids"][0] == 7:
            return 503
        return answer

    engine, _ = make_engine(tmp_path, weights, behaviour=flaky)
    out = engine.generate(PROMPTS, 2, SAMPLING)
    clean, _ = make_engine(tmp_path / "clean", weights)
    want = clean.generate(PROMPTS, 2, SAMPLING)
    assert [[s.response_ids.tolist() for s in g] for g in out] == [[s.response_ids.tolist() for s in g] for g in want]
    stats = engine.stats()
    assert stats["vllm/bad_responses"] == 2 and stats["vllm/retries"] == 4 and stats["vllm/restarts"] == 0
    engine.close()
    clean.close()


def test_4xx_is_not_retried(tmp_path, weights):
    engine, fake = make_engine(tmp_path, weights, behaviour=lambda body, answer: 400)
    with pytest.raises(RequestError, match="refused"):
        engine.generate([[4, 5]], 1, SAMPLING)
    assert len(fake.requests) == 1
    engine.close()


def test_dead_server_is_restarted_and_unfinished_samples_resent(tmp_path, weights):
    state = {"dropped": False}
    lock = threading.Lock()

    def die_once(body, answer):
        with lock:
            if not state["dropped"] and body["token_ids"][0] == 9:
                state["dropped"] = True
                return "drop"
        return answer

    engine, fake = make_engine(tmp_path, weights, behaviour=die_once)
    out = engine.generate(PROMPTS, 2, SAMPLING)
    assert fake.restarts == 1 and engine.stats()["vllm/restarts"] == 1
    keys = [(s.prompt_index, s.sample_index) for g in out for s in g]
    assert keys == [(i, j) for i in range(3) for j in range(2)]  # each sample once, none dropped
    assert engine.stats()["vllm/retries"] >= 1
    engine.close()


def test_hung_server_is_restarted(tmp_path, weights):
    """The first request never gets an answer (until the test ends the hang): the request
    timeout, not the length of a sleep, decides. Answers that are not hung come at once, so a
    slow machine can at worst make one of them time out too, which is one more restart."""
    state = {"hung": False}
    lock = threading.Lock()

    def hang_once(body, answer):
        with lock:
            first, state["hung"] = not state["hung"], True
        return "hang" if first else answer

    engine, fake = make_engine(tmp_path, weights, behaviour=hang_once, request_timeout_s=3.0, max_concurrency=1,
                               max_restarts=5)
    try:
        out = engine.generate([[4, 5]], 2, SAMPLING)
        assert fake.hanging.is_set()
        assert fake.restarts >= 1 and engine.stats()["vllm/restarts"] == fake.restarts
        assert [(s.prompt_index, s.sample_index) for s in out[0]] == [(0, 0), (0, 1)]
    finally:
        fake.release_hung()
        engine.close()


def test_restarts_are_bounded(tmp_path, weights):
    engine, fake = make_engine(tmp_path, weights, behaviour=lambda body, answer: "drop", max_restarts=2)
    with pytest.raises(ServerDiedError, match="after 2 restarts"):
        engine.generate(PROMPTS, 1, SAMPLING)
    assert fake.restarts == 2
    engine.close()



def test_no_restart_once_the_run_is_stopping(tmp_path, weights):
    """After SIGTERM (which SLURM sends the server too) a dead server is reported, not restarted:
    a restart would outlast the grace period the trainer needs to save."""
    stopping = []
    engine, fake = make_engine(tmp_path, weights, behaviour=lambda body, answer: "drop" if stopping else answer,
                               max_restarts=3)
    engine.stopping = lambda: bool(stopping)
    assert len(engine.generate(PROMPTS, 1, SAMPLING)) == 3
    stopping.append("SIGTERM")
    with pytest.raises(ServerDiedError, match="not restarted: the run is stopping"):
        engine.generate(PROMPTS, 1, SAMPLING)
    fake.stop()
    with pytest.raises(ServerDiedError, match="not restarted: the run is stopping"):
        push(engine, weights, 4)
    assert fake.restarts == 0 and engine.stats()["vllm/restarts"] == 0
    engine.close()


def test_a_server_dead_at_the_weight_sync_is_restarted_on_the_new_weights(tmp_path, weights):
    engine, fake = make_engine(tmp_path, weights, max_restarts=1)
    fake.stop()  # dead between two syncs: the reload request finds no server
    push(engine, weights, 4)
    assert fake.restarts == 1 and engine.stats()["vllm/restarts"] == 1
    assert engine.policy_version == 4 and len(engine.generate(PROMPTS, 1, SAMPLING)) == 3
    engine.close()


def test_max_restarts_bounds_the_weight_sync_too(tmp_path, weights):
    engine, fake = make_engine(tmp_path, weights, max_restarts=0)
    fake.stop()
    with pytest.raises(ServerDiedError, match="max_restarts=0 allows no restart"):
        push(engine, weights, 4)
    assert fake.restarts == 0 and engine.policy_version == 3
    engine.close()

def test_every_request_carries_the_key_and_none_passes_without_it(tmp_path, weights):
    engine, fake = make_engine(tmp_path, weights)
    engine.generate(PROMPTS, 2, SAMPLING)
    push(engine, weights, 4)  # DiskReloadSync: /collective_rpc + /reset_prefix_cache
    assert engine.server.alive()
    assert fake.unauthorised == 0 and len(fake.requests) == 6
    for path, body in (("/collective_rpc", {"method": "reload_weights"}), ("/v1/completions", {}),
                       ("/health", None)):
        for key in (None, "wrong"):
            with pytest.raises(HttpStatusError) as info:
                request(fake.url + path, body, timeout=120, api_key=key)
            assert info.value.status == 401
    assert fake.unauthorised == 6
    engine.close()


def test_a_server_at_a_url_takes_its_key_from_the_config_or_the_environment(tmp_path, weights, monkeypatch):
    fake = FakeVllm(ARCH.vocab_size)
    fake.start("unused")
    options = {"url": fake.url, "warmup": False, "probe_every": 0, "health_timeout_s": 120.0}
    try:
        monkeypatch.delenv("MEGATRON_RL_VLLM_API_KEY", raising=False)
        with pytest.raises(ServerStartError, match="refused a request without an API key.*MEGATRON_RL_VLLM_API_KEY"):
            push(VllmEngine(ARCH, VllmConfig(**options), str(tmp_path), weight_sync="reload"), weights, 0)
        with pytest.raises(ServerStartError, match="refused the API key we sent"):
            push(VllmEngine(ARCH, VllmConfig(**options, api_key="wrong"), str(tmp_path), weight_sync="reload"), weights, 0)
        cfg = VllmConfig(**options, api_key=fake.api_key)
        assert fake.api_key not in repr(cfg)
        engine = VllmEngine(ARCH, cfg, str(tmp_path), weight_sync="reload")
        push(engine, weights, 0)
        assert len(engine.generate(PROMPTS, 1, SAMPLING)) == 3
        assert fake.api_key not in repr(engine.server)
        engine.close()
        monkeypatch.setenv("MEGATRON_RL_VLLM_API_KEY", fake.api_key)
        engine = VllmEngine(ARCH, VllmConfig(**options), str(tmp_path), weight_sync="reload")
        push(engine, weights, 0)
        push(engine, weights, 1)  # the weight sync's /collective_rpc carries it too
        assert len(engine.generate(PROMPTS, 1, SAMPLING)) == 3
        engine.close()
    finally:
        fake.stop()


def test_a_server_at_a_url_is_used_but_never_restarted(tmp_path, weights):
    fake = FakeVllm(ARCH.vocab_size)
    fake.start("unused")
    cfg = VllmConfig(url=fake.url, api_key=fake.api_key, warmup=False, probe_every=0, health_interval_s=0.5,
                     health_timeout_s=120.0)
    engine = VllmEngine(ARCH, cfg, str(tmp_path), weight_sync="reload")
    push(engine, weights, 0)
    assert engine.server.model_name == "fake" and len(engine.generate(PROMPTS, 1, SAMPLING)) == 3
    fake.behaviour = lambda body, answer: "drop"
    with pytest.raises(ServerDiedError, match="cannot be restarted"):
        engine.generate(PROMPTS, 1, SAMPLING)
    assert fake.restarts == 0
    engine.close()
    fake.stop()
