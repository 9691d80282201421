"""Reading a megatron-core checkpoint without running code that the checkpoint brings.

A `torch_dist` checkpoint has two places where the reader unpickles:

1. `.metadata`: torch.distributed.checkpoint's `FileSystemReader.read_metadata` calls
   `pickle.load` on it (no restriction), and megatron-core's `dist_checkpointing.load` reads it
   first. `check_metadata(dir)` unpickles it beforehand with `MetadataUnpickler`, which resolves
   only what that file legitimately holds (below); a file that names anything else is refused
   before megatron reads it.
2. the byte items inside `*.distcp` (megatron's `ShardedObject`s, e.g. each layer's
   `_extra_state`): torch's `DefaultLoadPlanner.load_bytes` calls `torch.load(..., weights_only=False)`.
   `weights_only_torch_loads()` sets torch's documented override `TORCH_FORCE_WEIGHTS_ONLY_LOAD=1`
   for the duration of the load, so that call (and megatron's `common.pt` load) uses torch's
   restricted unpickler: tensors and plain containers, never code.

The manifest's sha256 list cannot stand in for either: whoever can write the checkpoint can write
its manifest too.

What `.metadata` may name (`allowed_global`): the dataclasses and enums of
`torch.distributed.checkpoint.{metadata,planner,filesystem}` (the format's own records: building
one runs no code beyond setting its fields), torch dtypes, `torch.Size`,
`torch.serialization._get_layout` (maps a layout's name to the layout object),
`collections.OrderedDict`, and pathlib's path classes (the storage id a writer may record).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import importlib
import os
import pathlib
import pickle

import torch

DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
               "torch.distributed.checkpoint.filesystem")
METADATA_FILE = ".metadata"
_FORCE = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
_FORCE_NO = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"  # torch refuses both set at once
_PLAIN = {("torch", "Size"): torch.Size, ("torch.serialization", "_get_layout"): None,
          ("collections", "OrderedDict"): collections.OrderedDict,
          **{("pathlib", c.__name__): c for c in (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.Path)}}


class UnsafeCheckpoint(RuntimeError):
    """A checkpoint file asks the unpickler for something outside the allowed set."""


def allowed_global(module: str, name: str):
    """The object `module.name` when a checkpoint's `.metadata` may use it, else None."""
    if (module, name) in _PLAIN:
        return _PLAIN[(module, name)] or getattr(importlib.import_module(module), name)
    if module == "torch":
        obj = getattr(torch, name, None)
        return obj if isinstance(obj, torch.dtype) else None
    if module in DCP_MODULES:
        obj = getattr(importlib.import_module(module), name, None)
        is_record = isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))
        return obj if is_record else None
    return None


class MetadataUnpickler(pickle.Unpickler):
    """`pickle.Unpickler` that resolves only `allowed_global` names; anything else raises
    UnsafeCheckpoint naming it."""

    def find_class(self, module: str, name: str):
        obj = allowed_global(module, name)
        if obj is None:
            raise UnsafeCheckpoint(f"it names {module}.{name}, which a checkpoint's metadata never holds")
        return obj


def check_metadata(checkpoint_dir: str):
    """Unpickle `checkpoint_dir/.metadata` with `MetadataUnpickler` and return it (torch's
    `Metadata`: the saved keys, shapes and where their bytes are); raise UnsafeCheckpoint (naming
    the file and the global) if it holds anything else. None for a dir without the file:
    megatron then fails on it by itself, reading nothing. Other unpickling errors propagate."""
    path = os.path.join(checkpoint_dir, METADATA_FILE)
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        try:
            return MetadataUnpickler(f).load()
        except UnsafeCheckpoint as e:
            raise UnsafeCheckpoint(f"{path} is refused: {e}; it was not written by megatron-core (a crafted "
                                   f"checkpoint could run code here), so nothing was loaded") from None


@contextlib.contextmanager
def weights_only_torch_loads():
    """Within the block every `torch.load` uses torch's weights-only unpickler, whatever its
    caller passes (torch's `TORCH_FORCE_WEIGHTS_ONLY_LOAD`). Restores the environment after."""
    saved = {k: os.environ.get(k) for k in (_FORCE, _FORCE_NO)}
    os.environ[_FORCE] = "1"
    os.environ.pop(_FORCE_NO, None)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
