"""Checkpoint names are the bare GPTModel's: the converter's checkpoint (an unwrapped model) starts
the trainer (a DDP-wrapped one) with exactly the HF weights, and a checkpoint written under the
wrapper's `module.` names (before this convention) still loads."""
import os

import torch

from tests.distributed.test_rl_loop import BASE
from tests.mcore_setup import hf_tensors, random_hf_dir
from tests.spawn import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _policy_after_load(rank, world, hf_dir, run_dir, ckpt, legacy_save_to=None):
    """Build the trainer's policy from `hf_dir`'s arch (random init), optionally save it the old way
    (wrapped names) to `legacy_save_to` first; perturb it, load `ckpt`, return its HF-named weights."""
    from megatron.core import dist_checkpointing

    from megatron_rl.configure import load_config
    from megatron_rl.parallel import init_parallel
    from megatron_rl.platform import apply_platform_workarounds
    from megatron_rl.trainer.checkpoint import load_checkpoint
    from megatron_rl.trainer.loop import close
    from megatron_rl.trainer.manifest import write_json
    from megatron_rl.trainer.setup import setup

    apply_platform_workarounds()
    cfg = load_config(None, BASE + [f"train.run_dir={run_dir}", f"model.hf_dir={hf_dir}", "sft.steps=0"])
    ctx = setup(cfg, init_parallel(cfg.parallel, seed=cfg.train.seed))
    try:
        saved = None
        if legacy_save_to is not None:
            os.makedirs(legacy_save_to)
            dist_checkpointing.save({"model": ctx.policy.model.sharded_state_dict()}, legacy_save_to)
            os.makedirs(os.path.join(legacy_save_to, "extra"))
            write_json(os.path.join(legacy_save_to, "extra", "rank_00000.json"), {"step": 0})
            saved = {k: v.clone() for k, v in ctx.policy.export()}
        with torch.no_grad():
            for p in ctx.policy.model.parameters():
                p.add_(0.5)
        load_checkpoint(ckpt, ctx.policy.model, verify=False)
        return saved, {k: v.clone() for k, v in ctx.policy.export()}
    finally:
        close(ctx)


def test_converted_checkpoint_starts_the_trainer_with_the_hf_weights(tmp_path):
    import subprocess
    import sys

    from megatron_rl.model.presets import preset_arch

    src = random_hf_dir(preset_arch("qwen3_moe", "tiny"), root=str(tmp_path))
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1")
    proc = subprocess.run([sys.executable, "tools/convert_hf_to_mcore.py", "--hf-dir", src, "--mcore-dir",
                           str(tmp_path / "mcore")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [(_, loaded)] = run_ranks(_policy_after_load, world_size=1, timeout=300, hf_dir=src,
                              run_dir=str(tmp_path / "run"), ckpt=str(tmp_path / "mcore" / "iter_0000000"))
    expected = hf_tensors(src)
    assert loaded.keys() == expected.keys()
    for k in expected:
        assert torch.equal(loaded[k], expected[k].to(loaded[k].dtype)), k


def test_a_checkpoint_under_the_wrappers_names_still_loads(tmp_path):
    from megatron_rl.model.presets import preset_arch

    src = random_hf_dir(preset_arch("qwen3_moe", "tiny"), root=str(tmp_path))
    legacy = str(tmp_path / "legacy")
    [(saved, loaded)] = run_ranks(_policy_after_load, world_size=1, timeout=300, hf_dir=src,
                                  run_dir=str(tmp_path / "run"), ckpt=legacy, legacy_save_to=legacy)
    assert saved.keys() == loaded.keys()
    for k in saved:
        assert torch.equal(loaded[k], saved[k]), k
