"""Configurations the vLLM backend refuses instead of training on wrong numbers."""
import pytest

from megatron_rl.config.schema import RunConfig
from megatron_rl.rollout import EngineNeeds, EngineRequest
from megatron_rl.rollout.serving.errors import UnsupportedError
from megatron_rl.rollout.vllm import VllmConfig, VllmEngine, make_vllm_engine
from megatron_rl.rollout.vllm.weight_sync import check_supported
from tests.vllm.conftest import hf_weights, push, tiny_arch
from tests.vllm.fake_server import FakeVllm

pytestmark = pytest.mark.vllm

MOE = tiny_arch("qwen3_moe")
DENSE = tiny_arch()
NOWHERE = "http://127.0.0.1:9"  # never contacted: refusals happen before any connection


def test_moe_in_place_reload_refused_on_cpu_with_the_safe_alternative(tmp_path):
    with pytest.raises(UnsupportedError) as info:
        VllmEngine(MOE, VllmConfig(url=NOWHERE, device="cpu"), str(tmp_path), weight_sync="reload")
    msg = str(info.value)
    assert "MoE" in msg and "expert weights wrong" in msg and "weight_sync=restart" in msg
    # a URL server of unknown device is treated as CPU, and the message says how to declare a GPU one
    with pytest.raises(UnsupportedError, match="device=cuda"):
        VllmEngine(MOE, VllmConfig(url=NOWHERE), str(tmp_path), weight_sync="reload")
    check_supported(MOE, "reload", "cuda", routed_experts=False, can_restart=True)  # GPU: allowed
    check_supported(MOE, "restart", "cpu", routed_experts=False, can_restart=True)  # the alternatives
    check_supported(MOE, "memory", "cpu", routed_experts=False, can_restart=False)
    assert "weight_sync=memory" in msg


def test_moe_reload_refused_on_the_installed_cpu_lane(tmp_path, vllm_python):
    with pytest.raises(UnsupportedError, match="weight_sync=restart"):
        VllmEngine(MOE, VllmConfig(python=vllm_python), str(tmp_path), weight_sync="reload")


def test_r3_refused_at_start_up_on_cpu(tmp_path):
    cfg = VllmConfig(url=NOWHERE, device="cpu", enable_return_routed_experts=True)
    with pytest.raises(UnsupportedError) as info:
        VllmEngine(DENSE, cfg, str(tmp_path), weight_sync="reload")
    assert "dense model" in str(info.value)
    with pytest.raises(UnsupportedError) as info:
        check_supported(MOE, "restart", "cpu", routed_experts=True, can_restart=True)
    msg = str(info.value)
    assert "R3" in msg and "enable_return_routed_experts" in msg and "embedded" in msg


def test_r3_refused_when_a_gpu_server_returns_no_routing(tmp_path):
    _, weights = hf_weights(MOE, seed=0)
    fake = FakeVllm(MOE.vocab_size)  # answers without routed_experts
    cfg = VllmConfig(enable_return_routed_experts=True, warmup=False, probe_every=0)
    engine = VllmEngine(MOE, cfg, str(tmp_path), weight_sync="reload", server=fake, device="cuda")
    with pytest.raises(UnsupportedError, match="returns no routed_experts"):
        push(engine, weights, 0)


def test_restart_sync_needs_a_server_we_launch(tmp_path):
    with pytest.raises(UnsupportedError, match="cannot restart"):
        VllmEngine(DENSE, VllmConfig(url=NOWHERE), str(tmp_path), weight_sync="restart")


def test_head_dim_the_cpu_attention_cannot_run_is_refused(tmp_path):
    with pytest.raises(UnsupportedError, match="head_dim=16"):
        check_supported(tiny_arch(head_dim=16), "reload", "cpu", routed_experts=False, can_restart=True)


def test_multi_latent_attention_is_refused_on_a_cpu_server():
    # vLLM 0.32's CPU MLA disagrees with transformers on the same DeepSeek-V3 checkpoint (docs/models.md)
    arch = tiny_arch("deepseek_v3", kv_lora_rank=512, qk_rope_head_dim=64)
    with pytest.raises(UnsupportedError, match="multi-latent attention.*embedded"):
        check_supported(arch, "restart", "cpu", routed_experts=False, can_restart=True)
    check_supported(arch, "restart", "cuda", routed_experts=False, can_restart=True)  # a GPU server: allowed


def test_router_replay_r3_in_the_run_config_is_refused_by_a_cpu_server(tmp_path):
    base = RunConfig()
    base.rollout.vllm, base.rollout.weight_sync = VllmConfig(device="cpu"), "restart"  # refused before any launch
    request = EngineRequest(MOE, base.rollout, str(tmp_path), needs=EngineNeeds(routed_experts=True))
    with pytest.raises(UnsupportedError, match="R3"):
        make_vllm_engine(request)
