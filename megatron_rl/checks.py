"""Value checks for configured values (the config sections, an engine's settings section, a
registered component's parameters): each failure names the field, the value and the fix. It
imports nothing of the project, so every layer may use it.

    integer("train.steps", -1, lo=0)   # ValueError: train.steps=-1: must be an integer >= 0
    number("rollout.top_p", 1.5, lo=0, hi=1, lo_open=True)
    choice("model.dtype", "fp8", ("fp32", "bf16", "fp16"))

They accept exactly the field's type (a bool is not an integer; 2.5 is not an integer), so
`train.steps=2.5` and `train.micro_batch_size=true` fail at start-up instead of mid-run. An
integer must also fit 64 bits unless its bounds say more (torch and numpy take 64-bit integers:
a seed of 2**64 failed mid-start with "Overflow when unpacking long long"). A number must be
finite unless the field says what infinity means (`finite=False`): `optim.lr=inf` would write
inf/NaN into every weight in the first update.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def integer(where: str, value, lo: int | None = None, hi: int | None = None, hint: str = "") -> None:
    ok = isinstance(value, int) and not isinstance(value, bool)
    if ok and (lo is None or value >= lo) and (hi is None or value <= hi):
        if INT64_MIN <= value <= INT64_MAX:
            return
        raise ValueError(f"{where}={value!r}: must fit a 64-bit integer ({INT64_MIN} to {INT64_MAX}){_hint(hint)}")
    bounds = " and ".join(b for b in (f">= {lo}" if lo is not None else "", f"<= {hi}" if hi is not None else "")
                          if b)
    raise ValueError(f"{where}={value!r}: must be an integer{' ' + bounds if bounds else ''}{_hint(hint)}")


def number(where: str, value, lo: float | None = None, hi: float | None = None, lo_open: bool = False,
           hi_open: bool = False, hint: str = "", finite: bool = True) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    if ok and finite and math.isinf(value):
        raise ValueError(f"{where}={value!r}: must be a finite number{_hint(hint)}")
    if ok and lo is not None:
        ok = value > lo if lo_open else value >= lo
    if ok and hi is not None:
        ok = value < hi if hi_open else value <= hi
    if ok:
        return
    parts = []
    if lo is not None:
        parts.append(f"{'>' if lo_open else '>='} {lo:g}")
    if hi is not None:
        parts.append(f"{'<' if hi_open else '<='} {hi:g}")
    raise ValueError(f"{where}={value!r}: must be a number{' ' + ' and '.join(parts) if parts else ''}{_hint(hint)}")


def choice(where: str, value, choices: Iterable) -> None:
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{where}={value!r}: choose one of {', '.join(map(str, choices))}")


def boolean(where: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{where}={value!r}: must be true or false")


def _hint(hint: str) -> str:
    return f" ({hint})" if hint else ""
