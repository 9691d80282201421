"""The multi-turn render check with a real HF tokenizer and its chat template: a template that
writes the turns as they were kept reports nothing; a Qwen3-like one that drops earlier turns'
<think> blocks is reported where the kept ids first differ (and never changes them)."""
import logging

import pytest
import torch

from megatron_rl.config.env_section import EnvSection
from megatron_rl.data.envs import ENVS, Environment, Step, register_env
from megatron_rl.data.hf_tokenizer import HfTokenizer
from megatron_rl.data.types import Example
from megatron_rl.rollout.function import RolloutFnInputs
from megatron_rl.rollout.multi_turn import MultiTurn
from megatron_rl.rollout.trajectory import rerender_chat
from megatron_rl.rollout.types import Sample, SamplingParams
from tests.unit.data.test_hf_tokenizer import write_tokenizer

CHATML = ("{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
          "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
# Qwen3's habit: an assistant turn before the last message loses its reasoning
DROPS_THINK = ("{%- for m in messages -%}{%- set c = m.content -%}"
               "{%- if m.role == 'assistant' and not loop.last and '</think>' in c -%}"
               "{%- set c = c.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}"
               "{{- '<|im_start|>' + m.role + '\\n' + c + '<|im_end|>\\n' -}}"
               "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
PROMPT = "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
TURN = "<think>2 and 3</think>5"
PREFIX, SUFFIX = "\n<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"


class Chatter(Environment):
    """Answers "ok, once more" to every turn (role user) for 3 turns."""

    max_turns = 3

    def reset(self, example):
        return example.prompt

    def step(self, generated_text, generated_ids):
        return Step("ok, once more", None, False)


class TurnEngine:
    """Every response is TURN then the tokenizer's eos, log-prob 0."""

    policy_version, max_len = 0, 512

    def __init__(self, tok):
        self.ids = tok.encode(TURN) + [tok.eos_id]

    def generate_requests(self, requests):
        return [Sample(prompt_ids=torch.tensor(r.prompt_ids), response_ids=torch.tensor(self.ids),
                       rollout_logprobs=torch.zeros(len(self.ids)), finish_reason="stop", policy_version=0,
                       prompt_index=r.stream[0], sample_index=r.stream[1]) for r in requests]


@pytest.fixture
def chatter():
    register_env("chatter")(Chatter)
    yield
    ENVS.pop("chatter")


def _tokenizer(folder, template, where="config"):
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    if where == "config":
        config["chat_template"] = template
    elif where == "list":
        config["chat_template"] = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": template}]
    write_tokenizer(folder, config)
    if where == "jinja":
        (folder / "chat_template.jinja").write_text(template)
    return HfTokenizer(folder)


def _run(tok, caplog):
    fn = MultiTurn(RolloutFnInputs(tok, None, EnvSection(name="chatter", check_render=True, max_tokens=200,
                                                         observation_prefix=PREFIX, observation_suffix=SUFFIX)))
    with caplog.at_level(logging.WARNING):
        return fn(TurnEngine(tok), [Example(PROMPT, "5", "t")], 2, SamplingParams(max_tokens=50))


@pytest.mark.parametrize("where", ["config", "list", "jinja"])
def test_the_tokenizer_reads_its_chat_template(tmp_path, where):
    tok = _tokenizer(tmp_path / "m", CHATML, where)
    assert tok.chat_template == CHATML
    assert tok.render_chat([{"role": "user", "content": "hi"}], True) == "<|im_start|>user\nhi<|im_end|>\n" \
                                                                         "<|im_start|>assistant\n"
    plain = HfTokenizer(write_tokenizer(tmp_path / "plain"))
    assert plain.chat_template is None
    with pytest.raises(ValueError, match="has no chat template"):
        plain.render_chat([{"role": "user", "content": "hi"}])


def test_a_template_that_writes_the_turns_as_kept_reports_no_drift(tmp_path, chatter, caplog):
    tok = _tokenizer(tmp_path / "m", CHATML)
    gen = _run(tok, caplog)
    assert gen.stats["env/turns"] == 3 and gen.stats["env/render_drift"] == 0
    assert gen.stats["env/render_unencodable"] == 0 and "re-render" not in caplog.text
    # the kept sequence is what ChatML writes, but the newline that closes the last message
    turn, obs = tok.encode(TURN) + [tok.eos_id], tok.encode_prompt(PREFIX + "ok, once more" + SUFFIX)
    assert gen.samples[0].response_ids.tolist() == turn + obs + turn + obs + turn


def test_a_template_that_drops_earlier_reasoning_is_reported_where_it_differs(tmp_path, chatter, caplog):
    tok = _tokenizer(tmp_path / "m", DROPS_THINK)
    gen = _run(tok, caplog)
    assert gen.stats["env/render_drift"] == 2 and gen.stats["env/render_unencodable"] == 0
    prompt = len(tok.encode_prompt(PROMPT))  # the first turn's <think> is the first id a re-render changes
    assert f"2 of 2 trajectories re-render with the chat template to other ids than were sampled (first: " \
           f"trajectory 0 at id {prompt};" in caplog.text
    assert tok.decode(gen.samples[0].response_ids.tolist()).startswith(TURN)  # reported, never fixed


def test_rerender_chat_renders_the_turns_after_the_prompt_and_refuses_a_template_it_cannot_split():
    seen = []

    def render(messages, generation, header="<assistant>"):
        seen.append([m["role"] for m in messages])
        return "".join(f"<{m['role']}>{m['content']}</>" for m in messages) + (header if generation else "")

    def encode(text):
        return [ord(c) for c in text]

    out = rerender_chat("P", [("a1", "o1", "tool"), ("a2", "", "tool")], render, encode)
    assert "".join(map(chr, out)) == "Pa1</><tool>o1</><assistant>a2</>"
    assert seen[-1] == ["user", "assistant", "tool", "assistant"]  # no message for the last turn's ""
    with pytest.raises(ValueError, match="writes a conversation's first user message otherwise"):
        rerender_chat("P", [("a1", "", "user")], lambda m, g: render(m, g, header="<think>"), encode)
