"""Every model family through a real vLLM server (CPU lane, fp32): the weights we export in HF
checkpoint format load into vLLM's own model class, pass the parity probe, and sample with the
fp32 reference's log-probs. Mixtral also checks the renamed expert block (`block_sparse_moe.w1/w3/w2`)
and, being MoE on CPU, syncs by restart. One server per family (a start costs ~30-80 s)."""
import pytest
import torch

from megatron_rl.model.hf_io import SafetensorsReader
from megatron_rl.model.parity import random_hf_model
from megatron_rl.rollout.types import SamplingParams
from megatron_rl.rollout.vllm import VllmConfig, VllmEngine
from tests.vllm.conftest import ONE_PROCESS_ENGINE, push, tiny_arch

pytestmark = pytest.mark.vllm

FAMILIES = {
    "llama3": (tiny_arch("llama", rope_llama3_factor=8.0, rope_theta=500000.0, max_position_embeddings=16384),
               "reload"),
    "qwen2_tied": (tiny_arch("qwen2", hidden_size=128, tie_word_embeddings=True), "reload"),
    "mixtral": (tiny_arch("mixtral"), "restart"),
}
PROMPTS = [[4 + (3 * i) % 40, 5 + i % 7, 14, 8 + i % 5] for i in range(4)]


def checkpoint_weights(arch, path):
    """(model, HF checkpoint-format (name, tensor) pairs): what export_hf_weights yields."""
    model = random_hf_model(arch, seed=0)
    model.save_pretrained(path)
    read = SafetensorsReader(str(path))
    return model, [(name, read(name)) for name in read.keys()]  # noqa: SIM118 - a reader, not a dict


@torch.no_grad()
def reference_logprobs(model, sample) -> torch.Tensor:
    ids = torch.cat([sample.prompt_ids, sample.response_ids])[None]
    logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    return logp.gather(-1, ids[0, 1:, None]).squeeze(-1)[len(sample.prompt_ids) - 1:]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_serves_the_exported_weights(family, vllm_python, tmp_path):
    arch, weight_sync = FAMILIES[family]
    model, weights = checkpoint_weights(arch, tmp_path / "hf")
    if family == "mixtral":
        assert any(".block_sparse_moe.experts.3.w3." in name for name, _ in weights)
    cfg = VllmConfig(python=vllm_python, dtype="float32", max_num_seqs=16, max_model_len=256,
                     health_timeout_s=120.0, env=ONE_PROCESS_ENGINE)
    engine = VllmEngine(arch, cfg, str(tmp_path / "server"), weight_sync=weight_sync)
    try:
        push(engine, weights, 0)  # runs the parity probe: raises if vLLM computes otherwise
        assert engine.stats()["vllm/probe_max_abs_diff"] < 1e-3
        out = engine.generate(PROMPTS, 2, SamplingParams(temperature=1.0, max_tokens=16, seed=3))
    finally:
        engine.close()
    diffs = [float((reference_logprobs(model, s) - s.rollout_logprobs).abs().max()) for g in out for s in g]
    assert max(diffs) < 1e-3, diffs
    print(f"\n{family}: max |vLLM - fp32 reference| over {len(diffs)} samples: {max(diffs):.2e}")
