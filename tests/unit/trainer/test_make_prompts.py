"""loop.make_prompts builds the tasks with data.heldout_size (it used to keep each task's default)."""
from megatron_rl.config import load_config
from megatron_rl.data import CharTokenizer
from megatron_rl.trainer.startup import make_prompts


def test_tasks_hold_out_data_heldout_size():
    cfg = load_config(None, ["data.tasks=[addition, sorting]", "data.heldout_size=16"])
    stream = make_prompts(cfg, CharTokenizer(), 512)
    assert [t.heldout_size for t in stream.tasks] == [16, 16] and len(stream.heldout()) == 32
