"""What every prompt source hands the trainer, and the seed derivation that makes them replayable.

An `Example` is one prompt with the label its reward function checks against. A prompt source
(toy-task `PromptStream`, `JsonlPrompts`) answers `batch(step, size)` with a list of examples
that depends only on (its seed, step, size): the trainer's step is the whole "data position",
so a run resumed from a checkpoint at step k sees exactly the prompts it would have seen.
`reserve(step, start, count)` is a step's own second stream, drawn only by over-sampling
(`rollout.oversample`): a pure function of (seed, step, start, count), so the extra prompts of
step k are the same in every run and no other step's batch changes.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Protocol


class DataError(ValueError):
    """A data file is malformed; the message names the file, the 1-based line and the fix."""


@dataclass(frozen=True)
class Example:
    """One prompt. prompt: the text the policy continues; label: what the reward checks the
    response against (e.g. "975"); task: the task name, which selects the reward function.
    env / env_settings: the environment a multi-turn rollout runs this example in and its settings
    (a JSONL record's "env" and "env_settings"); None: the run's env.name and env.settings."""

    prompt: str
    label: str
    task: str
    env: str | None = None
    env_settings: dict | None = field(default=None, hash=False)


class PromptSource(Protocol):
    """A deterministic source of prompts: the same (step, size) always gives the same list.

    reserve: examples start .. start + count - 1 of step `step`'s reserve stream, which only
    over-sampling draws (trainer/oversample.py); a pure function of (seed, step, start, count),
    independent of `size` and of every step's batch.
    heldout: problems never drawn for training (evaluations), possibly none; rewards: task name ->
    reward name of its own tasks ({} = the run's data.reward decides); state_dict /
    load_state_dict: what identifies the source, checked (not restored) at resume."""

    def batch(self, step: int, size: int) -> list[Example]: ...

    def reserve(self, step: int, start: int, count: int) -> list[Example]: ...

    def heldout(self) -> list[Example]: ...

    def rewards(self) -> dict[str, str]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class Tokenizer(Protocol):
    """What the trainer asks of a tokenizer (data/tokenizer.py: CharTokenizer; hf_tokenizer.py).

    encode_prompt: a prompt's ids as the policy reads it (chat template, BOS); encode: plain text;
    decode: a response's ids -> the text its reward reads (stops at a stop id); token_bound: the
    most tokens `num_chars` characters can take; fingerprint: names the ids and end tokens, so a
    resume under other ones is refused; chat_template: the tokenizer's chat template or None (with
    one, a `render_chat(messages, add_generation_prompt)` method writes a conversation with it)."""

    pad_id: int
    eos_id: int
    vocab_size: int
    stop_ids: tuple[int, ...]
    fingerprint: str
    chat_template: str | None

    def encode_prompt(self, text: str) -> list[int]: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids) -> str: ...

    def token_bound(self, num_chars: int) -> int: ...


def derive_seed(*parts: object) -> int:
    """A 64-bit seed from any parts with a stable repr (ints, strs), e.g. (seed, "step", 7).

    Independent of PYTHONHASHSEED and the Python version, unlike hash().
    """
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little")
