"""Policy losses as pure tensor functions, in three orthogonal parts plus advantages:

- surrogates (`surrogates.py`): per-token ℓ_t — ppo_clip, mu_grpo, reinforce, cispo, gspo, gspo_token,
  minirl, p3o (+ p3o_ess_stats / ess_from_stats for the global ESS);
- rollout corrections (`corrections.py`, `corrections_seq.py`): weight c_t and keep mask — tis_token,
  tis_seq, mis_token, mis_seq, mis_geo, veto, icepop, kpop, opsm, nav;
- aggregation (`aggregation.py`): token_mean, seq_mean_token_mean, token_sum_norm, always with a
  GLOBAL normaliser passed in;
- advantages (`advantages.py`): grpo, mean_centered, rloo, zero_variance_groups;
- per-step statistics (`step_stats.py`): values of the current policy over the optimizer step that a
  surrogate declares as parameters (P3O's ESS), computed by the trainer for every surrogate alike.

`compute_policy_loss` (`policy_loss.py`) composes them; `seqops.py` makes per-sequence reductions
work under context parallelism. The math is specified in docs/algorithms.md; each function's docstring
has its formula.
"""

from megatron_rl.losses.advantages import (
    ADVANTAGES,
    AdvantageSpec,
    get_advantage,
    grpo,
    mean_centered,
    register_advantage,
    rloo,
    zero_variance_groups,
)
from megatron_rl.losses.aggregation import (
    AGGREGATIONS,
    AggregationSpec,
    GlobalCounts,
    aggregate,
    get_aggregation,
    local_counts,
    register_aggregation,
    required_counts,
    seq_mean_token_mean,
    token_mean,
    token_sum_norm,
)
from megatron_rl.losses.corrections import (
    CORRECTIONS,
    CorrectionSpec,
    apply_corrections,
    binary_kl,
    get_correction,
    icepop,
    kpop,
    mis_token,
    register_correction,
    tis_token,
)
from megatron_rl.losses.corrections_seq import NAV_SCOPES, mis_geo, mis_seq, nav, opsm, tis_seq, veto
from megatron_rl.losses.policy_loss import (
    RECIPES,
    LossRecipe,
    compute_policy_loss,
    get_recipe,
    keep_sampling_mask,
    register_recipe,
)
from megatron_rl.losses.seqops import LOCAL, CPSeqOps, LocalSeqOps, SeqOps
from megatron_rl.losses.step_stats import STEP_STATISTICS, StepStatistic, register_step_statistic
from megatron_rl.losses.surrogates import (
    SURROGATES,
    SurrogateSpec,
    cispo,
    ess_from_stats,
    get_surrogate,
    gspo,
    gspo_token,
    minirl,
    mu_grpo,
    p3o,
    p3o_ess_stats,
    ppo_clip,
    register_surrogate,
    reinforce,
)
from megatron_rl.losses.types import Correction, PolicyBatch, SurrogateOut, masked_log_ratio

__all__ = [
    "ADVANTAGES",
    "AGGREGATIONS",
    "CORRECTIONS",
    "LOCAL",
    "NAV_SCOPES",
    "RECIPES",
    "STEP_STATISTICS",
    "SURROGATES",
    "AdvantageSpec",
    "AggregationSpec",
    "CPSeqOps",
    "Correction",
    "CorrectionSpec",
    "GlobalCounts",
    "LocalSeqOps",
    "LossRecipe",
    "PolicyBatch",
    "SeqOps",
    "StepStatistic",
    "SurrogateOut",
    "SurrogateSpec",
    "aggregate",
    "apply_corrections",
    "binary_kl",
    "cispo",
    "compute_policy_loss",
    "ess_from_stats",
    "get_advantage",
    "get_aggregation",
    "get_correction",
    "get_recipe",
    "get_surrogate",
    "grpo",
    "gspo",
    "gspo_token",
    "icepop",
    "keep_sampling_mask",
    "kpop",
    "local_counts",
    "masked_log_ratio",
    "mean_centered",
    "minirl",
    "mis_geo",
    "mis_seq",
    "mis_token",
    "mu_grpo",
    "nav",
    "opsm",
    "p3o",
    "p3o_ess_stats",
    "ppo_clip",
    "register_advantage",
    "register_aggregation",
    "register_correction",
    "register_recipe",
    "register_step_statistic",
    "register_surrogate",
    "reinforce",
    "required_counts",
    "rloo",
    "seq_mean_token_mean",
    "tis_seq",
    "tis_token",
    "token_mean",
    "token_sum_norm",
    "veto",
    "zero_variance_groups",
]
