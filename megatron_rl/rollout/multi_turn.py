"""`multi_turn`: an agent loop; the policy and an environment take turns, one token sequence each.

    trajectory k (example k // n): env = make_env(name, **settings)   the example's env, else env.name
        ids = encode_prompt(env.reset(example))                         turn 0's prompt
        repeat: sample a turn from ids (token ids in) -> ids += sampled ids
                env.step(decoded turn, sampled ids) -> observation, reward, done
                ids += encode(prefix + observation + suffix)            tokenized alone
    (encode: the tokenizer's encode_prompt, less the BOS-like prefix it puts before every text)
    one Sample per trajectory (rollout/trajectory.py: assemble): the environment's ids are in the
    response as context with loss_mask False; reward = the sum of the environment's rewards
    (advantages stay per trajectory); each turn's own reward is kept and logged by turn

Every trajectory is a coroutine: its turns go to the engine as single requests
(rollout/requests.py), its environment calls run in threads with their deadline. With
env.turns=async it goes on as soon as its own environment answers, beside trajectories at other
turns (the engine gets the requests pending whenever it is free, or each as it comes: the
vLLM engine, rollout/requests.py): none waits for the slowest. With
env.turns=lockstep (the default) every engine call holds one request of every running trajectory
(bit-exact calls and resumes, each turn waiting for the slowest environment).

The resets all run first; turn 0 is then one engine call of the n samples of every example, exactly
as `single_turn` calls it (same prompts, seed and streams (i, j)): an environment that ends every
trajectory after one turn reproduces the single-turn samples. Turn m >= 1 of trajectory k draws
from stream (k, 0) of a seed derived from (rollout seed, m), so a sample depends on its own
trajectory, never on which others share its batch; each turn samples at most rollout.max_tokens,
and fewer where the trajectory's budget (env.max_tokens, and the engine's maximum length) leaves
less.

An example may name its own environment (a JSONL record's "env" and "env_settings", data/jsonl.py);
the others run in env.name with env.settings. A trajectory ends when its environment says done,
after env.max_turns (or its environment's own max_turns, whichever is fewer) policy turns, when
its next observation would leave no budget for a turn (that observation is dropped: nothing would
be sampled after it), or when an environment call fails
(raises, times out after env.timeout_s, or answers what is not a Step, text the tokenizer
cannot encode, or a reward that is not finite or takes the trajectory's sum past float's range:
inf or NaN never reaches the loss): a failed trajectory keeps its sampled turns and scores 0
(counted, as a failing reward is; its failure quotes at most MAX_FAILURE_CHARS of what the
environment answered). A failed reset leaves the example's own prompt as the trajectory's prompt and ends
after one turn.

With env.check_render, every trajectory is also rendered as text and encoded again
(trajectory.rerender; with a tokenizer that has a chat template, the conversation after the prompt
as that template writes it: trajectory.rerender_chat, so a template that rewrites earlier turns,
as Qwen3's drops their <think> blocks, shows); a difference from the kept ids is counted
(env/render_drift) and warned about once per call, never corrected.

Stats (Generated.stats): env/turns (mean policy turns per trajectory), env/sampled_per_turn (mean
sampled tokens per turn), env/observation_tokens (mean per trajectory), env/failures, env/timeouts,
env/stuck_calls (calls past their deadline still running, of this call and earlier ones),
env/budget_ends, env/render_drift, env/render_unencodable, and by policy turn (labels as
mismatch/turn/*: 0, 1, 2, 3_or_later) env/turn/{k}/turns (policy turns sampled) and
env/turn/{k}/reward (their mean reward: the environment's reward for that turn, None as 0, every
turn of a failed trajectory 0), so the rewards by turn of a call sum to its trajectories' rewards;
with an engine that reports its prefix-cache hits (vLLM), rollout/prefix_cache/{first,later}/share
(the prompt tokens of first / later turns served from the cache: prefix_cache_stats).

A call that outlives env.timeout_s keeps its thread (Python cannot stop one); once more than
env.max_stuck_calls of them still run, the rollout raises StuckEnvironment naming the environment
(rollout/env_calls.py says why threads and a bound, not processes).

Cost: at most one engine call per trajectory turn (usually far fewer: each call takes every
request pending), one environment call per trajectory and turn (a thread each, at most
env.max_calls_in_flight at once, rollout/env_calls.py; plus at most env.max_stuck_calls
abandoned), O(trajectory
length) host memory per trajectory; one event loop per rollout call.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from megatron_rl.data.envs import Environment, Step, make_env
from megatron_rl.data.types import derive_seed
from megatron_rl.metrics.mismatch import turn_labels
from megatron_rl.rollout.engine import RolloutEngine
from megatron_rl.rollout.env_calls import CallResult, EnvCalls
from megatron_rl.rollout.function import Generated, RolloutFnInputs, RolloutFnSpec
from megatron_rl.rollout.requests import RequestQueue
from megatron_rl.rollout.trajectory import Turn, assemble, continuation, drift, rerender, rerender_chat
from megatron_rl.rollout.types import Request, Sample, SamplingParams

log = logging.getLogger(__name__)


@dataclass
class _Trajectory:
    """Rank 0's record of one trajectory while it runs."""

    env: Environment
    max_turns: int
    prompt_text: str = ""
    prompt_ids: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    observations: list[str] = field(default_factory=list)  # each kept observation's text, no delimiters
    rewards: list[float] = field(default_factory=list)  # per policy turn shown to the environment
    failure: str | None = None
    ended_by: str | None = None  # "done" | "max_turns" | "budget" | "failure"

    def ids(self) -> list[int]:
        out = list(self.prompt_ids)
        for t in self.turns:
            out += t.sample.response_ids.tolist() + list(t.observation_ids)
        return out

    def response_len(self) -> int:
        return len(self.ids()) - len(self.prompt_ids)

    @property
    def reward(self) -> float:
        """The trajectory's reward: the sum of its turns' rewards."""
        return sum(self.rewards)

    def turn_rewards(self) -> list[float]:
        """One reward per sampled policy turn (0 for a turn the environment did not score)."""
        return self.rewards + [0.0] * (len(self.turns) - len(self.rewards))

    def fail(self, why: str) -> None:
        self.failure, self.rewards, self.ended_by = _clip(why), [], "failure"


class MultiTurn:
    def __init__(self, inputs: RolloutFnInputs):
        if inputs.env is None or inputs.env.name is None:
            raise ValueError("rollout.function=multi_turn needs an environment: set env.name")
        self.tokenizer, self.env = inputs.tokenizer, inputs.env
        self.encode_observation = continuation(self.tokenizer.encode_prompt)
        self.calls = EnvCalls(self.env.timeout_s, self.env.max_stuck_calls,  # across calls: abandoned ones live on
                              self.env.max_calls_in_flight)

    def __call__(self, engine: RolloutEngine, examples: Sequence, n: int, sampling: SamplingParams) -> Generated:
        cfg = self.env
        trajs = []
        for k in range(len(examples) * n):
            name, settings = env_of(examples[k // n], cfg)
            env = make_env(name, **settings)
            trajs.append(_Trajectory(env, min(cfg.max_turns, env.max_turns)))
        try:
            asyncio.run(self._rollout(engine, examples, trajs, n, sampling))
        except BaseExceptionGroup as group:  # an engine error (every request of its call has it), StuckEnvironment
            raise group.exceptions[0] from None
        samples = [assemble(t.prompt_ids, t.turns) for t in trajs]
        rewards = [t.reward for t in trajs]
        return Generated(samples, lambda: rewards, self._stats(trajs))

    async def _rollout(self, engine, examples: Sequence, trajs: list[_Trajectory], n: int,
                       sampling: SamplingParams) -> None:
        """Every reset, then one coroutine per trajectory (module docstring)."""
        resets = await asyncio.gather(*(self.calls.call(functools.partial(t.env.reset, examples[k // n]),
                                                        f"{t.env.name}.reset") for k, t in enumerate(trajs)))
        for k, (t, r) in enumerate(zip(trajs, resets, strict=True)):
            t.prompt_text = examples[k // n].prompt  # checked at start-up: the fallback of a failed reset
            if r.failure is not None or not isinstance(r.value, str):
                t.fail(r.failure or f"reset returned {type(r.value).__name__}, not the prompt text")
            else:
                try:
                    t.prompt_ids, t.prompt_text = self.tokenizer.encode_prompt(r.value), r.value
                except ValueError as e:
                    t.fail(f"error: the first observation cannot be encoded: {e}")
            if t.failure is not None:
                t.prompt_ids = self.tokenizer.encode_prompt(t.prompt_text)
        self._share_first_prompts(trajs, n)
        first = dataclasses.replace(sampling, max_tokens=min(sampling.max_tokens, self.env.max_tokens))
        async with RequestQueue(engine, together=self.env.turns == "lockstep") as queue, asyncio.TaskGroup() as tasks:
            for k, t in enumerate(trajs):
                tasks.create_task(self._trajectory(queue, engine.max_len, t, k, n, first, sampling))

    def _share_first_prompts(self, trajs: list[_Trajectory], n: int) -> None:
        """Turn 0 as single_turn samples it: the n samples of each example from one prompt, the
        first successful reset's (a group compares responses to one prompt); a reset that gave
        another first observation fails its trajectory."""
        for i in range(0, len(trajs), n):
            group = trajs[i:i + n]
            ref = next((t for t in group if t.failure is None), group[0])
            for t in group:
                if t.prompt_ids != ref.prompt_ids:
                    if t.failure is None:
                        t.fail("reset gave a different first observation than the rest of its group")
                    t.prompt_text, t.prompt_ids = ref.prompt_text, ref.prompt_ids

    # ---- one trajectory ---------------------------------------------------------------------------
    async def _trajectory(self, queue: RequestQueue, max_len: int, t: _Trajectory, k: int, n: int,
                          first: SamplingParams, sampling: SamplingParams) -> None:
        """Trajectory k (sample k % n of example k // n): turn 0 from its prompt with `first`, on
        stream (k // n, k % n) as single_turn's; then turn -> environment -> turn until it ends,
        turn m on stream (k, 0) of the seed derived for turn m."""
        async with queue.member():
            t.turns.append(Turn(await queue.sample(Request(t.prompt_ids, first, (k // n, k % n)))))
            turn = 0
            while t.ended_by is None:
                ids = t.turns[-1].sample.response_ids.tolist()
                step = functools.partial(t.env.step, self.tokenizer.decode(ids), ids)
                self._take(t, await self.calls.call(step, f"{t.env.name}.step"), turn, max_len)
                if t.ended_by is not None:
                    return
                turn += 1
                seed = derive_seed(sampling.seed, "turn", turn) % 2**31
                params = dataclasses.replace(sampling, max_tokens=self._room(t, max_len, sampling.max_tokens), seed=seed)
                t.turns.append(Turn(await queue.sample(Request(t.ids(), params, (k, 0)))))

    def _room(self, t: _Trajectory, max_len: int, max_tokens: int) -> int:
        """How many tokens trajectory t's next turn may sample."""
        return min(max_tokens, self.env.max_tokens - t.response_len(), max_len - len(t.ids()))

    def _take(self, t: _Trajectory, r: CallResult, turn: int, max_len: int) -> None:
        """Apply one environment answer to its trajectory."""
        s = t.turns[-1].sample
        if r.failure is not None or not isinstance(r.value, Step):
            t.fail(r.failure or f"step returned {type(r.value).__name__}, not a Step")
            return
        step = r.value
        if not (isinstance(step.observation, str) and (step.reward is None or isinstance(step.reward, (int, float)))):
            t.fail(f"step returned {step!r}: a text observation and a number or None reward")
            return
        try:
            reward = 0.0 if step.reward is None else float(step.reward)
        except OverflowError:  # an int beyond float's range
            reward = math.inf
        if not math.isfinite(reward) or not math.isfinite(t.reward + reward):  # never reaches the loss
            why = "not a finite number" if not math.isfinite(reward) else f"the trajectory's sum {t.reward + reward}"
            t.fail(f"step returned reward {_clip(repr(step.reward))}: {why}")
            return
        t.rewards.append(reward)  # turn `turn`: every turn is shown
        if step.done:
            t.ended_by = "done"
            return
        if turn + 1 >= t.max_turns:
            t.ended_by = "max_turns"
            return
        text = self.env.observation_prefix + step.observation + self.env.observation_suffix
        try:
            obs = self.encode_observation(text)
        except ValueError as e:
            t.fail(f"error: the observation cannot be encoded: {e}")
            return
        room = min(self.env.max_tokens - t.response_len(), max_len - len(t.ids())) - len(obs)
        if room < 1:
            t.ended_by = "budget"
            return
        t.turns[-1] = Turn(s, obs)
        t.observations.append(step.observation)

    # ---- demonstrations (the SFT warm start) ------------------------------------------------------
    def demonstration(self, example) -> Sample:
        """One trajectory of the environment's demonstrated turns (Environment.demonstrate), as a
        rollout would have recorded it: each turn's text encoded alone + the stop id (loss_mask
        True), each observation as a rollout appends it (False); log-probs 0 (unused by SFT).
        Raises ValueError when the environment has no demonstration."""
        name, settings = env_of(example, self.env)
        env = make_env(name, **settings)
        prompt = self.tokenizer.encode_prompt(env.reset(example))
        texts = env.demonstrate(example)
        if not texts:
            raise ValueError(f"environment {name!r} has no demonstration for {example.prompt!r}; the SFT warm "
                             f"start of a multi_turn run trains on demonstrations (or set sft.steps=0)")
        context, turns = list(prompt), []
        for k, text in enumerate(texts):
            ids = self.tokenizer.encode(text) + [self.tokenizer.eos_id]
            sample = Sample(prompt_ids=torch.tensor(context, dtype=torch.long), response_ids=torch.tensor(ids, dtype=torch.long),
                            rollout_logprobs=torch.zeros(len(ids)), finish_reason="stop", policy_version=0)
            step = env.step(text, ids)
            last = step.done or k == len(texts) - 1
            obs = [] if last else self.encode_observation(
                self.env.observation_prefix + step.observation + self.env.observation_suffix)
            turns.append(Turn(sample, obs))
            context += ids + obs
            if last:
                break
        return assemble(prompt, turns)

    # ---- diagnostics ----------------------------------------------------------------------------
    def _stats(self, trajs: list[_Trajectory]) -> dict[str, float]:
        num = max(len(trajs), 1)
        turns = sum(len(t.turns) for t in trajs)
        sampled = sum(len(x.sample.response_ids) for t in trajs for x in t.turns)
        stats = {"env/turns": turns / num, "env/sampled_per_turn": sampled / max(turns, 1),
                 "env/observation_tokens": sum(len(x.observation_ids) for t in trajs for x in t.turns) / num,
                 "env/failures": float(sum(t.failure is not None for t in trajs)),
                 "env/timeouts": float(sum(t.failure == "timeout" for t in trajs)),
                 "env/budget_ends": float(sum(t.ended_by == "budget" for t in trajs)),
                 "env/stuck_calls": float(self.calls.stuck()),
                 **turn_reward_stats([t.turn_rewards() for t in trajs]),
                 **prefix_cache_stats([[(len(x.sample.prompt_ids), x.sample.cached_tokens) for x in t.turns]
                                       for t in trajs])}
        failed = [t.failure for t in trajs if t.failure is not None]
        if failed:
            log.warning("multi_turn: %d of %d trajectories ended by a failing environment (first: %s)",
                        len(failed), len(trajs), failed[0])
        if self.env.check_render:
            stats.update(self._render_drift(trajs))
        return stats

    def _render_drift(self, trajs: list[_Trajectory]) -> dict[str, float]:
        """How many trajectories a text-keeping pipeline would re-tokenize into other ids
        (env/render_drift), and of those, how many it could not encode at all (a sampled special
        or unused id decodes to U+FFFD; or the chat template failed: env/render_unencodable). With
        a tokenizer that has a chat template, the pipeline renders the conversation with it
        (trajectory.rerender_chat: turns as assistant messages, observations as the environment's
        observation_role), else as plain text (trajectory.rerender)."""
        chat = self.tokenizer.chat_template is not None
        drifted, unencodable = [], 0
        for k, t in enumerate(trajs):
            try:
                rendered = self._rendered_chat(t) if chat else self._rendered_text(t)
            except ValueError:
                unencodable += 1
                continue
            d = drift(t.ids(), rendered, closing_ok=chat)
            if d is not None:
                drifted.append((k, d))
        if drifted:
            k, d = drifted[0]
            log.warning("multi_turn: %d of %d trajectories re-%s to other ids than were sampled (first: "
                        "trajectory %d at id %d; %d kept ids vs %d re-encoded); the kept ids are trained",
                        len(drifted), len(trajs), "render with the chat template" if chat else "encode", k,
                        d.index, d.kept_len, d.rendered_len)
        return {"env/render_drift": float(len(drifted) + unencodable), "env/render_unencodable": float(unencodable)}

    def _rendered_text(self, t: _Trajectory) -> list[int]:
        """t's conversation as plain text (its delimiters: env.observation_prefix/suffix), encoded."""
        cfg, tok = self.env, self.tokenizer
        turns = [(tok.decode(x.sample.response_ids.tolist()), x.sample.response_ids.tolist(),
                  cfg.observation_prefix + t.observations[i] + cfg.observation_suffix if i < len(t.observations)
                  else "") for i, x in enumerate(t.turns)]
        return rerender(t.prompt_text, turns, tok.encode_prompt, tok.stop_ids)

    def _rendered_chat(self, t: _Trajectory) -> list[int]:
        """t's conversation as the tokenizer's chat template writes it, encoded."""
        tok = self.tokenizer
        turns = [(tok.decode(x.sample.response_ids.tolist()), t.observations[i] if i < len(t.observations) else "",
                  t.env.observation_role) for i, x in enumerate(t.turns)]
        return rerender_chat(t.prompt_text, turns, tok.render_chat, tok.encode_prompt)


MAX_FAILURE_CHARS = 300


def _clip(text: str, limit: int = MAX_FAILURE_CHARS) -> str:
    """`text` cut to about `limit` characters, its start and end kept (a failure quotes what the
    environment answered, which may be megabytes)."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]} ...[{len(text) - 2 * half} characters cut]... {text[-half:]}"


def turn_reward_stats(rewards: Sequence[Sequence[float]]) -> dict[str, float]:
    """env/turn/{label}/{turns,reward} from each trajectory's per-turn rewards (rewards[i][k]: turn
    k of trajectory i). Turns 0, 1, 2 each, then 3 and later together (metrics.mismatch.turn_labels);
    reward: the mean over the turns in the bucket; a bucket no trajectory reached is left out."""
    labels = turn_labels()
    count, total = [0] * len(labels), [0.0] * len(labels)
    for per_turn in rewards:
        for k, r in enumerate(per_turn):
            b = min(k, len(labels) - 1)
            count[b] += 1
            total[b] += r
    out = {}
    for label, c, s in zip(labels, count, total, strict=True):
        if c:
            out[f"env/turn/{label}/turns"], out[f"env/turn/{label}/reward"] = float(c), s / c
    return out


def prefix_cache_stats(turns: Sequence[Sequence[tuple[int, int | None]]]) -> dict[str, float]:
    """rollout/prefix_cache/{first,later}/{share,prompt_tokens} from turns[i][k] = (prompt tokens,
    prompt tokens found in the engine's prefix cache or None) of turn k of trajectory i: over the
    first turns (k = 0) and over the later ones (k >= 1), sum cached / sum prompt tokens, and that
    sum of prompt tokens, counting only the requests the engine reported (Sample.cached_tokens); a
    bucket without one is left out (an engine that does not report it logs no key)."""
    prompt, cached = {"first": 0, "later": 0}, {"first": 0, "later": 0}
    for per_turn in turns:
        for k, (length, hit) in enumerate(per_turn):
            if hit is not None:
                b = "first" if k == 0 else "later"
                prompt[b] += length
                cached[b] += hit
    return {key: value for b in prompt if prompt[b]
            for key, value in ((f"rollout/prefix_cache/{b}/share", cached[b] / prompt[b]),
                               (f"rollout/prefix_cache/{b}/prompt_tokens", float(prompt[b])))}


def env_of(example, cfg) -> tuple[str, dict]:
    """(name, settings) of the environment `example` runs in: its own (Example.env, with its
    env_settings, else the run's env.settings when it is env.name, else none), or the run's."""
    name = example.env
    if name is None:
        return cfg.name, dict(cfg.settings)
    if example.env_settings is not None:
        return name, dict(example.env_settings)
    return name, dict(cfg.settings) if name == cfg.name else {}


def check(cfg) -> None:
    """multi_turn needs env.name."""
    if cfg.env.name is None:
        raise ValueError("rollout.function=multi_turn needs an environment: set env.name (e.g. env.name=calculator)")


def supervised(inputs: RolloutFnInputs, examples: Sequence) -> list[Sample]:
    """The SFT warm start's samples: one demonstrated trajectory per example."""
    fn = MultiTurn(inputs)
    return [fn.demonstration(e) for e in examples]


def max_trained(cfg) -> int:
    """The most sampled tokens of a trajectory: every turn at rollout.max_tokens, within the budget."""
    return min(cfg.env.max_tokens, cfg.env.max_turns * cfg.rollout.max_tokens)


MULTI_TURN = RolloutFnSpec(make=MultiTurn, check=check, max_trained=max_trained, supervised=supervised, runs_envs=True)
"""A registered entry (rollout/registered.py)."""
