"""A judge model as the reward (rollout/vllm/judge.py).

Against the fake server (always run): scores parsed and scaled; an answer that is not a completion,
one without a number, and one that never comes (released by the test once the deadline has passed)
each score 0 and are counted by type; at most judge.max_in_flight requests at once, and they do run
concurrently. Against a real CPU vLLM server (the vllm tier): a judge model the test makes (every
layer's output zeroed, so its greedy answer is always the token "7") launched from its folder,
answering through its own tokenizer: 0.7 for every item with scale 10."""
import threading

import pytest
import torch

from megatron_rl.config.judge_section import JudgeSection
from megatron_rl.config.schema import RunConfig
from megatron_rl.configure import load_config
from megatron_rl.rewards import RewardRunner
from megatron_rl.rollout.vllm.judge import ENV_JUDGE_KEY, Judge
from tests.vllm.conftest import ONE_PROCESS_ENGINE
from tests.vllm.fake_server import HANG_GUARD_S, FakeVllm


@pytest.fixture
def fake(monkeypatch):
    server = FakeVllm()
    server.start("")
    monkeypatch.setenv(ENV_JUDGE_KEY, server.api_key)
    yield server
    server.release_hung()
    server.stop()


def _completion(text: str) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": "length"}]}


def test_scores_are_parsed_and_scaled_and_each_failure_scores_0_counted(fake, tmp_path):
    release, bodies = threading.Event(), []

    def answer(body):
        bodies.append(body)
        response = body["prompt"].split("Response: ")[1].split("\n")[0]
        if response == "hang":  # answers only once the test has its rewards: past any deadline
            release.wait(HANG_GUARD_S)
        return {"good": _completion(" 7 out of 10"), "garbage": {"choices": []}, "words": _completion(" great"),
                "hang": _completion("9"), "ten": _completion("10")}[response]

    fake.completions = answer
    judge = Judge(JudgeSection(url=fake.url, timeout_s=5.0), str(tmp_path))  # the others answer in ms
    runner = RewardRunner(judge)
    items = [("12+3=", r, "15", "addition") for r in ("good", "garbage", "words", "hang", "ten")]
    try:
        assert runner(items) == [0.7, 0.0, 0.0, 0.0, 1.0]
    finally:
        release.set()
    stats = runner.stats()
    assert stats["rewards/errors"] == 3
    assert stats["rewards/errors/ValueError"] == stats["rewards/errors/JudgeUnparsable"] == 1
    assert stats["rewards/errors/TransportError"] == 1  # no whole answer within judge.timeout_s
    good = next(b for b in bodies if "Response: good" in b["prompt"])
    assert good["temperature"] == 0.0 and good["max_tokens"] == 8 and good["model"] == "fake"
    assert good["prompt"] == JudgeSection().template.format(prompt="12+3=", response="good", label="15")
    runner.close()


def test_at_most_max_in_flight_requests_run_and_they_run_together(fake, tmp_path):
    lock, running, most = threading.Lock(), [0], [0]
    together = threading.Barrier(3, timeout=60)  # three requests must be in flight at once

    def answer(body):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            together.wait()
        except threading.BrokenBarrierError:
            pass
        with lock:
            running[0] -= 1
        return _completion("5")

    fake.completions = answer
    judge = Judge(JudgeSection(url=fake.url, max_in_flight=3), str(tmp_path))
    assert judge.score_batch([("p", str(k), "l") for k in range(9)]) == [0.5] * 9
    assert most[0] == 3 and not together.broken
    judge.close()


def test_the_config_needs_exactly_one_judge_and_checks_its_fields():
    with pytest.raises(ValueError, match="data.reward=judge needs a judge: set judge.model"):
        load_config(None, ["data.reward=judge"])
    with pytest.raises(ValueError, match="judge.model and judge.url are both set"):
        JudgeSection(model="m", url="http://x")
    with pytest.raises(ValueError, match="judge.pattern"):
        JudgeSection(pattern="(")
    with pytest.raises(ValueError, match=r"judge.template: only \{prompt\}"):
        JudgeSection(template="{answer}")
    cfg = load_config(None, ["data.reward=judge", "judge.url=http://127.0.0.1:1"])
    assert isinstance(cfg, RunConfig) and cfg.judge.url == "http://127.0.0.1:1"


def _judge_model(folder):
    """A Qwen3 whose every layer adds nothing and whose LM head scores only the token "7": its
    greedy answer to anything is "7" (the hidden state is the all-ones embedding, normed)."""
    from tokenizers import Tokenizer

    from megatron_rl.model.parity import random_hf_model
    from tests.unit.data.test_hf_tokenizer import write_tokenizer
    from tests.vllm.conftest import tiny_arch

    write_tokenizer(folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    model = random_hf_model(tiny_arch(vocab_size=tok.get_vocab_size(), tie_word_embeddings=False), seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
            elif "norm" in name:
                p.fill_(1.0)
        model.model.embed_tokens.weight.fill_(1.0)
        head = model.lm_head.weight
        head.zero_()
        head[tok.token_to_id("7")] = 1.0
    model.save_pretrained(folder)
    return folder


@pytest.mark.vllm
def test_a_launched_judge_scores_through_its_own_tokenizer(vllm_python, tmp_path, monkeypatch):
    for name, value in ONE_PROCESS_ENGINE.items():  # the launched server inherits the trainer's environment
        monkeypatch.setenv(name, value)
    folder = _judge_model(tmp_path / "judge")
    section = JudgeSection(model=str(folder), python=vllm_python, dtype="float32", max_model_len=256, max_tokens=1,
                           max_in_flight=4)
    judge = Judge(section, str(tmp_path / "run"))
    try:
        runner = RewardRunner(judge)
        items = [(f"{k}+{k}=", f"{2 * k}", f"{2 * k}", "addition") for k in range(6)]
        assert runner(items) == [0.7] * 6 and runner.stats()["rewards/errors"] == 0
    finally:
        judge.close()
    assert not judge.server.alive()
