"""Print the training-inference mismatch table of a run: KL and |Δ log p| by rollout probability.

    python tools/mismatch_report.py runs/demo                # all steps, count-weighted
    python tools/mismatch_report.py runs/demo --last 10      # the last 10 steps only
    python tools/mismatch_report.py runs/demo --step 42      # one step
    python tools/mismatch_report.py --compare runs/bf16 runs/fp16 runs/fp16_fp32head   # side by side

Reads RUN_DIR/metrics.jsonl (written by pretrain_rl.py). Also prints the headline mismatch
numbers (KL k3, k1, ESS of w = π_old/μ) averaged over the same steps, and for a multi-turn run
(rollout.function=multi_turn) the same table by policy turn, the environment's mean reward by
policy turn, with router replay (R2 / R3) the engine-vs-trainer routing agreement by policy turn,
and the environment's averages (turns per trajectory, sampled tokens per turn, failures per step). With --compare, one
column pair (mean |Δlogp|, KL k3) per run for every μ bucket, then the headline numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from megatron_rl.metrics.mismatch import bucket_labels
from megatron_rl.metrics.report import (
    format_agreement_turn_table,
    format_bucket_table,
    format_env_turn_table,
    merge_agreement_turn_rows,
    merge_bucket_rows,
    merge_env_turn_rows,
    merge_turn_rows,
)

HEADLINE = ("mismatch/kl_k3", "mismatch/kl_k1", "mismatch/abs_logprob_diff", "mismatch/w/ess", "mismatch/w/max",
            "mismatch/entropy", "env/turns", "env/sampled_per_turn", "env/failures", "env/render_drift")


def read_history(run_dir: str, last: int | None = None, step: int | None = None) -> list[dict]:
    """The RL rows of RUN_DIR/metrics.jsonl that carry mismatch values (FileNotFoundError if none)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: is {run_dir} a run directory of pretrain_rl.py?")
    history = []
    with open(path) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                history.append(json.loads(line))
            except ValueError as e:  # a row cut short by a crash: report it and use the others
                print(f"{path}:{lineno}: skipped, not a complete JSON row ({getattr(e, 'msg', e)}); the run was "
                      f"probably interrupted while writing it", file=sys.stderr)
            except RecursionError:
                print(f"{path}:{lineno}: skipped, a JSON row nested too deeply to read", file=sys.stderr)
    history = [h for h in history if "mismatch/kl_k3" in h and h.get("phase", "rl") == "rl"]
    if step is not None:
        history = [h for h in history if h["step"] == step]
    elif last:
        history = history[-last:]
    return history


def run_labels(run_dirs: list[str]) -> list[str]:
    """A column name for each run, one per run given: the folder's name, or where two runs share
    it (a/run, b/run) the path as given; a path given twice keeps a #k suffix. Keyed by the folder
    name alone, --compare a/run b/run showed one of them."""
    names = [os.path.basename(os.path.normpath(d)) for d in run_dirs]
    labels = [n if names.count(n) == 1 else os.path.normpath(d) for n, d in zip(names, run_dirs)]
    return [label if labels.count(label) == 1 else f"{label} #{labels[:i + 1].count(label)}"
            for i, label in enumerate(labels)]


def headline(history: list[dict]) -> dict[str, float]:
    out = {}
    for key in HEADLINE:
        vals = [h[key] for h in history if key in h]
        if vals:
            out[key] = sum(vals) / len(vals)
    return out


def compare_table(runs: dict[str, list[dict]]) -> str:
    """μ buckets as rows, (mean |Δlogp|, KL k3) per run as columns; then the headline numbers."""
    merged = {name: {r[0]: r for r in merge_bucket_rows(h)} for name, h in runs.items()}
    width = max(19, *(len(n) for n in runs))
    head = f"{'μ bucket':>14}" + "".join(f" | {name:>{width}}" for name in runs)
    sub = f"{'':>14}" + "".join(f" | {'|Δlogp| / KL k3':>{width}}" for _ in runs)
    lines = ["mismatch by rollout probability μ, side by side", head, sub]
    for label in bucket_labels():
        cells = []
        for name in runs:
            row = merged[name].get(label)
            cell = "-" if row is None or not row[1] else f"{row[2]:.2e} / {row[3]:.2e}"
            cells.append(f" | {cell:>{width}}")
        lines.append(f"{label:>14}" + "".join(cells))
    lines.append("")
    heads = {name: headline(h) for name, h in runs.items()}
    for key in HEADLINE:
        if any(key in v for v in heads.values()):
            lines.append(f"{key:>28}" + "".join(f" | {heads[n].get(key, float('nan')):>{width}.4e}" for n in runs))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", nargs="?")
    p.add_argument("--compare", nargs="+", metavar="RUN_DIR", help="several runs side by side")
    p.add_argument("--last", type=int, default=None, help="only the last N RL steps")
    p.add_argument("--step", type=int, default=None, help="only this step")
    args = p.parse_args(argv)
    if bool(args.run_dir) == bool(args.compare):
        p.error("give one RUN_DIR, or --compare RUN_DIR RUN_DIR ...")
    try:
        if args.compare:
            runs = dict(zip(run_labels(args.compare), (read_history(d, args.last, args.step) for d in args.compare)))
            empty = [n for n, h in runs.items() if not h]
            if empty:
                print(f"no RL steps with mismatch metrics in: {', '.join(empty)}", file=sys.stderr)
                return 1
            print(compare_table(runs))
            return 0
        history = read_history(args.run_dir, args.last, args.step)
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
        return 2
    if not history:
        print("no RL steps with mismatch metrics in this run", file=sys.stderr)
        return 1
    steps = f"step {history[0]['step']}" if len(history) == 1 else \
        f"steps {history[0]['step']}-{history[-1]['step']} ({len(history)} steps)"
    print(format_bucket_table(merge_bucket_rows(history), f"mismatch by rollout probability μ, {steps}"))
    print()
    turns = merge_turn_rows(history)
    if turns:
        print(format_bucket_table(turns, f"mismatch by policy turn, {steps}", first="turn"))
        print()
    rewards = merge_env_turn_rows(history)
    if rewards:
        print(format_env_turn_table(rewards, f"environment reward by policy turn, {steps}"))
        print()
    agreement = merge_agreement_turn_rows(history)
    if agreement:
        print(format_agreement_turn_table(agreement, f"MoE routing agreement (engine vs trainer) by policy turn, "
                                                     f"{steps}"))
        print()
    for key, value in headline(history).items():
        print(f"{key:>28} {value:.4e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
