"""Zig-zag CP layout: known small cases, round trips (property-based), positions, label shift."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.logprobs import (
    global_positions,
    local_cu_seqlens,
    next_token_labels,
    zigzag_indices,
    zigzag_shard,
    zigzag_unshard,
)


def test_single_sequence_matches_megatron_layout():
    # S=8, CP=2: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert zigzag_indices(0, 2, total_len=8).tolist() == [0, 1, 6, 7]
    assert zigzag_indices(1, 2, total_len=8).tolist() == [2, 3, 4, 5]
    assert zigzag_indices(2, 4, total_len=16).tolist() == [4, 5, 10, 11]


def test_packed_sequences_are_sharded_one_by_one():
    cu = torch.tensor([0, 4, 12])
    assert zigzag_indices(0, 2, cu).tolist() == [0, 3, 4, 5, 10, 11]
    assert zigzag_indices(1, 2, cu).tolist() == [1, 2, 6, 7, 8, 9]
    assert local_cu_seqlens(cu, 2).tolist() == [0, 2, 6]
    assert global_positions(0, 2, cu).tolist() == [0, 3, 0, 1, 6, 7]
    assert global_positions(1, 2, cu).tolist() == [1, 2, 2, 3, 4, 5]


def test_batch_rows_with_seq_dim():
    x = torch.arange(2 * 8).view(2, 8)
    assert zigzag_shard(x, 1, 2, seq_dim=1).tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert global_positions(1, 2, total_len=8).tolist() == [2, 3, 4, 5]


def test_rejects_lengths_not_multiple_of_2cp():
    with pytest.raises(ValueError, match="multiple of 2\\*CP"):
        zigzag_indices(0, 2, [0, 4, 10])
    with pytest.raises(ValueError):
        zigzag_shard(torch.zeros(12), 0, 2, cu_seqlens=[0, 8])


def test_next_token_labels_shift_within_sequences():
    ids = torch.tensor([10, 11, 12, 13, 20, 21, 22, 23])
    assert next_token_labels(ids, [0, 4, 8]).tolist() == [11, 12, 13, -100, 21, 22, 23, -100]
    assert next_token_labels(ids.view(2, 4)).tolist() == [[11, 12, 13, -100], [21, 22, 23, -100]]


@settings(max_examples=40, deadline=None)
@given(cp=st.integers(1, 4), units=st.lists(st.integers(0, 4), min_size=1, max_size=5),
       feat=st.integers(1, 3))
def test_round_trip_and_partition(cp, units, feat):
    lengths = [2 * cp * u for u in units]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    x = torch.randn(cu[-1], feat)
    shards = [zigzag_shard(x, r, cp, cu) for r in range(cp)]
    assert all(s.shape[0] == cu[-1] // cp for s in shards)
    torch.testing.assert_close(zigzag_unshard(shards, cu), x, atol=0, rtol=0)
    idx = torch.cat([zigzag_indices(r, cp, cu) for r in range(cp)])
    assert sorted(idx.tolist()) == list(range(cu[-1]))
    starts = torch.repeat_interleave(torch.tensor(cu[:-1]), torch.tensor(lengths))
    for r in range(cp):
        local = zigzag_indices(r, cp, cu)
        assert torch.equal(global_positions(r, cp, cu), local - starts[local])
