"""The GPU lane's RL tests (tests/gpu/test_rl_gpu.py) run here on the CPU, through the same launches
and assertions, so the GPU lane's own logic cannot rot between the rare runs on a GPU machine.

Run here, the tests checked what they read (metrics.jsonl also holds the SFT rows) and what a
fresh model can show (every recipe's gradient needs a reward that varies within a group). This
module checks those tests, not a GPU: gloo, fp32/bf16/fp16 on the CPU, torch.compile off. It is
skipped where CUDA is present, because tests/gpu then runs the same tests on the GPU.
"""
import pytest
import torch

from tests.gpu import test_rl_gpu as lane

pytestmark = [pytest.mark.skipif(torch.cuda.is_available(), reason="tests/gpu runs these on the GPU here")]


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_demo_short(tmp_path, dtype):
    lane.test_demo_short(tmp_path, dtype)


def test_every_recipe_one_step(tmp_path):
    lane.test_every_recipe_one_step(tmp_path)


@pytest.mark.parametrize("mode", ["r2", "r3"])
def test_router_replay(tmp_path, mode):
    lane.test_router_replay(tmp_path, mode)


def test_sft_only(tmp_path):
    lane.test_sft_only(tmp_path)


def test_resume_continues_like_the_uninterrupted_run(tmp_path):
    lane.test_resume_continues_like_the_uninterrupted_run(tmp_path)
