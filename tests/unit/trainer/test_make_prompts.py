"""startup.make_prompts: tasks with data.heldout_size (it used to keep each task's default); JSONL rows
naming an environment only with a rollout function that runs environments."""
import pytest

from megatron_rl.configure import load_config
from megatron_rl.data import CharTokenizer
from megatron_rl.trainer.startup import make_prompts


def test_tasks_hold_out_data_heldout_size():
    cfg = load_config(None, ["data.tasks=[addition, sorting]", "data.heldout_size=16"])
    stream = make_prompts(cfg, CharTokenizer(), 512)
    assert [t.heldout_size for t in stream.tasks] == [16, 16] and len(stream.heldout()) == 32


def _rows(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "12*34=", "label": "408"}\n'
                    '{"prompt": "guess n0042:", "label": "57", "env": "guess"}\n')
    return str(path)


def test_rows_naming_an_environment_need_a_function_that_runs_one(tmp_path):
    cfg = load_config(None, [f"data.jsonl={_rows(tmp_path)}"])  # single_turn: would train them as prompts
    with pytest.raises(ValueError, match=r"rollout.function=single_turn runs none.*'guess'|'guess'.*single_turn runs"):
        make_prompts(cfg, CharTokenizer(), 512)


def test_rows_naming_an_environment_load_for_multi_turn(tmp_path):
    cfg = load_config(None, [f"data.jsonl={_rows(tmp_path)}", "rollout.function=multi_turn", "env.name=calculator"])
    prompts = make_prompts(cfg, CharTokenizer(), 512)
    assert [e.env for e in prompts.examples] == [None, "guess"]
