"""Start-up refusal of a train.init_checkpoint that is not one checkpoint, and the messages of a
run that fails or stops before anything was saved."""
import signal
from types import SimpleNamespace

from megatron_rl.trainer.loop import engine_failure_message, stopped
from megatron_rl.trainer.startup import init_checkpoint_problem


def test_init_checkpoint_that_does_not_exist(tmp_path):
    msg = init_checkpoint_problem(str(tmp_path / "nope"))
    assert msg.startswith(f"train.init_checkpoint={tmp_path / 'nope'}: no such directory")


def test_init_checkpoint_folder_of_checkpoints_names_the_newest(tmp_path):
    for name in ("iter_0000001", "iter_0000002", "iter_0000003.tmp"):
        (tmp_path / name).mkdir()
    assert init_checkpoint_problem(str(tmp_path)) == (
        f"train.init_checkpoint={tmp_path} holds checkpoints rather than being one: use "
        f"train.init_checkpoint={tmp_path / 'iter_0000002'} (the newest)")
    (tmp_path / "latest").write_text("iter_0000001")  # `latest` wins, as on resume
    assert f"use train.init_checkpoint={tmp_path / 'iter_0000001'} (the newest)" in init_checkpoint_problem(str(tmp_path))


def test_a_checkpoint_dir_passes(tmp_path):
    (tmp_path / "manifest.json").write_text("{}")
    assert init_checkpoint_problem(str(tmp_path)) is None


def test_failure_before_any_save_does_not_suggest_resume():
    msg = engine_failure_message(RuntimeError("engine died"), 0, None)
    assert msg == "engine died. No RL step completed, so nothing was saved; fix the engine and rerun"
    assert "None" not in msg and "resume" not in msg
    msg = engine_failure_message(RuntimeError("engine died"), 3, "/r/checkpoints/iter_0000003")
    assert "of the 3 completed steps to /r/checkpoints/iter_0000003" in msg and "train.resume=true" in msg


def test_stop_before_any_save_does_not_name_a_checkpoint():
    ctx = SimpleNamespace(stop=SimpleNamespace(signum=signal.SIGTERM), cfg=SimpleNamespace(train=SimpleNamespace(steps=5)))
    assert str(stopped(ctx, 0, None)).endswith("after step 0 of 5; nothing was saved: rerun to start over")
    assert "checkpoint /c; rerun with train.resume=true" in str(stopped(ctx, 2, "/c"))


class _Stream:
    def __init__(self, tty: bool):
        self.tty = tty

    def isatty(self):
        return self.tty


def test_progress_bars_only_when_both_streams_are_terminals(monkeypatch):
    """The bars (stderr) replace the step lines (stdout): with `> log` or `| tee log` and stderr
    still on a terminal, bars would leave the log with no step lines."""
    import sys

    from megatron_rl.configure import load_config
    from megatron_rl.trainer import loop

    monkeypatch.setattr(loop.dist, "get_rank", lambda: 0)
    cfg = load_config(None)
    for out, err, want in ((True, True, True), (False, True, False), (True, False, False), (False, False, False)):
        monkeypatch.setattr(sys, "stdout", _Stream(out))
        monkeypatch.setattr(sys, "stderr", _Stream(err))
        assert loop.show_progress(cfg) is want, (out, err)
    assert loop.show_progress(load_config(None, ["log.progress=true"])) is True   # asked for: on a file too
    monkeypatch.setattr(loop.dist, "get_rank", lambda: 1)
    assert loop.show_progress(load_config(None, ["log.progress=true"])) is False  # rank 0 only
