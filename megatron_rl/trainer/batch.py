"""Samples -> padded training tensors, the split into mini-batches / micro-batches, and the
context-parallel shard of every row.

Layout (one row per response; rows right padded to a common length S; L = S - 1 model inputs):
    input_ids     [N, L]  the row's tokens but the last (pad id after the response)
    labels        [N, L]  labels[:, t] = token t + 1 of the row: the label shift happens here, on the
                          whole row, before any context-parallel split
    position_ids  [N, L]  index of each input token inside its row
    loss_mask     [N, L]  1 at the response tokens' label positions (P-1 .. P+R-2) that the sample's
                          own loss_mask keeps (all of them by default), else 0
    rollout_logprobs, advantages, positions (index of the token inside its response): [N, L]
    turns         [N, L]  the policy turn (0, 1, ...) of each trained label position, -1 elsewhere; only
                          in a batch holding environment tokens (a sample whose loss_mask has a False),
                          None otherwise (rollout/trajectory.py: turn_index)
    token_versions [N, L] the policy version of each response token's label position (the row's version
                          elsewhere); only in a batch holding a sample that crossed a weight update
                          (partial rollouts: Sample.token_versions), None otherwise
A sample with prompt length P and response length R has its response token r at row index P + r,
i.e. it is labels[:, P - 1 + r], and its log-prob at label index P - 1 + r.

Under context parallelism (`cp_shard`) every [N, L] tensor holds this CP rank's zig-zag shard of
each row, [N, L / CP], sharded by megatron-core's own `get_batch_on_this_cp_rank`; per-row tensors
(rewards, versions) stay whole.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from megatron_rl.platform.mcore_api import cp_zigzag_shard
from megatron_rl.rollout.trajectory import turn_index
from megatron_rl.rollout.types import Sample

# the [N, L(, ...)] fields: context parallelism shards their columns; the others are per row
PER_TOKEN = ("input_ids", "labels", "position_ids", "loss_mask", "rollout_logprobs", "advantages", "positions",
             "kept_ids", "turns", "token_versions")


@dataclass(frozen=True)
class TrainBatch:
    input_ids: torch.Tensor  # [N, L] int64
    labels: torch.Tensor  # [N, L] int64: next token of each input position
    position_ids: torch.Tensor  # [N, L] int64: index of each input token in its row
    loss_mask: torch.Tensor  # [N, L] bool
    rollout_logprobs: torch.Tensor  # [N, L] fp32 (0 off-mask)
    advantages: torch.Tensor  # [N, L] fp32 (the sample's advantage on its response tokens)
    positions: torch.Tensor  # [N, L] int64, index inside the response (0 off-mask)
    rewards: torch.Tensor  # [N] fp32
    versions: torch.Tensor  # [N] int64: policy version that generated each sample
    kept_ids: torch.Tensor | None = None  # [N, L, K] int64, -1 padded: rollout's top-p/top-k sets
    turns: torch.Tensor | None = None  # [N, L] int64: policy turn of each trained position, -1 elsewhere
    token_versions: torch.Tensor | None = None  # [N, L] int64: policy version of each response token
    cp_size: int = 1  # > 1: the [N, L] tensors are this rank's zig-zag shard (1/cp_size of each row)

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def input_len(self) -> int:
        """The model's (global) input length per row, L·CP: megatron's schedules divide it by CP."""
        return self.input_ids.shape[1] * self.cp_size

    def select(self, index) -> TrainBatch:
        """Rows `index` (slice or index tensor) of every tensor field."""
        return replace(self, **{f.name: getattr(self, f.name)[index] for f in fields(self)
                                if isinstance(getattr(self, f.name), torch.Tensor)})

    def to(self, device: torch.device | str) -> TrainBatch:
        """Every tensor field on `device` (the model's: the micro-batches feed it directly)."""
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)
                                if isinstance(getattr(self, f.name), torch.Tensor)})

    def with_advantages(self, advantages_per_row: torch.Tensor) -> TrainBatch:
        adv = advantages_per_row.float().unsqueeze(1) * self.loss_mask.float()
        return replace(self, advantages=adv)


def cp_shard(batch: TrainBatch, cp_group) -> TrainBatch:
    """This rank's context-parallel shard of every row: each [N, L] tensor -> [N, L / CP].

    Zig-zag (2·CP chunks per row, rank r keeps chunks r and 2·CP−1−r) by megatron-core's
    `get_batch_on_this_cp_rank`, the same split its GPTModel expects under CP. L must be a multiple
    of 2·CP (`padded_length(..., row_multiple(tp, cp))`). A CP group of size 1 returns `batch`.
    """
    import torch.distributed as dist

    cp = dist.get_world_size(cp_group)
    if cp == 1:
        return batch
    if batch.cp_size != 1:
        raise ValueError("batch is already a context-parallel shard")
    length = batch.input_ids.shape[1]
    if length % (2 * cp):
        raise ValueError(f"rows have {length} inputs, not a multiple of 2*CP={2 * cp}; "
                         "pad them with padded_length(samples, row_multiple(tp, cp))")
    tensors = {k: getattr(batch, k).contiguous() for k in PER_TOKEN if getattr(batch, k) is not None}
    return replace(batch, **cp_zigzag_shard(tensors, cp_group), cp_size=cp)


def model_device() -> torch.device:
    """Where the megatron model lives: the current CUDA device when there is one (megatron builds
    its parameters there), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def row_multiple(tp: int, cp: int) -> int:
    """What the input length L must be a multiple of: TP (sequence parallelism splits the
    sequence over TP ranks) times 2·CP under context parallelism (zig-zag chunks)."""
    return tp * (2 * cp if cp > 1 else 1)


def padded_length(samples: list[Sample], multiple: int = 1) -> int:
    """Common row length S such that the model's input length S - 1 (the longest prompt+response
    minus the last token, which is never an input) is a multiple of `multiple` (TP under
    sequence parallelism, 2*CP under context parallelism)."""
    longest = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    return -(-(longest - 1) // multiple) * multiple + 1


def _response_mask(i: int, s: Sample) -> torch.Tensor:
    """Sample `i`'s loss_mask, checked: [R] bool."""
    m = s.loss_mask
    if m.dtype != torch.bool or tuple(m.shape) != (len(s.response_ids),):
        raise ValueError(f"sample {i}: loss_mask must be bool [{len(s.response_ids)}] (one per response token), got "
                         f"{m.dtype} {tuple(m.shape)}")
    return m


def build_batch(samples: list[Sample], rewards: list[float], pad_id: int, seq_len: int,
                with_kept_ids: bool = False) -> TrainBatch:
    """Pack samples into a TrainBatch of rows of length `seq_len` (advantages left at 0).

    A sample's `loss_mask` (None: all true) selects the response tokens that are trained on; the
    others stay in the row as context and are 0 in every per-token tensor but the token ids, as
    padding is. with_kept_ids: also pack each sample's kept top-p/top-k token ids (required on
    every sample). Cost: O(N·S) host memory, one row copy per sample.
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
        if s.loss_mask is None:  # every response token was sampled (single-turn)
            mask[i, p - 1:p - 1 + r] = True
            logp[i, p - 1:p - 1 + r] = s.rollout_logprobs.float()
            pos[i, p - 1:p - 1 + r] = torch.arange(r)
            continue
        m = _response_mask(i, s)  # masked tokens (an environment's) are context: 0 off-mask, like padding
        mask[i, p - 1:p - 1 + r] = m
        logp[i, p - 1:p - 1 + r] = torch.where(m, s.rollout_logprobs.float(), 0.0)
        pos[i, p - 1:p - 1 + r] = torch.where(m, torch.arange(r), 0)
    kept = None
    if with_kept_ids:
        missing = [i for i, s in enumerate(samples) if s.kept_ids is None]
        if missing:
            raise ValueError(f"keep_sampling_mask needs kept ids from the engine; samples {missing[:5]} have none")
        k = max(s.kept_ids.shape[1] for s in samples)
        kept = torch.full((n, seq_len - 1, k), -1, dtype=torch.long)
        for i, s in enumerate(samples):
            p, r = len(s.prompt_ids), len(s.response_ids)
            ids = s.kept_ids if s.loss_mask is None else s.kept_ids.masked_fill(~s.trained()[:, None], -1)
            kept[i, p - 1:p - 1 + r, :s.kept_ids.shape[1]] = ids
    return TrainBatch(input_ids=tokens[:, :-1].contiguous(), labels=tokens[:, 1:].contiguous(),
                      position_ids=torch.arange(seq_len - 1).expand(n, -1).contiguous(),
                      loss_mask=mask, rollout_logprobs=logp, advantages=torch.zeros(n, seq_len - 1), positions=pos,
                      rewards=torch.tensor(rewards, dtype=torch.float32),
                      versions=torch.tensor([s.policy_version for s in samples], dtype=torch.long), kept_ids=kept,
                      turns=_turns(samples, seq_len), token_versions=_token_versions(samples, seq_len))


def _token_versions(samples: list[Sample], seq_len: int) -> torch.Tensor | None:
    """[N, seq_len - 1] policy version per label position (the row's policy_version off the response),
    or None when no sample crossed a weight update (the per-row `versions` say it all)."""
    if all(s.token_versions is None for s in samples):
        return None
    out = torch.tensor([s.policy_version for s in samples], dtype=torch.long)[:, None].repeat(1, seq_len - 1)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        out[i, p - 1:p - 1 + r] = s.versions()
    return out


def _turns(samples: list[Sample], seq_len: int) -> torch.Tensor | None:
    """[N, seq_len - 1] policy turn per label position (-1 off the trained tokens), or None when no
    sample holds an environment token (single-turn batches pack as before)."""
    if all(s.loss_mask is None or bool(s.loss_mask.all()) for s in samples):
        return None
    out = torch.full((len(samples), seq_len - 1), -1, dtype=torch.long)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        out[i, p - 1:p - 1 + r] = turn_index(s.trained())
    return out


def pack(samples: list[Sample], rewards: list[float], pad_id: int, parallel, with_kept_ids: bool = False) -> TrainBatch:
    """`build_batch` at the common row length the parallel layout needs (`parallel`: a
    ParallelConfig; TP under sequence parallelism, 2·CP under context parallelism)."""
    seq_len = padded_length(samples, row_multiple(parallel.tp, parallel.cp))
    return build_batch(samples, rewards, pad_id, seq_len, with_kept_ids=with_kept_ids)


def local_shard(full: TrainBatch, layout, groups) -> tuple[torch.Tensor, TrainBatch]:
    """This rank's part of the step's batch: its DP rows (`layout`, a parallel.layout.BatchLayout),
    their CP shard, on the model's device. Returns (the rows' global indices [local_size], the batch)."""
    import torch.distributed as dist

    rows = layout.local_rows(dist.get_rank(groups.dp_group))
    return rows, cp_shard(full.select(rows), groups.cp_group).to(model_device())
