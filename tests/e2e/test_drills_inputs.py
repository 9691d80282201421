"""Fault drills, third round: untrusted inputs met through `pretrain_rl.py` and the converter as a user
would meet them. Each is refused at start-up, before a model is built (a few seconds a case), in
one line naming the field or the file: exit code 2 for the config, 1 for the content of a file it
names (the convention of tests/e2e/test_drills.py's 10), 2 for the converter's refusals.

Numbers refer to the round's list: 6 rollout.vllm and YAML bounds, 7 secret flags, 8 links in the
run directory and an index naming files outside its folder, 9 an HF folder's values, 11 smaller
ones (a seed past 64 bits, --summary-json's folder, a FIFO for data.jsonl). The breadth of each
is in the unit tests named beside it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.e2e.test_drills import ENV, HANG_GUARD_S, ROOT, run

PRECIOUS = "someone else's file\n"


def _bomb(path):
    """Aliases of aliases under rollout.vllm, 8**7 values once written out: past the bound, and small
    enough that a missed refusal prints tens of MB, not the 13.5 GB of the drill's 1.5 KB file."""
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 8)}]" for i in range(1, 7)]
    path.write_text("rollout:\n  vllm:\n" + "".join(f"    {line}\n" for line in lines))
    return path


def _file(path):
    path.write_text("a file where the summary's folder would be")
    return path


def _fifo(path):
    os.mkfifo(path)
    return path


# case -> (the run's extra arguments, given tmp_path; what the one stderr line names)
START_UP = {
    "6_yaml_alias_bomb": (lambda t: ["--config", str(_bomb(t / "bomb.yaml")), "--print-config"],
                          "the config expands to more than"),
    "6_vllm_under_embedded": (lambda t: ["rollout.vllm={bogus: 1}"], "unknown config key rollout.vllm.bogus"),
    "7_abbreviated_secret_flag": (lambda t: ["rollout.vllm={extra_args: ['--hf_tok=hf_S3CR3T']}"],
                                  "--hf_tok looks like a secret (vLLM reads it as --hf-token)"),
    "11_seed_past_64_bits": (lambda t: ["train.seed=18446744073709551616"],
                             "train.seed=18446744073709551616: must be an integer >= 0 and <= 4294967295"),
    "11_summary_json_folder": (lambda t: ["--summary-json", str(_file(t / "notes") / "summary.json")],
                               f"cannot create its folder {{t}}{os.sep}notes"),
    "11_jsonl_fifo": (lambda t: [f"data.jsonl={_fifo(t / 'p.jsonl')}"], "p.jsonl: is not a regular file (a FIFO"),
}


@pytest.mark.parametrize("case", sorted(START_UP))
def test_refused_at_start_up_in_one_line(tmp_path, case):
    """Unit tests: tests/unit/config/test_input_bounds.py, tests/unit/rollout/test_vllm_secret_flags.py,
    tests/unit/test_pretrain_rl.py."""
    args, names = START_UP[case]
    proc = run(tmp_path / "R", "train.steps=1", *args(tmp_path))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("config error: ") and names.format(t=tmp_path) in line, line
    assert "S3CR3T" not in proc.stdout + proc.stderr and len(proc.stdout) < 10_000
    assert not (tmp_path / "R").exists()   # nothing started


def test_8_a_linked_lock_is_not_followed(tmp_path):
    """run_dir/.lock was opened "a+" and truncated: a link planted there overwrote its target.
    Unit tests: tests/unit/trainer/test_run_dir_links.py."""
    victim = tmp_path / "victim"
    victim.write_text(PRECIOUS)
    (tmp_path / "R").mkdir()
    os.symlink(victim, tmp_path / "R" / ".lock")
    proc = run(tmp_path / "R", "train.steps=1")
    assert proc.returncode == 1, proc.stderr[-2000:]
    [line] = [ln for ln in proc.stderr.splitlines() if ln.startswith("error")]
    assert "cannot take its lock" in line and ".lock is a symbolic link" in line and "traceback" not in line
    assert victim.read_text() == PRECIOUS and os.listdir(tmp_path / "R") == [".lock"]


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A tiny Qwen3 checkpoint with the toy tokenizer's 64-symbol vocabulary."""
    from megatron_rl.model.presets import preset_arch
    from tests.mcore_setup import random_hf_dir

    return random_hf_dir(preset_arch("qwen3", "tiny"), root=str(tmp_path_factory.mktemp("hf")))


def _damaged(src, dest, case):
    """A copy of `src` with one untrusted value: (the folder, what the error line names)."""
    import shutil

    shutil.copytree(src, dest)
    config = json.loads((dest / "config.json").read_text())
    if case == "index_outside":
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        (dest / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
            names[0]: "model.safetensors", names[1]: "/etc/passwd"}}))
        return dest, "weight_map names '/etc/passwd', which is not in"
    key, value = {"negative_layers": ("num_hidden_layers", -3), "zero_heads": ("num_attention_heads", 0)}[case]
    config[key] = value
    (dest / "config.json").write_text(json.dumps(config))
    return dest, f"{dest / 'config.json'}: {key}={value}: must be an integer >= 1"


@pytest.mark.parametrize("case", ["negative_layers", "index_outside"])
def test_9_an_untrusted_hf_folder_is_named_before_a_model_is_built(tmp_path, hf_folder, case):
    """-3 layers was a math domain error, an index naming /etc/passwd opened it. A link planted at the
    error log is not followed either. Unit tests: tests/unit/model/test_hf_inputs.py (with 0 heads,
    a string, a list, and 10**6 layers, which built for minutes and is not rerun here for that reason)."""
    hf, names = _damaged(hf_folder, tmp_path / "hf", case)
    victim = tmp_path / "victim"
    victim.write_text(PRECIOUS)
    (tmp_path / "R").mkdir()
    os.symlink(victim, tmp_path / "R" / "error-rank0.log")
    proc = run(tmp_path / "R", "train.steps=1", f"model.hf_dir={hf}")
    assert proc.returncode == 1, proc.stderr[-2000:]
    [line] = [ln for ln in proc.stderr.splitlines() if ln.startswith("error")]
    assert line.startswith(f"error: model.hf_dir={hf}: ") and names in line, line
    assert "(traceback:" not in line and victim.read_text() == PRECIOUS   # the log's link was not followed


@pytest.mark.parametrize("case", ["zero_heads", "index_outside"])
def test_9_the_converter_refuses_an_untrusted_hf_folder(tmp_path, hf_folder, case):
    hf, names = _damaged(hf_folder, tmp_path / "hf", case)
    proc = subprocess.run([sys.executable, "tools/convert_hf_to_mcore.py", "--hf-dir", str(hf),
                           "--mcore-dir", str(tmp_path / "mcore")], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=HANG_GUARD_S, check=False)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(f"convert_hf_to_mcore.py: error: --hf-dir {hf}: ") and names in line, line
    assert not (tmp_path / "mcore").exists()
