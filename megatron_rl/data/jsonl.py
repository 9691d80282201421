"""User prompts from a JSONL file (or a Parquet file, or a folder saved by HF `datasets`: the same
rows as a table, data/tables.py), validated row by row, served with the `batch(step, size)` interface.

Format: UTF-8, one JSON object per line; blank lines are skipped (line numbers still count them).

    {"prompt": "123+456=", "label": "975"}
    {"prompt": "s:5,3,1,4=", "label": "1345", "task": "sorting", "source": "ignored"}

    prompt  str, required, not blank      the text the policy continues
    label   str, required (may be empty)  what the reward checks the response against
    task    str, optional                 selects the reward; rows without it get `default_task`
    env     str, optional                 a registered environment (data/envs/) this row's
                                          multi-turn trajectories run in, instead of env.name
    env_settings  object, optional        that environment's settings (only with "env"); without
                                          it, env.settings when "env" is env.name, else none
    other keys are allowed and ignored.

    {"prompt": "guess 0-99 n0042:", "label": "57", "task": "guessing", "env": "guess"}
    {"prompt": "123*45=", "label": "5535", "env": "calculator", "env_settings": {"call_open": "c:"}}

An unknown environment, settings it does not take or of the wrong type (`"call_open": 5` where
the calculator takes a string) are refused while loading, naming the line
(building an environment is cheap by contract: data/envs/base.py). Only a rollout function that
runs environments (multi_turn) reads "env"; with another, the run refuses such rows at start-up
(trainer/startup.py: check_row_envs).

Every problem raises `DataError` with `file:line: what is wrong; how to fix it` (a table's row:
`path row i`, counted from 0 as dataset[i]), e.g.

    data.jsonl:7: field "label" is missing; every row needs "prompt" and "label" strings
    train.parquet row 6: field "prompt" is empty; every row needs a non-blank prompt

A table holds the same fields as columns (others are not read); a null in an optional column is
that field left out.

`JsonlPrompts` walks the rows in epochs, each epoch in its own seeded permutation: with a fixed
batch size, batch(step, size) holds rows step*size .. step*size+size-1 of that endless sequence,
so it is a pure function of (seed, step, size) and a resume at step k replays exactly.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol

from megatron_rl.data.types import DataError, Example, derive_seed

REQUIRED = ("prompt", "label")
_ROW_HINT = 'each line must be one JSON object like {"prompt": "...", "label": "..."}'
_TABLE_HINT = 'each row needs "prompt" and "label" strings'


class _Encoder(Protocol):  # both raise ValueError on text they cannot encode
    def encode_prompt(self, text: str) -> list[int]: ...
    def encode(self, text: str) -> list[int]: ...


def _type_name(value: object) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), type(value).__name__
    )


def _parse_row(where: str, text: str, default_task: str, tokenizer: _Encoder | None) -> Example:
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        cut = "" if text.endswith("\n") else " (the file's last line, with no newline: is the file truncated?)"
        raise DataError(f"{where}: invalid JSON ({e.msg} at column {e.colno}){cut}; {_ROW_HINT}") from None
    except RecursionError:  # [[[[...]]]] deeper than the parser's stack
        raise DataError(f"{where}: the JSON is nested too deeply to read; {_ROW_HINT}") from None
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {_type_name(row)}; {_ROW_HINT}")
    return _check_row(where, row, default_task, tokenizer)


def _check_row(where: str, row: dict, default_task: str, tokenizer: _Encoder | None) -> Example:
    """One row (a JSONL line's object, a table's row) checked and made an Example."""
    for field in REQUIRED:
        if field not in row:
            raise DataError(f'{where}: field "{field}" is missing; every row needs "prompt" and "label" strings')
    for field in (*REQUIRED, "task"):
        if field in row and not isinstance(row[field], str):
            value = row[field]
            raise DataError(
                f'{where}: field "{field}" must be a string, got {_type_name(value)} ({_show(value)}); '
                f"quote it, e.g. {json.dumps(_show(value))}"
            )
    env, env_settings = _parse_env(where, row)
    if not row["prompt"].strip():
        raise DataError(f'{where}: field "prompt" is empty; every row needs a non-blank prompt')
    task = row.get("task", default_task)
    if not task:
        raise DataError(f'{where}: field "task" is empty; remove it to use the default task or name one')
    if tokenizer is not None:
        for field, encode in (("prompt", tokenizer.encode_prompt), ("label", tokenizer.encode)):
            try:
                encode(row[field])
            except ValueError as e:
                raise DataError(
                    f'{where}: field "{field}" cannot be tokenized: {e}; '
                    "remove the character or use a tokenizer that covers it"
                ) from None
    return Example(prompt=row["prompt"], label=row["label"], task=task, env=env, env_settings=env_settings)


def _show(value: object) -> str:
    """`value` as JSON, or its repr when JSON has no spelling for it (a table's bytes or dates)."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _parse_env(where: str, row: dict) -> tuple[str | None, dict | None]:
    """A row's "env" and "env_settings", checked by building the environment once."""
    from megatron_rl.data.envs import ENVS, make_env  # envs import this package's types

    env, settings = row.get("env"), row.get("env_settings")
    if env is None:
        if settings is not None:
            raise DataError(f'{where}: field "env_settings" without "env"; name the environment they are for')
        return None, None
    if not isinstance(env, str) or not env:
        raise DataError(f'{where}: field "env" must name an environment, got {_show(env)}; '
                        f"available: {', '.join(sorted(ENVS))}")
    if env not in ENVS:
        raise DataError(f'{where}: field "env" names an unknown environment {env!r}; available: '
                        f"{', '.join(sorted(ENVS))} (or register one with data.envs.register_env)")
    if settings is not None and not isinstance(settings, dict):
        raise DataError(f'{where}: field "env_settings" must be an object of {env!r}\'s settings, got '
                        f"{_type_name(settings)}")
    try:
        make_env(env, **(settings or {}))
    except (TypeError, ValueError) as e:
        raise DataError(f'{where}: field "env_settings" does not fit environment {env!r}: {e}') from None
    return env, settings


def load_jsonl(
    path: str | os.PathLike, default_task: str = "jsonl", tokenizer: _Encoder | None = None,
    fits: Callable[[Example], str | None] | None = None, overlong: str = "error",
) -> tuple[list[Example], int]:
    """Read and validate every row of `path` (see the module docstring for the format).

    tokenizer: optional; when given, each prompt and label must encode without ValueError (the
    error names the line, the field and, for CharTokenizer, the character and its position).
    fits: optional length check, example -> None when it fits, else why not (e.g. "412 prompt
    tokens + 8 response tokens > 256"). overlong: "error" raises at the first row that does not
    fit, with the count of all such rows; "skip" drops them.
    Returns (examples, number of rows skipped as too long). Raises DataError on the first bad
    row, or when the file has no (remaining) rows.
    """
    return _collect(os.fspath(path), _jsonl_rows(path, default_task, tokenizer), fits, overlong, _ROW_HINT)


def load_prompts(
    path: str | os.PathLike, default_task: str = "jsonl", tokenizer: _Encoder | None = None,
    fits: Callable[[Example], str | None] | None = None, overlong: str = "error",
) -> tuple[list[Example], int]:
    """`load_jsonl` for every format a prompt file comes in: a Parquet (.parquet) or Arrow (.arrow)
    file, or a folder saved by HF datasets' save_to_disk, read by data/tables.py (a row is named
    "path row i", counted from 0 as dataset[i]); anything else is JSONL. The same checks, the same
    Examples for the same rows."""
    from megatron_rl.data.tables import is_table, table_rows

    if not is_table(path):
        return load_jsonl(path, default_task, tokenizer, fits, overlong)
    rows = ((where, _check_row(where, row, default_task, tokenizer)) for where, row in table_rows(path))
    return _collect(os.fspath(path), rows, fits, overlong, _TABLE_HINT)


def _jsonl_rows(path, default_task: str, tokenizer: _Encoder | None) -> Iterator[tuple[str, Example]]:
    name = os.fspath(path)
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{name}:{lineno}"
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: not valid UTF-8 (byte {e.start}); save the file as UTF-8") from None
            if text.strip():
                yield where, _parse_row(where, text, default_task, tokenizer)


def _collect(name: str, rows: Iterable[tuple[str, Example]], fits: Callable[[Example], str | None] | None,
             overlong: str, hint: str) -> tuple[list[Example], int]:
    """The checked rows that fit, and how many did not (see load_jsonl)."""
    if overlong not in ("error", "skip"):
        raise ValueError(f"overlong={overlong!r}; choose error or skip")
    examples, too_long = [], []
    for where, ex in rows:
        why = fits(ex) if fits is not None else None
        if why is None:
            examples.append(ex)
        else:
            too_long.append((where, why))
    if too_long and overlong == "error":
        where, why = too_long[0]
        raise DataError(f"{where}: the prompt is too long ({why}); {len(too_long)} row(s) of {name} are. Shorten "
                        f"them, raise the model's maximum length, lower rollout.max_tokens, or set "
                        f"data.overlong_prompts=skip to drop them")
    if not examples:
        raise DataError(f"{name}: no rows{' that fit the model' if too_long else ''}; {hint}")
    return examples, len(too_long)


class JsonlPrompts:
    """Prompts from a JSONL or Parquet file, a datasets folder (load_prompts), or a list of
    Examples, in seeded per-epoch permutations.

    fits / overlong: the length check applied while loading (see load_jsonl).

    shuffle=False serves rows in file order every epoch. Keep `size` fixed for a run: changing it
    changes which rows step k maps to.
    """

    def __init__(
        self,
        source: str | os.PathLike | Sequence[Example],
        seed: int,
        shuffle: bool = True,
        default_task: str = "jsonl",
        tokenizer: _Encoder | None = None,
        fits: Callable[[Example], str | None] | None = None,
        overlong: str = "error",
    ):
        self.skipped_overlong = 0  # rows dropped by overlong="skip"
        if isinstance(source, (str, os.PathLike)):
            self.path: str | None = os.fspath(source)
            self.examples, self.skipped_overlong = load_prompts(source, default_task=default_task,
                                                                tokenizer=tokenizer, fits=fits, overlong=overlong)
        else:
            self.path = None
            self.examples = list(source)
            if not self.examples:
                raise DataError("JsonlPrompts: no examples given")
        self.seed = int(seed)
        self.shuffle = shuffle
        self._order_cache: tuple[int, list[int]] | None = None

    def __len__(self) -> int:
        return len(self.examples)

    def epoch(self, step: int, size: int) -> float:
        """Epochs completed before batch `step` (fractional), for logging."""
        return step * size / len(self.examples)

    def batch(self, step: int, size: int) -> list[Example]:
        """Rows step*size .. step*size + size - 1 of the endless epoch sequence."""
        if step < 0 or size < 0:
            raise ValueError(f"JsonlPrompts.batch: step and size must be >= 0, got step={step}, size={size}")
        n = len(self.examples)
        return [self.examples[self._order(k // n)[k % n]] for k in range(step * size, (step + 1) * size)]

    def reserve(self, step: int, start: int, count: int) -> list[Example]:
        """Examples start .. start + count - 1 of step `step`'s reserve (over-sampling's extra
        prompts): rows drawn uniformly with replacement by a generator of their own (seeded by
        (seed, "jsonl_reserve", step)), so the epoch order, and with it every step's batch, is
        unchanged; a reserve row may repeat a row of any batch. Cost: start + count draws."""
        if step < 0 or start < 0 or count < 0:
            raise ValueError(f"JsonlPrompts.reserve: step, start and count must be >= 0, got step={step}, "
                             f"start={start}, count={count}")
        rng = random.Random(derive_seed(self.seed, "jsonl_reserve", step))
        rows = [rng.randrange(len(self.examples)) for _ in range(start + count)]
        return [self.examples[i] for i in rows[start:]]

    def heldout(self) -> list[Example]:
        """JSONL prompts have no held-out split (evaluations are skipped)."""
        return []

    def rewards(self) -> dict[str, str]:
        """No task-specific reward: every row is scored by data.reward (exact_match by default)."""
        return {}

    def _order(self, epoch: int) -> list[int]:
        if self._order_cache is not None and self._order_cache[0] == epoch:
            return self._order_cache[1]
        order = list(range(len(self.examples)))
        if self.shuffle:
            random.Random(derive_seed(self.seed, "jsonl_epoch", epoch)).shuffle(order)
        self._order_cache = (epoch, order)
        return order

    def state_dict(self) -> dict:
        """What identifies the source: rows, seed, shuffle and a sha256 of the rows' content
        (prompt, label, task and, where a row names one, its environment, in order; the file's path
        and formatting do not count)."""
        rows = [[e.prompt, e.label, e.task] + ([e.env, e.env_settings] if e.env else []) for e in self.examples]
        content = hashlib.sha256(json.dumps(rows, sort_keys=True, default=repr).encode())
        return {"kind": "JsonlPrompts", "path": self.path, "rows": len(self.examples),
                "seed": self.seed, "shuffle": self.shuffle, "sha256": content.hexdigest()}

    def load_state_dict(self, state: dict) -> None:
        """Check a checkpoint's source against this one (same rows, content, seed, shuffle; the
        path may move). Raises ValueError naming what differs."""
        mine = self.state_dict()
        diffs = [k for k in ("rows", "sha256", "seed", "shuffle") if k in state and state[k] != mine[k]]
        if diffs:
            raise ValueError(
                "the checkpoint was trained on different JSONL prompts ("
                + "; ".join(f"{k}: checkpoint {state.get(k)!r} vs now {mine[k]!r}" for k in diffs)
                + "); resume with the same file and data settings or start a new run"
            )
