"""tools/gpu_check.sh without a GPU: `--plan` prints which parts (and GPU test groups) run under which
megatron-core with which command lines; the GPU_TESTS groups select every test of tests/gpu exactly
once; bad settings (PARTS, GPU_TESTS, MCORE, PART_TIMEOUT, BUDGET, no wheels) stop it at start-up with
a message naming the setting. And its control flow, with stand-ins for nvidia-smi and Python: a part
stopped at its time limit gets SIGINT (so pytest prints its summary), the next part and the summary
still run, BUDGET skips what would not fit, and an install is kept for the next call."""
import os
import shlex
import shutil
import subprocess
import sys
import time

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
    base = {k: v for k, v in os.environ.items()
            if k not in ("MCORE", "PARTS", "GPU_TESTS", "PART_TIMEOUT", "BUDGET", "PYTEST_ARGS", "BENCH_ARGS")}
    proc = subprocess.run(["bash", str(SCRIPT), *args], env={**base, "WHL": str(whl), "OUT": "/out", **env},
                          capture_output=True, text=True, timeout=60, check=False)
    return proc.returncode, proc.stdout, proc.stderr


def test_plan_lists_the_default_parts_for_every_version(whl):
    rc, out, err = _run(whl, "--plan")
    assert rc == 0, err
    assert "parts: gpu bench logprobs; megatron-core: 0.16.1 0.19.2; part time limit: 540s" in out
    assert "gpu test groups: rl kernels more" in out
    for v in ("0.16.1", "0.19.2"):
        assert f"/tmp/site-{v}" in out
        assert f"--json /out/rl_step_gpu_\\<date\\>_\\<device\\>_mcore-{v}.json" in out
        for group in ("rl", "kernels", "more"):
            assert f"--junitxml /out/gpu_{group}_\\<date\\>_\\<device\\>_mcore-{v}.xml -m not\\ vllm tests/gpu/" in out
    # one pytest per group, in GPU_TESTS' order, then the benchmark
    lines = [line.split(":")[0].strip() for line in out.splitlines() if line.startswith("  ")]
    assert lines == ["gpu rl", "gpu kernels", "gpu more", "bench"] * 2
    assert "tests/unit" not in out
    assert "install 1 peer wheels into /tmp/site-peers" in out and "--device cuda" in out


def test_plan_follows_mcore_parts_and_extra_pytest_arguments(whl):
    rc, out, err = _run(whl, "--plan", MCORE="0.19.2", PARTS="unit gpu", GPU_TESTS="more rl", PART_TIMEOUT="300",
                        BUDGET="570", PYTEST_ARGS="-x -k demo")
    assert rc == 0, err
    assert "megatron-core: 0.19.2; part time limit: 300s (0 = none); call budget: 570s" in out and "0.16.1" not in out
    assert "tests/unit -m not\\ vllm -x -k demo" in out
    assert "test_every_recipe_one_step -x -k demo" in out and "test_resume_continues_like_the_uninterrupted_run -x -k demo" in out
    lines = [line.split(":")[0].strip() for line in out.splitlines() if line.startswith("  ")]
    assert lines == ["unit", "gpu more", "gpu rl"]
    assert "rl_step_gpu" not in out and "logprobs" not in out and "test_logprobs_gpu" not in out


def test_the_log_prob_table_alone_needs_no_megatron_wheels(tmp_path):
    rc, out, err = _run(tmp_path, "--plan", PARTS="logprobs")
    assert rc == 0, err
    assert "megatron-core: none" in out and "install 0 peer wheels" in out


@pytest.mark.parametrize("env, message", [
    ({"PARTS": "gpu tests"}, "PARTS has 'tests'; choose from: unit gpu bench logprobs"),
    ({"GPU_TESTS": "rl resume"}, "GPU_TESTS has 'resume'; choose from: rl kernels more"),
    ({"MCORE": "0.18.0"}, "MCORE has 0.18.0 but there is no"),
    ({"PART_TIMEOUT": "9m"}, "PART_TIMEOUT='9m' is not a whole number of seconds"),
    ({"BUDGET": "-1"}, "BUDGET='-1' is not a whole number of seconds"),
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


def _selected(plan: str) -> dict[str, list[str]]:
    """GPU_TESTS group -> the pytest node ids its command line selects (from a --plan)."""
    groups = {}
    for line in plan.splitlines():
        if line.startswith("  gpu "):
            name, cmd = line.strip()[len("gpu "):].split(":", 1)
            words = shlex.split(cmd)
            groups[name] = [w for w in words if w.startswith("tests/gpu/")]
    return groups


def test_the_gpu_test_groups_select_every_gpu_test_exactly_once(whl):
    """A test added to tests/gpu must go into a GPU_TESTS group, or the GPU check never runs it."""
    rc, out, err = _run(whl, "--plan", MCORE="0.19.2", PARTS="gpu")
    assert rc == 0, err
    groups = _selected(out)
    assert list(groups) == ["rl", "kernels", "more"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/gpu"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    ids = [line for line in proc.stdout.splitlines() if line.startswith("tests/gpu/")]
    assert len(ids) > 20, proc.stdout[-2000:] + proc.stderr[-2000:]

    def picks(selection: str, node: str) -> bool:
        return node == selection or node.startswith((selection + "::", selection + "["))

    for node in ids:
        owners = [g for g, selections in groups.items() if any(picks(s, node) for s in selections)]
        assert len(owners) == 1, (node, owners)
    for group, selections in groups.items():   # and no selection that matches nothing (a renamed test)
        for selection in selections:
            assert any(picks(selection, node) for node in ids), (group, selection)
    # the first group holds the first evidence: an RL run per dtype, R3 and resume
    rl = [node for node in ids if any(picks(s, node) for s in groups["rl"])]
    assert {"test_demo_short[fp32]", "test_demo_short[bf16]", "test_demo_short[fp16]", "test_router_replay[r3]",
            "test_resume_continues_like_the_uninterrupted_run"} == {node.split("::")[-1] for node in rl}


FAKE_PYTHON = r"""#!/usr/bin/env bash
# a stand-in for python3: pip installs create the target, the environment check passes, pytest
# sleeps (group rl: until stopped; it says so on SIGINT, as pytest prints its summary), the rest pass
case "$1 $2" in
    "-m pip") shift; while [ "$1" != "--target" ]; do shift; done; mkdir -p "$2"; echo "pip install" >> "$FAKE_LOG" ;;
    "- ") cat > /dev/null; echo "python 3.12 (stand-in)" ;;
    "-m pytest")
        if [[ "$*" == *test_demo_short* ]]; then
            sleep 30 &   # in the background (bash starts it with SIGINT ignored): the trap ends it
            trap 'kill $!; echo "pytest: interrupted: 3 passed, 1 failed"; exit 2' INT
            wait $!
        fi
        echo "pytest: 4 passed" ;;
    *) echo "ran: $*" ;;
esac
"""


def _fake_machine(tmp_path):
    """PATH with an nvidia-smi stand-in, a Python stand-in, a wheel folder of a version of its own."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text('#!/usr/bin/env bash\ncase "$*" in -L) echo "GPU 0: Stand-in H100" ;; *memory*) echo "Stand-in H100, 81559 MiB, 0 MiB" ;;'
                   ' *) echo "Stand-in H100" ;; esac\n')
    python = bin_dir / "python-stand-in"
    python.write_text(FAKE_PYTHON)
    for f in (smi, python):
        f.chmod(0o755)
    version = f"test-{os.getpid()}-{time.monotonic_ns()}"   # /tmp/site-<version>: this test's own
    whl = tmp_path / "whl"
    for sub in (f"mcore-{version}", "common"):
        (whl / sub).mkdir(parents=True)
    (whl / f"mcore-{version}" / "megatron_core-x.whl").write_text("x")
    (whl / "common" / "psutil-x.whl").write_text("y")
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": str(python), "FAKE_LOG": str(tmp_path / "pip.log")}
    return whl, version, env


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine would run the check for real")
def test_a_part_over_its_time_limit_is_interrupted_and_the_check_goes_on(tmp_path):
    whl, version, env = _fake_machine(tmp_path)
    out_dir = tmp_path / "out"
    try:
        start = time.monotonic()
        rc, out, err = _run(whl, MCORE=version, PARTS="gpu bench", GPU_TESTS="rl more", PART_TIMEOUT="2",
                            OUT=str(out_dir), **env)
        assert time.monotonic() - start < 25   # not the stand-in's 30 s: stopped at 2 s
        assert rc == 1, out + err
        assert "pytest: interrupted: 3 passed, 1 failed" in out   # SIGINT: pytest's summary is printed
        assert f"--- gpu rl mcore-{version}: stopped at its time limit (2s)" in out
        assert "pytest: 4 passed" in out and "ran: benchmarks/rl_step_gpu.py" in out   # the next parts ran
        assert f"gpu_check: FAILED: gpu rl mcore-{version} (time limit)" in out
        assert "Filesystem" in out   # df -h in the environment block
        log = next(out_dir.glob(f"gpu_check_*_Stand-in-H100_mcore-{version}.log")).read_text()
        assert "pytest: interrupted" in log and "stopped at its time limit" in log
        assert (tmp_path / "pip.log").read_text().count("pip install") == 1

        # the next call: the same wheels, so the install is kept; BUDGET leaves no room for any part
        rc, out, err = _run(whl, MCORE=version, PARTS="gpu bench", GPU_TESTS="more", BUDGET="90", OUT=str(out_dir), **env)
        assert rc == 1, out + err
        assert "is installed from the same wheels; kept" in out + "".join(p.read_text() for p in out_dir.glob("*.log"))
        assert (tmp_path / "pip.log").read_text().count("pip install") == 1
        assert f"--- gpu more mcore-{version}: not started" in out
        assert f"FAILED: gpu more mcore-{version} (not started: budget) bench mcore-{version} (not started: budget)" in out
    finally:
        shutil.rmtree(f"/tmp/site-{version}", ignore_errors=True)
