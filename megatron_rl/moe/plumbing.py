"""Rollout routing (R3) -> the replay indices each rank's MoE layers see; pure functions.

The rollout engine reports, per sample, `routed_experts [P+R-1, num_moe_layers, topk]`: the
experts of every processed input position (prompt and response tokens except the last). The
trainer lays rows out as `tokens [N, S]`, right padded, and feeds `tokens[:, :-1]` (S-1 input
positions; position t of a row is token t of prompt+response). A megatron rank's router sees

    [S-1, b] sequence-first  ->  CP zig-zag shard of the sequence (CP > 1)
                             ->  contiguous 1/TP of the (local) sequence (sequence parallel)
                             ->  flattened s * b + row                       = local token order

and a pipeline stage holds only its own MoE layers. Each cut is made once: `RolloutRouting.rank_part`
takes a rank's rows, CP columns and MoE layers (trainer/scatter.py cuts on rank 0 and sends each
rank that part only); `TokenLayout.to_local` lays the CP-local columns out in megatron's token
order (the sequence-parallel cut included) and `replay_routing` applies the fallback below.

Fallback (megatron replays a whole layer or nothing, never per token):
- padding (positions at or after the row's last token, whose outputs are masked and, causal
  attention being one-way, never reach a real token): any valid experts do; without a live record
  they get `k` distinct experts spread over all experts (`(t + j) % E`) to keep EP loads even;
- real positions with no engine routing (a sample with `routed_experts=None`, or prompt positions
  when an engine reports generated tokens only): the live router's choice, taken from a RECORD
  pass of the same micro-batch with the same weights ("hybrid": record, overwrite the positions
  the engine routed, replay). Such positions form a prefix of their row (or the whole row), and
  causal attention makes the prefix's hidden states depend on the prefix only, so replaying the
  recorded choice is what the live router picks there (up to numerical noise); in later update passes those
  positions keep that choice (R2 semantics for them). `live_routing_needed` says when the record
  pass is needed; `replayed_token_sums` counts the fraction of real tokens replayed from the engine.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from megatron_rl.logprobs.context_parallel import zigzag_indices
from megatron_rl.metrics.reduce import ratio
from megatron_rl.moe.replay import MicroBatchRouting


@dataclass(frozen=True)
class TokenLayout:
    """Where a micro-batch's CP-local positions land on this rank's routers.

    sequence_parallel: megatron's `config.sequence_parallel` (on for MoE with TP > 1); without it
    every TP rank routes the whole (CP-local) sequence. The context-parallel cut is not here: the
    values it lays out are already this rank's CP shard (`RolloutRouting.rank_part`, or a TrainBatch
    tensor after trainer.batch.cp_shard), so no path cuts CP twice.
    """

    tp_size: int = 1
    tp_rank: int = 0
    sequence_parallel: bool = False

    @classmethod
    def from_groups(cls, groups, sequence_parallel: bool) -> TokenLayout:
        """From a megatron_rl ParallelGroups and the model config's sequence_parallel."""
        return cls(tp_size=groups.config.tp, tp_rank=groups.tp_rank, sequence_parallel=sequence_parallel)

    def positions(self, seq_len: int, device: torch.device | str = "cpu") -> Tensor:
        """`[seq_len / TP_sp]` int64 on `device`: which of `seq_len` CP-local positions this rank
        routes, in order."""
        pos = torch.arange(seq_len, device=device)
        if self.sequence_parallel and self.tp_size > 1:
            if seq_len % self.tp_size:
                raise ValueError(f"{seq_len} (CP-local) positions do not split over TP={self.tp_size} "
                                 "under sequence parallelism; pad the rows (trainer.batch.padded_length)")
            size = seq_len // self.tp_size
            pos = pos[self.tp_rank * size:(self.tp_rank + 1) * size]
        return pos

    def to_local(self, x: Tensor) -> Tensor:
        """`[b, S / CP, *rest]` values of this rank's CP shard -> `[S_local * b, *rest]` in megatron's
        local token order."""
        pos = self.positions(x.shape[1], x.device)
        return x[:, pos].transpose(0, 1).reshape(-1, *x.shape[2:])


@dataclass(frozen=True)
class RolloutRouting:
    """Engine routing of a batch, laid out like TrainBatch rows (input positions 0..S-2).

    experts: `[N, S-1, L, k]` int16 (0 where unknown), or None when no sample has routing.
    known: `[N, S-1]` bool, the engine reported this position's experts.
    real: `[N, S-1]` bool, a position before the row's last token (P+R-1 per row): the positions
        whose outputs the losses can see. The rest is padding.
    """

    experts: Tensor | None
    known: Tensor
    real: Tensor

    @classmethod
    def from_samples(cls, samples: Sequence, seq_len: int) -> RolloutRouting:
        """Rows for `samples` (megatron_rl.rollout.types.Sample) in a batch of row length `seq_len`.

        A sample's `routed_experts [n, L, k]` covers its last n input positions: n = P+R-1 is the
        full record, a shorter one (an engine that reports generated tokens only) leaves the
        prompt prefix unknown.
        """
        n, s = len(samples), seq_len - 1
        known = torch.zeros(n, s, dtype=torch.bool)
        real = torch.zeros(n, s, dtype=torch.bool)
        shape = next((tuple(x.routed_experts.shape[1:]) for x in samples if x.routed_experts is not None), None)
        experts = torch.zeros(n, s, *shape, dtype=torch.int16) if shape is not None else None
        for i, smp in enumerate(samples):
            length = len(smp.prompt_ids) + len(smp.response_ids) - 1
            if length > s:
                raise ValueError(f"sample {i} has {length} input positions, more than seq_len - 1 = {s}")
            real[i, :length] = True
            r = smp.routed_experts
            if r is None:
                continue
            if tuple(r.shape[1:]) != shape:
                raise ValueError(f"sample {i}: routed_experts {tuple(r.shape)} does not match [n, {shape[0]}, "
                                 f"{shape[1]}] of the other samples")
            if r.shape[0] > length:
                raise ValueError(f"sample {i}: routed_experts has {r.shape[0]} positions, more than its "
                                 f"{length} input positions (P + R - 1)")
            experts[i, length - r.shape[0]:length] = r.to(torch.int16)
            known[i, length - r.shape[0]:length] = True
        return cls(experts, known, real)

    def rank_part(self, rows: Tensor | slice, cp_rank: int = 0, cp: int = 1,
                  layer_ids: Sequence[int] | None = None) -> RolloutRouting:
        """What one rank's replay reads: rows `rows`, the zig-zag columns of CP rank `cp_rank` (the
        columns trainer.batch.cp_shard keeps of every per-token field: chunks r and 2·CP−1−r of
        2·CP) and, of `experts`, the MoE layers `layer_ids` in that order (its pipeline stage's,
        `RouterReplayController.layer_ids`; None: all). Pure; O(rows · S/CP · len(layer_ids) · k)."""
        part = self.select(rows)
        if cp > 1:
            cols = zigzag_indices(cp_rank, cp, total_len=part.known.shape[1], device=part.known.device)
            part = RolloutRouting(**{f.name: None if getattr(part, f.name) is None else getattr(part, f.name)[:, cols]
                                     for f in fields(part)})
        if layer_ids is not None and part.experts is not None:
            index = torch.tensor(list(layer_ids), dtype=torch.long, device=part.experts.device)
            part = replace(part, experts=part.experts.index_select(2, index))
        return part

    def select(self, index) -> RolloutRouting:
        """Rows `index` (slice or index tensor), like TrainBatch.select."""
        return RolloutRouting(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[index]
                                 for f in fields(self)})

    @property
    def size(self) -> int:
        return self.known.shape[0]


def live_routing_needed(routing: RolloutRouting) -> bool:
    """True when some real position lacks engine routing: `replay_routing` then needs a live record."""
    return bool((routing.real & ~routing.known).any())


def spread_experts(num_tokens: int, topk: int, num_experts: int) -> Tensor:
    """`[num_tokens, topk]` int64, k distinct experts per token: `(t + j) % num_experts`."""
    if topk > num_experts:
        raise ValueError(f"topk={topk} > num_experts={num_experts}")
    return (torch.arange(num_tokens)[:, None] + torch.arange(topk)[None, :]) % num_experts


def replay_routing(routing: RolloutRouting, layout: TokenLayout, layer_ids: Sequence[int], num_experts: int,
                   live: MicroBatchRouting | None = None) -> MicroBatchRouting:
    """This rank's replay indices for one micro-batch of rows.

    routing: the micro-batch's rows of this rank's part (`RolloutRouting.rank_part`: its CP columns
        and its stage's MoE layers `layer_ids`, in that order), b rows of (S-1)/CP positions.
    layout: this rank's TokenLayout. layer_ids: the stage's MoE layers (controller.layer_ids).
    live: the same micro-batch's RECORD-pass routing on this rank (needed when
        `live_routing_needed(routing)`; optional otherwise, then it also fills padding).
    Returns indices `[S_local*b, k]` int64 per local layer, and `mask` = the real tokens replayed
    from the engine (where engine-vs-trainer agreement is defined).
    """
    known = layout.to_local(routing.known)
    real = layout.to_local(routing.real)
    tokens = known.shape[0]
    missing_real = real & ~known
    if live is None and bool(missing_real.any()):
        raise ValueError(f"{int(missing_real.sum())} real tokens of this micro-batch have no engine routing; "
                         "run a RECORD pass of the micro-batch first and pass its routing as `live`")
    if live is not None and len(live.indices) != len(layer_ids):
        raise ValueError(f"live routing has {len(live.indices)} layers, expected {len(layer_ids)}")
    if routing.experts is None:
        if live is None:
            raise ValueError("no engine routing in this micro-batch and no live record to fall back to")
        return MicroBatchRouting([t.long() for t in live.indices], known & real)
    if routing.experts.shape[2] != len(layer_ids):
        raise ValueError(f"the routing holds {routing.experts.shape[2]} MoE layers, this stage replays "
                         f"{len(layer_ids)} ({tuple(layer_ids)}): give it the stage's part "
                         "(RolloutRouting.rank_part with the controller's layer_ids)")
    experts = layout.to_local(routing.experts).long()  # [T, L', k]
    if experts.numel() and (int(experts.max()) >= num_experts or int(experts.min()) < 0):
        raise ValueError(f"engine routing has expert ids outside [0, {num_experts})")
    topk = experts.shape[-1]
    out = []
    for layer in range(len(layer_ids)):
        if live is not None:
            fill = live.indices[layer].long().to(experts.device)
            if fill.shape != (tokens, topk):
                raise ValueError(f"live routing of local layer {layer} is {tuple(fill.shape)}, "
                                 f"expected {(tokens, topk)} for this layout")
        else:
            fill = spread_experts(tokens, topk, num_experts).to(experts.device)
        out.append(torch.where(known[:, None], experts[:, layer], fill))
    return MicroBatchRouting(out, known & real)


def local_mask(rows_mask: Tensor, layout: TokenLayout) -> Tensor:
    """`[b, (S-1)/CP]` per-position bool of this rank's CP shard (e.g. the `real` of a rank's
    RolloutRouting part) -> `[S_local*b]` in local token order."""
    return layout.to_local(rows_mask.bool())


def replayed_token_sums(routing: RolloutRouting) -> dict[str, Tensor]:
    """`moe/replayed_token_fraction`: real tokens replayed from the engine / real tokens, as a
    ratio in the metrics convention (megatron_rl/metrics/reduce.py).

    Counts of this rank's part (its rows and CP columns; the same on every TP / PP rank of a DP x CP
    cell): summed over the world, each position counts TP·PP times, which cancels in the fraction.
    """
    real = routing.real
    return ratio("moe/replayed_token_fraction", (real & routing.known).sum(dtype=torch.float64),
                 real.sum(dtype=torch.float64))
