"""The order pytest-xdist hands test files to its workers: the longest first.

`make test` runs two workers with `--dist loadfile` (a file's tests stay on one worker) and
`--no-loadscope-reorder`, so files are handed out in collection order; xdist's default would order
them by number of tests, which puts the one-test whole-run files (the short demo, 293 s) last,
where one worker runs them alone while the other has finished. With the long files first, the many
short ones fill in behind them and the two workers end together (greedy longest-first).

LONG_FILES: seconds per file on a fresh clone's CI run (6a02ee0, 2026-11-30, 2-core AMD EPYC), the files over 15 s. A file not listed keeps its collection place after them; an outdated number only makes the
schedule less even, never a test wrong.
"""
from __future__ import annotations

LONG_FILES = {
    "vllm/test_pool.py": 321,
    "e2e/test_demo_short.py": 266,
    "e2e/test_repro_quick.py": 153,
    "e2e/test_drills.py": 137,
    "vllm/test_memory_sync.py": 122,
    "vllm/test_server.py": 117,
    "vllm/test_families.py": 106,
    "vllm/test_trainer_loop.py": 103,
    "e2e/test_gpu_lane_on_cpu.py": 101,
    "vllm/test_restart.py": 99,
    "e2e/test_golden.py": 97,
    "distributed/test_replay_in_loop.py": 95,
    "distributed/test_rl_loop.py": 65,
    "vllm/test_reaping.py": 53,
    "distributed/test_spawn_pool.py": 53,
    "e2e/test_drills_round3.py": 46,
    "distributed/test_precision.py": 45,
    "distributed/test_convert_tool.py": 40,
    "distributed/test_schedules.py": 37,
    "vllm/test_judge.py": 35,
    "distributed/test_model_parallel.py": 32,
    "tools/test_gpu_benchmark.py": 32,
    "distributed/test_partial_rollouts.py": 27,
    "e2e/test_plugins.py": 27,
    "distributed/test_compiled_math_inductor.py": 26,
    "unit/platform/test_gpu_logprob_compiles.py": 22,
    "vllm/test_client_faults.py": 21,
    "vllm/test_launcher.py": 20,
    "distributed/test_workarounds.py": 19,
    "tools/test_slurm_example.py": 18,
    "distributed/test_cp_trainer_path.py": 18,
    "tools/test_gpu_run_configs.py": 17,
    "unit/losses/test_zero_weight_terms.py": 16,
}


def longest_first(paths: list[str]) -> list[int]:
    """Indices of `paths` (each a test's file, relative to tests/, "/"-separated) in run order:
    LONG_FILES by descending seconds, then the others; ties keep their order (stable), so a file's
    tests stay together and in their own order."""
    return sorted(range(len(paths)), key=lambda i: -LONG_FILES.get(paths[i], 0))
