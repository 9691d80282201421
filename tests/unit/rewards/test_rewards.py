import threading

import pytest

from megatron_rl.rewards import exact_match, get_reward, math_verify_reward, reward_names


def test_registry():
    assert {"exact_match", "math"} <= set(reward_names())
    assert get_reward("exact_match") is exact_match and get_reward("math") is math_verify_reward
    with pytest.raises(KeyError, match="available: .*exact_match"):
        get_reward("nope")


@pytest.mark.parametrize(
    "response,label,reward",
    [("975", "975", 1.0), (" 975\n", "975", 1.0), ("975", " 975 ", 1.0), ("9750", "975", 0.0),
     ("97", "975", 0.0), ("", "975", 0.0), ("", "", 1.0), ("9\ufffd75", "975", 0.0)],
)
def test_exact_match(response, label, reward):
    assert exact_match("123+456=", response, label) == reward


@pytest.mark.parametrize(
    "response,label,reward",
    [
        ("\\boxed{1/2}", "0.5", 1.0),
        ("so the answer is $\\frac{1}{2}$", "0.5", 1.0),
        ("x = 3", "3", 1.0),
        ("2 + 2 = 4, so the answer is \\boxed{4}", "4", 1.0),
        ("0.5", "\\frac{1}{2}", 1.0),
        ("3", "$3$", 1.0),
        ("the answer is 4", "3", 0.0),
        ("\\boxed{1/3}", "0.5", 0.0),
        ("no idea", "3", 0.0),
        ("", "3", 0.0),
        ("\\boxed{", "3", 0.0),
        ("3", "", 0.0),
    ],
)
def test_math(response, label, reward):
    assert math_verify_reward("question", response, label) == reward


def test_math_off_the_main_thread():
    out = []
    t = threading.Thread(target=lambda: out.append(math_verify_reward("", "\\boxed{1/2}", "0.5")))
    t.start()
    t.join()
    assert out == [1.0]
