"""The RL trainer's context-parallel data path: CP=2 (two gloo ranks) against one rank.

megatron-core has no CP attention on CPU (it needs Transformer Engine), so the model is replaced
at one seam only, `make_forward_step(hidden_states=..., head_weight=...)`, by a small causal
encoder that does what CP attention does: it reads the whole sequence (all-gathering the local
input shards over the CP group) and returns this rank's zig-zag shard of the final hidden states,
`[L/CP, b, H]`, as megatron-core shards them. Everything else is the trainer's own code:
build_batch -> cp_shard (megatron's `get_batch_on_this_cp_rank`) -> micro-batches -> the forward
step (fused vocab log-probs from hidden states) -> old log-probs, mismatch sums and P3O's ESS ->
global counts -> policy_loss_fn with CPSeqOps -> backward. The CP ranks' summed gradient (what
megatron's DDP all-reduce over DP×CP does) must equal the single-rank gradient, for every recipe.
A second test runs one optimizer step through megatron's schedule, DDP, finalize_model_grads and
optimizer themselves (the toy encoder as a MegatronModule) and checks the reduced gradients and
updated weights against CP=1.
"""
import pytest
import torch

from tests.spawn import run_ranks

V, H, G = 24, 16, 4  # vocab, hidden, group size
PROMPTS = 3
KEEP = "grpo+keep_sampling_mask"


def _samples(with_kept: bool):
    """Deterministic samples of unequal prompt/response lengths; rewards with one all-zero group."""
    from megatron_rl.rollout.types import Sample

    g = torch.Generator().manual_seed(7)
    samples, rewards = [], []
    for i in range(PROMPTS * G):
        p = int(torch.randint(1, 6, (1,), generator=g))
        r = int(torch.randint(1, 10, (1,), generator=g))
        resp = torch.randint(1, V, (r,), generator=g)
        kept = None
        if with_kept:  # the sampled token plus 4 others (-1 padded to 6)
            others = torch.randint(0, V, (r, 4), generator=g)
            kept = torch.cat([resp[:, None], others, torch.full((r, 1), -1)], dim=1)
        samples.append(Sample(prompt_ids=torch.randint(1, V, (p,), generator=g), response_ids=resp,
                              rollout_logprobs=-torch.rand(r, generator=g) * 3 - 0.05, finish_reason="stop",
                              policy_version=0, kept_ids=kept))
        rewards.append(0.0 if i // G == 1 else float(torch.rand((), generator=g) < 0.5))
    return samples, rewards


class ToyCausalModel:
    """h_t = tanh(mean_{s<=t} E[x_s] + P[t]) for the full row, then this rank's zig-zag shard."""

    def __init__(self, cp_group, cp: int):
        g = torch.Generator().manual_seed(11)
        self.E = (torch.randn(V, H, generator=g) * 0.5).requires_grad_()
        self.P = (torch.randn(64, H, generator=g) * 0.5).requires_grad_()
        self.W = (torch.randn(V, H, generator=g) * 0.5).requires_grad_()
        self.cp_group, self.cp = cp_group, cp

    def params(self):
        return [self.E, self.P, self.W]

    def perturb(self):
        """A step's worth of change, so that π_θ differs from π_old (ratios, clipping, ESS)."""
        g = torch.Generator().manual_seed(13)
        with torch.no_grad():
            for p in self.params():
                p.add_(torch.randn(p.shape, generator=g) * 0.15)

    def hidden_states(self, model, input_ids, position_ids, attention_mask):
        import torch.distributed as dist

        from megatron_rl.logprobs import zigzag_all_gather, zigzag_shard

        assert model is self
        # megatron's TE CP attention masks causally across shards itself; CP=1 gets the mask
        assert (attention_mask is None) == (self.cp > 1)
        if self.cp > 1:
            input_ids = zigzag_all_gather(input_ids, self.cp_group, seq_dim=1)
            position_ids = zigzag_all_gather(position_ids, self.cp_group, seq_dim=1)
        e = self.E[input_ids]  # [b, L, H]
        steps = torch.arange(1, e.shape[1] + 1, dtype=e.dtype)[None, :, None]
        h = torch.tanh(e.cumsum(1) / steps + self.P[position_ids])
        if self.cp > 1:
            h = zigzag_shard(h, dist.get_rank(self.cp_group), self.cp, seq_dim=1)
        return h.transpose(0, 1)

    def head_weight(self, model):
        return self.W


def _check_shard(full, local, rank, cp):
    """cp_shard (megatron's function) == our zig-zag indices; labels shifted on the whole row."""
    from megatron_rl.logprobs import zigzag_indices, zigzag_shard

    for name in ("input_ids", "labels", "position_ids", "loss_mask", "rollout_logprobs", "advantages",
                 "positions", "kept_ids"):
        a, b = getattr(full, name), getattr(local, name)
        if a is None:
            assert b is None
            continue
        assert torch.equal(zigzag_shard(a, rank, cp, seq_dim=1), b), name
    idx = zigzag_indices(rank, cp, total_len=full.input_len)
    row_tokens = torch.cat([full.input_ids, full.labels[:, -1:]], dim=1)  # the whole padded row
    assert torch.equal(local.labels, row_tokens[:, idx + 1])
    assert local.input_len == full.input_len and local.cp_size == cp


def _one_recipe(recipe: str, groups, rank: int, cp: int, forward_grads: bool = False) -> dict:
    from megatron_rl.config.schema import LossSection
    from megatron_rl.losses import STEP_STATISTICS
    from megatron_rl.losses.setup import resolve_loss
    from megatron_rl.metrics.mismatch import mismatch_sums
    from megatron_rl.metrics.reduce import accumulate, finish
    from megatron_rl.parallel.layout import BatchLayout
    from megatron_rl.trainer.batch import build_batch, cp_shard, padded_length, row_multiple
    from megatron_rl.trainer.passes import (
        PassSettings,
        TokenLocalLoss,
        collect_logprobs,
        make_forward_step,
        micro_batches,
        reduce_dp,
    )
    from megatron_rl.trainer.phases import (
        global_counts,
        group_advantages,
        policy_loss_fn,
        policy_token_terms,
        seq_ops,
    )

    keep = recipe == KEEP
    samples, rewards = _samples(with_kept=keep)
    loss = resolve_loss(LossSection(recipe="grpo" if keep else recipe, keep_sampling_mask=keep,
                                    filter_zero_variance_groups=recipe == "dapo"), max_response_len=9)
    adv, keep_rows, _ = group_advantages(torch.tensor(rewards), G, loss.advantages, loss.filter_zero_variance_groups)
    full = build_batch(samples, rewards, 0, padded_length(samples, row_multiple(1, cp)), with_kept_ids=keep)
    full = full.with_advantages(adv)
    if not keep_rows.all():
        from dataclasses import replace

        full = replace(full, loss_mask=full.loss_mask & keep_rows[:, None])
    local = cp_shard(full, groups.cp_group)
    if cp > 1:
        _check_shard(full, local, rank, cp)
    model = ToyCausalModel(groups.cp_group, cp)
    settings = PassSettings(micro_batch_size=3, temperature=0.9)
    seq = seq_ops(groups)

    def run(loss_fn, slices, need_entropy=False):
        step = make_forward_step(groups, settings, loss_fn, need_entropy, model.hidden_states, model.head_weight)
        outs = []
        for mb in micro_batches(local, slices):
            out, loss_func = step(iter([mb]), model)
            loss, _, metrics = loss_func(out)
            if loss.requires_grad:
                loss.backward()
            outs.append(metrics)
        return outs

    every = [slice(i, i + 3) for i in range(0, local.size, 3)]
    with torch.no_grad():  # π_old pass (the trainer's logprob_pass loss)
        outs = run(collect_logprobs, every, need_entropy=True)
    old = torch.cat([o["logprobs"] for o in outs])
    entropy = torch.cat([o["entropy"] for o in outs])
    sums = mismatch_sums(old, local.rollout_logprobs, local.loss_mask, entropy=entropy, seq=seq)
    model.perturb()
    loss_kw = loss.loss_kwargs()
    step_metrics = {}
    for slices in BatchLayout(local.size, 2, 1, 3).minibatch_slices():
        counts = global_counts(local, slices, groups, seq)
        for param, name in loss.step_statistics.items():  # as trainer.phases.step_parameters
            stat = STEP_STATISTICS.get(name)
            with torch.no_grad():
                lp = torch.cat([o["logprobs"] for o in run(collect_logprobs, slices)])
            rows = slice(slices[0].start, slices[-1].stop)
            loss_kw["surrogate_params"][param] = stat.value(reduce_dp(stat.sums(lp, old[rows], local.loss_mask[rows]),
                                                                      groups))
        loss_fn = policy_loss_fn(loss_kw, counts, old, seq)
        if forward_grads:  # the trainer's choice under loss.head_gradients=auto (phases.update)
            assert loss.gradients_in_forward, recipe
            loss_fn = TokenLocalLoss(policy_token_terms(loss_kw, counts, old, seq), loss_fn)
        for o in run(loss_fn, slices):
            step_metrics = accumulate(step_metrics, o)
    ratio_keys = [k for k in step_metrics if k.startswith("mismatch/")]
    sums.update({k: step_metrics.pop(k) for k in ratio_keys})
    mismatch = finish(reduce_dp(sums, groups))
    metrics = finish(reduce_dp(step_metrics, groups))
    grads = {}
    for name, p in zip("EPW", model.params(), strict=True):
        g = p.grad.clone()
        torch.distributed.all_reduce(g, group=groups.dp_cp_group)  # megatron DDP's DP×CP reduction
        grads[name] = g
    return {"metrics": metrics, "mismatch": mismatch, "grads": grads}


def _worker(rank, world, recipes, forward_grads=False):
    from megatron_rl.parallel import ParallelConfig, init_parallel
    from megatron_rl.platform import apply_platform_workarounds

    apply_platform_workarounds()
    groups = init_parallel(ParallelConfig(context_parallel_size=world))
    assert groups.config.cp == world and groups.dp_size == 1
    return {r: _one_recipe(r, groups, rank, world, forward_grads) for r in recipes}


def _close(a: float, b: float, name: str, tol: float = 2e-5):
    assert abs(a - b) <= tol * (1 + abs(b)), (name, a, b)


def _assert_same(ref: dict, r0: dict, r1: dict, recipes: list[str]):
    """Rank 0's metrics and both ranks' reduced gradients equal the reference, recipe by recipe."""
    for recipe in recipes:
        want, got = ref[recipe], r0[recipe]
        assert got["metrics"].keys() == want["metrics"].keys(), recipe
        for k, v in want["metrics"].items():
            _close(got["metrics"][k], v, f"{recipe}: {k}")
        assert got["mismatch"].keys() == want["mismatch"].keys(), recipe
        for k, v in want["mismatch"].items():
            _close(got["mismatch"][k], v, f"{recipe}: {k}")
        for k, g in want["grads"].items():
            torch.testing.assert_close(got["grads"][k], g, rtol=2e-5, atol=1e-6, msg=f"{recipe}: grad {k}")
            torch.testing.assert_close(r1[recipe]["grads"][k], g, rtol=2e-5, atol=1e-6)


@pytest.mark.mcore_api  # get_batch_on_this_cp_rank: is_hybrid_cp, cp_group (0.19)
def test_cp2_trainer_path_matches_single_rank():
    from megatron_rl.losses import RECIPES

    recipes = sorted(RECIPES.names()) + [KEEP]
    [ref] = run_ranks(_worker, world_size=1, timeout=300, recipes=recipes)
    r0, r1 = run_ranks(_worker, world_size=2, timeout=300, recipes=recipes)
    _assert_same(ref, r0, r1, recipes)
    # not vacuous: (nearly) every recipe trains, and the recipes do differ
    moving = [r for r in recipes if ref[r]["grads"]["E"].abs().max() > 1e-6]
    assert len(moving) >= len(recipes) - 1, sorted(set(recipes) - set(moving))
    assert len({round(ref[r]["metrics"]["loss/value"], 6) for r in recipes}) >= len(recipes) // 2


def test_gradients_formed_in_the_forward_match_the_recompute_path():
    """loss.head_gradients=auto: every token-local recipe through `fused_token_loss` (the gradient
    formed chunk by chunk in the forward from TokenTerms) gives the recompute path's metrics and
    gradients, on one rank and on two CP ranks."""
    from megatron_rl.config.schema import LossSection
    from megatron_rl.losses import RECIPES
    from megatron_rl.losses.setup import resolve_loss

    recipes = [r for r in sorted(RECIPES.names())
               if resolve_loss(LossSection(recipe=r), max_response_len=9).gradients_in_forward] + [KEEP]
    assert len(recipes) >= 10
    [ref] = run_ranks(_worker, world_size=1, timeout=300, recipes=recipes)
    [one] = run_ranks(_worker, world_size=1, timeout=300, recipes=recipes, forward_grads=True)
    _assert_same(ref, one, one, recipes)
    r0, r1 = run_ranks(_worker, world_size=2, timeout=300, recipes=recipes, forward_grads=True)
    _assert_same(ref, r0, r1, recipes)



def _sft_worker(rank, world, forward_grads):
    """trainer/sft.py's loss over the same samples (label tokens = the responses), two micro-batches:
    (nll, the DP×CP-reduced gradients of E, P, W)."""
    from megatron_rl.losses import GlobalCounts, local_counts
    from megatron_rl.parallel import ParallelConfig, init_parallel
    from megatron_rl.platform import apply_platform_workarounds
    from megatron_rl.trainer.batch import build_batch, cp_shard, padded_length, row_multiple
    from megatron_rl.trainer.passes import (
        PassSettings,
        TokenLocalLoss,
        make_forward_step,
        micro_batches,
        reduce_dp,
    )
    from megatron_rl.trainer.sft import sft_loss

    apply_platform_workarounds()
    groups = init_parallel(ParallelConfig(context_parallel_size=world))
    samples, _ = _samples(with_kept=False)
    full = build_batch(samples, [0.0] * len(samples), 0, padded_length(samples, row_multiple(1, world)))
    local = cp_shard(full, groups.cp_group)
    slices = [slice(0, 5), slice(5, local.size)]
    counts = GlobalCounts()
    for sl in slices:
        counts = counts + local_counts(local.loss_mask[sl])
    n_tok = reduce_dp({"n/sum": counts.num_tokens}, groups)["n/sum"]
    loss_fn = sft_loss(n_tok, in_forward=forward_grads)
    assert isinstance(loss_fn, TokenLocalLoss) == forward_grads
    model = ToyCausalModel(groups.cp_group, world)
    step = make_forward_step(groups, PassSettings(micro_batch_size=5, temperature=1.0), loss_fn, False,
                             model.hidden_states, model.head_weight)
    nll = 0.0
    for mb in micro_batches(local, slices):
        out, loss_func = step(iter([mb]), model)
        loss, _, metrics = loss_func(out)
        loss.backward()
        nll += float(metrics["nll/sum"])
    nll = float(reduce_dp({"nll/sum": torch.tensor(nll, dtype=torch.float64)}, groups)["nll/sum"])
    grads = {}
    for name, p in zip("EPW", model.params(), strict=True):
        g = p.grad.clone()
        torch.distributed.all_reduce(g, group=groups.dp_cp_group)
        grads[name] = g
    return nll, grads


def test_sft_gradients_formed_in_the_forward_match_the_recompute_path():
    """The warm start's NLL under loss.head_gradients=auto (NllTerms through fused_token_loss) gives
    the recompute path's value and gradients, on one rank and on two CP ranks."""
    [(nll, grads)] = run_ranks(_sft_worker, world_size=1, timeout=300, forward_grads=False)
    assert 1.0 < nll < 10.0 and all(g.abs().max() > 1e-4 for g in grads.values())
    runs = [*run_ranks(_sft_worker, world_size=1, timeout=300, forward_grads=True),
            *run_ranks(_sft_worker, world_size=2, timeout=300, forward_grads=True)]
    for got_nll, got in runs:
        _close(got_nll, nll, "nll")
        for k, g in grads.items():
            torch.testing.assert_close(got[k], g, rtol=2e-5, atol=1e-6, msg=f"grad {k}")


def _ddp_worker(rank, world, recipe, forward_grads):
    """One optimizer step through megatron's schedule, DDP (grad reduction over DP×CP),
    finalize_model_grads and optimizer, with the toy encoder as a MegatronModule. forward_grads:
    the loss through `fused_token_loss`, whose weight gradient goes into DDP's main_grad in the
    forward, scaled by the gradient megatron's backward gives the loss."""
    import torch.nn.functional as F
    from megatron.core.enums import ModelType
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import MegatronModule

    from megatron_rl.config.schema import LossSection, OptimSection
    from megatron_rl.losses.setup import resolve_loss
    from megatron_rl.parallel import ParallelConfig, init_parallel
    from megatron_rl.parallel.layout import BatchLayout
    from megatron_rl.platform import apply_platform_workarounds
    from megatron_rl.trainer.batch import build_batch, cp_shard, padded_length, row_multiple
    from megatron_rl.trainer.passes import (
        PassSettings,
        TokenLocalLoss,
        make_forward_step,
        megatron_loss_scale,
        micro_batches,
    )
    from megatron_rl.trainer.phases import (
        global_counts,
        group_advantages,
        policy_loss_fn,
        policy_token_terms,
        seq_ops,
    )
    from megatron_rl.trainer.stack import OptimSettings, build_optimizer, forward_backward, wrap_model

    apply_platform_workarounds()
    groups = init_parallel(ParallelConfig(context_parallel_size=world))
    config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=1, context_parallel_size=world,
                               calculate_per_token_loss=True, use_cpu_initialization=True,
                               gradient_accumulation_fusion=False, activation_func=F.silu)
    toy = ToyCausalModel(groups.cp_group, world)

    class Module(MegatronModule):
        def __init__(self):
            super().__init__(config)
            self.model_type = ModelType.encoder_or_decoder
            self.E, self.P, self.W = (torch.nn.Parameter(t.detach().clone()) for t in toy.params())

        def set_input_tensor(self, _tensor):  # the schedule's PP hook (one stage here)
            pass

    model = wrap_model(Module(), OptimSettings())
    inner = model.module
    toy.E, toy.P, toy.W = inner.E, inner.P, inner.W  # the seam reads the DDP-managed parameters
    optimizer = build_optimizer(model, OptimSettings(OptimSection(lr=1e-2, clip_grad=0.0)))

    samples, rewards = _samples(with_kept=False)
    loss = resolve_loss(LossSection(recipe=recipe), max_response_len=9)
    assert loss.gradients_in_forward or not forward_grads
    adv, _, _ = group_advantages(torch.tensor(rewards), G, loss.advantages, False)
    full = build_batch(samples, rewards, 0, padded_length(samples, row_multiple(1, world))).with_advantages(adv)
    local = cp_shard(full, groups.cp_group)
    seq = seq_ops(groups)
    old = local.rollout_logprobs + 0.1 * local.loss_mask  # any fixed π_old: ratios ≠ 1
    settings = PassSettings(micro_batch_size=3)
    [slices] = BatchLayout(local.size, 1, 1, 3).minibatch_slices()
    counts = global_counts(local, slices, groups, seq)
    loss_fn = policy_loss_fn(loss.loss_kwargs(), counts, old, seq)
    if forward_grads:
        loss_fn = TokenLocalLoss(policy_token_terms(loss.loss_kwargs(), counts, old, seq), loss_fn)
    step = make_forward_step(groups, settings, loss_fn, False, lambda m, *a: toy.hidden_states(toy, *a),
                             lambda m: toy.W, grad_scale=megatron_loss_scale(model))
    outs = forward_backward(model, step, iter(micro_batches(local, slices)), len(slices),
                            seq_length=local.input_len, micro_batch_size=3, optimizer=optimizer)
    grads = {n: p.main_grad.detach().clone() for n, p in (("E", inner.E), ("P", inner.P), ("W", inner.W))}
    ok, grad_norm, _ = optimizer.step()
    assert ok
    loss_value = torch.stack([o["loss/value/sum"] for o in outs]).sum()
    torch.distributed.all_reduce(loss_value, group=groups.dp_cp_group)
    return {"grads": grads, "grad_norm": float(grad_norm), "loss": float(loss_value),
            "after": {n: p.detach().clone() for n, p in (("E", inner.E), ("P", inner.P), ("W", inner.W))}}


@pytest.mark.parametrize("recipe,forward_grads", [("gspo", False), pytest.param("grpo", True, marks=pytest.mark.mcore_api)])  # DDP, DP x CP
def test_cp2_megatron_ddp_step_matches_single_rank(recipe, forward_grads):
    """megatron's DDP sums (calculate_per_token_loss) the CP shards' gradients: same step as CP=1;
    with gradients formed in the forward, the same step as the recompute path."""
    [ref] = run_ranks(_ddp_worker, world_size=1, timeout=180, recipe=recipe, forward_grads=False)
    runs = run_ranks(_ddp_worker, world_size=2, timeout=180, recipe=recipe, forward_grads=forward_grads)
    if forward_grads:
        runs += run_ranks(_ddp_worker, world_size=1, timeout=180, recipe=recipe, forward_grads=True)
    for got in runs:
        _close(got["loss"], ref["loss"], "loss")
        _close(got["grad_norm"], ref["grad_norm"], "grad_norm")
        assert ref["grad_norm"] > 0
        for k in ref["grads"]:
            torch.testing.assert_close(got["grads"][k], ref["grads"][k], rtol=2e-5, atol=1e-7)
            torch.testing.assert_close(got["after"][k], ref["after"][k], rtol=2e-5, atol=1e-7)

def _setup_cp2(rank, world):
    from megatron_rl.configure import load_config
    from megatron_rl.parallel import init_parallel
    from megatron_rl.platform import apply_platform_workarounds
    from megatron_rl.trainer.setup import setup

    apply_platform_workarounds()
    cfg = load_config("examples/demo_cpu.yaml", ["--context-parallel-size", "2", "train.run_dir=/tmp/unused"])
    assert cfg.parallel.cp == 2  # a valid configuration ...
    try:
        setup(cfg, init_parallel(cfg.parallel, seed=0))
    except RuntimeError as e:
        return str(e)
    return None


def test_cp2_run_on_cpu_stops_at_setup_with_the_reason():
    """... whose model forward needs TE's CP attention: on CPU the run stops before any work."""
    for msg in run_ranks(_setup_cp2, world_size=2, timeout=120):
        assert msg is not None and "context_parallel_size=2" in msg and "Transformer Engine" in msg, msg
