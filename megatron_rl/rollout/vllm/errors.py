"""Errors of the vLLM backend. Every failure the trainer can see is one of these, by name."""
from __future__ import annotations


class VllmError(RuntimeError):
    """Base class of every vLLM-backend error."""


class VllmUnsupportedError(VllmError, ValueError):
    """A configuration the backend refuses instead of producing wrong numbers (the message says
    why and what to use instead)."""


class VllmStartError(VllmError):
    """The server did not become healthy (exited, or timed out); the message has its log's tail."""


class VllmServerDiedError(VllmError):
    """The server kept dying or hanging and the bounded restarts are spent. The trainer should
    checkpoint and stop; no partial batch is returned."""


class VllmRequestError(VllmError):
    """The server refused a request (HTTP 4xx): a client-side bug or a limit such as max_model_len.
    Not retried."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class VllmBadResponseError(VllmError):
    """Responses still failed validation (malformed JSON, wrong lengths, missing or non-finite
    log-probs, ...) after the bounded retries. `count` bad responses in this call, `examples`
    holds a few of their reasons."""

    def __init__(self, message: str, count: int = 0, examples: list[str] | None = None):
        super().__init__(message)
        self.count = count
        self.examples = list(examples or [])


class VllmParityError(VllmError):
    """After a weight sync the server's log-probs differ from the reference by more than the
    tolerance: the server is not running the weights the trainer just exported."""

    def __init__(self, message: str, max_abs_diff: float):
        super().__init__(message)
        self.max_abs_diff = max_abs_diff


class VllmProbeError(VllmError):
    """The parity probe after a weight sync got no measurement: the server refused the probe or
    answered it without usable prompt log-probs. The message names the server and what was wrong."""
