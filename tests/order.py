"""The order pytest-xdist hands test files to its workers: the longest first.

`make test` runs two workers with `--dist loadfile` (a file's tests stay on one worker) and
`--no-loadscope-reorder`, so files are handed out in collection order; xdist's default would order
them by number of tests, which puts the one-test whole-run files (the short demo, 264 s) last,
where one worker runs them alone while the other has finished. With the long files first, the many
short ones fill in behind them and the two workers end together (greedy longest-first).

LONG_FILES: seconds per file on a fresh clone's CI run (2-core AMD EPYC, 2026-11-29 at 47d77dd;
`make ci-time`), the files over 15 s (test_repro_quick with the collapse script's quick run added
since). A file not listed keeps its collection place after them; an outdated number only makes the
schedule less even, never a test wrong.
"""
from __future__ import annotations

LONG_FILES = {
    "vllm/test_pool.py": 520,
    "e2e/test_demo_short.py": 374,
    "vllm/test_restart.py": 266,
    "e2e/test_repro_quick.py": 235,
    "e2e/test_drills.py": 192,
    "vllm/test_families.py": 177,
    "distributed/test_convert_tool.py": 171,
    "vllm/test_trainer_loop.py": 169,
    "vllm/test_server.py": 138,
    "vllm/test_memory_sync.py": 200,  # the TP=2 / EP=2 syncs (their file merged in) and the MoE disk check
    "vllm/test_reaping.py": 127,
    "e2e/test_golden.py": 124,
    "e2e/test_gpu_lane_on_cpu.py": 119,
    "distributed/test_replay_in_loop.py": 116,
    "distributed/test_workarounds.py": 98,
    "distributed/test_recipes_in_loop.py": 86,
    "distributed/test_precision.py": 74,
    "e2e/test_drills_round3.py": 67,
    "distributed/test_spawn_pool.py": 66,
    "distributed/test_rl_loop.py": 66,
    "vllm/test_judge.py": 60,
    "distributed/test_schedules.py": 47,
    "e2e/test_plugins.py": 43,
    "distributed/test_compiled_math_inductor.py": 42,
    "distributed/test_partial_rollouts.py": 39,
    "tools/test_gpu_benchmark.py": 38,
    "distributed/test_model_parallel.py": 36,
    "tools/test_gpu_check_script.py": 33,
    "unit/platform/test_gpu_logprob_compiles.py": 26,
    "distributed/test_cp_trainer_path.py": 24,
    "distributed/test_checkpoint_names.py": 23,
    "distributed/test_nonfinite_updates.py": 22,
    "e2e/test_ratio_reference.py": 21,
    "distributed/test_dist_checkpoint.py": 20,
    "distributed/test_logprobs_peak_memory.py": 20,
    "vllm/test_launcher.py": 20,
    "tools/test_slurm_example.py": 19,
    "distributed/test_metrics_over_ranks.py": 19,
    "distributed/test_oversample_run.py": 19,
    "vllm/test_client_faults.py": 18,
    "tools/test_gpu_run_configs.py": 18,
    "distributed/test_router_replay.py": 16,
    "distributed/test_multi_turn_loop.py": 16,
}


def longest_first(paths: list[str]) -> list[int]:
    """Indices of `paths` (each a test's file, relative to tests/, "/"-separated) in run order:
    LONG_FILES by descending seconds, then the others; ties keep their order (stable), so a file's
    tests stay together and in their own order."""
    return sorted(range(len(paths)), key=lambda i: -LONG_FILES.get(paths[i], 0))
