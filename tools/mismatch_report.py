"""Print the training-inference mismatch table of a run: KL and |Δ log p| by rollout probability.

    python tools/mismatch_report.py runs/demo                # all steps, count-weighted
    python tools/mismatch_report.py runs/demo --last 10      # the last 10 steps only
    python tools/mismatch_report.py runs/demo --step 42      # one step

Reads RUN_DIR/metrics.jsonl (written by pretrain_rl.py). Also prints the headline mismatch
numbers (KL k3, k1, ESS of w = π_old/μ) averaged over the same steps.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from megatron_rl.metrics.report import format_bucket_table, merge_bucket_rows

HEADLINE = ("mismatch/kl_k3", "mismatch/kl_k1", "mismatch/abs_logprob_diff", "mismatch/w/ess", "mismatch/w/max",
            "mismatch/entropy")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    p.add_argument("--last", type=int, default=None, help="only the last N RL steps")
    p.add_argument("--step", type=int, default=None, help="only this step")
    args = p.parse_args(argv)
    path = os.path.join(args.run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        print(f"{path} not found: is {args.run_dir} a run directory of pretrain_rl.py?", file=sys.stderr)
        return 2
    history = []
    with open(path) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                history.append(json.loads(line))
            except ValueError as e:  # a row cut short by a crash: report it and use the others
                print(f"{path}:{lineno}: skipped, not a complete JSON row ({e.msg}); the run was probably "
                      f"interrupted while writing it", file=sys.stderr)
    history = [h for h in history if "mismatch/kl_k3" in h and h.get("phase", "rl") == "rl"]
    if args.step is not None:
        history = [h for h in history if h["step"] == args.step]
    elif args.last:
        history = history[-args.last:]
    if not history:
        print("no RL steps with mismatch metrics in this run", file=sys.stderr)
        return 1
    steps = f"step {history[0]['step']}" if len(history) == 1 else \
        f"steps {history[0]['step']}-{history[-1]['step']} ({len(history)} steps)"
    print(format_bucket_table(merge_bucket_rows(history), f"mismatch by rollout probability μ, {steps}"))
    print()
    for key in HEADLINE:
        vals = [h[key] for h in history if key in h]
        if vals:
            print(f"{key:>28} {sum(vals) / len(vals):.4e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
