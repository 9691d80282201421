"""Files at fixed names in the run directory (its lock, error logs, metrics, the vLLM server's log,
the write probe) are opened without following a symbolic link planted there: the link's target is
never truncated or appended to, and a FIFO at the name never blocks the run (fs.open_no_follow)."""
import os
import sys

import pytest

from megatron_rl.fs import open_no_follow
from megatron_rl.trainer import run_dir as run_files

PRECIOUS = "someone else's file\n"


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "victim"
    path.write_text(PRECIOUS)
    yield path
    assert path.read_text() == PRECIOUS, "the link's target was written"


def plant(link, target):
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(target, link)


@pytest.mark.parametrize("mode", ["r", "rb", "w", "wb", "a", "ab", "a+", "xb"])
def test_open_no_follow_refuses_a_link_in_every_mode(tmp_path, victim, mode):
    plant(tmp_path / "f", victim)
    with pytest.raises(OSError, match=rf"{tmp_path / 'f'} is a symbolic link \(to {victim}\), and it is not followed"):
        open_no_follow(str(tmp_path / "f"), mode)


@pytest.mark.parametrize("mode", ["r", "w", "a", "a+"])
def test_open_no_follow_refuses_a_fifo_without_blocking(tmp_path, mode):
    os.mkfifo(tmp_path / "f")
    with pytest.raises(OSError, match="is not a regular file"):
        open_no_follow(str(tmp_path / "f"), mode)


def test_open_no_follow_opens_files_as_open_does(tmp_path):
    path = str(tmp_path / "f")
    with open_no_follow(path, "w") as f:
        f.write("ab")
    with open_no_follow(path, "a+") as f:
        f.seek(0)
        assert f.read() == "ab"
        f.write("c")
    with open_no_follow(path, "w") as f:  # truncates a file of its own
        f.write("d")
    assert (tmp_path / "f").read_text() == "d"


def test_a_linked_lock_is_refused_and_its_target_kept(tmp_path, victim):
    plant(tmp_path / "run" / ".lock", victim)
    with pytest.raises(run_files.RunDirRefused, match=r"train.run_dir=.*: cannot take its lock: .*\.lock is a "
                                                      r"symbolic link"):
        run_files.lock_run_dir(str(tmp_path / "run"))


def test_a_lock_that_is_a_fifo_is_refused(tmp_path):
    (tmp_path / "run").mkdir()
    os.mkfifo(tmp_path / "run" / ".lock")
    with pytest.raises(run_files.RunDirRefused, match="is not a regular file"):
        run_files.lock_run_dir(str(tmp_path / "run"))


def test_the_write_probe_does_not_follow_a_link(tmp_path, victim):
    plant(tmp_path / "ckpt" / f".write-test-{os.getpid()}", victim)
    problem = run_files.check_writable(str(tmp_path / "ckpt"), 0, "train.run_dir")
    assert problem is not None and "is a symbolic link" in problem and "train.run_dir" in problem


def test_an_error_log_link_is_not_followed(tmp_path, victim, capsys):
    from pretrain_rl import report_error

    plant(tmp_path / "run" / "error-rank0.log", victim)
    report_error(ValueError("boom"), 0, str(tmp_path / "run"), debug=False)
    assert capsys.readouterr().err.strip() == "error: boom"   # no traceback file to point at


def test_a_refused_run_dir_gets_no_error_log(tmp_path, capsys):
    from pretrain_rl import report_error

    report_error(run_files.RunDirRefused("refused"), 0, str(tmp_path / "run"), debug=False)
    assert not (tmp_path / "run").exists() and capsys.readouterr().err.strip() == "error: refused"


def test_a_metrics_link_is_not_followed(tmp_path, victim):
    from megatron_rl.metrics.sink import MetricsSink

    plant(tmp_path / "run" / "metrics.jsonl", victim)
    with pytest.raises(OSError, match="metrics.jsonl is a symbolic link"):
        MetricsSink(str(tmp_path / "run"), enabled=True, tensorboard=False)


def test_a_server_log_link_is_not_followed(tmp_path, victim):
    from megatron_rl.rollout.serving.launcher import _popen_logged
    from megatron_rl.rollout.vllm.env import local_server

    plant(tmp_path / "vllm" / "server.log", victim)
    with pytest.raises(OSError, match="server.log is a symbolic link"):
        _popen_logged([sys.executable, "-c", "pass"], {}, str(tmp_path / "vllm" / "server.log"), "header\n")
    server = local_server(sys.executable, [], {}, str(tmp_path / "vllm" / "server.log"))
    assert server.log_tail() == "(no log)"   # the target's lines are not shown as the server's
