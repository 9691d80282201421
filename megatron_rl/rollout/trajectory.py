"""A multi-turn trajectory as ONE token sequence (pure functions; rollout/multi_turn.py drives them).

    prompt | turn 1 sampled | obs 1 | turn 2 sampled | obs 2 | ... | turn T sampled
    sample = assemble(prompt_ids, [Turn(s1, obs1_ids), Turn(s2, obs2_ids), Turn(sT, [])])

Turn t's engine sample `s_t` must have been generated from exactly the ids before it (its
prompt_ids = prompt + every earlier turn's sampled and observation ids): the trainer then scores
the very tokens μ was reported for, and nothing is ever re-tokenized. The trajectory's Sample has

    response_ids      every turn's sampled ids, each followed by its observation's ids
    loss_mask         True on sampled ids, False on observation ids
    rollout_logprobs  log μ on sampled ids; 0 on observation ids (never read: they have no μ)
    kept_ids          the engine's kept sets on sampled ids; -1 rows on observation ids
    routed_experts    per input position, the routing the engine used when it computed the μ that
                      depends on it: turn 1's routes, then from each later turn the positions it
                      was the first to process (its observation's and the previous turn's last
                      sampled token's, which is never an input of the turn that sampled it);
                      observation positions thus carry the engine's prefill routing of them
                      (R3 replays the engine's routing everywhere; R2 ignores this field)
    policy_version    the oldest of its turns' (a weight push between turns makes it older)
    token_versions    each sampled id's version (an observation's ids take the version of the turn
                      before them), when they are not all the same; else None
    finish_reason     its last turn's

Cost: O(trajectory length) host memory and time.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from megatron_rl.rollout.types import Sample


@dataclass(frozen=True)
class Turn:
    """sample: the engine's sample of one policy turn; observation_ids: the environment's answer
    appended after it (empty for none, and for the last turn)."""

    sample: Sample
    observation_ids: Sequence[int] = ()


def assemble(prompt_ids: Sequence[int], turns: Sequence[Turn]) -> Sample:
    """The trajectory's Sample (see the module docstring); ValueError if a turn's engine prompt is
    not exactly the ids before it."""
    if not turns:
        raise ValueError("a trajectory has at least one policy turn")
    if len(turns[-1].observation_ids):
        raise ValueError("the last turn of a trajectory has no observation (nothing is sampled after it)")
    context = list(prompt_ids)
    ids, logp, mask, kept, routes, routed, versions = [], [], [], [], [], 0, []
    for t, turn in enumerate(turns):
        s = turn.sample
        dev = s.response_ids.device  # the engine's samples say where their tensors live
        obs = torch.tensor(list(turn.observation_ids), dtype=torch.long, device=dev)
        if s.prompt_ids.tolist() != context:
            raise ValueError(f"turn {t}: the engine was prompted with other ids than the trajectory so far "
                             f"({len(s.prompt_ids)} ids vs {len(context)}): the sequence would be re-tokenized")
        r, o = len(s.response_ids), len(obs)
        ids += [s.response_ids, obs]
        logp += [s.rollout_logprobs.float(), torch.zeros(o, device=dev)]
        mask += [torch.ones(r, dtype=torch.bool, device=dev), torch.zeros(o, dtype=torch.bool, device=dev)]
        v = s.versions().int()
        versions += [v, torch.full((o,), int(v[-1]) if r else s.policy_version, dtype=torch.int32, device=dev)]
        if s.kept_ids is not None:
            kept.append((s.kept_ids, o))
        if s.routed_experts is not None:  # the positions no earlier turn processed
            routes.append(s.routed_experts[routed:])
            routed = len(s.routed_experts)
        context += s.response_ids.tolist() + obs.tolist()
    first, last = turns[0].sample, turns[-1].sample
    return Sample(prompt_ids=torch.tensor(list(prompt_ids), dtype=torch.long), response_ids=torch.cat(ids),
                  rollout_logprobs=torch.cat(logp), finish_reason=last.finish_reason,
                  policy_version=min(t.sample.policy_version for t in turns), prompt_index=first.prompt_index,
                  sample_index=first.sample_index, routed_experts=_all_or_none(routes, turns, torch.cat),
                  kept_ids=_all_or_none(kept, turns, _stack_kept), loss_mask=torch.cat(mask),
                  token_versions=_mixed(torch.cat(versions)))


def _mixed(versions: torch.Tensor) -> torch.Tensor | None:
    return versions if len(versions) and bool((versions != versions[0]).any()) else None


def _all_or_none(parts: list, turns: Sequence[Turn], join):
    if not parts:
        return None
    if len(parts) != len(turns):
        raise ValueError("some turns of a trajectory carry kept ids / routed experts and some do not")
    return join(parts)


def _stack_kept(parts: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """Each turn's kept ids [R_t, K_t] then o_t rows of -1, padded with -1 to the widest K."""
    width = max(k.shape[1] for k, _ in parts)
    rows = []
    for k, o in parts:
        rows.append(torch.nn.functional.pad(k, (0, width - k.shape[1]), value=-1))
        rows.append(torch.full((o, width), -1, dtype=torch.long))
    return torch.cat(rows)


def turn_index(loss_mask: torch.Tensor) -> torch.Tensor:
    """[..., R] int64: the policy turn (0, 1, ...) each sampled token belongs to; -1 off-mask.

    A turn is a maximal run of sampled tokens (an empty observation joins two turns into one)."""
    m = loss_mask.bool()
    prev = torch.nn.functional.pad(m[..., :-1], (1, 0), value=False)
    starts = (m & ~prev).long().cumsum(-1) - 1
    return torch.where(m, starts, -1)


@dataclass(frozen=True)
class Drift:
    """Where re-encoding a trajectory's text gave other ids: first differing index into
    prompt + response ids (or the shorter length), and both lengths."""

    index: int
    kept_len: int
    rendered_len: int


def continuation(encode_prompt: Callable[[str], list[int]]) -> Callable[[str], list[int]]:
    """text -> ids as `encode_prompt` gives them, less what it puts before every text (a BOS:
    encode_prompt("")): how an observation, or any text after the start, is tokenized alone."""
    prefix = encode_prompt("")

    def encode(text: str) -> list[int]:
        ids = encode_prompt(text)
        return ids[len(prefix):] if prefix and ids[:len(prefix)] == prefix else ids

    return encode


def rerender(prompt_text: str, turns: Sequence[tuple[str, Sequence[int], str]],
             encode_prompt: Callable[[str], list[int]], stop_ids: Sequence[int]) -> list[int]:
    """The ids a text-keeping pipeline would train on: the conversation rendered as text and
    encoded again. turns: per policy turn (its decoded text, its sampled ids, its observation's
    full text with the turn delimiters); encode_prompt: the tokenizer's. A sampled stop id is kept
    as an id (text cannot spell it); the text between stop ids is encoded in one piece (the first
    as a prompt, the others as continuations), so a merge across a turn boundary shows."""
    out, text, encode = [], prompt_text, encode_prompt
    for decoded, ids, observation in turns:
        text += decoded
        if len(ids) and int(ids[-1]) in stop_ids:
            out += encode(text) + [int(ids[-1])]
            text, encode = "", continuation(encode_prompt)
        text += observation
    return out + (encode(text) if text else [])


PLACEHOLDER = "\x00prompt\x00"  # the first user message's content when the template renders the turns


def rerender_chat(prompt_text: str, turns: Sequence[tuple[str, str, str]],
                  render: Callable[[list[dict], bool], str], encode_prompt: Callable[[str], list[int]]) -> list[int]:
    """The ids a chat-template pipeline would train on: the conversation after the prompt as the
    template writes it, after the prompt's own text, encoded again.

    turns: per policy turn (its decoded text, the observation that followed it: raw text, no
    delimiters, "" for none, and that observation's role, "user" or "tool"); render(messages,
    add_generation_prompt): the tokenizer's chat template. The prompt already holds its template
    (its text is the first observation as the policy read it), so the template renders the turns
    after a placeholder user message: rendered = encode_prompt(prompt_text + T[len(H):]) with
    H = render([user], True) and T = render([user, assistant, observation, ..., assistant], False).
    A template that writes the conversation's start otherwise than H raises ValueError.
    """
    messages = [{"role": "user", "content": PLACEHOLDER}]
    head = render(messages, True)
    for k, (decoded, observation, role) in enumerate(turns):
        messages.append({"role": "assistant", "content": decoded})
        if observation:
            messages.append({"role": role, "content": observation})
    full = render(messages, False)
    if not full.startswith(head):
        raise ValueError("the chat template writes a conversation's first user message otherwise with assistant "
                         "turns after it than alone with the generation prompt")
    return encode_prompt(prompt_text + full[len(head):])


def drift(kept: Sequence[int], rendered: Sequence[int], closing_ok: bool = False) -> Drift | None:
    """None when the ids agree, else where they first differ. closing_ok: rendered may go on past
    the kept ids' end (a chat template closing the last message: no policy turn follows it)."""
    kept, rendered = list(kept), list(rendered)
    if closing_ok and len(rendered) > len(kept) and rendered[:len(kept)] == kept:
        return None
    if kept == rendered:
        return None
    index = next((i for i, (a, b) in enumerate(zip(kept, rendered)) if a != b), min(len(kept), len(rendered)))
    return Drift(index, len(kept), len(rendered))
