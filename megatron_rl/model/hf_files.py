"""A Hugging Face model folder read as untrusted input: every value is checked before it is used.

    arch = load_arch(hf_dir)          # config.json -> ModelArch; HfInputError names the file and key
    reader = SafetensorsReader(hf_dir)   # every header checked against its file: length, offsets,
                                         # dtype, shape; an index names files of the folder only
    check_weights(reader, arch)       # the tensors config.json implies are there, in its sizes
    tensor = reader("model.embed_tokens.weight")

A folder is downloaded from anywhere. Unchecked, a config.json with -3 layers, 0 heads, or a
string or a list for a size failed deep in the model build (a math domain error, a
ZeroDivisionError, a TypeError), one claiming 10**6 layers built for minutes before anything
failed; a safetensors header was trusted for its length (2**60 bytes: a MemoryError), its offsets
(past the file's end), its dtype (a KeyError) and its shape; an index could name any file on the
machine (`/etc/passwd` was opened). Each is now an HfInputError naming the file and the value,
before a model is built. The files themselves may be symbolic links (a Hugging Face cache's
snapshot links into its blobs), but the names an index gives must stay inside the folder.

Cost: the headers (a few MB for the largest models) are read once per reader; check_weights
walks the tensor names the architecture needs (layers x experts), stopping at the first missing.
"""
from __future__ import annotations

import ctypes
import json
import os
import stat

import torch

from megatron_rl.model.arch import ModelArch
from megatron_rl.model.mappings import Scope, mapping_for

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_JSON_BYTES = 256 << 20       # config.json is a few KB; the largest index files a few MB
MAX_HEADER_BYTES = 100_000_000   # the safetensors library's own limit on a header

# safetensors dtype names -> torch dtypes (the format's header spells them so)
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class HfInputError(ValueError):
    """A file of a Hugging Face model folder is missing, damaged, or says something impossible;
    the message names the file and the value."""


def _regular_file(path: str, what: str) -> os.stat_result:
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise HfInputError(f"{path} does not exist; {what}") from None
    except OSError as e:
        raise HfInputError(f"{path} cannot be read ({e.strerror or e})") from None
    if not stat.S_ISREG(info.st_mode):
        raise HfInputError(f"{path} is not a regular file; {what}")
    return info


def read_json_object(path: str, what: str) -> dict:
    """The JSON object in `path` (a regular file of at most MAX_JSON_BYTES); HfInputError naming
    the file for anything else: missing, a FIFO, too large, not UTF-8 JSON, nested too deeply to
    parse, or not an object. `what` says what the file should be, for the message."""
    info = _regular_file(path, what)
    if info.st_size > MAX_JSON_BYTES:
        raise HfInputError(f"{path} is {info.st_size:,} bytes; {what} is far smaller (at most {MAX_JSON_BYTES:,})")
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read())
    except RecursionError:
        raise HfInputError(f"{path}: JSON nested too deeply to read; {what}") from None
    except ValueError as e:  # JSONDecodeError (line and column), UnicodeDecodeError
        raise HfInputError(f"{path} is not valid JSON ({e}); is the file complete?") from None
    if not isinstance(data, dict):
        raise HfInputError(f"{path}: expected a JSON object, got {type(data).__name__}; {what}")
    return data


def load_arch(hf_dir: str) -> ModelArch:
    """The ModelArch of `hf_dir`'s config.json, each value it reads checked for its type and range
    (ModelArch.from_hf_config); HfInputError naming the file and the key."""
    path = os.path.join(hf_dir, "config.json")
    config = read_json_object(path, "a Hugging Face model folder holds its config.json")
    try:
        return ModelArch.from_hf_config(config)
    except (ValueError, TypeError, KeyError) as e:
        message = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
        raise HfInputError(f"{path}: {message.removeprefix('config.json ')}") from None


def _inside(name: str) -> bool:
    """Whether the relative file name `name` stays inside its folder (no absolute path, no `..`)."""
    if not name or "\0" in name or os.path.isabs(name):
        return False
    parts = os.path.normpath(name).split(os.sep)
    return parts[0] not in ("..", ".")


def weight_files(path: str) -> list[str]:
    """The safetensors files of folder `path`: the ones its index names (each checked to lie in
    the folder), else model.safetensors."""
    index = os.path.join(path, INDEX)
    if not os.path.lexists(index):
        if not os.path.lexists(os.path.join(path, SINGLE)):
            raise HfInputError(f"{path}: no {SINGLE} or {INDEX}")
        return [SINGLE]
    weight_map = read_json_object(index, "an index maps tensor names to files").get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise HfInputError(f"{index}: weight_map must map tensor names to file names")
    files = sorted(set(weight_map.values()))
    outside = next((f for f in files if not _inside(f)), None)
    if outside is not None:
        raise HfInputError(f"{index}: weight_map names {outside!r}, which is not in {path}; an index may only "
                           f"name files of its own folder")
    return files


def read_header(file: str) -> tuple[int, dict[str, tuple[str, tuple[int, ...], int, int]]]:
    """(where the data starts, {name: (dtype, shape, begin, end)}) of a safetensors file, every
    entry checked against the file: the header's length fits the file (and the format's limit),
    it is a JSON object, each dtype is known, each shape a list of sizes >= 0, each data_offsets
    [begin, end] lies in the data and holds exactly shape x itemsize bytes."""
    size = _regular_file(file, "a safetensors file of the folder").st_size
    with open(file, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 <= n <= min(size - 8, MAX_HEADER_BYTES):
            why = ("too short for a safetensors file" if n < 0 else
                   f"its header length says {n:,} bytes, more than the file holds" if n > size - 8 else
                   f"its header length says {n:,} bytes, more than a safetensors header may be")
            raise HfInputError(f"{file} ({size:,} bytes): {why}; the file is damaged or not safetensors")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except RecursionError:
        raise HfInputError(f"{file}: the header is nested too deeply to read") from None
    except ValueError as e:
        raise HfInputError(f"{file}: the header is not valid JSON ({e}); the file is damaged") from None
    if not isinstance(header, dict):
        raise HfInputError(f"{file}: the header is not a JSON object; the file is damaged or not safetensors")
    header.pop("__metadata__", None)
    data_bytes = size - 8 - n
    out = {}
    for name, entry in header.items():
        out[name] = _entry(f"{file}: tensor {name!r}", entry, data_bytes)
    return 8 + n, out


def _entry(where: str, entry, data_bytes: int) -> tuple[str, tuple[int, ...], int, int]:
    if not isinstance(entry, dict):
        raise HfInputError(f"{where}: its header entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _ST_DTYPES:
        raise HfInputError(f"{where}: dtype {dtype!r} is not one of {', '.join(_ST_DTYPES)}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise HfInputError(f"{where}: shape {shape!r} is not a list of sizes >= 0")
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data_bytes):
        raise HfInputError(f"{where}: data_offsets {offsets!r} do not lie in the file's {data_bytes:,} data bytes "
                           f"(the file is damaged or cut short)")
    numel, (begin, end) = _numel(shape), offsets
    if numel * _ST_DTYPES[dtype].itemsize != end - begin:
        raise HfInputError(f"{where}: shape {shape} of {dtype} is {numel * _ST_DTYPES[dtype].itemsize:,} bytes, "
                           f"its data_offsets hold {end - begin:,}")
    return dtype, tuple(shape), begin, end


class SafetensorsReader:
    """Read HF tensors by name from a checkpoint directory (single file or sharded with index).

    Every header is read and checked when the reader is made (read_header); each call reads that
    tensor's bytes with a plain positioned read into fresh memory: nothing is memory-mapped, so a
    process that converts tensor by tensor holds one tensor, not the mapped files (safetensors'
    own `safe_open` maps them, and touched pages stay resident).
    Format: 8-byte little-endian header length, a JSON header {name: {dtype, shape,
    data_offsets: [begin, end)}} with offsets from the end of the header, then the bytes.
    """

    def __init__(self, path: str):
        self.path = path
        self._where: dict[str, tuple[str, int, tuple[str, tuple[int, ...], int, int]]] = {}
        for file in weight_files(path):
            full = os.path.join(path, file)
            start, entries = read_header(full)
            for name, entry in entries.items():
                self._where[name] = (full, start, entry)

    def keys(self) -> list[str]:
        return list(self._where)

    def describe(self, name: str) -> tuple[str, tuple[int, ...]] | None:
        """(safetensors dtype, shape) of tensor `name`, None when the checkpoint has none."""
        if name not in self._where:
            return None
        dtype, shape, _, _ = self._where[name][2]
        return dtype, shape

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"{self.path}: checkpoint has no tensor {name!r}")
        file, start, (dtype, shape, begin, end) = self._where[name]
        # File bytes land in host memory (callers copy them to the parameter's device), in
        # torch-owned, resizable storage (a streaming writer frees it after writing; `.numpy()`
        # would pin it), filled in place through a ctypes view of its bytes.
        buf = torch.empty(end - begin, dtype=torch.uint8, device="cpu")
        with open(file, "rb", buffering=0) as f:
            f.seek(start + begin)
            view = memoryview((ctypes.c_char * buf.numel()).from_address(buf.data_ptr())).cast("B")
            if buf.numel() and f.readinto(view) != buf.numel():
                raise ValueError(f"{file}: tensor {name!r} is cut short (the file is truncated)")
        return buf.view(_ST_DTYPES[dtype]).reshape(shape)


def expected_names(arch: ModelArch):
    """The HF tensor names `arch` reads (megatron_rl/model/mappings), the global ones first, then
    layer by layer: a caller that stops at the first missing one does work in proportion to the
    checkpoint, not to what a config.json claims."""
    params = mapping_for(arch)
    for p in params:
        if p.scope is Scope.GLOBAL:
            yield from p.hf
    for layer in range(arch.num_layers):
        moe = arch.is_moe_layer(layer)
        for p in params:
            if p.scope is Scope.LAYER or (p.scope is Scope.DENSE and not moe) or (p.scope is Scope.MOE and moe):
                yield from (h.format(layer=layer) for h in p.hf)
            elif p.scope is Scope.EXPERT and moe:
                for expert in range(arch.num_experts):
                    yield from (h.format(layer=layer, expert=expert) for h in p.hf)


def check_weights(reader: SafetensorsReader, arch: ModelArch) -> None:
    """config.json and the weights describe the same model, checked before one is built: every
    tensor `arch` reads is there (a config.json claiming 10**6 layers over a checkpoint of 2 fails
    at the first missing tensor of layer 2), floating point, the embedding is vocab_size x
    hidden_size, and the tensors hold as many numbers as the architecture has (its parameters,
    plus the sigmoid router's bias buffers). HfInputError naming the folder and the tensor."""
    belongs = "does config.json belong to these weights?"
    total, seen = 0, set()
    for name in expected_names(arch):
        if name in seen:
            continue
        seen.add(name)
        found = reader.describe(name)
        if found is None:
            raise HfInputError(f"{reader.path}: config.json (num_hidden_layers={arch.num_layers}"
                               f"{f', {arch.num_experts} experts' if arch.is_moe else ''}) needs tensor {name}, which "
                               f"no safetensors file of the folder holds; {belongs}")
        dtype, shape = found
        if not _ST_DTYPES[dtype].is_floating_point:
            raise HfInputError(f"{reader.path}: tensor {name} is {dtype}; model weights are floating point")
        total += _numel(shape)
    embedding = reader.describe("model.embed_tokens.weight")
    if embedding is not None and embedding[1] != (arch.vocab_size, arch.hidden_size):
        raise HfInputError(f"{reader.path}: model.embed_tokens.weight is {list(embedding[1])}, and config.json says "
                           f"vocab_size x hidden_size = [{arch.vocab_size}, {arch.hidden_size}]; {belongs}")
    buffers = arch.num_experts * sum(map(arch.is_moe_layer, range(arch.num_layers))) \
        if arch.family.router == "sigmoid" else 0
    expected = arch.num_parameters() + buffers
    if total != expected:
        raise HfInputError(f"{reader.path}: the tensors the model reads hold {total:,} numbers, and config.json's "
                           f"sizes (hidden_size, intermediate_size, head_dim, heads, experts) make {expected:,}; "
                           f"{belongs}")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
