"""Every loss recipe runs through the real RL step (one process) and produces a finite update."""

from megatron_rl.losses import RECIPES
from tests.distributed.test_rl_loop import BASE, hf_dir  # noqa: F401 - fixture
from tests.spawn import run_ranks


def _each_recipe(rank, world, recipes, run_root, hf):
    import math

    from megatron_rl.configure import load_config
    from megatron_rl.parallel import init_parallel
    from megatron_rl.platform import apply_platform_workarounds
    from megatron_rl.trainer.loop import close, train
    from megatron_rl.trainer.setup import setup

    apply_platform_workarounds()
    out = {}
    for recipe in recipes:
        cfg = load_config(None, BASE + [f"train.run_dir={run_root}/{recipe}", f"loss.recipe={recipe}", "train.steps=1",
                                        f"model.hf_dir={hf}", "rollout.dtype=bf16"])
        ctx = setup(cfg, init_parallel(cfg.parallel, seed=cfg.train.seed))
        try:
            summary = train(ctx)
        finally:
            close(ctx)
        last = summary["last"]
        out[recipe] = (last["loss/policy"], last["optim/grad_norm"], last["mismatch/kl_k3"])
        assert all(math.isfinite(v) for v in out[recipe]), (recipe, last)
    return out


def test_all_recipes_train(tmp_path, hf_dir):  # noqa: F811
    names = sorted(RECIPES.names())
    [out] = run_ranks(_each_recipe, world_size=1, timeout=600, recipes=names, run_root=str(tmp_path), hf=hf_dir)
    assert set(out) == set(names)
    for recipe, (loss, grad_norm, kl) in out.items():
        assert grad_norm > 0, recipe
        assert kl > 0, recipe  # bf16 engine vs fp32 trainer
