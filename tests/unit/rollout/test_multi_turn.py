"""The multi-turn rollout function: one token sequence per trajectory, environments that fail.

Trajectories are compared with sequences built by hand from the engine's script; an environment
that ends after one turn gives exactly single_turn's samples; a hung environment is released by an
event the test sets at the end (its deadline is short and nothing else waits on a clock)."""
import dataclasses
import logging
import math
import re
import threading

import pytest
import torch

from megatron_rl.config.env_section import EnvSection
from megatron_rl.data.envs import ENVS, Step, register_env
from megatron_rl.data.types import Example
from megatron_rl.rollout.function import RolloutFnInputs
from megatron_rl.rollout.multi_turn import MultiTurn
from megatron_rl.rollout.single_turn import SingleTurn
from megatron_rl.rollout.types import SamplingParams
from megatron_rl.trainer.batch import build_batch
from tests.unit.rollout.multi_turn_fakes import RELEASE, TOK, Flaky, OneShot, ScriptedEngine, fake_logprob

TOY_CALC = {"call_open": "c:", "call_close": "", "result_open": "r:", "result_close": ""}
SAMPLING = SamplingParams(temperature=1.0, max_tokens=12, stop_token_ids=TOK.stop_ids, seed=7)


@pytest.fixture
def test_envs():
    for name, cls in (("oneshot", OneShot), ("flaky", Flaky)):
        register_env(name)(cls)
    yield
    for name in ("oneshot", "flaky"):
        ENVS.pop(name)


def _multi(name="calculator", settings=None, **kw) -> MultiTurn:
    env = EnvSection(name=name, settings=settings if settings is not None else dict(TOY_CALC), **kw)
    return MultiTurn(RolloutFnInputs(TOK, rewards=None, env=env))


def _calculator_script(text: str) -> str:
    """The policy of a calculator user: call the tool, then copy its result."""
    return text.split("r:")[1] if "r:" in text else "c:" + text.rstrip("=")


def test_a_calculator_trajectory_is_the_hand_built_sequence():
    engine = ScriptedEngine(_calculator_script)
    gen = _multi(check_render=True)(engine, [Example("123*45=", "5535", "multiplication")], 1, SAMPLING)
    [s] = gen.samples
    prompt = TOK.encode("123*45=")
    call, obs, answer = TOK.encode("c:123*45") + [TOK.eos_id], TOK.encode("r:5535"), TOK.encode("5535") + [TOK.eos_id]
    assert s.prompt_ids.tolist() == prompt
    assert s.response_ids.tolist() == call + obs + answer
    assert s.loss_mask.tolist() == [True] * len(call) + [False] * len(obs) + [True] * len(answer)
    mu = [fake_logprob(len(prompt) + r, t) for r, t in enumerate(call)] + [0.0] * len(obs) + \
         [fake_logprob(len(prompt + call + obs) + r, t) for r, t in enumerate(answer)]
    assert torch.allclose(s.rollout_logprobs, torch.tensor(mu), rtol=0, atol=0)
    assert [c[0] for c in engine.calls] == [[prompt], [prompt + call + obs]]  # token ids in: never re-encoded
    assert gen.score() == [1.0] and s.finish_reason == "stop" and s.policy_version == 3
    assert gen.stats["env/turns"] == 2 and gen.stats["env/failures"] == 0 and gen.stats["env/render_drift"] == 0
    assert gen.stats["env/observation_tokens"] == len(obs)
    assert gen.stats["env/sampled_per_turn"] == (len(call) + len(answer)) / 2


def test_a_wrong_answer_scores_0_and_max_turns_ends_a_trajectory_without_its_observation():
    always_call = ScriptedEngine(lambda text: "c:1+1")
    gen = _multi(max_turns=2)(always_call, [Example("123*45=", "5535", "multiplication")], 2, SAMPLING)
    call = TOK.encode("c:1+1") + [TOK.eos_id]
    for s in gen.samples:  # two calls; the second's result is not appended: no turn follows it
        assert s.response_ids.tolist() == call + TOK.encode("r:2") + call
    assert gen.score() == [0.0, 0.0]
    wrong = _multi()(ScriptedEngine(lambda text: "5536"), [Example("123*45=", "5535", "multiplication")], 1, SAMPLING)
    assert wrong.score() == [0.0] and wrong.stats["env/turns"] == 1


def test_the_token_budget_caps_a_turn_and_ends_before_an_observation_that_leaves_no_room():
    engine = ScriptedEngine(_calculator_script)
    # prompt 7 ids; turn 1: 9 ids, obs 6 ids -> 15; a budget of 16 leaves 1 id for the answer
    gen = _multi(max_tokens=16)(engine, [Example("123*45=", "5535", "multiplication")], 1, SAMPLING)
    assert len(gen.samples[0].response_ids) == 16 and engine.calls[1][1][0].max_tokens == 1
    assert gen.samples[0].finish_reason == "length"
    gen = _multi(max_tokens=15)(ScriptedEngine(_calculator_script), [Example("123*45=", "5535", "m")], 1, SAMPLING)
    assert len(gen.samples[0].response_ids) == 9 and gen.stats["env/budget_ends"] == 1


def test_one_turn_without_observations_reproduces_single_turn(test_envs):
    examples = [Example("12+3=", "15", "addition"), Example("7+8=", "15", "addition")]

    def rewards(items):
        return [float(response == label) for _, response, label, _ in items]

    single = SingleTurn(RolloutFnInputs(TOK, rewards))(ScriptedEngine(random_ids=True), examples, 3, SAMPLING)
    multi = _multi("oneshot", {})(ScriptedEngine(random_ids=True), examples, 3, SAMPLING)
    assert len(single.samples) == len(multi.samples) == 6
    for a, b in zip(single.samples, multi.samples):
        for field in ("prompt_ids", "response_ids", "rollout_logprobs"):
            assert torch.equal(getattr(a, field), getattr(b, field)), field
        assert (a.finish_reason, a.prompt_index, a.sample_index) == (b.finish_reason, b.prompt_index, b.sample_index)
        assert b.loss_mask.all() and a.loss_mask is None
    assert single.score() == multi.score()
    # so the trainer's tensors, and every loss and gradient computed from them, are the same bit for bit
    packed = [build_batch(g.samples, g.score(), pad_id=0, seq_len=20) for g in (single, multi)]
    for f in dataclasses.fields(packed[0]):
        x, y = getattr(packed[0], f.name), getattr(packed[1], f.name)
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, f.name


def test_an_environment_that_raises_hangs_or_misbehaves_ends_its_trajectory_and_the_call_goes_on(test_envs, caplog):
    labels = ["ok", "raise", "hang", "bad", "noreset", "badreset", "badstep"]
    examples = [Example(f"{i}+{i}=", label, "addition") for i, label in enumerate(labels)]
    try:
        with caplog.at_level(logging.WARNING):
            gen = _multi("flaky", {}, timeout_s=0.5)(ScriptedEngine(lambda text: "1"), examples, 2, SAMPLING)
    finally:
        RELEASE.set()
    assert gen.score() == [1.0, 1.0] + [0.0] * 12
    assert len(gen.samples) == 14 and all(s.response_ids.tolist() == TOK.encode("1") + [TOK.eos_id]
                                          for s in gen.samples)
    for k in (8, 10):  # a failed reset: the example's own prompt
        assert gen.samples[k].prompt_ids.tolist() == TOK.encode(f"{k // 2}+{k // 2}=")
    assert gen.stats["env/failures"] == 12 and gen.stats["env/timeouts"] == 2
    assert "12 of 14 trajectories ended by a failing environment" in caplog.text


def test_the_render_check_reports_a_merge_across_a_turn_boundary():
    """A tokenizer that merges "r:" into one id (a BPE merge). The policy's turn ends with "r" (no
    stop id) and the observation starts with ":": kept as two ids, while the rendered text encodes
    "r:" to one; the drift is counted, and the kept ids are what the sample holds."""

    class Merging(type(TOK)):
        def encode_prompt(self, text):
            ids = self.encode(text.replace("r:", "?"))
            return [52 if i == self.encode("?")[0] else i for i in ids]

    tok = Merging()
    gen = MultiTurn(RolloutFnInputs(tok, None, EnvSection(name="calculator", check_render=True, settings={
        "call_open": "c", "call_close": "r", "result_open": ":", "result_close": ""})))
    engine = ScriptedEngine(lambda text: "c1+1r", max_len=512)
    out = gen(engine, [Example("1+1=", "2", "addition")], 1, SamplingParams(max_tokens=5, stop_token_ids=()))
    kept = out.samples[0].response_ids.tolist()
    assert kept[4:6] == tok.encode("r:")  # "r" sampled (no stop id ends the turn), ":" the environment's
    assert out.stats["env/render_drift"] == 1
    plain = _multi(check_render=True)(ScriptedEngine(_calculator_script), [Example("1*1=", "1", "m")], 1, SAMPLING)
    assert plain.stats["env/render_drift"] == 0  # the same check, no merge: nothing reported
    assert plain.stats["env/render_unencodable"] == 0
    unused = _multi(check_render=True)(ScriptedEngine(lambda text: "7", tail=[52]), [Example("1*1=", "1", "m")], 1,
                                       SAMPLING)  # a sampled unused id decodes to U+FFFD, which no text encodes
    assert unused.stats["env/render_drift"] == unused.stats["env/render_unencodable"] == 1


def test_the_config_names_the_environment_and_checks_its_settings():
    from megatron_rl.config.loader import ConfigError
    from megatron_rl.config.schema import LossSection
    from megatron_rl.configure import load_config
    from megatron_rl.losses.setup import resolve_loss
    from megatron_rl.rollout.function import max_trained

    with pytest.raises(ConfigError, match="set env.name"):
        load_config(None, ["rollout.function=multi_turn"])
    with pytest.raises(ConfigError, match="unknown environment 'nope'"):
        load_config(None, ["env.name=nope"])
    with pytest.raises(ConfigError, match="env.settings"):
        load_config(None, ["env.name=calculator", "env.settings.bogus=1"])
    with pytest.raises(ConfigError, match=r"env.settings: calculator's setting call_open=5: a string"):
        load_config(None, ["env.name=calculator", "env.settings.call_open=5"])
    cfg = load_config(None, ["rollout.function=multi_turn", "env.name=calculator", "data.tasks=[multiplication]",
                             "rollout.max_tokens=10", "env.max_turns=3", "env.max_tokens=64"])
    assert cfg.env.name == "calculator"
    # a constant-normaliser loss divides by the most tokens a trajectory can sample: 3 turns of 10
    assert max_trained(cfg) == 30 and resolve_loss(LossSection(recipe="minirl"), max_trained(cfg)).agg_params == {
        "l_norm": 30.0}
    assert max_trained(load_config(None, ["rollout.max_tokens=10"])) == 10


def test_a_group_shares_the_first_successful_reset_and_one_that_differs_fails(test_envs):
    class Moody(OneShot):
        made, lock = 0, threading.Lock()

        def reset(self, example):
            with Moody.lock:  # resets of one call run in threads: the count, not the order, is fixed
                Moody.made += 1
                odd = Moody.made % 2
            return super().reset(example) + ("?" if odd else "")

    register_env("moody")(Moody)
    try:
        gen = _multi("moody", {})(ScriptedEngine(lambda text: "1"), [Example("1+1=", "odd", "addition")], 4, SAMPLING)
    finally:
        ENVS.pop("moody")
    prompts = {tuple(s.prompt_ids.tolist()) for s in gen.samples}
    assert len(prompts) == 1 and gen.stats["env/failures"] == 2  # two of four resets differ from the first


def test_with_the_embedded_engine_one_turn_reproduces_single_turn_routes_and_kept_sets_included(
        test_envs, moe_checkpoint):
    from megatron_rl.rollout.embedded import EmbeddedEngine

    arch, _, ckpt = moe_checkpoint
    engine = EmbeddedEngine(arch)
    engine.update_weights(ckpt.items(), version=2)
    sampling = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=5, seed=11, return_kept_ids=True,
                              logprobs_mode="processed", stop_token_ids=TOK.stop_ids)
    examples = [Example("12+3=", "15", "addition"), Example("7+8=", "15", "addition")]
    single = SingleTurn(RolloutFnInputs(TOK, lambda items: [0.0] * len(items)))(engine, examples, 2, sampling)
    multi = _multi("oneshot", {})(engine, examples, 2, sampling)
    for a, b in zip(single.samples, multi.samples, strict=True):
        for field in ("prompt_ids", "response_ids", "rollout_logprobs", "routed_experts", "kept_ids"):
            assert torch.equal(getattr(a, field), getattr(b, field)), field
        assert len(b.routed_experts) == len(b.prompt_ids) + len(b.response_ids) - 1


def test_a_tokenizer_that_starts_every_prompt_with_bos_puts_none_before_an_observation():
    class WithBos(type(TOK)):
        def encode_prompt(self, text):
            return [self.bos_id] + self.encode(text)

    tok = WithBos()
    gen = MultiTurn(RolloutFnInputs(tok, None, EnvSection(name="calculator", check_render=True, settings=TOY_CALC)))
    out = gen(ScriptedEngine(_calculator_script), [Example("12*10=", "120", "multiplication")], 1, SAMPLING)
    s = out.samples[0]
    assert s.prompt_ids.tolist() == [tok.bos_id] + tok.encode("12*10=")
    assert s.response_ids.tolist() == tok.encode("c:12*10") + [tok.eos_id] + tok.encode("r:120") + tok.encode("120") + [
        tok.eos_id]
    assert out.score() == [1.0] and out.stats["env/render_drift"] == 0  # the render encodes continuations alike


def _bisect_script(text: str) -> str:
    """A guess player: bisection from the feedback so far in the context text."""
    lo, hi = 0, 99
    for guess, answer in re.findall(r"(\d+)(higher|lower)", text.split(":", 1)[1]):
        lo, hi = (int(guess) + 1, hi) if answer == "higher" else (lo, int(guess) - 1)
    return str((lo + hi) // 2)


@pytest.mark.parametrize("env,example,script", [
    ("calculator", Example("123*45=", "5535", "multiplication"), _calculator_script),
    ("guess", Example("guess 0-99 n0001:", "57", "guessing"), _bisect_script)], ids=["calculator", "guess"])
def test_a_demonstration_is_the_trajectory_a_rollout_of_its_turns_records(env, example, script):
    from megatron_rl.rollout import ROLLOUT_FNS

    settings = TOY_CALC if env == "calculator" else {}
    inputs = RolloutFnInputs(TOK, None, EnvSection(name=env, settings=settings, max_turns=8, max_tokens=64))
    [demo] = ROLLOUT_FNS.get("multi_turn").supervised(inputs, [example])
    rolled = MultiTurn(inputs)(ScriptedEngine(script), [example], 1, SAMPLING)
    [s] = rolled.samples
    assert rolled.score() == [1.0]
    for field in ("prompt_ids", "response_ids", "loss_mask"):
        assert torch.equal(getattr(demo, field), getattr(s, field)), field
    assert int((~demo.loss_mask).sum()) > 0  # the observations are in it, masked


def test_an_environment_without_demonstrations_is_named(test_envs):
    from megatron_rl.rollout.multi_turn import supervised

    with pytest.raises(ValueError, match="'oneshot' has no demonstration for '1\\+1='.*sft.steps=0"):
        supervised(RolloutFnInputs(TOK, None, EnvSection(name="oneshot")), [Example("1+1=", "2", "addition")])


def test_an_example_may_name_its_own_environment():
    """A calculator example (the run's env.name) beside a guess example (its own env): each runs
    its environment's game under its own turn cap (guess: env.max_turns=4 < its 7)."""

    def script(text):
        return "50" if text.startswith("guess") else _calculator_script(text)

    examples = [Example("123*45=", "5535", "multiplication"), Example("guess 0-99 n0042:", "57", "guessing", env="guess")]
    gen = _multi(max_turns=4)(ScriptedEngine(script), examples, 1, SAMPLING)
    calc, guess = gen.samples
    assert calc.response_ids.tolist() == (TOK.encode("c:123*45") + [TOK.eos_id] + TOK.encode("r:5535") +
                                          TOK.encode("5535") + [TOK.eos_id])
    turn = TOK.encode("50") + [TOK.eos_id]
    assert guess.response_ids.tolist() == (turn + TOK.encode("higher")) * 3 + turn  # the 4th's feedback dropped
    assert gen.score() == [1.0, 0.0]


def test_which_settings_an_examples_environment_gets():
    from megatron_rl.rollout.multi_turn import env_of

    cfg = EnvSection(name="calculator", settings=dict(TOY_CALC))
    assert env_of(Example("1=", "1", "t"), cfg) == ("calculator", TOY_CALC)
    assert env_of(Example("1=", "1", "t", env="calculator"), cfg) == ("calculator", TOY_CALC)  # the run's own
    assert env_of(Example("1=", "1", "t", env="guess"), cfg) == ("guess", {})  # another's: its defaults
    mine = {"call_open": "x"}
    assert env_of(Example("1=", "1", "t", env="calculator", env_settings=mine), cfg) == ("calculator", mine)


def test_per_turn_rewards_sum_to_the_trajectory_reward_and_are_logged_by_turn():
    """An environment that rewards turn k with k + 1 for 5 turns; a second trajectory's environment
    raises at its third turn (a failure: every turn scores 0). By hand: trajectory rewards 15 and 0;
    by turn (2 trajectories at turns 0-2, 1 at 3 and 4): (1+0)/2, (2+0)/2, (3+0)/2, (4+5)/2."""

    class Counting(OneShot):
        max_turns = 5

        def reset(self, example):
            self.k, self.label = 0, example.label
            return example.prompt

        def step(self, generated_text, generated_ids):
            self.k += 1
            if self.label == "raise" and self.k == 3:
                raise ValueError("broke at turn 2")
            return Step("x", float(self.k), False)

    register_env("counting")(Counting)
    try:
        examples = [Example("1+1=", "ok", "t"), Example("2+2=", "raise", "t")]
        gen = _multi("counting", {}, max_turns=5)(ScriptedEngine(lambda text: "1"), examples, 1, SAMPLING)
    finally:
        ENVS.pop("counting")
    assert gen.score() == [15.0, 0.0]
    want = {"0": (2, 0.5), "1": (2, 1.0), "2": (2, 1.5), "3_or_later": (2, 4.5)}
    for label, (turns, reward) in want.items():
        assert gen.stats[f"env/turn/{label}/turns"] == turns and gen.stats[f"env/turn/{label}/reward"] == reward
    assert gen.stats["env/failures"] == 1


def test_turn_reward_stats_leaves_out_turns_no_trajectory_reached():
    from megatron_rl.rollout.multi_turn import turn_reward_stats

    assert turn_reward_stats([[1.0], [0.0, 2.0]]) == {"env/turn/0/turns": 2.0, "env/turn/0/reward": 0.5,
                                                      "env/turn/1/turns": 1.0, "env/turn/1/reward": 2.0}
    assert turn_reward_stats([]) == {}


def test_prefix_cache_stats_are_the_cached_share_of_first_and_later_turn_prompt_tokens():
    """By hand: first turns 10 + 10 prompt tokens, 0 + 8 cached; later turns 30 + 50 + 40 (the
    None-reported 99-token turn left out), 16 + 48 + 32 cached."""
    from megatron_rl.rollout.multi_turn import prefix_cache_stats

    got = prefix_cache_stats([[(10, 0), (30, 16), (50, 48)], [(10, 8), (99, None), (40, 32)]])
    assert got == {"rollout/prefix_cache/first/share": 8 / 20, "rollout/prefix_cache/first/prompt_tokens": 20.0,
                   "rollout/prefix_cache/later/share": (16 + 48 + 32) / (30 + 50 + 40),
                   "rollout/prefix_cache/later/prompt_tokens": 120.0}
    assert prefix_cache_stats([[(10, 4)], [(12, 0)]]) == {"rollout/prefix_cache/first/share": 4 / 22,
                                                          "rollout/prefix_cache/first/prompt_tokens": 22.0}
    assert prefix_cache_stats([[(10, None), (20, None)]]) == {} == prefix_cache_stats([])  # not reported: no key


def test_a_non_finite_reward_fails_its_trajectory_and_never_reaches_the_score():
    """NaN, inf, and finite turns of 1e308 whose sum is inf: each fails its trajectory (reward 0,
    counted in env/failures, named in the log), beside a finite trajectory that scores."""

    class Paying(OneShot):
        max_turns = 3

        def reset(self, example):
            self.label = example.label
            return example.prompt

        def step(self, generated_text, generated_ids):
            if self.label == "huge":
                return Step("x", 1e308, False)
            bad = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "bigint": 10**400}
            return Step("", bad.get(self.label, 2.0), True)

    register_env("paying")(Paying)
    try:
        examples = [Example(f"{i}+{i}=", label, "t") for i, label in enumerate(["nan", "inf", "-inf", "huge", "bigint", "ok"])]
        gen = _multi("paying", {}, max_turns=3)(ScriptedEngine(lambda text: "1"), examples, 1, SAMPLING)
    finally:
        ENVS.pop("paying")
    assert gen.score() == [0.0, 0.0, 0.0, 0.0, 0.0, 2.0]
    assert gen.stats["env/failures"] == 5
    assert all(math.isfinite(v) for v in gen.stats.values()), gen.stats


def test_an_observation_that_cannot_be_encoded_is_quoted_in_part(caplog):
    """A 1 MB observation of characters the toy tokenizer lacks fails its trajectory; the failure
    and the warning quote a bounded part of it, not the megabyte."""

    class Flood(OneShot):
        def step(self, generated_text, generated_ids):
            return Step("<" * 1_000_000, None, False)

    register_env("flood")(Flood)
    try:
        with caplog.at_level(logging.WARNING):
            gen = _multi("flood", {})(ScriptedEngine(lambda text: "1"), [Example("1+1=", "2", "t")], 2, SAMPLING)
    finally:
        ENVS.pop("flood")
    assert gen.stats["env/failures"] == 2 and gen.score() == [0.0, 0.0]
    assert "cannot be encoded" in caplog.text and "'<'" in caplog.text
    assert len(caplog.text) < 2_000


def _stuck_threads():
    return sum(t.name.startswith("env-call-") and t.is_alive() for t in threading.enumerate())


@pytest.mark.parametrize("how", ["hang", "loop"])
def test_a_stuck_environment_stops_the_run_before_its_threads_pile_up(how):
    """Every step one trajectory of two hangs (an Event) or busy-loops (until the Event; both end once the test sets it): each of
    its calls is abandoned at env.timeout_s and keeps its thread. Over up to 40 steps the run stops
    with StuckEnvironment naming the environment and the settings once more than
    env.max_stuck_calls (default 32; 4 for the loop, to spare the CPU) are stuck, and the threads
    never exceed that plus one step's."""

    release = threading.Event()

    class Stuck(OneShot):
        def step(self, generated_text, generated_ids):
            if self.label == "stuck":
                while not release.wait(None if how == "hang" else 0.0):
                    pass
            return Step("", 1.0, True)

    register_env("stuck")(Stuck)
    cap = 32 if how == "hang" else 4
    before = _stuck_threads()
    fn = _multi("stuck", {}, timeout_s=0.05, **({} if how == "hang" else {"max_stuck_calls": cap}))
    examples = [Example("1+1=", "stuck", "t"), Example("2+2=", "ok", "t")]
    stopped, most = None, 0
    try:
        for step in range(40):
            try:
                gen = fn(ScriptedEngine(lambda text: "1"), examples, 1, SAMPLING)
            except Exception as e:  # noqa: BLE001 - the run's stop, checked below
                stopped = (step, e)
                break
            assert gen.score() == [0.0, 1.0] and gen.stats["env/timeouts"] == 1
            assert gen.stats["env/stuck_calls"] == step + 1  # the run sees them coming
            most = max(most, _stuck_threads() - before)
    finally:
        release.set()
        ENVS.pop("stuck")
    assert stopped is not None, f"40 steps with {most} stuck threads and no stop"
    step, e = stopped
    assert step == cap and type(e).__name__ == "StuckEnvironment", (step, e)
    assert f"{cap + 1} environment calls are still running past env.timeout_s=0.05 s (stuck.step x{cap + 1})" in str(e)
    assert f"env.max_stuck_calls={cap}" in str(e)
    assert most <= cap
