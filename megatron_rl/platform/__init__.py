"""CPU compatibility layer for megatron-core: the only module that touches megatron's private names.

megatron-core assumes CUDA in a handful of places. On a CPU-only machine (our laptop/CI lane)
`apply_cpu_workarounds()` patches exactly those places, once, explicitly, before a model is
built. It is a no-op when CUDA is available. Each workaround is registered with a number (the
numbering of the platform notes), the failure it fixes, and a probe in
`tests/unit/platform/` that proves it is still needed and still sufficient on the pinned
megatron-core version: when upstream fixes a line, that test fails and the patch gets deleted.
"""
from megatron_rl.platform.registry import (
    WORKAROUNDS,
    Workaround,
    applied_workarounds,
    apply_cpu_workarounds,
    cpu_only,
)

__all__ = ["WORKAROUNDS", "Workaround", "applied_workarounds", "apply_cpu_workarounds", "cpu_only"]
