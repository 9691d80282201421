"""Fused log-probs under TP=2 (vocab-parallel) and CP=2 (zig-zag) vs the single-rank computation
(TP also for `fused_token_loss`, the gradients-in-the-forward variant).

Every rank builds the same full problem from a seed, takes its TP vocab shard or CP token shard,
and returns outputs and gradients; the parent compares them with the straightforward
full-logits computation on one rank (fp32, atol 1e-5). The TP=1×CP=1 case is the unit suite.
"""
from __future__ import annotations

import torch

from megatron_rl.logprobs import next_token_labels, reference_logprobs_and_entropy
from tests.spawn import run_ranks

ATOL = 1e-5
H, V = 16, 98                     # V divisible by TP=2
LENGTHS = [8, 4, 12, 20]          # packed sequences, multiples of 2*CP = 4


def _problem():
    """Packed batch: tokens, cu_seqlens, shifted labels, hidden, weight, kept sets, loss weights."""
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist())
    t = int(cu[-1])
    tokens = torch.randint(0, V, (t,), generator=g)
    labels = next_token_labels(tokens, cu)
    h = torch.randn(t, H, generator=g)
    w = torch.randn(V, H, generator=g) * 0.5
    mix = torch.randn(H, H, generator=g) / H**0.5
    kept = torch.full((t, 5), -1)
    for i, y in enumerate(labels.tolist()):
        ids = torch.randperm(V, generator=g)[: 1 + i % 5]
        if y >= 0 and y not in ids.tolist():
            ids[0] = y
        kept[i, : ids.numel()] = ids
    grads = [torch.randn(t, generator=g) for _ in range(3)]
    return {"cu": cu, "tokens": tokens, "labels": labels, "h": h, "w": w, "mix": mix, "kept": kept,
            "grads": grads}


def _weighted(out, grads):
    return sum((o * g).sum() for o, g in zip(out, grads))


def _reference(tied: bool):
    p = _problem()
    w = p["w"].clone().requires_grad_()
    mix = p["mix"].clone().requires_grad_()
    h = torch.tanh(w[p["tokens"]] @ mix) if tied else p["h"].clone().requires_grad_()
    out = reference_logprobs_and_entropy(h, w, p["labels"], kept_ids=p["kept"])
    _weighted(out, p["grads"]).backward()
    return [o.detach() for o in out], (mix.grad if tied else h.grad), w.grad


# ---------------------------------------------------------------- TP = 2, CP = 1
def _tp_worker(rank, world_size):
    return {tied: _tp_case(rank, world_size, tied) for tied in (False, True)}


def _tp_case(rank, world_size, tied):
    import torch.distributed as dist
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
    )

    from megatron_rl.logprobs import token_logprobs_and_entropy
    from megatron_rl.logprobs.loss_fused import fused_token_loss

    tp = dist.new_group(list(range(world_size)))
    p = _problem()
    rows = V // world_size
    start = rank * rows
    results = {}
    for mode in ("reduce_grad_input", "megatron_copy", "loss_fused", "loss_fused_reduce"):
        w = p["w"][start:start + rows].clone().requires_grad_()
        mix = p["mix"].clone().requires_grad_()
        if tied:   # vocab-parallel embedding lookup (megatron: masked local lookup + TP all-reduce)
            here = (p["tokens"] >= start) & (p["tokens"] < start + rows)
            local = (p["tokens"] - start).clamp(0, rows - 1)
            emb = reduce_from_tensor_model_parallel_region(w[local] * here[:, None], group=tp)
            h = torch.tanh(emb @ mix)
            leaf = mix
        else:
            h = leaf = p["h"].clone().requires_grad_()
        if mode in ("megatron_copy", "loss_fused"):
            h = copy_to_tensor_model_parallel_region(h, group=tp)
        if mode.startswith("loss_fused"):   # the same weighted sum as a token-local loss, its gradients in the forward
            g = p["grads"]
            loss, out = fused_token_loss(
                h, w, p["labels"], lambda r, lp, ent, kp, g=g: (lp * g[0][r] + ent * g[1][r] + kp * g[2][r]).sum(),
                tp_group=tp, kept_ids=p["kept"], chunk_size=7, reduce_grad_input=mode == "loss_fused_reduce",
                kernels=None)
            loss.backward()
            results[mode] = (list(out), leaf.grad, w.grad)
            continue
        # megatron_copy also tiles the backward: blocks of 13 rows inside each rank's vocab shard
        out = token_logprobs_and_entropy(h, w, p["labels"], tp_group=tp, kept_ids=p["kept"],
                                         chunk_size=7, grad_tile=(5, 13) if mode == "megatron_copy" else None,
                                         reduce_grad_input=mode == "reduce_grad_input")
        _weighted(out, p["grads"]).backward()
        results[mode] = ([o.detach() for o in out], leaf.grad, w.grad)
    return results


def test_tp2_matches_single_rank_tied_and_untied():
    """Values identical on both TP ranks and equal to one rank's; grad of h (or, tied, of the
    layer below the embedding) complete with either TP reduction; grad of W = its row shard."""
    rows = V // 2
    results = run_ranks(_tp_worker, world_size=2, timeout=180)
    for tied in (False, True):
        ref_out, ref_dleaf, ref_dw = _reference(tied)
        for rank, res in enumerate(results):
            for mode, (out, dleaf, dw) in res[tied].items():
                where = f"rank {rank} tied={tied} {mode}"
                for a, b in zip(out, ref_out):
                    torch.testing.assert_close(a, b, atol=ATOL, rtol=0, msg=where)
                torch.testing.assert_close(dleaf, ref_dleaf, atol=ATOL, rtol=0, msg=where)
                torch.testing.assert_close(dw, ref_dw[rank * rows:(rank + 1) * rows], atol=ATOL, rtol=0,
                                           msg=where)


# ---------------------------------------------------------------- TP = 1, CP = 2
def _cp_worker(rank, world_size):
    import torch.distributed as dist

    from megatron_rl.logprobs import (
        global_positions,
        token_logprobs_and_entropy,
        zigzag_all_gather,
        zigzag_shard,
    )

    cp = dist.new_group(list(range(world_size)))
    p = _problem()
    cu = p["cu"]

    def shard(x):
        return zigzag_shard(x, rank, world_size, cu)

    # zig-zag round trip and positions
    x = torch.arange(int(cu[-1])) * 10
    round_trip = torch.equal(zigzag_all_gather(shard(x), cp, cu), x)
    starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1])
    positions_ok = torch.equal(global_positions(rank, world_size, cu), shard(torch.arange(int(cu[-1])) - starts))

    # weighted outputs: local shard only; grads of the full h (through the shard) and of W
    h = p["h"].clone().requires_grad_()
    w = p["w"].clone().requires_grad_()
    out = token_logprobs_and_entropy(shard(h), w, shard(p["labels"]), kept_ids=shard(p["kept"]), chunk_size=5)
    _weighted(out, [shard(g) for g in p["grads"]]).backward()
    gathered = [zigzag_all_gather(o.detach(), cp, cu) for o in out]
    dw = w.grad.clone()
    dist.all_reduce(dw, group=cp)        # what DDP does over the DP×CP group
    dh = h.grad.clone()
    dist.all_reduce(dh, group=cp)

    # token-sum loss: CP=2 (all-reduced) vs CP=1 on this rank, same fused function
    w2 = p["w"].clone().requires_grad_()
    token_logprobs_and_entropy(shard(p["h"]), w2, shard(p["labels"])).logprobs.sum().backward()
    dist.all_reduce(w2.grad, group=cp)
    w1 = p["w"].clone().requires_grad_()
    token_logprobs_and_entropy(p["h"], w1, p["labels"]).logprobs.sum().backward()
    token_sum_diff = (w2.grad - w1.grad).abs().max().item()
    return {"round_trip": round_trip, "positions_ok": positions_ok, "out": gathered, "dh": dh, "dw": dw,
            "token_sum_diff": token_sum_diff}


def test_cp2_matches_single_rank():
    ref_out, ref_dh, ref_dw = _reference(tied=False)
    for res in run_ranks(_cp_worker, world_size=2, timeout=180):
        assert res["round_trip"] and res["positions_ok"]
        for a, b in zip(res["out"], ref_out):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
        torch.testing.assert_close(res["dh"], ref_dh, atol=ATOL, rtol=0)
        torch.testing.assert_close(res["dw"], ref_dw, atol=ATOL, rtol=0)
        assert res["token_sum_diff"] < ATOL
