"""resume_check: which config changes a resume refuses."""
import copy

import pytest

from megatron_rl.config.loader import config_to_dict
from megatron_rl.configure import load_config
from megatron_rl.trainer.resume_check import (
    MAY_CHANGE,
    config_changes,
    describe_changes,
    engine_may_change,
    fields,
)


@pytest.fixture(scope="module")
def saved():
    return config_to_dict(load_config("examples/demo_cpu.yaml", []))


def changed(saved, **edits):
    now = copy.deepcopy(saved)
    for name, value in edits.items():
        section, field = name.split("__")
        now[section][field] = value
    return now


def test_the_same_config_resumes(saved):
    assert config_changes(saved, copy.deepcopy(saved)) == []


@pytest.mark.parametrize("edit", [
    {"loss__recipe": "minirl"}, {"optim__lr": 0.5}, {"train__seed": 7}, {"data__tasks": ["sorting"]},
    {"data__seed": 3}, {"rollout__temperature": 0.7}, {"rollout__group_size": 4}, {"train__schedule": "async"},
    {"model__overrides": {"num_layers": 2}}, {"moe__router_replay": "r3"}, {"train__num_minibatches": 1},
])
def test_a_change_to_what_the_steps_compute_is_named(saved, edit):
    [(name, old, new)] = config_changes(saved, changed(saved, **edit))
    [(key, value)] = edit.items()
    assert name == key.replace("__", ".") and new == value and old == saved[key.split("__")[0]][key.split("__")[1]]


@pytest.mark.parametrize("edit", [
    {"train__steps": 400}, {"train__save_every": 5}, {"train__eval_every": 0}, {"train__micro_batch_size": 8},
    {"parallel__tensor_model_parallel_size": 2}, {"log__tensorboard": False}, {"sft__steps": 0},
    {"rollout__device": "cpu"}, {"train__run_dir": "elsewhere"}, {"rollout__weight_sync": "memory"},
])
def test_where_and_how_often_may_change(saved, edit):
    assert config_changes(saved, changed(saved, **edit)) == []


def test_steps_set_the_stage_length_under_the_staged_schedule(saved):
    staged = changed(saved, train__schedule="staged", train__stages=4, train__steps=8)
    assert [c[0] for c in config_changes(staged, changed(staged, train__steps=16))] == ["train.steps"]


def test_a_field_the_checkpoint_predates_is_not_compared(saved):
    old = copy.deepcopy(saved)
    del old["train"]["allow_config_change"]
    assert config_changes(old, changed(saved, train__allow_config_change=True)) == []


def test_every_may_change_entry_names_a_field_or_section(saved):
    names = set(fields(saved))
    sections = set(saved)
    for entry in MAY_CHANGE:
        assert entry in names or entry in sections, entry
    for entry in engine_may_change():
        assert entry in names, entry


def test_the_message_names_the_fields_and_the_ways_out(saved):
    msg = describe_changes(config_changes(saved, changed(saved, loss__recipe="minirl", optim__lr=0.5)), "ck/iter_2")
    assert "loss.recipe: 'grpo' -> 'minirl'" in msg and "optim.lr: 0.0001 -> 0.5" in msg
    assert "train.resume=false" in msg and "train.allow_config_change=true" in msg and "ck/iter_2" in msg


@pytest.mark.parametrize("edit,refused", [
    ({"url": "http://other:8000"}, None), ({"tensor_parallel_size": 2}, None), ({"env": {"X": "1"}}, None),
    ({"request_timeout_s": 60.0}, None), ({"device": "cuda"}, None),
    ({"dtype": "float32"}, "rollout.vllm.dtype"), ({"quantization": "fp8"}, "rollout.vllm.quantization"),
    ({"logprobs_mode": "raw_logprobs"}, "rollout.vllm.logprobs_mode"), ({"seed": 3}, "rollout.vllm.seed"),
    ({"extra_args": ["--foo"]}, "rollout.vllm.extra_args"),
])
def test_the_vllm_server_may_move_but_not_change_what_it_computes(saved, edit, refused):
    """Where the server runs and how it is reached may change on resume; what it computes may not,
    whether the checkpoint set the field or left it at its default."""
    now = changed(saved, rollout__vllm=edit)
    got = [c[0] for c in config_changes(saved, now)]
    assert got == ([] if refused is None else [refused])
    assert [c[0] for c in config_changes(now, saved)] == got   # set in the checkpoint, default now
