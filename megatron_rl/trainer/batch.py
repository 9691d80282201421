"""Samples -> padded training tensors, and the split into mini-batches / micro-batches.

Layout (one row per response, right padded to a common length S):
    tokens      [N, S]    prompt + response token ids (pad id after the response)
    label index t predicts tokens[:, t + 1]; every per-token tensor below is [N, S - 1]:
    loss_mask   1 at the response tokens' label positions (P-1 .. P+R-2), else 0
    rollout_logprobs, advantages, positions (index of the token inside its response)
A sample with prompt length P and response length R has its response token r at tokens[P + r]
and its log-prob at label index P - 1 + r.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from megatron_rl.rollout.types import Sample


@dataclass(frozen=True)
class TrainBatch:
    tokens: torch.Tensor  # [N, S] int64
    loss_mask: torch.Tensor  # [N, S-1] bool
    rollout_logprobs: torch.Tensor  # [N, S-1] fp32 (0 off-mask)
    advantages: torch.Tensor  # [N, S-1] fp32 (the sample's advantage on its response tokens)
    positions: torch.Tensor  # [N, S-1] int64, index inside the response (0 off-mask)
    rewards: torch.Tensor  # [N] fp32
    versions: torch.Tensor  # [N] int64: policy version that generated each sample
    kept_ids: torch.Tensor | None = None  # [N, S-1, K] int64, -1 padded: rollout's top-p/top-k sets

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1]

    def select(self, index) -> TrainBatch:
        """Rows `index` (slice or index tensor) of every field."""
        return TrainBatch(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[index]
                             for f in fields(self)})

    def with_advantages(self, advantages_per_row: torch.Tensor) -> TrainBatch:
        adv = advantages_per_row.float().unsqueeze(1) * self.loss_mask.float()
        return replace(self, advantages=adv)


def padded_length(samples: list[Sample], multiple: int = 1) -> int:
    """Common row length S such that the model's input length S - 1 (the longest prompt+response
    minus the last token, which is never an input) is a multiple of `multiple` (TP under
    sequence parallelism, 2*CP under context parallelism)."""
    longest = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    return -(-(longest - 1) // multiple) * multiple + 1


def build_batch(samples: list[Sample], rewards: list[float], pad_id: int, seq_len: int,
                with_kept_ids: bool = False) -> TrainBatch:
    """Pack samples into a TrainBatch of rows of length `seq_len` (advantages left at 0).

    with_kept_ids: also pack each sample's kept top-p/top-k token ids (required on every sample).
    """
    n = len(samples)
    tokens = torch.full((n, seq_len), pad_id, dtype=torch.long)
    mask = torch.zeros(n, seq_len - 1, dtype=torch.bool)
    logp = torch.zeros(n, seq_len - 1, dtype=torch.float32)
    pos = torch.zeros(n, seq_len - 1, dtype=torch.long)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        if p + r > seq_len:
            raise ValueError(f"sample {i} has {p}+{r} tokens, more than seq_len={seq_len}")
        if p < 1:
            raise ValueError(f"sample {i} has an empty prompt; a response needs at least one context token")
        tokens[i, :p] = s.prompt_ids
        tokens[i, p:p + r] = s.response_ids
        mask[i, p - 1:p - 1 + r] = True
        logp[i, p - 1:p - 1 + r] = s.rollout_logprobs.float()
        pos[i, p - 1:p - 1 + r] = torch.arange(r)
    kept = None
    if with_kept_ids:
        missing = [i for i, s in enumerate(samples) if s.kept_ids is None]
        if missing:
            raise ValueError(f"keep_sampling_mask needs kept ids from the engine; samples {missing[:5]} have none")
        k = max(s.kept_ids.shape[1] for s in samples)
        kept = torch.full((n, seq_len - 1, k), -1, dtype=torch.long)
        for i, s in enumerate(samples):
            p, r = len(s.prompt_ids), len(s.response_ids)
            kept[i, p - 1:p - 1 + r, :s.kept_ids.shape[1]] = s.kept_ids
    return TrainBatch(tokens=tokens, loss_mask=mask, rollout_logprobs=logp,
                      advantages=torch.zeros(n, seq_len - 1), positions=pos,
                      rewards=torch.tensor(rewards, dtype=torch.float32),
                      versions=torch.tensor([s.policy_version for s in samples], dtype=torch.long), kept_ids=kept)


def local_rows(n: int, num_minibatches: int, dp_size: int, dp_rank: int) -> torch.Tensor:
    """Global row indices this DP rank trains on, mini-batch by mini-batch.

    Mini-batch m is the global rows [m*n/N, (m+1)*n/N) whatever the DP size (so an optimizer
    step sees the same data at any DP), and each mini-batch is split evenly over DP ranks.
    The result is laid out so that minibatch_slices(len, N, mbs) finds each mini-batch's
    local share contiguously.
    """
    if n % (num_minibatches * dp_size):
        raise ValueError(f"{n} samples per step do not split into train.num_minibatches={num_minibatches} "
                         f"x {dp_size} data-parallel ranks")
    per = n // num_minibatches
    share = per // dp_size
    return torch.cat([torch.arange(m * per + dp_rank * share, m * per + (dp_rank + 1) * share)
                      for m in range(num_minibatches)])


def shard_rows(n: int, parts: int, index: int) -> slice:
    """Contiguous equal share `index` of `n` rows split into `parts` (n must divide)."""
    if n % parts:
        raise ValueError(f"{n} rows do not split evenly into {parts} parts")
    size = n // parts
    return slice(index * size, (index + 1) * size)


def minibatch_slices(n: int, num_minibatches: int, micro_batch_size: int) -> list[list[slice]]:
    """Rows of each mini-batch (one optimizer step), as micro-batch slices.

    n rows -> num_minibatches contiguous mini-batches -> micro-batches of micro_batch_size.
    Raises with the arithmetic when the sizes do not divide (PP needs equal micro-batches).
    """
    if n % num_minibatches:
        raise ValueError(f"{n} samples per rank do not split into train.num_minibatches={num_minibatches}")
    per = n // num_minibatches
    if per % micro_batch_size:
        raise ValueError(f"a mini-batch of {per} samples per rank does not split into micro-batches of "
                         f"train.micro_batch_size={micro_batch_size}; choose a divisor of {per}")
    return [[slice(m * per + k * micro_batch_size, m * per + (k + 1) * micro_batch_size)
             for k in range(per // micro_batch_size)] for m in range(num_minibatches)]
