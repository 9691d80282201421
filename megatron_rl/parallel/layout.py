"""How one step's rows split over optimizer steps, data-parallel ranks and micro-batches.

    layout = BatchLayout(rows=64, num_minibatches=2, dp=2, micro_batch_size=8).check()
    rows = layout.local_rows(dp_rank)          # this DP rank's global row indices, mini-batch by mini-batch
    for slices in layout.minibatch_slices():   # per optimizer step: micro-batch slices of the local rows
        ...

Mini-batch m is the global rows [m·n/N, (m+1)·n/N) whatever the DP size, so an optimizer step
sees the same data at any DP; each mini-batch is split evenly over the DP ranks, and each rank's
share into equal micro-batches (megatron's pipeline schedules need equal ones). The config's
start-up check (`RunConfig.check_layout`), the RL batch (trainer/phases.py) and the SFT batch
(trainer/sft.py) all use this one class, so a layout that starts is a layout that trains.
Cost: O(rows) integers; nothing here touches a tensor of the batch itself.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BatchLayout:
    """rows: samples per step (B·G); num_minibatches: N optimizer steps per batch; dp: data-parallel
    ranks; micro_batch_size: rows per forward/backward. what: how error messages name `rows`."""

    rows: int
    num_minibatches: int
    dp: int
    micro_batch_size: int
    what: str = "rollout.prompts_per_step x rollout.group_size"

    def check(self) -> BatchLayout:
        """Raise ValueError naming the sizes when the rows do not split evenly; return self."""
        n, parts, mbs = self.rows, self.num_minibatches * self.dp, self.micro_batch_size
        if n % parts:
            into = " x ".join(p for p in (f"train.num_minibatches={self.num_minibatches}" if self.num_minibatches > 1
                                          else "", f"{self.dp} data-parallel ranks" if self.dp > 1 else "") if p)
            raise ValueError(f"{self.what} = {n} samples per step do not split into {into}; choose a multiple of "
                             f"{parts}")
        if self.per_minibatch % mbs:
            raise ValueError(f"a mini-batch of {self.per_minibatch} samples per data-parallel rank does not split into "
                             f"train.micro_batch_size={mbs}; choose a divisor of {self.per_minibatch}")
        return self

    @property
    def per_minibatch(self) -> int:
        """Rows of one mini-batch on one DP rank."""
        return self.rows // (self.num_minibatches * self.dp)

    @property
    def local_size(self) -> int:
        """Rows one DP rank trains on per step."""
        return self.rows // self.dp

    def local_rows(self, dp_rank: int) -> torch.Tensor:
        """[local_size] int64: the global row indices DP rank `dp_rank` trains on, laid out so that
        `minibatch_slices` finds each mini-batch's share contiguously."""
        self.check()
        per, share = self.rows // self.num_minibatches, self.per_minibatch
        return torch.cat([torch.arange(m * per + dp_rank * share, m * per + (dp_rank + 1) * share)
                          for m in range(self.num_minibatches)])

    def minibatch_slices(self) -> list[list[slice]]:
        """Per mini-batch (one optimizer step), the micro-batch slices of the local rows."""
        self.check()
        per, mbs = self.per_minibatch, self.micro_batch_size
        return [[slice(m * per + k * mbs, m * per + (k + 1) * mbs) for k in range(per // mbs)]
                for m in range(self.num_minibatches)]
