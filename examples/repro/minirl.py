"""Claim 1, MiniRL (Qwen, "Stabilizing RL with LLMs"): on a MoE policy,
  - on-policy, the training-inference IS weight is required and length normalisation hurts;
  - off-policy (N mini-batches per rollout batch), clipping is required; routing replay R2 is the
    better stabiliser at N=2 and R3 at N>=4.

    .venv/bin/python examples/repro/minirl.py            # full: every arm, 2 seeds
    .venv/bin/python examples/repro/minirl.py --quick    # every arm's config checked, QUICK arms 2 steps (e2e tier)

Arms (all recipe `minirl`: MiniRL's surrogate, token-sum aggregation, mean-centred advantages):
    on-policy            N=1
    on-policy w/o IS     N=1, c_tis=null (the IS weight ρ_t = μ/π is dropped)
    on-policy + len-norm N=1, per-sequence token mean (length normalisation)
    N=2|4 R2|R3          N optimizer steps per batch, router replay R2 (π_old's routing) or R3 (μ's)
    ... no clip          the same without MiniRL's clip mask (eps_low=1, eps_high=1e+9)
Writes <out>/results.md, <out>/curves.png, TensorBoard under <out>/runs.
"""
from __future__ import annotations

import common as c

NO_CLIP = "loss.surrogate_params={eps_low: 1.0, eps_high: 1.0e+9}"
ARMS = {
    "on-policy": ["loss.recipe=minirl", "train.num_minibatches=1"],
    "on-policy w/o IS": ["loss.recipe=minirl", "train.num_minibatches=1", "loss.surrogate_params={c_tis: null}"],
    "on-policy + len-norm": ["loss.recipe=minirl", "train.num_minibatches=1", "loss.aggregation=seq_mean_token_mean"],
}
for n in (2, 4):
    for replay in ("r2", "r3"):
        base = [f"loss.recipe=minirl_{replay}", f"train.num_minibatches={n}"]
        ARMS[f"N={n} {replay.upper()}"] = base
        ARMS[f"N={n} {replay.upper()} no clip"] = [*base, NO_CLIP]
# --quick runs this arm (the others' configs are only checked): the one furthest from the demo's path,
# with R3 (the engine's routing replayed), 4 optimizer steps per batch and the clip mask removed
# (R2 and the one-mini-batch path run in tests/distributed/test_replay_in_loop.py and every demo run)
QUICK = ("N=4 R3 no clip",)


def main() -> None:
    args, scale = c.parse_args(__doc__, steps=48, seeds=2)
    ckpt = c.warm_start(args.sft_dir, scale)
    runs = c.run_arms(args.out, ckpt, ARMS, scale, quick=QUICK)
    rows = [[*c.accuracy_cells(arm, rs), c.pct(c.final(rs, "after_rl_sampled_accuracy")[0]),
             f"{c.series_mean(rs, 'mismatch/kl_k3'):.2e}", c.collapsed_cell(rs)] for arm, rs in runs.items()]
    c.write_report(args.out, "MiniRL: IS correction, length normalisation, clipping, R2 vs R3",
                   [*c.ACCURACY_HEADER, "sampled after", "KL(μ‖π) k3 mean", "collapsed"], rows,
                   [(f"{scale.steps} RL steps per arm from one SFT checkpoint, seeds {list(scale.seeds)}; "
                     "collapsed = ended below half its starting greedy accuracy.")])
    c.plot_panels(args.out, [
        ("on-policy", "eval/heldout_accuracy", {a: runs[a] for a in runs if a.startswith("on-policy")}),
        ("N=2", "eval/heldout_accuracy", {a: runs[a] for a in runs if a.startswith("N=2")}),
        ("N=4", "eval/heldout_accuracy", {a: runs[a] for a in runs if a.startswith("N=4")}),
        ("sampled reward", "rollout/reward_mean", runs)])


if __name__ == "__main__":
    main()
