"""Checkpoint faults without a model (the review's third round; the runs are in
tests/e2e/test_drills_round3.py): only regular files of a checkpoint are ever opened, a manifest
or host state that cannot be used is named, a full disk names what holds its space, a failed
save's message names the writer's failure, and the files a resume reads back (metrics.jsonl, the
counters) never stop it. Single process: the collectives degrade to local."""
import errno
import json
import os
import shutil
from collections import namedtuple

from torch.distributed.checkpoint.api import CheckpointException

from megatron_rl.trainer import checkpoint
from megatron_rl.trainer import run_dir as run_files
from megatron_rl.trainer.manifest import build_manifest


def _checkpoint(root, step=1, extra=None):
    path = os.path.join(root, f"iter_{step:07d}")
    os.makedirs(os.path.join(path, "extra"))
    with open(os.path.join(path, "__0_0.distcp"), "wb") as f:
        f.write(b"weights" * 100)
    with open(os.path.join(path, "extra", "rank_00000.json"), "w") as f:
        json.dump(extra if extra is not None else {"step": step}, f)
    build_manifest(path, {"run_id": "r", "step": step, "written_at": 1.0})
    return path


def _edit_manifest(path, edit):
    """Rewrite `path`'s manifest as `edit` changes it (as anyone who can write the checkpoint can)."""
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    edit(manifest)
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump(manifest, f)


def _resign(path, fake):
    _edit_manifest(path, lambda m: m["files"].update({rel: {"bytes": 0, "sha256": "0" * 64} for rel in fake}))


# ---- 2: a failed save names what failed; a full disk names what holds its space
def test_a_writer_failure_is_named_without_megatrons_wrapping():
    failure = RuntimeError("Worker failure: the checkpoint writer process 12 writing /c/__0_1.distcp was killed "
                           "by SIGKILL")
    message = checkpoint._first_failure(CheckpointException("write", {0: (failure, None)}))
    assert message == "the checkpoint writer process 12 writing /c/__0_1.distcp was killed by SIGKILL"
    assert "another rank" in checkpoint._first_failure(CheckpointException("write", {}))


def test_partial_saves_are_swept_and_a_full_disk_names_what_holds_space(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    (root / "iter_0000003.tmp").mkdir(parents=True)
    (root / "iter_0000003.tmp" / "__0_0.distcp").write_bytes(b"x" * 1000)
    (root / "iter_0000002.corrupt").mkdir()
    assert checkpoint.partial_saves(str(root)) == [str(root / "iter_0000003.tmp")]
    assert checkpoint.folder_bytes(str(root / "iter_0000003.tmp")) == 1000
    assert checkpoint.sweep_partial_saves(str(root)) == [str(root / "iter_0000003.tmp")]
    assert sorted(os.listdir(root)) == ["iter_0000002.corrupt"]   # only the unfinished save
    held = [("/run/previous/x/checkpoints/iter_0000009.tmp", 3 << 30)]
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10 << 30, 9 << 30, 1 << 30))
    msg = run_files.check_writable(str(root), 2 << 30, "train.run_dir", held)
    assert "1.00 GiB free" in msg and "iter_0000009.tmp (3.00 GiB)" in msg
    assert run_files.check_writable(str(root), 2 << 30, "train.run_dir").endswith("choose another train.run_dir")

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    msg = run_files.check_writable(str(root), 1, "train.run_dir", held)
    assert "No space left on device" in msg and "free some space" in msg and "iter_0000009.tmp" in msg
    assert [n for n in os.listdir(root) if n.startswith(".write-test")] == []   # the probe is not left

