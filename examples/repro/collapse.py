"""Claims 1a, 4b and 4c under a large mismatch: does an FP8 rollout engine make RL degrade or collapse
where an fp32 engine at the same learning rate does not, and which correction prevents it?

    .venv/bin/python examples/repro/collapse.py            # every arm at lr 3e-4 fp8_block, 3 seeds, 24 steps
    .venv/bin/python examples/repro/collapse.py --search   # the search for a setting, then every arm there
    .venv/bin/python examples/repro/collapse.py --setting "lr 1e-4 fp8_tensor"   # every arm at another setting
    .venv/bin/python examples/repro/collapse.py --quick    # every config checked, QUICK arms 2 steps (e2e tier)

Every arm starts from the same SFT warm start of the CPU demo (a tiny Qwen3-MoE on reversed
3-digit addition) and trains the same fp32 trainer with the same task, learning rate and seeds;
only the rollout engine and the correction differ:

    fp32 engine           rollout.dtype=fp32: no mismatch beyond kernel order (the control)
    bf16 engine           the demo's engine (a small mismatch, for scale)
    fp8 engine            rollout.quantization=<format> (weights quantized at every sync,
                          activations at every GEMM input; precision/fp8.py), uncorrected GRPO
    fp8 + token TIS       loss.recipe=tis (truncated token IS weight)
    fp8 + sequence MIS    loss.recipe=mis (sequence-level masked IS)
    fp8 + IcePop          loss.recipe=icepop (tokens outside the ratio band masked)
    fp8 + MiniRL          loss.recipe=minirl (MiniRL's IS-weighted surrogate)
    fp8 + R3              moe.router_replay=r3 (the engine's expert routing replayed in training)

A setting is a learning rate and an FP8 format. --search runs the control and the uncorrected FP8
arm for every setting of SEARCH (a cheap pass: two arms), picks the setting where the FP8 arm's
held-out accuracy gains least against the control's (the control itself must not collapse, so
the step size is ruled out as the cause), and runs every arm there. The held-out greedy accuracy is
measured through each arm's own engine, so an arm is judged by its change over RL (after − before,
both through the same engine), not by its level.

Verdicts (results.md): the FP8 arm *degrades* when its mean gain is at least DEGRADE points below
the control's and below it in every seed, *collapses* when a seed ends below half its starting
accuracy; a cure *prevents* it when its mean gain is within DEGRADE / 2 of the control's and no
seed collapses. The mismatch pattern of the uncorrected FP8 arm: KL(μ‖π) by μ bucket at the first
and last step (buckets.png: largest as μ → 0?), KL's growth over training (last / first), and its
correlation with the policy's entropy over steps (Pearson, per seed).
Writes <out>/results.md, <out>/search.md, <out>/curves.png, <out>/buckets.png, TensorBoard under <out>/runs.
"""
from __future__ import annotations

import math
import os

import common as c
from tim import buckets, plot_buckets

SEARCH = [f"lr {lr} {fmt}" for lr in ("1e-4", "3e-4") for fmt in ("fp8_tensor", "fp8_block", "mxfp8")]
DEFAULT_SETTING = "lr 3e-4 fp8_block"  # where the search found FP8 furthest below the control (README)
DEGRADE = 0.10  # 10 points of held-out accuracy
CURES = {
    "fp8 + token TIS": ["loss.recipe=tis"],
    "fp8 + sequence MIS": ["loss.recipe=mis"],
    "fp8 + IcePop": ["loss.recipe=icepop"],
    "fp8 + MiniRL": ["loss.recipe=minirl"],
    "fp8 + R3": ["loss.recipe=grpo", "moe.router_replay=r3"],
}
# --quick runs these (the others' configs are only checked): the control and the uncorrected FP8
# engine are the experiment's two sides; every cure's recipe runs in tests/e2e/test_golden.py
QUICK = ("fp32 engine", "fp8 engine")


def parse_setting(setting: str) -> tuple[str, str]:
    """"lr 3e-4 fp8_block" -> ("3e-4", "fp8_block")."""
    parts = setting.split()
    if len(parts) != 3 or parts[0] != "lr" or parts[2] not in ("fp8_tensor", "fp8_block", "mxfp8"):
        raise SystemExit(f"--setting {setting!r}: write 'lr <rate> <fp8_tensor|fp8_block|mxfp8>', e.g. {DEFAULT_SETTING!r}")
    return parts[1], parts[2]


def arms(setting: str, every: bool = True) -> dict[str, list[str]]:
    """The arms at `setting` (the control and the uncorrected FP8 arm only, with every=False)."""
    lr, fmt = parse_setting(setting)
    base = [f"optim.lr={lr}"]
    fp8 = [*base, "rollout.dtype=bf16", f"rollout.quantization={fmt}"]
    out = {"fp32 engine": [*base, "rollout.dtype=fp32", "loss.recipe=grpo"],
           "fp8 engine": [*fp8, "loss.recipe=grpo"]}
    if every:
        out["bf16 engine"] = [*base, "rollout.dtype=bf16", "loss.recipe=grpo"]
        out.update({arm: [*fp8, *extra] for arm, extra in CURES.items()})
    return out


def gains(runs: list[c.ArmRun]) -> list[float]:
    """Per seed: held-out greedy accuracy after RL minus before (through the arm's own engine)."""
    return [r.summary["after_rl_accuracy"] - r.summary["before_rl_accuracy"] for r in runs
            if r.summary.get("after_rl_accuracy") is not None and r.summary.get("before_rl_accuracy") is not None]


def verdict(arm: str, runs: list[c.ArmRun], control: list[c.ArmRun]) -> str:
    mine, ref = gains(runs), gains(control)
    if not mine or not ref:
        return "n/a"
    gap = c.mean(ref) - c.mean(mine)
    collapsed = sum(c.collapsed(r) for r in runs)
    if arm == "fp32 engine":
        return "control" + (f", {collapsed} seed(s) collapsed: the step size alone collapses" if collapsed else "")
    if collapsed:
        return f"collapses ({collapsed}/{len(runs)} seeds)"
    if gap >= DEGRADE and all(m < r for m, r in zip(mine, ref)):
        return f"degrades ({100 * gap:.1f} points below the control)"
    if gap <= DEGRADE / 2:
        return f"holds ({-100 * gap:+.1f} points vs the control's gain)"
    return f"between ({100 * gap:.1f} points below the control)"


def pearson(xs: list[float], ys: list[float]) -> float:
    pairs = [(x, y) for x, y in zip(xs, ys) if math.isfinite(x) and math.isfinite(y)]
    if len(pairs) < 3:
        return math.nan
    mx, my = sum(x for x, _ in pairs) / len(pairs), sum(y for _, y in pairs) / len(pairs)
    sxy = sum((x - mx) * (y - my) for x, y in pairs)
    sxx, syy = sum((x - mx) ** 2 for x, _ in pairs), sum((y - my) ** 2 for _, y in pairs)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else math.nan


def pattern(runs: list[c.ArmRun]) -> list[str]:
    """The mismatch pattern of one arm's runs, as report lines."""
    lines = []
    for r in runs:
        kl = [row.get("mismatch/kl_k3", math.nan) for row in r.rows]
        entropy = [row.get("mismatch/entropy", math.nan) for row in r.rows]
        first, last = buckets(r, r.rows[0]), buckets(r, r.rows[-1])
        low = min(first, key=lambda b: float(b.split("-")[0]), default=None)
        high = max(first, key=lambda b: float(b.split("-")[0]), default=None)
        lines.append(f"- seed {r.seed}: KL k3 {kl[0]:.2e} → {kl[-1]:.2e} (× {kl[-1] / kl[0]:.2f}); "
                     f"by μ bucket at step 1: {low} {first.get(low, math.nan):.2e} vs {high} "
                     f"{first.get(high, math.nan):.2e}, at the last step {low} {last.get(low, math.nan):.2e}; "
                     f"Pearson(KL, entropy) over steps {pearson(kl, entropy):+.2f}")
    return lines


def table(runs: dict[str, list[c.ArmRun]]) -> list[list[str]]:
    control = runs["fp32 engine"]
    return [[*c.accuracy_cells(arm, rs), " / ".join(f"{100 * g:+.1f}" for g in gains(rs)),
             f"{c.series_mean(rs, 'mismatch/kl_k3'):.2e}", f"{c.series_mean(rs, 'mismatch/entropy'):.3f}",
             c.collapsed_cell(rs), verdict(arm, rs, control)] for arm, rs in runs.items()]


HEADER = [*c.ACCURACY_HEADER, "gain per seed (points)", "KL k3 mean", "entropy mean", "collapsed", "verdict"]


def search(args, scale, ckpt) -> str:
    """The two-arm pass over SEARCH; writes search.md and returns the chosen setting."""
    rows, worst = [], (math.inf, DEFAULT_SETTING)
    for setting in SEARCH:
        out = os.path.join(args.out, "search", setting.replace(" ", "_"))
        runs = c.run_arms(out, ckpt, arms(setting, every=False), scale)
        ref, fp8 = gains(runs["fp32 engine"]), gains(runs["fp8 engine"])
        control_ok = not any(c.collapsed(r) for r in runs["fp32 engine"])
        edge = c.mean(fp8) - c.mean(ref)
        rows.append(f"| {setting} | {' / '.join(f'{100 * g:+.1f}' for g in ref)} | "
                    f"{' / '.join(f'{100 * g:+.1f}' for g in fp8)} | {100 * edge:+.1f} | "
                    f"{c.series_mean(runs['fp8 engine'], 'mismatch/kl_k3'):.2e} | "
                    f"{c.series_mean(runs['fp32 engine'], 'mismatch/kl_k3'):.2e} | {'yes' if control_ok else 'no'} |")
        if control_ok and edge < worst[0]:
            worst = (edge, setting)
    text = "\n".join([
        "# The search: the control and the uncorrected FP8 engine at each setting", "",
        (f"{scale.steps} RL steps, seeds {list(scale.seeds)}; gain = held-out greedy accuracy after − before RL "
         "(points, through the arm's own engine); FP8 − control = the difference of the mean gains."), "",
        "| setting | control gain | fp8 gain | fp8 − control | fp8 KL k3 mean | control KL k3 mean | control holds |",
        "|---|---|---|---|---|---|---|", *rows, "",
        f"Chosen: {worst[1]} (the FP8 arm's gain furthest below the control's where the control holds)."])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "search.md"), "w") as f:
        f.write(text + "\n")
    print(text, flush=True)
    return worst[1]


def options(p) -> None:
    p.add_argument("--search", action="store_true", help="search SEARCH's settings with the two-arm pass, then run "
                                                          "every arm at the chosen one")
    p.add_argument("--setting", default=DEFAULT_SETTING, help=f"'lr <rate> <format>' (default {DEFAULT_SETTING!r})")


def main() -> None:
    args, scale = c.parse_args(__doc__, steps=24, seeds=3, more=options)
    setting = args.setting
    parse_setting(setting)
    ckpt = c.warm_start(args.sft_dir, scale)
    if scale.quick:  # every setting's arms checked; the QUICK arms of --setting run
        for s in SEARCH:
            c.check_arms(args.out, ckpt, arms(s), scale)
    elif args.search:
        setting = search(args, scale, ckpt)
    runs = c.run_arms(args.out, ckpt, arms(setting), scale, quick=QUICK)
    notes = [(f"Setting: {setting}; {scale.steps} RL steps per arm from one SFT checkpoint, seeds {list(scale.seeds)}. "
              f"Verdicts: degrades = mean gain ≥ {100 * DEGRADE:.0f} points below the control's and below it in "
              f"every seed; collapses = a seed ends below half its starting accuracy; holds = within "
              f"{100 * DEGRADE / 2:.0f} points."), "", "Mismatch pattern of the uncorrected FP8 engine:", "",
             *pattern(runs["fp8 engine"])]
    c.write_report(args.out, "FP8 rollouts: a mismatch-driven collapse, and which correction prevents it",
                   HEADER, table(runs), notes)
    c.plot_panels(args.out, [("held-out greedy", "eval/heldout_accuracy", runs),
                             ("sampled reward", "rollout/reward_mean", runs),
                             ("engine-vs-trainer KL k3", "mismatch/kl_k3", runs),
                             ("entropy of π_old", "mismatch/entropy", runs)])
    plot_buckets(args.out, runs["fp8 engine"][0])


if __name__ == "__main__":
    main()
