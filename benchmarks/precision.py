"""Precision recipes on the tiny-MoE CPU demo: how far the rollout engine's μ is from the trainer's π.

    python benchmarks/precision.py                  # the CPU recipes, 60 RL steps each
    python benchmarks/precision.py --steps 20 --out benchmarks/results/precision_cpu.md
    python benchmarks/precision.py --recipes fp32 bf16 --r3 bf16 --work-dir runs/prec --reuse   # add runs

One SFT warm start (fp32) is made first; every recipe then runs RL from that checkpoint with the
same seed (examples/precision_cpu.yaml, router replay R2 so that the engine's routing is compared
with the trainer's; the --r3 recipes run once more with R3, the trainer replaying the engine's
routing). The FP8 recipes (fp8_tensor, fp8_block, mxfp8) are a bf16 trainer against the embedded
engine with FP8 GEMMs (rollout.quantization, docs/precision.md). Per recipe, averaged over the RL
steps:

    KL k3              mean over tokens of exp(Δ) − Δ − 1, Δ = log π_old − log μ
    mean |Δlogp|       over all response tokens, and over the tokens the engine gave μ < 0.01
    routing agreement  fraction of (token, MoE layer) whose top-k expert set is the same in the
                       engine and in the trainer's π_old pass (moe/route_agree_rollout_train; under
                       R3 the trainer's router's own choice, while the engine's is replayed)
    reward             the sampled training reward of the last steps

then the mismatch-by-μ tables of all runs side by side (tools/mismatch_report.py --compare), at
step 1 and over the run. The training-inference mismatch blog predicts fp16 < bf16, an fp32 LM
head lower still, and FP8 rollouts well above bf16. Only the CPU-runnable recipes are measured
here (fp8_rollout and te_fp8 need a GPU).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from tools.mismatch_report import compare_table, read_history

RECIPES = ("fp32", "bf16", "fp16", "fp8_tensor", "fp8_block", "mxfp8")
R3 = ("bf16", "fp8_block")
LOW_MU = ("0-0.0001", "0.0001-0.001", "0.001-0.01")  # the μ buckets below 0.01


def run(args, run_dir: str, overrides: list[str]) -> dict:
    """A run's summary; with --reuse, that of the run already in run_dir when it finished."""
    summary_path = os.path.join(run_dir, "summary.json")
    if args.reuse and os.path.exists(summary_path):
        with open(summary_path) as f:
            return json.load(f)
    cmd = [sys.executable, "pretrain_rl.py", "--config", args.config, f"train.run_dir={run_dir}",
           "log.progress=false", "log.tensorboard=false", "--summary-json", summary_path, *args.override, *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({' '.join(overrides)}):\n{proc.stderr[-3000:]}")
    with open(summary_path) as f:
        return json.load(f)


def low_mu_abs_diff(rows: list[dict]) -> float:
    """Count-weighted mean |Δlogp| over the tokens with μ < 0.01, over all steps."""
    count = total = 0.0
    for r in rows:
        for label in LOW_MU:
            c = r.get(f"mismatch/bucket/{label}/count", 0.0)
            count += c
            total += c * r.get(f"mismatch/bucket/{label}/abs_diff", 0.0)
    return total / count if count else float("nan")


def _mean(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if key in r]
    return sum(vals) / len(vals) if vals else float("nan")


def measure(args, work: str) -> tuple[list[dict], str, str]:
    base = run(args, os.path.join(work, "sft"), ["train.steps=0", "precision.recipe=fp32"])
    checkpoint = base["sft"]["checkpoint"]
    print(f"SFT warm start: {base['sft']['steps']} steps -> {checkpoint}", flush=True)
    arms = [(r, r, []) for r in args.recipes] + [(f"{r}+r3", r, ["moe.router_replay=r3"]) for r in args.r3]
    results, histories = [], {}
    for label, recipe, extra in arms:
        run_dir = os.path.join(work, label)
        start = time.time()
        summary = run(args, run_dir, [f"train.init_checkpoint={checkpoint}", "sft.steps=0",
                                      f"train.steps={args.steps}", f"precision.recipe={recipe}", *extra])
        rows = read_history(run_dir)
        first = rows[:1]  # step 1: every recipe starts from the same weights and prompts
        results.append({"recipe": label, "kl_k3": _mean(rows, "mismatch/kl_k3"),
                        "abs": _mean(rows, "mismatch/abs_logprob_diff"), "abs_low": low_mu_abs_diff(rows),
                        "route": _mean(rows, "moe/route_agree_rollout_train"),
                        "kl_k3_1": _mean(first, "mismatch/kl_k3"), "abs_1": _mean(first, "mismatch/abs_logprob_diff"),
                        "abs_low_1": low_mu_abs_diff(first), "route_1": _mean(first, "moe/route_agree_rollout_train"),
                        "reward": summary["reward_last"]})
        histories[label] = rows
        print(f"{label}: KL k3 {results[-1]['kl_k3']:.3e} ({time.time() - start:.0f} s)", flush=True)
    return (results, compare_table({k: v[:1] for k, v in histories.items()}), compare_table(histories))


def table(results: list[dict], step1: str, side_by_side: str, args) -> str:
    head = ("| recipe | KL k3 | mean \\|Δlogp\\| | mean \\|Δlogp\\|, μ < 0.01 | routing agreement |", "|---|---|---|---|---|")
    lines = [(f"Precision recipes on `{args.config}`, {args.steps} RL steps each from one fp32 SFT checkpoint, "
              f"same seed; {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU cores, embedded engine."
              + (f" {args.note}" if args.note else "")), "",
             "Step 1 (the same weights and prompts for every recipe: the numerics alone):", "", *head]
    lines += [f"| {r['recipe']} | {r['kl_k3_1']:.2e} | {r['abs_1']:.2e} | {r['abs_low_1']:.2e} | {r['route_1']:.4f} |"
              for r in results]
    lines += ["", f"Mean over the {args.steps} steps (the runs diverge after step 1), and the reward:", "",
              head[0] + " reward (last steps) |", head[1] + "---|"]
    lines += [f"| {r['recipe']} | {r['kl_k3']:.2e} | {r['abs']:.2e} | {r['abs_low']:.2e} | {r['route']:.4f} "
              f"| {r['reward']:.3f} |" for r in results]
    return "\n".join(lines + ["", "Step 1 by μ bucket:", "", "```", step1, "```", "",
                              f"Over the {args.steps} steps by μ bucket:", "", "```", side_by_side, "```"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="examples/precision_cpu.yaml")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--recipes", nargs="+", default=list(RECIPES), help="precision recipes to run (router replay R2)")
    p.add_argument("--r3", nargs="*", default=list(R3), help="recipes to run again with router replay R3")
    p.add_argument("--note", default="", help="a sentence for the table's heading (the machine, its load)")
    p.add_argument("--override", action="append", default=[], help="extra section.field=value for every run")
    p.add_argument("--out", default=None, help="also write the table (Markdown) here")
    p.add_argument("--work-dir", default=None, help="keep the runs here (default: a temporary folder)")
    p.add_argument("--reuse", action="store_true", help="with --work-dir: keep the runs already there that finished")
    args = p.parse_args(argv)
    if args.reuse and not args.work_dir:
        p.error("--reuse needs --work-dir")
    if args.work_dir:
        os.makedirs(args.work_dir, exist_ok=True)
        measured = measure(args, args.work_dir)
    else:
        with tempfile.TemporaryDirectory() as work:
            measured = measure(args, work)
    text = table(*measured, args)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
