"""pretrain_rl.py's own start-up checks (in-process: each refusal returns before a model is built)."""
import os

import pytest

from pretrain_rl import check_summary_json, main


@pytest.fixture
def no_run(monkeypatch):
    """A refusal the entry point misses fails at once, instead of training in this process."""
    import megatron_rl.parallel

    def started(*args, **kwargs):
        raise AssertionError("the run started: the refusal was missed")

    monkeypatch.setattr(megatron_rl.parallel, "init_distributed", started)


def test_a_summary_json_into_a_missing_folder_is_refused_at_start_up(tmp_path, capsys, no_run):
    """It was found only when the run had finished: the summary was lost after the whole training."""
    target = tmp_path / "missing" / "summary.json"
    assert main(["--summary-json", str(target), f"train.run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"config error: --summary-json {target}: the folder {target.parent} does not exist")
    assert not (tmp_path / "run").exists()


def test_summary_json_paths(tmp_path):
    check_summary_json(str(tmp_path / "summary.json"))          # a new file in a folder that exists
    with pytest.raises(ValueError, match="is a folder; name a file in it"):
        check_summary_json(str(tmp_path))
    if os.geteuid() != 0:   # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ValueError, match="not writable by this user"):
            check_summary_json(str(locked / "summary.json"))
