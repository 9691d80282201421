"""Prompts and tokenization for RL: the toy character tokenizer, verifiable toy tasks
(`megatron_rl.data.tasks`), and validated prompts from JSONL, Parquet or `datasets` folders. Every prompt source answers
`batch(step, size) -> list[Example]` as a pure function of its seed, so the trainer's step is the
data position a checkpoint needs."""

from megatron_rl.data.jsonl import DataError, JsonlPrompts, load_jsonl, load_prompts
from megatron_rl.data.tasks import PromptStream, Task, make_task, register_task
from megatron_rl.data.tokenizer import CharTokenizer
from megatron_rl.data.types import Example, PromptSource, derive_seed

__all__ = [
    "CharTokenizer",
    "DataError",
    "Example",
    "JsonlPrompts",
    "PromptSource",
    "PromptStream",
    "Task",
    "derive_seed",
    "load_jsonl",
    "load_prompts",
    "make_task",
    "register_task",
]
