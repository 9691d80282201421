"""Run a function on N gloo ranks in fresh spawned processes and collect what each rank returns.

    results = run_ranks(fn, world_size=2, timeout=180, some_kwarg=1)   # -> [rank0_result, rank1_result]

`fn(rank, world_size, **kwargs)` must be a top-level (importable) function. Each child gets a
fresh interpreter (spawn), `OMP_NUM_THREADS=1`, an initialised gloo process group, and nothing
else: applying the CPU platform layer or megatron parallel state is the function's job, so
tests say explicitly what they set up. A hung child is killed after `timeout` seconds and the
test fails instead of hanging CI; an exception on any rank is re-raised in the parent with that
rank's traceback.

Ports, without races against tests running in parallel: the rendezvous store is a TCPStore the
parent opens on port 0 (the kernel picks a free port and the store keeps it listening from then
on) and the children join it as clients, so no port is ever chosen, released and bound again
later; gloo's own connections use ports the kernel assigns. (MASTER_ADDR / MASTER_PORT in the
children name that store, for code that reads them.) `free_port()` is for in-process single-rank
set-ups that must name a port in MASTER_PORT: it keeps the port reserved for the life of the
process, see there.
"""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue as queue_mod
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

HOST = "127.0.0.1"
_RESERVED: list[socket.socket] = []  # free_port()'s sockets: open until this process exits


def free_port() -> int:
    """A loopback port for MASTER_PORT (a single-rank `init_process_group` in this process).

    The port is bound here with SO_REUSEADDR and stays bound, not listening, until this process
    exits: the kernel then gives it to no other process that asks for a free port (bind to port
    0) or opens a connection, so tests running in parallel cannot take it between this call and
    its use, while torch's TCPStore, which binds with SO_REUSEADDR, can still listen on it (in
    this process or a child). For several ranks use run_ranks, which needs no port at all. (For
    one rank, MASTER_PORT=0 works too: the store then listens on a port the kernel picks.)
    """
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((HOST, 0))
    except BaseException:
        s.close()
        raise
    _RESERVED.append(s)
    return s.getsockname()[1]


def _child(fn: Callable, rank: int, world_size: int, port: int, timeout: float, queue, kwargs: dict) -> None:
    os.environ.update(MASTER_ADDR=HOST, MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=UserWarning)  # megatron's "no Apex/TE" notices
    torch.set_num_threads(1)
    try:
        # join the parent's store as a client: nothing here binds a port chosen in advance
        store = dist.TCPStore(HOST, port, world_size, is_master=False, timeout=timedelta(seconds=timeout))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
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
    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    # the rendezvous store, listening from here on a port the kernel picked (see the docstring)
    store = dist.TCPStore(HOST, 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, store.port, timeout, queue, kwargs), daemon=False)
             for r in range(world_size)]
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for p in procs:
            p.start()
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"--- rank {rank} ---\n{payload}")
                break  # the other ranks are likely blocked in a collective
    except queue_mod.Empty:
        errors.append(f"timed out after {timeout}s waiting for ranks")
    except Exception as e:  # noqa: BLE001 - e.g. a child that could not start
        errors.append(f"waiting for ranks failed: {type(e).__name__}: {e}")
    finally:
        for p in procs:
            if p.pid is None:  # never started
                continue
            p.join(timeout=5 if errors else 30)
            if p.is_alive():
                p.kill()
                p.join()
        del store  # closes the rendezvous port once every child has gone
    if errors:
        raise RuntimeError("distributed test failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
