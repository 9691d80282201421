"""Prompt rows from the tables users keep their data in: Parquet files, and folders written by
Hugging Face `datasets` (`Dataset.save_to_disk`: Arrow files listed in state.json, beside
dataset_info.json). Read with pyarrow alone (the `data` extra); `datasets` itself is not needed.

    for where, row in table_rows("gsm8k_train/"):      # "gsm8k_train/ row 0", {"prompt": ..., "label": ...}
        ...

Rows are numbered from 0 across the whole table, as `dataset[i]` and `table.slice(i, 1)` number
them; a row is a dict of the columns the prompt format reads (data/jsonl.py: prompt, label, task,
env, env_settings; other columns are not read), without the optional ones that are null there
(a table has every column in every row; a JSONL row leaves out what it does not set), so every
per-row check and its message is JSONL's. Memory: one record batch
of the file at a time beside the rows read so far; the caller keeps only the checked Examples.

Raises DataError (data/types.py) naming the path: a folder that is not a saved Dataset (a
DatasetDict's folder names its splits), a table without a "prompt" or "label" column, a file
pyarrow cannot read, or pyarrow missing.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator

from megatron_rl.data.types import DataError

COLUMNS = ("prompt", "label", "task", "env", "env_settings")
SUFFIXES = (".parquet", ".arrow")
INSTALL = "pip install 'megatron-rl[data]' (or pyarrow)"


def is_table(path: str | os.PathLike) -> bool:
    """A Parquet or Arrow file (by suffix), or a folder (a saved `datasets` Dataset)."""
    return os.path.isdir(path) or os.fspath(path).endswith(SUFFIXES)


def table_rows(path: str | os.PathLike) -> Iterator[tuple[str, dict]]:
    """(where, row) of every row of the table at `path`, in order."""
    name = os.fspath(path)
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise DataError(f"{name}: reading Parquet and Arrow tables needs pyarrow, which is not installed; "
                        f"{INSTALL}") from None
    files = _dataset_files(name) if os.path.isdir(name) else [name]
    index = 0
    for file in files:
        for row in _file_rows(name, file):
            yield f"{name} row {index}", row
            index += 1


def _dataset_files(folder: str) -> list[str]:
    """The Arrow files of a folder written by `Dataset.save_to_disk`, in order (state.json)."""
    if os.path.isfile(os.path.join(folder, "dataset_dict.json")):
        splits = sorted(n for n in os.listdir(folder) if os.path.isdir(os.path.join(folder, n)))
        raise DataError(f"{folder}: a DatasetDict (splits {', '.join(splits) or 'none'}); name one split's folder, "
                        f"e.g. {os.path.join(folder, splits[0] if splits else 'train')}")
    state = os.path.join(folder, "state.json")
    if not os.path.isfile(state):
        raise DataError(f"{folder}: a folder, but not one saved by datasets' save_to_disk (no state.json); name a "
                        f"JSONL or Parquet file, or such a folder")
    try:
        with open(state, encoding="utf-8") as f:
            files = [entry["filename"] for entry in json.load(f)["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{state}: not a datasets state.json ({type(e).__name__}: {e}); save the dataset again "
                        f"with save_to_disk") from None
    paths = []
    for file in files:
        if not isinstance(file, str) or os.path.basename(file) != file:
            raise DataError(f"{state}: data file {file!r} is not a file name inside the folder")
        paths.append(os.path.join(folder, file))
    if not paths:
        raise DataError(f"{state}: lists no data files; save the dataset again with save_to_disk")
    return paths


def _file_rows(name: str, file: str) -> Iterator[dict]:
    import pyarrow as pa

    try:
        schema, batches = _batches(file)
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{file}: not a table pyarrow can read ({e}); name a JSONL or Parquet file, or a folder "
                        f"saved by datasets' save_to_disk") from None
    columns = [c for c in COLUMNS if c in schema.names]
    for needed in ("prompt", "label"):
        if needed not in columns:
            raise DataError(f'{name}: no column "{needed}" (columns: {", ".join(schema.names) or "none"}); every '
                            f'row needs "prompt" and "label" strings: rename the columns, e.g. with '
                            f'dataset.rename_column("question", "prompt")')
    try:
        for batch in batches(columns):
            for row in batch.select(columns).to_pylist():  # a null optional value: as if absent, as in JSONL
                yield {k: v for k, v in row.items() if v is not None or k in ("prompt", "label")}
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{file}: reading it failed ({e}); is the file truncated?") from None


def _batches(file: str):
    """(schema, columns -> record batches) of a Parquet file, or of an Arrow IPC stream (what
    save_to_disk writes) or IPC file."""
    import pyarrow as pa
    import pyarrow.ipc
    import pyarrow.parquet as pq

    if file.endswith(".parquet"):
        parquet = pq.ParquetFile(file)
        return parquet.schema_arrow, lambda columns: parquet.iter_batches(columns=columns)
    try:
        stream = pa.ipc.open_stream(pa.memory_map(file))
        return stream.schema, lambda columns: stream
    except pa.ArrowInvalid:
        ipc = pa.ipc.open_file(pa.memory_map(file))
        return ipc.schema, lambda columns: (ipc.get_batch(i) for i in range(ipc.num_record_batches))
