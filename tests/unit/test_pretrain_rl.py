"""pretrain_rl.py's own start-up checks (in-process: each refusal returns before a model is built)."""
import os

import pytest

from pretrain_rl import main, prepare_summary_json


@pytest.fixture
def no_run(monkeypatch):
    """A refusal the entry point misses fails at once, instead of training in this process."""
    import megatron_rl.parallel

    def started(*args, **kwargs):
        raise AssertionError("the run started: the refusal was missed")

    monkeypatch.setattr(megatron_rl.parallel, "init_distributed", started)


def test_a_summary_json_that_cannot_be_written_is_refused_at_start_up(tmp_path, capsys, no_run):
    """It was found only when the run had finished: the summary was lost after the whole training."""
    (tmp_path / "notes").write_text("a file, not a folder")
    target = tmp_path / "notes" / "summary.json"
    assert main(["--summary-json", str(target), f"train.run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"config error: --summary-json {target}: cannot create its folder {target.parent} (")
    assert not (tmp_path / "run").exists()


def test_summary_json_paths(tmp_path):
    prepare_summary_json(str(tmp_path / "new" / "deeper" / "summary.json"))   # made, as train.run_dir is
    assert (tmp_path / "new" / "deeper").is_dir() and not (tmp_path / "new" / "deeper" / "summary.json").exists()
    with pytest.raises(ValueError, match="is a folder; name a file in it"):
        prepare_summary_json(str(tmp_path))
    if os.geteuid() != 0:   # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ValueError, match="not writable by this user"):
            prepare_summary_json(str(locked / "summary.json"))


def test_a_transfer_host_that_does_not_resolve_is_a_config_error(tmp_path, capsys, no_run, monkeypatch):
    """It failed ~260 s in, in torch's rendezvous, with 50 lines of warnings (the resolver is faked:
    a real lookup of an unknown name may wait on DNS)."""
    import socket

    def nowhere(host, *args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", nowhere)
    assert main([f"train.run_dir={tmp_path / 'run'}", "rollout.backend=vllm",
                 "rollout.vllm={transfer_host: trainer.invalid}"]) == 2
    assert capsys.readouterr().err.startswith("config error: rollout.vllm.transfer_host='trainer.invalid' does not "
                                              "resolve on this machine")
