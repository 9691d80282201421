"""vLLM's dialect of the serving layer (rollout/vllm/dialect.py): the command line a launched server
gets, written out here in full, and the generate requests, which are protocol.py's."""
import pytest

import megatron_rl.rollout.registered  # noqa: F401 - registers the "vllm" dialect
from megatron_rl.rollout.serving import DIALECTS, Dialect
from megatron_rl.rollout.serving.launcher import LocalServer
from megatron_rl.rollout.types import SamplingParams
from megatron_rl.rollout.vllm import VllmConfig
from megatron_rl.rollout.vllm.protocol import generate_answer_cap, generate_body, parse_generate
from tests.vllm.fake_server import good_answer


def test_vllm_is_registered_and_is_a_dialect():
    vllm = DIALECTS.get("vllm")
    assert isinstance(vllm, Dialect)
    assert (vllm.generate_path, vllm.health_path) == ("/inference/v1/generate", "/health")
    with pytest.raises(TypeError, match="must be a Dialect"):
        DIALECTS.add("half", object())


def test_a_launched_server_s_command_line():
    vllm = DIALECTS.get("vllm")
    cfg = VllmConfig(dtype="float32", seed=3, max_num_seqs=8, enforce_eager=True, extra_args=["--x", "1"])
    flags = vllm.server_flags(cfg, 256, "raw_logprobs", 64, ["--weight-transfer-config", "{}"])
    server = LocalServer("/py", flags, {}, "/tmp/none.log", dialect=vllm)
    assert server.command("/m", 8000) == [
        "/py", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m", "--served-model-name", "policy",
        "--host", "127.0.0.1", "--port", "8000", "--middleware", "megatron_rl_vllm_auth.RequireBearerKey",
        "--dtype", "float32", "--max-model-len", "256", "--seed", "3", "--logprobs-mode", "raw_logprobs",
        "--max-logprobs", "64", "--tensor-parallel-size", "1", "--skip-tokenizer-init", "--enable-scale-out",
        "--enable-prompt-tokens-details", "--max-num-seqs", "8", "--enforce-eager", "--load-format", "dummy", "--weight-transfer-config", "{}",
        "--x", "1"]
    assert "--load-format" not in vllm.server_flags(cfg, 256, "raw_logprobs", 64)  # a disk sync: real weights


def test_its_requests_are_protocol_s():
    vllm, s = DIALECTS.get("vllm"), SamplingParams(max_tokens=4, stop_token_ids=(3,), seed=1)
    body = vllm.generate_body("m", [4, 5], s, seed=9, num_logprobs=2)
    assert body == generate_body("m", [4, 5], s, 9, 2)
    assert vllm.answer_cap(2, s, 2, 6) == generate_answer_cap(2, s, 2, 6)
    got, want = vllm.parse_generate(good_answer(body, 32), 2, s, 32), parse_generate(good_answer(body, 32), 2, s, 32)
    assert got.ids.tolist() == want.ids.tolist() and got.logprobs.tolist() == want.logprobs.tolist()
    assert got.finish == want.finish


def test_its_control_calls_are_the_development_endpoints_the_engine_sent_before():
    """The exact (method, path, body) of vLLM's pause, resume and abort (what generation.py sent)."""
    vllm = DIALECTS.get("vllm")
    assert [tuple(c) for c in vllm.pause_calls()] == [("POST", "/pause?mode=keep&clear_cache=false", {})]
    assert [tuple(c) for c in vllm.resume_calls()] == [
        ("POST", "/reset_prefix_cache?reset_running_requests=true", {}), ("POST", "/resume", {})]
    assert [tuple(c) for c in vllm.abort_calls(paused=False)] == [("POST", "/abort_requests", {})]
    assert [tuple(c) for c in vllm.abort_calls(paused=True)] == [("POST", "/pause?mode=abort&clear_cache=false", {})]
    assert vllm.read_control(vllm.pause_calls()[0], {"status": "paused"}) is None
    assert "VLLM_SERVER_DEV_MODE=1" in vllm.control_hint


def test_its_receivers_are_the_engine_s_weight_syncs():
    from megatron_rl.rollout.vllm.transfer import BACKENDS, MemorySync, weight_transfer_args
    from megatron_rl.rollout.vllm.weight_sync import TAKES, DiskReloadSync, RestartSync

    vllm, gloo = DIALECTS.get("vllm"), BACKENDS["gloo"]
    assert vllm.weight_syncs == TAKES == ("memory", "reload", "restart")
    assert vllm.receiver_flags(gloo) == weight_transfer_args(gloo)
    server = LocalServer("/py", [], {}, "/tmp/none.log", dialect=vllm)
    receiver = vllm.memory_receiver(server, gloo, 1 << 20, "127.0.0.1")
    assert isinstance(receiver, MemorySync) and (receiver.server, receiver.bucket_bytes) == (server, 1 << 20)
    assert type(vllm.disk_receiver("reload")) is DiskReloadSync and type(vllm.disk_receiver("restart")) is RestartSync
    assert tuple(vllm.version_label(7)) == ("POST", "/update_weight_version", {"new_version": "7"})


def test_its_parity_probe_scores_by_prompt_logprobs():
    from megatron_rl.rollout.vllm.protocol import prompt_logprobs_answer_cap, prompt_logprobs_body

    vllm = DIALECTS.get("vllm")
    assert tuple(vllm.score_call("m", [4, 5, 6])) == ("POST", "/v1/completions", prompt_logprobs_body("m", [4, 5, 6]))
    assert vllm.score_cap(3) == prompt_logprobs_answer_cap(3)
    answer = {"choices": [{"index": 0, "prompt_logprobs": [None, {"5": {"logprob": -1.5}}, {"6": {"logprob": -0.25}}]}]}
    assert vllm.parse_score(answer, [4, 5, 6]).tolist() == [-1.5, -0.25]
