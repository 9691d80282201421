"""Real vLLM server faults: RestartSync, and a server killed mid-generation is restarted on the
latest weights and the call still returns every sample exactly once. A frozen server (SIGSTOP) is
found by the same request deadline and restart as the fake hung server of test_client_faults.py,
and a real one frozen mid-sync by test_pool.py.

The fault is triggered by events, never by a timer: it strikes when the server has answered the
first request of the generate() call, while one request of that call is held back until the fault
has struck, so the call can never finish before the fault, however fast or slow the machine."""
import os
import signal
import time

import pytest
import torch

from megatron_rl.rollout.types import SamplingParams
from megatron_rl.rollout.vllm import VllmConfig, VllmEngine
from tests.vllm.conftest import ONE_PROCESS_ENGINE, fault_after_first_answer, hf_weights, push, tiny_arch

pytestmark = pytest.mark.vllm

ARCH = tiny_arch()
PROMPTS = [[4 + i % 40, 5 + i % 7, 14, 8 + i % 5] for i in range(32)]
LONG = SamplingParams(temperature=1.0, max_tokens=48, seed=21)  # the faults wait for events, not for length


@pytest.fixture(scope="module")
def engine(vllm_python, tmp_path_factory):
    # health_timeout_s: how long /health may take before the server counts as hung. A frozen server
    # never answers, so this only sets how fast the freeze is seen; it is generous so that a busy
    # server on a loaded machine is never taken for a frozen one.
    cfg = VllmConfig(python=vllm_python, dtype="float32", max_num_seqs=64, max_model_len=256,
                     health_interval_s=2.0, health_timeout_s=30.0, max_restarts=1, env=ONE_PROCESS_ENGINE)
    eng = VllmEngine(ARCH, cfg, str(tmp_path_factory.mktemp("vllm_restart")), weight_sync="restart")
    push(eng, hf_weights(ARCH, seed=0)[1], 0)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def synced(engine):
    """RestartSync to new weights (a full server restart, timed); the expected samples on them."""
    pid = engine.server.pid
    push(engine, hf_weights(ARCH, seed=2)[1], 1)
    assert engine.server.pid != pid and engine.stats()["vllm/probe_max_abs_diff"] < 1e-3
    print(f"\nRestartSync: {engine.stats()['timing/vllm_restart']:.1f} s")
    return engine.generate(PROMPTS, 2, LONG)


def _fault_during_generate(engine, sig, monkeypatch):
    """engine.generate(PROMPTS, 2, LONG) with `sig` sent to the server's process group as soon as
    the server has answered one request of the call (the first request is held back until then)."""
    pid = engine.server.pid
    struck = fault_after_first_answer(monkeypatch, lambda: os.killpg(pid, sig))
    t0 = time.perf_counter()
    out = engine.generate(PROMPTS, 2, LONG)
    seconds = time.perf_counter() - t0
    monkeypatch.undo()
    assert struck.is_set() and engine.server.pid != pid
    return out, seconds


def _same(a, b):
    return all(torch.equal(x.response_ids, y.response_ids) for g, h in zip(a, b) for x, y in zip(g, h))


def test_killed_server_is_restarted_and_the_call_completes(engine, synced, monkeypatch):
    before = engine.stats()
    out, seconds = _fault_during_generate(engine, signal.SIGKILL, monkeypatch)
    after = engine.stats()
    assert after["vllm/restarts"] == before["vllm/restarts"] + 1
    assert after["vllm/retries"] > before["vllm/retries"]
    assert [[(s.prompt_index, s.sample_index) for s in g] for g in out] == [[(i, 0), (i, 1)] for i in range(32)]
    assert _same(out, synced)  # restarted on the latest weights: same samples as without the fault
    assert all(s.policy_version == 1 for g in out for s in g)
    print(f"\nkill -9 mid-generate: call took {seconds:.1f} s, restart {after['timing/vllm_restart']:.1f} s, "
          f"{int(after['vllm/retries'] - before['vllm/retries'])} samples re-sent")
