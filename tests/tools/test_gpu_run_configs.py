"""The GPU lane's run configurations (tests/gpu) are valid: checked here, on any machine (no GPU needed), so a
config change that would break the GPU lane shows up in the CPU suite too (nothing is run for that), and a
failed GPU-lane run reports its error in the test output (two runs that fail at start-up)."""
import pytest

from megatron_rl.configure import load_config
from megatron_rl.losses import RECIPES
from tests.golden import register_reward
from tests.gpu.runs import DEMO, DEMO_SHORT, DENSE_REWARD, ONE_STEP, ROOT

CONFIGS = {
    **{f"demo_{d}": DEMO_SHORT + [f"model.dtype={d}"] for d in ("fp32", "bf16", "fp16")},
    **{f"recipe_{r}": ONE_STEP + DENSE_REWARD + [f"loss.recipe={r}", "model.dtype=bf16"]
       for r in sorted(RECIPES.names())},
    **{f"replay_{m}": ONE_STEP + ["--router-replay", m, "model.dtype=bf16"] for m in ("r2", "r3")},
    "sft_only": ONE_STEP + ["train.steps=0", "sft.steps=6", "sft.batch_size=16", "sft.eval_every=3",
                            "train.eval_size=32"],
    "resume": ONE_STEP + ["model.dtype=fp32", "rollout.dtype=fp32", "train.steps=3", "train.resume=true"],
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_gpu_run_config_loads(name, tmp_path):
    register_reward()   # as tests.gpu.driver does before the recipe runs
    cfg = load_config(str(ROOT / DEMO), CONFIGS[name] + [f"train.run_dir={tmp_path}"])
    assert cfg.log.tensorboard is False  # the GPU machine has no TensorBoard wheel (tools/gpu_wheels.sh)


def test_context_parallel_config_loads(tmp_path):
    from tests.gpu.test_context_parallel_loop import OVERRIDES

    cfg = load_config(str(ROOT / DEMO), OVERRIDES + [f"train.run_dir={tmp_path}", "--context-parallel-size", "2"])
    assert cfg.parallel.context_parallel_size == 2 and cfg.model.dtype == "bf16"


# three short subprocesses (~15 s): a config error and a start-up error
def test_a_failed_gpu_lane_run_explains_itself(tmp_path):
    """On the GPU machine only the test output comes back, not pytest's tmp dir: a failed run's
    message has the error itself (the traceback with --debug), not just an exit code."""
    from tests.gpu.runs import launch, launch_many

    (tmp_path / "many").mkdir()
    empty = tmp_path / "hf"   # a folder (config-time checks pass) without config.json: fails when read
    empty.mkdir()
    out = launch_many(tmp_path / "many", {"bad_config": ONE_STEP + ["loss.recipe=nope"],
                                          "no_checkpoint": ONE_STEP + [f"model.hf_dir={empty}"]})
    assert "returned 2" in out["bad_config"] and "unknown loss recipe 'nope'" in out["bad_config"]
    assert "returned 1" in out["no_checkpoint"] and "Traceback" in out["no_checkpoint"]
    assert f"{empty}/config.json does not exist" in out["no_checkpoint"]
    with pytest.raises(AssertionError, match=rf"(?s)exit 1.*Traceback.*{empty}/config.json does not exist"):
        launch(tmp_path / "one", "no_checkpoint", ONE_STEP + [f"model.hf_dir={empty}"])
