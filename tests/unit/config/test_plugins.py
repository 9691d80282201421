"""Plugins by import path (megatron_rl/plugins.py, configure/plugins.py): the user's reward, task,
environment and rollout function, named as `module:attribute` or registered by a `plugins` module,
are registered before the config is checked; every way one can be wrong is refused at load time,
naming the field. Each test writes its plugin module to its own folder under a fresh name."""
import itertools
import sys
import textwrap

import pytest

from megatron_rl.config import ConfigError, config_to_dict
from megatron_rl.configure import load_config
from megatron_rl.data.envs import ENVS, make_env
from megatron_rl.data.tasks import TASKS, make_task
from megatron_rl.rewards import REWARDS, RewardRunner
from megatron_rl.rollout import ROLLOUT_FNS
from megatron_rl.trainer.resume_check import config_changes

PLUGIN = '''
from dataclasses import dataclass
import random
from megatron_rl.data.envs import Environment, Step, register_env
from megatron_rl.data.tasks import Task, register_task
from megatron_rl.data.types import Example
from megatron_rl.rewards import register_reward
from megatron_rl.rollout.function import RolloutFnSpec, ROLLOUT_FNS

def reward(prompt, response, label):
    return float(response.strip() == label)

def two_args(prompt, response):
    return 0.0

async def coroutine(prompt, response, label):
    return 0.0

NUMBER = 3

@dataclass(frozen=True, kw_only=True)
class Echo(Task):
    @property
    def num_problems(self): return 10_000
    @property
    def max_label_len(self): return 4
    @property
    def max_prompt_len(self): return 7
    def generate(self, rng):
        n = rng.randrange(10_000)
        return Example(prompt=f"e:{n}=", label=str(n), task=self.name)

@dataclass(frozen=True, kw_only=True)
class Unfinished(Task):
    pass

@dataclass
class Say(Environment):
    word: str = "ok"
    def reset(self, example): return example.prompt
    def step(self, text, ids): return Step(self.word, 1.0, True)

SPEC = RolloutFnSpec(make=lambda inputs: None)

@register_reward("{m}_registered")
def registered(prompt, response, label):
    return 1.0

@register_env("{m}_env")
@dataclass
class Registered(Environment):
    def reset(self, example): return example.prompt
    def step(self, text, ids): return Step("", 0.0, True)
'''
_names = (f"megatron_rl_test_plugin_{i}" for i in itertools.count())


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """A fresh plugin module (PLUGIN, or the source given) on sys.path; returns its name. Every
    registry entry the test adds is removed afterwards."""
    before = {id(r): dict(r) for r in (REWARDS, TASKS, ENVS)}
    fns = set(ROLLOUT_FNS.names())
    monkeypatch.syspath_prepend(str(tmp_path))
    made = []

    def write(source: str = PLUGIN) -> str:
        name = next(_names)
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source).replace("{m}", name))
        made.append(name)
        return name

    yield write
    for registry in (REWARDS, TASKS, ENVS):
        registry.clear()
        registry.update(before[id(registry)])
    for name in set(ROLLOUT_FNS.names()) - fns:
        ROLLOUT_FNS.remove(name)
    for name in made:
        sys.modules.pop(name, None)


def test_import_paths_register_under_the_whole_name(plugin):
    m = plugin()
    cfg = load_config(None, [f"data.reward={m}:reward", f"data.tasks=[{m}:Echo, addition]", f"env.name={m}:Say",
                             "env.settings={word: fine}", f"rollout.function={m}:SPEC"])
    assert cfg.data.reward == f"{m}:reward" and cfg.data.tasks == [f"{m}:Echo", "addition"]
    assert RewardRunner(cfg.data.reward).score("p", " 7", "7", "any") == 1.0
    task = make_task(f"{m}:Echo")
    assert task.name == f"{m}:Echo" and not task.is_heldout(task.sample(__import__("random").Random(0)))
    assert make_env(cfg.env.name, **cfg.env.settings).word == "fine" and ROLLOUT_FNS.get(f"{m}:SPEC") is not None
    # the names are the config's values: into the checkpoint's copy as they are
    assert config_to_dict(cfg)["data"]["reward"] == f"{m}:reward"
    again = load_config(None, [f"data.reward={m}:reward"])  # a second load finds them registered
    assert again.data.reward == f"{m}:reward"


def test_plugins_list_imports_modules_for_what_they_register(plugin):
    m = plugin()
    with pytest.raises(ConfigError, match="data.reward"):  # not imported: not registered
        load_config(None, [f"data.reward={m}_registered"])
    cfg = load_config(None, [f"plugins=[{m}]", f"data.reward={m}_registered", f"env.name={m}_env"])
    assert cfg.plugins == [m] and config_to_dict(cfg)["plugins"] == [m]
    assert cfg.env.name == f"{m}_env"


@pytest.mark.parametrize("override,message", [
    ("data.reward={m}:two_args", (r"data.reward: {m}:two_args is function two_args\(prompt, response\), which cannot "
                                 r"be called as f\(prompt, response, label\); a reward plugin must be a function")),
    ("data.reward={m}:coroutine", r"data.reward: .*a coroutine function"),
    ("data.reward={m}:NUMBER", r"data.reward: {m}:NUMBER is int 3, not a function"),
    ("data.reward={m}:Echo", r"data.reward: {m}:Echo is class Echo, not a function"),
    ("data.reward={m}:missing", r"data.reward: module {m} \(.*{m}.py\) has no attribute 'missing'"),
    ("data.reward={m}:reward.x", r"data.reward: .*has no attribute 'reward.x'"),
    ("'data.reward={m}:1x'", r"data.reward: .*write an import path as package.module:attribute"),
    ("data.reward=no_such_module_xyz:f", (r"data.reward: no module named 'no_such_module_xyz' on sys.path; set "
                                         r"PYTHONPATH")),
    ("data.tasks=[addition, {m}:reward]", (r"data.tasks\[1\]: {m}:reward is function reward, not a subclass of "
                                          r"megatron_rl.data.tasks.base.Task")),
    ("data.tasks=[{m}:Unfinished]", r"data.tasks\[0\]: .*abstract \(it does not implement generate, max_label_len"),
    ("env.name={m}:Echo", r"env.name: {m}:Echo is class Echo, not a subclass of .*Environment"),
    ("env.name={m}:Say", None),
    ("rollout.function={m}:reward", r"rollout.function: {m}:reward is function reward, not a RolloutFnSpec"),
    ("plugins=[no_such_module_xyz]", r"plugins\[0\]='no_such_module_xyz': no module named"),
    ("plugins=[/tmp/a_plugin.py]", r"plugins\[0\]='/tmp/a_plugin.py': .* is not a module name"),
    ("plugins={m}", r"plugins='{m}': a list of module names"),
])
def test_a_bad_plugin_is_refused_naming_the_field(plugin, override, message):
    m = plugin()
    override = override.replace("{m}", m).strip("'")
    if message is None:  # the good case of the same shape
        load_config(None, [override])
        return
    with pytest.raises(ConfigError, match=message.replace("{m}", m)):
        load_config(None, [override])


def test_a_module_that_fails_to_import_is_refused_with_its_line(plugin):
    m = plugin("import os\nraise RuntimeError('no GPU here')\n")
    with pytest.raises(ConfigError, match=rf"data.reward: importing module {m} failed at .*{m}.py:2: RuntimeError: no "
                                          r"GPU here"):
        load_config(None, [f"data.reward={m}:f"])
    m = plugin("import a_dependency_that_is_not_installed\n")
    with pytest.raises(ConfigError, match=rf"plugins\[0\]='{m}': importing module {m} failed at .*: "
                                          r"ModuleNotFoundError: No module named 'a_dependency_that_is_not_installed'"):
        load_config(None, [f"plugins=[{m}]"])


def test_a_plugin_task_needs_a_registered_reward(plugin):
    m = plugin(PLUGIN + "\nclass Scored(Echo):\n    reward = 'nowhere'\n\nclass ByPath(Echo):\n"
                        "    reward = '{m}:reward'\n")
    with pytest.raises(ConfigError, match=rf"data.tasks\[0\]='{m}:Scored': its reward 'nowhere' is not a registered"):
        load_config(None, [f"data.tasks=[{m}:Scored]"])
    load_config(None, [f"data.tasks=[{m}:Scored]", "data.reward=exact_match"])  # data.reward scores it instead
    load_config(None, [f"data.tasks=[{m}:ByPath]"])
    assert f"{m}:reward" in REWARDS


def test_a_registered_class_keeps_its_own_name(plugin):
    m = plugin()
    cfg = load_config(None, [f"plugins=[{m}]", f"env.name={m}:Registered"])
    assert ENVS[cfg.env.name].name == f"{m}_env"  # the decorator's name, which metrics and seeds use


def test_a_checkpoints_config_is_compared_never_imported(plugin):
    """A resume compares the checkpoint's config as data: a plugin only it names is never imported."""
    m = plugin("raise SystemExit('imported')\n")
    now = config_to_dict(load_config(None, []))
    saved = {**now, "plugins": [m], "data": {**now["data"], "reward": f"{m}:reward"}}
    changes = config_changes(saved, now)
    assert ("data.reward", f"{m}:reward", None) in changes and ("plugins", [m], []) in changes
    assert m not in sys.modules
