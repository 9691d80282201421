"""Weight-name mappings per architecture (data), and the registry that picks one."""
from megatron_rl.model.mappings.base import Kind, Param, Scope, from_shards, to_local_shard
from megatron_rl.model.mappings.common import TIED_HEAD, UNTIED_HEAD
from megatron_rl.model.mappings.families import REGISTRY


def mapping_for(arch) -> tuple[Param, ...]:
    """The Param entries for `arch` (a ModelArch), including the right output-layer entry."""
    if arch.arch not in REGISTRY:
        raise KeyError(f"no weight mapping for arch {arch.arch!r}; available: {sorted(REGISTRY)}")
    return REGISTRY[arch.arch] + (TIED_HEAD if arch.tie_word_embeddings else UNTIED_HEAD)


__all__ = ["Kind", "Param", "Scope", "from_shards", "mapping_for", "to_local_shard"]
