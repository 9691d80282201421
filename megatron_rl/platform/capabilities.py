"""What this process can use (CUDA, Transformer Engine, Apex), detected from the libraries themselves.

Every platform decision keys on one of these capabilities, never on "CPU" as a stand-in for
something else: a GPU machine without Transformer Engine takes the same TE-less code paths in
megatron-core as a laptop does, and needs the same patches for them.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
from dataclasses import dataclass
from enum import Enum

import torch


def _importable(module: str) -> bool:
    """`module` imports in this process (any failure counts as absent: a TE build without its CUDA
    libraries raises OSError, not ImportError)."""
    top = module.split(".")[0]
    if importlib.util.find_spec(top) is None:
        return False
    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 - ImportError, OSError of a broken build, ...
        return False
    return True


@dataclass(frozen=True)
class Capabilities:
    """cuda: torch.cuda.is_available(). te: `transformer_engine.pytorch` imports. apex: `apex` imports.

    megatron-core decides its own fallbacks from the same imports (its `try: import
    transformer_engine ... except ImportError` blocks), so these match what megatron sees.
    """

    cuda: bool
    te: bool
    apex: bool

    @property
    def te_usable(self) -> bool:
        """Transformer Engine can run here: importable and a CUDA device to run it on."""
        return self.te and self.cuda

    def describe(self) -> str:
        yes = {True: "yes", False: "no"}
        return f"CUDA={yes[self.cuda]}, Transformer Engine={yes[self.te]}, Apex={yes[self.apex]}"


@functools.lru_cache(maxsize=1)
def capabilities() -> Capabilities:
    """This process's capabilities (detected once; importing TE is slow)."""
    return Capabilities(cuda=torch.cuda.is_available(), te=_importable("transformer_engine.pytorch"),
                        apex=_importable("apex"))


class Condition(Enum):
    """When a platform workaround is needed: the code path it patches runs only then.

    NO_CUDA: torch has no usable CUDA device (megatron-core calls torch.cuda.* or allocates on
        "cuda" unconditionally).
    NO_TE: Transformer Engine is not usable (not importable, or no CUDA to run it): megatron-core's
        local layer spec and its TE-less fallbacks are in use.
    NO_TE_NO_APEX: neither TE nor Apex imports, so megatron-core's optimizers fall back to
        torch.optim (its `HAVE_APEX_OR_TE = False` branches).
    ALWAYS: a megatron-core defect on every platform.
    """

    NO_CUDA = "no_cuda"
    NO_TE = "no_te"
    NO_TE_NO_APEX = "no_te_no_apex"
    ALWAYS = "always"

    def holds(self, caps: Capabilities) -> bool:
        if self is Condition.NO_CUDA:
            return not caps.cuda
        if self is Condition.NO_TE:
            return not caps.te_usable
        if self is Condition.NO_TE_NO_APEX:
            return not caps.te and not caps.apex
        return True

    @property
    def description(self) -> str:
        return {
            Condition.NO_CUDA: "no CUDA device",
            Condition.NO_TE: "Transformer Engine not usable (not installed, or no CUDA)",
            Condition.NO_TE_NO_APEX: "neither Transformer Engine nor Apex installed",
            Condition.ALWAYS: "every platform",
        }[self]
