"""A name -> function registry: the config names a surrogate / correction / aggregation / advantage
estimator, the trainer looks it up here. A registry is a plain dict plus a decorator.

    SURROGATES = Registry("surrogate")
    @SURROGATES.register("ppo_clip")
    def ppo_clip(...): ...
    SURROGATES.get("ppo_clip")        # KeyError listing the registered names if unknown

An entry may declare facts about itself as keyword arguments of `register` (read back with
`info(name)`), e.g. a surrogate's per-step statistics and allowed aggregations, so the trainer
and the config check handle every entry alike instead of special-casing names.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

F = TypeVar("F", bound=Callable)


class Registry:
    """Dict of named callables of one kind (`kind` only appears in error messages)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._fns: dict[str, Callable] = {}
        self._info: dict[str, dict] = {}

    def register(self, name: str, **info) -> Callable[[F], F]:
        def deco(fn: F) -> F:
            if name in self._fns:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._fns[name] = fn
            self._info[name] = info
            return fn

        return deco

    def info(self, name: str) -> dict:
        """What entry `name` declared when it was registered (KeyError if unknown)."""
        self.get(name)
        return self._info[name]

    def get(self, name: str) -> Callable:
        try:
            return self._fns[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r}; available: {', '.join(sorted(self._fns))}") from None

    def names(self) -> list[str]:
        return sorted(self._fns)

    def __contains__(self, name: object) -> bool:
        return name in self._fns

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
