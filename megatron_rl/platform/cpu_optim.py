"""Workarounds #10-#15: megatron-core's DDP, optimizer, checkpointing and tied embeddings without
CUDA, without Transformer Engine and Apex, or anywhere (each declares its condition).

#11 and #15 change torch process-wide; they are applied only in processes without CUDA (see
registry.apply_platform_workarounds). #12 (the grad scaler's .cuda(); docs/platform.md) is
covered by #15 and is not a separate patch.
"""
from __future__ import annotations

import importlib

import torch

from megatron_rl.platform.capabilities import Condition
from megatron_rl.platform.cpu_model import torch_proxy
from megatron_rl.platform.workaround import Workaround

_CUDA_STRING_MODULES = (
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.utils",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
)


def _cuda_strings() -> None:
    # The optimizer stack allocates small tensors with a hard-coded device="cuda" string
    # (found_inf, loss scale, grad-norm buffers, local_multi_tensor_l2_norm), which #2 does not
    # cover: give those modules a torch proxy that maps "cuda" to the CPU.
    for name in _CUDA_STRING_MODULES:
        module = importlib.import_module(name)
        module.torch = torch_proxy()


def _type_strings() -> None:
    # Params are classified by `param.type() == 'torch.cuda.FloatTensor'` (Float16 optimizer,
    # distributed optimizer, clip_grads): "TypeError: Wrapped parameters must be one of
    # torch.cuda.FloatTensor, ...". Report CPU tensors under the CUDA type name.
    original = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original(self)
            if self.device.type == "cpu" and name.startswith("torch.") and not name.startswith("torch.cuda."):
                return "torch.cuda." + name[len("torch."):]
            return name
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_


def _tensor_cuda_identity() -> None:
    # Tensor.cuda() on CPU tensors: LanguageModule.setup_embeddings_and_output_layer (tied
    # embeddings under PP > 1: `weight.data = weight.data.cuda()`), the fp16 grad scaler's
    # load_state_dict (`state_dict['scale'].cuda(...)`; #12 in docs/platform.md, which this
    # makes unnecessary) and `fully_reshardable` optimizer checkpoints. Identity on CPU.
    torch.Tensor.cuda = lambda self, *args, **kwargs: self


def _adamw_step_on_load() -> None:
    # Without TE and Apex (any device) DistributedOptimizer falls back to torch.optim.AdamW
    # (megatron's `HAVE_APEX_OR_TE = False` branches), which keeps a per-param
    # 0-dim state['step']. Three defects on checkpoint load: (a) a fresh optimizer has no state,
    # and state_dict() asserts one common step; (b) the pre-load step overwrites the restored one;
    # (c) one shared step tensor is set into every param's state and incremented once per param.
    from megatron.core.optimizer import distrib_optimizer

    if getattr(distrib_optimizer, "HAVE_APEX_OR_TE", True):
        return
    cls = distrib_optimizer.DistributedOptimizer
    orig_sharded, orig_set, orig_load = (cls.sharded_state_dict, cls._set_main_param_and_optimizer_states,
                                         cls.load_state_dict)

    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading=False, sharding_type=None,
                           metadata=None):
        if is_loading and self.init_state_fn is not None:
            self.init_state_fn(self.optimizer, self.config)
            for group in self.optimizer.param_groups:
                for param in group["params"]:
                    self.optimizer.state[param].setdefault("step", torch.tensor(0.0))
        return orig_sharded(self, model_sharded_state_dict or {}, is_loading, sharding_type, metadata)

    def set_states(self, model_param, tensors):
        group_index, order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][order]]
        step = state.pop("step", None)
        try:
            orig_set(self, model_param, {k: v for k, v in tensors.items() if k != "step"})
        finally:
            if step is not None:
                state["step"] = step

    def load_state_dict(self, state_dict):
        orig_load(self, state_dict)
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].detach().clone()

    cls.sharded_state_dict = sharded_state_dict
    cls._set_main_param_and_optimizer_states = set_states
    cls.load_state_dict = load_state_dict


def _load_under_no_grad() -> None:
    # Any platform: with fp32 params the distributed optimizer's main params are views of the
    # model's Parameters (`model_param.view(-1)[start:end]`, no detach), and
    # load_parameter_state_from_dp_reshardable copies into them outside no_grad ("a view of a leaf
    # Variable that requires grad is being used in an in-place operation"). Load under no_grad.
    from megatron.core.optimizer import distrib_optimizer

    cls = distrib_optimizer.DistributedOptimizer
    if getattr(cls.load_state_dict, "_under_no_grad", False):
        return
    inner = cls.load_state_dict

    def load_state_dict(self, state_dict):
        with torch.no_grad():
            return inner(self, state_dict)

    load_state_dict._under_no_grad = True
    cls.load_state_dict = load_state_dict


WORKAROUNDS = (
    Workaround(10, "cuda_strings", Condition.NO_CUDA,
               "AssertionError: Torch not compiled with CUDA enabled (optimizer)", _cuda_strings),
    Workaround(11, "type_strings", Condition.NO_CUDA,
               "TypeError: Wrapped parameters must be one of torch.cuda.FloatTensor", _type_strings),
    Workaround(13, "adamw_step_on_load", Condition.NO_TE_NO_APEX,
               "AssertionError in DistributedOptimizer.state_dict (step)", _adamw_step_on_load),
    Workaround(14, "load_under_no_grad", Condition.ALWAYS,
               "RuntimeError: a view of a leaf Variable that requires grad", _load_under_no_grad),
    Workaround(15, "tensor_cuda_identity", Condition.NO_CUDA,
               "AssertionError: Torch not compiled with CUDA enabled (.cuda())", _tensor_cuda_identity),
)
