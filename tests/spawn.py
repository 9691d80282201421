"""Run a function on N gloo ranks in fresh spawned processes and collect what each rank returns.

    results = run_ranks(fn, world_size=2, timeout=180, some_kwarg=1)   # -> [rank0_result, rank1_result]

`fn(rank, world_size, **kwargs)` must be a top-level (importable) function. Each child gets a
fresh interpreter (spawn), `OMP_NUM_THREADS=1`, an initialised gloo process group on a free
loopback port, and nothing else: applying the CPU platform layer or megatron parallel state
is the function's job, so tests say explicitly what they set up. A hung child is killed after
`timeout` seconds and the test fails instead of hanging CI; an exception on any rank is
re-raised in the parent with that rank's traceback.
"""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn: Callable, rank: int, world_size: int, port: int, queue, kwargs: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=UserWarning)  # megatron's "no Apex/TE" notices
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        out = fn(rank, world_size, **kwargs)
        # serialise here: a tensor sent through the queue as-is lives in this process's shared
        # memory, which is gone once the child exits
        buf = io.BytesIO()
        torch.save(out, buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - ship every failure to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                from megatron.core import parallel_state

                parallel_state.destroy_model_parallel()
            except ImportError:
                pass
            dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int = 2, timeout: float = 240.0, **kwargs: Any) -> list:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, queue, kwargs), daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"--- rank {rank} ---\n{payload}")
                break  # the other ranks are likely blocked in a collective
    except Exception as e:  # queue.Empty on timeout
        errors.append(f"timed out after {timeout}s waiting for ranks ({type(e).__name__})")
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 30)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("distributed test failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
