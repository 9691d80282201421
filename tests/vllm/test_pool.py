"""A pool of two real CPU vLLM servers (rollout.vllm.num_servers=2, in-memory weight sync): the
requests spread over both; one server killed mid-generate loses no sample and duplicates none,
and the samples are those of the unkilled call (seeded sampling: a sample depends on its seed,
not on the server); the killed server restarts on random weights, stays out until the next sync
reaches it, then serves again; one killed between generate and sync, or SIGSTOPped mid-sync,
misses that sync (the other takes it, within rollout.vllm.sync_timeout_s), is restarted and
filled by the next; and pretrain_rl.py completes RL steps under the staged schedule on the same
two servers as a pool of URLs (rollout.vllm.urls).

Two server starts for the module (one pool, module-scoped) plus a restart per fault. The servers
run the model in their EngineCore process (ONE_PROCESS_ENGINE, conftest.py): the layout's own
faults (the whole group dying with the trainer) are test_reaping.py's and test_trainer_loop.py's. The
kill is triggered by an event, never a timer: server 1 is killed once it has answered a request
of the call, while the first request sent to it is held back until then, so the call cannot end
before the kill however fast or slow the machine."""
import json
import os
import secrets
import signal
import subprocess
import sys

import pytest
import torch

from megatron_rl.rollout.types import SamplingParams
from megatron_rl.rollout.vllm import VllmConfig, VllmEngine
from megatron_rl.rollout.vllm.protocol import GENERATE
from tests.vllm.conftest import ONE_PROCESS_ENGINE, fault_after_first_answer, hf_weights, tiny_arch
from tests.vllm.test_trainer_loop import CONFIG, ROOT, _env, check_schedule

pytestmark = pytest.mark.vllm

ARCH = tiny_arch()
PROMPTS = [[4 + i % 40, 5 + i % 7, 14, 8 + i % 5] for i in range(24)]
SAMPLING = SamplingParams(temperature=1.0, max_tokens=48, seed=7)
GUARD_S = 600.0  # hang guards only


@pytest.fixture(scope="module")
def pool(vllm_python, tmp_path_factory):
    """Two launched servers sharing one key (so that a trainer in another process can reach both
    as URLs, given the key), on the weights of seed 0."""
    cfg = VllmConfig(python=vllm_python, dtype="float32", max_num_seqs=32, num_servers=2, health_interval_s=2.0,
                     health_timeout_s=30.0, max_restarts=1, sync_timeout_s=120.0, env=ONE_PROCESS_ENGINE)
    engine = VllmEngine(ARCH, cfg, str(tmp_path_factory.mktemp("vllm_pool")))
    key = secrets.token_urlsafe(16)
    for r in engine.replicas:
        r.server.api_key = key
    weights = hf_weights(ARCH, seed=0)[1]
    try:
        engine.update_weights(weights, 0)
        yield engine, weights, key
    finally:
        engine.close()


@pytest.fixture(scope="module")
def unkilled(pool):
    engine = pool[0]
    before = [r.requests for r in engine.replicas]
    out = engine.generate(PROMPTS, 2, SAMPLING)
    served = [r.requests - b for r, b in zip(engine.replicas, before)]
    return out, served


def _keys(out):
    return [[(s.prompt_index, s.sample_index) for s in g] for g in out]


def _same(a, b):
    return all(torch.equal(x.response_ids, y.response_ids) and torch.equal(x.rollout_logprobs, y.rollout_logprobs)
               for g, h in zip(a, b) for x, y in zip(g, h))


def test_requests_spread_over_both_servers(pool, unkilled):
    engine = pool[0]
    out, served = unkilled
    assert _keys(out) == [[(i, 0), (i, 1)] for i in range(len(PROMPTS))]
    assert all(n > 0 for n in served) and sum(served) == 2 * len(PROMPTS), served
    stats = engine.stats()
    assert stats["vllm/probe_max_abs_diff"] < 1e-5  # the larger of the two servers' probes
    assert all(stats[f"vllm/server{k}/probe_max_abs_diff"] < 1e-5 for k in (0, 1))
    assert all(stats[f"vllm/server{k}/tokens"] > 0 and stats[f"vllm/server{k}/tokens_per_s"] > 0 for k in (0, 1))


def _kill_server_during_generate(engine, k, monkeypatch):
    """engine.generate(PROMPTS, 2, SAMPLING) with server k's process group SIGKILLed once it has
    answered a request of the call; the first request sent to it is held back until then."""
    server = engine.replicas[k].server
    pid = server.pid
    struck = fault_after_first_answer(monkeypatch, lambda: os.killpg(pid, signal.SIGKILL),
                                      url=server.url + GENERATE)
    out = engine.generate(PROMPTS, 2, SAMPLING)
    monkeypatch.undo()
    assert struck.is_set()
    return out


def test_a_server_killed_mid_generate_loses_no_sample_and_rejoins_after_the_next_sync(pool, unkilled, monkeypatch):
    engine, weights, _ = pool
    before = engine.stats()
    out = _kill_server_during_generate(engine, 1, monkeypatch)
    after = engine.stats()
    assert _keys(out) == _keys(unkilled[0])  # every (i, j) once
    assert _same(out, unkilled[0])  # the other server finished them: the same samples
    assert after["vllm/retries"] > before["vllm/retries"]
    assert engine.replicas[1].state in ("down", "stale")  # restarting, or up on random weights: out of the pool
    # the next sync waits for the restart and reaches both; then both serve again, the same samples
    engine.update_weights(weights, 1)
    assert engine.stats()["vllm/restarts"] == before["vllm/restarts"] + 1
    assert [r.state for r in engine.replicas] == ["ready", "ready"]
    assert engine.stats()["vllm/server1/probe_max_abs_diff"] < 1e-5
    requests = engine.replicas[1].requests
    again = engine.generate(PROMPTS, 2, SAMPLING)
    assert _same(again, unkilled[0]) and engine.replicas[1].requests > requests
    assert engine.stats()["vllm/server1/restarts"] == 1


def test_a_server_killed_between_generate_and_sync_misses_one_sync_and_is_filled_by_the_next(pool, unkilled):
    """Killed while the trainer trains: the next sync finds it dead, goes to the other server, and
    restarts it; it serves nothing (STALE) until the sync after fills it."""
    engine, weights, _ = pool
    restarts = engine.stats()["vllm/restarts"]
    server = engine.replicas[1].server
    os.killpg(server.pid, signal.SIGKILL)
    server.proc.wait(GUARD_S)  # dead (reaped) before the sync: the event, no timer
    engine.update_weights(weights, 2)  # before: TransportError (connection refused) and the run stopped
    assert engine.replicas[0].state == "ready" and engine.replicas[1].state in ("down", "stale")
    engine.update_weights(weights, 3)  # waits for the restart, and fills it
    assert [r.state for r in engine.replicas] == ["ready", "ready"]
    assert engine.stats()["vllm/restarts"] == restarts + 1
    requests = engine.replicas[1].requests
    again = engine.generate(PROMPTS, 2, SAMPLING)
    assert _same(again, unkilled[0]) and engine.replicas[1].requests > requests


# killed: its /update_weights is refused (TransportError), its broadcast is cut (gloo's error) or
# its /health fails during the broadcast, whichever the trainer sees first (a race: all three name
# the server and drop it); stopped: only the health watch can tell
@pytest.mark.parametrize("sig, causes", [(signal.SIGSTOP, ("stopped answering /health",)),
                                         (signal.SIGKILL, ("TransportError", "gloo", "onnection",
                                                           "stopped answering /health"))],
                         ids=["stopped", "killed"])
def test_a_server_stopped_or_killed_mid_sync_is_dropped_within_the_deadline(pool, unkilled, caplog, sig, causes):
    """SIGSTOPped (or SIGKILLed) as its first bucket goes out: the sync ends on the other server,
    within rollout.vllm.sync_timeout_s (before: a stopped one hung the run for startup_timeout_s,
    624 s; a killed one stopped it), naming the server, the cause and, for a hang, the setting; it
    is restarted and the next sync fills it."""
    engine, weights, _ = pool
    replica = engine.replicas[1]
    pid, real_post, struck = replica.server.pid, replica.memory._post, []

    def post(path, body, timeout):
        if path == "/update_weights" and not struck:
            os.killpg(pid, sig)  # the event: mid-sync, after its pause and start
            struck.append(path)
        return real_post(path, body, timeout)

    replica.memory._post = post
    try:
        engine.update_weights(weights, 4)
    finally:
        del replica.memory._post
    assert struck and engine.replicas[0].state == "ready" and replica.state in ("down", "stale")
    assert engine.stats()["timing/vllm_memory_sync"] < engine.cfg.sync_timeout_s
    dropped = [r.getMessage() for r in caplog.records if "dropped from the in-memory sync of version 4" in r.getMessage()]
    assert dropped and all("server1" in m and "server0" not in m for m in dropped), dropped
    assert any(c in m for m in dropped for c in causes), dropped
    if sig == signal.SIGSTOP:
        assert any("rollout.vllm.health_timeout_s" in m for m in dropped), dropped
    engine.update_weights(weights, 5)
    assert [r.state for r in engine.replicas] == ["ready", "ready"]
    assert _same(engine.generate(PROMPTS, 2, SAMPLING), unkilled[0])


def test_rl_steps_on_a_pool_of_server_urls_under_the_staged_schedule(pool, tmp_path, vllm_python):
    """pretrain_rl.py for four steps against the pool's two servers as rollout.vllm.urls (their
    shared key in the environment), under the staged schedule (a stage's batches in one request
    burst, then held-out evaluations): the trainer streams its weights into both (no weight file),
    both served its rollouts, and the schedule's record holds (check_schedule: staleness 0, 1, 0,
    1 in two generate calls; the tokens of the current weights match the fp32 trainer, ~0)."""
    engine, _, key = pool
    urls = ", ".join(f'"{r.server.url}"' for r in engine.replicas)
    config = tmp_path / "vllm_pool.yaml"
    config.write_text(CONFIG.format(run_dir=tmp_path / "run").replace("steps: 2,", "steps: 4,").replace(
        "max_tokens: 8}", f"max_tokens: 8, vllm: {{urls: [{urls}]}}}}"))
    env = dict(_env(vllm_python), MEGATRON_RL_VLLM_API_KEY=key)
    summary_path = tmp_path / "summary.json"
    run = subprocess.run([sys.executable, "pretrain_rl.py", "--config", str(config), "--summary-json",
                          str(summary_path), "train.schedule=staged", "train.stages=2"], check=False, cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert json.loads(summary_path.read_text())["steps"] == 4
    assert not os.path.exists(tmp_path / "run" / "weights")  # weights went in memory (the default): no file
    rows = check_schedule(tmp_path / "run", [0, 1, 0, 1], 2, evaluates=True)
    assert all(rows[-1][f"vllm/server{k}/requests"] > 0 for k in (0, 1)), rows[-1]
    assert rows[-1]["vllm/restarts"] == 0
