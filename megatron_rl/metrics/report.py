"""Human-readable mismatch views: the bucket table (text) and its TensorBoard figure, and the
per-turn tables of multi-turn runs (mismatch, the environment's reward, and MoE routing agreement).

The bucket table answers "where does the engine disagree with the trainer?": tokens bucketed by
the rollout probability μ_t, with the count, mean |log π_old − log μ| and the k3 KL per bucket.
The turn table asks the same by policy turn (later turns sit on longer contexts and on
environment text the policy never produced).
"""
from __future__ import annotations

from collections.abc import Callable

from megatron_rl.metrics.mismatch import bucket_labels, turn_labels

COLUMNS = ("count", "abs_diff", "kl_k3")
TURN_COLUMNS = ("tokens", "abs_logprob_diff", "kl_k3")

Row = tuple[str, float, float, float]


def _rows(metrics: dict[str, float], prefix: str, labels: list[str], columns: tuple[str, ...]) -> list[Row]:
    return [(label, *(float(metrics[f"{prefix}/{label}/{c}"]) for c in columns)) for label in labels
            if f"{prefix}/{label}/{columns[0]}" in metrics]


def bucket_rows(metrics: dict[str, float]) -> list[Row]:
    """(bucket label, count, mean |Δ|, k3) for every μ bucket present in a finished metrics dict."""
    return _rows(metrics, "mismatch/bucket", bucket_labels(), COLUMNS)


def turn_rows(metrics: dict[str, float]) -> list[Row]:
    """(turn label, tokens, mean |Δ|, k3) for every policy-turn bucket present (multi-turn runs)."""
    return _rows(metrics, "mismatch/turn", turn_labels(), TURN_COLUMNS)


def _merge(history: list[dict[str, float]], rows_of: Callable[[dict], list[Row]], labels: list[str]) -> list[Row]:
    acc: dict[str, list[float]] = {}
    for metrics in history:
        for label, count, absd, k3 in rows_of(metrics):
            a = acc.setdefault(label, [0.0, 0.0, 0.0])
            a[0] += count
            a[1] += count * absd
            a[2] += count * k3
    return [(label, c, s1 / c if c else 0.0, s2 / c if c else 0.0)
            for label in labels if label in acc for c, s1, s2 in [acc[label]]]


def merge_bucket_rows(history: list[dict[str, float]]) -> list[Row]:
    """Count-weighted aggregate of the bucket table over several steps."""
    return _merge(history, bucket_rows, bucket_labels())


def merge_turn_rows(history: list[dict[str, float]]) -> list[Row]:
    """Token-weighted aggregate of the turn table over several steps."""
    return _merge(history, turn_rows, turn_labels())


def env_turn_rows(metrics: dict[str, float]) -> list[tuple[str, float, float]]:
    """(turn label, policy turns, mean environment reward) for every turn bucket present in one
    step's metrics (env/turn/{label}/{turns,reward}: rollout/multi_turn.py)."""
    return [(label, float(metrics[f"env/turn/{label}/turns"]), float(metrics[f"env/turn/{label}/reward"]))
            for label in turn_labels() if f"env/turn/{label}/turns" in metrics]


def merge_env_turn_rows(history: list[dict[str, float]]) -> list[tuple[str, float, float]]:
    """Turn-weighted aggregate of env_turn_rows over several steps: a bucket's reward is the mean
    over all its turns, Σ_steps turns·reward / Σ_steps turns."""
    acc: dict[str, list[float]] = {}
    for metrics in history:
        for label, turns, reward in env_turn_rows(metrics):
            a = acc.setdefault(label, [0.0, 0.0])
            a[0] += turns
            a[1] += turns * reward
    return [(label, c, s / c if c else 0.0) for label in turn_labels() if label in acc for c, s in [acc[label]]]


AGREEMENT = "moe/route_agree_rollout_train"


def merge_agreement_turn_rows(history: list[dict[str, float]]) -> list[tuple[str, float, float]]:
    """(turn label, trained tokens, engine-vs-trainer routing agreement) per turn bucket, over the
    steps that logged `moe/route_agree_rollout_train/turn/<t>` (R2 / R3 runs with turns). Steps are
    weighted by the bucket's trained tokens (mismatch/turn/<t>/tokens): the agreement counts those
    positions' (token, layer) pairs, so this is the pooled ratio wherever the engine routed every
    position."""
    acc: dict[str, list[float]] = {}
    for metrics in history:
        for label in turn_labels():
            key = f"{AGREEMENT}/turn/{label}"
            if key in metrics:
                tokens = float(metrics.get(f"mismatch/turn/{label}/tokens", 1.0))
                a = acc.setdefault(label, [0.0, 0.0])
                a[0] += tokens
                a[1] += tokens * float(metrics[key])
    return [(label, c, s / c if c else 0.0) for label in turn_labels() if label in acc for c, s in [acc[label]]
            if c]


def format_agreement_turn_table(rows, title: str = "MoE routing agreement (engine vs trainer) by policy turn") -> str:
    """rows: (label, tokens, agreement), as merge_agreement_turn_rows gives them."""
    lines = [title, f"{'turn':>14} {'tokens':>10} {'agreement':>13}"]
    lines += [f"{label:>14} {int(tokens):>10d} {value:>13.4f}" for label, tokens, value in rows]
    return "\n".join(lines)


def format_env_turn_table(rows, title: str = "environment reward by policy turn") -> str:
    """rows: (label, turns, mean reward), as env_turn_rows / merge_env_turn_rows give them."""
    lines = [title, f"{'turn':>14} {'turns':>10} {'mean reward':>13}"]
    lines += [f"{label:>14} {int(turns):>10d} {reward:>13.4f}" for label, turns, reward in rows]
    return "\n".join(lines)


def format_bucket_table(rows, title: str = "mismatch by rollout probability μ", first: str = "μ bucket") -> str:
    """rows: (label, tokens, mean |Δlogp|, KL k3), as bucket_rows / turn_rows give them."""
    total = sum(r[1] for r in rows) or 1.0
    lines = [title, f"{first:>14} {'tokens':>10} {'share':>7} {'mean |Δlogp|':>13} {'KL k3':>11}"]
    for label, count, absd, k3 in rows:
        lines.append(f"{label:>14} {int(count):>10d} {100 * count / total:>6.1f}% {absd:>13.3e} {k3:>11.3e}")
    return "\n".join(lines)


def bucket_figure(rows, step: int):
    """A matplotlib figure (bars: token share; line: k3 per bucket, log scale) or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    labels = [r[0] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(labels, [r[1] for r in rows], color="#9ecae1", label="tokens")
    ax.set_ylabel("tokens")
    ax.set_xlabel("rollout probability μ bucket")
    ax.tick_params(axis="x", rotation=30)
    ax2 = ax.twinx()
    ax2.plot(labels, [max(r[3], 1e-12) for r in rows], "o-", color="#d62728", label="KL k3")
    ax2.set_yscale("log")
    ax2.set_ylabel("KL k3 (log)")
    ax.set_title(f"training-inference mismatch by μ, step {step}")
    fig.tight_layout()
    return fig
