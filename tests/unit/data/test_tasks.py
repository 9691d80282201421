import random

import pytest

from megatron_rl.data.tasks import TASKS, Addition, PromptStream, Sorting, make_task
from megatron_rl.data.types import Example


def _solve_addition(prompt: str) -> str:
    """Independent check: parse 'a+b=' and reverse the decimal sum digit by digit."""
    assert prompt.endswith("=") and prompt.count("+") == 1
    a, b = (int(x) for x in prompt[:-1].split("+"))
    total, digits = a + b, []
    while True:
        digits.append(chr(ord("0") + total % 10))
        total //= 10
        if total == 0:
            return "".join(digits)


def _solve_sorting(prompt: str) -> str:
    assert prompt.startswith("s:") and prompt.endswith("=")
    counts = [0] * 10
    for d in prompt[2:-1].split(","):
        counts[int(d)] += 1
    return "".join(str(d) * c for d, c in enumerate(counts))


def test_registry():
    assert {"addition", "sorting"} <= set(TASKS)
    assert isinstance(make_task("addition", digits=2), Addition)
    with pytest.raises(KeyError, match="available: .*addition"):
        make_task("nope")


def test_hand_checked_examples():
    add = Addition(heldout_size=10)
    ex = add.generate(_FixedRng([123, 456]))
    assert ex == Example(prompt="123+456=", label="975", task="addition")
    assert add.generate(_FixedRng([500, 500])).label == "0001"
    assert add.generate(_FixedRng([7, 45])) == Example("007+045=", "25", "addition")
    assert Addition(heldout_size=10, zero_pad=False).generate(_FixedRng([7, 45])).prompt == "7+45="
    assert Addition(heldout_size=10).generate(_FixedRng([0, 0])).label == "0"


class _FixedRng:
    """randrange returns the given operands in order."""

    def __init__(self, values):
        self.values = list(values)

    def randrange(self, n):
        v = self.values.pop(0)
        assert 0 <= v < n
        return v


@pytest.mark.parametrize("digits", [1, 2, 3, 5])
def test_addition_labels_correct(digits):
    task = Addition(digits=digits, heldout_size=10)
    rng = random.Random(digits)
    for _ in range(2000):
        ex = task.sample(rng)
        assert ex.label == _solve_addition(ex.prompt)
        assert len(ex.prompt) == 2 * digits + 2 and len(ex.label) <= task.max_label_len


def test_sorting_labels_correct():
    task = Sorting()
    rng = random.Random(0)
    lengths = set()
    for _ in range(3000):
        ex = task.sample(rng)
        assert ex.task == "sorting" and ex.label == _solve_sorting(ex.prompt)
        lengths.add(len(ex.label))
    assert lengths == {4, 5, 6}
    assert Sorting(min_len=2, max_len=2, heldout_size=10).num_problems == 100


def test_generation_deterministic():
    for task in (Addition(), Sorting()):
        a = [task.sample(random.Random(5)) for _ in range(3)]
        b = [task.sample(random.Random(5)) for _ in range(3)]
        assert a == b
        assert task.heldout() == type(task)().heldout()  # fresh instance, same split


def test_heldout_fixed_distinct_and_disjoint_from_training():
    for task in (Addition(), Sorting(), Addition(digits=2, heldout_size=2000)):
        held = task.heldout()
        assert len(held) == task.heldout_size == len({e.prompt for e in held})
        assert task.heldout(10) == held[:10]
        prompts = {e.prompt for e in held}
        rng = random.Random(1)
        train = [task.sample(rng) for _ in range(5000)]
        assert not prompts & {e.prompt for e in train}
        assert all(task.is_heldout(e) for e in held) and not any(task.is_heldout(e) for e in train)
    # with 2-digit addition 20% of the space is held out: raw draws do hit it, sample() never does
    small = Addition(digits=2, heldout_size=2000)
    rng = random.Random(3)
    raw = [small.generate(rng) for _ in range(500)]
    assert any(small.is_heldout(e) for e in raw)
    assert Addition(heldout_seed=1).heldout() != Addition().heldout()


def test_bad_settings():
    with pytest.raises(ValueError, match="more than half"):
        Addition(digits=1, heldout_size=60)
    with pytest.raises(ValueError, match="digits"):
        Addition(digits=0)
    with pytest.raises(ValueError, match="min_len"):
        Sorting(min_len=5, max_len=4)


def test_prompt_stream_reproducible_by_seed_and_step():
    tasks = [Addition(), Sorting()]
    s1, s2 = PromptStream(tasks, seed=3), PromptStream([Addition(), Sorting()], seed=3)
    b7 = s1.batch(7, 64)
    s1.batch(8, 64)
    assert s2.batch(7, 64) == b7  # no state: order and history do not matter
    assert s1.batch(8, 64) != b7 and PromptStream(tasks, seed=4).batch(7, 64) != b7
    assert {e.task for e in b7} == {"addition", "sorting"}
    held = {e.prompt for e in s1.heldout()}
    assert len(held) == 2000
    assert not held & {e.prompt for step in range(50) for e in s1.batch(step, 64)}


def test_prompt_stream_reserve_is_a_stream_of_its_own():
    """Over-sampling's extra prompts: pure in (seed, step, start, count), contiguous slices of one
    stream per step, and no step's batch changes (batch draws nothing from it)."""
    tasks = [Addition(), Sorting()]
    s = PromptStream(tasks, seed=3)
    r = s.reserve(7, 0, 12)
    assert PromptStream([Addition(), Sorting()], seed=3).reserve(7, 0, 12) == r
    assert s.reserve(7, 4, 5) == r[4:9] and s.reserve(7, 12, 0) == []
    assert s.reserve(8, 0, 12) != r and r[:8] != s.batch(7, 8)
    held = {e.prompt for e in s.heldout()}
    assert not held & {e.prompt for e in s.reserve(0, 0, 500)}
    with pytest.raises(ValueError, match="start=-1"):
        s.reserve(0, -1, 2)


def test_prompt_stream_weights_and_resume_check():
    only_sort = PromptStream([Addition(), Sorting()], seed=0, weights=[0, 1])
    assert {e.task for e in only_sort.batch(0, 100)} == {"sorting"}
    assert PromptStream(Addition(), seed=0).batch(1, 4)[0].task == "addition"
    mix = PromptStream([Addition(), Sorting()], seed=0, weights=[3, 1])
    n_add = sum(e.task == "addition" for s in range(20) for e in mix.batch(s, 100))
    assert 1350 < n_add < 1650
    assert mix.rewards() == {"addition": "exact_match", "sorting": "exact_match"}
    mix.load_state_dict(mix.state_dict())
    other = PromptStream([Addition(digits=4), Sorting()], seed=0, weights=[3, 1])
    with pytest.raises(ValueError, match="tasks: checkpoint"):
        other.load_state_dict(mix.state_dict())
    with pytest.raises(ValueError, match="distinct"):
        PromptStream([Addition(), Addition(digits=2)], seed=0)
    with pytest.raises(ValueError, match="weights"):
        PromptStream([Addition(), Sorting()], seed=0, weights=[1])
