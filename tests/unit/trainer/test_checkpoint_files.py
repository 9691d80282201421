"""Checkpoint directory logic without a model: manifests, retention, moving an earlier run aside,
start-up writability and space checks (single process; the collectives degrade to local)."""
import errno
import json
import os
import pathlib
import shutil
import time
from collections import namedtuple

import pytest

from megatron_rl.trainer import run_dir as run_files
from megatron_rl.trainer.checkpoint import latest_checkpoint, read_extra, retired_checkpoints
from megatron_rl.trainer.manifest import build_manifest, verify_manifest


def _fake_checkpoint(root, step, run_id, written_at, payload=b"weights"):
    path = os.path.join(root, f"iter_{step:07d}")
    os.makedirs(os.path.join(path, "extra"))
    with open(os.path.join(path, "__0_0.distcp"), "wb") as f:
        f.write(payload * 100)
    with open(os.path.join(path, "extra", "rank_00000.json"), "w") as f:
        json.dump({"step": step}, f)
    build_manifest(path, {"run_id": run_id, "step": step, "written_at": written_at})
    return path


def _point_latest(root, path):
    with open(os.path.join(root, "latest"), "w") as f:
        f.write(os.path.basename(path))


def test_manifest_detects_a_flipped_bit_a_missing_and_an_extra_file(tmp_path):
    path = _fake_checkpoint(str(tmp_path), 1, "a", 1.0)
    assert verify_manifest(path) == []
    shard = pathlib.Path(path, "__0_0.distcp")
    data = bytearray(shard.read_bytes())
    data[10] ^= 0x01
    shard.write_bytes(bytes(data))
    [problem] = verify_manifest(path)
    assert "__0_0.distcp does not match its sha256" in problem
    os.remove(os.path.join(path, "extra", "rank_00000.json"))
    pathlib.Path(path, "stray.bin").write_bytes(b"x")
    problems = verify_manifest(path)
    assert any("rank_00000.json is missing" in p for p in problems)
    assert any("stray.bin is not in the manifest" in p for p in problems)
    pathlib.Path(path, "manifest.json").write_text("{trunc")
    assert "is damaged" in verify_manifest(path)[0]


def test_retention_keeps_newest_by_step_and_by_time_and_latest_and_other_runs(tmp_path):
    root = str(tmp_path)
    other = [_fake_checkpoint(root, s, "old", 100.0 + s) for s in (7, 8)]  # an earlier run, higher steps
    mine = [_fake_checkpoint(root, s, "new", 200.0 + s) for s in (1, 2, 3)]
    _point_latest(root, mine[-1])
    # keep=2: step 1 is neither among the 2 newest by step nor by time
    assert retired_checkpoints(root, "new", keep=2) == [mine[0]]
    # the run went back (resumed from step 1 after a fallback) and wrote step 2 again, last:
    # the newest by time (step 2) is protected even though step 3 has a higher number
    shutil.rmtree(mine[1])
    again = _fake_checkpoint(root, 2, "new", 900.0)
    _point_latest(root, again)
    assert retired_checkpoints(root, "new", keep=1) == [mine[0]]
    assert all(os.path.isdir(p) for p in other)  # never candidates: another run id
    assert retired_checkpoints(root, "old", keep=1) == [other[0]]


def test_latest_falls_back_to_the_highest_complete_checkpoint(tmp_path):
    root = str(tmp_path)
    assert latest_checkpoint(root) is None
    a = _fake_checkpoint(root, 3, "r", 1.0)
    _fake_checkpoint(root, 1, "r", 2.0)
    (tmp_path / "latest").write_text("iter_0000009")  # names a dir that is gone
    assert latest_checkpoint(root) == a
    assert read_extra(a) == {"step": 3}


@pytest.mark.parametrize("content", ["../outside", "/abs/iter_0000001", "iter_0000001/../../outside", "\xff\xfe"])
def test_latest_never_names_a_dir_outside_root(tmp_path, content):
    root = tmp_path / "ckpts"
    a = _fake_checkpoint(str(root), 2, "r", 1.0)
    (tmp_path / "outside").mkdir()
    (root / "latest").write_bytes(content.encode("latin-1"))
    assert latest_checkpoint(str(root)) == a


def test_fresh_run_moves_the_earlier_run_aside(tmp_path):
    run = tmp_path / "run"
    assert run_files.archive_previous_run(str(run)) is None
    _fake_checkpoint(str(run / "checkpoints"), 4, "old", 1.0)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "sft").mkdir()
    dest = run_files.archive_previous_run(str(run))
    assert sorted(os.listdir(dest)) == ["checkpoints", "metrics.jsonl"]
    assert os.path.isdir(os.path.join(dest, "checkpoints", "iter_0000004"))
    assert not (run / "checkpoints").exists() and (run / "sft").is_dir()  # SFT result stays usable
    time.sleep(0)  # a second archive in the same second gets its own folder
    (run / "metrics.jsonl").write_text("{}\n")
    assert run_files.archive_previous_run(str(run)) != dest


def test_check_writable_names_the_directory_and_the_field(tmp_path, monkeypatch):
    assert run_files.check_writable(str(tmp_path / "ckpt"), 1 << 20, "train.run_dir") is None
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    msg = run_files.check_writable(str(blocker / "ckpt"), 1, "train.run_dir")
    assert msg.startswith(f"cannot write checkpoints to {blocker / 'ckpt'}") and "train.run_dir" in msg
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10 << 30, 9 << 30, 1 << 30))
    msg = run_files.check_writable(str(tmp_path / "ckpt"), 2 << 30, "train.run_dir")
    assert "1.00 GiB free" in msg and "needs about 2.00 GiB" in msg


def test_read_extra_is_json_only(tmp_path):
    """Host state is JSON: a pickle planted where the old format kept it is never read."""
    path = _fake_checkpoint(str(tmp_path), 1, "r", 1.0)
    (tmp_path / "iter_0000001" / "extra" / "rank_00000.pt").write_bytes(b"\x80\x04crafted")
    assert read_extra(path) == {"step": 1}
    (tmp_path / "iter_0000001" / "extra" / "rank_00000.json").write_text("\x00\x00\x00")
    with pytest.raises(Exception, match="rank_00000.json is damaged"):
        read_extra(path)


def test_a_run_dir_is_held_by_one_run_at_a_time(tmp_path):
    first = run_files.lock_run_dir(str(tmp_path / "run"))
    with pytest.raises(run_files.RunDirInUse, match=rf"in use by another run \(pid {os.getpid()} on "):
        run_files.lock_run_dir(str(tmp_path / "run"))
    first.close()  # the process ending (any way) releases it the same way
    run_files.lock_run_dir(str(tmp_path / "run")).close()


@pytest.mark.parametrize("code", [errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK])
def test_a_filesystem_without_locks_runs_unguarded_and_says_so(tmp_path, monkeypatch, capsys, code):
    """Lustre mounted without -o flock raises ENOSYS: the run starts (with a warning) instead of
    failing before its first step; any other error still stops it."""
    import fcntl

    def no_locks(f, op):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    run_files.lock_run_dir(str(tmp_path / "run")).close()
    assert "its filesystem cannot lock files" in capsys.readouterr().err
    monkeypatch.setattr(fcntl, "flock", lambda f, op: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    with pytest.raises(OSError, match="I/O error"):
        run_files.lock_run_dir(str(tmp_path / "run2"))
