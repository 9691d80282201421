"""Run a function on N gloo ranks in spawned worker processes and collect what each rank returns.

    results = run_ranks(fn, world_size=2, timeout=180, some_kwarg=1)   # -> [rank0_result, rank1_result]
    results = run_ranks(fn, world_size=1, fresh=True)                  # a new interpreter for this call

`fn(rank, world_size, **kwargs)` must be a top-level (importable) function. Each rank runs in a
worker process (spawned: a fresh interpreter, `OMP_NUM_THREADS=1`, torch threads 1) that joins an
initialised gloo process group for the call and nothing else: applying the CPU platform layer or
megatron parallel state is the function's job, so tests say explicitly what they set up. A hung
rank is killed after `timeout` seconds and the test fails instead of hanging CI; an exception on
any rank is re-raised in the parent with that rank's traceback.

Workers are kept for the pytest session, one pool per world size: starting an interpreter and
importing torch, megatron-core and transformers costs 4-8 s on 2 cores, which the distributed
tier used to pay on every call. Between calls a worker tears down what a call sets up through the
APIs the tests use (the process group, megatron's parallel state and its RouterReplay list) and
puts back what it had when it started (environment variables, torch's default RNG state, default
dtype, thread count), so a call sees what a new process would (a new interpreter seeds torch's
generator at random: tests seed what they draw). A pool whose call failed
or timed out is killed (a rank may still sit in a collective) and the next call starts a new
one. The teardown also frees what a call leaves that would otherwise live as long as the worker:
megatron's groups (`destroy_parallel`) and any DDP model (`release_model`), whose gloo groups
hold threads and sockets. A worker whose threads or open files still grow past a bound
(SPARE_THREADS, SPARE_FDS) is replaced before the next call, so no leak piles up for a session. `fresh=True` gives a call interpreters of its own, for runs whose point is a new process
(the golden numbers) or that change process-wide state the reset above does not cover.

Ports, without races against tests running in parallel: the rendezvous store of each call is a
TCPStore the parent opens on port 0 (the kernel picks a free port and the store keeps it
listening from then on) and the ranks join it as clients, so no port is ever chosen, released and
bound again later; gloo's own connections use ports the kernel assigns. (MASTER_ADDR /
MASTER_PORT in the ranks name that store, for code that reads them.) `free_port()` is for
in-process single-rank set-ups that must name a port in MASTER_PORT: it keeps the port reserved
for the life of the process, see there.
"""
from __future__ import annotations

import atexit
import contextlib
import io
import multiprocessing as mp
import os
import queue as queue_mod
import select
import socket
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

HOST = "127.0.0.1"
SPARE_THREADS = 32  # a worker is replaced once a teardown leaves it this many threads above its first call's
SPARE_FDS = 64      # ... or this many open files
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


# ----------------------------------------------------------------------------- the rank side


def _run_call(fn: Callable, rank: int, world_size: int, port: int, timeout: float, results, kwargs: dict,
              spent: Callable[[], bool] = lambda: False) -> None:
    """One call on one rank: join the call's store, init gloo, run fn, tear down, ship the result.

    The result goes out after the teardown, with `spent()`: whether this worker should be
    replaced (see _worker), so the parent knows before it submits the next call."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR=HOST, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    store = None
    try:
        # join the parent's store as a client: nothing here binds a port chosen in advance
        store = dist.TCPStore(HOST, port, world_size, is_master=False, timeout=timedelta(seconds=timeout))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        out = fn(rank, world_size, **kwargs)
        # serialise here: a tensor sent through the queue as-is lives in this process's shared
        # memory, which is gone once a fresh rank exits
        buf = io.BytesIO()
        torch.save(out, buf)
        status, payload = "ok", buf.getvalue()
    except BaseException:  # noqa: BLE001 - ship every failure to the parent
        status, payload = "error", traceback.format_exc()
    del store
    try:
        _teardown()
        replace = spent()
    except BaseException:  # noqa: BLE001 - a worker that cannot tear down is not reused
        replace = True
    results.put((rank, status, payload, replace))


def _teardown() -> None:
    """Undo what a call may have set up process-wide through the APIs the tests use, and free the
    models it left behind: a megatron DDP is never collected on its own (release_model says why)
    and would keep its process groups, with their gloo threads and sockets, for the worker's life."""
    import gc

    import torch.distributed as dist

    try:
        from megatron.core.transformer.moe.router_replay import RouterReplay

        from megatron_rl.parallel import destroy_parallel

        destroy_parallel()
        RouterReplay.global_router_replay_instances.clear()
    except ImportError:
        pass
    if dist.is_initialized():
        dist.destroy_process_group()
    if "megatron.core.distributed" in sys.modules:
        from megatron.core.distributed import DistributedDataParallel

        from megatron_rl.trainer.stack import release_model

        for model in [o for o in gc.get_objects() if isinstance(o, DistributedDataParallel)]:
            release_model(model)
        model = None  # the loop variable would keep the last one alive through the collection
    gc.collect()


def _threads_and_fds() -> tuple[int, int]:
    import psutil

    me = psutil.Process()
    return me.num_threads(), me.num_fds()


def _rank_setup() -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning)  # megatron's "no Apex/TE" notices
    torch.set_num_threads(1)


def _next_task(tasks, parent: int):
    """The next call from `tasks`, or None once the parent is gone (the pytest process was killed:
    a worker is not daemonic, see _Pool, so it must notice on its own)."""
    while True:
        try:
            return tasks.get(timeout=2.0)
        except queue_mod.Empty:
            if os.getppid() != parent:
                return None


def _worker(rank: int, world_size: int, tasks, results, parent: int) -> None:
    """A pooled rank: run calls from `tasks` until it gets None, each from a fresh-process state.

    A worker whose threads or open files have grown past its first call's by SPARE_THREADS /
    SPARE_FDS after a teardown asks to be replaced: whatever a call leaks that the teardown does
    not free stays bounded per worker instead of piling up for the whole session."""
    _rank_setup()
    env, rng, dtype = dict(os.environ), torch.get_rng_state(), torch.get_default_dtype()
    first: list[tuple[int, int]] = []

    def spent() -> bool:
        now = _threads_and_fds()
        if not first:
            first.append(now)
        return now[0] > first[0][0] + SPARE_THREADS or now[1] > first[0][1] + SPARE_FDS

    while (task := _next_task(tasks, parent)) is not None:
        fn, port, timeout, kwargs = task
        os.environ.clear()
        os.environ.update(env)
        torch.set_rng_state(rng)
        torch.set_default_dtype(dtype)
        torch.set_num_threads(1)
        _run_call(fn, rank, world_size, port, timeout, results, kwargs, spent)


def _fresh(fn: Callable, rank: int, world_size: int, port: int, timeout: float, results, kwargs: dict) -> None:
    _rank_setup()
    _run_call(fn, rank, world_size, port, timeout, results, kwargs)


# ----------------------------------------------------------------------------- the parent side


def _kill_tree(p) -> None:
    """SIGKILL a rank and every process it started (megatron's checkpoint writer, a Manager), which
    would otherwise outlive it. The rank is stopped first, so it starts none while its tree is read."""
    import psutil

    try:
        rank = psutil.Process(p.pid)
        rank.suspend()
        tree = rank.children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    exits = []  # a pidfd turns readable when its process has exited (a zombie too): SIGKILL lands asynchronously
    for c in tree:
        with contextlib.suppress(ProcessLookupError):
            exits.append(os.pidfd_open(c.pid))
    p.kill()
    p.join()
    for c in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            c.kill()
    for fd in exits:  # the tree is gone when this returns; the 60 s only guard a hang
        select.select([fd], [], [], 60)
        os.close(fd)


class _Pool:
    """`world_size` spawned workers, each with its own task queue, sharing one result queue."""

    def __init__(self, world_size: int):
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        # not daemonic: a rank saving a checkpoint forks megatron's writer processes, which a
        # daemonic process may not have; the atexit hook below ends the workers, and a worker whose
        # parent died ends itself (_next_task)
        self.procs = [ctx.Process(target=_worker, args=(r, world_size, self.tasks[r], self.results, os.getpid()),
                                  daemon=False) for r in range(world_size)]
        for p in self.procs:
            p.start()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def submit(self, fn: Callable, port: int, timeout: float, kwargs: dict) -> None:
        for q in self.tasks:
            q.put((fn, port, timeout, kwargs))

    def close(self, kill: bool) -> None:
        if not kill:
            for q in self.tasks:
                q.put(None)
        for p in self.procs:
            p.join(timeout=0 if kill else 10)
            if p.is_alive():
                _kill_tree(p)


_POOLS: dict[int, _Pool] = {}


@atexit.register
def _close_pools() -> None:
    while _POOLS:
        _POOLS.popitem()[1].close(kill=False)


def _collect(results, world_size: int, timeout: float, procs) -> tuple[dict[int, Any], list[str], bool]:
    """Wait for every rank's result; stop at the first error (the other ranks are likely blocked).
    The flag: a rank asked to be replaced (_worker)."""
    out: dict[int, Any] = {}
    errors: list[str] = []
    replace = False
    try:
        for _ in range(world_size):
            rank, status, payload, spent = results.get(timeout=timeout)
            replace |= spent
            if status != "ok":
                errors.append(f"--- rank {rank} ---\n{payload}")
                break
            out[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    except queue_mod.Empty:
        dead = [p.exitcode for p in procs if not p.is_alive()]
        errors.append(f"timed out after {timeout}s waiting for ranks" + (f" (exit codes {dead})" if dead else ""))
    except Exception as e:  # noqa: BLE001 - e.g. a rank that could not start
        errors.append(f"waiting for ranks failed: {type(e).__name__}: {e}")
    return out, errors, replace


def run_ranks(fn: Callable, world_size: int = 2, timeout: float = 240.0, fresh: bool = False, **kwargs: Any) -> list:
    import torch.distributed as dist

    # the rendezvous store, listening from here on a port the kernel picked (see the docstring)
    store = dist.TCPStore(HOST, 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    if fresh:
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        procs = [ctx.Process(target=_fresh, args=(fn, r, world_size, store.port, timeout, results, kwargs))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        out, errors, _ = _collect(results, world_size, timeout, procs)
        for p in procs:
            p.join(timeout=5 if errors else 30)
            if p.is_alive():
                _kill_tree(p)
    else:
        pool = _POOLS.get(world_size)
        if pool is None or not pool.alive():
            if pool is not None:
                pool.close(kill=True)
            pool = _POOLS[world_size] = _Pool(world_size)
        pool.submit(fn, store.port, timeout, kwargs)
        out, errors, replace = _collect(pool.results, world_size, timeout, pool.procs)
        if errors:  # a rank may still sit in a collective or hold half a call's state
            _POOLS.pop(world_size).close(kill=True)
        elif replace:
            _POOLS.pop(world_size).close(kill=False)
    del store  # closes the rendezvous port once every rank has gone
    if errors:
        raise RuntimeError("distributed test failed:\n" + "\n".join(errors))
    return [out[r] for r in range(world_size)]
