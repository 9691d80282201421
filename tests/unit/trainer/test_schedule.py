"""Schedule configuration checks and the pending batches' checkpoint format (the bookkeeping over
steps runs in tests/distributed/test_schedule_bookkeeping.py)."""

import pytest
import torch


def test_staged_needs_whole_stages():
    from megatron_rl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="train.steps=10 is not a multiple of train.stages=4"):
        load_config(None, ["train.schedule=staged", "train.stages=4", "train.steps=10"])


def test_pending_batches_round_trip_through_weights_only_load(tmp_path):
    from megatron_rl.rollout.types import Sample
    from megatron_rl.trainer.rollouts import Rollout
    from megatron_rl.trainer.schedule import SyncSchedule

    s = SyncSchedule(None, None)
    s.pending[3] = Rollout([Sample(prompt_ids=torch.tensor([1, 2]), response_ids=torch.tensor([3]),
                                   rollout_logprobs=torch.tensor([-0.25]), finish_reason="length",
                                   policy_version=2, routed_experts=torch.zeros(2, 1, 2, dtype=torch.int16))],
                           torch.tensor([1.0]), {"rewards/count": 1.0})
    torch.save(s.state_dict(), tmp_path / "q.pt")
    back = SyncSchedule(None, None)
    back.load_state_dict(torch.load(tmp_path / "q.pt", weights_only=True))
    (r,) = back.pending.values()
    assert list(back.pending) == [3] and r.samples[0].policy_version == 2
    assert torch.equal(r.samples[0].routed_experts, s.pending[3].samples[0].routed_experts)
    assert torch.equal(r.rewards, s.pending[3].rewards) and r.reward_stats == {"rewards/count": 1.0}
