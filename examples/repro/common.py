"""What every reproduction script shares: one SFT warm start, arms run from it, a table and a plot.

A script compares *arms*: named lists of `section.field=value` overrides on the CPU demo
(examples/demo_cpu.yaml: a tiny Qwen3-MoE on reversed 3-digit addition, bf16 engine vs fp32 trainer).

    1. `warm_start(...)`: the demo's SFT warm start, made once and shared by every script (cached in
       runs/repro/sft, keyed on the demo config's bytes); every arm starts RL from its checkpoint,
       so arms differ only in what they set.
    2. `run_arm(out, ckpt, arm, seed, steps)`: one `pretrain_rl.py` process. Logs go to
       <out>/runs/<arm>/seed<k>/ (metrics.jsonl, TensorBoard), so `tensorboard --logdir <out>/runs`
       shows every arm of a script side by side.
    3. `curve`, `mean_curve`, `write_report`, `plot_panels`: per-step series, averaged over seeds,
       a Markdown table and a matplotlib PNG.

`--quick` (the e2e tier) checks that the script still runs end to end, not the claim: every arm's
configuration is loaded and checked in this process the way pretrain_rl.py does it (`check_arms`:
a renamed field, recipe or value fails here, naming the arm), and only the script's `QUICK` arms,
the ones whose code paths differ most, run, for a few steps with one seed and a small held-out set.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = "examples/demo_cpu.yaml"
QUIET = ["log.progress=false", "log.figure_every=0"]


@dataclass(frozen=True)
class Scale:
    """How big a script's runs are: full (the claim) or quick (the e2e smoke run)."""

    steps: int
    seeds: tuple[int, ...]
    eval_size: int
    eval_every: int
    sft: tuple[str, ...] = ()
    jobs: int = 1  # arm runs at a time, each with cores // jobs threads
    quick: bool = False  # run only the script's QUICK arms; check every arm's config (run_arms)


def parse_args(description: str, steps: int, seeds: int = 2,
               more: Callable[[argparse.ArgumentParser], None] | None = None) -> tuple[argparse.Namespace, Scale]:
    """The command line every script shares (`more` adds a script's own options) and its Scale."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    if more is not None:
        more(p)
    p.add_argument("--out", default=None, help="output folder (default: runs/repro/<script>)")
    p.add_argument("--steps", type=int, default=steps, help=f"RL steps per arm (default {steps})")
    p.add_argument("--seeds", type=int, default=seeds, help=f"seeds per arm (default {seeds})")
    p.add_argument("--quick", action="store_true", help="checks the script runs, not the claim: every arm's config "
                                                        "is checked, a few arms run a few steps with one seed")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time, each with (CPU cores / jobs) threads "
                                                       "(default 2: on 2 cores, two one-thread runs finish sooner "
                                                       "than two two-thread runs in a row)")
    p.add_argument("--sft-dir", default=None, help="where the shared SFT warm start is made and cached "
                                                   "(default: runs/repro/sft; with --quick: <out>/sft)")
    args = p.parse_args()
    name = os.path.splitext(os.path.basename(sys.argv[0]))[0]
    args.out = os.path.abspath(args.out or os.path.join(ROOT, "runs", "repro", name))
    args.sft_dir = os.path.abspath(args.sft_dir or (os.path.join(args.out, "sft") if args.quick
                                                    else os.path.join(ROOT, "runs", "repro", "sft")))
    if args.quick:
        # a 16-problem SFT that stops at once: the arms then run from a barely trained model
        scale = Scale(steps=2, seeds=(0,), eval_size=16, eval_every=0,
                      sft=("sft.steps=2", "sft.batch_size=16", "sft.eval_every=0", "data.heldout_size=16"),
                      jobs=args.jobs, quick=True)
    else:
        scale = Scale(steps=args.steps, seeds=tuple(range(args.seeds)), eval_size=500, eval_every=max(args.steps // 4, 1),
                      jobs=args.jobs)
    return args, scale


def _pretrain(run_dir: str, overrides: list[str], jobs: int = 1) -> dict:
    """One pretrain_rl.py process on CONFIG (with CPU cores // jobs threads); returns its summary.
    Raises with the stderr tail on failure."""
    os.makedirs(run_dir, exist_ok=True)
    summary_path = os.path.join(run_dir, "summary.json")
    cmd = [sys.executable, "pretrain_rl.py", "--config", CONFIG, f"train.run_dir={run_dir}",
           "--summary-json", summary_path, *QUIET, *overrides]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    if jobs > 1:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // jobs))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"run failed: {' '.join(overrides)}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    with open(summary_path) as f:
        return json.load(f)


def warm_start(sft_dir: str, scale: Scale) -> str:
    """The SFT checkpoint every arm starts from, made in `sft_dir` unless a checkpoint made there from
    the same demo config and overrides exists."""
    with open(os.path.join(ROOT, CONFIG), "rb") as f:
        key = {"config_sha1": hashlib.sha1(f.read()).hexdigest(), "overrides": list(scale.sft)}
    cache = os.path.join(sft_dir, "warm_start.json")
    if os.path.exists(cache):
        with open(cache) as f:
            cached = json.load(f)
        if cached["key"] == key and os.path.isdir(cached["checkpoint"]):
            print(f"SFT warm start: reusing {cached['checkpoint']}", flush=True)
            return cached["checkpoint"]
    t0 = time.perf_counter()
    summary = _pretrain(sft_dir, ["train.steps=0", "train.resume=false", *scale.sft])
    print(f"SFT warm start: {summary['sft']['steps']} steps, held-out greedy "
          f"{100 * summary['sft']['heldout_accuracy']:.1f}%, {time.perf_counter() - t0:.0f} s", flush=True)
    with open(cache, "w") as f:
        json.dump({"key": key, "checkpoint": summary["sft"]["checkpoint"]}, f)
    return summary["sft"]["checkpoint"]


@dataclass
class ArmRun:
    """One arm x seed: its summary and its RL metrics rows (metrics.jsonl, phase rl)."""

    arm: str
    seed: int
    summary: dict
    rows: list[dict]
    seconds: float


def _arm_command(out: str, checkpoint: str, arm: str, overrides: list[str], seed: int,
                 scale: Scale) -> tuple[str, list[str]]:
    """(run folder, pretrain_rl.py overrides) of one arm x seed."""
    run_dir = os.path.join(out, "runs", arm.replace(" ", "_").replace("/", "-"), f"seed{seed}")
    cmd = [f"train.init_checkpoint={checkpoint}", "sft.steps=0", "train.resume=false",
           f"train.steps={scale.steps}", f"train.seed={1234 + seed}",
           f"train.eval_size={scale.eval_size}", f"train.eval_every={scale.eval_every}",
           *([f"data.heldout_size={scale.eval_size}"] if scale.eval_size < 500 else []), *overrides]
    return run_dir, cmd


def run_arm(out: str, checkpoint: str, arm: str, overrides: list[str], seed: int, scale: Scale) -> ArmRun:
    """RL from the warm start with `overrides`; seed k sets train.seed (sampling). data.seed stays,
    so every arm and seed sees the same prompts and is scored on the same held-out problems.

    A run that already finished in its folder with the same command is read back instead of run
    again, so an interrupted script resumes at the first unfinished arm, and a second call only
    rebuilds the table and the plot."""
    run_dir, cmd = _arm_command(out, checkpoint, arm, overrides, seed, scale)
    done = os.path.join(run_dir, "arm.json")
    if os.path.exists(done):
        with open(done) as f:
            record = json.load(f)
        if record["overrides"] == cmd:
            with open(os.path.join(run_dir, "summary.json")) as f:
                summary = json.load(f)
            return ArmRun(arm, seed, summary, _rl_rows(run_dir), record["seconds"])
    t0 = time.perf_counter()
    summary = _pretrain(run_dir, cmd, scale.jobs)
    seconds = time.perf_counter() - t0
    with open(done, "w") as f:  # written last: its presence means the run finished
        json.dump({"overrides": cmd, "seconds": seconds}, f)
    after = summary.get("after_rl_accuracy")
    print(f"  {arm} seed {seed}: held-out greedy "
          f"{'n/a' if after is None else f'{100 * after:.1f}%'}, {seconds:.0f} s", flush=True)
    return ArmRun(arm, seed, summary, _rl_rows(run_dir), seconds)


def _rl_rows(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r.get("phase") == "rl"]


def check_arms(out: str, checkpoint: str, arms: dict[str, list[str]], scale: Scale) -> None:
    """Every arm x seed's command through the product's own config loading and checks, as
    pretrain_rl.py runs them at start-up (load_config, check_layout on one rank, check_paths), in
    this process: an arm whose overrides no longer load or validate stops the script, naming it."""
    if ROOT not in sys.path:  # this checkout's package, as _pretrain's processes get it (PYTHONPATH)
        sys.path.insert(0, ROOT)
    from megatron_rl.config import ConfigError
    from megatron_rl.configure import load_config

    for arm, overrides in arms.items():
        for seed in scale.seeds:
            run_dir, cmd = _arm_command(out, checkpoint, arm, overrides, seed, scale)
            try:
                cfg = load_config(os.path.join(ROOT, CONFIG), [f"train.run_dir={run_dir}", *QUIET, *cmd])
                cfg.check_layout(1)
                cfg.check_paths()
            except (ConfigError, ValueError, OSError) as e:
                raise SystemExit(f"arm {arm!r}: config error: {e}") from None


def run_arms(out: str, checkpoint: str, arms: dict[str, list[str]], scale: Scale,
             quick: tuple[str, ...] = ()) -> dict[str, list[ArmRun]]:
    """Every arm x every seed, `scale.jobs` processes at a time; arm -> its runs (seed order).

    With --quick (scale.quick), every arm's config is checked in this process (check_arms) and only
    the arms named in `quick` run (all of them if `quick` is empty)."""
    from concurrent.futures import ThreadPoolExecutor

    if scale.quick:
        check_arms(out, checkpoint, arms, scale)
        missing = [a for a in quick if a not in arms]
        if missing:
            raise SystemExit(f"--quick arms {missing} are not arms of this script: {list(arms)}")
        run = [a for a in arms if a in quick] if quick else list(arms)
        print(f"--quick: checked the config of {len(arms)} arms; running {len(run)}: {', '.join(run)}", flush=True)
        arms = {a: arms[a] for a in run}
    with ThreadPoolExecutor(max_workers=scale.jobs) as pool:  # threads only wait on the processes
        futures = {arm: [pool.submit(run_arm, out, checkpoint, arm, overrides, seed, scale) for seed in scale.seeds]
                   for arm, overrides in arms.items()}
        return {arm: [f.result() for f in fs] for arm, fs in futures.items()}


# ----------------------------------------------------------------------------- series and summaries


def curve(run: ArmRun, key: str) -> list[tuple[int, float]]:
    """(step, value) for every RL row that has `key`; held-out accuracy also gets step 0 (before RL)."""
    points = [(r["step"], r[key]) for r in run.rows if key in r]
    before = {"eval/heldout_accuracy": "before_rl_accuracy",
              "eval/heldout_sampled_accuracy": "before_rl_sampled_accuracy"}.get(key)
    if before and run.summary.get(before) is not None:
        points.insert(0, (0, run.summary[before]))
    return points


def mean_curve(runs: list[ArmRun], key: str) -> list[tuple[int, float]]:
    """Per step, the mean over the seeds that logged it."""
    by_step: dict[int, list[float]] = {}
    for run in runs:
        for step, v in curve(run, key):
            by_step.setdefault(step, []).append(v)
    return [(s, sum(v) / len(v)) for s, v in sorted(by_step.items())]


def mean(values) -> float:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else math.nan


def final(runs: list[ArmRun], key: str = "after_rl_accuracy") -> tuple[float, list[float]]:
    """Mean over seeds of a summary value, and the per-seed values."""
    values = [r.summary.get(key) for r in runs]
    return mean(values), values


def peak(runs: list[ArmRun], key: str = "eval/heldout_accuracy") -> float:
    """Mean over seeds of the best value of `key` seen during the run (before RL included)."""
    return mean(max((v for _, v in curve(r, key)), default=math.nan) for r in runs)


def collapsed(run: ArmRun, drop: float = 0.5) -> bool:
    """The run ended at less than `drop` x its starting held-out accuracy (the lr-collapse signature)."""
    before, after = run.summary.get("before_rl_accuracy"), run.summary.get("after_rl_accuracy")
    return before is not None and after is not None and after < drop * before


def series_mean(runs: list[ArmRun], key: str) -> float:
    """Mean over seeds of each run's mean of metric `key` over its steps."""
    return mean(mean(v for _, v in curve(r, key)) for r in runs)


def pct(x: float) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{100 * x:.1f}%"


ACCURACY_HEADER = ["arm", "greedy before", "greedy after (mean)", "per seed", "peak"]


def accuracy_cells(arm: str, runs: list[ArmRun]) -> list[str]:
    """The first cells of every script's table row (ACCURACY_HEADER): held-out greedy accuracy."""
    after, per_seed = final(runs)
    return [arm, pct(final(runs, "before_rl_accuracy")[0]), pct(after), " / ".join(pct(v) for v in per_seed),
            pct(peak(runs))]


def collapsed_cell(runs: list[ArmRun]) -> str:
    return f"{sum(collapsed(r) for r in runs)}/{len(runs)}"


# ----------------------------------------------------------------------------- report


def write_report(out: str, title: str, header: list[str], rows: list[list[str]], notes: list[str]) -> str:
    """<out>/results.md: title, the machine and date, a Markdown table, notes. Also printed."""
    command = " ".join(sys.argv[1:]) or "(defaults)"
    lines = [f"# {title}", "", f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU cores, `{command}`.", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", *notes]
    text = "\n".join(lines) + "\n"
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(text)
    print("\n" + text, flush=True)
    return text


def plot_panels(out: str, panels: list[tuple[str, str, dict[str, list[ArmRun]]]], name: str = "curves.png") -> str:
    """One subplot per (title, metric key, arm -> runs): the seed-mean curve of each arm. Returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on a server
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, (title, key, arms) in zip(axes[0], panels):
        ax.set_prop_cycle(color=plt.cm.tab20.colors)  # up to 20 arms in distinct colours
        for arm, runs in arms.items():
            points = mean_curve(runs, key)
            if points:
                ax.plot(*zip(*points), label=arm, marker="." if len(points) < 20 else None)
        ax.set_title(title)
        ax.set_xlabel("RL step")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}; TensorBoard: tensorboard --logdir {os.path.join(out, 'runs')}", flush=True)
    return path
