"""The order pytest-xdist hands test files to its workers: the longest first.

`make test` runs two workers with `--dist loadfile` (a file's tests stay on one worker) and
`--no-loadscope-reorder`, so files are handed out in collection order; xdist's default would order
them by number of tests, which puts the one-test whole-run files (the short demo, 293 s) last,
where one worker runs them alone while the other has finished. With the long files first, the many
short ones fill in behind them and the two workers end together (greedy longest-first).

LONG_FILES: seconds per file on a fresh clone's CI run (ee4f45b, 2026-11-30, 2-core AMD EPYC), the files over 15 s. A file not listed keeps its collection place after them; an outdated number only makes the
schedule less even, never a test wrong.
"""
from __future__ import annotations

LONG_FILES = {
    "vllm/test_pool.py": 337,
    "e2e/test_demo_short.py": 307,
    "e2e/test_repro_quick.py": 147,
    "e2e/test_drills.py": 146,
    "vllm/test_server.py": 132,
    "vllm/test_memory_sync.py": 131,
    "vllm/test_restart.py": 126,
    "vllm/test_families.py": 120,
    "vllm/test_trainer_loop.py": 116,
    "e2e/test_gpu_lane_on_cpu.py": 112,
    "distributed/test_replay_in_loop.py": 112,
    "e2e/test_golden.py": 111,
    "distributed/test_spawn_pool.py": 77,
    "distributed/test_rl_loop.py": 71,
    "vllm/test_reaping.py": 64,
    "distributed/test_precision.py": 56,
    "vllm/test_judge.py": 46,
    "distributed/test_convert_tool.py": 45,
    "distributed/test_schedules.py": 43,
    "tools/test_gpu_benchmark.py": 41,
    "e2e/test_drills_round3.py": 37,
    "distributed/test_model_parallel.py": 35,
    "distributed/test_partial_rollouts.py": 34,
    "distributed/test_compiled_math_inductor.py": 31,
    "e2e/test_plugins.py": 29,
    "distributed/test_workarounds.py": 28,
    "unit/platform/test_gpu_logprob_compiles.py": 26,
    "e2e/test_ratio_reference.py": 25,
    "distributed/test_oversample_run.py": 24,
    "tools/test_slurm_example.py": 24,
    "distributed/test_cp_trainer_path.py": 23,
    "vllm/test_launcher.py": 23,
    "tools/test_gpu_run_configs.py": 22,
    "distributed/test_metrics_over_ranks.py": 21,
    "vllm/test_client_faults.py": 20,
    "unit/losses/test_zero_weight_terms.py": 20,
    "distributed/test_dist_checkpoint.py": 19,
    "distributed/test_router_replay.py": 16,
}


def longest_first(paths: list[str]) -> list[int]:
    """Indices of `paths` (each a test's file, relative to tests/, "/"-separated) in run order:
    LONG_FILES by descending seconds, then the others; ties keep their order (stable), so a file's
    tests stay together and in their own order."""
    return sorted(range(len(paths)), key=lambda i: -LONG_FILES.get(paths[i], 0))
