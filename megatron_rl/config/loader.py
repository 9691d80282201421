"""YAML + command-line overrides -> RunConfig, with errors that name the key and the fix.

    data = read_config("examples/demo_cpu.yaml", ["train.steps=10", "--tensor-model-parallel-size", "2"])
    cfg = build_config(data)      # every section checks its own values

`megatron_rl.configure.load_config` is the whole start-up path: it also imports the user's plugins
between the two and checks the rules across sections and registered components after.

Overrides are `section.field=value` (value parsed as YAML: 3, 1e-4, true, [a, b], {C: 2}) or
Megatron-style flags from MEGATRON_FLAGS. A mapping given as a value merges into the file's
mapping key by key; an empty one, `{}`, replaces it (`env.settings={}` drops the file's settings).

Every parsed YAML document, the file and each override value, is bounded before anything else
reads it (`check_expansion`): at most MAX_CONFIG_SIZE values and characters once its aliases are
written out, and MAX_CONFIG_DEPTH levels of nesting.
"""
from __future__ import annotations

import dataclasses
import difflib
from typing import Any

import yaml

from megatron_rl.config.engine_sections import engine_sections
from megatron_rl.config.schema import RolloutSection, RunConfig
from megatron_rl.precision import expand_precision

# Megatron-LM flag -> config path (so `torchrun pretrain_rl.py --tensor-model-parallel-size 2` works)
MEGATRON_FLAGS = {
    "--tensor-model-parallel-size": "parallel.tensor_model_parallel_size",
    "--pipeline-model-parallel-size": "parallel.pipeline_model_parallel_size",
    "--expert-model-parallel-size": "parallel.expert_model_parallel_size",
    "--expert-tensor-parallel-size": "parallel.expert_tensor_parallel_size",
    "--context-parallel-size": "parallel.context_parallel_size",
    "--lr": "optim.lr",
    "--clip-grad": "optim.clip_grad",
    "--weight-decay": "optim.weight_decay",
    "--use-distributed-optimizer": "optim.use_distributed_optimizer",
    "--micro-batch-size": "train.micro_batch_size",
    "--train-iters": "train.steps",
    "--seed": "train.seed",
    "--save-interval": "train.save_every",
    "--load": "train.init_checkpoint",
    "--run-dir": "train.run_dir",
    "--rollout-backend": "rollout.backend",
    "--recipe": "loss.recipe",
    "--router-replay": "moe.router_replay",
    "--sft-steps": "sft.steps",
}
_BOOL_FLAGS = {"--use-distributed-optimizer"}
# settings that moved, with what to use instead
MOVED = {"optim.dtype": "the training precision is model.dtype (the optimizer keeps fp32 master weights "
                        "for bf16/fp16 models)"}
# settings that were renamed: the old name -> the new setting for the value it was given
RENAMED = {
    "rollout.vllm.weight_sync": lambda value: f"rollout.weight_sync={value}",
    "rollout.weight_transport": lambda value: ("rollout.weight_sync=reload (or restart: a fresh vLLM server on "
                                               "each folder)" if value == "disk" else
                                               f"rollout.weight_sync={'auto' if value is None else value}"),
}


class ConfigError(ValueError):
    pass


# A config's size once written out, counting each mapping, list and scalar as 1 and each text by
# its length: far above any real config (the largest example is a few hundred), far below what
# printing it or saving it in a checkpoint would choke on. A config is never nested this deep.
MAX_CONFIG_SIZE = 1_000_000
MAX_CONFIG_DEPTH = 32


def check_expansion(data: Any, source: str) -> None:
    """Refuse a parsed YAML document that is too large or too deep once its aliases are expanded.

    A YAML alias (`*a`) repeats what its anchor (`&a`) holds. safe_load shares one object among
    the repeats, but everything that writes the config out (--print-config, the copy each
    checkpoint keeps, the resume comparison) expands every one: a 1.5 KB file of aliases of
    aliases ("billion laughs") grew to 13.5 GB, and an alias inside its own anchor never ends.
    The walk is iterative and stops at the budget, so checking is bounded too. Raises
    ConfigError naming `source` and the path where the budget ran out."""
    budget = MAX_CONFIG_SIZE
    stack = [(data, "", 0)]
    while stack:
        node, path, depth = stack.pop()
        budget -= len(node) if isinstance(node, str) else 1
        if budget < 0:
            raise ConfigError(f"{source}: the config expands to more than {MAX_CONFIG_SIZE:,} values and characters "
                              f"(reached at {path or 'the top'}); YAML aliases (*name) that repeat anchors of "
                              f"aliases multiply without bound: write the values out instead")
        if depth > MAX_CONFIG_DEPTH:
            raise ConfigError(f"{source}: {path} is nested more than {MAX_CONFIG_DEPTH} levels deep (a YAML alias "
                              f"inside its own anchor?); a config needs a few levels")
        if isinstance(node, dict):
            for key, value in node.items():
                budget -= len(key) if isinstance(key, str) else 1
                stack.append((value, f"{path}.{key}" if path else str(key), depth + 1))
        elif isinstance(node, (list, tuple)):
            stack.extend((value, f"{path}[{i}]", depth + 1) for i, value in enumerate(node))


def _field_names(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _build(cls, data: dict, where: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'} must be a mapping, got {type(data).__name__}")
    names = _field_names(cls)
    kwargs = {}
    hints = {f.name: f for f in dataclasses.fields(cls)}
    if cls is RolloutSection:  # each registered engine's own section instead of the `engines` field
        engines = engine_sections()
        names = [n for n in names if n != "engines"] + list(engines)
        given = {k: data[k] for k in engines if k in data}
        data = {k: v for k, v in data.items() if k not in engines}
        kwargs["engines"] = {name: _section(section, given[name], f"{where}.{name}") if name in given else section()
                             for name, section in engines.items()}
    for key, value in data.items():
        if key not in names:
            path = f"{where}.{key}" if where else key
            if path in RENAMED:
                raise ConfigError(f"{path} was renamed: use {RENAMED[path](value)}")
            if path in MOVED:
                raise ConfigError(f"{path} is no longer a setting: {MOVED[path]}")
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"; did you mean {where + '.' if where else ''}{close[0]}?" if close else \
                f"; valid keys: {', '.join(names)}"
            raise ConfigError(f"unknown config key {where + '.' if where else ''}{key}{hint}")
        default = hints[key].default_factory() if hints[key].default_factory is not dataclasses.MISSING else \
            hints[key].default
        path = f"{where}.{key}" if where else key
        if dataclasses.is_dataclass(default):
            kwargs[key] = _section(type(default), value, path)
        else:
            kwargs[key] = _coerce(str(hints[key].type), value, f"{where}.{key}" if where else key)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        msg = str(e)  # section checks name their field already; others get the section's name
        raise ConfigError(msg if not where or msg.startswith(where) else f"{where}: {msg}") from e


def _section(cls, value: Any, path: str):
    """A section (a dataclass) from its mapping."""
    if not isinstance(value, dict):
        raise ConfigError(f"{path}={value!r}: {path} is a section, not a value; set one of its fields "
                          f"({path}.<field>=..., e.g. {path}.{_field_names(cls)[0]}=...)")
    return _build(cls, value, path)


def _coerce(annotation: str, value: Any, where: str) -> Any:
    """YAML reads `3e-4` as a string (no dot) and `1` as an int: coerce to the field's type.

    Only lossless conversions: an int field refuses 2.5 and true, a float field refuses true."""
    kinds = annotation.replace(" ", "").split("|")
    if value is None and "None" in kinds:
        return None
    if value is None:
        raise ConfigError(f"{where}: a value is required (null is not allowed here)")
    if "float" in kinds and isinstance(value, (int, str)) and not isinstance(value, bool):
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{where}={value!r}: expected a number") from None
    if "int" in kinds and "float" not in kinds:
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                raise ConfigError(f"{where}={value!r}: expected an integer") from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}={value!r}: expected an integer")
    if "bool" in kinds and not isinstance(value, bool):
        raise ConfigError(f"{where}={value!r}: expected true or false")
    return value


def _set(tree: dict, path: str, value: Any) -> None:
    parts = path.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {path}: {p} is not a section")
    node[parts[-1]] = value


def parse_overrides(args: list[str]) -> dict:
    """["a.b=1", "--tensor-model-parallel-size", "2", "--c.d=x"] -> nested dict."""
    tree: dict = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in MEGATRON_FLAGS:
            if arg in _BOOL_FLAGS:
                _set(tree, MEGATRON_FLAGS[arg], True)
                i += 1
                continue
            if i + 1 >= len(args):
                raise ConfigError(f"{arg} needs a value")
            _set(tree, MEGATRON_FLAGS[arg], _value(arg, args[i + 1]))
            i += 2
            continue
        key, sep, value = arg.lstrip("-").partition("=")
        if not sep:
            if arg.startswith("--") and i + 1 < len(args) and "." in key:
                value, i = args[i + 1], i + 1
            else:
                raise ConfigError(f"cannot parse override {arg!r}; use section.field=value "
                                  f"(e.g. train.steps=10) or a Megatron flag ({', '.join(sorted(MEGATRON_FLAGS))})")
        _set(tree, key.replace("-", "_"), _value(key, value))
        i += 1
    return tree


def _value(name: str, text: str) -> Any:
    """An override's value read as YAML (so 3, 1.0e-6, true, null, [a, b] and {k: v} work)."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{name}={text!r}: not a valid YAML value ({_yaml_problem(e)}); write it as YAML "
                          f"and quote the whole override for the shell, e.g. 'loss.corrections=[{{name: tis_token, "
                          f"C: 2}}]'") from None
    except (ValueError, RecursionError) as e:  # an integer of 5,000 digits; [[[[...]]]] past the parser's stack
        raise ConfigError(f"{name}: not a usable YAML value ({_unparsable(e)})") from None
    check_expansion(value, f"override {name}")
    return value


def _unparsable(e: BaseException) -> str:
    return "nested too deeply to read" if isinstance(e, RecursionError) else str(e)


def _yaml_problem(e: yaml.YAMLError) -> str:
    """What the YAML parser objects to, and where (line and column, 1-based)."""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    mark = getattr(e, "problem_mark", None)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem


def _merge(base: dict, over: dict) -> dict:
    """`over` on top of `base`: a mapping merges key by key into the one it meets, except an empty
    one, which replaces it (`env.settings={}` drops the file's settings; a section set to {} is
    back to its defaults)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and v and isinstance(out.get(k), dict) else v
    return out


def expand_recipe(data: dict) -> dict:
    """Fill in the settings the loss recipe implies (LossRecipe.implies, e.g. minirl_r3 ->
    moe.router_replay=r3); a config that sets one of them to something else is an error."""
    loss = data.get("loss") if isinstance(data.get("loss"), dict) else {}
    name = loss.get("recipe", _default("loss", "recipe"))
    from megatron_rl.losses import RECIPES

    if not isinstance(name, str) or name not in RECIPES:
        return data  # resolve_loss names the problem with the valid recipes
    out = dict(data)
    for path, value in RECIPES.get(name).implies.items():
        section, key = path.split(".")
        given = (out.get(section) or {}).get(key) if isinstance(out.get(section), dict) else None
        if given is not None and given != value:
            raise ConfigError(f"loss.recipe={name} implies {path}={value}, but the config sets {path}={given}; "
                              f"remove one of them")
        out[section] = {**(out.get(section) or {}), key: value}
    return out


def _default(section: str, key: str):
    """A field's default, read off the dataclass (no instance: that would run the validation)."""
    cls = {f.name: f for f in dataclasses.fields(RunConfig)}[section].default_factory
    spec = {f.name: f for f in dataclasses.fields(cls)}[key]
    return spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default


def read_config(path: str | None = None, overrides: list[str] | None = None) -> dict:
    """The config file (YAML) with the overrides on top and the precision and loss recipes
    expanded, as plain data: what `build_config` builds and what the user's plugins are read from."""
    data: dict = {}
    if path:
        try:
            with open(path) as f:
                data = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {_yaml_problem(e)}") from None
        except (ValueError, RecursionError) as e:
            raise ConfigError(f"{path}: not a usable config ({_unparsable(e)})") from None
        check_expansion(data, path)
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections (model:, rollout:, ...)")
    cli = parse_overrides(overrides or [])
    try:  # a recipe fills in the fields of its own layer that the layer does not set itself; a
        # recipe on the command line replaces the file's recipe (none of its fields survive)
        if (cli.get("precision") or {}).get("recipe") is not None:
            data = _merge(data, expand_precision(cli))
        else:
            data = _merge(expand_precision(data), cli)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return expand_recipe(data)


def build_config(data: dict) -> RunConfig:
    """The RunConfig of `read_config`'s data; every section checks its own values (ConfigError
    naming the field). The rules across sections are `megatron_rl.configure.validate`'s."""
    return _build(RunConfig, data, "")


REDACTED = "<redacted>"


def config_to_dict(cfg) -> dict:
    """The config as plain data, for printing and for the copy each checkpoint keeps: each engine's
    section under its own name (`rollout.vllm`), with its secrets replaced by "<redacted>" (the
    section's SECRET_FIELDS, e.g. `rollout.vllm.api_key`, and the values of its SECRET_MAPPINGS,
    e.g. `rollout.vllm.env`, which may carry tokens such as HF_TOKEN). Checkpoints are copied and
    shared; keys are not."""
    data = dataclasses.asdict(cfg)
    rollout = data["rollout"]
    engines = rollout.pop("engines")
    for name, section in cfg.rollout.engines.items():
        values = engines[name]
        for key in getattr(section, "SECRET_FIELDS", ()):
            if values.get(key) is not None:
                values[key] = REDACTED
        for key in getattr(section, "SECRET_MAPPINGS", ()):
            if isinstance(values.get(key), dict):
                values[key] = {k: REDACTED for k in values[key]}
        rollout[name] = values
    return data
