"""A typed name -> spec registry: every seam of the project that the config names by a string
(loss parts, rollout engines, rollout functions, weight transports, schedules) keeps its entries in one.

    SURROGATES = Registry("surrogate", SurrogateSpec)
    SURROGATES.add("ppo_clip", SurrogateSpec(fn=ppo_clip, token_local=True))
    SURROGATES.get("ppo_clip").token_local     # KeyError listing the registered names if unknown

An entry is a frozen dataclass of its registry's spec type: what the entry is (a function, a
factory) and the facts it declares about itself (a surrogate's parameter ranges, an engine's
config section and start-up checks). The spec checks itself in its `__post_init__`, so a
misspelt declaration (`token_lcoal=True`) or a range for a parameter the function does not take
fails when the module registering it is imported, not as a silently ignored flag mid-run.

`keyword_params` and `ParamRules` are the shared vocabulary of specs whose function takes
keyword-only parameters from the config (checked by name and kind, then by declared range).
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from megatron_rl import checks

S = TypeVar("S")


class Registry(Generic[S]):
    """Named entries of one spec type (`kind` names the registry in error messages)."""

    def __init__(self, kind: str, spec: type[S]):
        self.kind = kind
        self.spec = spec
        self._entries: dict[str, S] = {}

    def add(self, name: str, entry: S) -> S:
        """Register `entry` under `name` (ValueError for a second entry of that name, TypeError for
        an entry that is not a `spec`)."""
        if not isinstance(entry, self.spec):
            raise TypeError(f"{self.kind} {name!r}: a registry entry must be a {self.spec.__name__}, got "
                            f"{type(entry).__name__}")
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = entry
        return entry

    def remove(self, name: str) -> None:
        """Forget entry `name` (a test that registered a toy entry cleans up after itself)."""
        self._entries.pop(name, None)

    def get(self, name: str) -> S:
        try:
            return self._entries[name]
        except (KeyError, TypeError):  # TypeError: an unhashable name from a config (a list)
            raise KeyError(f"unknown {self.kind} {name!r}; available: {', '.join(sorted(self._entries))}") from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        try:
            return name in self._entries
        except TypeError:
            return False

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


def keyword_params(fn: Callable) -> dict[str, inspect.Parameter]:
    """`fn`'s keyword-only parameters by name: what a config may set for it."""
    return {n: p for n, p in inspect.signature(fn).parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}


@dataclass(frozen=True)
class ParamRules:
    """The value ranges an entry declares for its function's keyword parameters, checked at start-up
    (losses/setup.py: check_values).

    limits: parameter -> keyword arguments of checks.number (lo, hi, lo_open, finite, hint).
    choices: parameter -> allowed values.
    band: (lo, hi): two parameters that must satisfy lo <= hi (else the kept band is empty).
    """

    limits: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    choices: Mapping[str, tuple] = field(default_factory=dict)
    band: tuple[str, str] | None = None

    def check_against(self, where: str, fn: Callable) -> None:
        """Every parameter named here must be a keyword-only parameter of `fn` (TypeError)."""
        known = keyword_params(fn)
        named = [*self.limits, *self.choices, *(self.band or ())]
        unknown = sorted(n for n in named if n not in known)
        if unknown:
            raise TypeError(f"{where}: declares rules for {unknown}, which are not keyword parameters of "
                            f"{getattr(fn, '__name__', fn)} ({', '.join(sorted(known)) or 'none'})")
        allowed = set(inspect.signature(checks.number).parameters) - {"where", "value"}
        for name, bounds in self.limits.items():
            extra = sorted(set(bounds) - allowed)
            if extra:
                raise TypeError(f"{where}: limits[{name!r}] has {extra}, not arguments of checks.number")
