"""The GPU lane's RL tests (tests/gpu/test_rl_gpu.py) run here on the CPU, through the same runs
and assertions, so the GPU lane's own logic cannot rot between the rare runs on a GPU machine.

Run here, the tests checked what they read (metrics.jsonl also holds the SFT rows) and what a
fresh model can show (every recipe's gradient needs a reward that varies within a group). This
module checks those tests, not a GPU: gloo, fp32/bf16/fp16 on the CPU, torch.compile off. It is
skipped where CUDA is present, because tests/gpu then runs the same tests on the GPU.

The lane launches each run as its own torchrun process (`tests.gpu.runs.launch`). Here all of
them but one run in one process of the lane's own driver (`tests.gpu.driver`, as its
`launch_many` does: `pretrain_rl.main` once per run), started once for the module: ten
interpreters' imports saved. Each lane test then reads its runs' results through a stand-in for
`launch`/`launch_many` that answers the exact (name, overrides) it was planned for and launches
anything else for real; the SFT-only run keeps the real torchrun launch, so `launch` itself is
checked too.
"""
import json

import pytest
import torch

from megatron_rl.losses import RECIPES
from tests.gpu import runs
from tests.gpu import test_rl_gpu as lane

pytestmark = [pytest.mark.skipif(torch.cuda.is_available(), reason="tests/gpu runs these on the GPU here")]

RESUME = [*runs.ONE_STEP, "model.dtype=fp32", "rollout.dtype=fp32"]


def _planned() -> list[tuple[str, str, list[str]]]:
    """(key, run directory, overrides) of every run the lane's tests make, in the order they make
    them (the resume test's second "part" run resumes the first in the same directory)."""
    out = [(f"demo_{d}", f"demo_{d}", runs.DEMO_SHORT + [f"model.dtype={d}"]) for d in ("fp32", "bf16", "fp16")]
    out += [(name, name, runs.ONE_STEP + runs.DENSE_REWARD + [f"loss.recipe={name}", "model.dtype=bf16"])
            for name in sorted(RECIPES.names())]
    out += [(mode, mode, runs.ONE_STEP + ["--router-replay", mode, "model.dtype=bf16"]) for mode in ("r2", "r3")]
    out += [("full", "full", RESUME + ["train.steps=3"]), ("part", "part", RESUME + ["train.steps=2"]),
            ("part_resumed", "part", RESUME + ["train.steps=3", "train.resume=true"])]
    return out


@pytest.fixture(scope="module")
def batched(tmp_path_factory):
    """Every planned run in one driver process: (name, overrides) -> (summary, RL rows) or the error text."""
    import subprocess
    import sys

    root = tmp_path_factory.mktemp("lane")
    plan = _planned()
    spec = {key: ["--config", runs.DEMO, "--debug", "--summary-json", str(root / f"{key}.json"),
                  f"train.run_dir={root / run_dir}", *overrides] for key, run_dir, overrides in plan}
    (root / "runs.json").write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, "-m", "tests.gpu.driver", str(root / "runs.json"), str(root / "results.json")],
                          cwd=runs.ROOT, env=runs._env(), capture_output=True, text=True, timeout=1800, check=False)
    assert (root / "results.json").exists(), f"driver died: exit {proc.returncode}\n{proc.stderr[-6000:]}"
    errors = json.loads((root / "results.json").read_text())
    return {(run_dir if key != "part_resumed" else "part", tuple(overrides)):
            errors[key] or runs._read(root / run_dir, root / f"{key}.json") for key, run_dir, overrides in plan}


@pytest.fixture
def lane_runs(batched, monkeypatch):
    """The lane's launch/launch_many answered from `batched`; a run not planned is launched for real."""
    real_launch, real_many = runs.launch, runs.launch_many

    def answer(name, overrides):
        result = batched[(name, tuple(overrides))]
        assert not isinstance(result, str), f"{name}: {result}"
        return result

    def launch(tmp_path, name, overrides, timeout=900):
        if (name, tuple(overrides)) not in batched:
            return real_launch(tmp_path, name, overrides, timeout)
        return answer(name, overrides)

    def launch_many(tmp_path, spec, timeout=1800):
        if not all((name, tuple(o)) in batched for name, o in spec.items()):
            return real_many(tmp_path, spec, timeout)
        return {name: batched[(name, tuple(o))] for name, o in spec.items()}

    monkeypatch.setattr(lane, "launch", launch)
    monkeypatch.setattr(lane, "launch_many", launch_many)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_demo_short(tmp_path, lane_runs, dtype):
    lane.test_demo_short(tmp_path, dtype)


def test_every_recipe_one_step(tmp_path, lane_runs):
    lane.test_every_recipe_one_step(tmp_path)


@pytest.mark.parametrize("mode", ["r2", "r3"])
def test_router_replay(tmp_path, lane_runs, mode):
    lane.test_router_replay(tmp_path, mode)


def test_sft_only(tmp_path, lane_runs):
    lane.test_sft_only(tmp_path)   # not planned: a real torchrun launch


def test_resume_continues_like_the_uninterrupted_run(tmp_path, lane_runs):
    lane.test_resume_continues_like_the_uninterrupted_run(tmp_path)

