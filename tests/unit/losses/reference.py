"""Independent, deliberately naive reference implementations (Python floats, explicit loops).

Written from the specification (docs/algorithms.md) without looking at megatron_rl.losses; inputs are
nested lists [B][T] (masks as bools). Each surrogate reference returns (per_token_loss, d loss_t / d logprob_t) where the
derivative is analytic (score-function forms) — gspo returns per-sequence values instead.
"""
from __future__ import annotations

import math


def _clip(x, lo, hi):
    return max(lo, min(hi, x))


def ppo_clip(lp, old, A, m, eps_low, eps_high, dual=None):
    loss, grad = [], []
    for i in range(len(lp)):
        lrow, grow = [], []
        for t in range(len(lp[i])):
            if not m[i][t]:
                lrow.append(0.0), grow.append(0.0)
                continue
            r = math.exp(lp[i][t] - old[i][t])
            a = A[i][t]
            un, cl = r * a, _clip(r, 1 - eps_low, 1 + eps_high) * a
            if un <= cl:
                val, g = -un, -r * a           # d(-r a)/d lp = -r a
            else:
                val, g = -cl, 0.0 if (r > 1 + eps_high or r < 1 - eps_low) else -r * a
            if dual is not None and a < 0 and val > -dual * a:
                val, g = -dual * a, 0.0
            lrow.append(val), grow.append(g)
        loss.append(lrow), grad.append(grow)
    return loss, grad


def reinforce(lp, ro, A, m):
    loss = [[-math.exp(lp[i][t] - ro[i][t]) * A[i][t] * lp[i][t] if m[i][t] else 0.0
             for t in range(len(lp[i]))] for i in range(len(lp))]
    grad = [[-math.exp(lp[i][t] - ro[i][t]) * A[i][t] if m[i][t] else 0.0
             for t in range(len(lp[i]))] for i in range(len(lp))]
    return loss, grad


def cispo(lp, old, A, m, eps_low, eps_high):
    loss, grad = [], []
    for i in range(len(lp)):
        loss.append([]), grad.append([])
        for t in range(len(lp[i])):
            if not m[i][t]:
                loss[i].append(0.0), grad[i].append(0.0)
                continue
            c = _clip(math.exp(lp[i][t] - old[i][t]), 1 - eps_low, 1 + eps_high)
            loss[i].append(-c * A[i][t] * lp[i][t]), grad[i].append(-c * A[i][t])
    return loss, grad


def minirl(lp, old, ro, A, m, eps_low, eps_high, c_tis):
    loss, grad = [], []
    for i in range(len(lp)):
        loss.append([]), grad.append([])
        for t in range(len(lp[i])):
            a = A[i][t]
            r = math.exp(lp[i][t] - old[i][t]) if m[i][t] else 1.0
            masked_out = (a > 0 and r > 1 + eps_high) or (a < 0 and r < 1 - eps_low)
            if not m[i][t] or masked_out:
                loss[i].append(0.0), grad[i].append(0.0)
                continue
            c = min(math.exp(lp[i][t] - ro[i][t]), c_tis) if c_tis is not None else 1.0
            loss[i].append(-c * a * lp[i][t]), grad[i].append(-c * a)
    return loss, grad


def ess(lp, old, m):
    rs = [math.exp(lp[i][t] - old[i][t]) for i in range(len(lp)) for t in range(len(lp[i])) if m[i][t]]
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
            r = math.exp(lp[i][t] - old[i][t])
            c = min(r, e)
            d = old[i][t] - lp[i][t]
            k3 = math.exp(d) - d - 1
            loss[i].append(-c * A[i][t] * lp[i][t] + (1 - e) * k3)
            grad[i].append(-c * A[i][t] + (1 - e) * (1 - math.exp(d)))
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
        s = math.exp(sum(lp[i][t] - old[i][t] for t in idx) / n)
        a = A[i][idx[0]]
        un, cl = s * a, _clip(s, 1 - eps_low, 1 + eps_high) * a
        if un <= cl or not (s > 1 + eps_high or s < 1 - eps_low):
            val, coef = -min(un, cl), -s * a / n
        else:
            val, coef = -cl, 0.0
        out.append((val, [coef if m[i][t] else 0.0 for t in range(len(lp[i]))], s))
    return out


# ----------------------------------------------------------------------------- corrections


def _seq_logw(old, ro, m, i):
    return sum(old[i][t] - ro[i][t] for t in range(len(old[i])) if m[i][t])


def tis_token(old, ro, m, C, lp=None):
    src = lp if lp is not None else old
    return [[min(math.exp(src[i][t] - ro[i][t]), C) if m[i][t] else 1.0 for t in range(len(old[i]))]
            for i in range(len(old))]


def tis_seq(old, ro, m, C):
    return [[min(math.exp(_seq_logw(old, ro, m, i)), C) if m[i][t] else 1.0 for t in range(len(old[i]))]
            for i in range(len(old))]


def mis_token(old, ro, m, C):
    keep = [[(not m[i][t]) or (1 / C <= math.exp(old[i][t] - ro[i][t]) <= C) for t in range(len(old[i]))]
            for i in range(len(old))]
    weight = [[(math.exp(old[i][t] - ro[i][t]) if keep[i][t] else 0.0) if m[i][t] else 1.0
               for t in range(len(old[i]))] for i in range(len(old))]
    return weight, keep


def mis_seq(old, ro, m, C):
    weight, keep = [], []
    for i in range(len(old)):
        W = math.exp(_seq_logw(old, ro, m, i))
        k = W <= C
        keep.append([k or not m[i][t] for t in range(len(old[i]))])
        weight.append([(W if k else 0.0) if m[i][t] else 1.0 for t in range(len(old[i]))])
    return weight, keep


def mis_geo(old, ro, m, lo, hi):
    keep = []
    for i in range(len(old)):
        n = sum(1 for t in range(len(old[i])) if m[i][t])
        g = math.exp(_seq_logw(old, ro, m, i) / n) if n else 1.0
        keep.append([(lo <= g <= hi) or not m[i][t] for t in range(len(old[i]))])
    return keep


def veto(old, ro, m, tau):
    keep = []
    for i in range(len(old)):
        bad = any(m[i][t] and math.exp(old[i][t] - ro[i][t]) < tau for t in range(len(old[i])))
        keep.append([not (bad and m[i][t]) for t in range(len(old[i]))])
    return keep


def icepop(old, ro, m, alpha, beta):
    return [[(not m[i][t]) or alpha <= math.exp(old[i][t] - ro[i][t]) <= beta for t in range(len(old[i]))]
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
            p = _clip(math.exp(src[i][t]), 1e-12, 1 - 1e-7)
            q = _clip(math.exp(ro[i][t]), 1e-12, 1 - 1e-7)
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
        trig = {t for t in idx if neg and math.exp(lp[i][t] - old[i][t]) > kappa}
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
