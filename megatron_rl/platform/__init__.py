"""Platform compatibility layer for megatron-core: the only module that touches megatron's private names.

megatron-core assumes CUDA, and often Transformer Engine or Apex, in a handful of places.
`apply_platform_workarounds()` patches exactly the places this process needs, once, explicitly,
before a model is built. Each workaround declares the condition it is about (no CUDA, no
Transformer Engine, neither TE nor Apex, or always: see `Condition`), detected from the
libraries themselves (`capabilities()`). Each has a number (the one docs/platform.md uses), the
failure it fixes, and a probe in `tests/unit/platform/` that proves it is still needed and still
sufficient wherever its condition holds: when upstream fixes a line, that test fails and the
patch gets deleted.
"""
from megatron_rl.platform.capabilities import Capabilities, Condition, capabilities
from megatron_rl.platform.registry import (
    Workaround,
    applied_workarounds,
    apply_platform_workarounds,
    needed_workarounds,
    workarounds,
)

__all__ = ["Capabilities", "Condition", "Workaround", "applied_workarounds", "apply_platform_workarounds",
           "capabilities", "needed_workarounds", "workarounds"]
