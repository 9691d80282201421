"""Claim 3, P3O ("Trust the batch"): the batch's normalised effective sample size (ESS) of the
policy ratios r = π_θ/π_old can replace a fixed clip range: it matches or beats the best of a
sweep of fixed ranges (the paper: GRPO with ε in {0.2, 0.4, 0.6}), with no range to tune.

    .venv/bin/python examples/repro/p3o.py            # full: every arm, 2 seeds
    .venv/bin/python examples/repro/p3o.py --quick    # every arm's config checked, QUICK arms 2 steps (e2e tier)

Every arm takes 4 optimizer steps per rollout batch (train.num_minibatches=4), so r moves away
from 1 on the later mini-batches, which is where a trust region acts. (Not asynchronous rollouts:
there the staleness is in μ, while π_old is recomputed by the trainer, so r and its ESS do not see
it; the paper's async runs use the behaviour policy as π_old.)
    P3O (ESS)            recipe p3o: ESS-capped score-function weight + ESS-weighted regulariser
    clip ε=0.2|0.4|0.6   PPO clip, symmetric range (the paper's GRPO sweep)
    no clip              PPO's ratio-weighted objective without clipping (ε = 1e+9)
Writes <out>/results.md, <out>/curves.png, TensorBoard under <out>/runs.
"""
from __future__ import annotations

import common as c

OFF_POLICY = ["train.num_minibatches=4"]
ARMS = {"P3O (ESS)": ["loss.recipe=p3o", *OFF_POLICY]}
for eps in (0.2, 0.4, 0.6):  # the paper's GRPO sweep
    ARMS[f"clip ε={eps}"] = ["loss.recipe=grpo", f"loss.surrogate_params={{eps_low: {eps}, eps_high: {eps}}}", *OFF_POLICY]
ARMS["no clip"] = ["loss.recipe=grpo", "loss.surrogate_params={eps_low: 1.0e+9, eps_high: 1.0e+9}", *OFF_POLICY]
# --quick runs this arm (the others' configs are only checked): P3O's ESS-weighted loss (the fixed
# ranges and "no clip" are GRPO's clip with other numbers, the demo's path)
QUICK = ("P3O (ESS)",)


def main() -> None:
    args, scale = c.parse_args(__doc__, steps=48, seeds=2)
    ckpt = c.warm_start(args.sft_dir, scale)
    runs = c.run_arms(args.out, ckpt, ARMS, scale, quick=QUICK)
    rows = [[*c.accuracy_cells(arm, rs), f"{c.series_mean(rs, 'mismatch/r/ess'):.3f}", c.collapsed_cell(rs)]
            for arm, rs in runs.items()]
    c.write_report(args.out, "P3O: ESS-adaptive trust region vs fixed clip ranges (4 optimizer steps per batch)",
                   [*c.ACCURACY_HEADER, "mean ESS of r", "collapsed"], rows,
                   [(f"{scale.steps} RL steps per arm from one SFT checkpoint, seeds {list(scale.seeds)}; "
                     "ESS of r = π_θ/π_old per batch (1 = on-policy); collapsed = ended below half its "
                     "starting greedy accuracy.")])
    c.plot_panels(args.out, [("held-out greedy", "eval/heldout_accuracy", runs),
                             ("sampled reward", "rollout/reward_mean", runs),
                             ("ESS of π_θ/π_old", "mismatch/r/ess", runs)])


if __name__ == "__main__":
    main()
