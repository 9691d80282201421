"""Registry entries the user brings: names written as import paths, and modules imported for what
they register.

    data.reward: my_rewards:strict_match     # attribute strict_match of module my_rewards
    plugins: [my_envs]                       # imported first: its @register_env entries are names

A registry name with a ":" is an import path, `package.module:attribute`; the module is imported
from `sys.path` (the user sets PYTHONPATH), never from a file path. `resolve(name, slot)` imports
the module, reads the attribute, asks the slot whether it is what its registry holds (a reward is
called as fn(prompt, response, label), a task is a Task subclass, ...), and registers it under the
whole name, so every later use is an ordinary registry lookup. Each registry declares its
`PluginSlot` beside itself (rewards/registry.py, data/tasks/base.py, data/envs/base.py,
rollout/function.py); `configure/plugins.py` resolves the config's names through them before the
config tree is built.

This runs the user's code, by the user's choice: only what the current config names is ever
imported (a checkpoint's stored config is compared with it as data, never resolved).

Errors are `PluginError` (a ValueError) saying what is wrong with the name; the caller adds the
config field.
"""
from __future__ import annotations

import importlib
import inspect
import re
import traceback
from collections.abc import Callable, Container
from dataclasses import dataclass
from types import ModuleType
from typing import Any

_MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
PATH_HINT = ("set PYTHONPATH to the folder that holds it (a module name like my_pkg.rewards, not a file path, "
             "is what is imported)")


class PluginError(ValueError):
    """A plugin cannot be imported, or is not what its registry holds."""


def is_import_path(name: object) -> bool:
    """A registry name written as `package.module:attribute`."""
    return isinstance(name, str) and ":" in name


def import_module(module: object) -> ModuleType:
    """Import `module` (a dotted name on sys.path); PluginError naming what failed and where."""
    if not isinstance(module, str) or not _MODULE.fullmatch(module):
        raise PluginError(f"{module!r} is not a module name; write the dotted name of a module importable from "
                          f"sys.path, e.g. my_pkg.rewards, and {PATH_HINT}")
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is not None and (module == e.name or module.startswith(e.name + ".")):
            raise PluginError(f"no module named {e.name!r} on sys.path; {PATH_HINT}") from None
        raise PluginError(f"importing module {module} failed{_at(e)}: {type(e).__name__}: {e}") from e
    except Exception as e:  # anything the user's module raises while it runs
        raise PluginError(f"importing module {module} failed{_at(e)}: {type(e).__name__}: {e}") from e


def _at(e: BaseException) -> str:
    """ ' at file:line' of the innermost frame of e's traceback (the user's line, mostly)."""
    frames = traceback.extract_tb(e.__traceback__)
    return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def load_attribute(path: str) -> Any:
    """The object `package.module:attribute` names (the attribute may be dotted: `module:Class.method`)."""
    module, _, attribute = path.partition(":")
    if not all(part.isidentifier() for part in attribute.split(".")):
        raise PluginError(f"{path!r}: write an import path as package.module:attribute (one colon, the attribute "
                          f"a Python name)")
    obj = mod = import_module(module)
    for part in attribute.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            where = getattr(mod, "__file__", None) or "no file"
            raise PluginError(f"module {module} ({where}) has no attribute {attribute!r}") from None
    return obj


@dataclass(frozen=True)
class PluginSlot:
    """What a registry accepts by import path.

    kind: the registry's name in messages ("reward"). expects: what an entry is, for the message
    ("a function (prompt, response, label) -> float"). entries: the registry (names `in` it are
    taken as they are). refuse(obj) -> why `obj` cannot be an entry, or None. add(name, obj):
    register it under `name`."""

    kind: str
    expects: str
    entries: Container[str]
    refuse: Callable[[Any], str | None]
    add: Callable[[str, Any], None]


def resolve(name: object, slot: PluginSlot) -> None:
    """Make `name` a registered entry of `slot`'s registry if it is an import path not yet
    registered; anything else is left to the registry's own lookup (which names an unknown name)."""
    if not is_import_path(name) or name in slot.entries:
        return
    obj = load_attribute(name)
    why = slot.refuse(obj)
    if why:
        raise PluginError(f"{name} is {why}; a {slot.kind} plugin must be {slot.expects}")
    slot.add(name, obj)


def describe(obj: Any) -> str:
    """'function f', 'class C', 'an int (3)': what a refusal says the attribute is."""
    if inspect.isclass(obj):
        return f"class {obj.__qualname__}"
    if inspect.isroutine(obj):
        return f"function {getattr(obj, '__qualname__', obj)}"
    return f"{type(obj).__name__} {obj!r:.60}"


def call_refusal(obj: Any, params: tuple[str, ...]) -> str | None:
    """Why `obj` cannot be called with the positional arguments `params`, or None."""
    if inspect.isclass(obj) or not callable(obj):
        return f"{describe(obj)}, not a function"
    if inspect.iscoroutinefunction(obj) or inspect.iscoroutinefunction(type(obj).__call__):
        return f"{describe(obj)}, a coroutine function (it returns a coroutine, not a value)"
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # a builtin without a readable signature: taken on trust
        return None
    try:
        signature.bind(*params)
    except TypeError:
        return f"{describe(obj)}{signature}, which cannot be called as f({', '.join(params)})"
    return None


def class_refusal(obj: Any, base: type) -> str | None:
    """Why `obj` is not a concrete subclass of `base`, or None."""
    if not inspect.isclass(obj) or not issubclass(obj, base):
        return f"{describe(obj)}, not a subclass of {base.__module__}.{base.__qualname__}"
    if inspect.isabstract(obj):
        return f"{describe(obj)}, which is abstract (it does not implement {', '.join(sorted(obj.__abstractmethods__))})"
    return None


def own_name(cls: type, name: str) -> None:
    """Give `cls` the registry name `name`, unless it has its own (a class registered by its
    decorator keeps the name its entries, seeds and metrics already use)."""
    if not cls.__dict__.get("name"):
        cls.name = name


def class_slot(kind: str, base: type, entries: dict[str, type], where: str) -> PluginSlot:
    """The slot of a registry of classes (tasks, environments): a concrete subclass of `base`,
    registered under its import path and named by it unless it has a name of its own. `where`:
    the file that defines `base`, for the message."""

    def add(name: str, cls: type) -> None:
        own_name(cls, name)
        entries[name] = cls

    return PluginSlot(kind=kind, expects=f"a concrete subclass of {base.__name__} ({where})", entries=entries,
                      refuse=lambda obj: class_refusal(obj, base), add=add)
