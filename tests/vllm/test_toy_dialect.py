"""A server kind other than vLLM plugs into the serving layer (rollout/serving) as a dialect: this
file's ToyDialect (its own generate path, body and answer field names) plus one registry line.
An engine built with it generates on a pool of 2 fake servers (tests/vllm/fake_server.py, taught
the toy path by its `routes` hook), keeps every sample when one server dies mid-call (it is
restarted), and draws the same samples as vLLM's dialect for the same seeds. Its launch side is
its own command line and health path. Its pause, resume and abort are its own paths and bodies
(the fake answers them through the same hook), sent to both servers at once."""
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

from megatron_rl.rollout.pausing import GenerationAborted
from megatron_rl.rollout.serving import DIALECTS, Control, Parsed
from megatron_rl.rollout.serving.errors import ParityError
from megatron_rl.rollout.serving.http import BadResponse
from megatron_rl.rollout.serving.launcher import LocalServer
from megatron_rl.rollout.serving.pool import READY
from megatron_rl.rollout.types import SamplingParams
from megatron_rl.rollout.vllm import VllmConfig, VllmEngine
from megatron_rl.rollout.vllm.dialect import VLLM_DIALECT
from tests.vllm.conftest import hf_weights, push
from tests.vllm.fake_server import FakeVllm
from tests.vllm.test_abort import GUARD_S, generate_in_background
from tests.vllm.test_pool_faults import (
    ARCH,
    PROMPTS,
    SAMPLING,
    _keys,
    dies_once_after,
    make_pool,
)

pytestmark = pytest.mark.vllm


@dataclass(frozen=True)
class ToyDialect:
    """A made-up server: POST /toy/generate {"input_ids", "max_new_tokens", ..., "stop"} answers
    {"output_ids", "output_logprobs", "stop_reason"}; it is launched as `python -m toy_server`;
    POST /toy/freeze, /toy/thaw, /toy/cancel pause, resume and abort, each answering a JSON object.
    It takes weights from a folder only (weight_sync=reload), loading them as vLLM's does (its
    receiver is vLLM's), and labels them with POST /toy/label {"version"}. POST /toy/score
    {"input_ids"} answers {"logprobs": [log p(x_t | x_<t) for t >= 1]} (the parity probe)."""

    name: str = "toy"
    generate_path: str = "/toy/generate"
    health_path: str = "/toy/health"
    control_hint: str = "toy_server --control"
    weight_syncs: tuple[str, ...] = ("reload",)

    def server_flags(self, cfg, max_model_len: int, logprobs_mode: str, max_logprobs: int,
                     receiver: Sequence[str] = ()) -> list[str]:
        return ["--context-length", str(max_model_len), *receiver, *cfg.extra_args]

    def server_argv(self, model_dir: str, model_name: str, host: str, port: int, flags: Sequence[str]) -> list[str]:
        return ["-m", "toy_server", "--model-path", model_dir, "--name", model_name, "--bind", f"{host}:{port}", *flags]

    def generate_body(self, model: str, prompt: list[int], sampling: SamplingParams, seed: int,
                      num_logprobs: int = 0) -> dict:
        return {"model": model, "input_ids": list(prompt), "max_new_tokens": sampling.max_tokens,
                "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
                "seed": seed, "stop": sorted(set(sampling.stop_token_ids)), "top_n": num_logprobs}

    def answer_cap(self, prompt_len: int, sampling: SamplingParams, num_logprobs: int = 0,
                   routed_values: int = 0) -> int:
        return 1024 + 64 * sampling.max_tokens  # an id and a float per token

    def parse_generate(self, resp, prompt_len: int, sampling: SamplingParams, vocab_size: int,
                       max_model_len: int | None = None, num_logprobs: int = 0) -> Parsed:
        ids, lps, finish = (resp.get(k) for k in ("output_ids", "output_logprobs", "stop_reason")) \
            if isinstance(resp, dict) else (None, None, None)
        if not isinstance(ids, list) or not ids or not all(type(t) is int and 0 <= t < vocab_size for t in ids):
            raise BadResponse(f"output_ids is {ids!r:.100}")
        if len(ids) > sampling.max_tokens or not isinstance(lps, list) or len(lps) != len(ids) or \
                not all(isinstance(x, float) and math.isfinite(x) and x <= 0 for x in lps):
            raise BadResponse(f"{len(ids)} output_ids, output_logprobs {lps!r:.100}")
        if finish not in ("stop", "length") or (finish == "stop") != (ids[-1] in sampling.stop_token_ids):
            raise BadResponse(f"stop_reason {finish!r:.20} after token {ids[-1]}")
        return Parsed(torch.tensor(ids, dtype=torch.long), torch.tensor(lps, dtype=torch.float32), finish,
                      None, None, None)

    def pause_calls(self) -> list[Control]:
        return [Control("POST", "/toy/freeze", {"keep_state": True})]

    def resume_calls(self) -> list[Control]:
        return [Control("POST", "/toy/thaw", {"recompute": True})]

    def abort_calls(self, paused: bool) -> list[Control]:
        return [Control("POST", "/toy/cancel", {"stay_frozen": paused})]

    def read_control(self, call: Control, answer) -> None:
        if not isinstance(answer, dict):
            raise BadResponse(f"{call.path} answered {answer!r:.100}, not a JSON object")

    def receiver_flags(self, backend) -> list[str]:
        return []  # takes no weights in memory

    def memory_receiver(self, server, backend, bucket_bytes: int, host: str):
        raise NotImplementedError("the toy takes no weights in memory")

    def disk_receiver(self, weight_sync: str):
        return VLLM_DIALECT.disk_receiver(weight_sync)

    def version_label(self, version: int) -> Control:
        return Control("POST", "/toy/label", {"version": version})

    def score_call(self, model: str, tokens: list[int]) -> Control:
        return Control("POST", "/toy/score", {"input_ids": list(tokens)})

    def score_cap(self, num_tokens: int) -> int:
        return 1024 + 32 * num_tokens

    def parse_score(self, answer, tokens: list[int]) -> torch.Tensor:
        lps = answer.get("logprobs") if isinstance(answer, dict) else None
        if not isinstance(lps, list) or len(lps) != len(tokens) - 1 or not all(isinstance(x, float) for x in lps):
            raise BadResponse(f"logprobs is {lps!r:.100}")
        return torch.tensor(lps, dtype=torch.float32)


def _to_vllm(body: dict) -> dict:
    """The fake's hook: a toy body as the fake's vLLM handler reads it."""
    return {"token_ids": body["input_ids"], "sampling_params": {"max_tokens": body["max_new_tokens"],
                                                                "seed": body["seed"], "stop_token_ids": body["stop"]}}


def _from_vllm(answer: dict) -> dict:
    c = answer["choices"][0]
    return {"output_ids": c["token_ids"], "output_logprobs": [e["logprob"] for e in c["logprobs"]["content"]],
            "stop_reason": c["finish_reason"]}


@pytest.fixture(scope="module")
def toy():
    DIALECTS.add("toy", ToyDialect())  # the one registry line a new server kind adds
    yield DIALECTS.get("toy")
    DIALECTS.remove("toy")


@pytest.fixture(scope="module")
def weights():
    return hf_weights(ARCH, seed=0)[1]


def _routes():
    """The toy path on a fake, counting the requests that came in the toy's form."""
    seen, lock = [], threading.Lock()

    def inbound(body):
        with lock:
            seen.append(body["seed"])
        return _to_vllm(body)

    return {ToyDialect.generate_path: (inbound, _from_vllm)}, seen


def _samples(out):
    return [(s.prompt_index, s.sample_index, s.response_ids.tolist(), s.rollout_logprobs.tolist(), s.finish_reason,
             s.policy_version, s.token_versions) for g in out for s in g]


def test_a_toy_dialect_engine_fails_over_and_samples_as_the_vllm_one(tmp_path, weights, toy):
    routes, seen = _routes()
    engine, (a, b) = make_pool(tmp_path / "toy", weights, [None, dies_once_after(1)], dialect=toy, routes=routes)
    out = engine.generate(PROMPTS, 2, SAMPLING)
    assert _keys(out) == [(i, j) for i in range(8) for j in range(2)]  # each once, though server 1 died
    engine.fleet.await_restarts()
    assert b.restarts == 1 and engine.stats()["vllm/restarts"] == 1
    assert [r.state for r in engine.replicas] == [READY, READY]
    assert len(seen) == len(a.requests) + len(b.requests) >= 17  # every request on the toy's path; one dropped
    assert not any("output_mode" in r for f in (a, b) for r in f.requests)  # in the toy's form (no vLLM field)
    engine.close()

    vllm, fakes = make_pool(tmp_path / "vllm", weights, [None, None], dialect=VLLM_DIALECT)
    assert _samples(vllm.generate(PROMPTS, 2, SAMPLING)) == _samples(out)  # same seeds: the same samples
    assert all(f.requests for f in fakes) and all(r["output_mode"] == "tokens" for f in fakes for r in f.requests)
    vllm.close()


def test_a_bad_toy_answer_is_retried_and_counted(tmp_path, weights, toy):
    """The toy's parse is the engine's validation: an answer it refuses is a bad answer, retried."""
    routes, _ = _routes()
    lock, state = threading.Lock(), {"bad": 0}

    def one_bad(body, answer):
        with lock:
            state["bad"] += 1
            if state["bad"] > 1:
                return answer
        answer["choices"][0]["logprobs"]["content"][0]["logprob"] = 0.5  # a log-prob above 0
        return answer

    engine, _ = make_pool(tmp_path, weights, [one_bad], dialect=toy, routes=routes)
    assert _keys(engine.generate(PROMPTS[:2], 1, SAMPLING)) == [(0, 0), (1, 0)]
    assert engine.stats()["vllm/bad_responses"] == 1
    engine.close()


def test_the_toy_s_launch_is_its_own(toy):
    flags = toy.server_flags(type("Cfg", (), {"extra_args": ["--x"]})(), 128, "raw_logprobs", 8)
    server = LocalServer("/py", flags, {}, "/tmp/toy.log", dialect=toy)
    assert server.command("/m", 9) == ["/py", "-m", "toy_server", "--model-path", "/m", "--name", "policy",
                                       "--bind", "127.0.0.1:9", "--context-length", "128", "--x"]


def test_the_toy_s_abort_pause_and_resume_reach_both_servers_at_once(tmp_path, weights, toy):
    """abort() ends the call in flight through /toy/cancel on both servers. pause() freezes the next
    call on both through /toy/freeze, sent at once: each server's answers only once the other's has
    arrived (a barrier, an event: sent one after the other, the first would wait in vain and its
    server be lost). resume() thaws both and the call's samples come back."""
    routes, _ = _routes()
    bodies, both = [], threading.Barrier(2, timeout=GUARD_S)

    def freeze(body):
        bodies.append(body)
        both.wait()  # BrokenBarrierError (no answer: the server is lost) unless both were sent at once
        return {"frozen": True}

    routes.update({"/toy/freeze": freeze, "/toy/thaw": lambda body: bodies.append(body) or {"thawed": True},
                   "/toy/cancel": "abort"})
    hold = ["the calls"]
    hang = lambda body, answer: "hang" if hold else answer
    engine, fakes = make_pool(tmp_path, weights, [hang, hang], dialect=toy, routes=routes)
    thread, outcome = generate_in_background(engine, PROMPTS, SAMPLING)
    assert all(f.hanging.wait(GUARD_S) for f in fakes)  # a request of the call on each server
    engine.abort()  # returns once the call has ended: each server ended its hung requests on /toy/cancel
    thread.join(GUARD_S)
    assert isinstance(outcome.get("error"), GenerationAborted) and [f.aborts for f in fakes] == [1, 1]
    assert all(f.posts[-1] == "/toy/cancel" for f in fakes)
    engine.resume()

    for f in fakes:
        f.hanging.clear()
    thread, outcome = generate_in_background(engine, PROMPTS, SAMPLING)
    assert all(f.hanging.wait(GUARD_S) for f in fakes)
    engine.pause()
    assert engine.fleet.paused == {0, 1} and all(f.posts[-1] == "/toy/freeze" for f in fakes)
    push(engine, weights, 4)  # the folder loaded by vLLM's receiver (the toy's), labelled the toy's way
    assert all("/toy/label" in f.posts and "/update_weight_version" not in f.posts for f in fakes)
    engine.resume()
    assert all(f.posts[-1] == "/toy/thaw" for f in fakes)
    assert bodies == [{"keep_state": True}] * 2 + [{"recompute": True}] * 2
    hold.clear()
    for f in fakes:
        f.release_hung()
    thread.join(GUARD_S)
    assert _keys(outcome["samples"]) == [(i, j) for i in range(8) for j in range(2)]
    assert engine.stats()["vllm/pauses"] == 1 and engine.stats()["vllm/aborts"] == 1
    engine.close()


def test_the_parity_probe_asks_the_toy_s_scoring(tmp_path, weights, toy):
    """After each sync the probe scores its tokens through /toy/score (never vLLM's /v1/completions)
    and compares them with the reference: equal, the sync passes; 0.25 off, ParityError."""
    score = {"logprob": -1.0}
    routes, _ = _routes()
    routes["/toy/score"] = lambda body: {"logprobs": [score["logprob"]] * (len(body["input_ids"]) - 1)}
    fake = FakeVllm(ARCH.vocab_size, routes=routes)
    cfg = VllmConfig(warmup=False, probe_every=1, probe_tolerance=0.1, retry_backoff_s=0.01)
    engine = VllmEngine(ARCH, cfg, str(tmp_path), weight_sync="reload", server=fake, device="cpu", dialect=toy,
                        reference=lambda tokens: torch.full((len(tokens) - 1,), -1.0))
    push(engine, weights, 3)
    assert engine.stats()["vllm/probe_max_abs_diff"] == 0.0 and "/toy/score" in fake.posts
    score["logprob"] = -1.25
    with pytest.raises(ParityError, match="differ from the reference by 0.25"):
        push(engine, weights, 4)
    assert fake.posts.count("/toy/score") == 2 and "/v1/completions" not in fake.posts
    engine.close()


def test_the_config_picks_the_toy(tmp_path, toy):
    """rollout.vllm.dialect=toy, once registered: the engine the trainer builds speaks it."""
    from megatron_rl.config import ConfigError
    from megatron_rl.configure import load_config
    from megatron_rl.rollout import ENGINES
    from megatron_rl.rollout.engine import EngineRequest

    cfg = load_config(None, ["rollout.backend=vllm", "rollout.vllm={dialect: toy, url: 'http://127.0.0.1:9'}",
                             "rollout.weight_sync=reload"])
    engine = ENGINES.get("vllm").make(EngineRequest(ARCH, cfg.rollout, str(tmp_path)))
    assert engine.dialect is toy and engine.generation.dialect is toy and engine.server.health_path == "/toy/health"
    engine.close()
    with pytest.raises(ConfigError, match=r"rollout.weight_sync=auto \(memory\): the servers of rollout.vllm.dialect="
                                          r"toy take reload; set rollout.weight_sync to one of them"):
        load_config(None, ["rollout.backend=vllm", "rollout.vllm={dialect: toy}", "rollout.weight_sync=auto"])
    with pytest.raises(ValueError, match="rollout.weight_sync='restart': toy servers take reload"):
        VllmEngine(ARCH, VllmConfig(), str(tmp_path), weight_sync="restart", server=FakeVllm(), dialect=toy)
