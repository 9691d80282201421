"""Each rank's part of the step's batch, sent by rank 0 as tensors: the rows it trains on, no more.

Rank 0 holds the engine and the step's whole batch (it generated it). It computes the group
advantages (a group's statistics need the whole group) and packs the padded batch once
(trainer/phases.py `prepare`); every other rank receives only its part:

    plan = row_plan(layout, coords, layers)             # pure: rows, CP shard, MoE layers of every rank
    tensors = part_tensors(full, routing, plan[r], cp)  # pure: rank r's tensors, by field name
    local = scatter_batch(prepare, layout, groups, layer_ids)  # collective: LocalRollout on every rank

A rank's part is what `batch.local_shard` keeps of the whole batch: its DP rows (`BatchLayout.
local_rows`, mini-batch by mini-batch) and, under context parallelism, the zig-zag columns of its
CP rank of every per-token field (`batch.PER_TOKEN`); per-row fields (rewards, versions) whole.
The engine's routing for router replay (R2/R3) comes with it cut the same way, and to the MoE
layers of the rank's pipeline stage (`RolloutRouting.rank_part`; the replay reads it as it is and
only lays it out for its TP rank, moe/plumbing.py `TokenLayout`).

Protocol (every rank alike; an error of rank 0's `prepare` reaches every rank as the same
exception, so no rank is left waiting in a collective):
  1. coordinates: one small object all-gather (DP rank, CP rank, rank in its model-parallel group,
     TP rank, the MoE layer ids it replays), so rank 0 knows whom to send what whatever
     megatron's rank order and pipeline split (the layer ids come from the built model:
     `RouterReplayController.layer_ids`);
  2. header: one small pickled broadcast from rank 0: the part's fields (name, dtype, shape; the
     same on every rank, DP shares and CP shards being equal, but for the routing's layer count,
     which each rank reads off its own layer ids), rank 0's host metrics of the whole batch
     (rewards, lengths, advantages), or the error;
  3. body, two flat byte buffers, point to point from rank 0: the batch fields to the first rank
     of each model-parallel group (its TP x PP ranks share the DP rows and CP shard), which
     broadcasts them in that group; the routing to the first rank of each TP group (a pipeline
     stage of a model-parallel group: its TP ranks share the stage's layers), which broadcasts it
     in that group. Both on the group's device: the CPU for gloo, the current CUDA device for NCCL
     (`metrics.reduce.group_device`).

Cost, for N = B·G rows of L inputs, DP x CP x TP x PP ranks, c bytes of per-token fields per
position (+ 8·K for kept ids, + 8 for token versions when a sample crossed a weight update) and,
under router replay, M MoE layers (M_s on stage s) x k experts (int16):
    received per rank   N/DP · L/CP · (c + 2 + 2·M_s·k)          (+ N/DP · 12 per-row bytes)
    sent by rank 0      each (DP, CP) part once and each (DP, CP, stage) routing part once: the
                        whole batch and the whole routing, once
    rank 0's memory     the packed batch plus one part being sent
    each group          one broadcast of its part: batch fields over TP·PP ranks, routing over TP
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
    rows: [local_size] their global indices; routing: this rank's part of the engine's routing (those
    rows, its CP columns, its stage's MoE layers; host), or None; metrics: rank 0's values of the whole batch; bytes_received: the bytes
    of the part (rank 0 counts its own part, which it keeps)."""

    batch: TrainBatch
    rows: Tensor
    routing: RolloutRouting | None
    metrics: dict[str, float]
    bytes_received: int


@dataclass(frozen=True)
class RankRows:
    """One rank's share: rows [local_size] int64 global row indices; cp_rank: which zig-zag shard
    of each row's per-token values it trains on; layers: the MoE layers (indices among all of the
    model's) whose routing it reads, or None for all."""

    rows: Tensor
    cp_rank: int
    layers: tuple[int, ...] | None = None


def row_plan(layout, coords: Sequence[tuple[int, int]],
             layers: Sequence[Sequence[int] | None] | None = None) -> list[RankRows]:
    """Every rank's share of a step: coords[g] = (DP rank, CP rank) of global rank g, layers[g] its
    MoE layers (None: every rank reads all); `layout` a parallel.layout.BatchLayout. Pure;
    O(world · (rows + layers)) integers."""
    layers = layers if layers is not None else [None] * len(coords)
    return [RankRows(layout.local_rows(dp), cp, None if ids is None else tuple(ids))
            for (dp, cp), ids in zip(coords, layers, strict=True)]


def part_tensors(full: TrainBatch, routing: RolloutRouting | None, share: RankRows, cp: int) -> dict[str, Tensor]:
    """The tensors of `share` by field name (routing fields as "routing.<name>"), contiguous, on
    `full`'s device: `full.select(rows)` with every per-token field cut to the CP rank's zig-zag
    columns, as `batch.cp_shard` cuts them (megatron-core's split: 2·CP chunks per row, rank r
    keeps chunks r and 2·CP−1−r), then `routing_tensors`. Pure."""
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
    return out | routing_tensors(routing, share, cp)


def routing_tensors(routing: RolloutRouting | None, share: RankRows, cp: int) -> dict[str, Tensor]:
    """The routing fields of `share` ("routing.<name>"), contiguous: its rows, its CP rank's
    zig-zag columns and its MoE layers (`RolloutRouting.rank_part`); empty without routing. Pure."""
    if routing is None:
        return {}
    part = routing.rank_part(share.rows.to(routing.known.device), share.cp_rank, cp, share.layers)
    return {_ROUTING + f.name: getattr(part, f.name).contiguous() for f in fields(part)
            if getattr(part, f.name) is not None}


def stage_spec(spec, layers: Sequence[int] | None):
    """`spec` (rank 0's routing fields) as a rank reading MoE `layers` receives them: the layer
    dimension of the experts is len(layers) (None: unchanged, every rank reads all layers)."""
    return [(name, dtype, shape[:2] + (len(layers),) + shape[3:]
             if layers is not None and name == _ROUTING + "experts" else shape) for name, dtype, shape in spec]


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


@dataclass(frozen=True)
class _Coord:
    """Where a global rank sits: what it receives (its DP rows, CP shard, MoE layers) and from whom
    (the first rank of its model-parallel group for the batch fields, of its TP group for the routing)."""

    dp: int
    cp: int
    mp: int  # rank in its model-parallel (TP x PP) group
    tp: int  # rank in its TP group
    layers: tuple[int, ...] | None


def _coordinates(groups, layers) -> list[_Coord]:
    """Every global rank's `_Coord` (one small object all-gather)."""
    mine = _Coord(dist.get_rank(groups.dp_group), dist.get_rank(groups.cp_group), dist.get_rank(groups.pgs.mp),
                  dist.get_rank(groups.tp_group), None if layers is None else tuple(int(i) for i in layers))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


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


def _deliver(spec, own: dict[str, Tensor] | None, part: Callable[[int], dict[str, Tensor]], leaders: list[bool],
             group) -> dict[str, Tensor]:
    """One buffer per `group`: rank 0 sends `part(dst)` to every other rank whose `leaders[dst]`
    (the first rank of its group), which broadcasts it in `group`; rank 0 keeps `own`. The tensors
    of this rank's part, by name."""
    device, rank = group_device(), dist.get_rank()
    if rank == 0:
        for dst, lead in enumerate(leaders):
            if dst != 0 and lead:
                dist.send(to_buffer(part(dst), device), dst=dst)
        buf = to_buffer(own, device) if dist.get_world_size(group) > 1 else None
    else:
        buf = torch.empty(buffer_size(spec), dtype=torch.uint8, device=device)
        if leaders[rank]:
            dist.recv(buf, src=0)
    if dist.get_world_size(group) > 1:
        dist.broadcast(buf, src=dist.get_global_rank(group, 0), group=group)
    return own if rank == 0 else from_buffer(buf, spec)


def scatter_batch(prepare: Callable[[], Prepared], layout, groups,
                  layer_ids: Sequence[int] | None = None) -> LocalRollout:
    """Every rank's part of the step's batch (collective; the module docstring gives the protocol
    and its cost). `prepare` runs on global rank 0 only; `layout`: the step's BatchLayout;
    `groups`: the run's ParallelGroups; layer_ids: the MoE layers whose routing this rank reads
    (its stage's, `RouterReplayController.layer_ids`; None on every rank: all layers)."""
    cp = groups.config.cp
    coords = _coordinates(groups, layer_ids)
    me = coords[dist.get_rank()]
    rows = layout.local_rows(me.dp)
    header, prepared, plan, own = None, None, None, None
    if dist.get_rank() == 0:
        try:
            prepared = prepare()
            plan = row_plan(layout, [(c.dp, c.cp) for c in coords], [c.layers for c in coords])
            own = part_tensors(prepared.full, prepared.routing, plan[0], cp)
            header = {"spec": spec_of(own), "metrics": prepared.metrics}
        except Exception as e:  # noqa: BLE001 - every rank must learn of it
            header = {"error": _picklable(e)}
    header = broadcast(header)
    if "error" in header:
        raise header["error"]
    spec = [f for f in header["spec"] if not f[0].startswith(_ROUTING)]
    routing_spec = stage_spec([f for f in header["spec"] if f[0].startswith(_ROUTING)], me.layers)
    mine = {k: v for k, v in own.items() if not k.startswith(_ROUTING)} if own is not None else None
    tensors = _deliver(spec, mine, lambda dst: part_tensors(prepared.full, None, plan[dst], cp),
                       [c.mp == 0 for c in coords], groups.pgs.mp)
    if routing_spec:
        mine = {k: v for k, v in own.items() if k.startswith(_ROUTING)} if own is not None else None
        tensors = tensors | _deliver(routing_spec, mine, lambda dst: routing_tensors(prepared.routing, plan[dst], cp),
                                     [c.tp == 0 for c in coords], groups.tp_group)
    return _local(tensors, rows, cp, header["metrics"], part_bytes(spec) + part_bytes(routing_spec))
