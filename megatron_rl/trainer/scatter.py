"""Each rank's part of the step's batch, sent by rank 0 as tensors: the rows it trains on, no more.

Rank 0 holds the engine and the step's whole batch (it generated it). It computes the group
advantages (a group's statistics need the whole group) and packs the padded batch once
(trainer/phases.py `prepare`); every other rank receives only its part:

    plan = row_plan(layout, coords, cp)                # pure: the rows and CP shard of every rank
    tensors = part_tensors(full, routing, plan[r], cp)  # pure: rank r's tensors, by field name
    local = scatter_batch(prepare, layout, groups)      # collective: LocalRollout on every rank

A rank's part is what `batch.local_shard` keeps of the whole batch: its DP rows (`BatchLayout.
local_rows`, mini-batch by mini-batch) and, under context parallelism, the zig-zag columns of its
CP rank of every per-token field (`batch.PER_TOKEN`); per-row fields (rewards, versions) whole.
The engine's routing for router replay (R2/R3) comes with it as whole rows: the replay's
`TokenLayout` cuts them for its CP and TP ranks itself.

Protocol (every rank alike; an error of rank 0's `prepare` reaches every rank as the same
exception, so no rank is left waiting in a collective):
  1. coordinates: one all-gather of three integers per rank (DP rank, CP rank, rank in its
     model-parallel group), so rank 0 knows whom to send what whatever megatron's rank order;
  2. header: one small pickled broadcast from rank 0: the part's fields (name, dtype, shape; the
     same on every rank, DP shares and CP shards being equal), rank 0's host metrics of the whole
     batch (rewards, lengths, advantages), or the error;
  3. body: rank 0 sends the first rank of each model-parallel group (TP x PP ranks share their DP
     rows and CP shard) its part as one flat byte buffer, point to point; that rank broadcasts it
     in its model-parallel group. Both on the group's device: the CPU for gloo, the current CUDA
     device for NCCL (`metrics.reduce.group_device`).

Cost, for N = B·G rows of L inputs, DP x CP x MP ranks (MP = TP·PP), c bytes of per-token fields
per position (+ 8·K for kept ids, + 8 for token versions when a sample crossed a weight update) and, under router replay, M MoE layers x k experts (int16):
    received per rank   N/DP · (L/CP · c + L · (2 + 2·M·k))        (+ N/DP · 12 per-row bytes)
    sent by rank 0      each (DP, CP) part once: the whole batch, its routing CP times
    rank 0's memory     the packed batch plus one part being sent
    each MP group       one broadcast of its part
"""
from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_rl.logprobs.context_parallel import zigzag_indices
from megatron_rl.metrics.reduce import group_device
from megatron_rl.moe import RolloutRouting
from megatron_rl.trainer.batch import PER_TOKEN, TrainBatch, model_device
from megatron_rl.trainer.rollout_io import broadcast

_ROUTING = "routing."  # prefix of the routing fields among a part's tensors
_ALIGN = 8  # every field starts at a multiple of 8 bytes of the buffer: any dtype can view it


@dataclass(frozen=True)
class Prepared:
    """Rank 0's step batch, ready to split: full: the packed batch (advantages and kept rows in
    its loss mask), one CP-whole row per sample; routing: the engine's routing of its rows, or
    None (no router replay); metrics: host floats of the whole batch, logged as they are."""

    full: TrainBatch
    routing: RolloutRouting | None
    metrics: dict[str, float]


@dataclass(frozen=True)
class LocalRollout:
    """This rank's part of the step. batch: its rows (its CP shard), on the model's device;
    rows: [local_size] their global indices; routing: the engine's routing of those rows (whole
    rows, host), or None; metrics: rank 0's values of the whole batch; bytes_received: the bytes
    of the part (rank 0 counts its own part, which it keeps)."""

    batch: TrainBatch
    rows: Tensor
    routing: RolloutRouting | None
    metrics: dict[str, float]
    bytes_received: int


@dataclass(frozen=True)
class RankRows:
    """One rank's share: rows [local_size] int64 global row indices; cp_rank: which zig-zag shard
    of each row's per-token values it trains on."""

    rows: Tensor
    cp_rank: int


def row_plan(layout, coords: Sequence[tuple[int, int]]) -> list[RankRows]:
    """Every rank's share of a step: coords[g] = (DP rank, CP rank) of global rank g; `layout` a
    parallel.layout.BatchLayout. Pure; O(world · rows) integers."""
    return [RankRows(layout.local_rows(dp), cp) for dp, cp in coords]


def part_tensors(full: TrainBatch, routing: RolloutRouting | None, share: RankRows, cp: int) -> dict[str, Tensor]:
    """The tensors of `share` by field name (routing fields as "routing.<name>"), contiguous, on
    `full`'s device: `full.select(rows)` with every per-token field cut to the CP rank's zig-zag
    columns, as `batch.cp_shard` cuts them (megatron-core's split: 2·CP chunks per row, rank r
    keeps chunks r and 2·CP−1−r); routing rows whole. Pure."""
    length = full.input_ids.shape[1]
    if cp > 1 and length % (2 * cp):
        raise ValueError(f"rows have {length} inputs, not a multiple of 2*CP={2 * cp}; "
                         "pad them with padded_length(samples, row_multiple(tp, cp))")
    rows = share.rows.to(full.input_ids.device)
    cols = zigzag_indices(share.cp_rank, cp, total_len=length, device=rows.device) if cp > 1 else None
    out = {}
    for f in fields(full):
        t = getattr(full, f.name)
        if isinstance(t, Tensor):
            t = t[rows]
            out[f.name] = (t[:, cols] if cols is not None and f.name in PER_TOKEN else t).contiguous()
    for f in fields(RolloutRouting) if routing is not None else ():
        t = getattr(routing, f.name)
        if t is not None:
            out[_ROUTING + f.name] = t[rows.to(t.device)].contiguous()
    return out


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _nbytes(dtype: torch.dtype, shape) -> int:
    return torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()


def part_bytes(spec) -> int:
    """Bytes of the tensors of `spec` (what a rank receives, without the buffer's alignment)."""
    return sum(_nbytes(dtype, shape) for _, dtype, shape in spec)


def spec_of(tensors: dict[str, Tensor]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) of each tensor: what a receiver needs to read the buffer."""
    return [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]


def buffer_size(spec) -> int:
    """Bytes of the flat buffer of `spec` (each field padded to _ALIGN bytes)."""
    return sum(_padded(_nbytes(dtype, shape)) for _, dtype, shape in spec)


def to_buffer(tensors: dict[str, Tensor], device: torch.device) -> Tensor:
    """The tensors as one flat uint8 buffer on `device`, in order, each at an _ALIGN offset."""
    buf = torch.zeros(buffer_size(spec_of(tensors)), dtype=torch.uint8, device=device)
    offset = 0
    for t in tensors.values():
        n = t.numel() * t.element_size()
        buf[offset:offset + n] = t.reshape(-1).view(torch.uint8)
        offset += _padded(n)
    return buf


def from_buffer(buf: Tensor, spec) -> dict[str, Tensor]:
    """The inverse of `to_buffer`: views of `buf` by name."""
    out, offset = {}, 0
    for name, dtype, shape in spec:
        n = _nbytes(dtype, shape)
        out[name] = buf[offset:offset + n].view(dtype).view(shape)
        offset += _padded(n)
    return out


def _coordinates(groups) -> list[tuple[int, int, int]]:
    """(DP rank, CP rank, model-parallel rank) of every global rank (one small all-gather)."""
    mine = torch.tensor([dist.get_rank(groups.dp_group), dist.get_rank(groups.cp_group),
                         dist.get_rank(groups.pgs.mp)], dtype=torch.long, device=group_device())
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [tuple(int(x) for x in t.tolist()) for t in every]


def _picklable(error: Exception) -> Exception:
    """`error` itself when it pickles (the other ranks raise the same type), else a RuntimeError
    with its text: an error that cannot be sent must not leave rank 0 out of the broadcast."""
    try:
        pickle.dumps(error)
        return error
    except Exception:  # noqa: BLE001 - any failure to pickle
        return RuntimeError(f"{type(error).__name__}: {error}")


def _local(tensors: dict[str, Tensor], rows: Tensor, cp: int, metrics: dict, nbytes: int) -> LocalRollout:
    routing = {k[len(_ROUTING):]: v.cpu() for k, v in tensors.items() if k.startswith(_ROUTING)}
    batch = TrainBatch(**{k: v for k, v in tensors.items() if not k.startswith(_ROUTING)}, cp_size=cp)
    return LocalRollout(batch.to(model_device()), rows, RolloutRouting(**{"experts": None, **routing}) if routing
                        else None, metrics, nbytes)


def scatter_batch(prepare: Callable[[], Prepared], layout, groups) -> LocalRollout:
    """Every rank's part of the step's batch (collective; the module docstring gives the protocol
    and its cost). `prepare` runs on global rank 0 only; `layout`: the step's BatchLayout;
    `groups`: the run's ParallelGroups."""
    cp = groups.config.cp
    coords = _coordinates(groups)
    mine = coords[dist.get_rank()]
    rows = layout.local_rows(mine[0])
    header, prepared, plan = None, None, None
    if dist.get_rank() == 0:
        try:
            prepared = prepare()
            plan = row_plan(layout, [c[:2] for c in coords])
            own = part_tensors(prepared.full, prepared.routing, plan[0], cp)
            header = {"spec": spec_of(own), "metrics": prepared.metrics}
        except Exception as e:  # noqa: BLE001 - every rank must learn of it
            header = {"error": _picklable(e)}
    header = broadcast(header)
    if "error" in header:
        raise header["error"]
    spec, mp, device = header["spec"], groups.pgs.mp, group_device()
    if dist.get_rank() == 0:
        for dst, (_, _, mp_rank) in enumerate(coords):
            if dst != 0 and mp_rank == 0:  # the first rank of another model-parallel group
                dist.send(to_buffer(part_tensors(prepared.full, prepared.routing, plan[dst], cp), device), dst=dst)
        buf = to_buffer(own, device) if dist.get_world_size(mp) > 1 else None
    else:
        buf = torch.empty(buffer_size(spec), dtype=torch.uint8, device=device)
        if mine[2] == 0:
            dist.recv(buf, src=0)
    if dist.get_world_size(mp) > 1:
        dist.broadcast(buf, src=dist.get_global_rank(mp, 0), group=mp)
    tensors = own if dist.get_rank() == 0 else from_buffer(buf, spec)
    return _local(tensors, rows, cp, header["metrics"], part_bytes(spec))
