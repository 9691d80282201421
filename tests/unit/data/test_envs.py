"""The environment registry and the calculator environment."""
import pytest

from megatron_rl.data.envs import ENVS, Step, make_env
from megatron_rl.data.envs.calculator import calculate
from megatron_rl.data.tasks import make_task
from megatron_rl.data.types import Example


def test_calculate_answers_one_operation_and_nothing_else():
    assert calculate("123*45") == "5535" and calculate(" 7 - 9 ") == "-2" and calculate("1+2") == "3"
    for bad in ("1+2+3", "2**10", "__import__('os')", "", "1234567890*2", "1/2"):
        assert calculate(bad) == "?"


def test_the_calculator_answers_calls_and_scores_the_final_answer():
    env = make_env("calculator")
    assert env.reset(Example("123*45=", "5535", "multiplication")) == "123*45="
    assert env.step("<calc>123*45</calc>", [9]) == Step("<r>5535</r>", None, False)
    assert env.step("<calc>12/4</calc>", [9]) == Step("<r>?</r>", None, False)
    assert env.step(" 5535 ", [9]) == Step("", 1.0, True)
    assert make_env("calculator").step("5535", [9]).reward == 0.0  # never reset: no label, scores 0
    toy = make_env("calculator", call_open="c:", call_close="", result_open="r:", result_close="")
    toy.reset(Example("9*9=", "81", "multiplication"))
    assert toy.step("c:9*9", [9]) == Step("r:81", None, False) and toy.step("80", [9]) == Step("", 0.0, True)


def test_make_env_names_the_registered_environments_and_refuses_unknown_settings():
    assert "calculator" in ENVS
    with pytest.raises(KeyError, match="available: .*calculator"):
        make_env("nope")
    with pytest.raises(TypeError):
        make_env("calculator", bogus=1)
    with pytest.raises(ValueError, match="call_open"):
        make_env("calculator", call_open="")


def test_make_env_checks_each_settings_type_against_its_field():
    """Annotations written as text (from __future__ import annotations: the built-in environments)
    and as types (this test's); an int is a number, a bool is none; None only where the field takes it."""
    import dataclasses

    from megatron_rl.data.envs import Environment, register_env

    @dataclasses.dataclass
    class Typed(Environment):
        rate: float = 0.5
        count: int = 1
        tag: str | None = None
        flag: bool = False

        def reset(self, example):
            return example.prompt

        def step(self, generated_text, generated_ids):
            return Step("", None, True)

    register_env("typed")(Typed)
    try:
        assert make_env("typed", rate=2, count=3, tag=None, flag=True).rate == 2
        for key, value, want in (("rate", True, "a number"), ("count", 1.5, "an integer"), ("tag", 5, "a string or null"),
                                 ("flag", 1, "true or false"), ("count", None, "an integer")):
            with pytest.raises(TypeError, match=f"typed's setting {key}={value!r}: {want}$"):
                make_env("typed", **{key: value})
    finally:
        ENVS.pop("typed")
    with pytest.raises(TypeError, match="calculator's setting call_open=5: a string"):
        make_env("calculator", call_open=5)


def test_multiplication_prompts_determine_their_products():
    import random

    task = make_task("multiplication", heldout_size=10)
    ex = task.sample(random.Random(0))
    a, b = ex.prompt.rstrip("=").split("*")
    assert 100 <= int(a) <= 999 and 10 <= int(b) <= 99 and ex.label == str(int(a) * int(b))
    assert len(ex.prompt) == task.max_prompt_len and len(ex.label) <= task.max_label_len


def test_the_guess_game_answers_higher_lower_and_ends_at_the_secret():
    import random

    from megatron_rl.data.tasks.guessing import secret_of

    task = make_task("guessing", heldout_size=10)
    ex = task.sample(random.Random(3))
    game = int(ex.prompt.split("n")[1].rstrip(":"))
    assert ex.label == str(secret_of(game)) and ex.label not in ex.prompt.split("n")[0]
    env = make_env("guess")
    env.reset(Example("guess 0-99 n0001:", "57", "guessing"))
    assert env.step("50", [9]) == Step("higher", None, False) and env.step("75", [9]) == Step("lower", None, False)
    assert env.step("5 7", [9]) == Step("?", None, False) and env.step("100", [9]) == Step("?", None, False)
    assert env.step("57", [9]) == Step("", 1.0, True)
    # bisection wins within the game's max_turns whatever the secret
    for secret in range(100):
        env = make_env("guess")
        env.reset(Example("g", str(secret), "guessing"))
        lo, hi = 0, 99
        for _ in range(env.max_turns):
            mid = (lo + hi) // 2
            step = env.step(str(mid), [9])
            if step.done:
                break
            lo, hi = (mid + 1, hi) if step.observation == "higher" else (lo, mid - 1)
        assert step.done and step.reward == 1.0, secret


def test_the_demonstrations_solve_their_problems():
    calc = make_env("calculator")
    ex = Example("123*45=", "5535", "multiplication")
    calc.reset(ex)
    assert calc.demonstrate(ex) == ["<calc>123*45</calc>", "5535"]
    assert calc.demonstrate(Example("what?", "7", "x")) == ["7"]  # no expression: the answer alone
    guess = make_env("guess")
    guess.reset(Example("g", "57", "guessing"))
    assert guess.demonstrate(Example("g", "57", "guessing")) == ["49", "74", "61", "55", "58", "56", "57"]
