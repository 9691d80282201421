"""The builder's platform decisions (capabilities -> device, spec, fused kernels), for every case, on CPU."""
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.model.builder import (
    BuildOptions,
    BuildPlan,
    Kernels,
    build_plan,
    plan_for,
    transformer_config,
)
from megatron_rl.model.presets import preset_arch
from megatron_rl.parallel import ParallelConfig
from megatron_rl.platform import Capabilities

CPU = Capabilities(cuda=False, te=False, apex=False)
GPU_BARE = Capabilities(cuda=True, te=False, apex=False)
GPU_TE = Capabilities(cuda=True, te=True, apex=False)
ALL_TE = Kernels(te_grouped_gemm=True, te_fused_rope=True, te_fused_router=True, te_fused_permute=True)
APEX = Kernels(wgrad_accum_fusion=True, fused_softmax=True)
FUSIONS = ("moe_grouped_gemm", "bias_activation_fusion", "masked_softmax_fusion", "bias_dropout_fusion",
           "apply_rope_fusion", "persist_layer_norm", "gradient_accumulation_fusion", "moe_router_fusion",
           "moe_permute_fusion")


def _on(plan: BuildPlan) -> set[str]:
    return {k for k in FUSIONS if getattr(plan, k)}


def test_cpu_keeps_everything_off():
    plan = build_plan(CPU)
    assert (plan.device, plan.use_te, plan.use_cpu_initialization) == ("cpu", False, True)
    assert _on(plan) == set()
    # even if kernels were reported (they are not probed without CUDA), nothing needs CUDA on the CPU
    assert _on(build_plan(CPU, Kernels(**{k: True for k in Kernels.__dataclass_fields__}))) == set()


def test_gpu_without_te_or_apex():
    """The H100 of the issue: torch only. The model goes to the GPU; only megatron's torch.compile
    fusions are on; nothing that needs TE or Apex."""
    plan = build_plan(GPU_BARE)
    assert (plan.device, plan.use_te, plan.use_cpu_initialization) == ("cuda", False, False)
    assert _on(plan) == {"bias_activation_fusion", "bias_dropout_fusion"}


def test_gpu_with_apex_kernels_local_spec():
    plan = build_plan(Capabilities(cuda=True, te=False, apex=True), APEX)
    assert _on(plan) == {"bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion",
                         "gradient_accumulation_fusion"}


def test_gpu_with_te():
    plan = build_plan(GPU_TE, ALL_TE)
    assert plan.use_te and plan.device == "cuda"
    assert _on(plan) == {"moe_grouped_gemm", "bias_activation_fusion", "bias_dropout_fusion", "apply_rope_fusion",
                         "moe_router_fusion", "moe_permute_fusion"}
    # TE's attention fuses its own softmax: the local-attention switch stays off even with the kernels
    assert not build_plan(GPU_TE, Kernels(fused_softmax=True)).masked_softmax_fusion


def test_te_features_follow_the_te_version():
    # an old TE without grouped linears / fused router: those switches stay off
    plan = build_plan(GPU_TE, Kernels(te_fused_rope=True))
    assert _on(plan) == {"bias_activation_fusion", "bias_dropout_fusion", "apply_rope_fusion"}


def test_router_fusion_off_under_routing_replay():
    # megatron's fused top-k skips RouterReplay: replay would silently not apply
    assert not build_plan(GPU_TE, ALL_TE, routing_replay=True).moe_router_fusion
    assert build_plan(GPU_TE, ALL_TE, routing_replay=True).moe_permute_fusion


def test_local_spec_on_a_te_machine():
    plan = build_plan(GPU_TE, ALL_TE, spec="local")
    assert not plan.use_te and plan.device == "cuda"
    assert _on(plan) == {"bias_activation_fusion", "bias_dropout_fusion"}


def test_te_spec_needs_te():
    with pytest.raises(RuntimeError, match="Transformer Engine and CUDA"):
        build_plan(GPU_BARE, spec="te")
    with pytest.raises(RuntimeError, match="CUDA=no"):
        build_plan(Capabilities(cuda=False, te=True, apex=False), spec="te")
    with pytest.raises(ValueError, match="spec"):
        build_plan(CPU, spec="fast")


CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="checks this process's plan on a machine without CUDA")


@CPU_ONLY
def test_this_cpu_process():
    plan = plan_for(BuildOptions())
    assert plan == build_plan(CPU)


@CPU_ONLY
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_cpu_transformer_config_is_unchanged(arch):
    """The CPU lane's TransformerConfig: exactly the switches it always had (its numbers are golden)."""
    cfg = transformer_config(preset_arch(arch), SimpleNamespace(config=ParallelConfig()), BuildOptions(), use_te=False)
    assert cfg.use_cpu_initialization is True
    for name in FUSIONS:
        assert getattr(cfg, name) is False, name


GROUPED = Kernels(te_grouped_gemm=True)   # TransformerConfig checks the other TE fusions against TE


@pytest.mark.parametrize("arch,kernels,fused", [("qwen3", Kernels(), True), ("qwen3_moe", Kernels(), False),
                                                ("qwen3_moe", GROUPED, True)],
                         ids=["dense", "moe_sequential_experts", "moe_grouped_experts"])
def test_swiglu_fusion_off_for_experts_run_one_at_a_time(arch, kernels, fused):
    """Beside a GPU the SwiGLU is megatron's compiled fusion, except for MoE experts run one at a
    time (SequentialMLP), whose per-expert token counts (0 and 1 included) recompile it up to
    Dynamo's limit. Grouped experts (TE) and dense MLPs keep it."""
    caps = GPU_TE if kernels is GROUPED else GPU_BARE
    plan = build_plan(caps, kernels)
    cfg = transformer_config(preset_arch(arch), SimpleNamespace(config=ParallelConfig()), BuildOptions(),
                             use_te=plan.use_te, plan=plan)
    assert plan.bias_activation_fusion and cfg.bias_activation_fusion is fused
    assert cfg.bias_dropout_fusion
