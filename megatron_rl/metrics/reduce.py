"""The one metrics convention: reducible values, one reducer, one finishing function.

Everything the RL step reduces over micro-batches and ranks (loss parts, mismatch diagnostics,
routing agreement, per-step loss statistics) is a dict of 0-dim tensors whose keys end in how
they reduce:

    <name>/sum    summed          <name>/min    minimum          <name>/max    maximum

`finish` turns reduced values into the logged floats, by the shape of the key:

    <name>/num/sum and <name>/den/sum              -> <name> = num / den           (0 when den = 0)
    <name>/ess_x/sum, <name>/ess_x2/sum, <name>/ess_n/sum
                                                   -> <name> = (Σx)² / (n · Σx²)   (1 when n = 0)
    any other <name>/sum | /min | /max             -> <name>   (a /min or /max still at ±inf, i.e.
                                                       no rank had a value, is reported as 0)

so a ratio is always finished after the reduction (never a mean of per-rank means).

    acc = accumulate(acc, micro_batch_values)          # over micro-batches, op by op
    reduced = reduce_metrics(acc, group)                # one collective per op, on the group's device
    logged = finish(reduced)                            # host floats
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import Tensor

OPS = ("sum", "min", "max")
_REDUCE = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
_COMBINE = {"sum": torch.add, "min": torch.minimum, "max": torch.maximum}
_ESS_PARTS = ("ess_x", "ess_x2", "ess_n")


def op_of(key: str) -> str:
    """'sum' | 'min' | 'max' from the key's last component (ValueError for any other key)."""
    op = key.rsplit("/", 1)[-1]
    if op not in OPS:
        raise ValueError(f"metric key {key!r} does not end in /sum, /min or /max")
    return op


def ratio(name: str, num: Tensor, den: Tensor) -> dict[str, Tensor]:
    """The two entries of a ratio metric `name` = Σ num / Σ den."""
    return {f"{name}/num/sum": num, f"{name}/den/sum": den}


def ess(name: str, x_sum: Tensor, x2_sum: Tensor, n: Tensor) -> dict[str, Tensor]:
    """The three entries of an effective-sample-size metric `name` = (Σx)² / (n Σx²)."""
    return {f"{name}/ess_x/sum": x_sum, f"{name}/ess_x2/sum": x2_sum, f"{name}/ess_n/sum": n}


def accumulate(acc: Mapping[str, Tensor] | None, new: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Merge `new` into `acc` key by key with each key's op (keys of either are kept)."""
    out = dict(acc or {})
    for k, v in new.items():
        v = v.detach().double()
        out[k] = _COMBINE[op_of(k)](out[k], v) if k in out else v
    return out


def group_device(group=None) -> torch.device:
    """Where a collective of `group` runs: the current CUDA device for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reduce_metrics(values: Mapping[str, Tensor], group=None, pp_group=None, pp_src: int | None = None,
                   ) -> dict[str, Tensor]:
    """All-reduce every key with its op over `group` (default: the world): the values are stacked
    on the group's device, one collective per op present. Every rank of `group` must hold the
    same keys. With `pp_group` and `pp_src` (the global rank of the last pipeline stage), that
    stage's result is then handed to every stage (stages before it hold no loss values).
    Returns float64 0-dim tensors on the group's device."""
    device = group_device(group)
    out: dict[str, Tensor] = {}
    keys = sorted(values)
    for op in OPS:
        ks = [k for k in keys if op_of(k) == op]
        if not ks:
            continue
        flat = torch.stack([values[k].detach().to(device=device, dtype=torch.float64) for k in ks])
        if dist.get_world_size(group) > 1:
            dist.all_reduce(flat, op=_REDUCE[op], group=group)
        out.update(zip(ks, flat.unbind(), strict=True))
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        holder = [{k: float(v) for k, v in out.items()} if dist.get_rank() == pp_src else None]
        dist.broadcast_object_list(holder, src=pp_src, group=pp_group)
        out = {k: torch.tensor(v, dtype=torch.float64, device=device) for k, v in holder[0].items()}
    return out


def finish(values: Mapping[str, Tensor | float]) -> dict[str, float]:
    """Reduced values -> logged floats (see the module docstring). Reads values to the host."""
    s = {k: float(v) for k, v in values.items()}
    out: dict[str, float] = {}
    for key, v in s.items():
        body = key.rsplit("/", 1)[0]  # without the op
        name, _, part = body.rpartition("/")
        if part == "num" and f"{name}/den/sum" in s:
            den = s[f"{name}/den/sum"]
            out[name] = v / den if den > 0 else 0.0
        elif part == "den" and f"{name}/num/sum" in s:
            continue
        elif part == "ess_x":
            x2, n = s[f"{name}/ess_x2/sum"], s[f"{name}/ess_n/sum"]
            out[name] = (v * v / (n * x2) if x2 > 0 else 0.0) if n > 0 else 1.0
        elif part in _ESS_PARTS:
            continue
        elif key.endswith(("/min", "/max")) and math.isinf(v):  # the reduction's identity: nothing to report
            out[body] = 0.0
        else:
            out[body] = v
    return out
