"""Fakes for the multi-turn tests: a scripted engine (no model) and environments that fail on cue."""
import threading

import torch

from megatron_rl.data.envs import Environment, Step
from megatron_rl.data.tokenizer import CharTokenizer
from megatron_rl.rollout.types import Sample, grouped, requests_of, stream_seed

TOK = CharTokenizer()


def fake_logprob(context_len: int, token: int) -> float:
    """What ScriptedEngine reports as log μ of `token` sampled after `context_len` ids."""
    return -0.01 * (token + 1) - 0.001 * context_len


class ScriptedEngine:
    """RolloutEngine whose every response is `script(context text)`, then the ids `tail`, then <eos>,
    truncated to max_tokens, each token at log-prob fake_logprob; with `random_ids`, sample (i, j) is instead
    max_tokens ids drawn from stream_seed(seed, i, j) (a request's stream (i, j)). Records every call's
    prompts and sampling settings."""

    def __init__(self, script=None, random_ids=False, max_len=512, tail=()):
        self.script, self.random_ids, self.calls, self._max_len, self.tail = script, random_ids, [], max_len, list(tail)
        self.policy_version = 3

    @property
    def max_len(self):
        return self._max_len

    def _ids(self, prompt, i, j, sampling):
        if self.random_ids:
            g = torch.Generator().manual_seed(stream_seed(sampling.seed, i, j))
            return torch.randint(4, 40, (sampling.max_tokens,), generator=g).tolist()
        text = "".join(TOK.decode([t]) for t in prompt)  # every id, past an <eos> too
        return (TOK.encode(self.script(text)) + self.tail + [TOK.eos_id])[:sampling.max_tokens]

    def generate(self, prompts, n, sampling):
        return grouped(self.generate_requests(requests_of(prompts, n, sampling)), len(prompts), n)

    def generate_requests(self, requests):
        """One sample per request; records the call as (prompts, their SamplingParams)."""
        self.calls.append(([list(r.prompt_ids) for r in requests], [r.sampling for r in requests]))
        out = []
        for r in requests:
            p, (i, j) = list(r.prompt_ids), r.stream
            ids = self._ids(p, i, j, r.sampling)
            lp = [fake_logprob(len(p) + k, t) for k, t in enumerate(ids)]
            out.append(Sample(prompt_ids=torch.tensor(p), response_ids=torch.tensor(ids),
                              rollout_logprobs=torch.tensor(lp), policy_version=self.policy_version,
                              finish_reason="stop" if ids[-1] == TOK.eos_id else "length",
                              prompt_index=i, sample_index=j))
        return out


class OneShot(Environment):
    """One turn, no observation: reward 1 when the turn's text equals the label (single_turn's
    exact match)."""

    max_turns = 5

    def reset(self, example):
        self.label = example.label
        return example.prompt

    def step(self, generated_text, generated_ids):
        return Step("", float(generated_text == self.label), True)


RELEASE = threading.Event()  # set by the test once it is done: the hung call's thread then returns


class Flaky(Environment):
    """By the example's label: "raise" raises in step, "hang" blocks until RELEASE, "bad" returns
    no Step, "badstep" a Step of wrong types, "noreset" raises in reset, "badreset" answers text the tokenizer cannot encode;
    anything else ends with reward 1."""

    max_turns = 2

    def reset(self, example):
        if example.label == "noreset":
            raise RuntimeError("reset broke")
        if example.label == "badreset":
            return "<not in the toy vocabulary>"
        self.label = example.label
        return example.prompt

    def step(self, generated_text, generated_ids):
        if self.label == "raise":
            raise ValueError("step broke")
        if self.label == "hang":
            RELEASE.wait()
            return Step("", 1.0, True)
        if self.label == "bad":
            return "not a step"
        if self.label == "badstep":
            return Step(None, "one", False)
        return Step("", 1.0, True)
