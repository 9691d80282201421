"""The order pytest-xdist hands test files to its workers: the longest first.

`make test` runs two workers with `--dist loadfile` (a file's tests stay on one worker) and
`--no-loadscope-reorder`, so files are handed out in collection order; xdist's default would order
them by number of tests, which puts the one-test whole-run files (the short demo, 264 s) last,
where one worker runs them alone while the other has finished. With the long files first, the many
short ones fill in behind them and the two workers end together (greedy longest-first).

LONG_FILES: seconds per file on a fresh clone's CI run (2-core Xeon, 2026-11-27 at 98b3a3c, the
machine shared with other jobs, so the numbers are high but in proportion; `make ci-time`), the
files over 15 s. A file not listed keeps its collection place after them; an
outdated number only makes the schedule less even, never a test wrong.
"""
from __future__ import annotations

LONG_FILES = {
    "e2e/test_drills.py": 554,
    "e2e/test_repro_quick.py": 550,
    "e2e/test_demo_short.py": 434,
    "vllm/test_restart.py": 339,
    "e2e/test_gpu_lane_on_cpu.py": 298,
    "vllm/test_trainer_loop.py": 221,
    "vllm/test_memory_sync_parallel.py": 209,
    "vllm/test_pool.py": 184,
    "vllm/test_memory_sync.py": 170,
    "vllm/test_families.py": 117,
    "vllm/test_reaping.py": 106,
    "e2e/test_drills_round3.py": 86,
    "distributed/test_workarounds.py": 71,
    "distributed/test_convert_tool.py": 69,
    "vllm/test_server.py": 67,
    "e2e/test_golden.py": 48,
    "e2e/test_ratio_reference.py": 41,
    "distributed/test_schedules.py": 39,
    "distributed/test_replay_in_loop.py": 37,
    "tools/test_gpu_run_configs.py": 33,
    "distributed/test_recipes_in_loop.py": 29,
    "distributed/test_rl_loop.py": 29,
    "tools/test_gpu_benchmark.py": 27,
    "e2e/test_drills_inputs.py": 26,
    "distributed/test_compiled_math_inductor.py": 22,
    "vllm/test_client_faults.py": 20,
    "distributed/test_precision.py": 19,
    "vllm/test_launcher.py": 18,
    "tools/test_slurm_example.py": 16,
    "e2e/test_multiturn_example.py": 15,
    "distributed/test_model_parallel.py": 15,
}


def longest_first(paths: list[str]) -> list[int]:
    """Indices of `paths` (each a test's file, relative to tests/, "/"-separated) in run order:
    LONG_FILES by descending seconds, then the others; ties keep their order (stable), so a file's
    tests stay together and in their own order."""
    return sorted(range(len(paths)), key=lambda i: -LONG_FILES.get(paths[i], 0))
