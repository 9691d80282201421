"""One platform workaround: what it patches, when it is needed, and from which megatron-core release it
is not (the registry of them all is registry.py)."""
from __future__ import annotations

import functools
import importlib.metadata
import re
from collections.abc import Callable
from dataclasses import dataclass

from megatron_rl.platform.capabilities import Capabilities, Condition


@dataclass(frozen=True)
class Workaround:
    """One patch of megatron-core (or torch) for a platform where megatron-core's code path fails.

    number: stable id (docs/platform.md and tests/unit/platform use it).
    needed_when: the platform condition under which the patched code path fails.
    fixes: the error the unpatched call raises, so a reader can grep for it.
    apply: idempotent function that installs the patch.
    fixed_in: the first megatron-core release without the defect, e.g. "0.17.0" (None: every
        release has it). Releases from this one on need no patch; its probe proves it on each CI
        lane (tests/distributed/test_workarounds.py). The workaround is deleted once the oldest supported
        megatron-core (pyproject.toml) is at least this release.
    """

    number: int
    name: str
    needed_when: Condition
    fixes: str
    apply: Callable[[], None]
    fixed_in: str | None = None

    def has_defect(self, mcore: str | None = None) -> bool:
        """Whether megatron-core release `mcore` (default: the installed one) has the patched defect."""
        if self.fixed_in is None:
            return True
        return parse_version(mcore or megatron_core_version()) < parse_version(self.fixed_in)

    def needed(self, caps: Capabilities, mcore: str | None = None) -> bool:
        """Whether a process with `caps` on megatron-core `mcore` (default: this one's) needs the
        patch: its condition holds and that release has the defect."""
        return self.needed_when.holds(caps) and self.has_defect(mcore)


def parse_version(version: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a release string: "0.19.2", "0.17.0rc0", "0.19.2+e432f21" -> (0, 19, 2)."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if match is None:
        raise ValueError(f"not a release version: {version!r}")
    return tuple(int(part or 0) for part in match.groups())


@functools.lru_cache(maxsize=1)
def megatron_core_version() -> str:
    """The installed megatron-core release (its distribution's metadata; a source tree without it
    falls back to `megatron.core.package_info`)."""
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        from megatron.core import package_info

        return package_info.__version__
