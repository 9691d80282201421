"""Config input that was accepted and then blew up later (third fault-drill round): every section
is validated whichever engine runs, and YAML is bounded before anything writes it out."""
import pytest

from megatron_rl.config import ConfigError, config_to_dict
from megatron_rl.config.loader import MAX_CONFIG_DEPTH, MAX_CONFIG_SIZE
from megatron_rl.configure import load_config


def _bomb(levels: int = 7) -> str:
    """A 'billion laughs' YAML mapping: each anchor repeats the one before ten times (10**levels leaves)."""
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "\n".join(lines)


@pytest.mark.parametrize("overrides,msg", [
    (["rollout.vllm={bogus: 1}"], r"unknown config key rollout.vllm.bogus"),
    (["rollout.vllm={tensor_parallel_size: two}"], r"rollout.vllm.tensor_parallel_size='two': expected an integer"),
    (["rollout.vllm={enforce_eager: 1}"], r"rollout.vllm.enforce_eager=1: expected true or false"),
    (["rollout.vllm={env: {HF_TOKEN: [a, b]}}"], r"rollout.vllm.env=.*must be a mapping of names to values"),
    (["rollout.vllm={extra_args: [[--a, b]]}"], r"rollout.vllm.extra_args=.*must be a list of command-line"),
    (["rollout.vllm=[1, 2]"], r"rollout.vllm=\[1, 2\]: rollout.vllm is a section, not a value"),
    (["rollout.vllm={extra_args: [--hf-token=x]}"], r"--hf-token looks like a secret"),
])
def test_rollout_vllm_is_validated_under_the_embedded_backend(overrides, msg):
    assert load_config(None).rollout.backend == "embedded"
    with pytest.raises(ConfigError, match=msg):
        load_config(None, overrides)


def test_a_valid_rollout_vllm_passes_under_the_embedded_backend():
    cfg = load_config(None, [("rollout.vllm={tensor_parallel_size: 2, env: {A: 1}, extra_args: [--seed, 3], "
                             "probe_tolerance: 1e-3}")])   # YAML reads 1e-3 as text: a float field takes it
    assert cfg.rollout.vllm.tensor_parallel_size == 2 and cfg.rollout.vllm.probe_tolerance == 1e-3


def test_a_yaml_alias_bomb_is_refused_before_anything_expands_it(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text("rollout:\n  vllm:\n" + "".join(f"    {line}\n" for line in _bomb().splitlines()))
    assert path.stat().st_size < 2000
    with pytest.raises(ConfigError, match=rf"{path}: the config expands to more than {MAX_CONFIG_SIZE:,} values"
                                          r".*reached at rollout\.vllm\.l"):
        load_config(str(path))


@pytest.mark.parametrize("section", ["model.overrides", "loss.surrogate_params", "rollout.vllm"])
def test_every_section_is_bounded_on_the_command_line(section):
    bomb = "{" + ", ".join(_bomb().splitlines()) + "}"
    with pytest.raises(ConfigError, match=rf"override {section}: the config expands to more than"):
        load_config(None, [f"{section}={bomb}"])


@pytest.mark.parametrize("value", ["&a [*a]", "&a {k: *a}"])
def test_an_alias_inside_its_own_anchor_is_refused(value):
    with pytest.raises(ConfigError, match=rf"nested more than {MAX_CONFIG_DEPTH} levels deep"):
        load_config(None, [f"rollout.vllm={{extra_args: {value}}}"])


def test_a_document_too_deep_for_the_parser_is_a_config_error(tmp_path):
    path = tmp_path / "deep.yaml"
    path.write_text("model:\n  overrides: " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ConfigError, match=rf"{path}: not a usable config \(nested too deeply to read\)"):
        load_config(str(path))
    with pytest.raises(ConfigError, match=r"loss.surrogate_params: not a usable YAML value \(nested too deeply"):
        load_config(None, ["loss.surrogate_params=" + "[" * 100_000 + "]" * 100_000])


def test_shared_anchors_within_the_bound_still_work(tmp_path):
    """Anchors are fine in moderation: a repeated mapping is expanded once per use."""
    path = tmp_path / "ok.yaml"
    path.write_text("loss:\n  surrogate_params: &p {eps_low: 0.2, eps_high: 0.28}\n"
                    "rollout:\n  vllm:\n    env: {A: '1'}\n")
    cfg = load_config(str(path))
    assert config_to_dict(cfg)["loss"]["surrogate_params"] == {"eps_low": 0.2, "eps_high": 0.28}


@pytest.mark.parametrize("overrides,msg", [
    (["train.seed=18446744073709551616"], (r"train.seed=18446744073709551616: must be an integer >= 0 and <= 4294967295 "
                                          r"\(a 32-bit seed")),
    (["--seed", "9223372036854775808"], r"train.seed=9223372036854775808: must be an integer >= 0 and <= 4294967295"),
    (["train.seed=-1"], r"train.seed=-1: must be an integer >= 0"),
    (["data.seed=4294967296"], r"data.seed=4294967296: must be an integer >= 0 and <= 4294967295"),
    (["rollout.vllm={seed: 4294967296}"], r"rollout.vllm.seed=4294967296: must be an integer >= 0 and <= 4294967295"),
    (["train.steps=9223372036854775808"], r"train.steps=9223372036854775808: must fit a 64-bit integer"),
    (["train.eval_every=-9223372036854775809"], r"train.eval_every=-9223372036854775809: must be an integer >= 0"),
    (["rollout.max_tokens=" + "9" * 30], r"rollout.max_tokens=9{30}: must fit a 64-bit integer"),
])
def test_integers_are_bounded_where_they_are_read(overrides, msg):
    """train.seed=2**64 failed mid-start in megatron's RNG tracker ("Overflow when unpacking long
    long", exit 1); every integer must fit 64 bits, and a seed 32 (numpy, vLLM's requests)."""
    with pytest.raises(ConfigError, match=msg):
        load_config(None, overrides)


def test_largest_seed_passes():
    assert load_config(None, ["train.seed=4294967295", "data.seed=0"]).train.seed == 2**32 - 1


def test_a_jsonl_that_is_a_fifo_is_named_as_such(tmp_path):
    import os

    os.mkfifo(tmp_path / "p.jsonl")
    os.symlink(tmp_path / "gone.jsonl", tmp_path / "dangling.jsonl")
    cfg = load_config(None, [f"data.jsonl={tmp_path / 'p.jsonl'}", f"train.run_dir={tmp_path / 'run'}"])
    with pytest.raises(ValueError, match=r"p.jsonl: is not a regular file \(a FIFO, socket or device"):
        cfg.check_paths()
    cfg = load_config(None, [f"data.jsonl={tmp_path / 'dangling.jsonl'}", f"train.run_dir={tmp_path / 'run'}"])
    with pytest.raises(ValueError, match=r"dangling.jsonl: is a symbolic link to a file that does not exist"):
        cfg.check_paths()
