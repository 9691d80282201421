"""A pool of servers without vLLM: placement by least work in flight (ServerPool alone), the
config errors of rollout.vllm.num_servers / urls, and the client's pool fault handling against
fake servers (tests/vllm/fake_server.py): a server that dies mid-call has its samples finished by
the others and comes back after a restart; one that may not be restarted stays out; a sync
reaches every server, and one that was down is started on the new weights; an in-memory sync
packs the stream once and sends each bucket to every server; a server that dies mid-turn under
async multi-turn rollouts loses no trajectory."""
import asyncio
import os
import threading
import time

import pytest
import torch

from megatron_rl.config.env_section import EnvSection
from megatron_rl.data.tokenizer import CharTokenizer
from megatron_rl.data.types import Example
from megatron_rl.rollout.function import RolloutFnInputs
from megatron_rl.rollout.multi_turn import MultiTurn
from megatron_rl.rollout.serving.errors import ServerDiedError, UnsupportedError
from megatron_rl.rollout.serving.http import TransportError
from megatron_rl.rollout.serving.pool import DOWN, FAILED, READY, Replica, ServerPool
from megatron_rl.rollout.serving.receivers import Watch
from megatron_rl.rollout.serving.servers import server_cores, server_devices, shared_gpu
from megatron_rl.rollout.types import Request, SamplingParams, stream_seed
from megatron_rl.rollout.vllm import VllmConfig, VllmEngine
from megatron_rl.rollout.vllm.dialect import VLLM_DIALECT
from megatron_rl.rollout.vllm.env import server_env
from megatron_rl.rollout.vllm.transfer import BACKENDS, MemorySync, packed_buckets, push_all
from tests.vllm.conftest import hf_weights, push, tiny_arch
from tests.vllm.fake_server import FakeVllm, good_answer

pytestmark = pytest.mark.vllm

ARCH = tiny_arch()
SAMPLING = SamplingParams(max_tokens=6, stop_token_ids=(1,), seed=5)
PROMPTS = [[4 + i, 5, 6] for i in range(8)]


@pytest.fixture(scope="module")
def weights():
    return hf_weights(ARCH, seed=0)[1]


class _Handle:
    url, can_restart = "http://nowhere", True


def test_placement_takes_the_ready_server_with_least_work_in_flight():
    pool = ServerPool([Replica(k, _Handle(), state=READY) for k in range(3)])
    with pool.serving(10, 1.0) as a, pool.serving(4, 1.0) as b, pool.serving(4, 1.0) as c:
        assert (a.index, b.index, c.index) == (0, 1, 2)  # a tie: the next server after the last one's
        with pool.serving(1, 1.0) as d:
            assert d.index == 1  # 4 < 10, and server 1 ties with server 2: after server 2 come 0, then 1
            pool.set_state(pool.replicas[2], DOWN)
            with pool.serving(1, 1.0) as e:
                assert e.index == 1  # 5 < 10; server 2 is out
    assert [r.in_flight for r in pool.replicas] == [0, 0, 0]
    assert [r.requests for r in pool.replicas] == [1, 3, 1]


def test_placement_waits_for_a_server_coming_back_and_fails_when_none_can():
    pool = ServerPool([Replica(0, _Handle(), state=DOWN), Replica(1, _Handle(), state=FAILED, why="gone")], kind="vLLM")
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.serving(1, 600.0).__enter__().index))
    waiter.start()
    pool.set_state(pool.replicas[0], READY)  # the event the waiter waits for: no timer
    waiter.join(600.0)
    assert got == [0]
    pool.set_state(pool.replicas[0], FAILED, "restart failed")
    with pytest.raises(ServerDiedError, match="no vLLM server of the pool can serve.*restart failed"):
        pool.serving(1, 600.0).__enter__()


@pytest.mark.parametrize("fields, error", [
    ({"url": "http://a:1", "urls": ["http://b:1"]}, "rollout.vllm.url and rollout.vllm.urls are both set"),
    ({"urls": ["ftp://b:1"]}, "rollout.vllm.urls: 'ftp://b:1' must start with http"),
    ({"urls": ["http://b:1", "http://b:1"]}, "rollout.vllm.urls lists a server twice"),
    ({"urls": ["http://b:1", "http://c:1"], "num_servers": 3}, "rollout.vllm.num_servers=3 with 2 server URLs"),
    ({"num_servers": 0}, "rollout.vllm.num_servers"),
])
def test_pool_config_errors_name_the_field(fields, error):
    with pytest.raises(ValueError, match=error):
        VllmConfig(**fields)


def test_a_server_on_the_sender_s_gpu_is_found():
    assert shared_gpu(None, 1, None, 0) == "0"  # nothing set: both on device 0
    assert shared_gpu("1", 1, None, 0) is None
    assert shared_gpu("6,7", 2, "4,5,6,7", 2) == "6" and shared_gpu("6,7", 2, "4,5,6,7", 1) is None
    assert shared_gpu("0,1,2,3", 2, None, 3) is None  # the server takes the first tensor_parallel_size only


def test_in_memory_sync_over_nccl_refuses_a_server_on_the_trainer_s_gpu(monkeypatch, tmp_path):
    """NCCL takes no two ranks of one group on one GPU: the first sync would fail, so the start-up
    refuses it, naming the field and the ways out."""
    from megatron_rl.rollout.vllm import env as servers

    monkeypatch.setattr(servers, "ensure_vllm_python", lambda python: "python")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nccl = BACKENDS["nccl"]
    with pytest.raises(UnsupportedError, match=r"weight_sync=memory with CUDA .* one GPU \(0\).*weight_sync=reload"):
        servers.make_servers(ARCH, VllmConfig(), "memory", str(tmp_path), "cuda", nccl, 64, "raw_logprobs", 8, trainer_gpu=0)
    own = VllmConfig(env={"CUDA_VISIBLE_DEVICES": "1"})
    launched, device = servers.make_servers(ARCH, own, "memory", str(tmp_path), "cuda", nccl, 64, "raw_logprobs", 8, trainer_gpu=0)
    assert device == "cuda" and len(launched) == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,4")  # the trainer's device 0 is physical 2
    with pytest.raises(UnsupportedError, match=r"vLLM server 0 on one GPU \(2\)"):  # server k: k-th of 2,3,4
        servers.make_servers(ARCH, VllmConfig(num_servers=2), "memory", str(tmp_path), "cuda", nccl, 64, "raw_logprobs", 8,
                             trainer_gpu=0)
    pool = VllmConfig(num_servers=2, env={"CUDA_VISIBLE_DEVICES": "3,4"})  # servers 0 and 1 on 3 and 4
    assert len(servers.make_servers(ARCH, pool, "memory", str(tmp_path), "cuda", nccl, 64, "raw_logprobs", 8, trainer_gpu=0)[0]) == 2
    with pytest.raises(UnsupportedError, match=r"vLLM server 1 on one GPU \(4\)"):
        servers.make_servers(ARCH, pool, "memory", str(tmp_path), "cuda", nccl, 64, "raw_logprobs", 8, trainer_gpu=2)


def test_each_launched_server_gets_devices_of_its_own():
    assert [server_devices(None, k, 2, 3, section="rollout.vllm") for k in range(3)] == ["0,1", "2,3", "4,5"]
    assert server_devices("4,5,6,7", 1, 2, 2, section="rollout.vllm") == "6,7"
    with pytest.raises(UnsupportedError, match="rollout.vllm.num_servers=3 x tensor_parallel_size=2 needs 6 GPUs"):
        server_devices("0,1,2,3", 0, 2, 3, section="rollout.vllm")


def test_each_launched_cpu_server_of_a_pool_computes_on_cores_of_its_own(monkeypatch):
    assert [server_cores([0, 1], k, 2) for k in range(2)] == ["0", "1"]
    assert [server_cores(list(range(7)), k, 3) for k in range(3)] == ["0,1", "2,3", "4,5,6"]
    assert [server_cores([0, 1], k, 3) for k in range(3)] == ["0", "1", "0"]  # fewer cores: shared
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5, 6, 7})
    pool = VllmConfig(num_servers=2)
    assert [server_env(pool, "cpu", k, dev=False)["VLLM_CPU_OMP_THREADS_BIND"] for k in range(2)] == ["4,5", "6,7"]
    for cfg in (VllmConfig(), VllmConfig(num_servers=2, env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"}),
                VllmConfig(num_servers=2, tensor_parallel_size=2)):  # one server, the user's, TP ranks: vLLM's own
        assert server_env(cfg, "cpu", 0, dev=False).get("VLLM_CPU_OMP_THREADS_BIND") in (None, "nobind")


def make_pool(tmp_path, weights, behaviours, dialect=VLLM_DIALECT, routes=None, **cfg):
    """An engine of `dialect` on a pool of fakes (one per behaviour; `routes`: FakeVllm's) that took weights."""
    fakes = [FakeVllm(ARCH.vocab_size, b, routes=routes) for b in behaviours]
    options = {"warmup": False, "probe_every": 0, "retry_backoff_s": 0.01, "health_interval_s": 0.5,
               "health_timeout_s": 120.0, "max_concurrency": 4}
    options.update(cfg)
    engine = VllmEngine(ARCH, VllmConfig(**options), str(tmp_path), weight_sync="reload", server=fakes, device="cpu",
                        dialect=dialect)
    push(engine, weights, 3)
    return engine, fakes


def _keys(out):
    return [(s.prompt_index, s.sample_index) for g in out for s in g]


def dies_once_after(n: int):
    """Answers `n` requests, then drops one, which marks the fake dead: it drops every request
    until it is restarted, and answers from then on."""
    state = {"seen": 0}
    lock = threading.Lock()

    def behaviour(body, answer):
        with lock:
            state["seen"] += 1
            return "drop" if state["seen"] == n + 1 else answer

    return behaviour


def _from_its_own_seed(out) -> bool:
    """Each sample is the fake's answer to the seed of its (i, j), whichever server gave it."""
    params = {"max_tokens": SAMPLING.max_tokens, "stop_token_ids": list(SAMPLING.stop_token_ids)}
    return all(s.response_ids.tolist() == good_answer({"sampling_params": {**params, "seed": stream_seed(SAMPLING.seed, i, j)}},
                                                      ARCH.vocab_size)["choices"][0]["token_ids"]
               for i, g in enumerate(out) for j, s in enumerate(g))


def test_a_dead_server_s_samples_go_to_the_others_and_it_restarts(tmp_path, weights):
    engine, (_, b) = make_pool(tmp_path, weights, [None, dies_once_after(1)])
    out = engine.generate(PROMPTS, 2, SAMPLING)
    assert _keys(out) == [(i, j) for i in range(8) for j in range(2)]  # each once
    assert _from_its_own_seed(out)
    engine.fleet.await_restarts()
    stats = engine.stats()
    assert b.restarts == 1 and stats["vllm/restarts"] == 1 and stats["vllm/server1/restarts"] == 1
    assert stats["vllm/server0/requests"] > 0 and stats["vllm/server1/requests"] >= 2
    assert [r.state for r in engine.replicas] == [READY, READY]  # a disk sync: back on the newest folder
    served = engine.replicas[1].requests
    assert _from_its_own_seed(engine.generate(PROMPTS, 2, SAMPLING)) and engine.replicas[1].requests > served
    engine.close()


def test_await_restarts_waits_for_a_take_out_under_way(tmp_path, weights, monkeypatch):
    """The health check takes a server out beside the calls, so a call can return before that
    take-out has queued the restart; await_restarts() must still wait for it. The take-out is held
    inside the server's stop (an event, no timer): await_restarts() returns only after it is let go
    and the restart has run, whenever it is called."""
    engine, (_, b) = make_pool(tmp_path, weights, [None, None])
    replica = engine.replicas[1]
    in_stop, release = threading.Event(), threading.Event()
    stop = replica.server.stop

    def held_stop(graceful=True):
        in_stop.set()
        assert release.wait(600.0)
        stop(graceful)

    monkeypatch.setattr(replica.server, "stop", held_stop)
    taking_out = threading.Thread(target=engine.fleet.lose, args=(replica, replica.epoch, "test: gone"))
    taking_out.start()
    assert in_stop.wait(600.0)  # marked DOWN, its restart not queued yet
    seen = []
    waiter = threading.Thread(target=lambda: (engine.fleet.await_restarts(), seen.append(b.restarts)))
    waiter.start()
    release.set()
    taking_out.join(600.0)
    waiter.join(600.0)
    assert seen == [1] and [r.state for r in engine.replicas] == [READY, READY]
    engine.close()


def test_a_server_that_may_not_restart_stays_out_and_the_pool_fails_when_none_is_left(tmp_path, weights):
    engine, (a, b) = make_pool(tmp_path, weights, [None, dies_once_after(1)])
    b.can_restart = False  # as a server at a URL
    assert _from_its_own_seed(engine.generate(PROMPTS, 2, SAMPLING))
    assert b.restarts == 0 and [r.state for r in engine.replicas] == [READY, FAILED]
    assert "cannot be restarted by us" in engine.replicas[1].why
    a.can_restart = False
    a.behaviour = lambda body, answer: "drop"
    with pytest.raises(ServerDiedError, match="cannot be restarted by us"):
        engine.generate(PROMPTS, 1, SAMPLING)
    engine.close()


def test_every_server_takes_each_sync_and_one_found_dead_is_started_on_it(tmp_path, weights):
    engine, (a, b) = make_pool(tmp_path, weights, [None, None], max_restarts=1)
    b.stop()  # dead between two syncs: its reload request finds no server
    push(engine, weights, 4)
    assert b.restarts == 1 and a.restarts == 0 and engine.policy_version == 4
    assert [r.state for r in engine.replicas] == [READY, READY]
    assert len(engine.generate(PROMPTS, 1, SAMPLING)) == 8
    assert all(r.requests > 0 for r in engine.replicas)
    engine.close()


class _Recorder:
    """A MemorySync's channel and control plane, recorded (what each server would receive)."""

    device = "cpu"

    def __init__(self):
        self.posts, self.received = [], []

    def broadcast(self, data):
        self.received.append(data.clone())

    def close(self):
        pass


def _recorded_syncs(n: int):
    """n in-memory syncs of 160-byte buckets whose HTTP requests and broadcasts are recorded."""
    syncs, recorders = [], []
    for _ in range(n):
        rec = _Recorder()
        sync = MemorySync(_Handle(), BACKENDS["gloo"], bucket_bytes=160, host="127.0.0.1")
        sync.channel = rec
        sync._post = lambda path, body, timeout, rec=rec: rec.posts.append((path, body))
        syncs.append(sync)
        recorders.append(rec)
    return syncs, recorders


def test_one_sync_packs_the_stream_once_and_sends_every_bucket_to_every_server():
    syncs, recorders = _recorded_syncs(2)
    tensors = [(f"t{i}", torch.arange(n, dtype=torch.float32) + 1000 * i) for i, n in enumerate([10, 20, 5, 30, 100])]
    read = []

    def stream():
        for pair in tensors:
            read.append(pair[0])
            yield pair

    assert not push_all(syncs, stream(), version=7, timeout=60.0).failed
    assert read == [n for n, _ in tensors]  # one pass over the export for all servers
    want = [data.clone() for _, data in packed_buckets(tensors, 160)]
    for rec in recorders:
        assert len(rec.received) == len(want) and all(torch.equal(a, b) for a, b in zip(rec.received, want))
        paths = [p for p, _ in rec.posts]
        assert paths == ["/pause?mode=wait", "/start_weight_update", *["/update_weights"] * len(want),
                         "/finish_weight_update", "/resume"]
        assert rec.posts[-2][1] == {"weight_version": "7"}
    for s in syncs:
        s._rpc.shutdown()


def test_a_sync_inside_a_partial_rollout_leaves_the_paused_servers_paused_for_resume():
    """held: the servers whose requests the engine froze (/pause?mode=keep); the sync neither drains
    nor resumes them (its /pause?mode=wait would wait for requests that cannot run), and still
    labels the new weights. A server it did not freeze (one that rejoins, STALE) syncs as usual."""
    syncs, recorders = _recorded_syncs(2)
    push_all(syncs, [("t", torch.ones(8))], version=9, timeout=60.0, held=[syncs[0]])
    paused, rejoining = ([p for p, _ in rec.posts] for rec in recorders)
    assert paused == ["/start_weight_update", "/update_weights", "/finish_weight_update"]
    assert rejoining == ["/pause?mode=wait", "/start_weight_update", "/update_weights", "/finish_weight_update",
                         "/resume"]
    assert all(rec.posts[-1 if rec is recorders[0] else -2][1] == {"weight_version": "9"} for rec in recorders)
    for s in syncs:
        s._rpc.shutdown()


TENSORS = [(f"t{i}", torch.full((30,), float(i))) for i in range(4)]  # 120 bytes each: one bucket each at 160


def _sent(rec) -> list[str]:
    return [p for p, _ in rec.posts]


def test_a_server_that_refuses_the_sync_is_dropped_and_the_others_get_all_of_it():
    """Dead between generation and sync (connection refused): the sync goes on to the live server."""
    syncs, recorders = _recorded_syncs(2)

    def refused(path, body, timeout):
        raise TransportError(f"{path}: [Errno 111] Connection refused")

    syncs[1]._post = refused
    pushed = push_all(syncs, TENSORS, version=3, timeout=60.0)
    assert list(pushed.failed) == [syncs[1]] and "Connection refused" in pushed.failed[syncs[1]]
    assert _sent(recorders[0])[-2:] == ["/finish_weight_update", "/resume"] and len(recorders[0].received) == 4
    assert recorders[1].received == []  # nothing more after its first request failed
    for s in syncs:
        s._rpc.shutdown()


class _Hung(_Recorder):
    """A channel whose second broadcast never returns until `release` is set (a stopped worker)."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()
        self.entered = threading.Event()

    def broadcast(self, data):
        if len(self.received) == 1:
            self.entered.set()
            self.release.wait(600.0)
        super().broadcast(data)


@pytest.mark.parametrize("by", ["health", "deadline"])
def test_a_server_hung_mid_sync_is_dropped_by_its_health_or_the_deadline_and_named(by):
    """Stopped mid-broadcast: dropped once /health fails (checked while the push waits on it), or
    when the sync's deadline passes, whichever is first; the other server gets the whole sync, and
    the push's wall time is bounded by the deadline, not by the hung broadcast."""
    syncs, recorders = _recorded_syncs(2)
    hung = _Hung()
    syncs[1].channel = hung
    hung.posts = recorders[1].posts
    syncs[1]._post = lambda path, body, timeout: hung.posts.append((path, body))
    deadline = 600.0 if by == "health" else 3.0
    watch = Watch(deadline, "rollout.vllm.sync_timeout_s", alive=lambda s: not (s is syncs[1] and hung.entered.is_set()),
                  interval_s=0.05, health_setting="rollout.vllm.health_timeout_s=10 s")
    t0 = time.perf_counter()
    try:
        pushed = push_all(syncs, TENSORS, version=4, timeout=600.0,
                          watch=watch if by == "health" else Watch(deadline, "rollout.vllm.sync_timeout_s"))
        wall = time.perf_counter() - t0
    finally:
        hung.release.set()
    want = ("stopped answering /health during the sync, hung or dead (rollout.vllm.health_timeout_s=10 s)"
            if by == "health" else "did not finish its part of the sync within rollout.vllm.sync_timeout_s=3 s")
    assert pushed.failed[syncs[1]] == want
    if by == "health":  # found before the deadline: the other server finishes the sync
        assert list(pushed.failed) == [syncs[1]]
        assert len(recorders[0].received) == 4 and _sent(recorders[0])[-1] == "/resume"
    else:  # the deadline bounds the whole sync: the other is left unfinished, and says why
        assert "rollout.vllm.sync_timeout_s=3 s ran out while the sync waited" in pushed.failed[syncs[0]]
    assert "/finish_weight_update" not in _sent(hung)
    assert wall < deadline + 30.0  # the deadline bounds it (slack: a loaded 2-core machine)
    for s in syncs:
        s._rpc.shutdown()


def test_a_server_killed_mid_turn_under_async_turns_loses_no_trajectory(tmp_path, weights, echo_env):
    """multi_turn with env.turns=async (each trajectory its own coroutine, each request on its own)
    over a pool of 2: server 1 dies at the first later-turn request it gets (its prompt holds an
    observation), so the fault strikes mid-trajectory. Its requests go to server 0, every
    trajectory finishes all its turns, and each is token for token the one a pool without the fault
    gives (a request's seed, not its server, decides)."""
    tok = CharTokenizer()
    fn = MultiTurn(RolloutFnInputs(tok, None, EnvSection(name=echo_env, max_turns=3, max_tokens=40,
                                                         turns="async")))
    examples = [Example(p, "", "echo") for p in ("12+3=", "7*8=", "guess:", "abc")]
    sampling = SamplingParams(max_tokens=5, stop_token_ids=tok.stop_ids, seed=11)
    healthy, _ = make_pool(tmp_path / "healthy", weights, [None, None])
    observation = tok.encode(" ok:")
    struck = threading.Event()

    def dies_at_a_later_turn(body, answer):
        ids = body["token_ids"]
        later = any(ids[k:k + len(observation)] == observation for k in range(len(ids)))
        if later and not struck.is_set():
            struck.set()
            return "drop"  # marks the fake dead: it drops everything until restarted
        return answer

    faulty, (_, b) = make_pool(tmp_path / "faulty", weights, [None, dies_at_a_later_turn])
    try:
        want, got = fn(healthy, examples, 2, sampling), fn(faulty, examples, 2, sampling)
        assert struck.is_set() and faulty.stats()["vllm/retries"] >= 1
        assert got.stats["env/turns"] == want.stats["env/turns"] == 3
        assert len(got.samples) == len(want.samples) == 8
        for a, c in zip(got.samples, want.samples, strict=True):
            assert a.prompt_ids.tolist() == c.prompt_ids.tolist()
            assert a.response_ids.tolist() == c.response_ids.tolist() and a.loss_mask.tolist() == c.loss_mask.tolist()
        assert got.score() == want.score() == [3.0] * 8
        assert not any(k.startswith("rollout/prefix_cache/") for k in got.stats)  # the fakes do not say
        faulty.fleet.await_restarts()
        assert b.restarts == 1 and faulty.stats()["vllm/server1/restarts"] == 1
    finally:
        healthy.close()
        faulty.close()


def test_the_prefix_cache_share_the_servers_report_reaches_the_rollout_s_stats(tmp_path, weights, echo_env):
    """Fakes that report a prompt's cached tokens (usage.prompt_tokens_details.cached_tokens, as
    vLLM with --enable-prompt-tokens-details): a third of it on server 0, half on server 1. The
    async multi_turn call's rollout/prefix_cache/{first,later}/share is sum cached / sum prompt
    tokens over the requests the fakes received, recomputed here from their own records (a first
    turn's prompt is an example's)."""
    tok = CharTokenizer()
    fn = MultiTurn(RolloutFnInputs(tok, None, EnvSection(name=echo_env, max_turns=3, max_tokens=40,
                                                         turns="async")))
    examples = [Example(p, "", "echo") for p in ("12+3=", "7*8=", "guess:", "abc")]
    engine, fakes = make_pool(tmp_path, weights, [None, None])
    rules = (lambda ids: len(ids) // 3, lambda ids: len(ids) // 2)
    for fake, rule in zip(fakes, rules, strict=True):
        fake.cached_tokens = rule
    try:
        got = fn(engine, examples, 2, SamplingParams(max_tokens=5, stop_token_ids=tok.stop_ids, seed=11))
    finally:
        engine.close()
    firsts = [tok.encode_prompt(e.prompt) for e in examples]
    sums = {"first": [0, 0], "later": [0, 0]}
    for fake, rule in zip(fakes, rules, strict=True):
        for body in fake.requests:
            ids = body["token_ids"]
            bucket = sums["first" if ids in firsts else "later"]
            bucket[0], bucket[1] = bucket[0] + rule(ids), bucket[1] + len(ids)
    assert got.stats["env/turns"] == 3 and all(f.requests for f in fakes)
    assert sums["later"][1] > 0
    for b, (cached, prompt) in sums.items():
        assert got.stats[f"rollout/prefix_cache/{b}/share"] == pytest.approx(cached / prompt, abs=1e-12)
        assert got.stats[f"rollout/prefix_cache/{b}/prompt_tokens"] == prompt


def test_each_server_s_throughput_covers_requests_sent_one_by_one(tmp_path, weights):
    """vllm/server{k}/tokens_per_s is measured over each burst of calls, so requests sent as
    coroutines (single_turn's groups, async turns) count as generate() calls do."""
    engine, _ = make_pool(tmp_path, weights, [None, None])
    requests = [Request(p, SAMPLING, (i, 0)) for i, p in enumerate(PROMPTS)]

    async def each():
        return await asyncio.gather(*(engine.sample(r) for r in requests))

    try:
        samples = asyncio.run(each())
        stats = engine.stats()
        assert len(samples) == len(PROMPTS)
        assert all(stats[f"vllm/server{k}/tokens"] > 0 and stats[f"vllm/server{k}/tokens_per_s"] > 0 for k in (0, 1))
    finally:
        engine.close()
