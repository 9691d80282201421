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
