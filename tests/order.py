"""The order pytest-xdist hands test files to its workers: the longest first.

`make test` runs two workers with `--dist loadfile` (a file's tests stay on one worker) and
`--no-loadscope-reorder`, so files are handed out in collection order; xdist's default would order
them by number of tests, which puts the one-test whole-run files (the short demo, 293 s) last,
where one worker runs them alone while the other has finished. With the long files first, the many
short ones fill in behind them and the two workers end together (greedy longest-first).

LONG_FILES: seconds per file on a fresh clone's CI run (2-core AMD EPYC, 2026-11-29 at 57292ab;
`make ci-time`), the files over 15 s. A file not listed keeps its collection place after them; an outdated number only makes the
schedule less even, never a test wrong.
"""
from __future__ import annotations

LONG_FILES = {
    "vllm/test_pool.py": 349,
    "e2e/test_demo_short.py": 291,
    "vllm/test_restart.py": 215,
    "e2e/test_repro_quick.py": 152,
    "e2e/test_drills.py": 148,
    "vllm/test_memory_sync.py": 124,
    "vllm/test_trainer_loop.py": 113,
    "vllm/test_families.py": 113,
    "e2e/test_golden.py": 109,
    "distributed/test_replay_in_loop.py": 106,
    "vllm/test_server.py": 106,
    "e2e/test_gpu_lane_on_cpu.py": 105,
    "distributed/test_spawn_pool.py": 67,
    "distributed/test_rl_loop.py": 63,
    "vllm/test_reaping.py": 56,
    "distributed/test_precision.py": 55,
    "vllm/test_judge.py": 42,
    "e2e/test_drills_round3.py": 41,
    "distributed/test_schedules.py": 41,
    "distributed/test_convert_tool.py": 40,
    "distributed/test_model_parallel.py": 34,
    "tools/test_gpu_benchmark.py": 33,
    "distributed/test_partial_rollouts.py": 31,
    "distributed/test_compiled_math_inductor.py": 31,
    "e2e/test_plugins.py": 29,
    "unit/platform/test_gpu_logprob_compiles.py": 25,
    "tools/test_gpu_run_configs.py": 22,
    "vllm/test_launcher.py": 22,
    "distributed/test_cp_trainer_path.py": 21,
    "distributed/test_workarounds.py": 20,
    "tools/test_slurm_example.py": 20,
    "vllm/test_client_faults.py": 19,
    "distributed/test_oversample_run.py": 18,
    "distributed/test_metrics_over_ranks.py": 17,
    "distributed/test_dist_checkpoint.py": 17,
    "e2e/test_ratio_reference.py": 15,
}


def longest_first(paths: list[str]) -> list[int]:
    """Indices of `paths` (each a test's file, relative to tests/, "/"-separated) in run order:
    LONG_FILES by descending seconds, then the others; ties keep their order (stable), so a file's
    tests stay together and in their own order."""
    return sorted(range(len(paths)), key=lambda i: -LONG_FILES.get(paths[i], 0))
