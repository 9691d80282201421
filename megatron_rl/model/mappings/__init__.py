"""Weight-name mappings per architecture (data), and the registry that picks one."""
from megatron_rl.model.mappings.base import Kind, Param, Scope, from_shards, to_local_shard
from megatron_rl.model.mappings.qwen3 import QWEN3, QWEN3_MOE, TIED_HEAD, UNTIED_HEAD

_REGISTRY = {"qwen3": QWEN3, "qwen3_moe": QWEN3_MOE}


def mapping_for(arch) -> tuple[Param, ...]:
    """The Param entries for `arch` (a ModelArch), including the right output-layer entry."""
    if arch.arch not in _REGISTRY:
        raise KeyError(f"no weight mapping for arch {arch.arch!r}; available: {sorted(_REGISTRY)}")
    return _REGISTRY[arch.arch] + (TIED_HEAD if arch.tie_word_embeddings else UNTIED_HEAD)


__all__ = ["Kind", "Param", "Scope", "from_shards", "mapping_for", "to_local_shard"]
