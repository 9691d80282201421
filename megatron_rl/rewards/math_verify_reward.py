"""`math`: 1.0 when the response's final answer is mathematically equal to the label, by the
`math-verify` package (`parse` extracts the answer — a \\boxed{} answer first, else the last
expression — and `verify` compares with sympy), else 0.0.

    math("", "so \\boxed{1/2}", "0.5") == 1.0      math("", "x = 3", "3") == 1.0
    math("", "the answer is 4", "3") == 0.0         math("", "no idea", "3") == 0.0

The label may be plain ("0.5", "\\frac{1}{2}") or LaTeX in $...$. A response or label that does
not parse scores 0.0 (math-verify reports its parse errors as "nothing parsed", not exceptions).

Timeouts and threads: math-verify bounds each parse/compare with signal.alarm (`timeout_s`
seconds), which only works in the main thread of the main interpreter. Called from the main
thread, a pathological expression is cut off after timeout_s and scores 0.0 (math-verify logs a
warning). Called from any other thread, this function passes timeout=None so it does not fail, but
then nothing bounds sympy's time: run it in the main thread, or in worker processes (each process's
main thread), when responses are untrusted. While it runs it owns SIGALRM.
"""
from __future__ import annotations

import threading
from functools import lru_cache

from megatron_rl.rewards.registry import register_reward

DEFAULT_TIMEOUT_S = 5


def _timeout(timeout_s: int | None) -> int | None:
    return timeout_s if threading.current_thread() is threading.main_thread() else None


@lru_cache(maxsize=4096)
def _parse_gold(label: str, timeout_s: int | None) -> tuple:
    from math_verify import parse

    gold = parse(label, parsing_timeout=timeout_s)
    if not gold and "$" not in label:
        gold = parse(f"${label}$", parsing_timeout=timeout_s)
    return tuple(gold)


def math_verify_reward(prompt: str, response: str, label: str, timeout_s: int | None = DEFAULT_TIMEOUT_S) -> float:
    from math_verify import parse, verify

    timeout = _timeout(timeout_s)
    gold = _parse_gold(label, timeout)
    if not gold:
        return 0.0
    answer = parse(response, parsing_timeout=timeout)
    if not answer:
        return 0.0
    return 1.0 if verify(list(gold), answer, timeout_seconds=timeout) else 0.0


register_reward("math")(math_verify_reward)
