"""megatron-core's checkpoint save, with its writer processes watched: a writer that dies fails the save.

megatron-core 0.16's torch_dist save strategy (the default of every `dist_checkpointing.save`)
forks one writer process per output file (`thread_count`, 2) from the saving rank, then waits for
them on a `JoinableQueue.join()`. A writer that never reaches its `task_done()` (SIGKILLed by
the kernel's out-of-memory killer, or by anyone) left the trainer waiting forever; SIGTERM sets
the stop flag, which is read between steps, so it could not end the wait either.

`watched_save_strategy()` is megatron's strategy with the same writers writing the same files
through the same function (`FileSystemWriterAsync.write_preloaded_data`); each reports on its own
pipe, and the saving process waits on the pipes. A pipe that closes without a result is a writer
that died: its pid, its exit (the signal), and the file it was writing become the save's error.
That error, like a writer's exception, goes back through megatron's results queue and its
collective finalize, so every rank fails the save alike (`CheckpointException`) and none waits
for the others at a barrier. That queue lives in megatron's helper process (platform/reaping.py):
one that died fails the save naming it. Waiting costs nothing while the writers work (one `wait`
on their pipes). Releases whose writers are threads (megatron-core 0.19 writes with
`write_preloaded_data_multithread`) have no process to die: they save with megatron's own strategy.
"""
from __future__ import annotations

import contextlib
import gc
import multiprocessing
import signal
from functools import partial
from multiprocessing.connection import wait


class WriterFailed(RuntimeError):
    """A checkpoint writer process failed (its error, naming the file) or died (how, naming the file)."""


def watched_save_strategy():
    """megatron's default save strategy (torch_dist, version 1), its writer processes watched;
    None (megatron's own default) on a release whose writers are not processes."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    forked_writers = getattr(FileSystemWriterAsync, "write_preloaded_data_multiproc", None)
    if forked_writers is None:
        return None

    class WatchedSave(TorchDistSaveShardedStrategy):
        def async_save(self, *args, **kwargs):
            request = super().async_save(*args, **kwargs)
            fn = request.async_fn
            if fn is None:
                return request  # nothing to write on this rank
            if getattr(fn, "func", None) is not forked_writers:  # loud: every checkpoint test fails on it
                raise RuntimeError(f"megatron-core's save request runs {fn!r}, not the forked writers "
                                   f"megatron_rl/platform/checkpoint_writer.py watches: update it for this release")
            return request._replace(async_fn=partial(write_watched, *fn.args, **fn.keywords))

    return WatchedSave("torch_dist", 1)


@contextlib.contextmanager
def _gc_off():
    """megatron's writers run with the garbage collector off (a collection in a forked child can
    free CUDA tensors the parent owns); the same here."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class _Pipe:
    """The writer's `results_queue`: its one result, sent on its pipe. An exception travels as its
    type and message (whatever it holds, a RuntimeError pickles)."""

    def __init__(self, conn):
        self.conn = conn

    def put(self, item) -> None:
        index, result = item
        if isinstance(result, BaseException):
            result = RuntimeError(f"{type(result).__name__}: {result}")
        self.conn.send((index, result))


class _NoCount:
    """The writer's `count_queue`: megatron's join() on it is what hung; the pipe replaces it."""

    def get(self) -> None:
        pass

    def task_done(self) -> None:
        pass


def _write_one(write, transform_list, use_msc: bool, index: int, bucket, conn) -> None:
    kwargs = {"use_msc": True} if use_msc else {}
    write(transform_list, index, bucket, _Pipe(conn), _NoCount(), True, **kwargs)
    conn.close()


def how_it_ended(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        name = signal.Signals(-exitcode).name
        why = " (the kernel's out-of-memory killer sends it: see dmesg)" if name == "SIGKILL" else ""
        return f"was killed by {name}{why}"
    return f"exited with status {exitcode} without reporting"


def write_watched(transform_list, use_msc: bool, rank: int, write_buckets, results_queue) -> None:
    """megatron's `write_preloaded_data_multiproc` (same arguments, same result on `results_queue`:
    {writer index: its write results}, or an exception), with a dead writer reported instead of
    waited for. Every writer is waited for, so none still writes once the save has failed."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    ctx = multiprocessing.get_context("fork")  # as megatron's: the tensors are shared, not copied
    results: dict[int, list] = {}
    failure: BaseException | None = None
    with _gc_off():
        waiting = {}
        for index, bucket in enumerate(write_buckets):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_write_one, name=f"checkpoint-writer-{index}",
                               args=(FileSystemWriterAsync.write_preloaded_data, transform_list, use_msc, index,
                                     bucket, writer))
            proc.start()
            writer.close()  # the writer's copy is its own: EOF here once it has ended
            waiting[reader] = (index, proc, bucket[0])
        while waiting:
            for reader in wait(list(waiting)):
                index, proc, file = waiting.pop(reader)
                try:
                    _, result = reader.recv()
                except (EOFError, OSError):  # ended before (or while) sending its result
                    proc.join()
                    result = WriterFailed(f"the checkpoint writer process {proc.pid} writing {file} "
                                        f"{how_it_ended(proc.exitcode)}")
                reader.close()
                if isinstance(result, BaseException):
                    if failure is None:
                        failure = result if isinstance(result, WriterFailed) else WriterFailed(f"writing {file}: {result}")
                else:
                    results[index] = result
                    proc.join()
    try:
        results_queue.put(failure if failure is not None else results)
    except (OSError, EOFError) as e:  # megatron's results queue lives in a helper process (platform/reaping.py)
        raise WriterFailed(f"the checkpoint writer's results queue is gone: its helper process died "
                           f"({type(e).__name__}: {e})") from e
