"""The environment server as its own process (python -m megatron_rl.data.envs.server) on 127.0.0.1,
driven by `env.name: remote` through the multi-turn rollout's deadline wrapper (EnvCalls): our
calculator answers as the local one does, a failing environment and a hanging one end their
trajectories (counted as an error and a timeout), and the server refuses a wrong key."""
import os
import signal
import subprocess
import sys

import pytest

from megatron_rl.data.envs import make_env
from megatron_rl.data.types import Example
from megatron_rl.rollout.env_calls import EnvCalls

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEY = "env-server-test-key"
TOY = {"call_open": "c:", "call_close": "", "result_open": "r:", "result_close": ""}


@pytest.fixture(scope="module")
def url():
    env = dict(os.environ, MEGATRON_RL_ENV_KEY=KEY, PYTHONPATH=ROOT)
    proc = subprocess.Popen([sys.executable, "-m", "megatron_rl.data.envs.server", "--port", "0",
                             "--plugins", "tests.tools.env_server_envs"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # the server prints its address once it listens
    if not line.startswith("serving environments"):
        proc.kill()
        pytest.fail(f"the server did not start: {line!r} {proc.stderr.read()[-2000:]}")
    assert "calculator" in line and "test_fail" in line and "test_hang" in line
    yield line.split(" on ")[-1].strip()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM


def test_trajectories_through_a_server_process(url, monkeypatch):
    monkeypatch.setenv("MEGATRON_RL_ENV_KEY", KEY)
    example = Example("12*34=", "408", "multiplication")
    good = make_env("remote", url=url, env="calculator", settings=TOY)
    local = make_env("calculator", **TOY)
    fail = make_env("remote", url=url, env="test_fail")
    hang = make_env("remote", url=url, env="test_hang", timeout_s=60, retries=0)
    calls = EnvCalls(timeout_s=5.0, max_stuck=4)
    resets = calls.run([lambda e=e: e.reset(example) for e in (good, fail, hang)], ["a.reset", "b.reset", "c.reset"])
    assert [r.value for r in resets] == ["12*34="] * 3
    local.reset(example)
    steps = calls.run([lambda: good.step("c:12*34", [1]), lambda: fail.step("x", [1]), lambda: hang.step("x", [1])],
                      ["a.step", "b.step", "c.step"])
    assert steps[0].value == local.step("c:12*34", [1])
    assert steps[1].failure.startswith("error: EnvServerError") and "HTTP 500: RuntimeError: the tool's sandbox is gone" \
        in steps[1].failure
    assert steps[2].failure == "timeout"
    assert good.step("408", [2]) == local.step("408", [2])


def test_a_wrong_key_is_refused(url, monkeypatch):
    from megatron_rl.data.envs.remote import EnvServerError

    monkeypatch.setenv("MEGATRON_RL_ENV_KEY", "not-the-key")
    with pytest.raises(EnvServerError, match="HTTP 401"):
        make_env("remote", url=url, env="calculator").reset(Example("1+1=", "2", "t"))


def test_the_server_refuses_to_start_without_a_key():
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_RL_ENV_KEY"}
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.data.envs.server", "--port", "0"], cwd=ROOT,
                          env=dict(env, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and "set MEGATRON_RL_ENV_KEY" in proc.stderr
