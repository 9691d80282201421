"""Router replay (R2 / R3) through megatron's schedules at world size 1, TP2 (SP), EP2, TP2xEP2, PP2.

Every rank loads the same random HF model, records the live routing (R2), and checks:
- replaying the routing recorded with the same weights changes neither the loss nor the router
  gradients (R2: the first mini-batch stays on-policy);
- after the router weights are perturbed (the live routing then differs), every router's routing
  map under replay equals the recorded one in every micro-batch, also when activation
  recomputation re-runs the router in backward (PP2: 1F1B interleaves forwards and backwards),
  and the router weights still get gradients;
- R3: the world-size-1 routing, handed over in the engine's per-sample format, goes through
  megatron_rl.moe.plumbing into this layout and matches what this layout's router records itself
  (the single-rank reference), then replays exactly, padding and missing routing included; each
  rank reads only its part (RolloutRouting.rank_part: its rows and its stage's MoE layers), and
  the loss and router gradients under R3 equal the single rank's.
"""
import pytest
import torch
import torch.distributed as dist

from tests.spawn import run_ranks

BATCH, SEQ = 4, 16  # rows of SEQ + 1 tokens: SEQ input positions
LENGTHS = (17, 12, 15, 9)  # prompt + response tokens of each row (then padding)
PROMPT = 5
# engine routing per row: full record, full, none (routed_experts=None), generated tokens only
ROUTED = ("full", "full", None, "generated")

SIZES = {
    "tp2": {"tensor_model_parallel_size": 2},
    "ep2": {"expert_model_parallel_size": 2},
    "tp2ep2": {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2, "expert_tensor_parallel_size": 1},
    "pp2": {"pipeline_model_parallel_size": 2},
}


def _tokens(vocab):
    tokens = torch.randint(1, vocab, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(5))
    for i, n in enumerate(LENGTHS):
        tokens[i, n:] = 0
    return tokens


def _samples(tokens, engine_routes):
    from megatron_rl.rollout.types import Sample

    out = []
    for i, n in enumerate(LENGTHS):
        routed = engine_routes[i]
        if ROUTED[i] is None:
            routed = None
        elif ROUTED[i] == "generated":
            routed = routed[PROMPT - 1:]  # positions P-1 .. P+R-2: the ones that produced response tokens
        out.append(Sample(prompt_ids=tokens[i, :PROMPT], response_ids=tokens[i, PROMPT:n],
                          rollout_logprobs=torch.zeros(n - PROMPT), finish_reason="stop", policy_version=0,
                          routed_experts=routed))
    return out


def _to_map(idx, num_experts):
    return torch.zeros(idx.shape[0], num_experts, dtype=torch.bool).scatter(1, idx.long(), True)


def _child(rank, world, sizes, recompute=None, engine_routes=None):
    """recompute: None | "full" (whole layers) | "selective" (recompute_modules=["moe"])."""
    from megatron_rl.metrics.reduce import accumulate, finish, reduce_metrics
    from megatron_rl.model import BuildOptions, build_gpt_model, causal_mask
    from megatron_rl.model.hf_io import SafetensorsReader, load_hf_weights
    from megatron_rl.model.presets import preset_arch
    from megatron_rl.moe import (
        RolloutRouting,
        RouterReplayController,
        TokenLayout,
        live_routing_needed,
        micro_batches_for,
        replay_routing,
        replayed_token_sums,
        routing_agreement_sums,
    )
    from megatron_rl.moe.replay import moe_routers
    from megatron_rl.parallel.layout import BatchLayout
    from megatron_rl.trainer.stack import OptimSettings, forward_backward, wrap_model
    from tests.mcore_setup import random_hf_dir, setup_parallel

    groups = setup_parallel(**sizes)
    arch = preset_arch("qwen3_moe")
    path = random_hf_dir(arch, seed=0)
    RouterReplayController.forget_global_instances()
    if recompute == "selective":  # read when the MoE layers are built: set it in the config the builder makes
        import dataclasses

        from megatron_rl.model import builder

        make = builder.transformer_config
        builder.transformer_config = lambda *a, **k: dataclasses.replace(
            make(*a, **k), recompute_granularity="selective", recompute_modules=["moe"])
    model = build_gpt_model(arch, groups, BuildOptions(dtype="fp32", routing_replay=True))
    load_hf_weights(model, arch, groups, SafetensorsReader(path))
    if recompute == "full":  # read at forward time
        model.config.recompute_granularity, model.config.recompute_method = "full", "uniform"
        model.config.recompute_num_layers = 1
    ddp = wrap_model(model, OptimSettings())
    ctl = RouterReplayController(ddp)
    routers = moe_routers(ddp)
    E, K = arch.num_experts, arch.moe_topk

    tokens = _tokens(arch.vocab_size)
    rows = BatchLayout(BATCH, 1, groups.dp_size, 1).local_rows(dist.get_rank(groups.dp_group))
    local = tokens[rows]
    mbs = 2 if local.shape[0] == BATCH and groups.config.pp == 1 else 1
    slices = [slice(i, i + mbs) for i in range(0, local.shape[0], mbs)]

    def forward_step(it, m):
        b = next(it)
        out = m(b[:, :-1], torch.arange(SEQ).expand(b.shape[0], -1), causal_mask(SEQ), labels=b[:, 1:])

        def loss_func(per_token):
            loss = per_token.float().sum() / (BATCH * SEQ)
            return loss, torch.tensor(1), {"loss": loss.detach()}

        return out, loss_func

    step = ctl.wrap_forward_step(forward_step)

    def run(forward_only=False):
        outs = forward_backward(ddp, step, iter([local[sl] for sl in slices]), len(slices), SEQ, mbs,
                                forward_only=forward_only)
        loss = sum(float(o["loss"]) for o in outs) if outs else None
        return loss, [r.weight.main_grad.clone() for r in routers] if not forward_only else None

    captured = []
    for layer, r in enumerate(routers):
        r.register_forward_hook(lambda m, i, o, layer=layer: captured.append(
            (layer, m.router_replay.router_replay_action, o[1].detach().clone())))

    def maps_match(routing):
        """Every captured forward (and recompute) map == the replayed indices, micro-batch by micro-batch."""
        ok = True
        for layer in range(len(routers)):
            want = [_to_map(mb.indices[layer], E) for mb in routing]
            for action in ("replay_forward", "replay_backward"):
                got = [mp for lay, a, mp in captured if lay == layer and a is not None and a.value == action]
                if action == "replay_backward" and not recompute:
                    ok &= not got
                    continue
                ok &= len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        captured.clear()
        return ok

    out = {"layer_ids": ctl.layer_ids}
    # ---- R2: record (π_old pass), then replay with the same weights: same loss and router grads
    with ctl.record() as rec:
        run(forward_only=True)
    assert len(rec) == len(slices)
    assert all(t.shape == (SEQ * mbs // (groups.config.tp if model.config.sequence_parallel else 1), K)
               for mb in rec for t in mb.indices)
    out["loss_free"], grads_free = run()
    if groups.is_last_stage:
        total = torch.tensor(out["loss_free"], dtype=torch.float64)
        dist.all_reduce(total, group=groups.dp_group)
        out["loss_total"] = float(total)
    captured.clear()
    with ctl.replay(micro_batches_for(rec, slices, mbs)):
        out["loss_replay"], grads_replay = run()
    for a, b in zip(grads_free, grads_replay, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
    assert maps_match(rec)

    # ---- R3 plumbing: the single-rank routing in engine format -> this layout == own record. At
    # world size 1 the run's own record plays the engine (the reference of the other layouts).
    reference = engine_routes is None
    if reference:
        engine_routes = _engine_routes(rec, slices, mbs)
    layout = TokenLayout.from_groups(groups, model.config.sequence_parallel)
    # this rank's part: its rows and its stage's MoE layers, as rank 0 cuts it (trainer/scatter.py)
    routing = RolloutRouting.from_samples(_samples(tokens, engine_routes), SEQ + 1).rank_part(
        rows, layer_ids=ctl.layer_ids)
    sums = replayed_token_sums(routing)
    r3, r3_live = [], []
    for k, sl in enumerate(slices):
        sub = routing.select(sl)
        live = rec[k] if live_routing_needed(sub) else None
        mb = replay_routing(sub, layout, ctl.layer_ids, E, live=live)
        r3.append(mb)
        # padding from the own record too (not spread by local token index): the whole loss, padding
        # included, is then the single rank's
        r3_live.append(replay_routing(sub, layout, ctl.layer_ids, E, live=rec[k]))
        sums = accumulate(sums, routing_agreement_sums(rec[k].indices, mb.indices, mb.mask, ctl.layer_ids,
                                                     ctl.num_moe_layers, "route_agree_rollout_train"))
    out["r3_before"] = finish(reduce_metrics(sums))

    # ---- perturb the routers: live routing changes, replay still reproduces the record
    with torch.no_grad():  # the same perturbation of each MoE layer in every layout
        for layer_id, r in zip(ctl.layer_ids, routers, strict=True):
            g = torch.Generator().manual_seed(11 + layer_id)
            r.weight.add_(torch.randn(r.weight.shape, generator=g) * 0.5)
    with ctl.record() as rec_free:
        run(forward_only=True)
    captured.clear()
    changed = torch.zeros(2, dtype=torch.float64)
    for a, b in zip(rec, rec_free, strict=True):
        for x, y in zip(a.indices, b.indices, strict=True):
            changed += torch.tensor([(_to_map(x, E) != _to_map(y, E)).any(-1).sum(), x.shape[0]])
    dist.all_reduce(changed)
    out["changed_fraction"] = float(changed[0] / changed[1])

    # every token in a policy turn (0..4, by position and row): the probe also counts by turn
    turn_rows = ((torch.arange(SEQ)[None, :] + torch.arange(BATCH)[:, None]) % 5)[rows]
    with ctl.replay([mb.with_turns(layout.to_local(turn_rows[sl])) for mb, sl in zip(rec, slices, strict=True)],
                    probe=True) as session:
        run()
    out["maps_match"] = maps_match(rec)
    out["router_grads_nonzero"] = all(bool(r.weight.main_grad.abs().sum() > 0) for r in routers)
    out["router_grads"] = {i: r.weight.main_grad.clone() for i, r in zip(ctl.layer_ids, routers, strict=True)}
    sums = reduce_metrics(session.agreement_sums("route_agree_old_new"))
    out["probe_sums"] = {k: float(v) for k, v in sums.items()}
    out["probe"] = finish(sums)

    with ctl.replay(r3):
        run()
    out["r3_maps_match"] = maps_match(r3)
    with ctl.replay(r3_live):  # R3 with the perturbed routers: loss and router gradients vs one rank
        r3_loss, r3_grads = run()
    out["r3_router_grads"] = dict(zip(ctl.layer_ids, r3_grads, strict=True))
    if groups.is_last_stage:
        total = torch.tensor(r3_loss, dtype=torch.float64)
        dist.all_reduce(total, group=groups.dp_group)
        out["r3_loss_total"] = float(total)
    if reference:  # world size 1: export the routing in the engine's format, check row independence
        out["engine_routes"] = engine_routes
        out["row_independent"] = _row_independent(ctl, ddp, step, local, forward_backward, rec_free, mbs)
        out["refuses_plain_model"] = _refuses_plain_model(arch, groups)
    return out


def _engine_routes(rec, slices, mbs):
    """Per row `[L_i - 1, num_moe_layers, k]` int16 sorted ascending (the embedded engine's format)."""
    routes = []
    for k, sl in enumerate(slices):
        per_layer = torch.stack([t.view(SEQ, mbs, -1) for t in rec[k].indices], dim=2)  # [S, b, L, k]
        for j in range(sl.stop - sl.start):
            n = LENGTHS[sl.start + j] - 1
            routes.append(per_layer[:n, j].sort(dim=-1).values.to(torch.int16))
    return routes


def _row_independent(ctl, ddp, step, local, forward_backward, rec, mbs):
    """Row 0 alone routes like row 0 inside its micro-batch: tokens are [s, b] sequence-first."""
    with ctl.record() as alone:
        forward_backward(ddp, step, iter([local[:1]]), 1, SEQ, 1, forward_only=True)
    return all(torch.equal(a.view(SEQ, 1, -1)[:, 0].sort(-1).values, b.view(SEQ, mbs, -1)[:, 0].sort(-1).values)
               for a, b in zip(alone[0].indices, rec[0].indices, strict=True))


def _refuses_plain_model(arch, groups):
    from megatron_rl.model import BuildOptions, build_gpt_model
    from megatron_rl.moe import RouterReplayController

    try:
        RouterReplayController(build_gpt_model(arch, groups, BuildOptions(dtype="fp32")))
    except ValueError as e:
        return "routing_replay=True" in str(e)
    return False


def _check(out, recompute):
    assert out["maps_match"] and out["router_grads_nonzero"]
    assert out["changed_fraction"] > 0.05  # the perturbation does change the live routing
    assert 0.0 < out["probe"]["moe/route_agree_old_new"] < 1.0
    # by turn: the turns partition the (token, layer) pairs, over every rank's layers and tokens
    sums, turns = out["probe_sums"], ("0", "1", "2", "3_or_later")
    for part in ("num", "den"):
        by_turn = sum(sums[f"moe/route_agree_old_new/turn/{t}/{part}/sum"] for t in turns)
        assert by_turn == sums[f"moe/route_agree_old_new/{part}/sum"], part
    assert all(sums[f"moe/route_agree_old_new/turn/{t}/den/sum"] > 0 for t in turns)
    if out.get("loss_free") is not None:
        assert out["loss_replay"] == pytest.approx(out["loss_free"], rel=1e-7)


def _same_router_grads(out, reference):
    """Router gradients of the replayed pass with perturbed routers == the single-rank run's."""
    for layer, grad in out["router_grads"].items():
        torch.testing.assert_close(grad, reference["router_grads"][layer], rtol=1e-4, atol=1e-7, msg=str(layer))


@pytest.fixture(scope="module")
def reference():
    [out] = run_ranks(_child, world_size=1, timeout=120, sizes={})
    return out


def test_replay_world_size_1(reference):
    _check(reference, recompute=False)
    assert reference["row_independent"]
    assert reference["refuses_plain_model"]
    assert reference["layer_ids"] == (0, 1)
    assert reference["r3_maps_match"]


@pytest.mark.parametrize("recompute", ["full", pytest.param("selective", marks=pytest.mark.mcore_api)])  # MoE recompute: training only (0.19)
def test_replay_world_size_1_recompute(reference, recompute):
    [out] = run_ranks(_child, world_size=1, timeout=120, sizes={}, recompute=recompute,
                      engine_routes=reference["engine_routes"])
    _check(out, recompute)
    _same_router_grads(out, reference)
    assert out["loss_total"] == pytest.approx(reference["loss_total"], rel=1e-6)
    assert out["r3_maps_match"]
    assert out["r3_before"]["moe/route_agree_rollout_train"] == 1.0


@pytest.mark.parametrize("layout,recompute", [("tp2", None), ("ep2", None), pytest.param("tp2ep2", None, marks=pytest.mark.mcore_api),  # top-k routing changed in 0.19
                                              
                                                     ("pp2", "full")])
def test_replay_two_ranks(reference, layout, recompute):
    outs = run_ranks(_child, world_size=2, timeout=150, sizes=SIZES[layout], recompute=recompute,
                     engine_routes=reference["engine_routes"])
    for out in outs:
        _check(out, recompute)
        _same_router_grads(out, reference)
        assert out["r3_maps_match"]
        # plumbing puts the single-rank routing where this layout's own router sends each token
        assert out["r3_before"]["moe/route_agree_rollout_train"] >= 0.98, out["r3_before"]
        assert 0.0 < out["r3_before"]["moe/replayed_token_fraction"] < 1.0
        # the live routing after the perturbation, and the probe, match the single-rank run
        assert out["changed_fraction"] == pytest.approx(reference["changed_fraction"], abs=0.02)
        for k, v in reference["probe"].items():
            assert out["probe"][k] == pytest.approx(v, abs=0.02), k
    if layout == "pp2":
        assert [o["layer_ids"] for o in outs] == [(0,), (1,)]
    totals = [o["loss_total"] for o in outs if "loss_total" in o]
    assert totals and all(t == pytest.approx(reference["loss_total"], rel=1e-5) for t in totals)
    # R3 (each rank replaying its part of the engine's routing: its stage's layers under PP) == one rank
    r3_totals = [o["r3_loss_total"] for o in outs if "r3_loss_total" in o]
    assert r3_totals and all(t == pytest.approx(reference["r3_loss_total"], rel=1e-5) for t in r3_totals)
    for out in outs:
        for layer, grad in out["r3_router_grads"].items():
            torch.testing.assert_close(grad, reference["r3_router_grads"][layer], rtol=1e-4, atol=1e-7)
