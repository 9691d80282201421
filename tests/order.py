"""The order pytest-xdist hands test files to its workers: the longest first.

`make test` runs two workers with `--dist loadfile` (a file's tests stay on one worker) and
`--no-loadscope-reorder`, so files are handed out in collection order; xdist's default would order
them by number of tests, which puts the one-test whole-run files (the short demo, 264 s) last,
where one worker runs them alone while the other has finished. With the long files first, the many
short ones fill in behind them and the two workers end together (greedy longest-first).

LONG_FILES: seconds per file on the fresh clone's CI run (2-core Xeon, 2026-11-27,
`make ci-time`), the files over ~15 s. A file not listed keeps its collection place after them; an
outdated number only makes the schedule less even, never a test wrong.
"""
from __future__ import annotations

LONG_FILES = {
    "e2e/test_repro_quick.py": 644,
    "vllm/test_trainer_loop.py": 309,
    "e2e/test_demo_short.py": 264,
    "e2e/test_drills.py": 257,
    "e2e/test_gpu_lane_on_cpu.py": 203,
    "vllm/test_restart.py": 147,
    "e2e/test_drills_round3.py": 132,
    "vllm/test_memory_sync.py": 107,
    "vllm/test_memory_sync_parallel.py": 106,
    "vllm/test_families.py": 88,
    "distributed/test_convert_tool.py": 76,
    "distributed/test_workarounds.py": 63,
    "vllm/test_reaping.py": 60,
    "e2e/test_golden.py": 56,
    "vllm/test_server.py": 50,
    "distributed/test_schedules.py": 42,
    "e2e/test_ratio_reference.py": 38,
    "distributed/test_precision.py": 32,
    "unit/platform/test_gpu_logprob_compiles.py": 30,
    "e2e/test_drills_inputs.py": 27,
    "tools/test_gpu_check_script.py": 26,
    "distributed/test_rl_loop.py": 24,
    "distributed/test_cp_trainer_path.py": 22,
    "distributed/test_replay_in_loop.py": 19,
    "tools/test_gpu_benchmark.py": 19,
    "distributed/test_spawn_pool.py": 18,
    "distributed/test_compiled_math_inductor.py": 18,
    "vllm/test_client_faults.py": 17,
    "distributed/test_recipes_in_loop.py": 16,
    "distributed/test_model_parallel.py": 15,
}


def longest_first(paths: list[str]) -> list[int]:
    """Indices of `paths` (each a test's file, relative to tests/, "/"-separated) in run order:
    LONG_FILES by descending seconds, then the others; ties keep their order (stable), so a file's
    tests stay together and in their own order."""
    return sorted(range(len(paths)), key=lambda i: -LONG_FILES.get(paths[i], 0))
