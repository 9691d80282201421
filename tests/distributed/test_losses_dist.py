"""Policy losses on 2 gloo ranks vs the single-rank computation.

- data parallel: rows split over ranks, global counts / P3O ESS all-reduced once; the sum of the ranks'
  losses and each rank's gradient equal the full-batch values;
- context parallel: every row's tokens split zig-zag over the ranks (2·CP chunks, rank r holds chunks
  r and 2·CP−1−r) with global `positions`, per-sequence reductions through CPSeqOps; same checks,
  plus metrics (num/den sums) and mismatch sums.
"""
import numpy as np
import torch
import torch.distributed as dist

from megatron_rl.losses import (
    LOCAL,
    CPSeqOps,
    PolicyBatch,
    compute_policy_loss,
    ess_from_stats,
    local_counts,
    p3o_ess_stats,
)
from megatron_rl.losses.aggregation import GlobalCounts
from megatron_rl.metrics import mismatch as mm
from megatron_rl.metrics.reduce import finish, reduce_metrics
from tests.spawn import run_ranks

CONFIGS = [
    ("ppo_clip", {"eps_high": 0.28, "dual_clip": 3.0}, [("tis_token", {})], "token_mean", {}),
    ("ppo_clip", {}, [("mis_token", {"C": 1.5}), ("icepop", {"alpha": 0.8, "beta": 1.3})], "seq_mean_token_mean", {}),
    ("minirl", {}, [("kpop", {})], "token_sum_norm", {"l_norm": 8}),
    ("cispo", {}, [("tis_seq", {}), ("mis_seq", {"C": 3.0})], "token_mean", {}),
    ("reinforce", {}, [("mis_geo", {"lo": 0.8, "hi": 1.2})], "seq_mean_token_mean", {}),
    ("gspo", {"eps_low": 0.05, "eps_high": 0.07}, [("opsm", {"delta": 0.02})], "seq_mean_token_mean", {}),
    ("gspo_token", {"eps_low": 0.05, "eps_high": 0.07}, [("veto", {"tau": 0.6})], "seq_mean_token_mean", {}),
    ("p3o", {}, [("nav", {"kappa": 1.3, "nav_scope": "suffix"})], "token_mean", {}),
    ("mu_grpo", {}, [("nav", {"kappa": 1.3})], "seq_mean_token_mean", {}),
    ("ppo_clip", {}, [("nav", {"kappa": 1.3, "nav_scope": "trigger_only"})], "token_mean", {}),
    ("ppo_clip", {}, [("nav", {"kappa": 1.3, "nav_scope": "sequence"})], "token_mean", {}),
]


def _data(seed: int, B: int = 6, T: int = 8) -> dict:
    rng = np.random.default_rng(seed)
    lengths = np.array([T, 0, 3, T - 1, 5, 1])[:B]  # right padding, one empty row
    m = np.arange(T)[None, :] < lengths[:, None]
    old = -rng.exponential(1.5, (B, T)) - 1e-3
    ro = np.minimum(old + rng.normal(0, 0.4, (B, T)), -1e-4)
    lp = old + rng.normal(0, 0.4, (B, T))
    A = np.repeat(np.array([-1.0, 0.5, -0.7, 1.2, -1.5, 0.3])[:B, None], T, axis=1)
    return {k: torch.tensor(v, dtype=torch.float32) for k, v in {"lp": lp, "old": old, "ro": ro, "A": A}.items()} | {
        "m": torch.tensor(m)}


def _run(d, rows, cols, seq, positions, cfg, reduce_group):
    """Loss/grad/metrics of the shard d[rows][:, cols] with global counts and ESS all-reduced."""
    surrogate, sparams, corrections, aggregation, agg_params = cfg
    lp = d["lp"][rows][:, cols].clone().requires_grad_()
    sl = {k: d[k][rows][:, cols] for k in ("old", "ro", "A", "m")}
    batch = PolicyBatch(lp, sl["old"], sl["ro"], sl["A"], sl["m"], seq=seq, positions=positions)
    c = local_counts(batch.loss_mask, seq)
    stats = p3o_ess_stats(lp, batch.old_logprobs, batch.loss_mask)
    flat = torch.stack([c.num_tokens, c.num_seqs, *stats])
    if reduce_group:
        dist.all_reduce(flat)
    sparams = dict(sparams)
    if surrogate == "p3o":
        sparams["ess"] = ess_from_stats(flat[2], flat[3], flat[4])
    loss, metrics = compute_policy_loss(batch, surrogate, sparams, corrections, aggregation, agg_params,
                                        normaliser=GlobalCounts(flat[0], flat[1]))
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, metrics


def _check_shard(rank, d, rows, cols, seq, positions, cfg):
    full_loss, full_grad, full_metrics = _run(d, slice(None), slice(None), LOCAL, None, cfg, reduce_group=False)
    loss, grad, metrics = _run(d, rows, cols, seq, positions, cfg, reduce_group=True)
    total = loss.clone()
    dist.all_reduce(total)
    torch.testing.assert_close(total, full_loss, rtol=1e-5, atol=1e-6, msg=f"{cfg} loss")
    torch.testing.assert_close(grad, full_grad[rows][:, cols], rtol=1e-5, atol=1e-7, msg=f"{cfg} grad")
    keys = sorted(metrics)
    assert keys == sorted(full_metrics), (keys, sorted(full_metrics))
    # finished over ranks == finished on one rank (a global value such as p3o/ess is a mean of copies)
    got, want = finish(reduce_metrics(metrics)), finish(full_metrics)
    assert got.keys() == want.keys()
    torch.testing.assert_close(torch.tensor([got[k] for k in sorted(got)], dtype=torch.float64),
                               torch.tensor([want[k] for k in sorted(got)], dtype=torch.float64),
                               rtol=1e-9, atol=1e-7, msg=f"{cfg} metrics")
    return float(total)


def dp_worker(rank, world_size, seeds):
    rows = slice(rank * 3, rank * 3 + 3)
    return [_check_shard(rank, _data(seed), rows, slice(None), LOCAL, None, cfg) for seed in seeds for cfg in CONFIGS]


def _zigzag_cols(rank, world_size, T):
    chunk = T // (2 * world_size)
    idx = [*range(rank * chunk, (rank + 1) * chunk),
           *range((2 * world_size - 1 - rank) * chunk, (2 * world_size - rank) * chunk)]
    return torch.tensor(idx)


def cp_worker(rank, world_size, seeds):
    d = _data(seeds[0])
    cols = _zigzag_cols(rank, world_size, d["lp"].shape[1])
    positions = cols.expand(d["lp"].shape[0], -1)
    seq = CPSeqOps(group=None)
    out = [_check_shard(rank, _data(seed), slice(None), cols, seq, positions, cfg) for seed in seeds for cfg in CONFIGS]
    # CPSeqOps contract against LocalSeqOps
    x = d["lp"].clone().requires_grad_()
    s = seq.sum(x[:, cols])
    (g,) = torch.autograd.grad((s * torch.arange(1.0, 7.0)).sum() / world_size, x)
    torch.testing.assert_close(s, x.sum(-1))
    torch.testing.assert_close(g[:, cols], torch.arange(1.0, 7.0)[:, None].expand(6, len(cols)))
    torch.testing.assert_close(seq.min(d["lp"][:, cols]), d["lp"].amin(-1))
    torch.testing.assert_close(seq.max(d["lp"][:, cols]), d["lp"].amax(-1))
    # mismatch sums: CP shards all-reduced == single rank
    kw = {"logprobs": d["lp"], "turn_ids": (torch.arange(8) >= 5).long().expand(6, 8)}
    full = finish(mm.mismatch_sums(d["old"], d["ro"], d["m"], **kw))
    local = mm.mismatch_sums(d["old"][:, cols], d["ro"][:, cols], d["m"][:, cols], seq=seq,
                             **{k: v[:, cols] for k, v in kw.items()})
    got = finish(reduce_metrics(local))
    assert got.keys() == full.keys()
    for k in full:
        assert abs(got[k] - full[k]) <= 1e-9 + 1e-9 * abs(full[k]), (k, got[k], full[k])
    return out


def test_losses_data_parallel_matches_single_rank():
    r0, r1 = run_ranks(dp_worker, world_size=2, timeout=120, seeds=(3, 5))  # seeds where every correction fires
    assert r0 == r1


def test_losses_context_parallel_matches_single_rank():
    r0, r1 = run_ranks(cp_worker, world_size=2, timeout=120, seeds=(5, 3))
    assert r0 == r1
