"""Per-token policy versions (partial rollouts): packing into the batch against a hand-built
layout, per-token staleness against hand-counted values, the per-token staleness buckets of the
mismatch values, the checkpoint format, and the start-up refusals of train.in_flight_update."""
import pytest
import torch

from megatron_rl.metrics.mismatch import mismatch_sums
from megatron_rl.rollout.types import Sample
from megatron_rl.trainer.batch import build_batch
from megatron_rl.trainer.schedule import staleness, token_staleness


def _sample(prompt, response, version, token_versions=None, loss_mask=None):
    return Sample(prompt_ids=torch.tensor(prompt), response_ids=torch.tensor(response),
                  rollout_logprobs=-torch.ones(len(response)), finish_reason="length", policy_version=version,
                  token_versions=None if token_versions is None else torch.tensor(token_versions, dtype=torch.int32),
                  loss_mask=None if loss_mask is None else torch.tensor(loss_mask))


def test_token_versions_pack_at_the_response_label_positions():
    samples = [_sample([1, 2], [3, 4, 5], 3, [3, 3, 4]), _sample([6], [7, 8], 2)]
    batch = build_batch(samples, [0.0, 1.0], pad_id=0, seq_len=6)
    # row 0: P=2, labels 1..3 are its response; row 1: P=1, labels 0..1; elsewhere the row's version
    assert batch.token_versions.tolist() == [[3, 3, 3, 4, 3], [2, 2, 2, 2, 2]]
    assert batch.versions.tolist() == [3, 2]
    # no sample crossed an update: no per-token field, the batch is as before
    assert build_batch(samples[1:], [1.0], pad_id=0, seq_len=6).token_versions is None


def test_per_token_staleness_and_its_mean_and_max():
    samples = [_sample([1, 2], [3, 4, 5], 3, [3, 3, 4]), _sample([6], [7, 8], 2),
               _sample([1], [2, 3, 4], 3, [3, 4, 4], loss_mask=[True, False, True])]
    batch = build_batch(samples, [0.0] * 3, pad_id=0, seq_len=6)
    got = staleness(batch.versions, 4, batch.token_versions)
    assert got[batch.loss_mask].tolist() == [1, 1, 0, 2, 2, 1, 0]
    # trainer at version 4: staleness 1,1,0 | 2,2 | 1,(masked),0 -> 7 tokens, sum 7, max 2
    assert token_staleness(batch, 4) == (pytest.approx(7 / 7), 2.0)
    # the first two samples at version 5: 2,2,1 | 3,3 -> sum 11 over 5 tokens; rows of one version only
    assert token_staleness(build_batch(samples[:2], [0.0] * 2, pad_id=0, seq_len=6), 5) == (pytest.approx(11 / 5), 3.0)
    assert token_staleness(build_batch(samples[1:2], [0.0], pad_id=0, seq_len=6), 5) == (pytest.approx(3.0), 3.0)
    nothing = _sample([1], [2], 3, loss_mask=[False])   # no trained token
    assert token_staleness(build_batch([nothing], [0.0], pad_id=0, seq_len=3), 4) == (0.0, 0.0)
    whole_rows = staleness(torch.tensor([4, 2]), 4, None, length=3)
    assert whole_rows.tolist() == [[0, 0, 0], [2, 2, 2]]


def test_mismatch_staleness_buckets_count_tokens_not_rows():
    old = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    mu = torch.tensor([[-1.5, -1.5, -1.0], [-1.0, -1.0, -1.0]])
    mask = torch.ones(2, 3, dtype=torch.bool)
    per_token = torch.tensor([[1, 1, 0], [0, 0, 0]])  # row 0 resumed on new weights after token 1
    out = mismatch_sums(old, mu, mask, staleness=per_token, max_staleness=1)
    assert float(out["mismatch/staleness_1/tokens/sum"]) == 2
    assert float(out["mismatch/staleness_0/tokens/sum"]) == 4
    # |Δ| = 0.5 on exactly the stale tokens
    assert float(out["mismatch/staleness_1/abs_logprob_diff/num/sum"]) == pytest.approx(1.0)
    assert float(out["mismatch/staleness_0/abs_logprob_diff/num/sum"]) == pytest.approx(0.0)
    rows = mismatch_sums(old, mu, mask, staleness=torch.tensor([1, 0]), max_staleness=1)  # [B] still means rows
    assert float(rows["mismatch/staleness_1/tokens/sum"]) == 3


def test_token_versions_survive_the_checkpoint_format(tmp_path):
    from megatron_rl.trainer.rollouts import Rollout
    from megatron_rl.trainer.schedule import SyncSchedule

    s = SyncSchedule(None, None)
    s.pending[1] = Rollout([_sample([1], [2, 3], 0, [0, 1])], torch.tensor([1.0]), {})
    torch.save(s.state_dict(), tmp_path / "q.pt")
    back = SyncSchedule(None, None)
    back.load_state_dict(torch.load(tmp_path / "q.pt", weights_only=True))
    (sample,) = back.pending[1].samples
    assert sample.token_versions.tolist() == [0, 1] and sample.token_versions.dtype == torch.int32


@pytest.mark.parametrize("overrides,match", [
    (["train.in_flight_update=pause"], "train.in_flight_update=pause .* train.schedule=async"),
    (["train.in_flight_update=pause", "train.schedule=async", "rollout.backend=vllm", "rollout.weight_sync=restart"],
     "in_flight_update=pause with rollout.backend=vllm: .*weight_sync=restart replaces the servers"),
    (["train.in_flight_update=later"], "train.in_flight_update='later': choose one of wait, pause, abort"),
])
def test_in_flight_update_refusals_name_the_field(overrides, match):
    from megatron_rl.config import ConfigError
    from megatron_rl.configure import load_config

    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_pause_is_taken_by_vllm_with_an_in_place_sync():
    from megatron_rl.configure import load_config

    for sync in ("memory", "reload"):
        cfg = load_config(None, ["train.in_flight_update=pause", "train.schedule=async", "rollout.backend=vllm",
                                 f"rollout.weight_sync={sync}"])
        assert cfg.train.in_flight_update == "pause"


def test_pause_refuses_r3_router_replay():
    from megatron_rl.config import ConfigError
    from megatron_rl.configure import load_config

    with pytest.raises(ConfigError, match="moe.router_replay=r3"):
        load_config(None, ["train.in_flight_update=pause", "train.schedule=async", "model.arch=qwen3_moe",
                           "moe.router_replay=r3"])
