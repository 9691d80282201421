"""Fault drills: each defect a reliability review found, reproduced through `pretrain_rl.py` as a
user would meet it, and what must happen now. Faults are triggered by events (a checkpoint
directory appears, a metrics row is written), never by timers; deadlines only guard hangs.

Numbers refer to the review's list: 1 retention, 2 no unpickling, 4 corrupt bytes, 5 unwritable
checkpoints, 6 children reaped on SIGTERM / SIGKILL, 7 metrics rows on resume, 8 prompt length,
9 config values, 10 clear errors, 12 progress bars in a log file, 13 resuming under another config, 14 two runs in one run_dir. (3, the vLLM server's key,
and 11, fault tests without timers, live in tests/vllm.)
"""
from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from tests.e2e.runner import ENV, HANG_GUARD_S, run_pretrain

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BASE = ["--config", "examples/demo_cpu.yaml", "sft.steps=0", "rollout.prompts_per_step=2",
        "rollout.group_size=2", "train.micro_batch_size=2", "train.num_minibatches=1", "train.eval_size=4",
        "log.tensorboard=false"]


def _writers_are_processes() -> bool:
    """megatron-core 0.16 forks a writer process per checkpoint file; 0.19 writes with threads."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    return hasattr(FileSystemWriterAsync, "write_preloaded_data_multiproc")


FORKED_WRITERS = pytest.mark.skipif(not _writers_are_processes(), reason="this megatron-core writes checkpoints "
                                    "with threads: there is no writer process to freeze or kill")


def cmd(run_dir, *overrides):
    return [sys.executable, "pretrain_rl.py", *BASE, f"train.run_dir={run_dir}", *overrides]


def run(run_dir, *overrides) -> subprocess.CompletedProcess:
    """`python pretrain_rl.py BASE train.run_dir=... OVERRIDES` as a kept worker runs it (tests/e2e/runner.py:
    the exit code, stdout and stderr a new process would give, without its 11 s of imports)."""
    return run_pretrain(cmd(run_dir, *overrides)[2:], ENV, HANG_GUARD_S)


def run_process(run_dir, *overrides, **popen) -> subprocess.CompletedProcess:
    """The same in a new `python pretrain_rl.py` process, for what only a process shows."""
    return subprocess.run(cmd(run_dir, *overrides), cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=HANG_GUARD_S, check=False, **popen)


def ok(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_the_kept_worker_answers_as_the_process_would(tmp_path):
    """run() (tests/e2e/runner.py) against `python pretrain_rl.py`: the same exit code and output."""
    for override in ("train.steps=-1", "data.tasks=[sortin]"):
        kept, process = run(tmp_path / "R", override), run_process(tmp_path / "R", override)
        assert process.returncode == 2 and not (tmp_path / "R").exists()
        assert (kept.returncode, kept.stdout, kept.stderr) == (process.returncode, process.stdout, process.stderr)


def metric_steps(run_dir) -> list[int]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["step"] for line in f if json.loads(line).get("phase") == "rl"]


def wait_for(predicate, what: str, proc: subprocess.Popen | None = None):
    """Until predicate(); fails at once, naming its exit code, when `proc` (the trainer the wait is
    about) has ended meanwhile: a broken run fails its test rather than waiting out the hang guard."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not predicate():
        assert proc is None or proc.poll() is None, f"the trainer exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"hang guard: still waiting for {what}"
        time.sleep(0.005)


def wait_gone(pids: list[int]):
    procs = [psutil.Process(p) for p in pids if psutil.pid_exists(p)]
    _, alive = psutil.wait_procs(procs, timeout=60)
    assert not alive, f"left running: {[(p.pid, p.cmdline()[:3]) for p in alive]}"


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A completed 2-step run with a checkpoint after each step (copied by the tests that damage it)."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    proc = ok(run(run_dir, "train.steps=2", "train.save_every=1"))
    assert "wall time" in proc.stdout and "TensorBoard" not in proc.stdout  # log.tensorboard=false: none to show
    return run_dir


def copy_of(finished_run, tmp_path):
    dest = tmp_path / "run"
    shutil.copytree(finished_run, dest)
    return dest


# ---- 1: a fresh run in a used run_dir never deletes its own newest checkpoint
def test_1_fresh_run_in_used_run_dir_keeps_its_checkpoints(tmp_path):
    r = tmp_path / "R"
    ok(run(r, "train.steps=4", "train.save_every=1"))
    second = ok(run(r, "train.steps=2", "train.save_every=1"))
    assert "moved the earlier run's checkpoints" in second.stdout
    ckpts = r / "checkpoints"
    assert (ckpts / "latest").read_text() == "iter_0000002" and (ckpts / "iter_0000002").is_dir()
    [previous] = os.listdir(r / "previous")
    assert sorted(os.listdir(r / "previous" / previous / "checkpoints")) == ["iter_0000003", "iter_0000004", "latest"]
    third = ok(run(r, "train.steps=3", "train.resume=true"))
    assert "at step 2" in third.stdout
    assert (ckpts / "latest").read_text() == "iter_0000003"
    # a fresh start that fails before its first step (here: a vLLM interpreter that does not exist)
    # leaves the run where a resume finds it: nothing is moved before the model and engine exist
    failed = run(r, "train.steps=3", "train.resume=false", "rollout.backend=vllm", "rollout.vllm={python: /nope/python}")
    assert failed.returncode != 0 and "moved the earlier run" not in failed.stdout, failed.stderr[-2000:]
    assert (ckpts / "latest").read_text() == "iter_0000003" and len(os.listdir(r / "previous")) == 1


# ---- 2: resuming never unpickles what is in the checkpoint
class Payload:
    """Creates `marker` if it is ever unpickled."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _republish(r, latest):
    """Rewrite a tampered checkpoint's manifest as an attacker would (the sha256 list has no key)."""
    from megatron_rl.trainer.manifest import build_manifest

    run_id = json.loads((r / "checkpoints" / "iter_0000001" / "manifest.json").read_text())["run_id"]
    os.remove(latest / "manifest.json")
    build_manifest(str(latest), {"run_id": run_id, "step": 2, "written_at": time.time()})


def test_2_crafted_pickles_in_a_checkpoint_do_not_run(finished_run, tmp_path):
    r = copy_of(finished_run, tmp_path)
    marker = tmp_path / "pwned"
    latest = r / "checkpoints" / "iter_0000002"
    (latest / "extra" / "rank_00000.pt").write_bytes(pickle.dumps({"step": 2, "x": Payload(marker)}))
    (latest / "common.pt").write_bytes(pickle.dumps(Payload(marker)))
    _republish(r, latest)
    proc = run(r, "train.steps=3", "train.resume=true")
    assert not marker.exists(), "code from the checkpoint ran"
    assert proc.returncode == 1 and "iter_0000002" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("where", ["metadata", "byte_item"])
def test_2_crafted_pickles_in_megatrons_files_do_not_run(finished_run, tmp_path, where):
    """megatron-core's reader unpickles `.metadata` with plain pickle and its byte items (each
    layer's `_extra_state`) with torch.load(weights_only=False): a payload in either must not run."""
    import dataclasses

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    r = copy_of(finished_run, tmp_path)
    marker = tmp_path / "pwned"
    latest = r / "checkpoints" / "iter_0000002"
    with open(latest / ".metadata", "rb") as f:
        md = pickle.load(f)  # the run's own file
    if where == "metadata":
        md.planner_data = Payload(marker)
    else:  # point one byte item at a torch.save'd payload appended to its shard file
        key = next(k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))
        info = md.storage_data[MetadataIndex(key)]
        shard = latest / info.relative_path
        buf = io.BytesIO()
        torch.save(Payload(marker), buf)
        md.storage_data[MetadataIndex(key)] = dataclasses.replace(info, offset=shard.stat().st_size,
                                                                  length=len(buf.getvalue()))
        with open(shard, "ab") as f:
            f.write(buf.getvalue())
    (latest / ".metadata").write_bytes(pickle.dumps(md))
    _republish(r, latest)
    proc = run(r, "train.steps=3", "train.resume=true")
    assert not marker.exists(), "code from the checkpoint ran"
    assert proc.returncode == 1 and "iter_0000002" in proc.stderr, proc.stderr[-2000:]
    assert (".metadata is refused" if where == "metadata" else "refused because loading it could run code") \
        in proc.stderr, proc.stderr[-2000:]


# ---- 13: a resume under a config that changes what the remaining steps compute is refused
def test_13_resume_refuses_a_changed_config_unless_allowed(finished_run, tmp_path):
    r = copy_of(finished_run, tmp_path)
    refused = run(r, "train.steps=3", "train.resume=true", "loss.recipe=minirl", "train.save_every=1")
    assert refused.returncode != 0 and "loss.recipe: 'grpo' -> 'minirl'" in refused.stderr, refused.stderr[-2000:]
    assert sorted(os.listdir(r / "checkpoints")) == ["iter_0000001", "iter_0000002", "latest"]  # nothing ran
    assert metric_steps(r) == [1, 2]
    ok(run(r, "train.steps=3", "train.resume=true", "loss.recipe=minirl", "train.allow_config_change=true"))
    assert metric_steps(r) == [1, 2, 3]


def test_13_resume_and_warm_start_refuse_another_tokenizer(tmp_path):
    """The same data.tokenizer setting can name edited files: a checkpoint records its tokenizer's
    fingerprint, and a resume or a warm start from it under other token ids is refused."""
    from tests.unit.data.test_hf_tokenizer import write_tokenizer

    folder = write_tokenizer(tmp_path / "tok")
    r = tmp_path / "run"
    ok(run(r, "train.steps=1", f"data.tokenizer={folder}"))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))   # one more end token
    refused = run(r, "train.steps=2", "train.resume=true", f"data.tokenizer={folder}")
    assert refused.returncode != 0 and "train.resume:" in refused.stderr, refused.stderr[-2000:]
    assert "was trained with another tokenizer" in refused.stderr and metric_steps(r) == [1]
    warm = run(tmp_path / "warm", "train.steps=1", f"data.tokenizer={folder}",
               f"train.init_checkpoint={r / 'checkpoints' / 'iter_0000001'}")
    assert warm.returncode != 0 and "train.init_checkpoint:" in warm.stderr, warm.stderr[-2000:]
    assert "was trained with another tokenizer" in warm.stderr
    ok(run(r, "train.steps=2", "train.resume=true", f"data.tokenizer={folder}", "train.allow_config_change=true"))
    assert metric_steps(r) == [1, 2]


# ---- 4: flipped bits are found; the run falls back to the last good checkpoint, deleting nothing
def test_4_corrupt_bytes_fall_back_to_the_previous_good_checkpoint(finished_run, tmp_path):
    r = copy_of(finished_run, tmp_path)
    ckpts = r / "checkpoints"
    weights = ckpts / "iter_0000002" / "__0_0.distcp"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x04
    weights.write_bytes(bytes(data))
    proc = ok(run(r, "train.steps=3", "train.resume=true", "train.save_every=1"))
    assert "__0_0.distcp does not match its sha256" in proc.stderr
    assert "resumed from" in proc.stdout and "iter_0000001 at step 1" in proc.stdout
    # the damaged one is kept aside; step 1 went only once two newer good checkpoints existed
    assert sorted(os.listdir(ckpts)) == ["iter_0000002", "iter_0000002.corrupt", "iter_0000003", "latest"]
    assert (ckpts / "latest").read_text() == "iter_0000003"
    assert metric_steps(r) == [1, 2, 3]  # the redone step 2 is logged once


def test_4_an_unreadable_manifest_falls_back_too(finished_run, tmp_path):
    """Even when the newest checkpoint's manifest itself is cut short (its run id unreadable)."""
    r = copy_of(finished_run, tmp_path)
    manifest = r / "checkpoints" / "iter_0000002" / "manifest.json"
    manifest.write_text(manifest.read_text()[:40])
    proc = ok(run(r, "train.steps=3", "train.resume=true"))
    assert "manifest.json is damaged" in proc.stderr and "iter_0000001 at step 1" in proc.stdout


# ---- 5: an unwritable checkpoint directory stops the run before any step
def test_5_unwritable_checkpoints_fail_at_start_up(tmp_path):
    r = tmp_path / "R"
    r.mkdir()
    (r / "checkpoints").write_text("a file where the checkpoint directory should be")
    proc = run(r, "train.steps=2", "train.save_every=0")
    assert proc.returncode == 1
    assert f"cannot write checkpoints to {r / 'checkpoints'}" in proc.stderr and "Traceback" not in proc.stderr
    assert not (r / "metrics.jsonl").exists() or metric_steps(r) == []


# ---- 6 + 7 (+ 14): SIGKILL while a checkpoint is being written: no process left, no row logged twice,
#      the partial save removed on resume; meanwhile a second launch into the same run_dir is refused,
#      and the SIGKILL frees the directory
def test_6_7_sigkill_mid_save_leaves_no_process_and_no_duplicate_rows(tmp_path):
    r = tmp_path / "R"
    proc = subprocess.Popen(cmd(r, "train.steps=200", "train.save_every=1"), cwd=ROOT, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        caught = None
        for k in range(2, 40):  # freeze it inside the save of step k (tmp dir present, not yet published)
            tmp, final = r / "checkpoints" / f"iter_{k:07d}.tmp", r / "checkpoints" / f"iter_{k:07d}"
            wait_for(lambda tmp=tmp, final=final: tmp.exists() or final.exists(), f"the save of step {k}", proc)
            os.kill(proc.pid, signal.SIGSTOP)
            if not final.exists():
                caught = k
                break
            os.kill(proc.pid, signal.SIGCONT)
        assert caught is not None, "never caught a save in flight"
        # 14: a second launch into the directory the (frozen) run holds is refused, touching nothing,
        # not even the running run's error log
        (r / "error-rank0.log").write_text("the running run's")
        intruder = run(r, "train.steps=2")
        assert intruder.returncode == 1 and "is in use by another run (pid" in intruder.stderr, intruder.stderr[-2000:]
        assert (r / "error-rank0.log").read_text() == "the running run's" and "traceback:" not in intruder.stderr
        assert (r / "checkpoints" / f"iter_{caught - 1:07d}").is_dir() and not (r / "previous").exists()
        children = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        assert children, "expected megatron's checkpoint writer helper"
        proc.kill()
        proc.wait()
        wait_gone(children)
    finally:
        if proc.poll() is None:
            proc.kill()
    partial = r / "checkpoints" / f"iter_{caught:07d}.tmp"
    assert partial.is_dir()
    resumed = ok(run(r, f"train.steps={caught + 1}", "train.resume=true", "train.save_every=0"))
    assert f"at step {caught - 1}" in resumed.stdout
    assert metric_steps(r) == list(range(1, caught + 2))
    assert f"removed {partial}" in resumed.stdout and not partial.exists()  # not left to fill the disk


def test_6_sigterm_finishes_the_step_saves_and_reaps(tmp_path):
    r = tmp_path / "R"
    proc = subprocess.Popen(cmd(r, "train.steps=200", "train.save_every=1000"), cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: (r / "metrics.jsonl").exists() and metric_steps(r), "the first step", proc)
    children = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "stopped by SIGTERM after step" in err and "rerun with train.resume=true" in err
    wait_gone(children)
    saved = int((r / "checkpoints" / "latest").read_text().split("_")[1])
    assert saved == metric_steps(r)[-1]  # the checkpoint holds every logged step
    resumed = ok(run(r, f"train.steps={saved + 1}", "train.resume=true"))
    assert f"at step {saved}" in resumed.stdout


def test_6_sigterm_to_the_whole_job_still_saves(tmp_path):
    """SLURM (time limit, scancel, preemption), systemd and `timeout` signal every process of the
    job. megatron's checkpoint-writer helper, made at the first save, died of it and the stop-save
    then failed on a broken pipe: every step since the last periodic save was lost."""
    r = tmp_path / "R"
    proc = subprocess.Popen(cmd(r, "train.steps=200", "train.save_every=2"), cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    wait_for(lambda: (r / "checkpoints" / "latest").exists(), "the first periodic save (the helper exists)", proc)
    helpers = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "stopped by SIGTERM after step" in err and "Broken pipe" not in err
    wait_gone(helpers)
    saved = int((r / "checkpoints" / "latest").read_text().split("_")[1])
    assert saved == metric_steps(r)[-1]


@FORKED_WRITERS
def test_7_a_writer_of_a_killed_trainer_dies_and_frees_the_run_dir(tmp_path):
    """megatron forks writer workers for each save. One whose trainer was SIGKILLed mid-save waited
    forever on the dead trainer's queue, holding the run directory's lock (inherited at fork):
    every resume was refused. Freeze a writer mid-save, kill the trainer: the writer must die with
    it and the lock must be free the moment the trainer is gone."""
    import fcntl

    r = tmp_path / "R"
    lock = str(r / ".lock")
    proc = subprocess.Popen(cmd(r, "train.steps=400", "train.save_every=1"), cwd=ROOT, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    frozen: list[psutil.Process] = []
    try:
        # after the first save the writer's helper exists (spawned: a child with this command line
        # only until it execs), so from then on a child with the trainer's command line is a fork
        wait_for(lambda: (r / "checkpoints" / "latest").exists(), "the first save", proc)
        trainer = psutil.Process(proc.pid)

        def freeze_a_writer() -> bool:
            for c in trainer.children():
                try:
                    if c.cmdline() != trainer.cmdline():
                        continue
                    c.suspend()
                    # a child is past its fork hook (death signal set, lock closed) once the lock is
                    # gone from its files; one frozen inside the hook is let go (however many: under
                    # load many are caught there). A hook that never closes the lock leaves no
                    # writer to find, and the wait below fails naming that.
                    if lock in [f.path for f in c.open_files()]:
                        c.resume()
                        continue
                    frozen.append(c)
                    return True
                except psutil.NoSuchProcess:
                    pass
            return False

        wait_for(freeze_a_writer, "a forked checkpoint writer that has closed the run directory's lock")
        writer = frozen[-1]
        proc.kill()
        proc.wait()
        def lock_is_free() -> bool:
            # the frozen writer closed its copy at fork; another child caught between its fork and
            # that hook dies of its death signal a moment after the trainer: the lock frees then
            with open(lock, "a+") as f:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return False
                fcntl.flock(f, fcntl.LOCK_UN)
                return True

        wait_for(lock_is_free, "the run directory's lock, held after the trainer died")
        wait_gone([writer.pid])   # and the frozen writer died with the trainer, frozen as it was
    finally:
        if proc.poll() is None:
            proc.kill()
        for w in frozen:   # a failed check must not leave a frozen process behind
            if w.is_running():
                w.kill()
    ok(run(r, "train.steps=1", "train.resume=true", "train.allow_config_change=true"))


# ---- 8: a model vocabulary the tokenizer lacks is refused at start-up
def test_8_a_vocabulary_the_tokenizer_lacks_is_refused_at_start_up(tmp_path):
    """A model whose vocabulary is not the tokenizer's would sample ids no prompt or reward knows
    (it failed in the first evaluation, after SFT): refused before anything is built."""
    proc = run(tmp_path / "R", "train.steps=1", "model.overrides={vocab_size: 128}")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "model.overrides: vocab_size=128, but data.tokenizer=char is the 64-symbol" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="refused only where there is no CUDA")
def test_8_an_engine_device_this_machine_lacks_is_refused_at_start_up(tmp_path):
    proc = run(tmp_path / "R", "train.steps=1", "rollout.device=cuda")
    assert proc.returncode == 1 and "rollout.device=cuda: this machine has no CUDA" in proc.stderr, proc.stderr[-2000:]


def test_8_expert_parallelism_of_a_dense_model_is_refused_at_start_up(tmp_path):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = subprocess.run(launcher + cmd(tmp_path / "R", "train.steps=1", "model.arch=qwen3",
                                         "--expert-model-parallel-size", "2")[1:],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=HANG_GUARD_S, check=False)
    assert proc.returncode != 0 and "splits experts, and model qwen3 has none" in proc.stderr, proc.stderr[-2000:]


# ---- 8: prompts longer than the model takes are refused (or skipped) at start-up, never OOM
@pytest.mark.parametrize("length", [301, 50_000])
def test_8_overlong_jsonl_prompt_is_refused_at_start_up(tmp_path, length):
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": "1+2=", "label": "3"}) + "\n" +
                    json.dumps({"prompt": "1" * length, "label": "1"}) + "\n")
    proc = run(tmp_path / "R", f"data.jsonl={data}", "train.steps=1")
    assert proc.returncode == 1 and f"{data}:2: the prompt is too long" in proc.stderr, proc.stderr[-2000:]
    assert "data.overlong_prompts=skip" in proc.stderr


def test_8_overlong_prompts_can_be_skipped_with_a_count(tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "label": "3"}) + "\n" for p in ("1+2=", "2+1=", "1" * 301)))
    proc = ok(run(tmp_path / "R", f"data.jsonl={data}", "data.overlong_prompts=skip", "train.steps=1"))
    assert "dropped 1 prompt(s)" in proc.stdout


# ---- 9: every bad value is a start-up error naming the field (exit 2, before a model is built)
@pytest.mark.parametrize("override,field", [
    ("train.steps=-1", "train.steps"), ("train.eval_every=-2", "train.eval_every"),
    ("sft.eval_every=-1", "sft.eval_every"), ("train.micro_batch_size=0", "train.micro_batch_size"),
    ("train.steps=2.5", "train.steps"), ("rollout.top_p=1.5", "rollout.top_p"), ("rollout.top_k=0", "rollout.top_k"),
    ("rollout.temperature=-1", "rollout.temperature"), ("train.micro_batch_size=3", "train.micro_batch_size"),
    ("train.num_minibatches=3", "train.num_minibatches"), ("data.tasks=[sortin]", "data.tasks[0]"),
])
def test_9_bad_config_values_fail_at_start_up(tmp_path, override, field):
    proc = run(tmp_path / "R", override)
    assert proc.returncode == 2 and field in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "R").exists()  # nothing started


def test_9_zero_eval_every_means_only_before_and_after(tmp_path):
    proc = ok(run(tmp_path / "R", "train.steps=2", "train.eval_every=0", "sft.eval_every=0", "sft.steps=1",
                  "sft.batch_size=2"))
    assert "held-out accuracy, greedy: before -> after RL" in proc.stdout


# ---- 10: damaged files are named, in one line
def test_10_corrupt_hf_config_is_named_in_one_line(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "qwen3", "hidden_si')
    proc = run(tmp_path / "R", f"model.hf_dir={hf}", "train.steps=1")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    [line] = [ln for ln in proc.stderr.splitlines() if ln.startswith("error")]
    assert str(hf / "config.json") in line and "error-rank0.log" in line
    assert "Traceback" in (tmp_path / "R" / "error-rank0.log").read_text()


@pytest.mark.mcore_api   # the file megatron-core writes the non-sharded state to
def test_10_zeroed_checkpoint_file_is_named(finished_run, tmp_path):
    r = copy_of(finished_run, tmp_path)
    folder = r / "checkpoints" / "iter_0000002"
    # megatron-core 0.16 writes the non-sharded state to common.pt, 0.19 into the shard
    target = folder / "common.pt" if (folder / "common.pt").exists() else folder / "__0_0.distcp"
    target.write_bytes(b"\0" * target.stat().st_size)
    proc = run(tmp_path / "R2", f"train.init_checkpoint={r / 'checkpoints' / 'iter_0000002'}", "train.steps=1")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert str(target) in proc.stderr and "weights_only=False" not in proc.stderr


def test_10_truncated_jsonl_says_so(tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": "1+2=", "label": "3"}) + "\n" + '{"prompt": "2+')
    proc = run(tmp_path / "R", f"data.jsonl={data}", "train.steps=1")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    [line] = [ln for ln in proc.stderr.splitlines() if ln.startswith("error")]
    assert f"{data}:2" in line and "is the file truncated?" in line


# ---- 12: a log file gets step lines, not carriage-return redraws
def test_12_no_progress_bar_redraws_in_a_log_file(tmp_path):
    proc = ok(run(tmp_path / "R", "train.steps=2", "sft.steps=2", "sft.batch_size=2", "sft.eval_every=1"))
    assert "\r" not in proc.stdout + proc.stderr
    assert "step 2 " in proc.stdout and "SFT step 2" in proc.stdout
