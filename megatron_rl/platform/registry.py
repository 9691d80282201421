"""Registry of platform workarounds and the single entry point that applies those this process needs."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from megatron_rl.platform.capabilities import Capabilities, Condition, capabilities


@dataclass(frozen=True)
class Workaround:
    """One patch of megatron-core (or torch) for a platform where megatron-core's code path fails.

    number: stable id (docs/platform.md and tests/unit/platform use it).
    needed_when: the platform condition under which the patched code path fails.
    fixes: the error the unpatched call raises, so a reader can grep for it.
    apply: idempotent function that installs the patch.
    defect_present: for a defect that a later megatron-core release fixed, tells whether the
        installed release still has it (None: no release known to fix it). A fixed defect needs
        no patch; the workaround is deleted once the oldest supported release has the fix.
    """

    number: int
    name: str
    needed_when: Condition
    fixes: str
    apply: Callable[[], None]
    defect_present: Callable[[], bool] | None = None

    def needed(self, caps: Capabilities) -> bool:
        """Whether this process needs the patch: its condition holds and the defect is there."""
        if not self.needed_when.holds(caps):
            return False
        return self.defect_present is None or self.defect_present()


_APPLIED: set[int] = set()


def workarounds() -> tuple[Workaround, ...]:
    """Every registered workaround, in number order (whether or not this process needs it)."""
    from megatron_rl.platform import cpu_model, cpu_optim

    return tuple(sorted(cpu_model.WORKAROUNDS + cpu_optim.WORKAROUNDS, key=lambda w: w.number))


def needed_workarounds(caps: Capabilities | None = None) -> tuple[Workaround, ...]:
    """The workarounds a process with `caps` (default: this one's) needs."""
    caps = capabilities() if caps is None else caps
    return tuple(w for w in workarounds() if w.needed(caps))


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
