"""Claim 4, training-inference mismatch (TIM): KL(μ‖π) is largest on tokens the rollout engine gave a
low probability μ, it grows over training, and a too-large learning rate feeds it until training
collapses. Which rollout corrections prevent the collapse (TIS, MIS, IcePop, KPop, OPSM)? And how
much mismatch does each precision recipe leave?

    .venv/bin/python examples/repro/tim.py            # full: every arm, 2 seeds
    .venv/bin/python examples/repro/tim.py --quick    # every arm's config checked, QUICK arms 2 steps (e2e tier)

Part A (lr collapse; every arm GRPO with a bf16 engine against an fp32 trainer):
    lr 1e-4              the demo's learning rate, the reference
    lr 1e-3 <correction> ten times larger, with none | tis | mis | icepop | kpop | opsm
Part B (precision): each recipe for a few steps from the same checkpoint: KL k3 and |Δlog p| at the
    first step (same weights and prompts for every recipe: the numerics alone).
Writes <out>/results.md, <out>/curves.png (A), <out>/buckets.png (KL by μ bucket, start vs end of
the uncorrected lr 1e-3 run), TensorBoard under <out>/runs.
"""
from __future__ import annotations

import dataclasses
import os

import common as c

HIGH_LR = "optim.lr=1.0e-3"
COLLAPSE = {
    "lr 1e-4": ["loss.recipe=grpo"],
    "lr 1e-3": ["loss.recipe=grpo", HIGH_LR],
    "lr 1e-3 TIS": ["loss.recipe=tis", HIGH_LR],
    "lr 1e-3 MIS": ["loss.recipe=mis", HIGH_LR],
    "lr 1e-3 IcePop": ["loss.recipe=icepop", HIGH_LR],
    "lr 1e-3 KPop": ["loss.recipe=kpop", HIGH_LR],
    "lr 1e-3 OPSM": ["loss.recipe=grpo", "loss.corrections=[{name: opsm}]", HIGH_LR],
}
PRECISION = {f"precision {r}": [f"precision.recipe={r}", "model.dtype=null", "rollout.dtype=null"]
             for r in ("fp32", "bf16", "fp16", "bf16_fp32head", "fp16_fp32head")}
PRECISION_STEPS = 5
# --quick runs these (the others' configs are only checked): the uncorrected lr 1e-3 run (the buckets
# plot's) and the precision recipe that changes most, fp16 in both engines with an fp32 head (every
# correction recipe runs through the RL step in tests/e2e/test_golden.py)
QUICK = ("lr 1e-3",)
QUICK_PRECISION = ("precision fp16_fp32head",)


def buckets(run: c.ArmRun, row: dict) -> dict[str, float]:
    """μ bucket -> KL k3 of one metrics row."""
    return {k.split("/")[2]: v for k, v in row.items() if k.startswith("mismatch/bucket/") and k.endswith("/kl_k3")}


def plot_buckets(out: str, run: c.ArmRun) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first, last = buckets(run, run.rows[0]), buckets(run, run.rows[-1])
    names = sorted(set(first) | set(last), key=lambda b: float(b.split("-")[0]))
    fig, ax = plt.subplots(figsize=(7, 4))
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [first.get(n, 0.0) for n in names], width=0.4, label=f"step {run.rows[0]['step']}")
    ax.bar([i + 0.2 for i in x], [last.get(n, 0.0) for n in names], width=0.4, label=f"step {run.rows[-1]['step']}")
    ax.set_xticks(list(x), names, rotation=30, fontsize=8)
    ax.set_yscale("log")
    ax.set_xlabel("rollout probability μ bucket")
    ax.set_ylabel("KL(μ‖π) k3")
    ax.set_title(f"mismatch by μ: {run.arm}, seed {run.seed}")
    ax.legend()
    fig.tight_layout()
    path = os.path.join(out, "buckets.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    args, scale = c.parse_args(__doc__, steps=48, seeds=2)
    ckpt = c.warm_start(args.sft_dir, scale)
    runs = c.run_arms(args.out, ckpt, COLLAPSE, scale, quick=QUICK)
    short = dataclasses.replace(scale, steps=min(PRECISION_STEPS, scale.steps), seeds=scale.seeds[:1], eval_size=0,
                                eval_every=0)
    precision = c.run_arms(args.out, ckpt, PRECISION, short, quick=QUICK_PRECISION)
    rows = []
    for arm, rs in runs.items():
        kl_first = c.mean(r.rows[0].get("mismatch/kl_k3") for r in rs)
        kl_last = c.mean(r.rows[-1].get("mismatch/kl_k3") for r in rs)
        rows.append([*c.accuracy_cells(arm, rs), f"{kl_first:.2e} → {kl_last:.2e}",
                     f"{c.series_mean(rs, 'mismatch/kl_k3'):.2e}", f"{c.series_mean(rs, 'optim/grad_norm'):.3g}",
                     c.collapsed_cell(rs)])
    notes = [(f"Part A: {scale.steps} RL steps per arm from one SFT checkpoint, seeds {list(scale.seeds)}; "
              "KL = engine-vs-trainer KL k3 (first → last step, and mean); collapsed = ended below half its "
              "starting greedy accuracy."), "",
             f"Part B: precision recipes, step 1 (same weights and prompts), then the mean over {short.steps} steps:",
             "",
             "| recipe | KL k3 step 1 | mean \\|Δlog p\\| step 1 | KL k3 mean |", "|---|---|---|---|"]
    for arm, rs in precision.items():
        r = rs[0]
        notes.append(f"| {arm.split()[1]} | {r.rows[0].get('mismatch/kl_k3', float('nan')):.2e} | "
                     f"{r.rows[0].get('mismatch/abs_logprob_diff', float('nan')):.2e} | "
                     f"{c.series_mean([r], 'mismatch/kl_k3'):.2e} |")
    c.write_report(args.out, "Training-inference mismatch: where it is, how it grows, what stops the lr collapse",
                   [*c.ACCURACY_HEADER, "KL first → last", "KL mean", "grad norm mean", "collapsed"], rows, notes)
    c.plot_panels(args.out, [("held-out greedy", "eval/heldout_accuracy", runs),
                             ("engine-vs-trainer KL k3", "mismatch/kl_k3", runs),
                             ("sampled reward", "rollout/reward_mean", runs)])
    plot_buckets(args.out, runs["lr 1e-3"][0])


if __name__ == "__main__":
    main()
