"""Process groups, built once in the entry point and passed down explicitly."""
from megatron_rl.parallel.state import (
    ParallelConfig,
    ParallelGroups,
    destroy_parallel,
    init_distributed,
    init_parallel,
)

__all__ = ["ParallelConfig", "ParallelGroups", "destroy_parallel", "init_distributed", "init_parallel"]
