import pytest
import torch

from megatron_rl.parallel.layout import BatchLayout
from megatron_rl.rollout.types import Sample
from megatron_rl.trainer.batch import build_batch, padded_length, row_multiple
from megatron_rl.trainer.phases import group_advantages


def _sample(p, r, version=0):
    return Sample(prompt_ids=torch.tensor(p), response_ids=torch.tensor(r),
                  rollout_logprobs=-0.1 * torch.arange(1, len(r) + 1, dtype=torch.float32),
                  finish_reason="stop", policy_version=version)


def test_build_batch_layout():
    s = [_sample([5, 6, 7], [8, 9]), _sample([5], [1, 2, 3], version=3)]
    b = build_batch(s, [1.0, 0.0], pad_id=0, seq_len=5)
    assert b.input_ids.tolist() == [[5, 6, 7, 8], [5, 1, 2, 3]]
    assert b.labels.tolist() == [[6, 7, 8, 9], [1, 2, 3, 0]]  # shifted on the whole row
    assert b.position_ids.tolist() == [[0, 1, 2, 3]] * 2
    assert b.input_len == 4 and b.cp_size == 1
    # label index t predicts token t + 1: response tokens of row 0 are predicted at t = 2, 3
    assert b.loss_mask.tolist() == [[False, False, True, True], [True, True, True, False]]
    assert torch.allclose(b.rollout_logprobs[0], torch.tensor([0, 0, -0.1, -0.2]))
    assert b.positions[1].tolist() == [0, 1, 2, 0]
    assert b.versions.tolist() == [0, 3]
    adv = b.with_advantages(torch.tensor([2.0, -1.0])).advantages
    assert adv.tolist() == [[0, 0, 2, 2], [-1, -1, -1, 0]]
    one = b.select(torch.tensor([1]))
    assert one.labels.tolist() == [[1, 2, 3, 0]] and one.versions.tolist() == [3] and one.cp_size == 1


def test_row_multiple():
    assert row_multiple(1, 1) == 1 and row_multiple(2, 1) == 2
    assert row_multiple(1, 2) == 4 and row_multiple(2, 4) == 16  # TP x 2*CP zig-zag chunks


def test_padded_length_makes_inputs_divisible():
    s = [_sample([1, 2, 3], [4, 5, 6])]  # 6 tokens, 5 inputs
    assert padded_length(s) == 6
    assert padded_length(s, 2) == 7 and (7 - 1) % 2 == 0
    assert padded_length(s, 4) == 9


def test_sample_longer_than_row_is_an_error():
    with pytest.raises(ValueError, match="sample 0"):
        build_batch([_sample([1, 2], [3, 4])], [0.0], 0, 3)


def test_minibatch_and_shard_arithmetic():
    assert BatchLayout(8, 1, 2, 4).local_rows(1).tolist() == [4, 5, 6, 7]  # one mini-batch: a DP shard
    mbs = BatchLayout(8, 2, 1, 2).minibatch_slices()
    assert mbs == [[slice(0, 2), slice(2, 4)], [slice(4, 6), slice(6, 8)]]
    with pytest.raises(ValueError, match="micro_batch_size=3"):
        BatchLayout(8, 2, 1, 3).minibatch_slices()
    with pytest.raises(ValueError, match="num_minibatches=3"):
        BatchLayout(8, 3, 1, 1).minibatch_slices()


def test_group_advantages_and_zero_variance_filter():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 0.0])  # groups of 3: mixed, all-0
    adv, keep, zero_var = group_advantages(rewards, 3, "mean_centered", filter_zero_var=True)
    assert torch.allclose(adv, torch.tensor([1 / 3, -2 / 3, 1 / 3, 0, 0, 0]))
    assert zero_var.tolist() == [False, True]
    assert keep.tolist() == [True, True, True, False, False, False]
    _, keep, _ = group_advantages(rewards, 3, "grpo", filter_zero_var=False)
    assert keep.all()


def test_local_rows_keep_each_minibatch_global():
    # 8 rows, 2 mini-batches (rows 0-3, 4-7), 2 DP ranks: rank 1 trains rows 2,3 then 6,7
    layout = BatchLayout(8, 2, 2, 1)
    assert layout.local_rows(0).tolist() == [0, 1, 4, 5]
    assert layout.local_rows(1).tolist() == [2, 3, 6, 7]
    together = sorted(layout.local_rows(0).tolist()[:2] + layout.local_rows(1).tolist()[:2])
    assert together == [0, 1, 2, 3]  # the first optimizer step sees exactly mini-batch 0
    with pytest.raises(ValueError, match="num_minibatches=2 x 2 data-parallel ranks"):
        BatchLayout(6, 2, 2, 1).local_rows(0)


def test_the_config_check_and_the_trainer_use_one_layout():
    """RunConfig.check_layout refuses exactly the layouts the trainer's split cannot make."""
    from megatron_rl.configure import load_config

    cfg = load_config(None, ["rollout.prompts_per_step=3", "rollout.group_size=4", "train.num_minibatches=2",
                             "train.micro_batch_size=2"])
    cfg.check_layout(1)
    assert cfg.layout(1).minibatch_slices() == [[slice(0, 2), slice(2, 4), slice(4, 6)],
                                                [slice(6, 8), slice(8, 10), slice(10, 12)]]
    with pytest.raises(ValueError, match="12 samples per step do not split into train.num_minibatches=2 x 4 data"):
        cfg.check_layout(4)
    with pytest.raises(ValueError, match="a mini-batch of 3 samples per data-parallel rank"):
        cfg.check_layout(2)
