"""Errors of the serving layer. Every failure the trainer can see from a served engine (vLLM's, or
any server kind with a dialect) is one of these, by name.

Cost: none; raising one is O(message).
"""
from __future__ import annotations


class ServingError(RuntimeError):
    """Base class of every serving-layer error."""


class UnsupportedError(ServingError, ValueError):
    """A configuration the engine refuses instead of producing wrong numbers (the message says
    why and what to use instead)."""


class ServerStartError(ServingError):
    """The server did not become healthy (exited, or timed out); the message has its log's tail."""


class ServerDiedError(ServingError):
    """The server kept dying or hanging and the bounded restarts are spent. The trainer should
    checkpoint and stop; no partial batch is returned."""


class RequestError(ServingError):
    """The server refused a request (HTTP 4xx): a client-side bug or a limit such as max_model_len.
    Not retried."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class BadResponseError(ServingError):
    """Responses still failed validation (malformed JSON, wrong lengths, missing or non-finite
    log-probs, ...) after the bounded retries. `count` bad responses in this call, `examples`
    holds a few of their reasons."""

    def __init__(self, message: str, count: int = 0, examples: list[str] | None = None):
        super().__init__(message)
        self.count = count
        self.examples = list(examples or [])


class ParityError(ServingError):
    """After a weight sync the server's log-probs differ from the reference by more than the
    tolerance: the server is not running the weights the trainer just exported."""

    def __init__(self, message: str, max_abs_diff: float):
        super().__init__(message)
        self.max_abs_diff = max_abs_diff


class ProbeError(ServingError):
    """The parity probe after a weight sync got no measurement: the server refused the probe or
    answered it without usable prompt log-probs. The message names the server and what was wrong."""
