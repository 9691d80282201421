"""Platform compatibility layer for megatron-core: the only package that touches megatron's private names
(the workarounds here, and `mcore_api.py`: the calls whose signature or private flags differ between
the megatron-core releases we support).

megatron-core assumes CUDA, and often Transformer Engine or Apex, in a handful of places.
`apply_platform_workarounds()` patches exactly the places this process needs, once, explicitly,
before a model is built. Each workaround declares the condition it is about (no CUDA, no
Transformer Engine, neither TE nor Apex, or always: see `Condition`), detected from the
libraries themselves (`capabilities()`). Each has a number (the one docs/platform.md uses), the
failure it fixes, and a probe in `tests/distributed/probes.py` that proves it is still needed and still
sufficient wherever its condition holds: when upstream fixes a line, that test fails. A defect
fixed in a later megatron-core release names that release (`fixed_in`): the patch is applied
only on older releases, and on newer ones its probe proves that it is not needed (each CI lane
runs its own megatron-core: 0.16.1 and 0.19.2). The patch is deleted once the oldest supported
release has the fix.
"""
from megatron_rl.platform.capabilities import Capabilities, Condition, capabilities
from megatron_rl.platform.registry import (
    applied_workarounds,
    apply_platform_workarounds,
    needed_workarounds,
    workarounds,
)
from megatron_rl.platform.workaround import Workaround, megatron_core_version

__all__ = ["Capabilities", "Condition", "Workaround", "applied_workarounds", "apply_platform_workarounds",
           "capabilities", "megatron_core_version", "needed_workarounds", "workarounds"]
