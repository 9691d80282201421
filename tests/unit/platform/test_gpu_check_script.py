"""tools/gpu_check.sh, the parts that need no GPU: `--plan` prints which parts run under which
megatron-core with which command lines, and bad settings (PARTS, MCORE, PART_TIMEOUT, no wheels)
stop it at start-up with a message naming the setting. Nothing is installed or run here."""
import os
import shutil
import subprocess

import pytest

from tests.gpu.runs import ROOT

SCRIPT = ROOT / "tools" / "gpu_check.sh"


@pytest.fixture
def whl(tmp_path):
    """A wheel folder laid out as `make gpu-wheels` leaves it (empty files: --plan installs nothing)."""
    for sub in ("mcore-0.16.1", "mcore-0.19.2", "common", "peers"):
        (tmp_path / sub).mkdir()
    (tmp_path / "mcore-0.16.1" / "megatron_core-0.16.1-cp312-cp312-x.whl").touch()
    (tmp_path / "mcore-0.19.2" / "megatron_core-0.19.2-cp312-cp312-x.whl").touch()
    (tmp_path / "common" / "math_verify-0.9.0-py3-none-any.whl").touch()
    (tmp_path / "peers" / "liger_kernel-0.8.5-py3-none-any.whl").touch()
    return tmp_path


def _run(whl, *args, **env):
    base = {k: v for k, v in os.environ.items() if k not in ("MCORE", "PARTS", "PART_TIMEOUT", "PYTEST_ARGS")}
    proc = subprocess.run(["bash", str(SCRIPT), *args], env={**base, "WHL": str(whl), "OUT": "/out", **env},
                          capture_output=True, text=True, timeout=60, check=False)
    return proc.returncode, proc.stdout, proc.stderr


def test_plan_lists_the_default_parts_for_every_version(whl):
    rc, out, err = _run(whl, "--plan")
    assert rc == 0, err
    assert "parts: gpu bench logprobs; megatron-core: 0.16.1 0.19.2" in out
    for v in ("0.16.1", "0.19.2"):
        assert f"/tmp/site-{v}" in out
        assert f"--json /out/rl_step_gpu_\\<date\\>_\\<device\\>_mcore-{v}.json" in out
    assert out.count("tests/gpu -m not\\ vllm") == 2 and "tests/unit" not in out
    assert "install 1 peer wheels into /tmp/site-peers" in out and "--device cuda" in out


def test_plan_follows_mcore_parts_and_extra_pytest_arguments(whl):
    rc, out, err = _run(whl, "--plan", MCORE="0.19.2", PARTS="unit gpu", PART_TIMEOUT="540", PYTEST_ARGS="-x -k demo")
    assert rc == 0, err
    assert "megatron-core: 0.19.2; part time limit: 540s" in out and "0.16.1" not in out
    assert "tests/unit -m not\\ vllm -x -k demo" in out and "tests/gpu -m not\\ vllm -x -k demo" in out
    assert "rl_step_gpu" not in out and "logprobs" not in out


def test_the_log_prob_table_alone_needs_no_megatron_wheels(tmp_path):
    rc, out, err = _run(tmp_path, "--plan", PARTS="logprobs")
    assert rc == 0, err
    assert "megatron-core: none" in out and "install 0 peer wheels" in out


@pytest.mark.parametrize("env, message", [
    ({"PARTS": "gpu tests"}, "PARTS has 'tests'; choose from: unit gpu bench logprobs"),
    ({"MCORE": "0.18.0"}, "MCORE has 0.18.0 but there is no"),
    ({"PART_TIMEOUT": "9m"}, "PART_TIMEOUT='9m' is not a whole number of seconds"),
])
def test_bad_settings_stop_at_start_up_naming_the_setting(whl, env, message):
    rc, out, err = _run(whl, "--plan", **env)
    assert rc == 2 and message in err and out == ""


def test_no_wheels_and_unknown_arguments_stop_at_start_up(whl, tmp_path):
    rc, _, err = _run(tmp_path / "nowhere", "--plan")
    assert rc == 2 and "run 'make gpu-wheels'" in err
    rc, _, err = _run(whl, "--dry-run")
    assert rc == 2 and "unknown argument '--dry-run'" in err


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine would run the check for real")
def test_without_a_gpu_the_check_refuses_to_run(whl):
    rc, _, err = _run(whl)
    assert rc == 2 and "no NVIDIA GPU here" in err
