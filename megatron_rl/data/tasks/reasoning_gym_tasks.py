"""`reasoning_gym:<dataset>`: the procedural generators of the reasoning-gym package, each scored by
the package's own scorer (an optional extra: `pip install 'megatron-rl[reasoning-gym]'`).

    data:
      tasks: ["reasoning_gym:basic_arithmetic"]
      tokenizer: byte                   # their text is more than the toy tokenizer's 38 symbols
      task_settings:
        reasoning_gym:basic_arithmetic: {min_terms: 2, max_terms: 2, max_digits: 2, operators: ["+"]}

The task's settings are the generator's config fields (reasoning_gym's `<Dataset>Config`, less
`seed` and `size`) beside `heldout_size` and `heldout_seed`; the package's own `validate()` checks
them when the task is built, and an unknown one is refused naming it. Nothing imports the package
until such a task is configured (`TASK_FAMILIES`; configure/plugins.py builds the class at start-up).

Problems. The generator makes item i from `Random(seed + i)`; a training draw takes i uniform in
[0, SPAN) from the run's stream (data.seed and the step, tasks/stream.py), the held-out split
`heldout_size` distinct problems with i in [SPAN, 2 SPAN) from `heldout_seed`: disjoint seeds, and,
as for every task, a training draw whose question is a held-out one is redrawn, so no held-out
question is ever trained on even where two seeds make the same question. A held-out split the
generator cannot fill (fewer distinct questions than asked for) is refused when the task is built.

Prompt, label, reward. The prompt is the question as the package writes it, the label its answer
(the SFT warm start's target). The reward is `dataset.score_answer(answer, entry)` with the
response, stripped, as the answer (the built-in tasks' convention: the model writes the answer and
<eos>) and the generator's own entry (question, answer, metadata). Entries are kept by question for
the questions this process drew (the held-out split, and the last `RECENT` training draws), since
a reward is called with (prompt, response, label) alone; a question not among them scores 0.0,
counted by the reward runner as a KeyError.

Lengths. `max_prompt_len`/`max_label_len` are the longest of the held-out split and of 1,000
reference draws; a training draw longer than them is redrawn (rare), so they bound every prompt.
"""
from __future__ import annotations

import dataclasses
import random
from collections import OrderedDict
from functools import cached_property
from typing import Any, ClassVar

from megatron_rl.data.tasks.base import _MAX_REJECTIONS, TASK_FAMILIES, Task
from megatron_rl.data.types import Example, derive_seed
from megatron_rl.rewards.registry import register_reward

SPAN = 10**9            # item indices of training draws: [0, SPAN); held-out: [SPAN, 2 SPAN)
REFERENCE_DRAWS = 1000  # the draws the length bounds are measured on, beside the held-out split
RECENT = 1 << 16        # training entries kept for the reward, per task
INSTALL = "pip install 'megatron-rl[reasoning-gym]'"

# task name -> {question: (dataset, entry)}: what the reward scores with (see the module docstring)
_HELDOUT: dict[str, dict[str, tuple[Any, dict]]] = {}
_RECENT: dict[str, OrderedDict[str, tuple[Any, dict]]] = {}


def _package():
    try:
        import reasoning_gym
    except ImportError as e:
        raise ValueError(f"reasoning-gym is not installed ({e}); install the extra: {INSTALL}") from None
    return reasoning_gym


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReasoningGymTask(Task):
    """The base of the classes `task_class` makes; `dataset`: the reasoning-gym dataset name."""

    dataset: ClassVar[str] = ""

    def __post_init__(self):
        for f in self._generator_fields():  # YAML and a checkpoint's JSON write sequences as lists
            if isinstance(getattr(self, f), tuple):
                object.__setattr__(self, f, list(getattr(self, f)))
        super().__post_init__()
        self._bounds  # builds the generator and the held-out split: refused settings fail here  # noqa: B018

    @classmethod
    def _generator_fields(cls) -> list[str]:
        base = {f.name for f in dataclasses.fields(Task)}
        return [f.name for f in dataclasses.fields(cls) if f.name not in base]

    def settings(self) -> dict:
        """The generator's config fields as this task sets them."""
        return {f: getattr(self, f) for f in self._generator_fields()}

    @cached_property
    def _generator(self):
        rg = _package()
        try:
            return rg.create_dataset(self.dataset, seed=0, size=2 * SPAN, **self.settings())
        except (AssertionError, TypeError, ValueError) as e:
            raise ValueError(f"{self.name}: reasoning-gym refused the settings {self.settings()}: "
                             f"{type(e).__name__}: {e}") from None

    @property
    def num_problems(self) -> int:
        """An upper bound (the training indices); the generator's real count is what fills the split."""
        return SPAN

    @property
    def max_prompt_len(self) -> int:
        return self._bounds[0]

    @property
    def max_label_len(self) -> int:
        return self._bounds[1]

    def _item(self, index: int) -> tuple[Example, dict]:
        """Item `index` of the generator: the Example and the generator's entry."""
        entry = self._generator[index]
        return Example(prompt=str(entry["question"]), label=str(entry["answer"]), task=self.name), entry

    def generate(self, rng: random.Random) -> Example:
        """A problem with index in [0, SPAN), redrawn while longer than the length bounds."""
        max_prompt, max_label = self._bounds
        for _ in range(_MAX_REJECTIONS):
            ex, entry = self._item(rng.randrange(SPAN))
            if len(ex.prompt) <= max_prompt and len(ex.label) <= max_label:
                recent = _RECENT.setdefault(self.name, OrderedDict())
                recent[ex.prompt] = (self._generator, entry)
                recent.move_to_end(ex.prompt)
                if len(recent) > RECENT:
                    recent.popitem(last=False)
                return ex
        raise RuntimeError(f"{self.name}: {_MAX_REJECTIONS} draws in a row were longer than the length bounds")

    @cached_property
    def _heldout(self) -> tuple[Example, ...]:
        rng = random.Random(derive_seed("heldout", self.name, self.heldout_seed))
        seen: dict[str, tuple[Example, dict]] = {}
        draws = 20 * self.heldout_size + 1000
        for _ in range(draws):
            if len(seen) >= self.heldout_size:
                break
            ex, entry = self._item(SPAN + rng.randrange(SPAN))
            seen.setdefault(ex.prompt, (ex, entry))
        if len(seen) < self.heldout_size:
            raise ValueError(f"{self.name}: the generator made only {len(seen)} distinct problems in {draws} draws, "
                             f"fewer than heldout_size={self.heldout_size}; lower data.heldout_size or widen the "
                             f"task's settings (data.task_settings)")
        _HELDOUT[self.name] = {q: (self._generator, entry) for q, (_, entry) in seen.items()}
        return tuple(ex for ex, _ in seen.values())

    @cached_property
    def _bounds(self) -> tuple[int, int]:
        rng = random.Random(derive_seed("bounds", self.name))
        examples = [*self._heldout, *(self._item(rng.randrange(SPAN))[0] for _ in range(REFERENCE_DRAWS))]
        return max(len(e.prompt) for e in examples), max(len(e.label) for e in examples)


def answer_of(response: str) -> str:
    """The answer a response gives: the response without surrounding whitespace."""
    return response.strip()


def score(name: str, prompt: str, response: str) -> float:
    """The package's score of `response` to the question `prompt` of task `name` (KeyError for a
    question this process did not draw)."""
    found = _HELDOUT.get(name, {}).get(prompt) or _RECENT.get(name, {}).get(prompt)
    if found is None:
        raise KeyError(f"{name}: the question {prompt[:80]!r} was not drawn by this process, so its "
                       f"reasoning-gym entry is unknown")
    dataset, entry = found
    return float(dataset.score_answer(answer_of(response), entry))


def task_class(dataset: str) -> type[Task]:
    """The Task class of reasoning-gym dataset `dataset`, its reward registered under the task's
    name (ValueError when the package is missing or has no such dataset)."""
    rg = _package()
    datasets = rg.factory.DATASETS
    if dataset not in datasets:
        raise ValueError(f"reasoning-gym {rg.__version__ if hasattr(rg, '__version__') else ''} has no dataset "
                         f"{dataset!r}; it has: {', '.join(sorted(datasets))}")
    name = f"reasoning_gym:{dataset}"
    _, config_cls = datasets[dataset]
    fields = []
    for f in dataclasses.fields(config_cls):
        if f.name in ("seed", "size"):
            continue  # the task's: the run's draws and the held-out split set them
        default = f.default if f.default is not dataclasses.MISSING else None
        factory = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if factory is not None:
            fields.append((f.name, Any, dataclasses.field(default_factory=factory)))
        else:
            fields.append((f.name, Any, dataclasses.field(default=default)))
    cls = dataclasses.make_dataclass(f"ReasoningGym_{dataset}", fields, bases=(ReasoningGymTask,), frozen=True,
                                     kw_only=True, namespace={"dataset": dataset, "reward": name,
                                                              "__module__": __name__})
    register_reward(name)(lambda prompt, response, label: score(name, prompt, response))
    return cls


TASK_FAMILIES["reasoning_gym"] = task_class
