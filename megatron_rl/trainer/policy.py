"""The trainable policy: megatron model + optimizer + the weight export that feeds engines."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rl.model import BuildOptions, ModelArch, build_gpt_model
from megatron_rl.model.hf_files import HfInputError, SafetensorsReader, check_weights, load_arch
from megatron_rl.model.hf_io import export_hf_weights, load_hf_weights
from megatron_rl.model.presets import preset_arch
from megatron_rl.parallel import ParallelGroups
from megatron_rl.trainer.stack import OptimSettings, build_optimizer, release_model, wrap_model


@dataclass
class Policy:
    arch: ModelArch
    groups: ParallelGroups
    model: object  # megatron DDP(Float16Module?(GPTModel))
    optimizer: object
    settings: OptimSettings

    def export(self, dtype: torch.dtype | None = None, to: str | int = "all"):
        """HF checkpoint-format (name, tensor) pairs of the current weights (collective; `to`: which
        rank gets which stage's tensors, model/hf_io.py: export_hf_weights)."""
        return export_hf_weights(self.model, self.arch, self.groups, dtype=dtype, to=to)

    def release(self) -> None:
        """End of the policy's life: its model and groups can be freed (stack.release_model). It
        cannot train afterwards."""
        release_model(self.model)
        self.optimizer = None


def arch_from_config(model_section, vocab_size: int | None = None) -> ModelArch:
    """ModelArch from the model section: a HF dir's config.json, or a preset + overrides.

    vocab_size: the tokenizer's size, used for presets (a HF dir brings its own).
    A HF dir is checked whole before anything is built from it (model/hf_files.py): its
    config.json's values, its safetensors headers, and that the weights are the ones config.json
    describes; ValueError naming model.hf_dir, the file and the value.
    """
    if model_section.hf_dir:
        try:
            arch = load_arch(model_section.hf_dir)
            check_weights(SafetensorsReader(model_section.hf_dir), arch)
        except HfInputError as e:
            raise ValueError(f"model.hf_dir={model_section.hf_dir}: "
                             f"{str(e).removeprefix(model_section.hf_dir + ': ')}") from None
        return arch
    overrides = dict(model_section.overrides or {})
    if vocab_size is not None:
        overrides.setdefault("vocab_size", vocab_size)
    return preset_arch(model_section.arch, model_section.size, **overrides)


def build_policy(model_section, optim, groups: ParallelGroups, arch: ModelArch, seed: int,
                 routing_replay: bool = False, precision=None) -> Policy:
    """Build, (optionally) load HF weights, wrap for training and attach the optimizer.

    optim: the config's OptimSection; the training precision is model_section.dtype;
    precision: the config's PrecisionSection (FP8 training fields), or None."""
    fp8 = {} if precision is None or precision.fp8 is None else {"fp8": precision.fp8,
                                                                "fp8_recipe": precision.fp8_recipe}
    opts = BuildOptions(**fp8, dtype=model_section.dtype, seed=seed, init_std=model_section.init_std,
                        moe_aux_loss_coeff=model_section.moe_aux_loss_coeff, routing_replay=routing_replay,
                        recompute=model_section.recompute)
    model = build_gpt_model(arch, groups, opts)
    if model_section.hf_dir:
        load_hf_weights(model, arch, groups, SafetensorsReader(model_section.hf_dir))
    settings = OptimSettings(optim, dtype=model_section.dtype)
    wrapped = wrap_model(model, settings)
    return Policy(arch, groups, wrapped, build_optimizer(wrapped, settings), settings)
