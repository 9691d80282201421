"""reasoning-gym tasks (`reasoning_gym:<dataset>`): draws per seed, a held-out split no training
draw reaches, the package's scorer as the reward, and the refusals at start-up. Where the optional
package is not installed (lane 2), only the test of that refusal runs."""
import sys

import pytest

from megatron_rl.config import ConfigError
from megatron_rl.configure import load_config
from megatron_rl.data.byte_tokenizer import ByteTokenizer
from megatron_rl.data.tasks import PromptStream, make_task
from megatron_rl.data.tasks.base import TASKS, add_family_task
from megatron_rl.data.tasks.reasoning_gym_tasks import task_class
from megatron_rl.data.tokenizer import CharTokenizer
from megatron_rl.rewards import get_reward

NAME = "reasoning_gym:basic_arithmetic"
SMALL = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2, operators=["+"], allow_parentheses=False,
             allow_negation=False)


@pytest.fixture(scope="module")
def rg():
    rg = pytest.importorskip("reasoning_gym")
    add_family_task(NAME)
    return rg


def _sum(prompt: str) -> str:
    """Independent check: 'Calculate a + b.' -> str(a + b)."""
    assert prompt.startswith("Calculate ") and prompt.endswith(".")
    a, b = prompt[len("Calculate "):-1].split(" + ")
    return str(int(a) + int(b))


def test_draws_are_a_function_of_the_seed(rg):
    task = make_task(NAME, heldout_size=50, **SMALL)
    a, b = PromptStream(task, seed=3), PromptStream(make_task(NAME, heldout_size=50, **SMALL), seed=3)
    assert a.batch(7, 16) == b.batch(7, 16) and a.reserve(7, 2, 4) == b.reserve(7, 2, 4)
    assert a.batch(7, 16) != PromptStream(task, seed=4).batch(7, 16) and a.batch(7, 16) != a.batch(8, 16)
    for e in a.batch(0, 64) + task.heldout():
        assert e.task == NAME and e.label == _sum(e.prompt)
    assert task.heldout() == make_task(NAME, heldout_size=50, **SMALL).heldout()
    assert task.heldout() != make_task(NAME, heldout_size=50, heldout_seed=1, **SMALL).heldout()


def test_no_heldout_question_is_ever_drawn_for_training(rg):
    # 1-digit sums only: 11 x 11 = 121 questions, 40 held out, so training draws hit them often
    task = make_task(NAME, heldout_size=40, **dict(SMALL, max_digits=1))
    heldout = {e.prompt for e in task.heldout()}
    assert len(heldout) == 40
    drawn = {e.prompt for step in range(60) for e in PromptStream(task, seed=0).batch(step, 64)}
    assert drawn and not drawn & heldout
    assert len(drawn) == 121 - 40  # and every other question is drawn


def test_reward_is_the_package_scorer(rg):
    task = make_task(NAME, heldout_size=20, **SMALL)
    reward = get_reward(task.reward)
    train = PromptStream(task, seed=0).batch(0, 4)
    for e in [*task.heldout(), *train]:
        assert reward(e.prompt, e.label, e.label) == 1.0
        assert reward(e.prompt, f" {e.label}\n", e.label) == 1.0     # the response, stripped
        assert reward(e.prompt, str(int(e.label) + 1) + "x", e.label) == 0.0
    # basic_arithmetic keeps the package's default scorer: partial credit len(answer) / len(response)
    e = train[0]
    assert reward(e.prompt, "9" + e.label, e.label) == pytest.approx(len(e.label) / (len(e.label) + 1))
    with pytest.raises(KeyError, match="not drawn by this process"):
        reward("Calculate 1000 + 1000.", "2000", "2000")


def test_lengths_bound_every_draw(rg):
    task = make_task(NAME, heldout_size=20, **SMALL)
    assert (task.max_prompt_len, task.max_label_len) == (len("Calculate 100 + 100."), 3)
    for e in PromptStream(task, seed=1).batch(0, 256):
        assert len(e.prompt) <= task.max_prompt_len and len(e.label) <= task.max_label_len


def test_settings_reach_the_checkpoint_as_json_would_write_them(rg):
    task = make_task(NAME, heldout_size=20, **dict(SMALL, operators=("+",)))
    config = task.config()
    assert config["operators"] == ["+"] and config["max_digits"] == 2 and "seed" not in config
    assert PromptStream(task, seed=0).state_dict()["tasks"] == [config]


def _config(*overrides):
    settings = "{min_terms: 2, max_terms: 2, max_digits: 2, operators: ['+'], allow_parentheses: false}"
    return load_config(None, [f"data.tasks=['{NAME}']", "data.tokenizer=byte", "data.heldout_size=20",
                              f"data.task_settings={{'{NAME}': {settings}}}", *overrides])


def test_config(rg):
    cfg = _config()
    assert cfg.data.settings_of(NAME) == dict(heldout_size=20, min_terms=2, max_terms=2, max_digits=2,
                                              operators=["+"], allow_parentheses=False)
    assert TASKS[NAME].reward == NAME


ONE_DIGIT = "{min_terms: 2, max_terms: 2, max_digits: 1, operators: ['+'], allow_parentheses: false}"
REFUSALS = [  # (overrides, what the ConfigError says)
    (["data.tasks=['reasoning_gym:no_such_set']"],
     r"data.tasks\[0\]='reasoning_gym:no_such_set': .*has no dataset 'no_such_set'; it has: .*basic_arithmetic"),
    ([f"data.task_settings={{'{NAME}': {{max_digitz: 2}}}}"],
     r"data.task_settings\['reasoning_gym:basic_arithmetic'\]:.*max_digitz"),
    ([f"data.task_settings={{'{NAME}': {{min_terms: 0}}}}"],
     r"data.task_settings\[.*reasoning-gym refused the settings.*min_terms must be positive"),
    ([f"data.task_settings={{'{NAME}': {ONE_DIGIT}}}", "data.heldout_size=1000"],   # 121 questions
     r"only \d+ distinct problems .* fewer than heldout_size=1000"),
    (["data.task_settings={addition: {digits: 2}}"], r"data.task_settings names \['addition'\], which data.tasks"),
]


@pytest.mark.parametrize("overrides, msg", REFUSALS)
def test_config_errors(rg, overrides, msg):
    with pytest.raises(ConfigError, match=msg):
        _config(*overrides)


def test_missing_package_is_refused_with_the_install_line(monkeypatch):
    """Runs where reasoning-gym is not installed too (lane 2): the refusal names the field and the extra."""
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)   # `import reasoning_gym` raises ImportError
    with pytest.raises(ValueError, match=r"pip install 'megatron-rl\[reasoning-gym\]'"):
        task_class("gcd")
    with pytest.raises(ConfigError, match=r"data.tasks\[0\]='reasoning_gym:leg_counting': reasoning-gym is not "
                                          r"installed .*pip install 'megatron-rl\[reasoning-gym\]'"):
        load_config(None, ["data.tasks=['reasoning_gym:leg_counting']", "data.tokenizer=byte"])


def test_text_the_tokenizer_cannot_encode_is_refused(rg):
    from megatron_rl.trainer.startup import check_encodable

    stream = PromptStream(make_task(NAME, heldout_size=5, **SMALL), seed=0)
    check_encodable(stream, ByteTokenizer(), "byte")
    with pytest.raises(ValueError, match=r"cannot be encoded by data.tokenizer=char .*'C'.*use data.tokenizer=byte"):
        check_encodable(stream, CharTokenizer(), "char")
