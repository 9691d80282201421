"""The embedded rollout engine on a GPU (rollout.device): weights copied from CUDA tensors stay
on the device, samples come back on the CPU, and in fp32 the GPU engine samples what the CPU
engine samples (same per-sequence random streams). GPU lane: skipped without CUDA."""
import pytest
import torch

pytestmark = [pytest.mark.gpu]


def test_gpu_engine_matches_cpu_engine_in_fp32(tmp_path_factory):
    from megatron_rl.rollout.embedded import EmbeddedEngine
    from megatron_rl.rollout.types import SamplingParams
    from tests.unit.rollout.conftest import make_checkpoint

    arch, _, ckpt = make_checkpoint(tmp_path_factory, arch="qwen3_moe")  # HF checkpoint-format tensors
    cpu = EmbeddedEngine(arch, dtype="fp32")
    gpu = EmbeddedEngine(arch, dtype="fp32", device="cuda")
    cpu.update_weights(ckpt.items(), version=1)
    gpu.update_weights([(n, t.cuda()) for n, t in ckpt.items()], version=1)  # on-device copy
    assert {p.device.type for p in gpu.model.parameters()} == {"cuda"}
    prompts = [[3, 4, 5], [6, 7]]
    sampling = SamplingParams(temperature=1.0, max_tokens=6, seed=7, top_p=0.9, return_kept_ids=True)
    a, b = cpu.generate(prompts, 3, sampling), gpu.generate(prompts, 3, sampling)
    for ga, gb in zip(a, b, strict=True):
        for sa, sb in zip(ga, gb, strict=True):
            assert sb.response_ids.device.type == "cpu" and sb.rollout_logprobs.device.type == "cpu"
            assert torch.equal(sa.response_ids, sb.response_ids)
            torch.testing.assert_close(sa.rollout_logprobs, sb.rollout_logprobs, rtol=1e-4, atol=1e-4)
            if sa.routed_experts is not None:
                assert sb.routed_experts.device.type == "cpu"
