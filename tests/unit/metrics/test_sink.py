"""The metrics sink on a resume: metrics.jsonl drops the redone steps' rows, TensorBoard hides the
interrupted run's points of those steps (a purge step) and keeps the SFT warm start's curve."""
import json
import os
import time
from types import SimpleNamespace

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.summary.writer import event_file_writer

from megatron_rl.metrics.sink import MetricsSink


def _scalars(log_dir: str, tag: str) -> list[tuple[int, float]]:
    acc = EventAccumulator(log_dir, purge_orphaned_data=True)   # TensorBoard's own reading
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_a_resume_replaces_the_redone_steps_everywhere(tmp_path, monkeypatch):
    run = str(tmp_path)
    sink = MetricsSink(run, enabled=True)
    for step in range(1, 11):
        sink.log(step, {"sft/nll": 1.0 / step}, phase="sft")
    for step in range(1, 5):
        sink.log(step, {"rollout/reward_mean": float(step)})
    sink.close()   # the run dies after step 4; its checkpoint holds step 2

    # A resume is a later process: its event files sort after the first run's by their time stamp.
    # In one process within one second they would sort by a writer counter that is not zero-padded
    # (file 10 before file 7), so the resumed run's files get a later stamp, as they would for real.
    later = time.time() + 100
    monkeypatch.setattr(event_file_writer, "time", SimpleNamespace(time=lambda: later))
    resumed = MetricsSink(run, enabled=True)
    assert resumed.drop_rows_after(2) == 2
    for step in (3, 4):
        resumed.log(step, {"rollout/reward_mean": 10.0 * step})
    resumed.close()

    with open(os.path.join(run, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [(r["step"], r["rollout/reward_mean"]) for r in rows if r["phase"] == "rl"] == [
        (1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    tb = os.path.join(run, "tensorboard")
    assert _scalars(tb, "rollout/reward_mean") == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    assert [s for s, _ in _scalars(os.path.join(tb, "sft"), "sft/nll")] == list(range(1, 11))


def test_sync_puts_the_rows_on_disk(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd)))
    sink = MetricsSink(str(tmp_path), enabled=True, tensorboard=False)
    sink.log(1, {"x": 1.0})
    sink.sync()
    assert synced == [str(tmp_path / "metrics.jsonl")]
    sink.close()
