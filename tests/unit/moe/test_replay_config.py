"""Router replay refuses configurations where megatron's RouterReplay would silently not apply."""
import copy
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.model.builder import BuildOptions, transformer_config
from megatron_rl.model.presets import preset_arch
from megatron_rl.moe.replay import (
    MicroBatchRouting,
    backward_replay_modes,
    check_replay_config,
    micro_batches_for,
    moe_layer_pattern,
)
from megatron_rl.parallel import ParallelConfig


def _config(routing_replay=True, arch="qwen3_moe", **overrides):
    cfg = transformer_config(preset_arch(arch), SimpleNamespace(config=ParallelConfig()),
                             BuildOptions(routing_replay=routing_replay), use_te=False)
    cfg = copy.copy(cfg)
    for k, v in overrides.items():  # set after __post_init__: some combinations need TE to validate
        setattr(cfg, k, v)
    return cfg


def test_accepts_the_builder_config():
    check_replay_config(_config())


@pytest.mark.parametrize("overrides,words", [
    ({"moe_enable_routing_replay": False}, ["routing_replay=True"]),
    ({"moe_router_fusion": True}, ["moe_router_fusion", "moe_router_fusion=False"]),
    ({"moe_expert_capacity_factor": 1.25}, ["moe_expert_capacity_factor", "None"]),
    ({"moe_router_load_balancing_type": "sinkhorn"}, ["sinkhorn"]),
    ({"moe_router_load_balancing_type": ["aux_loss", "sinkhorn"]}, ["sinkhorn"]),
    ({"moe_router_force_load_balancing": True}, ["moe_router_force_load_balancing"]),
    ({"virtual_pipeline_model_parallel_size": 2}, ["virtual_pipeline_model_parallel_size"]),
    ({"mtp_num_layers": 1}, ["mtp_num_layers"]),
], ids=["off", "fusion", "capacity", "sinkhorn", "sinkhorn_list", "force_balance", "vpp", "mtp"])
def test_refuses(overrides, words):
    with pytest.raises(ValueError) as e:
        check_replay_config(_config(**overrides))
    for w in words:
        assert w in str(e.value)


def test_refuses_dense_model():
    with pytest.raises(ValueError, match="MoE"):
        check_replay_config(_config(arch="qwen3"))


def test_backward_replay_modes():
    assert backward_replay_modes(_config()) == (False, False)
    assert backward_replay_modes(_config(recompute_granularity="full")) == (True, False)
    assert backward_replay_modes(_config(recompute_granularity="selective", recompute_modules=["moe"])) == (False, True)
    assert backward_replay_modes(_config(recompute_granularity="selective", recompute_modules=["core_attn"])) == (
        False, False)


def test_moe_layer_pattern():
    assert moe_layer_pattern(SimpleNamespace(moe_layer_freq=2, num_layers=5)) == [1, 0, 1, 0, 1]
    assert moe_layer_pattern(SimpleNamespace(moe_layer_freq=[0, 1, 1], num_layers=3)) == [0, 1, 1]
    with pytest.raises(ValueError):
        moe_layer_pattern(SimpleNamespace(moe_layer_freq="([1]*3)", num_layers=3))


def test_micro_batches_for_update_slices():
    recorded = [MicroBatchRouting([torch.full((4, 2), j)]) for j in range(6)]  # π_old pass: 6 x 2 rows
    # mini-batch 1 of 2 (rows 6..11) as train.minibatch_slices gives it
    picked = micro_batches_for(recorded, [slice(6, 8), slice(8, 10), slice(10, 12)], micro_batch_size=2)
    assert [int(mb.indices[0][0, 0]) for mb in picked] == [3, 4, 5]
    with pytest.raises(ValueError, match="same micro_batch_size"):
        micro_batches_for(recorded, [slice(6, 10)], micro_batch_size=2)
    with pytest.raises(ValueError, match="past"):
        micro_batches_for(recorded, [slice(12, 14)], micro_batch_size=2)
