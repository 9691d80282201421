"""Registry of platform workarounds and the single entry point that applies those this process needs."""
from __future__ import annotations

from collections.abc import Iterable

from megatron_rl.platform import cpu_model, cpu_optim
from megatron_rl.platform.capabilities import Capabilities, capabilities
from megatron_rl.platform.workaround import Workaround

_APPLIED: set[int] = set()


def workarounds() -> tuple[Workaround, ...]:
    """Every registered workaround, in number order (whether or not this process needs it)."""
    return tuple(sorted(cpu_model.WORKAROUNDS + cpu_optim.WORKAROUNDS, key=lambda w: w.number))


def needed_workarounds(caps: Capabilities | None = None, mcore: str | None = None) -> tuple[Workaround, ...]:
    """The workarounds a process with `caps` on megatron-core release `mcore` (defaults: this
    process's) needs."""
    caps = capabilities() if caps is None else caps
    return tuple(w for w in workarounds() if w.needed(caps, mcore))


def apply_platform_workarounds(skip: Iterable[int] = ()) -> list[int]:
    """Apply every workaround this process needs (see `needed_workarounds`) that is not in `skip`.

    Call it once, before megatron-core builds anything (pretrain_rl.py, the tools and the tests
    do). Returns the numbers applied by this call: [] on a GPU machine with Transformer Engine
    and Apex, all of them on a CPU-only one. Idempotent: each patch is applied at most once per
    process.
    """
    skip = set(skip)
    done = []
    for w in needed_workarounds():
        if w.number in skip or w.number in _APPLIED:
            continue
        w.apply()
        _APPLIED.add(w.number)
        done.append(w.number)
    return done


def applied_workarounds() -> frozenset[int]:
    """Numbers of the workarounds applied in this process so far."""
    return frozenset(_APPLIED)
