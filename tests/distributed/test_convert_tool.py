"""tools/convert_hf_to_mcore.py: HF -> mcore (EP=2) -> HF (one rank) is bit-for-bit, and a
checkpoint streamed at one rank loads at TP=2 and at EP=2."""
import os
import subprocess
import sys

import pytest
import torch

from tests.mcore_setup import hf_tensors, random_hf_dir

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1")


def _run(*args, nproc=1):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] \
        if nproc > 1 else [sys.executable]
    run = subprocess.run(launcher + ["tools/convert_hf_to_mcore.py", *args], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return run.stdout


def test_roundtrip_through_an_ep2_checkpoint(tmp_path):
    from megatron_rl.model.presets import preset_arch

    src = random_hf_dir(preset_arch("qwen3_moe", mlp_only_layers=(0,)), root=str(tmp_path))
    _run("--hf-dir", src, "--mcore-dir", str(tmp_path / "mcore"), "--expert-model-parallel-size", "2", nproc=2)
    _run("--reverse", "--mcore-dir", str(tmp_path / "mcore" / "iter_0000000"), "--hf-dir", str(tmp_path / "back"))
    a, b = hf_tensors(src), hf_tensors(str(tmp_path / "back"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def _load_at(rank, world, path, arch_dict, sizes):
    from megatron_rl.model import BuildOptions, ModelArch, build_gpt_model
    from megatron_rl.model.hf_io import export_hf_weights
    from megatron_rl.trainer.checkpoint import load_checkpoint
    from tests.mcore_setup import setup_parallel

    groups = setup_parallel(**sizes)
    arch = ModelArch(**arch_dict)
    model = build_gpt_model(arch, groups, BuildOptions(seed=9))
    load_checkpoint(path, model)
    return dict(export_hf_weights(model, arch, groups))


@pytest.mark.parametrize("family,sizes", [("mixtral", {"tensor_model_parallel_size": 2}),
                                          ("mixtral", {"expert_model_parallel_size": 2}),
                                          ("deepseek_v3", {"tensor_model_parallel_size": 2})],
                         ids=["tp2", "ep2", "deepseek_v3_tp2"])
def test_streamed_checkpoint_loads_at_another_layout(tmp_path, family, sizes):
    """DeepSeek-V3 adds MLA's duplicated down projections and the router's bias, a buffer that the
    meta-device model materialises like a parameter."""
    from megatron_rl.model.presets import preset_arch
    from tests.spawn import run_ranks

    arch = preset_arch(family)
    src = random_hf_dir(arch, root=str(tmp_path))
    _run("--hf-dir", src, "--mcore-dir", str(tmp_path / "mcore"))
    loaded = run_ranks(_load_at, world_size=2, timeout=180, path=str(tmp_path / "mcore" / "iter_0000000"),
                       arch_dict=arch.to_dict(), sizes=sizes)[0]
    ref = hf_tensors(src)
    assert loaded.keys() == ref.keys()
    assert all(torch.equal(loaded[k], ref[k]) for k in ref)
    assert all(ref[k].abs().sum() > 0 for k in ref if k.endswith("e_score_correction_bias"))
