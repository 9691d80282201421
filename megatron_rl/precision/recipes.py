"""Precision recipes: one name for the trainer's and the rollout engine's numerics together.

    precision.recipe=fp16_fp32head          # in YAML or on the command line
    precision.recipe=bf16 rollout.dtype=fp32   # a recipe, with one field overridden

A recipe is data: the config settings it stands for. The config loader fills them in before
validation (`expand_precision`); a field the config sets itself keeps the config's value, so a
recipe is overridable field by field. No recipe (the default) leaves model.dtype and rollout.dtype
as they are given. What each setting does:

    model.dtype              the trainer's parameters and compute (bf16/fp16 keep fp32 master
                             weights; fp16 uses megatron's dynamic loss scaling, optim.*loss_scale*)
    rollout.dtype            the rollout engine's weights and compute
    precision.fp32_lm_head   the output projection and its softmax in fp32 in the embedded
                             engine's LM head (the hidden state and the head weight upcast), as the
                             trainer's log-prob kernel computes them in every recipe (fp32 logits
                             from the model's own values). vLLM has no such option and is refused.
    rollout.quantization     FP8 GEMMs in the embedded engine (precision/fp8.py): weights quantized
                             at every sync, activations at every GEMM input, fp32 accumulation
    rollout.vllm.quantization  "fp8": FP8 weights in the vLLM server (GPU only)
    precision.fp8, precision.fp8_recipe   FP8 training through Transformer Engine (megatron-core's
                             TransformerConfig.fp8 / fp8_recipe; GPU with TE only)

The training-inference mismatch blog (docs/algorithms.md, references) predicts: fp16 in both engines
has a smaller mismatch than bf16 (more mantissa bits), an fp32 LM head lowers it further, and an
fp8 rollout widens it unless corrected. `benchmarks/precision.py` measures the CPU-runnable ones
(fp8_tensor, fp8_block and mxfp8 among them: the embedded engine's FP8 runs on the CPU).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PrecisionRecipe:
    """settings: {"section.field" or "section.sub.field": value}; doc: one line; needs: what it
    needs beyond the CPU lane (None: runs anywhere)."""

    settings: Mapping[str, Any]
    doc: str
    needs: str | None = None


PRECISION_RECIPES: dict[str, PrecisionRecipe] = {
    "fp32": PrecisionRecipe({"model.dtype": "fp32", "rollout.dtype": "fp32"},
                            "fp32 trainer and engine: the reference (no numeric mismatch beyond kernels)"),
    "bf16": PrecisionRecipe({"model.dtype": "bf16", "rollout.dtype": "bf16"},
                            "bf16 trainer and engine: the usual GPU setting"),
    "fp16": PrecisionRecipe({"model.dtype": "fp16", "rollout.dtype": "fp16"},
                            "fp16 trainer (dynamic loss scaling) and engine: more mantissa bits than bf16"),
    "bf16_fp32head": PrecisionRecipe({"model.dtype": "bf16", "rollout.dtype": "bf16", "precision.fp32_lm_head": True},
                                     "bf16 with the output projection and softmax in fp32 on both sides"),
    "fp16_fp32head": PrecisionRecipe({"model.dtype": "fp16", "rollout.dtype": "fp16", "precision.fp32_lm_head": True},
                                     "fp16 with the output projection and softmax in fp32 on both sides"),
    "fp8_tensor": PrecisionRecipe({"model.dtype": "bf16", "rollout.dtype": "bf16", "rollout.quantization": "fp8_tensor"},
                                  "bf16 trainer, embedded engine with per-tensor-scaled FP8 GEMMs"),
    "fp8_block": PrecisionRecipe({"model.dtype": "bf16", "rollout.dtype": "bf16", "rollout.quantization": "fp8_block"},
                                 "bf16 trainer, embedded engine with 128x128-block FP8 GEMMs (DeepSeek-V3)"),
    "mxfp8": PrecisionRecipe({"model.dtype": "bf16", "rollout.dtype": "bf16", "rollout.quantization": "mxfp8"},
                             "bf16 trainer, embedded engine with MXFP8 GEMMs (blocks of 32, E8M0 scales)"),
    "fp8_rollout": PrecisionRecipe({"model.dtype": "bf16", "rollout.dtype": "bf16", "rollout.backend": "vllm",
                                    "rollout.vllm.quantization": "fp8"},
                                   "bf16 trainer, FP8-quantised vLLM rollouts (pair with an IS correction)",
                                   needs="a vLLM server on a GPU"),
    "te_fp8": PrecisionRecipe({"model.dtype": "bf16", "rollout.dtype": "bf16", "precision.fp8": "hybrid",
                               "precision.fp8_recipe": "tensorwise"},
                              "FP8 training through Transformer Engine (megatron-core fp8 fields)",
                              needs="Transformer Engine on CUDA"),
}


def _get(tree: Mapping, path: str):
    node: Any = tree
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _set(tree: dict, path: str, value) -> dict:
    head, _, rest = path.partition(".")
    out = dict(tree)
    if rest:
        out[head] = _set(dict(out.get(head) or {}), rest, value)
    else:
        out[head] = value
    return out


def expand_precision(data: dict) -> dict:
    """Fill in the settings of `precision.recipe` that the config does not set itself."""
    name = _get(data, "precision.recipe")
    if name is None:
        return data
    if name not in PRECISION_RECIPES:
        raise ValueError(f"precision.recipe={name!r}: choose one of {', '.join(PRECISION_RECIPES)}")
    out = data
    for path, value in PRECISION_RECIPES[name].settings.items():
        if _get(out, path) is None:
            out = _set(out, path, value)
    return out
