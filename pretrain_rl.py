"""megatron-rl entry point: RL post-training of a megatron-core (MoE) GPT, Megatron-style.

What it does: builds the policy on megatron-core (TP/PP/EP from the flags), a rollout engine
(embedded transformers engine by default, or a vLLM server), optionally warm-starts with SFT
on the task, then runs the RL loop (rollout -> reward -> advantages -> old log-probs -> N
optimizer steps -> weight sync, on the sync, staged or async schedule), logging to stdout, metrics.jsonl and
TensorBoard under train.run_dir, checkpointing atomically and resuming automatically.

One CPU (the laptop/CI default; what `make demo` runs):
    python pretrain_rl.py --config examples/demo_cpu.yaml
Two CPU processes (gloo), tensor or expert parallel:
    torchrun --nproc_per_node=2 pretrain_rl.py --config examples/demo_cpu.yaml --tensor-model-parallel-size 2
One GPU node (NCCL; 6 trainer ranks, the vLLM rollout server on the other 2 GPUs):
    torchrun --nproc_per_node=6 pretrain_rl.py --config my_run.yaml --rollout-backend vllm \
        rollout.vllm.tensor_parallel_size=2 'rollout.vllm.env={CUDA_VISIBLE_DEVICES: "6,7"}'
32k-64k token responses (GPUs with Transformer Engine): split every row over CP ranks
    torchrun --nproc_per_node=8 pretrain_rl.py --config my_run.yaml --context-parallel-size 2
A SLURM allocation: see examples/slurm_rl.sbatch.

Overrides: any `section.field=value` (e.g. train.steps=20 loss.recipe=minirl) or a Megatron flag
(--tensor-model-parallel-size, --expert-model-parallel-size, --pipeline-model-parallel-size,
--lr, --micro-batch-size, --train-iters, --seed, --rollout-backend, --recipe, ...).
Every field, its default and what it does: docs/config.md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import warnings


def parse_args(argv=None):
    from megatron_rl.config import MEGATRON_FLAGS

    p = argparse.ArgumentParser(
        prog="pretrain_rl.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Megatron flags understood: " + ", ".join(sorted(MEGATRON_FLAGS)))
    p.add_argument("--config", default=None, help="YAML run config (examples/*.yaml); overrides follow")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--summary-json", default=None, help="write the final summary here (rank 0)")
    p.add_argument("--debug", action="store_true",
                   help="print the full traceback of an error (otherwise one line, traceback in run_dir/error-rank<r>.log)")
    args, overrides = p.parse_known_args(argv)
    return args, overrides


def prepare_summary_json(path: str) -> None:
    """--summary-json is written after the run: at start-up its folder is created if missing (as
    train.run_dir's is; the summary often sits beside the run directory) and a path that cannot
    take the file is refused, naming it (a missing folder was found only once training was over,
    and the summary lost). Raises ValueError."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"--summary-json {path} is a folder; name a file in it")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--summary-json {path}: cannot create its folder {folder} ({e.strerror or e}); name a "
                         f"file in a folder that exists or can be made") from None
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ValueError(f"--summary-json {path}: not writable by this user; name a file in a writable folder")


def print_summary(summary: dict) -> None:
    def pct(x):
        return "n/a" if x is None else f"{100 * x:.1f}%"

    sft = summary.get("sft") or {}
    rows = [
        ("SFT warm start", f"{sft.get('steps', 0)} steps, {sft.get('seconds', 0):.0f}s" if sft else "skipped"),
    ]
    for kind, key in (("greedy", "rl_accuracy"), ("sampled", "rl_sampled_accuracy")):
        before, after = summary.get(f"before_{key}"), summary.get(f"after_{key}")
        if before is None and after is None:
            continue
        gain = f"  ({100 * (after - before):+.1f} points)" if before is not None and after is not None else ""
        rows.append((f"held-out accuracy, {kind}: before -> after RL", f"{pct(before)} -> {pct(after)}{gain}"))
    if summary["reward_first"] is not None:
        rows.append(("sampled reward (first -> last steps)",
                     f"{summary['reward_first']:.3f} -> {summary['reward_last']:.3f} over {summary['steps']} steps"))
    if summary["kl_k3_mean"] is not None:
        rows.append(("engine-vs-trainer KL k3 (mean / last)",
                     f"{summary['kl_k3_mean']:.2e} / {summary['kl_k3_last']:.2e}"))
    if summary["tensorboard"] is not None:
        rows.append(("TensorBoard logs", f"tensorboard --logdir {summary['tensorboard']}"))
    if summary.get("wall_seconds") is not None:
        minutes, seconds = divmod(round(summary["wall_seconds"]), 60)
        rows.append(("wall time (start-up to end)", f"{minutes} min {seconds:02d} s"))
    width = max(len(r[0]) for r in rows)
    print("\n" + "=" * (width + 40))
    for k, v in rows:
        print(f"{k.ljust(width)}  {v}")
    print("=" * (width + 40), flush=True)


def report_error(e: BaseException, rank: int, run_dir: str, debug: bool) -> None:
    """One line per failing rank on stderr; the traceback goes to run_dir/error-rank<r>.log (and to
    stderr with --debug), except when the run directory was refused (it belongs to another live
    run, whose own error log must not be overwritten by a launch it refused, or its lock is a
    link). A symbolic link at the log's name is not followed: the traceback is then not kept."""
    from megatron_rl.fs import open_no_follow
    from megatron_rl.trainer.run_dir import RunDirRefused

    trace = "".join(traceback.format_exception(e))
    log = None if isinstance(e, RunDirRefused) else os.path.join(run_dir, f"error-rank{rank}.log")
    try:
        if log is not None:
            os.makedirs(run_dir, exist_ok=True)
            with open_no_follow(log, "w") as f:
                f.write(trace)
    except OSError:
        log = None
    if debug:
        print(trace, file=sys.stderr)
    where = f" (traceback: {log})" if log and not debug else ""
    message = str(e).strip() or type(e).__name__
    if not isinstance(e, (ValueError, OSError, RuntimeError)):  # not one of ours: say what kind it is
        message = f"{type(e).__name__}: {message}"
    print(f"error{f' on rank {rank}' if rank else ''}: {message}{where}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    """Exit codes: 0 done, 1 an error (one line on stderr), 2 a config error, 128 + signal number
    when SIGTERM/SIGINT stopped the run after saving its completed steps."""
    t0 = time.perf_counter()
    warnings.filterwarnings("ignore", category=UserWarning)  # megatron's "no Apex/TE" notices
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch.distributed.checkpoint's deprecation notes
    args, overrides = parse_args(argv)
    import torch

    if not torch.cuda.is_available():  # megatron's jit_fuser is torch.compile: minutes of CPU compiles
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    from megatron_rl.config import ConfigError, config_to_dict
    from megatron_rl.configure import load_config

    try:
        cfg = load_config(args.config, overrides)
        cfg.check_layout(int(os.environ.get("WORLD_SIZE", "1")))
        if args.print_config:  # what the config says; the paths are this machine's business
            print(json.dumps(config_to_dict(cfg), indent=2, default=str))
            return 0
        cfg.check_paths()
        if args.summary_json and int(os.environ.get("RANK", "0")) == 0:  # rank 0 writes it, after the run
            prepare_summary_json(args.summary_json)
    except (ConfigError, ValueError, OSError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    from torch.distributed.checkpoint.api import CheckpointException

    from megatron_rl.parallel import destroy_parallel, init_distributed, init_parallel
    from megatron_rl.platform import apply_platform_workarounds
    from megatron_rl.trainer.loop import run
    from megatron_rl.trainer.stop import Stopped, StopSignals

    stop = StopSignals.install()  # SIGTERM like Ctrl-C: finish the step, save, exit
    rank = int(os.environ.get("RANK", "0"))
    try:
        apply_platform_workarounds()
        rank, _ = init_distributed()
        groups = init_parallel(cfg.parallel, seed=cfg.train.seed)
        try:
            summary = run(cfg, groups, stop)
        finally:
            destroy_parallel()
    except Stopped as e:
        if rank == 0:
            print(str(e), file=sys.stderr, flush=True)
        return 128 + e.signum
    except KeyboardInterrupt:
        print(f"interrupted{f' (rank {rank})' if rank else ''}: stopped without saving", file=sys.stderr, flush=True)
        return 130
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - the top level: one clear line, the
        # traceback in a file (torch's CheckpointException is a BaseException)
        report_error(e, rank, cfg.train.run_dir, args.debug)
        return 1
    finally:
        stop.uninstall()
    if rank == 0:
        summary["wall_seconds"] = time.perf_counter() - t0
        print_summary(summary)
        if args.summary_json:
            try:
                with open(args.summary_json, "w") as f:
                    json.dump(summary, f, indent=1, default=str)
            except OSError as e:
                print(f"error: --summary-json {args.summary_json}: {e.strerror or e}", file=sys.stderr, flush=True)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
