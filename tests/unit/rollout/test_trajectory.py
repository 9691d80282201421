"""Assembling a trajectory from its turns: every field against a sequence built by hand."""
import pytest
import torch

from megatron_rl.rollout.trajectory import Turn, assemble, drift, rerender, turn_index
from megatron_rl.rollout.types import Sample


def _turn(context, ids, lps, version=0, routes=None, kept=None):
    return Sample(prompt_ids=torch.tensor(context), response_ids=torch.tensor(ids), rollout_logprobs=torch.tensor(lps),
                  finish_reason="stop", policy_version=version, routed_experts=routes, kept_ids=kept)


def test_routes_kept_sets_and_versions_splice_at_the_positions_each_turn_first_processed():
    prompt, a, obs, b = [10, 11], [20, 21, 22], [30, 31], [40]
    # routes as [positions, 1 layer, 1 expert] holding (turn + 1) * 100 + position: which turn wrote each row
    r1 = torch.tensor([[[100 + p]] for p in range(len(prompt) + len(a) - 1)], dtype=torch.int16)
    ctx2 = prompt + a + obs
    r2 = torch.tensor([[[200 + p]] for p in range(len(ctx2) + len(b) - 1)], dtype=torch.int16)
    k1 = torch.tensor([[20, 5], [21, -1], [22, 6]])
    k2 = torch.tensor([[40, 1, 2]])
    s = assemble(prompt, [Turn(_turn(prompt, a, [-1.0, -2.0, -3.0], 4, r1, k1), obs),
                          Turn(_turn(ctx2, b, [-4.0], 5, r2, k2))])
    assert s.response_ids.tolist() == a + obs + b
    assert s.loss_mask.tolist() == [True, True, True, False, False, True]
    assert s.rollout_logprobs.tolist() == [-1.0, -2.0, -3.0, 0.0, 0.0, -4.0]
    # positions 0..3 (prompt, a but its last token) from turn 1; 4 (a's last) .. 6 (obs) from turn 2
    assert s.routed_experts[:, 0, 0].tolist() == [100, 101, 102, 103, 204, 205, 206]
    assert len(s.routed_experts) == len(prompt) + len(s.response_ids) - 1
    assert s.kept_ids.tolist() == [[20, 5, -1], [21, -1, -1], [22, 6, -1], [-1] * 3, [-1] * 3, [40, 1, 2]]
    assert s.policy_version == 4 and s.finish_reason == "stop"


def test_a_turn_prompted_with_other_ids_or_an_observation_after_the_last_turn_is_refused():
    with pytest.raises(ValueError, match="re-tokenized"):
        assemble([1, 2], [Turn(_turn([1, 2], [3], [-1.0]), [4]), Turn(_turn([1, 2, 3, 5], [6], [-1.0]))])
    with pytest.raises(ValueError, match="last turn"):
        assemble([1, 2], [Turn(_turn([1, 2], [3], [-1.0]), [4])])


def test_turn_index_numbers_the_runs_of_sampled_tokens():
    m = torch.tensor([[True, True, False, False, True, False, True], [False, True, True, True, False, False, False]])
    assert turn_index(m).tolist() == [[0, 0, -1, -1, 1, -1, 2], [-1, 0, 0, 0, -1, -1, -1]]


def test_rerender_keeps_stop_ids_and_encodes_the_text_between_them_in_one_piece():
    def encode(text):  # a merge of "ab" into 7, else one id per character
        return [7 if c == "X" else ord(c) for c in text.replace("ab", "X")]

    turns = [("a", [ord("a"), 1], "b"), ("a", [ord("a")], "b"), ("c", [ord("c"), 1], "")]
    assert rerender("p", turns, encode, stop_ids=(1,)) == [ord("p"), ord("a"), 1, ord("b"), 7, ord("c"), 1]
    kept = [ord("p"), ord("a"), 1, ord("b"), ord("a"), ord("b"), ord("c"), 1]
    d = drift(kept, rerender("p", turns, encode, stop_ids=(1,)))
    assert (d.index, d.kept_len, d.rendered_len) == (4, 8, 7)
    assert drift(kept, kept) is None
