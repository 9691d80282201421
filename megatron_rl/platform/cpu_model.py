"""Workarounds #1-#9, #16 and #17: building and running megatron-core GPT/MoE models without CUDA (gloo) or
without Transformer Engine (megatron-core's local layer spec). Each declares its condition.

(#4, `add_bias_linear=False`, is a model setting, not a patch: see megatron_rl.model.builder.)
"""
from __future__ import annotations

import contextlib
import types

import torch

from megatron_rl.platform.capabilities import Condition
from megatron_rl.platform.workaround import Workaround


def torch_proxy() -> types.ModuleType:
    """A stand-in `torch` module whose tensor factories map device='cuda' to the CPU.

    Assigned as the `torch` global of megatron modules that hard-code the string "cuda".
    """

    class _TorchProxy(types.ModuleType):
        def __getattr__(self, name):
            return getattr(torch, name)

    proxy = _TorchProxy("torch")

    def _wrap(fn):
        def factory(*args, **kwargs):
            device = kwargs.get("device")
            if device is not None and str(device).startswith("cuda"):
                kwargs["device"] = "cpu"
            if kwargs.get("pin_memory"):
                kwargs["pin_memory"] = False
            return fn(*args, **kwargs)

        return factory

    for name in ("zeros", "ones", "empty", "full", "tensor", "empty_like", "zeros_like", "arange"):
        setattr(proxy, name, _wrap(getattr(torch, name)))
    return proxy


def _rng_tracker() -> None:
    # CudaRNGStatesTracker (model_parallel_cuda_manual_seed, get_cuda_rng_tracker().fork()) calls
    # torch.cuda RNG APIs: "AssertionError: Torch not compiled with CUDA enabled".
    import megatron.core.tensor_parallel.random as mrand

    def cpu_get(device="cuda"):
        return torch.get_rng_state()

    torch.cuda.get_rng_state = cpu_get
    torch.cuda.random.get_rng_state = cpu_get
    torch.cuda.manual_seed = torch.manual_seed
    mrand._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)


def _current_device() -> None:
    # RoPE, router, TP mappings allocate on torch.cuda.current_device().
    torch.cuda.current_device = lambda: torch.device("cpu")


def _te_general_gemm() -> None:
    # Without Transformer Engine (any device): megatron-core 0.16 binds moe_utils.te_general_gemm
    # only inside its `import transformer_engine` try-block, but RouterGatingLinearFunction tests
    # it unconditionally: "NameError: name 'te_general_gemm'". Fixed in 0.17.0, which binds it
    # (and the other TE kernels) to None in an `else:` branch.
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _synchronize() -> None:
    # dist_checkpointing and parallel_state call torch.cuda.synchronize().
    torch.cuda.synchronize = lambda *a, **k: None


class _FakeEvent:
    def synchronize(self):
        pass

    def wait(self, *a, **k):
        pass

    def record(self, *a, **k):
        pass


class _FakeStream:
    def __init__(self, *a, **k):
        pass

    def wait_stream(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def record_event(self, *a, **k):
        return _FakeEvent()

    def synchronize(self):
        pass


def _streams() -> None:
    # MoEAlltoAllTokenDispatcher creates torch.cuda.Stream() for its device-to-host copies:
    # "RuntimeError: torch.cuda.Stream requires CUDA support". On CPU everything is synchronous.
    current = _FakeStream()
    torch.cuda.Stream = _FakeStream
    torch.cuda.Event = _FakeEvent
    torch.cuda.current_stream = lambda *a, **k: current
    torch.cuda.default_stream = lambda *a, **k: current
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()


def _sp_torch_norm() -> None:
    # Without Transformer Engine (any device) the local layer spec builds its RMSNorms as
    # WrappedTorchNorm (TE's spec uses TENorm). MoE with TP>1 requires sequence parallelism,
    # but WrappedTorchNorm asserts
    # "sequence parallel not supported by torch LayerNorm". A plain torch norm is correct under
    # SP as long as its parameters carry `sequence_parallel=True`, so that finalize_model_grads
    # all-reduces their gradients over TP.
    from megatron.core.transformer import torch_norm

    def new(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False, zero_centered_gamma=False,
            normalization="LayerNorm"):
        assert not config.layernorm_zero_centered_gamma, "zero_centered_gamma not supported by torch norms"
        assert not config.persist_layer_norm, "persist_layer_norm not supported by torch norms"
        norm_cls = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}[config.normalization]
        norm = norm_cls(normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm

    torch_norm.WrappedTorchNorm.__new__ = new


def _split_sizes_numpy() -> None:
    # maybe_move_tensor_to_cpu(..., as_numpy=True) converts only CUDA tensors; on CPU the
    # alltoall split sizes stay tensors and gloo's all_to_all_single raises
    # "TypeError: all_to_all_single(): incompatible function arguments".
    from megatron.core.transformer.moe import token_dispatcher

    def to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor):
            tensor = tensor.cpu()
            if as_numpy:
                tensor = tensor.numpy()
        return tensor

    token_dispatcher.maybe_move_tensor_to_cpu = to_cpu


def _schedules_device() -> None:
    # pipeline_parallel.schedules: torch.zeros([], dtype=torch.int, device="cuda").
    from megatron.core.pipeline_parallel import schedules

    schedules.torch = torch_proxy()


def _mla_local_attention() -> None:
    # Without Transformer Engine (any device) the local spec's core attention is megatron's
    # DotProductAttention, whose __init__ has no k_channels / v_channels, while
    # MLASelfAttention passes them (its keys are qk_nope + qk_rope wide, its values v_head_dim):
    # "TypeError: DotProductAttention.__init__() got an unexpected keyword argument 'k_channels'".
    # Its forward takes the head sizes from the tensors except the context's width, which it
    # computes from kv_channels; with the widths given, that is heads x v_channels.
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    original = DotProductAttention.__init__
    if getattr(original, "_accepts_mla_channels", False):
        return

    def init(self, *args, k_channels=None, v_channels=None, **kwargs):
        original(self, *args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_attention_head = v_channels
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition
        if k_channels is not None and kwargs.get("softmax_scale") is None:
            raise ValueError("k_channels without softmax_scale: MLA passes its own scale")

    init._accepts_mla_channels = True
    DotProductAttention.__init__ = init


def _mla_te_globals() -> None:
    # Without Transformer Engine, multi_latent_attention's TE-dependent globals are wrong, though
    # differently per release. megatron-core 0.16 imports the TE wrappers from
    # megatron.core.extensions (which imports without TE, its classes placeholder mocks), so it
    # sets HAVE_TE = True and MLASelfAttention runs isinstance(linear_proj, <mock>): "TypeError:
    # isinstance() arg 2 must be a type". From 0.17 it binds the TE names and, with them,
    # megatron's own duplicated `Linear` (post_training.modelopt.layers, no TE needed) to None, so
    # a spec with that Linear as a down projection is refused: "ValueError: Unsupported
    # linear_q_down_proj". The builder uses it (see model/builder.py for why), on every release.
    from megatron.core.post_training.modelopt.layers import Linear
    from megatron.core.transformer import multi_latent_attention

    if not isinstance(multi_latent_attention.TELinear, type):
        multi_latent_attention.HAVE_TE = False
    if multi_latent_attention.Linear is None:
        multi_latent_attention.Linear = Linear


WORKAROUNDS = (
    Workaround(1, "rng_tracker", Condition.NO_CUDA,
               "AssertionError: Torch not compiled with CUDA enabled (RNG tracker)", _rng_tracker),
    Workaround(2, "current_device", Condition.NO_CUDA,
               "AssertionError: Torch not compiled with CUDA enabled (current_device)", _current_device),
    Workaround(3, "te_general_gemm", Condition.NO_TE, "NameError: name 'te_general_gemm' is not defined",
               _te_general_gemm, fixed_in="0.17.0"),
    Workaround(5, "synchronize", Condition.NO_CUDA,
               "AssertionError: Torch not compiled with CUDA enabled (synchronize)", _synchronize),
    Workaround(6, "streams", Condition.NO_CUDA, "RuntimeError: torch.cuda.Stream requires CUDA support",
               _streams),
    Workaround(7, "sp_torch_norm", Condition.NO_TE,
               "AssertionError: sequence parallel not supported by torch LayerNorm", _sp_torch_norm),
    Workaround(8, "split_sizes_numpy", Condition.NO_CUDA,
               "TypeError: all_to_all_single(): incompatible function arguments", _split_sizes_numpy),
    Workaround(9, "schedules_device", Condition.NO_CUDA,
               "AssertionError: Torch not compiled with CUDA enabled (schedules)", _schedules_device),
    Workaround(16, "mla_local_attention", Condition.NO_TE,
               "TypeError: DotProductAttention.__init__() got an unexpected keyword argument 'k_channels'",
               _mla_local_attention),
    Workaround(17, "mla_te_globals", Condition.NO_TE,
               "TypeError: isinstance() arg 2 must be a type (0.16); ValueError: Unsupported linear_q_down_proj "
               "(0.17 on)", _mla_te_globals),
)
