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
on their pipes).

megatron-core 0.19 writes with threads (`write_preloaded_data_multithread`): no process can die,
but a writer's error loses its cause there (a full disk reads "An error is caught while starting
worker 0, error: <class 'RuntimeError'>", no file, no reason). `write_named` runs the same writers
in threads and fails the save with the file and the writer's own error, as on 0.16. Cost, both
releases: one writer per output file, as megatron's; nothing is copied.
"""
from __future__ import annotations

import contextlib
import gc
import multiprocessing
import signal
import threading
from functools import partial
from multiprocessing.connection import wait


class WriterFailed(RuntimeError):
    """A checkpoint writer process failed (its error, naming the file) or died (how, naming the file)."""


def watched_save_strategy():
    """megatron's default save strategy (torch_dist, version 1), its writers watched: megatron's
    forked writers (0.16) replaced by `write_watched`, its writer threads (0.19) by `write_named`."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    ours = {getattr(FileSystemWriterAsync, "write_preloaded_data_multiproc", None): write_watched,
            getattr(FileSystemWriterAsync, "write_preloaded_data_multithread", None): write_named}
    ours.pop(None, None)

    class WatchedSave(TorchDistSaveShardedStrategy):
        def async_save(self, *args, **kwargs):
            request = super().async_save(*args, **kwargs)
            fn = request.async_fn
            if fn is None:
                return request  # nothing to write on this rank
            writer = ours.get(getattr(fn, "func", None))
            if writer is None:  # loud: every checkpoint test fails on it
                raise RuntimeError(f"megatron-core's save request runs {fn!r}, not the writers "
                                   f"megatron_rl/platform/checkpoint_writer.py watches: update it for this release")
            return request._replace(async_fn=partial(writer, *fn.args, **fn.keywords))

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
    _report(results_queue, failure if failure is not None else results)


class _Kept:
    """A writer thread's `results_queue`: keeps its one result, (index, write results or exception)."""

    def __init__(self):
        self.item = None

    def put(self, item) -> None:
        self.item = item


def write_named(transform_list, use_msc: bool, rank: int, write_buckets, results_queue) -> None:
    """megatron's `write_preloaded_data_multithread` (same arguments, same result on `results_queue`),
    a failed writer named: `WriterFailed("writing <file>: <type>: <message>")`. One thread per
    output file through megatron's `write_preloaded_data`; every thread is joined before the result
    is reported, so none still writes once the save has failed."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    kwargs = {"use_msc": True} if use_msc else {}
    kept = [_Kept() for _ in write_buckets]
    threads = [threading.Thread(target=FileSystemWriterAsync.write_preloaded_data, name=f"checkpoint-writer-{i}",
                                args=(transform_list, i, bucket, kept[i], _NoCount(), True), kwargs=kwargs)
               for i, bucket in enumerate(write_buckets)]
    with _gc_off():
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    results: dict[int, list] = {}
    failure: BaseException | None = None
    for index, (bucket, k) in enumerate(zip(write_buckets, kept)):
        # megatron's writer catches its own errors; anything past that ends the thread with no result
        result = k.item[1] if k.item is not None else RuntimeError("the writer thread ended without a result")
        if isinstance(result, BaseException):
            failure = failure or WriterFailed(f"writing {bucket[0]}: {type(result).__name__}: {result}")
        else:
            results[index] = result
    _report(results_queue, failure if failure is not None else results)


def _report(results_queue, item) -> None:
    try:
        results_queue.put(item)
    except (OSError, EOFError) as e:  # megatron's results queue lives in a helper process (platform/reaping.py)
        raise WriterFailed(f"the checkpoint writer's results queue is gone: its helper process died "
                           f"({type(e).__name__}: {e})") from e
