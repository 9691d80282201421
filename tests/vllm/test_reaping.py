"""A real vLLM server's whole process group (API server, engine core, its worker, the resource
tracker) is gone once the trainer that launched it is SIGKILLed: nothing of the trainer runs; the
kernel sends the API server SIGTERM through PR_SET_PDEATHSIG and vLLM takes its engine core down.
SIGTERM with a real server is test_trainer_loop.py's test_sigterm_mid_run_leaves_no_server_process
(pretrain_rl.py itself, the same production layout); exits, Ctrl-C and the handlers' details are
covered with a stand-in server in test_launcher.py.

The "trainer" is a child process that starts the engine the way the trainer does
(the `disk` transport's write and VllmEngine.load_weights_from) and prints the server's pid once it is up: the test waits for that
line, not for a time."""
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.vllm.test_launcher import DEADLINE, group

pytestmark = pytest.mark.vllm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAINER = """
import signal, sys
sys.path.insert(0, {root!r})
from megatron_rl.rollout.vllm import VllmConfig, VllmEngine
from tests.vllm.conftest import push, hf_weights, tiny_arch

arch = tiny_arch()
cfg = VllmConfig(python={python!r}, dtype="float32", max_model_len=128, warmup=False, probe_every=0)
engine = VllmEngine(arch, cfg, {run_dir!r}, weight_sync="reload")
push(engine, hf_weights(arch, seed=0)[1], 0)
print(engine.server.pid, flush=True)
signal.pause()
"""


def test_the_servers_process_group_dies_with_a_killed_trainer(vllm_python, tmp_path):
    sig = signal.SIGKILL
    code = TRAINER.format(root=ROOT, python=vllm_python, run_dir=str(tmp_path / "run"))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    trainer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    pid = None
    try:
        line = trainer.stdout.readline()  # the event: the server is up
        assert line.strip(), f"the trainer ended before its server was up (exit code {trainer.wait()})"
        pid = int(line)
        members = group(pid)
        assert pid in members and len(members) >= 2, members  # the API server and its engine core at least
        trainer.send_signal(sig)
        assert trainer.wait(timeout=DEADLINE) == -sig
        deadline = time.monotonic() + DEADLINE
        while group(pid):
            assert time.monotonic() < deadline, f"still alive {DEADLINE:g} s after the trainer ended: {group(pid)}"
            time.sleep(0.1)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        if pid is not None:
            for p in group(pid):  # never leave a server behind, even when the test failed
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
