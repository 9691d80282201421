"""Schedule configuration checks and the pending batches' checkpoint format (the bookkeeping over
steps runs in tests/distributed/test_schedule_bookkeeping.py)."""

import pytest
import torch


def test_staged_needs_whole_stages():
    from megatron_rl.config import ConfigError
    from megatron_rl.configure import load_config

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


class _PausableEngine:
    def __init__(self):
        self.calls = []

    def pause(self):
        self.calls.append("pause")

    def abort(self):
        self.calls.append("abort")

    def resume(self):
        self.calls.append("resume")


class _FailingWeights:
    def push(self, version):
        raise RuntimeError("the push failed half way")


@pytest.mark.parametrize("in_flight, calls", [("pause", ["pause", "abort", "resume"]), ("abort", ["abort", "resume"])])
def test_a_failed_push_ends_the_parked_generation_instead_of_letting_it_go_on(in_flight, calls):
    """train.in_flight_update=pause: the push failed, so the engine's weights may be half loaded;
    the parked generation is ended (abort), never let go on over them."""
    from types import SimpleNamespace

    from megatron_rl.trainer.schedule import AsyncSchedule

    engine = _PausableEngine()
    schedule = AsyncSchedule(SimpleNamespace(engine=engine), _FailingWeights(), max_staleness=1, steps=4,
                             in_flight=in_flight)
    schedule._worker = SimpleNamespace(join=lambda timeout=None: None, is_alive=lambda: False)  # one in flight
    with pytest.raises(RuntimeError, match="half way"):
        schedule.sync(2)
    assert engine.calls == calls
