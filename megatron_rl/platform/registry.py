"""Registry of CPU workarounds and the single entry point that applies them."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Workaround:
    """One patch of megatron-core (or torch) for CPU-only processes.

    number: stable id (matches the platform notes and the tests).
    fixes: the error the unpatched call raises, so a reader can grep for it.
    apply: idempotent function that installs the patch.
    """

    number: int
    name: str
    fixes: str
    apply: Callable[[], None]


_APPLIED: set[int] = set()


def cpu_only() -> bool:
    """True when this process has no usable CUDA device (the CPU lane)."""
    return not torch.cuda.is_available()


def _all() -> tuple[Workaround, ...]:
    from megatron_rl.platform import cpu_model, cpu_optim

    return cpu_model.WORKAROUNDS + cpu_optim.WORKAROUNDS


WORKAROUNDS: tuple[Workaround, ...] = ()  # filled lazily (megatron imports are heavy)


def apply_cpu_workarounds(skip: Iterable[int] = (), force: bool = False) -> list[int]:
    """Apply every registered CPU workaround not in `skip`; return the numbers applied now.

    No-op (returns []) when CUDA is available, unless `force` (used by tests on CPU anyway).
    Idempotent: a workaround is applied at most once per process.
    """
    global WORKAROUNDS
    if not (cpu_only() or force):
        return []
    if not WORKAROUNDS:
        WORKAROUNDS = _all()
    skip = set(skip)
    done = []
    for w in WORKAROUNDS:
        if w.number in skip or w.number in _APPLIED:
            continue
        w.apply()
        _APPLIED.add(w.number)
        done.append(w.number)
    return done


def applied_workarounds() -> frozenset[int]:
    return frozenset(_APPLIED)
