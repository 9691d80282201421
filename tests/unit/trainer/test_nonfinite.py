"""trainer/nonfinite.py in one process: the parameter check, the skip decision of an optimizer step
(with a stand-in for megatron's optimizer, which records what was called), and the count of
non-finite updates in a row. The real loop's skips run in tests/distributed/test_nonfinite_updates.py."""
import math
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.trainer.nonfinite import (
    NonFiniteUpdates,
    NonFiniteWeights,
    StepOutcome,
    agreed_finite,
    check_parameters,
    count_in_a_row,
    guarded_step,
    nonfinite_parameters,
)


def _model(**fills) -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2).to(torch.bfloat16))
    with torch.no_grad():
        for name, value in fills.items():
            p = dict(model.named_parameters())[name]
            p.view(-1)[1] = value
    return model


def test_finite_parameters_pass_even_near_the_float_limit():
    assert nonfinite_parameters(_model(**{"0.weight": 3e38, "1.weight": -3e38}).named_parameters()) == []
    check_parameters(_model(), "the update")  # no torch.distributed: the local verdict


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_nonfinite_parameter_is_named(value):
    model = _model(**{"0.bias": value, "1.weight": value})
    assert nonfinite_parameters(model.named_parameters()) == ["0.bias", "1.weight"]
    with pytest.raises(NonFiniteWeights, match=r"the update of step 2 left inf or NaN in 2 parameter tensor\(s\) "
                                               r"\(0.bias, 1.weight\); nothing was saved .*\. Lower optim.lr"):
        check_parameters(model, "the update of step 2", "Lower optim.lr")


def test_meta_parameters_are_not_read():
    with torch.device("meta"):
        model = torch.nn.Linear(2, 2)
    assert nonfinite_parameters(model.named_parameters()) == []


def test_agreed_finite_without_distributed_is_the_local_verdict():
    assert agreed_finite([torch.tensor(1.0), torch.tensor(-2.0, dtype=torch.float64)])
    assert agreed_finite([])  # an earlier pipeline stage holds no loss
    assert not agreed_finite([torch.tensor(1.0), torch.tensor(math.nan)])
    assert not agreed_finite(iter([torch.tensor(-math.inf)]))


class FakeOptimizer:
    """megatron's optimizer as guarded_step calls it; grads scaled by clipping are recorded."""

    def __init__(self, grad_norm: float, found_inf: bool = False, clip_grad: float = 1.0):
        self.grad_norm, self.found_inf = grad_norm, found_inf
        self.config = SimpleNamespace(clip_grad=clip_grad, use_precision_aware_optimizer_no_fp8_or_ds_fp8=False)
        self.param = torch.nn.Parameter(torch.zeros(2))
        self.param.grad = torch.ones(2)
        self.calls = []

    def prepare_grads(self):
        self.calls.append("prepare_grads")
        return self.found_inf

    def get_grad_norm(self):
        self.calls.append("get_grad_norm")
        return self.grad_norm

    def get_parameters(self):
        return [self.param]

    def step_with_ready_grads(self):
        self.calls.append("step_with_ready_grads")
        return True


@pytest.fixture
def clip_calls(monkeypatch):
    """megatron's clip_grad_by_total_norm_fp32 asserts CUDA tensors (the CPU platform layer, which
    unit tests do not apply, lifts that): record its arguments instead."""
    from megatron.core.optimizer import clip_grads

    calls = []
    monkeypatch.setattr(clip_grads, "clip_grad_by_total_norm_fp32", lambda params, **kw: calls.append(kw))
    return calls


def test_a_finite_step_is_megatrons_step(clip_calls):
    opt = FakeOptimizer(grad_norm=4.0)
    assert guarded_step(opt, loss_finite=True) == StepOutcome(True, 4.0)
    assert opt.calls == ["prepare_grads", "get_grad_norm", "step_with_ready_grads"]
    assert clip_calls == [{"max_norm": 1.0, "total_norm": 4.0, "use_decoupled_grad": False}]


@pytest.mark.parametrize("grad_norm,loss_finite,reason", [(math.nan, True, "gradient norm"),
                                                          (math.inf, True, "gradient norm"),
                                                          (2.0, False, "loss"), (math.nan, False, "loss")])
def test_a_nonfinite_loss_or_gradient_norm_skips_the_update(clip_calls, grad_norm, loss_finite, reason):
    opt = FakeOptimizer(grad_norm=grad_norm)
    out = guarded_step(opt, loss_finite=loss_finite)
    assert not out.applied and out.nonfinite == reason and not out.overflow
    assert "step_with_ready_grads" not in opt.calls and clip_calls == []  # weights and Adam state untouched


def test_an_fp16_overflow_is_the_loss_scalers_skip(clip_calls):
    out = guarded_step(FakeOptimizer(grad_norm=1.0, found_inf=True), loss_finite=True)
    assert out.overflow and not out.applied and out.nonfinite is None and math.isnan(out.grad_norm)
    assert guarded_step(FakeOptimizer(1.0, found_inf=True), loss_finite=False).nonfinite == "loss"


def test_clip_grad_zero_does_not_clip(clip_calls):
    assert guarded_step(FakeOptimizer(grad_norm=4.0, clip_grad=0.0)).applied and clip_calls == []


def test_updates_in_a_row_stop_the_run_at_the_limit():
    skipped, applied = StepOutcome(False, math.nan, nonfinite="gradient norm"), StepOutcome(True, 1.0)
    overflow = StepOutcome(False, math.nan, overflow=True)
    assert count_in_a_row(0, skipped, 3, "RL step 1, update 1 of 2") == 1
    assert count_in_a_row(1, overflow, 3, "w") == 1      # the fp16 loss scaler's skips are its own business
    assert count_in_a_row(2, applied, 3, "w") == 0       # a finite update ends the run of skips
    with pytest.raises(NonFiniteUpdates, match=r"RL step 4, update 2 of 2: the gradient norm is not finite .*; 3 "
                                               r"update\(s\) in a row skipped .*train.max_nonfinite_updates=3"):
        count_in_a_row(2, skipped, 3, "RL step 4, update 2 of 2")
    with pytest.raises(NonFiniteUpdates, match="train.max_nonfinite_updates=1"):
        count_in_a_row(0, skipped, 1, "SFT step 1")
