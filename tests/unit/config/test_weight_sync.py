"""`rollout.weight_sync` is the one name for how weights reach the engine: the WEIGHT_SYNCS registry
and the engines' specs are its only source (every name an engine takes resolves for it, to the
registry's transport; every other pair is refused at start-up naming the field, the value and the
choices), and the two settings it replaced are refused with the new spelling."""
import pytest

from megatron_rl.config import ConfigError
from megatron_rl.configure import load_config
from megatron_rl.rollout import ENGINES, WEIGHT_SYNCS, weight_sync
from megatron_rl.trainer.transport import TRANSPORTS

PAIRS = [(engine, name) for engine in ENGINES.names() for name in [*WEIGHT_SYNCS.names(), "auto", "nccl"]]


def test_the_built_in_names_and_what_each_engine_takes():
    assert WEIGHT_SYNCS.names() == ["memory", "reload", "restart"]
    assert [WEIGHT_SYNCS.get(n).transport for n in WEIGHT_SYNCS.names()] == ["memory", "disk", "disk"]
    assert ENGINES.get("embedded").weight_syncs == ("memory",)
    assert ENGINES.get("vllm").weight_syncs == ("memory", "reload", "restart")
    assert all(WEIGHT_SYNCS.get(n).transport in TRANSPORTS for n in WEIGHT_SYNCS.names())


@pytest.mark.parametrize(("engine", "name"), PAIRS)
def test_every_pair_resolves_or_is_refused_naming_the_field(engine, name):
    spec = ENGINES.get(engine)
    overrides = [f"rollout.backend={engine}", f"rollout.weight_sync={name}"]
    if name == "auto" or name in spec.weight_syncs:
        cfg = load_config(None, overrides)
        resolved = weight_sync(cfg.rollout)
        assert resolved == (spec.weight_syncs[0] if name == "auto" else name)
        assert WEIGHT_SYNCS.get(resolved).transport in TRANSPORTS
        return
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert str(e.value).startswith(f"rollout.weight_sync='{name}': rollout.backend={engine} takes "
                                   f"{', '.join(spec.weight_syncs)} (auto = {spec.weight_syncs[0]})")


def test_auto_and_null_are_the_engine_s_default():
    assert load_config(None, []).rollout.weight_sync == "auto"
    assert load_config(None, ["rollout.weight_sync=null"]).rollout.weight_sync == "auto"
    assert weight_sync(load_config(None, ["rollout.backend=vllm"]).rollout) == "memory"
    with pytest.raises(ConfigError, match=r"rollout.weight_sync=\[1\]: name a weight sync"):
        load_config(None, ["rollout.weight_sync=[1]"])


def test_a_refusal_names_the_engines_that_take_the_name():
    with pytest.raises(ConfigError, match=r"rollout.weight_sync='restart': rollout.backend=embedded takes memory "
                                          r"\(auto = memory\); rollout.backend=vllm takes it"):
        load_config(None, ["rollout.weight_sync=restart"])


@pytest.mark.parametrize(("override", "message"), [
    ("rollout.vllm={weight_sync: reload}", "rollout.vllm.weight_sync was renamed: use rollout.weight_sync=reload"),
    ("rollout.vllm={weight_sync: memory}", "rollout.vllm.weight_sync was renamed: use rollout.weight_sync=memory"),
    ("rollout.vllm.weight_sync=restart", "rollout.vllm.weight_sync was renamed: use rollout.weight_sync=restart"),
    ("rollout.weight_transport=memory", "rollout.weight_transport was renamed: use rollout.weight_sync=memory"),
    ("rollout.weight_transport=disk", ("rollout.weight_transport was renamed: use rollout.weight_sync=reload "
                                       "(or restart: a fresh vLLM server on each folder)")),
    ("rollout.weight_transport=null", "rollout.weight_transport was renamed: use rollout.weight_sync=auto"),
])
def test_the_old_settings_are_refused_with_the_new_spelling(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["rollout.backend=vllm", override])
    assert str(e.value) == message


def test_an_old_setting_in_a_file_stops_the_entry_point_with_exit_2(tmp_path, capsys):
    import pretrain_rl

    path = tmp_path / "old.yaml"
    path.write_text("rollout:\n  backend: vllm\n  vllm: {weight_sync: restart}\n")
    assert pretrain_rl.main(["--config", str(path)]) == 2
    assert "rollout.vllm.weight_sync was renamed: use rollout.weight_sync=restart" in capsys.readouterr().err
