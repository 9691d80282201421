"""The builder on a GPU: the model lands on the current CUDA device, runs forward and backward, and
matches the Hugging Face model it was loaded from; with Transformer Engine, the TE spec (grouped
experts when TE has them) maps to and from HF names exactly. GPU lane: skipped without CUDA.
"""
import pytest
import torch

from megatron_rl.platform import capabilities
from tests.spawn import run_ranks

pytestmark = pytest.mark.gpu


def _build_and_check(rank, world, spec, dtype):
    from megatron_rl.model import BuildOptions, build_gpt_model, causal_mask
    from megatron_rl.model.builder import plan_for
    from megatron_rl.model.hf_io import SafetensorsReader, export_hf_weights, load_hf_weights
    from megatron_rl.model.parity import mcore_logits, random_hf_model
    from megatron_rl.model.presets import preset_arch
    from megatron_rl.trainer.stack import OptimSettings, wrap_model
    from tests.mcore_setup import hf_tensors, random_hf_dir, setup_parallel

    groups = setup_parallel()
    arch = preset_arch("qwen3_moe", "tiny", num_experts=8, moe_topk=2)
    opts = BuildOptions(dtype=dtype, spec=spec)
    plan = plan_for(opts)
    model = build_gpt_model(arch, groups, opts)
    devices = {p.device for p in model.parameters()}
    assert devices == {torch.device("cuda", torch.cuda.current_device())}, devices

    path = random_hf_dir(arch, seed=0)
    load_hf_weights(model, arch, groups, SafetensorsReader(path))
    exported = dict(export_hf_weights(model, arch, groups))
    reference = hf_tensors(path)
    assert exported.keys() == reference.keys()
    for k, t in reference.items():  # load -> export is exact (in the model's dtype)
        torch.testing.assert_close(exported[k].float().cpu(), t.to(exported[k].dtype).float(), rtol=0, atol=0, msg=k)

    dev = torch.device("cuda", torch.cuda.current_device())
    tokens = torch.randint(0, arch.vocab_size, (2, 16), device=dev)
    with torch.no_grad():  # before wrapping: the bare GPTModel against the HF model it was loaded from
        hf = random_hf_model(arch, seed=0).to(dev)  # the weights random_hf_dir saved
        diff = (mcore_logits(model, tokens, groups) - hf(tokens).logits.float()).abs().max()

    # forward + backward as the trainer runs it (Float16Module for bf16, megatron DDP: grads in main_grad)
    ddp = wrap_model(model, OptimSettings(dtype=dtype))
    loss = ddp(tokens, torch.arange(16, device=dev).expand(2, -1), causal_mask(16, device=dev), labels=tokens)
    loss.float().mean().backward()
    grads = [p.main_grad for p in ddp.parameters() if getattr(p, "main_grad", None) is not None]
    grads_finite = bool(grads) and all(bool(torch.isfinite(g).all()) for g in grads)
    return plan.use_te, plan.moe_grouped_gemm, bool(torch.isfinite(loss).all()), grads_finite, float(diff)


def test_local_spec_model_on_the_gpu():
    """Issue: 'weight is on cpu, different from other tensors on cuda:0 (fused_rms_norm)'."""
    [(use_te, _, loss_ok, grads_ok, max_diff)] = run_ranks(_build_and_check, world_size=1, timeout=600,
                                                           spec="local", dtype="fp32")
    assert not use_te and loss_ok and grads_ok
    assert max_diff < 1e-3  # fp32 megatron vs fp32 HF on the same GPU


@pytest.mark.skipif(not capabilities().te_usable, reason="needs Transformer Engine")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_te_spec_maps_and_matches_hf(dtype):
    [(use_te, grouped, loss_ok, grads_ok, max_diff)] = run_ranks(_build_and_check, world_size=1, timeout=600,
                                                                 spec="te", dtype=dtype)
    assert use_te and loss_ok and grads_ok
    if dtype == "fp32":  # bf16 weights are rounded copies of the HF ones: only finiteness there
        assert max_diff < 1e-2, (grouped, max_diff)


def _load_converted_on_the_gpu(rank, world, path, arch_dict):
    """The trainer's GPU model (its default spec: TE's where usable) loaded from a checkpoint the
    converter wrote on the host, exported to HF names."""
    from megatron_rl.model import BuildOptions, ModelArch, build_gpt_model
    from megatron_rl.model.hf_io import export_hf_weights
    from megatron_rl.trainer.checkpoint import load_checkpoint
    from tests.mcore_setup import setup_parallel

    groups = setup_parallel()
    arch = ModelArch(**arch_dict)
    model = build_gpt_model(arch, groups, BuildOptions(seed=9))
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    load_checkpoint(path, model)
    return {k: v.cpu() for k, v in export_hf_weights(model, arch, groups)}


def test_converter_runs_on_a_gpu_machine(tmp_path):
    """tools/convert_hf_to_mcore.py beside a GPU: HF -> mcore (a meta-device build, which megatron
    would otherwise allocate on the GPU and fail to move) and back, bit for bit; and the trainer's
    GPU model loads the host-written checkpoint exactly. The tool runs on the host, with the GPUs
    hidden from it."""
    import os
    import subprocess
    import sys

    from megatron_rl.model.presets import preset_arch
    from tests.mcore_setup import hf_tensors, random_hf_dir

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    src = random_hf_dir(preset_arch("qwen3_moe", "tiny"), root=str(tmp_path))
    for args in (["--hf-dir", src, "--mcore-dir", str(tmp_path / "mcore")],
                 ["--reverse", "--mcore-dir", str(tmp_path / "mcore" / "iter_0000000"), "--hf-dir", str(tmp_path / "back")]):
        run = subprocess.run([sys.executable, "tools/convert_hf_to_mcore.py", *args], cwd=root, capture_output=True,
                             text=True, timeout=600, check=False)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    a, b = hf_tensors(src), hf_tensors(str(tmp_path / "back"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    [loaded] = run_ranks(_load_converted_on_the_gpu, world_size=1, timeout=600,
                         path=str(tmp_path / "mcore" / "iter_0000000"), arch_dict=preset_arch("qwen3_moe", "tiny").to_dict())
    assert loaded.keys() == a.keys() and all(torch.equal(loaded[k], a[k].to(loaded[k].dtype)) for k in a)
