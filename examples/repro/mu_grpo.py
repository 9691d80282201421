"""Claim 2, µ-GRPO ("How off-policy can GRPO be?"): with a few large stale stages (one weight sync per
stage), standard clipping plateaus, relaxed clipping alone learns early and then degrades, and relaxed
clipping + the negative-advantage veto (NAV) stays stable and matches on-policy GRPO.

    .venv/bin/python examples/repro/mu_grpo.py            # full: every arm, 2 seeds
    .venv/bin/python examples/repro/mu_grpo.py --quick    # every arm's config checked, QUICK arms 4 steps (e2e tier)

Arms (staged = train.schedule=staged, K=4 stages: each stage generates all of its steps' batches
from one set of weights β, so a batch is up to steps/4 - 1 versions stale). As in the paper, the
staged arms take the ratio against the behaviour policy, r = π_θ/β (loss.ratio_reference=rollout:
β is the engine's μ), so the clip and the veto act on the staleness:
    GRPO sync                 the low-staleness reference (a weight sync every step)
    GRPO staged               clip [0.8, 1.2] on r = π_θ/β
    relaxed clip staged       µ-GRPO's surrogate, clip [0, 5], without the veto
    µ-GRPO staged             relaxed clip + NAV (recipe mu_grpo)
    µ-GRPO staged, r vs π_old the same with this trainer's default ratio (π_old recomputed each
                              step: r starts at 1 and neither the clip nor the veto sees the staleness)
Writes <out>/results.md, <out>/curves.png, TensorBoard under <out>/runs.
"""
from __future__ import annotations

import dataclasses

import common as c

STAGED = ["train.schedule=staged", "train.stages=4"]
BEHAVIOUR = "loss.ratio_reference=rollout"
ARMS = {
    "GRPO sync": ["loss.recipe=grpo", "train.schedule=sync"],
    "GRPO staged": ["loss.recipe=grpo", BEHAVIOUR, *STAGED],
    "relaxed clip staged": ["loss.recipe=mu_grpo", "loss.corrections=[]", BEHAVIOUR, *STAGED],
    "µ-GRPO staged": ["loss.recipe=mu_grpo", BEHAVIOUR, *STAGED],
    "µ-GRPO staged, r vs π_old": ["loss.recipe=mu_grpo", *STAGED],
}
# --quick runs this arm (the others' configs are only checked): the staged schedule with the ratio
# against β and µ-GRPO's relaxed clip + veto (the sync schedule is the demo's, run everywhere)
QUICK = ("µ-GRPO staged",)


def main() -> None:
    args, scale = c.parse_args(__doc__, steps=48, seeds=2)
    if args.quick:
        scale = dataclasses.replace(scale, steps=4)  # one batch per stage
    if scale.steps % 4:
        raise SystemExit(f"--steps {scale.steps}: the staged schedule needs a multiple of 4")
    ckpt = c.warm_start(args.sft_dir, scale)
    runs = c.run_arms(args.out, ckpt, ARMS, scale, quick=QUICK)
    rows = [[*c.accuracy_cells(arm, rs), f"{c.series_mean(rs, 'schedule/staleness_mean'):.1f}",
             f"{c.series_mean(rs, 'timing/step'):.2f} s", c.collapsed_cell(rs)] for arm, rs in runs.items()]
    c.write_report(args.out, "µ-GRPO: relaxed clipping and the negative-advantage veto under stale stages",
                   [*c.ACCURACY_HEADER, "mean staleness", "time per step", "collapsed"], rows,
                   [(f"{scale.steps} RL steps per arm from one SFT checkpoint, seeds {list(scale.seeds)}; "
                     "staleness in trainer versions; collapsed = ended below half its starting greedy accuracy.")])
    c.plot_panels(args.out, [("held-out greedy", "eval/heldout_accuracy", runs),
                             ("sampled reward", "rollout/reward_mean", runs)])


if __name__ == "__main__":
    main()
