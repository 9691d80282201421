"""Independent, deliberately naive reference implementations (Python floats, explicit loops).

Written from the specification (docs/algorithms.md) without looking at megatron_rl.losses; inputs are
nested lists [B][T] (masks as bools). Each surrogate reference returns (per_token_loss, d loss_t / d logprob_t) where the
derivative is analytic (score-function forms) — gspo returns per-sequence values instead.

Float64 throughout, with the spec's rule for terms of weight 0 (docs/algorithms.md#zero-weight-terms):
such a term is 0 with derivative 0 whatever its ratio, also where the ratio overflows (`_exp` gives inf
past float64's range instead of raising). `policy_loss` composes surrogate × corrections × aggregation.
"""
from __future__ import annotations

import math


def _clip(x, lo, hi):
    return max(lo, min(hi, x))


def _exp(x):
    """math.exp, but inf past float64's range (math.exp raises there)."""
    return math.exp(x) if x < 709.0 else (x if math.isnan(x) else math.inf)


def _clip_term(r, a, eps_low, eps_high, dual=None):
    """(−min(r a, clip(r) a) [dual-capped], its derivative by log r); (0, 0) for a = 0."""
    if a == 0:
        return 0.0, 0.0
    un, cl = r * a, _clip(r, 1 - eps_low, 1 + eps_high) * a
    if un <= cl:
        val, g = -un, -r * a           # d(-r a)/d lp = -r a
    else:
        val, g = -cl, 0.0 if (r > 1 + eps_high or r < 1 - eps_low) else -r * a
    if dual is not None and a < 0 and val > -dual * a:
        val, g = -dual * a, 0.0
    return val, g


def ppo_clip(lp, old, A, m, eps_low, eps_high, dual=None):
    loss, grad = [], []
    for i in range(len(lp)):
        lrow, grow = [], []
        for t in range(len(lp[i])):
            if not m[i][t]:
                lrow.append(0.0), grow.append(0.0)
                continue
            val, g = _clip_term(_exp(lp[i][t] - old[i][t]), A[i][t], eps_low, eps_high, dual)
            lrow.append(val), grow.append(g)
        loss.append(lrow), grad.append(grow)
    return loss, grad


def reinforce(lp, ro, A, m):
    live = [[m[i][t] and A[i][t] != 0 for t in range(len(lp[i]))] for i in range(len(lp))]
    loss = [[-_exp(lp[i][t] - ro[i][t]) * A[i][t] * lp[i][t] if live[i][t] else 0.0
             for t in range(len(lp[i]))] for i in range(len(lp))]
    grad = [[-_exp(lp[i][t] - ro[i][t]) * A[i][t] if live[i][t] else 0.0
             for t in range(len(lp[i]))] for i in range(len(lp))]
    return loss, grad


def cispo(lp, old, A, m, eps_low, eps_high):
    loss, grad = [], []
    for i in range(len(lp)):
        loss.append([]), grad.append([])
        for t in range(len(lp[i])):
            if not m[i][t] or A[i][t] == 0:
                loss[i].append(0.0), grad[i].append(0.0)
                continue
            c = _clip(_exp(lp[i][t] - old[i][t]), 1 - eps_low, 1 + eps_high)
            loss[i].append(-c * A[i][t] * lp[i][t]), grad[i].append(-c * A[i][t])
    return loss, grad


def minirl(lp, old, ro, A, m, eps_low, eps_high, c_tis):
    loss, grad = [], []
    for i in range(len(lp)):
        loss.append([]), grad.append([])
        for t in range(len(lp[i])):
            a = A[i][t]
            r = _exp(lp[i][t] - old[i][t]) if m[i][t] else 1.0
            masked_out = (a > 0 and r > 1 + eps_high) or (a < 0 and r < 1 - eps_low)
            if not m[i][t] or masked_out or a == 0:
                loss[i].append(0.0), grad[i].append(0.0)
                continue
            c = min(_exp(lp[i][t] - ro[i][t]), c_tis) if c_tis is not None else 1.0
            loss[i].append(-c * a * lp[i][t]), grad[i].append(-c * a)
    return loss, grad


def ess(lp, old, m):
    rs = [_exp(lp[i][t] - old[i][t]) for i in range(len(lp)) for t in range(len(lp[i])) if m[i][t]]
    if not rs:
        return 1.0
    return sum(rs) ** 2 / (len(rs) * sum(r * r for r in rs))


def p3o(lp, old, A, m, e):
    loss, grad = [], []
    for i in range(len(lp)):
        loss.append([]), grad.append([])
        for t in range(len(lp[i])):
            if not m[i][t]:
                loss[i].append(0.0), grad[i].append(0.0)
                continue
            c = min(_exp(lp[i][t] - old[i][t]), e)
            d = old[i][t] - lp[i][t]
            val, g = -c * A[i][t] * lp[i][t], -c * A[i][t]
            if e != 1:  # k3's weight 1 - ESS
                val, g = val + (1 - e) * (_exp(d) - d - 1), g + (1 - e) * (1 - _exp(d))
            loss[i].append(val), grad[i].append(g)
    return loss, grad


def gspo(lp, old, A, m, eps_low, eps_high):
    """Per-sequence (loss_i, d loss_i / d lp_t for each t, s_i)."""
    out = []
    for i in range(len(lp)):
        idx = [t for t in range(len(lp[i])) if m[i][t]]
        if not idx:
            out.append((0.0, [0.0] * len(lp[i]), 1.0))
            continue
        n = len(idx)
        s = _exp(sum(lp[i][t] - old[i][t] for t in idx) / n)
        val, g = _clip_term(s, A[i][idx[0]], eps_low, eps_high)
        out.append((val, [g / n if m[i][t] else 0.0 for t in range(len(lp[i]))], s))
    return out


# ----------------------------------------------------------------------------- corrections


def _seq_logw(old, ro, m, i):
    return sum(old[i][t] - ro[i][t] for t in range(len(old[i])) if m[i][t])


def tis_token(old, ro, m, C, lp=None):
    src = lp if lp is not None else old
    return [[min(_exp(src[i][t] - ro[i][t]), C) if m[i][t] else 1.0 for t in range(len(old[i]))]
            for i in range(len(old))]


def tis_seq(old, ro, m, C):
    return [[min(_exp(_seq_logw(old, ro, m, i)), C) if m[i][t] else 1.0 for t in range(len(old[i]))]
            for i in range(len(old))]


def mis_token(old, ro, m, C):
    keep = [[(not m[i][t]) or (1 / C <= _exp(old[i][t] - ro[i][t]) <= C) for t in range(len(old[i]))]
            for i in range(len(old))]
    weight = [[(_exp(old[i][t] - ro[i][t]) if keep[i][t] else 0.0) if m[i][t] else 1.0
               for t in range(len(old[i]))] for i in range(len(old))]
    return weight, keep


def mis_seq(old, ro, m, C):
    weight, keep = [], []
    for i in range(len(old)):
        W = _exp(_seq_logw(old, ro, m, i))
        k = W <= C
        keep.append([k or not m[i][t] for t in range(len(old[i]))])
        weight.append([(W if k else 0.0) if m[i][t] else 1.0 for t in range(len(old[i]))])
    return weight, keep


def mis_geo(old, ro, m, lo, hi):
    keep = []
    for i in range(len(old)):
        n = sum(1 for t in range(len(old[i])) if m[i][t])
        g = _exp(_seq_logw(old, ro, m, i) / n) if n else 1.0
        keep.append([(lo <= g <= hi) or not m[i][t] for t in range(len(old[i]))])
    return keep


def veto(old, ro, m, tau):
    keep = []
    for i in range(len(old)):
        bad = any(m[i][t] and _exp(old[i][t] - ro[i][t]) < tau for t in range(len(old[i])))
        keep.append([not (bad and m[i][t]) for t in range(len(old[i]))])
    return keep


def icepop(old, ro, m, alpha, beta):
    return [[(not m[i][t]) or alpha <= _exp(old[i][t] - ro[i][t]) <= beta for t in range(len(old[i]))]
            for i in range(len(old))]


def binary_kl(p, q):
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))


def kpop(src, ro, m, phi):
    keep = []
    for i in range(len(src)):
        row = []
        for t in range(len(src[i])):
            if not m[i][t]:
                row.append(True)
                continue
            p = _clip(_exp(src[i][t]), 1e-12, 1 - 1e-7)
            q = _clip(_exp(ro[i][t]), 1e-12, 1 - 1e-7)
            row.append(binary_kl(p, q) <= phi and binary_kl(q, p) <= phi)
        keep.append(row)
    return keep


def opsm(lp, ro, A, m, delta):
    keep = []
    for i in range(len(lp)):
        idx = [t for t in range(len(lp[i])) if m[i][t]]
        drop = bool(idx) and A[i][idx[0]] < 0 and sum(ro[i][t] - lp[i][t] for t in idx) / len(idx) > delta
        keep.append([not (drop and m[i][t]) for t in range(len(lp[i]))])
    return keep


def nav(lp, old, A, m, kappa, scope, positions=None):
    keep = []
    for i in range(len(lp)):
        T = len(lp[i])
        pos = positions[i] if positions is not None else list(range(T))
        idx = [t for t in range(T) if m[i][t]]
        neg = bool(idx) and A[i][idx[0]] < 0
        trig = {t for t in idx if neg and _exp(lp[i][t] - old[i][t]) > kappa}
        row = [True] * T
        if trig:
            first = min(pos[t] for t in trig)
            for t in idx:
                if scope == "suffix":
                    drop = t not in trig and pos[t] > first
                elif scope == "from_trigger":
                    drop = pos[t] >= first
                elif scope == "trigger_only":
                    drop = t in trig
                else:
                    drop = True
                row[t] = not drop
        keep.append(row)
    return keep


# ----------------------------------------------------------------------------- aggregation, advantages


def token_mean(x, m, n):
    return sum(x[i][t] for i in range(len(x)) for t in range(len(x[i])) if m[i][t]) / n


def seq_mean_token_mean(x, m, n_seq):
    total = 0.0
    for i in range(len(x)):
        idx = [t for t in range(len(x[i])) if m[i][t]]
        if idx:
            total += sum(x[i][t] for t in idx) / len(idx)
    return total / n_seq


def token_sum_norm(x, m, n_seq, l_norm):
    return sum(x[i][t] for i in range(len(x)) for t in range(len(x[i])) if m[i][t]) / (n_seq * l_norm)


def grpo_adv(R, eps):
    out = []
    for g in R:
        mu = sum(g) / len(g)
        sd = math.sqrt(sum((r - mu) ** 2 for r in g) / len(g))
        out.append([(r - mu) / (sd + eps) for r in g])
    return out


def rloo_adv(R):
    return [[r - (sum(g) - r) / (len(g) - 1) for r in g] for g in R]


# ----------------------------------------------------------------------------- composition


CORRECTION_DEFAULTS = {"tis_token": {"C": 2.0}, "mis_token": {"C": 2.0}, "icepop": {"alpha": 0.5, "beta": 5.0},
                       "kpop": {"phi": 0.01}, "tis_seq": {"C": 2.0}, "mis_seq": {"C": 2.0},
                       "mis_geo": {"lo": 0.999, "hi": 1.001}, "veto": {"tau": 1e-4}, "opsm": {"delta": 1e-3},
                       "nav": {"kappa": 2.0, "scope": "from_trigger"}}
SURROGATE_DEFAULTS = {"ppo_clip": {"eps_low": 0.2, "eps_high": 0.2, "dual_clip": None},
                      "mu_grpo": {"eps_low": 1.0, "eps_high": 4.0, "dual_clip": None},
                      "cispo": {"eps_low": 1.0, "eps_high": 0.28}, "gspo": {"eps_low": 3e-4, "eps_high": 4e-4},
                      "gspo_token": {"eps_low": 3e-4, "eps_high": 4e-4},
                      "minirl": {"eps_low": 0.2, "eps_high": 0.27, "c_tis": 5.0}}


def correction(name, params, lp, old, ro, A, m):
    """(weight c [B][T], keep [B][T]) of one correction with the default parameters of the spec."""
    p = {**CORRECTION_DEFAULTS[name], **params}
    ones = [[1.0] * len(row) for row in m]
    if name in ("tis_token", "tis_seq"):
        return (tis_token(old, ro, m, p["C"]) if name == "tis_token" else tis_seq(old, ro, m, p["C"])), None
    if name in ("mis_token", "mis_seq"):
        return (mis_token if name == "mis_token" else mis_seq)(old, ro, m, p["C"])
    keep = {"icepop": lambda: icepop(old, ro, m, p["alpha"], p["beta"]),
            "kpop": lambda: kpop(old, ro, m, p["phi"]),
            "mis_geo": lambda: mis_geo(old, ro, m, p["lo"], p["hi"]),
            "veto": lambda: veto(old, ro, m, p["tau"]),
            "opsm": lambda: opsm(lp, ro, A, m, p["delta"]),
            "nav": lambda: nav(lp, old, A, m, p["kappa"], p["scope"])}[name]()
    return ones, keep


def _aggregation_weights(aggregation, params, m):
    """a_t with loss = Σ_t a_t ℓ'_t, the counts being this batch's."""
    lengths = [sum(1 for x in row if x) for row in m]
    n_tok, n_seq = max(sum(lengths), 1), max(sum(1 for n in lengths if n), 1)
    if aggregation == "token_mean":
        return [[1.0 / n_tok] * len(row) for row in m]
    if aggregation == "seq_mean_token_mean":
        return [[1.0 / (n_seq * max(n, 1))] * len(row) for row, n in zip(m, lengths, strict=True)]
    return [[1.0 / (n_seq * params["l_norm"])] * len(row) for row in m]  # token_sum_norm


def policy_loss(surrogate, sparams, corrections, aggregation, agg_params, lp, old, ro, A, m):
    """(a_t ℓ'_t [B][T], d loss / d lp [B][T]) of surrogate × corrections × aggregation: the loss is
    the sum of the first (kept per token, so a test can scale its tolerance by Σ |a_t ℓ'_t|).

    ℓ'_t = Π c_t · 1(∧ keep_t) · ℓ_t; a term whose weight is 0 (dropped, or c_t = 0) is 0 and adds no
    derivative. GSPO's ℓ_t reads s_i, so its derivative reaches every valid token of the response.
    sparams: the surrogate's parameters, as the library names them (p3o: {"ess": value}).
    """
    B = len(lp)
    weight = [[1.0] * len(row) for row in m]
    keep = [[True] * len(row) for row in m]
    for name, params in corrections:
        c, k = correction(name, params, lp, old, ro, A, m)
        weight = [[w * x for w, x in zip(wr, cr, strict=True)] for wr, cr in zip(weight, c, strict=True)]
        if k is not None:
            keep = [[a and b for a, b in zip(kr, r, strict=True)] for kr, r in zip(keep, k, strict=True)]
    agg = _aggregation_weights(aggregation, agg_params, m)
    coef = [[agg[i][t] * weight[i][t] if m[i][t] and keep[i][t] and weight[i][t] != 0 else None
             for t in range(len(lp[i]))] for i in range(B)]  # None: the term is not weighted
    loss = [[0.0] * len(row) for row in lp]
    grad = [[0.0] * len(row) for row in lp]
    p = {**SURROGATE_DEFAULTS.get(surrogate, {}), **sparams}
    if surrogate in ("gspo", "gspo_token"):
        for i in range(B):
            idx = [t for t in range(len(lp[i])) if m[i][t]]
            if not idx:
                continue
            s = _exp(sum(lp[i][t] - old[i][t] for t in idx) / len(idx))
            total = 0.0
            for t in idx:
                if coef[i][t] is None:
                    continue
                val, g = _clip_term(s, A[i][t], p["eps_low"], p["eps_high"])
                loss[i][t] = coef[i][t] * val
                if surrogate == "gspo":
                    total += coef[i][t] * g
                else:
                    grad[i][t] = coef[i][t] * g
            if surrogate == "gspo":
                for t in idx:
                    grad[i][t] = total / len(idx)
        return loss, grad
    name = "ppo_clip" if surrogate == "mu_grpo" else surrogate
    terms, derivs = {
        "ppo_clip": lambda: ppo_clip(lp, old, A, m, p["eps_low"], p["eps_high"], p["dual_clip"]),
        "reinforce": lambda: reinforce(lp, ro, A, m),
        "cispo": lambda: cispo(lp, old, A, m, p["eps_low"], p["eps_high"]),
        "minirl": lambda: minirl(lp, old, ro, A, m, p["eps_low"], p["eps_high"], p["c_tis"]),
        "p3o": lambda: p3o(lp, old, A, m, p["ess"]),
    }[name]()
    for i in range(B):
        for t in range(len(lp[i])):
            if coef[i][t] is not None:
                loss[i][t] = coef[i][t] * terms[i][t]
                grad[i][t] = coef[i][t] * derivs[i][t]
    return loss, grad
