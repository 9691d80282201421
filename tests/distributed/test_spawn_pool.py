"""tests/spawn.py's worker pool: a call sees what a fresh process would, a failed or hung call costs
the pool (never the next test), and a rank's own children go with it."""
import os
import time

import pytest
import torch

from tests import spawn
from tests.spawn import run_ranks


def _leave_traces(rank, world):
    """What a careless call might leave behind in its process, and what it saw on arrival."""
    import torch.distributed as dist

    seen = {"env": os.environ.get("SPAWN_POOL_TEST"), "draw": torch.rand(3).tolist(),
            "dtype": str(torch.get_default_dtype()), "pid": os.getpid()}
    os.environ["SPAWN_POOL_TEST"] = "left over"
    torch.manual_seed(99)
    torch.set_default_dtype(torch.float64)
    t = torch.ones(1)
    dist.all_reduce(t)
    return seen, float(t)


def _fail_with_a_child(rank, world, pid_file):
    import subprocess
    import sys

    if rank == 1:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        with open(pid_file, "w") as f:
            f.write(str(child.pid))
        raise ValueError("rank 1 failed on purpose")
    return rank


def _hang(rank, world):
    time.sleep(3600)


def test_each_call_starts_from_a_fresh_process_state():
    first, second = (run_ranks(_leave_traces, world_size=2) for _ in range(2))
    fresh = run_ranks(_leave_traces, world_size=2, fresh=True)
    for a, b, f in zip(first, second, fresh):
        assert a[0]["pid"] == b[0]["pid"] != f[0]["pid"]  # the pool's workers served both calls
        for seen in (a[0], b[0], f[0]):
            assert seen["env"] is None and seen["dtype"] == "torch.float32"
        # torch's generator as the worker started with it (a new interpreter seeds it at random, so a
        # test seeds what it draws; a call never sees the previous call's manual_seed)
        assert a[0]["draw"] == b[0]["draw"]
        assert a[1] == b[1] == 2.0


def test_a_failed_call_raises_with_the_ranks_traceback_and_the_next_call_gets_a_new_pool(tmp_path):
    """A rank that started a process of its own (as megatron's checkpoint writer does) and failed:
    the pool goes, with that process."""
    import psutil

    run_ranks(_leave_traces, world_size=2)
    before = {p.pid for p in spawn._POOLS[2].procs}
    with pytest.raises(RuntimeError, match="rank 1 failed on purpose"):
        run_ranks(_fail_with_a_child, world_size=2, pid_file=str(tmp_path / "child"))
    assert 2 not in spawn._POOLS  # a rank may still sit in a collective: the pool is gone
    child = int((tmp_path / "child").read_text())
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
    assert run_ranks(_leave_traces, world_size=2)[0][1] == 2.0
    assert not before & {p.pid for p in spawn._POOLS[2].procs}


def test_a_hung_call_times_out_and_the_next_call_gets_a_new_pool():
    with pytest.raises(RuntimeError, match="timed out after 3"):
        run_ranks(_hang, world_size=1, timeout=3)
    assert 1 not in spawn._POOLS
    assert run_ranks(_leave_traces, world_size=1)[0][1] == 1.0


def _train_a_tp2_model(rank, world):
    """What a distributed test typically leaves behind: megatron's groups (TP=2) and a DDP-wrapped
    MoE after a forward and backward pass. Returns the worker's threads and open files on arrival."""
    import psutil

    from megatron_rl.model import BuildOptions, build_gpt_model, causal_mask
    from megatron_rl.model.presets import preset_arch
    from megatron_rl.trainer.stack import OptimSettings, wrap_model
    from tests.mcore_setup import setup_parallel

    me = psutil.Process()
    arrival = (me.num_threads(), me.num_fds(), os.getpid())
    groups = setup_parallel(tensor_model_parallel_size=2)
    arch = preset_arch("qwen3_moe", "tiny")
    model = wrap_model(build_gpt_model(arch, groups, BuildOptions(dtype="fp32")), OptimSettings())
    ids = torch.randint(0, arch.vocab_size, (2, 8), generator=torch.Generator().manual_seed(rank))
    model(ids, torch.arange(8).expand(2, -1), causal_mask(8), labels=ids).float().sum().backward()
    return arrival


def test_a_pooled_worker_keeps_its_threads_and_files_flat_over_many_calls():
    """Each call builds process groups and a DDP model: a worker must not keep them (gloo holds two
    threads and sockets per group and peer, megatron's DDP is never collected on its own). The
    counts are taken as each call arrives, so they show what earlier calls left. Eleven calls: a leak
    of even one thread or one file per call spreads the ten counts after the first by 9, past the
    bounds (the leak this guards against was about 46 threads per call)."""
    arrivals = [run_ranks(_train_a_tp2_model, world_size=2) for _ in range(11)]
    for rank in range(2):
        threads, fds, pids = zip(*(a[rank] for a in arrivals[1:]), strict=True)
        assert len(set(pids)) == 1, "the worker was replaced: the teardown left something behind"
        assert max(threads) - min(threads) <= 2, threads
        assert max(fds) - min(fds) <= 4, fds


def test_a_worker_that_grows_anyway_is_replaced():
    """What the teardown cannot free stays bounded: past SPARE_THREADS the worker asks to go."""
    run_ranks(_leave_threads, world_size=1, count=0)
    first = spawn._POOLS[1].procs[0].pid
    run_ranks(_leave_threads, world_size=1, count=spawn.SPARE_THREADS + 1)
    assert 1 not in spawn._POOLS  # replaced before the next call
    run_ranks(_leave_threads, world_size=1, count=0)
    assert spawn._POOLS[1].procs[0].pid != first


_KEPT: list = []


def _leave_threads(rank, world, count):
    """Threads that outlive the call (a module-level list keeps their stop events)."""
    import threading

    for _ in range(count):
        stop = threading.Event()
        threading.Thread(target=stop.wait, daemon=True).start()
        _KEPT.append(stop)
    return count
