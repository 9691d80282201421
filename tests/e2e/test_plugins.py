"""A newcomer's plugin module trains: README's `my_plugin.py` (a reward function and an
environment), written to a folder outside the package and found through PYTHONPATH, drives two
RL steps of the tiny model twice through pretrain_rl.py: the reward named by import path in a
single-turn run, the environment registered by a `plugins` module in a multi-turn run. A bad
plugin stops the launch with exit code 2 before anything is built."""
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = ["model.overrides={}", "sft.steps=0", "train.steps=2", "rollout.prompts_per_step=2", "rollout.group_size=2",
        "train.micro_batch_size=2", "train.num_minibatches=1", "train.eval_size=4", "train.eval_every=0",
        "log.tensorboard=false", "log.progress=false"]


def readme_plugin() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        blocks = re.findall(r"```python\n(# my_plugin\.py.*?)```", f.read(), flags=re.DOTALL)
    assert len(blocks) == 1, "README has no (or several) my_plugin.py examples"
    return blocks[0]


# appended to README's module: each call of the reward or of an environment's step leaves a line
COUNTER = """
_reward, _step = digits_match, SecondTry.step


def _count(what):
    with open(__import__("os").environ["PLUGIN_CALLS"], "a") as f:
        f.write(what + "\\n")


def digits_match(prompt, response, label):
    _count("reward")
    return _reward(prompt, response, label)


def _counted_step(self, generated_text, generated_ids):
    _count("step")
    return _step(self, generated_text, generated_ids)


SecondTry.step = _counted_step
"""


def train(tmp_path, name: str, config: str, *overrides: str) -> tuple[list[dict], list[str]]:
    """The rl rows of metrics.jsonl, and the plugin calls of the run."""
    plugin_dir = tmp_path / "plugin_src"
    plugin_dir.mkdir(exist_ok=True)
    (plugin_dir / "my_plugin.py").write_text(readme_plugin() + COUNTER)
    calls = tmp_path / f"{name}.calls"
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", PLUGIN_CALLS=str(calls),
               PYTHONPATH=os.pathsep.join(p for p in (str(plugin_dir), os.environ.get("PYTHONPATH")) if p))
    run_dir = tmp_path / name
    proc = subprocess.run([sys.executable, "pretrain_rl.py", "--config", config, *BASE, f"train.run_dir={run_dir}",
                           *overrides], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("phase") == "rl"], calls.read_text().split() if calls.exists() else []


def test_a_reward_function_by_import_path_trains(tmp_path):
    rl, calls = train(tmp_path, "reward", "examples/demo_cpu.yaml", "data.reward=my_plugin:digits_match")
    assert len(rl) == 2 and all(r["rewards/errors"] == 0 for r in rl)
    # 2 steps x 2 prompts x 2 samples, plus the held-out evaluations before and after RL (4 problems each)
    assert calls.count("reward") >= rl[-1]["rewards/count"] >= 8 and "step" not in calls


def test_an_environment_from_a_plugins_module_trains(tmp_path):
    rl, calls = train(tmp_path, "env", "examples/demo_cpu.yaml", "plugins=[my_plugin]", "rollout.function=multi_turn",
                      "env.name=second_try")
    assert len(rl) == 2
    for r in rl:
        assert r["env/failures"] == 0 and 1 <= r["env/turns"] <= 2
    assert calls.count("step") >= 8 and "reward" not in calls   # every trajectory steps at least once


def test_a_bad_plugin_stops_the_launch_naming_the_field(tmp_path):
    """Before any model is built: exit 2 and one line naming the field."""
    plugin_dir = tmp_path / "plugin_src"
    plugin_dir.mkdir()
    (plugin_dir / "my_plugin.py").write_text(readme_plugin())
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(plugin_dir), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "pretrain_rl.py", "--config", "examples/demo_cpu.yaml",
                           f"train.run_dir={tmp_path / 'run'}", "env.name=my_plugin:digits_match"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("config error: env.name: my_plugin:digits_match is function digits_match, not a "
                                  "subclass of megatron_rl.data.envs.base.Environment"), proc.stderr
    assert not (tmp_path / "run").exists()
