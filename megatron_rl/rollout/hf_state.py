"""HF checkpoint-format tensors -> the in-memory state of a `transformers` model.

Checkpoints (and `export_hf_weights`) name MoE experts one by one
(`model.layers.0.mlp.experts.3.gate_proj.weight` [I, H]), while transformers 5 keeps them
fused in memory:

    mlp.experts.gate_up_proj [E, 2*I, H] = per expert e: cat([gate_e, up_e], dim=0)
    mlp.experts.down_proj    [E, H, I]   = per expert e: down_e

(gate first: `Qwen3MoeExperts.forward` does `gate, up = linear(x, gate_up_proj[e]).chunk(2)`).
Older transformers kept one module per expert, so the checkpoint names are the model's names.
`checkpoint_layout` reads the model's own parameter names and shapes and says, for every
checkpoint tensor it expects, which slice of which model parameter it fills; the fused layouts
are data (`FUSED_RULES`, and per family `rules_for`), so a model that has per-expert modules
simply matches none of them. Mixtral's checkpoints also rename the MoE block
(`block_sparse_moe.experts.{e}.w1|w3|w2`, `block_sparse_moe.gate`) while transformers 5 calls it
`mlp`: its rules carry the rename.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FusedRule:
    """A fused model parameter [E, R, C] and the per-expert checkpoint tensors it holds.

    model: regex on the model's parameter name; its group `prefix` fills the templates.
    parts: checkpoint name templates ({prefix}, {expert}) stacked along dim 1 in this order,
        each [R / len(parts), C].
    per_expert: False for a plain rename: the parameter is the one checkpoint tensor parts[0].
    """

    model: str
    parts: tuple[str, ...]
    per_expert: bool = True


FUSED_RULES: tuple[FusedRule, ...] = (
    FusedRule(r"(?P<prefix>.+\.mlp\.experts)\.gate_up_proj",
              ("{prefix}.{expert}.gate_proj.weight", "{prefix}.{expert}.up_proj.weight")),
    FusedRule(r"(?P<prefix>.+\.mlp\.experts)\.down_proj", ("{prefix}.{expert}.down_proj.weight",)),
)
_MIXTRAL = "{prefix}.block_sparse_moe"
MIXTRAL_RULES: tuple[FusedRule, ...] = (  # w1 = gate, w3 = up, w2 = down
    FusedRule(r"(?P<prefix>.+)\.mlp\.experts\.gate_up_proj",
              (_MIXTRAL + ".experts.{expert}.w1.weight", _MIXTRAL + ".experts.{expert}.w3.weight")),
    FusedRule(r"(?P<prefix>.+)\.mlp\.experts\.down_proj", (_MIXTRAL + ".experts.{expert}.w2.weight",)),
    FusedRule(r"(?P<prefix>.+)\.mlp\.gate\.weight", (_MIXTRAL + ".gate.weight",), per_expert=False),
)


def rules_for(arch: str) -> tuple[FusedRule, ...]:
    """The rules of family `arch` (a ModelArch.arch); the Qwen naming is also every dense family's."""
    return MIXTRAL_RULES if arch == "mixtral" else FUSED_RULES


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: `param[expert, rows]` (expert None = the whole param)."""

    param: str
    expert: int | None = None
    rows: tuple[int, int] | None = None  # [start, stop) along the dim after the expert dim


def checkpoint_layout(model_shapes: Mapping[str, tuple[int, ...]],
                      rules: Iterable[FusedRule] = FUSED_RULES) -> dict[str, Target]:
    """Checkpoint tensor name -> Target, for every tensor a checkpoint of this model holds.

    model_shapes: the model's parameter name -> shape (deduplicated: a tied alias such as
    `lm_head.weight` is not listed, see `tied_aliases`).
    """
    compiled = [(re.compile(r.model), r) for r in rules]
    layout: dict[str, Target] = {}
    for name, shape in model_shapes.items():
        for pattern, rule in compiled:
            if (m := pattern.fullmatch(name)) is None:
                continue
            if not rule.per_expert:
                layout[rule.parts[0].format(prefix=m["prefix"])] = Target(name)
                break
            parts = rule.parts
            num_experts, rows = shape[0], shape[1]
            if rows % len(parts):
                raise ValueError(f"{name} {tuple(shape)}: dim 1 is not divisible into {len(parts)} parts")
            step = rows // len(parts)
            for e in range(num_experts):
                for k, template in enumerate(parts):
                    ckpt = template.format(prefix=m["prefix"], expert=e)
                    layout[ckpt] = Target(name, e, (k * step, (k + 1) * step))
            break
        else:
            layout[name] = Target(name)
    return layout


def tied_aliases(model: torch.nn.Module) -> set[str]:
    """State-dict names that share storage with another parameter (tied `lm_head.weight`)."""
    unique = {n for n, _ in model.named_parameters()}
    return {n for n, _ in model.named_parameters(remove_duplicate=False)} - unique


def state_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters and the checkpointed (persistent) buffers, such as DeepSeek-V3's router
    `e_score_correction_bias`; not RoPE tables, which the model recomputes."""
    out = dict(model.named_parameters())
    saved = model.state_dict(keep_vars=True).keys()
    out.update((n, b) for n, b in model.named_buffers() if n in saved)
    return out


class CheckpointLoader:
    """Copies HF checkpoint-format tensors into `model` one at a time (`take`), casting to its
    dtype; `finish` checks that every tensor the model needs came exactly once. A tied alias (e.g.
    `lm_head.weight` under tie_word_embeddings) is accepted and skipped, since the tensor it shares
    is loaded under its own name. For a stream with several readers (a weight sync that also
    feeds the parity probe's reference); `load_checkpoint_tensors` for one."""

    def __init__(self, model: torch.nn.Module, rules: Iterable[FusedRule] = FUSED_RULES):
        self.params = state_tensors(model)
        self.layout = checkpoint_layout({n: tuple(p.shape) for n, p in self.params.items()}, rules)
        self.aliases = tied_aliases(model)
        self.seen: set[str] = set()
        self.unexpected: list[str] = []

    @torch.no_grad()
    def take(self, name: str, tensor: torch.Tensor) -> None:
        """Raises KeyError on a tensor given twice, ValueError on a shape mismatch."""
        target = self.layout.get(name)
        if target is None:
            if name not in self.aliases:
                self.unexpected.append(name)
            return
        if name in self.seen:
            raise KeyError(f"checkpoint tensor {name!r} was given twice")
        self.seen.add(name)
        dst = self.params[target.param]
        if target.expert is not None:
            dst = dst[target.expert]
        if target.rows is not None:
            dst = dst[target.rows[0]:target.rows[1]]
        if tuple(tensor.shape) != tuple(dst.shape):
            where = target.param if target.expert is None else f"{target.param}[{target.expert}]"
            raise ValueError(f"shape mismatch: checkpoint {name!r} is {tuple(tensor.shape)}, "
                             f"{where} slot is {tuple(dst.shape)}")
        dst.copy_(tensor)

    def finish(self) -> None:
        """Raises KeyError listing unexpected or missing names."""
        missing = sorted(self.layout.keys() - self.seen)
        if self.unexpected or missing:
            raise KeyError(f"weights do not match the model: {len(self.unexpected)} unexpected "
                           f"{sorted(self.unexpected)[:5]}, {len(missing)} missing {missing[:5]}")


def load_checkpoint_tensors(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]],
                            rules: Iterable[FusedRule] = FUSED_RULES) -> None:
    """Copy HF checkpoint-format (name, tensor) pairs into `model` (see CheckpointLoader).

    Every checkpoint tensor the model needs must arrive exactly once. Raises KeyError listing
    unexpected or missing names and ValueError on a shape mismatch. Tensors stream in one at a
    time; on error the model may be partly updated.
    """
    loader = CheckpointLoader(model, rules)
    for name, tensor in named_tensors:
        loader.take(name, tensor)
    loader.finish()
