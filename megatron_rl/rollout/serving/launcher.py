"""Start, watch and stop an inference server of any kind (its command line and health path: its
dialect, serving/dialect.py), or connect to a running one.

    server = LocalServer(python, flags, env, log_path="runs/x/vllm/server.log", dialect=VLLM_DIALECT,
                         pythonpath=[plugin_dir], key_env=["MEGATRON_RL_VLLM_API_KEY", "VLLM_API_KEY"])
    server.start(model_dir)          # child process on 127.0.0.1:<free port>; waits for dialect.health_path
    server.alive(); server.restart(new_model_dir); server.stop()
    request_json(server.url + dialect.generate_path, body, api_key=server.api_key)

What is the server kind's own comes in from its engine: the interpreter of its environment, its
flags (dialect.server_flags), its environment, the folders its server-side code is imported from
(`pythonpath`) and the environment variables that carry the key (`key_env`). vLLM's: rollout/vllm/
env.py.

Access. Every server we launch gets a fresh random key (`server.api_key`, secrets.token_urlsafe)
and refuses any request, on any path, without `Authorization: Bearer <key>` (HTTP 401): the kind
guards every path with its own code (vLLM: its --api-key check covers only /v1, /v2, /inference and
/cohere, not the development endpoints that in-place weight sync needs, so its server also loads the
middleware server_plugin/megatron_rl_vllm_auth.py). The key reaches the child through its
environment (`key_env`; vLLM's MEGATRON_RL_VLLM_API_KEY and VLLM_API_KEY), never its command line
(which `ps` shows to every user) or the log. The server listens on 127.0.0.1 only.

Ports. The port is chosen by binding port 0, and that socket stays bound (SO_REUSEADDR, not
listening) until the server is healthy: the kernel then hands the port to no other process that
asks for any free port or opens a connection, while a server that binds with SO_REUSEADDR (vLLM
does) still can. A start that fails with "address already in use" anyway is retried on a new port, the last
time without the reservation (for a server that binds without SO_REUSEADDR).

The child runs in its own process group (so a stop takes its helper processes with it: vLLM's engine core)
and gets SIGTERM from the kernel if the thread that launched it dies (PR_SET_PDEATHSIG, set in
a two-line exec wrapper: no preexec_fn, which is unsafe with threads). The kernel ties that
signal to the thread that forked, not to the process, and a server may be (re)started from a
thread that ends soon after (the async schedule generates, and the client restarts a failed
server, on a thread per batch), so every server is forked by one daemon launcher thread that
lives as long as the process: a server dies with the trainer, never with the thread that asked
for it. Servers still running when the trainer exits are stopped by an atexit hook and, if the
process gets SIGTERM, by a signal handler that then re-delivers the signal; Ctrl-C unwinds
through KeyboardInterrupt into both. Every start appends the server's output to `log_path`
under a header line.

Cost: per server, one child process, one health request per check and a log file that grows with
its output; the process-wide state is one launcher thread and the set of live children.
"""
from __future__ import annotations

import atexit
import os
import queue
import secrets
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TypeVar

from megatron_rl.fs import open_no_follow
from megatron_rl.rollout.serving.dialect import Dialect
from megatron_rl.rollout.serving.errors import ServerDiedError, ServerStartError
from megatron_rl.rollout.serving.http import HttpStatusError, TransportError, healthy, request_json

HOST = "127.0.0.1"
SERVED_MODEL_NAME = "policy"

# ---- reaping servers on exit (the one piece of process-wide state: atexit and signals are) ----
_LIVE: dict[int, subprocess.Popen] = {}
_LOCK = threading.Lock()
_HANDLERS_INSTALLED = False


def _kill_group(proc: subprocess.Popen, term_timeout: float = 20.0) -> None:
    """SIGTERM the process group led by `proc`, SIGKILL it after `term_timeout` s (0: at once), reap it."""
    if proc.poll() is None and term_timeout > 0:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            os.killpg(proc.pid, signal.SIGCONT)  # a stopped (hung) server must run to handle SIGTERM
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=term_timeout)
        except subprocess.TimeoutExpired:
            pass
    try:  # whatever is left of the group (vLLM's engine core), even after the leader exited
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _stop_all() -> None:
    with _LOCK:
        procs = list(_LIVE.values())
        _LIVE.clear()
    for proc in procs:
        _kill_group(proc, term_timeout=10.0)


def _on_sigterm(signum, frame):
    _stop_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install_reaping() -> None:
    """The atexit hook and, called from the main thread (the only one that may set it), the
    SIGTERM handler; once per process."""
    global _HANDLERS_INSTALLED
    with _LOCK:
        if not _HANDLERS_INSTALLED:
            atexit.register(_stop_all)
            if threading.current_thread() is threading.main_thread() and \
                    signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
                signal.signal(signal.SIGTERM, _on_sigterm)
            _HANDLERS_INSTALLED = True


def _track(proc: subprocess.Popen) -> None:
    with _LOCK:
        _LIVE[proc.pid] = proc


def _untrack(proc: subprocess.Popen) -> None:
    with _LOCK:
        _LIVE.pop(proc.pid, None)


def free_port() -> int:
    """A port free right now (another process may take it before it is used: see reserve_port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def reserve_port() -> socket.socket:
    """A socket bound to a free port of HOST with SO_REUSEADDR and not listening: while it stays
    open, no other process gets that port from bind(0) or for an outgoing connection, but a
    server that binds it with SO_REUSEADDR (vLLM, http.server) can. Close it once that server
    listens."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((HOST, 0))
    except BaseException:
        s.close()
        raise
    return s


# ---- the launcher thread: the one thread that forks servers ------------------------------------
T = TypeVar("T")


class _LauncherThread:
    """A daemon thread that runs the jobs given to `call` one at a time and never ends before
    its process: the thread PR_SET_PDEATHSIG ties our servers to (see the module docstring)."""

    def __init__(self):
        self.pid = os.getpid()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name="server-launcher", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            future, job = self._jobs.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(job())
                except BaseException as e:  # noqa: BLE001 - handed to the caller, who raises it
                    future.set_exception(e)

    def call(self, job: Callable[[], T]) -> T:
        """job() on the launcher thread; its result or its exception, here."""
        if threading.current_thread() is self.thread:
            return job()
        future: Future = Future()
        self._jobs.put((future, job))
        return future.result()


_LAUNCHER: _LauncherThread | None = None


def _launcher() -> _LauncherThread:
    """The process's launcher thread, started on first use (anew in a forked child, which has
    none of its parent's threads)."""
    global _LAUNCHER
    with _LOCK:
        if _LAUNCHER is None or _LAUNCHER.pid != os.getpid():
            _LAUNCHER = _LauncherThread()
        return _LAUNCHER


def _popen_logged(cmd: list[str], env: dict[str, str], log_path: str, header: str) -> subprocess.Popen:
    """Start `cmd` in a new session, its output appended to `log_path` after `header`, and track
    it for the exit reaping. Runs on the launcher thread, start to finish: a caller interrupted
    while it waits (Ctrl-C) neither closes the log under Popen nor loses the server, which the
    exit reaping still stops."""
    with open_no_follow(log_path, "ab") as log:   # a link planted at the name is not followed
        log.write(header.encode())
        log.flush()
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    _track(proc)
    return proc


# Runs in the child before the server's code: die with the launcher thread (that is, with our process), and not
# at all if it is gone.
_EXEC_WRAPPER = (
    "import ctypes, os, signal, sys\n"
    "try: ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG\n"
    "except Exception: pass\n"
    "if os.getppid() != int(sys.argv[1]): sys.exit(3)\n"
    "os.execv(sys.executable, [sys.executable] + sys.argv[2:])\n"
)


class LocalServer:
    """A server we launch and own.

    python: the server environment's interpreter. args: its flags after the model and port
    (dialect.server_flags). env: the child's extra environment. log_path: output of every start.
    dialect: the server kind (serving/dialect.py): its command line and health path.
    pythonpath: folders put first on the child's PYTHONPATH (the kind's server-side code; vLLM's
    server_plugin/). key_env: the environment variables the child finds its key in.
    api_key: a fresh random key per LocalServer (kept across restarts); send it with every
    request (`http.request(..., api_key=server.api_key)`). Never logged.
    """

    can_restart = True
    model_name = SERVED_MODEL_NAME

    def __init__(self, python: str, args: list[str], env: dict[str, str], log_path: str,
                 startup_timeout_s: float = 600.0, health_timeout_s: float = 10.0, *, dialect: Dialect,
                 pythonpath: Sequence[str] = (), key_env: Sequence[str] = ()):
        self.python, self.args, self.env = python, list(args), dict(env)
        self.dialect = dialect
        self.pythonpath, self.key_env = list(pythonpath), list(key_env)
        self.log_path = log_path
        self.startup_timeout_s, self.health_timeout_s = startup_timeout_s, health_timeout_s
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.model_dir: str | None = None
        self.starts = 0
        self.api_key = secrets.token_urlsafe(32)

    def __repr__(self) -> str:  # no key in it
        return f"LocalServer(url={self.url!r}, pid={self.pid}, log_path={self.log_path!r})"

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def command(self, model_dir: str, port: int) -> list[str]:
        return [self.python, *self.dialect.server_argv(model_dir, SERVED_MODEL_NAME, HOST, port, self.args)]

    def start(self, model_dir: str) -> float:
        """Launch on `model_dir` and wait until healthy; seconds it took. Raises ServerStartError."""
        if self.proc is not None:
            raise RuntimeError("server already started; use restart()")
        t0 = time.perf_counter()
        for attempt in range(3):
            # the port stays reserved until the server is healthy; the last try goes without the
            # reservation, for a server that binds without SO_REUSEADDR
            holder = reserve_port() if attempt < 2 else None
            try:
                self.port = holder.getsockname()[1] if holder is not None else free_port()
                self._spawn(model_dir)
                self._wait_healthy(t0)
                break
            except ServerStartError as e:
                if attempt == 2 or "address already in use" not in str(e).lower():
                    raise
            finally:
                if holder is not None:
                    holder.close()
        self.model_dir = model_dir
        return time.perf_counter() - t0

    def restart(self, model_dir: str) -> float:
        self.stop()
        return self.start(model_dir)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and \
            healthy(self.url, self.health_timeout_s, self.api_key, self.dialect.health_path)

    def stop(self, graceful: bool = True) -> None:
        """SIGTERM the server's process group (SIGKILL after 20 s); graceful=False: SIGKILL at once
        (a dead or hung server has nothing to finish)."""
        proc, self.proc = self.proc, None
        if proc is not None:
            _kill_group(proc, term_timeout=20.0 if graceful else 0.0)
            _untrack(proc)

    # ---- internals ----------------------------------------------------------------------------
    def _spawn(self, model_dir: str) -> None:
        cmd = self.command(model_dir, self.port)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        env.update(self.env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (*self.pythonpath, env.get("PYTHONPATH")) if p)
        for name in self.key_env:  # the environment: not visible to `ps`
            env[name] = self.api_key
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        self.starts += 1
        header = f"\n===== start {self.starts} at {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(cmd)}\n"
        wrapped = [self.python, "-c", _EXEC_WRAPPER, str(os.getpid()), *cmd[1:]]
        _install_reaping()  # here, not on the launcher thread: the SIGTERM handler needs the main thread
        self.proc = _launcher().call(lambda: _popen_logged(wrapped, env, self.log_path, header))

    def _wait_healthy(self, t0: float) -> None:
        while True:
            if self.proc.poll() is not None:
                rc = self.proc.returncode
                self.stop()
                raise ServerStartError(f"{self.dialect.name} server exited with code {rc} during start-up; log "
                                       f"{self.log_path}:\n{self.log_tail()}")
            if healthy(self.url, timeout=self.health_timeout_s, api_key=self.api_key, path=self.dialect.health_path):
                return
            if time.perf_counter() - t0 > self.startup_timeout_s:
                self.stop()
                raise ServerStartError(f"{self.dialect.name} server not healthy after {self.startup_timeout_s:g} s; log "
                                       f"{self.log_path}:\n{self.log_tail()}")
            time.sleep(0.5)

    @property
    def log_where(self) -> str:
        return self.log_path

    def log_tail(self, lines: int = 25) -> str:
        try:
            with open_no_follow(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - 400 * lines))
                return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class RemoteServer:
    """A server someone else runs at `url`, started as its kind needs (vLLM's: --skip-tokenizer-init,
    --enable-scale-out for the token-in/token-out endpoint the requests use, VLLM_SERVER_DEV_MODE=1
    for in-place weight sync; docs/config.md, rollout.vllm.url). `api_key` goes with every request.
    kind: how messages name the server kind (dialect.name); key_hint: where its key is set (vLLM's:
    "rollout.vllm.api_key or $MEGATRON_RL_VLLM_API_KEY"). We never restart it: if it dies, that is
    an error."""

    can_restart = False

    def __init__(self, url: str, health_timeout_s: float = 10.0, model_name: str | None = None,
                 api_key: str | None = None, health_path: str = "/health", kind: str = "inference",
                 key_hint: str = "its API key"):
        self.url = url.rstrip("/")
        self.health_path = health_path
        self.kind, self.key_hint = kind, key_hint
        self.health_timeout_s = health_timeout_s
        self.model_name = model_name
        self.model_dir: str | None = None
        self.api_key = api_key or None

    def __repr__(self) -> str:  # no key in it
        return f"RemoteServer(url={self.url!r})"

    @property
    def log_where(self) -> str:
        return self.url

    def log_tail(self, lines: int = 25) -> str:
        return ""  # its output is its operator's

    def start(self, model_dir: str) -> float:
        t0 = time.perf_counter()
        try:
            request_json(self.url + self.health_path, timeout=self.health_timeout_s, api_key=self.api_key)
            if self.model_name is None:
                models = request_json(self.url + "/v1/models", timeout=self.health_timeout_s, api_key=self.api_key)
                try:
                    self.model_name = models["data"][0]["id"]
                except (TypeError, KeyError, IndexError):
                    raise ServerStartError(f"{self.url}/v1/models lists no model: {models!r:.200}") from None
        except HttpStatusError as e:
            if e.status in (401, 403):
                given = "the API key we sent" if self.api_key else "a request without an API key"
                raise ServerStartError(f"the {self.kind} server at {self.url} refused {given} (HTTP {e.status}): "
                                       f"set {self.key_hint} to its key") from None
            raise ServerStartError(f"no healthy {self.kind} server at {self.url}: {e}") from None
        except (TransportError, ValueError) as e:
            raise ServerStartError(f"no healthy {self.kind} server at {self.url}: {e}") from None
        return time.perf_counter() - t0

    def restart(self, model_dir: str) -> float:
        raise ServerDiedError(f"the {self.kind} server at {self.url} is not answering and was not launched by "
                              f"us, so it cannot be restarted")

    def alive(self) -> bool:
        return healthy(self.url, self.health_timeout_s, self.api_key, self.health_path)

    def stop(self, graceful: bool = True) -> None:
        pass
