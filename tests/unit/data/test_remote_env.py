"""`env.name: remote` against the environment server (data/envs/remote.py, server.py), served from a
thread of this process: the same trajectory as the local environment, keys, an environment that
raises, one that hangs, retries that do not act twice, bounds. (tests/tools/test_env_server.py runs
the server as its own process.)"""
import threading
from dataclasses import dataclass

import pytest

from megatron_rl.data.envs import ENVS, Step, make_env, register_env
from megatron_rl.data.envs.base import Environment
from megatron_rl.data.envs.remote import EnvServerError, RemoteEnv, call
from megatron_rl.data.envs.server import EnvService, make_server
from megatron_rl.data.types import Example

KEY = "test-key-1"
TOY = {"call_open": "c:", "call_close": "", "result_open": "r:", "result_close": ""}
GATE = threading.Event()  # the hanging environment's step waits on it
STEPS = []  # every step the counting environments took


@dataclass
class _Boom(Environment):
    def reset(self, example):
        return example.prompt

    def step(self, text, ids):
        raise ValueError("the sandbox crashed")


@dataclass
class _Hang(Environment):
    def reset(self, example):
        return example.prompt

    def step(self, text, ids):
        STEPS.append(text)
        GATE.wait(30)
        return Step("late", None, True)


@dataclass
class _Count(Environment):
    max_turns = 8

    def reset(self, example):
        return example.prompt

    def step(self, text, ids):
        STEPS.append(text)
        return Step(f"seen {len(STEPS)}", 0.5, False)


@pytest.fixture(scope="module")
def server():
    for name, cls in (("test_boom", _Boom), ("test_hang", _Hang), ("test_count", _Count)):
        register_env(name)(cls)
    service = EnvService(max_sessions=3, idle_s=600)
    srv = make_server("127.0.0.1", 0, KEY, service)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", service
    GATE.set()
    srv.shutdown()
    srv.server_close()
    for name in ("test_boom", "test_hang", "test_count"):
        ENVS.pop(name)


@pytest.fixture(autouse=True)
def key(monkeypatch):
    monkeypatch.setenv("MEGATRON_RL_ENV_KEY", KEY)
    STEPS.clear()


def _remote(url, env="calculator", **kw):
    return make_env("remote", url=url, env=env, **kw)


def test_a_trajectory_over_the_server_is_the_local_one(server):
    url, service = server
    example = Example("12*34=", "408", "multiplication")
    local, remote = make_env("calculator", **TOY), _remote(url, settings=TOY, observation_role="tool")
    assert remote.reset(example) == local.reset(example) == "12*34="
    assert remote.demonstrate(example) == local.demonstrate(example) == ["c:12*34", "408"]
    for turn in ("c:12*34", "c:5+6", "408"):
        assert remote.step(turn, [1, 2]) == local.step(turn, [1, 2])
    assert remote.observation_role == "tool"
    assert service.sessions.get(remote.session) is None  # done closed it


def test_a_wrong_or_missing_key_is_refused(server, monkeypatch):
    url, _ = server
    monkeypatch.setenv("MEGATRON_RL_ENV_KEY", "wrong")
    with pytest.raises(EnvServerError, match="HTTP 401: a wrong or missing key"):
        _remote(url).reset(Example("1+1=", "2", "t"))
    monkeypatch.delenv("MEGATRON_RL_ENV_KEY")
    with pytest.raises(EnvServerError, match="HTTP 401"):
        call(url, "health", None, 5, 0, 0, None)


def test_an_environment_that_raises_ends_the_call_with_its_words_and_is_not_retried(server):
    url, _ = server
    env = _remote(url, env="test_boom", retries=3)
    env.reset(Example("x", "y", "t"))
    with pytest.raises(EnvServerError, match=r"step: HTTP 500: ValueError: the sandbox crashed"):
        env.step("a", [1])


def test_a_hanging_environment_times_out_and_the_retry_does_not_step_it_twice(server):
    url, _ = server
    env = _remote(url, env="test_hang", timeout_s=0.3, retries=1, backoff_s=0)
    env.reset(Example("x", "y", "t"))
    with pytest.raises(EnvServerError, match=r"step: no answer after 2 tries, timeout_s=0.3"):
        env.step("a", [1])
    GATE.set()  # the first call now finishes; the retry, queued behind it, gets its answer
    assert call(url, "step", {"session": env.session, "turn": 1, "text": "a", "ids": [1]}, 10, 0, 0, KEY) == \
        {"observation": "late", "reward": None, "done": True}
    assert STEPS == ["a"]


def test_a_repeated_turn_gets_the_same_answer_and_turns_come_in_order(server):
    url, _ = server
    env = _remote(url, env="test_count")
    env.reset(Example("x", "y", "t"))
    first = env.step("a", [1])
    again = call(url, "step", {"session": env.session, "turn": 1, "text": "a", "ids": [1]}, 5, 0, 0, KEY)
    assert again == {"observation": first.observation, "reward": 0.5, "done": False} and STEPS == ["a"]
    with pytest.raises(EnvServerError, match="HTTP 409: turn 3 after turn 1"):
        call(url, "step", {"session": env.session, "turn": 3, "text": "b", "ids": []}, 5, 0, 0, KEY)
    env.close()


def test_bad_requests_are_named(server):
    url, _ = server
    with pytest.raises(EnvServerError, match="HTTP 400: unknown environment 'nope'"):
        _remote(url, env="nope").reset(Example("x", "y", "t"))
    with pytest.raises(EnvServerError, match="HTTP 400: calculator takes no setting 'bogus'"):
        _remote(url, settings={"bogus": 1}).reset(Example("x", "y", "t"))
    with pytest.raises(EnvServerError, match="HTTP 400: env=remote"):
        _remote(url, env="remote").reset(Example("x", "y", "t"))
    with pytest.raises(EnvServerError, match="HTTP 404: no session"):
        call(url, "step", {"session": "never", "turn": 1, "text": "", "ids": []}, 5, 0, 0, KEY)


def test_sessions_are_bounded(server):
    url, service = server
    service.sessions.clear()
    envs = [_remote(url, env="test_count", retries=0) for _ in range(4)]
    for env in envs[:3]:
        env.reset(Example("x", "y", "t"))
    with pytest.raises(EnvServerError, match="no answer after 1 tries.*HTTP 503: 3 sessions open"):
        envs[3].reset(Example("x", "y", "t"))
    envs[0].close()
    assert envs[3].reset(Example("x", "y", "t")) == "x"
    service.sessions.clear()


def test_an_unreachable_server_is_retried_then_named():
    env = RemoteEnv(url="http://127.0.0.1:9", env="calculator", retries=1, backoff_s=0, timeout_s=2)
    with pytest.raises(EnvServerError, match=r"http://127.0.0.1:9 reset: no answer after 2 tries"):
        env.reset(Example("x", "y", "t"))


@pytest.mark.parametrize("settings, message", [
    ({"url": "127.0.0.1:8765", "env": "calculator"}, "url='127.0.0.1:8765'"),
    ({"url": "http://h:1"}, "setting env: name the environment"),
    ({"url": "http://h:1", "env": "c", "timeout_s": 0}, "timeout_s=0 must be > 0"),
])
def test_settings_are_checked_when_the_config_loads(settings, message):
    with pytest.raises(ValueError, match=message):
        make_env("remote", **settings)
