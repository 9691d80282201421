"""Rollout schedules on the CPU demo at an equal number of optimizer updates: sync vs staged (K=4,
µ-GRPO) vs async (max_staleness=1).

    python benchmarks/schedules.py                         # embedded engine, 300 RL steps (--steps)
    python benchmarks/schedules.py --steps 40 --backend vllm --config examples/vllm_cpu.yaml

One SFT warm start is made first and every schedule starts RL from its checkpoint, with the same
seed, steps and train.num_minibatches (so the same number of optimizer updates). Per schedule:

    RL wall-clock   sum of the steps' timing/step (generation, old log-probs, updates, syncs;
                    evaluations excluded), and its speed relative to sync (sync time / time)
    generate calls  engine calls that produced training batches; weight syncs to the engine
    staleness       mean over steps of the batch's mean staleness (trainer versions)
    accuracy        held-out accuracy after RL, greedy and sampled (before RL: the same start)

Recipes: grpo for sync (the demo's), mu_grpo for staged (relaxed clipping + negative-advantage
veto, built for stale data), decoupled_ppo for async (the behaviour weight π_old/μ corrects the
staleness). The table goes to stdout and, with --out, to a Markdown file.
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
SCHEDULES = {
    "sync": ["train.schedule=sync", "loss.recipe=grpo"],
    "staged K=4": ["train.schedule=staged", "train.stages=4", "loss.recipe=mu_grpo"],
    "async s=1": ["train.schedule=async", "train.max_staleness=1", "loss.recipe=decoupled_ppo"],
}


def run(args, run_dir: str, overrides: list[str]) -> dict:
    """One pretrain_rl.py run; returns its summary and metrics rows."""
    summary_path = os.path.join(run_dir, "summary.json")
    cmd = [sys.executable, "pretrain_rl.py", "--config", args.config, f"train.run_dir={run_dir}",
           "log.tensorboard=false", "log.progress=false", f"train.eval_size={args.eval_size}",
           "train.eval_every=0", "--summary-json", summary_path, *args.override, *overrides]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({' '.join(overrides)}):\n{proc.stderr[-3000:]}")
    with open(summary_path) as f:
        summary = json.load(f)
    rows = []
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(metrics):
        with open(metrics) as f:
            rows = [r for r in map(json.loads, f) if r.get("phase") == "rl"]
    return {"summary": summary, "rows": rows, "process_s": time.perf_counter() - t0}


def measure(args, work: str) -> list[dict]:
    base = run(args, os.path.join(work, "sft"), ["train.steps=0", *args.sft])
    checkpoint = base["summary"]["sft"]["checkpoint"]
    print(f"SFT warm start: {base['summary']['sft']['steps']} steps -> {checkpoint}", flush=True)
    out = []
    for name, overrides in SCHEDULES.items():
        r = run(args, os.path.join(work, name.split()[0]),
                [f"train.init_checkpoint={checkpoint}", "sft.steps=0", f"train.steps={args.steps}", *overrides])
        rows, s = r["rows"], r["summary"]
        last = rows[-1]
        out.append({"schedule": name, "recipe": overrides[-1].split("=")[1],
                    "rl_s": sum(x["timing/step"] for x in rows),
                    "generate_s": sum(x["timing/generate"] for x in rows),
                    "generate_calls": last.get("schedule/generate_calls"),
                    "weight_syncs": last.get("schedule/weight_syncs"),
                    "staleness": sum(x["schedule/staleness_mean"] for x in rows) / len(rows),
                    "before": s["before_rl_accuracy"], "after": s["after_rl_accuracy"],
                    "before_sampled": s["before_rl_sampled_accuracy"], "after_sampled": s["after_rl_sampled_accuracy"],
                    "reward_last": s["reward_last"]})
        print(f"{name}: {out[-1]['rl_s']:.1f} s", flush=True)
    return out


def table(results: list[dict], args) -> str:
    sync = results[0]["rl_s"]
    lines = [(f"Schedules on `{args.config}` ({args.backend} engine), {args.steps} RL steps each "
              f"(equal optimizer updates), from one SFT checkpoint; {time.strftime('%Y-%m-%d')}, "
              f"{os.cpu_count()} CPU cores."), "",
             ("| schedule | recipe | RL wall-clock | speed vs sync | generation time | generate calls | weight syncs "
              "| mean staleness | held-out greedy | held-out sampled | reward (last steps) |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(
            f"| {r['schedule']} | {r['recipe']} | {r['rl_s']:.1f} s | {sync / r['rl_s']:.2f}x | {r['generate_s']:.1f} s "
            f"| {r['generate_calls']:.0f} | {r['weight_syncs']:.0f} | {r['staleness']:.2f} "
            f"| {100 * r['before']:.1f}% -> {100 * r['after']:.1f}% "
            f"| {100 * r['before_sampled']:.1f}% -> {100 * r['after_sampled']:.1f}% | {r['reward_last']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="examples/demo_cpu.yaml")
    p.add_argument("--backend", default="embedded", choices=("embedded", "vllm"))
    p.add_argument("--steps", type=int, default=300, help="RL steps per schedule (a multiple of 4)")
    p.add_argument("--eval-size", type=int, default=500)
    p.add_argument("--sft", nargs="*", default=[], help="extra overrides for the SFT warm start")
    p.add_argument("--override", action="append", default=[], help="extra section.field=value for every run")
    p.add_argument("--out", default=None, help="also write the table (Markdown) here")
    p.add_argument("--work-dir", default=None, help="keep the runs here (default: a temporary folder)")
    args = p.parse_args(argv)
    if args.steps % 4:
        p.error("--steps must be a multiple of 4 (staged K=4)")
    args.override.append(f"rollout.backend={args.backend}")
    if args.work_dir:
        os.makedirs(args.work_dir, exist_ok=True)
        results = measure(args, args.work_dir)
    else:
        with tempfile.TemporaryDirectory() as work:
            results = measure(args, work)
    text = table(results, args)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
