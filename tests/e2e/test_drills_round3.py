"""Fault drills, third round: checkpoint faults met through `pretrain_rl.py` as a user meets them.

Numbers are the review's: 2 a disk that fills during a save, 3 a checkpoint writer that dies,
4 a checkpoint that cannot be verified (a named pipe or a device link in its manifest, a deleted
manifest, a malformed entry), 5 a dtype change on resume, 10 the files a resume reads back
(metrics.jsonl's lines, the cumulative counters). The runs are test_drills.py's tiny config; the
tests that resume share one finished 2-step run (copied before anything is changed). Faults are
triggered by events (a writer process appears), never by timers.

A full disk is a per-process file-size limit in the child (RLIMIT_FSIZE, set between fork and
exec, with SIGXFSZ ignored so that the write fails instead of killing the process): every write
past 1 MiB fails with EFBIG, the way a full disk makes it fail with ENOSPC, deterministically and
without a filesystem to fill. The checkpoint's shards are about 6 MiB; everything else the run
writes is far below the limit.
"""
from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess

import psutil
import pytest

from tests.e2e.test_drills import (
    ENV,
    FORKED_WRITERS,
    HANG_GUARD_S,
    ROOT,
    cmd,
    copy_of,
    metric_steps,
    ok,
    run,
    wait_for,
    wait_gone,
)

FILE_LIMIT = 1 << 20


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """test_drills.py's: a completed 2-step run with a checkpoint after each step, shared by the
    resume tests (each changes a copy)."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    ok(run(run_dir, "train.steps=2", "train.save_every=1"))
    return run_dir


def _one_error_line(proc) -> str:
    """The failed run's one line on stderr; no traceback there (it is in error-rank0.log)."""
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "[rank0]" not in proc.stderr, proc.stderr[-3000:]
    [line] = [ln for ln in proc.stderr.splitlines() if ln.startswith("error")]
    return line


# ---- 2: a disk that fills during a save
def _small_files_only():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT, FILE_LIMIT))


@pytest.mark.mcore_api   # megatron-core's writers: processes (0.16), threads (0.19)
def test_2_a_save_that_cannot_write_is_one_line_and_its_folder_is_removed_on_the_rerun(tmp_path):
    r = tmp_path / "R"
    proc = subprocess.run(cmd(r, "train.steps=1"), cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=HANG_GUARD_S, check=False, preexec_fn=_small_files_only)
    partial = r / "checkpoints" / "iter_0000001.tmp"
    line = _one_error_line(proc)
    assert f"cannot save the checkpoint of step 1 to {r / 'checkpoints' / 'iter_0000001'}: writing {partial}" in line
    assert "no checkpoint was saved" in line and f"(traceback: {r / 'error-rank0.log'})" in line
    assert "Traceback" in (r / "error-rank0.log").read_text()
    assert partial.is_dir()  # named in the message: it holds the space
    # the rerun (the disk freed) removes it before it checks for room, and never carries it to previous/
    rerun = ok(run(r, "train.steps=1", "train.resume=true"))
    assert f"removed {partial}: a save that a crash or a failed write cut short" in rerun.stdout
    assert [p for p, _, _ in os.walk(r) if p.endswith(".tmp")] == []
    assert (r / "checkpoints" / "latest").read_text() == "iter_0000001"


# ---- 3: a checkpoint writer process that dies (the OOM killer) fails the save instead of hanging the run
@FORKED_WRITERS
def test_3_a_dead_checkpoint_writer_fails_the_save_and_the_run_names_the_newest_checkpoint(tmp_path):
    r = tmp_path / "R"
    proc = subprocess.Popen(cmd(r, "train.steps=200", "train.save_every=1"), cwd=ROOT, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    killed: list[int] = []
    try:
        # from the first save on, megatron's results-queue helper exists (spawned: it has the
        # trainer's command line only until it execs), so a child with the trainer's command line
        # is a forked writer: each is SIGKILLed on sight, as the OOM killer would. One killed after
        # it reported changes nothing (that save succeeds), so the next save's are killed too.
        wait_for(lambda: (r / "checkpoints" / "latest").exists(), "the first save", proc)
        trainer = psutil.Process(proc.pid)

        def kill_the_writers() -> bool:
            if proc.poll() is not None:
                return True
            for c in trainer.children():
                try:
                    if c.cmdline() == trainer.cmdline():
                        c.kill()
                        killed.append(c.pid)
                except psutil.NoSuchProcess:
                    pass
            return False

        wait_for(kill_the_writers, "the run to fail its save (a dead writer hung it)")
        err = proc.stderr.read()
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert killed
    line = _one_error_line(subprocess.CompletedProcess(proc.args, proc.returncode, "", err))
    assert "was killed by SIGKILL" in line and "the checkpoint writer process" in line, line
    saved = int((r / "checkpoints" / "latest").read_text().split("_")[1])
    assert f"the newest checkpoint is {r / 'checkpoints' / f'iter_{saved:07d}'}: rerun with train.resume=true" in line
    wait_gone(killed)


# ---- 4: a checkpoint that cannot be verified is set aside, and the resume falls back
def _resign(ckpt, fake: list[str]):
    """Rewrite `ckpt`'s manifest as an attacker would (the sha256 list has no key), listing
    `fake` (not regular files) beside the real files."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    files = [p for p in ckpt.rglob("*") if p.is_file() and not p.is_symlink() and p.name != "manifest.json"]
    manifest["files"] = {str(p.relative_to(ckpt)): {"bytes": p.stat().st_size,
                                                    "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
                         for p in files}
    manifest["files"].update({rel: {"bytes": 0, "sha256": "0" * 64} for rel in fake})
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def test_4_unverifiable_checkpoints_are_set_aside_and_only_regular_files_are_read(finished_run, tmp_path):
    r = copy_of(finished_run, tmp_path)
    ckpts = r / "checkpoints"
    for step in (3, 4):
        shutil.copytree(ckpts / "iter_0000002", ckpts / f"iter_{step:07d}")
    (ckpts / "iter_0000004" / "manifest.json").unlink()                      # deleted
    manifest = json.loads((ckpts / "iter_0000003" / "manifest.json").read_text())
    manifest["files"]["common.pt"] = "ok"                                     # a malformed entry
    (ckpts / "iter_0000003" / "manifest.json").write_text(json.dumps(manifest))
    os.mkfifo(ckpts / "iter_0000002" / "extra" / "notes")                     # a named pipe: opening it blocks
    os.symlink("/dev/zero", ckpts / "iter_0000002" / "zero")                  # a device: reading it never ends
    _resign(ckpts / "iter_0000002", ["extra/notes", "zero"])
    (ckpts / "latest").unlink()
    os.mkfifo(ckpts / "latest")                                               # the marker, a named pipe too
    proc = ok(run(r, "train.steps=1", "train.resume=true"))
    assert f"{ckpts / 'iter_0000004' / 'manifest.json'} is missing" in proc.stderr
    assert f"{ckpts / 'iter_0000003' / 'manifest.json'} is damaged (its entry for 'common.pt'" in proc.stderr
    assert f"{ckpts / 'iter_0000002' / 'extra' / 'notes'} is a named pipe, not a file" in proc.stderr
    assert f"{ckpts / 'iter_0000002' / 'zero'} is a symbolic link, not a file" in proc.stderr
    assert f"resumed from {ckpts / 'iter_0000001'} at step 1" in proc.stdout
    assert sorted(os.listdir(ckpts)) == ["iter_0000001", "iter_0000002.corrupt", "iter_0000003.corrupt",
                                         "iter_0000004.corrupt", "latest"]


# ---- 5: a resume under another dtype is refused by name, before the checkpoint is loaded
@pytest.mark.parametrize("override,named", [("model.dtype=fp16", "model.dtype: 'fp32' -> 'fp16'"),
                                            ("precision.recipe=bf16", "precision.recipe: None -> 'bf16'")])
def test_5_a_dtype_change_on_resume_is_refused_naming_the_field(finished_run, tmp_path, override, named):
    r = copy_of(finished_run, tmp_path)
    line = _one_error_line(run(r, "train.steps=3", "train.resume=true", override))
    assert named in line and "KeyError" not in line, line
    assert sorted(os.listdir(r / "checkpoints")) == ["iter_0000001", "iter_0000002", "latest"]
    assert metric_steps(r) == [1, 2]


# ---- 10: a resume reads metrics.jsonl's bad lines without stopping, and continues the counters
def test_10_bad_metrics_lines_are_named_and_the_resumed_run_repeats_the_uninterrupted_one(finished_run, tmp_path):
    r = copy_of(finished_run, tmp_path)
    shutil.rmtree(r / "checkpoints" / "iter_0000002")  # resume from step 1: step 2 is trained again
    metrics = r / "metrics.jsonl"
    rows = metrics.read_bytes().splitlines(keepends=True)
    bad = [b"\xff\xfe not UTF-8\n", b"[1, 2]\n", b'{"step": "2", "phase": "rl"}\n']
    metrics.write_bytes(b"".join(rows[:1] + bad + rows[1:]))
    proc = ok(run(r, "train.steps=2", "train.resume=true"))
    for number, why in ((2, "not UTF-8 text"), (3, "a JSON list, not a row (an object)"), (4, "its step is '2', not a number")):
        assert f"{metrics}:{number}: {why}; dropped that line" in proc.stderr, proc.stderr[-2000:]
    with open(finished_run / "metrics.jsonl") as f:
        uninterrupted = [json.loads(line) for line in f]
    with open(metrics) as f:
        resumed = [json.loads(line) for line in f]
    assert [row["step"] for row in resumed] == [1, 2]
    for key, value in uninterrupted[1].items():   # step 2: the counters continue, everything is bit-exact
        if key != "time" and not key.startswith("timing/"):
            assert resumed[1][key] == value, key
    assert resumed[1]["rewards/count"] > 0 and resumed[1]["schedule/weight_syncs"] == 2
