"""What the serving layer needs of one server, launched or at a URL (serving/launcher.py:
LocalServer, RemoteServer; tests/vllm/fake_server.py). Here, below the servers and their dialects,
so that a dialect's weight receivers can name it without importing the launcher.

Cost: none (a protocol).
"""
from __future__ import annotations

from typing import Protocol


class ServerHandle(Protocol):
    """What the client needs from a server: where it is, the key every request must carry
    (None: none), whether it lives, and (when we launched it) restarting it on a model directory."""

    url: str
    model_name: str
    can_restart: bool
    api_key: str | None

    def start(self, model_dir: str) -> float: ...
    def restart(self, model_dir: str) -> float: ...
    def alive(self) -> bool: ...
    def stop(self, graceful: bool = True) -> None: ...

    @property
    def log_where(self) -> str:
        """Where its output can be read (a file; a URL for a server we do not run)."""

    def log_tail(self, lines: int = 25) -> str:
        """Its output's last lines ("" when we cannot read it)."""
