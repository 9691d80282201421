"""The order pytest-xdist hands test files to its workers: the longest first.

`make test` runs two workers with `--dist loadfile` (a file's tests stay on one worker) and
`--no-loadscope-reorder`, so files are handed out in collection order; xdist's default would order
them by number of tests, which puts the one-test whole-run files (the short demo, 264 s) last,
where one worker runs them alone while the other has finished. With the long files first, the many
short ones fill in behind them and the two workers end together (greedy longest-first).

LONG_FILES: seconds per file on a fresh clone's CI run (2-core AMD EPYC, idle, 2026-11-29 at
51fb84f; `make ci-time`), the files over 15 s, lowered by the CPU seconds measured for the files
cut since (the repro scripts' --quick, the drills' kept worker, shared vLLM servers). A file not listed keeps its collection place after them; an
outdated number only makes the schedule less even, never a test wrong.
"""
from __future__ import annotations

LONG_FILES = {
    "vllm/test_pool.py": 520,
    "e2e/test_demo_short.py": 342,
    "e2e/test_drills.py": 250,
    "vllm/test_restart.py": 250,
    "vllm/test_families.py": 249,
    "e2e/test_repro_quick.py": 230,
    "vllm/test_server.py": 200,
    "vllm/test_memory_sync_parallel.py": 200,
    "e2e/test_gpu_lane_on_cpu.py": 200,
    "distributed/test_convert_tool.py": 189,
    "vllm/test_trainer_loop.py": 185,
    "distributed/test_replay_in_loop.py": 136,
    "vllm/test_reaping.py": 132,
    "e2e/test_golden.py": 132,
    "vllm/test_memory_sync.py": 130,
    "distributed/test_workarounds.py": 110,
    "distributed/test_schedules.py": 95,
    "e2e/test_drills_round3.py": 90,
    "distributed/test_rl_loop.py": 74,
    "distributed/test_precision.py": 70,
    "distributed/test_spawn_pool.py": 70,
    "distributed/test_recipes_in_loop.py": 61,
    "distributed/test_compiled_math_inductor.py": 55,
    "e2e/test_plugins.py": 53,
    "e2e/test_drills_inputs.py": 45,
    "e2e/test_ratio_reference.py": 40,
    "tools/test_gpu_benchmark.py": 40,
    "distributed/test_partial_rollouts.py": 39,
    "distributed/test_model_parallel.py": 37,
}


def longest_first(paths: list[str]) -> list[int]:
    """Indices of `paths` (each a test's file, relative to tests/, "/"-separated) in run order:
    LONG_FILES by descending seconds, then the others; ties keep their order (stable), so a file's
    tests stay together and in their own order."""
    return sorted(range(len(paths)), key=lambda i: -LONG_FILES.get(paths[i], 0))
