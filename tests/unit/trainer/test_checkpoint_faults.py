"""Checkpoint faults without a model (the review's third round; the runs are in
tests/e2e/test_drills_round3.py): only regular files of a checkpoint are ever opened, a manifest
or host state that cannot be used is named, a full disk names what holds its space, a failed
save's message names the writer's failure, and the files a resume reads back (metrics.jsonl, the
counters) never stop it. Single process: the collectives degrade to local."""
import errno
import json
import os
import pickle
import random
import shutil
from collections import namedtuple

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from megatron_rl.metrics.sink import MetricsSink
from megatron_rl.rewards import RewardRunner
from megatron_rl.trainer import checkpoint
from megatron_rl.trainer import run_dir as run_files
from megatron_rl.trainer.host_state import host_state_problem, rng_state, set_rng_state
from megatron_rl.trainer.manifest import NotRegularFile, build_manifest, read_manifest, verify_manifest
from megatron_rl.trainer.schedule import SyncSchedule


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


# ---- 4: only regular files inside the checkpoint are read
def test_named_pipes_links_and_devices_are_reported_never_opened(tmp_path):
    path = _checkpoint(str(tmp_path))
    os.mkfifo(os.path.join(path, "extra", "pipe"))
    os.symlink("/dev/zero", os.path.join(path, "zero"))
    os.symlink(str(tmp_path), os.path.join(path, "folder_link"))
    _resign(path, ["extra/pipe", "zero"])
    problems = verify_manifest(path)
    assert any(p.endswith("extra/pipe is a named pipe, not a file: a checkpoint holds only files") for p in problems)
    assert any("zero is a symbolic link, not a file" in p for p in problems)
    assert any("folder_link is a symbolic link, not a file" in p for p in problems)
    assert not any("is missing" in p for p in problems)  # reported once, as what it is
    with pytest.raises(NotRegularFile, match="is a named pipe"):
        build_manifest(path, {"run_id": "r", "step": 1, "written_at": 1.0})


def test_a_manifest_or_latest_that_is_a_named_pipe_does_not_block(tmp_path):
    path = _checkpoint(str(tmp_path), 2)
    os.remove(os.path.join(path, "manifest.json"))
    os.mkfifo(os.path.join(path, "manifest.json"))
    assert "is a named pipe, not a file" in verify_manifest(path)[0]
    assert checkpoint.read_manifest_or_none(path) is None
    os.mkfifo(tmp_path / "latest")
    assert checkpoint.latest_checkpoint(str(tmp_path)) == path  # the highest-step one instead
    os.remove(os.path.join(path, "extra", "rank_00000.json"))
    os.mkfifo(os.path.join(path, "extra", "rank_00000.json"))
    with pytest.raises(checkpoint.CorruptCheckpoint, match="rank_00000.json is a named pipe"):
        checkpoint.read_extra(path)


@pytest.mark.parametrize("entry", ["ok", None, [1], {"bytes": "7", "sha256": "0" * 64}, {"bytes": 7},
                                   {"bytes": -1, "sha256": "0" * 64}, {"bytes": 7, "sha256": 5}])
def test_a_malformed_manifest_entry_is_named(tmp_path, entry):
    path = _checkpoint(str(tmp_path))
    _edit_manifest(path, lambda m: m["files"].update({"__0_0.distcp": entry}))
    with pytest.raises(ValueError, match=r"is damaged \(its entry for '__0_0.distcp' is "):
        read_manifest(path)
    [problem] = verify_manifest(path)
    assert "its entry for '__0_0.distcp'" in problem


def test_a_missing_manifest_is_a_checkpoint_that_cannot_be_verified(tmp_path):
    path = _checkpoint(str(tmp_path))
    os.remove(os.path.join(path, "manifest.json"))
    with pytest.raises(checkpoint.CorruptCheckpoint, match="manifest.json is missing"):
        checkpoint.load_checkpoint(path, model=None)


def test_metadata_may_name_only_files_of_the_manifest(tmp_path):
    """megatron opens the files `.metadata` names: one outside the checkpoint is refused."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    path = _checkpoint(str(tmp_path))
    for name, refused in (("__0_0.distcp", False), ("../../outside", True)):
        info = _StorageInfo(relative_path=name, offset=0, length=1)
        with open(os.path.join(path, ".metadata"), "wb") as f:
            pickle.dump(Metadata(state_dict_metadata={}, storage_data={MetadataIndex("w"): info}), f)
        os.remove(os.path.join(path, "manifest.json"))
        build_manifest(path, {"run_id": "r", "step": 1, "written_at": 1.0})
        if refused:
            with pytest.raises(checkpoint.CorruptCheckpoint, match="names '../../outside' as a file"):
                checkpoint._before_the_load(path, verify=True, check=None)
        else:
            extra, metadata = checkpoint._before_the_load(path, verify=True, check=None)
            assert extra == {"step": 1} and metadata.storage_data


def test_retention_keeps_a_checkpoint_whose_manifest_has_no_usable_step(tmp_path):
    root = str(tmp_path)
    odd = _checkpoint(root, 1)
    _edit_manifest(odd, lambda m: m.update(step="one"))
    for step in (2, 3, 4):
        _checkpoint(root, step)
    retired = checkpoint.retired_checkpoints(root, "r", keep=1)   # was a ValueError, failing the save
    assert retired == [os.path.join(root, "iter_0000002"), os.path.join(root, "iter_0000003")]


# ---- 5: a resume reads every field of the host state only once it is checked
def _host_state():
    return {"step": 2, "policy_version": 2, "run_id": "abc", "rng": rng_state(),
            "state": {"curve": [{"rollout/reward_mean": 0.5, "mismatch/kl_k3": 1e-6}], "before_rl_accuracy": None},
            "config": {"train": {"steps": 2}, "plugins": ["my_rewards"]}, "data": {"kind": "PromptStream"},
            "counters": {"schedule/generate_calls": 2, "rewards/count": 8}}


@pytest.mark.parametrize("edit,named", [
    (lambda s: s.update(step="2"), "step is '2', not a count"),
    (lambda s: s.pop("policy_version"), "policy_version is None"),
    (lambda s: s.update(run_id=7), "run_id is 7"),
    (lambda s: s.update(state=[]), "state is not a mapping"),
    (lambda s: s["state"]["curve"].append({"mismatch/kl_k3": 1.0}), "state.curve[1] is not a point"),
    (lambda s: s["state"].update(before_rl_accuracy="high"), "state.before_rl_accuracy is 'high'"),
    (lambda s: s["rng"].update(torch=[0, 1]), "rng.torch is not the torch generator's state"),
    (lambda s: s["rng"].update(python=[3, [1, 2], None]), "rng.python is not Python's random state"),
    (lambda s: s.update(config={"train": 3}), "config is not a mapping of sections"),
    (lambda s: s["config"].update(plugins="my_rewards"), "config.plugins is not a list of module names"),
    (lambda s: s.update(data="x"), "data is not a mapping"),
    (lambda s: s["counters"].update({"rewards/count": -1}), "counters is not a mapping of names to counts"),
])
def test_host_state_problems_are_named(edit, named):
    state = json.loads(json.dumps(_host_state()))   # as read back from the JSON file
    assert host_state_problem(state) is None
    edit(state)
    assert named in host_state_problem(state)


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


# ---- 10: the files a resume reads back
def test_lines_of_metrics_jsonl_that_are_not_rows_are_named_and_dropped(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "phase": "rl"}, {"step": 2, "phase": "rl"}, {"step": 3, "phase": "rl"}]
    good = [json.dumps(r).encode() + b"\n" for r in rows]
    bad = [b"\xff\xfe\n", b"[1, 2]\n", b'{"step": "2"}\n', b"\n", b'{"step": 2, "ph']
    path.write_bytes(good[0] + bad[0] + bad[1] + good[1] + bad[2] + bad[3] + good[2] + bad[4])
    sink = MetricsSink(str(tmp_path), enabled=True, tensorboard=False)
    assert sink.drop_rows_after(2) == 6   # 4 bad lines, the redone step 3, the last line a crash cut short
    sink.close()
    err = capsys.readouterr().err
    for number, why in ((2, "not UTF-8 text"), (3, "a JSON list, not a row"), (5, "its step is '2', not a number"),
                        (6, "not JSON")):
        assert f"{path}:{number}: {why}" in err
    assert ":8:" not in err   # the cut-short last line is expected after a crash: dropped quietly
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]


def test_cumulative_counters_continue_after_a_resume():
    schedule, rewards = SyncSchedule(None, None), RewardRunner("exact_match")
    schedule.generate_calls, schedule.weight_syncs = 3, 4
    rewards([("p", "a", "a", "t"), ("p", "b", "a", "t")])
    saved = json.loads(json.dumps({**schedule.stats(), **rewards.stats()}))   # the checkpoint's counters
    again, fresh = SyncSchedule(None, None), RewardRunner("exact_match")
    again.load_stats(saved)
    fresh.load_stats(saved)
    assert again.stats() == schedule.stats() and fresh.stats() == rewards.stats()
    fresh([("p", "a", "a", "t")])
    assert fresh.stats()["rewards/count"] == 3


def test_rng_state_round_trips_through_json():
    state = json.loads(json.dumps(rng_state()))
    expected = (torch.rand(3), random.random())
    set_rng_state(state)
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
