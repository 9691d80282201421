"""The order pytest-xdist hands test files to its workers: the longest first.

`make test` runs two workers with `--dist loadfile` (a file's tests stay on one worker) and
`--no-loadscope-reorder`, so files are handed out in collection order; xdist's default would order
them by number of tests, which puts the one-test whole-run files (the short demo, 293 s) last,
where one worker runs them alone while the other has finished. With the long files first, the many
short ones fill in behind them and the two workers end together (greedy longest-first).

LONG_FILES: seconds per file on a fresh clone's CI run (2-core AMD EPYC, 2026-11-29 at 468af13;
`make ci-time`), the files over 15 s. A file not listed keeps its collection place after them; an outdated number only makes the
schedule less even, never a test wrong.
"""
from __future__ import annotations

LONG_FILES = {
    "vllm/test_pool.py": 345,
    "e2e/test_demo_short.py": 293,
    "vllm/test_restart.py": 212,
    "e2e/test_drills.py": 159,
    "e2e/test_repro_quick.py": 147,
    "vllm/test_families.py": 134,
    "vllm/test_memory_sync.py": 133,
    "vllm/test_trainer_loop.py": 127,
    "vllm/test_server.py": 120,
    "e2e/test_golden.py": 115,
    "e2e/test_gpu_lane_on_cpu.py": 111,
    "distributed/test_replay_in_loop.py": 96,
    "distributed/test_spawn_pool.py": 82,
    "distributed/test_rl_loop.py": 73,
    "distributed/test_precision.py": 73,
    "vllm/test_reaping.py": 67,
    "distributed/test_convert_tool.py": 65,
    "vllm/test_judge.py": 51,
    "distributed/test_partial_rollouts.py": 48,
    "distributed/test_schedules.py": 47,
    "e2e/test_drills_round3.py": 40,
    "tools/test_gpu_benchmark.py": 39,
    "distributed/test_model_parallel.py": 39,
    "distributed/test_compiled_math_inductor.py": 36,
    "e2e/test_plugins.py": 31,
    "distributed/test_oversample_run.py": 31,
    "unit/platform/test_gpu_logprob_compiles.py": 28,
    "vllm/test_launcher.py": 25,
    "distributed/test_workarounds.py": 25,
    "tools/test_slurm_example.py": 25,
    "tools/test_gpu_run_configs.py": 24,
    "e2e/test_reasoning_gym_run.py": 19,
    "distributed/test_cp_trainer_path.py": 23,
    "distributed/test_metrics_over_ranks.py": 22,
    "e2e/test_ratio_reference.py": 21,
    "distributed/test_dist_checkpoint.py": 21,
    "distributed/test_router_replay.py": 19,
    "vllm/test_client_faults.py": 18,
    "unit/losses/test_zero_weight_terms.py": 17,
    "distributed/test_nonfinite_updates.py": 16,
}


def longest_first(paths: list[str]) -> list[int]:
    """Indices of `paths` (each a test's file, relative to tests/, "/"-separated) in run order:
    LONG_FILES by descending seconds, then the others; ties keep their order (stable), so a file's
    tests stay together and in their own order."""
    return sorted(range(len(paths)), key=lambda i: -LONG_FILES.get(paths[i], 0))
