"""The client's limits on an answer against the fake HTTP server (no vLLM): a whole request has
one deadline, an answer has a size cap, and a parity probe that gets no usable answer says so.
The faults are the server's behaviour; no outcome depends on this machine's speed (the trickle
would take minutes where the deadline is 1 s)."""
import pytest
import torch

from megatron_rl.rollout.serving.errors import BadResponseError, ProbeError, ServerDiedError
from megatron_rl.rollout.types import SamplingParams
from megatron_rl.rollout.vllm import VllmConfig, VllmEngine
from megatron_rl.rollout.vllm.protocol import generate_answer_cap
from tests.vllm.conftest import hf_weights, push, tiny_arch
from tests.vllm.fake_server import FLOOD_BYTES, HANG_GUARD_S, FakeVllm

pytestmark = pytest.mark.vllm

ARCH = tiny_arch()
SAMPLING = SamplingParams(max_tokens=6, stop_token_ids=(1,), seed=5)


@pytest.fixture(scope="module")
def weights():
    return hf_weights(ARCH, seed=0)[1]


def make_engine(tmp_path, weights, behaviour=None, reference=None, **cfg):
    fake = FakeVllm(ARCH.vocab_size, behaviour)
    options = {"warmup": False, "probe_every": 0, "retry_backoff_s": 0.01, "health_interval_s": 0.5,
               "health_timeout_s": 120.0, **cfg}
    engine = VllmEngine(ARCH, VllmConfig(**options), str(tmp_path), weight_sync="reload", server=fake, device="cpu",
                        reference=reference)
    return engine, fake


def test_a_trickling_server_is_taken_out_at_the_request_deadline(tmp_path, weights):
    """Every byte comes well within the timeout, but the answer would take minutes: the deadline
    covers the whole request, so the server counts as hung and the error names the setting."""
    engine, fake = make_engine(tmp_path, weights, behaviour=lambda body, answer: "trickle", request_timeout_s=1.0,
                               max_restarts=1, max_concurrency=1)
    push(engine, weights, 3)
    try:
        with pytest.raises(ServerDiedError, match=r"within rollout\.vllm\.request_timeout_s=1 s") as info:
            engine.generate([[4, 5]], 1, SAMPLING)
        assert "connect to last byte" in str(info.value)
        assert fake.restarts == 1  # taken out once, restarted, and hung again
    finally:
        engine.close()


@pytest.mark.parametrize("flood", ["flood", "flood-declared"])
def test_an_answer_past_the_cap_is_refused_after_reading_at_most_the_cap(tmp_path, weights, flood):
    """The server offers 256 MiB for a 6-token sample; the client reads no more than the cap (a
    few KiB per token), refuses the answer by name, and leaves: the server could send only what
    the sockets' buffers hold."""
    engine, fake = make_engine(tmp_path, weights, behaviour=lambda body, answer: flood, max_retries=0)
    push(engine, weights, 3)
    cap = generate_answer_cap(2, SAMPLING, 0)
    try:
        with pytest.raises(BadResponseError, match=f"larger than {cap} bytes") as info:
            engine.generate([[4, 5]], 1, SAMPLING)
        assert "max_tokens=6" in str(info.value)
        assert fake.flood_ended.wait(HANG_GUARD_S)
        assert fake.flooded[0] < FLOOD_BYTES // 4, fake.flooded  # stopped early: memory does not follow the answer
        assert cap < 1 << 20
    finally:
        engine.close()


def _probe_engine(tmp_path, weights, completions):
    engine, fake = make_engine(tmp_path, weights, probe_every=1,
                               reference=lambda tokens: torch.zeros(len(tokens) - 1))
    fake.completions = completions
    return engine, fake


def test_a_probe_refused_for_non_finite_log_probs_says_the_probe_failed(tmp_path, weights):
    """vLLM answers HTTP 400 "Out of range float values" when the probe's log-probs are NaN or
    inf (it cannot write them as JSON): broken weights, and the message says so."""
    out_of_range = b'{"error": {"message": "Out of range float values are not JSON compliant", "code": 400}}'
    engine, fake = _probe_engine(tmp_path, weights, lambda body: (400, out_of_range))
    try:
        with pytest.raises(ProbeError) as info:
            push(engine, weights, 3)
        message = str(info.value)
        assert "parity probe" in message and fake.url in message and "HTTP 400" in message
        assert "not finite" in message and "Out of range float values" in message
    finally:
        engine.close()


def test_a_probe_answer_without_prompt_logprobs_says_the_probe_failed(tmp_path, weights):
    answer = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}
    engine, fake = _probe_engine(tmp_path, weights, lambda body: answer)
    try:
        with pytest.raises(ProbeError) as info:
            push(engine, weights, 3)
        message = str(info.value)
        assert "parity probe" in message and fake.url in message and "prompt_logprobs missing" in message
        assert "rollout.vllm.probe_every=0" in message
    finally:
        engine.close()
