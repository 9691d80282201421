"""The embedded engine's FP8 rollouts (rollout.quantization): which layers are swapped, their GEMM
against a float64 matmul of the FP8 inputs, log-probs further from fp32 than bf16's, and weight
syncs that quantize again."""
import pytest
import torch

from megatron_rl.precision.fp8 import FP8_FORMATS
from megatron_rl.rollout.embedded import EmbeddedEngine
from megatron_rl.rollout.fp8_modules import Fp8Experts, Fp8Linear, fp8_linear
from megatron_rl.rollout.types import SamplingParams
from tests.unit.rollout.conftest import prompts_of

FORMATS = ["fp8_tensor", "fp8_block", "mxfp8"]


def _engine(checkpoint, **kw):
    arch, _, ckpt = checkpoint
    engine = EmbeddedEngine(arch, **kw)
    engine.update_weights(ckpt.items(), version=1)
    return engine


@pytest.fixture(scope="module")
def engines(moe_checkpoint):
    out = {"fp32": _engine(moe_checkpoint, dtype="fp32"), "bf16": _engine(moe_checkpoint, dtype="bf16")}
    out.update({f: _engine(moe_checkpoint, dtype="bf16", quantization=f) for f in FORMATS})
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_gemms_are_swapped_as_vllm_serves_fp8(engines, fmt):
    model = engines[fmt].model
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, Fp8Linear) and isinstance(layer.self_attn.o_proj, Fp8Linear)
    assert isinstance(layer.mlp.experts, Fp8Experts)
    assert not isinstance(model.lm_head, Fp8Linear) and not isinstance(layer.mlp.gate, Fp8Linear)
    assert not any(isinstance(m, Fp8Linear) for n, m in model.named_modules() if n.endswith("gate"))
    # the parameters keep their names: a weight sync loads them as before
    assert "model.layers.0.self_attn.q_proj.weight" in dict(model.named_parameters())
    assert len(engines[fmt].fp8_layers) == sum(isinstance(m, (Fp8Linear, Fp8Experts)) for m in model.modules())


@pytest.mark.parametrize("fmt", FORMATS)
def test_engine_gemm_is_the_fp64_matmul_of_the_fp8_inputs(engines, fmt):
    layer = engines[fmt].model.model.layers[1].mlp.experts if fmt == "mxfp8" else \
        engines[fmt].model.model.layers[1].self_attn.q_proj
    spec = FP8_FORMATS.get(fmt)
    w = layer.qweight if isinstance(layer, Fp8Linear) else layer.qgate_up[0]
    weight = layer.weight if isinstance(layer, Fp8Linear) else layer.gate_up_proj[0]
    ref_w = spec.quantize_weight(weight)
    assert torch.equal(w.values.view(torch.uint8), ref_w.values.view(torch.uint8))
    x = (torch.randn(2, 7, weight.shape[1], generator=torch.Generator().manual_seed(0)) * 2).bfloat16()
    xd = spec.quantize_activation(x.reshape(-1, x.shape[-1])).dequantize(torch.float64)
    wd = w.dequantize(torch.float64)
    ref = (xd @ wd.T).view(2, 7, -1)
    bound = weight.shape[1] * 2.0 ** -23 * (xd.abs() @ wd.abs().T).view(2, 7, -1)
    y = fp8_linear(x, w, spec)
    assert y.dtype == torch.float32 and ((y.double() - ref).abs() <= bound).all()
    assert ((ref - (x.double() @ weight.double().T)).abs() > bound).any()  # FP8 rounding is not fp32 error
    if isinstance(layer, Fp8Linear):  # the layer returns it in the engine's dtype
        assert torch.equal(layer(x), y.bfloat16())


def _scores(engine, seqs):
    """Log-probs of every next token of the given sequences under the engine's model, [N, L-1]."""
    ids = torch.tensor(seqs)
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def test_fp8_logprobs_are_further_from_fp32_than_bf16(engines, moe_checkpoint):
    arch = moe_checkpoint[0]
    out = engines["fp32"].generate(prompts_of([6] * 8, arch.vocab_size), n=2,
                                   sampling=SamplingParams(temperature=1.0, max_tokens=8, seed=1))
    seqs = [s.prompt_ids.tolist() + s.response_ids.tolist() for row in out for s in row]
    seqs = [q for q in seqs if len(q) == 14]
    ref = _scores(engines["fp32"], seqs)
    diff = {name: float((_scores(e, seqs) - ref).abs().mean()) for name, e in engines.items()}
    assert diff["fp32"] == 0
    for fmt in FORMATS:
        assert diff[fmt] > 2 * diff["bf16"], diff


@pytest.mark.parametrize("fmt", FORMATS)
def test_weight_sync_quantizes_again(moe_checkpoint, fmt):
    arch, _, ckpt = moe_checkpoint
    engine = _engine(moe_checkpoint, dtype="bf16", quantization=fmt)
    q_proj, experts = engine.model.model.layers[0].self_attn.q_proj, engine.model.model.layers[0].mlp.experts
    before = (q_proj.qweight.values.float().clone(), q_proj.qweight.scale.float().clone(),
              experts.qdown[1].scale.float().clone())
    sampling = SamplingParams(temperature=1.0, max_tokens=4, seed=0)
    prompts = prompts_of([5, 5], arch.vocab_size)
    lp_before = [s.rollout_logprobs for row in engine.generate(prompts, 2, sampling) for s in row]
    engine.update_weights(((k, v * 1.5 if v.dim() >= 2 else v) for k, v in ckpt.items()), version=2)
    spec = FP8_FORMATS.get(fmt)
    assert torch.equal(q_proj.qweight.values.float(), spec.quantize_weight(q_proj.weight).values.float())
    assert not torch.equal(q_proj.qweight.scale.float(), before[1])  # 1.5 x the weights: 1.5 x an amax scale,
    assert not torch.equal(experts.qdown[1].scale.float(), before[2])  # and MX's power of two moves up for some
    assert torch.equal(experts.qdown[1].scale.float(), spec.quantize_weight(experts.down_proj[1]).scale.float())
    lp_after = [s.rollout_logprobs for row in engine.generate(prompts, 2, sampling) for s in row]
    assert any(a.shape != b.shape or not torch.equal(a, b) for a, b in zip(lp_before, lp_after))
    engine.close()
